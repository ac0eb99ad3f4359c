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

/// Every metric the rules read is one the agent exports (by name, in metrics_slo.rs), so
/// a renamed metric cannot leave the rules reading nothing.
#[test]
fn the_rules_read_only_metrics_the_agent_exports() {
    let rules = std::fs::read_to_string(rules_dir().join("shareguard-slo.rules.yaml")).unwrap();
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .join("agent/src/metrics_slo.rs"),
    )
    .unwrap();
    let mut read = std::collections::BTreeSet::new();
    for word in rules.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
        // A prefix in a comment (`shareguard_slo_objective_*`) names no metric.
        if word.starts_with("shareguard_slo_") && !word.ends_with('_') {
            read.insert(word.to_owned());
        }
    }
    assert!(!read.is_empty());
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
            "the rules read {name}, which the agent does not export"
        );
    }
}
