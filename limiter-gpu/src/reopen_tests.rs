use std::path::Path;
use std::sync::Weak;
use std::sync::atomic::{AtomicU32, Ordering};

use nvml_wrapper::error::NvmlError;

use super::*;
use crate::simulated::{SimOp, SimulatedBackend, SimulatedGpu};

const GIB: u64 = 1 << 30;
const GPU: &str = "GPU-reopen-0";

fn cg() -> &'static Path {
    Path::new("/sys/fs/cgroup/kubepods/pod-reopen")
}

fn gpu() -> Arc<SimulatedBackend> {
    Arc::new(SimulatedBackend::new(vec![SimulatedGpu::new(
        GPU,
        16 * GIB,
    )]))
}

/// An opener that hands out the given back ends in order, counting the opens; after
/// the last it fails as a driver that is not loaded.
fn opener(backends: Vec<Arc<SimulatedBackend>>) -> (BackendOpener, Arc<AtomicU32>) {
    let opens = Arc::new(AtomicU32::new(0));
    let count = opens.clone();
    let queue = Mutex::new(backends.into_iter());
    let open: BackendOpener = Arc::new(move || {
        count.fetch_add(1, Ordering::SeqCst);
        let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
        match next {
            Some(b) => Ok(b as Arc<dyn GpuBackend>),
            None => Err(crate::nvml::map_nvml_error(
                "simulated nvmlInit",
                NvmlError::DriverNotLoaded,
            )),
        }
    });
    (open, opens)
}

#[test]
fn a_driver_gone_mid_run_is_reopened_and_the_call_goes_through() {
    let (first, second) = (gpu(), gpu());
    let (open, opens) = opener(vec![first.clone(), second.clone()]);
    let b = ReopeningBackend::open(open, Duration::ZERO).unwrap();
    b.set_cgroup_limit(GPU, cg(), GIB).unwrap();
    // The driver is reloaded: the old handle answers "uninitialized" from now on.
    first.inject_fault(SimOp::SetCgroupLimit, || NvmlError::Uninitialized, None);
    b.set_cgroup_limit(GPU, cg(), 2 * GIB).unwrap();
    assert_eq!(opens.load(Ordering::SeqCst), 2);
    assert_eq!(b.reopened(), 1);
    assert_eq!(
        second
            .cgroup_limit(GPU, cg())
            .unwrap()
            .map(|l| l.hard_bytes),
        Some(2 * GIB),
        "the call ran on the reopened back end"
    );
}

#[test]
fn the_stale_back_end_is_dropped_before_the_new_one_is_opened() {
    // For NVML: nvmlShutdown on the stale handle before nvmlInit, so that NVML's own
    // reference count reaches zero and the new init attaches to the new driver.
    let first = gpu();
    first.inject_fault(SimOp::Discover, || NvmlError::DriverNotLoaded, None);
    let weak: Weak<SimulatedBackend> = Arc::downgrade(&first);
    let handed = Mutex::new(Some(first));
    let dropped_before = Arc::new(Mutex::new(None));
    let seen = dropped_before.clone();
    let open: BackendOpener = Arc::new(move || {
        if let Some(b) = handed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Ok(b as Arc<dyn GpuBackend>);
        }
        *seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(weak.upgrade().is_none());
        Ok(gpu() as Arc<dyn GpuBackend>)
    });
    let b = ReopeningBackend::open(open, Duration::ZERO).unwrap();
    assert_eq!(b.discover().unwrap().len(), 1);
    assert_eq!(
        *dropped_before.lock().unwrap_or_else(|p| p.into_inner()),
        Some(true)
    );
}

#[test]
fn reopening_is_rate_limited() {
    let first = gpu();
    let (open, opens) = opener(vec![first.clone(), gpu()]);
    let b = ReopeningBackend::open(open, Duration::from_secs(3600)).unwrap();
    first.inject_fault(
        SimOp::ComputeProcesses,
        || NvmlError::LibRmVersionMismatch,
        None,
    );
    for _ in 0..5 {
        let e = b.compute_processes(GPU).unwrap_err();
        assert!(matches!(e, GpuError::Reopening(_)), "{e:?}");
        assert!(
            e.is_retryable(),
            "the agent retries while the back end reopens"
        );
    }
    assert_eq!(
        opens.load(Ordering::SeqCst),
        1,
        "no reopen within the interval"
    );
    assert!(!b.is_open());
    assert_eq!(
        b.name(),
        "simulated",
        "names stay while there is no back end"
    );
    assert_eq!(b.mechanism_label(Mechanism::Mps), "simulated-mps");
}

#[test]
fn a_reopen_is_tried_again_once_the_interval_passed() {
    let first = gpu();
    // The first reopen fails (the driver is not back yet), the second works.
    let opens = Arc::new(AtomicU32::new(0));
    let count = opens.clone();
    let handed = Mutex::new(Some(first.clone()));
    let open: BackendOpener = Arc::new(move || {
        let n = count.fetch_add(1, Ordering::SeqCst);
        if let Some(b) = handed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return Ok(b as Arc<dyn GpuBackend>);
        }
        if n == 1 {
            return Err(GpuError::Unavailable("driver not loaded yet".into()));
        }
        Ok(gpu() as Arc<dyn GpuBackend>)
    });
    let interval = Duration::from_millis(50);
    let b = ReopeningBackend::open(open, interval).unwrap();
    first.inject_fault(SimOp::Discover, || NvmlError::DriverNotLoaded, None);
    std::thread::sleep(interval + Duration::from_millis(10));
    let e = b.discover().unwrap_err();
    assert!(
        matches!(&e, GpuError::Reopening(m) if m.contains("driver not loaded yet")),
        "{e:?}"
    );
    assert_eq!(opens.load(Ordering::SeqCst), 2);
    // Within the interval: not tried.
    assert!(b.discover().is_err());
    assert_eq!(opens.load(Ordering::SeqCst), 2);
    std::thread::sleep(interval + Duration::from_millis(10));
    assert_eq!(b.discover().unwrap().len(), 1);
    assert_eq!(opens.load(Ordering::SeqCst), 3);
    assert_eq!(b.reopened(), 1);
}

#[test]
fn errors_that_are_not_about_the_handle_reopen_nothing() {
    let first = gpu();
    let (open, opens) = opener(vec![first.clone(), gpu()]);
    let b = ReopeningBackend::open(open, Duration::ZERO).unwrap();
    first.inject_fault(SimOp::GetCgroupLimit, || NvmlError::Timeout, Some(1));
    assert!(matches!(
        b.cgroup_limit(GPU, cg()).unwrap_err(),
        GpuError::Transient(_)
    ));
    first.inject_fault(SimOp::SetCgroupLimit, || NvmlError::NotSupported, Some(1));
    assert!(matches!(
        b.set_cgroup_limit(GPU, cg(), GIB).unwrap_err(),
        GpuError::NotSupported(_)
    ));
    assert_eq!(opens.load(Ordering::SeqCst), 1);
    assert_eq!(b.reopened(), 0);
}

#[test]
fn a_lost_gpu_keeps_its_class_when_it_stays_lost() {
    let first = gpu();
    let second = gpu();
    first.inject_fault(SimOp::Capabilities, || NvmlError::GpuLost, None);
    second.inject_fault(SimOp::Capabilities, || NvmlError::GpuLost, None);
    let (open, opens) = opener(vec![first, second]);
    let b = ReopeningBackend::open(open, Duration::ZERO).unwrap();
    let e = b.capabilities(GPU).unwrap_err();
    assert!(matches!(e, GpuError::DeviceFault(_)), "{e:?}");
    assert_eq!(
        opens.load(Ordering::SeqCst),
        2,
        "reopened once, then gave up the call"
    );
}
