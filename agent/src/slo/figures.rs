//! One class's figures: what its windows kept, and what its live shares say now.

use std::{collections::BTreeMap, time::Duration};

use shareguard_common::Quantity;

use super::RefusalReason;

/// What one window kept of one class.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowFigures {
    pub span: Duration,
    /// Durable-answer latency of the claims answered without an error.
    pub prepare_p50: Option<Duration>,
    pub prepare_p99: Option<Duration>,
    pub prepare_samples: u64,
    /// More answers than a window keeps: the percentiles cover the latest ones only.
    pub prepare_truncated: bool,
    /// Admission to the first ENFORCED (OBSERVED in the observe stage).
    pub convergence_p99: Option<Duration>,
    pub convergence_samples: u64,
    pub convergence_truncated: bool,
    /// Claims asked for (refused or not).
    pub claims: u64,
    /// Refused or failed claims by reason; reasons with none are left out.
    pub refusals: BTreeMap<RefusalReason, u64>,
    pub drift_repairs: u64,
}

impl WindowFigures {
    pub fn empty(span: Duration) -> Self {
        Self {
            span,
            prepare_p50: None,
            prepare_p99: None,
            prepare_samples: 0,
            prepare_truncated: false,
            convergence_p99: None,
            convergence_samples: 0,
            convergence_truncated: false,
            claims: 0,
            refusals: BTreeMap::new(),
            drift_repairs: 0,
        }
    }

    pub fn refused(&self) -> u64 {
        self.refusals.values().fold(0, |a, n| a.saturating_add(*n))
    }

    /// Refused over asked for; None with no claims.
    pub fn refusal_rate(&self) -> Option<f64> {
        (self.claims > 0).then(|| self.refused() as f64 / self.claims as f64)
    }

    /// The claims refused because enforcing them failed, over asked for.
    pub fn enforcement_refusal_rate(&self) -> Option<f64> {
        let n = self
            .refusals
            .get(&RefusalReason::Enforcement)
            .copied()
            .unwrap_or(0);
        (self.claims > 0).then(|| n as f64 / self.claims as f64)
    }
}

/// Allocated against read back, for one capacity of one class, now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReadBack {
    pub capacity: String,
    /// What every live share of the class holds in the ledger.
    pub allocated: Quantity,
    /// What the shares that should be enforced asked for (see [`ReadBackSum::add`]).
    pub requested: Quantity,
    /// What the kernel or driver was last read back to enforce for those shares.
    pub read_back: Quantity,
    /// How many shares `requested` sums.
    pub shares: u64,
}

impl ReadBack {
    /// read_back / requested; None when nothing should be enforced.
    pub fn ratio(&self) -> Option<f64> {
        if self.requested.is_zero() {
            return None;
        }
        Some(self.read_back.nanos() as f64 / self.requested.nanos() as f64)
    }
}

pub use crate::amounts::Amounts;

/// Sums [`ReadBack`] over a class's live shares.
#[derive(Debug, Default)]
pub struct ReadBackSum {
    by_capacity: BTreeMap<String, ReadBack>,
}

impl ReadBackSum {
    /// A live share: `consumed` is what it holds in the ledger; `enforceable`, for a
    /// share that should be enforced now, what it asks the limiter for (a dedicated
    /// allocation: the whole device) and what was read back. A share should be enforced
    /// when its device is in the enforce stage, the device's mechanism enforces (not
    /// accounting, not a watchdog alone) and the share is past its admission with a
    /// sandbox to hold it on (not PREPARING, PENDING or RELEASING). Each capacity's read
    /// back counts up to what the share asked for: a looser limit does not hold the
    /// share to its amount, and must not make up for another share's shortfall. Sums
    /// that overflow stop where they reached; a figure off by that much says so on its
    /// own.
    pub fn add(
        &mut self,
        consumed: &Amounts,
        enforceable: Option<(&BTreeMap<String, Quantity>, &Amounts)>,
    ) {
        let add = |a: &mut Quantity, b: &Quantity| {
            if let Some(s) = a.checked_add(b) {
                *a = s;
            }
        };
        for (name, q) in consumed {
            add(&mut self.entry(name).allocated, q);
        }
        if let Some((wanted, enforced)) = enforceable {
            for (name, q) in wanted {
                let e = self.entry(name);
                add(&mut e.requested, q);
                e.shares += 1;
                if let Some(got) = enforced.get(name) {
                    add(&mut e.read_back, got.min(q));
                }
            }
        }
    }

    fn entry(&mut self, name: &str) -> &mut ReadBack {
        self.by_capacity
            .entry(name.to_owned())
            .or_insert_with(|| ReadBack {
                capacity: name.to_owned(),
                ..Default::default()
            })
    }

    pub fn finish(self) -> Vec<ReadBack> {
        self.by_capacity.into_values().collect()
    }
}

/// Recovery after this start.
#[derive(Clone, Debug, PartialEq)]
pub enum Recovery {
    /// Start to every share of the class verified.
    Done(Duration),
    /// Not all verified yet: how many are left, and how long since the start.
    Waiting { unverified: u64, since: Duration },
}

/// A class's stage, from its devices'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClassStage {
    Observe,
    Enforce,
    /// Some devices in each: judged as enforce (something can be rolled back).
    Mixed,
}

impl ClassStage {
    pub fn name(self) -> &'static str {
        match self {
            ClassStage::Observe => "observe",
            ClassStage::Enforce => "enforce",
            ClassStage::Mixed => "mixed",
        }
    }

    /// Whether some device of the class enforces.
    pub fn enforces(self) -> bool {
        self != ClassStage::Observe
    }
}

/// Everything the verdict on one class is taken from.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassFigures {
    pub class: String,
    pub stage: ClassStage,
    pub devices: Vec<String>,
    /// No device of the class has a mechanism that limits: nothing converges, nothing
    /// is read back.
    pub accounting_only: bool,
    /// Over the verdict's window.
    pub window: WindowFigures,
    pub short: WindowFigures,
    pub read_back: Vec<ReadBack>,
    pub recovery: Recovery,
}

impl ClassFigures {
    /// The lowest read-back ratio over the class's capacities; None when no share
    /// should be enforced.
    pub fn read_back_ratio(&self) -> Option<(&str, f64)> {
        self.read_back
            .iter()
            .filter_map(|r| Some((r.capacity.as_str(), r.ratio()?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), q(v))).collect()
    }

    #[test]
    fn read_back_sums_only_what_should_be_enforced() {
        let mut s = ReadBackSum::default();
        let a = |pairs: &[(&str, &str)]| Amounts::from(map(pairs));
        let held = map(&[("bandwidth", "100M")]);
        s.add(
            &held.clone().into(),
            Some((&held, &a(&[("bandwidth", "100M")]))),
        );
        // Drifted: nothing read back.
        let other = map(&[("bandwidth", "50M")]);
        s.add(&a(&[("bandwidth", "50M")]), Some((&other, &Amounts::new())));
        // Pending or observed: allocated, not expected to be enforced.
        s.add(&a(&[("bandwidth", "30M")]), None);
        // Held looser than asked: counts as what was asked, never more.
        let loose = map(&[("bandwidth", "50M")]);
        s.add(
            &a(&[("bandwidth", "50M")]),
            Some((&loose, &a(&[("bandwidth", "80M")]))),
        );
        let r = s.finish();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].allocated, q("230M"));
        assert_eq!(r[0].requested, q("200M"));
        assert_eq!(r[0].read_back, q("150M"));
        assert_eq!(r[0].shares, 3);
        let ratio = r[0].ratio().unwrap();
        assert!((ratio - 0.75).abs() < 1e-9, "{ratio}");
        let none = ReadBack::default();
        assert_eq!(none.ratio(), None, "nothing to enforce: no ratio, not 0");
    }

    #[test]
    fn refusal_rates_are_over_claims_asked_for() {
        let mut w = WindowFigures::empty(Duration::from_secs(60));
        assert_eq!(w.refusal_rate(), None);
        w.claims = 10;
        w.refusals.insert(RefusalReason::Capacity, 2);
        w.refusals.insert(RefusalReason::Enforcement, 1);
        assert_eq!(w.refused(), 3);
        assert_eq!(w.refusal_rate(), Some(0.3));
        assert_eq!(w.enforcement_refusal_rate(), Some(0.1));
    }
}
