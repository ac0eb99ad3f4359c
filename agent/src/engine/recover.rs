//! Start-up: rebuild the ledger from the store and re-verify what the kernel or driver
//! still enforces. Nothing is freed here: a share that cannot be verified becomes UNKNOWN
//! or DEGRADED and keeps its capacity until an explicit Unprepare. After a reboot nothing
//! survived, so every enforced share waits for its pod's sandbox again (PENDING), and the
//! discovery loop enforces it when the pod is back.

use crate::{
    audit::Decision,
    config::DeviceKind,
    ledger::State,
    record::{Phase, ShareRecord},
    store::{Batch, Loaded},
};

use super::{Engine, OpenError, now_ms, prepare::ACCOUNTED_REASON};

pub(super) fn recover(
    engine: &Engine,
    loaded: Loaded,
    boot_id: &str,
) -> Result<(State, Batch), OpenError> {
    check_inventory(engine, &loaded.shares)?;
    let rebooted = loaded.boot_id.as_deref().is_some_and(|b| b != boot_id);
    let mut state = State::default();
    state.epoch = loaded.epoch;
    state.epoch_durable = loaded.epoch;
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
            let before = r.clone();
            r.phase = phase;
            r.reason = reason;
            if phase == Phase::Pending {
                r.sandbox = None;
                r.enforced.clear();
            }
            r.updated_at_ms = now;
            // Written to the store directly, not through commit_locked.
            r.carry_condition_since(Some(&before));
            batch.put_shares.push(r.clone());
        }
        state.put(r);
    }
    Ok((state, batch))
}

/// Refuses a config that dropped a device with live enforced shares, or changed the kind
/// of a device with live shares: their limits would stay in the kernel with nothing to
/// release them, or be judged by the wrong limiter. The message names each share, so an
/// operator can release them under the old config first. A dropped accounting device
/// holds nothing in the kernel: its shares become UNKNOWN and keep their capacity.
fn check_inventory(engine: &Engine, shares: &[ShareRecord]) -> Result<(), OpenError> {
    let mut problems = Vec::new();
    for r in shares.iter().filter(|r| r.phase.holds_capacity()) {
        let who = format!(
            "share {} of claim {}/{} ({})",
            r.key,
            r.claim.namespace,
            r.claim.name,
            r.phase.name()
        );
        match engine.cfg.device(&r.device) {
            None if r.device_kind != DeviceKind::Generic.as_str() => problems.push(format!(
                "device {} is gone from the config, but {who} is enforced on it",
                r.device
            )),
            Some(d) if !r.device_kind.is_empty() && r.device_kind != d.kind.as_str() => problems
                .push(format!(
                    "device {} changed kind from {} to {}, but {who} is live on it",
                    r.device,
                    r.device_kind,
                    d.kind.as_str()
                )),
            _ => {}
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(OpenError::Inventory(format!(
        "refusing to start: {}; release those claims under the old config first (or put the devices back)",
        problems.join("; ")
    )))
}

/// The phase a live record should have now, or None to leave it as it is.
fn reverify(engine: &Engine, r: &ShareRecord, rebooted: bool) -> Option<(Phase, String)> {
    if !r.phase.holds_capacity() {
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
    let spec = engine.spec_of(r);
    if r.phase == Phase::Releasing {
        // A release that was interrupted stays RELEASING, holding its capacity, until the
        // Unprepare is repeated; the limiter re-learns the share first, so that the
        // repeated release finds what to undo (the GPU limiter keeps its table in memory).
        if let Err(e) = limiter.verify(&spec) {
            tracing::debug!(share = %r.key, error = %e, "releasing share not verifiable at start");
        }
        return None;
    }
    if rebooted {
        // Whatever an install record says is stale now; drop it, so nothing is undone on
        // an interface that merely took an old name or index.
        if let Err(e) = limiter.remove(&r.key) {
            tracing::warn!(share = %r.key, error = %e, "clearing a share's pre-reboot state failed");
        }
        return Some((
            Phase::Pending,
            "node rebooted: no enforcement survives a reboot; waiting for the pod's sandbox, capacity held".to_owned(),
        ));
    }
    if matches!(r.phase, Phase::Pending | Phase::Preparing) {
        // Nothing verified to verify: the discovery loop's first pass takes these on.
        return None;
    }
    Some(match limiter.verify(&spec) {
        Ok(e) => engine.judge(r, &e),
        Err(e) => (
            Phase::Unknown,
            format!("could not be verified after restart: {e}"),
        ),
    })
}
