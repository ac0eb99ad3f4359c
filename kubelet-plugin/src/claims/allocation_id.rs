//! An id for one allocation of a claim, the same every time the plugin derives it: the
//! agent tells a repeated Prepare of the same allocation (answered from its store) from a
//! re-allocation (a new claim object or new results) by it. Kubernetes has no such id,
//! so it is a digest of what identifies the allocation.

use k8s_openapi::api::resource::v1::DeviceRequestAllocationResult;
use sha2::{Digest, Sha256};

/// `sha256-` and 32 hex digits over the claim's uid and this driver's results. The
/// results' order in the claim does not change it.
pub fn allocation_id(claim_uid: &str, results: &[&DeviceRequestAllocationResult]) -> String {
    let mut lines: Vec<String> = results
        .iter()
        .map(|r| {
            let consumed: Vec<String> = r
                .consumed_capacity
                .iter()
                .flatten()
                .map(|(k, q)| format!("{k}={}", q.0))
                .collect();
            // NUL cannot occur in any of these fields (the API server validates them as
            // names), so the fields cannot run into each other.
            format!(
                "{}\0{}\0{}\0{}\0{}\0{}\0{}",
                r.request,
                r.driver,
                r.pool,
                r.device,
                r.share_id.as_deref().unwrap_or(""),
                r.admin_access.unwrap_or(false),
                consumed.join(",")
            )
        })
        .collect();
    lines.sort();
    let mut h = Sha256::new();
    h.update(claim_uid.as_bytes());
    for l in &lines {
        h.update(b"\n");
        h.update(l.as_bytes());
    }
    let digest = h.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256-{hex}")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    use super::*;

    fn result(device: &str, share: &str, bw: &str) -> DeviceRequestAllocationResult {
        DeviceRequestAllocationResult {
            request: "net".into(),
            driver: "net.example.com".into(),
            pool: "node-a".into(),
            device: device.into(),
            share_id: Some(share.into()),
            consumed_capacity: Some(BTreeMap::from([(
                "bandwidth".to_owned(),
                Quantity(bw.into()),
            )])),
            ..Default::default()
        }
    }

    #[test]
    fn same_allocation_same_id_in_any_order() {
        let a = result("eth0", "0b6a4c9e-1111-4c3e-9f00-000000000001", "200M");
        let b = result("eth1", "0b6a4c9e-1111-4c3e-9f00-000000000002", "100M");
        let id = allocation_id("uid-1", &[&a, &b]);
        assert_eq!(id, allocation_id("uid-1", &[&b, &a]));
        assert!(id.starts_with("sha256-") && id.len() == 7 + 32, "{id}");
    }

    #[test]
    fn any_change_of_the_allocation_changes_the_id() {
        let a = result("eth0", "0b6a4c9e-1111-4c3e-9f00-000000000001", "200M");
        let id = allocation_id("uid-1", &[&a]);
        // A new claim object with the same results.
        assert_ne!(id, allocation_id("uid-2", &[&a]));
        // Re-allocated: a new shareID, another amount, another device.
        let other_share = result("eth0", "0b6a4c9e-1111-4c3e-9f00-000000000009", "200M");
        assert_ne!(id, allocation_id("uid-1", &[&other_share]));
        let other_amount = result("eth0", "0b6a4c9e-1111-4c3e-9f00-000000000001", "300M");
        assert_ne!(id, allocation_id("uid-1", &[&other_amount]));
        let other_device = result("eth1", "0b6a4c9e-1111-4c3e-9f00-000000000001", "200M");
        assert_ne!(id, allocation_id("uid-1", &[&other_device]));
    }
}
