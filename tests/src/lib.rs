//! Harness for the integration tests: runs the real `shareguard` binary on a temporary
//! socket, store and metrics port, and kills it (SIGKILL) when dropped, so a failing test
//! leaves no agent behind. Every agent gets its own directory, so tests run in parallel.
//!
//! The binary is the one cargo built next to the test executable (`target/<profile>/
//! shareguard`); the README's test command builds it before running the tests.

#![allow(clippy::unwrap_used)] // A harness failure is a test failure; panics say where.

use std::{
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use shareguard_proto::v1::{self as pb, node_agent_client::NodeAgentClient};
use tonic::transport::Channel;

pub use shareguard_proto::v1 as proto;

/// A client of the agent's API.
pub type Client = NodeAgentClient<Channel>;

pub mod apiserver;
pub mod audit;
pub mod cluster;
pub mod foreign;
pub mod k8s;
pub mod kubelet;
pub mod locks;
pub mod manifests;
pub mod net;
pub mod plugin;
pub mod pod;
pub mod shell;
pub mod sim_agent;
pub mod stale;

/// How long an agent may take to become ready before the test fails.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub const DRIVER: &str = "shareguard.example.com";
pub const POOL: &str = "node-a";

/// A `gpu` device `gpu-0` on the SIMULATED back end (80Gi, shares in whole GiB) with this
/// `watchdog` table, for tests on machines without a GPU.
pub fn simulated_gpu_device(watchdog: &str) -> String {
    format!(
        r#"
[[device]]
name = "gpu-0"
driver = "{DRIVER}"
pool = "{POOL}"
kind = "gpu"
backend = "simulated"
allowed_namespaces = ["*"]
watchdog = {watchdog}
[device.simulated]
memory = "80Gi"
[device.capacity.memory]
default = "1Gi"
valid_range = {{ min = "1Gi", step = "1Gi" }}
"#
    )
}

/// The comma-separated list in environment variable `name`, or `default`'s: how the
/// benchmarks take their sizes.
pub fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_owned())
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Environment variable `name` parsed as a `T` (spaces around it ignored), or `default`
/// when it is unset; a value that does not parse fails the benchmark, naming it.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    setting_or(name, std::env::var(name).ok().as_deref(), default)
}

/// [`env_or`] of the value `raw` found for `name`.
fn setting_or<T: std::str::FromStr>(name: &str, raw: Option<&str>, default: T) -> T {
    raw.map_or(default, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} does not parse"))
    })
}

/// Releases claims `uids` for a benchmark that is failing: one Unprepare, as far as the
/// agent answers within 5 s, its answer ignored and nothing that could panic again. The
/// agent is killed after, but what it installed for a share (its queue devices) outlives
/// it.
pub fn release_quietly(rt: &tokio::runtime::Runtime, client: &mut Client, uids: Vec<String>) {
    let claims = uids.iter().map(|u| claim_ref(u)).collect();
    let call = client.unprepare(pb::UnprepareRequest {
        epoch: 0,
        claims,
        only_pre_bind: false,
    });
    let _ = rt.block_on(tokio::time::timeout(Duration::from_secs(5), call));
}

/// The path of the `shareguard` binary built alongside the running test.
pub fn agent_bin() -> PathBuf {
    if let Ok(p) = std::env::var("SHAREGUARD_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test-exe> -> target/<profile>/shareguard
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let bin = profile_dir.join("shareguard");
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build -p shareguard`; the README's test command does)",
        bin.display()
    );
    bin
}

/// A device table for the agent's config: a generic device `name` with one `memory`
/// capacity and a valid_range policy of `step`..=`capacity` in steps of `step`.
pub fn generic_device(
    name: &str,
    capacity: &str,
    step: &str,
    namespaces: &[&str],
    admin: &[&str],
) -> String {
    let list = |v: &[&str]| {
        v.iter()
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        r#"
[[device]]
name = "{name}"
driver = "{DRIVER}"
pool = "{POOL}"
kind = "generic"
allowed_namespaces = [{}]
admin_namespaces = [{}]
[device.capacity.memory]
value = "{capacity}"
default = "{step}"
valid_range = {{ min = "{step}", max = "{capacity}", step = "{step}" }}
"#,
        list(namespaces),
        list(admin)
    )
}

#[derive(Clone, Debug)]
pub struct Options {
    /// `[[device]]` tables.
    pub devices: String,
    pub allowed_uids: Vec<u32>,
    /// Extra lines for the `[agent]` table.
    pub agent_extra: String,
    /// The state directory; a fresh one in the agent's directory when None.
    pub state_dir: Option<PathBuf>,
    /// The socket in a directory the agent makes (`run/` in the agent's directory, which
    /// other uids may then traverse), rather than directly in the agent's directory.
    pub own_socket_dir: bool,
    /// A command the agent is started through, e.g. `setpriv` with its options, to run
    /// it with fewer capabilities or other groups than the test's own.
    pub run_through: Vec<String>,
}

impl Options {
    pub fn new(devices: impl Into<String>) -> Self {
        Self {
            devices: devices.into(),
            allowed_uids: vec![0],
            agent_extra: String::new(),
            state_dir: None,
            own_socket_dir: false,
            run_through: Vec::new(),
        }
    }
}

/// A running agent with its own temporary directory.
pub struct Agent {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub state_dir: PathBuf,
    pub audit_log: PathBuf,
    pub log: PathBuf,
    pub metrics: Option<SocketAddr>,
    child: Option<Child>,
    starts: u32,
    run_through: Vec<String>,
    /// Last: released once the agent is stopped and its files are gone.
    _host: net::HostLock,
}

impl Agent {
    pub fn start(opts: Options) -> Agent {
        let host_lock = net::HostLock::shared();
        let dir = tempfile::Builder::new().prefix("sg-it-").tempdir().unwrap();
        let socket = if opts.own_socket_dir {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o711)).unwrap();
            dir.path().join("run").join("agent.sock")
        } else {
            dir.path().join("agent.sock")
        };
        let state_dir = opts
            .state_dir
            .clone()
            .unwrap_or_else(|| dir.path().join("state"));
        let audit_log = dir.path().join("audit.jsonl");
        let config = dir.path().join("agent.toml");
        let uids = opts
            .allowed_uids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        // Kubelet's directory is the agent's own (a test writes a DRA checkpoint there
        // as kubelet would), never the machine's.
        let kubelet = if opts.agent_extra.contains("kubelet_dir") {
            String::new()
        } else {
            format!("kubelet_dir = {:?}", dir.path().join("kubelet"))
        };
        let text = format!(
            "[agent]\nsocket = {:?}\nstate_dir = {:?}\naudit_log = {:?}\nmetrics_addr = \"127.0.0.1:0\"\nallowed_uids = [{uids}]\n{kubelet}\n{}\n{}\n{}",
            socket,
            state_dir,
            audit_log,
            // Tests read /metrics right after what they changed: no cached render, unless
            // a test asks for one.
            if opts.agent_extra.contains("metrics_max_age") {
                ""
            } else {
                "metrics_max_age = \"0s\""
            },
            opts.agent_extra,
            opts.devices
        );
        fs::write(&config, text).unwrap();
        let mut a = Agent {
            log: dir.path().join("agent-0.log"),
            dir,
            socket,
            config,
            state_dir,
            audit_log,
            metrics: None,
            child: None,
            starts: 0,
            run_through: opts.run_through.clone(),
            _host: host_lock,
        };
        a.spawn();
        a
    }

    fn spawn(&mut self) {
        self.launch();
        self.wait_ready();
    }

    /// Writes kubelet's DRA checkpoint as kubelet does (a new file renamed over the
    /// old), listing `(claim uid, claim name, namespace, pod uids)`.
    pub fn write_kubelet_checkpoint(&self, claims: &[(&str, &str, &str, &[&str])]) {
        let dir = self.dir.path().join("kubelet");
        fs::create_dir_all(&dir).unwrap();
        let tmp = dir.join(".checkpoint.tmp");
        fs::write(&tmp, shareguard::discovery::kubelet::render(claims)).unwrap();
        fs::rename(&tmp, dir.join(shareguard::discovery::kubelet::CHECKPOINT)).unwrap();
    }

    /// SIGTERM, as kubelet stops the agent's pod; the exit status and how long the
    /// agent took to exit, or None when it is still running after `within`.
    pub fn terminate(&mut self, within: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let c = self.child.as_mut().expect("agent not running");
        let status = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        let started = Instant::now();
        while started.elapsed() < within {
            if let Some(s) = c.try_wait().unwrap() {
                self.child = None;
                return Some((s, started.elapsed()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Starts the agent again after [`Agent::kill9`], on the same config, store and
    /// socket, and waits until it is ready.
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "the agent is still running");
        self.spawn();
    }

    /// Starts the process without waiting for it to be ready.
    fn launch(&mut self) {
        self.log = self.dir.path().join(format!("agent-{}.log", self.starts));
        self.starts += 1;
        let log = fs::File::create(&self.log).unwrap();
        let mut cmd = match self.run_through.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(agent_bin());
                c
            }
            None => Command::new(agent_bin()),
        };
        let child = cmd
            .args(["agent", "--config"])
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.metrics = None;
    }

    /// Waits for the "ready" log line (which names the metrics address) and then for
    /// `/readyz` to answer 200; fails the test with the agent's log if it exits first.
    pub fn wait_ready(&mut self) {
        self.wait_ready_every(Duration::from_millis(20));
    }

    fn wait_ready_every(&mut self, poll: Duration) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("agent exited during start ({status}):\n{}", self.log_text());
            }
            // Both addresses from one read of the log: reading it twice let the "ready"
            // line appear between the reads, so the health port was probed and ready
            // while the metrics address was still unknown.
            let log = self.log_text();
            if self.metrics.is_none() {
                self.metrics = ready_addr_in(&log, "metrics");
            }
            // The health port where there is one: the metrics port may speak TLS only.
            let probe = ready_addr_in(&log, "health").or(self.metrics);
            if let Some(addr) = probe
                && http_get(addr, "/readyz").is_some_and(|(code, _)| code == 200)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "agent not ready after {READY_TIMEOUT:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(poll);
        }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `health_addr` as the agent bound it (its "ready" line), when it serves one.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.ready_addr("health")
    }

    /// The address `key=ADDR` on the agent's "ready" line.
    fn ready_addr(&self, key: &str) -> Option<SocketAddr> {
        ready_addr_in(&self.log_text(), key)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGKILL, as a crash: no shutdown code runs.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL, then start again on the same config, store and socket path.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// [`Agent::restart`], returning the time from spawning the process until `/readyz`
    /// answered 200, for the benchmark. Polls every 2 ms: the tests' 20 ms would round
    /// a sub-second figure up by as much.
    pub fn restart_timed(&mut self) -> Duration {
        self.kill9();
        let started = Instant::now();
        self.launch();
        self.wait_ready_every(Duration::from_millis(2));
        started.elapsed()
    }

    pub async fn client(&self) -> NodeAgentClient<Channel> {
        shareguard::client::connect(&self.socket).await.unwrap()
    }

    /// Runs the CLI against this agent.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(agent_bin())
            // The environment, not --socket: the local subcommands (audit, cleanup,
            // config, capacity) note on stderr that they ignore a --socket.
            .env("SHAREGUARD_SOCKET", &self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    /// Runs the CLI against this agent with `input` on its standard input.
    pub fn cli_with_stdin(&self, args: &[&str], input: &str) -> Output {
        let mut child = Command::new(agent_bin())
            // The environment, not --socket: the local subcommands (audit, cleanup,
            // config, capacity) note on stderr that they ignore a --socket.
            .env("SHAREGUARD_SOCKET", &self.socket)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Dropping stdin after the write closes it, so the CLI sees end of input.
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// A bare gRPC channel to the agent's socket, for services other than `NodeAgent`
    /// (grpc.health.v1).
    pub async fn channel(&self) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("unix://{}", self.socket.display()))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// GET on the metrics server: (status code, body).
    pub fn http(&self, path: &str) -> (u16, String) {
        http_get(self.metrics.unwrap(), path).unwrap()
    }

    /// Scrapes `/metrics` until series `name` with `labels` satisfies `ok`, and returns
    /// its value; fails after [`PHASE_TIMEOUT`] with the last body. Counters from the
    /// kernel are read by the agent on a period, so a scrape right after traffic may
    /// show the previous reading.
    pub fn wait_metric(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        ok: impl Fn(f64) -> bool,
    ) -> f64 {
        let deadline = Instant::now() + PHASE_TIMEOUT;
        loop {
            let (_, body) = self.http("/metrics");
            if let Some(v) = metric_sample(&body, name, labels)
                && ok(v)
            {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{name}{labels:?} not as expected within {PHASE_TIMEOUT:?}:\n{body}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn audit_lines(&self) -> Vec<serde_json::Value> {
        fs::read_to_string(&self.audit_log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Waits until the audit log has a line of `decision` for share `share_id` (the
    /// engine writes it after the event it records), and returns every line then;
    /// panics at `deadline`.
    pub fn wait_audit(
        &self,
        decision: &str,
        share_id: &str,
        deadline: Instant,
    ) -> Vec<serde_json::Value> {
        loop {
            let lines = self.audit_lines();
            if audit_count(&lines, decision, share_id) > 0 {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "no {decision} audit line for {share_id}: {lines:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// How many of `lines` record `decision` for share `share_id`.
pub fn audit_count(lines: &[serde_json::Value], decision: &str, share_id: &str) -> usize {
    lines
        .iter()
        .filter(|l| l["decision"] == decision && l["share_id"] == share_id)
        .count()
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
        // An agent killed with shares still installed leaves their queue devices, which
        // outlive it by design (I8); the test made them, so the test removes them. Its
        // install records name each one; an agent killed between making a queue pair and
        // recording it leaves one no record names, found by the limiter's own name for
        // each share the audit log saw admitted.
        let mut ifbs: std::collections::BTreeSet<String> =
            self.installed_queues().into_iter().collect();
        // Parsed leniently: a drop must not panic, and a killed agent may leave half a
        // line.
        let log = fs::read_to_string(&self.audit_log).unwrap_or_default();
        let audited: std::collections::BTreeSet<String> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|l| l["share_id"].as_str().map(str::to_owned))
            .filter(|id| !id.is_empty())
            .map(|id| shareguard_limiter_net::state::queue_name(&id))
            .collect();
        ifbs.extend(
            existing_queues()
                .into_iter()
                .filter(|n| audited.contains(n)),
        );
        for ifb in ifbs {
            let _ = Command::new("ip")
                .args(["link", "del", &ifb])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The devices of shareguard's group (its queue pairs) in this network namespace, by
/// name.
fn existing_queues() -> Vec<String> {
    let group = shareguard_limiter_net::rtnl::QUEUE_GROUP.to_string();
    let out = Command::new("ip")
        .args(["-j", "link", "show", "group", &group])
        .stderr(Stdio::null())
        .output();
    out.ok()
        .and_then(|o| serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).ok())
        .unwrap_or_default()
        .iter()
        .filter_map(|l| l["ifname"].as_str().map(str::to_owned))
        .collect()
}

impl Agent {
    /// The queue devices the bandwidth limiter's install records name.
    pub fn installed_queues(&self) -> Vec<String> {
        fs::read_dir(self.state_dir.join("net"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter_map(|v| v["queue"].as_str().map(str::to_owned))
            .collect()
    }
}

/// The field `name` of `/proc/PID/status`, its words joined by one space (`Uid`,
/// `CapEff`, `NoNewPrivs`, ...).
pub fn proc_status(pid: u32, name: &str) -> String {
    let text = fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The address `key=ADDR` on the "ready" line of an agent's log text.
fn ready_addr_in(log: &str, key: &str) -> Option<SocketAddr> {
    let key = format!("{key}=");
    log.lines().filter(|l| l.contains(" ready ")).find_map(|l| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(key.as_str()))
            .and_then(|a| a.parse().ok())
    })
}

/// Minimal HTTP/1.0 GET, enough for /readyz and /metrics without another dependency.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let buf = http_response(addr, path, "")?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((code, body))
}

/// The whole response (status line, headers, body) to a GET of `path` with
/// `extra_headers` (each line ending in `\r\n`).
pub fn http_response(addr: SocketAddr, path: &str, extra_headers: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: localhost\r\n{extra_headers}\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    Some(buf)
}

/// A fresh lowercase UUIDv4 from the kernel.
pub fn share_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/uuid")
        .unwrap()
        .trim()
        .to_owned()
}

pub fn alloc(device: &str, share_id: &str, memory: &str) -> pb::DeviceAllocation {
    pb::DeviceAllocation {
        request: "mem".into(),
        driver: DRIVER.into(),
        pool: POOL.into(),
        device: device.into(),
        share_id: share_id.into(),
        consumed_capacity: [("memory".to_owned(), memory.to_owned())]
            .into_iter()
            .collect(),
        policy_version: "v1".into(),
        ..Default::default()
    }
}

pub fn claim(
    uid: &str,
    namespace: &str,
    allocation_id: &str,
    allocations: Vec<pb::DeviceAllocation>,
) -> pb::ClaimPrepare {
    pb::ClaimPrepare {
        claim: Some(pb::ClaimRef {
            uid: uid.into(),
            namespace: namespace.into(),
            name: format!("claim-{uid}"),
        }),
        allocation_id: allocation_id.into(),
        target: None,
        allocations,
        pre_bind: false,
    }
}

pub fn claim_ref(uid: &str) -> pb::ClaimRef {
    pb::ClaimRef {
        uid: uid.into(),
        ..Default::default()
    }
}

/// Takes epochs with `NewEpoch`, as a plugin instance does at its start, until the
/// agent's epoch is `epoch` (only `NewEpoch` moves it); returns `epoch`.
pub async fn take_epoch(c: &mut NodeAgentClient<Channel>, epoch: u64) -> u64 {
    loop {
        let now = c
            .list_devices(pb::ListDevicesRequest {})
            .await
            .unwrap()
            .into_inner()
            .epoch;
        assert!(now <= epoch, "the agent is at epoch {now}, past {epoch}");
        if now == epoch {
            return epoch;
        }
        c.new_epoch(pb::NewEpochRequest {}).await.unwrap();
    }
}

/// Prepares one claim and returns its result (the request itself must be accepted).
pub async fn prepare_one(
    c: &mut NodeAgentClient<Channel>,
    epoch: u64,
    claim: pb::ClaimPrepare,
) -> pb::ClaimResult {
    let uid = claim.claim.as_ref().unwrap().uid.clone();
    let mut r = c
        .prepare(pb::PrepareRequest {
            epoch,
            claims: vec![claim],
        })
        .await
        .unwrap()
        .into_inner();
    r.claims
        .remove(&uid)
        .unwrap_or_else(|| panic!("no result for claim {uid}"))
}

/// Unprepares one claim and returns its outcome (empty code: released).
pub async fn unprepare_one(c: &mut NodeAgentClient<Channel>, epoch: u64, uid: &str) -> pb::Error {
    let mut r = c
        .unprepare(pb::UnprepareRequest {
            epoch,
            claims: vec![claim_ref(uid)],
            only_pre_bind: false,
        })
        .await
        .unwrap()
        .into_inner();
    r.claims
        .remove(uid)
        .unwrap_or_else(|| panic!("no outcome for claim {uid}"))
}

/// One device as ListDevices reports it.
pub async fn device(c: &mut NodeAgentClient<Channel>, name: &str) -> pb::DeviceStatus {
    devices(c)
        .await
        .into_iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no device {name}"))
}

/// Every device of the agent's inventory, as `ListDevices` gives them.
pub async fn devices(c: &mut NodeAgentClient<Channel>) -> Vec<pb::DeviceStatus> {
    c.list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner()
        .devices
}

/// One share by shareID (it must exist).
pub async fn get_share(c: &mut NodeAgentClient<Channel>, id: impl Into<String>) -> pb::ShareStatus {
    let share_id = id.into();
    c.get_share(pb::GetShareRequest {
        share_id: share_id.clone(),
    })
    .await
    .unwrap_or_else(|e| panic!("GetShare {share_id}: {e}"))
    .into_inner()
}

/// How long [`wait_phase`] waits: the agent reacts to a sandbox within milliseconds (its
/// events), and within its rescan period at worst.
pub const PHASE_TIMEOUT: Duration = Duration::from_secs(15);

/// Waits until share `id` is in `phase`, reading it every 10 ms, and returns it; fails
/// with the share's last status after [`PHASE_TIMEOUT`]. A share not there yet (a call
/// still admitting it) is waited for too.
/// The share's status once `done` holds of it, within 20 s; else a panic saying `what`
/// was expected, with the last status.
pub async fn wait_share(
    c: &mut NodeAgentClient<Channel>,
    id: &str,
    what: &str,
    done: impl Fn(&pb::ShareStatus) -> bool,
) -> pb::ShareStatus {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = get_share(c, id.to_owned()).await;
        if done(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "expected {what} within 20s: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn wait_phase(
    c: &mut NodeAgentClient<Channel>,
    id: &str,
    phase: pb::Phase,
) -> pb::ShareStatus {
    let deadline = Instant::now() + PHASE_TIMEOUT;
    loop {
        let got = c
            .get_share(pb::GetShareRequest {
                share_id: id.to_owned(),
            })
            .await;
        let last = match got {
            Ok(s) if s.get_ref().phase == phase as i32 => return s.into_inner(),
            Ok(s) => format!("{:?}", s.into_inner()),
            Err(e) if e.code() == tonic::Code::NotFound => "not found".to_owned(),
            Err(e) => panic!("GetShare {id}: {e}"),
        };
        assert!(
            Instant::now() < deadline,
            "share {id} not {phase:?} within {PHASE_TIMEOUT:?}: {last}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The next CHANGED event of share `id` on the `WatchShares` stream `s` that `wanted`
/// accepts, within `deadline`.
pub async fn next_change(
    s: &mut tonic::Streaming<pb::WatchSharesResponse>,
    id: &str,
    deadline: Duration,
    wanted: impl Fn(&pb::ShareStatus) -> bool,
) -> pb::ShareStatus {
    let until = tokio::time::Instant::now() + deadline;
    loop {
        let ev = tokio::time::timeout_at(until, s.message())
            .await
            .unwrap_or_else(|_| panic!("no change of {id} within {deadline:?}"))
            .unwrap_or_else(|e| panic!("WatchShares: {e}"))
            .unwrap_or_else(|| panic!("WatchShares ended"));
        if ev.kind == pb::watch_shares_response::Kind::Changed as i32
            && let Some(share) = ev.share
            && share.share_id == id
            && wanted(&share)
        {
            return share;
        }
    }
}

/// The next change of share `id` to `phase`: a phase the share passes through for
/// milliseconds (DEGRADED between a drift and its repair) is seen here, where polling
/// may miss it.
pub async fn changed_to(
    s: &mut tonic::Streaming<pb::WatchSharesResponse>,
    id: &str,
    phase: pb::Phase,
    deadline: Duration,
) -> pb::ShareStatus {
    next_change(s, id, deadline, |share| share.phase == phase as i32).await
}

/// The value of the metric series `name` whose labels include every `(key, value)` of
/// `labels`, from the text `/metrics` serves; None when no such series is exposed (a
/// counter that has not counted yet may not be). A value that is not a number fails.
pub fn metric_sample(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        let set = rest.strip_suffix('}')?;
        let all = labels
            .iter()
            .all(|(k, v)| set.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        (n == name && all).then(|| {
            value
                .parse()
                .unwrap_or_else(|e| panic!("{name}: sample value {value:?}: {e}"))
        })
    })
}

/// Every share record the agent holds, tombstones included.
pub async fn all_shares(c: &mut NodeAgentClient<Channel>) -> Vec<pb::ShareStatus> {
    c.list_shares(pb::ListSharesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .shares
}

/// Whole GiB in a canonical quantity the agent printed ("10Gi", "2Ti" or "0"); anything
/// else fails the test, since the tests only hand out whole GiB.
pub fn gib(q: &str) -> u64 {
    if q == "0" {
        return 0;
    }
    let (n, scale) = match (q.strip_suffix("Gi"), q.strip_suffix("Ti")) {
        (Some(n), _) => (n, 1),
        (_, Some(n)) => (n, 1024),
        _ => panic!("{q:?} is not a whole number of Gi"),
    };
    n.parse::<u64>()
        .unwrap_or_else(|_| panic!("{q:?} is not a whole number of Gi"))
        * scale
}

#[cfg(test)]
mod tests {
    use super::{ready_addr_in, setting_or};

    #[test]
    fn a_setting_is_trimmed_defaulted_or_refused_by_name() {
        assert_eq!(setting_or("N", Some(" 12\n"), 3usize), 12);
        assert_eq!(setting_or("N", None, 3usize), 3);
        let refused = std::panic::catch_unwind(|| setting_or("FLEET_NODES", Some("ten"), 3usize))
            .expect_err("a value that does not parse is refused");
        let message = refused
            .downcast_ref::<String>()
            .cloned()
            .unwrap_or_default();
        assert!(message.contains("FLEET_NODES=\"ten\""), "{message}");
    }

    #[test]
    fn ready_addresses_come_from_the_ready_line_only() {
        let log = "2026-12-07T08:00:00Z  INFO shareguard::server: listening metrics=127.0.0.1:1\n\
                   2026-12-07T08:00:01Z  INFO shareguard::server: ready socket=/run/a.sock \
                   metrics=127.0.0.1:4001 health=127.0.0.1:4002 shares=0\n";
        assert_eq!(
            ready_addr_in(log, "metrics"),
            Some("127.0.0.1:4001".parse().unwrap())
        );
        assert_eq!(
            ready_addr_in(log, "health"),
            Some("127.0.0.1:4002".parse().unwrap())
        );
        assert_eq!(ready_addr_in(log.lines().next().unwrap(), "metrics"), None);
    }
}
