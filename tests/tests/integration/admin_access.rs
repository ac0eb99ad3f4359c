//! adminAccess: allowed only in a device's admin namespaces, and an admin-access share
//! observes the device without consuming its capacity (as in Kubernetes).

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, prepare_one, proto as pb, share_id,
};

fn admin_alloc(device: &str, id: &str, memory: &str) -> pb::DeviceAllocation {
    pb::DeviceAllocation {
        admin_access: true,
        ..alloc(device, id, memory)
    }
}

#[tokio::test]
async fn admin_share_in_an_admin_namespace_consumes_nothing() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a", "ops"],
        &["ops"],
    )));
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "fill",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "20Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    // The device is full, and an admin-access share is still admitted.
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "observe",
            "ops",
            "alloc-1",
            vec![admin_alloc("gen-0", &id, "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert!(r.shares[0].admin_access, "{r:?}");
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("20Gi", 2),
        "{d:?}"
    );
    let audit = a.audit_lines();
    assert!(
        audit.iter().any(|l| l["decision"] == "admit"
            && l["share_id"] == id.as_str()
            && l["tenant"] == "ops"),
        "the admin share's admission is audited: {audit:?}"
    );

    a.restart();
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("20Gi", 2),
        "{d:?}"
    );
}
