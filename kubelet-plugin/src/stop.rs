//! The plugin's stop signal: a `watch` of a bool that turns true once, at shutdown,
//! which each long-running task selects on.

use tokio::sync::watch;

/// Resolves once `stop` is true (or its sender is gone).
pub(crate) async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// [`until_stopped`] on a clone of `rx`, for a future that must own what it waits on.
pub(crate) fn stopped(rx: &watch::Receiver<bool>) -> impl Future<Output = ()> + use<> {
    let mut rx = rx.clone();
    async move { until_stopped(&mut rx).await }
}
