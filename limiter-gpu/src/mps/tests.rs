//! The MPS manager against `tests/fixtures/simulated-nvidia-cuda-mps-control`, a
//! simulation of NVIDIA's control program: real processes, real files, real waits.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tempfile::TempDir;

use super::*;
use crate::mps_tmpfs::{Mounted, host_sees_in, mounts_in, shm_size};

const UUID: &str = "GPU-5f0c1e2a-0000-4000-8000-000000000001";
const SHARE: &str = "0b6c3f6e-3a1d-4d0b-9a51-1f2b3c4d5e6f";

fn simulated_control() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/simulated-nvidia-cuda-mps-control")
}

/// A root for the share directories that, on drop, kills every simulated daemon found
/// below it and detaches every share's tmpfs, so a failing test leaves no process and no
/// mount behind.
pub(crate) struct Root {
    pub(crate) dir: TempDir,
}

impl Root {
    pub(crate) fn new() -> Self {
        Self {
            dir: tempfile::Builder::new()
                .prefix("sg-mps")
                .tempdir()
                .expect("temp dir"),
        }
    }

    /// Daemons driving the simulated control program.
    pub(crate) fn daemons(&self) -> MpsDaemons {
        self.daemons_with(simulated_control(), Duration::from_secs(10))
    }

    fn daemons_with(&self, control: PathBuf, timeout: Duration) -> MpsDaemons {
        MpsDaemons::new(self.config(control, timeout)).expect("a short absolute dir")
    }

    fn config(&self, control: PathBuf, timeout: Duration) -> MpsConfig {
        MpsConfig {
            control,
            dir: self.dir.path().to_path_buf(),
            timeout,
            cgroup: self.cgroup(),
            ..MpsConfig::default()
        }
    }

    /// This root's own daemon cgroup, removed with it.
    pub(crate) fn cgroup(&self) -> String {
        format!(
            "sgt-{}",
            self.dir.path().file_name().unwrap().to_string_lossy()
        )
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let Ok(entries) = fs::read_dir(self.dir.path()) else {
            return;
        };
        for e in entries.flatten() {
            let dir = e.path();
            // Wherever a pid is written down, and only if it is the simulation.
            for file in [
                dir.join(RECORD),
                dir.join("pipe").join(PID_FILE),
                dir.join("pipe/fake-daemon-pid"),
            ] {
                let pid = fs::read_to_string(file).ok().and_then(|t| {
                    t.split_whitespace()
                        .next()
                        .and_then(|p| p.parse::<u32>().ok())
                });
                if let Some(pid) = pid
                    && is_control(pid, &simulated_control())
                {
                    let _ = Command::new("kill").arg(pid.to_string()).status();
                }
            }
            let _ = unmount_shm(&dir.join("shm"));
            let _ = unmount_shm(&dir.join("pipe"));
        }
        if let Err(e) = crate::mps_cgroup::remove(&self.cgroup(), Duration::from_secs(5)) {
            eprintln!("{e}");
        }
    }
}

/// A process that looks like the share's daemon to anyone who goes by a pid: argv[0] is
/// the control program and its environment names the share's pipe directory. Killed on
/// drop.
struct Decoy(std::process::Child);

impl Decoy {
    fn start(pipe: &Path) -> Self {
        use std::os::unix::process::CommandExt;
        let child = Command::new("sleep")
            .arg0(simulated_control())
            .arg("600")
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let d = Self(child);
        // exec has happened once the command line is the one asked for.
        wait_for(
            || is_control(pid, &simulated_control()),
            "the decoy to exec",
        );
        d
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Still running: never signalled by anyone.
    fn untouched(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for Decoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `done` until it holds; panics after 10 s.
fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "waited 10s for {what}"
        );
        std::thread::sleep(POLL);
    }
}

fn kill9(pid: u32) {
    assert!(
        Command::new("kill")
            .arg("-9")
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success()
    );
    wait_for(|| !process_alive(pid), "kill -9 to end the process");
}

fn pid_of(d: &MpsDaemons, key: &str) -> u32 {
    fs::read_to_string(d.pipe_dir(key).join(PID_FILE))
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid")
}

/// The tmpfs mounts at `path` in this mount namespace.
fn tmpfs_mounts(path: &Path) -> usize {
    let real = fs::canonicalize(path).unwrap();
    mounts_at(&real)
        .unwrap()
        .iter()
        .filter(|m| m.fstype == "tmpfs")
        .count()
}

#[test]
fn dir_names_are_plain_for_share_ids_and_hashed_otherwise() {
    assert_eq!(dir_name(SHARE), SHARE);
    // FNV-1a 64 of the key, so that the path survives a rebuild with another std.
    assert_eq!(dir_name("claim-uid/gpu-0"), "h-ad78b2bff96e830c");
    for odd in ["", ".hidden", "h-looks-hashed", &"x".repeat(37), "a b", "ü"] {
        let n = dir_name(odd);
        assert!(n.starts_with("h-") && n.len() == 18, "{odd:?} -> {n}");
    }
    assert_ne!(dir_name("a/b"), dir_name("a/c"));
}

#[test]
fn limits_are_whole_mib_rounded_down() {
    assert_eq!(mib_value(8 << 30).unwrap(), "8192M");
    assert_eq!(mib_value((1 << 20) + 5).unwrap(), "1M");
    assert!(matches!(mib_value(1000), Err(GpuError::InvalidArgument(_))));
    assert_eq!(enforceable_bytes((3 << 20) + 7), 3 << 20);
}

#[test]
fn shown_limits_parse_with_their_granularity() {
    let g = parse_shown("8G\n").unwrap();
    assert_eq!((g.bytes, g.granularity), (8 << 30, 1 << 30));
    let m = parse_shown(" 512M").unwrap();
    assert_eq!((m.bytes, m.granularity), (512 << 20, 1 << 20));
    for bad in [
        "",
        "8",
        "G",
        "8T",
        "-1G",
        "8 G",
        "99999999999999999999G",
        "Server 1 not found",
    ] {
        assert!(
            matches!(parse_shown(bad), Err(GpuError::Internal(_))),
            "{bad:?}"
        );
    }
    // 8500 MiB is shown as 8G: that reading admits 8500 MiB but not 9 GiB or 7 GiB.
    assert!(g.admits(8500 << 20));
    assert!(!g.admits(9 << 30));
    assert!(!g.admits(7 << 30));
    assert!(MpsLimit::exact(5).admits(5) && !MpsLimit::exact(5).admits(6));
}

#[test]
fn the_directory_must_leave_room_for_the_sockets() {
    for dir in [
        "relative/mps",
        "/run/a-directory-name-far-too-long-for-sockets",
    ] {
        let r = MpsDaemons::new(MpsConfig {
            dir: dir.into(),
            ..MpsConfig::default()
        });
        assert!(matches!(r, Err(GpuError::InvalidArgument(_))), "{dir}");
    }
    assert!(MpsDaemons::new(MpsConfig::default()).is_ok());
}

#[test]
fn probe_needs_an_executable_control_program() {
    let root = Root::new();
    if crate::test_root::is_root() {
        // Needs a mount (see the next test); without root the probe says so.
        assert_eq!(root.daemons().probe(), Support::Supported);
    }
    let missing = root.daemons_with(
        "/nonexistent/nvidia-cuda-mps-control".into(),
        Duration::from_secs(1),
    );
    match missing.probe() {
        Support::Unsupported(why) => assert!(why.contains("/nonexistent"), "{why}"),
        Support::Supported => panic!("a missing program cannot be supported"),
    }
    let plain = root.dir.path().join("not-executable");
    fs::write(&plain, "").unwrap();
    assert!(
        !root
            .daemons_with(plain, Duration::from_secs(1))
            .probe()
            .is_supported()
    );
}

#[test]
fn a_share_gets_its_own_daemon_with_the_limit_read_back() {
    if !crate::test_root::require_root("a_share_gets_its_own_daemon_with_the_limit_read_back") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    assert_eq!(d.limit(SHARE).unwrap(), None, "no daemon yet");

    d.ensure_limit(UUID, SHARE, 8500 << 20).unwrap();
    let pipe = d.pipe_dir(SHARE);
    assert_eq!(pipe, root.dir.path().join(SHARE).join("pipe"));
    let pid = pid_of(&d, SHARE);
    assert!(process_alive(pid));
    // The daemon was started for the share's GPU only.
    assert_eq!(
        fs::read_to_string(pipe.join("fake-visible-devices"))
            .unwrap()
            .trim(),
        UUID
    );
    assert_eq!(
        fs::metadata(&pipe).unwrap().permissions().mode() & 0o7777,
        0o1777
    );
    // Its /dev/shm is the share's own directory, which the CDI spec gives the containers.
    let shm = d.shm_dir(SHARE);
    assert_eq!(shm, root.dir.path().join(SHARE).join("shm"));
    assert_eq!(
        fs::read_to_string(shm.join("simulated-mps-daemon"))
            .unwrap()
            .trim(),
        pipe.to_str().unwrap()
    );
    assert_eq!(
        fs::metadata(&shm).unwrap().permissions().mode() & 0o7777,
        0o1777
    );
    let shown = d.limit(SHARE).unwrap().expect("a limit");
    assert!(shown.admits(8500 << 20), "{shown:?}");
    assert_eq!(shown.bytes, 8 << 30, "the control program shows whole GiB");

    // Again with another limit: the same daemon, the new value.
    d.ensure_limit(UUID, SHARE, 512 << 20).unwrap();
    assert_eq!(pid_of(&d, SHARE), pid);
    assert_eq!(
        d.limit(SHARE).unwrap(),
        Some(MpsLimit {
            bytes: 512 << 20,
            granularity: 1 << 20
        })
    );

    d.stop(SHARE).unwrap();
    assert!(!process_alive(pid), "the daemon quit");
    assert!(
        !root.dir.path().join(SHARE).exists(),
        "its directory went with it"
    );
    assert_eq!(d.limit(SHARE).unwrap(), None);
    d.stop(SHARE).expect("stopping twice is fine");
}

#[test]
fn running_servers_get_the_limit_and_their_drift_is_seen() {
    if !crate::test_root::require_root("running_servers_get_the_limit_and_their_drift_is_seen") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 2 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    // A server already running with another limit (started before a change).
    fs::write(pipe.join("fake-servers"), "4242\n").unwrap();
    fs::write(pipe.join("fake-server-4242"), "4096\n").unwrap();
    assert_eq!(
        d.limit(SHARE).unwrap().map(|l| l.bytes),
        Some(4 << 30),
        "the server's own limit is what its clients get"
    );
    d.ensure_limit(UUID, SHARE, 2 << 30).unwrap();
    assert_eq!(
        fs::read_to_string(pipe.join("fake-server-4242"))
            .unwrap()
            .trim(),
        "2048"
    );
    assert!(d.limit(SHARE).unwrap().unwrap().admits(2 << 30));
    d.stop(SHARE).unwrap();
}

#[test]
fn a_dead_daemon_reads_as_no_limit_and_is_started_again() {
    if !crate::test_root::require_root("a_dead_daemon_reads_as_no_limit_and_is_started_again") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pid = pid_of(&d, SHARE);
    kill9(pid);
    assert_eq!(d.limit(SHARE).unwrap(), None);
    let control = d.pipe_dir(SHARE).join("control");
    assert!(control.exists(), "the killed daemon's socket stays behind");
    let leftover = d.pipe_dir(SHARE).join("left-by-the-dead-daemon");
    fs::write(&leftover, "").unwrap();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let new = pid_of(&d, SHARE);
    assert_ne!(new, pid, "a new daemon");
    assert!(
        !leftover.exists(),
        "the dead daemon's files went before the new one started"
    );
    assert_eq!(
        crate::sys::listener_pid(&control).unwrap(),
        new,
        "the new daemon listens on the control socket"
    );
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));
    d.stop(SHARE).unwrap();
}

#[test]
fn a_daemon_started_for_another_gpu_is_replaced() {
    if !crate::test_root::require_root("a_daemon_started_for_another_gpu_is_replaced") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit("GPU-other", SHARE, 1 << 30).unwrap();
    let pid = pid_of(&d, SHARE);
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert!(!process_alive(pid));
    let pipe = d.pipe_dir(SHARE);
    assert_eq!(
        fs::read_to_string(pipe.join("fake-visible-devices"))
            .unwrap()
            .trim(),
        UUID
    );
    d.stop(SHARE).unwrap();
}

#[test]
fn a_directory_of_another_share_is_never_taken_over() {
    let root = Root::new();
    let d = root.daemons();
    let dir = root.dir.path().join(SHARE);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("key"), "some-other-share").unwrap();
    assert!(matches!(
        d.ensure_limit(UUID, SHARE, 1 << 30),
        Err(GpuError::Internal(_))
    ));
    assert!(matches!(d.stop(SHARE), Err(GpuError::Internal(_))));
    assert!(dir.join("key").exists(), "left as it was");
}

#[test]
fn a_hanging_or_failing_control_program_is_an_error_in_bounded_time() {
    if !crate::test_root::require_root(
        "a_hanging_or_failing_control_program_is_an_error_in_bounded_time",
    ) {
        return;
    }
    let root = Root::new();
    let hang = root.dir.path().join("hanging-control");
    fs::write(&hang, "#!/bin/sh\nexec sleep 60\n").unwrap();
    fs::set_permissions(&hang, fs::Permissions::from_mode(0o755)).unwrap();
    let d = root.daemons_with(hang, Duration::from_millis(200));
    match d.ensure_limit(UUID, SHARE, 1 << 30) {
        Err(GpuError::Transient(msg)) => assert!(msg.contains("did not answer"), "{msg}"),
        other => panic!("expected a timeout, got {other:?}"),
    }

    let fail = root.dir.path().join("failing-control");
    fs::write(&fail, "#!/bin/sh\necho 'no GPU for you' >&2\nexit 3\n").unwrap();
    fs::set_permissions(&fail, fs::Permissions::from_mode(0o755)).unwrap();
    let d = root.daemons_with(fail, Duration::from_secs(5));
    // The daemon start's own output goes nowhere (the daemon would hold the pipes
    // open), so only its status shows; a command's output is kept.
    match d.ensure_limit(UUID, "other-share", 1 << 30) {
        Err(GpuError::Transient(msg)) => {
            assert!(msg.contains("-d") && msg.contains("exit 3"), "{msg}")
        }
        other => panic!("expected the failure, got {other:?}"),
    }
    match d.command(&d.pipe_dir("other-share"), "get_server_list") {
        Err(GpuError::Transient(msg)) => {
            assert!(
                msg.contains("exit 3") && msg.contains("no GPU for you"),
                "{msg}"
            )
        }
        other => panic!("expected the failure, got {other:?}"),
    }
}

#[test]
fn a_refused_limit_is_an_error() {
    if !crate::test_root::require_root("a_refused_limit_is_an_error") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    // The simulation refuses devices other than 0, as the real one answers for an
    // unknown device: the answer text must not be taken for success.
    let pipe = d.pipe_dir(SHARE);
    let answer = d
        .command(&pipe, "set_default_device_pinned_mem_limit 3 1024M")
        .unwrap();
    assert!(matches!(
        set_answer(answer),
        Err(GpuError::InvalidArgument(_))
    ));
    d.stop(SHARE).unwrap();
}

#[test]
fn a_launcher_runs_the_daemon_in_the_foreground_under_it() {
    if !crate::test_root::require_root("a_launcher_runs_the_daemon_in_the_foreground_under_it") {
        return;
    }
    let root = Root::new();
    let mut cfg = root.daemons().config().clone();
    // `env` stands in for systemd-run: it passes the unit name on, and `setsid --fork`
    // returns once the daemon runs, as systemd-run does.
    cfg.launcher = [
        "env",
        "SG_TEST_UNIT=shareguard-mps-{name}",
        "setsid",
        "--fork",
    ]
    .map(String::from)
    .to_vec();
    let d = MpsDaemons::new(cfg).unwrap();
    d.ensure_limit(UUID, SHARE, 3 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    assert_eq!(
        fs::read_to_string(pipe.join("fake-started"))
            .unwrap()
            .trim(),
        format!("-f umask=0022 unit=shareguard-mps-{SHARE}")
    );
    let pid = pid_of(&d, SHARE);
    assert!(process_alive(pid));
    assert!(d.limit(SHARE).unwrap().unwrap().admits(3 << 30));
    d.stop(SHARE).unwrap();
    assert!(!process_alive(pid));
}

#[test]
fn the_shm_size_is_whole_mib_and_never_zero() {
    for bad in [0, 1, MIB - 1, MIB + 4096] {
        let r = MpsDaemons::new(MpsConfig {
            shm_bytes: bad,
            ..MpsConfig::default()
        });
        // tmpfs would take size=0 for no cap at all.
        assert!(matches!(r, Err(GpuError::InvalidArgument(_))), "{bad}");
    }
    // The node's memory, so that no container's /dev/shm shrinks (see shm_bytes).
    let node = node_memory_bytes().unwrap();
    assert_eq!(MpsConfig::default().shm_bytes, node);
    assert!(
        node > FALLBACK_SHM_BYTES && node.is_multiple_of(1 << 20),
        "{node}"
    );
    assert_eq!(
        parse_mem_total("MemTotal:       24632084 kB\nMemFree: 1 kB\n"),
        Some(24054 << 20),
        "rounded down to whole MiB"
    );
    assert_eq!(parse_mem_total("MemTotal: 1000 kB\n"), None, "under 1 MiB");
    assert_eq!(parse_mem_total("MemFree: 5 kB\n"), None);
    assert!(
        MpsDaemons::new(MpsConfig {
            shm_bytes: 3 << 20,
            ..MpsConfig::default()
        })
        .is_ok()
    );
}

#[test]
fn the_shm_is_a_capped_tmpfs_kept_across_restarts_and_gone_with_the_share() {
    if !crate::test_root::require_root(
        "the_shm_is_a_capped_tmpfs_kept_across_restarts_and_gone_with_the_share",
    ) {
        return;
    }
    let root = Root::new();
    let mut cfg = root.config(simulated_control(), Duration::from_secs(10));
    cfg.shm_bytes = 4 << 20;
    let d = MpsDaemons::new(cfg.clone()).unwrap();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let shm = d.shm_dir(SHARE);
    assert_eq!(tmpfs_mounts(&shm), 1, "a tmpfs of its own");
    assert_eq!(shm_size(&shm).unwrap(), 4 << 20);
    let real = fs::canonicalize(&shm).unwrap();
    let opts = mounts_at(&real).unwrap().pop().unwrap().options;
    for o in ["nosuid", "nodev", "noexec"] {
        assert!(opts.split(',').any(|x| x == o), "{o} missing in {opts}");
    }
    assert_eq!(
        fs::metadata(&shm).unwrap().permissions().mode() & 0o7777,
        0o1777
    );
    // The daemon's /dev/shm is this tmpfs.
    assert!(shm.join("simulated-mps-daemon").exists());
    // The cap holds: 5 MiB do not fit in 4.
    let err = fs::write(shm.join("big"), vec![0u8; 5 << 20]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(28), "ENOSPC: {err}");
    fs::remove_file(shm.join("big")).unwrap();

    // Again: the same mount, not a second one on top.
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert_eq!(tmpfs_mounts(&shm), 1);
    // A new size is applied to the mounted tmpfs in place.
    cfg.shm_bytes = 8 << 20;
    let d = MpsDaemons::new(cfg).unwrap();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert_eq!(tmpfs_mounts(&shm), 1);
    assert_eq!(shm_size(&shm).unwrap(), 8 << 20);

    // A dead daemon is replaced over the same tmpfs, which the share's containers hold:
    // what they wrote is still there.
    fs::write(shm.join("tenant-segment"), "x").unwrap();
    kill9(pid_of(&d, SHARE));
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert_eq!(tmpfs_mounts(&shm), 1);
    assert!(shm.join("tenant-segment").exists(), "the same tmpfs");

    // Dead again, then released: the tmpfs goes with its directory.
    kill9(pid_of(&d, SHARE));
    d.stop(SHARE).unwrap();
    assert!(!root.dir.path().join(SHARE).exists());
    assert!(
        mounts_at(&real).unwrap().is_empty(),
        "nothing mounted at {}",
        real.display()
    );
}

#[test]
fn a_forged_pid_file_is_never_trusted_and_its_process_never_signalled() {
    if !crate::test_root::require_root(
        "a_forged_pid_file_is_never_trusted_and_its_process_never_signalled",
    ) {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    let real = pid_of(&d, SHARE);
    let mut decoy = Decoy::start(&pipe);

    // The daemon runs and the pid file names the decoy: the agent keeps to its daemon.
    fs::write(pipe.join(PID_FILE), format!("{}\n", decoy.pid())).unwrap();
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));
    d.ensure_limit(UUID, SHARE, 2 << 30).unwrap();
    assert!(process_alive(real), "not restarted");
    assert!(d.limit(SHARE).unwrap().unwrap().admits(2 << 30));

    // The daemon dies and the pid file names the decoy, which passes every check of
    // the pid alone (alive, argv[0], environment): no daemon, no limit read back.
    kill9(real);
    fs::write(pipe.join(PID_FILE), format!("{}\n", decoy.pid())).unwrap();
    assert_eq!(d.limit(SHARE).unwrap(), None);
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let new = pid_of(&d, SHARE);
    assert!(new != decoy.pid() && new != real && process_alive(new));
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));

    // A recycled pid: the record's pid with another start time is not the daemon.
    let record = fs::read_to_string(root.dir.path().join(SHARE).join(RECORD)).unwrap();
    let daemon = Daemon::parse(&record).unwrap();
    assert_eq!(daemon.pid, new);
    let recycled = Daemon {
        pid: decoy.pid(),
        start: proc_stat(decoy.pid()).unwrap().start + 1,
    };
    assert!(!recycled.runs());
    assert!(
        Daemon {
            pid: decoy.pid(),
            start: proc_stat(decoy.pid()).unwrap().start
        }
        .runs()
    );

    fs::write(pipe.join(PID_FILE), format!("{}\n", decoy.pid())).unwrap();
    d.stop(SHARE).unwrap();
    assert!(!process_alive(new), "the agent's daemon quit");
    assert!(decoy.untouched(), "the decoy was never signalled");
}

#[test]
fn the_agents_record_is_where_no_container_reaches() {
    if !crate::test_root::require_root("the_agents_record_is_where_no_container_reaches") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let dir = root.dir.path().join(SHARE);
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
    // Others may pass through to pipe/ (MPS servers run as their client's uid), never
    // list or write; the agent's files are its own.
    assert_eq!(mode(&dir), 0o711);
    for f in ["key", "gpu", RECORD] {
        assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
    }
    // Servers (any client's uid) write their logs, clients add files to pipe/: both
    // open to all, sticky so that nobody replaces what another made.
    assert_eq!(mode(&dir.join("pipe")), 0o1777);
    assert_eq!(mode(&dir.join("log")), 0o1777);
    // What the containers get is pipe/ and shm/, neither of which holds the record.
    let dirs = d.dirs(SHARE);
    for shared in [&dirs.pipe, &dirs.shm] {
        assert!(!dir.join(RECORD).starts_with(shared));
        assert!(!dir.starts_with(shared));
    }
    let record = Daemon::parse(&fs::read_to_string(dir.join(RECORD)).unwrap()).unwrap();
    assert_eq!(record.pid, pid_of(&d, SHARE));
    assert!(record.runs());
    d.stop(SHARE).unwrap();
}

#[test]
fn a_pipe_directory_someone_else_can_write_is_not_trusted() {
    if !crate::test_root::require_root("a_pipe_directory_someone_else_can_write_is_not_trusted") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    // Writable by all without the sticky bit: anyone could replace the daemon's socket.
    fs::set_permissions(&pipe, fs::Permissions::from_mode(0o777)).unwrap();
    assert!(matches!(d.limit(SHARE), Err(GpuError::Internal(_))));
    // With it, a tenant's own socket under the control socket's name is still refused.
    fs::set_permissions(&pipe, fs::Permissions::from_mode(0o1777)).unwrap();
    // The daemon's socket, kept aside to be put back (a rename keeps it listening).
    let aside = pipe.join("control.daemon");
    fs::rename(pipe.join("control"), &aside).unwrap();
    let forged = std::os::unix::net::UnixListener::bind(pipe.join("control")).unwrap();
    std::os::unix::fs::chown(pipe.join("control"), Some(65534), None).unwrap();
    let err = d.limit(SHARE).unwrap_err();
    assert!(
        matches!(&err, GpuError::Internal(m) if m.contains("not a socket of uid")),
        "{err:?}"
    );
    fs::remove_file(pipe.join("control")).unwrap();
    // A plain file is no socket either, whoever owns it.
    fs::write(pipe.join("control"), "").unwrap();
    assert!(matches!(d.limit(SHARE), Err(GpuError::Internal(_))));
    fs::remove_file(pipe.join("control")).unwrap();
    drop(forged);
    // A socket of the agent's uid that another process serves (a tenant running as
    // root could make one) is refused too: the kernel names its listener.
    let other = std::os::unix::net::UnixListener::bind(pipe.join("control")).unwrap();
    let err = d.limit(SHARE).unwrap_err();
    assert!(
        matches!(&err, GpuError::Internal(m) if m.contains("not the share's MPS daemon")),
        "{err:?}"
    );
    drop(other);
    fs::remove_file(pipe.join("control")).unwrap();
    // The daemon's own socket is what the agent talks through.
    fs::rename(&aside, pipe.join("control")).unwrap();
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));
    fs::set_permissions(&pipe, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&pipe, Some(65534), None).unwrap();
    assert!(matches!(d.limit(SHARE), Err(GpuError::Internal(_))));
    // Nor does a prepare take it over: the mode is the agent's to set, the owner not.
    assert!(matches!(
        d.ensure_limit(UUID, SHARE, 1 << 30),
        Err(GpuError::Internal(_))
    ));
    std::os::unix::fs::chown(&pipe, Some(0), None).unwrap();
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));
    d.stop(SHARE).unwrap();
}

#[test]
fn files_are_replaced_whole_never_rewritten_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = dir.path().join("gpu");
    write_atomic(&gpu, "GPU-old-0000").unwrap();
    let mut before = fs::File::open(&gpu).unwrap();
    write_atomic(&gpu, "GPU-new").unwrap();
    // The file open before holds the old text, whole: the new one is another inode,
    // renamed over the name, so nobody ever read a truncated or half-written file.
    let mut old = String::new();
    before.read_to_string(&mut old).unwrap();
    assert_eq!(old, "GPU-old-0000");
    assert_eq!(fs::read_to_string(&gpu).unwrap(), "GPU-new");
    assert_eq!(
        fs::metadata(&gpu).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["gpu"], "no temp file left");
}

#[test]
fn a_dead_writers_temp_file_is_ignored_and_removed() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("gpu"), "GPU-a").unwrap();
    // A writer of an earlier agent process died between its write and its rename.
    let stale = dir.path().join(".gpu.4242-17.0.tmp");
    fs::write(&stale, "GPU-b-half").unwrap();
    // One of this process is a write in flight (another thread's).
    let ours = dir.path().join(format!(".key.{}.999.tmp", own_tag()));
    fs::write(&ours, "").unwrap();
    assert_eq!(fs::read_to_string(dir.path().join("gpu")).unwrap(), "GPU-a");
    remove_stale_temps(dir.path()).unwrap();
    assert!(!stale.exists());
    assert!(ours.exists());
    assert_eq!(fs::read_to_string(dir.path().join("gpu")).unwrap(), "GPU-a");
}

#[test]
fn a_prepare_removes_what_a_dead_writer_left() {
    if !crate::test_root::require_root("a_prepare_removes_what_a_dead_writer_left") {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    let dir = root.dir.path().join(SHARE);
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join("key"), SHARE).unwrap();
    let stale = dir.join(".gpu.4242-17.3.tmp");
    fs::write(&stale, "GPU-half").unwrap();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert!(!stale.exists());
    assert_eq!(fs::read_to_string(dir.join("gpu")).unwrap(), UUID);
    d.stop(SHARE).unwrap();
}

#[test]
fn mountinfo_is_read_with_its_escapes() {
    let info = "\
36 35 98:0 / /mnt/a\\040b rw,noatime master:1 - ext3 /dev/root rw
37 35 0:40 / /run/x/shm rw,nosuid,nodev,noexec,relatime shared:7 - tmpfs tmpfs rw,size=4096k
38 37 0:41 / /run/x/shm rw,relatime - tmpfs tmpfs rw
";
    assert_eq!(
        mounts_in(info, Path::new("/mnt/a b")),
        [Mounted {
            fstype: "ext3".into(),
            options: "rw,noatime".into()
        }]
    );
    let shm = mounts_in(info, Path::new("/run/x/shm"));
    assert_eq!(shm.len(), 2, "stacked, bottom first");
    assert_eq!(shm[0].options, "rw,nosuid,nodev,noexec,relatime");
    assert!(mounts_in(info, Path::new("/run/x")).is_empty());
}

#[test]
fn a_tmpfs_the_hosts_namespace_does_not_show_is_refused() {
    // A stand-in for /proc/1 in another mount namespace than this process's.
    let init = tempfile::tempdir().unwrap();
    fs::create_dir(init.path().join("ns")).unwrap();
    std::os::unix::fs::symlink("mnt:[1]", init.path().join("ns/mnt")).unwrap();
    let shm = Path::new("/run/shareguard-mps/s/shm");
    fs::write(
        init.path().join("mountinfo"),
        "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n",
    )
    .unwrap();
    assert!(matches!(
        host_sees_in(shm, init.path()),
        Err(GpuError::Unavailable(_))
    ));
    fs::write(
        init.path().join("mountinfo"),
        "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
         90 27 0:50 / /run/shareguard-mps/s/shm rw,nosuid shared:9 - tmpfs tmpfs rw,size=65536k\n",
    )
    .unwrap();
    host_sees_in(shm, init.path()).unwrap();
    // The same namespace as this process: nothing to compare.
    let same = tempfile::tempdir().unwrap();
    fs::create_dir(same.path().join("ns")).unwrap();
    std::os::unix::fs::symlink(
        fs::read_link("/proc/self/ns/mnt").unwrap(),
        same.path().join("ns/mnt"),
    )
    .unwrap();
    host_sees_in(shm, same.path()).unwrap();
}

#[test]
fn a_client_is_terminated_through_its_server_and_nothing_else_is() {
    if !crate::test_root::require_root(
        "a_client_is_terminated_through_its_server_and_nothing_else_is",
    ) {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    // Two servers (one per client uid), each with its clients.
    fs::write(pipe.join("fake-servers"), "4242\n4343\n").unwrap();
    fs::write(pipe.join("fake-clients-4242"), "500\n501\n").unwrap();
    fs::write(pipe.join("fake-clients-4343"), "600\n").unwrap();
    assert!(d.terminate_client(SHARE, 600).unwrap());
    assert!(d.terminate_client(SHARE, 501).unwrap());
    assert_eq!(
        fs::read_to_string(pipe.join("fake-terminated")).unwrap(),
        "600\n501\n",
        "each through the server that lists it"
    );
    assert_eq!(
        fs::read_to_string(pipe.join("fake-clients-4242")).unwrap(),
        "500\n"
    );
    // No server has it: nothing is sent, and the caller hears so.
    assert!(!d.terminate_client(SHARE, 777).unwrap());
    assert!(!d.terminate_client("another-share", 500).unwrap());
    // A server that still lists the client after terminate_client holds its memory:
    // said as such, with the server's answer, for the caller to stop the process.
    fs::write(pipe.join("fake-terminate-holds"), "").unwrap();
    match d.terminate_client(SHARE, 500) {
        Err(GpuError::MpsClientHeld {
            server: 4242,
            client: 500,
            answer,
        }) => assert_eq!(answer, "0"),
        other => panic!("{other:?}"),
    }
    fs::remove_file(pipe.join("fake-terminate-holds")).unwrap();
    // A list the build cannot read is an error, not a guess.
    fs::write(pipe.join("fake-clients-4242"), "Server busy\n").unwrap();
    assert!(matches!(
        d.terminate_client(SHARE, 500),
        Err(GpuError::Internal(_))
    ));
    d.stop(SHARE).unwrap();
}

#[test]
fn pid_lists_parse_or_fail_whole() {
    assert_eq!(parse_pids("12\n13 14\n", "x").unwrap(), vec![12, 13, 14]);
    assert_eq!(parse_pids("", "x").unwrap(), Vec::<u32>::new());
    assert!(parse_pids("12\nno\n", "get_client_list").is_err());
}

/// The pipe directory, which the share's containers write, is a tmpfs of its own capped
/// in bytes and files, so a tenant cannot fill the host's /run through it; it stays
/// across a daemon restart (the new daemon's socket is there for the containers that
/// hold it) and goes with the share.
#[test]
fn the_pipe_directory_is_a_small_tmpfs_of_its_own_kept_across_restarts() {
    if !crate::test_root::require_root(
        "the_pipe_directory_is_a_small_tmpfs_of_its_own_kept_across_restarts",
    ) {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pipe = d.pipe_dir(SHARE);
    assert_eq!(tmpfs_mounts(&pipe), 1, "a tmpfs of its own");
    assert_eq!(shm_size(&pipe).unwrap(), PIPE_BYTES);
    let files = nix::sys::statvfs::statvfs(&pipe).unwrap().files();
    assert_eq!(files, PIPE_INODES);
    let real = fs::canonicalize(&pipe).unwrap();
    let opts = mounts_at(&real).unwrap().pop().unwrap().options;
    for o in ["nosuid", "nodev", "noexec"] {
        assert!(opts.split(',').any(|x| x == o), "{o} missing in {opts}");
    }
    assert_eq!(
        fs::metadata(&pipe).unwrap().permissions().mode() & 0o7777,
        0o1777
    );
    // A tenant's bytes and files stop at the caps.
    let err = fs::write(pipe.join("big"), vec![0u8; 5 << 20]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(28), "ENOSPC: {err}");
    fs::remove_file(pipe.join("big")).unwrap();
    let mut made = 0;
    let err = loop {
        match fs::write(pipe.join(format!("f{made}")), "") {
            Ok(()) => made += 1,
            Err(e) => break e,
        }
        assert!(made <= PIPE_INODES, "no cap on files");
    };
    assert_eq!(
        err.raw_os_error(),
        Some(28),
        "ENOSPC after {made} files: {err}"
    );
    for i in 0..made {
        fs::remove_file(pipe.join(format!("f{i}"))).unwrap();
    }

    // A daemon that died is replaced on the same tmpfs, and its socket is there.
    let old = pid_of(&d, SHARE);
    kill9(old);
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert_ne!(pid_of(&d, SHARE), old);
    assert_eq!(tmpfs_mounts(&pipe), 1);
    assert_eq!(
        crate::sys::listener_pid(&pipe.join("control")).unwrap(),
        pid_of(&d, SHARE)
    );

    d.stop(SHARE).unwrap();
    assert!(!pipe.exists());
    assert!(mounts_at(&real).unwrap().is_empty(), "nothing left mounted");
}

/// Root in the host's user namespace is told from root inside a user namespace and from
/// another uid: only the first owns a pipe directory whatever its mode.
#[test]
fn root_is_told_apart_from_root_in_a_user_namespace_and_other_uids() {
    if !crate::test_root::require_root(
        "root_is_told_apart_from_root_in_a_user_namespace_and_other_uids",
    ) {
        return;
    }
    let spawn = |argv: &[&str]| {
        let mut child = Command::new(argv[0])
            .args(&argv[1..])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Each prints once it runs as it should, then sleeps.
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
            &mut line,
        )
        .unwrap();
        child
    };
    let ready = "echo ready; exec sleep 100";
    let mut plain = spawn(&["sh", "-c", ready]);
    let mut userns = spawn(&["unshare", "--user", "--map-root-user", "sh", "-c", ready]);
    let mut nobody = spawn(&[
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "sh",
        "-c",
        ready,
    ]);
    let got = [&plain, &userns, &nobody].map(|c| root_without_user_namespace(c.id()));
    for c in [&mut plain, &mut userns, &mut nobody] {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert_eq!(got, [true, false, false]);
    assert!(!root_without_user_namespace(u32::MAX), "no such process");
}

/// The probe serves a share for real before it says MPS is supported: a tmpfs under the
/// base directory (which the host must see: `host_sees`, tested on its own below), and
/// a control program that runs. What it tried is gone afterwards.
#[test]
fn probe_tries_a_share_and_leaves_nothing() {
    if !crate::test_root::require_root("probe_tries_a_share_and_leaves_nothing") {
        return;
    }
    let root = Root::new();
    assert_eq!(root.daemons().probe(), Support::Supported);
    let left: Vec<_> = fs::read_dir(root.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(
        mounts_at(&fs::canonicalize(root.dir.path()).unwrap())
            .unwrap()
            .is_empty()
    );

    // A control program whose libraries do not load.
    let broken = root.dir.path().join("broken-control");
    fs::write(
        &broken,
        "#!/bin/sh\necho 'nvidia-cuda-mps-control: error while loading shared libraries: libcuda.so.1' >&2\nexit 127\n",
    )
    .unwrap();
    fs::set_permissions(&broken, fs::Permissions::from_mode(0o755)).unwrap();
    match root.daemons_with(broken, Duration::from_secs(5)).probe() {
        Support::Unsupported(why) => assert!(why.contains("does not run"), "{why}"),
        Support::Supported => panic!("a control program that cannot start"),
    }
}

/// The daemon runs outside the cgroups of the process that started it (the agent), in
/// the share daemons' cgroup; one found back in its starter's cgroup (an agent killed
/// before it moved it, or an earlier version's) is moved out by the next read-back.
#[test]
fn the_daemon_runs_outside_its_starters_cgroup_and_is_taken_out_again() {
    if !crate::test_root::require_root(
        "the_daemon_runs_outside_its_starters_cgroup_and_is_taken_out_again",
    ) {
        return;
    }
    let root = Root::new();
    let d = root.daemons();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    let pid = pid_of(&d, SHARE);
    let v2_line = |pid: u32| -> String {
        fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("0::").map(str::to_owned))
            .unwrap()
    };
    let ours = v2_line(std::process::id());
    assert_eq!(v2_line(pid), format!("/{}", root.cgroup()));
    assert_ne!(v2_line(pid), ours);

    // Back into the test's own cgroup, as if its starter had died before moving it.
    let mount =
        crate::cgroupns::cgroup_mounts(&fs::read_to_string("/proc/self/mountinfo").unwrap())
            .into_iter()
            .find(|m| m.v2 && m.root == "/")
            .unwrap();
    let own = mount.point.join(ours.trim_start_matches('/'));
    fs::write(own.join("cgroup.procs"), pid.to_string()).unwrap();
    assert_eq!(v2_line(pid), ours);
    assert!(d.limit(SHARE).unwrap().unwrap().admits(1 << 30));
    assert_eq!(
        v2_line(pid),
        format!("/{}", root.cgroup()),
        "taken out again"
    );
    d.stop(SHARE).unwrap();
}
