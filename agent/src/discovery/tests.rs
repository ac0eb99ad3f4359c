//! Discovery's verdicts on a fake cgroup tree and a fake `/proc`: a process is a
//! directory with a `stat` (its start time) and, unless it is exiting, an `ns/net`
//! whose inode stands for its network namespace.

use std::{fs, os::unix::fs::MetadataExt, path::Path};

use super::*;

const POD: &str = "0b6a4c9e-1111-4c3e-9f00-000000000042";

struct Node {
    _dir: tempfile::TempDir,
    mount: PathBuf,
    proc_root: PathBuf,
    host_netns: u64,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("cgroup");
        let proc_root = dir.path().join("proc");
        fs::create_dir_all(mount.join(format!("kubepods/pod{POD}"))).unwrap();
        fs::create_dir_all(&proc_root).unwrap();
        // The machine has been up for 1,000 s.
        fs::write(proc_root.join("uptime"), "1000.00 1500.00\n").unwrap();
        let host = proc_root.join("host-netns");
        fs::write(&host, "").unwrap();
        let host_netns = fs::metadata(&host).unwrap().ino();
        Node {
            _dir: dir,
            mount,
            proc_root,
            host_netns,
        }
    }

    /// A process of the pod started at second 10 of the machine's uptime; `netns`:
    /// a file whose inode is its namespace, None for a process that is exiting.
    fn process(&self, pid: u32, netns: Option<&Path>) {
        let dir = self.proc_root.join(pid.to_string());
        fs::create_dir_all(dir.join("ns")).unwrap();
        let fields: Vec<String> = (4..=21).map(|f| f.to_string()).collect();
        // Field 22, the start time, in ticks of 1/100 s.
        fs::write(
            dir.join("stat"),
            format!("{pid} (p) S {} 1000 23\n", fields.join(" ")),
        )
        .unwrap();
        if let Some(ns) = netns {
            fs::hard_link(ns, dir.join("ns/net")).unwrap();
        }
    }

    fn procs(&self, pids: &[u32]) {
        let list: String = pids.iter().map(|p| format!("{p}\n")).collect();
        fs::write(
            self.mount.join(format!("kubepods/pod{POD}/cgroup.procs")),
            list,
        )
        .unwrap();
    }

    fn find(&self) -> Found {
        let d = Discovery::new(
            self.mount.clone(),
            Vec::new(),
            self.proc_root.clone(),
            self.host_netns,
            None,
        );
        let target = TargetRecord::new(vec![POD.to_owned()], Default::default());
        d.find(&target, Needs::Network, &[])
    }
}

#[test]
fn a_pod_whose_processes_are_all_exiting_waits_and_is_not_called_host_network() {
    let n = Node::new();
    let host = n.proc_root.join("host-netns");
    // Both exiting (zombies: no namespace to read), long after they started.
    n.process(10, None);
    n.process(11, None);
    n.procs(&[10, 11]);
    match n.find() {
        Found::Waiting(why) => assert!(why.contains("exiting"), "{why}"),
        other => panic!("a pod being torn down is not hostNetwork: {other:?}"),
    }

    // One of them alive in the host's namespace: hostNetwork, the zombie beside it
    // changing nothing.
    n.process(12, Some(&host));
    n.procs(&[10, 11, 12]);
    assert_eq!(
        n.find(),
        Found::HostNetwork {
            pod_uid: POD.to_owned()
        }
    );
}
