//! A pod's processes and their network namespace, read from cgroupfs and `/proc`.
//!
//! Namespaces are compared by inode (what `stat` on `/proc/<pid>/ns/net` gives), never
//! by path or pid: a pid can be reused by another process the moment the first exits,
//! so a namespace is opened through the pid and then checked to be the one expected.

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::Read,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// More pids than a pod has; reading stops there, so a hostile tree cannot stall a scan.
const MAX_PIDS: usize = 4096;
/// Container cgroups sit one or two levels below the pod's.
const MAX_DEPTH: usize = 4;
/// More cgroups than a pod has (a container each, and a level or two below).
const MAX_CGROUPS: usize = 256;
/// `cgroup.procs` of a busy cgroup stays far below this.
const MAX_PROCS_BYTES: u64 = 256 * 1024;
/// How many pids of each cgroup come before any cgroup's next ones: every container's
/// first processes, the sandbox's among them, are read before one container's many can
/// fill the scan.
const FIRST_ROUND: usize = 8;

/// The pids of a pod's cgroup tree, and whether they are all of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    pub pids: Vec<u32>,
    /// False when the scan stopped at a bound or could not read a cgroup: a sandbox not
    /// among `pids` may then still be there.
    pub complete: bool,
}

/// The pids in `dir` and every cgroup below it (to a bounded depth and count): first
/// [`FIRST_ROUND`] of each cgroup, then the rest, so that one container with many
/// processes cannot keep the others' out of the scan.
pub fn pids_in(dir: &Path) -> Scan {
    let mut cgroups = Vec::new();
    let mut complete = true;
    walk(dir, 0, &mut cgroups, &mut complete);
    let mut out: Vec<u32> = Vec::new();
    for round in [0, 1] {
        for pids in &cgroups {
            let (skip, take) = if round == 0 {
                (0, FIRST_ROUND)
            } else {
                (FIRST_ROUND, usize::MAX)
            };
            for &pid in pids.iter().skip(skip).take(take) {
                if out.len() == MAX_PIDS {
                    complete = false;
                    break;
                }
                out.push(pid);
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    Scan {
        pids: out,
        complete,
    }
}

/// Each cgroup's pids, `dir` and below, in the order [`super::cgroups::subdirs`] lists
/// them.
fn walk(dir: &Path, depth: usize, cgroups: &mut Vec<Vec<u32>>, complete: &mut bool) {
    if cgroups.len() == MAX_CGROUPS {
        *complete = false;
        return;
    }
    let mut text = String::new();
    match File::open(dir.join("cgroup.procs")) {
        Ok(f) => match f.take(MAX_PROCS_BYTES).read_to_string(&mut text) {
            Ok(n) if (n as u64) < MAX_PROCS_BYTES => {}
            _ => *complete = false,
        },
        // Removed while it was read: its processes are gone with it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(_) => *complete = false,
    }
    cgroups.push(
        text.lines()
            .filter_map(|l| l.trim().parse::<u32>().ok())
            .collect(),
    );
    let subs = super::cgroups::subdirs(dir);
    if depth == MAX_DEPTH {
        if !subs.is_empty() {
            *complete = false;
        }
        return;
    }
    for sub in subs {
        walk(&sub, depth + 1, cgroups, complete);
    }
}

/// Inode of `pid`'s network namespace, None when the process is gone.
pub fn netns_inode(proc_root: &Path, pid: u32) -> Option<u64> {
    fs::metadata(netns_path(proc_root, pid))
        .ok()
        .map(|m| m.ino())
}

fn netns_path(proc_root: &Path, pid: u32) -> PathBuf {
    proc_root.join(pid.to_string()).join("ns/net")
}

/// Inode of the network namespace at `path` (a `/proc/<pid>/ns/net` or a bind mount
/// under `/run/netns`): what the namespace is, whatever path named it. Anything not on
/// nsfs is refused, so a plain file cannot pass for a namespace by its inode number.
pub fn netns_inode_of_path(path: &Path) -> std::io::Result<u64> {
    use nix::sys::statfs::{NSFS_MAGIC, statfs};
    let fs_type = statfs(path)
        .map_err(std::io::Error::from)?
        .filesystem_type();
    if fs_type != NSFS_MAGIC {
        return Err(std::io::Error::other("not a namespace"));
    }
    Ok(fs::metadata(path)?.ino())
}

/// Opens `pid`'s network namespace and checks it is the one with inode `want`: the pid
/// may have been reused since it was read.
pub fn open_netns(proc_root: &Path, pid: u32, want: u64) -> std::io::Result<File> {
    let f = File::open(netns_path(proc_root, pid))?;
    let got = f.metadata()?.ino();
    if got != want {
        return Err(std::io::Error::other(format!(
            "pid {pid} is now in namespace {got}, not {want}"
        )));
    }
    Ok(f)
}

/// The network namespaces `pids` are in, by inode, each with one pid that was in it.
pub fn netns_of(proc_root: &Path, pids: &[u32]) -> BTreeMap<u64, u32> {
    let mut m = BTreeMap::new();
    for &pid in pids {
        if let Some(ino) = netns_inode(proc_root, pid) {
            m.entry(ino).or_insert(pid);
        }
    }
    m
}

/// The kernel's clock ticks per second in `/proc/PID/stat` (USER_HZ): 100 on every
/// architecture Linux runs pods on, fixed by its ABI whatever the kernel's own HZ.
const USER_HZ: u64 = 100;

/// How long the oldest of `pids` has been running: `/proc/uptime` less its start time
/// (field 22 of `/proc/PID/stat`, read after the command's closing parenthesis, as the
/// command may hold spaces and parentheses). None when no start time can be read.
pub fn oldest_age(proc_root: &Path, pids: &[u32]) -> Option<std::time::Duration> {
    let uptime: f64 = fs::read_to_string(proc_root.join("uptime"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let started = pids
        .iter()
        .filter_map(|pid| {
            let stat = fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
            let (_, after) = stat.rsplit_once(')')?;
            // After the command: state is field 3, so start time (22) is the 20th.
            after.split_whitespace().nth(19)?.parse::<u64>().ok()
        })
        .min()?;
    let since_boot = std::time::Duration::from_millis(started.saturating_mul(1000) / USER_HZ);
    Some(
        std::time::Duration::try_from_secs_f64(uptime)
            .ok()?
            .saturating_sub(since_boot),
    )
}

/// The inode of the agent's own network namespace: the host's, where pods' veths have
/// their host side.
pub fn own_netns_inode() -> std::io::Result<u64> {
    fs::metadata("/proc/self/ns/net").map(|m| m.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_process_ages_from_its_start_time() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("uptime"), "100.50 180.00\n").unwrap();
        // Field 22 (start time) is 9050 ticks in one, 2000 in the other, whose command
        // holds a space and a parenthesis.
        let stat = |pid: u32, comm: &str, start: u64| {
            let dir = d.path().join(pid.to_string());
            std::fs::create_dir(&dir).unwrap();
            let rest: Vec<String> = (4..=21).map(|f| f.to_string()).collect();
            std::fs::write(
                dir.join("stat"),
                format!("{pid} ({comm}) S {} {start} 23 24\n", rest.join(" ")),
            )
            .unwrap();
        };
        stat(10, "pause", 9050);
        stat(11, "runc:[2:INIT]) x", 2000);
        assert_eq!(
            oldest_age(d.path(), &[10]),
            Some(std::time::Duration::from_millis(10_000))
        );
        assert_eq!(
            oldest_age(d.path(), &[10, 11, 12]),
            Some(std::time::Duration::from_millis(80_500))
        );
        assert_eq!(oldest_age(d.path(), &[12]), None, "no such process");
        // This process has run for at most as long as the machine.
        let own = oldest_age(Path::new("/proc"), &[std::process::id()]).unwrap();
        assert!(
            own < std::time::Duration::from_secs(24 * 3600 * 365),
            "{own:?}"
        );
    }

    #[test]
    fn pids_come_from_the_cgroup_and_below() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("c1/c2")).unwrap();
        fs::write(d.path().join("cgroup.procs"), "").unwrap();
        fs::write(d.path().join("c1/cgroup.procs"), "7\n3\n").unwrap();
        fs::write(d.path().join("c1/c2/cgroup.procs"), "3\n12\nnot-a-pid\n").unwrap();
        assert_eq!(
            pids_in(d.path()),
            Scan {
                pids: vec![3, 7, 12],
                complete: true
            }
        );
        let missing = pids_in(&d.path().join("missing"));
        assert!(missing.pids.is_empty() && missing.complete, "{missing:?}");
    }

    #[test]
    fn a_container_with_many_processes_leaves_room_for_the_others_and_is_told() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("cgroup.procs"), "").unwrap();
        // Sorts before the sandbox's container, and alone holds more than a scan reads.
        fs::create_dir(d.path().join("0-many")).unwrap();
        let many: String = (100_000..100_000 + MAX_PIDS as u32 + 10)
            .map(|p| format!("{p}\n"))
            .collect();
        fs::write(d.path().join("0-many/cgroup.procs"), many).unwrap();
        fs::create_dir(d.path().join("sandbox")).unwrap();
        fs::write(d.path().join("sandbox/cgroup.procs"), "42\n").unwrap();
        let scan = pids_in(d.path());
        assert!(scan.pids.contains(&42), "the sandbox's process was read");
        assert_eq!(scan.pids.len(), MAX_PIDS);
        assert!(!scan.complete, "the scan says it stopped short");

        // Below the bounds: complete again.
        fs::write(d.path().join("0-many/cgroup.procs"), "7\n").unwrap();
        assert_eq!(
            pids_in(d.path()),
            Scan {
                pids: vec![7, 42],
                complete: true
            }
        );
        // Deeper than a pod's tree goes: not all of it read.
        let deep = d.path().join("sandbox/a/b/c/d/e");
        fs::create_dir_all(&deep).unwrap();
        assert!(!pids_in(d.path()).complete);
    }

    #[test]
    fn our_own_namespace_is_found_by_inode() {
        let own = own_netns_inode().unwrap();
        let me = std::process::id();
        assert_eq!(netns_inode(Path::new("/proc"), me), Some(own));
        assert_eq!(
            netns_inode_of_path(Path::new("/proc/self/ns/net")).unwrap(),
            own
        );
        assert!(open_netns(Path::new("/proc"), me, own).is_ok());
        assert!(open_netns(Path::new("/proc"), me, own + 1).is_err());
        assert!(
            netns_inode_of_path(Path::new("/etc/hostname")).is_err(),
            "a plain file is not a namespace"
        );
        let m = netns_of(Path::new("/proc"), &[me, u32::MAX]);
        assert_eq!(m.keys().copied().collect::<Vec<_>>(), vec![own]);
    }
}
