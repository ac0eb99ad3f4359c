//! GPU memory shares through the real agent, on the SIMULATED GPU back end (this machine
//! has no GPU): limits set and read back, the CDI spec per claim, oversubscription
//! refused, release, restart; and the watchdog against real processes in real cgroups
//! laid out as the kubelet lays them out, with `terminate` ending the one over its limit
//! and no other. The NVML path runs only on a machine with a GPU: tests/gpu/run-on-gpu.sh.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use shareguard_limiter_gpu::cdi::validate_spec;
use shareguard_tests::{
    Agent, DRIVER, Options, POOL, alloc, audit_count, claim, device, devices, get_share,
    metric_sample, net,
    pod::{Layout, Sandbox, pod_uid},
    prepare_one, proto as pb, share_id, simulated_gpu_device, unprepare_one, wait_phase,
    wait_share,
};

const UUID: &str = "GPU-simulated-gpu-0";
/// The uid a pod that is not root runs as in these tests.
const NOBODY: u32 = 65534;

/// The agent, with its CDI directory and simulated-processes file in `dir`.
fn start(dir: &Path, watchdog: &str) -> Agent {
    let mut o = Options::new(simulated_gpu_device(watchdog));
    // The reconciler would repair what these tests look at first; an hour keeps it out.
    o.agent_extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_processes = {:?}\nreconcile_period = \"1h\"",
        dir.join("cdi"),
        dir.join("processes.json")
    );
    Agent::start(o)
}

/// A claim of `amount` for pod `pod_uid`: the agent finds the pod's cgroup itself.
fn gpu_claim(uid: &str, id: &str, amount: &str, pod_uid: &str) -> pb::ClaimPrepare {
    let mut c = claim(uid, "team-a", "a1", vec![alloc("gpu-0", id, amount)]);
    c.target = Some(pb::PodTarget {
        pod_uids: vec![pod_uid.into()],
        ..Default::default()
    });
    c
}

fn spec_path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join("cdi")
        .join(format!("{DRIVER}-gpu_{claim_uid}.json"))
}

#[tokio::test]
async fn simulated_gpu_share_end_to_end() {
    if !net::privileged("simulated_gpu_share_end_to_end") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = start(dir.path(), r#"{ period = "1s", action = "report" }"#);
    let mut c = a.client().await;

    let d = device(&mut c, "gpu-0").await;
    assert_eq!(d.kind, "gpu");
    assert_eq!(d.capacity["memory"], "80Gi", "from [device.simulated]");
    assert!(
        d.mechanisms.iter().all(|m| m.starts_with("simulated")),
        "named as simulated everywhere: {:?}",
        d.mechanisms
    );

    let id = share_id();
    // The pod's cgroup exists (kubelet makes it before the sandbox): the limit goes on it.
    let sb = Sandbox::cgroup_only(&pod_uid(), Layout::Systemd);
    let pod = sb.uid();
    let r = prepare_one(&mut c, 0, gpu_claim("g1", &id, "10Gi", pod)).await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.mechanism, "simulated-cgroup");
    assert_eq!(
        s.sandbox.as_ref().map(|x| x.cgroup.as_str()),
        Some(sb.pod_cgroup().as_str()),
        "the limit is on the pod's own cgroup"
    );
    assert_eq!(
        s.limits[0].enforced, "10Gi",
        "read back from the simulated driver"
    );
    assert!(s.reason.contains("SIMULATED"), "{}", s.reason);

    // The claim's CDI spec: one device per share, named with the shareID.
    assert_eq!(r.cdi_device_ids, [format!("{DRIVER}/gpu=gpu-0-{id}")]);
    let path = spec_path(dir.path(), "g1");
    let spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    validate_spec(&spec).unwrap_or_else(|p| panic!("{path:?} is not a valid CDI spec: {p:?}"));
    assert_eq!(spec["kind"], format!("{DRIVER}/gpu"));
    assert_eq!(spec["devices"][0]["name"], format!("gpu-0-{id}"));
    assert_eq!(
        spec["devices"][0]["containerEdits"]["env"][0],
        format!("CUDA_VISIBLE_DEVICES={UUID}")
    );

    // 10Gi + 75Gi > 80Gi: refused, and no spec is written for it.
    let r = prepare_one(&mut c, 0, gpu_claim("g2", &share_id(), "75Gi", pod)).await;
    assert!(r.error.is_some(), "{r:?}");
    assert!(!spec_path(dir.path(), "g2").exists());
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "10Gi");

    // The simulated driver's state lives in the agent process, like a driver reset: after
    // a SIGKILL the restarted agent re-verifies, finds no limit and says so; a repeated
    // Prepare puts it back.
    a.kill9();
    fs::remove_file(&path).unwrap();
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Degraded as i32, "{s:?}");
    let r = prepare_one(&mut c, 0, gpu_claim("g1", &id, "10Gi", pod)).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    assert!(path.exists(), "a repeated Prepare rewrites the CDI spec");

    assert_eq!(unprepare_one(&mut c, 0, "g1").await.code, "");
    assert!(!path.exists(), "the spec is removed on release");
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "0");
}

/// `tests/gpu/simulated-driver-root.sh`: a SIMULATED driver root with `gpus` GPU nodes.
fn simulated_driver_root(root: &Path, gpus: u32) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu/simulated-driver-root.sh");
    let out = Command::new(&script)
        .arg(root)
        .arg(gpus.to_string())
        .arg("550.54.15")
        .output()
        .unwrap();
    assert!(out.status.success(), "{script:?}: {out:?}");
}

/// A GPU device with a driver root: the claim's CDI spec gives its containers the
/// driver's control nodes, its own GPU's node and no other, the driver's libraries under
/// every name the linker looks for and its tools, all read-only from the root, and
/// `NVIDIA_VISIBLE_DEVICES=void`. A root that lacks libcuda refuses the share with what
/// is missing, writes no spec and holds no capacity; once the files are there the same
/// Prepare goes through. (SIMULATED GPU and driver files: no GPU here.)
#[tokio::test]
async fn a_share_gets_its_gpus_node_and_the_drivers_files_from_the_driver_root() {
    if !net::privileged("a_share_gets_its_gpus_node_and_the_drivers_files_from_the_driver_root") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("driver");
    // Two GPU nodes: the device's GPU is the simulated back end's first, minor 0.
    simulated_driver_root(&root, 2);
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let libcuda = lib.join("libcuda.so.550.54.15");
    let saved = dir.path().join("libcuda.saved");
    fs::rename(&libcuda, &saved).unwrap();

    let mut o = Options::new(
        simulated_gpu_device(r#"{ period = "1s", action = "report" }"#).replace(
            "backend = \"simulated\"",
            &format!("backend = \"simulated\"\ndriver_root = {:?}", root),
        ),
    );
    o.agent_extra = format!(
        "cdi_dir = {:?}\nreconcile_period = \"1h\"",
        dir.path().join("cdi")
    );
    let a = Agent::start(o);
    let mut c = a.client().await;
    assert!(
        a.log_text().contains("libcuda.so"),
        "the missing library is logged at start"
    );

    let id = share_id();
    let sb = Sandbox::cgroup_only(&pod_uid(), Layout::Systemd);
    let r = prepare_one(&mut c, 0, gpu_claim("d1", &id, "10Gi", sb.uid())).await;
    let e = format!("{:?}", r.error);
    // The simulated back end names no driver version: any libcuda.so.<version> would do.
    assert!(e.contains("libcuda.so.<driver version>"), "{r:?}");
    assert!(e.contains(&root.display().to_string()), "{r:?}");
    assert!(
        !spec_path(dir.path(), "d1").exists(),
        "no spec for a refused claim"
    );
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "0");

    // The driver's library arrives (a driver container finishing its install): the
    // agent looks at the root again within seconds, and the same Prepare goes through.
    fs::rename(&saved, &libcuda).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let r = loop {
        let r = prepare_one(&mut c, 0, gpu_claim("d1", &id, "10Gi", sb.uid())).await;
        if r.error.is_none() || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(r.error, None, "{r:?}");

    let spec: serde_json::Value =
        serde_json::from_slice(&fs::read(spec_path(dir.path(), "d1")).unwrap()).unwrap();
    validate_spec(&spec).unwrap_or_else(|p| panic!("not a valid CDI spec: {p:?}"));
    let edits = &spec["devices"][0]["containerEdits"];
    let host = |rel: &str| root.join(rel).display().to_string();
    let nodes: Vec<(String, String)> = edits["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["path"].as_str().unwrap().to_owned(),
                n["hostPath"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        nodes,
        [
            ("/dev/nvidiactl".to_owned(), host("dev/nvidiactl")),
            ("/dev/nvidia-uvm".to_owned(), host("dev/nvidia-uvm")),
            (
                "/dev/nvidia-uvm-tools".to_owned(),
                host("dev/nvidia-uvm-tools")
            ),
            ("/dev/nvidia0".to_owned(), host("dev/nvidia0")),
        ],
        "the control nodes and its own GPU's, not /dev/nvidia1"
    );
    let mounts: Vec<(String, String)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(
                m["options"],
                serde_json::json!(["ro", "nosuid", "nodev", "bind"])
            );
            (
                m["containerPath"].as_str().unwrap().to_owned(),
                m["hostPath"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let l = "/usr/lib/x86_64-linux-gnu";
    let cuda = host("usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15");
    let ml = host("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15");
    assert_eq!(
        mounts,
        [
            (format!("{l}/libcuda.so.550.54.15"), cuda.clone()),
            (format!("{l}/libcuda.so"), cuda.clone()),
            (format!("{l}/libcuda.so.1"), cuda),
            (format!("{l}/libnvidia-ml.so.550.54.15"), ml.clone()),
            (format!("{l}/libnvidia-ml.so"), ml.clone()),
            (format!("{l}/libnvidia-ml.so.1"), ml),
            ("/usr/bin/nvidia-smi".to_owned(), host("usr/bin/nvidia-smi")),
        ]
    );
    let env = edits["env"].as_array().unwrap();
    assert!(
        env.contains(&"NVIDIA_VISIBLE_DEVICES=void".into()),
        "{env:?}"
    );
    assert!(
        env.contains(&format!("CUDA_VISIBLE_DEVICES={UUID}").into()),
        "{env:?}"
    );
    assert_eq!(unprepare_one(&mut c, 0, "d1").await.code, "");
}

/// A claim whose limit cannot be set is rolled back; when the driver also refuses to
/// remove what was recorded, nothing is leaked: the share stays RELEASING with its
/// capacity held (another claim cannot take it), and the reconciler finishes the removal
/// once the driver lets it, which frees the capacity. The faults are the SIMULATED
/// driver's, injected through its faults file.
#[tokio::test]
async fn a_roll_back_the_driver_refuses_holds_the_capacity_until_it_is_removed() {
    if !net::privileged("a_roll_back_the_driver_refuses_holds_the_capacity_until_it_is_removed") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults.json");
    fs::write(
        &faults,
        r#"[{"op": "set_cgroup_limit", "error": "unknown"},
            {"op": "clear_cgroup_limit", "error": "unknown"}]"#,
    )
    .unwrap();
    let mut o = Options::new(simulated_gpu_device(
        "{ period = \"1s\", action = \"report\" }",
    ));
    o.agent_extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_faults = {faults:?}\nreconcile_period = \"200ms\"",
        dir.path().join("cdi"),
    );
    let a = Agent::start(o);
    let mut c = a.client().await;
    let sb = Sandbox::cgroup_only(&pod_uid(), Layout::Systemd);

    let id = share_id();
    let r = prepare_one(&mut c, 0, gpu_claim("rb", &id, "50Gi", sb.uid())).await;
    let e = r
        .error
        .as_ref()
        .expect("the claim fails: its limit cannot be set");
    assert!(e.retryable, "a transient driver error: {e:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Releasing as i32, "{r:?}");
    assert!(
        r.shares[0]
            .reason
            .contains("removing what was installed failed"),
        "{}",
        r.shares[0].reason
    );
    assert!(!spec_path(dir.path(), "rb").exists(), "no CDI spec for it");
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "50Gi");
    // Held, not just counted: 50Gi + 40Gi > 80Gi.
    let other = prepare_one(&mut c, 0, gpu_claim("rb2", &share_id(), "40Gi", sb.uid())).await;
    let oe = other
        .error
        .expect("refused while the rolled-back share holds 50Gi");
    assert_eq!(oe.code, "ResourceExhausted", "{oe:?}");
    // A reconciler pass (every 200ms) tries again while the driver still refuses.
    net::wait_for(
        "a retried removal in the log",
        Duration::from_secs(10),
        || a.log_text().contains("roll-back removal failed again"),
    );
    assert_eq!(
        get_share(&mut c, id.clone()).await.phase,
        pb::Phase::Releasing as i32
    );

    // The driver lets go: the reconciler removes the limit and only then frees the share.
    fs::remove_file(&faults).unwrap();
    let s = wait_phase(&mut c, &id, pb::Phase::Failed).await;
    assert!(s.reason.starts_with("claim rolled back"), "{}", s.reason);
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "0");
    let r = prepare_one(&mut c, 0, gpu_claim("rb3", &share_id(), "40Gi", sb.uid())).await;
    assert_eq!(r.error, None, "the capacity is free again: {r:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    let lines = a.audit_lines();
    let of = |decision: &str| {
        lines
            .iter()
            .filter(|l| l["decision"] == decision && l["share_id"] == id.as_str())
            .count()
    };
    assert_eq!(
        (of("fail"), of("release")),
        (1, 1),
        "the roll-back and its end, audited once each"
    );
}

#[tokio::test]
async fn watchdog_terminates_only_the_process_over_its_share() {
    if !net::privileged("watchdog_terminates_only_the_process_over_its_share") {
        return;
    }
    // One pod in each kubelet layout, each with its sandbox process.
    let mut pa = Sandbox::start(&pod_uid(), Layout::Systemd, None);
    let mut pb_ = Sandbox::start(&pod_uid(), Layout::Cgroupfs, None);
    let (uid_a, uid_b) = (pa.uid().to_owned(), pb_.uid().to_owned());

    let dir = tempfile::tempdir().unwrap();
    let a = start(
        dir.path(),
        r#"{ period = "100ms", action = "terminate", grace = "300ms" }"#,
    );
    let mut c = a.client().await;
    let (id_a, id_b) = (share_id(), share_id());
    for (uid, id, pod) in [("wa", &id_a, &uid_a), ("wb", &id_b, &uid_b)] {
        let r = prepare_one(&mut c, 0, gpu_claim(uid, id, "10Gi", pod)).await;
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    }
    // The simulated GPU reports the processes: A at 12Gi of its 10Gi, B at 5Gi and a
    // second process of B whose usage the driver does not report.
    let mut b2 = Sandbox::start(&uid_b, Layout::Cgroupfs, None);
    fs::write(
        dir.path().join("processes.json"),
        serde_json::json!([
            { "gpu_uuid": UUID, "pid": pa.pid(), "used_bytes": 12u64 << 30 },
            { "gpu_uuid": UUID, "pid": pb_.pid(), "used_bytes": 5u64 << 30 },
            { "gpu_uuid": UUID, "pid": b2.pid(), "used_bytes": null },
        ])
        .to_string(),
    )
    .unwrap();

    let deadline = Instant::now() + Duration::from_secs(10);
    while pa.running() {
        assert!(
            Instant::now() < deadline,
            "the process over its share was not terminated within 10 s:\n{}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(pb_.running(), "the process within its share must live");

    // The kill happens in the poll; the audit line follows when the engine takes it.
    let lines = a.wait_audit("terminate", &id_a, deadline);
    let of = |decision: &str, id: &str| audit_count(&lines, decision, id);
    assert_eq!(of("over_limit", &id_a), 1, "{lines:?}");
    assert!(of("terminate", &id_a) >= 1, "{lines:?}");
    assert_eq!(of("over_limit", &id_b) + of("terminate", &id_b), 0);
    let term = lines.iter().find(|l| l["decision"] == "terminate").unwrap();
    assert!(
        term["reason"]
            .as_str()
            .unwrap()
            .contains(&pa.pid().unwrap().to_string()),
        "{term}"
    );

    // B's usage is shown in its status, and that it counts only what the driver reports;
    // the metrics count the event and the kill.
    let s = get_share(&mut c, id_b).await;
    assert_eq!(s.usage[0].name, "memory");
    assert_eq!(s.usage[0].used, "5Gi");
    assert!(
        s.reason
            .contains("the driver does not report the memory of 1 of the share's processes"),
        "{s:?}"
    );
    assert!(b2.running(), "a process of unknown usage is never chosen");
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
    assert!(
        metric_sample(
            &body,
            "shareguard_gpu_terminations_total",
            &[("outcome", "terminated")]
        )
        .is_some_and(|n| n >= 1.0),
        "{body}"
    );
}

/// Without NVML (no driver, no library: this machine), an `nvml` GPU device is listed as
/// unavailable with the reason, holds no capacity, refuses its shares, and the agent
/// serves its other devices as usual.
#[tokio::test]
async fn missing_nvml_leaves_the_device_unavailable_and_the_agent_serving() {
    if shareguard_limiter_gpu::nvml::NvmlBackend::open().is_ok() {
        eprintln!(
            "SKIPPED missing_nvml_leaves_the_device_unavailable_and_the_agent_serving: this machine has NVML"
        );
        return;
    }
    let devices = format!(
        r#"
[[device]]
name = "gpu-0"
driver = "{DRIVER}"
pool = "{POOL}"
kind = "gpu"
backend = "nvml"
index = 0
allowed_namespaces = ["*"]
[device.capacity.memory]
default = "1Gi"
valid_range = {{ min = "1Gi", step = "1Gi" }}
{}"#,
        shareguard_tests::generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
    );
    let a = Agent::start(Options::new(devices));
    let mut c = a.client().await;
    let d = device(&mut c, "gpu-0").await;
    assert_eq!(d.mechanisms.len(), 1);
    assert!(
        d.mechanisms[0].starts_with("unavailable: NVML"),
        "{:?}",
        d.mechanisms
    );
    assert_eq!(
        d.capacity["memory"], "0",
        "nothing discovered, nothing to hand out"
    );
    let r = prepare_one(&mut c, 0, gpu_claim("nv", &share_id(), "1Gi", &pod_uid())).await;
    assert!(r.error.is_some(), "{r:?}");
    assert!(
        a.log_text().contains("NVML unavailable"),
        "the reason is logged"
    );
    // The other device is served as usual.
    let r = prepare_one(
        &mut c,
        0,
        claim(
            "g",
            "team-a",
            "a1",
            vec![alloc("gen-0", &share_id(), "5Gi")],
        ),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Accounted as i32);
}

/// Where the per-share MPS daemons of one test live; kills any still running and
/// detaches each share's /dev/shm tmpfs when dropped, so a failed assertion leaves no
/// process and no mount behind.
struct MpsDir(PathBuf);

impl MpsDir {
    fn pid(&self, share: &str) -> Option<u32> {
        fs::read_to_string(self.0.join(share).join("pipe/nvidia-cuda-mps-control.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for MpsDir {
    fn drop(&mut self) {
        for e in fs::read_dir(&self.0).into_iter().flatten().flatten() {
            if let Ok(pid) = fs::read_to_string(e.path().join("pipe/nvidia-cuda-mps-control.pid")) {
                let _ = Command::new("kill").arg(pid.trim()).status();
            }
            // Fails harmlessly where the share was released (nothing mounted there).
            for tmpfs in ["shm", "pipe"] {
                let _ = Command::new("umount")
                    .arg("--lazy")
                    .arg(e.path().join(tmpfs))
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
}

/// Alive and not a zombie (a quit daemon may wait for its reaper for a while).
fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// The `mps` mechanism end to end through the agent: a simulated GPU that offers MPS
/// only, whose shares the real MPS daemon management enforces by driving a SIMULATION
/// of NVIDIA's control program (limiter-gpu/tests/fixtures). One daemon per share, its
/// pipe directory in the claim's CDI spec, the daemon outliving an agent SIGKILL, a dead
/// daemon found and replaced by the reconciler, and everything gone on release.
#[tokio::test]
async fn mps_share_gets_its_own_daemon_through_the_agent() {
    if !net::privileged("mps_share_gets_its_own_daemon_through_the_agent") {
        return;
    }
    let (t, o) = MpsTest::new();
    let (dir, mps, processes) = (&t.dir, &t.mps, t.processes.clone());
    let mut a = Agent::start(o);
    let mut c = a.client().await;
    assert_eq!(
        device(&mut c, "gpu-0").await.mechanisms,
        ["simulated-mps", "simulated-watchdog"]
    );

    let id = share_id();
    // MPS needs nothing of the pod: the daemon is there before the pod's containers.
    let pod = pod_uid();
    let r = prepare_one(&mut c, 0, gpu_claim("m1", &id, "10Gi", &pod)).await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.mechanism, "simulated-mps");
    assert_eq!(s.limits[0].enforced, "10Gi", "read back from the daemon");
    let pid = mps.pid(&id).expect("a daemon for the share");
    assert!(alive(pid));

    // The containers get the share's own pipe directory, and nothing else of MPS.
    let pipe = mps.0.join(&id).join("pipe");
    let path = spec_path(dir.path(), "m1");
    let spec: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    validate_spec(&spec).unwrap_or_else(|p| panic!("{path:?} is not a valid CDI spec: {p:?}"));
    let edits = &spec["devices"][0]["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    assert!(
        env.contains(&format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display()).as_str()),
        "{env:?}"
    );
    assert_eq!(edits["mounts"][0]["hostPath"], pipe.to_str().unwrap());
    // The daemon's /dev/shm is the share's own directory, and the containers get it.
    let shm = mps.0.join(&id).join("shm");
    assert_eq!(edits["mounts"][1]["hostPath"], shm.to_str().unwrap());
    assert_eq!(edits["mounts"][1]["containerPath"], "/dev/shm");
    assert!(
        shm.join("simulated-mps-daemon").exists(),
        "the daemon's /dev/shm"
    );

    // The daemon outlives the agent: the restarted agent reads the limit back from it.
    a.kill9();
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(mps.pid(&id), Some(pid), "the same daemon");

    // A dead daemon is drift: the reconciler starts a new one with the limit.
    assert!(
        Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if let Some(new) = mps.pid(&id)
            && new != pid
            && alive(new)
            && s.phase == pb::Phase::Enforced as i32
        {
            break;
        }
        assert!(Instant::now() < deadline, "no new daemon within 20s: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Counted once the repair is persisted, which the share's status shows first.
    a.wait_metric(
        "shareguard_reconcile_repairs_total",
        &[("device", "gpu-0")],
        |n| n >= 1.0,
    );

    // The pod's process, reported by the simulated GPU as a client of the daemon: the
    // share stays ENFORCED through reconcile passes. Reported as running on the GPU
    // directly (its container lost CUDA_MPS_PIPE_DIRECTORY), it is unlimited: DEGRADED,
    // and ENFORCED again once it is a client.
    // Not root: a root tenant's client is refused MPS (below).
    let proc = Sandbox::start_as(&pod, Layout::Systemd, NOBODY);
    let report = |via_mps: bool| {
        fs::write(
            &processes,
            serde_json::json!([
                { "gpu_uuid": UUID, "pid": proc.pid(), "used_bytes": 1u64 << 30, "via_mps": via_mps },
            ])
            .to_string(),
        )
        .unwrap();
    };
    let passes = |a: &Agent| {
        metric_sample(
            &a.http("/metrics").1,
            "shareguard_reconcile_duration_seconds_count",
            &[],
        )
        .unwrap_or(0.0)
    };
    let wait_for = |what: &str, deadline: Instant, ok: &dyn Fn() -> bool| {
        while !ok() {
            assert!(Instant::now() < deadline, "{what} within 20s");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    report(true);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.usage.first().is_some_and(|u| u.used == "1Gi") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the watchdog never saw the process: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = passes(&a);
    wait_for("two reconcile passes", deadline, &|| {
        passes(&a) >= seen + 2.0
    });
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "an MPS client: {s:?}");
    report(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.phase == pb::Phase::Degraded as i32 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a process outside MPS went unnoticed: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report(true);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.phase == pb::Phase::Enforced as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "not ENFORCED again: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A second client of the same share: MPS bounds each client on its own, so the two
    // may hold 20Gi together. The status says so, never 10Gi ENFORCED; with one client
    // again it is the share's limit once more.
    let drift_lines = audit_count(&a.audit_lines(), "drift", &id);
    let drift_metric = || {
        metric_sample(
            &a.http("/metrics").1,
            "shareguard_reconcile_drift_total",
            &[("device", "gpu-0")],
        )
        .unwrap_or(0.0)
    };
    let drifts = drift_metric();
    let second = Sandbox::start_as(&pod, Layout::Systemd, NOBODY);
    report_mps_clients(&processes, &[proc.pid(), second.pid()]);
    let s = wait_share(
        &mut c,
        &id,
        "two MPS clients reported as more than the share's limit",
        |s| s.phase == pb::Phase::Degraded as i32 && s.limits[0].enforced == "20Gi",
    )
    .await;
    assert!(
        s.reason.contains(
            "2 processes of the share, each bound to 10Gi on its own, may hold 20Gi together"
        ),
        "{s:?}"
    );
    // The tenant started a process; nothing undid the limit. Not drift: no drift line or
    // count (the drift alert would fire on a tenant's action), no repair tried, and one
    // `degrade` line that says why.
    assert!(
        !s.reason.contains("drift") && !s.reason.contains("repair"),
        "{s:?}"
    );
    // The audit line follows the status it records: waited for, then counted.
    let deadline = Instant::now() + Duration::from_secs(20);
    while audit_count(&a.audit_lines(), "degrade", &id) == 0 {
        assert!(Instant::now() < deadline, "no degrade line");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines = a.audit_lines();
    assert_eq!(audit_count(&lines, "drift", &id), drift_lines, "{lines:?}");
    assert_eq!(audit_count(&lines, "degrade", &id), 1, "{lines:?}");
    assert_eq!(drift_metric(), drifts);
    drop(second);
    report(true);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.phase == pb::Phase::Enforced as i32 && s.limits[0].enforced == "10Gi" {
            assert!(s.reason.contains("memory held per process"), "{s:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ENFORCED with one client: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A client of the share that runs as root outside a user namespace owns the pipe
    // directory and could serve the daemon's socket itself: MPS does not hold the
    // share, and the status says so; without it, ENFORCED again.
    let root = Sandbox::start(&pod, Layout::Systemd, None);
    report_mps_clients(&processes, &[proc.pid(), root.pid()]);
    let s = wait_share(&mut c, &id, "a root client noticed", |s| {
        s.phase == pb::Phase::Degraded as i32 && s.reason.contains("root tenant")
    })
    .await;
    assert!(
        s.reason.contains(&format!(
            "process {} of the share's pod runs as root",
            root.pid().expect("a started sandbox has a process")
        )),
        "{s:?}"
    );
    drop(root);
    report(true);
    loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.phase == pb::Phase::Enforced as i32 {
            break;
        }
        assert!(Instant::now() < deadline, "not ENFORCED again: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(proc);

    let last = mps.pid(&id).unwrap();
    assert_eq!(unprepare_one(&mut c, 0, "m1").await.code, "");
    assert!(!alive(last), "the daemon quit on release");
    assert!(!mps.0.join(&id).exists(), "its directory is gone");
    assert!(!path.exists(), "the CDI spec is removed");
}

/// The rollout's observe stage on a GPU: the share is admitted and counted, nothing
/// limits it, and the watchdog reports its usage against its amount without acting on
/// it, whatever the device's action; `rollout gpu-0 enforce` limits it and the device's
/// action (terminate) applies again.
#[tokio::test]
async fn an_observed_gpu_share_is_reported_and_never_terminated() {
    if !net::privileged("an_observed_gpu_share_is_reported_and_never_terminated") {
        return;
    }
    let mut pa = Sandbox::start(&pod_uid(), Layout::Systemd, None);
    let uid_a = pa.uid().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let devices =
        simulated_gpu_device(r#"{ period = "100ms", action = "terminate", grace = "300ms" }"#)
            .replace("kind = \"gpu\"", "kind = \"gpu\"\nstage = \"observe\"");
    let mut o = Options::new(devices);
    o.agent_extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_processes = {:?}\nreconcile_period = \"1h\"",
        dir.path().join("cdi"),
        dir.path().join("processes.json")
    );
    let a = Agent::start(o);
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(&mut c, 0, gpu_claim("oa", &id, "10Gi", &uid_a)).await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Observed as i32, "{r:?}");
    assert!(r.shares[0].limits[0].enforced.is_empty(), "{r:?}");
    assert_eq!(device(&mut c, "gpu-0").await.allocated["memory"], "10Gi");

    // 12Gi of its 10Gi: reported (audit, metric, status), never terminated.
    fs::write(
        dir.path().join("processes.json"),
        serde_json::json!([{ "gpu_uuid": UUID, "pid": pa.pid(), "used_bytes": 12u64 << 30 }])
            .to_string(),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let lines = a.wait_audit("over_limit", &id, deadline);
    assert_eq!(audit_count(&lines, "terminate", &id), 0, "{lines:?}");
    // Well past the grace under which `terminate` would have acted: ten more polls.
    let polls = a.wait_metric(
        "shareguard_gpu_watchdog_polls_total",
        &[("result", "ok")],
        |_| true,
    );
    a.wait_metric(
        "shareguard_gpu_watchdog_polls_total",
        &[("result", "ok")],
        |n| n >= polls + 10.0,
    );
    assert!(
        pa.running(),
        "an observed share's process is never terminated"
    );
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Observed as i32, "{s:?}");
    assert_eq!(
        (s.usage[0].name.as_str(), s.usage[0].used.as_str()),
        ("memory", "12Gi")
    );
    assert!(s.reason.contains("over the memory limit since"), "{s:?}");
    let status: serde_json::Value = serde_json::from_str(&s.device_status_json).unwrap();
    assert_eq!(status["data"]["observed"]["memory"], "12Gi", "{status}");

    // Enforce: limited and read back; the device's action applies to it again.
    let o = a.cli(&["rollout", "gpu-0", "enforce"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.limits[0].enforced, "10Gi", "{s:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while pa.running() {
        assert!(
            Instant::now() < deadline,
            "enforced, the process over its share is terminated:\n{}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The simulated GPU's process list (its `simulated_gpu_processes` file): each of
/// `pids` an MPS client of the GPU holding 1 GiB.
fn report_mps_clients(file: &Path, pids: &[Option<u32>]) {
    let list: Vec<serde_json::Value> = pids
        .iter()
        .map(|pid| {
            serde_json::json!({ "gpu_uuid": UUID, "pid": pid, "used_bytes": 1u64 << 30, "via_mps": true })
        })
        .collect();
    fs::write(file, serde_json::Value::Array(list).to_string()).unwrap();
}

/// The cgroups of a stand-in for the agent's container: one per hierarchy the test can
/// make one in (cgroup v2, and v1 but cpuset, whose new cgroups need settings first).
/// Killing every process in them is what a container runtime does when it tears the
/// container down. Removed on drop, with whatever is still in them killed.
struct ContainerCgroups(Vec<PathBuf>);

impl ContainerCgroups {
    fn new() -> Self {
        let name = format!("sgt-agent-{}-{}", std::process::id(), share_id());
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mut made = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for m in shareguard_limiter_gpu::cgroupns::cgroup_mounts(&info) {
            if m.root != "/" || m.options.iter().any(|o| o == "cpuset") {
                continue;
            }
            if !seen.insert((m.v2, m.options.clone())) {
                continue;
            }
            let dir = m.point.join(&name);
            fs::create_dir(&dir).unwrap();
            made.push(dir);
        }
        Self(made)
    }

    /// A `run_through` that puts the agent in these cgroups before it starts.
    fn run_through(&self) -> Vec<String> {
        let writes: String = self
            .0
            .iter()
            .map(|d| format!("echo $$ > {:?} && ", d.join("cgroup.procs")))
            .collect();
        vec![
            "sh".into(),
            "-c".into(),
            format!("{writes}exec \"$@\""),
            "sh".into(),
        ]
    }

    /// SIGKILL to every process in them until none is left.
    fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids: Vec<String> = self
                .0
                .iter()
                .flat_map(|d| {
                    fs::read_to_string(d.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                        .map(str::to_owned)
                        .collect::<Vec<_>>()
                })
                .collect();
            if pids.is_empty() {
                return;
            }
            assert!(Instant::now() < deadline, "still in the cgroups: {pids:?}");
            let _ = Command::new("kill").arg("-9").args(&pids).status();
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ContainerCgroups {
    fn drop(&mut self) {
        self.kill_all();
        for d in &self.0 {
            let _ = fs::remove_dir(d);
        }
    }
}

/// Tenants outlive the agent: its MPS daemons run outside its cgroup, so tearing its
/// container down (every process in the container's cgroups killed, as a rolling
/// update or an OOM kill of the container does) leaves the share's daemon running with
/// its limit, and the restarted agent takes the same daemon back, ENFORCED, without a
/// new one. (SIMULATED GPU and control program.)
#[tokio::test]
async fn an_mps_daemon_outlives_the_agents_container_and_is_taken_back() {
    if !net::privileged("an_mps_daemon_outlives_the_agents_container_and_is_taken_back") {
        return;
    }
    let (t, mut o) = MpsTest::new();
    let (mps, cgroup) = (&t.mps, t.cgroup.0.clone());
    let container = ContainerCgroups::new();
    o.run_through = container.run_through();
    let mut a = Agent::start(o);
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(&mut c, 0, gpu_claim("o1", &id, "10Gi", &pod_uid())).await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    let daemon = mps.pid(&id).expect("a daemon for the share");
    let cgroup_of = |pid: u32| fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let agent_pid = a.pid();
    assert!(
        cgroup_of(agent_pid).contains("sgt-agent-"),
        "the agent runs in the stand-in container: {}",
        cgroup_of(agent_pid)
    );
    assert!(
        !cgroup_of(daemon).contains("sgt-agent-"),
        "the daemon left it: {}",
        cgroup_of(daemon)
    );
    assert!(cgroup_of(daemon).contains(&format!("0::/{cgroup}")));

    container.kill_all();
    assert!(!alive(agent_pid), "the agent went with its container");
    assert!(alive(daemon), "the tenant's daemon did not");

    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.limits[0].enforced, "10Gi");
    assert_eq!(mps.pid(&id), Some(daemon), "the same daemon, taken back");

    assert_eq!(unprepare_one(&mut c, 0, "o1").await.code, "");
    assert!(!alive(daemon), "released: the daemon quit");
}

/// What an agent with a SIMULATED MPS GPU needs of a test: a directory of its own,
/// the daemons' directory (their processes killed on drop) and cgroup (removed after
/// them), and the simulated GPU's process list. Fields drop in this order.
struct MpsTest {
    mps: MpsDir,
    cgroup: DaemonsCgroup,
    processes: PathBuf,
    dir: tempfile::TempDir,
}

impl MpsTest {
    /// The test's directories and the agent's options: one GPU offering MPS only, the
    /// simulated control program, a reconcile every 300 ms.
    fn new() -> (Self, Options) {
        let dir = tempfile::Builder::new().prefix("sg").tempdir().unwrap();
        let cgroup = DaemonsCgroup(format!("sgt-mps-{}-{}", std::process::id(), share_id()));
        let mps = MpsDir(dir.path().join("mps"));
        let processes = dir.path().join("processes.json");
        let control = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../limiter-gpu/tests/fixtures/simulated-nvidia-cuda-mps-control");
        let mut o = Options::new(
            simulated_gpu_device(r#"{ period = "100ms", action = "report" }"#).replace(
                "memory = \"80Gi\"\n",
                "memory = \"80Gi\"\ncgroup_limits = false\n",
            ),
        );
        o.agent_extra = format!(
            "cdi_dir = {:?}\nmps_control = {control:?}\nmps_dir = {:?}\nmps_cgroup = {:?}\nreconcile_period = \"300ms\"\nsimulated_gpu_processes = {processes:?}",
            dir.path().join("cdi"),
            mps.0,
            cgroup.0
        );
        (
            Self {
                mps,
                cgroup,
                processes,
                dir,
            },
            o,
        )
    }
}

/// The test's own cgroup for MPS daemons, removed once they are gone.
struct DaemonsCgroup(String);

impl Drop for DaemonsCgroup {
    fn drop(&mut self) {
        if let Err(e) = shareguard_limiter_gpu::mps_cgroup::remove(&self.0, Duration::from_secs(5))
        {
            eprintln!("{e}");
        }
    }
}

/// `gpus = "all"` through the real agent: the table is no device itself; every GPU the
/// (SIMULATED) back end lists is one, named by its uuid, with its own capacity, ledger
/// and attributes.
#[tokio::test]
async fn gpus_all_makes_one_device_of_each_gpu_listed() {
    let table = simulated_gpu_device(r#"{ period = "1s", action = "report" }"#)
        .replace("name = \"gpu-0\"", "name = \"gpu\"")
        .replace(
            "backend = \"simulated\"",
            "backend = \"simulated\"\ngpus = \"all\"",
        )
        .replace("memory = \"80Gi\"", "memory = \"16Gi\"\ncount = 2");
    let dir = tempfile::tempdir().unwrap();
    let mut o = Options::new(table);
    o.agent_extra = format!("cdi_dir = {:?}", dir.path().join("cdi"));
    let a = Agent::start(o);
    let mut c = a.client().await;

    let listed = devices(&mut c).await;
    let names: Vec<&str> = listed.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["gpu-simulated-gpu-0", "gpu-simulated-gpu-1"]);
    for (i, d) in listed.iter().enumerate() {
        assert_eq!(d.kind, "gpu");
        assert_eq!(d.capacity["memory"], "16Gi", "{}", d.name);
        assert_eq!(
            d.attributes.get("uuid").map(String::as_str),
            Some(format!("GPU-simulated-gpu-{i}").as_str()),
            "{}: {:?}",
            d.name,
            d.attributes
        );
    }

    // Each GPU holds its own shares: 16Gi on each, so 12Gi fits once on each and not
    // twice on one; the table's own name is no device.
    for (n, (dev, want_ok)) in [
        ("gpu-simulated-gpu-0", true),
        ("gpu-simulated-gpu-1", true),
        ("gpu-simulated-gpu-0", false),
        ("gpu", false),
    ]
    .into_iter()
    .enumerate()
    {
        // A pod with no sandbox yet: the share waits for it, its capacity held.
        let mut one = claim(
            &format!("all-{n}"),
            "team-a",
            "a1",
            vec![alloc(dev, &share_id(), "12Gi")],
        );
        one.target = Some(pb::PodTarget {
            pod_uids: vec![pod_uid()],
            ..Default::default()
        });
        let r = prepare_one(&mut c, 0, one).await;
        assert_eq!(r.error.is_none(), want_ok, "{dev}: {r:?}");
    }
    let free = |d: &pb::DeviceStatus| d.free["memory"].clone();
    let listed = devices(&mut c).await;
    assert_eq!(listed.iter().map(free).collect::<Vec<_>>(), ["4Gi", "4Gi"]);
}
