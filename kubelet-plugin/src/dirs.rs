//! `shareguard kubelet-plugin-dirs`: hands the plugin's socket directories to the uid
//! the plugin runs as, so that the plugin itself needs neither root nor a capability.
//!
//! kubelet's registration directory is root's (0750), and kubelet watches it and the
//! directories below it for sockets. The plugin therefore registers from a directory of
//! its own inside it (`plugins_registry/<driver>/`) and serves from
//! `plugins/<driver>/`; this command, run before the plugin at each start (an init
//! container with CAP_CHOWN and CAP_FOWNER only), creates those directories where missing and
//! gives them to the plugin's uid and gid, mode 0750. Owning them is also what lets the
//! plugin remove its own registration socket when it stops.

use std::{
    fs::{self, DirBuilder, OpenOptions, Permissions},
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    },
    path::{Path, PathBuf},
};

use clap::Args;

/// The directories' mode: the plugin reads and writes, its group reads, nobody else.
const MODE: u32 = 0o750;

#[derive(Args, Clone, Debug)]
pub struct DirsArgs {
    /// The plugin's uid and gid, `UID:GID`, numeric; not root (a plugin that runs as
    /// root needs no directory of its own).
    #[arg(long, value_parser = owner)]
    pub owner: Owner,
    /// The directories: the plugin's `--registry-dir` and `<plugins-dir>/<driver>` for
    /// each driver. Each is made if missing (its parent must exist); a symlink or
    /// anything else that is not a directory is refused.
    #[arg(required = true)]
    pub dirs: Vec<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

fn owner(s: &str) -> Result<Owner, String> {
    let (uid, gid) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: not UID:GID"))?;
    let id = |what: &str, v: &str| {
        v.parse::<u32>()
            .map_err(|_| format!("{s:?}: {what} {v:?} is not a number"))
    };
    let o = Owner {
        uid: id("uid", uid)?,
        gid: id("gid", gid)?,
    };
    if o.uid == 0 {
        return Err(format!(
            "{s:?}: uid 0: the directories are for a plugin that does not run as root"
        ));
    }
    Ok(o)
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct DirError {
    pub path: String,
    pub reason: String,
}

impl DirError {
    fn new(path: &Path, reason: impl Into<String>) -> Self {
        Self {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }
}

/// Makes and hands over each directory, in order; stops at the first it cannot. Returns
/// one line per directory for the log.
pub fn prepare(args: &DirsArgs) -> Result<Vec<String>, DirError> {
    args.dirs
        .iter()
        .map(|d| prepare_one(d, args.owner))
        .collect()
}

fn prepare_one(path: &Path, o: Owner) -> Result<String, DirError> {
    let io_err = |what: &str, e: io::Error| DirError::new(path, format!("{what}: {e}"));
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(DirError::new(
                path,
                "is a symlink; refusing to hand over what it points to",
            ));
        }
        Ok(m) if !m.is_dir() => return Err(DirError::new(path, "exists and is not a directory")),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            DirBuilder::new().mode(MODE).create(path).map_err(|e| {
                let hint = if e.kind() == io::ErrorKind::NotFound {
                    " (its parent is missing: is kubelet's --root-dir elsewhere?)"
                } else {
                    ""
                };
                DirError::new(path, format!("cannot create: {e}{hint}"))
            })?;
        }
        Err(e) => return Err(io_err("cannot read", e)),
    }
    // Everything from here on goes through one descriptor opened without following a
    // symlink, so a directory swapped for a link after the check above is not followed.
    // O_PATH: a directory handed over at an earlier start is the plugin's (0750), which
    // root without CAP_DAC_READ_SEARCH may not open for reading; an O_PATH descriptor
    // needs no permission on the directory itself.
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| io_err("cannot open as a directory", e))?;
    // fchown and fchmod refuse an O_PATH descriptor; its /proc link reaches the very
    // inode it holds.
    let by_fd = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd()));
    std::os::unix::fs::chown(&by_fd, Some(o.uid), Some(o.gid))
        .map_err(|e| io_err(&format!("cannot give to {}:{}", o.uid, o.gid), e))?;
    fs::set_permissions(&by_fd, Permissions::from_mode(MODE))
        .map_err(|e| io_err(&format!("cannot set mode {MODE:o}"), e))?;
    let m = dir.metadata().map_err(|e| io_err("cannot read back", e))?;
    Ok(format!(
        "{}: owner {}:{}, mode {:o}",
        path.display(),
        m.uid(),
        m.gid(),
        m.mode() & 0o7777
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_two_numbers_and_not_root() {
        assert_eq!(
            owner("65200:65201"),
            Ok(Owner {
                uid: 65200,
                gid: 65201
            })
        );
        for (bad, says) in [
            ("65200", "not UID:GID"),
            ("x:1", "uid \"x\""),
            ("1:-1", "gid \"-1\""),
            ("0:0", "uid 0"),
        ] {
            let e = owner(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
