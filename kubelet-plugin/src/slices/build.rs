//! The ResourceSlices that publish one driver's devices on this node: one slice per
//! pool, each the whole pool (`resourceSliceCount: 1`).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::resource::v1::{
        CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
        DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{ObjectMeta, OwnerReference},
    },
};
use sha2::{Digest, Sha256};
use shareguard_proto::v1 as pb;

use crate::inventory::DriverDevices;

/// The node the slices belong to: they name it and are owned by it, so that they go
/// with the Node object.
#[derive(Clone, Debug)]
pub struct NodeRef {
    pub name: String,
    pub uid: String,
}

/// One pool's slice as it should be, before its generation is known.
#[derive(Clone, Debug)]
pub struct Desired {
    pub pool: String,
    /// The slice with `pool.generation` 0; the publisher sets it.
    pub slice: ResourceSlice,
    /// A digest of everything published, kept in an annotation: the API server may
    /// rewrite quantities in canonical form, so the slice it returns is not compared
    /// field by field.
    pub digest: String,
}

/// A device that cannot be published, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub device: String,
    pub reason: String,
}

/// The annotation holding [`Desired::digest`].
pub fn digest_annotation(driver: &str) -> String {
    format!("{driver}/spec-digest")
}

use shareguard_common::slice::{
    DEVICE_ATTRIBUTES, MAX_STRING_ATTRIBUTE, is_dns_label, is_label_value,
};

/// `gated`: each device carries the binding gate's conditions (`crate::binding`).
pub fn desired(
    driver: &str,
    node: &NodeRef,
    devices: &DriverDevices,
    gated: bool,
) -> (Vec<Desired>, Vec<Skipped>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for (pool, devs) in devices.pools() {
        let mut api_devices = Vec::new();
        for d in devs {
            match device(driver, d, gated) {
                Ok(dev) => api_devices.push(dev),
                Err(reason) => skipped.push(Skipped {
                    device: d.name.clone(),
                    reason,
                }),
            }
        }
        let spec = ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.name.clone()),
            pool: ResourcePool {
                name: pool.to_owned(),
                generation: 0,
                resource_slice_count: 1,
            },
            devices: Some(api_devices),
            ..Default::default()
        };
        let digest = {
            // serde_json of k8s-openapi types: fields in a fixed order, maps sorted.
            let text = serde_json::to_string(&spec).unwrap_or_default();
            let d = Sha256::digest(text.as_bytes());
            d[..12]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                // Given by the publisher, from the slices it finds (`super::names`).
                name: None,
                annotations: Some(BTreeMap::from([(
                    digest_annotation(driver),
                    digest.clone(),
                )])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: node.name.clone(),
                    uid: node.uid.clone(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            spec,
        };
        out.push(Desired {
            pool: pool.to_owned(),
            slice,
            digest,
        });
    }
    (out, skipped)
}

/// The taint key of a device that cannot hold its shares now, under the driver's name.
pub fn unhealthy_taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// What a device that cannot hold its shares now carries (the agent's `fault_reason` as
/// the value): NoSchedule, so that the scheduler gives it no new claim that does not
/// tolerate it and leaves the pods that run there alone; gone once the fault is.
fn taint(driver: &str, d: &pb::DeviceStatus) -> Option<DeviceTaint> {
    if d.fault.is_empty() && d.fault_reason.is_empty() {
        return None;
    }
    // The value must be a label value. The agent's codes are; anything else becomes
    // "fault".
    let r = &d.fault_reason;
    Some(DeviceTaint {
        key: unhealthy_taint_key(driver),
        value: Some(if is_label_value(r) {
            r.clone()
        } else {
            "fault".into()
        }),
        effect: "NoSchedule".into(),
        time_added: None,
    })
}

fn device(driver: &str, d: &pb::DeviceStatus, gated: bool) -> Result<Device, String> {
    if !is_dns_label(&d.name) {
        return Err(format!(
            "name {:?} is not a DNS label (at most 63 of a-z, 0-9 and '-'), which a ResourceSlice device name must be",
            d.name
        ));
    }
    let mut capacity = BTreeMap::new();
    for (name, value) in &d.capacity {
        // A size the agent could not learn (a GPU whose NVML is missing reports 0) is
        // no device to share, and the API server refuses a request policy above the
        // capacity, which would refuse the pool's whole slice and hide every other
        // device of the pool with it (seen on the test cluster: a GPU without NVML kept
        // the NIC beside it from being published).
        let known = shareguard_common::Quantity::parse(value).is_ok_and(|q| !q.is_zero());
        if !known {
            return Err(format!(
                "capacity {name} is {value:?}, not a size (mechanism {:?}): nothing to share",
                d.mechanism
            ));
        }
        let policy = d.policy.get(name).map(request_policy);
        capacity.insert(
            name.clone(),
            DeviceCapacity {
                value: Quantity(value.clone()),
                request_policy: policy,
            },
        );
    }
    let [kind, mechanism, enforced, stage] = DEVICE_ATTRIBUTES;
    let mut attributes = BTreeMap::from([
        (kind.to_owned(), string_attr(&d.kind)),
        (mechanism.to_owned(), string_attr(&d.mechanism)),
        (
            enforced.to_owned(),
            DeviceAttribute {
                bool: Some(d.enforces),
                ..Default::default()
            },
        ),
    ]);
    // An agent from before rollout stages says none: its devices enforce.
    let stage_name = if d.stage.is_empty() {
        "enforce"
    } else {
        &d.stage
    };
    attributes.insert(stage.to_owned(), string_attr(stage_name));
    for (k, v) in &d.attributes {
        attributes.insert(k.clone(), string_attr(v));
    }
    for (k, v) in &d.int_attributes {
        attributes.insert(
            k.clone(),
            DeviceAttribute {
                int: Some(*v),
                ..Default::default()
            },
        );
    }
    Ok(Device {
        name: d.name.clone(),
        // Shares: the scheduler may hand out parts of it to many claims.
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(capacity),
        taints: taint(driver, d).map(|t| vec![t]),
        binding_conditions: gated.then(|| vec![crate::binding::ADMITTED.to_owned()]),
        binding_failure_conditions: gated.then(|| vec![crate::binding::REFUSED.to_owned()]),
        ..Default::default()
    })
}

fn request_policy(p: &pb::CapacityPolicy) -> CapacityRequestPolicy {
    let q = |s: &str| (!s.is_empty()).then(|| Quantity(s.to_owned()));
    CapacityRequestPolicy {
        default: q(&p.default),
        valid_values: (!p.valid_values.is_empty())
            .then(|| p.valid_values.iter().map(|v| Quantity(v.clone())).collect()),
        valid_range: p.valid_range.as_ref().map(|r| CapacityRequestPolicyRange {
            min: Quantity(r.min.clone()),
            max: q(&r.max),
            step: q(&r.step),
        }),
    }
}

fn string_attr(v: &str) -> DeviceAttribute {
    let mut s = v.to_owned();
    if s.len() > MAX_STRING_ATTRIBUTE {
        let mut end = MAX_STRING_ATTRIBUTE;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
    DeviceAttribute {
        string: Some(s),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::Inventory;

    fn inventory(names: &[&str]) -> DriverDevices {
        let devices = names
            .iter()
            .map(|n| pb::DeviceStatus {
                name: (*n).into(),
                driver: "d.example.com".into(),
                pool: "p".into(),
                kind: "gpu".into(),
                capacity: [("memory".to_owned(), "80Gi".to_owned())].into(),
                mechanism: "nvml-cgroup".into(),
                enforces: true,
                attributes: [("model".to_owned(), "x".repeat(100))].into(),
                int_attributes: [("numaNode".to_owned(), 1)].into(),
                ..Default::default()
            })
            .collect();
        Inventory::from_agent(&pb::ListDevicesResponse { devices, epoch: 0 }).drivers
            ["d.example.com"]
            .clone()
    }

    fn node() -> NodeRef {
        NodeRef {
            name: "n1".into(),
            uid: "u".into(),
        }
    }

    #[test]
    fn devices_are_shareable_with_their_facts_and_bad_names_are_skipped() {
        let (desired, skipped) = desired(
            "d.example.com",
            &node(),
            &inventory(&["gpu-0", "GPU_1"]),
            false,
        );
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].device, "GPU_1");
        let devs = desired[0].slice.spec.devices.as_ref().unwrap();
        assert_eq!(devs.len(), 1);
        let attrs = devs[0].attributes.as_ref().unwrap();
        assert_eq!(attrs["enforced"].bool, Some(true));
        assert_eq!(attrs["mechanism"].string.as_deref(), Some("nvml-cgroup"));
        // An agent that names no stage is one from before stages: its devices enforce.
        assert_eq!(attrs["stage"].string.as_deref(), Some("enforce"));
        assert_eq!(
            attrs["model"].string.as_ref().unwrap().len(),
            64,
            "cut to the API's bound"
        );
        assert_eq!(devs[0].allow_multiple_allocations, Some(true));
        // Whole numbers as int attributes, which selectors compare as numbers.
        assert_eq!(attrs["numaNode"].int, Some(1));
        assert_eq!(attrs["numaNode"].string, None);
    }

    #[test]
    fn a_device_that_cannot_hold_its_shares_is_tainted_no_schedule_until_it_can() {
        let mut devices = inventory(&["gpu-0", "gpu-1"]);
        let faults = [
            ("gpu-0", "gpu-not-answering", "gpu-not-answering"),
            // Not a label value: the taint still goes on, with a value the API takes.
            ("gpu-1", "not a label!", "fault"),
        ];
        for (name, reason, _) in faults {
            let d = devices
                .devices
                .get_mut(&("p".to_owned(), name.to_owned()))
                .unwrap();
            d.fault = "GPU x does not answer the driver".into();
            d.fault_reason = reason.into();
        }
        let (tainted, _) = desired("d.example.com", &node(), &devices, false);
        let devs = tainted[0].slice.spec.devices.as_ref().unwrap();
        for (d, (name, _, value)) in devs.iter().zip(faults) {
            assert_eq!(d.name, name);
            let t = d.taints.as_ref().unwrap();
            assert_eq!(t.len(), 1, "{t:?}");
            assert_eq!(t[0].key, "d.example.com/unhealthy");
            assert_eq!(t[0].value.as_deref(), Some(value));
            assert_eq!(t[0].effect, "NoSchedule", "never evicts a running pod");
            assert_eq!(t[0].time_added, None, "the API server stamps it");
        }
        // The fault gone: no taint, and a digest of its own, so the slice is applied.
        let (healthy, _) = desired(
            "d.example.com",
            &node(),
            &inventory(&["gpu-0", "gpu-1"]),
            false,
        );
        let devs = healthy[0].slice.spec.devices.as_ref().unwrap();
        assert!(devs.iter().all(|d| d.taints.is_none()), "{devs:?}");
        assert_ne!(healthy[0].digest, tainted[0].digest);
    }

    /// With the binding gate on, every device makes the scheduler wait for the node's
    /// admission, and a refusal sends the pod back; off, none does.
    #[test]
    fn a_gated_device_carries_the_gates_binding_conditions() {
        let devices = inventory(&["gpu-0", "gpu-1"]);
        let (gated, _) = desired("d.example.com", &node(), &devices, true);
        for d in gated[0].slice.spec.devices.as_ref().unwrap() {
            assert_eq!(
                d.binding_conditions.as_deref(),
                Some(&[crate::binding::ADMITTED.to_owned()][..])
            );
            assert_eq!(
                d.binding_failure_conditions.as_deref(),
                Some(&[crate::binding::REFUSED.to_owned()][..])
            );
        }
        let (plain, _) = desired("d.example.com", &node(), &devices, false);
        let devs = plain[0].slice.spec.devices.as_ref().unwrap();
        assert!(
            devs.iter().all(|d| d.binding_conditions.is_none()),
            "{devs:?}"
        );
        assert_ne!(plain[0].digest, gated[0].digest);
    }

    /// The plugin reads the inventory every few seconds and passes (a LIST, maybe an
    /// apply) only when a digest changed: what a Prepare changes must not change one.
    #[test]
    fn allocations_leave_the_digest_as_it_is() {
        let idle = inventory(&["gpu-0"]);
        let mut busy = idle.clone();
        for d in busy.devices.values_mut() {
            d.allocated = [("memory".to_owned(), "40Gi".to_owned())].into();
            d.free = [("memory".to_owned(), "40Gi".to_owned())].into();
            d.live_shares = 3;
        }
        let digest = |d: &DriverDevices| {
            desired("d.example.com", &node(), d, false).0[0]
                .digest
                .clone()
        };
        assert_eq!(digest(&idle), digest(&busy));
    }

    #[test]
    fn a_device_says_its_rollout_stage() {
        let mut devices = inventory(&["gpu-0"]);
        for d in devices.devices.values_mut() {
            d.stage = "observe".into();
        }
        let (desired, _) = desired("d.example.com", &node(), &devices, false);
        let devs = desired[0].slice.spec.devices.as_ref().unwrap();
        let attrs = devs[0].attributes.as_ref().unwrap();
        assert_eq!(attrs["stage"].string.as_deref(), Some("observe"));
        // What the mechanism can hold stays as it is: a rollback leaves the device in
        // the classes that ask for an enforcing mechanism.
        assert_eq!(attrs["enforced"].bool, Some(true));
    }

    #[test]
    fn a_device_of_unknown_size_is_skipped_and_the_rest_of_its_pool_published() {
        let mut devices = inventory(&["gpu-0", "gpu-1"]);
        for ((_, name), d) in &mut devices.devices {
            if name == "gpu-1" {
                d.capacity.insert("memory".into(), "0".into());
                d.mechanism = "unavailable".into();
            }
        }
        let (desired, skipped) = desired("d.example.com", &node(), &devices, false);
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert_eq!(skipped[0].device, "gpu-1");
        assert!(
            skipped[0].reason.contains("memory"),
            "{}",
            skipped[0].reason
        );
        let devs = desired[0].slice.spec.devices.as_ref().unwrap();
        assert_eq!(devs.len(), 1);
        assert_eq!(devs[0].name, "gpu-0");
    }

    #[test]
    fn the_digest_follows_the_content() {
        let d = |names: &[&str]| {
            desired("d.example.com", &node(), &inventory(names), false).0[0]
                .digest
                .clone()
        };
        assert_eq!(d(&["gpu-0"]), d(&["gpu-0"]));
        assert_ne!(d(&["gpu-0"]), d(&["gpu-0", "gpu-1"]));
    }
}
