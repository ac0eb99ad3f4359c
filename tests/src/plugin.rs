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
        }
    }

    /// Starts the process without waiting.
    pub fn launch(&mut self) {
        self.log = self.dir.path().join(format!("plugin-{}.log", self.starts));
        self.starts += 1;
        let log = fs::File::create(&self.log).unwrap();
        let child = Command::new(agent_bin())
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
            .env("RUST_LOG", "info")
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
        self.kubelet
            .plugins_dir
            .join(driver)
            .join("dra.sock")
            .display()
            .to_string()
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
