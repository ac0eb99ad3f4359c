//! Kernel events that can mean a pod sandbox appeared, went away or changed, turned into
//! a "rescan" signal: inotify on the cgroup tree (new and removed directories down to the
//! pods, and each pod's `cgroup.events`, which the kernel rewrites when the pod's first
//! process arrives or its last one leaves), and rtnetlink link events (a pod's veth
//! added, moved or deleted). A signal carries no detail on purpose: the rescan reads the
//! truth from the kernel, so a lost or coalesced event costs nothing but latency, and the
//! periodic rescan bounds even that.

use std::{
    collections::{BTreeSet, HashMap},
    path::PathBuf,
    sync::Arc,
};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::{Discovery, cgroups};

/// What a directory watch reports: sub-directories made or removed, and itself going.
fn dir_mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_ONLYDIR
}

/// Starts both watchers on threads of their own; each calls `kick` on every event.
/// Failing to start one is logged, not fatal: the periodic rescan still finds sandboxes.
pub fn spawn(discovery: Arc<Discovery>, kick: Arc<Notify>) {
    let k = kick.clone();
    match shareguard_limiter_net::rtnl::watch_links(move || k.notify_one()) {
        Ok(_) => debug!("watching link events"),
        Err(e) => {
            warn!(error = %e, "cannot watch link events; pods' veths are found by the periodic rescan")
        }
    }
    let started = std::thread::Builder::new()
        .name("shareguard-cgwatch".into())
        .spawn(move || {
            if let Err(e) = run_inotify(&discovery, &kick) {
                warn!(error = %e, "cgroup watcher stopped; pods are found by the periodic rescan");
            }
        });
    if let Err(e) = started {
        warn!(error = %e, "cannot start the cgroup watcher");
    }
}

/// The paths watched now, by watch descriptor.
struct Watches {
    ino: Inotify,
    by_wd: HashMap<WatchDescriptor, PathBuf>,
}

impl Watches {
    /// Watches everything that should be: the mount and the level below it (where a
    /// kubelet root can appear), each kubelet root, its QoS directories and pods, and
    /// each pod's `cgroup.events`. Adding a watch twice returns the same descriptor.
    fn sync(&mut self, d: &Discovery) {
        d.refresh_roots();
        let mut want: Vec<(PathBuf, AddWatchFlags)> = vec![(d.mount().to_owned(), dir_mask())];
        for d1 in cgroups::subdirs(d.mount()) {
            want.push((d1, dir_mask()));
        }
        for root in d.roots() {
            want.push((root.clone(), dir_mask()));
            for q in cgroups::qos_dirs(&root) {
                if q.is_dir() {
                    want.push((q, dir_mask()));
                }
            }
            for pod in cgroups::all_pod_dirs(&root) {
                want.push((pod.join("cgroup.events"), AddWatchFlags::IN_MODIFY));
                want.push((pod, dir_mask()));
            }
        }
        let have: BTreeSet<&PathBuf> = self.by_wd.values().collect();
        let missing: Vec<(PathBuf, AddWatchFlags)> = want
            .into_iter()
            .filter(|(p, _)| !have.contains(p))
            .collect();
        for (p, mask) in missing {
            // A directory can be gone again already; the next event or rescan catches up.
            if let Ok(wd) = self.ino.add_watch(&p, mask) {
                self.by_wd.insert(wd, p);
            }
        }
    }
}

fn run_inotify(d: &Discovery, kick: &Notify) -> nix::Result<()> {
    let ino = Inotify::init(InitFlags::IN_CLOEXEC)?;
    let mut w = Watches {
        ino,
        by_wd: HashMap::new(),
    };
    w.sync(d);
    debug!(
        watches = w.by_wd.len(),
        "watching the cgroup tree for pod sandboxes"
    );
    loop {
        let events = match w.ino.read_events() {
            Ok(ev) => ev,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
        };
        for e in &events {
            if e.mask.contains(AddWatchFlags::IN_IGNORED) {
                // The watched path is gone (removed directory): forget it.
                w.by_wd.remove(&e.wd);
            }
        }
        // New directories (a kubelet root, a pod) need watches before the rescan reads
        // them, or an event inside them could fall between the two.
        w.sync(d);
        kick.notify_one();
    }
}
