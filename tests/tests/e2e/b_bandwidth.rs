use super::*;

/// b. Pods in two namespaces asking 200M (from a claim template) and 100M (a claim of
/// its own) of one node's NIC are scheduled with shareIDs, iperf3 in each measures its
/// limit in both directions, and each claim shows Enforced with the amount read back,
/// written by the plugin under the real authorization.
/// e. The second pod deleted: kubelet unprepares, the share is released, its status
/// entry leaves the claim (which outlives the pod) and the ledger gets the capacity back.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn b_e_pods_get_their_bandwidth_both_ways_and_give_it_back() {
    let c = Cluster::from_env();
    let node = NODES[0];
    let (_server_ns, server) = iperf_server(&c, node);
    let allocated_before = allocated_bandwidth(&c, node);
    let tenants: Vec<(Namespace, &str, f64)> = [
        ("e2e-a", "200M", 200e6, ClaimKind::Template),
        ("e2e-b", "100M", 100e6, ClaimKind::Standalone),
    ]
    .into_iter()
    .map(|(prefix, amount, bits, kind)| {
        let ns = c.namespace(prefix);
        c.apply(&bandwidth_pod(&ns.name, "client", node, amount, kind));
        (ns, amount, bits)
    })
    .collect();

    for (ns, amount, bits) in &tenants {
        let pod = wait_running(&c, &ns.name, "client");
        assert_eq!(field(&pod, "spec.nodeName"), node);
        let claim = only_claim(&c, &ns.name);
        let results = field(&claim, "status.allocation.devices.results")
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(results.len(), 1, "{claim}");
        let share_id = results[0]["shareID"]
            .as_str()
            .unwrap_or_else(|| panic!("the scheduler gave no shareID: {claim}"))
            .to_string();
        assert_eq!(results[0]["pool"], node, "{claim}");
        assert_eq!(
            results[0]["consumedCapacity"]["bandwidth"], *amount,
            "{claim}"
        );

        let entry = wait_enforced_status(&c, &ns.name);
        assert_eq!(entry["shareID"], share_id.as_str(), "{entry}");
        assert_eq!(entry["pool"], node, "{entry}");
        assert_eq!(
            field(&entry, "data.requested.bandwidth"),
            *amount,
            "{entry}"
        );
        assert_eq!(field(&entry, "data.enforced.bandwidth"), *amount, "{entry}");
        // Written by the plugin with the driver as field manager: the granular status
        // authorization (on in 1.36) let it through.
        assert!(
            status_managers(&c, &ns.name, &claim).contains(&DRIVER.to_string()),
            "status written by {DRIVER}"
        );

        let _lock = TrafficLock::acquire();
        for reverse in [false, true] {
            assert_in_band(&c, &ns.name, "client", &server, reverse, *bits, amount);
        }
    }
    let allocated_all = allocated_bandwidth(&c, node);
    assert_eq!(
        allocated_all,
        allocated_before + 300_000_000,
        "the ledger holds both shares"
    );

    // e. The second tenant's pod goes; its claim stays.
    let (ns, amount, _) = &tenants[1];
    let claim = only_claim(&c, &ns.name);
    let claim_name = field(&claim, "metadata.name")
        .as_str()
        .unwrap_or_default()
        .to_string();
    let share_id = first_share_id(&claim);
    c.ok(&["delete", "pod", "-n", &ns.name, "client", "--wait=true"]);
    wait_for(
        &format!("share {share_id} ({amount}) released on {node}"),
        STATUS_TIMEOUT,
        || {
            let s = c.agent_cli(node, &["share", &share_id]);
            if s["phase"] == "RELEASED" {
                Ok(())
            } else {
                Err(format!("{s}"))
            }
        },
    );
    assert_eq!(
        allocated_bandwidth(&c, node),
        allocated_before + 200_000_000,
        "the ledger freed the released share's 100M, once"
    );
    wait_for(
        &format!("the status entry of {share_id} gone from claim {claim_name}"),
        STATUS_TIMEOUT,
        || {
            let claim = c
                .get(&["resourceclaim", "-n", &ns.name, &claim_name])
                .ok_or_else(|| "the claim is gone, but it has no owner".to_string())?;
            let ours = field(&claim, "status.devices")
                .as_array()
                .into_iter()
                .flatten()
                .any(|d| d["driver"] == DRIVER);
            if ours {
                Err(format!("{}", field(&claim, "status")))
            } else {
                Ok(())
            }
        },
    );
}

/// The field managers that wrote the claim's status subresource.
fn status_managers(c: &Cluster, ns: &str, claim: &Value) -> Vec<String> {
    let name = field(claim, "metadata.name").as_str().unwrap_or_default();
    let managed = c.json(&[
        "get",
        "resourceclaim",
        "-n",
        ns,
        name,
        "--show-managed-fields",
    ]);
    field(&managed, "metadata.managedFields")
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["subresource"] == "status")
        .filter_map(|m| m["manager"].as_str().map(str::to_string))
        .collect()
}
