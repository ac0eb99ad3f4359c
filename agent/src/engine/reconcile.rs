//! The reconciler: on a period, re-reads every enforced share's enforcement from the
//! kernel or driver, moves a share whose enforcement drifted (a qdisc deleted by hand, a
//! class rate changed, an ifb removed, a GPU limit lifted) to DEGRADED with the reason,
//! re-applies it, and returns it to ENFORCED once the read-back matches again. Every
//! transition is persisted before it is published, like any other.
//!
//! What it never does: free capacity. A share whose target is gone (the pod's network
//! namespace, its interface) stays DEGRADED, saying so, until an explicit Unprepare.
//! UNKNOWN shares (not verifiable since a restart or reboot) are read back too, and
//! become ENFORCED if their enforcement is there after all (a transient failure at
//! start), but are never re-applied: after a reboot their stored target is stale, and
//! the pod's repeated Prepare carries the target as it is now.

use std::time::Instant;

use tracing::{Instrument, info, info_span, warn};

use crate::{
    record::{Phase, ShareRecord},
    sync::lock,
};

use super::{Engine, judge, now_ms, spec_of};

/// What one pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileStats {
    pub checked: usize,
    pub drifted: usize,
    pub repaired: usize,
}

/// The phases the reconciler reads back: what was enforced, or should be again.
fn reconciled(p: Phase) -> bool {
    matches!(p, Phase::Enforced | Phase::Degraded | Phase::Unknown)
}

impl Engine {
    /// One pass over the live enforced shares.
    pub async fn reconcile(&self) -> ReconcileStats {
        let started = Instant::now();
        let candidates: Vec<ShareRecord> = {
            let st = lock(&self.state);
            st.records
                .values()
                .filter(|r| reconciled(r.phase))
                .filter(|r| !self.accounting_only(&r.device))
                .cloned()
                .collect()
        };
        let mut stats = ReconcileStats::default();
        for r in candidates {
            let span =
                info_span!("reconcile", share = %r.key, claim = %r.claim.uid, device = %r.device);
            self.reconcile_share(&r.key, &r.claim.uid, &mut stats)
                .instrument(span)
                .await;
        }
        self.metrics.reconciled(started.elapsed());
        stats
    }

    async fn reconcile_share(&self, key: &str, claim_uid: &str, stats: &mut ReconcileStats) {
        // The claim's lock: a Prepare or Unprepare of the same claim must not interleave
        // with a re-apply here.
        let _guard = self.locks.lock(claim_uid).await;
        // Re-read under the lock: the share may have been released meanwhile.
        let Some(r) = lock(&self.state).records.get(key).cloned() else {
            return;
        };
        if !reconciled(r.phase) {
            return;
        }
        let Some(l) = self.limiter(&r.device).cloned() else {
            return;
        };
        stats.checked += 1;
        let spec = spec_of(&r);
        let verified = tokio::task::spawn_blocking(move || l.verify(&spec))
            .await
            .unwrap_or_else(|e| {
                Err(shareguard_common::limiter::LimiterError::retryable(
                    format!("verify task failed: {e}"),
                ))
            });
        let why = match &verified {
            Ok(e) => match judge(&r, e) {
                judged @ ((Phase::Enforced, _) | (Phase::Accounted, _)) => {
                    if matches!(r.phase, Phase::Degraded | Phase::Unknown) {
                        // Repaired by someone else (or the kernel came back): say so.
                        self.settle(&r, e, judged, stats, false).await;
                    }
                    return;
                }
                (_, why) => why,
            },
            Err(e) => e.to_string(),
        };
        if r.phase == Phase::Unknown {
            // Verified only; re-applying is the repeated Prepare's job (see above).
            return;
        }
        // Drift: record it before trying to repair, so a crash in between is explained.
        if r.phase == Phase::Enforced {
            stats.drifted += 1;
            self.metrics.drift(&r.device);
            warn!(reason = %why, "enforcement drifted");
            let mut d = r.clone();
            d.phase = Phase::Degraded;
            d.reason = format!("drift found by the reconciler: {why}; repairing");
            d.updated_at_ms = now_ms();
            if self.persist(&d).await.is_err() {
                return;
            }
        }
        match self.apply_blocking(&r).await {
            Ok(e) => match judge(&r, &e) {
                judged @ ((Phase::Enforced, _) | (Phase::Accounted, _)) => {
                    self.settle(&r, &e, judged, stats, true).await;
                }
                (_, why) => self.still_degraded(&r, &why).await,
            },
            Err(e) => self.still_degraded(&r, &e.to_string()).await,
        }
    }

    /// Persists `r` as `judged` from `e`, the enforcement just read back.
    async fn settle(
        &self,
        r: &ShareRecord,
        e: &shareguard_common::limiter::Enforcement,
        (phase, reason): (Phase, String),
        stats: &mut ReconcileStats,
        repaired: bool,
    ) {
        let mut n = r.clone();
        n.phase = phase;
        n.reason = if repaired {
            format!("{reason} (repaired by the reconciler)")
        } else {
            reason
        };
        n.mechanism = e.mechanism.clone();
        n.enforced = e.enforced.clone();
        n.error = None;
        n.updated_at_ms = now_ms();
        if self.persist(&n).await.is_ok() {
            if repaired {
                stats.repaired += 1;
                self.metrics.repaired(&r.device);
            }
            info!(phase = phase.name(), "enforcement verified again");
        }
    }

    async fn still_degraded(&self, r: &ShareRecord, why: &str) {
        let mut n = r.clone();
        n.phase = Phase::Degraded;
        // Capacity stays held: the pod may be gone, but only Unprepare says so.
        n.reason =
            format!("drift could not be repaired: {why}; capacity stays held until Unprepare");
        n.updated_at_ms = now_ms();
        let current = lock(&self.state).records.get(&r.key).cloned();
        if current.as_ref().map(|c| (&c.phase, &c.reason)) != Some((&n.phase, &n.reason)) {
            warn!(reason = %why, "repair failed");
            let _ = self.persist(&n).await;
        }
    }

    async fn persist(&self, r: &ShareRecord) -> Result<(), ()> {
        self.commit_durable(crate::store::Batch {
            put_shares: vec![r.clone()],
            ..Default::default()
        })
        .await
        .map_err(|e| warn!(error = %e, "persisting a reconciled share failed"))
    }
}
