//! The limiter of `generic` devices: accounting only. Its shares are ACCOUNTED, which the
//! API states as "counted in the ledger, not enforced", never ENFORCED.

use shareguard_common::limiter::{DeviceFacts, Enforcement, LimitSpec, Limiter, LimiterError};

pub const MECHANISM: &str = "accounting-only";

#[derive(Debug, Default)]
pub struct AccountingLimiter;

impl Limiter for AccountingLimiter {
    fn mechanisms(&self) -> Vec<String> {
        vec![MECHANISM.to_owned()]
    }

    fn accounting_only(&self) -> bool {
        true
    }

    fn device_facts(&self, _device: &str) -> DeviceFacts {
        DeviceFacts {
            mechanism: MECHANISM.to_owned(),
            enforces: false,
            attributes: Default::default(),
            int_attributes: Default::default(),
            // Nothing to break: counting needs no hardware.
            fault: None,
        }
    }

    fn apply(&self, _spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        Ok(Enforcement {
            mechanism: MECHANISM.to_owned(),
            ..Enforcement::default()
        })
    }

    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.apply(spec)
    }

    fn remove(&self, _share_key: &str) -> Result<(), LimiterError> {
        Ok(())
    }
}
