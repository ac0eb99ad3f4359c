//! Real cgroups and real processes for the watchdog's system tests and benchmark.
//!
//! Everything is created under a root directory unique to the test process and test
//! (`shareguard-test-<pid>-<tag>`), so tests run in parallel and never touch a real
//! kubelet's `kubepods` tree; below that root the paths are exactly the kubelet's (the
//! prefix is what a kubelet with `--cgroup-root`, or a nested one as in kind, adds).
//!
//! [`Fixture`] owns the processes and the cgroups and, when dropped (also while a test
//! panics), kills and reaps the processes first and then removes the cgroups, deepest
//! first.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A cgroup hierarchy the tests can create cgroups in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hierarchy {
    /// The cgroup v2 (unified) hierarchy: `/proc/PID/cgroup` line `0::/path`.
    V2,
    /// The named v1 hierarchy systemd uses on hybrid hosts: line `N:name=systemd:/path`.
    V1NameSystemd,
}

impl Hierarchy {
    /// Where the hierarchy is mounted, from `/proc/self/mountinfo`; None when it is not.
    pub fn mount_point(self) -> Option<PathBuf> {
        let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
        info.lines().find_map(|line| self.mount_of(line))
    }

    fn mount_of(self, line: &str) -> Option<PathBuf> {
        // id parent major:minor root mount-point options... - fstype source superopts
        let (pre, post) = line.split_once(" - ")?;
        let mount_point = pre.split(' ').nth(4)?;
        let mut post = post.split(' ');
        let (fstype, _source, opts) = (post.next()?, post.next()?, post.next()?);
        let hit = match self {
            Hierarchy::V2 => fstype == "cgroup2",
            Hierarchy::V1NameSystemd => {
                fstype == "cgroup" && opts.split(',').any(|o| o == "name=systemd")
            }
        };
        hit.then(|| PathBuf::from(mount_point))
    }
}

#[path = "../../src/test_root.rs"]
pub mod test_root;

/// True when the test can run (see [`test_root::require_root_for`]).
pub fn require_root(test: &str) -> bool {
    test_root::require_root_for(test, "cgroups")
}

/// The mount point of `h`, or a SKIPPED line and None when this host does not have it
/// (a pure v2 node has no v1 hierarchy; that is the host, not a failure).
pub fn require_hierarchy(test: &str, h: Hierarchy) -> Option<PathBuf> {
    let m = h.mount_point();
    if m.is_none() {
        eprintln!("SKIPPED {test}: no {h:?} cgroup hierarchy mounted on this host");
    }
    m
}

/// A pod uid unique to this test process, test tag and pod number (a lowercase UUID,
/// as the API server spells it).
pub fn pod_uid(tag: u16, n: u32) -> String {
    format!("{:08x}-{tag:04x}-4000-8000-{n:012x}", std::process::id())
}

/// A 64-hex-digit container id, as containerd makes them.
pub fn container_id(tag: u16, n: u32) -> String {
    format!(
        "{:08x}{tag:04x}{n:08x}{:044x}",
        std::process::id(),
        0xc0ffee_u32
    )
}

/// `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`
pub fn systemd_burstable(uid: &str, cid: &str) -> String {
    let us = uid.replace('-', "_");
    format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{us}.slice/cri-containerd-{cid}.scope"
    )
}

/// `kubepods/besteffort/pod<uid>/<container id>`
pub fn cgroupfs_besteffort(uid: &str, cid: &str) -> String {
    format!("kubepods/besteffort/pod{uid}/{cid}")
}

/// One test's processes and cgroups. Field order matters: fields drop in declaration
/// order, so the processes are gone before their cgroups are removed.
pub struct Fixture {
    children: Vec<Child>,
    /// Every directory created, in creation order (parents before children).
    created: Vec<PathBuf>,
    roots: Vec<PathBuf>,
}

impl Fixture {
    pub fn new() -> Self {
        Self {
            children: Vec::new(),
            created: Vec::new(),
            roots: Vec::new(),
        }
    }

    /// The test's root directory in the hierarchy mounted at `mount`, created on first
    /// use.
    pub fn root(&mut self, mount: &Path, test: &str) -> PathBuf {
        let root = mount.join(format!("shareguard-test-{}-{test}", std::process::id()));
        if !self.roots.contains(&root) {
            self.mkdir_all(&root);
            self.roots.push(root.clone());
        }
        root
    }

    /// Creates `root/rel` and whatever is missing above it, remembering each directory
    /// created so that it is removed again.
    pub fn cgroup(&mut self, root: &Path, rel: &str) -> PathBuf {
        let path = root.join(rel);
        self.mkdir_all(&path);
        path
    }

    fn mkdir_all(&mut self, path: &Path) {
        let mut missing = Vec::new();
        let mut p = path;
        while !p.exists() {
            missing.push(p.to_path_buf());
            p = p
                .parent()
                .unwrap_or_else(|| panic!("{} has no existing parent", path.display()));
        }
        for dir in missing.into_iter().rev() {
            fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            self.created.push(dir);
        }
    }

    /// Starts `sleep 600`; returns its index and pid. It stays in the test's cgroups
    /// until [`Fixture::move_to`] puts it somewhere.
    pub fn spawn_sleep(&mut self) -> (usize, u32) {
        let child = Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        self.children.push(child);
        (self.children.len() - 1, pid)
    }

    /// Starts `sleep 600` and moves it into `cgroup`.
    pub fn spawn_in(&mut self, cgroup: &Path) -> (usize, u32) {
        let (i, pid) = self.spawn_sleep();
        move_to(pid, cgroup);
        (i, pid)
    }

    /// Has the process exited? Reaps it if so.
    pub fn exited(&mut self, i: usize) -> Option<ExitStatus> {
        self.children[i].try_wait().expect("try_wait")
    }

    /// Waits until the process has exited, failing after `timeout`.
    pub fn wait_exit(&mut self, i: usize, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.exited(i) {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "process {} still running after {timeout:?}",
                self.children[i].id()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Default for Fixture {
    fn default() -> Self {
        Self::new()
    }
}

/// Moves `pid` into `cgroup` by writing it to `cgroup.procs`.
pub fn move_to(pid: u32, cgroup: &Path) {
    let procs = cgroup.join("cgroup.procs");
    fs::write(&procs, pid.to_string())
        .unwrap_or_else(|e| panic!("write {pid} to {}: {e}", procs.display()));
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for c in &mut self.children {
            // kill and wait are no-ops for a child already reaped.
            let _ = c.kill();
            let _ = c.wait();
        }
        // Deepest first. A cgroup can stay busy for a moment after its last process is
        // reaped, so EBUSY is retried until a deadline; failures are reported, not
        // raised, since this may run while a test is already panicking.
        for dir in self.created.iter().rev() {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match fs::remove_dir(dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotFound => break,
                    Err(e)
                        if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                    {
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
}
