use super::*;

/// p. A claim used by two pods on one node is one share: kubelet prepares the claim once
/// (for the first pod) and only notes the second in its DRA checkpoint, where the agent
/// finds it; both pods are then held by the share's one limit, sending at once in either
/// direction. The second pod ending leaves the first limited; the claim is released
/// with the last.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn p_two_pods_of_one_claim_are_held_by_one_limit() {
    let c = Cluster::from_env();
    let node = NODES[0];
    let servers = [iperf_server(&c, node), iperf_server(&c, node)];
    let ns = c.namespace("e2e-p");
    c.apply(&bandwidth_pod(
        &ns.name,
        "first",
        node,
        "100M",
        ClaimKind::Standalone,
    ));
    wait_running(&c, &ns.name, "first");
    let share_id = first_share_id(&wait_for(
        "the shared claim allocated",
        STATUS_TIMEOUT,
        || {
            let claim = only_claim(&c, &ns.name);
            if field(&claim, "status.allocation").is_null() {
                Err(format!("{claim}"))
            } else {
                Ok(claim)
            }
        },
    ));
    wait_enforced_status(&c, &ns.name);
    c.apply(&tools_pod(
        &ns.name,
        "second",
        node,
        Some(("first", ClaimKind::Standalone)),
        &["sleep", "86400"],
    ));
    wait_running(&c, &ns.name, "second");
    let pods_of = |s: &Value| -> usize {
        usize::from(!s["sandbox"].is_null()) + s["moreSandboxes"].as_array().map_or(0, Vec::len)
    };
    let s = wait_for(
        &format!("share {share_id} ENFORCED on both pods"),
        STATUS_TIMEOUT,
        || {
            let s = c.agent_cli(node, &["share", &share_id]);
            if s["phase"] == "ENFORCED" && pods_of(&s) == 2 {
                Ok(s)
            } else {
                Err(format!("{s}"))
            }
        },
    );
    eprintln!("share on both pods: {s}");

    let _lock = TrafficLock::acquire();
    for reverse in [false, true] {
        let (a, b) = std::thread::scope(|t| {
            let a = t.spawn(|| iperf(&c, &ns.name, "first", &servers[0].1, reverse));
            let b = t.spawn(|| iperf(&c, &ns.name, "second", &servers[1].1, reverse));
            (
                a.join().expect("iperf3 of the first pod"),
                b.join().expect("iperf3 of the second pod"),
            )
        });
        let ratio = (a + b) / 100e6;
        eprintln!(
            "two pods of one 100M claim, {}: {:.1} + {:.1} Mbit/s, {ratio:.3} of the limit",
            if reverse { "into them" } else { "out of them" },
            a / 1e6,
            b / 1e6
        );
        assert!(
            (GOODPUT_LOW..=GOODPUT_HIGH).contains(&ratio),
            "two pods of one 100M claim together: {ratio:.3} of the limit"
        );
        assert!(a > 5e6 && b > 5e6, "both pods make progress: {a} and {b}");
    }

    c.ok(&["delete", "pod", "-n", &ns.name, "second", "--wait=true"]);
    wait_for(
        &format!("share {share_id} ENFORCED on the first pod alone"),
        STATUS_TIMEOUT,
        || {
            let s = c.agent_cli(node, &["share", &share_id]);
            if s["phase"] == "ENFORCED" && pods_of(&s) == 1 {
                Ok(())
            } else {
                Err(format!("{s}"))
            }
        },
    );
    assert_in_band(
        &c,
        &ns.name,
        "first",
        &servers[0].1,
        false,
        100e6,
        "the pod left",
    );
}
