//! The NVML back end, through nvml-wrapper, which loads `libnvidia-ml.so.1` at run
//! time: the agent builds and starts on nodes without NVIDIA's driver, and there
//! [`NvmlBackend::open`] returns [`GpuError::Unavailable`] instead of failing to start.
//!
//! Per-cgroup memory limits (`nvmlDeviceSetMemoryLimits_v1`, R615+) are not bound by
//! nvml-wrapper 0.13; they are resolved from the same loaded library (see
//! [`crate::sys`]) and a library without them is "not supported", never an error.

use std::ffi::{CString, OsStr};
use std::path::Path;
use std::sync::Mutex;

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
use crate::sys::{DEVICE_MEMORY_LIMIT_MAX, MemoryLimitFns, RawMemoryLimits, SymbolPresence};

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

/// `nvmlReturn_t` values nvml-wrapper 0.13 has no variant for (it hands them over as
/// `UnexpectedVariant`); the numbers are nvml.h's, as nvml-wrapper-sys's generated
/// bindings carry them (`tests/fixtures/nvml-return-codes.txt`).
mod raw_code {
    pub const INSUFFICIENT_RESOURCES: u32 = 23;
    pub const FREQ_NOT_SUPPORTED: u32 = 24;
    pub const ARGUMENT_VERSION_MISMATCH: u32 = 25;
    pub const DEPRECATED: u32 = 26;
    pub const NOT_READY: u32 = 27;
    pub const GPU_NOT_FOUND: u32 = 28;
    pub const INVALID_STATE: u32 = 29;
    pub const RESET_TYPE_NOT_SUPPORTED: u32 = 30;
}

/// Maps an NVML error onto the crate's error, `what` saying which call failed.
///
/// The split (see [`GpuError`] for why each class is retryable or not):
/// - the library or driver cannot be used at all -> `Unavailable`;
/// - the call or feature does not exist here -> `NotSupported`;
/// - busy, timed out, not ready yet, or an "unknown" internal error -> `Transient`;
/// - the GPU fell off the bus or needs a reset -> `DeviceFault`.
///
/// Calls on one cgroup go through [`map_cgroup_error`] instead, which knows what
/// "operating system error" means there.
#[allow(deprecated)] // AlreadyInitialized is deprecated upstream but still a variant.
pub fn map_nvml_error(what: &str, e: NvmlError) -> GpuError {
    use NvmlError as N;
    let msg = format!("{what}: {e}");
    if let N::UnexpectedVariant(code) = e {
        let msg = format!("{what}: nvmlReturn_t {code}");
        return match code {
            raw_code::INSUFFICIENT_RESOURCES | raw_code::NOT_READY | raw_code::INVALID_STATE => {
                GpuError::Transient(msg)
            }
            // The library does not take the struct version this build passes, or the
            // call is gone from it: nothing a retry changes.
            raw_code::FREQ_NOT_SUPPORTED
            | raw_code::ARGUMENT_VERSION_MISMATCH
            | raw_code::DEPRECATED
            | raw_code::RESET_TYPE_NOT_SUPPORTED => GpuError::NotSupported(msg),
            raw_code::GPU_NOT_FOUND => GpuError::GpuNotFound(msg),
            _ => GpuError::Internal(msg),
        };
    }
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
    /// What clearing a limit found the driver takes as "no hard limit"; None before the
    /// first clear.
    clear_value: Mutex<Option<ClearValue>>,
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
            clear_value: Mutex::new(None),
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

    /// What clearing a limit found the driver takes as "no hard limit" (None before the
    /// first clear), for probes and diagnostics.
    pub fn clear_value(&self) -> Option<ClearValue> {
        *self.clear_value.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The raw getter, for diagnostics that must see exactly what the driver answers
    /// (`NotFound` for a cgroup never limited, for instance) before any interpretation.
    pub fn raw_cgroup_limits(
        &self,
        uuid: &str,
        cgroup: &Path,
    ) -> Result<Result<RawMemoryLimits, NvmlError>, GpuError> {
        let fns = self.limit_fns()?;
        let path = Self::cgroup_cstring(cgroup)?;
        let d = self.device(uuid)?;
        Ok(fns.get(&d, &path))
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

/// Maps an error of a call on one cgroup (`nvmlDeviceSet/GetMemoryLimits_v1`).
///
/// "Operating system error" there means the driver could not open or write the
/// cgroup's files: the cgroup is being removed or not fully created yet, which is
/// the pod's sandbox changing, not NVML being unusable for the node. The share then
/// waits for its sandbox like any other missing target.
pub fn map_cgroup_error(what: &str, cgroup: &Path, e: NvmlError) -> GpuError {
    match e {
        NvmlError::OperatingSystem => GpuError::TargetMissing(format!(
            "{what}({}): {e} (the cgroup is gone or not ready)",
            cgroup.display()
        )),
        other => map_nvml_error(&format!("{what}({})", cgroup.display()), other),
    }
}

/// Why the setter refused a limit, given what the getter says about the cgroup now.
///
/// Which `nvmlReturn_t` the driver gives for "the cgroup already uses more than the new
/// limit" is not documented; the answers that can mean it (out of memory, in use,
/// insufficient resources) become [`GpuError::UsageAboveLimit`] when the cgroup's usage
/// read right after is indeed above the limit, and keep their own class otherwise.
/// `tests/gpu/run-on-gpu.sh` prints the code a real driver gives.
pub fn set_refusal(
    e: NvmlError,
    cgroup: &Path,
    limit: u64,
    read_back: impl FnOnce() -> Result<RawMemoryLimits, NvmlError>,
) -> GpuError {
    const WHAT: &str = "nvmlDeviceSetMemoryLimits_v1";
    let over_usage = matches!(
        e,
        NvmlError::InsufficientMemory
            | NvmlError::InUse
            | NvmlError::UnexpectedVariant(raw_code::INSUFFICIENT_RESOURCES)
    );
    match e {
        // The driver answers "not found" for a cgroup without dmem files, i.e. whose
        // parent does not enable the controller for its children (NVIDIA's MPS memory
        // partitioning guide: "Setting on a cgroup with no dmem files returns 'not
        // found'").
        NvmlError::NotFound => GpuError::NotSupported(format!(
            "{WHAT}({}): cgroup has no device memory controller",
            cgroup.display()
        )),
        e if over_usage => match read_back() {
            Ok(now) if now.current_used > limit => GpuError::UsageAboveLimit {
                cgroup: cgroup.display().to_string(),
                used: now.current_used,
                limit,
            },
            _ => map_cgroup_error(WHAT, cgroup, e),
        },
        other => map_cgroup_error(WHAT, cgroup, other),
    }
}

/// The "no hard limit" value the driver took when a limit was cleared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClearValue {
    /// [`DEVICE_MEMORY_LIMIT_MAX`], the documented sentinel (value assumed; see
    /// [`crate::sys`]).
    LimitMax,
    /// The GPU's total memory, where the driver refused the sentinel as an invalid
    /// argument: the cap is then lifted in effect, not by name.
    TotalMemory,
}

/// Clears a cgroup's limits through `set(soft, hard)`: soft 0 and hard at the sentinel,
/// or, where the driver refuses the sentinel as an invalid argument (the assumed value
/// is wrong), hard at the GPU's `total` memory. `known` is what an earlier clear found
/// the driver takes, so that the refusal is met once, not on every clear.
pub fn clear_limits(
    mut set: impl FnMut(u64, u64) -> Result<(), NvmlError>,
    total: impl FnOnce() -> Result<u64, NvmlError>,
    known: Option<ClearValue>,
) -> Result<ClearValue, NvmlError> {
    if known != Some(ClearValue::TotalMemory) {
        match set(0, DEVICE_MEMORY_LIMIT_MAX) {
            Ok(()) => return Ok(ClearValue::LimitMax),
            Err(NvmlError::InvalidArg) if known.is_none() => {}
            Err(e) => return Err(e),
        }
    }
    set(0, total()?)?;
    Ok(ClearValue::TotalMemory)
}

/// What the getter's answer for `cgroup` means: its limit, no limit, or an error.
pub fn interpret_get(
    answer: Result<RawMemoryLimits, NvmlError>,
    cgroup: &Path,
    total: impl FnOnce() -> Result<u64, GpuError>,
) -> Result<Option<CgroupLimit>, GpuError> {
    match answer {
        Ok(raw) => interpret_limits(raw.soft, raw.hard, raw.current_used, total),
        // The driver's answer for a cgroup that was never given a limit.
        Err(NvmlError::NotFound) => Ok(None),
        Err(e) => Err(map_cgroup_error("nvmlDeviceGetMemoryLimits_v1", cgroup, e)),
    }
}

/// What the driver's read-back means: no limit, or the limit. The documented "no limit"
/// reading is soft 0 with hard at `NVML_DEVICE_MEMORY_LIMIT_MAX`. Its value is assumed
/// (see [`crate::sys`]), and a driver that refused it was cleared with the GPU's total
/// memory, so any hard limit at or above the GPU's memory with soft 0 counts as none.
/// `total` is only asked for when the sentinel is not what was read.
pub fn interpret_limits(
    soft: u64,
    hard: u64,
    used: u64,
    total: impl FnOnce() -> Result<u64, GpuError>,
) -> Result<Option<CgroupLimit>, GpuError> {
    if soft == 0 && (hard == DEVICE_MEMORY_LIMIT_MAX || hard >= total()?) {
        Ok(None)
    } else {
        Ok(Some(CgroupLimit {
            soft_bytes: soft,
            hard_bytes: hard,
            used_bytes: used,
        }))
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
                minor: d.minor_number().ok(),
                pci_bus_id: d
                    .pci_info()
                    .ok()
                    .and_then(|p| shareguard_common::pci::from_nvml_bus_id(&p.bus_id)),
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
                } else if let Err(why) = crate::dmem::driver_regions(&self.cgroup2_root) {
                    // The symbols are there, but nothing would hold a limit: the kernel
                    // lacks the dmem controller or the driver does not account in it.
                    Support::Unsupported(why)
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
        fns.set(&d, &path, bytes, bytes)
            .map_err(|e| set_refusal(e, cgroup, bytes, || fns.get(&d, &path)))
    }

    fn cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<Option<CgroupLimit>, GpuError> {
        let fns = self.limit_fns()?;
        if !cgroup.is_dir() {
            return Ok(None);
        }
        let path = Self::cgroup_cstring(cgroup)?;
        let d = self.device(uuid)?;
        interpret_get(fns.get(&d, &path), cgroup, || Self::total_memory(&d))
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
        let mut known = self.clear_value.lock().unwrap_or_else(|p| p.into_inner());
        let total = || {
            d.memory_info()
                .map(|m| m.total)
                .map_err(|e| {
                    tracing::warn!(error = %e, "nvmlDeviceGetMemoryInfo_v2 failed while clearing a limit");
                    e
                })
        };
        match clear_limits(|soft, hard| fns.set(&d, &path, soft, hard), total, *known) {
            Ok(took) => {
                if *known != Some(took) {
                    match took {
                        ClearValue::LimitMax => tracing::info!(
                            hard = DEVICE_MEMORY_LIMIT_MAX,
                            "the driver takes NVML_DEVICE_MEMORY_LIMIT_MAX as assumed to clear a GPU memory limit"
                        ),
                        ClearValue::TotalMemory => tracing::warn!(
                            tried = DEVICE_MEMORY_LIMIT_MAX,
                            "the driver refused the assumed NVML_DEVICE_MEMORY_LIMIT_MAX; GPU memory limits are cleared to the GPU's total memory instead"
                        ),
                    }
                    *known = Some(took);
                }
                Ok(())
            }
            // The cgroup went away while it was cleared: the driver dropped its limit
            // with it, as above.
            Err(NvmlError::OperatingSystem) if !cgroup.is_dir() => {
                tracing::warn!(
                    cgroup = %cgroup.display(),
                    "cgroup removed while its GPU memory limit was cleared"
                );
                Ok(())
            }
            Err(e) => Err(map_cgroup_error(
                "nvmlDeviceSetMemoryLimits_v1 (clear)",
                cgroup,
                e,
            )),
        }
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
#[path = "nvml_tests.rs"]
mod tests;
