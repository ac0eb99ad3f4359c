//! A share follows its pod's sandbox: enforced once the sandbox is there, back to PENDING
//! (capacity held, the dead sandbox's objects removed) when it goes away, enforced again
//! on a new one, all without a call. [`Engine::step`] decides one share's next state from
//! what discovery finds; Prepare, the discovery loop and the reconciler all go through
//! it, each holding the claim's lock, and persist what it returns.

use std::time::Duration;

use shareguard_common::limiter::{LimiterError, Needs};
use tracing::{Instrument, info, info_span, warn};

use crate::{
    audit::Decision,
    discovery::{Found, Sandbox, with_unwired_note},
    error::{ClaimError, Code},
    record::{Phase, SandboxRecord, ShareRecord},
    sync::lock,
};

use super::{Engine, now_ms};

/// What [`Engine::step`] decided for one share.
#[derive(Debug)]
pub(super) enum Step {
    /// Nothing to change.
    Same,
    /// The share's next record, to persist.
    Next(ShareRecord),
    /// Applying the limit failed; the record as attempted (its sandbox set, so that
    /// whatever was installed is still known) and the error.
    Failed(ShareRecord, LimiterError),
}

/// Whether a share is brought in line with its pod's sandbox: by its phase, and never a
/// quarantined stand-in, which knows too little of its share to act on anything.
pub(super) fn follows_sandbox(r: &ShareRecord) -> bool {
    !r.quarantined
        && matches!(
            r.phase,
            Phase::Preparing
                | Phase::Pending
                | Phase::Enforced
                | Phase::Observed
                | Phase::Degraded
                | Phase::Unknown
        )
}

/// How the reason of a share begins when its limit is installed and kept, but does not
/// hold all of its pods together (see [`not_all_held`]).
pub(super) const PARTLY: &str = "not every pod of the share is held by its limit: ";

/// Why the limit installed on `sandboxes` does not hold the share as a whole, if it does
/// not: pods in the host's network namespace beside pods with their own network (no
/// per-pod limit reaches their traffic), or several pods under a limit that binds each
/// cgroup on its own. The limit stays on what it reaches either way: a tenant who starts
/// another pod takes no limit off the others.
fn not_all_held(needs: Needs, sandboxes: &[Sandbox], host_network: &[String]) -> Option<String> {
    match needs {
        Needs::Network if !host_network.is_empty() => Some(format!(
            "{PARTLY}pod(s) {} run in the host's network namespace (hostNetwork), whose traffic cannot be limited per pod; the limit holds the other {} pod(s) together; capacity held",
            host_network.join(", "),
            sandboxes.len()
        )),
        Needs::Cgroup if sandboxes.len() > 1 => Some(format!(
            "{PARTLY}{} pods run on this node, and the limit binds each pod's cgroup on its own: together they may use up to {} times the share; capacity held",
            sandboxes.len(),
            sandboxes.len()
        )),
        _ => None,
    }
}

/// What the discovery loop did in one pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscoverStats {
    pub checked: usize,
    pub changed: usize,
}

impl Engine {
    /// What the limiter of `r`'s device needs of the pod.
    pub(super) fn needs(&self, r: &ShareRecord) -> Needs {
        self.limiter(&r.device)
            .map_or(Needs::Nothing, |l| l.needs(&r.device))
    }

    /// The next state of `r` given what discovery finds now. Applies the limit to a
    /// sandbox that appeared or changed, and removes what was installed for one that is
    /// gone; persists nothing. `force`: apply even when the share looks settled (Prepare).
    pub(super) async fn step(&self, r: &ShareRecord, force: bool) -> Step {
        let needs = self.needs(r);
        if needs == Needs::Nothing {
            if !force && !matches!(r.phase, Phase::Preparing | Phase::Pending | Phase::Unknown) {
                return Step::Same;
            }
            let mut n = r.clone();
            n.set_sandboxes(Vec::new());
            return self.apply_to(n).await;
        }
        match self.find_sandbox(r, needs).await {
            Found::Ready {
                sandboxes,
                host_network,
            } => {
                let records: Vec<SandboxRecord> =
                    sandboxes.iter().map(|sb| sb.record.clone()).collect();
                let same = r.sandboxes() == records;
                let partly = not_all_held(needs, &sandboxes, &host_network);
                if same
                    && !force
                    && matches!(r.phase, Phase::Enforced | Phase::Observed | Phase::Degraded)
                {
                    // Settled on these sandboxes: drift is the reconciler's to find. Only
                    // the note on what the scans saw besides them, or which pods the
                    // limit does not hold, may have changed.
                    let was_partly = r.phase == Phase::Degraded && r.reason.starts_with(PARTLY);
                    match &partly {
                        Some(why) if was_partly && *r.reason == **why => return Step::Same,
                        Some(_) => {}
                        None if was_partly => {}
                        None => {
                            let reason = with_unwired_note(&r.reason, &sandboxes);
                            if r.phase == Phase::Enforced && *reason != *r.reason {
                                let mut n = r.clone();
                                n.reason = reason.into();
                                return Step::Next(n);
                            }
                            return Step::Same;
                        }
                    }
                }
                if !same && r.sandbox.is_some() && needs != Needs::Network {
                    // A new sandbox (or cgroup): what the old one had goes first. (The
                    // bandwidth limiter takes a pod that left off its veth itself, and
                    // keeps the others limited throughout.)
                    if let Err(e) = self.remove_blocking(r).await {
                        warn!(error = %e, "removing the limit of the pod's previous sandbox failed");
                    }
                }
                let mut n = r.clone();
                n.set_sandboxes(records);
                match self.apply_to(n).await {
                    Step::Next(mut n) if n.phase == Phase::Enforced => {
                        match partly {
                            // Installed and read back for the pods it reaches, and kept:
                            // but the share as a whole is not held.
                            Some(why) => {
                                n.phase = Phase::Degraded;
                                n.error = Some(Box::new(ClaimError::precondition(
                                    "target.pod_uids",
                                    why.clone(),
                                )));
                                n.reason = why.into();
                            }
                            None => n.reason = with_unwired_note(&n.reason, &sandboxes).into(),
                        }
                        Step::Next(n)
                    }
                    other => other,
                }
            }
            Found::Waiting(why) => {
                let reason = format!("{why}; capacity held");
                self.without_sandbox(r, Phase::Pending, reason, None).await
            }
            Found::HostNetwork { pod_uid } => {
                let reason = format!(
                    "pod {pod_uid} runs in the host's network namespace (hostNetwork): its traffic cannot be limited per pod and the host's interfaces are never touched; not enforced, capacity held"
                );
                let err = ClaimError::precondition("target.pod_uids", reason.clone());
                self.without_sandbox(r, Phase::Degraded, reason, Some(err))
                    .await
            }
        }
    }

    /// What discovery finds now for `r`'s pods (kubelet's list of them, where it has one).
    async fn find_sandbox(&self, r: &ShareRecord, needs: Needs) -> Found {
        let d = self.discovery.clone();
        let (mut target, current, claim) = (r.target.clone(), r.sandboxes(), r.claim.clone());
        tokio::task::spawn_blocking(move || {
            match d.claim_pods(&claim, &target.pod_uids) {
                Ok(pods) => target.pod_uids = pods,
                Err(why) => return Found::Waiting(why),
            }
            d.find(&target, needs, &current)
        })
        .await
        .unwrap_or_else(|e| Found::Waiting(format!("discovery task failed: {e}")))
    }

    /// Whether discovery still finds exactly the sandbox `r` is enforced on (always true
    /// for a share that needs nothing of its pod).
    pub(super) async fn on_same_sandbox(&self, r: &ShareRecord) -> bool {
        let needs = self.needs(r);
        if needs == Needs::Nothing {
            return true;
        }
        match self.find_sandbox(r, needs).await {
            Found::Ready { sandboxes, .. } => sandboxes
                .iter()
                .map(|sb| &sb.record)
                .eq(r.sandboxes().iter()),
            _ => false,
        }
    }

    /// Applies `n` (its sandbox set) and judges the read-back.
    async fn apply_to(&self, mut n: ShareRecord) -> Step {
        match self.apply_blocking(&n).await {
            Ok(e) => {
                let (phase, reason) = self.judge(&n, &e);
                n.mechanism = e.mechanism.into();
                n.enforced = e.enforced.into();
                n.phase = phase;
                n.reason = reason.into();
                n.error = None;
                Step::Next(n)
            }
            Err(e) => Step::Failed(n, e),
        }
    }

    /// `r` with no sandbox to enforce on: whatever was installed for one is removed, and
    /// the share says why it is not enforced.
    async fn without_sandbox(
        &self,
        r: &ShareRecord,
        phase: Phase,
        reason: String,
        error: Option<ClaimError>,
    ) -> Step {
        if r.sandbox.is_none() && r.phase == phase && *r.reason == *reason {
            return Step::Same;
        }
        let mut n = r.clone();
        if (r.sandbox.is_some()
            || matches!(
                r.phase,
                Phase::Enforced | Phase::Observed | Phase::Degraded | Phase::Unknown
            ))
            && let Err(e) = self.remove_blocking(r).await
        {
            // Kept on the record, so the next pass tries the removal again.
            n.phase = Phase::Degraded;
            n.reason = format!(
                "the pod's sandbox is gone, and removing what was installed for it failed: {e}; retrying, capacity held"
            ).into();
            n.error = Some(Box::new(ClaimError::unavailable(e.message)));
            return if n == *r { Step::Same } else { Step::Next(n) };
        }
        n.phase = phase;
        n.reason = reason.into();
        n.error = error.map(Box::new);
        n.set_sandboxes(Vec::new());
        n.enforced.clear();
        Step::Next(n)
    }

    /// Brings share `key` in line with its pod's sandbox, under its claim's lock, and
    /// persists and publishes what changed. Returns whether it changed.
    pub(super) async fn converge(&self, key: &str, claim_uid: &str) -> bool {
        let _guard = self.locks.lock(claim_uid).await;
        let Some(r) = lock(&self.state).records.get(key).cloned() else {
            return false;
        };
        if !follows_sandbox(&r) || self.accounting_only(&r.device) {
            return false;
        }
        let next = match self.step(&r, false).await {
            Step::Same => return false,
            Step::Next(n) => n,
            Step::Failed(mut n, e) => {
                n.phase = Phase::Degraded;
                n.reason = format!(
                    "enforcing on the pod's sandbox failed: {e}; retried on the next rescan, capacity held"
                ).into();
                n.error = Some(Box::new(ClaimError {
                    code: Code::Unavailable,
                    field: String::new(),
                    message: e.message,
                    retryable: true,
                }));
                n
            }
        };
        if next == r {
            return false;
        }
        info!(
            from = r.phase.name(),
            to = next.phase.name(),
            reason = %next.reason,
            "share followed its pod's sandbox"
        );
        match self.persist_change(&r, next, Decision::Sandbox, None).await {
            Some(next) => {
                self.metrics
                    .sandbox_transition(&next.device, next.phase.name());
                true
            }
            None => false,
        }
    }

    /// The tail of every path that moves a share on its own (the sandbox loop, a stage
    /// change): `next`, stamped, made durable, then audited under `decision` as
    /// "FROM -> TO: reason". None when the store refused it (logged; the loops retry).
    pub(super) async fn persist_change(
        &self,
        before: &ShareRecord,
        mut next: ShareRecord,
        decision: Decision,
        caller: Option<u32>,
    ) -> Option<ShareRecord> {
        next.updated_at_ms = now_ms();
        if !self.persist_one(&next).await {
            return None;
        }
        self.audit_share(
            &next,
            decision,
            &format!(
                "{} -> {}: {}",
                before.phase.name(),
                next.phase.name(),
                next.reason
            ),
            caller,
            None,
        );
        Some(next)
    }

    /// Persists one record and publishes it; false (logged) when the store refused it.
    pub(super) async fn persist_one(&self, r: &ShareRecord) -> bool {
        match self
            .commit_durable(crate::store::Batch {
                put_shares: vec![r.clone()],
                ..Default::default()
            })
            .await
        {
            Ok(()) => true,
            Err(e) => {
                warn!(share = %r.key, error = %e, "persisting a share's new state failed");
                false
            }
        }
    }

    /// One pass of the discovery loop over every share that follows a sandbox.
    pub async fn discover(&self) -> DiscoverStats {
        self.discovery.refresh_roots();
        let candidates: Vec<(String, String)> = {
            let st = lock(&self.state);
            st.records
                .values()
                .filter(|r| follows_sandbox(r))
                .filter(|r| !self.accounting_only(&r.device))
                .map(|r| (r.key.clone(), r.claim.uid.clone()))
                .collect()
        };
        let mut stats = DiscoverStats::default();
        for (key, claim) in candidates {
            stats.checked += 1;
            let span = info_span!("discover", share = %key, claim = %claim);
            if self.converge(&key, &claim).instrument(span).await {
                stats.changed += 1;
            }
        }
        self.slo_check_recovery();
        stats
    }

    /// Wakes the discovery loop.
    pub fn kick(&self) {
        self.kick.notify_one();
    }

    /// Runs the discovery loop until the process ends: a pass on every kernel event
    /// (coalesced while a pass runs) and every `period`.
    pub async fn discovery_loop(self: std::sync::Arc<Self>, period: Duration) {
        crate::discovery::watch::spawn(self.discovery.clone(), self.kick.clone());
        loop {
            let s = self.discover().await;
            if s.changed > 0 {
                info!(
                    checked = s.checked,
                    changed = s.changed,
                    "pod discovery pass"
                );
            }
            // A pod whose verdict was put off (by this pass or by a Prepare meanwhile)
            // is looked at again when it is due, besides events and the period.
            let mut due: Option<std::time::Instant> = None;
            loop {
                if let Some(at) = self.discovery.take_recheck() {
                    due = Some(due.map_or(at, |d| d.min(at)));
                }
                let wait = due.map_or(period, |at| {
                    at.saturating_duration_since(std::time::Instant::now())
                        .min(period)
                });
                tokio::select! {
                    () = self.kick.notified() => break,
                    () = self.discovery.recheck_set() => {}
                    () = tokio::time::sleep(wait) => break,
                }
            }
        }
    }
}
