//! The PyTorch allocator a run starts in the share's cgroup, its output read as it comes,
//! and the watchdog polled beside it.

use super::*;

/// Kills and reaps the allocator if it is still running when dropped.
pub(crate) struct ChildGuard(pub(crate) Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take()
            && let Ok(None) = c.try_wait()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct AllocatorLog {
    /// At least one line of the protocol came: the allocator ran as intended.
    pub(crate) any_line: bool,
    pub(crate) start: Option<String>,
    pub(crate) reached: u64,
    pub(crate) fail: Option<(u64, String)>,
    pub(crate) init_failed: Option<String>,
    pub(crate) done: bool,
}

impl AllocatorLog {
    pub(crate) fn take_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("ALLOC ") else {
            return;
        };
        self.any_line = true;
        let (kind, rest) = rest.split_once(' ').unwrap_or((rest, ""));
        let (fields, error) = match rest.split_once("error=") {
            Some((f, e)) => (f, Some(e.to_string())),
            None => (rest, None),
        };
        let total = fields
            .split_whitespace()
            .find_map(|f| f.strip_prefix("total="))
            .and_then(|v| v.parse::<u64>().ok());
        match kind {
            "start" => self.start = Some(rest.to_string()),
            "ok" | "holding" => self.reached = total.unwrap_or(self.reached).max(self.reached),
            "done" => self.done = true,
            "fail" => {
                let t = total.unwrap_or(self.reached);
                self.fail = Some((t, error.unwrap_or_default()));
            }
            "init-failed" => self.init_failed = Some(error.unwrap_or_default()),
            _ => {}
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct WatchLog {
    pub(crate) polls: u32,
    /// NVML listed the allocator's pid at least once.
    pub(crate) seen: bool,
    /// The allocator's pid was attributed to the test pod.
    pub(crate) attributed: bool,
    pub(crate) max_used: Option<u64>,
    /// (seconds after start, used, limit) of the first over-limit event.
    pub(crate) first_over: Option<(f64, u64, u64)>,
    pub(crate) terminated: Vec<String>,
    pub(crate) errors: Vec<String>,
}

pub(crate) struct AllocatorRun {
    pub(crate) pid: u32,
    pub(crate) status: Option<ExitStatus>,
    pub(crate) timed_out: bool,
    pub(crate) log: AllocatorLog,
    pub(crate) watch: WatchLog,
}

#[derive(Clone, Copy)]
pub(crate) enum Stream {
    Out,
    Err,
}

pub(crate) fn spawn_reader(
    src: impl Read + Send + 'static,
    which: Stream,
    tx: mpsc::Sender<(Stream, String)>,
) {
    thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            if tx.send((which, line)).is_err() {
                break;
            }
        }
    });
}

pub(crate) fn drain(rx: &Receiver<(Stream, String)>, log: &mut AllocatorLog, wait: Duration) {
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((Stream::Out, line)) => {
                println!("  allocator| {line}");
                log.take_line(&line);
            }
            Ok((Stream::Err, line)) => println!("  allocator stderr| {line}"),
            Err(_) => return,
        }
    }
}

pub(crate) fn pod_of(pid: u32) -> Option<String> {
    pod_uid_of_pid(Path::new("/proc"), &agent_namespace().roots(), pid)
}

pub(crate) fn run_allocator(
    opts: &Opts,
    backend: &Back,
    limiter: &GpuLimiter,
    gpu: &GpuInfo,
    cgroup: Option<&TestCgroup>,
    mps: Option<&MpsDirs>,
) -> Result<AllocatorRun, String> {
    let (prog, args) = opts
        .allocator
        .split_first()
        .ok_or("empty allocator command")?;
    // The shell joins the cgroup and then becomes the allocator (same pid), so the
    // allocator's first CUDA call already happens inside the pod. Under MPS it first
    // takes the share daemon's /dev/shm, in a mount namespace of its own, as the CDI
    // spec gives a container: MPS clients meet their server there too.
    let mut argv = mps.map(|m| with_shm(&m.shm)).unwrap_or_default();
    argv.extend(["/bin/sh".into(), "-c".into()]);
    argv.push(
        r#"cg=$1; shift; if [ -n "$cg" ]; then echo $$ > "$cg" || exit 97; fi; exec "$@""#.into(),
    );
    argv.push("sh".into());
    argv.push(
        cgroup
            .map(|cg| cg.ctr.join("cgroup.procs").to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]).arg(prog).args(args);
    let mps_pipe_dir = mps.map(|m| m.pipe.as_path());
    cmd.env("CUDA_VISIBLE_DEVICES", &gpu.uuid)
        .env("GPU_CHECK_TARGET_BYTES", opts.alloc_bytes.to_string())
        .env("GPU_CHECK_STEP_BYTES", opts.step_bytes.to_string())
        .env("GPU_CHECK_HOLD_SECONDS", opts.hold.as_secs().to_string())
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match mps_pipe_dir {
        // As the share's CDI spec does for its containers: the allocator becomes a
        // client of the share's own MPS daemon, under the limit read back above.
        Some(dir) => {
            cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir);
            println!(
                "allocator env: CUDA_MPS_PIPE_DIRECTORY={} (the share's MPS daemon)",
                dir.display()
            );
            if let Some(m) = mps {
                println!("allocator /dev/shm: {} (the daemon's)", m.shm.display());
            }
        }
        // Not inherited from this program's environment: a container of a share
        // without MPS gets none either.
        None => {
            cmd.env_remove("CUDA_MPS_PIPE_DIRECTORY");
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start the allocator {:?}: {e}", opts.allocator))?;
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    if let Some(out) = child.stdout.take() {
        spawn_reader(out, Stream::Out, tx.clone());
    }
    if let Some(err) = child.stderr.take() {
        spawn_reader(err, Stream::Err, tx);
    }
    let mut guard = ChildGuard(Some(child));
    println!("allocator started: pid {pid}");

    let start = Instant::now();
    let mut log = AllocatorLog::default();
    let mut watch = WatchLog::default();
    let mut wd = Watchdog::new();
    let terminator = PidfdTerminator::default().with_roots(agent_namespace().roots());
    let mut last_line = String::new();
    let mut timed_out = false;
    let status = loop {
        drain(&rx, &mut log, Duration::ZERO);
        backend.feed(
            &gpu.uuid,
            pid,
            log.start
                .is_some()
                .then_some(log.reached)
                .filter(|_| !log.done),
            mps.is_some(),
        );
        poll_watchdog(
            backend,
            limiter,
            gpu,
            opts.action,
            pid,
            start,
            &mut wd,
            &terminator,
            &mut watch,
            &mut last_line,
        );
        let Some(child) = guard.0.as_mut() else {
            break None;
        };
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) => {}
            Err(e) => {
                println!("allocator: wait failed: {e}");
                break None;
            }
        }
        if start.elapsed() > opts.timeout {
            println!(
                "allocator: still running after {} s; killing it",
                opts.timeout.as_secs()
            );
            timed_out = true;
            let _ = child.kill();
            break child.wait().ok();
        }
        thread::sleep(opts.poll);
    };
    // The pipes close when the allocator exits; what it wrote last is still queued.
    drain(&rx, &mut log, Duration::from_millis(500));
    let how = match status {
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => format!("{s}"),
        },
        None => "unknown".into(),
    };
    println!(
        "allocator finished after {:.1} s: {how}",
        start.elapsed().as_secs_f64()
    );
    Ok(AllocatorRun {
        pid,
        status,
        timed_out,
        log,
        watch,
    })
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn poll_watchdog(
    backend: &Back,
    limiter: &GpuLimiter,
    gpu: &GpuInfo,
    action: Action,
    alloc_pid: u32,
    start: Instant,
    wd: &mut Watchdog,
    terminator: &PidfdTerminator,
    watch: &mut WatchLog,
    last_line: &mut String,
) {
    watch.polls += 1;
    let t = start.elapsed().as_secs_f64();
    let procs = match backend.gpu().compute_processes(&gpu.uuid) {
        Ok(p) => p,
        Err(e) => {
            let msg = format!("compute processes: {e}");
            if !watch.errors.contains(&msg) {
                println!("  watchdog t={t:.1}s: {msg}");
                watch.errors.push(msg);
            }
            return;
        }
    };
    let usage: Vec<ProcessUsage> = procs
        .iter()
        .map(|p| ProcessUsage {
            gpu_uuid: gpu.uuid.clone(),
            pid: p.pid,
            used_bytes: p.used_bytes,
            via_mps: p.via_mps,
        })
        .collect();
    if let Some(p) = procs.iter().find(|p| p.pid == alloc_pid) {
        watch.seen = true;
        if let Some(u) = p.used_bytes {
            watch.max_used = Some(watch.max_used.map_or(u, |m| m.max(u)));
        }
    }
    let shares = limiter.watched_shares(action);
    let verdict = wd.evaluate(Instant::now(), &usage, pod_of, &shares);

    let mut parts = Vec::new();
    for p in &procs {
        let used = p.used_bytes.map_or_else(|| "usage unknown".into(), short);
        let mine = if p.pid == alloc_pid {
            " (allocator)"
        } else {
            ""
        };
        let owner = match verdict.usage.iter().find(|u| u.pids.contains(&p.pid)) {
            Some(u) => {
                if p.pid == alloc_pid {
                    watch.attributed = true;
                }
                format!(
                    "pod {} share {} ({} of {})",
                    u.pod_uid,
                    u.share_keys.join(","),
                    short(u.used_bytes),
                    short(u.limit_bytes)
                )
            }
            None if fs::metadata(format!("/proc/{}", p.pid)).is_err() => {
                "unattributed: not in this /proc (another pid namespace?)".into()
            }
            None => "unattributed (no share for its cgroup)".into(),
        };
        parts.push(format!("pid {}{mine} {used} -> {owner}", p.pid));
    }
    if procs.is_empty() {
        parts.push("no compute processes".into());
    }
    let line = parts.join("; ");
    if line != *last_line {
        println!("  watchdog t={t:.1}s: {line}");
        *last_line = line;
    }
    for o in verdict.over_limit.iter().filter(|o| o.new) {
        println!(
            "  watchdog t={t:.1}s: OVER-LIMIT event: pod {} shares {} use {} > limit {}",
            o.pod_uid,
            o.share_keys.join(","),
            short(o.used_bytes),
            short(o.limit_bytes)
        );
        if watch.first_over.is_none() {
            watch.first_over = Some((t, o.used_bytes, o.limit_bytes));
        }
    }
    for (d, r) in execute_terminations(&verdict, |d| limiter.terminate(d, terminator)) {
        let what = match r {
            Ok(x) => format!("{x:?}"),
            Err(e) => format!("failed: {e}"),
        };
        println!(
            "  watchdog t={t:.1}s: terminate pid {} ({} used) of pod {}: {what}",
            d.pid,
            short(d.used_bytes),
            d.pod_uid
        );
        watch.terminated.push(format!("pid {} {what}", d.pid));
    }
}

// ---------------------------------------------------------------------------------
// Summary
