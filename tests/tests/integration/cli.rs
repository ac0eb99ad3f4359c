//! The `shareguard` CLI against a running agent: tables for people, proto3 canonical JSON
//! (camelCase) for scripts, and exit status 1 with the reason on stderr for a refusal.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::process::Output;

use serde_json::{Value, json};
use shareguard_tests::{
    Agent, DRIVER, Options, POOL, agent_bin, all_shares, alloc, claim, device, generic_device,
    get_share, prepare_one, proto as pb, share_id, take_epoch, unprepare_one,
};

fn two_devices() -> Options {
    Options::new(format!(
        "{}{}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a", "team-b"], &[]),
        generic_device("gen-1", "20Gi", "5Gi", &["team-a", "team-b"], &[])
    ))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs the CLI, requires success and returns stdout.
fn ok(a: &Agent, args: &[&str]) -> String {
    let o = a.cli(args);
    assert!(
        o.status.success(),
        "shareguard {args:?} failed ({}):\n{}",
        o.status,
        stderr(&o)
    );
    stdout(&o)
}

fn ok_json(a: &Agent, args: &[&str]) -> Value {
    let mut full = vec!["-o", "json"];
    full.extend_from_slice(args);
    let out = ok(a, &full);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("shareguard {args:?}: not JSON ({e}):\n{out}"))
}

/// proto3 JSON leaves empty repeated fields out.
fn share_ids(v: &Value) -> Vec<String> {
    let mut ids: Vec<String> = v["shares"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| s["shareId"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default();
    ids.sort();
    ids
}

/// The line of a table whose first column is `first`.
fn row<'a>(table: &'a str, first: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(first))
        .unwrap_or_else(|| panic!("no row {first:?} in:\n{table}"))
}

#[tokio::test]
async fn devices_in_table_and_json() {
    let a = Agent::start(two_devices());
    take_epoch(&mut a.client().await, 2).await;
    let r = prepare_one(
        &mut a.client().await,
        2,
        claim(
            "cli-dev",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &share_id(), "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let table = ok(&a, &["devices"]);
    assert!(table.starts_with("DEVICE"), "a header first:\n{table}");
    let cols: Vec<&str> = row(&table, "gen-0").split_whitespace().collect();
    assert_eq!(
        cols[..7],
        [
            "gen-0",
            DRIVER,
            POOL,
            "generic",
            "memory=40Gi",
            "memory=10Gi",
            "memory=30Gi"
        ],
        "{table}"
    );
    let cols: Vec<&str> = row(&table, "gen-1").split_whitespace().collect();
    assert_eq!(
        cols[4..7],
        ["memory=20Gi", "memory=0", "memory=20Gi"],
        "{table}"
    );

    let v = ok_json(&a, &["devices"]);
    // Canonical JSON writes uint64 as a string.
    assert_eq!(v["epoch"], "2", "{v}");
    let d = &v["devices"][0];
    assert_eq!(d["name"], "gen-0");
    assert_eq!(d["capacity"], json!({"memory": "40Gi"}));
    assert_eq!(d["allocated"], json!({"memory": "10Gi"}));
    assert_eq!(d["free"], json!({"memory": "30Gi"}));
    assert_eq!(d["liveShares"], 1, "camelCase field names: {d}");
    assert_eq!(d["allowedNamespaces"], json!(["team-a", "team-b"]));
    assert_eq!(d["policy"]["memory"]["validRange"]["step"], "5Gi", "{d}");
}

#[tokio::test]
async fn shares_in_table_and_json_with_filters() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let (a0, b1, gone) = (share_id(), share_id(), share_id());
    for (uid, ns, dev, id) in [
        ("cli-a0", "team-a", "gen-0", &a0),
        ("cli-b1", "team-b", "gen-1", &b1),
        ("cli-gone", "team-a", "gen-1", &gone),
    ] {
        let r = prepare_one(
            &mut c,
            0,
            claim(uid, ns, "alloc-1", vec![alloc(dev, id, "10Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    assert_eq!(unprepare_one(&mut c, 0, "cli-gone").await.code, "");

    let table = ok(&a, &["shares"]);
    assert!(table.starts_with("SHARE"), "a header first:\n{table}");
    let cols: Vec<&str> = row(&table, &a0).split_whitespace().collect();
    assert_eq!(
        cols[..7],
        [
            a0.as_str(),
            "team-a/claim-cli-a0",
            "gen-0",
            "ACCOUNTED",
            "accounting-only",
            "memory=10Gi",
            "memory=-"
        ],
        "{table}"
    );
    assert!(row(&table, &gone).contains("RELEASED"), "{table}");

    let v = ok_json(&a, &["shares"]);
    let mut want = vec![a0.clone(), b1.clone(), gone.clone()];
    want.sort();
    assert_eq!(share_ids(&v), want);
    let s = v["shares"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["shareId"] == a0.as_str())
        .unwrap();
    assert_eq!(s["phase"], "ACCOUNTED", "{s}");
    assert_eq!(
        s["claim"],
        json!({"uid": "cli-a0", "namespace": "team-a", "name": "claim-cli-a0"})
    );
    assert_eq!(
        s["limits"],
        json!([{"name": "memory", "requested": "10Gi"}]),
        "nothing enforced is shown as nothing: {s}"
    );
    assert_eq!(s["allocationId"], "alloc-1");

    let mut gen1 = vec![b1.clone(), gone.clone()];
    gen1.sort();
    assert_eq!(
        share_ids(&ok_json(&a, &["shares", "--device", "gen-1"])),
        gen1
    );
    assert_eq!(
        share_ids(&ok_json(&a, &["shares", "--namespace", "team-b"])),
        std::slice::from_ref(&b1)
    );
    assert_eq!(
        share_ids(&ok_json(&a, &["shares", "--phase", "released"])),
        std::slice::from_ref(&gone)
    );
    assert_eq!(
        share_ids(&ok_json(
            &a,
            &["shares", "--phase", "ACCOUNTED", "--device", "gen-1"]
        )),
        std::slice::from_ref(&b1)
    );
    assert_eq!(
        share_ids(&ok_json(&a, &["shares", "--namespace", "team-z"])),
        Vec::<String>::new()
    );

    let o = a.cli(&["shares", "--phase", "sleeping"]);
    assert!(
        !o.status.success(),
        "an unknown phase must fail, not list everything"
    );
    assert!(stderr(&o).contains("sleeping"), "{}", stderr(&o));
}

#[tokio::test]
async fn one_share_in_table_and_json() {
    let a = Agent::start(two_devices());
    let id = share_id();
    let r = prepare_one(
        &mut a.client().await,
        0,
        claim(
            "cli-one",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "15Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let table = ok(&a, &["share", &id]);
    let cols: Vec<&str> = row(&table, &id).split_whitespace().collect();
    assert_eq!(
        cols[1..6],
        [
            "team-a/claim-cli-one",
            "gen-0",
            "ACCOUNTED",
            "accounting-only",
            "memory=15Gi"
        ],
        "{table}"
    );

    let v = ok_json(&a, &["share", &id]);
    assert_eq!(v["shareId"], id.as_str());
    assert_eq!(v["device"], "gen-0");
    assert_eq!(v["phase"], "ACCOUNTED");
    assert_eq!(v["limits"][0]["requested"], "15Gi");
    let status: Value = serde_json::from_str(v["deviceStatusJson"].as_str().unwrap()).unwrap();
    assert_eq!(status["data"]["requested"]["memory"], "15Gi");

    let missing = share_id();
    let o = a.cli(&["share", &missing]);
    assert!(!o.status.success(), "an unknown share must fail");
    assert!(stderr(&o).contains("not found"), "{}", stderr(&o));
}

fn prepare_json(uid: &str, id: &str, memory: &str) -> String {
    json!({
        "epoch": "3",
        "claims": [{
            "claim": {"uid": uid, "namespace": "team-a", "name": format!("claim-{uid}")},
            "allocationId": "alloc-1",
            "target": {"podUids": ["0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88"]},
            "allocations": [{
                "request": "mem",
                "driver": DRIVER,
                "pool": POOL,
                "device": "gen-0",
                "shareId": id,
                "consumedCapacity": {"memory": memory},
                "policyVersion": "v7",
            }],
        }],
    })
    .to_string()
}

#[tokio::test]
async fn prepare_reads_camel_case_json_from_stdin() {
    let a = Agent::start(two_devices());
    take_epoch(&mut a.client().await, 3).await;
    let id = share_id();
    let o = a.cli_with_stdin(
        &["-o", "json", "prepare", "-f", "-"],
        &prepare_json("cli-stdin", &id, "20Gi"),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let r = &v["claims"]["cli-stdin"];
    assert_eq!(r["shares"][0]["shareId"], id.as_str(), "{v}");
    assert_eq!(r["shares"][0]["phase"], "ACCOUNTED", "{v}");
    assert!(r.get("error").is_none(), "{v}");

    // What the CLI sent is what the agent stored, camelCase fields included.
    let mut c = a.client().await;
    let s = get_share(&mut c, id).await;
    assert_eq!(
        (s.policy_version.as_str(), s.allocation_id.as_str()),
        ("v7", "alloc-1")
    );
    assert_eq!(s.limits[0].requested, "20Gi");
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "20Gi");
    assert_eq!(
        c.list_devices(pb::ListDevicesRequest {})
            .await
            .unwrap()
            .into_inner()
            .epoch,
        3
    );
}

#[tokio::test]
async fn prepare_from_a_file_exits_1_with_the_reason_for_a_refusal() {
    let a = Agent::start(two_devices());
    take_epoch(&mut a.client().await, 3).await;
    let file = a.dir.path().join("too-big.json");
    std::fs::write(&file, prepare_json("cli-refused", &share_id(), "45Gi")).unwrap();
    let o = a.cli(&["prepare", "-f", file.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "a refused claim exits 1: {}",
        stderr(&o)
    );
    let err = stderr(&o);
    assert!(err.contains("cli-refused"), "stderr names the claim: {err}");
    assert!(
        err.contains("InvalidArgument"),
        "stderr gives the code: {err}"
    );
    assert!(
        err.contains("claims[0].allocations[0].consumed_capacity[memory]"),
        "stderr names the field: {err}"
    );
    assert!(all_shares(&mut a.client().await).await.is_empty());

    // Capacity refusals are told apart from input errors, and say they may be retried.
    std::fs::write(&file, prepare_json("cli-fill", &share_id(), "40Gi")).unwrap();
    assert!(
        a.cli(&["prepare", "-f", file.to_str().unwrap()])
            .status
            .success()
    );
    std::fs::write(&file, prepare_json("cli-full", &share_id(), "5Gi")).unwrap();
    let o = a.cli(&["prepare", "-f", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("ResourceExhausted") && stderr(&o).contains("retryable"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test]
async fn prepare_of_malformed_json_fails_without_calling_the_agent() {
    let a = Agent::start(two_devices());
    let o = a.cli_with_stdin(&["prepare", "-f", "-"], "{\"claims\": 12}");
    assert!(!o.status.success());
    assert!(stderr(&o).contains("PrepareRequest"), "{}", stderr(&o));
    assert!(all_shares(&mut a.client().await).await.is_empty());
}

#[tokio::test]
async fn release_without_epoch_reuses_the_agents_epoch() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    take_epoch(&mut c, 7).await;
    let id = share_id();
    // Epoch 7: a release sent with epoch 0 would be refused as stale.
    let r = prepare_one(
        &mut c,
        7,
        claim(
            "cli-rel",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let o = a.cli(&["release", "cli-rel", "--epoch", "6"]);
    assert!(!o.status.success(), "a stale --epoch must fail");
    assert!(stderr(&o).contains("epoch"), "{}", stderr(&o));
    assert_eq!(device(&mut c, "gen-0").await.allocated["memory"], "10Gi");

    let out = ok(&a, &["release", "cli-rel"]);
    assert!(out.contains("cli-rel") && out.contains("released"), "{out}");
    let s = get_share(&mut c, id).await;
    assert_eq!(s.phase, pb::Phase::Released as i32, "{s:?}");
    let all = c
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.epoch, 7, "the CLI must not move the fence");
    assert_eq!(all.devices[0].allocated["memory"], "0");
}

#[test]
fn no_agent_on_the_socket_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("nobody.sock");
    let o = std::process::Command::new(agent_bin())
        .arg("--socket")
        .arg(&socket)
        .arg("devices")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&socket.display().to_string()),
        "stderr should name the socket: {}",
        stderr(&o)
    );
}

/// `shareguard capacity` needs no agent: the design card's fleet, as a table and as JSON,
/// and a bad flag named with its reason (exit 1, nothing on stdout).
#[test]
fn capacity_estimates_a_fleet_without_an_agent() {
    let dir = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(agent_bin())
            .env("SHAREGUARD_SOCKET", dir.path().join("nobody.sock"))
            .arg("capacity")
            .args(args)
            .output()
            .unwrap()
    };
    let card = [
        "--devices",
        "100",
        "--capacity",
        "40Gi",
        "--min",
        "5Gi",
        "--step",
        "5Gi",
        "--utilization",
        "0.7",
    ];
    let o = run(&card);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(
        row(&out, "promised").split_whitespace().last(),
        Some("2800Gi")
    );
    let mut with_mix = card.to_vec();
    with_mix.extend(["--reserve", "10%", "--mix", "3Gi=2,10Gi=1", "-o", "json"]);
    let o = run(&with_mix);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    // 36Gi usable, 35Gi packable; 80% of what is consumed is asked for; 70% of that.
    assert_eq!(v["packablePerDevice"], "35Gi");
    assert_eq!(v["roundingEfficiency"], "80%");
    assert_eq!(v["promised"], "1960Gi");
    let mut bad = card.to_vec();
    bad[9] = "1.5";
    let o = run(&bad);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout(&o).is_empty());
    assert!(
        stderr(&o).contains("--utilization: \"1.5\" is more than the whole"),
        "{}",
        stderr(&o)
    );
}

/// `shareguard config reference` prints docs/config-reference.md (the agent's unit test
/// checks that file against the parser's keys); every key it lists, written into a
/// config, is one the parser takes (no "unknown field").
#[test]
fn config_reference_prints_the_docs_reference_of_keys_the_parser_takes() {
    let o = std::process::Command::new(agent_bin())
        .args(["config", "reference"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let docs = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config-reference.md"),
    )
    .unwrap();
    assert_eq!(stdout(&o), docs);
    let agent_keys: Vec<&str> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("| `agent."))
        .filter_map(|l| l.split('`').next())
        .filter(|k| !k.contains('.'))
        .collect();
    assert!(agent_keys.len() > 25, "{agent_keys:?}");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    for k in agent_keys {
        std::fs::write(&file, format!("[agent]\n{k} = 0\n")).unwrap();
        let o = std::process::Command::new(agent_bin())
            .args(["config", "check"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(!stderr(&o).contains("unknown field"), "{k}: {}", stderr(&o));
    }
}

/// `shareguard config check FILE` validates without an agent: 0 with warnings on stderr
/// for a config that works but is probably not meant, 1 with `file:line: reason` for one
/// the agent would refuse; `devices` repeats the warnings of the running agent.
#[tokio::test]
async fn config_check_validates_and_warns_and_devices_repeats_the_warnings() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("agent.toml");
    let check = |text: &str| {
        std::fs::write(&file, text).unwrap();
        std::process::Command::new(agent_bin())
            .args(["config", "check"])
            .arg(&file)
            .output()
            .unwrap()
    };
    let net = "[agent]\nstate_dir = \"/nonexistent\"\n[[device]]\nname = \"nic-0\"\ndriver = \"d.example.com\"\npool = \"p\"\nkind = \"net\"\n[device.capacity.bandwidth]\nvalue = \"10Gi\"\n";
    let o = check(net);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(": ok (1 devices)"), "{}", stdout(&o));
    let warned = stderr(&o);
    assert!(warned.contains("allowed_namespaces is empty"), "{warned}");
    assert!(warned.contains("did you mean \"10G\""), "{warned}");
    let o = check(&net.replace("kind = \"net\"", "kind = \"fpga\""));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!(
            "{}:7: device nic-0: kind \"fpga\"",
            file.display()
        )),
        "{}",
        stderr(&o)
    );

    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &[],
        &[],
    )));
    let table = ok(&a, &["devices"]);
    assert!(
        table.contains("warning: device gen-0: allowed_namespaces is empty"),
        "{table}"
    );
    let v = ok_json(&a, &["devices"]);
    assert!(v.to_string().contains("allowed_namespaces is empty"), "{v}");
}

/// kubectl's habits: `-n`/`-A`, a claim named NAMESPACE/NAME for `share` and `release`,
/// and `watch` with a header and the time of each line.
#[tokio::test]
async fn namespaces_and_claims_by_name_as_kubectl_spells_them() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let (a0, b1) = (share_id(), share_id());
    for (uid, ns, dev, id) in [
        ("k-a0", "team-a", "gen-0", &a0),
        ("k-b1", "team-b", "gen-1", &b1),
    ] {
        let r = prepare_one(
            &mut c,
            0,
            claim(uid, ns, "alloc-1", vec![alloc(dev, id, "10Gi")]),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    let only_a = ok_json(&a, &["shares", "-n", "team-a"]);
    assert_eq!(share_ids(&only_a), std::slice::from_ref(&a0));
    let mut both = vec![a0.clone(), b1.clone()];
    both.sort();
    assert_eq!(share_ids(&ok_json(&a, &["shares", "-A"])), both);
    let o = a.cli(&["shares", "-A", "-n", "team-a"]);
    assert!(!o.status.success(), "-A and -n together are refused");

    // The claim by its name: `claim()` names claim `uid` "claim-<uid>".
    let table = ok(&a, &["share", "team-b/claim-k-b1"]);
    assert!(row(&table, &b1).contains("team-b/claim-k-b1"), "{table}");
    let o = a.cli(&["share", "team-b/no-such-claim"]);
    assert!(
        !o.status.success() && stderr(&o).contains("no share of it"),
        "{}",
        stderr(&o)
    );
    let out = ok(&a, &["release", "team-b/claim-k-b1"]);
    assert_eq!(out.trim(), "claim k-b1: released");
    assert_eq!(
        get_share(&mut c, b1.clone()).await.phase,
        pb::Phase::Released as i32
    );
    // Released, the name no longer names a live claim.
    let o = a.cli(&["release", "team-b/claim-k-b1"]);
    assert!(
        !o.status.success() && stderr(&o).contains("no live share"),
        "{}",
        stderr(&o)
    );

    // watch: a header, then each line with the time it came.
    let mut w = std::process::Command::new(agent_bin())
        .args(["watch", "-n", "team-a"])
        .env("SHAREGUARD_SOCKET", &a.socket)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(w.stdout.take().unwrap()));
    let header = lines.next().unwrap().unwrap();
    assert!(
        header.starts_with("TIME") && header.contains("PHASE"),
        "{header}"
    );
    let first = lines.next().unwrap().unwrap();
    w.kill().unwrap();
    let _ = w.wait();
    let (time, rest) = first.split_once(' ').unwrap();
    // RFC 3339 in seconds, UTC: 2026-12-03T18:45:00Z.
    let b = time.as_bytes();
    assert!(
        b.len() == 20 && b[4] == b'-' && b[10] == b'T' && b[19] == b'Z',
        "{first}"
    );
    assert!(
        rest.starts_with("SNAPSHOT") && rest.contains(&a0),
        "{first}"
    );
}

/// `-o yaml` and `-o wide` where they mean something, and a global flag a subcommand
/// would ignore refused there rather than dropped.
#[tokio::test]
async fn yaml_and_wide_output_and_flags_a_subcommand_would_ignore() {
    let a = Agent::start(two_devices());
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "y-1",
            "team-a",
            "alloc-1",
            vec![alloc("gen-0", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let y: serde_yaml::Value = serde_yaml::from_str(&ok(&a, &["shares", "-o", "yaml"])).unwrap();
    assert_eq!(
        y["shares"][0]["shareId"].as_str(),
        Some(id.as_str()),
        "{y:?}"
    );
    assert_eq!(y["shares"][0]["phase"].as_str(), Some("ACCOUNTED"), "{y:?}");
    let wide = ok(&a, &["shares", "-o", "wide"]);
    assert!(wide.lines().next().unwrap().contains("CLAIM UID"), "{wide}");
    assert!(row(&wide, &id).contains(" y-1 "), "{wide}");
    let devices = ok(&a, &["devices", "-o", "wide"]);
    assert!(
        row(&devices, "gen-0").contains("shareguard-accounted"),
        "{devices}"
    );

    let refused = |args: &[&str], why: &str| {
        let o = std::process::Command::new(agent_bin())
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    };
    // A global flag a subcommand has no use for is accepted with a note, as kubectl
    // accepts its global flags everywhere; the command runs as it would without it.
    let noted = |args: &[&str], note: &str| {
        let o = std::process::Command::new(agent_bin())
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(note), "{args:?}: {}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let log = a.audit_log.to_str().unwrap();
    let audit = noted(
        &["--socket", "/x", "audit", "--file", log, "-o", "json"],
        "note: --socket ignored: `audit` does not talk to a running agent",
    );
    assert!(
        audit.contains(&id),
        "the audit log as without --socket: {audit}"
    );
    let capacity = noted(
        &[
            "capacity",
            "--socket",
            "/x",
            "--devices",
            "1",
            "--capacity",
            "1Gi",
            "--min",
            "1Gi",
            "--utilization",
            "1",
        ],
        "note: --socket ignored: `capacity`",
    );
    assert!(capacity.contains("promised (logical)"), "{capacity}");
    let config = a.config.to_str().unwrap();
    noted(
        &["config", "check", config, "-o", "json"],
        "note: -o ignored: `config` prints no output that -o could format",
    );
    refused(
        &["rollout", "-o", "yaml"],
        "`rollout` offers -o table, json",
    );
}
