//! A fleet of simulated nodes against a real API server: what shareguard's kubelet
//! plugins cost the control plane when there are many of them.
//!
//! `tests/cluster/fleet.sh` starts the test cluster's control plane alone (etcd,
//! kube-apiserver, controller-manager, scheduler, and from deploy/ the plugin's
//! ServiceAccount, RBAC, admission policies and DeviceClasses) and runs this. It then
//! plays `FLEET_NODES` nodes (default 1,000) in one process: for each, a Node object, a
//! token of the plugin's ServiceAccount bound to that Node (it names the node, as the
//! pod-bound token of the DaemonSet's pod there does), a SIMULATED agent
//! ([`shareguard_tests::sim_agent`]) that serves the inventory a real agent reported (its
//! pool renamed for the node), and the real kubelet plugin
//! (`shareguard_kubelet_plugin::run`) with its default settings. The harness plays
//! kubelet and the scheduler only in the churn phase ([`churn`]).
//!
//! Phases, each measured from the API server's own figures (`/metrics`:
//! `apiserver_request_total`, and `apiserver_request_duration_seconds` for every verb but
//! WATCH and CONNECT) and from its audit log (every request of the plugin's
//! ServiceAccount, tests/cluster/audit-policy.yaml):
//!
//! 1. `no plugin`: the control plane with the Node objects, for `FLEET_BASE_SECONDS`
//!    (default 60), `FLEET_SETTLE_SECONDS` (default 120) after they were made: what the
//!    API server serves without shareguard.
//! 2. `start`: every node's plugin started at once, as a new DaemonSet does, until each
//!    node's ResourceSlice is there and the plugins' requests other than watches are
//!    down to one a second per 100 nodes.
//! 3. `at rest`: `FLEET_REST_SECONDS` (default 600, two of the plugin's watch renewals
//!    and its slices' LIST every ten resync periods) with every plugin running.
//! 4. `churn`: claims prepared and released across the fleet for `FLEET_CHURN_SECONDS`
//!    (default 300; 0 leaves the phase out), `FLEET_CLAIMS_PER_NODE_MINUTE` new claims a
//!    minute on each node (default 1), each prepared for `FLEET_CLAIM_SECONDS` (default
//!    60), its share ENFORCED `FLEET_ENFORCE_MS` after its Prepare (default 1000, as a
//!    pod's sandbox follows its Prepare); until every claim is gone and the plugins'
//!    requests are down again. `FLEET_ENFORCED_EVENTS=false` runs the plugins with
//!    `--enforced-events=false`.
//! 5. `rolling restart`: every plugin replaced by a new instance, `FLEET_RESTART_BATCH`
//!    nodes at a time (default 50; a DaemonSet's `maxSurge`): the new instance starts
//!    beside the old, takes the agent's epoch, and the old one is stopped; until the
//!    plugins' requests are down again as after the start.
//!
//! Prints markdown for docs/benchmarks.md; asserts only that each phase ends (every
//! slice published, every claim prepared and released, every instance replaced), not
//! how fast. `FLEET_LOG` (default `warn`) filters the plugins' logs on stderr.

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

// In a folder of its own: a file beside this one would be taken for a benchmark.
#[path = "fleet/churn.rs"]
mod churn;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec},
    core::v1::{Node, ServiceAccount},
    resource::v1::ResourceSlice,
};
use kube::{
    Api, Client, Config,
    api::{ListParams, ObjectMeta, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use shareguard_kubelet_plugin::PluginArgs;
use shareguard_tests::{audit::AuditLog, env_or, kubelet::Kubelet, net, sim_agent::SimAgent};
use tokio::{sync::oneshot, task::JoinHandle};

const DEVICE: &str = "nic-fleet";
const NAMESPACE: &str = "shareguard-system";
const SERVICE_ACCOUNT: &str = "shareguard-kubelet-plugin";
/// How many API requests each phase makes at once while setting up (Nodes, tokens).
const SETUP_CONCURRENCY: usize = 32;

/// One running instance of a node's plugin.
struct Instance {
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

/// One simulated node: its folder (agent socket, kubelet's plugin folders, kubeconfig),
/// its agent and its plugin.
struct SimNode {
    name: String,
    dir: PathBuf,
    agent: SimAgent,
    plugin: Option<Instance>,
}

impl SimNode {
    fn kubelet(&self) -> Kubelet {
        Kubelet {
            registry_dir: self.dir.join("registry"),
            plugins_dir: self.dir.join("plugins"),
        }
    }

    fn start_plugin(&mut self, instance: &str) -> Instance {
        let args = PluginArgs {
            agent_socket: self.dir.join("agent.sock"),
            drivers: Vec::new(),
            node_name: self.name.clone(),
            registry_dir: self.dir.join("registry"),
            plugins_dir: self.dir.join("plugins"),
            instance_id: Some(instance.to_owned()),
            health_addr: None,
            kubeconfig: Some(self.dir.join("kubeconfig")),
            kube_api_qps: 50,
            kube_api_burst: 100,
            resync_seconds: 30,
            max_slices_per_node: 16,
            binding_conditions: true,
            enforced_events: env_or("FLEET_ENFORCED_EVENTS", true),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let span = tracing::info_span!("node", node = %self.name, instance);
        let task = tokio::spawn(tracing::Instrument::instrument(
            shareguard_kubelet_plugin::run(args, async {
                let _ = stopped.await;
            }),
            span,
        ));
        Instance { stop, task }
    }
}

/// The API server's request counters and latency histogram, summed over every series.
#[derive(Clone, Debug, Default)]
struct Scrape {
    /// `apiserver_request_total` by verb.
    requests: BTreeMap<String, f64>,
    /// `apiserver_request_duration_seconds_bucket` of every verb but WATCH and CONNECT:
    /// cumulative count by upper bound.
    buckets: BTreeMap<u64, f64>,
}

/// `le="0.005"` as nanoseconds, so buckets sort; `+Inf` last.
fn bound_ns(le: &str) -> u64 {
    if le == "+Inf" {
        return u64::MAX;
    }
    (le.parse::<f64>().unwrap() * 1e9).round() as u64
}

fn label<'a>(series: &'a str, name: &str) -> Option<&'a str> {
    let start = series.find(&format!("{name}=\""))? + name.len() + 2;
    let len = series[start..].find('"')?;
    Some(&series[start..start + len])
}

impl Scrape {
    async fn take(admin: &Client) -> Scrape {
        let req = http::Request::get("/metrics").body(Vec::new()).unwrap();
        let text = admin.request_text(req).await.unwrap();
        let mut out = Scrape::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let verb = label(series, "verb").unwrap_or_default().to_owned();
            if series.starts_with("apiserver_request_total{") {
                *out.requests.entry(verb).or_default() += value;
            } else if series.starts_with("apiserver_request_duration_seconds_bucket{")
                && verb != "WATCH"
                && verb != "CONNECT"
                && let Some(le) = label(series, "le")
            {
                *out.buckets.entry(bound_ns(le)).or_default() += value;
            }
        }
        out
    }
}

/// What the API server did between two scrapes, and the plugins' own requests.
struct Phase {
    name: &'static str,
    seconds: f64,
    requests: f64,
    by_verb: BTreeMap<String, f64>,
    /// Requests other than watches, and the upper bound of the bucket their 99th
    /// percentile falls in (seconds; None: none, or above the last bound).
    timed: f64,
    p99_bound: Option<f64>,
    /// The plugins' requests (audit log) made in the phase, by `verb resource`: a watch
    /// counts where it began, not where one that began before ended.
    ours: BTreeMap<String, usize>,
    /// Of them, answered 429 (Too Many Requests: the API server's priority and fairness
    /// had no room for them).
    ours_429: usize,
    /// The API server's time to answer the plugins' requests other than watches, ms
    /// (audit log).
    ours_ms: Vec<f64>,
}

impl Phase {
    fn new(
        name: &'static str,
        seconds: f64,
        a: &Scrape,
        b: &Scrape,
        ours: &[shareguard_tests::audit::Request],
    ) -> Phase {
        let by_verb: BTreeMap<String, f64> = b
            .requests
            .iter()
            .map(|(v, n)| (v.clone(), n - a.requests.get(v).copied().unwrap_or(0.0)))
            .filter(|(_, n)| *n > 0.0)
            .collect();
        let delta: Vec<(u64, f64)> = b
            .buckets
            .iter()
            .map(|(le, n)| (*le, n - a.buckets.get(le).copied().unwrap_or(0.0)))
            .collect();
        let timed = delta.last().map_or(0.0, |(_, n)| *n);
        let p99_bound = delta
            .iter()
            .find(|(_, n)| timed > 0.0 && *n >= 0.99 * timed)
            .and_then(|(le, _)| (*le != u64::MAX).then(|| *le as f64 / 1e9));
        Phase {
            name,
            seconds,
            requests: by_verb.values().sum(),
            by_verb,
            timed,
            p99_bound,
            ours: shareguard_tests::audit::by_kind(ours),
            ours_429: ours.iter().filter(|r| r.code == 429).count(),
            ours_ms: ours
                .iter()
                .filter_map(|r| Some(r.latency()?.as_secs_f64() * 1e3))
                .collect(),
        }
    }

    fn ours_total(&self) -> usize {
        self.ours.values().sum()
    }
}

/// Raises the open-file limit to its hard limit: each simulated node holds a few API
/// connections and sockets.
fn raise_nofile() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    hard
}

/// Creates node `name` and a token of the plugin's ServiceAccount bound to it.
async fn node_and_token(admin: &Client, name: &str) -> String {
    let nodes: Api<Node> = Api::all(admin.clone());
    let node = Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                "shareguard.example.com/fleet".to_owned(),
                "simulated".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        ..Node::default()
    };
    let node = nodes.create(&PostParams::default(), &node).await.unwrap();
    let sa: Api<ServiceAccount> = Api::namespaced(admin.clone(), NAMESPACE);
    let req = TokenRequest {
        spec: TokenRequestSpec {
            audiences: Vec::new(),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(name.to_owned()),
                uid: node.metadata.uid,
            }),
            expiration_seconds: Some(6 * 3600),
        },
        ..TokenRequest::default()
    };
    sa.create_token_request(SERVICE_ACCOUNT, &PostParams::default(), &req)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
}

async fn slices(admin: &Client) -> usize {
    let api: Api<ResourceSlice> = Api::all(admin.clone());
    api.list_metadata(&ListParams::default())
        .await
        .map_or(0, |l| l.items.len())
}

/// Waits until every node has its ResourceSlice; panics after `limit`.
async fn until_published(admin: &Client, n: usize, limit: Duration) {
    let t = Instant::now();
    loop {
        let have = slices(admin).await;
        if have >= n {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "{have} of {n} nodes' ResourceSlices after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the plugins' requests other than watches come down to `per_second` a
/// second or fewer over 5 s (their retries and first lists done), for at most `limit`.
async fn until_quiet(audit: &AuditLog, per_second: f64, limit: Duration) {
    let t = Instant::now();
    loop {
        let mark = audit.mark();
        tokio::time::sleep(Duration::from_secs(5)).await;
        let busy = audit
            .since(mark)
            .iter()
            .filter(|r| r.verb != "watch")
            .count();
        if busy as f64 <= per_second * 5.0 {
            return;
        }
        assert!(
            t.elapsed() < limit,
            "the plugins still made {busy} requests in 5 s after {limit:?}"
        );
    }
}

/// Stops `i` and waits for it to end; panics if it ended with an error.
async fn stop(node: &str, i: Instance) {
    let _ = i.stop.send(());
    match i.task.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("node {node}: the plugin ended with {e:#}"),
        Err(e) => panic!("node {node}: the plugin's task: {e}"),
    }
}

/// Panics naming the first plugin that ended on its own (an error it could not get
/// past), so that a phase is never measured with nodes missing.
fn check_running(nodes: &[SimNode]) {
    for n in nodes {
        if let Some(i) = &n.plugin {
            assert!(
                !i.task.is_finished(),
                "node {}: the plugin ended on its own",
                n.name
            );
        }
    }
}

fn main() {
    if !net::privileged("fleet simulation") {
        return;
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            std::env::var("FLEET_LOG").unwrap_or_else(|_| "warn".to_owned()),
        ))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let n = env_or::<usize>("FLEET_NODES", 1000);
    let base = Duration::from_secs(env_or::<u64>("FLEET_BASE_SECONDS", 60));
    let settle = Duration::from_secs(env_or::<u64>("FLEET_SETTLE_SECONDS", 120));
    // A start or restart is over once the plugins' requests other than watches are down
    // to this many a second (at rest, 1,000 nodes made 3.3: each LISTs its slices every
    // 300 s).
    let quiet = (n as f64 / 100.0).max(1.0);
    let rest = Duration::from_secs(env_or::<u64>("FLEET_REST_SECONDS", 600));
    let batch = env_or::<usize>("FLEET_RESTART_BATCH", 50).max(1);
    let churn_for = Duration::from_secs(env_or::<u64>("FLEET_CHURN_SECONDS", 300));
    let claims_per_node_minute = env_or::<f64>("FLEET_CLAIMS_PER_NODE_MINUTE", 1.0);
    let claim_lifetime = Duration::from_secs(env_or::<u64>("FLEET_CLAIM_SECONDS", 60));
    let enforce_after = Duration::from_millis(env_or::<u64>("FLEET_ENFORCE_MS", 1000));
    let kubeconfig_path = PathBuf::from(
        std::env::var_os("SGC_KUBECONFIG")
            .expect("SGC_KUBECONFIG is not set: run this with tests/cluster/fleet.sh"),
    );
    let audit = AuditLog::from_env();
    let nofile = raise_nofile();
    eprintln!("{n} nodes; open files up to {nofile}");

    // The inventory every simulated agent serves: what a real agent reports for one
    // NIC share device.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (inventory, ask) = {
        let pins = net::PinDir::new();
        let agent = net::start_agent(
            net::net_device(
                DEVICE,
                &format!("mechanism = \"auto\"\n{}", net::bandwidth_capacity("10G")),
            ),
            &pins,
            "",
        );
        let inventory = rt.block_on(async {
            let mut c = agent.client().await;
            c.list_devices(shareguard_tests::proto::ListDevicesRequest {})
                .await
                .unwrap()
                .into_inner()
        });
        // Every churn claim asks for one share of the device at its policy's default.
        let d = &inventory.devices[0];
        let (capacity, policy) = d.policy.iter().next().unwrap();
        let ask = churn::ShareAsk {
            driver: d.driver.clone(),
            device: d.name.clone(),
            capacity: capacity.clone(),
            amount: policy.default.clone(),
        };
        (inventory, Arc::new(ask))
    };
    let dir = tempfile::tempdir().unwrap();
    let admin_kc = Kubeconfig::read_from(&kubeconfig_path).unwrap();
    // The admin's `cluster` entry as it stands (server and CA), for every node's
    // kubeconfig; fields it does not have are left out.
    let api_server = serde_json::to_value(admin_kc.clusters[0].cluster.as_ref().unwrap()).unwrap();

    let phases = rt.block_on(async {
        let config =
            Config::from_custom_kubeconfig(admin_kc.clone(), &KubeConfigOptions::default())
                .await
                .unwrap();
        let admin = Client::try_from(config).unwrap();

        let t = Instant::now();
        let names: Vec<String> = (0..n).map(|i| format!("fleet-{i:05}")).collect();
        let mut tokens = Vec::with_capacity(n);
        for chunk in names.chunks(SETUP_CONCURRENCY) {
            let made =
                futures::future::join_all(chunk.iter().map(|name| node_and_token(&admin, name)))
                    .await;
            tokens.extend(made);
        }
        eprintln!("{n} Nodes and tokens in {:.1?}", t.elapsed());
        let mut nodes: Vec<SimNode> = names
            .into_iter()
            .zip(tokens)
            .map(|(name, token)| {
                let d = dir.path().join(&name);
                std::fs::create_dir_all(d.join("registry")).unwrap();
                std::fs::create_dir_all(d.join("plugins")).unwrap();
                shareguard_tests::cluster::write_token_kubeconfig(
                    &d.join("kubeconfig"),
                    &api_server,
                    &token,
                );
                let agent =
                    SimAgent::serve(&d.join("agent.sock"), &name, &inventory, enforce_after);
                SimNode {
                    name,
                    dir: d,
                    agent,
                    plugin: None,
                }
            })
            .collect();

        let mut phases = Vec::new();
        let measure = |name: &'static str, t0: Instant, s0: Scrape, m0: u64| {
            let admin = admin.clone();
            let audit = audit.clone();
            async move {
                let s1 = Scrape::take(&admin).await;
                let seconds = t0.elapsed().as_secs_f64();
                let ours: Vec<_> = audit
                    .since(m0)
                    .into_iter()
                    .filter(|r| !(r.verb == "watch" && r.first_stage == "ResponseComplete"))
                    .collect();
                Phase::new(name, seconds, &s0, &s1, &ours)
            }
        };

        // 1. No plugin, once the node controller has dealt with the new Nodes (it marks
        // each one that never reported as unreachable after its grace period).
        tokio::time::sleep(settle).await;
        let (t0, s0, m0) = (Instant::now(), Scrape::take(&admin).await, audit.mark());
        tokio::time::sleep(base).await;
        phases.push(measure("no plugin", t0, s0, m0).await);

        // 2. Every plugin started at once.
        let (t0, s0, m0) = (Instant::now(), Scrape::take(&admin).await, audit.mark());
        for node in &mut nodes {
            let i = node.start_plugin("a");
            node.plugin = Some(i);
        }
        until_published(&admin, n, Duration::from_secs(600)).await;
        eprintln!("every node published in {:.1?}", t0.elapsed());
        until_quiet(&audit, quiet, Duration::from_secs(600)).await;
        check_running(&nodes);
        phases.push(measure("start", t0, s0, m0).await);

        // 3. At rest.
        let (t0, s0, m0) = (Instant::now(), Scrape::take(&admin).await, audit.mark());
        tokio::time::sleep(rest).await;
        check_running(&nodes);
        phases.push(measure("at rest", t0, s0, m0).await);

        // 4. Churn.
        let mut churned = None;
        if !churn_for.is_zero() {
            churn::create_namespace(&admin).await;
            // kubelet's plugin watcher registers each node's plugin first.
            let mut refs: Vec<Arc<churn::NodeRef>> = Vec::with_capacity(n);
            for chunk in nodes.chunks(SETUP_CONCURRENCY) {
                let registered = futures::future::join_all(chunk.iter().map(|node| {
                    churn::register(node.name.clone(), node.kubelet(), &ask.driver, "a")
                }))
                .await;
                refs.extend(registered.into_iter().map(Arc::new));
            }
            let every = Duration::from_secs_f64(60.0 / (claims_per_node_minute * n as f64));
            let (t0, s0, m0) = (Instant::now(), Scrape::take(&admin).await, audit.mark());
            let mut lives = Vec::new();
            let mut k = 0usize;
            while t0.elapsed() < churn_for {
                let i = k % n;
                lives.push(tokio::spawn(churn::claim_life(
                    admin.clone(),
                    refs[i].clone(),
                    ask.clone(),
                    format!("c-{k:07}"),
                    claim_lifetime,
                )));
                k += 1;
                tokio::time::sleep_until((t0 + every * k as u32).into()).await;
            }
            let mut outcomes = Vec::with_capacity(lives.len());
            for l in lives {
                outcomes.push(l.await.unwrap());
            }
            eprintln!(
                "{} claims prepared and released in {:.1?}",
                outcomes.len(),
                t0.elapsed()
            );
            for node in &nodes {
                assert_eq!(
                    node.agent.live_claims(),
                    0,
                    "node {}: claims still prepared after the churn",
                    node.name
                );
            }
            until_quiet(&audit, quiet, Duration::from_secs(600)).await;
            check_running(&nodes);
            phases.push(measure("churn", t0, s0, m0).await);
            churned = Some(outcomes);
            churn::delete_namespace(&admin).await;
        }

        // 5. A rolling restart, `batch` nodes at a time.
        let (t0, s0, m0) = (Instant::now(), Scrape::take(&admin).await, audit.mark());
        for chunk in nodes.chunks_mut(batch) {
            let mut replaced = Vec::new();
            for node in chunk.iter_mut() {
                let before = node.agent.epoch();
                let new = node.start_plugin("b");
                let old = node.plugin.replace(new).unwrap();
                replaced.push((node.name.clone(), before, old));
            }
            // The new instance serves once it took the agent's epoch; then the old one
            // goes, as the DaemonSet deletes the old pod once the new one is ready.
            for ((name, before, old), node) in replaced.into_iter().zip(chunk.iter()) {
                let t = Instant::now();
                while node.agent.epoch() <= before {
                    assert!(
                        t.elapsed() < Duration::from_secs(120),
                        "node {name}: the new plugin took no epoch in 120 s"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                stop(&name, old).await;
            }
        }
        eprintln!("every plugin replaced in {:.1?}", t0.elapsed());
        until_quiet(&audit, quiet, Duration::from_secs(600)).await;
        check_running(&nodes);
        phases.push(measure("rolling restart", t0, s0, m0).await);

        for node in &mut nodes {
            if let Some(i) = node.plugin.take() {
                stop(&node.name, i).await;
            }
        }
        (phases, churned)
    });
    let (phases, churned) = phases;

    println!("### A fleet of {n} simulated nodes\n");
    println!(
        "Rolling restart {batch} nodes at a time. API server: every request it served \
         (`apiserver_request_total`); p99 is the upper bound of the latency bucket the 99th \
         percentile of its non-watch requests falls in. shareguard: the plugins' own \
         requests (audit log).\n"
    );
    println!(
        "| phase | seconds | API server requests/s | its p99 (non-watch) | shareguard requests | of them a second | a node's a minute | answered 429 | their p99 (non-watch) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for p in &phases {
        let ours = p.ours_total() as f64;
        println!(
            "| {} | {:.1} | {:.1} | {} | {} | {:.1} | {:.2} | {} | {} |",
            p.name,
            p.seconds,
            p.requests / p.seconds,
            p.p99_bound
                .map_or("-".to_owned(), |b| format!("<= {:.0} ms", b * 1e3)),
            p.ours_total(),
            ours / p.seconds,
            ours / n as f64 / (p.seconds / 60.0),
            p.ours_429,
            if p.ours_ms.is_empty() {
                "-".to_owned()
            } else {
                format!("{:.1} ms", net::percentile(&p.ours_ms, 99.0))
            },
        );
    }
    println!();
    for p in &phases {
        let verbs: Vec<String> = p
            .by_verb
            .iter()
            .map(|(v, c)| format!("{v} {c:.0}"))
            .collect();
        let ours: Vec<String> = p.ours.iter().map(|(k, c)| format!("{k} {c}")).collect();
        println!(
            "- {}: API server {} ({} timed); shareguard {}",
            p.name,
            verbs.join(", "),
            p.timed,
            if ours.is_empty() {
                "none".to_owned()
            } else {
                ours.join(", ")
            }
        );
    }

    if let (Some(outcomes), Some(p)) = (churned, phases.iter().find(|p| p.name == "churn")) {
        let claims = outcomes.len();
        let prepared: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| Some(o.prepared_in?.as_secs_f64() * 1e3))
            .collect();
        let calls: u32 = outcomes.iter().map(|o| o.prepare_calls).sum();
        let unprepared = outcomes.iter().filter(|o| o.unprepared).count();
        println!(
            "\n### Churn: {claims} claims, {claims_per_node_minute} a minute on each node, \
             each prepared for {} s\n",
            claim_lifetime.as_secs()
        );
        println!("| what | value |\n|---|---|");
        println!(
            "| prepared / released | {} / {unprepared} of {claims} |",
            prepared.len()
        );
        println!(
            "| kubelet's Prepare calls per claim | {:.2} |",
            f64::from(calls) / claims.max(1) as f64
        );
        if !prepared.is_empty() {
            println!(
                "| kubelet's first Prepare -> prepared, p50 / p99 | {:.1} / {:.1} ms |",
                net::percentile(&prepared, 50.0),
                net::percentile(&prepared, 99.0)
            );
        }
        for (kind, count) in &p.ours {
            println!(
                "| shareguard `{kind}` per claim | {:.2} |",
                *count as f64 / claims.max(1) as f64
            );
        }
        println!(
            "| shareguard requests per claim, all (at-rest requests included) | {:.2} |",
            p.ours_total() as f64 / claims.max(1) as f64
        );
    }
}
