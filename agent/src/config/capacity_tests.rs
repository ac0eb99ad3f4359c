//! The config refuses what resource.k8s.io refuses in a ResourceSlice's `DeviceCapacity`
//! and `CapacityRequestPolicy`, since the kubelet plugin publishes the devices from it
//! and one refused device makes the whole slice fail.
//!
//! The first table is kubernetes' own, `TestValidateDeviceCapacity` in
//! `pkg/apis/resource/validation/validation_device_capacity_test.go` as of 1.34–1.36,
//! case by case (same names, inputs and verdicts); the second holds what 1.34–1.36
//! accept but the agent refuses, each with the reason; the third the ResourceSlice
//! rules around a device.
//!
//! The fractional-capacity gate (`DRAFractionalCapacityRange`, from Kubernetes 1.37) makes
//! the API server and the scheduler compute ranges in milli-units and compare valid
//! values exactly, where 1.34–1.36 round up to whole units (`100m` and `200m` are then
//! duplicates; a fractional step's grid is not the exact one). The agent follows the
//! stricter of the two in each case, so that a config it accepts publishes on every
//! version: valid values distinct when rounded up, and a range with a step in whole
//! units.

use super::Config;

/// A one-device config: a generic device of capacity `memory` with `value` and the
/// policy lines given (TOML inside `[device.capacity.memory]`).
fn config(value: &str, policy: &str) -> String {
    format!(
        r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"

[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "generic"
allowed_namespaces = ["*"]
[device.capacity.memory]
value = "{value}"
{policy}
"#
    )
}

/// What the config loader says: Ok, or the message (which names the device, capacity
/// and part).
fn load(value: &str, policy: &str) -> Result<(), String> {
    Config::parse(&config(value, policy), "t.toml")
        .map(|_| ())
        .map_err(|e| {
            assert!(e.line > 0, "the error names a line: {e}");
            e.message
        })
}

/// (name, capacity value, policy lines, None when accepted or Some(what the error says)).
type Case = (
    &'static str,
    &'static str,
    &'static str,
    Option<&'static str>,
);

#[test]
fn the_api_servers_own_cases() {
    let cases: &[Case] = &[
        ("no-policy", "1Gi", "", None),
        ("policy-without-default", "1Gi", "", None),
        (
            "policy-with-valid-values-without-default",
            "1Gi",
            r#"valid_values = ["1Gi"]"#,
            Some("default: required"),
        ),
        (
            "policy-with-valid-range-without-default",
            "1Gi",
            r#"valid_range = { min = "1Gi" }"#,
            Some("default: required"),
        ),
        // The config's valid_range table cannot leave min out: TOML refuses it.
        (
            "policy-with-valid-range-without-min",
            "1Gi",
            r#"default = "1Gi"
valid_range = { }"#,
            Some("missing field `min`"),
        ),
        (
            "valid-simple-range",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi" }"#,
            None,
        ),
        (
            "valid-range-with-max",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", max = "10Gi" }"#,
            None,
        ),
        (
            "valid-range-with-step",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", step = "1Gi" }"#,
            None,
        ),
        (
            "valid-range-with-max-and-step",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", max = "10Gi", step = "1Gi" }"#,
            None,
        ),
        (
            "valid-single-option",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["1Gi"]"#,
            None,
        ),
        (
            "valid-two-options",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["1Gi", "10Gi"]"#,
            None,
        ),
        ("default-without-policy", "10Gi", r#"default = "1Gi""#, None),
        (
            "more-than-one-policy",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["1Gi"]
valid_range = { min = "1Gi" }"#,
            Some("exactly one policy"),
        ),
        (
            "invalid-options",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["20Gi"]"#,
            Some("default: 1Gi is not allowed"),
        ),
        (
            "invalid-options-duplicate",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["1Gi", "1Gi"]"#,
            Some("valid_values[1]: 1Gi is a duplicate"),
        ),
        (
            "invalid-options-duplicate-normalized",
            "10Gi",
            r#"default = "1Ki"
valid_values = ["1Ki", "1024"]"#,
            Some("valid_values[1]: 1024 is a duplicate of 1Ki"),
        ),
        (
            "invalid-options-unsort",
            "10Gi",
            r#"default = "1Gi"
valid_values = ["2Gi", "1Gi"]"#,
            Some("valid_values[1]: 1Gi is below 2Gi: values must be sorted"),
        ),
        (
            "invalid-range-large-min-small-max",
            "10Gi",
            r#"default = "2Gi"
valid_range = { min = "20Gi", max = "1Gi" }"#,
            Some("valid_range.max: min 20Gi is larger than max 1Gi"),
        ),
        (
            "invalid-range-large-max",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", max = "20Gi" }"#,
            Some("valid_range.max: 20Gi is larger than the capacity's value 10Gi"),
        ),
        (
            "invalid-range-multiple-of-step",
            "10Gi",
            r#"default = "2Gi"
valid_range = { min = "1Gi", max = "10Gi", step = "2Gi" }"#,
            Some("valid_range.max: 10Gi is not min 1Gi plus a whole number of steps of 2Gi"),
        ),
        (
            "invalid-range-large-step",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", step = "10Gi" }"#,
            Some("valid_range.step: one step (11Gi) is larger than the capacity's value 10Gi"),
        ),
    ];
    check(cases);
}

/// Accepted by the API server of 1.34–1.36 (or by one of them), refused here.
#[test]
fn what_the_agent_refuses_beyond_the_api_server() {
    let cases: &[Case] = &[
        // 1.34–1.36 panic on it (divide by zero); 1.37 refuses it.
        (
            "zero-step",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", step = "0" }"#,
            Some("valid_range.step: must be greater than zero"),
        ),
        // Negative amounts: 1.37 refuses a negative min with a step; nothing consumes
        // a negative amount.
        (
            "negative-min",
            "10Gi",
            r#"default = "0"
valid_range = { min = "-1" }"#,
            Some("valid_range.min: \"-1\" is negative"),
        ),
        (
            "negative-step",
            "10Gi",
            r#"default = "1Gi"
valid_range = { min = "1Gi", step = "-1Mi" }"#,
            Some("valid_range.step: \"-1Mi\" is negative"),
        ),
        // With a step: 1.34–1.36 compute the grid in whole units (rounded up), the exact
        // grid differs, and the scheduler hands out whole amounts.
        (
            "fractional-step",
            "1",
            r#"default = "200m"
valid_range = { min = "200m", max = "1", step = "100m" }"#,
            Some("valid_range.step: 100m is not a whole number"),
        ),
        // 1.34–1.36 compare valid values rounded up: 100m and 200m are both 1 to them.
        (
            "fractional-values-equal-when-rounded",
            "10Gi",
            r#"default = "100m"
valid_values = ["100m", "200m"]"#,
            Some("valid_values[1]: 200m is a duplicate of 100m to Kubernetes 1.34-1.36"),
        ),
        (
            "decimal-point-duplicate",
            "10",
            r#"default = "1"
valid_values = ["1", "1.0"]"#,
            Some("valid_values[1]: 1 is a duplicate of 1"),
        ),
        // Beyond int64 units, Kubernetes' arithmetic wraps.
        (
            "step-above-int64",
            "100E",
            r#"default = "1"
valid_range = { min = "1", step = "10E" }"#,
            Some("valid_range.step: \"10E\" is above 9223372036854775807"),
        ),
        // A default above the capacity with no max: never fits a request that names no
        // amount.
        (
            "default-above-capacity",
            "10Gi",
            r#"default = "20Gi"
valid_range = { min = "1Gi" }"#,
            Some("default: 20Gi is larger than the capacity's value 10Gi"),
        ),
        (
            "default-above-capacity-without-policy",
            "10Gi",
            r#"default = "20Gi""#,
            Some("default: 20Gi is larger than the capacity's value 10Gi"),
        ),
        // The issue's three, which the agent used to accept.
        (
            "valid-value-above-capacity",
            "2",
            r#"default = "1"
valid_values = ["1", "3"]"#,
            Some("valid_values[1]: 3 is larger than the capacity's value 2"),
        ),
        (
            "min-above-capacity",
            "1Gi",
            r#"default = "2Gi"
valid_range = { min = "2Gi" }"#,
            Some("valid_range.min: 2Gi is larger than the capacity's value 1Gi"),
        ),
        (
            "too-many-values",
            "100",
            r#"default = "1"
valid_values = ["1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11"]"#,
            Some("valid_values: 11 entries, at most 10"),
        ),
        // Accepted: a fractional range without a step is exact everywhere.
        (
            "fractional-range-without-step",
            "1",
            r#"default = "250m"
valid_range = { min = "200m", max = "1" }"#,
            None,
        ),
        (
            "fractional-values",
            "10",
            r#"default = "1500m"
valid_values = ["1500m", "3"]"#,
            None,
        ),
    ];
    check(cases);
}

fn check(cases: &[Case]) {
    let mut wrong = Vec::new();
    for (name, value, policy, want) in cases {
        let got = load(value, policy);
        let ok = match (want, &got) {
            (None, Ok(())) => true,
            // TOML's own refusals come before the device is known.
            (Some(w), Err(m)) if w.starts_with("missing field") => m.contains(w),
            (Some(w), Err(m)) => m.contains(w) && m.contains("device gen-0: capacity memory"),
            _ => false,
        };
        if !ok {
            wrong.push(format!("{name}: want {want:?}, got {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The ResourceSlice rules around a device: capacity names, attributes and capacities
/// together, devices per pool, the driver name.
#[test]
fn what_a_resource_slice_takes_around_a_device() {
    // A capacity name is a C identifier, optionally after a domain.
    let text = config("1", "").replace("capacity.memory", "capacity.\"egress-rate\"");
    let e = Config::parse(&text, "t.toml").unwrap_err();
    assert!(
        e.message
            .contains("\"egress-rate\" is not a resource.k8s.io qualified name"),
        "{e}"
    );
    let ok = config("1", "").replace("capacity.memory", "capacity.\"example.com/egress_rate\"");
    Config::parse(&ok, "t.toml").unwrap();

    // 32 attributes and capacities per device: a generic device publishes 4 attributes.
    let caps: String = (0..29)
        .map(|i| format!("[device.capacity.c{i}]\nvalue = \"1\"\n"))
        .collect();
    let base = config("1", "");
    let e = Config::parse(&format!("{base}{caps}"), "t.toml").unwrap_err();
    assert!(
        e.message
            .contains("30 capacities, at most 28 for a generic device"),
        "{e}"
    );
    let fits: String = (0..27)
        .map(|i| format!("[device.capacity.c{i}]\nvalue = \"1\"\n"))
        .collect();
    Config::parse(&format!("{base}{fits}"), "t.toml").unwrap();

    // 128 devices per pool (the plugin publishes a pool as one slice).
    let device = |i: usize, pool: &str| {
        format!(
            "[[device]]\nname = \"d{i}\"\ndriver = \"shareguard.example.com\"\npool = \"{pool}\"\n\
             kind = \"generic\"\n[device.capacity.memory]\nvalue = \"1\"\n"
        )
    };
    let head = "[agent]\nsocket = \"/tmp/x.sock\"\nstate_dir = \"/tmp/state\"\n";
    let full: String = (0..128).map(|i| device(i, "p")).collect();
    Config::parse(&format!("{head}{full}{}", device(200, "other")), "t.toml").unwrap();
    let e = Config::parse(&format!("{head}{full}{}", device(128, "p")), "t.toml").unwrap_err();
    assert!(
        e.message.contains(
            "device d128: pool \"p\" of driver \"shareguard.example.com\" has more than 128 devices"
        ),
        "{e}"
    );

    // A driver name is at most 63 characters.
    let long = format!("{}.example.com", "d".repeat(60));
    let text = config("1", "").replace("shareguard.example.com", &long);
    let e = Config::parse(&text, "t.toml").unwrap_err();
    assert!(e.message.contains("at most 63 characters"), "{e}");
}
