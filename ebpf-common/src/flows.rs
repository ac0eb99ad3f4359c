//! Which of a share's flows are *sparse* (a ping, DNS, an RPC, a health check) and go to
//! the share's priority class, as plain functions so that the kernel side and the unit
//! tests run the very same code.
//!
//! `htb-ebpf` spreads bulk flows over [`crate::FLOW_CLASSES`] classes by flow hash; two
//! flows share a class with probability 1/16, and a sparse flow that lands in a bulk
//! flow's class waits behind its queue. So a flow is first judged by what it sends, the
//! way `fq_codel` serves new and sparse flows first: each flow (by its 32-bit hash, per
//! share and direction) has a small credit, [`SPARSE_BURST`] bytes, refilled at
//! [`SPARSE_BYTES_PER_SEC`]. While its packets fit in the credit it is sparse and goes to
//! the priority class. Once a packet does not fit, the flow is bulk and stays bulk until
//! it has sent nothing for [`BULK_IDLE_NS`]: a flow that went back and forth would have
//! its packets overtake its own earlier ones still queued in its bulk class, which TCP
//! reads as loss. From sparse to bulk nothing is reordered: the priority class is always
//! served first.
//!
//! The priority class sits under the share's class like the others, so sparse flows
//! never take more than the share's limit; they only go first.
//!
//! Updates race between CPUs like [`crate::pace`]'s: two packets of one flow on two CPUs
//! may both spend the same credit, which errs by one packet and never reorders a bulk
//! flow (its `bulk` mark is only cleared after an idle gap).

/// Key of `SG_FLOWS`: a flow of one share and direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The packet's flow hash (`bpf_get_hash_recalc`).
    pub hash: u32,
    /// The share's counter index (slot and direction, [`crate::counter_index`]).
    pub index: u32,
}

/// Value of `SG_FLOWS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowState {
    /// When the flow's last packet was seen (`CLOCK_MONOTONIC`, ns).
    pub last_ns: u64,
    /// Bytes the flow may still send as sparse, at most [`SPARSE_BURST`].
    pub credit: u32,
    /// 1 once the flow has been found bulk, until it goes idle.
    pub bulk: u32,
}

/// Credit of a new or idle flow, in bytes on the wire: a DNS answer, a small RPC, a
/// TCP handshake and its first request fit.
pub const SPARSE_BURST: u32 = 16 * 1024;
/// Rate at which the credit refills (about 1 Mbit/s): a flow that keeps below it stays
/// sparse however long it lives (pings, health checks, keep-alives).
pub const SPARSE_BYTES_PER_SEC: u64 = 128 * 1024;
/// How long a bulk flow must send nothing before it may be sparse again: longer than its
/// queue takes to drain in all but a share whose every flow class is backlogged (each
/// flow class holds at most 20 ms of the share's rate), so its next packets do not
/// overtake its own queued ones.
pub const BULK_IDLE_NS: u64 = 250_000_000;

const NSEC_PER_SEC: u64 = 1_000_000_000;

/// Judges one packet of `wire_len` bytes of a flow whose state is `state` (None: not
/// seen before, or forgotten) at `now_ns`: whether it is sparse, and the flow's new state.
#[inline(always)]
pub const fn step(state: Option<FlowState>, now_ns: u64, wire_len: u64) -> (bool, FlowState) {
    let s = match state {
        Some(s) => s,
        None => FlowState {
            last_ns: now_ns,
            credit: SPARSE_BURST,
            bulk: 0,
        },
    };
    // Another CPU may have stored a later time than this packet's clock read.
    let elapsed = now_ns.saturating_sub(s.last_ns);
    let (mut credit, bulk) = if s.bulk != 0 && elapsed >= BULK_IDLE_NS {
        (SPARSE_BURST as u64, false)
    } else {
        (s.credit as u64, s.bulk != 0)
    };
    // At most a second's refill: more would overflow nothing, but the burst caps it anyway.
    let capped = if elapsed > NSEC_PER_SEC {
        NSEC_PER_SEC
    } else {
        elapsed
    };
    credit += capped * SPARSE_BYTES_PER_SEC / NSEC_PER_SEC;
    if credit > SPARSE_BURST as u64 {
        credit = SPARSE_BURST as u64;
    }
    let sparse = !bulk && wire_len <= credit;
    if sparse {
        credit -= wire_len;
    }
    (
        sparse,
        FlowState {
            last_ns: now_ns,
            // At most SPARSE_BURST, so it fits.
            credit: credit as u32,
            bulk: if sparse { 0 } else { 1 },
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Feeds packets of `len` bytes every `gap_ns` from `start`, `n` of them, and returns
    /// each verdict and the final state.
    fn run(
        mut s: Option<FlowState>,
        start: u64,
        gap_ns: u64,
        len: u64,
        n: usize,
    ) -> (Vec<bool>, Option<FlowState>) {
        let mut out = Vec::new();
        for i in 0..n {
            let (sparse, next) = step(s, start + i as u64 * gap_ns, len);
            out.push(sparse);
            s = Some(next);
        }
        (out, s)
    }

    #[test]
    fn a_ping_stays_sparse_for_ever() {
        // 98-byte echo requests every 20 ms, and every 1 ms: both far below the refill.
        for gap in [20 * MS, MS] {
            let (v, _) = run(None, 5, gap, 98, 10_000);
            assert!(v.iter().all(|s| *s), "gap {gap}");
        }
    }

    #[test]
    fn a_bulk_flow_is_sparse_for_its_first_burst_then_bulk_until_idle() {
        // 64 KiB GSO packets at 2 Gbit/s (one per 262 us) and 1514-byte frames at 50M.
        for (len, gap) in [(65_536 + 45 * 66, 262_000), (1514, 242_000)] {
            let (v, s) = run(None, 0, gap, len, 1000);
            let first_bulk = v.iter().position(|s| !*s).unwrap();
            let refilled = first_bulk as u64 * gap * SPARSE_BYTES_PER_SEC / NSEC_PER_SEC;
            assert!(
                first_bulk as u64 * len <= u64::from(SPARSE_BURST) + refilled,
                "at most the burst (and its refill meanwhile) goes first: {first_bulk} packets of {len}"
            );
            assert!(
                first_bulk as u64 * len + len > u64::from(SPARSE_BURST),
                "and all of it"
            );
            assert!(
                v[first_bulk..].iter().all(|s| !*s),
                "never back to sparse while it sends (that would reorder it)"
            );
            let last = s.unwrap().last_ns;
            // A pause shorter than the idle time keeps it bulk, even with credit back.
            let (after_short, _) = step(s, last + BULK_IDLE_NS - 1, 100);
            assert!(!after_short);
            // After the idle time it starts afresh.
            let (after_idle, s2) = step(s, last + BULK_IDLE_NS, 100);
            assert!(after_idle);
            assert_eq!(s2.bulk, 0);
            assert_eq!(s2.credit, SPARSE_BURST - 100);
        }
    }

    #[test]
    fn a_flow_above_the_refill_rate_turns_bulk() {
        // 1 KiB every 4 ms is 256 KiB/s, twice the refill: the credit runs out.
        let (v, s) = run(None, 0, 4 * MS, 1024, 100);
        let first_bulk = v.iter().position(|s| !*s).expect("turns bulk");
        assert!(
            first_bulk > 16,
            "the burst carries it a while: {first_bulk}"
        );
        assert!(v[first_bulk..].iter().all(|s| !*s));
        assert_eq!(s.unwrap().bulk, 1);
        // Just under the refill rate it never does: 500 bytes every 4 ms is 122 KiB/s.
        let (v, _) = run(None, 0, 4 * MS, 500, 10_000);
        assert!(v.iter().all(|s| *s));
    }

    #[test]
    fn packets_larger_than_the_burst_are_bulk_at_once() {
        let (sparse, s) = step(None, 0, u64::from(SPARSE_BURST) + 1);
        assert!(!sparse);
        assert_eq!(s.bulk, 1);
    }

    #[test]
    fn clocks_that_go_back_or_jump_far_do_not_overflow() {
        let s = FlowState {
            last_ns: 10 * MS,
            credit: 0,
            bulk: 0,
        };
        // Another CPU stored a later time: no refill, no underflow.
        let (sparse, n) = step(Some(s), 5 * MS, 1);
        assert!(!sparse);
        assert_eq!(n.credit, 0);
        let (sparse, n) = step(Some(s), u64::MAX, 1);
        assert!(sparse);
        assert_eq!(n.credit, SPARSE_BURST - 1);
    }
}
