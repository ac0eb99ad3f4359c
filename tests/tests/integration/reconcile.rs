//! The reconciler against drift injected by hand on real interfaces: the share's qdisc
//! deleted, its class rate changed, its ifb removed, its program link unpinned (which
//! detaches it). Each is found within two periods (the share goes DEGRADED, with the
//! reason), repaired (ENFORCED again, the kernel state as it was), seen by a watcher in
//! that order, and counted in the metrics. The pod's interface recreated is followed:
//! the share waits for the new one (PENDING) and is enforced on it. A pod that is gone
//! leaves its share waiting, capacity held. Root only; skips without it unless
//! `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::time::{Duration, Instant};

use shareguard_tests::{
    Agent, device, metric_sample,
    net::{self, PinDir, Pod, TrafficLock},
    prepare_one, proto as pb, share_id,
};
use tonic::Streaming;

const PERIOD: Duration = Duration::from_millis(500);

fn start(pins: &PinDir) -> Agent {
    let lines = format!(
        "mechanism = \"htb-ebpf\"\n{}",
        net::bandwidth_capacity("10G")
    );
    let extra = format!("reconcile_period = \"{}ms\"", PERIOD.as_millis());
    net::start_agent(net::net_device("nic-0", &lines), pins, &extra)
}

/// The next CHANGED event of share `id`, within `deadline` of now.
async fn changed(
    s: &mut Streaming<pb::WatchSharesResponse>,
    id: &str,
    deadline: Duration,
) -> pb::ShareStatus {
    shareguard_tests::next_change(s, id, deadline, |_| true).await
}

#[tokio::test]
async fn drift_is_found_within_two_periods_and_repaired() {
    if !net::privileged("drift_is_found_within_two_periods_and_repaired") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let pod = Pod::new();
    let mut c = a.client().await;
    let id = share_id();
    let cl = net::bw_claim("rc", "team-a", "nic-0", &pod, &id, "100M");
    let r = prepare_one(&mut c, 0, cl).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    let ifb = shareguard_limiter_net::state::queue_name(&id);
    let host = pod.host_if().to_owned();
    let qdiscs = || net::sh(&["tc", "qdisc", "show", "dev", &host]);
    let htb = shareguard_limiter_net::tc::HtbParams::for_rate(100_000_000);
    // The share's class's bucket follows the share's use of its rate (limiter-net's
    // `burst`): either size is as installed, to within tc's rounding to a microsecond.
    let bucket_ok = |dev: &str| {
        let index = net::ifindex(dev);
        let classes =
            shareguard_limiter_net::rtnl::htb_classes(index, shareguard_limiter_net::tc::MAJOR)
                .unwrap();
        let b = classes[&shareguard_limiter_net::tc::SHARE_MINOR].burst;
        let us = 100_000_000 / 8 / 1_000_000 + 1;
        [htb.burst_bytes, htb.idle_burst_bytes()]
            .iter()
            .any(|&want| b <= want && want - b <= us)
    };
    let class = |dev: &str| {
        assert!(
            bucket_ok(dev),
            "the share's class on {dev} holds neither bucket"
        );
        let out = net::sh(&["tc", "class", "show", "dev", dev]);
        out.lines()
            .map(|l| match l.split_once(" burst ") {
                Some((head, _)) if l.contains(" 1:100 root ") => {
                    format!("{head} (busy or idle bucket)")
                }
                _ => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (qdiscs_before, class_before) = (qdiscs(), class(&host));
    assert!(class_before.contains("rate 100Mbit"), "{class_before}");

    let mut w = c
        .watch_shares(pb::WatchSharesRequest::default())
        .await
        .unwrap()
        .into_inner();
    // Removing the pin ends the link (the agent keeps no fd of it), so the program no
    // longer sees the pod's traffic: the reconciler must notice from the pin alone.
    let link = pins
        .0
        .join("net/links")
        .join(shareguard_limiter_net::limiter::link_name(
            &id,
            shareguard_limiter_net::bpf::Direction::FromPod,
        ));
    assert!(link.exists(), "{link:?}");
    let link_str = link.display().to_string();
    let flow_rate = format!("{}bit", htb.flow_rate_bps());
    let share_burst = format!("{}b", htb.burst_bytes);
    let injections: [(&str, Vec<&str>); 7] = [
        (
            "root qdisc deleted",
            vec!["tc", "qdisc", "del", "dev", &host, "root"],
        ),
        (
            "share class rate changed",
            vec![
                "tc", "class", "change", "dev", &host, "parent", "1:", "classid", "1:100", "htb",
                "rate", "1mbit", "ceil", "1mbit",
            ],
        ),
        // A flow class that may send more than its part on its own would let its flow
        // past the share's limit.
        (
            "flow class rate raised",
            vec![
                "tc", "class", "change", "dev", &host, "parent", "1:100", "classid", "1:3", "htb",
                "rate", "10gbit", "ceil", "10gbit",
            ],
        ),
        // So would the priority class of sparse flows.
        (
            "priority class rate raised",
            vec![
                "tc", "class", "change", "dev", &host, "parent", "1:100", "classid", "1:11", "htb",
                "rate", "10gbit", "ceil", "10gbit", "prio", "0",
            ],
        ),
        // A flow class's own burst goes out at once whatever the share's class has
        // left: one as large as the share's lets a new flow past the limit after idle.
        (
            "flow class burst raised",
            vec![
                "tc",
                "class",
                "change",
                "dev",
                &host,
                "parent",
                "1:100",
                "classid",
                "1:3",
                "htb",
                "rate",
                &flow_rate,
                "ceil",
                "100mbit",
                "burst",
                &share_burst,
                "cburst",
                &share_burst,
                "prio",
                "1",
            ],
        ),
        ("ifb deleted", vec!["ip", "link", "del", &ifb]),
        ("program link unpinned", vec!["rm", &link_str]),
    ];
    // Each drift is timed against the period: no other measurement may share the CPUs.
    let _lock = TrafficLock::acquire();
    for (i, (what, cmd)) in injections.iter().enumerate() {
        let injected = Instant::now();
        net::sh(cmd);
        let s = changed(&mut w, &id, 2 * PERIOD + Duration::from_secs(2)).await;
        let found = injected.elapsed();
        assert_eq!(s.phase, pb::Phase::Degraded as i32, "{what}: {s:?}");
        assert!(s.reason.contains("drift"), "{what}: {}", s.reason);
        assert!(
            found <= 2 * PERIOD + Duration::from_millis(500),
            "{what}: found after {found:?}, more than two periods of {PERIOD:?}"
        );
        let s = changed(&mut w, &id, 2 * PERIOD + Duration::from_secs(2)).await;
        assert_eq!(s.phase, pb::Phase::Enforced as i32, "{what}: {s:?}");
        assert!(s.reason.contains("repaired"), "{what}: {}", s.reason);
        assert_eq!(s.limits[0].enforced, "100M", "{what}");
        assert_eq!(
            qdiscs(),
            qdiscs_before,
            "{what}: the qdiscs are as installed"
        );
        assert_eq!(
            class(&host),
            class_before,
            "{what}: the class is as installed"
        );
        assert!(net::link_exists(&ifb), "{what}: the ifb is back");
        assert!(link.exists(), "{what}: the program link is pinned again");
        let (_, body) = a.http("/metrics");
        let n = (i + 1) as f64;
        assert_eq!(
            metric_sample(
                &body,
                "shareguard_reconcile_drift_total",
                &[("device", "nic-0")]
            )
            .unwrap_or(0.0),
            n,
            "{what}"
        );
        assert_eq!(
            metric_sample(
                &body,
                "shareguard_reconcile_repairs_total",
                &[("device", "nic-0")]
            )
            .unwrap_or(0.0),
            n,
            "{what}"
        );
    }
    // Each drift and each repair is a decision in the audit log (the repair is audited
    // before it is counted, so the last one is there too).
    let audited = |decision: &str| {
        a.audit_lines()
            .iter()
            .filter(|l| l["decision"] == decision && l["share_id"] == id.as_str())
            .count()
    };
    assert_eq!(
        (audited("drift"), audited("repair")),
        (injections.len(), injections.len())
    );

    // The pod's network is set up again (same names, a new interface): the old
    // interface is gone, and its limit with it; the share follows the pod to the new
    // one, waiting (PENDING) in between at most.
    let old_index = pod.host_ifindex();
    let mut pod = pod;
    pod.recreate_link();
    assert_ne!(pod.host_ifindex(), old_index);
    let s = until_phase(&mut w, &id, pb::Phase::Enforced, &[pb::Phase::Pending]).await;
    assert_eq!(
        s.sandbox.as_ref().map(|x| x.host_ifindex),
        Some(pod.host_ifindex()),
        "recreated: enforced on the new interface: {s:?}"
    );
    assert_eq!(
        class(&host),
        class_before,
        "recreated: the class is on the new interface"
    );

    // The pod goes away without an Unprepare: waiting again, never released implicitly.
    drop(pod);
    let s = until_phase(&mut w, &id, pb::Phase::Pending, &[]).await;
    assert!(s.reason.contains("waiting"), "{}", s.reason);
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "100M");
}

/// Follows share `id`'s changes until it is in `want`, allowing only `via` in between.
async fn until_phase(
    w: &mut Streaming<pb::WatchSharesResponse>,
    id: &str,
    want: pb::Phase,
    via: &[pb::Phase],
) -> pb::ShareStatus {
    loop {
        let s = changed(w, id, 2 * PERIOD + Duration::from_secs(2)).await;
        if s.phase == want as i32 {
            return s;
        }
        assert!(
            via.iter().any(|p| *p as i32 == s.phase),
            "on the way to {want:?}: {s:?}"
        );
    }
}

/// A rate that is not a whole number of bytes per second is held rounded down to one
/// (the kernel counts bytes): the share is ENFORCED with the rounding stated, and the
/// reconciler does not take the rounding for drift, pass after pass.
#[tokio::test]
async fn a_rate_in_part_bytes_is_held_rounded_down_and_is_not_drift() {
    if !net::privileged("a_rate_in_part_bytes_is_held_rounded_down_and_is_not_drift") {
        return;
    }
    let pins = PinDir::new();
    // A step of 4 bit/s lets the policy allow rates that are not multiples of 8.
    let lines = "mechanism = \"htb-ebpf\"\n[device.capacity.bandwidth]\nvalue = \"10G\"\n\
                 default = \"10M\"\nvalid_range = { min = \"10M\", max = \"10G\", step = \"4\" }\n";
    let extra = format!("reconcile_period = \"{}ms\"", PERIOD.as_millis());
    let a = net::start_agent(net::net_device("nic-0", lines), &pins, &extra);
    let pod = Pod::new();
    let mut c = a.client().await;
    let id = share_id();
    let cl = net::bw_claim("rb", "team-a", "nic-0", &pod, &id, "100000004");
    let r = prepare_one(&mut c, 0, cl).await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{r:?}");
    assert!(
        s.reason
            .contains("bandwidth held as 100M, the nearest step of 8"),
        "{}",
        s.reason
    );
    let out = net::sh(&["tc", "class", "show", "dev", pod.host_if()]);
    assert!(out.contains("rate 100Mbit"), "{out}");

    // Three reconciler passes later: still ENFORCED, no drift found, nothing re-applied.
    let passes = || {
        let (_, body) = a.http("/metrics");
        metric_sample(&body, "shareguard_reconcile_duration_seconds_count", &[]).unwrap_or(0.0)
    };
    let (start, deadline) = (passes(), Instant::now() + 10 * PERIOD);
    while passes() < start + 3.0 {
        assert!(
            Instant::now() < deadline,
            "no three reconciler passes in {:?}",
            10 * PERIOD
        );
        tokio::time::sleep(PERIOD / 5).await;
    }
    let (_, body) = a.http("/metrics");
    let drift = metric_sample(
        &body,
        "shareguard_reconcile_drift_total",
        &[("device", "nic-0")],
    );
    assert_eq!(
        drift.unwrap_or(0.0),
        0.0,
        "the rounding was taken for drift"
    );
    let s = shareguard_tests::get_share(&mut c, id.clone()).await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert!(
        !a.audit_lines().iter().any(|l| l["decision"] == "drift"),
        "a drift line in the audit log"
    );
}
