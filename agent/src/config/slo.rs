//! `[slo]`: the windows the SLO figures are kept over and the objectives each class's
//! figures are judged against (see [`crate::slo`]).
//!
//! ```toml
//! [slo]
//! window = "1h"                # the verdict's window
//! short_window = "5m"          # shown beside it
//! save_period = "30s"          # how often the windows are saved for the next start
//! prepare_p99 = "100ms"        # the defaults for every class...
//! convergence_p99 = "10s"
//! refusal_rate_max = 0.05
//! read_back_ratio_min = 0.99
//! drift_repairs_max = 5
//! recovery_max = "10s"
//! min_samples = 20
//! [slo.class."shareguard-net-bandwidth"]   # ...and one class's own, field by field
//! prepare_p99 = "20ms"
//! ```
//!
//! A class named here but by no device of this node is allowed: one file serves every
//! node, and another node may have it.

use std::{collections::BTreeMap, ops::Range, time::Duration};

use serde::Deserialize;
use toml::Spanned;

use crate::{
    config::{ConfigError, check_class_name},
    slo::{Objectives, SloConfig},
};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSlo {
    window: Option<Spanned<String>>,
    short_window: Option<Spanned<String>>,
    save_period: Option<Spanned<String>>,
    prepare_p99: Option<Spanned<String>>,
    convergence_p99: Option<Spanned<String>>,
    refusal_rate_max: Option<Spanned<f64>>,
    read_back_ratio_min: Option<Spanned<f64>>,
    drift_repairs_max: Option<Spanned<u64>>,
    recovery_max: Option<Spanned<String>>,
    min_samples: Option<Spanned<u64>>,
    #[serde(default)]
    class: BTreeMap<Spanned<String>, Spanned<RawObjectives>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawObjectives {
    prepare_p99: Option<Spanned<String>>,
    convergence_p99: Option<Spanned<String>>,
    refusal_rate_max: Option<Spanned<f64>>,
    read_back_ratio_min: Option<Spanned<f64>>,
    drift_repairs_max: Option<Spanned<u64>>,
    recovery_max: Option<Spanned<String>>,
    min_samples: Option<Spanned<u64>>,
}

/// Builds a [`ConfigError`] at a span of the file.
pub(crate) type ErrAt<'a> = &'a dyn Fn(Range<usize>, String) -> ConfigError;

/// A window: at least a second (a count window's buckets are a sixtieth of it) and at
/// most a week (what is kept for it stays bounded either way; a longer one would judge a
/// rollout on what it no longer is).
fn window(key: &str, s: &Spanned<String>, err: ErrAt<'_>) -> Result<Duration, ConfigError> {
    let d = duration(key, s, err)?;
    if d < Duration::from_secs(1) || d > Duration::from_secs(7 * 24 * 3600) {
        return Err(err(
            s.span(),
            format!("{key}: {:?} must be between 1s and 7 days", s.get_ref()),
        ));
    }
    Ok(d)
}

fn duration(key: &str, s: &Spanned<String>, err: ErrAt<'_>) -> Result<Duration, ConfigError> {
    let d = crate::duration::parse(s.get_ref())
        .map_err(|e| err(s.span(), format!("{key}: {:?}: {e}", s.get_ref())))?;
    if d.is_zero() {
        return Err(err(
            s.span(),
            format!("{key}: must be more than zero; no figure could meet it"),
        ));
    }
    Ok(d)
}

fn ratio(key: &str, s: &Spanned<f64>, err: ErrAt<'_>) -> Result<f64, ConfigError> {
    let v = *s.get_ref();
    if !(0.0..=1.0).contains(&v) {
        return Err(err(
            s.span(),
            format!("{key}: {v} is not a ratio between 0 and 1"),
        ));
    }
    Ok(v)
}

/// `base` with the fields `raw` sets; `prefix` names the table in errors.
fn objectives(
    prefix: &str,
    raw: &RawObjectives,
    base: &Objectives,
    err: ErrAt<'_>,
) -> Result<Objectives, ConfigError> {
    let mut o = base.clone();
    let key = |k: &str| format!("{prefix}.{k}");
    if let Some(s) = &raw.prepare_p99 {
        o.prepare_p99 = duration(&key("prepare_p99"), s, err)?;
    }
    if let Some(s) = &raw.convergence_p99 {
        o.convergence_p99 = duration(&key("convergence_p99"), s, err)?;
    }
    if let Some(s) = &raw.recovery_max {
        o.recovery_max = duration(&key("recovery_max"), s, err)?;
    }
    if let Some(s) = &raw.refusal_rate_max {
        o.refusal_rate_max = ratio(&key("refusal_rate_max"), s, err)?;
    }
    if let Some(s) = &raw.read_back_ratio_min {
        o.read_back_ratio_min = ratio(&key("read_back_ratio_min"), s, err)?;
    }
    if let Some(s) = &raw.drift_repairs_max {
        o.drift_repairs_max = *s.get_ref();
    }
    if let Some(s) = &raw.min_samples {
        if *s.get_ref() == 0 {
            return Err(err(
                s.span(),
                format!(
                    "{}: must be at least 1; a verdict on no samples is a guess",
                    key("min_samples")
                ),
            ));
        }
        o.min_samples = *s.get_ref();
    }
    Ok(o)
}

pub(crate) fn parse(raw: Option<RawSlo>, err: ErrAt<'_>) -> Result<SloConfig, ConfigError> {
    let mut c = SloConfig::default();
    let Some(raw) = raw else {
        return Ok(c);
    };
    if let Some(s) = &raw.window {
        c.window = window("slo.window", s, err)?;
    }
    if let Some(s) = &raw.short_window {
        c.short_window = window("slo.short_window", s, err)?;
    }
    if let Some(s) = &raw.save_period {
        c.save_period = window("slo.save_period", s, err)?;
    }
    if c.short_window > c.window {
        let at = raw
            .short_window
            .as_ref()
            .or(raw.window.as_ref())
            .map_or(0..0, Spanned::span);
        return Err(err(
            at,
            format!(
                "slo.short_window: {} is longer than slo.window ({})",
                humantime::format_duration(c.short_window),
                humantime::format_duration(c.window)
            ),
        ));
    }
    let defaults = RawObjectives {
        prepare_p99: raw.prepare_p99,
        convergence_p99: raw.convergence_p99,
        refusal_rate_max: raw.refusal_rate_max,
        read_back_ratio_min: raw.read_back_ratio_min,
        drift_repairs_max: raw.drift_repairs_max,
        recovery_max: raw.recovery_max,
        min_samples: raw.min_samples,
    };
    c.defaults = objectives("slo", &defaults, &Objectives::default(), err)?;
    for (name, table) in &raw.class {
        check_class_name(name.get_ref()).map_err(|why| {
            err(
                name.span(),
                format!("slo.class.{:?}: {why}", name.get_ref()),
            )
        })?;
        let prefix = format!("slo.class.{:?}", name.get_ref());
        let o = objectives(&prefix, table.get_ref(), &c.defaults, err)?;
        c.classes.insert(name.get_ref().clone(), o);
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::Config;

    const BASE: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"

[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "generic"
allowed_namespaces = ["team-a"]
[device.capacity.memory]
value = "40Gi"
"#;

    fn with(slo: &str) -> String {
        format!("{BASE}\n{slo}")
    }

    #[test]
    fn without_slo_every_class_gets_the_defaults() {
        let c = Config::parse(BASE, "t.toml").unwrap();
        assert_eq!(c.slo, crate::slo::SloConfig::default());
        assert_eq!(c.slo.window, Duration::from_secs(3600));
        assert_eq!(
            c.slo.objectives("anything").prepare_p99,
            Duration::from_millis(100)
        );
    }

    #[test]
    fn defaults_and_a_classes_own_objectives_are_read_field_by_field() {
        let c = Config::parse(
            &with(
                r#"[slo]
window = "30m"
short_window = "1m"
save_period = "10s"
prepare_p99 = "20ms"
min_samples = 3
drift_repairs_max = 0
[slo.class."shareguard-accounted"]
refusal_rate_max = 0.5
recovery_max = "2s"
"#,
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.slo.window, Duration::from_secs(1800));
        assert_eq!(c.slo.short_window, Duration::from_secs(60));
        assert_eq!(c.slo.save_period, Duration::from_secs(10));
        let d = c.slo.objectives("other");
        assert_eq!(
            (d.prepare_p99, d.min_samples, d.drift_repairs_max),
            (Duration::from_millis(20), 3, 0)
        );
        let a = c.slo.objectives("shareguard-accounted");
        // The class's own fields, and the [slo] defaults for the rest.
        assert_eq!(a.refusal_rate_max, 0.5);
        assert_eq!(a.recovery_max, Duration::from_secs(2));
        assert_eq!(a.prepare_p99, Duration::from_millis(20));
        assert_eq!(a.min_samples, 3);
    }

    #[test]
    fn bad_values_name_the_file_line_and_key() {
        // BASE, the blank line `with` adds, then `[slo]` and the line at fault.
        let line_of_slo = BASE.lines().count() + 3;
        let cases = [
            ("prepare_p99 = \"soon\"", "slo.prepare_p99", 0),
            ("prepare_p99 = \"0s\"", "slo.prepare_p99", 0),
            ("refusal_rate_max = 1.5", "slo.refusal_rate_max", 0),
            ("read_back_ratio_min = -0.1", "slo.read_back_ratio_min", 0),
            ("min_samples = 0", "slo.min_samples", 0),
            ("window = \"10ms\"", "slo.window", 0),
            ("short_window = \"2h\"", "slo.short_window", 0),
            ("save_period = \"100ms\"", "slo.save_period", 0),
            ("prepare_p95 = \"1s\"", "prepare_p95", 0),
            (
                "[slo.class.\"Bad_Name\"]\nprepare_p99 = \"1s\"",
                "slo.class.\"Bad_Name\"",
                0,
            ),
            (
                "[slo.class.\"gpu\"]\nconvergence_p99 = \"forever\"",
                "slo.class.\"gpu\".convergence_p99",
                1,
            ),
        ];
        for (text, key, below) in cases {
            let e = Config::parse(&with(&format!("[slo]\n{text}\n")), "bad.toml").unwrap_err();
            assert_eq!(e.path, "bad.toml");
            assert!(e.message.contains(key), "{text}: {e}");
            assert_eq!(e.line, line_of_slo + below, "{text}: {e}");
        }
    }
}
