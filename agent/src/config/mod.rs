//! The agent's TOML configuration: where it listens and stores state, and the node's
//! device inventory with capacities and request policies.
//!
//! A bad configuration is refused at start with the file, the line and the reason, and
//! nothing is started: an agent that guesses at its inventory would hand out capacity
//! the node does not have.
//!
//! A device's pool is the node's name unless set, and `[[node]]` tables change devices
//! on one node, so that one file serves every node ([`crate::config::node`]).

pub mod gpu;
pub mod node;
pub mod reference;
pub mod rollout;
pub mod slo;
pub mod warnings;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use shareguard_common::{Quantity, slice};
use shareguard_limiter_gpu::limiter::MEMORY;
use shareguard_limiter_net::Mechanism;
use toml::Spanned;

use crate::{
    config::gpu::{GpuConfig, RawGpu, RawSimulated, RawWatchdog},
    config::node::{NodeName, NodeNameSources, Problem},
    policy::Policy,
    validate::{is_dns_label, is_driver_name, is_namespace, is_pool_name, is_qualified_name},
};

pub const DEFAULT_PATH: &str = "/etc/shareguard/agent.toml";

#[derive(Clone, Debug)]
pub struct Config {
    pub agent: AgentConfig,
    pub devices: Vec<DeviceConfig>,
    /// `[slo]`: the SLO figures' windows and objectives (see [`crate::config::slo`]).
    pub slo: crate::slo::SloConfig,
}

#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The node's name: `[agent] node_name`, else `--node-name`/`NODE_NAME`, else the
    /// host name. None only where none of them gives a valid name and nothing needed
    /// one (every device sets its pool and there is no `[[node]]` table).
    pub node_name: Option<String>,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub metrics_addr: SocketAddr,
    /// `/healthz` and `/readyz` alone, for kubelet's probes: they say nothing about
    /// tenants, so they may be served where `/metrics` may not. None: only on
    /// `metrics_addr`.
    pub health_addr: Option<SocketAddr>,
    /// A file holding the bearer token a scraper of `/metrics` must send; read at each
    /// scrape, so it can be rotated in place. Required for a `metrics_addr` other than
    /// loopback: the metrics name tenants' namespaces and claims.
    pub metrics_token_file: Option<PathBuf>,
    /// TLS on `metrics_addr`, with client certificates checked against a CA where
    /// `client_ca_file` is given; the files are read for each connection.
    pub metrics_tls: Option<crate::api::metrics::tls::MetricsTls>,
    pub audit_log: PathBuf,
    /// Size bound and rotation of the audit log (`audit_max_bytes`, `audit_keep`).
    pub audit_bound: crate::audit::Bound,
    /// Callers with the admin role: every RPC (the node's operators, `shareguard release`).
    pub allowed_uids: Vec<u32>,
    /// Callers with the kubelet-plugin role: Prepare, Unprepare, NewEpoch and the reads.
    pub plugin_uids: Vec<u32>,
    /// Callers with the read-only role: GetShare, ListShares, WatchShares, ListDevices.
    pub reader_uids: Vec<u32>,
    /// The group the API socket and its directory belong to, mode 0660 and 0750, so that
    /// the listed non-root uids in it can connect; None: root only, 0600 and 0700.
    pub socket_group: Option<u32>,
    pub max_claims_per_request: usize,
    pub tombstone_retention: Duration,
    /// The most RELEASED and FAILED records kept; the oldest beyond it go at the next
    /// sweep, whatever their age, so that a caller that prepares and releases without
    /// end cannot grow the store and the agent's memory without bound.
    pub tombstone_max: usize,
    /// bpffs directory for the bandwidth limiter's pinned maps and links.
    pub bpffs_dir: PathBuf,
    /// Where CDI spec files for GPU claims are written (the runtime scans it).
    pub cdi_dir: PathBuf,
    /// The cgroup v2 mount; None: found in the mount table at start (`/sys/fs/cgroup` on
    /// most nodes, `/sys/fs/cgroup/unified` on hybrid ones).
    pub cgroup_root: Option<PathBuf>,
    /// Kubelet cgroup roots deeper than discovery looks by itself (two levels below the
    /// mount), absolute or relative to the mount.
    pub pod_cgroup_roots: Vec<PathBuf>,
    /// Kubelet's root directory, whose DRA checkpoint says which pods kubelet runs with
    /// each claim; None: not read (the kubelet plugin's pods are used).
    pub kubelet_dir: Option<PathBuf>,
    /// How often every pod is looked for again, besides the kernel's events.
    pub rescan_period: Duration,
    /// Most WatchShares streams served at once.
    pub max_watchers: usize,
    /// A scrape within this long of the last render gets that render again.
    pub metrics_max_age: Duration,
    /// How often the per-share traffic counters are read from the kernel for /metrics
    /// (a scrape reads the last values; it never talks to the kernel itself).
    pub counters_period: Duration,
    /// NVIDIA's MPS control program and where the per-share MPS daemons live
    /// (`mps_control`, `mps_dir`).
    pub mps: shareguard_limiter_gpu::mps::MpsConfig,
    /// Simulation only: a JSON file the simulated GPUs read their running processes
    /// from on every watchdog poll (`[{"gpu_uuid", "pid", "used_bytes"}]`).
    pub simulated_gpu_processes: Option<PathBuf>,
    /// Simulation only: a JSON file listing back-end calls of the simulated GPUs that
    /// fail while listed (`[{"op", "error"}]`), so that tests of the real binary can
    /// inject a driver fault.
    pub simulated_gpu_faults: Option<PathBuf>,
    /// How often the reconciler re-reads every enforced share from the kernel/driver.
    pub reconcile_period: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Generic,
    Net,
    Gpu,
}

impl DeviceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeviceKind::Generic => "generic",
            DeviceKind::Net => "net",
            DeviceKind::Gpu => "gpu",
        }
    }
}

#[derive(Clone, Debug)]
pub struct DeviceConfig {
    pub name: String,
    pub driver: String,
    /// As configured, else the node's name.
    pub pool: String,
    pub kind: DeviceKind,
    /// Namespaces that may use the device; `*` allows all.
    pub allowed_namespaces: Vec<String>,
    /// Namespaces that may request admin access.
    pub admin_namespaces: Vec<String>,
    pub capacities: BTreeMap<String, CapacityConfig>,
    /// For `net` devices: the mechanism the config insists on; `None` (`auto`) takes
    /// the first of `AUTO_ORDER` the kernel probe finds (never `edt-fq`).
    pub net_mechanism: Option<Mechanism>,
    /// For `net` devices: what the path from a pod carries at most, bit/s (`line_rate`).
    /// A share direction limited at or above it is counted but not shaped (its status
    /// says "unconstrained"): shaping it would cost throughput and hold nothing back.
    /// None (the default): every limit is shaped.
    pub net_line_rate_bps: Option<u64>,
    /// For `gpu` devices: back end, GPU and watchdog.
    pub gpu: Option<GpuConfig>,
    /// The rollout stage the device starts in, until one is set at runtime (which the
    /// store keeps); `enforce` by default.
    pub stage: crate::rollout::Stage,
    /// The DeviceClass the device is rolled out and measured with (`class`): a stage
    /// can be set for every device of a class at once, and the SLO figures are kept
    /// per class. By default the class in `deploy/` that selects the device's kind.
    pub class: String,
}

impl DeviceConfig {
    pub fn allows_namespace(&self, ns: &str) -> bool {
        self.allowed_namespaces.iter().any(|a| a == "*" || a == ns)
    }

    pub fn is_admin_namespace(&self, ns: &str) -> bool {
        self.admin_namespaces.iter().any(|a| a == ns)
    }
}

#[derive(Clone, Debug)]
pub struct CapacityConfig {
    pub value: Quantity,
    pub policy: Policy,
}

#[derive(Debug, thiserror::Error)]
#[error("{path}:{line}: {message}")]
pub struct ConfigError {
    pub path: String,
    pub line: usize,
    pub message: String,
}

/// The file as parsed, before any check; its shape is also what
/// [`crate::config::reference`] walks.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    #[serde(default)]
    agent: RawAgent,
    #[serde(default, rename = "device")]
    devices: Vec<Spanned<RawDevice>>,
    slo: Option<crate::config::slo::RawSlo>,
    rollout: Option<crate::config::rollout::RawRollout>,
}

/// `metrics_tls = { cert_file = "...", key_file = "...", client_ca_file = "..." }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMetricsTls {
    cert_file: PathBuf,
    key_file: PathBuf,
    client_ca_file: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    node_name: Option<Spanned<String>>,
    socket: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    metrics_addr: Option<Spanned<String>>,
    health_addr: Option<Spanned<String>>,
    metrics_token_file: Option<PathBuf>,
    metrics_tls: Option<RawMetricsTls>,
    audit_log: Option<PathBuf>,
    /// An integer or a quantity string ("64Mi").
    audit_max_bytes: Option<Spanned<RawBytes>>,
    audit_keep: Option<Spanned<u32>>,
    allowed_uids: Option<Spanned<Vec<u32>>>,
    plugin_uids: Option<Spanned<Vec<u32>>>,
    reader_uids: Option<Spanned<Vec<u32>>>,
    socket_group: Option<u32>,
    max_claims_per_request: Option<Spanned<usize>>,
    tombstone_retention: Option<Spanned<String>>,
    tombstone_max: Option<Spanned<usize>>,
    bpffs_dir: Option<PathBuf>,
    cdi_dir: Option<PathBuf>,
    cgroup_root: Option<PathBuf>,
    pod_cgroup_roots: Option<Vec<PathBuf>>,
    kubelet_dir: Option<Spanned<PathBuf>>,
    rescan_period: Option<Spanned<String>>,
    counters_period: Option<Spanned<String>>,
    max_watchers: Option<Spanned<usize>>,
    metrics_max_age: Option<Spanned<String>>,
    mps_control: Option<PathBuf>,
    mps_dir: Option<Spanned<PathBuf>>,
    mps_launcher: Option<Spanned<Vec<String>>>,
    mps_cgroup: Option<Spanned<String>>,
    /// A quantity: the cap of each MPS share's /dev/shm tmpfs.
    mps_shm_size: Option<Spanned<String>>,
    simulated_gpu_processes: Option<PathBuf>,
    simulated_gpu_faults: Option<PathBuf>,
    reconcile_period: Option<Spanned<String>>,
}

/// A byte count written as a TOML integer or as a quantity string.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawBytes {
    Int(i64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Spanned<String>,
    driver: Spanned<String>,
    /// The node's name unless set.
    pool: Option<Spanned<String>>,
    kind: Spanned<String>,
    #[serde(default)]
    allowed_namespaces: Vec<Spanned<String>>,
    #[serde(default)]
    admin_namespaces: Vec<Spanned<String>>,
    #[serde(default)]
    capacity: BTreeMap<Spanned<String>, Spanned<RawCapacity>>,
    /// For `net` devices: the shared NIC the device stands for; its link speed is the
    /// capacity of a bandwidth capacity that gives no `value`.
    interface: Option<Spanned<String>>,
    /// For `net` devices: "auto" (the default) or a mechanism name.
    mechanism: Option<Spanned<String>>,
    /// For `net` devices: what the path from a pod carries at most, as a quantity in
    /// bit/s; a limit at or above it is not shaped.
    line_rate: Option<Spanned<String>>,
    /// For `gpu` devices, see [`crate::config::gpu`].
    backend: Option<Spanned<String>>,
    uuid: Option<Spanned<String>>,
    index: Option<Spanned<u32>>,
    watchdog: Option<Spanned<RawWatchdog>>,
    simulated: Option<Spanned<RawSimulated>>,
    driver_root: Option<Spanned<String>>,
    container_driver_root: Option<Spanned<String>>,
    /// The first rollout stage: "observe" or "enforce" (the default).
    stage: Option<Spanned<String>>,
    /// The DeviceClass the device belongs to for rollout and SLOs.
    class: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCapacity {
    value: Option<Spanned<String>>,
    /// For `net` devices with an interface and no `value`: the capacity as this
    /// percentage of the link speed, so that one config leaves the same headroom on
    /// nodes whose NICs differ.
    link_percent: Option<Spanned<i64>>,
    default: Option<Spanned<String>>,
    #[serde(default)]
    valid_values: Vec<String>,
    valid_range: Option<Spanned<RawRange>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRange {
    min: String,
    max: Option<String>,
    step: Option<String>,
}

/// An upper bound of the capacities one device may have: resource.k8s.io allows 32
/// attributes and capacities per device together (the config allows fewer, since the
/// published attributes count too). It also bounds what one share record holds.
pub const MAX_CAPACITIES: usize = 32;

/// Maximum claims in one Prepare or Unprepare unless the config says otherwise.
pub const DEFAULT_MAX_CLAIMS: usize = 128;
/// The most `WatchShares` streams `[agent] max_watchers` may allow.
pub const MAX_WATCHERS: usize = 65_536;

impl Config {
    /// The node's name from `[agent] node_name`, else this host's name.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_for(path, &NodeNameSources::this_host(None))
    }

    /// [`Config::load`] with the node's name from `node` where `[agent] node_name`
    /// does not give it.
    pub fn load_for(path: &Path, node: &NodeNameSources) -> Result<Config, ConfigError> {
        Config::parse_for(&Config::read(path)?, &path.display().to_string(), node)
    }

    /// The text of the config file at `path`.
    pub fn read(path: &Path) -> Result<String, ConfigError> {
        std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.display().to_string(),
            line: 0,
            message: format!("cannot read: {e}"),
        })
    }

    /// The node's name from `[agent] node_name`, else this host's name.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Config::parse_for(text, origin, &NodeNameSources::this_host(None))
    }

    /// Parses `text` as the config of the node `node` names where `[agent] node_name`
    /// does not: its `[[node]]` table applied, its devices' pools defaulted to its name.
    pub fn parse_for(
        text: &str,
        origin: &str,
        node: &NodeNameSources,
    ) -> Result<Config, ConfigError> {
        let err = |span: std::ops::Range<usize>, message: String| ConfigError {
            path: origin.to_owned(),
            line: line_of(text, span.start),
            message,
        };
        let problem = |(span, message): Problem| ConfigError {
            path: origin.to_owned(),
            line: span.map_or(0, |s| line_of(text, s.start)),
            message,
        };
        let toml_err = |prefix: &str, e: toml::de::Error| ConfigError {
            path: origin.to_owned(),
            line: e.span().map(|s| line_of(text, s.start)).unwrap_or(0),
            message: format!("{prefix}{}", e.message()),
        };
        let deserialize = |doc: Spanned<toml::de::DeTable<'_>>, prefix: &str| {
            RawConfig::deserialize(toml::de::Deserializer::from(doc))
                .map_err(|e| toml_err(prefix, e))
        };
        let mut doc = toml::de::DeTable::parse(text).map_err(|e| toml_err("", e))?;
        let overrides = crate::config::node::take_overrides(doc.get_mut()).map_err(problem)?;
        // What every node shares, checked on every node: `[agent]` (which no [[node]]
        // table changes) and the devices as they are without a [[node]] table.
        let base = deserialize(doc.clone(), "")?;
        let node_name = NodeName::resolve(base.agent.node_name.as_ref(), node).map_err(problem)?;
        // Every [[node]] table is checked here, not only where it applies: a misspelt
        // field or device would otherwise surface only when that node's agent restarts.
        for o in &overrides {
            let mut theirs = doc.clone();
            crate::config::node::apply(theirs.get_mut(), o).map_err(problem)?;
            deserialize(theirs, &format!("[[node]] {}: ", o.name.get_ref()))?;
        }
        let raw = match overrides.first() {
            None => base,
            Some(first) => {
                let name = node_name.need().map_err(|why| {
                    err(
                        first.name.span(),
                        format!("[[node]] tables are matched against the node's name, and {why}"),
                    )
                })?;
                match overrides.iter().find(|o| o.name.get_ref() == name) {
                    None => base,
                    Some(o) => {
                        crate::config::node::apply(doc.get_mut(), o).map_err(problem)?;
                        deserialize(doc, "")?
                    }
                }
            }
        };

        let a = raw.agent;
        let addr = |key: &str, s: &Option<Spanned<String>>| {
            s.as_ref()
                .map(|s| {
                    s.get_ref().parse::<SocketAddr>().map_err(|e| {
                        err(
                            s.span(),
                            format!("agent.{key}: {:?} is not host:port: {e}", s.get_ref()),
                        )
                    })
                })
                .transpose()
        };
        let metrics_addr = addr("metrics_addr", &a.metrics_addr)?
            .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9464)));
        let health_addr = addr("health_addr", &a.health_addr)?;
        let client_certs = a
            .metrics_tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some());
        if !metrics_addr.ip().is_loopback()
            && a.metrics_token_file.is_none()
            && !client_certs
            && let Some(s) = &a.metrics_addr
        {
            return Err(err(
                s.span(),
                format!(
                    "agent.metrics_addr: {metrics_addr} is reachable from other hosts, and the metrics name tenants' namespaces and claims: bind it to loopback, or set metrics_token_file (a bearer token) or metrics_tls with client_ca_file (client certificates) so that only authenticated scrapers read them"
                ),
            ));
        }
        // A uid listed but unable to connect is a config that does not do what it says.
        if a.socket_group.is_none() {
            for (key, list) in [
                ("allowed_uids", &a.allowed_uids),
                ("plugin_uids", &a.plugin_uids),
                ("reader_uids", &a.reader_uids),
            ] {
                if let Some(l) = list
                    && let Some(uid) = l.get_ref().iter().find(|u| **u != 0)
                {
                    return Err(err(
                        l.span(),
                        format!(
                            "agent.{key}: uid {uid} could never connect: the API socket is root's alone (mode 0600) unless socket_group names the group its callers are in (mode 0660)"
                        ),
                    ));
                }
            }
        }
        let max_watchers = match a.max_watchers {
            // Watchers are the kubelet plugin and SREs' `shareguard watch`: a handful.
            None => 64,
            Some(n) if *n.get_ref() == 0 => {
                return Err(err(
                    n.span(),
                    "agent.max_watchers: must be at least 1".into(),
                ));
            }
            // Each open stream holds a semaphore permit, and a semaphore takes at most
            // `usize::MAX >> 3` (it panics above); far below that, every stream costs a
            // task and a queue, so the bound is what one node can really serve.
            Some(n) if *n.get_ref() > MAX_WATCHERS => {
                return Err(err(
                    n.span(),
                    format!(
                        "agent.max_watchers: {} is more than the {MAX_WATCHERS} streams one agent serves at once",
                        n.get_ref()
                    ),
                ));
            }
            Some(n) => n.into_inner(),
        };
        let max_claims_per_request = match a.max_claims_per_request {
            None => DEFAULT_MAX_CLAIMS,
            Some(n) if *n.get_ref() == 0 => {
                return Err(err(
                    n.span(),
                    "agent.max_claims_per_request: must be at least 1".into(),
                ));
            }
            Some(n) => n.into_inner(),
        };
        let duration = |field: &str, s: &Spanned<String>| {
            crate::duration::parse(s.get_ref())
                .map_err(|e| err(s.span(), format!("agent.{field}: {:?}: {e}", s.get_ref())))
        };
        let tombstone_retention = match &a.tombstone_retention {
            None => Duration::from_secs(24 * 3600),
            Some(s) => duration("tombstone_retention", s)?,
        };
        let tombstone_max = match a.tombstone_max {
            // 100,000 records are about 600 MiB of the agent (docs/benchmarks.md): the
            // default keeps tombstones to a tenth of that.
            None => 10_000,
            Some(n) if *n.get_ref() == 0 => {
                return Err(err(
                    n.span(),
                    "agent.tombstone_max: must be at least 1 (a release is kept for audit)".into(),
                ));
            }
            Some(n) => n.into_inner(),
        };
        // A period of the agent's loops: at least 100 ms, so that a typo cannot make one
        // spin.
        let period = |field: &str, s: Option<Spanned<String>>, default: Duration| {
            let Some(s) = s else {
                return Ok(default);
            };
            let d = duration(field, &s)?;
            if d < Duration::from_millis(100) {
                return Err(err(
                    s.span(),
                    format!("agent.{field}: must be at least 100ms"),
                ));
            }
            Ok(d)
        };
        // Often enough that drift is noticed within a minute's dashboards, rarely enough
        // that re-reading thousands of shares costs nothing noticeable.
        let reconcile_period = period(
            "reconcile_period",
            a.reconcile_period,
            Duration::from_secs(10),
        )?;
        // Events find a sandbox within milliseconds; this only bounds what a lost event
        // costs.
        let rescan_period = period("rescan_period", a.rescan_period, Duration::from_secs(5))?;
        let counters_period = period("counters_period", a.counters_period, Duration::from_secs(5))?;
        // A second is nothing to a scrape interval of 15 s or more, and bounds what any
        // number of scrapers cost to one render a second.
        let metrics_max_age = match &a.metrics_max_age {
            None => Duration::from_secs(1),
            Some(s) => duration("metrics_max_age", s)?,
        };
        let audit_max_bytes = match a.audit_max_bytes {
            None => crate::audit::DEFAULT_MAX_BYTES,
            Some(b) => {
                let span = b.span();
                let bytes = match b.into_inner() {
                    RawBytes::Int(n) => i128::from(n),
                    RawBytes::Text(t) => Quantity::parse(&t)
                        .ok()
                        .and_then(|q| q.ceil_units())
                        .ok_or_else(|| {
                            err(
                                span.clone(),
                                format!("agent.audit_max_bytes: {t:?} is not a quantity of bytes"),
                            )
                        })?,
                };
                // Zero would rotate before every line; a bound of one line is the least
                // that keeps the log.
                u64::try_from(bytes)
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or_else(|| {
                        err(
                            span,
                            format!("agent.audit_max_bytes: {bytes} is not at least 1 byte"),
                        )
                    })?
            }
        };
        let audit_keep = match a.audit_keep {
            None => crate::audit::DEFAULT_KEEP,
            // Zero would delete the lines a rotation has just moved aside.
            Some(n) if *n.get_ref() == 0 => {
                return Err(err(n.span(), "agent.audit_keep: must be at least 1".into()));
            }
            Some(n) => n.into_inner(),
        };
        let mut mps = shareguard_limiter_gpu::mps::MpsConfig::default();
        if let Some(c) = a.mps_control {
            mps.control = c;
        }
        if let Some(l) = a.mps_launcher {
            let span = l.span();
            let l = l.into_inner();
            if l.first().is_some_and(String::is_empty) {
                return Err(err(
                    span,
                    "agent.mps_launcher: the first element names a program and cannot be empty"
                        .into(),
                ));
            }
            mps.launcher = l;
        }
        if let Some(q) = a.mps_shm_size {
            let span = q.span();
            mps.shm_bytes = Quantity::parse(q.get_ref())
                .ok()
                .and_then(|v| v.ceil_units())
                .and_then(|v| u64::try_from(v).ok())
                .ok_or_else(|| {
                    err(
                        span.clone(),
                        format!(
                            "agent.mps_shm_size: {:?} is not a quantity of bytes",
                            q.get_ref()
                        ),
                    )
                })?;
            shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
                .map_err(|e| err(span, format!("agent.mps_shm_size: {e}")))?;
        }
        if let Some(c) = a.mps_cgroup {
            let span = c.span();
            mps.cgroup = c.into_inner();
            shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
                .map_err(|e| err(span, format!("agent.mps_cgroup: {e}")))?;
        }
        if let Some(d) = a.mps_dir {
            let span = d.span();
            mps.dir = d.into_inner();
            // The same check the daemons make, here so that it names the field.
            shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
                .map_err(|e| err(span, format!("agent.mps_dir: {e}")))?;
        }
        let kubelet_dir = match a.kubelet_dir {
            None => Some(PathBuf::from("/var/lib/kubelet")),
            Some(d) if d.get_ref().as_os_str().is_empty() => None,
            Some(d) if d.get_ref().is_absolute() => Some(d.into_inner()),
            Some(d) => {
                return Err(err(
                    d.span(),
                    format!(
                        "agent.kubelet_dir: {:?} is not an absolute path (\"\" reads no checkpoint)",
                        d.get_ref()
                    ),
                ));
            }
        };
        let state_dir = a
            .state_dir
            .unwrap_or_else(|| PathBuf::from("/var/lib/shareguard"));
        let agent = AgentConfig {
            node_name: node_name.known().map(str::to_owned),
            socket: a
                .socket
                .unwrap_or_else(|| PathBuf::from("/run/shareguard/agent.sock")),
            audit_log: a.audit_log.unwrap_or_else(|| state_dir.join("audit.jsonl")),
            audit_bound: crate::audit::Bound {
                max_bytes: audit_max_bytes,
                keep: audit_keep,
            },
            state_dir,
            metrics_addr,
            health_addr,
            metrics_token_file: a.metrics_token_file,
            metrics_tls: a.metrics_tls.map(|t| crate::api::metrics::tls::MetricsTls {
                cert_file: t.cert_file,
                key_file: t.key_file,
                client_ca_file: t.client_ca_file,
            }),
            allowed_uids: a
                .allowed_uids
                .map(Spanned::into_inner)
                .unwrap_or_else(|| vec![0]),
            plugin_uids: a.plugin_uids.map(Spanned::into_inner).unwrap_or_default(),
            reader_uids: a.reader_uids.map(Spanned::into_inner).unwrap_or_default(),
            socket_group: a.socket_group,
            max_claims_per_request,
            tombstone_retention,
            tombstone_max,
            bpffs_dir: a
                .bpffs_dir
                .unwrap_or_else(|| PathBuf::from("/sys/fs/bpf/shareguard")),
            cdi_dir: a.cdi_dir.unwrap_or_else(|| PathBuf::from("/var/run/cdi")),
            cgroup_root: a.cgroup_root,
            pod_cgroup_roots: a.pod_cgroup_roots.unwrap_or_default(),
            kubelet_dir,
            rescan_period,
            counters_period,
            max_watchers,
            metrics_max_age,
            mps,
            simulated_gpu_processes: a.simulated_gpu_processes,
            simulated_gpu_faults: a.simulated_gpu_faults,
            reconcile_period,
        };

        let class_stages = crate::config::rollout::parse(raw.rollout, &err)?;
        let mut devices = Vec::with_capacity(raw.devices.len());
        // What each device stands for: two devices for one GPU or one NIC would hand out
        // its capacity twice.
        let mut hardware: BTreeMap<String, String> = BTreeMap::new();
        let mut names = BTreeSet::new();
        let mut ids = BTreeSet::new();
        let mut pool_sizes: BTreeMap<(String, String), usize> = BTreeMap::new();
        for d in raw.devices {
            let dspan = d.span();
            let d = d.into_inner();
            let name = d.name.get_ref().clone();
            if !is_dns_label(&name) {
                return Err(err(
                    d.name.span(),
                    format!(
                        "device.name: {name:?} is not a DNS label (lowercase letters, digits, '-', at most 63)"
                    ),
                ));
            }
            if !names.insert(name.clone()) {
                return Err(err(
                    d.name.span(),
                    format!("device.name: {name:?} is defined twice"),
                ));
            }
            if !is_driver_name(d.driver.get_ref()) {
                return Err(err(
                    d.driver.span(),
                    format!(
                        "device {name}: driver {:?} is not a DNS subdomain of at most 63 characters",
                        d.driver.get_ref()
                    ),
                ));
            }
            let pool = match &d.pool {
                Some(p) if !is_pool_name(p.get_ref()) => {
                    return Err(err(
                        p.span(),
                        format!(
                            "device {name}: pool {:?} is not a valid pool name: one or more DNS subdomains joined by '/', at most 253 characters",
                            p.get_ref()
                        ),
                    ));
                }
                Some(p) => p.get_ref().clone(),
                // Node names are DNS subdomains, so a valid one is a valid pool name.
                None => node_name
                    .need()
                    .map_err(|why| {
                        err(
                            d.name.span(),
                            format!(
                                "device {name}: sets no pool, so its pool is the node's name, and {why}"
                            ),
                        )
                    })?
                    .to_owned(),
            };
            if !ids.insert((d.driver.get_ref().clone(), pool.clone(), name.clone())) {
                return Err(err(
                    dspan.clone(),
                    format!("device {name}: driver/pool/name is not unique"),
                ));
            }
            // The plugin publishes a pool as one ResourceSlice.
            let in_pool = pool_sizes
                .entry((d.driver.get_ref().clone(), pool.clone()))
                .or_insert(0usize);
            *in_pool += 1;
            if *in_pool > slice::MAX_DEVICES_PER_SLICE {
                return Err(err(
                    dspan.clone(),
                    format!(
                        "device {name}: pool {pool:?} of driver {:?} has more than {} devices, which resource.k8s.io takes in one ResourceSlice",
                        d.driver.get_ref(),
                        slice::MAX_DEVICES_PER_SLICE
                    ),
                ));
            }
            let kind = match d.kind.get_ref().as_str() {
                "generic" => DeviceKind::Generic,
                // Refused until their limiters exist: an agent that accepted them would
                // report bandwidth or GPU shares it cannot enforce.
                "net" => DeviceKind::Net,
                "gpu" => DeviceKind::Gpu,
                other => {
                    return Err(err(
                        d.kind.span(),
                        format!("device {name}: kind {other:?} is not one of generic, net, gpu"),
                    ));
                }
            };
            let mut allowed = Vec::new();
            for ns in d.allowed_namespaces {
                if ns.get_ref() != "*" && !is_namespace(ns.get_ref()) {
                    return Err(err(
                        ns.span(),
                        format!(
                            "device {name}: allowed_namespaces: {:?} is not a namespace name or \"*\"",
                            ns.get_ref()
                        ),
                    ));
                }
                allowed.push(ns.into_inner());
            }
            let mut admin = Vec::new();
            for ns in d.admin_namespaces {
                if !is_namespace(ns.get_ref()) {
                    return Err(err(
                        ns.span(),
                        format!(
                            "device {name}: admin_namespaces: {:?} is not a namespace name",
                            ns.get_ref()
                        ),
                    ));
                }
                admin.push(ns.into_inner());
            }
            if d.capacity.is_empty() {
                return Err(err(
                    dspan,
                    format!(
                        "device {name}: no [device.capacity.<name>] table: a device needs at least one capacity"
                    ),
                ));
            }
            // The plugin publishes the capacities beside its attributes, and the API
            // server takes at most 32 of both together per device.
            let attributes = slice::attributes_for(kind == DeviceKind::Gpu);
            if d.capacity.len() + attributes > slice::MAX_ATTRIBUTES_AND_CAPACITIES {
                return Err(err(
                    dspan,
                    format!(
                        "device {name}: {} capacities, at most {} for a {} device (resource.k8s.io takes {} attributes and capacities per device, and its ResourceSlice entry has {attributes} attributes)",
                        d.capacity.len(),
                        slice::MAX_ATTRIBUTES_AND_CAPACITIES - attributes,
                        kind.as_str(),
                        slice::MAX_ATTRIBUTES_AND_CAPACITIES,
                    ),
                ));
            }
            let raw_gpu = RawGpu {
                backend: &d.backend,
                uuid: &d.uuid,
                index: &d.index,
                watchdog: &d.watchdog,
                simulated: &d.simulated,
                driver_root: &d.driver_root,
                container_driver_root: &d.container_driver_root,
            };
            let (gpu, gpu_memory) = if kind == DeviceKind::Gpu {
                let memory_given = d
                    .capacity
                    .iter()
                    .any(|(k, c)| k.get_ref() == MEMORY && c.get_ref().value.is_some());
                let (g, q) = raw_gpu
                    .parse(&name, &dspan, memory_given)
                    .map_err(|(span, m)| err(span, m))?;
                (Some(g), q)
            } else {
                if let Some((span, field)) = raw_gpu.first_present() {
                    return Err(err(
                        span,
                        format!("device {name}: {field} is only for kind \"gpu\""),
                    ));
                }
                (None, None)
            };
            let discover_memory = gpu.as_ref().is_some_and(|g| g.discover_memory);
            let mut capacities = BTreeMap::new();
            for (cname, cap) in d.capacity {
                let cspan = cap.span();
                let cap = cap.into_inner();
                let cname_s = cname.get_ref().clone();
                if !is_qualified_name(&cname_s) {
                    return Err(err(
                        cname.span(),
                        format!(
                            "device {name}: capacity name {cname_s:?} is not a resource.k8s.io qualified name: a C identifier (letters, digits, '_'; not starting with a digit; at most 32), optionally after \"<domain>/\""
                        ),
                    ));
                }
                let percent = match &cap.link_percent {
                    None => None,
                    Some(p) => Some(
                        link_percent(p.get_ref(), cap.value.is_some(), kind, &d.interface)
                            .map_err(|why| {
                                err(
                                    p.span(),
                                    format!(
                                        "device {name}: capacity {cname_s}.link_percent: {why}"
                                    ),
                                )
                            })?,
                    ),
                };
                let value = match (&cap.value, kind, &d.interface) {
                    (Some(v), _, _) => Quantity::parse(v.get_ref()).map_err(|e| {
                        err(
                            v.span(),
                            format!("device {name}: capacity {cname_s}.value: {e}"),
                        )
                    })?,
                    (None, DeviceKind::Net, Some(nic)) => {
                        link_speed(nic.get_ref(), percent.unwrap_or(100)).map_err(|why| {
                            err(
                                nic.span(),
                                format!("device {name}: capacity {cname_s} has no value and {why}"),
                            )
                        })?
                    }
                    (None, DeviceKind::Gpu, _) if cname_s == MEMORY && discover_memory => {
                        // Filled in from the GPU when the agent starts.
                        Quantity::ZERO
                    }
                    (None, DeviceKind::Gpu, _) if cname_s == MEMORY && gpu_memory.is_some() => {
                        gpu_memory.unwrap_or(Quantity::ZERO)
                    }
                    (None, _, _) => {
                        return Err(err(
                            cspan,
                            format!("device {name}: capacity {cname_s}: value is required"),
                        ));
                    }
                };
                // Only a GPU's memory is discovered, and only when it has no value.
                let discovered_later = discover_memory && cname_s == MEMORY;
                if !discovered_later && (value.is_negative() || value.is_zero()) {
                    return Err(err(
                        cspan.clone(),
                        format!(
                            "device {name}: capacity {cname_s}.value: {value} must be positive"
                        ),
                    ));
                }
                let range = cap.valid_range.as_ref().map(|r| {
                    let r = r.get_ref();
                    (r.min.as_str(), r.max.as_deref(), r.step.as_deref())
                });
                let policy = Policy::from_parts(
                    cap.default.as_ref().map(|d| d.get_ref().as_str()),
                    &cap.valid_values,
                    range,
                )
                .map_err(|e| {
                    err(
                        cspan.clone(),
                        format!("device {name}: capacity {cname_s}: {e}"),
                    )
                })?;
                // A GPU's memory is checked against the policy once it is read from the
                // GPU (limiters.rs).
                if !discovered_later {
                    policy.check_capacity(&value).map_err(|e| {
                        err(cspan, format!("device {name}: capacity {cname_s}: {e}"))
                    })?;
                }
                capacities.insert(cname_s, CapacityConfig { value, policy });
            }
            if kind == DeviceKind::Gpu
                && let Some(other) = capacities.keys().find(|k| k.as_str() != MEMORY)
            {
                return Err(err(
                    dspan.clone(),
                    format!(
                        "device {name}: a gpu device's only capacity is {MEMORY}; {other:?} is not it"
                    ),
                ));
            }
            let stands_for = match (&gpu, &d.interface) {
                (Some(g), _) => Some((format!("{:?}", g.selector), "GPU")),
                (None, Some(nic)) if kind == DeviceKind::Net => {
                    Some((format!("interface {}", nic.get_ref()), "interface"))
                }
                _ => None,
            };
            if let Some((what, noun)) = stands_for
                && let Some(other) = hardware.insert(what.clone(), name.clone())
            {
                return Err(err(
                    dspan.clone(),
                    format!(
                        "device {name}: names the same {noun} as device {other} ({what}); its capacity would be handed out twice"
                    ),
                ));
            }
            if kind == DeviceKind::Net {
                check_net_capacities(&name, &capacities).map_err(|why| err(dspan.clone(), why))?;
            } else if let Some(nic) = &d.interface {
                return Err(err(
                    nic.span(),
                    format!("device {name}: interface is only for kind \"net\""),
                ));
            }
            let net_mechanism = match &d.mechanism {
                None => None,
                Some(m) if kind != DeviceKind::Net => {
                    return Err(err(
                        m.span(),
                        format!("device {name}: mechanism is only for kind \"net\""),
                    ));
                }
                Some(m) if m.get_ref() == "auto" => None,
                Some(m) => Some(Mechanism::parse(m.get_ref()).ok_or_else(|| {
                    let names: Vec<&str> = Mechanism::ALL.iter().map(|m| m.name()).collect();
                    err(
                        m.span(),
                        format!(
                            "device {name}: mechanism {:?} is not one of auto, {}",
                            m.get_ref(),
                            names.join(", ")
                        ),
                    )
                })?),
            };
            let net_line_rate_bps = match &d.line_rate {
                None => None,
                Some(r) if kind != DeviceKind::Net => {
                    return Err(err(
                        r.span(),
                        format!("device {name}: line_rate is only for kind \"net\""),
                    ));
                }
                Some(r) => Some(
                    line_rate_bps(r.get_ref())
                        .map_err(|why| err(r.span(), format!("device {name}: line_rate: {why}")))?,
                ),
            };
            let class = match &d.class {
                None => default_class(kind).to_owned(),
                Some(c) => {
                    check_class_name(c.get_ref()).map_err(|why| {
                        err(
                            c.span(),
                            format!("device {name}: class {:?}: {why}", c.get_ref()),
                        )
                    })?;
                    c.get_ref().clone()
                }
            };
            let stage = match &d.stage {
                // The class's first stage, where `[rollout.class]` names it.
                None => class_stages.get(&class).copied().unwrap_or_default(),
                Some(s) => crate::config::rollout::parse_stage(s, &format!("device {name}"), &err)?,
            };
            devices.push(DeviceConfig {
                stage,
                class,
                name,
                driver: d.driver.into_inner(),
                pool,
                kind,
                allowed_namespaces: allowed,
                admin_namespaces: admin,
                capacities,
                net_mechanism,
                net_line_rate_bps,
                gpu,
            });
        }
        let slo = crate::config::slo::parse(raw.slo, &err)?;
        Ok(Config {
            agent,
            devices,
            slo,
        })
    }

    pub fn device(&self, name: &str) -> Option<&DeviceConfig> {
        self.devices.iter().find(|d| d.name == name)
    }
}

/// The DeviceClass in `deploy/deviceclasses.yaml` that selects a device of `kind`.
pub fn default_class(kind: DeviceKind) -> &'static str {
    match kind {
        DeviceKind::Net => "shareguard-net-bandwidth",
        DeviceKind::Gpu => "shareguard-gpu-memory",
        DeviceKind::Generic => "shareguard-accounted",
    }
}

/// A DeviceClass's name is a DNS subdomain (RFC 1123): what Kubernetes accepts as one.
pub fn check_class_name(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 253 {
        return Err("a DeviceClass name has 1 to 253 characters".into());
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if !s.split('.').all(label_ok) {
        return Err(
            "a DeviceClass name is lowercase letters, digits, '-' and '.', each part starting and ending with a letter or digit"
                .into(),
        );
    }
    Ok(())
}

/// A `net` device has one symmetric `bandwidth`, or `egressBandwidth` and/or
/// `ingressBandwidth` (the pod's egress and ingress), and nothing else.
fn check_net_capacities(name: &str, caps: &BTreeMap<String, CapacityConfig>) -> Result<(), String> {
    use shareguard_limiter_net::limiter::{BANDWIDTH, CAPACITIES};
    if let Some(other) = caps.keys().find(|k| !CAPACITIES.contains(&k.as_str())) {
        return Err(format!(
            "device {name}: a net device's capacities are {}; {other:?} is not one of them",
            CAPACITIES.join(", ")
        ));
    }
    if caps.contains_key(BANDWIDTH) && caps.len() > 1 {
        return Err(format!(
            "device {name}: bandwidth (both directions) cannot be combined with egressBandwidth or ingressBandwidth"
        ));
    }
    Ok(())
}

/// A line rate in bit/s: a positive whole number of bits per second that fits in 64 bits.
fn line_rate_bps(text: &str) -> Result<u64, String> {
    let q = Quantity::parse(text).map_err(|e| e.to_string())?;
    if q.is_negative() || q.is_zero() {
        return Err(format!("{q} must be positive"));
    }
    let bits = q
        .ceil_units()
        .ok_or_else(|| format!("{q} is out of range"))?;
    if Quantity::from_units(bits, shareguard_common::Format::DecimalSI) != Some(q) {
        return Err(format!("{q} is not a whole number of bit/s"));
    }
    u64::try_from(bits).map_err(|_| format!("{q} is above 2^64-1 bit/s"))
}

/// A capacity's `link_percent`, checked before any link is read: a whole percentage of
/// the link speed, where there is a link speed and no `value` to say otherwise.
fn link_percent(
    percent: &i64,
    has_value: bool,
    kind: DeviceKind,
    interface: &Option<Spanned<String>>,
) -> Result<u8, String> {
    if kind != DeviceKind::Net {
        return Err("only for kind \"net\" (a percentage of its interface's link speed)".into());
    }
    if has_value {
        return Err(
            "value is set too; set one: value is the capacity, link_percent a percentage of the link speed"
                .into(),
        );
    }
    if interface.is_none() {
        return Err("needs the device's interface, whose link speed it is a percentage of".into());
    }
    u8::try_from(*percent)
        .ok()
        .filter(|p| (1..=100).contains(p))
        .ok_or_else(|| format!("{percent} is not a whole percentage from 1 to 100"))
}

/// `percent` % of a NIC's link speed from sysfs, in bit/s.
fn link_speed(nic: &str, percent: u8) -> Result<Quantity, String> {
    if nic.is_empty() || nic.contains('/') || nic == "." || nic == ".." {
        return Err(format!("interface {nic:?} is not an interface name"));
    }
    let path = format!("/sys/class/net/{nic}/speed");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("{path} cannot be read ({e})"))?;
    let mbit: i128 = text
        .trim()
        .parse()
        .ok()
        .filter(|m: &i128| *m > 0)
        .ok_or_else(|| format!("{path} reports no link speed ({:?})", text.trim()))?;
    percent_of_mbit(mbit, percent).ok_or_else(|| format!("{path}: speed out of range"))
}

/// `percent` % of `mbit` Mbit/s as a decimal quantity of bit/s. Exact: a Mbit/s is
/// 10^6 bit/s, so a hundredth of it is a whole 10^4.
fn percent_of_mbit(mbit: i128, percent: u8) -> Option<Quantity> {
    let bits = mbit.checked_mul(10_000)?.checked_mul(i128::from(percent))?;
    Quantity::from_units(bits, shareguard_common::Format::DecimalSI)
}

/// 1-based line of a byte offset, for error messages.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
#[path = "capacity_tests.rs"]
mod capacity_tests;

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
