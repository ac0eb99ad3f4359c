//! `ListShares` in pages: every share that exists throughout a listing is on exactly one
//! page, in the listing's order, while shares are admitted and released between pages;
//! a token the agent did not issue is refused by name; and a node with 100k shares lists
//! whole through the CLI, within gRPC's default message size.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::collections::BTreeSet;

use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, net, prepare_one, proto as pb, share_id,
    unprepare_one,
};

async fn page(
    c: &mut shareguard_tests::Client,
    size: u32,
    token: String,
) -> Result<pb::ListSharesResponse, tonic::Status> {
    c.list_shares(pb::ListSharesRequest {
        page_size: size,
        page_token: token,
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

#[tokio::test]
async fn each_share_is_on_one_page_while_shares_come_and_go() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "1Ti",
        "1Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    // Claim names sort in the listing order: claim-p00 .. claim-p39.
    let mut ids = Vec::new();
    for i in 0..40 {
        let id = share_id();
        let uid = format!("p{i:02}");
        let r = prepare_one(
            &mut c,
            0,
            claim(&uid, "team-a", "a1", vec![alloc("gen-0", &id, "1Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
        ids.push((uid, id));
    }
    let (mut seen, mut names) = (Vec::new(), Vec::new());
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let p = page(&mut c, 7, token).await.unwrap();
        assert!(
            p.shares.len() <= 7,
            "{} shares on a page of 7",
            p.shares.len()
        );
        seen.extend(p.shares.iter().map(|s| s.share_id.clone()));
        names.extend(
            p.shares
                .iter()
                .map(|s| s.claim.clone().unwrap_or_default().name),
        );
        pages += 1;
        // Between pages: one share already listed and one not yet listed are released
        // (both stay as tombstones, so both are still listed once), and a new claim
        // is admitted at each end of the order.
        if pages == 2 {
            assert_eq!(unprepare_one(&mut c, 0, "p03").await.code, "");
            assert_eq!(unprepare_one(&mut c, 0, "p30").await.code, "");
            for uid in ["a-first", "z-last"] {
                let r = prepare_one(
                    &mut c,
                    0,
                    claim(
                        uid,
                        "team-a",
                        "a1",
                        vec![alloc("gen-0", &share_id(), "1Gi")],
                    ),
                )
                .await;
                assert_eq!(r.error, None, "{r:?}");
            }
        }
        if p.next_page_token.is_empty() {
            break;
        }
        token = p.next_page_token;
    }
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a share listed twice: {seen:?}");
    for (uid, id) in &ids {
        assert!(unique.contains(id), "{uid} ({id}) never listed");
    }
    // The claim admitted after the listing passed its place is not there; the one
    // ahead of it is, and everything came in order.
    assert_eq!(seen.len(), ids.len() + 1, "{names:?}");
    assert!(!names.contains(&"claim-a-first".to_owned()), "{names:?}");
    assert_eq!(names.last().map(String::as_str), Some("claim-z-last"));
    assert!(names.is_sorted(), "out of order: {names:?}");
    assert!(pages >= 6, "{pages} pages");

    let e = page(&mut c, 7, "zz".into()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("page_token"), "{}", e.message());
    let all = page(&mut c, 100_000, String::new()).await.unwrap();
    assert_eq!((all.shares.len(), all.next_page_token.as_str()), (42, ""));
}

/// 100k shares: more than one answer could carry at gRPC's default 4 MiB, so the CLI
/// must page. Each claim carries 32 shares, each Prepare 32 claims.
#[tokio::test]
async fn a_hundred_thousand_shares_list_through_the_cli() {
    const N: usize = 100_000;
    let mut o = Options::new(generic_device("gen-0", "100Ti", "1Mi", &["team-a"], &[]));
    o.agent_extra = "max_claims_per_request = 32".into();
    let a = Agent::start(o);
    let _busy = net::TrafficLock::busy();
    let mut c = a.client().await;
    let mut ids = BTreeSet::new();
    let mut n = 0;
    while n < N {
        let mut claims = Vec::new();
        for _ in 0..32 {
            let allocs: Vec<_> = (0..32.min(N - n))
                .map(|_| {
                    let id = share_id();
                    ids.insert(id.clone());
                    alloc("gen-0", &id, "1Mi")
                })
                .collect();
            if allocs.is_empty() {
                break;
            }
            n += allocs.len();
            claims.push(claim(&format!("big-{n}"), "team-a", "a1", allocs));
        }
        let r = c
            .prepare(pb::PrepareRequest { epoch: 0, claims })
            .await
            .unwrap()
            .into_inner();
        for (uid, cr) in &r.claims {
            assert_eq!(cr.error, None, "{uid}: {cr:?}");
        }
    }
    assert_eq!(ids.len(), N);
    let out = a.cli(&["-o", "json", "shares"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed: BTreeSet<String> = v["shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["shareId"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(listed.len(), N);
    assert!(
        listed == ids,
        "the CLI listed other shares than were admitted"
    );
}
