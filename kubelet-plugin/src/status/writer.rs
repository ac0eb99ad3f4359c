//! Keeps `status.devices` of every claim with shares of our drivers equal to what the
//! agent reports, from its WatchShares stream: a change marks the claim, and marked
//! claims are written at most once per `MIN_INTERVAL` each (changes in between are
//! merged), except that a share turning ENFORCED is written at once (within
//! `WRITE_BURST`), and a change that another nearly always follows at once waits for
//! it (`SETTLE_DELAY`); retried with jittered backoff, and skipped when the body is
//! what was last written.
//! After a reconnect (a plugin or agent restart) the snapshot marks every claim again;
//! after a start of the plugin, a claim whose body is what the instance before wrote
//! (`super::written`, a record on the node) is not written again.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use shareguard_proto::v1 as pb;
use tokio::{sync::watch, time::Instant};
use tracing::{debug, info, warn};

use super::{
    build::{self, Target},
    written::{self, Written},
};
use crate::{
    agent::Agent, backoff, claims::SeenClaims, cluster::Clients, events::Events,
    stop::until_stopped,
};

/// A claim's status is written at most this often on average; changes in between are
/// merged.
const MIN_INTERVAL: Duration = Duration::from_secs(1);
/// How many writes of one claim a share turning ENFORCED may make sooner than
/// `MIN_INTERVAL` after the one before, in a row: the time from the agent's ENFORCED to
/// the claim's condition is a target (250 ms at p99), and a write of the same claim a
/// moment before (its PENDING, another share) must not hold it back. Every other change
/// waits out the interval, merged with what follows: a release's steps (the sandbox
/// gone, RELEASING, RELEASED) are one write, not three. A claim whose shares flap is
/// still written about once a second.
const WRITE_BURST: u32 = 3;
/// How long a change that another one nearly always follows at once waits for it, to
/// go in one write with it (a change that matters ends the wait). Counted on the test
/// cluster, each of these cost one apply per claim when written alone:
/// - a share's messages alone (the same conditions, the same data): its waiting message
///   changes when kubelet prepares the claim ("kubelet has not prepared the claim"
///   becomes "no sandbox yet") about a second before it is ENFORCED, and the write held
///   the ENFORCED one back by `MIN_INTERVAL`;
/// - a share PREPARING: the agent admitted it and applies its limit within the same
///   Prepare, and its PENDING or ENFORCED follows within milliseconds;
/// - a share that left ENFORCED for PENDING: its sandbox went away, nearly always
///   because its pod is being deleted, and kubelet's Unprepare (the release, which
///   removes the entry) follows within a second or two. Meanwhile the claim still says
///   Enforced for a pod with no sandbox, whose traffic no longer exists; a sandbox
///   made anew and not enforced within this delay is written PENDING then.
const SETTLE_DELAY: Duration = Duration::from_secs(5);
/// How often marked claims are looked at.
const TICK: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How often at most the record of written claims goes to disk: a crash loses at most
/// this much of it, which costs a restart one apply per claim written in it.
const RECORD_EVERY: Duration = Duration::from_secs(1);

#[derive(Default)]
struct ClaimState {
    dirty: bool,
    /// What is dirty is only changes that wait for another (see `SETTLE_DELAY`), not to
    /// be written before this; None once a change that matters is pending.
    settles_until: Option<Instant>,
    /// When the claim may be written next (rate limit or backoff).
    not_before: Option<Instant>,
    /// A share of the claim turned ENFORCED since the last write: written without
    /// waiting for `not_before`'s interval (not a backoff), as `paced_until` allows.
    enforced: bool,
    /// The rate of those writes (a generic cell rate algorithm: one instant for the
    /// whole bucket): allowed while this is at most `WRITE_BURST - 1` intervals ahead of
    /// now; each write moves it one `MIN_INTERVAL` on.
    paced_until: Option<Instant>,
    /// `not_before` is a backoff after a failure, which nothing skips.
    backing_off: bool,
    /// Failed writes in a row.
    failures: u32,
    /// The digest of the body last written (`written::digest`); after a start, the
    /// one the instance before recorded.
    last_written: Option<String>,
    /// The API server has no claim of this uid any more (deleted, or deleted and created
    /// anew under the name): nothing is written to it again.
    gone: bool,
}

impl ClaimState {
    /// Whether the write rate allows a write at `now`.
    fn may_write(&self, now: Instant) -> bool {
        self.paced_until
            .is_none_or(|t| t <= now + MIN_INTERVAL * (WRITE_BURST - 1))
    }

    /// Counts a write made at `now`.
    fn wrote(&mut self, now: Instant) {
        self.paced_until = Some(self.paced_until.map_or(now, |t| t.max(now)) + MIN_INTERVAL);
    }

    /// Whether the claim is to be written at `now`.
    fn due(&self, now: Instant) -> bool {
        let paced = self.not_before.is_none_or(|t| t <= now)
            || (self.enforced && !self.backing_off && self.may_write(now));
        self.dirty && (self.gone || (paced && self.settles_until.is_none_or(|t| t <= now)))
    }

    /// A change of the claim's shares: `settles` when it is one that waits for the
    /// next (see `SETTLE_DELAY`).
    fn mark(&mut self, settles: bool, enforced: bool) {
        self.enforced |= enforced;
        if !settles {
            self.settles_until = None;
        } else if !self.dirty {
            self.settles_until = Some(Instant::now() + SETTLE_DELAY);
        }
        // Dirty with a change that matters already pending: it stays so.
        self.dirty = true;
    }
}

/// What a failed apply of a claim's status means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyFailure {
    /// No claim of that name (404): it was deleted.
    Deleted,
    /// A claim of that name with another uid: the one the shares belong to was deleted
    /// and another created under its name. The uid in the apply body is checked against
    /// the stored one: the API server answers 422 Invalid with a cause on
    /// `metadata.uid` ("field is immutable"), and 409 Conflict where the uid is an
    /// explicit precondition.
    Replaced,
    /// Another client error (403, 400, a 422 of an admission policy): this body will
    /// not be taken as it is. A claim deallocated since is one: the plugin's admission
    /// policy lets it write only claims allocated on its node.
    Refused,
    /// Anything else (the server busy or away): tried again with backoff.
    Retry,
}

impl ApplyFailure {
    pub fn of(e: &kube::Error) -> Self {
        let kube::Error::Api(s) = e else {
            return Self::Retry;
        };
        let uid_cause = s
            .details
            .iter()
            .flat_map(|d| &d.causes)
            .any(|c| c.field == "metadata.uid");
        match s.code {
            404 => Self::Deleted,
            409 => Self::Replaced,
            422 if uid_cause => Self::Replaced,
            // Timeout and throttling are the server's state, not the request's.
            408 | 429 => Self::Retry,
            400..=499 => Self::Refused,
            _ => Self::Retry,
        }
    }
}

pub struct StatusWriter {
    clients: Clients,
    agent: Arc<Agent>,
    drivers: BTreeSet<String>,
    /// The latest status of each share, by its claim and then its key: a claim's write
    /// reads only its own shares, not every share on the node.
    shares: Shares,
    claims: BTreeMap<Target, ClaimState>,
    /// Where a share's move worth telling its owner goes.
    events: Events,
    /// What the plugin's reads of a claim found; a claim made for one pod has its
    /// release left out (`crate::claims::SeenClaims`).
    seen: SeenClaims,
    /// What was written, kept on the node for the next start.
    written: Written,
    recorded_at: Instant,
    /// The state of the retry waits' jitter (`crate::backoff`).
    jitter: u64,
}

/// The wait before writing a claim again after `failures` failed writes in a row before
/// this one: `MIN_INTERVAL` doubled each time up to `MAX_BACKOFF`, drawn between half of
/// that and all of it, so that the claims (and the nodes) that failed together in an API
/// server incident do not all come back at the same instant.
fn retry_wait(jitter: &mut u64, failures: u32) -> Duration {
    backoff::doubled(MIN_INTERVAL, MAX_BACKOFF, failures, backoff::next(jitter))
}

/// Claim -> share key -> latest status. A share's claim never changes (allocation
/// results are immutable), so a share is under one claim only.
type Shares = HashMap<Target, BTreeMap<String, pb::ShareStatus>>;

/// Files `s` under its claim; a share that names no claim is not written anywhere.
fn insert(shares: &mut Shares, s: pb::ShareStatus) {
    if let Some(t) = Target::of(&s) {
        shares.entry(t).or_default().insert(share_key(&s), s);
    }
}

/// Whether a share's move from `before` (None: first seen) to `now` is one that waits
/// for the next (see `SETTLE_DELAY`).
fn settles(before: Option<&pb::ShareStatus>, now: &pb::ShareStatus) -> bool {
    let is = |s: &pb::ShareStatus, p: pb::Phase| s.phase == p as i32;
    is(now, pb::Phase::Preparing)
        || before.is_some_and(|b| {
            build::differs_in_messages_only(b, now)
                || (is(b, pb::Phase::Enforced) && is(now, pb::Phase::Pending))
        })
}

fn share_key(s: &pb::ShareStatus) -> String {
    // Dedicated allocations have no shareID; the claim and device name them.
    if s.share_id.is_empty() {
        let uid = s.claim.as_ref().map(|c| c.uid.as_str()).unwrap_or("");
        format!("{uid}/{}/{}/{}", s.driver, s.pool, s.device)
    } else {
        s.share_id.clone()
    }
}

impl StatusWriter {
    pub fn new(
        clients: Clients,
        agent: Arc<Agent>,
        drivers: BTreeSet<String>,
        events: Events,
        seen: SeenClaims,
        written: Written,
    ) -> Self {
        Self {
            clients,
            agent,
            drivers,
            shares: HashMap::new(),
            claims: BTreeMap::new(),
            events,
            seen,
            written,
            recorded_at: Instant::now(),
            jitter: backoff::seed(),
        }
    }

    /// The claim's state, made on first sight with what the record says was written.
    fn claim(&mut self, t: &Target) -> &mut ClaimState {
        let written = &self.written;
        self.claims.entry(t.clone()).or_insert_with(|| ClaimState {
            last_written: written.get(t).map(str::to_owned),
            ..ClaimState::default()
        })
    }

    /// Forgets a claim nothing of ours is left in (or that is gone).
    fn forget(&mut self, t: &Target) {
        self.claims.remove(t);
        self.shares.remove(t);
        self.written.remove(t);
        self.seen.forget(&t.uid);
    }

    /// The record to disk, if it changed and `RECORD_EVERY` passed (or `now`).
    fn record(&mut self, now: bool) {
        if now || self.recorded_at.elapsed() >= RECORD_EVERY {
            self.written.flush();
            self.recorded_at = Instant::now();
        }
    }

    /// Runs until `stop` turns true.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut reconnect_delay = Duration::from_millis(100);
        loop {
            let stream = tokio::select! {
                r = self.agent.watch() => r,
                () = until_stopped(&mut stop) => return self.record(true),
            };
            let mut stream = match stream {
                Ok(s) => s,
                Err(e) => {
                    debug!(error = %e, "watching shares; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(reconnect_delay) => {}
                        () = until_stopped(&mut stop) => return self.record(true),
                    }
                    reconnect_delay = (reconnect_delay * 2).min(Duration::from_secs(5));
                    continue;
                }
            };
            info!("watching the agent's shares for claim status");
            let mut snapshot: Option<Shares> = Some(HashMap::new());
            let mut tick = tokio::time::interval(TICK);
            loop {
                tokio::select! {
                    msg = stream.message() => match msg {
                        Ok(Some(m)) => {
                            reconnect_delay = Duration::from_millis(100);
                            // A change due now is written now, not at the next tick.
                            if let Some(t) = self.on_message(m, &mut snapshot)
                                && !self.agent.is_fenced()
                                && self.claims.get(&t).is_some_and(|c| c.due(Instant::now()))
                            {
                                self.write(t).await;
                            }
                        }
                        Ok(None) | Err(_) => {
                            warn!("the agent's share stream ended; reconnecting");
                            break;
                        }
                    },
                    _ = tick.tick() => {
                        if !self.agent.is_fenced() {
                            self.flush().await;
                        }
                        self.record(false);
                    }
                    () = until_stopped(&mut stop) => return self.record(true),
                }
            }
        }
    }

    /// Takes in one message of the stream; the claim a change marked, if any.
    fn on_message(
        &mut self,
        m: pb::WatchSharesResponse,
        snapshot: &mut Option<Shares>,
    ) -> Option<Target> {
        let kind = pb::watch_shares_response::Kind::try_from(m.kind);
        match (kind, m.share) {
            (Ok(pb::watch_shares_response::Kind::Snapshot), Some(s)) => {
                if let Some(snap) = snapshot.as_mut()
                    && self.drivers.contains(&s.driver)
                {
                    insert(snap, s);
                }
            }
            (Ok(pb::watch_shares_response::Kind::SnapshotEnd), _) => {
                if let Some(snap) = snapshot.take() {
                    // What moved while the stream was down is told as any move is;
                    // shares first seen (a start of the plugin) are not.
                    for (t, now) in &snap {
                        for (key, s) in now {
                            let before = self.shares.get(t).and_then(|m| m.get(key));
                            if before.is_some() {
                                self.events.share_changed(before, s);
                            }
                        }
                    }
                    // Claims known before and not in the snapshot are marked too: their
                    // entries go.
                    let old = std::mem::replace(&mut self.shares, snap);
                    let now: Vec<Target> = self.shares.keys().cloned().collect();
                    for t in old.into_keys().chain(now) {
                        self.claim(&t).mark(false, false);
                    }
                    // Claims released while the plugin was away are not kept on record.
                    let live: BTreeSet<(String, String)> = self
                        .shares
                        .keys()
                        .map(|t| (t.driver.clone(), t.uid.clone()))
                        .collect();
                    self.written.retain(&live);
                }
            }
            (Ok(pb::watch_shares_response::Kind::Changed), Some(s)) => {
                if !self.drivers.contains(&s.driver) {
                    return None;
                }
                let marked = Target::of(&s);
                if let Some(t) = &marked {
                    let before = self.shares.get(t).and_then(|m| m.get(&share_key(&s)));
                    if before.is_none() && !build::shown(&s) {
                        // Released, and not known here: its claim's entry was removed
                        // already (the claim forgotten after that write), or never
                        // written by this instance. Taken in, it would be written away
                        // a second time.
                        return None;
                    }
                    self.events.share_changed(before, &s);
                    let settles = settles(before, &s);
                    let enforced = |x: &pb::ShareStatus| x.phase == pb::Phase::Enforced as i32;
                    let now_enforced = enforced(&s) && !before.is_some_and(enforced);
                    self.claim(t).mark(settles, now_enforced);
                }
                insert(&mut self.shares, s);
                return marked;
            }
            _ => {}
        }
        None
    }

    async fn flush(&mut self) {
        let now = Instant::now();
        let due: Vec<Target> = self
            .claims
            .iter()
            .filter(|(_, c)| c.due(now))
            .map(|(t, _)| t.clone())
            .collect();
        for t in due {
            self.write(t).await;
        }
    }

    /// Writes claim `t`'s status (it is due).
    async fn write(&mut self, t: Target) {
        // In key order (a BTreeMap), so that an unchanged claim gets the same body.
        let shares: Vec<&pb::ShareStatus> = self
            .shares
            .get(&t)
            .into_iter()
            .flat_map(|m| m.values())
            .collect();
        let body = build::body(&t, &shares);
        let live = shares.iter().any(|s| build::shown(s));
        let Some(state) = self.claims.get_mut(&t) else {
            return;
        };
        state.dirty = false;
        state.settles_until = None;
        let enforced = std::mem::take(&mut state.enforced);
        if state.gone {
            // Written no more; forgotten once its shares are released.
            if !live {
                self.forget(&t);
            }
            return;
        }
        let digest = written::digest(&body);
        if state.last_written.as_ref() == Some(&digest) {
            return;
        }
        if !live && self.seen.for_one_pod(&t.uid) {
            info!(claim = %t.name, namespace = %t.namespace, driver = %t.driver, "the release is not written: the claim was made for its pod alone, and its deallocation removes the entries");
            self.forget(&t);
            return;
        }
        let api = Api::<ResourceClaim>::namespaced(self.clients.calls.clone(), &t.namespace);
        let params = PatchParams::apply(&t.driver).force();
        let applied = self
            .clients
            .bounded(api.patch_status(&t.name, &params, &Patch::Apply(&body)))
            .await;
        match applied.map_err(|e| (ApplyFailure::of(&e), e)) {
            Ok(_) => {
                debug!(claim = %t.name, namespace = %t.namespace, driver = %t.driver, "claim status written");
                self.written.set(&t, &digest);
                state.last_written = Some(digest);
                state.failures = 0;
                let now = Instant::now();
                state.not_before = Some(now + MIN_INTERVAL);
                state.backing_off = false;
                state.wrote(now);
                if !live {
                    // Nothing of ours is left in it; forget the claim and its
                    // released shares.
                    self.forget(&t);
                }
            }
            // Only the removal of released shares was left to write, and it is
            // refused: the claim was deallocated (a kubelet Unprepare comes before
            // the pod's reservation and the allocation go), and the API server drops
            // the status entries of deallocated devices itself. Retrying would only
            // be refused again until the claim is gone.
            Err((ApplyFailure::Refused, e)) if !live => {
                info!(claim = %t.name, namespace = %t.namespace, driver = %t.driver, error = %e, "the release is not written: the claim is no longer ours to write");
                self.forget(&t);
            }
            // The claim is gone, or was created anew under the name (the uid in the
            // body no longer matches): no write to this uid can succeed again, so
            // none is tried, with or without backoff.
            Err((why @ (ApplyFailure::Deleted | ApplyFailure::Replaced), e)) => {
                info!(claim = %t.name, namespace = %t.namespace, claim_uid = %t.uid, driver = %t.driver, why = ?why, error = %e, "claim deleted or replaced; its status is not written any more");
                if live {
                    state.gone = true;
                } else {
                    self.forget(&t);
                }
            }
            Err((_, e)) => {
                state.dirty = true;
                state.enforced |= enforced;
                let wait = retry_wait(&mut self.jitter, state.failures);
                state.failures = state.failures.saturating_add(1);
                state.not_before = Some(Instant::now() + wait);
                state.backing_off = true;
                warn!(claim = %t.name, namespace = %t.namespace, driver = %t.driver, error = %e, retry_in = ?wait, "writing claim status failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_alone_waits_for_a_change_that_matters_and_goes_with_it() {
        let mut c = ClaimState::default();
        let before = Instant::now();
        c.mark(true, false);
        assert!(c.dirty);
        let until = c.settles_until.expect("a message alone waits");
        assert!(until >= before + SETTLE_DELAY);
        // Another message alone does not push it further out.
        std::thread::sleep(Duration::from_millis(5));
        c.mark(true, false);
        assert_eq!(c.settles_until, Some(until));
        // A change that matters is written at once, the message with it.
        c.mark(false, false);
        assert!(c.dirty && c.settles_until.is_none());
        // And stays so when a message alone follows before the write.
        c.mark(true, false);
        assert!(c.settles_until.is_none());
    }

    #[test]
    fn preparing_a_sandbox_gone_and_messages_alone_wait_for_what_follows() {
        let share = |phase: pb::Phase, message: &str| {
            let status = if phase == pb::Phase::Enforced {
                "True"
            } else {
                "False"
            };
            let condition = serde_json::json!({"type": "Enforced", "status": status,
                "reason": format!("{phase:?}"), "message": message});
            pb::ShareStatus {
                share_id: "s1".into(),
                phase: phase as i32,
                device_status_json: serde_json::json!({ "conditions": [condition] }).to_string(),
                ..Default::default()
            }
        };
        let preparing = share(pb::Phase::Preparing, "admitted");
        let pending = share(pb::Phase::Pending, "no sandbox yet");
        let pending_later = share(pb::Phase::Pending, "kubelet prepared it; no sandbox yet");
        let enforced = share(pb::Phase::Enforced, "read back");
        let failed = share(pb::Phase::Failed, "no");
        let degraded = share(pb::Phase::Degraded, "drift");
        let releasing = share(pb::Phase::Releasing, "");
        // Waits: what the agent moves on from within the same call, a message alone,
        // the sandbox of an enforced share gone.
        assert!(settles(None, &preparing));
        assert!(settles(Some(&pending), &pending_later));
        assert!(settles(Some(&enforced), &pending));
        // Written at once (as the pacing allows): everything else.
        for (before, now) in [
            (None, &pending),
            (Some(&preparing), &pending),
            (Some(&pending), &enforced),
            (Some(&enforced), &degraded),
            (Some(&enforced), &failed),
            (Some(&pending), &releasing),
            (Some(&enforced), &releasing),
        ] {
            assert!(!settles(before, now), "{before:?} -> {now:?}");
        }
    }

    #[test]
    fn a_claim_writes_a_burst_at_once_then_once_per_interval() {
        let mut c = ClaimState::default();
        let t0 = Instant::now();
        for i in 0..WRITE_BURST {
            assert!(c.may_write(t0), "write {i} of the burst");
            c.wrote(t0);
        }
        assert!(!c.may_write(t0));
        assert!(!c.may_write(t0 + MIN_INTERVAL - Duration::from_millis(1)));
        assert!(c.may_write(t0 + MIN_INTERVAL));
        c.wrote(t0 + MIN_INTERVAL);
        assert!(!c.may_write(t0 + MIN_INTERVAL));
        // Quiet for long enough, the whole burst again.
        let later = t0 + MIN_INTERVAL * 10;
        for _ in 0..WRITE_BURST {
            assert!(c.may_write(later));
            c.wrote(later);
        }
        assert!(!c.may_write(later));
    }

    #[test]
    fn only_a_share_turning_enforced_skips_the_interval_and_never_a_backoff() {
        let now = Instant::now();
        let just_written = || {
            let mut c = ClaimState::default();
            c.wrote(now);
            c.not_before = Some(now + MIN_INTERVAL);
            c
        };
        // Any other change waits out the interval.
        let mut c = just_written();
        c.mark(false, false);
        assert!(!c.due(now) && c.due(now + MIN_INTERVAL));
        // A share turning ENFORCED goes at once.
        let mut c = just_written();
        c.mark(false, true);
        assert!(c.due(now));
        // Not during a backoff after a failure.
        c.backing_off = true;
        assert!(!c.due(now));
        // Nor beyond the burst: the bucket is empty after WRITE_BURST writes at once.
        let mut c = just_written();
        for _ in 1..WRITE_BURST {
            c.wrote(now);
        }
        c.mark(false, true);
        assert!(!c.due(now));
    }

    #[test]
    fn a_failed_write_waits_doubling_to_the_cap_each_wait_drawn_apart() {
        let mut jitter = 1;
        for failures in 0..12 {
            let full = (MIN_INTERVAL * 2u32.pow(failures)).min(MAX_BACKOFF);
            let w = retry_wait(&mut jitter, failures);
            assert!(w >= full / 2 && w <= full, "{failures}: {w:?} of {full:?}");
        }
        // Claims that failed together: their waits after the same number of failures
        // spread over the range rather than all ending at one instant.
        let waits: std::collections::BTreeSet<Duration> =
            (0..100).map(|_| retry_wait(&mut jitter, 3)).collect();
        assert!(waits.len() > 90, "{waits:?}");
        assert!(waits.first() < Some(&(MIN_INTERVAL * 5)), "{waits:?}");
        assert!(waits.last() > Some(&(MIN_INTERVAL * 7)), "{waits:?}");
    }

    fn api_error(json: serde_json::Value) -> kube::Error {
        kube::Error::Api(Box::new(serde_json::from_value(json).unwrap()))
    }

    /// What kube-apiserver answers a server-side apply whose `metadata.uid` is not the
    /// stored object's (kubernetes/kubernetes#127625): 422 Invalid, the cause on
    /// `metadata.uid`.
    fn uid_invalid() -> serde_json::Value {
        serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "ResourceClaim.resource.k8s.io \"c1\" is invalid: metadata.uid: Invalid value: \"0b6a4c9e-1111-4c3e-9f00-000000000001\": field is immutable",
            "reason": "Invalid",
            "details": {
                "name": "c1", "group": "resource.k8s.io", "kind": "ResourceClaim",
                "causes": [{
                    "reason": "FieldValueInvalid",
                    "message": "Invalid value: \"0b6a4c9e-1111-4c3e-9f00-000000000001\": field is immutable",
                    "field": "metadata.uid",
                }],
            },
            "code": 422,
        })
    }

    #[test]
    fn a_uid_refusal_means_replaced_other_client_errors_refused_and_the_rest_retried() {
        assert_eq!(
            ApplyFailure::of(&api_error(uid_invalid())),
            ApplyFailure::Replaced
        );
        let conflict = serde_json::json!({"status": "Failure", "reason": "Conflict", "code": 409,
            "message": "Precondition failed: UID in precondition: a, UID in object meta: b"});
        assert_eq!(
            ApplyFailure::of(&api_error(conflict)),
            ApplyFailure::Replaced
        );
        let gone = serde_json::json!({"status": "Failure", "reason": "NotFound", "code": 404});
        assert_eq!(ApplyFailure::of(&api_error(gone)), ApplyFailure::Deleted);
        // A 422 on anything else (a status the API server finds invalid) is not a
        // replaced claim.
        let mut other = uid_invalid();
        other["details"]["causes"][0]["field"] = "status.devices[0].data".into();
        assert_eq!(ApplyFailure::of(&api_error(other)), ApplyFailure::Refused);
        // The plugin's admission policy, once the claim is deallocated.
        let policy = serde_json::json!({"status": "Failure", "reason": "Invalid", "code": 422,
            "message": "resourceclaims.resource.k8s.io \"c1\" is forbidden: ValidatingAdmissionPolicy 'shareguard-kubelet-plugin-claim-status' with binding 'shareguard-kubelet-plugin-claim-status' denied request"});
        assert_eq!(ApplyFailure::of(&api_error(policy)), ApplyFailure::Refused);
        let busy =
            serde_json::json!({"status": "Failure", "reason": "TooManyRequests", "code": 429});
        assert_eq!(ApplyFailure::of(&api_error(busy)), ApplyFailure::Retry);
    }
}
