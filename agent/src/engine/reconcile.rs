//! The reconciler: on a period, re-reads every enforced share's enforcement from the
//! kernel or driver, moves a share whose enforcement drifted (a qdisc deleted by hand, a
//! class rate changed, a queue device removed, a GPU limit lifted) to DEGRADED with the reason,
//! re-applies it, and returns it to ENFORCED once the read-back matches again. Every
//! transition is persisted before it is published, like any other.
//!
//! Each pass first brings every share in line with its pod's sandbox (as the discovery
//! loop does on events), so a sandbox whose event was lost is still followed: gone, the
//! share waits again (PENDING); replaced, it is enforced on the new one. A read-back
//! that does not match asks discovery once more before it calls anything drift: an
//! interface deleted between the two is the pod moving, followed the same way. PREPARING
//! shares left by a crash are taken on the same way. UNKNOWN shares (not verifiable
//! since a restart) are re-applied: their target is the sandbox discovery finds now,
//! never a stale one.
//!
//! What it never does: free capacity. Only an Unprepare does that.

use std::time::Instant;

use tracing::{Instrument, info, info_span, warn};

use crate::{
    audit::Decision,
    record::{Phase, ShareRecord},
    sync::lock,
};

use super::{Engine, now_ms};

/// What one pass found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReconcileStats {
    pub checked: usize,
    pub drifted: usize,
    pub repaired: usize,
}

/// The phases the reconciler reads back: what was enforced, or should be again.
fn reconciled(p: Phase) -> bool {
    matches!(
        p,
        Phase::Enforced | Phase::Observed | Phase::Degraded | Phase::Unknown
    )
}

impl Engine {
    /// One pass over the live enforced shares.
    pub async fn reconcile(&self) -> ReconcileStats {
        let started = Instant::now();
        self.finish_roll_backs().await;
        let candidates: Vec<ShareRecord> = {
            let st = lock(&self.state);
            st.records
                .values()
                .filter(|r| super::sandbox::follows_sandbox(r))
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
        self.slo_check_recovery();
        stats
    }

    /// Retries the removals a failed Prepare's roll-back could not make (shares left
    /// RELEASING with `rolling_back`): once what was installed is gone, the share is
    /// FAILED with its claim's error, and its capacity is free.
    async fn finish_roll_backs(&self) {
        let pending: Vec<(String, String)> = lock(&self.state)
            .records
            .values()
            .filter(|r| r.rolling_back && r.phase == Phase::Releasing)
            .map(|r| (r.key.clone(), r.claim.uid.clone()))
            .collect();
        for (key, claim_uid) in pending {
            let span = info_span!("roll_back", share = %key, claim = %claim_uid);
            async {
                let _guard = self.locks.lock(&claim_uid).await;
                let Some(r) = lock(&self.state).records.get(&key).cloned() else {
                    return;
                };
                if !(r.rolling_back && r.phase == Phase::Releasing) {
                    return;
                }
                if let Err(e) = self.remove_blocking(&r).await {
                    warn!(error = %e, "roll-back removal failed again");
                    return;
                }
                let mut n = r.clone();
                n.updated_at_ms = now_ms();
                n.phase = Phase::Failed;
                n.rolling_back = false;
                n.set_sandboxes(Vec::new());
                // The claim's error, kept on the share since the roll-back.
                let why = r.error.as_ref().map_or("", |e| e.message.as_str());
                n.reason = format!(
                    "claim rolled back: {why}; what it had installed is removed, capacity freed"
                )
                .into();
                if self.persist_one(&n).await {
                    info!("roll-back finished");
                    self.audit_share(&n, Decision::Release, &n.reason, None, None);
                }
            }
            .instrument(span)
            .await;
        }
    }

    async fn reconcile_share(&self, key: &str, claim_uid: &str, stats: &mut ReconcileStats) {
        // A sandbox that appeared, went or changed is all this share's pass does.
        if self.converge(key, claim_uid).await {
            stats.checked += 1;
            return;
        }
        // The claim's lock: a Prepare or Unprepare of the same claim must not interleave
        // with a re-apply here.
        let guard = self.locks.lock(claim_uid).await;
        // Re-read under the lock: the share may have been released meanwhile.
        let Some(r) = lock(&self.state).records.get(key).cloned() else {
            return;
        };
        if !reconciled(r.phase) {
            return;
        }
        if r.sandbox.is_none() && self.needs(&r) != shareguard_common::limiter::Needs::Nothing {
            // Not enforced on any sandbox (host network, several pods): nothing to read back.
            return;
        }
        let Some(l) = self.limiter(&r.device) else {
            return;
        };
        stats.checked += 1;
        let spec = self.spec_of(&r);
        let verified = tokio::task::spawn_blocking(move || l.verify(&spec))
            .await
            .unwrap_or_else(|e| {
                Err(shareguard_common::limiter::LimiterError::retryable(
                    format!("verify task failed: {e}"),
                ))
            });
        let why = match &verified {
            Ok(e) => match self.judge(&r, e) {
                judged @ (Phase::Enforced | Phase::Accounted | Phase::Observed, _) => {
                    // Repaired by someone else, the kernel came back, or the device's
                    // stage changed under a share a stage pass did not reach.
                    if judged.0 != r.phase {
                        // Repaired by someone else (or the kernel came back): say so.
                        self.settle(&r, e, judged, stats, false).await;
                    }
                    return;
                }
                // The limit is in place as set, but the share's processes outnumber what
                // it holds whole (MPS bounds each client on its own): the tenant started
                // a process, nothing undid the limit, and applying it again changes
                // nothing. Not drift: no drift count (which alerts), no repair.
                (_, why) if self.judge(&r, &as_set(e)).0 == Phase::Enforced => {
                    self.outgrown(&r, e, &why).await;
                    return;
                }
                (_, why) => why,
            },
            Err(e) => e.to_string(),
        };
        // The sandbox may have gone or changed since `converge` looked: a CNI that sets
        // the pod's network up again deletes the interface the limit was on. That is
        // the pod moving, not drift: the share follows it as on any other pass.
        if !self.on_same_sandbox(&r).await {
            drop(guard);
            self.converge(key, claim_uid).await;
            return;
        }
        // Drift: record it before trying to repair, so a crash in between is explained.
        if r.phase == Phase::Enforced {
            stats.drifted += 1;
            self.metrics.drift(&r.device);
            warn!(reason = %why, "enforcement drifted");
            let mut d = r.clone();
            d.phase = Phase::Degraded;
            d.reason = format!("drift found by the reconciler: {why}; repairing").into();
            d.updated_at_ms = now_ms();
            if !self.persist_one(&d).await {
                return;
            }
            self.audit_share(&d, Decision::Drift, &d.reason, None, None);
        }
        match self.apply_blocking(&r).await {
            Ok(e) => match self.judge(&r, &e) {
                judged @ (Phase::Enforced | Phase::Accounted | Phase::Observed, _) => {
                    self.settle(&r, &e, judged, stats, true).await;
                }
                (_, why) => self.still_degraded(&r, &why, Some(&e)).await,
            },
            Err(e) => self.still_degraded(&r, &e.to_string(), None).await,
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
            format!("{reason} (repaired by the reconciler)").into()
        } else {
            reason.into()
        };
        n.mechanism = e.mechanism.as_str().into();
        n.enforced = e.enforced.clone().into();
        n.error = None;
        n.updated_at_ms = now_ms();
        if self.persist_one(&n).await {
            if repaired {
                // Audited before it is counted: whoever sees the count sees the line.
                self.audit_share(&n, Decision::Repair, &n.reason, None, None);
                stats.repaired += 1;
                self.metrics.repaired(&r.device);
                self.slo_repaired(r);
            }
            info!(phase = phase.name(), "enforcement verified again");
        }
    }

    /// Persists `r` as DEGRADED for `why` with the bound `e` read back, when that changes
    /// the record: a share whose limit holds per process and whose processes are more
    /// than one (see [`as_set`]).
    async fn outgrown(
        &self,
        r: &ShareRecord,
        e: &shareguard_common::limiter::Enforcement,
        why: &str,
    ) {
        if r.phase == Phase::Degraded && *r.reason == *why && r.enforced == e.enforced {
            return;
        }
        let mut n = r.clone();
        n.phase = Phase::Degraded;
        n.reason = why.to_owned().into();
        n.mechanism = e.mechanism.as_str().into();
        n.enforced = e.enforced.clone().into();
        n.updated_at_ms = now_ms();
        warn!(reason = %why, "the share's processes are more than its limit holds whole");
        if self.persist_one(&n).await {
            self.audit_share(&n, Decision::Degrade, &n.reason, None, None);
        }
    }

    /// Persists `r` as DEGRADED for `why`, with what was read back where the read-back
    /// worked (an MPS share with more processes than one holds more than its request:
    /// the status must show that bound, not the one read before).
    async fn still_degraded(
        &self,
        r: &ShareRecord,
        why: &str,
        read_back: Option<&shareguard_common::limiter::Enforcement>,
    ) {
        let mut n = r.clone();
        n.phase = Phase::Degraded;
        if let Some(e) = read_back {
            n.enforced = e.enforced.clone().into();
        }
        // Capacity stays held: the pod may be gone, but only Unprepare says so.
        n.reason =
            format!("drift could not be repaired: {why}; capacity stays held until Unprepare")
                .into();
        n.updated_at_ms = now_ms();
        let current = lock(&self.state).records.get(&r.key).cloned();
        if current.as_ref().map(|c| (&c.phase, &c.reason, &c.enforced))
            != Some((&n.phase, &n.reason, &n.enforced))
        {
            warn!(reason = %why, "repair failed");
            if self.persist_one(&n).await {
                self.audit_share(&n, Decision::Repair, &n.reason, None, Some("Unavailable"));
            }
        }
    }
}

/// `e` as the limit was set: each capacity held per process at its per-process figure,
/// not at the bound of the share's processes together. Judged ENFORCED, the limit itself
/// is in place and only the number of processes makes the share's bound larger.
pub(super) fn as_set(
    e: &shareguard_common::limiter::Enforcement,
) -> shareguard_common::limiter::Enforcement {
    let mut set = e.clone();
    for (name, per) in &e.per_process {
        set.enforced.insert(name.clone(), per.each);
    }
    set
}
