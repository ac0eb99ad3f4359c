//! The plugin's side of the node agent's API: one channel that redials the socket after
//! the agent restarts, and this plugin instance's epoch.

use std::{
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use shareguard_proto::v1::{self as pb, node_agent_client::NodeAgentClient};
use tonic::{Code, transport::Channel};
use tracing::{info, warn};

use crate::error::ClaimError;

/// How long one call to the agent may take. kubelet gives a whole NodePrepareResources
/// 45 s; the agent answers Prepare once the claim is durable, in milliseconds, and its
/// own deadline for anything slow (a GPU driver call) is below this.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Agent {
    client: NodeAgentClient<Channel>,
    epoch: u64,
    fenced: AtomicBool,
}

impl Agent {
    /// Waits for the agent, takes a new epoch, which fences the instance this one
    /// replaces at once, and reads the inventory.
    /// Fails at once when the agent answers but refuses the plugin (its uid is not in
    /// the agent's `allowed_uids`) or does not know the calls (an older agent): waiting
    /// would not help.
    pub async fn start(socket: &Path) -> Result<(Self, pb::ListDevicesResponse), tonic::Status> {
        let client = NodeAgentClient::new(shareguard_uds::client::lazy(socket));
        let mut delay = Duration::from_millis(100);
        let mut waited = Duration::ZERO;
        let mut warned = false;
        loop {
            match Self::first_calls(&client).await {
                Ok((epoch, inventory)) => {
                    info!(epoch, socket = %socket.display(), "connected to the node agent");
                    let agent = Self {
                        client,
                        epoch,
                        fenced: AtomicBool::new(false),
                    };
                    return Ok((agent, inventory));
                }
                Err(e)
                    if matches!(
                        e.code(),
                        Code::PermissionDenied | Code::Unauthenticated | Code::Unimplemented
                    ) =>
                {
                    return Err(e);
                }
                Err(e) => {
                    // The agent is a sibling container or unit that may start later.
                    if !warned || waited >= Duration::from_secs(30) {
                        warn!(socket = %socket.display(), error = %e.message(), "waiting for the node agent");
                        warned = true;
                        waited = Duration::ZERO;
                    }
                    tokio::time::sleep(delay).await;
                    waited += delay;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    async fn first_calls(
        client: &NodeAgentClient<Channel>,
    ) -> Result<(u64, pb::ListDevicesResponse), tonic::Status> {
        let epoch = client
            .clone()
            .new_epoch(pb::NewEpochRequest {})
            .await?
            .into_inner()
            .epoch;
        let inventory = client
            .clone()
            .list_devices(pb::ListDevicesRequest {})
            .await?
            .into_inner();
        Ok((epoch, inventory))
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Relaxed)
    }

    pub async fn list_devices(&self) -> Result<pb::ListDevicesResponse, ClaimError> {
        let mut req = tonic::Request::new(pb::ListDevicesRequest {});
        req.set_timeout(CALL_TIMEOUT);
        self.client
            .clone()
            .list_devices(req)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error(&s))
    }

    pub async fn prepare(
        &self,
        claims: Vec<pb::ClaimPrepare>,
    ) -> Result<pb::PrepareResponse, ClaimError> {
        if self.is_fenced() {
            return Err(ClaimError::Fenced(self.epoch));
        }
        let mut req = tonic::Request::new(pb::PrepareRequest {
            epoch: self.epoch,
            claims,
        });
        req.set_timeout(CALL_TIMEOUT);
        self.client
            .clone()
            .prepare(req)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error(&s))
    }

    pub async fn unprepare(
        &self,
        claims: Vec<pb::ClaimRef>,
    ) -> Result<pb::UnprepareResponse, ClaimError> {
        if self.is_fenced() {
            return Err(ClaimError::Fenced(self.epoch));
        }
        let mut req = tonic::Request::new(pb::UnprepareRequest {
            epoch: self.epoch,
            claims,
        });
        req.set_timeout(CALL_TIMEOUT);
        self.client
            .clone()
            .unprepare(req)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error(&s))
    }

    /// A stream of share changes: the snapshot, its end marker, then every change.
    pub async fn watch(&self) -> Result<tonic::Streaming<pb::WatchSharesResponse>, ClaimError> {
        self.client
            .clone()
            .watch_shares(pb::WatchSharesRequest::default())
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| self.call_error(&s))
    }

    /// A per-claim error of the agent's answer; notes a stale epoch.
    pub fn claim_error(&self, e: &pb::Error) -> ClaimError {
        if is_stale_epoch(&e.code, &e.field) {
            self.fence();
            return ClaimError::Fenced(self.epoch);
        }
        let mut text = format!("{}: {}", e.code, e.message);
        if !e.field.is_empty() {
            text.push_str(&format!(" (field {})", e.field));
        }
        if e.retryable {
            text.push_str("; retryable");
        }
        ClaimError::Refused(text)
    }

    fn call_error(&self, s: &tonic::Status) -> ClaimError {
        // The agent answers a whole request with FailedPrecondition only for a stale
        // epoch (see its RequestError::code).
        if s.code() == Code::FailedPrecondition {
            self.fence();
            return ClaimError::Fenced(self.epoch);
        }
        ClaimError::Agent {
            code: s.code(),
            message: s.message().to_owned(),
        }
    }

    fn fence(&self) {
        if !self.fenced.swap(true, Ordering::Relaxed) {
            warn!(
                epoch = self.epoch,
                "the agent follows a newer kubelet plugin instance; this one is fenced"
            );
        }
    }
}

/// The agent refuses a claim of an older epoch with FailedPrecondition on field `epoch`.
fn is_stale_epoch(code: &str, field: &str) -> bool {
    code == "FailedPrecondition" && field == "epoch"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_precondition_on_the_epoch_fences() {
        assert!(is_stale_epoch("FailedPrecondition", "epoch"));
        assert!(!is_stale_epoch(
            "FailedPrecondition",
            "claims[0].allocation_id"
        ));
        assert!(!is_stale_epoch("ResourceExhausted", "epoch"));
    }
}
