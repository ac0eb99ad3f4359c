//! Scenarios on the real test cluster (tests/cluster/, `make e2e`): kube-apiserver,
//! kube-scheduler and two kubelets with containerd built from upstream, shareguard
//! installed from deploy/. Each is `#[ignore]`d in a plain `cargo test` (no cluster
//! there); tests/cluster/e2e.sh runs them with `--ignored` on a fresh cluster.
//!
//! One file per scenario, named after its letter (libtest runs them in name order, so
//! `z_uninstall` and `zz_helm` come last, as they must); what several scenarios use is
//! here.

mod a2_plugin_uid;
mod a_pools;
mod b_bandwidth;
mod c_capacity;
mod d_race;
mod f_killed_agent;
mod g_rolling_update;
mod h_gpu;
mod i_step_grid;
mod j_plugin_gone;
mod k_admission;
mod l_no_consumable_capacity;
mod m_refused_claim;
mod n_example;
mod o_rollback;
mod p_shared_claim;
mod q_nic_fault;
mod r_lost_node;
mod s_api_requests;
mod z_uninstall;
mod zz_helm;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use shareguard_tests::{
    cluster::{
        Cluster, DRIVER, NODES, Namespace, TOOLS_IMAGE, driver_entry, field, is_enforced,
        run_script, script, wait_for,
    },
    net::{GOODPUT_HIGH, GOODPUT_LOW, TrafficLock},
};

/// Pod start on these nodes: sandbox, CNI, containers from local images.
pub(crate) const POD_TIMEOUT: Duration = Duration::from_secs(120);
/// Agent ENFORCED -> condition in the claim, and the plugin's other writes.
pub(crate) const STATUS_TIMEOUT: Duration = Duration::from_secs(60);

/// What kubelet writes into pod `pod`'s status of its DRA devices' health: every
/// `allocatedResourcesStatus[].resources[]` entry (resourceID, health, message).
pub(crate) fn resource_health(c: &Cluster, ns: &str, pod: &str) -> Vec<Value> {
    let p = c.json(&["get", "pod", "-n", ns, pod]);
    field(&p, "status.containerStatuses")
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| {
            s["allocatedResourcesStatus"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|r| r["resources"].as_array().cloned().unwrap_or_default())
        .collect()
}

/// The first taint of device `device` in `node`'s slices, if it has one.
pub(crate) fn device_taint(c: &Cluster, node: &str, device: &str) -> Option<Value> {
    node_slices(c, node)
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == device)
        .and_then(|d| d["taints"].as_array().and_then(|t| t.first().cloned()))
}

const AGENT_CONFIGMAP: &str = "shareguard-agent-config";

/// The agents' config changed as an operator would: the ConfigMap applied, the agents'
/// DaemonSet patched where the change needs it (a mount), the agents restarted and
/// waited for. The ConfigMap as it was, and the DaemonSet without the patch, come back
/// when this drops.
pub(crate) struct AgentConfig {
    cluster: Cluster,
    original: Value,
    /// The patch that undoes the one applied, if any.
    undo: Option<String>,
}

impl AgentConfig {
    /// `edit` gets the agents' config file (agent.toml) and returns the new one;
    /// `patch` is a strategic merge patch of the agents' DaemonSet and the one that
    /// undoes it.
    pub(crate) fn change(
        c: &Cluster,
        edit: impl FnOnce(String) -> String,
        patch: Option<(String, String)>,
    ) -> AgentConfig {
        let original = c.json(&[
            "get",
            "configmap",
            "-n",
            "shareguard-system",
            AGENT_CONFIGMAP,
        ]);
        let toml = field(&original, "data")["agent.toml"]
            .as_str()
            .unwrap_or_else(|| panic!("no agent.toml in {original}"))
            .to_string();
        let mut changed = original.clone();
        changed["data"]["agent.toml"] = Value::String(edit(toml));
        let (patch, undo) = patch.unzip();
        let guard = AgentConfig {
            cluster: c.clone(),
            original,
            undo,
        };
        guard.install(&changed, patch.as_deref());
        guard
    }

    fn install(&self, configmap: &Value, patch: Option<&str>) {
        let mut cm = configmap.clone();
        // apply wants no server-owned fields.
        if let Some(meta) = cm["metadata"].as_object_mut() {
            for f in [
                "resourceVersion",
                "uid",
                "creationTimestamp",
                "managedFields",
            ] {
                meta.remove(f);
            }
        }
        self.cluster.apply(&cm.to_string());
        if let Some(patch) = patch {
            self.cluster.ok(&[
                "patch",
                "-n",
                "shareguard-system",
                "daemonset/shareguard-agent",
                "--type=strategic",
                "-p",
                patch,
            ]);
        }
        self.cluster.ok(&[
            "rollout",
            "restart",
            "-n",
            "shareguard-system",
            "daemonset/shareguard-agent",
        ]);
        self.cluster.ok(&[
            "rollout",
            "status",
            "-n",
            "shareguard-system",
            "daemonset/shareguard-agent",
            "--timeout=180s",
        ]);
    }
}

impl Drop for AgentConfig {
    fn drop(&mut self) {
        let original = self.original.clone();
        let undo = self.undo.clone();
        self.install(&original, undo.as_deref());
    }
}

/// How a pod gets its claim.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum ClaimKind {
    /// From a ResourceClaimTemplate: the claim is the pod's and goes with it.
    Template,
    /// A ResourceClaim of its own, which outlives the pod.
    Standalone,
}

/// A claim (or claim template) named `name` asking the bandwidth class for `amount`,
/// and a pod `name` on `node` that uses it and sleeps (the scenario runs iperf3 in it
/// with kubectl exec).
pub(crate) fn bandwidth_pod(
    ns: &str,
    name: &str,
    node: &str,
    amount: &str,
    kind: ClaimKind,
) -> String {
    let spec = format!(
        "devices:\n  requests:\n  - name: net\n    exactly:\n      deviceClassName: shareguard-net-bandwidth\n      capacity:\n        requests: {{bandwidth: {amount}}}\n"
    );
    let claim = match kind {
        ClaimKind::Template => format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  spec:\n{}",
            indent(&spec, 4)
        ),
        ClaimKind::Standalone => format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n{}",
            indent(&spec, 2)
        ),
    };
    format!(
        "{claim}---\n{}",
        tools_pod(ns, name, node, Some((name, kind)), &["sleep", "86400"])
    )
}

pub(crate) fn indent(text: &str, by: usize) -> String {
    text.lines()
        .map(|l| format!("{}{l}\n", " ".repeat(by)))
        .collect()
}

/// A pod of the test-workload image on `node`, using the claim (or template) given.
pub(crate) fn tools_pod(
    ns: &str,
    name: &str,
    node: &str,
    claim: Option<(&str, ClaimKind)>,
    cmd: &[&str],
) -> String {
    let cmd = cmd
        .iter()
        .map(|c| format!("{c:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let (claims, uses) = match claim {
        Some((c, kind)) => (
            format!(
                "  resourceClaims:\n  - name: net\n    {}: {c}\n",
                match kind {
                    ClaimKind::Template => "resourceClaimTemplateName",
                    ClaimKind::Standalone => "resourceClaimName",
                }
            ),
            "    resources:\n      claims:\n      - name: net\n".to_string(),
        ),
        None => (String::new(), String::new()),
    };
    format!(
        r#"apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{kubernetes.io/hostname: {node}}}
  terminationGracePeriodSeconds: 1
{claims}  containers:
  - name: tools
    image: {TOOLS_IMAGE}
    imagePullPolicy: Never
    command: [{cmd}]
{uses}"#
    )
}

pub(crate) fn wait_running(c: &Cluster, ns: &str, pod: &str) -> Value {
    wait_for(&format!("pod {ns}/{pod} Running"), POD_TIMEOUT, || {
        let p = c
            .get(&["pod", "-n", ns, pod])
            .ok_or_else(|| "not found".to_string())?;
        if field(&p, "status.phase") == "Running" {
            Ok(p)
        } else {
            Err(format!("{}", field(&p, "status")))
        }
    })
}

/// The single claim of a namespace (made from its pod's template).
pub(crate) fn only_claim(c: &Cluster, ns: &str) -> Value {
    let claims = c.json(&["get", "resourceclaims", "-n", ns]);
    let items = claims["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 1, "claims in {ns}: {claims}");
    items[0].clone()
}

/// The claim's status.devices entry of shareguard, once its Enforced condition is True.
pub(crate) fn wait_enforced_status(c: &Cluster, ns: &str) -> Value {
    wait_for(
        &format!("the claim in {ns} to show Enforced=True"),
        STATUS_TIMEOUT,
        || {
            let claim = only_claim(c, ns);
            let entry = driver_entry(&claim)
                .ok_or_else(|| format!("no {DRIVER} entry: {}", field(&claim, "status")))?;
            if is_enforced(entry) {
                Ok(entry.clone())
            } else {
                Err(format!("{entry}"))
            }
        },
    )
}

/// Pod `pod` on `node` in `ns` with a claim of `kind` asking for `amount`, once it runs
/// and its claim says Enforced: the claim's status entry.
pub(crate) fn enforced_pod(
    c: &Cluster,
    ns: &str,
    pod: &str,
    node: &str,
    amount: &str,
    kind: ClaimKind,
) -> Value {
    c.apply(&bandwidth_pod(ns, pod, node, amount, kind));
    wait_running(c, ns, pod);
    wait_enforced_status(c, ns)
}

/// TCP goodput of iperf3 from pod `ns/pod` to `server` (or from `server` with
/// `reverse`), in bit/s.
pub(crate) fn iperf(c: &Cluster, ns: &str, pod: &str, server: &str, reverse: bool) -> f64 {
    let mut args = vec![
        "exec", "-n", ns, pod, "--", "iperf3", "-c", server, "-t", "5", "-O", "1", "-J",
    ];
    if reverse {
        args.push("-R");
    }
    let text = c.ok(&args);
    let v: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("iperf3 gave no JSON: {e}: {text}"));
    field(&v, "end.sum_received.bits_per_second")
        .as_f64()
        .unwrap_or_else(|| panic!("iperf3 reported no received rate: {text}"))
}

pub(crate) fn pod_ip(p: &Value) -> String {
    field(p, "status.podIP")
        .as_str()
        .unwrap_or_else(|| panic!("pod has no IP: {p}"))
        .to_string()
}

/// An iperf3 server pod on `node` (no claim), in a namespace of its own: the guard and
/// the server's address once it runs.
pub(crate) fn iperf_server(c: &Cluster, node: &str) -> (Namespace, String) {
    let ns = c.namespace("e2e-iperf");
    c.apply(&tools_pod(
        &ns.name,
        "server",
        node,
        None,
        &["iperf3", "-s"],
    ));
    let ip = pod_ip(&wait_running(c, &ns.name, "server"));
    (ns, ip)
}

/// iperf3 from `ns/pod` to `server` (or back, with `reverse`) measures goodput within
/// the band the other bandwidth tests hold shaped shares to. Call under the traffic lock.
pub(crate) fn assert_in_band(
    c: &Cluster,
    ns: &str,
    pod: &str,
    server: &str,
    reverse: bool,
    limit_bits: f64,
    what: &str,
) {
    let way = if reverse {
        "into the pod"
    } else {
        "out of the pod"
    };
    let rate = iperf(c, ns, pod, server, reverse);
    let ratio = rate / limit_bits;
    eprintln!(
        "{what} {way}: {:.1} Mbit/s, {ratio:.3} of the limit",
        rate / 1e6
    );
    assert!(
        (GOODPUT_LOW..=GOODPUT_HIGH).contains(&ratio),
        "{what} {way}: goodput {ratio:.3} of the limit, outside {GOODPUT_LOW}..{GOODPUT_HIGH}"
    );
}

/// The shareID of a claim's first allocation result.
pub(crate) fn first_share_id(claim: &Value) -> String {
    field(claim, "status.allocation.devices.results")[0]["shareID"]
        .as_str()
        .unwrap_or_else(|| panic!("no shareID in the allocation: {claim}"))
        .to_string()
}

/// The bandwidth nic-0 of `node` has allocated, in bit/s, from the agent's ledger.
pub(crate) fn allocated_bandwidth(c: &Cluster, node: &str) -> u64 {
    nic_allocated(&c.agent_cli(node, &["devices"]))
}

/// The bandwidth nic-0 has allocated, in bit/s, from `shareguard devices` as JSON.
pub(crate) fn nic_allocated(devices: &Value) -> u64 {
    let nic = devices["devices"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|d| d["name"] == "nic-0")
        .unwrap_or_else(|| panic!("no nic-0: {devices}"));
    match nic["allocated"]["bandwidth"].as_str() {
        None => 0,
        Some(q) => shareguard_common::Quantity::parse(q)
            .ok()
            .and_then(|q| u64::try_from(q.ceil_units()?).ok())
            .unwrap_or_else(|| panic!("allocated bandwidth {q:?} is not a whole number")),
    }
}

/// The pod's PodScheduled condition once the scheduler has said it cannot place it.
pub(crate) fn wait_unschedulable(c: &Cluster, ns: &str, pod: &str) -> String {
    wait_for(
        &format!("pod {ns}/{pod} to be unschedulable"),
        POD_TIMEOUT,
        || {
            let p = c
                .get(&["pod", "-n", ns, pod])
                .ok_or_else(|| "not found".to_string())?;
            let cond = field(&p, "status.conditions")
                .as_array()
                .into_iter()
                .flatten()
                .find(|k| k["type"] == "PodScheduled")
                .cloned()
                .unwrap_or(Value::Null);
            if cond["status"] == "False" && cond["reason"] == "Unschedulable" {
                Ok(cond["message"].as_str().unwrap_or_default().to_string())
            } else {
                Err(format!("{}", field(&p, "status")))
            }
        },
    )
}

/// A pod asking for `amount` with no node named: the scheduler picks.
pub(crate) fn unpinned_bandwidth_pod(ns: &str, name: &str, amount: &str) -> String {
    bandwidth_pod(ns, name, "", amount, ClaimKind::Template)
        .replace("  nodeSelector: {kubernetes.io/hostname: }\n", "")
}

pub(crate) fn share_phase(c: &Cluster, node: &str, share_id: &str) -> String {
    c.agent_cli(node, &["share", share_id])["phase"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// shareguard's ResourceSlices, of one node or all: name -> uid (a slice deleted and
/// made again has a new uid).
pub(crate) fn slice_uids(
    c: &Cluster,
    node: Option<&str>,
) -> std::collections::BTreeMap<String, String> {
    let mut selector = format!("spec.driver={DRIVER}");
    if let Some(node) = node {
        selector.push_str(&format!(",spec.nodeName={node}"));
    }
    let slices = c.json(&["get", "resourceslices", "--field-selector", &selector]);
    slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            (
                field(s, "metadata.name")
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                field(s, "metadata.uid")
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// The images of shareguard's pods on every node, one line per pod.
pub(crate) fn shareguard_images(c: &Cluster) -> Vec<String> {
    let pods = c.json(&["get", "pods", "-n", "shareguard-system"]);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{} {}",
                field(p, "metadata.name").as_str().unwrap_or_default(),
                field(p, "spec.containers")[0]["image"]
                    .as_str()
                    .unwrap_or_default()
            )
        })
        .collect()
}

/// deploy/chart/, the Helm chart, as a path for `helm`.
pub(crate) fn chart_dir() -> String {
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/chart");
    chart
        .to_str()
        .unwrap_or_else(|| panic!("{chart:?} is not UTF-8"))
        .to_owned()
}

/// The ResourceSlices shareguard's plugin published for `node`, as the API server has them.
pub(crate) fn node_slices(c: &Cluster, node: &str) -> Vec<serde_json::Value> {
    let slices = c.json(&[
        "get",
        "resourceslices",
        "--field-selector",
        &format!("spec.nodeName={node},spec.driver={DRIVER}"),
    ]);
    slices["items"].as_array().cloned().unwrap_or_default()
}

/// The Events of namespace `ns` (events.k8s.io/v1) as (kind of the object, its name,
/// type, reason, note).
pub(crate) fn events(c: &Cluster, ns: &str) -> Vec<(String, String, String, String, String)> {
    let list = c.json(&["get", "events.events.k8s.io", "-n", ns]);
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (
                s(&e["regarding"]["kind"]),
                s(&e["regarding"]["name"]),
                s(&e["type"]),
                s(&e["reason"]),
                s(&e["note"]),
            )
        })
        .collect()
}

/// Every object of deploy/ is gone (the namespace with both DaemonSets, the
/// cluster-wide RBAC, admission policy and DeviceClasses), no shareguard pod is left,
/// and kubelet has deleted the driver's ResourceSlices on both nodes.
pub(crate) fn assert_nothing_installed(c: &Cluster) {
    for (kind, name) in [
        ("namespace", "shareguard-system"),
        ("clusterrole", "shareguard-kubelet-plugin"),
        ("clusterrolebinding", "shareguard-kubelet-plugin"),
        (
            "validatingadmissionpolicy",
            "shareguard-kubelet-plugin-resourceslices",
        ),
        (
            "validatingadmissionpolicybinding",
            "shareguard-kubelet-plugin-resourceslices",
        ),
        (
            "validatingadmissionpolicy",
            "shareguard-kubelet-plugin-events",
        ),
        (
            "validatingadmissionpolicybinding",
            "shareguard-kubelet-plugin-events",
        ),
        (
            "validatingadmissionpolicy",
            "shareguard-kubelet-plugin-claim-status",
        ),
        (
            "validatingadmissionpolicybinding",
            "shareguard-kubelet-plugin-claim-status",
        ),
        ("deviceclass", "shareguard-net-bandwidth"),
        ("deviceclass", "shareguard-net-bandwidth-limited"),
        ("deviceclass", "shareguard-gpu-memory"),
        ("deviceclass", "shareguard-gpu-memory-per-process"),
        ("deviceclass", "shareguard-accounted"),
    ] {
        assert!(
            c.get(&[kind, name]).is_none(),
            "{kind} {name} is still there"
        );
    }
    // The namespace's deletion waited for its pods; a pod in another namespace would
    // be one the uninstall missed.
    let pods = c.json(&[
        "get",
        "pods",
        "-A",
        "-l",
        "app.kubernetes.io/name=shareguard",
    ]);
    assert_eq!(pods["items"].as_array().map_or(0, Vec::len), 0, "{pods}");
    // kubelet's 30 s after the last plugin went.
    wait_for(
        "kubelet to wipe the driver's slices",
        POD_TIMEOUT,
        || match slice_uids(c, None).len() {
            0 => Ok(()),
            n => Err(format!("{n} slices")),
        },
    );
}
