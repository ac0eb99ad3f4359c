//! Many tenants on one NIC, each saturating its share: does a tenant stay within its limit,
//! and does a quiet tenant's latency stay where it was alone (the target row in docs/architecture.md:
//! "each within its limit; a quiet tenant's p99 moves < 10%")?
//!
//! The NIC ([`nic::Nic`]) is one veth pair to a "remote host" namespace, shaped to 1 Gbit/s
//! with a 10 ms FIFO in each direction, that every tenant pod's traffic is routed across:
//! without one shared bottleneck there is nothing to contend for, and pods that each talk
//! over their own veth only meet in the CPU. The agent's `net` device has the line rate as
//! its capacity and a request policy of 5M steps from 5M, so that 32 tenants fit: tenant
//! `i` takes 10 x the minimum (50M) when `i` is even and the minimum (5M) when odd; the
//! quiet tenant takes the minimum. With 32 tenants the shares add up to 885M.
//!
//! Each run, in each direction across the NIC: every active tenant's pod runs one TCP bulk
//! flow with no limit of its own (iperf3, the remote host at the other end; the offered
//! load is whatever TCP takes, always more than the tenant's share), and beside it a
//! sparse flow (ping every 10 ms from the pod to the remote host, over the measured
//! seconds after the warm-up). The quiet tenant's pod only pings: across the NIC, and at
//! the same time to its own host end, a path that meets the others only in the CPUs. Per
//! tenant: goodput against its limit, the sparse flow's RTT p99, the bulk flow's
//! retransmits, the highest 1-second rate behind its shaper against the limit (interface
//! counters, [`sample`]); per run: the NIC queue's drops and highest sampled backlog, and
//! how busy the two CPUs were, whoever used them (iperf3's two ends of tenant `i` run on
//! CPU `i % 2`, see `net::Iperf::cpu`).
//!
//! Sequence, per direction: the quiet tenant alone; the NIC allocated whole (one share of
//! the full capacity) to one tenant, with the quiet pod, unshared, pinging beside it; each
//! size alone; then for N = 1, 2, 4, 8, 16, 32: the quiet tenant alone again (its share and
//! the N shares in place, nothing sending), N tenants with shares, and the same N tenants
//! with every share released, the NIC given whole to one tenant whose pods share it
//! unshaped (what sharing the NIC without shareguard looks like). Side by side in one run,
//! so that the machine's load hits every variant alike; the quiet tenant's change is
//! against the median of its alone runs.
//!
//! Prints markdown tables for docs/benchmarks.md and draws docs/isolation-goodput.png and
//! docs/isolation-rtt.png from the same figures ([`plot`]); asserts nothing about speed.
//!
//! Run as root: `cargo build --release -p shareguard && cargo bench -p shareguard-tests
//! --bench isolation` (the agent binary is the one next to the bench: target/release).
//! `ISOLATION_TENANTS` (default `1,2,4,8,16,32`), `ISOLATION_SECONDS` (measured seconds per
//! run, default 6), `ISOLATION_DIRECTIONS` (default `to-pod,from-pod`) and
//! `ISOLATION_PLOTS` (directory for the PNGs, default the repository's `docs/`) make a
//! smaller run. Two more change what is measured: `ISOLATION_OFFERED` (`saturate`, the
//! default, or a multiple of each tenant's share, e.g. `0.9`: its bulk flow is paced to
//! that rate, a fixed offered load, in the unshared runs too) and `ISOLATION_NIC` (the
//! NIC's line rate in bit/s, default the device's capacity, 1 Gbit/s; above it, the
//! capacity a node publishes is kept below what its wire carries).

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

mod nic;
mod plot;
mod report;
mod sample;

use std::{
    fs,
    path::PathBuf,
    time::{Duration, Instant},
};

use shareguard_tests::{
    Agent, Client, env_or, net,
    net::{Direction, Iperf, IperfServer, LoadAvg, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id, unprepare_one, wait_phase,
};

use crate::nic::Nic;

const DEVICE: &str = "nic-shared";
/// The net device's `bandwidth` capacity, and by default the NIC's line rate: what the
/// shares of the device add up to at most is what the wire carries. 1 Gbit/s keeps 32
/// tenants' traffic (forwarded, shaped twice) within what two cores route.
const CAPACITY_BPS: u64 = 1_000_000_000;
/// [`CAPACITY_BPS`] as a quantity, written as the agent writes it back.
const CAPACITY: &str = "1G";
/// The request policy's minimum (and step), bit/s and as the quantity a claim carries.
const MIN_BPS: u64 = 5_000_000;
const MIN: &str = "5M";
/// Ten times the minimum.
const TEN_BPS: u64 = 50_000_000;
const TEN: &str = "50M";
/// The sparse flow: one ping every 10 ms, for one second less than the measured seconds
/// (at most 500 samples in a 6 s run, its p99 then the 5th highest; a busy machine
/// stretches ping's intervals, and the window, not the count, ends it).
const PING_EVERY: Duration = Duration::from_millis(10);
/// iperf3's warm-up before the measured seconds; the pings start half a second after it,
/// when 32 clients started side by side on two cores are all past their connect.
const OMIT_S: u32 = 1;
const PING_DELAY: Duration = Duration::from_millis(1500);

/// One tenant: its pod (own namespace, veth, sandbox), an iperf3 server there, its size.
struct Tenant {
    server: IperfServer,
    pod: Pod,
    ten: bool,
}

impl Tenant {
    fn rate(&self) -> (&'static str, u64) {
        if self.ten {
            (TEN, TEN_BPS)
        } else {
            (MIN, MIN_BPS)
        }
    }
}

/// What each tenant's bulk flow offers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Offered {
    /// Whatever TCP takes: always more than a share.
    Saturate,
    /// This multiple of the tenant's share, paced by the sender.
    Paced(f64),
}

impl Offered {
    fn parse(v: &str) -> Offered {
        if v == "saturate" {
            return Offered::Saturate;
        }
        match v.parse::<f64>() {
            Ok(f) if f > 0.0 && f.is_finite() => Offered::Paced(f),
            _ => panic!("ISOLATION_OFFERED={v:?}: `saturate` or a positive multiple of the share"),
        }
    }

    /// The pacing rate for a tenant whose share is (or would be) `share_bps`.
    fn pace(self, share_bps: u64) -> Option<u64> {
        match self {
            Offered::Saturate => None,
            Offered::Paced(f) => Some((share_bps as f64 * f).round() as u64),
        }
    }
}

/// What a whole bench run varies: the offered load and the NIC's line rate.
#[derive(Clone, Copy, Debug)]
pub struct Variant {
    pub offered: Offered,
    pub nic_bps: u64,
}

impl Variant {
    /// The plots' file name suffix: none for the default (saturating, line rate =
    /// capacity), whose plots docs/benchmarks.md shows first.
    pub fn suffix(&self) -> String {
        let mut s = String::new();
        if let Offered::Paced(f) = self.offered {
            s.push_str(&format!("-paced-{f}"));
        }
        if self.nic_bps != CAPACITY_BPS {
            s.push_str(&format!("-nic-{}M", self.nic_bps / 1_000_000));
        }
        s
    }

    /// What the tenants do, for a plot's words.
    pub fn load(&self) -> String {
        match self.offered {
            Offered::Saturate => "saturating their shares".to_owned(),
            Offered::Paced(f) => format!("offering {f} x their share"),
        }
    }

    /// The NIC's line rate, for a plot's words.
    pub fn nic(&self) -> String {
        format!("{} Mbit/s", self.nic_bps / 1_000_000)
    }
}

/// What a run allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// Each tenant its share, the quiet tenant too.
    Shares,
    /// No share: the NIC given whole to one tenant whose pods share it.
    WholeNic,
}

/// A tenant in a run: which one, its share's rate and id (none without a share), and the
/// rate its bulk flow is paced to (none: as fast as TCP goes).
#[derive(Clone, Debug)]
struct Active {
    i: usize,
    limit_bps: Option<u64>,
    share_id: Option<String>,
    pace_bps: Option<u64>,
}

/// One tenant's bulk flow and sparse flow in a run.
pub struct Flow {
    pub tenant: usize,
    /// Its share, bit/s; `None` when it has none.
    pub limit_bps: Option<u64>,
    pub ten: bool,
    pub m: net::Measurement,
    pub rtts: Vec<f64>,
    /// The highest rate behind the shaper over any 1 s of the measured seconds, L2 bit/s
    /// (the unit of the limit), from the interface counters ([`sample`]).
    pub peak_bps: f64,
    /// The mean over the same samples, L2 bit/s.
    pub wire_bps: f64,
}

/// One run: who sent what, the quiet tenant's pings beside it, the NIC's drops, the CPUs.
pub struct Run {
    pub dir: Direction,
    pub label: String,
    /// Active tenants (0 for the quiet tenant alone).
    pub n: usize,
    pub setup: Setup,
    pub flows: Vec<Flow>,
    pub quiet: Vec<f64>,
    /// Pings the quiet tenant sent.
    pub quiet_sent: u32,
    /// The quiet tenant's pings to its own host end at the same time: a path that crosses
    /// no NIC and no share's queue, only the host's CPUs.
    pub quiet_local: Vec<f64>,
    /// The NIC queue's backlog in the run's direction, bytes, every 100 ms.
    pub nic_backlog: Vec<u64>,
    pub nic_drops: u64,
    /// Busy share of all CPUs over the run, 0..1.
    pub cpu_busy: f64,
    pub load: LoadAvg,
}

fn config() -> String {
    let (min, line) = (MIN, CAPACITY);
    net::net_device(
        DEVICE,
        &format!(
            "mechanism = \"auto\"\n[device.capacity.bandwidth]\nvalue = \"{line}\"\n\
             default = \"{min}\"\nvalid_range = {{ min = \"{min}\", max = \"{line}\", step = \"{min}\" }}\n"
        ),
    )
}

/// Claims on one agent, released by [`Claims::release`] or at drop (also on panic), so
/// that capacity held by one run never leaks into the next.
struct Claims<'a> {
    rt: &'a tokio::runtime::Runtime,
    client: &'a mut Client,
    uids: Vec<String>,
}

impl<'a> Claims<'a> {
    fn new(rt: &'a tokio::runtime::Runtime, client: &'a mut Client) -> Self {
        Claims {
            rt,
            client,
            uids: Vec::new(),
        }
    }

    /// Prepares a share of `rate` for `pod` and waits until the agent reads it back from
    /// the kernel (ENFORCED).
    fn add(&mut self, pod: &Pod, rate: &str) -> pb::ShareStatus {
        let uid = format!("iso-{}", share_id());
        let id = share_id();
        let namespace = format!("tenant-{}", &pod.uid()[..8]);
        let claim = net::bw_claim(&uid, &namespace, DEVICE, pod, &id, rate);
        let r = self.rt.block_on(prepare_one(self.client, 0, claim));
        assert_eq!(r.error, None, "{r:?}");
        self.uids.push(uid);
        let s = self
            .rt
            .block_on(wait_phase(self.client, &id, pb::Phase::Enforced));
        assert_eq!(s.limits[0].enforced, rate, "read back: {s:?}");
        s
    }

    fn release(&mut self) {
        for uid in self.uids.drain(..) {
            let e = self.rt.block_on(unprepare_one(self.client, 0, &uid));
            assert_eq!(e.code, "", "unprepare {uid}: {e:?}");
        }
    }
}

impl Drop for Claims<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.release();
            return;
        }
        shareguard_tests::release_quietly(self.rt, self.client, std::mem::take(&mut self.uids));
    }
}

/// Runs the bulk flows of `active` in `dir` with a sparse flow beside each, the quiet
/// pod's pings (across the NIC, and to its own host end), and the counter samples;
/// `seconds` measured after the warm-up.
#[allow(clippy::too_many_arguments)] // One call site per kind of run; a struct would only rename them.
fn run(
    nic: &Nic,
    tenants: &[Tenant],
    quiet: &Pod,
    active: &[Active],
    dir: Direction,
    seconds: u32,
    label: &str,
    setup: Setup,
) -> Run {
    let window = Duration::from_secs(u64::from(seconds - 1));
    let counters: Vec<String> = active
        .iter()
        .map(|a| {
            net::shaped_bytes_counter(dir, tenants[a.i].pod.host_if(), a.share_id.as_deref(), None)
        })
        .collect();
    // Samples over the measured seconds, less the last 0.3 s in which the clients end.
    let (from, until) = if active.is_empty() {
        (Duration::ZERO, window)
    } else {
        (
            Duration::from_secs(u64::from(OMIT_S)),
            Duration::from_secs(u64::from(OMIT_S + seconds)) - Duration::from_millis(300),
        )
    };
    // The quiet tenant alone pings at once; beside bulk flows, once they are past warm-up.
    let delay = if active.is_empty() {
        Duration::ZERO
    } else {
        PING_DELAY
    };
    let drops = nic.drops(dir);
    let cpu = net::CpuJiffies::now();
    let t0 = Instant::now();
    let (flows, quiet_rtts, quiet_local, samples) = std::thread::scope(|s| {
        let bulk: Vec<_> = active
            .iter()
            .map(|a| {
                let run = Iperf {
                    seconds,
                    omit: OMIT_S,
                    cpu: Some(a.i as u32 % 2),
                    pace_bps: a.pace_bps,
                    ..Iperf::new(dir)
                };
                s.spawn(move || tenants[a.i].server.measure_from(nic.netns(), &run))
            })
            .collect();
        let ping = move |ns: &'_ Pod, to: std::net::Ipv4Addr| {
            std::thread::sleep(delay);
            net::ping_for(ns.netns(), to, PING_EVERY, window)
        };
        let sparse: Vec<_> = active
            .iter()
            .map(|a| s.spawn(move || ping(&tenants[a.i].pod, nic.addr()).rtts))
            .collect();
        let q = s.spawn(move || ping(quiet, nic.addr()));
        let local = s.spawn(move || ping(quiet, quiet.host_addr()).rtts);
        let counters = &counters;
        let sampler = s.spawn(move || sample::sample(nic, dir, counters, t0, from, until));
        let samples = sampler.join().unwrap();
        let flows: Vec<Flow> = bulk
            .into_iter()
            .zip(sparse)
            .zip(active)
            .zip(&samples.bytes)
            .map(|(((b, p), a), bytes)| Flow {
                tenant: a.i,
                limit_bps: a.limit_bps,
                ten: tenants[a.i].ten,
                m: b.join().unwrap(),
                rtts: p.join().unwrap(),
                peak_bps: sample::peak_1s(bytes),
                wire_bps: sample::mean(bytes),
            })
            .collect();
        (flows, q.join().unwrap(), local.join().unwrap(), samples)
    });
    let cpu1 = net::CpuJiffies::now();
    let r = Run {
        dir,
        label: label.to_owned(),
        n: active.len(),
        setup,
        flows,
        quiet: quiet_rtts.rtts,
        quiet_sent: quiet_rtts.sent,
        quiet_local,
        nic_backlog: samples.backlog,
        nic_drops: nic.drops(dir) - drops,
        cpu_busy: (cpu1.busy - cpu.busy) as f64 / (cpu1.all - cpu.all).max(1) as f64,
        load: LoadAvg::now(),
    };
    eprintln!(
        "{dir} {label}: {} tenants, quiet p99 {:.3} ms (to its host end {:.3}), CPU {:.0}%, {:.1} s",
        r.n,
        net::percentile(&r.quiet, 99.0),
        net::percentile(&r.quiet_local, 99.0),
        r.cpu_busy * 100.0,
        t0.elapsed().as_secs_f64()
    );
    r
}

fn main() {
    if !net::privileged("isolation bench") {
        return;
    }
    let counts: Vec<usize> = env_or("ISOLATION_TENANTS", "1,2,4,8,16,32".to_owned())
        .split(',')
        .map(|n| n.trim().parse().expect("ISOLATION_TENANTS: numbers"))
        .collect();
    let seconds: u32 = env_or("ISOLATION_SECONDS", 6);
    assert!(seconds >= 2, "ISOLATION_SECONDS: at least 2");
    let dirs: Vec<Direction> = env_or("ISOLATION_DIRECTIONS", "to-pod,from-pod".to_owned())
        .split(',')
        .map(|d| match d.trim() {
            "to-pod" => Direction::ToPod,
            "from-pod" => Direction::FromPod,
            other => panic!("ISOLATION_DIRECTIONS: {other:?} is not to-pod or from-pod"),
        })
        .collect();
    let plots = std::env::var_os("ISOLATION_PLOTS").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs"),
        PathBuf::from,
    );
    let offered = Offered::parse(&env_or("ISOLATION_OFFERED", "saturate".to_owned()));
    let nic_bps: u64 = env_or("ISOLATION_NIC", CAPACITY_BPS);
    assert!(
        nic_bps >= CAPACITY_BPS,
        "ISOLATION_NIC: at least the device's capacity, {CAPACITY_BPS}"
    );
    let variant = Variant { offered, nic_bps };
    let max_n = counts.iter().copied().max().unwrap_or(1).max(2);
    let bench_start = Instant::now();
    let load_before = LoadAvg::now();

    let rt = tokio::runtime::Runtime::new().unwrap();
    let pins = PinDir::new();
    let agent: Agent = net::start_agent(config(), &pins, "");
    let mut client = rt.block_on(agent.client());
    let nic = Nic::new(nic_bps);
    let quiet = Pod::new();
    nic.attach(&quiet);
    let tenants: Vec<Tenant> = (0..max_n)
        .map(|i| {
            let pod = Pod::new();
            nic.attach(&pod);
            Tenant {
                server: pod.iperf_server(),
                pod,
                ten: i % 2 == 0,
            }
        })
        .collect();
    let mechanism = Claims::new(&rt, &mut client).add(&quiet, MIN).mechanism;
    eprintln!(
        "set up {} tenant pods and the NIC in {:.1} s; mechanism {mechanism}",
        tenants.len(),
        bench_start.elapsed().as_secs_f64()
    );

    let mut runs: Vec<Run> = Vec::new();
    for &dir in &dirs {
        // Per direction, so that other tests' measurements may run in between.
        let _lock = TrafficLock::acquire();
        let go = |active: &[Active], label: &str, setup: Setup| {
            run(&nic, &tenants, &quiet, active, dir, seconds, label, setup)
        };
        runs.push(go(&[], "quiet alone, no share", Setup::WholeNic));
        {
            let mut c = Claims::new(&rt, &mut client);
            let share = c.add(&tenants[0].pod, CAPACITY);
            runs.push(go(
                &[Active {
                    i: 0,
                    limit_bps: Some(CAPACITY_BPS),
                    share_id: Some(share.share_id),
                    pace_bps: offered.pace(CAPACITY_BPS),
                }],
                "NIC whole to one tenant (share = capacity)",
                Setup::WholeNic,
            ));
        }
        // Each size alone: tenant 0 is 10 x the minimum, tenant 1 the minimum.
        for i in [0, 1] {
            let mut c = Claims::new(&rt, &mut client);
            c.add(&quiet, MIN);
            let (rate, bps) = tenants[i].rate();
            let share = c.add(&tenants[i].pod, rate);
            let a = Active {
                i,
                limit_bps: Some(bps),
                share_id: Some(share.share_id),
                pace_bps: offered.pace(bps),
            };
            runs.push(go(&[a], &format!("alone at {rate}"), Setup::Shares));
        }
        for &n in &counts {
            let mut c = Claims::new(&rt, &mut client);
            c.add(&quiet, MIN);
            let active: Vec<Active> = (0..n)
                .map(|i| {
                    let (rate, bps) = tenants[i].rate();
                    let share = c.add(&tenants[i].pod, rate);
                    Active {
                        i,
                        limit_bps: Some(bps),
                        share_id: Some(share.share_id),
                        pace_bps: offered.pace(bps),
                    }
                })
                .collect();
            runs.push(go(&[], "quiet alone, shares in place", Setup::Shares));
            runs.push(go(&active, "shares", Setup::Shares));
            c.release();
            drop(c);
            let unshared: Vec<Active> = (0..n)
                .map(|i| Active {
                    i,
                    limit_bps: None,
                    share_id: None,
                    // The same load as with shares: what the tenant would have been given.
                    pace_bps: offered.pace(tenants[i].rate().1),
                })
                .collect();
            runs.push(go(&unshared, "whole NIC, no shares", Setup::WholeNic));
        }
    }
    let load_after = LoadAvg::now();
    let elapsed = bench_start.elapsed();

    report::print(&report::Context {
        runs: &runs,
        mechanism: &mechanism,
        seconds,
        variant,
        load_before,
        load_after,
        elapsed,
    });
    fs::create_dir_all(&plots).unwrap();
    for path in plot::draw(&runs, &plots, &variant) {
        eprintln!("wrote {}", path.display());
    }
    // Claims are released; the agent goes first, then its pins, the pods, the NIC.
    drop(client);
    drop(agent);
    drop(pins);
}
