//! What the wire carried, sampled beside a run: each tenant's byte counter behind its
//! shaper, and the NIC queue's backlog.
//!
//! The highest 1-second rate comes from the interface counters rather than iperf3's
//! intervals: those count what the receiving program read in each interval, and a
//! receiver the busy CPUs delayed reads two intervals' bytes in one (in a first run of
//! this bench, one interval at 1.35 x the limit of a flow whose 6-second mean was under
//! 0.956 of it).

use std::time::{Duration, Instant};

use shareguard_tests::{net, net::Direction};

use crate::nic::Nic;

/// How often the counters are read.
const EVERY: Duration = Duration::from_millis(100);

/// Samples of one run: per counter (seconds since the first sample, bytes), and the NIC
/// queue's backlog in bytes.
pub struct Samples {
    pub bytes: Vec<Vec<(f64, u64)>>,
    pub backlog: Vec<u64>,
}

/// Reads `counters` and the NIC's backlog in `dir` every 100 ms from `start` until `end`
/// (both after `t0`).
pub fn sample(
    nic: &Nic,
    dir: Direction,
    counters: &[String],
    t0: Instant,
    start: Duration,
    end: Duration,
) -> Samples {
    let mut s = Samples {
        bytes: vec![Vec::new(); counters.len()],
        backlog: Vec::new(),
    };
    if let Some(wait) = start.checked_sub(t0.elapsed()) {
        std::thread::sleep(wait);
    }
    let first = Instant::now();
    while t0.elapsed() < end {
        let at = first.elapsed().as_secs_f64();
        for (c, v) in counters.iter().zip(&mut s.bytes) {
            v.push((at, net::read_counter(c)));
        }
        s.backlog.push(nic.backlog(dir));
        std::thread::sleep(EVERY);
    }
    s
}

/// The highest rate over any window of at least one second between two samples, bit/s
/// (NaN with less than a second of samples).
pub fn peak_1s(v: &[(f64, u64)]) -> f64 {
    let mut best = f64::NAN;
    for (i, &(t, b)) in v.iter().enumerate() {
        if let Some(&(t2, b2)) = v[i..].iter().find(|(t2, _)| t2 - t >= 1.0) {
            best = best.max((b2 - b) as f64 * 8.0 / (t2 - t));
        }
    }
    best
}

/// The mean rate between the first and the last sample, bit/s.
pub fn mean(v: &[(f64, u64)]) -> f64 {
    match (v.first(), v.last()) {
        (Some(&(t, b)), Some(&(t2, b2))) if t2 > t => (b2 - b) as f64 * 8.0 / (t2 - t),
        _ => f64::NAN,
    }
}
