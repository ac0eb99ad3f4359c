//! A retry schedule with jitter for work that goes to the API server on the plugin's
//! own schedule (the slice publisher's passes): the delay doubles with each failure in
//! a row, from `first` up to `max`, and each is drawn between half of it and all of
//! it, so that the nodes of a cluster that failed together do not come back together.
//! An overloaded API server is the gate's to handle (`crate::throttle`); this is what
//! a failure that reaches the caller costs.

use std::time::Duration;

pub struct Backoff {
    first: Duration,
    max: Duration,
    failures: u32,
    /// splitmix64 state: jitter needs no strong source, only one that differs by node.
    seed: u64,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        // Nodes start at different instants and with different pids.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Self::seeded(
            first,
            max,
            now.as_nanos() as u64 ^ u64::from(std::process::id()) << 32,
        )
    }

    fn seeded(first: Duration, max: Duration, seed: u64) -> Self {
        Self {
            first,
            max: max.max(first),
            failures: 0,
            seed,
        }
    }

    /// The wait before the next try, after one more failure.
    pub fn failed(&mut self) -> Duration {
        let full = self
            .first
            .saturating_mul(1u32 << self.failures.min(16))
            .min(self.max);
        self.failures = self.failures.saturating_add(1);
        full.mul_f64(0.5 + 0.5 * self.jitter())
    }

    /// A success: the next failure starts from `first` again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// In [0, 1).
    fn jitter(&mut self) -> f64 {
        self.seed = self.seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_first_to_max_each_between_half_and_all_and_resets() {
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(120));
        let mut b = Backoff::seeded(first, max, 7);
        let mut full = first;
        for i in 0..12 {
            let d = b.failed();
            assert!(
                d >= full / 2 && d <= full,
                "failure {i}: {d:?} outside [{:?}, {full:?}]",
                full / 2
            );
            full = (full * 2).min(max);
        }
        assert!(b.failed() <= max);
        b.succeeded();
        assert!(b.failed() <= first, "a success starts over");
    }

    #[test]
    fn two_nodes_that_failed_together_do_not_retry_together() {
        let waits = |seed| {
            let mut b = Backoff::seeded(Duration::from_secs(1), Duration::from_secs(120), seed);
            (0..6).map(|_| b.failed()).collect::<Vec<_>>()
        };
        let (a, b) = (waits(1), waits(2));
        assert!(a.iter().zip(&b).all(|(x, y)| x != y), "{a:?} {b:?}");
        // And one node's waits are not all at the same point of their range.
        let spread: Vec<f64> = a
            .iter()
            .enumerate()
            .map(|(i, d)| d.as_secs_f64() / (1u64 << i) as f64)
            .collect();
        assert!(
            spread.iter().any(|f| (f - spread[0]).abs() > 0.01),
            "{spread:?}"
        );
    }
}
