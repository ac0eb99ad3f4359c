//! What the limiter installed for each share, one small JSON file per share under its
//! state directory, written atomically.
//!
//! The kernel objects (qdiscs, queue devices, pinned links) outlive the agent, and so must
//! the knowledge of which interface each share was installed on: a release often comes
//! after the pod's network namespace, and with it the means to resolve the interface
//! again, is gone.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{bpf::Direction, error::NetError, mechanism::Mechanism};

/// One share's install record. Versioned by its fields: a field added later carries a
/// serde default that says what records written before it meant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Installed {
    pub share_key: String,
    /// How it is enforced; records from before the field existed were all HTB.
    #[serde(default = "htb")]
    pub mechanism: Mechanism,
    /// The host-side interface of the share's (first) pod when it was installed; its
    /// pinned links are named [`crate::limiter::link_name`].
    pub host_index: u32,
    pub host_name: String,
    /// The host-side interfaces of the share's other pods: one limit holds them all
    /// together. Their links are named after their index. Records from before the field
    /// existed had one pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_hosts: Vec<Host>,
    /// `htb-ebpf` with several pods: the queue device that traffic to all of them is
    /// redirected to (its peer is [`to_return_name`]). Once made, it stays while the share
    /// is installed, also with one pod left: changing layouts back would leave a moment
    /// with the pods unshaped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_queue: Option<String>,
    /// Traffic to the pod (egress of the host side), bit/s.
    pub to_pod_bps: Option<u64>,
    /// Traffic from the pod (redirected to `queue`), bit/s.
    pub from_pod_bps: Option<u64>,
    /// The queue device traffic from the pod is redirected to (its peer is
    /// [`return_name`]), or the ifb an earlier version used, under the name it had then.
    #[serde(alias = "ifb")]
    pub queue: Option<String>,
    /// The share's counter slot (index into the programs' counter and pacing arrays),
    /// allocated among the installed shares. Records from before it was allocated used
    /// the interface's index, which [`Installed::slot`] still reads them as.
    #[serde(default)]
    pub slot: Option<u32>,
    /// The device's line rate when the share was installed, bit/s: a direction whose
    /// limit is at or above it is unconstrained (nothing shaped, only counted). Records
    /// from before the field existed shaped every direction.
    #[serde(default)]
    pub path_bps: Option<u64>,
    /// The device is in the rollout's `observe` stage: the programs count both
    /// directions and nothing shapes either. Records from before the field existed
    /// were all limits.
    #[serde(default)]
    pub count_only: bool,
}

/// One host-side interface of a share's pod.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Host {
    pub index: u32,
    pub name: String,
}

impl Installed {
    /// Every host-side interface of the share, the first one first; `true` marks it.
    pub fn hosts(&self) -> Vec<(Host, bool)> {
        let first = Host {
            index: self.host_index,
            name: self.host_name.clone(),
        };
        std::iter::once((first, true))
            .chain(self.more_hosts.iter().map(|h| (h.clone(), false)))
            .collect()
    }

    /// Whether the share's record names interface `index` called `name`.
    pub fn has_host(&self, index: u32, name: &str) -> bool {
        self.hosts()
            .iter()
            .any(|(h, _)| h.index == index && h.name == name)
    }

    /// The direction's limit, bit/s, if it has one.
    pub fn limit(&self, dir: Direction) -> Option<u64> {
        match dir {
            Direction::ToPod => self.to_pod_bps,
            Direction::FromPod => self.from_pod_bps,
        }
    }

    /// Whether the direction has a limit at or above what the path carries.
    pub fn unconstrained(&self, dir: Direction) -> bool {
        is_unconstrained(self.limit(dir), self.path_bps)
    }

    /// The rate the direction is shaped to: its limit, unless it has none or is
    /// unconstrained.
    pub fn shaped(&self, dir: Direction) -> Option<u64> {
        shaped(self.limit(dir), self.path_bps).filter(|_| !self.count_only)
    }

    /// The counter slot in use: the allocated one, or the interface index of a record
    /// written before slots were allocated (when that fits the arrays).
    pub fn slot(&self) -> Option<u32> {
        self.slot.or_else(|| {
            (self.host_index < shareguard_ebpf_common::MAX_SLOTS).then_some(self.host_index)
        })
    }
}

/// A limit at or above the path's line rate is unconstrained: the path never carries
/// more, so shaping would cost throughput and CPU and hold nothing back.
pub fn is_unconstrained(limit_bps: Option<u64>, path_bps: Option<u64>) -> bool {
    matches!((limit_bps, path_bps), (Some(l), Some(p)) if l >= p)
}

/// The rate a direction limited to `limit_bps` is shaped to on a path of `path_bps`:
/// none when it has no limit or is unconstrained.
pub fn shaped(limit_bps: Option<u64>, path_bps: Option<u64>) -> Option<u64> {
    limit_bps.filter(|_| !is_unconstrained(limit_bps, path_bps))
}

fn htb() -> Mechanism {
    Mechanism::HtbEbpf
}

/// 64-bit FNV-1a: a hash that never changes between builds, for names that must stay
/// the same across agent versions (files, queue devices, pinned links).
pub fn stable_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// 12 hex digits of the share key's hash: short enough for interface names (15 bytes).
pub fn short_id(share_key: &str) -> String {
    format!("{:012x}", stable_hash(share_key) & 0xffff_ffff_ffff)
}

/// The share's queue device: traffic from the pod is redirected to its egress.
pub fn queue_name(share_key: &str) -> String {
    format!("sgb{}", short_id(share_key))
}

/// The peer of the share's queue device, where the return program sends what the queue
/// released back to the pod's host veth.
pub fn return_name(share_key: &str) -> String {
    format!("sgr{}", short_id(share_key))
}

/// The share's to-pod queue device (`htb-ebpf` with several pods): traffic to its pods
/// is redirected to its egress.
pub fn to_queue_name(share_key: &str) -> String {
    format!("sgt{}", short_id(share_key))
}

/// The peer of the share's to-pod queue device.
pub fn to_return_name(share_key: &str) -> String {
    format!("sgu{}", short_id(share_key))
}

/// A share key as a file name: letters, digits, `-` and `_` as they are, every other
/// byte as `%XX`, so that distinct keys get distinct names and none escapes the directory.
pub fn file_name(share_key: &str) -> String {
    let mut out = String::with_capacity(share_key.len());
    for b in share_key.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub struct StateDir {
    dir: PathBuf,
}

fn serr(path: &Path, e: impl std::fmt::Display) -> NetError {
    NetError::State {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

/// An I/O error on the state directory. A full disk, an exhausted quota or a filesystem
/// remounted read-only can pass without anyone changing the request, so those are their
/// own (retryable) kind.
fn ioerr(path: &Path, e: std::io::Error) -> NetError {
    const ENOSPC: i32 = 28;
    const EROFS: i32 = 30;
    const EDQUOT: i32 = 122;
    if matches!(e.raw_os_error(), Some(ENOSPC | EROFS | EDQUOT)) {
        NetError::StateUnwritable {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    } else {
        serr(path, e)
    }
}

impl StateDir {
    pub fn open(dir: &Path) -> Result<StateDir, NetError> {
        fs::create_dir_all(dir).map_err(|e| ioerr(dir, e))?;
        Ok(StateDir {
            dir: dir.to_owned(),
        })
    }

    /// One file per share, named after the whole share key (escaped), so that two
    /// shares can never write each other's record.
    fn path(&self, share_key: &str) -> PathBuf {
        self.dir.join(format!("{}.json", file_name(share_key)))
    }

    /// Where records were kept before they were named after the whole key: twelve hex
    /// digits of its hash, which two keys can share.
    fn legacy_path(&self, share_key: &str) -> PathBuf {
        self.dir.join(format!("{}.json", short_id(share_key)))
    }

    pub fn get(&self, share_key: &str) -> Result<Option<Installed>, NetError> {
        for p in [self.path(share_key), self.legacy_path(share_key)] {
            match fs::read(&p) {
                Ok(b) => {
                    let i: Installed = serde_json::from_slice(&b).map_err(|e| serr(&p, e))?;
                    // A legacy name can belong to another key; the file says whose it is.
                    if i.share_key == share_key {
                        return Ok(Some(i));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ioerr(&p, e)),
            }
        }
        Ok(None)
    }

    pub fn all(&self) -> Result<Vec<Installed>, NetError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(|e| ioerr(&self.dir, e))? {
            let p = entry.map_err(|e| ioerr(&self.dir, e))?.path();
            if p.extension().is_some_and(|x| x == "json") {
                let b = fs::read(&p).map_err(|e| ioerr(&p, e))?;
                out.push(serde_json::from_slice(&b).map_err(|e| serr(&p, e))?);
            }
        }
        Ok(out)
    }

    /// Written to a temporary file, synced, renamed over the old one, and the directory
    /// synced: a crash leaves the old record or the new one, never half of one.
    pub fn put(&self, i: &Installed) -> Result<(), NetError> {
        let p = self.path(&i.share_key);
        let tmp = p.with_extension("json.tmp");
        let body = serde_json::to_vec_pretty(i).map_err(|e| serr(&p, e))?;
        let mut f = fs::File::create(&tmp).map_err(|e| ioerr(&tmp, e))?;
        f.write_all(&body)
            .and_then(|()| f.sync_all())
            .map_err(|e| ioerr(&tmp, e))?;
        fs::rename(&tmp, &p).map_err(|e| ioerr(&p, e))?;
        self.remove_legacy(&i.share_key)?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| ioerr(&self.dir, e))
    }

    /// Removes the record's legacy file, when it holds this key's record.
    fn remove_legacy(&self, share_key: &str) -> Result<(), NetError> {
        let p = self.legacy_path(share_key);
        let ours = match fs::read(&p) {
            Ok(b) => {
                serde_json::from_slice::<Installed>(&b).is_ok_and(|i| i.share_key == share_key)
            }
            Err(_) => false,
        };
        if ours {
            fs::remove_file(&p).map_err(|e| ioerr(&p, e))?;
        }
        Ok(())
    }

    pub fn remove(&self, share_key: &str) -> Result<(), NetError> {
        let p = self.path(share_key);
        match fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ioerr(&p, e)),
        }
        self.remove_legacy(share_key)?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| ioerr(&self.dir, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_or_read_only_disk_is_retryable() {
        use shareguard_common::limiter::{LimiterError, Retry};
        let p = Path::new("/x");
        for errno in [28, 30, 122] {
            let e: LimiterError = ioerr(p, std::io::Error::from_raw_os_error(errno)).into();
            assert_eq!(e.retry, Retry::Retryable, "errno {errno}: {e}");
        }
        let e: LimiterError = ioerr(p, std::io::Error::from_raw_os_error(13)).into();
        assert_eq!(e.retry, Retry::Permanent, "EACCES does not pass by itself");
    }

    #[test]
    fn names_are_stable_and_fit_interface_names() {
        // Pinned values: changing the hash would orphan every installed share.
        assert_eq!(stable_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash("a"), 0xaf63_dc4c_8601_ec8c);
        let n = queue_name("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c");
        assert_eq!(n.len(), 15);
        assert_eq!(n, queue_name("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c"));
    }

    #[test]
    fn put_get_remove_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::open(d.path()).unwrap();
        let i = Installed {
            share_key: "k".into(),
            mechanism: Mechanism::EdtFq,
            host_index: 7,
            host_name: "veth1".into(),
            to_pod_bps: Some(50_000_000),
            from_pod_bps: None,
            queue: None,
            path_bps: None,
            slot: Some(3),
            count_only: false,
            more_hosts: Vec::new(),
            to_queue: None,
        };
        assert_eq!(s.get("k").unwrap(), None);
        s.put(&i).unwrap();
        assert_eq!(s.get("k").unwrap(), Some(i.clone()));
        assert_eq!(s.all().unwrap(), vec![i]);
        s.remove("k").unwrap();
        s.remove("k").unwrap();
        assert_eq!(s.get("k").unwrap(), None);
    }

    #[test]
    fn records_from_before_the_mechanism_field_read_as_htb() {
        let old = r#"{"share_key":"k","host_index":7,"host_name":"v","to_pod_bps":8,"from_pod_bps":null,"ifb":null}"#;
        let i: Installed = serde_json::from_str(old).unwrap();
        assert_eq!(i.mechanism, Mechanism::HtbEbpf);
        assert_eq!(i.slot(), Some(7), "the interface index was the slot then");
        assert_eq!(i.path_bps, None);
        assert_eq!(i.shaped(Direction::ToPod), Some(8), "older records shaped");
    }

    #[test]
    fn a_direction_at_or_above_the_line_rate_is_unconstrained() {
        let i = Installed {
            share_key: "k".into(),
            mechanism: Mechanism::HtbEbpf,
            host_index: 7,
            host_name: "v".into(),
            to_pod_bps: Some(25_000_000_000),
            from_pod_bps: Some(24_999_999_999),
            queue: None,
            path_bps: Some(25_000_000_000),
            slot: Some(1),
            count_only: false,
            more_hosts: Vec::new(),
            to_queue: None,
        };
        assert!(i.unconstrained(Direction::ToPod), "equal to the line rate");
        assert_eq!(i.shaped(Direction::ToPod), None);
        assert!(!i.unconstrained(Direction::FromPod), "one bit/s below it");
        assert_eq!(i.shaped(Direction::FromPod), Some(24_999_999_999));
        assert!(
            !is_unconstrained(None, Some(1)),
            "no limit is not unconstrained"
        );
        assert!(
            !is_unconstrained(Some(u64::MAX), None),
            "no line rate: shaped"
        );
    }

    #[test]
    fn keys_whose_short_ids_collide_keep_separate_records() {
        // Two keys with the same 48-bit short id would have shared one file before.
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::open(d.path()).unwrap();
        let rec = |k: &str, idx: u32| Installed {
            share_key: k.into(),
            mechanism: Mechanism::HtbEbpf,
            host_index: idx,
            host_name: format!("v{idx}"),
            to_pod_bps: Some(1),
            from_pod_bps: None,
            queue: None,
            path_bps: None,
            slot: Some(idx),
            count_only: false,
            more_hosts: Vec::new(),
            to_queue: None,
        };
        // Not a real collision of the hash (that would take 2^24 tries), but the file
        // names no longer depend on it: a key and the same key escaped differently never
        // meet, and a dedicated key with '/' stays inside the directory.
        let a = rec("dedicated/claim-1/nic-0", 1);
        let b = rec("dedicated%2Fclaim-1%2Fnic-0", 2);
        s.put(&a).unwrap();
        s.put(&b).unwrap();
        assert_eq!(s.get(&a.share_key).unwrap(), Some(a.clone()));
        assert_eq!(s.get(&b.share_key).unwrap(), Some(b.clone()));
        assert_eq!(s.all().unwrap().len(), 2);
        assert!(!file_name(&a.share_key).contains('/'));
        assert_ne!(file_name(&a.share_key), file_name(&b.share_key));
    }

    #[test]
    fn a_legacy_record_is_found_and_moved_on_the_next_write() {
        let d = tempfile::tempdir().unwrap();
        let s = StateDir::open(d.path()).unwrap();
        let k = "3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c";
        let legacy = d.path().join(format!("{}.json", short_id(k)));
        std::fs::write(
            &legacy,
            format!(r#"{{"share_key":"{k}","host_index":7,"host_name":"v","to_pod_bps":8,"from_pod_bps":null,"ifb":null}}"#),
        )
        .unwrap();
        let i = s.get(k).unwrap().expect("found under its legacy name");
        assert_eq!(i.slot(), Some(7));
        s.put(&Installed { slot: Some(7), ..i }).unwrap();
        assert!(!legacy.exists(), "moved to the full-key name");
        assert_eq!(s.all().unwrap().len(), 1);
        s.remove(k).unwrap();
        assert_eq!(s.get(k).unwrap(), None);
    }
}
