//! Whether a share the gate admitted before binding, and no kubelet prepared since, is
//! still wanted: pure, from its claim as the API server has it now. Such a share's pod
//! never reached this node's kubelet (the binding timed out or failed elsewhere, the pod
//! was deleted while the scheduler waited), so no Unprepare will ever come for it.

use k8s_openapi::api::resource::v1::ResourceClaim;
use shareguard_proto::v1 as pb;

use crate::claims;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// Released, for this reason.
    Release(&'static str),
}

/// `claim` is None where the API server has no claim of that name.
pub fn sweep_verdict(share: &pb::ShareStatus, claim: Option<&ResourceClaim>) -> Verdict {
    if !share.pre_bind {
        // Prepared by kubelet: only kubelet's Unprepare releases it (a node cut off from
        // the API server keeps its shares while its pods may still run).
        return Verdict::Keep;
    }
    let Some(claim) = claim else {
        return Verdict::Release("the claim is gone");
    };
    let want_uid = share.claim.as_ref().map(|c| c.uid.as_str()).unwrap_or("");
    let uid = claim.metadata.uid.as_deref().unwrap_or("");
    if uid != want_uid {
        return Verdict::Release("the claim was deleted and created anew");
    }
    let Some(allocation) = claim.status.as_ref().and_then(|s| s.allocation.as_ref()) else {
        return Verdict::Release("the claim was deallocated");
    };
    let results: Vec<_> = allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == share.driver)
        .collect();
    if claims::allocation_id(uid, &results) != share.allocation_id {
        return Verdict::Release("the claim was allocated anew");
    }
    Verdict::Keep
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn result(device: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: "d".into(),
            pool: "node-a".into(),
            device: device.into(),
            request: "net".into(),
            share_id: Some("s1".into()),
            ..Default::default()
        }
    }

    fn claim(uid: &str, results: Option<Vec<DeviceRequestAllocationResult>>) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: results.map(|r| AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(r),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn share(pre_bind: bool) -> pb::ShareStatus {
        pb::ShareStatus {
            claim: Some(pb::ClaimRef {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
            }),
            driver: "d".into(),
            allocation_id: claims::allocation_id("u1", &[&result("nic-0")]),
            pre_bind,
            ..Default::default()
        }
    }

    #[test]
    fn a_gate_share_goes_once_its_claim_lost_the_allocation() {
        let same = claim("u1", Some(vec![result("nic-0")]));
        assert_eq!(sweep_verdict(&share(true), Some(&same)), Verdict::Keep);
        for (c, why) in [
            (None, "the claim is gone"),
            (
                Some(claim("u2", Some(vec![result("nic-0")]))),
                "the claim was deleted and created anew",
            ),
            (Some(claim("u1", None)), "the claim was deallocated"),
            (
                Some(claim("u1", Some(vec![result("nic-1")]))),
                "the claim was allocated anew",
            ),
        ] {
            assert_eq!(
                sweep_verdict(&share(true), c.as_ref()),
                Verdict::Release(why)
            );
        }
    }

    #[test]
    fn a_share_kubelet_prepared_is_never_released_here() {
        for c in [None, Some(claim("u1", None)), Some(claim("u2", None))] {
            assert_eq!(sweep_verdict(&share(false), c.as_ref()), Verdict::Keep);
        }
    }
}
