//! A retry schedule with jitter for work that goes to the API server on the plugin's
//! own schedule (the slice publisher's passes): the delay doubles with each failure in
//! a row, from `first` up to `max`, and each is drawn between half of it and all of
//! it, so that the nodes of a cluster that failed together do not come back together.
//! An overloaded API server is the gate's to handle (`crate::throttle`); this is what
//! a failure that reaches the caller costs. The gate's holds and the status writer's
//! per-claim retries are drawn with the same pieces ([`doubled`], [`seed`], [`next`],
//! [`unit`]).

use std::time::Duration;

/// splitmix64's increment: each draw's state is the one before plus this.
pub const STEP: u64 = 0x9e37_79b9_7f4a_7c15;

/// A jitter seed that differs by node and start: nodes start at different instants and
/// with different pids. Jitter needs no strong source, only one that is not shared.
pub fn seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ u64::from(std::process::id()).rotate_left(32)
}

/// splitmix64's output for the draw whose state is `state`: a number in [0, 1).
pub fn unit(state: u64) -> f64 {
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The next draw in [0, 1) of the splitmix64 stream whose state is `state`.
pub fn next(state: &mut u64) -> f64 {
    *state = state.wrapping_add(STEP);
    unit(*state)
}

/// `first` doubled `n` times, at most `max`, then drawn between half of that and all
/// of it by `jitter` in [0, 1).
pub fn doubled(first: Duration, max: Duration, n: u32, jitter: f64) -> Duration {
    first
        .saturating_mul(1u32 << n.min(16))
        .min(max)
        .mul_f64(0.5 + 0.5 * jitter)
}

pub struct Backoff {
    first: Duration,
    max: Duration,
    failures: u32,
    /// splitmix64 state.
    seed: u64,
}

impl Backoff {
    pub fn new(first: Duration, max: Duration) -> Self {
        Self::seeded(first, max, seed())
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
        let wait = doubled(self.first, self.max, self.failures, next(&mut self.seed));
        self.failures = self.failures.saturating_add(1);
        wait
    }

    /// A success: the next failure starts from `first` again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
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
