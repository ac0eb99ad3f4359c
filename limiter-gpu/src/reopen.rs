//! [`ReopeningBackend`]: a GPU back end that survives a driver reload.
//!
//! A reloaded or upgraded driver leaves an initialised NVML handle useless for good:
//! every call answers "uninitialized", "driver not loaded", "library/driver version
//! mismatch" or "GPU lost", and nothing but `nvmlShutdown` + `nvmlInit` recovers it. This
//! wrapper drops the back end at the first such answer (for NVML that runs
//! `nvmlShutdown` once the last call in flight on it returns) and opens a new one through
//! its opener (for NVML: `nvmlInit` and the probe of symbols and driver version again),
//! at most once per interval, so that a driver that stays away is not hammered with
//! `nvmlInit` by every share and watchdog poll. A call that met the loss is run once more
//! on the reopened back end when the interval allows, so the caller mostly sees nothing.
//!
//! What is not redone: the mechanism each device got when the limiter started. The
//! limiter's shares are recorded under it, and a driver upgraded to one with per-cgroup
//! limits is used that way from the agent's next start.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::{
    Capabilities, CgroupLimit, ComputeProcess, GpuBackend, GpuInfo, Mechanism, MpsLimit,
};
use crate::error::GpuError;

/// Opens a back end: NVML's `open` (with its MPS daemons), or a test's simulation.
pub type BackendOpener = Arc<dyn Fn() -> Result<Arc<dyn GpuBackend>, GpuError> + Send + Sync>;

/// Lets an attempt through at most once per interval.
#[derive(Debug)]
pub struct RetryGate {
    interval: Duration,
    last: Mutex<Option<Instant>>,
}

impl RetryGate {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: Mutex::new(None),
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// True (and the attempt counted from now) when the last one is an interval ago.
    pub fn try_pass(&self) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match *last {
            Some(t) if now.duration_since(t) < self.interval => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

struct State {
    current: Option<Arc<dyn GpuBackend>>,
    /// Why there is no current back end (the loss, or the last failed reopen).
    why: String,
    reopened: u64,
}

pub struct ReopeningBackend {
    open: BackendOpener,
    gate: RetryGate,
    // Fixed by the first back end, so that names and labels stay what they were while
    // there is none (a lost NVML stays "nvml", a simulation stays "simulated").
    name: &'static str,
    simulated: bool,
    labels: [String; 3],
    state: Mutex<State>,
}

/// Whether an error from a back end that worked means its handle is stale: the driver
/// went away (or came back as another version), or the GPU fell off and was reset.
fn handle_is_stale(e: &GpuError) -> bool {
    matches!(e, GpuError::Unavailable(_) | GpuError::DeviceFault(_))
}

impl ReopeningBackend {
    /// Opens the first back end; this one must work (the limiter discovers its GPUs
    /// through it). Later losses are reopened at most once per `interval`.
    pub fn open(open: BackendOpener, interval: Duration) -> Result<Self, GpuError> {
        let gate = RetryGate::new(interval);
        gate.try_pass();
        let first = open()?;
        let labels = Mechanism::ALL.map(|m| first.mechanism_label(m));
        Ok(Self {
            name: first.name(),
            simulated: first.is_simulated(),
            labels,
            open,
            gate,
            state: Mutex::new(State {
                current: Some(first),
                why: String::new(),
                reopened: 0,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Plain data replaced whole; a panic elsewhere leaves it consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many times a lost back end was opened again.
    pub fn reopened(&self) -> u64 {
        self.lock().reopened
    }

    /// Whether a back end is open now.
    pub fn is_open(&self) -> bool {
        self.lock().current.is_some()
    }

    /// The back end, opened again first if it was lost and the interval allows.
    fn current(&self) -> Result<Arc<dyn GpuBackend>, GpuError> {
        let mut st = self.lock();
        if let Some(b) = &st.current {
            return Ok(b.clone());
        }
        if !self.gate.try_pass() {
            return Err(GpuError::Reopening(format!(
                "{}; next attempt within {:?}",
                st.why,
                self.gate.interval()
            )));
        }
        // Under the lock: one reopen at a time, and no call starts on a half-made one.
        match (self.open)() {
            Ok(b) => {
                st.reopened += 1;
                tracing::info!(
                    backend = self.name,
                    reopened = st.reopened,
                    "GPU back end opened again"
                );
                st.current = Some(b.clone());
                Ok(b)
            }
            Err(e) => {
                tracing::warn!(backend = self.name, error = %e, retry_in = ?self.gate.interval(), "GPU back end still cannot be opened");
                st.why = e.to_string();
                Err(GpuError::Reopening(format!(
                    "{e}; next attempt within {:?}",
                    self.gate.interval()
                )))
            }
        }
    }

    /// Drops `stale` unless another call already replaced it. Dropping the last
    /// reference shuts it down (nvmlShutdown), before the next open initialises anew.
    fn lost(&self, stale: &Arc<dyn GpuBackend>, e: &GpuError) {
        let mut st = self.lock();
        if st.current.as_ref().is_some_and(|c| Arc::ptr_eq(c, stale)) {
            tracing::warn!(backend = self.name, error = %e, "GPU back end lost; it is opened again at the next call");
            st.current = None;
            st.why = format!("lost: {e}");
        }
    }

    fn call<T>(&self, f: impl Fn(&dyn GpuBackend) -> Result<T, GpuError>) -> Result<T, GpuError> {
        let mut last = None;
        // Once on the back end as it is, once more on a reopened one.
        for _ in 0..2 {
            let b = match self.current() {
                Ok(b) => b,
                // Why the reopen did not happen says more than the loss, except for
                // a GPU fault, whose class the caller acts on.
                Err(e) => {
                    return Err(match last {
                        Some(fault @ GpuError::DeviceFault(_)) => fault,
                        _ => e,
                    });
                }
            };
            match f(b.as_ref()) {
                Err(e) if handle_is_stale(&e) => {
                    self.lost(&b, &e);
                    last = Some(match e {
                        // Retryable already, and says more than "reopening".
                        GpuError::DeviceFault(_) => e,
                        other => GpuError::Reopening(other.to_string()),
                    });
                }
                r => return r,
            }
        }
        Err(last.unwrap_or_else(|| GpuError::Internal("reopen loop ended without a result".into())))
    }
}

impl GpuBackend for ReopeningBackend {
    fn name(&self) -> &'static str {
        self.name
    }

    fn is_simulated(&self) -> bool {
        self.simulated
    }

    fn mechanism_label(&self, m: Mechanism) -> String {
        let i = Mechanism::ALL.iter().position(|x| *x == m).unwrap_or(0);
        self.labels[i].clone()
    }

    fn discover(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.call(|b| b.discover())
    }

    fn compute_processes(&self, uuid: &str) -> Result<Vec<ComputeProcess>, GpuError> {
        self.call(|b| b.compute_processes(uuid))
    }

    fn capabilities(&self, uuid: &str) -> Result<Capabilities, GpuError> {
        self.call(|b| b.capabilities(uuid))
    }

    fn set_cgroup_limit(
        &self,
        uuid: &str,
        cgroup: &std::path::Path,
        bytes: u64,
    ) -> Result<(), GpuError> {
        self.call(|b| b.set_cgroup_limit(uuid, cgroup, bytes))
    }

    fn cgroup_limit(
        &self,
        uuid: &str,
        cgroup: &std::path::Path,
    ) -> Result<Option<CgroupLimit>, GpuError> {
        self.call(|b| b.cgroup_limit(uuid, cgroup))
    }

    fn clear_cgroup_limit(&self, uuid: &str, cgroup: &std::path::Path) -> Result<(), GpuError> {
        self.call(|b| b.clear_cgroup_limit(uuid, cgroup))
    }

    fn set_mps_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError> {
        self.call(|b| b.set_mps_limit(uuid, share_key, bytes))
    }

    fn mps_limit(&self, uuid: &str, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        self.call(|b| b.mps_limit(uuid, share_key))
    }

    fn clear_mps_limit(&self, uuid: &str, share_key: &str) -> Result<(), GpuError> {
        self.call(|b| b.clear_mps_limit(uuid, share_key))
    }

    fn mps_dirs(&self, share_key: &str) -> Option<shareguard_common::limiter::MpsDirs> {
        // Paths only, the same for every back end the opener makes; while none can be
        // opened there are none to give, and the share's apply fails anyway.
        self.current().ok().and_then(|b| b.mps_dirs(share_key))
    }
}

#[cfg(test)]
#[path = "reopen_tests.rs"]
mod tests;
