//! Per-claim serialisation. Two calls for the same claim (a kubelet retry racing the
//! first attempt) run one after the other; calls for different claims run concurrently
//! and meet only at the short ledger critical section.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::sync::lock;

#[derive(Default)]
pub struct ClaimLocks {
    map: Mutex<HashMap<String, Arc<AsyncMutex<()>>>>,
}

pub struct ClaimGuard<'a> {
    locks: &'a ClaimLocks,
    uid: String,
    entry: Arc<AsyncMutex<()>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl ClaimLocks {
    pub async fn lock(&self, uid: &str) -> ClaimGuard<'_> {
        let entry = lock(&self.map).entry(uid.to_owned()).or_default().clone();
        let guard = entry.clone().lock_owned().await;
        ClaimGuard {
            locks: self,
            uid: uid.to_owned(),
            entry,
            guard: Some(guard),
        }
    }
}

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = lock(&self.locks.map);
        // Two references left (the map's and ours) means nobody else waits: forget the
        // entry so the map does not grow with every claim ever seen. Clones are only made
        // under the map lock, which we hold, so the count cannot rise meanwhile.
        if Arc::strong_count(&self.entry) == 2 {
            map.remove(&self.uid);
        }
    }
}
