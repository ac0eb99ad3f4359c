//! Every `unsafe` line of the crate: the two NVML functions nvml-wrapper 0.13 does not
//! bind, and the pidfd calls the watchdog terminates processes with. Each has a safe
//! interface; callers never see a raw pointer or file descriptor.
//!
//! # Where the NVML signatures come from
//!
//! NVIDIA's NVML API reference (docs.nvidia.com/deploy/nvml-api, "Device Queries" and
//! the struct pages `nvmlSetMemoryLimits_v1_t` / `nvmlGetMemoryLimits_v1_t`) declares:
//!
//! ```c
//! nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits);
//! nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits);
//! typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit; } nvmlSetMemoryLimits_v1_t;
//! typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit, currentUsed; } nvmlGetMemoryLimits_v1_t;
//! ```
//!
//! (`nameSpace` is the full path of the cgroup directory; limits are bytes.) The structs
//! carry no version field, so the `_v1` suffix is the only versioning.
//!
//! # `NVML_DEVICE_MEMORY_LIMIT_MAX`: assumed, not known
//!
//! The struct pages say "to clear the limits, set softLimit to 0, and hardLimit to
//! NVML_DEVICE_MEMORY_LIMIT_MAX" and "no limit is set when softLimit is 0 and hardLimit
//! is NVML_DEVICE_MEMORY_LIMIT_MAX", but give no value, and no authoritative copy of an
//! R615+ `nvml.h` was found to read it from (nvml-wrapper-sys 0.10's bindings predate
//! the call; NVIDIA's cuda-python bindings declare the functions, not the macro). The
//! natural sentinel for an `unsigned long long` "max" is `ULLONG_MAX`, so
//! [`DEVICE_MEMORY_LIMIT_MAX`] is `u64::MAX` (a public third-party prototype that says it
//! follows `cuda-nvml-dev-13-4`'s header writes the same; that is corroboration, not a
//! source). It is not trusted further than this:
//!
//! - clearing writes it first; a driver that refuses it with
//!   `NVML_ERROR_INVALID_ARGUMENT` gets the GPU's total memory as the hard limit
//!   instead (which lifts the cap in effect), is logged once, and keeps getting that;
//! - reading back, soft 0 with a hard limit of `u64::MAX` or at least the GPU's memory
//!   is "no limit".
//!
//! The total memory is only the fallback because `nvmlDeviceGetMemoryInfo_v2` (what
//! nvml-wrapper's `memory_info` calls) reports it per cgroup partition from R615 on: in
//! a limited cgroup it is that cgroup's limit, not the GPU's. `tests/gpu/run-on-gpu.sh`
//! prints which of the two a real driver took. None of this has been run against a real
//! R615+ driver yet.

use std::ffi::{CStr, c_char, c_uint, c_ulonglong, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use nvml_wrapper::Device;
use nvml_wrapper::error::{NvmlError, nvml_try};

use crate::cgroup::{NamespaceRoots, pod_from_proc_cgroup_in, read_proc_cgroup};
use crate::watchdog::{ProcessTerminator, TerminateError, Terminated};

/// The value this crate writes as `NVML_DEVICE_MEMORY_LIMIT_MAX` ("no hard limit"):
/// `ULLONG_MAX`, assumed (see the module comment for why and what guards it).
pub const DEVICE_MEMORY_LIMIT_MAX: u64 = u64::MAX;

#[repr(C)]
struct SetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
}

#[repr(C)]
struct GetMemoryLimitsV1 {
    name_space: *const c_char,
    soft_limit: c_ulonglong,
    hard_limit: c_ulonglong,
    current_used: c_ulonglong,
}

// The sizes the C structs have on LP64 (a pointer and two or three 64-bit integers, no
// padding); a mismatch here would mean the declarations above drifted from the header.
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(std::mem::size_of::<SetMemoryLimitsV1>() == 24);
    assert!(std::mem::size_of::<GetMemoryLimitsV1>() == 32);
};

// nvmlDevice_t is `struct nvmlDevice_st *`; nvmlReturn_t is a C enum (unsigned int).
type SetFn = unsafe extern "C" fn(*mut c_void, *mut SetMemoryLimitsV1) -> c_uint;
type GetFn = unsafe extern "C" fn(*mut c_void, *mut GetMemoryLimitsV1) -> c_uint;

const SET_SYMBOL: &[u8] = b"nvmlDeviceSetMemoryLimits_v1\0";
const GET_SYMBOL: &[u8] = b"nvmlDeviceGetMemoryLimits_v1\0";

/// Limits read back through `nvmlDeviceGetMemoryLimits_v1`, as the driver reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawMemoryLimits {
    pub soft: u64,
    pub hard: u64,
    pub current_used: u64,
}

/// The per-cgroup memory limit functions of a loaded NVML library.
#[derive(Clone, Copy)]
pub struct MemoryLimitFns {
    set: SetFn,
    get: GetFn,
}

impl std::fmt::Debug for MemoryLimitFns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MemoryLimitFns")
    }
}

/// Which of the two symbols the library exports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SymbolPresence {
    pub set: bool,
    pub get: bool,
}

impl MemoryLimitFns {
    /// Looks both symbols up in `lib`. Returns what was found, and the functions when
    /// both are there.
    ///
    /// # Safety
    ///
    /// `lib` must be the NVML library (so the symbols have the signatures above), and
    /// the returned functions must not be called after `lib` is unloaded. The NVML back
    /// end keeps them next to the `Nvml` that owns the library and only calls them with
    /// a `Device` borrowed from that `Nvml`, which keeps it loaded.
    pub unsafe fn resolve(lib: &libloading::Library) -> (SymbolPresence, Option<Self>) {
        // SAFETY: the types match NVIDIA's declarations (see the module comment); the
        // caller guarantees `lib` is libnvidia-ml. A missing symbol is an Err, not UB.
        let set = unsafe { lib.get::<SetFn>(SET_SYMBOL) }.ok().map(|s| *s);
        // SAFETY: as above.
        let get = unsafe { lib.get::<GetFn>(GET_SYMBOL) }.ok().map(|s| *s);
        let presence = SymbolPresence {
            set: set.is_some(),
            get: get.is_some(),
        };
        let fns = match (set, get) {
            (Some(set), Some(get)) => Some(Self { set, get }),
            _ => None,
        };
        (presence, fns)
    }

    pub fn set(
        &self,
        device: &Device<'_>,
        cgroup: &CStr,
        soft: u64,
        hard: u64,
    ) -> Result<(), NvmlError> {
        let mut arg = SetMemoryLimitsV1 {
            name_space: cgroup.as_ptr(),
            soft_limit: soft,
            hard_limit: hard,
        };
        // SAFETY: `device` is a live handle from the NVML instance these functions were
        // resolved from (borrowing it keeps the library loaded); `arg` is a valid,
        // exclusively borrowed struct of the declared layout whose string outlives the
        // call. NVML does not keep either pointer after returning.
        let rc = unsafe { (self.set)(device.handle().cast(), &mut arg) };
        nvml_try(rc)
    }

    pub fn get(&self, device: &Device<'_>, cgroup: &CStr) -> Result<RawMemoryLimits, NvmlError> {
        let mut arg = GetMemoryLimitsV1 {
            name_space: cgroup.as_ptr(),
            soft_limit: 0,
            hard_limit: 0,
            current_used: 0,
        };
        // SAFETY: as in `set`; the out fields are plain integers NVML writes into.
        let rc = unsafe { (self.get)(device.handle().cast(), &mut arg) };
        nvml_try(rc)?;
        Ok(RawMemoryLimits {
            soft: arg.soft_limit,
            hard: arg.hard_limit,
            current_used: arg.current_used,
        })
    }
}

/// Terminates processes through a pidfd, after checking that the process still belongs
/// to the pod it was attributed to. The pidfd pins the process: once it is open, a PID
/// reused by another process can no longer be signalled by mistake, and the cgroup check
/// made after opening it rules out a reuse that happened before.
#[derive(Clone, Debug)]
pub struct PidfdTerminator {
    proc_root: PathBuf,
    /// The agent's cgroup namespace roots, which `/proc/PID/cgroup` is relative to.
    roots: NamespaceRoots,
}

impl Default for PidfdTerminator {
    fn default() -> Self {
        Self::with_proc_root("/proc")
    }
}

impl PidfdTerminator {
    /// Reads `/proc/PID/cgroup` under `proc_root` as the initial cgroup namespace does;
    /// inside another one, paths climbing out of it read as no pod (see
    /// [`PidfdTerminator::with_roots`]).
    pub fn with_proc_root(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
            roots: NamespaceRoots::Initial,
        }
    }

    /// Resolves cgroup paths against `roots`, the reader's cgroup namespace: the same
    /// roots the process was attributed with, so the re-check reads the same way.
    pub fn with_roots(mut self, roots: NamespaceRoots) -> Self {
        self.roots = roots;
        self
    }

    fn pidfd_open(pid: u32) -> Result<Option<OwnedFd>, TerminateError> {
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| TerminateError::Failed(format!("pid {pid} out of range")))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1;
        // it touches no memory of ours.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            return match err.raw_os_error() {
                Some(libc::ESRCH) => Ok(None),
                _ => Err(TerminateError::Failed(format!("pidfd_open({pid}): {err}"))),
            };
        }
        let fd = i32::try_from(fd)
            .map_err(|_| TerminateError::Failed(format!("pidfd_open({pid}) returned {fd}")))?;
        // SAFETY: the kernel just returned this descriptor to us and nothing else owns it.
        Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn send_sigkill(fd: &OwnedFd) -> Result<Terminated, TerminateError> {
        // SAFETY: a valid pidfd we own, a signal number, a null siginfo (allowed: the
        // kernel fills it as for kill(2)) and no flags.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc == 0 {
            return Ok(Terminated::Signalled);
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ESRCH) => Ok(Terminated::AlreadyGone),
            _ => Err(TerminateError::Failed(format!("pidfd_send_signal: {err}"))),
        }
    }
}

impl ProcessTerminator for PidfdTerminator {
    fn terminate(&self, pid: u32, pod_uid: &str) -> Result<Terminated, TerminateError> {
        let Some(fd) = Self::pidfd_open(pid)? else {
            return Ok(Terminated::AlreadyGone);
        };
        let content = match read_proc_cgroup(&self.proc_root, pid) {
            Ok(c) => c,
            Err(e) => {
                return match e.raw_os_error() {
                    Some(libc::ESRCH) | Some(libc::ENOENT) => Ok(Terminated::AlreadyGone),
                    _ => Err(TerminateError::Failed(format!(
                        "{}/{pid}/cgroup: {e}",
                        self.proc_root.display()
                    ))),
                };
            }
        };
        match pod_from_proc_cgroup_in(&content, &self.roots) {
            Some(p) if p.uid == pod_uid => Self::send_sigkill(&fd),
            other => Err(TerminateError::NotInPod {
                pid,
                expected: pod_uid.to_string(),
                found: other.map(|p| p.uid),
            }),
        }
    }
}

/// The pid of the process that listens on the unix socket at `path`, as the kernel
/// recorded it when that process called listen(2): SO_PEERCRED of a connection to it,
/// closed at once. Non-blocking, so a full backlog is an error rather than a wait.
/// Whoever wrote files next to the socket cannot forge this.
pub fn listener_pid(path: &std::path::Path) -> std::io::Result<u32> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, UnixAddr, connect, getsockopt, socket,
        sockopt::PeerCredentials,
    };
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    connect(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    let pid = getsockopt(&fd, PeerCredentials)?.pid();
    u32::try_from(pid).map_err(|_| std::io::Error::other(format!("peer pid {pid}")))
}

/// Joins pid 1's cgroup namespace, in the calling thread only (setns(2) changes the
/// namespace of the thread that calls it): for a thread that is to name cgroups outside
/// the agent's own namespace. Needs CAP_SYS_ADMIN and pid 1 in sight.
pub fn join_init_cgroup_ns() -> std::io::Result<()> {
    let ns = std::fs::File::open("/proc/1/ns/cgroup")?;
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWCGROUP).map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_without_the_symbols_reports_both_missing() {
        // libc stands in for an NVML before R615: neither symbol is there.
        // SAFETY: no symbol of the declared types exists in libc, so `resolve` hands out
        // no function; nothing is called.
        let lib = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        // SAFETY: as above; `lib` outlives the (absent) functions.
        let (presence, fns) = unsafe { MemoryLimitFns::resolve(&lib) };
        assert_eq!(
            presence,
            SymbolPresence {
                set: false,
                get: false
            }
        );
        assert!(fns.is_none());
    }

    #[test]
    fn terminating_a_missing_pid_is_gone_not_an_error() {
        // PID max on Linux is at most 2^22; this one cannot exist.
        let t = PidfdTerminator::default();
        assert_eq!(
            t.terminate(4_194_304 + 17, "x").unwrap(),
            Terminated::AlreadyGone
        );
    }

    #[test]
    fn refuses_a_process_outside_the_pod() {
        // Our own process is not in the pod; the check must refuse to signal it.
        let t = PidfdTerminator::default();
        let err = t
            .terminate(std::process::id(), "0b7e6a36-6f0a-4c0b-9a51-2b1c8b7f2d11")
            .unwrap_err();
        assert!(matches!(err, TerminateError::NotInPod { .. }), "{err:?}");
    }
}
