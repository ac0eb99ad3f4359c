//! What the gate does with one claim of a pod nominated to this node: pure, from the
//! claim as the API server has it.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};

use super::{ADMITTED, REFUSED};
use crate::claims;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// No result of the claim is one of this node's devices with binding conditions.
    NotOurs,
    /// Not yet: the scheduler's PreBind writes the allocation and the reservation
    /// right after it nominated the pod. The reason, for logs.
    Wait(&'static str),
    /// The scheduler waits on these drivers' results; the allocation id of each (as
    /// the driver's Prepare computes it).
    Admit(BTreeMap<String, String>),
    /// Every result of ours already says admitted or refused.
    Told,
}

/// The names of the pod's ResourceClaims: those it names, and those made from its
/// templates (listed in its status once made; the scheduler waits for them).
pub fn claim_names(pod: &Pod) -> Vec<String> {
    let mut names = BTreeSet::new();
    for c in pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
    {
        if let Some(n) = &c.resource_claim_name {
            names.insert(n.clone());
        }
    }
    let statuses = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten());
    for s in statuses {
        if let Some(n) = &s.resource_claim_name {
            names.insert(n.clone());
        }
    }
    names.into_iter().collect()
}

/// `pools` is driver -> this node's pools of it.
pub fn decide(
    claim: &ResourceClaim,
    pod_uid: &str,
    pools: &BTreeMap<String, BTreeSet<String>>,
) -> Next {
    let Some(status) = &claim.status else {
        return Next::Wait("the claim has no status yet");
    };
    let Some(allocation) = &status.allocation else {
        return Next::Wait("the claim is not allocated yet");
    };
    let ours: Vec<_> = allocation
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| {
            pools.get(&r.driver).is_some_and(|p| p.contains(&r.pool))
                && r.binding_conditions.as_ref().is_some_and(|c| !c.is_empty())
        })
        .collect();
    if ours.is_empty() {
        return Next::NotOurs;
    }
    let reserved = status
        .reserved_for
        .iter()
        .flatten()
        .any(|r| r.uid == pod_uid);
    if !reserved {
        return Next::Wait("the claim is not reserved for the pod yet");
    }
    let uid = claim.metadata.uid.as_deref().unwrap_or("");
    let told = ours.iter().all(|r| {
        status.devices.iter().flatten().any(|d| {
            d.driver == r.driver
                && d.pool == r.pool
                && d.device == r.device
                && d.share_id == r.share_id
                && d.conditions
                    .iter()
                    .flatten()
                    .any(|c| (c.type_ == ADMITTED || c.type_ == REFUSED) && c.status == "True")
        })
    });
    if told {
        return Next::Told;
    }
    let drivers: BTreeSet<&str> = ours.iter().map(|r| r.driver.as_str()).collect();
    Next::Admit(
        drivers
            .into_iter()
            .map(|d| {
                // The same id the driver's Prepare sends: over all of the driver's
                // results of the claim.
                let all: Vec<_> = allocation
                    .devices
                    .iter()
                    .flat_map(|x| x.results.iter().flatten())
                    .filter(|r| r.driver == d)
                    .collect();
                (d.to_owned(), claims::allocation_id(uid, &all))
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        PodResourceClaim, PodResourceClaimStatus, PodSpec, PodStatus,
    };
    use k8s_openapi::api::resource::v1::{
        AllocatedDeviceStatus, AllocationResult, DeviceAllocationResult,
        DeviceRequestAllocationResult, ResourceClaimConsumerReference, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};

    use super::*;

    const DRIVER: &str = "net.example.com";
    const POD: &str = "pod-uid";

    fn pools() -> BTreeMap<String, BTreeSet<String>> {
        BTreeMap::from([(DRIVER.to_owned(), BTreeSet::from(["node-a".to_owned()]))])
    }

    fn result(pool: &str, gated: bool) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            driver: DRIVER.into(),
            pool: pool.into(),
            device: "nic-0".into(),
            request: "net".into(),
            share_id: Some("3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d".into()),
            binding_conditions: gated.then(|| vec![ADMITTED.to_owned()]),
            binding_failure_conditions: gated.then(|| vec![REFUSED.to_owned()]),
            ..Default::default()
        }
    }

    fn claim(results: Vec<DeviceRequestAllocationResult>, reserved: bool) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                uid: Some("claim-uid".into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                reserved_for: reserved.then(|| {
                    vec![ResourceClaimConsumerReference {
                        resource: "pods".into(),
                        name: "p".into(),
                        uid: POD.into(),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn said(c: &mut ResourceClaim, condition: &str, status: &str) {
        let r = result("node-a", true);
        c.status.as_mut().unwrap().devices = Some(vec![AllocatedDeviceStatus {
            driver: r.driver,
            pool: r.pool,
            device: r.device,
            share_id: r.share_id,
            conditions: Some(vec![Condition {
                type_: condition.into(),
                status: status.into(),
                reason: "R".into(),
                message: String::new(),
                last_transition_time: Time(Default::default()),
                observed_generation: None,
            }]),
            ..Default::default()
        }]);
    }

    #[test]
    fn only_a_reserved_claim_with_gated_results_here_is_admitted() {
        let pools = pools();
        let mut unallocated = claim(vec![], true);
        unallocated.status.as_mut().unwrap().allocation = None;
        assert!(matches!(decide(&unallocated, POD, &pools), Next::Wait(_)));
        assert_eq!(
            decide(&claim(vec![result("node-b", true)], true), POD, &pools),
            Next::NotOurs,
            "another node's pool"
        );
        assert_eq!(
            decide(&claim(vec![result("node-a", false)], true), POD, &pools),
            Next::NotOurs,
            "a device published without binding conditions"
        );
        assert!(matches!(
            decide(&claim(vec![result("node-a", true)], false), POD, &pools),
            Next::Wait(_)
        ));
        let c = claim(vec![result("node-a", true)], true);
        let Next::Admit(ids) = decide(&c, POD, &pools) else {
            panic!("{:?}", decide(&c, POD, &pools));
        };
        let r = result("node-a", true);
        assert_eq!(ids[DRIVER], claims::allocation_id("claim-uid", &[&r]));
    }

    #[test]
    fn a_result_already_told_either_way_is_left_alone() {
        let pools = pools();
        for (cond, status, told) in [
            (ADMITTED, "True", true),
            (REFUSED, "True", true),
            (ADMITTED, "False", false),
            ("Enforced", "True", false),
        ] {
            let mut c = claim(vec![result("node-a", true)], true);
            said(&mut c, cond, status);
            assert_eq!(
                decide(&c, POD, &pools) == Next::Told,
                told,
                "{cond}={status}"
            );
        }
    }

    #[test]
    fn a_pods_claims_by_name_and_from_templates() {
        let pod = Pod {
            spec: Some(PodSpec {
                resource_claims: Some(vec![
                    PodResourceClaim {
                        name: "a".into(),
                        resource_claim_name: Some("shared".into()),
                        ..Default::default()
                    },
                    PodResourceClaim {
                        name: "b".into(),
                        resource_claim_template_name: Some("t".into()),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
            status: Some(PodStatus {
                resource_claim_statuses: Some(vec![PodResourceClaimStatus {
                    name: "b".into(),
                    resource_claim_name: Some("p-b-x7k2q".into()),
                }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(claim_names(&pod), ["p-b-x7k2q", "shared"]);
    }
}
