//! What the API server stored of a ResourceSlice against what the plugin applied, field
//! by field. An API server drops the fields of a feature whose gate is off as it stores
//! an object, without an error: with `DRAConsumableCapacity` off (alpha, off by default,
//! in 1.34 and 1.35) a slice loses `allowMultipleAllocations` and every capacity's
//! `requestPolicy`, and the scheduler then hands each device out whole, to one claim. The
//! apply still succeeds, so only a read-back shows it.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::resource::v1::{CapacityRequestPolicy, Device, DeviceCapacity, ResourceSliceSpec},
    apimachinery::pkg::api::resource::Quantity,
};

/// One field of one device that the API server did not keep as applied.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Difference {
    pub device: String,
    /// The field's path in the device, as in the API: `allowMultipleAllocations`,
    /// `capacity[bandwidth].requestPolicy`, `attributes[kind]`, ...
    pub field: String,
    /// What was applied and what is stored, for the log.
    pub applied: String,
    pub stored: String,
}

impl Difference {
    /// Whether the field belongs to DRA consumable capacity, which an API server with
    /// the `DRAConsumableCapacity` gate off drops.
    pub fn is_consumable_capacity(&self) -> bool {
        self.field == "allowMultipleAllocations" || self.field.contains(".requestPolicy")
    }

    /// Whether the field is one of the binding gate's, which an API server with the
    /// `DRADeviceBindingConditions` gate off drops.
    pub fn is_binding_condition(&self) -> bool {
        self.field.starts_with("binding")
    }
}

/// Every field of `applied`'s devices that `stored` lacks or holds otherwise. Quantities
/// are compared by value (the API server may write them in canonical form); what the
/// server adds (defaults, fields the plugin does not set) is not a difference.
pub fn differences(applied: &ResourceSliceSpec, stored: &ResourceSliceSpec) -> Vec<Difference> {
    let stored_devices: BTreeMap<&str, &Device> = stored
        .devices
        .iter()
        .flatten()
        .map(|d| (d.name.as_str(), d))
        .collect();
    let mut out = Vec::new();
    for a in applied.devices.iter().flatten() {
        let mut diff = |field: String, applied: String, stored: String| {
            out.push(Difference {
                device: a.name.clone(),
                field,
                applied,
                stored,
            });
        };
        let Some(s) = stored_devices.get(a.name.as_str()) else {
            diff("device".into(), a.name.clone(), "absent".into());
            continue;
        };
        if a.allow_multiple_allocations.unwrap_or(false)
            != s.allow_multiple_allocations.unwrap_or(false)
        {
            diff(
                "allowMultipleAllocations".into(),
                show(&a.allow_multiple_allocations),
                show(&s.allow_multiple_allocations),
            );
        }
        let none = BTreeMap::new();
        let stored_caps = s.capacity.as_ref().unwrap_or(&none);
        for (name, ac) in a.capacity.iter().flatten() {
            match stored_caps.get(name) {
                None => diff(
                    format!("capacity[{name}]"),
                    ac.value.0.clone(),
                    "absent".into(),
                ),
                Some(sc) => capacity(name, ac, sc, &mut diff),
            }
        }
        // Taints by key, value and effect: the API server stamps `timeAdded`, and drops
        // them all where the `DRADeviceTaints` gate is off (beta, on by default from
        // 1.36), which leaves a device that cannot hold its shares schedulable.
        let taints = |d: &Device| -> Vec<(String, String, String)> {
            d.taints
                .iter()
                .flatten()
                .map(|t| {
                    (
                        t.key.clone(),
                        t.value.clone().unwrap_or_default(),
                        t.effect.clone(),
                    )
                })
                .collect()
        };
        if taints(a) != taints(s) {
            diff("taints".into(), show(&taints(a)), show(&taints(s)));
        }
        // Dropped where `DRADeviceBindingConditions` is off (beta, on by default from
        // 1.36): the scheduler then binds without waiting for the node's admission.
        if a.binding_conditions != s.binding_conditions {
            diff(
                "bindingConditions".into(),
                show(&a.binding_conditions),
                show(&s.binding_conditions),
            );
        }
        if a.binding_failure_conditions != s.binding_failure_conditions {
            diff(
                "bindingFailureConditions".into(),
                show(&a.binding_failure_conditions),
                show(&s.binding_failure_conditions),
            );
        }
        let no_attrs = BTreeMap::new();
        let stored_attrs = s.attributes.as_ref().unwrap_or(&no_attrs);
        for (name, aa) in a.attributes.iter().flatten() {
            let sa = stored_attrs.get(name);
            if sa != Some(aa) {
                diff(format!("attributes[{name}]"), show(&Some(aa)), show(&sa));
            }
        }
    }
    out
}

fn capacity(
    name: &str,
    a: &DeviceCapacity,
    s: &DeviceCapacity,
    diff: &mut impl FnMut(String, String, String),
) {
    if !same_quantity(&a.value, &s.value) {
        diff(
            format!("capacity[{name}].value"),
            a.value.0.clone(),
            s.value.0.clone(),
        );
    }
    let field = format!("capacity[{name}].requestPolicy");
    match (&a.request_policy, &s.request_policy) {
        (None, _) => {}
        (Some(ap), None) => diff(field, show(&Some(ap)), "absent".into()),
        (Some(ap), Some(sp)) => policy(&field, ap, sp, diff),
    }
}

fn policy(
    field: &str,
    a: &CapacityRequestPolicy,
    s: &CapacityRequestPolicy,
    diff: &mut impl FnMut(String, String, String),
) {
    let mut opt = |what: &str, a: &Option<Quantity>, s: &Option<Quantity>| {
        let same = match (a, s) {
            (None, _) => true,
            (Some(a), Some(s)) => same_quantity(a, s),
            (Some(_), None) => false,
        };
        if !same {
            diff(format!("{field}.{what}"), show(a), show(s));
        }
    };
    opt("default", &a.default, &s.default);
    match (&a.valid_range, &s.valid_range) {
        (None, _) => {}
        (Some(ar), None) => opt("validRange", &Some(ar.min.clone()), &None),
        (Some(ar), Some(sr)) => {
            opt(
                "validRange.min",
                &Some(ar.min.clone()),
                &Some(sr.min.clone()),
            );
            opt("validRange.max", &ar.max, &sr.max);
            opt("validRange.step", &ar.step, &sr.step);
        }
    }
    if let Some(av) = &a.valid_values {
        let sv = s.valid_values.as_deref().unwrap_or_default();
        let same = av.len() == sv.len() && av.iter().zip(sv).all(|(a, s)| same_quantity(a, s));
        if !same {
            diff(format!("{field}.validValues"), show(av), show(&sv));
        }
    }
}

/// By value where both parse ("1000M" is "1G"), else as text.
fn same_quantity(a: &Quantity, s: &Quantity) -> bool {
    match (
        shareguard_common::Quantity::parse(&a.0),
        shareguard_common::Quantity::parse(&s.0),
    ) {
        (Ok(a), Ok(s)) => a == s,
        _ => a.0 == s.0,
    }
}

fn show<T: serde::Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("<{e}>"))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{
        CapacityRequestPolicyRange, DeviceAttribute, ResourcePool,
    };

    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity(s.into())
    }

    fn spec() -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: "d.example.com".into(),
            pool: ResourcePool {
                name: "p".into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(vec![Device {
                name: "nic-0".into(),
                allow_multiple_allocations: Some(true),
                attributes: Some(BTreeMap::from([(
                    "kind".to_owned(),
                    DeviceAttribute {
                        string: Some("net".into()),
                        ..Default::default()
                    },
                )])),
                capacity: Some(BTreeMap::from([(
                    "bandwidth".to_owned(),
                    DeviceCapacity {
                        value: q("10G"),
                        request_policy: Some(CapacityRequestPolicy {
                            default: Some(q("100M")),
                            valid_range: Some(CapacityRequestPolicyRange {
                                min: q("100M"),
                                max: Some(q("10G")),
                                step: Some(q("100M")),
                            }),
                            valid_values: None,
                        }),
                    },
                )])),
                ..Default::default()
            }]),
            ..Default::default()
        }
    }

    fn device(s: &mut ResourceSliceSpec) -> &mut Device {
        &mut s.devices.as_mut().unwrap()[0]
    }

    #[test]
    fn a_slice_stored_as_applied_has_no_difference_even_with_canonical_quantities() {
        let applied = spec();
        let mut stored = spec();
        let cap = device(&mut stored)
            .capacity
            .as_mut()
            .unwrap()
            .get_mut("bandwidth")
            .unwrap();
        cap.value = q("10000M");
        // The server may add what the plugin does not set.
        device(&mut stored).binds_to_node = Some(false);
        assert_eq!(differences(&applied, &stored), []);
    }

    #[test]
    fn an_api_server_without_consumable_capacity_is_caught() {
        let applied = spec();
        let mut stored = spec();
        let d = device(&mut stored);
        d.allow_multiple_allocations = None;
        for c in d.capacity.as_mut().unwrap().values_mut() {
            c.request_policy = None;
        }
        let got = differences(&applied, &stored);
        let fields: Vec<&str> = got.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "allowMultipleAllocations",
                "capacity[bandwidth].requestPolicy"
            ]
        );
        assert!(got.iter().all(Difference::is_consumable_capacity));
        assert!(got.iter().all(|d| d.device == "nic-0"));
        assert_eq!(got[0].applied, "true");
        assert_eq!(got[0].stored, "null");
    }

    /// An API server with `DRADeviceTaints` off drops the taints: said, since the
    /// device then stays schedulable while it cannot hold its shares.
    #[test]
    fn dropped_taints_are_a_difference_and_a_stamped_time_is_not() {
        let mut applied = spec();
        device(&mut applied).taints = Some(vec![k8s_openapi::api::resource::v1::DeviceTaint {
            key: "d/unhealthy".into(),
            value: Some("link-down".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
        let mut stamped = applied.clone();
        device(&mut stamped).taints.as_mut().unwrap()[0].time_added =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        assert_eq!(differences(&applied, &stamped), vec![]);
        let dropped = spec();
        let d = differences(&applied, &dropped);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].field, "taints");
        assert!(!d[0].is_consumable_capacity());
    }

    /// An API server with `DRADeviceBindingConditions` off drops the binding
    /// conditions: said, since pods then bind before the node admitted their shares.
    #[test]
    fn dropped_binding_conditions_are_a_difference() {
        let mut applied = spec();
        device(&mut applied).binding_conditions = Some(vec!["Admitted".into()]);
        device(&mut applied).binding_failure_conditions = Some(vec!["AdmissionRefused".into()]);
        assert_eq!(differences(&applied, &applied.clone()), vec![]);
        let d = differences(&applied, &spec());
        let fields: Vec<&str> = d.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, ["bindingConditions", "bindingFailureConditions"]);
        assert!(d.iter().all(Difference::is_binding_condition));
    }

    #[test]
    fn changed_capacities_policies_and_attributes_are_named() {
        let applied = spec();
        let mut stored = spec();
        let d = device(&mut stored);
        d.attributes = None;
        let cap = d.capacity.as_mut().unwrap().get_mut("bandwidth").unwrap();
        cap.value = q("1G");
        cap.request_policy
            .as_mut()
            .unwrap()
            .valid_range
            .as_mut()
            .unwrap()
            .step = None;
        let fields: Vec<String> = differences(&applied, &stored)
            .into_iter()
            .map(|d| d.field)
            .collect();
        assert_eq!(
            fields,
            [
                "capacity[bandwidth].value",
                "capacity[bandwidth].requestPolicy.validRange.step",
                "attributes[kind]"
            ]
        );
        let mut gone = spec();
        gone.devices = Some(vec![]);
        assert_eq!(differences(&applied, &gone)[0].field, "device");
    }
}
