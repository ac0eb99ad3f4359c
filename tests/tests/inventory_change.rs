//! A device that leaves the inventory across a restart: its shares become UNKNOWN and
//! keep their capacity until an explicit Unprepare. Capacity is never freed implicitly.

use std::fs;

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, get_share, prepare_one, proto as pb,
    share_id, unprepare_one,
};

#[tokio::test]
async fn shares_of_a_removed_device_become_unknown_and_keep_their_capacity() {
    let gen1 = generic_device("gen-1", "20Gi", "5Gi", &["team-a"], &[]);
    let mut a = Agent::start(Options::new(format!(
        "{}{gen1}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
    )));
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        1,
        claim(
            "inv",
            "team-a",
            "alloc-1",
            vec![alloc("gen-1", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let full = fs::read_to_string(&a.config).unwrap();
    let without = full.replace(&gen1, "");
    assert_ne!(without, full, "the harness's config layout changed");
    fs::write(&a.config, &without).unwrap();
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Unknown as i32, "{s:?}");
    assert!(
        s.reason.contains("inventory"),
        "the reason should say why: {s:?}"
    );
    assert!(
        a.audit_lines()
            .iter()
            .any(|l| l["decision"] == "recover" && l["share_id"] == id.as_str()),
        "the change of phase at start is audited"
    );

    // The device comes back: the share still holds its capacity, as nothing released it.
    fs::write(&a.config, &full).unwrap();
    a.restart();
    let mut c = a.client().await;
    let d = device(&mut c, "gen-1").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("10Gi", 1),
        "{d:?}"
    );
    // Nothing was lost while it was gone, and an accounting share has nothing to
    // re-verify: it is ACCOUNTED again.
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Accounted as i32, "{s:?}");

    assert_eq!(unprepare_one(&mut c, 1, "inv").await.code, "");
    let d = device(&mut c, "gen-1").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("0", 0),
        "{d:?}"
    );
}
