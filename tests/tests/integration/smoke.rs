//! The harness itself works: an agent starts, answers, and is ready again after SIGKILL.

use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, get_share, proto as pb, share_id,
};

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
            epoch: 0,
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
    let s = get_share(&mut a.client().await, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Accounted as i32);
}
