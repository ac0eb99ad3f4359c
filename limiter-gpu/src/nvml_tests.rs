use shareguard_common::limiter::Retry;

use super::*;

#[test]
fn nvml_errors_map_to_the_documented_classes() {
    type Class = fn(&GpuError) -> bool;
    let cases: Vec<(NvmlError, Retry, Class)> = vec![
        (NvmlError::LibraryNotFound, Retry::Permanent, |e| {
            matches!(e, GpuError::Unavailable(_))
        }),
        (NvmlError::DriverNotLoaded, Retry::Permanent, |e| {
            matches!(e, GpuError::Unavailable(_))
        }),
        (NvmlError::NoPermission, Retry::Permanent, |e| {
            matches!(e, GpuError::Unavailable(_))
        }),
        (NvmlError::Uninitialized, Retry::Permanent, |e| {
            matches!(e, GpuError::Unavailable(_))
        }),
        (NvmlError::LibRmVersionMismatch, Retry::Permanent, |e| {
            matches!(e, GpuError::Unavailable(_))
        }),
        (NvmlError::NotSupported, Retry::Permanent, |e| {
            matches!(e, GpuError::NotSupported(_))
        }),
        (NvmlError::FunctionNotFound, Retry::Permanent, |e| {
            matches!(e, GpuError::NotSupported(_))
        }),
        (NvmlError::InvalidArg, Retry::Permanent, |e| {
            matches!(e, GpuError::InvalidArgument(_))
        }),
        (NvmlError::NotFound, Retry::Permanent, |e| {
            matches!(e, GpuError::GpuNotFound(_))
        }),
        (NvmlError::Timeout, Retry::Retryable, |e| {
            matches!(e, GpuError::Transient(_))
        }),
        (NvmlError::Unknown, Retry::Retryable, |e| {
            matches!(e, GpuError::Transient(_))
        }),
        (NvmlError::InUse, Retry::Retryable, |e| {
            matches!(e, GpuError::Transient(_))
        }),
        (NvmlError::GpuLost, Retry::Retryable, |e| {
            matches!(e, GpuError::DeviceFault(_))
        }),
        (NvmlError::ResetRequired, Retry::Retryable, |e| {
            matches!(e, GpuError::DeviceFault(_))
        }),
        (NvmlError::UnexpectedVariant(77), Retry::Permanent, |e| {
            matches!(e, GpuError::Internal(_))
        }),
    ];
    for (nvml, retry, class) in cases {
        let shown = format!("{nvml:?}");
        let e = map_nvml_error("call", nvml);
        assert_eq!(e.retry(), retry, "{shown} -> {e:?}");
        assert!(class(&e), "{shown} -> {e:?}");
        assert!(e.to_string().contains("call"), "context kept: {e}");
    }
}

#[test]
fn raw_return_codes_map_through_nvml_wrapper() {
    // nvmlReturn_t values from nvml.h: 9 driver not loaded, 10 timeout, 15 GPU lost.
    assert!(matches!(
        map_nvml_error("x", NvmlError::from(9u32)),
        GpuError::Unavailable(_)
    ));
    assert!(map_nvml_error("x", NvmlError::from(10u32)).is_retryable());
    assert!(matches!(
        map_nvml_error("x", NvmlError::from(15u32)),
        GpuError::DeviceFault(_)
    ));
}

#[test]
fn missing_library_is_an_error_value_not_a_panic() {
    let r = NvmlBackend::open_path(OsStr::new("/nonexistent/libnvidia-ml.so.1"));
    match r {
        Err(GpuError::Unavailable(msg)) => assert!(msg.contains("NVML"), "{msg}"),
        Err(other) => panic!("expected Unavailable, got {other:?}"),
        Ok(_) => panic!("a nonexistent library must not load"),
    }
}

#[test]
fn default_open_without_a_driver_is_unavailable() {
    // This machine has no NVIDIA driver; where one exists the open may succeed.
    if let Err(e) = NvmlBackend::open() {
        assert!(matches!(e, GpuError::Unavailable(_)), "{e:?}");
        assert_eq!(e.retry(), Retry::Permanent);
    }
}

#[test]
fn symbol_presence_agrees_with_the_cgroup_decision() {
    // Only where a driver is present; `sys` tests the lookup itself without one.
    let Ok(b) = NvmlBackend::open() else { return };
    let p = b.memory_limit_symbols();
    match &b.limit_fns {
        CgroupLimitFns::Callable(_) => assert!(p.set && p.get, "{p:?}"),
        CgroupLimitFns::Missing(why) => {
            assert!(!(p.set && p.get), "{p:?}");
            assert!(why.contains("missing from NVML"), "{why}");
        }
    }
}

#[test]
fn mps_clients_join_the_process_list_once() {
    let p = |pid, used, via_mps| ComputeProcess {
        pid,
        used_bytes: used,
        via_mps,
    };
    let merged = merge_processes(
        vec![
            p(10, Some(5), false),
            p(11, None, false),
            p(13, Some(1), false),
        ],
        vec![
            p(11, Some(7), true),
            p(12, None, true),
            p(10, Some(99), true),
        ],
    );
    assert_eq!(
        merged,
        vec![
            p(10, Some(5), true),
            p(11, Some(7), true),
            p(13, Some(1), false),
            p(12, None, true)
        ]
    );
}

#[test]
fn read_back_interpretation() {
    let total = 80 << 30;
    let t = || Ok(total);
    assert_eq!(interpret_limits(0, total, 0, t).unwrap(), None);
    assert_eq!(interpret_limits(0, u64::MAX, 5, t).unwrap(), None);
    // The sentinel needs no total: a failing memory query does not matter then.
    let no_total = || Err(GpuError::Transient("no memory info".into()));
    assert_eq!(interpret_limits(0, u64::MAX, 5, no_total).unwrap(), None);
    let l = interpret_limits(8 << 30, 8 << 30, 1, t).unwrap().unwrap();
    assert_eq!(
        (l.soft_bytes, l.hard_bytes, l.used_bytes),
        (8 << 30, 8 << 30, 1)
    );
    // A hard limit below the GPU with no soft limit is still a limit.
    assert!(interpret_limits(0, 8 << 30, 0, t).unwrap().is_some());
}

#[test]
fn clearing_writes_the_sentinel_first() {
    let mut writes = Vec::new();
    let took = clear_limits(
        |soft, hard| {
            writes.push((soft, hard));
            Ok(())
        },
        || panic!("the total memory is not needed when the sentinel is taken"),
        None,
    )
    .unwrap();
    assert_eq!(took, ClearValue::LimitMax);
    assert_eq!(writes, vec![(0, DEVICE_MEMORY_LIMIT_MAX)]);
}

#[test]
fn a_refused_sentinel_falls_back_to_total_memory_once() {
    let total = 80u64 << 30;
    let mut writes = Vec::new();
    let refuse_max = |writes: &mut Vec<(u64, u64)>, soft, hard| {
        writes.push((soft, hard));
        if hard == DEVICE_MEMORY_LIMIT_MAX {
            Err(NvmlError::InvalidArg)
        } else {
            Ok(())
        }
    };
    let took = clear_limits(|s, h| refuse_max(&mut writes, s, h), || Ok(total), None).unwrap();
    assert_eq!(took, ClearValue::TotalMemory);
    assert_eq!(writes, vec![(0, DEVICE_MEMORY_LIMIT_MAX), (0, total)]);
    // Known from then on: the sentinel is not tried again.
    writes.clear();
    let took = clear_limits(
        |s, h| refuse_max(&mut writes, s, h),
        || Ok(total),
        Some(took),
    )
    .unwrap();
    assert_eq!(took, ClearValue::TotalMemory);
    assert_eq!(writes, vec![(0, total)]);
}

#[test]
fn a_clear_failing_otherwise_is_not_retried_with_total_memory() {
    let mut calls = 0;
    let err = clear_limits(
        |_, _| {
            calls += 1;
            Err(NvmlError::OperatingSystem)
        },
        || Ok(1),
        None,
    )
    .unwrap_err();
    assert!(matches!(err, NvmlError::OperatingSystem), "{err:?}");
    assert_eq!(calls, 1);
    // Nor is an invalid argument once the sentinel is known to be taken.
    let err = clear_limits(
        |_, _| Err(NvmlError::InvalidArg),
        || panic!("no fallback"),
        Some(ClearValue::LimitMax),
    )
    .unwrap_err();
    assert!(matches!(err, NvmlError::InvalidArg), "{err:?}");
}

#[test]
fn an_operating_system_error_on_a_cgroup_is_a_missing_target() {
    let cg = Path::new("/sys/fs/cgroup/kubepods/podx");
    let e = map_cgroup_error(
        "nvmlDeviceGetMemoryLimits_v1",
        cg,
        NvmlError::OperatingSystem,
    );
    assert!(matches!(e, GpuError::TargetMissing(_)), "{e:?}");
    assert!(e.is_retryable());
    assert!(e.to_string().contains("/kubepods/podx"), "{e}");
    // Elsewhere it still means NVML is unusable.
    assert!(matches!(
        map_nvml_error("nvmlInit", NvmlError::OperatingSystem),
        GpuError::Unavailable(_)
    ));
    // Other errors on a cgroup keep their class and name the cgroup.
    let e = map_cgroup_error("set", cg, NvmlError::Timeout);
    assert!(
        matches!(e, GpuError::Transient(ref m) if m.contains("podx")),
        "{e:?}"
    );
}

#[test]
fn a_refusal_below_current_usage_is_its_own_error() {
    let cg = Path::new("/sys/fs/cgroup/kubepods/pody");
    let limit = 1u64 << 30;
    let using = |used| {
        move || {
            Ok(RawMemoryLimits {
                soft: 0,
                hard: u64::MAX,
                current_used: used,
            })
        }
    };
    for refusal in [
        NvmlError::InsufficientMemory,
        NvmlError::InUse,
        NvmlError::UnexpectedVariant(23),
    ] {
        let shown = format!("{refusal:?}");
        let e = set_refusal(refusal, cg, limit, using(3 << 30));
        match &e {
            GpuError::UsageAboveLimit {
                cgroup,
                used,
                limit: l,
            } => {
                assert_eq!(
                    (cgroup.as_str(), *used, *l),
                    ("/sys/fs/cgroup/kubepods/pody", 3 << 30, limit)
                );
            }
            other => panic!("{shown}: {other:?}"),
        }
        assert!(e.is_retryable());
        let text = e.to_string();
        assert!(
            text.contains("pody") && text.contains(&(3u64 << 30).to_string()),
            "{text}"
        );
    }
    // The same answer with usage within the limit keeps its own meaning.
    let e = set_refusal(NvmlError::InsufficientMemory, cg, limit, using(limit));
    assert!(matches!(e, GpuError::Transient(_)), "{e:?}");
    // A getter that fails too gives the setter's error, not a guess.
    let e = set_refusal(NvmlError::InUse, cg, limit, || {
        Err(NvmlError::OperatingSystem)
    });
    assert!(matches!(e, GpuError::Transient(_)), "{e:?}");
    // Other refusals are not read back at all.
    let e = set_refusal(NvmlError::NotFound, cg, limit, || panic!("not read"));
    assert!(matches!(e, GpuError::NotSupported(_)), "{e:?}");
    let e = set_refusal(NvmlError::OperatingSystem, cg, limit, || panic!("not read"));
    assert!(matches!(e, GpuError::TargetMissing(_)), "{e:?}");
}

#[test]
fn missing_symbols_are_named() {
    let r = missing_reason(
        SymbolPresence {
            set: false,
            get: true,
        },
        "610.1",
    );
    assert!(r.contains("nvmlDeviceSetMemoryLimits_v1 is missing"), "{r}");
    assert!(r.contains("R615"), "{r}");
}
