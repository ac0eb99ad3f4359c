//! One agent per state directory, i.e. per node: an exclusive lock on
//! `<state_dir>/agent.lock`, taken before the agent touches anything of the node (BPF
//! pins, qdiscs, GPU limits, MPS daemons, the store) and held until it exits.
//!
//! The store's own lock comes too late for that: the limiters are built before the
//! store opens, and building them loads and pins programs. A second agent (another
//! release's DaemonSet on this node, node pools whose selectors overlap, an SRE's
//! `shareguard agent` by hand) waits a moment for the lock, as a rolling update's new
//! pod does for the old one, then exits naming the holder, having changed nothing.

use std::{
    fs::{File, OpenOptions, TryLockError},
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

/// The lock file's name in the state directory.
pub const FILE_NAME: &str = "agent.lock";

/// How long a starting agent waits for the lock: a replaced agent's process may still
/// be exiting when kubelet starts the new one.
pub const PATIENCE: Duration = Duration::from_secs(5);

/// The held lock; released when dropped, or by the kernel when the process ends.
#[derive(Debug)]
pub struct AgentLock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentLockError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "another shareguard agent (pid {holder}) holds {}: a node's state directory serves one agent, i.e. one release; this one exits having changed nothing",
        path.display()
    )]
    Held { path: PathBuf, holder: String },
}

impl AgentLock {
    /// Takes the lock of `state_dir` (which must exist), waiting up to `patience` while
    /// another process holds it, and records this process's pid in it for the message
    /// a later contender prints.
    pub fn acquire(state_dir: &Path, patience: Duration) -> Result<AgentLock, AgentLockError> {
        let path = state_dir.join(FILE_NAME);
        let io = |source| AgentLockError::Io {
            path: path.clone(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        let deadline = Instant::now() + patience;
        loop {
            match file.try_lock() {
                Ok(()) => break,
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(TryLockError::WouldBlock) => {
                    let holder = std::fs::read_to_string(&path)
                        .ok()
                        .map(|s| s.trim().to_owned())
                        .filter(|s| !s.is_empty())
                        .unwrap_or_else(|| "unknown".to_owned());
                    return Err(AgentLockError::Held { path, holder });
                }
                Err(TryLockError::Error(e)) => return Err(io(e)),
            }
        }
        file.set_len(0).map_err(io)?;
        file.write_all(format!("{}\n", std::process::id()).as_bytes())
            .map_err(io)?;
        Ok(AgentLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_waits_then_is_refused_naming_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let first = AgentLock::acquire(dir.path(), Duration::ZERO).unwrap();
        let started = Instant::now();
        let e = AgentLock::acquire(dir.path(), Duration::from_millis(200)).unwrap_err();
        assert!(
            started.elapsed() >= Duration::from_millis(200),
            "it did not wait"
        );
        let text = e.to_string();
        assert!(
            text.contains(&format!("pid {}", std::process::id())) && text.contains(FILE_NAME),
            "{text}"
        );
        // Released with its holder: the next one gets it.
        drop(first);
        AgentLock::acquire(dir.path(), Duration::ZERO).unwrap();
    }

    #[test]
    fn a_missing_state_directory_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let e = AgentLock::acquire(&dir.path().join("absent"), Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("absent/agent.lock"), "{e}");
    }
}
