//! Bandwidth limiter for `net` devices (eBPF on tc, both directions).
//!
//! Being built, per the issue "Real bandwidth enforcement: aya eBPF on tc, both
//! directions, proven with traffic". So far: [`bpf`], the loader of the kernel side
//! (ebpf/). Until the limiter itself exists the agent refuses `kind = "net"` devices in its
//! configuration rather than pretending to enforce them.

pub mod bpf;
