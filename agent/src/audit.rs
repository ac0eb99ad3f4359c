//! The audit log (I7): one JSON line per decision, for every share and every refusal.
//!
//! Lines are appended with one `write` each on an O_APPEND file, so a crash of the agent
//! never leaves a half line and never loses a line already written: the kernel has it.
//! (A power loss can lose the last lines; the share store itself is fsynced.)

use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    io::Write,
    path::Path,
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
    /// The GPU watchdog saw a share's processes use more memory than its limit.
    OverLimit,
    /// The GPU watchdog ended (or tried to end) a process of a share over its limit.
    Terminate,
}

#[derive(Debug, Serialize)]
pub struct AuditLine<'a> {
    pub time: String,
    pub decision: Decision,
    pub reason: &'a str,
    pub tenant: &'a str,
    pub claim_uid: &'a str,
    pub claim_name: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub share_id: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub device: &'a str,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub amounts: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub policy_version: &'a str,
    pub allocation_id: &'a str,
    pub epoch: u64,
    /// None for decisions the agent took by itself (restart recovery).
    pub caller_uid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub code: Option<&'a str>,
}

pub struct AuditLog {
    file: Mutex<File>,
}

impl AuditLog {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            file: Mutex::new(file),
        })
    }

    /// Writes one line. A failed write is logged, not returned: refusing service because
    /// the audit disk is full would turn a logging problem into an outage, and the share
    /// store still has the decision.
    pub fn write(&self, line: &AuditLine<'_>) {
        let mut buf = match serde_json::to_vec(line) {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "audit line does not serialize");
                return;
            }
        };
        buf.push(b'\n');
        let mut f = crate::sync::lock(&self.file);
        if let Err(e) = f.write_all(&buf) {
            tracing::error!(error = %e, "audit log write failed");
        }
    }
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

/// A time in milliseconds since the epoch, as RFC 3339.
pub fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}
