//! A share's directory made ready for its daemon: the record of whose it is, the pipe
//! directory and /dev/shm as tmpfs mounts of their own, each checked before use.

use std::{fs, path::Path};

use nix::mount::MsFlags;

use super::{
    MpsDaemons, PIPE_BYTES, PIPE_INODES, SHARED_MODE, SHM_FLAGS, check_owner, check_private_dir,
    check_shared_dir, create_dir, exists, remove_stale_temps, set_mode, write_atomic,
};
use crate::{
    error::{GpuError, io_err},
    mps_tmpfs::{host_sees, mount_err, mounts_at, shm_size, unmount_shm},
};

impl MpsDaemons {
    pub(super) fn prepare_dir(&self, dir: &Path, share_key: &str) -> Result<(), GpuError> {
        let base = &self.cfg.dir;
        if !exists(base)? {
            // Search, not read, for others: an MPS server (its client's uid) must reach
            // its pipe directory, and nobody but the agent needs to list the shares.
            create_dir(base, 0o711, true)?;
            // Whatever the agent's umask (the systemd unit's is 0077).
            set_mode(base, 0o711)?;
        }
        check_private_dir(base)?;
        create_dir(dir, 0o711, false)?;
        // Another share's directory is left exactly as it is.
        let known = check_owner(dir, share_key)?;
        set_mode(dir, 0o711)?;
        check_private_dir(dir)?;
        if !known {
            write_atomic(&dir.join("key"), share_key)?;
        }
        remove_stale_temps(dir)?;
        // Servers run as their clients' uids and clients add files to the pipe
        // directory: both are open to every uid, sticky (see the module comment).
        for sub in ["pipe", "log"] {
            let d = dir.join(sub);
            create_dir(&d, SHARED_MODE, false)?;
            set_mode(&d, SHARED_MODE)?;
            check_shared_dir(&d)?;
        }
        self.ensure_pipe(&dir.join("pipe"))?;
        let shm = dir.join("shm");
        create_dir(&shm, 0o700, false)?;
        self.ensure_shm(&shm)
    }

    /// The pipe directory's own tmpfs, capped in bytes and files, mounted unless it is
    /// there (it stays while the share lives, across daemon restarts: the containers
    /// that hold it must keep meeting the new daemon there). A pipe directory of an
    /// earlier version, with what a running daemon put there, is left as it is: a tmpfs
    /// over it would hide the daemon's sockets; it gets its tmpfs when the daemon is
    /// next started, after the old files are cleared.
    pub(super) fn ensure_pipe(&self, pipe: &Path) -> Result<(), GpuError> {
        let real = fs::canonicalize(pipe).map_err(|e| io_err("resolving", pipe, &e))?;
        match mounts_at(&real)?.last() {
            Some(m) if m.fstype == "tmpfs" => {}
            Some(m) => {
                return Err(GpuError::Internal(format!(
                    "{} is a {} mount, not the share's tmpfs",
                    real.display(),
                    m.fstype
                )));
            }
            None => {
                let mut entries = fs::read_dir(&real).map_err(|e| io_err("reading", &real, &e))?;
                if entries.next().is_some() {
                    tracing::warn!(
                        pipe = %real.display(),
                        "an MPS pipe directory without its own tmpfs, in use: it gets one when its daemon next starts"
                    );
                    return Ok(());
                }
                nix::mount::mount(
                    Some("tmpfs"),
                    &real,
                    Some("tmpfs"),
                    SHM_FLAGS,
                    Some(format!("size={PIPE_BYTES},nr_inodes={PIPE_INODES},mode=1777").as_str()),
                )
                .map_err(|e| mount_err("mounting a tmpfs on", &real, e))?;
            }
        }
        let got = shm_size(&real)?;
        if got != PIPE_BYTES {
            return Err(GpuError::Internal(format!(
                "{} reads back as a tmpfs of {got} bytes, not {PIPE_BYTES}",
                real.display()
            )));
        }
        check_shared_dir(&real)?;
        host_sees(&real)
    }

    /// Mounts the share's capped tmpfs on `shm` unless it is there already, in which case
    /// only a changed size is applied.
    pub(super) fn ensure_shm(&self, shm: &Path) -> Result<(), GpuError> {
        // mountinfo shows mount points with every symlink resolved.
        let real = fs::canonicalize(shm).map_err(|e| io_err("resolving", shm, &e))?;
        let was_mounted = !mounts_at(&real)?.is_empty();
        let mounted = self.mount_shm(&real);
        if mounted.is_err() && !was_mounted {
            // Fail closed: a CDI spec may already name this directory, and a runtime
            // that finds no directory fails the container, where one that finds the
            // bare directory (or one the host sees bare) would give it an uncapped
            // /dev/shm. A tmpfs the containers already hold stays.
            let _ = unmount_shm(&real);
            let _ = fs::remove_dir(&real);
        }
        mounted
    }

    pub(super) fn mount_shm(&self, real: &Path) -> Result<(), GpuError> {
        let bytes = self.cfg.shm_bytes;
        let size = format!("size={bytes}");
        match mounts_at(real)?.last() {
            None => {
                // Nobody but the agent uses the bare directory; the tmpfs's root gets
                // /dev/shm's mode.
                set_mode(real, 0o700)?;
                nix::mount::mount(
                    Some("tmpfs"),
                    real,
                    Some("tmpfs"),
                    SHM_FLAGS,
                    Some(format!("{size},mode=1777").as_str()),
                )
                .map_err(|e| mount_err("mounting a tmpfs on", real, e))?;
            }
            Some(m) if m.fstype != "tmpfs" => {
                return Err(GpuError::Internal(format!(
                    "{} is a {} mount, not the share's tmpfs",
                    real.display(),
                    m.fstype
                )));
            }
            Some(_) => {
                if shm_size(real)? != bytes {
                    // A changed shm_bytes. tmpfs resizes in place (and refuses to go below
                    // what is in use), so the containers that hold it keep the same one.
                    nix::mount::mount(
                        None::<&str>,
                        real,
                        None::<&str>,
                        SHM_FLAGS | MsFlags::MS_REMOUNT,
                        Some(size.as_str()),
                    )
                    .map_err(|e| mount_err("resizing the tmpfs on", real, e))?;
                }
            }
        }
        let is_tmpfs = mounts_at(real)?.last().is_some_and(|m| m.fstype == "tmpfs");
        let got = shm_size(real)?;
        if !is_tmpfs || got != bytes {
            return Err(GpuError::Internal(format!(
                "{} reads back as {} of {got} bytes, not a tmpfs of {bytes}",
                real.display(),
                if is_tmpfs { "a tmpfs" } else { "no tmpfs" }
            )));
        }
        host_sees(real)
    }
}
