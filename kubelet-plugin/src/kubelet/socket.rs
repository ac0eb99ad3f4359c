//! The plugin's socket files: a stale one (left by a killed instance) is replaced at
//! start, and a clean stop removes the file, unless another instance has replaced it
//! meanwhile (a rolling update starts the new plugin before the old one stops).

use std::{
    io,
    os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use tokio::net::UnixListener;
use tracing::{info, warn};

use crate::error::PluginError;

/// The longest path a unix socket address holds (`sun_path` is 108 bytes on Linux, with
/// the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Removes its socket file when dropped, if the file is still the one it bound.
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    inode: u64,
}

impl SocketFile {
    /// Binds `path`, making its directory and replacing a socket file already there.
    /// Refuses to replace anything that is not a socket.
    pub fn bind(path: &Path) -> Result<(UnixListener, Self), PluginError> {
        let err = |source: io::Error| PluginError::Socket {
            path: path.display().to_string(),
            source,
        };
        // kubelet dials the path as it is: it must fit a unix socket's address.
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes, longer than a unix socket's path may be ({MAX_SOCKET_PATH}): shorten the directory, the driver's name or --instance-id"
                ),
            )));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                info!(path = %path.display(), "replacing a socket left by an earlier instance");
                std::fs::remove_file(path).map_err(err)?;
            }
            Ok(_) => {
                return Err(err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a socket; not replacing it",
                )));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        let listener = UnixListener::bind(path).map_err(err)?;
        // kubelet (root) is the only client; nobody else on the node needs to connect.
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
        let inode = std::fs::symlink_metadata(path).map_err(err)?.ino();
        Ok((
            listener,
            Self {
                path: path.to_path_buf(),
                inode,
            },
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) if m.ino() == self.inode => {
                if let Err(e) = std::fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), error = %e, "cannot remove socket");
                }
            }
            // Replaced by a newer instance, or already gone: not ours to remove.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_removed_at_drop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/x.sock");
        let (l1, s1) = SocketFile::bind(&path).unwrap();
        // A killed instance leaves its file behind.
        std::mem::forget(s1);
        drop(l1);
        let (_l2, s2) = SocketFile::bind(&path).unwrap();
        assert!(path.exists());
        drop(s2);
        assert!(!path.exists(), "removed at a clean stop");
    }

    #[tokio::test]
    async fn a_socket_replaced_by_a_newer_instance_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        let (_old_l, old) = SocketFile::bind(&path).unwrap();
        let (_new_l, new) = SocketFile::bind(&path).unwrap();
        drop(old);
        assert!(
            path.exists(),
            "the old instance removed the new one's socket"
        );
        drop(new);
        assert!(!path.exists());
    }

    /// kubelet dials the path itself: one too long for a socket address is refused at
    /// once with the limit, and nothing is made.
    #[tokio::test]
    async fn a_path_too_long_for_a_socket_address_is_refused_by_length() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("d").as_os_str().len();
        let fits = dir
            .path()
            .join("d")
            .join("x".repeat(MAX_SOCKET_PATH - base - 1));
        assert_eq!(fits.as_os_str().len(), MAX_SOCKET_PATH);
        let (_l, s) = SocketFile::bind(&fits).unwrap();
        drop(s);
        let long = dir
            .path()
            .join("e")
            .join("x".repeat(MAX_SOCKET_PATH - base));
        let e = SocketFile::bind(&long).unwrap_err().to_string();
        assert!(e.contains("108 bytes") && e.contains("(107)"), "{e}");
        assert!(!dir.path().join("e").exists(), "made its directory");
    }

    #[tokio::test]
    async fn anything_but_a_socket_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.sock");
        std::fs::write(&path, b"data").unwrap();
        let e = SocketFile::bind(&path).unwrap_err().to_string();
        assert!(e.contains("not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
    }
}
