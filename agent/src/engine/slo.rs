//! Where the engine feeds the SLO figures (see [`crate::slo`]) and reads them back: the
//! events as they happen, allocated against read back from the records when asked.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use crate::{
    amounts::Amounts,
    error::{ClaimError, RequestError},
    record::{Phase, ShareRecord},
    request,
    rollout::Stage,
    slo::{self, ClassFigures, ClassStage, Objectives, ReadBackSum, RefusalReason, Verdict},
    sync::lock,
};

use super::{Engine, now_ms};

/// One class's figures, its objectives and the verdict on them.
#[derive(Clone, Debug)]
pub struct ClassSlo {
    pub figures: ClassFigures,
    pub objectives: Objectives,
    pub verdict: Verdict,
}

/// The phases a share's status converges to: what its device's stage and mechanism give
/// it (ACCOUNTED for a GPU the watchdog can only watch).
fn converged_phase(p: Phase) -> bool {
    matches!(p, Phase::Enforced | Phase::Observed | Phase::Accounted)
}

/// The phases a share had before a restart that recovery must verify again: it was, or
/// was about to be, held by a limiter. PENDING shares had nothing to verify; RELEASING
/// ones wait for their Unprepare.
pub(super) fn to_verify(p: Phase) -> bool {
    matches!(
        p,
        Phase::Enforced | Phase::Observed | Phase::Degraded | Phase::Unknown | Phase::Preparing
    )
}

impl Engine {
    /// Loads the SLO windows the store saved (once per process, see
    /// [`crate::slo::persist`]), for the classes the config's devices are in. Returns
    /// the saved classes no device is in any more, whose windows the store can drop.
    pub(super) fn slo_restore(&self, saved: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
        if saved.is_empty() {
            return Vec::new();
        }
        let classes: BTreeSet<String> = self.cfg.devices.iter().map(|d| d.class.clone()).collect();
        let loaded = self.slo.restore(saved, &classes, Instant::now(), now_ms());
        if !loaded.is_empty() {
            tracing::info!(classes = ?loaded, "SLO windows loaded as last saved");
        }
        saved
            .keys()
            .filter(|c| !classes.contains(*c))
            .cloned()
            .collect()
    }

    /// Saves every class's SLO window in the store; resolves once it is durable. Not a
    /// change anyone waits for: a full disk fails it like any write, and the next save
    /// tries again.
    pub fn save_slo(&self) -> crate::store::Durable {
        let batch = crate::store::Batch {
            slo: self
                .slo
                .snapshot(Instant::now(), now_ms())
                .into_iter()
                .map(|(c, v)| (c, Some(v)))
                .collect(),
            ..Default::default()
        };
        if let Err(e) = batch.check_sizes() {
            // Not reached (each record is cut to fit), and never worth the store.
            tracing::error!(error = %e, "SLO windows not saved");
            return crate::store::Durable::failed();
        }
        self.submit(batch)
    }

    /// The DeviceClass of `device`, if the config has the device.
    pub(super) fn class_of(&self, device: &str) -> Option<&str> {
        self.cfg.device(device).map(|d| d.class.as_str())
    }

    /// The classes the allocations of `c` name (unknown devices name none).
    fn classes_of(&self, c: &request::ClaimPrepare) -> BTreeSet<String> {
        c.allocations
            .iter()
            .filter_map(|a| self.class_of(&a.device))
            .map(str::to_owned)
            .collect()
    }

    /// A claim of a Prepare was answered after `took`: counted in each class it touches.
    pub(super) fn slo_prepared(
        &self,
        c: &request::ClaimPrepare,
        took: Duration,
        error: Option<&ClaimError>,
        shares: &[ShareRecord],
    ) {
        let classes = self.classes_of(c);
        // Admitted, then rolled back: the shares say so (FAILED, or RELEASING while
        // what was installed is removed).
        let rolled_back = shares
            .iter()
            .any(|r| r.phase == Phase::Failed || r.rolling_back);
        let refusal = error.map(|e| RefusalReason::of(e, rolled_back));
        self.slo.prepared(&classes, took, refusal, Instant::now());
        for class in &classes {
            self.metrics.slo_prepared(class, took, refusal);
        }
    }

    /// Shares just admitted: their convergence is timed from now.
    pub(super) fn slo_admitted(&self, records: &[ShareRecord]) {
        let now = Instant::now();
        for r in records.iter().filter(|r| r.phase == Phase::Preparing) {
            if let Some(class) = self.class_of(&r.device) {
                self.slo.admitted(&r.key, class, now);
            }
        }
    }

    /// Every change of a share passes here (from `commit_locked`): a share's first
    /// converged phase since its admission is a convergence sample.
    pub(super) fn slo_changed(&self, r: &ShareRecord) {
        if converged_phase(r.phase) {
            if let Some((class, took)) = self.slo.converged(&r.key, Instant::now()) {
                self.metrics.slo_converged(&class, took);
            }
        } else if !r.phase.holds_capacity() {
            self.slo.forget(&r.key);
        }
    }

    pub(super) fn slo_repaired(&self, r: &ShareRecord) {
        if let Some(class) = self.class_of(&r.device) {
            self.slo.repaired(class, Instant::now());
            self.metrics.slo_repaired(class);
        }
    }

    /// Recovery is measured against the shares the store held in a phase to verify
    /// (see [`to_verify`]), by class. Only the first call counts: a store reopened later
    /// is not a start.
    pub(super) fn slo_expect_recovery(&self, stored: &[Box<ShareRecord>]) {
        let mut by_class: BTreeMap<String, BTreeSet<String>> = self
            .cfg
            .devices
            .iter()
            .map(|d| (d.class.clone(), BTreeSet::new()))
            .collect();
        for r in stored.iter().filter(|r| to_verify(r.phase)) {
            if self.accounting_only(&r.device) {
                continue;
            }
            if let Some(keys) = self.class_of(&r.device).and_then(|c| by_class.get_mut(c)) {
                keys.insert(r.key.clone());
            }
        }
        self.slo.expect_recovery(by_class);
    }

    /// Marks the classes whose every share to verify is verified (or gone) as recovered.
    /// Cheap once every class has recovered.
    pub(crate) fn slo_check_recovery(&self) {
        if !self.slo.recovering() {
            return;
        }
        let done = {
            let st = lock(&self.state);
            self.slo.check_recovery(
                |key| {
                    st.records
                        .get(key)
                        .is_none_or(|r| !r.phase.holds_capacity() || converged_phase(r.phase))
                },
                Instant::now(),
            )
        };
        for (class, took) in done {
            tracing::info!(%class, seconds = took.as_secs_f64(), "every share of the class verified since the start");
        }
    }

    /// The figures, objectives and verdict of every class the config's devices name (or
    /// of `only`; an unknown class is an error).
    pub fn slo(&self, only: Option<&str>) -> Result<Vec<ClassSlo>, RequestError> {
        self.slo_check_recovery();
        let mut classes: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for d in &self.cfg.devices {
            classes.entry(&d.class).or_default().push(&d.name);
        }
        if let Some(c) = only
            && !classes.contains_key(c)
        {
            return Err(RequestError::UnknownClass(c.to_owned()));
        }
        let now = Instant::now();
        let live: Vec<ShareRecord> = self.live_records();
        let mut out = Vec::new();
        for (class, devices) in classes {
            if only.is_some_and(|c| c != class) {
                continue;
            }
            let has = |st: Stage| devices.iter().any(|d| self.stage(d) == st);
            let stage = match (has(Stage::Observe), has(Stage::Enforce)) {
                (true, true) => ClassStage::Mixed,
                (true, false) => ClassStage::Observe,
                _ => ClassStage::Enforce,
            };
            let accounting_only = devices
                .iter()
                .all(|d| self.limiters.get(*d).is_none_or(|l| l.accounting_only()));
            let mut sum = ReadBackSum::default();
            for r in live.iter().filter(|r| devices.contains(&r.device.as_str())) {
                let none = Amounts::new();
                let consumed = if r.counts() { &r.consumed } else { &none };
                let spec;
                let enforceable = if self.should_be_enforced(r) {
                    spec = self.limits_of(r);
                    // Not verified as held: what its record last read back is stale
                    // (drift found) or does not match; it holds nothing for the figure.
                    let held = !matches!(r.phase, Phase::Degraded | Phase::Unknown);
                    Some((&spec, if held { &r.enforced } else { &none }))
                } else {
                    None
                };
                sum.add(consumed, enforceable);
            }
            let (window, short) = self.slo.windows(class, now);
            let figures = ClassFigures {
                class: class.to_owned(),
                stage,
                devices: devices.iter().map(|d| (*d).to_owned()).collect(),
                accounting_only,
                window,
                short,
                read_back: sum.finish(),
                recovery: self.slo.recovery(class),
            };
            let objectives = self.cfg.slo.objectives(class).clone();
            let verdict = slo::verdict::judge(&figures, &objectives);
            out.push(ClassSlo {
                figures,
                objectives,
                verdict,
            });
        }
        Ok(out)
    }

    /// Whether `r` should be held by its limiter now, and so count in the read-back
    /// ratio: its device enforces (stage and mechanism) and the share is past its
    /// admission with a sandbox to be held on. ACCOUNTED (a watchdog alone) is stated as
    /// not enforced up front, so it is not expected to read anything back.
    fn should_be_enforced(&self, r: &ShareRecord) -> bool {
        self.stage(&r.device) == Stage::Enforce
            && !self.accounting_only(&r.device)
            && matches!(
                r.phase,
                Phase::Enforced | Phase::Observed | Phase::Degraded | Phase::Unknown
            )
    }
}
