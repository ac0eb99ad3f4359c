//! What the plugin's own read of a claim found, kept by claim uid for the parts that
//! would otherwise read the claim again or write more than it needs:
//!
//! - the pods its `status.reservedFor` named (kubelet's Prepare, the binding gate), so
//!   that a ShareEnforced Event names them without a GET of the claim, which every
//!   claim's first enforcement would otherwise cost;
//! - whether it was made for one pod (from the pod's resourceClaimTemplate): the status
//!   writer does not write such a claim's release.
//!
//! Why the release of a claim made for one pod is left out: such a claim serves its pod
//! alone, and kubelet unprepares it only once that pod's containers stopped for good.
//! The resource claim controller then takes the pod off `status.reservedFor` as soon as
//! the pod is terminal or gone, clears the allocation with it, and deletes the claim;
//! the API server drops the `status.devices` entries of deallocated devices itself. A
//! release apply would remove entries that are about to go anyway, one of the few
//! requests a claim costs. Until the controller gets there (usually within a second of
//! kubelet's Unprepare; longer while the controller manager is down), the claim still
//! shows the share's last status for a pod that no longer runs. A claim made by hand may
//! serve another pod later and stay allocated meanwhile: its release is written. So is
//! that of a claim not kept here (read by an instance before a restart, or past the
//! bound).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use super::ReservedPod;

/// Claims kept at most; beyond this, a new one is not kept: an Event reads its pods from
/// the API server, and its release is written.
const MAX: usize = 4096;

#[derive(Debug)]
struct Seen {
    /// None once kubelet unprepared the claim: no Event of it names pods any more.
    pods: Option<Vec<ReservedPod>>,
    for_one_pod: bool,
}

/// Claim uid -> what its last read found; cheap to clone, one memory for all clones
/// (kubelet's Prepare fills it, Events and the status writer read it).
#[derive(Clone, Default)]
pub struct SeenClaims(Arc<Mutex<HashMap<String, Seen>>>);

impl SeenClaims {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Seen>> {
        // A panic while holding it leaves a map of plain values, still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The plugin just read claim `uid`: reserved for `pods`; `for_one_pod` when a pod is
    /// its controlling owner ([`super::owning_pod`]). The newest read wins.
    pub fn read(&self, uid: &str, pods: Vec<ReservedPod>, for_one_pod: bool) {
        let mut m = self.map();
        if m.len() < MAX || m.contains_key(uid) {
            let seen = Seen {
                pods: Some(pods),
                for_one_pod,
            };
            m.insert(uid.to_owned(), seen);
        }
    }

    /// The pods last read for claim `uid`, if kept and not yet unprepared.
    pub fn pods(&self, uid: &str) -> Option<Vec<ReservedPod>> {
        self.map().get(uid).and_then(|s| s.pods.clone())
    }

    /// Whether claim `uid`, as last read, was made for one pod.
    pub fn for_one_pod(&self, uid: &str) -> bool {
        self.map().get(uid).is_some_and(|s| s.for_one_pod)
    }

    /// kubelet unprepared claim `uid`: its pods are not needed any more; whether it was
    /// made for one pod is, until the status writer decided on its release.
    pub fn unprepared(&self, uid: &str) {
        if let Some(s) = self.map().get_mut(uid) {
            s.pods = None;
        }
    }

    /// Claim `uid` is done with on this node.
    pub fn forget(&self, uid: &str) {
        self.map().remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> ReservedPod {
        ReservedPod {
            name: name.into(),
            uid: format!("{name}-uid"),
        }
    }

    #[test]
    fn kept_from_a_read_until_forgotten_and_bounded() {
        let seen = SeenClaims::default();
        seen.read("a", vec![pod("p")], true);
        seen.read("b", vec![], false);
        assert!(seen.for_one_pod("a") && !seen.for_one_pod("b"));
        assert_eq!(seen.pods("a"), Some(vec![pod("p")]));
        assert_eq!(seen.pods("b"), Some(vec![]));
        assert_eq!(seen.pods("c"), None);
        // Unprepared: the pods go, the release's decision stays.
        seen.unprepared("a");
        assert_eq!(seen.pods("a"), None);
        assert!(seen.for_one_pod("a"));
        // A clone is the same memory (Prepare fills it, the writer forgets).
        seen.clone().forget("a");
        assert!(!seen.for_one_pod("a"));
        // The newest read wins.
        seen.read("a", vec![pod("p")], true);
        seen.read("a", vec![pod("q")], false);
        assert!(!seen.for_one_pod("a"));
        assert_eq!(seen.pods("a"), Some(vec![pod("q")]));
        for i in 0..MAX {
            seen.read(&i.to_string(), vec![], true);
        }
        seen.read("one more", vec![pod("p")], true);
        assert!(!seen.for_one_pod("one more") && seen.pods("one more").is_none());
        // Those already kept are still read again.
        seen.read("0", vec![pod("r")], true);
        assert_eq!(seen.pods("0"), Some(vec![pod("r")]));
    }
}
