//! The `net` limiter: both directions of a pod's traffic limited on the host side, where
//! the pod cannot undo it, with the mechanism chosen per device from what the kernel
//! offers (see [`crate::mechanism`]).
//!
//! Programs, maps and links are pinned under the agent's bpffs directory and the qdiscs
//! live in the kernel: killing the agent lifts no limit, and a restarted agent adopts
//! the pinned links instead of attaching again. Each share's install record (which
//! interface, which mechanism, which queue device) is on disk, so a release still finds what to
//! remove after the pod's namespace is gone.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    sync::{Arc, Mutex},
    time::Instant,
};

use shareguard_common::{
    Format, Quantity,
    limiter::{DeviceFacts, Enforcement, LimitSpec, Limiter, LimiterError, Needs, TrafficCounters},
};
use shareguard_ebpf_common::{FLAG_TO_POD_QUEUE, IfaceConfig};
use tracing::info;

use crate::{
    bpf::{Bpf, Direction},
    burst,
    bypass::{self, Sample, Window},
    error::NetError,
    mechanism::{self, Mechanism, RootQdisc},
    probe::{self, Probe},
    rtnl,
    state::{
        self, Host, Installed, StateDir, queue_name, return_name, short_id, to_queue_name,
        to_return_name,
    },
    tc,
};

mod governor;
mod install;
mod read_back;

/// Symmetric capacity: both directions at the same rate.
pub const BANDWIDTH: &str = "bandwidth";
/// Traffic from the pod (the pod's egress).
pub const EGRESS: &str = "egressBandwidth";
/// Traffic to the pod.
pub const INGRESS: &str = "ingressBandwidth";
/// The capacity names a `net` device may have.
pub const CAPACITIES: [&str; 3] = [BANDWIDTH, EGRESS, INGRESS];

/// Where the kernel's BPF filesystem is normally mounted.
const BPFFS: &str = "/sys/fs/bpf";

/// What all `net` devices of an agent share: the loaded programs and pinned maps, the
/// install records and the kernel probe. One lock for the BPF side and the interfaces:
/// two shares must never interleave their changes to one interface.
pub struct NetBackend {
    bpf: Mutex<Bpf>,
    state: StateDir,
    probe: Probe,
    /// The `htb-ebpf` directions whose bucket follows their activity ([`burst`]).
    bursts: burst::Registry,
    /// Per share: the window over which its traffic past the programs is counted
    /// ([`crate::bypass`]). In memory: a restarted agent starts new windows.
    windows: Mutex<HashMap<String, Window>>,
}

/// The `Limiter` of one `net` device: the shared back end, the device's mechanism and
/// its line rate.
pub struct NetLimiter {
    backend: Arc<NetBackend>,
    mechanism: Mechanism,
    /// What the device's path carries at most, bit/s (config `line_rate`): a direction
    /// limited at or above it is counted but not shaped. None: every limit is shaped.
    line_rate_bps: Option<u64>,
    /// The NIC the device stands for, whose link state is the device's health (config
    /// `interface`); None: no NIC to watch.
    interface: Option<String>,
}

/// `ShareStatus.mechanism` of a share whose every limited direction is unconstrained.
pub const UNCONSTRAINED: &str = "unconstrained";

/// The file name of a share's pinned link for one direction on its first pod's host
/// veth, under `<pin_dir>/links/`.
pub fn link_name(share_key: &str, dir: Direction) -> String {
    format!("{}-{}", short_id(share_key), dir_word(dir))
}

/// The file name of a share's pinned link for one direction on the host veth `ifindex`
/// of another of its pods.
pub fn more_link_name(share_key: &str, dir: Direction, ifindex: u32) -> String {
    format!("{}-{}-{ifindex}", short_id(share_key), dir_word(dir))
}

/// The pinned link of `host` for `dir`: `first` is the record's first host.
fn host_link(share_key: &str, dir: Direction, host: &Host, first: bool) -> String {
    if first {
        link_name(share_key, dir)
    } else {
        more_link_name(share_key, dir, host.index)
    }
}

fn dir_word(dir: Direction) -> &'static str {
    match dir {
        Direction::ToPod => "to-pod",
        Direction::FromPod => "from-pod",
    }
}

/// The file name of a share's pinned link on the ingress of its return device.
pub fn return_link_name(share_key: &str) -> String {
    format!("{}-return", short_id(share_key))
}

/// The file name of a share's pinned link on the ingress of its to-pod return device.
pub fn to_return_link_name(share_key: &str) -> String {
    format!("{}-return-to", short_id(share_key))
}

/// The lowest counter slot no other installed share holds. Slots are allocated, not
/// taken from the interface index: a busy node's ifindexes pass the array's size within
/// days, since every pod veth and every queue device takes a new one.
fn free_slot(others: &[Installed]) -> Result<u32, NetError> {
    let used: std::collections::BTreeSet<u32> = others.iter().filter_map(Installed::slot).collect();
    (0..shareguard_ebpf_common::MAX_SLOTS)
        .find(|s| !used.contains(s))
        .ok_or_else(|| {
            NetError::Conflict(format!(
                "all {} counter slots are held by installed shares",
                shareguard_ebpf_common::MAX_SLOTS
            ))
        })
}

/// The directions a capacity limits: `bandwidth` both, `ingressBandwidth` (the pod's
/// ingress) traffic to the pod, `egressBandwidth` traffic from it; none for any other.
fn directions(capacity: &str) -> &'static [Direction] {
    match capacity {
        BANDWIDTH => &[Direction::ToPod, Direction::FromPod],
        INGRESS => &[Direction::ToPod],
        EGRESS => &[Direction::FromPod],
        _ => &[],
    }
}

/// (to the pod, from the pod) in bit/s.
pub fn rates(limits: &BTreeMap<String, Quantity>) -> Result<(Option<u64>, Option<u64>), NetError> {
    let bps = |name: &str, q: &Quantity| -> Result<u64, NetError> {
        let v = q
            .ceil_units()
            .and_then(|v| u64::try_from(v).ok())
            .filter(|v| *v > 0)
            .ok_or_else(|| {
                NetError::Conflict(format!("{name}: {q} is not a positive rate in bit/s"))
            })?;
        Ok(v)
    };
    let (mut to, mut from) = (None, None);
    for (name, q) in limits {
        let dirs = directions(name);
        if dirs.is_empty() {
            return Err(NetError::Conflict(format!(
                "capacity {name:?} is not one the bandwidth limiter enforces ({})",
                CAPACITIES.join(", ")
            )));
        }
        let v = bps(name, q)?;
        for dir in dirs {
            match dir {
                Direction::ToPod => to = Some(v),
                Direction::FromPod => from = Some(v),
            }
        }
    }
    Ok((to, from))
}

fn lock(m: &Mutex<Bpf>) -> std::sync::MutexGuard<'_, Bpf> {
    // A panic while holding the lock leaves kernel objects as they were; the next call
    // re-reads the kernel, so carrying on is safe.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn lock_windows(
    m: &Mutex<HashMap<String, Window>>,
) -> std::sync::MutexGuard<'_, HashMap<String, Window>> {
    // A window is a few counters: one left half-updated by a panic costs one verdict.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bpf_err(e: impl std::fmt::Display) -> NetError {
    NetError::Bpf(e.to_string())
}

/// Whether a root qdisc is one of ours: handle `1:`, of the kind we install there.
fn is_ours(q: &rtnl::RootQdisc, kind: Option<&str>) -> bool {
    Some(q.kind.as_str()) == kind && q.major == tc::MAJOR
}

/// Whether `ifindex`'s root qdisc is one of ours.
fn root_is_ours(ifindex: u32, kind: &str) -> Result<bool, NetError> {
    Ok(rtnl::root_qdisc(ifindex)?.is_some_and(|q| is_ours(&q, Some(kind))))
}

/// The share's rate as the HTB tree on `ifindex` enforces it, in bit/s: the share class's
/// rate, but only while every flow class and the priority class sit below it with a ceil
/// of at most that rate and assured rates that together stay within it (HTB sends a class
/// within its assured rate whatever its parent has left, so more would let the share past
/// its limit, and that is drift), and with own bursts that together stay within the
/// share's plus one sparse flow's credit ([`tc::own_bursts_fit`]; each class sends its
/// own burst at once, past the share's class: a tree whose classes each had the share's
/// whole burst, as this agent installed before, let sixteen flows after an idle spell
/// through at 1.2 to 2.0 times the limit's first 100 ms, and is reinstalled); None
/// otherwise.
fn htb_tree_bps(ifindex: u32) -> Result<Option<u64>, NetError> {
    let classes = rtnl::htb_classes(ifindex, tc::MAJOR)?;
    let Some(share) = classes.get(&tc::SHARE_MINOR) else {
        return Ok(None);
    };
    let (mut assured, mut own_bursts) = (0u64, 0u64);
    for minor in tc::MINOR..=tc::SPARSE_MINOR {
        match classes.get(&minor) {
            Some(c) if c.parent_minor == tc::SHARE_MINOR && c.ceil <= share.rate => {
                assured = assured.saturating_add(c.rate);
                own_bursts = own_bursts.saturating_add(c.burst);
            }
            _ => return Ok(None),
        }
    }
    // tc rounds each burst down to a whole scheduler tick, the share's too.
    let tick = rtnl::bytes_in_ticks(share.rate, 1) + 1;
    Ok(
        (assured <= share.rate && tc::own_bursts_fit(share.burst, own_bursts, tick))
            .then_some(share.rate * 8),
    )
}

/// The directions of `i` whose bucket the burst governor keeps, by counter index: those
/// `htb-ebpf` shapes whose idle bucket is smaller than their busy one. `queues`: the
/// queue devices that queue traffic from the pods and to them, where there are.
fn governed_directions(
    i: &Installed,
    (queue_index, to_queue_index): (Option<u32>, Option<u32>),
) -> Vec<(u32, burst::Governed)> {
    if i.mechanism != Mechanism::HtbEbpf {
        return Vec::new();
    }
    let Some(slot) = i.slot() else {
        return Vec::new();
    };
    [Direction::ToPod, Direction::FromPod]
        .into_iter()
        .filter_map(|dir| {
            let rate = i.shaped(dir)?;
            let ifindex = match dir {
                Direction::ToPod if i.to_queue.is_some() => to_queue_index?,
                Direction::ToPod => i.host_index,
                Direction::FromPod => queue_index?,
            };
            let p = tc::HtbParams::for_rate(rate);
            let index = shareguard_ebpf_common::counter_index(slot, dir.index())?;
            (p.idle_burst_bytes() < p.burst_bytes).then(|| {
                (
                    index,
                    burst::Governed {
                        share_key: i.share_key.clone(),
                        direction: dir,
                        ifindex,
                        bytes_per_sec: rate / 8,
                        busy_bytes: p.burst_bytes,
                        idle_bytes: p.idle_burst_bytes(),
                        bucket: burst::Bucket::Unknown,
                        retry_after_ns: 0,
                    },
                )
            })
        })
        .collect()
}

/// Takes share `i` off one of its pods' host veths (`first`: the record's first one):
/// its links, its configuration for the programs and a root qdisc of ours.
fn leave_host(bpf: &mut Bpf, i: &Installed, host: &Host, first: bool) -> Result<(), NetError> {
    for dir in [Direction::ToPod, Direction::FromPod] {
        bpf.detach(&host_link(&i.share_key, dir, host, first))
            .map_err(bpf_err)?;
    }
    // The ifindex may already belong to a new interface; its entry is ours either way.
    bpf.clear_iface(host.index).map_err(bpf_err)?;
    let still_there = rtnl::name_of_index(host.index)?.as_deref() == Some(host.name.as_str());
    if still_there
        && i.shaped(Direction::ToPod).is_some()
        && let Some(kind) = i.mechanism.qdisc_kind()
        && root_is_ours(host.index, kind)?
    {
        tc::remove_root(&host.name)?;
    }
    Ok(())
}

/// `ours`: the device's root is already our qdisc (HTB then changes it in place, once it
/// has the share's class: an older layout is rebuilt).
fn install_root(dev: &str, ifindex: u32, q: &RootQdisc, ours: bool) -> Result<(), NetError> {
    match q {
        RootQdisc::Htb(p) => {
            let tree =
                ours && rtnl::htb_classes(ifindex, tc::MAJOR)?.contains_key(&tc::SHARE_MINOR);
            tc::install_htb(dev, p, ours, tree)
        }
        RootQdisc::Fq => tc::install_fq(dev),
    }
}

impl NetBackend {
    /// `state_dir` keeps what was installed per share; `pin_dir` is the bpffs directory
    /// for maps and links (deterministic, so a restarted agent finds them). Probes the
    /// kernel once.
    pub fn open(state_dir: &Path, pin_dir: &Path) -> Result<Arc<NetBackend>, NetError> {
        // Pins only outlive the agent on a BPF filesystem; mount the usual one if the
        // machine has none (minimal hosts and containers often do not).
        let bpffs = Path::new(BPFFS);
        if pin_dir.starts_with(bpffs) {
            crate::bpf::ensure_bpffs(bpffs).map_err(bpf_err)?;
        }
        let mut bpf = Bpf::load(pin_dir).map_err(bpf_err)?;
        let probe = probe::probe()?;
        info!(
            fq = probe.fq,
            htb = probe.htb,
            queue = probe.queue,
            available = ?mechanism::available(&probe),
            "probed the kernel for bandwidth mechanisms"
        );
        let wakeups = bpf.take_wakeups();
        let backend = Arc::new(NetBackend {
            bpf: Mutex::new(bpf),
            state: StateDir::open(state_dir)?,
            probe,
            bursts: burst::Registry::default(),
            windows: Mutex::new(HashMap::new()),
        });
        if let Some(w) = wakeups {
            governor::spawn(Arc::downgrade(&backend), w)?;
        }
        Ok(backend)
    }

    /// Runs `f` under the back end's lock, for the burst governor.
    pub(crate) fn govern(&self, f: impl FnOnce(&mut Bpf, &burst::Registry)) {
        let mut bpf = lock(&self.bpf);
        f(&mut bpf, &self.bursts);
    }

    pub fn probe(&self) -> Probe {
        self.probe
    }
}

impl NetLimiter {
    /// The limiter for a device that asks for `requested` (None: the strongest the kernel
    /// has). Fails when the kernel cannot run the requested one.
    /// `line_rate_bps`: what the device's path carries at most (None: unknown, so every
    /// limit is shaped).
    pub fn new(
        backend: Arc<NetBackend>,
        requested: Option<Mechanism>,
        line_rate_bps: Option<u64>,
    ) -> Result<NetLimiter, NetError> {
        let mechanism = mechanism::choose(&backend.probe, requested)?;
        Ok(NetLimiter {
            backend,
            mechanism,
            line_rate_bps,
            interface: None,
        })
    }

    /// The limiter that reports `interface`'s link state as the device's health.
    pub fn with_interface(mut self, interface: Option<String>) -> NetLimiter {
        self.interface = interface;
        self
    }

    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    fn uninstall(&self, bpf: &mut Bpf, i: &Installed) -> Result<(), NetError> {
        for dir in [Direction::ToPod, Direction::FromPod] {
            if let Some(index) = i
                .slot()
                .and_then(|slot| shareguard_ebpf_common::counter_index(slot, dir.index()))
            {
                self.backend.bursts.forget(index);
            }
        }
        for (host, first) in i.hosts() {
            leave_host(bpf, i, &host, first)?;
        }
        bpf.detach(&return_link_name(&i.share_key))
            .map_err(bpf_err)?;
        bpf.detach(&to_return_link_name(&i.share_key))
            .map_err(bpf_err)?;
        if let Some(queue) = &i.queue {
            rtnl::delete_queue(queue, &i.share_key)?;
        }
        if let Some(queue) = &i.to_queue {
            if let Some(slot) = i.slot() {
                bpf.set_to_pod_queue(slot, 0).map_err(bpf_err)?;
            }
            rtnl::delete_queue(queue, &i.share_key)?;
        }
        Ok(())
    }
}

impl Limiter for NetLimiter {
    fn mechanisms(&self) -> Vec<String> {
        vec![self.mechanism.name().to_owned()]
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn device_facts(&self, _device: &str) -> DeviceFacts {
        let (mut attributes, mut int_attributes) = Default::default();
        if let Some(i) = self.interface.as_deref() {
            crate::link::placement(Path::new(crate::link::SYS_CLASS_NET), i)
                .add_attributes(&mut attributes, &mut int_attributes);
        }
        DeviceFacts {
            mechanism: self.mechanism.name().to_owned(),
            enforces: true,
            attributes,
            int_attributes,
            fault: self
                .interface
                .as_deref()
                .and_then(|i| crate::link::fault(Path::new(crate::link::SYS_CLASS_NET), i)),
        }
    }

    fn needs(&self, _device: &str) -> Needs {
        Needs::Network
    }

    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.install(spec, false)
    }

    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let bpf = lock(&self.backend.bpf);
        Ok(self.read_back(&bpf, spec, false)?)
    }

    /// Counts the share's traffic, both directions, and shapes nothing: the programs on
    /// the pod's veth and the share's counter slot, no qdisc, no queue device, no pacing.
    fn observe(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        self.install(spec, true)
    }

    fn verify_observed(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let bpf = lock(&self.backend.bpf);
        Ok(self.read_back(&bpf, spec, true)?)
    }

    fn counters(&self, share_key: &str) -> Option<TrafficCounters> {
        let i = self.backend.state.get(share_key).ok()??;
        let (to, from) = lock(&self.backend.bpf).counters(i.slot()?).ok()?;
        let kind = i.mechanism.qdisc_kind();
        let qdisc_drops = |ifindex: Option<u32>| {
            ifindex
                .and_then(|x| rtnl::root_qdisc(x).ok().flatten())
                .filter(|q| is_ours(q, kind))
                .map_or(0, |q| q.drops)
        };
        let (queue_index, to_queue_index) = Self::queue_indices(&i).ok()?;
        let to_pod_drops = match i.shaped(Direction::ToPod) {
            None => 0,
            Some(_) if i.to_queue.is_some() => qdisc_drops(to_queue_index),
            Some(_) => i
                .hosts()
                .iter()
                .map(|(h, _)| qdisc_drops(Some(h.index)))
                .sum(),
        };
        Some(TrafficCounters {
            to_pod_bytes: to.bytes,
            to_pod_packets: to.packets,
            from_pod_bytes: from.bytes,
            from_pod_packets: from.packets,
            drops: to_pod_drops + qdisc_drops(queue_index) + to.drops + from.drops,
        })
    }

    fn remove(&self, share_key: &str) -> Result<(), LimiterError> {
        let state = &self.backend.state;
        let mut bpf = lock(&self.backend.bpf);
        if let Some(i) = state.get(share_key)? {
            self.uninstall(&mut bpf, &i)?;
            state.remove(share_key)?;
        }
        lock_windows(&self.backend.windows).remove(share_key);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity::parse(v).unwrap()))
            .collect()
    }

    #[test]
    fn capacity_names_map_to_directions() {
        assert_eq!(
            rates(&limits(&[(BANDWIDTH, "2G")])).unwrap(),
            (Some(2_000_000_000), Some(2_000_000_000))
        );
        // Kubernetes' names are from the pod's side: its ingress is traffic to it.
        assert_eq!(
            rates(&limits(&[(INGRESS, "50M"), (EGRESS, "10M")])).unwrap(),
            (Some(50_000_000), Some(10_000_000))
        );
        assert_eq!(
            rates(&limits(&[(EGRESS, "10M")])).unwrap(),
            (None, Some(10_000_000))
        );
        // A fractional rate is rounded up to whole bit/s, never down.
        assert_eq!(
            rates(&limits(&[(INGRESS, "1500m")])).unwrap(),
            (Some(2), None)
        );
    }

    #[test]
    fn unknown_or_zero_rates_are_refused() {
        assert!(rates(&limits(&[("memory", "1Gi")])).is_err());
        assert!(rates(&limits(&[(BANDWIDTH, "0")])).is_err());
    }

    #[test]
    fn pin_names_are_per_share_and_direction() {
        let a = link_name("k", Direction::ToPod);
        assert_ne!(a, link_name("k", Direction::FromPod));
        assert_ne!(a, link_name("j", Direction::ToPod));
    }

    #[test]
    fn slots_are_the_lowest_free_whatever_the_interface_index() {
        let rec = |k: &str, host_index: u32, slot: Option<u32>| Installed {
            share_key: k.into(),
            mechanism: Mechanism::HtbEbpf,
            host_index,
            host_name: "v".into(),
            to_pod_bps: Some(1),
            from_pod_bps: None,
            queue: None,
            slot,
            path_bps: None,
            count_only: false,
            more_hosts: Vec::new(),
            to_queue: None,
        };
        assert_eq!(free_slot(&[]).unwrap(), 0);
        // A legacy record holds its interface index; an allocated one its slot.
        let others = [
            rec("a", 0, None),
            rec("b", 20_001, Some(1)),
            rec("c", 50_000, None),
        ];
        assert_eq!(free_slot(&others).unwrap(), 2);
        let full: Vec<Installed> = (0..shareguard_ebpf_common::MAX_SLOTS)
            .map(|s| rec("x", 30_000 + s, Some(s)))
            .collect();
        assert!(
            free_slot(&full).is_err(),
            "every slot held: refused, not wrapped"
        );
    }
}
