//! The machine-wide locks tests share across test processes: [`TrafficLock`] around a
//! measurement (or shared, [`TrafficLock::busy`], by a test that loads the CPUs) and
//! [`HostLock`] around anything that acts on the whole machine.

use std::{
    fs::File,
    time::{Duration, Instant},
};

/// Lock file that keeps throughput measurements from running at the same time.
const TRAFFIC_LOCK: &str = "/tmp/shareguard-tests-traffic.lock";
/// Lock file that a test acting on the whole machine holds exclusively, and every agent
/// and pod of the other tests shared ([`HostLock`]).
const HOST_LOCK: &str = "/tmp/shareguard-tests-host.lock";

/// An exclusive `flock` on a file under /tmp, held until drop. `flock` locks belong to
/// the open file description, so two holders conflict whether they are threads of one
/// process or separate processes.
#[derive(Debug)]
pub struct FileLock {
    _file: File,
}

impl FileLock {
    pub fn acquire(path: &str) -> FileLock {
        let file = FileLock::open(path);
        file.lock().unwrap_or_else(|e| panic!("lock {path}: {e}"));
        FileLock { _file: file }
    }

    /// The same file locked shared: any number of shared holders, no exclusive one.
    pub fn shared(path: &str) -> FileLock {
        let file = FileLock::open(path);
        file.lock_shared()
            .unwrap_or_else(|e| panic!("lock {path} shared: {e}"));
        FileLock { _file: file }
    }

    fn open(path: &str) -> File {
        File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .unwrap_or_else(|e| panic!("open lock file {path}: {e}"))
    }
}

/// Held around every throughput or timing measurement: such tests in this process and in
/// other test processes never run at the same time and compete for the CPUs (two iperf3
/// runs side by side on two cores each measure less than their limit).
#[derive(Debug)]
pub struct TrafficLock {
    _lock: FileLock,
    pub waited: Duration,
}

impl TrafficLock {
    pub fn acquire() -> TrafficLock {
        let started = Instant::now();
        let lock = FileLock::acquire(TRAFFIC_LOCK);
        TrafficLock {
            _lock: lock,
            waited: started.elapsed(),
        }
    }

    /// Held by a test that keeps the CPUs busy without measuring anything (a hundred
    /// thousand shares, dozens of racing clients): such tests run beside each other, but
    /// never beside a measurement (seen: two pods' goodput read 0.927 of their limit
    /// while 100,000 shares were listed next to them). Taken after the test's agent
    /// exists, as [`HostLock`] requires.
    pub fn busy() -> BusyLock {
        BusyLock {
            _lock: FileLock::shared(TRAFFIC_LOCK),
        }
    }
}

/// See [`TrafficLock::busy`].
#[derive(Debug)]
pub struct BusyLock {
    _lock: FileLock,
}

thread_local! {
    /// Set on the thread of a test that holds [`HostLock`] exclusively, whose own agents
    /// and pods must not wait for the lock it holds.
    static HOST_EXCLUSIVE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Keeps tests that act on the whole machine apart from the rest: `shareguard cleanup
/// --apply` removes every queue device of shareguard's group on the machine, as it must
/// on a node, and so would take other tests' shares apart under them. Every agent and pod
/// a test makes holds it shared ([`HostLock::shared`]); such a test holds it exclusively
/// ([`HostLock::exclusive`]), and its own agents and pods, made on its thread, then take
/// nothing. The host lock is always taken before the [`TrafficLock`] (exclusive or
/// [`TrafficLock::busy`]), never after, so that the two cannot wait on each other.
#[derive(Debug)]
pub struct HostLock {
    _lock: Option<FileLock>,
    exclusive: bool,
}

impl HostLock {
    /// Held by an agent or a pod while it lives; nothing on the thread of an exclusive
    /// holder.
    pub fn shared() -> HostLock {
        if HOST_EXCLUSIVE.with(std::cell::Cell::get) {
            return HostLock {
                _lock: None,
                exclusive: false,
            };
        }
        HostLock {
            _lock: Some(FileLock::shared(HOST_LOCK)),
            exclusive: false,
        }
    }

    /// Waits until no agent or pod of another test lives, and keeps new ones waiting
    /// until dropped.
    pub fn exclusive() -> HostLock {
        let lock = FileLock::acquire(HOST_LOCK);
        HOST_EXCLUSIVE.with(|c| c.set(true));
        HostLock {
            _lock: Some(lock),
            exclusive: true,
        }
    }
}

impl Drop for HostLock {
    fn drop(&mut self) {
        if self.exclusive {
            HOST_EXCLUSIVE.with(|c| c.set(false));
        }
    }
}
