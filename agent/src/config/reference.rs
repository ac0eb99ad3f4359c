//! The reference of every config key: its TOML type, its default and what it means.
//!
//! The keys and their TOML types come from the parser itself: [`keys`] walks the
//! config's `Deserialize` impls with a deserializer that records, for every struct, the
//! fields it asks for (serde hands each struct's field list to `deserialize_struct`),
//! so a key added to the parser and not to [`DOCS`] (or one left in [`DOCS`] after the
//! parser dropped it) fails a test. `shareguard config reference` prints the result;
//! docs/config-reference.md is that output, and a test keeps them equal.

mod keys;

pub use keys::keys;

/// (key, type as the reference states it, default, meaning). The key is the TOML path;
/// `<name>` stands for a table key the user picks (a capacity's or a class's name).
/// The stated type refines the TOML one (a duration, a quantity, a path are strings).
pub const DOCS: &[(&str, &str, &str, &str)] = &[
    // [agent]
    (
        "agent.node_name",
        "string",
        "--node-name, else $NODE_NAME, else the host name",
        "The node's name as the API server knows it: the default pool of every device.",
    ),
    (
        "agent.socket",
        "path",
        "/run/shareguard/agent.sock",
        "The gRPC API's unix socket (mode 0600, or 0660 with socket_group).",
    ),
    (
        "agent.state_dir",
        "path",
        "/var/lib/shareguard",
        "The sled store (<state_dir>/store, mode 0700) and, by default, the audit log.",
    ),
    (
        "agent.metrics_addr",
        "address",
        "127.0.0.1:9464",
        "/metrics, /healthz and /readyz (port 0: any free port). Other than loopback only with metrics_token_file or metrics_tls with client_ca_file.",
    ),
    (
        "agent.health_addr",
        "address",
        "none",
        "/healthz and /readyz alone, without authentication, for kubelet's probes.",
    ),
    (
        "agent.metrics_token_file",
        "path",
        "none",
        "A bearer token /metrics asks for (read for each request).",
    ),
    (
        "agent.metrics_tls.cert_file",
        "path",
        "required in metrics_tls",
        "TLS certificate of metrics_addr (read for each connection: renewed in place).",
    ),
    (
        "agent.metrics_tls.key_file",
        "path",
        "required in metrics_tls",
        "Its private key.",
    ),
    (
        "agent.metrics_tls.client_ca_file",
        "path",
        "none",
        "Only scrapers with a certificate of this CA are served.",
    ),
    (
        "agent.audit_log",
        "path",
        "<state_dir>/audit.jsonl",
        "The audit log, one JSON line per decision.",
    ),
    (
        "agent.audit_max_bytes",
        "integer or quantity",
        "64Mi",
        "The audit log is rotated before it would pass this size.",
    ),
    (
        "agent.audit_keep",
        "integer",
        "4",
        "Rotated audit files kept (audit.jsonl.1 is the newest).",
    ),
    (
        "agent.allowed_uids",
        "array of integers",
        "[0]",
        "Peer uids with the admin role (every RPC).",
    ),
    (
        "agent.plugin_uids",
        "array of integers",
        "[]",
        "Peer uids with the kubelet-plugin role: Prepare, Unprepare, NewEpoch and the reads.",
    ),
    (
        "agent.reader_uids",
        "array of integers",
        "[]",
        "Peer uids with the read-only role: GetShare, ListShares, WatchShares, ListDevices, GetSlo.",
    ),
    (
        "agent.socket_group",
        "integer",
        "none",
        "The socket 0660 and its directory 0750 in this group, for non-root uids above; the agent must be in the group.",
    ),
    (
        "agent.max_claims_per_request",
        "integer",
        "128",
        "Larger Prepare and Unprepare batches are refused.",
    ),
    (
        "agent.tombstone_retention",
        "duration",
        "24h",
        "How long RELEASED and FAILED records are kept for audit.",
    ),
    (
        "agent.tombstone_max",
        "integer",
        "10000",
        "The most RELEASED and FAILED records kept; the oldest beyond it are swept whatever their age.",
    ),
    (
        "agent.bpffs_dir",
        "path",
        "/sys/fs/bpf/shareguard",
        "Pinned maps and links of the bandwidth limiter.",
    ),
    (
        "agent.cdi_dir",
        "path",
        "/var/run/cdi",
        "CDI specs of claims with GPU shares.",
    ),
    (
        "agent.cgroup_root",
        "path",
        "the cgroup v2 mount from the mount table",
        "Where pods' cgroups are looked for.",
    ),
    (
        "agent.pod_cgroup_roots",
        "array of paths",
        "[]",
        "kubelet cgroup roots nested deeper than two levels.",
    ),
    (
        "agent.kubelet_dir",
        "path",
        "/var/lib/kubelet",
        "kubelet's root directory: its DRA checkpoint names the pods of each claim (\"\": not read).",
    ),
    (
        "agent.rescan_period",
        "duration",
        "5s",
        "Every pod looked for again (events find them at once; this bounds a lost event).",
    ),
    (
        "agent.counters_period",
        "duration",
        "5s",
        "Traffic counters read from the kernel, for metrics and what observe measures.",
    ),
    (
        "agent.max_watchers",
        "integer",
        "64",
        "WatchShares streams served at once.",
    ),
    (
        "agent.metrics_max_age",
        "duration",
        "1s",
        "Scrapes within this age of a render share it.",
    ),
    (
        "agent.mps_control",
        "path",
        "/usr/bin/nvidia-cuda-mps-control",
        "NVIDIA's MPS control program.",
    ),
    (
        "agent.mps_dir",
        "path",
        "/run/shareguard-mps",
        "Per-share MPS daemons' directories (at most 40 bytes).",
    ),
    (
        "agent.mps_launcher",
        "array of strings",
        "[]",
        "A command an MPS daemon is started through, e.g. systemd-run; {name} is the share's unit name.",
    ),
    (
        "agent.mps_cgroup",
        "string",
        "shareguard-mps",
        "The cgroup at the top of the cgroup v2 hierarchy that MPS daemons run in, outside the agent's, so that an agent restart ends none (v1 hierarchies: their root).",
    ),
    (
        "agent.mps_shm_size",
        "quantity",
        "the node's memory",
        "Cap of each MPS share's /dev/shm tmpfs (whole MiB), which replaces the containers' own /dev/shm; its pages count against the writing pod's memory limit.",
    ),
    (
        "agent.simulated_gpu_processes",
        "path",
        "none",
        "SIMULATED GPUs only: a JSON file of the processes the simulated driver reports.",
    ),
    (
        "agent.simulated_gpu_faults",
        "path",
        "none",
        "SIMULATED GPUs only: a JSON file of faults the simulated driver injects.",
    ),
    (
        "agent.reconcile_period",
        "duration",
        "10s",
        "How often every enforced share is read back and drift repaired.",
    ),
    // [[device]]
    (
        "device.name",
        "string",
        "required",
        "Unique on the node; a DNS label.",
    ),
    (
        "device.driver",
        "string",
        "required",
        "The DRA driver name (a DNS subdomain) the device is published under.",
    ),
    (
        "device.pool",
        "string",
        "agent.node_name",
        "The ResourceSlice pool; no two nodes may share one.",
    ),
    (
        "device.kind",
        "string",
        "required",
        "net (bandwidth through eBPF on tc), gpu (GPU memory) or generic (accounting only).",
    ),
    (
        "device.allowed_namespaces",
        "array of strings",
        "[] (none: a warning at start)",
        "Namespaces whose claims may use the device; \"*\" allows all.",
    ),
    (
        "device.admin_namespaces",
        "array of strings",
        "[]",
        "Namespaces whose claims may use adminAccess on the device.",
    ),
    (
        "device.capacity.<name>.value",
        "quantity",
        "net: the interface's link speed times link_percent; else required",
        "The device's capacity of <name> (bandwidth in bit/s; binary suffixes get a hint). \
         For net, the link speed lets the shares fill the wire, and a tenant's packets then \
         wait behind the others' bursts in the NIC's queue: where tenants need their latency \
         kept, publish a fraction of it (link_percent).",
    ),
    (
        "device.capacity.<name>.link_percent",
        "integer",
        "100",
        "net with an interface, instead of value: 1 to 100, the capacity as this percentage \
         of the interface's link speed, read at start, so one config keeps the same headroom on \
         nodes whose NICs differ. In the isolation bench, with 1 to 32 tenants saturating \
         their shares, 10 kept a quiet tenant's p99 within 10% of its p99 alone at every \
         count; 20 did up to 8 tenants, and 50 and 100 did not (docs/benchmarks.md, \
         \"The NIC's line rate against the capacity\").",
    ),
    (
        "device.capacity.<name>.default",
        "quantity",
        "none",
        "The request policy's default amount.",
    ),
    (
        "device.capacity.<name>.valid_values",
        "array of quantities",
        "[]",
        "The request policy's allowed amounts (instead of valid_range).",
    ),
    (
        "device.capacity.<name>.valid_range.min",
        "quantity",
        "required in valid_range",
        "The smallest amount.",
    ),
    (
        "device.capacity.<name>.valid_range.max",
        "quantity",
        "the capacity",
        "The largest amount.",
    ),
    (
        "device.capacity.<name>.valid_range.step",
        "quantity",
        "none (any amount from min)",
        "Amounts are min + n * step.",
    ),
    (
        "device.interface",
        "string",
        "none",
        "net: the NIC the device stands for, or auto: the NIC of the node's default route \
         (IPv4, else IPv6), found at start; its speed is the capacity when value is not set, \
         its link state the device's health (down or gone: unhealthy), and its PCIe root, PCI \
         address and NUMA node are published as attributes.",
    ),
    (
        "device.mechanism",
        "string",
        "auto",
        "net: auto (htb-ebpf, else bpf-policer), or htb-ebpf, bpf-policer, edt-fq by name.",
    ),
    (
        "device.line_rate",
        "quantity",
        "none",
        "net: what a pod's path carries at most (bit/s); a share at or above it is counted, not shaped.",
    ),
    (
        "device.backend",
        "string",
        "nvml",
        "gpu: nvml, or simulated (named as such everywhere).",
    ),
    (
        "device.uuid",
        "string",
        "none",
        "gpu: the GPU by UUID (or index).",
    ),
    (
        "device.index",
        "integer",
        "none",
        "gpu: the GPU by NVML index (or uuid).",
    ),
    (
        "device.gpus",
        "string",
        "none",
        "gpu: \"all\" (instead of uuid or index): one device per GPU the back end lists when the agent starts, named <name>-<its uuid>; none on a node without GPUs.",
    ),
    (
        "device.driver_root",
        "path",
        "/ (nvml); none (simulated)",
        "gpu: where the driver's device nodes, libraries and tools are on the host (/run/nvidia/driver under the GPU Operator); the share's containers get them from there.",
    ),
    (
        "device.container_driver_root",
        "path",
        "none",
        "gpu: where the agent's container mounts the host's driver root (the chart: /driver-root); without it the agent reads the root through pid 1's root, or as it is.",
    ),
    (
        "device.watchdog.period",
        "duration",
        "1s",
        "gpu: how often the GPU's processes are read.",
    ),
    (
        "device.watchdog.action",
        "string",
        "report",
        "gpu: report, or terminate the process of a share over its limit.",
    ),
    (
        "device.watchdog.grace",
        "duration",
        "10s",
        "gpu, terminate only: how long a share may stay over its limit first.",
    ),
    (
        "device.simulated.memory",
        "quantity",
        "required in simulated",
        "SIMULATED GPU: its memory.",
    ),
    (
        "device.simulated.cgroup_limits",
        "boolean",
        "true",
        "SIMULATED GPU: offers per-cgroup memory limits.",
    ),
    (
        "device.simulated.mps",
        "boolean",
        "true",
        "SIMULATED GPU: offers MPS.",
    ),
    (
        "device.simulated.count",
        "integer",
        "1",
        "SIMULATED GPU, gpus = \"all\" only: how many GPUs the back end lists (1 to 64).",
    ),
    (
        "device.simulated.pci_bus_id",
        "string",
        "none",
        "SIMULATED GPU: the PCI address it claims (0000:3b:00.0), whose place in the machine is read from sysfs as a real GPU's.",
    ),
    (
        "device.stage",
        "string",
        "its class's (rollout.class), else enforce",
        "The rollout stage to start in: enforce, or observe (admitted, counted, measured, nothing limited).",
    ),
    (
        "device.class",
        "string",
        "by kind: shareguard-net-bandwidth, shareguard-gpu-memory, shareguard-accounted",
        "The DeviceClass for rollout and SLOs.",
    ),
    // [rollout]
    (
        "rollout.class.<name>",
        "string",
        "none",
        "The stage DeviceClass <name>'s devices start in (a device's own stage wins).",
    ),
    // [slo]
    (
        "slo.window",
        "duration",
        "1h",
        "The window the verdict is judged over.",
    ),
    (
        "slo.short_window",
        "duration",
        "5m",
        "A shorter window reported beside it.",
    ),
    (
        "slo.save_period",
        "duration",
        "30s",
        "How often the windows are saved in the store for the next start (also at every \
         stop); a crash loses what came after the last save. 1s to 7 days.",
    ),
    (
        "slo.prepare_p99",
        "duration",
        "100ms",
        "Objective: Prepare p99.",
    ),
    (
        "slo.convergence_p99",
        "duration",
        "10s",
        "Objective: admission to ENFORCED p99.",
    ),
    (
        "slo.refusal_rate_max",
        "float",
        "0.05",
        "Objective: refused claims over claims asked for.",
    ),
    (
        "slo.read_back_ratio_min",
        "float",
        "0.99",
        "Objective: limits read back over requested.",
    ),
    (
        "slo.drift_repairs_max",
        "integer",
        "5",
        "Objective: drift repairs in the window.",
    ),
    (
        "slo.recovery_max",
        "duration",
        "10s",
        "Objective: agent start to every share verified.",
    ),
    (
        "slo.min_samples",
        "integer",
        "20",
        "Fewer claims in the window than this: hold.",
    ),
    (
        "slo.class.<name>.prepare_p99",
        "duration",
        "slo.prepare_p99",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.convergence_p99",
        "duration",
        "slo.convergence_p99",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.refusal_rate_max",
        "float",
        "slo.refusal_rate_max",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.read_back_ratio_min",
        "float",
        "slo.read_back_ratio_min",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.drift_repairs_max",
        "integer",
        "slo.drift_repairs_max",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.recovery_max",
        "duration",
        "slo.recovery_max",
        "The objective for DeviceClass <name>.",
    ),
    (
        "slo.class.<name>.min_samples",
        "integer",
        "slo.min_samples",
        "The objective for DeviceClass <name>.",
    ),
];

/// Whether the reference's stated type can be the parser's TOML type.
fn fits(stated: &str, toml: &str) -> bool {
    match toml {
        "string" => matches!(
            stated,
            "string" | "path" | "address" | "duration" | "quantity"
        ),
        "integer" => stated == "integer",
        "float" => stated == "float",
        "boolean" => stated == "boolean",
        "array" => stated.starts_with("array of "),
        "any" => stated.contains(" or "),
        _ => false,
    }
}

/// The reference as Markdown (docs/config-reference.md).
pub fn markdown() -> String {
    let mut out = String::from(
        "# Config reference\n\n\
         Every key of the agent's config file (`shareguard agent --config FILE`), generated\n\
         from the parser by `shareguard config reference`; a test fails when this file\n\
         differs from its output or a key is missing. `<name>` is a name you choose (a\n\
         capacity, a DeviceClass). Durations are written as `500ms`, `10s`, `1h`; quantities\n\
         as Kubernetes quantities (`10G` bit/s, `40Gi` bytes). `shareguard config check FILE`\n\
         validates a file without starting the agent.\n\n",
    );
    let mut section = "";
    for (key, ty, default, meaning) in DOCS {
        let top = key.split('.').next().unwrap_or_default();
        if top != section {
            section = top;
            let title = match top {
                "agent" => "`[agent]`",
                "device" => "`[[device]]` (one table per device)",
                "rollout" => "`[rollout]`",
                _ => "`[slo]`",
            };
            out.push_str(&format!(
                "## {title}\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
            ));
        }
        out.push_str(&format!("| `{key}` | {ty} | {default} | {meaning} |\n"));
        if DOCS
            .iter()
            .skip_while(|d| d.0 != *key)
            .nth(1)
            .is_none_or(|next| next.0.split('.').next() != Some(top))
        {
            out.push('\n');
        }
    }
    out
}

/// Keys the parser accepts and the reference lacks, keys the reference has and the
/// parser does not accept, and keys whose stated type the parser's contradicts.
pub fn mismatches() -> Vec<String> {
    let parsed = keys();
    let mut out = Vec::new();
    for (key, toml) in &parsed {
        match DOCS.iter().find(|d| d.0 == key) {
            None => out.push(format!("{key} ({toml}) is not in the reference")),
            Some(d) if !fits(d.1, toml) => {
                out.push(format!("{key}: stated {:?}, parsed as {toml}", d.1));
            }
            Some(_) => {}
        }
    }
    for d in DOCS {
        if !parsed.contains_key(d.0) {
            out.push(format!("{} is in the reference but not accepted", d.0));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_the_parser_accepts_is_in_the_reference_and_only_those() {
        let keys = keys();
        // The walk itself: it found keys of every level.
        for k in [
            "agent.socket",
            "agent.metrics_tls.cert_file",
            "device.capacity.<name>.valid_range.step",
            "device.watchdog.grace",
            "slo.class.<name>.min_samples",
        ] {
            assert!(keys.contains_key(k), "{k} not found: {keys:?}");
        }
        assert_eq!(keys["agent.allowed_uids"], "array");
        assert_eq!(keys["agent.audit_keep"], "integer");
        assert_eq!(keys["device.simulated.mps"], "boolean");
        assert_eq!(keys["slo.refusal_rate_max"], "float");
        assert_eq!(keys["agent.audit_max_bytes"], "any");
        assert!(!keys.contains_key("device"), "a table is no key: {keys:?}");
        let m = mismatches();
        assert!(m.is_empty(), "{m:#?}");
    }

    #[test]
    fn the_docs_file_is_the_generated_reference() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config-reference.md");
        let want = markdown();
        if std::env::var_os("SHAREGUARD_WRITE_CONFIG_REFERENCE").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "docs/config-reference.md is not `shareguard config reference`'s output; \
             SHAREGUARD_WRITE_CONFIG_REFERENCE=1 cargo test -p shareguard config::reference writes it"
        );
    }
}
