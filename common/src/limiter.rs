//! The limiter interface: how the agent asks a device's back end to enforce a share and
//! to say what the kernel or driver really enforces.
//!
//! The calls are synchronous on purpose: back ends talk netlink, switch network
//! namespaces or call NVML, all of which block or must stay on one OS thread. The agent
//! runs them on blocking threads, never on an async worker.

use std::{collections::BTreeMap, path::PathBuf};

use crate::quantity::Quantity;

/// Where a share's limit applies: the sandbox of the share's pod as the agent found and
/// verified it in the kernel (never a place a caller named). Limiters act on nothing
/// else (I9, docs/architecture.md).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Target {
    /// Every pod the share belongs to.
    pub pod_uids: Vec<String>,
    /// The pod's cgroup v2 directories, absolute: the pod's own cgroup, or cgroups below
    /// it that a verified hint named. Empty when the limiter needs none.
    pub cgroups: Vec<PathBuf>,
    /// The host side of each pod's veth, when the limiter needs the pods' network: one
    /// limit holds the traffic of all of them together, since a second pod on the claim
    /// must not get a rate of its own.
    pub host_ifaces: Vec<HostIface>,
}

/// The host-side end of a pod's veth pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIface {
    pub index: u32,
    pub name: String,
}

/// What a share needs from its pod's sandbox before a limiter can enforce it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Needs {
    /// Nothing of the pod: enforced at Prepare (accounting, MPS daemons, the watchdog).
    Nothing,
    /// The pod's cgroup (a per-cgroup GPU memory limit).
    Cgroup,
    /// The pod's own network namespace and the host side of its veth (bandwidth).
    Network,
}

/// One share to enforce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitSpec {
    /// Stable key of the share (its shareID, or a derived key for dedicated allocations);
    /// back ends derive pin paths and handles from it, so it must be deterministic.
    pub share_key: String,
    /// Device name from the agent's inventory.
    pub device: String,
    /// Capacity name -> amount to enforce.
    pub limits: BTreeMap<String, Quantity>,
    pub target: Target,
}

/// What a back end read back after applying or verifying a share.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Enforcement {
    /// Mechanism name as reported in `ShareStatus.mechanism`, e.g. "htb" or "nvml-cgroup".
    pub mechanism: String,
    /// Capacity name -> limit read back from the kernel or driver. A capacity missing here
    /// is not enforced.
    pub enforced: BTreeMap<String, Quantity>,
    /// The mechanism only watches and acts afterwards (the GPU watchdog): it reads no
    /// limit back by design, which is not the same as a limit that stopped working.
    pub watch_only: bool,
    /// Nothing real holds the limit: a simulated device, for tests and demos.
    pub simulated: bool,
    /// Capacities whose limit is at or above what the device's path carries (its
    /// configured line rate): nothing shapes them, since the path itself stays below the
    /// limit, and `enforced` holds that line rate, the bound that actually applies.
    pub unconstrained: std::collections::BTreeSet<String>,
    /// Capacity name -> the finest step the mechanism holds a limit in (bandwidth: whole
    /// bytes per second, 8 bit/s). A read-back below the request by less than one step
    /// is the request held as closely as the mechanism can, rounded toward the safe side,
    /// not drift. Absent: the read-back must equal the request.
    pub resolution: BTreeMap<String, Quantity>,
    /// Capacities the mechanism bounds per process rather than for the share as a whole:
    /// MPS holds each client process of its server to the limit on its own, so N
    /// processes of a share may hold N times it together. For such a capacity `enforced`
    /// is the bound on the share's processes together as last seen (the per-process limit
    /// times their number, at least one), never the per-process figure alone.
    pub per_process: BTreeMap<String, PerProcess>,
    /// What the status should say besides the phase: why a share got another mechanism
    /// than its device's, what part of the pod the limit does not reach.
    pub notes: Vec<String>,
    /// The device is in the rollout's `observe` stage: nothing was applied, by design.
    pub observed: bool,
}

/// A limit held per process (see [`Enforcement::per_process`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PerProcess {
    /// What each process of the share may hold.
    pub each: Quantity,
    /// The share's processes bound that way when the limit was read back.
    pub processes: u64,
}

/// Traffic a share's enforcement counted, as the kernel holds it (monotonic while the
/// share stays installed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrafficCounters {
    pub to_pod_bytes: u64,
    pub to_pod_packets: u64,
    pub from_pod_bytes: u64,
    pub from_pod_packets: u64,
    /// Packets the shaping queues dropped, both directions.
    pub drops: u64,
}

/// Whether retrying the same call can succeed without anyone changing the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Transient: the target is not there yet, the kernel was busy, a lock was held.
    Retryable,
    /// The request cannot work on this node as it is (unsupported, invalid target).
    Permanent,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LimiterError {
    pub retry: Retry,
    pub message: String,
}

impl LimiterError {
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            retry: Retry::Retryable,
            message: message.into(),
        }
    }

    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            retry: Retry::Permanent,
            message: message.into(),
        }
    }
}

/// An enforcement back end for one kind of device.
///
/// Every method is idempotent: the agent calls `apply` again when a Prepare is repeated
/// (the pod may have a new network namespace or cgroup) and `remove` again when an
/// Unprepare is repeated or a crash interrupted the first one.
pub trait Limiter: Send + Sync {
    /// Mechanisms this back end can use on this node, strongest first (for ListDevices).
    fn mechanisms(&self) -> Vec<String>;

    /// True when the back end enforces nothing and only accounts: its shares are ACCOUNTED,
    /// never ENFORCED, and it has no side effects to recover after a crash.
    fn accounting_only(&self) -> bool;

    /// What a share on `device` needs of its pod's sandbox before `apply` can run. The
    /// agent waits for that (the share is PENDING) and hands it over in `LimitSpec.target`.
    fn needs(&self, _device: &str) -> Needs {
        Needs::Nothing
    }

    /// Installs or updates the limit for `spec` and returns what was read back.
    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError>;

    /// Reads back what is enforced for `spec` now, changing nothing.
    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError>;

    /// Removes everything `apply` installed for `share_key`; succeeds if nothing is left.
    fn remove(&self, share_key: &str) -> Result<(), LimiterError>;

    /// The rollout's observe stage: installs what measures the share and limits nothing,
    /// returning an Enforcement with `observed` set. By default nothing measures: what
    /// an earlier stage installed is removed.
    fn observe(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.remove(&spec.share_key)?;
        Ok(self.observed(&spec.device))
    }

    /// Checks that the share is measured and not limited, as [`Limiter::observe`] left
    /// it, changing nothing; an error when it is not (the reconciler observes it again).
    /// By default that nothing is installed: what an earlier stage left (a crash in the
    /// middle of a stage change) is removed. The device's own `verify` is not asked,
    /// since some re-adopt a share they have not seen (the GPU limiter after a restart)
    /// and would limit it again.
    fn verify_observed(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.remove(&spec.share_key)?;
        Ok(self.observed(&spec.device))
    }

    /// An Enforcement that says the share is observed, with the device's mechanism.
    fn observed(&self, device: &str) -> Enforcement {
        Enforcement {
            mechanism: self.device_facts(device).mechanism,
            observed: true,
            ..Enforcement::default()
        }
    }

    /// True for a back end whose `apply` fails before it touches anything (one that is
    /// unavailable on this node): a claim rolled back there has nothing to remove. Its
    /// `remove` may still refuse, since what an earlier run installed is out of its sight,
    /// but a share this call admitted had no earlier run.
    fn failed_apply_installs_nothing(&self) -> bool {
        false
    }

    /// What the kernel counted for the share, for metrics; None where nothing counts.
    fn counters(&self, _share_key: &str) -> Option<TrafficCounters> {
        None
    }

    /// For devices a container reaches through CDI (GPUs): what the claim's CDI spec
    /// must give the container for share `share_key` on `device`. None for everything
    /// else.
    fn cdi_device(&self, _device: &str, _share_key: &str) -> Option<CdiDevice> {
        None
    }

    /// What `device`'s shares get, as the kubelet plugin publishes it in the device's
    /// ResourceSlice attributes, so that a DeviceClass can ask for enforced devices only.
    fn device_facts(&self, device: &str) -> DeviceFacts;
}

/// One device's enforcement as published to the scheduler (see `Limiter::device_facts`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceFacts {
    /// The mechanism the device's shares get ("edt-fq", "nvml-cgroup", "accounting-only"...).
    pub mechanism: String,
    /// True only where that mechanism holds a share to its amount on real hardware: not
    /// for accounting, a reactive watchdog, a simulated back end or an unavailable
    /// limiter.
    pub enforces: bool,
    /// Further facts, e.g. a GPU's `uuid` and `model`.
    pub attributes: std::collections::BTreeMap<String, String>,
    /// Further facts that are whole numbers, e.g. a NIC's `numaNode`, published as int
    /// attributes so that selectors compare them as numbers.
    pub int_attributes: std::collections::BTreeMap<String, i64>,
    /// Why the device cannot hold its shares now (its NIC's link down or gone, its
    /// limiter unavailable, its GPU not answering the driver); None while it can. What
    /// kubelet is told of the device's health, and the taint its slice carries.
    pub fault: Option<DeviceFault>,
}

/// Why a device cannot hold its shares now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFault {
    /// A short code of the kind of fault, a Kubernetes label value (`link-down`,
    /// `link-gone`, `limiter-unavailable`, `gpu-not-answering`): the value of the taint
    /// the device's ResourceSlice carries while it lasts.
    pub reason: &'static str,
    /// The fault in words, for people.
    pub message: String,
}

impl DeviceFault {
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

/// What a CDI spec gives a container for one share (see `Limiter::cdi_device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiDevice {
    /// The GPU's UUID, for `CUDA_VISIBLE_DEVICES`.
    pub gpu_uuid: String,
    /// The share's MPS control daemon, where the share runs through MPS.
    pub mps: Option<MpsDirs>,
    /// The device nodes of the share's GPU and of the driver's control devices; empty
    /// where the device has no driver root (a simulated GPU without one).
    pub device_nodes: Vec<CdiDeviceNode>,
    /// The driver's libraries and tools, read-only.
    pub mounts: Vec<CdiMount>,
}

/// A device node a CDI spec gives a container: its path there and on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiDeviceNode {
    pub path: std::path::PathBuf,
    pub host_path: std::path::PathBuf,
}

/// A host file a CDI spec binds read-only into a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiMount {
    pub host_path: std::path::PathBuf,
    pub container_path: std::path::PathBuf,
}

/// Where a share's containers meet its MPS control daemon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsDirs {
    /// `CUDA_MPS_PIPE_DIRECTORY`, mounted at the same path.
    pub pipe: std::path::PathBuf,
    /// The daemon's `/dev/shm`, mounted at the containers' `/dev/shm`.
    pub shm: std::path::PathBuf,
}
