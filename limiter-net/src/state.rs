//! What the limiter installed for each share, one small JSON file per share under its
//! state directory, written atomically.
//!
//! The kernel objects (qdiscs, ifb devices, pinned links) outlive the agent, and so must
//! the knowledge of which interface each share was installed on: a release often comes
//! after the pod's network namespace, and with it the means to resolve the interface
//! again, is gone.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{error::NetError, mechanism::Mechanism};

/// One share's install record. Versioned by its fields: a field added later carries a
/// serde default that says what records written before it meant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Installed {
    pub share_key: String,
    /// How it is enforced; records from before the field existed were all HTB.
    #[serde(default = "htb")]
    pub mechanism: Mechanism,
    /// The pod's host-side interface when it was installed.
    pub host_index: u32,
    pub host_name: String,
    /// Traffic to the pod (egress of the host side), bit/s.
    pub to_pod_bps: Option<u64>,
    /// Traffic from the pod (redirected to `ifb`), bit/s.
    pub from_pod_bps: Option<u64>,
    pub ifb: Option<String>,
}

fn htb() -> Mechanism {
    Mechanism::HtbEbpf
}

/// 64-bit FNV-1a: a hash that never changes between builds, for names that must stay
/// the same across agent versions (files, ifb devices, pinned links).
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

pub fn ifb_name(share_key: &str) -> String {
    format!("sgb{}", short_id(share_key))
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

impl StateDir {
    pub fn open(dir: &Path) -> Result<StateDir, NetError> {
        fs::create_dir_all(dir).map_err(|e| serr(dir, e))?;
        Ok(StateDir {
            dir: dir.to_owned(),
        })
    }

    fn path(&self, share_key: &str) -> PathBuf {
        self.dir.join(format!("{}.json", short_id(share_key)))
    }

    pub fn get(&self, share_key: &str) -> Result<Option<Installed>, NetError> {
        let p = self.path(share_key);
        match fs::read(&p) {
            Ok(b) => {
                let i: Installed = serde_json::from_slice(&b).map_err(|e| serr(&p, e))?;
                // Twelve hex digits can collide; the file says whose it is.
                Ok((i.share_key == share_key).then_some(i))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(serr(&p, e)),
        }
    }

    pub fn all(&self) -> Result<Vec<Installed>, NetError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(|e| serr(&self.dir, e))? {
            let p = entry.map_err(|e| serr(&self.dir, e))?.path();
            if p.extension().is_some_and(|x| x == "json") {
                let b = fs::read(&p).map_err(|e| serr(&p, e))?;
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
        let mut f = fs::File::create(&tmp).map_err(|e| serr(&tmp, e))?;
        f.write_all(&body)
            .and_then(|()| f.sync_all())
            .map_err(|e| serr(&tmp, e))?;
        fs::rename(&tmp, &p).map_err(|e| serr(&p, e))?;
        fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| serr(&self.dir, e))
    }

    pub fn remove(&self, share_key: &str) -> Result<(), NetError> {
        let p = self.path(share_key);
        match fs::remove_file(&p) {
            Ok(()) => fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| serr(&self.dir, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(serr(&p, e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_stable_and_fit_interface_names() {
        // Pinned values: changing the hash would orphan every installed share.
        assert_eq!(stable_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(stable_hash("a"), 0xaf63_dc4c_8601_ec8c);
        let n = ifb_name("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c");
        assert_eq!(n.len(), 15);
        assert_eq!(n, ifb_name("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c"));
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
            ifb: None,
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
    }
}
