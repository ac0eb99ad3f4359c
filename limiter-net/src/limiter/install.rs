//! Installing a share on its pods' veths: the mechanism's qdiscs, queue devices and
//! programs, the record first, and the veths regrouped as pods join and leave.

use super::*;

impl NetLimiter {
    /// Installs share `spec`: limited, or counted only (`count_only`, the rollout's
    /// observe stage). Switching between the two takes the old installation down first.
    pub(super) fn install(
        &self,
        spec: &LimitSpec,
        count_only: bool,
    ) -> Result<Enforcement, LimiterError> {
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
