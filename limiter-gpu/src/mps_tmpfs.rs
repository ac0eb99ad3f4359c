//! The tmpfs mounts of the mps mechanism: what is mounted where, in the agent's mount
//! namespace and as the host (pid 1) sees it, a tmpfs's size, and detaching it.

use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::MntFlags;

use crate::error::GpuError;

use crate::error::io_err;

/// One mount as `/proc/<pid>/mountinfo` shows it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Mounted {
    pub(crate) fstype: String,
    /// The per-mount options (`rw,nosuid,nodev,noexec,relatime`).
    pub(crate) options: String,
}

/// The mounts of this process's namespace at `path` (resolved), bottom first.
pub(crate) fn mounts_at(path: &Path) -> Result<Vec<Mounted>, GpuError> {
    let info = Path::new("/proc/self/mountinfo");
    let text = fs::read_to_string(info).map_err(|e| io_err("reading", info, &e))?;
    Ok(mounts_in(&text, path))
}

/// The mounts at `path` in a mountinfo text (proc(5)): mount point in field 5, options
/// in 6, the file system type after the optional fields' ` - ` separator.
pub(crate) fn mounts_in(mountinfo: &str, path: &Path) -> Vec<Mounted> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let sep = 6 + f.get(6..)?.iter().position(|x| *x == "-")?;
            let point = unescape_mountinfo(f.get(4)?);
            (Path::new(std::ffi::OsStr::from_bytes(&point)) == path).then(|| Mounted {
                fstype: f.get(sep + 1).copied().unwrap_or_default().to_string(),
                options: f.get(5).copied().unwrap_or_default().to_string(),
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo`.
pub(crate) fn unescape_mountinfo(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match octal {
            Some(c) => {
                out.push(c);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// The size of the file system at `path`, as tmpfs reports its cap.
pub(crate) fn shm_size(path: &Path) -> Result<u64, GpuError> {
    let st = nix::sys::statvfs::statvfs(path)
        .map_err(|e| GpuError::Transient(format!("statvfs {}: {e}", path.display())))?;
    // Both are u64 here and u32 on 32-bit targets; widening never loses anything.
    let (blocks, frsize) = (st.blocks() as u64, st.fragment_size() as u64);
    blocks.checked_mul(frsize).ok_or_else(|| {
        GpuError::Internal(format!(
            "{}: {blocks} blocks of {frsize} bytes",
            path.display()
        ))
    })
}

/// Detaches every mount on `shm`; none there (or no `shm`) is success.
pub(crate) fn unmount_shm(shm: &Path) -> Result<(), GpuError> {
    let real = match fs::canonicalize(shm) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("resolving", shm, &e)),
    };
    // Detached, not unmounted: a host process with a file open in it (EBUSY) must not
    // keep the share's directory from going. The tmpfs itself lives on in containers
    // that still hold it and is freed with the last of them.
    for _ in mounts_at(&real)? {
        match nix::mount::umount2(
            real.as_path(),
            MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW,
        ) {
            Ok(()) | Err(Errno::EINVAL) => {}
            Err(e) => return Err(mount_err("detaching the tmpfs on", &real, e)),
        }
    }
    if mounts_at(&real)?.is_empty() {
        Ok(())
    } else {
        Err(GpuError::Transient(format!(
            "{} is still mounted after detaching it",
            real.display()
        )))
    }
}

/// Whether the host sees the tmpfs mounted at `real`: the container runtime resolves the
/// CDI spec's host paths there, so a mount that stayed in the agent's own namespace (a
/// container without Bidirectional propagation, a systemd unit with PrivateMounts=)
/// would hand the containers the bare directory, uncapped and not the daemon's. pid 1
/// stands for the host: the agent runs with the host's pids for NVML anyway.
pub(crate) fn host_sees(real: &Path) -> Result<(), GpuError> {
    host_sees_in(real, Path::new("/proc/1"))
}

pub(crate) fn host_sees_in(real: &Path, init: &Path) -> Result<(), GpuError> {
    let ours = fs::read_link("/proc/self/ns/mnt");
    let theirs = fs::read_link(init.join("ns/mnt"));
    let (Ok(ours), Ok(theirs)) = (ours, theirs) else {
        // pid 1 is out of sight (no hostPID, no ptrace access): nothing to compare with.
        return Ok(());
    };
    if ours == theirs {
        return Ok(());
    }
    let info = init.join("mountinfo");
    let text = fs::read_to_string(&info).map_err(|e| io_err("reading", &info, &e))?;
    if mounts_in(&text, real)
        .last()
        .is_some_and(|m| m.fstype == "tmpfs")
    {
        return Ok(());
    }
    Err(GpuError::Unavailable(format!(
        "the share's /dev/shm tmpfs on {} is mounted in the agent's mount namespace only; \
         the container runtime, in the host's, would give containers the bare directory: \
         run the agent in the host's mount namespace or let the MPS directory propagate \
         to it (mountPropagation: Bidirectional)",
        real.display()
    )))
}

pub(crate) fn mount_err(what: &str, path: &Path, e: Errno) -> GpuError {
    let msg = format!("{what} {}: {e}", path.display());
    match e {
        // The node as set up cannot do it: no CAP_SYS_ADMIN, or a sandbox without mount().
        Errno::EPERM | Errno::EACCES => GpuError::Unavailable(format!(
            "{msg}: the mps mechanism needs CAP_SYS_ADMIN and mount(2) for each share's \
             /dev/shm"
        )),
        _ => GpuError::Transient(msg),
    }
}
