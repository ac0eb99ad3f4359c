use std::collections::BTreeMap;

use super::*;
use crate::record::{
    ClaimId, ClaimRecord, Phase, SandboxRecord, ShareRecord, TargetHints, TargetRecord,
};

fn trees(dir: &Path) -> Trees {
    let db = sled::Config::new().path(dir).open().unwrap();
    Trees {
        shares: db.open_tree("shares").unwrap(),
        claims: db.open_tree("claims").unwrap(),
        meta: db.open_tree("meta").unwrap(),
        quarantine: db.open_tree("quarantine").unwrap(),
        db,
    }
}

fn share(key: &str, reason: String) -> ShareRecord {
    ShareRecord {
        key: key.into(),
        shared: true,
        claim: ClaimId::default(),
        allocation_id: "a".into(),
        request: "r".into(),
        driver: "d".into(),
        pool: "p".into(),
        device: "gen-0".into(),
        consumed: Default::default(),
        policy_version: Default::default(),
        admin_access: false,
        target: TargetRecord::default(),
        phase: Phase::Preparing,
        mechanism: Default::default(),
        enforced: Default::default(),
        reason: reason.into(),
        error: None,
        epoch: 1,
        created_at_ms: 0,
        updated_at_ms: 0,
        released_at_ms: None,
        sandbox: None,
        more_sandboxes: None,
        device_kind: "generic".into(),
        condition_since_ms: 0,
        quarantined: false,
        rolling_back: false,
        pre_bind: false,
    }
}

fn put(r: ShareRecord) -> Batch {
    Batch {
        put_shares: vec![r],
        ..Default::default()
    }
}

#[test]
fn a_failed_batch_fails_the_rest_of_its_group_and_every_later_one() {
    let dir = tempfile::tempdir().unwrap();
    let t = trees(dir.path());
    let failed = Failure {
        flag: Arc::new(AtomicBool::new(false)),
        problem: Arc::new(Mutex::new(None)),
    };
    // Over the bound: refused, as a write sled would not make durable.
    let huge = "x".repeat(record::MAX_RECORD_BYTES + 1);
    let group = [
        put(share("a", "ok".into())),
        put(share("b", huge)),
        put(share("c", "ok".into())),
    ];
    let refs: Vec<&Batch> = group.iter().collect();
    let r = apply_group(&t, &refs, &failed);
    assert!(r[0].is_ok());
    assert!(
        matches!(r[1], Err(StoreError::TooLarge { .. })),
        "{:?}",
        r[1]
    );
    assert!(matches!(r[2], Err(StoreError::Failed)), "{:?}", r[2]);
    assert!(t.shares.get("a").unwrap().is_some());
    assert!(t.shares.get("b").unwrap().is_none());
    assert!(
        t.shares.get("c").unwrap().is_none(),
        "decided on a state with b in it: never written"
    );
    let later = [put(share("d", "ok".into()))];
    let refs: Vec<&Batch> = later.iter().collect();
    assert!(matches!(
        apply_group(&t, &refs, &failed)[0],
        Err(StoreError::Failed)
    ));
}

#[test]
fn slo_windows_are_kept_by_class_and_dropped_by_none() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let save = |slo: Vec<(&str, Option<&[u8]>)>| {
        let b = Batch {
            slo: slo
                .into_iter()
                .map(|(c, v)| (c.to_owned(), v.map(<[u8]>::to_vec)))
                .collect(),
            ..Default::default()
        };
        b.check_sizes()?;
        store.submit(b).wait_blocking()
    };
    save(vec![("a", Some(b"one")), ("b", Some(b"two"))]).unwrap();
    save(vec![("a", None), ("b", Some(b"three"))]).unwrap();
    let slo = store.load().unwrap().slo;
    assert_eq!(slo.keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(slo["b"], b"three");
    let huge = vec![b'x'; record::MAX_RECORD_BYTES + 1];
    assert!(matches!(
        save(vec![("c", Some(&huge))]),
        Err(StoreError::TooLarge { .. })
    ));
    assert!(!store.has_failed(), "refused before it reached the writer");
}

/// A start reads many records on one thread and decodes them on another, in chunks:
/// every record comes back once, in key order, and one that does not decode is set
/// apart wherever it falls among them.
#[test]
fn many_records_load_in_key_order_with_an_unreadable_one_set_apart() {
    let dir = tempfile::tempdir().unwrap();
    let n = 1_000;
    let store = Store::open(dir.path()).unwrap();
    let batch = Batch {
        put_shares: (0..n)
            .map(|i| share(&format!("s{i:05}"), String::new()))
            .collect(),
        ..Default::default()
    };
    store.submit(batch).wait_blocking().unwrap();
    store
        .trees
        .shares
        .insert("s00300", &b"\x01{not json"[..])
        .unwrap();
    let loaded = store.load().unwrap();
    let keys: Vec<String> = loaded.shares.iter().map(|r| r.key.clone()).collect();
    let want: Vec<String> = (0..n)
        .filter(|i| *i != 300)
        .map(|i| format!("s{i:05}"))
        .collect();
    assert_eq!(keys, want);
    assert_eq!(loaded.quarantined.len(), 1);
    assert_eq!(loaded.quarantined[0].key, "s00300");
    assert_eq!(loaded.quarantined[0].tree, "shares");
}

/// sled 0.34 writes a value to an unsynced blob file once it is over a quarter of a
/// segment minus headers; the bound must stay well below that (checked at compile
/// time, with sled's default segment size, which the store does not change).
const _: () = {
    const SEGMENT: usize = 512 * 1024;
    const BLOB_THRESHOLD: usize = SEGMENT / 4 - 64;
    assert!(record::MAX_RECORD_BYTES * 2 <= BLOB_THRESHOLD);
};

/// A record with every field at the largest size validation, the config and the
/// engine let through encodes below the bound.
#[test]
fn the_largest_record_the_agent_can_make_fits_the_bound() {
    use crate::validate::{MAX_CGROUP_PATHS, MAX_ID_LEN, MAX_PATH_LEN, MAX_PODS};
    use shareguard_common::Quantity;
    let long = |n: usize| "a".repeat(n);
    // Capacity names: a DNS subdomain prefix and a 63-character name.
    let caps: BTreeMap<String, Quantity> = (0..crate::config::MAX_CAPACITIES)
        .map(|i| {
            (
                format!("{}/{:0>63}", long(253), i),
                Quantity::parse("-9223372036854775807").unwrap(),
            )
        })
        .collect();
    let paths: Vec<String> = (0..MAX_CGROUP_PATHS).map(|_| long(MAX_PATH_LEN)).collect();
    let mut r = share(&long(MAX_ID_LEN * 2), "é".repeat(10_000));
    r.claim = ClaimId {
        uid: long(MAX_ID_LEN),
        namespace: long(63).into(),
        name: long(253).into(),
    };
    r.allocation_id = long(MAX_ID_LEN).into();
    r.request = long(127).into();
    r.driver = long(253).into();
    r.pool = long(253).into();
    r.device = long(63).into();
    r.policy_version = long(MAX_ID_LEN).into();
    r.consumed = caps.clone().into();
    r.enforced = caps.into();
    r.mechanism = long(64).into();
    r.target = TargetRecord::new(
        (0..MAX_PODS).map(|_| long(36)).collect(),
        TargetHints {
            cgroup_paths: paths.clone(),
            netns_inode: Some(u64::MAX),
            interface: Some(long(15)),
        },
    );
    r.sandbox = Some(Box::new(SandboxRecord {
        pod_uid: long(36),
        cgroup: long(MAX_PATH_LEN),
        cgroup_inode: u64::MAX,
        cgroups: paths,
        netns_inode: Some(u64::MAX),
        host_ifindex: Some(u32::MAX),
        host_ifname: Some(long(15).into()),
    }));
    r.error = Some(Box::new(crate::error::ClaimError::internal(
        "é".repeat(10_000),
    )));
    r.bound();
    let bytes = record::encode(&r).len();
    eprintln!("largest record: {bytes} bytes");
    assert!(
        bytes <= record::MAX_RECORD_BYTES,
        "{bytes} bytes > {}",
        record::MAX_RECORD_BYTES
    );
}

fn of_claim(key: &str, uid: &str, allocation: &str, created_at_ms: u64) -> ShareRecord {
    let mut r = share(key, String::new());
    r.claim.uid = uid.into();
    r.allocation_id = allocation.into();
    r.created_at_ms = created_at_ms;
    r
}

fn index(uid: &str, allocation: &str, keys: &[&str], cdi: &[&str]) -> ClaimRecord {
    ClaimRecord {
        claim: ClaimId {
            uid: uid.into(),
            ..Default::default()
        },
        allocation_id: allocation.into(),
        share_keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        cdi_device_ids: cdi.iter().map(|k| (*k).to_owned()).collect(),
        updated_at_ms: 0,
    }
}

/// A claim's index is in memory for every claim: one share's key sits inline and no
/// CDI ids cost nothing, and it is stored as the same JSON lists as before.
#[test]
fn a_claims_index_keeps_one_key_inline_and_stores_plain_lists() {
    assert!(std::mem::size_of::<ClaimRecord>() <= 152);
    let one = index("u", "a", &["s1"], &[]);
    assert!(!one.share_keys.spilled());
    let bytes = record::encode(&one);
    let text = std::str::from_utf8(&bytes[1..]).unwrap();
    assert!(
        text.contains("\"share_keys\":[\"s1\"],\"cdi_device_ids\":[]"),
        "{text}"
    );
    let back: ClaimRecord = record::decode(&bytes).unwrap();
    assert!(!back.share_keys.spilled());
    assert_eq!(back, one);
    let two = index("u", "a", &["s1", "s2"], &["k8s.example/gpu=x"]);
    assert_eq!(
        record::decode::<ClaimRecord>(&record::encode(&two)).unwrap(),
        two
    );
}

/// A Prepare's batch (its shares and the claim's index) writes the shares alone, in
/// format 2; an index with CDI ids is kept, and goes once a write of it has none. At
/// load every claim is known from its shares.
#[test]
fn a_claims_index_is_stored_only_for_its_cdi_ids() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let write = |b: Batch| store.submit(b).wait_blocking().unwrap();
    let prepare = Batch {
        put_shares: vec![of_claim("s1", "c1", "a1", 1)],
        put_claims: vec![index("c1", "a1", &["s1"], &[])],
        ..Default::default()
    };
    assert_eq!(apply(&store.trees, &prepare).unwrap(), Written::OneKey);
    assert!(store.trees.claims.is_empty());
    assert_eq!(store.trees.shares.get("s1").unwrap().unwrap()[0], 2);
    write(Batch {
        put_shares: vec![of_claim("s2", "c2", "a1", 1), of_claim("s3", "c2", "a1", 1)],
        put_claims: vec![index("c2", "a1", &["s2", "s3"], &["k8s.example/gpu=x"])],
        ..Default::default()
    });
    assert_eq!(store.trees.claims.len(), 1);
    let loaded = store.load().unwrap();
    let mut claims = loaded.claims.clone();
    claims.sort_by(|a, b| a.claim.uid.cmp(&b.claim.uid));
    assert_eq!(claims.len(), 2);
    assert_eq!(claims[0].share_keys.as_slice(), ["s1"]);
    assert!(!claims[0].share_keys.spilled(), "one key is kept inline");
    assert_eq!(claims[0].allocation_id, "a1");
    assert_eq!(claims[1].share_keys.as_slice(), ["s2", "s3"]);
    assert_eq!(&*claims[1].cdi_device_ids, ["k8s.example/gpu=x"]);
    let gone = Batch {
        put_claims: vec![index("c2", "a1", &["s2", "s3"], &[])],
        ..Default::default()
    };
    assert_eq!(apply(&store.trees, &gone).unwrap(), Written::Transaction);
    assert!(store.trees.claims.is_empty());
    let epoch = Batch {
        epoch: Some(7),
        put_shares: vec![of_claim("s1", "c1", "a1", 1)],
        ..Default::default()
    };
    assert_eq!(apply(&store.trees, &epoch).unwrap(), Written::Transaction);
}

/// A store an earlier version wrote (format 1, an index record for every claim) loads:
/// each claim's shares, under its newest allocation, the index's CDI ids where it names
/// that allocation, and the keys it lists of shares that did not load; the record goes
/// once its claim is written again.
#[test]
fn an_earlier_versions_index_loads_and_goes_when_its_claim_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let t = &store.trees;
    for r in [
        of_claim("old", "c1", "a1", 1),
        of_claim("new-b", "c1", "a2", 5),
        of_claim("new-a", "c1", "a2", 5),
        of_claim("x1", "c3", "a1", 1),
    ] {
        t.shares
            .insert(r.key.as_bytes(), record::encode(&r))
            .unwrap();
    }
    t.shares.insert("lost", &b"\x01{not json"[..]).unwrap();
    for c in [
        index("c1", "a2", &["new-b", "lost", "new-a"], &["cdi=1"]),
        index("c3", "a0", &["x1"], &["cdi=stale"]),
        index("c4", "a1", &[], &[]),
    ] {
        t.claims
            .insert(c.claim.uid.as_bytes(), record::encode(&c))
            .unwrap();
    }
    let mut claims = store.load().unwrap().claims;
    claims.sort_by(|a, b| a.claim.uid.cmp(&b.claim.uid));
    assert_eq!(claims.len(), 3, "{claims:?}");
    assert_eq!(claims[0].allocation_id, "a2");
    assert_eq!(
        claims[0].share_keys.as_slice(),
        ["old", "new-a", "new-b", "lost"]
    );
    assert_eq!(&*claims[0].cdi_device_ids, ["cdi=1"]);
    assert_eq!(claims[1].allocation_id, "a1");
    assert!(claims[1].cdi_device_ids.is_empty(), "another allocation's");
    assert_eq!(claims[2].claim.uid, "c4", "no share: kept as stored");
    store
        .submit(Batch {
            put_shares: vec![of_claim("x1", "c3", "a1", 1)],
            put_claims: vec![ClaimRecord::clone(&claims[1])],
            ..Default::default()
        })
        .wait_blocking()
        .unwrap();
    assert!(t.claims.get("c3").unwrap().is_none());
    assert!(t.claims.get("c1").unwrap().is_some());
}

#[test]
fn share_records_are_format_2_and_a_newer_format_is_refused() {
    let r = share("s", String::new());
    let v2 = record::encode_share(&r);
    assert_eq!(v2[0], record::FORMAT_V2);
    assert_eq!(record::decode::<ShareRecord>(&v2).unwrap(), r);
    assert_eq!(
        record::decode::<ShareRecord>(&record::encode(&r)).unwrap(),
        r
    );
    let mut v3 = v2;
    v3[0] = 3;
    assert!(matches!(
        record::decode::<ShareRecord>(&v3),
        Err(record::DecodeError::UnknownFormat { found: 3, max: 2 })
    ));
}

/// Fields a record lacks are left out of its JSON, which keeps sled's cached copy of
/// every live record smaller, and the record still reads the same here and in an agent
/// of the previous version, whose share record had these fields without serde defaults
/// (a missing `Option` reads as None) and read the target through defaults.
#[test]
fn absent_fields_are_left_out_and_read_back_in_this_and_the_previous_version() {
    #[derive(serde::Deserialize)]
    #[allow(dead_code)] // Read only to prove that it deserializes.
    struct PreviousShape {
        key: String,
        share_id: Option<String>,
        error: Option<crate::error::ClaimError>,
        released_at_ms: Option<u64>,
        #[serde(default)]
        sandbox: Option<SandboxRecord>,
        target: PreviousTarget,
        reason: String,
    }
    /// The target before its hints were boxed: its fields read through defaults.
    #[derive(serde::Deserialize, Debug, Default, PartialEq)]
    #[serde(default)]
    struct PreviousTarget {
        pod_uids: Vec<String>,
        cgroup_paths: Vec<String>,
        netns_inode: Option<u64>,
        interface: Option<String>,
    }
    let bare = share("s", "r".into());
    let text = String::from_utf8(record::encode_share(&bare)[1..].to_vec()).unwrap();
    for absent in [
        "\"error\"",
        "\"released_at_ms\"",
        "\"sandbox\"",
        "\"pod_uids\"",
        "\"cgroup_paths\"",
        "\"netns_inode\"",
        "\"interface\"",
        "null",
    ] {
        assert!(!text.contains(absent), "{absent} in {text}");
    }
    assert!(text.contains("\"target\":{}"), "{text}");
    assert_eq!(
        record::decode::<ShareRecord>(&record::encode_share(&bare)).unwrap(),
        bare
    );
    let old: PreviousShape = serde_json::from_str(&text).unwrap();
    assert!(old.error.is_none() && old.sandbox.is_none() && old.released_at_ms.is_none());
    // A share's id is written out from its key, which the record keeps once.
    assert_eq!(old.share_id.as_deref(), Some(old.key.as_str()));
    assert_eq!(bare.share_id(), Some("s"));
    assert_eq!(old.target, PreviousTarget::default());

    let mut full = bare.clone();
    full.error = Some(Box::new(crate::error::ClaimError::internal("boom")));
    full.released_at_ms = std::num::NonZeroU64::new(7);
    full.target = TargetRecord::new(
        vec!["p".into()],
        TargetHints {
            cgroup_paths: vec!["c".into()],
            netns_inode: Some(9),
            interface: Some("eth1".into()),
        },
    );
    full.set_sandboxes(vec![SandboxRecord {
        pod_uid: "p".into(),
        cgroup: "c".into(),
        cgroup_inode: 3,
        ..Default::default()
    }]);
    let bytes = record::encode_share(&full);
    assert_eq!(record::decode::<ShareRecord>(&bytes).unwrap(), full);
    let old: PreviousShape = serde_json::from_slice(&bytes[1..]).unwrap();
    assert_eq!(old.error.as_ref(), full.error.as_deref());
    assert_eq!(old.sandbox.as_ref(), full.sandbox.as_deref());
    let previous_target = PreviousTarget {
        pod_uids: vec!["p".into()],
        cgroup_paths: vec!["c".into()],
        netns_inode: Some(9),
        interface: Some("eth1".into()),
    };
    assert_eq!(
        (old.released_at_ms, &old.target),
        (Some(7), &previous_target)
    );
    // A record an earlier version wrote with explicit nulls reads the same.
    let with_nulls = text.replacen(
        '{',
        "{\"error\":null,\"released_at_ms\":null,\"sandbox\":null,\"more_sandboxes\":[],",
        1,
    );
    let mut v = vec![record::FORMAT_V2];
    v.extend(with_nulls.replace("\"target\":{}", "\"target\":{\"pod_uids\":[],\"cgroup_paths\":[],\"netns_inode\":null,\"interface\":null}").into_bytes());
    assert_eq!(record::decode::<ShareRecord>(&v).unwrap(), bare);

    // Several pods' sandboxes: the rest are stored as a list beside the first, as the
    // previous version keeps them; a release time of 0 (which no release has) reads as
    // unknown rather than failing the record.
    let mut several = full.clone();
    let second = SandboxRecord {
        pod_uid: "q".into(),
        cgroup: "d".into(),
        cgroup_inode: 4,
        ..Default::default()
    };
    several.set_sandboxes(vec![full.sandboxes()[0].clone(), second.clone()]);
    assert_eq!(several.more_sandboxes(), std::slice::from_ref(&second));
    let bytes = record::encode_share(&several);
    assert_eq!(record::decode::<ShareRecord>(&bytes).unwrap(), several);
    #[derive(serde::Deserialize)]
    struct PreviousSandboxes {
        more_sandboxes: Vec<SandboxRecord>,
        released_at_ms: Option<u64>,
    }
    let old: PreviousSandboxes = serde_json::from_slice(&bytes[1..]).unwrap();
    assert_eq!(
        (old.more_sandboxes, old.released_at_ms),
        (vec![second], Some(7))
    );
    let zero = String::from_utf8(bytes[1..].to_vec())
        .unwrap()
        .replace("\"released_at_ms\":7", "\"released_at_ms\":0");
    let mut v = vec![record::FORMAT_V2];
    v.extend(zero.into_bytes());
    assert_eq!(
        record::decode::<ShareRecord>(&v).unwrap().released_at_ms,
        None
    );

    // A whole device's allocation has no share id: left out, read as none by both, and
    // an earlier version's explicit null reads the same.
    let mut dedicated = bare.clone();
    dedicated.key = "dedicated/u/gen-0".into();
    dedicated.shared = false;
    let bytes = record::encode_share(&dedicated);
    let text = std::str::from_utf8(&bytes[1..]).unwrap();
    assert!(!text.contains("share_id"), "{text}");
    let old: PreviousShape = serde_json::from_str(text).unwrap();
    assert_eq!(old.share_id, None);
    assert_eq!(record::decode::<ShareRecord>(&bytes).unwrap(), dedicated);
    assert_eq!(dedicated.share_id(), None);
    let with_null = text.replacen('{', "{\"share_id\":null,", 1);
    let mut v = vec![record::FORMAT_V2];
    v.extend(with_null.into_bytes());
    assert_eq!(record::decode::<ShareRecord>(&v).unwrap(), dedicated);
}

/// A fixed reason is the one shared copy, not a copy of the record's own, whether the
/// record was read from the store or made by the engine (which bounds every record it
/// commits); any other reason is the record's own.
#[test]
fn a_fixed_reason_is_shared_and_any_other_is_kept_whole() {
    use crate::record::{Reason, reasons};
    let shared = |r: &Reason, fixed: &str| {
        record::fixed_reason(fixed).is_some_and(|f| std::sync::Arc::ptr_eq(r, f))
    };
    let r = share("s", reasons::ACCOUNTED.to_owned());
    assert!(!shared(&r.reason, reasons::ACCOUNTED));
    let back: ShareRecord = record::decode(&record::encode_share(&r)).unwrap();
    assert!(
        shared(&back.reason, reasons::ACCOUNTED),
        "{:?}",
        back.reason
    );
    assert_eq!(back, r);

    let mut made = share("t", reasons::RELEASED.to_owned());
    made.bound();
    assert!(shared(&made.reason, reasons::RELEASED), "{:?}", made.reason);

    let own = share("u", "enforced: 100M egress".to_owned());
    let back: ShareRecord = record::decode(&record::encode_share(&own)).unwrap();
    assert_eq!(&*back.reason, "enforced: 100M egress");
    assert!(record::fixed_reason(&back.reason).is_none());
    // Two records decoded with the same fixed reason hold one copy of it.
    let again: ShareRecord = record::decode(&record::encode_share(&r)).unwrap();
    let first: ShareRecord = record::decode(&record::encode_share(&r)).unwrap();
    assert!(std::sync::Arc::ptr_eq(&again.reason, &first.reason));
}

/// Every live share's record is kept in memory, boxed, and the agent's memory limit is
/// sized by it (docs/benchmarks.md): what most records lack is boxed, and the share id
/// is not a second copy of the key.
#[test]
fn a_share_record_stays_within_its_inline_size() {
    let size = std::mem::size_of::<ShareRecord>();
    assert!(
        size <= 456,
        "a share record grew to {size} bytes inline; box what most records lack"
    );
}

/// The caller's hints, which the kubelet plugin never sends, cost a share without them
/// one pointer, and verifying hints keeps the interface the caller named.
#[test]
fn a_target_boxes_its_hints_only_when_it_has_some() {
    assert_eq!(std::mem::size_of::<TargetRecord>(), 32);
    let pods = vec!["p".to_owned()];
    let bare = TargetRecord::new(pods.clone(), TargetHints::default());
    let mut t = bare.clone();
    t.set_verified(None, Vec::new());
    assert_eq!(t, bare, "no hints: nothing boxed");
    let mut t = TargetRecord::new(
        pods.clone(),
        TargetHints {
            interface: Some("eth1".into()),
            ..TargetHints::default()
        },
    );
    t.set_verified(Some(7), vec!["c".into()]);
    assert_eq!(
        (t.interface(), t.netns_inode(), t.cgroup_paths()),
        (Some("eth1"), Some(7), &["c".to_owned()][..])
    );
    assert_eq!(t.pod_uids, pods);
    t.set_verified(None, Vec::new());
    assert_eq!((t.interface(), t.netns_inode()), (Some("eth1"), None));
    assert!(t.cgroup_paths().is_empty());
}
