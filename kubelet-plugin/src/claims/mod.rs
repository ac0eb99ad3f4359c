//! From a ResourceClaim, as the API server has it, to the agent's Prepare: the pure part
//! of NodePrepareResources, tested without an API server.

mod allocation_id;
mod build;
mod pods;
mod seen;

pub use allocation_id::allocation_id;
pub use build::{KubeletDevice, Prepared, build};
pub use pods::{ReservedPod, owning_pod, reserved_pods};
pub use seen::SeenClaims;

/// The name of the claim's request an allocation result belongs to: a result of a
/// `firstAvailable` subrequest names `<request>/<subrequest>`, and everything from the
/// first '/' is the subrequest (upstream's `resourceclaim.BaseRequestRef`). kubelet
/// matches the request names a plugin returns exactly against the containers'
/// `resources.claims[].request`, which name only the parent request.
pub fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

#[cfg(test)]
mod tests {
    use super::base_request;

    #[test]
    fn a_subrequest_reference_names_its_parent() {
        assert_eq!(base_request("gpu"), "gpu");
        assert_eq!(base_request("gpu/large"), "gpu");
        // Not valid in the API, but split as upstream does: at the first '/'.
        assert_eq!(base_request("a/b/c"), "a");
        assert_eq!(base_request(""), "");
    }
}
