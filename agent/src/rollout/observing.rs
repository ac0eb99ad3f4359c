//! [`Observing`]: a device's limiter as the engine sees it while the device is in the
//! `observe` stage. It lifts whatever its device's limiter installed for a share and
//! applies nothing but what measures it (the device limiter's `observe`); its pods are still found (it needs of the pod what the limiter
//! needs), so that the share is ready to be enforced the moment the stage changes.

use std::sync::Arc;

use shareguard_common::limiter::{
    CdiDevice, DeviceFacts, Enforcement, LimitSpec, Limiter, LimiterError, Needs, TrafficCounters,
};

pub struct Observing {
    inner: Arc<dyn Limiter>,
}

impl Observing {
    pub fn new(inner: Arc<dyn Limiter>) -> Self {
        Self { inner }
    }
}

impl Limiter for Observing {
    fn mechanisms(&self) -> Vec<String> {
        self.inner.mechanisms()
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn needs(&self, device: &str) -> Needs {
        self.inner.needs(device)
    }

    /// Lifts what an earlier stage installed (a share enforced before the rollback) and
    /// installs only what measures the share (the bandwidth limiter counts its traffic).
    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.inner.observe(spec)
    }

    /// Verifying in `observe` checks that the share is measured and not limited, and a
    /// limit an earlier stage left (a crash in the middle of a stage change) fails it,
    /// so that the reconciler's pass or the start lifts it.
    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.inner.verify_observed(spec)
    }

    fn observe(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.inner.observe(spec)
    }

    fn verify_observed(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.inner.verify_observed(spec)
    }

    fn remove(&self, share_key: &str) -> Result<(), LimiterError> {
        self.inner.remove(share_key)
    }

    fn counters(&self, share_key: &str) -> Option<TrafficCounters> {
        self.inner.counters(share_key)
    }

    /// The same CDI devices as under `enforce`: a stage change never changes what a
    /// pod's containers were given.
    fn cdi_device(&self, device: &str, share_key: &str) -> Option<CdiDevice> {
        self.inner.cdi_device(device, share_key)
    }

    /// The device's own: `enforced` says what its mechanism can hold, the `stage`
    /// attribute (from the device listing) whether it does now, so that a DeviceClass
    /// chooses between them and a rollback does not make a device unschedulable.
    fn device_facts(&self, device: &str) -> DeviceFacts {
        self.inner.device_facts(device)
    }
}
