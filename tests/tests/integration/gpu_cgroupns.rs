//! The GPU watchdog of an agent that runs in a cgroup namespace of its own, as a
//! DaemonSet pod does on a cgroup v2 node: `/proc/PID/cgroup` then shows paths relative
//! to the agent's own container cgroup (`0::/../../../burstable/pod<uid>/<id>`), and the
//! watchdog must still map a GPU process to its pod, in both kubelet layouts.
//!
//! Each test lays out one kubelet tree below a top of its own in the cgroup v2 hierarchy:
//! the agent's pod (besteffort) with the agent in its container cgroup, started there
//! through `unshare --cgroup` (so that cgroup is its namespace root), and workload pods
//! in other QoS classes with a `sleep` each. The SIMULATED GPU back end reports the
//! workloads' pids; one is over its share with `action = "terminate"`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    fs,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use shareguard_tests::{
    Agent, Options, alloc, audit_count, claim, get_share, metric_sample, net,
    pod::{CgroupTop, Layout, pod_uid},
    prepare_one, proto as pb, share_id, simulated_gpu_device,
};

const UUID: &str = "GPU-simulated-gpu-0";

/// Root is needed for cgroups and a cgroup namespace; without it the test says so and
/// passes, except under CI=true, where that would hide that it never ran.
fn privileged(test: &str) -> bool {
    if net::is_root() {
        return true;
    }
    assert!(
        !net::in_ci(),
        "{test}: needs root (cgroups, a cgroup namespace); CI=true, so this fails instead of skipping"
    );
    eprintln!("SKIP {test}: needs root to make cgroups and a cgroup namespace");
    false
}

/// The kubelet tree's paths, below the top, for one layout.
struct Paths {
    layout: Layout,
}

impl Paths {
    fn root(&self) -> &'static str {
        match self.layout {
            Layout::Systemd => "kubepods.slice",
            Layout::Cgroupfs => "kubepods",
        }
    }

    /// A container cgroup of pod `uid` in QoS class `qos` ("" for Guaranteed).
    fn container(&self, qos: &str, uid: &str, id: &str) -> String {
        let root = self.root();
        match self.layout {
            Layout::Systemd => {
                let us = uid.replace('-', "_");
                let scope = format!("cri-containerd-{id}.scope");
                if qos.is_empty() {
                    format!("{root}/kubepods-pod{us}.slice/{scope}")
                } else {
                    format!("{root}/kubepods-{qos}.slice/kubepods-{qos}-pod{us}.slice/{scope}")
                }
            }
            Layout::Cgroupfs => {
                if qos.is_empty() {
                    format!("{root}/pod{uid}/{id}")
                } else {
                    format!("{root}/{qos}/pod{uid}/{id}")
                }
            }
        }
    }
}

/// A workload process in a container cgroup; killed and reaped when dropped.
struct Workload(Child);

impl Workload {
    fn start(cgroup: &Path) -> Workload {
        let child = Command::new("sleep")
            .arg("100000")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let w = Workload(child);
        let procs = cgroup.join("cgroup.procs");
        fs::write(&procs, w.pid().to_string())
            .unwrap_or_else(|e| panic!("write {} to {}: {e}", w.pid(), procs.display()));
        w
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn running(&mut self) -> bool {
        self.0.try_wait().ok().flatten().is_none()
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn gpu_claim(uid: &str, id: &str, amount: &str, pod_uid: &str) -> pb::ClaimPrepare {
    let mut c = claim(uid, "team-a", "a1", vec![alloc("gpu-0", id, amount)]);
    c.target = Some(pb::PodTarget {
        pod_uids: vec![pod_uid.into()],
        ..Default::default()
    });
    c
}

/// How a process in the cgroup namespace of `ns_pid` reads `pid`'s cgroup v2 path.
fn cgroup_seen_from(ns_pid: u32, pid: u32) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--cgroup=/proc/{ns_pid}/ns/cgroup"))
        .args(["cat", &format!("/proc/{pid}/cgroup")])
        .output()
        .expect("run nsenter (util-linux)");
    assert!(out.status.success(), "nsenter: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
        .unwrap_or_default()
}

/// The whole scenario in `layout`: the agent's pod besteffort, workload X burstable and
/// over its share, workload Y guaranteed and within it.
async fn watchdog_in_a_cgroup_namespace(layout: Layout) {
    let top = CgroupTop::new(layout);
    let paths = Paths { layout };
    let agent_cgroup = top.mkdir(&paths.container("besteffort", &pod_uid(), "agent0"));
    let (uid_x, uid_y) = (pod_uid(), pod_uid());
    let cgroup_x = top.mkdir(&paths.container("burstable", &uid_x, "ctr-x"));
    let cgroup_y = top.mkdir(&paths.container("", &uid_y, "ctr-y"));
    let mut x = Workload::start(&cgroup_x);
    let mut y = Workload::start(&cgroup_y);

    let dir = tempfile::tempdir().unwrap();
    let processes = dir.path().join("processes.json");
    let mut o = Options::new(simulated_gpu_device(
        r#"{ period = "100ms", action = "terminate", grace = "300ms" }"#,
    ));
    o.agent_extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_processes = {processes:?}\nreconcile_period = \"1h\"",
        dir.path().join("cdi"),
    );
    // Into its container cgroup first, then a new cgroup namespace rooted there; both
    // exec, so the agent keeps the pid the harness knows.
    o.run_through = vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo $$ > {:?} && exec unshare --cgroup \"$@\"",
            agent_cgroup.join("cgroup.procs")
        ),
        "sh".into(),
    ];
    // Declared after the workloads and the tree: dropped first (also on a panic), so
    // nothing is left running in the tree when it is removed.
    let a = Agent::start(o);

    // The premise: the agent is in a namespace of its own and reads the workloads'
    // cgroups relative to its own, climbing out of it.
    assert_ne!(
        fs::read_link(format!("/proc/{}/ns/cgroup", a.pid())).unwrap(),
        fs::read_link("/proc/self/ns/cgroup").unwrap(),
        "the agent has a cgroup namespace of its own"
    );
    let seen = cgroup_seen_from(a.pid(), x.pid());
    assert!(
        seen.starts_with("/../../../") && !seen.contains(paths.root()),
        "the agent reads {seen:?} for the workload: no kubelet root left in it"
    );

    let mut c = a.client().await;
    let (id_x, id_y) = (share_id(), share_id());
    for (claim_uid, id, pod) in [("cx", &id_x, &uid_x), ("cy", &id_y, &uid_y)] {
        let r = prepare_one(&mut c, 0, gpu_claim(claim_uid, id, "10Gi", pod)).await;
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    }
    // X at 12Gi of its 10Gi, Y at 5Gi of its 10Gi.
    fs::write(
        &processes,
        serde_json::json!([
            { "gpu_uuid": UUID, "pid": x.pid(), "used_bytes": 12u64 << 30 },
            { "gpu_uuid": UUID, "pid": y.pid(), "used_bytes": 5u64 << 30 },
        ])
        .to_string(),
    )
    .unwrap();

    // Y's usage is attributed to Y's share.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = get_share(&mut c, id_y.clone()).await;
        if s.usage.first().is_some_and(|u| u.used == "5Gi") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watchdog never attributed Y's process to its share: {s:?}\n{}",
            a.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The namespace root it found is its own container cgroup.
    let own = agent_cgroup
        .strip_prefix(shareguard_tests::pod::cgroup2_mount())
        .unwrap()
        .display()
        .to_string();
    assert!(
        a.log_text().contains(&format!("root: \"/{own}\"")),
        "the agent's log names its namespace root /{own}:\n{}",
        a.log_text()
    );
    // X, over its share past the grace period, is terminated; Y lives.
    while x.running() {
        assert!(
            Instant::now() < deadline,
            "the process over its share was not terminated within 10 s:\n{}",
            a.log_text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(y.running(), "the process within its share must live");

    let lines = a.wait_audit("terminate", &id_x, deadline);
    let of = audit_count;
    assert_eq!(of(&lines, "over_limit", &id_x), 1, "{lines:?}");
    assert_eq!(
        of(&lines, "over_limit", &id_y) + of(&lines, "terminate", &id_y),
        0
    );
    let term = lines
        .iter()
        .find(|l| l["decision"] == "terminate" && l["share_id"] == id_x.as_str())
        .unwrap();
    assert!(
        term["reason"]
            .as_str()
            .unwrap()
            .contains(&x.pid().to_string()),
        "{term}"
    );
    let (_, body) = a.http("/metrics");
    assert_eq!(
        metric_sample(
            &body,
            "shareguard_gpu_over_limit_events_total",
            &[("device", "gpu-0")]
        ),
        Some(1.0),
        "{body}"
    );
}

#[tokio::test]
async fn watchdog_maps_pods_inside_a_cgroup_namespace_cgroupfs() {
    if !privileged("watchdog_maps_pods_inside_a_cgroup_namespace_cgroupfs") {
        return;
    }
    watchdog_in_a_cgroup_namespace(Layout::Cgroupfs).await;
}

#[tokio::test]
async fn watchdog_maps_pods_inside_a_cgroup_namespace_systemd() {
    if !privileged("watchdog_maps_pods_inside_a_cgroup_namespace_systemd") {
        return;
    }
    watchdog_in_a_cgroup_namespace(Layout::Systemd).await;
}
