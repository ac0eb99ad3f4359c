//! What only a GPU can prove about the dmem probe, containers' leaf cgroups and MPS: one
//! `CHECK` line per point, PASS, FAIL or NOT-RUN.
//!
//! - `dmem-probe-agrees-with-the-driver`: the probe (an NVIDIA region in the root's
//!   `dmem.capacity`) says nvml-cgroup can bind exactly when a limit set on a cgroup with
//!   `dmem.max` reads back; a FAIL either way means the probe refuses a working driver or
//!   trusts a broken one;
//! - `leaf-cgroups-get-the-pods-limit`: a share applied on a pod cgroup puts the limit on
//!   its container leaf, and on a leaf made afterwards once the watchdog's pass runs;
//! - `mps-limit-binds-each-client`: two clients of one share's daemon each hold 5/8 of
//!   the share, together more than it (per-client semantics), and the read-back says
//!   twice the share. The share is at least 4 GiB: a client's own CUDA context counts
//!   against MPS's limit (about 500 MiB for PyTorch on an H200), so a client cannot hold
//!   the whole share, and a small one leaves no room beside the context;
//! - `mps-terminate-client`: `terminate_client` through the share's daemon ends a
//!   client's GPU work and NVML stops listing it;
//! - `mps-server-for-a-non-root-client`: a client of uid 65534 gets a server (which runs
//!   as that uid and writes its log), i.e. the pipe and log directories are usable.

use shareguard_limiter_gpu::dmem::{DMEM_MAX, driver_regions};
use shareguard_limiter_gpu::watchdog::{TerminateDecision, Terminated};

use shareguard_limiter_gpu::backend::Capabilities;

use super::nvml_checks::{ScratchCgroup, check_line, wait_holding};
use super::*;

const MPS_SHARE_KEY: &str = "gpu-check-mps-clients";
const LEAF_SHARE_KEY: &str = "gpu-check-leaves";
const NOBODY: u32 = 65534;

/// Kills a process only if it is one of the check's own MPS clients.
struct OwnClients(Arc<Mutex<Vec<u32>>>);

impl shareguard_limiter_gpu::watchdog::ProcessTerminator for OwnClients {
    fn terminate(
        &self,
        pid: u32,
        _pod_uid: &str,
    ) -> Result<Terminated, shareguard_limiter_gpu::watchdog::TerminateError> {
        use shareguard_limiter_gpu::watchdog::TerminateError;
        if !self.0.lock().is_ok_and(|v| v.contains(&pid)) {
            return Err(TerminateError::Failed(format!(
                "pid {pid} is not one of the check's clients"
            )));
        }
        let status = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .map_err(|e| TerminateError::Failed(format!("kill -KILL {pid}: {e}")))?;
        if status.success() {
            Ok(Terminated::Signalled)
        } else {
            Err(TerminateError::Failed(format!(
                "kill -KILL {pid}: {status}"
            )))
        }
    }
}

pub(super) fn mps_checks(opts: &Opts, backend: &Back, gpu: &GpuInfo, cgroup: Option<&TestCgroup>) {
    section("checks: dmem probe, leaf cgroups, MPS per client");
    let Back::Nvml(b) = backend else {
        for n in [
            "dmem-probe-agrees-with-the-driver",
            "leaf-cgroups-get-the-pods-limit",
            "mps-limit-binds-each-client",
            "mps-terminate-client",
            "mps-server-for-a-non-root-client",
        ] {
            check_line(
                n,
                "NOT-RUN",
                "SIMULATED back end; these checks are about the real driver",
            );
        }
        return;
    };
    let caps = b.capabilities(&gpu.uuid);
    dmem_probe_check(b, gpu, cgroup, &caps);
    leaf_check(backend, gpu, cgroup, &caps);
    mps_client_checks(opts, backend, gpu, &caps);
}

fn dmem_probe_check(
    b: &NvmlBackend,
    gpu: &GpuInfo,
    cgroup: Option<&TestCgroup>,
    caps: &Result<Capabilities, GpuError>,
) {
    const NAME: &str = "dmem-probe-agrees-with-the-driver";
    let Some(root) = cgroup2_mount() else {
        return check_line(NAME, "NOT-RUN", "no cgroup2 mount");
    };
    let regions = driver_regions(&root);
    println!("dmem regions at {}: {regions:?}", root.display());
    let probe_says = matches!(caps, Ok(c) if c.cgroup_limits.is_supported());
    let Some(cg) = cgroup else {
        return check_line(NAME, "NOT-RUN", "no test cgroup");
    };
    let dir = cg
        .top
        .join("kubepods")
        .join(format!("gpu-check-dmem-{}", std::process::id()));
    if let Err(e) = fs::create_dir(&dir) {
        return check_line(NAME, "NOT-RUN", &format!("mkdir {}: {e}", dir.display()));
    }
    let _scratch = ScratchCgroup(dir.clone());
    if !dir.join(DMEM_MAX).exists() {
        return check_line(
            NAME,
            if probe_says { "FAIL" } else { "PASS" },
            &format!(
                "{} has no {DMEM_MAX} (no dmem controller to delegate); probe says nvml-cgroup {}",
                dir.display(),
                if probe_says { "works" } else { "does not work" }
            ),
        );
    }
    let set = b.set_cgroup_limit(&gpu.uuid, &dir, 256 * MIB);
    let got = b.cgroup_limit(&gpu.uuid, &dir);
    let binds = set.is_ok() && matches!(&got, Ok(Some(l)) if l.hard_bytes == 256 * MIB);
    let _ = b.clear_cgroup_limit(&gpu.uuid, &dir);
    let detail = format!(
        "probe: {}; a 256Mi limit on a cgroup with {DMEM_MAX}: set {set:?}, read back {}",
        if probe_says {
            "supported"
        } else {
            "not supported"
        },
        read_back_text(&got)
    );
    check_line(
        NAME,
        if binds == probe_says { "PASS" } else { "FAIL" },
        &detail,
    );
}

/// A new limiter over the same back end and GPU, apart from the one the main run used.
fn limiter_for(backend: &Back, gpu: &GpuInfo) -> Result<GpuLimiter, String> {
    GpuLimiter::new(
        backend.shared(),
        &[GpuDeviceConfig {
            name: DEVICE.into(),
            gpu: GpuSelector::Uuid(gpu.uuid.clone()),
            memory_bytes: None,
            driver_root: None,
            container_driver_root: None,
        }],
    )
    .map_err(|e| format!("GpuLimiter::new: {e}"))
}

fn share_spec(
    key: &str,
    bytes: u64,
    pod_uid: &str,
    cgroups: Vec<PathBuf>,
) -> Result<LimitSpec, String> {
    Ok(LimitSpec {
        share_key: key.into(),
        device: DEVICE.into(),
        limits: BTreeMap::from([(
            MEMORY.to_string(),
            Quantity::parse(&format!("{}Mi", bytes / MIB)).map_err(|e| e.to_string())?,
        )]),
        target: Target {
            pod_uids: vec![pod_uid.into()],
            cgroups,
            ..Target::default()
        },
    })
}

fn leaf_check(
    backend: &Back,
    gpu: &GpuInfo,
    cgroup: Option<&TestCgroup>,
    caps: &Result<Capabilities, GpuError>,
) {
    const NAME: &str = "leaf-cgroups-get-the-pods-limit";
    match caps {
        Ok(c) if c.cgroup_limits.is_supported() => {}
        Ok(c) => {
            return check_line(
                NAME,
                "NOT-RUN",
                &format!("nvml-cgroup: {}", support_text(&c.cgroup_limits)),
            );
        }
        Err(e) => return check_line(NAME, "NOT-RUN", &format!("probe failed: {e}")),
    }
    let Some(cg) = cgroup else {
        return check_line(NAME, "NOT-RUN", "no test cgroup");
    };
    let pod = cg
        .top
        .join("kubepods")
        .join(format!("gpu-check-leaves-{}", std::process::id()));
    if let Err(e) = fs::create_dir(&pod) {
        return check_line(NAME, "NOT-RUN", &format!("mkdir {}: {e}", pod.display()));
    }
    let _pod = ScratchCgroup(pod.clone());
    // The leaves need the controller from the pod, as a kubelet's pod cgroup gives it.
    if let Err(e) = fs::write(pod.join("cgroup.subtree_control"), "+dmem") {
        return check_line(NAME, "NOT-RUN", &format!("+dmem in {}: {e}", pod.display()));
    }
    let first = pod.join("c1");
    if let Err(e) = fs::create_dir(&first) {
        return check_line(NAME, "NOT-RUN", &format!("mkdir {}: {e}", first.display()));
    }
    let _first = ScratchCgroup(first.clone());
    let limiter = match limiter_for(backend, gpu) {
        Ok(l) => l,
        Err(e) => return check_line(NAME, "NOT-RUN", &e),
    };
    let bytes = 512 * MIB;
    let spec = match share_spec(LEAF_SHARE_KEY, bytes, "gpu-check-leaves", vec![pod.clone()]) {
        Ok(s) => s,
        Err(e) => return check_line(NAME, "NOT-RUN", &e),
    };
    let applied = limiter.apply(&spec);
    let later = pod.join("c2");
    let made = fs::create_dir(&later);
    let _later = ScratchCgroup(later.clone());
    limiter.follow_leaves();
    let g = backend.gpu();
    let limit = |p: &Path| g.cgroup_limit(&gpu.uuid, p);
    let (on_pod, on_first, on_later) = (limit(&pod), limit(&first), limit(&later));
    let holds = |r: &Result<Option<CgroupLimit>, GpuError>| matches!(r, Ok(Some(l)) if l.hard_bytes == bytes);
    let ok =
        applied.is_ok() && made.is_ok() && holds(&on_pod) && holds(&on_first) && holds(&on_later);
    let removed = limiter.remove(LEAF_SHARE_KEY);
    check_line(
        NAME,
        if ok { "PASS" } else { "FAIL" },
        &format!(
            "apply {:?}; pod {}, leaf {}, leaf made later {}; remove {removed:?}",
            applied.map(|e| e.mechanism),
            read_back_text(&on_pod),
            read_back_text(&on_first),
            read_back_text(&on_later)
        ),
    );
}

/// An allocator as a client of the share's daemon: the daemon's /dev/shm in a mount
/// namespace of its own and its pipe directory, as the CDI spec gives a container; run as
/// `uid` where given. Returns once it holds `bytes`.
fn mps_client(
    opts: &Opts,
    gpu: &GpuInfo,
    dirs: &MpsDirs,
    bytes: u64,
    uid: Option<u32>,
) -> Result<ChildGuard, String> {
    let (prog, args) = opts
        .allocator
        .split_first()
        .ok_or("empty allocator command")?;
    let mut argv = with_shm(&dirs.shm);
    if let Some(uid) = uid {
        argv.extend([
            "setpriv".into(),
            format!("--reuid={uid}"),
            format!("--regid={uid}"),
            "--clear-groups".into(),
        ]);
    }
    argv.push(prog.clone());
    argv.extend(args.iter().cloned());
    let child = Command::new(&argv[0])
        .args(&argv[1..])
        .env("CUDA_VISIBLE_DEVICES", &gpu.uuid)
        .env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
        .env("GPU_CHECK_TARGET_BYTES", bytes.to_string())
        .env("GPU_CHECK_STEP_BYTES", bytes.to_string())
        .env("GPU_CHECK_HOLD_SECONDS", "60")
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("allocator not started: {e}"))?;
    let mut guard = ChildGuard(Some(child));
    wait_holding(&mut guard, bytes)?;
    Ok(guard)
}

fn mps_client_checks(
    opts: &Opts,
    backend: &Back,
    gpu: &GpuInfo,
    caps: &Result<Capabilities, GpuError>,
) {
    const NAMES: [&str; 3] = [
        "mps-limit-binds-each-client",
        "mps-terminate-client",
        "mps-server-for-a-non-root-client",
    ];
    let not_run = |why: &str| NAMES.iter().for_each(|n| check_line(n, "NOT-RUN", why));
    match caps {
        Ok(c) if c.mps.is_supported() => {}
        Ok(c) => return not_run(&format!("mps: {}", support_text(&c.mps))),
        Err(e) => return not_run(&format!("probe failed: {e}")),
    }
    if opts.allocator.is_empty() {
        return not_run("no allocator");
    }
    let limiter = match limiter_for(backend, gpu) {
        Ok(l) => l,
        Err(e) => return not_run(&e),
    };
    if limiter.device(DEVICE).map(|d| d.mechanism) != Some(Mechanism::Mps) {
        return not_run("the limiter chose another mechanism than mps for this GPU");
    }
    // The two clients belong to the share's pod; nothing else does.
    let pod = "gpu-check-mps-pod".to_string();
    let clients: Arc<Mutex<Vec<u32>>> = Arc::default();
    let members = clients.clone();
    let limiter = limiter.with_pod_lookup(Arc::new(move |pid| {
        members
            .lock()
            .ok()?
            .contains(&pid)
            .then(|| "gpu-check-mps-pod".to_string())
    }));
    let bytes = opts.share_bytes.max(4096 * MIB);
    let hold = bytes / 8 * 5;
    let spec = match share_spec(MPS_SHARE_KEY, bytes, &pod, Vec::new()) {
        Ok(s) => s,
        Err(e) => return not_run(&e),
    };
    if let Err(e) = limiter.apply(&spec) {
        return not_run(&format!("apply: {e}"));
    }
    let Some(dirs) = limiter
        .cdi_device(DEVICE, MPS_SHARE_KEY)
        .and_then(|c| c.mps)
    else {
        let _ = limiter.remove(MPS_SHARE_KEY);
        return not_run("the share has no MPS directories");
    };
    let first = mps_client(opts, gpu, &dirs, hold, None);
    let second = mps_client(opts, gpu, &dirs, hold, None);
    for c in [&first, &second].into_iter().flatten() {
        if let Some(pid) = c.0.as_ref().map(Child::id)
            && let Ok(mut v) = clients.lock()
        {
            v.push(pid);
        }
    }
    let processes = backend.gpu().compute_processes(&gpu.uuid);
    println!("NVML compute processes with two clients: {processes:?}");
    match (&first, &second) {
        (Ok(_), Ok(_)) => {
            let e = limiter.verify(&spec);
            let twice = Quantity::parse(&format!("{}Mi", 2 * bytes / MIB)).ok();
            let read = e
                .as_ref()
                .ok()
                .and_then(|e| e.enforced.get(MEMORY).cloned());
            check_line(
                NAMES[0],
                if read.is_some() && read == twice {
                    "PASS"
                } else {
                    "FAIL"
                },
                &format!(
                    "both clients hold {} each, {} together, over the share of {}; the read-back says {read:?} (twice is {twice:?})",
                    short(hold),
                    short(2 * hold),
                    short(bytes)
                ),
            );
        }
        (Ok(_), Err(e)) => check_line(
            NAMES[0],
            "FAIL",
            &format!(
                "the second client could not hold {} beside the first's ({e}): MPS bound the clients together, so reporting twice the share is too pessimistic",
                short(hold)
            ),
        ),
        (Err(e), _) => check_line(NAMES[0], "NOT-RUN", &format!("the first client: {e}")),
    }
    match &first {
        Ok(c) => {
            let pid = c.0.as_ref().map_or(0, Child::id);
            let d = TerminateDecision {
                share_keys: vec![MPS_SHARE_KEY.into()],
                pod_uid: pod.clone(),
                gpu_uuid: gpu.uuid.clone(),
                pid,
                used_bytes: hold,
                via_mps: true,
            };
            // The clients run in no pod cgroup, so the agent's own terminator (which
            // checks the pid's pod from its cgroup) would refuse them: this one kills only
            // the check's own clients.
            let r = limiter.terminate(&d, &OwnClients(clients.clone()));
            let end = Instant::now() + Duration::from_secs(10);
            let mut listed = true;
            while listed && Instant::now() < end {
                listed = backend
                    .gpu()
                    .compute_processes(&gpu.uuid)
                    .map_or(true, |ps| {
                        ps.iter()
                            .any(|p| p.pid == pid && p.used_bytes.unwrap_or(1) > 0)
                    });
                if listed {
                    thread::sleep(Duration::from_millis(100));
                }
            }
            check_line(
                NAMES[1],
                if matches!(
                    r,
                    Ok(Terminated::MpsClientTerminated | Terminated::MpsClientKilled)
                ) && !listed
                {
                    "PASS"
                } else {
                    "FAIL"
                },
                &format!("terminate: {r:?}; NVML still lists pid {pid} with memory: {listed}"),
            );
        }
        Err(e) => check_line(NAMES[1], "NOT-RUN", &format!("no client to terminate: {e}")),
    }
    drop(first);
    drop(second);
    let nobody = mps_client(opts, gpu, &dirs, 64 * MIB, Some(NOBODY));
    check_line(
        NAMES[2],
        if nobody.is_ok() { "PASS" } else { "FAIL" },
        &match &nobody {
            Ok(_) => format!("a client of uid {NOBODY} holds 64Mi through the share's daemon"),
            Err(e) => {
                format!("a client of uid {NOBODY}: {e}; see the daemon's log under {MPS_DIR}")
            }
        },
    );
    drop(nobody);
    if let Err(e) = limiter.remove(MPS_SHARE_KEY) {
        println!("cleanup: removing the MPS check's share: {e}");
    }
}
