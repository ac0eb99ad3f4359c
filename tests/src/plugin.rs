//! The real `shareguard kubelet-plugin` process, on a test "node": its own kubelet
//! directories, the agent's socket, and a kubeconfig for the API stand-in. Killed
//! (SIGKILL) when dropped, so a failing test leaves no plugin behind.

use std::{
    fs,
    path::PathBuf,
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use crate::{Agent, agent_bin, apiserver::ApiServer, kubelet::Kubelet};

const READY_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Plugin {
    pub dir: tempfile::TempDir,
    pub kubelet: Kubelet,
    pub node: String,
    pub log: PathBuf,
    agent_socket: PathBuf,
    kubeconfig: PathBuf,
    drivers: Vec<String>,
    child: Option<Child>,
    resync_seconds: u64,
    starts: u32,
    /// `--instance-id`: the sockets' names carry it.
    instance_id: Option<String>,
    /// Runs as this uid and gid, from `bin` (a copy every uid may execute), instead of
    /// as the test's own uid from the build directory.
    run_as: Option<(u32, u32)>,
    bin: PathBuf,
    /// More arguments for the next [`Plugin::launch`].
    pub extra_args: Vec<String>,
}

impl Plugin {
    /// Starts the plugin for `agent` and waits until the registration socket of each of
    /// `drivers` (the agent's) is there.
    pub fn start(agent: &Agent, api: &ApiServer, node: &str, drivers: &[&str]) -> Plugin {
        Self::start_for(&agent.socket, api, node, drivers)
    }

    /// [`Plugin::start`] with `--resync-seconds` (1 otherwise): a long one leaves the
    /// API server's watch as the only way a slice's change is noticed.
    pub fn start_with_resync(
        agent: &Agent,
        api: &ApiServer,
        node: &str,
        drivers: &[&str],
        resync_seconds: u64,
    ) -> Plugin {
        let mut p = Self::create(&agent.socket, api, node, drivers);
        p.resync_seconds = resync_seconds;
        p.launch();
        p.wait_ready();
        p
    }

    /// [`Plugin::start`] for an agent listening at `agent_socket`, started elsewhere.
    pub fn start_for(
        agent_socket: &std::path::Path,
        api: &ApiServer,
        node: &str,
        drivers: &[&str],
    ) -> Plugin {
        let mut p = Self::create(agent_socket, api, node, drivers);
        p.launch();
        p.wait_ready();
        p
    }

    /// The plugin for `agent`, not started yet: set [`Plugin::extra_args`], then
    /// [`Plugin::launch`].
    pub fn new(agent: &Agent, api: &ApiServer, node: &str, drivers: &[&str]) -> Plugin {
        Self::create(&agent.socket, api, node, drivers)
    }

    fn create(
        agent_socket: &std::path::Path,
        api: &ApiServer,
        node: &str,
        drivers: &[&str],
    ) -> Plugin {
        let dir = tempfile::Builder::new().prefix("sg-kp-").tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig);
        Plugin {
            kubelet: Kubelet {
                registry_dir: dir.path().join("plugins_registry"),
                plugins_dir: dir.path().join("plugins"),
            },
            log: dir.path().join("plugin-0.log"),
            dir,
            node: node.to_owned(),
            agent_socket: agent_socket.to_path_buf(),
            kubeconfig,
            drivers: drivers.iter().map(|d| (*d).to_owned()).collect(),
            child: None,
            starts: 0,
            resync_seconds: 1,
            instance_id: None,
            run_as: None,
            bin: agent_bin(),
            extra_args: Vec::new(),
        }
    }

    /// [`Plugin::start_instance`] as a DaemonSet runs it unprivileged: kubelet's
    /// directories are root's, `shareguard kubelet-plugin-dirs` (as root) makes
    /// `plugins_registry/<driver>` and `plugins/<driver>` and gives them to `uid`:`gid`,
    /// and the plugin runs as `uid`:`gid` with no supplementary group. Returns the
    /// output of `kubelet-plugin-dirs` beside the plugin.
    pub fn start_as(
        agent: &Agent,
        api: &ApiServer,
        node: &str,
        drivers: &[&str],
        instance_id: &str,
        (uid, gid): (u32, u32),
    ) -> (Plugin, String) {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let mut p = Self::create(&agent.socket, api, node, drivers);
        let root = p.dir.path().to_path_buf();
        // Other uids may pass through the test's directory, not list it.
        fs::set_permissions(&root, fs::Permissions::from_mode(0o711)).unwrap();
        // Root's and not writable by others; 0711 rather than kubelet's 0750 because in
        // the pod the plugin reaches its two directories through bind mounts, below
        // mount points the runtime made, never through kubelet's own directories.
        for d in [&p.kubelet.registry_dir, &p.kubelet.plugins_dir] {
            fs::DirBuilder::new().mode(0o711).create(d).unwrap();
        }
        let bin = root.join("shareguard");
        fs::copy(agent_bin(), &bin).unwrap();
        fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
        let dirs: Vec<PathBuf> = drivers
            .iter()
            .flat_map(|d| {
                [
                    p.kubelet.registry_dir.join(d),
                    p.kubelet.plugins_dir.join(d),
                ]
            })
            .collect();
        let out = Command::new(agent_bin())
            .args(["kubelet-plugin-dirs", "--owner", &format!("{uid}:{gid}")])
            .args(&dirs)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "kubelet-plugin-dirs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        p.instance_id = Some(instance_id.to_owned());
        p.run_as = Some((uid, gid));
        p.bin = bin;
        p.launch();
        p.wait_ready();
        (p, String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// A second instance of `first`'s plugin, as a rolling update starts it: the same
    /// kubelet directories, its own `--instance-id` (and so its own sockets), and
    /// `/readyz` on a port of its own. `first` must have an instance id too.
    pub fn start_beside(
        first: &Plugin,
        agent: &Agent,
        api: &ApiServer,
        instance_id: &str,
    ) -> Plugin {
        let drivers: Vec<&str> = first.drivers.iter().map(String::as_str).collect();
        let mut p = Self::create(&agent.socket, api, &first.node, &drivers);
        p.kubelet = first.kubelet.clone();
        p.instance_id = Some(instance_id.to_owned());
        p.launch();
        p.wait_ready();
        p
    }

    /// [`Plugin::start`] with `--instance-id` and a health server.
    pub fn start_instance(
        agent: &Agent,
        api: &ApiServer,
        node: &str,
        drivers: &[&str],
        instance_id: &str,
    ) -> Plugin {
        let mut p = Self::create(&agent.socket, api, node, drivers);
        p.instance_id = Some(instance_id.to_owned());
        p.launch();
        p.wait_ready();
        p
    }

    /// Starts the process without waiting.
    pub fn launch(&mut self) {
        self.log = self.dir.path().join(format!("plugin-{}.log", self.starts));
        self.starts += 1;
        let log = fs::File::create(&self.log).unwrap();
        let mut cmd = Command::new(&self.bin);
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt;
            // As root, std also drops the supplementary groups when it changes uid.
            cmd.uid(uid).gid(gid);
        }
        let child = cmd
            .arg("kubelet-plugin")
            .arg("--agent-socket")
            .arg(&self.agent_socket)
            .args(["--node-name", &self.node])
            .arg("--registry-dir")
            .arg(&self.kubelet.registry_dir)
            .arg("--plugins-dir")
            .arg(&self.kubelet.plugins_dir)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["--resync-seconds", &self.resync_seconds.to_string()])
            .args(
                self.instance_id
                    .iter()
                    .flat_map(|id| ["--instance-id", id, "--health-addr", "127.0.0.1:0"]),
            )
            .args(&self.extra_args)
            .env(
                "RUST_LOG",
                std::env::var("SG_PLUGIN_LOG").unwrap_or("info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Waits until the plugin logged that it serves kubelet for every driver (its
    /// sockets are bound by then); fails with the log if it exits first.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "plugin exited during start ({status}):\n{}",
                    self.log_text()
                );
            }
            let log = self.log_text();
            let serving = log.lines().filter(|l| l.contains("serving kubelet"));
            if self
                .drivers
                .iter()
                .all(|d| serving.clone().any(|l| l.contains(&format!("driver={d}"))))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "plugin not serving after {READY_TIMEOUT:?}:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn endpoint(&self, driver: &str) -> String {
        let file = match &self.instance_id {
            Some(id) => format!("dra-{id}.sock"),
            None => "dra.sock".to_owned(),
        };
        self.kubelet
            .plugins_dir
            .join(driver)
            .join(file)
            .display()
            .to_string()
    }

    /// This instance's registration socket for `driver`.
    pub fn registration_socket(&self, driver: &str) -> PathBuf {
        self.kubelet
            .instance_registration_socket(driver, self.instance_id.as_deref())
    }

    /// The address of `/healthz` and `/readyz`, from the log (the port is the kernel's
    /// choice); only with an instance id.
    pub fn health_addr(&self) -> std::net::SocketAddr {
        let log = self.log_text();
        let line = log
            .lines()
            .find(|l| l.contains("serving /healthz and /readyz"))
            .unwrap_or_else(|| panic!("no health server in the log:\n{log}"));
        let addr = line
            .split("addr=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        addr.parse().unwrap()
    }

    /// `GET /readyz`: the status code and the body.
    pub fn readyz(&self) -> (u16, String) {
        crate::http_get(self.health_addr(), "/readyz").expect("health server answers")
    }

    /// SIGTERM, and the exit status once the process is gone.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("plugin not running");
        let status = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -TERM failed");
        c.wait().unwrap()
    }

    /// Waits for the process to exit by itself (at most [`READY_TIMEOUT`]).
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + READY_TIMEOUT;
        let c = self.child.as_mut().expect("plugin not running");
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "plugin still running after {READY_TIMEOUT:?}:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, as a crash: the sockets stay behind.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGKILL, then start again with the same directories.
    pub fn restart(&mut self) {
        self.kill9();
        self.launch();
        self.wait_ready();
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.kill9();
    }
}
