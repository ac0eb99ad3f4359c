//! What the kubelet plugin publishes of each device in its ResourceSlice, and the limits
//! resource.k8s.io puts on a slice (Kubernetes 1.34–1.36), so that the agent's config
//! refuses at start what the API server would refuse when the slice is published.

/// Attributes of every device, in the driver's domain.
pub const DEVICE_ATTRIBUTES: [&str; 4] = ["kind", "mechanism", "enforced", "stage"];
/// Attributes a GPU adds: `binds` says what its memory limit holds to the amount:
/// `share` (all of the share's processes together), `process` (each process on its
/// own: MPS), or `none` (the watchdog only reports or stops after the fact).
pub const GPU_ATTRIBUTES: [&str; 3] = ["uuid", "model", "binds"];
/// Attributes a NIC or a GPU adds where the kernel says (none for a NIC without a PCI
/// device): its NUMA node (an integer, in the driver's domain) and Kubernetes' standard
/// PCIe root and PCI address, which other drivers' devices carry too, so that a claim
/// can ask for a GPU and a NIC on one root (`matchAttribute`). See [`crate::pci`].
pub const PLACEMENT_ATTRIBUTES: [&str; 3] = [
    "numaNode",
    "resource.kubernetes.io/pcieRoot",
    "resource.kubernetes.io/pciBusID",
];
/// `ResourceSliceMaxAttributesAndCapacitiesPerDevice`.
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
/// `ResourceSliceMaxDevices`: the plugin publishes a pool as one slice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// `DeviceAttributeMaxValueLength`, for string attributes.
pub const MAX_STRING_ATTRIBUTE: usize = 64;
/// `CapacityRequestPolicyDiscreteMaxOptions`.
pub const MAX_VALID_VALUES: usize = 10;

/// How many attributes the plugin publishes at most for a device of this kind
/// ("net", "gpu", "generic").
pub fn attributes_for(kind: &str) -> usize {
    DEVICE_ATTRIBUTES.len()
        + match kind {
            "gpu" => GPU_ATTRIBUTES.len() + PLACEMENT_ATTRIBUTES.len(),
            "net" => PLACEMENT_ATTRIBUTES.len(),
            _ => 0,
        }
}

/// RFC 1123 label: what Kubernetes requires of namespaces and device names.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A Kubernetes label value, non-empty: at most 63 of letters, digits, '-', '_' and '.',
/// beginning and ending with a letter or digit. What a device taint's value must be.
pub fn is_label_value(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && s.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// RFC 1123 subdomain: object names and driver names.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && !s.is_empty() && s.split('.').all(is_dns_label)
}

/// A driver name: a DNS subdomain of at most 63 characters (resource.k8s.io's
/// `DriverNameMaxLength`).
pub fn is_driver_name(s: &str) -> bool {
    s.len() <= 63 && is_dns_subdomain(s)
}

/// A namespace name: an RFC 1123 label.
pub fn is_namespace(s: &str) -> bool {
    is_dns_label(s)
}

/// Pool names are one or more DNS subdomains joined by '/'.
pub fn is_pool_name(s: &str) -> bool {
    s.len() <= 253 && !s.is_empty() && s.split('/').all(is_dns_subdomain)
}

/// A ResourceSlice attribute or capacity name (resource.k8s.io `QualifiedName`): a C
/// identifier of at most 32 characters, optionally after a domain (a DNS subdomain of at
/// most 63 characters) and '/'. The API server accepts more than one '/' (an open TODO
/// there); the agent does not.
pub fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        None => is_c_identifier(s),
        Some((domain, name)) => {
            domain.len() <= 63 && is_dns_subdomain(domain) && is_c_identifier(name)
        }
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`, at most 32 characters (resource.k8s.io's `DeviceMaxIDLength`).
pub fn is_c_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && !s.as_bytes()[0].is_ascii_digit()
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_what_kubernetes_takes() {
        for ok in [
            "link-down",
            "gpu-not-answering",
            "a",
            "A.b_c-9",
            &"x".repeat(63),
        ] {
            assert!(is_label_value(ok), "{ok:?}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "a b",
            "not a label!",
            "a/b",
            &"x".repeat(64),
        ] {
            assert!(!is_label_value(bad), "{bad:?}");
        }
    }
}
