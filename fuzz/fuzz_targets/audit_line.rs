//! Audit lines from arbitrary caller strings: never a panic, always one line of valid
//! JSON whose length is bounded whatever the input, with no control or bidi character
//! written raw, and the chain's `prev` as its last field.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use shareguard::audit::{AuditLine, Decision, bound, chain};

/// Ten capped fields, the reason, and the amounts: far above any real line, and far
/// below what an uncapped request could write.
const MAX_LINE: usize = 10 * (bound::MAX_FIELD_BYTES + 64)
    + bound::MAX_REASON_BYTES
    + (bound::MAX_AMOUNTS + 1) * (2 * bound::MAX_AMOUNT_BYTES + 64)
    + 1024;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let parts: Vec<&str> = text.split('\u{0}').collect();
    let part = |i: usize| parts.get(i).copied().unwrap_or("");
    let amounts: BTreeMap<String, String> = parts
        .iter()
        .skip(8)
        .map(|p| (p.to_string(), p.chars().rev().collect()))
        .collect();
    let line = AuditLine {
        time: "2026-01-01T00:00:00.000Z".into(),
        decision: Decision::Refuse,
        reason: part(0),
        tenant: part(1),
        claim_uid: part(2),
        claim_name: part(3),
        share_id: part(4),
        device: part(5),
        amounts,
        policy_version: part(6),
        allocation_id: part(7),
        epoch: u64::MAX,
        caller_uid: Some(0),
        code: Some(part(8)),
    };
    let obj = serde_json::to_vec(&line).expect("an audit line serializes");
    let written = chain::chained(obj, &chain::hash(data)).expect("an object");
    assert!(written.len() <= MAX_LINE, "{} bytes", written.len());
    let s = std::str::from_utf8(&written).expect("UTF-8");
    assert!(
        !s.chars()
            .any(|c| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c)),
        "a raw control character"
    );
    let v: serde_json::Value = serde_json::from_str(s).expect("valid JSON");
    assert_eq!(v["prev"], chain::hex(&chain::hash(data)));
});
