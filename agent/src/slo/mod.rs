//! The SLO figures that decide a rollout, kept per DeviceClass (the config's `class`)
//! over sliding windows, and the verdict on them (promote, hold, roll back).
//!
//! The engine records events here as they happen ([`Slo`]): each Prepare's answer, a
//! share's admission and its first ENFORCED (or OBSERVED), a drift repair, recovery
//! after a start. What can be read from the records at any time (allocated against read
//! back) is computed when the figures are asked for, never kept (see
//! [`figures::ReadBackSum`]). A claim that names devices of several classes counts in
//! each of them.
//!
//! - [`window`]: time-bounded windows with bounded memory.
//! - [`objectives`]: what each class's figures are judged against.
//! - [`figures`]: one class's figures over a window.
//! - [`verdict`]: the verdict and its reasons.
//! - [`persist`]: the windows saved in the store and loaded at start.
//!
//! The rules are written down in `docs/operations.md` ("SLO figures and verdicts").

pub mod figures;
pub mod objectives;
pub mod persist;
pub mod verdict;
pub mod window;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    time::{Duration, Instant},
};

pub use figures::{ClassFigures, ClassStage, ReadBack, ReadBackSum, Recovery, WindowFigures};
pub use objectives::{Objectives, SloConfig};
pub use verdict::{Verdict, VerdictKind};

use crate::{
    error::{ClaimError, Code},
    sync::lock,
};
use window::{CountWindow, SampleWindow};

/// Why a claim was refused or failed, as the SLO figures count it: from the error's code
/// and the field it names, never from its text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefusalReason {
    /// Over the device's free capacity (ResourceExhausted).
    Capacity,
    /// An amount the device's request policy or capacities do not allow (InvalidArgument
    /// on a `consumed_capacity` field).
    Policy,
    /// Any other malformed request (InvalidArgument).
    Invalid,
    /// Not allowed: the namespace on the device, adminAccess, another namespace's pod
    /// (PermissionDenied).
    Denied,
    /// A newer control-plane epoch was accepted (FailedPrecondition on `epoch`).
    Epoch,
    /// A conflicting claim or shareID (AlreadyExists).
    Conflict,
    /// Any other precondition: a re-allocation before Unprepare, a release in progress.
    Precondition,
    /// The node could not take it now: the store, a roll-back in progress (Unavailable,
    /// Internal).
    Unavailable,
    /// Admitted, then the limit could not be applied or read back: the claim was rolled
    /// back. The only refusal that is the enforcement's own.
    Enforcement,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 9] = [
        RefusalReason::Capacity,
        RefusalReason::Policy,
        RefusalReason::Invalid,
        RefusalReason::Denied,
        RefusalReason::Epoch,
        RefusalReason::Conflict,
        RefusalReason::Precondition,
        RefusalReason::Unavailable,
        RefusalReason::Enforcement,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RefusalReason::Capacity => "capacity",
            RefusalReason::Policy => "policy",
            RefusalReason::Invalid => "invalid",
            RefusalReason::Denied => "denied",
            RefusalReason::Epoch => "epoch",
            RefusalReason::Conflict => "conflict",
            RefusalReason::Precondition => "precondition",
            RefusalReason::Unavailable => "unavailable",
            RefusalReason::Enforcement => "enforcement",
        }
    }

    /// The reason for a claim answered with `e`; `rolled_back`: its shares were admitted
    /// and the claim rolled back because enforcing them failed.
    pub fn of(e: &ClaimError, rolled_back: bool) -> RefusalReason {
        if rolled_back {
            return RefusalReason::Enforcement;
        }
        match e.code {
            Code::ResourceExhausted => RefusalReason::Capacity,
            Code::InvalidArgument if e.field.contains(".consumed_capacity") => {
                RefusalReason::Policy
            }
            Code::InvalidArgument => RefusalReason::Invalid,
            Code::PermissionDenied => RefusalReason::Denied,
            Code::FailedPrecondition if e.field == "epoch" => RefusalReason::Epoch,
            Code::FailedPrecondition => RefusalReason::Precondition,
            Code::AlreadyExists => RefusalReason::Conflict,
            Code::Unavailable | Code::Internal => RefusalReason::Unavailable,
        }
    }
}

/// What one window keeps of one class.
#[derive(Debug)]
struct Windows {
    /// Durable-answer latency of claims answered without an error.
    prepare: SampleWindow,
    /// Admission to the first ENFORCED (OBSERVED in observe).
    convergence: SampleWindow,
    /// Claims asked for, refused or not.
    claims: CountWindow,
    refusals: BTreeMap<RefusalReason, CountWindow>,
    repairs: CountWindow,
    span: Duration,
    origin: Instant,
}

impl Windows {
    fn new(span: Duration, origin: Instant) -> Self {
        Self {
            prepare: SampleWindow::new(span),
            convergence: SampleWindow::new(span),
            claims: CountWindow::new(span, origin),
            refusals: BTreeMap::new(),
            repairs: CountWindow::new(span, origin),
            span,
            origin,
        }
    }

    fn figures(&mut self, now: Instant) -> WindowFigures {
        let prepare = self.prepare.samples(now);
        let convergence = self.convergence.samples(now);
        let refusals: BTreeMap<RefusalReason, u64> = self
            .refusals
            .iter_mut()
            .map(|(r, w)| (*r, w.count(now)))
            .filter(|(_, n)| *n > 0)
            .collect();
        WindowFigures {
            span: self.span,
            prepare_p50: prepare.quantile(0.5),
            prepare_p99: prepare.quantile(0.99),
            prepare_samples: prepare.len() as u64,
            prepare_truncated: prepare.truncated,
            convergence_p99: convergence.quantile(0.99),
            convergence_samples: convergence.len() as u64,
            convergence_truncated: convergence.truncated,
            claims: self.claims.count(now),
            refusals,
            drift_repairs: self.repairs.count(now),
        }
    }
}

#[derive(Debug)]
struct ClassWindows {
    long: Windows,
    short: Windows,
}

/// Recovery of one class after this start.
#[derive(Debug)]
enum RecoveryState {
    /// The shares still to be verified, by key.
    Waiting(BTreeSet<String>),
    Done(Duration),
}

#[derive(Debug, Default)]
struct Inner {
    classes: BTreeMap<String, ClassWindows>,
    /// Shares admitted by this process that have not reached their phase yet: key ->
    /// (class, when admitted). Bounded by the live shares; an entry goes when its share
    /// converges or is released.
    admitted: HashMap<String, (String, Instant)>,
    recovery: BTreeMap<String, RecoveryState>,
    /// Whether the start's recovery was set up: a store reopened later is not a start.
    recovery_set: bool,
    /// Whether the saved windows were loaded: a store reopened later holds only what
    /// this process saved itself.
    restored: bool,
}

/// The recorder the engine feeds.
#[derive(Debug)]
pub struct Slo {
    window: Duration,
    short_window: Duration,
    /// The agent's start: when the engine began to open the store.
    started: Instant,
    /// Where the count windows number their buckets from: a window before the start,
    /// so that counts loaded from before it keep their place (see [`persist`]).
    count_origin: Instant,
    inner: std::sync::Mutex<Inner>,
}

impl Slo {
    pub fn new(cfg: &SloConfig, started: Instant) -> Self {
        Self {
            window: cfg.window,
            short_window: cfg.short_window,
            started,
            // Where the machine has been up for less than a window, counts loaded from
            // before the start land in its first bucket: they then leave the window
            // early, never late.
            count_origin: started.checked_sub(cfg.window).unwrap_or(started),
            inner: std::sync::Mutex::new(Inner::default()),
        }
    }

    fn with_class<T>(&self, inner: &mut Inner, class: &str, f: impl Fn(&mut Windows) -> T) {
        let (long, short, origin) = (self.window, self.short_window, self.count_origin);
        let c = inner
            .classes
            .entry(class.to_owned())
            .or_insert_with(|| ClassWindows {
                long: Windows::new(long, origin),
                short: Windows::new(short, origin),
            });
        f(&mut c.long);
        f(&mut c.short);
    }

    /// One claim of a Prepare answered after `took`, in each of `classes` it touches;
    /// `refusal`: why it was refused or failed.
    pub fn prepared(
        &self,
        classes: &BTreeSet<String>,
        took: Duration,
        refusal: Option<RefusalReason>,
        now: Instant,
    ) {
        let mut inner = lock(&self.inner);
        for class in classes {
            self.with_class(&mut inner, class, |w| {
                w.claims.add(now, 1);
                match refusal {
                    None => w.prepare.record(now, took),
                    Some(r) => w
                        .refusals
                        .entry(r)
                        .or_insert_with(|| CountWindow::new(w.span, w.origin))
                        .add(now, 1),
                }
            });
        }
    }

    /// Share `key` of `class` was admitted (its record first queued for the store).
    pub fn admitted(&self, key: &str, class: &str, now: Instant) {
        lock(&self.inner)
            .admitted
            .insert(key.to_owned(), (class.to_owned(), now));
    }

    /// Share `key` reached ENFORCED or OBSERVED: the first time since its admission by
    /// this process, the time it took is a convergence sample. Returns it and the class.
    pub fn converged(&self, key: &str, now: Instant) -> Option<(String, Duration)> {
        let mut inner = lock(&self.inner);
        let (class, at) = inner.admitted.remove(key)?;
        let took = now.saturating_duration_since(at);
        self.with_class(&mut inner, &class, |w| w.convergence.record(now, took));
        Some((class, took))
    }

    /// Share `key` is no longer live (released, failed): it will not converge.
    pub fn forget(&self, key: &str) {
        lock(&self.inner).admitted.remove(key);
    }

    /// The reconciler repaired a drifted share of `class`.
    pub fn repaired(&self, class: &str, now: Instant) {
        let mut inner = lock(&self.inner);
        self.with_class(&mut inner, class, |w| w.repairs.add(now, 1));
    }

    /// The shares each class must have verified for it to count as recovered, as the
    /// start found them. A class with none is recovered at its first check. Only the
    /// first call counts.
    pub fn expect_recovery(&self, to_verify: BTreeMap<String, BTreeSet<String>>) {
        let mut inner = lock(&self.inner);
        if std::mem::replace(&mut inner.recovery_set, true) {
            return;
        }
        inner.recovery = to_verify
            .into_iter()
            .map(|(class, keys)| (class, RecoveryState::Waiting(keys)))
            .collect();
    }

    /// Whether some class has not recovered yet (so the engine need not look when none).
    pub fn recovering(&self) -> bool {
        lock(&self.inner)
            .recovery
            .values()
            .any(|r| matches!(r, RecoveryState::Waiting(_)))
    }

    /// Drops from each waiting class the shares `verified` says are verified (or gone);
    /// a class with none left is recovered now. Returns the classes that just recovered.
    pub fn check_recovery(
        &self,
        verified: impl Fn(&str) -> bool,
        now: Instant,
    ) -> Vec<(String, Duration)> {
        let mut inner = lock(&self.inner);
        let took = now.saturating_duration_since(self.started);
        let mut done = Vec::new();
        for (class, state) in &mut inner.recovery {
            if let RecoveryState::Waiting(keys) = state {
                keys.retain(|k| !verified(k));
                if keys.is_empty() {
                    *state = RecoveryState::Done(took);
                    done.push((class.clone(), took));
                }
            }
        }
        done
    }

    /// The recovery figure of `class`.
    pub fn recovery(&self, class: &str) -> Recovery {
        match lock(&self.inner).recovery.get(class) {
            Some(RecoveryState::Done(d)) => Recovery::Done(*d),
            Some(RecoveryState::Waiting(keys)) => Recovery::Waiting {
                unverified: keys.len() as u64,
                since: self.started.elapsed(),
            },
            // A class whose devices were added after the start: nothing to recover.
            None => Recovery::Done(Duration::ZERO),
        }
    }

    /// Each class's verdict window as saved in the store (see [`persist`]): its key's
    /// class and the encoded record.
    pub fn snapshot(&self, now: Instant, now_ms: u64) -> Vec<(String, Vec<u8>)> {
        let mut inner = lock(&self.inner);
        inner
            .classes
            .iter_mut()
            .map(|(class, c)| {
                let w = &mut c.long;
                let (prepare, prepare_dropped) = w.prepare.entries(now);
                let (convergence, convergence_dropped) = w.convergence.entries(now);
                let rec = persist::SloRecord {
                    saved_ms: now_ms,
                    prepare: persist::samples(&prepare),
                    prepare_dropped_ms: prepare_dropped.map(persist::ms),
                    convergence: persist::samples(&convergence),
                    convergence_dropped_ms: convergence_dropped.map(persist::ms),
                    claims: persist::counts(&w.claims.entries(now)),
                    refusals: w
                        .refusals
                        .iter_mut()
                        .map(|(r, cw)| (r.name().to_owned(), persist::counts(&cw.entries(now))))
                        .filter(|(_, v)| !v.is_empty())
                        .collect(),
                    repairs: persist::counts(&w.repairs.entries(now)),
                };
                (class.clone(), rec.encode_bounded())
            })
            .collect()
    }

    /// Loads the saved windows of `classes` (the config's; a class no device names any
    /// more is left out), before anything is recorded. Returns the classes loaded; a
    /// record that does not decode is logged and skipped: the class starts empty.
    pub fn restore(
        &self,
        saved: &BTreeMap<String, Vec<u8>>,
        classes: &BTreeSet<String>,
        now: Instant,
        now_ms: u64,
    ) -> Vec<String> {
        let mut inner = lock(&self.inner);
        let mut loaded = Vec::new();
        if std::mem::replace(&mut inner.restored, true) {
            return loaded;
        }
        for (class, bytes) in saved.iter().filter(|(c, _)| classes.contains(*c)) {
            let rec: persist::SloRecord = match crate::record::decode(bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(%class, error = %e, "the saved SLO window does not read; the class starts empty");
                    continue;
                }
            };
            let r = persist::Rebase::new(rec.saved_ms, now_ms, now, self.window);
            let prepare = r.samples(&rec.prepare);
            let convergence = r.samples(&rec.convergence);
            let claims = r.counts(&rec.claims);
            let repairs = r.counts(&rec.repairs);
            let refusals: Vec<(RefusalReason, Vec<(Instant, u64)>)> = rec
                .refusals
                .iter()
                .filter_map(|(name, v)| Some((persist::reason(name)?, r.counts(v))))
                .collect();
            let prepare_dropped = rec.prepare_dropped_ms.and_then(|a| r.at(a));
            let convergence_dropped = rec.convergence_dropped_ms.and_then(|a| r.at(a));
            self.with_class(&mut inner, class, |w| {
                for (at, v) in &prepare {
                    w.prepare.record(*at, *v);
                }
                for (at, v) in &convergence {
                    w.convergence.record(*at, *v);
                }
                if let Some(at) = prepare_dropped {
                    w.prepare.mark_dropped(at);
                }
                if let Some(at) = convergence_dropped {
                    w.convergence.mark_dropped(at);
                }
                for (at, n) in &claims {
                    w.claims.add(*at, *n);
                }
                for (at, n) in &repairs {
                    w.repairs.add(*at, *n);
                }
                for (reason, counts) in &refusals {
                    let cw = w
                        .refusals
                        .entry(*reason)
                        .or_insert_with(|| CountWindow::new(w.span, w.origin));
                    for (at, n) in counts {
                        cw.add(*at, *n);
                    }
                }
            });
            loaded.push(class.clone());
        }
        loaded
    }

    /// The figures kept for `class` over the verdict's window and the short one.
    pub fn windows(&self, class: &str, now: Instant) -> (WindowFigures, WindowFigures) {
        let mut inner = lock(&self.inner);
        match inner.classes.get_mut(class) {
            Some(c) => (c.long.figures(now), c.short.figures(now)),
            None => (
                WindowFigures::empty(self.window),
                WindowFigures::empty(self.short_window),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classes(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn reasons_come_from_the_code_and_field() {
        let cases = [
            (ClaimError::exhausted("claims[0]", "x"), "capacity"),
            (
                ClaimError::invalid("claims[0].allocations[0].consumed_capacity[bandwidth]", "x"),
                "policy",
            ),
            (ClaimError::invalid("claims[0].claim.uid", "x"), "invalid"),
            (
                ClaimError::denied("claims[0].claim.namespace", "x"),
                "denied",
            ),
            (ClaimError::stale_epoch(1, 2), "epoch"),
            (
                ClaimError::precondition("claims[0].allocation_id", "x"),
                "precondition",
            ),
            (ClaimError::conflict("claims[0]", "x"), "conflict"),
            (ClaimError::unavailable("x"), "unavailable"),
            (ClaimError::internal("x"), "unavailable"),
        ];
        for (e, want) in cases {
            assert_eq!(RefusalReason::of(&e, false).name(), want, "{e:?}");
            assert_eq!(RefusalReason::of(&e, true), RefusalReason::Enforcement);
        }
    }

    #[test]
    fn a_claim_counts_in_every_class_it_touches() {
        let t0 = Instant::now();
        let s = Slo::new(&SloConfig::default(), t0);
        let both = classes(&["a", "b"]);
        s.prepared(&both, Duration::from_millis(3), None, t0);
        s.prepared(
            &both,
            Duration::from_millis(1),
            Some(RefusalReason::Capacity),
            t0,
        );
        s.prepared(&classes(&["b"]), Duration::from_millis(9), None, t0);
        let (a, _) = s.windows("a", t0);
        let (b, short) = s.windows("b", t0);
        assert_eq!((a.claims, a.prepare_samples), (2, 1));
        assert_eq!(a.refusals[&RefusalReason::Capacity], 1);
        assert_eq!((b.claims, b.prepare_samples), (3, 2));
        assert_eq!(b.prepare_p99, Some(Duration::from_millis(9)));
        assert_eq!(short.claims, 3, "the short window sees the same events");
        assert_eq!(s.windows("c", t0).0.claims, 0);
    }

    #[test]
    fn convergence_counts_once_per_admission_and_not_after_a_release() {
        let t0 = Instant::now();
        let s = Slo::new(&SloConfig::default(), t0);
        s.admitted("s1", "a", t0);
        s.admitted("s2", "a", t0);
        let got = s.converged("s1", t0 + Duration::from_millis(40));
        assert_eq!(got, Some(("a".to_owned(), Duration::from_millis(40))));
        assert_eq!(s.converged("s1", t0 + Duration::from_secs(9)), None);
        s.forget("s2");
        assert_eq!(s.converged("s2", t0 + Duration::from_secs(9)), None);
        let (w, _) = s.windows("a", t0 + Duration::from_secs(10));
        assert_eq!(
            (w.convergence_samples, w.convergence_p99),
            (1, Some(Duration::from_millis(40)))
        );
    }

    #[test]
    fn windows_saved_at_a_stop_are_the_windows_after_the_next_start() {
        let cfg = SloConfig::default(); // 1 h, and 5 min beside it
        let t0 = Instant::now();
        let before = Slo::new(&cfg, t0);
        let (a, gone) = (classes(&["a"]), classes(&["gone"]));
        let min = Duration::from_secs(60);
        let ms = Duration::from_millis(1);
        // 50 min before the stop: one claim; 2 min before: two more, one refused;
        // a repair and a convergence in between; a class the next config lacks.
        let stop = t0 + 60 * min;
        before.prepared(&a, 7 * ms, None, stop - 50 * min);
        before.prepared(&a, 3 * ms, None, stop - 2 * min);
        before.prepared(&a, ms, Some(RefusalReason::Capacity), stop - 2 * min);
        before.repaired("a", stop - 30 * min);
        before.admitted("s1", "a", stop - 40 * min);
        before.converged("s1", stop - 40 * min + 250 * ms);
        before.prepared(&gone, ms, None, stop - min);
        let saved: BTreeMap<String, Vec<u8>> =
            before.snapshot(stop, 1_000_000_000).into_iter().collect();
        assert_eq!(saved.len(), 2);

        // The next start, 5 min of wall time later, on a fresh monotonic clock.
        let t1 = Instant::now() + 120 * min;
        let after = Slo::new(&cfg, t1);
        let wall = 1_000_000_000 + 5 * 60 * 1000;
        let configured = classes(&["a", "b"]);
        assert_eq!(after.restore(&saved, &configured, t1, wall), ["a"]);
        assert!(
            after.restore(&saved, &configured, t1, wall).is_empty(),
            "once per process"
        );
        let (long, short) = after.windows("a", t1);
        assert_eq!((long.claims, long.prepare_samples), (3, 2));
        assert_eq!(long.prepare_p99, Some(7 * ms));
        assert_eq!(long.refusals[&RefusalReason::Capacity], 1);
        assert_eq!(long.drift_repairs, 1);
        assert_eq!(
            (long.convergence_samples, long.convergence_p99),
            (1, Some(250 * ms))
        );
        // 2 + 5 = 7 min old: outside the 5-min window.
        assert_eq!((short.claims, short.prepare_samples), (0, 0));
        assert_eq!(after.windows("gone", t1).0.claims, 0, "not configured");
        // They keep ageing: 50 + 5 + 6 = 61 min after, the first claim has left.
        let (long, _) = after.windows("a", t1 + 6 * min);
        assert_eq!((long.claims, long.prepare_samples), (2, 1));
        assert_eq!(long.prepare_p99, Some(3 * ms));
        // New events land beside the loaded ones.
        after.prepared(&a, 9 * ms, None, t1 + 6 * min);
        let (long, short) = after.windows("a", t1 + 6 * min);
        assert_eq!((long.claims, short.claims), (3, 1));
        assert_eq!(long.prepare_p99, Some(9 * ms));
    }

    #[test]
    fn recovery_is_measured_once_every_expected_share_is_verified() {
        let t0 = Instant::now();
        let s = Slo::new(&SloConfig::default(), t0);
        s.expect_recovery(
            [
                ("a".to_owned(), classes(&["s1", "s2"])),
                ("b".to_owned(), BTreeSet::new()),
            ]
            .into(),
        );
        assert!(s.recovering());
        let done = s.check_recovery(|k| k == "s1", t0 + Duration::from_millis(5));
        assert_eq!(done, vec![("b".to_owned(), Duration::from_millis(5))]);
        assert!(matches!(
            s.recovery("a"),
            Recovery::Waiting { unverified: 1, .. }
        ));
        let done = s.check_recovery(|_| true, t0 + Duration::from_millis(70));
        assert_eq!(done, vec![("a".to_owned(), Duration::from_millis(70))]);
        assert_eq!(s.recovery("a"), Recovery::Done(Duration::from_millis(70)));
        assert!(!s.recovering());
        // Once measured it stays: a later check changes nothing.
        assert!(
            s.check_recovery(|_| true, t0 + Duration::from_secs(9))
                .is_empty()
        );
    }
}
