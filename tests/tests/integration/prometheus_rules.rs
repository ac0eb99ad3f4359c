//! The Prometheus rules in `deploy/prometheus/` (recording rules and alerts for the SLO
//! figures): `promtool check rules` accepts them, and `promtool test rules` runs their
//! unit tests (each recorded value and each alert, firing or not). promtool comes from
//! Debian's `prometheus` package (scripts/test.sh installs it); without it the test
//! skips, except under `CI=true`, where it fails.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("deploy/prometheus")
}

/// promtool with `args` in the rules' directory: its success and what it said. None
/// when there is no promtool (a failure under CI=true).
fn promtool(args: &[&str]) -> Option<(bool, String)> {
    let out = match Command::new("promtool")
        .args(args)
        .current_dir(rules_dir())
        .output()
    {
        Ok(o) => o,
        Err(e) => {
            assert!(
                !shareguard_tests::net::in_ci(),
                "promtool: {e}; install Debian's prometheus package (scripts/test.sh does); CI=true, so this fails instead of skipping"
            );
            eprintln!("SKIP: promtool: {e} (Debian's prometheus package)");
            return None;
        }
    };
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), said))
}

#[test]
fn the_slo_rules_pass_promtool_check_and_their_unit_tests() {
    let Some((ok, said)) = promtool(&["check", "rules", "shareguard-slo.rules.yaml"]) else {
        return;
    };
    assert!(ok, "promtool check rules:\n{said}");
    assert!(said.contains("SUCCESS"), "{said}");
    let (ok, said) = promtool(&["test", "rules", "shareguard-slo.rules.test.yaml"]).unwrap();
    assert!(ok, "promtool test rules:\n{said}");
    assert!(said.contains("SUCCESS"), "{said}");
}

#[test]
fn the_operations_alerts_pass_promtool_check_and_their_unit_tests() {
    let Some((ok, said)) = promtool(&["check", "rules", "shareguard-alerts.rules.yaml"]) else {
        return;
    };
    assert!(ok, "promtool check rules:\n{said}");
    let (ok, said) = promtool(&["test", "rules", "shareguard-alerts.rules.test.yaml"]).unwrap();
    assert!(ok, "promtool test rules:\n{said}");
    assert!(said.contains("SUCCESS"), "{said}");
}

/// The agent's metric sources: where every exported family is registered by name.
fn metric_sources() -> String {
    let agent = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .join("agent/src");
    ["api/metrics/mod.rs", "api/metrics/slo.rs"]
        .iter()
        .map(|f| std::fs::read_to_string(agent.join(f)).unwrap())
        .collect()
}

/// Every metric the rules read is one the agent exports (by name, in api/metrics/mod.rs
/// and api/metrics/slo.rs), so a renamed metric cannot leave the rules reading nothing.
#[test]
fn the_rules_read_only_metrics_the_agent_exports() {
    let source = metric_sources();
    for file in ["shareguard-slo.rules.yaml", "shareguard-alerts.rules.yaml"] {
        let rules = std::fs::read_to_string(rules_dir().join(file)).unwrap();
        let mut read = std::collections::BTreeSet::new();
        for word in rules.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
            // A prefix in a comment (`shareguard_slo_objective_*`) names no metric.
            if word.starts_with("shareguard_") && !word.ends_with('_') {
                read.insert(word.to_owned());
            }
        }
        assert!(!read.is_empty(), "{file}");
        for name in read {
            // Counters are exported as NAME_total, histograms as NAME_bucket.
            let base = name
                .strip_suffix("_total")
                .or_else(|| name.strip_suffix("_bucket"))
                .unwrap_or(&name);
            let objective = base.strip_prefix("shareguard_slo_objective_");
            let known = source.contains(&format!("\"{base}\""))
                || objective.is_some_and(|o| source.contains(&format!("(\"{o}\"")));
            assert!(
                known,
                "{file} reads {name}, which the agent does not export"
            );
        }
    }
}

/// deploy/prometheusrule.yaml (the Helm chart's render, which chart.rs holds it to)
/// carries exactly the groups of the two rule files, in order: the chart reads them
/// from its files/, links to this directory.
#[test]
fn the_prometheusrule_is_the_rule_files() {
    let load = |p: PathBuf| -> serde_yaml::Value {
        serde_yaml::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    };
    let mut groups = Vec::new();
    for f in ["shareguard-alerts.rules.yaml", "shareguard-slo.rules.yaml"] {
        groups.extend(
            load(rules_dir().join(f))["groups"]
                .as_sequence()
                .unwrap()
                .iter()
                .cloned(),
        );
    }
    let cr = load(rules_dir().parent().unwrap().join("prometheusrule.yaml"));
    assert_eq!(cr["kind"].as_str(), Some("PrometheusRule"));
    assert_eq!(cr["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    assert!(
        cr["spec"]["groups"] == serde_yaml::Value::Sequence(groups),
        "deploy/prometheusrule.yaml differs from the rule files"
    );
}
