//! A SIMULATED node agent, for the fleet simulation (benches/fleet.rs): it serves the
//! `NodeAgent` API on a unix socket as a node's agent would to its kubelet plugin, from
//! an inventory a real agent reported once (its pools renamed for this node). It admits
//! every claim the plugin prepares as PENDING, reports each share ENFORCED a set time
//! later (as a real agent does once the pod's sandbox appears), and releases on
//! Unprepare, streaming every change on `WatchShares` as the real one does. It checks
//! no ledger, limits nothing and persists nothing: it stands in for the agent only so
//! that the plugin's requests to the API server can be counted for many nodes on one
//! machine. Nothing outside the fleet simulation uses it.

use std::{
    collections::HashMap,
    path::Path,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::{Stream, StreamExt};
use serde_json::json;
use shareguard_proto::v1::{
    self as pb,
    node_agent_server::{NodeAgent, NodeAgentServer},
};
use tokio::sync::{broadcast, oneshot};
use tonic::{Request, Response, Status};

/// One simulated node's agent, served until dropped.
pub struct SimAgent {
    epoch: Arc<AtomicU64>,
    shares: Arc<Mutex<Shares>>,
    _stop: oneshot::Sender<()>,
}

impl SimAgent {
    /// Serves on `socket` the devices of `inventory` as node `node`'s: each device's pool
    /// is the node's name, as a real agent's is unless its config names one. A prepared
    /// share turns ENFORCED `enforce_after` after its Prepare.
    pub fn serve(
        socket: &Path,
        node: &str,
        inventory: &pb::ListDevicesResponse,
        enforce_after: Duration,
    ) -> SimAgent {
        let listener = tokio::net::UnixListener::bind(socket)
            .unwrap_or_else(|e| panic!("bind {}: {e}", socket.display()));
        let mut devices = inventory.devices.clone();
        for d in &mut devices {
            d.pool = node.to_owned();
        }
        let epoch = Arc::new(AtomicU64::new(0));
        // Room for every change of a busy node between two reads of a slow watcher; one
        // that falls behind anyway is cut off and watches again, as from the real agent.
        let (changes, _) = broadcast::channel(1024);
        let shares = Arc::new(Mutex::new(Shares {
            by_claim: HashMap::new(),
            changes,
        }));
        let service = Service {
            devices: Arc::new(devices),
            epoch: epoch.clone(),
            shares: shares.clone(),
            enforce_after,
        };
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(NodeAgentServer::new(service))
                .serve_with_incoming_shutdown(shareguard_uds::incoming(listener), async {
                    let _ = stopped.await;
                }),
        );
        SimAgent {
            epoch,
            shares,
            _stop: stop,
        }
    }

    /// The highest epoch taken so far (0: none).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// How many claims hold shares now (prepared and not yet unprepared).
    pub fn live_claims(&self) -> usize {
        lock(&self.shares).by_claim.len()
    }
}

/// The live shares by claim uid, and the stream of their changes.
struct Shares {
    by_claim: HashMap<String, Claim>,
    changes: broadcast::Sender<pb::ShareStatus>,
}

struct Claim {
    allocation_id: String,
    shares: Vec<pb::ShareStatus>,
}

impl Shares {
    /// Sets the phase of every share of `uid` and tells the watchers.
    fn set_phase(&mut self, uid: &str, phase: pb::Phase, reason: &str) {
        let Some(claim) = self.by_claim.get_mut(uid) else {
            return;
        };
        for s in &mut claim.shares {
            s.phase = phase as i32;
            s.reason = reason.to_owned();
            s.device_status_json = device_status(s);
            // No watcher is not an error: the plugin may be between two instances.
            let _ = self.changes.send(s.clone());
        }
    }
}

/// The shares' lock; a panic while it is held leaves whole values.
fn lock(m: &Mutex<Shares>) -> std::sync::MutexGuard<'_, Shares> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The `AllocatedDeviceStatus` the plugin copies into the claim, shaped as the real
/// agent's (its two conditions and the limits), without the traffic figures.
fn device_status(s: &pb::ShareStatus) -> String {
    let enforced = s.phase == pb::Phase::Enforced as i32;
    let holds = s.phase != pb::Phase::Released as i32;
    let limits: serde_json::Map<String, serde_json::Value> = s
        .limits
        .iter()
        .map(|l| {
            (
                l.name.clone(),
                json!({"requested": l.requested, "enforced": l.enforced}),
            )
        })
        .collect();
    json!({
        "driver": s.driver,
        "pool": s.pool,
        "device": s.device,
        "shareID": s.share_id,
        "conditions": [{
            "type": "Enforced",
            "status": if enforced { "True" } else { "False" },
            "reason": if enforced { "Enforced" } else { "WaitingForPodSandbox" },
            "message": s.reason,
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }, {
            "type": "Admitted",
            "status": if holds { "True" } else { "False" },
            "reason": "CapacityHeld",
            "message": "the node's ledger holds the share's capacity",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }],
        "data": {"mechanism": s.mechanism, "limits": limits, "simulated": true},
    })
    .to_string()
}

#[derive(Clone)]
struct Service {
    devices: Arc<Vec<pb::DeviceStatus>>,
    epoch: Arc<AtomicU64>,
    shares: Arc<Mutex<Shares>>,
    enforce_after: Duration,
}

type Watch = Pin<Box<dyn Stream<Item = Result<pb::WatchSharesResponse, Status>> + Send>>;

fn unsupported(call: &str) -> Status {
    Status::unimplemented(format!(
        "{call}: not served by the simulated agent of the fleet simulation"
    ))
}

fn share_of(c: &pb::ClaimPrepare, a: &pb::DeviceAllocation) -> pb::ShareStatus {
    let mut s = pb::ShareStatus {
        share_id: a.share_id.clone(),
        claim: c.claim.clone(),
        driver: a.driver.clone(),
        pool: a.pool.clone(),
        device: a.device.clone(),
        request: a.request.clone(),
        phase: pb::Phase::Pending as i32,
        mechanism: "simulated".to_owned(),
        limits: a
            .consumed_capacity
            .iter()
            .map(|(name, q)| pb::CapacityLimit {
                name: name.clone(),
                requested: q.clone(),
                enforced: String::new(),
            })
            .collect(),
        policy_version: a.policy_version.clone(),
        allocation_id: c.allocation_id.clone(),
        admin_access: a.admin_access,
        reason: "no sandbox of the claim's pods on this node yet".to_owned(),
        pod_uids: c
            .target
            .as_ref()
            .map(|t| t.pod_uids.clone())
            .unwrap_or_default(),
        pre_bind: c.pre_bind,
        ..Default::default()
    };
    s.device_status_json = device_status(&s);
    s
}

fn watch_message(
    kind: pb::watch_shares_response::Kind,
    share: Option<pb::ShareStatus>,
) -> Result<pb::WatchSharesResponse, Status> {
    Ok(pb::WatchSharesResponse {
        kind: kind as i32,
        share,
    })
}

#[tonic::async_trait]
impl NodeAgent for Service {
    async fn prepare(
        &self,
        r: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareResponse>, Status> {
        let mut out = HashMap::new();
        let mut shares = lock(&self.shares);
        for c in r.into_inner().claims {
            let uid = c.claim.as_ref().map(|c| c.uid.clone()).unwrap_or_default();
            // A repeated Prepare of the same allocation answers what it answered before.
            let known = shares
                .by_claim
                .get(&uid)
                .filter(|k| k.allocation_id == c.allocation_id);
            if let Some(k) = known {
                out.insert(
                    uid,
                    pb::ClaimResult {
                        shares: k.shares.clone(),
                        ..Default::default()
                    },
                );
                continue;
            }
            let new: Vec<pb::ShareStatus> = c.allocations.iter().map(|a| share_of(&c, a)).collect();
            for s in &new {
                let _ = shares.changes.send(s.clone());
            }
            shares.by_claim.insert(
                uid.clone(),
                Claim {
                    allocation_id: c.allocation_id.clone(),
                    shares: new.clone(),
                },
            );
            let (state, after, id) = (self.shares.clone(), self.enforce_after, uid.clone());
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                lock(&state).set_phase(&id, pb::Phase::Enforced, "");
            });
            out.insert(
                uid,
                pb::ClaimResult {
                    shares: new,
                    ..Default::default()
                },
            );
        }
        Ok(Response::new(pb::PrepareResponse { claims: out }))
    }

    async fn unprepare(
        &self,
        r: Request<pb::UnprepareRequest>,
    ) -> Result<Response<pb::UnprepareResponse>, Status> {
        let mut shares = lock(&self.shares);
        let mut out = HashMap::new();
        for c in r.into_inner().claims {
            shares.set_phase(&c.uid, pb::Phase::Releasing, "kubelet unprepared the claim");
            shares.set_phase(&c.uid, pb::Phase::Released, "kubelet unprepared the claim");
            shares.by_claim.remove(&c.uid);
            out.insert(c.uid, pb::Error::default());
        }
        Ok(Response::new(pb::UnprepareResponse { claims: out }))
    }

    async fn get_share(
        &self,
        r: Request<pb::GetShareRequest>,
    ) -> Result<Response<pb::ShareStatus>, Status> {
        let id = r.into_inner().share_id;
        let shares = lock(&self.shares);
        shares
            .by_claim
            .values()
            .flat_map(|c| &c.shares)
            .find(|s| s.share_id == id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("share {id}: none on this simulated node")))
    }

    async fn list_shares(
        &self,
        _: Request<pb::ListSharesRequest>,
    ) -> Result<Response<pb::ListSharesResponse>, Status> {
        let shares = lock(&self.shares);
        Ok(Response::new(pb::ListSharesResponse {
            shares: shares
                .by_claim
                .values()
                .flat_map(|c| c.shares.clone())
                .collect(),
            next_page_token: String::new(),
        }))
    }

    type WatchSharesStream = Watch;

    async fn watch_shares(
        &self,
        _: Request<pb::WatchSharesRequest>,
    ) -> Result<Response<Watch>, Status> {
        // The snapshot and the subscription under one lock: no change falls between.
        let (snapshot, rx) = {
            let shares = lock(&self.shares);
            let snapshot: Vec<pb::ShareStatus> = shares
                .by_claim
                .values()
                .flat_map(|c| c.shares.clone())
                .collect();
            (snapshot, shares.changes.subscribe())
        };
        let head = snapshot
            .into_iter()
            .map(|s| watch_message(pb::watch_shares_response::Kind::Snapshot, Some(s)))
            .chain(std::iter::once(watch_message(
                pb::watch_shares_response::Kind::SnapshotEnd,
                None,
            )));
        // A watcher that fell behind gets an error and the stream ends: it watches again
        // and takes a new snapshot, as from the real agent.
        let changes = futures::stream::unfold(Some(rx), |rx| async move {
            let mut rx = rx?;
            match rx.recv().await {
                Ok(s) => Some((
                    watch_message(pb::watch_shares_response::Kind::Changed, Some(s)),
                    Some(rx),
                )),
                Err(broadcast::error::RecvError::Lagged(n)) => Some((
                    Err(Status::data_loss(format!(
                        "the watcher fell {n} changes behind; watch again"
                    ))),
                    None,
                )),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        });
        let stream = futures::stream::iter(head).chain(changes);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_devices(
        &self,
        _: Request<pb::ListDevicesRequest>,
    ) -> Result<Response<pb::ListDevicesResponse>, Status> {
        Ok(Response::new(pb::ListDevicesResponse {
            devices: self.devices.as_ref().clone(),
            epoch: self.epoch.load(Ordering::Acquire),
        }))
    }

    async fn new_epoch(
        &self,
        _: Request<pb::NewEpochRequest>,
    ) -> Result<Response<pb::NewEpochResponse>, Status> {
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        Ok(Response::new(pb::NewEpochResponse { epoch }))
    }

    async fn set_stage(
        &self,
        _: Request<pb::SetStageRequest>,
    ) -> Result<Response<pb::SetStageResponse>, Status> {
        Err(unsupported("SetStage"))
    }

    async fn get_slo(
        &self,
        _: Request<pb::GetSloRequest>,
    ) -> Result<Response<pb::GetSloResponse>, Status> {
        Err(unsupported("GetSlo"))
    }
}
