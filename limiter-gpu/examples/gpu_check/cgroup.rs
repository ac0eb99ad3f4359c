//! A pod cgroup of the check's own under the cgroup2 mount, with a container leaf, made
//! and removed around each run.

use super::*;

/// A pod-like cgroup tree, removed when dropped (also while unwinding from a panic).
pub(crate) struct TestCgroup {
    /// `<cgroup v2 mount>/shareguard-gpu-check-<pid>-<rand>`, the tree's top.
    pub(crate) top: PathBuf,
    /// `<top>/kubepods/pod<uid>`: the share's target, as a pod cgroup.
    pub(crate) pod: PathBuf,
    /// `<pod>/allocator`: where the allocator runs, as a container would.
    pub(crate) ctr: PathBuf,
    /// Directories made, in creation order.
    pub(crate) created: Vec<PathBuf>,
    /// `cgroup.subtree_control` files this check added `+dmem` to, in order.
    pub(crate) enabled_dmem: Vec<PathBuf>,
    pub(crate) done: bool,
}

impl TestCgroup {
    pub(crate) fn create(pod_uid: &str) -> Result<TestCgroup, String> {
        let root = cgroup2_mount().ok_or("no cgroup2 file system is mounted")?;
        let kind = if root == Path::new("/sys/fs/cgroup") {
            "cgroup v2 (unified) at /sys/fs/cgroup"
        } else {
            "cgroup v1 with the v2 (unified) hierarchy"
        };
        println!("cgroup: {kind}, using {}", root.display());
        let controllers = read_small(&root.join("cgroup.controllers")).unwrap_or_default();
        let has_dmem = controllers.split_whitespace().any(|c| c == "dmem");
        println!(
            "cgroup: root controllers: {} (dmem {})",
            controllers.trim(),
            if has_dmem {
                "available"
            } else {
                "NOT available in this kernel"
            }
        );
        let suffix = pod_uid.get(..8).unwrap_or("x");
        let top = root.join(format!("{CGROUP_PREFIX}{}-{suffix}", std::process::id()));
        let pod = top.join("kubepods").join(format!("pod{pod_uid}"));
        let ctr = pod.join("allocator");
        // The guard exists before the first directory, so an error half way cleans up.
        let mut cg = TestCgroup {
            top: top.clone(),
            pod: pod.clone(),
            ctr: ctr.clone(),
            created: Vec::new(),
            enabled_dmem: Vec::new(),
            done: false,
        };
        for dir in [top.clone(), top.join("kubepods"), pod.clone(), ctr.clone()] {
            fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
            cg.created.push(dir);
        }
        if has_dmem {
            // The device memory controller must reach the pod cgroup for the driver to
            // charge and limit it: enabled from the root down to the pod's parent. The
            // allocator's own cgroup is charged to the pod, as a container's would be.
            for dir in [root.clone(), top.clone(), top.join("kubepods")] {
                let file = dir.join("cgroup.subtree_control");
                let on = read_small(&file).unwrap_or_default();
                if on.split_whitespace().any(|c| c == "dmem") {
                    continue;
                }
                match fs::write(&file, "+dmem") {
                    Ok(()) => cg.enabled_dmem.push(file),
                    Err(e) => {
                        println!("cgroup: could not enable dmem in {}: {e}", file.display());
                        break;
                    }
                }
            }
        }
        let pod_files = fs::read_dir(&pod)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| n.starts_with("dmem."))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        println!("cgroup: created {}", ctr.display());
        println!(
            "cgroup: pod cgroup dmem files: {}",
            if pod_files.is_empty() {
                "none".to_string()
            } else {
                pod_files.join(" ")
            }
        );
        let parsed = pod_from_proc_cgroup(&format!(
            "0::/{}",
            ctr.strip_prefix(&root).unwrap_or(&ctr).display()
        ));
        println!(
            "cgroup: the library's parser maps it to pod {}",
            parsed.map_or_else(|| "NONE (layout not recognised)".to_string(), |p| p.uid)
        );
        Ok(cg)
    }

    /// Kills whatever is left in the tree, removes it, and takes back `+dmem` where
    /// this check added it. Returns what it could not undo (also printed).
    pub(crate) fn cleanup(&mut self) -> Vec<String> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        let mut problems = Vec::new();
        if self.created.is_empty() {
            return problems;
        }
        // cgroup.kill (Linux 5.14+) kills every process of the subtree at once.
        let kill = self.top.join("cgroup.kill");
        if kill.exists()
            && let Err(e) = fs::write(&kill, "1")
        {
            println!("cleanup: {}: {e}", kill.display());
        }
        for dir in self.created.iter().rev() {
            let mut last = None;
            // A killed process leaves its cgroup a moment after it is reaped.
            for _ in 0..50 {
                match fs::remove_dir(dir) {
                    Ok(()) => {
                        last = None;
                        break;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        last = None;
                        break;
                    }
                    Err(e) => last = Some(e),
                }
                thread::sleep(Duration::from_millis(100));
            }
            if let Some(e) = last {
                let p = format!("could not remove {}: {e}", dir.display());
                println!("cleanup: {p}");
                problems.push(p);
            }
        }
        for file in self.enabled_dmem.iter().rev() {
            if !file.exists() {
                continue; // inside a removed cgroup
            }
            match fs::write(file, "-dmem") {
                Ok(()) => println!("cleanup: dmem disabled again in {}", file.display()),
                Err(e) => println!(
                    "cleanup: dmem left enabled in {} (it was off before): {e}",
                    file.display()
                ),
            }
        }
        if problems.is_empty() {
            println!("cleanup: test cgroup {} removed", self.top.display());
        }
        problems
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        self.cleanup();
    }
}

/// Where the cgroup v2 hierarchy is mounted: `/sys/fs/cgroup` on unified hosts, else
/// the unified mount of a hybrid host (`/sys/fs/cgroup/unified`).
pub(crate) fn cgroup2_mount() -> Option<PathBuf> {
    let info = read_small(Path::new("/proc/self/mountinfo")).ok()?;
    let mut mounts = Vec::new();
    for line in info.lines() {
        // id parent major:minor root mountpoint options [optional...] - fstype source ...
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next() == Some("cgroup2")
            && let Some(mp) = left.split_whitespace().nth(4)
        {
            mounts.push(PathBuf::from(mp.replace("\\040", " ")));
        }
    }
    for preferred in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if let Some(m) = mounts.iter().find(|m| m.as_path() == Path::new(preferred)) {
            return Some(m.clone());
        }
    }
    mounts.into_iter().next()
}

/// A random RFC 4122 version 4 uuid, lowercase, as the API server makes pod uids.
pub(crate) fn random_pod_uid() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let mut s = String::with_capacity(36);
    for (i, x) in b.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        let _ = write!(s, "{x:02x}");
    }
    Ok(s)
}

// ---------------------------------------------------------------------------------
// Allocator and watchdog
