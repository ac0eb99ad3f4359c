//! Small synchronisation helpers shared by the agent.

use std::sync::{Mutex, MutexGuard};

/// Locks a std mutex, carrying on past poisoning. A poisoned lock means a panic while
/// it was held; every structure behind these locks is changed only after the store
/// accepted the change, so what it holds is still a valid (if possibly stale) view, and
/// refusing all further service would turn one bug into an outage.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
