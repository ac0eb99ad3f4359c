//! Where kubelet keeps pod cgroups: the cgroup v2 mount, found from the mount table, the
//! kubelet roots under it, and the pod cgroup names of both cgroup drivers.
//!
//! | driver | pod cgroup, relative to a kubelet root |
//! |---|---|
//! | systemd (`kubepods.slice`) | `kubepods-pod<uid_>.slice` (Guaranteed), `kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice`, likewise besteffort |
//! | cgroupfs (`kubepods`) | `pod<uid>` (Guaranteed), `burstable/pod<uid>`, `besteffort/pod<uid>` |
//!
//! systemd unit names spell the uid with `_` for `-` and prefix every level with its
//! parent's name, so a kubelet tree nested under another slice (kind's
//! `kubelet.slice/kubelet-kubepods.slice`) names its pods `kubelet-kubepods-...`. Roots
//! are found up to two levels below the mount (`/kubepods.slice`,
//! `/kubelet.slice/kubelet-kubepods.slice`); deeper ones come from the config.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// The mount point of the cgroup v2 hierarchy in `/proc/self/mountinfo` text. On a
/// hybrid host that is `/sys/fs/cgroup/unified` beside the v1 controllers (and
/// `/sys/fs/cgroup` itself is a tmpfs); on most nodes it is `/sys/fs/cgroup`. The mount
/// showing the most of the hierarchy is preferred: inside a cgroup namespace the host's
/// tree (its root `/../..` from the namespace's) over the container's own view (`/`),
/// and either over a bind mount of part of it. The watchdog ranks mounts the same way
/// (`shareguard_limiter_gpu::cgroupns`).
pub fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    shareguard_limiter_gpu::cgroupns::best_cgroup2_mount(mountinfo).map(|m| m.point)
}

/// The cgroup v2 mount of this host.
pub fn host_cgroup2_mount() -> Option<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|m| cgroup2_mount(&m))
}

/// Whether a directory name is a kubelet root: `kubepods` (cgroupfs driver),
/// `kubepods.slice` or `<parent>-kubepods.slice` (systemd driver).
pub fn is_kubelet_root(name: &str) -> bool {
    name == "kubepods" || name == "kubepods.slice" || name.ends_with("-kubepods.slice")
}

/// Subdirectories of `dir`, sorted; nothing when it cannot be read.
pub fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Kubelet roots one or two levels below the cgroup v2 mount.
pub fn detect_roots(mount: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for d1 in subdirs(mount) {
        if name_of(&d1).is_some_and(is_kubelet_root) {
            roots.push(d1);
            continue;
        }
        for d2 in subdirs(&d1) {
            if name_of(&d2).is_some_and(is_kubelet_root) {
                roots.push(d2);
            }
        }
    }
    roots
}

fn name_of(p: &Path) -> Option<&str> {
    p.file_name().and_then(|n| n.to_str())
}

/// The systemd unit prefix of a kubelet root (`kubepods`, `kubelet-kubepods`), or None
/// for a cgroupfs root.
fn systemd_prefix(root: &Path) -> Option<&str> {
    name_of(root)?.strip_suffix(".slice")
}

/// The QoS-class directories under a kubelet root (burstable, besteffort).
pub fn qos_dirs(root: &Path) -> [PathBuf; 2] {
    match systemd_prefix(root) {
        Some(p) => [
            root.join(format!("{p}-burstable.slice")),
            root.join(format!("{p}-besteffort.slice")),
        ],
        None => [root.join("burstable"), root.join("besteffort")],
    }
}

/// Where kubelet puts pod `uid`'s cgroup under `root`: Guaranteed, burstable, besteffort.
pub fn pod_dirs(root: &Path, uid: &str) -> [PathBuf; 3] {
    match systemd_prefix(root) {
        Some(p) => {
            let us = uid.replace('-', "_");
            [
                root.join(format!("{p}-pod{us}.slice")),
                root.join(format!("{p}-burstable.slice"))
                    .join(format!("{p}-burstable-pod{us}.slice")),
                root.join(format!("{p}-besteffort.slice"))
                    .join(format!("{p}-besteffort-pod{us}.slice")),
            ]
        }
        None => [
            root.join(format!("pod{uid}")),
            root.join("burstable").join(format!("pod{uid}")),
            root.join("besteffort").join(format!("pod{uid}")),
        ],
    }
}

/// Every pod cgroup directory under a kubelet root (for the watcher).
pub fn all_pod_dirs(root: &Path) -> Vec<PathBuf> {
    let is_pod = |p: &PathBuf| {
        name_of(p).is_some_and(|n| {
            (n.starts_with("pod") && systemd_prefix(root).is_none())
                || (n.contains("-pod") && n.ends_with(".slice"))
        })
    };
    let mut out: Vec<PathBuf> = subdirs(root).into_iter().filter(is_pod).collect();
    for q in qos_dirs(root) {
        out.extend(subdirs(&q).into_iter().filter(is_pod));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn the_v2_mount_comes_from_the_mount_table() {
        assert_eq!(
            cgroup2_mount(HYBRID),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        // A bind mount of a sub-tree (a container's view) loses to the whole hierarchy.
        let both =
            format!("50 40 0:26 /kubepods.slice /mnt/pods rw - cgroup2 cgroup2 rw\n{unified}");
        assert_eq!(cgroup2_mount(&both), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(
            cgroup2_mount("41 31 0:38 / /x rw - cgroup cgroup rw\n"),
            None
        );
        assert_eq!(
            cgroup2_mount("41 31 0:38 / /a\\040b rw - cgroup2 cgroup2 rw\n"),
            Some(PathBuf::from("/a b"))
        );
        assert_eq!(cgroup2_mount("garbage\n\n - \n"), None);
        // Inside a cgroup namespace: the host's tree mounted at another path beats the
        // container's own /sys/fs/cgroup.
        let namespaced =
            format!("{unified}60 40 0:26 /../../.. /host/sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        assert_eq!(
            cgroup2_mount(&namespaced),
            Some(PathBuf::from("/host/sys/fs/cgroup"))
        );
    }

    #[test]
    fn pod_dirs_follow_both_drivers_and_nesting() {
        let uid = "1234abcd-5678-4ef0-9abc-def012345678";
        let us = "1234abcd_5678_4ef0_9abc_def012345678";
        let r = Path::new("/cg/kubepods.slice");
        assert_eq!(
            pod_dirs(r, uid),
            [
                r.join(format!("kubepods-pod{us}.slice")),
                r.join(format!(
                    "kubepods-burstable.slice/kubepods-burstable-pod{us}.slice"
                )),
                r.join(format!(
                    "kubepods-besteffort.slice/kubepods-besteffort-pod{us}.slice"
                )),
            ]
        );
        let kind = Path::new("/cg/kubelet.slice/kubelet-kubepods.slice");
        assert_eq!(
            pod_dirs(kind, uid)[1],
            kind.join(format!(
                "kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{us}.slice"
            ))
        );
        let fs = Path::new("/cg/kubepods");
        assert_eq!(
            pod_dirs(fs, uid),
            [
                fs.join(format!("pod{uid}")),
                fs.join(format!("burstable/pod{uid}")),
                fs.join(format!("besteffort/pod{uid}")),
            ]
        );
        // What the watchdog's parser reads back from each of them is the same pod.
        for root in [r, kind, fs] {
            for d in pod_dirs(root, uid) {
                let rel = d.strip_prefix("/cg").unwrap().to_str().unwrap();
                let pod = shareguard_limiter_gpu::cgroup::pod_from_cgroup_path(rel);
                assert_eq!(pod.map(|p| p.uid).as_deref(), Some(uid), "{rel}");
            }
        }
    }

    #[test]
    fn roots_by_name() {
        for yes in ["kubepods", "kubepods.slice", "kubelet-kubepods.slice"] {
            assert!(is_kubelet_root(yes), "{yes}");
        }
        for no in [
            "kubepods-burstable.slice",
            "mykubepods",
            "kubepods.scope",
            "",
        ] {
            assert!(!is_kubelet_root(no), "{no}");
        }
    }

    #[test]
    fn roots_and_pods_are_found_on_disk() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path();
        let uid = "1234abcd-5678-4ef0-9abc-def012345678";
        let mk = |rel: &str| fs::create_dir_all(m.join(rel)).unwrap();
        mk(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234abcd_5678_4ef0_9abc_def012345678.slice/cri-containerd-1.scope",
        );
        mk("kubelet.slice/kubelet-kubepods.slice");
        mk("test.slice/kubepods/besteffort");
        mk("system.slice/ssh.service");
        mk("a/b/kubepods");
        let roots = detect_roots(m);
        assert_eq!(
            roots,
            vec![
                m.join("kubelet.slice/kubelet-kubepods.slice"),
                m.join("kubepods.slice"),
                m.join("test.slice/kubepods"),
            ],
            "two levels deep at most"
        );
        assert_eq!(
            all_pod_dirs(&roots[1]),
            vec![m.join(
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234abcd_5678_4ef0_9abc_def012345678.slice"
            )]
        );
        assert!(pod_dirs(&roots[1], uid)[1].is_dir());
    }
}
