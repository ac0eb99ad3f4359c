//! Start-up: rebuild the ledger from the store and re-verify what the kernel or driver
//! still enforces. Nothing is freed here: a share that cannot be verified becomes UNKNOWN
//! or DEGRADED and keeps its capacity until an explicit Unprepare.

use crate::{
    audit::Decision,
    ledger::State,
    record::{Phase, ShareRecord},
    store::{Batch, Loaded},
};

use super::{Engine, judge, now_ms, prepare::ACCOUNTED_REASON, spec_of};

pub(super) fn recover(engine: &Engine, loaded: Loaded, boot_id: &str) -> (State, Batch) {
    let rebooted = loaded.boot_id.as_deref().is_some_and(|b| b != boot_id);
    let mut state = State::default();
    state.epoch = loaded.epoch;
    let mut batch = Batch {
        boot_id: (loaded.boot_id.as_deref() != Some(boot_id)).then(|| boot_id.to_owned()),
        ..Default::default()
    };
    for c in loaded.claims {
        state.claims.insert(c.claim.uid.clone(), c);
    }
    let now = now_ms();
    for mut r in loaded.shares {
        if let Some((phase, reason)) = reverify(engine, &r, rebooted)
            && (phase != r.phase || reason != r.reason)
        {
            engine.audit_share(
                &r,
                Decision::Recover,
                &format!("{} -> {}: {reason}", r.phase.name(), phase.name()),
                None,
                None,
            );
            r.phase = phase;
            r.reason = reason;
            r.updated_at_ms = now;
            batch.put_shares.push(r.clone());
        }
        state.put(r);
    }
    (state, batch)
}

/// The phase a live record should have now, or None to leave it as it is.
fn reverify(engine: &Engine, r: &ShareRecord, rebooted: bool) -> Option<(Phase, String)> {
    if !r.phase.holds_capacity() || r.phase == Phase::Releasing {
        // Released and failed records hold nothing; a release that was interrupted stays
        // RELEASING, holding its capacity, until the Unprepare is repeated.
        return None;
    }
    let Some(limiter) = engine.limiter(&r.device) else {
        return Some((
            Phase::Unknown,
            format!(
                "device {} is no longer in the inventory; capacity stays reserved until Unprepare",
                r.device
            ),
        ));
    };
    if limiter.accounting_only() {
        // Accounting has no kernel state to lose: any live phase other than ACCOUNTED
        // (UNKNOWN while the device was missing from the inventory) is resolved by the
        // device being back.
        return (r.phase != Phase::Accounted)
            .then(|| (Phase::Accounted, ACCOUNTED_REASON.to_owned()));
    }
    if rebooted {
        return Some((
            Phase::Unknown,
            "node rebooted: no enforcement survives a reboot; waiting for the pod's Prepare to be repeated".to_owned(),
        ));
    }
    Some(match limiter.verify(&spec_of(r)) {
        Ok(e) => judge(r, &e),
        Err(e) => (
            Phase::Unknown,
            format!("could not be verified after restart: {e}"),
        ),
    })
}
