//! Network harness for tests with real traffic: network namespaces, veth pairs, ifb
//! devices, qdiscs and iperf3/ping, each behind a guard that removes what it made when it
//! drops, also when the test panics.
//!
//! Rules the harness keeps:
//!
//! - Traffic stays inside namespaces and veth pairs it created: every address comes from
//!   198.18.0.0/15 (RFC 2544 benchmarking space) and every measurement targets a [`Pod`].
//! - Names are unique per process (pid) and per object (an atomic counter), so tests run in
//!   parallel, and in parallel with other test processes. Interface names stay within
//!   the kernel's 15 characters.
//! - Nothing sleeps in place of waiting: readiness (link up, iperf3 listening) is polled
//!   with a deadline.
//! - Throughput measurements take [`TrafficLock`] so that two of them never share the CPU
//!   (veth throughput is CPU-bound).
//!
//! Tests that need it call [`privileged`] first: without root it skips with a message,
//! unless `CI=true`, where it fails.
//!
//! A test process killed before its guards run (SIGKILL, Ctrl-C) leaves its objects
//! behind; the next process to make one removes them ([`sweep_stale`]).
//!
//! External tools: `ip` and `tc` (iproute2), `iperf3`, `ping` (iputils-ping).

// `new()` creates kernel objects (namespaces, links); a `Default` would hide that.
#![allow(clippy::new_without_default)]

use std::{
    fmt, fs,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

pub use crate::{
    locks::{BusyLock, FileLock, HostLock, TrafficLock},
    shell::{
        in_ci, is_root, link_exists, netns_list, privileged, require_tools, sh, try_sh, wait_for,
    },
    stale::{sweep_stale, sweep_stale_now},
};
use crate::{
    shell::quiet,
    stale::{self, next_id, remove_netns},
};

/// Measured seconds of a default [`Iperf`] run (after [`DEFAULT_OMIT`]).
pub const DEFAULT_SECONDS: u32 = 5;
/// Warm-up seconds iperf3 runs first and leaves out of its totals (`-O`). iperf3 runs the
/// omitted seconds *in addition* to `-t`: `-t 5 -O 1` lasts 6 s and reports the last 5.
pub const DEFAULT_OMIT: u32 = 1;

/// Lowest TCP goodput through a shaped share the tests accept, as a fraction of its L2
/// limit. A perfect shaper of Ethernet frames gives 1448/1514 = 0.956; `htb-ebpf` with
/// its 10 ms bucket measured 0.947 to 0.957 in 48 measurements of two runs of the
/// traffic tests, and never below 0.942 in the bandwidth benchmark and the tuning runs,
/// also with two busy loops on the two cores (docs/benchmarks.md, "Accuracy in the
/// tests"; docs/htb-tuning.md).
pub const GOODPUT_LOW: f64 = 0.93;
/// Highest: a shaper that lets 1.5% more through than the limit fails. Nothing measured
/// above 0.957; the measurement's own error (iperf3's interval against the sender's, one
/// 10 ms bucket over 5 s) is a few tenths of a percent.
pub const GOODPUT_HIGH: f64 = 0.97;

/// The first address of the range the harness uses, 198.18.0.0/15.
const BASE: u32 = u32::from_be_bytes([198, 18, 0, 0]);
/// Number of /30 blocks in 198.18.0.0/15.
const BLOCKS: u32 = 1 << 15;
/// How long a link or a server may take to come up.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Lock file that serialises address allocation between processes.
const ADDR_LOCK: &str = "/tmp/shareguard-tests-net-addr.lock";
/// A rate from a benchmark's list ("50M", "2G"), in bits per second, read as the agent
/// reads a quantity. Panics, naming it, on a rate that is not a whole, positive number
/// of bits per second.
pub fn rate_bps(rate: &str) -> u64 {
    shareguard_common::Quantity::parse_non_negative(rate)
        .ok()
        .filter(|q| !q.is_zero() && q.nanos() % 1_000_000_000 == 0)
        .and_then(|q| q.ceil_units())
        .and_then(|u| u64::try_from(u).ok())
        .unwrap_or_else(|| panic!("rate {rate:?}: not a whole, positive number of bit/s"))
}

/// A private bpffs directory for one agent's pins, removed (and with it every link the
/// agent pinned, so no program stays attached) when dropped, also on panic.
pub struct PinDir(pub PathBuf);

impl PinDir {
    pub fn new() -> PinDir {
        PinDir(PathBuf::from(format!(
            "{}/{}{}-{}",
            stale::BPFFS,
            stale::PIN_PREFIX,
            std::process::id(),
            next_id()
        )))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A `net` device table for the agent's config, with `lines` in it (a mechanism, the
/// capacities).
pub fn net_device(name: &str, lines: &str) -> String {
    let (driver, pool) = (crate::DRIVER, crate::POOL);
    format!(
        r#"
[[device]]
name = "{name}"
driver = "{driver}"
pool = "{pool}"
kind = "net"
allowed_namespaces = ["*"]
{lines}
"#
    )
}

/// A symmetric `bandwidth` capacity of `value`, allocated in 10M steps from 10M.
pub fn bandwidth_capacity(value: &str) -> String {
    format!(
        "[device.capacity.bandwidth]\nvalue = \"{value}\"\ndefault = \"10M\"\n\
         valid_range = {{ min = \"10M\", max = \"{value}\", step = \"10M\" }}\n"
    )
}

/// The agent on `devices`, its pins under `pins`, with `extra` lines for `[agent]`.
pub fn start_agent(devices: String, pins: &PinDir, extra: &str) -> crate::Agent {
    let mut o = crate::Options::new(devices);
    o.agent_extra = format!("bpffs_dir = {:?}\n{extra}", pins.0);
    crate::Agent::start(o)
}

/// A claim `uid` in `namespace` for one `bandwidth` share `id` of `rate` on `device`,
/// for `pod`.
pub fn bw_claim(
    uid: &str,
    namespace: &str,
    device: &str,
    pod: &Pod,
    id: &str,
    rate: &str,
) -> crate::proto::ClaimPrepare {
    bw_claim_for(uid, namespace, device, pod.uid(), id, rate)
}

/// [`bw_claim`] for the pod with uid `pod_uid`, which need not exist yet: the pod's uid
/// is all kubelet's plugin knows, and the agent finds the sandbox itself.
pub fn bw_claim_for(
    uid: &str,
    namespace: &str,
    device: &str,
    pod_uid: &str,
    id: &str,
    rate: &str,
) -> crate::proto::ClaimPrepare {
    let mut c = crate::claim(
        uid,
        namespace,
        "a1",
        vec![crate::proto::DeviceAllocation {
            request: "bw".into(),
            driver: crate::DRIVER.into(),
            pool: crate::POOL.into(),
            device: device.into(),
            share_id: id.into(),
            consumed_capacity: [("bandwidth".to_owned(), rate.to_owned())].into(),
            ..Default::default()
        }],
    );
    c.target = Some(crate::proto::PodTarget {
        pod_uids: vec![pod_uid.to_owned()],
        ..Default::default()
    });
    c
}

/// A veth pair `host` <-> `eth0` in namespace `ns`, without IPv6 on the host end (no
/// router solicitations or MLD reports in the figures).
fn add_veth(host: &str, ns: &str) {
    sh(&[
        "ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]);
    let _ = fs::write(format!("/proc/sys/net/ipv6/conf/{host}/disable_ipv6"), "1");
}

/// A veth pair from the root namespace into a new namespace of its own, both ends up and
/// without addresses: (the namespace, whose end is `eth0`; the host end). A second way
/// into a pod for the tests to wire with BPF redirects, as a CNI's host routing is.
pub fn veth_to_new_netns() -> (Netns, Link) {
    let netns = Netns::new();
    let link = Link {
        name: ifname("sgn", next_id()),
    };
    add_veth(link.name(), netns.name());
    sh(&["ip", "-n", netns.name(), "link", "set", "lo", "up"]);
    sh(&["ip", "-n", netns.name(), "link", "set", "eth0", "up"]);
    sh(&["ip", "link", "set", link.name(), "up"]);
    (netns, link)
}

/// The MAC address of `dev` in the namespace `ns` (None: the root namespace).
pub fn mac(ns: Option<&Netns>, dev: &str) -> String {
    let out = match ns {
        Some(ns) => ns.sh(&["cat", &format!("/sys/class/net/{dev}/address")]),
        None => fs::read_to_string(format!("/sys/class/net/{dev}/address"))
            .unwrap_or_else(|e| panic!("the address of {dev}: {e}")),
    };
    out.trim().to_owned()
}

/// [`add_veth`] with the host end at ifindex `index` or the first free one above it.
fn add_veth_at(host: &str, ns: &str, index: u32) {
    for i in index..index + 1000 {
        let idx = i.to_string();
        if try_sh(&[
            "ip", "link", "add", host, "index", &idx, "type", "veth", "peer", "name", "eth0",
            "netns", ns,
        ])
        .is_ok()
        {
            let _ = fs::write(format!("/proc/sys/net/ipv6/conf/{host}/disable_ipv6"), "1");
            return;
        }
    }
    panic!("no free ifindex in {index}..{}", index + 1000);
}

fn add_host_addr(host: &str, addr: Ipv4Addr) {
    sh(&["ip", "addr", "add", &format!("{addr}/30"), "dev", host]);
}

/// Gives the pod end its address, brings both ends up, waits until the host end is up
/// and returns its ifindex.
fn bring_up(host: &str, ns: &str, pod_addr: Ipv4Addr) -> u32 {
    sh(&[
        "ip",
        "-n",
        ns,
        "addr",
        "add",
        &format!("{pod_addr}/30"),
        "dev",
        "eth0",
    ]);
    sh(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
    sh(&["ip", "link", "set", host, "up"]);
    let oper = format!("/sys/class/net/{host}/operstate");
    wait_for(&format!("{host} to be up"), READY_TIMEOUT, || {
        fs::read_to_string(&oper).is_ok_and(|s| s.trim() == "up")
    });
    ifindex(host)
}

/// A unique interface name: `<prefix><pid>_<n>`, checked against IFNAMSIZ.
fn ifname(prefix: &str, n: u32) -> String {
    let name = format!("{prefix}{}_{n}", std::process::id());
    assert!(
        name.len() <= 15,
        "interface name {name} is longer than 15 characters"
    );
    name
}

/// The 1, 5 and 15 minute load averages, to print beside throughput figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadAvg(pub f64, pub f64, pub f64);

impl LoadAvg {
    pub fn now() -> LoadAvg {
        let s = fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let mut v = s
            .split_whitespace()
            .take(3)
            .map(|x| x.parse().unwrap_or(f64::NAN));
        LoadAvg(
            v.next().unwrap_or(f64::NAN),
            v.next().unwrap_or(f64::NAN),
            v.next().unwrap_or(f64::NAN),
        )
    }
}

impl fmt::Display for LoadAvg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.2} {:.2} {:.2}", self.0, self.1, self.2)
    }
}

/// The sysfs byte counter of what a pod's traffic in `dir` carried past its shaper: to
/// the pod, what the host end `host_if` sent it (after a shaper on that end); from the
/// pod, what left share `share_id`'s queue device, or else what left `ifb` (a shaper of
/// the test's own on one), or else what the host end took in.
pub fn shaped_bytes_counter(
    dir: Direction,
    host_if: &str,
    share_id: Option<&str>,
    ifb: Option<&str>,
) -> String {
    let (dev, which) = match (dir, share_id, ifb) {
        (Direction::ToPod, _, _) => (host_if.to_owned(), "tx_bytes"),
        (Direction::FromPod, Some(id), _) => {
            let queue = shareguard_limiter_net::state::queue_name(id);
            assert!(
                fs::metadata(format!("/sys/class/net/{queue}")).is_ok(),
                "share {id} has no queue device {queue}: what leaves the share's shaper is read there"
            );
            (queue, "tx_bytes")
        }
        (Direction::FromPod, None, Some(ifb)) => (ifb.to_owned(), "tx_bytes"),
        (Direction::FromPod, None, None) => (host_if.to_owned(), "rx_bytes"),
    };
    let path = format!("/sys/class/net/{dev}/statistics/{which}");
    assert!(fs::metadata(&path).is_ok(), "{path}: no such counter");
    path
}

/// The value of a sysfs counter such as [`shaped_bytes_counter`]'s.
pub fn read_counter(path: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("{path}: no counter"))
}

/// User plus system CPU time (all threads, also those that ended) process `pid` has used
/// so far, in clock ticks, from `/proc/PID/stat`; None once the process is gone.
pub fn process_cpu_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: count from its closing parenthesis,
    // after which field 3 comes first, so utime and stime (14 and 15) are the 12th and
    // 13th.
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let utime: u64 = rest.next()?.parse().ok()?;
    let stime: u64 = rest.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Clock ticks a second (`getconf CLK_TCK`): the unit of /proc's CPU times.
pub fn clock_ticks() -> f64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .unwrap_or_else(|e| panic!("getconf CLK_TCK: {e}"));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("getconf CLK_TCK: {e}"))
}

/// Jiffies of all CPUs together, from the `cpu` line of /proc/stat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuJiffies {
    /// All but idle and iowait.
    pub busy: u64,
    pub all: u64,
    pub softirq: u64,
}

impl CpuJiffies {
    pub fn now() -> CpuJiffies {
        let stat = fs::read_to_string("/proc/stat").unwrap_or_else(|e| panic!("/proc/stat: {e}"));
        let v: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        assert!(v.len() >= 8, "/proc/stat's cpu line: {v:?}");
        // user nice system idle iowait irq softirq steal
        let all: u64 = v.iter().take(8).sum();
        CpuJiffies {
            busy: all - v[3] - v[4],
            all,
            softirq: v[6],
        }
    }
}

// ---------------------------------------------------------------------------------------
// Namespaces and links

/// A network namespace (`ip netns add`), deleted on drop after killing any process still
/// in it (processes the test started there: the name is unique).
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// A new namespace named `sgt-<pid>-<n>`.
    pub fn new() -> Netns {
        sweep_stale();
        let name = format!("sgt-{}-{}", std::process::id(), next_id());
        sh(&["ip", "netns", "add", &name]);
        Netns { name }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, the path a CRI hands to CNI plugins.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`, which execs:
    /// the child's pid is the program's).
    pub fn exec(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `args` inside the namespace; panics if it fails.
    pub fn sh(&self, args: &[&str]) -> String {
        let mut all = vec!["ip", "netns", "exec", &self.name];
        all.extend_from_slice(args);
        sh(&all)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        remove_netns(&self.name);
    }
}

/// A link in the root namespace, deleted on drop (`ip link del`; deleting one end of a
/// veth pair deletes both).
#[derive(Debug)]
pub struct Link {
    name: String,
}

impl Link {
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        quiet(&["ip", "link", "del", &self.name]);
    }
}

/// An ifb device in the root namespace, up, deleted on drop.
#[derive(Debug)]
pub struct Ifb {
    link: Link,
}

impl Ifb {
    /// A new ifb named `sgi<pid>_<n>`.
    pub fn new() -> Ifb {
        sweep_stale();
        let name = ifname("sgi", next_id());
        sh(&["ip", "link", "add", &name, "type", "ifb"]);
        let link = Link { name };
        sh(&["ip", "link", "set", link.name(), "up"]);
        Ifb { link }
    }

    pub fn name(&self) -> &str {
        self.link.name()
    }

    pub fn ifindex(&self) -> u32 {
        ifindex(self.name())
    }
}

/// The ifindex of an interface in the root namespace.
pub fn ifindex(name: &str) -> u32 {
    let p = format!("/sys/class/net/{name}/ifindex");
    fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{p}: {e}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// A pod as the agent sees one: a network namespace and a veth pair whose host end
/// (`sgh<pid>_<n>`) stays in the root namespace and whose other end is `eth0` in the pod's
/// namespace. Dropping it deletes the link, then the namespace.
///
/// Addresses: each pod gets one /30 block out of 198.18.0.0/15 (32768 blocks): the host
/// end has `base+1/30`, the pod `base+2/30`. The search for a free block starts at a block
/// derived from the pid and the counter and takes the first one that no address in the
/// root namespace overlaps; it runs under an exclusive file lock
/// (`/tmp/shareguard-tests-net-addr.lock`) that also covers assigning the host address,
/// so parallel tests in one process and in other processes never pick the same block.
#[derive(Debug)]
pub struct Pod {
    // Field order is drop order: the sandbox (its process and cgroups), the link, then
    // the namespace.
    sandbox: Option<crate::pod::Sandbox>,
    link: Link,
    netns: Netns,
    uid: String,
    host_addr: Ipv4Addr,
    pod_addr: Ipv4Addr,
    ifindex: u32,
    /// Last: released once everything of the pod is gone.
    _host: HostLock,
}

impl Pod {
    /// A pod with a fresh uid, its sandbox in the systemd driver's layout.
    pub fn new() -> Pod {
        Pod::with(&crate::pod::pod_uid(), crate::pod::Layout::Systemd)
    }

    /// Pod `uid` with its sandbox (cgroup and process in the namespace) in `layout`.
    pub fn with(uid: &str, layout: crate::pod::Layout) -> Pod {
        let mut p = Pod::network_only(uid);
        p.sandbox = Some(crate::pod::Sandbox::start(
            uid,
            layout,
            Some(p.netns.name()),
        ));
        p
    }

    /// Pod `uid`'s network (namespace, veth, addresses) without a sandbox process: what
    /// CNI has set up before the runtime starts the sandbox.
    pub fn network_only(uid: &str) -> Pod {
        Pod::network_at(uid, None)
    }

    /// Pod `uid` whose host-side veth has an ifindex of at least `index` (a busy node's
    /// ifindexes grow with every veth and ifb it ever made), with its sandbox.
    pub fn with_host_index(uid: &str, index: u32, layout: crate::pod::Layout) -> Pod {
        let mut p = Pod::network_at(uid, Some(index));
        p.start_sandbox(layout);
        p
    }

    fn network_at(uid: &str, index: Option<u32>) -> Pod {
        let host_lock = HostLock::shared();
        let netns = Netns::new();
        let n = next_id();
        let host = ifname("sgh", n);
        match index {
            Some(i) => add_veth_at(&host, netns.name(), i),
            None => add_veth(&host, netns.name()),
        }
        let link = Link { name: host };
        let (host_addr, pod_addr) = {
            let _lock = FileLock::acquire(ADDR_LOCK);
            let block =
                free_block(std::process::id().wrapping_mul(2654435761) ^ n.wrapping_mul(40503));
            let base = BASE + block * 4;
            let host_addr = Ipv4Addr::from(base + 1);
            add_host_addr(link.name(), host_addr);
            (host_addr, Ipv4Addr::from(base + 2))
        };
        sh(&["ip", "-n", netns.name(), "link", "set", "lo", "up"]);
        let ifindex = bring_up(link.name(), netns.name(), pod_addr);
        Pod {
            sandbox: None,
            link,
            netns,
            uid: uid.to_owned(),
            host_addr,
            pod_addr,
            ifindex,
            _host: host_lock,
        }
    }

    /// Deletes the veth pair and creates it again with the same names and addresses, as
    /// a CNI plugin does when it sets a sandbox's network up again: the host end gets a
    /// new ifindex, and everything installed on the old one is gone with it.
    pub fn recreate_link(&mut self) {
        let host = self.link.name().to_owned();
        let ns = self.netns.name().to_owned();
        sh(&["ip", "link", "del", &host]);
        add_veth(&host, &ns);
        add_host_addr(&host, self.host_addr);
        self.ifindex = bring_up(&host, &ns, self.pod_addr);
    }

    /// The pod's uid.
    pub fn uid(&self) -> &str {
        &self.uid
    }

    pub fn sandbox_mut(&mut self) -> Option<&mut crate::pod::Sandbox> {
        self.sandbox.as_mut()
    }

    /// The pod's sandbox (cgroup and process), if it has one.
    pub fn sandbox(&self) -> Option<&crate::pod::Sandbox> {
        self.sandbox.as_ref()
    }

    /// Starts the pod's sandbox now (see [`Pod::network_only`]).
    pub fn start_sandbox(&mut self, layout: crate::pod::Layout) {
        self.sandbox = Some(crate::pod::Sandbox::start(
            &self.uid,
            layout,
            Some(self.netns.name()),
        ));
    }

    /// The host end of the veth pair, in the root namespace.
    pub fn host_if(&self) -> &str {
        self.link.name()
    }

    /// The ifindex of the host end.
    pub fn host_ifindex(&self) -> u32 {
        self.ifindex
    }

    /// The interface name inside the pod's namespace.
    pub fn pod_if(&self) -> &str {
        "eth0"
    }

    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    pub fn netns_name(&self) -> &str {
        self.netns.name()
    }

    /// `/run/netns/<name>`.
    pub fn netns_path(&self) -> PathBuf {
        self.netns.path()
    }

    pub fn host_addr(&self) -> Ipv4Addr {
        self.host_addr
    }

    pub fn pod_addr(&self) -> Ipv4Addr {
        self.pod_addr
    }

    /// Sets `gso_max_size` on both ends of the veth pair: the largest GSO packet a TCP
    /// sender on either side builds for this path, hence the largest packet a shaper on
    /// it queues (65536 is the default).
    pub fn set_gso_max_size(&self, bytes: u32) {
        let b = bytes.to_string();
        sh(&[
            "ip",
            "link",
            "set",
            "dev",
            self.host_if(),
            "gso_max_size",
            &b,
        ]);
        sh(&[
            "ip",
            "-n",
            self.netns_name(),
            "link",
            "set",
            "dev",
            "eth0",
            "gso_max_size",
            &b,
        ]);
    }

    /// Starts an iperf3 server in the pod, bound to the pod's address.
    pub fn iperf_server(&self) -> IperfServer {
        IperfServer::start(self)
    }
}

/// The first /30 block, searching from `start`, that no IPv4 address in the root
/// namespace overlaps. Call under the address lock.
fn free_block(start: u32) -> u32 {
    let mut used = vec![false; BLOCKS as usize];
    used[0] = true; // 198.18.0.0/30: keep the network address of the range out.
    for line in sh(&["ip", "-o", "-4", "addr", "show"]).lines() {
        let mut words = line.split_whitespace();
        let Some(cidr) = words.find(|w| *w == "inet").and_then(|_| words.next()) else {
            continue;
        };
        let Some((addr, len)) = cidr.split_once('/') else {
            continue;
        };
        let (Ok(addr), Ok(len)) = (addr.parse::<Ipv4Addr>(), len.parse::<u32>()) else {
            continue;
        };
        let len = len.min(30);
        let size = 1u64 << (32 - len);
        let first = u64::from(u32::from(addr)) & !(size - 1);
        for a in (first..first + size).step_by(4) {
            if let Some(off) = a.checked_sub(u64::from(BASE))
                && off < u64::from(BLOCKS) * 4
            {
                used[(off / 4) as usize] = true;
            }
        }
    }
    (0..BLOCKS)
        .map(|i| (start.wrapping_add(i)) % BLOCKS)
        .find(|b| !used[*b as usize])
        .unwrap_or_else(|| panic!("no free /30 left in 198.18.0.0/15"))
}

// ---------------------------------------------------------------------------------------
// Qdiscs

/// A qdisc installed by the test, deleted on drop: `tc qdisc del dev <dev> <parent>`
/// where parent is `root`, `clsact` or `ingress`.
#[derive(Debug)]
pub struct Qdisc {
    dev: String,
    parent: &'static str,
}

impl Qdisc {
    /// Takes ownership of a qdisc already installed on `dev` at `parent`.
    pub fn adopt(dev: &str, parent: &'static str) -> Qdisc {
        Qdisc {
            dev: dev.to_owned(),
            parent,
        }
    }

    pub fn dev(&self) -> &str {
        &self.dev
    }
}

impl Drop for Qdisc {
    fn drop(&mut self) {
        quiet(&["tc", "qdisc", "del", "dev", &self.dev, self.parent]);
    }
}

/// The burst containerd hands the CNI bandwidth plugin for a pod's
/// `kubernetes.io/{ingress,egress}-bandwidth` annotation: `math.MaxUint32` *bits*
/// (CRI-O passes 4 GB), i.e. about 512 MiB, so in practice the first seconds are unshaped.
pub const CONTAINERD_TBF_BURST_BYTES: u64 = u32::MAX as u64 / 8;

/// A `tbf` at the root of `dev` configured as the CNI bandwidth plugin does it: `rate`,
/// `burst`, and a queue limit of 25 ms at the rate plus the burst (`tc ... tbf rate R
/// burst B latency 25ms` computes exactly the plugin's `limit = rate * 25ms + burst`).
/// The plugin takes the burst in bits; this takes bytes.
pub fn tbf(dev: &str, rate_bps: u64, burst_bytes: u64) -> Qdisc {
    let guard = Qdisc::adopt(dev, "root");
    sh(&[
        "tc",
        "qdisc",
        "replace",
        "dev",
        dev,
        "root",
        "handle",
        "1:",
        "tbf",
        "rate",
        &format!("{rate_bps}bit"),
        "burst",
        &burst_bytes.to_string(),
        "latency",
        "25ms",
    ]);
    guard
}

/// [`tbf`] on the host end: limits traffic to the pod, as the CNI plugin's ingress limit.
pub fn tbf_to_pod(pod: &Pod, rate_bps: u64, burst_bytes: u64) -> Qdisc {
    tbf(pod.host_if(), rate_bps, burst_bytes)
}

/// [`tbf`] on an ifb fed by the host end's ingress: limits traffic from the pod, as the
/// CNI plugin's egress limit.
pub fn tbf_from_pod(pod: &Pod, rate_bps: u64, burst_bytes: u64) -> FromPodShaper {
    FromPodShaper::new(pod, |dev| tbf(dev, rate_bps, burst_bytes))
}

/// The leaf queue under the HTB class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leaf {
    /// What HTB creates by itself: pfifo with the device's txqueuelen as limit (1000 on a
    /// veth, 32 on an ifb).
    Default,
    /// `pfifo limit <packets>`.
    Pfifo(u32),
    /// `bfifo limit <bytes>`.
    Bfifo(u64),
}

/// One HTB class at the root of a device (`htb default 1`, class 1:1); `None` leaves a
/// parameter to tc's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Htb {
    pub rate_bps: u64,
    /// `ceil`; `None`: equal to the rate.
    pub ceil_bps: Option<u64>,
    /// Bytes.
    pub burst: Option<u64>,
    /// Bytes.
    pub cburst: Option<u64>,
    /// Bytes.
    pub quantum: Option<u64>,
    pub r2q: Option<u32>,
    pub leaf: Leaf,
}

impl Htb {
    /// Rate = ceil = `rate_bps`, everything else tc's default.
    pub fn new(rate_bps: u64) -> Htb {
        Htb {
            rate_bps,
            ceil_bps: None,
            burst: None,
            cburst: None,
            quantum: None,
            r2q: None,
            leaf: Leaf::Default,
        }
    }

    /// The `tc` commands that install it on `dev` (for the record and for docs).
    pub fn commands(&self, dev: &str) -> Vec<Vec<String>> {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let mut qdisc = s(&[
            "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1",
        ]);
        if let Some(r2q) = self.r2q {
            qdisc.extend(s(&["r2q", &r2q.to_string()]));
        }
        let mut class = s(&[
            "tc",
            "class",
            "replace",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:1",
            "htb",
            "rate",
            &format!("{}bit", self.rate_bps),
            "ceil",
            &format!("{}bit", self.ceil_bps.unwrap_or(self.rate_bps)),
        ]);
        for (k, v) in [
            ("burst", self.burst),
            ("cburst", self.cburst),
            ("quantum", self.quantum),
        ] {
            if let Some(v) = v {
                class.extend(s(&[k, &v.to_string()]));
            }
        }
        let mut cmds = vec![qdisc, class];
        let leaf = |kind: &str, limit: String| {
            s(&[
                "tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", kind,
                "limit", &limit,
            ])
        };
        match self.leaf {
            Leaf::Default => {}
            Leaf::Pfifo(n) => cmds.push(leaf("pfifo", n.to_string())),
            Leaf::Bfifo(n) => cmds.push(leaf("bfifo", n.to_string())),
        }
        cmds
    }

    /// Installs it as the root qdisc of `dev`.
    pub fn apply(&self, dev: &str) -> Qdisc {
        let guard = Qdisc::adopt(dev, "root");
        for c in self.commands(dev) {
            sh(&c.iter().map(String::as_str).collect::<Vec<_>>());
        }
        guard
    }
}

/// HTB on the host end: shapes traffic to the pod.
pub fn htb_to_pod(pod: &Pod, htb: &Htb) -> Qdisc {
    htb.apply(pod.host_if())
}

/// Redirects everything arriving on `dev` from its peer (ingress) to the egress of
/// `ifb`: `tc qdisc add dev <dev> clsact` + `tc filter add dev <dev> ingress protocol all
/// u32 match u32 0 0 action mirred egress redirect dev <ifb>` (the CNI bandwidth plugin's
/// filter; `matchall`, `flower` and `basic` are not built into the CI kernel, `u32` and
/// `bpf` are). The guard removes the clsact qdisc and with it the filter.
pub fn redirect_ingress(dev: &str, ifb: &Ifb) -> Qdisc {
    sh(&["tc", "qdisc", "add", "dev", dev, "clsact"]);
    let guard = Qdisc::adopt(dev, "clsact");
    sh(&[
        "tc",
        "filter",
        "add",
        "dev",
        dev,
        "ingress",
        "protocol",
        "all",
        "u32",
        "match",
        "u32",
        "0",
        "0",
        "action",
        "mirred",
        "egress",
        "redirect",
        "dev",
        ifb.name(),
    ]);
    guard
}

/// Shaping of traffic from a pod: the host end's ingress redirected to a new ifb, with
/// a qdisc at the ifb's root. Drop order: redirect, qdisc, ifb.
#[derive(Debug)]
pub struct FromPodShaper {
    _redirect: Qdisc,
    _root: Qdisc,
    ifb: Ifb,
}

impl FromPodShaper {
    /// Creates the ifb, installs `root(ifb name)` on it, then redirects the pod's traffic.
    pub fn new(pod: &Pod, root: impl FnOnce(&str) -> Qdisc) -> FromPodShaper {
        let ifb = Ifb::new();
        let root = root(ifb.name());
        let redirect = redirect_ingress(pod.host_if(), &ifb);
        FromPodShaper {
            _redirect: redirect,
            _root: root,
            ifb,
        }
    }

    pub fn ifb(&self) -> &Ifb {
        &self.ifb
    }
}

/// HTB on an ifb fed by the host end's ingress: shapes traffic from the pod.
pub fn htb_from_pod(pod: &Pod, htb: &Htb) -> FromPodShaper {
    FromPodShaper::new(pod, |dev| htb.apply(dev))
}

/// `tc -d class show dev <dev>`: what the kernel took (burst, cburst, quantum, ...).
pub fn tc_classes(dev: &str) -> String {
    sh(&["tc", "-d", "class", "show", "dev", dev])
}

/// Statistics of the root qdisc of `dev` (`tc -s -j qdisc show`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QdiscStats {
    pub bytes: u64,
    pub packets: u64,
    pub drops: u64,
    pub overlimits: u64,
    pub requeues: u64,
}

pub fn root_qdisc_stats(dev: &str) -> QdiscStats {
    let v: serde_json::Value = serde_json::from_str(&sh(&[
        "tc", "-s", "-j", "qdisc", "show", "dev", dev, "root",
    ]))
    .unwrap_or_else(|e| panic!("tc -j output for {dev}: {e}"));
    let q = v
        .as_array()
        .and_then(|a| a.first())
        .unwrap_or_else(|| panic!("no root qdisc on {dev}"));
    let n = |k: &str| q.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
    QdiscStats {
        bytes: n("bytes"),
        packets: n("packets"),
        drops: n("drops"),
        overlimits: n("overlimits"),
        requeues: n("requeues"),
    }
}

// ---------------------------------------------------------------------------------------
// iperf3

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Root namespace sends, the pod receives: leaves through the host end's egress.
    ToPod,
    /// The pod sends (`iperf3 -R`): arrives on the host end's ingress.
    FromPod,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::ToPod => "to-pod",
            Direction::FromPod => "from-pod",
        })
    }
}

/// What one iperf3 run does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Iperf {
    pub direction: Direction,
    /// Measured seconds (`-t`).
    pub seconds: u32,
    /// Warm-up seconds left out of the totals (`-O`), run before the measured ones.
    pub omit: u32,
    /// Reporting interval in seconds (`-i`).
    pub interval: f64,
    /// Parallel streams (`-P`).
    pub streams: u32,
    /// TCP congestion control of the sender (`-C`); `None`: the system default
    /// (`net.ipv4.tcp_congestion_control`, bbr on the CI machine).
    pub congestion: Option<&'static str>,
    /// The CPU both ends run on (`-A n,n`); `None`: wherever the scheduler puts them.
    ///
    /// A veth hands each packet to the backlog of the CPU that sends it, so a TCP flow
    /// whose packets leave from two CPUs (the sender's, and the one where its ACKs wake
    /// TCP Small Queues) arrives out of order, with or without any limit. The sender
    /// reads that as loss and cuts its window: with the ends left to the scheduler or on
    /// two CPUs, an unlimited veth here took 14,000 to 62,000 retransmits per 5 s, on one
    /// CPU none
    /// (docs/htb-tuning.md, "Reordering"). One CPU makes the figure the shaper's, as for
    /// traffic from another node, which a NIC delivers to one CPU per flow.
    pub cpu: Option<u32>,
    /// The sender's rate, bit/s (`-b`, iperf3 pacing its writes of one segment each): a
    /// fixed offered load rather than whatever TCP takes. `None`: unpaced. Not `--fq-rate`: iperf3 3.12's
    /// server does not apply it, and with `-R` the server sends (measured on loopback:
    /// 21.9 Gbit/s with `--fq-rate 45M`, 45.1 Mbit/s with `-b 45M`).
    pub pace_bps: Option<u64>,
}

impl Iperf {
    /// One TCP stream, [`DEFAULT_SECONDS`] measured after [`DEFAULT_OMIT`], 1 s intervals.
    pub fn new(direction: Direction) -> Iperf {
        Iperf {
            direction,
            seconds: DEFAULT_SECONDS,
            omit: DEFAULT_OMIT,
            interval: 1.0,
            streams: 1,
            congestion: None,
            cpu: Some(0),
            pace_bps: None,
        }
    }
}

/// One reporting interval as the *receiver* saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    pub start: f64,
    pub end: f64,
    pub bits_per_second: f64,
    /// Part of the warm-up (`-O`), not in the totals.
    pub omitted: bool,
}

/// The result of one iperf3 run.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    pub direction: Direction,
    /// Goodput at the receiver over the measured seconds (`end.sum_received`).
    pub bits_per_second: f64,
    /// What the sender wrote (`end.sum_sent`).
    pub sender_bits_per_second: f64,
    /// TCP retransmits of the sender (`end.sum_sent.retransmits`).
    pub retransmits: u64,
    /// Measured seconds at the receiver.
    pub seconds: f64,
    /// Receiver-side intervals, warm-up included (flagged `omitted`).
    pub intervals: Vec<Interval>,
    /// Load average when the run ended.
    pub load: LoadAvg,
    /// The sender's congestion control, as iperf3 reports it.
    pub congestion: String,
    /// iperf3's whole JSON report.
    pub json: serde_json::Value,
}

impl fmt::Display for Measurement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {:.1} Mbit/s over {:.1} s, {} retransmits, {} (load {})",
            self.direction,
            self.bits_per_second / 1e6,
            self.seconds,
            self.retransmits,
            self.congestion,
            self.load
        )
    }
}

/// A persistent iperf3 server in a pod's namespace, bound to the pod's address on a port
/// unique in this process; SIGKILLed on drop. It serves one test at a time.
#[derive(Debug)]
pub struct IperfServer {
    child: Child,
    addr: Ipv4Addr,
    port: u16,
    log: tempfile::NamedTempFile,
}

impl IperfServer {
    pub fn start(pod: &Pod) -> IperfServer {
        let port = 5201 + (next_id() % 20000) as u16;
        let log = tempfile::Builder::new()
            .prefix("sg-iperf3-server-")
            .tempfile()
            .unwrap_or_else(|e| panic!("iperf3 server log: {e}"));
        let out = log
            .reopen()
            .unwrap_or_else(|e| panic!("iperf3 server log: {e}"));
        let err = log
            .reopen()
            .unwrap_or_else(|e| panic!("iperf3 server log: {e}"));
        let child = pod
            .netns()
            .exec("iperf3")
            // -J and -i 0.1: with --get-server-output the client gets the server's
            // (receiver's) report as JSON, with intervals fine enough to re-bucket.
            .args([
                "-s",
                "-J",
                "-i",
                "0.1",
                "-B",
                &pod.pod_addr().to_string(),
                "-p",
                &port.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("start iperf3 server: {e}"));
        let mut s = IperfServer {
            child,
            addr: pod.pod_addr(),
            port,
            log,
        };
        s.wait_listening();
        s
    }

    /// Waits until the server's socket is in LISTEN, read from `/proc/<pid>/net/tcp`
    /// (the server's namespace view), without connecting: a probe connection would count
    /// as a test to iperf3.
    fn wait_listening(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("iperf3 server exited ({status}): {}", self.log_text());
        }
        self.wait_listen_socket();
    }

    /// [`IperfServer::wait_listening`]'s wait, and each measurement's: until the server
    /// listens and holds no connection that is still open on its side. A client started
    /// while the server was still finishing the previous test was refused in benchmark
    /// runs, once with "Connection refused" and once with "the server is busy running a
    /// test".
    fn wait_listen_socket(&self) {
        let pid = self.child.id();
        let port = format!(":{:04X}", self.port);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            // /proc/<pid>/net/tcp lists the server's namespace: (local address, state)
            // of each socket; 0A is LISTEN, and 01 ESTABLISHED, 02 and 03 SYN, 08
            // CLOSE_WAIT are connections the server has not closed yet.
            let states: Vec<String> = ["tcp", "tcp6"]
                .iter()
                .filter_map(|f| fs::read_to_string(format!("/proc/{pid}/net/{f}")).ok())
                .flat_map(|t| {
                    t.lines()
                        .skip(1)
                        .filter_map(|l| {
                            let w: Vec<&str> = l.split_whitespace().collect();
                            (w.len() > 3 && w[1].ends_with(&port)).then(|| w[3].to_owned())
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let listening = states.iter().any(|s| s == "0A");
            let busy = states
                .iter()
                .any(|s| matches!(s.as_str(), "01" | "02" | "03" | "08"));
            if listening && !busy {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "iperf3 server on {}:{} not idle and listening after {READY_TIMEOUT:?} ({states:?}): {}",
                self.addr,
                self.port,
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The server's process id (in the root pid namespace).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// Runs the iperf3 client from the root namespace against this server. Does not take
    /// [`TrafficLock`]; callers measuring throughput should hold it.
    pub fn measure(&self, run: &Iperf) -> Measurement {
        self.measure_client(None, run)
    }

    /// Runs `run` against this server and `other` at once, each client on a thread of
    /// its own: (this one's, the other's). Does not take [`TrafficLock`].
    pub fn measure_with(&self, other: &IperfServer, run: &Iperf) -> (Measurement, Measurement) {
        std::thread::scope(|s| {
            let a = s.spawn(|| self.measure(run));
            let b = s.spawn(|| other.measure(run));
            (
                a.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                b.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
            )
        })
    }

    /// As [`IperfServer::measure`], with the client in namespace `from`: traffic that
    /// reaches the pod through whatever route `from` has to it (another host across a
    /// NIC) rather than straight over the pod's veth.
    pub fn measure_from(&self, from: &Netns, run: &Iperf) -> Measurement {
        self.measure_client(Some(from), run)
    }

    fn measure_client(&self, from: Option<&Netns>, run: &Iperf) -> Measurement {
        self.wait_listen_socket();
        let out = tempfile::Builder::new()
            .prefix("sg-iperf3-client-")
            .tempfile()
            .unwrap_or_else(|e| panic!("iperf3 client output: {e}"));
        let mut cmd = match from {
            Some(ns) => ns.exec("iperf3"),
            None => Command::new("iperf3"),
        };
        cmd.args([
            "-c",
            &self.addr.to_string(),
            "-p",
            &self.port.to_string(),
            "-t",
            &run.seconds.to_string(),
            "-O",
            &run.omit.to_string(),
            "-i",
            &run.interval.to_string(),
            "-P",
            &run.streams.to_string(),
            "-J",
            "--get-server-output",
            "--connect-timeout",
            "5000",
        ]);
        if let Some(cc) = run.congestion {
            cmd.args(["-C", cc]);
        }
        if let Some(cpu) = run.cpu {
            cmd.args(["-A", &format!("{cpu},{cpu}")]);
        }
        if let Some(bps) = run.pace_bps {
            // iperf3 hands both to the server too, which sends with -R. Its pacing
            // writes whole blocks when it is behind: 128 KiB by default, a burst that
            // takes 1 ms on a 1 Gbit/s wire; one segment's payload keeps it to a packet.
            cmd.args(["-b", &bps.to_string(), "-l", "1448"]);
        }
        if run.direction == Direction::FromPod {
            cmd.arg("-R");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(
                out.reopen()
                    .unwrap_or_else(|e| panic!("iperf3 client output: {e}")),
            )
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("start iperf3 client: {e}"));
        let limit = Duration::from_secs(u64::from(run.seconds + run.omit) + 20);
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = child.try_wait().unwrap_or_else(|e| panic!("iperf3: {e}")) {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "iperf3 client still running after {limit:?}; server log: {}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let text = fs::read_to_string(out.path()).unwrap_or_default();
        let json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("iperf3 client ({status}) printed no JSON ({e}): {text}"));
        if let Some(err) = json.get("error") {
            panic!(
                "iperf3 client ({status}) failed: {err}; server log: {}",
                self.log_text()
            );
        }
        parse_iperf(run, json, LoadAvg::now())
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn parse_iperf(run: &Iperf, json: serde_json::Value, load: LoadAvg) -> Measurement {
    let f = |v: &serde_json::Value, p: &str| {
        v.pointer(p)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or_else(|| panic!("iperf3 JSON has no {p}: {v}"))
    };
    // The receiver is the client with -R, the server otherwise (its report comes back
    // with --get-server-output, in 0.1 s intervals: re-bucketed to the run's interval).
    let receiver = match run.direction {
        Direction::FromPod => Some(&json),
        Direction::ToPod => json.get("server_output_json"),
    };
    let fine: Vec<(f64, f64, f64, bool)> = receiver
        .and_then(|r| r.get("intervals"))
        .and_then(serde_json::Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|i| {
                    let s = i.get("sum")?;
                    Some((
                        s.get("start")?.as_f64()?,
                        s.get("end")?.as_f64()?,
                        s.get("bytes")?.as_f64()?,
                        s.get("omitted")?.as_bool()?,
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    Measurement {
        direction: run.direction,
        bits_per_second: f(&json, "/end/sum_received/bits_per_second"),
        sender_bits_per_second: f(&json, "/end/sum_sent/bits_per_second"),
        retransmits: json
            .pointer("/end/sum_sent/retransmits")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0),
        seconds: f(&json, "/end/sum_received/seconds"),
        intervals: rebucket(&fine, run.interval),
        load,
        congestion: json
            .pointer("/end/sender_tcp_congestion")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        json,
    }
}

/// Joins consecutive (start, end, bytes, omitted) intervals into intervals of about
/// `width` seconds, never across the end of the warm-up.
fn rebucket(fine: &[(f64, f64, f64, bool)], width: f64) -> Vec<Interval> {
    let mut out: Vec<Interval> = Vec::new();
    let mut cur: Option<(f64, f64, f64, bool)> = None;
    for &(start, end, bytes, omitted) in fine {
        cur = match cur {
            Some((s, _, b, o)) if o == omitted => Some((s, end, b + bytes, o)),
            Some(done) => {
                out.push(interval(done));
                Some((start, end, bytes, omitted))
            }
            None => Some((start, end, bytes, omitted)),
        };
        if let Some(c) = cur
            && c.1 - c.0 >= width - 0.02
        {
            out.push(interval(c));
            cur = None;
        }
    }
    if let Some(c) = cur {
        out.push(interval(c));
    }
    out
}

fn interval((start, end, bytes, omitted): (f64, f64, f64, bool)) -> Interval {
    Interval {
        start,
        end,
        bits_per_second: if end > start {
            bytes * 8.0 / (end - start)
        } else {
            0.0
        },
        omitted,
    }
}

// ---------------------------------------------------------------------------------------
// ping

/// Round-trip times in ms of `count` pings from the root namespace to the pod, sent
/// every `interval` (below 200 ms needs root, which the harness has). Lost replies are
/// missing from the result.
pub fn ping_rtt(pod: &Pod, count: u32, interval: Duration) -> Vec<f64> {
    parse_ping(&ping_args(&[], pod.pod_addr(), count, interval))
}

/// As [`ping_rtt`], from inside the pod to the host end's address.
pub fn ping_rtt_from_pod(pod: &Pod, count: u32, interval: Duration) -> Vec<f64> {
    parse_ping(&ping_args(
        &["ip", "netns", "exec", pod.netns_name()],
        pod.host_addr(),
        count,
        interval,
    ))
}

/// As [`ping_rtt`] (from inside the pod to the host end's address when `from_pod`), with
/// `payload` bytes of ICMP data in each request (`-s`): a sparse flow of a chosen rate.
pub fn ping_rtt_sized(
    pod: &Pod,
    from_pod: bool,
    count: u32,
    interval: Duration,
    payload: u32,
) -> Vec<f64> {
    let size = payload.to_string();
    let out = if from_pod {
        ping_output(
            &["ip", "netns", "exec", pod.netns_name()],
            pod.host_addr(),
            count,
            interval,
            &["-s", &size],
        )
    } else {
        ping_output(&[], pod.pod_addr(), count, interval, &["-s", &size])
    };
    parse_ping(&out)
}

/// What a [`ping_for`] sent and got back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pings {
    /// Round-trip times in ms of the replies; lost ones are missing.
    pub rtts: Vec<f64>,
    /// Requests sent (ping's "packets transmitted").
    pub sent: u32,
}

/// Pings `to` from inside namespace `ns` every `interval` for `duration` (`-w`): a
/// window of time rather than a count, since ping's intervals stretch on this VM (500
/// pings every 10 ms took 8 s in the isolation bench), and a window meant to lie inside a
/// load must not run past it.
pub fn ping_for(ns: &Netns, to: Ipv4Addr, interval: Duration, duration: Duration) -> Pings {
    let deadline = duration.as_secs().max(1).to_string();
    let count = (duration.as_secs_f64() / interval.as_secs_f64()).ceil() as u32;
    let out = ping_output(
        &["ip", "netns", "exec", ns.name()],
        to,
        count,
        interval,
        &["-w", &deadline],
    );
    Pings {
        rtts: parse_ping(&out),
        sent: parse_ping_sent(&out),
    }
}

/// ping's "N packets transmitted" (0 when it printed no summary).
pub fn parse_ping_sent(out: &str) -> u32 {
    out.lines()
        .find_map(|l| {
            l.split_once(" packets transmitted")
                .and_then(|(n, _)| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn ping_args(prefix: &[&str], to: Ipv4Addr, count: u32, interval: Duration) -> String {
    ping_output(prefix, to, count, interval, &[])
}

fn ping_output(
    prefix: &[&str],
    to: Ipv4Addr,
    count: u32,
    interval: Duration,
    extra: &[&str],
) -> String {
    let count = count.to_string();
    let interval = format!("{:.3}", interval.as_secs_f64());
    let to = to.to_string();
    let mut args: Vec<&str> = prefix.to_vec();
    args.extend(["ping", "-n", "-c", &count, "-i", &interval, "-W", "2"]);
    args.extend(extra);
    args.push(&to);
    // ping exits 1 when some replies are missing; the caller judges from the count.
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run ping: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `time=X ms` of each reply in ping's output.
pub fn parse_ping(out: &str) -> Vec<f64> {
    out.lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("time="))
                .and_then(|t| t.parse().ok())
        })
        .collect()
}

/// The `p`-th percentile (0..=100, nearest rank) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// What `streams` new TCP flows in `dir` get through together in their first 100 ms (the
/// receiver's first 0.1 s interval, no warm-up), and the bound the limit allows them: the
/// limit over that interval's actual length (iperf3's timer makes it 100 to 102 ms) plus
/// one burst of 64 KiB. Bytes, both.
pub fn first_100ms(
    server: &IperfServer,
    dir: Direction,
    streams: u32,
    limit_bps: u64,
) -> (f64, f64) {
    let run = Iperf {
        seconds: 1,
        omit: 0,
        interval: 0.1,
        streams,
        ..Iperf::new(dir)
    };
    let m = server.measure(&run);
    m.intervals
        .iter()
        .find(|i| !i.omitted)
        .map_or((f64::NAN, f64::NAN), |i| {
            let seconds = i.end - i.start;
            (
                i.bits_per_second * seconds / 8.0,
                limit_bps as f64 / 8.0 * seconds + 65_536.0,
            )
        })
}

/// Jain's fairness index of `x`: (sum x)^2 / (n sum x^2), 1 when all are equal, 1/n when
/// one takes everything; NaN when empty or all zero.
pub fn jain(x: &[f64]) -> f64 {
    let sum: f64 = x.iter().sum();
    let squares: f64 = x.iter().map(|v| v * v).sum();
    sum * sum / (x.len() as f64 * squares)
}

/// Two TCP flows in one share, in `dir`: their goodput together over `limit_bps`, and
/// their [`jain`] index (NaN when iperf3 did not report both).
pub fn two_flows(server: &IperfServer, dir: Direction, limit_bps: u64) -> (f64, f64) {
    let run = Iperf {
        streams: 2,
        ..Iperf::new(dir)
    };
    let m = server.measure(&run);
    let per: Vec<f64> = m.json["end"]["streams"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter_map(|s| s["receiver"]["bits_per_second"].as_f64())
                .collect()
        })
        .unwrap_or_default();
    let index = if per.len() == 2 { jain(&per) } else { f64::NAN };
    (m.bits_per_second / limit_bps as f64, index)
}

/// The median of `v`; NaN when empty.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        f64::midpoint(s[m - 1], s[m])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_output_parses() {
        let out = "PING 198.18.0.6 (198.18.0.6) 56(84) bytes of data.\n\
                   64 bytes from 198.18.0.6: icmp_seq=1 ttl=64 time=0.843 ms\n\
                   64 bytes from 198.18.0.6: icmp_seq=2 ttl=64 time=12.5 ms\n\
                   \n--- 198.18.0.6 ping statistics ---\n\
                   rtt min/avg/max/mdev = 0.236/0.539/0.843/0.303 ms\n";
        assert_eq!(parse_ping(out), vec![0.843, 12.5]);
        assert_eq!(parse_ping_sent(out), 0);
        assert_eq!(
            parse_ping_sent(
                "--- x ping statistics ---\n500 packets transmitted, 498 received, 0.4% packet loss, time 4990ms\n"
            ),
            500
        );
    }

    #[test]
    fn rates_read_as_quantities_and_a_bad_one_is_named() {
        assert_eq!(rate_bps("50M"), 50_000_000);
        assert_eq!(rate_bps("2G"), 2_000_000_000);
        assert_eq!(rate_bps("1500k"), 1_500_000);
        for bad in ["", "0", "1.5", "fast", "-5M"] {
            let e = std::panic::catch_unwind(|| rate_bps(bad)).unwrap_err();
            let msg = e.downcast_ref::<String>().unwrap();
            assert!(msg.contains(&format!("{bad:?}")), "{msg}");
        }
    }

    #[test]
    fn jain_is_one_when_equal_and_one_over_n_when_one_takes_all() {
        assert!((jain(&[5.0, 5.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0]) - 0.5).abs() < 1e-12);
        assert!((jain(&[3.0, 1.0]) - 0.8).abs() < 1e-12);
        assert!(jain(&[]).is_nan());
    }

    #[test]
    fn percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn rebucket_joins_fine_intervals() {
        let fine: Vec<_> = (0..25)
            .map(|i| {
                let t = f64::from(i) / 10.0;
                (t, t + 0.1, 1000.0, i < 10)
            })
            .collect();
        let r = rebucket(&fine, 1.0);
        assert_eq!(r.len(), 3);
        assert!(r[0].omitted && !r[1].omitted && !r[2].omitted);
        assert!((r[0].bits_per_second - 80_000.0).abs() < 1.0);
        assert!((r[2].end - 2.5).abs() < 1e-9);
        assert_eq!(rebucket(&fine, 0.1).len(), 25);
    }

    #[test]
    fn names_fit_ifnamsiz() {
        assert!(ifname("sgh", 9999).len() <= 15);
    }

    #[test]
    fn htb_commands() {
        let h = Htb {
            burst: Some(62500),
            cburst: Some(62500),
            leaf: Leaf::Bfifo(1000),
            ..Htb::new(50_000_000)
        };
        let c: Vec<String> = h.commands("d").iter().map(|c| c.join(" ")).collect();
        assert_eq!(
            c,
            [
                "tc qdisc replace dev d root handle 1: htb default 1",
                "tc class replace dev d parent 1: classid 1:1 htb rate 50000000bit ceil 50000000bit burst 62500 cburst 62500",
                "tc qdisc replace dev d parent 1:1 handle 10: bfifo limit 1000",
            ]
        );
    }
}
