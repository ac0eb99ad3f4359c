//! GPU memory limiter (placeholder doc; rewritten below when the crate is complete).

pub mod backend;
pub mod cdi;
pub mod cgroup;
pub mod error;
pub mod limiter;
pub mod nvml;
pub mod simulated;
pub mod sys;
pub mod watchdog;

pub use backend::{GpuBackend, Mechanism};
pub use error::GpuError;
