//! The audit log (I7): one JSON line per decision, for every share and every refusal.
//!
//! Lines are appended with one `write` each on an O_APPEND file, so a crash of the agent
//! never leaves a half line and never loses a line already written: the kernel has it.
//! (A power loss can lose the last lines; the share store itself is fsynced.)
//!
//! The log is bounded: when the next line would take the current file past
//! [`Bound::max_bytes`], the file is rotated (`audit.jsonl` -> `audit.jsonl.1` -> `.2` ...,
//! the oldest beyond [`Bound::keep`] dropped) before the line is written, under the same
//! lock as the writes. A line is never split across files; a single line longer than the
//! bound is written whole into a file of its own, which is then the only file that may
//! exceed the bound. [`query`] reads the files back for `shareguard audit`.
//!
//! Each line ends with `"prev"`: the SHA-256 of the line before it (its bytes without the
//! newline; 64 zeros for the first line ever written), across rotations and restarts.
//! `shareguard audit --verify` ([`chain`]) recomputes the chain, so a line removed from or
//! edited in the middle of the log is found. The newest line is covered once the next one
//! is written. Files are created 0600: the log names tenants and claims.

pub mod bound;
pub mod chain;
pub mod query;

use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    io::Write,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Mutex,
    time::SystemTime,
};

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// A share was admitted to the ledger.
    Admit,
    /// A repeated Prepare returned the stored result.
    Repeat,
    /// A claim or share was refused; nothing of it holds capacity.
    Refuse,
    /// Enforcement failed after admission; the claim was rolled back.
    Fail,
    Release,
    /// A restart changed what the agent believes about a share.
    Recover,
    /// A control-plane instance took a new epoch (`NewEpoch`), fencing every older one.
    Epoch,
    /// The reconciler found a share's enforcement no longer what was applied.
    Drift,
    /// The reconciler applied a drifted share's limit again: verified, or not (the
    /// reason says which).
    Repair,
    /// The reconciler found a share no longer held whole for a reason applying its limit
    /// again cannot change, and that is not drift: the limit is in place as set (MPS
    /// bounds each client process on its own, and the share now has more than one).
    Degrade,
    /// A released or failed share's record was removed after its retention.
    Sweep,
    /// A stored record could not be read at start: kept as found, and what it held
    /// stays reserved where that can be read.
    Quarantine,
    /// The agent started with another config than the last start did.
    Config,
    /// The GPU watchdog saw a share's processes use more memory than its limit.
    OverLimit,
    /// The GPU watchdog ended (or tried to end) a process of a share over its limit.
    Terminate,
    /// A share followed its pod's sandbox: enforced on a sandbox that appeared or was
    /// replaced, or waiting again after it went away.
    Sandbox,
    /// A device's rollout stage changed (`SetStage`), and each of its shares with it.
    Rollout,
}

/// One decision. Every string may come from a caller: each is capped and made printable
/// as it is written ([`bound`]), so a line stays small whatever the request held.
#[derive(Debug, Serialize)]
pub struct AuditLine<'a> {
    pub time: String,
    pub decision: Decision,
    #[serde(serialize_with = "bound::reason")]
    pub reason: &'a str,
    #[serde(serialize_with = "bound::field")]
    pub tenant: &'a str,
    #[serde(serialize_with = "bound::field")]
    pub claim_uid: &'a str,
    #[serde(serialize_with = "bound::field")]
    pub claim_name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty", serialize_with = "bound::field")]
    pub share_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty", serialize_with = "bound::field")]
    pub device: &'a str,
    #[serde(
        skip_serializing_if = "BTreeMap::is_empty",
        serialize_with = "bound::amounts"
    )]
    pub amounts: BTreeMap<String, String>,
    /// The policy version the caller says the scheduler used: the caller's word, which
    /// the agent compares with its own config but cannot prove.
    #[serde(
        rename = "caller_policy_version",
        skip_serializing_if = "str::is_empty",
        serialize_with = "bound::field"
    )]
    pub policy_version: &'a str,
    #[serde(serialize_with = "bound::field")]
    pub allocation_id: &'a str,
    pub epoch: u64,
    /// None for decisions the agent took by itself (restart recovery).
    pub caller_uid: Option<u32>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "bound::opt_field"
    )]
    pub code: Option<&'a str>,
}

impl Decision {
    /// Every decision, in the order `shareguard audit --decision` lists them.
    pub const ALL: [Decision; 17] = [
        Decision::Admit,
        Decision::Repeat,
        Decision::Refuse,
        Decision::Fail,
        Decision::Release,
        Decision::Recover,
        Decision::Epoch,
        Decision::Drift,
        Decision::Repair,
        Decision::Degrade,
        Decision::Sweep,
        Decision::Quarantine,
        Decision::Config,
        Decision::OverLimit,
        Decision::Terminate,
        Decision::Sandbox,
        Decision::Rollout,
    ];

    /// The name written in the `decision` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Admit => "admit",
            Decision::Repeat => "repeat",
            Decision::Refuse => "refuse",
            Decision::Fail => "fail",
            Decision::Release => "release",
            Decision::Recover => "recover",
            Decision::Epoch => "epoch",
            Decision::Drift => "drift",
            Decision::Repair => "repair",
            Decision::Degrade => "degrade",
            Decision::Sweep => "sweep",
            Decision::Quarantine => "quarantine",
            Decision::Config => "config",
            Decision::OverLimit => "over_limit",
            Decision::Terminate => "terminate",
            Decision::Sandbox => "sandbox",
            Decision::Rollout => "rollout",
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is not a decision (one of: admit, repeat, refuse, fail, release, recover, epoch, drift, repair, degrade, sweep, quarantine, config, over_limit, terminate, sandbox, rollout)"
)]
pub struct UnknownDecision(pub String);

impl std::str::FromStr for Decision {
    type Err = UnknownDecision;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Decision::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| UnknownDecision(s.to_owned()))
    }
}

/// How large the audit log may grow: the current file up to `max_bytes`, plus `keep`
/// rotated files of (at most) that size each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bound {
    pub max_bytes: u64,
    /// Rotated files kept (`.1` .. `.keep`); at least 1, so a rotation never deletes the
    /// lines it has just moved aside.
    pub keep: u32,
}

/// 64 MiB: some 200,000 lines of about 300 bytes, days of decisions on a busy node, while
/// a query still reads the whole log in well under a second.
pub const DEFAULT_MAX_BYTES: u64 = 64 << 20;
/// Four rotated files: with the current one, at most 320 MiB on the state disk.
pub const DEFAULT_KEEP: u32 = 4;

impl Default for Bound {
    fn default() -> Self {
        Bound {
            max_bytes: DEFAULT_MAX_BYTES,
            keep: DEFAULT_KEEP,
        }
    }
}

/// The file written to now, and how many bytes it holds.
struct Current {
    file: File,
    size: u64,
    /// Rotate before a line would take `size` past this. Normally the bound; after a failed
    /// rotation one bound further, so a broken directory costs one attempt (and one error
    /// line) per bound's worth of lines rather than one per line.
    rotate_at: u64,
    /// The hash of the last line written, which the next line carries.
    prev: chain::Hash,
}

pub struct AuditLog {
    path: PathBuf,
    bound: Bound,
    current: Mutex<Current>,
}

/// `audit.jsonl.N`: the Nth most recent rotated file.
pub fn rotated_path(path: &Path, n: u32) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

impl AuditLog {
    /// Opens (or creates) the log for appending. An existing file is continued, and its
    /// size counts towards the bound, so restarts do not reset it.
    pub fn open(path: &Path, bound: Bound) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = open_append(path)?;
        // A file from before files were made private, or one someone opened up.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        let mut size = file.metadata()?.len();
        if size > 0 && !ends_with_newline(path, size)? {
            // A power loss can leave a partial last line; without this the next line would
            // be glued onto it and be lost to any reader as well.
            file.write_all(b"\n")?;
            size += 1;
        }
        // The chain goes on from the last line written, in this file or, right after a
        // rotation, in the one before it.
        let prev = match chain::last_line_hash(path)? {
            Some(h) => h,
            None => chain::last_line_hash(&rotated_path(path, 1))?.unwrap_or(chain::GENESIS),
        };
        // The config refuses zeros; clamping keeps a zero from a caller from rotating
        // before every line or deleting every rotated file.
        let bound = Bound {
            max_bytes: bound.max_bytes.max(1),
            keep: bound.keep.max(1),
        };
        Ok(Self {
            path: path.to_owned(),
            bound,
            current: Mutex::new(Current {
                file,
                size,
                rotate_at: bound.max_bytes,
                prev,
            }),
        })
    }

    /// Writes one line. A failed write is logged, not returned: refusing service because
    /// the audit disk is full would turn a logging problem into an outage, and the share
    /// store still has the decision.
    pub fn write(&self, line: &AuditLine<'_>) {
        let buf = match serde_json::to_vec(line) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "audit line does not serialize");
                return;
            }
        };
        self.append(buf);
    }

    /// Chains the serialized object `obj` to the line before it and appends it whole
    /// (with its newline), rotating first if it would not fit. Chaining and rotation
    /// happen under the write lock, so lines are chained in the order they are written,
    /// no other writer can put a line into the file being moved aside, and every line
    /// lies whole in exactly one file.
    fn append(&self, obj: Vec<u8>) {
        let mut cur = crate::sync::lock(&self.current);
        let Some(mut buf) = chain::chained(obj, &cur.prev) else {
            tracing::error!("audit line is not a JSON object");
            return;
        };
        let hash = chain::hash(&buf);
        buf.push(b'\n');
        let buf = &buf[..];
        let len = buf.len() as u64;
        // An empty file takes any line, even one longer than the bound: splitting or
        // dropping it would lose part of a decision.
        if cur.size > 0 && cur.size.saturating_add(len) > cur.rotate_at {
            match self.rotate() {
                Ok(file) => {
                    *cur = Current {
                        file,
                        size: 0,
                        rotate_at: self.bound.max_bytes,
                        prev: cur.prev,
                    };
                }
                Err(e) => {
                    tracing::error!(
                        error = %e,
                        path = %self.path.display(),
                        "audit log rotation failed; still appending to the current file"
                    );
                    cur.rotate_at = cur.size.saturating_add(self.bound.max_bytes);
                }
            }
        }
        match cur.file.write_all(buf) {
            Ok(()) => {
                cur.size += len;
                cur.prev = hash;
            }
            Err(e) => {
                tracing::error!(error = %e, "audit log write failed");
                // A short write may have left part of the line; count what is really there.
                if let Ok(m) = cur.file.metadata() {
                    cur.size = m.len();
                }
            }
        }
    }

    /// Moves the current file to `.1` (shifting older ones up, dropping the one past
    /// `keep`) and returns the new, empty current file. The new file is created under a
    /// temporary name first and renamed into place, so a failure before the renames leaves
    /// everything as it was, and the returned handle needs no second open that could fail
    /// after them. The caller keeps writing to the old handle until this returns.
    ///
    /// Not fsynced, like the lines themselves: an agent crash loses nothing (renames are
    /// atomic), a power loss may lose the last lines, as before.
    fn rotate(&self) -> std::io::Result<File> {
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let file = open_append(&tmp)?;
        // A leftover from a rotation that failed half way may hold old bytes.
        file.set_len(0)?;
        let shift = || -> std::io::Result<()> {
            for n in (1..self.bound.keep).rev() {
                let from = rotated_path(&self.path, n);
                match std::fs::rename(&from, rotated_path(&self.path, n + 1)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            std::fs::rename(&self.path, rotated_path(&self.path, 1))?;
            std::fs::rename(&tmp, &self.path)
        };
        if let Err(e) = shift() {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // Files past `keep` left by an earlier config with a larger one: the bound holds
        // for them too. Best effort; they are numbered contiguously by earlier rotations.
        let mut n = self.bound.keep + 1;
        while std::fs::remove_file(rotated_path(&self.path, n)).is_ok() {
            n += 1;
        }
        Ok(file)
    }
}

fn open_append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

fn ends_with_newline(path: &Path, size: u64) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path)?;
    f.seek(SeekFrom::Start(size - 1))?;
    let mut last = [0u8; 1];
    f.read_exact(&mut last)?;
    Ok(last[0] == b'\n')
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// A time in milliseconds since the epoch, as RFC 3339.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

#[cfg(test)]
mod tests;
