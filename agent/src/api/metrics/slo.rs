//! The SLO figures as metrics (see [`crate::slo`]), per DeviceClass.
//!
//! Two kinds, on purpose. Raw counters and histograms (`shareguard_slo_claims_total`,
//! `shareguard_slo_refusals_total`, `shareguard_slo_prepare_duration_seconds`,
//! `shareguard_slo_convergence_duration_seconds`, `shareguard_slo_drift_repairs_total`)
//! from which Prometheus computes windowed figures properly, over a fleet (the recording
//! rules in `deploy/prometheus/`). And gauges of what the agent itself judges on: its
//! windowed figures (`shareguard_slo_window_*`, labelled with the window), allocated
//! against read back, recovery, the objectives from the config
//! (`shareguard_slo_objective_*`, so alerts compare with what this node was told) and
//! the verdict. Gauges are set at each render from [`Engine::slo`].

use std::{sync::atomic::AtomicU64, time::Duration};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::{
    engine::Engine,
    slo::{RefusalReason, verdict::VerdictKind},
};

type FloatGauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabel {
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassReason {
    class: String,
    /// A [`RefusalReason`] name.
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassCapacity {
    class: String,
    capacity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassWindow {
    class: String,
    /// The window's length as the config writes it ("1h", "5m").
    window: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassWindowPercentile {
    class: String,
    window: String,
    /// "p50" or "p99" (not `quantile`, which Prometheus keeps for summaries).
    percentile: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassVerdict {
    class: String,
    /// "promote", "hold" or "roll_back".
    verdict: String,
}

fn prepare_histogram() -> Histogram {
    // 0.25 ms .. ~4 s, as shareguard_prepare_duration_seconds.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

fn convergence_histogram() -> Histogram {
    // 10 ms .. ~5 min: admission comes before kubelet creates the pod's sandbox.
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}

type HistFamily = Family<ClassLabel, Histogram, fn() -> Histogram>;

pub struct SloMetrics {
    prepare: HistFamily,
    claims: Family<ClassLabel, Counter>,
    refusals: Family<ClassReason, Counter>,
    convergence: HistFamily,
    repairs: Family<ClassLabel, Counter>,
    allocated: Family<ClassCapacity, FloatGauge>,
    requested: Family<ClassCapacity, FloatGauge>,
    read_back: Family<ClassCapacity, FloatGauge>,
    read_back_ratio: Family<ClassCapacity, FloatGauge>,
    recovery: Family<ClassLabel, FloatGauge>,
    unverified: Family<ClassLabel, Gauge>,
    window_prepare: Family<ClassWindowPercentile, FloatGauge>,
    window_convergence: Family<ClassWindowPercentile, FloatGauge>,
    window_refusal_ratio: Family<ClassWindow, FloatGauge>,
    window_claims: Family<ClassWindow, Gauge>,
    window_repairs: Family<ClassWindow, Gauge>,
    objectives: Vec<(&'static str, Family<ClassLabel, FloatGauge>)>,
    verdict: Family<ClassVerdict, Gauge>,
}

fn class(c: &str) -> ClassLabel {
    ClassLabel {
        class: c.to_owned(),
    }
}

impl SloMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            prepare: HistFamily::new_with_constructor(prepare_histogram),
            claims: Family::default(),
            refusals: Family::default(),
            convergence: HistFamily::new_with_constructor(convergence_histogram),
            repairs: Family::default(),
            allocated: Family::default(),
            requested: Family::default(),
            read_back: Family::default(),
            read_back_ratio: Family::default(),
            recovery: Family::default(),
            unverified: Family::default(),
            window_prepare: Family::default(),
            window_convergence: Family::default(),
            window_refusal_ratio: Family::default(),
            window_claims: Family::default(),
            window_repairs: Family::default(),
            objectives: [
                ("prepare_p99_seconds", "Prepare p99"),
                ("convergence_p99_seconds", "admission-to-ENFORCED p99"),
                ("refusal_ratio_max", "most refused claims per claim"),
                ("read_back_ratio_min", "least read back per requested"),
                ("drift_repairs_max", "most drift repairs in the window"),
                ("recovery_max_seconds", "longest start-to-verified"),
            ]
            .into_iter()
            .map(|(name, help)| {
                let f = Family::<ClassLabel, FloatGauge>::default();
                registry.register(
                    format!("shareguard_slo_objective_{name}"),
                    format!("The config's SLO objective for the class: {help}"),
                    f.clone(),
                );
                (name, f)
            })
            .collect(),
            verdict: Family::default(),
        };
        let r = registry;
        r.register(
            "shareguard_slo_prepare_duration_seconds",
            "Durable-answer time of claims of the class answered without an error",
            m.prepare.clone(),
        );
        r.register(
            "shareguard_slo_claims",
            "Claims of Prepare calls that name a device of the class, refused or not",
            m.claims.clone(),
        );
        r.register(
            "shareguard_slo_refusals",
            "Claims of the class refused or rolled back, by reason (capacity, policy, invalid, denied, epoch, conflict, precondition, unavailable, enforcement)",
            m.refusals.clone(),
        );
        r.register(
            "shareguard_slo_convergence_duration_seconds",
            "Time from a share's admission to its first ENFORCED (OBSERVED in observe, ACCOUNTED where a watchdog alone holds it)",
            m.convergence.clone(),
        );
        r.register(
            "shareguard_slo_drift_repairs",
            "Drifted shares of the class the reconciler repaired",
            m.repairs.clone(),
        );
        r.register(
            "shareguard_slo_allocated",
            "Capacity the class's live shares hold, in the capacity's base unit",
            m.allocated.clone(),
        );
        r.register(
            "shareguard_slo_requested",
            "What the class's shares that should be enforced asked for, in the capacity's base unit",
            m.requested.clone(),
        );
        r.register(
            "shareguard_slo_read_back",
            "What was read back as enforced for those shares, in the capacity's base unit",
            m.read_back.clone(),
        );
        r.register(
            "shareguard_slo_read_back_ratio",
            "Read back over requested for the shares that should be enforced (absent when none should)",
            m.read_back_ratio.clone(),
        );
        r.register(
            "shareguard_slo_recovery_seconds",
            "Agent start to every share of the class verified (absent until then)",
            m.recovery.clone(),
        );
        r.register(
            "shareguard_slo_unverified_shares",
            "Shares of the class not verified again since the agent started",
            m.unverified.clone(),
        );
        r.register(
            "shareguard_slo_window_prepare_seconds",
            "Prepare durable-answer time percentile over the agent's window",
            m.window_prepare.clone(),
        );
        r.register(
            "shareguard_slo_window_convergence_seconds",
            "Admission-to-ENFORCED percentile over the agent's window",
            m.window_convergence.clone(),
        );
        r.register(
            "shareguard_slo_window_refusal_ratio",
            "Refused claims over claims of the class, over the agent's window",
            m.window_refusal_ratio.clone(),
        );
        r.register(
            "shareguard_slo_window_claims",
            "Claims of the class over the agent's window",
            m.window_claims.clone(),
        );
        r.register(
            "shareguard_slo_window_drift_repairs",
            "Drift repairs of the class over the agent's window",
            m.window_repairs.clone(),
        );
        r.register(
            "shareguard_slo_verdict",
            "1 for the class's verdict now (promote, hold, roll_back), 0 for the others",
            m.verdict.clone(),
        );
        m
    }

    pub fn prepared(&self, c: &str, took: Duration, refusal: Option<RefusalReason>) {
        self.claims.get_or_create(&class(c)).inc();
        match refusal {
            None => self
                .prepare
                .get_or_create(&class(c))
                .observe(took.as_secs_f64()),
            Some(r) => {
                self.refusals
                    .get_or_create(&ClassReason {
                        class: c.to_owned(),
                        reason: r.name().to_owned(),
                    })
                    .inc();
            }
        }
    }

    pub fn converged(&self, c: &str, took: Duration) {
        self.convergence
            .get_or_create(&class(c))
            .observe(took.as_secs_f64());
    }

    pub fn repaired(&self, c: &str) {
        self.repairs.get_or_create(&class(c)).inc();
    }

    /// Sets every gauge from the engine's figures now.
    pub fn set(&self, engine: &Engine) {
        for f in [
            &self.allocated,
            &self.requested,
            &self.read_back,
            &self.read_back_ratio,
        ] {
            f.clear();
        }
        self.recovery.clear();
        self.window_prepare.clear();
        self.window_convergence.clear();
        self.window_refusal_ratio.clear();
        // Every class is known to the engine, so None cannot name an unknown one.
        let Ok(all) = engine.slo(None) else {
            return;
        };
        for s in &all {
            let f = &s.figures;
            let c = class(&f.class);
            // Present from the start, so a rate over them starts at zero.
            let _ = self.claims.get_or_create(&c);
            let _ = self.repairs.get_or_create(&c);
            let _ = self.prepare.get_or_create(&c);
            let _ = self.convergence.get_or_create(&c);
            for r in RefusalReason::ALL {
                let _ = self.refusals.get_or_create(&ClassReason {
                    class: f.class.clone(),
                    reason: r.name().to_owned(),
                });
            }
            for rb in &f.read_back {
                let l = ClassCapacity {
                    class: f.class.clone(),
                    capacity: rb.capacity.clone(),
                };
                let q = |q: &shareguard_common::Quantity| q.nanos() as f64 / 1e9;
                self.allocated.get_or_create(&l).set(q(&rb.allocated));
                self.requested.get_or_create(&l).set(q(&rb.requested));
                self.read_back.get_or_create(&l).set(q(&rb.read_back));
                if let Some(r) = rb.ratio() {
                    self.read_back_ratio.get_or_create(&l).set(r);
                }
            }
            match &f.recovery {
                crate::slo::Recovery::Done(d) => {
                    self.recovery.get_or_create(&c).set(d.as_secs_f64());
                    self.unverified.get_or_create(&c).set(0);
                }
                crate::slo::Recovery::Waiting { unverified, .. } => {
                    self.unverified
                        .get_or_create(&c)
                        .set(i64::try_from(*unverified).unwrap_or(i64::MAX));
                }
            }
            for w in [&f.window, &f.short] {
                let window = humantime::format_duration(w.span).to_string();
                let pct = |p: &str| ClassWindowPercentile {
                    class: f.class.clone(),
                    window: window.clone(),
                    percentile: p.to_owned(),
                };
                for (p, v) in [("p50", w.prepare_p50), ("p99", w.prepare_p99)] {
                    if let Some(v) = v {
                        self.window_prepare
                            .get_or_create(&pct(p))
                            .set(v.as_secs_f64());
                    }
                }
                if let Some(v) = w.convergence_p99 {
                    self.window_convergence
                        .get_or_create(&pct("p99"))
                        .set(v.as_secs_f64());
                }
                let cw = ClassWindow {
                    class: f.class.clone(),
                    window,
                };
                if let Some(r) = w.refusal_rate() {
                    self.window_refusal_ratio.get_or_create(&cw).set(r);
                }
                let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                self.window_claims.get_or_create(&cw).set(n(w.claims));
                self.window_repairs
                    .get_or_create(&cw)
                    .set(n(w.drift_repairs));
            }
            let o = &s.objectives;
            for (name, fam) in &self.objectives {
                let v = match *name {
                    "prepare_p99_seconds" => o.prepare_p99.as_secs_f64(),
                    "convergence_p99_seconds" => o.convergence_p99.as_secs_f64(),
                    "refusal_ratio_max" => o.refusal_rate_max,
                    "read_back_ratio_min" => o.read_back_ratio_min,
                    "drift_repairs_max" => o.drift_repairs_max as f64,
                    _ => o.recovery_max.as_secs_f64(),
                };
                fam.get_or_create(&c).set(v);
            }
            for k in VerdictKind::ALL {
                self.verdict
                    .get_or_create(&ClassVerdict {
                        class: f.class.clone(),
                        verdict: k.label().to_owned(),
                    })
                    .set(i64::from(k == s.verdict.kind));
            }
        }
    }
}
