//! Bandwidth limiter for `net` devices (eBPF on tc, both directions).
//!
//! Not implemented yet: it is the subject of the issue "Real bandwidth enforcement: aya
//! eBPF on tc, both directions, proven with traffic". Until then the agent refuses
//! `kind = "net"` devices in its configuration rather than pretending to enforce them.
