//! Where the agent's own cgroup namespace is rooted in each mounted hierarchy: the
//! [`NamespaceRoots`] that `/proc/PID/cgroup` paths are resolved against
//! (see [`crate::cgroup`]).
//!
//! In the initial cgroup namespace (a systemd unit, or a container sharing the host's)
//! paths are absolute and nothing is looked for. In a private one (a container on a
//! cgroup v2 node) the kernel says where the namespace root is only relative to itself:
//! the root field of a cgroup mount in `/proc/self/mountinfo` is the mount's root as
//! seen from the namespace root, `/../../..` for the host's whole hierarchy mounted
//! three levels above it. That gives the depth of the namespace root below the mount,
//! not its names; those are found by looking, at that depth, for the cgroup whose
//! `cgroup.procs` lists the agent itself (its own line of `/proc/self/cgroup` says where
//! below the namespace root it is). A process is in exactly one cgroup per hierarchy and
//! only a holder of the agent's cgroup can move it, so the one match is the answer, and
//! the look is bounded in directories and time. A mount whose root is not an ancestor of
//! the namespace root (the container's own `/sys/fs/cgroup`, a bind of some subtree)
//! cannot say where anything outside it is and is not used; the DaemonSet mounts the
//! host's tree for this.
//!
//! The answer is re-checked on every use (the agent's own cgroup must still list it) and
//! looked for again when it stops matching; meanwhile the hierarchy is unknown, so its
//! processes are unattributed rather than attributed by a stale root.

use std::{
    collections::{BTreeMap, VecDeque},
    fs,
    io::Read,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use crate::cgroup::{NamespaceRoots, read_proc_cgroup, resolve_path};

/// The inode of the initial cgroup namespace (`PROC_CGROUP_INIT_INO` in the kernel's
/// `include/linux/proc_ns.h`, fixed ABI: `cgroup:[4026531835]`).
pub const INITIAL_CGROUP_NS_INODE: u64 = 0xEFFF_FFFB;

/// Deeper than any kubelet layout nests a container (kind's nesting included).
const MAX_LEVELS: usize = 16;
/// Directories looked at in one search, at most: a node has thousands of cgroups.
const MAX_DIRS: usize = 100_000;
/// One search takes at most this long; what it has not found by then is unknown.
const MAX_SEARCH: Duration = Duration::from_secs(2);
/// A search that found nothing is not repeated sooner than this.
const RESEARCH_AFTER: Duration = Duration::from_secs(10);
/// `cgroup.procs` of the agent's cgroup holds a few pids.
const MAX_PROCS_BYTES: u64 = 256 * 1024;

/// A cgroup mount of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupMount {
    /// Where it is mounted.
    pub point: PathBuf,
    /// Its root as the reader's cgroup namespace sees it (`/`, `/../..`, `/kubepods`).
    pub root: String,
    /// cgroup v2 (else v1).
    pub v2: bool,
    /// The super options: a v1 mount's controllers (and `name=`) are among them.
    pub options: Vec<String>,
}

impl CgroupMount {
    /// How many levels above the reader's namespace root this mount's root is: 0 for
    /// `/`, k for k `..` and nothing else. None for a root below or beside the namespace
    /// root, from which the namespace root cannot be reached.
    pub fn levels_above(&self) -> Option<usize> {
        let segs: Vec<&str> = self.root.split('/').filter(|s| !s.is_empty()).collect();
        segs.iter().all(|s| *s == "..").then_some(segs.len())
    }

    /// Whether this mount is hierarchy `controllers` (a `/proc/PID/cgroup` line's second
    /// field: empty for v2, `cpu,cpuacct` or `name=systemd` for v1).
    pub(crate) fn serves(&self, controllers: &str) -> bool {
        if controllers.is_empty() {
            return self.v2;
        }
        !self.v2
            && controllers
                .split(',')
                .all(|c| self.options.iter().any(|o| o == c))
    }
}

/// The cgroup mounts of mountinfo text, in its order.
pub fn cgroup_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        // id parent major:minor root mount-point options [optional...] - fstype source super
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let mut p = post.split(' ');
        let v2 = match p.next() {
            Some("cgroup2") => true,
            Some("cgroup") => false,
            _ => continue,
        };
        let options = p
            .nth(1)
            .map(|o| o.split(',').map(str::to_owned).collect())
            .unwrap_or_default();
        let mut f = pre.split(' ');
        let (Some(root), Some(point)) = (f.nth(3), f.next()) else {
            continue;
        };
        out.push(CgroupMount {
            point: PathBuf::from(unescape(point)),
            root: unescape(root),
            v2,
            options,
        });
    }
    out
}

/// Every mount point of mountinfo text, unescaped: what is mounted over a directory
/// (`shareguard cleanup` leaves such a directory, not its own to remove).
pub fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(unescape(point)))
        .collect()
}

/// The cgroup v2 mount that shows the most of the hierarchy: a root furthest above the
/// reader's namespace root first, then one at it, then a subtree; the first of equals.
pub fn best_cgroup2_mount(mountinfo: &str) -> Option<CgroupMount> {
    let mut v2: Vec<CgroupMount> = cgroup_mounts(mountinfo)
        .into_iter()
        .filter(|m| m.v2)
        .collect();
    // Stable: the mount table's order decides among equals.
    v2.sort_by_key(|m| std::cmp::Reverse(m.levels_above().map(|k| k + 1).unwrap_or(0)));
    v2.into_iter().next()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 3 < b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u16, |acc, c| acc * 8 + u16::from(c - b'0'));
                u8::try_from(v).ok()
            });
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One resolved hierarchy: its id, the mount it was found in, and its namespace root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundRoot {
    pub id: u32,
    pub point: PathBuf,
    /// Absolute from the mount's root, plain.
    pub root: String,
}

/// What was found of the reader's namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    Initial,
    /// The hierarchies whose root was found; the others are unknown.
    Namespaced(Vec<FoundRoot>),
}

impl Found {
    pub fn roots(&self) -> NamespaceRoots {
        match self {
            Found::Initial => NamespaceRoots::Initial,
            Found::Namespaced(v) => {
                NamespaceRoots::Namespaced(v.iter().map(|r| (r.id, r.root.clone())).collect())
            }
        }
    }
}

/// `<proc_root>/<pid>/cgroup` lines: (hierarchy id, controllers, path).
fn lines(content: &str) -> impl Iterator<Item = (u32, &str, &str)> {
    content.lines().filter_map(|l| {
        let mut p = l.splitn(3, ':');
        let id = p.next()?.parse().ok()?;
        Some((id, p.next()?, p.next()?))
    })
}

/// Whether `dir`'s `cgroup.procs` lists `pid`.
fn lists(dir: &Path, pid: u32) -> bool {
    let mut text = String::new();
    fs::File::open(dir.join("cgroup.procs"))
        .and_then(|f| f.take(MAX_PROCS_BYTES).read_to_string(&mut text))
        .is_ok()
        && text.lines().any(|l| l.trim().parse::<u32>() == Ok(pid))
}

/// The directory of plain path `abs` (from the mount's root) under `point`.
fn under(point: &Path, abs: &str) -> PathBuf {
    point.join(abs.trim_start_matches('/'))
}

/// The namespace root in `mount`, whose root is `levels` above it, of a process `pid`
/// that sits at `own` (its own line: plain, from the namespace root). Searches the
/// directories exactly `levels` deep for the one below which `own` lists `pid`.
pub fn locate_root(mount: &Path, levels: usize, own: &str, pid: u32) -> Option<String> {
    // The own path must stay inside the namespace: resolved against "/" it is plain.
    let own = resolve_path("/", own)?;
    if levels == 0 {
        return Some("/".to_owned());
    }
    if levels > MAX_LEVELS {
        return None;
    }
    let started = Instant::now();
    let mut seen = 0usize;
    let mut queue: VecDeque<(PathBuf, String, usize)> =
        VecDeque::from([(mount.to_path_buf(), String::new(), 0)]);
    while let Some((dir, rel, depth)) = queue.pop_front() {
        if depth == levels {
            let root = if rel.is_empty() { "/".to_owned() } else { rel };
            if lists(&under(&under(mount, &root), &own), pid) {
                return Some(root);
            }
            continue;
        }
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            seen += 1;
            if seen > MAX_DIRS || started.elapsed() > MAX_SEARCH {
                tracing::warn!(mount = %mount.display(), seen, "gave up looking for the agent's cgroup namespace root");
                return None;
            }
            // A cgroup's subdirectories are cgroups; its files are not (and symlinks
            // are not followed: a cgroupfs has none).
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            queue.push_back((entry.path(), format!("{rel}/{name}"), depth + 1));
        }
    }
    None
}

/// Finds the namespace roots of the process `pid` whose cgroup namespace has inode
/// `ns_inode`, whose own `/proc/PID/cgroup` is `own` and whose mount table is
/// `mountinfo`.
pub fn find(ns_inode: u64, own: &str, mountinfo: &str, pid: u32) -> Found {
    if ns_inode == INITIAL_CGROUP_NS_INODE {
        return Found::Initial;
    }
    let mounts = cgroup_mounts(mountinfo);
    let mut found = Vec::new();
    for (id, controllers, path) in lines(own) {
        let mut candidates: Vec<(usize, &CgroupMount)> = mounts
            .iter()
            .filter(|m| m.serves(controllers))
            .filter_map(|m| m.levels_above().map(|k| (k, m)))
            .collect();
        // The mount showing the most first; the search checks itself (the agent's pid
        // is in one cgroup only), so a mount hidden under another one finds nothing.
        candidates.sort_by_key(|(k, _)| std::cmp::Reverse(*k));
        let hit = candidates.iter().find_map(|(k, m)| {
            locate_root(&m.point, *k, path, pid).map(|root| FoundRoot {
                id,
                point: m.point.clone(),
                root,
            })
        });
        match hit {
            Some(r) => found.push(r),
            None => tracing::warn!(
                hierarchy = id,
                controllers,
                "cgroup namespace root not found in any mount: processes are not attributed through this hierarchy"
            ),
        }
    }
    Found::Namespaced(found)
}

/// The part of `found` that still holds for a process `pid` whose own
/// `/proc/PID/cgroup` is now `own`: each root kept, with the process's own path below
/// it, still lists it.
fn holding(found: &Found, own: &str, pid: u32) -> Found {
    let Found::Namespaced(roots) = found else {
        return Found::Initial;
    };
    let own: BTreeMap<u32, &str> = lines(own).map(|(id, _, p)| (id, p)).collect();
    Found::Namespaced(
        roots
            .iter()
            .filter(|r| {
                own.get(&r.id)
                    .and_then(|p| resolve_path(&r.root, p))
                    .is_some_and(|abs| lists(&under(&r.point, &abs), pid))
            })
            .cloned()
            .collect(),
    )
}

/// Whether `found` has a root for every hierarchy of `own`.
fn complete(found: &Found, own: &str) -> bool {
    match found {
        Found::Initial => true,
        Found::Namespaced(roots) => lines(own).all(|(id, _, _)| roots.iter().any(|r| r.id == id)),
    }
}

/// The agent's cgroup namespace, found once and re-checked on each use.
pub struct CgroupNamespace {
    proc_root: PathBuf,
    pid: u32,
    state: Mutex<Option<(Found, Instant)>>,
}

impl CgroupNamespace {
    /// This process's namespace, read from `proc_root` (`/proc`); nothing is read yet.
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
            pid: std::process::id(),
            state: Mutex::new(None),
        }
    }

    /// The roots to resolve `/proc/PID/cgroup` paths against now. Never fails: what
    /// cannot be found is left out, and those processes stay unattributed.
    pub fn roots(&self) -> NamespaceRoots {
        let own_dir = self.proc_root.join(self.pid.to_string());
        let own = read_proc_cgroup(&self.proc_root, self.pid).unwrap_or_default();
        // A poisoned lock only means a panic elsewhere mid-update; the state is a
        // cache and is rebuilt below when it does not hold.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((found, at)) = state.as_ref() {
            let kept = holding(found, &own, self.pid);
            // A root that stopped matching is dropped at once; a new search (bounded,
            // but a walk of the tree) waits a while after the last one.
            if at.elapsed() < RESEARCH_AFTER || (kept == *found && complete(&kept, &own)) {
                return kept.roots();
            }
        }
        let ns_inode = fs::metadata(own_dir.join("ns/cgroup"))
            .map(|m| m.ino())
            .unwrap_or(0);
        let mountinfo = fs::read_to_string(own_dir.join("mountinfo")).unwrap_or_default();
        let found = find(ns_inode, &own, &mountinfo, self.pid);
        tracing::info!(?found, "cgroup namespace of the agent");
        let roots = found.roots();
        *state = Some((found, Instant::now()));
        roots
    }
}

/// The agent process's own namespace, through `/proc`, shared by every user.
pub fn agent_namespace() -> &'static CgroupNamespace {
    static NS: OnceLock<CgroupNamespace> = OnceLock::new();
    NS.get_or_init(|| CgroupNamespace::new("/proc"))
}

#[cfg(test)]
#[path = "cgroupns_tests.rs"]
mod tests;
