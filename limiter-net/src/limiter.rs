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
use shareguard_ebpf_common::IfaceConfig;
use tracing::info;

use crate::{
    bpf::{Bpf, Direction},
    burst,
    bypass::{self, Sample, Window},
    error::NetError,
    mechanism::{self, Mechanism, RootQdisc},
    probe::{self, Probe},
    rtnl,
    state::{self, Installed, StateDir, queue_name, return_name, short_id},
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

/// The file name of a share's pinned link for one direction, under `<pin_dir>/links/`.
pub fn link_name(share_key: &str, dir: Direction) -> String {
    let d = match dir {
        Direction::ToPod => "to-pod",
        Direction::FromPod => "from-pod",
    };
    format!("{}-{d}", short_id(share_key))
}

/// The file name of a share's pinned link on the ingress of its return device.
pub fn return_link_name(share_key: &str) -> String {
    format!("{}-return", short_id(share_key))
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
/// `htb-ebpf` shapes whose idle bucket is smaller than their busy one. `queue_index`: the
/// queue device that queues traffic from the pod, where there is one.
fn governed_directions(i: &Installed, queue_index: Option<u32>) -> Vec<(u32, burst::Governed)> {
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
            bpf.detach(&link_name(&i.share_key, dir)).map_err(bpf_err)?;
        }
        bpf.detach(&return_link_name(&i.share_key))
            .map_err(bpf_err)?;
        // The ifindex may already belong to a new interface; its entry is ours either way.
        bpf.clear_iface(i.host_index).map_err(bpf_err)?;
        let still_there =
            rtnl::name_of_index(i.host_index)?.as_deref() == Some(i.host_name.as_str());
        if still_there
            && i.shaped(Direction::ToPod).is_some()
            && let Some(kind) = i.mechanism.qdisc_kind()
            && root_is_ours(i.host_index, kind)?
        {
            tc::remove_root(&i.host_name)?;
        }
        if let Some(queue) = &i.queue {
            rtnl::delete_queue(queue, &i.share_key)?;
        }
        Ok(())
    }

    /// The rate one direction is enforced at, read back from the kernel: the HTB class's
    /// rate, or the rate in the programs' map while they are attached, flagged for the
    /// direction and (for EDT) an fq is at the root of the device that queues it. For an
    /// unconstrained direction, the path's line rate while the programs that count it
    /// are attached and nothing of ours shapes it.
    fn direction_rate(
        &self,
        bpf: &Bpf,
        i: &Installed,
        dir: Direction,
        cfg: Option<&IfaceConfig>,
        queue_dev_index: Option<u32>,
    ) -> Result<Option<u64>, NetError> {
        // Where this direction's traffic queues: the veth itself, or the queue device.
        let (wanted, queue_index) = match dir {
            Direction::ToPod => (i.to_pod_bps, Some(i.host_index)),
            Direction::FromPod => (i.from_pod_bps, queue_dev_index),
        };
        if wanted.is_none() {
            return Ok(None);
        }
        let attached = || {
            bpf.is_attached(&link_name(&i.share_key, dir), i.host_index)
                .map_err(bpf_err)
        };
        if i.unconstrained(dir) {
            // Something of ours still shaping it (left over, or drift) is not "nothing
            // shapes it": that is reported as not read back.
            let paced = cfg.is_some_and(|c| {
                let p = c.pacing(dir.index());
                p.edt || p.police || (dir == Direction::FromPod && c.redirect_ifindex != 0)
            });
            let queued = match (dir, i.mechanism.qdisc_kind()) {
                (Direction::ToPod, Some(kind)) => root_is_ours(i.host_index, kind)?,
                (Direction::FromPod, _) => queue_index.is_some(),
                (Direction::ToPod, None) => false,
            };
            return Ok(match (i.path_bps, cfg) {
                (Some(path), Some(_)) if !paced && !queued && attached()? => Some(path),
                _ => None,
            });
        }
        // Traffic from the pod reaches its queue only through the program's redirect.
        let redirected = |cfg: &IfaceConfig| {
            dir == Direction::ToPod || queue_index.is_some_and(|q| cfg.redirect_ifindex == q)
        };
        let pacing = cfg.map(|c| c.pacing(dir.index()));
        Ok(match i.mechanism {
            Mechanism::HtbEbpf => match queue_index {
                // HTB's default class catches all traffic to the pod, so that direction
                // holds even without the classifier or its configuration.
                Some(q)
                    if dir == Direction::ToPod || (cfg.is_some_and(redirected) && attached()?) =>
                {
                    htb_tree_bps(q)?
                }
                _ => None,
            },
            Mechanism::EdtFq => match (queue_index, cfg, pacing) {
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

    /// What the kernel holds for the share: the limits read back, or with `observing`
    /// (the rollout's observe stage) that its traffic is counted and nothing shapes it.
    fn read_back(
        &self,
        bpf: &Bpf,
        spec: &LimitSpec,
        observing: bool,
    ) -> Result<Enforcement, NetError> {
        let i = self.backend.state.get(&spec.share_key)?.ok_or_else(|| {
            NetError::NotFound(format!("an installed limit for share {}", spec.share_key))
        })?;
        if rtnl::name_of_index(i.host_index)?.as_deref() != Some(i.host_name.as_str()) {
            return Err(NetError::NotFound(format!(
                "interface {} (#{}) the limit was installed on",
                i.host_name, i.host_index
            )));
        }
        let cfg = bpf.iface(i.host_index).map_err(bpf_err)?;
        let queue_index = match &i.queue {
            Some(n) => rtnl::index_of(n)?,
            None => None,
        };
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
            return self.read_counting(bpf, &i, cfg.as_ref(), queue_index);
        }
        for (index, g) in governed_directions(&i, queue_index) {
            self.backend.bursts.found(index, g);
        }
        let to_pod = self.direction_rate(bpf, &i, Direction::ToPod, cfg.as_ref(), queue_index)?;
        let from_pod =
            self.direction_rate(bpf, &i, Direction::FromPod, cfg.as_ref(), queue_index)?;
        // What was read back is configuration; whether the traffic passes it is the
        // programs' place in the chain and the counters.
        let ahead = self.ahead(bpf, &i)?;
        let sample = self.sample(bpf, &i)?;
        let bypassed = {
            let mut windows = lock_windows(&self.backend.windows);
            match windows.get_mut(&i.share_key) {
                Some(w) => w.judge(sample, &i.host_name, &ahead),
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
                "another program on {} runs before shareguard's ({}), and may end the chain before the limit",
                i.host_name,
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
        // The agent found this interface as the host side of the pod's veth; a share is
        // never put on any other.
        let host = spec.target.host_iface.clone().ok_or_else(|| {
            LimiterError::permanent(
                "a bandwidth share needs the host side of its pod's veth, and none was found",
            )
        })?;
        if rtnl::name_of_index(host.index)?.as_deref() != Some(host.name.as_str()) {
            return Err(
                NetError::NotFound(format!("interface {} (#{})", host.name, host.index)).into(),
            );
        }
        // One read of the records: other shares on this interface, and this share's own.
        let (mut existing, others): (Vec<Installed>, Vec<Installed>) = state
            .all()?
            .into_iter()
            .partition(|i| i.share_key == spec.share_key);
        if let Some(other) = others
            .iter()
            .find(|o| o.host_index == host.index && o.host_name == host.name)
        {
            return Err(NetError::Conflict(format!(
                "interface {} is already limited by share {}",
                host.name, other.share_key
            ))
            .into());
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
            && (old.host_index != host.index
                || old.host_name != host.name
                || old.mechanism != self.mechanism
                || old.path_bps != self.line_rate_bps
                || old.count_only != count_only)
        {
            // The pod sandbox came back with a new interface, or the device now uses
            // another mechanism or line rate (which may shape what was unconstrained, or
            // the reverse): take the old limit down and install afresh.
            self.uninstall(&mut bpf, old)?;
            state.remove(&spec.share_key)?;
            existing = None;
        }
        let root = rtnl::root_qdisc(host.index)?;
        let root_ours = root
            .as_ref()
            .is_some_and(|q| is_ours(q, self.mechanism.qdisc_kind()));
        if let Some(rtnl::RootQdisc { kind, major, .. }) = &root
            && *major != 0
            && !(root_ours && existing.is_some())
        {
            // Someone else's qdisc: replacing it would break the promise to leave the
            // interface as it was found. (The policer installs none, but a foreign root
            // qdisc is refused for it too: it would queue the share's traffic in ways
            // the share's status could not report.)
            return Err(NetError::Conflict(format!(
                "interface {} already has a root qdisc {kind} {major}: that was not installed by shareguard",
                host.name
            ))
            .into());
        }
        // A share keeps its slot while it stays installed (its counters continue).
        let slot = match existing.as_ref().and_then(|e| e.slot) {
            Some(s) => s,
            None => free_slot(&others)?,
        };
        // An unconstrained direction gets no qdisc and no redirect, and an observed
        // share none in either direction; the programs still count them.
        let shaped = |bps| state::shaped(bps, self.line_rate_bps).filter(|_| !count_only);
        let plan = self.mechanism.plan(shaped(to), shaped(from), slot);
        // Traffic from the pod is redirected to a queue device when something has to
        // queue it; the released packets come back through its peer (see the programs).
        let queue_dev = plan.queue_root.map(|_| queue_name(&spec.share_key));
        if queue_dev.is_some() && shareguard_ebpf_common::loop_mark(host.index).is_none() {
            return Err(NetError::Unsupported(format!(
                "interface {} has index {}, beyond the {} the queue loop's packet mark can carry",
                host.name,
                host.index,
                shareguard_ebpf_common::LOOP_MARK_IFINDEX
            ))
            .into());
        }
        // Record first: if anything below fails or the agent dies, remove() still knows
        // what to clean up.
        let installed = Installed {
            share_key: spec.share_key.clone(),
            mechanism: self.mechanism,
            host_index: host.index,
            host_name: host.name.clone(),
            to_pod_bps: to,
            from_pod_bps: from,
            queue: queue_dev.clone(),
            slot: Some(slot),
            path_bps: self.line_rate_bps,
            count_only,
        };
        let fresh = existing.is_none();
        state.put(&installed)?;
        if let Some(q) = &plan.veth_root {
            // The root read above: a foreign one was refused, so it is ours or none.
            install_root(&host.name, host.index, q, root_ours)?;
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
        if fresh {
            // Pacing state or counts another share left in this slot would hold or drop
            // this one's packets, or be reported as its traffic.
            bpf.reset_counters(cfg.slot).map_err(bpf_err)?;
        }
        bpf.set_iface(host.index, cfg).map_err(bpf_err)?;
        for dir in [Direction::ToPod, Direction::FromPod] {
            bpf.attach(host.index, dir, &link_name(&spec.share_key, dir))
                .map_err(bpf_err)?;
        }

        // A share installed afresh counts from 0 in its slot: a new window from here
        // (one across the reset would read the interface's traffic as unseen). A repair
        // keeps its window, so that the next read-back judges the whole period since the
        // last; a verdict already given stands until a whole window says otherwise.
        if fresh && !count_only {
            let sample = self.sample(&bpf, &installed)?;
            lock_windows(&self.backend.windows)
                .entry(spec.share_key.clone())
                .and_modify(|w| w.base = sample)
                .or_insert_with(|| Window::new(sample));
        }
        // The tree was (re)installed with the idle bucket: the share is armed, and gets
        // the full one once it uses its rate.
        let queue_index = (cfg.redirect_ifindex != 0).then_some(cfg.redirect_ifindex);
        for (index, g) in governed_directions(&installed, queue_index) {
            self.backend.bursts.installed(&mut bpf, index, g)?;
        }
        Ok(self.read_back(&bpf, spec, count_only)?)
    }
}

impl NetLimiter {
    /// The hooks of the share's host veth where another program runs before ours:
    /// (hook, programs ahead) each; empty when ours run first on both.
    fn ahead(&self, bpf: &Bpf, i: &Installed) -> Result<Vec<(&'static str, usize)>, NetError> {
        let mut out = Vec::new();
        for (dir, hook) in [
            (Direction::ToPod, "egress"),
            (Direction::FromPod, "ingress"),
        ] {
            if let Some(n) = bpf
                .ahead_of(&link_name(&i.share_key, dir), i.host_index, dir)
                .map_err(bpf_err)?
            {
                out.push((hook, n));
            }
        }
        Ok(out)
    }

    /// The counters [`crate::bypass`] compares, read now. A direction the share does not limit
    /// reads as fully seen: what passes it unseen takes nothing from the limit.
    fn sample(&self, bpf: &Bpf, i: &Installed) -> Result<Sample, NetError> {
        let at = Instant::now();
        let iface = rtnl::link_packets(i.host_index)?.ok_or_else(|| {
            NetError::NotFound(format!("interface {} (#{})", i.host_name, i.host_index))
        })?;
        let (to, from) = match i.slot() {
            Some(slot) => bpf.counters(slot).map_err(bpf_err)?,
            None => Default::default(),
        };
        let queue = match i.mechanism.qdisc_kind() {
            Some(kind) if i.shaped(Direction::ToPod).is_some() => {
                rtnl::root_qdisc(i.host_index)?.filter(|q| is_ours(q, Some(kind)))
            }
            _ => None,
        };
        let seen = |c: shareguard_ebpf_common::Counters| c.packets.wrapping_add(c.drops);
        Ok(Sample {
            at,
            received: iface.rx,
            sent: iface.tx,
            seen_from_pod: if i.from_pod_bps.is_some() {
                seen(from)
            } else {
                iface.rx
            },
            seen_to_pod: if i.to_pod_bps.is_some() {
                seen(to)
            } else {
                iface.tx
            },
            queue_drops: queue.as_ref().map_or(0, |q| q.drops),
            queue_held: queue.as_ref().map_or(0, |q| q.qlen),
            // Best effort: a pod end that cannot be read now (its namespace going away)
            // means nothing can be told of traffic past the host veth, not drift.
            pod_received: match i.to_pod_bps {
                Some(_) => rtnl::peer_packets(i.host_index)
                    .ok()
                    .flatten()
                    .map(|p| p.rx),
                None => None,
            },
        })
    }

    /// An observed share as the kernel holds it: both programs attached to count it, and
    /// nothing of ours paces, redirects or queues its traffic.
    fn read_counting(
        &self,
        bpf: &Bpf,
        i: &Installed,
        cfg: Option<&IfaceConfig>,
        queue_index: Option<u32>,
    ) -> Result<Enforcement, NetError> {
        let Some(cfg) = cfg else {
            return Err(NetError::NotFound(format!(
                "the counting configuration of interface {}",
                i.host_name
            )));
        };
        if cfg.flags != 0 || cfg.redirect_ifindex != 0 || cfg.classid != 0 {
            return Err(NetError::OtherStage(format!(
                "share {} is paced or classified on {} while its device observes",
                i.share_key, i.host_name
            )));
        }
        let queued = match self.mechanism.qdisc_kind() {
            Some(kind) => root_is_ours(i.host_index, kind)?,
            None => false,
        };
        if queued || queue_index.is_some() {
            return Err(NetError::OtherStage(format!(
                "a queue of ours still shapes share {} while its device observes",
                i.share_key
            )));
        }
        for dir in [Direction::ToPod, Direction::FromPod] {
            if !bpf
                .is_attached(&link_name(&i.share_key, dir), i.host_index)
                .map_err(bpf_err)?
            {
                return Err(NetError::NotFound(format!(
                    "the program counting traffic {} on {}",
                    match dir {
                        Direction::ToPod => "to the pod",
                        Direction::FromPod => "from the pod",
                    },
                    i.host_name
                )));
            }
        }
        Ok(Enforcement {
            mechanism: i.mechanism.name().to_owned(),
            observed: true,
            notes: vec![
                "its traffic is counted in both directions, with the time it ran above its allocated rate".to_owned(),
            ],
            ..Enforcement::default()
        })
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
        let queue_index = i
            .queue
            .as_deref()
            .and_then(|n| rtnl::index_of(n).ok().flatten());
        Some(TrafficCounters {
            to_pod_bytes: to.bytes,
            to_pod_packets: to.packets,
            from_pod_bytes: from.bytes,
            from_pod_packets: from.packets,
            drops: qdisc_drops(i.shaped(Direction::ToPod).map(|_| i.host_index))
                + qdisc_drops(queue_index)
                + to.drops
                + from.drops,
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
