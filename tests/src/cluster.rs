//! The real test cluster (tests/cluster/, `make e2e`): kube-apiserver, the scheduler,
//! two kubelets with containerd, and shareguard installed from deploy/. The scenarios
//! drive it the way a user does, with kubectl, and read what it says as JSON.
//!
//! `tests/cluster/e2e.sh` starts a fresh cluster and runs the scenarios with
//! `SGC_KUBECONFIG` and `SGC_KUBECTL` set; the scenarios are `#[ignore]`d in a plain
//! `cargo test`, which has no cluster. Run by hand against a cluster of
//! `make cluster-up`:
//!
//! ```sh
//! SGC_KUBECONFIG=... SGC_KUBECTL=... cargo test -p shareguard-tests --test e2e -- --ignored
//! ```
//!
//! Every namespace a scenario makes is a [`Namespace`] guard, deleted when it drops, also
//! when the scenario panics; its name is unique per process and object.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use serde_json::Value;

/// The driver shareguard's deploy/ configures.
pub const DRIVER: &str = "shareguard.example.com";
/// The nodes of tests/cluster/lib.sh.
pub const NODES: [&str; 2] = ["sgc-node-1", "sgc-node-2"];
/// The test-workload image (tests/cluster/images.sh): a shell, iperf3, ping, ip.
pub const TOOLS_IMAGE: &str = "localhost/shareguard-e2e-tools:latest";

static NEXT: AtomicU32 = AtomicU32::new(0);

/// kubectl on the test cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    kubectl: PathBuf,
    kubeconfig: PathBuf,
}

impl Cluster {
    /// The cluster e2e.sh started. Panics with what to run when there is none: the
    /// scenarios only run where e2e.sh (or a person) points them at a cluster.
    pub fn from_env() -> Cluster {
        let var = |name: &str| {
            std::env::var_os(name).map(PathBuf::from).unwrap_or_else(|| {
                panic!("{name} is not set: run the scenarios with `make e2e` (tests/cluster/e2e.sh)")
            })
        };
        Cluster {
            kubectl: var("SGC_KUBECTL"),
            kubeconfig: var("SGC_KUBECONFIG"),
        }
    }

    /// This cluster as another caller: a kubeconfig in `dir` with the same API server
    /// and CA, authenticated by `token` alone.
    pub fn with_token(&self, token: &str, dir: &Path) -> Cluster {
        let raw = self.json(&["config", "view", "--raw", "--minify"]);
        let cluster = &raw["clusters"][0]["cluster"];
        let kubeconfig = dir.join("kubeconfig");
        write_token_kubeconfig(
            &kubeconfig,
            &serde_json::json!({
                "server": cluster["server"],
                "certificate-authority": cluster["certificate-authority"],
            }),
            token,
        );
        Cluster {
            kubectl: self.kubectl.clone(),
            kubeconfig,
        }
    }

    /// kubectl with these arguments in the background, its output into `out`; for
    /// `--watch`, which runs until it is killed.
    pub fn spawn(&self, args: &[&str], out: std::fs::File) -> std::process::Child {
        Command::new(&self.kubectl)
            .env("KUBECONFIG", &self.kubeconfig)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting kubectl {}: {e}", args.join(" ")))
    }

    /// kubectl with these arguments, its output whatever it is.
    pub fn run(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut cmd = Command::new(&self.kubectl);
        cmd.env("KUBECONFIG", &self.kubeconfig).args(args);
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", self.kubectl.display()));
        if let Some(input) = stdin {
            use std::io::Write;
            // take(): stdin was set to piped just above.
            let mut pipe = child.stdin.take().expect("piped stdin");
            pipe.write_all(input.as_bytes())
                .unwrap_or_else(|e| panic!("write kubectl's stdin: {e}"));
        }
        child
            .wait_with_output()
            .unwrap_or_else(|e| panic!("wait for kubectl: {e}"))
    }

    /// kubectl's stdout; panics with its stderr when it fails.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args, None);
        assert!(
            out.status.success(),
            "kubectl {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply -f -` of these documents.
    pub fn apply(&self, yaml: &str) {
        let out = self.run(&["apply", "-f", "-"], Some(yaml));
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `kubectl get ... -o json`, parsed.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let text = self.ok(&all);
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("kubectl {} gave no JSON: {e}\n{text}", args.join(" ")))
    }

    /// The object, or None when the API server says it is not there.
    pub fn get(&self, args: &[&str]) -> Option<Value> {
        let mut all = vec!["get"];
        all.extend(args);
        all.extend(["-o", "json", "--ignore-not-found"]);
        let out = self.run(&all, None);
        assert!(
            out.status.success(),
            "kubectl {} failed: {}",
            all.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return None;
        }
        Some(
            serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("kubectl {} gave no JSON: {e}", all.join(" "))),
        )
    }

    /// `helm ARGS` on this cluster; its stdout, or a panic with its stderr. Helm is
    /// SHAREGUARD_HELM, the pinned build scripts/test.sh's `ensure_helm` exports.
    pub fn helm(&self, args: &[&str]) -> String {
        let helm = std::env::var_os("SHAREGUARD_HELM").unwrap_or_else(|| {
            panic!("SHAREGUARD_HELM is not set: scripts/test.sh (ensure_helm in scripts/lib.sh) builds Helm and sets it")
        });
        let out = Command::new(&helm)
            .env("KUBECONFIG", &self.kubeconfig)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", Path::new(&helm).display()));
        assert!(
            out.status.success(),
            "helm {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The shareguard agent pod (DaemonSet `shareguard-agent`) on `node`.
    pub fn agent_pod(&self, node: &str) -> String {
        self.shareguard_pod(node, "agent")
    }

    /// The running pod of shareguard's `component` (`agent` or `kubelet-plugin`, the
    /// DaemonSets' label) on `node`; during an update the newest.
    pub fn shareguard_pod(&self, node: &str, component: &str) -> String {
        let pods = self.json(&[
            "get",
            "pods",
            "-n",
            "shareguard-system",
            "-l",
            // The release `shareguard`'s: scenario zz puts a second release's pods
            // beside them for a while.
            &format!(
                "app.kubernetes.io/instance=shareguard,app.kubernetes.io/component={component}"
            ),
            "--field-selector",
            &format!("spec.nodeName={node},status.phase=Running"),
            "--sort-by",
            ".metadata.creationTimestamp",
        ]);
        let items = pods["items"].as_array().cloned().unwrap_or_default();
        items
            .last()
            .and_then(|p| p["metadata"]["name"].as_str())
            .unwrap_or_else(|| panic!("no running shareguard {component} pod on {node}: {pods}"))
            .to_string()
    }

    /// `shareguard -o json ARGS` in the agent container on `node`: the SRE's CLI on the
    /// agent's socket.
    pub fn agent_cli(&self, node: &str, args: &[&str]) -> Value {
        let out = self.agent_cli_with(node, args, None);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "shareguard {args:?} failed: {}{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("shareguard {args:?} gave no JSON: {e}: {text}"))
    }

    /// `shareguard -o json ARGS` in the agent's container on `node`, with `stdin`, as it
    /// ended.
    pub fn agent_cli_with(&self, node: &str, args: &[&str], stdin: Option<&str>) -> Output {
        let pod = self.agent_pod(node);
        let mut all = vec!["exec"];
        if stdin.is_some() {
            all.push("-i");
        }
        all.extend([
            "-n",
            "shareguard-system",
            &pod,
            "-c",
            "agent",
            "--",
            "shareguard",
            "-o",
            "json",
        ]);
        all.extend(args);
        self.run(&all, stdin)
    }

    /// kubelet's `dra_operations_duration_seconds` of `node`: (operation, count, sum)
    /// per operation, a failed one as `OPERATION (error)`.
    pub fn kubelet_dra_operations(&self, node: &str) -> Vec<(String, f64, f64)> {
        let text = self.ok(&[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{node}/proxy/metrics"),
        ]);
        let mut out: Vec<(String, f64, f64)> = Vec::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("dra_operations_duration_seconds_") else {
                continue;
            };
            let Some((kind, rest)) = rest.split_once('{') else {
                continue;
            };
            let Some(op) = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("operation_name=\""))
                .and_then(|v| v.split('"').next())
            else {
                continue;
            };
            let value: f64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0);
            let key = format!(
                "{op}{}",
                if rest.contains("is_error=\"true\"") {
                    " (error)"
                } else {
                    ""
                }
            );
            let slot = match out.iter().position(|(k, _, _)| *k == key) {
                Some(i) => i,
                None => {
                    out.push((key, 0.0, 0.0));
                    out.len() - 1
                }
            };
            match kind {
                "count" => out[slot].1 += value,
                "sum" => out[slot].2 += value,
                _ => {}
            }
        }
        out
    }

    /// A fresh namespace, deleted when the guard drops.
    pub fn namespace(&self, prefix: &str) -> Namespace {
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        self.ok(&["create", "namespace", &name]);
        let ns = Namespace {
            cluster: self.clone(),
            name,
        };
        // kube-controller-manager makes the namespace's `default` ServiceAccount a
        // moment later, and until then the API server refuses every pod in it (seen
        // right after a restart of kube-apiserver, when its informers reconnect).
        wait_for(
            &format!("the default ServiceAccount of {}", ns.name),
            Duration::from_secs(60),
            || match self.get(&["serviceaccount", "default", "-n", &ns.name]) {
                Some(_) => Ok(()),
                None => Err("not yet".to_string()),
            },
        );
        ns
    }
}

/// A namespace of one scenario; deleting it deletes its pods and claims, and so makes
/// kubelet unprepare them.
#[derive(Debug)]
pub struct Namespace {
    cluster: Cluster,
    pub name: String,
}

impl Drop for Namespace {
    fn drop(&mut self) {
        // Waits (bounded) until its pods and claims are gone, so that the next scenario
        // finds the nodes' capacity free again.
        let _ = self.cluster.run(
            &[
                "delete",
                "namespace",
                &self.name,
                "--wait=true",
                "--timeout=120s",
            ],
            None,
        );
    }
}

/// A kubeconfig at `path` for the API server a kubeconfig `cluster` entry names (its
/// `server` and CA), authenticated by `token` alone.
pub fn write_token_kubeconfig(path: &Path, cluster: &Value, token: &str) {
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    });
    std::fs::write(path, config.to_string()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// One of tests/cluster/'s scripts with its arguments, stdin closed, to run or spawn.
pub fn script(name: &str, args: &[&str]) -> Command {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("cluster")
        .join(name);
    let mut cmd = Command::new(path);
    cmd.args(args).stdin(Stdio::null());
    cmd
}

/// Runs one of tests/cluster/'s scripts to its end; panics unless it succeeds.
pub fn run_script(name: &str, args: &[&str]) {
    let status = script(name, args)
        .status()
        .unwrap_or_else(|e| panic!("tests/cluster/{name}: {e}"));
    assert!(status.success(), "tests/cluster/{name} {args:?}: {status}");
}

/// Polls `f` every 250 ms until it returns Ok, for at most `timeout`; panics naming
/// `what` and the last state `f` described when it never does.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return v,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}

/// The claim's `status.devices` entry written by shareguard's driver, if any.
pub fn driver_entry(claim: &Value) -> Option<&Value> {
    field(claim, "status.devices")
        .as_array()?
        .iter()
        .find(|d| d["driver"] == DRIVER)
}

/// Whether a `status.devices` entry has its `Enforced` condition True.
pub fn is_enforced(entry: &Value) -> bool {
    entry["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|k| k["type"] == "Enforced" && k["status"] == "True")
}

/// A JSON field by path (`a.b.c`), or Null.
pub fn field<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, k| &v[k])
}
