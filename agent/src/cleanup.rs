//! `shareguard cleanup`: everything shareguard put on this node, found from the agent's
//! config, listed (the default, a dry run) or removed (`--apply`): each share's root
//! qdisc and queue devices, the pinned BPF programs and maps (unpinning detaches them), the claims'
//! CDI specs, the MPS daemons and their directories, the kubelet plugin's directories,
//! the API socket, the state and the audit log (and the directories shareguard made
//! for them, once nothing else is in them). For uninstalling: removing
//! while an agent runs would only have it put things back, so `--apply` refuses then.
//!
//! Things are recognised by what shareguard makes them as, never by a name fragment:
//! qdiscs named by an install record and still ours, queue devices in shareguard's device group,
//! CDI specs named `<driver>-gpu_<claim uid>.json` for a configured driver, MPS
//! directories that carry their share's key.

use std::path::{Path, PathBuf};

use serde::Serialize;
use shareguard_limiter_net::cleanup::{self as net, Leftover};

use crate::config::Config;

/// One thing found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Item {
    /// "qdisc", "queue device", "bpf-pins", "cdi-spec", "mps-daemon", "plugin-dir", "socket-dir",
    /// "state", "audit-log".
    pub kind: &'static str,
    pub what: String,
    #[serde(skip)]
    action: Action,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    Net(Leftover),
    Tree(PathBuf),
    File(PathBuf),
    /// A directory shareguard made, removed only once nothing else is in it: a
    /// configured path may be shared (a socket in /run), and nothing but shareguard's
    /// own is ever removed from it.
    EmptyDir(PathBuf),
    /// A share's MPS daemon (key) and the directory its stop removes.
    Mps(String, PathBuf),
}

/// Where the kubelet keeps plugins (`--kubelet-dir`).
pub const KUBELET_DIR: &str = "/var/lib/kubelet";

/// Everything found, in the order it is removed: what holds traffic or processes first,
/// then files, the state last (it is what names the rest).
pub fn find(cfg: &Config, kubelet_dir: &Path, keep_audit: bool) -> anyhow::Result<Vec<Item>> {
    let mut items = Vec::new();
    let a = &cfg.agent;
    let net_state = a.state_dir.join("net");
    for l in net::leftovers(&net_state)? {
        items.push(Item {
            kind: match l {
                Leftover::RootQdisc { .. } => "qdisc",
                Leftover::Queue { .. } => "queue device",
            },
            what: l.describe(),
            action: Action::Net(l),
        });
    }
    let mps = shareguard_limiter_gpu::mps::MpsDaemons::new(a.mps.clone())?;
    for key in mps.share_keys()? {
        let dir = mps
            .base_dir()
            .join(shareguard_limiter_gpu::mps::dir_name(&key));
        items.push(Item {
            kind: "mps-daemon",
            what: format!("MPS daemon of share {key} and {}", dir.display()),
            action: Action::Mps(key, dir),
        });
    }
    let tree = |kind: &'static str, p: &Path| {
        p.exists().then(|| Item {
            kind,
            what: p.display().to_string(),
            action: Action::Tree(p.to_owned()),
        })
    };
    // A directory something is mounted on (a volume of its own, or a container's
    // hostPath when cleanup runs from the image) is emptied but stays: removing it is
    // not ours to do, and rmdir would fail with EBUSY anyway.
    let mounts = mount_points();
    let empty_dir = |kind: &'static str, p: &Path| {
        (p.is_dir() && !is_mounted_on(&mounts, p)).then(|| Item {
            kind,
            what: format!("{} (once empty)", p.display()),
            action: Action::EmptyDir(p.to_owned()),
        })
    };
    items.extend(empty_dir("mps-dir", &a.mps.dir));
    // The agent pins everything under `net/` of its BPF directory.
    items.extend(tree("bpf-pins", &a.bpffs_dir.join("net")));
    items.extend(empty_dir("bpf-pins", &a.bpffs_dir));
    let mut drivers: Vec<&str> = cfg.devices.iter().map(|d| d.driver.as_str()).collect();
    drivers.sort_unstable();
    drivers.dedup();
    for spec in cdi_specs(&a.cdi_dir, &drivers)? {
        items.push(Item {
            kind: "cdi-spec",
            what: spec.display().to_string(),
            action: Action::File(spec),
        });
    }
    for d in &drivers {
        for sub in ["plugins", "plugins_registry"] {
            items.extend(tree("plugin-dir", &kubelet_dir.join(sub).join(d)));
        }
    }
    if std::fs::symlink_metadata(&a.socket)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        items.push(Item {
            kind: "socket",
            what: a.socket.display().to_string(),
            action: Action::File(a.socket.clone()),
        });
    }
    if let Some(dir) = a.socket.parent() {
        items.extend(empty_dir("socket", dir));
    }
    // What the agent keeps in its state directory: the store and the bandwidth
    // limiter's install records (the audit log, by default, below).
    for sub in ["store", "net"] {
        items.extend(tree("state", &a.state_dir.join(sub)));
    }
    let lock = a.state_dir.join(crate::agent_lock::FILE_NAME);
    if lock.is_file() {
        items.push(Item {
            kind: "state",
            what: lock.display().to_string(),
            action: Action::File(lock),
        });
    }
    if !keep_audit {
        for f in crate::audit::query::log_files(&a.audit_log).unwrap_or_default() {
            items.push(Item {
                kind: "audit-log",
                what: f.display().to_string(),
                action: Action::File(f),
            });
        }
    }
    items.extend(empty_dir("state", &a.state_dir));
    Ok(keep_emptied(items))
}

/// The mount points of this process's mount namespace; none when mountinfo cannot be
/// read (then a mounted directory is listed, and its removal reports EBUSY).
fn mount_points() -> std::collections::HashSet<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            shareguard_limiter_gpu::cgroupns::mount_points(&m)
                .into_iter()
                .collect()
        })
        .unwrap_or_default()
}

/// `p` as configured or as it resolves (/var/run/cdi is /run/cdi on most hosts).
fn is_mounted_on(mounts: &std::collections::HashSet<PathBuf>, p: &Path) -> bool {
    mounts.contains(p) || p.canonicalize().is_ok_and(|c| mounts.contains(&c))
}

/// Drops the directories that would not be empty once the other items are gone: they
/// hold something that is not shareguard's, and stay.
fn keep_emptied(items: Vec<Item>) -> Vec<Item> {
    let removed: std::collections::HashSet<PathBuf> = items
        .iter()
        .filter_map(|i| match &i.action {
            Action::Tree(p) | Action::File(p) | Action::EmptyDir(p) | Action::Mps(_, p) => {
                Some(p.clone())
            }
            Action::Net(_) => None,
        })
        .collect();
    items
        .iter()
        .filter(|i| match &i.action {
            Action::EmptyDir(p) => std::fs::read_dir(p)
                .is_ok_and(|entries| entries.flatten().all(|e| removed.contains(&e.path()))),
            _ => true,
        })
        .cloned()
        .collect()
}

/// The claims' CDI specs of `drivers` in `dir`: `<driver>-gpu_<claim uid>.json`.
fn cdi_specs(dir: &Path, drivers: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let listing = match std::fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow::anyhow!("listing {}: {e}", dir.display())),
    };
    let mut out = Vec::new();
    for entry in listing {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = drivers.iter().any(|d| {
            name.strip_prefix(&format!("{d}-gpu_"))
                .and_then(|rest| rest.strip_suffix(".json"))
                .is_some_and(|uid| {
                    !uid.is_empty()
                        && uid
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                })
        });
        if ours && entry.file_type().is_ok_and(|t| t.is_file()) {
            out.push(entry.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Removes `item`; Ok when it is gone (or was already).
pub fn remove(cfg: &Config, item: &Item) -> anyhow::Result<()> {
    match &item.action {
        Action::Net(l) => net::remove(l)?,
        Action::Mps(key, _) => {
            shareguard_limiter_gpu::mps::MpsDaemons::new(cfg.agent.mps.clone())?.stop(key)?;
        }
        Action::Tree(p) => match std::fs::remove_dir_all(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(anyhow::anyhow!("removing {}: {e}", p.display())),
        },
        Action::EmptyDir(p) => match std::fs::remove_dir(p) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::DirectoryNotEmpty
                ) => {}
            Err(e) => return Err(anyhow::anyhow!("removing {}: {e}", p.display())),
        },
        Action::File(p) => match std::fs::remove_file(p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(anyhow::anyhow!("removing {}: {e}", p.display())),
        },
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_specs_named_as_shareguard_names_them_are_found() {
        let dir = tempfile::tempdir().unwrap();
        for f in [
            "d.example.com-gpu_6b3d0f3e-1c52-4b8e-9d0c-9b7a8f0e1a11.json",
            "d.example.com-gpu_.json",
            "d.example.com-gpu_x.yaml",
            "other.example.com-gpu_abc.json",
            "nvidia.com-gpu.json",
            "d.example.com-gpu_a b.json",
        ] {
            std::fs::write(dir.path().join(f), "{}").unwrap();
        }
        std::fs::create_dir(dir.path().join("d.example.com-gpu_dir.json")).unwrap();
        let found = cdi_specs(dir.path(), &["d.example.com"]).unwrap();
        let names: Vec<String> = found
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            ["d.example.com-gpu_6b3d0f3e-1c52-4b8e-9d0c-9b7a8f0e1a11.json"]
        );
        assert!(
            cdi_specs(&dir.path().join("absent"), &["d"])
                .unwrap()
                .is_empty()
        );
    }
}
