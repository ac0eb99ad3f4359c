//! The gate's tasks: the watch of the unbound pods nominated to this node, one worker
//! per such pod that admits its claims, and the sweep of admitted shares whose claim
//! lost the allocation before any kubelet prepared them.
//!
//! API requests, per claim: one GET half a second after its pod is nominated (a few
//! more while the scheduler has not written the allocation yet, at most one per 250 ms
//! to 2 s), and
//! for a refusal one status apply; per node: one watch of pods, and one GET per gate
//! share still unprepared by kubelet each sweep, from the second sweep that finds it
//! (a share kubelet prepares within a sweep period costs none).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::Arc,
    time::Duration,
};

use futures::StreamExt;
use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{
    Api,
    api::{Patch, PatchParams},
    runtime::{WatchStreamExt, watcher},
};
use shareguard_proto::v1 as pb;
use tokio::{sync::watch, task::JoinSet, time::Instant};
use tracing::{Instrument, debug, info, info_span, warn};

use super::{
    decide::{Next, claim_names, decide},
    refusal,
    sweep::{Verdict, sweep_verdict},
};
use crate::{
    agent::Agent,
    cluster::Clients,
    driver::{Driver, GateRefusal},
    error::ClaimError,
    stop::until_stopped,
};

/// How long a worker keeps trying one pod: the scheduler's default binding timeout.
const GIVE_UP: Duration = Duration::from_secs(600);
/// The first look at a nominated pod's claims: PreBind writes the allocation and the
/// reservation right after the nomination, and a look at once found them unwritten for
/// most claims on the test cluster (a second GET each). Free for the pod: the scheduler
/// checks the binding conditions at once, before any plugin could have answered, and
/// then only 5 s later.
const FIRST_LOOK: Duration = Duration::from_millis(500);
const FIRST_RETRY: Duration = Duration::from_millis(250);
const MAX_RETRY: Duration = Duration::from_secs(2);
/// How often, at most, the gate's shares that kubelet has not prepared are checked.
const MAX_SWEEP_PERIOD: Duration = Duration::from_secs(30);

pub struct Gate {
    clients: Clients,
    node: String,
    agent: Arc<Agent>,
    drivers: Vec<Arc<Driver>>,
    sweep_every: Duration,
    /// The claims whose gate shares the last sweep found unprepared by kubelet.
    unprepared: Unprepared,
}

/// What became of one claim in one look.
enum Step {
    Done,
    Again,
}

impl Gate {
    /// `period`: the plugin's resync period; the sweep runs as often, at most every 30 s.
    pub fn new(
        clients: Clients,
        node: &str,
        agent: Arc<Agent>,
        drivers: Vec<Arc<Driver>>,
        period: Duration,
    ) -> Self {
        Self {
            clients,
            node: node.to_owned(),
            agent,
            drivers,
            sweep_every: period.min(MAX_SWEEP_PERIOD),
            unprepared: Unprepared::default(),
        }
    }

    /// Driver -> this node's pools of it, as published now.
    fn pools(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.drivers
            .iter()
            .map(|d| {
                let devices = d.devices_now();
                let pools = devices
                    .devices
                    .pools()
                    .keys()
                    .map(|p| (*p).to_owned())
                    .collect();
                (d.name().to_owned(), pools)
            })
            .collect()
    }

    /// Runs until `stop`.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        // Unbound pods the scheduler nominated here: it writes `nominatedNodeName`
        // before PreBind, where it waits for the binding conditions. A pod that is bound
        // (or nominated elsewhere) leaves the selection, which the watch reports as a
        // deletion.
        let fields = format!("status.nominatedNodeName={},spec.nodeName=", self.node);
        let watch = || {
            watcher::watcher(
                Api::<Pod>::all(self.clients.watches.clone()),
                watcher::Config::default().fields(&fields),
            )
            .default_backoff()
            .boxed()
        };
        let mut pods = watch();
        let mut workers: HashMap<String, tokio::task::AbortHandle> = HashMap::new();
        // The pods a relist (after the watch was lost) returned: a worker of a pod not
        // among them is stopped at its end, since no deletion was seen for it.
        let mut relisted: Option<BTreeSet<String>> = None;
        let mut tasks = JoinSet::new();
        let mut sweep = tokio::time::interval(self.sweep_every);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                ev = pods.next() => match ev {
                    Some(Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod))) => {
                        let Some(uid) = pod.metadata.uid.clone() else { continue };
                        if let Some(seen) = relisted.as_mut() {
                            seen.insert(uid.clone());
                        }
                        if workers.get(&uid).is_some_and(|h| !h.is_finished()) {
                            continue;
                        }
                        let span = info_span!(
                            "binding-gate",
                            pod = %format!("{}/{}", pod.metadata.namespace.as_deref().unwrap_or(""), pod.metadata.name.as_deref().unwrap_or("")),
                            pod_uid = %uid,
                        );
                        let me = self.clone();
                        let h = tasks.spawn(async move { me.admit_pod(pod).await }.instrument(span));
                        workers.insert(uid, h);
                    }
                    Some(Ok(watcher::Event::Delete(pod))) => {
                        if let Some(h) = pod.metadata.uid.and_then(|u| workers.remove(&u)) {
                            h.abort();
                        }
                    }
                    Some(Ok(watcher::Event::Init)) => relisted = Some(BTreeSet::new()),
                    Some(Ok(watcher::Event::InitDone)) => {
                        let seen = relisted.take().unwrap_or_default();
                        workers.retain(|uid, h| {
                            let keep = !h.is_finished() && seen.contains(uid);
                            if !keep {
                                h.abort();
                            }
                            keep
                        });
                    }
                    Some(Err(e)) => debug!(error = %e, "watching nominated pods; the watch restarts"),
                    None => pods = watch(),
                },
                Some(_) = tasks.join_next() => {}
                _ = sweep.tick() => self.sweep().await,
                () = until_stopped(&mut stop) => {
                    tasks.shutdown().await;
                    return;
                }
            }
        }
    }

    /// Admits each claim of the pod once the scheduler allocated and reserved it.
    async fn admit_pod(&self, pod: Pod) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let mut pending: BTreeSet<String> = claim_names(&pod).into_iter().collect();
        let started = Instant::now();
        let mut delay = FIRST_RETRY;
        // One claim's allocations already admitted by this worker: not asked again while
        // the status writer catches up.
        let mut admitted: BTreeSet<(String, String)> = BTreeSet::new();
        tokio::time::sleep(FIRST_LOOK).await;
        while !pending.is_empty() && started.elapsed() < GIVE_UP {
            for name in pending.clone() {
                if let Step::Done = self.claim_step(&ns, &name, &uid, &mut admitted).await {
                    pending.remove(&name);
                }
            }
            if pending.is_empty() {
                break;
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(MAX_RETRY);
        }
    }

    async fn claim_step(
        &self,
        ns: &str,
        name: &str,
        pod_uid: &str,
        admitted: &mut BTreeSet<(String, String)>,
    ) -> Step {
        let api = Api::<ResourceClaim>::namespaced(self.clients.calls.clone(), ns);
        let claim = match self.clients.bounded(api.get_opt(name)).await {
            Ok(Some(c)) => c,
            // The scheduler does not nominate a pod whose claim is missing; deleted
            // since, there is nothing to admit.
            Ok(None) => return Step::Done,
            Err(e) => {
                debug!(claim = %name, error = %e, "reading the claim; trying again");
                return Step::Again;
            }
        };
        let pools = self.pools();
        let ids = match decide(&claim, pod_uid, &pools) {
            Next::NotOurs | Next::Told => return Step::Done,
            Next::Wait(why) => {
                debug!(claim = %name, why, "not yet");
                return Step::Again;
            }
            Next::Admit(ids) => ids,
        };
        let c = pb::ClaimRef {
            uid: claim.metadata.uid.clone().unwrap_or_default(),
            namespace: ns.to_owned(),
            name: name.to_owned(),
        };
        let mut step = Step::Done;
        for (driver_name, allocation_id) in ids {
            if admitted.contains(&(driver_name.clone(), allocation_id.clone())) {
                continue;
            }
            let Some(driver) = self.drivers.iter().find(|d| d.name() == driver_name) else {
                continue;
            };
            match driver.admit_before_binding(&claim, &c).await {
                Ok(()) => {
                    info!(claim = %format!("{ns}/{name}"), claim_uid = %c.uid, driver = %driver_name, "admitted before binding");
                    admitted.insert((driver_name, allocation_id));
                }
                Err(GateRefusal::Fenced(_)) => {}
                Err(GateRefusal::Refused { code, error }) => {
                    warn!(claim = %format!("{ns}/{name}"), claim_uid = %c.uid, driver = %driver_name, error = %error, "refused before binding; telling the scheduler");
                    let pools = pools.get(&driver_name).cloned().unwrap_or_default();
                    if let Err(e) = self
                        .tell_refused(&api, &claim, &driver_name, &pools, code.as_deref(), &error)
                        .await
                    {
                        warn!(claim = %format!("{ns}/{name}"), error = %e, "writing the refusal into the claim's status; trying again");
                        step = Step::Again;
                    }
                }
            }
        }
        step
    }

    async fn tell_refused(
        &self,
        api: &Api<ResourceClaim>,
        claim: &ResourceClaim,
        driver: &str,
        pools: &BTreeSet<String>,
        code: Option<&str>,
        error: &ClaimError,
    ) -> Result<(), kube::Error> {
        let message = match error {
            ClaimError::Refused(text) => text.clone(),
            other => other.to_string(),
        };
        let now = k8s_openapi::jiff::Timestamp::now()
            .round(k8s_openapi::jiff::Unit::Second)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
            .to_string();
        let body = refusal::body(claim, driver, pools, &refusal::reason(code), &message, &now);
        let name = claim.metadata.name.as_deref().unwrap_or("");
        let params = PatchParams::apply(&refusal::field_manager(driver)).force();
        self.clients
            .bounded(api.patch_status(name, &params, &Patch::Apply(body)))
            .await
            .map(|_| ())
    }

    /// Releases the gate's shares whose claims lost their allocation before any kubelet
    /// prepared them. A fenced instance leaves it to the newer one.
    async fn sweep(&self) {
        if self.agent.is_fenced() {
            return;
        }
        let shares = match self.agent.list_shares().await {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "listing shares for the sweep");
                return;
            }
        };
        let held = |s: &pb::ShareStatus| {
            s.pre_bind
                && !matches!(
                    pb::Phase::try_from(s.phase),
                    Ok(pb::Phase::Releasing | pb::Phase::Released | pb::Phase::Failed)
                )
        };
        let mut by_claim: BTreeMap<(String, String, String), Vec<&pb::ShareStatus>> =
            BTreeMap::new();
        for s in shares.iter().filter(|s| held(s)) {
            if let Some(c) = &s.claim {
                by_claim
                    .entry((c.namespace.clone(), c.name.clone(), c.uid.clone()))
                    .or_default()
                    .push(s);
            }
        }
        let due = self
            .unprepared
            .due(by_claim.keys().map(|(_, _, uid)| uid.clone()).collect());
        for ((ns, name, uid), shares) in by_claim {
            if !due.contains(&uid) {
                continue;
            }
            let api = Api::<ResourceClaim>::namespaced(self.clients.calls.clone(), &ns);
            let claim = match self.clients.bounded(api.get_opt(&name)).await {
                Ok(c) => c,
                Err(e) => {
                    debug!(claim = %format!("{ns}/{name}"), error = %e, "reading the claim for the sweep");
                    continue;
                }
            };
            let why = shares
                .iter()
                .find_map(|s| match sweep_verdict(s, claim.as_ref()) {
                    Verdict::Release(why) => Some(why),
                    Verdict::Keep => None,
                });
            let Some(why) = why else { continue };
            // The agent releases it only while it is still the gate's: kubelet may have
            // prepared it since the listing, and then only kubelet's Unprepare may.
            let c = pb::ClaimRef {
                uid: uid.clone(),
                namespace: ns.clone(),
                name: name.clone(),
            };
            match self.agent.unprepare_pre_bind(vec![c]).await {
                Ok(r) if r.claims.get(&uid).is_none_or(|e| e.code.is_empty()) => {
                    info!(claim = %format!("{ns}/{name}"), claim_uid = %uid, why, "released a share admitted before binding that no kubelet prepared");
                }
                Ok(r)
                    if r.claims
                        .get(&uid)
                        .is_some_and(|e| e.code == "FailedPrecondition") =>
                {
                    debug!(claim = %format!("{ns}/{name}"), "kubelet prepared the claim meanwhile: kept");
                }
                Ok(r) => {
                    warn!(claim = %format!("{ns}/{name}"), error = ?r.claims.get(&uid), "releasing a gate share")
                }
                Err(e) => {
                    warn!(claim = %format!("{ns}/{name}"), error = %e, "releasing a gate share")
                }
            }
        }
    }
}

/// The claims whose gate shares a sweep found unprepared by kubelet. A claim's shares
/// are read only from the second sweep that finds them, once they have waited a whole
/// sweep period for kubelet: a pod bound as usual is prepared by its kubelet seconds
/// after the gate admitted it (the scheduler checks the binding conditions every 5 s),
/// and a look in that window cost one more GET of the claim, 0.3 per claim on the test
/// cluster. A share whose pod never comes holds its capacity up to one sweep period
/// longer, against the scheduler's binding timeout of 10 minutes.
#[derive(Default)]
struct Unprepared(std::sync::Mutex<BTreeSet<String>>);

impl Unprepared {
    /// Of the claims `now` holds unprepared, those the sweep before found too; `now`
    /// is kept for the next.
    fn due(&self, now: BTreeSet<String>) -> BTreeSet<String> {
        let mut before = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let due = now.intersection(&before).cloned().collect();
        *before = now;
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(uids: &[&str]) -> BTreeSet<String> {
        uids.iter().map(|u| (*u).to_owned()).collect()
    }

    #[test]
    fn a_claim_is_read_from_the_second_sweep_that_finds_it_unprepared() {
        let u = Unprepared::default();
        assert!(u.due(set(&["a"])).is_empty(), "first seen: not read");
        assert_eq!(u.due(set(&["a", "b"])), set(&["a"]));
        // b prepared by kubelet meanwhile, a still waiting, c new.
        assert_eq!(u.due(set(&["a", "c"])), set(&["a"]));
        assert_eq!(u.due(set(&["c"])), set(&["c"]));
        // Gone and back (released, admitted anew): first seen again.
        assert!(u.due(set(&[])).is_empty());
        assert!(u.due(set(&["c"])).is_empty());
    }
}
