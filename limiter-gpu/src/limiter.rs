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
    CdiDevice, DeviceFacts, DeviceFault, Enforcement, LimitSpec, Limiter, LimiterError, Needs,
    PerProcess,
};
use shareguard_common::{Format, Quantity};

use crate::backend::{GpuBackend, GpuInfo, Mechanism};
use crate::driver::{DeviceDriver, DriverEdits, DriverRoot};
use crate::error::GpuError;
use crate::mps::enforceable_bytes;
use crate::watchdog::{
    Action, ProcessTerminator, ProcessUsage, TerminateDecision, TerminateError, Terminated,
    WatchedShare,
};

mod read_back;
mod watch;

/// The one capacity a GPU device has.
pub const MEMORY: &str = "memory";

/// How a device config names its GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelector {
    Uuid(String),
    Index(u32),
    /// `gpus = "all"`: the device stands for every GPU its back end lists when the agent
    /// starts. The agent makes one device of each ([`crate::setup::list`]) before any
    /// limiter is built, so no limiter resolves this.
    All,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuDeviceConfig {
    /// Device name in the agent's inventory.
    pub name: String,
    pub gpu: GpuSelector,
    /// `memory` capacity in bytes; the GPU's total memory when None.
    pub memory_bytes: Option<u64>,
    /// Where the driver's files are on the host (see [`crate::driver`]); the share's
    /// containers get their device nodes and libraries from it. None gives them
    /// neither, which only a simulated GPU may do.
    pub driver_root: Option<PathBuf>,
    /// Where the agent's container mounts the host's driver root, if it does.
    pub container_driver_root: Option<PathBuf>,
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

/// See [`GpuLimiter::mps_clients`].
#[derive(Clone, Copy, Debug, Default)]
struct MpsClients {
    clients: u64,
    outside: Option<u32>,
    /// A process of the share's pods running as root outside a user namespace.
    root: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ShareRecord {
    device: String,
    uuid: String,
    bytes: u64,
    mechanism: Mechanism,
    pod_uids: Vec<String>,
    cgroups: Vec<PathBuf>,
    /// Why this share has another mechanism than its device, for its status.
    note: Option<String>,
    /// The device is in the rollout's observe stage: nothing limits the share, and the
    /// watchdog only reports its usage (never terminates), whatever the device's action.
    observed: bool,
}

/// Host PID -> pod uid, as the watchdog maps GPU processes.
pub type PodLookup = Arc<dyn Fn(u32) -> Option<String> + Send + Sync>;
/// Whether a process runs as root outside a user namespace (see
/// [`crate::mps::root_without_user_namespace`]).
pub type RootLookup = Arc<dyn Fn(u32) -> bool + Send + Sync>;

pub struct GpuLimiter {
    backend: Arc<dyn GpuBackend>,
    devices: BTreeMap<String, GpuDevice>,
    shares: Mutex<BTreeMap<String, ShareRecord>>,
    /// The driver files of each device that has a driver root.
    drivers: BTreeMap<String, DeviceDriver>,
    /// For the MPS read-back: a process of the share's pod outside its daemon.
    pod_of: PodLookup,
    /// For the MPS read-back: a process of the share's pod that could take the daemon's
    /// socket over.
    is_root: RootLookup,
    /// What each GPU (by UUID) last answered the watchdog's process query: absent or
    /// None when it answered, the error when it did not. The device's health, read
    /// without calling the driver on the caller's thread: a failing GPU can keep an NVML
    /// call waiting for seconds, and the watchdog asks on a thread of its own.
    answered: Mutex<BTreeMap<String, Option<String>>>,
}

impl GpuLimiter {
    /// Discovers the GPUs, resolves each device config and probes its mechanism.
    pub fn new(
        backend: Arc<dyn GpuBackend>,
        configs: &[GpuDeviceConfig],
    ) -> Result<Self, GpuError> {
        let gpus = backend.discover()?;
        let mut devices = BTreeMap::new();
        let mut drivers = BTreeMap::new();
        for c in configs {
            let gpu = match &c.gpu {
                GpuSelector::Uuid(u) => gpus.iter().find(|g| &g.uuid == u),
                GpuSelector::Index(i) => gpus.iter().find(|g| g.index == *i),
                GpuSelector::All => None,
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
            if let Some(root) = &c.driver_root {
                // The simulated back end's version names no files; the libraries there
                // are whichever one version the root holds.
                let version = (!backend.is_simulated()).then(|| gpu.driver_version.clone());
                let root = DriverRoot::new(root, c.container_driver_root.as_deref())?;
                let driver = DeviceDriver::new(root, version, gpu.minor);
                if let Err(why) = driver.edits() {
                    tracing::error!(
                        device = %c.name,
                        gpu = %gpu.uuid,
                        error = %why,
                        "the GPU's containers could not run CUDA: its shares are refused and it is not published as enforcing until the driver root has what is missing"
                    );
                }
                drivers.insert(c.name.clone(), driver);
            }
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
            drivers,
            pod_of: Arc::new(|pid| {
                let roots = crate::cgroupns::agent_namespace().roots();
                crate::cgroup::pod_uid_of_pid(Path::new("/proc"), &roots, pid)
            }),
            is_root: Arc::new(crate::mps::root_without_user_namespace),
            answered: Mutex::new(BTreeMap::new()),
        })
    }

    /// Replaces how GPU processes are mapped to pods (tests; a different /proc).
    pub fn with_pod_lookup(mut self, pod_of: PodLookup) -> Self {
        self.pod_of = pod_of;
        self
    }

    /// Replaces how root processes are told (tests).
    pub fn with_root_lookup(mut self, is_root: RootLookup) -> Self {
        self.is_root = is_root;
        self
    }

    /// The share's processes on its GPU as MPS sees them: how many are clients of an MPS
    /// server (each bound to the limit on its own), and one that is not, which allocates
    /// outside any daemon's limit.
    fn mps_clients(&self, rec: &ShareRecord) -> Result<MpsClients, GpuError> {
        let mut seen = MpsClients::default();
        if rec.pod_uids.is_empty() {
            return Ok(seen);
        }
        for p in self.backend.compute_processes(&rec.uuid)? {
            if !(self.pod_of)(p.pid).is_some_and(|pod| rec.pod_uids.contains(&pod)) {
                continue;
            }
            if p.via_mps {
                seen.clients += 1;
            } else {
                seen.outside.get_or_insert(p.pid);
            }
            if (self.is_root)(p.pid) {
                seen.root.get_or_insert(p.pid);
            }
        }
        Ok(seen)
    }

    pub fn device(&self, name: &str) -> Option<&GpuDevice> {
        self.devices.get(name)
    }

    /// The label to report for a mechanism (the simulated back end's are prefixed).
    pub fn label(&self, m: Mechanism) -> String {
        self.backend.mechanism_label(m)
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
        let mut mechanism = dev.mechanism;
        let mut note = None;
        let cgroups = if dev.mechanism == Mechanism::NvmlCgroup {
            if spec.target.cgroups.is_empty() {
                return Err(GpuError::InvalidArgument(
                    "nvml-cgroup needs the pod's cgroup, and none was given".into(),
                ));
            }
            for cg in &spec.target.cgroups {
                check_cgroup(cg)?;
            }
            // A pod whose cgroup cannot carry the limit falls back on its own; the
            // device's other shares keep the hard limit. Not to mps: its pipe directory
            // would have had to be in the claim's CDI spec, written before the pod
            // existed, so the containers would run outside the daemon.
            match spec
                .target
                .cgroups
                .iter()
                .find_map(|cg| self.backend.cgroup_ready(cg).err())
            {
                Some(why) => {
                    tracing::warn!(share = %spec.share_key, reason = %why, "nvml-cgroup cannot bind for this share; the watchdog watches it");
                    mechanism = Mechanism::Watchdog;
                    note = Some(format!(
                        "{} not used for this share: {why}; the watchdog watches it instead",
                        self.label(Mechanism::NvmlCgroup)
                    ));
                    Vec::new()
                }
                None => spec.target.cgroups.clone(),
            }
        } else {
            Vec::new()
        };
        Ok(ShareRecord {
            device: dev.name.clone(),
            uuid: dev.gpu.uuid.clone(),
            bytes,
            mechanism,
            pod_uids: spec.target.pod_uids.clone(),
            cgroups,
            note,
            observed: false,
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

    /// Where a pod cgroup's limit goes: the pod's cgroup and each container's leaf cgroup
    /// below it that can carry one. NVIDIA documents that a limit on a pod (or a slice)
    /// may not reach its containers, whose leaves have their own `dmem.max`. A leaf that
    /// cannot carry a limit is left out (the pod's limit is what there is for it).
    fn targets(&self, pod_cgroup: &Path) -> Vec<PathBuf> {
        let mut out = vec![pod_cgroup.to_path_buf()];
        let Ok(entries) = std::fs::read_dir(pod_cgroup) else {
            return out;
        };
        let mut leaves: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .filter(|p| self.backend.cgroup_ready(p).is_ok())
            .collect();
        leaves.sort();
        out.extend(leaves);
        out
    }

    /// Gives the leaf cgroups that appeared below the share's pod cgroups since it was
    /// applied (a container started) the pod's limit: the pod growing, not drift. The
    /// agent calls it from every watchdog poll, so a new container waits at most one
    /// period for its limit; `verify` does it too.
    pub fn follow_leaves(&self) {
        let recs: Vec<(String, ShareRecord)> = self
            .lock()
            .iter()
            .filter(|(_, r)| r.mechanism == Mechanism::NvmlCgroup)
            .map(|(k, r)| (k.clone(), r.clone()))
            .collect();
        for (key, rec) in recs {
            if let Err(e) = self.limit_new_leaves(&key, &rec) {
                tracing::warn!(share = %key, error = %e, "could not limit a new container cgroup");
            }
        }
    }

    fn limit_new_leaves(&self, key: &str, rec: &ShareRecord) -> Result<(), GpuError> {
        for cg in &rec.cgroups {
            let total = self.cgroup_total(&rec.uuid, cg);
            for leaf in self.targets(cg).into_iter().skip(1) {
                if self.backend.cgroup_limit(&rec.uuid, &leaf)?.is_none() {
                    tracing::info!(share = key, cgroup = %leaf.display(), "limiting a new container cgroup of the share's pod");
                    self.backend.set_cgroup_limit(&rec.uuid, &leaf, total)?;
                }
            }
        }
        Ok(())
    }

    fn enforce(&self, key: &str, rec: &ShareRecord) -> Result<(), GpuError> {
        match rec.mechanism {
            Mechanism::NvmlCgroup => {
                for cg in &rec.cgroups {
                    let total = self.cgroup_total(&rec.uuid, cg);
                    for t in self.targets(cg) {
                        self.backend.set_cgroup_limit(&rec.uuid, &t, total)?;
                    }
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

    /// The device's driver edits; None for a device without a driver root, an error
    /// naming what its root lacks.
    fn driver_edits(&self, device: &str) -> Result<Option<Arc<DriverEdits>>, GpuError> {
        match self.drivers.get(device) {
            None => Ok(None),
            Some(d) => d.edits().map(Some).map_err(GpuError::Unavailable),
        }
    }

    fn apply_inner(&self, spec: &LimitSpec) -> Result<Enforcement, GpuError> {
        // A container that cannot reach the driver would run no CUDA at all: refused
        // before anything is limited.
        self.driver_edits(&spec.device)?;
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
        if rec.observed {
            return Err(GpuError::Transient(format!(
                "share {} is only watched (installed for the observe stage), not limited",
                spec.share_key
            )));
        }
        if rec.mechanism == Mechanism::NvmlCgroup {
            self.limit_new_leaves(&spec.share_key, &rec)?;
        }
        self.read_back(&spec.share_key, &rec)
    }

    /// The share as the observe stage keeps it: in the table for the watchdog, which
    /// reports its usage against its amount, and limited by nothing.
    fn observed_record(&self, spec: &LimitSpec) -> Result<ShareRecord, GpuError> {
        Ok(ShareRecord {
            mechanism: Mechanism::Watchdog,
            cgroups: Vec::new(),
            note: None,
            observed: true,
            ..self.record_for(spec)?
        })
    }

    fn observed_enforcement(&self) -> Enforcement {
        Enforcement {
            mechanism: self.label(Mechanism::Watchdog),
            observed: true,
            simulated: self.backend.is_simulated(),
            notes: vec![
                "the watchdog reports its GPU memory use against its amount and acts on nothing"
                    .to_owned(),
            ],
            ..Enforcement::default()
        }
    }

    fn observe_inner(&self, spec: &LimitSpec) -> Result<Enforcement, GpuError> {
        self.driver_edits(&spec.device)?;
        let rec = self.observed_record(spec)?;
        // A limit an earlier stage set comes off first (and the record with it).
        if self
            .lock()
            .get(&spec.share_key)
            .is_some_and(|r| !r.observed)
        {
            self.remove_inner(&spec.share_key)?;
        }
        self.admit(&spec.share_key, &rec)?;
        Ok(self.observed_enforcement())
    }

    fn verify_observed_inner(&self, spec: &LimitSpec) -> Result<Enforcement, GpuError> {
        let recorded = self.lock().get(&spec.share_key).cloned();
        match recorded {
            Some(r) if r.observed => {}
            Some(_) => {
                return Err(GpuError::Transient(format!(
                    "share {} is limited while its device observes",
                    spec.share_key
                )));
            }
            // First sight since a restart: adopt it as observed, touching nothing.
            None => self.admit(&spec.share_key, &self.observed_record(spec)?)?,
        }
        Ok(self.observed_enforcement())
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
                    // Leaves first: the pod's limit stays over them until they are clear.
                    for t in self.targets(cg).iter().rev() {
                        if rest == 0 {
                            self.backend.clear_cgroup_limit(&rec.uuid, t)?;
                        } else {
                            self.backend.set_cgroup_limit(&rec.uuid, t, rest)?;
                        }
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
        let [uuid, model, binds] = shareguard_common::slice::GPU_ATTRIBUTES;
        let mut attributes = BTreeMap::from([
            (uuid.to_owned(), d.gpu.uuid.clone()),
            (binds.to_owned(), d.mechanism.binds().to_owned()),
        ]);
        if !d.gpu.name.is_empty() {
            attributes.insert(model.to_owned(), d.gpu.name.clone());
        }
        // Where the GPU sits: the PCI address the driver gives, its root and NUMA node
        // from sysfs (what a claim aligns a NIC with).
        let mut int_attributes = BTreeMap::new();
        if let Some(bus) = &d.gpu.pci_bus_id {
            let mut p = shareguard_common::pci::placement(
                &std::path::Path::new(shareguard_common::pci::SYS_BUS_PCI_DEVICES).join(bus),
            );
            // The driver's address, also where sysfs has no such device to resolve.
            p.pci_bus_id = Some(bus.clone());
            p.add_attributes(&mut attributes, &mut int_attributes);
        }
        DeviceFacts {
            mechanism: self.label(d.mechanism),
            // A simulated GPU limits nothing real, the watchdog acts only after a pod
            // went over, and a share whose containers cannot reach the driver is refused.
            enforces: d.mechanism.enforces()
                && !self.backend.is_simulated()
                && self.driver_edits(device).is_ok(),
            attributes,
            int_attributes,
            // The call the watchdog makes every poll: a GPU that does not answer it (lost
            // from the bus, the driver gone or reloading) holds no share's memory to
            // anything the agent can see.
            // What the GPU last answered the watchdog, which asks every poll.
            fault: self
                .answered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .get(&d.gpu.uuid)
                .cloned()
                .flatten()
                .map(|e| {
                    DeviceFault::new(
                        "gpu-not-answering",
                        format!("GPU {} does not answer the driver: {e}", d.gpu.uuid),
                    )
                }),
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

    fn observe(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Ok(self.observe_inner(spec)?)
    }

    fn verify_observed(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Ok(self.verify_observed_inner(spec)?)
    }

    fn cdi_device(&self, device: &str, share_key: &str) -> Option<CdiDevice> {
        let d = self.devices.get(device)?;
        // Apply refused the share while the root lacked something; a root that lost
        // files since gives no driver edits rather than paths that are gone.
        let driver = self.driver_edits(device).ok().flatten();
        Some(CdiDevice {
            device_nodes: driver
                .as_ref()
                .map(|e| e.device_nodes.clone())
                .unwrap_or_default(),
            mounts: driver.map(|e| e.mounts.clone()).unwrap_or_default(),
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

/// The step MPS limits are set in.
const MPS_STEP: u64 = 1 << 20;

fn quantity(bytes: u64) -> Result<Quantity, GpuError> {
    Quantity::from_units(i128::from(bytes), Format::BinarySI)
        .ok_or_else(|| GpuError::Internal(format!("{bytes} bytes as a quantity")))
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
