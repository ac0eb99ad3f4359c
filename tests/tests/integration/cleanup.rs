//! `shareguard cleanup` through the real binary on the real kernel: with shares in place
//! (a bandwidth share's qdisc, ifb and pinned programs; a GPU claim's CDI spec; the
//! store and audit log), the dry run lists each and touches nothing; `--apply` refuses
//! while the agent answers; once the agent is gone it removes every one of them, and a
//! second run finds nothing.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::path::Path;

use shareguard_tests::{
    Agent, alloc, claim,
    net::{self, PinDir, Pod},
    prepare_one, proto as pb, share_id, simulated_gpu_device,
};

fn cleanup(a: &Agent, extra: &[&str]) -> (bool, String, String) {
    let config = a.config.display().to_string();
    let kubelet = a.dir.path().join("kubelet").display().to_string();
    let mut args = vec!["cleanup", "--config", &config, "--kubelet-dir", &kubelet];
    args.extend_from_slice(extra);
    let o = a.cli(&args);
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn kinds(json: &str) -> Vec<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["kind"].as_str().unwrap().to_owned(),
                i["what"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn root_kind(dev: &str) -> String {
    net::sh(&["tc", "qdisc", "show", "dev", dev, "root"])
}

#[tokio::test]
async fn cleanup_lists_then_removes_everything_shareguard_put_on_the_node() {
    if !net::privileged("cleanup_lists_then_removes_everything_shareguard_put_on_the_node") {
        return;
    }
    // `cleanup --apply` removes every queue device in shareguard's group on the machine,
    // as it must on a node: also another test's (seen when this test ran beside the
    // bandwidth tests). Every other test's agents and pods hold the host lock shared, so
    // none runs while this holds it; the traffic lock after it, as HostLock requires.
    let _host = net::HostLock::exclusive();
    let _lock = net::TrafficLock::acquire();
    let pins = PinDir::new();
    let cdi = tempfile::tempdir().unwrap();
    let devices = format!(
        "{}{}",
        net::net_device(
            "nic-0",
            &format!(
                "mechanism = \"htb-ebpf\"\n{}",
                net::bandwidth_capacity("10G")
            )
        ),
        simulated_gpu_device(r#"{ period = "1s", action = "report" }"#)
    );
    let mut a = net::start_agent(devices, &pins, &format!("cdi_dir = {:?}", cdi.path()));
    let pod = Pod::new();
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        net::bw_claim("cl-net", "team-a", "nic-0", &pod, &id, "100M"),
    )
    .await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    // A GPU claim whose pod has no sandbox: PENDING, its CDI spec written at Prepare.
    let mut g = claim(
        "cl-gpu",
        "team-a",
        "g1",
        vec![alloc("gpu-0", &share_id(), "1Gi")],
    );
    g.target = Some(pb::PodTarget {
        pod_uids: vec![shareguard_tests::pod::pod_uid()],
        ..Default::default()
    });
    let r = prepare_one(&mut c, 0, g).await;
    assert_eq!(r.error, None, "{r:?}");
    let ifbs = a.installed_queues();
    assert_eq!(ifbs.len(), 1, "the share's queue device: {ifbs:?}");
    assert!(
        root_kind(pod.host_if()).contains("htb 1:"),
        "{}",
        root_kind(pod.host_if())
    );
    let spec = std::fs::read_dir(cdi.path()).unwrap().count();
    assert_eq!(spec, 1, "the GPU claim's CDI spec");

    // Dry run, agent running: everything listed, nothing touched.
    let (ok, out, err) = cleanup(&a, &["-o", "json"]);
    assert!(ok, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["applied"].as_bool(), v["agentRunning"].as_bool()),
        (Some(false), Some(true))
    );
    let found = kinds(&out);
    let has = |kind: &str, part: &str| found.iter().any(|(k, w)| k == kind && w.contains(part));
    assert!(has("qdisc", pod.host_if()), "{found:?}");
    assert!(has("queue device", &ifbs[0]), "{found:?}");
    assert!(
        has("bpf-pins", &pins.0.join("net").display().to_string()),
        "{found:?}"
    );
    assert!(has("cdi-spec", "gpu_cl-gpu.json"), "{found:?}");
    assert!(has("state", "store"), "{found:?}");
    assert!(has("audit-log", "audit"), "{found:?}");
    assert!(
        root_kind(pod.host_if()).contains("htb 1:"),
        "a dry run touches nothing"
    );
    assert!(net::link_exists(&ifbs[0]));

    // --apply while the agent answers: refused, nothing touched.
    let (ok, _, err) = cleanup(&a, &["--apply"]);
    assert!(!ok && err.contains("stop it first"), "{err}");
    assert!(net::link_exists(&ifbs[0]));

    // The agent gone (as after `kubectl delete` of its DaemonSet): everything removed.
    a.kill9();
    let (ok, out, err) = cleanup(&a, &["--apply"]);
    assert!(ok, "{out}{err}");
    assert!(out.contains(" 0 failed"), "{out}");
    assert!(!net::link_exists(&ifbs[0]), "ifb left: {out}");
    assert!(
        !root_kind(pod.host_if()).contains("htb"),
        "qdisc left: {out}"
    );
    assert!(!pins.0.join("net").exists(), "pins left: {out}");
    assert_eq!(
        std::fs::read_dir(cdi.path()).unwrap().count(),
        0,
        "CDI spec left: {out}"
    );
    assert!(
        !a.state_dir.join("store").exists() && !a.audit_log.exists(),
        "{out}"
    );
    // The pod's own veth stays: it is the pod's, not shareguard's.
    assert!(net::link_exists(pod.host_if()));
    let (ok, out, _) = cleanup(&a, &[]);
    assert!(ok && out.contains("nothing of shareguard's found"), "{out}");
    assert!(!Path::new(&a.socket).exists());
}
