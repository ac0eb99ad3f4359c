//! Incoming protobuf into the engine's request types ([`crate::request`]), field for
//! field: nothing is checked or dropped here, so the engine sees what the caller sent
//! and its errors name the caller's fields.

use shareguard_proto::v1 as pb;

use crate::request;

impl From<pb::ClaimRef> for request::ClaimRef {
    fn from(c: pb::ClaimRef) -> Self {
        request::ClaimRef {
            uid: c.uid,
            namespace: c.namespace,
            name: c.name,
        }
    }
}

impl From<pb::PodTarget> for request::PodTarget {
    fn from(t: pb::PodTarget) -> Self {
        request::PodTarget {
            pod_uids: t.pod_uids,
            cgroup_paths: t.cgroup_paths,
            netns_path: t.netns_path,
            interface: t.interface,
        }
    }
}

impl From<pb::CapacityPolicy> for request::CapacityPolicy {
    fn from(p: pb::CapacityPolicy) -> Self {
        request::CapacityPolicy {
            default: p.default,
            valid_values: p.valid_values,
            valid_range: p.valid_range.map(|r| request::ValidRange {
                min: r.min,
                max: r.max,
                step: r.step,
            }),
        }
    }
}

impl From<request::CapacityPolicy> for pb::CapacityPolicy {
    fn from(p: request::CapacityPolicy) -> Self {
        pb::CapacityPolicy {
            default: p.default,
            valid_values: p.valid_values,
            valid_range: p.valid_range.map(|r| pb::ValidRange {
                min: r.min,
                max: r.max,
                step: r.step,
            }),
        }
    }
}

impl From<pb::DeviceAllocation> for request::DeviceAllocation {
    fn from(a: pb::DeviceAllocation) -> Self {
        request::DeviceAllocation {
            request: a.request,
            driver: a.driver,
            pool: a.pool,
            device: a.device,
            share_id: a.share_id,
            consumed_capacity: a.consumed_capacity,
            policy: a.policy.into_iter().map(|(k, v)| (k, v.into())).collect(),
            policy_version: a.policy_version,
            admin_access: a.admin_access,
        }
    }
}

impl From<pb::ClaimPrepare> for request::ClaimPrepare {
    fn from(c: pb::ClaimPrepare) -> Self {
        request::ClaimPrepare {
            claim: c.claim.map(Into::into),
            allocation_id: c.allocation_id,
            target: c.target.map(Into::into),
            allocations: c.allocations.into_iter().map(Into::into).collect(),
            pre_bind: c.pre_bind,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field arrives: a field the translation forgot would read as unset, and the
    /// engine would refuse or misread the claim.
    #[test]
    fn a_claim_arrives_whole() {
        let claim = pb::ClaimPrepare {
            claim: Some(pb::ClaimRef {
                uid: "u".into(),
                namespace: "ns".into(),
                name: "n".into(),
            }),
            allocation_id: "a1".into(),
            target: Some(pb::PodTarget {
                pod_uids: vec!["p".into()],
                cgroup_paths: vec!["/c".into()],
                netns_path: "/run/netns/x".into(),
                interface: "eth1".into(),
            }),
            allocations: vec![pb::DeviceAllocation {
                request: "r".into(),
                driver: "d".into(),
                pool: "pool".into(),
                device: "dev".into(),
                share_id: "s".into(),
                consumed_capacity: [("memory".to_owned(), "1Gi".to_owned())].into(),
                policy: [(
                    "memory".to_owned(),
                    pb::CapacityPolicy {
                        default: "1Gi".into(),
                        valid_values: vec!["2Gi".into()],
                        valid_range: Some(pb::ValidRange {
                            min: "1".into(),
                            max: "2".into(),
                            step: "3".into(),
                        }),
                    },
                )]
                .into(),
                policy_version: "v7".into(),
                admin_access: true,
            }],
            pre_bind: true,
        };
        let got = request::ClaimPrepare::from(claim.clone());
        let c = got.claim.as_ref().unwrap();
        assert_eq!(
            (c.uid.as_str(), c.namespace.as_str(), c.name.as_str()),
            ("u", "ns", "n")
        );
        assert_eq!(got.allocation_id, "a1");
        assert!(got.pre_bind);
        let t = got.target.as_ref().unwrap();
        assert_eq!(t.pod_uids, ["p"]);
        assert_eq!(t.cgroup_paths, ["/c"]);
        assert_eq!(
            (t.netns_path.as_str(), t.interface.as_str()),
            ("/run/netns/x", "eth1")
        );
        let a = &got.allocations[0];
        assert_eq!(
            (
                a.request.as_str(),
                a.driver.as_str(),
                a.pool.as_str(),
                a.device.as_str()
            ),
            ("r", "d", "pool", "dev")
        );
        assert_eq!(
            (a.share_id.as_str(), a.policy_version.as_str()),
            ("s", "v7")
        );
        assert!(a.admin_access);
        assert_eq!(a.consumed_capacity["memory"], "1Gi");
        // The policy goes out again as it came in.
        let back: pb::CapacityPolicy = a.policy["memory"].clone().into();
        assert_eq!(back, claim.allocations[0].policy["memory"]);
    }
}
