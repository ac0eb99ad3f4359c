//! [`GpuLimiter`]: the agent's `Limiter` for `gpu` devices, over any [`GpuBackend`].
//!
//! Per GPU it picks the strongest mechanism the back end offers, in the order
//! `nvml-cgroup` > `mps` > `watchdog`, and reports it (as the back end labels it, so the
//! simulated back end says `simulated-cgroup`) in `Enforcement.mechanism`. A watchdog-only
//! GPU yields no `enforced` entry: the agent then states the share as not enforced
//! up front, and the watchdog verifies and acts afterwards.
//!
//! The only capacity is `memory`, in bytes. The limiter keeps its own table of the
//! shares it applied and refuses one that would make a GPU's shares add up to more than
//! its capacity, whatever the caller's ledger says (defence in depth: the scheduler has
//! been seen to double count). The table lives in memory: after a restart `verify`
//! re-adopts each live share from its spec; `remove` of a share never seen by this
//! process has nothing to undo and succeeds (the driver drops a cgroup's limit with the
//! cgroup).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use shareguard_common::limiter::{
    CdiDevice, DeviceFacts, Enforcement, LimitSpec, Limiter, LimiterError, Needs,
};
use shareguard_common::{Format, Quantity};

use crate::backend::{GpuBackend, GpuInfo, Mechanism};
use crate::error::GpuError;
use crate::mps::enforceable_bytes;
use crate::watchdog::{Action, ProcessUsage, WatchedShare};

/// The one capacity a GPU device has.
pub const MEMORY: &str = "memory";

/// How a device config names its GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelector {
    Uuid(String),
    Index(u32),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDeviceConfig {
    /// Device name in the agent's inventory.
    pub name: String,
    pub gpu: GpuSelector,
    /// `memory` capacity in bytes; the GPU's total memory when None.
    pub memory_bytes: Option<u64>,
}

/// A configured device as resolved against the GPUs found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDevice {
    pub name: String,
    pub gpu: GpuInfo,
    pub capacity_bytes: u64,
    pub mechanism: Mechanism,
    /// Why stronger mechanisms were not chosen, for status and logs.
    pub not_chosen: Vec<(Mechanism, String)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ShareRecord {
    device: String,
    uuid: String,
    bytes: u64,
    mechanism: Mechanism,
    pod_uids: Vec<String>,
    cgroups: Vec<PathBuf>,
}

/// Host PID -> pod uid, as the watchdog maps GPU processes.
pub type PodLookup = Arc<dyn Fn(u32) -> Option<String> + Send + Sync>;

pub struct GpuLimiter {
    backend: Arc<dyn GpuBackend>,
    devices: BTreeMap<String, GpuDevice>,
    shares: Mutex<BTreeMap<String, ShareRecord>>,
    /// For the MPS read-back: a process of the share's pod outside its daemon.
    pod_of: PodLookup,
}

impl GpuLimiter {
    /// Discovers the GPUs, resolves each device config and probes its mechanism.
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        configs: &[GpuDeviceConfig],
    ) -> Result<Self, GpuError> {
        let gpus = backend.discover()?;
        let mut devices = BTreeMap::new();
        for c in configs {
            let gpu = match &c.gpu {
                GpuSelector::Uuid(u) => gpus.iter().find(|g| &g.uuid == u),
                GpuSelector::Index(i) => gpus.iter().find(|g| g.index == *i),
            }
            .ok_or_else(|| GpuError::GpuNotFound(format!("device {}: {:?}", c.name, c.gpu)))?
            .clone();
            let capacity_bytes = match c.memory_bytes {
                None => gpu.total_memory_bytes,
                Some(m) if m > 0 && m <= gpu.total_memory_bytes => m,
                Some(m) => {
                    return Err(GpuError::InvalidArgument(format!(
                        "device {}: memory {m} is not within 1..={} bytes of GPU {}",
                        c.name, gpu.total_memory_bytes, gpu.uuid
                    )));
                }
            };
            // One by index and one by uuid can still be the same GPU; only now is that
            // known. Its memory would be handed out twice.
            if let Some(other) = devices
                .values()
                .find(|d: &&GpuDevice| d.gpu.uuid == gpu.uuid)
            {
                return Err(GpuError::InvalidArgument(format!(
                    "devices {} and {} are the same GPU {}",
                    other.name, c.name, gpu.uuid
                )));
            }
            let (mechanism, not_chosen) = choose_mechanism(backend.as_ref(), &gpu.uuid);
            tracing::info!(
                device = %c.name,
                gpu = %gpu.uuid,
                backend = backend.name(),
                mechanism = %backend.mechanism_label(mechanism),
                not_chosen = ?not_chosen,
                "GPU device ready"
            );
            if devices
                .insert(
                    c.name.clone(),
                    GpuDevice {
                        name: c.name.clone(),
                        gpu,
                        capacity_bytes,
                        mechanism,
                        not_chosen,
                    },
                )
                .is_some()
            {
                return Err(GpuError::InvalidArgument(format!(
                    "device {} twice",
                    c.name
                )));
            }
        }
        Ok(Self {
            backend,
            devices,
            shares: Mutex::new(BTreeMap::new()),
            pod_of: Arc::new(|pid| {
                let roots = crate::cgroupns::agent_namespace().roots();
                crate::cgroup::pod_uid_of_pid(Path::new("/proc"), &roots, pid)
            }),
        })
    }

    /// Replaces how GPU processes are mapped to pods (tests; a different /proc).
    pub fn with_pod_lookup(mut self, pod_of: PodLookup) -> Self {
        self.pod_of = pod_of;
        self
    }

    /// A process of the share's pod on its GPU that is not a client of an MPS server:
    /// it allocates outside the daemon's limit.
    fn outside_mps(&self, rec: &ShareRecord) -> Result<Option<u32>, GpuError> {
        if rec.pod_uids.is_empty() {
            return Ok(None);
        }
        Ok(self
            .backend
            .compute_processes(&rec.uuid)?
            .into_iter()
            .filter(|p| !p.via_mps)
            .find(|p| (self.pod_of)(p.pid).is_some_and(|pod| rec.pod_uids.contains(&pod)))
            .map(|p| p.pid))
    }

    pub fn device(&self, name: &str) -> Option<&GpuDevice> {
        self.devices.get(name)
    }

    /// The label to report for a mechanism (the simulated back end's are prefixed).
    pub fn label(&self, m: Mechanism) -> String {
        self.backend.mechanism_label(m)
    }

    /// The share table as the watchdog needs it, every share with `action`.
    pub fn watched_shares(&self, action: Action) -> Vec<WatchedShare> {
        self.watched_shares_by(|_| action)
    }

    /// The share table as the watchdog needs it, each share with its device's action.
    pub fn watched_shares_by(&self, action_of: impl Fn(&str) -> Action) -> Vec<WatchedShare> {
        // A share of several pods is watched in each of them (the engine reports such a
        // share as not enforced for them together).
        self.lock()
            .iter()
            .flat_map(|(k, r)| {
                r.pod_uids.iter().map(|pod| WatchedShare {
                    share_key: k.clone(),
                    pod_uid: pod.clone(),
                    gpu_uuid: r.uuid.clone(),
                    limit_bytes: r.bytes,
                    action: action_of(&r.device),
                })
            })
            .collect()
    }

    /// UUIDs of the GPUs behind the configured devices, each once.
    pub fn gpu_uuids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.devices.values().map(|d| d.gpu.uuid.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Every compute process on this limiter's GPUs, as the watchdog takes them.
    pub fn process_usage(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        let mut out = Vec::new();
        for uuid in self.gpu_uuids() {
            for p in self.backend.compute_processes(&uuid)? {
                out.push(ProcessUsage {
                    gpu_uuid: uuid.clone(),
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                });
            }
        }
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, ShareRecord>> {
        // The table is only replaced entry by entry; a panic elsewhere cannot leave an
        // entry half written, so a poisoned lock still guards consistent data.
        self.shares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks `spec` and turns it into the record it would be stored as.
    fn record_for(&self, spec: &LimitSpec) -> Result<ShareRecord, GpuError> {
        let dev = self.devices.get(&spec.device).ok_or_else(|| {
            GpuError::InvalidArgument(format!("unknown GPU device {}", spec.device))
        })?;
        if let Some(other) = spec.limits.keys().find(|k| k.as_str() != MEMORY) {
            return Err(GpuError::InvalidArgument(format!(
                "GPU devices have only the {MEMORY} capacity, not {other}"
            )));
        }
        let q = spec
            .limits
            .get(MEMORY)
            .ok_or_else(|| GpuError::InvalidArgument(format!("no {MEMORY} amount")))?;
        let bytes = whole_bytes(q)?;
        if bytes > dev.capacity_bytes {
            return Err(GpuError::Oversubscribed(format!(
                "{bytes} bytes asked, device {} has {}",
                dev.name, dev.capacity_bytes
            )));
        }
        let cgroups = if dev.mechanism == Mechanism::NvmlCgroup {
            if spec.target.cgroups.is_empty() {
                return Err(GpuError::InvalidArgument(
                    "nvml-cgroup needs the pod's cgroup, and none was given".into(),
                ));
            }
            for cg in &spec.target.cgroups {
                check_cgroup(cg)?;
            }
            spec.target.cgroups.clone()
        } else {
            Vec::new()
        };
        Ok(ShareRecord {
            device: dev.name.clone(),
            uuid: dev.gpu.uuid.clone(),
            bytes,
            mechanism: dev.mechanism,
            pod_uids: spec.target.pod_uids.clone(),
            cgroups,
        })
    }

    /// Adds `rec` under `key` unless that oversubscribes its device or contradicts what
    /// is recorded for the key.
    fn admit(&self, key: &str, rec: &ShareRecord) -> Result<(), GpuError> {
        let mut shares = self.lock();
        if let Some(old) = shares.get(key)
            && (old.device != rec.device || old.bytes != rec.bytes)
        {
            return Err(GpuError::InvalidArgument(format!(
                "share {key} is recorded as {} bytes on {}; allocation results are immutable",
                old.bytes, old.device
            )));
        }
        let others: u64 = shares
            .iter()
            .filter(|(k, r)| k.as_str() != key && r.device == rec.device)
            .fold(0u64, |acc, (_, r)| acc.saturating_add(r.bytes));
        let capacity = self
            .devices
            .get(&rec.device)
            .map_or(0, |d| d.capacity_bytes);
        if others.saturating_add(rec.bytes) > capacity {
            return Err(GpuError::Oversubscribed(format!(
                "device {}: {} bytes held by other shares + {} asked > {} capacity",
                rec.device, others, rec.bytes, capacity
            )));
        }
        shares.insert(key.to_string(), rec.clone());
        Ok(())
    }

    /// The limit a cgroup must carry on a GPU: the sum of all recorded shares of that
    /// cgroup there (one pod may hold several shares of one GPU; the driver keeps one
    /// limit per cgroup and GPU).
    fn cgroup_total(&self, uuid: &str, cgroup: &Path) -> u64 {
        self.lock()
            .values()
            .filter(|r| r.uuid == uuid && r.cgroups.iter().any(|c| c == cgroup))
            .fold(0u64, |acc, r| acc.saturating_add(r.bytes))
    }

    fn enforce(&self, key: &str, rec: &ShareRecord) -> Result<(), GpuError> {
        match rec.mechanism {
            Mechanism::NvmlCgroup => {
                for cg in &rec.cgroups {
                    let total = self.cgroup_total(&rec.uuid, cg);
                    self.backend.set_cgroup_limit(&rec.uuid, cg, total)?;
                }
                Ok(())
            }
            Mechanism::Mps => {
                self.backend
                    .set_mps_limit(&rec.uuid, key, enforceable_bytes(rec.bytes))
            }
            Mechanism::Watchdog => Ok(()),
        }
    }

    /// Reads the limit back. The share counts as enforced only when every one of its
    /// cgroups carries exactly the expected limit; anything else yields no `enforced`
    /// entry, which the agent reports as DEGRADED rather than trusting it.
    fn read_back(&self, key: &str, rec: &ShareRecord) -> Result<Enforcement, GpuError> {
        // The bytes in force when the read-back agrees: the share's memory, or for MPS
        // that rounded down to the MiB its limits are set in.
        let in_force = match rec.mechanism {
            Mechanism::NvmlCgroup => {
                let mut all = true;
                for cg in &rec.cgroups {
                    let want = self.cgroup_total(&rec.uuid, cg);
                    let got = self.backend.cgroup_limit(&rec.uuid, cg)?;
                    if got.map(|l| l.hard_bytes) != Some(want) {
                        tracing::warn!(
                            share = key,
                            cgroup = %cg.display(),
                            want,
                            got = ?got,
                            "GPU memory limit read back differs"
                        );
                        all = false;
                    }
                }
                all.then_some(rec.bytes)
            }
            Mechanism::Mps => {
                let want = enforceable_bytes(rec.bytes);
                let got = self.backend.mps_limit(&rec.uuid, key)?;
                if !got.is_some_and(|l| l.admits(want)) {
                    tracing::warn!(share = key, want, got = ?got, "MPS limit read back differs");
                    None
                } else if let Some(pid) = self.outside_mps(rec)? {
                    // The daemon holds the limit, but this process never asked it: a
                    // container that lost or replaced CUDA_MPS_PIPE_DIRECTORY runs on the
                    // GPU directly, unlimited.
                    tracing::warn!(
                        share = key,
                        pid,
                        pods = ?rec.pod_uids,
                        "a process of the share's pod uses the GPU outside its MPS daemon"
                    );
                    None
                } else {
                    Some(want)
                }
            }
            Mechanism::Watchdog => None,
        };
        let mut enforced = BTreeMap::new();
        if let Some(bytes) = in_force {
            let q = Quantity::from_units(i128::from(bytes), Format::BinarySI)
                .ok_or_else(|| GpuError::Internal(format!("{bytes} bytes as a quantity")))?;
            enforced.insert(MEMORY.to_string(), q);
        }
        Ok(Enforcement {
            mechanism: self.label(rec.mechanism),
            enforced,
            watch_only: !rec.mechanism.enforces(),
            simulated: self.backend.is_simulated(),
            unconstrained: Default::default(),
            // Memory limits are whole bytes, as requested: no rounding to allow for.
            resolution: Default::default(),
        })
    }

    fn apply_inner(&self, spec: &LimitSpec) -> Result<Enforcement, GpuError> {
        let rec = self.record_for(spec)?;
        // Recorded before the driver is touched, so that `remove` can undo a partial
        // apply (one cgroup limited, the next failing).
        self.admit(&spec.share_key, &rec)?;
        self.enforce(&spec.share_key, &rec)?;
        self.read_back(&spec.share_key, &rec)
    }

    fn verify_inner(&self, spec: &LimitSpec) -> Result<Enforcement, GpuError> {
        let recorded = self.lock().get(&spec.share_key).cloned();
        let rec = match recorded {
            Some(r) => r,
            None => {
                // First sight since a restart: adopt the share without touching the
                // driver, so its capacity counts again and `remove` can undo it.
                let r = self.record_for(spec)?;
                self.admit(&spec.share_key, &r)?;
                r
            }
        };
        self.read_back(&spec.share_key, &rec)
    }

    fn remove_inner(&self, key: &str) -> Result<(), GpuError> {
        let Some(rec) = self.lock().get(key).cloned() else {
            tracing::debug!(
                share = key,
                "GPU share not known to this process; nothing to remove"
            );
            return Ok(());
        };
        match rec.mechanism {
            Mechanism::NvmlCgroup => {
                for cg in &rec.cgroups {
                    let rest = self.cgroup_total(&rec.uuid, cg).saturating_sub(rec.bytes);
                    if rest == 0 {
                        self.backend.clear_cgroup_limit(&rec.uuid, cg)?;
                    } else {
                        self.backend.set_cgroup_limit(&rec.uuid, cg, rest)?;
                    }
                }
            }
            Mechanism::Mps => self.backend.clear_mps_limit(&rec.uuid, key)?,
            Mechanism::Watchdog => {}
        }
        // Dropped only once the driver is clean, so a failed remove is retried in full.
        self.lock().remove(key);
        Ok(())
    }
}

impl Limiter for GpuLimiter {
    fn mechanisms(&self) -> Vec<String> {
        let mut ms: Vec<Mechanism> = self.devices.values().map(|d| d.mechanism).collect();
        // The watchdog runs everywhere as the verifier.
        ms.push(Mechanism::Watchdog);
        ms.sort();
        ms.dedup();
        ms.into_iter().map(|m| self.label(m)).collect()
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn device_facts(&self, device: &str) -> DeviceFacts {
        let Some(d) = self.devices.get(device) else {
            return DeviceFacts::default();
        };
        let [uuid, model] = shareguard_common::slice::GPU_ATTRIBUTES;
        let mut attributes = BTreeMap::from([(uuid.to_owned(), d.gpu.uuid.clone())]);
        if !d.gpu.name.is_empty() {
            attributes.insert(model.to_owned(), d.gpu.name.clone());
        }
        DeviceFacts {
            mechanism: self.label(d.mechanism),
            // A simulated GPU limits nothing real, and the watchdog acts only after a
            // pod went over.
            enforces: d.mechanism.enforces() && !self.backend.is_simulated(),
            attributes,
        }
    }

    /// A per-cgroup hard limit needs the pod's cgroup; MPS daemons and the watchdog need
    /// nothing of the pod and are in place before its containers start.
    fn needs(&self, device: &str) -> Needs {
        match self.devices.get(device).map(|d| d.mechanism) {
            Some(Mechanism::NvmlCgroup) => Needs::Cgroup,
            _ => Needs::Nothing,
        }
    }

    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.apply_inner(spec).map_err(|e| {
            tracing::warn!(share = %spec.share_key, device = %spec.device, error = %e, "GPU apply failed");
            e.into()
        })
    }

    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Ok(self.verify_inner(spec)?)
    }

    fn remove(&self, share_key: &str) -> Result<(), LimiterError> {
        Ok(self.remove_inner(share_key)?)
    }

    fn cdi_device(&self, device: &str, share_key: &str) -> Option<CdiDevice> {
        let d = self.devices.get(device)?;
        Some(CdiDevice {
            gpu_uuid: d.gpu.uuid.clone(),
            // Only a share that runs through its own MPS daemon has a pipe directory to
            // hand to its containers.
            mps: (d.mechanism == Mechanism::Mps)
                .then(|| self.backend.mps_dirs(share_key))
                .flatten(),
        })
    }
}

fn choose_mechanism(backend: &dyn GpuBackend, uuid: &str) -> (Mechanism, Vec<(Mechanism, String)>) {
    let caps = match backend.capabilities(uuid) {
        Ok(c) => c,
        Err(e) => {
            // A failed probe leaves the GPU usable under the watchdog; the reason is
            // kept for the device's status.
            let why = format!("probe failed: {e}");
            return (
                Mechanism::Watchdog,
                vec![(Mechanism::NvmlCgroup, why.clone()), (Mechanism::Mps, why)],
            );
        }
    };
    let mut not_chosen = Vec::new();
    for (m, support) in [
        (Mechanism::NvmlCgroup, &caps.cgroup_limits),
        (Mechanism::Mps, &caps.mps),
    ] {
        match support {
            crate::backend::Support::Supported => return (m, not_chosen),
            crate::backend::Support::Unsupported(why) => not_chosen.push((m, why.clone())),
        }
    }
    (Mechanism::Watchdog, not_chosen)
}

/// Bytes of a memory quantity: positive, whole, and within u64.
fn whole_bytes(q: &Quantity) -> Result<u64, GpuError> {
    let nanos = q.nanos();
    if nanos <= 0 || nanos % 1_000_000_000 != 0 {
        return Err(GpuError::InvalidArgument(format!(
            "memory {q} is not a positive whole number of bytes"
        )));
    }
    u64::try_from(nanos / 1_000_000_000)
        .map_err(|_| GpuError::InvalidArgument(format!("memory {q} is too large")))
}

/// A cgroup the agent found for the share's pod: an absolute path without `..`, so
/// that NVML is never pointed anywhere the agent did not look.
fn check_cgroup(p: &Path) -> Result<(), GpuError> {
    if !p.is_absolute() || p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(GpuError::InvalidArgument(format!(
            "cgroup {} is not an absolute path without ..",
            p.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
#[path = "limiter_tests.rs"]
mod tests;
