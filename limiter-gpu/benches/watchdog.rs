//! GPU watchdog cost and detection latency with 1, 16 and 64 shares on the simulated
//! back end. Prints markdown; asserts only that the watchdog reports the right share
//! (speed is judged in the table: a timed assertion would be flaky on a shared machine).
//!
//! ```text
//! sudo nice -n 19 cargo bench -p shareguard-limiter-gpu --bench watchdog
//! ```
//!
//! Per share count N:
//!
//! - **evaluate cost**: one `Watchdog::evaluate` over N shares and N processes, each
//!   pid mapped to its pod through `/proc/PID/cgroup` (the lookup runs inside
//!   `evaluate`). Wall time and the thread's CPU time, median and p99.
//! - **tick cost**: a whole poll as the agent will run it: the back end's process list,
//!   the limiter's share table, `evaluate`.
//! - **detection latency**: a watchdog thread polls every P = 100 ms on a fixed
//!   schedule. The main thread waits a random part of P, then makes the simulated GPU
//!   report one process over its share; latency is from that moment to the over-limit
//!   event out of the watchdog. The design target is "within one poll period with 64
//!   shares".
//!
//! As root, with a cgroup v2 mount, each share's pod is a real cgroup in the kubelet's
//! systemd layout holding a real `sleep` process, and the lookups read the real `/proc`.
//! Otherwise the lookups read fake `<pid>/cgroup` files in a temporary directory, and
//! the table says so.
//!
//! `BENCH_QUICK=1`, or running the binary other than through `cargo bench` (as
//! `cargo test --all-targets` does), runs a few samples only, to check the benchmark
//! works. `BENCH_RUNS` sets the number of latency runs per share count (default 60).

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

#[allow(dead_code)]
#[path = "../tests/support/cgroups.rs"]
mod cgroups;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use shareguard_common::Quantity;
use shareguard_common::limiter::{LimitSpec, Limiter, Target};
use shareguard_limiter_gpu::GpuLimiter;
use shareguard_limiter_gpu::backend::ComputeProcess;
use shareguard_limiter_gpu::cgroup::{NamespaceRoots, pod_uid_of_pid};
use shareguard_limiter_gpu::cgroupns::agent_namespace;
use shareguard_limiter_gpu::limiter::{GpuDeviceConfig, GpuSelector, MEMORY};
use shareguard_limiter_gpu::simulated::{SimulatedBackend, SimulatedGpu};
use shareguard_limiter_gpu::watchdog::{Action, Watchdog};

use cgroups::{Fixture, Hierarchy, container_id, pod_uid, systemd_burstable};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const GPU: &str = "GPU-simulated-bench-0";
const PERIOD: Duration = Duration::from_millis(100);
const SHARE_COUNTS: [usize; 3] = [1, 16, 64];
const UNDER: u64 = 512 * MIB;
const OVER: u64 = 2 * GIB;

struct Settings {
    quick: bool,
    runs: usize,
    eval_samples: usize,
}

impl Settings {
    fn from_env() -> Self {
        let under_cargo_bench = std::env::args().any(|a| a == "--bench");
        let quick = std::env::var("BENCH_QUICK").is_ok_and(|v| v == "1") || !under_cargo_bench;
        let runs = std::env::var("BENCH_RUNS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60);
        Self {
            quick,
            runs: if quick { 3 } else { runs },
            eval_samples: if quick { 50 } else { 5_000 },
        }
    }
}

/// Where the pid -> pod lookups read from, and what keeps it alive.
struct Pods {
    proc_root: PathBuf,
    pids: Vec<u32>,
    uids: Vec<String>,
    label: &'static str,
    _fixture: Option<Fixture>,
    _fake: Option<tempfile::TempDir>,
}

impl Pods {
    /// The namespace roots the lookups resolve against: the real one for the real
    /// `/proc`, the initial one for the fake files (written with absolute paths).
    fn roots(&self) -> NamespaceRoots {
        if self._fixture.is_some() {
            agent_namespace().roots()
        } else {
            NamespaceRoots::Initial
        }
    }
}

fn pods(n: usize) -> Pods {
    let tag = 0xbe00 + u16::try_from(n).unwrap();
    let uids: Vec<String> = (0..n)
        .map(|i| pod_uid(tag, u32::try_from(i).unwrap()))
        .collect();
    if cgroups::test_root::is_root()
        && let Some(mount) = Hierarchy::V2.mount_point()
    {
        let mut fx = Fixture::new();
        let root = fx.root(&mount, &format!("bench-{n}"));
        let mut pids = Vec::new();
        for (i, uid) in uids.iter().enumerate() {
            let cid = container_id(tag, u32::try_from(i).unwrap());
            let cg = fx.cgroup(&root, &systemd_burstable(uid, &cid));
            pids.push(fx.spawn_in(&cg).1);
        }
        return Pods {
            proc_root: PathBuf::from("/proc"),
            pids,
            uids,
            label: "real /proc, real v2 cgroups",
            _fixture: Some(fx),
            _fake: None,
        };
    }
    let dir = tempfile::tempdir().unwrap();
    let mut pids = Vec::new();
    for (i, uid) in uids.iter().enumerate() {
        let pid = 4_000_000 + u32::try_from(i).unwrap();
        let d = dir.path().join(pid.to_string());
        std::fs::create_dir(&d).unwrap();
        let cid = container_id(tag, u32::try_from(i).unwrap());
        std::fs::write(
            d.join("cgroup"),
            format!("1:name=systemd:/\n0::/{}\n", systemd_burstable(uid, &cid)),
        )
        .unwrap();
        pids.push(pid);
    }
    Pods {
        proc_root: dir.path().to_path_buf(),
        pids,
        uids,
        label: "fake /proc files (not root)",
        _fixture: None,
        _fake: Some(dir),
    }
}

fn share_key(i: usize) -> String {
    format!("share-{i:03}")
}

fn setup(p: &Pods) -> (Arc<SimulatedBackend>, GpuLimiter) {
    let mut gpu = SimulatedGpu::new(GPU, 80 * GIB);
    gpu.cgroup_limits = false;
    gpu.mps = false;
    let backend = Arc::new(SimulatedBackend::new(vec![gpu]));
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
    for (i, uid) in p.uids.iter().enumerate() {
        l.apply(&LimitSpec {
            share_key: share_key(i),
            device: "gpu0".into(),
            limits: BTreeMap::from([(MEMORY.to_string(), Quantity::parse("1Gi").unwrap())]),
            target: Target {
                pod_uids: vec![uid.clone()],
                ..Target::default()
            },
        })
        .unwrap();
    }
    (backend, l)
}

/// Every process at `UNDER`, except `over` (an index) at `OVER`.
fn report(backend: &SimulatedBackend, pids: &[u32], over: Option<usize>) {
    backend.set_processes(
        GPU,
        pids.iter()
            .enumerate()
            .map(|(i, &pid)| ComputeProcess {
                pid,
                used_bytes: Some(if Some(i) == over { OVER } else { UNDER }),
                via_mps: false,
            })
            .collect(),
    );
}

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into the valid, exclusively borrowed
    // `ts`; CLOCK_THREAD_CPUTIME_ID is supported on every Linux this runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap(),
        u32::try_from(ts.tv_nsec).unwrap(),
    )
}

/// Nearest-rank percentile of sorted samples.
fn pct(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

struct Cost {
    eval_wall: (Duration, Duration),
    eval_cpu: (Duration, Duration),
    tick_wall: (Duration, Duration),
}

fn cost(p: &Pods, backend: &SimulatedBackend, l: &GpuLimiter, samples: usize) -> Cost {
    let n = p.pids.len();
    report(backend, &p.pids, None);
    let procs = l.process_usage().unwrap();
    let shares = l.watched_shares(Action::Report);
    let mut wd = Watchdog::new();
    let roots = p.roots();
    let pod_of = |pid| pod_uid_of_pid(&p.proc_root, &roots, pid);
    let check = |v: &shareguard_limiter_gpu::watchdog::Verdict| {
        // Every pid attributed, nothing over: the lookups really found the pods.
        assert_eq!(v.usage.len(), n);
        assert!(v.usage.iter().all(|u| u.pids.len() == 1));
        assert!(v.unattributed.is_empty(), "{:?}", v.unattributed);
        assert!(v.over_limit.is_empty());
    };
    for _ in 0..samples / 10 {
        check(&wd.evaluate(Instant::now(), &procs, pod_of, &shares));
    }
    let (mut wall, mut cpu, mut tick) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let c0 = thread_cpu();
        let t0 = Instant::now();
        let v = wd.evaluate(t0, &procs, pod_of, &shares);
        wall.push(t0.elapsed());
        cpu.push(thread_cpu().saturating_sub(c0));
        check(&v);
    }
    for _ in 0..samples {
        let t0 = Instant::now();
        let procs = l.process_usage().unwrap();
        let shares = l.watched_shares(Action::Report);
        let v = wd.evaluate(t0, &procs, pod_of, &shares);
        tick.push(t0.elapsed());
        check(&v);
    }
    for s in [&mut wall, &mut cpu, &mut tick] {
        s.sort_unstable();
    }
    Cost {
        eval_wall: (pct(&wall, 50.0), pct(&wall, 99.0)),
        eval_cpu: (pct(&cpu, 50.0), pct(&cpu, 99.0)),
        tick_wall: (pct(&tick, 50.0), pct(&tick, 99.0)),
    }
}

#[derive(Default)]
struct Ticks {
    done: Mutex<u64>,
    cv: Condvar,
}

impl Ticks {
    fn count(&self) -> u64 {
        *self.done.lock().unwrap()
    }

    /// Waits until at least `n` ticks have completed, failing after `timeout`.
    fn wait_for(&self, n: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut done = self.done.lock().unwrap();
        while *done < n {
            let left = deadline
                .checked_duration_since(Instant::now())
                .unwrap_or_else(|| panic!("watchdog stalled: {} of {n} ticks", *done));
            done = self.cv.wait_timeout(done, left).unwrap().0;
        }
    }
}

/// Small xorshift for the injection phase; no crate needed for uniform offsets.
struct Rng(u64);

impl Rng {
    fn below(&mut self, d: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let nanos = u64::try_from(d.as_nanos()).unwrap();
        Duration::from_nanos(self.0 % nanos)
    }
}

struct Latency {
    /// Injection -> event, sorted.
    sorted: Vec<Duration>,
    /// Of the ticks that raised the events: the latest wake-up after its scheduled time,
    /// and the longest time from wake-up to the event (the tick's own work).
    max_late: Duration,
    max_work: Duration,
}

/// An over-limit event out of the watchdog thread.
struct Event {
    woke: Instant,
    late: Duration,
    at: Instant,
    share_keys: Vec<String>,
}

fn latency(p: &Pods, backend: &Arc<SimulatedBackend>, l: &Arc<GpuLimiter>, runs: usize) -> Latency {
    let n = p.pids.len();
    report(backend, &p.pids, None);
    let ticks = Arc::new(Ticks::default());
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<Event>();

    let watchdog = {
        let (l, ticks, stop) = (l.clone(), ticks.clone(), stop.clone());
        let proc_root = p.proc_root.clone();
        let roots = p.roots();
        std::thread::spawn(move || {
            let mut wd = Watchdog::new();
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                // The poll period: a fixed schedule; a late tick skips, never bunches.
                next += PERIOD;
                let now = Instant::now();
                match next.checked_duration_since(now) {
                    Some(d) => std::thread::sleep(d),
                    None => next = now,
                }
                let woke = Instant::now();
                let late = woke.saturating_duration_since(next);
                let procs = l.process_usage().unwrap();
                let shares = l.watched_shares(Action::Report);
                let v = wd.evaluate(
                    Instant::now(),
                    &procs,
                    |pid| pod_uid_of_pid(&proc_root, &roots, pid),
                    &shares,
                );
                let at = Instant::now();
                for o in v.over_limit.iter().filter(|o| o.new) {
                    let e = Event {
                        woke,
                        late,
                        at,
                        share_keys: o.share_keys.clone(),
                    };
                    if tx.send(e).is_err() {
                        return;
                    }
                }
                *ticks.done.lock().unwrap() += 1;
                ticks.cv.notify_all();
            }
        })
    };

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut out = Vec::with_capacity(runs);
    let (mut max_late, mut max_work) = (Duration::ZERO, Duration::ZERO);
    for r in 0..runs {
        let victim = r % n;
        // All under; two completed ticks later the last episode is surely closed.
        report(backend, &p.pids, None);
        let c = ticks.count();
        ticks.wait_for(c + 2, 20 * PERIOD);
        assert!(rx.try_recv().is_err(), "event while every share is under");
        // Random phase against the poll schedule.
        std::thread::sleep(rng.below(PERIOD));
        let t0 = Instant::now();
        report(backend, &p.pids, Some(victim));
        let e = rx
            .recv_timeout(20 * PERIOD)
            .unwrap_or_else(|e| panic!("no over-limit event within {:?}: {e}", 20 * PERIOD));
        assert_eq!(
            e.share_keys,
            vec![share_key(victim)],
            "wrong share reported"
        );
        out.push(e.at.saturating_duration_since(t0));
        max_late = max_late.max(e.late);
        max_work = max_work.max(e.at.saturating_duration_since(e.woke));
    }
    stop.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    out.sort_unstable();
    Latency {
        sorted: out,
        max_late,
        max_work,
    }
}

fn us(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!("{cores} vCPU, {cpu}, Linux {}", kernel.trim())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() {
    let s = Settings::from_env();
    println!("## GPU watchdog (simulated back end)\n");
    println!(
        "Machine: {}; load average at start {}.{}\n",
        machine(),
        loadavg(),
        if s.quick {
            " QUICK RUN: figures not meaningful."
        } else {
            ""
        }
    );
    println!(
        "Poll period P = {} ms; {} latency runs and {} evaluate samples per row. \
         Latency: simulated GPU reporting one process over its share -> over-limit event.\n",
        PERIOD.as_millis(),
        s.runs,
        s.eval_samples
    );
    let mut latency_rows = Vec::new();
    println!(
        "| shares | pid -> pod lookups | evaluate wall median / p99 (us) | evaluate CPU median / p99 (us) | whole tick median / p99 (us) |"
    );
    println!("|---:|---|---:|---:|---:|");
    for n in SHARE_COUNTS {
        let p = pods(n);
        let (backend, l) = setup(&p);
        let l = Arc::new(l);
        let c = cost(&p, &backend, &l, s.eval_samples);
        println!(
            "| {n} | {} | {} / {} | {} / {} | {} / {} |",
            p.label,
            us(c.eval_wall.0),
            us(c.eval_wall.1),
            us(c.eval_cpu.0),
            us(c.eval_cpu.1),
            us(c.tick_wall.0),
            us(c.tick_wall.1),
        );
        latency_rows.push((n, latency(&p, &backend, &l, s.runs)));
    }
    println!(
        "\n| shares | P (ms) | latency median (ms) | p99 (ms) | max (ms) | runs within P | detecting tick: wake-up late, max (ms) | detecting tick: wake-up to event, max (us) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (n, lat) in latency_rows {
        let within = lat.sorted.iter().filter(|d| **d <= PERIOD).count();
        println!(
            "| {n} | {} | {} | {} | {} | {within}/{} | {} | {} |",
            PERIOD.as_millis(),
            ms(pct(&lat.sorted, 50.0)),
            ms(pct(&lat.sorted, 99.0)),
            ms(*lat.sorted.last().unwrap()),
            lat.sorted.len(),
            ms(lat.max_late),
            us(lat.max_work),
        );
    }
    println!("\nLoad average at end {}.", loadavg());
}
