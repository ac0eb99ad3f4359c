//! I7: every decision is one JSON line in the audit log, naming the tenant, claim,
//! shareID, device, amounts, policy version, decision and reason.

use serde_json::json;
use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, prepare_one, proto as pb, share_id, take_epoch,
    unprepare_one,
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
    take_epoch(&mut c, 4).await;
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
        ("caller_policy_version", json!("v1")),
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

/// One request under the message size limit used to write a line per allocation, each
/// repeating the request's strings unchecked: megabytes of log, enough to rotate every
/// earlier decision away. Now a request writes at most one line per claim, each line is
/// small whatever the request held, and nothing in it can drive a terminal.
#[tokio::test]
async fn one_request_cannot_flood_the_audit_log() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let before = std::fs::read(&a.audit_log).unwrap_or_default().len();
    // Escape, C1 CSI, DEL and a bidi override: what a terminal would act on.
    let nasty = "\u{1b}[2J\u{9b}31m\u{7f}\u{202e}";
    // One claim with 10,000 allocations (the bound is 32), each with a 200-byte shareID.
    let wide = claim(
        "flood-wide",
        "team-a",
        "alloc-1",
        (0..10_000)
            .map(|i| alloc("gen-0", &format!("{nasty}{i:0>190}"), "5Gi"))
            .collect(),
    );
    // And as many claims as a request may carry, each with an 8 KiB namespace.
    let mut claims = vec![wide];
    for i in 1..128 {
        claims.push(claim(
            &format!("flood-{i}"),
            &format!("{nasty}{}", "n".repeat(8 << 10)),
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ));
    }
    let r = a
        .client()
        .await
        .prepare(pb::PrepareRequest { epoch: 0, claims })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims.len(), 128);
    assert!(r.claims.values().all(|c| c.error.is_some()), "all refused");

    let text = std::fs::read(&a.audit_log).unwrap();
    let new = &text[before..];
    let lines: Vec<&[u8]> = new
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines.len(), 128, "one line per refused claim");
    let longest = lines.iter().map(|l| l.len()).max().unwrap();
    assert!(longest < 3 << 10, "a line of {longest} bytes");
    let s = String::from_utf8(new.to_vec()).unwrap();
    for c in ['\u{1b}', '\u{9b}', '\u{7f}', '\u{202e}'] {
        assert!(!s.contains(c), "{c:?} written raw into the audit log");
    }
    let wide: serde_json::Value = serde_json::from_slice(lines[0]).unwrap();
    assert_eq!(wide["claim_uid"], "flood-wide", "{wide}");
    assert!(
        wide["reason"].as_str().unwrap().contains("allocations"),
        "the reason names the field: {wide}"
    );

    // The table a person reads shows no control character either, whatever the file
    // holds: a line written by hand into the file is escaped too.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&a.audit_log)
        .unwrap();
    std::io::Write::write_all(
        &mut f,
        format!(
            "{}\n",
            json!({"time": "2026-01-01T00:00:00Z", "decision": "refuse", "tenant": nasty, "reason": "a\nb"})
        )
        .as_bytes(),
    )
    .unwrap();
    let o = a.cli(&["audit", "--file", a.audit_log.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8(o.stdout).unwrap();
    for c in ['\u{1b}', '\u{9b}', '\u{7f}', '\u{202e}'] {
        assert!(!table.contains(c), "{c:?} printed raw:\n{table}");
    }
    let written = text.iter().filter(|b| **b == b'\n').count();
    assert_eq!(
        table.lines().count(),
        1 + written + 1,
        "a header, the agent's lines and the hand-written one, one row each:\n{table}"
    );
}

/// A start with another config than the last one is a decision too: its digest and
/// the devices it adds and removes. A start with the same config writes nothing.
#[test]
fn a_changed_config_is_audited_at_start() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "20Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let configs = |a: &Agent| -> Vec<String> {
        a.audit_lines()
            .iter()
            .filter(|l| l["decision"] == "config")
            .map(|l| l["reason"].as_str().unwrap().to_owned())
            .collect()
    };
    let first = configs(&a);
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(
        first[0].starts_with("first start recorded on this store: config sha256 ")
            && first[0].ends_with("devices: gen-0"),
        "{}",
        first[0]
    );
    a.restart();
    assert_eq!(configs(&a).len(), 1, "the same config audited again");

    let text = std::fs::read_to_string(&a.config).unwrap();
    let more = format!(
        "{text}{}",
        generic_device("gen-1", "10Gi", "5Gi", &["team-a"], &[])
    );
    std::fs::write(&a.config, more).unwrap();
    a.restart();
    let all = configs(&a);
    assert_eq!(all.len(), 2, "{all:?}");
    assert!(
        all[1].starts_with("config changed since the last start: sha256 ")
            && all[1].contains("devices added: [gen-1]; removed: []"),
        "{}",
        all[1]
    );
}
