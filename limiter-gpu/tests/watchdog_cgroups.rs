//! The watchdog against the real system.
//!
//! Each test creates real cgroups laid out as the kubelet lays them out (systemd driver:
//! `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/
//! cri-containerd-<id>.scope`; cgroupfs driver: `kubepods/besteffort/pod<uid>/<id>`),
//! starts real `sleep` processes in them, and has the simulated GPU report those pids
//! with memory usage. The watchdog maps every pid to its pod by reading the real
//! `/proc/PID/cgroup`, reports the share over its limit and, with `terminate`, the real
//! [`PidfdTerminator`] ends that process and no other.
//!
//! Root only (cgroups): without root each test prints `SKIPPED <test>: needs root
//! (cgroups)` and passes, unless `CI=true`, where it fails. Tests for a hierarchy the
//! host does not mount (the v1 `name=systemd` one on a pure v2 node) skip likewise.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

#[allow(dead_code)]
#[path = "support/cgroups.rs"]
mod cgroups;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shareguard_common::Quantity;
use shareguard_common::limiter::{LimitSpec, Limiter, Target};
use shareguard_limiter_gpu::GpuLimiter;
use shareguard_limiter_gpu::backend::{ComputeProcess, Mechanism};
use shareguard_limiter_gpu::cgroup::{pod_uid_of_pid, read_proc_cgroup};
use shareguard_limiter_gpu::cgroupns::agent_namespace;
use shareguard_limiter_gpu::limiter::{GpuDeviceConfig, GpuSelector, MEMORY};
use shareguard_limiter_gpu::simulated::{SimulatedBackend, SimulatedGpu};
use shareguard_limiter_gpu::sys::PidfdTerminator;
use shareguard_limiter_gpu::watchdog::{
    Action, ProcessTerminator, TerminateError, Terminated, Verdict, Watchdog, execute_terminations,
};

use cgroups::{
    Fixture, Hierarchy, cgroupfs_besteffort, container_id, move_to, pod_uid, require_hierarchy,
    require_root, systemd_burstable,
};

const GIB: u64 = 1 << 30;
const GPU: &str = "GPU-simulated-watchdog-0";
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);
const KILL_NOW: Action = Action::Terminate {
    grace: Duration::ZERO,
};

fn proc_root() -> &'static Path {
    Path::new("/proc")
}

/// A simulated GPU without cgroup limits or MPS: the watchdog is all there is.
fn watchdog_only_gpu() -> Arc<SimulatedBackend> {
    let mut gpu = SimulatedGpu::new(GPU, 80 * GIB);
    gpu.cgroup_limits = false;
    gpu.mps = false;
    Arc::new(SimulatedBackend::new(vec![gpu]))
}

/// A limiter over `backend` holding one share of `limit` per (share key, pod uid).
fn limiter(backend: &Arc<SimulatedBackend>, shares: &[(&str, &str)], limit: &str) -> GpuLimiter {
    let l = GpuLimiter::new(
        backend.clone(),
        &[GpuDeviceConfig {
            name: "gpu0".into(),
            gpu: GpuSelector::Uuid(GPU.into()),
            memory_bytes: None,
            driver_root: None,
            container_driver_root: None,
        }],
    )
    .unwrap();
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::Watchdog);
    for (key, uid) in shares {
        let e = l
            .apply(&LimitSpec {
                share_key: (*key).into(),
                device: "gpu0".into(),
                limits: BTreeMap::from([(MEMORY.to_string(), Quantity::parse(limit).unwrap())]),
                target: Target {
                    pod_uids: vec![(*uid).into()],
                    ..Target::default()
                },
            })
            .unwrap();
        assert_eq!(e.mechanism, "simulated-watchdog");
        assert!(
            e.enforced.is_empty(),
            "the watchdog enforces nothing up front"
        );
    }
    l
}

fn report(backend: &SimulatedBackend, procs: &[(u32, u64)]) {
    backend.set_processes(
        GPU,
        procs
            .iter()
            .map(|&(pid, bytes)| ComputeProcess {
                pid,
                used_bytes: Some(bytes),
                via_mps: false,
            })
            .collect(),
    );
}

/// One watchdog tick as the agent will run it: the back end's processes of every GPU,
/// pid -> pod from the real `/proc`, the limiter's share table.
fn tick(wd: &mut Watchdog, l: &GpuLimiter, action: Action) -> Verdict {
    wd.evaluate(
        Instant::now(),
        &l.process_usage().unwrap(),
        |pid| pod_uid_of_pid(proc_root(), &agent_namespace().roots(), pid),
        &l.watched_shares(action),
    )
}

fn cgroup_file(pid: u32) -> String {
    read_proc_cgroup(proc_root(), pid).unwrap_or_else(|e| format!("<{e}>"))
}

fn assert_pod(pid: u32, uid: Option<&str>) {
    assert_eq!(
        pod_uid_of_pid(proc_root(), &agent_namespace().roots(), pid).as_deref(),
        uid,
        "pid {pid}, /proc/{pid}/cgroup:\n{}",
        cgroup_file(pid)
    );
}

fn assert_running(fx: &mut Fixture, procs: &[(usize, u32)]) {
    for &(i, pid) in procs {
        assert_eq!(fx.exited(i), None, "pid {pid} must still run");
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    Systemd,
    Cgroupfs,
}

/// Two pods with a 4 GiB share each, one in each kubelet layout, two processes each; a
/// third pod without a share and a host process also use the GPU. The pod in `over`
/// uses 5 + 1 GiB, the other 3 + 0.5 GiB.
fn over_limit_scenario(test: &str, tag: u16, h: Hierarchy, over: Layout, action: Action) {
    if !require_root(test) {
        return;
    }
    let Some(mount) = require_hierarchy(test, h) else {
        return;
    };
    let mut fx = Fixture::new();
    let root = fx.root(&mount, test);

    let (uid_sys, uid_fs, uid_none) = (pod_uid(tag, 1), pod_uid(tag, 2), pod_uid(tag, 3));
    let cg_sys =
        [1, 2].map(|n| fx.cgroup(&root, &systemd_burstable(&uid_sys, &container_id(tag, n))));
    let cg_fs =
        [3, 4].map(|n| fx.cgroup(&root, &cgroupfs_besteffort(&uid_fs, &container_id(tag, n))));
    let cg_none = fx.cgroup(
        &root,
        &cgroupfs_besteffort(&uid_none, &container_id(tag, 5)),
    );

    let sys = cg_sys.map(|c| fx.spawn_in(&c));
    let fs = cg_fs.map(|c| fx.spawn_in(&c));
    let no_share = fx.spawn_in(&cg_none);
    let host = fx.spawn_sleep();

    for (_, pid) in sys {
        assert_pod(pid, Some(&uid_sys));
    }
    for (_, pid) in fs {
        assert_pod(pid, Some(&uid_fs));
    }
    assert_pod(no_share.1, Some(&uid_none));
    assert_pod(host.1, None);

    let backend = watchdog_only_gpu();
    let l = limiter(
        &backend,
        &[("share-sys", &uid_sys), ("share-fs", &uid_fs)],
        "4Gi",
    );
    let (over_procs, under_procs, over_uid, over_key) = match over {
        Layout::Systemd => (sys, fs, &uid_sys, "share-sys"),
        Layout::Cgroupfs => (fs, sys, &uid_fs, "share-fs"),
    };
    let [big, small] = over_procs;
    report(
        &backend,
        &[
            (big.1, 5 * GIB),
            (small.1, GIB),
            (under_procs[0].1, 3 * GIB),
            (under_procs[1].1, GIB / 2),
            (no_share.1, 10 * GIB),
            (host.1, 10 * GIB),
        ],
    );

    let mut wd = Watchdog::new();
    let v = tick(&mut wd, &l, action);

    // Every pid is mapped to its share through its real /proc/PID/cgroup.
    let mut usage: Vec<(String, Vec<u32>, u64)> = v
        .usage
        .iter()
        .map(|u| (u.pod_uid.clone(), u.pids.clone(), u.used_bytes))
        .collect();
    usage.sort();
    let mut want = vec![
        (uid_sys.clone(), sorted(sys.map(|p| p.1))),
        (uid_fs.clone(), sorted(fs.map(|p| p.1))),
    ];
    want.sort();
    let used_of = |uid: &str| {
        if uid == over_uid {
            6 * GIB
        } else {
            3 * GIB + GIB / 2
        }
    };
    let want: Vec<(String, Vec<u32>, u64)> = want
        .into_iter()
        .map(|(u, p)| {
            let b = used_of(&u);
            (u, p, b)
        })
        .collect();
    assert_eq!(usage, want);
    let mut unattributed = v.unattributed.clone();
    unattributed.sort();
    let mut want_un = vec![(GPU.to_string(), no_share.1), (GPU.to_string(), host.1)];
    want_un.sort();
    assert_eq!(unattributed, want_un);

    // Exactly the over-limit share is reported, as a new event.
    assert_eq!(v.over_limit.len(), 1, "{:?}", v.over_limit);
    let o = &v.over_limit[0];
    assert_eq!(
        (
            o.pod_uid.as_str(),
            o.share_keys.clone(),
            o.used_bytes,
            o.limit_bytes,
            o.new
        ),
        (
            over_uid.as_str(),
            vec![over_key.to_string()],
            6 * GIB,
            4 * GIB,
            true
        )
    );

    let others = [small, under_procs[0], under_procs[1], no_share, host];
    let outcomes = execute_terminations(&v, |d| {
        PidfdTerminator::default().terminate(d.pid, &d.pod_uid)
    });
    match action {
        Action::Report => {
            assert!(outcomes.is_empty(), "{outcomes:?}");
            assert_running(&mut fx, &[big]);
            assert_running(&mut fx, &others);
            return;
        }
        Action::Terminate { .. } => {}
    }
    // Killing the largest process brings the share back under its limit: that one only.
    let pids: Vec<(u32, &Result<Terminated, TerminateError>)> =
        outcomes.iter().map(|(d, r)| (d.pid, r)).collect();
    assert_eq!(pids, vec![(big.1, &Ok(Terminated::Signalled))]);
    let st = fx.wait_exit(big.0, EXIT_TIMEOUT);
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    assert_running(&mut fx, &others);

    // The driver may list a dead process for a while; reaped, it is in no pod any
    // more, and the share is back under its limit.
    let v = tick(&mut wd, &l, action);
    assert!(v.over_limit.is_empty(), "{:?}", v.over_limit);
    assert!(v.terminate.is_empty(), "{:?}", v.terminate);
    assert!(v.unattributed.contains(&(GPU.to_string(), big.1)));
    let over_usage = v.usage.iter().find(|u| &u.pod_uid == over_uid).unwrap();
    assert_eq!(
        (over_usage.pids.clone(), over_usage.used_bytes),
        (vec![small.1], GIB)
    );
    assert_running(&mut fx, &others);
}

fn sorted<const N: usize>(mut a: [u32; N]) -> Vec<u32> {
    a.sort_unstable();
    a.to_vec()
}

#[test]
fn v2_systemd_layout_over_limit_process_is_terminated_and_no_other() {
    over_limit_scenario(
        "v2_systemd_layout_over_limit_process_is_terminated_and_no_other",
        1,
        Hierarchy::V2,
        Layout::Systemd,
        KILL_NOW,
    );
}

#[test]
fn v2_cgroupfs_layout_over_limit_process_is_terminated_and_no_other() {
    over_limit_scenario(
        "v2_cgroupfs_layout_over_limit_process_is_terminated_and_no_other",
        2,
        Hierarchy::V2,
        Layout::Cgroupfs,
        KILL_NOW,
    );
}

#[test]
fn v1_systemd_layout_over_limit_process_is_terminated_and_no_other() {
    over_limit_scenario(
        "v1_systemd_layout_over_limit_process_is_terminated_and_no_other",
        3,
        Hierarchy::V1NameSystemd,
        Layout::Systemd,
        KILL_NOW,
    );
}

#[test]
fn v1_cgroupfs_layout_over_limit_process_is_terminated_and_no_other() {
    over_limit_scenario(
        "v1_cgroupfs_layout_over_limit_process_is_terminated_and_no_other",
        4,
        Hierarchy::V1NameSystemd,
        Layout::Cgroupfs,
        KILL_NOW,
    );
}

#[test]
fn v2_report_action_reports_and_leaves_every_process_running() {
    over_limit_scenario(
        "v2_report_action_reports_and_leaves_every_process_running",
        5,
        Hierarchy::V2,
        Layout::Systemd,
        Action::Report,
    );
}

/// Between the verdict and the kill the process leaves the pod (as a pid that was
/// reused by another process would be elsewhere): the terminator re-reads its cgroup
/// through the pidfd and refuses.
#[test]
fn v2_process_that_left_the_pod_is_not_signalled() {
    let test = "v2_process_that_left_the_pod_is_not_signalled";
    if !require_root(test) {
        return;
    }
    let Some(mount) = require_hierarchy(test, Hierarchy::V2) else {
        return;
    };
    let tag = 6;
    let mut fx = Fixture::new();
    let root = fx.root(&mount, test);
    let (uid_a, uid_b) = (pod_uid(tag, 1), pod_uid(tag, 2));
    let cg_a = fx.cgroup(&root, &systemd_burstable(&uid_a, &container_id(tag, 1)));
    let cg_b = fx.cgroup(&root, &cgroupfs_besteffort(&uid_b, &container_id(tag, 2)));
    let cg_host = fx.cgroup(&root, "system.slice/containerd.service");
    let a = fx.spawn_in(&cg_a);
    let b = fx.spawn_in(&cg_b);

    let backend = watchdog_only_gpu();
    let l = limiter(&backend, &[("share-a", &uid_a), ("share-b", &uid_b)], "1Gi");
    report(&backend, &[(a.1, 2 * GIB), (b.1, GIB / 2)]);
    let v = tick(&mut Watchdog::new(), &l, KILL_NOW);
    assert_eq!(
        v.terminate.iter().map(|d| d.pid).collect::<Vec<_>>(),
        vec![a.1]
    );

    // Into a cgroup of no pod: refused, nothing found.
    move_to(a.1, &cg_host);
    let out = execute_terminations(&v, |d| {
        PidfdTerminator::default().terminate(d.pid, &d.pod_uid)
    });
    assert_eq!(out.len(), 1);
    match &out[0].1 {
        Err(TerminateError::NotInPod {
            pid,
            expected,
            found,
        }) => {
            assert_eq!(
                (*pid, expected.as_str(), found.as_deref()),
                (a.1, uid_a.as_str(), None)
            );
        }
        other => panic!("want NotInPod, got {other:?}"),
    }
    // Into another pod: refused, that pod named.
    move_to(a.1, &cg_b);
    match PidfdTerminator::default().terminate(a.1, &uid_a) {
        Err(TerminateError::NotInPod { found, .. }) => assert_eq!(found, Some(uid_b.clone())),
        other => panic!("want NotInPod, got {other:?}"),
    }
    assert_running(&mut fx, &[a, b]);

    // Back in its pod it is signalled: the refusals above were the check, not a failure.
    move_to(a.1, &cg_a);
    assert_eq!(
        PidfdTerminator::default().terminate(a.1, &uid_a),
        Ok(Terminated::Signalled)
    );
    let st = fx.wait_exit(a.0, EXIT_TIMEOUT);
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
    assert_running(&mut fx, &[b]);
    // Gone and reaped: nothing to signal.
    assert_eq!(
        PidfdTerminator::default().terminate(a.1, &uid_a),
        Ok(Terminated::AlreadyGone)
    );
}

/// On a hybrid host a process can sit in one pod in the v2 hierarchy and in another in
/// the v1 one. It is then in no known pod: never attributed, never terminated, even
/// with both shares over their limit.
#[test]
fn hybrid_process_in_two_pods_is_unattributed_and_not_terminated() {
    let test = "hybrid_process_in_two_pods_is_unattributed_and_not_terminated";
    if !require_root(test) {
        return;
    }
    let Some(v2) = require_hierarchy(test, Hierarchy::V2) else {
        return;
    };
    let Some(v1) = require_hierarchy(test, Hierarchy::V1NameSystemd) else {
        return;
    };
    let tag = 7;
    let mut fx = Fixture::new();
    let (uid_a, uid_b) = (pod_uid(tag, 1), pod_uid(tag, 2));
    let root2 = fx.root(&v2, test);
    let root1 = fx.root(&v1, test);
    let cg_a = fx.cgroup(&root2, &systemd_burstable(&uid_a, &container_id(tag, 1)));
    let cg_b = fx.cgroup(&root1, &cgroupfs_besteffort(&uid_b, &container_id(tag, 2)));
    let x = fx.spawn_in(&cg_a);
    move_to(x.1, &cg_b);
    let content = cgroup_file(x.1);
    assert!(content.contains(&format!("pod{uid_b}")), "{content}");
    assert!(content.contains(&uid_a.replace('-', "_")), "{content}");
    assert_pod(x.1, None);

    let backend = watchdog_only_gpu();
    let l = limiter(&backend, &[("share-a", &uid_a), ("share-b", &uid_b)], "1Gi");
    report(&backend, &[(x.1, 10 * GIB)]);
    let v = tick(&mut Watchdog::new(), &l, KILL_NOW);
    assert_eq!(v.unattributed, vec![(GPU.to_string(), x.1)]);
    assert!(v.over_limit.is_empty(), "{:?}", v.over_limit);
    assert!(v.terminate.is_empty(), "{:?}", v.terminate);
    assert!(matches!(
        PidfdTerminator::default().terminate(x.1, &uid_a),
        Err(TerminateError::NotInPod { found: None, .. })
    ));
    assert_running(&mut fx, &[x]);
}
