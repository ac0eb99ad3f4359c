use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use nvml_wrapper::error::NvmlError;
use shareguard_common::Quantity;
use shareguard_common::limiter::{Retry, Target};

use super::*;
use crate::backend::GpuBackend;
use crate::limiter::{GpuDeviceConfig, GpuSelector, MEMORY};
use crate::reopen::{BackendOpener, ReopeningBackend};
use crate::simulated::{SimOp, SimulatedBackend, SimulatedGpu};

const GIB: u64 = 1 << 30;
const GPU: &str = "GPU-deferred-0";

fn gpu() -> Arc<SimulatedBackend> {
    Arc::new(SimulatedBackend::new(vec![SimulatedGpu::new(
        GPU,
        16 * GIB,
    )]))
}

fn cg() -> PathBuf {
    Path::new("/sys/fs/cgroup/kubepods/pod-deferred").to_path_buf()
}

fn configs() -> Vec<GpuDeviceConfig> {
    vec![GpuDeviceConfig {
        name: "gpu0".into(),
        gpu: GpuSelector::Uuid(GPU.into()),
        memory_bytes: None,
        driver_root: None,
        container_driver_root: None,
    }]
}

fn spec() -> LimitSpec {
    LimitSpec {
        share_key: "share-1".into(),
        device: "gpu0".into(),
        limits: BTreeMap::from([(MEMORY.to_string(), Quantity::parse("2Gi").unwrap())]),
        target: Target {
            pod_uids: vec!["pod-deferred".into()],
            cgroups: vec![cg()],
            ..Target::default()
        },
    }
}

/// A builder whose back end fails to open `fail` times (no driver yet), then opens
/// `backend`; counts its calls.
fn builder(backend: Arc<SimulatedBackend>, fail: u32) -> (LimiterBuilder, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let count = calls.clone();
    let build: LimiterBuilder = Box::new(move || {
        let n = count.fetch_add(1, Ordering::SeqCst);
        if n < fail {
            return Err(crate::nvml::map_nvml_error(
                "simulated nvmlInit",
                NvmlError::DriverNotLoaded,
            ));
        }
        GpuLimiter::new(backend.clone(), &configs())
    });
    (build, calls)
}

#[test]
fn shares_wait_retryably_until_the_driver_comes_then_enforce() {
    let b = gpu();
    let (build, calls) = builder(b.clone(), 2);
    let l = DeferredGpuLimiter::new("simulated", build, Duration::ZERO);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "tried at once");
    assert!(l.built().is_none());
    let facts = l.device_facts("gpu0");
    assert_eq!(facts.mechanism, "unavailable");
    assert!(!facts.enforces);
    assert_eq!(l.needs("gpu0"), Needs::Cgroup);
    assert!(l.failed_apply_installs_nothing());

    let e = l.apply(&spec()).unwrap_err();
    assert_eq!(e.retry, Retry::Retryable, "{e:?}");
    assert!(e.message.contains("driver"), "says why: {}", e.message);
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // The driver is there now: the next use builds the limiter and enforces.
    let enf = l.apply(&spec()).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(enf.enforced[MEMORY], Quantity::parse("2Gi").unwrap());
    assert_eq!(
        b.cgroup_limit(GPU, &cg()).unwrap().map(|x| x.hard_bytes),
        Some(2 * GIB)
    );
    assert_eq!(l.device_facts("gpu0").mechanism, "simulated-cgroup");
    assert!(!l.failed_apply_installs_nothing());
    // Built for good: never built again.
    l.verify(&spec()).unwrap();
    l.remove("share-1").unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(b.cgroup_limit(GPU, &cg()).unwrap(), None);
}

#[test]
fn building_is_rate_limited() {
    let (build, calls) = builder(gpu(), u32::MAX);
    let l = DeferredGpuLimiter::new("simulated", build, Duration::from_secs(3600));
    for _ in 0..5 {
        assert_eq!(l.apply(&spec()).unwrap_err().retry, Retry::Retryable);
        assert_eq!(l.verify(&spec()).unwrap_err().retry, Retry::Retryable);
        // What an earlier run installed may be in the driver: not "removed".
        assert_eq!(l.remove("share-1").unwrap_err().retry, Retry::Retryable);
        assert!(l.get().is_none());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one attempt per interval");
    assert!(
        l.mechanisms()[0].starts_with("unavailable: "),
        "{:?}",
        l.mechanisms()
    );
}

#[test]
fn a_build_is_tried_again_once_the_interval_passed() {
    let (build, calls) = builder(gpu(), 1);
    let interval = Duration::from_millis(50);
    let l = DeferredGpuLimiter::new("simulated", build, interval);
    assert!(l.get().is_none());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    std::thread::sleep(interval + Duration::from_millis(10));
    assert!(l.get().is_some());
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn a_driver_reloaded_under_a_built_limiter_is_reopened_and_the_share_enforced_again() {
    // Start without a driver, come up, then lose the driver mid-run: the whole chain
    // the agent builds (deferred limiter over a reopening back end).
    let (first, second) = (gpu(), gpu());
    let queue = Mutex::new(vec![first.clone(), second.clone()].into_iter());
    let opens = Arc::new(AtomicU32::new(0));
    let count = opens.clone();
    let open: BackendOpener = Arc::new(move || {
        count.fetch_add(1, Ordering::SeqCst);
        queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .next()
            .map(|b| b as Arc<dyn GpuBackend>)
            .ok_or_else(|| GpuError::Unavailable("no more drivers".into()))
    });
    let build: LimiterBuilder = Box::new(move || {
        let backend = ReopeningBackend::open(open.clone(), Duration::ZERO)?;
        GpuLimiter::new(Arc::new(backend), &configs())
    });
    let l = DeferredGpuLimiter::new("simulated", build, Duration::ZERO);
    l.apply(&spec()).unwrap();
    assert_eq!(
        first
            .cgroup_limit(GPU, &cg())
            .unwrap()
            .map(|x| x.hard_bytes),
        Some(2 * GIB)
    );
    // Reloaded: the old handle answers "driver not loaded" to everything; the new
    // driver starts without the limit.
    for op in [
        SimOp::GetCgroupLimit,
        SimOp::SetCgroupLimit,
        SimOp::Capabilities,
    ] {
        first.inject_fault(op, || NvmlError::DriverNotLoaded, None);
    }
    let enf = l.verify(&spec()).unwrap();
    assert!(
        enf.enforced.is_empty(),
        "the new driver holds no limit: {enf:?}"
    );
    assert_eq!(opens.load(Ordering::SeqCst), 2, "reopened once");
    // The agent re-applies a share that drifted: it is enforced on the new driver.
    let enf = l.apply(&spec()).unwrap();
    assert_eq!(enf.enforced[MEMORY], Quantity::parse("2Gi").unwrap());
    assert_eq!(
        second
            .cgroup_limit(GPU, &cg())
            .unwrap()
            .map(|x| x.hard_bytes),
        Some(2 * GIB)
    );
}

#[test]
fn a_ready_limiter_is_served_as_is() {
    let b = gpu();
    let l = DeferredGpuLimiter::ready(Arc::new(GpuLimiter::new(b, &configs()).unwrap()));
    assert!(l.built().is_some());
    l.apply(&spec()).unwrap();
}
