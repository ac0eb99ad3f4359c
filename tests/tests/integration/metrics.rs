//! `/metrics`, `/healthz` and `/readyz`: the ledger gauges say what ListDevices says, and
//! the refusal counter moves with refusals and only with them.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use shareguard_tests::{
    Agent, Options, alloc, claim, device, generic_device, gib, metric_sample, prepare_one,
    share_id, unprepare_one,
};

const GIB: f64 = (1u64 << 30) as f64;

fn memory(body: &str, name: &str) -> f64 {
    metric_sample(body, name, &[("device", "gen-0"), ("capacity", "memory")])
        .unwrap_or_else(|| panic!("no {name} for gen-0:\n{body}"))
}

/// A counter that has not counted yet may not be exposed at all.
fn refusals(a: &Agent, code: &str) -> f64 {
    metric_sample(
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
            0,
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
        metric_sample(
            &body,
            "shareguard_device_live_shares",
            &[("device", "gen-0")]
        ),
        Some(2.0)
    );
    assert_eq!(
        metric_sample(&body, "shareguard_shares", &[("phase", "ACCOUNTED")]),
        Some(2.0)
    );

    // The gauges follow a release, so they are computed from the ledger, not remembered.
    assert_eq!(unprepare_one(&mut c, 0, "m-2").await.code, "");
    let body = a.http("/metrics").1;
    assert_eq!(memory(&body, "shareguard_device_allocated"), 5.0 * GIB);
    assert_eq!(memory(&body, "shareguard_device_free"), 15.0 * GIB);
    assert_eq!(
        metric_sample(&body, "shareguard_shares", &[("phase", "RELEASED")]),
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
        0,
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
        0,
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
        0,
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

/// Every family, with samples in it (a live share, a refusal, a GPU share on the
/// simulated back end watched by the watchdog), passes Prometheus' own linter, and the
/// per-share families say what the share asked for and what was read back.
#[tokio::test]
async fn metrics_pass_promtool_and_show_requested_and_enforced() {
    if !shareguard_tests::net::privileged("metrics_pass_promtool_and_show_requested_and_enforced") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let devices = generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
        + &format!(
            r#"
[[device]]
name = "gpu-0"
driver = "{}"
pool = "{}"
kind = "gpu"
backend = "simulated"
allowed_namespaces = ["*"]
watchdog = {{ period = "50ms", action = "report" }}
[device.simulated]
memory = "80Gi"
[device.capacity.memory]
default = "1Gi"
valid_range = {{ min = "1Gi", step = "1Gi" }}
"#,
            shareguard_tests::DRIVER,
            shareguard_tests::POOL
        );
    let mut o = Options::new(devices);
    o.agent_extra = format!("cdi_dir = {:?}", dir.path().join("cdi"));
    let a = Agent::start(o);
    let mut c = a.client().await;
    let gen_share = share_id();
    prepare_one(
        &mut c,
        0,
        claim(
            "m1",
            "team-a",
            "a1",
            vec![alloc("gen-0", &gen_share, "10Gi")],
        ),
    )
    .await;
    // Refused: 7Gi is off the policy's steps.
    prepare_one(
        &mut c,
        0,
        claim(
            "m2",
            "team-a",
            "a1",
            vec![alloc("gen-0", &share_id(), "7Gi")],
        ),
    )
    .await;
    let gpu_share = share_id();
    let mut g = claim(
        "m3",
        "team-a",
        "a1",
        vec![alloc("gpu-0", &gpu_share, "2Gi")],
    );
    // The GPU limit goes on the pod's cgroup, which the agent finds by the pod's uid.
    let sb = shareguard_tests::pod::Sandbox::cgroup_only(
        &shareguard_tests::pod::pod_uid(),
        shareguard_tests::pod::Layout::Cgroupfs,
    );
    g.target = Some(shareguard_tests::proto::PodTarget {
        pod_uids: vec![sb.uid().to_owned()],
        ..Default::default()
    });
    let r = prepare_one(&mut c, 0, g).await;
    assert_eq!(r.error, None, "{r:?}");

    // Wait for a watchdog poll to be counted, with a deadline: its families are then
    // in the output too.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let body = loop {
        let (_, body) = a.http("/metrics");
        if metric_sample(
            &body,
            "shareguard_gpu_watchdog_polls_total",
            &[("result", "ok")],
        )
        .is_some()
        {
            break body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no watchdog poll counted:\n{body}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };

    let share =
        |name: &str, id: &str| metric_sample(&body, name, &[("share", id), ("capacity", "memory")]);
    assert_eq!(
        share("shareguard_share_requested", &gen_share),
        Some(10.0 * GIB)
    );
    assert_eq!(
        share("shareguard_share_enforced", &gen_share),
        None,
        "an accounting share is not enforced"
    );
    assert_eq!(
        share("shareguard_share_requested", &gpu_share),
        Some(2.0 * GIB)
    );
    assert_eq!(
        share("shareguard_share_enforced", &gpu_share),
        Some(2.0 * GIB)
    );
    assert!(
        body.contains("shareguard_enforcement_duration_seconds_count{device=\"gpu-0\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("shareguard_reconcile_duration_seconds"),
        "{body}"
    );

    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; scripts/test.sh installs it)");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), body.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "promtool check metrics failed:\n{said}\n{body}"
    );
    assert_eq!(said.trim(), "", "promtool has remarks:\n{said}");

    // A scraper that asks for OpenMetrics gets it: counter families without `_total` in
    // their metadata, and the `# EOF` terminator.
    let om = shareguard_tests::http_response(
        a.metrics.unwrap(),
        "/metrics",
        "Accept: application/openmetrics-text; version=1.0.0\r\n",
    )
    .unwrap();
    assert!(
        om.contains("content-type: application/openmetrics-text"),
        "{om}"
    );
    assert!(om.contains("# TYPE shareguard_refusals counter"), "{om}");
    assert!(om.trim_end().ends_with("# EOF"), "{om}");
    assert!(
        body.contains("# TYPE shareguard_refusals_total counter"),
        "{body}"
    );
    assert!(!body.contains("# EOF"), "{body}");
}

/// Scrapes within `metrics_max_age` of a render share it: however many scrapers there
/// are, the agent renders at most once per that age. With no age, every scrape renders.
#[tokio::test]
async fn scrapes_within_the_max_age_share_one_render() {
    let devices = generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[]);
    let mut o = Options::new(devices.clone());
    o.agent_extra = "metrics_max_age = \"1h\"".into();
    let cached = Agent::start(o);
    let fresh = Agent::start(Options::new(devices));
    let allocated = |a: &Agent| {
        metric_sample(
            &a.http("/metrics").1,
            "shareguard_device_allocated",
            &[("device", "gen-0"), ("capacity", "memory")],
        )
    };
    assert_eq!(allocated(&cached), Some(0.0));
    assert_eq!(allocated(&fresh), Some(0.0));
    for a in [&cached, &fresh] {
        let mut c = a.client().await;
        let r = prepare_one(
            &mut c,
            0,
            claim(
                "mc",
                "team-a",
                "a1",
                vec![alloc("gen-0", &share_id(), "5Gi")],
            ),
        )
        .await;
        assert_eq!(r.error, None, "{r:?}");
    }
    assert_eq!(allocated(&cached), Some(0.0), "the render of an hour ago");
    assert_eq!(allocated(&fresh), Some(5.0 * GIB), "rendered again");
}

/// Every counter and histogram the alerts (`deploy/prometheus/`) and the dashboard
/// (`deploy/grafana/`) read is there at zero on a fresh agent, for every device it
/// knows (GPU families for its GPUs), before anything happened: `increase()` over a
/// series that appears at its first event misses that event, and a fresh agent's
/// dashboard would be empty.
#[tokio::test]
async fn every_counter_the_alerts_and_dashboard_read_is_at_zero_on_a_fresh_agent() {
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut read = std::collections::BTreeSet::new();
    for file in [
        "prometheus/shareguard-alerts.rules.yaml",
        "prometheus/shareguard-slo.rules.yaml",
        "grafana/shareguard-dashboard.json",
    ] {
        let text = std::fs::read_to_string(deploy.join(file)).unwrap();
        for word in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
            // Recording rules' names (`instance:shareguard_...:rate5m`) hold a colon, a
            // prefix in a comment or regex ends in `_`: neither names a metric.
            if word.starts_with("shareguard_") && !word.ends_with('_') {
                read.insert(word.to_owned());
            }
        }
    }
    assert!(read.len() > 20, "{read:?}");

    let devices = format!(
        "{}{}",
        generic_device("gen-0", "20Gi", "5Gi", &["team-a"], &[]),
        shareguard_tests::simulated_gpu_device("{ period = \"1s\" }")
    );
    let a = Agent::start(Options::new(devices));
    let body = a.http("/metrics").1;
    // family -> type, from `# TYPE family type`.
    let types: std::collections::BTreeMap<&str, &str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let samples = |name: &str| -> Vec<&str> {
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .collect()
    };
    let mut checked = 0;
    for name in &read {
        // One series per live share, and none while there is none: no label set of
        // them is known before a share is.
        if name.starts_with("shareguard_share_") || name.starts_with("shareguard_gpu_share_") {
            continue;
        }
        let family = ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        // Counters' TYPE lines name the `_total` series, histograms' the family.
        let Some(kind) = types
            .get(format!("{family}_total").as_str())
            .or_else(|| types.get(family))
        else {
            // Gauges of a figure that is not defined before a share or a claim of the
            // class: a percentile or ratio of nothing, what was read back of no share.
            let undefined = [
                "shareguard_slo_read_back",
                "shareguard_slo_read_back_ratio",
                "shareguard_slo_requested",
                "shareguard_slo_window_convergence_seconds",
                "shareguard_slo_window_prepare_seconds",
                "shareguard_slo_window_refusal_ratio",
            ];
            assert!(
                undefined.contains(&family),
                "the deploy files read {name}, which a fresh agent does not export:\n{body}"
            );
            continue;
        };
        let series = match *kind {
            "counter" => format!("{family}_total"),
            "histogram" => format!("{family}_bucket"),
            _ => continue,
        };
        let got = samples(&series);
        assert!(
            !got.is_empty(),
            "{name} ({kind}) has no series on a fresh agent:\n{body}"
        );
        // Events that cannot have happened yet are there at 0 (periodic work, the
        // reconciler's and the watchdog's, may have run once already).
        if ["drift", "repairs", "refusals", "over_limit", "terminations"]
            .iter()
            .any(|e| family.contains(e))
        {
            assert!(
                got.iter().all(|l| l.ends_with(" 0")),
                "{series} counted before anything happened: {got:?}"
            );
        }
        checked += 1;
        // Per device: every device the agent has.
        if got.iter().any(|l| l.contains("device=\"")) {
            let gpu_only = family.starts_with("shareguard_gpu_");
            for dev in ["gen-0", "gpu-0"] {
                if gpu_only && dev == "gen-0" {
                    continue;
                }
                assert!(
                    got.iter().any(|l| l.contains(&format!("device=\"{dev}\""))),
                    "{series} has no series for {dev}: {got:?}"
                );
            }
        }
    }
    for must in [
        "shareguard_reconcile_drift_total",
        "shareguard_reconcile_repairs_total",
        "shareguard_gpu_watchdog_polls_total",
        "shareguard_refusals_total",
    ] {
        assert!(read.contains(must), "{must} is read by the deploy files");
    }
    assert!(checked >= 8, "{checked} counters and histograms checked");
}
