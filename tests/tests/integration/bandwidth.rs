//! Bandwidth shares enforced for real: the agent (the real binary) limits a pod's traffic
//! in both directions, and iperf3 measures TCP goodput through network namespaces and a
//! veth pair. The limit is judged on what the receiver got over 5 s after a 1 s warm-up.
//!
//! Goodput can never reach the configured rate: HTB counts whole Ethernet frames, TCP
//! delivers 1448 payload bytes of each 1514, so a perfect shaper gives 0.956 of the
//! limit. The band, 0.93 to 0.97 (`net::GOODPUT_LOW`, `GOODPUT_HIGH`), leaves room for
//! that and for a noisy machine.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{fs, time::Duration};

use shareguard_limiter_net::tc;
use shareguard_tests::{
    Agent, changed_to, device, foreign, get_share,
    net::{self, Direction, Iperf, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id, unprepare_one, wait_phase,
};

const LOW: f64 = net::GOODPUT_LOW;
const HIGH: f64 = net::GOODPUT_HIGH;
/// The low end of the band while the agent is dead and an HTB share holds its idle
/// bucket.
const DEAD_LOW: f64 = 0.85;

fn start(capacity: &str) -> (Agent, PinDir) {
    start_with(net::net_device("nic-0", &net::bandwidth_capacity(capacity)))
}

/// An agent with a 10G device whose reconciler runs every `period`.
fn start_reconciling(period: &str) -> (Agent, PinDir) {
    let pins = PinDir::new();
    let devices = net::net_device("nic-0", &net::bandwidth_capacity("10G"));
    let a = net::start_agent(devices, &pins, &format!("reconcile_period = \"{period}\""));
    (a, pins)
}

fn start_with(devices: String) -> (Agent, PinDir) {
    let pins = PinDir::new();
    (net::start_agent(devices, &pins, ""), pins)
}

fn bw_claim(uid: &str, pod: &Pod, id: &str, rate: &str) -> pb::ClaimPrepare {
    net::bw_claim(uid, "team-a", "nic-0", pod, id, rate)
}

fn rate_bps(rate: &str) -> f64 {
    let (n, mult) = match rate.strip_suffix('G') {
        Some(n) => (n, 1e9),
        None => (rate.strip_suffix('M').unwrap(), 1e6),
    };
    n.parse::<f64>().unwrap() * mult
}

fn assert_within(m: &net::Measurement, limit_bps: f64, what: &str) {
    assert_within_band(m, limit_bps, LOW, HIGH, what);
}

/// As [`assert_within`] with its own bounds (a mechanism measured to get less, or more).
fn assert_within_band(m: &net::Measurement, limit_bps: f64, low: f64, high: f64, what: &str) {
    let ratio = m.bits_per_second / limit_bps;
    eprintln!("{what}: {m} -> {ratio:.3} of the limit");
    assert!(
        (low..=high).contains(&ratio),
        "{what}: measured {:.1} Mbit/s is {ratio:.3} of the {:.0} Mbit/s limit, outside {low}..={high}",
        m.bits_per_second / 1e6,
        limit_bps / 1e6
    );
}

/// The mechanism the agent picks on this kernel when the config leaves it to the probe.
fn auto_mechanism() -> &'static str {
    // Once per process: the probe uses a device named after the process id.
    static AUTO: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    AUTO.get_or_init(|| {
        shareguard_limiter_net::mechanism::auto(&shareguard_limiter_net::probe::probe().unwrap())
            .name()
    })
}

fn enforced_share(r: &pb::ClaimResult, rate: &str) -> pb::ShareStatus {
    enforced_share_by(r, rate, auto_mechanism())
}

fn enforced_share_by(r: &pb::ClaimResult, rate: &str, mechanism: &str) -> pb::ShareStatus {
    assert_eq!(r.error, None, "{r:?}");
    let s = r.shares[0].clone();
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.mechanism, mechanism);
    assert_eq!(s.limits[0].requested, rate);
    assert_eq!(
        s.limits[0].enforced, rate,
        "read back from the kernel: {s:?}"
    );
    s
}

#[tokio::test]
async fn limits_hold_in_both_directions_at_50m_500m_2g() {
    if !net::privileged("limits_hold_in_both_directions_at_50m_500m_2g") {
        return;
    }
    let (a, _pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    for (i, rate) in ["50M", "500M", "2G"].into_iter().enumerate() {
        let uid = format!("bw-{i}");
        let r = prepare_one(&mut c, 0, bw_claim(&uid, &pod, &share_id(), rate)).await;
        enforced_share(&r, rate);
        for dir in [Direction::ToPod, Direction::FromPod] {
            let _lock = TrafficLock::acquire();
            let m = server.measure(&Iperf::new(dir));
            assert_within(&m, rate_bps(rate), &format!("{rate} {dir}"));
        }
        assert_eq!(unprepare_one(&mut c, 0, &uid).await.code, "");
    }
}

#[tokio::test]
async fn two_pods_share_one_device_each_within_its_share() {
    if !net::privileged("two_pods_share_one_device_each_within_its_share") {
        return;
    }
    let (a, _pins) = start("500M");
    let (p1, p2) = (Pod::new(), Pod::new());
    let (s1, s2) = (p1.iperf_server(), p2.iperf_server());
    let mut c = a.client().await;
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("pod-a", &p1, &share_id(), "300M")).await,
        "300M",
    );
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("pod-b", &p2, &share_id(), "200M")).await,
        "200M",
    );
    // The device is full: a third share is refused by the ledger, not squeezed in.
    let p3 = Pod::new();
    let r = prepare_one(&mut c, 0, bw_claim("pod-c", &p3, &share_id(), "10M")).await;
    assert_eq!(r.error.unwrap().code, "ResourceExhausted");

    // Both pods receive at the same time, each as fast as TCP lets it.
    let _lock = TrafficLock::acquire();
    let (m1, m2) = s1.measure_with(&s2, &Iperf::new(Direction::ToPod));
    assert_within(&m1, 300e6, "pod a (300M) while pod b runs");
    assert_within(&m2, 200e6, "pod b (200M) while pod a runs");
    assert!(m1.bits_per_second + m2.bits_per_second <= 500e6 * HIGH);
    let d = device(&mut c, "nic-0").await;
    assert_eq!(d.allocated["bandwidth"], "500M");
}

#[tokio::test]
async fn limit_holds_while_the_agent_is_dead_and_after_it_is_back() {
    if !net::privileged("limit_holds_while_the_agent_is_dead_and_after_it_is_back") {
        return;
    }
    let (mut a, pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let id = share_id();
    let mut c = a.client().await;
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("k1", &pod, &id, "100M")).await,
        "100M",
    );
    a.kill9();
    {
        let _lock = TrafficLock::acquire();
        for dir in [Direction::ToPod, Direction::FromPod] {
            let m = server.measure(&Iperf::new(dir));
            // The share was idle when the agent died, so its class keeps the idle bucket
            // (limiter-net's `burst`) until the agent is back: never more than the
            // limit, but less room to make up for late dequeues. Measured 0.908 under
            // the full suite's load, 0.93 to 0.956 on a quiet machine.
            assert_within_band(&m, 100e6, DEAD_LOW, HIGH, &format!("agent dead, {dir}"));
        }
    }
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(
        s.phase,
        pb::Phase::Enforced as i32,
        "re-verified after restart: {s:?}"
    );
    // A repeated Prepare after the restart adopts the pinned links: still one per hook.
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("k1", &pod, &id, "100M")).await,
        "100M",
    );
    let links: Vec<_> = fs::read_dir(pins.0.join("net/links")).unwrap().collect();
    assert_eq!(
        links.len(),
        3,
        "one pinned link per direction and one on the return device, never two: {links:?}"
    );
    let _lock = TrafficLock::acquire();
    let m = server.measure(&Iperf::new(Direction::ToPod));
    assert_within(&m, 100e6, "agent back");

    // The eBPF counters kept counting through the restart, and are exported per share:
    // two to-pod runs of 6 s at about 100 Mbit/s went through the share.
    let bytes = |direction: &str, least: f64| {
        a.wait_metric(
            "shareguard_share_traffic_bytes_total",
            &[("share", &id), ("direction", direction)],
            |v| v > least,
        )
    };
    bytes("to_pod", 2.0 * 5.0 * 100e6 / 8.0 * 0.9);
    bytes("from_pod", 5.0 * 100e6 / 8.0 * 0.9);
}

#[tokio::test]
async fn release_lifts_the_limit_and_leaves_the_interface_as_found() {
    if !net::privileged("release_lifts_the_limit_and_leaves_the_interface_as_found") {
        return;
    }
    let (a, pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    let before = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    let id = share_id();
    let ifb = shareguard_limiter_net::state::queue_name(&id);
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("rel", &pod, &id, "100M")).await,
        "100M",
    );
    assert!(
        net::link_exists(&ifb),
        "the share's ifb {ifb} exists while enforced"
    );
    assert_eq!(unprepare_one(&mut c, 0, "rel").await.code, "");
    assert_eq!(
        net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]),
        before
    );
    let links = fs::read_dir(pins.0.join("net/links")).unwrap().count();
    assert_eq!(links, 0, "detach means unpin");
    assert!(!net::link_exists(&ifb), "the share's ifb {ifb} is gone");
    let _lock = TrafficLock::acquire();
    for dir in [Direction::ToPod, Direction::FromPod] {
        let m = server.measure(&Iperf::new(dir));
        eprintln!("released, {dir}: {m}");
        assert!(
            m.bits_per_second > 3.0 * 100e6,
            "after release {dir} should be far above the old 100M limit: {m}"
        );
    }
}

#[tokio::test]
async fn a_limit_at_or_above_the_line_rate_is_counted_not_shaped() {
    if !net::privileged("a_limit_at_or_above_the_line_rate_is_counted_not_shaped") {
        return;
    }
    let line = "line_rate = \"25G\"\n";
    let (a, pins) = start_with(net::net_device(
        "nic-0",
        &format!("{line}{}", net::bandwidth_capacity("100G")),
    ));
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    let before = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    let id = share_id();
    let r = prepare_one(&mut c, 0, bw_claim("free", &pod, &id, "40G")).await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.mechanism, "unconstrained", "{s:?}");
    assert_eq!(
        (
            s.limits[0].requested.as_str(),
            s.limits[0].enforced.as_str()
        ),
        ("40G", "25G"),
        "the bound that applies is the path's: {s:?}"
    );
    assert!(s.reason.contains("bandwidth unconstrained"), "{s:?}");
    // Nothing shapes it: the veth's root is as found, no ifb, yet both programs are
    // attached (pinned) and count.
    assert_eq!(
        net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]),
        before
    );
    let ifb = shareguard_limiter_net::state::queue_name(&id);
    assert!(
        !net::link_exists(&ifb),
        "no ifb {ifb} for an unconstrained share"
    );
    assert_eq!(fs::read_dir(pins.0.join("net/links")).unwrap().count(), 2);
    {
        let _lock = TrafficLock::acquire();
        let m = server.measure(&Iperf::new(Direction::ToPod));
        eprintln!("unconstrained 40G share, to-pod: {m}");
        // Far above any limit the tests shape to; what it keeps of unlimited
        // throughput is a benchmark figure (docs/benchmarks.md), not a test bound.
        assert!(m.bits_per_second > 2.0 * 2e9, "{m}");
        a.wait_metric(
            "shareguard_share_traffic_bytes_total",
            &[("share", &id), ("direction", "to_pod")],
            |v| v > m.bits_per_second * 5.0 / 8.0 * 0.9,
        );
    }
    assert_eq!(unprepare_one(&mut c, 0, "free").await.code, "");
    assert_eq!(fs::read_dir(pins.0.join("net/links")).unwrap().count(), 0);

    // Just below the line rate is shaped by the device's mechanism, read back as such.
    let r = prepare_one(&mut c, 0, bw_claim("below", &pod, &share_id(), "24G")).await;
    enforced_share(&r, "24G");
    assert_ne!(
        net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]),
        before,
        "a shaped share installs its qdisc"
    );
    assert_eq!(unprepare_one(&mut c, 0, "below").await.code, "");
}

#[tokio::test]
async fn many_new_flows_after_idle_get_the_limit_and_one_burst() {
    if !net::privileged("many_new_flows_after_idle_get_the_limit_and_one_burst") {
        return;
    }
    let (a, _pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    let r = prepare_one(&mut c, 0, bw_claim("burst", &pod, &share_id(), "200M")).await;
    enforced_share(&r, "200M");
    for dir in [Direction::ToPod, Direction::FromPod] {
        let _lock = TrafficLock::acquire();
        // Sixteen flows land in most of the share's classes. After an idle spell the
        // share's class holds 16 KiB and each class's own burst is one frame, so
        // together they stay within the bound (measured 0.86 to 0.98). With the full
        // bucket after idle they measured up to 1.05; with each class holding the
        // share's whole burst on its own, 1.19 to 1.76.
        let (bytes, allowed) = net::first_100ms(&server, dir, 16, 200_000_000);
        eprintln!(
            "{dir}: 16 new flows, {bytes:.0} bytes in the first 100 ms, {:.3} of {allowed:.0}",
            bytes / allowed
        );
        assert!(
            bytes <= allowed,
            "{dir}: 16 new flows sent {bytes:.0} bytes in their first 100 ms, allowed {allowed:.0}"
        );
        assert!(
            bytes > 0.3 * allowed,
            "{dir}: {bytes:.0} of {allowed:.0}: did they run?"
        );
    }
    assert_eq!(unprepare_one(&mut c, 0, "burst").await.code, "");
}

/// The bucket of the share's class on `ifindex`, bytes, as the kernel has it.
fn share_bucket(ifindex: u32) -> u64 {
    let classes = shareguard_limiter_net::rtnl::htb_classes(ifindex, tc::MAJOR).unwrap();
    classes
        .get(&tc::SHARE_MINOR)
        .unwrap_or_else(|| panic!("no share class on #{ifindex}: {classes:?}"))
        .burst
}

/// Whether `bucket` is `want` as tc and the kernel round it: down, tc to a whole
/// microsecond at the rate, the kernel to a 64 ns tick.
fn bucket_is(bucket: u64, want: u64, bytes_per_sec: u64) -> bool {
    let microsecond = shareguard_limiter_net::rtnl::bytes_in_ticks(bytes_per_sec, 16) + 1;
    bucket <= want && want - bucket <= microsecond
}

#[tokio::test]
async fn a_new_flow_after_idle_gets_the_limit_and_no_burst() {
    if !net::privileged("a_new_flow_after_idle_gets_the_limit_and_no_burst") {
        return;
    }
    let (a, _pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(&mut c, 0, bw_claim("idle", &pod, &id, "2G")).await;
    enforced_share(&r, "2G");
    // HTB's buckets follow the share's use of its rate; EDT has none to follow, and the
    // bound holds for it all the same.
    let htb = auto_mechanism() == "htb-ebpf";
    let p = tc::HtbParams::for_rate(2_000_000_000);
    let bytes_per_sec = 250_000_000;
    let veth = pod.host_ifindex();
    // The share's class on the veth (to the pod) and on its ifb (from the pod).
    let queues = if htb {
        vec![
            veth,
            net::ifindex(&shareguard_limiter_net::state::queue_name(&id)),
        ]
    } else {
        Vec::new()
    };
    let idle = || {
        queues
            .iter()
            .all(|&i| bucket_is(share_bucket(i), p.idle_burst_bytes(), bytes_per_sec))
    };
    for dir in [Direction::ToPod, Direction::FromPod] {
        let _lock = TrafficLock::acquire();
        net::wait_for(
            "the idle share's classes to hold the idle bucket",
            Duration::from_secs(5),
            idle,
        );
        // The full bucket, 10 ms of the rate, would let 1.03 to 1.05 of this through.
        let (bytes, allowed) = net::first_100ms(&server, dir, 1, 2_000_000_000);
        eprintln!(
            "{dir}: {bytes:.0} bytes in the first 100 ms, {:.3} of {allowed:.0}",
            bytes / allowed
        );
        assert!(
            bytes <= allowed,
            "{dir}: a new flow sent {bytes:.0} bytes in its first 100 ms, allowed {allowed:.0}"
        );
        // With the idle bucket until the flow uses its rate, the first 100 ms carry
        // 0.45 to 0.95 of the limit's: a new flow waits rather than bursts.
        assert!(
            bytes > 0.2 * allowed,
            "{dir}: {bytes:.0} of {allowed:.0}: did it run?"
        );
    }
    if htb {
        // While a flow uses the rate, the class has its full bucket back, and once the
        // flow ends, the idle one again.
        let _lock = TrafficLock::acquire();
        std::thread::scope(|s| {
            let flow = s.spawn(|| {
                server.measure(&Iperf {
                    seconds: 3,
                    omit: 0,
                    ..Iperf::new(Direction::ToPod)
                })
            });
            net::wait_for(
                "the busy share's class to hold the full bucket",
                Duration::from_secs(3),
                || bucket_is(share_bucket(veth), p.burst_bytes, bytes_per_sec),
            );
            let m = flow.join().unwrap();
            assert!(m.bits_per_second > 0.9 * 2e9, "{m}");
        });
        net::wait_for(
            "the share's classes to hold the idle bucket after the flow",
            Duration::from_secs(2),
            idle,
        );
    }
    assert_eq!(unprepare_one(&mut c, 0, "idle").await.code, "");
}

#[tokio::test]
async fn two_flows_in_one_share_get_equal_parts() {
    if !net::privileged("two_flows_in_one_share_get_equal_parts") {
        return;
    }
    let (a, _pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    for rate in ["200M", "2G"] {
        let r = prepare_one(&mut c, 0, bw_claim("fair", &pod, &share_id(), rate)).await;
        enforced_share(&r, rate);
        for dir in [Direction::ToPod, Direction::FromPod] {
            let _lock = TrafficLock::acquire();
            let (goodput, index) = net::two_flows(&server, dir, rate_bps(rate) as u64);
            eprintln!("{rate} {dir}: two flows, {goodput:.3} of the limit, Jain {index:.3}");
            // 1.0 for equal parts, 0.5 when one flow takes all. The two land in one
            // flow class (one FIFO) once in sixteen runs.
            assert!(
                index >= 0.95,
                "{rate} {dir}: two flows got unequal parts, Jain index {index:.3}"
            );
            assert!(
                (LOW..=HIGH).contains(&goodput),
                "{rate} {dir}: together {goodput:.3} of the limit"
            );
        }
        assert_eq!(unprepare_one(&mut c, 0, "fair").await.code, "");
    }
}

/// Bytes and packets HTB class `classid` of `dev` has sent (`tc -s class show`).
fn class_sent(dev: &str, classid: &str) -> (u64, u64) {
    let out = net::sh(&["tc", "-s", "class", "show", "dev", dev, "classid", classid]);
    let words: Vec<&str> = out.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "Sent")
        .unwrap_or_else(|| panic!("no counters for {classid} on {dev}: {out}"));
    let num = |i: usize| -> u64 { words[i].parse().unwrap_or_else(|_| panic!("{out}")) };
    (num(at + 1), num(at + 3))
}

#[tokio::test]
async fn sparse_flows_go_first_and_bulk_flows_stay_in_their_classes() {
    /// Half of tbf's p99 at 50M (see the assertion).
    const MAX_PING_P99_MS: f64 = 5.0;
    if !net::privileged("sparse_flows_go_first_and_bulk_flows_stay_in_their_classes") {
        return;
    }
    let (a, _pins) = start_with(net::net_device(
        "nic-0",
        &format!(
            "mechanism = \"htb-ebpf\"\n{}",
            net::bandwidth_capacity("10G")
        ),
    ));
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(&mut c, 0, bw_claim("sparse", &pod, &id, "50M")).await;
    enforced_share_by(&r, "50M", "htb-ebpf");
    let ifb = shareguard_limiter_net::state::queue_name(&id);
    let host = pod.host_if().to_owned();
    let (pings, rtts, bulk) = {
        let _lock = TrafficLock::acquire();
        std::thread::scope(|s| {
            let flow = s.spawn(|| server.measure(&Iperf::new(Direction::ToPod)));
            // Once the bulk flow has left its first burst behind.
            std::thread::sleep(std::time::Duration::from_millis(1200));
            let pings = 100;
            let rtts = net::ping_rtt(&pod, pings, std::time::Duration::from_millis(20));
            (pings, rtts, flow.join().unwrap())
        })
    };
    assert_within(&bulk, 50e6, "bulk flow beside the pings");
    assert!(rtts.len() >= 95, "{} of 100 pings answered", rtts.len());
    let p99 = net::percentile(&rtts, 99.0);
    eprintln!(
        "ping beside a 50M bulk flow: p50 {:.3} ms, p99 {p99:.3} ms",
        net::percentile(&rtts, 50.0),
    );
    // The latency goal is half of tbf's p99 with the CNI plugin's settings, which the
    // benchmark measures side by side: 11 ms at 50M, and 13 ms for one HTB class with
    // its default 1000-packet queue. Pings that waited behind the bulk flow would take
    // that long; through the priority class they took 0.1 to 0.8 ms in the benchmark.
    assert!(
        p99 < MAX_PING_P99_MS,
        "ping p99 beside a 50M bulk flow {p99:.3} ms, at least {MAX_PING_P99_MS} ms"
    );
    // The echo requests went to the pod through the priority class, the replies came
    // back through the ifb's; the bulk flow (31 MB in 5 s) through its flow class, with
    // at most its first burst (16 KiB) and the iperf3 control connection in the priority
    // class.
    let (to_bytes, to_packets) = class_sent(&host, "1:11");
    let (_, from_packets) = class_sent(&ifb, "1:11");
    eprintln!(
        "priority class: to the pod {to_bytes} B / {to_packets} pkt, from it {from_packets} pkt"
    );
    assert!(
        to_packets >= u64::from(pings),
        "{to_packets} packets to the pod in 1:11"
    );
    assert!(
        from_packets >= u64::from(pings),
        "{from_packets} packets from the pod in 1:11"
    );
    assert!(
        to_bytes < 1_000_000,
        "{to_bytes} bytes in the priority class: bulk went there"
    );
    let in_flows: u64 = (1..=16)
        .map(|m| class_sent(&host, &format!("1:{m:x}")).0)
        .sum();
    assert!(
        in_flows > 20_000_000,
        "{in_flows} bytes in the flow classes"
    );
    assert_eq!(unprepare_one(&mut c, 0, "sparse").await.code, "");
}

#[tokio::test]
async fn failures_are_reported_never_enforced() {
    if !net::privileged("failures_are_reported_never_enforced") {
        return;
    }
    let (mut a, _pins) = start("10G");
    let mut c = a.client().await;

    // A network namespace hint that is not the pod's: refused, nothing held or touched.
    let pod = Pod::new();
    let other = Pod::new();
    let mut wrong = bw_claim("wrong-ns", &pod, &share_id(), "50M");
    wrong.target.as_mut().unwrap().netns_path = other.netns_path().display().to_string();
    let before = net::sh(&["tc", "qdisc", "show", "dev", other.host_if()]);
    let r = prepare_one(&mut c, 0, wrong).await;
    let e = r.error.clone().unwrap();
    assert_eq!(e.code, "PermissionDenied", "{e:?}");
    assert_eq!(e.field, "claims[0].target.netns_path", "{e:?}");
    assert!(r.shares.is_empty());
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "0");
    assert_eq!(
        net::sh(&["tc", "qdisc", "show", "dev", other.host_if()]),
        before
    );

    // A link with the share's queue device name that shareguard did not make: never taken over
    // (or deleted by the roll-back), the share fails for good.
    let squatted = share_id();
    let name = shareguard_limiter_net::state::queue_name(&squatted);
    let _squatter = LinkGuard::add(&name);
    let p = Pod::new();
    let r = prepare_one(&mut c, 0, bw_claim("squat", &p, &squatted, "50M")).await;
    let e = r.error.clone().unwrap();
    assert_eq!(e.code, "FailedPrecondition", "{e:?}");
    assert!(
        e.message.contains("not the queue device shareguard made"),
        "{e:?}"
    );
    assert!(net::link_exists(&name), "the foreign link stays");
    assert!(
        !net::sh(&["tc", "qdisc", "show", "dev", p.host_if()]).contains("htb"),
        "the roll-back removed what the share had installed"
    );

    // A qdisc shareguard did not install: the kernel state is not ours to replace, so
    // the share fails for good and the foreign qdisc stays.
    let foreign = Pod::new();
    net::sh(&[
        "tc",
        "qdisc",
        "add",
        "dev",
        foreign.host_if(),
        "root",
        "handle",
        "5:",
        "tbf",
        "rate",
        "1gbit",
        "burst",
        "100kb",
        "latency",
        "25ms",
    ]);
    let r = prepare_one(&mut c, 0, bw_claim("foreign", &foreign, &share_id(), "50M")).await;
    let e = r.error.clone().unwrap();
    assert_eq!(e.code, "FailedPrecondition", "{e:?}");
    assert!(!e.retryable);
    assert!(net::sh(&["tc", "qdisc", "show", "dev", foreign.host_if()]).contains("tbf 5:"));

    // The pod goes away while the agent is down: after the restart the share waits for
    // it again (PENDING), holding its capacity until it is released, and what was
    // installed for the dead sandbox (its ifb) is gone.
    let vanishing = Pod::new();
    let id = share_id();
    enforced_share(
        &prepare_one(&mut c, 0, bw_claim("vanish", &vanishing, &id, "50M")).await,
        "50M",
    );
    let ifb = shareguard_limiter_net::state::queue_name(&id);
    assert!(net::link_exists(&ifb));
    a.kill9();
    drop(vanishing);
    a.restart();
    let mut c = a.client().await;
    let s = wait_phase(&mut c, &id, pb::Phase::Pending).await;
    assert!(s.reason.contains("waiting"), "{s:?}");
    assert!(!net::link_exists(&ifb), "the dead sandbox's ifb is removed");
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "50M");
    assert_eq!(unprepare_one(&mut c, 0, "vanish").await.code, "");
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "0");
}

/// An ifb of someone else's, deleted when dropped.
struct LinkGuard(String);

impl LinkGuard {
    fn add(name: &str) -> LinkGuard {
        net::sh(&["ip", "link", "add", "name", name, "type", "ifb"]);
        LinkGuard(name.to_owned())
    }
}

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .status();
    }
}

/// A dedicated allocation of a net device (no shareID, no amounts) is the whole device:
/// limited at its capacity and read back, not ENFORCED with nothing limited.
#[tokio::test]
async fn a_dedicated_net_allocation_is_limited_at_the_devices_capacity() {
    if !net::privileged("a_dedicated_net_allocation_is_limited_at_the_devices_capacity") {
        return;
    }
    let (a, _pins) = start("300M");
    let pod = Pod::new();
    let mut c = a.client().await;
    let mut cl = bw_claim("whole", &pod, "", "0");
    cl.allocations[0].consumed_capacity.clear();
    let r = prepare_one(&mut c, 0, cl).await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.limits.len(), 1, "{s:?}");
    assert_eq!(
        (s.limits[0].name.as_str(), s.limits[0].enforced.as_str()),
        ("bandwidth", "300M"),
        "{s:?}"
    );
    let server = pod.iperf_server();
    let _lock = TrafficLock::acquire();
    let m = server.measure(&Iperf::new(Direction::ToPod));
    assert_within(&m, 300e6, "dedicated");
}

/// Where nothing can queue, the programs police: packets over the token bucket are
/// dropped, so TCP sees loss instead of delay and gets less of the limit than a shaper
/// gives it. The band below is this mechanism's, measured (docs/benchmarks.md); it still
/// fails a policer that lets traffic through unlimited or that starves it.
#[tokio::test]
async fn policer_fallback_limits_both_directions() {
    const POLICER_LOW: f64 = 0.80;
    // Its 250 ms bucket comes on top of the rate after every pause: 0.937 to 0.993 in
    // the benchmark.
    const POLICER_HIGH: f64 = 1.05;
    if !net::privileged("policer_fallback_limits_both_directions") {
        return;
    }
    let (a, pins) = start_with(net::net_device(
        "nic-0",
        &format!(
            "mechanism = \"bpf-policer\"\n{}",
            net::bandwidth_capacity("10G")
        ),
    ));
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    assert_eq!(device(&mut c, "nic-0").await.mechanisms, ["bpf-policer"]);
    let before = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    for (i, rate) in ["50M", "500M"].into_iter().enumerate() {
        let uid = format!("pol-{i}");
        let id = share_id();
        let r = prepare_one(&mut c, 0, bw_claim(&uid, &pod, &id, rate)).await;
        enforced_share_by(&r, rate, "bpf-policer");
        // No qdisc and no ifb: the programs alone enforce it.
        assert_eq!(
            net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]),
            before
        );
        assert!(!net::link_exists(
            &shareguard_limiter_net::state::queue_name(&id)
        ));
        for dir in [Direction::ToPod, Direction::FromPod] {
            let _lock = TrafficLock::acquire();
            let what = format!("policer {rate} {dir}");
            let mut m = server.measure(&Iperf::new(dir));
            // TCP through a policer reacts to its drops, and on two cores the tests
            // that run beside this one (they take no traffic lock) can cost it a fifth
            // of the limit (0.783 once at 500M from the pod, at load 0.8 to 1.6). A run
            // below the band is measured once more and the second decides; a policer
            // that lets everything through fails on the first, one that starves on both.
            let ratio = m.bits_per_second / rate_bps(rate);
            assert!(
                ratio <= POLICER_HIGH,
                "{what}: {ratio:.3} of the limit: {m}"
            );
            if ratio < POLICER_LOW {
                eprintln!("{what}: {m} -> {ratio:.3} of the limit; measuring once more");
                m = server.measure(&Iperf::new(dir));
            }
            assert_within_band(&m, rate_bps(rate), POLICER_LOW, POLICER_HIGH, &what);
        }
        // A policer at its limit drops packets.
        a.wait_metric("shareguard_share_drops_total", &[("share", &id)], |d| {
            d > 0.0
        });
        assert_eq!(unprepare_one(&mut c, 0, &uid).await.code, "");
    }
    let links = fs::read_dir(pins.0.join("net/links")).unwrap().count();
    assert_eq!(links, 0, "detach means unpin");
}

/// `edt-fq` end to end, wherever the kernel has `sch_fq`: the programs stamp each packet's
/// departure time, a root `fq` on the veth (to the pod) and on the share's ifb (from it)
/// holds it until then, and TCP gets the limit in both directions. On a kernel without
/// `sch_fq` the mechanism cannot exist, so there is nothing to run; the test says so and
/// ends (`net_devices` checks that such a device fails its shares for good instead).
/// Its band is the shapers' band; `edt-fq`'s own figures are not measured yet.
#[tokio::test]
async fn edt_fq_limits_both_directions_where_the_kernel_has_sch_fq() {
    const TEST: &str = "edt_fq_limits_both_directions_where_the_kernel_has_sch_fq";
    if !net::privileged(TEST) {
        return;
    }
    let kernel = shareguard_limiter_net::probe::probe().unwrap();
    if !kernel.fq {
        eprintln!("SKIP {TEST}: this kernel has no sch_fq, so edt-fq cannot run here");
        return;
    }
    let (a, pins) = start_with(net::net_device(
        "nic-0",
        &format!("mechanism = \"edt-fq\"\n{}", net::bandwidth_capacity("10G")),
    ));
    let pod = Pod::new();
    let server = pod.iperf_server();
    let mut c = a.client().await;
    assert_eq!(device(&mut c, "nic-0").await.mechanisms, ["edt-fq"]);
    let before = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    for (i, rate) in ["50M", "500M", "2G"].into_iter().enumerate() {
        let uid = format!("edt-{i}");
        let id = share_id();
        let r = prepare_one(&mut c, 0, bw_claim(&uid, &pod, &id, rate)).await;
        enforced_share_by(&r, rate, "edt-fq");
        let ifb = shareguard_limiter_net::state::queue_name(&id);
        for dev in [pod.host_if(), ifb.as_str()] {
            let root = net::sh(&["tc", "qdisc", "show", "dev", dev, "root"]);
            assert!(root.starts_with("qdisc fq "), "{dev}: {root}");
        }
        for dir in [Direction::ToPod, Direction::FromPod] {
            let _lock = TrafficLock::acquire();
            let m = server.measure(&Iperf::new(dir));
            assert_within(&m, rate_bps(rate), &format!("edt-fq {rate} {dir}"));
        }
        assert_eq!(unprepare_one(&mut c, 0, &uid).await.code, "");
        assert!(!net::link_exists(&ifb), "the share's ifb {ifb} is gone");
        assert_eq!(
            net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]),
            before
        );
    }
    let links = fs::read_dir(pins.0.join("net/links")).unwrap().count();
    assert_eq!(links, 0, "detach means unpin");
}

/// A child process killed when the test ends, however it ends.
struct Flood(std::process::Child);

impl Drop for Flood {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// CNI stand-ins that pass every packet, linked to both hooks of host veth `index` at
/// `place`: (ingress, egress).
fn cni_passing(index: u32, place: foreign::Place) -> (foreign::Foreign, foreign::Foreign) {
    let link =
        |ingress| foreign::Foreign::attach(index, ingress, foreign::Action::Pass, place).unwrap();
    (link(true), link(false))
}

/// Packets a host interface's own counters say it received and sent.
fn iface_packets(dev: &str) -> (u64, u64) {
    let read = |what: &str| -> u64 {
        fs::read_to_string(format!("/sys/class/net/{dev}/statistics/{what}"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    (read("rx_packets"), read("tx_packets"))
}

/// Measures both directions through the share and checks that the CNI stand-ins on the
/// pod's host veth (`ingress`, `egress`) ran for every packet of the pod: the one on
/// ingress once per packet the veth received from the pod, the one on egress at least
/// once per packet it sent to the pod (it runs before the share's queue, which also
/// drops some).
fn limited_and_seen_by_the_cni(
    pod: &Pod,
    queue: &str,
    server: &net::IperfServer,
    rate: &str,
    ingress: &foreign::Foreign,
    egress: &foreign::Foreign,
    what: &str,
) {
    for dir in [Direction::ToPod, Direction::FromPod] {
        let _lock = TrafficLock::acquire();
        let (rx0, tx0) = iface_packets(pod.host_if());
        let (in0, out0) = (ingress.runs().unwrap(), egress.runs().unwrap());
        let dropped0 = queue_drops(queue);
        let m = server.measure(&Iperf::new(dir));
        let (rx1, tx1) = iface_packets(pod.host_if());
        let out1 = egress.runs().unwrap();
        assert_within(&m, rate_bps(rate), &format!("{what}: {rate} {dir}"));
        let (received, sent) = (rx1 - rx0, tx1 - tx0);
        let ran_out = out1 - out0;
        let dropped = queue_drops(queue) - dropped0;
        let ran_in = runs_settle(ingress, in0, received, dropped, &format!("{what} {dir}"));
        eprintln!(
            "{what} {dir}: the veth received {received} and sent {sent} packets; the CNI's ingress program ran {ran_in} times, its egress program {ran_out}"
        );
        // The egress program runs before the share's queue, which drops some; a packet
        // or two it passed before the first read may leave the queue after it.
        assert!(
            ran_out + 4 >= sent,
            "{what} {dir}: the CNI's egress program ran {ran_out} times for {sent} packets to the pod"
        );
    }
}

/// Packets the root qdisc of `dev` (a share's queue device) dropped so far.
fn queue_drops(dev: &str) -> u64 {
    let out = net::sh(&["tc", "-s", "qdisc", "show", "dev", dev, "root"]);
    let (_, rest) = out
        .split_once("(dropped ")
        .unwrap_or_else(|| panic!("no drops in: {out}"));
    rest.split(',').next().unwrap().trim().parse().unwrap()
}

/// The runs of the CNI stand-in `p` since `from`, once they match the `received` packets
/// from the pod less those the share's queue `dropped`: the pod's last packets may still
/// sit in the queue when the counters are read, and pass the stand-in when the queue
/// releases them, never twice.
fn runs_settle(p: &foreign::Foreign, from: u64, received: u64, dropped: u64, what: &str) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let ran = p.runs().unwrap() - from;
        assert!(
            ran <= received + 2,
            "{what}: the CNI's program ran {ran} times for {received} packets from the pod"
        );
        // A packet or two may sit between the veth's counter and the hook at a read; what
        // the share's queue dropped never comes back.
        if ran + dropped + 2 >= received {
            return ran;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the CNI's program ran {ran} times for {received} packets from the pod, 5 s after the traffic stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A CNI attaches its programs to the pod's host veth when the sandbox is made, before
/// the share is found, and its programs end the chain when they pass a packet. Ours go
/// first: the share is limited both ways, and the CNI's programs still see every packet
/// of the pod (the pod's traffic comes back from the share's queue to the same hook).
#[tokio::test]
async fn a_cni_program_in_front_is_put_behind_and_still_sees_every_packet() {
    if !net::privileged("a_cni_program_in_front_is_put_behind_and_still_sees_every_packet") {
        return;
    }
    let (a, _pins) = start("10G");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let _stats = foreign::RunStats::enable().unwrap();
    let index = pod.host_ifindex();
    let (ingress, egress) = cni_passing(index, foreign::Place::First);
    let mut c = a.client().await;
    let id = share_id();
    let queue = shareguard_limiter_net::state::queue_name(&id);
    let r = prepare_one(&mut c, 0, bw_claim("cni-first", &pod, &id, "100M")).await;
    enforced_share(&r, "100M");
    limited_and_seen_by_the_cni(
        &pod,
        &queue,
        &server,
        "100M",
        &ingress,
        &egress,
        "CNI first",
    );
    assert_eq!(unprepare_one(&mut c, 0, "cni-first").await.code, "");
}

/// A CNI that attaches its programs again after the share is enforced (an agent restart,
/// an endpoint regenerated) may put them behind ours, or in front. Behind: nothing to
/// do, and they see every packet. In front: the reconciler finds ours out of place and
/// the pod's traffic past them, says so (DEGRADED, with the reason), puts ours first
/// again and returns to ENFORCED once a whole period shows the traffic passing ours.
#[tokio::test]
async fn a_cni_program_attached_later_is_seen_behind_and_repaired_in_front() {
    if !net::privileged("a_cni_program_attached_later_is_seen_behind_and_repaired_in_front") {
        return;
    }
    let (a, _pins) = start_reconciling("2s");
    let pod = Pod::new();
    let server = pod.iperf_server();
    let _stats = foreign::RunStats::enable().unwrap();
    let mut c = a.client().await;
    let id = share_id();
    let queue = shareguard_limiter_net::state::queue_name(&id);
    let r = prepare_one(&mut c, 0, bw_claim("cni-later", &pod, &id, "100M")).await;
    enforced_share(&r, "100M");
    let index = pod.host_ifindex();
    {
        let (ingress, egress) = cni_passing(index, foreign::Place::Last);
        limited_and_seen_by_the_cni(
            &pod,
            &queue,
            &server,
            "100M",
            &ingress,
            &egress,
            "CNI behind",
        );
        assert_eq!(
            get_share(&mut c, id.clone()).await.phase,
            pb::Phase::Enforced as i32
        );
    }
    // Now in front, while the pod sends: until the reconciler comes, its traffic passes
    // unlimited, and the share must say so. The repair follows within milliseconds, so
    // the stream of changes tells it, not a poll.
    let mut changes = c
        .watch_shares(pb::WatchSharesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let (ingress, egress) = cni_passing(index, foreign::Place::First);
    {
        // A flood of pings from the pod: thousands of packets a second past ours.
        let _lock = TrafficLock::acquire();
        let mut flood = Flood(
            pod.netns()
                .exec("ping")
                .args(["-f", "-q", "-w", "20", &pod.host_addr().to_string()])
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        let degraded = changed_to(
            &mut changes,
            &id,
            pb::Phase::Degraded,
            Duration::from_secs(15),
        )
        .await;
        flood.0.kill().unwrap();
        eprintln!("degraded: {}", degraded.reason);
        for part in ["bypasses the shaper", "runs before shareguard's"] {
            assert!(degraded.reason.contains(part), "{}", degraded.reason);
        }
    }
    let back = wait_phase(&mut c, &id, pb::Phase::Enforced).await;
    eprintln!("back: {}", back.reason);
    limited_and_seen_by_the_cni(
        &pod,
        &queue,
        &server,
        "100M",
        &ingress,
        &egress,
        "CNI put behind again",
    );
    assert_eq!(unprepare_one(&mut c, 0, "cni-later").await.code, "");
}

/// A CNI with host routing bypasses the host veth: its program on the node's interface
/// hands traffic for the pod straight to the pod's end of the veth
/// (`bpf_redirect_peer`), and its program on the pod's veth sends the pod's traffic
/// straight out (`bpf_redirect`). Here a second veth pair stands for the node's NIC, its
/// far end in a namespace of its own that answers for the pod's peer address. From the
/// pod, ours run first and shape before the CNI's redirect, which still sees every
/// packet. To the pod, nothing on the host veth sees the traffic: the share must not say
/// ENFORCED while that goes on, and says why; it is ENFORCED again once it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traffic_redirected_past_the_host_veth_is_not_called_enforced() {
    if !net::privileged("traffic_redirected_past_the_host_veth_is_not_called_enforced") {
        return;
    }
    let (a, _pins) = start_reconciling("1s");
    let pod = Pod::new();
    let server = pod.iperf_server();
    // The "node's NIC": its far end owns the pod's peer address, with the host veth's MAC
    // so that the frames the CNI stand-in redirects to it from the pod are its own.
    let (outside, nic) = net::veth_to_new_netns();
    let host_mac = net::mac(None, pod.host_if());
    let pod_mac = net::mac(Some(pod.netns()), pod.pod_if());
    let host_addr = pod.host_addr().to_string();
    let pod_addr = pod.pod_addr().to_string();
    outside.sh(&["ip", "link", "set", "eth0", "address", &host_mac]);
    outside.sh(&[
        "ip",
        "addr",
        "add",
        &format!("{host_addr}/32"),
        "dev",
        "eth0",
    ]);
    outside.sh(&[
        "ip",
        "route",
        "add",
        &format!("{pod_addr}/32"),
        "dev",
        "eth0",
    ]);
    outside.sh(&[
        "ip",
        "neigh",
        "replace",
        &pod_addr,
        "lladdr",
        &pod_mac,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    pod.netns().sh(&[
        "ip",
        "neigh",
        "replace",
        &host_addr,
        "lladdr",
        &host_mac,
        "dev",
        pod.pod_if(),
        "nud",
        "permanent",
    ]);
    let _stats = foreign::RunStats::enable().unwrap();
    let nic_index = net::ifindex(nic.name());
    // The CNI's programs, there before the share: on the NIC, into the pod past its host
    // veth; on the host veth's ingress, first, the pod's traffic straight to the NIC.
    let _to_pod = foreign::Foreign::attach(
        nic_index,
        true,
        foreign::Action::RedirectPeer(pod.host_ifindex()),
        foreign::Place::First,
    )
    .unwrap();
    let from_pod = foreign::Foreign::attach(
        pod.host_ifindex(),
        true,
        foreign::Action::Redirect(nic_index),
        foreign::Place::First,
    )
    .unwrap();
    let mut c = a.client().await;
    let id = share_id();
    let r = prepare_one(&mut c, 0, bw_claim("peer", &pod, &id, "100M")).await;
    enforced_share(&r, "100M");

    {
        let _lock = TrafficLock::acquire();
        let (rx0, _) = iface_packets(pod.host_if());
        let ran0 = from_pod.runs().unwrap();
        let queue = shareguard_limiter_net::state::queue_name(&id);
        let dropped0 = queue_drops(&queue);
        let m = server.measure_from(&outside, &Iperf::new(Direction::FromPod));
        let (rx1, _) = iface_packets(pod.host_if());
        assert_within(&m, 100e6, "from the pod, then redirected by the CNI");
        let received = rx1 - rx0;
        let dropped = queue_drops(&queue) - dropped0;
        let ran = runs_settle(&from_pod, ran0, received, dropped, "the CNI's redirect");
        eprintln!("the CNI's redirect ran {ran} times for {received} packets from the pod");
    }
    {
        let _lock = TrafficLock::acquire();
        let mut iperf = Iperf::new(Direction::ToPod);
        iperf.seconds = 6;
        // The share's phase while the traffic runs, read beside the measurement.
        let runtime = tokio::runtime::Handle::current();
        let (m, s) = std::thread::scope(|scope| {
            let run = scope.spawn(|| server.measure_from(&outside, &iperf));
            let phase =
                scope.spawn(|| runtime.block_on(wait_phase(&mut c, &id, pb::Phase::Degraded)));
            (run.join().unwrap(), phase.join().unwrap())
        });
        eprintln!("to the pod past the host veth: {m}");
        // Nothing of shareguard's is in that path: the pod gets what it gets.
        assert!(
            m.bits_per_second > 2.0 * 100e6,
            "the redirect past the host veth should not be limited here: {m}"
        );
        eprintln!("while it ran: {}", s.reason);
        assert!(
            s.reason.contains("reached the pod without leaving"),
            "{}",
            s.reason
        );
    }
    let back = wait_phase(&mut c, &id, pb::Phase::Enforced).await;
    eprintln!("back: {}", back.reason);
    assert_eq!(unprepare_one(&mut c, 0, "peer").await.code, "");
}

/// The bandwidth limiter itself on one share whose claim two pods use, each behind its
/// own veth: removed on drop, also when the test fails, so no queue device or qdisc
/// stays behind.
struct SharedShare {
    limiter: shareguard_limiter_net::NetLimiter,
    key: String,
    // Dropped after the limiter's removal: the pins, then the state directory.
    _pins: PinDir,
    _state: tempfile::TempDir,
}

impl SharedShare {
    fn new() -> SharedShare {
        let pins = PinDir::new();
        let state = tempfile::tempdir().unwrap();
        let backend = shareguard_limiter_net::NetBackend::open(state.path(), &pins.0).unwrap();
        SharedShare {
            limiter: shareguard_limiter_net::NetLimiter::new(backend, None, None).unwrap(),
            key: share_id(),
            _pins: pins,
            _state: state,
        }
    }

    fn spec(&self, rate: &str, pods: &[&Pod]) -> shareguard_common::limiter::LimitSpec {
        use shareguard_common::limiter::{HostIface, LimitSpec, Target};
        LimitSpec {
            share_key: self.key.clone(),
            device: "nic-0".into(),
            limits: [(
                "bandwidth".to_owned(),
                shareguard_common::Quantity::parse(rate).unwrap(),
            )]
            .into(),
            target: Target {
                pod_uids: pods.iter().map(|p| p.uid().to_owned()).collect(),
                cgroups: Vec::new(),
                host_ifaces: pods
                    .iter()
                    .map(|p| HostIface {
                        index: p.host_ifindex(),
                        name: p.host_if().to_owned(),
                    })
                    .collect(),
            },
        }
    }

    /// Applies the share to `pods` and checks that `rate` was read back.
    fn apply(&self, rate: &str, pods: &[&Pod]) {
        use shareguard_common::limiter::Limiter as _;
        let e = self.limiter.apply(&self.spec(rate, pods)).unwrap();
        assert_eq!(
            e.enforced
                .get("bandwidth")
                .map(ToString::to_string)
                .as_deref(),
            Some(rate),
            "{e:?}"
        );
    }
}

impl Drop for SharedShare {
    fn drop(&mut self) {
        use shareguard_common::limiter::Limiter as _;
        if let Err(e) = self.limiter.remove(&self.key) {
            eprintln!("removing share {}: {e}", self.key);
        }
    }
}

/// A claim that two pods use is one share: the limit holds the traffic of both together,
/// in both directions, not each pod on its own. A pod that leaves or joins is taken off
/// or put under the same limit while the others stay limited, and the release leaves
/// every interface as it was found.
#[test]
fn one_share_holds_all_of_its_pods_together() {
    if !net::privileged("one_share_holds_all_of_its_pods_together") {
        return;
    }
    let uid = shareguard_tests::pod::pod_uid();
    let (p1, p2) = (Pod::network_only(&uid), Pod::network_only(&uid));
    let (s1, s2) = (p1.iperf_server(), p2.iperf_server());
    let share = SharedShare::new();
    share.apply("100M", &[&p1, &p2]);
    let queues: Vec<String> = net::sh(&["ip", "-o", "link", "show"])
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .filter(|n| n.starts_with("sgt") || n.starts_with("sgb"))
        .collect();
    assert!(
        queues.iter().any(|n| n.starts_with("sgt")),
        "traffic to the pods queues on a to-pod queue device: {queues:?}"
    );
    for p in [&p1, &p2] {
        assert!(
            !net::sh(&["tc", "qdisc", "show", "dev", p.host_if(), "root"]).contains("htb"),
            "no HTB of its own on {}: it would give the pod the whole rate",
            p.host_if()
        );
    }

    let _lock = TrafficLock::acquire();
    for dir in [Direction::ToPod, Direction::FromPod] {
        let (m1, m2) = s1.measure_with(&s2, &Iperf::new(dir));
        let sum = m1.bits_per_second + m2.bits_per_second;
        assert!(
            (100e6 * LOW..=100e6 * HIGH).contains(&sum),
            "{dir}: the two pods together got {:.1} Mbit/s of a 100M share ({m1}; {m2})",
            sum / 1e6
        );
        for m in [&m1, &m2] {
            assert!(
                m.bits_per_second > 100e6 * 0.1,
                "{dir}: both pods make progress, not one starved ({m1}; {m2})"
            );
        }
    }

    // The first pod leaves; the other keeps the limit, alone.
    drop(s1);
    drop(p1);
    share.apply("100M", &[&p2]);
    for dir in [Direction::ToPod, Direction::FromPod] {
        assert_within(&s2.measure(&Iperf::new(dir)), 100e6, "the pod left alone");
    }
    // A third joins: both again under one limit.
    let p3 = Pod::network_only(&uid);
    let s3 = p3.iperf_server();
    share.apply("100M", &[&p2, &p3]);
    let (m2, m3) = s2.measure_with(&s3, &Iperf::new(Direction::ToPod));
    let sum = m2.bits_per_second + m3.bits_per_second;
    assert!(
        (100e6 * LOW..=100e6 * HIGH).contains(&sum),
        "after a pod joined: {:.1} Mbit/s together ({m2}; {m3})",
        sum / 1e6
    );

    use shareguard_common::limiter::Limiter as _;
    share.limiter.remove(&share.key).unwrap();
    for p in [&p2, &p3] {
        let root = net::sh(&["tc", "qdisc", "show", "dev", p.host_if(), "root"]);
        assert!(!root.contains("htb"), "{}: {root}", p.host_if());
    }
    let id = shareguard_limiter_net::state::short_id(&share.key);
    let links = net::sh(&["ip", "-o", "link", "show"]);
    assert!(
        !links.contains(&id),
        "the share's queue devices are gone: {links}"
    );
}
