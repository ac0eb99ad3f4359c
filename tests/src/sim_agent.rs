//! A SIMULATED node agent, for the fleet simulation (benches/fleet.rs): it serves the
//! `NodeAgent` API on a unix socket as a node's agent would to its kubelet plugin, from
//! an inventory a real agent reported once (its pools renamed for this node), and keeps
//! no share: a plugin at rest asks it for the inventory, an epoch and a watch of shares,
//! and that is all the simulation needs from it. It limits nothing and persists nothing;
//! nothing outside the fleet simulation uses it.

use std::{
    path::Path,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use futures::{Stream, StreamExt};
use shareguard_proto::v1::{
    self as pb,
    node_agent_server::{NodeAgent, NodeAgentServer},
};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

/// One simulated node's agent, served until dropped.
pub struct SimAgent {
    epoch: Arc<AtomicU64>,
    _stop: oneshot::Sender<()>,
}

impl SimAgent {
    /// Serves on `socket` the devices of `inventory` as node `node`'s: each device's pool
    /// is the node's name, as a real agent's is unless its config names one.
    pub fn serve(socket: &Path, node: &str, inventory: &pb::ListDevicesResponse) -> SimAgent {
        let listener = tokio::net::UnixListener::bind(socket)
            .unwrap_or_else(|e| panic!("bind {}: {e}", socket.display()));
        let mut devices = inventory.devices.clone();
        for d in &mut devices {
            d.pool = node.to_owned();
        }
        let epoch = Arc::new(AtomicU64::new(0));
        let service = Service {
            devices: Arc::new(devices),
            epoch: epoch.clone(),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(NodeAgentServer::new(service))
                .serve_with_incoming_shutdown(shareguard_uds::incoming(listener), async {
                    let _ = stopped.await;
                }),
        );
        SimAgent { epoch, _stop: stop }
    }

    /// The highest epoch taken so far (0: none).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
}

#[derive(Clone)]
struct Service {
    devices: Arc<Vec<pb::DeviceStatus>>,
    epoch: Arc<AtomicU64>,
}

type Watch = Pin<Box<dyn Stream<Item = Result<pb::WatchSharesResponse, Status>> + Send>>;

fn unsupported(call: &str) -> Status {
    Status::unimplemented(format!(
        "{call}: the simulated agent of the fleet simulation holds no share"
    ))
}

#[tonic::async_trait]
impl NodeAgent for Service {
    async fn prepare(
        &self,
        _: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareResponse>, Status> {
        Err(unsupported("Prepare"))
    }

    async fn unprepare(
        &self,
        _: Request<pb::UnprepareRequest>,
    ) -> Result<Response<pb::UnprepareResponse>, Status> {
        Err(unsupported("Unprepare"))
    }

    async fn get_share(
        &self,
        r: Request<pb::GetShareRequest>,
    ) -> Result<Response<pb::ShareStatus>, Status> {
        Err(Status::not_found(format!(
            "share {}: none on this simulated node",
            r.into_inner().share_id
        )))
    }

    async fn list_shares(
        &self,
        _: Request<pb::ListSharesRequest>,
    ) -> Result<Response<pb::ListSharesResponse>, Status> {
        Ok(Response::new(pb::ListSharesResponse::default()))
    }

    type WatchSharesStream = Watch;

    async fn watch_shares(
        &self,
        _: Request<pb::WatchSharesRequest>,
    ) -> Result<Response<Watch>, Status> {
        // An empty snapshot, then no change for as long as the plugin watches.
        let end = pb::WatchSharesResponse {
            kind: pb::watch_shares_response::Kind::SnapshotEnd as i32,
            share: None,
        };
        let stream =
            futures::stream::once(async move { Ok(end) }).chain(futures::stream::pending());
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
