//! The share directories on disk: atomic records, owner checks, and the modes that
//! keep the agent's files its own while tenants' servers pass through.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
};

use super::{CONTROL_SOCKET, own_tag};
use crate::error::{GpuError, io_err};

/// Whether `dir` is recorded as `share_key`'s (false: no record yet); an error when it
/// belongs to another share, whose daemon must never be touched for this one.
pub(super) fn check_owner(dir: &Path, share_key: &str) -> Result<bool, GpuError> {
    match fs::read_to_string(dir.join("key")) {
        Ok(k) if k == share_key => Ok(true),
        Ok(k) => Err(GpuError::Internal(format!(
            "{} belongs to share {k:?}, not {share_key:?}",
            dir.display()
        ))),
        Err(_) => Ok(false),
    }
}

pub(super) static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Temp file in the same directory, fsync, rename over the target, fsync the directory:
/// a crash leaves the old file or the new one, never a torn one, and a reader never sees
/// one half written. Mode 0600: these files are the agent's alone.
pub(super) fn write_atomic(path: &Path, text: &str) -> Result<(), GpuError> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(GpuError::Internal(format!(
            "{} has no directory and file name",
            path.display()
        )));
    };
    let name = name.to_string_lossy();
    let mut attempts = 0;
    let (tmp, mut file) = loop {
        let tmp = dir.join(format!(
            ".{name}.{}.{}.tmp",
            own_tag(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            // Only an earlier process with this process's tag (same pid, same start
            // time, another boot) can have left this name; the next number is free.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && attempts < 16 => {
                attempts += 1;
            }
            Err(e) => return Err(io_err("creating", &tmp, &e)),
        }
    };
    let written = file
        .write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .and_then(|()| {
            drop(file);
            fs::rename(&tmp, path)
        })
        .and_then(|()| File::open(dir)?.sync_all());
    if written.is_err() {
        // Best effort: a leftover is ignored, and removed by the next prepare.
        let _ = fs::remove_file(&tmp);
    }
    written.map_err(|e| io_err("writing", path, &e))
}

/// Removes the temp files of [`write_atomic`] that a writer which died before its rename
/// left in `dir`: those of any other process. This process's own are in flight.
pub(super) fn remove_stale_temps(dir: &Path) -> Result<(), GpuError> {
    let ours = format!(".{}.", own_tag());
    for e in fs::read_dir(dir).map_err(|e| io_err("reading", dir, &e))? {
        let e = e.map_err(|e| io_err("reading", dir, &e))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') && name.ends_with(".tmp") && !name.contains(&ours) {
            remove_file(&e.path())?;
        }
    }
    Ok(())
}

/// Removes a file; one already gone is fine.
pub(super) fn remove_file(path: &Path) -> Result<(), GpuError> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("removing", path, &e)),
        _ => Ok(()),
    }
}

pub(super) fn create_dir(path: &Path, mode: u32, recursive: bool) -> Result<(), GpuError> {
    match fs::DirBuilder::new()
        .mode(mode)
        .recursive(recursive)
        .create(path)
    {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(io_err("creating", path, &e)),
        _ => Ok(()),
    }
}

/// Whether anything is at `path` (a dangling symlink counts).
pub(super) fn exists(path: &Path) -> Result<bool, GpuError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err("reading", path, &e)),
    }
}

/// Refuses anything but a directory (not a symlink to one) of this process's user that
/// no one else can write: whoever could write it could plant what the agent reads or
/// talks to there. Not retryable: someone changed what only the agent creates.
pub(super) fn check_private_dir(path: &Path) -> Result<(), GpuError> {
    let m = fs::symlink_metadata(path).map_err(|e| io_err("reading", path, &e))?;
    let euid = nix::unistd::geteuid().as_raw();
    if m.file_type().is_dir() && m.uid() == euid && m.mode() & 0o022 == 0 {
        return Ok(());
    }
    Err(GpuError::Internal(format!(
        "{} is not a directory of uid {euid} that only it can write (uid {}, mode {:o}); \
         refusing to trust what is in it",
        path.display(),
        m.uid(),
        m.mode() & 0o7777
    )))
}

/// The mode of `pipe/` and `log/`: every uid may add files, only a file's owner remove
/// or replace it.
pub(super) const SHARED_MODE: u32 = 0o1777;

/// Refuses anything but a directory (not a symlink to one) of this process's user that
/// others can write only with the sticky bit set: there they may add files, never
/// remove or replace the agent's or the daemon's.
pub(super) fn check_shared_dir(path: &Path) -> Result<(), GpuError> {
    let m = fs::symlink_metadata(path).map_err(|e| io_err("reading", path, &e))?;
    let euid = nix::unistd::geteuid().as_raw();
    let mode = m.mode();
    if m.file_type().is_dir() && m.uid() == euid && (mode & 0o022 == 0 || mode & 0o1000 != 0) {
        return Ok(());
    }
    Err(GpuError::Internal(format!(
        "{} is not a directory of uid {euid} that others can write only with the sticky \
         bit (uid {}, mode {:o}); refusing to trust what is in it",
        path.display(),
        m.uid(),
        mode & 0o7777
    )))
}

/// The daemon's control socket in `pipe`, where it exists, must be a socket of the
/// agent's uid (the daemon runs as it): in a directory tenants may add to, a socket of
/// theirs under that name would answer for the daemon. A missing one is the control
/// program's to report (no daemon listening).
pub(super) fn check_control_socket(pipe: &Path) -> Result<(), GpuError> {
    let path = pipe.join(CONTROL_SOCKET);
    let m = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("reading", &path, &e)),
    };
    let euid = nix::unistd::geteuid().as_raw();
    if m.file_type().is_socket() && m.uid() == euid {
        return Ok(());
    }
    Err(GpuError::Internal(format!(
        "{} is not a socket of uid {euid} (uid {}, mode {:o}); refusing to talk through it",
        path.display(),
        m.uid(),
        m.mode() & 0o7777
    )))
}

pub(super) fn set_mode(path: &Path, mode: u32) -> Result<(), GpuError> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("setting the mode of", path, &e))
}
