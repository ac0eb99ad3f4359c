//! HTB and fq qdiscs, installed with iproute2's `tc`.
//!
//! rtnetlink has no HTB or fq support, and their option structures are easy to get subtly
//! wrong by hand; `tc` is the reference implementation of them. What `tc` installed is
//! always read back from the kernel over netlink ([`crate::rtnl::htb_classes`]), never
//! taken from `tc`'s exit status alone.

use std::{
    io::Write,
    process::{Command, Output, Stdio},
};

use crate::error::NetError;

/// The root HTB `1:`.
pub const MAJOR: u16 = 1;
/// The share's class `1:100`, whose rate and ceil are the share's limit: every flow class
/// below it borrows from it, so together they never exceed it. Its rate is what the
/// limiter reads back as enforced.
pub const SHARE_MINOR: u16 = 0x100;
/// The first flow class `1:1`; the programs put each flow in one of `1:1` to `1:10`
/// (hex: [`FLOW_CLASSES`] of them) by its hash, and `1:1` is also the default class.
pub const MINOR: u16 = 1;
/// `1:1` as skb->priority / TC classid: the first flow class.
pub const CLASSID: u32 = (MAJOR as u32) << 16 | MINOR as u32;
pub use shareguard_ebpf_common::FLOW_CLASSES;
/// The priority class `1:11`, right after the flow classes, where the programs put sparse
/// flows (`shareguard_ebpf_common::flows`): HTB serves it before the flow classes.
pub const SPARSE_MINOR: u16 = MINOR + FLOW_CLASSES as u16;

/// HTB parameters for one rate. The defaults of `tc` (a burst of one timer tick's worth
/// at HZ=1000 rounded to the MTU) starve TCP at high rates; see docs/htb-tuning.md for
/// how these were chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtbParams {
    pub rate_bps: u64,
    pub burst_bytes: u64,
    pub quantum_bytes: u64,
    /// Each flow class's FIFO, in bytes.
    pub queue_bytes: u64,
}

/// Smallest burst: two full-size frames, so a single packet never waits for tokens.
const MIN_BURST: u64 = 2 * 1514;

/// A flow class's own burst: one full-size frame. A class within its own tokens sends
/// without asking the share's class, so whatever the classes hold of their own is sent
/// at once past the share's bucket; kept this small, sixteen flows after an idle spell
/// get what one flow gets. What lets a flow make up for time its queue stood empty is
/// the share's bucket, which every flow class borrows from.
const OWN_BURST: u64 = 1514;

/// The share's class's bucket after an idle spell ([`crate::burst`]): what the share
/// sends at once past its rate when it starts again, together with the classes' own
/// bursts at most one 64 KiB burst ([`HtbParams::after_idle_bytes`]).
pub const IDLE_BURST: u64 = 16 * 1024;

/// One sparse flow's whole credit (`shareguard_ebpf_common::flows`): the priority
/// class's own burst is at least this, so that a message that fits it (an RPC's answer,
/// a DNS reply) goes out at once even while bulk flows keep the share's class empty.
const SPARSE_CREDIT: u64 = shareguard_ebpf_common::flows::SPARSE_BURST as u64;

/// The rate at which a sparse flow's credit refills, bit/s: what one flow may send for
/// good and stay sparse.
const SPARSE_CREDIT_BPS: u64 = shareguard_ebpf_common::flows::SPARSE_BYTES_PER_SEC * 8;

/// Whether the classes' own bursts, `own_sum` together, stay within what the share's
/// class may send at once (`share_burst`; below about 40 Mbit/s, within the floor of
/// [`MIN_BURST`] each) plus one sparse flow's credit, give or take `slack` bytes of
/// rounding.
pub fn own_bursts_fit(share_burst: u64, own_sum: u64, slack: u64) -> bool {
    let floors = (u64::from(FLOW_CLASSES) + 1) * MIN_BURST;
    own_sum
        <= share_burst
            .max(floors)
            .saturating_add(SPARSE_CREDIT)
            .saturating_add(slack)
}

/// Ten milliseconds of `rate_bps` in bytes, at least [`MIN_BURST`].
fn burst_for(rate_bps: u64) -> u64 {
    (rate_bps / 8 / 100).max(MIN_BURST)
}

/// One maximal GSO packet: a flow class that borrows from the share's class sends about
/// this much per round when several borrow, which shares the rate among busy flows by
/// bytes. Also keeps tc's default (`rate / 8 / r2q`) from exceeding HTB's 200000-byte cap.
const QUANTUM: u64 = 65_536;
/// Smallest flow queue: four maximal GSO packets.
const MIN_QUEUE: u64 = 4 * 65_536;

impl HtbParams {
    pub fn for_rate(rate_bps: u64) -> HtbParams {
        let bytes_per_s = rate_bps / 8;
        // Ten milliseconds of traffic: the share's class's burst, and every class's
        // cburst. The bucket is what lets the shaper make up for time its queue stood
        // empty while the sender had data: a TCP sender on this node keeps only about a
        // millisecond in the queue (TCP Small Queues), and cuts its window whenever
        // packets arrive out of order, which they do on a veth when the sender's packets
        // leave from different CPUs. With 4 ms the agent's tree measured 0.880 to 0.956 of
        // the limit at 2 Gbit/s under such reordering, with 10 ms 0.949 to 0.956 in the
        // same runs (docs/htb-tuning.md, "Reordering"). A full bucket after an idle spell
        // would let a new flow's first 100 ms carry 1.03 to 1.05 of the limit's and a
        // sender that does not ramp up (UDP) 10 ms of the rate at once: the share's class
        // holds only [`IDLE_BURST`] while the share is idle ([`crate::burst`]).
        let burst_bytes = burst_for(rate_bps);
        HtbParams {
            rate_bps,
            burst_bytes,
            quantum_bytes: QUANTUM,
            // 20 ms of the rate per flow, bounded in bytes rather than packets: a bulk
            // flow keeps the share busy, and sixteen queues of 64 KiB packets counted in
            // packets could hold a gigabyte.
            queue_bytes: (bytes_per_s / 50).max(MIN_QUEUE),
        }
    }

    /// The assured rate of the priority class: a sixteenth of the share's, and at least
    /// what one sparse flow may send and stay sparse (its credit's refill, about
    /// 1 Mbit/s) up to a quarter of the share's. Sparse flows within it are sent at once,
    /// before anything else of the share's; beyond it the class borrows from the share's
    /// class, which the bulk flows keep empty and in debt for whole GSO packets. A
    /// sixteenth alone is below the credit's refill in a share under about 16 Mbit/s, where
    /// a ping or an RPC that keeps within its credit would wait behind the bulk flows
    /// (docs/benchmarks.md, "A sparse flow beside a bulk flow in a small share").
    pub fn sparse_rate_bps(&self) -> u64 {
        let credit_rate = SPARSE_CREDIT_BPS.min(self.rate_bps / 4);
        (self.rate_bps / u64::from(FLOW_CLASSES))
            .max(credit_rate)
            .max(8)
    }

    /// The priority class's own burst: one sparse flow's credit, so that a message that
    /// fits it goes out at once even while bulk flows keep the share's class empty.
    pub fn sparse_burst_bytes(&self) -> u64 {
        SPARSE_CREDIT
    }

    /// A flow class's own burst, [`OWN_BURST`].
    pub fn flow_burst_bytes(&self) -> u64 {
        OWN_BURST
    }

    /// The share's class's bucket while the share is idle ([`crate::burst`]): at most
    /// [`IDLE_BURST`], never more than its bucket while busy.
    pub fn idle_burst_bytes(&self) -> u64 {
        IDLE_BURST.min(self.burst_bytes)
    }

    /// What the tree lets through past the share's rate when traffic starts after an idle
    /// spell, with the share's class at its idle bucket: that bucket plus every class's
    /// own (HTB also lets each class that has tokens send one whole packet, up to one
    /// 64 KiB GSO packet, into debt, which it pays back before it sends again).
    pub fn after_idle_bytes(&self) -> u64 {
        self.idle_burst_bytes()
            + self.sparse_burst_bytes()
            + u64::from(FLOW_CLASSES) * self.flow_burst_bytes()
    }

    /// The assured rate of each flow class: an equal part of what the priority class
    /// leaves. A flow within it is sent at once, without waiting for tokens the other
    /// flows took from the share's class; beyond it a flow borrows from the share's class,
    /// up to the share's rate. HTB lets a class within its assured rate send whatever its
    /// parent has left, so these rates together must not exceed the share's.
    pub fn flow_rate_bps(&self) -> u64 {
        (self.rate_bps.saturating_sub(self.sparse_rate_bps()) / u64::from(FLOW_CLASSES)).max(8)
    }
}

/// Ok when `tc` exited with success, else its stderr as the error of `command`.
fn finished(command: impl FnOnce() -> String, out: &Output) -> Result<(), NetError> {
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Command {
            command: command(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn run(args: &[String]) -> Result<(), NetError> {
    let command = || format!("tc {}", args.join(" "));
    let out = Command::new("tc")
        .args(args)
        .output()
        .map_err(|e| NetError::Command {
            command: command(),
            stderr: format!("cannot run tc: {e}"),
        })?;
    finished(command, &out)
}

/// Runs `lines` (tc commands without the leading `tc`) in one `tc -batch`, which stops at
/// the first that fails.
fn run_batch(lines: &[String]) -> Result<(), NetError> {
    let command = || {
        format!(
            "tc -batch - ({} commands, first: {})",
            lines.len(),
            lines.first().map_or("", String::as_str)
        )
    };
    let mut child = Command::new("tc")
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetError::Command {
            command: command(),
            stderr: format!("cannot run tc: {e}"),
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        stdin
            .write_all(text.as_bytes())
            .map_err(|e| NetError::Command {
                command: command(),
                stderr: format!("writing to tc: {e}"),
            })?;
    }
    let out = child.wait_with_output().map_err(|e| NetError::Command {
        command: command(),
        stderr: format!("waiting for tc: {e}"),
    })?;
    finished(command, &out)
}

/// A filter on a clsact hook, as `tc -j filter show` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub priority: u32,
    pub handle: u32,
    /// A BPF filter's program name, where it has one.
    pub name: Option<String>,
}

/// The filters on `dev`'s clsact `hook` ("ingress" or "egress") in the order they run: by
/// priority, and within one priority in the kernel's list order (the one added last
/// first), which is the order the kernel lists them in. Empty without a clsact qdisc.
pub fn clsact_filters(dev: &str, hook: &str) -> Result<Vec<Filter>, NetError> {
    let args = s(&["-j", "filter", "show", "dev", dev, hook]);
    let command = || format!("tc {}", args.join(" "));
    let out = Command::new("tc")
        .args(&args)
        .output()
        .map_err(|e| NetError::Command {
            command: command(),
            stderr: format!("cannot run tc: {e}"),
        })?;
    finished(command, &out)?;
    parse_filters(&out.stdout).map_err(|reason| NetError::Command {
        command: command(),
        stderr: format!("unexpected output: {reason}"),
    })
}

/// `tc -j filter show` lists each priority's chain head without options, then one entry
/// with options per filter; only the filters count. tc prints nothing at all where there
/// is no filter.
fn parse_filters(json: &[u8]) -> Result<Vec<Filter>, String> {
    if json.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    let entries: Vec<serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for entry in &entries {
        let Some(options) = entry.get("options") else {
            continue;
        };
        let priority = entry
            .get("pref")
            .and_then(serde_json::Value::as_u64)
            .and_then(|p| u32::try_from(p).ok())
            .ok_or_else(|| format!("a filter without a priority: {entry}"))?;
        let handle = options
            .get("handle")
            .and_then(serde_json::Value::as_str)
            .and_then(|h| u32::from_str_radix(h.trim_start_matches("0x"), 16).ok())
            .ok_or_else(|| format!("a filter without a handle: {entry}"))?;
        let name = options
            .get("bpf_name")
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned);
        out.push(Filter {
            priority,
            handle,
            name,
        });
    }
    Ok(out)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_owned()).collect()
}

/// The tc commands that give `dev` the share's tree below an existing root HTB `1:`: the
/// share's class `1:100` (rate = ceil = the limit) and below it [`FLOW_CLASSES`] flow
/// classes `1:1`..`1:10` (`prio 1`) and the priority class `1:11` (`prio 0`, served
/// first), each with an assured part of the rate (together at most the limit), ceil = the
/// limit, and a byte-bounded FIFO. `replace` throughout: run again, it changes the rates
/// in place.
pub fn htb_tree_commands(dev: &str, p: &HtbParams) -> Vec<String> {
    let rate = format!("{}bit", p.rate_bps);
    let burst = format!("{}b", p.burst_bytes);
    // The share's class starts from the idle bucket; the burst governor gives it the
    // full one once the share uses its rate (crate::burst).
    let idle = format!("{}b", p.idle_burst_bytes());
    let mut out = vec![format!(
        "class replace dev {dev} parent 1: classid 1:{SHARE_MINOR:x} htb rate {rate} ceil {rate} burst {idle} cburst {idle} quantum {}",
        p.quantum_bytes
    )];
    for i in 0..=FLOW_CLASSES {
        let minor = u32::from(MINOR) + i;
        let (own, own_burst, prio) = if minor == u32::from(SPARSE_MINOR) {
            (p.sparse_rate_bps(), p.sparse_burst_bytes(), 0)
        } else {
            (p.flow_rate_bps(), p.flow_burst_bytes(), 1)
        };
        out.push(format!(
            "class replace dev {dev} parent 1:{SHARE_MINOR:x} classid 1:{minor:x} htb rate {own}bit ceil {rate} burst {own_burst}b cburst {burst} prio {prio} quantum {}",
            p.quantum_bytes
        ));
        out.push(format!(
            "qdisc replace dev {dev} parent 1:{minor:x} handle {:x}: bfifo limit {}",
            0x10 + minor,
            p.queue_bytes
        ));
    }
    out
}

/// Makes `dev`'s root an HTB `1:` with the share's tree ([`htb_tree_commands`]); its
/// default class is the first flow class, so nothing bypasses the share's class.
/// Idempotent: when the root HTB with the share's class is already there (`tree_is_ours`)
/// only the classes and leaves are replaced in place, since HTB refuses to "change" a
/// root it already is; there is never a window in which the interface is unlimited. An
/// HTB root of ours without the share's class (an older layout) is rebuilt.
pub fn install_htb(
    dev: &str,
    p: &HtbParams,
    root_is_ours: bool,
    tree_is_ours: bool,
) -> Result<(), NetError> {
    let mut lines = Vec::new();
    if root_is_ours && !tree_is_ours {
        lines.push(format!("qdisc del dev {dev} root"));
    }
    if !tree_is_ours {
        lines.push(format!(
            "qdisc replace dev {dev} root handle 1: htb default {MINOR:x}"
        ));
    }
    lines.extend(htb_tree_commands(dev, p));
    run_batch(&lines)
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
    fn filters_are_listed_in_the_order_tc_prints_them_without_chain_heads() {
        let json = br#"[{"protocol":"all","pref":1,"kind":"bpf","chain":0},
            {"protocol":"all","pref":1,"kind":"bpf","chain":0,"options":{"handle":"0x5347","bpf_name":"sg_ingress","direct-action":true}},
            {"protocol":"all","pref":1,"kind":"bpf","chain":0,"options":{"handle":"0x1","bytecode":{"length":1}}},
            {"protocol":"all","pref":2,"kind":"bpf","chain":0},
            {"protocol":"all","pref":2,"kind":"bpf","chain":0,"options":{"handle":"0x3","bpf_name":"cil_from_container"}}]"#;
        let filters = parse_filters(json).unwrap();
        let seen: Vec<(u32, u32, Option<&str>)> = filters
            .iter()
            .map(|f| (f.priority, f.handle, f.name.as_deref()))
            .collect();
        assert_eq!(
            seen,
            [
                (1, 0x5347, Some("sg_ingress")),
                (1, 1, None),
                (2, 3, Some("cil_from_container"))
            ]
        );
        assert_eq!(parse_filters(b"\n").unwrap(), []);
        assert!(parse_filters(br#"[{"pref":1,"options":{}}]"#).is_err());
        assert!(parse_filters(b"not json").is_err());
    }

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
    fn the_tree_is_the_share_class_over_sixteen_flow_classes_and_a_priority_class() {
        let p = HtbParams::for_rate(50_000_000);
        let lines = htb_tree_commands("d", &p);
        assert_eq!(lines.len(), 1 + 2 * (FLOW_CLASSES as usize + 1));
        assert_eq!(
            lines[0],
            "class replace dev d parent 1: classid 1:100 htb rate 50000000bit ceil 50000000bit burst 16384b cburst 16384b quantum 65536"
        );
        assert_eq!(
            lines[1],
            "class replace dev d parent 1:100 classid 1:1 htb rate 2929687bit ceil 50000000bit burst 1514b cburst 62500b prio 1 quantum 65536"
        );
        assert_eq!(
            lines[2],
            "qdisc replace dev d parent 1:1 handle 11: bfifo limit 262144"
        );
        assert!(lines[31].contains("classid 1:10 "), "{}", lines[31]);
        assert_eq!(
            lines[33],
            "class replace dev d parent 1:100 classid 1:11 htb rate 3125000bit ceil 50000000bit burst 16384b cburst 62500b prio 0 quantum 65536"
        );
        assert_eq!(
            lines[34],
            "qdisc replace dev d parent 1:11 handle 21: bfifo limit 262144"
        );
        assert_eq!(HtbParams::for_rate(2_000_000_000).queue_bytes, 5_000_000);
    }

    #[test]
    fn assured_rates_together_never_exceed_the_share() {
        for rate in [
            8,
            1_000,
            2_000_000,
            5_000_000,
            50_000_000,
            2_000_000_000,
            99_999_999_999,
            u64::MAX / 2,
        ] {
            let p = HtbParams::for_rate(rate);
            let sum = p.sparse_rate_bps() + u64::from(FLOW_CLASSES) * p.flow_rate_bps();
            assert!(sum <= rate.max(17 * 8), "{rate}: {sum}");
        }
    }

    #[test]
    fn a_sparse_flow_within_its_credit_is_assured_in_small_shares() {
        // From about 4.2 Mbit/s up, the priority class assures a whole sparse flow's
        // refill; below, a quarter of the share; from 16.8 Mbit/s, a sixteenth.
        for rate in [4_200_000, 5_000_000, 10_000_000, 16_000_000] {
            let p = HtbParams::for_rate(rate);
            assert_eq!(p.sparse_rate_bps(), SPARSE_CREDIT_BPS, "{rate}");
        }
        assert_eq!(HtbParams::for_rate(2_000_000).sparse_rate_bps(), 500_000);
        for rate in [20_000_000, 50_000_000, 2_000_000_000] {
            let p = HtbParams::for_rate(rate);
            assert_eq!(p.sparse_rate_bps(), rate / 16, "{rate}");
        }
        // The flow classes share what is left.
        let p = HtbParams::for_rate(5_000_000);
        assert_eq!(p.flow_rate_bps(), (5_000_000 - SPARSE_CREDIT_BPS) / 16);
    }

    #[test]
    fn own_bursts_together_stay_within_the_share_burst() {
        for rate in [
            1_000_000,
            50_000_000,
            200_000_000,
            2_000_000_000,
            100_000_000_000,
        ] {
            let p = HtbParams::for_rate(rate);
            let sum = p.sparse_burst_bytes() + u64::from(FLOW_CLASSES) * p.flow_burst_bytes();
            assert!(own_bursts_fit(p.burst_bytes, sum, 0), "{rate}: {sum}");
            assert!(p.sparse_burst_bytes() >= SPARSE_CREDIT, "{rate}");
            // With the share's class at its idle bucket, the read-back still takes the
            // tree as the share's.
            assert!(own_bursts_fit(p.idle_burst_bytes(), sum, 0), "{rate}: idle");
        }
        // The tree as it was: every class with the share's whole burst.
        let p = HtbParams::for_rate(2_000_000_000);
        assert!(!own_bursts_fit(p.burst_bytes, 17 * p.burst_bytes, 1_000));
    }

    #[test]
    fn after_idle_the_tree_lets_through_at_most_one_burst_past_the_rate() {
        for rate in [1_000_000, 50_000_000, 2_000_000_000, 100_000_000_000] {
            let p = HtbParams::for_rate(rate);
            assert!(
                p.after_idle_bytes() <= 65_536,
                "{rate}: {}",
                p.after_idle_bytes()
            );
            assert!(p.idle_burst_bytes() <= p.burst_bytes);
        }
        // From 13 Mbit/s up, the busy bucket is larger than the idle one: that is where
        // shrinking it after an idle spell matters.
        assert!(HtbParams::for_rate(50_000_000).idle_burst_bytes() < 62_500);
        assert_eq!(HtbParams::for_rate(1_000_000).idle_burst_bytes(), MIN_BURST);
    }

    #[test]
    fn fq_goes_at_the_root_under_our_handle() {
        assert_eq!(
            fq_args("sgh1").join(" "),
            "qdisc replace dev sgh1 root handle 1: fq"
        );
    }
}
