//! The agent library's core: admission against the ledger, durable state, enforcement
//! through each device's limiter, and recovery at start. The gRPC layer only translates
//! to and from these calls; every decision is taken here.

mod audit;
pub mod gpu;
mod locks;
pub mod observer;
pub mod page;
mod prepare;
mod query;
mod reconcile;
mod recover;
pub mod rollout;
mod sandbox;
mod slo;
mod storage;
#[cfg(test)]
mod tests;
pub mod traffic;
mod unprepare;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{SystemTime, UNIX_EPOCH},
};

use shareguard_common::limiter::{HostIface, LimitSpec, Limiter, Target};
use tokio::sync::{Notify, broadcast};
use tracing::info;

pub use observer::Observer;
pub use prepare::PrepareOutcome;
pub use query::{DeviceView, ShareFilter};
pub use slo::ClassSlo;

use crate::{
    audit::AuditLog,
    config::Config,
    discovery::{self, Discovery},
    error::RequestError,
    ledger::State,
    record::{Phase, ShareRecord},
    store::{Batch, Durable, Store, StoreError},
    sync::lock,
};

/// Changes are broadcast to watchers; one that falls this far behind gets a new snapshot.
const EVENT_BUFFER: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("state store at {path}: {source}")]
    Store { path: String, source: StoreError },
    #[error("audit log {path}: {source}")]
    Audit {
        path: String,
        source: std::io::Error,
    },
    #[error("no limiter for device {0}")]
    NoLimiter(String),
    #[error("pod discovery: {0}")]
    Discovery(String),
    /// The config dropped or changed a device that still has live shares: starting would
    /// leave their capacity and enforcement unaccounted for.
    #[error("{0}")]
    Inventory(String),
}

pub struct Engine {
    cfg: Arc<Config>,
    /// The store; swapped for a fresh one when a failed store is reopened (see
    /// [`storage`]). Lock order: `state`, then `store`.
    store: Mutex<Option<Store>>,
    /// The kernel's boot id at start, for re-verifying after a reopen.
    boot_id: String,
    state: Mutex<State>,
    locks: locks::ClaimLocks,
    limiters: HashMap<String, Arc<dyn Limiter>>,
    /// Each device's rollout stage (see [`rollout`]); the limiter the engine uses for a
    /// device follows it.
    stages: Mutex<HashMap<String, crate::rollout::Stage>>,
    /// Held for the whole of a stage change (see [`rollout`]).
    stage_change: tokio::sync::Mutex<()>,
    events: broadcast::Sender<ShareRecord>,
    audit: AuditLog,
    /// Told what is counted (the metrics registry; see [`observer`]).
    metrics: Arc<dyn Observer>,
    /// What the GPU watchdog last saw, by share key (see [`gpu`]).
    gpu_obs: Mutex<HashMap<String, gpu::GpuObservation>>,
    /// Finds pods' sandboxes (see [`crate::discovery`]).
    discovery: Arc<Discovery>,
    /// Wakes the discovery loop: kernel events, and a Prepare that left a share waiting.
    kick: Arc<Notify>,
    /// Traffic counters and what is measured from them, by share key, as the counters
    /// task last read them (see [`traffic`]).
    traffic: Mutex<traffic::Traffic>,
    /// When the engine was opened: the monotonic clock traffic is measured by.
    started: std::time::Instant,
    /// The SLO figures' events (see [`crate::slo`] and [`slo`]).
    slo: crate::slo::Slo,
}

/// The fence (I4): a request's epoch must be the current one (see [`Engine::fence`]).
fn check_fence(st: &State, epoch: u64) -> Result<(), RequestError> {
    match epoch.cmp(&st.epoch) {
        std::cmp::Ordering::Less => Err(RequestError::StaleEpoch {
            got: epoch,
            current: st.epoch,
        }),
        std::cmp::Ordering::Greater => Err(RequestError::UnknownEpoch {
            got: epoch,
            current: st.epoch,
        }),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Engine {
    /// Opens the store under `cfg.agent.state_dir`, rebuilds the ledger from it and
    /// re-verifies every live share (see [`recover`]). `boot_id` is the kernel's boot id:
    /// when it differs from the stored one, no enforcement survived and live enforced
    /// shares become UNKNOWN.
    pub fn open(
        cfg: Arc<Config>,
        limiters: HashMap<String, Arc<dyn Limiter>>,
        boot_id: &str,
        metrics: Arc<dyn Observer>,
    ) -> Result<Engine, OpenError> {
        // The start recovery is timed from (see [`crate::slo`]).
        let started = std::time::Instant::now();
        for d in &cfg.devices {
            if !limiters.contains_key(&d.name) {
                return Err(OpenError::NoLimiter(d.name.clone()));
            }
        }
        let store_dir = cfg.agent.state_dir.join("store");
        // A store closed a moment ago in this process (a test, or a reopen) may still
        // hold sled's lock for an instant; a running second agent holds it for good.
        let store =
            Store::open_patiently(&store_dir, storage::REOPEN_PATIENCE).map_err(|source| {
                OpenError::Store {
                    path: store_dir.display().to_string(),
                    source,
                }
            })?;
        let audit =
            AuditLog::open(&cfg.agent.audit_log, cfg.agent.audit_bound).map_err(|source| {
                OpenError::Audit {
                    path: cfg.agent.audit_log.display().to_string(),
                    source,
                }
            })?;
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let discovery = Arc::new(open_discovery(&cfg)?);
        let slo = crate::slo::Slo::new(&cfg.slo, started);
        let mut engine = Engine {
            slo,
            cfg,
            store: Mutex::new(None),
            boot_id: boot_id.to_owned(),
            state: Mutex::new(State::default()),
            locks: locks::ClaimLocks::default(),
            limiters,
            stages: Mutex::new(HashMap::new()),
            stage_change: tokio::sync::Mutex::new(()),
            events,
            audit,
            metrics,
            gpu_obs: Mutex::new(HashMap::new()),
            discovery,
            kick: Arc::new(Notify::new()),
            traffic: Mutex::new(traffic::Traffic::default()),
            started,
        };
        let state = engine.load_state_from(&store)?;
        engine.state = Mutex::new(state);
        engine.store = Mutex::new(Some(store));
        engine.slo_check_recovery();
        for d in engine.devices() {
            for (name, cap) in &d.config.capacities {
                if let Some(held) = d.usage.allocated.get(name).filter(|h| **h > cap.value) {
                    // Shrunk under live shares: they keep what they hold (only Unprepare
                    // frees), new shares are refused until the device fits again.
                    tracing::warn!(
                        device = %d.config.name,
                        capacity = %name,
                        held = %held,
                        configured = %cap.value,
                        "device is over-committed: its live shares hold more than its configured capacity; new shares are refused until enough are released"
                    );
                }
            }
        }
        Ok(engine)
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn accounting_only(&self, device: &str) -> bool {
        self.limiter(device).is_none_or(|l| l.accounting_only())
    }

    /// I4 and I10: a mutating request carries the current epoch, the one the latest
    /// [`Engine::new_epoch`] returned. Only `NewEpoch` moves the fence: an epoch below
    /// the current one is stale (its caller was replaced), one above it was never issued
    /// (were it accepted, one call with 2^64-1 would leave no epoch for `NewEpoch` to
    /// take and fence every plugin for good). A call at the current epoch waits while
    /// that epoch is not durable yet (a `NewEpoch` still flushing it).
    async fn fence(&self, epoch: u64) -> Result<(), RequestError> {
        {
            let st = lock(&self.state);
            check_fence(&st, epoch)?;
            if st.epoch_durable >= epoch {
                return Ok(());
            }
        }
        // Everything submitted before, the epoch's own write included, is durable once
        // a barrier behind it resolves.
        self.barrier().await?;
        let mut st = lock(&self.state);
        st.epoch_durable = st.epoch_durable.max(epoch);
        Ok(())
    }

    /// A new epoch above every accepted one, durable before it is returned: a control
    /// plane instance that takes it fences every instance before it at once.
    pub async fn new_epoch(&self, caller: Option<u32>) -> Result<u64, RequestError> {
        let (epoch, durable) = {
            let mut st = lock(&self.state);
            let Some(epoch) = st.epoch.checked_add(1) else {
                return Err(RequestError::Invalid {
                    field: "epoch".into(),
                    message: "the highest epoch is taken; no newer one exists".into(),
                });
            };
            let d = self.commit_locked(
                &mut st,
                Batch {
                    epoch: Some(epoch),
                    ..Default::default()
                },
            )?;
            st.epoch = epoch;
            (epoch, d)
        };
        durable.wait().await?;
        let mut st = lock(&self.state);
        st.epoch_durable = st.epoch_durable.max(epoch);
        info!(epoch, "new control-plane epoch");
        self.audit_node(
            crate::audit::Decision::Epoch,
            &format!(
                "NewEpoch: epoch {epoch} taken; calls with epoch {} or older are refused from now on",
                epoch - 1
            ),
            epoch,
            caller,
            None,
        );
        Ok(epoch)
    }

    /// The fence without waiting for durability: for a request none of whose claims is
    /// valid, which changes nothing.
    fn check_epoch(&self, epoch: u64) -> Result<(), RequestError> {
        check_fence(&lock(&self.state), epoch)
    }

    /// Applies `batch` to the in-memory state and queues it for the store, under the
    /// state lock, so the store sees changes in the order they were decided. Returns the
    /// handle that resolves once the change is durable; nothing may be acknowledged
    /// before that. Refuses every change once the store has failed, because the memory
    /// could then be ahead of the disk.
    fn commit_locked(&self, st: &mut State, mut batch: Batch) -> Result<Durable, StoreError> {
        let slot = lock(&self.store);
        let Some(store) = slot.as_ref().filter(|s| !s.has_failed()) else {
            return Err(StoreError::Failed);
        };
        for r in &mut batch.put_shares {
            r.bound();
            // Here, where every change of a share passes, rather than at each place that
            // changes a phase.
            r.carry_condition_since(st.records.get(&r.key));
        }
        // Refused here, before memory changes, rather than by the writer, where a failed
        // write stops the store for good.
        batch.check_sizes()?;
        for k in &batch.delete_shares {
            st.remove(k);
        }
        for k in &batch.delete_claims {
            st.claims.remove(k);
        }
        for c in &batch.put_claims {
            st.claims.insert(c.clone());
        }
        for r in &batch.put_shares {
            self.slo_changed(r);
            st.put(r.clone());
        }
        Ok(store.submit(batch))
    }

    /// Tells watchers about changed shares. Called only once the change is durable, so a
    /// watcher never sees a state that a crash could take back.
    fn publish(&self, shares: &[ShareRecord]) {
        for r in shares {
            // Receivers may lag or be absent; a send error only means nobody listens.
            let _ = self.events.send(r.clone());
        }
    }

    /// Commits under the lock, then waits until it is durable.
    async fn commit_durable(&self, batch: Batch) -> Result<(), StoreError> {
        let changed = batch.put_shares.clone();
        let durable = {
            let mut st = lock(&self.state);
            self.commit_locked(&mut st, batch)?
        };
        durable.wait().await?;
        self.publish(&changed);
        Ok(())
    }

    /// Resolves once everything decided so far is durable.
    async fn barrier(&self) -> Result<(), StoreError> {
        let durable = self.submit(Batch::default());
        durable.wait().await
    }

    /// Removes RELEASED and FAILED records whose retention has passed, the oldest beyond
    /// `tombstone_max` whatever their age, and claim records left with no shares.
    /// Returns how many share records were removed.
    pub async fn sweep_tombstones(&self, now_ms: u64) -> Result<usize, StoreError> {
        let retention =
            u64::try_from(self.cfg.agent.tombstone_retention.as_millis()).unwrap_or(u64::MAX);
        let removed = {
            let mut st = lock(&self.state);
            let since = |r: &ShareRecord| r.released_at_ms.map_or(r.updated_at_ms, |t| t.get());
            let mut tombstones: Vec<(u64, &String)> = st
                .records
                .values()
                .filter(|r| !r.phase.holds_capacity())
                .map(|r| (since(r), &r.key))
                .collect();
            // Oldest first; the key breaks ties, so that the same records go each time.
            tombstones.sort();
            let over = tombstones
                .len()
                .saturating_sub(self.cfg.agent.tombstone_max);
            let expired: Vec<String> = tombstones
                .iter()
                .enumerate()
                .filter(|(i, (at, _))| *i < over || now_ms.saturating_sub(*at) >= retention)
                .map(|(_, (_, k))| (*k).clone())
                .collect();
            if expired.is_empty() {
                return Ok(0);
            }
            let expired_set: std::collections::HashSet<&str> =
                expired.iter().map(String::as_str).collect();
            let mut batch = Batch::default();
            for c in st.claims.values() {
                let left: crate::record::ShareKeys = c
                    .share_keys
                    .iter()
                    .filter(|k| !expired_set.contains(k.as_str()) && st.records.contains_key(k))
                    .cloned()
                    .collect();
                if left.is_empty() {
                    batch.delete_claims.push(c.claim.uid.clone());
                } else if left.len() != c.share_keys.len() {
                    let mut c = c.clone();
                    c.share_keys = left;
                    batch.put_claims.push(c);
                }
            }
            let gone: Vec<ShareRecord> = expired
                .iter()
                .filter_map(|k| st.records.get(k).cloned())
                .collect();
            drop(expired_set);
            batch.delete_shares = expired;
            (gone, self.commit_locked(&mut st, batch)?)
        };
        removed.1.wait().await?;
        for r in &removed.0 {
            let age = now_ms.saturating_sub(r.released_at_ms.map_or(r.updated_at_ms, |t| t.get()));
            let why = if age >= retention {
                format!(
                    "after its retention of {}",
                    humantime::format_duration(self.cfg.agent.tombstone_retention)
                )
            } else {
                format!(
                    "as one of the oldest beyond tombstone_max {}",
                    self.cfg.agent.tombstone_max
                )
            };
            self.audit_share(
                r,
                crate::audit::Decision::Sweep,
                &format!("{} record removed {why}", r.phase.name()),
                None,
                None,
            );
        }
        Ok(removed.0.len())
    }
}

/// Discovery over the cgroup v2 mount the config names, or the one in the mount table.
fn open_discovery(cfg: &Config) -> Result<Discovery, OpenError> {
    let mount = match &cfg.agent.cgroup_root {
        Some(m) => m.clone(),
        None => discovery::cgroups::host_cgroup2_mount().ok_or_else(|| {
            OpenError::Discovery(
                "no cgroup v2 hierarchy in /proc/self/mountinfo; set [agent] cgroup_root".into(),
            )
        })?,
    };
    let roots = cfg
        .agent
        .pod_cgroup_roots
        .iter()
        .map(|r| {
            if r.is_absolute() {
                r.clone()
            } else {
                mount.join(r)
            }
        })
        .collect();
    let host_netns = discovery::process::own_netns_inode()
        .map_err(|e| OpenError::Discovery(format!("own network namespace: {e}")))?;
    Ok(Discovery::new(
        mount,
        roots,
        PathBuf::from("/proc"),
        host_netns,
        cfg.agent.kubelet_dir.as_deref(),
    ))
}

impl Engine {
    /// The amounts `r` is limited to: what it consumes, or for a dedicated allocation the
    /// device's whole capacity.
    fn limits_of(
        &self,
        r: &ShareRecord,
    ) -> std::collections::BTreeMap<String, shareguard_common::Quantity> {
        if r.is_dedicated() {
            self.cfg
                .device(&r.device)
                .map(|d| {
                    d.capacities
                        .iter()
                        .map(|(k, c)| (k.clone(), c.value))
                        .collect()
                })
                .unwrap_or_default()
        } else {
            (&r.consumed).into()
        }
    }

    /// What the limiter is asked to enforce for `r`: its amounts (a dedicated allocation:
    /// the device's whole capacity) on the sandboxes it was found in, together.
    fn spec_of(&self, r: &ShareRecord) -> LimitSpec {
        let limits = self.limits_of(r);
        let sandboxes = r.sandboxes();
        LimitSpec {
            share_key: r.key.clone(),
            device: r.device.to_string(),
            limits,
            target: Target {
                // Where kubelet's list cannot be had as it is, no pod: the watchdog acts
                // on no process rather than on ones the caller named.
                pod_uids: self
                    .discovery
                    .claim_pods(&r.claim, &r.target.pod_uids)
                    .unwrap_or_default(),
                cgroups: sandboxes
                    .iter()
                    .flat_map(|s| &s.cgroups)
                    .map(|c| self.discovery.mount().join(c.trim_start_matches('/')))
                    .collect(),
                host_ifaces: sandboxes
                    .iter()
                    .filter_map(|s| {
                        Some(HostIface {
                            index: s.host_ifindex?,
                            name: s.host_ifname.as_deref()?.to_owned(),
                        })
                    })
                    .collect(),
            },
        }
    }

    /// [`judge`] for `r`: against what it consumes, or for a dedicated allocation the
    /// device's whole capacity.
    fn judge(
        &self,
        r: &ShareRecord,
        e: &shareguard_common::limiter::Enforcement,
    ) -> (Phase, String) {
        judge(&self.limits_of(r), e)
    }
}

/// The mechanism's step for `name`, when `got` is below `want` by less than it: the
/// request held as closely as the mechanism can, on the safe side.
fn step_below<'a>(
    e: &'a shareguard_common::limiter::Enforcement,
    name: &str,
    want: &shareguard_common::Quantity,
    got: &shareguard_common::Quantity,
) -> Option<&'a shareguard_common::Quantity> {
    let step = e.resolution.get(name)?;
    (got < want && want.checked_sub(got)? < *step).then_some(step)
}

/// I5: ENFORCED only when every wanted capacity (what the share consumes; a dedicated
/// allocation's whole device) was read back equal to the request.
/// Returns the phase and, when it is not ENFORCED, why.
///
/// A back end that can only watch (the GPU watchdog where the driver offers no hard
/// limit) reads nothing back by design: such a share is ACCOUNTED, stated as not
/// enforced up front, rather than DEGRADED as if something had stopped working.
fn judge(
    wanted: &std::collections::BTreeMap<String, shareguard_common::Quantity>,
    e: &shareguard_common::limiter::Enforcement,
) -> (Phase, String) {
    let note = if e.simulated {
        " (SIMULATED GPU: no real driver holds this limit)"
    } else {
        ""
    };
    let notes: String = e.notes.iter().map(|n| format!("; {n}")).collect();
    if e.observed {
        return (
            Phase::Observed,
            format!(
                "observe stage: admitted, counted and its pod found; nothing limited{notes}{note}"
            ),
        );
    }
    if e.enforced.is_empty() && e.watch_only {
        return (
            Phase::Accounted,
            format!(
                "not enforced: {}the watchdog observes usage and acts on it{notes}{note}",
                // With a note, the GPU has a limit this share could not get: the note
                // says why.
                if e.notes.is_empty() {
                    "this GPU offers no hard memory limit; "
                } else {
                    ""
                }
            ),
        );
    }
    let mut unconstrained = Vec::new();
    let mut rounded = Vec::new();
    for (name, want) in wanted {
        let got = e.enforced.get(name);
        // Held per process (MPS): the share is held only while its processes together
        // cannot exceed it, i.e. while it has at most one. The bound read back is what
        // they may hold together; say both figures, never the per-process one alone.
        if let (Some(got), Some(per)) = (got, e.per_process.get(name)) {
            let each = &per.each;
            let n = per.processes;
            if got > want {
                return (
                    Phase::Degraded,
                    format!(
                        "{name}: {n} processes of the share, each bound to {each} on its own, may hold {got} together, more than the share's {want}; the watchdog sums them against the share{note}"
                    ),
                );
            }
            rounded.push(format!(
                "{name} held per process: each of the share's processes is bound to {each} on its own ({n} now); a further one would get {each} too, which the watchdog sums against the share"
            ));
        }
        match got {
            None => {
                return (
                    Phase::Degraded,
                    format!("{name}: nothing enforced was read back{notes}{note}"),
                );
            }
            // The path's own capacity is the bound, read back from the limiter's record
            // that nothing shapes the direction; it can only be below the request.
            Some(got) if e.unconstrained.contains(name) && got <= want => {
                unconstrained.push(format!(
                    "{name} unconstrained: the path carries at most {got}, below the limit {want}, so nothing shapes it"
                ));
            }
            // Held as closely as the mechanism can, on the safe side of the request.
            Some(got) if let Some(step) = step_below(e, name, want, got) => {
                rounded.push(format!(
                    "{name} held as {got}, the nearest step of {step} at or below {want}"
                ));
            }
            Some(got) if got != want => {
                return (
                    Phase::Degraded,
                    format!("{name}: read back {got}, requested {want}{note}"),
                );
            }
            Some(_) => {}
        }
    }
    let notes: String = unconstrained
        .iter()
        .chain(&rounded)
        .chain(&e.notes)
        .map(|u| format!("; {u}"))
        .collect();
    (
        Phase::Enforced,
        format!("limit applied and read back{notes}{note}"),
    )
}
