//! tc classifiers that count a pod's traffic and steer it into the shaping qdiscs.
//!
//! Attached with TCX (or clsact on old kernels) to the pod's host-side veth:
//! `sg_egress` sees traffic to the pod, `sg_ingress` traffic from the pod. Both look the
//! packet's ifindex up in `SG_IFACES`; an interface that is not configured passes
//! untouched. What they do for a configured one depends on the mechanism user space chose:
//!
//! - `htb-ebpf`: count, classify (`skb->priority`) and redirect; the HTB qdiscs user space
//!   installs (on the veth, on an ifb) do the queueing that enforces the rate. They also
//!   note when the share last sent and wake user space when an idle share sends again
//!   (`shareguard_ebpf_common::activity`), which keeps the share's bucket small while idle;
//! - `edt-fq`: also give each packet its departure time (`skb->tstamp`, see
//!   `shareguard_ebpf_common::pace`), which the `fq` qdisc on the veth or the ifb honours;
//! - `bpf-policer`: drop what exceeds the share's token bucket, where nothing can queue.
//!
//! Passing returns `TC_ACT_UNSPEC`, which TCX reads as `TCX_NEXT`: a program attached
//! after ours (a CNI's) still runs, and with none the packet is passed. Ours are attached
//! first, ahead of a CNI's: a CNI's program that passes a packet ends the chain, so one
//! in front would let the pod's traffic past ours.
//!
//! A share with several pods (`FLAG_TO_POD_QUEUE`) has its traffic to them queued the same
//! way, on a second queue device: from each pod's veth egress to it and back, so that one
//! HTB holds them all together.
//!
//! Traffic from the pod that has to queue leaves the host veth's ingress for the share's
//! queue device and comes back to that same ingress once released (`sg_return`, on the
//! queue device's peer), marked so that `sg_ingress` lets it go on to the next program
//! this time: every program after ours sees every packet of the pod, shaped, with the
//! interface it came from. (An ifb would hand the packet back with tc skipped, which
//! takes a CNI's ingress programs out of the pod's path.)

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{__sk_buff, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_get_hash_recalc, bpf_ktime_get_ns, bpf_redirect, bpf_skb_set_tstamp},
    macros::{classifier, map},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TcContext,
};
use shareguard_ebpf_common::{
    Activity, Counters, DEFAULT_HEADER_LEN, DIR_FROM_POD, DIR_TO_POD, DirectionPacing,
    FLAG_HTB_FLOWS, FLAG_TO_POD_QUEUE, FlowKey, FlowState, IfaceConfig, MAX_COUNTERS, MAX_FLOWS,
    MAX_IFACES, MAX_SLOTS, PaceState, SKB_TSTAMP_DELIVERY_MONO, Verdict, activity, counter_index,
    flow_classid, flows, loop_ifindex, loop_mark, loop_mark_to_pod, loop_to_pod_ifindex, pace,
};

/// `BPF_F_INGRESS` (include/uapi/linux/bpf.h): `bpf_redirect` to the target's receive path.
const BPF_F_INGRESS: u64 = 1;

// The map names are the static names; user space finds them by the same names
// (shareguard_ebpf_common::IFACES_MAP and COUNTERS_MAP) and fails to load if they differ.
#[map]
static SG_IFACES: HashMap<u32, IfaceConfig> = HashMap::with_max_entries(MAX_IFACES, 0);

#[map]
static SG_COUNTERS: PerCpuArray<Counters> = PerCpuArray::with_max_entries(MAX_COUNTERS, 0);

#[map]
static SG_PACE: Array<PaceState> = Array::with_max_entries(MAX_COUNTERS, 0);

#[map]
static SG_FLOWS: LruHashMap<FlowKey, FlowState> = LruHashMap::with_max_entries(MAX_FLOWS, 0);

#[map]
static SG_ACTIVITY: Array<Activity> = Array::with_max_entries(MAX_COUNTERS, 0);

#[map]
static SG_WAKE: RingBuf = RingBuf::with_byte_size(activity::WAKE_BYTES, 0);

#[map]
static SG_TO_POD_QUEUES: Array<u32> = Array::with_max_entries(MAX_SLOTS, 0);

/// Traffic to the pod (egress of its host-side veth).
#[classifier]
pub fn sg_egress(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    // SAFETY: `skb` is the program's context pointer; both fields are ones tc programs
    // may read (verifier-checked).
    let (ifindex, mark) = unsafe { ((*skb).ifindex, (*skb).mark) };
    if mark != 0 && loop_to_pod_ifindex(mark) == Some(ifindex) {
        // Back from the share's to-pod queue: shaped and counted already; on to the next
        // program without the loop's mark.
        // SAFETY: a field tc programs may write (verifier-checked) of the context pointer.
        unsafe { (*skb).mark = 0 };
        return TC_ACT_UNSPEC;
    }
    let Some(cfg) = iface_config(skb) else {
        return TC_ACT_UNSPEC;
    };
    if !limit(&ctx, &cfg, DIR_TO_POD) {
        return TC_ACT_SHOT as i32;
    }
    classify(&ctx, &cfg, DIR_TO_POD);
    if cfg.flags & FLAG_TO_POD_QUEUE == 0 {
        return TC_ACT_UNSPEC;
    }
    // The share's pods are shaped together on one queue device. A loop configured without
    // its queue, or an interface whose index the mark cannot carry (user space refuses
    // both), drops the packet rather than pass it unshaped.
    let queue = SG_TO_POD_QUEUES.get(cfg.slot).copied().unwrap_or(0);
    let Some(mark) = loop_mark_to_pod(ifindex) else {
        return TC_ACT_SHOT as i32;
    };
    if queue == 0 {
        return TC_ACT_SHOT as i32;
    }
    // SAFETY: a field tc programs may write, of the context pointer.
    unsafe { (*skb).mark = mark };
    // Flags 0: to the queue device's egress, whose HTB classifies by the priority set
    // above; its peer's `sg_return` sends the packet back to this veth's egress.
    // SAFETY: a plain helper call with scalar arguments; it only records the target.
    let action = unsafe { bpf_redirect(queue, 0) };
    // TC_ACT_REDIRECT on success, TC_ACT_SHOT for invalid flags: both fit in an i32.
    action as i32
}

/// Sets `skb->priority` to the packet's HTB class, where `cfg` names one: with flow
/// classes, the priority class for a sparse flow, else its flow class by hash.
#[inline(always)]
fn classify(ctx: &TcContext, cfg: &IfaceConfig, dir: u32) {
    if cfg.classid == 0 {
        return;
    }
    let skb = ctx.skb.skb;
    let index = counter_index(cfg.slot, dir);
    if let Some(index) = index {
        note_activity(index);
    }
    // SAFETY: `skb` is the context pointer the kernel passed to this program, valid for
    // its whole run; the helper only reads (and caches) the packet's flow hash.
    let hash = unsafe { bpf_get_hash_recalc(skb) };
    let sparse =
        cfg.flags & FLAG_HTB_FLOWS != 0 && index.is_some_and(|index| is_sparse(ctx, hash, index));
    // SAFETY: as above; `priority` is a field tc programs may write (the verifier checks
    // the access).
    unsafe { (*skb).priority = flow_classid(cfg, hash, sparse) };
}

/// Notes that the share sends in this direction ([`activity`]) and, when user space waits
/// for that, tells it.
#[inline(always)]
fn note_activity(index: u32) {
    let Some(entry) = SG_ACTIVITY.get_ptr_mut(index) else {
        return;
    };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: an array entry returned by the lookup, valid for this run; other CPUs and
    // user space may write it concurrently, which costs at most one wake-up or one
    // grain of lateness (see `activity`), never memory safety: plain integers.
    let (wake, next) = activity::on_packet(unsafe { *entry }, now);
    let Some(mut next) = next else {
        return;
    };
    // Disarmed only once the wake-up is in the ring: if it is full, the next packet tries
    // again.
    if wake && SG_WAKE.output::<u32>(index, 0).is_err() {
        next.armed = 1;
    }
    // SAFETY: as for the read above.
    unsafe { *entry = next };
}

/// Runs [`flows::step`] for the packet's flow and stores its new state.
#[inline(always)]
fn is_sparse(ctx: &TcContext, hash: u32, index: u32) -> bool {
    let key = FlowKey { hash, index };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let entry = SG_FLOWS.get_ptr_mut(&key);
    // SAFETY: a non-null pointer from the lookup points to a value of the map's type that
    // stays valid for this run (RCU); other CPUs may write it concurrently, which costs
    // at most one packet's judgement (see `flows`), never memory safety: plain integers.
    let old = entry.map(|p| unsafe { *p });
    let (sparse, next) = flows::step(old, now, wire_len(ctx));
    match entry {
        // SAFETY: as for the read above.
        Some(p) => unsafe { *p = next },
        // A full map evicts its least recently seen flow; a failed insert only means the
        // flow is judged new again next time.
        None => {
            let _ = SG_FLOWS.insert(&key, &next, 0);
        }
    }
    sparse
}

/// Traffic from the pod (ingress of its host-side veth).
#[classifier]
pub fn sg_ingress(ctx: TcContext) -> i32 {
    let skb = ctx.skb.skb;
    // SAFETY: `skb` is the program's context pointer; both fields are ones tc programs
    // may read (verifier-checked).
    let (ifindex, mark) = unsafe { ((*skb).ifindex, (*skb).mark) };
    if mark != 0 && loop_ifindex(mark) == Some(ifindex) {
        // Back from the share's queue: shaped and counted already. Leave it as it came
        // from the pod (no mark, no priority, no departure time) for the next program.
        // SAFETY: fields tc programs may write (verifier-checked) of the context pointer.
        unsafe {
            (*skb).mark = 0;
            (*skb).priority = 0;
            if u32::from((*skb).tstamp_type) == SKB_TSTAMP_DELIVERY_MONO {
                // Type 0 (unspecified) with time 0 clears it; it cannot fail.
                bpf_skb_set_tstamp(skb, 0, 0);
            }
        }
        return TC_ACT_UNSPEC;
    }
    let Some(cfg) = iface_config(skb) else {
        return TC_ACT_UNSPEC;
    };
    if !limit(&ctx, &cfg, DIR_FROM_POD) {
        return TC_ACT_SHOT as i32;
    }
    if cfg.redirect_ifindex == 0 {
        return TC_ACT_UNSPEC;
    }
    // User space configures a redirect only for interfaces whose index fits the mark;
    // should one not, the packet is dropped rather than passed unshaped.
    let Some(mark) = loop_mark(ifindex) else {
        return TC_ACT_SHOT as i32;
    };
    // The queue device's HTB classifies by the priority, which the redirect keeps.
    classify(&ctx, &cfg, DIR_FROM_POD);
    // SAFETY: a field tc programs may write, of the context pointer.
    unsafe { (*skb).mark = mark };
    // Flags 0: to the queue device's egress, where its qdisc queues and shapes the
    // packet; its peer's `sg_return` brings it back here, with the mark that says so. An
    // EDT departure time set above is a mono delivery time, which the redirect keeps for
    // the queue device's fq.
    // SAFETY: a plain helper call with scalar arguments; it only records the target.
    let action = unsafe { bpf_redirect(cfg.redirect_ifindex, 0) };
    // TC_ACT_REDIRECT on success, TC_ACT_SHOT for invalid flags: both fit in an i32.
    action as i32
}

/// Ingress of a share's return device (the peer of one of its queue devices): every
/// packet the queue released goes back to the host veth its mark names, where it came
/// from: traffic from the pod to the veth's receive path, where `sg_ingress` passes it
/// on, traffic to the pod to the veth's egress, where `sg_egress` does. Anything else
/// arriving here (the device's own neighbour discovery) is not the pod's and is dropped.
#[classifier]
pub fn sg_return(ctx: TcContext) -> i32 {
    // SAFETY: `ctx.skb.skb` is the program's context pointer; `mark` is a field tc
    // programs may read.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if let Some(ifindex) = loop_ifindex(mark) {
        // SAFETY: a plain helper call with scalar arguments; it only records the target.
        // TC_ACT_REDIRECT on success: fits in an i32.
        return unsafe { bpf_redirect(ifindex, BPF_F_INGRESS) as i32 };
    }
    match loop_to_pod_ifindex(mark) {
        // SAFETY: as above.
        Some(ifindex) => unsafe { bpf_redirect(ifindex, 0) as i32 },
        None => TC_ACT_SHOT as i32,
    }
}

/// Paces or polices one packet of direction `dir` as `cfg` says and counts it; returns
/// whether it goes on (false: drop it).
#[inline(always)]
fn limit(ctx: &TcContext, cfg: &IfaceConfig, dir: u32) -> bool {
    let index = counter_index(cfg.slot, dir);
    let verdict = pace_packet(ctx, index, cfg.pacing(dir));
    count(index, ctx.len(), verdict)
}

/// Runs the share's EDT or policer arithmetic for one packet, stores the new state and,
/// for EDT, sets the packet's departure time. `Pass` when the direction is not paced.
#[inline(always)]
fn pace_packet(ctx: &TcContext, index: Option<u32>, d: DirectionPacing) -> Verdict {
    let DirectionPacing {
        edt,
        police,
        pace: p,
    } = d;
    if !edt && !police {
        return Verdict::Pass;
    }
    let Some(state) = index.and_then(|i| SG_PACE.get_ptr_mut(i)) else {
        return Verdict::Pass;
    };
    let skb = ctx.skb.skb;
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    let len = wire_len(ctx);
    // SAFETY: `state` is an array entry returned by the lookup, valid for this run. Other
    // CPUs may update it concurrently; a torn race costs at most one packet's worth of
    // accuracy (see `pace`), never memory safety: the value is a plain u64.
    let current = unsafe { *state };
    let (verdict, next) = if edt {
        // SAFETY: reading context fields tc programs may read (verifier-checked).
        let (tstamp, kind) = unsafe { ((*skb).tstamp, u32::from((*skb).tstamp_type)) };
        // Only a delivery time is a departure request; otherwise tstamp is a receive time.
        let asked = if kind == SKB_TSTAMP_DELIVERY_MONO {
            tstamp
        } else {
            0
        };
        pace::edt(current, now, asked, len, p)
    } else {
        pace::police(current, now, len, p)
    };
    // SAFETY: as for the read above.
    unsafe { *state = next };
    if let Verdict::Hold(at) = verdict {
        // SAFETY: `skb` is the program's context pointer; the helper validates the type.
        // A failure (an old kernel) leaves the packet unpaced, which the loader rules out
        // by probing: the limiter only chooses EDT where the helper exists.
        unsafe { bpf_skb_set_tstamp(skb, at, SKB_TSTAMP_DELIVERY_MONO) };
    }
    verdict
}

/// Bytes on the wire, as a qdisc counts them: a GSO packet leaves as `gso_segs` frames,
/// each with its own headers.
#[inline(always)]
fn wire_len(ctx: &TcContext) -> u64 {
    // SAFETY: reading a context field tc programs may read.
    let segs = unsafe { (*ctx.skb.skb).gso_segs };
    if segs <= 1 {
        return u64::from(ctx.len());
    }
    pace::wire_len(
        ctx.len(),
        segs,
        header_len(ctx).unwrap_or(DEFAULT_HEADER_LEN),
    )
}

/// Ethernet, IP and TCP or UDP header bytes of the packet, when it is one of those.
#[inline(always)]
fn header_len(ctx: &TcContext) -> Option<u32> {
    const ETH: usize = 14;
    let ethertype = u16::from_be(ctx.load::<u16>(12).ok()?);
    let (l3, l4_proto) = match ethertype {
        0x0800 => {
            let ihl = u32::from(ctx.load::<u8>(ETH).ok()? & 0x0f) * 4;
            (ihl, ctx.load::<u8>(ETH + 9).ok()?)
        }
        0x86dd => (40, ctx.load::<u8>(ETH + 6).ok()?),
        _ => return None,
    };
    let l4 = match l4_proto {
        6 => {
            // ihl is at most 60, so the offset stays small; the helper checks bounds.
            let off = ETH + l3 as usize + 12;
            u32::from(ctx.load::<u8>(off).ok()? >> 4) * 4
        }
        17 => 8,
        _ => return None,
    };
    Some(ETH as u32 + l3 + l4)
}

#[inline(always)]
fn iface_config(skb: *mut __sk_buff) -> Option<IfaceConfig> {
    // SAFETY: `skb` is the program's context pointer (see `sg_egress`).
    let ifindex = unsafe { (*skb).ifindex };
    let value = SG_IFACES.get_ptr(ifindex)?;
    // Copy the whole entry out at once: user space may update it while we run, and a copy
    // keeps the fields used below consistent with one another.
    // SAFETY: a non-null pointer returned by a hash map lookup points to a value of the
    // map's value type that stays valid for the rest of this program run (RCU).
    Some(unsafe { *value })
}

/// Counts a packet the verdict lets through (bytes and packets) or drops in the counters
/// at `index`; returns whether it goes on.
#[inline(always)]
fn count(index: Option<u32>, len: u32, verdict: Verdict) -> bool {
    let pass = !matches!(verdict, Verdict::Drop);
    let Some(index) = index else {
        return pass;
    };
    let Some(counters) = SG_COUNTERS.get_ptr_mut(index) else {
        return pass;
    };
    // SAFETY: the pointer is this CPU's copy of the array entry. tc programs run with
    // bottom halves disabled, so no other program run on this CPU interleaves with this
    // update, and each direction has its own entry: plain (non-atomic) adds are exact.
    unsafe {
        if pass {
            (*counters).bytes = (*counters).bytes.wrapping_add(u64::from(len));
            (*counters).packets = (*counters).packets.wrapping_add(1);
        } else {
            (*counters).drops = (*counters).drops.wrapping_add(1);
        }
    }
    pass
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
