//! HTB and fq qdiscs, installed with iproute2's `tc`.
//!
//! rtnetlink has no HTB or fq support, and their option structures are easy to get subtly
//! wrong by hand; `tc` is the reference implementation of them. What `tc` installed is
//! always read back from the kernel over netlink ([`crate::rtnl::htb_class_rate`]), never
//! taken from `tc`'s exit status alone.

use std::process::Command;

use crate::error::NetError;

/// The class every share's traffic goes to: `1:1` under the root HTB `1:`.
pub const MAJOR: u16 = 1;
pub const MINOR: u16 = 1;
/// `1:1` as skb->priority / TC classid.
pub const CLASSID: u32 = (MAJOR as u32) << 16 | MINOR as u32;

/// HTB parameters for one rate. The defaults of `tc` (a burst of one timer tick's worth
/// at HZ=1000 rounded to the MTU) starve TCP at high rates; see docs/htb-tuning.md for
/// how these were chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtbParams {
    pub rate_bps: u64,
    pub burst_bytes: u64,
    pub quantum_bytes: u64,
    pub queue_packets: u32,
}

/// Smallest burst: two full-size frames, so a single packet never waits for tokens.
const MIN_BURST: u64 = 2 * 1514;
/// One maximal GSO packet. With one class per root there is nothing to share
/// round-robin, so the value does not change throughput; setting it keeps tc's default
/// (`rate / 8 / r2q`) from exceeding HTB's 200000-byte cap and printing a warning.
const QUANTUM: u64 = 65_536;

impl HtbParams {
    pub fn for_rate(rate_bps: u64) -> HtbParams {
        let bytes_per_s = rate_bps / 8;
        // Ten milliseconds of traffic, for burst and cburst alike: with less, HTB loses
        // tokens whenever a dequeue comes late, and on a busy 2-core machine 1 to 2 ms
        // fell to 0.93-0.94 of the limit at 2 Gbit/s while 10 ms held 0.955
        // (docs/htb-tuning.md). The cost is at most 10 ms of line-rate burst after idle.
        let burst_bytes = (bytes_per_s / 100).max(MIN_BURST);
        HtbParams {
            rate_bps,
            burst_bytes,
            quantum_bytes: QUANTUM,
            // Explicit, because HTB's default leaf is as long as the device's txqueuelen:
            // 32 packets on an ifb, which overflowed at 2 Gbit/s with 16 KiB packets.
            queue_packets: 1000,
        }
    }
}

fn run(args: &[String]) -> Result<(), NetError> {
    let out = Command::new("tc")
        .args(args)
        .output()
        .map_err(|e| NetError::Command {
            command: format!("tc {}", args.join(" ")),
            stderr: format!("cannot run tc: {e}"),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Command {
            command: format!("tc {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_owned()).collect()
}

/// Makes `dev`'s root an HTB `1:` whose only class `1:1` (also the default class, so
/// nothing bypasses it) has rate = ceil = `p.rate_bps`, with a FIFO leaf of
/// `p.queue_packets`. Idempotent: when the root HTB is already there (`root_is_ours`)
/// only the class and leaf are replaced in place, since HTB refuses to "change" a root it
/// already is; there is never a window in which the interface is unlimited.
pub fn install_htb(dev: &str, p: &HtbParams, root_is_ours: bool) -> Result<(), NetError> {
    if !root_is_ours {
        run(&s(&[
            "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1",
        ]))?;
    }
    let rate = format!("{}bit", p.rate_bps);
    let burst = format!("{}b", p.burst_bytes);
    let quantum = p.quantum_bytes.to_string();
    run(&s(&[
        "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", &rate,
        "ceil", &rate, "burst", &burst, "cburst", &burst, "quantum", &quantum,
    ]))?;
    let limit = p.queue_packets.to_string();
    run(&s(&[
        "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", "pfifo", "limit", &limit,
    ]))
}

/// Arguments that make `dev`'s root an `fq` qdisc `1:` with its defaults, for EDT: fq
/// holds each packet until its `skb->tstamp` (set by the BPF programs) and keeps flows in
/// separate queues. Its own horizon (10 s) never applies: the programs drop anything
/// further ahead than [`crate::mechanism::EDT_HORIZON_NS`]. `replace` is idempotent.
pub fn fq_args(dev: &str) -> Vec<String> {
    s(&["qdisc", "replace", "dev", dev, "root", "handle", "1:", "fq"])
}

/// Makes `dev`'s root the `fq` of [`fq_args`].
pub fn install_fq(dev: &str) -> Result<(), NetError> {
    run(&fq_args(dev))
}

/// Removes the root qdisc of `dev` (ours: the caller checked it is the HTB or fq `1:`).
pub fn remove_root(dev: &str) -> Result<(), NetError> {
    run(&s(&["qdisc", "del", "dev", dev, "root"]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_scales_with_rate_and_has_a_floor() {
        // 10 ms of 2 Gbit/s is 2.5 MB.
        assert_eq!(HtbParams::for_rate(2_000_000_000).burst_bytes, 2_500_000);
        assert_eq!(HtbParams::for_rate(50_000_000).burst_bytes, 62_500);
        assert_eq!(HtbParams::for_rate(1_000_000).burst_bytes, MIN_BURST);
        assert!(HtbParams::for_rate(100_000_000_000).quantum_bytes <= 200_000);
        assert_eq!(CLASSID, 0x0001_0001);
    }

    #[test]
    fn fq_goes_at_the_root_under_our_handle() {
        assert_eq!(
            fq_args("sgh1").join(" "),
            "qdisc replace dev sgh1 root handle 1: fq"
        );
    }
}
