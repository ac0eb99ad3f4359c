//! I6 durability: SIGKILL the agent in the middle of a stream of Prepares and Unprepares.
//! After a restart every acknowledged operation is there, nothing is counted twice, and
//! the device's allocation is exactly the sum over the shares that hold capacity.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use shareguard_tests::{
    Agent, Options, all_shares, alloc, claim, claim_ref, device, generic_device, gib, net,
    proto as pb, share_id,
};
use tokio::sync::watch;

const WORKERS: usize = 4;
/// Acknowledgements to wait for before the kill: enough that both kinds of operation are
/// acknowledged many times over, few enough to keep the test quick.
const ACKS_BEFORE_KILL: usize = 120;
const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Journal {
    /// Every Prepare sent, acknowledged or not: uid -> (shareID, GiB).
    attempted: HashMap<String, (String, u64)>,
    /// uids whose Prepare was acknowledged as admitted.
    prepared: HashSet<String>,
    /// uids whose Unprepare was sent, acknowledged or not.
    releasing: HashSet<String>,
    /// uids whose Unprepare was acknowledged as released.
    released: HashSet<String>,
}

/// Prepares claims one after another and releases every second one, recording each
/// acknowledgement, until a call fails because the agent is gone.
async fn worker(
    w: usize,
    mut c: pb::node_agent_client::NodeAgentClient<tonic::transport::Channel>,
    journal: Arc<Mutex<Journal>>,
    acks: watch::Sender<usize>,
) {
    for k in 0.. {
        let uid = format!("crash-{w}-{k}");
        let id = share_id();
        let amount = 1 + (k % 3);
        journal
            .lock()
            .unwrap()
            .attempted
            .insert(uid.clone(), (id.clone(), amount));
        let req = pb::PrepareRequest {
            epoch: 0,
            claims: vec![claim(
                &uid,
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &id, &format!("{amount}Gi"))],
            )],
        };
        let Ok(r) = c.prepare(req).await else { return };
        let r = &r.get_ref().claims[&uid];
        assert_eq!(
            r.error, None,
            "the device has room for every claim of this test: {r:?}"
        );
        journal.lock().unwrap().prepared.insert(uid.clone());
        acks.send_modify(|n| *n += 1);

        if k % 2 == 1 {
            let prev = format!("crash-{w}-{}", k - 1);
            journal.lock().unwrap().releasing.insert(prev.clone());
            let req = pb::UnprepareRequest {
                epoch: 0,
                claims: vec![claim_ref(&prev)],
                only_pre_bind: false,
            };
            let Ok(r) = c.unprepare(req).await else {
                return;
            };
            assert_eq!(r.get_ref().claims[&prev].code, "", "{r:?}");
            journal.lock().unwrap().released.insert(prev);
            acks.send_modify(|n| *n += 1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_mid_stream_loses_no_acknowledged_operation() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "4Ti",
        "1Gi",
        &["team-a"],
        &[],
    )));
    let _busy = net::TrafficLock::busy();
    let journal = Arc::new(Mutex::new(Journal::default()));
    let (acks, mut seen) = watch::channel(0usize);
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        workers.push(tokio::spawn(worker(
            w,
            a.client().await,
            journal.clone(),
            acks.clone(),
        )));
    }
    tokio::time::timeout(DEADLINE, seen.wait_for(|n| *n >= ACKS_BEFORE_KILL))
        .await
        .expect("the workers were not acknowledged in time")
        .unwrap();
    a.kill9();
    for w in workers {
        // Each worker stops at its first failed call; one that never fails would mean the
        // agent was not killed.
        tokio::time::timeout(DEADLINE, w)
            .await
            .expect("a worker kept going after the kill")
            .unwrap();
    }

    a.restart();
    // Every worker has stopped: the journal is final.
    let j = std::mem::take(&mut *journal.lock().unwrap());
    assert!(
        j.released.len() >= 10 && j.prepared.len() >= 10,
        "too few acknowledgements to prove anything"
    );
    let mut c = a.client().await;
    let shares = all_shares(&mut c).await;
    let by_id: HashMap<&str, &pb::ShareStatus> =
        shares.iter().map(|s| (s.share_id.as_str(), s)).collect();
    assert_eq!(
        by_id.len(),
        shares.len(),
        "a shareID appears twice: {shares:#?}"
    );

    for s in &shares {
        let uid = &s.claim.as_ref().unwrap().uid;
        let (id, amount) = j
            .attempted
            .get(uid)
            .unwrap_or_else(|| panic!("share of a claim never sent: {s:?}"));
        assert_eq!(&s.share_id, id, "{s:?}");
        assert_eq!(
            s.limits
                .iter()
                .map(|l| l.requested.as_str())
                .collect::<Vec<_>>(),
            [format!("{amount}Gi")]
        );
        // Accounting shares are written in their final phase, so a crash can leave
        // nothing half-prepared to explain.
        assert!(
            s.phase == pb::Phase::Accounted as i32 || s.phase == pb::Phase::Released as i32,
            "unexpected phase after the crash: {s:?}"
        );
    }
    for uid in &j.prepared {
        let (id, _) = &j.attempted[uid];
        let s = by_id
            .get(id.as_str())
            .unwrap_or_else(|| panic!("acknowledged Prepare of {uid} lost"));
        if j.released.contains(uid) {
            assert_eq!(
                s.phase,
                pb::Phase::Released as i32,
                "acknowledged release of {uid} lost: {s:?}"
            );
        } else if !j.releasing.contains(uid) {
            // (A release in flight at the kill may have happened or not.)
            assert_eq!(
                s.phase,
                pb::Phase::Accounted as i32,
                "acknowledged share of {uid} does not hold capacity: {s:?}"
            );
        }
    }

    let holding: Vec<&pb::ShareStatus> = shares
        .iter()
        .filter(|s| s.phase == pb::Phase::Accounted as i32)
        .collect();
    let sum: u64 = holding.iter().map(|s| gib(&s.limits[0].requested)).sum();
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        gib(&d.allocated["memory"]),
        sum,
        "allocated is not the sum over live shares: {d:?}"
    );
    assert_eq!(gib(&d.free["memory"]), 4096 - sum, "{d:?}");
    assert_eq!(d.live_shares as usize, holding.len(), "{d:?}");

    // Releasing everything that is left frees the device completely: nothing was counted
    // twice, and nothing the store forgot is still counted.
    let live: Vec<pb::ClaimRef> = holding
        .iter()
        .map(|s| claim_ref(&s.claim.as_ref().unwrap().uid))
        .collect();
    for chunk in live.chunks(100) {
        let r = c
            .unprepare(pb::UnprepareRequest {
                epoch: 0,
                claims: chunk.to_vec(),
                only_pre_bind: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.claims.values().all(|e| e.code.is_empty()), "{r:?}");
    }
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("0", 0),
        "{d:?}"
    );
}
