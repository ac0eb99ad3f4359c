//! The one interface every GPU back end (NVML, simulated) implements.
//!
//! It is deliberately small and byte-based: the limiter decides *what* to enforce, the
//! back end only talks to the driver. All calls are blocking, like the rest of the
//! limiter interface; the agent runs them on blocking threads.

use std::fmt;
use std::path::Path;

use crate::error::GpuError;

/// Multi-Instance GPU state as the driver reports it now (not the pending mode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MigMode {
    Disabled,
    Enabled,
    /// The GPU has no MIG support at all (most GPUs before Ampere A100/H100).
    NotSupported,
}

/// One physical GPU as discovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// "GPU-xxxxxxxx-..." as NVML reports it; stable across reboots, unlike the index.
    pub uuid: String,
    pub index: u32,
    pub name: String,
    pub total_memory_bytes: u64,
    pub mig: MigMode,
    pub driver_version: String,
    /// The minor number of the GPU's device node, `/dev/nvidia<minor>`; None where the
    /// driver cannot say. It is not the index: NVML orders GPUs by PCI bus id.
    pub minor: Option<u32>,
    /// The GPU's PCI address in sysfs's spelling (`0000:3b:00.0`), where the driver
    /// gives one: where the GPU sits in the machine ([`shareguard_common::pci`]).
    pub pci_bus_id: Option<String>,
}

/// A process that holds a compute context on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeProcess {
    /// PID in the host's PID namespace (the agent runs with hostPID, as NVML reports
    /// driver-side PIDs).
    pub pid: u32,
    /// Device memory the process uses; None where the driver cannot say.
    pub used_bytes: Option<u64>,
    /// True for a client of an MPS server (NVML lists those apart). A process of an MPS
    /// share that is not one runs outside its daemon's limit.
    pub via_mps: bool,
}

/// Whether a mechanism can be used on one GPU, and if not, why (for status and logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Support {
    Supported,
    Unsupported(String),
}

impl Support {
    pub fn is_supported(&self) -> bool {
        matches!(self, Support::Supported)
    }
}

/// What one GPU offers, probed once per GPU and re-probed on demand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Per-cgroup hard memory limits (`nvmlDeviceSetMemoryLimits_v1`, driver R615+).
    pub cgroup_limits: Support,
    /// Per-share pinned device memory limits through an MPS control daemon.
    pub mps: Support,
}

/// Limits read back for one cgroup on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLimit {
    pub soft_bytes: u64,
    pub hard_bytes: u64,
    pub used_bytes: u64,
}

/// An MPS limit as read back: the true value lies in `bytes .. bytes + granularity`,
/// because the control program shows limits of 1 GiB and more in whole GiB.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpsLimit {
    pub bytes: u64,
    pub granularity: u64,
}

impl MpsLimit {
    /// An exact reading, as the simulated back end gives.
    pub fn exact(bytes: u64) -> Self {
        Self {
            bytes,
            granularity: 1,
        }
    }

    /// Whether a limit set to `want` would read back as this.
    pub fn admits(&self, want: u64) -> bool {
        want >= self.bytes && want - self.bytes < self.granularity.max(1)
    }
}

/// Enforcement mechanisms, strongest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mechanism {
    NvmlCgroup,
    Mps,
    Watchdog,
}

impl Mechanism {
    pub const ALL: [Mechanism; 3] = [Mechanism::NvmlCgroup, Mechanism::Mps, Mechanism::Watchdog];

    /// The name in `ShareStatus.mechanism` for a real back end.
    pub fn as_str(self) -> &'static str {
        match self {
            Mechanism::NvmlCgroup => "nvml-cgroup",
            Mechanism::Mps => "mps",
            Mechanism::Watchdog => "watchdog",
        }
    }

    /// True when the mechanism stops allocations up front; the watchdog only reacts.
    pub fn enforces(self) -> bool {
        !matches!(self, Mechanism::Watchdog)
    }

    /// What the limit holds to the share's amount, as the slice's `binds` attribute
    /// says it: the share's processes together (a per-cgroup limit on the pod), each
    /// process on its own (an MPS server's pinned limit binds each client), or none
    /// up front (the watchdog).
    pub fn binds(self) -> &'static str {
        match self {
            Mechanism::NvmlCgroup => "share",
            Mechanism::Mps => "process",
            Mechanism::Watchdog => "none",
        }
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A GPU driver interface.
///
/// Methods that take a `uuid` fail with [`GpuError::GpuNotFound`] for an unknown GPU.
/// Cgroup paths are absolute paths under the cgroup v2 mount (`/sys/fs/cgroup/...`),
/// which is what NVML expects.
pub trait GpuBackend: Send + Sync {
    /// "nvml" or "simulated"; goes into status, metrics and logs.
    fn name(&self) -> &'static str;

    /// True for the simulated back end. A simulated result must never be reported as
    /// real enforcement, so callers use this to label it.
    fn is_simulated(&self) -> bool;

    /// The mechanism name to report. The simulated back end overrides this so that no
    /// status, metric or log can mistake it for NVML.
    fn mechanism_label(&self, m: Mechanism) -> String {
        m.as_str().to_string()
    }

    fn discover(&self) -> Result<Vec<GpuInfo>, GpuError>;

    fn compute_processes(&self, uuid: &str) -> Result<Vec<ComputeProcess>, GpuError>;

    fn capabilities(&self, uuid: &str) -> Result<Capabilities, GpuError>;

    /// Sets soft and hard limit of `cgroup` on the GPU to `bytes`.
    fn set_cgroup_limit(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), GpuError>;

    /// Whether a per-cgroup limit can bind in `cgroup` (NVML: the dmem controller's files
    /// are there, see [`crate::dmem`]); Err says why not. A share whose cgroup it is not
    /// falls back to another mechanism instead of failing.
    fn cgroup_ready(&self, _cgroup: &Path) -> Result<(), String> {
        Ok(())
    }

    /// Reads the limit back; None when the cgroup has no limit on this GPU.
    fn cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<Option<CgroupLimit>, GpuError>;

    /// Zeroes the soft limit and lifts the hard limit. Done before a pod's cgroup goes
    /// away: with the dmem back end of the driver the soft limit is propagated to the
    /// ancestors and only an explicit reset through NVML takes it back out.
    fn clear_cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<(), GpuError>;

    /// Sets the MPS pinned device memory limit for a share (a whole number of MiB).
    fn set_mps_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError>;

    /// Reads the MPS limit of a share back; None when there is none.
    fn mps_limit(&self, uuid: &str, share_key: &str) -> Result<Option<MpsLimit>, GpuError>;

    fn clear_mps_limit(&self, uuid: &str, share_key: &str) -> Result<(), GpuError>;

    /// Ends the GPU work of MPS client `pid` through the server of the share's daemon
    /// (see [`crate::mps::MpsDaemons::terminate_client`]). Ok(false): the process is no
    /// client of it, or the back end runs no daemons.
    fn terminate_mps_client(
        &self,
        _uuid: &str,
        _share_key: &str,
        _pid: u32,
    ) -> Result<bool, GpuError> {
        Ok(false)
    }

    /// Where a share's containers meet its MPS control daemon, where the share runs
    /// through a real one.
    fn mps_dirs(&self, _share_key: &str) -> Option<shareguard_common::limiter::MpsDirs> {
        None
    }
}
