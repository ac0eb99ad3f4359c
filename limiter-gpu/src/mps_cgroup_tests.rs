use std::process::{Command, Stdio};

use super::*;

/// A process started in the caller's cgroups ends up in the daemon cgroup of every
/// hierarchy: `/shareguard-mps` on v2 and the root on v1, and no longer in a cgroup it
/// shared with its starter; a second move finds nothing to do.
#[test]
fn a_daemon_leaves_its_starters_cgroups() {
    if !crate::test_root::require_root_for(
        "a_daemon_leaves_its_starters_cgroups",
        "moving a process between cgroups",
    ) {
        return;
    }
    let mut child = Command::new("sleep")
        .arg("100")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    // A name of this test's own: the tests run beside each other and each removes its
    // cgroup when it is done.
    let name = format!("sgt-mps-{}-cgroup-test", std::process::id());
    let before = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let moved = move_out(pid, &name);
    let after = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let again = move_out(pid, &name);
    let _ = child.kill();
    let _ = child.wait();
    for m in cgroup_mounts(&fs::read_to_string("/proc/self/mountinfo").unwrap()) {
        if m.v2 && m.root == "/" {
            let _ = fs::remove_dir(m.point.join(&name));
        }
    }
    let moved = moved.unwrap();
    for line in after.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap(), f.next().unwrap());
        let want = if ctrl.is_empty() {
            format!("/{name}")
        } else {
            "/".to_owned()
        };
        assert_eq!(path, want, "{line}: before\n{before}after\n{after}");
    }
    let changed = before
        .lines()
        .zip(after.lines())
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(moved, changed, "before\n{before}after\n{after}");
    assert_eq!(again.unwrap(), 0, "nothing left to move");
}
