//! The SLO figures as the engine records them (see `engine/slo.rs`), on the fake kernel.

use super::*;
use crate::slo::{Recovery, RefusalReason, VerdictKind};

const CLASS: &str = "shareguard-accounted";

fn class(e: &Engine) -> crate::engine::ClassSlo {
    let mut all = e.slo(Some(CLASS)).unwrap();
    assert_eq!(all.len(), 1);
    all.remove(0)
}

#[test]
fn prepares_refusals_and_convergence_are_counted_in_the_class() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    let ok = claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")]);
    assert_eq!(rt.block_on(e.prepare(0, &[ok], 0)).unwrap()[0].error, None);
    // Over capacity, and one whose limit cannot be applied (rolled back).
    let big = claim("c2", "a1", vec![alloc("gen-0", &share(2), "20Gi")]);
    let out = rt.block_on(e.prepare(0, &[big], 0)).unwrap();
    assert_eq!(out[0].error.as_ref().unwrap().code, Code::ResourceExhausted);
    lock(&k.fail_apply).insert(share(3));
    let failing = claim("c3", "a1", vec![alloc("gen-1", &share(3), "1Gi")]);
    let out = rt.block_on(e.prepare(0, &[failing], 0)).unwrap();
    assert!(out[0].error.is_some());

    let s = class(&e);
    let w = &s.figures.window;
    assert_eq!(w.claims, 3);
    assert_eq!(
        w.prepare_samples, 1,
        "only the durable answer is a latency sample"
    );
    assert_eq!(w.refusals[&RefusalReason::Capacity], 1);
    assert_eq!(w.refusals[&RefusalReason::Enforcement], 1);
    assert_eq!(w.refusals.len(), 2);
    assert_eq!(
        w.convergence_samples, 1,
        "the rolled-back share never converged"
    );
    assert_eq!(s.figures.read_back.len(), 1);
    let rb = &s.figures.read_back[0];
    assert_eq!(
        (rb.allocated, rb.requested, rb.read_back),
        (q("2Gi"), q("2Gi"), q("2Gi"))
    );
    assert!(
        matches!(s.figures.recovery, Recovery::Done(_)),
        "nothing to verify at the start"
    );
    // Three claims are under the default min_samples: hold, and say so.
    assert_eq!(s.verdict.kind, VerdictKind::Hold);
    assert!(
        s.verdict.reasons[0].starts_with("too few claims: 3"),
        "{:?}",
        s.verdict.reasons
    );
    assert!(matches!(
        e.slo(Some("no-such-class")),
        Err(crate::error::RequestError::UnknownClass(_))
    ));
}

#[test]
fn a_share_not_held_as_read_back_rolls_the_class_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    let ok = claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")]);
    assert_eq!(rt.block_on(e.prepare(0, &[ok], 0)).unwrap()[0].error, None);
    // Read back short: DEGRADED, and it holds nothing for the figure.
    *lock(&k.shortfall) = Some(q("1Mi"));
    let short = claim("c2", "a1", vec![alloc("gen-1", &share(2), "2Gi")]);
    let out = rt.block_on(e.prepare(0, &[short], 0)).unwrap();
    assert_eq!(out[0].shares[0].phase, Phase::Degraded);
    let s = class(&e);
    let rb = &s.figures.read_back[0];
    assert_eq!(
        (rb.requested, rb.read_back, rb.shares),
        (q("4Gi"), q("2Gi"), 2)
    );
    assert_eq!(
        s.verdict.kind,
        VerdictKind::RollBack,
        "{:?}",
        s.verdict.reasons
    );
    assert_eq!(
        s.verdict.reasons,
        vec!["read_back_ratio 0.5000 is not >= 0.9900 (lowest on memory)".to_owned()]
    );
}

#[test]
fn recovery_after_a_restart_is_measured_once_and_unsaved_windows_start_empty() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    let started = std::time::Instant::now();
    let e = open(&cfg, Some(&k), "boot-a");
    let took = started.elapsed();
    let s = class(&e);
    let Recovery::Done(d) = s.figures.recovery else {
        panic!(
            "every share verified at the start: {:?}",
            s.figures.recovery
        );
    };
    assert!(d <= took, "{d:?} > {took:?}");
    // Nothing saved them (the server saves on a period and at stop): as at a crash.
    assert_eq!(s.figures.window.claims, 0);
    let rb = &s.figures.read_back[0];
    assert_eq!((rb.read_back, rb.shares), (q("3Gi"), 3));
    // After a reboot the shares wait for their pods (PENDING): not recovered yet, and
    // nothing is expected to be read back from a share with no sandbox.
    drop(e);
    let e = open(&cfg, Some(&k), "boot-b");
    let s = class(&e);
    assert!(
        matches!(s.figures.recovery, Recovery::Waiting { unverified: 3, .. }),
        "{:?}",
        s.figures.recovery
    );
    assert_eq!(s.verdict.kind, VerdictKind::Hold);
    assert!(
        s.verdict
            .reasons
            .iter()
            .any(|r| r.contains("3 share(s) not verified")),
        "{:?}",
        s.verdict.reasons
    );
}

#[test]
fn saved_windows_come_back_at_the_next_open_and_a_dropped_class_is_forgotten() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    {
        let e = open(&cfg, Some(&k), "boot-a");
        let ok = claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")]);
        assert_eq!(rt.block_on(e.prepare(0, &[ok], 0)).unwrap()[0].error, None);
        e.save_slo().wait_blocking().unwrap();
    }
    let e = open(&cfg, Some(&k), "boot-a");
    let w = class(&e).figures.window;
    assert_eq!(
        (w.claims, w.prepare_samples, w.convergence_samples),
        (1, 1, 1)
    );
    drop(e);
    // The devices move to another class: the old class's window is dropped at open...
    let mut moved = (*cfg).clone();
    for d in &mut moved.devices {
        d.class = "shareguard-elsewhere".into();
    }
    drop(open(&Arc::new(moved), Some(&k), "boot-a"));
    // ...so moving them back finds it empty.
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(class(&e).figures.window.claims, 0);
}
