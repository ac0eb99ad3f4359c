//! What the agent persists about shares and claims, and how it is encoded.
//!
//! Values are a one-byte format version followed by JSON. JSON keeps a node's store
//! readable with standard tools during an incident; the version byte lets a later agent
//! refuse, rather than misread, a record it does not understand.

use std::{collections::BTreeMap, num::NonZeroU64};

use serde::{Deserialize, Serialize};
use shareguard_common::Quantity;

use crate::{amounts::Amounts, error::ClaimError};

/// Value formats. Bump the one a record is written in, and teach `decode` the old one,
/// when a field changes meaning; adding an optional field with a serde default needs no
/// bump. Format 1: every record. Format 2: the same JSON, written for share records since
/// the store stopped keeping an index record for every claim (see `store`): an agent
/// that knows only format 1 would find those shares without their claim's index and
/// could not release them, so it quarantines them instead, which keeps what they hold
/// reserved and lets an Unprepare of their claim release them.
pub const FORMAT_V1: u8 = 1;
pub const FORMAT_V2: u8 = 2;

/// The largest encoded value the store accepts. sled 0.34 writes a value larger than a
/// quarter of a log segment (512 KiB by default, so about 128 KiB) to a blob file of its
/// own, which its flush does not fsync: a record that large could be acknowledged and
/// lost. Every field a record keeps is bounded (request validation, the config, and
/// [`bound_text`] for what limiters say), so a record stays far below this; the store
/// refuses anything above it rather than write it unsynced.
pub const MAX_RECORD_BYTES: usize = 48 * 1024;

/// Longest reason or error message a record keeps.
pub const MAX_TEXT_BYTES: usize = 2048;

/// `s` cut to [`MAX_TEXT_BYTES`] on a character boundary, marked as cut.
pub fn bound_text(s: &mut String) {
    if s.len() <= MAX_TEXT_BYTES {
        return;
    }
    let mut end = MAX_TEXT_BYTES - 3;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str("...");
}

/// A name a record keeps (namespace, driver, pool, device, request, mechanism, ...):
/// stored inline when it is at most 24 bytes, as such names nearly always are, else on
/// the heap like a `String`. With 100,000 live shares, an allocation of its own for
/// each of a record's dozen names was a tenth of the agent's memory. Encoded as a plain
/// JSON string.
pub type Name = compact_str::CompactString;

/// Why a share is in its phase, as its status says. Most records that stay long say one
/// of a few fixed sentences (an accounting share's, a released share's tombstone): those
/// share one copy (see [`reasons`]) instead of a copy of their own on the heap, also
/// when read back from the store. Reference-counted rather than a `Cow` of a static
/// sentence or a `String`: 16 bytes in every record rather than 24. Encoded as a plain
/// JSON string.
pub type Reason = std::sync::Arc<str>;

/// The fixed reasons a decoded record shares (see [`Reason`]).
pub mod reasons {
    pub const ACCOUNTED: &str = "accounted (not enforced): the device has no enforcement mechanism";
    pub const ADMITTED: &str = "admitted; applying the limit";
    pub const RELEASING: &str = "release in progress";
    pub const RELEASED: &str = "released";
    pub(super) const ALL: [&str; 4] = [ACCOUNTED, ADMITTED, RELEASING, RELEASED];
}

/// The one copy of each fixed reason that records share.
static FIXED_REASONS: std::sync::LazyLock<[Reason; 4]> =
    std::sync::LazyLock::new(|| reasons::ALL.map(Reason::from));

/// The shared copy of `text`, when it is one of the fixed reasons.
pub fn fixed_reason(text: &str) -> Option<&'static Reason> {
    FIXED_REASONS.iter().find(|r| ***r == *text)
}

/// `reason` as a record keeps it: one of the fixed sentences shared, any other cut to
/// [`MAX_TEXT_BYTES`].
pub fn bounded_reason(reason: Reason) -> Reason {
    if reason.len() > MAX_TEXT_BYTES {
        let mut text = reason.to_string();
        bound_text(&mut text);
        return text.into();
    }
    match fixed_reason(&reason) {
        Some(fixed) => fixed.clone(),
        None => reason,
    }
}

fn reason_from_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Reason, D::Error> {
    let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
    Ok(fixed_reason(&text).map_or_else(|| Reason::from(&*text), Reason::clone))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    Preparing,
    Enforced,
    Accounted,
    Degraded,
    Failed,
    Unknown,
    Releasing,
    Released,
    /// Admitted and durable, waiting for the pod's sandbox (see `TargetRecord`).
    Pending,
    /// The device is in the rollout's `observe` stage: admitted, counted and its pod
    /// found, nothing limited.
    Observed,
}

impl Phase {
    pub const ALL: [Phase; 10] = [
        Phase::Preparing,
        Phase::Pending,
        Phase::Enforced,
        Phase::Observed,
        Phase::Accounted,
        Phase::Degraded,
        Phase::Failed,
        Phase::Unknown,
        Phase::Releasing,
        Phase::Released,
    ];

    /// Every phase but FAILED and RELEASED holds its capacity: capacity is never freed
    /// implicitly, only by a completed release or a failed (never acknowledged) prepare.
    pub fn holds_capacity(self) -> bool {
        !matches!(self, Phase::Failed | Phase::Released)
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Preparing => "PREPARING",
            Phase::Enforced => "ENFORCED",
            Phase::Accounted => "ACCOUNTED",
            Phase::Degraded => "DEGRADED",
            Phase::Failed => "FAILED",
            Phase::Unknown => "UNKNOWN",
            Phase::Releasing => "RELEASING",
            Phase::Released => "RELEASED",
            Phase::Pending => "PENDING",
            Phase::Observed => "OBSERVED",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimId {
    pub uid: String,
    pub namespace: Name,
    pub name: Name,
}

/// The pods a share belongs to, and the caller's hints as the agent verified them at
/// admission. Nothing here is a place to act on: the agent finds each pod's sandbox
/// itself (`SandboxRecord`).
///
/// Stored as one JSON object with the fields `pod_uids`, `cgroup_paths`, `netns_inode`
/// and `interface`, each left out when absent (see [`TargetOut`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(from = "RawTarget")]
pub struct TargetRecord {
    pub pod_uids: Vec<String>,
    /// Boxed: the kubelet plugin sends no hints, so nearly every share has none, and a
    /// record is kept in memory for every live share (8 bytes instead of 64).
    hints: Option<Box<TargetHints>>,
}

/// What a caller may add to the pods: verified at admission, kept as verified.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetHints {
    /// cgroup hints, relative to the cgroup v2 mount, each verified to be a pod's cgroup
    /// or below it.
    pub cgroup_paths: Vec<String>,
    /// A network namespace hint, resolved once at admission and kept by inode (a
    /// `/proc/<pid>/ns/net` path is never looked up again: pids are reused).
    pub netns_inode: Option<u64>,
    /// The pod's interface inside its namespace; `eth0` when unset.
    pub interface: Option<String>,
}

impl TargetRecord {
    pub fn new(pod_uids: Vec<String>, hints: TargetHints) -> Self {
        let hints = (hints != TargetHints::default()).then(|| Box::new(hints));
        TargetRecord { pod_uids, hints }
    }

    pub fn cgroup_paths(&self) -> &[String] {
        self.hints.as_ref().map_or(&[], |h| &h.cgroup_paths)
    }

    pub fn netns_inode(&self) -> Option<u64> {
        self.hints.as_ref().and_then(|h| h.netns_inode)
    }

    pub fn interface(&self) -> Option<&str> {
        self.hints.as_ref().and_then(|h| h.interface.as_deref())
    }

    /// Replaces the hints, as the admission verified them.
    pub fn set_verified(&mut self, netns_inode: Option<u64>, cgroup_paths: Vec<String>) {
        let interface = self.hints.take().and_then(|h| h.interface);
        self.hints = TargetRecord::new(
            Vec::new(),
            TargetHints {
                cgroup_paths,
                netns_inode,
                interface,
            },
        )
        .hints;
    }
}

/// A target as it is stored: the same JSON as when the hints were fields of their own.
#[derive(Serialize)]
struct TargetOut<'a> {
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pod_uids: &'a [String],
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    cgroup_paths: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    netns_inode: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    interface: Option<&'a str>,
}

impl Serialize for TargetRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        TargetOut {
            pod_uids: &self.pod_uids,
            cgroup_paths: self.cgroup_paths(),
            netns_inode: self.netns_inode(),
            interface: self.interface(),
        }
        .serialize(s)
    }
}

/// [`TargetRecord`] as any format version stored it: records written before pods were
/// discovered named one `pod_uid` and a `netns_path`, which is dropped (the sandbox is
/// found again).
#[derive(Deserialize)]
struct RawTarget {
    #[serde(default)]
    pod_uids: Vec<String>,
    #[serde(default)]
    pod_uid: String,
    #[serde(default)]
    cgroup_paths: Vec<String>,
    #[serde(default)]
    netns_inode: Option<u64>,
    #[serde(default)]
    interface: Option<String>,
}

impl From<RawTarget> for TargetRecord {
    fn from(r: RawTarget) -> Self {
        let mut pod_uids = r.pod_uids;
        if pod_uids.is_empty() && !r.pod_uid.is_empty() {
            pod_uids.push(r.pod_uid);
        }
        TargetRecord::new(
            pod_uids,
            TargetHints {
                cgroup_paths: r.cgroup_paths,
                netns_inode: r.netns_inode,
                interface: r.interface,
            },
        )
    }
}

/// The pod sandbox a share was last enforced on, as discovery found it. Kept so that a
/// restarted agent, and every rescan, can tell a sandbox that is still there from one
/// that went away or was replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub pod_uid: String,
    /// The pod's cgroup, relative to the cgroup v2 mount.
    pub cgroup: String,
    /// Its directory's inode: a pod cgroup removed and made again is another sandbox.
    pub cgroup_inode: u64,
    /// The cgroups a cgroup limit is put on (relative to the mount): the pod's, or those
    /// below it that a verified hint named.
    #[serde(default)]
    pub cgroups: Vec<String>,
    /// The pod's network namespace, when the share needs the network.
    #[serde(default)]
    pub netns_inode: Option<u64>,
    #[serde(default)]
    pub host_ifindex: Option<u32>,
    #[serde(default)]
    pub host_ifname: Option<Name>,
}

/// One allocation result of a claim as the agent holds it. Stored as the JSON object
/// [`ShareOut`] writes.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ShareRecord {
    /// Store key: the shareID, or `dedicated/<claim uid>/<device>` for a dedicated allocation.
    pub key: String,
    /// A share of a device, whose shareID is its key, rather than a whole device. Kept
    /// as a flag rather than a second copy of the key: every live share's record is in
    /// memory. Stored as `share_id`, the key or absent, as every version reads it.
    #[serde(
        rename = "share_id",
        default,
        deserialize_with = "shared_from_share_id"
    )]
    pub shared: bool,
    pub claim: ClaimId,
    pub allocation_id: Name,
    pub request: Name,
    pub driver: Name,
    pub pool: Name,
    pub device: Name,
    pub consumed: Amounts,
    pub policy_version: Name,
    pub admin_access: bool,
    pub target: TargetRecord,
    pub phase: Phase,
    pub mechanism: Name,
    /// Limits read back from the kernel or driver; empty when nothing enforces the share.
    pub enforced: Amounts,
    #[serde(deserialize_with = "reason_from_text")]
    pub reason: Reason,
    /// Boxed, as with `sandbox`: most records have none, and a record is kept in memory
    /// for every live share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Box<ClaimError>>,
    pub epoch: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// 8 bytes rather than 16: no share is released at the epoch's first millisecond
    /// (a stored 0 reads as unknown, and the update time stands in, as for none).
    #[serde(default, deserialize_with = "nonzero_ms")]
    pub released_at_ms: Option<NonZeroU64>,
    /// The sandbox the share is enforced on; None while it waits for one or needs none.
    /// With several pods of the claim running here, the first of them by pod uid.
    /// Boxed: a share that needs no sandbox, or waits for one, then pays 8 bytes for it
    /// instead of 128, and one that has one pays 8 more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Box<SandboxRecord>>,
    /// The sandboxes of the claim's other pods running here: one limit holds them all
    /// together with `sandbox`'s. Empty in records written before it was kept.
    /// Boxed, and only when there are any: one pod of a claim per node is the rule, so
    /// nearly every record pays 8 bytes for this instead of an empty vector's 24.
    #[serde(default, deserialize_with = "boxed_unless_empty")]
    #[allow(clippy::box_collection)]
    pub more_sandboxes: Option<Box<Vec<SandboxRecord>>>,
    /// The device's kind when the share was admitted ("generic", "net", "gpu"), so a
    /// config that changes it under live shares is caught at start. Empty in records
    /// written before it was kept.
    #[serde(default)]
    pub device_kind: Name,
    /// When the share's `Enforced` condition last took its status (True while ENFORCED,
    /// False otherwise): its `lastTransitionTime` in the claim's `status.devices`, which
    /// by the API's conventions moves only when the status flips, not with every
    /// reason or message. 0 in records written before it was kept.
    #[serde(default)]
    pub condition_since_ms: u64,
    /// Stands for a stored record this agent could not read (see `store`'s
    /// quarantine): what is known of it was salvaged, the rest is empty. Absent from
    /// every record written for a share that was read whole.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub quarantined: bool,
    /// RELEASING because a failed Prepare's roll-back could not remove what it had
    /// installed: the reconciler retries the removal, and the share ends FAILED (with
    /// its claim's error) once it succeeds. Capacity stays held until then.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rolling_back: bool,
    /// Admitted by the kubelet plugin's binding gate for a pod the scheduler had not
    /// bound yet, and not prepared by kubelet since (its Prepare clears it). The plugin
    /// releases such a share when its claim loses the allocation before any kubelet
    /// prepared it; no other share is ever released without kubelet's Unprepare.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pre_bind: bool,
}

fn nonzero_ms<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<NonZeroU64>, D::Error> {
    Ok(Option::<u64>::deserialize(d)?.and_then(NonZeroU64::new))
}

// A boxed vector on purpose: see `ShareRecord::more_sandboxes`.
#[allow(clippy::box_collection)]
fn boxed_unless_empty<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Box<Vec<SandboxRecord>>>, D::Error> {
    let v = Vec::<SandboxRecord>::deserialize(d)?;
    Ok((!v.is_empty()).then(|| Box::new(v)))
}

/// A stored `share_id` says the allocation is a share. Any record this or an earlier
/// version wrote has it equal to its key; the key, which is what the store and every
/// lookup go by, is what a share's id is taken from.
fn shared_from_share_id<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Ok(Option::<serde::de::IgnoredAny>::deserialize(d)?.is_some())
}

/// A share record as it is stored: the fields of [`ShareRecord`], each under its own
/// name, with `share_id` written out from the key. Listed here, and filled by
/// destructuring, so that a field added to the record fails to compile until it is
/// stored too.
#[derive(Serialize)]
struct ShareOut<'a> {
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    share_id: Option<&'a str>,
    claim: &'a ClaimId,
    allocation_id: &'a Name,
    request: &'a Name,
    driver: &'a Name,
    pool: &'a Name,
    device: &'a Name,
    consumed: &'a Amounts,
    policy_version: &'a Name,
    admin_access: bool,
    target: &'a TargetRecord,
    phase: Phase,
    mechanism: &'a Name,
    enforced: &'a Amounts,
    reason: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a ClaimError>,
    epoch: u64,
    created_at_ms: u64,
    updated_at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    released_at_ms: Option<NonZeroU64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sandbox: Option<&'a SandboxRecord>,
    #[serde(skip_serializing_if = "<[SandboxRecord]>::is_empty")]
    more_sandboxes: &'a [SandboxRecord],
    device_kind: &'a Name,
    condition_since_ms: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    quarantined: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    rolling_back: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pre_bind: bool,
}

impl Serialize for ShareRecord {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let ShareRecord {
            key,
            shared,
            claim,
            allocation_id,
            request,
            driver,
            pool,
            device,
            consumed,
            policy_version,
            admin_access,
            target,
            phase,
            mechanism,
            enforced,
            reason,
            error,
            epoch,
            created_at_ms,
            updated_at_ms,
            released_at_ms,
            sandbox,
            more_sandboxes,
            device_kind,
            condition_since_ms,
            quarantined,
            rolling_back,
            pre_bind,
        } = self;
        ShareOut {
            key,
            share_id: shared.then_some(key.as_str()),
            claim,
            allocation_id,
            request,
            driver,
            pool,
            device,
            consumed,
            policy_version,
            admin_access: *admin_access,
            target,
            phase: *phase,
            mechanism,
            enforced,
            reason,
            error: error.as_deref(),
            epoch: *epoch,
            created_at_ms: *created_at_ms,
            updated_at_ms: *updated_at_ms,
            released_at_ms: *released_at_ms,
            sandbox: sandbox.as_deref(),
            more_sandboxes: more_sandboxes.as_deref().map_or(&[], Vec::as_slice),
            device_kind,
            condition_since_ms: *condition_since_ms,
            quarantined: *quarantined,
            rolling_back: *rolling_back,
            pre_bind: *pre_bind,
        }
        .serialize(s)
    }
}

impl crate::keyed::Keyed for ShareRecord {
    fn key(&self) -> &str {
        &self.key
    }
}

impl ShareRecord {
    /// Every sandbox the share is enforced on, the first one first.
    pub fn sandboxes(&self) -> Vec<SandboxRecord> {
        self.sandbox
            .as_deref()
            .into_iter()
            .chain(self.more_sandboxes())
            .cloned()
            .collect()
    }

    /// Sets the sandboxes the share is enforced on (none: it waits, or needs none).
    pub fn set_sandboxes(&mut self, mut sandboxes: Vec<SandboxRecord>) {
        self.sandbox = (!sandboxes.is_empty()).then(|| Box::new(sandboxes.remove(0)));
        self.more_sandboxes = (!sandboxes.is_empty()).then(|| Box::new(sandboxes));
    }

    /// The sandboxes of the claim's other pods (see `more_sandboxes`).
    pub fn more_sandboxes(&self) -> &[SandboxRecord] {
        self.more_sandboxes.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The status of the share's `Enforced` condition: True only while ENFORCED.
    pub fn condition_true(&self) -> bool {
        self.phase == Phase::Enforced
    }

    /// Sets [`Self::condition_since_ms`] for this record replacing `prev` (None: a new
    /// share): kept while the condition's status is the same, this record's update time
    /// when it flipped.
    pub fn carry_condition_since(&mut self, prev: Option<&ShareRecord>) {
        self.condition_since_ms = match prev {
            Some(p) if p.condition_true() == self.condition_true() => {
                // A record from before the field was kept: its last update is the best
                // estimate of when the status was taken.
                if p.condition_since_ms != 0 {
                    p.condition_since_ms
                } else {
                    p.updated_at_ms
                }
            }
            _ => self.updated_at_ms,
        };
    }

    /// Cuts the free-text fields (reason, error message) to their bound: they carry what
    /// limiters and the kernel said, which nothing else bounds. A reason that is one of
    /// the fixed ones shares it, as a decoded record's does, however it was made.
    pub fn bound(&mut self) {
        self.reason = bounded_reason(std::mem::take(&mut self.reason));
        if let Some(e) = &mut self.error {
            bound_text(&mut e.message);
        }
    }

    /// Whether this record counts against its device in the ledger. Admin-access
    /// allocations observe a device without consuming it, as in Kubernetes.
    pub fn counts(&self) -> bool {
        self.phase.holds_capacity() && !self.admin_access
    }

    /// The shareID the scheduler gave the allocation; None for a whole device.
    pub fn share_id(&self) -> Option<&str> {
        self.shared.then_some(self.key.as_str())
    }

    pub fn is_dedicated(&self) -> bool {
        !self.shared
    }

    /// Same allocation result: what the scheduler decided, not what happened to it since.
    pub fn same_allocation(&self, other: &ShareRecord) -> bool {
        self.key == other.key
            && self.claim.uid == other.claim.uid
            && self.driver == other.driver
            && self.pool == other.pool
            && self.device == other.device
            && self.request == other.request
            && self.consumed == other.consumed
            && self.admin_access == other.admin_access
    }
}

impl crate::keyed::Keyed for ClaimRecord {
    fn key(&self) -> &str {
        &self.claim.uid
    }
}

/// The per-claim index: which shares a claim prepared, under which allocation. One is
/// kept in memory for every claim with a live share: its keys sit inline when it has
/// one share, as nearly every claim does, and its CDI ids (a GPU claim's only) cost the
/// others no more than an empty slice. Stored as JSON lists, as when both were vectors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    pub claim: ClaimId,
    pub allocation_id: Name,
    pub share_keys: ShareKeys,
    pub cdi_device_ids: Box<[String]>,
    pub updated_at_ms: u64,
}

/// A claim's share keys (see [`ClaimRecord`]).
pub type ShareKeys = smallvec::SmallVec<[String; 1]>;

pub use crate::error::DecodeError;

/// A record other than a share's, in format 1.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    encode_as(FORMAT_V1, value)
}

/// A share's record, in format 2.
pub fn encode_share(r: &ShareRecord) -> Vec<u8> {
    encode_as(FORMAT_V2, r)
}

fn encode_as<T: Serialize>(format: u8, value: &T) -> Vec<u8> {
    let mut out = vec![format];
    // Serializing these plain structs (string keys, no non-finite floats) cannot fail.
    serde_json::to_writer(&mut out, value).expect("record types always serialize to JSON");
    out
}

/// What can still be read of a share record this agent cannot decode, such as one a
/// newer agent wrote in a format this one does not know: its device and amounts when the
/// body is JSON carrying them in today's shape, so their capacity stays held.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Salvage {
    pub share_id: Option<String>,
    pub claim: Option<ClaimId>,
    pub device: Option<String>,
    pub device_kind: Name,
    pub consumed: Option<BTreeMap<String, Quantity>>,
    pub admin_access: bool,
}

pub fn salvage(bytes: &[u8]) -> Salvage {
    let Some(v) = bytes
        .get(1..)
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
    else {
        return Salvage::default();
    };
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    let consumed = v.get("consumed").and_then(|m| m.as_object()).and_then(|m| {
        m.iter()
            .map(|(k, q)| Some((k.clone(), Quantity::parse_non_negative(q.as_str()?).ok()?)))
            .collect::<Option<BTreeMap<_, _>>>()
    });
    Salvage {
        share_id: text("share_id"),
        claim: v
            .get("claim")
            .and_then(|c| serde_json::from_value::<ClaimId>(c.clone()).ok())
            .filter(|c| !c.uid.is_empty()),
        device: text("device").filter(|d| !d.is_empty()),
        device_kind: text("device_kind").unwrap_or_default().into(),
        consumed,
        admin_access: v
            .get("admin_access")
            .and_then(|b| b.as_bool())
            .unwrap_or(false),
    }
}

pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, DecodeError> {
    match bytes.split_first() {
        None => Err(DecodeError::Empty),
        Some((&(FORMAT_V1 | FORMAT_V2), rest)) => Ok(serde_json::from_slice(rest)?),
        Some((&v, _)) => Err(DecodeError::UnknownFormat {
            found: v,
            max: FORMAT_V2,
        }),
    }
}
