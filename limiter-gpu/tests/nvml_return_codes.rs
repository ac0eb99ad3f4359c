//! Every `nvmlReturn_t` nvml.h declares (`tests/fixtures/nvml-return-codes.txt`, with its
//! source named there), through nvml-wrapper's conversion and shareguard's mapping: the
//! class each code gets, for calls in general and for calls on one cgroup. A code the
//! fixture gains without a class here fails the test, so a new driver's codes are
//! classified on purpose, not by a fall-through.

use std::collections::BTreeMap;
use std::path::Path;

use nvml_wrapper::error::{NvmlError, nvml_try};
use shareguard_limiter_gpu::GpuError;
use shareguard_limiter_gpu::nvml::{interpret_get, map_cgroup_error, map_nvml_error};

const FIXTURE: &str = include_str!("fixtures/nvml-return-codes.txt");

fn codes() -> Vec<(String, u32)> {
    FIXTURE
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, value) = l
                .split_once(' ')
                .unwrap_or_else(|| panic!("fixture line {l:?} is not <name> <value>"));
            let value = value
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("fixture line {l:?}: {e}"));
            (name.to_string(), value)
        })
        .collect()
}

fn class(e: &GpuError) -> &'static str {
    match e {
        GpuError::Unavailable(_) => "unavailable",
        GpuError::NotSupported(_) => "not-supported",
        GpuError::GpuNotFound(_) => "gpu-not-found",
        GpuError::InvalidArgument(_) => "invalid-argument",
        GpuError::Oversubscribed(_) => "oversubscribed",
        GpuError::TargetMissing(_) => "target-missing",
        GpuError::Transient(_) => "transient",
        GpuError::DeviceFault(_) => "device-fault",
        GpuError::UsageAboveLimit { .. } => "usage-above-limit",
        GpuError::Reopening(_) => "reopening",
        GpuError::Internal(_) => "internal",
        // Not an NVML return code: what the MPS control program said.
        GpuError::MpsClientHeld { .. } => "mps-client-held",
    }
}

/// name -> (class of a call in general, class of a call on one cgroup).
fn expected() -> BTreeMap<&'static str, (&'static str, &'static str)> {
    let same = |c| (c, c);
    BTreeMap::from([
        ("NVML_ERROR_UNINITIALIZED", same("unavailable")),
        ("NVML_ERROR_INVALID_ARGUMENT", same("invalid-argument")),
        ("NVML_ERROR_NOT_SUPPORTED", same("not-supported")),
        ("NVML_ERROR_NO_PERMISSION", same("unavailable")),
        ("NVML_ERROR_ALREADY_INITIALIZED", same("internal")),
        ("NVML_ERROR_NOT_FOUND", same("gpu-not-found")),
        ("NVML_ERROR_INSUFFICIENT_SIZE", same("transient")),
        ("NVML_ERROR_INSUFFICIENT_POWER", same("unavailable")),
        ("NVML_ERROR_DRIVER_NOT_LOADED", same("unavailable")),
        ("NVML_ERROR_TIMEOUT", same("transient")),
        ("NVML_ERROR_IRQ_ISSUE", same("transient")),
        ("NVML_ERROR_LIBRARY_NOT_FOUND", same("unavailable")),
        ("NVML_ERROR_FUNCTION_NOT_FOUND", same("not-supported")),
        ("NVML_ERROR_CORRUPTED_INFOROM", same("unavailable")),
        ("NVML_ERROR_GPU_IS_LOST", same("device-fault")),
        ("NVML_ERROR_RESET_REQUIRED", same("device-fault")),
        // The one code whose meaning depends on the call: on a cgroup it is the
        // cgroup's files that could not be reached.
        (
            "NVML_ERROR_OPERATING_SYSTEM",
            ("unavailable", "target-missing"),
        ),
        ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", same("unavailable")),
        ("NVML_ERROR_IN_USE", same("transient")),
        ("NVML_ERROR_MEMORY", same("transient")),
        ("NVML_ERROR_NO_DATA", same("transient")),
        ("NVML_ERROR_VGPU_ECC_NOT_SUPPORTED", same("not-supported")),
        ("NVML_ERROR_INSUFFICIENT_RESOURCES", same("transient")),
        ("NVML_ERROR_FREQ_NOT_SUPPORTED", same("not-supported")),
        (
            "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
            same("not-supported"),
        ),
        ("NVML_ERROR_DEPRECATED", same("not-supported")),
        ("NVML_ERROR_NOT_READY", same("transient")),
        ("NVML_ERROR_GPU_NOT_FOUND", same("gpu-not-found")),
        ("NVML_ERROR_INVALID_STATE", same("transient")),
        ("NVML_ERROR_RESET_TYPE_NOT_SUPPORTED", same("not-supported")),
        ("NVML_ERROR_UNKNOWN", same("transient")),
    ])
}

#[test]
fn the_fixture_is_nvml_h_as_nvml_wrapper_sys_carries_it() {
    let codes = codes();
    // Spot checks against values documented on NVIDIA's nvmlReturn_t page.
    for (name, value) in [
        ("NVML_SUCCESS", 0),
        ("NVML_ERROR_NOT_FOUND", 6),
        ("NVML_ERROR_DRIVER_NOT_LOADED", 9),
        ("NVML_ERROR_GPU_IS_LOST", 15),
        ("NVML_ERROR_OPERATING_SYSTEM", 17),
        ("NVML_ERROR_UNKNOWN", 999),
    ] {
        assert!(
            codes.iter().any(|(n, v)| n == name && *v == value),
            "{name} = {value} missing from the fixture"
        );
    }
    let mut values: Vec<u32> = codes.iter().map(|(_, v)| *v).collect();
    values.sort_unstable();
    values.dedup();
    assert_eq!(values.len(), codes.len(), "a value twice in the fixture");
}

#[test]
fn every_code_maps_to_its_class() {
    let expected = expected();
    let cgroup = Path::new("/sys/fs/cgroup/kubepods/pod-fixture");
    let mut seen = 0;
    for (name, value) in codes() {
        if name == "NVML_SUCCESS" {
            assert!(nvml_try(value).is_ok(), "{name} is success");
            continue;
        }
        let (general, on_cgroup) = *expected
            .get(name.as_str())
            .unwrap_or_else(|| panic!("{name} ({value}) has no expected class: classify it"));
        seen += 1;
        let e = map_nvml_error("call", NvmlError::from(value));
        assert_eq!(class(&e), general, "{name} ({value}) -> {e:?}");
        let e = map_cgroup_error("call", cgroup, NvmlError::from(value));
        assert_eq!(
            class(&e),
            on_cgroup,
            "{name} ({value}) on a cgroup -> {e:?}"
        );
        assert!(
            e.to_string().contains("pod-fixture"),
            "names the cgroup: {e}"
        );
    }
    assert_eq!(
        seen,
        expected.len(),
        "a class for a code not in the fixture"
    );
}

#[test]
fn the_getter_reads_not_found_as_no_limit() {
    let cgroup = Path::new("/sys/fs/cgroup/kubepods/pod-fixture");
    let value = codes()
        .into_iter()
        .find(|(n, _)| n == "NVML_ERROR_NOT_FOUND")
        .map(|(_, v)| v)
        .expect("NOT_FOUND is in the fixture");
    let r = interpret_get(Err(NvmlError::from(value)), cgroup, || Ok(1));
    assert_eq!(r, Ok(None));
    let os = codes()
        .into_iter()
        .find(|(n, _)| n == "NVML_ERROR_OPERATING_SYSTEM")
        .map(|(_, v)| v)
        .expect("OPERATING_SYSTEM is in the fixture");
    let r = interpret_get(Err(NvmlError::from(os)), cgroup, || Ok(1));
    assert!(matches!(r, Err(GpuError::TargetMissing(_))), "{r:?}");
}
