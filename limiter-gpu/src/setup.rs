//! Builds the GPU limiters from the GPU devices' config section. The agent parses the
//! section ([`GpuConfig`] per device) and hands it here; what a limiter is made of (the
//! NVML opener, reopening after a driver reload, the MPS daemons, a limiter built late
//! when the driver comes up after the agent, the simulated back end) stays inside this
//! crate.

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use tracing::{error, warn};

use crate::{
    GpuBackend, GpuError, GpuLimiter,
    deferred::DeferredGpuLimiter,
    limiter::{GpuDeviceConfig, GpuSelector},
    mps::{MpsConfig, MpsDaemons},
    nvml::NvmlBackend,
    reopen::{BackendOpener, ReopeningBackend},
    simulated::{SimulatedBackend, SimulatedGpu},
    watchdog::Action,
};

/// How often at most NVML is opened again: after a driver reload (the back end), and
/// while it could not be opened at all (the limiter). Each attempt is an nvmlInit and a
/// probe, cheap, but not for every share and watchdog poll.
pub const REOPEN_INTERVAL: Duration = Duration::from_secs(5);

/// Which back end drives a GPU device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuBackendKind {
    Nvml,
    /// An in-memory GPU of `memory_bytes`, for tests and demos without a GPU.
    Simulated {
        memory_bytes: u64,
        /// Whether the simulated driver offers per-cgroup limits.
        cgroup_limits: bool,
        /// Whether it offers MPS (which then runs real daemons of the MPS config's
        /// control program).
        mps: bool,
        /// The PCI address it claims (`[device.simulated] pci_bus_id`), if any.
        pci_bus_id: Option<String>,
        /// How many GPUs the back end lists for `gpus = "all"` (`[device.simulated]
        /// count`); 1 for a device that names its GPU.
        count: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchdogConfig {
    pub period: Duration,
    pub action: Action,
}

/// The `gpu` section of one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConfig {
    pub backend: GpuBackendKind,
    pub selector: GpuSelector,
    /// True when the `memory` capacity has no `value` in the config: the agent takes the
    /// GPU's memory when it starts (until then the capacity reads 0).
    pub discover_memory: bool,
    pub watchdog: WatchdogConfig,
    /// Where the driver's device nodes, libraries and tools are on the host, for the
    /// share's containers (see [`crate::driver`]). `/` for an NVML GPU unless set; a
    /// simulated GPU has none unless set, and its containers then get only the
    /// environment.
    pub driver_root: Option<PathBuf>,
    /// Where the agent's container mounts the host's driver root, when it does; else
    /// the agent reads it through pid 1's root or as it is.
    pub container_driver_root: Option<PathBuf>,
}

/// One GPU device of the inventory: its name, its section, and its `memory` capacity
/// in bytes where the config gives one.
#[derive(Clone, Copy, Debug)]
pub struct GpuDevice<'a> {
    pub name: &'a str,
    pub gpu: &'a GpuConfig,
    pub memory_bytes: Option<u64>,
}

/// What else the GPU limiters are built from: the agent's MPS settings and, for the
/// simulated back end, the file its faults are injected from.
#[derive(Clone, Debug, Default)]
pub struct Setup {
    pub mps: MpsConfig,
    pub simulated_faults: Option<PathBuf>,
}

/// One back end's limiter and the devices it serves.
pub struct GpuGroup {
    /// The devices, in the order they were given.
    pub devices: Vec<String>,
    /// The limiter, built or building itself once NVML opens; an error when it can never
    /// be built (a simulated GPU the config cannot be resolved against).
    pub limiter: Result<Arc<DeferredGpuLimiter>, GpuError>,
    /// Simulation only: the simulated back end, whose processes the watchdog is fed.
    pub simulated: Option<Arc<SimulatedBackend>>,
}

/// One limiter per back end kind (NVML, simulated) over that kind's devices; kinds
/// without devices get none.
pub fn build(devices: &[GpuDevice], setup: &Setup) -> Vec<GpuGroup> {
    let mut groups = Vec::new();
    for simulated in [false, true] {
        let devices: Vec<&GpuDevice> = devices
            .iter()
            .filter(|d| matches!(d.gpu.backend, GpuBackendKind::Simulated { .. }) == simulated)
            .collect();
        if devices.is_empty() {
            continue;
        }
        let configs: Vec<GpuDeviceConfig> = devices
            .iter()
            .map(|d| GpuDeviceConfig {
                name: d.name.to_owned(),
                gpu: d.gpu.selector.clone(),
                memory_bytes: d.memory_bytes.filter(|_| !d.gpu.discover_memory),
                driver_root: d.gpu.driver_root.clone(),
                container_driver_root: d.gpu.container_driver_root.clone(),
            })
            .collect();
        // Checked when the config was read, so this only fails for a config built in
        // code; then MPS is left out and said so.
        let mps_config = setup.mps.clone();
        let mps_daemons = move || {
            MpsDaemons::new(mps_config.clone())
                .map_err(
                    |e| error!(error = %e, "MPS daemons unusable; no GPU gets the mps mechanism"),
                )
                .ok()
        };
        let names: Vec<String> = devices.iter().map(|d| d.name.to_owned()).collect();
        if simulated {
            let backend = Arc::new(simulated_backend(&devices, setup, mps_daemons()));
            warn!(devices = ?names, "GPU devices on the SIMULATED back end: nothing real enforces their shares");
            // A simulated GPU is there from the start; a limiter that cannot be built
            // over it is a config error, which no retry mends.
            let limiter = GpuLimiter::new(backend.clone(), &configs)
                .map(|l| Arc::new(DeferredGpuLimiter::ready(Arc::new(l))));
            if let Err(e) = &limiter {
                error!(error = %e, "GPU limiter unavailable");
            }
            groups.push(GpuGroup {
                devices: names,
                limiter,
                simulated: Some(backend),
            });
        } else {
            let discovered: Vec<String> = devices
                .iter()
                .filter(|d| d.gpu.discover_memory)
                .map(|d| d.name.to_owned())
                .collect();
            let limiter = Arc::new(nvml_limiter(configs, mps_daemons, &names, discovered));
            groups.push(GpuGroup {
                devices: names,
                limiter: Ok(limiter),
                simulated: None,
            });
        }
    }
    groups
}

/// The GPUs a `gpus = "all"` device of back end `backend` stands for, as the back end
/// lists them now: NVML's every GPU; for a SIMULATED back end, `count` GPUs named
/// `GPU-simulated-<device>-<i>`. An error when NVML cannot be opened (no driver on the
/// node, or not yet).
pub fn list(
    device: &str,
    backend: &GpuBackendKind,
) -> Result<Vec<crate::backend::GpuInfo>, GpuError> {
    match backend {
        GpuBackendKind::Nvml => NvmlBackend::open()?.discover(),
        GpuBackendKind::Simulated {
            memory_bytes,
            count,
            pci_bus_id,
            ..
        } => {
            let gpus = (0..*count)
                .map(|i| {
                    let mut gpu =
                        SimulatedGpu::new(format!("GPU-simulated-{device}-{i}"), *memory_bytes);
                    gpu.pci_bus_id = pci_bus_id.clone();
                    gpu
                })
                .collect();
            SimulatedBackend::new(gpus).discover()
        }
    }
}

fn simulated_backend(
    devices: &[&GpuDevice],
    setup: &Setup,
    mps: Option<MpsDaemons>,
) -> SimulatedBackend {
    let gpus = devices
        .iter()
        .filter_map(|d| match (&d.gpu.selector, &d.gpu.backend) {
            (
                GpuSelector::Uuid(u),
                GpuBackendKind::Simulated {
                    memory_bytes,
                    cgroup_limits,
                    mps,
                    pci_bus_id,
                    ..
                },
            ) => {
                let mut gpu = SimulatedGpu::new(u.clone(), *memory_bytes);
                gpu.cgroup_limits = *cgroup_limits;
                gpu.mps = *mps;
                gpu.pci_bus_id = pci_bus_id.clone();
                Some(gpu)
            }
            _ => None,
        })
        .collect();
    let backend = SimulatedBackend::new(gpus).with_faults_file(setup.simulated_faults.clone());
    match mps {
        Some(d) => backend.with_mps_daemons(d),
        None => backend,
    }
}

/// The NVML devices' limiter: built now if NVML opens, else on use and from the
/// watchdog loop once it does (the driver container may come up after the agent). Its
/// back end is opened again after a driver reload.
///
/// Devices whose memory the config takes from the GPU (`discovered`) get their capacity
/// only when the limiter is built at start: the inventory is fixed then, so when NVML
/// comes later they stay at capacity 0 (nothing is admitted on them) until the agent
/// restarts, which the log says.
fn nvml_limiter(
    configs: Vec<GpuDeviceConfig>,
    mps_daemons: impl Fn() -> Option<MpsDaemons> + Send + Sync + 'static,
    names: &[String],
    discovered: Vec<String>,
) -> DeferredGpuLimiter {
    let open: BackendOpener = Arc::new(move || {
        NvmlBackend::open()
            .map(|b| match mps_daemons() {
                Some(d) => b.with_mps(d),
                None => b,
            })
            .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
    });
    let attempts = AtomicU32::new(0);
    let build = Box::new(move || {
        let at_start = attempts.fetch_add(1, Ordering::Relaxed) == 0;
        let backend = ReopeningBackend::open(open.clone(), REOPEN_INTERVAL)?;
        let l = GpuLimiter::new(Arc::new(backend), &configs)?;
        if !at_start && !discovered.is_empty() {
            warn!(devices = ?discovered, "NVML came up after the agent started: these devices keep capacity 0 (their memory is taken from the GPU) until the agent restarts");
        }
        Ok(l)
    });
    let gpu = DeferredGpuLimiter::new("NVML", build, REOPEN_INTERVAL);
    if gpu.built().is_none() {
        error!(devices = ?names, reason = %gpu.why(), "NVML unavailable: the GPU devices cannot be enforced until it can be opened; retrying");
    }
    gpu
}
