//! I7: every decision is one JSON line in the audit log, naming the tenant, claim,
//! shareID, device, amounts, policy version, decision and reason.

use serde_json::json;
use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, prepare_one, share_id, unprepare_one,
};

#[tokio::test]
async fn admit_refuse_and_release_are_each_audited_in_full() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    let (ok, full) = (share_id(), share_id());
    let r = prepare_one(
        &mut c,
        4,
        claim(
            "aud-ok",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &ok, "20Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let r = prepare_one(
        &mut c,
        4,
        claim(
            "aud-full",
            "team-a",
            "alloc-9",
            vec![alloc("gen-0", &full, "5Gi")],
        ),
    )
    .await;
    assert!(r.error.is_some(), "{r:?}");
    assert_eq!(unprepare_one(&mut c, 4, "aud-ok").await.code, "");

    let lines = a.audit_lines();
    let of = |uid: &str, decision: &str| {
        let found: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|l| l["claim_uid"] == uid && l["decision"] == decision)
            .collect();
        assert_eq!(found.len(), 1, "one {decision} line for {uid}: {lines:#?}");
        found[0].clone()
    };

    let admit = of("aud-ok", "admit");
    for (k, v) in [
        ("tenant", json!("team-a")),
        ("claim_name", json!("claim-aud-ok")),
        ("share_id", json!(ok)),
        ("device", json!("gen-0")),
        ("amounts", json!({"memory": "20Gi"})),
        ("policy_version", json!("v1")),
        ("allocation_id", json!("alloc-1")),
        ("epoch", json!(4)),
        ("caller_uid", json!(0)),
    ] {
        assert_eq!(admit[k], v, "admit line field {k}: {admit}");
    }
    assert!(
        admit["time"].as_str().is_some_and(|t| t.ends_with('Z')),
        "RFC 3339 UTC time: {admit}"
    );
    assert!(
        admit["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{admit}"
    );

    let refuse = of("aud-full", "refuse");
    for (k, v) in [
        ("share_id", json!(full)),
        ("amounts", json!({"memory": "5Gi"})),
        ("allocation_id", json!("alloc-9")),
        ("code", json!("ResourceExhausted")),
    ] {
        assert_eq!(refuse[k], v, "refuse line field {k}: {refuse}");
    }
    assert!(
        refuse["reason"]
            .as_str()
            .is_some_and(|r| r.contains("gen-0")),
        "the reason says what was full: {refuse}"
    );

    let release = of("aud-ok", "release");
    assert_eq!(
        (release["share_id"].clone(), release["caller_uid"].clone()),
        (json!(ok), json!(0)),
        "{release}"
    );
    assert!(
        lines
            .iter()
            .all(|l| l["decision"] != "admit" || l["claim_uid"] != "aud-full"),
        "a refused claim was also admitted"
    );
}
