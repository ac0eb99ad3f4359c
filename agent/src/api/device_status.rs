//! `ShareStatus.device_status_json`: a resource.k8s.io `AllocatedDeviceStatus` the kubelet
//! plugin copies unchanged into `ResourceClaim.status.devices`, so `kubectl get resourceclaim`
//! shows whether a share is enforced, not just scheduled.

use std::time::{Duration, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use crate::record::{Phase, ShareRecord};

/// Kubernetes caps the whole `data` + `conditions` of a device status; keep far below.
pub const MAX_BYTES: usize = 10 * 1024;

/// The condition that says the node's ledger holds the share (see `render`).
pub const ADMITTED: &str = "Admitted";

fn reason_of(phase: Phase) -> &'static str {
    match phase {
        Phase::Preparing => "Preparing",
        Phase::Enforced => "Enforced",
        Phase::Accounted => "AccountingOnly",
        Phase::Degraded => "Degraded",
        Phase::Failed => "Failed",
        Phase::Unknown => "Unknown",
        Phase::Releasing => "Releasing",
        Phase::Released => "Released",
        Phase::Pending => "WaitingForPodSandbox",
        Phase::Observed => "ObservedNotLimited",
    }
}

fn rfc3339_seconds(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The share's status, with what the agent observes it using (capacity name -> amount,
/// e.g. the GPU watchdog's memory usage) under `data.observed` when there is any.
pub fn render(
    r: &ShareRecord,
    observed: &[(String, String)],
    traffic: Option<&crate::rollout::measure::Measured>,
) -> String {
    let quantities = |m: &crate::amounts::Amounts| {
        m.iter()
            .map(|(k, v)| (k.to_owned(), Value::String(v.to_string())))
            .collect::<Map<String, Value>>()
    };
    let mut message = r.reason.to_string();
    // A message long enough to break the size bound is cut, never the structure.
    if message.len() > 1024 {
        let mut end = 1024;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    let mut status = json!({
        "driver": r.driver,
        "pool": r.pool,
        "device": r.device,
        "conditions": [{
            "type": "Enforced",
            "status": if r.phase == Phase::Enforced { "True" } else { "False" },
            "reason": reason_of(r.phase),
            "message": message,
            "lastTransitionTime": rfc3339_seconds(if r.condition_since_ms != 0 {
                r.condition_since_ms
            } else {
                r.updated_at_ms
            }),
        }, {
            // The node's ledger holds the share's capacity: the binding condition the
            // scheduler waits for where the plugin publishes binding conditions. True
            // from admission to release; a FAILED share holds nothing.
            "type": ADMITTED,
            "status": if r.phase.holds_capacity() { "True" } else { "False" },
            "reason": if r.phase.holds_capacity() { "CapacityHeld" } else { reason_of(r.phase) },
            "message": if r.phase.holds_capacity() {
                "the node's ledger holds the share's capacity"
            } else {
                "the node's ledger holds nothing for the share"
            },
            "lastTransitionTime": rfc3339_seconds(r.created_at_ms),
        }],
        "data": {
            "phase": r.phase.name(),
            "mechanism": r.mechanism,
            "requested": quantities(&r.consumed),
            "enforced": quantities(&r.enforced),
        },
    });
    if !observed.is_empty()
        && let Some(data) = status.get_mut("data").and_then(Value::as_object_mut)
    {
        let o: Map<String, Value> = observed
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        data.insert("observed".to_owned(), Value::Object(o));
    }
    if let Some(m) = traffic
        && let Some(data) = status.get_mut("data").and_then(Value::as_object_mut)
    {
        // Fixed keys and integers: a few hundred bytes at most, well inside the bound.
        let dir = |a: &crate::rollout::measure::Above| {
            json!({
                "bytes": a.bytes,
                "msAboveRate": a.ms_above,
                "bytesAboveRate": a.bytes_above,
                "peakBps": a.peak_bps,
            })
        };
        data.insert(
            "traffic".to_owned(),
            json!({
                "toPod": dir(&m.to_pod),
                "fromPod": dir(&m.from_pod),
                "intervalMs": m.interval_ms,
            }),
        );
    }
    if let (Some(id), Some(obj)) = (r.share_id(), status.as_object_mut()) {
        obj.insert("shareID".to_owned(), Value::String(id.to_owned()));
    }
    status.to_string()
}

#[cfg(test)]
mod tests {
    /// docs/kubernetes.md's table of reasons has a row for every reason a claim can
    /// show: one per phase, and the Admitted condition's own.
    #[test]
    fn every_reason_has_a_row_in_the_docs_table() {
        let docs = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/kubernetes.md"),
        )
        .unwrap();
        for phase in Phase::ALL {
            let row = format!("| `{}` | {} |", reason_of(phase), phase.name());
            assert!(docs.contains(&row), "docs/kubernetes.md has no row {row}");
        }
        assert!(docs.contains("reason `CapacityHeld`"));
    }

    use std::collections::BTreeMap;

    use serde_json::Value;
    use shareguard_common::Quantity;

    use super::*;
    use crate::record::{ClaimId, TargetRecord};

    fn record(phase: Phase, reason: &str) -> ShareRecord {
        let q = |s: &str| Quantity::parse(s).unwrap();
        ShareRecord {
            key: "3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c".into(),
            shared: true,
            claim: ClaimId::default(),
            allocation_id: "a".into(),
            request: "r".into(),
            driver: "shareguard.example.com".into(),
            pool: "node-a".into(),
            device: "gpu-0".into(),
            consumed: BTreeMap::from([("memory".to_owned(), q("10Gi"))]).into(),
            policy_version: "1".into(),
            admin_access: false,
            target: TargetRecord::default(),
            phase,
            mechanism: "nvml-cgroup".into(),
            enforced: if phase == Phase::Enforced {
                BTreeMap::from([("memory".to_owned(), q("10Gi"))]).into()
            } else {
                Default::default()
            },
            reason: reason.to_owned().into(),
            error: None,
            epoch: 1,
            created_at_ms: 1,
            updated_at_ms: 1_795_956_110_233,
            released_at_ms: None,
            sandbox: None,
            more_sandboxes: None,
            device_kind: "gpu".into(),
            condition_since_ms: 0,
            quarantined: false,
            rolling_back: false,
            pre_bind: false,
        }
    }

    /// The rules of resource.k8s.io/v1 `AllocatedDeviceStatus` and metav1 `Condition`
    /// that the API server validates, as far as the kubelet plugin copying the JSON relies on them.
    fn check_allocated_device_status(v: &Value) -> Result<(), String> {
        let o = v.as_object().ok_or("not an object")?;
        for k in o.keys() {
            if ![
                "driver",
                "pool",
                "device",
                "shareID",
                "conditions",
                "data",
                "networkData",
            ]
            .contains(&k.as_str())
            {
                return Err(format!("unknown field {k}"));
            }
        }
        for k in ["driver", "pool", "device"] {
            if o.get(k).and_then(Value::as_str).is_none_or(str::is_empty) {
                return Err(format!("{k} missing"));
            }
        }
        if let Some(id) = o.get("shareID") {
            let id = id.as_str().ok_or("shareID not a string")?;
            if id.len() != 36 || id.chars().any(|c| c.is_ascii_uppercase()) {
                return Err(format!("shareID {id} is not a lowercase UUID"));
            }
        }
        let conds = o
            .get("conditions")
            .and_then(Value::as_array)
            .ok_or("conditions")?;
        if conds.len() > 8 {
            return Err("more than 8 conditions".into());
        }
        for c in conds {
            let c = c.as_object().ok_or("condition not an object")?;
            for k in c.keys() {
                if ![
                    "type",
                    "status",
                    "reason",
                    "message",
                    "lastTransitionTime",
                    "observedGeneration",
                ]
                .contains(&k.as_str())
                {
                    return Err(format!("unknown condition field {k}"));
                }
            }
            let s = |k: &str| {
                c.get(k)
                    .and_then(Value::as_str)
                    .ok_or(format!("condition {k}"))
            };
            if !["True", "False", "Unknown"].contains(&s("status")?) {
                return Err("condition status".into());
            }
            let reason = s("reason")?;
            let ok = reason.len() <= 1024
                && reason.starts_with(|c: char| c.is_ascii_alphabetic())
                && reason
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_,:".contains(c))
                && !reason.ends_with([',', ':']);
            if !ok {
                return Err(format!("condition reason {reason:?}"));
            }
            if s("message")?.len() > 32 * 1024 {
                return Err("condition message too long".into());
            }
            humantime::parse_rfc3339(s("lastTransitionTime")?)
                .map_err(|e| format!("lastTransitionTime: {e}"))?;
            if s("type")?.is_empty() {
                return Err("condition type empty".into());
            }
        }
        if !o.get("data").is_some_and(Value::is_object) {
            return Err("data must be an object (a RawExtension of JSON)".into());
        }
        Ok(())
    }

    #[test]
    fn every_phase_renders_a_valid_allocated_device_status_under_10k() {
        for phase in Phase::ALL {
            // A reason far above the bound is cut, not the structure.
            let r = record(phase, &"é".repeat(20_000));
            // The largest figures traffic can have, with a GPU's usage besides.
            let most = crate::rollout::measure::Above {
                bytes: u64::MAX,
                ms_above: u64::MAX,
                bytes_above: u64::MAX,
                peak_bps: u64::MAX,
            };
            let mut traffic = crate::rollout::measure::Measured::default();
            (traffic.to_pod, traffic.from_pod, traffic.interval_ms) = (most, most, u64::MAX);
            let text = render(&r, &[("memory".into(), "3Gi".into())], Some(&traffic));
            assert!(text.len() <= MAX_BYTES, "{phase:?}: {} bytes", text.len());
            let v: Value = serde_json::from_str(&text).unwrap();
            check_allocated_device_status(&v).unwrap_or_else(|e| panic!("{phase:?}: {e}: {v}"));
            assert_eq!(v["data"]["observed"]["memory"], "3Gi");
            assert_eq!(v["data"]["traffic"]["fromPod"]["msAboveRate"], u64::MAX);
            assert_eq!(
                v["conditions"][0]["status"],
                if phase == Phase::Enforced {
                    "True"
                } else {
                    "False"
                }
            );
            assert_eq!(v["conditions"][1]["type"], ADMITTED);
            assert_eq!(
                v["conditions"][1]["status"],
                if matches!(phase, Phase::Failed | Phase::Released) {
                    "False"
                } else {
                    "True"
                },
                "{phase:?}: a share holds capacity until it fails or is released"
            );
        }
    }

    #[test]
    fn the_check_rejects_what_the_api_server_would() {
        let good: Value =
            serde_json::from_str(&render(&record(Phase::Enforced, "ok"), &[], None)).unwrap();
        check_allocated_device_status(&good).unwrap();
        let mut bad = good.clone();
        bad["conditions"][0]["reason"] = "not camel case!".into();
        assert!(check_allocated_device_status(&bad).is_err());
        let mut bad = good.clone();
        bad["extra"] = 1.into();
        assert!(check_allocated_device_status(&bad).is_err());
        let mut bad = good;
        bad["data"] = "x".into();
        assert!(check_allocated_device_status(&bad).is_err());
    }
}
