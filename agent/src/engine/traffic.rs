//! The traffic the kernel counted for each bandwidth share, read by the counters task
//! every `counters_period`, and what the agent measures from it (see
//! [`crate::rollout::measure`]): bytes per direction, time and bytes above the allocated
//! rate. Kept in memory: the kernel's counters restart with the share's installation, so
//! nothing here is worth a write to the store.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shareguard_common::limiter::TrafficCounters;

use crate::{
    record::{Phase, ShareRecord},
    rollout::measure::Measured,
    sync::lock,
};

use super::Engine;

/// How often an OBSERVED share's figures are sent to watchers (the kubelet plugin writes
/// them into the claim's status): the claim shows what observe measured without one API
/// write per share per counters period.
pub const REPORT_PERIOD: Duration = Duration::from_secs(60);

/// One share's figures and when watchers last got them.
#[derive(Clone, Copy, Debug)]
struct Tracked {
    measured: Measured,
    reported: Option<(Instant, Measured)>,
}

#[derive(Debug, Default)]
pub(super) struct Traffic {
    counters: HashMap<String, TrafficCounters>,
    tracked: HashMap<String, Tracked>,
}

/// The share's allocated rate per direction, bit/s: (to the pod, from the pod).
fn rates(engine: &Engine, r: &ShareRecord) -> (Option<u64>, Option<u64>) {
    shareguard_limiter_net::limiter::rates(&engine.limits_of(r)).unwrap_or((None, None))
}

/// What a refresh needs of a live share whose limiter counts traffic. Taken under the
/// state lock instead of a copy of the record: with 100,000 live shares, copies of
/// every record each period held the lock for tens of milliseconds and left about
/// 1 KiB a share of freed heap behind in the agent's resident memory.
struct Counted {
    key: String,
    /// Its device's limiter, by index into the pass's counting limiters.
    limiter: usize,
    phase: Phase,
    rates: (Option<u64>, Option<u64>),
}

impl Engine {
    /// Reads what the kernel counted for every live share whose limiter counts traffic,
    /// on a blocking thread, and keeps it for [`Engine::share_counters`]: a scrape then
    /// does no kernel or netlink work, however many scrapers there are. Measures each
    /// share against its rate, and sends OBSERVED shares whose figures changed to the
    /// watchers, at most once per [`REPORT_PERIOD`].
    pub async fn refresh_counters(self: &std::sync::Arc<Self>) {
        let e = self.clone();
        let fresh = tokio::task::spawn_blocking(move || {
            // The few devices whose limiter counts, and their limiters, found once per
            // pass: asking for each record's (a stage lookup under its own lock) cost
            // more than the rest of this walk under the state lock.
            let counting: Vec<(&str, _)> = e
                .limiters
                .keys()
                .filter_map(|d| {
                    let l = e.limiter(d)?;
                    (!l.accounting_only()).then_some((d.as_str(), l))
                })
                .collect();
            let counted: Vec<Counted> = {
                let st = lock(&e.state);
                st.records
                    .values()
                    .filter(|r| r.phase.holds_capacity())
                    .filter_map(|r| {
                        Some(Counted {
                            key: r.key.clone(),
                            limiter: counting.iter().position(|(d, _)| *d == r.device)?,
                            phase: r.phase,
                            rates: rates(&e, r),
                        })
                    })
                    .collect()
            };
            counted
                .into_iter()
                .filter_map(|s| {
                    let c = counting[s.limiter].1.counters(&s.key)?;
                    // Stamped as read: the interval judged is the one the kernel
                    // counted over, not one stretched or shrunk by however long this
                    // thread or the task that waits for it were kept off a CPU.
                    Some((s, c, Instant::now()))
                })
                .collect::<Vec<_>>()
        })
        .await;
        let fresh = match fresh {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "reading traffic counters failed");
                return;
            }
        };
        let now = Instant::now();
        let due = {
            let mut t = lock(&self.traffic);
            let clock_ms = |at: Instant| {
                u64::try_from(at.duration_since(self.started).as_millis()).unwrap_or(u64::MAX)
            };
            let mut tracked = std::mem::take(&mut t.tracked);
            let mut due = Vec::new();
            for (s, c, read_at) in &fresh {
                let (to, from) = s.rates;
                let entry = tracked.remove(&s.key).unwrap_or(Tracked {
                    measured: Measured::default(),
                    reported: None,
                });
                let mut entry = entry;
                entry.measured.sample(clock_ms(*read_at), c, to, from);
                if s.phase == Phase::Observed
                    && entry.reported.is_none_or(|(at, m)| {
                        now.duration_since(at) >= REPORT_PERIOD
                            && m.figures() != entry.measured.figures()
                    })
                {
                    entry.reported = Some((now, entry.measured));
                    due.push(s.key.as_str());
                }
                t.tracked.insert(s.key.clone(), entry);
            }
            // Shares not read this time (released, or no longer counted) are forgotten
            // with `tracked`'s leftovers.
            t.counters = fresh.iter().map(|(s, c, _)| (s.key.clone(), *c)).collect();
            due
        };
        let due: Vec<ShareRecord> = {
            let st = lock(&self.state);
            due.iter()
                .filter_map(|k| st.records.get(k).cloned())
                .collect()
        };
        self.publish(&due);
    }

    /// What the kernel counted for each of `shares`, as last read by
    /// [`Engine::refresh_counters`].
    pub fn share_counters<'a>(
        &self,
        shares: &'a [ShareRecord],
    ) -> Vec<(&'a ShareRecord, TrafficCounters)> {
        let t = lock(&self.traffic);
        shares
            .iter()
            .filter_map(|r| Some((r, *t.counters.get(&r.key)?)))
            .collect()
    }

    /// What the agent measured of share `key`'s traffic, if it counts any.
    pub fn measured(&self, key: &str) -> Option<Measured> {
        lock(&self.traffic).tracked.get(key).map(|t| t.measured)
    }
}
