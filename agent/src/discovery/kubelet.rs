//! Which pods kubelet itself runs with each claim, read from kubelet's DRA checkpoint
//! (`<kubelet dir>/dra_manager_state`), without API credentials.
//!
//! Kubelet calls `NodePrepareResources` once per claim and node: a second pod of a
//! claim that is already prepared here only adds its uid to kubelet's record of the
//! claim, and the agent hears nothing of it. Kubelet writes that record (claim uid, name,
//! namespace and the uids of the pods it admitted with the claim) to its checkpoint
//! before it calls any plugin, replacing the file by a rename. So the checkpoint is what
//! the node itself knows of a claim's pods: every pod it names runs the claim in the
//! claim's namespace (kubelet checked `status.reservedFor`), which no caller of the
//! agent's API can make it say.
//!
//! The format is kubelet's (`checkpoint.dra.kubelet.k8s.io/v1`): a JSON object with the
//! data as a JSON string and its CRC-32. A file that is absent, of another version or
//! damaged makes the checkpoint *unavailable*: the agent then uses the pods its caller
//! named, as it did before it read the checkpoint, and says so in its log.

use std::{
    collections::BTreeMap,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Mutex,
};

use serde::Deserialize;
use tracing::{info, warn};

use crate::sync::lock;

/// The checkpoint's file name in kubelet's root directory.
pub const CHECKPOINT: &str = "dra_manager_state";
/// The only checkpoint version read.
const API_VERSION: &str = "checkpoint.dra.kubelet.k8s.io/v1";
/// A checkpoint larger than this is not read (kubelet's holds a few hundred bytes per
/// claim: 16 MiB is tens of thousands of claims).
const MAX_BYTES: u64 = 16 << 20;

/// What kubelet's checkpoint says of one claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimPods {
    /// No checkpoint to read: the caller's pods are used. The reason, in words.
    Unavailable(String),
    /// Kubelet lists the claim under this namespace and name, with these pods (sorted).
    Listed {
        namespace: String,
        name: String,
        pods: Vec<String>,
    },
    /// The checkpoint is there and does not list the claim: kubelet has not admitted a
    /// pod with it on this node (or has released it).
    NotListed,
}

/// One claim as the checkpoint lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    namespace: String,
    name: String,
    pods: Vec<String>,
}

/// The checkpoint as last read, keyed by claim uid.
#[derive(Debug)]
enum Parsed {
    Unavailable(String),
    Claims(BTreeMap<String, Entry>),
}

/// What tells one version of the file from the next: inode, modification time (seconds,
/// nanoseconds), size.
type Stamp = (u64, i64, i64, u64);

/// Reads kubelet's DRA checkpoint, again only when the file changed.
#[derive(Debug)]
pub struct KubeletClaims {
    path: Option<PathBuf>,
    cache: Mutex<Option<(Stamp, std::sync::Arc<Parsed>)>>,
}

impl KubeletClaims {
    /// The checkpoint under kubelet's root directory `dir`; None: none is read.
    pub fn new(dir: Option<&Path>) -> KubeletClaims {
        KubeletClaims {
            path: dir.map(|d| d.join(CHECKPOINT)),
            cache: Mutex::new(None),
        }
    }

    /// The checkpoint's path, if one is read.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The checkpoint as it is now, for several questions answered from one reading
    /// (and, in Prepare, read before the ledger's lock is taken).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.current())
    }

    /// What the checkpoint says of claim `uid` now.
    pub fn claim(&self, uid: &str) -> ClaimPods {
        self.snapshot().claim(uid)
    }

    /// The namespaces of the claims kubelet lists pod `uid` with now.
    pub fn namespaces_of_pod(&self, uid: &str) -> Vec<String> {
        self.snapshot().namespaces_of_pod(uid)
    }
}

/// kubelet's checkpoint as read at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot(std::sync::Arc<Parsed>);

impl Snapshot {
    /// What the checkpoint says of claim `uid`.
    pub fn claim(&self, uid: &str) -> ClaimPods {
        match &*self.0 {
            Parsed::Unavailable(why) => ClaimPods::Unavailable(why.clone()),
            Parsed::Claims(m) => match m.get(uid) {
                Some(e) => ClaimPods::Listed {
                    namespace: e.namespace.clone(),
                    name: e.name.clone(),
                    pods: e.pods.clone(),
                },
                None => ClaimPods::NotListed,
            },
        }
    }

    /// The namespaces of the claims kubelet lists pod `uid` with (empty when the
    /// checkpoint is unavailable or does not name the pod).
    pub fn namespaces_of_pod(&self, uid: &str) -> Vec<String> {
        match &*self.0 {
            Parsed::Unavailable(_) => Vec::new(),
            Parsed::Claims(m) => m
                .values()
                .filter(|e| e.pods.iter().any(|p| p == uid))
                .map(|e| e.namespace.clone())
                .collect(),
        }
    }
}

impl KubeletClaims {
    /// The checkpoint as it is now: the cached parse while the file's identity, time and
    /// size are unchanged (kubelet replaces it by a rename, so any write changes them).
    fn current(&self) -> std::sync::Arc<Parsed> {
        let Some(path) = &self.path else {
            return std::sync::Arc::new(Parsed::Unavailable(
                "no kubelet directory is configured".into(),
            ));
        };
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) => {
                return std::sync::Arc::new(Parsed::Unavailable(format!(
                    "{}: {e}",
                    path.display()
                )));
            }
        };
        let stamp = (meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.len());
        let mut cache = lock(&self.cache);
        if let Some((s, p)) = &*cache
            && *s == stamp
        {
            return p.clone();
        }
        let parsed = std::sync::Arc::new(read(path, meta.len()));
        match (&*parsed, cache.as_ref().map(|(_, p)| &**p)) {
            (Parsed::Unavailable(why), _) => {
                warn!(path = %path.display(), reason = %why, "kubelet's DRA checkpoint is unreadable; the pods the kubelet plugin names are used")
            }
            (Parsed::Claims(m), None | Some(Parsed::Unavailable(_))) => {
                info!(path = %path.display(), claims = m.len(), "reading the pods of each claim from kubelet's DRA checkpoint")
            }
            _ => {}
        }
        *cache = Some((stamp, parsed.clone()));
        parsed
    }
}

/// Kubelet's checkpoint file: its data, as JSON in a string, and the data's CRC-32.
#[derive(Deserialize)]
struct File {
    #[serde(rename = "Data")]
    data: String,
    #[serde(rename = "Checksum")]
    checksum: u32,
}

#[derive(Deserialize)]
struct Data {
    #[serde(rename = "apiVersion", default)]
    api_version: String,
    #[serde(rename = "ClaimInfoStateList", default)]
    claims: Option<Vec<ClaimState>>,
}

#[derive(Deserialize)]
struct ClaimState {
    #[serde(rename = "ClaimUID")]
    claim_uid: String,
    #[serde(rename = "ClaimName")]
    claim_name: String,
    #[serde(rename = "Namespace")]
    namespace: String,
    /// A set, which Go writes as an object with the uids as keys; a list is read too.
    #[serde(rename = "PodUIDs", default)]
    pod_uids: Option<serde_json::Value>,
}

fn read(path: &Path, len: u64) -> Parsed {
    if len > MAX_BYTES {
        return Parsed::Unavailable(format!("{len} bytes, more than the {MAX_BYTES} read"));
    }
    match std::fs::read(path) {
        Ok(bytes) => parse(&bytes),
        Err(e) => Parsed::Unavailable(e.to_string()),
    }
}

fn parse(bytes: &[u8]) -> Parsed {
    let file: File = match serde_json::from_slice(bytes) {
        Ok(f) => f,
        Err(e) => return Parsed::Unavailable(format!("not a kubelet checkpoint: {e}")),
    };
    let sum = crc32fast::hash(file.data.as_bytes());
    if sum != file.checksum {
        return Parsed::Unavailable(format!(
            "its checksum is {:#x}, its data's {sum:#x}: damaged",
            file.checksum
        ));
    }
    let data: Data = match serde_json::from_str(&file.data) {
        Ok(d) => d,
        Err(e) => return Parsed::Unavailable(format!("its data is not understood: {e}")),
    };
    if data.api_version != API_VERSION {
        return Parsed::Unavailable(format!("version {:?}, not {API_VERSION}", data.api_version));
    }
    let mut claims = BTreeMap::new();
    for c in data.claims.unwrap_or_default() {
        let mut pods: Vec<String> = match c.pod_uids {
            Some(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect(),
            _ => Vec::new(),
        };
        pods.sort();
        pods.dedup();
        claims.insert(
            c.claim_uid,
            Entry {
                namespace: c.namespace,
                name: c.claim_name,
                pods,
            },
        );
    }
    Parsed::Claims(claims)
}

/// A checkpoint as kubelet writes one, for tests: `(claim uid, name, namespace, pods)`.
pub fn render(claims: &[(&str, &str, &str, &[&str])]) -> String {
    let list: Vec<serde_json::Value> = claims
        .iter()
        .map(|(uid, name, ns, pods)| {
            let set: serde_json::Map<String, serde_json::Value> = pods
                .iter()
                .map(|p| ((*p).to_owned(), serde_json::json!({})))
                .collect();
            serde_json::json!({
                "ClaimUID": uid,
                "ClaimName": name,
                "Namespace": ns,
                "PodUIDs": set,
                "DriverState": {},
            })
        })
        .collect();
    let data = serde_json::json!({
        "kind": "DRACheckpoint",
        "apiVersion": API_VERSION,
        "ClaimInfoStateList": list,
    })
    .to_string();
    serde_json::json!({ "Data": data, "Checksum": crc32fast::hash(data.as_bytes()) }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, text: &str) {
        // As kubelet does: a new file renamed over the old one.
        let tmp = dir.join("checkpoint.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(CHECKPOINT)).unwrap();
    }

    #[test]
    fn kubelets_pods_of_each_claim_are_read_and_follow_the_file() {
        let d = tempfile::tempdir().unwrap();
        let k = KubeletClaims::new(Some(d.path()));
        assert!(matches!(k.claim("c1"), ClaimPods::Unavailable(_)));
        write(
            d.path(),
            &render(&[("c1", "shared", "team-a", &["p2", "p1"])]),
        );
        assert_eq!(
            k.claim("c1"),
            ClaimPods::Listed {
                namespace: "team-a".into(),
                name: "shared".into(),
                pods: vec!["p1".into(), "p2".into()],
            }
        );
        assert_eq!(k.claim("c2"), ClaimPods::NotListed);
        assert_eq!(k.namespaces_of_pod("p2"), vec!["team-a".to_owned()]);
        assert!(k.namespaces_of_pod("p9").is_empty());
        // A third pod joins the claim: read again.
        write(
            d.path(),
            &render(&[("c1", "shared", "team-a", &["p1", "p2", "p3"])]),
        );
        assert!(matches!(k.claim("c1"), ClaimPods::Listed { pods, .. } if pods.len() == 3));
    }

    #[test]
    fn a_damaged_or_foreign_checkpoint_is_unavailable_not_empty() {
        let good = render(&[("c1", "n", "ns", &["p1"])]);
        assert!(matches!(parse(good.as_bytes()), Parsed::Claims(_)));
        // The data changed without its checksum.
        let tampered = good.replace("p1", "p9");
        assert!(
            matches!(parse(tampered.as_bytes()), Parsed::Unavailable(w) if w.contains("checksum"))
        );
        let v2 = good.replace("dra.kubelet.k8s.io/v1", "dra.kubelet.k8s.io/v2");
        // The checksum is over the data: recompute it, the version still differs.
        let f: File = serde_json::from_str(&v2).unwrap();
        let v2 =
            serde_json::json!({"Data": f.data, "Checksum": crc32fast::hash(f.data.as_bytes())})
                .to_string();
        assert!(matches!(parse(v2.as_bytes()), Parsed::Unavailable(w) if w.contains("version")));
        assert!(matches!(parse(b"{}"), Parsed::Unavailable(_)));
        // Kubelet's own empty checkpoint: no claims, but available.
        let empty = serde_json::json!({"kind":"DRACheckpoint","apiVersion":API_VERSION,"ClaimInfoStateList":null}).to_string();
        let file =
            serde_json::json!({"Data": empty, "Checksum": crc32fast::hash(empty.as_bytes())})
                .to_string();
        assert!(matches!(parse(file.as_bytes()), Parsed::Claims(m) if m.is_empty()));
    }

    #[test]
    fn a_list_of_pod_uids_is_read_like_a_set() {
        let data = serde_json::json!({
            "apiVersion": API_VERSION,
            "ClaimInfoStateList": [{"ClaimUID":"c","ClaimName":"n","Namespace":"ns","PodUIDs":["b","a","a"]}],
        })
        .to_string();
        let file = serde_json::json!({"Data": data, "Checksum": crc32fast::hash(data.as_bytes())})
            .to_string();
        match parse(file.as_bytes()) {
            Parsed::Claims(m) => assert_eq!(m["c"].pods, vec!["a", "b"]),
            Parsed::Unavailable(w) => panic!("{w}"),
        }
    }
}
