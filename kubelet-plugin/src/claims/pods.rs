//! The pods a claim is reserved for, from `status.reservedFor`.

use k8s_openapi::api::resource::v1::ResourceClaim;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservedPod {
    pub name: String,
    pub uid: String,
}

/// The consumers that are pods (core group, resource `pods`); other consumers (a
/// workload controller reserving for a whole group) have no sandbox of their own.
pub fn reserved_pods(claim: &ResourceClaim) -> Vec<ReservedPod> {
    claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| ReservedPod {
            name: r.name.clone(),
            uid: r.uid.clone(),
        })
        .collect()
}
