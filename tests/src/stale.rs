//! Unique names, and what test processes killed before their guards ran (SIGKILL, a
//! timeout) left behind: namespaces, links, cgroup tops and agents' pin directories
//! whose name carries the pid of a process that no longer exists, removed before the
//! first object of a process is made.

use std::{
    fs,
    io::ErrorKind,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Once,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

use crate::shell::{netns_list, quiet, try_sh};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A number unique in this process, for names.
pub(crate) fn next_id() -> u32 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Removes namespaces, links, cgroups and pins an earlier test process left behind when
/// it was killed before its guards ran (SIGKILL, a timeout): those whose name carries
/// the pid of a process that no longer exists. Runs once per process, before the first
/// object is made.
pub fn sweep_stale() {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(sweep_stale_now);
}

/// [`sweep_stale`], every time it is called. Assumes that every test process using the
/// harness on this host shares one pid namespace (so "no /proc/<pid>" means dead).
pub fn sweep_stale_now() {
    let dead = |pid: &str| {
        pid.parse::<u32>()
            .is_ok_and(|p| !Path::new(&format!("/proc/{p}")).exists())
    };
    for ns in netns_list() {
        if let Some((pid, _)) = ns.strip_prefix("sgt-").and_then(|r| r.split_once('-'))
            && dead(pid)
        {
            remove_netns(&ns);
        }
    }
    for entry in fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = ["sgh", "sgi"]
            .iter()
            .find_map(|p| name.strip_prefix(p))
            .and_then(|r| r.split_once('_'))
            .map(|(pid, _)| pid);
        if pid.is_some_and(dead) {
            quiet(&["ip", "link", "del", &name]);
        }
    }
    sweep_stale_cgroups(&dead);
    // Pin directories (`net::PinDir`): removing one unpins the links a killed agent left
    // there, which detaches their programs from links that may still exist.
    for entry in fs::read_dir(BPFFS).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some((pid, _)) = name
            .strip_prefix(PIN_PREFIX)
            .and_then(|r| r.split_once('-'))
            && dead(pid)
        {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Where test agents' pin directories are made: `<BPFFS>/<PIN_PREFIX><pid>-<n>`.
pub(crate) const BPFFS: &str = "/sys/fs/bpf";
pub(crate) const PIN_PREFIX: &str = "sg-it-";

/// Kills whatever still runs in the namespace, then deletes it.
pub(crate) fn remove_netns(name: &str) {
    if let Ok(pids) = try_sh(&["ip", "netns", "pids", name]) {
        for pid in pids.split_whitespace() {
            quiet(&["kill", "-KILL", pid]);
        }
    }
    quiet(&["ip", "netns", "del", name]);
}

/// Removes `dirs` (parents first in the list) deepest first. A cgroup can stay busy for
/// a moment after its last process is reaped, so EBUSY is retried until a deadline;
/// failures are reported, not raised (this may run while a test panics).
pub(crate) fn remove_tree(dirs: &[PathBuf]) {
    for dir in dirs.iter().rev() {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match fs::remove_dir(dir) {
                Ok(()) => break,
                Err(e) if e.kind() == ErrorKind::NotFound => break,
                Err(e) if e.raw_os_error() == Some(16) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    eprintln!("cleanup: rmdir {}: {e}", dir.display());
                    break;
                }
            }
        }
    }
}

/// Removes cgroup tops (`sgt-<pid>-<n>[.slice]`) of test processes that no longer exist,
/// killing what still runs in them first. Called once per process by [`sweep_stale`].
fn sweep_stale_cgroups(dead: &impl Fn(&str) -> bool) {
    let Some(mount) = shareguard::discovery::cgroups::host_cgroup2_mount() else {
        return;
    };
    for top in shareguard::discovery::cgroups::subdirs(&mount) {
        let Some(name) = top.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix("sgt-")
            .and_then(|r| r.split_once('-'))
            .map(|(pid, _)| pid)
        else {
            continue;
        };
        if dead(pid) {
            let mut dirs = Vec::new();
            collect(&top, &mut dirs);
            for d in &dirs {
                if let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) {
                    for p in procs.split_whitespace() {
                        let _ = Command::new("kill").args(["-KILL", p]).status();
                    }
                }
            }
            remove_tree(&dirs);
        }
    }
}

/// `dir` and every directory below it, parents first.
pub(crate) fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    for d in shareguard::discovery::cgroups::subdirs(dir) {
        collect(&d, out);
    }
}
