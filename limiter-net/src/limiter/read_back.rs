//! Reading back what the kernel holds for a share: the rate each direction is held
//! at on every one of its veths, whether its traffic passes the programs (their place
//! in the chain, and counters), and for an observed share that it is counted only.

use super::*;

/// What every veth of a share has in common, read once per read-back.
#[derive(Clone, Copy)]
struct Shared {
    /// The queue device of traffic from the pods, where there is one.
    from_queue: Option<u32>,
    /// For `htb-ebpf` traffic to several pods: the rate of the to-pod queue's HTB, read
    /// where the share's slot in `SG_TO_POD_QUEUES` points at that queue; None where it
    /// does not, or there is no such queue.
    to_queue_bps: Option<u64>,
}

impl NetLimiter {
    /// The rate one direction is enforced at on one of the share's host veths, read back
    /// from the kernel: the HTB class's rate, or the rate in the programs' map while they
    /// are attached, flagged for the direction and (for EDT) an fq is at the root of the
    /// device that queues it. For an unconstrained direction, the path's line rate while
    /// the programs that count it are attached and nothing of ours shapes it.
    fn direction_rate(
        &self,
        bpf: &Bpf,
        i: &Installed,
        (host, first): (&Host, bool),
        dir: Direction,
        cfg: Option<&IfaceConfig>,
        shared: Shared,
    ) -> Result<Option<u64>, NetError> {
        let queue_index = shared.from_queue;
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
                match (shared.to_queue_bps, cfg) {
                    (Some(bps), Some(c)) if looped(c) && attached()? => Some(bps),
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
    pub(super) fn queue_indices(i: &Installed) -> Result<(Option<u32>, Option<u32>), NetError> {
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
    pub(super) fn read_back(
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
        // The to-pod queue is one for all the veths: its HTB is dumped once.
        let to_queue_bps = match (i.mechanism, queues.1, i.slot()) {
            (Mechanism::HtbEbpf, Some(q), Some(slot))
                if i.shaped(Direction::ToPod).is_some()
                    && bpf.to_pod_queue(slot).map_err(bpf_err)? == q =>
            {
                htb_tree_bps(q)?
            }
            _ => None,
        };
        let shared = Shared {
            from_queue: queues.0,
            to_queue_bps,
        };
        let rate = |dir: Direction| -> Result<Option<u64>, NetError> {
            let mut low: Option<u64> = None;
            for ((h, first), cfg) in hosts.iter().zip(&cfgs) {
                match self.direction_rate(bpf, &i, (h, *first), dir, cfg.as_ref(), shared)? {
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
    pub(super) fn sample(
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
