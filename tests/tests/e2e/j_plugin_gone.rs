use super::*;

/// Lets the plugin's DaemonSet reach every node again, also when the scenario failed.
struct PluginOnEveryNode<'a>(&'a Cluster);

impl Drop for PluginOnEveryNode<'_> {
    fn drop(&mut self) {
        let c = self.0;
        let _ = c.run(
            &[
                "-n",
                "shareguard-system",
                "patch",
                "daemonset",
                "shareguard-kubelet-plugin",
                "--type",
                "json",
                "-p",
                r#"[{"op":"remove","path":"/spec/template/spec/affinity"}]"#,
            ],
            None,
        );
        let _ = c.run(
            &[
                "-n",
                "shareguard-system",
                "rollout",
                "status",
                "daemonset/shareguard-kubelet-plugin",
                "--timeout=180s",
            ],
            None,
        );
    }
}

/// j. The plugin taken off one node (its DaemonSet no longer reaches it): kubelet
/// deletes that node's slices once no instance has been registered for 30 s, not
/// before; the other node's slice stays (its plugin is replaced meanwhile, since the
/// pod template changed); back on the node, the plugin publishes the slice again. What
/// an uninstall relies on, and why an update must never leave a node without an
/// instance.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn j_a_node_without_its_plugin_loses_its_slices_after_30s() {
    let c = Cluster::from_env();
    let (node, other) = (NODES[1], NODES[0]);
    let other_before = slice_uids(&c, Some(other));
    assert_eq!(other_before.len(), 1, "{other_before:?}");
    let back = PluginOnEveryNode(&c);
    let affinity = format!(
        r#"{{"spec":{{"template":{{"spec":{{"affinity":{{"nodeAffinity":{{"requiredDuringSchedulingIgnoredDuringExecution":{{"nodeSelectorTerms":[{{"matchExpressions":[{{"key":"kubernetes.io/hostname","operator":"NotIn","values":["{node}"]}}]}}]}}}}}}}}}}}}}}"#
    );
    c.ok(&[
        "-n",
        "shareguard-system",
        "patch",
        "daemonset",
        "shareguard-kubelet-plugin",
        "--type",
        "merge",
        "-p",
        &affinity,
    ]);
    let gone = wait_for("no plugin pod on the node", POD_TIMEOUT, || {
        let pods = c.json(&[
            "get",
            "pods",
            "-n",
            "shareguard-system",
            "-l",
            "app.kubernetes.io/component=kubelet-plugin",
            "--field-selector",
            &format!("spec.nodeName={node}"),
        ]);
        match pods["items"].as_array().map_or(0, Vec::len) {
            0 => Ok(std::time::Instant::now()),
            n => Err(format!("{n} pods")),
        }
    });
    assert_eq!(node_slices(&c, node).len(), 1, "wiped at once");
    wait_for(
        "the node's slices wiped by kubelet",
        POD_TIMEOUT,
        || match node_slices(&c, node).len() {
            0 => Ok(()),
            n => Err(format!("{n} slices")),
        },
    );
    let after = gone.elapsed();
    eprintln!("slices of {node} wiped {after:?} after its plugin pod was gone");
    // kubelet's wiping delay is 30 s from the deregistration, which came with the
    // SIGTERM, up to the pod's 5 s drain before the pod was gone.
    assert!(after >= Duration::from_secs(20), "wiped after {after:?}");
    // The other node's plugin was replaced (the template changed), its slice kept.
    assert_eq!(
        slice_uids(&c, Some(other)),
        other_before,
        "{other}'s slice deleted or replaced"
    );

    drop(back);
    wait_for(
        "the node's slice published again",
        POD_TIMEOUT,
        || match node_slices(&c, node).len() {
            1 => Ok(()),
            n => Err(format!("{n} slices")),
        },
    );
}
