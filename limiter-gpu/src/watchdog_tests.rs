use std::sync::Mutex;

use super::*;

const GIB: u64 = 1 << 30;
const GPU0: &str = "GPU-0";
const GPU1: &str = "GPU-1";

fn share(key: &str, pod: &str, gpu: &str, limit: u64, action: Action) -> WatchedShare {
    WatchedShare {
        share_key: key.into(),
        pod_uid: pod.into(),
        gpu_uuid: gpu.into(),
        limit_bytes: limit,
        action,
    }
}

fn proc_(gpu: &str, pid: u32, used: Option<u64>) -> ProcessUsage {
    ProcessUsage {
        gpu_uuid: gpu.into(),
        pid,
        used_bytes: used,
        via_mps: false,
    }
}

/// pid -> pod: 1xx are pod-a, 2xx pod-b, anything else no pod.
fn pods(pid: u32) -> Option<String> {
    match pid / 100 {
        1 => Some("pod-a".into()),
        2 => Some("pod-b".into()),
        _ => None,
    }
}

fn kill_after(grace_s: u64) -> Action {
    Action::Terminate {
        grace: Duration::from_secs(grace_s),
    }
}

#[test]
fn usage_is_attributed_per_pod_and_gpu() {
    let shares = [
        share("s-a", "pod-a", GPU0, 4 * GIB, Action::Report),
        share("s-b", "pod-b", GPU0, 4 * GIB, Action::Report),
    ];
    let procs = [
        proc_(GPU0, 101, Some(GIB)),
        proc_(GPU0, 102, Some(2 * GIB)),
        proc_(GPU0, 201, Some(3 * GIB)),
        proc_(GPU0, 999, Some(GIB)), // host process
        proc_(GPU1, 103, Some(GIB)), // pod-a, but it has no share on GPU1
        proc_(GPU0, 104, None),      // usage unknown: counted as zero
    ];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    assert_eq!(v.usage.len(), 2);
    let a = v.usage.iter().find(|u| u.pod_uid == "pod-a").unwrap();
    assert_eq!(a.used_bytes, 3 * GIB);
    assert_eq!(a.pids, vec![101, 102, 104]);
    assert_eq!(a.share_keys, vec!["s-a".to_string()]);
    let b = v.usage.iter().find(|u| u.pod_uid == "pod-b").unwrap();
    assert_eq!(b.used_bytes, 3 * GIB);
    assert!(v.over_limit.is_empty());
    assert_eq!(
        v.unattributed,
        vec![(GPU0.to_string(), 999), (GPU1.to_string(), 103)]
    );
}

#[test]
fn over_limit_event_is_new_once_per_episode() {
    let shares = [share("s-a", "pod-a", GPU0, 2 * GIB, Action::Report)];
    let over = [proc_(GPU0, 101, Some(3 * GIB))];
    let under = [proc_(GPU0, 101, Some(GIB))];
    let mut w = Watchdog::new();
    let t0 = Instant::now();

    let v = w.evaluate(t0, &over, pods, &shares);
    assert_eq!(v.over_limit.len(), 1);
    assert!(v.over_limit[0].new);
    assert_eq!(v.over_limit[0].since, t0);
    assert_eq!(v.over_limit[0].used_bytes, 3 * GIB);

    let t1 = t0 + Duration::from_secs(5);
    let v = w.evaluate(t1, &over, pods, &shares);
    assert!(!v.over_limit[0].new);
    assert_eq!(v.over_limit[0].since, t0, "episode start is kept");

    let v = w.evaluate(t1 + Duration::from_secs(1), &under, pods, &shares);
    assert!(v.over_limit.is_empty());

    let t3 = t1 + Duration::from_secs(2);
    let v = w.evaluate(t3, &over, pods, &shares);
    assert!(v.over_limit[0].new, "a new episode after going under");
    assert_eq!(v.over_limit[0].since, t3);
}

#[test]
fn exactly_at_the_limit_is_not_over() {
    let shares = [share("s-a", "pod-a", GPU0, 2 * GIB, kill_after(0))];
    let v = Watchdog::new().evaluate(
        Instant::now(),
        &[proc_(GPU0, 101, Some(2 * GIB))],
        pods,
        &shares,
    );
    assert!(v.over_limit.is_empty());
    assert!(v.terminate.is_empty());
}

#[test]
fn report_never_terminates() {
    let shares = [share("s-a", "pod-a", GPU0, GIB, Action::Report)];
    let procs = [proc_(GPU0, 101, Some(10 * GIB))];
    let mut w = Watchdog::new();
    let t0 = Instant::now();
    for i in 0..5 {
        let v = w.evaluate(t0 + Duration::from_secs(3600 * i), &procs, pods, &shares);
        assert!(v.terminate.is_empty());
        assert_eq!(v.over_limit.len(), 1);
    }
}

#[test]
fn terminate_waits_for_the_grace_period_then_kills_largest_first() {
    let shares = [share("s-a", "pod-a", GPU0, 4 * GIB, kill_after(10))];
    let procs = [
        proc_(GPU0, 101, Some(GIB)),
        proc_(GPU0, 102, Some(3 * GIB)),
        proc_(GPU0, 103, Some(2 * GIB)),
        proc_(GPU0, 104, None),
    ];
    let mut w = Watchdog::new();
    let t0 = Instant::now();
    assert!(w.evaluate(t0, &procs, pods, &shares).terminate.is_empty());
    let v = w.evaluate(t0 + Duration::from_secs(9), &procs, pods, &shares);
    assert!(v.terminate.is_empty(), "inside the grace period");

    let v = w.evaluate(t0 + Duration::from_secs(10), &procs, pods, &shares);
    // 6 GiB used, 4 allowed: killing the 3 GiB process is enough.
    let pids: Vec<u32> = v.terminate.iter().map(|d| d.pid).collect();
    assert_eq!(pids, vec![102]);
    assert_eq!(v.terminate[0].pod_uid, "pod-a");

    // While 102 is still exiting it is not chosen again, and nothing more is needed.
    let v = w.evaluate(t0 + Duration::from_secs(11), &procs, pods, &shares);
    assert!(v.terminate.is_empty(), "{:?}", v.terminate);
}

#[test]
fn terminate_takes_as_many_as_needed_and_skips_unknown_usage() {
    let shares = [share("s-a", "pod-a", GPU0, GIB, kill_after(0))];
    let procs = [
        proc_(GPU0, 101, Some(GIB)),
        proc_(GPU0, 102, Some(GIB)),
        proc_(GPU0, 103, Some(GIB)),
        proc_(GPU0, 104, None),
    ];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    let pids: Vec<u32> = v.terminate.iter().map(|d| d.pid).collect();
    assert_eq!(
        pids,
        vec![101, 102],
        "ties go by pid; 104's usage is unknown"
    );
}

#[test]
fn never_terminates_outside_the_over_limit_share() {
    // pod-b is within its limit and has the largest process on the GPU; an unattributed
    // host process is even larger. Only pod-a's processes may be chosen.
    let shares = [
        share("s-a", "pod-a", GPU0, GIB, kill_after(0)),
        share("s-b", "pod-b", GPU0, 100 * GIB, kill_after(0)),
    ];
    let procs = [
        proc_(GPU0, 101, Some(2 * GIB)),
        proc_(GPU0, 201, Some(50 * GIB)),
        proc_(GPU0, 999, Some(70 * GIB)),
        proc_(GPU1, 102, Some(70 * GIB)),
    ];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    assert_eq!(v.terminate.len(), 1);
    assert_eq!(v.terminate[0].pid, 101);
    for d in &v.terminate {
        assert_eq!(pods(d.pid).as_deref(), Some(d.pod_uid.as_str()));
        assert_eq!(d.gpu_uuid, GPU0);
    }
}

#[test]
fn shares_of_one_pod_on_one_gpu_form_a_group() {
    let shares = [
        share("s-2", "pod-a", GPU0, 2 * GIB, kill_after(0)),
        share("s-1", "pod-a", GPU0, 2 * GIB, Action::Report),
    ];
    let procs = [proc_(GPU0, 101, Some(3 * GIB))];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    assert_eq!(v.usage.len(), 1);
    assert_eq!(v.usage[0].limit_bytes, 4 * GIB);
    assert_eq!(
        v.usage[0].share_keys,
        vec!["s-1".to_string(), "s-2".to_string()]
    );
    assert!(v.over_limit.is_empty());

    let procs = [proc_(GPU0, 101, Some(5 * GIB))];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    assert_eq!(v.over_limit.len(), 1);
    assert!(
        v.terminate.is_empty(),
        "one share of the group asked for report only"
    );
}

#[test]
fn pid_lookups_are_made_once_per_evaluation() {
    let shares = [share("s-a", "pod-a", GPU0, GIB, Action::Report)];
    // The same pid on two GPUs (a process using both).
    let procs = [proc_(GPU0, 101, Some(1)), proc_(GPU1, 101, Some(1))];
    let mut calls = 0;
    Watchdog::new().evaluate(
        Instant::now(),
        &procs,
        |pid| {
            calls += 1;
            pods(pid)
        },
        &shares,
    );
    assert_eq!(calls, 1);
}

#[test]
fn sixty_four_shares_over_limit_found_in_one_evaluation() {
    let mut shares = Vec::new();
    let mut procs = Vec::new();
    for i in 0..64u32 {
        shares.push(share(
            &format!("s{i}"),
            &format!("pod{i}"),
            GPU0,
            GIB,
            Action::Report,
        ));
        // Every odd share is over its limit.
        let used = if i % 2 == 1 { GIB + 1 } else { GIB };
        procs.push(proc_(GPU0, 10_000 + i, Some(used)));
    }
    let v = Watchdog::new().evaluate(
        Instant::now(),
        &procs,
        |pid| Some(format!("pod{}", pid - 10_000)),
        &shares,
    );
    assert_eq!(v.usage.len(), 64);
    assert_eq!(v.over_limit.len(), 32);
    assert!(v.over_limit.iter().all(|o| o.new));
}

#[derive(Default)]
struct FakeTerminator {
    calls: Mutex<Vec<(u32, String)>>,
}

impl ProcessTerminator for FakeTerminator {
    fn terminate(&self, pid: u32, pod_uid: &str) -> Result<Terminated, TerminateError> {
        self.calls.lock().unwrap().push((pid, pod_uid.to_string()));
        if pid == 102 {
            return Err(TerminateError::NotInPod {
                pid,
                expected: pod_uid.into(),
                found: None,
            });
        }
        Ok(Terminated::Signalled)
    }
}

#[test]
fn terminations_go_through_the_terminator_with_the_pod() {
    let shares = [share("s-a", "pod-a", GPU0, GIB, kill_after(0))];
    let procs = [
        proc_(GPU0, 101, Some(2 * GIB)),
        proc_(GPU0, 102, Some(2 * GIB)),
    ];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    let fake = FakeTerminator::default();
    let results = execute_terminations(&v, |d| fake.terminate(d.pid, &d.pod_uid));
    assert_eq!(
        *fake.calls.lock().unwrap(),
        vec![(101, "pod-a".to_string()), (102, "pod-a".to_string())]
    );
    assert_eq!(results[0].1, Ok(Terminated::Signalled));
    assert!(matches!(results[1].1, Err(TerminateError::NotInPod { .. })));
}

#[test]
fn unknown_usage_is_listed_not_counted_as_zero() {
    let shares = [share("s-a", "pod-a", GPU0, 4 * GIB, kill_after(0))];
    let procs = [
        proc_(GPU0, 101, Some(5 * GIB)),
        proc_(GPU0, 102, None),
        proc_(GPU0, 103, None),
    ];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    let u = &v.usage[0];
    assert_eq!(u.used_bytes, 5 * GIB, "the known part");
    assert_eq!(u.unknown_pids, vec![102, 103]);
    assert_eq!(u.pids, vec![101, 102, 103]);
    // Over on what is known; only the process of known usage is chosen.
    assert_eq!(v.terminate.len(), 1);
    assert_eq!(v.terminate[0].pid, 101);
}

#[test]
fn an_mps_client_is_marked_for_its_server() {
    let shares = [share("s-a", "pod-a", GPU0, GIB, kill_after(0))];
    let mut client = proc_(GPU0, 101, Some(3 * GIB));
    client.via_mps = true;
    let procs = [client, proc_(GPU0, 102, Some(2 * GIB))];
    let v = Watchdog::new().evaluate(Instant::now(), &procs, pods, &shares);
    let by_pid: Vec<(u32, bool)> = v.terminate.iter().map(|d| (d.pid, d.via_mps)).collect();
    assert_eq!(by_pid, vec![(101, true), (102, false)]);
}
