//! The inventory changing under live shares across a restart. An accounting device that
//! leaves: its shares become UNKNOWN and keep their capacity until an explicit Unprepare
//! (capacity is never freed implicitly). An enforced device that leaves, or a device
//! whose kind changes: the agent refuses to start. A capacity shrunk below what is held:
//! over-committed, never negative.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::fs;

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, get_share, metric_sample, prepare_one,
    proto as pb, share_id, unprepare_one,
};

#[tokio::test]
async fn shares_of_a_removed_device_become_unknown_and_keep_their_capacity() {
    let gen1 = generic_device("gen-1", "20Gi", "5Gi", &["team-a"], &[]);
    let mut a = Agent::start(Options::new(format!(
        "{}{gen1}",
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
    )));
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "inv",
            "team-a",
            "alloc-1",
            vec![alloc("gen-1", &id, "10Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");

    let full = fs::read_to_string(&a.config).unwrap();
    let without = full.replace(&gen1, "");
    assert_ne!(without, full, "the harness's config layout changed");
    fs::write(&a.config, &without).unwrap();
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Unknown as i32, "{s:?}");
    assert!(
        s.reason.contains("inventory"),
        "the reason should say why: {s:?}"
    );
    assert!(
        a.audit_lines()
            .iter()
            .any(|l| l["decision"] == "recover" && l["share_id"] == id.as_str()),
        "the change of phase at start is audited"
    );

    // The device comes back: the share still holds its capacity, as nothing released it.
    fs::write(&a.config, &full).unwrap();
    a.restart();
    let mut c = a.client().await;
    let d = device(&mut c, "gen-1").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("10Gi", 1),
        "{d:?}"
    );
    // Nothing was lost while it was gone, and an accounting share has nothing to
    // re-verify: it is ACCOUNTED again.
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Accounted as i32, "{s:?}");

    assert_eq!(unprepare_one(&mut c, 0, "inv").await.code, "");
    let d = device(&mut c, "gen-1").await;
    assert_eq!(
        (d.allocated["memory"].as_str(), d.live_shares),
        ("0", 0),
        "{d:?}"
    );
}

/// A capacity shrunk below what live shares hold: the device is over-committed. The
/// shares keep their capacity, `free` reads 0 (never negative) in the API, the CLI and
/// the metrics, a metric and a log line say so, and new shares are refused until enough
/// are released.
#[tokio::test]
async fn a_capacity_shrunk_under_live_shares_is_over_committed_never_negative() {
    let mut a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mut c = a.client().await;
    for (uid, amount) in [("oc-1", "20Gi"), ("oc-2", "10Gi")] {
        let r = prepare_one(
            &mut c,
            0,
            claim(
                uid,
                "team-a",
                "a1",
                vec![alloc("gen-0", &share_id(), amount)],
            ),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    let full = fs::read_to_string(&a.config).unwrap();
    let shrunk = full
        .replace("value = \"40Gi\"", "value = \"25Gi\"")
        .replace("max = \"40Gi\"", "max = \"25Gi\"");
    assert_ne!(shrunk, full, "the harness's config layout changed");
    fs::write(&a.config, &shrunk).unwrap();
    a.restart();
    assert!(
        a.log_text().contains("over-committed"),
        "a log line says so:\n{}",
        a.log_text()
    );
    let mut c = a.client().await;
    let d = device(&mut c, "gen-0").await;
    assert_eq!(
        (
            d.capacity["memory"].as_str(),
            d.allocated["memory"].as_str(),
            d.free["memory"].as_str()
        ),
        ("25Gi", "30Gi", "0"),
        "{d:?}"
    );
    let (_, body) = a.http("/metrics");
    let m = |name: &str| metric_sample(&body, name, &[("device", "gen-0"), ("capacity", "memory")]);
    assert_eq!(m("shareguard_device_overcommitted"), Some(1.0), "{body}");
    assert_eq!(m("shareguard_device_free"), Some(0.0), "{body}");
    let cli = a.cli(&["-o", "json", "devices"]);
    assert!(cli.status.success());
    let out = String::from_utf8_lossy(&cli.stdout);
    assert!(!out.contains("\"-"), "no negative amount in the CLI: {out}");

    // Nothing fits while over-committed; releasing 10Gi leaves 20Gi of 25Gi, and then
    // 5Gi fits again and the metric clears.
    let five = || {
        claim(
            "oc-3",
            "team-a",
            "a1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        )
    };
    let r = prepare_one(&mut c, 0, five()).await;
    assert_eq!(r.error.unwrap().code, "ResourceExhausted");
    assert_eq!(unprepare_one(&mut c, 0, "oc-2").await.code, "");
    let r = prepare_one(&mut c, 0, five()).await;
    assert_eq!(r.error, None, "{r:?}");
    let (_, body) = a.http("/metrics");
    assert_eq!(
        metric_sample(
            &body,
            "shareguard_device_overcommitted",
            &[("device", "gen-0"), ("capacity", "memory")]
        ),
        Some(0.0)
    );
}

/// Runs the agent on `config` and expects it to refuse to start: returns its stderr.
/// Fails (killing it) if it is still running after 30 s.
fn refused_start(config: &std::path::Path) -> String {
    let mut child = std::process::Command::new(shareguard_tests::agent_bin())
        .args(["agent", "--config"])
        .arg(config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the agent must refuse to start");
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return err;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the agent started on a config that drops a device with live shares");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A device with live enforced shares dropped from the config, or a device whose kind
/// changed under live shares: the agent refuses to start and names the device and each
/// share, so nothing it enforced is left without an owner; put back, it starts.
#[tokio::test]
async fn dropping_an_enforced_device_or_changing_a_kind_under_live_shares_stops_the_start() {
    let gpu = format!(
        r#"
[[device]]
name = "gpu-0"
driver = "{}"
pool = "{}"
kind = "gpu"
backend = "simulated"
allowed_namespaces = ["*"]
[device.simulated]
memory = "16Gi"
cgroup_limits = false
mps = false
[device.capacity.memory]
default = "1Gi"
valid_range = {{ min = "1Gi", step = "1Gi" }}
"#,
        shareguard_tests::DRIVER,
        shareguard_tests::POOL
    );
    let gen0 = generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]);
    let mut a = Agent::start(Options::new(format!("{gen0}{gpu}")));
    let mut c = a.client().await;
    let gid = share_id();
    let mut g = claim("g", "team-a", "a1", vec![alloc("gpu-0", &gid, "2Gi")]);
    g.target = Some(pb::PodTarget {
        pod_uids: vec![shareguard_tests::pod::pod_uid()],
        ..Default::default()
    });
    assert_eq!(prepare_one(&mut c, 0, g).await.error, None);
    let nid = share_id();
    assert_eq!(
        prepare_one(
            &mut c,
            0,
            claim("n", "team-a", "a1", vec![alloc("gen-0", &nid, "5Gi")])
        )
        .await
        .error,
        None
    );
    a.kill9();
    let full = fs::read_to_string(&a.config).unwrap();

    fs::write(&a.config, full.replace(&gpu, "")).unwrap();
    let err = refused_start(&a.config);
    assert!(err.contains("device gpu-0 is gone"), "{err}");
    assert!(err.contains(&gid), "names the share: {err}");

    // gen-0 again, as a (simulated) GPU of the same size.
    let as_gpu = gpu
        .replace("gpu-0", "gen-0")
        .replace("\"16Gi\"", "\"40Gi\"");
    fs::write(&a.config, full.replace(&gen0, &as_gpu)).unwrap();
    let err = refused_start(&a.config);
    assert!(
        err.contains("device gen-0 changed kind from generic to gpu"),
        "{err}"
    );
    assert!(err.contains(&nid), "names the share: {err}");

    fs::write(&a.config, &full).unwrap();
    a.restart();
    let mut c = a.client().await;
    assert_eq!(
        get_share(&mut c, gid).await.phase,
        pb::Phase::Accounted as i32
    );
}
