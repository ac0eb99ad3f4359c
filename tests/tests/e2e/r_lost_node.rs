use super::*;

/// `shareguard -o json ARGS` on `node` from the node's own namespaces
/// (tests/cluster/node-cli.sh): it needs neither kubelet nor the API server.
fn node_cli(node: &str, args: &[&str]) -> Value {
    let mut all = vec![node, "-o", "json"];
    all.extend(args);
    let out = script("node-cli.sh", &all)
        .output()
        .unwrap_or_else(|e| panic!("node-cli.sh {all:?}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "node-cli.sh {all:?}: {}{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("node-cli.sh {all:?}: {e}: {text}"))
}

/// The share's phase and the node's allocated bandwidth (bit/s), as the node's agent
/// says.
fn held(node: &str, share_id: &str) -> (String, u64) {
    let phase = node_cli(node, &["share", share_id])["phase"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (phase, nic_allocated(&node_cli(node, &["devices"])))
}

/// Whether `node`'s Ready condition is True.
fn ready(c: &Cluster, node: &str) -> bool {
    let n = c.json(&["get", "node", node]);
    field(&n, "status.conditions")
        .as_array()
        .into_iter()
        .flatten()
        .any(|k| k["type"] == "Ready" && k["status"] == "True")
}

/// A node's kubelet stopped; started again when this drops, also when the scenario
/// fails.
struct KubeletDown {
    node: &'static str,
    up: bool,
}

impl KubeletDown {
    fn stop(node: &'static str) -> KubeletDown {
        run_script("kubelet.sh", &[node, "stop"]);
        KubeletDown { node, up: false }
    }

    fn start(&mut self) {
        self.up = true;
        run_script("kubelet.sh", &[self.node, "start"]);
    }
}

impl Drop for KubeletDown {
    fn drop(&mut self) {
        if !self.up {
            // Best effort: the scenario has failed already.
            let _ = script("kubelet.sh", &[self.node, "start"]).status();
        }
    }
}

/// r. A node cut off from the control plane while its pod runs: its kubelet stopped
/// until the node is NotReady, the pod force-deleted as an operator would. The claim's
/// reservation and allocation go on the API server, but the node's agent keeps the
/// share and its capacity (the pod's containers may still run there, and no kubelet has
/// unprepared it): shown from the node itself, without kubelet or API server. No new
/// pod is placed on the lost node meanwhile. Once its kubelet is back, it unprepares the
/// claim of the pod that is gone: the share is released and the node's capacity is what
/// it was before, once.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn r_a_lost_nodes_shares_stay_held_until_its_kubelet_returns() {
    let c = Cluster::from_env();
    let node = NODES[1];
    let before = allocated_bandwidth(&c, node);
    let ns = c.namespace("e2e-r");
    c.apply(&bandwidth_pod(
        &ns.name,
        "lost",
        node,
        "300M",
        ClaimKind::Standalone,
    ));
    wait_running(&c, &ns.name, "lost");
    let claim = c.json(&["get", "resourceclaim", "-n", &ns.name, "lost"]);
    let share_id = field(&claim, "status.allocation.devices.results")[0]["shareID"]
        .as_str()
        .unwrap_or_else(|| panic!("no shareID: {claim}"))
        .to_string();
    wait_for(
        &format!("share {share_id} ENFORCED"),
        STATUS_TIMEOUT,
        || match share_phase(&c, node, &share_id).as_str() {
            "ENFORCED" => Ok(()),
            p => Err(p.to_string()),
        },
    );
    assert_eq!(allocated_bandwidth(&c, node), before + 300_000_000);

    let mut down = KubeletDown::stop(node);
    wait_for(
        &format!("{node} NotReady"),
        Duration::from_secs(150),
        || match ready(&c, node) {
            true => Err("Ready".into()),
            false => Ok(()),
        },
    );
    c.ok(&[
        "delete",
        "pod",
        "-n",
        &ns.name,
        "lost",
        "--force",
        "--grace-period=0",
    ]);
    let deleted = std::time::Instant::now();
    wait_for(
        "the claim neither reserved nor allocated",
        STATUS_TIMEOUT,
        || {
            let cl = c.json(&["get", "resourceclaim", "-n", &ns.name, "lost"]);
            let status = field(&cl, "status");
            if status["reservedFor"].is_null() && status["allocation"].is_null() {
                Ok(())
            } else {
                Err(format!("{status}"))
            }
        },
    );
    // On the node: the share and its capacity still held.
    let (phase, allocated) = held(node, &share_id);
    assert!(
        !matches!(phase.as_str(), "RELEASED" | "RELEASING" | ""),
        "the lost node keeps its share: {phase}"
    );
    assert_eq!(
        allocated,
        before + 300_000_000,
        "capacity held on the lost node"
    );
    // Nothing new is placed on the lost node meanwhile.
    c.apply(&bandwidth_pod(
        &ns.name,
        "newcomer",
        node,
        "100M",
        ClaimKind::Standalone,
    ));
    let why = wait_unschedulable(&c, &ns.name, "newcomer");
    eprintln!("newcomer, while {node} is lost: {why}");
    c.ok(&["delete", "pod", "-n", &ns.name, "newcomer", "--wait=true"]);
    c.ok(&[
        "delete",
        "resourceclaim",
        "-n",
        &ns.name,
        "newcomer",
        "--wait=true",
    ]);
    let (phase, _) = held(node, &share_id);
    assert!(
        !matches!(phase.as_str(), "RELEASED" | "RELEASING"),
        "still held: {phase}"
    );

    // kubelet back: it unprepares the claim of the pod that is gone (its DRA manager's
    // reconcile, once a minute), and the capacity comes back once.
    down.start();
    wait_for(
        &format!("share {share_id} released once {node}'s kubelet is back"),
        Duration::from_secs(240),
        || match held(node, &share_id) {
            (p, _) if p == "RELEASED" => Ok(()),
            (p, a) => Err(format!("{p}, allocated {a}")),
        },
    );
    // A figure for docs/benchmarks.md, not a bound.
    eprintln!(
        "the lost node's capacity stayed held {:?} after its pod was force-deleted",
        deleted.elapsed()
    );
    assert_eq!(allocated_bandwidth(&c, node), before, "nothing held twice");
    wait_for(
        &format!("{node} Ready again"),
        POD_TIMEOUT,
        || match ready(&c, node) {
            true => Ok(()),
            false => Err("not Ready".to_string()),
        },
    );
}
