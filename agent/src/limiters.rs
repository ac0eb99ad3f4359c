//! Which limiter enforces each device of the inventory.

use std::{collections::HashMap, sync::Arc};

use shareguard_common::{
    Format, Quantity,
    limiter::{DeviceFacts, DeviceFault, Enforcement, LimitSpec, Limiter, LimiterError},
};
use shareguard_limiter_gpu::{
    limiter::MEMORY,
    setup::{self, WatchdogConfig},
};
use shareguard_limiter_net::setup::NetDevice;
use tracing::{error, info};

use crate::{
    accounting::AccountingLimiter,
    config::{Config, DeviceKind},
    gpu_watch::GpuWatch,
};

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
            int_attributes: Default::default(),
            fault: Some(DeviceFault::new(
                "limiter-unavailable",
                format!("enforcement unavailable: {}", self.why),
            )),
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

/// Builds the limiters for `cfg` and fills in what only they can know: the GPUs of
/// `gpus = "all"` devices ([`crate::gpu_inventory`]) and the memory of GPUs whose
/// capacity the config leaves out.
///
/// Fails when a GPU's memory, read from the GPU, is smaller than what the device's
/// request policy needs (resource.k8s.io would refuse the device's ResourceSlice), or a
/// found GPU's device name is unusable.
pub fn for_config(cfg: &mut Config) -> Result<Limiters, String> {
    crate::gpu_inventory::expand(cfg)?;
    let mut out: HashMap<String, Arc<dyn Limiter>> = HashMap::new();
    for d in cfg.devices.iter().filter(|d| d.kind == DeviceKind::Generic) {
        out.insert(d.name.clone(), Arc::new(AccountingLimiter));
    }
    net_limiters(cfg, &mut out);
    let gpu_watches = gpu_limiters(cfg, &mut out)?;
    Ok(Limiters {
        by_device: out,
        gpu_watches,
    })
}

/// The net devices' limiters, built by the bandwidth limiter crate from their sections;
/// a device whose limiter cannot be built is listed unavailable, with the reason.
fn net_limiters(cfg: &Config, out: &mut HashMap<String, Arc<dyn Limiter>>) {
    let devices: Vec<NetDevice> = cfg
        .devices
        .iter()
        .filter_map(|d| {
            Some(NetDevice {
                name: &d.name,
                net: d.net.as_ref()?,
            })
        })
        .collect();
    let state = cfg.agent.state_dir.join("net");
    let pins = cfg.agent.bpffs_dir.join("net");
    match shareguard_limiter_net::setup::build(&state, &pins, &devices) {
        Ok(built) => {
            for (name, l) in built {
                let l: Arc<dyn Limiter> = match l {
                    Ok(l) => {
                        info!(device = %name, mechanism = %l.mechanism(), "bandwidth mechanism chosen");
                        Arc::new(l)
                    }
                    Err(e) => {
                        error!(device = %name, error = %e, "bandwidth limiter unavailable for the device");
                        Arc::new(Unavailable { why: e.to_string() })
                    }
                };
                out.insert(name, l);
            }
        }
        Err(e) => {
            error!(error = %e, "bandwidth limiter unavailable");
            for d in devices {
                out.insert(
                    d.name.to_owned(),
                    Arc::new(Unavailable { why: e.to_string() }),
                );
            }
        }
    }
}

/// The GPU devices' limiters, built by the GPU limiter crate from their sections (one
/// per back end), and the watchdog of each; then the memory of GPUs whose capacity the
/// config leaves out.
fn gpu_limiters(
    cfg: &mut Config,
    out: &mut HashMap<String, Arc<dyn Limiter>>,
) -> Result<Vec<GpuWatch>, String> {
    let devices: Vec<setup::GpuDevice> = cfg
        .devices
        .iter()
        .filter_map(|d| {
            let gpu = d.gpu.as_ref()?;
            Some(setup::GpuDevice {
                name: &d.name,
                gpu,
                memory_bytes: d
                    .capacities
                    .get(MEMORY)
                    .and_then(|c| c.value.ceil_units())
                    .and_then(|b| u64::try_from(b).ok()),
            })
        })
        .collect();
    let watchdogs: HashMap<&str, WatchdogConfig> = devices
        .iter()
        .map(|d| (d.name, d.gpu.watchdog.clone()))
        .collect();
    let groups = setup::build(
        &devices,
        &setup::Setup {
            mps: cfg.agent.mps.clone(),
            simulated_faults: cfg.agent.simulated_gpu_faults.clone(),
        },
    );
    let mut watches = Vec::new();
    let mut built = Vec::new();
    for g in groups {
        let gpu = match g.limiter {
            Ok(l) => l,
            Err(e) => {
                for name in g.devices {
                    out.insert(name, Arc::new(Unavailable { why: e.to_string() }));
                }
                continue;
            }
        };
        for name in &g.devices {
            out.insert(name.clone(), gpu.clone() as Arc<dyn Limiter>);
        }
        watches.push(GpuWatch::new(
            gpu.clone(),
            g.simulated,
            cfg.agent.simulated_gpu_processes.clone(),
            g.devices
                .iter()
                .filter_map(|n| Some((n.clone(), watchdogs.get(n.as_str())?.clone())))
                .collect(),
        ));
        built.push((g.devices, gpu));
    }
    // Capacities the config left to the GPU, where the GPU could be asked now.
    for (names, gpu) in built {
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use shareguard_common::limiter::{Needs, Retry, Target};
    use shareguard_limiter_gpu::nvml::NvmlBackend;

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
