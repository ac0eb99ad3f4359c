//! The GPU watchdog loop: every period it asks the GPU back end which compute processes
//! run, maps each host PID to its pod through `/proc/PID/cgroup`, lets the watchdog
//! decide (usage per share, over-limit episodes, terminations after the grace period),
//! carries out the terminations, and hands the result to the engine, which turns it into
//! share status, audit lines, metrics and watch events.
//!
//! The watchdog always runs, also where the driver enforces a hard limit: it is the
//! verifier that sees what the pods really use.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde::Deserialize;
use shareguard_limiter_gpu::{
    GpuError, GpuLimiter,
    backend::ComputeProcess,
    cgroup::pod_uid_of_pid,
    cgroupns::{CgroupNamespace, agent_namespace},
    deferred::DeferredGpuLimiter,
    simulated::SimulatedBackend,
    sys::PidfdTerminator,
    watchdog::{Action, Watchdog, execute_terminations},
};
use tracing::{debug, warn};

use crate::{config::gpu::WatchdogConfig, engine::Engine, sync::lock};

/// One back end's GPUs and their watchdog settings.
pub struct GpuWatch {
    /// The limiter, or what builds it once NVML can be opened: each poll is also an
    /// attempt (rate-limited by the limiter itself), so GPU devices come up without a
    /// share having to ask first.
    gpu: Arc<DeferredGpuLimiter>,
    /// Simulation only: the simulated back end and the file its processes come from.
    simulated: Option<(Arc<SimulatedBackend>, PathBuf)>,
    actions: HashMap<String, Action>,
    period: Duration,
    watchdog: Mutex<Watchdog>,
    /// The agent's cgroup namespace, which `/proc/PID/cgroup` paths are relative to.
    namespace: &'static CgroupNamespace,
}

pub use crate::engine::gpu::WatchReport;

/// One entry of the simulated processes file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SimulatedProcess {
    gpu_uuid: String,
    pid: u32,
    used_bytes: Option<u64>,
    /// Whether the process is an MPS client (NVML lists those apart).
    #[serde(default)]
    via_mps: bool,
}

impl GpuWatch {
    pub fn new(
        gpu: Arc<DeferredGpuLimiter>,
        simulated: Option<Arc<SimulatedBackend>>,
        processes_file: Option<PathBuf>,
        devices: Vec<(String, WatchdogConfig)>,
    ) -> GpuWatch {
        let period = devices
            .iter()
            .map(|(_, w)| w.period)
            .min()
            .unwrap_or(Duration::from_secs(1));
        GpuWatch {
            gpu,
            simulated: simulated.zip(processes_file),
            actions: devices.into_iter().map(|(d, w)| (d, w.action)).collect(),
            period,
            watchdog: Mutex::new(Watchdog::new()),
            namespace: agent_namespace(),
        }
    }

    pub fn period(&self) -> Duration {
        self.period
    }

    /// Simulation only: loads the processes the simulated GPUs report now. A missing file
    /// means no processes; a malformed one is an error (the poll is skipped and logged).
    fn load_simulated(&self, limiter: &GpuLimiter) -> Result<(), GpuError> {
        let Some((sim, file)) = &self.simulated else {
            return Ok(());
        };
        let list: Vec<SimulatedProcess> = match std::fs::read(file) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                GpuError::InvalidArgument(format!(
                    "simulated processes file {}: {e}",
                    file.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                return Err(GpuError::InvalidArgument(format!(
                    "simulated processes file {}: {e}",
                    file.display()
                )));
            }
        };
        let mut by_gpu: HashMap<String, Vec<ComputeProcess>> = limiter
            .gpu_uuids()
            .into_iter()
            .map(|u| (u, Vec::new()))
            .collect();
        for p in list {
            by_gpu.entry(p.gpu_uuid).or_default().push(ComputeProcess {
                pid: p.pid,
                used_bytes: p.used_bytes,
                via_mps: p.via_mps,
            });
        }
        for (uuid, procs) in by_gpu {
            sim.set_processes(&uuid, procs);
        }
        Ok(())
    }

    /// One poll: blocking (NVML, /proc), so it runs on a blocking thread.
    pub fn poll(&self, proc_root: &Path) -> Result<WatchReport, GpuError> {
        let started = Instant::now();
        let limiter = self
            .gpu
            .get()
            .ok_or_else(|| GpuError::Reopening(self.gpu.why()))?;
        self.load_simulated(&limiter)?;
        // Containers started since the last poll get their pod's limit on their own leaf
        // cgroups: within one period, not one reconcile period.
        limiter.follow_leaves();
        let shares = limiter.watched_shares_by(|device| {
            self.actions.get(device).copied().unwrap_or(Action::Report)
        });
        let processes = limiter.process_usage()?;
        // Read once per poll, so a process is attributed and re-checked before its
        // termination against the same roots.
        let roots = self.namespace.roots();
        let verdict = lock(&self.watchdog).evaluate(
            Instant::now(),
            &processes,
            |pid| pod_uid_of_pid(proc_root, &roots, pid),
            &shares,
        );
        let terminator = PidfdTerminator::with_proc_root(proc_root).with_roots(roots);
        let terminated = execute_terminations(&verdict, |d| limiter.terminate(d, &terminator));
        Ok(WatchReport {
            usage: verdict.usage,
            over_limit: verdict.over_limit,
            terminated,
            unattributed: verdict.unattributed,
            took: started.elapsed(),
        })
    }
}

/// Runs `watch` every period until the process ends.
pub fn spawn(engine: Arc<Engine>, watch: GpuWatch) {
    let watch = Arc::new(watch);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(watch.period());
        // A slow poll (NVML can block) must not be followed by a burst of catch-up polls.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let w = watch.clone();
            match tokio::task::spawn_blocking(move || w.poll(Path::new("/proc"))).await {
                Ok(Ok(report)) => {
                    debug!(
                        shares = report.usage.len(),
                        over = report.over_limit.len(),
                        unattributed = report.unattributed.len(),
                        took_ms = report.took.as_secs_f64() * 1e3,
                        "GPU watchdog poll"
                    );
                    engine.observe_gpu(&report);
                }
                Ok(Err(e)) => {
                    // The back end being (re)opened logs its own attempts, once per
                    // interval; a line per poll would only repeat them.
                    if matches!(e, GpuError::Reopening(_)) {
                        debug!(error = %e, "GPU watchdog poll failed");
                    } else {
                        warn!(error = %e, "GPU watchdog poll failed");
                    }
                    engine.gpu_poll_failed();
                }
                Err(e) => warn!(error = %e, "GPU watchdog poll panicked"),
            }
        }
    });
}
