//! GPU memory limiter for `gpu` devices (NVML, MPS, watchdog). Being built up; see the
//! modules for what exists.

pub mod cgroup;
pub mod watchdog;
