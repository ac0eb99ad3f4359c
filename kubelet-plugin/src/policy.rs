//! The request-policy snapshot a share is checked against, and its version.
//!
//! The scheduler rounds and checks a share's amount against the `requestPolicy` of the
//! device's capacity in the ResourceSlice this plugin published from the agent's
//! inventory. The agent checks the amount against that snapshot as well as its own
//! config, so that a scheduler that worked from a stale slice is caught. The version
//! names the snapshot's content: a digest of the pool's policies, so it is the same for
//! the same policies however often the plugin restarts or republishes.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};
use shareguard_proto::v1 as pb;

use crate::inventory::DriverDevices;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySnapshot {
    /// Pool -> version of its devices' request policies.
    versions: BTreeMap<String, String>,
}

impl PolicySnapshot {
    pub fn of(devices: &DriverDevices) -> Self {
        let versions = devices
            .pools()
            .into_iter()
            .map(|(pool, devs)| {
                let mut h = Sha256::new();
                for d in devs {
                    // BTreeMap: the capacities in name order, whatever the agent's order.
                    let policies: BTreeMap<&String, &pb::CapacityPolicy> =
                        d.policy.iter().collect();
                    for (cap, p) in policies {
                        h.update(policy_line(&d.name, cap, p).as_bytes());
                    }
                }
                let digest = h.finalize();
                let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
                (pool.to_owned(), format!("policy-{hex}"))
            })
            .collect();
        Self { versions }
    }

    pub fn version(&self, pool: &str) -> Option<&str> {
        self.versions.get(pool).map(String::as_str)
    }
}

fn policy_line(device: &str, capacity: &str, p: &pb::CapacityPolicy) -> String {
    let range = p
        .valid_range
        .as_ref()
        .map(|r| format!("{}..{}/{}", r.min, r.max, r.step))
        .unwrap_or_default();
    format!(
        "{device}\0{capacity}\0{}\0{}\0{range}\n",
        p.default,
        p.valid_values.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Inventory;

    fn inventory(step: &str) -> DriverDevices {
        let dev = pb::DeviceStatus {
            name: "eth0".into(),
            driver: "net.example.com".into(),
            pool: "node-a".into(),
            policy: [(
                "bandwidth".to_owned(),
                pb::CapacityPolicy {
                    default: "100M".into(),
                    valid_values: vec![],
                    valid_range: Some(pb::ValidRange {
                        min: "10M".into(),
                        max: "1G".into(),
                        step: step.into(),
                    }),
                },
            )]
            .into(),
            ..Default::default()
        };
        let inv = Inventory::from_agent(&pb::ListDevicesResponse {
            devices: vec![dev],
            epoch: 0,
        });
        inv.drivers["net.example.com"].clone()
    }

    #[test]
    fn the_version_follows_the_policies_and_nothing_else() {
        let a = PolicySnapshot::of(&inventory("10M"));
        let again = PolicySnapshot::of(&inventory("10M"));
        let changed = PolicySnapshot::of(&inventory("5M"));
        let v = a.version("node-a").unwrap();
        assert!(v.starts_with("policy-"), "{v}");
        assert_eq!(Some(v), again.version("node-a"));
        assert_ne!(Some(v), changed.version("node-a"));
        assert_eq!(a.version("other-pool"), None);
    }
}
