//! `/metrics`, `/healthz` and `/readyz`: the ledger gauges say what ListDevices says, and
//! the refusal counter moves with refusals and only with them.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, gib, prepare_one, share_id, unprepare_one,
};

const GIB: f64 = (1u64 << 30) as f64;

/// The value of the series `name` whose labels include `labels`, if it is exposed.
fn sample(body: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
        let set = rest.strip_suffix('}')?;
        let all = labels
            .iter()
            .all(|(k, v)| set.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        (n == name && all).then(|| value.parse().unwrap())
    })
}

fn memory(body: &str, name: &str) -> f64 {
    sample(body, name, &[("device", "gen-0"), ("capacity", "memory")])
        .unwrap_or_else(|| panic!("no {name} for gen-0:\n{body}"))
}

/// A counter that has not counted yet may not be exposed at all.
fn refusals(a: &Agent, code: &str) -> f64 {
    sample(
        &a.http("/metrics").1,
        "shareguard_refusals_total",
        &[("rpc", "Prepare"), ("reason", code)],
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn ledger_gauges_match_list_devices() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    for (uid, amount) in [("m-1", "5Gi"), ("m-2", "10Gi")] {
        let r = prepare_one(
            &mut c,
            1,
            claim(
                uid,
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &share_id(), amount)],
            ),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    let (code, body) = a.http("/metrics");
    assert_eq!(code, 200);
    let d = device(&mut c, "gen-0").await;
    assert_eq!(memory(&body, "shareguard_device_capacity"), 20.0 * GIB);
    assert_eq!(memory(&body, "shareguard_device_allocated"), 15.0 * GIB);
    assert_eq!(
        memory(&body, "shareguard_device_allocated"),
        gib(&d.allocated["memory"]) as f64 * GIB
    );
    assert_eq!(
        memory(&body, "shareguard_device_free"),
        gib(&d.free["memory"]) as f64 * GIB
    );
    assert_eq!(
        sample(
            &body,
            "shareguard_device_live_shares",
            &[("device", "gen-0")]
        ),
        Some(2.0)
    );
    assert_eq!(
        sample(&body, "shareguard_shares", &[("phase", "ACCOUNTED")]),
        Some(2.0)
    );

    // The gauges follow a release, so they are computed from the ledger, not remembered.
    assert_eq!(unprepare_one(&mut c, 1, "m-2").await.code, "");
    let body = a.http("/metrics").1;
    assert_eq!(memory(&body, "shareguard_device_allocated"), 5.0 * GIB);
    assert_eq!(memory(&body, "shareguard_device_free"), 15.0 * GIB);
    assert_eq!(
        sample(&body, "shareguard_shares", &[("phase", "RELEASED")]),
        Some(1.0)
    );
}

#[tokio::test]
async fn refusal_counter_counts_refusals_by_code() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        1,
        claim(
            "rc-fill",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "20Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(
        refusals(&a, "ResourceExhausted"),
        0.0,
        "an admission is not a refusal"
    );

    let r = prepare_one(
        &mut c,
        1,
        claim(
            "rc-full",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    assert_eq!(
        r.error.map(|e| e.code),
        Some("ResourceExhausted".to_owned())
    );
    assert_eq!(refusals(&a, "ResourceExhausted"), 1.0);

    let r = prepare_one(
        &mut c,
        1,
        claim(
            "rc-bad",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "7Gi")],
        ),
    )
    .await;
    assert_eq!(r.error.map(|e| e.code), Some("InvalidArgument".to_owned()));
    assert_eq!(refusals(&a, "InvalidArgument"), 1.0);
    assert_eq!(
        refusals(&a, "ResourceExhausted"),
        1.0,
        "each refusal is counted under its own code"
    );
}

#[tokio::test]
async fn health_and_readiness_endpoints() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    assert_eq!(a.http("/healthz").0, 200);
    assert_eq!(a.http("/readyz").0, 200);
    assert_eq!(
        a.http("/no-such-page").0,
        404,
        "a 200 for everything would make the two above meaningless"
    );
}
