//! The deployment files: `systemd/shareguard.service` and the manifests in `deploy/`.
//!
//! The unit is checked by systemd itself (`systemd-analyze verify` and `security`) and
//! against the sandbox it is meant to have; the manifests are read as YAML, the way the
//! API server reads them, and checked for the host mounts, the security context, the
//! probes and a config the agent's own parser accepts. Both grant the same capabilities,
//! and a test holds them to that. Nothing here needs a cluster or a running systemd.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_yaml::Value;
use shareguard::config::{Config, DeviceKind};
use shareguard::config_gpu::GpuBackendKind;
use shareguard_tests::{Agent, Options, agent_bin, generic_device};

/// What the agent needs and nothing more; the unit's comments say why for each.
const CAPABILITIES: [&str; 5] = [
    "CAP_BPF",
    "CAP_KILL",
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "CAP_SYS_PTRACE",
];

/// The only paths the unit may make writable.
const WRITABLE: [&str; 4] = [
    "/var/lib/shareguard",
    "/run/shareguard",
    "/sys/fs/bpf",
    "/run/cdi",
];

/// `systemd-analyze security --offline=yes` gave 3.3 ("OK") for the unit with systemd 252
/// (Debian 12): 3.0 before pod discovery added CAP_SYS_PTRACE (reading other uids'
/// /proc/PID/ns/net). The rest of the exposure is what the agent's work needs: root,
/// CAP_SYS_ADMIN, CAP_NET_ADMIN, the host's network, devices and /proc.
const MAX_EXPOSURE: f64 = 3.3;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn unit_text() -> String {
    fs::read_to_string(repo().join("systemd/shareguard.service")).unwrap()
}

/// `[Service]` of the unit: each key with its values in order (a key may repeat).
fn service_section(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut section = String::new();
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            section = line.to_owned();
            continue;
        }
        assert!(
            !line.ends_with('\\'),
            "continuation lines are not parsed here: {line}"
        );
        if section == "[Service]" {
            let (k, v) = line.split_once('=').unwrap();
            out.entry(k.trim().to_owned())
                .or_default()
                .push(v.trim().to_owned());
        }
    }
    out
}

fn one<'a>(s: &'a BTreeMap<String, Vec<String>>, key: &str) -> &'a str {
    match s.get(key).map(Vec::as_slice) {
        Some([v]) => v,
        other => panic!("{key}: expected exactly one value, got {other:?}"),
    }
}

fn words(s: &BTreeMap<String, Vec<String>>, key: &str) -> BTreeSet<String> {
    s.get(key)
        .into_iter()
        .flatten()
        .flat_map(|v| v.split_whitespace())
        .map(str::to_owned)
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// The unit with ExecStart= pointing at the binary this build made, in a directory of
/// its own: systemd-analyze refuses a unit whose binary does not exist, and
/// /usr/local/bin/shareguard is not installed here.
fn unit_for_analysis() -> (tempfile::TempDir, PathBuf) {
    let text = unit_text();
    let installed = "ExecStart=/usr/local/bin/shareguard ";
    assert!(
        text.contains(installed),
        "the unit runs /usr/local/bin/shareguard"
    );
    let bin = agent_bin();
    let text = text.replace(installed, &format!("ExecStart={} ", bin.display()));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shareguard.service");
    fs::write(&path, text).unwrap();
    (dir, path)
}

fn systemd_analyze(args: &[&str], unit: &Path) -> std::process::Output {
    Command::new("systemd-analyze")
        .args(args)
        .arg(unit)
        .output()
        .unwrap_or_else(|e| {
            panic!("systemd-analyze cannot run ({e}): install Debian's `systemd` package")
        })
}

#[test]
fn systemd_analyze_verify_accepts_the_unit_without_a_warning() {
    let (_dir, unit) = unit_for_analysis();
    let out = systemd_analyze(&["verify"], &unit);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Unknown keys, bad values and missing binaries are warnings with exit status 0:
    // any output at all fails the test.
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify: {}\n{text}",
        out.status
    );
}

#[test]
fn systemd_analyze_security_exposure_stays_at_the_measured_level() {
    let (_dir, unit) = unit_for_analysis();
    let out = systemd_analyze(&["security", "--offline=yes", "--no-pager"], &unit);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level for shareguard.service:"))
        .unwrap_or_else(|| panic!("no overall exposure level in:\n{text}"));
    let score: f64 = line
        .rsplit(':')
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unreadable exposure line: {line}"));
    assert!(
        score <= MAX_EXPOSURE,
        "exposure {score} > {MAX_EXPOSURE}; a sandbox option was loosened:\n{text}"
    );
}

#[test]
fn unit_sandbox_grants_only_what_the_agent_uses() {
    let s = service_section(&unit_text());

    assert_eq!(
        words(&s, "CapabilityBoundingSet"),
        set(&CAPABILITIES),
        "capabilities"
    );
    assert!(
        !s.contains_key("AmbientCapabilities"),
        "runs as root: no ambient set"
    );
    assert!(!s.contains_key("User") && !s.contains_key("DynamicUser"));

    assert_eq!(one(&s, "ProtectSystem"), "strict");
    assert_eq!(
        words(&s, "ReadWritePaths"),
        set(&WRITABLE),
        "writable paths"
    );
    for key in [
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateMounts",
        "ProtectControlGroups",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectHostname",
        "LockPersonality",
        "MemoryDenyWriteExecute",
        "RestrictRealtime",
        "RestrictSUIDSGID",
    ] {
        assert_eq!(one(&s, key), "yes", "{key}");
    }
    assert_eq!(
        words(&s, "RestrictAddressFamilies"),
        set(&["AF_UNIX", "AF_NETLINK", "AF_INET", "AF_INET6"])
    );
    // setns() into pod network namespaces; every other namespace type stays refused.
    assert_eq!(one(&s, "RestrictNamespaces"), "net");
    assert_eq!(one(&s, "SystemCallArchitectures"), "native");
    let filter = &s["SystemCallFilter"];
    assert!(
        filter.iter().any(|f| f == "@system-service bpf"),
        "{filter:?}"
    );
    assert!(
        filter.iter().all(|f| !f.contains("@mount")),
        "a bpffs mounted inside the unit's namespace would lose its pins: {filter:?}"
    );

    // Options that would break the agent on a real node (see the unit's comments).
    assert!(
        s.get("ProtectProc").is_none_or(|v| v == &["default"]),
        "the watchdog reads /proc/PID/cgroup of every user's processes"
    );
    assert!(
        s.get("ProcSubset").is_none_or(|v| v == &["all"]),
        "NVML reads /proc/driver/nvidia, the agent /proc/sys/kernel/random/boot_id"
    );
    for key in [
        "PrivateDevices",
        "ProtectClock",
        "DevicePolicy",
        "DeviceAllow",
        "PrivateNetwork",
        "PrivateUsers",
    ] {
        assert!(
            !s.contains_key(key),
            "{key} would hide the GPU or the host's network"
        );
    }
}

/// Every YAML document under deploy/, with the file it came from.
fn manifests() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = fs::read_dir(repo().join("deploy"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    let mut docs = Vec::new();
    for f in files {
        let text = fs::read_to_string(&f).unwrap();
        for d in serde_yaml::Deserializer::from_str(&text) {
            let v = Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                docs.push((f.display().to_string(), v));
            }
        }
    }
    docs
}

fn the(docs: &[(String, Value)], kind: &str) -> Value {
    let found: Vec<&Value> = docs
        .iter()
        .map(|(_, v)| v)
        .filter(|v| v["kind"] == kind)
        .collect();
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0].clone()
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

fn strings(v: &Value) -> BTreeSet<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("not a list: {v:?}"))
        .iter()
        .map(|x| s(x).to_owned())
        .collect()
}

/// The agent container of the DaemonSet.
fn agent_container(ds: &Value) -> Value {
    let cs = ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap();
    cs.iter()
        .find(|c| c["name"] == "agent")
        .expect("a container named agent")
        .clone()
}

fn configmap_config(docs: &[(String, Value)]) -> Config {
    let cm = the(docs, "ConfigMap");
    Config::parse(s(&cm["data"]["agent.toml"]), "configmap agent.toml")
        .unwrap_or_else(|e| panic!("the agent refuses the ConfigMap's config: {e}"))
}

/// The port metrics_addr listens on, and that it is reachable from outside the pod.
fn metrics_port(cfg: &Config) -> u16 {
    assert!(
        cfg.agent.metrics_addr.ip().is_unspecified(),
        "metrics_addr {} is not reachable by the kubelet's probes or Prometheus",
        cfg.agent.metrics_addr
    );
    cfg.agent.metrics_addr.port()
}

#[test]
fn daemonset_mounts_the_host_paths_the_agent_uses() {
    let docs = manifests();
    let ds = the(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let c = agent_container(&ds);

    // Volume name -> (host path, type).
    let mut host: BTreeMap<String, (String, String)> = BTreeMap::new();
    for v in pod["volumes"].as_sequence().unwrap() {
        if let Some(hp) = v.get("hostPath") {
            host.insert(
                s(&v["name"]).to_owned(),
                (s(&hp["path"]).to_owned(), s(&hp["type"]).to_owned()),
            );
        }
    }
    // (host path, hostPath type, mount path, propagation, read-only)
    let want: [(&str, &str, &str, Option<&str>, bool); 7] = [
        // Pins live on the host's bpffs; Directory: the host must have mounted it.
        (
            "/sys/fs/bpf",
            "Directory",
            "/sys/fs/bpf",
            Some("HostToContainer"),
            false,
        ),
        // The node's cgroup root, not the container's own subtree.
        ("/sys/fs/cgroup", "Directory", "/sys/fs/cgroup", None, true),
        (
            "/var/lib/shareguard",
            "DirectoryOrCreate",
            "/var/lib/shareguard",
            None,
            false,
        ),
        (
            "/run/shareguard",
            "DirectoryOrCreate",
            "/run/shareguard",
            None,
            false,
        ),
        (
            "/var/run/cdi",
            "DirectoryOrCreate",
            "/var/run/cdi",
            None,
            false,
        ),
        // Per-pod netns bind mounts appear after the agent started.
        (
            "/run/netns",
            "DirectoryOrCreate",
            "/run/netns",
            Some("HostToContainer"),
            true,
        ),
        (
            "/run/netns",
            "DirectoryOrCreate",
            "/var/run/netns",
            Some("HostToContainer"),
            true,
        ),
    ];
    let mounts = c["volumeMounts"].as_sequence().unwrap();
    let mut seen_host_mounts = BTreeSet::new();
    for (hpath, htype, mpath, prop, ro) in want {
        let m = mounts
            .iter()
            .find(|m| m["mountPath"] == mpath)
            .unwrap_or_else(|| panic!("no volumeMount at {mpath}"));
        let vol = s(&m["name"]);
        let (p, t) = host
            .get(vol)
            .unwrap_or_else(|| panic!("{mpath}: volume {vol} is not a hostPath"));
        assert_eq!((p.as_str(), t.as_str()), (hpath, htype), "{mpath}");
        assert_eq!(
            m.get("mountPropagation").map(s),
            prop,
            "{mpath}: mountPropagation"
        );
        assert_eq!(
            m.get("readOnly").and_then(Value::as_bool).unwrap_or(false),
            ro,
            "{mpath}: readOnly"
        );
        seen_host_mounts.insert(vol.to_owned());
    }
    // No host access beyond the table above.
    assert_eq!(
        host.keys().cloned().collect::<BTreeSet<_>>(),
        seen_host_mounts,
        "hostPath volumes"
    );
    // Bidirectional is refused by the API server for an unprivileged container.
    for m in mounts {
        assert_ne!(m.get("mountPropagation").map(s), Some("Bidirectional"));
    }

    // The config comes from the ConfigMap, at the path the command names, and the paths
    // in it are the mounted ones.
    let cfg_mount = mounts
        .iter()
        .find(|m| m["mountPath"] == "/etc/shareguard")
        .unwrap();
    let cfg_vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == cfg_mount["name"])
        .unwrap();
    let cm = the(&docs, "ConfigMap");
    assert_eq!(cfg_vol["configMap"]["name"], cm["metadata"]["name"]);
    let cmd: Vec<&str> = c["command"].as_sequence().unwrap().iter().map(s).collect();
    assert_eq!(
        cmd,
        [
            "/usr/local/bin/shareguard",
            "agent",
            "--config",
            "/etc/shareguard/agent.toml"
        ]
    );
    let cfg = configmap_config(&docs);
    let a = &cfg.agent;
    assert_eq!(a.socket.parent(), Some(Path::new("/run/shareguard")));
    assert_eq!(a.state_dir, Path::new("/var/lib/shareguard"));
    assert!(a.audit_log.starts_with("/var/lib/shareguard"));
    assert!(a.bpffs_dir.starts_with("/sys/fs/bpf/"));
    assert_eq!(a.cdi_dir, Path::new("/var/run/cdi"));
    assert_eq!(a.cgroup_root.as_deref(), Some(Path::new("/sys/fs/cgroup")));
}

#[test]
fn daemonset_runs_unprivileged_with_the_units_capabilities_in_the_host_namespaces() {
    let docs = manifests();
    let ds = the(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true);
    assert_eq!(pod["hostPID"], true);
    assert_ne!(pod.get("hostIPC"), Some(&Value::Bool(true)));
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["priorityClassName"], "system-node-critical");
    assert!(
        pod["tolerations"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|t| t["operator"] == "Exists" && t.get("key").is_none()),
        "tolerates every taint"
    );
    assert_eq!(ds["spec"]["updateStrategy"]["type"], "RollingUpdate");
    assert_eq!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"],
        1
    );
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() >= 10);

    let sc = &agent_container(&ds)["securityContext"];
    assert_eq!(sc["runAsUser"], 0);
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(strings(&sc["capabilities"]["drop"]), set(&["ALL"]));
    // The same set as the systemd unit, in Kubernetes' spelling.
    let unit_caps: BTreeSet<String> =
        words(&service_section(&unit_text()), "CapabilityBoundingSet")
            .iter()
            .map(|c| c.strip_prefix("CAP_").unwrap().to_owned())
            .collect();
    assert_eq!(strings(&sc["capabilities"]["add"]), unit_caps);
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");

    // The agent never calls the API server: no token, no RBAC.
    let sa = the(&docs, "ServiceAccount");
    assert_eq!(sa["automountServiceAccountToken"], false);
    assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
    for (file, d) in &docs {
        let kind = s(&d["kind"]);
        assert!(
            !kind.ends_with("Role") && !kind.ends_with("RoleBinding"),
            "{file}: {kind}"
        );
    }
}

#[test]
fn configmap_config_is_accepted_by_the_agent_and_has_a_net_and_an_nvml_gpu_device() {
    let docs = manifests();
    let cfg = configmap_config(&docs);
    let net = cfg
        .devices
        .iter()
        .find(|d| d.kind == DeviceKind::Net)
        .expect("a net device");
    assert!(net.capacities.contains_key("bandwidth"));
    let gpu = cfg
        .devices
        .iter()
        .find(|d| d.kind == DeviceKind::Gpu)
        .expect("a gpu device");
    assert!(matches!(
        gpu.gpu.as_ref().unwrap().backend,
        GpuBackendKind::Nvml
    ));
    assert_eq!(cfg.agent.allowed_uids, [0]);
}

#[test]
fn probes_and_scrape_targets_are_what_the_agent_serves() {
    let docs = manifests();
    let ds = the(&docs, "DaemonSet");
    let c = agent_container(&ds);
    let cfg = configmap_config(&docs);
    let port = metrics_port(&cfg);

    // The named container port is metrics_addr's port.
    let ports = c["ports"].as_sequence().unwrap();
    let metrics = ports
        .iter()
        .find(|p| p["name"] == "metrics")
        .expect("a port named metrics");
    assert_eq!(metrics["containerPort"].as_u64(), Some(u64::from(port)));

    // The probes' paths answer 200 on a real agent, with the port they name.
    let agent = Agent::start(Options::new(generic_device(
        "gen-0",
        "10Gi",
        "1Gi",
        &["*"],
        &[],
    )));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(get["port"], "metrics", "{probe}");
        assert_eq!(agent.http(path).0, 200, "{probe} {path}");
    }
    assert_eq!(agent.http("/metrics").0, 200);

    // Annotation-based scraping.
    let ann = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/scrape"], "true");
    assert_eq!(ann["prometheus.io/port"], port.to_string().as_str());
    assert_eq!(ann["prometheus.io/path"], "/metrics");

    // The PodMonitor selects these pods, in their namespace, on that port.
    let pm = the(&docs, "PodMonitor");
    assert_eq!(pm["apiVersion"], "monitoring.coreos.com/v1");
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(&labels[k], v, "PodMonitor selector {k:?}");
    }
    assert!(
        strings(&pm["spec"]["namespaceSelector"]["matchNames"])
            .contains(s(&ds["metadata"]["namespace"]))
    );
    let ep = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["port"], "metrics");
    assert_eq!(ep["path"], "/metrics");
}
