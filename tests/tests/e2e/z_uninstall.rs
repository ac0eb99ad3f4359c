use super::*;

/// z (last: it removes shareguard). The uninstall docs/kubernetes.md gives: the pods
/// with shareguard's claims deleted first, then `kubectl delete -k` of the install's
/// kustomization (tests/cluster/uninstall.sh). Every object of deploy/ goes (the
/// namespace with both DaemonSets, the cluster-wide RBAC, admission policy and
/// DeviceClasses), no shareguard pod is left, and kubelet deletes the driver's
/// ResourceSlices on both nodes once no plugin is registered.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn z_an_uninstall_leaves_no_object_and_no_slice() {
    let c = Cluster::from_env();
    {
        // A pod with a share, gone before the uninstall as the docs say.
        let ns = c.namespace("e2e-z");
        enforced_pod(&c, &ns.name, "p", NODES[0], "10M", ClaimKind::Template);
    }
    run_script("uninstall.sh", &[]);
    assert_nothing_installed(&c);
}
