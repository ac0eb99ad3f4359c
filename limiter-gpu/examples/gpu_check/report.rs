//! What a run found, judged against the share and printed as the summary.

use super::*;

#[derive(Debug, Default)]
pub(crate) struct Report {
    /// Some(enforced memory as read back by the limiter) when apply succeeded.
    pub(crate) applied: Option<Option<String>>,
    pub(crate) apply_error: Option<String>,
    pub(crate) limit_while_prepared: Option<String>,
    pub(crate) limit_after_release: Option<String>,
    /// The MPS limit read back from the share's daemon, where `mps` was chosen.
    pub(crate) mps_while_prepared: Option<String>,
    pub(crate) mps_after_release: Option<String>,
    /// Why the test cgroup could not be made, when it could not.
    pub(crate) cgroup_error: Option<String>,
}

/// The result of a mechanism the limiter chose, from the apply and the allocator's log;
/// `by` names what would block the allocator ("driver", "MPS").
pub(crate) fn enforcement_result(
    opts: &Opts,
    report: &Report,
    run: Option<&AllocatorRun>,
    by: &str,
) -> String {
    let limit = short(opts.share_bytes);
    if let Some(e) = &report.apply_error {
        return format!("not enforced: apply failed: {e}");
    }
    if matches!(report.applied, Some(None)) {
        return "not enforced: the limit read back does not match the share".into();
    }
    match run {
        None => "limit set and read back; no allocator ran, so nothing was blocked".into(),
        Some(r) if !r.log.any_line => "not exercised: the allocator did not run".into(),
        Some(r) => match (&r.log.init_failed, &r.log.fail) {
            (Some(e), _) => format!("allocator failed at CUDA init, before allocating: {e}"),
            (None, Some((t, e))) if *t <= opts.share_bytes => format!(
                "blocked by {by}: allocation stopped at {} of {} ({e})",
                short(*t),
                short(opts.alloc_bytes)
            ),
            (None, Some((t, e))) => format!(
                "NOT blocked at the limit: allocator got {} > {limit} before failing ({e})",
                short(*t)
            ),
            (None, None) if r.log.reached > opts.share_bytes => format!(
                "NOT blocked: allocator got {} with a {limit} limit",
                short(r.log.reached)
            ),
            (None, None) => format!(
                "not exercised: allocator reported {} and no failure",
                short(r.log.reached)
            ),
        },
    }
}

pub(crate) fn print_summary(
    opts: &Opts,
    limiter: &GpuLimiter,
    device: &shareguard_limiter_gpu::limiter::GpuDevice,
    mps: Option<Support>,
    report: &Report,
    run: Option<&AllocatorRun>,
) {
    let limit = short(opts.share_bytes);
    if let Some(r) = run {
        let st = match (r.status, r.timed_out) {
            (_, true) => "timed out, killed".to_string(),
            (Some(s), _) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("exit {c}"),
                (None, Some(sig)) => format!("signal {sig}"),
                _ => s.to_string(),
            },
            (None, _) => "unknown".into(),
        };
        let via = r.log.start.as_deref().unwrap_or("did not report how");
        println!("allocator pid {}: {via}; {st}", r.pid);
        match (&r.log.init_failed, &r.log.fail) {
            (Some(e), _) => println!("allocator: CUDA init failed: {e}"),
            (None, Some((t, e))) => println!(
                "allocator: got {} of {} asked, then: {e}",
                short(*t),
                short(opts.alloc_bytes)
            ),
            (None, None) => println!(
                "allocator: got {} of {} asked{}",
                short(r.log.reached),
                short(opts.alloc_bytes),
                if r.log.done { ", no error" } else { "" }
            ),
        }
    }

    let mut rows: Vec<[String; 3]> = vec![[
        "mechanism".into(),
        "result".into(),
        "enforced limit read back".into(),
    ]];

    // nvml-cgroup
    let cgroup_why = device
        .not_chosen
        .iter()
        .find(|(m, _)| *m == Mechanism::NvmlCgroup)
        .map(|(_, w)| w.clone());
    let while_prepared = report
        .limit_while_prepared
        .clone()
        .unwrap_or_else(|| "-".into());
    let after = report
        .limit_after_release
        .clone()
        .unwrap_or_else(|| "-".into());
    let cgroup_supported = cgroup_why.is_none();
    let nvml_result = match cgroup_why {
        Some(why) => format!("not supported: {why}"),
        None => enforcement_result(opts, report, run, "driver"),
    };
    rows.push([
        limiter.label(Mechanism::NvmlCgroup),
        nvml_result,
        if cgroup_supported {
            format!("prepared: {while_prepared}; after release: {after}")
        } else {
            "- (no driver limit)".into()
        },
    ]);

    // mps
    let mps_why = device
        .not_chosen
        .iter()
        .find(|(m, _)| *m == Mechanism::Mps)
        .map(|(_, w)| w.clone());
    let (mps_result, mps_read_back) = if let Some(why) = mps_why {
        (format!("not supported: {why}"), "- (no MPS daemon)".into())
    } else if device.mechanism == Mechanism::Mps {
        let prepared = report.mps_while_prepared.as_deref().unwrap_or("-");
        let after = report.mps_after_release.as_deref().unwrap_or("-");
        (
            enforcement_result(opts, report, run, "MPS"),
            format!("prepared: {prepared}; after release: {after}"),
        )
    } else {
        // A stronger mechanism came first, so no MPS daemon was started; the probe
        // still says whether MPS would have been usable.
        let chosen = limiter.label(device.mechanism);
        match mps {
            Some(Support::Unsupported(why)) => {
                (format!("not supported: {why}"), "- (no MPS daemon)".into())
            }
            Some(Support::Supported) => (
                format!("not attempted: {chosen} chosen first (MPS itself is supported)"),
                "- (no MPS daemon started)".into(),
            ),
            None => (
                format!("not attempted: {chosen} chosen first"),
                "- (no MPS daemon started)".into(),
            ),
        }
    };
    rows.push([limiter.label(Mechanism::Mps), mps_result, mps_read_back]);

    // watchdog
    let wd_result = match run {
        None => "not exercised: no allocator ran".to_string(),
        Some(r) if !r.log.any_line => "not exercised: the allocator did not run".into(),
        Some(r) => {
            let w = &r.watch;
            if let Some((t, used, lim)) = w.first_over {
                let act = if w.terminated.is_empty() {
                    match opts.action {
                        Action::Report => "reported (action report)".to_string(),
                        Action::Terminate { .. } => "not terminated (exited first)".to_string(),
                    }
                } else {
                    format!("terminated: {}", w.terminated.join(", "))
                };
                format!(
                    "caught by watchdog: over limit at t={t:.1}s ({} > {}), {act}",
                    short(used),
                    short(lim)
                )
            } else if w.attributed {
                format!(
                    "nothing to catch: allocator stayed within {limit} (max seen {})",
                    w.max_used.map_or_else(|| "unknown".into(), short)
                )
            } else if w.seen && report.cgroup_error.is_some() {
                "NOT caught: NVML listed the allocator, but with no test cgroup it is in no pod"
                    .into()
            } else if w.seen {
                "NOT caught: NVML listed the allocator but it was not attributed to the test pod"
                    .into()
            } else if !w.errors.is_empty() {
                format!("NOT caught: {}", w.errors.join("; "))
            } else if device.mechanism == Mechanism::Mps {
                format!(
                    "NOT caught: allocator pid {} never in NVML's process list ({} polls; under MPS the list may show the MPS server instead of its clients)",
                    r.pid, w.polls
                )
            } else {
                format!(
                    "NOT caught: allocator pid {} never in NVML's process list ({} polls; pid namespace, or no CUDA context)",
                    r.pid, w.polls
                )
            }
        }
    };
    rows.push([
        limiter.label(Mechanism::Watchdog),
        wd_result,
        format!("- (reacts only; watched {limit} from the share table)"),
    ]);

    let w0 = rows.iter().map(|r| r[0].len()).max().unwrap_or(0);
    let w1 = rows.iter().map(|r| r[1].len()).max().unwrap_or(0);
    println!();
    for (i, r) in rows.iter().enumerate() {
        println!("{:<w0$} | {:<w1$} | {}", r[0], r[1], r[2]);
        if i == 0 {
            println!(
                "{}-+-{}-+-{}",
                "-".repeat(w0),
                "-".repeat(w1),
                "-".repeat(24)
            );
        }
    }
    println!();
    println!(
        "limiter's choice for this GPU: {}",
        limiter.label(device.mechanism)
    );
}
