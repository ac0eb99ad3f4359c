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

/// Brings the record `old` of an installed share to the pods' veths `wanted`: a pod that
/// left is taken off its veth; the first veth stays first while its pod stays, else the
/// earliest one that stays takes its place, its pinned links renamed to the first's (a
/// rename: its programs run on throughout). `old` is left saying what is installed now.
/// Returns the first veth and the others, new ones last.
fn regroup(
    bpf: &mut Bpf,
    old: &mut Installed,
    wanted: &[Host],
) -> Result<(Host, Vec<Host>), NetError> {
    for (h, first) in old.hosts() {
        if !wanted.contains(&h) {
            leave_host(bpf, old, &h, first)?;
        }
    }
    let mut stay: Vec<Host> = old
        .more_hosts
        .iter()
        .filter(|h| wanted.contains(h))
        .cloned()
        .collect();
    let old_first = Host {
        index: old.host_index,
        name: old.host_name.clone(),
    };
    let first = if wanted.contains(&old_first) {
        old_first
    } else if stay.is_empty() {
        wanted[0].clone()
    } else {
        let next = stay.remove(0);
        for dir in [Direction::ToPod, Direction::FromPod] {
            bpf.rename_link(
                &more_link_name(&old.share_key, dir, next.index),
                &link_name(&old.share_key, dir),
            )
            .map_err(bpf_err)?;
        }
        next
    };
    old.host_index = first.index;
    old.host_name = first.name.clone();
    old.more_hosts = stay.clone();
    for h in wanted {
        if *h != first && !stay.contains(h) {
            stay.push(h.clone());
        }
    }
    Ok((first, stay))
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
            available = ?probe.available(),
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
            burst::spawn(Arc::downgrade(&backend), w)?;
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
        })
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

    /// The rate one direction is enforced at on one of the share's host veths, read back
    /// from the kernel: the HTB class's rate, or the rate in the programs' map while they
    /// are attached, flagged for the direction and (for EDT) an fq is at the root of the
    /// device that queues it. For an unconstrained direction, the path's line rate while
    /// the programs that count it are attached and nothing of ours shapes it.
    /// `queues`: the queue devices of traffic from the pods and to them, where there are.
    fn direction_rate(
        &self,
        bpf: &Bpf,
        i: &Installed,
        (host, first): (&Host, bool),
        dir: Direction,
        cfg: Option<&IfaceConfig>,
        (queue_index, to_queue_index): (Option<u32>, Option<u32>),
    ) -> Result<Option<u64>, NetError> {
        let wanted = match dir {
            Direction::ToPod => i.to_pod_bps,
            Direction::FromPod => i.from_pod_bps,
        };
        if wanted.is_none() {
            return Ok(None);
        }
        let attached = || {
            bpf.is_attached(&host_link(&i.share_key, dir, host, first), host.index)
                .map_err(bpf_err)
        };
        let looped = |c: &IfaceConfig| c.flags & FLAG_TO_POD_QUEUE != 0;
        if i.unconstrained(dir) {
            // Something of ours still shaping it (left over, or drift) is not "nothing
            // shapes it": that is reported as not read back.
            let paced = cfg.is_some_and(|c| {
                let p = c.pacing(dir.index());
                p.edt
                    || p.police
                    || (dir == Direction::FromPod && c.redirect_ifindex != 0)
                    || (dir == Direction::ToPod && looped(c))
            });
            let queued = match (dir, i.mechanism.qdisc_kind()) {
                (Direction::ToPod, Some(kind)) => root_is_ours(host.index, kind)?,
                (Direction::FromPod, _) => queue_index.is_some(),
                (Direction::ToPod, None) => false,
            };
            return Ok(match (i.path_bps, cfg) {
                (Some(path), Some(_)) if !paced && !queued && attached()? => Some(path),
                _ => None,
            });
        }
        // Traffic from the pod reaches its queue only through the program's redirect, and
        // traffic to the pods their shared queue only through the loop.
        let redirected = |cfg: &IfaceConfig| match dir {
            Direction::ToPod => true,
            Direction::FromPod => queue_index.is_some_and(|q| cfg.redirect_ifindex == q),
        };
        let pacing = cfg.map(|c| c.pacing(dir.index()));
        // Where this direction's traffic queues: the veth itself, or a queue device.
        let queue = match dir {
            Direction::ToPod => Some(host.index),
            Direction::FromPod => queue_index,
        };
        Ok(match i.mechanism {
            Mechanism::HtbEbpf if dir == Direction::ToPod && i.to_queue.is_some() => {
                match (to_queue_index, cfg, i.slot()) {
                    (Some(q), Some(c), Some(slot))
                        if looped(c)
                            && bpf.to_pod_queue(slot).map_err(bpf_err)? == q
                            && attached()? =>
                    {
                        htb_tree_bps(q)?
                    }
                    _ => None,
                }
            }
            Mechanism::HtbEbpf => match queue {
                // HTB's default class catches all traffic to the pod, so that direction
                // holds even without the classifier or its configuration.
                Some(q)
                    if dir == Direction::ToPod || (cfg.is_some_and(redirected) && attached()?) =>
                {
                    htb_tree_bps(q)?
                }
                _ => None,
            },
            Mechanism::EdtFq => match (queue, cfg, pacing) {
                (Some(q), Some(c), Some(p))
                    if p.edt && redirected(c) && attached()? && root_is_ours(q, "fq")? =>
                {
                    Some(mechanism::pace_bps(&p.pace))
                }
                _ => None,
            },
            Mechanism::BpfPolicer => match pacing {
                Some(p) if p.police && attached()? => Some(mechanism::pace_bps(&p.pace)),
                _ => None,
            },
        })
    }

    /// The queue devices of `i` as they are now: (from the pods, to the pods).
    fn queue_indices(i: &Installed) -> Result<(Option<u32>, Option<u32>), NetError> {
        let index = |name: &Option<String>| -> Result<Option<u32>, NetError> {
            match name {
                Some(n) => rtnl::index_of(n),
                None => Ok(None),
            }
        };
        Ok((index(&i.queue)?, index(&i.to_queue)?))
    }

    /// What the kernel holds for the share: the limits read back, or with `observing`
    /// (the rollout's observe stage) that its traffic is counted and nothing shapes it.
    /// With several pods, each direction holds at the lowest rate read back on any of
    /// their veths, and not at all when one of them holds nothing.
    fn read_back(
        &self,
        bpf: &Bpf,
        spec: &LimitSpec,
        observing: bool,
    ) -> Result<Enforcement, NetError> {
        let i = self.backend.state.get(&spec.share_key)?.ok_or_else(|| {
            NetError::NotFound(format!("an installed limit for share {}", spec.share_key))
        })?;
        let hosts = i.hosts();
        let mut cfgs = Vec::with_capacity(hosts.len());
        for (h, _) in &hosts {
            if rtnl::name_of_index(h.index)?.as_deref() != Some(h.name.as_str()) {
                return Err(NetError::NotFound(format!(
                    "interface {} (#{}) the limit was installed on",
                    h.name, h.index
                )));
            }
            cfgs.push(bpf.iface(h.index).map_err(bpf_err)?);
        }
        let queues = Self::queue_indices(&i)?;
        if i.count_only != observing {
            return Err(NetError::OtherStage(if observing {
                format!(
                    "share {} is limited while its device observes",
                    spec.share_key
                )
            } else {
                format!(
                    "share {} is only counted (installed for the observe stage), not limited",
                    spec.share_key
                )
            }));
        }
        if observing {
            for ((h, first), cfg) in hosts.iter().zip(&cfgs) {
                self.read_counting(bpf, &i, (h, *first), cfg.as_ref(), queues)?;
            }
            return Ok(counting(&i));
        }
        for (index, g) in governed_directions(&i, queues) {
            self.backend.bursts.found(index, g);
        }
        let rate = |dir: Direction| -> Result<Option<u64>, NetError> {
            let mut low: Option<u64> = None;
            for ((h, first), cfg) in hosts.iter().zip(&cfgs) {
                match self.direction_rate(bpf, &i, (h, *first), dir, cfg.as_ref(), queues)? {
                    Some(r) => low = Some(low.map_or(r, |l| l.min(r))),
                    None => return Ok(None),
                }
            }
            Ok(low)
        };
        let to_pod = rate(Direction::ToPod)?;
        let from_pod = rate(Direction::FromPod)?;
        // What was read back is configuration; whether the traffic passes it is the
        // programs' place in the chain and the counters.
        let ahead = self.ahead(bpf, &i)?;
        let sample = self.sample(bpf, &i, queues.1)?;
        let names = host_names(&i);
        let bypassed = {
            let mut windows = lock_windows(&self.backend.windows);
            match windows.get_mut(&i.share_key) {
                Some(w) => w.judge(sample, &names, &ahead),
                None => {
                    windows.insert(i.share_key.clone(), Window::new(sample));
                    None
                }
            }
        };
        if let Some(why) = bypassed {
            return Err(NetError::Bypassed(why));
        }
        if !ahead.is_empty() {
            return Err(NetError::Bypassed(format!(
                "another program on {names} runs before shareguard's ({}), and may end the chain before the limit",
                bypass::describe_ahead(&ahead)
            )));
        }
        let q = |bps: u64| Quantity::from_units(i128::from(bps), Format::DecimalSI);
        let mut enforced = BTreeMap::new();
        let mut unconstrained = std::collections::BTreeSet::new();
        let read = |dir: Direction| match dir {
            Direction::ToPod => to_pod,
            Direction::FromPod => from_pod,
        };
        for name in spec.limits.keys() {
            let dirs = directions(name);
            if dirs.is_empty() {
                continue;
            }
            if dirs.iter().all(|&d| i.unconstrained(d)) {
                unconstrained.insert(name.clone());
            }
            // What holds the capacity: the lowest of its directions', once each of them
            // was read back.
            let v = dirs
                .iter()
                .try_fold(u64::MAX, |low, &d| read(d).map(|r| low.min(r)));
            if let Some(v) = v.and_then(q) {
                enforced.insert(name.clone(), v);
            }
        }
        // Every mechanism here holds whole bytes per second, rounded down (never faster
        // than the limit): a rate that is not a multiple of 8 bit/s reads back below it.
        let resolution = enforced
            .keys()
            .filter_map(|name| Some((name.clone(), q(8)?)))
            .collect();
        let all_free = !unconstrained.is_empty() && unconstrained.len() == spec.limits.len();
        Ok(Enforcement {
            mechanism: if all_free {
                UNCONSTRAINED.to_owned()
            } else {
                i.mechanism.name().to_owned()
            },
            enforced,
            unconstrained,
            resolution,
            ..Enforcement::default()
        })
    }
}

impl NetLimiter {
    /// Installs share `spec`: limited, or counted only (`count_only`, the rollout's
    /// observe stage). Switching between the two takes the old installation down first.
    fn install(&self, spec: &LimitSpec, count_only: bool) -> Result<Enforcement, LimiterError> {
        let state = &self.backend.state;
        let mut bpf = lock(&self.backend.bpf);
        let (to, from) = rates(&spec.limits)?;
        // The agent found these interfaces as the host sides of the pods' veths; a share
        // is never put on any other.
        let mut wanted: Vec<Host> = spec
            .target
            .host_ifaces
            .iter()
            .map(|h| Host {
                index: h.index,
                name: h.name.clone(),
            })
            .collect();
        wanted.sort();
        wanted.dedup();
        if wanted.is_empty() {
            return Err(LimiterError::permanent(
                "a bandwidth share needs the host side of its pod's veth, and none was found",
            ));
        }
        for h in &wanted {
            if rtnl::name_of_index(h.index)?.as_deref() != Some(h.name.as_str()) {
                return Err(
                    NetError::NotFound(format!("interface {} (#{})", h.name, h.index)).into(),
                );
            }
        }
        // One read of the records: other shares on these interfaces, and this share's own.
        let (mut existing, others): (Vec<Installed>, Vec<Installed>) = state
            .all()?
            .into_iter()
            .partition(|i| i.share_key == spec.share_key);
        for h in &wanted {
            if let Some(other) = others.iter().find(|o| o.has_host(h.index, &h.name)) {
                return Err(NetError::Conflict(format!(
                    "interface {} is already limited by share {}",
                    h.name, other.share_key
                ))
                .into());
            }
        }
        // The queue devices and the pinned links are named after twelve hex digits of the key's
        // hash; two live shares with one short id would share them.
        let id = short_id(&spec.share_key);
        if let Some(other) = others.iter().find(|o| short_id(&o.share_key) == id) {
            return Err(NetError::Conflict(format!(
                "share keys {} and {} hash to the same short id {id}, which names their queue devices and pins",
                spec.share_key, other.share_key
            ))
            .into());
        }
        let mut existing = existing.pop();
        if let Some(old) = &existing
            && (old.mechanism != self.mechanism
                || old.path_bps != self.line_rate_bps
                || old.count_only != count_only)
        {
            // The device now uses another mechanism or line rate (which may shape what
            // was unconstrained, or the reverse), or the share changes stage: take the
            // old limit down and install afresh.
            self.uninstall(&mut bpf, old)?;
            state.remove(&spec.share_key)?;
            existing = None;
        }
        // The pods' veths in the order the record keeps them: a pod that stays keeps its
        // place (and its pinned links), one that left is taken off first.
        let before = existing.as_ref().map(Installed::hosts);
        let (first, more) = match existing.as_mut() {
            Some(old) => regroup(&mut bpf, old, &wanted)?,
            None => (wanted[0].clone(), wanted[1..].to_vec()),
        };
        let hosts: Vec<(Host, bool)> = std::iter::once((first.clone(), true))
            .chain(more.iter().map(|h| (h.clone(), false)))
            .collect();
        let kind = self.mechanism.qdisc_kind();
        let mut roots_ours = Vec::with_capacity(hosts.len());
        for (h, _) in &hosts {
            let root = rtnl::root_qdisc(h.index)?;
            let ours = root.as_ref().is_some_and(|q| is_ours(q, kind));
            let known = existing
                .as_ref()
                .is_some_and(|e| e.has_host(h.index, &h.name));
            if let Some(rtnl::RootQdisc { kind, major, .. }) = &root
                && *major != 0
                && !(ours && known)
            {
                // Someone else's qdisc: replacing it would break the promise to leave the
                // interface as it was found. (The policer installs none, but a foreign
                // root qdisc is refused for it too: it would queue the share's traffic in
                // ways the share's status could not report.)
                return Err(NetError::Conflict(format!(
                    "interface {} already has a root qdisc {kind} {major}: that was not installed by shareguard",
                    h.name
                ))
                .into());
            }
            roots_ours.push(ours);
        }
        // A share keeps its slot while it stays installed (its counters continue).
        let slot = match existing.as_ref().and_then(|e| e.slot) {
            Some(s) => s,
            None => free_slot(&others)?,
        };
        // An unconstrained direction gets no qdisc and no redirect, and an observed
        // share none in either direction; the programs still count them.
        let shaped = |bps| state::shaped(bps, self.line_rate_bps).filter(|_| !count_only);
        let several = hosts.len() > 1 || existing.as_ref().is_some_and(|e| e.to_queue.is_some());
        let plan = self.mechanism.plan(shaped(to), shaped(from), slot, several);
        // Traffic from the pod is redirected to a queue device when something has to
        // queue it; the released packets come back through its peer (see the programs).
        // Traffic to several pods likewise, to a queue device of its own.
        let queue_dev = plan.queue_root.map(|_| queue_name(&spec.share_key));
        let to_queue_dev = plan.to_queue_root.map(|_| to_queue_name(&spec.share_key));
        if queue_dev.is_some() || to_queue_dev.is_some() {
            for (h, _) in &hosts {
                if shareguard_ebpf_common::loop_mark(h.index).is_none() {
                    return Err(NetError::Unsupported(format!(
                        "interface {} has index {}, beyond the {} the queue loop's packet mark can carry",
                        h.name,
                        h.index,
                        shareguard_ebpf_common::LOOP_MARK_IFINDEX
                    ))
                    .into());
                }
            }
        }
        // Record first: if anything below fails or the agent dies, remove() still knows
        // what to clean up.
        let installed = Installed {
            share_key: spec.share_key.clone(),
            mechanism: self.mechanism,
            host_index: first.index,
            host_name: first.name.clone(),
            more_hosts: more,
            to_pod_bps: to,
            from_pod_bps: from,
            queue: queue_dev.clone(),
            slot: Some(slot),
            path_bps: self.line_rate_bps,
            count_only,
            to_queue: to_queue_dev.clone(),
        };
        let fresh = existing.is_none();
        state.put(&installed)?;
        if let Some(q) = &plan.veth_root {
            for ((h, _), ours) in hosts.iter().zip(&roots_ours) {
                // The root read above: a foreign one was refused, so it is ours or none.
                install_root(&h.name, h.index, q, *ours)?;
            }
        }
        let mut cfg = plan.iface;
        if let (Some(q), Some(name)) = (&plan.queue_root, &queue_dev) {
            let (queue, back) =
                rtnl::ensure_queue_pair(name, &return_name(&spec.share_key), &spec.share_key)?;
            cfg.redirect_ifindex = queue;
            let ours = matches!(q, RootQdisc::Htb(_)) && root_is_ours(cfg.redirect_ifindex, "htb")?;
            install_root(name, cfg.redirect_ifindex, q, ours)?;
            // Before the redirect is configured: a packet the queue releases must find
            // its way back.
            bpf.attach_return(back, &return_link_name(&spec.share_key))
                .map_err(bpf_err)?;
        } else {
            bpf.detach(&return_link_name(&spec.share_key))
                .map_err(bpf_err)?;
        }
        let mut to_queue_index = None;
        if let (Some(q), Some(name)) = (&plan.to_queue_root, &to_queue_dev) {
            let (queue, back) =
                rtnl::ensure_queue_pair(name, &to_return_name(&spec.share_key), &spec.share_key)?;
            install_root(name, queue, q, root_is_ours(queue, "htb")?)?;
            bpf.attach_return(back, &to_return_link_name(&spec.share_key))
                .map_err(bpf_err)?;
            // Before any veth is configured for the loop: the programs drop what they
            // would redirect to no queue.
            bpf.set_to_pod_queue(slot, queue).map_err(bpf_err)?;
            to_queue_index = Some(queue);
        }
        if fresh {
            // Pacing state or counts another share left in this slot would hold or drop
            // this one's packets, or be reported as its traffic.
            bpf.reset_counters(cfg.slot).map_err(bpf_err)?;
        }
        for (h, first) in &hosts {
            bpf.set_iface(h.index, cfg).map_err(bpf_err)?;
            for dir in [Direction::ToPod, Direction::FromPod] {
                bpf.attach(h.index, dir, &host_link(&spec.share_key, dir, h, *first))
                    .map_err(bpf_err)?;
            }
        }
        if to_queue_index.is_some() {
            // The veths' own HTB (the layout of one pod) goes once their traffic takes
            // the loop: until then it still held them, so no packet passed unshaped.
            for ((h, _), ours) in hosts.iter().zip(&roots_ours) {
                if *ours && root_is_ours(h.index, "htb")? {
                    tc::remove_root(&h.name)?;
                }
            }
        }

        // A share installed afresh counts from 0 in its slot: a new window from here
        // (one across the reset would read the interface's traffic as unseen). A repair
        // keeps its window, so that the next read-back judges the whole period since the
        // last; a verdict already given stands until a whole window says otherwise. A
        // pod that joined or left changes what the interfaces' counters add up to: a new
        // window from here too.
        let regrouped = before.is_some_and(|b| b != installed.hosts());
        if (fresh || regrouped) && !count_only {
            let sample = self.sample(&bpf, &installed, to_queue_index)?;
            lock_windows(&self.backend.windows)
                .entry(spec.share_key.clone())
                .and_modify(|w| w.base = sample)
                .or_insert_with(|| Window::new(sample));
        }
        // The tree was (re)installed with the idle bucket: the share is armed, and gets
        // the full one once it uses its rate.
        let queue_index = (cfg.redirect_ifindex != 0).then_some(cfg.redirect_ifindex);
        for (index, g) in governed_directions(&installed, (queue_index, to_queue_index)) {
            self.backend.bursts.installed(&mut bpf, index, g)?;
        }
        Ok(self.read_back(&bpf, spec, count_only)?)
    }
}

impl NetLimiter {
    /// The hooks of the share's host veths where another program runs before ours:
    /// (hook, programs ahead, summed over the veths) each; empty when ours run first on
    /// every one.
    fn ahead(&self, bpf: &Bpf, i: &Installed) -> Result<Vec<(&'static str, usize)>, NetError> {
        let mut out = Vec::new();
        for (dir, hook) in [
            (Direction::ToPod, "egress"),
            (Direction::FromPod, "ingress"),
        ] {
            let mut n = 0;
            for (h, first) in i.hosts() {
                n += bpf
                    .ahead_of(&host_link(&i.share_key, dir, &h, first), h.index, dir)
                    .map_err(bpf_err)?
                    .unwrap_or(0);
            }
            if n > 0 {
                out.push((hook, n));
            }
        }
        Ok(out)
    }

    /// The counters [`crate::bypass`] compares, read now, over all of the share's veths.
    /// A direction the share does not limit reads as fully seen: what passes it unseen
    /// takes nothing from the limit. `to_queue_index`: the to-pod queue device, where
    /// traffic to the pods queues instead of on each veth.
    fn sample(
        &self,
        bpf: &Bpf,
        i: &Installed,
        to_queue_index: Option<u32>,
    ) -> Result<Sample, NetError> {
        let at = Instant::now();
        let (mut rx, mut tx, mut pod_rx) = (0u64, 0u64, Some(0u64));
        let (mut queue_drops, mut queue_held) = (0u64, 0u64);
        let kind = i.mechanism.qdisc_kind();
        let shaped_to = i.shaped(Direction::ToPod).is_some();
        for (h, _) in i.hosts() {
            let iface = rtnl::link_packets(h.index)?.ok_or_else(|| {
                NetError::NotFound(format!("interface {} (#{})", h.name, h.index))
            })?;
            rx = rx.wrapping_add(iface.rx);
            tx = tx.wrapping_add(iface.tx);
            if i.to_queue.is_none()
                && shaped_to
                && let Some(q) = rtnl::root_qdisc(h.index)?.filter(|q| is_ours(q, kind))
            {
                queue_drops = queue_drops.wrapping_add(q.drops);
                queue_held = queue_held.wrapping_add(q.qlen);
            }
            // Best effort: a pod end that cannot be read now (its namespace going away)
            // means nothing can be told of traffic past the host veth, not drift.
            pod_rx = match (pod_rx, i.to_pod_bps) {
                (Some(sum), Some(_)) => rtnl::peer_packets(h.index)
                    .ok()
                    .flatten()
                    .map(|p| sum.wrapping_add(p.rx)),
                _ => None,
            };
        }
        if let Some(q) = to_queue_index
            .filter(|_| shaped_to)
            .map(rtnl::root_qdisc)
            .transpose()?
            .flatten()
            .filter(|q| is_ours(q, kind))
        {
            queue_drops = queue_drops.wrapping_add(q.drops);
            queue_held = queue_held.wrapping_add(q.qlen);
        }
        let (to, from) = match i.slot() {
            Some(slot) => bpf.counters(slot).map_err(bpf_err)?,
            None => Default::default(),
        };
        let seen = |c: shareguard_ebpf_common::Counters| c.packets.wrapping_add(c.drops);
        Ok(Sample {
            at,
            received: rx,
            sent: tx,
            seen_from_pod: if i.from_pod_bps.is_some() {
                seen(from)
            } else {
                rx
            },
            seen_to_pod: if i.to_pod_bps.is_some() { seen(to) } else { tx },
            queue_drops,
            queue_held,
            pod_received: pod_rx,
        })
    }

    /// An observed share as the kernel holds it on one of its veths: both programs
    /// attached to count it, and nothing of ours paces, redirects or queues its traffic.
    fn read_counting(
        &self,
        bpf: &Bpf,
        i: &Installed,
        (host, first): (&Host, bool),
        cfg: Option<&IfaceConfig>,
        (queue_index, to_queue_index): (Option<u32>, Option<u32>),
    ) -> Result<(), NetError> {
        let Some(cfg) = cfg else {
            return Err(NetError::NotFound(format!(
                "the counting configuration of interface {}",
                host.name
            )));
        };
        if cfg.flags != 0 || cfg.redirect_ifindex != 0 || cfg.classid != 0 {
            return Err(NetError::OtherStage(format!(
                "share {} is paced or classified on {} while its device observes",
                i.share_key, host.name
            )));
        }
        let queued = match self.mechanism.qdisc_kind() {
            Some(kind) => root_is_ours(host.index, kind)?,
            None => false,
        };
        if queued || queue_index.is_some() || to_queue_index.is_some() {
            return Err(NetError::OtherStage(format!(
                "a queue of ours still shapes share {} while its device observes",
                i.share_key
            )));
        }
        for dir in [Direction::ToPod, Direction::FromPod] {
            if !bpf
                .is_attached(&host_link(&i.share_key, dir, host, first), host.index)
                .map_err(bpf_err)?
            {
                return Err(NetError::NotFound(format!(
                    "the program counting traffic {} on {}",
                    match dir {
                        Direction::ToPod => "to the pod",
                        Direction::FromPod => "from the pod",
                    },
                    host.name
                )));
            }
        }
        Ok(())
    }
}

/// The read-back of an observed share whose every veth counts it ([`NetLimiter::read_counting`]).
fn counting(i: &Installed) -> Enforcement {
    Enforcement {
        mechanism: i.mechanism.name().to_owned(),
        observed: true,
        notes: vec![
            "its traffic is counted in both directions, with the time it ran above its allocated rate".to_owned(),
        ],
        ..Enforcement::default()
    }
}

/// The share's veths by name, for messages.
fn host_names(i: &Installed) -> String {
    i.hosts()
        .iter()
        .map(|(h, _)| h.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Limiter for NetLimiter {
    fn mechanisms(&self) -> Vec<String> {
        vec![self.mechanism.name().to_owned()]
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn device_facts(&self, _device: &str) -> DeviceFacts {
        DeviceFacts {
            mechanism: self.mechanism.name().to_owned(),
            enforces: true,
            attributes: Default::default(),
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
