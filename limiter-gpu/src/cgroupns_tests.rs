use super::*;

const PID: u32 = 4242;

/// The hybrid host's mount table as a process three levels down in the unified
/// hierarchy, and two in the memory one, sees it after `unshare --cgroup`.
const NAMESPACED_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 /../.. /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 /../../.. /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

#[test]
fn mounts_and_how_far_above_the_namespace_root_they_are() {
    let m = cgroup_mounts(NAMESPACED_HYBRID);
    assert_eq!(m.len(), 4, "the tmpfs is no cgroup mount: {m:?}");
    let levels: Vec<(bool, Option<usize>)> = m.iter().map(|m| (m.v2, m.levels_above())).collect();
    assert_eq!(
        levels,
        [
            (false, Some(0)),
            (false, Some(2)),
            (false, Some(0)),
            (true, Some(3))
        ]
    );
    assert!(m[1].serves("memory") && !m[1].serves("cpu") && !m[1].serves(""));
    assert!(m[2].serves("name=systemd"));
    assert!(m[3].serves("") && !m[3].serves("memory"));
    for (root, want) in [
        ("/kubepods", None),
        ("/../kubepods", None),
        ("/..//..", Some(2)),
        ("/", Some(0)),
    ] {
        let m = CgroupMount {
            point: "/x".into(),
            root: root.into(),
            v2: true,
            options: vec![],
        };
        assert_eq!(m.levels_above(), want, "{root}");
    }
    assert_eq!(cgroup_mounts("garbage\n - \n1 2 3 - cgroup2\n"), []);
}

#[test]
fn the_v2_mount_showing_most_wins() {
    // The container's own view (its namespace root) loses to the host's tree mounted
    // above it; a bind of a subtree loses to both.
    let own = "50 40 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
    let sub = "51 40 0:26 /kubepods.slice /mnt/pods rw - cgroup2 cgroup2 rw\n";
    let host = "52 40 0:26 /../../.. /host/cgroup rw - cgroup2 cgroup2 rw\n";
    let best = |t: &str| best_cgroup2_mount(t).map(|m| m.point);
    assert_eq!(
        best(&format!("{sub}{own}{host}")),
        Some("/host/cgroup".into())
    );
    assert_eq!(best(&format!("{sub}{own}")), Some("/sys/fs/cgroup".into()));
    assert_eq!(best(sub), Some("/mnt/pods".into()));
    assert_eq!(
        best("41 31 0:38 /../a\\040b /a\\040b rw - cgroup2 cgroup2 rw\n"),
        Some("/a b".into())
    );
    assert_eq!(best("41 31 0:38 / /x rw - cgroup cgroup rw,cpu\n"), None);
}

/// A cgroup tree under a temporary directory: `cgroup.procs` files in the given
/// directories, with the given pids.
fn tree(dirs: &[(&str, &[u32])]) -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    for (d, pids) in dirs {
        let p = t.path().join(d);
        fs::create_dir_all(&p).unwrap();
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        fs::write(p.join("cgroup.procs"), text).unwrap();
    }
    t
}

fn mountinfo_v2(point: &Path, root: &str) -> String {
    format!(
        "41 31 0:38 {root} {} rw - cgroup2 cgroup2 rw\n",
        point.display()
    )
}

#[test]
fn the_root_is_the_cgroup_at_its_depth_that_lists_the_agent() {
    let t = tree(&[
        ("kubepods/burstable/pod-x/c1", &[7, 8]),
        // Decoys: at the right depth but not us, and us is nowhere else.
        ("kubepods/besteffort/pod-a/other", &[9]),
        ("kubepods/besteffort/pod-a/agent", &[PID]),
        ("system.slice/x/y/z", &[]),
    ]);
    let m = t.path();
    assert_eq!(
        locate_root(m, 4, "/", PID).as_deref(),
        Some("/kubepods/besteffort/pod-a/agent")
    );
    // At another depth it is not there: no guess.
    assert_eq!(locate_root(m, 3, "/", PID), None);
    assert_eq!(locate_root(m, 4, "/", 1234), None);
    // Below its namespace root: the root is the ancestor at the mount's depth.
    assert_eq!(
        locate_root(m, 3, "/agent", PID).as_deref(),
        Some("/kubepods/besteffort/pod-a")
    );
    // An own path that climbs out of the namespace says nothing of where its root is.
    assert_eq!(locate_root(m, 4, "/../agent", PID), None);
    assert_eq!(locate_root(m, 0, "/", PID).as_deref(), Some("/"));
    assert_eq!(locate_root(m, MAX_LEVELS + 1, "/", PID), None);

    let found = find(
        4_026_532_000,
        "0::/\n",
        &mountinfo_v2(m, "/../../../.."),
        PID,
    );
    assert_eq!(
        found,
        Found::Namespaced(vec![FoundRoot {
            id: 0,
            point: m.to_path_buf(),
            root: "/kubepods/besteffort/pod-a/agent".into()
        }])
    );
    let mut want = BTreeMap::new();
    want.insert(0, "/kubepods/besteffort/pod-a/agent".to_owned());
    assert_eq!(found.roots(), NamespaceRoots::Namespaced(want));
}

#[test]
fn the_initial_namespace_needs_no_search() {
    assert_eq!(
        find(INITIAL_CGROUP_NS_INODE, "0::/\n", "", PID),
        Found::Initial
    );
    assert_eq!(Found::Initial.roots(), NamespaceRoots::Initial);
}

#[test]
fn hierarchies_are_found_each_in_its_own_mount() {
    let v2 = tree(&[("a/b/agent", &[PID])]);
    let mem = tree(&[("m/agent", &[PID]), ("m/agent2", &[1])]);
    let cpu = tree(&[("elsewhere", &[PID])]);
    let mountinfo = format!(
        "{}{}{}{}",
        mountinfo_v2(v2.path(), "/../../.."),
        format_args!(
            "35 31 0:32 /../.. {} rw - cgroup cgroup rw,memory\n",
            mem.path().display()
        ),
        // cpu's mount is a subtree of the namespace: nothing can be learnt from it.
        format_args!(
            "32 31 0:29 /sub {} rw - cgroup cgroup rw,cpu,cpuacct\n",
            cpu.path().display()
        ),
        // The container's own v2 view at its namespace root, listed after the host's.
        "50 40 0:26 / /nonexistent rw - cgroup2 cgroup2 rw\n",
    );
    let own = "4:memory:/\n2:cpu,cpuacct:/\n0::/\n";
    let Found::Namespaced(found) = find(1, own, &mountinfo, PID) else {
        panic!("not the initial namespace");
    };
    let got: Vec<(u32, &str)> = found.iter().map(|r| (r.id, r.root.as_str())).collect();
    assert_eq!(got, [(4, "/m/agent"), (0, "/a/b/agent")], "cpu is unknown");
}

#[test]
fn a_mount_hidden_under_another_finds_nothing() {
    // Both claim to be above the namespace root, but the deeper one's tree (what its
    // mount point really shows here) has no cgroup listing us at that depth.
    let real = tree(&[("a/agent", &[PID])]);
    let shadowed = tree(&[("a/agent", &[PID])]);
    let mountinfo = format!(
        "{}{}",
        mountinfo_v2(shadowed.path(), "/../../../.."),
        mountinfo_v2(real.path(), "/../.."),
    );
    let Found::Namespaced(found) = find(1, "0::/\n", &mountinfo, PID) else {
        panic!();
    };
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].point, real.path());
    assert_eq!(found[0].root, "/a/agent");
}

/// A fake `/proc` for this test process: its cgroup, mountinfo and a namespace file
/// that is not the initial namespace.
fn fake_proc(own: &str, mountinfo: &str) -> tempfile::TempDir {
    let p = tempfile::tempdir().unwrap();
    let d = p.path().join(std::process::id().to_string());
    fs::create_dir_all(d.join("ns")).unwrap();
    fs::write(d.join("ns/cgroup"), "").unwrap();
    fs::write(d.join("cgroup"), own).unwrap();
    fs::write(d.join("mountinfo"), mountinfo).unwrap();
    p
}

#[test]
fn a_root_that_stops_matching_is_dropped_at_once() {
    let me = std::process::id();
    let t = tree(&[("kubepods/besteffort/pod-a/agent", &[me])]);
    let proc_root = fake_proc("0::/\n", &mountinfo_v2(t.path(), "/../../../.."));
    let ns = CgroupNamespace::new(proc_root.path());
    let mut want = BTreeMap::new();
    want.insert(0, "/kubepods/besteffort/pod-a/agent".to_owned());
    assert_eq!(ns.roots(), NamespaceRoots::Namespaced(want.clone()));
    // Checked again on each use, from the cache.
    assert_eq!(ns.roots(), NamespaceRoots::Namespaced(want));
    // The agent is no longer where it was found (its cgroup renamed, say): nothing is
    // resolved through the stale root.
    let procs = t
        .path()
        .join("kubepods/besteffort/pod-a/agent/cgroup.procs");
    fs::write(&procs, "1\n").unwrap();
    assert_eq!(ns.roots(), NamespaceRoots::Namespaced(BTreeMap::new()));
}

#[test]
fn the_real_namespace_of_this_process() {
    let inode = fs::metadata("/proc/self/ns/cgroup").unwrap().ino();
    let roots = CgroupNamespace::new("/proc").roots();
    if inode == INITIAL_CGROUP_NS_INODE {
        assert_eq!(roots, NamespaceRoots::Initial);
    } else {
        // In a container: whatever was found resolves this process's own line to a
        // cgroup that lists it.
        eprintln!("in a cgroup namespace: {roots:?}");
    }
}

#[test]
fn mount_points_are_every_fifth_field_unescaped() {
    let table = format!(
        "{NAMESPACED_HYBRID}60 31 8:1 /nodes/n1/state /var/lib/shareguard rw - ext4 /dev/sda1 rw\n\
         61 31 8:1 /x /mnt/with\\040space rw - ext4 /dev/sda1 rw\nshort line\n"
    );
    let points = mount_points(&table);
    assert_eq!(points.len(), 7, "{points:?}");
    assert!(points.contains(&PathBuf::from("/var/lib/shareguard")));
    assert!(points.contains(&PathBuf::from("/mnt/with space")));
    assert!(!points.contains(&PathBuf::from("/var/lib")));
}
