//! The one NIC every tenant's traffic crosses: a "remote host" (a network namespace) behind
//! one veth pair whose two directions are each shaped to the NIC's line rate with a queue
//! of 10 ms at that rate ([`queue_bytes`]), routed to from the root namespace, where every
//! tenant pod's host-side veth is and where the agent puts its limits.
//!
//! Routing rather than a bridge: the harness's pods each have their own /30 with the host
//! end's address as the gateway, as a routed CNI (Calico, Cilium in native routing) sets
//! them up, so the root namespace forwards between the pods and the NIC. Forwarding is
//! switched on per interface (`net.ipv4.conf.<if>.forwarding`, which is what IPv4 checks
//! on the interface a packet arrives on), only on links the bench made, so the machine's
//! own `ip_forward` stays as it was and nothing is left to restore: the setting goes with
//! the link.

use std::{fs, net::Ipv4Addr};

use shareguard_tests::{
    net::{self, Direction, Htb, Leaf, Netns, Pod, Qdisc},
    pod,
};

/// The NIC's queue in each direction for a line rate of `line_bps`: 10 ms at line rate, a
/// byte limit (a packet limit would let 64 KiB GSO packets make it 50 times longer). About
/// what a NIC's ring and a FIFO qdisc in front of it hold without AQM; the same queue with
/// and without shares, so the comparison is about who fills it.
pub fn queue_bytes(line_bps: u64) -> u64 {
    line_bps / 8 / 100
}

/// The remote host and its link. Dropping it removes the qdisc, then the link and the
/// namespace (the `Pod` guard), also on panic.
pub struct Nic {
    _egress: Qdisc,
    remote: Pod,
}

impl Nic {
    /// The NIC, shaped to `line_bps` each way.
    pub fn new(line_bps: u64) -> Nic {
        // A pod's network without a sandbox: the harness's namespace, veth and address
        // block, and nothing the agent would take for a pod.
        let remote = Pod::network_only(&pod::pod_uid());
        forward(remote.host_if());
        remote.netns().sh(&[
            "ip",
            "route",
            "add",
            "198.18.0.0/15",
            "via",
            &remote.host_addr().to_string(),
        ]);
        let htb = Htb {
            leaf: Leaf::Bfifo(queue_bytes(line_bps)),
            ..Htb::new(line_bps)
        };
        // From the pods to the remote host: the root namespace's end of the wire.
        let egress = htb.apply(remote.host_if());
        // To the pods: the remote end, inside its namespace (gone with it).
        for c in htb.commands(remote.pod_if()) {
            let args: Vec<&str> = c.iter().map(String::as_str).collect();
            remote.netns().sh(&args);
        }
        Nic {
            _egress: egress,
            remote,
        }
    }

    /// Routes `pod`'s traffic through the NIC: forwarding on its host end, and a default
    /// route through it in the pod.
    pub fn attach(&self, pod: &Pod) {
        forward(pod.host_if());
        pod.netns().sh(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &pod.host_addr().to_string(),
        ]);
    }

    /// The remote host's namespace, where the iperf3 clients run.
    pub fn netns(&self) -> &Netns {
        self.remote.netns()
    }

    /// The remote host's address, the other end of every tenant's sparse flow.
    pub fn addr(&self) -> Ipv4Addr {
        self.remote.pod_addr()
    }

    /// Packets the NIC's queue in `dir` has dropped so far (the HTB root counts its leaf's
    /// drops).
    pub fn drops(&self, dir: Direction) -> u64 {
        self.queue_stat(dir, "drops")
    }

    /// Bytes waiting in the NIC's queue in `dir` now.
    pub fn backlog(&self, dir: Direction) -> u64 {
        self.queue_stat(dir, "backlog")
    }

    fn queue_stat(&self, dir: Direction, key: &str) -> u64 {
        let (ns, dev) = match dir {
            Direction::FromPod => (None, self.remote.host_if()),
            Direction::ToPod => (Some(self.remote.netns_name()), self.remote.pod_if()),
        };
        let mut args = vec!["tc"];
        if let Some(ns) = ns {
            args.extend(["-n", ns]);
        }
        args.extend(["-s", "-j", "qdisc", "show", "dev", dev, "root"]);
        let out = net::sh(&args);
        serde_json::from_str::<serde_json::Value>(&out)
            .ok()
            .and_then(|v| {
                v.get(0)
                    .and_then(|q| q.get(key))
                    .and_then(serde_json::Value::as_u64)
            })
            .unwrap_or_else(|| panic!("no {key} in `{}`: {out}", args.join(" ")))
    }
}

/// Lets the root namespace forward what arrives on `dev`.
fn forward(dev: &str) {
    let path = format!("/proc/sys/net/ipv4/conf/{dev}/forwarding");
    fs::write(&path, "1").unwrap_or_else(|e| panic!("{path}: {e}"));
}
