//! The writer's bound: rotation at the bound, `keep` honoured, no line lost or split (also
//! under concurrent writers), and a restart that continues the existing file.

use std::{collections::BTreeMap, path::Path, sync::Arc};

use super::{AuditLine, AuditLog, Bound, Decision, query, rotated_path};

/// Writes line `i` of writer `claim`. Its length does not depend on `i` (for i < 10,000),
/// so the tests can place the bound between line counts exactly.
fn put(log: &AuditLog, claim: &str, i: usize) {
    log.write(&line(&format!("{claim}-{i:04}")));
}

fn line(uid: &str) -> AuditLine<'_> {
    AuditLine {
        time: "2025-01-01T00:00:00.000Z".into(),
        decision: Decision::Admit,
        reason: "admitted",
        tenant: "team-a",
        claim_uid: uid,
        claim_name: "c",
        share_id: "",
        device: "gen-0",
        amounts: BTreeMap::from([("memory".to_owned(), "1Gi".to_owned())]),
        policy_version: "",
        allocation_id: "a",
        epoch: 1,
        caller_uid: Some(0),
        code: None,
    }
}

/// As written: with its `prev` and its newline.
fn line_len() -> u64 {
    let obj = serde_json::to_vec(&line("c-0000")).unwrap();
    super::chain::chained(obj, &super::chain::GENESIS)
        .unwrap()
        .len() as u64
        + 1
}

/// A bound that fits exactly `n` lines of [`line`].
fn bound_of(n: u64, keep: u32) -> Bound {
    Bound {
        max_bytes: n * line_len(),
        keep,
    }
}

fn uids(path: &Path) -> Vec<String> {
    query::read(path)
        .unwrap()
        .map(|e| e.unwrap().record.claim_uid)
        .collect()
}

fn file_uids(path: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{} ends in a partial line",
        path.display()
    );
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["claim_uid"].as_str().unwrap().to_owned()
        })
        .collect()
}

fn expected(claim: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{claim}-{i:04}")).collect()
}

#[test]
fn rotates_when_the_next_line_would_pass_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&path, bound_of(3, 4)).unwrap();
    for i in 0..3 {
        put(&log, "c", i);
    }
    assert!(
        !rotated_path(&path, 1).exists(),
        "three lines fit exactly: no rotation yet"
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 3 * line_len());
    put(&log, "c", 3);
    assert_eq!(file_uids(&rotated_path(&path, 1)), expected("c", 0..3));
    assert_eq!(file_uids(&path), expected("c", 3..4));
    assert!(!rotated_path(&path, 2).exists());
}

#[test]
fn keeps_only_keep_rotated_files_and_drops_the_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(&path, bound_of(3, 2)).unwrap();
    for i in 0..20 {
        put(&log, "c", i);
    }
    // 20 lines, 3 a file: 0..18 rotated out in six files, 18..20 current.
    assert_eq!(file_uids(&path), expected("c", 18..20));
    assert_eq!(file_uids(&rotated_path(&path, 1)), expected("c", 15..18));
    assert_eq!(file_uids(&rotated_path(&path, 2)), expected("c", 12..15));
    assert!(!rotated_path(&path, 3).exists(), "keep = 2");
    assert_eq!(uids(&path), expected("c", 12..20));
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 3, "no temporary files left behind: {names:?}");
}

#[test]
fn no_line_is_lost_or_split_across_many_rotations() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    // A bound that is not a whole number of lines: the rotation has to go before a line
    // that would straddle it, not cut it.
    let bound = Bound {
        max_bytes: 5 * line_len() + line_len() / 2,
        keep: 100,
    };
    let log = AuditLog::open(&path, bound).unwrap();
    for i in 0..203 {
        put(&log, "c", i);
    }
    assert_eq!(uids(&path), expected("c", 0..203));
    let files = query::log_files(&path).unwrap();
    assert_eq!(
        files.len(),
        41,
        "40 rotations of 5 lines, 3 in the current file"
    );
    for (n, f) in files.iter().enumerate() {
        let len = std::fs::metadata(f).unwrap().len();
        assert!(len <= bound.max_bytes, "{} has {len} bytes", f.display());
        let want = if n == 40 { 3 } else { 5 };
        assert_eq!(file_uids(f).len(), want, "{}", f.display());
    }
    assert!(rotated_path(&path, 40).exists() && !rotated_path(&path, 41).exists());
}

#[test]
fn concurrent_writers_each_keep_their_order_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = Arc::new(AuditLog::open(&path, bound_of(7, 1000)).unwrap());
    let writers: Vec<_> = (0..8)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0..150 {
                    put(&log, &format!("t{t}"), i);
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let all = uids(&path);
    assert_eq!(all.len(), 8 * 150);
    for t in 0..8 {
        let prefix = format!("t{t}-");
        let mine: Vec<String> = all
            .iter()
            .filter(|u| u.starts_with(&prefix))
            .cloned()
            .collect();
        assert_eq!(mine, expected(&format!("t{t}"), 0..150));
    }
    for f in query::log_files(&path).unwrap() {
        assert!(std::fs::metadata(&f).unwrap().len() <= 7 * line_len());
    }
}

#[test]
fn a_restart_appends_and_counts_the_existing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    {
        let log = AuditLog::open(&path, bound_of(3, 4)).unwrap();
        put(&log, "c", 0);
        put(&log, "c", 1);
    }
    let log = AuditLog::open(&path, bound_of(3, 4)).unwrap();
    put(&log, "c", 2);
    assert!(!rotated_path(&path, 1).exists());
    // Had the restart started counting at zero, this line would still fit.
    put(&log, "c", 3);
    assert_eq!(file_uids(&rotated_path(&path, 1)), expected("c", 0..3));
    assert_eq!(file_uids(&path), expected("c", 3..4));
}

#[test]
fn a_line_longer_than_the_bound_gets_a_file_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    let log = AuditLog::open(
        &path,
        Bound {
            max_bytes: 10,
            keep: 10,
        },
    )
    .unwrap();
    for i in 0..4 {
        put(&log, "c", i);
    }
    assert_eq!(uids(&path), expected("c", 0..4));
    for f in query::log_files(&path).unwrap() {
        assert_eq!(file_uids(&f).len(), 1, "{}", f.display());
    }
}

#[test]
fn a_partial_last_line_from_before_a_restart_is_closed_not_continued() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    std::fs::write(&path, "{\"time\":\"2025-01-01T00:00:00Z\",\"deci").unwrap();
    let log = AuditLog::open(&path, Bound::default()).unwrap();
    put(&log, "c", 0);
    let read: Vec<_> = query::read(&path).unwrap().collect();
    assert_eq!(read.len(), 2);
    assert!(
        matches!(&read[0], Err(query::LineError::Malformed { line: 1, .. })),
        "{read:?}"
    );
    assert_eq!(read[1].as_ref().unwrap().record.claim_uid, "c-0000");
}

#[test]
fn rotated_files_past_a_lowered_keep_are_removed_at_the_next_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    {
        let log = AuditLog::open(&path, bound_of(1, 6)).unwrap();
        for i in 0..7 {
            put(&log, "c", i);
        }
    }
    assert!(rotated_path(&path, 6).exists());
    let log = AuditLog::open(&path, bound_of(1, 2)).unwrap();
    put(&log, "c", 7);
    assert!(rotated_path(&path, 2).exists());
    assert!(!rotated_path(&path, 3).exists() && !rotated_path(&path, 6).exists());
    assert_eq!(uids(&path), expected("c", 5..8));
}

/// The chain goes on across a rotation and a reopen, from the last line written.
#[test]
fn the_chain_continues_across_rotation_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("audit.jsonl");
    {
        let log = AuditLog::open(&path, bound_of(2, 4)).unwrap();
        for i in 0..3 {
            put(&log, "c", i);
        }
    }
    // The current file holds one line; the next one opens on it.
    let log = AuditLog::open(&path, bound_of(2, 4)).unwrap();
    put(&log, "c", 3);
    put(&log, "c", 4);
    let v = super::chain::verify(&path).unwrap();
    assert_eq!(
        (v.chained, v.from_genesis, v.unchained, v.breaks.len()),
        (4, true, 0, 0),
        "{v:?}"
    );
}
