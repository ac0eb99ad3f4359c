//! The objectives each class's figures are judged against (`[slo]` in the config, see
//! [`crate::config::slo`]), and the windows the figures are kept over.

use std::{collections::BTreeMap, time::Duration};

/// One class's objectives. Every one is set: a class the config does not name gets the
/// `[slo]` defaults, and a `[slo.class."NAME"]` table overrides them field by field.
#[derive(Clone, Debug, PartialEq)]
pub struct Objectives {
    /// Prepare's durable-answer latency, p99 over the window, at most this.
    pub prepare_p99: Duration,
    /// Admission to ENFORCED (OBSERVED in the observe stage), p99, at most this.
    pub convergence_p99: Duration,
    /// Refused claims over claims asked for, at most this (0..=1).
    pub refusal_rate_max: f64,
    /// Read back over requested, summed over the shares that should be enforced, at
    /// least this (0..=1).
    pub read_back_ratio_min: f64,
    /// Drift repairs in the window, at most this many.
    pub drift_repairs_max: u64,
    /// Agent start to every share of the class verified, at most this.
    pub recovery_max: Duration,
    /// Fewer claims than this in the window (or fewer convergences, for the
    /// convergence p99) and a figure is too thin to promote on.
    pub min_samples: u64,
}

impl Default for Objectives {
    fn default() -> Self {
        Self {
            // A durable Prepare is an fsync or two; the design's target is far below
            // this, which leaves room for slow disks while catching a stuck store.
            prepare_p99: Duration::from_millis(100),
            // Admission happens before kubelet creates the sandbox, so this includes
            // the pod's start.
            convergence_p99: Duration::from_secs(10),
            refusal_rate_max: 0.05,
            // Mechanisms round to their step below the request, never far.
            read_back_ratio_min: 0.99,
            drift_repairs_max: 5,
            recovery_max: Duration::from_secs(10),
            min_samples: 20,
        }
    }
}

/// `[slo]`: the windows, the defaults, and the classes' own objectives.
#[derive(Clone, Debug, PartialEq)]
pub struct SloConfig {
    /// The window the verdict is taken over (`window`).
    pub window: Duration,
    /// A shorter window, shown beside it: what changed lately (`short_window`).
    pub short_window: Duration,
    /// How often the windows are saved in the store (`save_period`); also at every
    /// stop. A crash loses what came after the last save.
    pub save_period: Duration,
    pub defaults: Objectives,
    pub classes: BTreeMap<String, Objectives>,
}

impl Default for SloConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_secs(3600),
            short_window: Duration::from_secs(300),
            save_period: Duration::from_secs(30),
            defaults: Objectives::default(),
            classes: BTreeMap::new(),
        }
    }
}

impl SloConfig {
    pub fn objectives(&self, class: &str) -> &Objectives {
        self.classes.get(class).unwrap_or(&self.defaults)
    }
}
