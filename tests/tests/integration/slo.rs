//! The SLO figures and verdicts through the real binary, on real interfaces and the real
//! kernel (eBPF and HTB on the pods' host-side veths): every figure `shareguard slo -o
//! json` reports is checked against what this test did and measured itself, and each
//! verdict is produced by objectives the test sets in the config:
//!
//! - promote: three shares ENFORCED and read back (one measured with iperf3 at its
//!   limit), two refusals (over capacity, a namespace not allowed) within
//!   `refusal_rate_max = 0.5`, `min_samples = 3`;
//! - roll back: the test deletes one share's root qdisc; the reconciler repairs it, and
//!   one repair is over `drift_repairs_max = 0`;
//! - hold: the accounting class, with fewer claims than its `min_samples`;
//! - across a stop and a start (SIGTERM), the windows come back as the stop saved them:
//!   the same claims, samples and repair, so the roll-back stands; after kill -9 they
//!   come back as last saved (`save_period = "1h"` here: at that stop), so a claim
//!   made after it is gone, while the recovery time is measured from the new start and
//!   is no longer than the restart the test timed.
//!
//! A claim that also names a device of another class counts in both. Root only; skips
//! without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::time::{Duration, Instant};

use serde_json::Value;
use shareguard_common::Quantity;
use shareguard_tests::{
    Agent, DRIVER, POOL, alloc, generic_device, metric_sample,
    net::{self, Direction, Iperf, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id,
};

const NET: &str = "shareguard-net-bandwidth";
const ACCOUNTED: &str = "shareguard-accounted";
const RATE: &str = "100M";

fn devices() -> String {
    format!(
        r#"
[[device]]
name = "nic-0"
driver = "{DRIVER}"
pool = "{POOL}"
kind = "net"
mechanism = "htb-ebpf"
allowed_namespaces = ["team-a"]
[device.capacity.bandwidth]
value = "300M"
default = "10M"
valid_range = {{ min = "10M", max = "300M", step = "10M" }}
{}
[slo]
save_period = "1h"
min_samples = 3
refusal_rate_max = 0.5
drift_repairs_max = 0
prepare_p99 = "5s"
convergence_p99 = "10s"
[slo.class."{ACCOUNTED}"]
min_samples = 50
"#,
        generic_device("gen-0", "40Gi", "1Gi", &["team-a"], &[])
    )
}

/// `shareguard slo -o json`, parsed.
fn slo_json(a: &Agent) -> Value {
    let o = a.cli(&["-o", "json", "slo"]);
    assert!(
        o.status.success(),
        "shareguard slo: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `shareguard slo --check --class CLASS`'s exit status: what a pipeline gating the
/// rollout on the verdict sees.
fn check(a: &Agent, class: &str) -> Option<i32> {
    a.cli(&["slo", "--check", "--class", class]).status.code()
}

fn class<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["classes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["deviceClass"] == name)
        .unwrap_or_else(|| panic!("no class {name} in {v:#}"))
}

fn figure<'a>(c: &'a Value, name: &str) -> &'a Value {
    c["figures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("no figure {name} in {c:#}"))
}

/// A figure's value (canonical JSON: a double is a number; absent when unset).
fn value(c: &Value, name: &str) -> Option<f64> {
    figure(c, name)["value"].as_f64()
}

/// A uint64 (canonical JSON writes it as a string; zero is left out).
fn count(v: &Value) -> u64 {
    match v {
        Value::Null => 0,
        Value::String(s) => s.parse().unwrap(),
        other => other.as_u64().unwrap(),
    }
}

fn reasons(c: &Value) -> Vec<String> {
    c["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect()
}

fn q(s: &str) -> Quantity {
    Quantity::parse(s).unwrap()
}

#[tokio::test]
async fn slo_figures_match_what_the_test_measured_and_each_verdict_follows_its_objectives() {
    if !net::privileged(
        "slo_figures_match_what_the_test_measured_and_each_verdict_follows_its_objectives",
    ) {
        return;
    }
    let pins = PinDir::new();
    let mut a = net::start_agent(devices(), &pins, "reconcile_period = \"500ms\"");
    let mut c = a.client().await;
    let pods = [Pod::new(), Pod::new(), Pod::new()];

    // Three shares that fill the device, each timed from the call to its answer (which
    // is ENFORCED: the pods' sandboxes exist). The last also names a generic device of
    // another class, so it counts there too.
    let mut prepare_times = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        let id = share_id();
        let mut claim = net::bw_claim(&format!("ok-{i}"), "team-a", "nic-0", pod, &id, RATE);
        if i == 2 {
            claim.allocations.push(alloc("gen-0", &share_id(), "1Gi"));
        }
        let started = Instant::now();
        let r = prepare_one(&mut c, 0, claim).await;
        prepare_times.push(started.elapsed());
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
        assert_eq!(r.shares[0].limits[0].enforced, RATE, "{r:?}");
    }
    let slowest = *prepare_times.iter().max().unwrap();
    // Refused: over capacity (the device is full), and a namespace not allowed on it.
    let extra = Pod::new();
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("full", "team-a", "nic-0", &extra, &share_id(), RATE),
    )
    .await;
    assert_eq!(r.error.as_ref().unwrap().code, "ResourceExhausted", "{r:?}");
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("denied", "team-z", "nic-0", &extra, &share_id(), "10M"),
    )
    .await;
    assert_eq!(r.error.as_ref().unwrap().code, "PermissionDenied", "{r:?}");

    // What is read back is what the traffic gets: one share's goodput is its limit.
    {
        let server = pods[1].iperf_server();
        let _lock = TrafficLock::acquire();
        let m = server.measure(&Iperf::new(Direction::ToPod));
        eprintln!("share 1, to the pod: {m}");
        let ratio = m.bits_per_second / 100e6;
        assert!(
            (net::GOODPUT_LOW..=net::GOODPUT_HIGH).contains(&ratio),
            "{ratio:.3} of the limit"
        );
    }

    // Promote: every objective met on enough samples.
    let v = slo_json(&a);
    let n = class(&v, NET);
    eprintln!("before drift: {n:#}");
    assert_eq!(n["stage"], "enforce");
    assert_eq!(n["verdict"], "promote", "{:?}", reasons(n));
    assert_eq!(check(&a, NET), Some(0));
    assert!(
        reasons(n)[0].contains("stay in enforce"),
        "{:?}",
        reasons(n)
    );
    assert_eq!(count(&n["claims"]), 5);
    let refusals = n["refusals"].as_object().unwrap();
    assert_eq!(refusals.len(), 2, "{refusals:?}");
    assert_eq!(count(&refusals["capacity"]), 1);
    assert_eq!(count(&refusals["denied"]), 1);
    assert_eq!(value(n, "refusal_rate"), Some(2.0 / 5.0));
    assert_eq!(value(n, "enforcement_refusal_rate"), Some(0.0));
    let p99 = value(n, "prepare_p99").unwrap();
    assert!(p99 > 0.0, "{p99}");
    assert!(
        p99 <= slowest.as_secs_f64(),
        "Prepare p99 {p99}s is more than the slowest Prepare the test timed, {slowest:?}"
    );
    assert_eq!(count(&figure(n, "prepare_p99")["samples"]), 3);
    let conv = value(n, "convergence_p99").unwrap();
    assert!(
        conv <= slowest.as_secs_f64(),
        "convergence p99 {conv}s is more than the slowest Prepare-to-ENFORCED the test saw, {slowest:?}"
    );
    assert_eq!(count(&figure(n, "convergence_p99")["samples"]), 3);
    let rb = &n["readBack"][0];
    assert_eq!(rb["capacity"], "bandwidth");
    assert_eq!(q(rb["allocated"].as_str().unwrap()), q("300M"), "{rb}");
    assert_eq!(q(rb["requested"].as_str().unwrap()), q("300M"), "{rb}");
    assert_eq!(q(rb["readBack"].as_str().unwrap()), q("300M"), "{rb}");
    assert_eq!(rb["ratio"].as_f64(), Some(1.0));
    assert_eq!(count(&rb["shares"]), 3);
    assert_eq!(value(n, "drift_repairs"), Some(0.0));
    assert!(n["recoverySeconds"].as_f64().is_some(), "{n:#}");
    // The claim that also named gen-0 counts in its class; too few claims there.
    let g = class(&v, ACCOUNTED);
    assert_eq!(count(&g["claims"]), 1);
    assert_eq!(count(&figure(g, "prepare_p99")["samples"]), 1);
    assert_eq!(g["verdict"], "hold");
    assert_eq!(check(&a, ACCOUNTED), Some(3));
    // Over every class, the worst verdict decides.
    assert_eq!(a.cli(&["slo", "--check"]).status.code(), Some(3));
    assert!(
        reasons(g)[0].starts_with("too few claims: 1 in the window, min_samples is 50"),
        "{:?}",
        reasons(g)
    );
    let table = String::from_utf8_lossy(&a.cli(&["slo", "--class", NET]).stdout).into_owned();
    assert!(table.contains("VERDICT PROMOTE"), "{table}");
    assert!(
        !table.contains(ACCOUNTED),
        "--class shows that class only: {table}"
    );

    // Roll back: drift the test causes on the first pod's interface, repaired by the
    // reconciler, is one repair over drift_repairs_max = 0.
    net::sh(&["tc", "qdisc", "del", "dev", pods[0].host_if(), "root"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let v = loop {
        let v = slo_json(&a);
        if value(class(&v, NET), "drift_repairs") == Some(1.0) {
            break v;
        }
        assert!(Instant::now() < deadline, "no repair counted: {v:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let n = class(&v, NET);
    eprintln!("after drift: {n:#}");
    assert_eq!(n["verdict"], "roll back");
    assert_eq!(check(&a, NET), Some(4));
    assert_eq!(
        reasons(n),
        vec!["drift_repairs 1 is not <= 0".to_owned()],
        "{n:#}"
    );
    assert_eq!(
        figure(n, "drift_repairs")["status"],
        "missed",
        "{:#}",
        figure(n, "drift_repairs")
    );
    assert_eq!(figure(n, "drift_repairs")["enforcement"], true);
    // Repaired: read back in full again.
    assert_eq!(n["readBack"][0]["ratio"].as_f64(), Some(1.0), "{n:#}");

    // The same figures as metrics.
    let (_, body) = a.http("/metrics");
    let m = |name: &str, labels: &[(&str, &str)]| {
        metric_sample(&body, name, labels).unwrap_or_else(|| panic!("{name} {labels:?}"))
    };
    let net_class = [("class", NET)];
    assert_eq!(m("shareguard_slo_claims_total", &net_class), 5.0);
    assert_eq!(
        m(
            "shareguard_slo_refusals_total",
            &[("class", NET), ("reason", "capacity")]
        ),
        1.0
    );
    assert_eq!(
        m(
            "shareguard_slo_refusals_total",
            &[("class", NET), ("reason", "denied")]
        ),
        1.0
    );
    assert_eq!(m("shareguard_slo_drift_repairs_total", &net_class), 1.0);
    assert_eq!(
        m("shareguard_slo_prepare_duration_seconds_count", &net_class),
        3.0
    );
    assert_eq!(
        m(
            "shareguard_slo_convergence_duration_seconds_count",
            &net_class
        ),
        3.0
    );
    assert_eq!(
        m(
            "shareguard_slo_read_back_ratio",
            &[("class", NET), ("capacity", "bandwidth")]
        ),
        1.0
    );
    assert_eq!(
        m(
            "shareguard_slo_verdict",
            &[("class", NET), ("verdict", "roll_back")]
        ),
        1.0
    );
    assert_eq!(
        m("shareguard_slo_objective_drift_repairs_max", &net_class),
        0.0
    );
    assert_eq!(
        m(
            "shareguard_slo_window_claims",
            &[("class", NET), ("window", "1h")]
        ),
        5.0
    );

    // A stop and a start, as an upgrade of the DaemonSet does: the windows come back as
    // the stop saved them.
    let kept = |n: &Value| {
        (
            count(&n["claims"]),
            n["refusals"].clone(),
            value(n, "prepare_p99"),
            count(&figure(n, "prepare_p99")["samples"]),
            value(n, "convergence_p99"),
            count(&figure(n, "convergence_p99")["samples"]),
            value(n, "drift_repairs"),
        )
    };
    let before = kept(class(&slo_json(&a), NET));
    assert_eq!(before.0, 5);
    drop(c);
    let (status, _) = a
        .terminate(Duration::from_secs(15))
        .expect("the agent stops on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(
        a.log_text().contains("SLO windows saved"),
        "{}",
        a.log_text()
    );
    a.start_again();
    let v = slo_json(&a);
    let n = class(&v, NET);
    eprintln!("after a stop and a start: {n:#}");
    assert_eq!(kept(n), before, "{n:#}");
    assert_eq!(
        n["verdict"], "roll back",
        "the repair is still in the window"
    );
    assert_eq!(check(&a, NET), Some(4));
    assert!(
        a.log_text().contains("SLO windows loaded as last saved"),
        "{}",
        a.log_text()
    );

    // One more claim (refused: the device is full), then a crash: it came after the
    // last save, so it is gone; what the stop saved is back.
    let mut c = a.client().await;
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("full-again", "team-a", "nic-0", &extra, &share_id(), RATE),
    )
    .await;
    assert!(r.error.is_some(), "{r:?}");
    assert_eq!(count(&class(&slo_json(&a), NET)["claims"]), 6);
    drop(c);
    let restart = a.restart_timed();
    let v = slo_json(&a);
    let n = class(&v, NET);
    eprintln!("after kill -9 and a restart ({restart:?}): {n:#}");
    assert_eq!(kept(n), before, "{n:#}");
    // Recovery is this start's: from the agent's start to every share verified, within
    // the restart the test timed.
    let recovery = n["recoverySeconds"].as_f64().unwrap();
    assert!(
        recovery <= restart.as_secs_f64(),
        "recovery {recovery}s is more than the restart the test timed, {restart:?}"
    );
    assert_eq!(count(&n["unverifiedShares"]), 0);
    assert_eq!(value(n, "recovery"), Some(recovery));
    // What the records say survives: every share read back in full.
    assert_eq!(n["readBack"][0]["ratio"].as_f64(), Some(1.0), "{n:#}");
    assert_eq!(count(&n["readBack"][0]["shares"]), 3);

    let o = a.cli(&["slo", "--class", "no-such-class"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no device is in DeviceClass no-such-class"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
