//! NVML's per-cgroup calls and its re-opening: one `CHECK` line per point, PASS, FAIL or
//! NOT-RUN, so that the first GPU machine this runs on proves or disproves each in one
//! run.

use super::*;

pub(super) fn check_line(name: &str, verdict: &str, detail: &str) {
    println!("CHECK {name}: {verdict} - {detail}");
}

pub(super) fn nvml_checks(opts: &Opts, backend: &Back, gpu: &GpuInfo, cgroup: Option<&TestCgroup>) {
    section("checks: nvml-cgroup clear/get/usage, NVML reopen");
    cgroup_checks(opts, backend, gpu, cgroup);
    reopen_check(backend, gpu);
    late_build_check(backend, gpu);
    gpus_all_check(backend);
}

/// What the agent makes devices of for `gpus = "all"` (`setup::list`, its own NVML
/// open) is every GPU this run's back end discovered, and there is one at least.
fn gpus_all_check(backend: &Back) {
    const NAME: &str = "gpus-all-lists-every-gpu";
    if matches!(backend, Back::Sim(_)) {
        return check_line(NAME, "NOT-RUN", "SIMULATED back end; the list is NVML's");
    }
    let uuids = |gpus: Vec<GpuInfo>| gpus.into_iter().map(|g| g.uuid).collect::<Vec<_>>();
    let here = match backend.gpu().discover() {
        Ok(g) => uuids(g),
        Err(e) => return check_line(NAME, "NOT-RUN", &format!("discover: {e}")),
    };
    match shareguard_limiter_gpu::setup::list(
        "gpu",
        &shareguard_limiter_gpu::setup::GpuBackendKind::Nvml,
    ) {
        Ok(listed) => {
            let listed = uuids(listed);
            let ok = !listed.is_empty() && listed == here;
            check_line(
                NAME,
                if ok { "PASS" } else { "FAIL" },
                &format!("listed {listed:?}, discovered {here:?}"),
            );
        }
        Err(e) => check_line(NAME, "FAIL", &format!("setup::list: {e}")),
    }
}

/// A cgroup beside the test pod's, never limited before; removed (its processes
/// killed, its limit with it) when dropped.
pub(super) struct ScratchCgroup(pub(super) PathBuf);

impl Drop for ScratchCgroup {
    fn drop(&mut self) {
        let kill = self.0.join("cgroup.kill");
        if kill.exists() {
            let _ = fs::write(&kill, "1");
        }
        for _ in 0..50 {
            match fs::remove_dir(&self.0) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) => thread::sleep(Duration::from_millis(100)),
            }
        }
        println!("cleanup: could not remove {}", self.0.display());
    }
}

fn raw_answer_text(r: &Result<shareguard_limiter_gpu::sys::RawMemoryLimits, NvmlError>) -> String {
    match r {
        Ok(l) => format!(
            "ok: soft {} hard {} used {}",
            l.soft, l.hard, l.current_used
        ),
        Err(e) => format!("{e:?} ({e})"),
    }
}

fn cgroup_checks(opts: &Opts, backend: &Back, gpu: &GpuInfo, cgroup: Option<&TestCgroup>) {
    const NAMES: [&str; 3] = [
        "getter-on-a-cgroup-never-limited",
        "clear-reads-back-as-no-limit",
        "set-below-usage-is-its-own-error",
    ];
    let not_run = |why: &str| {
        for n in NAMES {
            check_line(n, "NOT-RUN", why);
        }
    };
    let Back::Nvml(b) = backend else {
        return not_run("SIMULATED back end; these checks are about the real driver");
    };
    let Some(cg) = cgroup else {
        return not_run("no test cgroup");
    };
    match b.capabilities(&gpu.uuid).map(|c| c.cgroup_limits) {
        Ok(Support::Supported) => {}
        Ok(Support::Unsupported(why)) => {
            return not_run(&format!("nvml-cgroup not supported: {why}"));
        }
        Err(e) => return not_run(&format!("capability probe failed: {e}")),
    }
    let dir = cg
        .top
        .join("kubepods")
        .join(format!("gpu-check-scratch-{}", std::process::id()));
    if let Err(e) = fs::create_dir(&dir) {
        return not_run(&format!("mkdir {}: {e}", dir.display()));
    }
    let scratch = ScratchCgroup(dir.clone());
    let uuid = gpu.uuid.as_str();

    // 1. The getter on a cgroup that never had a limit: the raw answer, and what the
    //    back end makes of it (no limit).
    let raw = b.raw_cgroup_limits(uuid, &dir);
    let raw_text = match &raw {
        Ok(r) => raw_answer_text(r),
        Err(e) => format!("not asked: {e}"),
    };
    match b.cgroup_limit(uuid, &dir) {
        Ok(None) => check_line(
            NAMES[0],
            "PASS",
            &format!("no limit; the driver answered {raw_text}"),
        ),
        other => check_line(
            NAMES[0],
            "FAIL",
            &format!("expected no limit, got {other:?}; the driver answered {raw_text}"),
        ),
    }

    // 2. Set, clear, read back: no limit, and which "no limit" value the driver took.
    let limit = 256 * MIB;
    let set = b.set_cgroup_limit(uuid, &dir, limit);
    let after_set = b.cgroup_limit(uuid, &dir);
    let cleared = b.clear_cgroup_limit(uuid, &dir);
    let after_clear = b.cgroup_limit(uuid, &dir);
    let raw_after = b
        .raw_cgroup_limits(uuid, &dir)
        .map(|r| raw_answer_text(&r))
        .unwrap_or_else(|e| e.to_string());
    let took = match b.clear_value() {
        Some(ClearValue::LimitMax) => {
            "NVML_DEVICE_MEMORY_LIMIT_MAX as assumed (u64::MAX)".to_string()
        }
        Some(ClearValue::TotalMemory) => {
            "the GPU's total memory (the driver REFUSED u64::MAX as NVML_DEVICE_MEMORY_LIMIT_MAX)"
                .to_string()
        }
        None => "nothing (the clear did not get through)".to_string(),
    };
    let ok = set.is_ok()
        && matches!(after_set, Ok(Some(l)) if l.hard_bytes == limit)
        && cleared.is_ok()
        && matches!(after_clear, Ok(None));
    check_line(
        NAMES[1],
        if ok { "PASS" } else { "FAIL" },
        &format!(
            "set {limit}: {set:?}, read {after_set:?}; clear: {cleared:?}, read {after_clear:?}; the driver took {took}; raw read after clear: {raw_after}"
        ),
    );

    // 3. A limit below what the cgroup already uses.
    if opts.allocator.is_empty() {
        check_line(
            NAMES[2],
            "NOT-RUN",
            "no allocator to use memory in the cgroup",
        );
        return;
    }
    match hold_memory_in(opts, gpu, &dir, 512 * MIB) {
        Err(why) => check_line(NAMES[2], "NOT-RUN", &why),
        Ok(mut child) => {
            let used = b
                .raw_cgroup_limits(uuid, &dir)
                .map(|r| raw_answer_text(&r))
                .unwrap_or_else(|e| e.to_string());
            let below = 64 * MIB;
            let r = b.set_cgroup_limit(uuid, &dir, below);
            let _ = child.kill();
            let _ = child.wait();
            let (verdict, detail) = match &r {
                Err(GpuError::UsageAboveLimit { used, limit, .. }) => {
                    ("PASS", format!("refused: {used} bytes used > {limit}"))
                }
                Ok(()) => (
                    "FAIL",
                    format!("the driver ACCEPTED a limit of {below} below current usage ({used})"),
                ),
                Err(e) => (
                    "FAIL",
                    format!(
                        "the driver refused with another answer, to classify: {e}; usage then: {used}"
                    ),
                ),
            };
            check_line(NAMES[2], verdict, &detail);
            let _ = b.clear_cgroup_limit(uuid, &dir);
        }
    }
    drop(scratch);
}

/// Starts the allocator in `dir` asking for `bytes` and waits until it holds them.
fn hold_memory_in(opts: &Opts, gpu: &GpuInfo, dir: &Path, bytes: u64) -> Result<Child, String> {
    let (prog, args) = opts
        .allocator
        .split_first()
        .ok_or("empty allocator command")?;
    let child = Command::new("/bin/sh")
        .arg("-c")
        .arg(r#"cg=$1; shift; echo $$ > "$cg" || exit 97; exec "$@""#)
        .arg("sh")
        .arg(dir.join("cgroup.procs"))
        .arg(prog)
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", &gpu.uuid)
        .env("GPU_CHECK_TARGET_BYTES", bytes.to_string())
        .env("GPU_CHECK_STEP_BYTES", bytes.to_string())
        .env("GPU_CHECK_HOLD_SECONDS", "60")
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("CUDA_MPS_PIPE_DIRECTORY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("allocator not started: {e}"))?;
    let mut guard = ChildGuard(Some(child));
    wait_holding(&mut guard, bytes)?;
    guard.0.take().ok_or_else(|| "allocator lost".to_string())
}

/// Waits (at most 60 s) until the allocator, started with its stdout piped, says it
/// holds its memory; an error when it says it cannot or says nothing. The guard kills it
/// on the error paths.
pub(super) fn wait_holding(guard: &mut ChildGuard, bytes: u64) -> Result<(), String> {
    let out = guard
        .0
        .as_mut()
        .and_then(|c| c.stdout.take())
        .ok_or("allocator without stdout")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        match rx.recv_timeout(end.saturating_duration_since(Instant::now())) {
            Ok(line) if line.starts_with("ALLOC holding") => return Ok(()),
            Ok(line) if line.starts_with("ALLOC fail") || line.starts_with("ALLOC init-failed") => {
                return Err(format!("allocator could not hold {bytes} bytes: {line}"));
            }
            Ok(_) => {}
            Err(_) => return Err("allocator did not report holding its memory within 60 s".into()),
        }
    }
}

/// A back end that answers "uninitialized" to discovery once told to: a driver reload,
/// simulated, over the real back end (nothing here reloads the real driver).
struct SimulatedLoss {
    inner: Arc<dyn GpuBackend>,
    lost: AtomicBool,
}

impl GpuBackend for SimulatedLoss {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn is_simulated(&self) -> bool {
        self.inner.is_simulated()
    }
    fn mechanism_label(&self, m: Mechanism) -> String {
        self.inner.mechanism_label(m)
    }
    fn discover(&self) -> Result<Vec<GpuInfo>, GpuError> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(map_nvml_error(
                "nvmlDeviceGetCount (simulated loss)",
                NvmlError::Uninitialized,
            ));
        }
        self.inner.discover()
    }
    fn compute_processes(&self, uuid: &str) -> Result<Vec<ComputeProcess>, GpuError> {
        self.inner.compute_processes(uuid)
    }
    fn capabilities(
        &self,
        uuid: &str,
    ) -> Result<shareguard_limiter_gpu::backend::Capabilities, GpuError> {
        self.inner.capabilities(uuid)
    }
    fn set_cgroup_limit(&self, uuid: &str, cgroup: &Path, bytes: u64) -> Result<(), GpuError> {
        self.inner.set_cgroup_limit(uuid, cgroup, bytes)
    }
    fn cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<Option<CgroupLimit>, GpuError> {
        self.inner.cgroup_limit(uuid, cgroup)
    }
    fn clear_cgroup_limit(&self, uuid: &str, cgroup: &Path) -> Result<(), GpuError> {
        self.inner.clear_cgroup_limit(uuid, cgroup)
    }
    fn set_mps_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError> {
        self.inner.set_mps_limit(uuid, share_key, bytes)
    }
    fn mps_limit(&self, uuid: &str, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        self.inner.mps_limit(uuid, share_key)
    }
    fn clear_mps_limit(&self, uuid: &str, share_key: &str) -> Result<(), GpuError> {
        self.inner.clear_mps_limit(uuid, share_key)
    }
}

/// A fresh back end of the kind under test: NVML opened anew (nvmlInit, the probe), or
/// the same simulated GPU.
fn open_again(backend: &Back) -> Result<Arc<dyn GpuBackend>, GpuError> {
    match backend {
        Back::Nvml(_) => NvmlBackend::open().map(|b| Arc::new(b) as Arc<dyn GpuBackend>),
        Back::Sim(s) => Ok(s.clone() as Arc<dyn GpuBackend>),
    }
}

fn reopen_check(backend: &Back, gpu: &GpuInfo) {
    const NAME: &str = "nvml-reopened-after-a-loss";
    let label = if matches!(backend, Back::Sim(_)) {
        " (SIMULATED back end)"
    } else {
        ""
    };
    let first = match open_again(backend) {
        Ok(b) => Arc::new(SimulatedLoss {
            inner: b,
            lost: AtomicBool::new(false),
        }),
        Err(e) => {
            return check_line(
                NAME,
                "NOT-RUN",
                &format!("cannot open a second back end: {e}"),
            );
        }
    };
    let handed = Mutex::new(Some(first.clone()));
    let sim = match backend {
        Back::Sim(s) => Some(s.clone()),
        Back::Nvml(_) => None,
    };
    let open: BackendOpener = Arc::new(move || {
        if let Some(b) = handed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Ok(b as Arc<dyn GpuBackend>);
        }
        match &sim {
            Some(s) => Ok(s.clone() as Arc<dyn GpuBackend>),
            None => NvmlBackend::open().map(|b| Arc::new(b) as Arc<dyn GpuBackend>),
        }
    });
    let rb = match ReopeningBackend::open(open, Duration::ZERO) {
        Ok(rb) => rb,
        Err(e) => return check_line(NAME, "NOT-RUN", &format!("first open failed: {e}")),
    };
    first.lost.store(true, Ordering::SeqCst);
    // Only the reopening back end holds it now: the reopen drops it (nvmlShutdown)
    // before opening anew. The main check's own NVML handle stays open, so NVML's
    // reference count does not reach zero here.
    drop(first);
    let found = rb.discover();
    let probe = rb
        .capabilities(&gpu.uuid)
        .map(|c| support_text(&c.cgroup_limits));
    let ok = matches!(&found, Ok(g) if g.iter().any(|x| x.uuid == gpu.uuid)) && rb.reopened() == 1;
    check_line(
        NAME,
        if ok { "PASS" } else { "FAIL" },
        &format!(
            "after a simulated NVML_ERROR_UNINITIALIZED: reopened {} time(s), discovery {}, nvml-cgroup probed again: {probe:?}{label}",
            rb.reopened(),
            match &found {
                Ok(g) => format!("found {} GPU(s)", g.len()),
                Err(e) => format!("failed: {e}"),
            }
        ),
    );
}

fn late_build_check(backend: &Back, gpu: &GpuInfo) {
    const NAME: &str = "limiter-built-when-nvml-comes-late";
    let label = if matches!(backend, Back::Sim(_)) {
        " (SIMULATED back end)"
    } else {
        ""
    };
    let sim = match backend {
        Back::Sim(s) => Some(s.clone()),
        Back::Nvml(_) => None,
    };
    let attempts = Arc::new(AtomicU32::new(0));
    let counted = attempts.clone();
    let uuid = gpu.uuid.clone();
    let build: LimiterBuilder = Box::new(move || {
        if counted.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(GpuError::Unavailable(
                "simulated: the driver container is not ready yet".into(),
            ));
        }
        let sim = sim.clone();
        let open: BackendOpener = Arc::new(move || match &sim {
            Some(s) => Ok(s.clone() as Arc<dyn GpuBackend>),
            None => NvmlBackend::open().map(|b| Arc::new(b) as Arc<dyn GpuBackend>),
        });
        let b = ReopeningBackend::open(open, Duration::from_secs(5))?;
        GpuLimiter::new(
            Arc::new(b),
            &[GpuDeviceConfig {
                name: "gpu-check-late".into(),
                gpu: GpuSelector::Uuid(uuid.clone()),
                memory_bytes: None,
                driver_root: None,
                container_driver_root: None,
            }],
        )
    });
    let d = DeferredGpuLimiter::new("NVML", build, Duration::ZERO);
    let before = d.built().is_none();
    let after = d.get();
    let facts = d.device_facts("gpu-check-late");
    let ok = before && after.is_some() && attempts.load(Ordering::SeqCst) == 2;
    check_line(
        NAME,
        if ok { "PASS" } else { "FAIL" },
        &format!(
            "not built at the first attempt: {before}; built at attempt {}: {}; device mechanism {}{label}",
            attempts.load(Ordering::SeqCst),
            after.is_some(),
            facts.mechanism
        ),
    );
}
