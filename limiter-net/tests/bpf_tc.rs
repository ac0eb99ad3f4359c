//! The tc programs with real traffic: a "pod" network namespace joined to this (the host's)
//! namespace by a veth pair, the programs attached to the host-side end as the agent does,
//! and ping across.
//!
//! These tests need root (BPF, network namespaces). Without it they print why and pass,
//! except with `CI=true`, where they fail: CI must run them.
//!
//! Every test has its own namespace, links, addresses (from 198.18.0.0/15, the benchmarking
//! range) and pin directory, named after the process id and a counter, and guards that
//! remove them when the test ends, also by a panic.

use std::{
    fs,
    io::Write as _,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::programs::{SchedClassifier, TcAttachType};
use shareguard_ebpf_common::{Activity, DIR_TO_POD, counter_index};
use shareguard_limiter_net::bpf::{
    AttachMode, Bpf, BpfError, Counters, Direction, IfaceConfig, ensure_bpffs,
};
use shareguard_limiter_net::rtnl;

const BPFFS: &str = "/sys/fs/bpf";
const PINGS: u64 = 20;
/// An ICMP echo of ping's default size on Ethernet: 14 + 20 + 8 + 56 bytes.
const PING_FRAME: u64 = 98;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Whether the test may run; prints why not, or panics where it must run.
fn privileged(test: &str) -> bool {
    let status = fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    let root = status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        == Some("0");
    if root {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: CI=true but not running as root: the BPF tests must run in CI"
    );
    // Straight to stderr: the test harness captures print!/eprint!, and a skip must show.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: needs root (BPF programs, network namespaces)"
    );
    false
}

fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn ip(args: &[&str]) -> String {
    run("ip", args)
}

fn ifindex_of(name: &str) -> u32 {
    let path = format!("/sys/class/net/{name}/ifindex");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {text:?}: {e}"))
}

fn link_stat(name: &str, stat: &str) -> u64 {
    let path = format!("/sys/class/net/{name}/statistics/{stat}");
    let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {text:?}: {e}"))
}

/// A pod namespace, the veth pair joining it to this namespace, and the pin directory.
/// Drop removes all of it.
struct Pod {
    netns: String,
    host_veth: String,
    host_addr: Ipv4Addr,
    extra_links: Vec<String>,
    pin_dir: PathBuf,
}

impl Pod {
    fn new() -> Self {
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        // Interface names have at most 15 bytes: "sg" + pid in hex (<= 6) + kind + n.
        let tag = format!("sg{pid:x}");
        // A /30 per pod in 198.18.0.0/15 (32768 of them), distinct for every test of this
        // process and unlikely to meet another process's.
        let subnet = (pid.wrapping_mul(64).wrapping_add(n)) % 32768;
        let base = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + subnet * 4;
        let pod = Self {
            netns: format!("sgtest-{pid}-{n}"),
            host_veth: format!("{tag}h{n}"),
            host_addr: Ipv4Addr::from(base + 1),
            extra_links: Vec::new(),
            pin_dir: PathBuf::from(BPFFS).join(format!("shareguard-test-{pid}-{n}")),
        };
        let pod_veth = format!("{tag}p{n}");
        let pod_addr = Ipv4Addr::from(base + 2);
        // From here on Drop cleans up whatever was created, even if a step below fails.
        ip(&["netns", "add", &pod.netns]);
        ip(&[
            "link",
            "add",
            &pod.host_veth,
            "type",
            "veth",
            "peer",
            "name",
            &pod_veth,
            "netns",
            &pod.netns,
        ]);
        ip(&[
            "addr",
            "add",
            &format!("{}/30", pod.host_addr),
            "dev",
            &pod.host_veth,
        ]);
        ip(&["link", "set", &pod.host_veth, "up"]);
        ip(&[
            "-n",
            &pod.netns,
            "addr",
            "add",
            &format!("{pod_addr}/30"),
            "dev",
            &pod_veth,
        ]);
        ip(&["-n", &pod.netns, "link", "set", &pod_veth, "up"]);
        ip(&["-n", &pod.netns, "link", "set", "lo", "up"]);
        ensure_bpffs(Path::new(BPFFS)).unwrap_or_else(|e| panic!("{e}"));
        pod
    }

    fn host_ifindex(&self) -> u32 {
        ifindex_of(&self.host_veth)
    }

    /// Adds a share's queue pair, as the limiter makes it, that Drop removes; returns
    /// the names of its queue device and its return device.
    fn add_queue_pair(&mut self) -> (String, String) {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("sg{:x}q{n}", std::process::id());
        let back = format!("sg{:x}r{n}", std::process::id());
        self.extra_links.push(name.clone());
        rtnl::ensure_queue_pair(&name, &back, &name)
            .unwrap_or_else(|e| panic!("making the queue pair {name}: {e}"));
        (name, back)
    }

    /// Pings the host side from the pod; returns how many replies came back.
    fn ping(&self, count: u64) -> u64 {
        let out = run(
            "ip",
            &[
                "netns",
                "exec",
                &self.netns,
                "ping",
                "-q",
                "-c",
                &count.to_string(),
                "-i",
                "0.01",
                "-W",
                "2",
                &self.host_addr.to_string(),
            ],
        );
        // "20 packets transmitted, 20 received, 0% packet loss, time 190ms"
        out.lines()
            .find_map(|line| {
                let (_, rest) = line.split_once(" packets transmitted, ")?;
                rest.split_once(" received")?.0.parse().ok()
            })
            .unwrap_or_else(|| panic!("no ping summary in {out:?}"))
    }

    /// Programs attached with TCX to the host veth for one hook, by name.
    fn tcx_programs(&self, hook: TcAttachType) -> Vec<(u32, String)> {
        let (_, programs) = SchedClassifier::query_tcx(&self.host_veth, hook)
            .unwrap_or_else(|e| panic!("querying TCX {hook:?} of {}: {e}", self.host_veth));
        programs
            .iter()
            .map(|p| (p.id(), p.name_as_str().unwrap_or("?").to_owned()))
            .collect()
    }

    /// `tc filter show` for one clsact hook of the host veth.
    fn tc_filters(&self, hook: &str) -> String {
        run("tc", &["filter", "show", "dev", &self.host_veth, hook])
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        // Best effort and silent: parts may not exist if setup failed half-way. Removing the
        // pins releases the links; deleting the namespace deletes the veth pair with it.
        let _ = fs::remove_dir_all(&self.pin_dir);
        for link in &self.extra_links {
            let _ = Command::new("ip").args(["link", "del", link]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_veth])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .output();
    }
}

fn attach_both(bpf: &mut Bpf, ifindex: u32) {
    for (dir, name) in [
        (Direction::ToPod, "to-pod"),
        (Direction::FromPod, "from-pod"),
    ] {
        if let Err(e) = bpf.attach(ifindex, dir, name) {
            panic!("attaching {name} to ifindex {ifindex}: {e}");
        }
    }
}

fn assert_counted(before: Counters, after: Counters, packets: u64, what: &str) {
    let grew = after.packets - before.packets;
    assert!(
        grew >= packets,
        "{what}: counted {grew} packets, sent at least {packets}"
    );
    assert!(
        after.bytes - before.bytes >= packets * PING_FRAME,
        "{what}: counted {} bytes for {packets} packets",
        after.bytes - before.bytes
    );
}

#[test]
fn counts_both_directions() {
    if !privileged("counts_both_directions") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    assert_eq!(bpf.mode(), AttachMode::Tcx, "this kernel has TCX");
    attach_both(&mut bpf, ifindex);
    let cfg = IfaceConfig {
        slot: 7,
        ..IfaceConfig::default()
    };
    bpf.set_iface(ifindex, cfg).unwrap();
    assert_eq!(bpf.iface(ifindex).unwrap(), Some(cfg));
    bpf.reset_counters(7).unwrap();
    let (to0, from0) = bpf.counters(7).unwrap();
    assert_eq!((to0, from0), (Counters::default(), Counters::default()));

    assert_eq!(pod.ping(PINGS), PINGS);

    let (to, from) = bpf.counters(7).unwrap();
    assert_counted(to0, to, PINGS, "to the pod");
    assert_counted(from0, from, PINGS, "from the pod");
    // Another slot saw nothing.
    assert_eq!(
        bpf.counters(8).unwrap(),
        (Counters::default(), Counters::default())
    );
    assert!(bpf.is_attached("to-pod", ifindex).unwrap());
    assert!(bpf.is_attached("from-pod", ifindex).unwrap());
    assert!(!bpf.is_attached("to-pod", ifindex + 100_000).unwrap());
    assert!(!bpf.is_attached("never-attached", ifindex).unwrap());

    // Unconfigured: the programs stay attached but leave the traffic alone.
    bpf.clear_iface(ifindex).unwrap();
    assert_eq!(bpf.iface(ifindex).unwrap(), None);
    bpf.clear_iface(ifindex).unwrap();
    assert_eq!(pod.ping(5), 5);
    assert_eq!(bpf.counters(7).unwrap(), (to, from));
}

#[test]
fn an_armed_share_wakes_user_space_at_its_next_packet() {
    if !privileged("an_armed_share_wakes_user_space_at_its_next_packet") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    let mut wake = bpf.take_wakeups().expect("the wake-up ring, once");
    assert!(bpf.take_wakeups().is_none(), "one reader only");
    attach_both(&mut bpf, ifindex);
    // An HTB share in slot 5: its traffic to the pod (the ping replies) is classified,
    // and noted.
    let slot = 5;
    let index = counter_index(slot, DIR_TO_POD).unwrap();
    bpf.set_iface(
        ifindex,
        IfaceConfig {
            slot,
            classid: shareguard_limiter_net::tc::CLASSID,
            ..IfaceConfig::default()
        },
    )
    .unwrap();
    bpf.reset_counters(slot).unwrap();
    assert_eq!(bpf.activity(index).unwrap(), Activity::default());

    let before = monotonic_ns();
    assert_eq!(pod.ping(3), 3);
    let seen = bpf.activity(index).unwrap();
    assert!(
        (before..=monotonic_ns()).contains(&seen.last_ns),
        "last packet noted at {}, pings from {before}",
        seen.last_ns
    );
    assert!(wake.drain().is_empty(), "not armed: no wake-up");

    bpf.arm(index, seen).unwrap();
    assert_eq!(bpf.activity(index).unwrap().armed, 1);
    assert_eq!(pod.ping(2), 2);
    assert_eq!(wake.drain(), vec![index], "one wake-up for the armed share");
    assert_eq!(bpf.activity(index).unwrap().armed, 0, "and disarmed");
    assert_eq!(pod.ping(2), 2);
    assert!(wake.drain().is_empty(), "disarmed: no more wake-ups");
}

#[test]
fn restart_adopts_pins_and_never_attaches_twice() {
    if !privileged("restart_adopts_pins_and_never_attaches_twice") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let cfg = IfaceConfig {
        slot: 3,
        ..IfaceConfig::default()
    };
    let (first_egress_prog, counted_before_restart) = {
        let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
        attach_both(&mut bpf, ifindex);
        // Attaching again under the same name, as a repeated Prepare does, adds nothing.
        attach_both(&mut bpf, ifindex);
        bpf.set_iface(ifindex, cfg).unwrap();
        bpf.reset_counters(3).unwrap();
        assert_eq!(pod.ping(PINGS), PINGS);
        let egress = pod.tcx_programs(TcAttachType::Egress);
        assert_eq!(egress.len(), 1, "{egress:?}");
        (egress[0].0, bpf.counters(3).unwrap())
        // The agent "exits" here: its handles close, the pins stay.
    };

    // Without any agent the programs keep running and counting.
    assert_eq!(pod.tcx_programs(TcAttachType::Egress).len(), 1);
    assert_eq!(pod.tcx_programs(TcAttachType::Ingress).len(), 1);
    assert_eq!(pod.ping(PINGS), PINGS);

    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    // The maps were adopted: same configuration, counters kept (and grown meanwhile).
    assert_eq!(bpf.iface(ifindex).unwrap(), Some(cfg));
    let (to1, from1) = bpf.counters(3).unwrap();
    assert_counted(
        counted_before_restart.0,
        to1,
        PINGS,
        "to the pod, agent down",
    );
    assert_counted(
        counted_before_restart.1,
        from1,
        PINGS,
        "from the pod, agent down",
    );

    attach_both(&mut bpf, ifindex);
    let egress = pod.tcx_programs(TcAttachType::Egress);
    let ingress = pod.tcx_programs(TcAttachType::Ingress);
    assert_eq!(
        egress.len(),
        1,
        "one program per hook after restart: {egress:?}"
    );
    assert_eq!(
        ingress.len(),
        1,
        "one program per hook after restart: {ingress:?}"
    );
    assert_eq!(egress[0].1, "sg_egress");
    assert_eq!(ingress[0].1, "sg_ingress");
    assert_ne!(
        egress[0].0, first_egress_prog,
        "the pinned link now runs the program loaded by the new instance"
    );
    assert!(bpf.is_attached("to-pod", ifindex).unwrap());
    assert!(bpf.is_attached("from-pod", ifindex).unwrap());

    assert_eq!(pod.ping(PINGS), PINGS);
    let (to2, from2) = bpf.counters(3).unwrap();
    assert_counted(to1, to2, PINGS, "to the pod, after restart");
    assert_counted(from1, from2, PINGS, "from the pod, after restart");
}

#[test]
fn detach_removes_the_attachment_and_the_pin() {
    if !privileged("detach_removes_the_attachment_and_the_pin") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    attach_both(&mut bpf, ifindex);
    bpf.set_iface(
        ifindex,
        IfaceConfig {
            slot: 1,
            ..IfaceConfig::default()
        },
    )
    .unwrap();
    assert_eq!(pod.tcx_programs(TcAttachType::Egress).len(), 1);

    bpf.detach("to-pod").unwrap();
    bpf.detach("from-pod").unwrap();
    assert_eq!(pod.tcx_programs(TcAttachType::Egress), vec![]);
    assert_eq!(pod.tcx_programs(TcAttachType::Ingress), vec![]);
    assert!(!pod.pin_dir.join("links/to-pod").exists());
    assert!(!pod.pin_dir.join("links/from-pod").exists());
    assert!(!bpf.is_attached("to-pod", ifindex).unwrap());
    // Idempotent, as a repeated Unprepare needs.
    bpf.detach("to-pod").unwrap();

    // Nothing counts any more although the interface is still configured.
    let before = bpf.counters(1).unwrap();
    assert_eq!(pod.ping(5), 5);
    assert_eq!(bpf.counters(1).unwrap(), before);
}

#[test]
fn a_name_moved_to_another_interface_leaves_the_old_one() {
    if !privileged("a_name_moved_to_another_interface_leaves_the_old_one") {
        return;
    }
    let old = Pod::new();
    let new = Pod::new();
    let mut bpf = Bpf::load(&old.pin_dir).unwrap();
    bpf.attach(old.host_ifindex(), Direction::ToPod, "share")
        .unwrap();
    // The pod sandbox came back with a new veth: same name, new interface.
    bpf.attach(new.host_ifindex(), Direction::ToPod, "share")
        .unwrap();
    assert_eq!(old.tcx_programs(TcAttachType::Egress), vec![]);
    assert_eq!(new.tcx_programs(TcAttachType::Egress).len(), 1);
    assert!(!bpf.is_attached("share", old.host_ifindex()).unwrap());
    assert!(bpf.is_attached("share", new.host_ifindex()).unwrap());
    bpf.detach("share").unwrap();
    assert_eq!(new.tcx_programs(TcAttachType::Egress), vec![]);
}

#[test]
fn a_deleted_interface_is_no_longer_attached() {
    if !privileged("a_deleted_interface_is_no_longer_attached") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    bpf.attach(ifindex, Direction::FromPod, "gone").unwrap();
    assert!(bpf.is_attached("gone", ifindex).unwrap());
    ip(&["link", "del", &pod.host_veth]);
    assert!(!bpf.is_attached("gone", ifindex).unwrap());
    match bpf.attach(ifindex, Direction::FromPod, "gone") {
        Err(BpfError::NoSuchInterface { ifindex: i }) => assert_eq!(i, ifindex),
        other => panic!("attach to a deleted interface: {other:?}"),
    }
    // The failed attach changed nothing; detach removes the dead link's pin.
    assert!(pod.pin_dir.join("links/gone").exists());
    bpf.detach("gone").unwrap();
    assert!(!pod.pin_dir.join("links/gone").exists());
}

/// Traffic from the pod goes round the share's queue loop (host veth ingress -> queue
/// device -> return device -> host veth ingress) and then on, in both attach modes:
/// every request gets its reply, each packet is counted once, and the return device sent
/// each one back.
#[test]
fn from_pod_traffic_goes_round_the_queue_loop_and_back_through_the_hook() {
    if !privileged("from_pod_traffic_goes_round_the_queue_loop_and_back_through_the_hook") {
        return;
    }
    for mode in [AttachMode::Tcx, AttachMode::Clsact] {
        let mut pod = Pod::new();
        let (queue, back) = pod.add_queue_pair();
        let ifindex = pod.host_ifindex();
        let mut bpf = Bpf::load_with_mode(&pod.pin_dir, mode).unwrap();
        attach_both(&mut bpf, ifindex);
        bpf.attach_return(ifindex_of(&back), "return").unwrap();
        let cfg = IfaceConfig {
            slot: 5,
            redirect_ifindex: ifindex_of(&queue),
            ..IfaceConfig::default()
        };
        bpf.set_iface(ifindex, cfg).unwrap();
        bpf.reset_counters(5).unwrap();
        let tx0 = link_stat(&queue, "tx_packets");
        let rx0 = link_stat(&back, "rx_packets");

        // Every reply needs its request to have come round the loop and into the host.
        assert_eq!(pod.ping(PINGS), PINGS, "{mode}");

        let tx = link_stat(&queue, "tx_packets") - tx0;
        let rx = link_stat(&back, "rx_packets") - rx0;
        assert!(
            tx >= PINGS,
            "{mode}: the queue device sent {tx}, the pod sent {PINGS}"
        );
        assert!(
            rx >= PINGS,
            "{mode}: the return device got {rx}, the pod sent {PINGS}"
        );
        let (to, from) = bpf.counters(5).unwrap();
        // Each packet counted once, not again when it comes back to the hook.
        assert!(
            from.packets < 2 * PINGS,
            "{mode}: counted {} from the pod",
            from.packets
        );
        assert_counted(Counters::default(), to, PINGS, "to the pod");
        assert_counted(Counters::default(), from, PINGS, "from the pod");
        bpf.detach("return").unwrap();
    }
}

#[test]
fn clsact_fallback_counts_adopts_and_detaches() {
    if !privileged("clsact_fallback_counts_adopts_and_detaches") {
        return;
    }
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let cfg = IfaceConfig {
        slot: 9,
        ..IfaceConfig::default()
    };
    {
        let mut bpf = Bpf::load_with_mode(&pod.pin_dir, AttachMode::Clsact).unwrap();
        attach_both(&mut bpf, ifindex);
        bpf.set_iface(ifindex, cfg).unwrap();
        bpf.reset_counters(9).unwrap();
        assert!(bpf.is_attached("to-pod", ifindex).unwrap());
    }
    // The filters outlive the instance that installed them.
    assert!(pod.tc_filters("egress").contains("sg_egress"));
    assert!(pod.tc_filters("ingress").contains("sg_ingress"));

    let mut bpf = Bpf::load_with_mode(&pod.pin_dir, AttachMode::Clsact).unwrap();
    attach_both(&mut bpf, ifindex);
    for (hook, program) in [("egress", "sg_egress"), ("ingress", "sg_ingress")] {
        let filters = pod.tc_filters(hook);
        assert_eq!(
            filters
                .lines()
                .filter(|line| line.contains(program))
                .count(),
            1,
            "one filter on {hook} after re-attaching: {filters}"
        );
    }
    assert_eq!(pod.ping(PINGS), PINGS);
    let (to, from) = bpf.counters(9).unwrap();
    assert_counted(Counters::default(), to, PINGS, "to the pod");
    assert_counted(Counters::default(), from, PINGS, "from the pod");
    assert!(pod.tcx_programs(TcAttachType::Egress).is_empty());

    bpf.detach("to-pod").unwrap();
    bpf.detach("from-pod").unwrap();
    assert!(!pod.tc_filters("egress").contains("sg_egress"));
    assert!(!pod.tc_filters("ingress").contains("sg_ingress"));
    assert!(!pod.pin_dir.join("links/to-pod").exists());
    assert!(!bpf.is_attached("to-pod", ifindex).unwrap());
}

#[test]
fn invalid_requests_are_refused() {
    if !privileged("invalid_requests_are_refused") {
        return;
    }
    let pod = Pod::new();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    for name in ["", ".", "..", "a/b"] {
        assert!(
            matches!(
                bpf.attach(pod.host_ifindex(), Direction::ToPod, name),
                Err(BpfError::InvalidName { .. })
            ),
            "name {name:?}"
        );
    }
    let too_far = IfaceConfig {
        slot: shareguard_limiter_net::bpf::MAX_SLOTS,
        ..IfaceConfig::default()
    };
    assert!(matches!(
        bpf.set_iface(pod.host_ifindex(), too_far),
        Err(BpfError::SlotOutOfRange { .. })
    ));
    assert!(matches!(
        bpf.counters(u32::MAX),
        Err(BpfError::SlotOutOfRange { .. })
    ));
    // EDT asked for with no rate to pace at.
    let flagged = IfaceConfig {
        flags: shareguard_ebpf_common::FLAG_EDT_TO_POD,
        ..IfaceConfig::default()
    };
    assert!(matches!(
        bpf.set_iface(pod.host_ifindex(), flagged),
        Err(BpfError::InvalidFlags { .. })
    ));
}

#[test]
fn a_pin_dir_outside_bpffs_is_refused() {
    // No root needed: the check comes before anything touches the kernel's BPF side.
    let dir = std::env::temp_dir().join(format!("shareguard-not-bpffs-{}", std::process::id()));
    let result = Bpf::load(&dir);
    let _ = fs::remove_dir_all(&dir);
    match result {
        Err(BpfError::NotBpfFs { path }) => assert_eq!(path, dir),
        other => panic!("pin dir on {}: {other:?}", dir.display()),
    }
}

/// CLOCK_MONOTONIC in ns, the clock of `bpf_ktime_get_ns` and of the pacing state.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the call only writes it.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    let non_negative = "CLOCK_MONOTONIC is never negative";
    u64::try_from(ts.tv_sec).expect(non_negative) * 1_000_000_000
        + u64::try_from(ts.tv_nsec).expect(non_negative)
}

/// The policer and EDT code paths run in the kernel's programs (this machine has no
/// sch_fq, so EDT's departure times are not honoured here, but its horizon drops are): a
/// rate of ten pings a second, offered a hundred a second, lets few through and drops
/// and counts the rest, in the direction configured and only there.
#[test]
fn policer_and_edt_horizon_drop_what_exceeds_the_rate() {
    use shareguard_ebpf_common::{FLAG_EDT_TO_POD, FLAG_POLICE_FROM_POD, Pace};
    if !privileged("policer_and_edt_horizon_drop_what_exceeds_the_rate") {
        return;
    }
    const SENT: u64 = 50;
    // Ten echo frames a second, and 100 ms of slack: one frame's worth.
    let slow = Pace {
        bytes_per_sec: PING_FRAME * 10,
        slack_ns: 100_000_000,
    };
    let pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let mut bpf = Bpf::load(&pod.pin_dir).unwrap();
    attach_both(&mut bpf, ifindex);

    for (flags, name) in [
        (FLAG_POLICE_FROM_POD, "policer, from the pod"),
        (FLAG_EDT_TO_POD, "EDT horizon, to the pod"),
    ] {
        let slot = 12;
        bpf.reset_counters(slot).unwrap();
        let cfg = IfaceConfig {
            slot,
            flags,
            to_pod: slow,
            from_pod: slow,
            ..IfaceConfig::default()
        };
        bpf.set_iface(ifindex, cfg).unwrap();
        let started = monotonic_ns();
        // 100 per second for half a second: five times the rate.
        let replies = pod.ping(SENT);
        let ended = monotonic_ns();
        let (to, from) = bpf.counters(slot).unwrap();
        let (to_state, from_state) = bpf.pace_state(slot).unwrap();
        let (limited, other, state, other_state) = if flags == FLAG_POLICE_FROM_POD {
            (from, to, from_state, to_state)
        } else {
            (to, from, to_state, from_state)
        };
        // Half a second at ten a second plus the slack: about six; never most of them.
        assert!(
            (2..=12).contains(&limited.packets),
            "{name}: {} of {SENT} let through",
            limited.packets
        );
        eprintln!("{name}: {replies} replies, limited {limited:?}, other {other:?}");
        // ARP and IPv6 neighbour discovery may add a few packets in either direction.
        assert!(
            replies <= limited.packets && replies + 4 >= limited.packets,
            "{name}: {replies} replies, {} let through",
            limited.packets
        );
        assert!(
            (SENT..=SENT + 4).contains(&(limited.packets + limited.drops)),
            "{name}: every packet counted once, as passed or dropped: {limited:?}"
        );
        assert_eq!(other.drops, 0, "{name}: the other direction is not limited");
        assert_eq!(other_state.t_last_ns, 0, "{name}: and keeps no state");
        // The state is a time on the programs' clock, within the run plus what was let
        // through (each frame moves it 100 ms on).
        assert!(
            state.t_last_ns >= started && state.t_last_ns <= ended + 13 * 100_000_000,
            "{name}: state {} outside {started}..{ended}",
            state.t_last_ns
        );
    }
    bpf.clear_iface(ifindex).unwrap();
    assert_eq!(pod.ping(5), 5, "unconfigured: nothing is dropped");
}

/// A root qdisc is read for its interface alone (the kernel's qdisc dump ignores the
/// interface it is given and returns every interface's): each of two interfaces reads
/// as what was installed on it, one with none as none, and one deleted as none.
#[test]
fn the_root_qdisc_is_read_for_one_interface_alone() {
    use shareguard_limiter_net::rtnl::root_qdisc;
    if !privileged("the_root_qdisc_is_read_for_one_interface_alone") {
        return;
    }
    let (a, b) = (Pod::new(), Pod::new());
    let (ia, ib) = (a.host_ifindex(), b.host_ifindex());
    let before = root_qdisc(ia).unwrap();
    assert!(
        before.as_ref().is_none_or(|q| q.major == 0),
        "a veth as created has no root qdisc of its own: {before:?}"
    );
    run(
        "tc",
        &[
            "qdisc",
            "add",
            "dev",
            &a.host_veth,
            "root",
            "handle",
            "1:",
            "htb",
        ],
    );
    run(
        "tc",
        &[
            "qdisc",
            "add",
            "dev",
            &b.host_veth,
            "root",
            "handle",
            "7:",
            "tbf",
            "rate",
            "1mbit",
            "burst",
            "10k",
            "latency",
            "10ms",
        ],
    );
    let qa = root_qdisc(ia).unwrap().expect("a's root");
    let qb = root_qdisc(ib).unwrap().expect("b's root");
    assert_eq!((qa.kind.as_str(), qa.major), ("htb", 1), "{qa:?}");
    assert_eq!((qb.kind.as_str(), qb.major), ("tbf", 7), "{qb:?}");
    drop(a);
    assert_eq!(root_qdisc(ia).unwrap(), None, "a deleted interface");
    assert_eq!(root_qdisc(ib).unwrap().map(|q| q.major), Some(7));
}

/// A CNI's filter on a clsact hook of the pod's host veth: priority 1 (where CNIs put
/// theirs), passing every packet, which ends classification as a CNI's does when it
/// passes a packet. Its action mirrors each packet to `sink`, which counts them.
fn add_cni_filter(veth: &str, hook: &str, sink: &str) {
    let head = format!("filter add dev {veth} {hook} protocol all prio 1 handle 1 bpf bytecode");
    let action = format!("action mirred egress mirror dev {sink} pass");
    let mut args: Vec<&str> = head.split_whitespace().collect();
    // Classic BPF: return a match for every packet.
    args.push("1,6 0 0 4294967295,");
    args.extend(action.split_whitespace());
    run("tc", &args);
}

/// Packets the CNI filter's action saw on `hook` of `veth`.
fn cni_filter_packets(veth: &str, hook: &str) -> u64 {
    let json = run("tc", &["-s", "-j", "filter", "show", "dev", veth, hook]);
    let filters: serde_json::Value = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("tc -j filter show gave no JSON: {e}: {json}"));
    filters
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["options"]["handle"] == "0x1")
        .flat_map(|f| {
            f["options"]["actions"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|a| a["stats"]["packets"].as_u64())
        .sum()
}

/// On clsact (kernels before 6.6) ours runs before a CNI's filter of the same priority,
/// and the CNI's still sees every packet of the pod after ours; when the CNI adds its
/// filter again, in front of ours, the position check says so, and attaching again puts
/// ours first, with one filter of ours on the hook.
#[test]
fn clsact_ours_runs_before_a_cni_filter_and_is_put_first_again() {
    if !privileged("clsact_ours_runs_before_a_cni_filter_and_is_put_first_again") {
        return;
    }
    let mut pod = Pod::new();
    let ifindex = pod.host_ifindex();
    let veth = pod.host_veth.clone();
    // Where the CNI filter's action mirrors what it saw (made here, removed with the pod).
    let (sink, _) = pod.add_queue_pair();
    run("tc", &["qdisc", "add", "dev", &veth, "clsact"]);
    add_cni_filter(&veth, "ingress", &sink);

    let mut bpf = Bpf::load_with_mode(&pod.pin_dir, AttachMode::Clsact).unwrap();
    attach_both(&mut bpf, ifindex);
    let cfg = IfaceConfig {
        slot: 11,
        ..IfaceConfig::default()
    };
    bpf.set_iface(ifindex, cfg).unwrap();
    let first = |bpf: &Bpf| {
        bpf.ahead_of("from-pod", ifindex, Direction::FromPod)
            .unwrap()
    };
    assert_eq!(first(&bpf), None, "{}", pod.tc_filters("ingress"));

    bpf.reset_counters(11).unwrap();
    let seen = cni_filter_packets(&veth, "ingress");
    assert_eq!(pod.ping(PINGS), PINGS);
    let (_, from) = bpf.counters(11).unwrap();
    assert_counted(
        Counters::default(),
        from,
        PINGS,
        "ours, in front of the CNI's",
    );
    let cni = cni_filter_packets(&veth, "ingress") - seen;
    assert!(
        cni >= PINGS,
        "the CNI's filter saw {cni} of the pod's {PINGS} packets behind ours"
    );

    // The CNI adds its filter again (as on a restart of its agent): the last added runs
    // first, so ours is behind it and sees nothing.
    let del = format!("filter del dev {veth} ingress protocol all prio 1 handle 1 bpf");
    run("tc", &del.split_whitespace().collect::<Vec<_>>());
    add_cni_filter(&veth, "ingress", &sink);
    assert_eq!(first(&bpf), Some(1), "{}", pod.tc_filters("ingress"));
    bpf.reset_counters(11).unwrap();
    assert_eq!(pod.ping(PINGS), PINGS);
    let (_, from) = bpf.counters(11).unwrap();
    assert_eq!(
        from.packets, 0,
        "ours behind a filter that ends classification"
    );

    bpf.attach(ifindex, Direction::FromPod, "from-pod").unwrap();
    assert_eq!(first(&bpf), None, "{}", pod.tc_filters("ingress"));
    let filters = pod.tc_filters("ingress");
    assert_eq!(
        filters.lines().filter(|l| l.contains("sg_ingress")).count(),
        1,
        "one filter of ours: {filters}"
    );
    bpf.reset_counters(11).unwrap();
    let seen = cni_filter_packets(&veth, "ingress");
    assert_eq!(pod.ping(PINGS), PINGS);
    let (_, from) = bpf.counters(11).unwrap();
    assert_counted(Counters::default(), from, PINGS, "ours, first again");
    assert!(cni_filter_packets(&veth, "ingress") - seen >= PINGS);
    bpf.detach("to-pod").unwrap();
    bpf.detach("from-pod").unwrap();
}
