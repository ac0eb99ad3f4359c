//! I3: a repeated Prepare of the same (claim uid, allocation id) returns the stored result
//! and counts nothing twice; allocation results are immutable; Unprepare any number of
//! times frees once; a released claim can be prepared again.

use shareguard_tests::{
    Agent, Options, all_shares, alloc, claim, device, generic_device, get_share, prepare_one,
    proto as pb, share_id, unprepare_one,
};

fn one_device() -> Options {
    Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a", "team-b"],
        &[],
    ))
}

/// The shares without `updated_at`, which a repeat may legitimately leave or touch.
fn stable(mut shares: Vec<pb::ShareStatus>) -> Vec<pb::ShareStatus> {
    for s in &mut shares {
        s.updated_at = None;
    }
    shares
}

#[tokio::test]
async fn repeated_prepare_returns_the_stored_result_and_counts_once() {
    let mut a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let req = claim(
        "idem-1",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &id, "10Gi")],
    );
    let first = prepare_one(&mut c, 0, req.clone()).await;
    assert_eq!(first.error, None, "{first:?}");

    let again = prepare_one(&mut c, 0, req.clone()).await;
    assert_eq!(again.error, None, "{again:?}");
    assert_eq!(stable(again.shares), stable(first.shares.clone()));
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("10Gi", 1),
        "counted twice: {d:?}"
    );
    assert_eq!(all_shares(&mut c).await.len(), 1);
    let repeats = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "repeat" && l["claim_uid"] == "idem-1")
        .count();
    assert_eq!(
        repeats, 1,
        "a repeat is audited as such, not as a second admission"
    );

    // The stored result survives a restart, so a retry after a crash is a repeat too.
    a.restart();
    let mut c = a.client().await;
    let after = prepare_one(&mut c, 0, req).await;
    assert_eq!(after.error, None, "{after:?}");
    assert_eq!(stable(after.shares), stable(first.shares));
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
}

#[tokio::test]
async fn same_allocation_with_another_amount_is_already_exists() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "immut-1",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let before = stable(all_shares(&mut c).await);

    let r = prepare_one(
        &mut c,
        0,
        claim(
            "immut-1",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "15Gi")],
        ),
    )
    .await;
    let e = r.error.clone().expect("a changed amount must be refused");
    assert_eq!(e.code, "AlreadyExists", "{e:?}");
    assert_eq!(e.field, "claims[0].allocations", "{e:?}");
    assert!(
        !e.retryable,
        "retrying the same immutable conflict cannot help: {e:?}"
    );
    assert!(r.shares.is_empty(), "{r:?}");
    assert_eq!(
        stable(all_shares(&mut c).await),
        before,
        "the stored share must not change"
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
}

#[tokio::test]
async fn share_id_of_another_claim_is_already_exists() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "owner",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    // Another tenant naming the same shareID must not be handed the first one's share.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "thief",
            "team-b",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    let e = r
        .error
        .clone()
        .expect("a shareID of another claim must be refused");
    assert_eq!(e.code, "AlreadyExists", "{e:?}");
    assert_eq!(e.field, "claims[0].allocations[0].share_id", "{e:?}");
    assert!(
        r.shares.is_empty(),
        "the other claim's share must not be disclosed: {r:?}"
    );
    let s = get_share(&mut c, id).await;
    assert_eq!(s.claim.map(|c| c.uid), Some("owner".to_owned()));
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
}

#[tokio::test]
async fn another_allocation_id_while_live_is_failed_precondition() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "realloc",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let r = prepare_one(
        &mut c,
        0,
        claim(
            "realloc",
            "team-a",
            "alloc-2",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    let e = r
        .error
        .clone()
        .expect("a re-allocation of a live claim must be refused");
    assert_eq!(e.code, "FailedPrecondition", "{e:?}");
    assert_eq!(e.field, "claims[0].allocation_id", "{e:?}");
    let shares = all_shares(&mut c).await;
    assert_eq!(
        shares
            .iter()
            .map(|s| (s.share_id.as_str(), s.allocation_id.as_str()))
            .collect::<Vec<_>>(),
        [(id.as_str(), "alloc-1")]
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");

    // Once released, the new allocation is accepted.
    assert_eq!(unprepare_one(&mut c, 0, "realloc").await.code, "");
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "realloc",
            "team-a",
            "alloc-2",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "5Gi");
}

#[tokio::test]
async fn unprepare_twice_frees_once() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    for uid in ["twice", "bystander"] {
        let r = prepare_one(
            &mut c,
            0,
            claim(
                uid,
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &share_id(), "10Gi")],
            ),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "20Gi");
    for _ in 0..3 {
        assert_eq!(
            unprepare_one(&mut c, 0, "twice").await,
            pb::Error::default()
        );
        // Only the released claim's 10Gi is freed, however often it is released.
        assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
    }
    let releases = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "release" && l["claim_uid"] == "twice")
        .count();
    assert_eq!(
        releases, 1,
        "one release happened, the repeats changed nothing"
    );
}

#[tokio::test]
async fn unprepare_of_an_unknown_claim_succeeds_and_changes_nothing() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "known",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        unprepare_one(&mut c, 0, "never-prepared").await,
        pb::Error::default()
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
}

#[tokio::test]
async fn released_claim_can_be_prepared_again() {
    let mut a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let req = claim(
        "again",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &id, "10Gi")],
    );
    assert_eq!(prepare_one(&mut c, 0, req.clone()).await.error, None);
    assert_eq!(unprepare_one(&mut c, 0, "again").await.code, "");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "0");

    let r = prepare_one(&mut c, 0, req).await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        r.shares
            .iter()
            .map(|s| (s.share_id.as_str(), s.phase))
            .collect::<Vec<_>>(),
        [(id.as_str(), pb::Phase::Accounted as i32)]
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");
    a.restart();
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("10Gi", 1),
        "{d:?}"
    );
}

#[tokio::test]
async fn repeat_with_the_amount_spelled_differently_is_a_repeat() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "spelled",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    // 5Gi in bytes: quantities compare by value, not by how they are written.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "spelled",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "5368709120")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        r.shares[0].limits[0].requested, "5Gi",
        "the stored result is returned: {r:?}"
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "5Gi");
}

#[tokio::test]
async fn same_claim_uid_from_another_namespace_is_not_a_repeat() {
    let a = Agent::start(one_device());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "ns-bound",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    // The same uid and allocation, but said to be a claim of another tenant. A claim uid
    // belongs to one namespace; answering this as a repeat would hand team-a's share to a
    // request made for team-b, and audit it as team-a's.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "ns-bound",
            "team-b",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    let e = r
        .error
        .clone()
        .unwrap_or_else(|| panic!("answered as a repeat across namespaces: {r:?}"));
    assert!(
        ["AlreadyExists", "FailedPrecondition", "PermissionDenied"].contains(&e.code.as_str()),
        "{e:?}"
    );
    assert!(
        r.shares.is_empty(),
        "team-a's share was disclosed to a team-b request: {r:?}"
    );
    let s = get_share(&mut c, id).await;
    assert_eq!(s.claim.map(|c| c.namespace), Some("team-a".to_owned()));
}
