//! Which limiter enforces each device of the inventory.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use shareguard_common::{
    Format, Quantity,
    limiter::{DeviceFacts, Enforcement, LimitSpec, Limiter, LimiterError},
};
use shareguard_limiter_gpu::mps::MpsDaemons;
use shareguard_limiter_gpu::{
    GpuBackend, GpuLimiter,
    deferred::DeferredGpuLimiter,
    limiter::{GpuDeviceConfig, MEMORY},
    nvml::NvmlBackend,
    reopen::{BackendOpener, ReopeningBackend},
    simulated::{SimulatedBackend, SimulatedGpu},
};
use shareguard_limiter_net::{NetBackend, NetLimiter};
use tracing::{error, info, warn};

use crate::{
    accounting::AccountingLimiter,
    config::gpu::GpuBackendKind,
    config::{Config, DeviceKind},
    gpu_watch::GpuWatch,
};

/// How often at most NVML is opened again: after a driver reload (the back end), and
/// while it could not be opened at all (the GPU limiter). Each attempt is an nvmlInit
/// and a probe, cheap, but not for every share and watchdog poll.
const GPU_REOPEN_INTERVAL: Duration = Duration::from_secs(5);

/// The limiter of every device, and the GPU watchdogs to run (one per GPU back end).
pub struct Limiters {
    pub by_device: HashMap<String, Arc<dyn Limiter>>,
    pub gpu_watches: Vec<GpuWatch>,
}

/// Stands in for a limiter that could not start (no BPF, no bpffs): the device is
/// listed with the reason, and its shares fail with it instead of being reported as
/// enforced. The agent keeps serving its other devices.
struct Unavailable {
    why: String,
}

impl Limiter for Unavailable {
    fn mechanisms(&self) -> Vec<String> {
        vec![format!("unavailable: {}", self.why)]
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn device_facts(&self, _device: &str) -> DeviceFacts {
        DeviceFacts {
            mechanism: "unavailable".to_owned(),
            enforces: false,
            attributes: Default::default(),
        }
    }

    fn apply(&self, _spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Err(LimiterError::permanent(format!(
            "enforcement unavailable: {}",
            self.why
        )))
    }

    fn verify(&self, _spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Err(LimiterError::retryable(format!(
            "enforcement unavailable: {}",
            self.why
        )))
    }

    fn failed_apply_installs_nothing(&self) -> bool {
        // `apply` refuses before anything is installed.
        true
    }

    fn remove(&self, _share_key: &str) -> Result<(), LimiterError> {
        // What an earlier run installed may still be in the kernel; saying it is gone
        // would free capacity that is still limited.
        Err(LimiterError::retryable(format!(
            "enforcement unavailable: {}",
            self.why
        )))
    }
}

/// Builds the limiters for `cfg` and fills in what only they can know: the memory of
/// GPUs whose capacity the config leaves out.
///
/// Fails when a GPU's memory, read from the GPU, is smaller than what the device's
/// request policy needs (resource.k8s.io would refuse the device's ResourceSlice).
pub fn for_config(cfg: &mut Config) -> Result<Limiters, String> {
    // One back end (programs, pins, install records, probe) for all net devices, opened
    // on first use; each device gets its own mechanism on top of it.
    let mut net: Option<Result<Arc<NetBackend>, String>> = None;
    let mut out: HashMap<String, Arc<dyn Limiter>> = HashMap::new();
    for d in &cfg.devices {
        let l: Arc<dyn Limiter> = match d.kind {
            DeviceKind::Generic => Arc::new(AccountingLimiter),
            DeviceKind::Net => {
                let backend = net.get_or_insert_with(|| {
                    let state = cfg.agent.state_dir.join("net");
                    let pins = cfg.agent.bpffs_dir.join("net");
                    NetBackend::open(&state, &pins).map_err(|e| {
                        error!(error = %e, "bandwidth limiter unavailable");
                        e.to_string()
                    })
                });
                match backend {
                    Ok(b) => match NetLimiter::new(b.clone(), d.net_mechanism, d.net_line_rate_bps)
                    {
                        Ok(l) => {
                            info!(device = %d.name, mechanism = %l.mechanism(), "bandwidth mechanism chosen");
                            Arc::new(l)
                        }
                        Err(e) => {
                            error!(device = %d.name, error = %e, "bandwidth limiter unavailable for the device");
                            Arc::new(Unavailable { why: e.to_string() })
                        }
                    },
                    Err(why) => Arc::new(Unavailable { why: why.clone() }),
                }
            }
            // Below, per back end.
            DeviceKind::Gpu => continue,
        };
        out.insert(d.name.clone(), l);
    }
    let gpu_watches = gpu_limiters(cfg, &mut out)?;
    Ok(Limiters {
        by_device: out,
        gpu_watches,
    })
}

/// One `GpuLimiter` per back end kind (NVML, simulated) over that kind's devices.
fn gpu_limiters(
    cfg: &mut Config,
    out: &mut HashMap<String, Arc<dyn Limiter>>,
) -> Result<Vec<GpuWatch>, String> {
    let mut watches = Vec::new();
    for simulated in [false, true] {
        let devices: Vec<_> = cfg
            .devices
            .iter()
            .filter_map(|d| d.gpu.as_ref().map(|g| (d, g)))
            .filter(|(_, g)| matches!(g.backend, GpuBackendKind::Simulated { .. }) == simulated)
            .collect();
        if devices.is_empty() {
            continue;
        }
        let configs: Vec<GpuDeviceConfig> = devices
            .iter()
            .map(|(d, g)| GpuDeviceConfig {
                name: d.name.clone(),
                gpu: g.selector.clone(),
                memory_bytes: d
                    .capacities
                    .get(MEMORY)
                    .filter(|_| !g.discover_memory)
                    .and_then(|c| c.value.ceil_units())
                    .and_then(|b| u64::try_from(b).ok()),
                driver_root: g.driver_root.clone(),
                container_driver_root: g.container_driver_root.clone(),
            })
            .collect();
        // Checked when the config was read, so this only fails for a config built in
        // code; then MPS is left out and said so.
        let mps_config = cfg.agent.mps.clone();
        let mps_daemons = move || {
            MpsDaemons::new(mps_config.clone())
                .map_err(
                    |e| error!(error = %e, "MPS daemons unusable; no GPU gets the mps mechanism"),
                )
                .ok()
        };
        let sim_backend = simulated.then(|| {
            let gpus = devices
                .iter()
                .filter_map(|(_, g)| match (&g.selector, &g.backend) {
                    (
                        shareguard_limiter_gpu::limiter::GpuSelector::Uuid(u),
                        GpuBackendKind::Simulated {
                            memory_bytes,
                            cgroup_limits,
                            mps,
                        },
                    ) => {
                        let mut gpu = SimulatedGpu::new(u.clone(), *memory_bytes);
                        gpu.cgroup_limits = *cgroup_limits;
                        gpu.mps = *mps;
                        Some(gpu)
                    }
                    _ => None,
                })
                .collect();
            let backend = SimulatedBackend::new(gpus)
                .with_faults_file(cfg.agent.simulated_gpu_faults.clone());
            Arc::new(match mps_daemons() {
                Some(d) => backend.with_mps_daemons(d),
                None => backend,
            })
        });
        let names: Vec<String> = devices.iter().map(|(d, _)| d.name.clone()).collect();
        let watchdogs: Vec<_> = devices
            .iter()
            .map(|(d, g)| (d.name.clone(), g.watchdog.clone()))
            .collect();
        let discovered: Vec<String> = devices
            .iter()
            .filter(|(_, g)| g.discover_memory)
            .map(|(d, _)| d.name.clone())
            .collect();
        let gpu = match &sim_backend {
            Some(b) => {
                warn!(devices = ?names, "GPU devices on the SIMULATED back end: nothing real enforces their shares");
                // A simulated GPU is there from the start; a limiter that cannot be built
                // over it is a config error, which no retry mends.
                match GpuLimiter::new(b.clone(), &configs) {
                    Ok(l) => Arc::new(DeferredGpuLimiter::ready(Arc::new(l))),
                    Err(e) => {
                        error!(error = %e, "GPU limiter unavailable");
                        for name in names {
                            out.insert(name, Arc::new(Unavailable { why: e.to_string() }));
                        }
                        continue;
                    }
                }
            }
            None => Arc::new(nvml_limiter(configs, mps_daemons, &names, discovered)),
        };
        for name in &names {
            out.insert(name.clone(), gpu.clone() as Arc<dyn Limiter>);
        }
        watches.push(GpuWatch::new(
            gpu.clone(),
            sim_backend,
            cfg.agent.simulated_gpu_processes.clone(),
            watchdogs,
        ));
        // Capacities the config left to the GPU, where the GPU could be asked now.
        let Some(l) = gpu.built() else { continue };
        for d in cfg.devices.iter_mut().filter(|d| names.contains(&d.name)) {
            if d.gpu.as_ref().is_some_and(|g| g.discover_memory)
                && let (Some(dev), Some(cap)) = (l.device(&d.name), d.capacities.get_mut(MEMORY))
                && let Some(q) =
                    Quantity::from_units(i128::from(dev.capacity_bytes), Format::BinarySI)
            {
                info!(device = %d.name, memory = %q, "GPU memory capacity taken from the GPU");
                cap.policy.check_capacity(&q).map_err(|e| {
                    format!(
                        "device {}: capacity {MEMORY} (the GPU's memory, {q}): {e}; give the capacity a value, or a policy that fits this GPU",
                        d.name
                    )
                })?;
                cap.value = q;
            }
        }
    }
    Ok(watches)
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
        let backend = ReopeningBackend::open(open.clone(), GPU_REOPEN_INTERVAL)?;
        let l = GpuLimiter::new(Arc::new(backend), &configs)?;
        if !at_start && !discovered.is_empty() {
            warn!(devices = ?discovered, "NVML came up after the agent started: these devices keep capacity 0 (their memory is taken from the GPU) until the agent restarts");
        }
        Ok(l)
    });
    let gpu = DeferredGpuLimiter::new("NVML", build, GPU_REOPEN_INTERVAL);
    if gpu.built().is_none() {
        error!(devices = ?names, reason = %gpu.why(), "NVML unavailable: the GPU devices cannot be enforced until it can be opened; retrying");
    }
    gpu
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use shareguard_common::limiter::{Needs, Retry, Target};

    use super::*;

    const NVML_GPU: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"
cdi_dir = "/tmp/cdi"

[[device]]
name = "gpu-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "gpu"
backend = "nvml"
index = 0
[device.capacity.memory]
value = "80Gi"
default = "10Gi"
valid_range = { min = "1Gi", step = "1Gi" }
"#;

    #[test]
    fn nvml_missing_at_start_leaves_the_gpu_retrying_not_unavailable_for_good() {
        if NvmlBackend::open().is_ok() {
            // A machine with a driver: nothing missing to retry.
            return;
        }
        let mut cfg = Config::parse(NVML_GPU, "t.toml").unwrap();
        let limiters = for_config(&mut cfg).unwrap();
        let l = &limiters.by_device["gpu-0"];
        assert!(
            l.mechanisms()[0].starts_with("unavailable: "),
            "{:?}",
            l.mechanisms()
        );
        let facts = l.device_facts("gpu-0");
        assert_eq!(facts.mechanism, "unavailable");
        assert!(!facts.enforces);
        assert_eq!(
            l.needs("gpu-0"),
            Needs::Cgroup,
            "waits for the pod's cgroup"
        );
        let spec = LimitSpec {
            share_key: "s".into(),
            device: "gpu-0".into(),
            limits: BTreeMap::from([(MEMORY.to_owned(), Quantity::parse("10Gi").unwrap())]),
            target: Target::default(),
        };
        let e = l.apply(&spec).unwrap_err();
        assert_eq!(e.retry, Retry::Retryable, "{e:?}");
        assert!(e.message.contains("NVML"), "says why: {}", e.message);
        assert_eq!(l.remove("s").unwrap_err().retry, Retry::Retryable);
        // The watchdog loop runs for it, and each poll is a (rate-limited) attempt.
        assert_eq!(limiters.gpu_watches.len(), 1);
        let polled = limiters.gpu_watches[0].poll(std::path::Path::new("/proc"));
        assert!(
            matches!(polled, Err(shareguard_limiter_gpu::GpuError::Reopening(_))),
            "{:?}",
            polled.err()
        );
    }
}
