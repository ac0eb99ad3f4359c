//! HTB qdiscs and classes, installed with iproute2's `tc`.
//!
//! rtnetlink has no HTB support, and HTB's option structures are easy to get subtly
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

/// Smallest burst: a few full-size frames, so a single packet never waits for tokens.
const MIN_BURST: u64 = 4 * 1514;
/// HTB refuses a quantum above 200000 bytes (it warns and clamps).
const MAX_QUANTUM: u64 = 200_000;

impl HtbParams {
    pub fn for_rate(rate_bps: u64) -> HtbParams {
        let bytes_per_s = rate_bps / 8;
        // Two milliseconds of traffic: enough to ride over timer slack at 2 Gbit/s,
        // small against the one-second windows over which a limit is judged.
        let burst_bytes = (bytes_per_s / 500).max(MIN_BURST);
        HtbParams {
            rate_bps,
            burst_bytes,
            quantum_bytes: burst_bytes.clamp(1514, MAX_QUANTUM),
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

/// Removes the root qdisc of `dev` (ours: the caller checked it is the HTB `1:`).
pub fn remove_root(dev: &str) -> Result<(), NetError> {
    run(&s(&["qdisc", "del", "dev", dev, "root"]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_scales_with_rate_and_has_a_floor() {
        assert_eq!(HtbParams::for_rate(2_000_000_000).burst_bytes, 500_000);
        assert_eq!(HtbParams::for_rate(1_000_000).burst_bytes, MIN_BURST);
        assert!(HtbParams::for_rate(100_000_000_000).quantum_bytes <= MAX_QUANTUM);
        assert_eq!(CLASSID, 0x0001_0001);
    }
}
