//! The NIC a `net` device stands for (its config's `interface`): whether its link can
//! carry the device's shares. Read from sysfs, in the agent's network namespace (the
//! node's: the agent runs with the host's network).

use std::{fs, io::ErrorKind, path::Path};

use shareguard_common::{limiter::DeviceFault, pci::Placement};

/// Where the kernel lists the interfaces of the reader's network namespace.
pub const SYS_CLASS_NET: &str = "/sys/class/net";

/// Whether `name` can be an interface's name under [`SYS_CLASS_NET`]: a name with a
/// slash or a dot-dot would read another file than the interface's.
pub fn is_interface_name(name: &str) -> bool {
    !(name.is_empty() || name.contains('/') || name == "." || name == "..")
}

/// Why `interface` cannot carry traffic now, or None when its link is up. `sys` is the
/// sysfs directory of interfaces ([`SYS_CLASS_NET`]; another in tests).
///
/// The kernel's `operstate` (RFC 2863): `up`, and `unknown` (what drivers that do not
/// track the state report, such as loopback and tun) carry traffic; `down`,
/// `lowerlayerdown` (a lower device down), `notpresent`, `dormant` and `testing` do not.
pub fn fault(sys: &Path, interface: &str) -> Option<DeviceFault> {
    if !is_interface_name(interface) {
        return Some(DeviceFault::new(
            "link-gone",
            format!("interface {interface:?} is not an interface name"),
        ));
    }
    let path = sys.join(interface).join("operstate");
    match fs::read_to_string(&path) {
        Ok(state) => match state.trim() {
            "up" | "unknown" => None,
            other => Some(DeviceFault::new(
                "link-down",
                format!("interface {interface} is {other}"),
            )),
        },
        Err(e) if e.kind() == ErrorKind::NotFound => Some(DeviceFault::new(
            "link-gone",
            format!("interface {interface} is gone"),
        )),
        Err(e) => Some(DeviceFault::new(
            "link-down",
            format!("interface {interface}: reading {}: {e}", path.display()),
        )),
    }
}

/// What a net device's config may give as its `interface` to mean the NIC of the
/// node's default route ([`default_route_interface`]), found when the config is read.
pub const AUTO: &str = "auto";

/// The interface the node's default route leaves by: the IPv4 default route with the
/// lowest metric, else the IPv6 one; among equals, the first the kernel lists. Read
/// from `proc_net` (/proc/net: the reader's network namespace, the node's for the
/// agent; another directory in tests). Unreachable, blackhole and prohibit routes
/// (RTF_REJECT) and routes that are not up carry no traffic and do not count.
pub fn default_route_interface(proc_net: &Path) -> Result<String, String> {
    const RTF_UP: u32 = 0x1;
    const RTF_REJECT: u32 = 0x200;
    let read = |name: &str| {
        let path = proc_net.join(name);
        fs::read_to_string(&path).map_err(|e| format!("{} cannot be read ({e})", path.display()))
    };
    // Iface Destination Gateway Flags RefCnt Use Metric Mask MTU Window IRTT, in hex.
    let v4 = read("route")?;
    let best_v4 = v4
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let metric = u32::from_str_radix(f.get(6)?, 16).ok()?;
            let default = *f.get(1)? == "00000000" && *f.get(7)? == "00000000";
            (default && flags & RTF_UP != 0 && flags & RTF_REJECT == 0)
                .then(|| (metric, f[0].to_owned()))
        })
        .min_by_key(|(metric, _)| *metric);
    if let Some((_, nic)) = best_v4 {
        return Ok(nic);
    }
    // dest dest_len src src_len next_hop metric refcnt use flags iface, in hex. The
    // kernel lists IPv6 unreachable defaults on lo; RTF_REJECT leaves them out.
    let v6 = read("ipv6_route").unwrap_or_default();
    let best_v6 = v6
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let default = f.first()?.bytes().all(|b| b == b'0') && *f.get(1)? == "00";
            let metric = u32::from_str_radix(f.get(5)?, 16).ok()?;
            let flags = u32::from_str_radix(f.get(8)?, 16).ok()?;
            let nic = *f.get(9)?;
            (default && flags & RTF_UP != 0 && flags & RTF_REJECT == 0 && nic != "lo")
                .then(|| (metric, nic.to_owned()))
        })
        .min_by_key(|(metric, _)| *metric);
    best_v6
        .map(|(_, nic)| nic)
        .ok_or_else(|| "the node has no default route (IPv4 or IPv6) that is up".to_owned())
}

/// `interface`'s place in the machine, from its `device` link in `sys`
/// (/sys/class/net); nothing where it has no PCI device (veth, bridge, bond).
pub fn placement(sys: &Path, interface: &str) -> Placement {
    if !is_interface_name(interface) {
        return Placement::default();
    }
    shareguard_common::pci::placement(&sys.join(interface).join("device"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sys_with(states: &[(&str, &str)]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for (name, state) in states {
            fs::create_dir(d.path().join(name)).unwrap();
            fs::write(d.path().join(name).join("operstate"), format!("{state}\n")).unwrap();
        }
        d
    }

    #[test]
    fn up_and_unknown_carry_traffic_and_nothing_else_does() {
        let d = sys_with(&[
            ("eth0", "up"),
            ("tun0", "unknown"),
            ("eth1", "down"),
            ("bond0", "lowerlayerdown"),
        ]);
        assert_eq!(fault(d.path(), "eth0"), None);
        assert_eq!(fault(d.path(), "tun0"), None);
        let said = |name| fault(d.path(), name).map(|f| (f.reason, f.message));
        assert_eq!(
            said("eth1"),
            Some(("link-down", "interface eth1 is down".to_owned()))
        );
        assert_eq!(
            said("bond0"),
            Some(("link-down", "interface bond0 is lowerlayerdown".to_owned()))
        );
        assert_eq!(
            said("eth9"),
            Some(("link-gone", "interface eth9 is gone".to_owned()))
        );
    }

    #[test]
    fn a_name_that_is_a_path_reads_nothing() {
        let d = sys_with(&[("eth0", "up")]);
        for bad in ["", "..", "eth0/..", "../eth0"] {
            let f = fault(d.path(), bad).unwrap();
            assert!(
                f.message.contains("not an interface name"),
                "{bad:?}: {f:?}"
            );
        }
    }

    /// The real sysfs of this machine: loopback exists everywhere and is never down
    /// while anything runs.
    #[test]
    fn loopback_carries_traffic() {
        assert_eq!(fault(Path::new(SYS_CLASS_NET), "lo"), None);
    }

    #[test]
    fn the_default_route_is_the_lowest_metric_ipv4_then_ipv6() {
        let d = tempfile::tempdir().unwrap();
        let head =
            "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
        let write = |route: &str, v6: &str| {
            fs::write(d.path().join("route"), format!("{head}{route}")).unwrap();
            fs::write(d.path().join("ipv6_route"), v6).unwrap();
        };
        // A subnet route, a default not up, a default of metric 100 and one of 50.
        write(
            "eth9\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
             eth8\t00000000\t010200C0\t0002\t0\t0\t0\t00000000\t0\t0\t0\n\
             eth1\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
             ens5\t00000000\t010200C0\t0003\t0\t0\t32\t00000000\t0\t0\t0\n",
            "",
        );
        assert_eq!(default_route_interface(d.path()), Ok("ens5".to_owned()));
        // No IPv4 default: IPv6's, not the unreachable one the kernel lists on lo.
        let unreachable_on_lo = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo\n";
        let v6_default = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 00000400 00000001 00000000 00000003     eth2\n";
        write("", &format!("{unreachable_on_lo}{v6_default}"));
        assert_eq!(default_route_interface(d.path()), Ok("eth2".to_owned()));
        write("", unreachable_on_lo);
        let e = default_route_interface(d.path()).unwrap_err();
        assert!(e.contains("no default route"), "{e}");
        fs::remove_file(d.path().join("route")).unwrap();
        let e = default_route_interface(d.path()).unwrap_err();
        assert!(e.contains("route cannot be read"), "{e}");
    }

    #[test]
    fn a_nic_s_placement_is_read_from_its_pci_device() {
        let d = tempfile::tempdir().unwrap();
        let pci = d
            .path()
            .join("devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1");
        fs::create_dir_all(pci.join("virtio2")).unwrap();
        fs::write(pci.join("numa_node"), "1\n").unwrap();
        let net = d.path().join("class/net");
        for (nic, target) in [("eth0", pci.join("virtio2")), ("eth1", pci.clone())] {
            fs::create_dir_all(net.join(nic)).unwrap();
            std::os::unix::fs::symlink(&target, net.join(nic).join("device")).unwrap();
        }
        let want = Placement {
            pcie_root: Some("pci0000:3a".to_owned()),
            pci_bus_id: Some("0000:3b:00.1".to_owned()),
            numa_node: Some(1),
        };
        assert_eq!(placement(&net, "eth0"), want);
        assert_eq!(placement(&net, "eth1"), want);
        // The kernel's -1: no NUMA node. No device link (a veth): nothing.
        fs::write(pci.join("numa_node"), "-1\n").unwrap();
        assert_eq!(placement(&net, "eth1").numa_node, None);
        fs::create_dir_all(net.join("veth0")).unwrap();
        assert_eq!(placement(&net, "veth0"), Placement::default());
        assert_eq!(placement(&net, "../x"), Placement::default());
    }
}
