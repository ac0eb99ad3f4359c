//! The audit lines the engine writes: a refused claim or request, a decision on a node
//! (epoch, rollout, config), and a decision on one share. Each is one `write`, with every
//! caller string bounded by the audit log itself.

use super::Engine;
use crate::{
    audit::{AuditLine, Decision, now_rfc3339},
    error::{ClaimError, RequestError},
    record::ShareRecord,
    request,
};

impl Engine {
    pub(super) fn audit_refusal(
        &self,
        claim: &request::ClaimRef,
        c: &request::ClaimPrepare,
        a: Option<&request::DeviceAllocation>,
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
            RequestError::CallerNotAllowed { uid } | RequestError::RoleTooLow { uid, .. } => {
                Some(*uid)
            }
            _ => caller,
        };
        self.audit_node(
            Decision::Refuse,
            &format!("{rpc}: {e}"),
            epoch,
            caller,
            Some(&code),
        );
    }

    /// A decision about the node or a whole request, not one share or claim.
    pub(crate) fn audit_node(
        &self,
        decision: Decision,
        reason: &str,
        epoch: u64,
        caller: Option<u32>,
        code: Option<&str>,
    ) {
        self.audit.write(&AuditLine {
            time: now_rfc3339(),
            decision,
            reason,
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
            code,
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
            share_id: r.share_id().unwrap_or(""),
            device: &r.device,
            amounts: r
                .consumed
                .iter()
                .map(|(k, v)| (k.to_owned(), v.to_string()))
                .collect(),
            policy_version: &r.policy_version,
            allocation_id: &r.allocation_id,
            epoch: r.epoch,
            caller_uid: caller,
            code,
        });
    }
}

/// The allocation a refusal names (`claims[i].allocations[j]…` in its field), or the only
/// one: the audit line shows its share and device. None for a claim-wide reason.
pub(super) fn allocation_at_fault<'a>(
    c: &'a request::ClaimPrepare,
    e: &ClaimError,
) -> Option<&'a request::DeviceAllocation> {
    let named = e
        .field
        .split_once(".allocations[")
        .and_then(|(_, rest)| rest.split_once(']'))
        .and_then(|(j, _)| j.parse::<usize>().ok())
        .and_then(|j| c.allocations.get(j));
    named.or(match c.allocations.as_slice() {
        [only] => Some(only),
        _ => None,
    })
}
