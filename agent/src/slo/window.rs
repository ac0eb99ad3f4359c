//! Sliding windows with bounded memory, on the monotonic clock.
//!
//! Two kinds, for the two kinds of figure:
//!
//! - [`SampleWindow`] keeps durations for percentiles: every sample younger than the
//!   window, but at most [`MAX_SAMPLES`] of them (the oldest go first). A percentile is
//!   exact over what is kept; past the cap it covers the latest [`MAX_SAMPLES`] samples,
//!   a shorter span than the window, and says so (`truncated`). A fixed-bucket histogram
//!   would bound memory too, but its percentiles are only as good as its bucket edges,
//!   and the figures are compared with objectives a test (or an SRE) measures exactly.
//! - [`CountWindow`] counts events (refusals, repairs) in [`BUCKETS`] buckets of
//!   window / [`BUCKETS`] each: exact counts in constant memory, with the window's old
//!   edge moving a bucket at a time (a count may include events up to one bucket older
//!   than the window).
//!
//! Time is passed in rather than read, so tests can move it.

use std::{collections::VecDeque, time::Duration, time::Instant};

/// The most samples one [`SampleWindow`] keeps: 8 bytes of value and 16 of time each,
/// under 100 KiB per window, and more than an hour of one Prepare a second.
pub const MAX_SAMPLES: usize = 4096;

/// How many buckets a [`CountWindow`] spans its window with.
pub const BUCKETS: u32 = 60;

/// Durations younger than a window, for percentiles.
#[derive(Debug)]
pub struct SampleWindow {
    span: Duration,
    samples: VecDeque<(Instant, Duration)>,
    /// When the newest sample dropped for the cap was taken: while that is inside the
    /// window, what is kept covers less than the window.
    dropped: Option<Instant>,
}

/// What a [`SampleWindow`] holds now, sorted, for percentiles.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Samples {
    sorted: Vec<Duration>,
    pub truncated: bool,
}

impl Samples {
    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The nearest-rank percentile `q` (0 < q <= 1): the smallest sample at or above
    /// which a fraction q of the samples lie. Always one of the samples, never an
    /// interpolation, so it can be checked against what a caller measured. None when
    /// there are none.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let n = self.sorted.len();
        if n == 0 {
            return None;
        }
        // rank = ceil(q * n), 1-based; q is clamped so the cast stays in range.
        let rank = (q.clamp(0.0, 1.0) * n as f64).ceil() as usize;
        self.sorted.get(rank.clamp(1, n) - 1).copied()
    }

    pub fn max(&self) -> Option<Duration> {
        self.sorted.last().copied()
    }
}

impl SampleWindow {
    pub fn new(span: Duration) -> Self {
        Self {
            span,
            samples: VecDeque::new(),
            dropped: None,
        }
    }

    pub fn record(&mut self, now: Instant, value: Duration) {
        self.expire(now);
        if self.samples.len() >= MAX_SAMPLES
            && let Some((at, _)) = self.samples.pop_front()
        {
            self.dropped = Some(at);
        }
        self.samples.push_back((now, value));
    }

    fn expire(&mut self, now: Instant) {
        while let Some((at, _)) = self.samples.front() {
            if now.saturating_duration_since(*at) < self.span {
                break;
            }
            self.samples.pop_front();
        }
        if self
            .dropped
            .is_some_and(|at| now.saturating_duration_since(at) >= self.span)
        {
            self.dropped = None;
        }
    }

    /// What the window holds at `now`, oldest first, as (age, value); and since when
    /// samples were dropped for the cap, if they were (for [`super::persist`]).
    pub fn entries(&mut self, now: Instant) -> (Vec<(Duration, Duration)>, Option<Duration>) {
        self.expire(now);
        let kept = self
            .samples
            .iter()
            .map(|(at, v)| (now.saturating_duration_since(*at), *v))
            .collect();
        (
            kept,
            self.dropped.map(|at| now.saturating_duration_since(at)),
        )
    }

    /// Samples before `at` were dropped: [`Samples::truncated`] until `at` leaves the
    /// window.
    pub fn mark_dropped(&mut self, at: Instant) {
        self.dropped = Some(self.dropped.map_or(at, |d| d.max(at)));
    }

    pub fn samples(&mut self, now: Instant) -> Samples {
        self.expire(now);
        let mut sorted: Vec<Duration> = self.samples.iter().map(|(_, d)| *d).collect();
        sorted.sort_unstable();
        Samples {
            sorted,
            truncated: self.dropped.is_some(),
        }
    }
}

/// Events counted over a window in fixed buckets.
#[derive(Debug)]
pub struct CountWindow {
    /// The window divided by [`BUCKETS`]; at least a millisecond.
    width: Duration,
    /// Counts by bucket number (time since `origin` / width), oldest first.
    buckets: VecDeque<(u64, u64)>,
    origin: Instant,
}

impl CountWindow {
    pub fn new(span: Duration, origin: Instant) -> Self {
        Self {
            width: (span / BUCKETS).max(Duration::from_millis(1)),
            buckets: VecDeque::new(),
            origin,
        }
    }

    fn bucket(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since / self.width.as_nanos().max(1)).unwrap_or(u64::MAX)
    }

    fn expire(&mut self, now: Instant) {
        let current = self.bucket(now);
        let oldest = current.saturating_sub(u64::from(BUCKETS) - 1);
        while self.buckets.front().is_some_and(|(b, _)| *b < oldest) {
            self.buckets.pop_front();
        }
    }

    pub fn add(&mut self, now: Instant, n: u64) {
        self.expire(now);
        let b = self.bucket(now);
        match self.buckets.back_mut() {
            Some((last, count)) if *last == b => *count = count.saturating_add(n),
            // Time only moves forward on the monotonic clock; a caller's `now` from
            // before the last event (taken before a lock) lands in the last bucket.
            Some((last, count)) if *last > b => *count = count.saturating_add(n),
            _ => self.buckets.push_back((b, n)),
        }
    }

    /// The buckets holding events at `now`, oldest first, as (age of the bucket's
    /// start, count), for [`super::persist`].
    pub fn entries(&mut self, now: Instant) -> Vec<(Duration, u64)> {
        self.expire(now);
        let width = self.width;
        let origin = self.origin;
        self.buckets
            .iter()
            .map(|(b, c)| {
                let start = u32::try_from(*b)
                    .ok()
                    .and_then(|b| width.checked_mul(b))
                    .and_then(|d| origin.checked_add(d))
                    .unwrap_or(now);
                (now.saturating_duration_since(start), *c)
            })
            .collect()
    }

    pub fn count(&mut self, now: Instant) -> u64 {
        self.expire(now);
        self.buckets
            .iter()
            .map(|(_, c)| *c)
            .fold(0, u64::saturating_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn samples_older_than_the_window_expire() {
        let t0 = Instant::now();
        let mut w = SampleWindow::new(Duration::from_secs(10));
        w.record(t0, 5 * MS);
        w.record(t0 + Duration::from_secs(5), 7 * MS);
        assert_eq!(w.samples(t0 + Duration::from_secs(9)).len(), 2);
        let s = w.samples(t0 + Duration::from_secs(10));
        assert_eq!(s.len(), 1, "the first is exactly a window old");
        assert_eq!(s.max(), Some(7 * MS));
        assert!(w.samples(t0 + Duration::from_secs(16)).is_empty());
    }

    #[test]
    fn percentiles_are_nearest_rank_and_one_of_the_samples() {
        let t0 = Instant::now();
        let mut w = SampleWindow::new(Duration::from_secs(60));
        for i in 1..=100u32 {
            w.record(t0, i * MS);
        }
        let s = w.samples(t0);
        assert_eq!(s.quantile(0.5), Some(50 * MS));
        assert_eq!(s.quantile(0.99), Some(99 * MS));
        assert_eq!(s.quantile(1.0), Some(100 * MS));
        let mut one = SampleWindow::new(Duration::from_secs(60));
        one.record(t0, 3 * MS);
        let s = one.samples(t0);
        assert_eq!(
            (s.quantile(0.5), s.quantile(0.99)),
            (Some(3 * MS), Some(3 * MS))
        );
        assert_eq!(Samples::default().quantile(0.99), None);
        // Three samples: p99 is the largest, p50 the middle.
        let mut three = SampleWindow::new(Duration::from_secs(60));
        for v in [9, 1, 4] {
            three.record(t0, v * MS);
        }
        let s = three.samples(t0);
        assert_eq!(
            (s.quantile(0.5), s.quantile(0.99)),
            (Some(4 * MS), Some(9 * MS))
        );
    }

    #[test]
    fn the_cap_keeps_the_latest_samples_and_says_so() {
        let t0 = Instant::now();
        let mut w = SampleWindow::new(Duration::from_secs(3600));
        for i in 0..(MAX_SAMPLES as u32 + 10) {
            w.record(t0 + i * MS, Duration::from_micros(u64::from(i)));
        }
        let s = w.samples(t0 + Duration::from_secs(5));
        assert_eq!(s.len(), MAX_SAMPLES);
        assert!(s.truncated);
        assert_eq!(s.sorted.first().copied(), Some(Duration::from_micros(10)));
        // Once what was dropped would have expired anyway, it is whole again.
        let s = w.samples(t0 + Duration::from_secs(3600) + 10 * MS);
        assert!(!s.truncated, "{}", s.len());
    }

    #[test]
    fn counts_cover_the_window_in_buckets_and_expire() {
        let t0 = Instant::now();
        let span = Duration::from_secs(60);
        let mut c = CountWindow::new(span, t0);
        c.add(t0, 2);
        c.add(t0 + Duration::from_secs(30), 1);
        assert_eq!(c.count(t0 + Duration::from_secs(59)), 3);
        // The first bucket is a whole window behind the current one: gone.
        assert_eq!(c.count(t0 + Duration::from_secs(60)), 1);
        assert_eq!(c.count(t0 + Duration::from_secs(91)), 0);
        c.add(t0 + Duration::from_secs(200), 4);
        c.add(t0 + Duration::from_secs(199), 1);
        assert_eq!(c.count(t0 + Duration::from_secs(200)), 5);
    }
}
