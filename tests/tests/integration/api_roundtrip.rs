//! Every unary `NodeAgent` RPC, end to end over the socket: what a Prepare admits is what
//! GetShare, ListShares and ListDevices then report, and an Unprepare is reflected in all
//! of them.

use shareguard_tests::{
    Agent, DRIVER, Options, POOL, all_shares, alloc, claim, claim_ref, device, generic_device,
    get_share, prepare_one, proto as pb, share_id, take_epoch, unprepare_one,
};

fn two_devices() -> Options {
    Options::new(format!(
        "{}{}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a", "team-b"], &[]),
        generic_device("gen-1", "20Gi", "5Gi", &["team-a", "team-b"], &[])
    ))
}

#[tokio::test]
async fn prepare_then_get_share_reports_the_admitted_share() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "rt-get",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares.len(), 1, "{r:?}");
    let answered = &r.shares[0];

    let s = get_share(&mut c, id.clone()).await;
    // The answer to Prepare and the stored record must be the same thing.
    assert_eq!(&s, answered);
    assert_eq!(s.share_id, id);
    assert_eq!(
        s.claim
            .as_ref()
            .map(|c| (c.uid.as_str(), c.namespace.as_str())),
        Some(("rt-get", "team-a"))
    );
    assert_eq!(
        (s.driver.as_str(), s.pool.as_str(), s.device.as_str()),
        (DRIVER, POOL, "gen-0")
    );
    assert_eq!(s.allocation_id, "alloc-1");
    assert_eq!(s.policy_version, "v1");
    assert_eq!(s.phase, pb::Phase::Accounted as i32);
    // A generic device enforces nothing, and the API must say so rather than show a limit.
    assert_eq!(s.mechanism, "accounting-only");
    assert_eq!(
        s.limits,
        vec![pb::CapacityLimit {
            name: "memory".into(),
            requested: "10Gi".into(),
            enforced: String::new()
        }]
    );
    assert_eq!(s.error, None);
    let status: serde_json::Value = serde_json::from_str(&s.device_status_json).unwrap();
    assert_eq!(status["shareID"], id.as_str());
    assert_eq!(status["data"]["phase"], "ACCOUNTED");
    assert_eq!(
        status["conditions"][0]["status"], "False",
        "accounting is not enforcement: {status}"
    );
}

#[tokio::test]
async fn get_share_of_an_unknown_id_is_not_found() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let missing = share_id();
    let e = c
        .get_share(pb::GetShareRequest {
            share_id: missing.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(
        e.message().contains(&missing),
        "the message should name the id: {e:?}"
    );
}

#[tokio::test]
async fn unprepare_releases_and_frees_the_capacity() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "rt-unprep",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "15Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "15Gi");

    let out = c
        .unprepare(pb::UnprepareRequest {
            epoch: 0,
            claims: vec![claim_ref("rt-unprep")],
            only_pre_bind: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.claims.len(), 1, "{out:?}");
    assert_eq!(out.claims["rt-unprep"].code, "", "{out:?}");

    let s = get_share(&mut c, id).await;
    assert_eq!(s.phase, pb::Phase::Released as i32, "{s:?}");
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (
            d.allocated["memory"].as_str(),
            d.free["memory"].as_str(),
            d.live_shares
        ),
        ("0", "40Gi", 0)
    );
}

#[tokio::test]
async fn list_shares_filters_by_device_namespace_and_phase() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let (a0, b0, a1, gone) = (share_id(), share_id(), share_id(), share_id());
    for (uid, ns, dev, id) in [
        ("ls-a0", "team-a", "gen-0", &a0),
        ("ls-b0", "team-b", "gen-0", &b0),
        ("ls-a1", "team-a", "gen-1", &a1),
        ("ls-gone", "team-b", "gen-1", &gone),
    ] {
        let r = prepare_one(
            &mut c,
            0,
            claim(uid, ns, "alloc-1", vec![alloc(dev, id, "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{uid}: {r:?}");
    }
    assert_eq!(unprepare_one(&mut c, 0, "ls-gone").await.code, "");

    let mut list = async |device: &str, namespace: &str, phase: pb::Phase| {
        let req = pb::ListSharesRequest {
            device: device.into(),
            namespace: namespace.into(),
            phase: phase as i32,
            ..Default::default()
        };
        let mut ids: Vec<String> = c
            .list_shares(req)
            .await
            .unwrap()
            .into_inner()
            .shares
            .into_iter()
            .map(|s| s.share_id)
            .collect();
        ids.sort();
        ids
    };
    let sorted = |mut v: Vec<&String>| {
        v.sort();
        v.into_iter().cloned().collect::<Vec<_>>()
    };
    assert_eq!(
        list("", "", pb::Phase::Unspecified).await,
        sorted(vec![&a0, &b0, &a1, &gone])
    );
    assert_eq!(
        list("gen-0", "", pb::Phase::Unspecified).await,
        sorted(vec![&a0, &b0])
    );
    assert_eq!(
        list("gen-1", "", pb::Phase::Unspecified).await,
        sorted(vec![&a1, &gone])
    );
    assert_eq!(
        list("", "team-a", pb::Phase::Unspecified).await,
        sorted(vec![&a0, &a1])
    );
    assert_eq!(
        list("", "team-b", pb::Phase::Unspecified).await,
        sorted(vec![&b0, &gone])
    );
    assert_eq!(list("", "", pb::Phase::Released).await, vec![gone.clone()]);
    assert_eq!(
        list("", "", pb::Phase::Accounted).await,
        sorted(vec![&a0, &b0, &a1])
    );
    // Filters combine: all three at once narrow to the one matching share.
    assert_eq!(
        list("gen-1", "team-a", pb::Phase::Accounted).await,
        vec![a1.clone()]
    );
    assert_eq!(
        list("gen-1", "team-b", pb::Phase::Accounted).await,
        Vec::<String>::new()
    );
    assert_eq!(
        list("no-such-device", "", pb::Phase::Unspecified).await,
        Vec::<String>::new()
    );
}

#[tokio::test]
async fn list_shares_refuses_a_phase_that_does_not_exist() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let e = c
        .list_shares(pb::ListSharesRequest {
            phase: 99,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}

#[tokio::test]
async fn list_devices_reports_inventory_allocation_and_epoch() {
    let a = Agent::start(Options::new(format!(
        "{}{}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &["ops"]),
        generic_device("gen-1", "20Gi", "5Gi", &["team-a"], &[])
    )));
    let mut c = a.client().await;
    take_epoch(&mut c, 3).await;
    let r = prepare_one(
        &mut c,
        3,
        claim(
            "ld-1",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "25Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let all = c
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.epoch, 3);
    let names: Vec<&str> = all.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["gen-0", "gen-1"]);

    let d = &all.devices[0];
    assert_eq!(
        (d.driver.as_str(), d.pool.as_str(), d.kind.as_str()),
        (DRIVER, POOL, "generic")
    );
    assert_eq!(d.capacity["memory"], "40Gi");
    assert_eq!(d.allocated["memory"], "25Gi");
    assert_eq!(d.free["memory"], "15Gi");
    assert_eq!(d.live_shares, 1);
    assert!(!d.dedicated);
    assert_eq!(d.allowed_namespaces, ["team-a"]);
    assert_eq!(d.admin_namespaces, ["ops"]);
    let p = &d.policy["memory"];
    assert_eq!(p.default, "5Gi");
    let range = p.valid_range.as_ref().unwrap();
    assert_eq!(
        (range.min.as_str(), range.max.as_str(), range.step.as_str()),
        ("5Gi", "40Gi", "5Gi")
    );

    let idle = &all.devices[1];
    assert_eq!(
        (
            idle.allocated["memory"].as_str(),
            idle.free["memory"].as_str(),
            idle.live_shares
        ),
        ("0", "20Gi", 0)
    );
}

#[tokio::test]
async fn prepare_batch_answers_every_claim_separately() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let ok = share_id();
    let r = c
        .prepare(pb::PrepareRequest {
            epoch: 0,
            claims: vec![
                claim(
                    "batch-ok",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-1", &ok, "20Gi")],
                ),
                // gen-1 is full after the first claim of the same batch.
                claim(
                    "batch-full",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-1", &share_id(), "5Gi")],
                ),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims.len(), 2, "{r:?}");
    assert_eq!(r.claims["batch-ok"].error, None);
    assert_eq!(r.claims["batch-ok"].shares[0].share_id, ok);
    let e = r.claims["batch-full"].error.as_ref().unwrap();
    assert_eq!(e.code, "ResourceExhausted", "{e:?}");
    assert!(e.retryable, "capacity can be freed later: {e:?}");
    assert!(r.claims["batch-full"].shares.is_empty());
    assert_eq!(all_shares(&mut c).await.len(), 1);
}

#[tokio::test]
async fn duplicate_claim_uid_in_one_request_is_refused_whole() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let e = c
        .prepare(pb::PrepareRequest {
            epoch: 0,
            claims: vec![
                claim(
                    "dup",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-0", &share_id(), "5Gi")],
                ),
                claim(
                    "dup",
                    "team-a",
                    "alloc-1",
                    vec![alloc("gen-0", &share_id(), "5Gi")],
                ),
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("claims[1]"), "{e:?}");
    assert!(all_shares(&mut c).await.is_empty());
}
