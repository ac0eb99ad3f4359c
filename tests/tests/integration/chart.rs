//! The Helm chart in deploy/chart/ and the plain manifests rendered from it.
//!
//! deploy/*.yaml are the chart's render with the default values, one file per template,
//! byte for byte: one source of truth, whether a user applies deploy/ with kubectl or
//! installs the chart. `SHAREGUARD_WRITE_MANIFESTS=1` rewrites them from the chart. The
//! chart passes `helm lint --strict`, and a render with other values (another driver,
//! image, namespace, node selector, devices, no PodMonitor; and metrics over TLS) is
//! held to what deploy.rs holds deploy/ to: every document its Kubernetes type with no
//! unknown field, the config one the agent's parser accepts, the driver named
//! everywhere a driver is named.
//!
//! Helm comes from scripts/test.sh (`ensure_helm` in scripts/lib.sh builds the pinned
//! version and exports SHAREGUARD_HELM). Without it these tests skip, except under
//! `CI=true`, where they fail.

#![allow(clippy::unwrap_used)] // Helpers of tests, too: a panic is a test failure; it says where.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use serde::Deserialize;
use serde_yaml::Value;
use shareguard::config::node::NodeNameSources;
use shareguard::config::{Config, DeviceKind};
use shareguard::rollout::Stage;
use shareguard_tests::manifests::check_document;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

fn chart() -> PathBuf {
    repo().join("deploy/chart")
}

/// The Helm version scripts/lib.sh pins (`SHAREGUARD_HELM_VERSION=`).
fn pinned_helm_version() -> String {
    let lib = fs::read_to_string(repo().join("scripts/lib.sh")).unwrap();
    lib.lines()
        .find_map(|l| l.strip_prefix("SHAREGUARD_HELM_VERSION="))
        .expect("scripts/lib.sh pins SHAREGUARD_HELM_VERSION")
        .trim()
        .to_owned()
}

/// SHAREGUARD_HELM, else where ensure_helm puts the pinned version. None (a failure
/// under CI=true) when neither is there. No `helm` from PATH: another version could
/// render other bytes, and the comparison with deploy/ would then say nothing of the
/// chart.
fn helm() -> Option<PathBuf> {
    let cache = std::env::var_os("SGC_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/shareguard-cluster"));
    let candidate = match std::env::var_os("SHAREGUARD_HELM") {
        Some(p) => PathBuf::from(p),
        None => cache
            .join(format!("helm-{}", pinned_helm_version()))
            .join("helm"),
    };
    if candidate.is_file() {
        return Some(candidate);
    }
    let why = format!(
        "no helm at {} (SHAREGUARD_HELM, else the pinned version where scripts/lib.sh's ensure_helm builds it; scripts/test.sh runs it)",
        candidate.display()
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}; CI=true, so this fails instead of skipping");
    }
    eprintln!("SKIP: {why}");
    None
}

/// `helm args...` in the repository: success, stdout, stderr.
fn run(helm: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(helm)
        .args(args)
        .current_dir(repo())
        // Helm's own state (repositories, plugins, cache) must not come from the user
        // running the tests, nor go into their home.
        .env("HELM_CONFIG_HOME", repo().join("target/helm/config"))
        .env("HELM_CACHE_HOME", repo().join("target/helm/cache"))
        .env("HELM_DATA_HOME", repo().join("target/helm/data"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", helm.display()));
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// `helm template` of the chart as the release `shareguard` in shareguard-system, with
/// `values` files on top of the defaults, for a cluster without the Prometheus
/// Operator's API.
fn render(helm: &Path, values: &[&Path]) -> String {
    render_with(helm, values, &[])
}

/// What deploy/ is rendered with beside the defaults: the two things a plain manifest
/// cannot do as an install does. The chart asks the cluster whether it serves
/// PodMonitors and PrometheusRules, a manifest cannot (deploy/podmonitor.yaml and
/// deploy/prometheusrule.yaml are applied or left out by their user); and the chart makes the metrics token's Secret with a random token,
/// which in a manifest in the repository would be everyone's.
const PLAIN_MANIFESTS: [&str; 6] = [
    "--api-versions",
    "monitoring.coreos.com/v1/PodMonitor",
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
    "--set",
    "metrics.tokenSecret.create=false",
];

/// [`render`] with `extra` arguments to `helm template`.
fn render_with(helm: &Path, values: &[&Path], extra: &[&str]) -> String {
    let chart = chart();
    let mut args = vec![
        "template",
        "shareguard",
        chart.to_str().unwrap(),
        "--namespace",
        "shareguard-system",
    ];
    for v in values {
        args.extend(["-f", v.to_str().unwrap()]);
    }
    args.extend(extra);
    let (ok, out, err) = run(helm, &args);
    assert!(ok, "helm {}:\n{err}", args.join(" "));
    out
}

/// Helm's output split back into files: template name (e.g. `daemonset.yaml`) ->
/// its documents as a manifest file. Helm prints each document as `---`, `# Source:
/// CHART/templates/NAME`, then the document with its surrounding whitespace trimmed,
/// so a file is its documents joined by `---` lines, ending in one newline.
fn split_by_template(out: &str) -> BTreeMap<String, String> {
    let mut docs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<(String, Vec<&str>)> = None;
    let mut flush = |c: Option<(String, Vec<&str>)>| {
        if let Some((name, lines)) = c {
            docs.entry(name)
                .or_default()
                .push(lines.join("\n").trim().to_owned());
        }
    };
    for line in out.lines() {
        if line == "---" {
            flush(current.take());
        } else if let Some(src) = line.strip_prefix("# Source: shareguard/templates/") {
            let c = current.as_mut().expect("a # Source: line after ---");
            assert!(c.0.is_empty() && c.1.is_empty(), "a second # Source: line");
            c.0 = src.to_owned();
        } else {
            current
                .get_or_insert_with(|| (String::new(), Vec::new()))
                .1
                .push(line);
        }
        if line == "---" {
            current = Some((String::new(), Vec::new()));
        }
    }
    flush(current.take());
    assert!(
        !docs.contains_key(""),
        "output outside a # Source: document:\n{out}"
    );
    docs.into_iter()
        .map(|(name, d)| (name, d.join("\n---\n") + "\n"))
        .collect()
}

/// The first line where `a` and `b` differ, for a message.
fn first_different_line(a: &str, b: &str) -> String {
    let (mut la, mut lb) = (a.lines(), b.lines());
    for n in 1.. {
        match (la.next(), lb.next()) {
            (None, None) => return "only in the line endings".to_owned(),
            (x, y) if x == y => {}
            (x, y) => {
                return format!(
                    "line {n}:\n  deploy/: {}\n  chart:   {}",
                    x.unwrap_or("(end)"),
                    y.unwrap_or("(end)")
                );
            }
        }
    }
    unreachable!()
}

#[test]
fn helm_lint_accepts_the_chart_strictly() {
    let Some(helm) = helm() else { return };
    let chart = chart();
    let chart = chart.to_str().unwrap();
    for args in [vec!["lint", chart], vec!["lint", "--strict", chart]] {
        let (ok, out, err) = run(&helm, &args);
        assert!(ok, "helm {}:\n{out}\n{err}", args.join(" "));
        assert!(
            out.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{out}"
        );
    }
    // With every value this file's other test sets, too.
    let dir = tempfile::tempdir().unwrap();
    let values = dir.path().join("values.yaml");
    fs::write(&values, OTHER_VALUES).unwrap();
    let (ok, out, err) = run(
        &helm,
        &["lint", "--strict", chart, "-f", values.to_str().unwrap()],
    );
    assert!(ok, "helm lint --strict with other values:\n{out}\n{err}");
}

#[test]
fn the_chart_is_the_workspace_version_and_its_image() {
    let chart: Value =
        serde_yaml::from_str(&fs::read_to_string(chart().join("Chart.yaml")).unwrap()).unwrap();
    assert_eq!(chart["apiVersion"], "v2");
    assert_eq!(chart["name"], "shareguard");
    // The image tag defaults to appVersion: the workspace's version, which `make image`
    // names its image by.
    assert_eq!(chart["appVersion"], env!("CARGO_PKG_VERSION"));
}

/// deploy/*.yaml are the default render ([`PLAIN_MANIFESTS`]).
/// `SHAREGUARD_WRITE_MANIFESTS=1` writes them.
#[test]
fn deploy_manifests_are_the_charts_default_render() {
    let Some(helm) = helm() else { return };
    let rendered = split_by_template(&render_with(&helm, &[], &PLAIN_MANIFESTS));
    let deploy = repo().join("deploy");
    if std::env::var_os("SHAREGUARD_WRITE_MANIFESTS").is_some() {
        for (name, text) in &rendered {
            fs::write(deploy.join(name), text).unwrap();
        }
    }
    // Every template renders with the defaults, and every manifest in deploy/ is a
    // template's: none is edited by hand beside the chart.
    let files: BTreeSet<String> = fs::read_dir(&deploy)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    let templates: BTreeSet<String> = rendered.keys().cloned().collect();
    assert_eq!(
        files, templates,
        "deploy/*.yaml and the chart's templates differ in files"
    );
    let mut stale = Vec::new();
    for (name, text) in &rendered {
        let on_disk = fs::read_to_string(deploy.join(name)).unwrap();
        if &on_disk != text {
            stale.push(format!(
                "deploy/{name}: {}",
                first_different_line(&on_disk, text)
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "deploy/ is not the chart's default render; change deploy/chart/ and rerun this test \
         with SHAREGUARD_WRITE_MANIFESTS=1 (`SHAREGUARD_WRITE_MANIFESTS=1 cargo test -p \
         shareguard-tests --test integration chart::`):\n{}",
        stale.join("\n")
    );
}

#[test]
fn the_splitter_rebuilds_files_from_helms_output() {
    // Helm's framing: documents trimmed, each after `---` and its template's name.
    let out = "---\n# Source: shareguard/templates/a.yaml\n# head\nkind: A\n---\n# Source: shareguard/templates/b.yaml\nkind: B\n---\n# Source: shareguard/templates/a.yaml\n# between\nkind: A2\n";
    let files = split_by_template(out);
    assert_eq!(
        files["a.yaml"],
        "# head\nkind: A\n---\n# between\nkind: A2\n"
    );
    assert_eq!(files["b.yaml"], "kind: B\n");
    assert_eq!(files.len(), 2);
}

/// Values unlike the defaults in every way the chart offers.
const OTHER_VALUES: &str = r#"
driverName: gpu.acme.io
namespace:
  name: sg
  create: false
image:
  repository: registry.acme.io/shareguard
  tag: "9.9.9"
  digest: "sha256:5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e"
  pullPolicy: Always
imagePullSecrets:
  - name: regcred
agent:
  nodeSelector:
    acme.io/shareguard: "true"
  resources:
    requests: {cpu: 100m, memory: 128Mi}
    limits: {memory: 2Gi}
  devices:
    - name: nic-1
      kind: net
      interface: ens5
      mechanism: bpf-policer
      lineRate: 25G
      allowedNamespaces: [team-a, team-b]
      adminNamespaces: [ops]
      stage: observe
      capacity:
        bandwidth:
          value: 40G
          default: 100M
          validRange: {min: 100M, step: 100M}
    - name: gen-0
      kind: generic
      allowedNamespaces: [team-c]
      capacity:
        memory:
          value: 40Gi
          default: 10Gi
          validValues: [10Gi, 20Gi]
  extraToml: |
    [[node]]
    name = "worker-1"
    [node.device.nic-1]
    interface = "ens6"
    [rollout.class]
    "shareguard-accounted" = "observe"
kubeletPlugin:
  maxSlicesPerNode: 4
  enforcedEvents: false
  nodeSelector:
    acme.io/shareguard: "true"
podMonitor:
  enabled: false
"#;

fn documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_sequence()
        .map(|s| s.iter().map(|x| x.as_str().unwrap()).collect())
        .unwrap_or_default()
}

/// The render with `values`, each document checked as its Kubernetes type.
fn render_checked(helm: &Path, values: &str) -> (String, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    fs::write(&file, values).unwrap();
    let out = render(helm, &[&file]);
    let docs = documents(&out);
    let mut failures = Vec::new();
    for d in &docs {
        if let Err(e) = check_document(&serde_json::to_value(d).unwrap()) {
            failures.push(format!("{:?} {:?}: {e}", d["kind"], d["metadata"]["name"]));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    (out, docs)
}

#[test]
fn other_values_render_valid_manifests_that_use_them() {
    let Some(helm) = helm() else { return };
    let (out, docs) = render_checked(&helm, OTHER_VALUES);
    let driver = "gpu.acme.io";
    // The tag for people, the digest for the nodes (docs/image.md).
    let image = "registry.acme.io/shareguard:9.9.9@sha256:5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e";

    // The default driver, namespace and image are gone, comments included: a comment
    // that named the old driver would mislead whoever reads the installed objects.
    for old in [
        "shareguard.example.com",
        "shareguard-system",
        "shareguard:0.1.0",
    ] {
        assert!(!out.contains(old), "{old} is still in the render");
    }
    let kinds: BTreeSet<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert!(!kinds.contains("PodMonitor"), "podMonitor.enabled=false");
    assert!(!kinds.contains("Namespace"), "namespace.create=false");
    for want in [
        "ConfigMap",
        "DaemonSet",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "DeviceClass",
    ] {
        assert!(kinds.contains(want), "no {want} in the render");
    }
    for d in &docs {
        let ns = &d["metadata"]["namespace"];
        assert!(
            ns.is_null() || ns == "sg",
            "{:?} in namespace {ns:?}",
            d["metadata"]["name"]
        );
    }

    // RBAC: the claim status subresource is granted for this driver only.
    let role = of_kind(&docs, "ClusterRole")[0];
    let named: Vec<Vec<&str>> = role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|r| !r["resourceNames"].is_null())
        .map(|r| strs(&r["resourceNames"]))
        .collect();
    assert_eq!(named, vec![vec![driver]]);
    let binding = of_kind(&docs, "ClusterRoleBinding")[0];
    assert_eq!(binding["subjects"][0]["namespace"], "sg");

    // Admission: this driver, and the plugin's account in this namespace.
    let policy = serde_json::to_string(&of_kind(&docs, "ValidatingAdmissionPolicy")[0]).unwrap();
    assert!(policy.contains(&format!("s.spec.driver == \\\"{driver}\\\"")));
    assert!(policy.contains("system:serviceaccount:sg:shareguard-kubelet-plugin"));
    // The bound on a node's slices: the policy and the plugin's flag, from one value.
    assert!(policy.contains("namePrefix.size())) < 4)"), "{policy}");

    // Every DeviceClass selects this driver's devices first.
    let classes = of_kind(&docs, "DeviceClass");
    assert_eq!(classes.len(), 5);
    for c in classes {
        let expr = c["spec"]["selectors"][0]["cel"]["expression"]
            .as_str()
            .unwrap();
        assert!(
            expr.starts_with(&format!("device.driver == \"{driver}\"")),
            "{expr}"
        );
    }

    // The config is one the agent accepts, with these devices, this driver, and the
    // [[node]] table applied on its node.
    let cm = of_kind(&docs, "ConfigMap")[0];
    let toml = cm["data"]["agent.toml"].as_str().unwrap();
    let on = |node: &str| {
        let sources = NodeNameSources {
            given: Some(node.to_owned()),
            host: Some("the-test-host".to_owned()),
        };
        Config::parse_for(toml, "rendered agent.toml", &sources)
            .unwrap_or_else(|e| panic!("the agent refuses the rendered config: {e}\n{toml}"))
    };
    let cfg = on("worker-2");
    let names: Vec<&str> = cfg.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["nic-1", "gen-0"]);
    for d in &cfg.devices {
        assert_eq!(d.driver, driver);
        assert_eq!(d.pool, "worker-2", "the pool is the node's name");
    }
    let nic = &cfg.devices[0];
    assert_eq!(nic.kind, DeviceKind::Net);
    assert_eq!(nic.allowed_namespaces, ["team-a", "team-b"]);
    assert_eq!(nic.admin_namespaces, ["ops"]);
    assert_eq!(nic.stage, Stage::Observe);
    assert_eq!(
        nic.net.clone().unwrap_or_default().line_rate_bps,
        Some(25_000_000_000)
    );
    assert!(toml.contains("interface = \"ens5\""), "{toml}");
    assert!(toml.contains("mechanism = \"bpf-policer\""), "{toml}");
    assert!(
        !toml.contains("value = \"10G\""),
        "the default device is gone"
    );
    let generic = &cfg.devices[1];
    assert_eq!(generic.kind, DeviceKind::Generic);
    assert_eq!(generic.allowed_namespaces, ["team-c"]);
    assert!(generic.capacities.contains_key("memory"));
    // Its class's first stage, from extraToml's [rollout.class].
    assert_eq!(generic.class, "shareguard-accounted");
    assert_eq!(generic.stage, Stage::Observe);
    assert!(
        on("worker-1")
            .devices
            .iter()
            .any(|d| d.name == "nic-1" && d.driver == driver),
        "extraToml's [[node]] table"
    );
    assert!(
        toml.contains("[node.device.nic-1]\ninterface = \"ens6\""),
        "{toml}"
    );

    // Both DaemonSets: the image in every container, the pull policy and secret, and
    // the node selector.
    let sets = of_kind(&docs, "DaemonSet");
    assert_eq!(sets.len(), 2);
    for ds in sets {
        let pod = &ds["spec"]["template"]["spec"];
        let name = ds["metadata"]["name"].as_str().unwrap();
        let containers: Vec<&Value> = ["containers", "initContainers"]
            .iter()
            .flat_map(|k| pod[*k].as_sequence().into_iter().flatten())
            .collect();
        assert!(!containers.is_empty());
        for c in containers {
            assert_eq!(c["image"], image, "{name} {:?}", c["name"]);
            assert_eq!(c["imagePullPolicy"], "Always", "{name}");
        }
        assert_eq!(pod["nodeSelector"]["acme.io/shareguard"], "true", "{name}");
        assert_eq!(pod["imagePullSecrets"][0]["name"], "regcred", "{name}");
        assert_eq!(pod["tolerations"][0]["operator"], "Exists", "{name}");
    }
    let agent = of_kind(&docs, "DaemonSet")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "shareguard-agent")
        .unwrap();
    let res = &agent["spec"]["template"]["spec"]["containers"][0]["resources"];
    assert_eq!(res["requests"]["cpu"], "100m");
    assert_eq!(res["limits"]["memory"], "2Gi");

    // The plugin's directories are the driver's.
    let plugin = serde_json::to_string(
        of_kind(&docs, "DaemonSet")
            .into_iter()
            .find(|d| d["metadata"]["name"] == "shareguard-kubelet-plugin")
            .unwrap(),
    )
    .unwrap();
    for dir in [
        "/var/lib/kubelet/plugins_registry/gpu.acme.io",
        "/var/lib/kubelet/plugins/gpu.acme.io",
    ] {
        assert!(plugin.contains(dir), "{dir} not in the plugin's DaemonSet");
    }
    assert!(
        plugin.contains("\"--max-slices-per-node\",\"4\""),
        "{plugin}"
    );
    assert!(
        plugin.contains("\"--enforced-events\",\"false\""),
        "{plugin}"
    );
}

/// Values the chart cannot use are refused by `helm template` (and so by install,
/// upgrade and lint, which check the same schema) before anything renders, naming the
/// value and the reason: a bound on a node's slices that the slice names cannot carry
/// (one or two digits), a misspelt key (which would otherwise be ignored in silence), a
/// device kind the agent does not know, the metrics Secret's earlier spelling as a
/// plain name, a net-only key on a GPU, a quantity that is not one.
#[test]
fn values_the_chart_cannot_use_are_refused_naming_them() {
    let Some(helm) = helm() else { return };
    let device = "agent:\n  devices:\n    - name: d\n      ";
    let cases: Vec<(String, &str, &str)> = vec![
        (
            "kubeletPlugin:\n  maxSlicesPerNode: 0\n".into(),
            "/kubeletPlugin/maxSlicesPerNode",
            "minimum",
        ),
        (
            "kubeletPlugin:\n  maxSlicesPerNode: 101\n".into(),
            "/kubeletPlugin/maxSlicesPerNode",
            "maximum",
        ),
        (
            "kubeletPlugin:\n  maxSlicesPerNode: -1\n".into(),
            "/kubeletPlugin/maxSlicesPerNode",
            "minimum",
        ),
        (
            "podMonitor:\n  enabeld: false\n".into(),
            "/podMonitor",
            "'enabeld' not allowed",
        ),
        (
            format!("{device}kind: nic\n"),
            "/agent/devices/0/kind",
            "must be one of",
        ),
        (
            "metrics:\n  tokenSecret: mine\n".into(),
            "/metrics/tokenSecret",
            "want object",
        ),
        (
            format!("{device}kind: gpu\n      interface: eth0\n"),
            "/agent/devices/0",
            "not",
        ),
        (
            format!(
                "{device}kind: net\n      capacity:\n        bandwidth:\n          value: ten gigabits\n"
            ),
            "/agent/devices/0/capacity/bandwidth/value",
            "does not match pattern",
        ),
        (
            "image:\n  digest: latest\n".into(),
            "/image/digest",
            "does not match pattern",
        ),
        (
            "agent:\n  logLevel: \"info; rm -rf\"\n".into(),
            "/agent/logLevel",
            "does not match pattern",
        ),
    ];
    for (values, at, why) in &cases {
        let err = refused(&helm, values);
        assert!(
            err.contains(&format!("at '{at}'")) && err.contains(why),
            "{values}: wanted {at} and {why:?} in: {err}"
        );
    }
}

/// What `helm template` says refusing the chart with `values`; a panic if it renders
/// anything.
fn refused(helm: &Path, values: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    fs::write(&file, values).unwrap();
    let chart = chart();
    let (ok, out, err) = run(
        helm,
        &[
            "template",
            "shareguard",
            chart.to_str().unwrap(),
            "-f",
            file.to_str().unwrap(),
        ],
    );
    assert!(!ok && out.is_empty(), "rendered with {values}:\n{out}");
    err
}

/// The PodMonitor is made where the cluster serves its API (`helm template` is told so
/// with --api-versions), left out where it does not unless `trustCRDsExist`, and never
/// with `enabled: false`.
#[test]
fn the_podmonitor_is_made_only_where_its_api_is_served() {
    let Some(helm) = helm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let api = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"];
    let count = |values: &str, extra: &[&str]| {
        let file = dir.path().join("values.yaml");
        fs::write(&file, values).unwrap();
        let docs = documents(&render_with(&helm, &[&file], extra));
        of_kind(&docs, "PodMonitor").len()
    };
    assert_eq!(count("{}", &[]), 0, "no PodMonitor API, yet a PodMonitor");
    assert_eq!(count("{}", &api), 1, "the API is served, no PodMonitor");
    assert_eq!(count("podMonitor:\n  trustCRDsExist: true\n", &[]), 1);
    assert_eq!(count("podMonitor:\n  enabled: false\n", &api), 0);
    assert_eq!(
        count(
            "podMonitor:\n  enabled: false\n  trustCRDsExist: true\n",
            &api
        ),
        0
    );
    // The release notes say which it was.
    let chart = chart();
    let notes = |extra: &[&str]| {
        let mut args = vec![
            "install",
            "--dry-run=client",
            "shareguard",
            chart.to_str().unwrap(),
            "-n",
            "kube-system",
        ];
        args.extend(extra);
        let (ok, out, err) = run(&helm, &args);
        assert!(ok, "{err}");
        out[out.find("NOTES:").expect("release notes")..].to_owned()
    };
    let without = notes(&[]);
    assert!(without.contains("No PodMonitor was made"), "{without}");
    assert!(
        without.contains("- nic-0 (net, interface auto: each node's default route's)"),
        "{without}"
    );
    let with = notes(&["--set", "podMonitor.trustCRDsExist=true"]);
    assert!(with.contains("A PodMonitor scrapes them"), "{with}");
}

/// The PrometheusRule is made as the PodMonitor is (where its API is served, or
/// trusted), carries the rule files' groups with the agent-down alert reading the job
/// of the release's namespace, and the labels given; the dashboard ConfigMap, when
/// asked for, holds deploy/grafana/'s file as it is, with the sidecar's label, in the
/// namespace given.
#[test]
fn the_rules_and_the_dashboard_come_from_deploy_s_files() {
    let Some(helm) = helm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let docs_of = |values: &str, extra: &[&str]| {
        let file = dir.path().join("values.yaml");
        fs::write(&file, values).unwrap();
        documents(&render_with(&helm, &[&file], extra))
    };
    let api = ["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"];
    assert!(of_kind(&docs_of("{}", &[]), "PrometheusRule").is_empty());
    assert!(
        of_kind(
            &docs_of("prometheusRule:\n  enabled: false\n", &api),
            "PrometheusRule"
        )
        .is_empty()
    );
    let docs = docs_of(
        "namespace:\n  name: sg\nprometheusRule:\n  labels:\n    release: prometheus\n",
        &api,
    );
    let rules = of_kind(&docs, "PrometheusRule");
    assert_eq!(rules.len(), 1);
    check_document(&serde_json::to_value(rules[0]).unwrap()).unwrap();
    assert_eq!(rules[0]["metadata"]["namespace"], "sg");
    assert_eq!(rules[0]["metadata"]["labels"]["release"], "prometheus");
    let text = serde_yaml::to_string(&rules[0]["spec"]).unwrap();
    assert!(
        text.contains(r#"up{job="sg/shareguard-agent"} == 0"#),
        "{text}"
    );
    assert!(!text.contains("shareguard-system"), "{text}");
    let groups: Vec<&str> = rules[0]["spec"]["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|g| g["name"].as_str().unwrap())
        .collect();
    let mut want = Vec::new();
    for f in ["shareguard-alerts.rules.yaml", "shareguard-slo.rules.yaml"] {
        let file: Value = serde_yaml::from_str(
            &fs::read_to_string(repo().join("deploy/prometheus").join(f)).unwrap(),
        )
        .unwrap();
        for g in file["groups"].as_sequence().unwrap() {
            want.push(g["name"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(groups, want);

    let dashboards = |docs: &[Value]| -> Vec<Value> {
        of_kind(docs, "ConfigMap")
            .into_iter()
            .filter(|c| c["metadata"]["name"] == "shareguard-grafana-dashboard")
            .cloned()
            .collect()
    };
    assert!(
        dashboards(&docs_of("{}", &[])).is_empty(),
        "a dashboard by default"
    );
    let docs = docs_of(
        "grafanaDashboard:\n  enabled: true\n  namespace: monitoring\n",
        &[],
    );
    let cm = &dashboards(&docs)[0];
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let file = fs::read_to_string(repo().join("deploy/grafana/shareguard-dashboard.json")).unwrap();
    assert_eq!(
        cm["data"]["shareguard-dashboard.json"].as_str().unwrap(),
        file.trim_end_matches('\n')
    );
}

/// `nodePools`: one ConfigMap and agent DaemonSet per pool, named after it, each on its
/// pool's nodes (with agent.nodeSelector) and reading its own config, which holds its
/// own devices and extraToml after agent.extraToml and which the agent's parser takes;
/// the pools' selectors do not overlap by label; no agent of the default pool is left.
/// A pool named twice, or without a nodeSelector, is refused naming it.
#[test]
fn node_pools_render_an_agent_and_config_each() {
    let Some(helm) = helm() else { return };
    let values = r#"
agent:
  nodeSelector: {kubernetes.io/os: linux}
  extraToml: "[slo]\n"
nodePools:
  - name: gpu
    nodeSelector: {nvidia.com/gpu.present: "true"}
    devices:
      - {name: gpu-0, kind: gpu, index: 0, allowedNamespaces: ["*"], capacity: {memory: {default: 1Gi, validRange: {min: 1Gi, step: 1Gi}}}}
    extraToml: |
      [[node]]
      name = "gpu-node-3"
      [node.device.gpu-0]
      index = 1
  - name: cpu
    nodeSelector: {nvidia.com/gpu.present: "false"}
    devices:
      - {name: nic-0, kind: net, interface: auto, allowedNamespaces: ["*"], capacity: {bandwidth: {value: 10G, default: 10M, validRange: {min: 10M, step: 10M}}}}
      - {name: nic-1, kind: net, interface: ens6, allowedNamespaces: [team-a], capacity: {bandwidth: {value: 25G}}}
"#;
    let (_, docs) = render_checked(&helm, values);
    let agents: Vec<&Value> = of_kind(&docs, "DaemonSet")
        .into_iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "agent")
        .collect();
    let names: Vec<&str> = agents
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["shareguard-agent-gpu", "shareguard-agent-cpu"]);
    let configs: BTreeMap<&str, &str> = of_kind(&docs, "ConfigMap")
        .into_iter()
        .map(|c| {
            (
                c["metadata"]["name"].as_str().unwrap(),
                c["data"]["agent.toml"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        configs.keys().copied().collect::<Vec<_>>(),
        ["shareguard-agent-config-cpu", "shareguard-agent-config-gpu"]
    );
    let mut checksums = BTreeSet::new();
    for (agent, (pool, gpu_present, devices)) in agents.iter().zip([
        ("gpu", "true", vec!["gpu-0"]),
        ("cpu", "false", vec!["nic-0", "nic-1"]),
    ]) {
        let spec = &agent["spec"];
        assert_eq!(
            spec["selector"]["matchLabels"]["shareguard-node-pool"],
            pool
        );
        let pod = &spec["template"];
        assert_eq!(pod["metadata"]["labels"]["shareguard-node-pool"], pool);
        checksums.insert(
            pod["metadata"]["annotations"]["checksum/config"]
                .as_str()
                .unwrap(),
        );
        let selector = &pod["spec"]["nodeSelector"];
        assert_eq!(
            selector["nvidia.com/gpu.present"], gpu_present,
            "{selector:?}"
        );
        assert_eq!(selector["kubernetes.io/os"], "linux", "{selector:?}");
        let volume = pod["spec"]["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "config")
            .unwrap();
        let cm = format!("shareguard-agent-config-{pool}");
        assert_eq!(volume["configMap"]["name"], cm.as_str());
        let toml = configs[cm.as_str()];
        assert!(
            toml.contains("[slo]"),
            "agent.extraToml is in every pool's config: {toml}"
        );
        let sources = NodeNameSources {
            given: Some("gpu-node-3".to_owned()),
            host: None,
        };
        let c = Config::parse_for(toml, &cm, &sources)
            .unwrap_or_else(|e| panic!("the agent refuses {cm}: {e}"));
        let got: Vec<&str> = c.devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(got, devices, "{cm}");
        if pool == "gpu" {
            assert!(toml.contains("name = \"gpu-node-3\""), "{toml}");
        } else {
            assert!(
                !toml.contains("gpu-node-3"),
                "another pool's [[node]] table: {toml}"
            );
        }
    }
    assert_eq!(checksums.len(), 2, "two configs, one checksum");

    for (bad, said) in [
        (
            "nodePools:\n  - {name: a, nodeSelector: {pool: p1}, devices: []}\n  - {name: a, nodeSelector: {pool: p2}, devices: []}\n",
            "nodePools: the pool name \"a\" is given twice",
        ),
        (
            "nodePools:\n  - {name: a, devices: []}\n",
            "at '/nodePools/0'",
        ),
        (
            "nodePools:\n  - {name: a, nodeSelector: {}, devices: []}\n",
            "at '/nodePools/0/nodeSelector'",
        ),
    ] {
        let err = refused(&helm, bad);
        assert!(err.contains(said), "{bad}: {err}");
    }
}

/// The claim-namespace policy: none while every class has a device open to every
/// namespace (the defaults), none when turned off; else one validation per closed
/// class, each with the union of its devices' allowed and admin namespaces across
/// every pool, sorted, and a class open through any of its devices left out.
#[test]
fn the_claim_namespace_policy_names_each_closed_class_and_its_namespaces() {
    let Some(helm) = helm() else { return };
    let policies = |values: &str| -> Vec<Value> {
        let (_, docs) = render_checked(&helm, values);
        of_kind(&docs, "ValidatingAdmissionPolicy")
            .into_iter()
            .filter(|p| p["metadata"]["name"] == "shareguard-claim-namespaces")
            .cloned()
            .collect()
    };
    assert!(
        policies("{}").is_empty(),
        "the defaults allow every namespace"
    );
    let pools = r#"
nodePools:
  - name: a
    nodeSelector: {pool: a}
    devices:
      - {name: nic-0, kind: net, interface: auto, allowedNamespaces: [team-b], adminNamespaces: [ops], capacity: {bandwidth: {value: 10G}}}
      - {name: gpu-0, kind: gpu, index: 0, allowedNamespaces: ["*"], capacity: {memory: {default: 1Gi}}}
  - name: b
    nodeSelector: {pool: b}
    devices:
      - {name: nic-0, kind: net, interface: auto, allowedNamespaces: [team-a, team-b], capacity: {bandwidth: {value: 10G}}}
      - {name: mem-0, kind: generic, allowedNamespaces: [team-c], capacity: {memory: {value: 8Gi}}}
"#;
    let found = policies(pools);
    assert_eq!(found.len(), 1);
    let checks: Vec<(String, String)> = found[0]["spec"]["validations"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["expression"].as_str().unwrap().to_owned(),
                v["messageExpression"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    // The two net classes are closed; the GPU classes and the accounted class (which
    // takes any device, the GPU's too) are open.
    assert_eq!(checks.len(), 2, "{checks:#?}");
    for ((expr, message), class) in checks.iter().zip([
        "shareguard-net-bandwidth",
        "shareguard-net-bandwidth-limited",
    ]) {
        assert!(
            expr.contains(&format!("deviceClassName == \"{class}\")")),
            "{expr}"
        );
        assert!(
            expr.contains(r#"request.namespace in ["ops","team-a","team-b"]"#),
            "{expr}"
        );
        assert!(
            message.contains(&format!(
                "may not use DeviceClass {class}: its devices allow ops, team-a, team-b"
            )),
            "{message}"
        );
    }
    let off = format!("{pools}admission:\n  claimNamespaces: false\n");
    assert!(policies(&off).is_empty(), "turned off, yet a policy");
}

/// The token Secret: made by default with a random token of 48 letters and digits
/// (another in each render without a cluster to look in: the one an install finds is
/// kept, which the test cluster shows), named as the agent mounts it and the PodMonitor
/// sends it; none with `create: false`, and the name given is used throughout.
#[test]
fn the_metrics_token_secret_is_made_with_a_random_token_unless_it_is_the_users() {
    let Some(helm) = helm() else { return };
    let token_of = |docs: &[Value]| -> String {
        let secrets = of_kind(docs, "Secret");
        assert_eq!(secrets.len(), 1);
        assert_eq!(secrets[0]["metadata"]["name"], "shareguard-metrics-token");
        assert_eq!(secrets[0]["metadata"]["namespace"], "shareguard-system");
        let b64 = secrets[0]["data"]["token"].as_str().unwrap();
        let out = Command::new("base64")
            .args(["-d"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write as _;
                c.stdin.take().unwrap().write_all(b64.as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let (_, first) = render_checked(&helm, "{}");
    let (_, second) = render_checked(&helm, "{}");
    let (a, b) = (token_of(&first), token_of(&second));
    for t in [&a, &b] {
        assert_eq!(t.len(), 48, "{t:?}");
        assert!(t.chars().all(|c| c.is_ascii_alphanumeric()), "{t:?}");
    }
    assert_ne!(a, b, "two renders made the same token");
    let agent = of_kind(&first, "DaemonSet")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "shareguard-agent")
        .unwrap();
    let vol = agent["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "metrics-token")
        .unwrap();
    assert_eq!(vol["secret"]["secretName"], "shareguard-metrics-token");

    let (out, docs) = render_checked(
        &helm,
        "metrics:\n  tokenSecret:\n    name: scrape-token\n    create: false\npodMonitor:\n  trustCRDsExist: true\n",
    );
    assert!(
        of_kind(&docs, "Secret").is_empty(),
        "create: false, yet a Secret"
    );
    assert!(
        !out.contains("shareguard-metrics-token"),
        "the default name is left"
    );
    let pm = of_kind(&docs, "PodMonitor");
    assert_eq!(
        pm[0]["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]["name"],
        "scrape-token"
    );
}

/// The agents' pod template carries the config's checksum: a change of agent.toml
/// changes the pod template (so an upgrade rolls the agents), a change elsewhere does
/// not. The log levels reach each process's RUST_LOG.
#[test]
fn a_config_change_rolls_the_agents_and_log_levels_reach_both_processes() {
    let Some(helm) = helm() else { return };
    let pod_of = |values: &str, name: &str| -> Value {
        let (_, docs) = render_checked(&helm, values);
        of_kind(&docs, "DaemonSet")
            .into_iter()
            .find(|d| d["metadata"]["name"] == name)
            .unwrap()["spec"]["template"]
            .clone()
    };
    let checksum = |values: &str| -> String {
        let pod = pod_of(values, "shareguard-agent");
        pod["metadata"]["annotations"]["checksum/config"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let base = checksum("{}");
    assert_eq!(base.len(), 64, "{base}");
    assert_eq!(checksum("{}"), base, "the same config, another checksum");
    assert_eq!(
        checksum("image:\n  tag: other\n"),
        base,
        "the image is no config"
    );
    assert_ne!(
        checksum("agent:\n  extraToml: |\n    [slo]\n"),
        base,
        "agent.toml changed, the checksum did not"
    );
    assert_ne!(checksum("driverName: gpu.acme.io\n"), base);

    let rust_log = |pod: &Value| -> String {
        pod["spec"]["containers"][0]["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "RUST_LOG")
            .unwrap()["value"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let values =
        "agent:\n  logLevel: info,shareguard::engine=debug\nkubeletPlugin:\n  logLevel: warn\n";
    assert_eq!(
        rust_log(&pod_of(values, "shareguard-agent")),
        "info,shareguard::engine=debug"
    );
    assert_eq!(
        rust_log(&pod_of(values, "shareguard-kubelet-plugin")),
        "warn"
    );
    assert_eq!(rust_log(&pod_of("{}", "shareguard-kubelet-plugin")), "info");
}

/// A net capacity given as a percentage of the link speed reaches the config as
/// `link_percent`, with no `value`, and the agent takes it: it goes on to read the
/// interface's speed, which this machine lacks.
#[test]
fn link_percent_reaches_the_config() {
    let Some(helm) = helm() else { return };
    let values = r#"
agent:
  devices:
    - name: nic-0
      kind: net
      interface: sg-chart-none0
      allowedNamespaces: ["*"]
      capacity:
        bandwidth:
          linkPercent: 10
          default: 10M
          validRange: {min: 10M, step: 10M}
"#;
    let (_, docs) = render_checked(&helm, values);
    let toml = of_kind(&docs, "ConfigMap")[0]["data"]["agent.toml"]
        .as_str()
        .unwrap();
    let capacity: Vec<&str> = toml
        .lines()
        .map(str::trim)
        .skip_while(|l| *l != "[device.capacity.bandwidth]")
        .take_while(|l| !l.is_empty())
        .collect();
    assert!(capacity.contains(&"link_percent = 10"), "{toml}");
    assert!(!capacity.iter().any(|l| l.starts_with("value")), "{toml}");
    assert!(toml.contains("publishes `link_percent` of the"), "{toml}");
    let sources = NodeNameSources {
        given: Some("worker-1".to_owned()),
        host: None,
    };
    let e = Config::parse_for(toml, "rendered agent.toml", &sources).unwrap_err();
    assert!(
        e.message
            .contains("/sys/class/net/sg-chart-none0/speed cannot be read"),
        "{e}\n{toml}"
    );
}

/// Metrics over TLS: the agent's config names the mounted Secret's files, the
/// DaemonSet mounts it, and the PodMonitor scrapes over https with its tlsConfig.
#[test]
fn metrics_tls_values_reach_the_config_the_mount_and_the_podmonitor() {
    let Some(helm) = helm() else { return };
    let values = r#"
metrics:
  tls:
    secretName: metrics-tls
podMonitor:
  trustCRDsExist: true
  tlsConfig:
    ca: {secret: {name: metrics-tls, key: ca.crt}}
    cert: {secret: {name: prometheus-client, key: tls.crt}}
    keySecret: {name: prometheus-client, key: tls.key}
"#;
    let (_, docs) = render_checked(&helm, values);
    let toml = of_kind(&docs, "ConfigMap")[0]["data"]["agent.toml"]
        .as_str()
        .unwrap();
    let sources = NodeNameSources {
        given: Some("worker-1".to_owned()),
        host: None,
    };
    Config::parse_for(toml, "rendered agent.toml", &sources)
        .unwrap_or_else(|e| panic!("the agent refuses the rendered config: {e}"));
    assert!(
        toml.lines().any(|l| l
            .trim_start()
            .starts_with("metrics_tls = { cert_file = \"/etc/shareguard-metrics-tls/tls.crt\"")),
        "{toml}"
    );
    let agent = of_kind(&docs, "DaemonSet")
        .into_iter()
        .find(|d| d["metadata"]["name"] == "shareguard-agent")
        .unwrap();
    let pod = &agent["spec"]["template"]["spec"];
    let vol = pod["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "metrics-tls")
        .expect("a metrics-tls volume");
    assert_eq!(vol["secret"]["secretName"], "metrics-tls");
    let mounted = pod["containers"][0]["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|m| m["name"] == "metrics-tls" && m["mountPath"] == "/etc/shareguard-metrics-tls");
    assert!(
        mounted,
        "metrics-tls is not mounted where metrics_tls reads"
    );
    let pm = of_kind(&docs, "PodMonitor");
    assert_eq!(pm.len(), 1);
    let ep = &pm[0]["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["scheme"], "https");
    assert_eq!(ep["tlsConfig"]["keySecret"]["name"], "prometheus-client");
}

/// `gpu.mps` runs the agent as the mps mechanism needs it, and deploy/gpu-mps/ holds
/// that render of the agent's DaemonSet (`SHAREGUARD_WRITE_MANIFESTS=1` writes it):
/// privileged (no allowPrivilegeEscalation: false beside it, which the API refuses),
/// the MPS directory Bidirectional, `utility,compute` from NVIDIA's runtime.
/// `gpu.driverRoot` mounts the host's driver root read-only at /driver-root and names
/// both paths in every gpu device of the config, which the agent's parser accepts.
#[test]
fn gpu_values_give_the_agent_what_mps_and_the_driver_root_need() {
    let Some(helm) = helm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    fs::write(&file, "gpu:\n  mps: true\n").unwrap();
    let rendered = split_by_template(&render_with(&helm, &[&file], &PLAIN_MANIFESTS));
    let path = repo().join("deploy/gpu-mps/daemonset.yaml");
    if std::env::var_os("SHAREGUARD_WRITE_MANIFESTS").is_some() {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, &rendered["daemonset.yaml"]).unwrap();
    }
    let on_disk = fs::read_to_string(&path).unwrap_or_default();
    assert!(
        on_disk == rendered["daemonset.yaml"],
        "deploy/gpu-mps/daemonset.yaml is not the chart's render with gpu.mps=true; rerun \
         with SHAREGUARD_WRITE_MANIFESTS=1: {}",
        first_different_line(&on_disk, &rendered["daemonset.yaml"])
    );

    let agent_of = |values: &str| {
        let (_, docs) = render_checked(&helm, values);
        let agent = of_kind(&docs, "DaemonSet")
            .into_iter()
            .find(|d| d["metadata"]["name"] == "shareguard-agent")
            .unwrap()
            .clone();
        let toml = of_kind(&docs, "ConfigMap")[0]["data"]["agent.toml"]
            .as_str()
            .unwrap()
            .to_owned();
        (agent, toml)
    };
    let env = |agent: &Value, name: &str| -> String {
        agent["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let mount = |agent: &Value, name: &str| -> Option<Value> {
        agent["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .cloned()
    };

    let (plain, plain_toml) = agent_of("{}");
    let sc = &plain["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(env(&plain, "NVIDIA_DRIVER_CAPABILITIES"), "utility");
    assert!(mount(&plain, "mps").unwrap()["mountPropagation"].is_null());
    assert!(mount(&plain, "driver-root").is_none());
    assert!(!plain_toml.contains("driver_root"), "{plain_toml}");

    let (mps, _) = agent_of("gpu:\n  mps: true\n");
    let sc = &mps["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    assert_eq!(sc["privileged"], true);
    assert!(sc["allowPrivilegeEscalation"].is_null(), "{sc:?}");
    assert_eq!(env(&mps, "NVIDIA_DRIVER_CAPABILITIES"), "utility,compute");
    assert_eq!(
        mount(&mps, "mps").unwrap()["mountPropagation"],
        "Bidirectional"
    );

    let (operator, toml) = agent_of("gpu:\n  driverRoot: /run/nvidia/driver\n");
    let m = mount(&operator, "driver-root").expect("the driver root mounted");
    assert_eq!(m["mountPath"], "/driver-root");
    assert_eq!(m["readOnly"], true);
    let vol = operator["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "driver-root")
        .unwrap();
    assert_eq!(vol["hostPath"]["path"], "/run/nvidia/driver");
    let sources = NodeNameSources {
        given: Some("worker-1".to_owned()),
        host: None,
    };
    let cfg = Config::parse_for(&toml, "rendered agent.toml", &sources)
        .unwrap_or_else(|e| panic!("the agent refuses the rendered config: {e}"));
    let gpus: Vec<_> = cfg
        .devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
        .collect();
    assert!(!gpus.is_empty());
    for d in gpus {
        let g = d.gpu.as_ref().unwrap();
        assert_eq!(
            g.driver_root.as_deref(),
            Some(Path::new("/run/nvidia/driver"))
        );
        assert_eq!(
            g.container_driver_root.as_deref(),
            Some(Path::new("/driver-root"))
        );
    }
}

/// `helm template` as `release` into `namespace` with `values` and every optional
/// object on (PodMonitor, PrometheusRule, dashboard, metrics Secret), each document
/// checked as its Kubernetes type.
fn render_release(helm: &Path, release: &str, namespace: &str, values: &str) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.yaml");
    fs::write(&file, values).unwrap();
    let chart = chart();
    let args = [
        "template",
        release,
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
        "--api-versions",
        "monitoring.coreos.com/v1/PodMonitor",
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--set",
        "grafanaDashboard.enabled=true",
        "-f",
        file.to_str().unwrap(),
    ];
    let (ok, out, err) = run(helm, &args);
    assert!(ok, "helm {}:\n{err}", args.join(" "));
    let docs = documents(&out);
    for d in &docs {
        if let Err(e) = check_document(&serde_json::to_value(d).unwrap()) {
            panic!(
                "{release}: {:?} {:?}: {e}",
                d["kind"], d["metadata"]["name"]
            );
        }
    }
    docs
}

/// Every object of a render as (kind, namespace, name); cluster-scoped ones with "".
fn object_keys(docs: &[Value]) -> BTreeSet<(String, String, String)> {
    docs.iter()
        .map(|d| {
            let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (
                s(&d["kind"]),
                s(&d["metadata"]["namespace"]),
                s(&d["metadata"]["name"]),
            )
        })
        .collect()
}

/// A second release beside the first, even in the same namespace, shares no object
/// with it, cluster-scoped ones included (ClusterRole, admission policies, DeviceClasses):
/// each is named after its release and labelled with it, its DaemonSets and PodMonitor
/// select only its own pods, and every name one object gives another (ConfigMap,
/// Secret, ServiceAccount, ClusterRole, policy) is one of its own release. Its plugin
/// is for its own driver only (`--driver`), which keeps it off the other release's
/// agent on a shared node. The prefix: the release's name where it says shareguard,
/// else `<release>-shareguard`, or fullnameOverride; a long one is refused, not cut.
#[test]
fn a_second_release_shares_no_object_with_the_first() {
    let Some(helm) = helm() else { return };
    let closed = r#"
agent:
  devices:
    - {name: mem-0, kind: generic, allowedNamespaces: [team-a],
       capacity: {memory: {value: 8Gi, default: 1Gi}}}
"#;
    let first = render_release(&helm, "shareguard", "kube-system", closed);
    let second = render_release(
        &helm,
        "canary",
        "kube-system",
        &format!(
            "{closed}\ndriverName: canary.example.com\nnamespace: {{name: shareguard-system, create: false}}\n"
        ),
    );
    let (a, b) = (object_keys(&first), object_keys(&second));
    assert_eq!(a.len(), first.len(), "two objects of one name in the first");
    assert_eq!(
        b.len(),
        second.len(),
        "two objects of one name in the second"
    );
    let both: Vec<_> = a.intersection(&b).collect();
    assert!(both.is_empty(), "objects of both releases: {both:?}");
    // Everything the optional values make is there, so nothing was left unchecked.
    let kinds: BTreeSet<&str> = second.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for k in [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "DeviceClass",
        "PodMonitor",
        "PrometheusRule",
        "Secret",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        assert!(kinds.contains(k), "no {k} in the render");
    }

    for (release, prefix, driver, docs) in [
        ("shareguard", "shareguard", "shareguard.example.com", &first),
        ("canary", "canary-shareguard", "canary.example.com", &second),
    ] {
        let names: BTreeSet<(String, String)> = object_keys(docs)
            .into_iter()
            .map(|(k, _, n)| (k, n))
            .collect();
        let has = |kind: &str, name: &str| names.contains(&(kind.to_owned(), name.to_owned()));
        for d in docs {
            let name = d["metadata"]["name"].as_str().unwrap();
            if d["kind"] != "Namespace" {
                assert!(name.starts_with(prefix), "{release}: {name}");
            }
            assert_eq!(
                d["metadata"]["labels"]["app.kubernetes.io/instance"], release,
                "{release}: {name}"
            );
        }
        for d in of_kind(docs, "DaemonSet")
            .into_iter()
            .chain(of_kind(docs, "PodMonitor"))
        {
            assert_eq!(
                d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"], release,
                "{release}: {:?} selects other releases' pods",
                d["metadata"]["name"]
            );
        }
        let sa = format!("{prefix}-kubelet-plugin");
        assert!(has("ServiceAccount", &sa), "{release}");
        for ds in of_kind(docs, "DaemonSet") {
            let pod = &ds["spec"]["template"]["spec"];
            if let Some(s) = pod["serviceAccountName"].as_str() {
                assert!(has("ServiceAccount", s), "{release}: {s}");
            }
            for v in pod["volumes"].as_sequence().unwrap() {
                if let Some(cm) = v["configMap"]["name"].as_str() {
                    assert!(has("ConfigMap", cm), "{release}: {cm}");
                }
                if let Some(s) = v["secret"]["secretName"].as_str() {
                    assert!(has("Secret", s), "{release}: {s}");
                }
            }
            for c in pod["containers"].as_sequence().unwrap() {
                let cmd = strs(&c["command"]);
                if cmd.get(1) == Some(&"kubelet-plugin") {
                    let i = cmd.iter().position(|a| *a == "--driver").unwrap();
                    assert_eq!(cmd[i + 1], driver, "{release}: the plugin's --driver");
                }
            }
        }
        let pm = of_kind(docs, "PodMonitor")[0];
        let cred = &pm["spec"]["podMetricsEndpoints"][0]["authorization"]["credentials"]["name"];
        assert!(has("Secret", cred.as_str().unwrap()), "{release}: {cred:?}");
        for b in of_kind(docs, "ClusterRoleBinding") {
            assert!(has("ClusterRole", b["roleRef"]["name"].as_str().unwrap()));
            assert_eq!(b["subjects"][0]["name"], sa.as_str(), "{release}");
        }
        for b in of_kind(docs, "ValidatingAdmissionPolicyBinding") {
            let p = b["spec"]["policyName"].as_str().unwrap();
            assert!(has("ValidatingAdmissionPolicy", p), "{release}: {p}");
        }
        // The plugin's policies admit this release's plugin alone.
        let user = format!("system:serviceaccount:shareguard-system:{sa}\"");
        let plugin_policies: Vec<_> = of_kind(docs, "ValidatingAdmissionPolicy")
            .into_iter()
            .filter(|p| {
                p["metadata"]["name"]
                    .as_str()
                    .unwrap()
                    .contains("kubelet-plugin")
            })
            .collect();
        assert_eq!(plugin_policies.len(), 3, "{release}");
        for p in plugin_policies {
            let text = serde_yaml::to_string(p).unwrap();
            assert!(text.contains(&user), "{release}: {text}");
        }
        // The claim-namespaces policy names this release's classes.
        let classes: BTreeSet<&str> = of_kind(docs, "DeviceClass")
            .into_iter()
            .map(|c| c["metadata"]["name"].as_str().unwrap())
            .collect();
        let policy = of_kind(docs, "ValidatingAdmissionPolicy")
            .into_iter()
            .find(|p| p["metadata"]["name"] == format!("{prefix}-claim-namespaces").as_str())
            .unwrap_or_else(|| panic!("{release}: no claim-namespaces policy"));
        let text = serde_yaml::to_string(policy).unwrap();
        assert!(
            classes
                .iter()
                .any(|c| text.contains(&format!("'{c}'")) || text.contains(&format!("\"{c}\""))),
            "{release}: the policy names none of {classes:?}:\n{text}"
        );
    }

    // fullnameOverride, and a release name that gives too long a prefix.
    let over = render_release(&helm, "x", "kube-system", "fullnameOverride: sg-b\n");
    assert!(
        object_keys(&over)
            .iter()
            .all(|(k, _, n)| k == "Namespace" || n.starts_with("sg-b"))
    );
    let long = "a".repeat(30);
    let chart = chart();
    let (ok, _, err) = run(&helm, &["template", &long, chart.to_str().unwrap()]);
    assert!(
        !ok && err.contains("over 40") && err.contains("fullnameOverride"),
        "{err}"
    );
}
