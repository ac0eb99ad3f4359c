//! Whether a share's traffic really passes its programs: the effect, not the
//! configuration. A program in front of ours that passes a packet (TCX_PASS) ends the
//! chain before ours runs, and one that redirects a packet past the hook takes it
//! elsewhere; either way the links and qdiscs read back as installed while the pod's
//! traffic is not limited. So every read-back compares, per direction, the packets the
//! host veth's own counters say it carried with the packets our programs saw there.
//!
//! Packets, not bytes: the veth and the programs count one per packet (a GSO packet
//! once), and a queue's drops and backlog are known only in packets. Over a window:
//!
//! - from the pod (host veth receive): every packet the veth received reaches its tc
//!   ingress hook, where ours counts it (passed or dropped). Unseen = received - seen.
//! - to the pod (host veth send): ours counts each packet before our root qdisc, which
//!   drops some and holds some; the veth counts what it sent. Unseen = sent + queue drops
//!   + growth of the queue - seen.
//! - to the pod, past the host veth: a program on another interface may hand packets
//!   straight to the pod's end of the veth (`bpf_redirect_peer`, Cilium's host routing),
//!   so they never leave the host veth at all. The pod's end counts what it received:
//!   what the host veth sent plus what was redirected to it. Past = received by the
//!   pod's end - sent by the host veth.
//!
//! What is in flight when the counters are read (the per-CPU backlog between the veth and
//! its ingress hook) moves a few hundred packets from one window to the next, hence
//! [`IN_FLIGHT`]; a pod whose traffic bypasses ours shows its whole traffic unseen, far
//! above it. A quiet pod shows none at all.

use std::time::{Duration, Instant};

/// Shortest window judged; a read-back sooner after the last keeps the last verdict: the
/// repair that follows a verify by milliseconds must not clear a bypass it had no time
/// to see, so a share found bypassed is ENFORCED again only after a whole reconcile
/// period in which its traffic passed the programs.
pub const MIN_WINDOW: Duration = Duration::from_millis(250);

/// Unseen packets per window below which nothing is concluded: at most what can be in
/// flight between the veth's counter and the hook (the kernel's per-CPU backlog, 1000
/// packets by default) at the two reads.
pub const IN_FLIGHT: u64 = 2048;

/// Of the packets the interface carried in a window, the part that may go unseen before
/// it is a bypass (one in twenty): what is in flight scales with the traffic.
pub const UNSEEN_SHARE: u64 = 20;

/// One read of the counters of a share's host veth and its programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub at: Instant,
    /// The host veth's own counters: received (from the pod), sent (to the pod).
    pub received: u64,
    pub sent: u64,
    /// Packets ours saw (passed or dropped), from the pod and to the pod.
    pub seen_from_pod: u64,
    pub seen_to_pod: u64,
    /// Our root qdisc on the host veth, when there is one: packets dropped so far, and
    /// held now.
    pub queue_drops: u64,
    pub queue_held: u64,
    /// Packets the pod's end of the veth received, when it can be read (and the share
    /// limits traffic to the pod).
    pub pod_received: Option<u64>,
}

/// Packets that passed the interface without passing ours, per direction, between two
/// samples.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unseen {
    pub from_pod: u64,
    pub to_pod: u64,
    /// Packets that reached the pod's end of the veth without leaving the host veth.
    pub past_host: u64,
    /// Packets the interface carried in the window, per direction.
    pub received: u64,
    pub sent: u64,
}

/// What passed unseen between `base` and `now`. A window in which any counter went back
/// (an interface recreated, a share installed afresh with its slot reset) tells nothing:
/// nothing unseen.
pub fn unseen(base: &Sample, now: &Sample) -> Unseen {
    let went_back = now.received < base.received
        || now.sent < base.sent
        || now.seen_from_pod < base.seen_from_pod
        || now.seen_to_pod < base.seen_to_pod
        || now.queue_drops < base.queue_drops
        || matches!((base.pod_received, now.pod_received), (Some(a), Some(b)) if b < a);
    if went_back {
        return Unseen::default();
    }
    let d = |a: u64, b: u64| b.saturating_sub(a);
    let received = d(base.received, now.received);
    let sent = d(base.sent, now.sent);
    let seen_from = d(base.seen_from_pod, now.seen_from_pod);
    let seen_to = d(base.seen_to_pod, now.seen_to_pod);
    let dropped = d(base.queue_drops, now.queue_drops);
    // Growth of the queue counts as sent; a queue that emptied sent what it had held.
    let to_pod = (sent + dropped + now.queue_held).saturating_sub(seen_to + base.queue_held);
    let past_host = match (base.pod_received, now.pod_received) {
        (Some(a), Some(b)) => d(a, b).saturating_sub(sent),
        _ => 0,
    };
    Unseen {
        from_pod: received.saturating_sub(seen_from),
        to_pod,
        past_host,
        received,
        sent,
    }
}

/// Whether `unseen` packets of `carried` are a bypass ([`IN_FLIGHT`], [`UNSEEN_SHARE`]).
pub fn is_bypass(unseen: u64, carried: u64) -> bool {
    unseen > IN_FLIGHT && unseen > carried / UNSEEN_SHARE
}

/// The verdict on a window, in words for the share's status, or `None` when ours saw
/// the share's traffic.
pub fn verdict(u: &Unseen, iface: &str, ahead: &[(&'static str, usize)]) -> Option<String> {
    let mut parts = Vec::new();
    for (dir, n, carried) in [
        ("from the pod", u.from_pod, u.received),
        ("to the pod", u.to_pod, u.sent),
    ] {
        if is_bypass(n, carried) {
            parts.push(format!(
                "{n} of {carried} packets {dir} on {iface} were not seen by shareguard's programs"
            ));
        }
    }
    let past = is_bypass(u.past_host, u.past_host + u.sent);
    if past {
        parts.push(format!(
            "{} packets reached the pod without leaving {iface} (redirected past the host veth, as bpf_redirect_peer does), where the limit to the pod is",
            u.past_host
        ));
    }
    if parts.is_empty() {
        return None;
    }
    let cause = if ahead.is_empty() && past && parts.len() == 1 {
        "another interface's program delivers them into the pod's namespace directly".to_owned()
    } else if ahead.is_empty() {
        "a program on the interface redirects them past shareguard's".to_owned()
    } else {
        format!(
            "another program on {iface} runs before shareguard's and ends the chain ({})",
            describe_ahead(ahead)
        )
    };
    Some(format!("{}: {cause}", parts.join("; ")))
}

/// The programs ahead of ours, per hook, in words: "1 on egress, 2 on ingress".
pub fn describe_ahead(ahead: &[(&'static str, usize)]) -> String {
    let hooks: Vec<String> = ahead
        .iter()
        .map(|(hook, n)| format!("{n} on {hook}"))
        .collect();
    hooks.join(", ")
}

/// A share's window: where it started, and the last verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub base: Sample,
    pub verdict: Option<String>,
}

impl Window {
    pub fn new(base: Sample) -> Self {
        Window {
            base,
            verdict: None,
        }
    }

    /// Judges the window ending at `now` when it is long enough ([`MIN_WINDOW`]) and
    /// starts the next one there; a shorter one keeps the last verdict. Returns the
    /// verdict that stands.
    pub fn judge(
        &mut self,
        now: Sample,
        iface: &str,
        ahead: &[(&'static str, usize)],
    ) -> Option<String> {
        if now.at.saturating_duration_since(self.base.at) >= MIN_WINDOW {
            self.verdict = verdict(&unseen(&self.base, &now), iface, ahead);
            self.base = now;
        }
        self.verdict.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at: Instant) -> Sample {
        Sample {
            at,
            received: 0,
            sent: 0,
            seen_from_pod: 0,
            seen_to_pod: 0,
            queue_drops: 0,
            queue_held: 0,
            pod_received: Some(0),
        }
    }

    #[test]
    fn a_quiet_pod_and_a_fully_seen_one_are_not_a_bypass() {
        let t = Instant::now();
        let base = sample(t);
        assert_eq!(verdict(&unseen(&base, &base), "v", &[]), None);
        let busy = Sample {
            at: t + MIN_WINDOW,
            received: 1_000_000,
            seen_from_pod: 999_500,
            sent: 500_000,
            seen_to_pod: 530_000,
            queue_drops: 20_000,
            queue_held: 10_000,
            pod_received: Some(500_000),
        };
        let u = unseen(&base, &busy);
        assert_eq!(u.from_pod, 500, "in flight");
        assert_eq!(u.to_pod, 0, "dropped and held by the queue, not unseen");
        assert_eq!(verdict(&u, "v", &[]), None);
    }

    #[test]
    fn traffic_past_the_programs_is_a_bypass_in_its_direction() {
        let t = Instant::now();
        let base = sample(t);
        let leak = Sample {
            at: t + MIN_WINDOW,
            received: 1_500_000,
            seen_from_pod: 10,
            sent: 40_000,
            seen_to_pod: 40_000,
            ..base
        };
        let why = verdict(&unseen(&base, &leak), "veth1", &[("ingress", 1)]).unwrap();
        assert!(
            why.contains("1499990 of 1500000 packets from the pod on veth1"),
            "{why}"
        );
        assert!(!why.contains("to the pod"), "{why}");
        assert!(why.contains("runs before shareguard's"), "{why}");
        // Nothing in front: something redirected them past ours.
        let to = Sample {
            sent: 90_000,
            seen_to_pod: 10,
            received: 0,
            seen_from_pod: 0,
            ..leak
        };
        let why = verdict(&unseen(&base, &to), "veth1", &[]).unwrap();
        assert!(why.contains("to the pod"), "{why}");
        assert!(why.contains("redirects them past"), "{why}");
    }

    #[test]
    fn packets_the_pod_got_past_the_host_veth_are_a_bypass() {
        let t = Instant::now();
        let base = sample(t);
        // Everything the pod received left the host veth: nothing past it.
        let through = Sample {
            at: t + MIN_WINDOW,
            sent: 50_000,
            seen_to_pod: 50_000,
            pod_received: Some(50_000),
            ..base
        };
        assert_eq!(unseen(&base, &through).past_host, 0);
        assert_eq!(verdict(&unseen(&base, &through), "v", &[]), None);
        let past = Sample {
            pod_received: Some(950_000),
            ..through
        };
        let u = unseen(&base, &past);
        assert_eq!(u.past_host, 900_000);
        let why = verdict(&u, "veth9", &[]).unwrap();
        assert!(
            why.contains("900000 packets reached the pod without leaving veth9"),
            "{why}"
        );
        assert!(
            why.contains("delivers them into the pod's namespace directly"),
            "{why}"
        );
        // Unknown on either side: nothing concluded.
        let unknown = Sample {
            pod_received: None,
            ..past
        };
        assert_eq!(unseen(&base, &unknown).past_host, 0);
    }

    #[test]
    fn counters_that_went_back_tell_nothing() {
        let t = Instant::now();
        let base = Sample {
            received: 1_000_000,
            sent: 1_000_000,
            seen_from_pod: 1_000_000,
            seen_to_pod: 1_000_000,
            pod_received: Some(1_000_000),
            ..sample(t)
        };
        // The share installed afresh: its slot's counters start again from 0 while the
        // interface's go on.
        let reset = Sample {
            at: t + MIN_WINDOW,
            received: 1_500_000,
            sent: 1_500_000,
            seen_from_pod: 400_000,
            seen_to_pod: 400_000,
            pod_received: Some(1_500_000),
            ..base
        };
        assert_eq!(unseen(&base, &reset), Unseen::default());
        assert_eq!(verdict(&unseen(&base, &reset), "v", &[]), None);
    }

    #[test]
    fn the_thresholds_hold_in_flight_packets_apart_from_a_leak() {
        assert!(!is_bypass(IN_FLIGHT, 0));
        assert!(is_bypass(IN_FLIGHT + 1, 0));
        assert!(!is_bypass(IN_FLIGHT + 1, (IN_FLIGHT + 1) * UNSEEN_SHARE));
        assert!(is_bypass(100_000, 1_000_000));
    }

    #[test]
    fn a_short_window_keeps_the_last_verdict_and_a_clean_one_clears_it() {
        let t = Instant::now();
        let mut w = Window::new(sample(t));
        let leak = Sample {
            at: t + MIN_WINDOW,
            received: 100_000,
            ..sample(t)
        };
        assert!(w.judge(leak, "v", &[]).is_some());
        // Milliseconds later (an apply right after the verify): still a bypass.
        let soon = Sample {
            at: leak.at + Duration::from_millis(5),
            ..leak
        };
        assert!(w.judge(soon, "v", &[]).is_some());
        // A whole window in which ours saw everything clears it.
        let clean = Sample {
            at: leak.at + MIN_WINDOW,
            received: 200_000,
            seen_from_pod: 100_000,
            ..leak
        };
        assert_eq!(w.judge(clean, "v", &[]), None);
    }
}
