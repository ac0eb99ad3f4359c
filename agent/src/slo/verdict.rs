//! The verdict on one class: promote, hold or roll back, with the figures that decided
//! it. Taken over the verdict's window (`[slo] window`) only; the short window is shown,
//! never judged, so one bad minute cannot flip a rollout back and forth.
//!
//! Each figure is judged against its objective ([`Status`]); then:
//!
//! - **roll back** when an *enforcement* objective is breached while some device of the
//!   class enforces: read-back ratio under `read_back_ratio_min`, drift repairs over
//!   `drift_repairs_max`, convergence p99 over `convergence_p99`, enforcement refusals
//!   (claims rolled back because their limit could not be applied) over
//!   `refusal_rate_max`, recovery over `recovery_max`. These say the limits themselves
//!   do not hold; going back to observe lifts them and keeps every share.
//! - **hold** when anything else is wrong: too few claims in the window (`min_samples`),
//!   a figure with too few samples to judge, Prepare p99 over its objective, all
//!   refusals together over `refusal_rate_max` (admission refusals: capacity, policy,
//!   namespaces, epochs; the callers' or the scheduler's, not the stage's), recovery
//!   not complete yet; and, for a class in observe, an enforcement objective breached
//!   (nothing to roll back: it is not ready).
//! - **promote** when every objective is met on enough samples: for a class in observe,
//!   ready to enforce; for one in enforce, stay.
//!
//! A figure that cannot exist for the class is not judged: read-back with no share that
//! should be enforced, convergence on an accounting-only class.

use super::{
    ClassFigures, Objectives, Recovery,
    figures::{ClassStage, WindowFigures},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerdictKind {
    Promote,
    Hold,
    RollBack,
}

impl VerdictKind {
    pub fn name(self) -> &'static str {
        match self {
            VerdictKind::Promote => "promote",
            VerdictKind::Hold => "hold",
            VerdictKind::RollBack => "roll back",
        }
    }

    /// The name as a metric label value.
    pub fn label(self) -> &'static str {
        match self {
            VerdictKind::Promote => "promote",
            VerdictKind::Hold => "hold",
            VerdictKind::RollBack => "roll_back",
        }
    }

    pub const ALL: [VerdictKind; 3] = [
        VerdictKind::Promote,
        VerdictKind::Hold,
        VerdictKind::RollBack,
    ];
}

/// How one figure stands against its objective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Met,
    Missed,
    /// Fewer samples than `min_samples`: not judged.
    TooFew,
    /// Nothing to measure (no share to enforce, not recovered yet, no objective).
    NoData,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Met => "met",
            Status::Missed => "missed",
            Status::TooFew => "too few samples",
            Status::NoData => "no data",
        }
    }
}

/// One figure beside its objective.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    /// `prepare_p50`, `prepare_p99`, `convergence_p99`, `refusal_rate`,
    /// `enforcement_refusal_rate`, `read_back_ratio`, `drift_repairs`, `recovery`.
    pub figure: &'static str,
    /// Seconds, a ratio or a count (see `unit`); None when there is none.
    pub value: Option<f64>,
    /// The same figure over the short window, where one is kept there.
    pub short_value: Option<f64>,
    pub unit: &'static str,
    /// `<=` or `>=` the objective; empty for a figure without one (`prepare_p50`).
    pub comparison: &'static str,
    pub objective: Option<f64>,
    pub samples: u64,
    pub status: Status,
    /// Whether a miss is the enforcement's (roll back) rather than a hold.
    pub enforcement: bool,
    /// What else the reader needs (the capacity the ratio is lowest on, a truncation).
    pub note: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub kind: VerdictKind,
    /// Each names the figure(s) that decided it.
    pub reasons: Vec<String>,
    pub lines: Vec<Line>,
}

fn secs(d: Option<std::time::Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

/// A figure with an upper bound.
#[allow(clippy::too_many_arguments)]
fn at_most(
    figure: &'static str,
    unit: &'static str,
    value: Option<f64>,
    short_value: Option<f64>,
    objective: f64,
    samples: u64,
    enough: bool,
    enforcement: bool,
) -> Line {
    let status = match value {
        None => Status::NoData,
        Some(_) if !enough => Status::TooFew,
        Some(v) if v <= objective => Status::Met,
        Some(_) => Status::Missed,
    };
    Line {
        figure,
        value,
        short_value,
        unit,
        comparison: "<=",
        objective: Some(objective),
        samples,
        status,
        enforcement,
        note: String::new(),
    }
}

fn lines(f: &ClassFigures, o: &Objectives) -> Vec<Line> {
    let (w, s): (&WindowFigures, &WindowFigures) = (&f.window, &f.short);
    let enough = |n: u64| n >= o.min_samples;
    let truncated = |t: bool| {
        if t {
            "more answers than a window keeps: over the latest ones".to_owned()
        } else {
            String::new()
        }
    };
    let mut out = Vec::new();
    out.push(Line {
        figure: "prepare_p50",
        value: secs(w.prepare_p50),
        short_value: secs(s.prepare_p50),
        unit: "seconds",
        comparison: "",
        objective: None,
        samples: w.prepare_samples,
        status: if w.prepare_p50.is_some() {
            Status::Met
        } else {
            Status::NoData
        },
        enforcement: false,
        note: truncated(w.prepare_truncated),
    });
    let mut p99 = at_most(
        "prepare_p99",
        "seconds",
        secs(w.prepare_p99),
        secs(s.prepare_p99),
        o.prepare_p99.as_secs_f64(),
        w.prepare_samples,
        enough(w.prepare_samples),
        false,
    );
    p99.note = truncated(w.prepare_truncated);
    out.push(p99);
    if f.accounting_only {
        out.push(Line {
            note: "accounting only: nothing to converge to".into(),
            ..at_most(
                "convergence_p99",
                "seconds",
                None,
                None,
                o.convergence_p99.as_secs_f64(),
                0,
                false,
                true,
            )
        });
    } else {
        let mut c = at_most(
            "convergence_p99",
            "seconds",
            secs(w.convergence_p99),
            secs(s.convergence_p99),
            o.convergence_p99.as_secs_f64(),
            w.convergence_samples,
            enough(w.convergence_samples),
            true,
        );
        c.note = truncated(w.convergence_truncated);
        out.push(c);
    }
    out.push(at_most(
        "refusal_rate",
        "ratio",
        w.refusal_rate(),
        s.refusal_rate(),
        o.refusal_rate_max,
        w.claims,
        enough(w.claims),
        false,
    ));
    out.push(at_most(
        "enforcement_refusal_rate",
        "ratio",
        w.enforcement_refusal_rate(),
        s.enforcement_refusal_rate(),
        o.refusal_rate_max,
        w.claims,
        enough(w.claims),
        true,
    ));
    let ratio = f.read_back_ratio();
    let shares = f.read_back.iter().map(|r| r.shares).max().unwrap_or(0);
    out.push(Line {
        figure: "read_back_ratio",
        value: ratio.map(|(_, r)| r),
        short_value: None,
        unit: "ratio",
        comparison: ">=",
        objective: Some(o.read_back_ratio_min),
        samples: shares,
        // A sum over what is live now: one share that does not hold is a fact, not a
        // sample too few.
        status: match ratio {
            None => Status::NoData,
            Some((_, r)) if r >= o.read_back_ratio_min => Status::Met,
            Some(_) => Status::Missed,
        },
        enforcement: true,
        note: match ratio {
            Some((cap, _)) => format!("lowest on {cap}"),
            None => "no share should be enforced now".into(),
        },
    });
    // Counted, not sampled: every repair is one.
    out.push(at_most(
        "drift_repairs",
        "count",
        Some(w.drift_repairs as f64),
        Some(s.drift_repairs as f64),
        o.drift_repairs_max as f64,
        w.drift_repairs,
        true,
        true,
    ));
    let mut rec = at_most(
        "recovery",
        "seconds",
        match &f.recovery {
            Recovery::Done(d) => Some(d.as_secs_f64()),
            Recovery::Waiting { .. } => None,
        },
        None,
        o.recovery_max.as_secs_f64(),
        1,
        true,
        true,
    );
    if let Recovery::Waiting { unverified, since } = &f.recovery {
        rec.note = format!(
            "not complete: {unverified} share(s) not verified yet, {:.1}s since the start",
            since.as_secs_f64()
        );
    }
    out.push(rec);
    out
}

fn describe(l: &Line) -> String {
    let v = l
        .value
        .map_or_else(|| "none".to_owned(), |v| fmt(v, l.unit));
    let o = l.objective.map_or_else(String::new, |o| fmt(o, l.unit));
    let note = if l.note.is_empty() {
        String::new()
    } else {
        format!(" ({})", l.note)
    };
    match l.status {
        Status::Missed => format!("{} {v} is not {} {o}{note}", l.figure, l.comparison),
        Status::TooFew => format!(
            "{} has {} samples, fewer than min_samples",
            l.figure, l.samples
        ),
        _ => format!("{}: {v}{note}", l.figure),
    }
}

/// A value in its unit, for reasons and tables.
pub fn fmt(v: f64, unit: &str) -> String {
    match unit {
        "seconds" if v < 1.0 => format!("{:.3}ms", v * 1000.0),
        "seconds" => format!("{v:.3}s"),
        "count" => format!("{v:.0}"),
        _ => format!("{v:.4}"),
    }
}

/// The verdict on `f` against `o`.
pub fn judge(f: &ClassFigures, o: &Objectives) -> Verdict {
    let lines = lines(f, o);
    let missed = |enforcement: bool| -> Vec<String> {
        lines
            .iter()
            .filter(|l| l.status == Status::Missed && l.enforcement == enforcement)
            .map(describe)
            .collect()
    };
    let breaches = missed(true);
    if f.stage.enforces() && !breaches.is_empty() {
        return Verdict {
            kind: VerdictKind::RollBack,
            reasons: breaches,
            lines,
        };
    }
    let mut holds: Vec<String> = Vec::new();
    if f.window.claims < o.min_samples {
        holds.push(format!(
            "too few claims: {} in the window, min_samples is {}",
            f.window.claims, o.min_samples
        ));
    }
    holds.extend(
        breaches
            .into_iter()
            .map(|b| format!("{b}; the class is in observe, so it is not ready to enforce")),
    );
    holds.extend(missed(false));
    for l in &lines {
        let convergence_needed = l.figure == "convergence_p99" && !f.accounting_only;
        let thin = l.status == Status::TooFew
            && l.figure != "refusal_rate"
            && l.figure != "enforcement_refusal_rate";
        if thin || (convergence_needed && l.status == Status::NoData && f.window.claims > 0) {
            holds.push(describe(l));
        }
        if l.figure == "recovery" && l.value.is_none() {
            holds.push(format!("recovery {}", l.note));
        }
    }
    if !holds.is_empty() {
        return Verdict {
            kind: VerdictKind::Hold,
            reasons: holds,
            lines,
        };
    }
    let why = match f.stage {
        ClassStage::Observe => format!(
            "every objective met over {} claims: ready to enforce",
            f.window.claims
        ),
        _ => format!(
            "every objective met over {} claims: stay in enforce",
            f.window.claims
        ),
    };
    Verdict {
        kind: VerdictKind::Promote,
        reasons: vec![why],
        lines,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use shareguard_common::Quantity;

    use super::*;
    use crate::slo::{ReadBack, RefusalReason};

    const MS: Duration = Duration::from_millis(1);

    fn good(stage: ClassStage) -> ClassFigures {
        let mut w = WindowFigures::empty(Duration::from_secs(3600));
        w.claims = 30;
        w.prepare_samples = 30;
        w.prepare_p50 = Some(2 * MS);
        w.prepare_p99 = Some(5 * MS);
        w.convergence_samples = 30;
        w.convergence_p99 = Some(300 * MS);
        let q = Quantity::parse("100M").unwrap();
        ClassFigures {
            class: "c".into(),
            stage,
            devices: vec!["nic-0".into()],
            accounting_only: false,
            short: w.clone(),
            window: w,
            read_back: vec![ReadBack {
                capacity: "bandwidth".into(),
                allocated: q,
                requested: q,
                read_back: q,
                shares: 1,
            }],
            recovery: Recovery::Done(Duration::from_millis(200)),
        }
    }

    fn kind(f: &ClassFigures) -> (VerdictKind, Vec<String>) {
        let v = judge(f, &Objectives::default());
        (v.kind, v.reasons)
    }

    #[test]
    fn every_objective_met_on_enough_samples_promotes() {
        let (k, why) = kind(&good(ClassStage::Observe));
        assert_eq!(k, VerdictKind::Promote, "{why:?}");
        assert!(why[0].contains("ready to enforce"), "{why:?}");
        let (k, why) = kind(&good(ClassStage::Enforce));
        assert_eq!(k, VerdictKind::Promote);
        assert!(why[0].contains("stay in enforce"), "{why:?}");
    }

    #[test]
    fn an_enforcement_breach_rolls_an_enforcing_class_back_and_holds_an_observing_one() {
        let mut f = good(ClassStage::Enforce);
        f.read_back[0].read_back = Quantity::parse("50M").unwrap();
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::RollBack);
        assert!(
            why[0].starts_with("read_back_ratio 0.5000 is not >= 0.9900"),
            "{why:?}"
        );

        let mut f = good(ClassStage::Mixed);
        f.window.drift_repairs = 6;
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::RollBack);
        assert!(why[0].starts_with("drift_repairs 6 is not <= 5"), "{why:?}");

        let mut f = good(ClassStage::Enforce);
        f.window.convergence_p99 = Some(Duration::from_secs(11));
        assert_eq!(kind(&f).0, VerdictKind::RollBack);

        let mut f = good(ClassStage::Enforce);
        f.window.refusals.insert(RefusalReason::Enforcement, 2);
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::RollBack);
        assert!(why[0].starts_with("enforcement_refusal_rate"), "{why:?}");

        let mut f = good(ClassStage::Enforce);
        f.recovery = Recovery::Done(Duration::from_secs(11));
        assert_eq!(kind(&f).0, VerdictKind::RollBack);

        let mut f = good(ClassStage::Observe);
        f.window.drift_repairs = 6;
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold);
        assert!(why[0].contains("not ready to enforce"), "{why:?}");
    }

    #[test]
    fn what_is_not_the_enforcements_fault_holds() {
        let mut f = good(ClassStage::Enforce);
        f.window.prepare_p99 = Some(Duration::from_millis(150));
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold);
        assert!(
            why[0].starts_with("prepare_p99 150.000ms is not <= 100.000ms"),
            "{why:?}"
        );

        let mut f = good(ClassStage::Enforce);
        f.window.refusals.insert(RefusalReason::Capacity, 3);
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold);
        assert!(
            why[0].starts_with("refusal_rate 0.1000 is not <= 0.0500"),
            "{why:?}"
        );

        let mut f = good(ClassStage::Enforce);
        f.recovery = Recovery::Waiting {
            unverified: 2,
            since: Duration::from_secs(3),
        };
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold);
        assert!(
            why.iter().any(|w| w.contains("2 share(s) not verified")),
            "{why:?}"
        );
    }

    #[test]
    fn too_few_samples_hold_but_never_hide_a_breach() {
        let mut f = good(ClassStage::Observe);
        f.window.claims = 3;
        f.window.prepare_samples = 3;
        f.window.convergence_samples = 3;
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold);
        assert!(why[0].starts_with("too few claims: 3"), "{why:?}");
        // A read-back breach needs no sample count.
        f.stage = ClassStage::Enforce;
        f.read_back[0].read_back = Quantity::ZERO;
        assert_eq!(kind(&f).0, VerdictKind::RollBack);
        // Nothing to enforce, nothing converged yet: not promoted on claims alone.
        let mut f = good(ClassStage::Observe);
        f.read_back.clear();
        f.window.convergence_p99 = None;
        f.window.convergence_samples = 0;
        let (k, why) = kind(&f);
        assert_eq!(k, VerdictKind::Hold, "{why:?}");
        assert!(why[0].starts_with("convergence_p99: none"), "{why:?}");
    }
}
