//! Which limiter enforces each device of the inventory.

use std::{collections::HashMap, sync::Arc};

use shareguard_common::limiter::{Enforcement, LimitSpec, Limiter, LimiterError};
use shareguard_limiter_net::limiter::NetLimiter;
use tracing::error;

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
    let mut net: Option<Arc<dyn Limiter>> = None;
    let mut out: HashMap<String, Arc<dyn Limiter>> = HashMap::new();
    for d in &cfg.devices {
        let l: Arc<dyn Limiter> = match d.kind {
            DeviceKind::Generic => Arc::new(AccountingLimiter),
            DeviceKind::Net => net
                .get_or_insert_with(|| {
                    let state = cfg.agent.state_dir.join("net");
                    let pins = cfg.agent.bpffs_dir.join("net");
                    match NetLimiter::new(&state, &pins) {
                        Ok(l) => Arc::new(l),
                        Err(e) => {
                            error!(error = %e, "bandwidth limiter unavailable");
                            Arc::new(Unavailable { why: e.to_string() })
                        }
                    }
                })
                .clone(),
            DeviceKind::Gpu => Arc::new(Unavailable {
                why: "no GPU limiter in this build".to_owned(),
            }),
        };
        out.insert(d.name.clone(), l);
    }
    out
}
