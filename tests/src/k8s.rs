//! Kubernetes objects for the tests, built from the k8s-openapi types the stand-in
//! serves: nodes, pods, and allocated ResourceClaims as the scheduler leaves them.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{Node, Pod, PodSpec},
        resource::v1::{
            AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaim,
            ResourceClaimConsumerReference, ResourceClaimSpec, ResourceClaimStatus,
        },
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};

pub fn node(name: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(crate::share_id()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A pod bound to `node`.
pub fn pod(namespace: &str, name: &str, uid: &str, node: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One allocation result: a share of `device` (`share_id` Some) or the whole device.
pub fn result(
    request: &str,
    driver: &str,
    pool: &str,
    device: &str,
    share_id: Option<&str>,
    consumed: &[(&str, &str)],
) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        request: request.into(),
        driver: driver.into(),
        pool: pool.into(),
        device: device.into(),
        share_id: share_id.map(str::to_owned),
        consumed_capacity: (!consumed.is_empty()).then(|| {
            consumed
                .iter()
                .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
                .collect::<BTreeMap<_, _>>()
        }),
        ..Default::default()
    }
}

/// A claim as the scheduler leaves it: allocated with `results` (None: not allocated)
/// and reserved for `pods` (name, uid).
pub fn claim(
    namespace: &str,
    name: &str,
    uid: &str,
    results: Option<Vec<DeviceRequestAllocationResult>>,
    pods: &[(&str, &str)],
) -> ResourceClaim {
    ResourceClaim {
        metadata: ObjectMeta {
            namespace: Some(namespace.into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: ResourceClaimSpec::default(),
        status: Some(ResourceClaimStatus {
            allocation: results.map(|r| AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(r),
                    config: None,
                }),
                ..Default::default()
            }),
            reserved_for: (!pods.is_empty()).then(|| {
                pods.iter()
                    .map(|(name, uid)| ResourceClaimConsumerReference {
                        api_group: None,
                        resource: "pods".into(),
                        name: (*name).into(),
                        uid: (*uid).into(),
                    })
                    .collect()
            }),
            devices: None,
        }),
    }
}
