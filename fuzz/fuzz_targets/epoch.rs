//! The epoch fence (I4, I10) under any sequence of calls, on the real engine and a real
//! sled store: only `NewEpoch` raises the epoch, by exactly one; a Prepare or Unprepare
//! at any other epoch than the current one is refused as stale or unknown and changes
//! nothing (neither the epoch nor the ledger); and the epoch a restart finds is the last
//! one `NewEpoch` returned.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use shareguard::{api::metrics::Metrics, config::Config, engine::Engine, error::RequestError};
use shareguard_proto::v1 as pb;

const DRIVER: &str = "shareguard.example.com";

fn config(dir: &std::path::Path) -> Arc<Config> {
    let text = format!(
        r#"
[agent]
state_dir = {:?}
audit_log = {:?}
cgroup_root = {:?}

[[device]]
name = "gen-0"
driver = "{DRIVER}"
pool = "p"
kind = "generic"
allowed_namespaces = ["*"]
[device.capacity.memory]
value = "4Gi"
"#,
        dir.join("state"),
        dir.join("audit.jsonl"),
        dir.join("cgroup"),
    );
    // A fixed, valid config: a refusal here is a broken target, not a finding.
    Arc::new(Config::parse(&text, "fuzz").expect("the fuzz config parses"))
}

fn open(cfg: &Arc<Config>) -> Engine {
    let mut c = (**cfg).clone();
    let limiters = shareguard::limiters::for_config(&mut c)
        .expect("limiters for generic devices")
        .by_device;
    Engine::open(cfg.clone(), limiters, "boot", Arc::new(Metrics::new()))
        .expect("the engine opens on its own store")
}

fn claim(n: u8, gib: u8) -> pb::ClaimPrepare {
    pb::ClaimPrepare {
        claim: Some(pb::ClaimRef {
            uid: format!("c{n}"),
            namespace: "ns".into(),
            name: format!("c{n}"),
        }),
        allocation_id: "a".into(),
        target: None,
        allocations: vec![pb::DeviceAllocation {
            request: "r".into(),
            driver: DRIVER.into(),
            pool: "p".into(),
            device: "gen-0".into(),
            share_id: format!("{n:08x}-0000-4000-8000-000000000000"),
            consumed_capacity: [("memory".to_owned(), format!("{}Gi", gib % 3 + 1))].into(),
            ..Default::default()
        }],
        pre_bind: false,
    }
}

/// The epoch a call carries: the current one, one off either way, or anything.
fn epoch_for(sel: u8, raw: u64, current: u64) -> u64 {
    match sel % 4 {
        0 => current,
        1 => current.wrapping_sub(1),
        2 => current.wrapping_add(1),
        _ => raw,
    }
}

fn allocated(e: &Engine) -> String {
    e.devices()
        .iter()
        .map(|d| format!("{:?}", d.usage.allocated))
        .collect()
}

fn fenced(r: &RequestError, got: u64, current: u64) -> bool {
    match r {
        RequestError::StaleEpoch { .. } => got < current,
        RequestError::UnknownEpoch { .. } => got > current,
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    // Each step is 10 bytes: what, which epoch, and eight bytes of an arbitrary epoch.
    if data.len() > 10 * 24 {
        return;
    }
    let dir = tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("a temporary directory");
    let cfg = config(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let mut engine = open(&cfg);
    let mut model = 0u64;
    for step in data.chunks_exact(10) {
        let raw = u64::from_le_bytes(step[2..10].try_into().expect("eight bytes"));
        let epoch = epoch_for(step[1], raw, model);
        let before = allocated(&engine);
        match step[0] % 4 {
            0 => {
                let got = rt.block_on(engine.new_epoch(Some(0))).expect("NewEpoch");
                model += 1;
                assert_eq!(got, model, "NewEpoch returned another epoch than the next");
            }
            1 => {
                let c = claim(step[1] >> 4, step[2]);
                match rt.block_on(engine.prepare(epoch, &[c.into()], 0)) {
                    Ok(_) => assert_eq!(
                        epoch, model,
                        "a Prepare at {epoch} passed the fence at {model}"
                    ),
                    Err(e) => {
                        assert!(
                            fenced(&e, epoch, model),
                            "Prepare at {epoch} (current {model}): {e}"
                        );
                        assert_eq!(
                            allocated(&engine),
                            before,
                            "a fenced Prepare changed the ledger"
                        );
                    }
                }
            }
            2 => {
                let c = pb::ClaimRef {
                    uid: format!("c{}", step[1] >> 4),
                    ..Default::default()
                };
                match rt.block_on(engine.unprepare(epoch, &[c.into()], 0, false)) {
                    Ok(_) => assert_eq!(
                        epoch, model,
                        "an Unprepare at {epoch} passed the fence at {model}"
                    ),
                    Err(e) => {
                        assert!(
                            fenced(&e, epoch, model),
                            "Unprepare at {epoch} (current {model}): {e}"
                        );
                        assert_eq!(
                            allocated(&engine),
                            before,
                            "a fenced Unprepare changed the ledger"
                        );
                    }
                }
            }
            _ => {
                // A restart: what was durable is what the next instance finds.
                drop(engine);
                engine = open(&cfg);
            }
        }
        assert_eq!(engine.epoch(), model, "the epoch moved without NewEpoch");
    }
});
