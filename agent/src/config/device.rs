//! `[[device]]`: the node's inventory, each device checked on its own and against the
//! others (names, pools, the hardware it stands for), its capacities and policies.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use shareguard_common::{
    Quantity, slice,
    slice::{is_dns_label, is_driver_name, is_namespace, is_pool_name, is_qualified_name},
};
use shareguard_limiter_gpu::limiter::MEMORY;
use shareguard_limiter_net::{Mechanism, link, setup::NetConfig};
use toml::Spanned;

use super::{
    CapacityConfig, ConfigError, DeviceConfig, DeviceKind, check_class_name, default_class,
    gpu::RawGpu, node::NodeName, raw::RawDevice, slo::ErrAt,
};
use crate::{policy::Policy, rollout::Stage};

/// Every `[[device]]`, in the file's order.
pub(super) fn parse(
    raw: Vec<Spanned<RawDevice>>,
    node_name: &NodeName,
    class_stages: &BTreeMap<String, Stage>,
    err: ErrAt<'_>,
) -> Result<Vec<DeviceConfig>, ConfigError> {
    let mut devices = Vec::with_capacity(raw.len());
    // What each device stands for: two devices for one GPU or one NIC would hand out
    // its capacity twice.
    let mut hardware: BTreeMap<String, String> = BTreeMap::new();
    let mut names = BTreeSet::new();
    let mut ids = BTreeSet::new();
    let mut pool_sizes: BTreeMap<(String, String), usize> = BTreeMap::new();
    for d in raw {
        let dspan = d.span();
        let d = d.into_inner();
        let name = d.name.get_ref().clone();
        if !is_dns_label(&name) {
            return Err(err(
                d.name.span(),
                format!(
                    "device.name: {name:?} is not a DNS label (lowercase letters, digits, '-', at most 63)"
                ),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(err(
                d.name.span(),
                format!("device.name: {name:?} is defined twice"),
            ));
        }
        if !is_driver_name(d.driver.get_ref()) {
            return Err(err(
                d.driver.span(),
                format!(
                    "device {name}: driver {:?} is not a DNS subdomain of at most 63 characters",
                    d.driver.get_ref()
                ),
            ));
        }
        let pool = match &d.pool {
            Some(p) if !is_pool_name(p.get_ref()) => {
                return Err(err(
                    p.span(),
                    format!(
                        "device {name}: pool {:?} is not a valid pool name: one or more DNS subdomains joined by '/', at most 253 characters",
                        p.get_ref()
                    ),
                ));
            }
            Some(p) => p.get_ref().clone(),
            // Node names are DNS subdomains, so a valid one is a valid pool name.
            None => node_name
                .need()
                .map_err(|why| {
                    err(
                        d.name.span(),
                        format!(
                            "device {name}: sets no pool, so its pool is the node's name, and {why}"
                        ),
                    )
                })?
                .to_owned(),
        };
        if !ids.insert((d.driver.get_ref().clone(), pool.clone(), name.clone())) {
            return Err(err(
                dspan.clone(),
                format!("device {name}: driver/pool/name is not unique"),
            ));
        }
        // The plugin publishes a pool as one ResourceSlice.
        let in_pool = pool_sizes
            .entry((d.driver.get_ref().clone(), pool.clone()))
            .or_insert(0usize);
        *in_pool += 1;
        if *in_pool > slice::MAX_DEVICES_PER_SLICE {
            return Err(err(
                dspan.clone(),
                format!(
                    "device {name}: pool {pool:?} of driver {:?} has more than {} devices, which resource.k8s.io takes in one ResourceSlice",
                    d.driver.get_ref(),
                    slice::MAX_DEVICES_PER_SLICE
                ),
            ));
        }
        let kind = match d.kind.get_ref().as_str() {
            "generic" => DeviceKind::Generic,
            // Refused until their limiters exist: an agent that accepted them would
            // report bandwidth or GPU shares it cannot enforce.
            "net" => DeviceKind::Net,
            "gpu" => DeviceKind::Gpu,
            other => {
                return Err(err(
                    d.kind.span(),
                    format!("device {name}: kind {other:?} is not one of generic, net, gpu"),
                ));
            }
        };
        let mut d = d;
        if kind == DeviceKind::Net
            && let Some(nic) = &d.interface
            && nic.get_ref() == link::AUTO
        {
            // Found once, when the config is read, so that everything after (the link
            // speed, the hardware check, the limiter) sees a name. A node without a
            // default route stops the agent here rather than publish a NIC it guessed.
            let found = link::default_route_interface(Path::new("/proc/net")).map_err(|why| {
                err(
                    nic.span(),
                    format!(
                        "device {name}: interface \"auto\" is the NIC of the node's default route, and {why}; name the interface (in a [[node]] table for this node)"
                    ),
                )
            })?;
            d.interface = Some(Spanned::new(nic.span(), found));
        }
        let mut allowed = Vec::new();
        for ns in d.allowed_namespaces {
            if ns.get_ref() != "*" && !is_namespace(ns.get_ref()) {
                return Err(err(
                    ns.span(),
                    format!(
                        "device {name}: allowed_namespaces: {:?} is not a namespace name or \"*\"",
                        ns.get_ref()
                    ),
                ));
            }
            allowed.push(ns.into_inner());
        }
        let mut admin = Vec::new();
        for ns in d.admin_namespaces {
            if !is_namespace(ns.get_ref()) {
                return Err(err(
                    ns.span(),
                    format!(
                        "device {name}: admin_namespaces: {:?} is not a namespace name",
                        ns.get_ref()
                    ),
                ));
            }
            admin.push(ns.into_inner());
        }
        if d.capacity.is_empty() {
            return Err(err(
                dspan,
                format!(
                    "device {name}: no [device.capacity.<name>] table: a device needs at least one capacity"
                ),
            ));
        }
        // The plugin publishes the capacities beside its attributes, and the API
        // server takes at most 32 of both together per device.
        let attributes = slice::attributes_for(kind.as_str());
        if d.capacity.len() + attributes > slice::MAX_ATTRIBUTES_AND_CAPACITIES {
            return Err(err(
                dspan,
                format!(
                    "device {name}: {} capacities, at most {} for a {} device (resource.k8s.io takes {} attributes and capacities per device, and its ResourceSlice entry has {attributes} attributes)",
                    d.capacity.len(),
                    slice::MAX_ATTRIBUTES_AND_CAPACITIES - attributes,
                    kind.as_str(),
                    slice::MAX_ATTRIBUTES_AND_CAPACITIES,
                ),
            ));
        }
        let raw_gpu = RawGpu {
            backend: &d.backend,
            uuid: &d.uuid,
            index: &d.index,
            gpus: &d.gpus,
            watchdog: &d.watchdog,
            simulated: &d.simulated,
            driver_root: &d.driver_root,
            container_driver_root: &d.container_driver_root,
        };
        let (gpu, gpu_memory) = if kind == DeviceKind::Gpu {
            let memory_given = d
                .capacity
                .iter()
                .any(|(k, c)| k.get_ref() == MEMORY && c.get_ref().value.is_some());
            let (g, q) = raw_gpu
                .parse(&name, &dspan, memory_given)
                .map_err(|(span, m)| err(span, m))?;
            (Some(g), q)
        } else {
            if let Some((span, field)) = raw_gpu.first_present() {
                return Err(err(
                    span,
                    format!("device {name}: {field} is only for kind \"gpu\""),
                ));
            }
            (None, None)
        };
        let discover_memory = gpu.as_ref().is_some_and(|g| g.discover_memory);
        let mut capacities = BTreeMap::new();
        for (cname, cap) in d.capacity {
            let cspan = cap.span();
            let cap = cap.into_inner();
            let cname_s = cname.get_ref().clone();
            if !is_qualified_name(&cname_s) {
                return Err(err(
                    cname.span(),
                    format!(
                        "device {name}: capacity name {cname_s:?} is not a resource.k8s.io qualified name: a C identifier (letters, digits, '_'; not starting with a digit; at most 32), optionally after \"<domain>/\""
                    ),
                ));
            }
            let percent = match &cap.link_percent {
                None => None,
                Some(p) => Some(
                    link_percent(p.get_ref(), cap.value.is_some(), kind, &d.interface).map_err(
                        |why| {
                            err(
                                p.span(),
                                format!("device {name}: capacity {cname_s}.link_percent: {why}"),
                            )
                        },
                    )?,
                ),
            };
            let value = match (&cap.value, kind, &d.interface) {
                (Some(v), _, _) => Quantity::parse(v.get_ref()).map_err(|e| {
                    err(
                        v.span(),
                        format!("device {name}: capacity {cname_s}.value: {e}"),
                    )
                })?,
                (None, DeviceKind::Net, Some(nic)) => {
                    link_speed(nic.get_ref(), percent.unwrap_or(100)).map_err(|why| {
                        err(
                            nic.span(),
                            format!("device {name}: capacity {cname_s} has no value and {why}"),
                        )
                    })?
                }
                (None, DeviceKind::Gpu, _) if cname_s == MEMORY && discover_memory => {
                    // Filled in from the GPU when the agent starts.
                    Quantity::ZERO
                }
                (None, DeviceKind::Gpu, _) if cname_s == MEMORY && gpu_memory.is_some() => {
                    gpu_memory.unwrap_or(Quantity::ZERO)
                }
                (None, _, _) => {
                    return Err(err(
                        cspan,
                        format!("device {name}: capacity {cname_s}: value is required"),
                    ));
                }
            };
            // Only a GPU's memory is discovered, and only when it has no value.
            let discovered_later = discover_memory && cname_s == MEMORY;
            if !discovered_later && (value.is_negative() || value.is_zero()) {
                return Err(err(
                    cspan.clone(),
                    format!("device {name}: capacity {cname_s}.value: {value} must be positive"),
                ));
            }
            let range = cap.valid_range.as_ref().map(|r| {
                let r = r.get_ref();
                (r.min.as_str(), r.max.as_deref(), r.step.as_deref())
            });
            let policy = Policy::from_parts(
                cap.default.as_ref().map(|d| d.get_ref().as_str()),
                &cap.valid_values,
                range,
            )
            .map_err(|e| {
                err(
                    cspan.clone(),
                    format!("device {name}: capacity {cname_s}: {e}"),
                )
            })?;
            // A GPU's memory is checked against the policy once it is read from the
            // GPU (limiters.rs).
            if !discovered_later {
                policy
                    .check_capacity(&value)
                    .map_err(|e| err(cspan, format!("device {name}: capacity {cname_s}: {e}")))?;
            }
            capacities.insert(cname_s, CapacityConfig { value, policy });
        }
        if kind == DeviceKind::Gpu
            && let Some(other) = capacities.keys().find(|k| k.as_str() != MEMORY)
        {
            return Err(err(
                dspan.clone(),
                format!(
                    "device {name}: a gpu device's only capacity is {MEMORY}; {other:?} is not it"
                ),
            ));
        }
        let stands_for = match (&gpu, &d.interface) {
            (Some(g), _) => Some((format!("{:?}", g.selector), "GPU")),
            (None, Some(nic)) if kind == DeviceKind::Net => {
                Some((format!("interface {}", nic.get_ref()), "interface"))
            }
            _ => None,
        };
        if let Some((what, noun)) = stands_for
            && let Some(other) = hardware.insert(what.clone(), name.clone())
        {
            return Err(err(
                dspan.clone(),
                format!(
                    "device {name}: names the same {noun} as device {other} ({what}); its capacity would be handed out twice"
                ),
            ));
        }
        if kind == DeviceKind::Net {
            check_net_capacities(&name, &capacities).map_err(|why| err(dspan.clone(), why))?;
        } else if let Some(nic) = &d.interface {
            return Err(err(
                nic.span(),
                format!("device {name}: interface is only for kind \"net\""),
            ));
        }
        let net_mechanism = match &d.mechanism {
            None => None,
            Some(m) if kind != DeviceKind::Net => {
                return Err(err(
                    m.span(),
                    format!("device {name}: mechanism is only for kind \"net\""),
                ));
            }
            Some(m) if m.get_ref() == "auto" => None,
            Some(m) => Some(Mechanism::parse(m.get_ref()).ok_or_else(|| {
                let names: Vec<&str> = Mechanism::ALL.iter().map(|m| m.name()).collect();
                err(
                    m.span(),
                    format!(
                        "device {name}: mechanism {:?} is not one of auto, {}",
                        m.get_ref(),
                        names.join(", ")
                    ),
                )
            })?),
        };
        let net_line_rate_bps = match &d.line_rate {
            None => None,
            Some(r) if kind != DeviceKind::Net => {
                return Err(err(
                    r.span(),
                    format!("device {name}: line_rate is only for kind \"net\""),
                ));
            }
            Some(r) => Some(
                line_rate_bps(r.get_ref())
                    .map_err(|why| err(r.span(), format!("device {name}: line_rate: {why}")))?,
            ),
        };
        let class = match &d.class {
            None => default_class(kind).to_owned(),
            Some(c) => {
                check_class_name(c.get_ref()).map_err(|why| {
                    err(
                        c.span(),
                        format!("device {name}: class {:?}: {why}", c.get_ref()),
                    )
                })?;
                c.get_ref().clone()
            }
        };
        let stage = match &d.stage {
            // The class's first stage, where `[rollout.class]` names it.
            None => class_stages.get(&class).copied().unwrap_or_default(),
            Some(s) => crate::config::rollout::parse_stage(s, &format!("device {name}"), &err)?,
        };
        devices.push(DeviceConfig {
            stage,
            class,
            name,
            driver: d.driver.into_inner(),
            pool,
            kind,
            allowed_namespaces: allowed,
            admin_namespaces: admin,
            capacities,
            net: (kind == DeviceKind::Net).then(|| NetConfig {
                mechanism: net_mechanism,
                line_rate_bps: net_line_rate_bps,
                interface: d.interface.as_ref().map(|i| i.get_ref().clone()),
            }),
            gpu,
        });
    }
    Ok(devices)
}

/// A `net` device has one symmetric `bandwidth`, or `egressBandwidth` and/or
/// `ingressBandwidth` (the pod's egress and ingress), and nothing else.
fn check_net_capacities(name: &str, caps: &BTreeMap<String, CapacityConfig>) -> Result<(), String> {
    use shareguard_limiter_net::limiter::{BANDWIDTH, CAPACITIES};
    if let Some(other) = caps.keys().find(|k| !CAPACITIES.contains(&k.as_str())) {
        return Err(format!(
            "device {name}: a net device's capacities are {}; {other:?} is not one of them",
            CAPACITIES.join(", ")
        ));
    }
    if caps.contains_key(BANDWIDTH) && caps.len() > 1 {
        return Err(format!(
            "device {name}: bandwidth (both directions) cannot be combined with egressBandwidth or ingressBandwidth"
        ));
    }
    Ok(())
}

/// A line rate in bit/s: a positive whole number of bits per second that fits in 64 bits.
fn line_rate_bps(text: &str) -> Result<u64, String> {
    let q = Quantity::parse(text).map_err(|e| e.to_string())?;
    if q.is_negative() || q.is_zero() {
        return Err(format!("{q} must be positive"));
    }
    let bits = q
        .ceil_units()
        .ok_or_else(|| format!("{q} is out of range"))?;
    if Quantity::from_units(bits, shareguard_common::Format::DecimalSI) != Some(q) {
        return Err(format!("{q} is not a whole number of bit/s"));
    }
    u64::try_from(bits).map_err(|_| format!("{q} is above 2^64-1 bit/s"))
}

/// A capacity's `link_percent`, checked before any link is read: a whole percentage of
/// the link speed, where there is a link speed and no `value` to say otherwise.
fn link_percent(
    percent: &i64,
    has_value: bool,
    kind: DeviceKind,
    interface: &Option<Spanned<String>>,
) -> Result<u8, String> {
    if kind != DeviceKind::Net {
        return Err("only for kind \"net\" (a percentage of its interface's link speed)".into());
    }
    if has_value {
        return Err(
            "value is set too; set one: value is the capacity, link_percent a percentage of the link speed"
                .into(),
        );
    }
    if interface.is_none() {
        return Err("needs the device's interface, whose link speed it is a percentage of".into());
    }
    u8::try_from(*percent)
        .ok()
        .filter(|p| (1..=100).contains(p))
        .ok_or_else(|| format!("{percent} is not a whole percentage from 1 to 100"))
}

/// `percent` % of a NIC's link speed from sysfs, in bit/s.
fn link_speed(nic: &str, percent: u8) -> Result<Quantity, String> {
    if !link::is_interface_name(nic) {
        return Err(format!("interface {nic:?} is not an interface name"));
    }
    let path = format!("/sys/class/net/{nic}/speed");
    let text =
        std::fs::read_to_string(&path).map_err(|e| format!("{path} cannot be read ({e})"))?;
    let mbit: i128 = text
        .trim()
        .parse()
        .ok()
        .filter(|m: &i128| *m > 0)
        .ok_or_else(|| format!("{path} reports no link speed ({:?})", text.trim()))?;
    percent_of_mbit(mbit, percent).ok_or_else(|| format!("{path}: speed out of range"))
}

/// `percent` % of `mbit` Mbit/s as a decimal quantity of bit/s. Exact: a Mbit/s is
/// 10^6 bit/s, so a hundredth of it is a whole 10^4.
pub(super) fn percent_of_mbit(mbit: i128, percent: u8) -> Option<Quantity> {
    let bits = mbit.checked_mul(10_000)?.checked_mul(i128::from(percent))?;
    Quantity::from_units(bits, shareguard_common::Format::DecimalSI)
}
