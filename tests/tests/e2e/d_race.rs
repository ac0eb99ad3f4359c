use super::*;

/// d. Two namespaces race for the last share of a NIC: one pod is scheduled and
/// enforced, the other waits until the first is gone, then runs, limited.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn d_two_tenants_race_for_the_last_share_and_the_loser_waits() {
    let c = Cluster::from_env();
    let node = NODES[0];
    let filler = c.namespace("e2e-fill");
    c.apply(&bandwidth_pod(
        &filler.name,
        "fill",
        node,
        "9800M",
        ClaimKind::Template,
    ));
    wait_running(&c, &filler.name, "fill");
    let (_server_ns, server) = iperf_server(&c, node);
    // Both at once: 200M is left, each asks 200M.
    let racers: Vec<Namespace> = ["e2e-d1", "e2e-d2"].map(|p| c.namespace(p)).into();
    let docs: Vec<String> = racers
        .iter()
        .map(|ns| bandwidth_pod(&ns.name, "racer", node, "200M", ClaimKind::Template))
        .collect();
    c.apply(&docs.join("---\n"));
    let (winner, loser) = wait_for("one racer scheduled, one refused", POD_TIMEOUT, || {
        let states: Vec<(usize, Value)> = racers
            .iter()
            .enumerate()
            .filter_map(|(i, ns)| c.get(&["pod", "-n", &ns.name, "racer"]).map(|p| (i, p)))
            .collect();
        let running: Vec<usize> = states
            .iter()
            .filter(|(_, p)| field(p, "status.phase") == "Running")
            .map(|(i, _)| *i)
            .collect();
        let refused: Vec<usize> = states
            .iter()
            .filter(|(_, p)| {
                field(p, "status.conditions")
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| k["type"] == "PodScheduled" && k["reason"] == "Unschedulable")
            })
            .map(|(i, _)| *i)
            .collect();
        match (running.as_slice(), refused.as_slice()) {
            ([w], [l]) => Ok((*w, *l)),
            _ => Err(format!("running {running:?}, unschedulable {refused:?}")),
        }
    });
    wait_enforced_status(&c, &racers[winner].name);
    assert!(
        c.get(&["pod", "-n", &racers[loser].name, "racer"])
            .is_some_and(|p| field(&p, "spec.nodeName").is_null()),
        "the loser is not bound to a node"
    );

    c.ok(&[
        "delete",
        "pod",
        "-n",
        &racers[winner].name,
        "racer",
        "--wait=true",
    ]);
    let loser_ns = &racers[loser].name;
    wait_running(&c, loser_ns, "racer");
    wait_enforced_status(&c, loser_ns);
    let _lock = TrafficLock::acquire();
    assert_in_band(
        &c,
        loser_ns,
        "racer",
        &server,
        true,
        200e6,
        "the loser's 200M, once scheduled",
    );
}
