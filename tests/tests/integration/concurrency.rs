//! I1 under contention: many Prepares racing for one device never admit more than fits,
//! and what was admitted is still exactly what is held after a restart.

use shareguard_tests::{
    Agent, Options, all_shares, alloc, claim, device, generic_device, net, prepare_one,
    proto as pb, share_id,
};

const RACERS: usize = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn sixty_four_racing_prepares_admit_exactly_what_fits() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let _busy = net::TrafficLock::busy();
    // Separate connections, so the calls really arrive at the agent concurrently rather
    // than queued behind one another on one HTTP/2 connection's flow control.
    let mut clients = Vec::with_capacity(RACERS);
    for _ in 0..RACERS {
        clients.push(a.client().await);
    }
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let start = start.clone();
            tokio::spawn(async move {
                let id = share_id();
                let uid = format!("race-{i}");
                start.wait().await;
                let r = prepare_one(
                    &mut c,
                    0,
                    claim(&uid, "team-a", "alloc-1", vec![alloc("gen-0", &id, "5Gi")]),
                )
                .await;
                (id, r)
            })
        })
        .collect();
    let mut admitted = Vec::new();
    let mut exhausted = 0;
    for t in tasks {
        let (id, r) = t.await.unwrap();
        match &r.error {
            None => {
                assert_eq!(r.shares.len(), 1, "{r:?}");
                assert_eq!(r.shares[0].phase, pb::Phase::Accounted as i32, "{r:?}");
                admitted.push(id);
            }
            Some(e) => {
                assert_eq!(e.code, "ResourceExhausted", "{e:?}");
                assert!(r.shares.is_empty(), "a refused claim holds nothing: {r:?}");
                exhausted += 1;
            }
        }
    }
    assert_eq!(admitted.len(), 4, "20Gi holds exactly four 5Gi shares");
    assert_eq!(exhausted, RACERS - 4);

    let check = async |a: &Agent| {
        let mut c = a.client().await;
        let d = device(&mut c, "gen-0").await;
        assert_eq!(d.allocated["memory"], d.capacity["memory"], "{d:?}");
        assert_eq!(
            (d.free["memory"].as_str(), d.live_shares),
            ("0", 4),
            "{d:?}"
        );
        // Refused claims leave no record behind, not even a FAILED one.
        let mut held: Vec<String> = all_shares(&mut c)
            .await
            .into_iter()
            .map(|s| s.share_id)
            .collect();
        held.sort();
        let mut want = admitted.clone();
        want.sort();
        assert_eq!(held, want);
    };
    check(&a).await;
    a.restart();
    check(&a).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn racing_retries_of_one_claim_count_it_once() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let _busy = net::TrafficLock::busy();
    let id = share_id();
    // A kubelet retry racing the first attempt: the same claim, allocation and shareID
    // from many callers at once must admit one share and answer all of them with it.
    let mut clients = Vec::new();
    for _ in 0..16 {
        clients.push(a.client().await);
    }
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            let id = id.clone();
            tokio::spawn(async move {
                prepare_one(
                    &mut c,
                    0,
                    claim(
                        "retry",
                        "team-a",
                        "alloc-1",
                        vec![alloc("gen-0", &id, "5Gi")],
                    ),
                )
                .await
            })
        })
        .collect();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(
            r.shares
                .iter()
                .map(|s| s.share_id.as_str())
                .collect::<Vec<_>>(),
            [id.as_str()]
        );
    }
    let mut c = a.client().await;
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "5Gi");
    a.restart();
    let mut c = a.client().await;
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "5Gi");
}

/// Many durable writes in flight at once must all complete. sled 0.34's `flush_async`
/// deadlocked its own thread pool under this load (found by the benchmark with 16
/// clients); the agent now makes writes durable on one writer thread, and this test keeps
/// it that way. The deadline only turns a hang into a failure; it measures nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 8)]
async fn many_concurrent_durable_prepares_and_releases_all_complete() {
    const CLIENTS: usize = 32;
    const ROUNDS: usize = 8;
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "1000Gi",
        "1Gi",
        &["team-a"],
        &[],
    )));
    let _busy = net::TrafficLock::busy();
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let mut c = a.client().await;
        tasks.push(tokio::spawn(async move {
            for round in 0..ROUNDS {
                let uid = format!("load-{i}-{round}");
                let r = prepare_one(
                    &mut c,
                    0,
                    claim(
                        &uid,
                        "team-a",
                        "a1",
                        vec![alloc("gen-0", &share_id(), "1Gi")],
                    ),
                )
                .await;
                assert_eq!(r.error, None, "{r:?}");
                if round % 2 == 1 {
                    let u = shareguard_tests::unprepare_one(&mut c, 0, &uid).await;
                    assert_eq!(u.code, "", "{u:?}");
                }
            }
        }));
    }
    let all = futures_join(tasks);
    tokio::time::timeout(std::time::Duration::from_secs(120), all)
        .await
        .expect("concurrent durable writes hung: the agent stopped answering");
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    // Half of every client's rounds stay prepared.
    assert_eq!(d.live_shares as usize, CLIENTS * ROUNDS / 2, "{d:?}");
    assert_eq!(d.allocated["memory"], format!("{}Gi", CLIENTS * ROUNDS / 2));
}

async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        if let Err(e) = t.await {
            panic!("a client task failed: {e}");
        }
    }
}
