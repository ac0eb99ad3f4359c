//! Claims made for one pod (from its resourceClaimTemplate), as the plugin's own reads
//! of them found: the status writer does not write their release.
//!
//! Such a claim serves its pod alone, and kubelet unprepares it only once that pod's
//! containers stopped for good. The resource claim controller then takes the pod off
//! `status.reservedFor` as soon as the pod is terminal or gone, clears the allocation
//! with it, and deletes the claim; the API server drops the `status.devices` entries of
//! deallocated devices itself. A release apply would remove entries that are about to
//! go anyway, one of the few requests a claim costs. Until the controller gets there
//! (usually within a second of kubelet's Unprepare; longer while the controller manager
//! is down), the claim still shows the share's last status for a pod that no longer
//! runs. A claim made by hand may serve another pod later and stay allocated meanwhile:
//! its release is written. So is that of a claim not held here (read by an instance
//! before a restart, or past the bound).

use std::{
    collections::HashSet,
    sync::{Arc, Mutex, MutexGuard},
};

/// Claims held at most; beyond this, a new one is not held, and its release is written.
const MAX: usize = 4096;

/// Claim uids; cheap to clone, shared by kubelet's Prepare and the status writer.
#[derive(Clone, Default)]
pub struct PodClaims(Arc<Mutex<HashSet<String>>>);

impl PodClaims {
    fn set(&self) -> MutexGuard<'_, HashSet<String>> {
        // A panic while holding it leaves a set of plain values, still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The plugin read claim `uid`: `for_one_pod` when a pod is its controlling owner
    /// ([`crate::claims::owning_pod`]).
    pub fn read(&self, uid: &str, for_one_pod: bool) {
        let mut s = self.set();
        if !for_one_pod {
            s.remove(uid);
        } else if s.len() < MAX {
            s.insert(uid.to_owned());
        }
    }

    pub fn holds(&self, uid: &str) -> bool {
        self.set().contains(uid)
    }

    /// Claim `uid` is done with on this node.
    pub fn forget(&self, uid: &str) {
        self.set().remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_from_a_read_until_forgotten_and_bounded() {
        let p = PodClaims::default();
        p.read("a", true);
        p.read("b", false);
        assert!(p.holds("a") && !p.holds("b"));
        // A clone is the same memory (Prepare fills it, the writer reads it).
        p.clone().forget("a");
        assert!(!p.holds("a"));
        // Read again and found otherwise (never the case for one uid, but the newest
        // read wins).
        p.read("a", true);
        p.read("a", false);
        assert!(!p.holds("a"));
        for i in 0..MAX {
            p.read(&i.to_string(), true);
        }
        p.read("one more", true);
        assert!(!p.holds("one more"), "beyond the bound a claim is not held");
        assert!(p.holds("0"));
    }
}
