use super::*;

/// c. Capacity used on one node leaves the other node's alone (each node its own pool),
/// and a claim that fits on no node leaves its pod Pending with the scheduler's reason.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn c_capacity_is_per_node_and_a_claim_that_fits_nowhere_waits() {
    let c = Cluster::from_env();
    // 6G of each node's 10G: a second 6G fits only on the other node, a third nowhere.
    let first = c.namespace("e2e-c1");
    c.apply(&bandwidth_pod(
        &first.name,
        "big",
        NODES[0],
        "6G",
        ClaimKind::Template,
    ));
    wait_running(&c, &first.name, "big");
    let second = c.namespace("e2e-c2");
    c.apply(&unpinned_bandwidth_pod(&second.name, "big", "6G"));
    let p = wait_running(&c, &second.name, "big");
    assert_eq!(
        field(&p, "spec.nodeName"),
        NODES[1],
        "6G more fits only on the node whose NIC is untouched"
    );
    wait_enforced_status(&c, &second.name);
    let third = c.namespace("e2e-c3");
    c.apply(&unpinned_bandwidth_pod(&third.name, "big", "6G"));
    let why = wait_unschedulable(&c, &third.name, "big");
    assert!(
        why.contains("cannot allocate all claims"),
        "the scheduler says the claim does not fit: {why}"
    );
    let claim = only_claim(&c, &third.name);
    assert!(
        field(&claim, "status.allocation").is_null(),
        "nothing allocated: {claim}"
    );
}
