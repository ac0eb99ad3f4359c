//! Unprepare: RELEASING (persisted) -> limiter removed -> RELEASED (tombstone), freeing
//! the capacity exactly once. Releasing an unknown or already released claim succeeds.

use std::collections::HashSet;

use tracing::{Instrument, info, info_span};

use crate::{
    audit::{AuditLine, Decision, now_rfc3339},
    error::{ClaimError, RequestError},
    record::{Phase, ShareRecord},
    request,
    store::Batch,
    sync::lock,
    validate::validate_claim_uid,
};

use super::{Engine, now_ms};

impl Engine {
    /// Returns, per claim in request order, the claim uid and its error (None: released).
    /// With `only_pre_bind`, a claim is released only while all its live shares are
    /// still the binding gate's (`pre_bind`), not kubelet's.
    pub async fn unprepare(
        &self,
        epoch: u64,
        claims: &[request::ClaimRef],
        caller_uid: u32,
        only_pre_bind: bool,
    ) -> Result<Vec<(String, Option<ClaimError>)>, RequestError> {
        self.check_batch("claims", claims.len())?;
        let mut seen = HashSet::new();
        for (i, c) in claims.iter().enumerate() {
            if !c.uid.is_empty() && !seen.insert(c.uid.as_str()) {
                return Err(RequestError::Invalid {
                    field: format!("claims[{i}].uid"),
                    message: format!("{:?} appears twice in the request", c.uid),
                });
            }
        }
        // Checked first, as for Prepare.
        let checked: Vec<Result<(), ClaimError>> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| validate_claim_uid(&format!("claims[{i}]"), c))
            .collect();
        if checked.iter().any(Result::is_ok) {
            self.fence(epoch).await?;
        } else {
            self.check_epoch(epoch)?;
        }
        let mut out = Vec::with_capacity(claims.len());
        for (i, (c, checked)) in claims.iter().zip(checked).enumerate() {
            let span = info_span!("unprepare", claim = %c.uid, namespace = %c.namespace, epoch);
            let res = async {
                if let Err(e) = checked {
                    self.audit_unprepare_refusal(c, &e, epoch, caller_uid);
                    return Err(e);
                }
                let released = self
                    .release_claim(&c.uid, epoch, caller_uid, only_pre_bind)
                    .await;
                // A FailedPrecondition here is a refusal decided before anything changed
                // (an epoch gone stale at the claim, a claim kubelet took over under
                // only_pre_bind): audited as the checks above are.
                if let Err(e) = &released
                    && e.code == crate::error::Code::FailedPrecondition
                {
                    self.audit_unprepare_refusal(c, e, epoch, caller_uid);
                }
                released
            }
            .instrument(span)
            .await;
            let key = if c.uid.is_empty() {
                super::prepare::unnamed_claim(i)
            } else {
                c.uid.clone()
            };
            out.push((key, res.err()));
        }
        Ok(out)
    }

    fn audit_unprepare_refusal(
        &self,
        c: &request::ClaimRef,
        e: &ClaimError,
        epoch: u64,
        caller: u32,
    ) {
        self.metrics.refused("Unprepare", e.reason());
        self.audit.write(&AuditLine {
            time: now_rfc3339(),
            decision: Decision::Refuse,
            reason: &format!("Unprepare: {e}"),
            tenant: &c.namespace,
            claim_uid: &c.uid,
            claim_name: &c.name,
            share_id: "",
            device: "",
            amounts: Default::default(),
            policy_version: "",
            allocation_id: "",
            epoch,
            caller_uid: Some(caller),
            code: Some(e.code.as_str()),
        });
    }

    async fn release_claim(
        &self,
        uid: &str,
        epoch: u64,
        caller: u32,
        only_pre_bind: bool,
    ) -> Result<(), ClaimError> {
        let _guard = self.locks.lock(uid).await;
        let live: Vec<ShareRecord> = {
            let st = lock(&self.state);
            // The fence again, where the release is decided (I4).
            if epoch < st.epoch {
                return Err(ClaimError::stale_epoch(epoch, st.epoch));
            }
            let Some(cr) = st.claims.get(uid) else {
                info!("claim not known: nothing to release");
                return Ok(());
            };
            cr.share_keys
                .iter()
                .filter_map(|k| st.records.get(k))
                .filter(|r| r.phase.holds_capacity())
                .cloned()
                .collect()
        };
        if live.is_empty() {
            return Ok(());
        }
        if only_pre_bind && live.iter().any(|r| !r.pre_bind) {
            return Err(ClaimError::precondition(
                "only_pre_bind",
                "kubelet prepared this claim after the binding gate admitted it: only kubelet's Unprepare releases it",
            ));
        }
        let (accounting, mut enforcing): (Vec<ShareRecord>, Vec<ShareRecord>) = live
            .into_iter()
            .partition(|r| self.accounting_only(&r.device));

        if !enforcing.is_empty() {
            // Persist RELEASING first, so a crash between here and the removal leaves a
            // share that says what was happening to it.
            let now = now_ms();
            for r in &mut enforcing {
                r.phase = Phase::Releasing;
                r.epoch = r.epoch.max(epoch);
                r.reason = crate::record::reasons::RELEASING.into();
                r.updated_at_ms = now;
            }
            self.commit_durable(Batch {
                put_shares: enforcing.clone(),
                ..Default::default()
            })
            .await?;
            for r in &mut enforcing {
                if let Err(e) = self.remove_blocking(r).await {
                    let err = ClaimError::unavailable(format!(
                        "removing the limit of {} failed: {e}",
                        r.key
                    ));
                    r.error = Some(Box::new(err.clone()));
                    r.reason = format!("release incomplete, capacity still held: {e}").into();
                    r.updated_at_ms = now_ms();
                    self.commit_durable(Batch {
                        put_shares: vec![r.clone()],
                        ..Default::default()
                    })
                    .await?;
                    self.audit_share(
                        r,
                        Decision::Fail,
                        &format!("Unprepare: {}", r.reason),
                        Some(caller),
                        Some(err.code.as_str()),
                    );
                    return Err(err);
                }
            }
        }

        let now = now_ms();
        let released: Vec<ShareRecord> = accounting
            .into_iter()
            .chain(enforcing)
            .map(|mut r| {
                r.phase = Phase::Released;
                r.rolling_back = false;
                r.reason = crate::record::reasons::RELEASED.into();
                r.error = None;
                r.enforced.clear();
                r.set_sandboxes(Vec::new());
                r.updated_at_ms = now;
                r.released_at_ms = std::num::NonZeroU64::new(now);
                r
            })
            .collect();
        // remove_cdi reads the devices and drivers, which releasing leaves as they were.
        if let Err(msg) = self.remove_cdi(uid, &released) {
            // The shares stay RELEASING: the next Unprepare removes the spec again.
            return Err(ClaimError::unavailable(format!(
                "removing the claim's CDI spec failed: {msg}"
            )));
        }
        self.commit_durable(Batch {
            put_shares: released.clone(),
            ..Default::default()
        })
        .await?;
        for r in &released {
            self.audit_share(
                r,
                Decision::Release,
                "released; capacity freed",
                Some(caller),
                None,
            );
        }
        info!(shares = released.len(), "claim released");
        Ok(())
    }
}
