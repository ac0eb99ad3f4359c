//! Writes the binary seeds of the committed corpus: encoded `ClaimPrepare` messages
//! (fuzz/corpus/claim_prepare) and encoded store records (fuzz/corpus/record). Text seeds
//! (quantities, configs) are plain files kept by hand.
//!
//! Run once, and again when the API or the records change, from the repository root:
//!
//! ```sh
//! CARGO_TARGET_DIR=target cargo run --manifest-path fuzz/Cargo.toml --example seed_corpus
//! ```
//!
//! Each seed is checked as it is written: the valid ones pass validation (or decode) and
//! the near-valid ones fail for the reason they were made for, so the corpus starts at
//! both sides of every check instead of at random bytes.

use std::{collections::BTreeMap, fs, path::Path};

use prost::Message;
use shareguard::{
    error::ClaimError,
    record::{
        self, ClaimId, ClaimRecord, Phase, SandboxRecord, ShareRecord, TargetHints, TargetRecord,
    },
    validate::{authorize, validate_claim},
};
use shareguard_common::Quantity;
use shareguard_fuzz::{DRIVER, POOL, inventory};
use shareguard_proto::v1 as pb;

const POD: &str = "0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88";
const SHARE_A: &str = "3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c";
const SHARE_B: &str = "7a0e9c41-2b3d-4e5f-8a6b-1c2d3e4f5a6b";

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    claim_prepare_seeds(&root.join("claim_prepare"));
    record_seeds(&root.join("record"));
}

fn claim(uid: &str, namespace: &str, allocations: Vec<pb::DeviceAllocation>) -> pb::ClaimPrepare {
    pb::ClaimPrepare {
        claim: Some(pb::ClaimRef {
            uid: uid.into(),
            namespace: namespace.into(),
            name: format!("{uid}-claim"),
        }),
        allocation_id: "alloc-1".into(),
        target: Some(pb::PodTarget {
            pod_uids: vec![POD.into()],
            ..Default::default()
        }),
        allocations,
        pre_bind: false,
    }
}

fn alloc(
    device: &str,
    pool: &str,
    share_id: &str,
    amounts: &[(&str, &str)],
) -> pb::DeviceAllocation {
    pb::DeviceAllocation {
        request: "req-0".into(),
        driver: DRIVER.into(),
        pool: pool.into(),
        device: device.into(),
        share_id: share_id.into(),
        consumed_capacity: amounts
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        policy_version: "v1".into(),
        ..Default::default()
    }
}

fn claim_prepare_seeds(dir: &Path) {
    let gen_amounts = [("memory", "10Gi"), ("example.com/slots", "2")];
    let mut seeds: Vec<(&str, pb::ClaimPrepare, Result<(), &str>)> = Vec::new();

    seeds.push((
        "generic-share",
        claim(
            "claim-1",
            "team-a",
            vec![alloc("gen-0", POOL, SHARE_A, &gen_amounts)],
        ),
        Ok(()),
    ));
    let mut net = claim(
        "claim-2",
        "team-c",
        vec![alloc(
            "nic-0",
            POOL,
            SHARE_A,
            &[("egressBandwidth", "100M"), ("ingressBandwidth", "1.5G")],
        )],
    );
    net.target = Some(pb::PodTarget {
        pod_uids: vec![POD.into()],
        cgroup_paths: vec![format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
            POD.replace('-', "_")
        )],
        netns_path: "/var/run/netns/cni-1234".into(),
        interface: "eth0".into(),
    });
    seeds.push(("net-share-with-hints", net, Ok(())));
    let mut gpu = alloc("gpu-0", "node-a/gpus", SHARE_A, &[("memory", "10Gi")]);
    gpu.policy.insert(
        "memory".into(),
        pb::CapacityPolicy {
            default: "1Gi".into(),
            valid_range: Some(pb::ValidRange {
                min: "1Gi".into(),
                max: "80Gi".into(),
                step: "1Gi".into(),
            }),
            ..Default::default()
        },
    );
    seeds.push((
        "gpu-share-with-policy",
        claim("claim-3", "team-a", vec![gpu]),
        Ok(()),
    ));
    let mut admin = alloc("gen-0", POOL, "", &[]);
    admin.admin_access = true;
    seeds.push((
        "dedicated-admin",
        claim("claim-4", "ops", vec![admin]),
        Ok(()),
    ));
    seeds.push((
        "two-shares",
        claim(
            "claim-5",
            "team-b",
            vec![
                alloc("gen-0", POOL, SHARE_A, &gen_amounts),
                alloc(
                    "gen-0",
                    POOL,
                    SHARE_B,
                    &[("memory", "40Gi"), ("example.com/slots", "4")],
                ),
            ],
        ),
        Ok(()),
    ));

    // Near misses, one check each.
    seeds.push((
        "amount-off-policy",
        claim(
            "claim-6",
            "team-a",
            vec![alloc(
                "gen-0",
                POOL,
                SHARE_A,
                &[("memory", "7Gi"), ("example.com/slots", "3")],
            )],
        ),
        Err("not allowed by device gen-0's policy"),
    ));
    seeds.push((
        "share-id-not-v4",
        claim(
            "claim-7",
            "team-a",
            vec![alloc(
                "gen-0",
                POOL,
                "3f1c2a4e-8b7d-1c1e-9a2b-0d1e2f3a4b5c",
                &gen_amounts,
            )],
        ),
        Err("UUIDv4"),
    ));
    seeds.push((
        "namespace-denied",
        claim(
            "claim-8",
            "team-c",
            vec![alloc("gpu-0", "node-a/gpus", SHARE_A, &[("memory", "1Gi")])],
        ),
        Err("may not use device gpu-0"),
    ));
    let mut no_pod = claim("claim-9", "team-a", vec![alloc("nic-0", POOL, "", &[])]);
    no_pod.target = None;
    seeds.push(("net-without-pod", no_pod, Err("finds the pod's sandbox")));
    let mut traversal = claim(
        "claim-10",
        "team-a",
        vec![alloc("gen-0", POOL, SHARE_A, &gen_amounts)],
    );
    traversal.target = Some(pb::PodTarget {
        pod_uids: vec![POD.into()],
        netns_path: "/run/netns/../../etc".into(),
        ..Default::default()
    });
    seeds.push(("netns-traversal", traversal, Err("netns_path")));

    let cfg = inventory();
    fs::create_dir_all(dir).expect("create the corpus directory");
    for (name, msg, want) in seeds {
        let got = validate_claim(cfg, 0, &msg.clone().into()).and_then(|v| authorize(cfg, &v));
        match (&got, want) {
            (Ok(()), Ok(())) => {}
            (Err(e), Err(says)) if e.to_string().contains(says) => {}
            _ => panic!("seed {name}: wanted {want:?}, validation says {got:?}"),
        }
        let path = dir.join(format!("seed-{name}"));
        // prost writes map entries in HashMap order, which differs between runs; a file
        // that already decodes to the same message is left alone, so a rerun changes nothing.
        let same = fs::read(&path)
            .ok()
            .and_then(|b| pb::ClaimPrepare::decode(b.as_slice()).ok())
            .is_some_and(|old| old == msg);
        if !same {
            fs::write(&path, msg.encode_to_vec()).expect("write a seed");
        }
    }
}

fn q(s: &str) -> Quantity {
    Quantity::parse(s).expect("seed quantities are valid")
}

fn record_seeds(dir: &Path) {
    let claim = ClaimId {
        uid: "claim-1".into(),
        namespace: "team-a".into(),
        name: "claim-1-claim".into(),
    };
    let accounted = ShareRecord {
        key: SHARE_A.into(),
        shared: true,
        claim: claim.clone(),
        allocation_id: "alloc-1".into(),
        request: "req-0".into(),
        driver: DRIVER.into(),
        pool: POOL.into(),
        device: "gen-0".into(),
        consumed: BTreeMap::from([
            ("memory".into(), q("10Gi")),
            ("example.com/slots".into(), q("2")),
        ])
        .into(),
        policy_version: "v1".into(),
        admin_access: false,
        target: TargetRecord::new(vec![POD.into()], TargetHints::default()),
        phase: Phase::Accounted,
        mechanism: "accounting".into(),
        enforced: Default::default(),
        reason: "accounted (not enforced): the device has no enforcement mechanism".into(),
        error: None,
        epoch: 3,
        created_at_ms: 1_700_000_000_000,
        updated_at_ms: 1_700_000_000_000,
        released_at_ms: None,
        sandbox: None,
        more_sandboxes: None,
        device_kind: "generic".into(),
        condition_since_ms: 1_700_000_000_000,
        quarantined: false,
        rolling_back: false,
        pre_bind: false,
    };
    let enforced = ShareRecord {
        key: SHARE_B.into(),
        shared: true,
        device: "nic-0".into(),
        consumed: BTreeMap::from([
            ("egressBandwidth".into(), q("100M")),
            ("ingressBandwidth".into(), q("1.5G")),
        ])
        .into(),
        target: TargetRecord::new(
            vec![POD.into()],
            TargetHints {
                cgroup_paths: vec!["/kubepods.slice/pod.slice".into()],
                netns_inode: Some(4_026_532_000),
                interface: Some("eth0".into()),
            },
        ),
        phase: Phase::Enforced,
        mechanism: "edt-fq".into(),
        enforced: BTreeMap::from([
            ("egressBandwidth".into(), q("100M")),
            ("ingressBandwidth".into(), q("1500M")),
        ])
        .into(),
        reason: "enforced".into(),
        sandbox: Some(Box::new(SandboxRecord {
            pod_uid: POD.into(),
            cgroup: "/kubepods.slice/pod.slice".into(),
            cgroup_inode: 12345,
            cgroups: vec!["/kubepods.slice/pod.slice".into()],
            netns_inode: Some(4_026_532_000),
            host_ifindex: Some(7),
            host_ifname: Some("veth1a2b3c".into()),
        })),
        device_kind: "net".into(),
        ..accounted.clone()
    };
    let failed = ShareRecord {
        key: "dedicated/claim-1/gpu-0".into(),
        shared: false,
        device: "gpu-0".into(),
        consumed: Default::default(),
        admin_access: true,
        phase: Phase::Failed,
        mechanism: Default::default(),
        reason: "refused".into(),
        error: Some(Box::new(ClaimError::invalid(
            "claims[0].allocations[0]",
            "no such thing",
        ))),
        released_at_ms: std::num::NonZeroU64::new(1_700_000_100_000),
        device_kind: "gpu".into(),
        ..accounted.clone()
    };
    let claim_record = ClaimRecord {
        claim,
        allocation_id: "alloc-1".into(),
        share_keys: [SHARE_A.into(), SHARE_B.into()].into_iter().collect(),
        cdi_device_ids: Box::new([format!("{DRIVER}/gpu=gpu-0-{SHARE_A}")]),
        updated_at_ms: 1_700_000_000_000,
    };

    let mut seeds: Vec<(&str, Vec<u8>)> = vec![
        ("share-accounted", record::encode_share(&accounted)),
        ("share-enforced", record::encode_share(&enforced)),
        ("share-failed-dedicated", record::encode_share(&failed)),
        // As releases before format 2 wrote shares.
        ("share-format-1", record::encode(&accounted)),
        ("claim", record::encode(&claim_record)),
    ];
    // A record as agents wrote it before pods were discovered: one `pod_uid` and a
    // `netns_path`, which decoding still accepts.
    let mut legacy = serde_json::to_value(&accounted).expect("records serialize");
    legacy["target"] = serde_json::json!({"pod_uid": POD, "netns_path": "/var/run/netns/x"});
    let mut bytes = vec![record::FORMAT_V1];
    bytes.extend(serde_json::to_vec(&legacy).expect("records serialize"));
    seeds.push(("share-legacy-target", bytes));
    // A format this agent does not know, refused rather than misread.
    let mut future = record::encode(&claim_record);
    future[0] = 3;
    seeds.push(("claim-format-3", future));

    fs::create_dir_all(dir).expect("create the corpus directory");
    for (name, bytes) in seeds {
        let decodes = record::decode::<ShareRecord>(&bytes).is_ok()
            || record::decode::<ClaimRecord>(&bytes).is_ok();
        assert_eq!(decodes, name != "claim-format-3", "seed {name}");
        fs::write(dir.join(format!("seed-{name}")), bytes).expect("write a seed");
    }
}
