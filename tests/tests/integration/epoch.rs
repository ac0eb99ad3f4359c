//! I4 fencing: only `NewEpoch` moves the fence. Prepare and Unprepare with an epoch below
//! the current one (stale) or above it (never issued) are refused whole, the current one is
//! accepted, and the fence is durable across a restart.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use shareguard_tests::{
    Agent, Options, alloc, claim, claim_ref, device, generic_device, prepare_one, proto as pb,
    share_id, take_epoch,
};

fn one_device() -> Options {
    Options::new(generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]))
}

async fn epoch_of(a: &Agent) -> u64 {
    a.client()
        .await
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner()
        .epoch
}

async fn prepare_at(
    a: &Agent,
    epoch: u64,
    uid: &str,
) -> Result<pb::PrepareResponse, tonic::Status> {
    let cl = claim(
        uid,
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &share_id(), "5Gi")],
    );
    a.client()
        .await
        .prepare(pb::PrepareRequest {
            epoch,
            claims: vec![cl],
        })
        .await
        .map(|r| r.into_inner())
}

async fn unprepare_at(
    a: &Agent,
    epoch: u64,
    uid: &str,
) -> Result<pb::UnprepareResponse, tonic::Status> {
    a.client()
        .await
        .unprepare(pb::UnprepareRequest {
            epoch,
            claims: vec![claim_ref(uid)],
            only_pre_bind: false,
        })
        .await
        .map(|r| r.into_inner())
}

fn assert_stale(r: Result<impl std::fmt::Debug, tonic::Status>) {
    let e = r.expect_err("a stale epoch must be refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("older than"),
        "the message should say why: {e:?}"
    );
}

fn assert_never_issued(r: Result<impl std::fmt::Debug, tonic::Status>) {
    let e = r.expect_err("an epoch never issued must be refused");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("never issued") && e.message().contains("NewEpoch"),
        "the message should say why and what to do: {e:?}"
    );
}

#[tokio::test]
async fn stale_epoch_is_refused_and_the_fence_survives_a_restart() {
    let mut a = Agent::start(one_device());
    take_epoch(&mut a.client().await, 5).await;
    assert!(
        prepare_at(&a, 5, "fence-live").await.unwrap().claims["fence-live"]
            .error
            .is_none()
    );
    assert_eq!(epoch_of(&a).await, 5);

    assert_stale(prepare_at(&a, 4, "fence-stale").await);
    assert_stale(unprepare_at(&a, 4, "fence-live").await);
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    // The stale Unprepare released nothing and the stale Prepare admitted nothing.
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("5Gi", 1),
        "{d:?}"
    );

    // Equal is accepted: a control plane retries with the epoch it has.
    assert!(
        prepare_at(&a, 5, "fence-equal").await.unwrap().claims["fence-equal"]
            .error
            .is_none()
    );

    a.restart();
    assert_eq!(epoch_of(&a).await, 5, "the fence was not persisted");
    assert_stale(prepare_at(&a, 4, "fence-stale").await);
    assert_stale(unprepare_at(&a, 0, "fence-live").await);

    // A new epoch moves the fence, and the old one is stale from then on.
    take_epoch(&mut a.client().await, 6).await;
    assert_eq!(
        unprepare_at(&a, 6, "fence-equal").await.unwrap().claims["fence-equal"].code,
        ""
    );
    assert_eq!(epoch_of(&a).await, 6);
    assert_stale(prepare_at(&a, 5, "fence-late").await);
    a.restart();
    assert_stale(unprepare_at(&a, 5, "fence-live").await);
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("5Gi", 1),
        "{d:?}"
    );
}

#[tokio::test]
async fn stale_epoch_refusal_is_audited() {
    let a = Agent::start(one_device());
    take_epoch(&mut a.client().await, 3).await;
    let r = prepare_one(
        &mut a.client().await,
        3,
        claim(
            "aud-live",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_stale(prepare_at(&a, 2, "aud-stale").await);
    let refused: Vec<serde_json::Value> = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "refuse" && l["code"] == "FailedPrecondition")
        .collect();
    assert!(
        !refused.is_empty(),
        "the stale request left no refuse line in the audit log"
    );
    assert!(
        refused.iter().all(|l| l["epoch"] == 2),
        "the line should carry the refused epoch: {refused:?}"
    );
}

/// Only `NewEpoch` raises the epoch: a Prepare with one valid claim and epoch 2^64-1, or
/// `shareguard release --epoch 18446744073709551615`, used to raise the fence to the
/// top, where no `NewEpoch` could ever succeed again, and every plugin was fenced for
/// good. Now both are refused, change nothing, and `NewEpoch` goes on working.
#[tokio::test]
async fn an_epoch_never_issued_is_refused_and_moves_nothing() {
    let mut a = Agent::start(one_device());
    let mut c = a.client().await;
    assert_eq!(take_epoch(&mut c, 2).await, 2);
    assert!(
        prepare_at(&a, 2, "top-live").await.unwrap().claims["top-live"]
            .error
            .is_none()
    );
    assert_never_issued(prepare_at(&a, u64::MAX, "top-new").await);
    assert_never_issued(prepare_at(&a, 3, "top-new").await);
    assert_never_issued(unprepare_at(&a, u64::MAX, "top-live").await);

    let o = a.cli(&["release", "top-live", "--epoch", &u64::MAX.to_string()]);
    assert!(
        !o.status.success(),
        "release with a made-up epoch must fail"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("never issued"), "{err}");

    assert_eq!(epoch_of(&a).await, 2, "the fence moved");
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("5Gi", 1),
        "nothing admitted, nothing released: {d:?}"
    );
    a.restart();
    assert_eq!(epoch_of(&a).await, 2, "the fence moved on disk");
    let next = a
        .client()
        .await
        .new_epoch(pb::NewEpochRequest {})
        .await
        .expect("NewEpoch must still work")
        .into_inner()
        .epoch;
    assert_eq!(next, 3);
    let audited = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "refuse" && l["epoch"] == u64::MAX)
        .count();
    assert!(audited >= 2, "the refusals are audited");
}
