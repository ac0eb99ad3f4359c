use super::*;

/// k. The admission policy (deploy/admission.yaml) evaluated by the real API server on
/// the plugin's own identity: a token of its ServiceAccount bound to its pod on one
/// node may write that node's slices of shareguard's driver, and is refused another
/// node's slice, another node's pool on its own node, another driver, and a slice name
/// outside its node's bounded set (so that it cannot hold more slices than that), each with
/// the policy's reason; it may write Events it reports as its node's instance on a
/// claim or pod of the Event's namespace, and is refused one as another node's
/// instance or reporter, one about a Secret and one about another namespace's pod; it
/// may change its own driver's entry of a claim on its node, and is refused the same
/// change as another node, a change of the claim's reservedFor and an entry of another
/// driver (the plugin's account impersonated with every permission, so that the policy
/// alone decides; on its own token the API server's authorization refuses the last).
/// Server-side dry runs: admission runs, nothing is stored.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn k_the_admission_policy_keeps_a_plugin_to_its_node_pool_and_driver() {
    let c = Cluster::from_env();
    let (node, other) = (NODES[0], NODES[1]);
    let pod = c.shareguard_pod(node, "kubelet-plugin");
    let pod_uid = c.json(&["get", "pod", "-n", "shareguard-system", &pod])["metadata"]["uid"]
        .as_str()
        .expect("the pod's uid")
        .to_string();
    let token = c.ok(&[
        "-n",
        "shareguard-system",
        "create",
        "token",
        "shareguard-kubelet-plugin",
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        &pod,
        "--bound-object-uid",
        &pod_uid,
        "--duration",
        "10m",
    ]);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let plugin = c.with_token(token.trim(), dir.path());
    // The plugin names its slices `<node>-<driver>-<n>`, n below 16 (the chart's
    // kubeletPlugin.maxSlicesPerNode), from 0 up: the last of them is free.
    let free = format!("{node}-{DRIVER}-15");
    let named = |meta: &str, node_name: &str, pool: &str, driver: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {{{meta}}}\nspec:\n  driver: {driver}\n  nodeName: {node_name}\n  pool: {{name: {pool}, generation: 1, resourceSliceCount: 1}}\n  devices: []\n"
        )
    };
    let slice = |node_name: &str, pool: &str, driver: &str| {
        named(&format!("name: {free}"), node_name, pool, driver)
    };
    let create = |doc: String| {
        let out = plugin.run(&["create", "--dry-run=server", "-f", "-"], Some(&doc));
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };

    let (ok, err) = create(slice(node, node, DRIVER));
    assert!(ok, "its own node, pool and driver refused: {err}");
    let (ok, err) = create(slice(node, &format!("{node}/nics"), DRIVER));
    assert!(ok, "a pool below its node's name refused: {err}");
    for (doc, reason) in [
        (
            slice(other, other, DRIVER),
            "may write only ResourceSlices of the node its pod runs on",
        ),
        (
            slice(node, other, DRIVER),
            "may write only ResourceSlices of its own node's pools",
        ),
        (
            slice(node, &format!("{node}0"), DRIVER),
            "may write only ResourceSlices of its own node's pools",
        ),
        (
            slice(node, node, "other.example.com"),
            "may write only ResourceSlices of its own driver",
        ),
        // How many: a name outside the node's 16, however it is spelled.
        (
            named(&format!("name: {node}-{DRIVER}-16"), node, node, DRIVER),
            "may write only ResourceSlices named",
        ),
        (
            named(&format!("name: {node}-{DRIVER}-03"), node, node, DRIVER),
            "may write only ResourceSlices named",
        ),
        (
            named(&format!("name: {other}-{DRIVER}-15"), node, node, DRIVER),
            "may write only ResourceSlices named",
        ),
        (
            named(
                &format!("generateName: {node}-{DRIVER}-"),
                node,
                node,
                DRIVER,
            ),
            "may write only ResourceSlices named",
        ),
    ] {
        let (ok, err) = create(doc.clone());
        assert!(!ok, "allowed:\n{doc}");
        assert!(
            err.contains("ValidatingAdmissionPolicy") && err.contains(reason),
            "{err}"
        );
    }
    // Events: only its own reports, on a claim or pod of the Event's namespace.
    let ns = c.namespace("e2e-k");
    let event = |instance: &str, controller: &str, kind: &str, api: &str, in_ns: &str| {
        format!(
            "apiVersion: events.k8s.io/v1\nkind: Event\nmetadata: {{generateName: e2e-k-, namespace: {}}}\neventTime: \"2026-01-01T00:00:00.000000Z\"\nreportingController: {controller}\nreportingInstance: {instance}\naction: Prepare\nreason: ShareEnforced\ntype: Normal\nnote: e2e\nregarding: {{apiVersion: {api}, kind: {kind}, name: x, namespace: {in_ns}, uid: 00000000-0000-4000-8000-000000000000}}\n",
            ns.name
        )
    };
    let own = format!("kubelet-plugin-{node}");
    let ctl = "shareguard/kubelet-plugin";
    for (kind, api) in [("ResourceClaim", "resource.k8s.io/v1"), ("Pod", "v1")] {
        let (ok, err) = create(event(&own, ctl, kind, api, &ns.name));
        assert!(ok, "its own Event on a {kind} refused: {err}");
    }
    for (doc, reason) in [
        (
            event(
                &format!("kubelet-plugin-{other}"),
                ctl,
                "Pod",
                "v1",
                &ns.name,
            ),
            "may write only Events it reports itself",
        ),
        (
            event(&own, "kubelet", "Pod", "v1", &ns.name),
            "may write only Events it reports itself",
        ),
        (
            event(&own, ctl, "Secret", "v1", &ns.name),
            "regarding a ResourceClaim or a Pod of the Event's own namespace",
        ),
        (
            event(&own, ctl, "Pod", "v1", "kube-system"),
            "regarding a ResourceClaim or a Pod of the Event's own namespace",
        ),
    ] {
        let (ok, err) = create(doc.clone());
        assert!(!ok, "allowed:\n{doc}");
        assert!(
            err.contains("ValidatingAdmissionPolicy") && err.contains(reason),
            "{err}"
        );
    }
    drop(ns);

    // Claim status: only its own driver's entries, of claims allocated on its node. From
    // 1.36 the API server's own authorization (resourceclaims/driver) refuses the same
    // first; the plugin's account impersonated with every permission (system:masters)
    // meets the policy alone.
    let ns = c.namespace("e2e-k-status");
    enforced_pod(&c, &ns.name, "client", node, "10M", ClaimKind::Template);
    let claim = only_claim(&c, &ns.name);
    let claim_name = field(&claim, "metadata.name")
        .as_str()
        .expect("the claim's name")
        .to_string();
    let ours = field(&claim, "status.devices")
        .as_array()
        .and_then(|d| d.iter().position(|e| e["driver"] == DRIVER))
        .expect("the claim's entry of shareguard");
    let user = "system:serviceaccount:shareguard-system:shareguard-kubelet-plugin";
    let patch_claim_as = |claim_name: &str, on: &str, patch: &str| {
        let extra = format!("authentication.kubernetes.io/node-name={on}");
        let out = c.run(
            &[
                "patch",
                "resourceclaim",
                "-n",
                &ns.name,
                claim_name,
                "--subresource=status",
                "--type=json",
                "-p",
                patch,
                "--dry-run=server",
                "--as",
                user,
                "--as-group",
                "system:masters",
                "--as-group",
                "system:authenticated",
                "--as-user-extra",
                &extra,
            ],
            None,
        );
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let patch_as = |on: &str, patch: &str| patch_claim_as(&claim_name, on, patch);
    let own_entry = format!(
        r#"[{{"op":"replace","path":"/status/devices/{ours}/data","value":{{"e2e":"k"}}}}]"#
    );
    let (ok, err) = patch_as(node, &own_entry);
    assert!(ok, "its own entry of a claim on its node refused: {err}");
    for (on, patch, reason) in [
        (
            other,
            own_entry.clone(),
            "may write the status only of claims allocated on the node its pod runs on",
        ),
        (
            node,
            r#"[{"op":"add","path":"/status/reservedFor/-","value":{"resource":"pods","name":"x","uid":"00000000-0000-4000-8000-000000000001"}}]"#.to_owned(),
            "may change only its own driver's entries",
        ),
    ] {
        let (ok, err) = patch_as(on, &patch);
        assert!(!ok, "allowed as {on}: {patch}");
        assert!(
            err.contains("ValidatingAdmissionPolicy") && err.contains(reason),
            "{err}"
        );
    }
    // Another driver's entry: the API server takes an entry only for a device the claim
    // is allocated, so a claim on this node is allocated (by hand, as the scheduler
    // would) a device of another driver. A claim allocated and never reserved stays
    // allocated (the claim controller deallocates only when the last user leaves).
    c.apply(&format!(
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: other-driver, namespace: {}}}\nspec:\n  devices:\n    requests:\n    - name: r\n      exactly: {{deviceClassName: shareguard-net-bandwidth}}\n",
        ns.name
    ));
    c.ok(&[
        "patch",
        "resourceclaim",
        "-n",
        &ns.name,
        "other-driver",
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(
            r#"{{"status":{{"allocation":{{"devices":{{"results":[{{"request":"r","driver":"other.example.com","pool":"{node}","device":"d0"}}]}},"nodeSelector":{{"nodeSelectorTerms":[{{"matchFields":[{{"key":"metadata.name","operator":"In","values":["{node}"]}}]}}]}}}}}}}}"#
        ),
    ]);
    let other_entry = format!(
        r#"[{{"op":"add","path":"/status/devices","value":[{{"driver":"other.example.com","pool":"{node}","device":"d0","data":{{"e2e":"k"}}}}]}}]"#
    );
    let (ok, err) = patch_claim_as("other-driver", node, &other_entry);
    assert!(!ok, "another driver's entry allowed: {other_entry}");
    assert!(
        err.contains("ValidatingAdmissionPolicy")
            && err.contains("may change only its own driver's entries"),
        "{err}"
    );
    // On its own token (no impersonation), the API server's authorization of 1.36
    // (resourceclaims/driver, granted for shareguard's driver only) refuses it first.
    // Server-side apply, as the plugin writes: `kubectl patch` would GET the claim
    // first, which the plugin may not.
    let out = plugin.run(
        &[
            "apply",
            "--server-side",
            "--subresource=status",
            &format!("--field-manager={DRIVER}"),
            "--dry-run=server",
            "-f",
            "-",
        ],
        Some(&format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: other-driver, namespace: {}}}\nstatus:\n  devices:\n  - {{driver: other.example.com, pool: {node}, device: d0, data: {{e2e: k}}}}\n",
            ns.name
        )),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another driver's entry allowed");
    assert!(
        err.contains("forbidden") && err.contains("other.example.com"),
        "{err}"
    );
    drop(ns);

    // A token that names no node (not bound to a pod) is refused everything.
    let unbound = c.ok(&[
        "-n",
        "shareguard-system",
        "create",
        "token",
        "shareguard-kubelet-plugin",
        "--duration",
        "10m",
    ]);
    let dir2 = tempfile::tempdir().expect("a temporary directory");
    let out = c.with_token(unbound.trim(), dir2.path()).run(
        &["create", "--dry-run=server", "-f", "-"],
        Some(&slice(node, node, DRIVER)),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("must call with a pod-bound ServiceAccount token"),
        "{err}"
    );
}

/// Deletes the claim-namespace policy and its binding when dropped, so that a failed
/// assertion leaves no policy refusing the next scenarios' claims.
struct ClaimNamespacePolicy(Cluster);

impl Drop for ClaimNamespacePolicy {
    fn drop(&mut self) {
        for kind in [
            "validatingadmissionpolicybinding",
            "validatingadmissionpolicy",
        ] {
            let _ = self.0.run(
                &[
                    "delete",
                    kind,
                    "shareguard-claim-namespaces",
                    "--ignore-not-found",
                ],
                None,
            );
        }
    }
}

/// k2. The chart's claim-namespace policy (deploy/chart/templates/claim-namespaces.yaml,
/// made where devices do not allow every namespace) evaluated by the real API server:
/// with the NICs allowed to one namespace and the GPU to all, a claim, a claim template
/// and a claim whose first available subrequest names shareguard-net-bandwidth are
/// refused in another namespace before anything is scheduled, with a message that names
/// the namespace, the class and the namespaces allowed; the same three are taken in
/// the allowed namespace, and a GPU claim is taken in both. Server-side dry runs.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn k2_a_claim_in_a_namespace_no_device_allows_is_refused_before_scheduling() {
    let c = Cluster::from_env();
    let allowed = c.namespace("e2e-k2-allowed");
    let refused = c.namespace("e2e-k2-refused");
    let chart = &chart_dir();
    let work = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary directory: {e}"));
    let values = work.path().join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "agent:\n  devices:\n    - {{name: nic-0, kind: net, interface: auto, allowedNamespaces: [{}], capacity: {{bandwidth: {{value: 10G}}}}}}\n    - {{name: gpu-0, kind: gpu, index: 0, allowedNamespaces: [\"*\"], capacity: {{memory: {{default: 1Gi}}}}}}\n",
            allowed.name
        ),
    )
    .unwrap_or_else(|e| panic!("{values:?}: {e}"));
    let values = values.to_str().unwrap_or_else(|| panic!("{values:?}"));
    let policy = c.helm(&[
        "template",
        "shareguard",
        chart,
        "-f",
        values,
        "--show-only",
        "templates/claim-namespaces.yaml",
    ]);
    assert!(
        policy.contains("kind: ValidatingAdmissionPolicyBinding"),
        "{policy}"
    );
    let _guard = ClaimNamespacePolicy(c.clone());
    c.apply(&policy);

    let request = |class: &str, first_available: bool| {
        if first_available {
            format!(
                "    - name: r\n      firstAvailable:\n        - {{name: a, deviceClassName: shareguard-accounted, capacity: {{requests: {{bandwidth: 10M}}}}}}\n        - {{name: b, deviceClassName: {class}, capacity: {{requests: {{bandwidth: 10M}}}}}}\n"
            )
        } else {
            format!("    - name: r\n      exactly: {{deviceClassName: {class}}}\n")
        }
    };
    let claim = |class: &str, first_available: bool| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: k2}}\nspec:\n  devices:\n    requests:\n{}",
            request(class, first_available)
        )
    };
    let template = |class: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: k2}}\nspec:\n  spec:\n    devices:\n      requests:\n{}",
            request(class, false)
                .lines()
                .map(|l| format!("  {l}\n"))
                .collect::<String>()
        )
    };
    // A poll: the API server takes a new policy into its admission a moment after the
    // write.
    let create = |ns: &str, doc: &str| {
        let out = c.run(
            &["create", "--dry-run=server", "-n", ns, "-f", "-"],
            Some(doc),
        );
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let net = "shareguard-net-bandwidth";
    wait_for(
        "the policy to refuse a claim",
        STATUS_TIMEOUT,
        || match create(&refused.name, &claim(net, false)) {
            (false, err) if err.contains("may not use DeviceClass") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    for doc in [claim(net, false), claim(net, true), template(net)] {
        let (ok, err) = create(&refused.name, &doc);
        assert!(!ok, "taken in {}: {doc}", refused.name);
        assert!(
            err.contains(&format!(
                "namespace {} may not use DeviceClass {net}: its devices allow {}",
                refused.name, allowed.name
            )),
            "{err}"
        );
        let (ok, err) = create(&allowed.name, &doc);
        assert!(ok, "refused in {}: {err}\n{doc}", allowed.name);
    }
    let gpu = claim("shareguard-gpu-memory", false);
    for ns in [&refused.name, &allowed.name] {
        let (ok, err) = create(ns, &gpu);
        assert!(
            ok,
            "a GPU claim, open to every namespace, refused in {ns}: {err}"
        );
    }
}
