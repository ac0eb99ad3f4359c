use std::collections::BTreeMap;
use std::sync::Arc;

use nvml_wrapper::error::NvmlError;
use shareguard_common::Quantity;
use shareguard_common::limiter::{LimitSpec, Limiter, Needs, Retry, Target};

use super::*;
use crate::backend::MigMode;
use crate::simulated::{SimOp, SimulatedBackend, SimulatedGpu};

const GIB: u64 = 1 << 30;
const ROOT: &str = "/sys/fs/cgroup";
const POD_A: &str = "kubepods.slice/kubepods-pod1111aaaa_0000_4000_8000_000000000001.slice";
const POD_B: &str = "kubepods.slice/kubepods-pod2222bbbb_0000_4000_8000_000000000002.slice";

fn sim(gpus: Vec<SimulatedGpu>) -> Arc<SimulatedBackend> {
    Arc::new(SimulatedBackend::new(gpus))
}

fn cfg(name: &str, gpu: GpuSelector, memory: Option<u64>) -> GpuDeviceConfig {
    GpuDeviceConfig {
        name: name.into(),
        gpu,
        memory_bytes: memory,
        driver_root: None,
        container_driver_root: None,
    }
}

fn limiter(backend: &Arc<SimulatedBackend>) -> GpuLimiter {
    GpuLimiter::new(backend.clone(), &[cfg("gpu0", GpuSelector::Index(0), None)]).unwrap()
}

fn spec(key: &str, memory: &str, cgroup: &str) -> LimitSpec {
    LimitSpec {
        share_key: key.into(),
        device: "gpu0".into(),
        limits: BTreeMap::from([(MEMORY.to_string(), Quantity::parse(memory).unwrap())]),
        target: Target {
            pod_uids: vec![format!("pod-of-{key}")],
            cgroups: vec![cg(cgroup)],
            ..Target::default()
        },
    }
}

fn cg(rel: &str) -> PathBuf {
    Path::new(ROOT).join(rel)
}

fn limit_of(b: &SimulatedBackend, rel: &str) -> Option<u64> {
    b.cgroup_limits()
        .into_iter()
        .find(|(_, p, _)| *p == cg(rel))
        .map(|(_, _, l)| l.hard_bytes)
}

#[test]
fn limit_is_set_and_read_back() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 80 * GIB)]);
    let l = limiter(&b);
    let e = l.apply(&spec("s1", "8Gi", POD_A)).unwrap();
    assert_eq!(e.mechanism, "simulated-cgroup");
    assert_eq!(e.enforced[MEMORY], Quantity::parse("8Gi").unwrap());
    assert_eq!(limit_of(&b, POD_A), Some(8 * GIB));
    // A repeated apply is idempotent.
    l.apply(&spec("s1", "8Gi", POD_A)).unwrap();
    assert_eq!(b.cgroup_limits().len(), 1);
    assert_eq!(l.verify(&spec("s1", "8Gi", POD_A)).unwrap(), e);
}

#[test]
fn oversubscription_is_refused() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 80 * GIB)]);
    let l = GpuLimiter::new(
        b.clone(),
        &[cfg(
            "gpu0",
            GpuSelector::Uuid("GPU-a".into()),
            Some(40 * GIB),
        )],
    )
    .unwrap();
    l.apply(&spec("s1", "30Gi", POD_A)).unwrap();
    let err = l.apply(&spec("s2", "11Gi", POD_B)).unwrap_err();
    assert_eq!(err.retry, Retry::Permanent);
    assert!(err.message.contains("oversubscribed"), "{}", err.message);
    assert_eq!(
        limit_of(&b, POD_B),
        None,
        "nothing was installed for the refused share"
    );
    // Exactly the rest fits.
    l.apply(&spec("s2", "10Gi", POD_B)).unwrap();
    // A share larger than the device on its own.
    assert!(l.apply(&spec("s3", "41Gi", POD_B)).is_err());
    // The same share with another amount is a contradiction, not an update.
    assert!(l.apply(&spec("s1", "20Gi", POD_A)).is_err());
}

#[test]
fn release_zeroes_the_limit_and_frees_capacity_once() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    let l = limiter(&b);
    l.apply(&spec("s1", "16Gi", POD_A)).unwrap();
    assert!(l.apply(&spec("s2", "1Gi", POD_B)).is_err());
    l.remove("s1").unwrap();
    assert_eq!(limit_of(&b, POD_A), None);
    l.remove("s1").unwrap();
    l.apply(&spec("s2", "16Gi", POD_B)).unwrap();
}

#[test]
fn shares_of_one_pod_on_one_gpu_add_up_in_its_cgroup() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 80 * GIB)]);
    let l = limiter(&b);
    l.apply(&spec("s1", "4Gi", POD_A)).unwrap();
    l.apply(&spec("s2", "6Gi", POD_A)).unwrap();
    assert_eq!(limit_of(&b, POD_A), Some(10 * GIB));
    assert!(
        !l.verify(&spec("s1", "4Gi", POD_A))
            .unwrap()
            .enforced
            .is_empty()
    );
    l.remove("s2").unwrap();
    assert_eq!(limit_of(&b, POD_A), Some(4 * GIB));
    l.remove("s1").unwrap();
    assert_eq!(limit_of(&b, POD_A), None);
}

#[test]
fn restart_re_verifies_and_re_adopts() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    {
        let l = limiter(&b);
        l.apply(&spec("s1", "12Gi", POD_A)).unwrap();
    }
    // A new process: nothing in memory, the driver still holds the limit.
    let l = limiter(&b);
    let e = l.verify(&spec("s1", "12Gi", POD_A)).unwrap();
    assert_eq!(e.enforced[MEMORY], Quantity::parse("12Gi").unwrap());
    // Its capacity counts again.
    assert!(l.apply(&spec("s2", "8Gi", POD_B)).is_err());

    // The driver lost the limit (reload): verify must not claim enforcement.
    b.tamper_cgroup_limit("GPU-a", &cg(POD_A), None);
    let e = l.verify(&spec("s1", "12Gi", POD_A)).unwrap();
    assert!(e.enforced.is_empty());
    assert_eq!(e.mechanism, "simulated-cgroup");
    // A re-apply repairs it.
    l.apply(&spec("s1", "12Gi", POD_A)).unwrap();
    assert_eq!(limit_of(&b, POD_A), Some(12 * GIB));
}

#[test]
fn nvml_errors_come_back_retryable_or_permanent() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    let l = limiter(&b);
    let cases: [(fn() -> NvmlError, Retry); 6] = [
        (|| NvmlError::Timeout, Retry::Retryable),
        (|| NvmlError::GpuLost, Retry::Retryable),
        (|| NvmlError::Unknown, Retry::Retryable),
        (|| NvmlError::DriverNotLoaded, Retry::Permanent),
        (|| NvmlError::NoPermission, Retry::Permanent),
        (|| NvmlError::NotSupported, Retry::Permanent),
    ];
    for (make, retry) in cases {
        b.inject_fault(SimOp::SetCgroupLimit, make, Some(1));
        let err = l.apply(&spec("s1", "1Gi", POD_A)).unwrap_err();
        assert_eq!(err.retry, retry, "{}", err.message);
        // The fault is gone: the retry goes through.
        l.apply(&spec("s1", "1Gi", POD_A)).unwrap();
        l.remove("s1").unwrap();
    }
    b.inject_fault(SimOp::GetCgroupLimit, || NvmlError::Timeout, Some(1));
    l.apply(&spec("s1", "1Gi", POD_A)).unwrap_err();
    assert!(l.verify(&spec("s1", "1Gi", POD_A)).is_ok());
}

#[test]
fn failed_remove_keeps_the_share_for_a_retry() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    let l = limiter(&b);
    l.apply(&spec("s1", "16Gi", POD_A)).unwrap();
    b.inject_fault(SimOp::ClearCgroupLimit, || NvmlError::Timeout, Some(1));
    assert_eq!(l.remove("s1").unwrap_err().retry, Retry::Retryable);
    assert!(
        l.apply(&spec("s2", "1Gi", POD_B)).is_err(),
        "capacity still held"
    );
    l.remove("s1").unwrap();
    assert_eq!(limit_of(&b, POD_A), None);
}

#[test]
fn mechanism_is_chosen_per_gpu_in_order() {
    let mut mps_only = SimulatedGpu::new("GPU-mps", 16 * GIB);
    mps_only.cgroup_limits = false;
    let mut mig = SimulatedGpu::new("GPU-mig", 16 * GIB);
    mig.mig = MigMode::Enabled;
    mig.mps = false;
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB), mps_only, mig]);
    let l = GpuLimiter::new(
        b.clone(),
        &[
            cfg("gpu0", GpuSelector::Index(0), None),
            cfg("gpu1", GpuSelector::Uuid("GPU-mps".into()), None),
            cfg("gpu2", GpuSelector::Index(2), None),
        ],
    )
    .unwrap();
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::NvmlCgroup);
    assert_eq!(l.device("gpu1").unwrap().mechanism, Mechanism::Mps);
    let wd = l.device("gpu2").unwrap();
    assert_eq!(wd.mechanism, Mechanism::Watchdog);
    assert_eq!(wd.not_chosen.len(), 2, "{:?}", wd.not_chosen);
    assert_eq!(
        l.mechanisms(),
        vec!["simulated-cgroup", "simulated-mps", "simulated-watchdog"]
    );
    assert!(!l.accounting_only());

    let mut s = spec("m1", "2Gi", POD_A);
    s.device = "gpu1".into();
    let e = l.apply(&s).unwrap();
    assert_eq!(e.mechanism, "simulated-mps");
    assert_eq!(e.enforced[MEMORY], Quantity::parse("2Gi").unwrap());
    assert_eq!(
        b.mps_limits(),
        vec![("GPU-mps".into(), "m1".into(), 2 * GIB)]
    );
    l.remove("m1").unwrap();
    assert!(b.mps_limits().is_empty());

    // Watchdog only: accepted, reported, and not enforced.
    let mut s = spec("w1", "2Gi", POD_A);
    s.device = "gpu2".into();
    s.target.cgroups.clear();
    let e = l.apply(&s).unwrap();
    assert_eq!(e.mechanism, "simulated-watchdog");
    assert!(e.enforced.is_empty());
    // Said as such, so that the agent reports ACCOUNTED (not DEGRADED) and SIMULATED.
    assert!(e.watch_only && e.simulated, "{e:?}");
    let watched = l.watched_shares(Action::Report);
    assert!(
        watched
            .iter()
            .any(|w| w.share_key == "w1" && w.gpu_uuid == "GPU-mig")
    );
}

#[test]
fn device_configs_are_checked() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    let new = |c: GpuDeviceConfig| GpuLimiter::new(b.clone(), &[c]);
    assert!(matches!(
        new(cfg("x", GpuSelector::Uuid("GPU-zz".into()), None)),
        Err(GpuError::GpuNotFound(_))
    ));
    assert!(matches!(
        new(cfg("x", GpuSelector::Index(3), None)),
        Err(GpuError::GpuNotFound(_))
    ));
    assert!(matches!(
        new(cfg("x", GpuSelector::Index(0), Some(17 * GIB))),
        Err(GpuError::InvalidArgument(_))
    ));
    let l = new(cfg("x", GpuSelector::Index(0), None)).unwrap();
    assert_eq!(l.device("x").unwrap().capacity_bytes, 16 * GIB);
    let twice = GpuLimiter::new(
        b.clone(),
        &[
            cfg("x", GpuSelector::Index(0), None),
            cfg("x", GpuSelector::Index(0), None),
        ],
    );
    assert!(twice.is_err());
    // One by index, one by uuid: the same GPU all the same.
    let same = GpuLimiter::new(
        b.clone(),
        &[
            cfg("x", GpuSelector::Index(0), None),
            cfg("y", GpuSelector::Uuid("GPU-a".into()), None),
        ],
    );
    assert!(
        matches!(&same, Err(GpuError::InvalidArgument(m)) if m.contains("same GPU")),
        "{:?}",
        same.err()
    );
    // No driver at all: the limiter cannot be built, and says why.
    b.inject_fault(SimOp::Discover, || NvmlError::DriverNotLoaded, Some(1));
    assert!(matches!(
        new(cfg("x", GpuSelector::Index(0), None)),
        Err(GpuError::Unavailable(_))
    ));
}

#[test]
fn bad_specs_are_permanent_errors() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 16 * GIB)]);
    let l = limiter(&b);
    let mut cases = Vec::new();
    let mut s = spec("s", "1Gi", POD_A);
    s.limits
        .insert("bandwidth".into(), Quantity::parse("1G").unwrap());
    cases.push(("unknown capacity", s));
    cases.push(("fraction of a byte", spec("s", "1500m", POD_A)));
    cases.push(("zero", spec("s", "0", POD_A)));
    cases.push(("dot-dot", spec("s", "1Gi", "kubepods.slice/../../etc")));
    let mut s = spec("s", "1Gi", POD_A);
    s.target.cgroups.clear();
    cases.push(("no cgroup", s));
    let mut s = spec("s", "1Gi", POD_A);
    s.device = "nope".into();
    cases.push(("unknown device", s));
    for (what, s) in cases {
        let err = l.apply(&s).unwrap_err();
        assert_eq!(err.retry, Retry::Permanent, "{what}: {}", err.message);
    }
    assert!(b.cgroup_limits().is_empty());
}

#[test]
fn cgroups_must_be_absolute_and_plain() {
    assert!(check_cgroup(&cg("a/b")).is_ok());
    assert!(check_cgroup(Path::new("a/b")).is_err());
    assert!(check_cgroup(Path::new("/sys/fs/cgroup/../../etc")).is_err());
}

#[test]
fn only_the_cgroup_mechanism_needs_the_pod() {
    let b = sim(vec![
        SimulatedGpu::new("GPU-cg", 16 * GIB),
        SimulatedGpu {
            cgroup_limits: false,
            mps: false,
            ..SimulatedGpu::new("GPU-w", 16 * GIB)
        },
    ]);
    let l = GpuLimiter::new(
        b,
        &[
            cfg("cg", GpuSelector::Uuid("GPU-cg".into()), None),
            cfg("w", GpuSelector::Uuid("GPU-w".into()), None),
        ],
    )
    .unwrap();
    assert_eq!(l.needs("cg"), Needs::Cgroup);
    assert_eq!(l.needs("w"), Needs::Nothing);
}

#[test]
fn mps_shares_run_through_their_own_daemon() {
    if !crate::test_root::require_root("mps_shares_run_through_their_own_daemon") {
        return;
    }
    // Kills the daemons below it on drop, so that a failed assertion leaves none.
    let root = crate::mps::tests::Root::new();
    let daemons = root.daemons();
    let mut gpu = SimulatedGpu::new("GPU-mps", 16 * GIB);
    gpu.cgroup_limits = false;
    let b = Arc::new(SimulatedBackend::new(vec![gpu]).with_mps_daemons(daemons));
    // 701, 702 and 704 belong to the share's pod, 703 to another; 704 runs as root
    // outside a user namespace.
    let l = limiter(&b)
        .with_pod_lookup(Arc::new(|pid| match pid {
            701 | 702 | 704 => Some("pod-of-m1".to_string()),
            703 => Some("pod-of-someone-else".to_string()),
            _ => None,
        }))
        .with_root_lookup(Arc::new(|pid| pid == 704));
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::Mps);
    assert_eq!(l.device_facts("gpu0").attributes["binds"], "process");

    // 2500 MiB and one byte: MPS limits are whole MiB, and the byte is not given.
    let s = spec("m1", "2621440001", POD_A);
    let e = l.apply(&s).unwrap();
    assert_eq!(e.mechanism, "simulated-mps");
    assert_eq!(e.enforced[MEMORY], Quantity::parse("2500Mi").unwrap());
    let pipe = root.dir.path().join("m1/pipe");
    let cdi = l.cdi_device("gpu0", "m1").unwrap();
    let mps = cdi.mps.expect("an MPS share has its daemon's directories");
    assert_eq!(mps.pipe, pipe);
    assert_eq!(mps.shm, root.dir.path().join("m1/shm"));
    let pid: u32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    // Drift: the limit changed behind the agent's back is not reported as enforced,
    // and apply puts it back.
    std::fs::write(pipe.join("fake-default-mib"), "4096\n").unwrap();
    assert!(l.verify(&s).unwrap().enforced.is_empty());
    assert_eq!(l.apply(&s).unwrap(), e);
    assert_eq!(l.verify(&s).unwrap(), e);

    // The pod's processes are the daemon's clients, and another pod's direct use is not
    // this share's business: still enforced.
    let proc = |pid, via_mps| crate::backend::ComputeProcess {
        pid,
        used_bytes: Some(GIB),
        via_mps,
    };
    let per_process = |e: &Enforcement| {
        let p = &e.per_process[MEMORY];
        (p.each.to_string(), p.processes)
    };
    assert_eq!(per_process(&e), ("2500Mi".into(), 0));
    assert_eq!(e.resolution[MEMORY], Quantity::parse("1Mi").unwrap());
    b.set_processes("GPU-mps", vec![proc(701, true), proc(703, false)]);
    let one = l.verify(&s).unwrap();
    assert_eq!(one.enforced, e.enforced);
    assert_eq!(per_process(&one), ("2500Mi".into(), 1));
    // Two clients of the share: MPS bounds each on its own, so together they may hold
    // twice the limit, and that is what the read-back says.
    b.set_processes("GPU-mps", vec![proc(701, true), proc(702, true)]);
    let two = l.verify(&s).unwrap();
    assert_eq!(two.enforced[MEMORY], Quantity::parse("5000Mi").unwrap());
    assert_eq!(per_process(&two), ("2500Mi".into(), 2));
    // One of them bypasses the daemon (no CUDA_MPS_PIPE_DIRECTORY): not enforced, and
    // applying again cannot change that.
    b.set_processes("GPU-mps", vec![proc(701, true), proc(702, false)]);
    assert!(l.verify(&s).unwrap().enforced.is_empty());
    assert!(l.apply(&s).unwrap().enforced.is_empty());
    b.set_processes("GPU-mps", vec![proc(701, true)]);
    assert_eq!(l.verify(&s).unwrap(), one);
    // A root tenant's client could serve the daemon's socket itself: not enforced, and
    // the status says why.
    b.set_processes("GPU-mps", vec![proc(701, true), proc(704, true)]);
    let root_client = l.verify(&s).unwrap();
    assert!(root_client.enforced.is_empty());
    assert!(
        root_client
            .notes
            .iter()
            .any(|n| n.contains("MPS refused for a root tenant") && n.contains("704")),
        "{:?}",
        root_client.notes
    );
    b.set_processes("GPU-mps", vec![proc(701, true)]);
    assert_eq!(l.verify(&s).unwrap(), one);

    // The watchdog stops the share's MPS clients through their server, never with a
    // signal; a client no daemon of the share serves is left alone; others are signalled.
    struct Signals(std::sync::Mutex<Vec<u32>>);
    impl crate::watchdog::ProcessTerminator for Signals {
        fn terminate(
            &self,
            pid: u32,
            _pod_uid: &str,
        ) -> Result<Terminated, crate::watchdog::TerminateError> {
            self.0.lock().unwrap().push(pid);
            Ok(Terminated::Signalled)
        }
    }
    let signals = Signals(Default::default());
    std::fs::write(pipe.join("fake-servers"), "4242\n").unwrap();
    std::fs::write(pipe.join("fake-clients-4242"), "701\n").unwrap();
    let decision = |pid: u32, via_mps: bool| TerminateDecision {
        share_keys: vec!["m1".into()],
        pod_uid: "pod-of-m1".into(),
        gpu_uuid: "GPU-mps".into(),
        pid,
        used_bytes: GIB,
        via_mps,
    };
    assert_eq!(
        l.terminate(&decision(701, true), &signals),
        Ok(Terminated::MpsClientTerminated)
    );
    assert_eq!(
        std::fs::read_to_string(pipe.join("fake-terminated")).unwrap(),
        "701\n"
    );
    // Our own pid stands for a live process that is no client of the share's daemon.
    let mine = std::process::id();
    let refused = l.terminate(&decision(mine, true), &signals).unwrap_err();
    assert!(refused.to_string().contains("not killed"), "{refused}");
    assert_eq!(
        l.terminate(&decision(4_194_304 + 17, true), &signals),
        Ok(Terminated::AlreadyGone)
    );
    assert!(
        signals.0.lock().unwrap().is_empty(),
        "no MPS client signalled"
    );
    assert_eq!(
        l.terminate(&decision(702, false), &signals),
        Ok(Terminated::Signalled)
    );
    assert_eq!(*signals.0.lock().unwrap(), vec![702]);
    // A server that keeps a terminated client's memory until its process exits (as an
    // H200 with driver 580 did): its work ended first, then the process is killed.
    std::fs::write(pipe.join("fake-terminate-holds"), "").unwrap();
    std::fs::write(pipe.join("fake-clients-4242"), "703\n").unwrap();
    assert_eq!(
        l.terminate(&decision(703, true), &signals),
        Ok(Terminated::MpsClientKilled)
    );
    assert_eq!(
        std::fs::read_to_string(pipe.join("fake-terminated")).unwrap(),
        "701\n703\n",
        "terminate_client before the signal"
    );
    assert_eq!(*signals.0.lock().unwrap(), vec![702, 703]);

    l.remove("m1").unwrap();
    assert!(!pipe.exists(), "the daemon's directory is gone");
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| s.contains(") Z ")),
        "the daemon quit"
    );
}

/// A pod cgroup (a temp dir standing for one) with these container leaves, each with
/// `dmem.max` where `ready`.
fn pod_dir(leaves: &[(&str, bool)], pod_ready: bool) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    if pod_ready {
        std::fs::write(d.path().join(crate::dmem::DMEM_MAX), "").unwrap();
    }
    for (name, ready) in leaves {
        add_leaf(d.path(), name, *ready);
    }
    d
}

fn add_leaf(pod: &Path, name: &str, ready: bool) {
    std::fs::create_dir(pod.join(name)).unwrap();
    if ready {
        std::fs::write(pod.join(name).join(crate::dmem::DMEM_MAX), "").unwrap();
    }
}

fn spec_at(key: &str, memory: &str, cgroup: &Path) -> LimitSpec {
    let mut s = spec(key, memory, "unused");
    s.target.cgroups = vec![cgroup.to_path_buf()];
    s
}

fn hard_limit(b: &SimulatedBackend, cgroup: &Path) -> Option<u64> {
    b.cgroup_limits()
        .into_iter()
        .find(|(_, p, _)| p == cgroup)
        .map(|(_, _, l)| l.hard_bytes)
}

#[test]
fn a_share_whose_cgroup_cannot_carry_the_limit_falls_back_alone() {
    let b = Arc::new(
        SimulatedBackend::new(vec![SimulatedGpu::new("GPU-a", 16 * GIB)])
            .with_required_cgroup_file(crate::dmem::DMEM_MAX),
    );
    let l = limiter(&b);
    let ready = pod_dir(&[], true);
    let bare = pod_dir(&[], false);
    let e = l.apply(&spec_at("s1", "4Gi", ready.path())).unwrap();
    assert_eq!(e.mechanism, "simulated-cgroup");
    assert_eq!(e.enforced[MEMORY], Quantity::parse("4Gi").unwrap());
    assert!(e.notes.is_empty());
    // The other pod's cgroup has no dmem.max: that share alone is watched, and says why.
    let f = l.apply(&spec_at("s2", "4Gi", bare.path())).unwrap();
    assert_eq!(f.mechanism, "simulated-watchdog");
    assert!(f.enforced.is_empty() && f.watch_only, "{f:?}");
    assert!(
        f.notes[0].contains("simulated-cgroup not used for this share")
            && f.notes[0].contains("has no dmem.max"),
        "{:?}",
        f.notes
    );
    assert_eq!(
        hard_limit(&b, bare.path()),
        None,
        "nothing set where it cannot bind"
    );
    // Its capacity still counts.
    assert!(matches!(
        l.apply(&spec_at("s3", "9Gi", ready.path())).unwrap_err(),
        LimiterError { .. }
    ));
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::NvmlCgroup);
}

#[test]
fn containers_leaf_cgroups_get_the_pods_limit_as_they_appear() {
    let b = Arc::new(
        SimulatedBackend::new(vec![SimulatedGpu::new("GPU-a", 16 * GIB)])
            .with_required_cgroup_file(crate::dmem::DMEM_MAX),
    );
    let l = limiter(&b);
    let pod = pod_dir(&[("c1", true), ("no-dmem", false)], true);
    let s = spec_at("s1", "4Gi", pod.path());
    let e = l.apply(&s).unwrap();
    assert_eq!(e.enforced[MEMORY], Quantity::parse("4Gi").unwrap());
    assert_eq!(hard_limit(&b, pod.path()), Some(4 * GIB));
    assert_eq!(hard_limit(&b, &pod.path().join("c1")), Some(4 * GIB));
    assert_eq!(hard_limit(&b, &pod.path().join("no-dmem")), None);

    // A container started: verify gives its leaf the limit and reads it back.
    add_leaf(pod.path(), "c2", true);
    assert_eq!(l.verify(&s).unwrap(), e);
    assert_eq!(hard_limit(&b, &pod.path().join("c2")), Some(4 * GIB));
    // So does the watchdog's pass, without a verify.
    add_leaf(pod.path(), "c3", true);
    l.follow_leaves();
    assert_eq!(hard_limit(&b, &pod.path().join("c3")), Some(4 * GIB));
    // A leaf whose limit changed behind the agent's back is drift, as the pod's is.
    b.tamper_cgroup_limit(
        "GPU-a",
        &pod.path().join("c1"),
        Some(crate::backend::CgroupLimit {
            soft_bytes: 0,
            hard_bytes: 8 * GIB,
            used_bytes: 0,
        }),
    );
    assert!(l.verify(&s).unwrap().enforced.is_empty());
    assert_eq!(l.apply(&s).unwrap(), e);

    l.remove("s1").unwrap();
    for t in ["", "c1", "c2", "c3"] {
        assert_eq!(hard_limit(&b, &pod.path().join(t)), None, "{t}");
    }
}

#[test]
fn an_observed_share_is_watched_in_report_mode_and_limited_by_nothing() {
    let b = sim(vec![SimulatedGpu::new("GPU-a", 80 * GIB)]);
    let l = limiter(&b);
    let s = spec("s1", "8Gi", POD_A);
    let terminate = Action::Terminate {
        grace: std::time::Duration::from_secs(1),
    };
    let e = l.observe(&s).unwrap();
    assert!(e.observed && e.enforced.is_empty(), "{e:?}");
    assert_eq!(
        limit_of(&b, POD_A),
        None,
        "nothing limits an observed share"
    );
    // The watchdog reports its usage against its amount, whatever the device's action.
    let w = l.watched_shares(terminate);
    assert_eq!(w.len(), 1);
    assert_eq!((w[0].limit_bytes, w[0].action), (8 * GIB, Action::Report));
    assert!(l.verify_observed(&s).unwrap().observed);
    // Under enforce, an observed share is not limited: the reconciler applies it.
    let err = l.verify(&s).unwrap_err();
    assert_eq!(err.retry, Retry::Retryable, "{err}");
    l.apply(&s).unwrap();
    assert_eq!(limit_of(&b, POD_A), Some(8 * GIB));
    assert_eq!(l.watched_shares(terminate)[0].action, terminate);
    // Back to observe: the limit comes off, the share stays watched, its capacity held.
    assert_eq!(l.verify_observed(&s).unwrap_err().retry, Retry::Retryable);
    l.observe(&s).unwrap();
    assert_eq!(
        b.cgroup_limits()
            .into_iter()
            .find(|(_, p, _)| *p == cg(POD_A))
            .map(|(_, _, x)| x.hard_bytes)
            .filter(|x| *x != 0),
        None
    );
    assert_eq!(l.watched_shares(terminate)[0].action, Action::Report);
    assert!(
        l.observe(&spec("s2", "73Gi", POD_B)).is_err(),
        "its 8Gi still counts"
    );
    // After a restart, the share is adopted as observed without touching the driver.
    let again = limiter(&b);
    assert!(again.verify_observed(&s).unwrap().observed);
    assert_eq!(again.watched_shares(terminate)[0].action, Action::Report);
}

/// A simulated GPU with a driver root: its containers get the control nodes, their own
/// GPU's node and no other, and the driver's libraries; a root that lacks them refuses
/// the share, naming what is missing, and serves it once the files are there.
#[test]
fn a_share_gets_its_own_gpus_node_and_the_driver_or_is_refused() {
    use crate::driver::tests::FakeRoot;
    if !crate::test_root::require_root_for(module_path!(), "mknod for fake device nodes") {
        return;
    }
    let root = FakeRoot::new();
    root.nodes(&["nvidiactl", "nvidia-uvm", "nvidia0"]);
    let b = sim(vec![
        SimulatedGpu::new("GPU-a", 80 * GIB),
        SimulatedGpu::new("GPU-b", 80 * GIB),
    ]);
    let with_root = |name: &str, uuid: &str| GpuDeviceConfig {
        driver_root: Some(root.dir.path().to_path_buf()),
        ..cfg(name, GpuSelector::Uuid(uuid.into()), None)
    };
    let l = GpuLimiter::new(
        b.clone(),
        &[with_root("gpu0", "GPU-a"), with_root("gpu1", "GPU-b")],
    )
    .unwrap();

    l.apply(&spec("s1", "8Gi", POD_A)).unwrap();
    let d = l.cdi_device("gpu0", "s1").unwrap();
    let nodes: Vec<_> = d.device_nodes.iter().map(|n| n.path.clone()).collect();
    assert_eq!(
        nodes,
        [
            PathBuf::from("/dev/nvidiactl"),
            "/dev/nvidia-uvm".into(),
            "/dev/nvidia0".into()
        ]
    );
    assert!(
        d.mounts
            .iter()
            .any(|m| m.container_path.ends_with("libcuda.so.1")),
        "{:?}",
        d.mounts
    );

    // GPU-b is the simulated back end's second GPU, minor 1, whose node is not there.
    let mut s2 = spec("s2", "8Gi", POD_B);
    s2.device = "gpu1".into();
    let e = l.apply(&s2).unwrap_err();
    assert!(e.message.contains("/dev/nvidia1"), "{e:?}");
    assert!(
        !l.lock().contains_key("s2"),
        "refused before anything was admitted"
    );
    root.nodes_from(1, &["nvidia1"]);
    l.drivers["gpu1"].look_again();
    l.apply(&s2).unwrap();
    let d = l.cdi_device("gpu1", "s2").unwrap();
    assert!(
        d.device_nodes
            .iter()
            .any(|n| n.path == Path::new("/dev/nvidia1"))
            && !d
                .device_nodes
                .iter()
                .any(|n| n.path == Path::new("/dev/nvidia0")),
        "its own GPU's node, no other: {:?}",
        d.device_nodes
    );
}

/// The slice says what a GPU's limit holds to the amount: the share together, each
/// process on its own, or nothing up front; DeviceClasses select on it.
#[test]
fn the_published_facts_say_what_the_limit_binds() {
    let cgroup = sim(vec![SimulatedGpu::new("GPU-a", 80 * GIB)]);
    let l = limiter(&cgroup);
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::NvmlCgroup);
    assert_eq!(l.device_facts("gpu0").attributes["binds"], "share");
    let mut none = SimulatedGpu::new("GPU-b", 80 * GIB);
    none.cgroup_limits = false;
    none.mps = false;
    let l = limiter(&sim(vec![none]));
    assert_eq!(l.device("gpu0").unwrap().mechanism, Mechanism::Watchdog);
    assert_eq!(l.device_facts("gpu0").attributes["binds"], "none");
    assert_eq!(Mechanism::Mps.binds(), "process");
}

/// A device's health is what its GPU last answered the watchdog: a GPU that stops
/// answering is a fault (with the driver's error) from the next poll on, every GPU is
/// asked even after one failed, and the fault is gone once it answers again.
#[test]
fn a_gpu_that_stops_answering_the_watchdog_is_a_fault_until_it_answers() {
    let b = sim(vec![
        SimulatedGpu::new("GPU-a", 80 * GIB),
        SimulatedGpu::new("GPU-b", 80 * GIB),
    ]);
    let l = GpuLimiter::new(
        b.clone(),
        &[
            cfg("gpu0", GpuSelector::Uuid("GPU-a".into()), None),
            cfg("gpu1", GpuSelector::Uuid("GPU-b".into()), None),
        ],
    )
    .unwrap();
    l.process_usage().unwrap();
    assert_eq!(l.device_facts("gpu0").fault, None);
    // Every query fails from now on: the facts say nothing until the watchdog asks.
    b.inject_fault(SimOp::ComputeProcesses, || NvmlError::GpuLost, None);
    assert_eq!(
        l.device_facts("gpu0").fault,
        None,
        "no driver call of its own"
    );
    assert!(l.process_usage().is_err());
    for (device, uuid) in [("gpu0", "GPU-a"), ("gpu1", "GPU-b")] {
        let f = l
            .device_facts(device)
            .fault
            .expect("a fault after the poll");
        assert_eq!(f.reason, "gpu-not-answering");
        assert!(
            f.message
                .starts_with(&format!("GPU {uuid} does not answer the driver")),
            "{f:?}"
        );
    }
    b.clear_faults();
    l.process_usage().unwrap();
    assert_eq!(l.device_facts("gpu0").fault, None);
    assert_eq!(l.device_facts("gpu1").fault, None);
}
