//! The MPS manager against `tests/fixtures/simulated-nvidia-cuda-mps-control`, a
//! simulation of NVIDIA's control program: real processes, real files, real waits.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tempfile::TempDir;

use super::*;

const UUID: &str = "GPU-5f0c1e2a-0000-4000-8000-000000000001";
const SHARE: &str = "0b6c3f6e-3a1d-4d0b-9a51-1f2b3c4d5e6f";

fn simulated_control() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/simulated-nvidia-cuda-mps-control")
}

/// A root for the share directories that kills every daemon found below it on drop, so
/// a failing test leaves no process behind.
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
        MpsDaemons::new(MpsConfig {
            control,
            dir: self.dir.path().to_path_buf(),
            timeout,
            launcher: Vec::new(),
        })
        .expect("a short absolute dir")
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let Ok(entries) = fs::read_dir(self.dir.path()) else {
            return;
        };
        for e in entries.flatten() {
            if let Ok(pid) = fs::read_to_string(e.path().join("pipe").join(PID_FILE)) {
                let _ = Command::new("kill").arg(pid.trim()).status();
            }
        }
    }
}

fn pid_of(d: &MpsDaemons, key: &str) -> u32 {
    fs::read_to_string(d.pipe_dir(key).join(PID_FILE))
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid")
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
    assert_eq!(root.daemons().probe(), Support::Supported);
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
        fs::metadata(&pipe).unwrap().permissions().mode() & 0o777,
        0o755
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
    assert!(
        Command::new("kill")
            .arg("-9")
            .arg(pid.to_string())
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while process_alive(pid) {
        assert!(
            std::time::Instant::now() < deadline,
            "kill -9 did not end {pid}"
        );
        std::thread::sleep(POLL);
    }
    assert_eq!(d.limit(SHARE).unwrap(), None);
    let leftover = d.pipe_dir(SHARE).join("control");
    fs::write(&leftover, "").unwrap();
    d.ensure_limit(UUID, SHARE, 1 << 30).unwrap();
    assert_ne!(pid_of(&d, SHARE), pid, "a new daemon");
    assert!(
        !leftover.exists(),
        "the dead daemon's files went before the new one started"
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
        expect_silence(answer),
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
