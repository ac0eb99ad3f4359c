//! The NVML back end, through nvml-wrapper, which loads `libnvidia-ml.so.1` at run
//! time: the agent builds and starts on nodes without NVIDIA's driver, and there
//! [`NvmlBackend::open`] returns [`GpuError::Unavailable`] instead of failing to start.
//!
//! Per-cgroup memory limits (`nvmlDeviceSetMemoryLimits_v1`, R615+) are not bound by
//! nvml-wrapper 0.13; they are resolved from the same loaded library (see
//! [`crate::sys`]) and a library without them is "not supported", never an error.

use std::ffi::{CString, OsStr};
use std::path::Path;

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use nvml_wrapper::enum_wrappers::device::ComputeMode;
use shareguard_common::limiter::MpsDirs;

use crate::backend::{
    Capabilities, CgroupLimit, ComputeProcess, GpuBackend, GpuInfo, MigMode, MpsLimit, Support,
};
use crate::error::GpuError;
use crate::mps::MpsDaemons;
use crate::sys::{MemoryLimitFns, SymbolPresence};

/// One entry per PID from NVML's two process lists: a PID on the MPS list is an MPS
/// client, and the memory figure is the one that is known.
pub fn merge_processes(
    direct: Vec<ComputeProcess>,
    mps: Vec<ComputeProcess>,
) -> Vec<ComputeProcess> {
    let mut out: Vec<ComputeProcess> = Vec::with_capacity(direct.len() + mps.len());
    for p in direct.into_iter().chain(mps) {
        match out.iter_mut().find(|q| q.pid == p.pid) {
            Some(q) => {
                q.via_mps |= p.via_mps;
                q.used_bytes = q.used_bytes.or(p.used_bytes);
            }
            None => out.push(p),
        }
    }
    out
}

/// First driver branch with per-cgroup memory limits.
const CGROUP_LIMITS_MIN_DRIVER: u32 = 615;

/// Maps an NVML error onto the crate's error, `what` saying which call failed.
///
/// The split (see [`GpuError`] for why each class is retryable or not):
/// - the library or driver cannot be used at all -> `Unavailable`;
/// - the call or feature does not exist here -> `NotSupported`;
/// - busy, timed out, or an "unknown" internal error -> `Transient`;
/// - the GPU fell off the bus or needs a reset -> `DeviceFault`.
#[allow(deprecated)] // AlreadyInitialized is deprecated upstream but still a variant.
pub fn map_nvml_error(what: &str, e: NvmlError) -> GpuError {
    use NvmlError as N;
    let msg = format!("{what}: {e}");
    match e {
        N::LibloadingError(_)
        | N::LibraryNotFound
        | N::DriverNotLoaded
        | N::NoPermission
        | N::Uninitialized
        | N::LibRmVersionMismatch
        | N::OperatingSystem
        | N::CorruptedInfoROM
        | N::InsufficientPower => GpuError::Unavailable(msg),
        N::NotSupported
        | N::FunctionNotFound
        | N::FailedToLoadSymbol(_)
        | N::VgpuEccNotSupported => GpuError::NotSupported(msg),
        N::NotFound => GpuError::GpuNotFound(msg),
        N::InvalidArg | N::Utf8Error(_) | N::NulError(_) | N::StringTooLong { .. } => {
            GpuError::InvalidArgument(msg)
        }
        N::Timeout
        | N::InUse
        | N::InsufficientMemory
        | N::InsufficientSize(_)
        | N::NoData
        | N::IrqIssue
        | N::Unknown => GpuError::Transient(msg),
        N::GpuLost | N::ResetRequired => GpuError::DeviceFault(msg),
        N::IncorrectBits(_)
        | N::UnexpectedVariant(_)
        | N::SetReleaseFailed
        | N::GetPciInfoFailed
        | N::PciInfoToCFailed
        | N::AlreadyInitialized => GpuError::Internal(msg),
    }
}

/// Why cgroup limits can or cannot be used, decided once when NVML is opened.
#[derive(Clone, Debug)]
enum CgroupLimitFns {
    Callable(MemoryLimitFns),
    Missing(String),
}

pub struct NvmlBackend {
    // Declared before `nvml` only for readability: the function pointers have no Drop
    // and are only called through `&self`, while `nvml` (and its library) is alive.
    limit_fns: CgroupLimitFns,
    limit_symbols: SymbolPresence,
    driver_version: String,
    cgroup2_root: std::path::PathBuf,
    /// The per-share MPS daemons; None leaves the `mps` mechanism unsupported.
    mps: Option<MpsDaemons>,
    nvml: Nvml,
}

impl NvmlBackend {
    /// Loads `libnvidia-ml.so.1` and initialises NVML.
    pub fn open() -> Result<Self, GpuError> {
        Self::from_init(Nvml::init())
    }

    /// As [`NvmlBackend::open`] with an explicit library path (for unusual installs).
    pub fn open_path(lib_path: &OsStr) -> Result<Self, GpuError> {
        Self::from_init(Nvml::builder().lib_path(lib_path).init())
    }

    fn from_init(init: Result<Nvml, NvmlError>) -> Result<Self, GpuError> {
        let nvml = init.map_err(|e| {
            let err = match e {
                // A library that cannot be loaded is the usual "no driver here" case.
                NvmlError::LibloadingError(_) | NvmlError::FailedToLoadSymbol(_) => {
                    GpuError::Unavailable(format!("cannot load NVML (libnvidia-ml.so.1): {e}"))
                }
                other => map_nvml_error("nvmlInit", other),
            };
            tracing::warn!(error = %err, "NVML unavailable; GPU devices will report it as their status");
            err
        })?;
        let driver_version = nvml
            .sys_driver_version()
            .map_err(|e| map_nvml_error("nvmlSystemGetDriverVersion", e))?;
        // SAFETY: `nvml.lib().__library` is the NVML library itself, and the functions
        // are stored next to `nvml` in the same struct and only used while it lives.
        let (presence, fns) = unsafe { MemoryLimitFns::resolve(&nvml.lib().__library) };
        let limit_fns = match fns {
            Some(f) => CgroupLimitFns::Callable(f),
            None => CgroupLimitFns::Missing(missing_reason(presence, &driver_version)),
        };
        tracing::info!(
            driver = %driver_version,
            set_memory_limits = presence.set,
            get_memory_limits = presence.get,
            "NVML loaded"
        );
        Ok(Self {
            limit_fns,
            limit_symbols: presence,
            driver_version,
            cgroup2_root: "/sys/fs/cgroup".into(),
            mps: None,
            nvml,
        })
    }

    /// Enables the `mps` mechanism through these daemons, where a GPU allows it.
    pub fn with_mps(mut self, mps: MpsDaemons) -> Self {
        self.mps = Some(mps);
        self
    }

    fn mps(&self) -> Result<&MpsDaemons, GpuError> {
        self.mps
            .as_ref()
            .ok_or_else(|| GpuError::NotSupported("MPS is not configured for this back end".into()))
    }

    /// Whether per-share MPS daemons can run on this GPU.
    fn mps_support(&self, device: &nvml_wrapper::Device<'_>) -> Result<Support, GpuError> {
        let Some(mps) = &self.mps else {
            return Ok(Support::Unsupported(
                "MPS is not configured for this back end".into(),
            ));
        };
        if Self::mig_mode(device)? == MigMode::Enabled {
            return Ok(Support::Unsupported(
                "MIG is enabled; per-share MPS daemons are set up for whole GPUs only".into(),
            ));
        }
        let mode = device
            .compute_mode()
            .map_err(|e| map_nvml_error("nvmlDeviceGetComputeMode", e))?;
        if mode != ComputeMode::Default {
            return Ok(Support::Unsupported(format!(
                "compute mode is {mode:?}; one MPS daemon per share needs DEFAULT, where \
                 several MPS servers may share the GPU"
            )));
        }
        Ok(mps.probe())
    }

    /// Which of `nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1` the
    /// loaded library exports, for probes and diagnostics. Both are needed for the
    /// nvml-cgroup mechanism; [`GpuBackend::capabilities`] says why it is unusable.
    pub fn memory_limit_symbols(&self) -> SymbolPresence {
        self.limit_symbols
    }

    fn device(&self, uuid: &str) -> Result<nvml_wrapper::Device<'_>, GpuError> {
        self.nvml
            .device_by_uuid(uuid)
            .map_err(|e| map_nvml_error(&format!("nvmlDeviceGetHandleByUUID({uuid})"), e))
    }

    fn limit_fns(&self) -> Result<&MemoryLimitFns, GpuError> {
        match &self.limit_fns {
            CgroupLimitFns::Callable(f) => Ok(f),
            CgroupLimitFns::Missing(why) => Err(GpuError::NotSupported(why.clone())),
        }
    }

    fn mig_mode(device: &nvml_wrapper::Device<'_>) -> Result<MigMode, GpuError> {
        match device.mig_mode() {
            // NVML_DEVICE_MIG_ENABLE is 1.
            Ok(m) if m.current == 1 => Ok(MigMode::Enabled),
            Ok(_) => Ok(MigMode::Disabled),
            Err(NvmlError::NotSupported) => Ok(MigMode::NotSupported),
            Err(e) => Err(map_nvml_error("nvmlDeviceGetMigMode", e)),
        }
    }

    fn cgroup_cstring(cgroup: &Path) -> Result<CString, GpuError> {
        CString::new(cgroup.as_os_str().as_encoded_bytes()).map_err(|_| {
            GpuError::InvalidArgument(format!("cgroup path {} contains NUL", cgroup.display()))
        })
    }

    fn total_memory(device: &nvml_wrapper::Device<'_>) -> Result<u64, GpuError> {
        device
            .memory_info()
            .map(|m| m.total)
            .map_err(|e| map_nvml_error("nvmlDeviceGetMemoryInfo", e))
    }
}

fn missing_reason(presence: SymbolPresence, driver: &str) -> String {
    let which = match (presence.set, presence.get) {
        (false, false) => "nvmlDeviceSetMemoryLimits_v1 and nvmlDeviceGetMemoryLimits_v1 are",
        (false, true) => "nvmlDeviceSetMemoryLimits_v1 is",
        (true, false) => "nvmlDeviceGetMemoryLimits_v1 is",
        (true, true) => "nothing is",
    };
    format!(
        "{which} missing from NVML (driver {driver}; per-cgroup limits need R{CGROUP_LIMITS_MIN_DRIVER} or later)"
    )
}

/// What the driver's read-back means: no limit, or the limit. The documented "no limit"
/// reading is soft 0 with hard at `NVML_DEVICE_MEMORY_LIMIT_MAX`; since that constant's
/// value is not known here (see [`crate::sys`]), any hard limit at or above the GPU's
/// memory counts as none, which is also what [`GpuBackend::clear_cgroup_limit`] writes.
pub fn interpret_limits(soft: u64, hard: u64, used: u64, total: u64) -> Option<CgroupLimit> {
    if soft == 0 && hard >= total {
        None
    } else {
        Some(CgroupLimit {
            soft_bytes: soft,
            hard_bytes: hard,
            used_bytes: used,
        })
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn is_simulated(&self) -> bool {
        false
    }

    fn discover(&self) -> Result<Vec<GpuInfo>, GpuError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| map_nvml_error("nvmlDeviceGetCount", e))?;
        let mut out = Vec::new();
        for index in 0..count {
            let d = self
                .nvml
                .device_by_index(index)
                .map_err(|e| map_nvml_error(&format!("nvmlDeviceGetHandleByIndex({index})"), e))?;
            out.push(GpuInfo {
                uuid: d
                    .uuid()
                    .map_err(|e| map_nvml_error("nvmlDeviceGetUUID", e))?,
                index,
                name: d
                    .name()
                    .map_err(|e| map_nvml_error("nvmlDeviceGetName", e))?,
                total_memory_bytes: Self::total_memory(&d)?,
                mig: Self::mig_mode(&d)?,
                driver_version: self.driver_version.clone(),
            });
        }
        Ok(out)
    }

    fn compute_processes(&self, uuid: &str) -> Result<Vec<ComputeProcess>, GpuError> {
        let d = self.device(uuid)?;
        let convert = |procs: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, via_mps| {
            procs
                .into_iter()
                .map(|p| ComputeProcess {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                    via_mps,
                })
                .collect::<Vec<_>>()
        };
        let direct = d
            .running_compute_processes()
            .map_err(|e| map_nvml_error("nvmlDeviceGetComputeRunningProcesses", e))?;
        // Clients of an MPS server are listed apart; without them the watchdog would see
        // only the server (in no pod) and miss every MPS share's processes.
        let mps = match d.mps_running_compute_processes() {
            Ok(p) => p,
            Err(NvmlError::NotSupported | NvmlError::FunctionNotFound) => Vec::new(),
            Err(e) => return Err(map_nvml_error("nvmlDeviceGetMPSComputeRunningProcesses", e)),
        };
        Ok(merge_processes(convert(direct, false), convert(mps, true)))
    }

    fn capabilities(&self, uuid: &str) -> Result<Capabilities, GpuError> {
        let d = self.device(uuid)?;
        let cgroup_limits = match &self.limit_fns {
            CgroupLimitFns::Missing(why) => Support::Unsupported(why.clone()),
            CgroupLimitFns::Callable(_) => {
                if Self::mig_mode(&d)? == MigMode::Enabled {
                    Support::Unsupported(
                        "MIG is enabled; NVML rejects MIG handles for cgroup limits".into(),
                    )
                } else if !self.cgroup2_root.join("cgroup.controllers").exists() {
                    Support::Unsupported(format!(
                        "cgroup v2 is not mounted at {}",
                        self.cgroup2_root.display()
                    ))
                } else {
                    Support::Supported
                }
            }
        };
        Ok(Capabilities {
            cgroup_limits,
            mps: self.mps_support(&d)?,
        })
    }

    fn set_cgroup_limit(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), GpuError> {
        let fns = self.limit_fns()?;
        if !cgroup.is_dir() {
            return Err(GpuError::TargetMissing(format!(
                "cgroup {} does not exist (yet)",
                cgroup.display()
            )));
        }
        let path = Self::cgroup_cstring(cgroup)?;
        let d = self.device(uuid)?;
        // The share's memory is both guaranteed (soft) and the cap (hard): the ledger
        // already made sure the guarantees fit the GPU.
        fns.set(&d, &path, bytes, bytes).map_err(|e| match e {
            // The driver answers "not found" for a cgroup without dmem files, i.e.
            // whose parent does not enable the controller for its children.
            NvmlError::NotFound => GpuError::NotSupported(format!(
                "nvmlDeviceSetMemoryLimits_v1({}): cgroup has no device memory controller",
                cgroup.display()
            )),
            other => map_nvml_error("nvmlDeviceSetMemoryLimits_v1", other),
        })
    }

    fn cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<Option<CgroupLimit>, GpuError> {
        let fns = self.limit_fns()?;
        if !cgroup.is_dir() {
            return Ok(None);
        }
        let path = Self::cgroup_cstring(cgroup)?;
        let d = self.device(uuid)?;
        let raw = fns
            .get(&d, &path)
            .map_err(|e| map_nvml_error("nvmlDeviceGetMemoryLimits_v1", e))?;
        Ok(interpret_limits(
            raw.soft,
            raw.hard,
            raw.current_used,
            Self::total_memory(&d)?,
        ))
    }

    fn clear_cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<(), GpuError> {
        let fns = self.limit_fns()?;
        if !cgroup.is_dir() {
            // The driver drops the limits of a removed cgroup. With its dmem back end
            // the soft limit's share in the ancestors stays, which nobody can undo now.
            tracing::warn!(
                cgroup = %cgroup.display(),
                "cgroup already removed; its GPU memory soft limit could not be zeroed first"
            );
            return Ok(());
        }
        let path = Self::cgroup_cstring(cgroup)?;
        let d = self.device(uuid)?;
        let total = Self::total_memory(&d)?;
        fns.set(&d, &path, 0, total)
            .map_err(|e| map_nvml_error("nvmlDeviceSetMemoryLimits_v1 (clear)", e))
    }

    fn set_mps_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError> {
        // Only to fail early and clearly for a GPU NVML does not know.
        self.device(uuid)?;
        self.mps()?.ensure_limit(uuid, share_key, bytes)
    }

    fn mps_limit(&self, _uuid: &str, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        self.mps()?.limit(share_key)
    }

    fn clear_mps_limit(&self, _uuid: &str, share_key: &str) -> Result<(), GpuError> {
        self.mps()?.stop(share_key)
    }

    fn mps_dirs(&self, share_key: &str) -> Option<MpsDirs> {
        self.mps.as_ref().map(|m| m.dirs(share_key))
    }

    fn cgroup_ready(&self, cgroup: &Path) -> Result<(), String> {
        crate::dmem::cgroup_has_dmem(cgroup)
    }

    fn terminate_mps_client(
        &self,
        _uuid: &str,
        share_key: &str,
        pid: u32,
    ) -> Result<bool, GpuError> {
        match &self.mps {
            Some(m) => m.terminate_client(share_key, pid),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use shareguard_common::limiter::Retry;

    use super::*;

    #[test]
    fn nvml_errors_map_to_the_documented_classes() {
        type Class = fn(&GpuError) -> bool;
        let cases: Vec<(NvmlError, Retry, Class)> = vec![
            (NvmlError::LibraryNotFound, Retry::Permanent, |e| {
                matches!(e, GpuError::Unavailable(_))
            }),
            (NvmlError::DriverNotLoaded, Retry::Permanent, |e| {
                matches!(e, GpuError::Unavailable(_))
            }),
            (NvmlError::NoPermission, Retry::Permanent, |e| {
                matches!(e, GpuError::Unavailable(_))
            }),
            (NvmlError::Uninitialized, Retry::Permanent, |e| {
                matches!(e, GpuError::Unavailable(_))
            }),
            (NvmlError::LibRmVersionMismatch, Retry::Permanent, |e| {
                matches!(e, GpuError::Unavailable(_))
            }),
            (NvmlError::NotSupported, Retry::Permanent, |e| {
                matches!(e, GpuError::NotSupported(_))
            }),
            (NvmlError::FunctionNotFound, Retry::Permanent, |e| {
                matches!(e, GpuError::NotSupported(_))
            }),
            (NvmlError::InvalidArg, Retry::Permanent, |e| {
                matches!(e, GpuError::InvalidArgument(_))
            }),
            (NvmlError::NotFound, Retry::Permanent, |e| {
                matches!(e, GpuError::GpuNotFound(_))
            }),
            (NvmlError::Timeout, Retry::Retryable, |e| {
                matches!(e, GpuError::Transient(_))
            }),
            (NvmlError::Unknown, Retry::Retryable, |e| {
                matches!(e, GpuError::Transient(_))
            }),
            (NvmlError::InUse, Retry::Retryable, |e| {
                matches!(e, GpuError::Transient(_))
            }),
            (NvmlError::GpuLost, Retry::Retryable, |e| {
                matches!(e, GpuError::DeviceFault(_))
            }),
            (NvmlError::ResetRequired, Retry::Retryable, |e| {
                matches!(e, GpuError::DeviceFault(_))
            }),
            (NvmlError::UnexpectedVariant(77), Retry::Permanent, |e| {
                matches!(e, GpuError::Internal(_))
            }),
        ];
        for (nvml, retry, class) in cases {
            let shown = format!("{nvml:?}");
            let e = map_nvml_error("call", nvml);
            assert_eq!(e.retry(), retry, "{shown} -> {e:?}");
            assert!(class(&e), "{shown} -> {e:?}");
            assert!(e.to_string().contains("call"), "context kept: {e}");
        }
    }

    #[test]
    fn raw_return_codes_map_through_nvml_wrapper() {
        // nvmlReturn_t values from nvml.h: 9 driver not loaded, 10 timeout, 15 GPU lost.
        assert!(matches!(
            map_nvml_error("x", NvmlError::from(9u32)),
            GpuError::Unavailable(_)
        ));
        assert!(map_nvml_error("x", NvmlError::from(10u32)).is_retryable());
        assert!(matches!(
            map_nvml_error("x", NvmlError::from(15u32)),
            GpuError::DeviceFault(_)
        ));
    }

    #[test]
    fn missing_library_is_an_error_value_not_a_panic() {
        let r = NvmlBackend::open_path(OsStr::new("/nonexistent/libnvidia-ml.so.1"));
        match r {
            Err(GpuError::Unavailable(msg)) => assert!(msg.contains("NVML"), "{msg}"),
            Err(other) => panic!("expected Unavailable, got {other:?}"),
            Ok(_) => panic!("a nonexistent library must not load"),
        }
    }

    #[test]
    fn default_open_without_a_driver_is_unavailable() {
        // This machine has no NVIDIA driver; where one exists the open may succeed.
        if let Err(e) = NvmlBackend::open() {
            assert!(matches!(e, GpuError::Unavailable(_)), "{e:?}");
            assert_eq!(e.retry(), Retry::Permanent);
        }
    }

    #[test]
    fn symbol_presence_agrees_with_the_cgroup_decision() {
        // Only where a driver is present; `sys` tests the lookup itself without one.
        let Ok(b) = NvmlBackend::open() else { return };
        let p = b.memory_limit_symbols();
        match &b.limit_fns {
            CgroupLimitFns::Callable(_) => assert!(p.set && p.get, "{p:?}"),
            CgroupLimitFns::Missing(why) => {
                assert!(!(p.set && p.get), "{p:?}");
                assert!(why.contains("missing from NVML"), "{why}");
            }
        }
    }

    #[test]
    fn mps_clients_join_the_process_list_once() {
        let p = |pid, used, via_mps| ComputeProcess {
            pid,
            used_bytes: used,
            via_mps,
        };
        let merged = merge_processes(
            vec![
                p(10, Some(5), false),
                p(11, None, false),
                p(13, Some(1), false),
            ],
            vec![
                p(11, Some(7), true),
                p(12, None, true),
                p(10, Some(99), true),
            ],
        );
        assert_eq!(
            merged,
            vec![
                p(10, Some(5), true),
                p(11, Some(7), true),
                p(13, Some(1), false),
                p(12, None, true)
            ]
        );
    }

    #[test]
    fn read_back_interpretation() {
        let total = 80 << 30;
        assert_eq!(interpret_limits(0, total, 0, total), None);
        assert_eq!(interpret_limits(0, u64::MAX, 5, total), None);
        let l = interpret_limits(8 << 30, 8 << 30, 1, total).unwrap();
        assert_eq!(
            (l.soft_bytes, l.hard_bytes, l.used_bytes),
            (8 << 30, 8 << 30, 1)
        );
        // A hard limit below the GPU with no soft limit is still a limit.
        assert!(interpret_limits(0, 8 << 30, 0, total).is_some());
    }

    #[test]
    fn missing_symbols_are_named() {
        let r = missing_reason(
            SymbolPresence {
                set: false,
                get: true,
            },
            "610.1",
        );
        assert!(r.contains("nvmlDeviceSetMemoryLimits_v1 is missing"), "{r}");
        assert!(r.contains("R615"), "{r}");
    }
}
