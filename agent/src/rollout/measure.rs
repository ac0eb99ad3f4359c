//! What the agent measures of a bandwidth share's traffic, whatever its stage: the bytes
//! each direction carried and, from the counters sampled every `counters_period`, how long
//! and by how much the share ran above its allocated rate. The counting programs see a
//! packet before any shaper does, so the figures are what the pod's traffic offered: in
//! `observe` what enforcing would have held back; under `enforce` what the shaper did
//! hold back (queued, then sent later, or dropped): near zero for a flow that has found
//! its rate, a few MB at a flow's start (TCP's start-up probes far above the rate
//! before it settles).
//!
//! The time above the rate is judged per sampling interval, from the interval's average:
//! a burst shorter than one interval is averaged with the rest of it, so both figures
//! are lower bounds at that resolution (the status says the interval).

use shareguard_common::limiter::TrafficCounters;

/// One direction's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Above {
    /// Bytes the kernel counted (since the share was installed on this sandbox).
    pub bytes: u64,
    /// Milliseconds of the sampled intervals in which the average rate was above the
    /// allocated one.
    pub ms_above: u64,
    /// In those intervals, the bytes beyond what the allocated rate allows.
    pub bytes_above: u64,
    /// The highest average rate of one interval, bit/s.
    pub peak_bps: u64,
}

/// A share's figures and the sample they continue from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Measured {
    pub to_pod: Above,
    pub from_pod: Above,
    /// The sampling interval the figures are judged over, ms.
    pub interval_ms: u64,
    /// The last sample: when (ms on a monotonic clock) and the byte counts.
    last: Option<(u64, u64, u64)>,
}

impl Measured {
    /// The figures, without the sample they continue from: what watchers are shown.
    pub fn figures(&self) -> (Above, Above) {
        (self.to_pod, self.from_pod)
    }

    /// Takes the counters read at `now_ms` (monotonic) for a share allocated `to_pod_bps`
    /// and `from_pod_bps` (None: that direction has no rate of its own).
    pub fn sample(
        &mut self,
        now_ms: u64,
        c: &TrafficCounters,
        to_pod_bps: Option<u64>,
        from_pod_bps: Option<u64>,
    ) {
        if let Some((then, to_before, from_before)) = self.last {
            let dt = now_ms.saturating_sub(then);
            // Counters that went back mean the share was installed afresh (a new
            // sandbox, a stage change): the interval has no meaning; start again from
            // this sample and keep what was measured before it.
            if dt > 0 && c.to_pod_bytes >= to_before && c.from_pod_bytes >= from_before {
                self.interval_ms = dt;
                judge(&mut self.to_pod, c.to_pod_bytes - to_before, dt, to_pod_bps);
                judge(
                    &mut self.from_pod,
                    c.from_pod_bytes - from_before,
                    dt,
                    from_pod_bps,
                );
            }
        }
        self.to_pod.bytes = c.to_pod_bytes;
        self.from_pod.bytes = c.from_pod_bytes;
        self.last = Some((now_ms, c.to_pod_bytes, c.from_pod_bytes));
    }
}

/// Adds one interval of `dt_ms` in which `bytes` went one way, allocated `bps`.
fn judge(a: &mut Above, bytes: u64, dt_ms: u64, bps: Option<u64>) {
    let bits = u128::from(bytes) * 8;
    let rate = u64::try_from(bits * 1000 / u128::from(dt_ms)).unwrap_or(u64::MAX);
    a.peak_bps = a.peak_bps.max(rate);
    let Some(bps) = bps else { return };
    // What the allocated rate lets through in the interval, in bytes, rounded down: a
    // share exactly at its rate is not above it.
    let allowed = u64::try_from(u128::from(bps) * u128::from(dt_ms) / 8000).unwrap_or(u64::MAX);
    if bytes > allowed {
        a.ms_above = a.ms_above.saturating_add(dt_ms);
        a.bytes_above = a.bytes_above.saturating_add(bytes - allowed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(to: u64, from: u64) -> TrafficCounters {
        TrafficCounters {
            to_pod_bytes: to,
            from_pod_bytes: from,
            ..TrafficCounters::default()
        }
    }

    #[test]
    fn intervals_above_the_rate_are_counted_with_the_bytes_beyond_it() {
        let mut m = Measured::default();
        let rate = Some(8_000_000); // 1 MB/s
        m.sample(0, &counters(0, 0), rate, rate);
        assert_eq!(
            (m.to_pod, m.interval_ms),
            (Above::default(), 0),
            "one sample judges nothing"
        );
        // 5 s at 3 MB/s to the pod, 1 MB/s from it (exactly the rate: not above).
        m.sample(5_000, &counters(15_000_000, 5_000_000), rate, rate);
        assert_eq!(
            m.to_pod,
            Above {
                bytes: 15_000_000,
                ms_above: 5_000,
                bytes_above: 10_000_000,
                peak_bps: 24_000_000,
            }
        );
        assert_eq!((m.from_pod.ms_above, m.from_pod.bytes_above), (0, 0));
        assert_eq!(m.from_pod.peak_bps, 8_000_000);
        assert_eq!(m.interval_ms, 5_000);
        // A quiet interval adds bytes, no time above.
        m.sample(10_000, &counters(15_000_100, 5_000_000), rate, rate);
        assert_eq!((m.to_pod.ms_above, m.to_pod.bytes), (5_000, 15_000_100));
    }

    #[test]
    fn counters_that_go_back_start_a_new_baseline_and_keep_the_figures() {
        let mut m = Measured::default();
        let rate = Some(8_000);
        m.sample(0, &counters(0, 0), rate, None);
        m.sample(1_000, &counters(5_000, 0), rate, None);
        assert_eq!(m.to_pod.bytes_above, 4_000);
        // Installed afresh: counts restart at 0.
        m.sample(2_000, &counters(10, 0), rate, None);
        assert_eq!(
            (m.to_pod.ms_above, m.to_pod.bytes_above, m.to_pod.bytes),
            (1_000, 4_000, 10)
        );
        m.sample(3_000, &counters(3_010, 0), rate, None);
        assert_eq!((m.to_pod.ms_above, m.to_pod.bytes_above), (2_000, 6_000));
        // A direction without a rate of its own is measured, never above.
        assert_eq!((m.from_pod.ms_above, m.from_pod.peak_bps), (0, 0));
        // No time passed: nothing judged, no division by zero.
        m.sample(3_000, &counters(9_999, 0), rate, None);
        assert_eq!(m.to_pod.ms_above, 2_000);
    }
}
