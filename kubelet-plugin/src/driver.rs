//! One driver's NodePrepareResources and NodeUnprepareResources: read each claim from
//! the API server, check it against this node's devices, and hand the claims to the
//! agent in one call. Every claim kubelet named gets an answer.

use std::{
    collections::HashMap,
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use futures::future::join_all;
use k8s_openapi::api::resource::v1::ResourceClaim;
use shareguard_proto::v1 as pb;
use tracing::{Instrument, info, info_span, warn};

use crate::{
    agent::Agent,
    answer::{Answers, Caller, DeviceAnswer},
    claims::{self, KubeletDevice, Prepared, SeenClaims},
    cluster::Cluster,
    error::ClaimError,
    events::Events,
    forward::Successors,
    inventory::DriverDevices,
    policy::PolicySnapshot,
};

/// Why the binding gate did not admit a claim.
#[derive(Debug)]
pub enum GateRefusal {
    /// This instance is fenced: the newer one decides.
    Fenced(u64),
    /// The claim, the agent or the API server refused it; `code` is the agent's.
    Refused {
        code: Option<String>,
        error: ClaimError,
    },
}

/// kubelet gives a whole call 45 s; an answer after that is thrown away, so the plugin
/// answers with an error (kubelet calls again) well before.
const CALL_DEADLINE: Duration = Duration::from_secs(35);

/// This node's devices of the driver, and the policy snapshot published for them.
#[derive(Clone, Debug, Default)]
pub struct Devices {
    pub devices: DriverDevices,
    pub policy: PolicySnapshot,
}

impl Devices {
    pub fn new(devices: DriverDevices) -> Self {
        let policy = PolicySnapshot::of(&devices);
        Self { devices, policy }
    }
}

pub struct Driver {
    name: String,
    agent: Arc<Agent>,
    cluster: Cluster,
    devices: RwLock<Arc<Devices>>,
    /// Where calls go once this instance is fenced.
    successors: Successors,
    /// Where a refused claim is told to its owner.
    events: Events,
    /// What its reads of a claim found, for Events and the status writer.
    seen: SeenClaims,
    /// Calls being answered now. kubelet drops its connection to an instance as soon
    /// as it unregisters, failing the calls still on it: a stop waits for these first.
    in_flight: tokio::sync::watch::Sender<usize>,
}

/// One call counted in [`Driver`]'s `in_flight` while it lives.
struct InFlight<'a>(&'a tokio::sync::watch::Sender<usize>);

impl<'a> InFlight<'a> {
    fn start(calls: &'a tokio::sync::watch::Sender<usize>) -> Self {
        calls.send_modify(|n| *n += 1);
        Self(calls)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Driver {
    /// `successors` finds the instances that may replace this one.
    pub fn new(
        name: &str,
        agent: Arc<Agent>,
        cluster: Cluster,
        devices: Devices,
        successors: Successors,
        events: Events,
        seen: SeenClaims,
    ) -> Self {
        Self {
            name: name.to_owned(),
            agent,
            cluster,
            devices: RwLock::new(Arc::new(devices)),
            successors,
            events,
            seen,
            in_flight: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Resolves once no call is being answered.
    pub async fn idle(&self) {
        let mut rx = self.in_flight.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn successors(&self) -> &Successors {
        &self.successors
    }

    /// The devices and policy snapshot served now.
    pub fn devices_now(&self) -> Arc<Devices> {
        self.devices()
    }

    fn devices(&self) -> Arc<Devices> {
        // A poisoned lock only means a writer panicked after the swap; the value is whole.
        self.devices
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn set_devices(&self, devices: Devices) {
        *self
            .devices
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(devices);
    }

    pub async fn prepare(
        &self,
        claims: &[pb::ClaimRef],
        caller: Caller,
    ) -> Answers<Vec<DeviceAnswer>> {
        let _call = InFlight::start(&self.in_flight);
        let started = Instant::now();
        if caller == Caller::Kubelet
            && self.agent.is_fenced()
            && let Some(a) = self.pass_on_prepare(claims, started).await
        {
            return a;
        }
        let answers = self.prepare_bounded(claims).await;
        // Fenced during this call: the agent refused the whole request before it
        // changed anything, so the successor can do all of it.
        if caller == Caller::Kubelet
            && self.agent.is_fenced()
            && let Some(a) = self.pass_on_prepare(claims, started).await
        {
            return a;
        }
        answers
    }

    async fn pass_on_prepare(
        &self,
        claims: &[pb::ClaimRef],
        started: Instant,
    ) -> Option<Answers<Vec<DeviceAnswer>>> {
        let left = CALL_DEADLINE.checked_sub(started.elapsed())?;
        self.successors
            .prepare(claims, self.agent.epoch(), left)
            .await
    }

    async fn prepare_bounded(&self, claims: &[pb::ClaimRef]) -> Answers<Vec<DeviceAnswer>> {
        match tokio::time::timeout(CALL_DEADLINE, self.prepare_all(claims)).await {
            Ok(answers) => answers,
            Err(_) => claims
                .iter()
                .map(|c| {
                    warn!(claim = %c.name, claim_uid = %c.uid, "prepare timed out");
                    (
                        c.uid.clone(),
                        Err(format!("preparing took longer than {CALL_DEADLINE:?}")),
                    )
                })
                .collect(),
        }
    }

    async fn prepare_all(&self, claims: &[pb::ClaimRef]) -> Answers<Vec<DeviceAnswer>> {
        let devices = self.devices();
        let built = join_all(claims.iter().map(|c| {
            let span = info_span!("prepare", claim = %format!("{}/{}", c.namespace, c.name), claim_uid = %c.uid);
            self.build(c, &devices).instrument(span)
        }))
        .await;
        let mut answers = Vec::with_capacity(claims.len());
        let mut asked: Vec<(&pb::ClaimRef, Vec<KubeletDevice>)> = Vec::new();
        let mut requests = Vec::new();
        for (c, b) in claims.iter().zip(built) {
            match b {
                Ok(Prepared { request, devices }) => {
                    requests.push(request);
                    asked.push((c, devices));
                }
                Err(e) => {
                    warn!(claim = %c.name, claim_uid = %c.uid, error = %e, "claim not prepared");
                    self.tell_refused(c, None, &e);
                    answers.push((c.uid.clone(), Err(e.to_string())));
                }
            }
        }
        if requests.is_empty() {
            return answers;
        }
        let mut results = match self.agent.prepare(requests).await {
            Ok(r) => r.claims,
            Err(e) => {
                warn!(error = %e, "the agent's Prepare failed");
                let code = match &e {
                    ClaimError::Agent { code, .. } if *code == tonic::Code::Unavailable => {
                        Some("Unavailable")
                    }
                    _ => None,
                };
                for (c, _) in &asked {
                    self.tell_refused(c, code, &e);
                }
                answers.extend(
                    asked
                        .iter()
                        .map(|(c, _)| (c.uid.clone(), Err(e.to_string()))),
                );
                return answers;
            }
        };
        for (c, devices) in asked {
            let _span = info_span!("prepare", claim = %format!("{}/{}", c.namespace, c.name), claim_uid = %c.uid).entered();
            let answer = match results.remove(&c.uid) {
                None => Err("the node agent gave no answer for the claim".to_owned()),
                Some(r) => match r.error.as_ref().filter(|e| !e.code.is_empty()) {
                    Some(e) => {
                        let err = self.agent.claim_error(e);
                        self.tell_refused(c, Some(&e.code), &err);
                        Err(err.to_string())
                    }
                    None => Ok(answer_devices(devices, &r)),
                },
            };
            match &answer {
                Ok(d) => info!(
                    shares = ?d.iter().filter_map(|d| d.share_id.as_deref()).collect::<Vec<_>>(),
                    "prepared"
                ),
                Err(e) => warn!(error = %e, "the agent refused the claim"),
            }
            answers.push((c.uid.clone(), answer));
        }
        answers
    }

    /// The binding gate's Prepare of `claim` (as the gate just read it; `c` names it),
    /// before the scheduler binds its pod (`pre_bind`): the agent holds the capacity or
    /// refuses. Never passed on: a fenced instance leaves the claim to the instance that
    /// fenced it, whose gate sees the same pod. A refusal is told in Events as kubelet's
    /// would be; the error carries the agent's code where it gave one.
    pub async fn admit_before_binding(
        &self,
        claim: &ResourceClaim,
        c: &pb::ClaimRef,
    ) -> Result<(), GateRefusal> {
        let _call = InFlight::start(&self.in_flight);
        let refused = |code: Option<String>, e: ClaimError| {
            self.tell_refused(c, code.as_deref(), &e);
            GateRefusal::Refused { code, error: e }
        };
        let devices = self.devices();
        let Prepared { mut request, .. } = self
            .build_from(claim, c, &devices)
            .map_err(|e| refused(None, e))?;
        request.pre_bind = true;
        let mut results = match self.agent.prepare(vec![request]).await {
            Ok(r) => r.claims,
            Err(ClaimError::Fenced(epoch)) => return Err(GateRefusal::Fenced(epoch)),
            Err(e) => {
                let code = match &e {
                    ClaimError::Agent { code, .. } if *code == tonic::Code::Unavailable => {
                        Some("Unavailable".to_owned())
                    }
                    _ => None,
                };
                return Err(refused(code, e));
            }
        };
        match results.remove(&c.uid) {
            None => Err(refused(
                None,
                ClaimError::Refused("the node agent gave no answer for the claim".into()),
            )),
            Some(r) => match r.error.as_ref().filter(|e| !e.code.is_empty()) {
                None => Ok(()),
                Some(e) => match self.agent.claim_error(e) {
                    ClaimError::Fenced(epoch) => Err(GateRefusal::Fenced(epoch)),
                    err => Err(refused(Some(e.code.clone()), err)),
                },
            },
        }
    }

    /// An Event on the claim and its pods for a refusal, unless this instance was only
    /// replaced (the call is passed on, and the successor answers it).
    fn tell_refused(&self, c: &pb::ClaimRef, code: Option<&str>, e: &ClaimError) {
        // The status writer forgets a claim once its shares are released; a refused
        // claim may have none to be forgotten with. Read again if kubelet retries.
        self.seen.forget(&c.uid);
        if matches!(e, ClaimError::Fenced(_)) {
            return;
        }
        let message = match e {
            // The agent's words without the plugin's preamble.
            ClaimError::Refused(text) => text.clone(),
            other => other.to_string(),
        };
        self.events.refused(c, &self.name, code, &message);
    }

    async fn build(&self, c: &pb::ClaimRef, devices: &Devices) -> Result<Prepared, ClaimError> {
        if c.uid.is_empty() || c.namespace.is_empty() || c.name.is_empty() {
            return Err(ClaimError::claim(
                &c.namespace,
                &c.name,
                "kubelet sent a claim without uid, namespace or name",
            ));
        }
        let claim = self.cluster.claim(&c.namespace, &c.name).await?;
        self.build_from(&claim, c, devices)
    }

    /// [`Driver::build`] from a claim already read.
    fn build_from(
        &self,
        claim: &ResourceClaim,
        c: &pb::ClaimRef,
        devices: &Devices,
    ) -> Result<Prepared, ClaimError> {
        // The pods are taken from the claim as they are, with no read of the Pods
        // (claims::pods says why that is enough).
        let reserved = claims::reserved_pods(claim);
        let pods = reserved.iter().map(|p| p.uid.clone()).collect();
        let prepared = claims::build(
            claim,
            c,
            &self.name,
            &devices.devices,
            &devices.policy,
            pods,
        )?;
        // The claim read is the one asked for (`claims::build` checked its uid): the
        // Events of its shares name these pods without reading it again.
        self.seen
            .read(&c.uid, reserved, claims::owning_pod(claim).is_some());
        Ok(prepared)
    }

    pub async fn unprepare(&self, claims: &[pb::ClaimRef], caller: Caller) -> Answers<()> {
        let _call = InFlight::start(&self.in_flight);
        let started = Instant::now();
        if caller == Caller::Kubelet
            && self.agent.is_fenced()
            && let Some(a) = self.pass_on_unprepare(claims, started).await
        {
            return a;
        }
        let answers = self.unprepare_own(claims).await;
        if caller == Caller::Kubelet
            && self.agent.is_fenced()
            && let Some(a) = self.pass_on_unprepare(claims, started).await
        {
            return a;
        }
        answers
    }

    async fn pass_on_unprepare(
        &self,
        claims: &[pb::ClaimRef],
        started: Instant,
    ) -> Option<Answers<()>> {
        let left = CALL_DEADLINE.checked_sub(started.elapsed())?;
        self.successors
            .unprepare(claims, self.agent.epoch(), left)
            .await
    }

    async fn unprepare_own(&self, claims: &[pb::ClaimRef]) -> Answers<()> {
        let span = info_span!("unprepare", claims = claims.len());
        async {
            let results = match tokio::time::timeout(
                CALL_DEADLINE,
                self.agent.unprepare(claims.to_vec()),
            )
            .await
            {
                Ok(Ok(r)) => r.claims,
                Ok(Err(e)) => return all_failed(claims, &e.to_string()),
                Err(_) => {
                    return all_failed(
                        claims,
                        &format!("unpreparing took longer than {CALL_DEADLINE:?}"),
                    );
                }
            };
            let mut results: HashMap<String, pb::Error> = results;
            claims
                .iter()
                .map(|c| {
                    let r = match results.remove(&c.uid) {
                        None => Err("the node agent gave no answer for the claim".to_owned()),
                        Some(e) if e.code.is_empty() => {
                            info!(claim = %format!("{}/{}", c.namespace, c.name), claim_uid = %c.uid, "unprepared");
                            self.seen.unprepared(&c.uid);
                            Ok(())
                        }
                        Some(e) => Err(self.agent.claim_error(&e).to_string()),
                    };
                    (c.uid.clone(), r)
                })
                .collect()
        }
        .instrument(span)
        .await
    }
}

fn all_failed(claims: &[pb::ClaimRef], why: &str) -> Answers<()> {
    warn!(error = %why, "the agent's Unprepare failed");
    claims
        .iter()
        .map(|c| (c.uid.clone(), Err(why.to_owned())))
        .collect()
}

/// kubelet's devices for an accepted claim, each with its share's CDI device ids. The
/// agent's shares are matched by the allocation result's full request name (a
/// subrequest's `req/sub`); kubelet gets the parent request's name.
fn answer_devices(devices: Vec<KubeletDevice>, r: &pb::ClaimResult) -> Vec<DeviceAnswer> {
    devices
        .into_iter()
        .map(|d| {
            let cdi_device_ids = r
                .shares
                .iter()
                .find(|s| {
                    s.share_id == d.share_id
                        && s.pool == d.pool
                        && s.device == d.device
                        && s.request == d.request
                })
                .map(|s| s.cdi_device_ids.clone())
                .unwrap_or_default();
            DeviceAnswer {
                request: claims::base_request(&d.request).to_owned(),
                pool: d.pool,
                device: d.device,
                share_id: (!d.share_id.is_empty()).then_some(d.share_id),
                cdi_device_ids,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(request: &str, share_id: &str) -> KubeletDevice {
        KubeletDevice {
            request: request.into(),
            pool: "node-a".into(),
            device: "nic-0".into(),
            share_id: share_id.into(),
        }
    }

    fn result(request: &str, share_id: &str, cdi: &str) -> pb::ClaimResult {
        pb::ClaimResult {
            shares: vec![pb::ShareStatus {
                request: request.into(),
                pool: "node-a".into(),
                device: "nic-0".into(),
                share_id: share_id.into(),
                cdi_device_ids: vec![cdi.into()],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    /// A `firstAvailable` subrequest's result names `req/sub`; kubelet matches a
    /// container's `resources.claims[].request` ("req") against the names it gets, so it
    /// must get "req". The agent's share (under the full name) still finds its CDI ids.
    #[test]
    fn a_subrequest_answers_with_its_parent_request() {
        let share = "3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
        let got = answer_devices(
            vec![device("net/fast", share)],
            &result("net/fast", share, "shareguard.example.com/share=x"),
        );
        assert_eq!(
            got,
            [DeviceAnswer {
                request: "net".into(),
                pool: "node-a".into(),
                device: "nic-0".into(),
                share_id: Some(share.into()),
                cdi_device_ids: vec!["shareguard.example.com/share=x".into()],
            }]
        );
        let plain = answer_devices(vec![device("net", "")], &result("net", "", "c"));
        assert_eq!(plain[0].request, "net");
        assert_eq!(plain[0].share_id, None, "a whole device has no share id");
        assert_eq!(plain[0].cdi_device_ids, ["c"]);
    }
}
