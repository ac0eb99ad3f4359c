//! Types and constants shared by the tc programs in `ebpf/` and their loader in
//! `limiter-net`, defined once so that both sides agree on the map layout.
//!
//! Every map value is `#[repr(C)]` with explicit fields and no implicit padding: the
//! kernel copies values as raw bytes, so padding would be uninitialised memory on one side
//! and a silent layout mismatch between the two compilers on the other. The size
//! assertions below make a layout change a compile error on both sides.

#![cfg_attr(not(test), no_std)]

use core::mem::{align_of, size_of};

/// Name of the hash map `ifindex (u32) -> IfaceConfig`.
pub const IFACES_MAP: &str = "SG_IFACES";
/// Name of the per-CPU array `counter_index(slot, dir) -> Counters`.
pub const COUNTERS_MAP: &str = "SG_COUNTERS";

/// Most interfaces (host-side veths) the programs can be configured for at once.
pub const MAX_IFACES: u32 = 4096;
/// Entries of the counters array: two per slot, one per direction.
pub const MAX_COUNTERS: u32 = 8192;
/// Number of counter slots, i.e. of shares that can be counted at once.
pub const MAX_SLOTS: u32 = MAX_COUNTERS / 2;

/// Program attached at the egress of the pod's host-side veth: traffic going to the pod.
pub const PROG_TO_POD: &str = "sg_egress";
/// Program attached at the ingress of the pod's host-side veth: traffic coming from the pod.
pub const PROG_FROM_POD: &str = "sg_ingress";

/// Counter direction of traffic to the pod (host veth egress).
pub const DIR_TO_POD: u32 = 0;
/// Counter direction of traffic from the pod (host veth ingress).
pub const DIR_FROM_POD: u32 = 1;

/// Index into [`COUNTERS_MAP`] of a slot's counters for one direction, or `None` when the
/// slot or direction is out of range.
///
/// The kernel side calls this on every packet: the bounds check is a single comparison,
/// and the array lookup that follows is bounds-checked by the kernel again anyway.
#[inline(always)]
pub const fn counter_index(slot: u32, dir: u32) -> Option<u32> {
    if slot >= MAX_SLOTS || dir > DIR_FROM_POD {
        None
    } else {
        Some(slot * 2 + dir)
    }
}

/// What the programs do for one host-side interface (value of [`IFACES_MAP`], keyed by the
/// interface's ifindex).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IfaceConfig {
    /// HTB class id (`major << 16 | minor`) written into `skb->priority` for traffic to the
    /// pod, so that an HTB qdisc on the veth classifies it without tc filters; 0 leaves the
    /// priority alone.
    pub classid: u32,
    /// ifindex of the ifb device that traffic from the pod is redirected to (its egress
    /// carries the shaping qdisc, since ingress cannot queue); 0 means no redirect.
    pub redirect_ifindex: u32,
    /// Counter slot of the share, see [`counter_index`].
    pub slot: u32,
    /// Reserved for future use; must be 0.
    pub flags: u32,
}

/// Traffic counted for one slot and direction. Per CPU in the map; user space sums them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub bytes: u64,
    pub packets: u64,
}

impl Counters {
    /// Adds another CPU's counters; wrapping because the kernel side wraps too.
    #[must_use]
    pub const fn wrapping_add(self, other: Self) -> Self {
        Self {
            bytes: self.bytes.wrapping_add(other.bytes),
            packets: self.packets.wrapping_add(other.packets),
        }
    }
}

const _: () = {
    assert!(size_of::<IfaceConfig>() == 16);
    assert!(align_of::<IfaceConfig>() == 4);
    assert!(size_of::<Counters>() == 16);
    assert!(align_of::<Counters>() == 8);
    assert!(MAX_COUNTERS.is_multiple_of(2));
};

// SAFETY: both types are `#[repr(C)]`, `Copy`, made only of integers, and have no padding
// (checked by the size assertions above), so every byte pattern is a valid value and
// every value is fully initialised, which is what `aya::Pod` requires.
#[cfg(feature = "user")]
unsafe impl aya::Pod for IfaceConfig {}
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for Counters {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_indices_are_dense_and_bounded() {
        assert_eq!(counter_index(0, DIR_TO_POD), Some(0));
        assert_eq!(counter_index(0, DIR_FROM_POD), Some(1));
        assert_eq!(counter_index(1, DIR_TO_POD), Some(2));
        assert_eq!(
            counter_index(MAX_SLOTS - 1, DIR_FROM_POD),
            Some(MAX_COUNTERS - 1)
        );
        assert_eq!(counter_index(MAX_SLOTS, DIR_TO_POD), None);
        assert_eq!(counter_index(u32::MAX, DIR_TO_POD), None);
        assert_eq!(counter_index(0, 2), None);
    }
}
