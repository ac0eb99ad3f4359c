use super::*;

/// Every event of shareguard's ResourceSlices that the API server reports while it
/// lives (`kubectl get --watch`), to find any deletion.
struct SliceWatch {
    child: std::process::Child,
    out: tempfile::NamedTempFile,
}

impl SliceWatch {
    fn start(c: &Cluster) -> SliceWatch {
        let out = tempfile::NamedTempFile::new().expect("a temporary file");
        let child = c.spawn(
            &[
                "get",
                "resourceslices",
                "--watch",
                "--output-watch-events",
                "-o",
                "json",
                "--field-selector",
                &format!("spec.driver={DRIVER}"),
            ],
            out.reopen().expect("the temporary file again"),
        );
        let w = SliceWatch { child, out };
        // The watch lists what exists first (ADDED): it has started once it did.
        wait_for("the ResourceSlice watch to start", STATUS_TIMEOUT, || {
            let n = w.events().len();
            if n >= NODES.len() {
                Ok(())
            } else {
                Err(format!("{n} events"))
            }
        });
        w
    }

    /// (type, slice name) of every event so far.
    fn events(&self) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(self.out.path()).unwrap_or_default();
        serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            // The last object may be half written.
            .map_while(Result::ok)
            .map(|e| {
                (
                    e["type"].as_str().unwrap_or_default().to_string(),
                    field(&e, "object.metadata.name")
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            })
            .collect()
    }
}

impl Drop for SliceWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Failed DRA operations kubelet counted on each node, by operation.
fn kubelet_dra_errors(c: &Cluster) -> Vec<(String, String, f64)> {
    NODES
        .iter()
        .flat_map(|node| {
            c.kubelet_dra_operations(node)
                .into_iter()
                .filter(|(op, _, _)| op.ends_with("(error)"))
                .map(|(op, count, _)| (node.to_string(), op, count))
        })
        .collect()
}

/// tests/cluster/update.sh TAG: the image under a new tag on every node, the install
/// applied again with it, both rollouts waited for.
fn update_to(tag: &str) -> std::process::Child {
    script("update.sh", &[tag])
        .spawn()
        .unwrap_or_else(|e| panic!("tests/cluster/update.sh: {e}"))
}

/// Puts the install back on the tag the other scenarios use, also when the scenario
/// failed half way.
struct InstalledTag;

impl Drop for InstalledTag {
    fn drop(&mut self) {
        match update_to("dev").wait() {
            Ok(s) if s.success() => {}
            other => eprintln!("putting shareguard back on localhost/shareguard:dev: {other:?}"),
        }
    }
}

/// g. A rolling update of shareguard to a new image tag while pods with claims start
/// and stop on both nodes: kubelet counts no failed Prepare or Unprepare, no pod gets a
/// FailedPrepareDynamicResources event, no ResourceSlice is deleted (a watch sees no
/// deletion and every slice keeps its uid), and every share is enforced at the end.
/// The plugin's pods surge (the new one registers beside the old one, which passes on
/// what still reaches it); the agent's pods are replaced one node at a time while the
/// plugin holds kubelet's calls for them.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn g_a_rolling_update_fails_no_prepare_and_wipes_no_slice() {
    let c = Cluster::from_env();
    let ns = c.namespace("e2e-g");
    let slices_before = slice_uids(&c, None);
    assert_eq!(slices_before.len(), NODES.len(), "{slices_before:?}");
    let errors_before = kubelet_dra_errors(&c);
    let watch = SliceWatch::start(&c);
    let _restore = InstalledTag;

    let started = std::time::Instant::now();
    let mut update = update_to("e2e-update");
    let mut starts: Vec<(String, Duration)> = Vec::new();
    let mut round = 0;
    // A pod on each node at once, round after round for as long as the update runs
    // (and at least three rounds), each claim prepared by whichever instance kubelet
    // calls at that moment; every second round's pods are deleted again, so that
    // Unprepare runs too.
    loop {
        let updating = update.try_wait().unwrap().is_none();
        if !updating && round >= 3 {
            break;
        }
        let t = std::time::Instant::now();
        let names: Vec<String> = NODES
            .iter()
            .enumerate()
            .map(|(n, node)| {
                let name = format!("p{round}-{n}");
                c.apply(&bandwidth_pod(
                    &ns.name,
                    &name,
                    node,
                    "10M",
                    ClaimKind::Template,
                ));
                name
            })
            .collect();
        for name in &names {
            wait_running(&c, &ns.name, name);
            starts.push((name.clone(), t.elapsed()));
            if round % 2 == 1 {
                c.ok(&["delete", "pod", "-n", &ns.name, name, "--wait=false"]);
            }
        }
        round += 1;
    }
    let status = update.wait().unwrap();
    assert!(status.success(), "tests/cluster/update.sh: {status}");
    let took = started.elapsed();
    eprintln!(
        "update: {took:?}; {} pods started meanwhile, slowest {:?}",
        starts.len(),
        starts.iter().map(|(_, d)| *d).max().unwrap_or_default()
    );

    // The new image everywhere.
    let images = shareguard_images(&c);
    assert!(
        images
            .iter()
            .all(|l| l.ends_with("localhost/shareguard:e2e-update")),
        "{images:?}"
    );
    // Every claim of a pod that still runs is enforced.
    wait_for("every remaining claim Enforced", STATUS_TIMEOUT, || {
        let claims = c.json(&["get", "resourceclaims", "-n", &ns.name]);
        let items = claims["items"].as_array().cloned().unwrap_or_default();
        let reserved: Vec<&Value> = items
            .iter()
            .filter(|k| field(k, "status.reservedFor").is_array())
            .collect();
        let missing: Vec<String> = reserved
            .iter()
            .filter(|k| !driver_entry(k).is_some_and(is_enforced))
            .map(|k| field(k, "metadata.name").to_string())
            .collect();
        if missing.is_empty() && !reserved.is_empty() {
            Ok(())
        } else {
            Err(format!("not enforced: {missing:?}"))
        }
    });
    // Deleted pods' claims are gone, so kubelet unprepared them.
    wait_for("the deleted pods' claims gone", POD_TIMEOUT, || {
        let pods = c.json(&["get", "pods", "-n", &ns.name]);
        let n = pods["items"].as_array().map_or(0, Vec::len);
        let claims = c.json(&["get", "resourceclaims", "-n", &ns.name]);
        let k = claims["items"].as_array().map_or(0, Vec::len);
        if n == k {
            Ok(())
        } else {
            Err(format!("{n} pods, {k} claims"))
        }
    });

    let failed = c.json(&[
        "get",
        "events",
        "-n",
        &ns.name,
        "--field-selector",
        "reason=FailedPrepareDynamicResources",
    ]);
    assert_eq!(
        failed["items"].as_array().map_or(0, Vec::len),
        0,
        "failed prepares during the update: {failed}"
    );
    assert_eq!(
        kubelet_dra_errors(&c),
        errors_before,
        "kubelet's failed DRA operations during the update"
    );
    let deleted: Vec<(String, String)> = watch
        .events()
        .into_iter()
        .filter(|(t, _)| t == "DELETED")
        .collect();
    assert!(
        deleted.is_empty(),
        "slices deleted during the update: {deleted:?}"
    );
    assert_eq!(slice_uids(&c, None), slices_before, "a slice was replaced");
}
