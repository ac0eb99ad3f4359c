//! A sparse flow beside a bulk flow in a small share: does it still go first? The share's
//! priority class (`1:11`, docs/architecture.md, Bandwidth) sends a sparse flow at once
//! while the flow stays within the class's assured rate; beyond it the class borrows from
//! the share's class, which the bulk flow keeps empty and in debt for whole GSO packets,
//! so the sparse flow waits. A sparse flow may send up to its credit's refill rate (about
//! 1 Mbit/s) and stay sparse; in a share under about 16 Mbit/s a sixteenth of the rate
//! is less than that.
//!
//! Per rate and direction: one share, one unpaced TCP bulk flow (iperf3) and beside it a
//! sparse flow of 1000-byte pings every 20 ms (about 0.42 Mbit/s on the wire) whose
//! requests cross the shaped direction; the pings' RTT p50/p99 and losses, the bulk
//! flow's goodput against the limit, and the priority class's rate as the kernel holds it.
//! `SMALL_ROUNDS` rounds (default 3), medians. Prints markdown for docs/benchmarks.md;
//! asserts nothing about speed. To compare two agents, run it with `SHAREGUARD_BIN` set to
//! each in turn.
//!
//! Run as root: `cargo build --release -p shareguard && cargo bench -p shareguard-tests
//! --bench small_shares`. `SMALL_RATES` (default `2M,5M,10M,20M`) picks the rates.

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

use std::time::Duration;

use shareguard_tests::{
    env_list, net,
    net::{Direction, Iperf, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id, unprepare_one, wait_phase,
};

const DEVICE: &str = "nic-small";
/// ICMP data of each ping: 1042 bytes on the wire, 50 a second.
const PAYLOAD: u32 = 1000;
const EVERY: Duration = Duration::from_millis(20);
/// Pings over 4 s of the bulk flow's 5 measured.
const PINGS: u32 = 200;

/// The priority class's rate on `dev` as tc prints it (`rate 1048Kbit`).
fn priority_rate(dev: &str) -> String {
    let classes = net::tc_classes(dev);
    classes
        .lines()
        .find(|l| l.contains("htb 1:11 "))
        .and_then(|l| {
            let mut w = l.split_whitespace();
            w.find(|x| *x == "rate").and_then(|_| w.next())
        })
        .unwrap_or_else(|| panic!("no priority class 1:11 on {dev}: {classes}"))
        .to_owned()
}

struct Row {
    rate: String,
    dir: Direction,
    class_rate: String,
    goodput: f64,
    p50: f64,
    p99: f64,
    lost: u32,
}

fn main() {
    if !net::privileged("small shares bench") {
        return;
    }
    let rates = env_list("SMALL_RATES", "2M,5M,10M,20M");
    let rounds: u32 = std::env::var("SMALL_ROUNDS")
        .ok()
        .map_or(3, |v| v.parse().expect("SMALL_ROUNDS: a count"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pins = PinDir::new();
    let agent = net::start_agent(
        net::net_device(
            DEVICE,
            "mechanism = \"auto\"\n[device.capacity.bandwidth]\nvalue = \"1G\"\n\
             default = \"1M\"\nvalid_range = { min = \"1M\", max = \"1G\", step = \"1M\" }\n",
        ),
        &pins,
        "",
    );
    let mut client = rt.block_on(agent.client());
    let pod = Pod::new();
    let server = pod.iperf_server();
    let _lock = TrafficLock::acquire();
    let load = net::LoadAvg::now();
    let mut rows: Vec<Row> = Vec::new();
    for _ in 0..rounds {
        for rate in &rates {
            let uid = format!("small-{}", share_id());
            let id = share_id();
            let claim = net::bw_claim(&uid, "bench", DEVICE, &pod, &id, rate);
            let r = rt.block_on(prepare_one(&mut client, 0, claim));
            assert_eq!(r.error, None, "{r:?}");
            let s = rt.block_on(wait_phase(&mut client, &id, pb::Phase::Enforced));
            assert_eq!(s.limits[0].enforced, *rate, "read back: {s:?}");
            let class_rate = priority_rate(pod.host_if());
            for dir in [Direction::ToPod, Direction::FromPod] {
                let (m, rtts) = std::thread::scope(|sc| {
                    let flow = sc.spawn(|| server.measure(&Iperf::new(dir)));
                    // After the bulk flow's warm-up second, within its measured ones.
                    std::thread::sleep(Duration::from_millis(1200));
                    let rtts =
                        net::ping_rtt_sized(&pod, dir == Direction::FromPod, PINGS, EVERY, PAYLOAD);
                    (flow.join().unwrap(), rtts)
                });
                eprintln!(
                    "{rate} {dir}: {m}; pings p99 {:.2} ms, {} of {PINGS} back",
                    net::percentile(&rtts, 99.0),
                    rtts.len()
                );
                rows.push(Row {
                    rate: rate.clone(),
                    dir,
                    class_rate: class_rate.clone(),
                    goodput: m.bits_per_second / net::rate_bps(rate) as f64,
                    p50: net::percentile(&rtts, 50.0),
                    p99: net::percentile(&rtts, 99.0),
                    lost: PINGS - rtts.len() as u32,
                });
            }
            assert_eq!(rt.block_on(unprepare_one(&mut client, 0, &uid)).code, "");
        }
    }

    println!("### A sparse flow beside a bulk flow in a small share\n");
    println!(
        "Agent `{}`; {rounds} round(s), medians (lost: the sum); sparse flow: {PAYLOAD}-byte \
         pings every {EVERY:?}; load before the run: {load}.\n",
        shareguard_tests::agent_bin().display()
    );
    println!(
        "| share | direction | priority class rate (kernel) | bulk goodput / limit | sparse RTT p50 ms | sparse RTT p99 ms | pings lost |"
    );
    println!("|---|---|---|---|---|---|---|");
    for rate in &rates {
        for dir in [Direction::ToPod, Direction::FromPod] {
            let of: Vec<&Row> = rows
                .iter()
                .filter(|r| r.rate == *rate && r.dir == dir)
                .collect();
            let med =
                |f: fn(&Row) -> f64| net::median(&of.iter().map(|r| f(r)).collect::<Vec<_>>());
            println!(
                "| {rate} | {dir} | {} | {:.3} | {:.2} | {:.2} | {} |",
                of[0].class_rate,
                med(|r| r.goodput),
                med(|r| r.p50),
                med(|r| r.p99),
                of.iter().map(|r| r.lost).sum::<u32>(),
            );
        }
    }
}
