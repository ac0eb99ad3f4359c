//! Pod discovery: the agent finds each share's pod sandbox itself, from the kernel's own
//! view, because kubelet prepares a claim before the pod's sandbox exists and the kubelet
//! plugin knows nothing but the pod's uid.
//!
//! For a pod uid it looks for the pod's cgroup in kubelet's layouts ([`cgroups`]), the
//! processes in it and their network namespace ([`process`]), and the host-side veth
//! whose peer is the pod's interface in that namespace (limiter-net's
//! `rtnl::pod_host_veth`, matched by link index and namespace id). What a share needs of
//! it depends on its device's limiter (`Needs`): a GPU cgroup limit needs the pod's
//! cgroup, bandwidth needs its network. Nothing a caller names is acted on unless it was
//! verified to belong to the pod ([`Discovery::verify_hints`]).
//!
//! Which pods a share has is kubelet's word where its DRA checkpoint can be read
//! ([`kubelet`]): kubelet prepares a claim once per node, so a second pod of a claim
//! reaches the agent only there. Elsewhere the pods the caller named are used.
//!
//! [`watch`] turns kernel events (cgroup directories and `cgroup.events`, link changes)
//! into rescans; a periodic rescan is the safety net.

pub mod cgroups;
pub mod kubelet;
pub mod process;
pub mod watch;

#[cfg(test)]
mod tests;

use std::{
    collections::BTreeSet,
    os::unix::fs::MetadataExt,
    path::{Component, Path, PathBuf},
    sync::Mutex,
};

use shareguard_common::limiter::{HostIface, Needs};
use shareguard_limiter_net::{NetError, rtnl};

use crate::{
    error::ClaimError,
    record::{ClaimId, SandboxRecord, TargetRecord},
    sync::lock,
};

/// The interface inside a pod's namespace when the claim names none.
pub const DEFAULT_POD_IFACE: &str = "eth0";

/// A pod sandbox as found, ready to be enforced on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sandbox {
    pub record: SandboxRecord,
    /// Absolute cgroup directories a cgroup limit applies to.
    pub cgroups: Vec<PathBuf>,
    pub host_iface: Option<HostIface>,
    /// Other network namespaces the pod's processes are in, none of them wired to the
    /// host (see [`Discovery::find`]).
    pub unwired_netns: usize,
    /// The last scan of the pod stopped short of all its processes, the sandbox's among
    /// them, and the sandbox was kept as recorded: a scan that could not read everything
    /// cannot tell that a sandbox is gone.
    pub partial_scan: bool,
}

impl Sandbox {
    /// `record`'s sandbox on the host veth it was enforced on (`index`, `name`), which is
    /// still there: confirmed without netlink.
    fn on_recorded_veth(
        mut record: SandboxRecord,
        cgroups: Vec<PathBuf>,
        index: u32,
        name: &str,
        unwired_netns: usize,
        partial_scan: bool,
    ) -> Sandbox {
        record.host_ifindex = Some(index);
        record.host_ifname = Some(name.into());
        Sandbox {
            record,
            cgroups,
            host_iface: Some(HostIface {
                index,
                name: name.to_owned(),
            }),
            unwired_netns,
            partial_scan,
        }
    }
}

/// How a share's reason tells what the last scan of its pod saw besides the sandbox:
/// appended to it while there is something to tell, found again by this start to be
/// replaced.
pub const UNWIRED_NOTE: &str = "; the pod has ";

/// `reason` with its note on the pods set to what the scans of `sandboxes` found: more
/// processes than a scan reads, or other network namespaces.
pub fn with_unwired_note(reason: &str, sandboxes: &[Sandbox]) -> String {
    let base = reason.split(UNWIRED_NOTE).next().unwrap_or(reason);
    if sandboxes.iter().any(|sb| sb.partial_scan) {
        return format!(
            "{base}{UNWIRED_NOTE}more than one scan reads (processes or cgroups): the sandbox it was enforced on is kept while its host veth is there"
        );
    }
    match sandboxes.iter().map(|sb| sb.unwired_netns).sum::<usize>() {
        0 => base.to_owned(),
        n => format!(
            "{base}{UNWIRED_NOTE}{n} more network namespace(s), none wired to the host: the limit holds every path out of it"
        ),
    }
}

/// What discovery found for a share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// None of the share's pods has what the share needs on this node (yet); in words.
    Waiting(String),
    /// These pods have it (at least one, ordered by pod uid); one limit is to hold them
    /// together. `host_network`: the share's pods that run in the host's network
    /// namespace besides them, whose traffic no per-pod limit reaches.
    Ready {
        sandboxes: Vec<Sandbox>,
        host_network: Vec<String>,
    },
    /// No pod has a sandbox of its own, and this one runs in the host's network
    /// namespace: there is no pod interface to limit.
    HostNetwork { pod_uid: String },
}

pub struct Discovery {
    /// Mount point of the cgroup v2 hierarchy.
    mount: PathBuf,
    /// Kubelet roots from the config (absolute), searched besides the detected ones.
    configured: Vec<PathBuf>,
    /// Roots found by the last [`Discovery::refresh_roots`].
    roots: Mutex<Vec<PathBuf>>,
    proc_root: PathBuf,
    /// The agent's own (the host's) network namespace.
    host_netns: u64,
    /// When a pod whose verdict was put off (see [`HOST_NETWORK_SETTLE`]) is to be
    /// looked at again: the discovery loop wakes then, not only on events.
    recheck: Mutex<Option<std::time::Instant>>,
    /// Told when `recheck` is set, so that the loop waits for the new time.
    recheck_set: tokio::sync::Notify,
    /// Kubelet's own list of each claim's pods.
    kubelet: kubelet::KubeletClaims,
}

/// How long a pod's processes must have run before "all of them in the host's network
/// namespace" means hostNetwork. The runtime puts a sandbox's first process in the
/// pod's cgroup before that process joins the sandbox's namespace (runc's init joins it
/// after the cgroup), so for a moment a pod with a network of its own looks like a
/// hostNetwork one; judged then, the share went DEGRADED and was repaired a moment later.
pub const HOST_NETWORK_SETTLE: std::time::Duration = std::time::Duration::from_secs(3);

impl Discovery {
    pub fn new(
        mount: PathBuf,
        configured: Vec<PathBuf>,
        proc_root: PathBuf,
        host_netns: u64,
        kubelet_dir: Option<&Path>,
    ) -> Discovery {
        let d = Discovery {
            mount,
            configured,
            roots: Mutex::new(Vec::new()),
            proc_root,
            host_netns,
            recheck: Mutex::new(None),
            recheck_set: tokio::sync::Notify::new(),
            kubelet: kubelet::KubeletClaims::new(kubelet_dir),
        };
        d.refresh_roots();
        d
    }

    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// Kubelet's list of each claim's pods.
    pub fn kubelet(&self) -> &kubelet::KubeletClaims {
        &self.kubelet
    }

    /// The pods claim `claim` has on this node: kubelet's own list where its checkpoint
    /// can be read, else `named` (the caller's). Err, in words, where the checkpoint
    /// does not list the claim as it is: no pod is acted on then.
    pub fn claim_pods(&self, claim: &ClaimId, named: &[String]) -> Result<Vec<String>, String> {
        match self.kubelet.claim(&claim.uid) {
            kubelet::ClaimPods::Unavailable(_) => Ok(named.to_vec()),
            kubelet::ClaimPods::Listed {
                namespace,
                name,
                pods,
            } if namespace == claim.namespace && name == claim.name => Ok(pods),
            kubelet::ClaimPods::Listed {
                namespace, name, ..
            } => Err(format!(
                "kubelet lists claim uid {} as {namespace}/{name}, not {}/{}: no pod is acted on",
                claim.uid, claim.namespace, claim.name
            )),
            kubelet::ClaimPods::NotListed => Err(format!(
                "kubelet has admitted no pod with claim {}/{} on this node yet (its DRA checkpoint does not list it)",
                claim.namespace, claim.name
            )),
        }
    }

    /// Looks for kubelet roots again (kubelet may start after the agent).
    pub fn refresh_roots(&self) {
        let mut roots = cgroups::detect_roots(&self.mount);
        for c in &self.configured {
            if !roots.contains(c) {
                roots.push(c.clone());
            }
        }
        *lock(&self.roots) = roots;
    }

    /// The earliest time a pod whose verdict was put off is to be looked at again,
    /// cleared.
    pub fn take_recheck(&self) -> Option<std::time::Instant> {
        lock(&self.recheck).take()
    }

    /// Returns once a recheck time was set since the last call (or at once, if one
    /// was set meanwhile).
    pub async fn recheck_set(&self) {
        self.recheck_set.notified().await;
    }

    fn recheck_at(&self, at: std::time::Instant) {
        {
            let mut r = lock(&self.recheck);
            if r.is_some_and(|t| t <= at) {
                return;
            }
            *r = Some(at);
        }
        self.recheck_set.notify_one();
    }

    pub fn roots(&self) -> Vec<PathBuf> {
        lock(&self.roots).clone()
    }

    /// The cgroup of pod `uid` and its inode, if kubelet made one under a kubelet root.
    /// Not found under the roots known: they are looked for again first, since a root
    /// made a moment ago may not have reached the watcher yet (kubelet makes its root
    /// once, but a Prepare can come right after).
    pub fn pod_cgroup(&self, uid: &str) -> Option<(PathBuf, u64)> {
        self.pod_cgroup_under_known_roots(uid).or_else(|| {
            self.refresh_roots();
            self.pod_cgroup_under_known_roots(uid)
        })
    }

    fn pod_cgroup_under_known_roots(&self, uid: &str) -> Option<(PathBuf, u64)> {
        for root in self.roots() {
            for d in cgroups::pod_dirs(&root, uid) {
                if let Ok(m) = std::fs::metadata(&d)
                    && m.is_dir()
                {
                    return Some((d, m.ino()));
                }
            }
        }
        None
    }

    fn relative(&self, p: &Path) -> String {
        let rel = p.strip_prefix(&self.mount).unwrap_or(p);
        format!("/{}", rel.display())
    }

    /// What share `target` has of `needs` now. `current` holds the sandboxes it is
    /// enforced on: while one is still there, it is confirmed without netlink.
    pub fn find(&self, target: &TargetRecord, needs: Needs, current: &[SandboxRecord]) -> Found {
        let mut found = Vec::new();
        let mut host_network = Vec::new();
        let mut waiting = Vec::new();
        for uid in &target.pod_uids {
            let cur = current.iter().find(|c| c.pod_uid == *uid);
            match self.find_pod(uid, target, needs, cur) {
                PodState::Ready(sb) => found.push(sb),
                PodState::HostNetwork => host_network.push(uid.clone()),
                PodState::Waiting(why) => waiting.push(why),
            }
        }
        if found.is_empty() {
            return match host_network.into_iter().next() {
                Some(pod_uid) => Found::HostNetwork { pod_uid },
                None => Found::Waiting(if waiting.is_empty() {
                    "no pod named".to_owned()
                } else {
                    waiting.join("; ")
                }),
            };
        }
        // In one order whatever order the pods were named in, so that the same pods are
        // the same sandboxes to compare. (No two are the same pod: Prepare refuses a uid
        // named twice, and kubelet's list is read as a set.)
        found.sort_by(|a, b| a.record.pod_uid.cmp(&b.record.pod_uid));
        Found::Ready {
            sandboxes: found,
            host_network,
        }
    }

    fn find_pod(
        &self,
        uid: &str,
        target: &TargetRecord,
        needs: Needs,
        current: Option<&SandboxRecord>,
    ) -> PodState {
        let Some((dir, inode)) = self.pod_cgroup(uid) else {
            return PodState::Waiting(format!("waiting for pod {uid}'s sandbox on this node"));
        };
        let cgroup = self.relative(&dir);
        if cgroup.len() > crate::validate::MAX_PATH_LEN {
            return PodState::Waiting(format!(
                "pod {uid}'s cgroup path is longer than {} bytes; not used",
                crate::validate::MAX_PATH_LEN
            ));
        }
        let mut record = SandboxRecord {
            pod_uid: uid.to_owned(),
            cgroup: cgroup.clone(),
            cgroup_inode: inode,
            ..SandboxRecord::default()
        };
        // A cgroup hint (verified at admission to be the pod's or below it) narrows the
        // limit to those cgroups while they exist.
        let hinted: Vec<PathBuf> = target
            .cgroup_paths()
            .iter()
            .map(|p| self.mount.join(p.trim_start_matches('/')))
            .filter(|p| p.starts_with(&dir) && p.is_dir())
            .collect();
        let limit_cgroups = if hinted.is_empty() {
            vec![dir.clone()]
        } else {
            hinted
        };
        record.cgroups = limit_cgroups.iter().map(|p| self.relative(p)).collect();
        if needs != Needs::Network {
            return PodState::Ready(Sandbox {
                record,
                cgroups: limit_cgroups,
                host_iface: None,
                unwired_netns: 0,
                partial_scan: false,
            });
        }
        let scan = process::pids_in(&dir);
        let mut spaces = process::netns_of(&self.proc_root, &scan.pids);
        // A process that is exiting (a zombie) has no namespace left to read: it is in
        // no namespace, not in the host's.
        let in_host = spaces.remove(&self.host_netns).is_some();
        // A scan that did not read every process cannot tell that the sandbox is gone:
        // the one the share was enforced on is kept while its host veth is there.
        if !scan.complete
            && let Some(c) = current
            && let (Some(netns), Some(index), Some(name)) =
                (c.netns_inode, c.host_ifindex, c.host_ifname.as_ref())
            && !spaces.contains_key(&netns)
            && host_link_index(name) == Some(index)
        {
            record.netns_inode = Some(netns);
            return PodState::Ready(Sandbox::on_recorded_veth(
                record,
                limit_cgroups,
                index,
                name,
                spaces.len(),
                true,
            ));
        }
        if scan.pids.is_empty() {
            return PodState::Waiting(format!(
                "pod {uid}'s cgroup {cgroup} has no processes yet: waiting for its sandbox"
            ));
        }
        if spaces.is_empty() && !in_host {
            // Every process is exiting: the pod is being torn down (or the pids went
            // away between the two reads). Judged as hostNetwork, that made a share
            // DEGRADED, with a warning, on every pod's deletion.
            return PodState::Waiting(format!(
                "pod {uid}'s processes are exiting: none has a network namespace left to read"
            ));
        }
        if spaces.is_empty() && !scan.complete {
            return PodState::Waiting(format!(
                "pod {uid}'s processes read so far are all in the host's network namespace, and it has more than one scan reads: waiting"
            ));
        }
        if spaces.is_empty() {
            if let Some(age) = process::oldest_age(&self.proc_root, &scan.pids)
                && age < HOST_NETWORK_SETTLE
            {
                self.recheck_at(std::time::Instant::now() + (HOST_NETWORK_SETTLE - age));
                return PodState::Waiting(format!(
                    "pod {uid}'s processes, started {} ms ago, are all in the host's network namespace: waiting to see whether its sandbox has a network of its own",
                    age.as_millis()
                ));
            }
            return PodState::HostNetwork;
        }
        let ifname = target.interface().unwrap_or(DEFAULT_POD_IFACE);
        let others = spaces.len() - 1;
        let (netns, pid) = match (spaces.len(), target.netns_inode()) {
            (1, _) => spaces.pop_first().unwrap_or_default(),
            (_, Some(hint)) if spaces.contains_key(&hint) => (hint, spaces[&hint]),
            // A process of the pod made a namespace of its own (`unshare -n`, which the
            // default seccomp profile allows). Only the sandbox's namespace is wired to
            // the host, and wiring another takes the host's privileges, so the limit on
            // the sandbox still holds every path out of the pod: it stays where it was
            // verified, or goes to the one namespace that is wired.
            (n, _) => match current
                .and_then(|c| c.netns_inode)
                .and_then(|ino| spaces.get(&ino).map(|pid| (ino, *pid)))
            {
                Some(kept) => kept,
                None => match self.wired(&spaces, ifname)[..] {
                    [one] => one,
                    ref wired => {
                        return PodState::Waiting(format!(
                            "pod {uid}'s processes are in {n} network namespaces, {} of them wired to the host through {ifname}; waiting until one is",
                            wired.len()
                        ));
                    }
                },
            },
        };
        record.netns_inode = Some(netns);
        // Still the interface it was enforced on: same namespace, and the host side is
        // still there under its name and index (no netlink needed for that).
        if let Some(c) = current
            && c.netns_inode == Some(netns)
            && let (Some(index), Some(name)) = (c.host_ifindex, c.host_ifname.as_ref())
            && host_link_index(name) == Some(index)
        {
            return PodState::Ready(Sandbox::on_recorded_veth(
                record,
                limit_cgroups,
                index,
                name,
                others,
                false,
            ));
        }
        let ns = match process::open_netns(&self.proc_root, pid, netns) {
            Ok(f) => f,
            Err(e) => {
                return PodState::Waiting(format!(
                    "pod {uid}'s network namespace could not be opened ({e}); retrying"
                ));
            }
        };
        match rtnl::pod_host_veth(&ns, ifname) {
            Ok(h) => {
                record.host_ifindex = Some(h.index);
                record.host_ifname = Some(h.name.as_str().into());
                PodState::Ready(Sandbox {
                    record,
                    cgroups: limit_cgroups,
                    host_iface: Some(h),
                    unwired_netns: others,
                    partial_scan: false,
                })
            }
            Err(NetError::NotFound(what)) => PodState::Waiting(format!(
                "pod {uid}'s sandbox has no {what} yet: waiting for its network"
            )),
            Err(e) => PodState::Waiting(format!(
                "pod {uid}'s interface {ifname} has no host-side veth: {e}"
            )),
        }
    }

    /// The namespaces among `spaces` (inode -> a pid in it) whose `ifname` is a veth
    /// with its peer on the host: a pod's sandbox. A namespace a tenant made has none.
    fn wired(
        &self,
        spaces: &std::collections::BTreeMap<u64, u32>,
        ifname: &str,
    ) -> Vec<(u64, u32)> {
        spaces
            .iter()
            .filter(|&(&ino, &pid)| {
                process::open_netns(&self.proc_root, pid, ino)
                    .is_ok_and(|ns| rtnl::pod_host_veth(&ns, ifname).is_ok())
            })
            .map(|(&ino, &pid)| (ino, pid))
            .collect()
    }

    /// Checks the caller's hints against the pods' sandboxes as they are now, and turns
    /// them into what is kept: a netns path becomes its inode, cgroup paths are kept
    /// relative to the cgroup v2 mount. A hint that does not belong to one of the pods is
    /// refused (PermissionDenied, naming the field), and so is one that cannot be
    /// verified because no pod has a sandbox yet.
    pub fn verify_hints(
        &self,
        field: &str,
        pod_uids: &[String],
        netns_path: Option<&str>,
        cgroup_paths: &[String],
    ) -> Result<(Option<u64>, Vec<String>), ClaimError> {
        if netns_path.is_none() && cgroup_paths.is_empty() {
            return Ok((None, Vec::new()));
        }
        let pods: Vec<(String, PathBuf)> = pod_uids
            .iter()
            .filter_map(|u| self.pod_cgroup(u).map(|(d, _)| (u.clone(), d)))
            .collect();
        let none = |f: String| {
            ClaimError::denied(
                f,
                "cannot be verified: no pod of the claim has a sandbox on this node yet; send the pod uid alone and the agent finds the sandbox itself",
            )
        };
        let mut netns_inode = None;
        if let Some(p) = netns_path {
            let f = format!("{field}.netns_path");
            if pods.is_empty() {
                return Err(none(f));
            }
            let ino = process::netns_inode_of_path(Path::new(p)).map_err(|e| {
                ClaimError::denied(&f, format!("{p:?} is not a network namespace: {e}"))
            })?;
            let ours: BTreeSet<u64> = pods
                .iter()
                .flat_map(|(_, d)| {
                    process::netns_of(&self.proc_root, &process::pids_in(d).pids).into_keys()
                })
                .collect();
            if !ours.contains(&ino) || ino == self.host_netns {
                return Err(ClaimError::denied(
                    f,
                    format!("{p:?} is not the network namespace of a process of the claim's pods"),
                ));
            }
            netns_inode = Some(ino);
        }
        let mut kept = Vec::new();
        for (i, p) in cgroup_paths.iter().enumerate() {
            let f = format!("{field}.cgroup_paths[{i}]");
            if pods.is_empty() {
                return Err(none(f));
            }
            let rel = Path::new(p.trim_start_matches('/'));
            if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
                return Err(ClaimError::invalid(f, format!("{p:?} is not a plain path")));
            }
            let abs = self.mount.join(rel);
            if !pods.iter().any(|(_, d)| abs.starts_with(d)) || !abs.is_dir() {
                return Err(ClaimError::denied(
                    f,
                    format!("{p:?} is not the cgroup of one of the claim's pods or below it"),
                ));
            }
            kept.push(self.relative(&abs));
        }
        Ok((netns_inode, kept))
    }
}

enum PodState {
    Ready(Sandbox),
    HostNetwork,
    Waiting(String),
}

/// The index of host link `name` now, from sysfs (the agent runs in the host's network
/// namespace, whose sysfs view this is).
fn host_link_index(name: &str) -> Option<u32> {
    if !shareguard_limiter_net::link::is_interface_name(name) {
        return None;
    }
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()?
        .trim()
        .parse()
        .ok()
}
