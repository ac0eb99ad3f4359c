//! WatchShares: a snapshot of what exists, the SNAPSHOT_END marker, then one CHANGED
//! event per change. Every read has a deadline, so a missing event fails the test instead
//! of hanging it.

use std::time::Duration;

use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, prepare_one, proto as pb, share_id, unprepare_one,
};
use tonic::Streaming;

use pb::watch_shares_response::Kind;

const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

async fn next(s: &mut Streaming<pb::WatchSharesResponse>) -> pb::WatchSharesResponse {
    tokio::time::timeout(EVENT_TIMEOUT, s.message())
        .await
        .expect("no watch event within the deadline")
        .expect("watch stream failed")
        .expect("watch stream ended")
}

/// Reads the snapshot up to SNAPSHOT_END and returns its shares.
async fn snapshot(s: &mut Streaming<pb::WatchSharesResponse>) -> Vec<pb::ShareStatus> {
    let mut shares = Vec::new();
    loop {
        let ev = next(s).await;
        match Kind::try_from(ev.kind) {
            Ok(Kind::Snapshot) => {
                shares.push(ev.share.expect("a SNAPSHOT event carries its share"))
            }
            Ok(Kind::SnapshotEnd) => {
                assert_eq!(ev.share, None, "SNAPSHOT_END carries no share");
                return shares;
            }
            other => panic!("{other:?} before SNAPSHOT_END: {ev:?}"),
        }
    }
}

/// Skips events of other shares (none are expected, but a watcher must not assume it)
/// and returns the next CHANGED event of `id`.
async fn changed(s: &mut Streaming<pb::WatchSharesResponse>, id: &str) -> pb::ShareStatus {
    loop {
        let ev = next(s).await;
        assert_eq!(
            ev.kind,
            Kind::Changed as i32,
            "after the snapshot only CHANGED events come: {ev:?}"
        );
        let share = ev.share.expect("a CHANGED event carries its share");
        if share.share_id == id {
            return share;
        }
    }
}

#[tokio::test]
async fn watch_sends_snapshot_marker_then_prepare_and_release() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    let before = share_id();
    let r = prepare_one(
        &mut c,
        1,
        claim(
            "w-before",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &before, "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let mut w = a
        .client()
        .await
        .watch_shares(pb::WatchSharesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let snap = snapshot(&mut w).await;
    assert_eq!(
        snap.iter().map(|s| s.share_id.as_str()).collect::<Vec<_>>(),
        [before.as_str()]
    );
    assert_eq!(snap[0].phase, pb::Phase::Accounted as i32);

    let id = share_id();
    let r = prepare_one(
        &mut c,
        1,
        claim(
            "w-new",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let admitted = changed(&mut w, &id).await;
    assert_eq!(admitted.phase, pb::Phase::Accounted as i32, "{admitted:?}");
    assert_eq!(admitted.limits[0].requested, "10Gi");

    assert_eq!(unprepare_one(&mut c, 1, "w-new").await.code, "");
    let released = changed(&mut w, &id).await;
    assert_eq!(released.phase, pb::Phase::Released as i32, "{released:?}");
}

#[tokio::test]
async fn watch_filters_by_device_and_namespace() {
    let a = Agent::start(Options::new(format!(
        "{}{}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a", "team-b"], &[]),
        generic_device("gen-1", "40Gi", "5Gi", &["team-a", "team-b"], &[])
    )));
    let mut c = a.client().await;
    let mut w = a
        .client()
        .await
        .watch_shares(pb::WatchSharesRequest {
            device: "gen-1".into(),
            namespace: "team-b".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(snapshot(&mut w).await.is_empty());

    // Three shares the filter excludes, then one it matches: the first event the watcher
    // sees must be the matching one.
    for (uid, ns, dev) in [
        ("wf-1", "team-a", "gen-1"),
        ("wf-2", "team-b", "gen-0"),
        ("wf-3", "team-a", "gen-0"),
    ] {
        let r = prepare_one(
            &mut c,
            1,
            claim(uid, ns, "alloc-1", vec![alloc(dev, &share_id(), "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{uid}: {r:?}");
    }
    let id = share_id();
    let r = prepare_one(
        &mut c,
        1,
        claim(
            "wf-4",
            "team-b",
            "alloc-1",
            vec![alloc("gen-1", &id, "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let ev = next(&mut w).await;
    assert_eq!(ev.kind, Kind::Changed as i32, "{ev:?}");
    assert_eq!(ev.share.map(|s| s.share_id), Some(id));
}
