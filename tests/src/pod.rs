//! Pods as kubelet lays them out, for the agent's pod discovery to find: a pod cgroup in
//! one of kubelet's layouts with a sandbox process in it, optionally inside a network
//! namespace.
//!
//! Each pod's tree hangs from a top directory of its own one level below the cgroup v2
//! mount (`sgt-<pid>-<n>.slice` or `sgt-<pid>-<n>`), the way kind nests kubelet's tree
//! under another slice, so tests run in parallel and never touch a real kubelet's
//! `kubepods`; below the top the paths are exactly kubelet's:
//!
//! - systemd driver: `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`
//! - cgroupfs driver: `kubepods/burstable/pod<uid>/<id>`
//!
//! [`Sandbox`] kills its process and removes its directories, deepest first, when dropped
//! (also while a test panics); a test process killed before that leaves its tops behind
//! for [`crate::stale::sweep_stale`] to remove. [`CgroupTop`] is a top for a test that lays out a
//! tree of its own.

use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Which cgroup driver's layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Systemd,
    Cgroupfs,
}

/// The cgroup v2 mount, from the mount table.
pub fn cgroup2_mount() -> PathBuf {
    shareguard::discovery::cgroups::host_cgroup2_mount().expect("no cgroup v2 hierarchy mounted")
}

/// A fresh pod uid (a lowercase UUIDv4, as the API server makes them).
pub fn pod_uid() -> String {
    crate::share_id()
}

/// A pod's cgroup with a sandbox process (`sleep`) in its container cgroup.
#[derive(Debug)]
pub struct Sandbox {
    uid: String,
    child: Option<Child>,
    /// More processes of the pod (see [`Sandbox::spawn_in_own_netns`]).
    extra: Vec<Child>,
    /// A container cgroup of many processes (see [`Sandbox::spawn_crowd`]).
    crowd: Option<PathBuf>,
    /// Empty container cgroups (see [`Sandbox::add_empty_containers`]).
    empty: Vec<PathBuf>,
    /// The pod's cgroup.
    pod_dir: PathBuf,
    /// Every directory made, parents first.
    created: Vec<PathBuf>,
}

impl Sandbox {
    /// Pod `uid`'s cgroup in `layout` with a process in it: in network namespace `netns`
    /// (`ip netns exec`), or in the host's (a hostNetwork pod) when None.
    pub fn start(uid: &str, layout: Layout, netns: Option<&str>) -> Sandbox {
        Self::start_with(uid, layout, netns, None)
    }

    /// [`Self::start`] with the sandbox's process running as `user` (uid and gid), as a
    /// pod that is not root runs.
    pub fn start_as(uid: &str, layout: Layout, user: u32) -> Sandbox {
        Self::start_with(uid, layout, None, Some(user))
    }

    fn start_with(uid: &str, layout: Layout, netns: Option<&str>, user: Option<u32>) -> Sandbox {
        let mut sb = Sandbox::cgroup_only(uid, layout);
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "sleep", "100000"]);
                c
            }
            None => {
                let mut c = Command::new("sleep");
                c.arg("100000");
                c
            }
        };
        if let Some(user) = user {
            std::os::unix::process::CommandExt::uid(&mut cmd, user);
            std::os::unix::process::CommandExt::gid(&mut cmd, user);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the sandbox process");
        let pid = child.id();
        sb.child = Some(child);
        let ctr = sb.container_dir();
        let procs = ctr.join("cgroup.procs");
        fs::write(&procs, pid.to_string())
            .unwrap_or_else(|e| panic!("write {pid} to {}: {e}", procs.display()));
        sb
    }

    /// Pod `uid`'s cgroup (and its container cgroup) with no process in it yet: kubelet
    /// makes the pod cgroup before the runtime starts the sandbox.
    pub fn cgroup_only(uid: &str, layout: Layout) -> Sandbox {
        crate::stale::sweep_stale();
        let mount = cgroup2_mount();
        let n = crate::stale::next_id();
        let cid = format!("{:08x}{n:08x}{}", std::process::id(), "c0ffee".repeat(8));
        let (top, rel) = match layout {
            Layout::Systemd => {
                let us = uid.replace('-', "_");
                (
                    format!("sgt-{}-{n}.slice", std::process::id()),
                    format!(
                        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{us}.slice/cri-containerd-{cid}.scope"
                    ),
                )
            }
            Layout::Cgroupfs => (
                format!("sgt-{}-{n}", std::process::id()),
                format!("kubepods/burstable/pod{uid}/{cid}"),
            ),
        };
        let top = mount.join(top);
        let ctr = top.join(rel);
        let pod_dir = ctr
            .parent()
            .expect("the container cgroup has a parent")
            .to_path_buf();
        let mut sb = Sandbox {
            uid: uid.to_owned(),
            child: None,
            extra: Vec::new(),
            crowd: None,
            empty: Vec::new(),
            pod_dir,
            created: Vec::new(),
        };
        let mut missing = Vec::new();
        let mut p = ctr.as_path();
        while !p.exists() {
            missing.push(p.to_path_buf());
            p = p.parent().expect("below the mount");
        }
        for dir in missing.into_iter().rev() {
            fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            sb.created.push(dir);
        }
        sb
    }

    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// The pod's cgroup, absolute.
    pub fn pod_dir(&self) -> &Path {
        &self.pod_dir
    }

    /// The pod's cgroup relative to the cgroup v2 mount, as the agent reports it.
    pub fn pod_cgroup(&self) -> String {
        let mount = cgroup2_mount();
        format!(
            "/{}",
            self.pod_dir
                .strip_prefix(&mount)
                .unwrap_or(&self.pod_dir)
                .display()
        )
    }

    fn container_dir(&self) -> PathBuf {
        self.created
            .last()
            .cloned()
            .expect("cgroup_only made the container cgroup")
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts another process of the pod's container in a network namespace of its own,
    /// as a tenant's `unshare -n` would (kubelet's default seccomp profile allows it),
    /// and returns its pid once it is in that namespace. It ends with the sandbox.
    pub fn spawn_in_own_netns(&mut self) -> u32 {
        let host = fs::read_link("/proc/self/ns/net").expect("read the host's netns");
        let child = Command::new("unshare")
            .args(["-n", "sleep", "100000"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn unshare");
        let pid = child.id();
        self.extra.push(child);
        let procs = self.container_dir().join("cgroup.procs");
        fs::write(&procs, pid.to_string())
            .unwrap_or_else(|e| panic!("write {pid} to {}: {e}", procs.display()));
        // unshare makes the namespace before it runs sleep: wait for that, not a time.
        let deadline = Instant::now() + Duration::from_secs(10);
        while fs::read_link(format!("/proc/{pid}/ns/net")).ok().as_ref() == Some(&host) {
            assert!(Instant::now() < deadline, "unshare -n did not take effect");
            std::thread::sleep(Duration::from_millis(5));
        }
        pid
    }

    /// Starts `n` processes in a container cgroup of the pod that sorts before the
    /// sandbox's, all in one network namespace of their own (`unshare -n`), and returns
    /// once they are all in the cgroup. They end with the sandbox.
    pub fn spawn_crowd(&mut self, n: usize) {
        let dir = self.pod_dir.join(format!("{}crowd", "0".repeat(16)));
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        self.crowd = Some(dir.clone());
        // The shell forks only once it is in the cgroup (it waits for a line first), so
        // every process it starts is born there.
        let script =
            format!("read go; i=0; while [ $i -lt {n} ]; do sleep 100000 & i=$((i+1)); done; wait");
        let mut child = Command::new("unshare")
            .args(["-n", "sh", "-c", &script])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn unshare");
        let procs = dir.join("cgroup.procs");
        fs::write(&procs, child.id().to_string())
            .unwrap_or_else(|e| panic!("write {} to {}: {e}", child.id(), procs.display()));
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(b"go\n").expect("start the crowd");
        }
        self.extra.push(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let count = fs::read_to_string(&procs).map_or(0, |t| t.lines().count());
            if count > n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{count} of {n} processes started in {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Makes `n` empty container cgroups in the pod that sort before the sandbox's. They
    /// go with the sandbox.
    pub fn add_empty_containers(&mut self, n: usize) {
        for i in 0..n {
            let dir = self.pod_dir.join(format!("{}empty{i:04}", "0".repeat(16)));
            fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            self.empty.push(dir);
        }
    }

    /// Whether the sandbox process still runs (reaping it if it exited).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for c in self.extra.iter_mut().chain(self.child.as_mut()) {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(crowd) = self.crowd.take() {
            // Its processes are not our children: the cgroup kills them all, and is
            // removed once they are gone.
            let _ = fs::write(crowd.join("cgroup.kill"), "1");
            let deadline = Instant::now() + Duration::from_secs(30);
            while fs::read_to_string(crowd.join("cgroup.procs")).is_ok_and(|t| !t.is_empty())
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = fs::remove_dir(&crowd);
        }
        for dir in self.empty.drain(..) {
            let _ = fs::remove_dir(&dir);
        }
        crate::stale::remove_tree(&self.created);
    }
}

/// A cgroup top of this test process (`sgt-<pid>-<n>[.slice]`, so
/// [`crate::stale`] knows it) for a test that lays out several pods, and processes of its own, in one
/// kubelet tree below it. When dropped (also while a test panics) it kills every
/// process left in it and removes every directory, deepest first.
#[derive(Debug)]
pub struct CgroupTop {
    path: PathBuf,
}

impl CgroupTop {
    /// A fresh top for `layout`'s naming (a `.slice` for the systemd driver).
    pub fn new(layout: Layout) -> CgroupTop {
        crate::stale::sweep_stale();
        let n = crate::stale::next_id();
        let name = match layout {
            Layout::Systemd => format!("sgt-{}-{n}.slice", std::process::id()),
            Layout::Cgroupfs => format!("sgt-{}-{n}", std::process::id()),
        };
        let path = cgroup2_mount().join(name);
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        CgroupTop { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes `rel` (and its parents) below the top; returns it, absolute.
    pub fn mkdir(&self, rel: &str) -> PathBuf {
        let dir = self.path.join(rel);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        dir
    }
}

impl Drop for CgroupTop {
    fn drop(&mut self) {
        let mut dirs = Vec::new();
        crate::stale::collect(&self.path, &mut dirs);
        for d in &dirs {
            if let Ok(procs) = fs::read_to_string(d.join("cgroup.procs")) {
                for p in procs.split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", p]).status();
                }
            }
        }
        crate::stale::remove_tree(&dirs);
    }
}
