//! The agent's `ClaimPrepare` for one claim kubelet asked to prepare, and the devices
//! kubelet gets back once the agent accepted it.

use std::collections::HashMap;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use shareguard_proto::v1 as pb;

use super::allocation_id;
use crate::{error::ClaimError, inventory::DriverDevices, policy::PolicySnapshot};

/// One device of kubelet's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeletDevice {
    /// The allocation result's request as the claim has it: `req/sub` for a
    /// `firstAvailable` subrequest. The agent gets the full name too (it is part of the
    /// allocation, and the audit then says which alternative the scheduler took); only
    /// kubelet's answer is cut to the parent request ([`super::base_request`]).
    pub request: String,
    pub pool: String,
    pub device: String,
    /// Empty for a whole device.
    pub share_id: String,
}

#[derive(Clone, Debug)]
pub struct Prepared {
    pub request: pb::ClaimPrepare,
    pub devices: Vec<KubeletDevice>,
}

/// Checks the claim against what kubelet asked for and this node's devices, and builds
/// the agent's request. `pod_uids` are the claim's pods (from `status.reservedFor`).
pub fn build(
    claim: &ResourceClaim,
    asked: &pb::ClaimRef,
    driver: &str,
    devices: &DriverDevices,
    policy: &PolicySnapshot,
    pod_uids: Vec<String>,
) -> Result<Prepared, ClaimError> {
    let refuse = |reason: String| ClaimError::claim(&asked.namespace, &asked.name, reason);
    let uid = claim.metadata.uid.as_deref().unwrap_or("");
    if uid != asked.uid {
        return Err(refuse(format!(
            "its uid is {uid:?}, not {:?} as kubelet asked: the claim was deleted and created anew",
            asked.uid
        )));
    }
    let results: Vec<&DeviceRequestAllocationResult> = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or_else(|| refuse("it has no allocation".into()))?
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver)
        .collect();
    if results.is_empty() {
        return Err(refuse(format!(
            "its allocation has no device of driver {driver}"
        )));
    }
    let mut allocations = Vec::with_capacity(results.len());
    let mut answer = Vec::with_capacity(results.len());
    for (i, r) in results.iter().enumerate() {
        let Some(dev) = devices.get(&r.pool, &r.device) else {
            return Err(refuse(format!(
                "allocation result {i} (request {:?}): device {}/{} is not one of this node's",
                r.request, r.pool, r.device
            )));
        };
        let share_id = r.share_id.clone().unwrap_or_default();
        let consumed: HashMap<String, String> = r
            .consumed_capacity
            .iter()
            .flatten()
            .map(|(k, q)| (k.clone(), q.0.clone()))
            .collect();
        // A share is checked against the request policy the scheduler saw: the one this
        // plugin publishes in the device's ResourceSlice. A whole device has none.
        let (policy, policy_version) = if share_id.is_empty() {
            (HashMap::new(), String::new())
        } else {
            (
                consumed
                    .keys()
                    .filter_map(|k| dev.policy.get(k).map(|p| (k.clone(), p.clone())))
                    .collect(),
                policy.version(&r.pool).unwrap_or_default().to_owned(),
            )
        };
        allocations.push(pb::DeviceAllocation {
            request: r.request.clone(),
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: share_id.clone(),
            consumed_capacity: consumed,
            policy,
            policy_version,
            admin_access: r.admin_access.unwrap_or(false),
        });
        answer.push(KubeletDevice {
            request: r.request.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id,
        });
    }
    Ok(Prepared {
        request: pb::ClaimPrepare {
            claim: Some(asked.clone()),
            allocation_id: allocation_id(&asked.uid, &results),
            target: Some(pb::PodTarget {
                pod_uids,
                ..Default::default()
            }),
            allocations,
            // The binding gate sets it; kubelet's Prepare never does.
            pre_bind: false,
        },
        devices: answer,
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;
    use crate::inventory::Inventory;

    const DRIVER: &str = "net.example.com";

    fn devices() -> DriverDevices {
        let dev = pb::DeviceStatus {
            name: "eth0".into(),
            driver: DRIVER.into(),
            pool: "node-a".into(),
            policy: [(
                "bandwidth".to_owned(),
                pb::CapacityPolicy {
                    default: "100M".into(),
                    ..Default::default()
                },
            )]
            .into(),
            ..Default::default()
        };
        Inventory::from_agent(&pb::ListDevicesResponse {
            devices: vec![dev],
            epoch: 0,
        })
        .drivers[DRIVER]
            .clone()
    }

    fn result(driver: &str, device: &str, share: Option<&str>) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: "bw".into(),
            driver: driver.into(),
            pool: "node-a".into(),
            device: device.into(),
            share_id: share.map(str::to_owned),
            consumed_capacity: share
                .map(|_| [("bandwidth".to_owned(), Quantity("200M".into()))].into()),
            ..Default::default()
        }
    }

    fn claim(uid: &str, results: Option<Vec<DeviceRequestAllocationResult>>) -> ResourceClaim {
        ResourceClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                namespace: Some("team-a".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: results.map(|results| AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(results),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn asked(uid: &str) -> pb::ClaimRef {
        pb::ClaimRef {
            uid: uid.into(),
            namespace: "team-a".into(),
            name: "c".into(),
        }
    }

    fn run(claim: &ResourceClaim) -> Result<Prepared, ClaimError> {
        let devs = devices();
        build(
            claim,
            &asked("uid-1"),
            DRIVER,
            &devs,
            &PolicySnapshot::of(&devs),
            vec!["pod-1".into()],
        )
    }

    fn refusal(claim: &ResourceClaim) -> String {
        match run(claim) {
            Ok(p) => panic!("accepted: {p:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_share_carries_its_amounts_policy_and_pods() {
        let share = "3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
        let other = result("gpu.example.com", "gpu0", Some(share));
        let p = run(&claim(
            "uid-1",
            Some(vec![result(DRIVER, "eth0", Some(share)), other]),
        ))
        .unwrap();
        assert_eq!(p.request.allocations.len(), 1, "only this driver's results");
        let a = &p.request.allocations[0];
        assert_eq!(a.share_id, share);
        assert_eq!(a.consumed_capacity["bandwidth"], "200M");
        assert_eq!(a.policy["bandwidth"].default, "100M");
        assert!(
            a.policy_version.starts_with("policy-"),
            "{}",
            a.policy_version
        );
        assert_eq!(p.request.target.unwrap().pod_uids, ["pod-1"]);
        assert!(p.request.allocation_id.starts_with("sha256-"));
        assert_eq!(p.devices[0].share_id, share);
    }

    #[test]
    fn a_whole_device_has_no_policy() {
        let p = run(&claim("uid-1", Some(vec![result(DRIVER, "eth0", None)]))).unwrap();
        let a = &p.request.allocations[0];
        assert!(a.share_id.is_empty());
        assert!(a.policy.is_empty());
        assert!(a.policy_version.is_empty());
    }

    #[test]
    fn a_replaced_claim_is_refused() {
        let e = refusal(&claim("uid-2", Some(vec![result(DRIVER, "eth0", None)])));
        assert!(e.contains("team-a/c") && e.contains("created anew"), "{e}");
    }

    #[test]
    fn a_claim_without_allocation_is_refused() {
        assert!(refusal(&claim("uid-1", None)).contains("no allocation"));
        let e = refusal(&claim(
            "uid-1",
            Some(vec![result("x.example.com", "eth0", None)]),
        ));
        assert!(e.contains("no device of driver net.example.com"), "{e}");
    }

    #[test]
    fn a_device_of_another_node_is_refused() {
        let e = refusal(&claim("uid-1", Some(vec![result(DRIVER, "eth9", None)])));
        assert!(e.contains("node-a/eth9 is not one of this node's"), "{e}");
    }
}
