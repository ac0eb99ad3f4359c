//! Bad input is refused with the gRPC code and the offending field named, the refusal is
//! audited, and nothing changes: ListDevices and ListShares read the same before and after.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{collections::HashMap, fs};

use shareguard_tests::{
    Agent, Options, all_shares, alloc, claim, claim_ref, generic_device, prepare_one, proto as pb,
    share_id,
};

/// Everything a client can see of the agent's state.
async fn state(a: &Agent) -> (pb::ListDevicesResponse, Vec<pb::ShareStatus>) {
    let mut c = a.client().await;
    (
        c.list_devices(pb::ListDevicesRequest {})
            .await
            .unwrap()
            .into_inner(),
        all_shares(&mut c).await,
    )
}

fn refusals_of(a: &Agent, uid: &str) -> Vec<serde_json::Value> {
    a.audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "refuse" && l["claim_uid"] == uid)
        .collect()
}

fn inventory() -> String {
    generic_device("gen-0", "40Gi", "5Gi", &["team-a", "ops"], &["ops"])
}

/// An agent with one live share, so that "nothing changed" is checked against a
/// non-empty state.
async fn agent_with_a_share(opts: Options) -> Agent {
    let a = Agent::start(opts);
    let r = prepare_one(
        &mut a.client().await,
        0,
        claim(
            "existing",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    a
}

struct Case {
    what: &'static str,
    edit: fn(&mut pb::ClaimPrepare),
    code: &'static str,
    field: &'static str,
    /// A fragment the message must contain, so that it says why and not only where.
    says: &'static str,
}

fn memory(c: &mut pb::ClaimPrepare, q: &str) {
    c.allocations[0]
        .consumed_capacity
        .insert("memory".into(), q.into());
}

fn target(c: &mut pb::ClaimPrepare) -> &mut pb::PodTarget {
    c.target.get_or_insert_with(Default::default)
}

const CASES: &[Case] = &[
    Case {
        what: "malformed quantity",
        edit: |c| memory(c, "10Gx"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "10Gx",
    },
    Case {
        what: "negative quantity",
        edit: |c| memory(c, "-5Gi"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "negative",
    },
    Case {
        what: "overflowing quantity",
        edit: |c| memory(c, "1e40"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "out of range",
    },
    Case {
        what: "fractional quantity the policy does not allow",
        edit: |c| memory(c, "5.5Gi"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "policy",
    },
    Case {
        what: "amount off the policy's step",
        edit: |c| memory(c, "7Gi"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "policy",
    },
    Case {
        what: "amount above the policy's max",
        edit: |c| memory(c, "45Gi"),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "policy",
    },
    Case {
        what: "amount the scheduler's policy snapshot does not allow",
        edit: |c| {
            c.allocations[0].policy.insert(
                "memory".into(),
                pb::CapacityPolicy {
                    default: "10Gi".into(),
                    valid_values: vec!["10Gi".into()],
                    valid_range: None,
                },
            );
        },
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[memory]",
        says: "snapshot",
    },
    Case {
        what: "uppercase shareID",
        edit: |c| c.allocations[0].share_id = c.allocations[0].share_id.to_uppercase(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].share_id",
        says: "lowercase",
    },
    Case {
        what: "malformed shareID",
        edit: |c| c.allocations[0].share_id = "not-a-uuid".into(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].share_id",
        says: "not-a-uuid",
    },
    Case {
        what: "shareID that is a UUID but not version 4",
        edit: |c| c.allocations[0].share_id = "3f1c2a4e-8b7d-1c1e-9a2b-0d1e2f3a4b5c".into(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].share_id",
        says: "UUIDv4",
    },
    Case {
        what: "one shareID twice in a claim",
        edit: |c| {
            let dup = c.allocations[0].clone();
            c.allocations.push(dup);
        },
        code: "InvalidArgument",
        field: "claims[0].allocations[1].share_id",
        says: "twice",
    },
    Case {
        what: "unknown device",
        edit: |c| c.allocations[0].device = "gen-9".into(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].device",
        says: "gen-9",
    },
    Case {
        what: "device of another pool",
        edit: |c| c.allocations[0].pool = "node-b".into(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].device",
        says: "node-b",
    },
    Case {
        what: "capacity the device lacks",
        edit: |c| {
            c.allocations[0]
                .consumed_capacity
                .insert("bandwidth".into(), "1G".into());
        },
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity[bandwidth]",
        says: "bandwidth",
    },
    Case {
        what: "a capacity of the device left out",
        edit: |c| c.allocations[0].consumed_capacity.clear(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity",
        says: "memory",
    },
    Case {
        what: "dedicated allocation with amounts",
        edit: |c| c.allocations[0].share_id.clear(),
        code: "InvalidArgument",
        field: "claims[0].allocations[0].consumed_capacity",
        says: "dedicated",
    },
    Case {
        what: "no allocations",
        edit: |c| c.allocations.clear(),
        code: "InvalidArgument",
        field: "claims[0].allocations",
        says: "required",
    },
    Case {
        what: "empty allocation id",
        edit: |c| c.allocation_id.clear(),
        code: "InvalidArgument",
        field: "claims[0].allocation_id",
        says: "required",
    },
    Case {
        what: "namespace that is not a namespace name",
        edit: |c| c.claim.as_mut().unwrap().namespace = "Team-A".into(),
        code: "InvalidArgument",
        field: "claims[0].claim.namespace",
        says: "Team-A",
    },
    Case {
        what: "namespace not allowed on the device",
        edit: |c| c.claim.as_mut().unwrap().namespace = "team-z".into(),
        code: "PermissionDenied",
        field: "claims[0].claim.namespace",
        says: "team-z",
    },
    Case {
        what: "adminAccess outside the admin namespaces",
        edit: |c| c.allocations[0].admin_access = true,
        code: "PermissionDenied",
        field: "claims[0].allocations[0].admin_access",
        says: "admin",
    },
    Case {
        what: "path traversal in a cgroup path",
        edit: |c| target(c).cgroup_paths = vec!["/kubepods.slice/../../../etc".into()],
        code: "InvalidArgument",
        field: "claims[0].target.cgroup_paths[0]",
        says: "traversal",
    },
    Case {
        what: "'.' component in a later cgroup path",
        edit: |c| {
            target(c).cgroup_paths = vec![
                "/kubepods.slice/pod-a.slice".into(),
                "/kubepods.slice/./x".into(),
            ]
        },
        code: "InvalidArgument",
        field: "claims[0].target.cgroup_paths[1]",
        says: "traversal",
    },
    Case {
        what: "path traversal in the netns path",
        edit: |c| target(c).netns_path = "/var/run/netns/../../etc/passwd".into(),
        code: "InvalidArgument",
        field: "claims[0].target.netns_path",
        says: "traversal",
    },
    Case {
        what: "netns path outside the netns directories",
        edit: |c| target(c).netns_path = "/etc/passwd".into(),
        code: "InvalidArgument",
        field: "claims[0].target.netns_path",
        says: "/run/netns/",
    },
    Case {
        what: "netns of a process named by a symbol, not a pid",
        edit: |c| target(c).netns_path = "/proc/self/ns/net".into(),
        code: "InvalidArgument",
        field: "claims[0].target.netns_path",
        says: "/proc/self/ns/net",
    },
    Case {
        what: "pod uid that is not a UUID",
        edit: |c| target(c).pod_uids = vec!["pod-a".into()],
        code: "InvalidArgument",
        field: "claims[0].target.pod_uids[0]",
        says: "not a pod uid",
    },
    Case {
        what: "pod uid named twice",
        edit: |c| {
            target(c).pod_uids = vec![
                "0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88".into(),
                "0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88".into(),
            ]
        },
        code: "InvalidArgument",
        field: "claims[0].target.pod_uids[1]",
        says: "twice",
    },
    Case {
        what: "claim uid with a dot (it names the claim's CDI spec)",
        edit: |c| c.claim.as_mut().unwrap().uid = "bad.uid".into(),
        code: "InvalidArgument",
        field: "claims[0].claim.uid",
        says: "only letters",
    },
    Case {
        what: "cgroup hint for a pod with no sandbox on the node",
        edit: |c| {
            let t = target(c);
            t.pod_uids = vec!["0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88".into()];
            t.cgroup_paths = vec![
                "/kubepods.slice/kubepods-pod0d6f2b5e_7d4e_4a64_8a1b_3c2d1e0f9a88.slice".into(),
            ];
        },
        code: "PermissionDenied",
        field: "claims[0].target.cgroup_paths[0]",
        says: "cannot be verified",
    },
];

#[tokio::test]
async fn bad_claims_are_refused_naming_the_field_and_change_nothing() {
    let a = agent_with_a_share(Options::new(inventory())).await;
    let mut c = a.client().await;
    let before = state(&a).await;
    for (i, case) in CASES.iter().enumerate() {
        let uid = format!("bad-{i}");
        let mut cl = claim(
            &uid,
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        );
        (case.edit)(&mut cl);
        let tenant = cl.claim.as_ref().unwrap().namespace.clone();
        // An edit may change the uid itself.
        let uid = cl.claim.as_ref().unwrap().uid.clone();
        let r = prepare_one(&mut c, 0, cl).await;
        let what = case.what;
        let e = r
            .error
            .clone()
            .unwrap_or_else(|| panic!("{what}: admitted: {r:?}"));
        assert_eq!(
            (e.code.as_str(), e.field.as_str()),
            (case.code, case.field),
            "{what}: {e:?}"
        );
        assert!(
            e.message.contains(case.says),
            "{what}: the message should say {:?}: {e:?}",
            case.says
        );
        assert!(
            !e.retryable,
            "{what}: bad input stays bad on a retry: {e:?}"
        );
        assert!(r.shares.is_empty(), "{what}: {r:?}");
        assert_eq!(
            state(&a).await,
            before,
            "{what}: the refusal changed the agent's state"
        );
        let audited = refusals_of(&a, &uid);
        assert!(
            !audited.is_empty(),
            "{what}: no refuse line in the audit log"
        );
        assert!(
            audited
                .iter()
                .all(|l| l["code"] == case.code && l["tenant"] == tenant.as_str()),
            "{what}: {audited:?}"
        );
    }
}

#[tokio::test]
async fn one_bad_claim_does_not_spoil_the_rest_of_its_batch() {
    let a = Agent::start(Options::new(inventory()));
    let mut c = a.client().await;
    let good = share_id();
    let r = c
        .prepare(pb::PrepareRequest {
            epoch: 0,
            claims: vec![
                claim(
                    "batch-bad",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-0", &share_id(), "7Gi")],
                ),
                claim(
                    "batch-good",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-0", &good, "5Gi")],
                ),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.claims["batch-bad"]
            .error
            .as_ref()
            .map(|e| e.code.as_str()),
        Some("InvalidArgument")
    );
    assert_eq!(r.claims["batch-good"].error, None, "{r:?}");
    let shares = all_shares(&mut c).await;
    assert_eq!(
        shares
            .iter()
            .map(|s| s.share_id.as_str())
            .collect::<Vec<_>>(),
        [good.as_str()]
    );
}

#[tokio::test]
async fn batch_over_the_limit_is_refused_whole() {
    let mut opts = Options::new(inventory());
    opts.agent_extra = "max_claims_per_request = 2".into();
    let a = agent_with_a_share(opts).await;
    let mut c = a.client().await;
    let before = state(&a).await;
    let claims: Vec<pb::ClaimPrepare> = (0..3)
        .map(|i| {
            claim(
                &format!("over-{i}"),
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &share_id(), "5Gi")],
            )
        })
        .collect();
    // A higher epoch than any accepted: a refused request must not move the fence either.
    let e = c
        .prepare(pb::PrepareRequest { epoch: 9, claims })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("claims") && e.message().contains('2'),
        "the message should name the field and the limit: {e:?}"
    );

    let refs: Vec<pb::ClaimRef> = ["existing", "b", "c"]
        .iter()
        .map(|u| claim_ref(u))
        .collect();
    let e = c
        .unprepare(pb::UnprepareRequest {
            epoch: 9,
            claims: refs,
            only_pre_bind: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(
        state(&a).await,
        before,
        "a refused batch changed the agent's state"
    );

    // I7: every decision is audited, a refusal of a whole request included.
    let audited: Vec<serde_json::Value> = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "refuse")
        .collect();
    assert!(
        audited.iter().any(|l| l["code"] == "InvalidArgument"),
        "the refused batch left no refuse line in the audit log: {audited:?}"
    );
}

#[tokio::test]
async fn caller_not_in_allowed_uids_is_refused_and_changes_nothing() {
    let mut a = agent_with_a_share(Options::new(inventory())).await;
    let before = state(&a).await;
    // The tests run as root: allowing only another uid shuts the test's own calls out.
    let text = fs::read_to_string(&a.config).unwrap();
    let locked = text.replace(
        "allowed_uids = [0]",
        "allowed_uids = [4242]\nsocket_group = 4242",
    );
    assert_ne!(locked, text, "the harness's config layout changed");
    fs::write(&a.config, &locked).unwrap();
    a.restart();

    let mut c = a.client().await;
    let cl = claim(
        "intruder",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &share_id(), "5Gi")],
    );
    let e = c
        .prepare(pb::PrepareRequest {
            epoch: 9,
            claims: vec![cl],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("uid 0"),
        "the message should name the caller: {e:?}"
    );
    let e = c
        .unprepare(pb::UnprepareRequest {
            epoch: 9,
            claims: vec![claim_ref("existing")],
            only_pre_bind: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    // Reads are refused too: the share inventory is not for every local user.
    let e = c
        .list_shares(pb::ListSharesRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let audit = a.audit_lines();

    fs::write(&a.config, &text).unwrap();
    a.restart();
    assert_eq!(
        state(&a).await,
        before,
        "a refused caller changed the agent's state"
    );
    let refused: Vec<&serde_json::Value> =
        audit.iter().filter(|l| l["decision"] == "refuse").collect();
    assert!(
        refused
            .iter()
            .any(|l| l["code"] == "PermissionDenied" && l["caller_uid"] == 0),
        "the refused caller left no refuse line in the audit log: {refused:?}"
    );
}

#[tokio::test]
async fn unprepare_of_a_malformed_uid_is_refused_per_claim() {
    let a = agent_with_a_share(Options::new(inventory())).await;
    let mut c = a.client().await;
    let before = state(&a).await;
    let r = c
        .unprepare(pb::UnprepareRequest {
            epoch: 0,
            claims: vec![claim_ref("bad/uid"), claim_ref("")],
            only_pre_bind: false,
        })
        .await
        .unwrap()
        .into_inner();
    let fields: HashMap<&str, (&str, &str)> = r
        .claims
        .iter()
        .map(|(k, e)| (k.as_str(), (e.code.as_str(), e.field.as_str())))
        .collect();
    assert_eq!(
        fields["bad/uid"],
        ("InvalidArgument", "claims[0].uid"),
        "{r:?}"
    );
    assert_eq!(
        fields["claims[1]"],
        ("InvalidArgument", "claims[1].uid"),
        "{r:?}"
    );
    assert_eq!(state(&a).await, before);
    // I7: a refused Unprepare is a decision like a refused Prepare.
    let refused = refusals_of(&a, "bad/uid");
    assert!(
        refused.iter().any(|l| l["code"] == "InvalidArgument"),
        "the refused Unprepare left no refuse line in the audit log: {:?}",
        a.audit_lines()
    );
}

/// Claims with no ClaimRef (or an empty uid) used to be answered under one key `""`, so
/// all but one refusal vanished from the answer. Each is refused under its index.
#[tokio::test]
async fn claims_without_a_uid_are_refused_one_by_one() {
    let a = Agent::start(Options::new(inventory()));
    let before = state(&a).await;
    let mut c = a.client().await;
    let mut no_ref = claim(
        "x",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &share_id(), "5Gi")],
    );
    no_ref.claim = None;
    let mut empty_uid = claim(
        "",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &share_id(), "5Gi")],
    );
    empty_uid.claim.as_mut().unwrap().uid.clear();
    let good = claim(
        "named",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &share_id(), "5Gi")],
    );
    let r = c
        .prepare(pb::PrepareRequest {
            epoch: 0,
            claims: vec![no_ref, good, empty_uid],
        })
        .await
        .unwrap()
        .into_inner();
    let mut keys: Vec<&str> = r.claims.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["claims[0]", "claims[2]", "named"], "{r:?}");
    for k in ["claims[0]", "claims[2]"] {
        let e = r.claims[k].error.as_ref().expect("refused");
        assert_eq!(e.code, "InvalidArgument", "{e:?}");
        assert!(e.field.starts_with(k), "{e:?}");
    }
    assert_eq!(r.claims["named"].error, None);
    c.unprepare(pb::UnprepareRequest {
        epoch: 0,
        claims: vec![claim_ref("named")],
        only_pre_bind: false,
    })
    .await
    .unwrap();

    let r = c
        .unprepare(pb::UnprepareRequest {
            epoch: 0,
            claims: vec![claim_ref(""), claim_ref("")],
            only_pre_bind: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut keys: Vec<&str> = r.claims.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["claims[0]", "claims[1]"], "{r:?}");
    assert!(
        r.claims.values().all(|e| e.code == "InvalidArgument"),
        "{r:?}"
    );
    let after = state(&a).await;
    assert_eq!(after.0.devices, before.0.devices, "the ledger is as before");
}
