//! From `/proc/PID/cgroup` to the pod a process belongs to.
//!
//! The kubelet names pod cgroups in one of two layouts, depending on its cgroup driver:
//!
//! - systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/...`
//!   with the uid's dashes turned into underscores (systemd reserves `-` in unit names
//!   for nesting);
//! - cgroupfs: `/kubepods/burstable/pod<uid>/<container>`.
//!
//! Guaranteed pods sit directly under `kubepods` (no QoS level), burstable and
//! besteffort pods one level down. Nested setups (kind, a `--cgroup-root`) add a prefix
//! such as `/kubelet.slice/kubelet-kubepods.slice/...`, which is accepted as long as the
//! `kubepods` marker is there. The input comes from processes we do not trust, so the
//! parser never panics and answers None for anything it does not recognise.
//!
//! # Inside a cgroup namespace
//!
//! The kernel writes each path of `/proc/PID/cgroup` relative to the *reader's* cgroup
//! namespace root in that hierarchy. An agent in a container with a private cgroup
//! namespace (the default for containers on cgroup v2 nodes) has its own container
//! cgroup as root, so a pod next to it reads `0::/../../../burstable/pod<uid>/<id>`: the
//! `kubepods` marker of the cgroupfs layout is gone, and even where a systemd unit name
//! survives, a name read off a relative path is a guess. Paths are therefore resolved
//! first: joined to the namespace root of their hierarchy ([`NamespaceRoots`], found by
//! `crate::cgroupns`) and normalised, `..` included; a path that climbs above the
//! hierarchy's root, or one of a hierarchy whose root is not known, is no answer. Only
//! then is the pod read off the path, so a process is attributed by where it really is
//! or not at all.
//!
//! [`pod_uid_of_pid`] reads the file for the watchdog's pid -> pod function.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// `/proc/PID/cgroup` is a few hundred bytes; the cap keeps a hostile mount (or a
/// pathological nesting) from making us read without end.
pub const MAX_PROC_CGROUP_BYTES: u64 = 64 * 1024;

/// The content of `<proc_root>/<pid>/cgroup`, at most [`MAX_PROC_CGROUP_BYTES`] of it.
/// A process that is gone reads as `ENOENT` (or `ESRCH` while it is being reaped).
pub fn read_proc_cgroup(proc_root: &Path, pid: u32) -> std::io::Result<String> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let mut content = String::new();
    File::open(&path)?
        .take(MAX_PROC_CGROUP_BYTES)
        .read_to_string(&mut content)?;
    Ok(content)
}

/// Where the reader's cgroup namespace is rooted, per hierarchy: what the paths of
/// `/proc/PID/cgroup` are relative to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceRoots {
    /// The initial cgroup namespace: every path is already absolute.
    Initial,
    /// A private cgroup namespace: the absolute path of its root (a plain path, from the
    /// hierarchy's root as mounted) by hierarchy id, `0` being cgroup v2. Lines of a
    /// hierarchy not listed cannot be resolved and are ignored.
    Namespaced(BTreeMap<u32, String>),
}

impl NamespaceRoots {
    /// The absolute form of `path` as a process in these namespaces reads it on the line
    /// of hierarchy `id`; None when it cannot be known.
    pub fn resolve(&self, id: &str, path: &str) -> Option<String> {
        match self {
            NamespaceRoots::Initial => resolve_path("/", path),
            NamespaceRoots::Namespaced(roots) => {
                let root = roots.get(&id.parse::<u32>().ok()?)?;
                resolve_path(root, path)
            }
        }
    }
}

/// `rel` (as `/proc/PID/cgroup` spells it: from the namespace root, maybe climbing out of
/// it with `..`) joined to `root` (absolute) and normalised. None when either is not
/// absolute or the result would climb above the hierarchy's root: such a path names no
/// cgroup we could know.
pub fn resolve_path(root: &str, rel: &str) -> Option<String> {
    if !root.starts_with('/') || !rel.starts_with('/') {
        return None;
    }
    let mut out: Vec<&str> = Vec::new();
    for seg in root.split('/').chain(rel.split('/')) {
        match seg {
            "" | "." => {}
            ".." => {
                out.pop()?;
            }
            s => out.push(s),
        }
    }
    Some(format!("/{}", out.join("/")))
}

/// The pod uid of a running process, read from `<proc_root>/<pid>/cgroup` and resolved
/// against the reader's namespace `roots`: the watchdog's pid -> pod function. None when
/// the process is gone, its file cannot be read, or it is in no pod (or in two) as far
/// as can be known.
pub fn pod_uid_of_pid(proc_root: &Path, roots: &NamespaceRoots, pid: u32) -> Option<String> {
    match read_proc_cgroup(proc_root, pid) {
        Ok(content) => pod_from_proc_cgroup_in(&content, roots).map(|p| p.uid),
        Err(e) => {
            if !matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) {
                tracing::debug!(pid, error = %e, "cannot read the cgroup of a GPU process");
            }
            None
        }
    }
}

/// Quality-of-service class, from where the pod cgroup sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodCgroup {
    /// Pod uid with dashes, as the API server spells it.
    pub uid: String,
    pub qos: Qos,
}

/// Pod of the process whose `/proc/PID/cgroup` content this is, read in the initial
/// cgroup namespace (see [`pod_from_proc_cgroup_in`]).
pub fn pod_from_proc_cgroup(content: &str) -> Option<PodCgroup> {
    pod_from_proc_cgroup_in(content, &NamespaceRoots::Initial)
}

/// Pod of the process whose `/proc/PID/cgroup` content this is, as read by a process
/// whose cgroup namespace has `roots`. The cgroup v2 line (`0::/path`) is preferred; v1
/// lines are used otherwise. Lines that name different pods make the answer None: a
/// process is in one pod or we do not know. A line that cannot be resolved adds nothing.
pub fn pod_from_proc_cgroup_in(content: &str, roots: &NamespaceRoots) -> Option<PodCgroup> {
    let mut v2 = None;
    let mut v1: Option<PodCgroup> = None;
    let mut v1_conflict = false;
    for line in content.lines() {
        // hierarchy-ID:controller-list:path; the path may itself contain ':'.
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Some(pod) = roots
            .resolve(id, path)
            .and_then(|abs| pod_from_cgroup_path(&abs))
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(pod);
        } else {
            match &v1 {
                Some(seen) if *seen != pod => v1_conflict = true,
                Some(_) => {}
                None => v1 = Some(pod),
            }
        }
    }
    match (v2, v1) {
        (Some(a), Some(b)) if a != b => None,
        (Some(a), _) => Some(a),
        (None, Some(b)) if !v1_conflict => Some(b),
        _ => None,
    }
}

/// Pod of one cgroup path (relative to the cgroup root, or absolute under
/// `/sys/fs/cgroup`).
pub fn pod_from_cgroup_path(path: &str) -> Option<PodCgroup> {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    for (i, seg) in segments.iter().enumerate() {
        if let Some(pod) = systemd_segment(seg) {
            return Some(pod);
        }
        if let Some(uid) = seg.strip_prefix("pod")
            && let Some(pod) = cgroupfs_segment(&segments[..i], uid)
        {
            return Some(pod);
        }
    }
    None
}

/// `[prefix-]kubepods[-burstable|-besteffort]-pod<uid_with_underscores>.slice`
fn systemd_segment(seg: &str) -> Option<PodCgroup> {
    let unit = seg.strip_suffix(".slice")?;
    let (prefix, uid) = unit.rsplit_once("-pod")?;
    let qos = if prefix.ends_with("kubepods-burstable") {
        Qos::Burstable
    } else if prefix.ends_with("kubepods-besteffort") {
        Qos::BestEffort
    } else if prefix.ends_with("kubepods") {
        Qos::Guaranteed
    } else {
        return None;
    };
    // The marker must be a whole word of the unit name, not the tail of "mykubepods".
    let head = prefix
        .strip_suffix("-burstable")
        .or_else(|| prefix.strip_suffix("-besteffort"))
        .unwrap_or(prefix);
    let before = head.strip_suffix("kubepods")?;
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    let uid = uid.replace('_', "-");
    valid_uid(&uid).then_some(PodCgroup { uid, qos })
}

/// `.../kubepods[/burstable|/besteffort]/pod<uid>`; `parents` are the segments above.
fn cgroupfs_segment(parents: &[&str], uid: &str) -> Option<PodCgroup> {
    let qos = match parents {
        [.., "kubepods", "burstable"] => Qos::Burstable,
        [.., "kubepods", "besteffort"] => Qos::BestEffort,
        [.., "kubepods"] => Qos::Guaranteed,
        _ => return None,
    };
    valid_uid(uid).then(|| PodCgroup {
        uid: uid.to_string(),
        qos,
    })
}

/// A pod uid: a lowercase RFC 4122 UUID, or the 32 hex digits the kubelet uses for
/// static pods (a hash of the manifest).
fn valid_uid(uid: &str) -> bool {
    let b = uid.as_bytes();
    let hex = |c: &u8| c.is_ascii_digit() || (b'a'..=b'f').contains(c);
    match b.len() {
        36 => b.iter().enumerate().all(|(i, c)| {
            if matches!(i, 8 | 13 | 18 | 23) {
                *c == b'-'
            } else {
                hex(c)
            }
        }),
        32 => b.iter().all(hex),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "1234abcd-5678-4ef0-9abc-def012345678";
    const UID_US: &str = "1234abcd_5678_4ef0_9abc_def012345678";

    #[test]
    fn layouts_table() {
        let cases: Vec<(String, Option<Qos>)> = vec![
            // systemd driver, all three QoS classes.
            (
                format!(
                    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice/cri-containerd-abc123.scope"
                ),
                Some(Qos::Burstable),
            ),
            (
                format!(
                    "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_US}.slice/crio-abc.scope"
                ),
                Some(Qos::BestEffort),
            ),
            (
                format!("0::/kubepods.slice/kubepods-pod{UID_US}.slice/cri-containerd-abc.scope"),
                Some(Qos::Guaranteed),
            ),
            // cgroupfs driver.
            (
                format!("0::/kubepods/burstable/pod{UID}/0123456789abcdef"),
                Some(Qos::Burstable),
            ),
            (
                format!("0::/kubepods/besteffort/pod{UID}/0123456789abcdef"),
                Some(Qos::BestEffort),
            ),
            (
                format!("0::/kubepods/pod{UID}/0123456789abcdef"),
                Some(Qos::Guaranteed),
            ),
            // The pod cgroup itself (no container level), e.g. the pause process.
            (format!("0::/kubepods/pod{UID}"), Some(Qos::Guaranteed)),
            // kind / nested kubelet with a cgroup root prefix.
            (
                format!(
                    "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_US}.slice/cri-containerd-x.scope"
                ),
                Some(Qos::BestEffort),
            ),
            // cgroup v1, several hierarchies that agree.
            (
                format!(
                    "12:memory:/kubepods/burstable/pod{UID}/c1\n11:cpu,cpuacct:/kubepods/burstable/pod{UID}/c1\n1:name=systemd:/kubepods/burstable/pod{UID}/c1"
                ),
                Some(Qos::Burstable),
            ),
            // Hybrid: v1 lines and an empty v2 line.
            (
                format!("5:devices:/kubepods/pod{UID}/c\n0::/"),
                Some(Qos::Guaranteed),
            ),
        ];
        for (content, qos) in cases {
            let got = pod_from_proc_cgroup(&content);
            match qos {
                Some(q) => assert_eq!(
                    got,
                    Some(PodCgroup {
                        uid: UID.into(),
                        qos: q
                    }),
                    "{content}"
                ),
                None => assert_eq!(got, None, "{content}"),
            }
        }
    }

    #[test]
    fn static_pod_hash_uid() {
        let hash = "0123456789abcdef0123456789abcdef";
        let got = pod_from_proc_cgroup(&format!("0::/kubepods/burstable/pod{hash}/c")).unwrap();
        assert_eq!(got.uid, hash);
    }

    #[test]
    fn not_pods() {
        let cases = [
            "",
            "0::/",
            "0::/system.slice/containerd.service",
            "0::/user.slice/user-1000.slice/session-3.scope",
            // A 'pod' segment without the kubepods ancestry is not a pod.
            "0::/docker/pod1234abcd-5678-4ef0-9abc-def012345678",
            "0::/mykubepods/pod1234abcd-5678-4ef0-9abc-def012345678",
            "0::/kubepods.slice/mykubepods-pod1234abcd_5678_4ef0_9abc_def012345678.slice",
            // Malformed uids.
            "0::/kubepods/pod1234",
            "0::/kubepods/podZZZZabcd-5678-4ef0-9abc-def012345678",
            "0::/kubepods/pod1234ABCD-5678-4EF0-9ABC-DEF012345678",
            "0::/kubepods/pod1234abcd-5678-4ef0-9abc-def0123456789",
            "0::/kubepods/pod1234abcd_5678_4ef0_9abc_def012345678",
            "0::/kubepods.slice/kubepods-pod.slice",
            "0::/kubepods.slice/kubepods-burstable-pod.slice",
            // Not a cgroup line at all.
            "garbage",
            "::::",
            "0:",
        ];
        for c in cases {
            assert_eq!(pod_from_proc_cgroup(c), None, "{c:?}");
        }
    }

    #[test]
    fn conflicting_lines_are_unknown() {
        let other = "aaaaaaaa-5678-4ef0-9abc-def012345678";
        let v1 = format!("12:memory:/kubepods/pod{UID}/c\n11:cpu:/kubepods/pod{other}/c");
        assert_eq!(pod_from_proc_cgroup(&v1), None);
        let mixed = format!("12:memory:/kubepods/pod{UID}/c\n0::/kubepods/pod{other}/c");
        assert_eq!(pod_from_proc_cgroup(&mixed), None);
    }

    fn ns(roots: &[(u32, &str)]) -> NamespaceRoots {
        NamespaceRoots::Namespaced(roots.iter().map(|(i, r)| (*i, (*r).to_owned())).collect())
    }

    #[test]
    fn paths_resolve_against_the_namespace_root() {
        let r = "/kubepods/besteffort/podA/c";
        for (rel, want) in [
            ("/", Some(r.to_owned())),
            ("/sub", Some(format!("{r}/sub"))),
            ("/../c2", Some("/kubepods/besteffort/podA/c2".to_owned())),
            (
                "/../../../burstable/podX/y",
                Some("/kubepods/burstable/podX/y".to_owned()),
            ),
            ("/../../../..", Some("/".to_owned())),
            // Above the hierarchy's root: no such cgroup.
            ("/../../../../..", None),
            ("/../../../../../../kubepods/burstable/podX/y", None),
            ("/././/x", Some(format!("{r}/x"))),
            // Not as the kernel writes it.
            ("", None),
            ("relative", None),
        ] {
            assert_eq!(resolve_path(r, rel), want, "{rel:?}");
        }
        assert_eq!(resolve_path("not/absolute", "/x"), None);
        assert_eq!(resolve_path("/", "/a/../.."), None);
    }

    /// Where an agent in its own cgroup namespace is, in each layout and QoS class, and
    /// how a process of pod UID reads from there.
    #[test]
    fn namespaced_paths_in_both_layouts() {
        let agent = "aaaaaaaa-5678-4ef0-9abc-def012345678";
        let agent_us = agent.replace('-', "_");
        let cases: Vec<(String, String, Qos)> = vec![
            // cgroupfs: agent besteffort, target burstable / guaranteed / besteffort.
            (
                format!("/kubepods/besteffort/pod{agent}/ctr"),
                format!("0::/../../../burstable/pod{UID}/c1"),
                Qos::Burstable,
            ),
            (
                format!("/kubepods/besteffort/pod{agent}/ctr"),
                format!("0::/../../../pod{UID}/c1"),
                Qos::Guaranteed,
            ),
            (
                format!("/kubepods/besteffort/pod{agent}/ctr"),
                format!("0::/../../pod{UID}/c1"),
                Qos::BestEffort,
            ),
            // cgroupfs: agent guaranteed (one level less), target burstable.
            (
                format!("/kubepods/pod{agent}/ctr"),
                format!("0::/../../burstable/pod{UID}/c1"),
                Qos::Burstable,
            ),
            // Nested under a cgroup root (kind, --cgroup-root).
            (
                format!("/sgt/kubepods/burstable/pod{agent}/ctr"),
                format!("0::/../../../besteffort/pod{UID}/c1"),
                Qos::BestEffort,
            ),
            // systemd: agent burstable, target besteffort / guaranteed / burstable.
            (
                format!(
                    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{agent_us}.slice/cri-containerd-a.scope"
                ),
                format!(
                    "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_US}.slice/cri-containerd-b.scope"
                ),
                Qos::BestEffort,
            ),
            (
                format!(
                    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{agent_us}.slice/cri-containerd-a.scope"
                ),
                format!("0::/../../../kubepods-pod{UID_US}.slice/cri-containerd-b.scope"),
                Qos::Guaranteed,
            ),
            (
                format!(
                    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{agent_us}.slice/cri-containerd-a.scope"
                ),
                format!("0::/../../kubepods-burstable-pod{UID_US}.slice/cri-containerd-b.scope"),
                Qos::Burstable,
            ),
        ];
        for (root, line, qos) in cases {
            let got = pod_from_proc_cgroup_in(&line, &ns(&[(0, &root)]));
            assert_eq!(
                got,
                Some(PodCgroup {
                    uid: UID.into(),
                    qos
                }),
                "{root} + {line}"
            );
        }
        // What the old reading gave the cgroupfs layout: nothing, since the relative
        // path lost its kubepods marker.
        assert_eq!(
            pod_from_proc_cgroup(&format!("0::/../../../burstable/pod{UID}/c1")),
            None
        );
        // The agent's own pod, seen from inside it.
        let root = format!("/kubepods/besteffort/pod{agent}/ctr");
        for line in ["0::/", "0::/../sidecar"] {
            assert_eq!(
                pod_from_proc_cgroup_in(line, &ns(&[(0, &root)])).map(|p| p.uid),
                Some(agent.to_owned()),
                "{line}"
            );
        }
    }

    #[test]
    fn namespaced_v1_lines_resolve_each_in_their_hierarchy() {
        let agent = "aaaaaaaa-5678-4ef0-9abc-def012345678";
        let other = "bbbbbbbb-5678-4ef0-9abc-def012345678";
        // Each hierarchy has its own namespace root (the agent's cgroup there).
        let agent_root = format!("/kubepods/besteffort/pod{agent}/ctr");
        let roots = ns(&[(4, &agent_root), (9, "/system.slice/containerd.service")]);
        let target = format!("4:memory:/../../../burstable/pod{UID}/c1");
        assert_eq!(
            pod_from_proc_cgroup_in(&target, &roots).map(|p| (p.uid, p.qos)),
            Some((UID.to_owned(), Qos::Burstable))
        );
        // name=systemd from the runtime's service cgroup.
        let both = format!("{target}\n9:name=systemd:/../../kubepods/burstable/pod{UID}/c1");
        assert_eq!(
            pod_from_proc_cgroup_in(&both, &roots)
                .map(|p| p.uid)
                .as_deref(),
            Some(UID)
        );
        // Lines disagreeing once resolved: unknown.
        let split = format!("{target}\n9:name=systemd:/../../kubepods/burstable/pod{other}/c1");
        assert_eq!(pod_from_proc_cgroup_in(&split, &roots), None);
        // A hierarchy whose root is unknown adds nothing: the same relative text under
        // hierarchy 5 would be read against the wrong root.
        let unknown = format!("5:devices:/../../../burstable/pod{other}/c1\n{target}");
        assert_eq!(
            pod_from_proc_cgroup_in(&unknown, &roots)
                .map(|p| p.uid)
                .as_deref(),
            Some(UID)
        );
        let alone = format!("5:devices:/../../../burstable/pod{other}/c");
        assert_eq!(pod_from_proc_cgroup_in(&alone, &roots), None);
        // The v2 line wins over v1 lines when it resolves, and must agree with them.
        let with_v2 = ns(&[(4, &agent_root), (0, &agent_root)]);
        let mixed = format!("{target}\n0::/../../../burstable/pod{other}/c1");
        assert_eq!(pod_from_proc_cgroup_in(&mixed, &with_v2), None);
    }

    #[test]
    fn namespaced_paths_that_climb_too_high_or_cannot_be_resolved() {
        let roots = ns(&[(0, "/kubepods/besteffort/podA/ctr")]);
        for line in [
            // Above the hierarchy's root, even with a pod written after it.
            format!("0::/../../../../../kubepods/burstable/pod{UID}/c"),
            format!("0::/../../../../../../../../../../kubepods/pod{UID}/c"),
            // A systemd unit name is not trusted when the path cannot be resolved.
            format!("0::/../../../../../kubepods-burstable-pod{UID_US}.slice/c"),
            // Up to the hierarchy's root: no pod there.
            "0::/../../../..".to_owned(),
        ] {
            assert_eq!(pod_from_proc_cgroup_in(&line, &roots), None, "{line}");
        }
        // No root known for the hierarchy at all: nothing is attributed, however
        // pod-like the text, since it is relative to somewhere unknown.
        let none = NamespaceRoots::Namespaced(BTreeMap::new());
        for line in [
            format!("0::/kubepods/burstable/pod{UID}/c"),
            format!("0::/../../kubepods-burstable-pod{UID_US}.slice/c"),
        ] {
            assert_eq!(pod_from_proc_cgroup_in(&line, &none), None, "{line}");
        }
        // In the initial namespace a path climbing above the root is no path.
        assert_eq!(
            pod_from_proc_cgroup(&format!("0::/../kubepods/pod{UID}/c")),
            None
        );
    }

    #[test]
    fn namespaced_hostile_inputs_do_not_panic() {
        let roots = ns(&[(0, "/kubepods/besteffort/podA/ctr"), (4, "/")]);
        let deep = format!("0::{}", "/..".repeat(100_000));
        let wide = format!("0::/{}", "x/".repeat(100_000));
        let inputs = [
            "0::..",
            "0::/..\0/kubepods",
            "x::/../..",
            "-1::/",
            "99999999999999999999::/",
            "4:memory:",
            "4:memory:/..",
            "0::/../\u{1F600}/../..",
            deep.as_str(),
            wide.as_str(),
        ];
        for i in inputs {
            assert_eq!(
                pod_from_proc_cgroup_in(i, &roots),
                None,
                "{:?}",
                i.chars().take(40).collect::<String>()
            );
        }
    }

    #[test]
    fn pod_of_pid_in_a_namespace() {
        let proc_root = fake_proc(&[(30, &format!("0::/../../../burstable/pod{UID}/c\n"))]);
        let roots = ns(&[(0, "/kubepods/besteffort/podA/ctr")]);
        assert_eq!(
            pod_uid_of_pid(proc_root.path(), &roots, 30).as_deref(),
            Some(UID)
        );
        assert_eq!(
            pod_uid_of_pid(proc_root.path(), &NamespaceRoots::Initial, 30),
            None
        );
    }

    fn fake_proc(entries: &[(u32, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (pid, content) in entries {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("cgroup"), content).unwrap();
        }
        dir
    }

    #[test]
    fn pod_of_pid_reads_the_proc_file() {
        let other = "aaaaaaaa-5678-4ef0-9abc-def012345678";
        let proc_root = fake_proc(&[
            (
                10,
                &format!(
                    "1:name=systemd:/\n0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice/cri-containerd-a.scope\n"
                ),
            ),
            (
                11,
                &format!("9:name=systemd:/kubepods/besteffort/pod{other}/c\n0::/\n"),
            ),
            (12, "0::/system.slice/containerd.service\n"),
        ]);
        let root = proc_root.path();
        assert_eq!(
            pod_uid_of_pid(root, &NamespaceRoots::Initial, 10).as_deref(),
            Some(UID)
        );
        assert_eq!(
            pod_uid_of_pid(root, &NamespaceRoots::Initial, 11).as_deref(),
            Some(other)
        );
        assert_eq!(pod_uid_of_pid(root, &NamespaceRoots::Initial, 12), None);
        // No such process.
        assert_eq!(pod_uid_of_pid(root, &NamespaceRoots::Initial, 13), None);
        let err = read_proc_cgroup(root, 13).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    }

    #[test]
    fn pod_of_pid_reads_at_most_the_cap() {
        // A pod line past the cap is not seen: the read stops there.
        let padding = format!(
            "1:name=systemd:/{}\n",
            "x".repeat(MAX_PROC_CGROUP_BYTES as usize)
        );
        let proc_root = fake_proc(&[(20, &format!("{padding}0::/kubepods/pod{UID}/c\n"))]);
        let content = read_proc_cgroup(proc_root.path(), 20).unwrap();
        assert_eq!(content.len() as u64, MAX_PROC_CGROUP_BYTES);
        assert_eq!(
            pod_uid_of_pid(proc_root.path(), &NamespaceRoots::Initial, 20),
            None
        );
    }

    #[test]
    fn pod_of_pid_against_the_real_proc() {
        // The test process is in no pod; the file is there and has a line per hierarchy.
        let proc_root = Path::new("/proc");
        let content = read_proc_cgroup(proc_root, std::process::id()).unwrap();
        assert!(content.lines().count() >= 1, "{content:?}");
        assert_eq!(
            pod_uid_of_pid(proc_root, &NamespaceRoots::Initial, std::process::id()),
            None
        );
        // PID max on Linux is at most 2^22; this one cannot exist.
        assert_eq!(
            pod_uid_of_pid(proc_root, &NamespaceRoots::Initial, 4_194_304 + 17),
            None
        );
    }

    #[test]
    fn hostile_inputs_do_not_panic() {
        let long = "a/".repeat(100_000);
        let inputs = [
            "\0\0\0",
            "0::/kubepods/pod\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}",
            "0::/kubepods.slice/kubepods-pod\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}\u{e9}.slice",
            "0::/kubepods/-pod/pod/.slice/-pod.slice",
            "0::////kubepods////pod",
            "\n\n\n0::\n",
            long.as_str(),
        ];
        for i in inputs {
            assert_eq!(pod_from_proc_cgroup(i), None, "{:?}", &i[..i.len().min(40)]);
        }
    }
}
