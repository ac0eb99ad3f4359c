//! The plugin's side of the node agent's API: one channel that redials the socket after
//! the agent restarts, and this plugin instance's epoch.

use std::{
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use shareguard_proto::v1::{self as pb, node_agent_client::NodeAgentClient};
use tokio::sync::watch;
use tonic::{Code, transport::Channel};
use tracing::{debug, info, warn};

use crate::error::ClaimError;

/// How long one call to the agent may take. kubelet gives a whole NodePrepareResources
/// 45 s; the agent answers Prepare once the claim is durable, in milliseconds, and its
/// own deadline for anything slow (a GPU driver call) is below this.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a Prepare or Unprepare waits for an agent that cannot be reached: well
/// inside the plugin's own deadline for kubelet's call (`driver::CALL_DEADLINE`).
const AGENT_WAIT: Duration = Duration::from_secs(25);
const FIRST_RETRY: Duration = Duration::from_millis(50);

pub struct Agent {
    client: NodeAgentClient<Channel>,
    /// Set by [`Agent::take_epoch`]; 0 until then, and no Prepare or Unprepare goes out
    /// with 0 (`Agent::check_epoch`).
    epoch: AtomicU64,
    /// Set once the agent follows a newer epoch than this instance's; never cleared.
    fenced: watch::Sender<bool>,
}

/// What a call gets from the transport when the agent is not there or stopped in the
/// middle of it (its pod replaced): no connection, or one closed under the call. The
/// agent itself answers with none of these (its errors map to other codes).
fn agent_went_away(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::Cancelled | Code::Unknown)
}

/// Refusals that waiting does not cure: the agent refuses the plugin (its uid is not
/// in the agent's `allowed_uids`) or does not know the call (an older agent).
fn refuses_for_good(code: Code) -> bool {
    matches!(
        code,
        Code::PermissionDenied | Code::Unauthenticated | Code::Unimplemented
    )
}

impl Agent {
    /// Waits for the agent and reads its inventory. Takes no epoch yet: the instance
    /// this one replaces keeps serving until [`Agent::take_epoch`].
    pub async fn connect(socket: &Path) -> Result<(Self, pb::ListDevicesResponse), tonic::Status> {
        let client = NodeAgentClient::new(shareguard_uds::client::lazy(socket));
        let mut delay = Duration::from_millis(100);
        let mut waited = Duration::ZERO;
        let mut warned = false;
        loop {
            match client.clone().list_devices(pb::ListDevicesRequest {}).await {
                Ok(inventory) => {
                    info!(socket = %socket.display(), "connected to the node agent");
                    let agent = Self {
                        client,
                        epoch: AtomicU64::new(0),
                        fenced: watch::Sender::new(false),
                    };
                    return Ok((agent, inventory.into_inner()));
                }
                Err(e) if refuses_for_good(e.code()) => return Err(e),
                Err(e) => {
                    // The agent runs in a pod of its own that may start later, or be
                    // replaced meanwhile (an update of its DaemonSet).
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

    /// Takes a new epoch, above every one the agent accepted. From here on the agent
    /// refuses the instance this one replaces, which passes kubelet's calls on to this
    /// one until kubelet has switched (`kubelet::forward`). Waits out an agent restart.
    pub async fn take_epoch(&self) -> Result<u64, tonic::Status> {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.client.clone().new_epoch(pb::NewEpochRequest {}).await {
                Ok(r) => {
                    let epoch = r.into_inner().epoch;
                    self.epoch.store(epoch, Ordering::Release);
                    info!(
                        epoch,
                        "took a new epoch; earlier plugin instances are fenced"
                    );
                    return Ok(epoch);
                }
                Err(e) if refuses_for_good(e.code()) => return Err(e),
                Err(e) => {
                    warn!(error = %e.message(), "taking an epoch from the node agent; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    pub fn is_fenced(&self) -> bool {
        *self.fenced.borrow()
    }

    /// Resolves once this instance is fenced.
    pub async fn fenced(&self) {
        let mut rx = self.fenced.subscribe();
        // The sender lives as long as `self`, so the wait ends only by a fence.
        let _ = rx.wait_for(|f| *f).await;
    }

    /// Notes the epoch a reading of the agent reported: one other than this instance's
    /// means a newer instance (or someone else) took an epoch since, or the agent lost
    /// its store; either way this instance's calls would be refused from now on.
    pub fn saw_epoch(&self, agent_epoch: u64) {
        let own = self.epoch();
        if own != 0 && agent_epoch != own {
            warn!(
                own,
                agent = agent_epoch,
                "the agent's epoch is no longer this instance's"
            );
            self.fence();
        }
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
        self.check_epoch()?;
        self.waiting_for_agent(|| {
            let mut req = tonic::Request::new(pb::PrepareRequest {
                epoch: self.epoch(),
                claims: claims.clone(),
            });
            req.set_timeout(CALL_TIMEOUT);
            let mut client = self.client.clone();
            async move { client.prepare(req).await }
        })
        .await
    }

    pub async fn unprepare(
        &self,
        claims: Vec<pb::ClaimRef>,
    ) -> Result<pb::UnprepareResponse, ClaimError> {
        self.unprepare_with(claims, false).await
    }

    /// Releases `claims` only while every share of each is still the binding gate's
    /// (`pre_bind`), decided by the agent under the claim's lock.
    pub async fn unprepare_pre_bind(
        &self,
        claims: Vec<pb::ClaimRef>,
    ) -> Result<pb::UnprepareResponse, ClaimError> {
        self.unprepare_with(claims, true).await
    }

    async fn unprepare_with(
        &self,
        claims: Vec<pb::ClaimRef>,
        only_pre_bind: bool,
    ) -> Result<pb::UnprepareResponse, ClaimError> {
        self.check_epoch()?;
        self.waiting_for_agent(|| {
            let mut req = tonic::Request::new(pb::UnprepareRequest {
                epoch: self.epoch(),
                claims: claims.clone(),
                only_pre_bind,
            });
            req.set_timeout(CALL_TIMEOUT);
            let mut client = self.client.clone();
            async move { client.unprepare(req).await }
        })
        .await
    }

    /// Refuses a mutating call of a fenced instance, or of one that has no epoch yet
    /// (its DRA socket serves from before it takes one, see `run`).
    fn check_epoch(&self) -> Result<(), ClaimError> {
        if self.is_fenced() {
            return Err(ClaimError::Fenced(self.epoch()));
        }
        if self.epoch() == 0 {
            return Err(ClaimError::Agent {
                code: Code::Unavailable,
                message: "this kubelet plugin instance has not taken its epoch yet".into(),
            });
        }
        Ok(())
    }

    /// Makes `call` until the agent answers, for at most [`AGENT_WAIT`]: an update of the
    /// agent's DaemonSet replaces its pod in seconds, and kubelet's call should not fail
    /// meanwhile. Calling again is safe: a Prepare or Unprepare the agent already did is
    /// answered from its store with no second effect.
    async fn waiting_for_agent<T, F, Fut>(&self, call: F) -> Result<T, ClaimError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let started = Instant::now();
        let mut delay = FIRST_RETRY;
        loop {
            match call().await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if agent_went_away(s.code()) && started.elapsed() + delay < AGENT_WAIT => {
                    // Once per call at info: an agent restart is worth a line, its
                    // retries are not.
                    if delay == FIRST_RETRY {
                        info!(error = %s.message(), wait_at_most = ?AGENT_WAIT, "the node agent is unavailable; waiting for it");
                    } else {
                        debug!(error = %s.message(), retry_in = ?delay, "the node agent is still unavailable");
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(1));
                }
                Err(s) => return Err(self.call_error(&s)),
            }
        }
    }

    /// Every share the agent holds, page by page.
    pub async fn list_shares(&self) -> Result<Vec<pb::ShareStatus>, ClaimError> {
        let mut out = Vec::new();
        let mut page_token = String::new();
        loop {
            let mut req = tonic::Request::new(pb::ListSharesRequest {
                page_size: 1000,
                page_token: page_token.clone(),
                ..Default::default()
            });
            req.set_timeout(CALL_TIMEOUT);
            let page = self
                .client
                .clone()
                .list_shares(req)
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| self.call_error(&s))?;
            out.extend(page.shares);
            if page.next_page_token.is_empty() {
                return Ok(out);
            }
            page_token = page.next_page_token;
        }
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
            return ClaimError::Fenced(self.epoch());
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
            return ClaimError::Fenced(self.epoch());
        }
        ClaimError::Agent {
            code: s.code(),
            message: s.message().to_owned(),
        }
    }

    fn fence(&self) {
        if !self.fenced.send_replace(true) {
            warn!(
                epoch = self.epoch(),
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
