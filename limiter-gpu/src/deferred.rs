//! [`DeferredGpuLimiter`]: the `gpu` devices' limiter on a node whose NVML cannot be
//! opened yet.
//!
//! The GPU operator's driver container often comes up after the agent: at the agent's
//! start `libnvidia-ml.so.1` is missing or the driver is not loaded. Rather than
//! leaving the GPU devices unusable until someone restarts the agent, this limiter keeps
//! trying to build the real [`GpuLimiter`], at most once per interval, whenever a share
//! is applied, verified or removed and whenever the watchdog loop polls. Until it
//! succeeds, every share fails retryably with the reason and the devices report the
//! mechanism `unavailable`; once it succeeds it serves as that limiter, for good (a
//! later driver reload is the back end's to survive: see [`crate::reopen`]).
//!
//! What it cannot do late: devices whose `memory` capacity is taken from the GPU were
//! published with capacity 0 when the agent started without NVML (nothing is admitted
//! on them) and keep it until the agent restarts; devices with a configured capacity
//! work as soon as the limiter is built.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use shareguard_common::limiter::{
    CdiDevice, DeviceFacts, DeviceFault, Enforcement, LimitSpec, Limiter, LimiterError, Needs,
};

use crate::error::GpuError;
use crate::limiter::GpuLimiter;
use crate::reopen::RetryGate;

/// Builds the limiter: opens the back end, discovers the GPUs, probes the mechanisms.
pub type LimiterBuilder = Box<dyn Fn() -> Result<GpuLimiter, GpuError> + Send + Sync>;

pub struct DeferredGpuLimiter {
    /// What is being opened ("NVML"), to begin the reason with.
    label: &'static str,
    build: Option<LimiterBuilder>,
    gate: RetryGate,
    built: OnceLock<Arc<GpuLimiter>>,
    /// Why it is not built yet; held while building, so that one build runs at a time.
    why: Mutex<String>,
}

impl DeferredGpuLimiter {
    /// Tries to build the limiter now, and again at most once per `interval` on use.
    /// `label` names what is opened ("NVML") in the reason shares and devices show.
    pub fn new(label: &'static str, build: LimiterBuilder, interval: Duration) -> Self {
        let d = Self {
            label,
            build: Some(build),
            gate: RetryGate::new(interval),
            built: OnceLock::new(),
            why: Mutex::new("not built yet".into()),
        };
        d.get();
        d
    }

    /// A limiter that is there from the start (the simulated back end, or NVML that
    /// opened at once), so that the agent handles every GPU back end one way.
    pub fn ready(limiter: Arc<GpuLimiter>) -> Self {
        let built = OnceLock::new();
        // A fresh OnceLock cannot be set already.
        let _ = built.set(limiter);
        Self {
            label: "",
            build: None,
            gate: RetryGate::new(Duration::MAX),
            built,
            why: Mutex::new(String::new()),
        }
    }

    /// The limiter if built, without trying to build it.
    pub fn built(&self) -> Option<Arc<GpuLimiter>> {
        self.built.get().cloned()
    }

    /// The limiter, built first if it is not yet and the interval allows.
    pub fn get(&self) -> Option<Arc<GpuLimiter>> {
        if let Some(l) = self.built.get() {
            return Some(l.clone());
        }
        let build = self.build.as_ref()?;
        let mut why = self.why.lock().unwrap_or_else(|p| p.into_inner());
        // Another caller may have built it while this one waited for the lock.
        if let Some(l) = self.built.get() {
            return Some(l.clone());
        }
        if !self.gate.try_pass() {
            return None;
        }
        match build() {
            Ok(l) => {
                tracing::info!(
                    backend = self.label,
                    "GPU limiter built; the GPU devices are served from now on"
                );
                let l = Arc::new(l);
                // Only set here, under `why`'s lock, after checking it is unset.
                let _ = self.built.set(l.clone());
                why.clear();
                Some(l)
            }
            Err(e) => {
                tracing::warn!(backend = self.label, error = %e, retry_in = ?self.gate.interval(), "GPU limiter cannot be built yet");
                *why = e.to_string();
                None
            }
        }
    }

    /// Why there is no limiter yet, and when it is tried again.
    pub fn why(&self) -> String {
        let why = self.why.lock().unwrap_or_else(|p| p.into_inner());
        format!(
            "{}: {why} (tried again at most every {:?})",
            self.label,
            self.gate.interval()
        )
    }

    fn unavailable(&self) -> LimiterError {
        LimiterError::retryable(format!("enforcement unavailable: {}", self.why()))
    }
}

impl Limiter for DeferredGpuLimiter {
    fn mechanisms(&self) -> Vec<String> {
        match self.built() {
            Some(l) => l.mechanisms(),
            None => vec![format!("unavailable: {}", self.why())],
        }
    }

    fn accounting_only(&self) -> bool {
        false
    }

    /// Until the mechanism is known, a share waits for its pod's cgroup, the most any
    /// GPU mechanism needs: a share applied without it would be refused for good by
    /// `nvml-cgroup`, while one that has it suits every mechanism.
    fn needs(&self, device: &str) -> Needs {
        match self.built() {
            Some(l) => l.needs(device),
            None => Needs::Cgroup,
        }
    }

    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        match self.get() {
            Some(l) => l.apply(spec),
            None => Err(self.unavailable()),
        }
    }

    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        match self.get() {
            Some(l) => l.verify(spec),
            None => Err(self.unavailable()),
        }
    }

    fn observe(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        match self.get() {
            Some(l) => l.observe(spec),
            None => Err(self.unavailable()),
        }
    }

    fn verify_observed(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        match self.get() {
            Some(l) => l.verify_observed(spec),
            None => Err(self.unavailable()),
        }
    }

    fn remove(&self, share_key: &str) -> Result<(), LimiterError> {
        match self.get() {
            Some(l) => l.remove(share_key),
            // What an earlier run installed may still be in the driver; saying it is
            // gone would free capacity that is still limited.
            None => Err(self.unavailable()),
        }
    }

    fn failed_apply_installs_nothing(&self) -> bool {
        // Without a limiter `apply` refuses before touching anything.
        self.built().is_none()
    }

    fn cdi_device(&self, device: &str, share_key: &str) -> Option<CdiDevice> {
        self.built()?.cdi_device(device, share_key)
    }

    fn device_facts(&self, device: &str) -> DeviceFacts {
        match self.built() {
            Some(l) => l.device_facts(device),
            None => DeviceFacts {
                mechanism: "unavailable".to_owned(),
                enforces: false,
                attributes: Default::default(),
                int_attributes: Default::default(),
                fault: Some(DeviceFault::new("limiter-unavailable", self.why())),
            },
        }
    }
}

#[cfg(test)]
#[path = "deferred_tests.rs"]
mod tests;
