use std::collections::BTreeMap;

use shareguard_tests::audit::{AuditLog, Request, by_kind};

use super::*;

/// Most API requests one claim may cost its node's plugin, from its pod's creation to
/// its share released: the binding gate's GET, kubelet's Prepare's GET, the status
/// applies (Admitted and ENFORCED: PREPARING and the sandbox's going wait for the write
/// after them, and the release of a claim made for its pod is left to its
/// deallocation) and the ShareEnforced Event on the pod, with room for two more (an
/// apply of a status that changed twice within the writer's spacing, a retry).
/// docs/kubernetes.md lists them.
const PER_CLAIM_MAX: usize = 7;
/// Most requests a node's plugin may make while nothing of its changes: a watch renewed
/// or a slice LIST, each a few minutes apart.
const AT_REST_MAX: usize = 3;

/// s. What one claim costs the API server, counted by the API server itself (its audit
/// log of shareguard's ServiceAccounts, tests/cluster/audit-policy.yaml): from the pod's
/// creation to its share released and the plugin done with the claim, every
/// request about the claim comes from its own node's plugin (its pod-bound token names
/// the node), at most `PER_CLAIM_MAX` of them; the other node's plugin, at rest all the
/// while, makes at most `AT_REST_MAX`.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn s_the_api_requests_of_one_claim_are_counted_by_the_api_server() {
    let c = Cluster::from_env();
    let audit = AuditLog::from_env();
    let (node, other) = (NODES[0], NODES[1]);
    let mark = audit.mark();
    let ns = c.namespace("e2e-s");
    c.apply(&bandwidth_pod(
        &ns.name,
        "one",
        node,
        "100M",
        ClaimKind::Template,
    ));
    wait_running(&c, &ns.name, "one");
    wait_enforced_status(&c, &ns.name);
    let claim = only_claim(&c, &ns.name);
    let name = field(&claim, "metadata.name")
        .as_str()
        .unwrap_or_default()
        .to_string();
    let share_id = first_share_id(&claim);
    c.ok(&["delete", "pod", "-n", &ns.name, "one", "--wait=true"]);
    // When the agent released the share (its `updatedAt`, RFC 3339 in milliseconds).
    let released = wait_for("the share released", STATUS_TIMEOUT, || {
        let s = c.agent_cli(node, &["share", &share_id]);
        match (s["phase"].as_str(), s["updatedAt"].as_str()) {
            (Some("RELEASED"), Some(at)) => Ok(at.to_string()),
            _ => Err(s.to_string()),
        }
    });
    // The window ends once the plugin had the release in hand: the claim was made from
    // the pod's template, so the plugin leaves its entry to the claim's deallocation
    // and says so, and that was the last request the claim could cost.
    let plugin = c.shareguard_pod(node, "kubelet-plugin");
    wait_for(
        "the plugin to leave the release to the claim's deallocation",
        STATUS_TIMEOUT,
        || {
            let logs = c.ok(&["logs", "-n", "shareguard-system", &plugin]);
            let left = logs.lines().any(|l| {
                l.contains("the release is not written: the claim was made for its pod alone")
                    && l.contains(&name)
            });
            if left {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    );
    let requests = audit.since(mark);
    let about_claim =
        |r: &&Request| r.namespace == ns.name && (r.name == name || r.resource == "events");
    let (mine, rest): (Vec<&Request>, Vec<&Request>) =
        requests.iter().partition(|r| about_claim(r));
    let of_node = |n: &str| -> BTreeMap<String, usize> {
        by_kind(rest.iter().copied().filter(|r| r.node == n))
    };
    eprintln!(
        "s: claim {}/{name}: {} requests {:#?}; meanwhile, about nothing of it: {node} {:?}, {other} {:?}",
        ns.name,
        mine.len(),
        by_kind(mine.iter().copied()),
        of_node(node),
        of_node(other)
    );
    for r in &mine {
        // What a status write said: each condition's type=status/reason.
        let said: Vec<String> = r.body["status"]["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|d| d["conditions"].as_array().cloned().unwrap_or_default())
            .map(|k| {
                format!(
                    "{}={}/{}",
                    str_of(&k["type"]),
                    str_of(&k["status"]),
                    str_of(&k["reason"])
                )
            })
            .collect();
        eprintln!(
            "s:   {} {} {} {} {}",
            r.received,
            r.kind(),
            r.name,
            r.code,
            said.join(" ")
        );
        if let Some(d) = r.body["status"]["devices"].get(0) {
            eprintln!("s:     data {} pool {}", d["data"], d["pool"]);
        }
    }
    let elsewhere: Vec<&&Request> = mine.iter().filter(|r| r.node != node).collect();
    assert!(
        elsewhere.is_empty(),
        "only {node}'s plugin reads or writes a claim allocated there: {elsewhere:#?}"
    );
    let kinds = by_kind(mine.iter().copied());
    assert!(
        kinds.get("get resourceclaims").is_some_and(|n| *n >= 1)
            && kinds
                .get("patch resourceclaims/status")
                .is_some_and(|n| *n >= 2),
        "the claim read, and its status written (admitted, ENFORCED): {kinds:#?}"
    );
    let after_release: Vec<&&Request> = mine
        .iter()
        .filter(|r| {
            r.kind() == "patch resourceclaims/status" && at_or_after(&r.received, &released)
        })
        .collect();
    assert!(
        after_release.is_empty(),
        "no write of the claim's status after its release: {after_release:#?}"
    );
    assert!(
        mine.len() <= PER_CLAIM_MAX,
        "one claim cost {} requests, more than {PER_CLAIM_MAX}: {mine:#?}",
        mine.len()
    );
    let idle: Vec<&&Request> = rest.iter().filter(|r| r.node == other).collect();
    assert!(
        idle.len() <= AT_REST_MAX,
        "{other}'s plugin, with nothing to do, made {} requests: {idle:#?}",
        idle.len()
    );
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// Whether RFC 3339 UTC time `a` (the API server's, in microseconds) is at or after `b`
/// (the agent's, in milliseconds), to the millisecond: both are `YYYY-MM-DDTHH:MM:SS.mmm`
/// in their first 23 characters, which compare as strings.
fn at_or_after(a: &str, b: &str) -> bool {
    let ms = |s: &str| s.get(..23).unwrap_or(s).to_string();
    ms(a) >= ms(b)
}
