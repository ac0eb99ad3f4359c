//! The deployment files: `systemd/shareguard.service` and the manifests in `deploy/`.
//!
//! The unit is checked by systemd itself (`systemd-analyze verify` and `security`) and
//! against the sandbox it is meant to have. The manifests (deploy/*.yaml and
//! deploy/examples/*.yaml) are read as YAML, each document as the Kubernetes type its
//! apiVersion and kind name, with no field the type lacks; then checked for the host
//! mounts, the security contexts of the agent and of the kubelet plugin, the plugin's
//! token and RBAC, the DeviceClass selectors, the example claim against the device's
//! request policy, the probes and a config the agent's own parser accepts. The unit and
//! the agent container grant the same capabilities, and a test holds them to that.
//! Nothing here needs a cluster or a running systemd.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_yaml::Value;
use shareguard::config::gpu::GpuBackendKind;
use shareguard::config::node::{NodeNameSources, pool_belongs_to};
use shareguard::config::{Config, DeviceKind};
use shareguard_tests::manifests::check_document;
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
const WRITABLE: [&str; 5] = [
    "/var/lib/shareguard",
    "/run/shareguard",
    "/run/shareguard-mps",
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

/// The manifest files: deploy/*.yaml (what `kubectl apply -f deploy/` applies), the
/// examples in deploy/examples/ and the node cleanup pod in deploy/uninstall/ (checked
/// the same way, applied by hand).
fn manifest_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [
        repo().join("deploy"),
        repo().join("deploy/examples"),
        repo().join("deploy/uninstall"),
    ] {
        let mut here: Vec<PathBuf> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
            .collect();
        here.sort();
        files.extend(here);
    }
    files
}

/// Every YAML document of [`manifest_files`], with the file it came from.
fn manifests() -> Vec<(String, Value)> {
    let mut docs = Vec::new();
    for f in manifest_files() {
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

/// The agent's DaemonSet (daemonset.yaml) and the kubelet plugin's (kubelet-plugin.yaml):
/// two, because they are updated differently.
const AGENT_DS: &str = "shareguard-agent";
const PLUGIN_DS: &str = "shareguard-kubelet-plugin";

/// The one DaemonSet called `name`.
fn ds_named(docs: &[(String, Value)], name: &str) -> Value {
    let found: Vec<&Value> = docs
        .iter()
        .map(|(_, v)| v)
        .filter(|v| v["kind"] == "DaemonSet" && v["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "exactly one DaemonSet {name}");
    found[0].clone()
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

fn containers(ds: &Value) -> Vec<Value> {
    ds["spec"]["template"]["spec"]["containers"]
        .as_sequence()
        .unwrap()
        .clone()
}

/// The agent container of the DaemonSet.
/// The pod volume mounted in container `c` at a directory above `file`.
fn volume_holding(ds: &Value, c: &Value, file: &std::path::Path) -> Value {
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| file.starts_with(s(&m["mountPath"])) && s(&m["mountPath"]) != "/")
        .unwrap_or_else(|| panic!("no mount holds {}", file.display()));
    ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .cloned()
        .unwrap_or_else(|| panic!("no volume {:?}", mount["name"]))
}

fn agent_container(ds: &Value) -> Value {
    containers(ds)
        .into_iter()
        .find(|c| c["name"] == "agent")
        .expect("a container named agent")
}

/// The ConfigMap's agent.toml.
fn configmap_text(docs: &[(String, Value)]) -> String {
    s(&the(docs, "ConfigMap")["data"]["agent.toml"]).to_owned()
}

/// The ConfigMap's config as the agent on `node` reads it (NODE_NAME from the
/// downward API, as the DaemonSet gives it).
fn config_on(text: &str, node: &str) -> Result<Config, shareguard::config::ConfigError> {
    let sources = NodeNameSources {
        given: Some(node.to_owned()),
        // Not this machine's: the test must not depend on where it runs.
        host: Some("the-test-host".to_owned()),
    };
    Config::parse_for(text, "configmap agent.toml", &sources)
}

fn configmap_config(docs: &[(String, Value)]) -> Config {
    config_on(&configmap_text(docs), "worker-1")
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
    let ds = ds_named(&docs, AGENT_DS);
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
    let want: [(&str, &str, &str, Option<&str>, bool); 9] = [
        // Pins live on the host's bpffs; Directory: the host must have mounted it.
        (
            "/sys/fs/bpf",
            "Directory",
            "/sys/fs/bpf",
            Some("HostToContainer"),
            false,
        ),
        // The node's cgroup root, not the container's own subtree; writable, since the
        // nvml-cgroup limits are pods' and containers' dmem files, written by path.
        ("/sys/fs/cgroup", "Directory", "/sys/fs/cgroup", None, false),
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
        // MPS daemons' directories, apart from the socket's, which the plugin mounts.
        (
            "/run/shareguard-mps",
            "DirectoryOrCreate",
            "/run/shareguard-mps",
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
        // kubelet's DRA checkpoint, replaced by a rename (so the directory); pods'
        // volumes mounted and unmounted below it are not held.
        (
            "/var/lib/kubelet",
            "Directory",
            "/var/lib/kubelet",
            Some("HostToContainer"),
            true,
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
    // No host access for the agent beyond the table above.
    let agent_host_mounts: BTreeSet<String> = mounts
        .iter()
        .map(|m| s(&m["name"]).to_owned())
        .filter(|v| host.contains_key(v))
        .collect();
    assert_eq!(
        agent_host_mounts, seen_host_mounts,
        "the agent's hostPath mounts"
    );
    // And none in the pod that no container uses (the kubelet plugin's own host
    // mounts are held to its table in kubelet_plugin_container_*).
    let all_mounted: BTreeSet<String> = containers(&ds)
        .iter()
        .flat_map(|c| c["volumeMounts"].as_sequence().unwrap().clone())
        .map(|m| s(&m["name"]).to_owned())
        .collect();
    for v in host.keys() {
        assert!(
            all_mounted.contains(v),
            "hostPath volume {v} is mounted by no container"
        );
    }
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
    assert_eq!(
        a.kubelet_dir.as_deref(),
        Some(Path::new("/var/lib/kubelet"))
    );
    // Found from the mount table: a fixed path is wrong on either v2 or hybrid nodes.
    assert_eq!(a.cgroup_root, None);
}

#[test]
fn daemonset_runs_unprivileged_with_the_units_capabilities_in_the_host_namespaces() {
    let docs = manifests();
    let ds = ds_named(&docs, AGENT_DS);
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

    // The agent never calls the API server: no identity of its own, no token in its
    // container, and none mounted automatically. The plugin's projected token is
    // checked in only_the_kubelet_plugin_container_*.
    assert!(
        pod.get("serviceAccountName").is_none(),
        "the agent's pod has an API identity"
    );
    let agent = agent_container(&ds);
    for m in agent["volumeMounts"].as_sequence().unwrap() {
        let mpath = s(&m["mountPath"]);
        assert!(
            !mpath.starts_with("/var/run/secrets") && !mpath.starts_with("/run/secrets"),
            "the agent container mounts {mpath}"
        );
        let vol = pod["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap();
        // The one Secret it mounts is the token scrapers must show it, which grants the
        // agent nothing.
        let scrape_token = vol["secret"]["secretName"] == "shareguard-metrics-token";
        assert!(
            vol.get("projected").is_none() && (vol.get("secret").is_none() || scrape_token),
            "the agent container mounts credentials: {vol:?}"
        );
    }
    assert!(agent.get("envFrom").is_none());
    for e in agent["env"].as_sequence().unwrap() {
        assert!(
            e.get("valueFrom")
                .is_none_or(|f| f.get("secretKeyRef").is_none()),
            "the agent container reads a secret: {e:?}"
        );
    }
}

/// A new plugin pod starts beside the old one and the old one stops only once the new
/// one is ready (kubelet never has no instance to call, and wipes no slice); a new
/// agent only once the old one stopped (two cannot open one store).
#[test]
fn the_plugin_is_updated_with_a_surge_and_the_agent_without() {
    let docs = manifests();
    let plugin = ds_named(&docs, PLUGIN_DS);
    let u = &plugin["spec"]["updateStrategy"];
    assert_eq!(u["type"], "RollingUpdate");
    assert_eq!(u["rollingUpdate"]["maxSurge"], 1);
    assert_eq!(u["rollingUpdate"]["maxUnavailable"], 0);
    let c = &containers(&plugin)[0];
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let agent = ds_named(&docs, AGENT_DS);
    let u = &agent["spec"]["updateStrategy"];
    assert_eq!(u["type"], "RollingUpdate");
    assert_eq!(u["rollingUpdate"]["maxSurge"], 0);
    assert_eq!(u["rollingUpdate"]["maxUnavailable"], 1);
    // Each its own pods: the selectors must not overlap, or each DaemonSet would count
    // the other's pods as its own.
    let sel = |ds: &Value| ds["spec"]["selector"]["matchLabels"].clone();
    assert_ne!(sel(&plugin), sel(&agent));
    for ds in [&plugin, &agent] {
        for (k, v) in sel(ds).as_mapping().unwrap() {
            assert_eq!(&ds["spec"]["template"]["metadata"]["labels"][k], v);
        }
    }
    assert_eq!(containers(&plugin).len(), 1);
    assert_eq!(containers(&agent).len(), 1);
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

/// The scheduler names a device by driver, pool and device name only: one ConfigMap
/// that gave every node the same pool would have capacity used on one node subtracted
/// on all of them.
#[test]
fn configmap_config_gives_each_node_a_pool_of_its_own() {
    let docs = manifests();
    let text = configmap_text(&docs);
    let mut seen = BTreeSet::new();
    for node in ["worker-1", "gpu-node-2"] {
        let cfg = config_on(&text, node).unwrap_or_else(|e| panic!("{node}: {e}"));
        assert_eq!(cfg.agent.node_name.as_deref(), Some(node));
        assert!(!cfg.devices.is_empty());
        for d in &cfg.devices {
            assert_eq!(d.pool, node, "{node}: device {}", d.name);
            assert!(pool_belongs_to(&d.pool, node));
            assert!(
                seen.insert((d.driver.clone(), d.pool.clone(), d.name.clone())),
                "{node}: {}/{}/{} is another node's device too",
                d.driver,
                d.pool,
                d.name
            );
        }
    }

    // A [[node]] table in the same ConfigMap changes its node's devices, and only its.
    let nic = configmap_config(&docs)
        .devices
        .iter()
        .find(|d| d.kind == DeviceKind::Net)
        .unwrap()
        .name
        .clone();
    let with = format!(
        "{text}\n[[node]]\nname = \"worker-7\"\n[node.device.{nic}]\npool = \"worker-7/nics\"\nline_rate = \"25G\"\n"
    );
    let there = config_on(&with, "worker-7").unwrap();
    let d = there.devices.iter().find(|d| d.name == nic).unwrap();
    assert_eq!(
        (
            d.pool.as_str(),
            d.net.clone().unwrap_or_default().line_rate_bps
        ),
        ("worker-7/nics", Some(25_000_000_000))
    );
    for elsewhere in ["worker-70", "worker-1"] {
        let cfg = config_on(&with, elsewhere).unwrap();
        let d = cfg.devices.iter().find(|d| d.name == nic).unwrap();
        assert_eq!(
            (
                d.pool.as_str(),
                d.net.clone().unwrap_or_default().line_rate_bps
            ),
            (elsewhere, None)
        );
    }
    // A device the ConfigMap lacks is refused on every node.
    let e = config_on(
        &format!(
            "{text}\n[[node]]\nname = \"worker-7\"\n[node.device.nic-99]\ninterface = \"ens5\"\n"
        ),
        "worker-1",
    )
    .unwrap_err();
    assert!(e.message.contains("\"nic-99\""), "{e}");
}

#[test]
fn the_agent_is_told_its_node_as_the_plugin_is() {
    use k8s_openapi::api::core::v1::Container;
    let docs = manifests();
    let ds = daemonset_named(&docs, AGENT_DS);
    let agent = pod_spec(&ds)
        .containers
        .iter()
        .find(|c| c.name == "agent")
        .expect("a container named agent");
    let from_field = |c: &Container| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == "NODE_NAME")
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.clone())
    };
    assert_eq!(
        from_field(agent).as_deref(),
        Some("spec.nodeName"),
        "the agent's NODE_NAME (its devices' pools) from the downward API"
    );
    assert_eq!(
        from_field(agent),
        from_field(plugin_container(&daemonset_named(&docs, PLUGIN_DS)))
    );
    // No node_name in the shared config (it would give every node one pool): the agent
    // refuses a config whose node_name differs from NODE_NAME, so two nodes would not
    // both start.
    for node in ["worker-1", "worker-2"] {
        let cfg = config_on(&configmap_text(&docs), node).unwrap();
        assert_eq!(cfg.agent.node_name.as_deref(), Some(node));
    }
    // And no flag that would say something else than the environment.
    let cmd = agent.command.as_deref().unwrap_or_default();
    assert!(
        cmd.iter().all(|a| a != "--node-name"),
        "the agent's command: {cmd:?}"
    );
}

#[test]
fn probes_and_scrape_targets_are_what_the_agent_serves() {
    let docs = manifests();
    let ds = ds_named(&docs, AGENT_DS);
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

    // The probes name the port health_addr listens on, on the node's loopback, where
    // the kubelet (in the host's network, as the agent) reaches it and nothing on the
    // node network does: no neighbour can hold its connections.
    let health = cfg
        .agent
        .health_addr
        .expect("the DaemonSet's config sets health_addr");
    assert!(health.ip().is_loopback(), "{health}");
    assert_eq!(ds["spec"]["template"]["spec"]["hostNetwork"], true);
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        assert_eq!(
            c[probe]["httpGet"]["host"].as_str(),
            Some(health.ip().to_string().as_str()),
            "{probe}"
        );
    }
    let named = ports
        .iter()
        .find(|p| p["name"] == "health")
        .expect("a port named health");
    assert_eq!(
        named["containerPort"].as_u64(),
        Some(u64::from(health.port()))
    );

    // The token file is in the optional Secret's volume, and the PodMonitor sends that
    // Secret's token.
    let token_file = cfg
        .agent
        .metrics_token_file
        .clone()
        .expect("metrics on every address need a token");
    let volume = volume_holding(&ds, &c, &token_file);
    assert_eq!(volume["secret"]["optional"], true, "{volume:?}");
    let secret = s(&volume["secret"]["secretName"]).to_owned();

    // The probes' paths answer 200 on a real agent with this config's shape, with the
    // port they name; /metrics only with the token.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    fs::write(&token, "deploy-test-token").unwrap();
    let mut o = Options::new(generic_device("gen-0", "10Gi", "1Gi", &["*"], &[]));
    o.agent_extra = format!("metrics_token_file = {token:?}\nhealth_addr = \"127.0.0.1:0\"");
    let agent = Agent::start(o);
    let health_at: std::net::SocketAddr = agent
        .log_text()
        .lines()
        .filter(|l| l.contains(" ready "))
        .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("health=")))
        .and_then(|a| a.parse().ok())
        .unwrap();
    for (probe, path) in [
        ("startupProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(get["port"], "health", "{probe}");
        assert_eq!(
            shareguard_tests::http_get(health_at, path).unwrap().0,
            200,
            "{probe} {path}"
        );
    }
    // Sized for a start that re-verifies 100,000 shares: minutes, not seconds.
    let startup = &c["startupProbe"];
    let window =
        startup["periodSeconds"].as_u64().unwrap() * startup["failureThreshold"].as_u64().unwrap();
    assert!(window >= 300, "startupProbe allows only {window} s");
    assert_eq!(agent.http("/metrics").0, 401);
    let ok = shareguard_tests::http_response(
        agent.metrics.unwrap(),
        "/metrics",
        "Authorization: Bearer deploy-test-token\r\n",
    )
    .unwrap();
    assert!(
        ok.starts_with("HTTP/1.0 200") || ok.starts_with("HTTP/1.1 200"),
        "{ok}"
    );

    // No annotation-based scraping: it could not send the token.
    let ann = &ds["spec"]["template"]["metadata"]["annotations"];
    assert!(ann["prometheus.io/scrape"].is_null(), "{ann:?}");

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
    assert_eq!(ep["authorization"]["type"], "Bearer");
    assert_eq!(ep["authorization"]["credentials"]["name"], secret.as_str());
    assert_eq!(ep["authorization"]["credentials"]["key"], "token");
    assert!(token_file.ends_with("token"), "{token_file:?}");
}

// ---------------------------------------------------------------------------------------
// Every document as its Kubernetes type, with no field the type does not have
// (shareguard_tests::manifests says how).

fn json(v: &Value) -> serde_json::Value {
    serde_json::to_value(v).unwrap()
}

#[test]
fn every_manifest_is_a_known_kubernetes_type_with_no_unknown_field() {
    let docs = manifests();
    let mut failures = Vec::new();
    for (file, doc) in &docs {
        let name = doc["metadata"]["name"].as_str().unwrap_or("(no name)");
        if let Err(e) = check_document(&json(doc)) {
            failures.push(format!("{file}: {} {name}: {e}", s(&doc["kind"])));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The files the README lists are all there (a file that fails to be read is a
    // failure above; one that goes missing is one here).
    let deploy = repo().join("deploy");
    let files: BTreeSet<String> = docs
        .iter()
        .map(|(f, _)| {
            let rel = Path::new(f).strip_prefix(&deploy).unwrap();
            rel.to_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(
        files,
        set(&[
            "admission.yaml",
            "daemonset.yaml",
            "deviceclasses.yaml",
            "examples/bandwidth-200m.yaml",
            "examples/bandwidth-200m-client.yaml",
            "examples/gpu-memory-4gi.yaml",
            "kubelet-plugin.yaml",
            "podmonitor.yaml",
            "prometheusrule.yaml",
            "rbac.yaml",
            "uninstall/node-cleanup.yaml",
        ])
    );
}

#[test]
fn round_trip_check_refuses_misspelled_fields_and_unknown_kinds() {
    let yaml = |t: &str| json(&serde_yaml::from_str::<Value>(t).unwrap());
    let good = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n    - name: c\n      securityContext: {readOnlyRootFilesystem: true}\n";
    assert_eq!(check_document(&yaml(good)), Ok(()));
    let misspelled = good.replace("readOnlyRootFilesystem", "readOnlyRootFileSystem");
    let err = check_document(&yaml(&misspelled)).unwrap_err();
    assert!(
        err.starts_with("$.spec.containers[0].securityContext.readOnlyRootFileSystem:"),
        "{err}"
    );
    // Misplaced: a container field at the pod level.
    let misplaced = good.replace("spec:\n", "spec:\n  readOnlyRootFilesystem: true\n");
    assert!(
        check_document(&yaml(&misplaced))
            .unwrap_err()
            .starts_with("$.spec.readOnlyRootFilesystem:")
    );
    // A value of the wrong type.
    let wrong = good.replace(
        "readOnlyRootFilesystem: true",
        "readOnlyRootFilesystem: yes please",
    );
    assert!(check_document(&yaml(&wrong)).is_err());
    // Kinds and versions this test does not know.
    for (api, kind) in [
        ("v1", "Podd"),
        ("v1beta1", "Pod"),
        ("resource.k8s.io/v1beta2", "DeviceClass"),
    ] {
        let doc = yaml(&format!(
            "apiVersion: {api}\nkind: {kind}\nmetadata: {{name: x}}\n"
        ));
        assert!(
            check_document(&doc)
                .unwrap_err()
                .contains("not a type this test knows")
        );
    }
    // The CRD's local type refuses unknown fields too.
    let pm = "apiVersion: monitoring.coreos.com/v1\nkind: PodMonitor\nmetadata: {name: m}\nspec:\n  selector: {}\n  podMetricsEndpoints:\n    - port: metrics\n      scrapeTimout: 10s\n";
    assert!(check_document(&yaml(pm)).is_err());
}

// ---------------------------------------------------------------------------------------
// The kubelet plugin: its container, its credentials, its RBAC, its classes, an example.

/// Every document of `kind`, as the k8s-openapi type `T`.
fn typed<T: serde::de::DeserializeOwned>(docs: &[(String, Value)], kind: &str) -> Vec<T> {
    docs.iter()
        .filter(|(_, v)| v["kind"] == kind)
        .map(|(f, v)| {
            serde_json::from_value(json(v)).unwrap_or_else(|e| panic!("{f}: {kind}: {e}"))
        })
        .collect()
}

/// The document of `kind` named `name`, as the k8s-openapi type `T`.
fn named_typed<T: serde::de::DeserializeOwned>(
    docs: &[(String, Value)],
    kind: &str,
    name: &str,
) -> T {
    let (f, v) = docs
        .iter()
        .find(|(_, v)| v["kind"] == kind && v["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"));
    serde_json::from_value(json(v)).unwrap_or_else(|e| panic!("{f}: {kind}: {e}"))
}

/// The user names an admission policy's match conditions compare the caller with.
fn policy_users(
    spec: &k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicySpec,
) -> Vec<String> {
    spec.match_conditions
        .iter()
        .flatten()
        .flat_map(|c| compared_with(&c.expression, "request.userInfo.username"))
        .collect()
}

/// The user name the API server gives the DaemonSet's ServiceAccount.
fn service_account_user(ds: &k8s_openapi::api::apps::v1::DaemonSet) -> String {
    format!(
        "system:serviceaccount:{}:{}",
        ds.metadata.namespace.as_deref().unwrap(),
        pod_spec(ds).service_account_name.as_deref().unwrap()
    )
}

fn the_typed<T: serde::de::DeserializeOwned>(docs: &[(String, Value)], kind: &str) -> T {
    let mut all = typed::<T>(docs, kind);
    assert_eq!(all.len(), 1, "exactly one {kind}");
    all.pop().unwrap()
}

fn daemonset_named(docs: &[(String, Value)], name: &str) -> k8s_openapi::api::apps::v1::DaemonSet {
    serde_json::from_value(json(&ds_named(docs, name))).unwrap()
}

fn pod_spec(ds: &k8s_openapi::api::apps::v1::DaemonSet) -> &k8s_openapi::api::core::v1::PodSpec {
    ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

fn plugin_container(
    ds: &k8s_openapi::api::apps::v1::DaemonSet,
) -> &k8s_openapi::api::core::v1::Container {
    pod_spec(ds)
        .containers
        .iter()
        .find(|c| c.name == "kubelet-plugin")
        .expect("a container named kubelet-plugin")
}

/// The drivers the agent's inventory names: those the plugin serves and publishes.
fn configmap_drivers(cfg: &Config) -> BTreeSet<String> {
    cfg.devices.iter().map(|d| d.driver.clone()).collect()
}

/// `--flag value` pairs after the subcommand; a flag given twice or without a value fails.
fn flags(args: &[String]) -> BTreeMap<String, String> {
    assert!(
        args.len().is_multiple_of(2),
        "flags without values: {args:?}"
    );
    let mut out = BTreeMap::new();
    for pair in args.chunks(2) {
        assert!(
            pair[0].starts_with("--") && !pair[1].starts_with("--"),
            "{pair:?}"
        );
        assert!(
            out.insert(pair[0].clone(), pair[1].clone()).is_none(),
            "{} given twice",
            pair[0]
        );
    }
    out
}

#[test]
fn kubelet_plugin_container_is_unprivileged_and_serves_kubelets_directories() {
    let docs = manifests();
    let ds = daemonset_named(&docs, PLUGIN_DS);
    let pod = pod_spec(&ds);
    let c = plugin_container(&ds);
    let cfg = configmap_config(&docs);

    // A uid of its own with the kubelet-plugin role and nothing of an admin's, in the
    // socket's group: no root, no capability, no privilege, a read-only root.
    let sc = c.security_context.as_ref().expect("a securityContext");
    let run_uid = sc.run_as_user.expect("runAsUser");
    let run_gid = sc.run_as_group.expect("runAsGroup");
    assert_ne!(run_uid, 0, "the plugin runs as root");
    assert_eq!(sc.run_as_non_root, Some(true));
    assert!(
        cfg.agent
            .plugin_uids
            .contains(&u32::try_from(run_uid).unwrap()),
        "the agent gives uid {run_uid} the kubelet-plugin role: {:?}",
        cfg.agent.plugin_uids
    );
    assert!(
        !cfg.agent
            .allowed_uids
            .contains(&u32::try_from(run_uid).unwrap()),
        "the plugin's uid {run_uid} is an admin"
    );
    assert_eq!(
        cfg.agent.socket_group.map(i64::from),
        Some(run_gid),
        "the plugin's group is the socket's"
    );
    // The agent gives its socket that group as the socket's owner, which needs no
    // CAP_CHOWN only if it is in the group itself.
    let agent_ds = daemonset_named(&docs, AGENT_DS);
    let agent_groups = pod_spec(&agent_ds)
        .security_context
        .as_ref()
        .and_then(|s| s.supplemental_groups.clone())
        .unwrap_or_default();
    assert!(
        agent_groups.contains(&run_gid),
        "the agent's pod is not in socket_group {run_gid}: {agent_groups:?}"
    );
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert!(
        caps.add.as_ref().is_none_or(Vec::is_empty),
        "added capabilities: {:?}",
        caps.add
    );
    assert_eq!(
        sc.seccomp_profile.as_ref().map(|p| p.type_.as_str()),
        Some("RuntimeDefault")
    );
    assert!(
        sc.app_armor_profile
            .as_ref()
            .is_none_or(|p| p.type_ != "Unconfined"),
        "AppArmor unconfined"
    );
    assert!(
        sc.se_linux_options.is_none(),
        "SELinux type changed: {:?}",
        sc.se_linux_options
    );
    // Its one TCP port is the health server's, in the pod's own network namespace.
    assert_ne!(
        pod.host_network,
        Some(true),
        "two instances' health ports would collide"
    );
    let ports = c.ports.as_deref().unwrap_or_default();
    assert_eq!(ports.len(), 1, "{ports:?}");
    assert_eq!(ports[0].name.as_deref(), Some("health"));

    // The subcommand, with every path given.
    let cmd = c.command.as_ref().expect("a command");
    assert_eq!(cmd[..2], ["/usr/local/bin/shareguard", "kubelet-plugin"]);
    assert!(c.args.is_none());
    let f = flags(&cmd[2..]);
    assert_eq!(
        f.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        BTreeSet::from([
            "--agent-socket",
            "--binding-conditions",
            "--driver",
            "--enforced-events",
            "--health-addr",
            "--instance-id",
            "--max-slices-per-node",
            "--node-name",
            "--plugins-dir",
            "--registry-dir"
        ]),
        "flags (no --kubeconfig: the in-cluster config)"
    );
    assert_eq!(
        Path::new(&f["--agent-socket"]),
        cfg.agent.socket,
        "the ConfigMap's socket"
    );
    assert_eq!(f["--node-name"], "$(NODE_NAME)");
    // The plugin serves its release's driver only: another release's agent is refused.
    assert_eq!(
        BTreeSet::from([f["--driver"].as_str()]),
        cfg.devices.iter().map(|d| d.driver.as_str()).collect(),
        "--driver is the devices' driver"
    );
    // The binding gate, on by default: no pod bound to a node that refused its share.
    assert_eq!(f["--binding-conditions"], "true");
    // The ShareEnforced Event, on by default (kubeletPlugin.enforcedEvents).
    assert_eq!(f["--enforced-events"], "true");
    let node_env = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME in env");
    let field = node_env
        .value_from
        .as_ref()
        .and_then(|v| v.field_ref.as_ref())
        .expect("NODE_NAME from a fieldRef");
    assert_eq!(field.field_path, "spec.nodeName");
    // Sockets named after the pod, so that two generations never share one.
    assert_eq!(f["--instance-id"], "$(POD_UID)");
    let uid = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "POD_UID")
        .and_then(|e| e.value_from.as_ref())
        .and_then(|v| v.field_ref.as_ref())
        .expect("POD_UID from a fieldRef");
    assert_eq!(uid.field_path, "metadata.uid");
    // The probes ask the health server the flag names, on the port the pod declares.
    let health: std::net::SocketAddr = f["--health-addr"].parse().unwrap();
    assert!(
        health.ip().is_unspecified(),
        "the kubelet's probes reach it"
    );
    assert_eq!(
        ports[0].container_port,
        i32::from(health.port()),
        "--health-addr and the health port"
    );
    for (probe, path) in [
        (c.liveness_probe.as_ref(), "/healthz"),
        (c.readiness_probe.as_ref(), "/readyz"),
    ] {
        let get = probe
            .and_then(|p| p.http_get.as_ref())
            .unwrap_or_else(|| panic!("an httpGet probe on {path}"));
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("health".into())
        );
    }

    // Volume name -> (host path, type) of the pod's hostPath volumes.
    let host: BTreeMap<&str, (&str, &str)> = pod
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            let hp = v.host_path.as_ref()?;
            Some((
                v.name.as_str(),
                (hp.path.as_str(), hp.type_.as_deref().unwrap_or("")),
            ))
        })
        .collect();
    let mounts = c.volume_mounts.as_deref().unwrap_or_default();
    let mount_at = |path: &Path| {
        mounts
            .iter()
            .find(|m| Path::new(&m.mount_path) == path)
            .unwrap_or_else(|| panic!("the plugin mounts nothing at {}", path.display()))
    };
    for m in mounts {
        assert!(
            m.mount_propagation.is_none(),
            "{}: propagation",
            m.mount_path
        );
    }

    // The agent's socket: the host directory the agent's pod mounts, read-only here.
    let sock_dir = cfg.agent.socket.parent().unwrap();
    let sock = mount_at(sock_dir);
    assert_eq!(
        sock.read_only,
        Some(true),
        "the plugin only connects to the socket"
    );
    let agent_ds = ds_named(&docs, AGENT_DS);
    let agent_sock = agent_container(&agent_ds)["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| Path::new(s(&m["mountPath"])) == sock_dir)
        .map(|m| s(&m["name"]).to_owned())
        .expect("the agent mounts its socket's directory");
    let agent_host_path = agent_ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == agent_sock.as_str())
        .map(|v| s(&v["hostPath"]["path"]).to_owned())
        .expect("the agent's socket directory is a hostPath");
    assert_eq!(
        host.get(sock.name.as_str()).map(|(p, _)| *p),
        Some(agent_host_path.as_str()),
        "the same host directory as the agent's socket"
    );
    // Nothing the plugin mounts from the host holds the MPS daemons' pipes, logs or
    // tenants' shm: a compromised plugin reads or replaces none of them.
    for m in mounts {
        if let Some((p, _)) = host.get(m.name.as_str()) {
            assert!(
                !cfg.agent.mps.dir.starts_with(p),
                "the plugin mounts {p}, which holds the agent's mps_dir {}",
                cfg.agent.mps.dir.display()
            );
        }
    }

    // kubelet's directories, at the same paths as on the host (kubelet is told the
    // socket paths as the plugin sees them): for each driver a directory of its own in
    // kubelet's registration directory (kubelet watches the directories below it; its
    // own is root's) and one in kubelet's plugins directory, and nothing else of them.
    assert_eq!(
        f["--registry-dir"], "/var/lib/kubelet/plugins_registry",
        "kubelet's registration directory"
    );
    let mut plugin_host_mounts = BTreeSet::from([sock.name.clone()]);
    let mut own_dirs = Vec::new();
    for driver in configmap_drivers(&cfg) {
        for parent in [&f["--registry-dir"], &f["--plugins-dir"]] {
            let dir = Path::new(parent).join(&driver);
            let m = mount_at(&dir);
            assert_eq!(
                host.get(m.name.as_str()),
                Some(&(dir.to_str().unwrap(), "DirectoryOrCreate")),
                "{driver}: its own directory under {parent}"
            );
            assert_ne!(m.read_only, Some(true));
            plugin_host_mounts.insert(m.name.clone());
            own_dirs.push(dir);
        }
    }

    // The init container hands exactly those directories to the plugin's uid and
    // group, with the two capabilities that takes and no other, through the very
    // volumes the plugin mounts.
    let inits = pod.init_containers.as_deref().unwrap_or_default();
    assert_eq!(inits.len(), 1, "one init container");
    let init = &inits[0];
    let cmd = init.command.as_ref().expect("a command");
    let mut want = vec![
        "/usr/local/bin/shareguard".to_owned(),
        "kubelet-plugin-dirs".into(),
        "--owner".into(),
        format!("{run_uid}:{run_gid}"),
    ];
    want.extend(own_dirs.iter().map(|d| d.display().to_string()));
    assert_eq!(cmd, &want);
    assert_eq!(init.image, c.image, "the plugin's image");
    let isc = init.security_context.as_ref().expect("a securityContext");
    assert_eq!(isc.run_as_user, Some(0));
    assert_eq!(isc.allow_privilege_escalation, Some(false));
    assert_eq!(isc.privileged, Some(false));
    assert_eq!(isc.read_only_root_filesystem, Some(true));
    let icaps = isc.capabilities.as_ref().expect("capabilities");
    assert_eq!(icaps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    assert_eq!(
        icaps
            .add
            .iter()
            .flatten()
            .map(String::as_str)
            .collect::<BTreeSet<_>>(),
        BTreeSet::from(["CHOWN", "FOWNER"])
    );
    let init_mounts: BTreeMap<&str, &str> = init
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.mount_path.as_str(), m.name.as_str()))
        .collect();
    let want_mounts: BTreeMap<&str, &str> = own_dirs
        .iter()
        .map(|d| (d.to_str().unwrap(), mount_at(d).name.as_str()))
        .collect();
    assert_eq!(init_mounts, want_mounts, "the init container's mounts");
    // Those and no other host path (not kubelet's whole plugins directory).
    let mounted: BTreeSet<String> = mounts
        .iter()
        .filter(|m| host.contains_key(m.name.as_str()))
        .map(|m| m.name.clone())
        .collect();
    assert_eq!(mounted, plugin_host_mounts, "the plugin's hostPath mounts");
}

#[test]
fn only_the_kubelet_plugin_container_holds_api_credentials() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let docs = manifests();
    let ds = daemonset_named(&docs, PLUGIN_DS);
    let pod = pod_spec(&ds);
    let sa: ServiceAccount = the_typed(&docs, "ServiceAccount");

    // No automatic token anywhere: it would be mounted into every container.
    assert_eq!(sa.automount_service_account_token, Some(false));
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert_eq!(
        pod.service_account_name.as_deref(),
        sa.metadata.name.as_deref()
    );
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);

    // One projected volume with what the in-cluster config reads.
    let token_volumes: Vec<_> = pod
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.secret.is_some() || v.projected.is_some())
        .collect();
    assert_eq!(token_volumes.len(), 1, "one credentials volume");
    let vol = token_volumes[0];
    let sources = vol
        .projected
        .as_ref()
        .unwrap()
        .sources
        .as_deref()
        .unwrap_or_default();
    assert_eq!(sources.len(), 3, "token, CA, namespace");
    let token = sources
        .iter()
        .find_map(|s| s.service_account_token.as_ref())
        .expect("a serviceAccountToken source");
    assert_eq!(token.path, "token");
    assert!(token.audience.is_none(), "the API server's own audience");
    let exp = token.expiration_seconds.expect("expirationSeconds");
    assert!(
        (600..=3607).contains(&exp),
        "expirationSeconds {exp}: as short as kubelet's default or shorter"
    );
    let ca = sources
        .iter()
        .find_map(|s| s.config_map.as_ref())
        .expect("the CA");
    assert_eq!(ca.name, "kube-root-ca.crt");
    let items = ca.items.as_deref().unwrap_or_default();
    assert_eq!(items.len(), 1);
    assert_eq!(
        (items[0].key.as_str(), items[0].path.as_str()),
        ("ca.crt", "ca.crt")
    );
    let ns = sources
        .iter()
        .find_map(|s| s.downward_api.as_ref())
        .expect("the namespace");
    let items = ns.items.as_deref().unwrap_or_default();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].path, "namespace");
    assert_eq!(
        items[0].field_ref.as_ref().map(|f| f.field_path.as_str()),
        Some("metadata.namespace")
    );

    // Mounted by the plugin container only, read-only, where kube-rs looks.
    let mut holders = Vec::new();
    for c in pod
        .containers
        .iter()
        .chain(pod.init_containers.iter().flatten())
    {
        for m in c.volume_mounts.iter().flatten() {
            if m.name == vol.name {
                holders.push(c.name.clone());
                assert_eq!(
                    m.mount_path,
                    "/var/run/secrets/kubernetes.io/serviceaccount"
                );
                assert_eq!(m.read_only, Some(true));
            } else {
                assert!(
                    !m.mount_path.contains("/secrets"),
                    "{}: {}",
                    c.name,
                    m.mount_path
                );
            }
        }
        assert!(c.env_from.is_none(), "{}: envFrom", c.name);
    }
    assert_eq!(holders, ["kubelet-plugin"], "containers with the token");
}

/// (apiGroup, resource, verb, resourceName or "*") for every grant of a ClusterRole.
fn grants(
    role: &k8s_openapi::api::rbac::v1::ClusterRole,
) -> BTreeSet<(String, String, String, String)> {
    assert!(role.aggregation_rule.is_none());
    let mut out = BTreeSet::new();
    for r in role.rules.iter().flatten() {
        assert!(r.non_resource_urls.is_none(), "nonResourceURLs: {r:?}");
        let names = r
            .resource_names
            .clone()
            .unwrap_or_else(|| vec!["*".to_owned()]);
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    for n in &names {
                        let grant = (g.clone(), res.clone(), v.clone(), n.clone());
                        assert!(out.insert(grant.clone()), "granted twice: {grant:?}");
                    }
                }
            }
        }
    }
    out
}

#[test]
fn cluster_role_grants_exactly_the_verbs_the_plugin_uses() {
    use k8s_openapi::api::rbac::v1::ClusterRole;
    let docs = manifests();
    let cfg = configmap_config(&docs);
    let role: ClusterRole = the_typed(&docs, "ClusterRole");
    // rbac.yaml says why for each. Adding a verb fails here until it is justified.
    let mut want: BTreeSet<(String, String, String, String)> = [
        ("resource.k8s.io", "resourceclaims", "get"),
        ("", "nodes", "get"),
        ("resource.k8s.io", "resourceslices", "list"),
        ("resource.k8s.io", "resourceslices", "watch"),
        ("resource.k8s.io", "resourceslices", "create"),
        ("resource.k8s.io", "resourceslices", "patch"),
        ("resource.k8s.io", "resourceslices", "delete"),
        ("resource.k8s.io", "resourceclaims/status", "patch"),
        // The binding gate, with a field selector always.
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ]
    .into_iter()
    .map(|(g, r, v)| (g.to_owned(), r.to_owned(), v.to_owned(), "*".to_owned()))
    .collect();
    // Kubernetes 1.36: status.devices of claims on this node, for this driver only.
    for driver in configmap_drivers(&cfg) {
        want.insert((
            "resource.k8s.io".to_owned(),
            "resourceclaims/driver".to_owned(),
            "associated-node:patch".to_owned(),
            driver,
        ));
    }
    assert_eq!(grants(&role), want);
}

#[test]
fn cluster_role_binding_names_the_daemonsets_service_account() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let docs = manifests();
    let ds = daemonset_named(&docs, PLUGIN_DS);
    let role: ClusterRole = the_typed(&docs, "ClusterRole");
    let b: ClusterRoleBinding = the_typed(&docs, "ClusterRoleBinding");
    assert_eq!(b.role_ref.api_group, "rbac.authorization.k8s.io");
    assert_eq!(b.role_ref.kind, "ClusterRole");
    assert_eq!(Some(&b.role_ref.name), role.metadata.name.as_ref());
    let subjects = b.subjects.as_deref().unwrap_or_default();
    assert_eq!(subjects.len(), 1, "{subjects:?}");
    let sub = &subjects[0];
    assert_eq!(sub.kind, "ServiceAccount");
    assert_eq!(Some(&sub.name), pod_spec(&ds).service_account_name.as_ref());
    assert_eq!(sub.namespace, ds.metadata.namespace);
}

/// The string literals compared with `what` in a CEL expression (`what == "x"`).
fn compared_with(expr: &str, what: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in expr.match_indices(what) {
        let rest = expr[i + what.len()..].trim_start();
        if let Some(rest) = rest.strip_prefix("==") {
            let rest = rest.trim_start();
            let lit = rest
                .strip_prefix('"')
                .and_then(|r| r.split_once('"'))
                .map(|(l, _)| l);
            out.push(
                lit.unwrap_or_else(|| panic!("{what} compared with a non-literal in {expr}"))
                    .to_owned(),
            );
        }
    }
    out
}

/// The one validation of a policy whose expression mentions `field`, its whitespace
/// made single spaces.
fn only_validation_of(
    spec: &k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicySpec,
    field: &str,
) -> String {
    let rules: Vec<String> = spec
        .validations
        .iter()
        .flatten()
        .map(|v| {
            v.expression
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|e| e.contains(field))
        .collect();
    let [rule] = &rules[..] else {
        panic!("one validation of {field}: {rules:?}")
    };
    rule.clone()
}

#[test]
fn resourceslice_admission_policy_checks_the_plugins_account_node_and_driver() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let docs = manifests();
    let ds = daemonset_named(&docs, PLUGIN_DS);
    let cfg = configmap_config(&docs);
    let name = "shareguard-kubelet-plugin-resourceslices";
    let p: ValidatingAdmissionPolicy = named_typed(&docs, "ValidatingAdmissionPolicy", name);
    let b: ValidatingAdmissionPolicyBinding =
        named_typed(&docs, "ValidatingAdmissionPolicyBinding", name);
    let spec = p.spec.as_ref().unwrap();
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let rules = spec
        .match_constraints
        .as_ref()
        .unwrap()
        .resource_rules
        .as_deref()
        .unwrap_or_default();
    assert!(rules.iter().any(|r| {
        r.api_groups.as_deref() == Some(&["resource.k8s.io".to_owned()][..])
            && r.resources.as_deref() == Some(&["resourceslices".to_owned()][..])
            && r.operations
                .iter()
                .flatten()
                .cloned()
                .collect::<BTreeSet<_>>()
                == set(&["CREATE", "UPDATE", "DELETE"])
    }));
    // It applies to the DaemonSet's ServiceAccount.
    let user = service_account_user(&ds);
    assert_eq!(policy_users(spec), [user]);
    // Node: the token's node name against the slice's spec.nodeName; driver: the
    // ConfigMap's drivers.
    let validations: String = spec
        .validations
        .iter()
        .flatten()
        .map(|v| v.expression.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(validations.contains("spec.?nodeName"), "{validations}");
    assert!(
        validations.contains("request.userInfo.extra[\"authentication.kubernetes.io/node-name\"]")
    );
    let drivers: BTreeSet<String> = compared_with(&validations, "spec.driver")
        .into_iter()
        .collect();
    assert_eq!(drivers, configmap_drivers(&cfg));
    // Pool: the token's node name, or that name and "/" before the rest, as the agent
    // names pools (config::node::pool_belongs_to); never a looser match such as a
    // prefix without the "/" ("worker-1" would own "worker-10").
    let node = "request.userInfo.extra[\"authentication.kubernetes.io/node-name\"][0]";
    let rule = only_validation_of(spec, "spec.pool.name");
    // What is created or updated; a stale slice of this node (the node rule holds the
    // old slice to it) stays deletable whatever its pool.
    assert_eq!(
        rule,
        format!(
            "request.operation == \"DELETE\" || (variables.hasNode && (object.spec.pool.name == {node} || object.spec.pool.name.startsWith({node} + \"/\")))"
        )
    );
    // The ConfigMap's pools pass that rule on any node.
    for node in ["worker-1", "worker-2"] {
        let cfg = config_on(&configmap_text(&docs), node).unwrap();
        assert!(cfg.devices.iter().all(|d| pool_belongs_to(&d.pool, node)));
    }
    // How many: the names the plugin gives its slices (`<node>-<driver>-<n>`, n below
    // its --max-slices-per-node) and no other, on a create or change.
    let slots =
        flags(&plugin_container(&ds).command.as_ref().unwrap()[2..])["--max-slices-per-node"]
            .clone();
    let rule = only_validation_of(spec, "object.metadata.name");
    assert_eq!(
        rule,
        format!(
            "request.operation == \"DELETE\" || (variables.hasNode && object.metadata.name.startsWith(variables.namePrefix) && object.metadata.name.substring(variables.namePrefix.size()).matches('^(0|[1-9][0-9]?)$') && int(object.metadata.name.substring(variables.namePrefix.size())) < {slots})"
        )
    );
    let prefix = spec
        .variables
        .iter()
        .flatten()
        .find(|v| v.name == "namePrefix")
        .map(|v| {
            v.expression
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        })
        .expect("a variable namePrefix");
    let drivers = configmap_drivers(&cfg);
    let [driver] = &drivers.iter().collect::<Vec<_>>()[..] else {
        panic!("one driver: {drivers:?}")
    };
    assert_eq!(
        prefix,
        format!("variables.hasNode ? {node} + \"-{driver}-\" : \"\"")
    );
    // Bound, denying.
    let bspec = b.spec.as_ref().unwrap();
    assert_eq!(bspec.policy_name, p.metadata.name);
    assert_eq!(
        bspec.validation_actions.as_deref(),
        Some(&["Deny".to_owned()][..])
    );
    assert!(bspec.param_ref.is_none());
}

/// The plugin's Events and claim status writes have policies of their own: each bound
/// and denying, failing closed, for the plugin's account alone, on the resource it
/// names, with the token's node in its rules; the claim-status one with the
/// ConfigMap's driver.
#[test]
fn events_and_claim_status_admission_policies_hold_the_plugin_to_its_node() {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    };
    let docs = manifests();
    let ds = daemonset_named(&docs, PLUGIN_DS);
    let cfg = configmap_config(&docs);
    let user = service_account_user(&ds);
    let policies: Vec<ValidatingAdmissionPolicy> = typed(&docs, "ValidatingAdmissionPolicy");
    let bindings: Vec<ValidatingAdmissionPolicyBinding> =
        typed(&docs, "ValidatingAdmissionPolicyBinding");
    assert_eq!(policies.len(), 3, "slices, events, claim status");
    for (name, group, resource, ops) in [
        (
            "shareguard-kubelet-plugin-events",
            "events.k8s.io",
            "events",
            &["CREATE", "UPDATE"][..],
        ),
        (
            "shareguard-kubelet-plugin-claim-status",
            "resource.k8s.io",
            "resourceclaims/status",
            &["UPDATE"][..],
        ),
    ] {
        let p: ValidatingAdmissionPolicy = named_typed(&docs, "ValidatingAdmissionPolicy", name);
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.failure_policy.as_deref(), Some("Fail"), "{name}");
        let rules = spec
            .match_constraints
            .as_ref()
            .unwrap()
            .resource_rules
            .as_deref()
            .unwrap_or_default();
        assert!(
            rules.iter().any(|r| {
                r.api_groups.iter().flatten().any(|g| g == group)
                    && r.resources.as_deref() == Some(&[resource.to_owned()][..])
                    && r.operations
                        .iter()
                        .flatten()
                        .cloned()
                        .collect::<BTreeSet<_>>()
                        == set(ops)
            }),
            "{name}: {rules:?}"
        );
        assert_eq!(policy_users(spec), std::slice::from_ref(&user), "{name}");
        let text: String = spec
            .variables
            .iter()
            .flatten()
            .map(|v| v.expression.as_str())
            .chain(
                spec.validations
                    .iter()
                    .flatten()
                    .map(|v| v.expression.as_str()),
            )
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            text.contains("request.userInfo.extra[\"authentication.kubernetes.io/node-name\"]"),
            "{name}"
        );
        if resource == "resourceclaims/status" {
            for d in configmap_drivers(&cfg) {
                assert!(
                    text.contains(&format!("d.driver != \"{d}\"")),
                    "{name}: {d}"
                );
            }
        } else {
            assert!(text.contains("\"shareguard/kubelet-plugin\""), "{name}");
        }
        let b = bindings
            .iter()
            .find(|b| b.metadata.name.as_deref() == Some(name))
            .unwrap_or_else(|| panic!("{name} is not bound"));
        let bspec = b.spec.as_ref().unwrap();
        assert_eq!(bspec.policy_name.as_deref(), Some(name));
        assert_eq!(
            bspec.validation_actions.as_deref(),
            Some(&["Deny".to_owned()][..])
        );
    }
}

/// One `device.` reference of a DeviceClass selector.
#[derive(Debug, PartialEq)]
enum DeviceRef {
    /// `device.driver == "x"`
    Driver(String),
    /// `device.attributes["domain"].name`, with the literal it is compared with, if any.
    Attribute(String, String, Option<String>),
    /// `device.capacity["domain"].name`
    Capacity(String, String),
}

/// `field["domain"].name` at the start of `rest`: (domain, name, what follows).
fn indexed_ref<'a>(rest: &'a str, field: &str) -> Option<(String, String, &'a str)> {
    let r = rest.strip_prefix(field)?.strip_prefix("[\"")?;
    let (domain, r) = r.split_once("\"].")?;
    let name: String = r
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    Some((domain.to_owned(), name.clone(), &r[name.len()..]))
}

/// Every `device.` reference in a CEL expression; a form this parser does not know fails.
fn device_refs(expr: &str) -> Vec<DeviceRef> {
    let mut out = Vec::new();
    for (i, _) in expr.match_indices("device.") {
        if expr[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
            continue;
        }
        let rest = &expr[i + "device.".len()..];
        let indexed = |field: &str| indexed_ref(rest, field);
        if rest.starts_with("driver") {
            let lits = compared_with(rest, "driver");
            out.push(DeviceRef::Driver(lits.into_iter().next().unwrap_or_else(
                || panic!("device.driver not compared with a literal: {expr}"),
            )));
        } else if let Some((domain, name, after)) = indexed("attributes") {
            let lit = after
                .trim_start()
                .strip_prefix("==")
                .and_then(|r| r.trim_start().strip_prefix('"'))
                .and_then(|r| r.split_once('"'))
                .map(|(l, _)| l.to_owned());
            out.push(DeviceRef::Attribute(domain, name, lit));
        } else if let Some((domain, name, _)) = indexed("capacity") {
            out.push(DeviceRef::Capacity(domain, name));
        } else {
            panic!("a device reference this test does not understand: {rest:.40}");
        }
    }
    out
}

/// The attributes the plugin publishes (deviceclasses.yaml lists them).
const ATTRIBUTES: [&str; 7] = [
    "kind",
    "mechanism",
    "enforced",
    "stage",
    "uuid",
    "model",
    "binds",
];

/// DeviceClass name -> the `kind` its selectors require, if one.
fn class_kinds(docs: &[(String, Value)]) -> BTreeMap<String, Option<String>> {
    use k8s_openapi::api::resource::v1::DeviceClass;
    typed::<DeviceClass>(docs, "DeviceClass")
        .into_iter()
        .map(|c| {
            let kinds: Vec<String> = c
                .spec
                .selectors
                .iter()
                .flatten()
                .flat_map(|s| device_refs(&s.cel.as_ref().unwrap().expression))
                .filter_map(|r| match r {
                    DeviceRef::Attribute(_, n, lit) if n == "kind" => lit,
                    _ => None,
                })
                .collect();
            assert!(kinds.len() <= 1, "{kinds:?}");
            (c.metadata.name.unwrap(), kinds.into_iter().next())
        })
        .collect()
}

#[test]
fn device_class_selectors_name_the_configmap_drivers_and_published_attributes() {
    use k8s_openapi::api::resource::v1::DeviceClass;
    let docs = manifests();
    let cfg = configmap_config(&docs);
    let drivers = configmap_drivers(&cfg);
    let classes: Vec<DeviceClass> = typed(&docs, "DeviceClass");
    assert!(!classes.is_empty());
    let mut enforced_kinds = BTreeSet::new();
    let mut stage_classes = BTreeMap::new();
    for c in &classes {
        let name = c.metadata.name.clone().unwrap();
        let selectors = c.spec.selectors.as_deref().unwrap_or_default();
        assert!(
            !selectors.is_empty(),
            "{name}: no selector would take every driver's devices"
        );
        for sel in selectors {
            let expr = &sel.cel.as_ref().expect("a CEL selector").expression;
            let refs = device_refs(expr);
            assert!(
                refs.iter()
                    .any(|r| matches!(r, DeviceRef::Driver(d) if drivers.contains(d))),
                "{name}: the selector does not test device.driver against the ConfigMap's drivers: {expr}"
            );
            let mut kind = None;
            let mut enforced = false;
            for r in &refs {
                match r {
                    DeviceRef::Driver(d) => assert!(drivers.contains(d), "{name}: driver {d}"),
                    DeviceRef::Attribute(domain, attr, lit) => {
                        assert!(
                            drivers.contains(domain),
                            "{name}: attribute domain {domain}"
                        );
                        assert!(
                            ATTRIBUTES.contains(&attr.as_str()),
                            "{name}: attribute {attr} is not published"
                        );
                        if attr == "kind" {
                            let k = lit.clone().unwrap_or_else(|| {
                                panic!("{name}: kind not compared with a literal")
                            });
                            assert!(
                                cfg.devices.iter().any(|d| d.kind.as_str() == k),
                                "{name}: no device of kind {k} in the ConfigMap"
                            );
                            kind = Some(k);
                        }
                        enforced |= attr == "enforced" && lit.is_none();
                        if attr == "stage" {
                            let stage = lit.as_deref().unwrap_or_else(|| {
                                panic!("{name}: stage not compared with a literal")
                            });
                            assert!(
                                ["enforce", "observe"].contains(&stage),
                                "{name}: no rollout stage is called {stage:?}"
                            );
                            stage_classes.insert(name.clone(), stage.to_owned());
                        }
                    }
                    DeviceRef::Capacity(domain, cap) => {
                        assert!(drivers.contains(domain), "{name}: capacity domain {domain}");
                        assert!(
                            cfg.devices.iter().any(|d| d.capacities.contains_key(cap)),
                            "{name}: no device has capacity {cap}"
                        );
                    }
                }
            }
            if let (Some(k), true) = (kind, enforced) {
                enforced_kinds.insert(k);
            }
        }
    }
    // An enforcing class for each kind the ConfigMap's devices enforce.
    assert_eq!(enforced_kinds, set(&["gpu", "net"]));
    // One class keeps new claims off NICs being observed (deviceclasses.yaml says which).
    assert_eq!(
        stage_classes,
        BTreeMap::from([(
            "shareguard-net-bandwidth-limited".to_owned(),
            "enforce".to_owned()
        )])
    );
}

#[test]
fn example_claim_template_asks_for_an_amount_the_net_device_policy_allows() {
    use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaimTemplate};
    use shareguard_common::Quantity;
    let docs = manifests();
    let cfg = configmap_config(&docs);
    let drivers = configmap_drivers(&cfg);
    let classes = class_kinds(&docs);
    let templates: Vec<ResourceClaimTemplate> = typed(&docs, "ResourceClaimTemplate");
    assert!(!templates.is_empty());
    let mut checked = 0;
    for t in &templates {
        let tname = t.metadata.name.clone().unwrap();
        let requests = t
            .spec
            .spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .as_deref()
            .unwrap_or_default();
        for r in requests {
            let ex = r
                .exactly
                .as_ref()
                .unwrap_or_else(|| panic!("{tname}/{}: an exact request", r.name));
            let kind = classes
                .get(&ex.device_class_name)
                .unwrap_or_else(|| panic!("{tname}: no DeviceClass {}", ex.device_class_name))
                .as_deref()
                .unwrap_or_else(|| panic!("{}: a class of one kind", ex.device_class_name));
            let devices: Vec<_> = cfg
                .devices
                .iter()
                .filter(|d| d.kind.as_str() == kind && drivers.contains(&d.driver))
                .collect();
            assert!(!devices.is_empty(), "no {kind} device in the ConfigMap");
            let asked = ex
                .capacity
                .as_ref()
                .and_then(|c| c.requests.as_ref())
                .expect("an amount of capacity");
            for (cap, amount) in asked {
                let q = Quantity::parse(&amount.0)
                    .unwrap_or_else(|e| panic!("{tname}: {cap}: {}: {e}", amount.0));
                // Some device of the class's kind has the capacity, and its policy takes the
                // amount as it is (the scheduler would round it up otherwise) within the
                // device's capacity.
                let fits = devices.iter().any(|d| {
                    d.capacities.get(cap).is_some_and(|c| {
                        c.policy.allows(&q).is_ok() && (c.value.is_zero() || q <= c.value)
                    })
                });
                assert!(
                    fits,
                    "{tname}: {cap} {q}: no {kind} device's policy allows it"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0);
    // The example's net request is the one this test was written for.
    let net = &cfg
        .devices
        .iter()
        .find(|d| d.kind == DeviceKind::Net)
        .unwrap()
        .capacities["bandwidth"];
    assert!(net.policy.allows(&Quantity::parse("200M").unwrap()).is_ok());
    assert!(
        net.policy
            .allows(&Quantity::parse("205M").unwrap())
            .is_err(),
        "the step is enforced"
    );

    // Each example pod uses a template, from the container that runs.
    let examples: Vec<(String, Value)> = docs
        .iter()
        .filter(|(f, _)| f.contains("/examples/"))
        .cloned()
        .collect();
    let pods: Vec<Pod> = typed(&examples, "Pod");
    assert_eq!(pods.len(), 2, "the bandwidth and the GPU example");
    for pod in &pods {
        let spec = pod.spec.as_ref().unwrap();
        assert_ne!(
            spec.host_network,
            Some(true),
            "a host-network pod has no veth to limit"
        );
        let claims = spec.resource_claims.as_deref().unwrap_or_default();
        let names: BTreeSet<&str> = templates
            .iter()
            .filter_map(|t| t.metadata.name.as_deref())
            .collect();
        for c in claims {
            assert!(
                c.resource_claim_template_name
                    .as_deref()
                    .is_some_and(|n| names.contains(n)),
                "{}: not one of the example templates",
                c.name
            );
        }
        let used: BTreeSet<&str> = spec
            .containers
            .iter()
            .flat_map(|c| c.resources.iter().flat_map(|r| r.claims.iter().flatten()))
            .map(|c| c.name.as_str())
            .collect();
        let declared: BTreeSet<&str> = claims.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(used, declared, "claims the containers use");
    }
}

/// The LICENSE file is the license Cargo.toml declares for every crate.
#[test]
fn the_license_file_is_the_one_cargo_toml_names() {
    let cargo = fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    assert!(
        cargo.contains("license = \"Apache-2.0\""),
        "Cargo.toml's license changed"
    );
    let text = fs::read_to_string(repo().join("LICENSE")).unwrap();
    let head: Vec<&str> = text.lines().take(2).map(str::trim).collect();
    assert_eq!(head, ["Apache License", "Version 2.0, January 2004"]);
    assert!(text.trim_end().ends_with("END OF TERMS AND CONDITIONS"));
}

/// deploy/uninstall/node-cleanup.yaml: `shareguard cleanup --apply` from the agent's
/// image on one node, with the agent's config from the ConfigMap shareguard-cleanup.
/// Every directory the shipped config names is reached through a host mount of one of
/// its parents, never mounted itself (cleanup leaves a directory something is mounted
/// on), in the host's network and PID namespaces, with the agent's capabilities and
/// DAC_OVERRIDE alone beside them.
#[test]
fn the_node_cleanup_pod_reaches_every_path_the_agent_config_names() {
    use k8s_openapi::api::core::v1::Pod;
    let docs = manifests();
    let cleanup: Vec<(String, Value)> = docs
        .iter()
        .filter(|(f, _)| f.ends_with("uninstall/node-cleanup.yaml"))
        .cloned()
        .collect();
    let pod: Pod = the_typed(&cleanup, "Pod");
    let spec = pod.spec.as_ref().unwrap();
    let node = spec.node_name.as_deref().expect("nodeName, to be replaced");
    assert_eq!(
        pod.metadata.name.as_deref(),
        Some(format!("shareguard-cleanup-{node}").as_str()),
        "one placeholder names the pod and its node"
    );
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert_eq!(spec.host_network, Some(true), "ifb links and qdiscs");
    assert_eq!(spec.host_pid, Some(true), "MPS daemons");
    assert_eq!(spec.automount_service_account_token, Some(false));
    assert_eq!(spec.containers.len(), 1);
    let c = &spec.containers[0];

    let agent_ds = daemonset_named(&docs, AGENT_DS);
    let agent = pod_spec(&agent_ds)
        .containers
        .iter()
        .find(|c| c.name == "agent")
        .unwrap();
    assert_eq!(c.image, agent.image, "the agent's image");
    let added = |c: &k8s_openapi::api::core::v1::Container| -> BTreeSet<String> {
        let caps = c.security_context.as_ref().unwrap().capabilities.as_ref();
        assert_eq!(
            caps.and_then(|k| k.drop.clone()),
            Some(vec!["ALL".to_owned()])
        );
        caps.and_then(|k| k.add.clone())
            .unwrap_or_default()
            .into_iter()
            .collect()
    };
    // Beyond the agent's: DAC_OVERRIDE, for the kubelet plugin's directories (its own
    // uid's, 0750), which the agent never touches.
    let extra: Vec<String> = added(c).difference(&added(agent)).cloned().collect();
    assert_eq!(extra, ["DAC_OVERRIDE"], "capabilities the agent has not");
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    let env = c.env.as_deref().unwrap_or_default();
    let node_name = env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    assert_eq!(
        node_name
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str()),
        Some("spec.nodeName"),
        "the config is read as the agent reads it"
    );

    // The config: the ConfigMap shareguard-cleanup's agent.toml, where the command
    // reads it.
    let mounts = c.volume_mounts.as_deref().unwrap_or_default();
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let volume = |name: &str| volumes.iter().find(|v| v.name == name).unwrap();
    let config_mount = mounts.iter().find(|m| m.name == "config").unwrap();
    assert_eq!(
        volume("config")
            .config_map
            .as_ref()
            .map(|m| m.name.as_str()),
        Some("shareguard-cleanup")
    );
    let command = c.command.clone().unwrap();
    assert_eq!(
        command,
        [
            "/usr/local/bin/shareguard".to_owned(),
            "cleanup".into(),
            "--config".into(),
            format!("{}/agent.toml", config_mount.mount_path),
            "--apply".into(),
        ]
    );

    // Host directories, each at its own path in the container.
    let host: Vec<&str> = mounts
        .iter()
        .filter_map(|m| {
            let h = volume(&m.name).host_path.as_ref()?;
            assert_eq!(
                h.path, m.mount_path,
                "{}: the host's path, as the host names it",
                m.name
            );
            assert_ne!(
                m.read_only,
                Some(true),
                "{}: cleanup removes from it",
                m.name
            );
            Some(m.mount_path.as_str())
        })
        .collect();
    let cfg = configmap_config(&docs);
    let a = &cfg.agent;
    let mut paths = vec![
        a.state_dir.clone(),
        a.audit_log.clone(),
        a.socket.parent().unwrap().to_owned(),
        a.mps.dir.clone(),
        a.bpffs_dir.clone(),
        // Where the kubelet plugin's directories are (cleanup's --kubelet-dir default).
        PathBuf::from("/var/lib/kubelet/plugins"),
        PathBuf::from("/var/lib/kubelet/plugins_registry"),
    ];
    // /var/run is a link to /run on the host (every current distribution) and in the
    // image (Debian's base), so /var/run/cdi is the host's /run/cdi.
    paths.push(match a.cdi_dir.strip_prefix("/var/run") {
        Ok(rest) => Path::new("/run").join(rest),
        Err(_) => a.cdi_dir.clone(),
    });
    for p in &paths {
        assert!(
            host.iter().any(|m| p.starts_with(m) && p != Path::new(m)),
            "{} is not below any host mount of the cleanup pod ({host:?})",
            p.display()
        );
    }
}
