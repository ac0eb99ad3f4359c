use super::*;

/// tests/cluster/restart-apiserver.sh with these gate changes (none: the usual gates).
fn restart_apiserver(changes: &[&str]) {
    run_script("restart-apiserver.sh", changes);
}

/// Puts the API server back on the usual feature gates, also when the scenario failed.
struct UsualApiServer;

impl Drop for UsualApiServer {
    fn drop(&mut self) {
        restart_apiserver(&[]);
    }
}

/// Whether every device of `node`'s shareguard slice has `allowMultipleAllocations`
/// (what the DRAConsumableCapacity gate guards), and the slice's name.
fn slice_whole(c: &Cluster, node: &str) -> Option<(String, bool)> {
    let s = node_slices(c, node).into_iter().next()?;
    let devices = field(&s, "spec.devices")
        .as_array()
        .cloned()
        .unwrap_or_default();
    let whole = !devices.is_empty()
        && devices
            .iter()
            .all(|d| d["allowMultipleAllocations"] == true);
    Some((field(&s, "metadata.name").as_str()?.to_string(), whole))
}

/// l. An API server with DRAConsumableCapacity off (a cluster where the gate was
/// never turned on) drops the consumable-capacity fields from every slice written,
/// without an error, and the scheduler would then give each device to one claim
/// whole. The plugin notices: it reads back what was stored and says loudly which
/// fields are gone and the likely cause; once the gate is on again its next check
/// publishes the slice whole again.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn l_an_api_server_without_consumable_capacity_is_noticed() {
    let c = Cluster::from_env();
    let node = NODES[0];
    let (name, whole) = slice_whole(&c, node).expect("the node's slice");
    assert!(
        whole,
        "the slice lacks allowMultipleAllocations before the scenario"
    );
    let pod = c.shareguard_pod(node, "kubelet-plugin");
    // The plugin's log keeps what an earlier run of this scenario on the same cluster
    // made it say: only a report after this restart counts.
    const DROPPED: &str = "published without fields the API server dropped";
    let reports = |logs: &str| logs.matches(DROPPED).count();
    let before = reports(&c.ok(&["logs", "-n", "shareguard-system", &pod]));
    let _usual = UsualApiServer;
    restart_apiserver(&["DRAConsumableCapacity=false"]);
    // Stored objects keep the fields until they are written again: delete the slice,
    // and the plugin writes it anew through this API server.
    c.ok(&["delete", "resourceslice", &name]);
    let logs = wait_for(
        "the plugin to report the dropped fields",
        STATUS_TIMEOUT,
        || {
            let logs = c.ok(&["logs", "-n", "shareguard-system", &pod]);
            if reports(&logs) > before {
                Ok(logs)
            } else {
                Err("not yet".to_string())
            }
        },
    );
    assert!(logs.contains("DRAConsumableCapacity"), "{logs}");
    assert!(logs.contains("allowMultipleAllocations"), "{logs}");
    let (_, whole) = slice_whole(&c, node).expect("the slice published again");
    assert!(!whole, "the API server kept the fields with the gate off");

    restart_apiserver(&[]);
    // The plugin checks again every --resync-seconds (30 s in deploy/).
    wait_for(
        "the slice published whole again",
        POD_TIMEOUT,
        || match slice_whole(&c, node) {
            Some((_, true)) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}
