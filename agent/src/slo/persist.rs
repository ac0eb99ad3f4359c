//! The SLO windows across a restart.
//!
//! A verdict that starts over at every restart would hide exactly what a rollout must
//! see: an agent restarted by its own upgrade would say "hold" for a window, and one
//! that crash-loops would never gather enough claims to be rolled back. So the agent
//! saves each class's verdict window (the short one is its recent part) in the store's
//! `meta/slo/<class>` every `[slo] save_period` and when it stops, and a start loads it
//! back before it serves. A crash loses what came after the last save; the figures are
//! not acknowledged to anyone, so nothing else waits for them to be durable.
//!
//! The monotonic clock does not survive a restart, so times are saved as ages at the
//! moment of the save, with that moment on the wall clock: at load, each age grows by
//! the wall time since, and what is then older than the window is dropped. A wall
//! clock that went back counts as no time passed.
//!
//! One record per class stays within the store's bound on a value
//! ([`record::MAX_RECORD_BYTES`]): if the samples do not fit, the oldest go, and the
//! loaded window says it is truncated, as a window past its own cap does.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::record;

use super::RefusalReason;

/// One class's verdict window as saved (`meta/slo/<class>`, [`record`]-encoded).
/// Pairs are `[age in ms at the save, value]`: a sample's value in ns, a bucket's count.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SloRecord {
    /// When it was saved, ms since the Unix epoch.
    pub saved_ms: u64,
    pub prepare: Vec<[u64; 2]>,
    /// Age in ms of the newest Prepare sample dropped (for the cap), if one was.
    #[serde(default)]
    pub prepare_dropped_ms: Option<u64>,
    pub convergence: Vec<[u64; 2]>,
    #[serde(default)]
    pub convergence_dropped_ms: Option<u64>,
    pub claims: Vec<[u64; 2]>,
    /// By [`RefusalReason::name`]; a name this agent does not know is skipped at load.
    pub refusals: BTreeMap<String, Vec<[u64; 2]>>,
    pub repairs: Vec<[u64; 2]>,
}

/// `d` in whole ms, as saved.
pub fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Samples as saved: `[age ms, value ns]`, oldest first.
pub fn samples(entries: &[(Duration, Duration)]) -> Vec<[u64; 2]> {
    entries.iter().map(|(age, v)| [ms(*age), ns(*v)]).collect()
}

/// Counts as saved: `[age ms, count]`, oldest first.
pub fn counts(entries: &[(Duration, u64)]) -> Vec<[u64; 2]> {
    entries.iter().map(|(age, n)| [ms(*age), *n]).collect()
}

impl SloRecord {
    /// The record encoded within the store's bound: while it is over, the older half of
    /// the larger sample list goes (its newest dropped age noted).
    pub fn encode_bounded(mut self) -> Vec<u8> {
        loop {
            let bytes = record::encode(&self);
            if bytes.len() <= record::MAX_RECORD_BYTES {
                return bytes;
            }
            let (list, dropped) = if self.prepare.len() >= self.convergence.len() {
                (&mut self.prepare, &mut self.prepare_dropped_ms)
            } else {
                (&mut self.convergence, &mut self.convergence_dropped_ms)
            };
            if list.is_empty() {
                // Only counts left, 60 buckets each per kind: far below the bound, so
                // this is not reached; an empty record is the safe answer if it is.
                return record::encode(&SloRecord {
                    saved_ms: self.saved_ms,
                    ..SloRecord::default()
                });
            }
            let cut = list.len().div_ceil(2);
            let newest_cut = list[cut - 1][0];
            list.drain(..cut);
            *dropped = Some(dropped.map_or(newest_cut, |d| d.min(newest_cut)));
        }
    }
}

/// Where the saved times land on this process's monotonic clock.
pub struct Rebase {
    now: Instant,
    /// Wall time from the save to now.
    since_save: Duration,
    window: Duration,
}

impl Rebase {
    pub fn new(saved_ms: u64, now_ms: u64, now: Instant, window: Duration) -> Self {
        Self {
            now,
            since_save: Duration::from_millis(now_ms.saturating_sub(saved_ms)),
            window,
        }
    }

    /// The instant of something `age_ms` old at the save; None when it is outside the
    /// window now (or before this machine's monotonic clock began).
    pub fn at(&self, age_ms: u64) -> Option<Instant> {
        let age = Duration::from_millis(age_ms).checked_add(self.since_save)?;
        if age >= self.window {
            return None;
        }
        self.now.checked_sub(age)
    }

    /// Saved samples as (instant, value), oldest first, those still in the window.
    pub fn samples(&self, saved: &[[u64; 2]]) -> Vec<(Instant, Duration)> {
        let mut out: Vec<(Instant, Duration)> = saved
            .iter()
            .filter_map(|[age, v]| Some((self.at(*age)?, Duration::from_nanos(*v))))
            .collect();
        out.sort_by_key(|(at, _)| *at);
        out
    }

    /// Saved counts as (instant, count), oldest first, those still in the window.
    pub fn counts(&self, saved: &[[u64; 2]]) -> Vec<(Instant, u64)> {
        let mut out: Vec<(Instant, u64)> = saved
            .iter()
            .filter_map(|[age, n]| Some((self.at(*age)?, *n)))
            .collect();
        out.sort_by_key(|(at, _)| *at);
        out
    }
}

/// The refusal reason saved under `name`.
pub fn reason(name: &str) -> Option<RefusalReason> {
    RefusalReason::ALL.into_iter().find(|r| r.name() == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_over_the_bound_drops_its_oldest_samples_and_says_so() {
        // 6000 samples of the largest values: far over 48 KiB as JSON.
        let big: Vec<[u64; 2]> = (0..6000u64)
            .map(|i| [600_000_000 - i, u64::MAX - i])
            .collect();
        let rec = SloRecord {
            saved_ms: 1,
            prepare: big.clone(),
            convergence: big[..100].to_vec(),
            ..SloRecord::default()
        };
        let bytes = rec.encode_bounded();
        assert!(bytes.len() <= record::MAX_RECORD_BYTES, "{}", bytes.len());
        let back: SloRecord = record::decode(&bytes).unwrap();
        assert!(!back.prepare.is_empty() && back.prepare.len() < 6000);
        // The newest are kept, and the newest dropped is named.
        assert_eq!(back.prepare.last(), big.last());
        let first_kept = back.prepare[0][0];
        let dropped = back.prepare_dropped_ms.unwrap();
        assert!(dropped > first_kept, "{dropped} {first_kept}");
        assert_eq!(back.convergence.len(), 100, "the small list is whole");
        assert_eq!(back.convergence_dropped_ms, None);
    }

    #[test]
    fn ages_grow_by_the_wall_time_since_the_save_and_old_ones_go() {
        let now = Instant::now() + Duration::from_secs(7200);
        let window = Duration::from_secs(3600);
        let r = Rebase::new(1_000_000, 1_000_000 + 600_000, now, window);
        // 10 min old at the save, 10 min since: 20 min old now.
        assert_eq!(r.at(600_000), now.checked_sub(Duration::from_secs(1200)));
        // 55 min old at the save: 65 min now, outside the hour.
        assert_eq!(r.at(3_300_000), None);
        // A wall clock that went back: no time passed.
        let back = Rebase::new(2_000_000, 1_000_000, now, window);
        assert_eq!(back.at(1000), now.checked_sub(Duration::from_secs(1)));
        let s = r.samples(&[[1000, 5], [2000, 7], [4_000_000, 9]]);
        assert_eq!(
            s.iter().map(|(_, v)| v.as_nanos()).collect::<Vec<_>>(),
            [7, 5],
            "oldest first, the expired one gone"
        );
    }

    #[test]
    fn reasons_round_trip_by_name() {
        for r in RefusalReason::ALL {
            assert_eq!(reason(r.name()), Some(r));
        }
        assert_eq!(reason("from-a-newer-agent"), None);
    }
}
