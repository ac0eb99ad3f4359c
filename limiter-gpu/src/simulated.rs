//! A simulated GPU back end for tests and for demonstrations on machines without a GPU.
//!
//! It is named "simulated" everywhere it surfaces: [`GpuBackend::name`], the mechanism
//! labels (`simulated-cgroup`, `simulated-mps`, `simulated-watchdog`), the GPU names and
//! the driver version. Nothing it reports can be mistaken for enforcement by NVML.
//!
//! Limits live in memory and are read back from there, so a limiter built twice over the
//! same `Arc<SimulatedBackend>` sees the limits of the first one, as a restarted agent
//! sees the driver's. Faults are injected as NVML error values and go through the same
//! mapping as the NVML back end, so tests of the error split exercise the real mapping.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use nvml_wrapper::error::NvmlError;
use serde::Deserialize;

use crate::backend::{
    Capabilities, CgroupLimit, ComputeProcess, GpuBackend, GpuInfo, Mechanism, MigMode, MpsLimit,
    Support,
};
use crate::error::GpuError;
use crate::mps::MpsDaemons;
use crate::nvml::map_nvml_error;
use shareguard_common::limiter::MpsDirs;

/// Configuration of one simulated GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedGpu {
    pub uuid: String,
    pub total_memory_bytes: u64,
    pub mig: MigMode,
    /// Whether the simulated driver offers per-cgroup limits (as R615+ would).
    pub cgroup_limits: bool,
    /// Whether a simulated MPS control daemon runs for this GPU.
    pub mps: bool,
    /// The PCI address it claims, where the test gives one (a real device's, so that
    /// its placement is read from sysfs as a real GPU's would be).
    pub pci_bus_id: Option<String>,
}

impl SimulatedGpu {
    /// A GPU with cgroup limits and MPS, MIG off.
    pub fn new(uuid: impl Into<String>, total_memory_bytes: u64) -> Self {
        Self {
            uuid: uuid.into(),
            total_memory_bytes,
            mig: MigMode::Disabled,
            cgroup_limits: true,
            mps: true,
            pci_bus_id: None,
        }
    }
}

/// The back-end call a fault is injected into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimOp {
    Discover,
    ComputeProcesses,
    Capabilities,
    SetCgroupLimit,
    GetCgroupLimit,
    ClearCgroupLimit,
    SetMpsLimit,
    GetMpsLimit,
    ClearMpsLimit,
}

/// Simulation only: one line of a faults file (see [`SimulatedBackend::with_faults_file`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFault {
    op: SimOp,
    error: FileError,
}

/// The NVML errors a faults file can name: one per class the NVML mapping tells apart.
#[derive(Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum FileError {
    /// Transient (retryable).
    Unknown,
    Timeout,
    /// A device fault.
    GpuLost,
    /// Unavailable.
    NoPermission,
    NotSupported,
}

impl FileError {
    fn nvml(self) -> NvmlError {
        match self {
            FileError::Unknown => NvmlError::Unknown,
            FileError::Timeout => NvmlError::Timeout,
            FileError::GpuLost => NvmlError::GpuLost,
            FileError::NoPermission => NvmlError::NoPermission,
            FileError::NotSupported => NvmlError::NotSupported,
        }
    }
}

struct Fault {
    op: SimOp,
    make: fn() -> NvmlError,
    /// None: every call fails until cleared.
    remaining: Option<u32>,
}

#[derive(Default)]
struct State {
    gpus: Vec<SimulatedGpu>,
    processes: HashMap<String, Vec<ComputeProcess>>,
    cgroup_limits: BTreeMap<(String, PathBuf), CgroupLimit>,
    mps_limits: BTreeMap<(String, String), u64>,
    faults: Vec<Fault>,
    faults_file: Option<PathBuf>,
    /// See [`SimulatedBackend::with_required_cgroup_file`].
    required_cgroup_file: Option<String>,
}

pub struct SimulatedBackend {
    state: Mutex<State>,
    /// When set, MPS limits go through these daemons (the GPU is simulated, the
    /// daemon management is the real code, driving whatever control program is
    /// configured); when not, they are kept in memory.
    mps_daemons: Option<MpsDaemons>,
}

const SIMULATED_DRIVER_VERSION: &str = "simulated";

impl SimulatedBackend {
    pub fn new(gpus: Vec<SimulatedGpu>) -> Self {
        Self {
            state: Mutex::new(State {
                gpus,
                ..State::default()
            }),
            mps_daemons: None,
        }
    }

    /// Routes MPS limits through real per-share daemons (see the field).
    pub fn with_mps_daemons(mut self, daemons: MpsDaemons) -> Self {
        self.mps_daemons = Some(daemons);
        self
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock leaves plain data behind, still
        // consistent enough to read; poisoning must not cascade into other assertions.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the compute processes the simulated driver reports for a GPU.
    pub fn set_processes(&self, uuid: &str, processes: Vec<ComputeProcess>) {
        self.lock().processes.insert(uuid.to_string(), processes);
    }

    /// Makes the next `times` calls of `op` fail with the NVML error `make` returns
    /// (every call while `times` is None).
    pub fn inject_fault(&self, op: SimOp, make: fn() -> NvmlError, times: Option<u32>) {
        self.lock().faults.push(Fault {
            op,
            make,
            remaining: times,
        });
    }

    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Simulation only: every call also fails while a JSON file at `path` lists its
    /// operation (`[{"op": "clear_cgroup_limit", "error": "unknown"}]`), read at each
    /// call; a missing file lists nothing. This is how tests of the real binary inject a
    /// driver fault, which they cannot reach in the agent's memory.
    pub fn with_faults_file(self, path: Option<PathBuf>) -> Self {
        self.lock().faults_file = path;
        self
    }

    /// Makes a cgroup ready for a limit only where this file exists in it, as NVML needs
    /// the dmem controller's `dmem.max` (see [`crate::dmem`]). Unset: every cgroup is.
    pub fn with_required_cgroup_file(self, name: impl Into<String>) -> Self {
        self.lock().required_cgroup_file = Some(name.into());
        self
    }

    /// Changes or drops a cgroup limit behind the limiter's back, as a driver reload or
    /// an operator with nvidia-smi would.
    pub fn tamper_cgroup_limit(&self, uuid: &str, cgroup: &Path, limit: Option<CgroupLimit>) {
        let key = (uuid.to_string(), cgroup.to_path_buf());
        let mut st = self.lock();
        match limit {
            Some(l) => st.cgroup_limits.insert(key, l),
            None => st.cgroup_limits.remove(&key),
        };
    }

    /// Every cgroup limit currently held, for assertions.
    pub fn cgroup_limits(&self) -> Vec<(String, PathBuf, CgroupLimit)> {
        self.lock()
            .cgroup_limits
            .iter()
            .map(|((u, p), l)| (u.clone(), p.clone(), *l))
            .collect()
    }

    /// Every MPS limit currently held, for assertions.
    pub fn mps_limits(&self) -> Vec<(String, String, u64)> {
        self.lock()
            .mps_limits
            .iter()
            .map(|((u, k), b)| (u.clone(), k.clone(), *b))
            .collect()
    }
}

impl State {
    fn check_fault(&mut self, op: SimOp, what: &str) -> Result<(), GpuError> {
        if let Some(e) = self.file_fault(op)? {
            return Err(map_nvml_error(what, e.nvml()));
        }
        let Some(i) = self.faults.iter().position(|f| f.op == op) else {
            return Ok(());
        };
        let err = (self.faults[i].make)();
        if let Some(n) = self.faults[i].remaining.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.faults.remove(i);
            }
        }
        Err(map_nvml_error(what, err))
    }

    /// The fault the faults file lists for `op`, if any. A file that cannot be read is
    /// an error of every call, so that a test's typo shows instead of passing unfaulted.
    fn file_fault(&self, op: SimOp) -> Result<Option<FileError>, GpuError> {
        let Some(path) = &self.faults_file else {
            return Ok(None);
        };
        let bad = |e: &dyn std::fmt::Display| {
            GpuError::InvalidArgument(format!("simulated faults file {}: {e}", path.display()))
        };
        let list: Vec<FileFault> = match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| bad(&e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(bad(&e)),
        };
        Ok(list.into_iter().find(|f| f.op == op).map(|f| f.error))
    }

    fn gpu(&self, uuid: &str) -> Result<&SimulatedGpu, GpuError> {
        self.gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .ok_or_else(|| GpuError::GpuNotFound(format!("simulated GPU {uuid}")))
    }

    fn cgroup_support(&self, uuid: &str) -> Result<Support, GpuError> {
        let g = self.gpu(uuid)?;
        Ok(if g.mig == MigMode::Enabled {
            // As the real driver: MIG handles are rejected for cgroup memory limits.
            Support::Unsupported("simulated GPU is in MIG mode".into())
        } else if !g.cgroup_limits {
            Support::Unsupported("simulated driver has no cgroup memory limits".into())
        } else {
            Support::Supported
        })
    }

    fn mps_support(&self, uuid: &str) -> Result<Support, GpuError> {
        Ok(if self.gpu(uuid)?.mps {
            Support::Supported
        } else {
            Support::Unsupported("no simulated MPS daemon for this GPU".into())
        })
    }

    fn require(&self, support: Support) -> Result<(), GpuError> {
        match support {
            Support::Supported => Ok(()),
            Support::Unsupported(why) => Err(GpuError::NotSupported(why)),
        }
    }
}

impl GpuBackend for SimulatedBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn is_simulated(&self) -> bool {
        true
    }

    fn mechanism_label(&self, m: Mechanism) -> String {
        match m {
            Mechanism::NvmlCgroup => "simulated-cgroup".into(),
            Mechanism::Mps => "simulated-mps".into(),
            Mechanism::Watchdog => "simulated-watchdog".into(),
        }
    }

    fn discover(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::Discover, "simulated discovery")?;
        Ok(st
            .gpus
            .iter()
            .zip(0u32..)
            .map(|(g, index)| GpuInfo {
                uuid: g.uuid.clone(),
                index,
                name: "Simulated GPU".into(),
                total_memory_bytes: g.total_memory_bytes,
                mig: g.mig,
                driver_version: SIMULATED_DRIVER_VERSION.into(),
                // Its place in the list, as on a node where no GPU was ever removed.
                minor: Some(index),
                pci_bus_id: g.pci_bus_id.clone(),
            })
            .collect())
    }

    fn compute_processes(&self, uuid: &str) -> Result<Vec<ComputeProcess>, GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::ComputeProcesses, "simulated process list")?;
        st.gpu(uuid)?;
        Ok(st.processes.get(uuid).cloned().unwrap_or_default())
    }

    fn capabilities(&self, uuid: &str) -> Result<Capabilities, GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::Capabilities, "simulated probe")?;
        let mps = match (st.mps_support(uuid)?, &self.mps_daemons) {
            (Support::Supported, Some(d)) => d.probe(),
            (support, _) => support,
        };
        Ok(Capabilities {
            cgroup_limits: st.cgroup_support(uuid)?,
            mps,
        })
    }

    fn cgroup_ready(&self, cgroup: &Path) -> Result<(), String> {
        match &self.lock().required_cgroup_file {
            Some(f) if !cgroup.join(f).exists() => {
                Err(format!("simulated: {} has no {f}", cgroup.display()))
            }
            _ => Ok(()),
        }
    }

    fn set_cgroup_limit(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::SetCgroupLimit, "simulated set cgroup limit")?;
        let support = st.cgroup_support(uuid)?;
        st.require(support)?;
        let used = st
            .cgroup_limits
            .get(&(uuid.to_string(), cgroup.to_path_buf()))
            .map_or(0, |l| l.used_bytes);
        // As the NVML back end reports a driver that refuses a limit below usage.
        if used > bytes {
            return Err(GpuError::UsageAboveLimit {
                cgroup: cgroup.display().to_string(),
                used,
                limit: bytes,
            });
        }
        st.cgroup_limits.insert(
            (uuid.to_string(), cgroup.to_path_buf()),
            CgroupLimit {
                soft_bytes: bytes,
                hard_bytes: bytes,
                used_bytes: used,
            },
        );
        Ok(())
    }

    fn cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<Option<CgroupLimit>, GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::GetCgroupLimit, "simulated get cgroup limit")?;
        let support = st.cgroup_support(uuid)?;
        st.require(support)?;
        Ok(st
            .cgroup_limits
            .get(&(uuid.to_string(), cgroup.to_path_buf()))
            .copied())
    }

    fn clear_cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<(), GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::ClearCgroupLimit, "simulated clear cgroup limit")?;
        st.gpu(uuid)?;
        st.cgroup_limits
            .remove(&(uuid.to_string(), cgroup.to_path_buf()));
        Ok(())
    }

    fn set_mps_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::SetMpsLimit, "simulated set MPS limit")?;
        let support = st.mps_support(uuid)?;
        st.require(support)?;
        let Some(daemons) = &self.mps_daemons else {
            st.mps_limits
                .insert((uuid.to_string(), share_key.to_string()), bytes);
            return Ok(());
        };
        // Outside the lock: starting a daemon waits for a process.
        drop(st);
        daemons.ensure_limit(uuid, share_key, bytes)
    }

    fn mps_limit(&self, uuid: &str, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::GetMpsLimit, "simulated get MPS limit")?;
        let support = st.mps_support(uuid)?;
        st.require(support)?;
        let Some(daemons) = &self.mps_daemons else {
            return Ok(st
                .mps_limits
                .get(&(uuid.to_string(), share_key.to_string()))
                .map(|b| MpsLimit::exact(*b)));
        };
        drop(st);
        daemons.limit(share_key)
    }

    fn clear_mps_limit(&self, uuid: &str, share_key: &str) -> Result<(), GpuError> {
        let mut st = self.lock();
        st.check_fault(SimOp::ClearMpsLimit, "simulated clear MPS limit")?;
        st.gpu(uuid)?;
        let Some(daemons) = &self.mps_daemons else {
            st.mps_limits
                .remove(&(uuid.to_string(), share_key.to_string()));
            return Ok(());
        };
        drop(st);
        daemons.stop(share_key)
    }

    fn mps_dirs(&self, share_key: &str) -> Option<MpsDirs> {
        self.mps_daemons.as_ref().map(|d| d.dirs(share_key))
    }

    /// Through the daemons where they run (the simulated control program keeps each
    /// server's clients); without them no process is anyone's client.
    fn terminate_mps_client(
        &self,
        uuid: &str,
        share_key: &str,
        pid: u32,
    ) -> Result<bool, GpuError> {
        self.lock().gpu(uuid)?;
        match &self.mps_daemons {
            Some(d) => d.terminate_client(share_key, pid),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn sim() -> SimulatedBackend {
        let mut mig = SimulatedGpu::new("GPU-sim-1", 40 * GIB);
        mig.mig = MigMode::Enabled;
        SimulatedBackend::new(vec![SimulatedGpu::new("GPU-sim-0", 80 * GIB), mig])
    }

    #[test]
    fn named_simulated_everywhere() {
        let s = sim();
        assert_eq!(s.name(), "simulated");
        assert!(s.is_simulated());
        for m in Mechanism::ALL {
            let label = s.mechanism_label(m);
            assert!(label.starts_with("simulated-"), "{label}");
        }
        let gpus = s.discover().unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].index, 1);
        assert!(gpus.iter().all(|g| g.name.contains("Simulated")));
        assert!(gpus.iter().all(|g| g.driver_version == "simulated"));
    }

    #[test]
    fn limits_set_read_back_and_cleared() {
        let s = sim();
        let cg = Path::new("/sys/fs/cgroup/kubepods.slice/pod-a");
        assert_eq!(s.cgroup_limit("GPU-sim-0", cg).unwrap(), None);
        s.set_cgroup_limit("GPU-sim-0", cg, 8 * GIB).unwrap();
        let l = s.cgroup_limit("GPU-sim-0", cg).unwrap().unwrap();
        assert_eq!((l.soft_bytes, l.hard_bytes), (8 * GIB, 8 * GIB));
        s.clear_cgroup_limit("GPU-sim-0", cg).unwrap();
        assert_eq!(s.cgroup_limit("GPU-sim-0", cg).unwrap(), None);
        // Clearing twice is fine: release is idempotent.
        s.clear_cgroup_limit("GPU-sim-0", cg).unwrap();
    }

    #[test]
    fn a_limit_below_usage_is_refused_and_nothing_changes() {
        let s = sim();
        let cg = Path::new("/sys/fs/cgroup/kubepods.slice/pod-b");
        s.set_cgroup_limit("GPU-sim-0", cg, 8 * GIB).unwrap();
        let mut l = s.cgroup_limit("GPU-sim-0", cg).unwrap().unwrap();
        l.used_bytes = 6 * GIB;
        s.tamper_cgroup_limit("GPU-sim-0", cg, Some(l));
        let e = s.set_cgroup_limit("GPU-sim-0", cg, 4 * GIB).unwrap_err();
        assert!(
            matches!(e, GpuError::UsageAboveLimit { used, limit, .. } if used == 6 * GIB && limit == 4 * GIB),
            "{e:?}"
        );
        assert_eq!(s.cgroup_limit("GPU-sim-0", cg).unwrap(), Some(l));
    }

    #[test]
    fn mig_gpu_refuses_cgroup_limits() {
        let s = sim();
        let caps = s.capabilities("GPU-sim-1").unwrap();
        assert!(!caps.cgroup_limits.is_supported());
        let err = s
            .set_cgroup_limit("GPU-sim-1", Path::new("/sys/fs/cgroup/x"), GIB)
            .unwrap_err();
        assert!(matches!(err, GpuError::NotSupported(_)), "{err:?}");
    }

    #[test]
    fn unknown_gpu_is_not_found() {
        let err = sim().compute_processes("GPU-nope").unwrap_err();
        assert!(matches!(err, GpuError::GpuNotFound(_)), "{err:?}");
    }

    #[test]
    fn injected_faults_count_down_and_map_like_nvml() {
        let s = sim();
        s.inject_fault(SimOp::ComputeProcesses, || NvmlError::Timeout, Some(2));
        for _ in 0..2 {
            let e = s.compute_processes("GPU-sim-0").unwrap_err();
            assert!(e.is_retryable(), "{e:?}");
        }
        assert!(s.compute_processes("GPU-sim-0").is_ok());

        s.inject_fault(SimOp::Discover, || NvmlError::DriverNotLoaded, None);
        for _ in 0..3 {
            let e = s.discover().unwrap_err();
            assert!(matches!(e, GpuError::Unavailable(_)), "{e:?}");
        }
        s.clear_faults();
        assert!(s.discover().is_ok());
    }

    #[test]
    fn a_faults_file_fails_the_operations_it_lists_while_it_lists_them() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("faults.json");
        let s = sim().with_faults_file(Some(file.clone()));
        let cg = Path::new("/kubepods/pod1");
        assert!(
            s.set_cgroup_limit("GPU-sim-0", cg, 1 << 30).is_ok(),
            "no file, no fault"
        );
        std::fs::write(
            &file,
            r#"[{"op": "clear_cgroup_limit", "error": "gpu_lost"}]"#,
        )
        .unwrap();
        for _ in 0..2 {
            let e = s.clear_cgroup_limit("GPU-sim-0", cg).unwrap_err();
            assert!(matches!(e, GpuError::DeviceFault(_)), "{e:?}");
        }
        assert!(
            s.cgroup_limit("GPU-sim-0", cg).unwrap().is_some(),
            "other ops work"
        );
        std::fs::write(&file, "[]").unwrap();
        assert!(s.clear_cgroup_limit("GPU-sim-0", cg).is_ok());
        std::fs::write(
            &file,
            r#"[{"op": "clear_cgroup_limt", "error": "unknown"}]"#,
        )
        .unwrap();
        let e = s.discover().unwrap_err();
        assert!(
            matches!(&e, GpuError::InvalidArgument(m) if m.contains("faults.json")),
            "{e:?}"
        );
    }

    #[test]
    fn processes_are_per_gpu() {
        let s = sim();
        s.set_processes(
            "GPU-sim-0",
            vec![ComputeProcess {
                pid: 42,
                used_bytes: Some(GIB),
                via_mps: false,
            }],
        );
        assert_eq!(s.compute_processes("GPU-sim-0").unwrap().len(), 1);
        assert!(s.compute_processes("GPU-sim-1").unwrap().is_empty());
    }
}
