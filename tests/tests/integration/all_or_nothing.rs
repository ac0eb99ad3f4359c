//! A claim is all-or-nothing: when one of its allocations does not fit, none of it holds
//! capacity, on any device, whatever the order of its allocations.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use shareguard_tests::{
    Agent, Options, all_shares, alloc, claim, device, generic_device, prepare_one, proto as pb,
    share_id,
};

fn two_devices() -> Options {
    Options::new(format!(
        "{}{}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]),
        generic_device("gen-1", "20Gi", "5Gi", &["team-a"], &[])
    ))
}

async fn refused_claim_holds_nothing(first_fits: bool) {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    // Fill gen-1 so that any further share of it does not fit.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "filler",
            "team-a",
            "alloc-1",
            vec![alloc("gen-1", &share_id(), "20Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let before = c
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();

    let (fits, full) = (share_id(), share_id());
    let mut allocations = vec![alloc("gen-0", &fits, "10Gi"), alloc("gen-1", &full, "5Gi")];
    if !first_fits {
        allocations.reverse();
    }
    let full_index = if first_fits { 1 } else { 0 };
    let r = prepare_one(&mut c, 0, claim("both", "team-a", "alloc-1", allocations)).await;
    let e = r.error.clone().expect("the claim does not fit on gen-1");
    assert_eq!(e.code, "ResourceExhausted", "{e:?}");
    assert_eq!(
        e.field,
        format!("claims[0].allocations[{full_index}].consumed_capacity[memory]"),
        "{e:?}"
    );
    assert!(r.shares.is_empty(), "{r:?}");

    let after = c
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(after, before, "neither device may change");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "0");
    let held: Vec<pb::ShareStatus> = all_shares(&mut c)
        .await
        .into_iter()
        .filter(|s| s.claim.as_ref().is_some_and(|c| c.uid == "both"))
        .filter(|s| s.phase != pb::Phase::Failed as i32 && s.phase != pb::Phase::Released as i32)
        .collect();
    assert!(
        held.is_empty(),
        "a share of the refused claim holds capacity: {held:?}"
    );
    for id in [fits, full] {
        let e = c
            .get_share(pb::GetShareRequest { share_id: id })
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            tonic::Code::NotFound,
            "a refused claim leaves no record: {e:?}"
        );
    }
}

#[tokio::test]
async fn two_device_claim_refused_when_the_second_does_not_fit() {
    refused_claim_holds_nothing(true).await;
}

#[tokio::test]
async fn two_device_claim_refused_when_the_first_does_not_fit() {
    refused_claim_holds_nothing(false).await;
}

#[tokio::test]
async fn two_allocations_of_one_claim_on_one_device_are_summed() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    // Each fits alone (15Gi of 20Gi), together they do not: the ledger must add up the
    // claim's own allocations, not check each against the same free amount.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "pair",
            "team-a",
            "alloc-1",
            vec![
                alloc("gen-1", &share_id(), "15Gi"),
                alloc("gen-1", &share_id(), "15Gi"),
            ],
        ),
    )
    .await;
    let e = r.error.clone().expect("30Gi does not fit in 20Gi");
    assert_eq!(e.code, "ResourceExhausted", "{e:?}");
    assert_eq!(
        e.field, "claims[0].allocations[1].consumed_capacity[memory]",
        "{e:?}"
    );
    assert_eq!(device(&mut c, "gen-1").await.allocated["memory"], "0");
    assert!(all_shares(&mut c).await.is_empty());
}
