//! tc classifiers that count a pod's traffic and steer it into the shaping qdiscs.
//!
//! Attached with TCX (or clsact on old kernels) to the pod's host-side veth:
//! `sg_egress` sees traffic to the pod, `sg_ingress` traffic from the pod. Both look the
//! packet's ifindex up in `SG_IFACES`; an interface that is not configured passes
//! untouched. The programs only count, classify and redirect: the queueing that enforces
//! a rate is done by the qdiscs user space installs (HTB on the veth, HTB on an ifb).
//!
//! Passing returns `TC_ACT_UNSPEC`, which TCX reads as `TCX_NEXT`: a program attached
//! after ours (a CNI's) still runs, and with none the packet is passed.

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{__sk_buff, TC_ACT_UNSPEC},
    helpers::bpf_redirect,
    macros::{classifier, map},
    maps::{HashMap, PerCpuArray},
    programs::TcContext,
};
use shareguard_ebpf_common::{
    Counters, DIR_FROM_POD, DIR_TO_POD, IfaceConfig, MAX_COUNTERS, MAX_IFACES, counter_index,
};

// The map names are the static names; user space finds them by the same names
// (shareguard_ebpf_common::IFACES_MAP and COUNTERS_MAP) and fails to load if they differ.
#[map]
static SG_IFACES: HashMap<u32, IfaceConfig> = HashMap::with_max_entries(MAX_IFACES, 0);

#[map]
static SG_COUNTERS: PerCpuArray<Counters> = PerCpuArray::with_max_entries(MAX_COUNTERS, 0);

/// Traffic to the pod (egress of its host-side veth).
#[classifier]
pub fn sg_egress(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    let Some(cfg) = iface_config(skb) else {
        return TC_ACT_UNSPEC;
    };
    count(cfg.slot, DIR_TO_POD, ctx.len());
    if cfg.classid != 0 {
        // SAFETY: `skb` is the context pointer the kernel passed to this program, valid for
        // its whole run; `priority` is a field tc programs may write (the verifier checks
        // the access).
        unsafe { (*skb).priority = cfg.classid };
    }
    TC_ACT_UNSPEC
}

/// Traffic from the pod (ingress of its host-side veth).
#[classifier]
pub fn sg_ingress(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    let Some(cfg) = iface_config(skb) else {
        return TC_ACT_UNSPEC;
    };
    count(cfg.slot, DIR_FROM_POD, ctx.len());
    if cfg.redirect_ifindex == 0 {
        return TC_ACT_UNSPEC;
    }
    // Flags 0: to the ifb's egress, where its qdisc queues and shapes the packet. The ifb
    // then hands the packet back to this interface's receive path flagged to skip the tc
    // ingress hook (skb->tc_skip_classify), so it neither comes through here again nor
    // loops; the tests check that each packet is counted once.
    // SAFETY: a plain helper call with scalar arguments; it only records the target.
    let action = unsafe { bpf_redirect(cfg.redirect_ifindex, 0) };
    // TC_ACT_REDIRECT on success, TC_ACT_SHOT for invalid flags: both fit in an i32.
    action as i32
}

#[inline(always)]
fn iface_config(skb: *mut __sk_buff) -> Option<IfaceConfig> {
    // SAFETY: `skb` is the program's context pointer (see `sg_egress`).
    let ifindex = unsafe { (*skb).ifindex };
    let value = SG_IFACES.get_ptr(ifindex)?;
    // Copy the 16 bytes out at once: user space may update the entry while we run, and a
    // copy keeps the fields used below consistent with one another.
    // SAFETY: a non-null pointer returned by a hash map lookup points to a value of the
    // map's value type that stays valid for the rest of this program run (RCU).
    Some(unsafe { *value })
}

#[inline(always)]
fn count(slot: u32, dir: u32, len: u32) {
    let Some(index) = counter_index(slot, dir) else {
        return;
    };
    let Some(counters) = SG_COUNTERS.get_ptr_mut(index) else {
        return;
    };
    // SAFETY: the pointer is this CPU's copy of the array entry. tc programs run with
    // bottom halves disabled, so no other program run on this CPU interleaves with this
    // update, and each direction has its own entry: plain (non-atomic) adds are exact.
    unsafe {
        (*counters).bytes = (*counters).bytes.wrapping_add(u64::from(len));
        (*counters).packets = (*counters).packets.wrapping_add(1);
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Unreachable in practice: nothing above can panic (no indexing, no unwrap, wrapping
    // arithmetic). BPF has no way to abort, and the verifier rejects the loop if it is
    // ever reachable, which turns a future mistake into a load error rather than a hang.
    loop {}
}

// The project's license. No helper used here is GPL-only (the kernel refuses to load a
// program that calls one without a GPL-compatible license, so the tests would catch that).
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 11] = *b"Apache-2.0\0";
