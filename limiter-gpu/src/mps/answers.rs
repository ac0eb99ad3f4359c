//! What NVIDIA's control program takes and answers: limits in MiB, lists of pids, a
//! set command's silence; and the names and sizes the share directories are made with.

use std::{fs, path::Path};

use super::{GIB, MAX_PLAIN_NAME, MIB};
use crate::{backend::MpsLimit, error::GpuError};

/// The node's memory (`MemTotal` of /proc/meminfo) in whole MiB, at least one; None
/// where it cannot be read.
pub fn node_memory_bytes() -> Option<u64> {
    parse_mem_total(&fs::read_to_string("/proc/meminfo").ok()?)
}

pub(super) fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    let bytes = kib.checked_mul(1024)? / MIB * MIB;
    (bytes > 0).then_some(bytes)
}

/// The command prefix that runs what follows it in a mount namespace of its own, with
/// `shm` as its `/dev/shm` (util-linux `unshare` and `mount`; needs CAP_SYS_ADMIN). The
/// process keeps its PID: both `exec`.
pub fn with_shm(shm: &Path) -> Vec<String> {
    [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        "mount --bind \"$1\" /dev/shm && shift && exec \"$@\"",
        "shareguard-mps-shm",
    ]
    .map(String::from)
    .into_iter()
    .chain([shm.to_string_lossy().into_owned()])
    .collect()
}

/// The PIDs a list command (`get_server_list`, `get_client_list`) answers, one per line;
/// anything else is an answer this build does not understand.
pub fn parse_pids(text: &str, command: &str) -> Result<Vec<u32>, GpuError> {
    text.split_whitespace()
        .map(|w| {
            w.parse::<u32>()
                .map_err(|_| GpuError::Internal(format!("{command} answered {text:?}, not PIDs")))
        })
        .collect()
}

/// A set command answers nothing; any text is the daemon refusing it.
pub fn set_answer(out: String) -> Result<(), GpuError> {
    if out.trim().is_empty() {
        Ok(())
    } else {
        Err(GpuError::InvalidArgument(format!(
            "MPS control refused the limit: {}",
            out.trim()
        )))
    }
}

/// The directory name for a share key: the key itself when short and made of
/// `[A-Za-z0-9._-]` (not starting with '.'), else `h-` and a 64-bit FNV-1a hash of it,
/// which is stable across builds (std's hasher is not).
pub fn dir_name(share_key: &str) -> String {
    let plain = !share_key.is_empty()
        && share_key.len() <= MAX_PLAIN_NAME
        && !share_key.starts_with('.')
        && !share_key.starts_with("h-")
        && share_key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if plain {
        return share_key.to_string();
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in share_key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("h-{h:016x}")
}

/// A limit as the control program takes it: whole MiB, rounded down so that the share
/// never gets more than it was given.
pub fn mib_value(bytes: u64) -> Result<String, GpuError> {
    let mib = bytes / MIB;
    if mib == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "{bytes} bytes is below the 1 MiB an MPS limit can express"
        )));
    }
    Ok(format!("{mib}M"))
}

/// The bytes an MPS limit of `bytes` really is (see [`mib_value`]).
pub fn enforceable_bytes(bytes: u64) -> u64 {
    bytes / MIB * MIB
}

/// Parses a limit as the control program shows it: `<n>M`, or `<n>G` where the driver
/// shows a limit of 1 GiB or more rounded down to whole GiB.
pub fn parse_shown(text: &str) -> Result<MpsLimit, GpuError> {
    let t = text.trim();
    let bad = || GpuError::Internal(format!("MPS control showed the limit as {t:?}"));
    let (digits, unit) = match t.char_indices().last() {
        Some((i, 'M')) => (&t[..i], MIB),
        Some((i, 'G')) => (&t[..i], GIB),
        _ => return Err(bad()),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(unit).ok_or_else(bad)?;
    Ok(MpsLimit {
        bytes,
        granularity: unit,
    })
}
