//! Where a share's MPS daemon runs: outside the agent's cgroup, so that what ends the
//! agent leaves tenants' daemons and servers running. A container's teardown (a rolling
//! update, a crash, an OOM kill of the container) kills every process of the
//! container's cgroup, as a systemd stop kills every process of the unit's: a daemon
//! left there would take its tenants' CUDA contexts with it, and a process started
//! before the new agent restarts the daemon would run without it. The agent takes its
//! daemons back at start by its own record (see the mps module), and moves a daemon it
//! finds in another cgroup (one an earlier version started, or one it was killed before
//! moving) out again, with the servers the daemon started.
//!
//! The daemon cgroup is `shareguard-mps` ([`crate::mps::MpsConfig::cgroup`]) at the top
//! of the cgroup v2 hierarchy, and the
//! root of each cgroup v1 hierarchy (a new v1 cgroup would first need its cpuset and
//! other controllers' settings copied in). Where the agent runs in a cgroup namespace
//! of its own (a container on a cgroup v2 node), no cgroup outside it can be named or
//! joined: the move is made from a thread of its own that joins pid 1's cgroup
//! namespace first (CAP_SYS_ADMIN, and pid 1 in sight: hostPID, SYS_PTRACE), through
//! the host's hierarchy mounted in the container. A daemon started under a launcher
//! (systemd-run) is the launcher's unit's and is not moved.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;

use crate::cgroupns::{CgroupMount, INITIAL_CGROUP_NS_INODE, cgroup_mounts};

/// The daemons' cgroup at the top of the cgroup v2 hierarchy (see
/// [`crate::mps::MpsConfig::cgroup`]).
pub const V2_CGROUP: &str = "shareguard-mps";

/// Moves `pid` and its children (the MPS servers a control daemon started) into the
/// daemon cgroup of every hierarchy (`v2_name` at the top of the v2 one), where they are
/// not there already. Returns how many moves were made; an error says which hierarchy
/// refused.
pub fn move_out(pid: u32, v2_name: &str) -> Result<usize, String> {
    let v2_name = v2_name.to_owned();
    std::thread::spawn(move || {
        if !in_initial_cgroup_ns() {
            crate::sys::join_init_cgroup_ns().map_err(|e| {
                format!("joining pid 1's cgroup namespace to leave the agent's cgroup: {e}")
            })?;
        }
        let mut pids = vec![pid];
        pids.extend(children(pid));
        let mut moved = 0;
        for t in targets(&v2_name)? {
            for p in &pids {
                if in_target(*p, &t) {
                    continue;
                }
                match fs::write(&t.procs, p.to_string()) {
                    Ok(()) => moved += 1,
                    // Gone in the meantime: nothing to move.
                    Err(_) if !PathBuf::from(format!("/proc/{p}")).exists() => {}
                    Err(e) => return Err(format!("moving {p} into {}: {e}", t.procs.display())),
                }
            }
        }
        Ok(moved)
    })
    .join()
    .map_err(|_| "the thread moving the MPS daemon panicked".to_owned())?
}

/// Removes the daemon cgroup `v2_name` of the v2 hierarchy once no process is left in
/// it, waiting up to `wait` for the last ones to exit; gone already is success. For
/// whoever made one of their own (tests, each with its name).
pub fn remove(v2_name: &str, wait: std::time::Duration) -> Result<(), String> {
    let info = fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("reading the mount table: {e}"))?;
    let deadline = std::time::Instant::now() + wait;
    for m in cgroup_mounts(&info) {
        if !(m.v2 && m.root == "/") {
            continue;
        }
        let dir = m.point.join(v2_name);
        loop {
            match fs::remove_dir(&dir) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) if std::time::Instant::now() >= deadline => {
                    return Err(format!("removing {}: {e}", dir.display()));
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }
    Ok(())
}

/// Whether this thread is in the initial cgroup namespace.
fn in_initial_cgroup_ns() -> bool {
    fs::read_link("/proc/thread-self/ns/cgroup")
        .is_ok_and(|l| l.to_string_lossy() == format!("cgroup:[{INITIAL_CGROUP_NS_INODE}]"))
}

/// One hierarchy, mounted whole: the mount, its daemon cgroup's `cgroup.procs`, and that
/// cgroup's path as `/proc/PID/cgroup` shows it.
struct Target {
    mount: CgroupMount,
    procs: PathBuf,
    path: String,
}

/// Every hierarchy this thread sees whole, one mount each.
fn targets(v2_name: &str) -> Result<Vec<Target>, String> {
    let info = fs::read_to_string("/proc/thread-self/mountinfo")
        .map_err(|e| format!("reading the mount table: {e}"))?;
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for m in cgroup_mounts(&info) {
        // Mounts of one hierarchy have the same super options.
        if m.root != "/" || !seen.insert((m.v2, m.options.clone())) {
            continue;
        }
        let (procs, path) = if m.v2 {
            let dir = m.point.join(v2_name);
            if let Err(e) = fs::create_dir(&dir)
                && e.kind() != std::io::ErrorKind::AlreadyExists
            {
                return Err(format!("creating {}: {e}", dir.display()));
            }
            (dir.join("cgroup.procs"), format!("/{v2_name}"))
        } else {
            (m.point.join("cgroup.procs"), "/".to_owned())
        };
        out.push(Target {
            mount: m,
            procs,
            path,
        });
    }
    Ok(out)
}

/// Whether `pid` is in the target's cgroup: its `/proc/PID/cgroup` line of that
/// hierarchy names the target's path.
fn in_target(pid: u32, t: &Target) -> bool {
    let Ok(text) = fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    text.lines().any(|line| {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrl), Some(path)) = (f.next(), f.next(), f.next()) else {
            return false;
        };
        path == t.path && t.mount.serves(ctrl)
    })
}

/// The children of `pid` (`/proc/PID/task/PID/children`); none where the kernel does
/// not list them.
fn children(pid: u32) -> Vec<u32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|t| {
            t.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
#[path = "mps_cgroup_tests.rs"]
mod tests;
