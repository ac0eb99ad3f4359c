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

/// The token in the chart's metrics Secret, decoded.
fn metrics_token(c: &Cluster) -> String {
    let b64 = c.ok(&[
        "get",
        "secret",
        "-n",
        "shareguard-system",
        "shareguard-metrics-token",
        "-o",
        "jsonpath={.data.token}",
    ]);
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("printf %s '{}' | base64 -d", b64.trim())])
        .output()
        .unwrap_or_else(|e| panic!("base64: {e}"));
    assert!(out.status.success(), "the token is not base64: {b64}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `node`'s agent's /metrics on the node's address, with `token` as the bearer token
/// if any: the HTTP status code and reason, then the body.
fn scrape(node: &str, token: Option<&str>) -> String {
    let auth = token.map_or(String::new(), |t| format!("-H 'Authorization: Bearer {t}'"));
    on_node(
        node,
        &format!(
            "addr=$(ip -4 -o addr show scope global | awk '{{print $4}}' | cut -d/ -f1 | head -1); \
             curl -s -o /tmp/sg-scrape.$$ -w '%{{http_code}} \n' {auth} http://$addr:9464/metrics; \
             cat /tmp/sg-scrape.$$; rm -f /tmp/sg-scrape.$$"
        ),
    )
}

/// The uids of shareguard's pods of `component` (agent, kubelet-plugin).
fn pod_uids(c: &Cluster, component: &str) -> std::collections::BTreeSet<String> {
    let pods = c.json(&[
        "get",
        "pods",
        "-n",
        "shareguard-system",
        "-l",
        &format!("app.kubernetes.io/component={component}"),
    ]);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| field(p, "metadata.deletionTimestamp").is_null())
        .map(|p| {
            field(p, "metadata.uid")
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}

/// The pods of release `release` of `component` in shareguard-system: (name, uid,
/// restarts of its main container).
fn release_pods(c: &Cluster, release: &str, component: &str) -> Vec<(String, String, u64)> {
    let pods = c.json(&[
        "get",
        "pods",
        "-n",
        "shareguard-system",
        "-l",
        &format!("app.kubernetes.io/instance={release},app.kubernetes.io/component={component}"),
    ]);
    pods["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |path: &str| field(p, path).as_str().unwrap_or_default().to_owned();
            let restarts = field(p, "status.containerStatuses")
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| c["restartCount"].as_u64().unwrap_or_default())
                .sum();
            (s("metadata.name"), s("metadata.uid"), restarts)
        })
        .collect()
}

/// A second release, `canary` (driver canary.example.com), installed into the first
/// release's namespace and, by mistake, onto a node the first release's agent serves:
/// Helm installs it beside the first, cluster-scoped objects included; on that node its
/// plugin refuses the first release's agent (`--driver`), saying so, and the scheduler
/// does not place its agent (the first agent holds the node's host ports); no slice of
/// its driver; the first release's plugin there is
/// not restarted, its shares stay enforced and its metrics token is kept; `helm
/// uninstall canary` takes only canary's objects.
fn second_release_beside_the_first(
    c: &Cluster,
    chart: &str,
    work: &tempfile::TempDir,
    token: &str,
) {
    let node = NODES[1];
    let values = work.path().join("canary.yaml");
    std::fs::write(
        &values,
        format!(
            "image: {{repository: localhost/shareguard, tag: helm-2}}\n\
             driverName: canary.example.com\n\
             namespace: {{name: shareguard-system, create: false}}\n\
             agent:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n  devices:\n\
             \x20   - {{name: canary-mem, kind: generic, allowedNamespaces: [\"*\"], capacity: {{memory: {{value: 8Gi, default: 1Gi}}}}}}\n\
             kubeletPlugin:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n"
        ),
    )
    .unwrap_or_else(|e| panic!("{values:?}: {e}"));
    let values = values.to_str().unwrap_or_else(|| panic!("{values:?}"));
    let first_plugins = release_pods(c, "shareguard", "kubelet-plugin");
    assert_eq!(first_plugins.len(), NODES.len(), "{first_plugins:?}");

    c.helm(&[
        "install",
        "canary",
        chart,
        "-n",
        "kube-system",
        "-f",
        values,
    ]);
    for (kind, name) in [
        ("daemonset", "canary-shareguard-agent"),
        ("daemonset", "canary-shareguard-kubelet-plugin"),
        ("secret", "canary-shareguard-metrics-token"),
    ] {
        assert!(
            c.get(&[kind, "-n", "shareguard-system", name]).is_some(),
            "{kind} {name}"
        );
    }
    for (kind, name) in [
        ("clusterrole", "canary-shareguard-kubelet-plugin"),
        (
            "validatingadmissionpolicy",
            "canary-shareguard-kubelet-plugin-resourceslices",
        ),
        ("deviceclass", "canary-shareguard-net-bandwidth"),
    ] {
        assert!(c.get(&[kind, name]).is_some(), "{kind} {name}");
    }

    // Each of canary's two processes on the node says why it does not serve there.
    let log_of = |component: &str, container: &str| -> String {
        let mut all = String::new();
        for (pod, _, _) in release_pods(c, "canary", component) {
            for previous in ["--previous=false", "--previous=true"] {
                let out = c.run(
                    &[
                        "logs",
                        "-n",
                        "shareguard-system",
                        &pod,
                        "-c",
                        container,
                        previous,
                    ],
                    None,
                );
                all.push_str(&String::from_utf8_lossy(&out.stdout));
            }
        }
        all
    };
    wait_for(
        "canary's plugin to refuse the first release's agent",
        POD_TIMEOUT,
        || {
            let log = log_of("kubelet-plugin", "kubelet-plugin");
            if log.contains("belongs to another release") && log.contains("shareguard.example.com")
            {
                Ok(())
            } else {
                Err(log)
            }
        },
    );
    // Its agent is not even placed: the first agent holds the node's host ports.
    wait_for(
        "the scheduler to keep canary's agent off the node",
        POD_TIMEOUT,
        || {
            let pods = c.json(&[
                "get",
                "pods",
                "-n",
                "shareguard-system",
                "-l",
                "app.kubernetes.io/instance=canary,app.kubernetes.io/component=agent",
            ]);
            let refused = pods["items"].as_array().is_some_and(|items| {
                !items.is_empty()
                    && items.iter().all(|p| {
                        field(p, "status.phase") == "Pending"
                            && field(p, "status.conditions").as_array().is_some_and(|cs| {
                                cs.iter().any(|c| {
                                    c["type"] == "PodScheduled"
                                        && c["status"] == "False"
                                        && c["message"]
                                            .as_str()
                                            .is_some_and(|m| m.contains("free ports"))
                                })
                            })
                    })
            });
            if refused {
                Ok(())
            } else {
                Err(format!("{pods}"))
            }
        },
    );
    let canary_slices = c.json(&[
        "get",
        "resourceslices",
        "--field-selector",
        "spec.driver=canary.example.com",
    ]);
    assert_eq!(
        canary_slices["items"].as_array().map_or(0, Vec::len),
        0,
        "{canary_slices}"
    );
    // The first release on that node: its plugin not restarted, its share enforced.
    assert_eq!(
        release_pods(c, "shareguard", "kubelet-plugin"),
        first_plugins,
        "the first release's plugins were restarted"
    );
    let claims = c.json(&["get", "resourceclaims", "-A"]);
    let on_node: Vec<String> = claims["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|cl| {
            field(cl, "status.allocation.nodeSelector")
                .to_string()
                .contains(node)
        })
        .map(first_share_id)
        .collect();
    assert!(!on_node.is_empty(), "no share on {node}: {claims}");
    for share in on_node {
        assert_eq!(share_phase(c, node, &share), "ENFORCED", "{share}");
    }
    assert!(!node_slices(c, node).is_empty(), "{node} lost its slice");

    c.helm(&[
        "uninstall",
        "canary",
        "-n",
        "kube-system",
        "--wait",
        "--timeout",
        "5m",
    ]);
    wait_for("canary's pods to be gone", POD_TIMEOUT, || {
        let left: Vec<_> = ["agent", "kubelet-plugin"]
            .iter()
            .flat_map(|comp| release_pods(c, "canary", comp))
            .collect();
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    assert!(
        c.get(&["deviceclass", "canary-shareguard-net-bandwidth"])
            .is_none()
    );
    assert!(
        c.get(&["deviceclass", "shareguard-net-bandwidth"])
            .is_some()
    );
    assert!(
        c.get(&["clusterrole", "shareguard-kubelet-plugin"])
            .is_some()
    );
    assert_eq!(
        metrics_token(c),
        token,
        "the second release changed the first's token"
    );
    assert_eq!(
        release_pods(c, "shareguard", "kubelet-plugin"),
        first_plugins,
        "the first release's plugins were restarted"
    );
}

/// zz (after z, which took the kubectl install away; alone, it takes it away itself).
/// The chart installed with Helm (the release record in kube-system, the chart making
/// shareguard-system), its render accepted by the API server's own validation, a pod's
/// share enforced, the metrics Secret made by the chart and its token the one the
/// agents' /metrics accepts, no PodMonitor where its API is not served; `helm upgrade`
/// to a new image tag rolls both DaemonSets and the share stays enforced under the new
/// agent, a pod started after it is enforced too, the token kept; an upgrade that
/// changes only agent.toml rolls the agents and not the plugins; node pools, one per
/// node with configs of their own, replace the one agent DaemonSet and each node
/// publishes its pool's capacity with the shares still enforced; `helm rollback` to the
/// first revision puts the first image and the one DaemonSet back and the shares are
/// enforced again;
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
    let chart = &chart_dir();
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary directory: {e}"));
    // What a user's values name: the image (built here, as no registry is reachable).
    // podMonitor stays on: this cluster serves no PodMonitor API (no Prometheus
    // Operator), so the chart must leave it out for the install to succeed.
    let values = work.path().join("values.yaml");
    std::fs::write(
        &values,
        "image:\n  repository: localhost/shareguard\n  tag: dev\n",
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

    // Every shareguard pod on `tag` (both DaemonSets, both nodes).
    let all_on = |tag: &str| {
        let image = format!(" localhost/shareguard:{tag}");
        wait_for(
            &format!("every shareguard pod on {tag}"),
            POD_TIMEOUT,
            || {
                let images = shareguard_images(&c);
                if images.len() == 2 * NODES.len() && images.iter().all(|i| i.ends_with(&image)) {
                    Ok(())
                } else {
                    Err(format!("{images:?}"))
                }
            },
        );
    };
    // The share of the first pod enforced again by the agent on its node now.
    let enforced_again = |share: &str, what: &str| {
        wait_for(what, STATUS_TIMEOUT, || {
            match share_phase(&c, NODES[0], share).as_str() {
                "ENFORCED" => Ok(()),
                other => Err(other.to_owned()),
            }
        });
    };

    let mut args = vec!["install", "shareguard", chart];
    args.extend(release);
    args.extend(["-f", values, "--wait", "--timeout", "5m"]);
    let notes = c.helm(&args);
    rollout(&c);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 1));
    assert!(notes.contains("No PodMonitor was made"), "{notes}");
    // The chart made the metrics token, and each node's agent serves /metrics to it
    // alone.
    let token = metrics_token(&c);
    assert_eq!(token.len(), 48, "{token:?}");
    for node in NODES {
        assert!(
            scrape(node, Some(&token)).starts_with("200 ")
                && scrape(node, Some("not-the-token")).starts_with("401")
                && scrape(node, None).starts_with("401"),
            "{node}: /metrics with and without the chart's token: {} / {}",
            scrape(node, Some(&token))
                .lines()
                .next()
                .unwrap_or_default(),
            scrape(node, None)
        );
    }
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
    all_on("helm-2");
    enforced_again(&share, "the new agent to enforce the share again");
    wait_enforced_status(&c, &before.name);
    let after = c.namespace("e2e-zz");
    enforced_pod(&c, &after.name, "p", NODES[1], "10M", ClaimKind::Template);
    assert_eq!(
        metrics_token(&c),
        token,
        "the upgrade changed the metrics token"
    );

    // A config change alone (a comment in agent.toml) rolls the agents through the
    // config's checksum, and only them: the plugin's pod template did not change.
    let plugins = pod_uids(&c, "kubelet-plugin");
    let agents = pod_uids(&c, "agent");
    let mut args = vec!["upgrade", "shareguard", chart];
    args.extend(release);
    args.extend([
        "-f",
        values,
        "--set",
        "image.tag=helm-2",
        "--set-string",
        "agent.extraToml=# a change of config",
        "--wait",
        "--timeout",
        "5m",
    ]);
    c.helm(&args);
    rollout(&c);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 3));
    wait_for("new agents on both nodes", POD_TIMEOUT, || {
        let now = pod_uids(&c, "agent");
        if now.len() == NODES.len() && now.is_disjoint(&agents) {
            Ok(())
        } else {
            Err(format!("{now:?} (before {agents:?})"))
        }
    });
    assert_eq!(
        pod_uids(&c, "kubelet-plugin"),
        plugins,
        "the plugins rolled too"
    );
    let config_now = c.ok(&[
        "get",
        "configmap",
        "-n",
        "shareguard-system",
        "shareguard-agent-config",
        "-o",
        "jsonpath={.data.agent\\.toml}",
    ]);
    assert!(config_now.contains("# a change of config"), "{config_now}");
    wait_enforced_status(&c, &before.name);
    wait_enforced_status(&c, &after.name);

    // Node pools, one per node by its hostname label, each with a config of its own:
    // the second node's NIC published at 5G. The one agent DaemonSet gives way to one
    // per pool; each node's slice says its own pool's capacity, and both shares are
    // enforced by the pools' agents.
    let pools = work.path().join("pools.yaml");
    let nic = |value: &str| {
        format!(
            "      - {{name: nic-0, kind: net, interface: auto, allowedNamespaces: [\"*\"], capacity: {{bandwidth: {{value: {value}, default: 10M, validRange: {{min: 10M, step: 10M}}}}}}}}\n"
        )
    };
    std::fs::write(
        &pools,
        format!(
            "nodePools:\n  - name: first\n    nodeSelector: {{kubernetes.io/hostname: {}}}\n    devices:\n{}  - name: second\n    nodeSelector: {{kubernetes.io/hostname: {}}}\n    devices:\n{}",
            NODES[0],
            nic("10G"),
            NODES[1],
            nic("5G")
        ),
    )
    .unwrap_or_else(|e| panic!("{pools:?}: {e}"));
    let pools = pools.to_str().unwrap_or_else(|| panic!("{pools:?}"));
    let mut args = vec!["upgrade", "shareguard", chart];
    args.extend(release);
    args.extend([
        "-f",
        values,
        "-f",
        pools,
        "--set",
        "image.tag=helm-2",
        "--wait",
        "--timeout",
        "5m",
    ]);
    c.helm(&args);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 4));
    for ds in ["shareguard-agent-first", "shareguard-agent-second"] {
        c.ok(&[
            "rollout",
            "status",
            "-n",
            "shareguard-system",
            &format!("daemonset/{ds}"),
            "--timeout=180s",
        ]);
    }
    assert!(
        c.get(&["daemonset", "-n", "shareguard-system", "shareguard-agent"])
            .is_none(),
        "the single pool's DaemonSet is left beside the pools'"
    );
    for (node, want) in [(NODES[0], "10G"), (NODES[1], "5G")] {
        wait_for(
            &format!("{node}'s slice at its pool's {want}"),
            POD_TIMEOUT,
            || {
                let caps: Vec<String> = node_slices(&c, node)
                    .iter()
                    .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
                    .filter(|d| d["name"] == "nic-0")
                    .map(|d| {
                        d["capacity"]["bandwidth"]["value"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned()
                    })
                    .collect();
                if caps == [want] {
                    Ok(())
                } else {
                    Err(format!("{caps:?}"))
                }
            },
        );
    }
    enforced_again(&share, "the first pool's agent to enforce the share again");
    wait_enforced_status(&c, &before.name);
    wait_enforced_status(&c, &after.name);

    second_release_beside_the_first(&c, chart, &work, &token);

    // `helm rollback` to the first release: the first image again on every pod, the
    // shares enforced by the agents it starts, the token kept.
    let mut args = vec!["rollback", "shareguard", "1"];
    args.extend(release);
    args.extend(["--wait", "--timeout", "5m"]);
    c.helm(&args);
    rollout(&c);
    assert_eq!(release_status(&c), ("deployed".to_owned(), 5));
    all_on("dev");
    enforced_again(&share, "the rolled-back agent to enforce the share again");
    wait_enforced_status(&c, &before.name);
    wait_enforced_status(&c, &after.name);
    assert_eq!(
        metrics_token(&c),
        token,
        "the rollback changed the metrics token"
    );

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
