//! `ShareStatus.device_status_json`: a resource.k8s.io `AllocatedDeviceStatus` the shim
//! copies unchanged into `ResourceClaim.status.devices`, so `kubectl get resourceclaim`
//! shows whether a share is enforced, not just scheduled.

use std::time::{Duration, UNIX_EPOCH};

use serde_json::{Map, Value, json};

use crate::record::{Phase, ShareRecord};

/// Kubernetes caps the whole `data` + `conditions` of a device status; keep far below.
pub const MAX_BYTES: usize = 10 * 1024;

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
    }
}

fn rfc3339_seconds(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

pub fn render(r: &ShareRecord) -> String {
    let quantities = |m: &std::collections::BTreeMap<String, shareguard_common::Quantity>| {
        m.iter()
            .map(|(k, v)| (k.clone(), Value::String(v.to_string())))
            .collect::<Map<String, Value>>()
    };
    let mut message = r.reason.clone();
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
            "lastTransitionTime": rfc3339_seconds(r.updated_at_ms),
        }],
        "data": {
            "phase": r.phase.name(),
            "mechanism": r.mechanism,
            "requested": quantities(&r.consumed),
            "enforced": quantities(&r.enforced),
        },
    });
    if let (Some(id), Some(obj)) = (&r.share_id, status.as_object_mut()) {
        obj.insert("shareID".to_owned(), Value::String(id.clone()));
    }
    status.to_string()
}
