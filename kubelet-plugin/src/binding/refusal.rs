//! The server-side apply body that tells the scheduler the node refused a claim's
//! shares: [`super::REFUSED`] True on each of the driver's results of this node. Applied
//! under a field manager of its own, so the status writer's applies of the same entries
//! (which own `Enforced` and `Admitted`) neither remove it nor conflict with it.

use std::collections::BTreeSet;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::{Value, json};

use super::REFUSED;

/// A condition's message is bounded by the API server (32 KiB); far less is plenty.
const MAX_MESSAGE: usize = 1024;

/// The field manager of the refusals of `driver`.
pub fn field_manager(driver: &str) -> String {
    format!("{driver}/binding-gate")
}

/// `reason` must be a condition reason (CamelCase); `now` an RFC 3339 time.
pub fn body(
    claim: &ResourceClaim,
    driver: &str,
    pools: &BTreeSet<String>,
    reason: &str,
    message: &str,
    now: &str,
) -> Value {
    let mut message = message.to_owned();
    if message.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    let devices: Vec<Value> = claim
        .status
        .iter()
        .flat_map(|s| s.allocation.iter())
        .flat_map(|a| a.devices.iter())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == driver && pools.contains(&r.pool))
        .map(|r| {
            let mut d = json!({
                "driver": r.driver,
                "pool": r.pool,
                "device": r.device,
                "conditions": [{
                    "type": REFUSED,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now,
                }],
            });
            if let (Some(id), Some(o)) = (&r.share_id, d.as_object_mut()) {
                o.insert("shareID".into(), Value::String(id.clone()));
            }
            d
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": claim.metadata.name,
            "namespace": claim.metadata.namespace,
            "uid": claim.metadata.uid,
        },
        "status": {"devices": devices},
    })
}

/// A condition reason from the agent's error code ("ResourceExhausted"), or
/// "Refused" where there is none that is one.
pub fn reason(code: Option<&str>) -> String {
    match code {
        Some(c)
            if !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_alphanumeric())
                && c.as_bytes()[0].is_ascii_uppercase() =>
        {
            c.to_owned()
        }
        _ => "Refused".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult,
        ResourceClaimStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    #[test]
    fn each_result_of_the_driver_here_is_refused_with_the_agents_words() {
        let r = |driver: &str, pool: &str, share: Option<&str>| DeviceRequestAllocationResult {
            driver: driver.into(),
            pool: pool.into(),
            device: "nic-0".into(),
            request: "net".into(),
            share_id: share.map(Into::into),
            ..Default::default()
        };
        let claim = ResourceClaim {
            metadata: ObjectMeta {
                name: Some("c".into()),
                namespace: Some("ns".into()),
                uid: Some("u".into()),
                ..Default::default()
            },
            status: Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(vec![
                            r("d", "node-a", Some("s1")),
                            r("d", "node-b", Some("s2")),
                            r("other", "node-a", Some("s3")),
                            r("d", "node-a", None),
                        ]),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let long = "é".repeat(2000);
        let v = body(
            &claim,
            "d",
            &BTreeSet::from(["node-a".to_owned()]),
            "ResourceExhausted",
            &long,
            "2026-12-05T00:00:00Z",
        );
        let devices = v["status"]["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2, "{v}");
        assert_eq!(devices[0]["shareID"], "s1");
        assert!(
            devices[1].get("shareID").is_none(),
            "a whole device has none"
        );
        let c = &devices[0]["conditions"][0];
        assert_eq!(
            (c["type"].as_str(), c["status"].as_str()),
            (Some(REFUSED), Some("True"))
        );
        assert_eq!(c["reason"], "ResourceExhausted");
        assert!(c["message"].as_str().unwrap().len() <= MAX_MESSAGE);
        assert_eq!(v["metadata"]["uid"], "u");
    }

    #[test]
    fn a_reason_is_camel_case_or_refused() {
        assert_eq!(reason(Some("ResourceExhausted")), "ResourceExhausted");
        for bad in [None, Some(""), Some("not ok"), Some("lower")] {
            assert_eq!(reason(bad), "Refused", "{bad:?}");
        }
    }
}
