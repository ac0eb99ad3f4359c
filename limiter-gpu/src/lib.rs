//! GPU memory limiter for `gpu` devices (NVML, MPS, watchdog).
//!
//! Not implemented yet: it is the subject of the issue "GPU memory enforcement: NVML
//! probe, per-share limits, watchdog verification, CDI". Until then the agent refuses
//! `kind = "gpu"` devices in its configuration rather than pretending to enforce them.
