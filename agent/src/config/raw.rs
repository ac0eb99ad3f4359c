//! The config file as TOML gives it, before any check: spans kept for the errors'
//! lines. `mod.rs` and the section parsers beside it turn it into [`super::Config`].

use std::{collections::BTreeMap, path::PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::gpu::{RawSimulated, RawWatchdog};

/// The file as parsed, before any check; its shape is also what
/// [`crate::config::reference`] walks.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawConfig {
    #[serde(default)]
    pub(super) agent: RawAgent,
    #[serde(default, rename = "device")]
    pub(super) devices: Vec<Spanned<RawDevice>>,
    pub(super) slo: Option<crate::config::slo::RawSlo>,
    pub(super) rollout: Option<crate::config::rollout::RawRollout>,
}

/// `metrics_tls = { cert_file = "...", key_file = "...", client_ca_file = "..." }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMetricsTls {
    pub(super) cert_file: PathBuf,
    pub(super) key_file: PathBuf,
    pub(super) client_ca_file: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAgent {
    pub(super) node_name: Option<Spanned<String>>,
    pub(super) socket: Option<PathBuf>,
    pub(super) state_dir: Option<PathBuf>,
    pub(super) metrics_addr: Option<Spanned<String>>,
    pub(super) health_addr: Option<Spanned<String>>,
    pub(super) metrics_token_file: Option<PathBuf>,
    pub(super) metrics_tls: Option<RawMetricsTls>,
    pub(super) audit_log: Option<PathBuf>,
    /// An integer or a quantity string ("64Mi").
    pub(super) audit_max_bytes: Option<Spanned<RawBytes>>,
    pub(super) audit_keep: Option<Spanned<u32>>,
    pub(super) allowed_uids: Option<Spanned<Vec<u32>>>,
    pub(super) plugin_uids: Option<Spanned<Vec<u32>>>,
    pub(super) reader_uids: Option<Spanned<Vec<u32>>>,
    pub(super) socket_group: Option<u32>,
    pub(super) max_claims_per_request: Option<Spanned<usize>>,
    pub(super) tombstone_retention: Option<Spanned<String>>,
    pub(super) tombstone_max: Option<Spanned<usize>>,
    pub(super) bpffs_dir: Option<PathBuf>,
    pub(super) cdi_dir: Option<PathBuf>,
    pub(super) cgroup_root: Option<PathBuf>,
    pub(super) pod_cgroup_roots: Option<Vec<PathBuf>>,
    pub(super) kubelet_dir: Option<Spanned<PathBuf>>,
    pub(super) rescan_period: Option<Spanned<String>>,
    pub(super) counters_period: Option<Spanned<String>>,
    pub(super) max_watchers: Option<Spanned<usize>>,
    pub(super) metrics_max_age: Option<Spanned<String>>,
    pub(super) mps_control: Option<PathBuf>,
    pub(super) mps_dir: Option<Spanned<PathBuf>>,
    pub(super) mps_launcher: Option<Spanned<Vec<String>>>,
    pub(super) mps_cgroup: Option<Spanned<String>>,
    /// A quantity: the cap of each MPS share's /dev/shm tmpfs.
    pub(super) mps_shm_size: Option<Spanned<String>>,
    pub(super) simulated_gpu_processes: Option<PathBuf>,
    pub(super) simulated_gpu_faults: Option<PathBuf>,
    pub(super) reconcile_period: Option<Spanned<String>>,
}

/// A byte count written as a TOML integer or as a quantity string.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum RawBytes {
    Int(i64),
    Text(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDevice {
    pub(super) name: Spanned<String>,
    pub(super) driver: Spanned<String>,
    /// The node's name unless set.
    pub(super) pool: Option<Spanned<String>>,
    pub(super) kind: Spanned<String>,
    #[serde(default)]
    pub(super) allowed_namespaces: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) admin_namespaces: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) capacity: BTreeMap<Spanned<String>, Spanned<RawCapacity>>,
    /// For `net` devices: the shared NIC the device stands for; its link speed is the
    /// capacity of a bandwidth capacity that gives no `value`.
    pub(super) interface: Option<Spanned<String>>,
    /// For `net` devices: "auto" (the default) or a mechanism name.
    pub(super) mechanism: Option<Spanned<String>>,
    /// For `net` devices: what the path from a pod carries at most, as a quantity in
    /// bit/s; a limit at or above it is not shaped.
    pub(super) line_rate: Option<Spanned<String>>,
    /// For `gpu` devices, see [`crate::config::gpu`].
    pub(super) backend: Option<Spanned<String>>,
    pub(super) uuid: Option<Spanned<String>>,
    pub(super) index: Option<Spanned<u32>>,
    pub(super) gpus: Option<Spanned<String>>,
    pub(super) watchdog: Option<Spanned<RawWatchdog>>,
    pub(super) simulated: Option<Spanned<RawSimulated>>,
    pub(super) driver_root: Option<Spanned<String>>,
    pub(super) container_driver_root: Option<Spanned<String>>,
    /// The first rollout stage: "observe" or "enforce" (the default).
    pub(super) stage: Option<Spanned<String>>,
    /// The DeviceClass the device belongs to for rollout and SLOs.
    pub(super) class: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCapacity {
    pub(super) value: Option<Spanned<String>>,
    /// For `net` devices with an interface and no `value`: the capacity as this
    /// percentage of the link speed, so that one config leaves the same headroom on
    /// nodes whose NICs differ.
    pub(super) link_percent: Option<Spanned<i64>>,
    pub(super) default: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) valid_values: Vec<String>,
    pub(super) valid_range: Option<Spanned<RawRange>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRange {
    pub(super) min: String,
    pub(super) max: Option<String>,
    pub(super) step: Option<String>,
}
