//! CDI (Container Device Interface) spec files, one per claim.
//!
//! Each share of a claim becomes one CDI device whose name includes the shareID; its
//! edits give the container its GPU and nothing of another: the driver's control nodes
//! and the GPU's own `/dev/nvidiaN`, the driver's libraries and tools read-only (both
//! found in the device's driver root, see [`crate::driver`]),
//! `CUDA_VISIBLE_DEVICES=<GPU uuid>`, and `NVIDIA_VISIBLE_DEVICES=void` so that NVIDIA's
//! own runtime, where installed, adds no GPU of its own to a container whose image asks
//! for `all`. Where the share runs through MPS they add `CUDA_MPS_PIPE_DIRECTORY`, a
//! bind mount of that directory and one of the share's /dev/shm tmpfs. The file is named as the CDI library
//! names transient specs (`<vendor>-<class>_<claim uid>.json`) and written atomically,
//! so a runtime scanning the directory never reads half a file (runtimes only load
//! `*.json` and `*.yaml`, so the dot-prefixed `.tmp` file is never picked up).
//!
//! [`validate_spec`] checks a spec against the rules of the CDI specification
//! (github.com/cncf-tags/container-device-interface, SPEC.md and pkg/parser), the way
//! the reference implementation checks it when it loads a file.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use serde_json::Value;
use shareguard_common::limiter::{CdiDeviceNode, CdiMount, MpsDirs};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiConfig {
    /// Directory the runtime scans for dynamic specs.
    pub dir: PathBuf,
    /// `vendor` of the kind `vendor/class` (a DNS-subdomain-like name).
    pub vendor: String,
    pub class: String,
}

impl Default for CdiConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("/var/run/cdi"),
            vendor: "shareguard.example".into(),
            class: "gpu".into(),
        }
    }
}

/// One share of a claim, as a CDI device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiShare {
    pub share_id: String,
    /// Device name from the agent's inventory; goes into the CDI device name for humans.
    pub device: String,
    pub gpu_uuid: String,
    /// The share's MPS control daemon, when the share is enforced through MPS.
    pub mps: Option<MpsDirs>,
    /// The GPU's and the driver's device nodes; empty for a simulated GPU without a
    /// driver root.
    pub device_nodes: Vec<CdiDeviceNode>,
    /// The driver's libraries and tools, bound read-only.
    pub mounts: Vec<CdiMount>,
}

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("invalid CDI input: {0}")]
    Invalid(String),
    #[error("CDI spec {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    cdi_version: &'static str,
    kind: String,
    devices: Vec<Device>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    container_edits: ContainerEdits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ContainerEdits {
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<DeviceNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    mounts: Vec<Mount>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DeviceNode {
    path: String,
    /// Left out where it is `path`: specs before 0.5.0 have no such field.
    #[serde(skip_serializing_if = "Option::is_none")]
    host_path: Option<String>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Mount {
    host_path: String,
    container_path: String,
    options: Vec<&'static str>,
}

/// The options of an MPS share's pipe directory mount, as the OCI runtime takes them:
/// a plain bind (the directory has no mounts below it), writable (MPS clients create
/// files there, as NVIDIA's components mount it), and nothing in it to run or to open
/// as a device. The directory is sticky: a tenant that is not root cannot replace the
/// daemon's sockets, and the agent checks who listens on them (see the mps module).
pub const PIPE_MOUNT_OPTIONS: [&str; 5] = ["bind", "rw", "nosuid", "nodev", "noexec"];
/// The options of an MPS share's /dev/shm mount: what a runtime gives its own /dev/shm.
pub const SHM_MOUNT_OPTIONS: [&str; 5] = ["bind", "rw", "nosuid", "nodev", "noexec"];
/// The options of the driver's libraries and tools: read-only, nothing setuid, no
/// device files; exec, which a shared library's code needs as much as a tool.
pub const DRIVER_MOUNT_OPTIONS: [&str; 4] = ["ro", "nosuid", "nodev", "bind"];

/// Known spec versions, oldest first (specs-go/version.go).
const KNOWN_VERSIONS: [&str; 10] = [
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
];

pub struct CdiWriter {
    cfg: CdiConfig,
}

impl CdiWriter {
    pub fn new(cfg: CdiConfig) -> Result<Self, CdiError> {
        validate_vendor_or_class(&cfg.vendor, 253)
            .and_then(|()| validate_vendor_or_class(&cfg.class, 63))
            .map_err(|e| CdiError::Invalid(format!("kind {}/{}: {e}", cfg.vendor, cfg.class)))?;
        Ok(Self { cfg })
    }

    pub fn kind(&self) -> String {
        format!("{}/{}", self.cfg.vendor, self.cfg.class)
    }

    /// Deterministic per claim, so a repeated Prepare rewrites the same file and a
    /// release after a restart finds it.
    pub fn spec_path(&self, claim_uid: &str) -> Result<PathBuf, CdiError> {
        let ok = !claim_uid.is_empty()
            && claim_uid.len() <= 128
            && claim_uid
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && claim_uid.as_bytes()[0].is_ascii_alphanumeric();
        if !ok {
            return Err(CdiError::Invalid(format!("claim uid {claim_uid:?}")));
        }
        Ok(self.cfg.dir.join(format!(
            "{}-{}_{claim_uid}.json",
            self.cfg.vendor, self.cfg.class
        )))
    }

    /// The fully qualified CDI device id of a share, as [`Self::build`] lists it.
    pub fn device_id(&self, share: &CdiShare) -> Result<String, CdiError> {
        Ok(format!("{}={}", self.kind(), Self::device_name(share)?))
    }

    /// The CDI device name of a share: inventory device name (made CDI-safe) and shareID.
    pub fn device_name(share: &CdiShare) -> Result<String, CdiError> {
        let dev: String = share
            .device
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let dev = dev.trim_matches(|c: char| !c.is_ascii_alphanumeric());
        let dev = if dev.is_empty() { "gpu" } else { dev };
        let name = format!("{dev}-{}", share.share_id);
        validate_device_name(&name)
            .map_err(|e| CdiError::Invalid(format!("share {}: {e}", share.share_id)))?;
        Ok(name)
    }

    /// The spec for a claim and the fully qualified CDI device ids, in share order.
    pub fn build(&self, shares: &[CdiShare]) -> Result<(Value, Vec<String>), CdiError> {
        if shares.is_empty() {
            return Err(CdiError::Invalid(
                "a claim spec needs at least one share".into(),
            ));
        }
        let mut devices = Vec::new();
        let mut ids = Vec::new();
        for s in shares {
            let name = Self::device_name(s)?;
            if s.gpu_uuid.is_empty() || s.gpu_uuid.contains(['\0', '\n', ',']) {
                return Err(CdiError::Invalid(format!("GPU uuid {:?}", s.gpu_uuid)));
            }
            let mut env = vec![
                format!("CUDA_VISIBLE_DEVICES={}", s.gpu_uuid),
                "NVIDIA_VISIBLE_DEVICES=void".to_owned(),
            ];
            let path_str = |p: &Path, what: &str| {
                p.to_str()
                    .filter(|d| d.starts_with('/') && !d.contains('\0'))
                    .map(str::to_owned)
                    .ok_or_else(|| CdiError::Invalid(format!("{what} {}", p.display())))
            };
            let mut device_nodes = Vec::new();
            for n in &s.device_nodes {
                let path = path_str(&n.path, "device node")?;
                let host = path_str(&n.host_path, "device node host path")?;
                device_nodes.push(DeviceNode {
                    host_path: (host != path).then_some(host),
                    path,
                });
            }
            let mut mounts = Vec::new();
            for m in &s.mounts {
                mounts.push(Mount {
                    host_path: path_str(&m.host_path, "driver file")?,
                    container_path: path_str(&m.container_path, "driver file container path")?,
                    options: DRIVER_MOUNT_OPTIONS.to_vec(),
                });
            }
            if let Some(m) = &s.mps {
                let pipe = path_str(&m.pipe, "MPS pipe dir")?;
                env.push(format!("CUDA_MPS_PIPE_DIRECTORY={pipe}"));
                // Read-write: MPS clients create files there, so the tenant can write
                // it; what the agent relies on there is checked in the mps module.
                mounts.push(Mount {
                    host_path: pipe.clone(),
                    container_path: pipe,
                    options: PIPE_MOUNT_OPTIONS.to_vec(),
                });
                // The server and its clients also meet in /dev/shm: the container's is
                // the share daemon's capped tmpfs, not the runtime's own.
                mounts.push(Mount {
                    host_path: path_str(&m.shm, "MPS shm dir")?,
                    container_path: "/dev/shm".into(),
                    options: SHM_MOUNT_OPTIONS.to_vec(),
                });
            }
            ids.push(format!("{}={name}", self.kind()));
            devices.push(Device {
                name,
                container_edits: ContainerEdits {
                    env,
                    device_nodes,
                    mounts,
                },
            });
        }
        // The oldest version that fits keeps older runtimes able to read the file:
        // dots in the class need 0.6.0; a device name starting with a digit, or a
        // device node's host path, 0.5.0.
        let version = if self.cfg.class.contains('.') {
            "0.6.0"
        } else if devices.iter().any(|d| {
            d.name.starts_with(|c: char| c.is_ascii_digit())
                || d.container_edits
                    .device_nodes
                    .iter()
                    .any(|n| n.host_path.is_some())
        }) {
            "0.5.0"
        } else {
            "0.3.0"
        };
        let spec = Spec {
            cdi_version: version,
            kind: self.kind(),
            devices,
        };
        let value = serde_json::to_value(&spec)
            .map_err(|e| CdiError::Invalid(format!("serialising spec: {e}")))?;
        Ok((value, ids))
    }

    /// Writes (or rewrites) the claim's spec and returns its CDI device ids.
    pub fn write_claim(
        &self,
        claim_uid: &str,
        shares: &[CdiShare],
    ) -> Result<Vec<String>, CdiError> {
        let path = self.spec_path(claim_uid)?;
        let (spec, ids) = self.build(shares)?;
        if let Err(problems) = validate_spec(&spec) {
            return Err(CdiError::Invalid(problems.join("; ")));
        }
        let mut bytes = serde_json::to_vec_pretty(&spec)
            .map_err(|e| CdiError::Invalid(format!("serialising spec: {e}")))?;
        bytes.push(b'\n');
        write_atomic(&path, &bytes).map_err(|source| CdiError::Io {
            path: path.clone(),
            source,
        })?;
        tracing::debug!(claim_uid, path = %path.display(), devices = ?ids, "CDI spec written");
        Ok(ids)
    }

    /// Removes the claim's spec; succeeds when it is already gone.
    pub fn remove_claim(&self, claim_uid: &str) -> Result<(), CdiError> {
        let path = self.spec_path(claim_uid)?;
        let io_err = |source| CdiError::Io {
            path: path.clone(),
            source,
        };
        match fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.cfg.dir).map_err(io_err),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(e)),
        }
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Temp file in the same directory, fsync, rename over the target, fsync the directory:
/// a crash leaves the old file or the new one, never a torn one.
fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no parent directory"))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?
        .to_string_lossy();
    let tmp = dir.join(format!(
        ".{file_name}.{}.{}.tmp",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if result.is_err() {
        // Best effort: the temp name is ignored by runtimes, so a leftover is harmless.
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn is_alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric()
}

/// pkg/parser: a letter first, a letter or digit last, `[A-Za-z0-9_.-]` between.
fn validate_vendor_or_class(name: &str, max_len: usize) -> Result<(), String> {
    let b = name.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return Err("empty name".into());
    };
    if b.len() > max_len {
        return Err(format!("{name:?} is longer than {max_len}"));
    }
    if !first.is_ascii_alphabetic() {
        return Err(format!("{name:?} should start with a letter"));
    }
    if !is_alnum(*last) {
        return Err(format!("{name:?} should end with a letter or digit"));
    }
    if let Some(c) = b
        .iter()
        .find(|c| !(is_alnum(**c) || matches!(c, b'_' | b'-' | b'.')))
    {
        return Err(format!("invalid character {:?} in {name:?}", *c as char));
    }
    Ok(())
}

/// pkg/parser: a letter or digit first and last, `[A-Za-z0-9_.:-]` between.
fn validate_device_name(name: &str) -> Result<(), String> {
    let b = name.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return Err("empty device name".into());
    };
    if !is_alnum(*first) || !is_alnum(*last) {
        return Err(format!(
            "device name {name:?} must start and end with a letter or digit"
        ));
    }
    if let Some(c) = b
        .iter()
        .find(|c| !(is_alnum(**c) || matches!(c, b'_' | b'-' | b'.' | b':')))
    {
        return Err(format!(
            "invalid character {:?} in device name {name:?}",
            *c as char
        ));
    }
    Ok(())
}

const SPEC_KEYS: [&str; 5] = [
    "cdiVersion",
    "kind",
    "annotations",
    "devices",
    "containerEdits",
];
const DEVICE_KEYS: [&str; 3] = ["name", "annotations", "containerEdits"];
const EDIT_KEYS: [&str; 7] = [
    "env",
    "deviceNodes",
    "mounts",
    "hooks",
    "intelRdt",
    "additionalGids",
    "netDevices",
];

/// Checks a spec document against the CDI specification's rules. Returns every
/// problem found, so a failing test says all that is wrong at once.
pub fn validate_spec(spec: &Value) -> Result<(), Vec<String>> {
    let mut p = Vec::new();
    let Some(obj) = spec.as_object() else {
        return Err(vec!["spec is not a JSON object".into()]);
    };
    unknown_keys(obj, &SPEC_KEYS, "spec", &mut p);

    let version = match obj.get("cdiVersion").and_then(Value::as_str) {
        Some(v) => {
            let v = v.strip_prefix('v').unwrap_or(v);
            match KNOWN_VERSIONS.iter().position(|k| *k == v) {
                Some(i) => Some(i),
                None => {
                    p.push(format!("unknown cdiVersion {v:?}"));
                    None
                }
            }
        }
        None => {
            p.push("cdiVersion missing or not a string".into());
            None
        }
    };
    // Feature -> minimum version index (0.5.0 is 4, 0.6.0 is 5, 0.7.0 is 6, 1.1.0 is 9).
    let mut required = 2; // 0.3.0, the earliest the reference implementation accepts

    match obj.get("kind").and_then(Value::as_str) {
        Some(kind) => match kind.split_once('/') {
            Some((vendor, class)) => {
                if let Err(e) = validate_vendor_or_class(vendor, 253) {
                    p.push(format!("kind vendor: {e}"));
                }
                if let Err(e) = validate_vendor_or_class(class, 63) {
                    p.push(format!("kind class: {e}"));
                }
                if class.contains('.') {
                    required = required.max(5);
                }
            }
            None => p.push(format!("kind {kind:?} is not vendor/class")),
        },
        None => p.push("kind missing or not a string".into()),
    }
    if obj.contains_key("annotations") {
        required = required.max(5);
    }
    if let Some(edits) = obj.get("containerEdits") {
        required = required.max(check_edits(edits, "spec containerEdits", &mut p, false));
    }

    match obj.get("devices").and_then(Value::as_array) {
        Some(devs) if !devs.is_empty() => {
            let mut names = HashSet::new();
            for (i, d) in devs.iter().enumerate() {
                let Some(dobj) = d.as_object() else {
                    p.push(format!("devices[{i}] is not an object"));
                    continue;
                };
                unknown_keys(dobj, &DEVICE_KEYS, &format!("devices[{i}]"), &mut p);
                match dobj.get("name").and_then(Value::as_str) {
                    Some(n) => {
                        if let Err(e) = validate_device_name(n) {
                            p.push(format!("devices[{i}]: {e}"));
                        }
                        if n.starts_with(|c: char| c.is_ascii_digit()) {
                            required = required.max(4);
                        }
                        if !names.insert(n.to_string()) {
                            p.push(format!("devices[{i}]: duplicate name {n:?}"));
                        }
                    }
                    None => p.push(format!("devices[{i}]: name missing")),
                }
                if dobj.contains_key("annotations") {
                    required = required.max(5);
                }
                match dobj.get("containerEdits") {
                    Some(e) => {
                        let where_ = format!("devices[{i}].containerEdits");
                        required = required.max(check_edits(e, &where_, &mut p, true));
                    }
                    None => p.push(format!("devices[{i}]: containerEdits missing")),
                }
            }
        }
        Some(_) => p.push("devices is empty; a spec needs at least one".into()),
        None => p.push("devices missing or not an array".into()),
    }

    if let Some(v) = version
        && v < required
    {
        p.push(format!(
            "cdiVersion {} is older than {} which the spec's fields need",
            KNOWN_VERSIONS[v], KNOWN_VERSIONS[required]
        ));
    }
    if p.is_empty() { Ok(()) } else { Err(p) }
}

fn unknown_keys(
    obj: &serde_json::Map<String, Value>,
    allowed: &[&str],
    where_: &str,
    p: &mut Vec<String>,
) {
    for k in obj.keys() {
        if !allowed.contains(&k.as_str()) {
            p.push(format!("{where_}: unknown field {k:?}"));
        }
    }
}

/// Checks one containerEdits object; returns the minimum version index its fields need.
fn check_edits(edits: &Value, where_: &str, p: &mut Vec<String>, must_be_nonempty: bool) -> usize {
    let Some(obj) = edits.as_object() else {
        p.push(format!("{where_} is not an object"));
        return 0;
    };
    unknown_keys(obj, &EDIT_KEYS, where_, p);
    let mut required = 0;
    let mut nonempty = false;
    if let Some(env) = obj.get("env") {
        match env.as_array() {
            Some(env) => {
                nonempty |= !env.is_empty();
                for e in env {
                    match e.as_str() {
                        // ValidateEnv: a '=' that is not the first character.
                        Some(s) if s.find('=').is_some_and(|i| i > 0) => {}
                        _ => p.push(format!("{where_}: invalid env entry {e}")),
                    }
                }
            }
            None => p.push(format!("{where_}: env is not an array")),
        }
    }
    if let Some(mounts) = obj.get("mounts") {
        match mounts.as_array() {
            Some(ms) => {
                nonempty |= !ms.is_empty();
                for m in ms {
                    let ok = ["hostPath", "containerPath"].iter().all(|k| {
                        m.get(k)
                            .and_then(Value::as_str)
                            .is_some_and(|s| !s.is_empty())
                    });
                    if !ok {
                        p.push(format!(
                            "{where_}: mount needs hostPath and containerPath: {m}"
                        ));
                    }
                }
            }
            None => p.push(format!("{where_}: mounts is not an array")),
        }
    }
    if let Some(nodes) = obj.get("deviceNodes").and_then(Value::as_array) {
        for n in nodes {
            // DeviceNode.Validate: a type of b, c, u or p; permissions of r, w and m.
            if let Some(t) = n.get("type")
                && !t
                    .as_str()
                    .is_some_and(|t| ["b", "c", "u", "p"].contains(&t))
            {
                p.push(format!(
                    "{where_}: device node type {t} is not b, c, u or p"
                ));
            }
            if let Some(perm) = n.get("permissions")
                && !perm
                    .as_str()
                    .is_some_and(|s| s.chars().all(|c| matches!(c, 'r' | 'w' | 'm')))
            {
                p.push(format!(
                    "{where_}: device node permissions {perm} are not of r, w, m"
                ));
            }
            if n.get("hostPath").is_some() {
                required = required.max(4);
            }
        }
    }
    for (k, need_key) in [("deviceNodes", "path"), ("hooks", "path")] {
        if let Some(v) = obj.get(k) {
            match v.as_array() {
                Some(items) => {
                    nonempty |= !items.is_empty();
                    for it in items {
                        if it.get(need_key).and_then(Value::as_str).is_none() {
                            p.push(format!("{where_}: {k} entry without {need_key}: {it}"));
                        }
                    }
                }
                None => p.push(format!("{where_}: {k} is not an array")),
            }
        }
    }
    if obj.contains_key("intelRdt") || obj.contains_key("additionalGids") {
        nonempty = true;
        required = required.max(6);
    }
    if obj.contains_key("netDevices") {
        nonempty = true;
        required = required.max(9);
    }
    if must_be_nonempty && !nonempty {
        p.push(format!("{where_}: a device needs at least one edit"));
    }
    required
}

#[cfg(test)]
#[path = "cdi_tests.rs"]
mod tests;
