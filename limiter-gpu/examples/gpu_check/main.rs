//! `gpu_check`: the GPU memory limiter against a real NVIDIA GPU, end to end.
//!
//! Run by `tests/gpu/run-on-gpu.sh` on a machine with a GPU, as root. In order:
//!
//! 1. the NVML probe per GPU (uuid, name, memory, MIG mode, driver, whether
//!    `nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1` exist, and what the
//!    capability probe concluded for `nvml-cgroup` and `mps`);
//! 2. a test cgroup laid out like a kubelet pod (`<cgroup2>/shareguard-gpu-check-*/
//!    kubepods/pod<uid>/allocator`), so that the library's cgroup parser maps the
//!    allocator to a pod; removed at the end by a guard, also on panic;
//! 3. a share (`--share-mib`, default 1 GiB) prepared through [`GpuLimiter`] for that pod,
//!    and the limit the driver reports back; where the limiter chose `mps`, that starts
//!    the share's own MPS control daemon (`--mps-control`, default
//!    `/usr/bin/nvidia-cuda-mps-control`, its directories under `/run/sg-gpu-check-mps`)
//!    and the limit read back is the daemon's (`get_default_device_pinned_mem_limit`);
//! 4. the allocator (the command after `--`) started inside the cgroup, trying to
//!    allocate `--alloc-mib` (default 2 GiB) in steps, while the watchdog logic runs over
//!    NVML's running compute processes; under `mps` it also gets
//!    `CUDA_MPS_PIPE_DIRECTORY=<the share's pipe directory>` and the daemon's `/dev/shm`
//!    (in a mount namespace of its own), as the share's CDI spec gives containers, so it
//!    runs as a client of the share's daemon;
//! 5. the share released (which stops the share's MPS daemon), and the limits read back
//!    once more: none is expected, and no daemon;
//! 6. one `CHECK <name>: PASS|FAIL|NOT-RUN` line per point the code relies on but only a
//!    GPU can prove: the getter on a cgroup never limited, a cleared limit read back as
//!    none (and which "no limit" value the driver took), a limit set below current
//!    usage, NVML reopened after a (simulated) loss, the limiter built late, the agent's
//!    `gpus = "all"` list being every GPU NVML lists (`nvml_checks.rs`); the dmem probe against a limit that binds, containers' leaf
//!    cgroups limited as they appear, MPS limits per client, terminate_client, and a
//!    non-root client's server (`mps_checks.rs`);
//! 7. a summary: mechanism | result | enforced limit read back.
//!
//! The allocator learns what to do from `GPU_CHECK_TARGET_BYTES`, `GPU_CHECK_STEP_BYTES`
//! and `GPU_CHECK_HOLD_SECONDS`, gets `CUDA_VISIBLE_DEVICES=<uuid>` (and, under `mps`,
//! `CUDA_MPS_PIPE_DIRECTORY`), and reports on stdout with lines of this form (anything
//! else is shown as is):
//!
//! ```text
//! ALLOC start <what it uses>
//! ALLOC ok total=<bytes>
//! ALLOC fail total=<bytes> step=<bytes> error=<one line>
//! ALLOC holding total=<bytes> seconds=<s>
//! ALLOC done total=<bytes>
//! ALLOC init-failed error=<one line>
//! ```
//!
//! `--simulated` runs the same steps over the library's simulated back end (a GPU
//! without cgroup limits or MPS, whose driver "sees" the allocator using what it reports
//! as allocated): a self-test of this program's cgroup, allocator, watchdog and summary
//! code on a machine without a GPU. `--simulated-cgroup` gives that GPU simulated
//! per-cgroup limits (stored and read back in memory; nothing blocks the allocator, its
//! own failures are what the summary reports). `--simulated-mps` gives it MPS instead,
//! through the real per-share daemon management driving the `--mps-control` program:
//! with `--mps-control limiter-gpu/tests/fixtures/simulated-nvidia-cuda-mps-control`
//! (a simulation of NVIDIA's control program) that self-tests the daemon start, the
//! limit read back, the pipe directory handed to the allocator and the daemon's stop
//! without a GPU; again nothing blocks the allocator. Every line then says SIMULATED; it
//! proves nothing about a GPU, a driver or NVIDIA's MPS.
//!
//! Cleanup: the share is released (and with it the MPS daemon stopped) on every path
//! that gets as far as preparing it, also when the allocator cannot be started and, by a
//! guard, on panic; the test cgroup is removed by its own guard. A gpu_check killed
//! from outside leaves them behind (`run-on-gpu.sh` removes a leftover cgroup); the
//! next run stops a daemon left for its share before it prepares the share.
//!
//! Exit status: 0 when the check ran, whatever it found (including "no GPU here" and
//! "not supported"); 1 when the check itself could not run (bad arguments, allocator
//! command not startable); 2 when cleanup left something behind (a limit, a cgroup, or
//! an MPS daemon directory under `/run/sg-gpu-check-mps`), which takes precedence over 1.

mod allocator;
mod cgroup;
mod mps_checks;
mod nvml_checks;
mod report;
mod text;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nvml_wrapper::error::NvmlError;

use allocator::*;
use cgroup::*;
use report::*;
use shareguard_common::Quantity;
use shareguard_common::limiter::{LimitSpec, Limiter, MpsDirs, Target};
use shareguard_limiter_gpu::backend::{
    CgroupLimit, ComputeProcess, GpuBackend, GpuInfo, MigMode, MpsLimit, Support,
};
use shareguard_limiter_gpu::cgroup::{pod_from_proc_cgroup, pod_uid_of_pid};
use shareguard_limiter_gpu::cgroupns::agent_namespace;
use shareguard_limiter_gpu::deferred::{DeferredGpuLimiter, LimiterBuilder};
use shareguard_limiter_gpu::limiter::{GpuDeviceConfig, GpuSelector, MEMORY};
use shareguard_limiter_gpu::mps::{MpsConfig, MpsDaemons, with_shm};
use shareguard_limiter_gpu::nvml::{ClearValue, NvmlBackend, map_nvml_error};
use shareguard_limiter_gpu::reopen::{BackendOpener, ReopeningBackend};
use shareguard_limiter_gpu::simulated::{SimulatedBackend, SimulatedGpu};
use shareguard_limiter_gpu::sys::PidfdTerminator;
use shareguard_limiter_gpu::watchdog::{Action, ProcessUsage, Watchdog, execute_terminations};
use shareguard_limiter_gpu::{GpuError, GpuLimiter, Mechanism};
use text::*;

const MIB: u64 = 1 << 20;
const SHARE_KEY: &str = "gpu-check-share";
const DEVICE: &str = "gpu-check";
const CGROUP_PREFIX: &str = "shareguard-gpu-check-";
/// Where this check's per-share MPS daemons live; apart from the agent's
/// `/run/shareguard-mps`, so that the check never touches a running agent's daemons.
const MPS_DIR: &str = "/run/sg-gpu-check-mps";
const MPS_CONTROL: &str = "/usr/bin/nvidia-cuda-mps-control";

const USAGE: &str = "\
usage: gpu_check [options] [-- ALLOCATOR COMMAND...]
  --gpu INDEX|UUID          GPU to test (default: index 0)
  --share-mib N             share to prepare (default 1024)
  --alloc-mib N             what the allocator tries to get (default 2048)
  --step-mib N              allocation step (default 256)
  --hold-secs N             how long the allocator holds its memory (default 10)
  --timeout-secs N          kill the allocator after this long (default 90)
  --poll-ms N               watchdog poll period (default 250)
  --watchdog-action A       terminate (default) or report
  --grace-secs N            grace before the watchdog terminates (default 2)
  --allocator-name NAME     how to call the allocator in the report
  --mps-control PATH        NVIDIA's MPS control program, for the mps mechanism
                            (default /usr/bin/nvidia-cuda-mps-control)
  --simulated               self-test over the SIMULATED back end (no GPU needed)
  --simulated-cgroup        as --simulated, the simulated GPU with cgroup limits
  --simulated-mps           as --simulated, the simulated GPU with MPS through real
                            per-share daemons of --mps-control (for a self-test:
                            limiter-gpu/tests/fixtures/simulated-nvidia-cuda-mps-control)";

#[derive(Debug)]
struct Opts {
    gpu: GpuSelector,
    share_bytes: u64,
    alloc_bytes: u64,
    step_bytes: u64,
    hold: Duration,
    timeout: Duration,
    poll: Duration,
    action: Action,
    allocator_name: Option<String>,
    allocator: Vec<String>,
    mps_control: PathBuf,
    simulated: bool,
    simulated_cgroup: bool,
    simulated_mps: bool,
}

impl Opts {
    fn parse(mut args: impl Iterator<Item = String>) -> Result<Opts, String> {
        let mut o = Opts {
            gpu: GpuSelector::Index(0),
            share_bytes: 1024 * MIB,
            alloc_bytes: 2048 * MIB,
            step_bytes: 256 * MIB,
            hold: Duration::from_secs(10),
            timeout: Duration::from_secs(90),
            poll: Duration::from_millis(250),
            action: Action::Terminate {
                grace: Duration::from_secs(2),
            },
            allocator_name: None,
            allocator: Vec::new(),
            mps_control: PathBuf::from(MPS_CONTROL),
            simulated: false,
            simulated_cgroup: false,
            simulated_mps: false,
        };
        let mut terminate = true;
        let mut grace = Duration::from_secs(2);
        while let Some(a) = args.next() {
            if a == "--" {
                o.allocator = args.by_ref().collect();
                break;
            }
            if a == "-h" || a == "--help" {
                return Err(String::new());
            }
            let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
            let num = |v: String| -> Result<u64, String> {
                v.parse::<u64>()
                    .map_err(|_| format!("{a}: {v:?} is not a whole number"))
            };
            match a.as_str() {
                "--gpu" => {
                    let v = value()?;
                    o.gpu = match v.parse::<u32>() {
                        Ok(i) => GpuSelector::Index(i),
                        Err(_) => GpuSelector::Uuid(v),
                    };
                }
                "--share-mib" => o.share_bytes = mib(num(value()?)?, &a)?,
                "--alloc-mib" => o.alloc_bytes = mib(num(value()?)?, &a)?,
                "--step-mib" => o.step_bytes = mib(num(value()?)?, &a)?,
                "--hold-secs" => o.hold = Duration::from_secs(num(value()?)?),
                "--timeout-secs" => o.timeout = Duration::from_secs(num(value()?)?),
                "--poll-ms" => o.poll = Duration::from_millis(num(value()?)?.max(10)),
                "--grace-secs" => grace = Duration::from_secs(num(value()?)?),
                "--watchdog-action" => {
                    terminate = match value()?.as_str() {
                        "terminate" => true,
                        "report" => false,
                        other => return Err(format!("--watchdog-action: {other:?}")),
                    }
                }
                "--allocator-name" => o.allocator_name = Some(value()?),
                "--simulated" => o.simulated = true,
                "--simulated-cgroup" => {
                    o.simulated = true;
                    o.simulated_cgroup = true;
                }
                "--simulated-mps" => {
                    o.simulated = true;
                    o.simulated_mps = true;
                }
                "--mps-control" => o.mps_control = PathBuf::from(value()?),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        o.action = if terminate {
            Action::Terminate { grace }
        } else {
            Action::Report
        };
        Ok(o)
    }
}

fn mib(n: u64, what: &str) -> Result<u64, String> {
    n.checked_mul(MIB)
        .filter(|b| *b > 0)
        .ok_or_else(|| format!("{what}: {n} MiB is out of range"))
}

fn main() -> ExitCode {
    let opts = match Opts::parse(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("gpu_check: {e}\n{USAGE}");
            return ExitCode::from(1);
        }
    };
    match run(&opts) {
        Ok(Outcome::Ran) => ExitCode::SUCCESS,
        Ok(Outcome::LeftState) => {
            println!("gpu_check: cleanup left state behind (see the lines above); exit 2");
            ExitCode::from(2)
        }
        Ok(Outcome::CheckFailed(why)) => {
            println!("gpu_check: FAILED: {why}");
            ExitCode::from(1)
        }
        Err(e) => {
            println!("gpu_check: FAILED: {e}");
            ExitCode::from(1)
        }
    }
}

enum Outcome {
    Ran,
    LeftState,
    /// The check itself is broken (the allocator never spoke its protocol).
    CheckFailed(String),
}

// ---------------------------------------------------------------------------------
// Formatting helpers

// ---------------------------------------------------------------------------------
// The check

/// The back end under test: NVML, or the simulated one for a self-test.
enum Back {
    Nvml(Arc<NvmlBackend>),
    Sim(Arc<SimulatedBackend>),
}

impl Back {
    fn gpu(&self) -> &dyn GpuBackend {
        match self {
            Back::Nvml(b) => b.as_ref(),
            Back::Sim(b) => b.as_ref(),
        }
    }

    fn shared(&self) -> Arc<dyn GpuBackend> {
        match self {
            Back::Nvml(b) => b.clone(),
            Back::Sim(b) => b.clone(),
        }
    }

    /// Simulated only: the driver reports the allocator using what it says it holds.
    /// `via_mps`: whether the allocator was started as a client of the share's daemon.
    fn feed(&self, uuid: &str, pid: u32, used: Option<u64>, via_mps: bool) {
        if let Back::Sim(b) = self {
            let procs = used
                .map(|u| {
                    vec![ComputeProcess {
                        pid,
                        used_bytes: Some(u),
                        via_mps,
                    }]
                })
                .unwrap_or_default();
            b.set_processes(uuid, procs);
        }
    }
}

fn run(opts: &Opts) -> Result<Outcome, String> {
    if opts.simulated {
        println!(
            "gpu_check: SIMULATED back end (self-test of this program; says nothing about a GPU)"
        );
    } else {
        println!("gpu_check: shareguard limiter-gpu against the real NVML, no simulation");
    }
    section("environment");
    let kernel = read_small(Path::new("/proc/sys/kernel/osrelease")).unwrap_or_default();
    println!("kernel: {}", kernel.trim());
    let own_cgroup = read_small(Path::new("/proc/self/cgroup")).unwrap_or_default();
    println!(
        "this process's cgroup: {}",
        own_cgroup.lines().collect::<Vec<_>>().join(" ; ")
    );

    section(if opts.simulated {
        "SIMULATED probe"
    } else {
        "NVML probe"
    });
    // The per-share MPS daemons hold nothing but this configuration, so a second handle
    // on them (for a daemon left by an earlier, killed run) is another `MpsDaemons`.
    let mps_cfg = MpsConfig {
        control: absolute(&opts.mps_control),
        dir: MPS_DIR.into(),
        ..MpsConfig::default()
    };
    let mps_daemons =
        || MpsDaemons::new(mps_cfg.clone()).map_err(|e| format!("MPS configuration: {e}"));
    let uses_mps = !opts.simulated || opts.simulated_mps;
    let backend = if opts.simulated {
        let sim = SimulatedBackend::new(vec![SimulatedGpu {
            cgroup_limits: opts.simulated_cgroup,
            mps: opts.simulated_mps,
            ..SimulatedGpu::new("GPU-simulated-0", 16 << 30)
        }]);
        Back::Sim(Arc::new(if opts.simulated_mps {
            sim.with_mps_daemons(mps_daemons()?)
        } else {
            sim
        }))
    } else {
        match NvmlBackend::open() {
            Ok(b) => Back::Nvml(Arc::new(b.with_mps(mps_daemons()?))),
            Err(e) => {
                println!("no NVIDIA GPU / NVML here (or not usable): {e}");
                println!("nothing to check on this machine.");
                return Ok(Outcome::Ran);
            }
        }
    };
    let gpus = match backend.gpu().discover() {
        Ok(g) if g.is_empty() => {
            println!("no NVIDIA GPU: NVML loaded but reports 0 GPUs.");
            return Ok(Outcome::Ran);
        }
        Ok(g) => g,
        Err(e) => {
            println!("no usable NVIDIA GPU: NVML loaded but discovery failed: {e}");
            return Ok(Outcome::Ran);
        }
    };
    match &backend {
        Back::Nvml(b) => {
            let symbols = b.memory_limit_symbols();
            let present = |b: bool| if b { "present" } else { "missing" };
            println!("NVML library: loaded");
            println!("nvmlDeviceSetMemoryLimits_v1: {}", present(symbols.set));
            println!("nvmlDeviceGetMemoryLimits_v1: {}", present(symbols.get));
        }
        Back::Sim(_) => println!("NVML library: not used (SIMULATED back end)"),
    }
    if uses_mps {
        println!(
            "MPS control program: {} ({})",
            mps_cfg.control.display(),
            support_text(&mps_daemons()?.probe())
        );
        println!("MPS daemon directory: {MPS_DIR} (one daemon per share below it)");
    } else {
        println!("MPS: not used (SIMULATED GPU without MPS; see --simulated-mps)");
    }
    let mut caps = BTreeMap::new();
    for g in &gpus {
        print_gpu(g);
        match backend.gpu().capabilities(&g.uuid) {
            Ok(c) => {
                println!("  nvml-cgroup:   {}", support_text(&c.cgroup_limits));
                println!("  mps:           {}", support_text(&c.mps));
                caps.insert(g.uuid.clone(), c);
            }
            Err(e) => println!("  capability probe failed: {e}"),
        }
    }
    let gpu = match &opts.gpu {
        GpuSelector::Index(i) => gpus.iter().find(|g| g.index == *i),
        GpuSelector::Uuid(u) => gpus.iter().find(|g| &g.uuid == u),
        // Its options name one GPU; this is what the agent's config may say.
        GpuSelector::All => None,
    }
    .ok_or_else(|| format!("GPU {:?} not found", opts.gpu))?
    .clone();
    println!(
        "testing GPU {} ({}, {})",
        gpu.index,
        gpu.uuid,
        short(gpu.total_memory_bytes)
    );
    if gpu.mig == MigMode::Enabled {
        println!(
            "note: MIG is enabled; CUDA_VISIBLE_DEVICES=<GPU uuid> gives the allocator no MIG instance"
        );
    }

    section("test cgroup");
    let pod_uid = random_pod_uid().map_err(|e| format!("/dev/urandom: {e}"))?;
    let mut cgroup_error = None;
    let mut cgroup = match TestCgroup::create(&pod_uid) {
        Ok(c) => Some(c),
        Err(e) => {
            cgroup_error = Some(e.clone());
            println!("test cgroup: NOT created: {e}");
            println!(
                "  (the nvml-cgroup mechanism needs it; the allocator runs outside any pod, so the watchdog cannot attribute it)"
            );
            None
        }
    };

    section("prepare the share");
    let dyn_backend = backend.shared();
    let limiter = GpuLimiter::new(
        dyn_backend,
        &[GpuDeviceConfig {
            name: DEVICE.into(),
            gpu: GpuSelector::Uuid(gpu.uuid.clone()),
            memory_bytes: None,
            driver_root: None,
            container_driver_root: None,
        }],
    )
    .map_err(|e| format!("GpuLimiter::new: {e}"))?;
    let device = limiter
        .device(DEVICE)
        .ok_or("GpuLimiter lost its device")?
        .clone();
    println!(
        "mechanism chosen by the limiter: {}",
        limiter.label(device.mechanism)
    );
    for (m, why) in &device.not_chosen {
        println!("  {} not chosen: {why}", m.as_str());
    }
    let mps_chosen = device.mechanism == Mechanism::Mps;
    if uses_mps {
        stop_leftover_daemon(&mps_daemons()?);
    }
    let spec = LimitSpec {
        share_key: SHARE_KEY.into(),
        device: DEVICE.into(),
        limits: BTreeMap::from([(
            MEMORY.to_string(),
            Quantity::parse(&format!("{}Mi", opts.share_bytes / MIB))
                .map_err(|e| format!("share size: {e}"))?,
        )]),
        target: Target {
            pod_uids: vec![pod_uid.clone()],
            cgroups: cgroup
                .as_ref()
                .map(|c| vec![c.pod.clone()])
                .unwrap_or_default(),
            ..Target::default()
        },
    };
    println!(
        "share {SHARE_KEY}: {} for pod {pod_uid} on {}",
        bytes(opts.share_bytes),
        gpu.uuid
    );
    let mut report = Report {
        cgroup_error,
        ..Report::default()
    };
    // From here on the share is released on every way out of this function: by
    // `release` below, or by the guard on an early return or a panic. Under `mps` that
    // stops the share's daemon. Dropped before the test cgroup (declared earlier), so a
    // cgroup's limit is cleared before the cgroup goes.
    let mut share = ShareGuard {
        limiter: &limiter,
        armed: true,
    };
    match limiter.apply(&spec) {
        Ok(enf) => {
            let enforced = enf.enforced.get(MEMORY).map(|q| q.to_string());
            println!(
                "apply: ok, mechanism {}, enforced (read back) {}",
                enf.mechanism,
                enforced.as_deref().unwrap_or("none")
            );
            report.applied = Some(enforced);
        }
        Err(e) => {
            println!("apply: FAILED ({:?}): {}", e.retry, e.message);
            report.apply_error = Some(e.message);
        }
    }
    if let Some(cg) = &cgroup {
        let rb = read_back(backend.gpu(), &gpu.uuid, &cg.pod);
        println!("driver read-back for {}: {rb}", cg.pod.display());
        report.limit_while_prepared = Some(rb);
    }
    // What the share's containers would get from its CDI spec.
    let mps_dirs = limiter.cdi_device(DEVICE, SHARE_KEY).and_then(|d| d.mps);
    let mps_pipe_dir = mps_dirs.as_ref().map(|m| m.pipe.clone());
    let mut daemon_pid = None;
    if mps_chosen {
        let rb = backend.gpu().mps_limit(&gpu.uuid, SHARE_KEY);
        let text = mps_limit_text(&rb);
        println!("MPS read-back (the share's daemon): {text}");
        report.mps_while_prepared = Some(text);
        match &mps_pipe_dir {
            Some(dir) => {
                daemon_pid = read_small(&dir.join(MPS_PID_FILE))
                    .ok()
                    .and_then(|p| p.trim().parse::<u32>().ok());
                println!(
                    "MPS daemon of the share: {}, pipe directory {}",
                    daemon_pid.map_or_else(|| "no pid file".into(), |p| format!("pid {p}")),
                    dir.display()
                );
            }
            None => println!("MPS: the limiter gives the share NO pipe directory"),
        }
    }

    section("allocator");
    let mut run_result = None;
    let mut allocator_error = None;
    if opts.allocator.is_empty() {
        println!("allocator: none given; nothing allocates (no CUDA allocator on this machine?)");
    } else {
        let name = opts
            .allocator_name
            .clone()
            .unwrap_or_else(|| opts.allocator.join(" "));
        println!("allocator: {name}");
        println!(
            "  asks for {} in steps of {}, holds it {} s",
            short(opts.alloc_bytes),
            short(opts.step_bytes),
            opts.hold.as_secs()
        );
        println!(
            "  watchdog: polls NVML every {} ms, action {:?}",
            opts.poll.as_millis(),
            opts.action
        );
        match run_allocator(
            opts,
            &backend,
            &limiter,
            &gpu,
            cgroup.as_ref(),
            mps_dirs.as_ref(),
        ) {
            Ok(r) => run_result = Some(r),
            // Reported once the share is released and the cgroup removed.
            Err(e) => {
                println!("allocator: NOT run: {e}");
                allocator_error = Some(e);
            }
        }
    }

    section("release the share");
    let mut left_state = false;
    // A limit may be left behind only where one was set: the mechanism is nvml-cgroup
    // and apply got as far as the driver, or it is mps (a daemon may have started even
    // where apply failed later).
    let limit_was_set = match device.mechanism {
        Mechanism::NvmlCgroup => report.applied.is_some(),
        Mechanism::Mps => true,
        Mechanism::Watchdog => false,
    };
    match share.release() {
        Ok(()) => println!("remove: ok"),
        Err(e) => {
            println!("remove: FAILED: {}", e.message);
            left_state |= limit_was_set;
        }
    }
    if let Some(cg) = &cgroup {
        let rb = backend.gpu().cgroup_limit(&gpu.uuid, &cg.pod);
        let text = read_back_text(&rb);
        println!("driver read-back after release: {text}");
        match rb {
            Ok(None) => {}
            Ok(Some(_)) => {
                println!("release: the driver still reports a limit on the test cgroup");
                left_state = true;
            }
            Err(_) => {
                left_state |= device.mechanism == Mechanism::NvmlCgroup && limit_was_set;
            }
        }
        report.limit_after_release = Some(text);
    }
    if mps_chosen {
        let rb = backend.gpu().mps_limit(&gpu.uuid, SHARE_KEY);
        let text = mps_limit_text(&rb);
        println!("MPS read-back after release: {text}");
        if !matches!(rb, Ok(None)) {
            println!("release: the share's MPS daemon is still there");
            left_state = true;
        }
        if let Some(pid) = daemon_pid {
            if process_alive(pid) {
                println!("release: the share's MPS daemon, pid {pid}, is still running");
                left_state = true;
            } else {
                println!("MPS daemon pid {pid}: gone");
            }
        }
        report.mps_after_release = Some(text);
    }
    if uses_mps {
        left_state |= !mps_dir_clean();
    }
    // Before the test cgroup goes: the checks make a cgroup of their own beside the pod.
    nvml_checks::nvml_checks(opts, &backend, &gpu, cgroup.as_ref());
    mps_checks::mps_checks(opts, &backend, &gpu, cgroup.as_ref());
    if let Some(mut cg) = cgroup.take() {
        let problems = cg.cleanup();
        left_state |= !problems.is_empty();
    }

    section("summary");
    let mps_caps = caps.get(&gpu.uuid).map(|c| c.mps.clone());
    print_summary(
        opts,
        &limiter,
        &device,
        mps_caps,
        &report,
        run_result.as_ref(),
    );
    if left_state {
        return Ok(Outcome::LeftState);
    }
    if let Some(e) = allocator_error {
        return Ok(Outcome::CheckFailed(e));
    }
    if let Some(r) = &run_result
        && !r.log.any_line
    {
        return Ok(Outcome::CheckFailed(format!(
            "the allocator {:?} printed no ALLOC line; it did not run as intended (see its output above)",
            opts.allocator
        )));
    }
    Ok(Outcome::Ran)
}

/// Releases the share when dropped unless [`ShareGuard::release`] did: the way out of
/// `run` on an early return or a panic, so that no MPS daemon or limit outlives the
/// check.
struct ShareGuard<'a> {
    limiter: &'a GpuLimiter,
    armed: bool,
}

impl ShareGuard<'_> {
    fn release(&mut self) -> Result<(), shareguard_common::limiter::LimiterError> {
        self.armed = false;
        self.limiter.remove(SHARE_KEY)
    }
}

impl Drop for ShareGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.armed = false;
        match self.limiter.remove(SHARE_KEY) {
            Ok(()) => println!("cleanup: share {SHARE_KEY} released"),
            Err(e) => println!(
                "cleanup: releasing share {SHARE_KEY} FAILED: {} (an MPS daemon may be left under {MPS_DIR})",
                e.message
            ),
        }
    }
}

/// The pid file NVIDIA's control daemon writes into its pipe directory.
const MPS_PID_FILE: &str = "nvidia-cuda-mps-control.pid";

/// Stops the daemon an earlier, killed run left for this check's share, so that this
/// run starts (and reads back) its own.
fn stop_leftover_daemon(mps: &MpsDaemons) {
    let Some(share_dir) = mps.pipe_dir(SHARE_KEY).parent().map(Path::to_path_buf) else {
        return;
    };
    if !share_dir.exists() {
        return;
    }
    match mps.stop(SHARE_KEY) {
        Ok(()) => println!(
            "MPS: stopped a daemon left by an earlier run in {}",
            share_dir.display()
        ),
        Err(e) => println!(
            "MPS: {} is left by an earlier run and could not be stopped: {e}",
            share_dir.display()
        ),
    }
}

/// True when nothing is left under [`MPS_DIR`]; removes the directory itself once it is
/// empty. Prints what is left.
fn mps_dir_clean() -> bool {
    let dir = Path::new(MPS_DIR);
    let entries: Vec<String> = match fs::read_dir(dir) {
        Ok(d) => d
            .filter_map(|e| e.ok())
            .map(|e| e.path().display().to_string())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
        Err(e) => {
            println!("cleanup: cannot list {MPS_DIR}: {e}");
            return false;
        }
    };
    if !entries.is_empty() {
        println!(
            "cleanup: MPS daemon directory left behind: {}",
            entries.join(" ")
        );
        return false;
    }
    match fs::remove_dir(dir) {
        Ok(()) => println!("cleanup: {MPS_DIR} removed, no MPS daemon left"),
        Err(e) => println!("cleanup: {MPS_DIR} is empty but stays: {e}"),
    }
    true
}

/// True while the process exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    read_small(&Path::new("/proc").join(pid.to_string()).join("stat")).is_ok_and(|stat| {
        // The state follows the command name in parentheses, which may hold spaces.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// A relative path made absolute against the working directory: the MPS daemon is
/// started through a shell and must find the same program.
fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        return p.to_path_buf();
    }
    std::env::current_dir().map_or_else(|_| p.to_path_buf(), |d| d.join(p))
}

// ---------------------------------------------------------------------------------
// Test cgroup
