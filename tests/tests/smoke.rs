//! The harness itself works: an agent starts, answers, and is ready again after SIGKILL.

use shareguard_tests::{Agent, Options, alloc, claim, generic_device, proto as pb, share_id};

#[tokio::test]
async fn prepare_survives_sigkill() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let id = share_id();
    let r = a
        .client()
        .await
        .prepare(pb::PrepareRequest {
            epoch: 1,
            claims: vec![claim(
                "c1",
                "team-a",
                "a1",
                vec![alloc("gen-0", &id, "10Gi")],
            )],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims["c1"].error, None, "{r:?}");
    a.restart();
    let s = a
        .client()
        .await
        .get_share(pb::GetShareRequest {
            share_id: id.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.phase, pb::Phase::Accounted as i32);
}
