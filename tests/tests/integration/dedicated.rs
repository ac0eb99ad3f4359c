//! Dedicated allocations (no shareID, no amounts) take the whole device: they exclude
//! shares, shares exclude them, and releasing one gives the whole device back.

use shareguard_tests::{
    Agent, DRIVER, Options, POOL, alloc, claim, device, generic_device, get_share, prepare_one,
    proto as pb, share_id, unprepare_one,
};

fn dedicated(device: &str) -> pb::DeviceAllocation {
    pb::DeviceAllocation {
        request: "whole".into(),
        driver: DRIVER.into(),
        pool: POOL.into(),
        device: device.into(),
        policy_version: "v1".into(),
        ..Default::default()
    }
}

fn one_device() -> Options {
    Options::new(generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]))
}

#[tokio::test]
async fn dedicated_allocation_takes_the_device_and_excludes_shares() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        claim("whole", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares.len(), 1, "{r:?}");
    assert_eq!(
        r.shares[0].share_id, "",
        "a dedicated allocation has no shareID"
    );
    // It is found under its dedicated key instead.
    let s = get_share(&mut c, "dedicated/whole/gen-0").await;
    assert_eq!(
        (s.device.as_str(), s.phase),
        ("gen-0", pb::Phase::Accounted as i32),
        "{s:?}"
    );
    assert!(
        s.limits.is_empty(),
        "a dedicated allocation consumes no named amounts: {s:?}"
    );
    let d = device(&mut c, "gen-0").await;
    assert!(d.dedicated, "{d:?}");
    assert_eq!(
        (d.allocated["memory"].as_str(), d.free["memory"].as_str()),
        ("40Gi", "0"),
        "{d:?}"
    );

    let r = prepare_one(
        &mut c,
        0,
        claim(
            "share",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    let e = r
        .error
        .clone()
        .expect("a share of a dedicated device must be refused");
    assert_eq!(e.code, "ResourceExhausted", "{e:?}");
    assert_eq!(e.field, "claims[0].allocations[0].device", "{e:?}");
    assert_eq!(device(&mut c, "gen-0").await.live_shares, 1);

    // Releasing the dedicated allocation gives the whole device back to shares.
    assert_eq!(unprepare_one(&mut c, 0, "whole").await.code, "");
    let d = device(&mut c, "gen-0").await;
    assert!(!d.dedicated, "{d:?}");
    assert_eq!(d.allocated["memory"], "0");
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "share",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "40Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
}

#[tokio::test]
async fn a_share_excludes_a_dedicated_allocation() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "small",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let r = prepare_one(
        &mut c,
        0,
        claim("whole", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    let e = r
        .error
        .clone()
        .expect("a dedicated allocation of a shared device must be refused");
    assert_eq!(e.code, "ResourceExhausted", "{e:?}");
    assert_eq!(e.field, "claims[0].allocations[0].device", "{e:?}");
    let d = device(&mut c, "gen-0").await;
    assert!(!d.dedicated, "{d:?}");
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("5Gi", 1),
        "{d:?}"
    );

    // A released share is a tombstone, and a tombstone must not block the device.
    assert_eq!(unprepare_one(&mut c, 0, "small").await.code, "");
    let r = prepare_one(
        &mut c,
        0,
        claim("whole", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert!(device(&mut c, "gen-0").await.dedicated);
}

#[tokio::test]
async fn two_dedicated_allocations_of_one_device_exclude_each_other() {
    let mut a = Agent::start(one_device());
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        claim("first", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let r = prepare_one(
        &mut c,
        0,
        claim("second", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    assert_eq!(
        r.error.map(|e| e.code),
        Some("ResourceExhausted".to_owned())
    );
    // The exclusion is rebuilt from the store after a restart.
    a.restart();
    let mut c = a.client().await;
    assert!(device(&mut c, "gen-0").await.dedicated);
    let r = prepare_one(
        &mut c,
        0,
        claim("third", "team-a", "alloc-1", vec![dedicated("gen-0")]),
    )
    .await;
    assert_eq!(
        r.error.map(|e| e.code),
        Some("ResourceExhausted".to_owned())
    );
}
