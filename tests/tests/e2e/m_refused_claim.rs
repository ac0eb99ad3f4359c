use super::*;

/// Waits until the claim and the pod `client` of `ns` both have an Event of `reason`.
fn wait_events_on_both(
    c: &Cluster,
    ns: &str,
    reason: &str,
) -> Vec<(String, String, String, String, String)> {
    wait_for(
        &format!("{reason} events on the claim and the pod in {ns}"),
        STATUS_TIMEOUT,
        || {
            let all = events(c, ns);
            let of: Vec<_> = all.iter().filter(|e| e.3 == reason).cloned().collect();
            let on = |kind: &str| of.iter().any(|e| e.0 == kind && e.1 == "client");
            if on("ResourceClaim") && on("Pod") {
                Ok(of)
            } else {
                Err(format!("{all:?}"))
            }
        },
    )
}

/// Releases a claim prepared on the agent directly, also when the scenario fails.
struct Filler<'a> {
    c: &'a Cluster,
    node: &'a str,
    uid: String,
    released: bool,
}

impl Filler<'_> {
    fn release(&mut self) {
        if !self.released {
            self.released = true;
            self.c.agent_cli(self.node, &["release", &self.uid]);
        }
    }
}

impl Drop for Filler<'_> {
    fn drop(&mut self) {
        if !self.released {
            self.released = true;
            // Best effort: the scenario has failed already when this releases.
            let _ = self
                .c
                .agent_cli_with(self.node, &["release", &self.uid], None);
        }
    }
}

/// m. A claim the node refuses, as a scheduler that counted capacity twice would leave
/// it: the node's ledger is filled behind the scheduler's back (a claim prepared on the
/// agent directly), so the scheduler's allocation of a pod's claim does not fit. The
/// binding gate refuses it before the pod is bound: the pod stays Pending, unbound
/// (never in ContainerCreating on a node that will not run it), the scheduler tries
/// again, and the claim and the pod get a Warning Event that says why, each retry
/// counted in that Event's series. Once the capacity is released a retry is admitted,
/// and a Normal Event says the share was enforced after waiting for the pod's sandbox.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn m_a_claim_the_node_refuses_is_told_in_events() {
    let c = Cluster::from_env();
    let node = NODES[1];
    let devices = c.agent_cli(node, &["devices"]);
    // proto3 JSON writes a uint64 as a string.
    let epoch: u64 = match &devices["epoch"] {
        Value::String(s) => s.parse().unwrap_or(0),
        v => v.as_u64().unwrap_or(0),
    };
    let free = 10_000_000_000 - allocated_bandwidth(&c, node);
    assert!(free >= 100_000_000, "{node} has only {free} bit/s free");
    let uid = format!("e2e-m-filler-{}", std::process::id());
    let req = shareguard_tests::proto::PrepareRequest {
        epoch,
        claims: vec![shareguard_tests::proto::ClaimPrepare {
            claim: Some(shareguard_tests::proto::ClaimRef {
                uid: uid.clone(),
                namespace: "e2e-m-filler".into(),
                name: "filler".into(),
            }),
            allocation_id: "a1".into(),
            // A pod that never comes: the share waits for it, capacity held.
            target: Some(shareguard_tests::proto::PodTarget {
                pod_uids: vec![shareguard_tests::share_id()],
                ..Default::default()
            }),
            allocations: vec![shareguard_tests::proto::DeviceAllocation {
                request: "net".into(),
                driver: DRIVER.into(),
                pool: node.into(),
                device: "nic-0".into(),
                share_id: shareguard_tests::share_id(),
                consumed_capacity: [("bandwidth".to_string(), format!("{}M", free / 1_000_000))]
                    .into_iter()
                    .collect(),
                ..Default::default()
            }],
            pre_bind: false,
        }],
    };
    let mut filler = Filler {
        c: &c,
        node,
        uid: uid.clone(),
        released: false,
    };
    let out = c.agent_cli_with(
        node,
        &["prepare", "--file", "-"],
        Some(&serde_json::to_string(&req).unwrap()),
    );
    assert!(
        out.status.success(),
        "prepare on the agent: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        allocated_bandwidth(&c, node),
        10_000_000_000,
        "the node is full"
    );

    let ns = c.namespace("e2e-m");
    c.apply(&bandwidth_pod(
        &ns.name,
        "client",
        node,
        "100M",
        ClaimKind::Standalone,
    ));
    let warned = wait_events_on_both(&c, &ns.name, "CapacityExceeded");
    for e in &warned {
        assert_eq!(e.2, "Warning", "{e:?}");
        assert!(
            e.4.contains(&format!("{DRIVER} on node {node} refused the claim"))
                && e.4.contains("ResourceExhausted"),
            "{e:?}"
        );
    }
    // kubectl's own view of the pod's events (core/v1) shows it too.
    let described = c.ok(&["describe", "pod", "-n", &ns.name, "client"]);
    assert!(described.contains("CapacityExceeded"), "{described}");
    let p = c.json(&["get", "pod", "-n", &ns.name, "client"]);
    assert_ne!(field(&p, "status.phase"), "Running", "{p}");
    assert!(
        field(&p, "spec.nodeName").as_str().unwrap_or("").is_empty(),
        "a pod whose share the node refused is not bound there: {p}"
    );

    filler.release();
    wait_running(&c, &ns.name, "client");
    // The share may also be told enforced again later (a repair of drift was seen on
    // this cluster right after the pod started): the one after the wait must be there
    // on the pod (the claim's status says it; no Event on the claim), and every one
    // says what was read back.
    let enforced = wait_for(
        &format!("ShareEnforced after the wait on the pod in {}", ns.name),
        STATUS_TIMEOUT,
        || {
            let all = events(&c, &ns.name);
            let waited = |kind: &str| {
                all.iter().any(|e| {
                    e.0 == kind
                        && e.3 == "ShareEnforced"
                        && e.4.contains("after waiting for the pod's sandbox")
                })
            };
            if waited("Pod") {
                Ok(all)
            } else {
                Err(format!("{all:?}"))
            }
        },
    );
    for e in enforced.iter().filter(|e| e.3 == "ShareEnforced") {
        assert_eq!(e.2, "Normal", "{e:?}");
        assert_eq!(e.0, "Pod", "a ShareEnforced goes on the pod alone: {e:?}");
        assert!(
            e.4.contains("bandwidth 100M enforced and read back"),
            "{e:?}"
        );
    }
    c.ok(&["delete", "pod", "-n", &ns.name, "client", "--wait=true"]);
}
