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

/// The kubelet plugin keeps a watch open for good: a stopping agent must not wait for
/// it to close (it would wait for the SIGKILL at the end of its pod's grace period, on
/// every node of a DaemonSet update).
#[tokio::test]
async fn an_open_watch_does_not_hold_a_stopping_agent() {
    let mut agent = Agent::start(Options::new(generic_device(
        "gen-0",
        "10Gi",
        "1Gi",
        &["*"],
        &[],
    )));
    let mut client = agent.client().await;
    let mut stream = client
        .watch_shares(pb::WatchSharesRequest::default())
        .await
        .unwrap()
        .into_inner();
    snapshot(&mut stream).await;
    // Blocks this test's runtime while the agent stops; the stream stays open.
    let stopped = agent.terminate(Duration::from_secs(20));
    let (status, _) =
        stopped.unwrap_or_else(|| panic!("the agent did not stop:\n{}", agent.log_text()));
    assert!(status.success(), "{status}:\n{}", agent.log_text());
    assert!(
        agent
            .log_text()
            .contains("streams still open; closing them"),
        "{}",
        agent.log_text()
    );
    drop(stream);
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
        0,
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
        0,
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

    assert_eq!(unprepare_one(&mut c, 0, "w-new").await.code, "");
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
            0,
            claim(uid, ns, "alloc-1", vec![alloc(dev, &share_id(), "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{uid}: {r:?}");
    }
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
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

/// Many watchers at once each see every transition, in order; a watcher that never
/// reads does not hold the agent back (the changes keep being answered), and once it
/// reads it gets the changes it missed in order, or a fresh snapshot if it fell too far
/// behind.
#[tokio::test]
async fn many_watchers_see_every_transition_and_a_stuck_one_blocks_nothing() {
    const CLAIMS: usize = 300;
    const WATCHERS: usize = 8;
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    let open = || async {
        let mut w = a
            .client()
            .await
            .watch_shares(pb::WatchSharesRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert!(snapshot(&mut w).await.is_empty());
        w
    };
    let stuck = open().await;
    let mut watchers = Vec::new();
    for _ in 0..WATCHERS {
        watchers.push(open().await);
    }
    let ids: Vec<String> = (0..CLAIMS).map(|_| share_id()).collect();
    let readers: Vec<_> = watchers
        .into_iter()
        .map(|mut w| {
            let ids = ids.clone();
            tokio::spawn(async move {
                for id in &ids {
                    assert_eq!(changed(&mut w, id).await.phase, pb::Phase::Accounted as i32);
                    assert_eq!(changed(&mut w, id).await.phase, pb::Phase::Released as i32);
                }
            })
        })
        .collect();
    // Far more changes than one watcher's queue holds: the stuck watcher's queue is
    // full long before the end.
    for (i, id) in ids.iter().enumerate() {
        let uid = format!("many-{i}");
        let r = prepare_one(
            &mut c,
            0,
            claim(&uid, "team-a", "a", vec![alloc("gen-0", id, "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(unprepare_one(&mut c, 0, &uid).await.code, "");
    }
    for r in readers {
        r.await.expect("a watcher missed or reordered a transition");
    }
    // The stuck watcher, read at last: each share's transitions in order, or, if it lost
    // events, a snapshot to start again from.
    let mut stuck = stuck;
    let mut last: std::collections::HashMap<String, i32> = Default::default();
    let mut seen = 0;
    while seen < 2 * CLAIMS {
        let ev = next(&mut stuck).await;
        match Kind::try_from(ev.kind) {
            Ok(Kind::Changed) => {
                let s = ev.share.unwrap();
                let before = last.insert(s.share_id.clone(), s.phase);
                if s.phase == pb::Phase::Released as i32 {
                    assert_eq!(before, Some(pb::Phase::Accounted as i32), "{s:?}");
                }
                seen += 1;
            }
            // Resynchronised: everything is in the snapshot, which ends the check.
            Ok(Kind::Snapshot) | Ok(Kind::SnapshotEnd) => break,
            other => panic!("{other:?}"),
        }
    }
}

/// Streams are bounded in number: past `max_watchers` a watch is refused with
/// RESOURCE_EXHAUSTED, and a client that goes away (without any change to wake its
/// stream) frees its slot.
#[tokio::test]
async fn watchers_are_bounded_and_a_closed_one_frees_its_slot() {
    let mut o = Options::new(generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]));
    o.agent_extra = "max_watchers = 2".into();
    let a = Agent::start(o);
    let mut c = a.client().await;
    let open = |mut c: shareguard_tests::Client| async move {
        c.watch_shares(pb::WatchSharesRequest::default()).await
    };
    let mut w1 = open(c.clone()).await.unwrap().into_inner();
    let w2 = open(c.clone()).await.unwrap().into_inner();
    snapshot(&mut w1).await;
    let refused = open(c.clone()).await.unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("max_watchers"), "{refused:?}");

    // The second client leaves; nothing changes meanwhile. Its slot comes free.
    drop(w2);
    let deadline = std::time::Instant::now() + EVENT_TIMEOUT;
    let mut w3 = loop {
        match open(c.clone()).await {
            Ok(s) => break s.into_inner(),
            Err(e) => {
                assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
                assert!(
                    std::time::Instant::now() < deadline,
                    "a closed watcher never freed its slot"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Both remaining streams still work.
    let id = share_id();
    prepare_one(
        &mut c,
        0,
        claim("w-b", "team-a", "a1", vec![alloc("gen-0", &id, "5Gi")]),
    )
    .await;
    snapshot(&mut w3).await;
    assert_eq!(changed(&mut w1, &id).await.share_id, id);
}
