//! The server-side apply body that sets one driver's `status.devices` entries of one
//! claim: the agent's `device_status_json` of each of the claim's live shares, unchanged.

use serde_json::{Value, json};
use shareguard_proto::v1 as pb;

/// Which entries one apply owns: a claim (by uid, so that a claim created anew under the
/// same name is never written) and one of our drivers, the apply's field manager.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub driver: String,
}

impl Target {
    pub fn of(s: &pb::ShareStatus) -> Option<Self> {
        let c = s.claim.as_ref()?;
        Some(Self {
            uid: c.uid.clone(),
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            driver: s.driver.clone(),
        })
    }
}

/// A share is shown from Prepare until Unprepare began; then its entry goes.
pub fn shown(s: &pb::ShareStatus) -> bool {
    !matches!(
        pb::Phase::try_from(s.phase),
        Ok(pb::Phase::Releasing | pb::Phase::Released)
    )
}

/// The apply body. With no share, `devices: []`: server-side apply then removes every
/// entry this driver set before and leaves other drivers' entries alone.
/// A share whose JSON does not parse is left out with a warning rather than failing the
/// claim's other entries.
pub fn body(t: &Target, shares: &[&pb::ShareStatus]) -> Value {
    let mut devices: Vec<Value> = shares
        .iter()
        .filter(|s| shown(s))
        .filter_map(|s| match serde_json::from_str::<Value>(&s.device_status_json) {
            Ok(v) if v.is_object() => Some(v),
            _ => {
                tracing::warn!(share = %s.share_id, claim = %t.name, "device_status_json is not a JSON object; left out");
                None
            }
        })
        .collect();
    // The list is a map keyed by driver, pool, device and shareID; a stable order keeps
    // equal statuses equal bodies.
    devices.sort_by_key(|v| {
        ["pool", "device", "shareID"]
            .map(|k| v.get(k).and_then(Value::as_str).unwrap_or("").to_owned())
    });
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": t.name, "namespace": t.namespace, "uid": t.uid},
        "status": {"devices": devices},
    })
}

/// Whether share `now`'s status differs from `before`'s only in its conditions'
/// messages (and so says nothing new that a controller or the scheduler reads: the same
/// phase, conditions, reasons, data and visibility).
pub fn differs_in_messages_only(before: &pb::ShareStatus, now: &pb::ShareStatus) -> bool {
    let without_messages = |s: &pb::ShareStatus| -> Option<Value> {
        let mut v: Value = serde_json::from_str(&s.device_status_json).ok()?;
        for c in v.get_mut("conditions")?.as_array_mut()? {
            c.as_object_mut()?.remove("message");
        }
        Some(v)
    };
    shown(before) == shown(now)
        && before.device_status_json != now.device_status_json
        && without_messages(before).is_some_and(|b| Some(b) == without_messages(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(id: &str, phase: pb::Phase, json: &str) -> pb::ShareStatus {
        pb::ShareStatus {
            share_id: id.into(),
            claim: Some(pb::ClaimRef {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
            }),
            driver: "d.example.com".into(),
            phase: phase as i32,
            device_status_json: json.into(),
            ..Default::default()
        }
    }

    #[test]
    fn live_shares_in_a_stable_order_and_released_ones_left_out() {
        let a = share(
            "b",
            pb::Phase::Enforced,
            r#"{"driver":"d.example.com","pool":"p","device":"eth0","shareID":"b"}"#,
        );
        let b = share(
            "a",
            pb::Phase::Pending,
            r#"{"driver":"d.example.com","pool":"p","device":"eth0","shareID":"a"}"#,
        );
        let gone = share("c", pb::Phase::Released, r#"{"shareID":"c"}"#);
        let bad = share("d", pb::Phase::Enforced, "not json");
        let t = Target::of(&a).unwrap();
        let v = body(&t, &[&a, &gone, &b, &bad]);
        let ids: Vec<&str> = v["status"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["shareID"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(v["metadata"]["uid"], "u1");
        assert_eq!(body(&t, &[&gone])["status"]["devices"], json!([]));
    }

    #[test]
    fn a_new_message_alone_is_told_apart_from_a_change_that_matters() {
        let status = |reason: &str, message: &str, phase: &str| {
            json!({"driver": "d.example.com", "pool": "p", "device": "eth0", "shareID": "a",
                "conditions": [{"type": "Enforced", "status": "False", "reason": reason,
                                "message": message, "lastTransitionTime": "2026-12-05T00:00:00Z"}],
                "data": {"phase": phase}})
            .to_string()
        };
        let waiting = share(
            "a",
            pb::Phase::Pending,
            &status(
                "WaitingForPodSandbox",
                "kubelet has not prepared the claim",
                "PENDING",
            ),
        );
        let no_sandbox = share(
            "a",
            pb::Phase::Pending,
            &status(
                "WaitingForPodSandbox",
                "no sandbox of the pod yet",
                "PENDING",
            ),
        );
        assert!(differs_in_messages_only(&waiting, &no_sandbox));
        assert!(
            !differs_in_messages_only(&waiting, &waiting),
            "no change at all"
        );
        let enforced = share(
            "a",
            pb::Phase::Enforced,
            &status("Enforced", "no sandbox of the pod yet", "ENFORCED"),
        );
        assert!(!differs_in_messages_only(&no_sandbox, &enforced));
        let released = share(
            "a",
            pb::Phase::Released,
            &status("WaitingForPodSandbox", "released", "PENDING"),
        );
        assert!(
            !differs_in_messages_only(&no_sandbox, &released),
            "its entry goes: that matters"
        );
    }
}
