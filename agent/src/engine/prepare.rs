//! Prepare: validate, authorize, admit against the ledger, persist, enforce, read back.
//!
//! A claim is all-or-nothing: when any of its allocations is refused or cannot be
//! enforced, none of it holds capacity afterwards.

use std::{collections::HashSet, time::Instant};

use shareguard_common::limiter::{LimiterError, Retry};
use shareguard_proto::v1 as pb;
use tracing::{Instrument, info, info_span, warn};

use crate::{
    audit::{AuditLine, Decision, now_rfc3339},
    error::{ClaimError, RequestError},
    ledger::{self, State},
    record::{ClaimRecord, Phase, ShareRecord},
    store::{Batch, Durable},
    sync::lock,
    validate::{ValidClaim, authorize, validate_claim},
};

use super::{Engine, judge, now_ms, spec_of};

/// What happened to one claim of a Prepare.
#[derive(Clone, Debug)]
pub struct PrepareOutcome {
    /// The claim uid as the caller sent it (the response map's key).
    pub uid: String,
    pub shares: Vec<ShareRecord>,
    pub error: Option<ClaimError>,
    pub cdi_device_ids: Vec<String>,
}

enum Admission {
    /// Same claim, same allocation, already live: no new side effects.
    Repeat(Vec<ShareRecord>),
    /// Admitted: the records, and the handle that resolves once they are durable.
    New(Vec<ShareRecord>, Durable),
}

pub(crate) const ACCOUNTED_REASON: &str =
    "accounted (not enforced): the device has no enforcement mechanism";

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
        claims: &[pb::ClaimPrepare],
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
        self.fence(epoch).await?;
        let mut out = Vec::with_capacity(claims.len());
        for (i, c) in claims.iter().enumerate() {
            let (uid, ns) = c
                .claim
                .as_ref()
                .map(|c| (c.uid.as_str(), c.namespace.as_str()))
                .unwrap_or(("", ""));
            let span = info_span!("prepare", claim = %uid, namespace = %ns, epoch);
            out.push(
                self.prepare_claim(i, c, epoch, caller_uid)
                    .instrument(span)
                    .await,
            );
        }
        Ok(out)
    }

    async fn prepare_claim(
        &self,
        index: usize,
        c: &pb::ClaimPrepare,
        epoch: u64,
        caller: u32,
    ) -> PrepareOutcome {
        let started = Instant::now();
        let checked = validate_claim(&self.cfg, index, c).and_then(|v| {
            authorize(&self.cfg, &v)?;
            Ok(v)
        });
        let out = match checked {
            Err(e) => self.refused(c, e, epoch, caller),
            Ok(valid) => {
                let _guard = self.locks.lock(&valid.claim.uid).await;
                let admission = {
                    let mut st = lock(&self.state);
                    self.admit(&mut st, &valid, epoch, caller)
                };
                match admission {
                    Err(e) => self.refused(c, e, epoch, caller),
                    Ok(Admission::Repeat(records)) => self.repeat(&valid, records, caller).await,
                    Ok(Admission::New(records, durable)) => {
                        self.enforce_new(&valid, records, durable, caller).await
                    }
                }
            }
        };
        self.metrics
            .observe_prepare(started.elapsed(), out.error.as_ref());
        out
    }

    /// Decides under the state lock: idempotency (I3), immutability, the ledger (I1).
    /// A new admission is committed to the store before the lock is released, so the
    /// next decision already counts it.
    fn admit(
        &self,
        st: &mut State,
        v: &ValidClaim,
        epoch: u64,
        caller: u32,
    ) -> Result<Admission, ClaimError> {
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
                return Ok(Admission::Repeat(live.into_iter().cloned().collect()));
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

        ledger::check_claim(&self.cfg, st, v)?;

        let claim_rec = ClaimRecord {
            claim: v.claim.clone(),
            allocation_id: v.allocation_id.clone(),
            share_keys: wanted.iter().map(|r| r.key.clone()).collect(),
            cdi_device_ids: Vec::new(),
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
        for r in &wanted {
            self.audit_share(
                r,
                Decision::Admit,
                "admitted to the ledger",
                Some(caller),
                None,
            );
        }
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
            share_id: a.share_id.clone(),
            claim: v.claim.clone(),
            allocation_id: v.allocation_id.clone(),
            request: a.request.clone(),
            driver: a.driver.clone(),
            pool: a.pool.clone(),
            device: a.device.clone(),
            consumed: a.consumed.clone(),
            policy_version: a.policy_version.clone(),
            admin_access: a.admin_access,
            target: v.target.clone(),
            // Accounting has no side effects, so its final phase is written at once; an
            // enforcing limiter first records PREPARING so a crash mid-way is explained.
            phase: if accounting {
                Phase::Accounted
            } else {
                Phase::Preparing
            },
            mechanism: if accounting {
                crate::accounting::MECHANISM.to_owned()
            } else {
                String::new()
            },
            enforced: Default::default(),
            reason: if accounting {
                ACCOUNTED_REASON.to_owned()
            } else {
                "admitted; applying the limit".to_owned()
            },
            error: None,
            epoch,
            created_at_ms: now,
            updated_at_ms: now,
            released_at_ms: None,
        }
    }

    async fn enforce_new(
        &self,
        v: &ValidClaim,
        mut records: Vec<ShareRecord>,
        durable: Durable,
        caller: u32,
    ) -> PrepareOutcome {
        // Durable before anything is applied or acknowledged (I6).
        if let Err(e) = durable.wait().await {
            return self.outcome(
                v,
                records,
                Some(ClaimError::unavailable(format!(
                    "state store flush failed: {e}"
                ))),
            );
        }
        self.publish(&records);
        let mut applied = Vec::new();
        let mut failure = None;
        for (i, r) in records.iter_mut().enumerate() {
            if r.phase != Phase::Preparing {
                continue;
            }
            match self.apply_blocking(r).await {
                Ok(e) => {
                    applied.push(r.key.clone());
                    let (phase, reason) = judge(r, &e);
                    r.mechanism = e.mechanism;
                    r.enforced = e.enforced;
                    r.phase = phase;
                    r.reason = reason;
                    r.updated_at_ms = now_ms();
                }
                Err(e) => {
                    failure = Some((i, e));
                    break;
                }
            }
        }
        if let Some((i, e)) = failure {
            return self.roll_back(v, records, applied, i, e, caller).await;
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
                    c.cdi_device_ids = ids;
                    c.updated_at_ms = now_ms();
                    c
                }),
            Err(msg) => {
                let e = LimiterError::retryable(format!("writing the claim's CDI spec: {msg}"));
                return self.roll_back(v, records, applied, 0, e, caller).await;
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
        self.outcome(v, records, None)
    }

    async fn roll_back(
        &self,
        v: &ValidClaim,
        mut records: Vec<ShareRecord>,
        applied: Vec<String>,
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
        for key in &applied {
            if let Some(r) = records.iter().find(|r| &r.key == key)
                && let Err(re) = self.remove_blocking(r).await
            {
                // The share is marked FAILED below either way; a limit left behind is
                // stricter than asked, never looser, and the next Prepare re-applies.
                warn!(share = %key, error = %re, "could not remove a limit during roll-back");
            }
        }
        let now = now_ms();
        for r in &mut records {
            r.phase = Phase::Failed;
            r.error = Some(err.clone());
            r.reason = format!("claim rolled back: {}", err.message);
            r.updated_at_ms = now;
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

    /// A repeated Prepare: counts nothing again, but re-applies enforcement to the target
    /// given now (a pod sandbox can come back with a new netns or cgroup).
    async fn repeat(
        &self,
        v: &ValidClaim,
        records: Vec<ShareRecord>,
        caller: u32,
    ) -> PrepareOutcome {
        let mut out = Vec::with_capacity(records.len());
        let mut changed = Vec::new();
        for r in records {
            if self.accounting_only(&r.device) || r.phase == Phase::Releasing {
                out.push(r);
                continue;
            }
            let mut n = r.clone();
            n.target = v.target.clone();
            match self.apply_blocking(&n).await {
                Ok(e) => {
                    let (phase, reason) = judge(&n, &e);
                    n.mechanism = e.mechanism;
                    n.enforced = e.enforced;
                    n.phase = phase;
                    n.reason = reason;
                    n.error = None;
                }
                Err(e) => {
                    n.phase = Phase::Degraded;
                    n.reason = format!("re-applying on a repeated Prepare failed: {e}");
                    n.error = Some(ClaimError::unavailable(e.message));
                }
            }
            if n != r {
                n.updated_at_ms = now_ms();
                changed.push(n.clone());
            }
            out.push(n);
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
            .map(|c| c.cdi_device_ids.clone())
            .unwrap_or_default();
        PrepareOutcome {
            uid: v.claim.uid.clone(),
            shares,
            error,
            cdi_device_ids,
        }
    }

    fn refused(
        &self,
        c: &pb::ClaimPrepare,
        e: ClaimError,
        epoch: u64,
        caller: u32,
    ) -> PrepareOutcome {
        let claim = c.claim.clone().unwrap_or_default();
        info!(error = %e, "claim refused");
        if c.allocations.is_empty() {
            self.audit_refusal(&claim, c, None, &e, epoch, caller);
        }
        for a in &c.allocations {
            self.audit_refusal(&claim, c, Some(a), &e, epoch, caller);
        }
        PrepareOutcome {
            uid: claim.uid,
            shares: Vec::new(),
            error: Some(e),
            cdi_device_ids: Vec::new(),
        }
    }

    fn audit_refusal(
        &self,
        claim: &pb::ClaimRef,
        c: &pb::ClaimPrepare,
        a: Option<&pb::DeviceAllocation>,
        e: &ClaimError,
        epoch: u64,
        caller: u32,
    ) {
        self.audit.write(&AuditLine {
            time: now_rfc3339(),
            decision: Decision::Refuse,
            reason: &e.to_string(),
            tenant: &claim.namespace,
            claim_uid: &claim.uid,
            claim_name: &claim.name,
            share_id: a.map(|a| a.share_id.as_str()).unwrap_or(""),
            device: a.map(|a| a.device.as_str()).unwrap_or(""),
            amounts: a
                .map(|a| {
                    a.consumed_capacity
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect()
                })
                .unwrap_or_default(),
            policy_version: a.map(|a| a.policy_version.as_str()).unwrap_or(""),
            allocation_id: &c.allocation_id,
            epoch,
            caller_uid: Some(caller),
            code: Some(e.code.as_str()),
        });
    }

    /// Audits a refusal of a whole Prepare or Unprepare (stale epoch, caller not allowed,
    /// batch too large): no claim of it was looked at, but the decision is still recorded.
    pub fn audit_request_refusal(
        &self,
        rpc: &str,
        caller: Option<u32>,
        epoch: u64,
        e: &RequestError,
    ) {
        let code = format!("{:?}", e.code());
        self.metrics.refused(rpc, &code);
        let caller = match e {
            RequestError::CallerNotAllowed { uid } => Some(*uid),
            _ => caller,
        };
        self.audit.write(&AuditLine {
            time: now_rfc3339(),
            decision: Decision::Refuse,
            reason: &format!("{rpc}: {e}"),
            tenant: "",
            claim_uid: "",
            claim_name: "",
            share_id: "",
            device: "",
            amounts: Default::default(),
            policy_version: "",
            allocation_id: "",
            epoch,
            caller_uid: caller,
            code: Some(&code),
        });
    }

    pub(crate) fn audit_share(
        &self,
        r: &ShareRecord,
        decision: Decision,
        reason: &str,
        caller: Option<u32>,
        code: Option<&str>,
    ) {
        self.audit.write(&AuditLine {
            time: now_rfc3339(),
            decision,
            reason,
            tenant: &r.claim.namespace,
            claim_uid: &r.claim.uid,
            claim_name: &r.claim.name,
            share_id: r.share_id.as_deref().unwrap_or(""),
            device: &r.device,
            amounts: r
                .consumed
                .iter()
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect(),
            policy_version: &r.policy_version,
            allocation_id: &r.allocation_id,
            epoch: r.epoch,
            caller_uid: caller,
            code,
        });
    }

    /// Runs the limiter on a blocking thread: limiters switch namespaces and make
    /// blocking netlink or NVML calls, which must never run on an async worker.
    pub(crate) async fn apply_blocking(
        &self,
        r: &ShareRecord,
    ) -> Result<shareguard_common::limiter::Enforcement, LimiterError> {
        let Some(l) = self.limiter(&r.device).cloned() else {
            return Err(LimiterError::permanent(format!(
                "no limiter for device {}",
                r.device
            )));
        };
        let spec = spec_of(r);
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
        let Some(l) = self.limiter(&r.device).cloned() else {
            return Ok(());
        };
        let key = r.key.clone();
        let span = info_span!("remove", share = %r.key, claim = %r.claim.uid, device = %r.device);
        tokio::task::spawn_blocking(move || span.in_scope(|| l.remove(&key)))
            .await
            .unwrap_or_else(|e| Err(LimiterError::retryable(format!("limiter task failed: {e}"))))
    }
}
