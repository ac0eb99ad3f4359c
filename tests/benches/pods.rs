//! Pod discovery and the metrics endpoint under load, through the release binary
//! (`cargo bench -p shareguard-tests --bench pods`, as root). Prints figures for
//! docs/benchmarks.md; asserts nothing about speed.
//!
//! 1. Sandbox to ENFORCED: `PODS` (100) bandwidth claims are prepared with nothing but
//!    their pod's uid, before any sandbox exists (PENDING). Then, one pod at a time, its
//!    network is set up (netns, veth) and its sandbox starts (a pod cgroup in kubelet's
//!    systemd layout, a process in it, in the pod's netns); the time from just before
//!    the sandbox starts (cgroup directories, process spawn, its move into the cgroup)
//!    to the share's ENFORCED event on a WatchShares stream is one sample. Each pod
//!    joins the ones before it, so the last is found among 99 others. The rescan period
//!    is an hour: every detection comes from the kernel's events.
//! 2. The agent's CPU with those shares live: over 20 s with no traffic, then while
//!    `SHAREGUARD_BENCH_BUSY` (10) of the pods each receive one TCP flow at their
//!    share's limit, from `/proc/PID/stat`. That is mostly the burst governor's cost: it
//!    reads a busy share's counters every 20 ms and an idle one's once a second.
//! 3. Prepare under scrapes: with those shares live (their counters read on the
//!    agent's period), sequential Prepare+Unprepare of an accounting share, in rounds
//!    without scrapers, with 8 threads each scraping /metrics every 100 ms (80 scrapes
//!    a second: far more than any Prometheus setup), and with 8 threads scraping as fast
//!    as they can (a stress case: on 2 cores the renders then take CPU from everything),
//!    the three alternated so that all see the same machine. Medians of the rounds' p50
//!    and p99, and the p99 ratios. The agent serves a scrape within `metrics_max_age`
//!    (its default, 1 s) of the last render that render again.

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up panics with the reason.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use shareguard_tests::{
    Agent, alloc, claim, env_or, generic_device,
    net::{self, PinDir, Pod, TrafficLock},
    pod::{Layout, pod_uid},
    proto as pb, share_id,
};

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn sandbox_latency(a: &Agent, pods: usize) -> (Vec<Duration>, Vec<Pod>) {
    let mut c = a.client().await;
    let uids: Vec<String> = (0..pods).map(|_| pod_uid()).collect();
    let ids: Vec<String> = (0..pods).map(|_| share_id()).collect();
    for (i, (u, id)) in uids.iter().zip(&ids).enumerate() {
        // 50M: a rate whose 10 ms bucket is above the idle one, so that the burst
        // governor keeps these shares (at 10M it would have nothing to do).
        let cl = net::bw_claim_for(&format!("p{i}"), "bench", "nic-0", u, id, "50M");
        let r = c
            .prepare(pb::PrepareRequest {
                epoch: 0,
                claims: vec![cl],
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.claims[&format!("p{i}")].shares[0].phase,
            pb::Phase::Pending as i32
        );
    }
    let mut w = c
        .watch_shares(pb::WatchSharesRequest {
            device: "nic-0".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // Past the snapshot.
    loop {
        let ev = w.message().await.unwrap().unwrap();
        if ev.kind == pb::watch_shares_response::Kind::SnapshotEnd as i32 {
            break;
        }
    }
    let mut out = Vec::with_capacity(pods);
    let mut live = Vec::with_capacity(pods);
    for (u, id) in uids.iter().zip(&ids) {
        // CNI's part first, as before a sandbox starts; it is not timed.
        let mut pod = Pod::network_only(u);
        let t = Instant::now();
        pod.start_sandbox(Layout::Systemd);
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), w.message())
                .await
                .expect("no ENFORCED within 30 s")
                .unwrap()
                .unwrap();
            if let Some(s) = ev.share
                && s.share_id == *id
                && s.phase == pb::Phase::Enforced as i32
            {
                break;
            }
        }
        out.push(t.elapsed());
        live.push(pod);
    }
    (out, live)
}

/// The CPU time (user and system, of all its threads, also those that ended) process
/// `pid` has used so far.
fn cpu_time(pid: u32) -> Duration {
    let ticks = net::process_cpu_ticks(pid).unwrap();
    Duration::from_secs_f64(ticks as f64 / net::clock_ticks())
}

/// The agent's CPU use, as a fraction of one core, over a span.
struct AgentCpu {
    idle: f64,
    idle_span: Duration,
    busy: f64,
    busy_span: Duration,
}

/// The agent's CPU use with its shares idle, then while each of `busy` pods receives one
/// TCP flow at its share's limit (the burst governor reads those shares' counters every
/// tick; the others it looks at once a second).
fn agent_cpu(a: &Agent, busy: &[Pod]) -> AgentCpu {
    let (c0, t0) = (cpu_time(a.pid()), Instant::now());
    // A span to average over, not a wait for a condition.
    std::thread::sleep(Duration::from_secs(20));
    let idle_span = t0.elapsed();
    let idle = (cpu_time(a.pid()) - c0).as_secs_f64() / idle_span.as_secs_f64();
    let servers: Vec<_> = busy.iter().map(Pod::iperf_server).collect();
    let (c0, t0) = (cpu_time(a.pid()), Instant::now());
    std::thread::scope(|s| {
        for server in &servers {
            // As long as the idle span, so that both hold as many of the agent's periodic
            // passes (counters, reconciler).
            let run = net::Iperf {
                seconds: 19,
                ..net::Iperf::new(net::Direction::ToPod)
            };
            s.spawn(move || server.measure(&run));
        }
    });
    let busy_span = t0.elapsed();
    let busy = (cpu_time(a.pid()) - c0).as_secs_f64() / busy_span.as_secs_f64();
    AgentCpu {
        idle,
        idle_span,
        busy,
        busy_span,
    }
}

/// How the scrapers of one round behave.
#[derive(Clone, Copy, PartialEq)]
enum Scraping {
    None,
    /// Each scraper sleeps this long between scrapes.
    Paced(Duration),
    /// Each scraper scrapes again as soon as it has the answer.
    FlatOut,
}

/// What the rounds of one kind of scraping measured.
#[derive(Clone, Default)]
struct ModeResult {
    /// Each round's Prepare (p50, p99).
    rounds: Vec<(Duration, Duration)>,
    scrapes: u64,
    scrape_us: u64,
}

/// `rounds` rounds of each of `modes` in turn (so that all see the same machine), each
/// `n` sequential Prepare+Unprepare while `scrapers` threads scrape /metrics. Returns,
/// per mode, each round's (p50, p99), the scrapes made and the microseconds they took.
async fn prepare_under_scrapes(
    a: &Agent,
    modes: &[Scraping],
    rounds: usize,
    n: usize,
    scrapers: usize,
) -> Vec<ModeResult> {
    let mut c = a.client().await;
    let mut out = vec![ModeResult::default(); modes.len()];
    for round in 0..rounds {
        for (m, mode) in modes.iter().enumerate() {
            let stop = Arc::new(AtomicBool::new(false));
            let scrapes = Arc::new(AtomicU64::new(0));
            let scrape_us = Arc::new(AtomicU64::new(0));
            let threads: Vec<_> = (0..if *mode == Scraping::None { 0 } else { scrapers })
                .map(|_| {
                    let (stop, scrapes, mode) = (stop.clone(), scrapes.clone(), *mode);
                    let scrape_us = scrape_us.clone();
                    let addr = a.metrics.unwrap();
                    std::thread::spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            let t = Instant::now();
                            let _ = shareguard_tests::http_get(addr, "/metrics");
                            scrape_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                            scrapes.fetch_add(1, Ordering::Relaxed);
                            if let Scraping::Paced(p) = mode {
                                std::thread::sleep(p);
                            }
                        }
                    })
                })
                .collect();
            let mut lat = Vec::with_capacity(n);
            for i in 0..n {
                let uid = format!("s{round}-{m}-{i}");
                let req = pb::PrepareRequest {
                    epoch: 0,
                    claims: vec![claim(
                        &uid,
                        "bench",
                        "a1",
                        vec![alloc("gen-0", &share_id(), "1Gi")],
                    )],
                };
                let t = Instant::now();
                let r = c.prepare(req).await.unwrap().into_inner();
                lat.push(t.elapsed());
                assert_eq!(r.claims[&uid].error, None);
                c.unprepare(pb::UnprepareRequest {
                    epoch: 0,
                    claims: vec![shareguard_tests::claim_ref(&uid)],
                    only_pre_bind: false,
                })
                .await
                .unwrap();
            }
            stop.store(true, Ordering::Relaxed);
            for t in threads {
                t.join().unwrap();
            }
            lat.sort();
            out[m].rounds.push((pct(&lat, 0.5), pct(&lat, 0.99)));
            out[m].scrapes += scrapes.load(Ordering::Relaxed);
            out[m].scrape_us += scrape_us.load(Ordering::Relaxed);
        }
    }
    out
}

fn main() {
    if !net::privileged("bench pods") {
        return;
    }
    let pods = env_or("SHAREGUARD_BENCH_PODS", 100);
    let rounds = env_or("SHAREGUARD_BENCH_ROUNDS", 5);
    let per_round = env_or("SHAREGUARD_BENCH_PREPARES", 300);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let _lock = TrafficLock::acquire();
    let pins = PinDir::new();
    let devices = format!(
        "{}{}",
        net::net_device("nic-0", &net::bandwidth_capacity("100G")),
        generic_device("gen-0", "100000Gi", "1Gi", &["bench"], &[])
    );
    // The agent's default render age for scrapes (the test harness sets none).
    let a = net::start_agent(
        devices,
        &pins,
        "rescan_period = \"1h\"\nmetrics_max_age = \"1s\"",
    );
    let (lat, pods_live) = rt.block_on(sandbox_latency(&a, pods));
    let mut sorted = lat.clone();
    sorted.sort();
    println!("## Sandbox to ENFORCED, {pods} pods on the node\n");
    println!(
        "| pods | p50 | p90 | p99 | max | mechanism |\n|---|---|---|---|---|---|\n| {pods} | {} | {} | {} | {} | {} |",
        ms(pct(&sorted, 0.5)),
        ms(pct(&sorted, 0.9)),
        ms(pct(&sorted, 0.99)),
        ms(*sorted.last().unwrap()),
        shareguard_limiter_net::mechanism::auto(&shareguard_limiter_net::probe::probe().unwrap(),)
            .name()
    );
    let tenth = |i: usize| {
        let chunk = &lat[i * lat.len() / 10..(i + 1) * lat.len() / 10];
        median(chunk.to_vec())
    };
    println!(
        "\nmedian of the first tenth of the pods {} , of the last tenth {} (found among {} others)",
        ms(tenth(0)),
        ms(tenth(9)),
        pods - 1
    );
    let busy = env_or("SHAREGUARD_BENCH_BUSY", 10).min(pods);
    let cpu = agent_cpu(&a, &pods_live[..busy]);
    println!("\n## The agent's CPU with {pods} live bandwidth shares\n");
    println!(
        "| shares carrying traffic | span | agent CPU, ms per s | of one core |\n|---|---|---|---|"
    );
    for (what, span, per_s) in [
        ("none", cpu.idle_span, cpu.idle),
        (
            &*format!("{busy}, a TCP flow each at its limit"),
            cpu.busy_span,
            cpu.busy,
        ),
    ] {
        println!(
            "| {what} | {:.1} s | {:.2} | {:.2}% |",
            span.as_secs_f64(),
            per_s * 1e3,
            per_s * 1e2
        );
    }
    println!(
        "\nper busy share: {:.2} ms of CPU per s more than idle",
        (cpu.busy - cpu.idle) * 1e3 / busy.max(1) as f64
    );
    let modes = [
        Scraping::None,
        Scraping::Paced(Duration::from_millis(100)),
        Scraping::FlatOut,
    ];
    let names = [
        "no scraper",
        "8 scrapers, each every 100 ms",
        "8 scrapers, flat out",
    ];
    let res = rt.block_on(prepare_under_scrapes(&a, &modes, rounds, per_round, 8));
    let p50 = |v: &[(Duration, Duration)]| median(v.iter().map(|x| x.0).collect());
    let p99 = |v: &[(Duration, Duration)]| median(v.iter().map(|x| x.1).collect());
    println!(
        "\n## Prepare with {pods} live bandwidth shares, without and with 8 scrapers on /metrics\n"
    );
    println!(
        "| scrapers | Prepare p50 (median of {rounds} rounds) | Prepare p99 (median of {rounds} rounds) | p99 / no scraper | scrapes | mean scrape |\n|---|---|---|---|---|---|"
    );
    let base = p99(&res[0].rounds);
    for (name, r) in names.iter().zip(&res) {
        let (rounds, scrapes, us) = (&r.rounds, &r.scrapes, r.scrape_us);
        println!(
            "| {name} | {} | {} | {:.2} | {scrapes} | {} |",
            ms(p50(rounds)),
            ms(p99(rounds)),
            p99(rounds).as_secs_f64() / base.as_secs_f64(),
            if *scrapes == 0 {
                "-".to_owned()
            } else {
                ms(Duration::from_micros(us / scrapes))
            }
        );
    }
    println!("\n({per_round} sequential Prepares, each with its Unprepare, per round.)");
    drop(pods_live);
    drop(a);
}
