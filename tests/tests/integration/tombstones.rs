//! Released shares are kept as tombstones for the retention period, then swept; live
//! shares are never swept, and the sweep is durable.

use std::time::{Duration, Instant};

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, get_share, prepare_one, proto as pb,
    share_id, unprepare_one,
};

const SWEEP_DEADLINE: Duration = Duration::from_secs(20);

#[tokio::test]
async fn released_tombstones_are_swept_after_retention_and_live_shares_stay() {
    let mut opts = Options::new(generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]));
    opts.agent_extra = "tombstone_retention = \"1s\"".into();
    let mut a = Agent::start(opts);
    let mut c = a.client().await;
    let (gone, kept) = (share_id(), share_id());
    let gone_claim = claim(
        "tomb-gone",
        "team-a",
        "alloc-1",
        vec![alloc("gen-0", &gone, "10Gi")],
    );
    assert_eq!(prepare_one(&mut c, 0, gone_claim.clone()).await.error, None);
    assert_eq!(
        prepare_one(
            &mut c,
            0,
            claim(
                "tomb-kept",
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &kept, "5Gi")]
            )
        )
        .await
        .error,
        None
    );
    assert_eq!(unprepare_one(&mut c, 0, "tomb-gone").await.code, "");

    // Right after the release the tombstone is there, for audit.
    let s = get_share(&mut c, gone.clone()).await;
    assert_eq!(s.phase, pb::Phase::Released as i32);

    let deadline = Instant::now() + SWEEP_DEADLINE;
    loop {
        match c
            .get_share(pb::GetShareRequest {
                share_id: gone.clone(),
            })
            .await
        {
            Err(e) if e.code() == tonic::Code::NotFound => break,
            Err(e) => panic!("{e:?}"),
            Ok(_) => {
                assert!(
                    Instant::now() < deadline,
                    "tombstone not swept within {SWEEP_DEADLINE:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // The sweep is a decision in the audit log, written once the removal is durable.
    let swept = |id: &str| {
        a.audit_lines()
            .iter()
            .filter(|l| l["decision"] == "sweep" && l["share_id"] == id)
            .count()
    };
    while swept(&gone) == 0 {
        assert!(
            Instant::now() < deadline,
            "no sweep line in the audit log within {SWEEP_DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((swept(&gone), swept(&kept)), (1, 0));
    let s = get_share(&mut c, kept.clone()).await;
    assert_eq!(
        s.phase,
        pb::Phase::Accounted as i32,
        "a live share must never be swept: {s:?}"
    );
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "5Gi");

    a.restart();
    let mut c = a.client().await;
    let e = c
        .get_share(pb::GetShareRequest { share_id: gone })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        tonic::Code::NotFound,
        "the sweep was not persisted: {e:?}"
    );
    // With its records gone, the claim can be prepared again from scratch.
    let r = prepare_one(&mut c, 0, gone_claim).await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "15Gi");
}

/// Tombstones are capped by count as well as by age: with `tombstone_max = 2`, five
/// released claims leave the two most recent at the next sweep, long before their
/// retention ends, each removal audited with its reason; a live share is never counted.
#[tokio::test]
async fn tombstones_beyond_the_count_cap_go_oldest_first() {
    let mut opts = Options::new(generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]));
    // The sweep runs every retention/4: within 2 s the cap has swept, and the age not
    // before 8 s.
    opts.agent_extra = "tombstone_retention = \"8s\"\ntombstone_max = 2".into();
    let a = Agent::start(opts);
    let mut c = a.client().await;
    let live = share_id();
    assert_eq!(
        prepare_one(
            &mut c,
            0,
            claim(
                "cap-live",
                "team-a",
                "a1",
                vec![alloc("gen-0", &live, "5Gi")]
            )
        )
        .await
        .error,
        None
    );
    let ids: Vec<String> = (0..5).map(|_| share_id()).collect();
    for (i, id) in ids.iter().enumerate() {
        let uid = format!("cap-{i}");
        let r = prepare_one(
            &mut c,
            0,
            claim(&uid, "team-a", "a1", vec![alloc("gen-0", id, "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(unprepare_one(&mut c, 0, &uid).await.code, "");
    }
    let exists = |c: &mut shareguard_tests::proto::node_agent_client::NodeAgentClient<
        tonic::transport::Channel,
    >,
                  id: String| {
        let mut c = c.clone();
        async move {
            match c.get_share(pb::GetShareRequest { share_id: id }).await {
                Ok(_) => true,
                Err(e) if e.code() == tonic::Code::NotFound => false,
                Err(e) => panic!("{e:?}"),
            }
        }
    };
    let deadline = Instant::now() + SWEEP_DEADLINE;
    loop {
        let mut kept = Vec::new();
        for id in &ids {
            kept.push(exists(&mut c, id.clone()).await);
        }
        if kept == [false, false, false, true, true] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the three oldest tombstones were not swept by count: {kept:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        exists(&mut c, live.clone()).await,
        "a live share is never swept"
    );
    let lines = a.audit_lines();
    let by_count = lines
        .iter()
        .filter(|l| {
            l.to_string()
                .contains("as one of the oldest beyond tombstone_max 2")
        })
        .count();
    assert!(by_count >= 3, "{lines:?}");
}
