//! What this node's plugin last wrote into each claim's status, kept on the node, so
//! that a start of the plugin (a rolling update, a crash) does not apply every live
//! claim's status again: a claim whose body has the digest recorded here is taken as
//! written. A rollout of 5,000 nodes with 40 claims each is otherwise 200,000 applies
//! that change nothing.
//!
//! A cache, never a source of truth: a file that is missing, unreadable or of another
//! version costs one apply per claim, as it did before there was one; an entry is
//! recorded only once the API server took the apply, and read only for a claim's first
//! write after a start (from then on the writer's memory decides, as before).
//!
//! One file per driver, beside its DRA socket (`<plugins-dir>/<driver>/`, the one
//! directory kubelet gives the plugin and the uninstall removes):
//!
//! ```text
//! claim-status.json  {"version": 1, "epoch": E,
//!                     "claims": {"<claim uid>": "<sha256 of the apply body, hex>"}}
//! claim-status.lock  held (flock) while the file is read for its epoch and replaced
//! ```
//!
//! `epoch` is the agent epoch of the instance that wrote it. An instance that a newer
//! one replaced (a rolling update) may not know it yet; it finds a higher epoch in the
//! file and leaves the file alone from then on, so that its last writes cannot undo
//! its successor's. The file is replaced by rename, never written in place, and not
//! fsynced: after a power loss a torn or empty file is only a cache miss.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs::{self, File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use super::build::Target;

const VERSION: u32 = 1;
pub const FILE: &str = "claim-status.json";
const LOCK: &str = "claim-status.lock";

/// The digest of an apply body: equal bodies, equal digests (serde_json keeps a
/// `Value`'s maps sorted, so equal values serialize to equal bytes).
pub fn digest(body: &Value) -> String {
    let text = body.to_string();
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[derive(Serialize, Deserialize)]
struct OnDisk {
    version: u32,
    epoch: u64,
    claims: BTreeMap<String, String>,
}

/// One driver's record and where it lives.
struct Driver {
    dir: PathBuf,
    /// Claim uid -> digest of the body last written.
    claims: HashMap<String, String>,
    dirty: bool,
    /// The last flush failed (logged once until one works again).
    failing: bool,
}

pub struct Written {
    drivers: BTreeMap<String, Driver>,
    /// This instance's agent epoch.
    epoch: u64,
    /// A newer instance wrote a file: this one writes none again.
    superseded: bool,
}

impl Written {
    /// Reads each driver's file in `dirs` (driver -> directory); what cannot be read
    /// is an empty record, with the reason in the log.
    pub fn load(dirs: BTreeMap<String, PathBuf>, epoch: u64) -> Self {
        let drivers = dirs
            .into_iter()
            .map(|(name, dir)| {
                let claims = match read(&dir.join(FILE)) {
                    Ok(Some(d)) if d.version == VERSION => d.claims.into_iter().collect(),
                    Ok(Some(d)) => {
                        info!(driver = %name, version = d.version, "claim status record of another version; every claim is written again");
                        HashMap::new()
                    }
                    Ok(None) => HashMap::new(),
                    Err(e) => {
                        warn!(driver = %name, error = %e, "claim status record unreadable; every claim is written again");
                        HashMap::new()
                    }
                };
                let d = Driver {
                    dir,
                    claims,
                    dirty: false,
                    failing: false,
                };
                (name, d)
            })
            .collect();
        Self {
            drivers,
            epoch,
            superseded: false,
        }
    }

    /// The digest recorded for the claim, if any.
    pub fn get(&self, t: &Target) -> Option<&str> {
        self.drivers
            .get(&t.driver)?
            .claims
            .get(&t.uid)
            .map(String::as_str)
    }

    /// Records that the API server took a body of this digest for the claim.
    pub fn set(&mut self, t: &Target, digest: &str) {
        if let Some(d) = self.drivers.get_mut(&t.driver)
            && d.claims.get(&t.uid).map(String::as_str) != Some(digest)
        {
            d.claims.insert(t.uid.clone(), digest.to_owned());
            d.dirty = true;
        }
    }

    /// Forgets the claim: nothing of ours is left in it, or it is gone.
    pub fn remove(&mut self, t: &Target) {
        if let Some(d) = self.drivers.get_mut(&t.driver)
            && d.claims.remove(&t.uid).is_some()
        {
            d.dirty = true;
        }
    }

    /// Keeps only the claims `keep` names, by driver and claim uid: after a start,
    /// claims whose shares were released while the plugin was away.
    pub fn retain(&mut self, keep: &BTreeSet<(String, String)>) {
        for (name, d) in &mut self.drivers {
            let before = d.claims.len();
            d.claims
                .retain(|uid, _| keep.contains(&(name.clone(), uid.clone())));
            d.dirty |= d.claims.len() != before;
        }
    }

    /// Writes each changed driver's file. A failure is logged (once until a flush
    /// works again) and tried at the next flush.
    pub fn flush(&mut self) {
        if self.superseded {
            return;
        }
        for (name, d) in &mut self.drivers {
            if !d.dirty {
                continue;
            }
            match replace(&d.dir, self.epoch, &d.claims) {
                Ok(true) => {
                    d.dirty = false;
                    if std::mem::take(&mut d.failing) {
                        info!(driver = %name, "claim status record written again");
                    }
                }
                Ok(false) => {
                    info!(driver = %name, epoch = self.epoch, "a newer plugin instance keeps the claim status record; this one leaves it");
                    self.superseded = true;
                    return;
                }
                Err(e) => {
                    if !std::mem::replace(&mut d.failing, true) {
                        warn!(driver = %name, dir = %d.dir.display(), error = %e, "writing the claim status record; a restart will write every claim again");
                    } else {
                        debug!(driver = %name, error = %e, "writing the claim status record");
                    }
                }
            }
        }
    }
}

fn read(path: &Path) -> io::Result<Option<OnDisk>> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces the file under the lock, unless it holds a higher epoch than `epoch`
/// (false then).
fn replace(dir: &Path, epoch: u64, claims: &HashMap<String, String>) -> io::Result<bool> {
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK))?;
    lock.lock()?;
    let path = dir.join(FILE);
    // A file that does not parse is replaced: it holds no epoch to respect.
    if let Ok(Some(d)) = read(&path)
        && d.epoch > epoch
    {
        return Ok(false);
    }
    let on_disk = OnDisk {
        version: VERSION,
        epoch,
        claims: claims.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
    };
    let tmp = dir.join(format!("{FILE}.tmp-{}", std::process::id()));
    let mut f = File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(&on_disk).map_err(io::Error::other)?)?;
    drop(f);
    fs::rename(&tmp, &path)?;
    // The lock goes with `lock`.
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(uid: &str) -> Target {
        Target {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("claim-{uid}"),
            driver: "d.example.com".into(),
        }
    }

    fn dirs(dir: &Path) -> BTreeMap<String, PathBuf> {
        BTreeMap::from([("d.example.com".to_owned(), dir.to_path_buf())])
    }

    #[test]
    fn a_flushed_record_is_what_the_next_start_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Written::load(dirs(dir.path()), 4);
        assert_eq!(w.get(&target("a")), None, "nothing recorded yet");
        w.set(&target("a"), "1111");
        w.set(&target("b"), "2222");
        w.remove(&target("b"));
        w.flush();
        let again = Written::load(dirs(dir.path()), 5);
        assert_eq!(again.get(&target("a")), Some("1111"));
        assert_eq!(
            again.get(&target("b")),
            None,
            "a removed claim stays removed"
        );
        // Another driver's claim of the same uid is another claim.
        let mut other = target("a");
        other.driver = "e.example.com".into();
        assert_eq!(again.get(&other), None);
    }

    #[test]
    fn retain_drops_the_claims_released_while_the_plugin_was_away() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Written::load(dirs(dir.path()), 1);
        w.set(&target("a"), "1");
        w.set(&target("b"), "2");
        w.retain(&BTreeSet::from([(
            "d.example.com".to_owned(),
            "b".to_owned(),
        )]));
        w.flush();
        let again = Written::load(dirs(dir.path()), 2);
        assert_eq!(
            (again.get(&target("a")), again.get(&target("b"))),
            (None, Some("2"))
        );
    }

    #[test]
    fn an_unreadable_or_foreign_record_is_a_cache_miss() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(FILE), b"{\"version\": 1, \"epo").unwrap();
        let mut w = Written::load(dirs(dir.path()), 3);
        assert_eq!(w.get(&target("a")), None);
        // And it is replaced by the next flush, not kept as it is.
        w.set(&target("a"), "1");
        w.flush();
        assert_eq!(
            Written::load(dirs(dir.path()), 4).get(&target("a")),
            Some("1")
        );
        fs::write(
            dir.path().join(FILE),
            br#"{"version": 2, "epoch": 1, "claims": {"a": "1"}}"#,
        )
        .unwrap();
        assert_eq!(Written::load(dirs(dir.path()), 4).get(&target("a")), None);
    }

    #[test]
    fn an_instance_a_newer_one_replaced_leaves_its_record_alone() {
        let dir = tempfile::tempdir().unwrap();
        let mut old = Written::load(dirs(dir.path()), 7);
        let mut new = Written::load(dirs(dir.path()), 8);
        new.set(&target("a"), "new");
        new.flush();
        // The old instance, not yet aware it was replaced, wrote a claim after that.
        old.set(&target("a"), "old");
        old.flush();
        assert_eq!(
            Written::load(dirs(dir.path()), 9).get(&target("a")),
            Some("new")
        );
        assert!(old.superseded);
        // Nor later.
        old.set(&target("b"), "old");
        old.flush();
        assert_eq!(Written::load(dirs(dir.path()), 9).get(&target("b")), None);
    }

    #[test]
    fn equal_bodies_have_equal_digests_and_any_change_another() {
        let a =
            serde_json::json!({"status": {"devices": [{"pool": "p", "data": {"x": 1, "a": 2}}]}});
        let b =
            serde_json::json!({"status": {"devices": [{"data": {"a": 2, "x": 1}, "pool": "p"}]}});
        assert_eq!(
            digest(&a),
            digest(&b),
            "maps are compared by content, not order"
        );
        let mut c = a.clone();
        c["status"]["devices"][0]["data"]["x"] = 3.into();
        assert_ne!(digest(&a), digest(&c));
        assert_eq!(digest(&a).len(), 64);
    }
}
