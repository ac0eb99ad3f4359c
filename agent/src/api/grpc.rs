//! The `shareguard.v1.NodeAgent` service: authenticates the caller, translates messages,
//! and hands every decision to the [`Engine`].

use std::{pin::Pin, sync::Arc};

use shareguard_proto::v1::{self as pb, node_agent_server::NodeAgent};
use tokio::sync::{broadcast::error::RecvError, mpsc};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status, transport::server::UdsConnectInfo};
use tracing::{debug, info_span};

use crate::{
    api::convert::{device_to_pb, outcome_to_pb, phase_from_pb, share_status},
    engine::{Engine, ShareFilter},
    error::{ClaimError, RequestError},
    request,
};

/// How many watch events may wait for a slow client before its stream falls behind and
/// is re-synchronised with a fresh snapshot.
const WATCH_QUEUE: usize = 256;

/// What a caller may do (I10). Each RPC needs one role; a caller has the highest role
/// one of its uid's lists gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// GetShare, ListShares, WatchShares, ListDevices, GetSlo: monitoring, read-only
    /// operators.
    ReadOnly,
    /// And Prepare, Unprepare, NewEpoch: the kubelet plugin.
    KubeletPlugin,
    /// Everything: the node's operators.
    Admin,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::ReadOnly => "read-only",
            Role::KubeletPlugin => "kubelet-plugin",
            Role::Admin => "admin",
        }
    }

    /// The role RPC `rpc` needs.
    pub fn needed_by(rpc: &str) -> Role {
        match rpc {
            "Prepare" | "Unprepare" | "NewEpoch" => Role::KubeletPlugin,
            "SetStage" => Role::Admin,
            "GetShare" | "ListShares" | "WatchShares" | "ListDevices" | "GetSlo" => Role::ReadOnly,
            // An RPC missing from this table needs the most, not the least.
            _ => Role::Admin,
        }
    }
}

pub struct Api {
    engine: Arc<Engine>,
    roles: Vec<(u32, Role)>,
    /// One permit per open WatchShares stream: each holds a queue and a task, so their
    /// number is bounded (`[agent] max_watchers`).
    watchers: Arc<tokio::sync::Semaphore>,
}

impl Api {
    pub fn new(engine: Arc<Engine>) -> Self {
        let a = &engine.config().agent;
        let roles = [
            (&a.allowed_uids, Role::Admin),
            (&a.plugin_uids, Role::KubeletPlugin),
            (&a.reader_uids, Role::ReadOnly),
        ]
        .iter()
        .flat_map(|(uids, role)| uids.iter().map(|u| (*u, *role)))
        .collect();
        let watchers = Arc::new(tokio::sync::Semaphore::new(
            engine.config().agent.max_watchers,
        ));
        Self {
            engine,
            roles,
            watchers,
        }
    }

    /// Callers are identified by the kernel's peer credentials on the unix socket, never
    /// by anything they say about themselves, and may call `rpc` only with its role.
    fn authenticate<T>(&self, req: &Request<T>, rpc: &'static str) -> Result<u32, RequestError> {
        let uid = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map(|c| c.uid())
            .ok_or(RequestError::Unauthenticated)?;
        let has = self
            .roles
            .iter()
            .filter(|(u, _)| *u == uid)
            .map(|(_, r)| *r)
            .max()
            .ok_or(RequestError::CallerNotAllowed { uid })?;
        let needs = Role::needed_by(rpc);
        if has < needs {
            return Err(RequestError::RoleTooLow {
                uid,
                rpc,
                has: has.name(),
                needs: needs.name(),
            });
        }
        Ok(uid)
    }

    fn caller<T>(&self, req: &Request<T>, rpc: &'static str) -> Result<u32, Status> {
        self.authenticate(req, rpc).map_err(|e| e.to_status())
    }

    /// For the mutating calls: a refused request is audited before it is answered.
    fn refuse(&self, rpc: &str, caller: Option<u32>, epoch: u64, e: RequestError) -> Status {
        self.engine.audit_request_refusal(rpc, caller, epoch, &e);
        e.to_status()
    }
}

fn filter(device: &str, namespace: &str, phase: i32) -> Result<ShareFilter, Status> {
    let phase = match pb::Phase::try_from(phase) {
        Ok(pb::Phase::Unspecified) => None,
        Ok(p) => phase_from_pb(p),
        Err(_) => {
            return Err(RequestError::Invalid {
                field: "phase".into(),
                message: format!("{phase} is not a Phase"),
            }
            .to_status());
        }
    };
    let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    Ok(ShareFilter {
        device: opt(device),
        namespace: opt(namespace),
        phase,
    })
}

fn unprepare_entry(e: Option<&ClaimError>) -> pb::Error {
    e.map(crate::api::convert::error_to_pb).unwrap_or_default()
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchSharesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl NodeAgent for Api {
    async fn prepare(
        &self,
        req: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareResponse>, Status> {
        let epoch = req.get_ref().epoch;
        let uid = self
            .authenticate(&req, "Prepare")
            .map_err(|e| self.refuse("Prepare", None, epoch, e))?;
        let r = req.into_inner();
        // On a task of its own: a client that goes away (or whose deadline passes, which
        // makes tonic drop this handler) must not leave the work half done. The task
        // runs to a consistent end, holding each claim's lock until then.
        let engine = self.engine.clone();
        let claims: Vec<request::ClaimPrepare> = r.claims.into_iter().map(Into::into).collect();
        let outcomes = tokio::spawn(async move { engine.prepare(r.epoch, &claims, uid).await })
            .await
            .map_err(|e| Status::internal(format!("prepare task failed: {e}")))?
            .map_err(|e| self.refuse("Prepare", Some(uid), epoch, e))?;
        let claims = outcomes
            .iter()
            .map(|o| (o.uid.clone(), outcome_to_pb(o)))
            .collect();
        Ok(Response::new(pb::PrepareResponse { claims }))
    }

    async fn unprepare(
        &self,
        req: Request<pb::UnprepareRequest>,
    ) -> Result<Response<pb::UnprepareResponse>, Status> {
        let epoch = req.get_ref().epoch;
        let uid = self
            .authenticate(&req, "Unprepare")
            .map_err(|e| self.refuse("Unprepare", None, epoch, e))?;
        let r = req.into_inner();
        // As for Prepare: a release that started runs to its end whatever the client does.
        let engine = self.engine.clone();
        let claims: Vec<request::ClaimRef> = r.claims.into_iter().map(Into::into).collect();
        let only_pre_bind = r.only_pre_bind;
        let results =
            tokio::spawn(
                async move { engine.unprepare(r.epoch, &claims, uid, only_pre_bind).await },
            )
            .await
            .map_err(|e| Status::internal(format!("unprepare task failed: {e}")))?
            .map_err(|e| self.refuse("Unprepare", Some(uid), epoch, e))?;
        let claims = results
            .iter()
            .map(|(uid, e)| (uid.clone(), unprepare_entry(e.as_ref())))
            .collect();
        Ok(Response::new(pb::UnprepareResponse { claims }))
    }

    async fn get_share(
        &self,
        req: Request<pb::GetShareRequest>,
    ) -> Result<Response<pb::ShareStatus>, Status> {
        self.caller(&req, "GetShare")?;
        let id = req.into_inner().share_id;
        let _span = info_span!("get_share", share = %id).entered();
        self.engine
            .get_share(&id)
            .map(|r| Response::new(share_status(&self.engine, &r)))
            .ok_or_else(|| RequestError::NotFound(id).to_status())
    }

    async fn list_shares(
        &self,
        req: Request<pb::ListSharesRequest>,
    ) -> Result<Response<pb::ListSharesResponse>, Status> {
        self.caller(&req, "ListShares")?;
        let r = req.into_inner();
        let f = filter(&r.device, &r.namespace, r.phase)?;
        let after = match r.page_token.as_str() {
            "" => None,
            t => Some(crate::engine::page::Position::from_token(t).map_err(|e| {
                RequestError::Invalid {
                    field: "page_token".into(),
                    message: e.to_string(),
                }
                .to_status()
            })?),
        };
        let (page, next) =
            self.engine
                .list_page(&f, after.as_ref(), crate::engine::page::size(r.page_size));
        let shares = page.iter().map(|r| share_status(&self.engine, r)).collect();
        Ok(Response::new(pb::ListSharesResponse {
            shares,
            next_page_token: next.map(|p| p.token()).unwrap_or_default(),
        }))
    }

    type WatchSharesStream = WatchStream;

    async fn watch_shares(
        &self,
        req: Request<pb::WatchSharesRequest>,
    ) -> Result<Response<Self::WatchSharesStream>, Status> {
        self.caller(&req, "WatchShares")?;
        let r = req.into_inner();
        let f = filter(&r.device, &r.namespace, 0)?;
        let permit = self.watchers.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "{} WatchShares streams are open, the most this agent serves at once (max_watchers)",
                self.engine.config().agent.max_watchers
            ))
        })?;
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let engine = self.engine.clone();
        tokio::spawn(async move {
            // Held until the stream ends, which includes the client going away.
            let _permit = permit;
            let send = |kind: pb::watch_shares_response::Kind, share: Option<pb::ShareStatus>| {
                let tx = tx.clone();
                async move {
                    tx.send(Ok(pb::WatchSharesResponse {
                        kind: kind as i32,
                        share,
                    }))
                    .await
                    .is_ok()
                }
            };
            'resync: loop {
                let (snapshot, mut events) = engine.subscribe(&f);
                for r in &snapshot {
                    if !send(
                        pb::watch_shares_response::Kind::Snapshot,
                        Some(share_status(&engine, r)),
                    )
                    .await
                    {
                        return;
                    }
                }
                if !send(pb::watch_shares_response::Kind::SnapshotEnd, None).await {
                    return;
                }
                loop {
                    // A client that leaves while nothing changes must still free its
                    // slot: wait for either.
                    let ev = tokio::select! {
                        ev = events.recv() => ev,
                        () = tx.closed() => return,
                    };
                    match ev {
                        Ok(r) if f.matches(&r) => {
                            if !send(
                                pb::watch_shares_response::Kind::Changed,
                                Some(share_status(&engine, &r)),
                            )
                            .await
                            {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(RecvError::Lagged(n)) => {
                            debug!(missed = n, "watcher fell behind; sending a fresh snapshot");
                            continue 'resync;
                        }
                        Err(RecvError::Closed) => return,
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_devices(
        &self,
        req: Request<pb::ListDevicesRequest>,
    ) -> Result<Response<pb::ListDevicesResponse>, Status> {
        self.caller(&req, "ListDevices")?;
        let devices = self.engine.devices().iter().map(device_to_pb).collect();
        Ok(Response::new(pb::ListDevicesResponse {
            devices,
            epoch: self.engine.epoch(),
        }))
    }

    async fn get_slo(
        &self,
        req: Request<pb::GetSloRequest>,
    ) -> Result<Response<pb::GetSloResponse>, Status> {
        self.caller(&req, "GetSlo")?;
        let class = req.into_inner().device_class;
        let only = (!class.is_empty()).then_some(class.as_str());
        let classes = self
            .engine
            .slo(only)
            .map_err(|e| e.to_status())?
            .iter()
            .map(crate::api::convert::class_slo_to_pb)
            .collect();
        Ok(Response::new(pb::GetSloResponse { classes }))
    }

    async fn new_epoch(
        &self,
        req: Request<pb::NewEpochRequest>,
    ) -> Result<Response<pb::NewEpochResponse>, Status> {
        let uid = self
            .authenticate(&req, "NewEpoch")
            .map_err(|e| self.refuse("NewEpoch", None, 0, e))?;
        // On a task of its own, as Prepare: a taken epoch is made durable to the end.
        let engine = self.engine.clone();
        let epoch = tokio::spawn(async move { engine.new_epoch(Some(uid)).await })
            .await
            .map_err(|e| Status::internal(format!("new epoch task failed: {e}")))?
            .map_err(|e| self.refuse("NewEpoch", Some(uid), 0, e))?;
        Ok(Response::new(pb::NewEpochResponse { epoch }))
    }

    async fn set_stage(
        &self,
        req: Request<pb::SetStageRequest>,
    ) -> Result<Response<pb::SetStageResponse>, Status> {
        let uid = self
            .authenticate(&req, "SetStage")
            .map_err(|e| self.refuse("SetStage", None, 0, e))?;
        let r = req.into_inner();
        let stage = crate::rollout::Stage::parse(&r.stage).ok_or_else(|| {
            self.refuse(
                "SetStage",
                Some(uid),
                0,
                RequestError::Invalid {
                    field: "stage".into(),
                    message: format!("{:?} is not \"observe\" or \"enforce\"", r.stage),
                },
            )
        })?;
        let invalid = |message: &str| {
            self.refuse(
                "SetStage",
                Some(uid),
                0,
                RequestError::Invalid {
                    field: "device".into(),
                    message: message.into(),
                },
            )
        };
        let target = match (r.device.is_empty(), r.device_class.is_empty()) {
            (false, true) => StageTarget::Device(r.device),
            (true, false) => StageTarget::Class(r.device_class),
            (true, true) => return Err(invalid("give a device or a device_class")),
            (false, false) => return Err(invalid("give a device or a device_class, not both")),
        };
        // On a task of its own, as Prepare: a stage change runs to its end.
        let engine = self.engine.clone();
        let changes = tokio::spawn(async move {
            match target {
                StageTarget::Device(d) => engine
                    .set_stage(&d, stage, Some(uid))
                    .await
                    .map(|c| vec![c]),
                StageTarget::Class(c) => engine.set_class_stage(&c, stage, Some(uid)).await,
            }
        })
        .await
        .map_err(|e| Status::internal(format!("stage task failed: {e}")))?
        .map_err(|e| self.refuse("SetStage", Some(uid), 0, e))?;
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        let changes: Vec<pb::StageChange> = changes
            .into_iter()
            .map(|c| pb::StageChange {
                device: c.device,
                previous: c.previous.name().to_owned(),
                stage: c.stage.name().to_owned(),
                shares_changed: count(c.shares_changed),
                shares_failed: count(c.shares_failed),
            })
            .collect();
        let first = changes.first().cloned().unwrap_or_default();
        let single = changes.len() == 1;
        Ok(Response::new(pb::SetStageResponse {
            device: if single { first.device } else { String::new() },
            previous: if single {
                first.previous
            } else {
                String::new()
            },
            stage: first.stage,
            shares_changed: changes
                .iter()
                .map(|c| c.shares_changed)
                .fold(0, u32::saturating_add),
            shares_failed: changes
                .iter()
                .map(|c| c.shares_failed)
                .fold(0, u32::saturating_add),
            changes,
        }))
    }
}

/// What a SetStage names.
enum StageTarget {
    Device(String),
    Class(String),
}
