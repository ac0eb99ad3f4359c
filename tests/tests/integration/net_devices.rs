//! How the agent sets up `net` devices at start: the mechanism each one gets from the
//! kernel probe or the config, and the capacity discovered from an interface's link speed.
//! Root only (BPF programs, veth pairs); without root they skip, except under `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{fs, process::Command};

use shareguard_limiter_net::probe;
use shareguard_tests::{
    Agent, agent_bin, device, net,
    net::{PinDir, Pod, net_device},
    prepare_one, proto as pb, share_id,
};

fn start(devices: String, pins: &PinDir) -> Agent {
    net::start_agent(devices, pins, "")
}

const CAPACITY: &str = "[device.capacity.bandwidth]\nvalue = \"10G\"\n";

#[tokio::test]
async fn each_device_gets_the_mechanism_the_kernel_and_config_allow() {
    if !net::privileged("each_device_gets_the_mechanism_the_kernel_and_config_allow") {
        return;
    }
    let kernel = probe::probe().unwrap();
    let pins = PinDir::new();
    let a = start(
        [
            net_device("auto", CAPACITY),
            net_device("edt", &format!("mechanism = \"edt-fq\"\n{CAPACITY}")),
            net_device("htb", &format!("mechanism = \"htb-ebpf\"\n{CAPACITY}")),
            net_device(
                "police",
                &format!("mechanism = \"bpf-policer\"\n{CAPACITY}"),
            ),
        ]
        .concat(),
        &pins,
    );
    let mut c = a.client().await;
    // auto: htb-ebpf where the kernel can run it, else the policer; never edt-fq, which
    // is used only by name until it has run end to end on a kernel with sch_fq.
    let auto = if shareguard_limiter_net::mechanism::available(&kernel).contains(&"htb-ebpf") {
        "htb-ebpf"
    } else {
        "bpf-policer"
    };
    assert_eq!(
        device(&mut c, "auto").await.mechanisms,
        [auto],
        "auto on {kernel:?}"
    );
    assert_eq!(device(&mut c, "police").await.mechanisms, ["bpf-policer"]);
    assert_eq!(device(&mut c, "htb").await.mechanisms, ["htb-ebpf"]);
    let edt = device(&mut c, "edt").await.mechanisms;
    if kernel.fq {
        assert_eq!(edt, ["edt-fq"]);
    } else {
        // This project's CI kernel: the device stays listed, says why, and its shares
        // fail for good instead of being reported as enforced by something else.
        assert_eq!(edt.len(), 1);
        assert!(
            edt[0].starts_with("unavailable: ") && edt[0].contains("sch_fq"),
            "{edt:?}"
        );
        let pod = Pod::new();
        let cl = net::bw_claim("edt-claim", "team-a", "edt", &pod, &share_id(), "50M");
        let r = prepare_one(&mut c, 0, cl).await;
        let e = r.error.clone().expect("no mechanism, no enforcement");
        assert!(!e.retryable, "{e:?}");
        assert_eq!(r.shares[0].phase, pb::Phase::Failed as i32, "{r:?}");
        assert_eq!(device(&mut c, "edt").await.allocated["bandwidth"], "0");
        assert!(
            !net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]).contains("htb"),
            "nothing installed for a failed share"
        );
    }
    assert!(
        a.log_text()
            .contains("probed the kernel for bandwidth mechanisms"),
        "the probe is logged"
    );
}

/// Also a percentage of it (`link_percent`), the headroom an operator keeps.
#[tokio::test]
async fn link_speed_of_the_interface_is_the_capacity_when_none_is_given() {
    if !net::privileged("link_speed_of_the_interface_is_the_capacity_when_none_is_given") {
        return;
    }
    let pod = Pod::new();
    let speed: u64 = fs::read_to_string(format!("/sys/class/net/{}/speed", pod.host_if()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let pins = PinDir::new();
    let policy = "default = \"10M\"\nvalid_range = { min = \"10M\", step = \"10M\" }\n";
    let nic = net_device(
        "nic",
        &format!(
            "interface = {:?}\n[device.capacity.bandwidth]\n{policy}",
            pod.host_if()
        ),
    );
    // The same kind of link, published at a tenth of its speed (headroom kept for latency).
    let other = Pod::new();
    let tenth = net_device(
        "nic-tenth",
        &format!(
            "interface = {:?}\n[device.capacity.bandwidth]\nlink_percent = 10\n{policy}",
            other.host_if()
        ),
    );
    let a = start(format!("{nic}{tenth}"), &pins);
    let mut c = a.client().await;
    let mbit = |m: u64| {
        if m.is_multiple_of(1000) {
            format!("{}G", m / 1000)
        } else {
            format!("{m}M")
        }
    };
    let d = device(&mut c, "nic").await;
    assert_eq!(
        d.capacity["bandwidth"],
        mbit(speed),
        "{speed} Mbit/s: {d:?}"
    );
    let d = device(&mut c, "nic-tenth").await;
    assert_eq!(
        d.capacity["bandwidth"],
        mbit(speed / 10),
        "10% of {speed} Mbit/s: {d:?}"
    );
    drop(c);
    drop(a);

    // A link that is down has no speed: the agent refuses the config and says why.
    net::sh(&["ip", "link", "set", "dev", pod.host_if(), "down"]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nic.toml");
    fs::write(
        &path,
        format!(
            "[agent]\nsocket = {:?}\nstate_dir = {:?}\nbpffs_dir = {:?}\n{nic}",
            dir.path().join("s.sock"),
            dir.path().join("state"),
            pins.0
        ),
    )
    .unwrap();
    let out = Command::new(agent_bin())
        .args(["agent", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("/sys/class/net/{}/speed", pod.host_if()))
            && stderr.contains("capacity bandwidth has no value"),
        "{stderr}"
    );
}

/// `interface = "auto"`: the agent takes the NIC of the node's default route (here the
/// machine's own, read only: its link state and placement) and publishes where it sits
/// in the machine, as the kernel's sysfs has it independently of the agent: the
/// standard PCIe root and PCI address, and the NUMA node where the kernel gives one. A
/// veth has no PCI device, so its device publishes none of them. A SIMULATED GPU that
/// claims the NIC's PCI address is placed as a real GPU would be, from sysfs: on the
/// NIC's root, so a claim could align the two.
#[tokio::test]
async fn an_auto_interface_is_the_default_route_nic_and_says_where_it_sits() {
    if !net::privileged("an_auto_interface_is_the_default_route_nic_and_says_where_it_sits") {
        return;
    }
    // The default route's NIC as `ip route` says it, not as the agent finds it.
    let out = Command::new("ip")
        .args(["-o", "-4", "route", "show", "default"])
        .output()
        .unwrap();
    let routes = String::from_utf8_lossy(&out.stdout).into_owned();
    let Some(nic) = routes
        .split_whitespace()
        .skip_while(|w| *w != "dev")
        .nth(1)
        .map(str::to_owned)
    else {
        assert!(
            !net::in_ci(),
            "no IPv4 default route on this machine: {routes:?}"
        );
        eprintln!("SKIP: no IPv4 default route here ({routes:?})");
        return;
    };
    let pod = Pod::new();
    let pins = PinDir::new();
    let auto = net_device("nic-auto", &format!("interface = \"auto\"\n{CAPACITY}"));
    let veth = net_device(
        "nic-veth",
        &format!("interface = {:?}\n{CAPACITY}", pod.host_if()),
    );
    // The NIC's PCI address as sysfs resolves it, for the simulated GPU to claim.
    let nic_bus = fs::canonicalize(format!("/sys/class/net/{nic}/device"))
        .ok()
        .and_then(|p| {
            p.components()
                .filter_map(|c| c.as_os_str().to_str().map(str::to_owned))
                .rfind(|c| shareguard_common::pci::is_pci_address(c))
        });
    let cdi = tempfile::tempdir().unwrap();
    let gpu = match &nic_bus {
        Some(bus) => {
            shareguard_tests::simulated_gpu_device("{ period = \"1s\", action = \"report\" }")
                .replace(
                    "[device.simulated]\n",
                    &format!("[device.simulated]\npci_bus_id = {bus:?}\n"),
                )
        }
        None => String::new(),
    };
    let a = net::start_agent(
        format!("{auto}{veth}{gpu}"),
        &pins,
        &format!("cdi_dir = {:?}", cdi.path()),
    );
    let mut c = a.client().await;
    let d = device(&mut c, "nic-auto").await;
    assert_eq!(d.fault, "", "the default route's NIC is up: {d:?}");
    let pcie_root = "resource.kubernetes.io/pcieRoot";
    let bus_id = "resource.kubernetes.io/pciBusID";
    match fs::canonicalize(format!("/sys/class/net/{nic}/device")) {
        Ok(dev) => {
            let path = dev.to_string_lossy().into_owned();
            let rest = path.strip_prefix("/sys/devices/").unwrap();
            let root = rest.split('/').next().unwrap();
            assert_eq!(
                d.attributes.get(pcie_root).map(String::as_str),
                Some(root),
                "{d:?}"
            );
            let bus = &d.attributes[bus_id];
            assert!(
                path.contains(&format!("/{bus}")) && bus.len() == 12,
                "{bus} is not a PCI device on {path}"
            );
            let numa = fs::read_to_string(format!("/sys/bus/pci/devices/{bus}/numa_node"))
                .ok()
                .and_then(|t| t.trim().parse::<i64>().ok())
                .filter(|n| *n >= 0);
            assert_eq!(d.int_attributes.get("numaNode").copied(), numa, "{d:?}");
        }
        // A NIC without a device (virtual): no placement to publish.
        Err(_) => assert!(!d.attributes.contains_key(pcie_root), "{d:?}"),
    }
    if let Some(bus) = &nic_bus {
        let g = device(&mut c, "gpu-0").await;
        assert_eq!(g.attributes.get(bus_id), Some(bus), "{g:?}");
        assert_eq!(
            g.attributes.get(pcie_root),
            d.attributes.get(pcie_root),
            "the GPU on the NIC's address is on its root: {g:?}"
        );
        assert_eq!(g.int_attributes, d.int_attributes, "{g:?}");
    }
    let d = device(&mut c, "nic-veth").await;
    assert!(
        !d.attributes.contains_key(pcie_root)
            && !d.attributes.contains_key(bus_id)
            && d.int_attributes.is_empty(),
        "a veth sits on no PCI device: {d:?}"
    );
}
