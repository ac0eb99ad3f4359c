//! The `mps` mechanism: one MPS control daemon per share, whose default pinned device
//! memory limit is the share's memory.
//!
//! Why one daemon per share: MPS keeps one pinned-memory limit per *server*, and a
//! control daemon runs servers for the clients that reach it through its pipe directory.
//! A client can lower its own limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`), never raise
//! it, but nothing outside the client can read that lower value back. With a daemon per
//! share the limit lives in the daemon, where `get_default_device_pinned_mem_limit`
//! reads it back, and the share's containers reach only their own daemon: the CDI spec
//! mounts that pipe directory alone. Several daemons on one GPU need the GPU's compute
//! mode to be DEFAULT (the NVML back end's probe checks it).
//!
//! Layout, all under [`MpsConfig::dir`] (default `/run/shareguard/mps`):
//!
//! ```text
//! <dir>/<name>/key     the full share key (a guard against two keys on one name)
//! <dir>/<name>/gpu     the GPU uuid the daemon was started for
//! <dir>/<name>/pipe/   CUDA_MPS_PIPE_DIRECTORY: sockets, nvidia-cuda-mps-control.pid
//! <dir>/<name>/shm/    the daemon's and the containers' /dev/shm (bind mounts)
//! <dir>/<name>/log/    CUDA_MPS_LOG_DIRECTORY
//! ```
//!
//! The daemon runs in a mount namespace of its own (util-linux `unshare`, which needs
//! CAP_SYS_ADMIN and a mount() the agent's systemd sandbox forbids: there, use the
//! launcher) so that its `/dev/shm` is the share's `shm/`, as NVIDIA's device plugin
//! gives its MPS daemon and clients a tmpfs of their own.
//!
//! `<name>` is the share key when it is short and plain (share ids are UUIDs), else a
//! stable hash of it, because the daemon's socket paths must fit a unix socket's 108
//! bytes. The daemon is started with `CUDA_VISIBLE_DEVICES=<uuid>`, so device 0 in its
//! commands is the share's GPU.
//!
//! Where the daemon runs: started directly (`-d`), it is a child of the agent, inside
//! the agent's cgroup and, under systemd, its sandbox (seccomp filter, W^X), which NVIDIA's
//! server may not tolerate, and a restart of the unit ends it. With
//! [`MpsConfig::launcher`] set (for example `systemd-run --collect
//! --unit=shareguard-mps-{name} --`) it runs in the foreground (`-f`) under that
//! launcher instead: its own unit, which outlives agent restarts, so the containers'
//! connections and the limit stay while the agent is away, as tc and BPF state does for
//! bandwidth. Either way a daemon that is gone is drift the reconciler repairs.
//!
//! Nothing here has run against NVIDIA's control program: the tests drive
//! `tests/fixtures/simulated-nvidia-cuda-mps-control`, a simulation of it, and
//! `tests/gpu/run-on-gpu.sh` is the check for a machine with a GPU.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::backend::{MpsLimit, Support};
use crate::error::GpuError;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The pid file NVIDIA's control daemon writes into its pipe directory.
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The longest `dir` accepted: with a 36-byte name, `/pipe/` and the daemon's longest
/// socket name (about 20 bytes) the path stays under the 108 bytes of `sun_path`.
pub const MAX_DIR_LEN: usize = 40;
/// The longest share key used as a directory name as it is (a UUID is 36).
const MAX_PLAIN_NAME: usize = 36;
/// How often a wait for the daemon re-checks its condition.
const POLL: Duration = Duration::from_millis(5);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsConfig {
    /// NVIDIA's control program.
    pub control: PathBuf,
    /// Where the per-share daemon directories live.
    pub dir: PathBuf,
    /// How long one control command, a daemon start or a stop may take.
    pub timeout: Duration,
    /// A command the daemon is started under, in the foreground; `{name}` in an
    /// argument becomes the share's directory name. Empty: started directly with `-d`.
    pub launcher: Vec<String>,
}

impl Default for MpsConfig {
    fn default() -> Self {
        Self {
            control: PathBuf::from("/usr/bin/nvidia-cuda-mps-control"),
            dir: PathBuf::from("/run/shareguard/mps"),
            timeout: Duration::from_secs(10),
            launcher: Vec::new(),
        }
    }
}

/// The per-share MPS control daemons of one node.
#[derive(Debug)]
pub struct MpsDaemons {
    cfg: MpsConfig,
}

impl MpsDaemons {
    pub fn new(cfg: MpsConfig) -> Result<Self, GpuError> {
        let len = cfg.dir.as_os_str().len();
        if !cfg.dir.is_absolute() || len > MAX_DIR_LEN {
            return Err(GpuError::InvalidArgument(format!(
                "MPS directory {} must be an absolute path of at most {MAX_DIR_LEN} bytes \
                 (the daemon's sockets live below it), not {len}",
                cfg.dir.display()
            )));
        }
        Ok(Self { cfg })
    }

    pub fn config(&self) -> &MpsConfig {
        &self.cfg
    }

    /// Whether the control program is there to run; the GPU-side conditions (compute
    /// mode, MIG) are the back end's to check.
    pub fn probe(&self) -> Support {
        let c = &self.cfg.control;
        match fs::metadata(c) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Support::Supported,
            Ok(_) => Support::Unsupported(format!("{} is not an executable file", c.display())),
            Err(e) => Support::Unsupported(format!(
                "{} not found ({e}): NVIDIA's MPS control program is needed",
                c.display()
            )),
        }
    }

    /// The directory a share's containers get as `CUDA_MPS_PIPE_DIRECTORY`.
    pub fn pipe_dir(&self, share_key: &str) -> PathBuf {
        self.share_dir(share_key).join("pipe")
    }

    /// The directory a share's containers get as `/dev/shm`: the daemon's `/dev/shm`.
    pub fn shm_dir(&self, share_key: &str) -> PathBuf {
        self.share_dir(share_key).join("shm")
    }

    /// Both directories, as a CDI spec needs them.
    pub fn dirs(&self, share_key: &str) -> shareguard_common::limiter::MpsDirs {
        shareguard_common::limiter::MpsDirs {
            pipe: self.pipe_dir(share_key),
            shm: self.shm_dir(share_key),
        }
    }

    /// Starts the share's daemon if it is not running and sets its limit, on the
    /// default (for servers yet to start) and on every running server.
    pub fn ensure_limit(&self, uuid: &str, share_key: &str, bytes: u64) -> Result<(), GpuError> {
        let value = mib_value(bytes)?;
        let dir = self.share_dir(share_key);
        self.prepare_dir(&dir, share_key)?;
        let pipe = dir.join("pipe");
        let recorded_gpu = fs::read_to_string(dir.join("gpu")).ok();
        let mut running = daemon_pid(&pipe, &self.cfg.control);
        if let Some(pid) = running
            && recorded_gpu.as_deref() != Some(uuid)
        {
            // Started for another GPU (a recycled name, or a config change): its device 0
            // is the wrong GPU, so it must go before a new one starts.
            self.quit(&pipe, pid)?;
            running = None;
        }
        write_file(&dir.join("gpu"), uuid)?;
        if running.is_none() {
            self.start(uuid, &dir)?;
        }
        self.command(
            &pipe,
            &format!("set_default_device_pinned_mem_limit 0 {value}"),
        )
        .and_then(expect_silence)?;
        for pid in self.servers(&pipe)? {
            self.command(
                &pipe,
                &format!("set_device_pinned_mem_limit {pid} 0 {value}"),
            )
            .and_then(expect_silence)?;
        }
        Ok(())
    }

    /// The limit the share's daemon holds: None when no daemon runs for it. Where a
    /// running server holds another limit than the default, that one is returned, since
    /// it is what the share's processes get.
    pub fn limit(&self, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        let pipe = self.pipe_dir(share_key);
        if daemon_pid(&pipe, &self.cfg.control).is_none() {
            return Ok(None);
        }
        let default = parse_shown(&self.command(&pipe, "get_default_device_pinned_mem_limit 0")?)?;
        for pid in self.servers(&pipe)? {
            let shown = parse_shown(
                &self.command(&pipe, &format!("get_device_pinned_mem_limit {pid} 0"))?,
            )?;
            if shown != default {
                return Ok(Some(shown));
            }
        }
        Ok(Some(default))
    }

    /// Ends the share's daemon and removes its directory; nothing left is success.
    pub fn stop(&self, share_key: &str) -> Result<(), GpuError> {
        let dir = self.share_dir(share_key);
        if !dir.exists() {
            return Ok(());
        }
        check_owner(&dir, share_key)?;
        let pipe = dir.join("pipe");
        if let Some(pid) = daemon_pid(&pipe, &self.cfg.control) {
            self.quit(&pipe, pid)?;
        }
        fs::remove_dir_all(&dir).map_err(|e| io_err("removing", &dir, &e))
    }

    fn share_dir(&self, share_key: &str) -> PathBuf {
        self.cfg.dir.join(dir_name(share_key))
    }

    fn prepare_dir(&self, dir: &Path, share_key: &str) -> Result<(), GpuError> {
        for d in [dir.join("pipe"), dir.join("log"), dir.join("shm")] {
            fs::create_dir_all(&d).map_err(|e| io_err("creating", &d, &e))?;
        }
        // Containers of any uid connect through the pipe directory and create their
        // segments in the shared /dev/shm (sticky, as /dev/shm is); the log is the agent's.
        set_mode(&dir.join("pipe"), 0o755)?;
        set_mode(&dir.join("shm"), 0o1777)?;
        set_mode(&dir.join("log"), 0o700)?;
        if check_owner(dir, share_key)? {
            Ok(())
        } else {
            write_file(&dir.join("key"), share_key)
        }
    }

    fn start(&self, uuid: &str, dir: &Path) -> Result<(), GpuError> {
        let pipe = dir.join("pipe");
        // What a dead daemon left (its pid file, sockets a new one could not bind over)
        // goes first; its log stays for whoever looks into why it died.
        for e in fs::read_dir(&pipe).map_err(|e| io_err("reading", &pipe, &e))? {
            let path = e.map_err(|e| io_err("reading", &pipe, &e))?.path();
            let removed = if path.is_dir() {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            removed.map_err(|e| io_err("removing", &path, &e))?;
        }
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // The daemon's sockets must be reachable by containers of any uid, whatever
        // umask the agent runs with (the systemd unit's is 0077); `sh` sets it without
        // unsafe code in this process.
        let mut argv: Vec<String> = vec![
            "-c".into(),
            "umask 022 && exec \"$@\"".into(),
            "shareguard-mps-start".into(),
        ];
        let mode = if self.cfg.launcher.is_empty() {
            "-d"
        } else {
            argv.extend(self.cfg.launcher.iter().map(|a| a.replace("{name}", &name)));
            "-f"
        };
        // MPS clients and their server meet in /dev/shm as well as in the pipe
        // directory, so the daemon (and the servers it starts) gets the share's own shm
        // directory as /dev/shm, in a mount namespace of its own; the CDI spec mounts the
        // same directory at the containers' /dev/shm. Nothing of the host's /dev/shm is
        // shared with a pod, nor one share's with another's.
        argv.extend(with_shm(&dir.join("shm")));
        argv.push(self.cfg.control.to_string_lossy().into_owned());
        argv.push(mode.into());
        let args: Vec<&str> = argv.iter().map(String::as_str).collect();
        let out = self.spawn(
            Path::new("/bin/sh"),
            &pipe,
            Some((uuid, &dir.join("log"))),
            &args,
            None,
        )?;
        if !out.success {
            return Err(GpuError::Transient(format!(
                "starting the MPS control daemon for {uuid} ({} {mode}{}): {}",
                self.cfg.control.display(),
                if self.cfg.launcher.is_empty() {
                    ""
                } else {
                    " under the launcher"
                },
                out.describe()
            )));
        }
        if self.wait_until(|| daemon_pid(&pipe, &self.cfg.control).is_some()) {
            return Ok(());
        }
        Err(GpuError::Transient(format!(
            "the MPS control daemon in {} did not come up within {:?}; see its log in {}",
            pipe.display(),
            self.cfg.timeout,
            dir.join("log").display()
        )))
    }

    /// Asks the running daemon `pid` to quit and waits until its process is gone.
    fn quit(&self, pipe: &Path, pid: u32) -> Result<(), GpuError> {
        self.command(pipe, "quit")?;
        if self.wait_until(|| !process_alive(pid)) {
            return Ok(());
        }
        Err(GpuError::Transient(format!(
            "the MPS control daemon {pid} in {} did not quit within {:?}",
            pipe.display(),
            self.cfg.timeout
        )))
    }

    /// Waits up to the configured timeout for `done`; false when it never was.
    fn wait_until(&self, done: impl Fn() -> bool) -> bool {
        let deadline = Instant::now() + self.cfg.timeout;
        loop {
            if done() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(POLL);
        }
    }

    fn servers(&self, pipe: &Path) -> Result<Vec<u32>, GpuError> {
        let text = self.command(pipe, "get_server_list")?;
        text.split_whitespace()
            .map(|w| {
                w.parse::<u32>().map_err(|_| {
                    GpuError::Internal(format!("get_server_list answered {text:?}, not PIDs"))
                })
            })
            .collect()
    }

    /// One control command; its standard output on success.
    fn command(&self, pipe: &Path, cmd: &str) -> Result<String, GpuError> {
        let out = self.run(pipe, cmd)?;
        if !out.success {
            return Err(GpuError::Transient(format!(
                "MPS control `{cmd}` in {}: {}",
                pipe.display(),
                out.describe()
            )));
        }
        Ok(out.stdout)
    }

    fn run(&self, pipe: &Path, input: &str) -> Result<Output, GpuError> {
        self.spawn(&self.cfg.control, pipe, None, &[], Some(input))
    }

    fn spawn(
        &self,
        program: &Path,
        pipe: &Path,
        daemon: Option<(&str, &Path)>,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<Output, GpuError> {
        let mut c = Command::new(program);
        c.args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((uuid, log)) = daemon {
            c.env("CUDA_VISIBLE_DEVICES", uuid)
                .env("CUDA_MPS_LOG_DIRECTORY", log)
                // The daemon must not hold the agent's pipes open after `-d` returns.
                .stdout(Stdio::null())
                .stderr(Stdio::null());
        }
        let what = || format!("{} {}", program.display(), args.join(" "));
        let mut child = c
            .spawn()
            .map_err(|e| GpuError::Unavailable(format!("cannot run {}: {e}", program.display())))?;
        if let Some(mut stdin) = child.stdin.take() {
            let line = input.map(|s| format!("{s}\n")).unwrap_or_default();
            // A control program that exits before reading is reported by its status.
            let _ = stdin.write_all(line.as_bytes());
        }
        let deadline = Instant::now() + self.cfg.timeout;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(GpuError::Transient(format!(
                        "{} did not answer within {:?}",
                        what(),
                        self.cfg.timeout
                    )));
                }
                Ok(None) => std::thread::sleep(POLL),
                Err(e) => return Err(GpuError::Internal(format!("waiting for {}: {e}", what()))),
            }
        };
        // The answers are a line or a few PIDs, far below a pipe's buffer, so reading
        // after the exit cannot have blocked the program.
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut stdout);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut stderr);
        }
        Ok(Output {
            success: status.success(),
            code: status.code(),
            stdout,
            stderr,
        })
    }
}

struct Output {
    success: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Output {
    fn describe(&self) -> String {
        let code = self.code.map_or("a signal".to_string(), |c| c.to_string());
        format!("exit {code}: {} {}", self.stdout.trim(), self.stderr.trim())
            .trim_end()
            .to_string()
    }
}

/// The command prefix that runs what follows it in a mount namespace of its own, with
/// `shm` as its `/dev/shm` (util-linux `unshare` and `mount`; needs CAP_SYS_ADMIN). The
/// process keeps its PID: both `exec`.
pub fn with_shm(shm: &Path) -> Vec<String> {
    [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "/bin/sh",
        "-c",
        "mount --bind \"$1\" /dev/shm && shift && exec \"$@\"",
        "shareguard-mps-shm",
    ]
    .map(String::from)
    .into_iter()
    .chain([shm.to_string_lossy().into_owned()])
    .collect()
}

/// A set command answers nothing; any text is the daemon refusing it.
fn expect_silence(out: String) -> Result<(), GpuError> {
    if out.trim().is_empty() {
        Ok(())
    } else {
        Err(GpuError::InvalidArgument(format!(
            "MPS control refused the limit: {}",
            out.trim()
        )))
    }
}

/// The directory name for a share key: the key itself when short and made of
/// `[A-Za-z0-9._-]` (not starting with '.'), else `h-` and a 64-bit FNV-1a hash of it,
/// which is stable across builds (std's hasher is not).
pub fn dir_name(share_key: &str) -> String {
    let plain = !share_key.is_empty()
        && share_key.len() <= MAX_PLAIN_NAME
        && !share_key.starts_with('.')
        && !share_key.starts_with("h-")
        && share_key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if plain {
        return share_key.to_string();
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in share_key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("h-{h:016x}")
}

/// A limit as the control program takes it: whole MiB, rounded down so that the share
/// never gets more than it was given.
pub fn mib_value(bytes: u64) -> Result<String, GpuError> {
    let mib = bytes / MIB;
    if mib == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "{bytes} bytes is below the 1 MiB an MPS limit can express"
        )));
    }
    Ok(format!("{mib}M"))
}

/// The bytes an MPS limit of `bytes` really is (see [`mib_value`]).
pub fn enforceable_bytes(bytes: u64) -> u64 {
    bytes / MIB * MIB
}

/// Parses a limit as the control program shows it: `<n>M`, or `<n>G` where the driver
/// shows a limit of 1 GiB or more rounded down to whole GiB.
pub fn parse_shown(text: &str) -> Result<MpsLimit, GpuError> {
    let t = text.trim();
    let bad = || GpuError::Internal(format!("MPS control showed the limit as {t:?}"));
    let (digits, unit) = match t.char_indices().last() {
        Some((i, 'M')) => (&t[..i], MIB),
        Some((i, 'G')) => (&t[..i], GIB),
        _ => return Err(bad()),
    };
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n.checked_mul(unit).ok_or_else(bad)?;
    Ok(MpsLimit {
        bytes,
        granularity: unit,
    })
}

/// The PID in the pipe directory's pid file, if that process is alive and is the
/// control program (not a PID reused after the daemon died).
fn daemon_pid(pipe: &Path, control: &Path) -> Option<u32> {
    let pid: u32 = fs::read_to_string(pipe.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if !process_alive(pid) {
        return None;
    }
    let name = control.file_name()?.to_string_lossy().into_owned();
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    // argv[0] for the program itself; argv[1] where an interpreter runs it.
    let is_control = cmdline.split(|b| *b == 0).take(2).any(|arg| {
        Path::new(&*String::from_utf8_lossy(arg))
            .file_name()
            .is_some_and(|f| f.to_string_lossy() == name)
    });
    is_control.then_some(pid)
}

/// True while the process exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses, which may hold spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Whether `dir` is recorded as `share_key`'s (false: no record yet); an error when it
/// belongs to another share, whose daemon must never be touched for this one.
fn check_owner(dir: &Path, share_key: &str) -> Result<bool, GpuError> {
    match fs::read_to_string(dir.join("key")) {
        Ok(k) if k == share_key => Ok(true),
        Ok(k) => Err(GpuError::Internal(format!(
            "{} belongs to share {k:?}, not {share_key:?}",
            dir.display()
        ))),
        Err(_) => Ok(false),
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), GpuError> {
    fs::write(path, text).map_err(|e| io_err("writing", path, &e))
}

fn set_mode(path: &Path, mode: u32) -> Result<(), GpuError> {
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| io_err("setting the mode of", path, &e))
}

fn io_err(what: &str, path: &Path, e: &std::io::Error) -> GpuError {
    GpuError::Transient(format!("{what} {}: {e}", path.display()))
}

#[cfg(test)]
#[path = "mps_tests.rs"]
pub(crate) mod tests;
