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
//! Layout, all under [`MpsConfig::dir`] (default `/run/shareguard-mps`, beside and not
//! inside the socket's directory: the kubelet plugin mounts that one, and has no business
//! with the daemons' pipes, logs and tenants' shm; and the socket's directory is 0750,
//! which an MPS server running as its client's uid could not pass through):
//!
//! ```text
//! <dir>/<name>/        0711: only the agent lists or writes it; MPS servers, which run
//!                      as their client's uid, can still pass through to pipe/
//! <dir>/<name>/key     the full share key (a guard against two keys on one name)
//! <dir>/<name>/gpu     the GPU uuid the daemon was started for
//! <dir>/<name>/daemon  the agent's record of the daemon it started: pid, start time, boot
//! <dir>/<name>/pipe/   CUDA_MPS_PIPE_DIRECTORY: sockets, nvidia-cuda-mps-control.pid;
//!                      a tmpfs of PIPE_BYTES and PIPE_INODES, 1777 (sticky), and
//!                      read-write in the share's containers
//! <dir>/<name>/shm/    a tmpfs of MpsConfig::shm_bytes: the daemon's and the
//!                      containers' /dev/shm (bind mounts)
//! <dir>/<name>/log/    CUDA_MPS_LOG_DIRECTORY, 1777 (sticky)
//! ```
//!
//! Why those two are open to every uid: the control daemon starts one MPS server per
//! client uid, running as that uid, which must reach the pipe directory and write its log;
//! and clients create their own files in the pipe directory, which is why NVIDIA's
//! components (its device plugin, its DRA driver) mount it read-write into containers.
//! The sticky bit keeps anyone but their owner (the daemon, root) from removing or
//! replacing the daemon's sockets and pid file; `log/` is mounted into no container.
//!
//! The daemon runs in a mount namespace of its own (util-linux `unshare`, which needs
//! CAP_SYS_ADMIN and a mount() the agent's systemd sandbox forbids: there, use the
//! launcher) so that its `/dev/shm` is the share's `shm/`, as NVIDIA's device plugin
//! gives its MPS daemon and clients a tmpfs of their own.
//!
//! `shm/` and `pipe/` are tmpfs of their own, capped (`shm/` at [`MpsConfig::shm_bytes`],
//! `pipe/` at [`PIPE_BYTES`] and [`PIPE_INODES`] files), because the share's containers
//! write to them: as plain directories they would let a tenant fill the file system
//! under `<dir>` (the host's `/run`, in memory, which containerd and kubelet need).
//! Each is mounted (nosuid, nodev, noexec, mode 1777) in the agent's mount namespace when the share is
//! prepared, kept while the share lives (also across a daemon restart: the containers
//! that hold it must keep meeting the new daemon there), and detached before the
//! share's directory is removed. The container runtime resolves the CDI spec's host
//! paths in the host's mount namespace, so the agent must run in it, or `<dir>` must
//! propagate to it (a DaemonSet needs `mountPropagation: Bidirectional` there, as
//! NVIDIA's device plugin has for its `/run/nvidia/mps`); where pid 1's namespace is
//! another one and does not show the tmpfs, the share fails with that reason rather
//! than hand its containers the bare directory.
//!
//! What the agent trusts, given that tenants share `pipe/` and `shm/` with the daemon:
//!
//! - `pipe/` is the agent's, sticky, and mounted read-write into the share's containers
//!   alone: a tenant that is not root can add files there but can neither remove nor
//!   replace the daemon's. Nothing in it is trusted for what it says: before every
//!   command sent through it the agent checks the directory (its owner, and no write for
//!   others without the sticky bit), that the daemon's `control` socket, where it is,
//!   is a socket of the agent's uid, and that the process the kernel names as listening
//!   on it (SO_PEERCRED) is the recorded daemon, so that a socket a tenant serves (one
//!   running as root can make one of root's) is never taken for the daemon. What is
//!   left open: a root tenant could put its socket there between that check and the
//!   control program's own connect.
//! - The daemon the agent started is the process the kernel names as listening on
//!   `control` right after the start, taken only if it is a live control program whose
//!   environment has this very pipe directory; the pid file plays no part. From then on
//!   the agent goes by its own record (`daemon`, in the share's directory, which is
//!   mounted nowhere): the pid, its start time (field 22 of /proc/PID/stat) and the
//!   boot id. A process is the share's daemon while all three match and its `argv[0]`
//!   is the control program, so a recycled pid is never taken for it. The agent never
//!   signals the daemon: it sends `quit` through the socket and waits for the recorded
//!   process to end.
//! - Nothing in `shm/` is read by the agent; `log/` is the agent's and the daemon's.
//! - `key`, `gpu` and `daemon` are written atomically (a temp file in the same
//!   directory, fsync, rename over, fsync of the directory), so a crash leaves the old
//!   file or the new one, and a temp file that a dead agent process left is removed
//!   the next time the share is prepared.
//!
//! `<name>` is the share key when it is short and plain (share ids are UUIDs), else a
//! stable hash of it, because the daemon's socket paths must fit a unix socket's 108
//! bytes. The daemon is started with `CUDA_VISIBLE_DEVICES=<uuid>`, so device 0 in its
//! commands is the share's GPU.
//!
//! Where the daemon runs: started directly (`-d`), it is moved out of the agent's cgroup
//! right away, with the servers it starts ([`crate::mps_cgroup`]), so that tearing the
//! agent's container down or stopping its unit ends no tenant's daemon; the restarted
//! agent takes it back by its record. Under systemd it still starts inside the unit's
//! sandbox (seccomp filter, W^X), which NVIDIA's server may not tolerate: with
//! [`MpsConfig::launcher`] set (for example `systemd-run --collect
//! --unit=shareguard-mps-{name} --`) it runs in the foreground (`-f`) under that
//! launcher instead, in its own unit. Either way the containers' connections and the
//! limit stay while the agent is away, as tc and BPF state does for bandwidth, and a
//! daemon that is gone is drift the reconciler repairs.
//!
//! Nothing here has run against NVIDIA's control program: the tests drive
//! `tests/fixtures/simulated-nvidia-cuda-mps-control`, a simulation of it, and
//! `tests/gpu/run-on-gpu.sh` is the check for a machine with a GPU.

mod answers;
mod control;
mod dirs;
mod files;
mod process;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::MsFlags;

pub use answers::*;
use files::*;
pub use process::*;

use crate::backend::{MpsLimit, Support};
use crate::error::{GpuError, io_err};
use crate::mps_tmpfs::{host_sees, mount_err, mounts_at, unmount_shm};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The pid file NVIDIA's control daemon writes into its pipe directory.
const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The socket NVIDIA's control daemon listens on in its pipe directory (its log says
/// "Starting control daemon using socket <pipe>/control").
const CONTROL_SOCKET: &str = "control";
/// The agent's own record of the daemon it started, in the share's directory.
const RECORD: &str = "daemon";
/// The longest `dir` accepted: with a 36-byte name, `/pipe/` and the daemon's longest
/// socket name (about 20 bytes) the path stays under the 108 bytes of `sun_path`.
pub const MAX_DIR_LEN: usize = 40;
/// The longest share key used as a directory name as it is (a UUID is 36).
const MAX_PLAIN_NAME: usize = 36;
/// How often a wait for the daemon re-checks its condition.
const POLL: Duration = Duration::from_millis(5);
/// See [`MpsConfig::shm_bytes`]: the cap where the node's memory cannot be read,
/// what containerd gives a container's /dev/shm.
pub const FALLBACK_SHM_BYTES: u64 = 64 * MIB;
/// The cap of each share's pipe directory, a tmpfs of its own: the daemon's sockets
/// and pid file and what its clients add take a few KiB; the cap keeps a tenant from
/// filling the host's /run, which containerd and kubelet depend on.
pub const PIPE_BYTES: u64 = 4 * MIB;
/// The pipe directory's cap on files, for the same reason (a tmpfs's inodes are memory).
pub const PIPE_INODES: u64 = 1024;
/// A tenant's /dev/shm holds data, never programs or devices.
const SHM_FLAGS: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

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
    /// The size cap of each share's `/dev/shm`, the tmpfs its daemon and containers
    /// share, in bytes: a whole number of MiB (so it is a whole number of pages on every
    /// page size, and what is read back is what was set), at least one, since tmpfs
    /// takes `size=0` for no cap at all.
    ///
    /// The default is the node's memory ([`node_memory_bytes`]), so that no container
    /// of the share has a smaller /dev/shm than it would have had without MPS: the CDI
    /// spec's mount takes the place of whatever was at /dev/shm, which is containerd's
    /// 64 MiB, or an emptyDir of medium Memory that a pod mounts there for PyTorch's
    /// DataLoader workers or NCCL, sized up to the pod's memory limit or the node's
    /// allocatable memory. What bounds a tenant is then what bounds such an emptyDir:
    /// tmpfs pages are charged to the memory cgroup of the process that writes them, so
    /// the pod's memory limit counts them and kubelet's eviction sees them. A smaller
    /// cap also bounds pods without a memory limit, at the price of their /dev/shm.
    pub shm_bytes: u64,
    /// The cgroup at the top of the cgroup v2 hierarchy the daemons run in, outside the
    /// agent's (see [`crate::mps_cgroup`]); v1 hierarchies have them at their root.
    pub cgroup: String,
}

impl Default for MpsConfig {
    fn default() -> Self {
        Self {
            control: PathBuf::from("/usr/bin/nvidia-cuda-mps-control"),
            dir: PathBuf::from("/run/shareguard-mps"),
            timeout: Duration::from_secs(10),
            launcher: Vec::new(),
            shm_bytes: node_memory_bytes().unwrap_or(FALLBACK_SHM_BYTES),
            cgroup: crate::mps_cgroup::V2_CGROUP.to_owned(),
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
        let c = &cfg.cgroup;
        if c.is_empty()
            || c.len() > 64
            || c.starts_with('.')
            || !c
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(GpuError::InvalidArgument(format!(
                "MPS cgroup {c:?} must be one cgroup name of at most 64 letters, digits, '-', \
                 '_' and '.', not starting with '.'"
            )));
        }
        if cfg.shm_bytes == 0 || !cfg.shm_bytes.is_multiple_of(MIB) {
            return Err(GpuError::InvalidArgument(format!(
                "MPS shm size {} bytes must be a whole number of MiB, at least 1 MiB \
                 (tmpfs takes 0 for no cap at all)",
                cfg.shm_bytes
            )));
        }
        Ok(Self { cfg })
    }

    pub fn config(&self) -> &MpsConfig {
        &self.cfg
    }

    /// Whether the control program is there to run; the GPU-side conditions (compute
    /// mode, MIG) are the back end's to check.
    ///
    /// Then whether a share could be served here, tried on a directory of its own: a
    /// tmpfs mounted under [`MpsConfig::dir`] must be what the host's mount namespace
    /// shows there (else the runtime would hand containers the bare directory: an agent
    /// container without Bidirectional propagation), and the control program must run
    /// and answer. Until both hold the GPU does not get the mechanism, so it is not
    /// published as enforcing through it.
    pub fn probe(&self) -> Support {
        let c = &self.cfg.control;
        match fs::metadata(c) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
            Ok(_) => {
                return Support::Unsupported(format!("{} is not an executable file", c.display()));
            }
            Err(e) => {
                return Support::Unsupported(format!(
                    "{} not found ({e}): NVIDIA's MPS control program is needed",
                    c.display()
                ));
            }
        }
        match self.try_a_share() {
            Ok(()) => Support::Supported,
            Err(e) => Support::Unsupported(format!("a share could not be served: {e}")),
        }
    }

    /// A tmpfs on a directory of its own under the base directory, seen by the host,
    /// and the control program asked through it with no daemon behind it; everything
    /// removed again.
    fn try_a_share(&self) -> Result<(), GpuError> {
        let base = &self.cfg.dir;
        if !exists(base)? {
            create_dir(base, 0o711, true)?;
            set_mode(base, 0o711)?;
        }
        check_private_dir(base)?;
        // Dot-first: never a share's name (share_keys passes it by).
        let dir = base.join(format!(".probe-{}", std::process::id()));
        create_dir(&dir, 0o700, false)?;
        let tried = (|| {
            let real = fs::canonicalize(&dir).map_err(|e| io_err("resolving", &dir, &e))?;
            if mounts_at(&real)?.is_empty() {
                nix::mount::mount(
                    Some("tmpfs"),
                    &real,
                    Some("tmpfs"),
                    SHM_FLAGS,
                    Some("size=1m,mode=0700"),
                )
                .map_err(|e| mount_err("mounting a tmpfs on", &real, e))?;
            }
            host_sees(&real)?;
            // Nothing listens here: the program must start and say so. One that cannot
            // start (a library missing) exits 126 or 127, or the loader says why.
            let out = self.spawn(&self.cfg.control, &real, None, &[], Some("get_server_list"))?;
            if matches!(out.code, Some(126 | 127))
                || out.stderr.contains("error while loading shared libraries")
            {
                return Err(GpuError::Unavailable(format!(
                    "{} does not run: {}",
                    self.cfg.control.display(),
                    out.describe()
                )));
            }
            Ok(())
        })();
        let _ = unmount_shm(&dir);
        let _ = fs::remove_dir(&dir);
        tried
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
        let mut running = self.recorded_daemon(&dir);
        if let Some(daemon) = running
            && recorded_gpu.as_deref() != Some(uuid)
        {
            // Started for another GPU (a recycled name, or a config change): its device 0
            // is the wrong GPU, so it must go before a new one starts.
            self.quit(&dir, daemon)?;
            running = None;
        }
        write_atomic(&dir.join("gpu"), uuid)?;
        match running {
            Some(daemon) => self.keep_out(daemon.pid),
            None => self.start(uuid, &dir)?,
        }
        self.command(
            &pipe,
            &format!("set_default_device_pinned_mem_limit 0 {value}"),
        )
        .and_then(set_answer)?;
        for pid in self.servers(&pipe)? {
            self.command(
                &pipe,
                &format!("set_device_pinned_mem_limit {pid} 0 {value}"),
            )
            .and_then(set_answer)?;
        }
        Ok(())
    }

    /// The limit the share's daemon holds: None when no daemon runs for it. Where a
    /// running server holds another limit than the default, that one is returned, since
    /// it is what the share's processes get.
    pub fn limit(&self, share_key: &str) -> Result<Option<MpsLimit>, GpuError> {
        let dir = self.share_dir(share_key);
        if !exists(&dir)? {
            return Ok(None);
        }
        check_private_dir(&dir)?;
        let Some(daemon) = self.recorded_daemon(&dir) else {
            return Ok(None);
        };
        // A daemon found in the agent's cgroup (after a restart of an agent killed
        // before it moved it, or one an earlier version started) goes out now.
        self.keep_out(daemon.pid);
        let pipe = dir.join("pipe");
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

    /// Ends the GPU work of `client` through the share's daemon: `terminate_client` on
    /// the server that lists it as a client, then waits until no server lists it (the
    /// server has let go of its memory). Ok(false) when no server of the share's daemon
    /// has it as a client (or no daemon runs): the caller decides what that means.
    /// [`GpuError::MpsClientHeld`] when the server still lists it after the wait: on an
    /// H200 with driver 580 a client's memory stays held until its process exits, so
    /// the caller stops the process, which its ended GPU work makes safe.
    ///
    /// MPS, not a signal, because SIGKILL of a client while the server works for it can
    /// hang or corrupt the server's other clients.
    pub fn terminate_client(&self, share_key: &str, client: u32) -> Result<bool, GpuError> {
        let dir = self.share_dir(share_key);
        if !exists(&dir)? {
            return Ok(false);
        }
        check_owner(&dir, share_key)?;
        check_private_dir(&dir)?;
        if self.recorded_daemon(&dir).is_none() {
            return Ok(false);
        }
        let pipe = dir.join("pipe");
        let Some(server) = self.server_of(&pipe, client)? else {
            return Ok(false);
        };
        // The answer's wording is not documented: what counts is that the server lets go.
        let answer = self.command(&pipe, &format!("terminate_client {server} {client}"))?;
        if self.wait_until(|| matches!(self.server_of(&pipe, client), Ok(None))) {
            return Ok(true);
        }
        Err(GpuError::MpsClientHeld {
            server,
            client,
            answer: answer.trim().to_owned(),
        })
    }

    /// The server of the daemon at `pipe` that has `client` among its clients.
    fn server_of(&self, pipe: &Path, client: u32) -> Result<Option<u32>, GpuError> {
        for server in self.servers(pipe)? {
            let clients = parse_pids(
                &self.command(pipe, &format!("get_client_list {server}"))?,
                "get_client_list",
            )?;
            if clients.contains(&client) {
                return Ok(Some(server));
            }
        }
        Ok(None)
    }

    /// The share keys of every daemon directory under the configured directory (each
    /// keeps its key in a file; one without is listed by its directory name, which is
    /// the key for a short plain key). For `shareguard cleanup`.
    pub fn share_keys(&self) -> Result<Vec<String>, GpuError> {
        let base = &self.cfg.dir;
        if !exists(base)? {
            return Ok(Vec::new());
        }
        let mut keys = Vec::new();
        for entry in fs::read_dir(base).map_err(|e| io_err("listing", base, &e))? {
            let entry = entry.map_err(|e| io_err("listing", base, &e))?;
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let key = fs::read_to_string(entry.path().join("key")).unwrap_or(name.clone());
            // Only a directory this key names: another is not a share's daemon.
            if dir_name(&key) == name {
                keys.push(key);
            }
        }
        keys.sort();
        Ok(keys)
    }

    /// The configured directory the share daemons live in.
    pub fn base_dir(&self) -> &Path {
        &self.cfg.dir
    }

    /// Ends the share's daemon, detaches its /dev/shm and removes its directory;
    /// nothing left is success.
    pub fn stop(&self, share_key: &str) -> Result<(), GpuError> {
        let dir = self.share_dir(share_key);
        if !exists(&dir)? {
            return Ok(());
        }
        check_owner(&dir, share_key)?;
        check_private_dir(&dir)?;
        match self.recorded_daemon(&dir) {
            Some(daemon) => self.quit(&dir, daemon)?,
            None => self.quit_unrecorded(&dir.join("pipe")),
        }
        // Before the removal, which would otherwise empty the tmpfs the share's
        // containers may still hold and then fail on its mount point.
        unmount_shm(&dir.join("shm"))?;
        unmount_shm(&dir.join("pipe"))?;
        fs::remove_dir_all(&dir).map_err(|e| io_err("removing", &dir, &e))
    }

    fn share_dir(&self, share_key: &str) -> PathBuf {
        self.cfg.dir.join(dir_name(share_key))
    }

    fn start(&self, uuid: &str, dir: &Path) -> Result<(), GpuError> {
        let pipe = dir.join("pipe");
        check_shared_dir(&pipe)?;
        self.quit_unrecorded(&pipe);
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
        self.ensure_pipe(&pipe)?;
        remove_file(&dir.join(RECORD))?;
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
        // tmpfs as /dev/shm, in a mount namespace of its own; the CDI spec mounts the
        // same tmpfs at the containers' /dev/shm. Nothing of the host's /dev/shm is
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
        let mut started = None;
        if self.wait_until(|| {
            started = started_daemon(&pipe, &self.cfg.control);
            started.is_some()
        }) && let Some(daemon) = started
        {
            write_atomic(&dir.join(RECORD), &daemon.record())?;
            self.keep_out(daemon.pid);
            return Ok(());
        }
        Err(GpuError::Transient(format!(
            "the MPS control daemon in {} did not come up within {:?}; see its log in {}",
            pipe.display(),
            self.cfg.timeout,
            dir.join("log").display()
        )))
    }

    /// The share's daemon as the agent recorded it when it started it, while that very
    /// process still runs the control program. The pipe directory's pid file plays no
    /// part: one naming another process is only worth a warning.
    fn recorded_daemon(&self, dir: &Path) -> Option<Daemon> {
        let daemon = Daemon::parse(&fs::read_to_string(dir.join(RECORD)).ok()?)?;
        // The start time again after the command line: the pid cannot have been
        // recycled in between and the command line read from another process.
        if !(daemon.runs() && is_control(daemon.pid, &self.cfg.control) && daemon.runs()) {
            return None;
        }
        let named = fs::read_to_string(dir.join("pipe").join(PID_FILE)).ok();
        if let Some(named) = named
            && named.trim() != daemon.pid.to_string()
        {
            tracing::warn!(
                dir = %dir.display(),
                recorded = daemon.pid,
                pid_file = named.trim(),
                "the MPS pid file names another process than the daemon the agent started; \
                 it is ignored"
            );
        }
        Some(daemon)
    }

    /// Asks the recorded daemon to quit and waits until that process is gone.
    fn quit(&self, dir: &Path, daemon: Daemon) -> Result<(), GpuError> {
        let pipe = dir.join("pipe");
        self.command(&pipe, "quit")?;
        if self.wait_until(|| !daemon.runs()) {
            return remove_file(&dir.join(RECORD));
        }
        Err(GpuError::Transient(format!(
            "the MPS control daemon {} in {} did not quit within {:?}",
            daemon.pid,
            pipe.display(),
            self.cfg.timeout
        )))
    }

    /// Asks a daemon the agent has no record of (one an earlier build started, or whose
    /// record was lost) to quit before its directory is cleared, so that it does not
    /// run on unseen. Best effort and not waited for: its pid is not known, and only the
    /// daemon behind the agent's own (checked) pipe directory can get the message.
    fn quit_unrecorded(&self, pipe: &Path) {
        if !pipe.join(PID_FILE).exists() {
            return;
        }
        match self.run(pipe, "quit") {
            Ok(out) if out.success => tracing::info!(
                pipe = %pipe.display(),
                "asked an MPS control daemon the agent has no record of to quit"
            ),
            // Most often a daemon that died: nothing to quit.
            Ok(_) | Err(_) => {}
        }
    }

    /// Moves a daemon started directly (not under the launcher, whose unit holds it) and
    /// its servers out of the agent's cgroup, so that what ends the agent leaves them
    /// running. A move that fails is logged: the share is held now, and a restart of
    /// the agent would end its daemon, which the reconciler then starts again.
    fn keep_out(&self, pid: u32) {
        if !self.cfg.launcher.is_empty() {
            return;
        }
        match crate::mps_cgroup::move_out(pid, &self.cfg.cgroup) {
            Ok(0) => {}
            Ok(moved) => tracing::info!(
                pid,
                moved,
                cgroup = %self.cfg.cgroup,
                "MPS daemon moved out of the agent's cgroup"
            ),
            Err(e) => tracing::warn!(
                pid,
                error = %e,
                "the MPS daemon stays in the agent's cgroup: a restart of the agent ends it"
            ),
        }
    }

    /// Waits up to the configured timeout for `done`; false when it never was.
    fn wait_until(&self, mut done: impl FnMut() -> bool) -> bool {
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
}

#[cfg(test)]
pub(crate) mod tests;
