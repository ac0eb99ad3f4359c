use super::*;

/// `sh -c SCRIPT` in node `node`'s network, mount and UTS namespaces (tests/cluster/
/// lib.sh's `sgc_in_node`): what a shell on that node sees. Its stdout; a panic with
/// its stderr when it fails.
fn on_node(node: &str, script: &str) -> String {
    let state = std::env::var("SGC_STATE").unwrap_or_else(|_| "/var/lib/shareguard-cluster".into());
    let ns = format!("{state}/ns/{node}");
    let out = std::process::Command::new("nsenter")
        .args([
            format!("--net={ns}.net"),
            format!("--mount={ns}.mnt"),
            format!("--uts={ns}.uts"),
        ])
        .args(["--", "sh", "-c", script])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("nsenter into {node}: {e}"));
    assert!(
        out.status.success(),
        "on {node}: {script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The directories shareguard's deploy/ config uses on a node.
const NODE_DIRS: [&str; 6] = [
    "/var/lib/shareguard",
    "/run/shareguard",
    "/run/shareguard-mps",
    "/sys/fs/bpf/shareguard",
    "/var/lib/kubelet/plugins/shareguard.example.com",
    "/var/lib/kubelet/plugins_registry/shareguard.example.com",
];

/// What of shareguard is on `node`: per directory of [`NODE_DIRS`] "absent", "empty
/// mount point" or what is in it; its CDI specs in /run/cdi; its ifb links and the
/// qdiscs of the kinds it installs, in the node's network namespace.
fn shareguard_on_node(node: &str) -> Vec<String> {
    let script = format!(
        r#"for d in {dirs}; do
  if [ ! -e "$d" ]; then echo "$d: absent"
  elif [ -z "$(ls -A "$d")" ] && mountpoint -q "$d"; then echo "$d: empty mount point"
  else echo "$d: $(ls -A "$d" | tr '\n' ' ')"; fi
done
for f in /run/cdi/{DRIVER}-*; do [ -e "$f" ] && echo "CDI spec $f"; done
ip -o link show type ifb | sed 's/^/ifb: /'
tc qdisc show | grep -E '^qdisc (htb|clsact|ingress) ' | sed 's/^/qdisc: /'
true"#,
        dirs = NODE_DIRS.join(" ")
    );
    on_node(node, &script).lines().map(str::to_owned).collect()
}

/// zz (after z, which took the kubectl install away; alone, it takes it away itself).
/// The chart installed with Helm (the release record in kube-system, the chart making
/// shareguard-system), its render accepted by the API server's own validation, a pod's
/// share enforced; `helm upgrade` to a new image tag rolls both DaemonSets and the share
/// stays enforced under the new agent, a pod started after it is enforced too;
/// `helm uninstall` (pods deleted first, as the docs say) leaves no object and no
/// slice; then deploy/uninstall/node-cleanup.yaml on each node, with the config saved
/// before the uninstall, removes what stayed on the node (the store, the audit log,
/// pins, the plugin's directories, the socket), and nothing of shareguard is left:
/// each directory gone, or empty where the test cluster mounts it (its nodes' paths are
/// bind mounts), no CDI spec, ifb or qdisc of its kinds.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn zz_helm_installs_upgrades_and_uninstalls_and_cleanup_leaves_nothing_on_the_nodes() {
    let c = Cluster::from_env();
    if c.get(&["namespace", "shareguard-system"]).is_some() {
        run_script("uninstall.sh", &[]);
    }
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/chart");
    let chart = chart.to_str().unwrap_or_else(|| panic!("{chart:?}"));
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary directory: {e}"));
    // What a user's values name: the image (built here, as no registry is reachable)
    // and no PodMonitor (this cluster has no Prometheus Operator).
    let values = work.path().join("values.yaml");
    std::fs::write(
        &values,
        "image:\n  repository: localhost/shareguard\n  tag: dev\npodMonitor:\n  enabled: false\n",
    )
    .unwrap_or_else(|e| panic!("{values:?}: {e}"));
    let values = values.to_str().unwrap_or_else(|| panic!("{values:?}"));
    let release = ["-n", "kube-system"];
    let rollout = |c: &Cluster| {
        for ds in ["shareguard-agent", "shareguard-kubelet-plugin"] {
            c.ok(&[
                "rollout",
                "status",
                "-n",
                "shareguard-system",
                &format!("daemonset/{ds}"),
                "--timeout=180s",
            ]);
        }
    };
    let release_status = |c: &Cluster| -> (String, u64) {
        let s: Value = serde_json::from_str(&c.helm(&[
            "status",
            "shareguard",
            "-n",
            "kube-system",
            "-o",
            "json",
        ]))
        .unwrap_or_else(|e| panic!("helm status gave no JSON: {e}"));
        (
            field(&s, "info.status")
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            s["version"].as_u64().unwrap_or_default(),
        )
    };

    let mut args = vec!["install", "shareguard", chart];
    args.extend(release);
    args.extend(["-f", values, "--wait", "--timeout", "5m"]);
    c.helm(&args);
    rollout(&c);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 1));
    for node in NODES {
        wait_for(
            &format!("{node}'s slices"),
            POD_TIMEOUT,
            || match node_slices(&c, node).len() {
                0 => Err("none yet".to_string()),
                n => Ok(n),
            },
        );
    }
    // The render, as the API server validates it: every field known (strict), every
    // object admissible. A dry run against the installed objects.
    let mut args = vec!["template", "shareguard", chart];
    args.extend(release);
    args.extend(["-f", values]);
    let rendered = c.helm(&args);
    let out = c.run(
        &["apply", "--dry-run=server", "--validate=strict", "-f", "-"],
        Some(&rendered),
    );
    assert!(
        out.status.success(),
        "the API server refuses the chart's render: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let before = c.namespace("e2e-zz");
    enforced_pod(&c, &before.name, "p", NODES[0], "10M", ClaimKind::Template);
    let share = first_share_id(&only_claim(&c, &before.name));
    assert_eq!(share_phase(&c, NODES[0], &share), "ENFORCED");
    // The config the agents run with, kept for the cleanup after the uninstall.
    let config = c.ok(&[
        "get",
        "configmap",
        "-n",
        "shareguard-system",
        "shareguard-agent-config",
        "-o",
        "jsonpath={.data.agent\\.toml}",
    ]);
    assert!(config.contains("state_dir"), "{config}");

    // A new release's image (the same build, under a new tag on both nodes).
    run_script("tag-image.sh", &["helm-2"]);
    let mut args = vec!["upgrade", "shareguard", chart];
    args.extend(release);
    args.extend([
        "-f",
        values,
        "--set",
        "image.tag=helm-2",
        "--wait",
        "--timeout",
        "5m",
    ]);
    c.helm(&args);
    rollout(&c);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 2));
    wait_for("every shareguard pod on helm-2", POD_TIMEOUT, || {
        let images = shareguard_images(&c);
        if images.len() == 2 * NODES.len()
            && images
                .iter()
                .all(|i| i.ends_with(" localhost/shareguard:helm-2"))
        {
            Ok(())
        } else {
            Err(format!("{images:?}"))
        }
    });
    wait_for(
        "the new agent to enforce the share again",
        STATUS_TIMEOUT,
        || match share_phase(&c, NODES[0], &share).as_str() {
            "ENFORCED" => Ok(()),
            other => Err(other.to_owned()),
        },
    );
    wait_enforced_status(&c, &before.name);
    let after = c.namespace("e2e-zz");
    enforced_pod(&c, &after.name, "p", NODES[1], "10M", ClaimKind::Template);

    // Uninstall as the docs say: the pods with claims first.
    drop(before);
    drop(after);
    let mut args = vec!["uninstall", "shareguard"];
    args.extend(release);
    args.extend(["--wait", "--timeout", "5m"]);
    c.helm(&args);
    wait_for("shareguard-system to be gone", POD_TIMEOUT, || {
        match c.get(&["namespace", "shareguard-system"]) {
            None => Ok(()),
            Some(n) => Err(format!("{}", field(&n, "status"))),
        }
    });
    assert_nothing_installed(&c);
    let releases = c.helm(&["list", "-n", "kube-system", "-o", "json"]);
    assert_eq!(releases.trim(), "[]", "helm still lists a release");

    // What the uninstall leaves on the nodes, by design (docs/kubernetes.md,
    // "Uninstall"): the store at least, which the cleanup below must take.
    for node in NODES {
        let left = shareguard_on_node(node);
        eprintln!("{node} after the uninstall: {left:?}");
        assert!(
            left.iter()
                .any(|l| l.starts_with("/var/lib/shareguard: ") && l.contains("store")),
            "{node}: {left:?}"
        );
    }

    // deploy/uninstall/node-cleanup.yaml on each node, as shipped but for the image.
    let ns = c.namespace("e2e-cleanup");
    c.ok(&[
        "label",
        "namespace",
        &ns.name,
        "pod-security.kubernetes.io/enforce=privileged",
    ]);
    let saved = work.path().join("agent.toml");
    std::fs::write(&saved, &config).unwrap_or_else(|e| panic!("{saved:?}: {e}"));
    c.ok(&[
        "create",
        "configmap",
        "shareguard-cleanup",
        "-n",
        &ns.name,
        &format!("--from-file=agent.toml={}", saved.display()),
    ]);
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/uninstall/node-cleanup.yaml");
    let manifest =
        std::fs::read_to_string(&manifest).unwrap_or_else(|e| panic!("{manifest:?}: {e}"));
    for node in NODES {
        let pod: String = manifest
            .replace("NODE_NAME_HERE", node)
            .lines()
            .map(|l| match l.split_once("image: shareguard:") {
                Some((indent, _)) => format!("{indent}image: localhost/shareguard:dev\n"),
                None => format!("{l}\n"),
            })
            .collect();
        let out = c.run(&["apply", "-n", &ns.name, "-f", "-"], Some(&pod));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for node in NODES {
        let name = format!("shareguard-cleanup-{node}");
        let phase = wait_for(&format!("{name} to end"), POD_TIMEOUT, || {
            let p = c
                .get(&["pod", "-n", &ns.name, &name])
                .ok_or_else(|| "not found".to_string())?;
            match field(&p, "status.phase").as_str() {
                Some(done @ ("Succeeded" | "Failed")) => Ok(done.to_owned()),
                _ => Err(format!("{}", field(&p, "status"))),
            }
        });
        let log = c.ok(&["logs", "-n", &ns.name, &name]);
        eprintln!("{name}:\n{log}");
        assert_eq!(phase, "Succeeded", "{name}: {log}");
        assert!(log.contains("removed"), "{name} removed nothing: {log}");
    }

    for node in NODES {
        let left = shareguard_on_node(node);
        let unexpected: Vec<&String> = left
            .iter()
            .filter(|l| !(l.ends_with(": absent") || l.ends_with(": empty mount point")))
            .collect();
        assert!(
            unexpected.is_empty(),
            "{node}: shareguard left {unexpected:?}"
        );
        // Only the test cluster's own bind mounts may stay (empty): the directories
        // below them are gone.
        for l in &left {
            if l.ends_with(": empty mount point") {
                assert!(
                    [
                        "/var/lib/shareguard:",
                        "/run/shareguard:",
                        "/run/shareguard-mps:"
                    ]
                    .iter()
                    .any(|d| l.starts_with(d)),
                    "{node}: {l}"
                );
            }
        }
    }
}
