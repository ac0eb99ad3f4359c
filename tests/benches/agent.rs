//! Benchmark of the real agent binary: Prepare and Unprepare latency and throughput over
//! gRPC on the unix socket with 1, 100 and 10,000 live shares, a bare fsync on the same
//! disk measured in the same run as the yardstick, and restart-to-ready with the last
//! (largest) share count. It prints markdown for docs/benchmarks.md and asserts nothing about speed:
//! the targets are judged in the printed table, because a noisy shared machine would make
//! a timed assertion flaky.
//!
//! ```text
//! cargo build --release -p shareguard && cargo bench -p shareguard-tests --bench agent
//! ```
//!
//! Sizes come from the environment (see [`Settings::from_env`]); `BENCH_QUICK=1` runs a
//! small version in seconds to check that the benchmark itself works.
//!
//! An agent that stops answering under concurrent load is reported as hung in the
//! throughput table rather than waited on forever, and the rest of the run goes on.

// A failed step is a failed benchmark, and the panic message says which step and why.
#![allow(clippy::unwrap_used)]

use std::{
    env,
    fmt::Write as _,
    fs::{self, File},
    future::Future,
    io::Write as _,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};

use shareguard_tests::{
    Agent, Options, agent_bin, alloc, claim, claim_ref, env_or, generic_device, http_get,
    proto as pb, share_id,
};
use tokio::{runtime::Runtime, task::JoinSet};

const DEVICE: &str = "gen-0";
const NAMESPACE: &str = "bench";
/// The fresh agent's epoch: only NewEpoch moves it.
const EPOCH: u64 = 0;
/// Big enough for 100,000 preloaded shares plus every share the measurements add on top.
const CAPACITY: &str = "1000000Gi";
/// Every share takes one step: the smallest amount the policy allows.
const AMOUNT: &str = "1Gi";
/// Claims per preload request; under the agent's default limit of 128 per request.
const PRELOAD_BATCH: usize = 64;

/// Prepare p99 must stay under this (docs/architecture.md, Targets).
const TARGET_PREPARE_P99: Duration = Duration::from_millis(1);
/// ... and at most this many times a bare fsync's p99 on the same disk.
const TARGET_FSYNC_RATIO: f64 = 3.0;
const TARGET_RESTART: Duration = Duration::from_secs(1);
/// Agent memory per live share, judged where the shares dwarf the agent's own
/// (docs/architecture.md, Targets: 100,000 shares under 256 MiB).
const TARGET_RSS_PER_SHARE_KIB: f64 = 2.0;
const RSS_JUDGED_FROM: usize = 100_000;
/// ... and the most the agent is ever resident with them, a start included, under this
/// (docs/architecture.md: 100,000 shares under 256 MiB RSS): the DaemonSet's memory limit
/// has to fit the peak, not what is left after it.
const TARGET_PEAK_RSS_MIB: f64 = 256.0;

struct Settings {
    quick: bool,
    /// Live shares present while each point is measured.
    sizes: Vec<usize>,
    samples: usize,
    fsync_samples: usize,
    warmup: usize,
    /// Concurrent clients for each throughput run, in order, on the same agent.
    clients: Vec<usize>,
    throughput_ops: usize,
    restarts: usize,
    preload_clients: usize,
    /// An agent that makes no progress for this long is taken as hung.
    hang: Duration,
}

impl Settings {
    /// `BENCH_QUICK=1` (small sizes), `BENCH_SIZES` (live shares per point, comma list;
    /// the last one is also restarted), `BENCH_SAMPLES`, `BENCH_FSYNC_SAMPLES`,
    /// `BENCH_WARMUP`, `BENCH_CLIENTS` (comma list), `BENCH_THROUGHPUT_OPS`,
    /// `BENCH_RESTARTS`, `BENCH_PRELOAD_CLIENTS`, `BENCH_HANG_S`.
    fn from_env() -> Settings {
        let quick = env::var("BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let (sizes, samples, fsync_samples, warmup, ops, restarts) = if quick {
            (vec![1, 100, 1000], 100, 100, 10, 160, 2)
        } else {
            (vec![1, 100, 10_000], 1000, 500, 50, 1600, 5)
        };
        let s = Settings {
            quick,
            sizes: env_list("BENCH_SIZES", sizes),
            samples: env_or("BENCH_SAMPLES", samples),
            fsync_samples: env_or("BENCH_FSYNC_SAMPLES", fsync_samples),
            warmup: env_or("BENCH_WARMUP", warmup),
            clients: env_list("BENCH_CLIENTS", vec![1, 4, 16]),
            throughput_ops: env_or("BENCH_THROUGHPUT_OPS", ops),
            restarts: env_or("BENCH_RESTARTS", restarts),
            // One client: concurrent Prepares can hang the agent (docs/benchmarks.md), and
            // the preload is set-up, not a measurement.
            preload_clients: env_or("BENCH_PRELOAD_CLIENTS", 1),
            hang: Duration::from_secs(env_or("BENCH_HANG_S", 20)),
        };
        assert!(!s.sizes.is_empty(), "BENCH_SIZES is empty");
        assert!(
            s.samples > 0 && s.fsync_samples > 0,
            "BENCH_SAMPLES and BENCH_FSYNC_SAMPLES must be at least 1"
        );
        assert!(
            s.clients.iter().all(|&c| c > 0) && s.preload_clients > 0,
            "BENCH_CLIENTS and BENCH_PRELOAD_CLIENTS must be at least 1"
        );
        s
    }
}

fn env_list(name: &str, default: Vec<usize>) -> Vec<usize> {
    match env::var(name) {
        Ok(v) => v
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}={v:?}: {s:?} is not a whole number"))
            })
            .collect(),
        Err(_) => default,
    }
}

#[derive(Clone, Copy, Debug)]
struct Stats {
    n: usize,
    p50: Duration,
    p99: Duration,
    mean: Duration,
    max: Duration,
}

impl Stats {
    fn of(mut v: Vec<Duration>) -> Stats {
        assert!(!v.is_empty(), "no samples");
        v.sort_unstable();
        let n = v.len();
        // Nearest rank: the smallest sample with at least p% of the samples at or below it.
        let rank = |p: usize| v[(n * p).div_ceil(100).clamp(1, n) - 1];
        let total: Duration = v.iter().sum();
        Stats {
            n,
            p50: rank(50),
            p99: rank(99),
            mean: total / u32::try_from(n).unwrap_or(u32::MAX),
            max: v[n - 1],
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64().max(1e-9)
}

struct FsyncBaseline {
    /// Append 4 KiB and fsync: the file grows, so the inode is written too, as for a log.
    append_fsync: Stats,
    /// Overwrite the same 4 KiB and fdatasync: the cheapest durable write there is.
    overwrite_fdatasync: Stats,
}

/// A bare fsync in `dir`, the directory that holds the agent's store, so both go to the
/// same file system and disk.
fn fsync_baseline(dir: &Path, n: usize) -> FsyncBaseline {
    let path = dir.join("fsync-baseline.dat");
    let block = [0xa5u8; 4096];
    let mut f = File::create(&path).unwrap();
    let mut append = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f.write_all(&block).unwrap();
        f.sync_all().unwrap();
        append.push(t.elapsed());
    }
    let mut overwrite = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        f.write_all_at(&block, 0).unwrap();
        f.sync_data().unwrap();
        overwrite.push(t.elapsed());
    }
    drop(f);
    let _ = fs::remove_file(&path);
    FsyncBaseline {
        append_fsync: Stats::of(append),
        overwrite_fdatasync: Stats::of(overwrite),
    }
}

fn prepare_request(uid: &str) -> pb::PrepareRequest {
    pb::PrepareRequest {
        epoch: EPOCH,
        claims: vec![claim(
            uid,
            NAMESPACE,
            "a1",
            vec![alloc(DEVICE, &share_id(), AMOUNT)],
        )],
    }
}

fn unprepare_request(uid: &str) -> pb::UnprepareRequest {
    pb::UnprepareRequest {
        epoch: EPOCH,
        claims: vec![claim_ref(uid)],
        only_pre_bind: false,
    }
}

/// A Prepare that did not admit the claim would time a refusal, not a Prepare.
fn expect_prepared(r: &pb::PrepareResponse, uid: &str) {
    let c = r
        .claims
        .get(uid)
        .unwrap_or_else(|| panic!("Prepare answered without claim {uid}: {r:?}"));
    if let Some(e) = &c.error {
        panic!("Prepare of claim {uid} refused: {e:?}");
    }
    let phase = c.shares.first().map(|s| s.phase);
    assert_eq!(
        phase,
        Some(pb::Phase::Accounted as i32),
        "claim {uid}: not ACCOUNTED: {c:?}"
    );
}

fn expect_released(r: &pb::UnprepareResponse, uid: &str) {
    let e = r
        .claims
        .get(uid)
        .unwrap_or_else(|| panic!("Unprepare answered without claim {uid}: {r:?}"));
    assert!(e.code.is_empty(), "Unprepare of claim {uid} failed: {e:?}");
}

/// Runs a set-up or sequential step, failing the benchmark instead of waiting forever
/// when the agent stops answering.
async fn guarded<T>(hang: Duration, what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(hang, f).await.unwrap_or_else(|_| {
        panic!("{what}: the agent made no progress for {hang:?} (hung; see docs/benchmarks.md)")
    })
}

/// Prepares `n` claims of one share each, in batches, so that 10,000 shares load in
/// seconds rather than one round trip each. `hang` bounds each batch, not the whole:
/// 100,000 shares take longer than any one call may.
async fn preload(a: &Agent, n: usize, clients: usize, hang: Duration) {
    let mut tasks = JoinSet::new();
    let per = n.div_ceil(clients).max(1);
    for start in (0..n).step_by(per) {
        let mut c = a.client().await;
        let end = (start + per).min(n);
        tasks.spawn(async move {
            let ids: Vec<usize> = (start..end).collect();
            for batch in ids.chunks(PRELOAD_BATCH) {
                let uids: Vec<String> = batch.iter().map(|i| format!("live-{i}")).collect();
                let req = pb::PrepareRequest {
                    epoch: EPOCH,
                    claims: uids
                        .iter()
                        .map(|u| {
                            claim(u, NAMESPACE, "a1", vec![alloc(DEVICE, &share_id(), AMOUNT)])
                        })
                        .collect(),
                };
                let r = guarded(hang, "preload", c.prepare(req))
                    .await
                    .unwrap()
                    .into_inner();
                for u in &uids {
                    expect_prepared(&r, u);
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

/// One Prepare at a time, each followed by the Unprepare of the same claim, so the live
/// share count stays where the point put it. Returns (prepare, unprepare) latencies.
async fn sequential(a: &Agent, tag: &str, n: usize) -> (Vec<Duration>, Vec<Duration>) {
    let mut c = a.client().await;
    // Built before timing: reading a UUID from /proc is not part of a Prepare.
    let reqs: Vec<(String, pb::PrepareRequest)> = (0..n)
        .map(|i| {
            let uid = format!("{tag}-{i}");
            let req = prepare_request(&uid);
            (uid, req)
        })
        .collect();
    let mut prep = Vec::with_capacity(n);
    let mut unprep = Vec::with_capacity(n);
    for (uid, req) in reqs {
        let ureq = unprepare_request(&uid);
        let t = Instant::now();
        let r = c.prepare(req).await.unwrap().into_inner();
        prep.push(t.elapsed());
        expect_prepared(&r, &uid);
        let t = Instant::now();
        let r = c.unprepare(ureq).await.unwrap().into_inner();
        unprep.push(t.elapsed());
        expect_released(&r, &uid);
    }
    (prep, unprep)
}

/// Round trips of a read-only call that touches neither the store nor the ledger: what
/// the client, gRPC and the socket cost before a Prepare does any work of its own.
async fn round_trip_floor(a: &Agent, n: usize) -> Vec<Duration> {
    let mut c = a.client().await;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let req = pb::GetShareRequest {
            share_id: share_id(),
        };
        let t = Instant::now();
        // NotFound is as much a round trip as a hit, and needs no share to exist.
        let _ = c.get_share(req).await;
        out.push(t.elapsed());
    }
    out
}

struct Throughput {
    prepares_per_s: f64,
    prepare: Stats,
    unprepares_per_s: f64,
    unprepare: Stats,
}

/// The agent stopped answering during a concurrent run.
struct Hang {
    phase: &'static str,
    /// Calls answered before the agent stopped.
    done: usize,
    /// What `/healthz` said afterwards: whether a liveness probe would notice.
    healthz: String,
    /// The agent's CPU time over one second after the hang: none means a deadlock,
    /// not an overload.
    cpu: String,
}

impl Hang {
    fn new(a: &Agent, phase: &'static str, done: usize) -> Hang {
        let before = shareguard_tests::net::process_cpu_ticks(a.pid());
        std::thread::sleep(Duration::from_secs(1));
        let cpu = match (before, shareguard_tests::net::process_cpu_ticks(a.pid())) {
            (Some(b), Some(e)) => format!("{} CPU ticks in 1 s", e.saturating_sub(b)),
            _ => "CPU time unknown".to_owned(),
        };
        let healthz = match a.metrics.and_then(|m| http_get(m, "/healthz")) {
            Some((code, _)) => format!("answered {code}"),
            None => "no answer".to_owned(),
        };
        Hang {
            phase,
            done,
            healthz,
            cpu,
        }
    }
}

/// Claims client `k` of a throughput run prepares: `ops` spread evenly over `clients`.
fn run_uids(tag: &str, clients: usize, ops: usize, k: usize) -> Vec<String> {
    let n = ops / clients + usize::from(k < ops % clients);
    (0..n).map(|i| format!("{tag}-{k}-{i}")).collect()
}

/// Unprepares every claim of a throughput run that hung, whether or not its Prepare was
/// answered (Unprepare of an unknown claim succeeds), so the live count is N again.
async fn release_all(a: &Agent, uids: &[String]) {
    let mut c = a.client().await;
    for batch in uids.chunks(PRELOAD_BATCH) {
        let req = pb::UnprepareRequest {
            epoch: EPOCH,
            claims: batch.iter().map(|u| claim_ref(u)).collect(),
            only_pre_bind: false,
        };
        let r = c.unprepare(req).await.unwrap().into_inner();
        for u in batch {
            expect_released(&r, u);
        }
    }
}

/// Waits for every task, unless the calls they count stop completing for `hang`; then
/// aborts them and returns how many completed.
async fn join_or_hang<T: 'static>(
    tasks: &mut JoinSet<T>,
    progress: &AtomicUsize,
    hang: Duration,
) -> Result<Vec<T>, usize> {
    let mut out = Vec::new();
    let mut last = progress.load(Relaxed);
    let mut since = Instant::now();
    loop {
        match tokio::time::timeout(Duration::from_millis(100), tasks.join_next()).await {
            Ok(Some(r)) => out.push(r.unwrap()),
            Ok(None) => return Ok(out),
            Err(_) => {
                let now = progress.load(Relaxed);
                if now != last {
                    last = now;
                    since = Instant::now();
                } else if since.elapsed() >= hang {
                    tasks.abort_all();
                    return Err(now);
                }
            }
        }
    }
}

/// `clients` connections, each preparing its share of `ops` claims one after the other;
/// then the same clients unprepare them all, which brings the live count back down.
async fn throughput(
    a: &Agent,
    tag: &str,
    clients: usize,
    ops: usize,
    hang: Duration,
) -> Result<Throughput, Hang> {
    let mut work = Vec::with_capacity(clients);
    for k in 0..clients {
        let reqs: Vec<(String, pb::PrepareRequest)> = run_uids(tag, clients, ops, k)
            .into_iter()
            .map(|uid| {
                let req = prepare_request(&uid);
                (uid, req)
            })
            .collect();
        work.push((a.client().await, reqs));
    }

    let progress = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for (mut c, reqs) in work {
        let progress = progress.clone();
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(reqs.len());
            let mut uids = Vec::with_capacity(reqs.len());
            for (uid, req) in reqs {
                let t = Instant::now();
                let r = c.prepare(req).await.unwrap().into_inner();
                lat.push(t.elapsed());
                progress.fetch_add(1, Relaxed);
                expect_prepared(&r, &uid);
                uids.push(uid);
            }
            (c, uids, lat)
        });
    }
    let prepared = join_or_hang(&mut tasks, &progress, hang)
        .await
        .map_err(|done| Hang::new(a, "Prepare", done))?;
    let prep_wall = started.elapsed();
    let mut prep_lat = Vec::with_capacity(ops);
    let mut conns = Vec::with_capacity(clients);
    for (c, uids, lat) in prepared {
        prep_lat.extend(lat);
        conns.push((c, uids));
    }

    let progress = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for (mut c, uids) in conns {
        let progress = progress.clone();
        tasks.spawn(async move {
            let mut lat = Vec::with_capacity(uids.len());
            for uid in uids {
                let req = unprepare_request(&uid);
                let t = Instant::now();
                let r = c.unprepare(req).await.unwrap().into_inner();
                lat.push(t.elapsed());
                progress.fetch_add(1, Relaxed);
                expect_released(&r, &uid);
            }
            lat
        });
    }
    let unprepared = join_or_hang(&mut tasks, &progress, hang)
        .await
        .map_err(|done| Hang::new(a, "Unprepare", done))?;
    let unprep_wall = started.elapsed();

    Ok(Throughput {
        prepares_per_s: ops as f64 / prep_wall.as_secs_f64(),
        prepare: Stats::of(prep_lat),
        unprepares_per_s: ops as f64 / unprep_wall.as_secs_f64(),
        unprepare: Stats::of(unprepared.into_iter().flatten().collect()),
    })
}

async fn live_shares(a: &Agent) -> u32 {
    let r = a
        .client()
        .await
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();
    r.devices
        .iter()
        .find(|d| d.name == DEVICE)
        .unwrap_or_else(|| panic!("ListDevices has no {DEVICE}: {r:?}"))
        .live_shares
}

struct RestartRun {
    to_ready: Duration,
    startup_ms: Option<u64>,
    records: Option<u64>,
}

struct Restarts {
    runs: Vec<RestartRun>,
    rss_kib: Option<u64>,
    /// The most the last start's process was ever resident (its start included): what
    /// a memory limit has to fit.
    peak_rss_kib: Option<u64>,
}

/// A numeric `key=value` field of the agent's "ready" log line.
fn ready_field(log: &str, key: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains(" ready "))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
}

/// A KiB figure of `/proc/<pid>/status`: `VmRSS` (resident now), `VmHWM` (the most
/// ever resident).
fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| {
        l.strip_prefix(field)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn restarts(rt: &Runtime, s: &Settings, a: &mut Agent, live: usize) -> Restarts {
    let mut runs = Vec::with_capacity(s.restarts);
    for i in 0..s.restarts {
        eprintln!("[{live} live] SIGKILL and restart {}/{}", i + 1, s.restarts);
        let to_ready = a.restart_timed();
        let log = a.log_text();
        runs.push(RestartRun {
            to_ready,
            startup_ms: ready_field(&log, "startup_ms"),
            records: ready_field(&log, "shares"),
        });
        // Recovery that lost a share would make a fast restart meaningless.
        let now_live = rt.block_on(guarded(s.hang, "ListDevices", live_shares(a)));
        assert_eq!(
            usize::try_from(now_live).ok(),
            Some(live),
            "live shares after restart {}",
            i + 1
        );
    }
    Restarts {
        runs,
        rss_kib: status_kib(a.pid(), "VmRSS"),
        peak_rss_kib: status_kib(a.pid(), "VmHWM"),
    }
}

struct Point {
    live: usize,
    preload: Duration,
    fsync: FsyncBaseline,
    floor: Stats,
    prepare: Stats,
    unprepare: Stats,
    /// Per client count: the figures, or how the agent hung.
    throughput: Vec<(usize, Result<Throughput, Hang>)>,
    restarts: Option<Restarts>,
    disk: String,
}

/// Measures one point on a fresh agent. The restarts come before the concurrent runs,
/// which may leave the agent hung.
fn run_point(rt: &Runtime, s: &Settings, live: usize, restart: bool) -> Point {
    let mut a = Agent::start(Options::new(generic_device(
        DEVICE,
        CAPACITY,
        AMOUNT,
        &[NAMESPACE],
        &[],
    )));
    let disk = disk_of(a.dir.path());
    eprintln!("[{live} live] preloading");
    let t = Instant::now();
    rt.block_on(preload(&a, live, s.preload_clients, s.hang));
    let preload_time = t.elapsed();
    eprintln!(
        "[{live} live] preloaded in {:.1} s; bare fsync",
        preload_time.as_secs_f64()
    );
    let fsync = fsync_baseline(a.dir.path(), s.fsync_samples);
    eprintln!("[{live} live] sequential Prepare/Unprepare");
    let (floor, (prep, unprep)) = rt.block_on(async {
        // The first calls pay for the connection and cold caches, which no steady-state
        // Prepare does.
        guarded(s.hang, "warm-up", sequential(&a, "warm", s.warmup)).await;
        let budget = s.hang * u32::try_from(s.samples.max(1)).unwrap_or(u32::MAX);
        let floor = guarded(budget, "GetShare", round_trip_floor(&a, s.samples)).await;
        let seq = guarded(budget, "sequential", sequential(&a, "seq", s.samples)).await;
        (floor, seq)
    });
    let restarts = (restart && s.restarts > 0).then(|| restarts(rt, s, &mut a, live));

    let mut runs = Vec::with_capacity(s.clients.len());
    for (i, &clients) in s.clients.iter().enumerate() {
        eprintln!("[{live} live] {clients} concurrent clients");
        let tag = format!("tput{i}");
        let ops = s.throughput_ops.max(clients);
        let r = rt.block_on(throughput(&a, &tag, clients, ops, s.hang));
        if let Err(h) = &r {
            // The store has every acknowledged call, so a restart brings the agent back;
            // releasing the run's claims restores N live shares for the next run.
            eprintln!(
                "[{live} live] agent hung in {} after {} calls; SIGKILL, restart, clean up",
                h.phase, h.done
            );
            a.restart();
            let uids: Vec<String> = (0..clients)
                .flat_map(|k| run_uids(&tag, clients, ops, k))
                .collect();
            rt.block_on(guarded(
                s.hang,
                "clean-up after a hang",
                release_all(&a, &uids),
            ));
        }
        runs.push((clients, r));
    }
    let now_live = rt.block_on(guarded(s.hang, "ListDevices", live_shares(&a)));
    assert_eq!(
        usize::try_from(now_live).ok(),
        Some(live),
        "live shares after the measurements"
    );
    Point {
        live,
        preload: preload_time,
        fsync,
        floor: Stats::of(floor),
        prepare: Stats::of(prep),
        unprepare: Stats::of(unprep),
        throughput: runs,
        restarts,
        disk,
    }
}

/// The mount that holds `dir` (longest mount point that is a prefix of it) and, where
/// sysfs says, the block device's write cache mode, which decides what an fsync costs.
fn disk_of(dir: &Path) -> String {
    let dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = fs::read_to_string("/proc/mounts").unwrap_or_default();
    let best = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 3 && dir.starts_with(f[1]))
                .then(|| (f[0].to_owned(), f[1].to_owned(), f[2].to_owned()))
        })
        .max_by_key(|(_, mnt, _)| mnt.len());
    let Some((dev, mnt, fstype)) = best else {
        return "unknown".into();
    };
    let mut out = format!("{dev} ({fstype}) mounted on {mnt}");
    let name = Path::new(&dev)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let queue = PathBuf::from(format!("/sys/class/block/{name}/queue"));
    let read = |f: &str| {
        fs::read_to_string(queue.join(f))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    if let Some(wc) = read("write_cache") {
        let _ = write!(out, ", write cache: {wc}");
    }
    if let Some(rot) = read("rotational") {
        let _ = write!(out, ", rotational: {rot}");
    }
    out
}

fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, m)| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn report(s: &Settings, points: &[Point]) -> String {
    let mut o = String::new();
    let w = &mut o;
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let _ = writeln!(w, "## Run\n");
    let _ = writeln!(w, "| | |\n|---|---|");
    let _ = writeln!(w, "| kernel | {} |", kernel.trim());
    let _ = writeln!(w, "| CPU | {cores} x {} |", cpu_model());
    if let Some(p) = points.first() {
        let _ = writeln!(w, "| disk (agent store and fsync file) | {} |", p.disk);
    }
    // Relative to the repository, as docs/benchmarks.md quotes it: a checkout's
    // absolute path says nothing to a reader.
    let bin = agent_bin();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shown = root
        .canonicalize()
        .ok()
        .and_then(|r| bin.strip_prefix(r).ok().map(std::path::Path::to_path_buf))
        .unwrap_or(bin);
    let _ = writeln!(w, "| agent binary | `{}` |", shown.display());
    let _ = writeln!(
        w,
        "| sizes | {} sequential samples after {} warm-up, {} fsync samples, {} ops per throughput run{} |",
        s.samples,
        s.warmup,
        s.fsync_samples,
        s.throughput_ops,
        if s.quick { ", BENCH_QUICK" } else { "" }
    );

    let _ = writeln!(w, "\n## Bare fsync on the store's disk (ms)\n");
    let _ = writeln!(
        w,
        "Measured right before each point's Prepare samples, in the agent's own directory.\n"
    );
    let _ = writeln!(
        w,
        "| before point | append 4 KiB + fsync p50 | p99 | overwrite 4 KiB + fdatasync p50 | p99 |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|");
    for p in points {
        let _ = writeln!(
            w,
            "| {} live | {} | {} | {} | {} |",
            p.live,
            ms(p.fsync.append_fsync.p50),
            ms(p.fsync.append_fsync.p99),
            ms(p.fsync.overwrite_fdatasync.p50),
            ms(p.fsync.overwrite_fdatasync.p99)
        );
    }

    let _ = writeln!(w, "\n## Prepare, one share, durable, one at a time (ms)\n");
    let _ = writeln!(
        w,
        "Each Prepare is followed by the Unprepare of its claim, so N stays live and one tombstone is added per sample. Ratios are against the append + fsync baseline measured just before. GetShare (unknown shareID) is the round trip through client, gRPC and socket alone.\n"
    );
    let _ = writeln!(
        w,
        "| live shares | samples | p50 | p99 | mean | max | p50 / fsync p50 | p99 / fsync p99 | GetShare p50 | p99 |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in points {
        let b = &p.fsync.append_fsync;
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {} |",
            p.live,
            p.prepare.n,
            ms(p.prepare.p50),
            ms(p.prepare.p99),
            ms(p.prepare.mean),
            ms(p.prepare.max),
            ratio(p.prepare.p50, b.p50),
            ratio(p.prepare.p99, b.p99),
            ms(p.floor.p50),
            ms(p.floor.p99)
        );
    }

    let _ = writeln!(w, "\n## Unprepare, one claim, one at a time (ms)\n");
    let _ = writeln!(w, "| live shares | samples | p50 | p99 | mean | max |");
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|");
    for p in points {
        let u = &p.unprepare;
        let _ = writeln!(
            w,
            "| {} | {} | {} | {} | {} | {} |",
            p.live,
            u.n,
            ms(u.p50),
            ms(u.p99),
            ms(u.mean),
            ms(u.max)
        );
    }

    let _ = writeln!(w, "\n## Throughput with concurrent clients\n");
    let _ = writeln!(
        w,
        "Each client has its own connection and one call in flight. Live shares rise from N to N + ops during the Prepare phase and fall back during the Unprepare phase. A run is marked hung when no call completed for {} s; the agent is then SIGKILLed and restarted, and the run's claims released, before the next run.\n",
        s.hang.as_secs()
    );
    let _ = writeln!(
        w,
        "| live shares (N) | clients | ops | Prepares/s | Prepare p50 ms | p99 ms | Unprepares/s | Unprepare p50 ms | p99 ms |"
    );
    let _ = writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in points {
        for (clients, r) in &p.throughput {
            let ops = s.throughput_ops.max(*clients);
            let _ = match r {
                Ok(t) => writeln!(
                    w,
                    "| {} | {clients} | {ops} | {:.0} | {} | {} | {:.0} | {} | {} |",
                    p.live,
                    t.prepares_per_s,
                    ms(t.prepare.p50),
                    ms(t.prepare.p99),
                    t.unprepares_per_s,
                    ms(t.unprepare.p50),
                    ms(t.unprepare.p99)
                ),
                Err(h) => writeln!(
                    w,
                    "| {} | {clients} | {ops} | **hung** in {} after {} calls ({}; /healthz {}) | | | | | |",
                    p.live, h.phase, h.done, h.cpu, h.healthz
                ),
            };
        }
    }

    let _ = writeln!(w, "\n## Preload (setting up each point)\n");
    let _ = writeln!(
        w,
        "Batches of {PRELOAD_BATCH} claims from {} client(s).\n",
        s.preload_clients
    );
    let _ = writeln!(w, "| live shares | time s | shares/s |");
    let _ = writeln!(w, "|---:|---:|---:|");
    for p in points {
        let secs = p.preload.as_secs_f64();
        let _ = writeln!(
            w,
            "| {} | {:.2} | {:.0} |",
            p.live,
            secs,
            p.live as f64 / secs.max(1e-9)
        );
    }

    let mut restart_summary = None;
    for p in points {
        let Some(r) = &p.restarts else { continue };
        let _ = writeln!(
            w,
            "\n## Restart to ready with {} live shares (SIGKILL, then start)\n",
            p.live
        );
        let _ = writeln!(
            w,
            "From spawning the process until `/readyz` answers 200 (polled every 2 ms), and the agent's own `startup_ms` from its ready line. Records include the tombstones the sequential samples left.\n"
        );
        let _ = writeln!(
            w,
            "| run | spawn to /readyz 200 ms | agent startup_ms | records loaded |"
        );
        let _ = writeln!(w, "|---:|---:|---:|---:|");
        let opt = |v: Option<u64>| v.map_or_else(|| "?".to_owned(), |v| v.to_string());
        for (i, run) in r.runs.iter().enumerate() {
            let _ = writeln!(
                w,
                "| {} | {} | {} | {} |",
                i + 1,
                ms(run.to_ready),
                opt(run.startup_ms),
                opt(run.records)
            );
        }
        if !r.runs.is_empty() {
            let st = Stats::of(r.runs.iter().map(|r| r.to_ready).collect());
            let mut startup: Vec<u64> = r.runs.iter().filter_map(|r| r.startup_ms).collect();
            startup.sort_unstable();
            let _ = writeln!(
                w,
                "| median / max | {} / {} | {} / {} | |",
                ms(st.p50),
                ms(st.max),
                opt(startup.get(startup.len().saturating_sub(1) / 2).copied()),
                opt(startup.last().copied())
            );
            restart_summary = Some((p.live, st));
        }
        if let Some(kib) = r.rss_kib {
            let _ = writeln!(
                w,
                "\nAgent resident memory after the last restart: {:.1} MiB.",
                kib as f64 / 1024.0
            );
        }
        if let Some(kib) = r.peak_rss_kib {
            let _ = writeln!(
                w,
                "Agent peak resident memory, that start included: {:.1} MiB.",
                kib as f64 / 1024.0
            );
        }
    }

    let _ = writeln!(w, "\n## Targets (docs/architecture.md)\n");
    let _ = writeln!(w, "| target | live shares | measured | met |");
    let _ = writeln!(w, "|---|---:|---|---|");
    let yes = |b: bool| if b { "yes" } else { "**no**" };
    for p in points {
        let _ = writeln!(
            w,
            "| Prepare p99 < {} ms | {} | {} ms | {} |",
            TARGET_PREPARE_P99.as_millis(),
            p.live,
            ms(p.prepare.p99),
            yes(p.prepare.p99 < TARGET_PREPARE_P99)
        );
    }
    for p in points {
        let r = ratio(p.prepare.p99, p.fsync.append_fsync.p99);
        let _ = writeln!(
            w,
            "| Prepare p99 <= 3x bare fsync p99 | {} | {:.2}x ({} / {} ms) | {} |",
            p.live,
            r,
            ms(p.prepare.p99),
            ms(p.fsync.append_fsync.p99),
            yes(r <= TARGET_FSYNC_RATIO)
        );
    }
    // Memory is judged where the shares dwarf the agent's own.
    let judged = |live: usize, ok: bool| {
        if live >= RSS_JUDGED_FROM {
            yes(ok)
        } else {
            "not judged below 100,000 live"
        }
    };
    for p in points {
        let Some(r) = &p.restarts else {
            continue;
        };
        if let Some(kib) = r.rss_kib {
            let per_share = kib as f64 / p.live.max(1) as f64;
            let _ = writeln!(
                w,
                "| agent RSS < {TARGET_RSS_PER_SHARE_KIB} KiB a live share | {} | {per_share:.2} KiB ({:.1} MiB) | {} |",
                p.live,
                kib as f64 / 1024.0,
                judged(p.live, per_share < TARGET_RSS_PER_SHARE_KIB)
            );
        }
        if let Some(kib) = r.peak_rss_kib {
            let mib = kib as f64 / 1024.0;
            let _ = writeln!(
                w,
                "| agent peak RSS, its start included, < {TARGET_PEAK_RSS_MIB} MiB | {} | {mib:.1} MiB | {} |",
                p.live,
                judged(p.live, mib < TARGET_PEAK_RSS_MIB)
            );
        }
    }
    if let Some((live, st)) = restart_summary {
        let _ = writeln!(
            w,
            "| restart to ready < 1 s | {live} | median {} ms, max {} ms | {} |",
            ms(st.p50),
            ms(st.max),
            yes(st.max < TARGET_RESTART)
        );
    }
    o
}

fn main() {
    // `cargo bench` passes `--bench`; this benchmark has no options of its own.
    let s = Settings::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let wall = Instant::now();
    let last = s.sizes.len() - 1;
    let points: Vec<Point> = s
        .sizes
        .iter()
        .enumerate()
        .map(|(i, &live)| run_point(&rt, &s, live, i == last))
        .collect();
    println!("{}", report(&s, &points));
    eprintln!(
        "benchmark finished in {:.0} s",
        wall.elapsed().as_secs_f64()
    );
}
