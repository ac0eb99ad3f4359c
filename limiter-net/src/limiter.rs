//! The `net` limiter: both directions of a pod's traffic shaped on the host side, where
//! the pod cannot undo it.
//!
//! Mechanism `htb-ebpf` (the one this kernel kind supports: no `sch_fq`, so no EDT):
//! - to the pod: an HTB qdisc at the root of the pod's host-side veth, class `1:1` at the
//!   share's rate; the TCX egress program counts the traffic and classifies it into `1:1`
//!   through `skb->priority` (the class is also HTB's default, so nothing bypasses it);
//! - from the pod: the TCX ingress program counts the traffic and redirects it to the
//!   share's ifb device, whose root HTB shapes it before the packet re-enters the stack.
//!
//! Programs, maps and links are pinned under the agent's bpffs directory and the qdiscs
//! live in the kernel: killing the agent lifts no limit, and a restarted agent adopts
//! the pinned links instead of attaching again.

use std::{collections::BTreeMap, path::Path, sync::Mutex};

use shareguard_common::{
    Format, Quantity,
    limiter::{Enforcement, LimitSpec, Limiter, LimiterError, TrafficCounters},
};
use shareguard_ebpf_common::IfaceConfig;

use crate::{
    bpf::{Bpf, Direction},
    error::NetError,
    rtnl,
    state::{Installed, StateDir, ifb_name, short_id},
    tc::{self, HtbParams},
};

pub const MECHANISM: &str = "htb-ebpf";
/// Symmetric capacity: both directions at the same rate.
pub const BANDWIDTH: &str = "bandwidth";
/// Traffic from the pod (Kubernetes' `egress-bandwidth` is the pod's egress).
pub const EGRESS: &str = "egress-bandwidth";
/// Traffic to the pod.
pub const INGRESS: &str = "ingress-bandwidth";
/// The capacity names a `net` device may have.
pub const CAPACITIES: [&str; 3] = [BANDWIDTH, EGRESS, INGRESS];

/// Where the kernel's BPF filesystem is normally mounted.
const BPFFS: &str = "/sys/fs/bpf";

/// The interface inside the pod's namespace when the target names none.
const DEFAULT_POD_IFACE: &str = "eth0";

pub struct NetLimiter {
    /// One lock for the BPF maps and links and the interfaces: two shares must never
    /// interleave their changes to one interface.
    bpf: Mutex<Bpf>,
    state: StateDir,
}

fn link_name(share_key: &str, dir: Direction) -> String {
    let d = match dir {
        Direction::ToPod => "to-pod",
        Direction::FromPod => "from-pod",
    };
    format!("{}-{d}", short_id(share_key))
}

/// Counter slot for a host interface: its ifindex, when it fits the counters array.
fn slot_of(ifindex: u32) -> u32 {
    if ifindex < shareguard_ebpf_common::MAX_SLOTS {
        ifindex
    } else {
        u32::MAX
    }
}

/// (to the pod, from the pod) in bit/s.
fn rates(limits: &BTreeMap<String, Quantity>) -> Result<(Option<u64>, Option<u64>), NetError> {
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
        match name.as_str() {
            BANDWIDTH => {
                let v = bps(name, q)?;
                to = Some(v);
                from = Some(v);
            }
            INGRESS => to = Some(bps(name, q)?),
            EGRESS => from = Some(bps(name, q)?),
            other => {
                return Err(NetError::Conflict(format!(
                    "capacity {other:?} is not one the bandwidth limiter enforces ({})",
                    CAPACITIES.join(", ")
                )));
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

impl NetLimiter {
    /// `state_dir` keeps what was installed per share; `pin_dir` is the bpffs directory
    /// for maps and links (deterministic, so a restarted agent finds them).
    pub fn new(state_dir: &Path, pin_dir: &Path) -> Result<NetLimiter, NetError> {
        // Pins only outlive the agent on a BPF filesystem; mount the usual one if the
        // machine has none (minimal hosts and containers often do not).
        let bpffs = Path::new(BPFFS);
        if pin_dir.starts_with(bpffs) {
            crate::bpf::ensure_bpffs(bpffs).map_err(|e| NetError::Bpf(e.to_string()))?;
        }
        let bpf = Bpf::load(pin_dir).map_err(|e| NetError::Bpf(e.to_string()))?;
        Ok(NetLimiter {
            bpf: Mutex::new(bpf),
            state: StateDir::open(state_dir)?,
        })
    }

    fn uninstall(&self, bpf: &mut Bpf, i: &Installed) -> Result<(), NetError> {
        for dir in [Direction::ToPod, Direction::FromPod] {
            bpf.detach(&link_name(&i.share_key, dir))
                .map_err(|e| NetError::Bpf(e.to_string()))?;
        }
        // The ifindex may already belong to a new interface; its entry is ours either way.
        bpf.clear_iface(i.host_index)
            .map_err(|e| NetError::Bpf(e.to_string()))?;
        let still_there =
            rtnl::name_of_index(i.host_index)?.as_deref() == Some(i.host_name.as_str());
        if still_there
            && i.to_pod_bps.is_some()
            && rtnl::root_qdisc(i.host_index)?
                .is_some_and(|q| q.kind == "htb" && q.major == tc::MAJOR)
        {
            tc::remove_root(&i.host_name)?;
        }
        if let Some(ifb) = &i.ifb {
            rtnl::delete_link(ifb)?;
        }
        Ok(())
    }

    fn read_back(&self, bpf: &Bpf, spec: &LimitSpec) -> Result<Enforcement, NetError> {
        let i = self.state.get(&spec.share_key)?.ok_or_else(|| {
            NetError::NotFound(format!("an installed limit for share {}", spec.share_key))
        })?;
        if rtnl::name_of_index(i.host_index)?.as_deref() != Some(i.host_name.as_str()) {
            return Err(NetError::NotFound(format!(
                "interface {} (#{}) the limit was installed on",
                i.host_name, i.host_index
            )));
        }
        // HTB's default class catches all traffic to the pod, so that direction holds
        // even without the classifier; traffic from the pod is only shaped while the
        // ingress program redirects it to the ifb.
        let to_pod = match i.to_pod_bps {
            Some(_) => rtnl::htb_class_rate(i.host_index, tc::MAJOR, tc::MINOR)?.map(|b| b * 8),
            None => None,
        };
        let from_pod = match &i.ifb {
            Some(ifb) => match rtnl::index_of(ifb)? {
                Some(idx) => {
                    let cfg = bpf
                        .iface(i.host_index)
                        .map_err(|e| NetError::Bpf(e.to_string()))?;
                    let attached = bpf
                        .is_attached(&link_name(&i.share_key, Direction::FromPod), i.host_index)
                        .map_err(|e| NetError::Bpf(e.to_string()))?;
                    if attached && cfg.is_some_and(|c| c.redirect_ifindex == idx) {
                        rtnl::htb_class_rate(idx, tc::MAJOR, tc::MINOR)?.map(|b| b * 8)
                    } else {
                        None
                    }
                }
                None => None,
            },
            None => None,
        };
        let q = |bps: u64| Quantity::from_units(i128::from(bps), Format::DecimalSI);
        let mut enforced = BTreeMap::new();
        for name in spec.limits.keys() {
            let v = match name.as_str() {
                BANDWIDTH => to_pod.zip(from_pod).map(|(a, b)| a.min(b)),
                INGRESS => to_pod,
                EGRESS => from_pod,
                _ => None,
            };
            if let Some(v) = v.and_then(q) {
                enforced.insert(name.clone(), v);
            }
        }
        Ok(Enforcement {
            mechanism: MECHANISM.to_owned(),
            enforced,
        })
    }
}

impl Limiter for NetLimiter {
    fn mechanisms(&self) -> Vec<String> {
        vec![MECHANISM.to_owned()]
    }

    fn accounting_only(&self) -> bool {
        false
    }

    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let mut bpf = lock(&self.bpf);
        let (to, from) = rates(&spec.limits)?;
        let netns = spec.target.netns_path.as_deref();
        let ifname = spec.target.interface.as_deref();
        if netns.is_none() && ifname.is_none() {
            return Err(LimiterError::permanent(
                "a bandwidth share needs target.netns_path (and interface), or a host interface",
            ));
        }
        let host = rtnl::resolve(netns, ifname.unwrap_or(DEFAULT_POD_IFACE))?;
        for other in self.state.all()? {
            if other.share_key != spec.share_key
                && other.host_index == host.index
                && other.host_name == host.name
            {
                return Err(NetError::Conflict(format!(
                    "interface {} is already limited by share {}",
                    host.name, other.share_key
                ))
                .into());
            }
        }
        if let Some(old) = self.state.get(&spec.share_key)?
            && (old.host_index != host.index || old.host_name != host.name)
        {
            // The pod sandbox came back with a new interface: move the limit there.
            self.uninstall(&mut bpf, &old)?;
            self.state.remove(&spec.share_key)?;
        }
        if let Some(rtnl::RootQdisc { kind, major, .. }) = rtnl::root_qdisc(host.index)?
            && major != 0
            && !(kind == "htb" && major == tc::MAJOR && self.state.get(&spec.share_key)?.is_some())
        {
            // Someone else's qdisc: replacing it would break the promise to leave the
            // interface as it was found.
            return Err(NetError::Conflict(format!(
                "interface {} already has a root qdisc {kind} {major}: that was not installed by shareguard",
                host.name
            ))
            .into());
        }
        // Record first: if anything below fails or the agent dies, remove() still knows
        // what to clean up.
        let ifb = from.map(|_| ifb_name(&spec.share_key));
        let installed = Installed {
            share_key: spec.share_key.clone(),
            host_index: host.index,
            host_name: host.name.clone(),
            to_pod_bps: to,
            from_pod_bps: from,
            ifb: ifb.clone(),
        };
        self.state.put(&installed)?;
        let ours = |ifindex: u32| -> Result<bool, NetError> {
            Ok(rtnl::root_qdisc(ifindex)?.is_some_and(|q| q.kind == "htb" && q.major == tc::MAJOR))
        };
        if let Some(r) = to {
            tc::install_htb(&host.name, &HtbParams::for_rate(r), ours(host.index)?)?;
        }
        let mut redirect = 0;
        if let (Some(r), Some(name)) = (from, &ifb) {
            redirect = rtnl::ensure_ifb(name)?;
            tc::install_htb(name, &HtbParams::for_rate(r), ours(redirect)?)?;
        }
        let cfg = IfaceConfig {
            classid: if to.is_some() { tc::CLASSID } else { 0 },
            redirect_ifindex: redirect,
            slot: slot_of(host.index),
            flags: 0,
        };
        bpf.set_iface(host.index, cfg)
            .map_err(|e| NetError::Bpf(e.to_string()))?;
        for dir in [Direction::ToPod, Direction::FromPod] {
            bpf.attach(host.index, dir, &link_name(&spec.share_key, dir))
                .map_err(|e| NetError::Bpf(e.to_string()))?;
        }
        Ok(self.read_back(&bpf, spec)?)
    }

    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let bpf = lock(&self.bpf);
        Ok(self.read_back(&bpf, spec)?)
    }

    fn counters(&self, share_key: &str) -> Option<TrafficCounters> {
        let i = self.state.get(share_key).ok()??;
        let (to, from) = lock(&self.bpf).counters(slot_of(i.host_index)).ok()?;
        let drops = |ifindex: Option<u32>| {
            ifindex
                .and_then(|x| rtnl::root_qdisc(x).ok().flatten())
                .filter(|q| q.kind == "htb" && q.major == tc::MAJOR)
                .map_or(0, |q| q.drops)
        };
        let ifb_index = i
            .ifb
            .as_deref()
            .and_then(|n| rtnl::index_of(n).ok().flatten());
        Some(TrafficCounters {
            to_pod_bytes: to.bytes,
            to_pod_packets: to.packets,
            from_pod_bytes: from.bytes,
            from_pod_packets: from.packets,
            drops: drops(i.to_pod_bps.map(|_| i.host_index)) + drops(ifb_index),
        })
    }

    fn remove(&self, share_key: &str) -> Result<(), LimiterError> {
        let mut bpf = lock(&self.bpf);
        if let Some(i) = self.state.get(share_key)? {
            self.uninstall(&mut bpf, &i)?;
            self.state.remove(share_key)?;
        }
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
        assert_eq!(slot_of(7), 7);
        assert_eq!(
            slot_of(1 << 20),
            u32::MAX,
            "beyond the counters array: not counted"
        );
    }
}
