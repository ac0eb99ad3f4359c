//! The markdown tables the isolation bench prints for docs/benchmarks.md, and the
//! figures its plots and its verdict share.

use std::time::Duration;

use shareguard_tests::net::{self, Direction, LoadAvg};

use crate::{Offered, Run, Setup, Variant, nic::queue_bytes};

pub struct Context<'a> {
    pub runs: &'a [Run],
    pub mechanism: &'a str,
    pub seconds: u32,
    pub variant: Variant,
    pub load_before: LoadAvg,
    pub load_after: LoadAvg,
    pub elapsed: Duration,
}

/// Whether `r` is one of the quiet tenant's runs alone.
pub fn is_alone(r: &Run) -> bool {
    r.n == 0
}

/// The quiet tenant's RTT p99 alone in direction `dir`: the median over its alone runs,
/// the yardstick every change is measured against.
pub fn alone_p99(runs: &[Run], dir: Direction) -> f64 {
    let v: Vec<f64> = runs
        .iter()
        .filter(|r| r.dir == dir && is_alone(r))
        .map(|r| net::percentile(&r.quiet, 99.0))
        .collect();
    net::median(&v)
}

/// The runs of N tenants side by side: (N, shares run, whole-NIC run), in run order.
pub fn by_n(runs: &[Run], dir: Direction) -> Vec<(usize, &Run, Option<&Run>)> {
    let of = |setup: Setup| {
        runs.iter()
            .filter(move |r| r.dir == dir && r.setup == setup && r.label.starts_with("shares"))
    };
    of(Setup::Shares)
        .map(|s| {
            let whole = runs.iter().find(|r| {
                r.dir == dir
                    && r.setup == Setup::WholeNic
                    && r.n == s.n
                    && r.label.contains("no shares")
            });
            (s.n, s, whole)
        })
        .collect()
}

fn ms(v: &[f64]) -> String {
    format!("{:.3}", net::percentile(v, 99.0))
}

/// The NIC queue's highest sampled backlog, in ms at the line rate `line_bps`.
fn backlog_ms(r: &Run, line_bps: u64) -> f64 {
    r.nic_backlog.iter().copied().max().unwrap_or(0) as f64 * 8.0 / line_bps as f64 * 1e3
}

/// What a share may send above its rate at once, bytes: its classes' buckets (57 KiB at
/// most) plus one GSO packet HTB lets go into debt (docs/architecture.md, the burst
/// governor). A second within the limit carries at most this much more than the rate.
pub const BURST_BYTES: f64 = (57 + 64) as f64 * 1024.0;

/// How far a flow's highest second went above its limit, KiB (0 when it stayed under).
pub fn excess_kib(f: &crate::Flow) -> Option<f64> {
    f.limit_bps
        .map(|l| ((f.peak_bps - l as f64) / 8.0).max(0.0) / 1024.0)
}

fn change(p99: f64, base: f64) -> String {
    format!("{:+.0}%", (p99 / base - 1.0) * 100.0)
}

fn dirs(runs: &[Run]) -> Vec<Direction> {
    let mut d: Vec<Direction> = Vec::new();
    for r in runs {
        if !d.contains(&r.dir) {
            d.push(r.dir);
        }
    }
    d
}

pub fn print(c: &Context<'_>) {
    let uname = net::sh(&["uname", "-r"]);
    println!("| | |\n|---|---|");
    println!("| kernel | {} |", uname.trim());
    println!("| mechanism (the agent's probe) | {} |", c.mechanism);
    println!(
        "| NIC | {} Mbit/s each way, {} KB FIFO (10 ms) |",
        c.variant.nic_bps / 1_000_000,
        queue_bytes(c.variant.nic_bps) / 1000
    );
    match c.variant.offered {
        Offered::Saturate => {
            println!("| offered load | saturating: each bulk flow as fast as TCP goes |");
        }
        Offered::Paced(f) => println!(
            "| offered load | fixed: each bulk flow paced to {f} x its tenant's share (TCP payload, iperf3 -b), with and without shares |"
        ),
    }
    println!(
        "| per run | 1 s warm-up, {} s measured; sparse flows: ping every 10 ms for {} s, from 0.5 s after the warm-up |",
        c.seconds,
        c.seconds - 1
    );
    println!(
        "| load average before / after | {} / {} |",
        c.load_before, c.load_after
    );
    println!("| bench duration | {:.0} s |", c.elapsed.as_secs_f64());
    println!();
    runs_table(c.runs, c.variant.nic_bps);
    println!();
    quiet_table(c.runs);
    println!();
    targets_table(c.runs);
    println!();
    println!("<details><summary>Every tenant of every run</summary>\n");
    tenants_table(c.runs);
    println!("\n</details>");
}

/// One line per run.
fn runs_table(runs: &[Run], line_bps: u64) {
    println!(
        "| direction | run | N | goodput Mbit/s (sum) | / line rate | goodput / limit, min..max | highest 1 s on the wire / limit, max | sparse flows' p99 ms, median (max) | retransmits | NIC drops | NIC queue max ms | quiet tenant p99 ms | quiet pings lost | quiet to its host end p99 ms | CPU busy |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        let sum: f64 = r.flows.iter().map(|f| f.m.bits_per_second).sum();
        let ratios: Vec<f64> = r
            .flows
            .iter()
            .filter_map(|f| f.limit_bps.map(|l| f.m.bits_per_second / l as f64))
            .collect();
        let peaks: Vec<f64> = r
            .flows
            .iter()
            .filter_map(|f| f.limit_bps.map(|l| f.peak_bps / l as f64))
            .collect();
        let p99s: Vec<f64> = r
            .flows
            .iter()
            .map(|f| net::percentile(&f.rtts, 99.0))
            .collect();
        let dash = |s: String, empty: bool| if empty { "-".to_owned() } else { s };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {:.0}% |",
            r.dir,
            r.label,
            r.n,
            dash(format!("{:.1}", sum / 1e6), r.flows.is_empty()),
            dash(format!("{:.3}", sum / line_bps as f64), r.flows.is_empty()),
            dash(
                format!(
                    "{:.3}..{:.3}",
                    ratios.iter().copied().fold(f64::NAN, f64::min),
                    ratios.iter().copied().fold(f64::NAN, f64::max)
                ),
                ratios.is_empty()
            ),
            dash(
                format!("{:.3}", peaks.iter().copied().fold(f64::NAN, f64::max)),
                peaks.is_empty()
            ),
            dash(
                format!(
                    "{:.3} ({:.3})",
                    net::median(&p99s),
                    p99s.iter().copied().fold(f64::NAN, f64::max)
                ),
                p99s.is_empty()
            ),
            r.flows.iter().map(|f| f.m.retransmits).sum::<u64>(),
            r.nic_drops,
            backlog_ms(r, line_bps),
            ms(&r.quiet),
            (r.quiet_sent as usize).saturating_sub(r.quiet.len()),
            ms(&r.quiet_local),
            r.cpu_busy * 100.0,
        );
    }
}

/// The quiet tenant per N: alone, beside N tenants with shares, beside N unshared.
fn quiet_table(runs: &[Run]) {
    println!(
        "| direction | N | quiet p99 ms, alone just before | with shares | change vs alone (median of alone runs) | to its host end, with shares (CPU only) | whole NIC, no shares | change |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for dir in dirs(runs) {
        let base = alone_p99(runs, dir);
        for (n, shares, whole) in by_n(runs, dir) {
            let before = runs
                .iter()
                .take_while(|r| !std::ptr::eq(*r, shares))
                .filter(|r| r.dir == dir && is_alone(r))
                .last()
                .map_or(f64::NAN, |r| net::percentile(&r.quiet, 99.0));
            let s = net::percentile(&shares.quiet, 99.0);
            let (w, wc) = whole.map_or(("-".to_owned(), "-".to_owned()), |w| {
                let p = net::percentile(&w.quiet, 99.0);
                (format!("{p:.3}"), change(p, base))
            });
            println!(
                "| {dir} | {n} | {before:.3} | {s:.3} | {} | {} | {w} | {wc} |",
                change(s, base),
                ms(&shares.quiet_local),
            );
        }
        let local: Vec<f64> = runs
            .iter()
            .filter(|r| r.dir == dir && is_alone(r))
            .map(|r| net::percentile(&r.quiet_local, 99.0))
            .collect();
        println!(
            "| {dir} | median of alone runs | {base:.3} | | | {:.3} | | |",
            net::median(&local)
        );
    }
}

/// The target's row (docs/architecture.md, Targets), per direction, from the shares runs.
fn targets_table(runs: &[Run]) {
    println!("| target (docs/architecture.md) | direction | measured | met |");
    println!("|---|---|---|---|");
    for dir in dirs(runs) {
        let shares = by_n(runs, dir);
        let peak = shares
            .iter()
            .flat_map(|(_, s, _)| s.flows.iter())
            .filter_map(|f| f.limit_bps.map(|l| f.peak_bps / l as f64))
            .fold(f64::NAN, f64::max);
        let excess = shares
            .iter()
            .flat_map(|(_, s, _)| s.flows.iter())
            .filter_map(excess_kib)
            .fold(0.0, f64::max);
        let goodput = shares
            .iter()
            .flat_map(|(_, s, _)| s.flows.iter())
            .filter_map(|f| f.limit_bps.map(|l| f.m.bits_per_second / l as f64))
            .fold(f64::NAN, f64::max);
        println!(
            "| each tenant within its limit | {dir} | goodput / limit at most {goodput:.3}; highest 1-s rate on the wire / limit at most {peak:.3}, at most {excess:.1} KiB above the limit in that second (a share's burst: {:.0} KiB) (N = 1 to {}) | {} |",
            BURST_BYTES / 1024.0,
            shares.iter().map(|s| s.0).max().unwrap_or(0),
            if excess * 1024.0 <= BURST_BYTES {
                "yes"
            } else {
                "**no**"
            }
        );
        let base = alone_p99(runs, dir);
        let worst = shares
            .iter()
            .map(|(n, s, _)| (*n, net::percentile(&s.quiet, 99.0)))
            .fold(
                (0, f64::NAN),
                |a, b| if b.1 > a.1 || a.1.is_nan() { b } else { a },
            );
        let changes: Vec<String> = shares
            .iter()
            .map(|(n, s, _)| format!("{n}: {}", change(net::percentile(&s.quiet, 99.0), base)))
            .collect();
        println!(
            "| a quiet tenant's p99 moves < 10% | {dir} | alone {base:.3} ms; worst {:.3} ms at N = {} ({}); per N {} | {} |",
            worst.1,
            worst.0,
            change(worst.1, base),
            changes.join(", "),
            if worst.1 / base - 1.0 < 0.10 {
                "yes"
            } else {
                "**no**"
            }
        );
    }
}

fn tenants_table(runs: &[Run]) {
    println!(
        "| direction | run | N | tenant | limit | goodput Mbit/s | / limit | on the wire (L2) Mbit/s | highest 1 s on the wire Mbit/s | / limit | above the limit, KiB | sparse p99 ms | retransmits |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in runs {
        for f in &r.flows {
            let (limit, g, p) =
                f.limit_bps
                    .map_or(("-".to_owned(), "-".to_owned(), "-".to_owned()), |l| {
                        (
                            format!("{}M", l / 1_000_000),
                            format!("{:.3}", f.m.bits_per_second / l as f64),
                            format!("{:.3}", f.peak_bps / l as f64),
                        )
                    });
            println!(
                "| {} | {} | {} | {} | {limit} | {:.1} | {g} | {:.1} | {:.1} | {p} | {} | {} | {} |",
                r.dir,
                r.label,
                r.n,
                f.tenant,
                f.m.bits_per_second / 1e6,
                f.wire_bps / 1e6,
                f.peak_bps / 1e6,
                excess_kib(f).map_or("-".to_owned(), |k| format!("{k:.1}")),
                ms(&f.rtts),
                f.m.retransmits
            );
        }
    }
}
