//! The NIC a `net` device stands for (its config's `interface`): whether its link can
//! carry the device's shares. Read from sysfs, in the agent's network namespace (the
//! node's: the agent runs with the host's network).

use std::{fs, io::ErrorKind, path::Path};

use shareguard_common::limiter::DeviceFault;

/// Where the kernel lists the interfaces of the reader's network namespace.
pub const SYS_CLASS_NET: &str = "/sys/class/net";

/// Why `interface` cannot carry traffic now, or None when its link is up. `sys` is the
/// sysfs directory of interfaces ([`SYS_CLASS_NET`]; another in tests).
///
/// The kernel's `operstate` (RFC 2863): `up`, and `unknown` (what drivers that do not
/// track the state report, such as loopback and tun) carry traffic; `down`,
/// `lowerlayerdown` (a lower device down), `notpresent`, `dormant` and `testing` do not.
pub fn fault(sys: &Path, interface: &str) -> Option<DeviceFault> {
    // A name with a slash or a dot-dot would read another file than the interface's.
    if interface.is_empty() || interface.contains('/') || interface == "." || interface == ".." {
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
}
