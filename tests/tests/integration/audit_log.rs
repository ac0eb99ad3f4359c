//! The audit log's size bound and `shareguard audit`, on the real binary: an agent with a
//! tiny `audit_max_bytes` rotates its log while it works, no file passes the bound (audit
//! lines are far shorter than it here; only a single line longer than the bound may make a
//! file exceed it, see agent/src/audit), nothing is lost across rotations and a restart,
//! and the command reads the files back in order with its filters.
#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{fs, path::Path};

use serde_json::Value;
use shareguard_tests::{
    Agent, Options, alloc, claim, generic_device, prepare_one, share_id, unprepare_one,
};

const BOUND: u64 = 2048;

/// Every line of the log as (file name, line text), reading the files directly: rotated
/// ones from the highest number (oldest) down, then the current file.
fn lines_on_disk(log: &Path) -> Vec<(String, String)> {
    let dir = log.parent().unwrap();
    let base = log.file_name().unwrap().to_str().unwrap();
    let mut rotated: Vec<(u32, String)> = fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let n = name.strip_prefix(base)?.strip_prefix('.')?.parse().ok()?;
            Some((n, name))
        })
        .collect();
    rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut files: Vec<String> = rotated.into_iter().map(|(_, n)| n).collect();
    files.push(base.to_owned());
    let mut out = Vec::new();
    for f in files {
        let text = fs::read_to_string(dir.join(&f)).unwrap();
        assert!(
            text.is_empty() || text.ends_with('\n'),
            "{f} ends in a partial line"
        );
        out.extend(text.lines().map(|l| (f.clone(), l.to_owned())));
    }
    out
}

fn field(line: &str, k: &str) -> String {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    v[k].as_str().unwrap_or_default().to_owned()
}

/// Runs `shareguard audit ARGS` and returns its stdout lines; fails on a non-zero exit.
fn audit(a: &Agent, args: &[&str]) -> Vec<String> {
    let config = a.config.to_str().unwrap();
    let mut all = vec!["audit", "--config", config];
    all.extend_from_slice(args);
    let out = a.cli(&all);
    assert!(
        out.status.success(),
        "shareguard {all:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn a_bounded_log_rotates_and_audit_reads_it_back_in_order() {
    let mut opts = Options::new(generic_device(
        "gen-0",
        "100Gi",
        "1Gi",
        &["team-a", "team-b"],
        &[],
    ));
    opts.agent_extra = format!("audit_max_bytes = {BOUND}\naudit_keep = 100\n");
    let mut a = Agent::start(opts);
    let mut c = a.client().await;

    // Twelve claims in two namespaces, two refusals, then half the claims released.
    let uid = |i: usize| format!("log-{i:02}");
    for i in 0..12 {
        let ns = if i % 2 == 0 { "team-a" } else { "team-b" };
        let sid = share_id();
        let r = prepare_one(
            &mut c,
            0,
            claim(&uid(i), ns, "alloc-1", vec![alloc("gen-0", &sid, "1Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    for (u, ns) in [("log-refused-ns", "team-c"), ("log-refused-big", "team-a")] {
        let sid = share_id();
        let amount = if ns == "team-c" { "1Gi" } else { "1000Gi" };
        let r = prepare_one(
            &mut c,
            0,
            claim(u, ns, "alloc-1", vec![alloc("gen-0", &sid, amount)]),
        )
        .await;
        assert!(r.error.is_some(), "{u} must be refused: {r:?}");
    }
    for i in (0..12).step_by(2) {
        assert_eq!(unprepare_one(&mut c, 0, &uid(i)).await.code, "");
    }

    // A crash and restart on the same log: the agent continues the current file, and
    // what it writes afterwards lands after everything from before.
    a.restart();
    let mut c = a.client().await;
    assert_eq!(unprepare_one(&mut c, 0, &uid(1)).await.code, "");

    let disk = lines_on_disk(&a.audit_log);
    let files: Vec<&String> = {
        let mut f: Vec<&String> = disk.iter().map(|(f, _)| f).collect();
        f.dedup();
        f
    };
    assert!(
        files.len() >= 4,
        "a {BOUND}-byte bound must rotate this log several times: {files:?}"
    );
    for f in &files {
        let len = fs::metadata(a.dir.path().join(f)).unwrap().len();
        assert!(len <= BOUND, "{f} has {len} bytes, more than {BOUND}");
    }
    // Every decision is there once and in the order it was taken: each claim's admit
    // before its release, the release after the restart last.
    let decisions_of = |u: &str| -> Vec<String> {
        disk.iter()
            .filter(|(_, l)| field(l, "claim_uid") == u)
            .map(|(_, l)| field(l, "decision"))
            .collect()
    };
    for i in 0..12 {
        let want: &[&str] = match i {
            1 => &["admit", "release"],
            i if i % 2 == 0 => &["admit", "release"],
            _ => &["admit"],
        };
        assert_eq!(decisions_of(&uid(i)), want, "{}", uid(i));
    }
    let (last_file, last) = disk.last().unwrap();
    assert_eq!(
        (last_file.as_str(), field(last, "claim_uid").as_str()),
        ("audit.jsonl", "log-01")
    );

    // --claim: exactly that claim's lines, as written, in order, across files.
    let want: Vec<&str> = disk
        .iter()
        .filter(|(_, l)| field(l, "claim_uid") == "log-00")
        .map(|(_, l)| l.as_str())
        .collect();
    let spans: Vec<&String> = {
        let mut s: Vec<&String> = disk
            .iter()
            .filter(|(_, l)| field(l, "claim_uid") == "log-00")
            .map(|(f, _)| f)
            .collect();
        s.dedup();
        s
    };
    assert!(
        spans.len() > 1,
        "log-00's lines should span files: {spans:?}"
    );
    assert_eq!(audit(&a, &["--claim", "log-00", "-o", "json"]), want);
    let by_file = {
        let out = a.cli(&[
            "audit",
            "--file",
            a.audit_log.to_str().unwrap(),
            "--claim",
            "log-00",
            "-o",
            "json",
        ]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(by_file.lines().collect::<Vec<_>>(), want, "--file");

    // --decision: only refusals, both of them.
    let refused = audit(&a, &["--decision", "refuse", "-o", "json"]);
    let uids: Vec<String> = refused.iter().map(|l| field(l, "claim_uid")).collect();
    assert_eq!(uids, ["log-refused-ns", "log-refused-big"], "{refused:#?}");
    assert!(refused.iter().all(|l| field(l, "decision") == "refuse"));

    // --namespace with --decision: team-b's six admits.
    let b = audit(
        &a,
        &["--namespace", "team-b", "--decision", "admit", "-o", "json"],
    );
    assert_eq!(b.len(), 6, "{b:#?}");
    assert!(b.iter().all(|l| field(l, "tenant") == "team-b"));

    // --limit: the most recent N of everything, oldest of them first.
    let all: Vec<&str> = disk.iter().map(|(_, l)| l.as_str()).collect();
    assert_eq!(
        audit(&a, &["--limit", "3", "-o", "json"]),
        all[all.len() - 3..]
    );
    assert_eq!(audit(&a, &["-o", "json"]), all, "no filter: the whole log");
    assert_eq!(
        audit(&a, &["--since", "2000-01-01T00:00:00Z", "-o", "json"]).len(),
        all.len()
    );
    assert_eq!(
        audit(&a, &["--since", "2h", "--decision", "refuse", "-o", "json"]).len(),
        2
    );
    assert_eq!(
        audit(&a, &["--since", "2999-01-01T00:00:00Z", "-o", "json"]).len(),
        0,
        "nothing is from the future"
    );

    // The table: a header and one row per line.
    let table = audit(&a, &["--claim", "log-00"]);
    assert!(
        table[0].starts_with("TIME") && table[0].contains("AMOUNTS"),
        "{table:#?}"
    );
    assert_eq!(table.len(), 1 + want.len(), "{table:#?}");
    assert!(table[1].contains("admit") && table[1].contains("memory=1Gi"));
}

#[tokio::test]
async fn a_malformed_line_is_reported_and_skipped_and_keep_is_honoured() {
    let mut opts = Options::new(generic_device("gen-0", "100Gi", "1Gi", &["team-a"], &[]));
    opts.agent_extra = format!("audit_max_bytes = {BOUND}\naudit_keep = 2\n");
    let a = Agent::start(opts);
    let mut c = a.client().await;
    for i in 0..30 {
        let sid = share_id();
        let u = format!("keep-{i:02}");
        let r = prepare_one(
            &mut c,
            0,
            claim(&u, "team-a", "alloc-1", vec![alloc("gen-0", &sid, "1Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    let rotated = |n: u32| a.dir.path().join(format!("audit.jsonl.{n}"));
    assert!(rotated(1).exists() && rotated(2).exists());
    assert!(!rotated(3).exists(), "audit_keep = 2");
    let disk = lines_on_disk(&a.audit_log);
    assert!(
        field(&disk[0].1, "claim_uid") != "keep-00",
        "the oldest lines were dropped"
    );
    assert_eq!(field(&disk.last().unwrap().1, "claim_uid"), "keep-29");

    // A rotated file is no longer written to: corrupt one of its lines.
    let one = rotated(1);
    let text = fs::read_to_string(&one).unwrap();
    let n_lines = text.lines().count();
    fs::write(&one, format!("{text}this is not json\n")).unwrap();
    let config = a.config.to_str().unwrap();
    let out = a.cli(&["audit", "--config", config, "-o", "json"]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("audit.jsonl.1:{}:", n_lines + 1)),
        "names the file and line: {stderr}"
    );
    let shown = String::from_utf8(out.stdout).unwrap();
    let want: Vec<&str> = disk.iter().map(|(_, l)| l.as_str()).collect();
    assert_eq!(
        shown.lines().collect::<Vec<_>>(),
        want,
        "the rest is all there"
    );

    // An unknown decision is refused by the command, not silently matched to nothing.
    let out = a.cli(&["audit", "--config", config, "--decision", "admitted"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("admitted"));
}

/// Each line carries the hash of the one before it, across rotations and a restart:
/// `shareguard audit --verify` passes on the log as written and names the place where a
/// line was removed or edited. Every file of the log is private to root.
#[tokio::test]
async fn the_chain_finds_a_removed_or_edited_line() {
    use std::os::unix::fs::PermissionsExt;
    let mut opts = Options::new(generic_device("gen-0", "100Gi", "1Gi", &["team-a"], &[]));
    opts.agent_extra = format!("audit_max_bytes = {BOUND}\naudit_keep = 100\n");
    let mut a = Agent::start(opts);
    let mut c = a.client().await;
    for i in 0..6 {
        let r = prepare_one(
            &mut c,
            0,
            claim(
                &format!("chain-{i}"),
                "team-a",
                "alloc-1",
                vec![alloc("gen-0", &share_id(), "1Gi")],
            ),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    a.restart();
    let mut c = a.client().await;
    for i in 0..6 {
        assert_eq!(
            unprepare_one(&mut c, 0, &format!("chain-{i}")).await.code,
            ""
        );
    }
    let verify = |a: &Agent| {
        let config = a.config.to_str().unwrap().to_owned();
        let o = a.cli(&["audit", "--config", &config, "--verify"]);
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (code, out, err) = verify(&a);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("intact") && out.contains("first line ever written"),
        "{out}"
    );

    let disk = lines_on_disk(&a.audit_log);
    assert!(disk.len() >= 12, "{disk:?}");
    let mut files: Vec<String> = disk.iter().map(|(f, _)| f.clone()).collect();
    files.dedup();
    assert!(files.len() >= 3, "rotated several times: {files:?}");
    for f in &files {
        let mode = fs::metadata(a.dir.path().join(f))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{f}: mode {mode:o}");
    }

    // Remove the first line of a rotated file in the middle of the log: the chain breaks
    // at the line that followed it.
    let victim = &files[1];
    let path = a.dir.path().join(victim);
    let original = fs::read_to_string(&path).unwrap();
    let rest: String = original.lines().skip(1).map(|l| format!("{l}\n")).collect();
    fs::write(&path, &rest).unwrap();
    let (code, _, err) = verify(&a);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("{victim}:1:")), "{err}");

    // Put it back and edit a decision instead.
    fs::write(&path, &original).unwrap();
    assert_eq!(verify(&a).0, Some(0));
    fs::write(&path, original.replacen("\"admit\"", "\"refuse\"", 1)).unwrap();
    let (code, _, err) = verify(&a);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("edited"), "{err}");
    fs::write(&path, &original).unwrap();
}
