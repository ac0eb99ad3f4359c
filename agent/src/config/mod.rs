//! The agent's TOML configuration: where it listens and stores state, and the node's
//! device inventory with capacities and request policies.
//!
//! A bad configuration is refused at start with the file, the line and the reason, and
//! nothing is started: an agent that guesses at its inventory would hand out capacity
//! the node does not have.
//!
//! A device's pool is the node's name unless set, and `[[node]]` tables change devices
//! on one node, so that one file serves every node ([`crate::config::node`]).

mod agent;
mod device;
pub mod gpu;
pub mod node;
mod raw;
pub mod reference;
pub mod rollout;
pub mod slo;
pub mod warnings;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;
use shareguard_common::Quantity;
use shareguard_limiter_net::setup::NetConfig;
use toml::Spanned;

use crate::{
    config::gpu::GpuConfig,
    config::node::{NodeName, NodeNameSources, Problem},
    policy::Policy,
};

pub(crate) use raw::RawConfig;

pub const DEFAULT_PATH: &str = "/etc/shareguard/agent.toml";

#[derive(Clone, Debug)]
pub struct Config {
    pub agent: AgentConfig,
    pub devices: Vec<DeviceConfig>,
    /// `[slo]`: the SLO figures' windows and objectives (see [`crate::config::slo`]).
    pub slo: crate::slo::SloConfig,
}

/// The files of `[agent] metrics_tls`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricsTls {
    /// PEM: the server's certificate first, then its chain.
    pub cert_file: PathBuf,
    /// PEM: the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// PEM: the CA(s) whose client certificates are admitted; None: no client
    /// certificate is asked for (TLS for the server only).
    pub client_ca_file: Option<PathBuf>,
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
    pub metrics_tls: Option<MetricsTls>,
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
    /// For `net` devices: mechanism and line rate.
    pub net: Option<NetConfig>,
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

        let agent = agent::parse(raw.agent, &node_name, &err)?;
        let class_stages = crate::config::rollout::parse(raw.rollout, &err)?;
        let devices = device::parse(raw.devices, &node_name, &class_stages, &err)?;
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
