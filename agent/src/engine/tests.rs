//! Engine tests against a real sled store and a fake limiter that behaves like a kernel:
//! what `apply` installs survives the agent (an engine re-open) but can be wiped to
//! simulate a reboot, and any call can be made to fail.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, Mutex},
};

use proptest::prelude::*;
use shareguard_common::{
    Quantity,
    limiter::{Enforcement, LimitSpec, Limiter, LimiterError, Needs, Target},
};

use super::Engine;
use crate::{
    api::metrics::Metrics, config::Config, error::Code, record::Phase, request, sync::lock,
};

const DRIVER: &str = "shareguard.example.com";

fn config(dir: &std::path::Path, retention: &str) -> Arc<Config> {
    let text = format!(
        r#"
[agent]
state_dir = {:?}
audit_log = {:?}
cgroup_root = {:?}
tombstone_retention = "{retention}"

[[device]]
name = "gen-0"
driver = "{DRIVER}"
pool = "p"
kind = "generic"
allowed_namespaces = ["*"]
[device.capacity.memory]
value = "10Gi"

[[device]]
name = "gen-1"
driver = "{DRIVER}"
pool = "p"
kind = "generic"
allowed_namespaces = ["*"]
[device.capacity.memory]
value = "10Gi"
"#,
        dir.join("state"),
        dir.join("audit.jsonl"),
        dir.join("cgroup"),
    );
    Arc::new(Config::parse(&text, "test").unwrap())
}

/// What the fake kernel holds for one share: the limits and the target they apply to.
type Installed = (BTreeMap<String, Quantity>, Target);

/// A limiter with kernel-like state. Shared between engine instances so that "the kernel"
/// outlives a restart of the agent.
#[derive(Default)]
struct FakeKernel {
    installed: Mutex<HashMap<String, Installed>>,
    fail_apply: Mutex<HashSet<String>>,
    fail_remove: Mutex<HashSet<String>>,
    permanent: Mutex<bool>,
    /// Enforce this much less than asked, to provoke a read-back mismatch.
    shortfall: Mutex<Option<Quantity>>,
    removes: Mutex<Vec<String>>,
    /// What the fake needs of the pod (default: nothing).
    needs: Mutex<Option<Needs>>,
    /// A pod cgroup the next read-back removes first, with the share's limit: a sandbox
    /// that goes while the reconciler reads it back.
    vanish_on_verify: Mutex<Option<std::path::PathBuf>>,
    /// The next read-back says it began, then waits until told to go on: a driver that
    /// answers slowly.
    hold_verify: Mutex<Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>>,
    /// What a read-back of a share with no limit says (default: "no limit installed").
    verify_error: Mutex<Option<String>>,
}

struct FakeLimiter(Arc<FakeKernel>);

impl Limiter for FakeLimiter {
    fn mechanisms(&self) -> Vec<String> {
        vec!["fake".into()]
    }
    fn accounting_only(&self) -> bool {
        false
    }
    fn device_facts(&self, _device: &str) -> shareguard_common::limiter::DeviceFacts {
        shareguard_common::limiter::DeviceFacts {
            mechanism: "fake".into(),
            enforces: false,
            attributes: Default::default(),
            int_attributes: Default::default(),
            fault: None,
        }
    }
    fn needs(&self, _device: &str) -> Needs {
        lock(&self.0.needs).unwrap_or(Needs::Nothing)
    }
    fn apply(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let k = &self.0;
        if lock(&k.fail_apply).contains(&spec.share_key) {
            // Half of it got in before the failure, as a qdisc before its queue device would.
            lock(&k.installed).insert(
                spec.share_key.clone(),
                (BTreeMap::new(), spec.target.clone()),
            );
            return Err(if *lock(&k.permanent) {
                LimiterError::permanent("interface does not exist")
            } else {
                LimiterError::retryable("netlink busy")
            });
        }
        let mut limits = spec.limits.clone();
        if let Some(s) = *lock(&k.shortfall) {
            for v in limits.values_mut() {
                *v = v.checked_sub(&s).unwrap();
            }
        }
        lock(&k.installed).insert(spec.share_key.clone(), (limits, spec.target.clone()));
        self.verify(spec)
    }
    fn verify(&self, spec: &LimitSpec) -> Result<Enforcement, LimiterError> {
        let held = lock(&self.0.hold_verify).take();
        if let Some((began, go_on)) = held {
            let _ = began.send(());
            let _ = go_on.recv();
        }
        if let Some(cgroup) = lock(&self.0.vanish_on_verify).take() {
            std::fs::remove_dir(&cgroup).unwrap();
            lock(&self.0.installed).remove(&spec.share_key);
        }
        match lock(&self.0.installed).get(&spec.share_key) {
            Some((l, _)) => Ok(Enforcement {
                mechanism: "fake".into(),
                enforced: l.clone(),
                ..Enforcement::default()
            }),
            None => Err(LimiterError::retryable(
                lock(&self.0.verify_error)
                    .clone()
                    .unwrap_or_else(|| "no limit installed".to_owned()),
            )),
        }
    }
    fn remove(&self, key: &str) -> Result<(), LimiterError> {
        if lock(&self.0.fail_remove).contains(key) {
            return Err(LimiterError::retryable("qdisc busy"));
        }
        lock(&self.0.removes).push(key.to_owned());
        lock(&self.0.installed).remove(key);
        Ok(())
    }
}

fn open(cfg: &Arc<Config>, kernel: Option<&Arc<FakeKernel>>, boot: &str) -> Engine {
    let mut cfg_mut = (**cfg).clone();
    // The test configs fit their devices; a refusal is a broken test.
    let mut limiters = crate::limiters::for_config(&mut cfg_mut)
        .expect("limiters for the test config")
        .by_device;
    if let Some(k) = kernel {
        for d in &cfg.devices {
            limiters.insert(
                d.name.clone(),
                Arc::new(FakeLimiter(k.clone())) as Arc<dyn Limiter>,
            );
        }
    }
    Engine::open(cfg.clone(), limiters, boot, Arc::new(Metrics::new()))
        .unwrap_or_else(|e| panic!("opening the engine: {e}"))
}

const POD: &str = "0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88";

fn share(n: u32) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn alloc(device: &str, id: &str, mem: &str) -> request::DeviceAllocation {
    request::DeviceAllocation {
        request: "r".into(),
        driver: DRIVER.into(),
        pool: "p".into(),
        device: device.into(),
        share_id: id.into(),
        consumed_capacity: [("memory".to_owned(), mem.to_owned())].into(),
        ..Default::default()
    }
}

fn claim(
    uid: &str,
    alloc_id: &str,
    allocs: Vec<request::DeviceAllocation>,
) -> request::ClaimPrepare {
    request::ClaimPrepare {
        claim: Some(request::ClaimRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
        }),
        allocation_id: alloc_id.into(),
        target: Some(request::PodTarget {
            pod_uids: vec![POD.into()],
            ..Default::default()
        }),
        allocations: allocs,
        pre_bind: false,
    }
}

/// An agent (boot "boot-a") that enforced shares 1 to 3, one claim each, then stopped.
fn enforce_three(cfg: &Arc<Config>, k: &Arc<FakeKernel>, rt: &tokio::runtime::Runtime) {
    let e = open(cfg, Some(k), "boot-a");
    for n in 1..=3 {
        let c = claim(
            &format!("c{n}"),
            "a1",
            vec![alloc("gen-0", &share(n), "1Gi")],
        );
        assert_eq!(rt.block_on(e.prepare(0, &[c], 0)).unwrap()[0].error, None);
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn allocated(e: &Engine, device: &str) -> Quantity {
    e.devices()
        .into_iter()
        .find(|d| d.config.name == device)
        .unwrap()
        .usage
        .allocated["memory"]
}

fn q(s: &str) -> Quantity {
    Quantity::parse(s).unwrap()
}

#[test]
fn enforced_only_after_matching_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    let out = rt
        .block_on(e.prepare(
            0,
            &[claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")])],
            0,
        ))
        .unwrap();
    assert_eq!(out[0].error, None);
    assert_eq!(out[0].shares[0].phase, Phase::Enforced);
    assert_eq!(out[0].shares[0].enforced.get("memory"), Some(&q("2Gi")));

    *lock(&k.shortfall) = Some(q("1Mi"));
    let out = rt
        .block_on(e.prepare(
            0,
            &[claim("c2", "a1", vec![alloc("gen-0", &share(2), "2Gi")])],
            0,
        ))
        .unwrap();
    let s = &out[0].shares[0];
    assert_eq!(
        s.phase,
        Phase::Degraded,
        "a mismatching read-back must not be ENFORCED"
    );
    assert!(s.reason.contains("read back"), "{}", s.reason);
    // DEGRADED still holds its capacity: nothing is freed implicitly.
    assert_eq!(allocated(&e, "gen-0"), q("4Gi"));
}

#[test]
fn enforcement_failure_rolls_the_whole_claim_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    lock(&k.fail_apply).insert(share(2));
    let c = claim(
        "c1",
        "a1",
        vec![
            alloc("gen-0", &share(1), "2Gi"),
            alloc("gen-1", &share(2), "3Gi"),
        ],
    );
    let out = rt
        .block_on(e.prepare(0, std::slice::from_ref(&c), 0))
        .unwrap();
    let err = out[0].error.clone().unwrap();
    assert_eq!(err.code, Code::Unavailable);
    assert!(err.retryable);
    assert_eq!(err.field, "claims[0].allocations[1]");
    assert!(out[0].shares.iter().all(|s| s.phase == Phase::Failed));
    assert_eq!(allocated(&e, "gen-0"), Quantity::ZERO);
    assert_eq!(allocated(&e, "gen-1"), Quantity::ZERO);
    assert_eq!(
        *lock(&k.removes),
        vec![share(1), share(2)],
        "the applied share is removed, and so is the half of the failed one"
    );
    assert!(lock(&k.installed).is_empty(), "{:?}", lock(&k.installed));

    // Permanent failures say so.
    *lock(&k.permanent) = true;
    let out = rt
        .block_on(e.prepare(0, std::slice::from_ref(&c), 0))
        .unwrap();
    let err = out[0].error.clone().unwrap();
    assert_eq!(err.code, Code::FailedPrecondition);
    assert!(!err.retryable);

    // Once the cause is gone, the same claim is admitted (FAILED holds nothing).
    lock(&k.fail_apply).clear();
    let out = rt.block_on(e.prepare(0, &[c], 0)).unwrap();
    assert_eq!(out[0].error, None);
    assert_eq!(allocated(&e, "gen-1"), q("3Gi"));
}

/// A roll-back whose removal fails leaks nothing: the share stays RELEASING with its
/// capacity held (also across a restart), a repeated Prepare waits for it, and the
/// reconciler removes what was left and only then frees the capacity.
#[test]
fn a_roll_back_whose_removal_fails_is_finished_by_the_reconciler() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    lock(&k.fail_apply).insert(share(2));
    lock(&k.fail_remove).insert(share(2));
    let c = claim(
        "c1",
        "a1",
        vec![
            alloc("gen-0", &share(1), "2Gi"),
            alloc("gen-1", &share(2), "3Gi"),
        ],
    );
    let out = rt
        .block_on(e.prepare(0, std::slice::from_ref(&c), 0))
        .unwrap();
    assert_eq!(
        out[0].error.as_ref().map(|e| e.code),
        Some(Code::Unavailable)
    );
    let phases: Vec<Phase> = out[0].shares.iter().map(|s| s.phase).collect();
    assert_eq!(phases, vec![Phase::Failed, Phase::Releasing]);
    assert!(
        out[0].shares[1]
            .reason
            .contains("removing what was installed failed"),
        "{}",
        out[0].shares[1].reason
    );
    assert!(
        lock(&k.installed).contains_key(&share(2)),
        "half of it is still in"
    );
    assert_eq!(allocated(&e, "gen-0"), Quantity::ZERO);
    assert_eq!(
        allocated(&e, "gen-1"),
        q("3Gi"),
        "held while something is installed"
    );

    // Held across a restart; a repeated Prepare is told to wait, retryably.
    drop(e);
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(allocated(&e, "gen-1"), q("3Gi"));
    let out = rt
        .block_on(e.prepare(0, std::slice::from_ref(&c), 0))
        .unwrap();
    let err = out[0].error.clone().unwrap();
    assert_eq!(
        (err.code, err.retryable),
        (Code::Unavailable, true),
        "{err:?}"
    );
    assert!(err.message.contains("still being rolled back"), "{err:?}");

    // The reconciler retries: still failing, nothing changes; then it goes through.
    rt.block_on(e.reconcile());
    assert_eq!(e.get_share(&share(2)).unwrap().phase, Phase::Releasing);
    lock(&k.fail_remove).clear();
    rt.block_on(e.reconcile());
    let r = e.get_share(&share(2)).unwrap();
    assert_eq!((r.phase, r.rolling_back), (Phase::Failed, false), "{r:?}");
    assert!(r.reason.contains("capacity freed"), "{}", r.reason);
    assert!(lock(&k.installed).is_empty(), "{:?}", lock(&k.installed));
    assert_eq!(allocated(&e, "gen-1"), Quantity::ZERO);
    let audit = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    assert_eq!(
        audit
            .lines()
            .filter(|l| l.contains("\"decision\":\"release\"") && l.contains(&share(2)))
            .count(),
        1,
        "{audit}"
    );

    // The cause gone, the claim is admitted as if it were new.
    lock(&k.fail_apply).clear();
    let out = rt.block_on(e.prepare(0, &[c], 0)).unwrap();
    assert_eq!(out[0].error, None);
    assert_eq!(allocated(&e, "gen-1"), q("3Gi"));
}

/// Reopening a failed store re-verifies every share, which may take long with a slow
/// driver or many shares: meanwhile the engine answers reads, health and devices from the
/// state as it was, and refuses changes as retryable; nothing waits on the reload.
#[test]
fn a_store_reopen_holds_no_lock_across_the_read_back() {
    use std::sync::mpsc;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = Arc::new(open(&cfg, Some(&k), "boot-a"));
    let rt = rt();
    let c = claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")]);
    let out = rt.block_on(e.prepare(0, &[c], 0)).unwrap();
    assert_eq!(out[0].shares[0].phase, Phase::Enforced);

    lock(&e.store).as_ref().unwrap().fail_for_test("disk full");
    assert!(e.store_problem().is_some());
    let (began_tx, began) = mpsc::channel();
    let (go_on, go_on_rx) = mpsc::channel();
    *lock(&k.hold_verify) = Some((began_tx, go_on_rx));
    let reopening = {
        let e = e.clone();
        std::thread::spawn(move || e.reopen_store())
    };
    began
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the reload reads the share back");

    // While the read-back hangs: reads answer, on another thread, within the deadline.
    let (tx, answers) = mpsc::channel();
    {
        let e = e.clone();
        std::thread::spawn(move || {
            let share = e.get_share(&share(1)).map(|r| r.phase);
            let problem = e.store_problem();
            let devices = e.devices().len();
            let _ = tx.send((share, problem, devices));
        });
    }
    let (share_phase, problem, devices) = answers
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("a read waited on the store's reload");
    assert_eq!(share_phase, Some(Phase::Enforced));
    assert_eq!(devices, 2);
    assert!(problem.is_some_and(|p| p.contains("being reopened")));
    let c2 = claim("c2", "a1", vec![alloc("gen-0", &share(2), "1Gi")]);
    let out = rt.block_on(e.prepare(0, &[c2], 0)).unwrap();
    let err = out[0]
        .error
        .clone()
        .expect("a change was accepted mid-reload");
    assert_eq!(
        (err.code, err.retryable),
        (Code::Unavailable, true),
        "{err:?}"
    );

    go_on.send(()).unwrap();
    assert!(matches!(reopening.join().unwrap(), Ok(true)));
    assert_eq!(e.store_problem(), None);
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Enforced);
    assert_eq!(allocated(&e, "gen-0"), q("2Gi"));
}

/// A start writes what it re-verified straight to the store, past `commit_locked`: the
/// reason it found (here a driver's long error) still keeps the record's bound.
#[test]
fn a_reason_found_at_start_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    lock(&k.installed).remove(&share(2));
    *lock(&k.verify_error) = Some("x".repeat(3 * crate::record::MAX_TEXT_BYTES));
    let e = open(&cfg, Some(&k), "boot-a");
    let r = e.get_share(&share(2)).unwrap();
    assert_eq!(r.phase, Phase::Unknown);
    assert!(
        r.reason.len() <= crate::record::MAX_TEXT_BYTES && r.reason.ends_with("..."),
        "{} bytes",
        r.reason.len()
    );
    drop(e);
    // Read back from the store as written.
    let e = open(&cfg, Some(&k), "boot-a");
    assert!(e.get_share(&share(2)).unwrap().reason.len() <= crate::record::MAX_TEXT_BYTES);
}

#[test]
fn restart_reverifies_and_never_frees() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    // Same boot: the "kernel" kept share 1, lost share 2, and share 3 drifted.
    lock(&k.installed).remove(&share(2));
    lock(&k.installed)
        .get_mut(&share(3))
        .unwrap()
        .0
        .insert("memory".into(), q("512Mi"));
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Enforced);
    assert_eq!(e.get_share(&share(2)).unwrap().phase, Phase::Unknown);
    assert_eq!(e.get_share(&share(3)).unwrap().phase, Phase::Degraded);
    assert_eq!(allocated(&e, "gen-0"), q("3Gi"));
    drop(e);

    // After a reboot nothing can be trusted: every share waits for its pod again, its
    // stale state cleared, and its capacity stays reserved.
    lock(&k.removes).clear();
    let e = open(&cfg, Some(&k), "boot-b");
    for n in 1..=3 {
        let r = e.get_share(&share(n)).unwrap();
        assert_eq!(r.phase, Phase::Pending);
        assert!(r.reason.contains("rebooted"), "{}", r.reason);
    }
    assert_eq!(lock(&k.removes).len(), 3, "pre-reboot state is cleared");
    assert_eq!(allocated(&e, "gen-0"), q("3Gi"));

    // The discovery loop enforces them again without any call.
    let s = rt.block_on(e.discover());
    assert_eq!(s.changed, 3, "{s:?}");
    assert_eq!(e.get_share(&share(2)).unwrap().phase, Phase::Enforced);
    // A repeated Prepare changes nothing and never counts twice.
    let out = rt
        .block_on(e.prepare(
            0,
            &[claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")])],
            0,
        ))
        .unwrap();
    assert_eq!(out[0].shares[0].phase, Phase::Enforced);
    assert_eq!(
        allocated(&e, "gen-0"),
        q("3Gi"),
        "a repeat never counts twice"
    );
}

/// The store keeps no index record for a claim without CDI ids: a restarted agent knows
/// each claim from its shares, under its newest allocation, with every share of it,
/// the released ones of an earlier allocation too.
#[test]
fn a_claims_index_is_rebuilt_from_its_shares_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    let refs = vec![request::ClaimRef {
        uid: "m".into(),
        ..Default::default()
    }];
    let first = claim(
        "m",
        "a1",
        vec![
            alloc("gen-0", &share(1), "1Gi"),
            alloc("gen-1", &share(2), "1Gi"),
        ],
    );
    let second = claim(
        "m",
        "a2",
        vec![
            alloc("gen-0", &share(3), "2Gi"),
            alloc("gen-1", &share(4), "2Gi"),
        ],
    );
    {
        let e = open(&cfg, Some(&k), "boot-a");
        assert_eq!(
            rt.block_on(e.prepare(0, std::slice::from_ref(&first), 0))
                .unwrap()[0]
                .error,
            None
        );
        let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
        assert_eq!(out[0].1, None);
        assert_eq!(
            rt.block_on(e.prepare(0, std::slice::from_ref(&second), 0))
                .unwrap()[0]
                .error,
            None
        );
    }
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(allocated(&e, "gen-0"), q("2Gi"));
    // Prepared under a2: a repeat is answered as stored, a1 is refused.
    let out = rt.block_on(e.prepare(0, &[second], 0)).unwrap();
    assert_eq!(out[0].error, None);
    assert_eq!(out[0].shares.len(), 2);
    assert_eq!(
        allocated(&e, "gen-0"),
        q("2Gi"),
        "a repeat never counts twice"
    );
    let out = rt.block_on(e.prepare(0, &[first], 0)).unwrap();
    let err = out[0]
        .error
        .clone()
        .expect("another allocation of a prepared claim");
    assert_eq!(err.code, Code::FailedPrecondition, "{err:?}");
    // Its Unprepare finds both shares of a2.
    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
    assert_eq!(out[0].1, None);
    for n in 1..=4 {
        assert_eq!(
            e.get_share(&share(n)).unwrap().phase,
            Phase::Released,
            "share {n}"
        );
    }
    assert_eq!(allocated(&e, "gen-0"), Quantity::ZERO);
    assert_eq!(allocated(&e, "gen-1"), Quantity::ZERO);
    assert_eq!(
        lock(&e.state).claims.get("m").unwrap().share_keys.len(),
        4,
        "every share of the claim, the earlier allocation's tombstones too"
    );
}

/// The binding gate's admission holds capacity like any Prepare and marks the share
/// `pre_bind`; kubelet's Prepare of the same allocation clears the mark (durably), and a
/// late gate repeat does not put it back.
#[test]
fn kubelets_prepare_clears_the_gates_pre_bind_mark() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    let gate = |pre_bind| {
        let mut c = claim("c1", "a1", vec![alloc("gen-0", &share(1), "2Gi")]);
        c.pre_bind = pre_bind;
        c
    };
    let e = open(&cfg, Some(&k), "boot-a");
    let out = rt.block_on(e.prepare(0, &[gate(true)], 0)).unwrap();
    assert_eq!(out[0].error, None);
    assert!(e.get_share(&share(1)).unwrap().pre_bind);
    assert_eq!(allocated(&e, "gen-0"), q("2Gi"));
    // The gate again (a second watch event): still the gate's, counted once.
    rt.block_on(e.prepare(0, &[gate(true)], 0)).unwrap();
    assert!(e.get_share(&share(1)).unwrap().pre_bind);
    assert_eq!(allocated(&e, "gen-0"), q("2Gi"));

    let out = rt.block_on(e.prepare(0, &[gate(false)], 0)).unwrap();
    assert_eq!(out[0].error, None);
    assert!(!e.get_share(&share(1)).unwrap().pre_bind);
    assert_eq!(
        allocated(&e, "gen-0"),
        q("2Gi"),
        "kubelet's Prepare counts nothing again"
    );
    rt.block_on(e.prepare(0, &[gate(true)], 0)).unwrap();
    assert!(
        !e.get_share(&share(1)).unwrap().pre_bind,
        "once kubelet prepared it, only kubelet's Unprepare may release it"
    );
    drop(e);
    let e = open(&cfg, Some(&k), "boot-a");
    assert!(
        !e.get_share(&share(1)).unwrap().pre_bind,
        "the clearing was durable"
    );
}

/// The gate's sweep releases with `only_pre_bind`: a claim still the gate's goes; one
/// kubelet prepared meanwhile is refused with FailedPrecondition and keeps its capacity,
/// and kubelet's own Unprepare still releases it.
#[test]
fn a_release_only_while_pre_bind_leaves_what_kubelet_prepared() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    let gate = |uid: &str, n| {
        let mut c = claim(uid, "a1", vec![alloc("gen-0", &share(n), "2Gi")]);
        c.pre_bind = true;
        c
    };
    let refs = |uid: &str| {
        vec![request::ClaimRef {
            uid: uid.into(),
            ..Default::default()
        }]
    };
    let e = open(&cfg, Some(&k), "boot-a");
    rt.block_on(e.prepare(0, &[gate("c1", 1), gate("c2", 2)], 0))
        .unwrap();
    assert_eq!(allocated(&e, "gen-0"), q("4Gi"));

    let out = rt.block_on(e.unprepare(0, &refs("c1"), 0, true)).unwrap();
    assert_eq!(out[0].1, None, "still the gate's: released");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Released);

    let mut kubelet = gate("c2", 2);
    kubelet.pre_bind = false;
    rt.block_on(e.prepare(0, &[kubelet], 0)).unwrap();
    let out = rt.block_on(e.unprepare(0, &refs("c2"), 0, true)).unwrap();
    let err = out[0].1.clone().expect("refused once kubelet prepared it");
    assert_eq!(err.code, crate::error::Code::FailedPrecondition, "{err:?}");
    assert_ne!(e.get_share(&share(2)).unwrap().phase, Phase::Released);
    assert_eq!(allocated(&e, "gen-0"), q("2Gi"), "its capacity stays held");

    let out = rt.block_on(e.unprepare(0, &refs("c2"), 0, false)).unwrap();
    assert_eq!(out[0].1, None, "kubelet's Unprepare releases it");
    assert_eq!(allocated(&e, "gen-0"), Quantity::ZERO);
}

/// The pod's cgroup in the test's cgroup tree (cgroupfs layout, burstable).
fn pod_dir(dir: &std::path::Path) -> std::path::PathBuf {
    dir.join("cgroup/kubepods/burstable")
        .join(format!("pod{POD}"))
}

/// An engine whose fake limiter needs the pod's cgroup, and the answer to a Prepare of
/// one claim with `share(1)` on `gen-0`.
fn prepared_for_a_pod(
    dir: &std::path::Path,
    rt: &tokio::runtime::Runtime,
) -> (
    Arc<Config>,
    Arc<FakeKernel>,
    Engine,
    Vec<super::PrepareOutcome>,
) {
    std::fs::create_dir_all(dir.join("cgroup/kubepods/burstable")).unwrap();
    let cfg = config(dir, "1h");
    let k = Arc::new(FakeKernel::default());
    *lock(&k.needs) = Some(Needs::Cgroup);
    let e = open(&cfg, Some(&k), "boot-a");
    let c = claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")]);
    let out = rt
        .block_on(e.prepare(0, std::slice::from_ref(&c), 0))
        .unwrap();
    (cfg, k, e, out)
}

#[test]
fn a_share_follows_its_pods_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    // Prepared before the pod's sandbox exists: admitted, waiting, capacity held.
    let (cfg, k, e, out) = prepared_for_a_pod(dir.path(), &rt);
    assert_eq!(out[0].error, None);
    assert_eq!(out[0].shares[0].phase, Phase::Pending);
    assert!(
        out[0].shares[0].reason.contains(POD),
        "{}",
        out[0].shares[0].reason
    );
    assert!(lock(&k.installed).is_empty(), "nothing to act on yet");
    assert_eq!(allocated(&e, "gen-0"), q("1Gi"));

    // The sandbox appears: enforced on the pod's cgroup, no call needed.
    std::fs::create_dir_all(pod_dir(dir.path())).unwrap();
    assert_eq!(rt.block_on(e.discover()).changed, 1);
    let r = e.get_share(&share(1)).unwrap();
    assert_eq!(r.phase, Phase::Enforced, "{}", r.reason);
    assert_eq!(
        lock(&k.installed)[&share(1)].1.cgroups,
        vec![pod_dir(dir.path())]
    );
    assert_eq!(
        r.sandbox.as_ref().unwrap().cgroup,
        format!("/kubepods/burstable/pod{POD}")
    );
    assert_eq!(rt.block_on(e.discover()).changed, 0, "settled");

    // It goes away before Unprepare: waiting again, its limit removed, capacity held.
    std::fs::remove_dir(pod_dir(dir.path())).unwrap();
    assert_eq!(rt.block_on(e.discover()).changed, 1);
    let r = e.get_share(&share(1)).unwrap();
    assert_eq!(r.phase, Phase::Pending, "{}", r.reason);
    assert!(r.sandbox.is_none());
    assert!(!lock(&k.installed).contains_key(&share(1)));
    assert_eq!(allocated(&e, "gen-0"), q("1Gi"));

    // It comes back (a new cgroup): enforced again.
    std::fs::create_dir_all(pod_dir(dir.path())).unwrap();
    assert_eq!(rt.block_on(e.discover()).changed, 1);
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Enforced);
    // A restart re-verifies it, and the next pass keeps it.
    drop(e);
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Enforced);
    assert_eq!(rt.block_on(e.discover()).changed, 0);
    let audit = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    assert_eq!(
        audit.lines().filter(|l| l.contains("\"sandbox\"")).count(),
        3,
        "every transition is audited:\n{audit}"
    );
}

/// The `Enforced` condition's `lastTransitionTime` (the claim's status shows it) moves
/// when its status flips between True and False, not when only the phase, the reason or
/// the message changes under the same status.
#[test]
fn the_conditions_transition_time_moves_only_when_its_status_flips() {
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    let tick = || std::thread::sleep(std::time::Duration::from_millis(5));
    let since = |e: &Engine| {
        let r = e.get_share(&share(1)).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&crate::api::device_status::render(&r, &[], None)).unwrap();
        let shown = v["conditions"][0]["lastTransitionTime"]
            .as_str()
            .unwrap()
            .to_owned();
        (r, shown)
    };
    let (_cfg, _k, e, _out) = prepared_for_a_pod(dir.path(), &rt);
    let (admitted, _) = since(&e);
    assert_eq!(admitted.phase, Phase::Pending);
    assert_eq!(
        admitted.condition_since_ms, admitted.created_at_ms,
        "False from admission on, PREPARING and PENDING alike"
    );

    // False -> True: the sandbox appears and the limit is read back.
    tick();
    std::fs::create_dir_all(pod_dir(dir.path())).unwrap();
    rt.block_on(e.discover());
    let (enforced, _) = since(&e);
    assert_eq!(enforced.phase, Phase::Enforced);
    assert_eq!(enforced.condition_since_ms, enforced.updated_at_ms);
    assert!(enforced.condition_since_ms > admitted.condition_since_ms);

    // True -> False: the sandbox goes.
    tick();
    std::fs::remove_dir(pod_dir(dir.path())).unwrap();
    rt.block_on(e.discover());
    let (waiting, _) = since(&e);
    assert_eq!(waiting.phase, Phase::Pending);
    assert_eq!(waiting.condition_since_ms, waiting.updated_at_ms);
    assert!(waiting.condition_since_ms > enforced.condition_since_ms);

    // False -> False with another phase and reason: Unprepare. Seconds apart (the
    // condition's time has second resolution), so a moved time would show.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let refs = [request::ClaimRef {
        uid: "c1".into(),
        ..Default::default()
    }];
    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
    assert!(out[0].1.is_none(), "{out:?}");
    let (released, shown) = since(&e);
    assert_eq!(released.phase, Phase::Released);
    assert_ne!(released.reason, waiting.reason);
    assert!(released.updated_at_ms >= waiting.updated_at_ms + 1000);
    assert_eq!(released.condition_since_ms, waiting.condition_since_ms);
    assert_eq!(
        shown,
        humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(waiting.condition_since_ms)
        )
        .to_string()
    );
}

/// A sandbox that goes between the reconciler's look at it and its read-back (a CNI
/// deleting the interface to set the pod's network up again) is the pod moving, not
/// drift: the share waits for its pod, and no drift is counted or repaired.
#[test]
fn a_sandbox_gone_during_a_read_back_is_not_drift() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(pod_dir(dir.path())).unwrap();
    let rt = rt();
    let (_cfg, k, e, out) = prepared_for_a_pod(dir.path(), &rt);
    assert_eq!(out[0].shares[0].phase, Phase::Enforced);

    *lock(&k.vanish_on_verify) = Some(pod_dir(dir.path()));
    let stats = rt.block_on(e.reconcile());
    assert!(lock(&k.vanish_on_verify).is_none(), "the read-back ran");
    assert_eq!((stats.drifted, stats.repaired), (0, 0), "{stats:?}");
    let r = e.get_share(&share(1)).unwrap();
    assert_eq!(r.phase, Phase::Pending, "{}", r.reason);
    assert!(r.reason.contains(POD), "{}", r.reason);
    assert!(r.sandbox.is_none());
    assert_eq!(allocated(&e, "gen-0"), q("1Gi"), "capacity held");
}

#[test]
fn failed_removal_keeps_capacity_until_a_retry_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    rt.block_on(e.prepare(
        0,
        &[claim("c1", "a1", vec![alloc("gen-0", &share(1), "4Gi")])],
        0,
    ))
    .unwrap();
    lock(&k.fail_remove).insert(share(1));
    let refs = [request::ClaimRef {
        uid: "c1".into(),
        ..Default::default()
    }];
    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
    let err = out[0].1.clone().unwrap();
    assert!(err.retryable);
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Releasing);
    assert_eq!(allocated(&e, "gen-0"), q("4Gi"));
    // The failed release is a decision in the audit log, with why.
    let audit = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    let failed: Vec<serde_json::Value> = audit
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|l: &serde_json::Value| l["decision"] == "fail")
        .collect();
    assert_eq!(failed.len(), 1, "{audit}");
    assert!(
        failed[0]["reason"]
            .as_str()
            .unwrap()
            .contains("release incomplete"),
        "{audit}"
    );
    drop(e);
    // RELEASING survives a restart as it is.
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Releasing);
    lock(&k.fail_remove).clear();
    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
    assert_eq!(out[0].1, None);
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Released);
    assert_eq!(allocated(&e, "gen-0"), Quantity::ZERO);
}

#[test]
fn tombstones_expire_after_retention_only() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "10s");
    let e = open(&cfg, None, "boot-a");
    let rt = rt();
    rt.block_on(e.prepare(
        0,
        &[claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")])],
        0,
    ))
    .unwrap();
    rt.block_on(e.prepare(
        0,
        &[claim("c2", "a1", vec![alloc("gen-0", &share(2), "1Gi")])],
        0,
    ))
    .unwrap();
    rt.block_on(e.unprepare(
        0,
        &[request::ClaimRef {
            uid: "c1".into(),
            ..Default::default()
        }],
        0,
        false,
    ))
    .unwrap();
    let released = e
        .get_share(&share(1))
        .unwrap()
        .released_at_ms
        .unwrap()
        .get();
    assert_eq!(
        rt.block_on(e.sweep_tombstones(released + 9_999)).unwrap(),
        0
    );
    assert_eq!(
        rt.block_on(e.sweep_tombstones(released + 10_000)).unwrap(),
        1
    );
    assert!(e.get_share(&share(1)).is_none());
    assert!(
        e.get_share(&share(2)).is_some(),
        "live shares are never swept"
    );
    drop(e);
    let e = open(&cfg, None, "boot-a");
    assert!(e.get_share(&share(1)).is_none(), "the sweep is durable");
    assert!(
        !lock(&e.state).claims.contains_key("c1"),
        "the claim index is swept too"
    );
}

/// One step of the model test.
#[derive(Clone, Debug)]
enum Op {
    /// Prepare claim `c` on device `d` for `gib` GiB (a new allocation if `c` is released).
    Prepare {
        c: u8,
        d: u8,
        gib: u8,
    },
    /// Repeat the last Prepare of claim `c` exactly.
    Repeat {
        c: u8,
    },
    Unprepare {
        c: u8,
    },
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..6, 0u8..2, 1u8..5).prop_map(|(c, d, gib)| Op::Prepare { c, d, gib }),
        2 => (0u8..6).prop_map(|c| Op::Repeat { c }),
        2 => (0u8..6).prop_map(|c| Op::Unprepare { c }),
        1 => Just(Op::Restart),
    ]
}

/// The plain model: which claims hold what, and the capacity rule.
#[derive(Default, Debug)]
struct Model {
    live: BTreeMap<u8, (u8, u8)>,
    /// Last request per claim, and a generation so a new allocation gets a new shareID.
    last: BTreeMap<u8, (request::ClaimPrepare, u32)>,
}

impl Model {
    fn used(&self, d: u8) -> u32 {
        self.live
            .values()
            .filter(|(dd, _)| *dd == d)
            .map(|(_, g)| u32::from(*g))
            .sum()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Random interleavings of prepare, repeated prepare, unprepare, repeated unprepare
    /// and restart: the engine's ledger always equals the model and never exceeds 10Gi.
    #[test]
    fn ledger_matches_model(ops in prop::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path(), "1h");
        let rt = rt();
        let mut e = open(&cfg, None, "boot");
        let mut m = Model::default();
        let mut generation = 0u32;
        for op in ops {
            match op {
                Op::Prepare { c, d, gib } => {
                    if m.live.contains_key(&c) {
                        continue; // covered by Repeat; a new allocation of a live claim is refused elsewhere
                    }
                    generation += 1;
                    let dev = format!("gen-{d}");
                    let req = claim(&format!("c{c}"), &format!("a{generation}"),
                        vec![alloc(&dev, &share(generation), &format!("{gib}Gi"))]);
                    let out = rt.block_on(e.prepare(0, std::slice::from_ref(&req), 0)).unwrap();
                    let fits = m.used(d) + u32::from(gib) <= 10;
                    prop_assert_eq!(out[0].error.is_none(), fits, "{:?}", out[0].error);
                    if fits {
                        m.live.insert(c, (d, gib));
                        m.last.insert(c, (req, generation));
                    } else {
                        prop_assert_eq!(out[0].error.as_ref().unwrap().code, Code::ResourceExhausted);
                    }
                }
                Op::Repeat { c } => {
                    let Some((req, _)) = m.last.get(&c).cloned() else { continue };
                    let out = rt.block_on(e.prepare(0, &[req], 0)).unwrap();
                    if m.live.contains_key(&c) {
                        prop_assert!(out[0].error.is_none(), "{:?}", out[0].error);
                    } else {
                        // A released claim prepared again is a fresh admission.
                        let (d, gib) = {
                            let r = &m.last[&c].0.allocations[0];
                            let d: u8 = r.device.trim_start_matches("gen-").parse().unwrap();
                            let g: u8 = r.consumed_capacity["memory"].trim_end_matches("Gi").parse().unwrap();
                            (d, g)
                        };
                        let fits = m.used(d) + u32::from(gib) <= 10;
                        prop_assert_eq!(out[0].error.is_none(), fits);
                        if fits { m.live.insert(c, (d, gib)); }
                    }
                }
                Op::Unprepare { c } => {
                    let refs = [request::ClaimRef { uid: format!("c{c}"), ..Default::default() }];
                    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
                    prop_assert_eq!(&out[0].1, &None);
                    m.live.remove(&c);
                }
                Op::Restart => {
                    drop(e);
                    e = open(&cfg, None, "boot");
                }
            }
            prop_assert!(lock(&e.state).sums_consistent(), "kept sums differ from the records");
            for d in 0..2u8 {
                let got = allocated(&e, &format!("gen-{d}"));
                let want = Quantity::parse(&format!("{}Gi", m.used(d))).unwrap();
                prop_assert_eq!(got, want, "device gen-{}", d);
                prop_assert!(got <= q("10Gi"));
            }
            let live: BTreeMap<String, Phase> = e
                .list_shares(&Default::default())
                .into_iter()
                .filter(|r| r.phase.holds_capacity())
                .map(|r| (r.claim.uid.clone(), r.phase))
                .collect();
            let want: Vec<String> = m.live.keys().map(|c| format!("c{c}")).collect();
            prop_assert_eq!(live.keys().cloned().collect::<Vec<_>>(), want);
        }
    }
}

#[test]
fn reconcile_repairs_drift_verifies_unknown_and_never_frees() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    // Share 2 cannot be verified at start (its limit is gone for the moment).
    let kept = lock(&k.installed).remove(&share(2)).unwrap();
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.get_share(&share(2)).unwrap().phase, Phase::Unknown);

    // Share 1 drifts; share 2's limit is back; share 3's limit is gone and cannot be
    // re-applied.
    lock(&k.installed)
        .get_mut(&share(1))
        .unwrap()
        .0
        .insert("memory".into(), q("512Mi"));
    lock(&k.installed).insert(share(2), kept);
    lock(&k.installed).remove(&share(3));
    lock(&k.fail_apply).insert(share(3));

    let stats = rt.block_on(e.reconcile());
    assert_eq!(stats.checked, 3);
    assert_eq!((stats.drifted, stats.repaired), (2, 1), "{stats:?}");
    let r1 = e.get_share(&share(1)).unwrap();
    assert_eq!(r1.phase, Phase::Enforced, "{}", r1.reason);
    assert!(r1.reason.contains("repaired"), "{}", r1.reason);
    assert_eq!(
        lock(&k.installed)[&share(1)].0["memory"],
        q("1Gi"),
        "re-applied"
    );
    let r2 = e.get_share(&share(2)).unwrap();
    assert_eq!(
        r2.phase,
        Phase::Enforced,
        "verified after all: {}",
        r2.reason
    );
    let r3 = e.get_share(&share(3)).unwrap();
    assert_eq!(r3.phase, Phase::Degraded);
    assert!(r3.reason.contains("capacity stays held"), "{}", r3.reason);
    assert_eq!(allocated(&e, "gen-0"), q("3Gi"), "nothing freed");

    // Another pass changes nothing that is settled.
    let stats = rt.block_on(e.reconcile());
    assert_eq!((stats.drifted, stats.repaired), (0, 0), "{stats:?}");
}

/// Unprepares claim `uid`, whose only share is `share(1)`, expecting the removal to
/// fail (the test arranged that): the share stays RELEASING. Returns the request.
fn release_cut_short(
    rt: &tokio::runtime::Runtime,
    e: &Engine,
    uid: &str,
) -> [request::ClaimRef; 1] {
    let refs = [request::ClaimRef {
        uid: uid.into(),
        ..Default::default()
    }];
    let out = rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap();
    assert!(out[0].1.is_some(), "the release was meant to fail: {out:?}");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Releasing);
    refs
}

/// A GPU share whose release was interrupted (RELEASING) is re-learnt by the GPU limiter
/// at start, whose share table lives in memory: the repeated Unprepare then clears the
/// limit in the driver instead of finding nothing to do.
#[test]
fn a_releasing_gpu_share_is_relearnt_at_start_and_its_limit_cleared() {
    use nvml_wrapper::error::NvmlError;
    use shareguard_limiter_gpu::{
        GpuLimiter,
        limiter::{GpuDeviceConfig, GpuSelector},
        simulated::{SimOp, SimulatedBackend, SimulatedGpu},
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(pod_dir(dir.path())).unwrap();
    let text = format!(
        r#"
[agent]
state_dir = {:?}
audit_log = {:?}
cgroup_root = {:?}
cdi_dir = {:?}

[[device]]
name = "gpu-0"
driver = "{DRIVER}"
pool = "p"
kind = "gpu"
backend = "simulated"
uuid = "GPU-shared"
allowed_namespaces = ["*"]
[device.simulated]
memory = "16Gi"
[device.capacity.memory]
"#,
        dir.path().join("state"),
        dir.path().join("audit.jsonl"),
        dir.path().join("cgroup"),
        dir.path().join("cdi"),
    );
    let cfg = Arc::new(Config::parse(&text, "test").unwrap());
    // The simulated driver outlives the agent (as a real one does); each agent life
    // gets a fresh limiter over it, with an empty share table.
    let gpu = Arc::new(SimulatedBackend::new(vec![SimulatedGpu::new(
        "GPU-shared",
        16 << 30,
    )]));
    let life = || {
        let l = GpuLimiter::new(
            gpu.clone(),
            &[GpuDeviceConfig {
                name: "gpu-0".into(),
                gpu: GpuSelector::Uuid("GPU-shared".into()),
                memory_bytes: None,
                driver_root: None,
                container_driver_root: None,
            }],
        )
        .unwrap();
        let limiters: HashMap<String, Arc<dyn Limiter>> =
            HashMap::from([("gpu-0".to_owned(), Arc::new(l) as Arc<dyn Limiter>)]);
        Engine::open(cfg.clone(), limiters, "boot-a", Arc::new(Metrics::new())).unwrap()
    };
    let rt = rt();
    let e = life();
    let mut c = claim("g1", "a1", vec![alloc("gpu-0", &share(1), "2Gi")]);
    c.allocations[0].device = "gpu-0".into();
    let out = rt.block_on(e.prepare(0, &[c], 0)).unwrap();
    assert_eq!(out[0].error, None, "{:?}", out[0]);
    assert_eq!(
        out[0].shares[0].phase,
        Phase::Enforced,
        "{:?}",
        out[0].shares[0]
    );
    assert_eq!(gpu.cgroup_limits().len(), 1);

    // The release is cut short by the driver: RELEASING, limit still in place.
    gpu.inject_fault(SimOp::ClearCgroupLimit, || NvmlError::Unknown, Some(1));
    let refs = release_cut_short(&rt, &e, "g1");
    drop(e);

    let e = life();
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Releasing);
    assert_eq!(
        rt.block_on(e.unprepare(0, &refs, 0, false)).unwrap()[0].1,
        None
    );
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Released);
    assert!(
        gpu.cgroup_limits().is_empty(),
        "the limit is cleared in the driver: {:?}",
        gpu.cgroup_limits()
    );
}

/// Prepares claim `uid` for `share(n)` on gen-0 at `epoch`, on a task of its own.
fn spawn_prepare(
    e: &Arc<Engine>,
    uid: &str,
    n: u32,
    amount: &str,
    epoch: u64,
) -> tokio::task::JoinHandle<Result<Vec<super::PrepareOutcome>, crate::error::RequestError>> {
    let (e, c) = (
        e.clone(),
        claim(uid, "a1", vec![alloc("gen-0", &share(n), amount)]),
    );
    tokio::spawn(async move { e.prepare(epoch, &[c], 0).await })
}

/// Polls `cond` between yields of the current-thread runtime, so that spawned tasks run
/// until they block; fails if it never holds within `tries` yields.
async fn yield_until(what: &str, tries: u32, cond: impl Fn() -> bool) {
    for _ in 0..tries {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{what}: not after {tries} yields");
}

/// I4 where it matters: a request that passed the fence at epoch 2 but reaches its
/// claim's admission after epoch 3 was issued is refused there, not admitted.
#[test]
fn the_fence_is_checked_again_at_admission() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let e = Arc::new(open(&cfg, None, "boot-a"));
    let rt = rt();
    rt.block_on(async {
        assert_eq!(e.new_epoch(None).await.unwrap(), 1);
        assert_eq!(e.new_epoch(None).await.unwrap(), 2);
        // Someone holds claim c1 (a retry of it in flight).
        let held = e.locks.lock("c1").await;
        let late = spawn_prepare(&e, "c1", 1, "1Gi", 2);
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        assert!(!late.is_finished(), "c1's Prepare waits for its lock");
        // A newer control plane takes an epoch while c1's Prepare waits for its lock.
        assert_eq!(e.new_epoch(None).await.unwrap(), 3);
        let c = claim("c2", "a1", vec![alloc("gen-0", &share(2), "1Gi")]);
        assert_eq!(e.prepare(3, &[c], 0).await.unwrap()[0].error, None);
        drop(held);
        let out = late.await.unwrap().unwrap();
        let err = out[0]
            .error
            .clone()
            .expect("a stale admission must be refused");
        assert_eq!(
            (err.code, err.field.as_str()),
            (Code::FailedPrecondition, "epoch")
        );
        assert!(e.get_share(&share(1)).is_none(), "nothing admitted");
    });
}

/// A call at an epoch `NewEpoch` issued but has not yet made durable (a caller that
/// guessed it) is answered only once that epoch is durable.
#[test]
fn a_same_epoch_answer_waits_until_the_epoch_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let e = Arc::new(open(&cfg, None, "boot-a"));
    let rt = rt();
    rt.block_on(async {
        let hold = lock(&e.store).as_ref().unwrap().hold();
        let raiser = {
            let e = e.clone();
            tokio::spawn(async move { e.new_epoch(None).await })
        };
        yield_until("epoch 1 issued", 100_000, || lock(&e.state).epoch == 1).await;
        // Refused by the ledger, so nothing of its own is written.
        let same = spawn_prepare(&e, "c2", 2, "99Gi", 1);
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        assert!(
            !same.is_finished(),
            "answered at epoch 1 while epoch 1 was not durable"
        );
        assert!(!raiser.is_finished(), "NewEpoch answered before durable");
        drop(hold);
        let out = same.await.unwrap().unwrap();
        assert_eq!(out[0].error.as_ref().unwrap().code, Code::ResourceExhausted);
        assert_eq!(raiser.await.unwrap().unwrap(), 1);
    });
}

/// Only `NewEpoch` moves the fence: a Prepare or Unprepare with an epoch that was never
/// issued (2^64-1 would leave no epoch for `NewEpoch` to take) is refused whole, valid
/// claims or not, and the fence stays where it was, across a restart too.
#[test]
fn only_new_epoch_moves_the_fence() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let e = open(&cfg, None, "boot-a");
    let rt = rt();
    let ok = claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")]);
    let release = request::ClaimRef {
        uid: "c1".into(),
        ..Default::default()
    };
    for epoch in [1, 7, u64::MAX] {
        let refused = rt.block_on(e.prepare(epoch, std::slice::from_ref(&ok), 0));
        assert!(
            matches!(
                refused,
                Err(crate::error::RequestError::UnknownEpoch { got, current: 0 }) if got == epoch
            ),
            "{refused:?}"
        );
        let refused = rt.block_on(e.unprepare(epoch, std::slice::from_ref(&release), 0, false));
        assert!(
            matches!(
                refused,
                Err(crate::error::RequestError::UnknownEpoch { .. })
            ),
            "{refused:?}"
        );
    }
    assert_eq!(e.epoch(), 0, "the fence did not move");
    assert!(e.get_share(&share(1)).is_none(), "nothing admitted");
    let mut bad = ok.clone();
    bad.claim.as_mut().unwrap().namespace = "NOT A NAMESPACE".into();
    assert!(rt.block_on(e.prepare(u64::MAX, &[bad], 0)).is_err());
    drop(e);
    let e = open(&cfg, None, "boot-a");
    assert_eq!(e.epoch(), 0, "the fence did not move on disk either");
    assert_eq!(rt.block_on(e.new_epoch(None)).unwrap(), 1);
    assert_eq!(rt.block_on(e.prepare(1, &[ok], 0)).unwrap()[0].error, None);
    assert_eq!(e.epoch(), 1);
}

/// A new control-plane instance's epoch fences every older one at once, is durable
/// before it is returned (a crash right after keeps the fence), and the epoch after it
/// is the next one taken.
#[test]
fn a_new_epoch_fences_older_instances_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let rt = rt();
    let e = open(&cfg, None, "boot-a");
    for want in 1..=3 {
        assert_eq!(rt.block_on(e.new_epoch(None)).unwrap(), want);
    }
    let c1 = claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")]);
    assert_eq!(rt.block_on(e.prepare(3, &[c1], 0)).unwrap()[0].error, None);
    let old = 3;
    let new = rt.block_on(e.new_epoch(None)).unwrap();
    assert_eq!(new, 4);
    let c2 = claim("c2", "a2", vec![alloc("gen-0", &share(2), "1Gi")]);
    let refused = rt.block_on(e.prepare(old, std::slice::from_ref(&c2), 0));
    assert!(
        matches!(
            refused,
            Err(crate::error::RequestError::StaleEpoch { got: 3, current: 4 })
        ),
        "{refused:?}"
    );
    drop(e);
    let e = open(&cfg, None, "boot-a");
    assert_eq!(e.epoch(), 4, "the new epoch was durable");
    assert_eq!(rt.block_on(e.new_epoch(None)).unwrap(), 5);
    assert!(rt.block_on(e.prepare(4, &[c2], 0)).is_err());
}

/// An admission is audited as such only once it is durable: a crash before that loses
/// it, and the audit log must not say otherwise.
#[test]
fn admit_is_audited_only_once_durable() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let e = Arc::new(open(&cfg, None, "boot-a"));
    let audit = || std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap_or_default();
    let rt = rt();
    rt.block_on(async {
        // The epoch is durable already, so only the admission waits below.
        let c0 = claim("c0", "a1", vec![alloc("gen-1", &share(9), "1Gi")]);
        assert_eq!(e.prepare(0, &[c0], 0).await.unwrap()[0].error, None);
        let hold = lock(&e.store).as_ref().unwrap().hold();
        let p = spawn_prepare(&e, "c1", 1, "1Gi", 0);
        yield_until("admitted in memory", 100_000, || {
            e.get_share(&share(1)).is_some()
        })
        .await;
        for _ in 0..1000 {
            tokio::task::yield_now().await;
        }
        let admitted = || {
            audit()
                .lines()
                .any(|l| l.contains("\"admit\"") && l.contains("\"c1\""))
        };
        assert!(!admitted(), "audited before durable:\n{}", audit());
        drop(hold);
        assert_eq!(p.await.unwrap().unwrap()[0].error, None);
        assert!(admitted(), "{}", audit());
    });
}

/// A repeated Prepare of a claim whose release is in progress (RELEASING) is refused:
/// the release must finish (or be repeated) first.
#[test]
fn a_repeated_prepare_of_a_releasing_claim_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let e = open(&cfg, Some(&k), "boot-a");
    let rt = rt();
    let c = claim("c1", "a1", vec![alloc("gen-0", &share(1), "1Gi")]);
    assert_eq!(
        rt.block_on(e.prepare(0, std::slice::from_ref(&c), 0))
            .unwrap()[0]
            .error,
        None
    );
    lock(&k.fail_remove).insert(share(1));
    release_cut_short(&rt, &e, "c1");
    let out = rt.block_on(e.prepare(0, &[c], 0)).unwrap();
    let err = out[0].error.clone().unwrap();
    assert_eq!(err.code, Code::FailedPrecondition, "{err:?}");
    assert!(err.message.contains("being released"), "{err:?}");
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Releasing);
}

#[test]
fn a_read_back_within_one_step_below_the_request_is_the_request_held() {
    let q = |s: &str| Quantity::parse(s).unwrap();
    let wanted: BTreeMap<String, Quantity> = [("bandwidth".to_owned(), q("100000004"))].into();
    let e = |got: &str, step: Option<&str>| Enforcement {
        mechanism: "htb-ebpf".into(),
        enforced: [("bandwidth".to_owned(), q(got))].into(),
        resolution: step
            .map(|s| [("bandwidth".to_owned(), q(s))].into())
            .unwrap_or_default(),
        ..Enforcement::default()
    };
    let (phase, why) = super::judge(&wanted, &e("100M", Some("8")));
    assert_eq!(phase, Phase::Enforced, "{why}");
    assert!(
        why.contains("bandwidth held as 100M, the nearest step of 8"),
        "{why}"
    );
    // Without a stated step the same read-back is drift; a whole step below is drift,
    // and so is anything above the request.
    assert_eq!(super::judge(&wanted, &e("100M", None)).0, Phase::Degraded);
    assert_eq!(
        super::judge(&wanted, &e("99999996", Some("8"))).0,
        Phase::Degraded
    );
    assert_eq!(
        super::judge(&wanted, &e("100000008", Some("8"))).0,
        Phase::Degraded
    );
}

#[test]
fn a_limit_held_per_process_is_enforced_only_while_one_process_holds_it() {
    let q = |s: &str| Quantity::parse(s).unwrap();
    let wanted: BTreeMap<String, Quantity> = [("memory".to_owned(), q("10Gi"))].into();
    let e = |got: &str, processes: u64| Enforcement {
        mechanism: "mps".into(),
        enforced: [("memory".to_owned(), q(got))].into(),
        resolution: [("memory".to_owned(), q("1Mi"))].into(),
        per_process: [(
            "memory".to_owned(),
            shareguard_common::limiter::PerProcess {
                each: q("10Gi"),
                processes,
            },
        )]
        .into(),
        ..Enforcement::default()
    };
    for n in [0, 1] {
        let (phase, why) = super::judge(&wanted, &e("10Gi", n));
        assert_eq!(phase, Phase::Enforced, "{why}");
        assert!(
            why.contains(&format!(
                "memory held per process: each of the share's processes is bound to 10Gi on its own ({n} now)"
            )),
            "{why}"
        );
    }
    // Two processes may hold twice the share: not ENFORCED, and the reason says why.
    let (phase, why) = super::judge(&wanted, &e("20Gi", 2));
    assert_eq!(phase, Phase::Degraded, "{why}");
    assert!(
        why.contains("2 processes of the share, each bound to 10Gi on its own, may hold 20Gi together, more than the share's 10Gi"),
        "{why}"
    );
    // As set, the limit is the share's: the reconciler takes that as no drift.
    assert_eq!(
        super::judge(&wanted, &super::reconcile::as_set(&e("20Gi", 2))).0,
        Phase::Enforced
    );
    // A per-process figure that is not the share's is no such case.
    let mut off = e("20Gi", 2);
    off.per_process.get_mut("memory").unwrap().each = q("20Gi");
    assert_eq!(
        super::judge(&wanted, &super::reconcile::as_set(&off)).0,
        Phase::Degraded
    );
}

#[test]
fn an_unconstrained_capacity_is_enforced_only_at_or_below_its_request() {
    let q = |s: &str| Quantity::parse(s).unwrap();
    let wanted: BTreeMap<String, Quantity> = [("bandwidth".to_owned(), q("40G"))].into();
    let e = |got: &str, free: bool| Enforcement {
        mechanism: "unconstrained".into(),
        enforced: [("bandwidth".to_owned(), q(got))].into(),
        unconstrained: if free {
            ["bandwidth".to_owned()].into()
        } else {
            Default::default()
        },
        ..Enforcement::default()
    };
    let (phase, why) = super::judge(&wanted, &e("25G", true));
    assert_eq!(phase, Phase::Enforced, "{why}");
    assert!(
        why.contains("bandwidth unconstrained: the path carries at most 25G"),
        "{why}"
    );
    // The path's bound read back above the request would be a false statement.
    assert_eq!(super::judge(&wanted, &e("50G", true)).0, Phase::Degraded);
    // Without the flag, a lower read-back is drift as before.
    assert_eq!(super::judge(&wanted, &e("25G", false)).0, Phase::Degraded);
    let (phase, why) = super::judge(&wanted, &e("40G", false));
    assert_eq!(
        (phase, why.as_str()),
        (Phase::Enforced, "limit applied and read back")
    );
}

#[test]
fn a_stage_change_lifts_and_restores_limits_and_keeps_every_share() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.stage("gen-0"), crate::rollout::Stage::Enforce);

    // Rollback: the limits go, every share and its capacity stay.
    let c = rt
        .block_on(e.set_stage("gen-0", crate::rollout::Stage::Observe, Some(0)))
        .unwrap();
    assert_eq!(
        (c.previous, c.stage, c.shares_changed, c.shares_failed),
        (
            crate::rollout::Stage::Enforce,
            crate::rollout::Stage::Observe,
            3,
            0
        )
    );
    for n in 1..=3 {
        let r = e.get_share(&share(n)).unwrap();
        assert_eq!(r.phase, Phase::Observed, "{}", r.reason);
        assert!(r.enforced.is_empty());
        assert!(r.reason.contains("nothing limited"), "{}", r.reason);
    }
    assert!(lock(&k.installed).is_empty(), "no limit left in the kernel");
    assert_eq!(allocated(&e, "gen-0"), q("3Gi"));
    // A new share on the observing device is admitted and counted, not limited.
    let out = rt
        .block_on(e.prepare(
            0,
            &[claim("c4", "a1", vec![alloc("gen-0", &share(4), "1Gi")])],
            0,
        ))
        .unwrap();
    assert_eq!(out[0].shares[0].phase, Phase::Observed);
    assert!(!lock(&k.installed).contains_key(&share(4)));
    // The reconciler keeps them observed, and lifts a limit that came back.
    lock(&k.installed).insert(share(1), (BTreeMap::new(), Target::default()));
    rt.block_on(e.reconcile());
    assert!(!lock(&k.installed).contains_key(&share(1)));
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Observed);

    // The stage survives a restart: the store's, not the config's.
    drop(e);
    let e = open(&cfg, Some(&k), "boot-a");
    assert_eq!(e.stage("gen-0"), crate::rollout::Stage::Observe);
    assert_eq!(e.get_share(&share(2)).unwrap().phase, Phase::Observed);
    assert!(lock(&k.installed).is_empty());

    // Promotion: every share limited again, read back.
    let c = rt
        .block_on(e.set_stage("gen-0", crate::rollout::Stage::Enforce, None))
        .unwrap();
    assert_eq!(c.shares_changed, 4);
    for n in 1..=4 {
        assert_eq!(e.get_share(&share(n)).unwrap().phase, Phase::Enforced);
        assert!(lock(&k.installed).contains_key(&share(n)));
    }
    assert_eq!(allocated(&e, "gen-0"), q("4Gi"));

    // Each change is audited, for the device and for each share.
    let audit = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    let rollouts: Vec<&str> = audit
        .lines()
        .filter(|l| l.contains("\"decision\":\"rollout\""))
        .collect();
    assert!(
        rollouts
            .iter()
            .any(|l| l.contains("device gen-0: stage enforce -> observe")),
        "{rollouts:?}"
    );
    assert!(
        rollouts
            .iter()
            .any(|l| l.contains("device gen-0: stage observe -> enforce")),
        "{rollouts:?}"
    );
    assert_eq!(rollouts.len(), 2 + 3 + 4, "{rollouts:?}");

    // Unknown devices are named; a device with nothing to enforce refuses.
    assert!(matches!(
        rt.block_on(e.set_stage("nope", crate::rollout::Stage::Observe, None)),
        Err(crate::error::RequestError::UnknownDevice(_))
    ));
}

#[test]
fn a_class_changes_stage_as_a_whole_or_not_at_all() {
    use crate::rollout::Stage;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), "1h");
    let k = Arc::new(FakeKernel::default());
    let rt = rt();
    enforce_three(&cfg, &k, &rt);
    let e = open(&cfg, Some(&k), "boot-a");
    // Both generic test devices are in their kind's class.
    let class = crate::config::default_class(crate::config::DeviceKind::Generic);
    let changes = rt
        .block_on(e.set_class_stage(class, Stage::Observe, Some(0)))
        .unwrap();
    let got: Vec<(&str, Stage, usize)> = changes
        .iter()
        .map(|c| (c.device.as_str(), c.stage, c.shares_changed))
        .collect();
    assert_eq!(
        got,
        [("gen-0", Stage::Observe, 3), ("gen-1", Stage::Observe, 0)]
    );
    assert_eq!(
        (e.stage("gen-0"), e.stage("gen-1")),
        (Stage::Observe, Stage::Observe)
    );
    assert!(lock(&k.installed).is_empty());
    // Asking again changes nothing and says so: no new audit line, no share changed.
    let device_lines = || {
        std::fs::read_to_string(dir.path().join("audit.jsonl"))
            .unwrap()
            .lines()
            .filter(|l| l.contains("\"decision\":\"rollout\"") && l.contains(": stage "))
            .count()
    };
    assert_eq!(device_lines(), 2);
    let again = rt
        .block_on(e.set_class_stage(class, Stage::Observe, Some(0)))
        .unwrap();
    assert!(
        again
            .iter()
            .all(|c| c.previous == Stage::Observe && c.shares_changed == 0)
    );
    assert_eq!(device_lines(), 2);
    assert!(matches!(
        rt.block_on(e.set_class_stage("no-such-class", Stage::Enforce, None)),
        Err(crate::error::RequestError::UnknownClass(_))
    ));
    drop(e);

    // One device of the class cannot take a stage (it only accounts): the class is
    // refused, naming it, and neither device moves, now or after a restart.
    let mut cfg_mut = (*cfg).clone();
    let mut limiters = crate::limiters::for_config(&mut cfg_mut)
        .expect("limiters for the test config")
        .by_device;
    limiters.insert(
        "gen-0".into(),
        Arc::new(FakeLimiter(k.clone())) as Arc<dyn Limiter>,
    );
    let open_mixed =
        |limiters| Engine::open(cfg.clone(), limiters, "boot-a", Arc::new(Metrics::new())).unwrap();
    let e = open_mixed(limiters.clone());
    let err = rt
        .block_on(e.set_class_stage(class, Stage::Enforce, None))
        .unwrap_err();
    assert!(
        matches!(&err, crate::error::RequestError::StageNotSupported { device, .. } if device == "gen-1"),
        "{err}"
    );
    assert_eq!(e.stage("gen-0"), Stage::Observe);
    assert_eq!(e.get_share(&share(1)).unwrap().phase, Phase::Observed);
    drop(e);
    let e = open_mixed(limiters);
    assert_eq!(e.stage("gen-0"), Stage::Observe);
}

#[path = "slo_tests.rs"]
mod slo_tests;
