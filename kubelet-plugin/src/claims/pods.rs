//! The pods a claim is reserved for, from `status.reservedFor`.

use k8s_openapi::api::resource::v1::ResourceClaim;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReservedPod {
    pub name: String,
    pub uid: String,
}

/// The consumers that are pods (core group, resource `pods`); other consumers (a
/// workload controller reserving for a whole group) have no sandbox of their own.
///
/// Their uids go to the agent as they are, without a GET of each Pod (which would need
/// `pods: get` in every namespace). What such a read would check holds already:
/// - bound to this node: the claim's results are devices of this node's pools (checked
///   in [`super::build`]), so its allocation's node selector names this node, and the
///   scheduler reserves a claim only for pods it places where that selector matches; a
///   reserved pod is bound here, or about to be;
/// - the same pod: an entry carries the pod's uid, and the agent finds a sandbox only by
///   that uid, so a pod deleted (or created anew under its name, with another uid) just
///   never shows a sandbox here;
/// - in the claim's namespace: a consumer reference has no namespace of its own; it names
///   a pod of the claim's namespace, and only the scheduler and the controller manager
///   may write `status.reservedFor` (from 1.36 behind `resourceclaims/binding`);
/// - kubelet itself prepares a claim for a pod only once it found the pod's uid in
///   `status.reservedFor`.
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
