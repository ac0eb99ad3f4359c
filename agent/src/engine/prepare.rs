//! Prepare: validate, authorize, admit against the ledger, persist, enforce, read back.
//!
//! A claim is all-or-nothing: when any of its allocations is refused or cannot be
//! enforced, none of it holds capacity afterwards.

use std::{collections::HashSet, time::Instant};

use shareguard_common::limiter::{LimiterError, Retry};
use tracing::{Instrument, info, info_span, warn};

use crate::{
    audit::Decision,
    discovery::kubelet::Snapshot,
    error::{ClaimError, RequestError},
    ledger::{self, State},
    record::{ClaimRecord, Name, Phase, ShareRecord},
    request,
    store::{Batch, Durable},
    sync::lock,
    validate::{ValidClaim, authorize, validate_claim},
};

use super::{Engine, audit::allocation_at_fault, now_ms, sandbox::Step};

/// What happened to one claim of a Prepare.
#[derive(Clone, Debug)]
pub struct PrepareOutcome {
    /// The claim uid as the caller sent it (the response map's key).
    pub uid: String,
    pub shares: Vec<ShareRecord>,
    pub error: Option<ClaimError>,
    pub cdi_device_ids: Vec<String>,
    /// Each share's own CDI device id (a GPU share's), in `shares` order.
    pub share_cdi_ids: Vec<Option<String>>,
}

enum Admission {
    /// Same claim, same allocation, already live: no new side effects.
    Repeat(Vec<ShareRecord>),
    /// Admitted: the records, and the handle that resolves once they are durable.
    New(Vec<ShareRecord>, Durable),
}

impl Engine {
    pub(crate) fn check_batch(
        &self,
        field: &'static str,
        count: usize,
    ) -> Result<(), RequestError> {
        let max = self.cfg.agent.max_claims_per_request;
        if count > max {
            return Err(RequestError::BatchTooLarge { field, count, max });
        }
        Ok(())
    }

    pub async fn prepare(
        &self,
        epoch: u64,
        claims: &[request::ClaimPrepare],
        caller_uid: u32,
    ) -> Result<Vec<PrepareOutcome>, RequestError> {
        self.check_batch("claims", claims.len())?;
        let mut seen = HashSet::new();
        for (i, c) in claims.iter().enumerate() {
            let uid = c.claim.as_ref().map(|c| c.uid.as_str()).unwrap_or("");
            if !uid.is_empty() && !seen.insert(uid) {
                return Err(RequestError::Invalid {
                    field: format!("claims[{i}].claim.uid"),
                    message: format!("{uid:?} appears twice in the request"),
                });
            }
        }
        // Every claim is checked first: a request none of whose claims is valid changes
        // nothing, so it need not wait for its epoch to be durable.
        let checked: Vec<Result<ValidClaim, ClaimError>> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| {
                validate_claim(&self.cfg, i, c).and_then(|v| {
                    authorize(&self.cfg, &v)?;
                    Ok(v)
                })
            })
            .collect();
        if checked.iter().any(Result::is_ok) {
            self.fence(epoch).await?;
        } else {
            self.check_epoch(epoch)?;
        }
        let mut out = Vec::with_capacity(claims.len());
        for (i, (c, checked)) in claims.iter().zip(checked).enumerate() {
            let (uid, ns) = c
                .claim
                .as_ref()
                .map(|c| (c.uid.as_str(), c.namespace.as_str()))
                .unwrap_or(("", ""));
            let span = info_span!("prepare", claim = %uid, namespace = %ns, epoch);
            let mut outcome = self
                .prepare_claim(c, checked, epoch, caller_uid)
                .instrument(span)
                .await;
            if outcome.uid.is_empty() {
                outcome.uid = unnamed_claim(i);
            }
            out.push(outcome);
        }
        Ok(out)
    }

    async fn prepare_claim(
        &self,
        c: &request::ClaimPrepare,
        checked: Result<ValidClaim, ClaimError>,
        epoch: u64,
        caller: u32,
    ) -> PrepareOutcome {
        let started = Instant::now();
        let out = match checked {
            Err(e) => self.refused(c, e, epoch, caller),
            Ok(mut valid) => match self.verify_hints(&mut valid).await {
                Err(e) => self.refused(c, e, epoch, caller),
                Ok(()) => {
                    let _guard = self.locks.lock(&valid.claim.uid).await;
                    // Read (when it changed) before the ledger's lock, which every
                    // other Prepare waits on.
                    let kubelet = self.discovery.kubelet().snapshot();
                    let admission = {
                        let mut st = lock(&self.state);
                        self.admit(&mut st, &kubelet, &valid, epoch)
                    };
                    match admission {
                        Err(e) => self.refused(c, e, epoch, caller),
                        Ok(Admission::Repeat(records)) => {
                            self.repeat(&valid, records, caller).await
                        }
                        Ok(Admission::New(records, durable)) => {
                            self.enforce_new(&valid, records, durable, caller).await
                        }
                    }
                }
            },
        };
        let took = started.elapsed();
        self.metrics.observe_prepare(took, out.error.as_ref());
        self.slo_prepared(c, took, out.error.as_ref(), &out.shares);
        out
    }

    /// Verifies the caller's netns and cgroup hints against the pods' sandboxes (I9) and
    /// keeps them in the form they are remembered in.
    async fn verify_hints(&self, v: &mut ValidClaim) -> Result<(), ClaimError> {
        if v.netns_path.is_none() && v.target.cgroup_paths().is_empty() {
            return Ok(());
        }
        let d = self.discovery.clone();
        let field = format!("claims[{}].target", v.index);
        let (pods, netns, cgroups) = (
            v.target.pod_uids.clone(),
            v.netns_path.clone(),
            v.target.cgroup_paths().to_vec(),
        );
        let (inode, kept) = tokio::task::spawn_blocking(move || {
            d.verify_hints(&field, &pods, netns.as_deref(), &cgroups)
        })
        .await
        .map_err(|e| ClaimError::internal(format!("hint check failed: {e}")))??;
        v.target.set_verified(inode, kept);
        Ok(())
    }

    /// Decides under the state lock: idempotency (I3), immutability, the ledger (I1).
    /// A new admission is committed to the store before the lock is released, so the
    /// next decision already counts it.
    fn admit(
        &self,
        st: &mut State,
        kubelet: &Snapshot,
        v: &ValidClaim,
        epoch: u64,
    ) -> Result<Admission, ClaimError> {
        // The fence again, where it matters: a higher epoch may have been accepted while
        // this request waited (I4).
        if epoch < st.epoch {
            return Err(ClaimError::stale_epoch(epoch, st.epoch));
        }
        let now = now_ms();
        let wanted: Vec<ShareRecord> = v
            .allocs
            .iter()
            .map(|a| self.new_record(v, a, epoch, now))
            .collect();
        let cfield = format!("claims[{}]", v.index);

        if let Some(cr) = st.claims.get(&v.claim.uid) {
            // A claim uid names one object in one namespace; the same uid with another
            // namespace or name is a different caller's mistake, never a repeat of it.
            if cr.claim.namespace != v.claim.namespace || cr.claim.name != v.claim.name {
                return Err(ClaimError::conflict(
                    format!("{cfield}.claim.uid"),
                    format!(
                        "claim uid {} is already known as another claim; a uid belongs to one namespace and name",
                        v.claim.uid
                    ),
                ));
            }
            let live: Vec<&ShareRecord> = cr
                .share_keys
                .iter()
                .filter_map(|k| st.records.get(k))
                .filter(|r| r.phase.holds_capacity())
                .collect();
            if !live.is_empty() {
                if let Some(r) = live.iter().find(|r| r.rolling_back) {
                    return Err(ClaimError::unavailable(format!(
                        "share {} of this claim is still being rolled back from a failed Prepare; retry once it is FAILED",
                        r.key
                    )));
                }
                if let Some(r) = live.iter().find(|r| r.phase == Phase::Releasing) {
                    return Err(ClaimError::precondition(
                        format!("{cfield}.claim.uid"),
                        format!(
                            "share {} of this claim is being released; repeat the Unprepare, then Prepare again",
                            r.key
                        ),
                    ));
                }
                if cr.allocation_id != v.allocation_id {
                    return Err(ClaimError::precondition(
                        format!("{cfield}.allocation_id"),
                        format!(
                            "claim is prepared with allocation {:?}; Unprepare it before preparing allocation {:?}",
                            cr.allocation_id, v.allocation_id
                        ),
                    ));
                }
                let same = live.len() == wanted.len()
                    && wanted
                        .iter()
                        .all(|w| live.iter().any(|l| l.same_allocation(w)));
                if !same {
                    return Err(ClaimError::conflict(
                        format!("{cfield}.allocations"),
                        format!(
                            "allocation results are immutable: allocation {:?} of this claim was prepared with other devices or amounts",
                            v.allocation_id
                        ),
                    ));
                }
                // The claim's reserved pods may have changed since (a caller may prepare
                // a claim again with the pods reserved now; kubelet itself prepares it
                // once per node, and discovery reads the later pods from its
                // checkpoint): the shares follow the pods named now.
                let mut records: Vec<ShareRecord> = live.into_iter().cloned().collect();
                // kubelet's Prepare of a share the binding gate admitted: from now on
                // only kubelet's Unprepare releases it.
                if !v.pre_bind {
                    for r in &mut records {
                        r.pre_bind = false;
                    }
                }
                if records
                    .iter()
                    .any(|r| r.target.pod_uids != v.target.pod_uids)
                {
                    pods_of_own_namespace(st, kubelet, v, &cfield)?;
                    for r in &mut records {
                        r.target.pod_uids.clone_from(&v.target.pod_uids);
                    }
                }
                return Ok(Admission::Repeat(records));
            }
        }

        for (a, w) in v.allocs.iter().zip(&wanted) {
            let Some(old) = st.records.get(&a.key) else {
                continue;
            };
            let field = format!("{cfield}.allocations[{}].share_id", a.index);
            if old.claim.uid != v.claim.uid {
                return Err(ClaimError::conflict(
                    field,
                    format!(
                        "shareID {} already belongs to claim {}/{} ({})",
                        a.key, old.claim.namespace, old.claim.name, old.claim.uid
                    ),
                ));
            }
            if !old.same_allocation(w) {
                return Err(ClaimError::conflict(
                    field,
                    format!(
                        "shareID {} was prepared with another device or amount: allocation results are immutable",
                        a.key
                    ),
                ));
            }
        }

        pods_of_own_namespace(st, kubelet, v, &cfield)?;

        ledger::check_claim(&self.cfg, st, v)?;

        let claim_rec = ClaimRecord {
            claim: v.claim.clone(),
            allocation_id: v.allocation_id.as_str().into(),
            share_keys: wanted.iter().map(|r| r.key.clone()).collect(),
            cdi_device_ids: Box::default(),
            updated_at_ms: now,
        };
        let durable = self.commit_locked(
            st,
            Batch {
                put_shares: wanted.clone(),
                put_claims: vec![claim_rec],
                ..Default::default()
            },
        )?;
        self.slo_admitted(&wanted);
        Ok(Admission::New(wanted, durable))
    }

    fn new_record(
        &self,
        v: &ValidClaim,
        a: &crate::validate::ValidAlloc,
        epoch: u64,
        now: u64,
    ) -> ShareRecord {
        let accounting = self.accounting_only(&a.device);
        ShareRecord {
            key: a.key.clone(),
            shared: a.share_id.is_some(),
            claim: v.claim.clone(),
            allocation_id: v.allocation_id.as_str().into(),
            request: a.request.as_str().into(),
            driver: a.driver.as_str().into(),
            pool: a.pool.as_str().into(),
            device: a.device.as_str().into(),
            consumed: a.consumed.clone().into(),
            policy_version: a.policy_version.as_str().into(),
            admin_access: a.admin_access,
            target: v.target.clone(),
            sandbox: None,
            more_sandboxes: None,
            device_kind: self
                .cfg
                .device(&a.device)
                .map(|d| d.kind.as_str().into())
                .unwrap_or_default(),
            // Accounting has no side effects, so its final phase is written at once; an
            // enforcing limiter first records PREPARING so a crash mid-way is explained.
            phase: if accounting {
                Phase::Accounted
            } else {
                Phase::Preparing
            },
            mechanism: if accounting {
                crate::accounting::MECHANISM.into()
            } else {
                Name::default()
            },
            enforced: Default::default(),
            reason: if accounting {
                crate::record::reasons::ACCOUNTED.into()
            } else {
                crate::record::reasons::ADMITTED.into()
            },
            error: None,
            epoch,
            created_at_ms: now,
            updated_at_ms: now,
            released_at_ms: None,
            condition_since_ms: now,
            quarantined: false,
            rolling_back: false,
            pre_bind: v.pre_bind,
        }
    }

    async fn enforce_new(
        &self,
        v: &ValidClaim,
        mut records: Vec<ShareRecord>,
        durable: Durable,
        caller: u32,
    ) -> PrepareOutcome {
        // Durable before anything is applied or acknowledged (I6), and audited as
        // admitted only then.
        if let Err(e) = durable.wait().await {
            return self.outcome(
                v,
                records,
                Some(ClaimError::unavailable(format!(
                    "state store flush failed: {e}"
                ))),
            );
        }
        for r in &records {
            self.audit_share(
                r,
                Decision::Admit,
                "admitted to the ledger",
                Some(caller),
                None,
            );
        }
        self.publish(&records);
        let mut applied = Vec::new();
        let mut failure = None;
        for (i, r) in records.iter_mut().enumerate() {
            if r.phase != Phase::Preparing {
                continue;
            }
            match self.step(r, true).await {
                Step::Next(mut n) => {
                    n.updated_at_ms = now_ms();
                    *r = n;
                    applied.push(r.key.clone());
                }
                Step::Same => applied.push(r.key.clone()),
                Step::Failed(n, e) => {
                    *r = n;
                    failure = Some((i, e));
                    break;
                }
            }
        }
        if let Some((i, e)) = failure {
            return self.roll_back(v, records, i, e, caller).await;
        }
        if applied.is_empty() {
            // Accounting only: the admission itself was the final, durable write.
            return self.outcome(v, records, None);
        }
        // The claim's CDI spec (GPU shares) is written before the result is persisted, so
        // an acknowledged claim always has its spec; its ids go into the same batch.
        let claim_rec = match self.write_cdi(&v.claim.uid, &records) {
            Ok(ids) if ids.is_empty() => None,
            Ok(ids) => lock(&self.state)
                .claims
                .get(&v.claim.uid)
                .cloned()
                .map(|mut c| {
                    c.cdi_device_ids = ids.into_boxed_slice();
                    c.updated_at_ms = now_ms();
                    c
                }),
            Err(msg) => {
                let e = LimiterError::retryable(format!("writing the claim's CDI spec: {msg}"));
                return self.roll_back(v, records, 0, e, caller).await;
            }
        };
        let changed: Vec<ShareRecord> = records
            .iter()
            .filter(|r| applied.contains(&r.key))
            .cloned()
            .collect();
        if let Err(e) = self
            .commit_durable(Batch {
                put_shares: changed,
                put_claims: claim_rec.into_iter().collect(),
                ..Default::default()
            })
            .await
        {
            return self.outcome(v, records, Some(e.into()));
        }
        for r in records.iter().filter(|r| applied.contains(&r.key)) {
            self.audit_share(r, Decision::Admit, &r.reason, Some(caller), None);
        }
        if records.iter().any(|r| r.phase == Phase::Pending) {
            // The sandbox may appear between this look and the next event: look again.
            self.kick();
        }
        self.outcome(v, records, None)
    }

    async fn roll_back(
        &self,
        v: &ValidClaim,
        mut records: Vec<ShareRecord>,
        failed: usize,
        e: LimiterError,
        caller: u32,
    ) -> PrepareOutcome {
        let field = format!("claims[{}].allocations[{}]", v.index, failed);
        let err = match e.retry {
            Retry::Retryable => ClaimError {
                code: crate::error::Code::Unavailable,
                field,
                message: e.message.clone(),
                retryable: true,
            },
            Retry::Permanent => ClaimError::precondition(field, e.message.clone()),
        };
        warn!(error = %err, "enforcement failed; rolling the claim back");
        // Every share of the claim, the failed one included: a failed apply can have
        // installed part of its limit (an install record, a qdisc, a queue device, a GPU table
        // entry), and a FAILED share holds nothing. Removal is idempotent.
        let mut left = HashSet::new();
        let installs_nothing = |device: &str| {
            self.accounting_only(device)
                || self
                    .limiter(device)
                    .is_some_and(|l| l.failed_apply_installs_nothing())
        };
        for r in records.iter().filter(|r| !installs_nothing(&r.device)) {
            if let Err(re) = self.remove_blocking(r).await {
                // What is left has an owner: the share stays RELEASING, capacity held,
                // and the reconciler removes it (see `finish_roll_backs`).
                warn!(share = %r.key, error = %re, "could not remove a limit during roll-back; retrying later");
                left.insert(r.key.clone());
            }
        }
        let now = now_ms();
        for r in &mut records {
            r.error = Some(Box::new(err.clone()));
            r.enforced.clear();
            r.updated_at_ms = now;
            if left.contains(&r.key) {
                r.phase = Phase::Releasing;
                r.rolling_back = true;
                r.reason = format!(
                    "claim rolled back: {}; removing what was installed failed, retrying, capacity held",
                    err.message
                ).into();
            } else {
                r.phase = Phase::Failed;
                r.reason = format!("claim rolled back: {}", err.message).into();
                r.set_sandboxes(Vec::new());
            }
        }
        if let Err(se) = self
            .commit_durable(Batch {
                put_shares: records.clone(),
                ..Default::default()
            })
            .await
        {
            return self.outcome(v, records, Some(se.into()));
        }
        for r in &records {
            self.audit_share(
                r,
                Decision::Fail,
                &err.message,
                Some(caller),
                Some(err.code.as_str()),
            );
        }
        self.outcome(v, records, Some(err))
    }

    /// A repeated Prepare: counts nothing again, but brings each share in line with its
    /// pod's sandbox as it is now (kubelet repeats a Prepare when it sets a sandbox up
    /// again).
    async fn repeat(
        &self,
        v: &ValidClaim,
        records: Vec<ShareRecord>,
        caller: u32,
    ) -> PrepareOutcome {
        let mut out = Vec::with_capacity(records.len());
        let mut changed = Vec::new();
        for r in records {
            // `r` may name other pods than the stored record (see `admit`).
            let stored = lock(&self.state).records.get(&r.key).cloned();
            if self.accounting_only(&r.device) || !super::sandbox::follows_sandbox(&r) {
                if stored.as_ref() != Some(&r) {
                    let mut n = r;
                    n.updated_at_ms = now_ms();
                    changed.push(n.clone());
                    out.push(n);
                } else {
                    out.push(r);
                }
                continue;
            }
            // Forced: a kubelet that repeats a Prepare expects the limit to be in place,
            // so one that drifted is put back now rather than at the next reconcile.
            let n = match self.step(&r, true).await {
                Step::Same => r.clone(),
                Step::Next(n) => n,
                Step::Failed(mut n, e) => {
                    n.phase = Phase::Degraded;
                    n.reason = format!("re-applying on a repeated Prepare failed: {e}").into();
                    n.error = Some(Box::new(ClaimError::unavailable(e.message)));
                    n
                }
            };
            if stored.as_ref() != Some(&n) {
                let mut n = n;
                n.updated_at_ms = now_ms();
                changed.push(n.clone());
                out.push(n);
            } else {
                out.push(r);
            }
        }
        // The spec may have been removed by hand or lost with a tmpfs /var/run: a repeated
        // Prepare puts it back (same file, same ids).
        if let Err(msg) = self.write_cdi(&v.claim.uid, &out) {
            warn!(error = %msg, "rewriting the claim's CDI spec failed");
            return self.outcome(
                v,
                out,
                Some(ClaimError::unavailable(format!(
                    "writing the claim's CDI spec: {msg}"
                ))),
            );
        }
        // Flush even when nothing changed: the first attempt may have been answered with
        // a flush error, and this answer must not acknowledge anything not yet durable.
        let res = if changed.is_empty() {
            self.barrier().await
        } else {
            self.commit_durable(Batch {
                put_shares: changed,
                ..Default::default()
            })
            .await
        };
        if let Err(e) = res {
            return self.outcome(v, out, Some(e.into()));
        }
        for r in &out {
            self.audit_share(
                r,
                Decision::Repeat,
                "repeated Prepare: stored result returned",
                Some(caller),
                None,
            );
        }
        info!("repeated Prepare answered from the store");
        self.outcome(v, out, None)
    }

    fn outcome(
        &self,
        v: &ValidClaim,
        shares: Vec<ShareRecord>,
        error: Option<ClaimError>,
    ) -> PrepareOutcome {
        let cdi_device_ids = lock(&self.state)
            .claims
            .get(&v.claim.uid)
            .map(|c| c.cdi_device_ids.to_vec())
            .unwrap_or_default();
        let share_cdi_ids = shares
            .iter()
            .map(|r| self.share_cdi_id(r, &cdi_device_ids))
            .collect();
        PrepareOutcome {
            uid: v.claim.uid.clone(),
            shares,
            error,
            cdi_device_ids,
            share_cdi_ids,
        }
    }

    fn refused(
        &self,
        c: &request::ClaimPrepare,
        e: ClaimError,
        epoch: u64,
        caller: u32,
    ) -> PrepareOutcome {
        let claim = c.claim.clone().unwrap_or_default();
        info!(error = %e, "claim refused");
        // One line per refused claim, however many allocations it names: a request's
        // lines are then bounded by its claim count, which is checked before anything.
        self.audit_refusal(&claim, c, allocation_at_fault(c, &e), &e, epoch, caller);
        PrepareOutcome {
            uid: claim.uid,
            shares: Vec::new(),
            error: Some(e),
            cdi_device_ids: Vec::new(),
            share_cdi_ids: Vec::new(),
        }
    }

    /// Runs the limiter on a blocking thread: limiters switch namespaces and make
    /// blocking netlink or NVML calls, which must never run on an async worker.
    pub(crate) async fn apply_blocking(
        &self,
        r: &ShareRecord,
    ) -> Result<shareguard_common::limiter::Enforcement, LimiterError> {
        let Some(l) = self.limiter(&r.device) else {
            return Err(LimiterError::permanent(format!(
                "no limiter for device {}",
                r.device
            )));
        };
        let spec = self.spec_of(r);
        let span = info_span!("apply", share = %r.key, claim = %r.claim.uid, device = %r.device);
        let started = Instant::now();
        let res = tokio::task::spawn_blocking(move || span.in_scope(|| l.apply(&spec)))
            .await
            .unwrap_or_else(|e| Err(LimiterError::retryable(format!("limiter task failed: {e}"))));
        self.metrics.enforced_in(&r.device, started.elapsed());
        match &res {
            Ok(e) => {
                info!(share = %r.key, claim = %r.claim.uid, mechanism = %e.mechanism, "limit applied")
            }
            Err(e) => {
                warn!(share = %r.key, claim = %r.claim.uid, error = %e, "applying the limit failed")
            }
        }
        res
    }

    pub(crate) async fn remove_blocking(&self, r: &ShareRecord) -> Result<(), LimiterError> {
        let Some(l) = self.limiter(&r.device) else {
            return Ok(());
        };
        let key = r.key.clone();
        let span = info_span!("remove", share = %r.key, claim = %r.claim.uid, device = %r.device);
        tokio::task::spawn_blocking(move || span.in_scope(|| l.remove(&key)))
            .await
            .unwrap_or_else(|e| Err(LimiterError::retryable(format!("limiter task failed: {e}"))))
    }
}

/// A pod uses claims of its own namespace only: a pod already named by a live claim of
/// another namespace, or that kubelet runs with a claim of another namespace, is not
/// this claim's (it would point limits, and the watchdog's terminations, at another
/// tenant's pod).
fn pods_of_own_namespace(
    st: &crate::ledger::State,
    kubelet: &Snapshot,
    v: &ValidClaim,
    cfield: &str,
) -> Result<(), ClaimError> {
    for (i, pod) in v.target.pod_uids.iter().enumerate() {
        let field = || format!("{cfield}.target.pod_uids[{i}]");
        if let Some(ns) = st.pod_namespaces(pod).find(|ns| *ns != v.claim.namespace) {
            return Err(ClaimError::denied(
                field(),
                format!(
                    "pod {pod} is named by a live claim of namespace {ns}; a pod only uses claims of its own namespace"
                ),
            ));
        }
        if let Some(ns) = kubelet
            .namespaces_of_pod(pod)
            .into_iter()
            .find(|ns| *ns != v.claim.namespace)
        {
            return Err(ClaimError::denied(
                field(),
                format!(
                    "kubelet runs pod {pod} with a claim of namespace {ns}; a pod only uses claims of its own namespace"
                ),
            ));
        }
    }
    Ok(())
}

/// The key a claim with no uid is answered under: its place in the request, which no
/// uid can collide with, so that two such claims are refused one by one rather than
/// merged under `""` in the response's map.
pub(crate) fn unnamed_claim(index: usize) -> String {
    format!("claims[{index}]")
}
