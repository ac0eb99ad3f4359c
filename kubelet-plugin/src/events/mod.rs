//! Kubernetes Events on a claim and its pods, for what a claim's owner has to know and
//! would otherwise only see as a pod stuck in ContainerCreating: the node refused the
//! claim, a share went DEGRADED or FAILED, a share was enforced after it waited.
//!
//! Neither NodePrepareResources nor the status writer waits for an Event: they queue a
//! job ([`Events`]), and one task writes them ([`recorder::Recorder`]), aggregated and
//! rate-limited per object. A full queue drops the job: an Event is a hint, the claim's
//! status and the agent's audit log are the record.

pub mod notice;
pub mod recorder;

use k8s_openapi::api::{
    events::v1::{Event, EventSeries},
    resource::v1::ResourceClaim,
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use shareguard_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tracing::debug;

pub use notice::Notice;
pub use recorder::{ClaimObject, EventApi, Recorder};

use crate::{
    claims::{ReservedPod, SeenClaims, reserved_pods},
    cluster::Clients,
};

/// Jobs waiting for the writer; beyond this, new ones are dropped.
const QUEUE: usize = 256;
struct Job {
    claim: ClaimObject,
    notice: Notice,
}

/// Where the plugin's parts hand their Events; cheap to clone.
#[derive(Clone)]
pub struct Events {
    tx: Option<mpsc::Sender<Job>>,
    node: String,
    /// Whether a share enforced after it waited is told (`--enforced-events`).
    enforced: bool,
}

impl Events {
    /// Events that go nowhere.
    pub fn disabled() -> Self {
        Self {
            tx: None,
            node: String::new(),
            enforced: true,
        }
    }

    /// The writer task for node `node`, until `stop` turns true; and its handle.
    /// `enforced`: whether a share enforced after it waited is told; `seen`: the pods of
    /// the claims the plugin read, named without reading the claim again.
    pub fn start(
        clients: Clients,
        node: &str,
        enforced: bool,
        seen: SeenClaims,
        mut stop: watch::Receiver<bool>,
    ) -> (Self, impl Future<Output = ()> + use<>) {
        let (tx, mut rx) = mpsc::channel::<Job>(QUEUE);
        let mut recorder = Recorder::new(KubeEvents { clients, seen }, node);
        let task = async move {
            loop {
                let job = tokio::select! {
                    job = rx.recv() => job,
                    _ = stop.wait_for(|s| *s) => None,
                };
                let Some(j) = job else { return };
                recorder.record(&j.claim, &j.notice).await;
            }
        };
        (
            Self {
                tx: Some(tx),
                node: node.to_owned(),
                enforced,
            },
            task,
        )
    }

    fn send(&self, claim: ClaimObject, notice: Notice) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(Job { claim, notice }).is_err() {
            debug!("event queue full; an event is dropped");
        }
    }

    /// The node refused claim `claim` of `driver`: `code` is the agent's gRPC code name
    /// (None where the plugin could not build the request).
    pub fn refused(&self, claim: &pb::ClaimRef, driver: &str, code: Option<&str>, message: &str) {
        self.send(
            ClaimObject {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                uid: claim.uid.clone(),
            },
            notice::refused(&self.node, driver, code, message),
        );
    }

    /// The Event a share's move calls for, unless it is one this plugin was told not to
    /// write.
    fn to_tell(&self, before: Option<&pb::ShareStatus>, now: &pb::ShareStatus) -> Option<Notice> {
        notice::on_change(before, now, &self.node)
            .filter(|n| self.enforced || n.kind != notice::Kind::Normal)
    }

    /// A share moved from `before` to `now` (as the agent's WatchShares said).
    pub fn share_changed(&self, before: Option<&pb::ShareStatus>, now: &pb::ShareStatus) {
        let Some(c) = now.claim.as_ref() else { return };
        if let Some(n) = self.to_tell(before, now) {
            self.send(
                ClaimObject {
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    uid: c.uid.clone(),
                },
                n,
            );
        }
    }
}

/// The API server's events.k8s.io/v1 Events, and the claim's pods.
struct KubeEvents {
    clients: Clients,
    /// The pods of the claims the plugin read.
    seen: SeenClaims,
}

impl EventApi for KubeEvents {
    async fn create(&self, event: Event) -> Result<(), kube::Error> {
        let ns = event.metadata.namespace.clone().unwrap_or_default();
        let api = Api::<Event>::namespaced(self.clients.calls.clone(), &ns);
        self.clients
            .bounded(api.create(&PostParams::default(), &event))
            .await
            .map(drop)
    }

    async fn patch_series(
        &self,
        namespace: &str,
        name: &str,
        series: EventSeries,
    ) -> Result<(), kube::Error> {
        let api = Api::<Event>::namespaced(self.clients.calls.clone(), namespace);
        let body = serde_json::json!({ "series": series });
        self.clients
            .bounded(api.patch(name, &PatchParams::default(), &Patch::Merge(&body)))
            .await
            .map(drop)
    }

    async fn claim_pods(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        recent: bool,
    ) -> Result<Vec<ReservedPod>, kube::Error> {
        if recent && let Some(pods) = self.seen.pods(uid) {
            return Ok(pods);
        }
        let api = Api::<ResourceClaim>::namespaced(self.clients.calls.clone(), namespace);
        let claim = self.clients.bounded(api.get(name)).await?;
        // A claim created anew under the name has other pods.
        if claim.metadata.uid.as_deref() != Some(uid) {
            return Ok(Vec::new());
        }
        Ok(reserved_pods(&claim))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(phase: pb::Phase) -> pb::ShareStatus {
        pb::ShareStatus {
            share_id: "0b6a4c9e-1111-4c3e-9f00-000000000001".into(),
            device: "nic-0".into(),
            phase: phase as i32,
            ..Default::default()
        }
    }

    #[test]
    fn without_enforced_events_only_warnings_are_told() {
        let told = |enforced: bool, from: pb::Phase, to: pb::Phase| {
            let events = Events {
                enforced,
                ..Events::disabled()
            };
            events
                .to_tell(Some(&share(from)), &share(to))
                .map(|n| n.reason)
        };
        use pb::Phase::*;
        assert_eq!(told(true, Pending, Enforced), Some("ShareEnforced"));
        assert_eq!(told(false, Pending, Enforced), None);
        assert_eq!(told(false, Degraded, Enforced), None);
        assert_eq!(told(true, Enforced, Degraded), Some("ShareDegraded"));
        assert_eq!(told(false, Enforced, Degraded), Some("ShareDegraded"));
        assert_eq!(told(false, Pending, Failed), Some("ShareFailed"));
    }
}
