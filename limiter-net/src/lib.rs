//! Bandwidth limiter for `net` devices: eBPF on tc, both directions, on the host side of
//! the pod's interface, where the pod cannot undo it.
//!
//! | module | what |
//! |---|---|
//! | [`limiter`] | [`limiter::NetLimiter`], the `Limiter` the agent uses for `net` devices |
//! | [`mechanism`] | which mechanism (EDT + fq, HTB, policer) and what it installs per share |
//! | [`burst`] | an HTB share's bucket: small after an idle spell, full while busy |
//! | [`bypass`] | whether the share's traffic passes the programs: interface vs program counters |
//! | [`link`] | whether a device's NIC carries traffic (its `operstate`) |
//! | [`bpf`] | the only module that talks to aya: load, pin, attach, maps, counters |
//! | [`rtnl`] | netlink: the pod's host-side interface, queue devices, HTB read-back |
//! | [`tc`] | HTB and fq qdiscs through iproute2's `tc` |
//! | [`state`] | what was installed per share, on disk |
//! | [`probe`] | what the kernel offers (veth queue pairs, HTB, fq) |
//! | [`setup`] | the limiters built from the devices' config section |

pub mod bpf;
pub mod burst;
pub mod bypass;
pub mod cleanup;
pub mod error;
pub mod limiter;
pub mod link;
pub mod mechanism;
pub mod probe;
pub mod rtnl;
pub mod setup;
pub mod state;
pub mod tc;

pub use error::NetError;
pub use limiter::{NetBackend, NetLimiter};
pub use mechanism::Mechanism;
