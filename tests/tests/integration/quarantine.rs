//! One unreadable record does not stop the node: the agent starts, the record is kept as
//! found in the store's quarantine, reported (an UNKNOWN share with the reason, a metric,
//! an audit line), and what it held stays reserved where that can be read. A record of
//! a newer format whose device and amounts still read keeps its capacity on that device;
//! one that reads not at all stops admission on every device until its claim is
//! unprepared.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, get_share, metric_sample, prepare_one,
    proto as pb, share_id, unprepare_one,
};

#[tokio::test]
async fn an_unreadable_record_is_quarantined_and_the_rest_load() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    let (newer, damaged, fine) = (share_id(), share_id(), share_id());
    for (uid, id) in [
        ("q-newer", &newer),
        ("q-damaged", &damaged),
        ("q-fine", &fine),
    ] {
        let r = prepare_one(
            &mut c,
            0,
            claim(uid, "team-a", "a1", vec![alloc("gen-0", id, "5Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    drop(c);
    a.kill9();

    // A newer agent's format byte over today's JSON, and a value that is not JSON at all.
    let store = a.state_dir.join("store");
    let garbage = vec![0x07, 0xde, 0xad, 0xbe, 0xef];
    {
        let db = sled::open(&store).unwrap();
        let shares = db.open_tree("shares").unwrap();
        let mut v = shares.get(newer.as_bytes()).unwrap().unwrap().to_vec();
        v[0] = 3;
        shares.insert(newer.as_bytes(), v).unwrap();
        shares.insert(damaged.as_bytes(), garbage.clone()).unwrap();
        // An index record, as an earlier version kept for every claim: the claim's index
        // is rebuilt from the shares that name the claim.
        let claims = db.open_tree("claims").unwrap();
        claims.insert("q-fine", garbage.clone()).unwrap();
        db.flush().unwrap();
    }
    a.start_again();
    let mut c = a.client().await;

    let s = get_share(&mut c, newer.clone()).await;
    assert_eq!(s.phase, pb::Phase::Unknown as i32, "{s:?}");
    assert!(
        s.reason.contains("is unreadable (value format 3 is newer")
            && s.reason
                .contains("stays reserved on device gen-0 until claim q-newer"),
        "{}",
        s.reason
    );
    // Nothing tells which claim a value that is not JSON belonged to: the store keeps
    // no second copy of that, so its stand-in gets a claim uid of its own.
    let damaged_claim = format!("quarantined-{damaged}");
    let s = get_share(&mut c, damaged.clone()).await;
    assert_eq!(s.phase, pb::Phase::Unknown as i32, "{s:?}");
    assert!(
        s.reason.contains(&format!(
            "no device admits new shares until claim {damaged_claim} is unprepared"
        )),
        "{}",
        s.reason
    );
    assert_eq!(
        get_share(&mut c, fine.clone()).await.phase,
        pb::Phase::Accounted as i32
    );
    // The newer record's 5Gi stays held; the damaged one's amount cannot be known.
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");

    let (_, body) = a.http("/metrics");
    assert_eq!(
        metric_sample(&body, "shareguard_store_quarantined_records", &[]),
        Some(3.0)
    );
    let lines = a.audit_lines();
    let q: Vec<_> = lines
        .iter()
        .filter(|l| l["decision"] == "quarantine")
        .collect();
    assert_eq!(q.len(), 3, "{q:?}");
    assert!(
        q.iter()
            .any(|l| l["share_id"] == newer.as_str() && l["device"] == "gen-0")
    );

    // Nothing is admitted while the damaged record may hold capacity anywhere.
    let extra = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim("q-new", "team-a", "a1", vec![alloc("gen-0", &extra, "5Gi")]),
    )
    .await;
    let e = r.error.expect("admitted over an unreadable record");
    assert_eq!(e.code, "Unavailable", "{e:?}");
    assert!(e.message.contains(&damaged_claim), "{}", e.message);

    // Its claim unprepared, admission resumes; the newer record's capacity is still held.
    assert_eq!(unprepare_one(&mut c, 0, &damaged_claim).await.code, "");
    let r = prepare_one(
        &mut c,
        0,
        claim("q-new", "team-a", "a1", vec![alloc("gen-0", &extra, "5Gi")]),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "15Gi");
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "q-over",
            "team-a",
            "a1",
            vec![alloc("gen-0", &share_id(), "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error.map(|e| e.code), Some("ResourceExhausted".into()));

    // The claim whose index entry was rebuilt releases its share.
    assert_eq!(unprepare_one(&mut c, 0, "q-fine").await.code, "");
    assert_eq!(
        get_share(&mut c, fine.clone()).await.phase,
        pb::Phase::Released as i32
    );

    // The originals are kept as found, even where the key was written since.
    drop(c);
    a.kill9();
    {
        let db = sled::open(&store).unwrap();
        let q = db.open_tree("quarantine").unwrap();
        assert_eq!(q.len(), 3);
        let kept = q
            .get(format!("shares/{damaged}").as_bytes())
            .unwrap()
            .unwrap();
        assert_eq!(kept.as_ref(), garbage.as_slice());
        assert_eq!(
            q.get(format!("shares/{newer}").as_bytes())
                .unwrap()
                .unwrap()[0],
            3
        );
    }
    a.start_again();
    let mut c = a.client().await;
    assert_eq!(
        get_share(&mut c, damaged).await.phase,
        pb::Phase::Released as i32
    );
    assert_eq!(
        get_share(&mut c, newer).await.phase,
        pb::Phase::Unknown as i32
    );
    let (_, body) = a.http("/metrics");
    assert_eq!(
        metric_sample(&body, "shareguard_store_quarantined_records", &[]),
        Some(3.0)
    );
}
