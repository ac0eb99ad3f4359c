//! The Grafana dashboard in `deploy/grafana/`: well formed for Grafana's import (unique
//! panel ids, every query on the dashboard's data source variable, each target its own
//! refId), and every metric its queries and variables name is one a live agent exports,
//! with samples: the agent here holds a bandwidth share on a real veth with traffic
//! counted, drift injected and repaired, a refusal, and a GPU share on the simulated back
//! end whose process goes over its limit and is terminated. A renamed metric, or a panel
//! on a metric the agent never fills, fails here. Root only (the share on a veth); skips
//! without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    time::Duration,
};

use serde_json::Value;
use shareguard_tests::{
    alloc, claim, metric_sample,
    net::{self, PinDir, Pod},
    pod::{Layout, Sandbox, pod_uid},
    prepare_one, proto as pb, share_id, simulated_gpu_device, wait_phase,
};

fn dashboard() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/shareguard-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// Every PromQL text on the dashboard, with where it is: the panels' targets and the
/// query variables.
fn queries(d: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {:?}", p["title"]),
                t["expr"].as_str().unwrap().to_owned(),
            ));
        }
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        if v["type"] == "query" {
            out.push((
                format!("variable {:?}", v["name"]),
                v["definition"].as_str().unwrap().to_owned(),
            ));
        }
    }
    out
}

/// The `shareguard_*` metric names a query reads.
fn metric_names(query: &str) -> BTreeSet<String> {
    query
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("shareguard_"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_dashboard_is_well_formed_for_import() {
    let d = dashboard();
    assert_eq!(d["uid"], "shareguard-overview");
    let vars: BTreeSet<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        vars.contains("datasource") && vars.contains("instance"),
        "{vars:?}"
    );

    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = &p["title"];
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "panel id repeated: {title}"
        );
        let g = &p["gridPos"];
        let (x, w) = (g["x"].as_u64().unwrap(), g["w"].as_u64().unwrap());
        assert!(x + w <= 24, "{title} is wider than the grid");
        if p["type"] == "row" {
            continue;
        }
        assert!(!p["description"].as_str().unwrap().is_empty(), "{title}");
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title} has no query");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(
                refs.insert(t["refId"].as_str().unwrap()),
                "{title}: refId repeated"
            );
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            let expr = t["expr"].as_str().unwrap();
            // Every panel follows the node picker, or a node's figures would mix in.
            if expr.contains("shareguard_") {
                assert!(expr.contains("instance=~\"$instance\""), "{title}: {expr}");
            }
        }
    }
    assert!(
        queries(&d).iter().any(|(_, q)| q.contains("shareguard_")),
        "no query reads the agent's metrics"
    );
}

/// The metrics the dashboard reads, each with a sample, from an agent that did what
/// fills them.
#[tokio::test]
async fn every_metric_the_dashboard_reads_has_samples_in_a_live_agent() {
    if !net::privileged("every_metric_the_dashboard_reads_has_samples_in_a_live_agent") {
        return;
    }
    let mut wanted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (place, q) in queries(&dashboard()) {
        for name in metric_names(&q) {
            wanted.entry(name).or_default().push(place.clone());
        }
    }
    assert!(wanted.len() >= 20, "{wanted:?}");

    let dir = tempfile::tempdir().unwrap();
    let pins = PinDir::new();
    let devices =
        net::net_device(
            "nic-0",
            &format!(
                "mechanism = \"htb-ebpf\"\n{}",
                net::bandwidth_capacity("10G")
            ),
        ) + &simulated_gpu_device(r#"{ period = "100ms", action = "terminate", grace = "200ms" }"#);
    let extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_processes = {:?}\nreconcile_period = \"300ms\"\ncounters_period = \"200ms\"",
        dir.path().join("cdi"),
        dir.path().join("processes.json"),
    );
    let a = net::start_agent(devices, &pins, &extra);
    let mut c = a.client().await;

    // A bandwidth share, enforced on the pod's veth, with traffic through it.
    let pod = Pod::new();
    let bw = share_id();
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("d-bw", "team-a", "nic-0", &pod, &bw, "100M"),
    )
    .await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    let host = pod.host_addr().to_string();
    pod.netns()
        .sh(&["ping", "-c", "5", "-i", "0.05", "-W", "1", &host]);

    // A refusal: 15M is off the policy's 10M steps.
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("d-off", "team-a", "nic-0", &pod, &share_id(), "15M"),
    )
    .await;
    assert_eq!(r.error.map(|e| e.code), Some("InvalidArgument".to_owned()));

    // A GPU share that waits for its pod's sandbox (a sandbox transition once it
    // comes), whose process the simulated driver then reports over its limit.
    let gpu_uid = pod_uid();
    let gpu_share = share_id();
    let mut g = claim(
        "d-gpu",
        "team-a",
        "a1",
        vec![alloc("gpu-0", &gpu_share, "2Gi")],
    );
    g.target = Some(pb::PodTarget {
        pod_uids: vec![gpu_uid.clone()],
        ..Default::default()
    });
    let r = prepare_one(&mut c, 0, g).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Pending as i32, "{r:?}");
    let mut gpu_pod = Sandbox::start(&gpu_uid, Layout::Cgroupfs, None);
    wait_phase(&mut c, &gpu_share, pb::Phase::Enforced).await;
    std::fs::write(
        dir.path().join("processes.json"),
        serde_json::json!([
            { "gpu_uuid": "GPU-simulated-gpu-0", "pid": gpu_pod.pid(), "used_bytes": 3u64 << 30 },
        ])
        .to_string(),
    )
    .unwrap();
    net::wait_for(
        "the GPU process over its share terminated",
        Duration::from_secs(10),
        || !gpu_pod.running(),
    );

    // Drift: the share's root qdisc deleted by hand, found and put back.
    net::sh(&["tc", "qdisc", "del", "dev", pod.host_if(), "root"]);
    let repaired = |body: &str| {
        metric_sample(
            body,
            "shareguard_reconcile_repairs_total",
            &[("device", "nic-0")],
        )
        .is_some_and(|n| n >= 1.0)
    };
    net::wait_for(
        "the drift repaired and counted",
        Duration::from_secs(10),
        || repaired(&a.http("/metrics").1),
    );

    let body = a.http("/metrics").1;
    let sampled: BTreeSet<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let missing: Vec<String> = wanted
        .iter()
        .filter(|(name, _)| !sampled.contains(name.as_str()))
        .map(|(name, at)| format!("{name} (read by {})", at.join(", ")))
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard reads metrics the agent did not export:\n{}\n\n{body}",
        missing.join("\n")
    );
}
