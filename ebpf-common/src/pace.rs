//! Per-packet rate arithmetic of the two BPF-only mechanisms, as plain functions so that
//! the kernel side and the unit tests run the very same code.
//!
//! Both keep one `u64` of state per share and direction ([`PaceState`]), a time in
//! nanoseconds of `CLOCK_MONOTONIC` (`bpf_ktime_get_ns`):
//!
//! - **EDT** ([`edt`]), as Cilium's Bandwidth Manager does it: the state is the departure
//!   time of the last packet; each packet gets a departure time (`skb->tstamp`) spaced
//!   `wire_len / rate` after it, and the `fq` qdisc holds the packet until then. A packet
//!   that would have to wait longer than the horizon is dropped instead, which bounds the
//!   queue (and the latency) a share can build.
//! - **Policer** ([`police`]): a token bucket in its "virtual scheduling" form (GCRA,
//!   ITU-T I.371): the state is the theoretical arrival time; a packet conforms when it is
//!   at most `slack_ns` early, and conforming packets move it on by `wire_len / rate`.
//!   Nothing queues: what does not conform is dropped. For kernels where no qdisc can.
//!
//! Updates race between CPUs (two packets of one share on two CPUs may read the same
//! state); like Cilium we accept that: the error is at most one packet per concurrent CPU,
//! and the alternative (a spin lock per packet) costs more than it buys.

/// Rate and slack of one direction of a share, as the BPF programs read it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Pace {
    /// L2 bytes per second (the share's bit/s divided by 8, rounded down); 0 = unlimited.
    pub bytes_per_sec: u64,
    /// EDT: the horizon, the longest a packet may be held before it is dropped instead.
    /// Policer: the bucket depth, as the time it takes to fill at the rate.
    pub slack_ns: u64,
}

/// The one word of per-share, per-direction state (value of `SG_PACE`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PaceState {
    /// EDT: departure time of the last packet sent. Policer: theoretical arrival time.
    pub t_last_ns: u64,
}

const NSEC_PER_SEC: u64 = 1_000_000_000;

/// Time `wire_len` bytes take at `bytes_per_sec`, rounded up so that rounding never lets
/// more through than the rate. `bytes_per_sec` must not be 0.
#[inline(always)]
pub const fn transmit_ns(wire_len: u64, bytes_per_sec: u64) -> u64 {
    // wire_len is at most a 64 KiB GSO packet plus its segments' headers, so
    // wire_len * 1e9 stays far below u64::MAX (1.8e19); saturate anyway. Not with
    // `saturating_mul`: its overflow check needs a 128-bit multiply, which BPF lacks.
    if wire_len > (u64::MAX - NSEC_PER_SEC) / NSEC_PER_SEC {
        return u64::MAX;
    }
    (wire_len * NSEC_PER_SEC).saturating_add(bytes_per_sec - 1) / bytes_per_sec
}

/// What to do with one packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Send now, untouched.
    Pass,
    /// Send no earlier than this departure time (EDT only: written to `skb->tstamp`).
    Hold(u64),
    /// Drop: over the horizon (EDT) or not conforming (policer).
    Drop,
}

/// EDT: the departure time of a packet of `wire_len` bytes arriving at `now` whose own
/// departure time is `tstamp` (0 when the sender set none; TCP's pacing sets one), and
/// the new state. The state does not move for a dropped packet.
#[inline(always)]
pub const fn edt(
    state: PaceState,
    now: u64,
    tstamp: u64,
    wire_len: u64,
    p: Pace,
) -> (Verdict, PaceState) {
    if p.bytes_per_sec == 0 {
        return (Verdict::Pass, state);
    }
    // A departure time the sender asked for is kept, unless it lies beyond the horizon:
    // honouring an arbitrary future time (SO_TXTIME lets a process set one) would move
    // the state there and drop the share's traffic until the clock caught up.
    let t = if tstamp > now && tstamp - now <= p.slack_ns {
        tstamp
    } else {
        now
    };
    let next = state
        .t_last_ns
        .saturating_add(transmit_ns(wire_len, p.bytes_per_sec));
    if next <= t {
        // Under the rate: leave when the packet wanted to; the next one is spaced from here.
        return (Verdict::Pass, PaceState { t_last_ns: t });
    }
    if next - now > p.slack_ns {
        return (Verdict::Drop, state);
    }
    (Verdict::Hold(next), PaceState { t_last_ns: next })
}

/// Policer: whether a packet of `wire_len` bytes arriving at `now` conforms, and the new
/// state. A non-conforming packet leaves the state as it was.
#[inline(always)]
pub const fn police(state: PaceState, now: u64, wire_len: u64, p: Pace) -> (Verdict, PaceState) {
    if p.bytes_per_sec == 0 {
        return (Verdict::Pass, state);
    }
    let tat = if state.t_last_ns > now {
        state.t_last_ns
    } else {
        now
    };
    if tat - now > p.slack_ns {
        return (Verdict::Drop, state);
    }
    (
        Verdict::Pass,
        PaceState {
            t_last_ns: tat.saturating_add(transmit_ns(wire_len, p.bytes_per_sec)),
        },
    )
}

/// Bytes on the wire for a packet of `len` bytes (L2 header included) that the stack
/// sends as `gso_segs` segments of `header_len` bytes of headers each: what the shaping
/// qdiscs count too, so that every mechanism limits the same quantity.
#[inline(always)]
pub const fn wire_len(len: u32, gso_segs: u32, header_len: u32) -> u64 {
    let extra = gso_segs.saturating_sub(1);
    len as u64 + extra as u64 * header_len as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAME: u64 = 1514;

    /// Offers back-to-back frames at `offered` bytes/s for `secs` and returns the bytes
    /// let through and the departure time of the last one, for either mechanism.
    fn run(
        mech: fn(PaceState, u64, u64, Pace) -> (Verdict, PaceState),
        p: Pace,
        offered: u64,
        secs: u64,
    ) -> (u64, u64) {
        let gap = transmit_ns(FRAME, offered);
        let (mut st, mut passed, mut last_departure) = (PaceState::default(), 0, 0);
        let mut now = 1_000_000_000; // not 0: the state starts at 0, long before "now"
        let end = now + secs * NSEC_PER_SEC;
        while now < end {
            let (v, next) = mech(st, now, FRAME, p);
            st = next;
            match v {
                Verdict::Pass => {
                    passed += FRAME;
                    last_departure = now;
                }
                Verdict::Hold(t) => {
                    assert!(t >= now, "a departure time in the past");
                    passed += FRAME;
                    last_departure = t;
                }
                Verdict::Drop => {}
            }
            now += gap;
        }
        (passed, last_departure)
    }

    fn edt_no_tstamp(s: PaceState, now: u64, len: u64, p: Pace) -> (Verdict, PaceState) {
        edt(s, now, 0, len, p)
    }

    #[test]
    fn edt_spaces_departures_at_the_rate_and_drops_beyond_the_horizon() {
        // 50 Mbit/s, offered at 10x for 2 s, 2 ms horizon.
        let p = Pace {
            bytes_per_sec: 6_250_000,
            slack_ns: 2_000_000,
        };
        let (passed, last) = run(edt_no_tstamp, p, 62_500_000, 2);
        let start = 1_000_000_000;
        // Everything let through leaves by the horizon, at exactly the rate.
        let span = last - start;
        assert!(span <= 2 * NSEC_PER_SEC + p.slack_ns, "{span}");
        let rate = passed as f64 / (span as f64 / 1e9);
        assert!(
            (rate / 6_250_000.0 - 1.0).abs() < 0.001,
            "paced at {rate} B/s"
        );
        // About 90% of what was offered had to be dropped.
        assert!(passed < 62_500_000 * 2 / 9, "{passed}");
    }

    #[test]
    fn edt_leaves_traffic_under_the_rate_alone() {
        let p = Pace {
            bytes_per_sec: 6_250_000,
            slack_ns: 2_000_000,
        };
        let (passed, _) = run(edt_no_tstamp, p, 3_000_000, 1);
        assert!(passed >= 3_000_000 - FRAME, "{passed}");
        let (v, _) = edt(PaceState { t_last_ns: 0 }, 10_000_000, 0, FRAME, p);
        assert_eq!(v, Verdict::Pass);
    }

    #[test]
    fn edt_respects_a_later_departure_the_sender_asked_for() {
        let p = Pace {
            bytes_per_sec: 6_250_000,
            slack_ns: 2_000_000,
        };
        let now = 10_000_000;
        let (v, st) = edt(PaceState { t_last_ns: 0 }, now, now + 500_000, FRAME, p);
        assert_eq!(v, Verdict::Pass, "the sender's own later time is kept");
        assert_eq!(st.t_last_ns, now + 500_000);
        // The next packet is spaced from that time, not from now.
        let (v, _) = edt(st, now, 0, FRAME, p);
        assert_eq!(
            v,
            Verdict::Hold(now + 500_000 + transmit_ns(FRAME, 6_250_000))
        );
    }

    #[test]
    fn edt_ignores_a_departure_time_beyond_the_horizon() {
        let p = Pace {
            bytes_per_sec: 6_250_000,
            slack_ns: 2_000_000,
        };
        let now = 10_000_000;
        let (v, st) = edt(PaceState { t_last_ns: 0 }, now, u64::MAX / 2, FRAME, p);
        assert_eq!((v, st.t_last_ns), (Verdict::Pass, now));
    }

    #[test]
    fn edt_drop_does_not_move_the_state() {
        let p = Pace {
            bytes_per_sec: 1_000,
            slack_ns: 1,
        };
        let st = PaceState {
            t_last_ns: 5_000_000,
        };
        let (v, next) = edt(st, 5_000_000, 0, FRAME, p);
        assert_eq!((v, next), (Verdict::Drop, st));
    }

    #[test]
    fn policer_passes_the_rate_plus_one_bucket() {
        // 500 Mbit/s, offered at 4x for 1 s, a 5 ms bucket.
        let p = Pace {
            bytes_per_sec: 62_500_000,
            slack_ns: 5_000_000,
        };
        let (passed, _) = run(police, p, 250_000_000, 1);
        let expected = 62_500_000 + 62_500_000 * 5 / 1000;
        let ratio = passed as f64 / expected as f64;
        assert!(
            (ratio - 1.0).abs() < 0.002,
            "passed {passed}, expected about {expected}"
        );
    }

    #[test]
    fn policer_is_exact_under_the_rate_and_unlimited_at_rate_zero() {
        let p = Pace {
            bytes_per_sec: 62_500_000,
            slack_ns: 0,
        };
        let (passed, _) = run(police, p, 31_250_000, 1);
        assert!(passed >= 31_250_000 - FRAME, "{passed}");
        let free = Pace {
            bytes_per_sec: 0,
            slack_ns: 0,
        };
        assert_eq!(
            police(PaceState::default(), 7, FRAME, free).0,
            Verdict::Pass
        );
        assert_eq!(
            edt(PaceState::default(), 7, 0, FRAME, free).0,
            Verdict::Pass
        );
    }

    #[test]
    fn transmit_time_rounds_up_and_never_overflows() {
        assert_eq!(transmit_ns(1514, 1_000_000_000), 1514);
        assert_eq!(transmit_ns(1, 3), 333_333_334);
        assert_eq!(transmit_ns(u64::MAX, 1), u64::MAX);
    }

    #[test]
    fn wire_length_counts_headers_per_segment() {
        assert_eq!(wire_len(1514, 0, 66), 1514);
        assert_eq!(wire_len(1514, 1, 66), 1514);
        // 45 segments of 1448 bytes in one GSO packet: 45 frames of 1514 on the wire.
        assert_eq!(wire_len(66 + 45 * 1448, 45, 66), 45 * 1514);
    }
}
