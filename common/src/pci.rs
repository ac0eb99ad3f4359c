//! Where a PCI device sits in the machine, read from sysfs: its PCIe root complex, its
//! address and its NUMA node, which a device's ResourceSlice entry publishes so that a
//! claim can ask for devices close together (a GPU and a NIC on one root, with
//! `matchAttribute` on Kubernetes' standard `resource.kubernetes.io/pcieRoot`).

use std::{collections::BTreeMap, fs, path::Path};

/// A device's place in the machine. Each None where the device is no PCI device or
/// the kernel does not say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// The PCIe root complex, `pci<domain>:<bus>` (`resource.kubernetes.io/pcieRoot`).
    pub pcie_root: Option<String>,
    /// The PCI address, `<domain>:<bus>:<device>.<function>`
    /// (`resource.kubernetes.io/pciBusID`).
    pub pci_bus_id: Option<String>,
    /// The NUMA node the kernel gives the PCI device (none where it says -1).
    pub numa_node: Option<i64>,
}

impl Placement {
    /// Adds what is known of the place to a device's attributes
    /// ([`crate::slice::PLACEMENT_ATTRIBUTES`]): the PCIe root and the address as
    /// strings, the NUMA node as an int.
    pub fn add_attributes(
        self,
        strings: &mut BTreeMap<String, String>,
        ints: &mut BTreeMap<String, i64>,
    ) {
        let [numa, pcie_root, pci_bus_id] = crate::slice::PLACEMENT_ATTRIBUTES;
        for (name, value) in [(pcie_root, self.pcie_root), (pci_bus_id, self.pci_bus_id)] {
            if let Some(v) = value {
                strings.insert(name.to_owned(), v);
            }
        }
        if let Some(n) = self.numa_node {
            ints.insert(numa.to_owned(), n);
        }
    }
}

/// Where the kernel lists PCI devices by address.
pub const SYS_BUS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// The [`Placement`] of the device at sysfs path `device` (a link such as
/// /sys/class/net/eth0/device or /sys/bus/pci/devices/0000:3b:00.0). It resolves to
/// /sys/devices/pci<root>/<bridges...>/<address>[/<function of a bus such as virtio>]:
/// the root is the first component, the address the last PCI address, the NUMA node
/// that device's `numa_node`.
pub fn placement(device: &Path) -> Placement {
    let mut p = Placement::default();
    let Ok(device) = fs::canonicalize(device) else {
        return p;
    };
    let parts: Vec<&str> = device
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .collect();
    let Some(root_at) = parts.iter().position(|c| is_pcie_root(c)) else {
        return p;
    };
    p.pcie_root = Some(parts[root_at].to_owned());
    let Some(last_pci) = parts.iter().rposition(|c| is_pci_address(c)) else {
        return p;
    };
    p.pci_bus_id = Some(parts[last_pci].to_owned());
    let pci_dir: std::path::PathBuf = device
        .components()
        .take(device.components().count() - (parts.len() - 1 - last_pci))
        .collect();
    p.numa_node = fs::read_to_string(pci_dir.join("numa_node"))
        .ok()
        .and_then(|t| t.trim().parse::<i64>().ok())
        .filter(|n| *n >= 0);
    p
}

/// `pci<domain>:<bus>`: four and two hex digits.
fn is_pcie_root(c: &str) -> bool {
    c.strip_prefix("pci").is_some_and(|rest| {
        let b = rest.as_bytes();
        b.len() == 7
            && b[4] == b':'
            && b.iter()
                .enumerate()
                .all(|(i, x)| i == 4 || x.is_ascii_hexdigit())
    })
}

/// `<domain>:<bus>:<device>.<function>`: `0000:00:03.0`.
pub fn is_pci_address(c: &str) -> bool {
    let b = c.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, x)| matches!(i, 4 | 7 | 10) || x.is_ascii_hexdigit())
}

/// A PCI address as NVML gives it (`00000000:3B:00.0`: an 8-digit domain, upper case)
/// in sysfs's spelling (`0000:3b:00.0`), or None when it is not one.
pub fn from_nvml_bus_id(bus_id: &str) -> Option<String> {
    let (domain, rest) = bus_id.trim().split_once(':')?;
    if domain.len() < 4 || !domain.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (high, low) = domain.split_at(domain.len() - 4);
    if high.bytes().any(|b| b != b'0') {
        return None;
    }
    let address = format!("{low}:{rest}").to_ascii_lowercase();
    is_pci_address(&address).then_some(address)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_and_addresses_are_told_from_other_path_parts() {
        assert!(is_pcie_root("pci0000:3a"));
        assert!(!is_pcie_root("pci0000:3"));
        assert!(!is_pcie_root("pci_bus"));
        assert!(is_pci_address("0000:3b:00.1"));
        assert!(!is_pci_address("0000:3b:00"));
        assert!(!is_pci_address("virtio2"));
    }

    #[test]
    fn nvml_s_bus_ids_are_spelled_as_sysfs_does() {
        assert_eq!(
            from_nvml_bus_id("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00.0")
        );
        assert_eq!(
            from_nvml_bus_id("0001:c1:00.0").as_deref(),
            Some("0001:c1:00.0")
        );
        assert_eq!(
            from_nvml_bus_id("00010000:3B:00.0"),
            None,
            "a domain above 16 bits"
        );
        assert_eq!(from_nvml_bus_id("GPU-1234"), None);
        assert_eq!(from_nvml_bus_id(""), None);
    }
}
