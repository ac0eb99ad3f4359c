//! What shaping costs the node's CPUs: whole-machine CPU seconds and softirq seconds per
//! gigabyte delivered through N shaped pods at once, side by side in one run with the
//! same pods unshaped, under `tbf` as the CNI bandwidth plugin sets it (its burst at
//! least two GSO packets, see [`Shaping::install`]), and under one HTB class per pod, at
//! 50M, 200M and 2G a pod, with 1, 10 and 100 pods, in each direction.
//!
//! Each pod has its own veth pair and iperf3 server, and runs one unpaced TCP flow
//! (iperf3's two ends of pod `i` on CPU `i % 2`, `net::Iperf::cpu` says why). The window
//! opens once every flow is moving bytes and has had a second more to leave slow start,
//! and lasts `SHAPING_CPU_SECONDS`: over it the busy jiffies of `/proc/stat` (everyone's:
//! iperf3, the kernel's softirqs, the agent's reconciler) and the bytes each pod's traffic
//! carried past its shaper (to the pod, what the host end sent; from it, what left the
//! shaper's ifb, or without one what the host end took in). Bytes a shaper dropped are
//! not counted, so retransmissions are a cost, not a gain.
//!
//! Where N flows at the rate ask more than two cores move (100 x 2G here), the limits do
//! not bind and the figure is what the shaping path costs a byte that it passes through.
//! The "of limits" column says which points those are.
//!
//! Rounds (`SHAPING_CPU_ROUNDS`, default 3; one takes about 20 minutes here) run every
//! variant of a point one after the other, rounds interleaved; the tables give medians
//! over rounds. Prints markdown for docs/benchmarks.md; asserts nothing about speed.
//!
//! Run as root: `cargo build --release -p shareguard && cargo bench -p shareguard-tests
//! --bench shaping_cpu` (the agent binary is the one next to the bench: target/release).
//! `SHAPING_CPU_RATES` (default `50M,200M,2G`), `SHAPING_CPU_PODS` (default `1,10,100`),
//! `SHAPING_CPU_DIRECTIONS` (default `to-pod,from-pod`) and `SHAPING_CPU_VARIANTS` (default
//! `none,tbf,htb,shareguard`; the "vs tbf" columns need `tbf`) make a smaller run, such as
//! one shaper alone under `perf record -a`.

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use shareguard_tests::{
    Client, env_list, env_or, net,
    net::{Direction, FromPodShaper, Htb, Iperf, IperfServer, PinDir, Pod, Qdisc, TrafficLock},
    prepare_one, share_id, unprepare_one, wait_phase,
};

const DEVICE: &str = "nic-cpu";
/// Room for 100 pods at 2G each.
const CAPACITY: &str = "1T";
/// Until every flow has moved bytes, a base and a part per flow: each client first waits
/// for its server to be done with the previous run (`IperfServer::measure`), and 100
/// flows under tbf once took more than 4 s.
fn ramp_limit(flows: usize) -> Duration {
    Duration::from_secs(3) + Duration::from_millis(80) * flows as u32
}
/// After every flow moved: out of slow start before the window opens.
const WARM: Duration = Duration::from_secs(1);
/// A flow's bytes that say it is sending (a few segments of a handshake and headers do
/// not).
const MOVING_BYTES: u64 = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    None,
    Tbf,
    Htb,
    Shareguard,
}

impl Variant {
    fn parse(name: &str) -> Variant {
        match name {
            "none" => Variant::None,
            "tbf" => Variant::Tbf,
            "htb" => Variant::Htb,
            "shareguard" => Variant::Shareguard,
            _ => panic!("SHAPING_CPU_VARIANTS: none, tbf, htb or shareguard, not {name:?}"),
        }
    }

    fn label(self, mechanism: &str) -> String {
        match self {
            Variant::None => "no limit".to_owned(),
            Variant::Tbf => "tbf (25 ms)".to_owned(),
            Variant::Htb => "HTB, one class".to_owned(),
            Variant::Shareguard => format!("shareguard {mechanism}"),
        }
    }
}

/// What shapes the pods of one point, removed on drop (also on panic): qdiscs and ifbs
/// by their guards, shares by [`Shaping::release`].
struct Shaping<'a> {
    to_pod: Vec<Qdisc>,
    from_pod: Vec<FromPodShaper>,
    /// (claim uid, share id) per pod, in pod order.
    shares: Vec<(String, String)>,
    rt: &'a tokio::runtime::Runtime,
    client: &'a mut Client,
}

impl<'a> Shaping<'a> {
    fn new(rt: &'a tokio::runtime::Runtime, client: &'a mut Client) -> Self {
        Shaping {
            to_pod: Vec::new(),
            from_pod: Vec::new(),
            shares: Vec::new(),
            rt,
            client,
        }
    }

    fn install(&mut self, variant: Variant, pods: &[Pod], rate: &str, bps: u64) {
        // 10 ms at the rate as burst, as shareguard's HTB has, and never less than two
        // 64 KiB GSO packets: tbf splits a GSO packet larger than its burst into segments
        // in software, which at 50M (62.5 KB) cost it up to 3x the CPU of HTB with 100
        // pods, a cost of the configuration rather than of shaping.
        let burst = (bps / 8 / 100).max(2 * 65_536);
        for pod in pods {
            match variant {
                Variant::None => {}
                Variant::Tbf => {
                    self.to_pod.push(net::tbf_to_pod(pod, bps, burst));
                    self.from_pod.push(net::tbf_from_pod(pod, bps, burst));
                }
                Variant::Htb => {
                    let htb = Htb::new(bps);
                    self.to_pod.push(net::htb_to_pod(pod, &htb));
                    self.from_pod.push(net::htb_from_pod(pod, &htb));
                }
                Variant::Shareguard => {
                    let uid = format!("cpu-{}", share_id());
                    let id = share_id();
                    let claim = net::bw_claim(&uid, "bench", DEVICE, pod, &id, rate);
                    let r = self.rt.block_on(prepare_one(self.client, 0, claim));
                    assert_eq!(r.error, None, "{r:?}");
                    self.shares.push((uid, id));
                }
            }
        }
        for (_, id) in &self.shares {
            let s = self.rt.block_on(wait_phase(
                self.client,
                id,
                shareguard_tests::proto::Phase::Enforced,
            ));
            assert_eq!(s.limits[0].enforced, rate, "read back: {s:?}");
        }
    }

    /// The counter of what pod `i`'s traffic in `dir` carried past its shaper.
    fn counter(&self, dir: Direction, i: usize, pod: &Pod) -> String {
        net::shaped_bytes_counter(
            dir,
            pod.host_if(),
            self.shares.get(i).map(|(_, id)| id.as_str()),
            self.from_pod.get(i).map(|s| s.ifb().name()),
        )
    }

    fn release(&mut self) {
        self.to_pod.clear();
        self.from_pod.clear();
        for (uid, _) in self.shares.drain(..) {
            let e = self.rt.block_on(unprepare_one(self.client, 0, &uid));
            assert_eq!(e.code, "", "unprepare {uid}: {e:?}");
        }
    }
}

impl Drop for Shaping<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.release();
            return;
        }
        let uids = self.shares.drain(..).map(|(uid, _)| uid).collect();
        shareguard_tests::release_quietly(self.rt, self.client, uids);
    }
}

/// One window's figures.
#[derive(Clone, Copy, Debug)]
struct Point {
    /// Bytes past the shapers over the window, all pods.
    bytes: u64,
    seconds: f64,
    busy_s: f64,
    softirq_s: f64,
    /// The agent's own CPU time (user and system) over the window.
    agent_s: f64,
    /// What the machine is busy with nothing sending, over as long: measured at the start
    /// of the window's round.
    idle_s: f64,
}

impl Point {
    fn gb(&self) -> f64 {
        self.bytes as f64 / 1e9
    }
    fn cpu_per_gb(&self) -> f64 {
        self.busy_s / self.gb()
    }
    /// CPU seconds a GB beyond what the machine spends with nothing sending: at 50M a
    /// pod moves 25 MB in a 4 s window, and the rest of the machine is not negligible.
    fn above_idle_per_gb(&self) -> f64 {
        (self.busy_s - self.idle_s).max(0.0) / self.gb()
    }
    fn softirq_per_gb(&self) -> f64 {
        self.softirq_s / self.gb()
    }
    /// The agent's CPU time a GB: for tbf and HTB, what the idle agent spends anyway.
    fn agent_per_gb(&self) -> f64 {
        self.agent_s / self.gb()
    }
    fn gbps(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.seconds / 1e9
    }
}

/// Runs one flow per server in `dir` and measures the window over `counters`.
fn measure(
    servers: &[IperfServer],
    counters: &[String],
    dir: Direction,
    seconds: u32,
    ticks: f64,
    idle_per_s: f64,
    agent_pid: u32,
) -> Point {
    // Long enough that every flow outlives the window: the ramp, the warm-up, the window,
    // and a second to spare.
    let ramp_limit = ramp_limit(servers.len());
    let total = seconds + (ramp_limit + WARM).as_secs() as u32 + 1;
    std::thread::scope(|s| {
        let start: Vec<u64> = counters.iter().map(|c| net::read_counter(c)).collect();
        let flows: Vec<_> = servers
            .iter()
            .enumerate()
            .map(|(i, server)| {
                let run = Iperf {
                    seconds: total,
                    omit: 0,
                    cpu: Some(i as u32 % 2),
                    ..Iperf::new(dir)
                };
                s.spawn(move || server.measure(&run))
            })
            .collect();
        let spawned = Instant::now();
        loop {
            let still = counters
                .iter()
                .zip(&start)
                .filter(|(c, s0)| net::read_counter(c) < *s0 + MOVING_BYTES)
                .count();
            if still == 0 {
                break;
            }
            assert!(
                spawned.elapsed() < ramp_limit,
                "{still} of {} flows had not moved {MOVING_BYTES} bytes after {ramp_limit:?}",
                servers.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let ramp = spawned.elapsed();
        std::thread::sleep(WARM);
        let c0 = net::CpuJiffies::now();
        let a0 = net::process_cpu_ticks(agent_pid).expect("the agent is running");
        let b0: u64 = counters.iter().map(|c| net::read_counter(c)).sum();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(u64::from(seconds)));
        let b1: u64 = counters.iter().map(|c| net::read_counter(c)).sum();
        let elapsed = t0.elapsed().as_secs_f64();
        let c1 = net::CpuJiffies::now();
        let a1 = net::process_cpu_ticks(agent_pid).expect("the agent is running");
        for f in flows {
            f.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        }
        eprintln!("  every flow moving after {ramp:.1?}");
        Point {
            bytes: b1 - b0,
            seconds: elapsed,
            busy_s: (c1.busy - c0.busy) as f64 / ticks,
            softirq_s: (c1.softirq - c0.softirq) as f64 / ticks,
            agent_s: (a1 - a0) as f64 / ticks,
            idle_s: idle_per_s * elapsed,
        }
    })
}

/// (rate, pod count, direction) by index in their lists, and the variant.
type Key = (usize, usize, usize, Variant);

fn main() {
    if !net::privileged("shaping CPU bench") {
        return;
    }
    let rates = env_list("SHAPING_CPU_RATES", "50M,200M,2G");
    let counts: Vec<usize> = env_list("SHAPING_CPU_PODS", "1,10,100")
        .iter()
        .map(|n| n.parse().expect("SHAPING_CPU_PODS: counts"))
        .collect();
    let dirs: Vec<Direction> = env_list("SHAPING_CPU_DIRECTIONS", "to-pod,from-pod")
        .iter()
        .map(|d| match d.as_str() {
            "to-pod" => Direction::ToPod,
            "from-pod" => Direction::FromPod,
            _ => panic!("SHAPING_CPU_DIRECTIONS: to-pod or from-pod, not {d:?}"),
        })
        .collect();
    let mut variants: Vec<Variant> = env_list("SHAPING_CPU_VARIANTS", "none,tbf,htb,shareguard")
        .iter()
        .map(|v| Variant::parse(v))
        .collect();
    variants.sort();
    variants.dedup();
    let seconds = env_or::<u32>("SHAPING_CPU_SECONDS", 4);
    let rounds = env_or::<u32>("SHAPING_CPU_ROUNDS", 3);
    let ticks = net::clock_ticks();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let pins = PinDir::new();
    let agent = net::start_agent(
        net::net_device(
            DEVICE,
            &format!(
                "mechanism = \"auto\"\n{}",
                net::bandwidth_capacity(CAPACITY)
            ),
        ),
        &pins,
        "",
    );
    let mut client = rt.block_on(agent.client());
    let mechanism = rt
        .block_on(shareguard_tests::device(&mut client, DEVICE))
        .mechanisms[0]
        .clone();
    let most = counts.iter().copied().max().unwrap_or(0);
    let started = Instant::now();
    let pods: Vec<Pod> = (0..most).map(|_| Pod::new()).collect();
    let servers: Vec<IperfServer> = pods.iter().map(Pod::iperf_server).collect();
    eprintln!("{most} pods up in {:.1?}", started.elapsed());
    let _lock = TrafficLock::acquire();
    let load = net::LoadAvg::now();

    let mut points: BTreeMap<Key, Vec<Point>> = BTreeMap::new();
    let mut idle = Vec::new();
    for round in 0..rounds {
        // What the machine spends with nothing sending (the agent, the bench, the rest),
        // to read the slow points against: at 50M one pod moves 25 MB a second.
        let c0 = net::CpuJiffies::now();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs(u64::from(seconds)));
        let c1 = net::CpuJiffies::now();
        let idle_per_s = (c1.busy - c0.busy) as f64 / ticks / t0.elapsed().as_secs_f64();
        eprintln!("round {round}: nothing sending, {idle_per_s:.3} CPU s a second");
        idle.push(idle_per_s);
        for (ri, rate) in rates.iter().enumerate() {
            for (ni, &n) in counts.iter().enumerate() {
                for &variant in &variants {
                    let mut shaping = Shaping::new(&rt, &mut client);
                    let t = Instant::now();
                    shaping.install(variant, &pods[..n], rate, net::rate_bps(rate));
                    eprintln!("  {n} pods shaped in {:.1?}", t.elapsed());
                    for (di, &dir) in dirs.iter().enumerate() {
                        let counters: Vec<String> = pods[..n]
                            .iter()
                            .enumerate()
                            .map(|(i, p)| shaping.counter(dir, i, p))
                            .collect();
                        let p = measure(
                            &servers[..n],
                            &counters,
                            dir,
                            seconds,
                            ticks,
                            idle_per_s,
                            agent.pid(),
                        );
                        eprintln!(
                            "round {round} {rate} x{n} {dir} {}: {:.2} Gbit/s, {:.3} CPU s/GB ({:.3} above idle), {:.3} softirq s/GB, agent {:.3} s/GB",
                            variant.label(&mechanism),
                            p.gbps(),
                            p.cpu_per_gb(),
                            p.above_idle_per_gb(),
                            p.softirq_per_gb(),
                            p.agent_per_gb()
                        );
                        points.entry((ri, ni, di, variant)).or_default().push(p);
                    }
                    shaping.release();
                }
            }
        }
    }
    drop(servers);
    drop(pods);

    println!("### CPU and softirq per shaped GB\n");
    println!(
        "Shaper `{mechanism}` (the kernel probe's pick); {rounds} round(s) of {seconds} s windows, \
         medians; {ticks} jiffies/s; load before the run: {load}; with nothing sending the \
         machine was busy {:.3} CPU s a second (median of the rounds).\n",
        net::median(&idle)
    );
    println!(
        "| rate a pod | pods | direction | shaping | delivered Gbit/s | of limits | CPU s/GB | above idle | softirq s/GB | agent s/GB | CPU vs tbf | above idle vs tbf | softirq vs tbf |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let med = |v: &[Point], f: fn(&Point) -> f64| net::median(&v.iter().map(f).collect::<Vec<_>>());
    for (ri, rate) in rates.iter().enumerate() {
        for (ni, &n) in counts.iter().enumerate() {
            for (di, &dir) in dirs.iter().enumerate() {
                // Without tbf in the run, the ratios to it are NaN and print as such.
                let tbf = points
                    .get(&(ri, ni, di, Variant::Tbf))
                    .map_or(&[][..], Vec::as_slice);
                let (tbf_cpu, tbf_above, tbf_soft) = (
                    med(tbf, Point::cpu_per_gb),
                    med(tbf, Point::above_idle_per_gb),
                    med(tbf, Point::softirq_per_gb),
                );
                for &variant in &variants {
                    let v = &points[&(ri, ni, di, variant)];
                    let gbps = med(v, Point::gbps);
                    let (cpu, above, soft, own) = (
                        med(v, Point::cpu_per_gb),
                        med(v, Point::above_idle_per_gb),
                        med(v, Point::softirq_per_gb),
                        med(v, Point::agent_per_gb),
                    );
                    let of_limits = match variant {
                        Variant::None => "-".to_owned(),
                        _ => format!(
                            "{:.2}",
                            gbps * 1e9 / (net::rate_bps(rate) as f64 * n as f64)
                        ),
                    };
                    println!(
                        "| {rate} | {n} | {dir} | {} | {gbps:.2} | {of_limits} | {cpu:.3} | {above:.3} | {soft:.3} | {own:.3} | {:.2} | {:.2} | {:.2} |",
                        variant.label(&mechanism),
                        cpu / tbf_cpu,
                        above / tbf_above,
                        soft / tbf_soft,
                    );
                }
            }
        }
    }
}
