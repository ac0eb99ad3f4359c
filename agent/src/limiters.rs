//! Which limiter enforces each device of the inventory.

use std::{collections::HashMap, sync::Arc};

use shareguard_common::limiter::{Enforcement, LimitSpec, Limiter, LimiterError};
use shareguard_limiter_net::{NetBackend, NetLimiter};
use tracing::{error, info};

use crate::{
    accounting::AccountingLimiter,
    config::{Config, DeviceKind},
};

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

    fn remove(&self, _share_key: &str) -> Result<(), LimiterError> {
        // What an earlier run installed may still be in the kernel; saying it is gone
        // would free capacity that is still limited.
        Err(LimiterError::retryable(format!(
            "enforcement unavailable: {}",
            self.why
        )))
    }
}

pub fn for_config(cfg: &Config) -> HashMap<String, Arc<dyn Limiter>> {
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
                    Ok(b) => match NetLimiter::new(b.clone(), d.net_mechanism) {
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
            DeviceKind::Gpu => Arc::new(Unavailable {
                why: "no GPU limiter in this build".to_owned(),
            }),
        };
        out.insert(d.name.clone(), l);
    }
    out
}
