//! The processes of a share's daemon as /proc shows them: who started it, whether it
//! still runs, whether it listens on the share's pipe, and this agent's own identity.

use std::{fs, io, os::unix::ffi::OsStrExt, path::Path, sync::OnceLock};

use super::{CONTROL_SOCKET, check_control_socket};
use crate::error::GpuError;

/// Whether process `pid` runs as root (any of its uids 0) in the agent's user namespace,
/// the host's: such a process owns a share's pipe directory, sticky bit or not. False
/// where that cannot be read (the process is gone).
pub fn root_without_user_namespace(pid: u32) -> bool {
    let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|uids| uids.split_whitespace().any(|u| u == "0"));
    let (Ok(theirs), Ok(ours)) = (
        fs::read_link(format!("/proc/{pid}/ns/user")),
        fs::read_link("/proc/self/ns/user"),
    ) else {
        return false;
    };
    root && theirs == ours
}

/// A process as the agent recorded it: a pid alone may be recycled, a pid with its
/// start time (clock ticks since boot) names one process for the whole boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Daemon {
    pub(super) pid: u32,
    pub(super) start: u64,
}

impl Daemon {
    /// The record's text: pid, start time and the boot they belong to.
    pub(super) fn record(&self) -> String {
        format!("{} {} {}\n", self.pid, self.start, boot_id())
    }

    /// The record written by [`Daemon::record`], if it is of this boot.
    pub(super) fn parse(text: &str) -> Option<Self> {
        let mut f = text.split_whitespace();
        let pid = f.next()?.parse().ok()?;
        let start = f.next()?.parse().ok()?;
        (f.next()? == boot_id() && f.next().is_none()).then_some(Self { pid, start })
    }

    /// Whether this very process still exists and is not a zombie.
    pub(super) fn runs(&self) -> bool {
        proc_stat(self.pid).is_some_and(|s| s.alive && s.start == self.start)
    }
}

pub(super) struct ProcStat {
    pub(super) alive: bool,
    pub(super) start: u64,
}

/// State and start time from `/proc/PID/stat`.
pub(super) fn proc_stat(pid: u32) -> Option<ProcStat> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces and parentheses: the fields
    // after it follow the last ')'. The state is field 3, the start time field 22.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some(ProcStat {
        alive: state != "Z" && state != "X",
        start,
    })
}

/// True while the process exists and is not a zombie.
#[cfg(test)]
pub(super) fn process_alive(pid: u32) -> bool {
    proc_stat(pid).is_some_and(|s| s.alive)
}

/// Whether the process runs the control program: its argv[0], or argv[1] where an
/// interpreter runs it.
pub(super) fn is_control(pid: u32, control: &Path) -> bool {
    let Some(name) = control.file_name() else {
        return false;
    };
    let Ok(cmdline) = fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    cmdline
        .split(|b| *b == 0)
        .take(2)
        .any(|arg| Path::new(std::ffi::OsStr::from_bytes(arg)).file_name() == Some(name))
}

/// Whether the process was started for `pipe`: a daemon of another share has another
/// `CUDA_MPS_PIPE_DIRECTORY`.
pub(super) fn serves(pid: u32, pipe: &Path) -> bool {
    let Ok(environ) = fs::read(format!("/proc/{pid}/environ")) else {
        return false;
    };
    let want = [b"CUDA_MPS_PIPE_DIRECTORY=", pipe.as_os_str().as_bytes()].concat();
    environ.split(|b| *b == 0).any(|var| var == want.as_slice())
}

/// The daemon the agent has just started: the process the kernel says listens on the
/// control socket (a socket of the agent's uid, which no tenant but root can make in
/// the sticky pipe directory), if it is a live control program of this pipe directory.
/// The pid file plays no part: tenants can write the directory it is in.
pub(super) fn started_daemon(pipe: &Path, control: &Path) -> Option<Daemon> {
    check_control_socket(pipe).ok()?;
    let pid = crate::sys::listener_pid(&pipe.join(CONTROL_SOCKET)).ok()?;
    let before = proc_stat(pid).filter(|s| s.alive)?;
    let daemon = Daemon {
        pid,
        start: before.start,
    };
    (is_control(pid, control) && serves(pid, pipe) && daemon.runs()).then_some(daemon)
}

/// The listener behind the control socket must be the recorded daemon: a socket in its
/// place that another process serves (a tenant with uid 0 can make one) would answer
/// the agent's read-backs and swallow its `quit`. No socket is the control program's
/// to report.
pub(super) fn check_listener(pipe: &Path, daemon: u32) -> Result<(), GpuError> {
    let path = pipe.join(CONTROL_SOCKET);
    match crate::sys::listener_pid(&path) {
        Ok(pid) if pid == daemon => Ok(()),
        Ok(pid) => Err(GpuError::Internal(format!(
            "{} is served by process {pid}, not the share's MPS daemon {daemon}; refusing to talk through it",
            path.display()
        ))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(GpuError::Transient(format!(
            "connecting to {}: {e}",
            path.display()
        ))),
    }
}

/// This boot's id: a record of an earlier boot names no process of this one, even where
/// `<dir>` is not on a tmpfs.
pub(super) fn boot_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into())
    })
}

/// This agent process among all that ever wrote into the share directories: pid and
/// start time, so that one that follows with the same pid (pid 1 in a container) still
/// differs.
pub(super) fn own_tag() -> &'static str {
    static TAG: OnceLock<String> = OnceLock::new();
    TAG.get_or_init(|| {
        let pid = std::process::id();
        match proc_stat(pid) {
            Some(s) => format!("{pid}-{}", s.start),
            None => format!("{pid}-0"),
        }
    })
}
