//! Bandwidth, side by side in one run on the same kind of veth pair: shareguard's
//! mechanisms (the real agent, a net share: the one the kernel probe picks, and the BPF
//! policer fallback) vs `tbf` as the CNI bandwidth plugin sets it (rate, burst, 25 ms
//! latency) vs no limit. For each rate and direction: TCP goodput / limit, ping RTT
//! p50/p99 across the shaped direction while that flow saturates the limit, and the
//! sender's retransmits; two flows in one share and their Jain fairness index; what a new
//! flow, and 16 new flows together, get through in their first 100 ms, against the
//! limit's 100 ms plus 64 KiB; then a limit above what the veth carries against no limit,
//! both directions, five interleaved rounds, medians: shaped as configured without a line
//! rate, and on a device whose `line_rate` the limit exceeds (unconstrained). iperf3's two
//! ends run on one CPU (`net::Iperf::cpu`, which says why). Prints markdown tables for
//! docs/benchmarks.md; asserts nothing about speed.
//!
//! Run as root: `cargo build --release -p shareguard && cargo bench -p shareguard-tests
//! --bench bandwidth` (the agent binary is the one next to the bench: target/release).

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

use std::time::Duration;

use shareguard_tests::{
    Agent, net,
    net::{Direction, Iperf, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id, unprepare_one,
};

/// New flows at once, for the first 100 ms of a sender with many connections: as many as
/// the share has flow classes, so that most classes get one.
const MANY: u32 = 16;

const RATES: [(&str, u64); 3] = [
    ("50M", 50_000_000),
    ("200M", 200_000_000),
    ("2G", 2_000_000_000),
];

struct Row {
    rate: &'static str,
    direction: Direction,
    mechanism: String,
    goodput: f64,
    ratio: f64,
    rtt_p50: f64,
    rtt_p99: f64,
    retransmits: u64,
}

/// Runs a saturating flow in `dir` and pings across it meanwhile: from the host to the
/// pod for traffic to the pod, from the pod to the host for traffic from it, so that the
/// ping's request waits in the shaped direction's queue.
fn measure_under_load(
    server: &net::IperfServer,
    pod: &Pod,
    dir: Direction,
) -> (net::Measurement, Vec<f64>) {
    std::thread::scope(|s| {
        let flow = s.spawn(|| server.measure(&Iperf::new(dir)));
        // Start pinging once the warm-up second is over, for 4 s of the 5 measured.
        std::thread::sleep(Duration::from_millis(1200));
        let rtts = match dir {
            Direction::ToPod => net::ping_rtt(pod, 200, Duration::from_millis(20)),
            Direction::FromPod => net::ping_rtt_from_pod(pod, 200, Duration::from_millis(20)),
        };
        (flow.join().unwrap(), rtts)
    })
}

/// The device the kernel probe picks a mechanism for, one pinned to the policer, and one
/// like the first that states its line rate (above what a veth carries here).
const AUTO: &str = "nic-auto";
const POLICER: &str = "nic-police";
const LINE_RATE: &str = "nic-line";
/// `line_rate` of [`LINE_RATE`]: unlimited veth throughput is 10 to 19.5 Gbit/s here.
const VETH_LINE_RATE: &str = "25G";
/// Interleaved rounds above line rate: unlimited veth throughput moves by 10 to 20%
/// between runs on this machine, more than what is measured, so the median takes five.
const HIGH_ROUNDS: u32 = 5;

fn net_agent(pins: &PinDir) -> Agent {
    let dev = |name: &str, mechanism: &str, extra: &str| {
        let lines = format!(
            "mechanism = \"{mechanism}\"\n{extra}{}",
            net::bandwidth_capacity("100G")
        );
        net::net_device(name, &lines)
    };
    let devices = [
        dev(AUTO, "auto", ""),
        dev(POLICER, "bpf-policer", ""),
        dev(
            LINE_RATE,
            "auto",
            &format!("line_rate = \"{VETH_LINE_RATE}\"\n"),
        ),
    ];
    net::start_agent(devices.concat(), pins, "")
}

fn share(pod: &Pod, device: &str, uid: &str, rate: &str) -> pb::ClaimPrepare {
    net::bw_claim(uid, "bench", device, pod, &share_id(), rate)
}

fn main() {
    if !net::privileged("bandwidth bench") {
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pins = PinDir::new();
    let agent = net_agent(&pins);
    let mut client = rt.block_on(agent.client());
    let pod = Pod::new();
    let server = pod.iperf_server();
    let _lock = TrafficLock::acquire();
    let auto = rt
        .block_on(shareguard_tests::device(&mut client, AUTO))
        .mechanisms[0]
        .clone();
    let mut rows = Vec::new();
    let mut fairness = Vec::new();
    for (rate, bps) in RATES {
        for dir in [Direction::ToPod, Direction::FromPod] {
            let row = |mechanism: &str, m: &net::Measurement, rtts: &[f64]| Row {
                rate,
                direction: dir,
                mechanism: mechanism.to_owned(),
                goodput: m.bits_per_second / 1e6,
                ratio: m.bits_per_second / bps as f64,
                rtt_p50: net::percentile(rtts, 50.0),
                rtt_p99: net::percentile(rtts, 99.0),
                retransmits: m.retransmits,
            };
            {
                let (m, rtts) = measure_under_load(&server, &pod, dir);
                rows.push(row("no limit", &m, &rtts));
            }
            {
                // The plugin's burst comes from the runtime (containerd passes 512 MiB,
                // which leaves the first seconds unshaped); 10 ms at the rate, the same as
                // shareguard's HTB, keeps the comparison about steady state.
                let burst = (bps / 8 / 100).max(2 * 1514);
                let (m, rtts) = match dir {
                    Direction::ToPod => {
                        let _tbf = net::tbf_to_pod(&pod, bps, burst);
                        measure_under_load(&server, &pod, dir)
                    }
                    Direction::FromPod => {
                        let _tbf = net::tbf_from_pod(&pod, bps, burst);
                        measure_under_load(&server, &pod, dir)
                    }
                };
                rows.push(row("tbf (CNI plugin, 25 ms)", &m, &rtts));
            }
            for (device, name) in [(AUTO, auto.as_str()), (POLICER, "bpf-policer")] {
                let uid = format!("bench-{device}-{}-{dir}", rate.to_lowercase());
                let r = rt.block_on(prepare_one(&mut client, 0, share(&pod, device, &uid, rate)));
                assert_eq!(r.error, None, "{r:?}");
                assert_eq!(r.shares[0].mechanism, name);
                let (m, rtts) = measure_under_load(&server, &pod, dir);
                rows.push(row(&format!("shareguard {name}"), &m, &rtts));
                if dir == Direction::ToPod && device == AUTO {
                    fairness.push((
                        rate,
                        format!("shareguard {name}"),
                        net::two_flows(&server, Direction::ToPod, bps),
                    ));
                }
                assert_eq!(rt.block_on(unprepare_one(&mut client, 0, &uid)).code, "");
            }
            if dir == Direction::ToPod {
                let burst = (bps / 8 / 100).max(2 * 1514);
                let _tbf = net::tbf_to_pod(&pod, bps, burst);
                fairness.push((
                    rate,
                    "tbf (CNI plugin, 25 ms)".to_owned(),
                    net::two_flows(&server, Direction::ToPod, bps),
                ));
            }
        }
    }
    // The first 100 ms of a new flow: the CNI plugin's tbf with the burst containerd hands
    // it (512 MiB) lets everything through until the bucket drains (kubernetes#90838).
    let mut first = Vec::new();
    for (rate, bps) in RATES {
        {
            let _tbf = net::tbf_to_pod(&pod, bps, 512 << 20);
            first.push((
                rate,
                "tbf (CNI plugin, 512 MiB burst)".to_owned(),
                net::first_100ms(&server, Direction::ToPod, 1, bps),
            ));
        }
        {
            let _tbf = net::tbf_to_pod(&pod, bps, (bps / 8 / 100).max(2 * 1514));
            first.push((
                rate,
                "tbf (10 ms burst)".to_owned(),
                net::first_100ms(&server, Direction::ToPod, 1, bps),
            ));
            first.push((
                rate,
                format!("tbf (10 ms burst), {MANY} flows"),
                net::first_100ms(&server, Direction::ToPod, MANY, bps),
            ));
        }
        for (device, name) in [(AUTO, auto.as_str()), (POLICER, "bpf-policer")] {
            let uid = format!("bench-first-{device}-{}", rate.to_lowercase());
            let r = rt.block_on(prepare_one(&mut client, 0, share(&pod, device, &uid, rate)));
            assert_eq!(r.error, None, "{r:?}");
            first.push((
                rate,
                format!("shareguard {name}"),
                net::first_100ms(&server, Direction::ToPod, 1, bps),
            ));
            if device == AUTO {
                first.push((
                    rate,
                    format!("shareguard {name}, {MANY} flows"),
                    net::first_100ms(&server, Direction::ToPod, MANY, bps),
                ));
            }
            assert_eq!(rt.block_on(unprepare_one(&mut client, 0, &uid)).code, "");
        }
    }

    // A limit far above what the veth carries must cost (almost) nothing. Interleaved
    // rounds, so that a change of load on the machine hits every variant alike; both
    // directions in each.
    let mut high: [Vec<f64>; 4] = Default::default();
    let mut high_from: [Vec<f64>; 4] = Default::default();
    let mut line_mechanism = String::new();
    for round in 0..HIGH_ROUNDS {
        high[0].push(
            server
                .measure(&Iperf::new(Direction::ToPod))
                .bits_per_second,
        );
        high_from[0].push(
            server
                .measure(&Iperf::new(Direction::FromPod))
                .bits_per_second,
        );
        for (i, device) in [(1, AUTO), (2, POLICER), (3, LINE_RATE)] {
            let uid = format!("bench-high-{device}-{round}");
            let r = rt.block_on(prepare_one(
                &mut client,
                0,
                share(&pod, device, &uid, "100G"),
            ));
            assert_eq!(r.error, None, "{r:?}");
            if device == LINE_RATE {
                line_mechanism.clone_from(&r.shares[0].mechanism);
            }
            high_from[i].push(
                server
                    .measure(&Iperf::new(Direction::FromPod))
                    .bits_per_second,
            );
            high[i].push(
                server
                    .measure(&Iperf::new(Direction::ToPod))
                    .bits_per_second,
            );
            assert_eq!(rt.block_on(unprepare_one(&mut client, 0, &uid)).code, "");
        }
    }

    println!(
        "| limit | direction | mechanism | goodput Mbit/s | goodput / limit | ping RTT p50 ms | p99 ms | retransmits |"
    );
    println!("|---:|---|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let ratio = if r.mechanism == "no limit" {
            "-".to_owned()
        } else {
            format!("{:.3}", r.ratio)
        };
        println!(
            "| {} | {} | {} | {:.1} | {} | {:.3} | {:.3} | {} |",
            r.rate, r.direction, r.mechanism, r.goodput, ratio, r.rtt_p50, r.rtt_p99, r.retransmits
        );
    }
    println!();
    println!("| limit | two flows to the pod | goodput / limit | Jain index |");
    println!("|---:|---|---:|---:|");
    for (rate, name, (ratio, jain)) in &fairness {
        println!("| {rate} | {name} | {ratio:.3} | {jain:.3} |");
    }
    println!();
    println!(
        "| limit | new flows to the pod | first 100 ms, KB | limit x 100 ms + 64 KiB, KB | ratio |"
    );
    println!("|---:|---|---:|---:|---:|");
    for (rate, name, (bytes, allowed)) in &first {
        println!(
            "| {rate} | {name} | {:.0} | {:.0} | {:.2} |",
            bytes / 1e3,
            allowed / 1e3,
            bytes / allowed
        );
    }
    println!();
    println!(
        "| 100G share on the veth | to the pod, median Mbit/s ({HIGH_ROUNDS} rounds) | / no limit | from the pod | / no limit |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (i, name) in [
        "no limit".to_owned(),
        format!("shareguard {auto}"),
        "shareguard bpf-policer".to_owned(),
        format!("shareguard, line_rate {VETH_LINE_RATE}: {line_mechanism}"),
    ]
    .iter()
    .enumerate()
    {
        println!(
            "| {name} | {:.0} | {:.3} | {:.0} | {:.3} |",
            net::median(&high[i]) / 1e6,
            net::median(&high[i]) / net::median(&high[0]),
            net::median(&high_from[i]) / 1e6,
            net::median(&high_from[i]) / net::median(&high_from[0]),
        );
    }
    // The agent goes first, then its pins (and with them every link it attached).
    drop(agent);
    drop(pins);
}
