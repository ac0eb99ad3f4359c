//! Types and constants shared by the tc programs in `ebpf/` and their loader in
//! `limiter-net`, defined once so that both sides agree on the map layout.
//!
//! Every map value is `#[repr(C)]` with explicit fields and no implicit padding: the
//! kernel copies values as raw bytes, so padding would be uninitialised memory on one side
//! and a silent layout mismatch between the two compilers on the other. The size
//! assertions below make a layout change a compile error on both sides.

#![cfg_attr(not(test), no_std)]

use core::mem::{align_of, size_of};

pub mod activity;
pub mod flows;
pub mod pace;

pub use activity::Activity;
pub use flows::{FlowKey, FlowState};
pub use pace::{Pace, PaceState, Verdict};

/// Name of the hash map `ifindex (u32) -> IfaceConfig`.
pub const IFACES_MAP: &str = "SG_IFACES";
/// Name of the array `slot -> ifindex (u32)`: the queue device that traffic to the pod of
/// the share in that slot goes round, read only under [`FLAG_TO_POD_QUEUE`].
pub const TO_POD_QUEUES_MAP: &str = "SG_TO_POD_QUEUES";
/// Name of the per-CPU array `counter_index(slot, dir) -> Counters`.
pub const COUNTERS_MAP: &str = "SG_COUNTERS";
/// Name of the array `counter_index(slot, dir) -> PaceState`, shared by all CPUs: the
/// EDT and policer state of each share and direction.
pub const PACE_MAP: &str = "SG_PACE";
/// Name of the LRU hash `FlowKey -> FlowState`: which flows are sparse ([`flows`]).
pub const FLOWS_MAP: &str = "SG_FLOWS";
/// Flows [`FLOWS_MAP`] remembers; the least recently seen are forgotten first (and start
/// afresh, as a new flow, if they come back).
pub const MAX_FLOWS: u32 = 65_536;

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

/// Program attached at the ingress of a share's return device (the far end of its queue
/// pair): hands each packet the queue released back to the ingress of the host veth it
/// came from, so that every program after ours there (a CNI's) sees it. See
/// [`loop_mark`].
pub const PROG_RETURN: &str = "sg_return";

/// The top byte of `skb->mark` on a packet from the pod that is in its share's queue
/// loop: host veth ingress -> queue device (HTB or fq) -> return device -> host veth
/// ingress again. A packet that crossed from the pod's network namespace has mark 0 (the
/// kernel clears it when a packet changes namespace), so only the programs themselves set
/// this; the low 24 bits are the host veth's ifindex, where the return device sends the
/// packet back to. Back on the host veth, the program clears the mark and lets the packet
/// go on to the next program unchanged: the loop is invisible to a CNI after ours.
pub const LOOP_MARK_MAGIC: u32 = 0x5300_0000;
/// The bits of `skb->mark` that carry the ifindex in [`LOOP_MARK_MAGIC`]'s mark.
pub const LOOP_MARK_IFINDEX: u32 = 0x00ff_ffff;
/// The top byte of `skb->mark` on a packet to the pod in its share's to-pod queue loop
/// ([`FLAG_TO_POD_QUEUE`]): host veth egress -> to-pod queue device -> its return device
/// -> host veth egress again. The low 24 bits are the host veth's ifindex, as in
/// [`LOOP_MARK_MAGIC`]'s mark; back on the veth the program clears the mark (a mark the
/// host's stack had set is not restored: the kernel clears it anyway when the packet
/// enters the pod's namespace, so only a program after ours on that hook misses it).
pub const LOOP_MARK_TO_POD_MAGIC: u32 = 0x5400_0000;

/// The mark of a packet of host veth `ifindex` on its way through the queue loop; `None`
/// for an ifindex too large to carry (the loop is then refused for that interface).
#[inline(always)]
pub const fn loop_mark(ifindex: u32) -> Option<u32> {
    if ifindex == 0 || ifindex > LOOP_MARK_IFINDEX {
        None
    } else {
        Some(LOOP_MARK_MAGIC | ifindex)
    }
}

/// The host veth a packet with `mark` returns to, when the mark is a loop mark.
#[inline(always)]
pub const fn loop_ifindex(mark: u32) -> Option<u32> {
    marked_ifindex(mark, LOOP_MARK_MAGIC)
}

/// The mark of a packet to the pod behind host veth `ifindex` on its way through the
/// to-pod queue loop ([`LOOP_MARK_TO_POD_MAGIC`]); `None` for an ifindex too large to
/// carry.
#[inline(always)]
pub const fn loop_mark_to_pod(ifindex: u32) -> Option<u32> {
    if ifindex == 0 || ifindex > LOOP_MARK_IFINDEX {
        None
    } else {
        Some(LOOP_MARK_TO_POD_MAGIC | ifindex)
    }
}

/// The host veth a packet to the pod with `mark` returns to, when the mark is a to-pod
/// loop mark.
#[inline(always)]
pub const fn loop_to_pod_ifindex(mark: u32) -> Option<u32> {
    marked_ifindex(mark, LOOP_MARK_TO_POD_MAGIC)
}

#[inline(always)]
const fn marked_ifindex(mark: u32, magic: u32) -> Option<u32> {
    let ifindex = mark & LOOP_MARK_IFINDEX;
    if mark & !LOOP_MARK_IFINDEX == magic && ifindex != 0 {
        Some(ifindex)
    } else {
        None
    }
}

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

/// [`IfaceConfig::flags`]: traffic to the pod gets an EDT departure time from
/// [`IfaceConfig::to_pod`] (an `fq` qdisc on the veth holds it until then).
pub const FLAG_EDT_TO_POD: u32 = 1 << 0;
/// Traffic from the pod gets an EDT departure time from [`IfaceConfig::from_pod`] before it
/// is redirected to the ifb, whose root `fq` holds it.
pub const FLAG_EDT_FROM_POD: u32 = 1 << 1;
/// Traffic to the pod is policed (dropped when over [`IfaceConfig::to_pod`]).
pub const FLAG_POLICE_TO_POD: u32 = 1 << 2;
/// Traffic from the pod is policed (dropped when over [`IfaceConfig::from_pod`]).
pub const FLAG_POLICE_FROM_POD: u32 = 1 << 3;
/// `htb-ebpf`: a sparse flow ([`flows`]) goes to the priority class, `classid` plus
/// [`FLOW_CLASSES`]; every other flow to one of [`FLOW_CLASSES`] HTB classes, `classid`
/// plus the packet's flow hash modulo [`FLOW_CLASSES`]; in both directions (from the
/// pod, before the redirect, for the ifb's HTB). A sparse flow (a ping, an RPC, DNS) is
/// sent first instead of waiting behind a bulk flow's queue, and bulk flows share the
/// rate by class: per-flow queueing where the kernel has no `fq`, `fq_codel` or `sfq`.
pub const FLAG_HTB_FLOWS: u32 = 1 << 4;
/// `htb-ebpf` for a share with several pods: traffic to the pod goes round the share's
/// to-pod queue device (its ifindex in [`TO_POD_QUEUES_MAP`] at the share's slot), whose
/// HTB holds the traffic to all of the share's pods together, instead of an HTB on each
/// pod's veth, which would give each pod the whole rate.
pub const FLAG_TO_POD_QUEUE: u32 = 1 << 5;
/// Every flag this build knows; the loader refuses others.
pub const FLAGS_KNOWN: u32 = FLAG_EDT_TO_POD
    | FLAG_EDT_FROM_POD
    | FLAG_POLICE_TO_POD
    | FLAG_POLICE_FROM_POD
    | FLAG_HTB_FLOWS
    | FLAG_TO_POD_QUEUE;

/// How many flow classes [`FLAG_HTB_FLOWS`] spreads a share's flows over. Two flows share
/// a class with probability 1/16.
pub const FLOW_CLASSES: u32 = 16;

/// The `skb->priority` (an HTB class id) of a packet with flow hash `hash` for `cfg`,
/// `sparse` when [`flows::step`] found its flow sparse: 0 (leave it alone) when `cfg`
/// names no class.
#[inline(always)]
pub const fn flow_classid(cfg: &IfaceConfig, hash: u32, sparse: bool) -> u32 {
    if cfg.classid == 0 {
        0
    } else if cfg.flags & FLAG_HTB_FLOWS == 0 {
        cfg.classid
    } else if sparse {
        cfg.classid + FLOW_CLASSES
    } else {
        cfg.classid + hash % FLOW_CLASSES
    }
}

/// `BPF_SKB_TSTAMP_DELIVERY_MONO` (include/uapi/linux/bpf.h): the time given to
/// `bpf_skb_set_tstamp` is a delivery time in `CLOCK_MONOTONIC`, which `fq` honours and
/// which survives the redirect from ingress to the ifb (a plain receive timestamp does not).
pub const SKB_TSTAMP_DELIVERY_MONO: u32 = 1;

/// Headers per segment assumed for a GSO packet whose headers cannot be parsed (IPv4 with
/// TCP timestamps over Ethernet: 14 + 20 + 32).
pub const DEFAULT_HEADER_LEN: u32 = 66;

/// Whether a configuration asks for something the programs cannot do: unknown flags, EDT
/// and policing in one direction, or a pacing flag without a rate.
pub const fn flags_valid(cfg: &IfaceConfig) -> bool {
    let to_pod = cfg.pacing(DIR_TO_POD);
    cfg.flags & !FLAGS_KNOWN == 0
        && direction_valid(to_pod)
        && direction_valid(cfg.pacing(DIR_FROM_POD))
        // The to-pod queue loop is HTB's: a paced direction queues where it is.
        && !(cfg.flags & FLAG_TO_POD_QUEUE != 0 && (to_pod.edt || to_pod.police))
}

/// One direction: not both EDT and policing, and a rate when either is asked for.
const fn direction_valid(p: DirectionPacing) -> bool {
    !(p.edt && p.police) && (!(p.edt || p.police) || p.pace.bytes_per_sec != 0)
}

/// What the programs do for one host-side interface (value of [`IFACES_MAP`], keyed by the
/// interface's ifindex).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct IfaceConfig {
    /// HTB class id (`major << 16 | minor`) written into `skb->priority`, so that the HTB
    /// qdisc on the veth (traffic to the pod) or on the ifb (traffic from it) classifies it
    /// without tc filters; with [`FLAG_HTB_FLOWS`] the first of the flow classes. 0 leaves
    /// the priority alone.
    pub classid: u32,
    /// ifindex of the queue device that traffic from the pod is redirected to (its egress
    /// carries the shaping qdisc, since ingress cannot queue; its peer returns the packet,
    /// see [`loop_mark`]); 0 means no redirect.
    pub redirect_ifindex: u32,
    /// Counter slot of the share, see [`counter_index`]; also the index of its
    /// [`PACE_MAP`] state.
    pub slot: u32,
    /// `FLAG_*`: which direction is paced (EDT) or policed by the programs themselves.
    pub flags: u32,
    /// Rate and slack for traffic to the pod, when a flag asks for EDT or policing.
    pub to_pod: Pace,
    /// Rate and slack for traffic from the pod, likewise.
    pub from_pod: Pace,
}

/// How the programs themselves limit one direction of an interface (see
/// [`IfaceConfig::pacing`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectionPacing {
    /// EDT: give packets departure times from `pace`.
    pub edt: bool,
    /// Policer: drop what exceeds `pace`.
    pub police: bool,
    pub pace: Pace,
}

impl IfaceConfig {
    /// The flags and rate of direction `dir` ([`DIR_TO_POD`] or [`DIR_FROM_POD`]; any
    /// other value reads as from the pod, like [`counter_index`] refuses it).
    #[inline(always)]
    pub const fn pacing(&self, dir: u32) -> DirectionPacing {
        let (edt, police, pace) = if dir == DIR_TO_POD {
            (FLAG_EDT_TO_POD, FLAG_POLICE_TO_POD, self.to_pod)
        } else {
            (FLAG_EDT_FROM_POD, FLAG_POLICE_FROM_POD, self.from_pod)
        };
        DirectionPacing {
            edt: self.flags & edt != 0,
            police: self.flags & police != 0,
            pace,
        }
    }
}

/// Traffic counted for one slot and direction. Per CPU in the map; user space sums them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    pub bytes: u64,
    pub packets: u64,
    /// Packets the programs dropped themselves (policer, EDT horizon).
    pub drops: u64,
}

impl Counters {
    /// Adds another CPU's counters; wrapping because the kernel side wraps too.
    #[must_use]
    pub const fn wrapping_add(self, other: Self) -> Self {
        Self {
            bytes: self.bytes.wrapping_add(other.bytes),
            packets: self.packets.wrapping_add(other.packets),
            drops: self.drops.wrapping_add(other.drops),
        }
    }
}

const _: () = {
    assert!(size_of::<Pace>() == 16);
    assert!(size_of::<PaceState>() == 8);
    assert!(size_of::<IfaceConfig>() == 48);
    assert!(align_of::<IfaceConfig>() == 8);
    assert!(size_of::<Counters>() == 24);
    assert!(size_of::<FlowKey>() == 8);
    assert!(size_of::<FlowState>() == 16);
    assert!(align_of::<FlowState>() == 8);
    assert!(align_of::<Counters>() == 8);
    assert!(size_of::<Activity>() == 16);
    assert!(align_of::<Activity>() == 8);
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
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for Pace {}
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PaceState {}
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowKey {}
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for FlowState {}
// SAFETY: as above.
#[cfg(feature = "user")]
unsafe impl aya::Pod for Activity {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_mark_carries_its_interface_and_nothing_else_reads_as_one() {
        for ifindex in [1, 2, 4096, LOOP_MARK_IFINDEX] {
            let mark = loop_mark(ifindex).unwrap();
            assert_eq!(loop_ifindex(mark), Some(ifindex));
        }
        assert_eq!(loop_mark(0), None);
        assert_eq!(loop_mark(LOOP_MARK_IFINDEX + 1), None);
        // A pod's packet arrives with mark 0; other marks a host program may set are not
        // loop marks unless they carry the magic byte exactly.
        for mark in [0, 1, LOOP_MARK_MAGIC, 0x5400_0001, 0x5300_0001 | 1 << 31] {
            assert_eq!(loop_ifindex(mark), None, "{mark:#x}");
        }
    }

    #[test]
    fn the_two_loops_marks_are_never_taken_for_one_another() {
        for ifindex in [1, 7, LOOP_MARK_IFINDEX] {
            let to = loop_mark_to_pod(ifindex).unwrap();
            assert_eq!(loop_to_pod_ifindex(to), Some(ifindex));
            assert_eq!(loop_ifindex(to), None);
            let from = loop_mark(ifindex).unwrap();
            assert_eq!(loop_to_pod_ifindex(from), None);
        }
        assert_eq!(loop_mark_to_pod(0), None);
        assert_eq!(loop_mark_to_pod(LOOP_MARK_IFINDEX + 1), None);
        assert_eq!(loop_to_pod_ifindex(LOOP_MARK_TO_POD_MAGIC), None);
    }

    #[test]
    fn the_to_pod_queue_is_not_combined_with_pacing_to_the_pod() {
        let rate = Pace {
            bytes_per_sec: 1000,
            ..Pace::default()
        };
        let queued = IfaceConfig {
            flags: FLAG_TO_POD_QUEUE | FLAG_HTB_FLOWS | FLAG_POLICE_FROM_POD,
            from_pod: rate,
            ..IfaceConfig::default()
        };
        assert!(flags_valid(&queued));
        for paced in [FLAG_EDT_TO_POD, FLAG_POLICE_TO_POD] {
            let cfg = IfaceConfig {
                flags: FLAG_TO_POD_QUEUE | paced,
                to_pod: rate,
                ..IfaceConfig::default()
            };
            assert!(!flags_valid(&cfg), "{paced:#x}");
        }
    }

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

    #[test]
    fn each_direction_reads_its_own_flags_and_rate() {
        let to = Pace {
            bytes_per_sec: 1,
            slack_ns: 2,
        };
        let from = Pace {
            bytes_per_sec: 3,
            slack_ns: 4,
        };
        let cfg = IfaceConfig {
            flags: FLAG_EDT_TO_POD | FLAG_POLICE_FROM_POD,
            to_pod: to,
            from_pod: from,
            ..IfaceConfig::default()
        };
        assert_eq!(
            cfg.pacing(DIR_TO_POD),
            DirectionPacing {
                edt: true,
                police: false,
                pace: to
            }
        );
        assert_eq!(
            cfg.pacing(DIR_FROM_POD),
            DirectionPacing {
                edt: false,
                police: true,
                pace: from
            }
        );
    }

    #[test]
    fn flags_are_checked_against_rates_and_each_other() {
        let rate = Pace {
            bytes_per_sec: 1,
            slack_ns: 0,
        };
        let cfg = |flags, to_pod, from_pod| IfaceConfig {
            flags,
            to_pod,
            from_pod,
            ..IfaceConfig::default()
        };
        assert!(flags_valid(&cfg(0, Pace::default(), Pace::default())));
        assert!(flags_valid(&cfg(
            FLAG_EDT_TO_POD | FLAG_POLICE_FROM_POD,
            rate,
            rate
        )));
        assert!(!flags_valid(&cfg(1 << 6, rate, rate)), "unknown flag");
        assert!(!flags_valid(&cfg(
            FLAG_EDT_TO_POD | FLAG_POLICE_TO_POD,
            rate,
            rate
        )));
        assert!(!flags_valid(&cfg(
            FLAG_EDT_FROM_POD | FLAG_POLICE_FROM_POD,
            rate,
            rate
        )));
        assert!(
            !flags_valid(&cfg(FLAG_EDT_TO_POD, Pace::default(), rate)),
            "no rate"
        );
        assert!(!flags_valid(&cfg(
            FLAG_POLICE_FROM_POD,
            rate,
            Pace::default()
        )));
    }

    #[test]
    fn flows_spread_over_the_flow_classes_from_the_first() {
        let mut c = IfaceConfig {
            classid: 0x0001_0001,
            ..IfaceConfig::default()
        };
        assert_eq!(
            flow_classid(&c, 12345, true),
            0x0001_0001,
            "one class without the flag"
        );
        c.flags = FLAG_HTB_FLOWS;
        assert_eq!(flow_classid(&c, 0, false), 0x0001_0001);
        assert_eq!(flow_classid(&c, 15, false), 0x0001_0010);
        assert_eq!(flow_classid(&c, 16, false), 0x0001_0001);
        assert_eq!(
            flow_classid(&c, u32::MAX, false),
            0x0001_0001 + u32::MAX % FLOW_CLASSES
        );
        // Sparse flows, whatever their hash, share the class after the flow classes.
        for hash in [0, 15, 16, u32::MAX] {
            assert_eq!(flow_classid(&c, hash, true), 0x0001_0011);
        }
        c.classid = 0;
        assert_eq!(
            flow_classid(&c, 7, true),
            0,
            "no class, priority left alone"
        );
    }
}
