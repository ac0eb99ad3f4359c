//! GPU memory limiter for `gpu` devices: a plain library; the agent decides when to call
//! it ([`setup`] builds it from the devices' config section, which the agent parses;
//! `agent/src/gpu_watch.rs` runs the watchdog loop, the engine writes the CDI specs).
//!
//! What exists:
//!
//! - [`backend`]: the [`GpuBackend`] trait (discovery, compute processes, per-GPU
//!   capability probe, per-cgroup and MPS limits), implemented by
//!   - [`nvml`]: NVML through nvml-wrapper, loaded at run time. No library, no driver
//!     or no permission is a [`GpuError::Unavailable`] value and a log line, never a
//!     panic. `nvmlDeviceSet/GetMemoryLimits_v1` (R615+) are resolved from the loaded
//!     library; see [`sys`] for their signatures and what is not known about them
//!     (the value of `NVML_DEVICE_MEMORY_LIMIT_MAX` is assumed; clearing falls back to
//!     the GPU's total memory where a driver refuses it). The getter's "not found" is
//!     no limit, "operating system error" on a cgroup a missing target (retryable),
//!     and a refusal while the cgroup already uses more than the new limit
//!     [`GpuError::UsageAboveLimit`].
//!   - [`simulated`]: an in-memory GPU for tests and demos, labelled "simulated" in
//!     every name and mechanism it reports, with fault injection as NVML errors.
//!   - [`reopen`]: [`reopen::ReopeningBackend`], any back end made to survive a driver
//!     reload: a back end whose calls answer "uninitialized", "driver not loaded",
//!     "version mismatch" or "GPU lost" is dropped (nvmlShutdown) and opened again
//!     (nvmlInit and the probe), at most once per interval.
//! - [`deferred`]: [`deferred::DeferredGpuLimiter`], the GPU devices' limiter while NVML
//!   cannot be opened yet (the driver container not ready when the agent starts): it
//!   builds the real limiter on use and from the watchdog loop, at most once per
//!   interval; until then shares fail retryably and the devices show `unavailable`.
//! - [`error`]: [`GpuError`] and its retryable/permanent split. Every `nvmlReturn_t`
//!   nvml.h declares is run through the mapping by `tests/nvml_return_codes.rs`, over
//!   the fixture `tests/fixtures/nvml-return-codes.txt` (source named in it).
//! - [`limiter`]: [`GpuLimiter`], the `shareguard_common::limiter::Limiter` for `gpu`
//!   devices: mechanism per GPU in the order nvml-cgroup > mps > watchdog, read-back
//!   before claiming enforcement, oversubscription refused, capacity name `memory`.
//!   nvml-cgroup limits go on the pod's cgroup and its containers' leaf cgroups (new
//!   leaves on each watchdog poll); a share whose cgroup cannot carry the limit is
//!   watched instead. MPS bounds each client on its own, so the read-back reports the
//!   limit times the share's clients (`Enforcement::per_process`).
//! - [`dmem`]: what nvml-cgroup needs of the kernel's dmem controller, probed per GPU
//!   (the driver's region in `dmem.capacity`) and per cgroup (`dmem.max`).
//! - [`watchdog`]: the watchdog's decisions (usage per share, unknown usage apart,
//!   over-limit episodes, which processes to terminate after the grace period) as pure
//!   logic; [`GpuLimiter::terminate`] stops an MPS client through its server
//!   (`terminate_client`) and any other process with [`sys::PidfdTerminator`], the
//!   pidfd-based kill that re-checks the pod first.
//! - [`cgroup`]: `/proc/PID/cgroup` -> pod uid for the systemd and cgroupfs layouts,
//!   paths resolved against the reader's cgroup namespace roots, and
//!   [`cgroup::pod_uid_of_pid`], the pid -> pod function the watchdog is fed.
//! - [`cgroupns`]: where the agent's own cgroup namespace is rooted in the mounted
//!   hierarchies (nothing to find in the initial namespace), re-checked on each use.
//! - [`cdi`]: one CDI spec per claim, written atomically, and a validator for the
//!   CDI specification's rules.
//! - [`driver`]: what a container needs of the driver (control and GPU device nodes,
//!   libraries under their sonames, tools), found in the device's driver root.
//! - [`mps`]: the `mps` mechanism: one MPS control daemon per share, its pinned device
//!   memory limit set and read back through NVIDIA's control program, whose answers are
//!   run through the parsers by `tests/mps_control_answers.rs` (sources in the fixture).
//! - [`sys`]: all unsafe code (the two unbound NVML functions, pidfd calls).
//!
//! What does not exist yet:
//!
//! - persistence of the limiter's share table: after a restart shares are re-adopted
//!   through `verify`, and `remove` of a share not seen since is a no-op;
//! - a run on a real GPU: `tests/gpu/run-on-gpu.sh` is written for one, but the NVML back
//!   end has not been run against a driver, the memory-limit calls not against R615+,
//!   and the MPS code not against NVIDIA's control program (only its simulation).

pub mod backend;
pub mod cdi;
pub mod cgroup;
pub mod cgroupns;
pub mod deferred;
pub mod dmem;
pub mod driver;
pub mod error;
pub mod limiter;
pub mod mps;
pub mod mps_cgroup;
mod mps_tmpfs;
pub mod nvml;
pub mod reopen;
pub mod setup;
pub mod simulated;
pub mod sys;
#[cfg(test)]
mod test_root;
pub mod watchdog;

pub use backend::{GpuBackend, Mechanism};
pub use error::GpuError;
pub use limiter::GpuLimiter;
