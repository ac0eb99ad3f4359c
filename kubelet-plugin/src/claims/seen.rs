//! What the plugin's own read of a claim found, kept by claim uid for the parts that
//! would otherwise read the claim again: the pods its `status.reservedFor` named
//! (kubelet's Prepare, the binding gate), so that a ShareEnforced Event names them
//! without a GET of the claim, which every claim's first enforcement would otherwise
//! cost.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use super::ReservedPod;

/// Claims kept at most; beyond this, a new one is not kept, and an Event reads its pods
/// from the API server.
const MAX: usize = 4096;

/// Claim uid -> its pods; cheap to clone, one memory for all clones.
#[derive(Clone, Default)]
pub struct SeenClaims(Arc<Mutex<HashMap<String, Vec<ReservedPod>>>>);

impl SeenClaims {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Vec<ReservedPod>>> {
        // A panic while holding it leaves a map of plain values, still usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The pods claim `uid` is reserved for, as the plugin just read it.
    pub fn know_pods(&self, uid: &str, pods: Vec<ReservedPod>) {
        let mut m = self.map();
        if m.len() < MAX || m.contains_key(uid) {
            m.insert(uid.to_owned(), pods);
        }
    }

    /// The pods last read for claim `uid`, if kept.
    pub fn pods(&self, uid: &str) -> Option<Vec<ReservedPod>> {
        self.map().get(uid).cloned()
    }

    /// Claim `uid` is done with on this node.
    pub fn forget(&self, uid: &str) {
        self.map().remove(uid);
    }
}
