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

/// The uid of the pod the claim was made for (from the pod's resourceClaimTemplate):
/// the Pod that is the claim's controlling owner, as the resource claim controller
/// itself tells such a claim from one made by hand.
pub fn owning_pod(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.api_version == "v1" && o.kind == "Pod")
        .map(|o| o.uid.as_str())
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    use super::*;

    fn owned_by(refs: Vec<OwnerReference>) -> ResourceClaim {
        let mut c = ResourceClaim::default();
        c.metadata.owner_references = Some(refs);
        c
    }

    fn owner(kind: &str, api_version: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: "p".into(),
            uid: format!("{kind}-uid"),
            controller,
            ..OwnerReference::default()
        }
    }

    #[test]
    fn only_a_controlling_pod_owns_a_claim() {
        let pod = owner("Pod", "v1", Some(true));
        assert_eq!(owning_pod(&owned_by(vec![pod.clone()])), Some("Pod-uid"));
        // Made by hand: no owner.
        assert_eq!(owning_pod(&ResourceClaim::default()), None);
        // A pod that owns it without being its controller, another kind of controller
        // (a workload's group), or something else called Pod: not made for one pod.
        assert_eq!(owning_pod(&owned_by(vec![owner("Pod", "v1", None)])), None);
        assert_eq!(
            owning_pod(&owned_by(vec![owner("Pod", "v1", Some(false))])),
            None
        );
        assert_eq!(
            owning_pod(&owned_by(vec![owner(
                "PodGroup",
                "scheduling.k8s.io/v1alpha1",
                Some(true)
            )])),
            None
        );
        assert_eq!(
            owning_pod(&owned_by(vec![owner("Pod", "example.com/v1", Some(true))])),
            None
        );
        // Found among other owners.
        assert_eq!(
            owning_pod(&owned_by(vec![owner("ConfigMap", "v1", None), pod])),
            Some("Pod-uid")
        );
    }
}
