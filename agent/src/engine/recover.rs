//! Start-up: rebuild the ledger from the store and re-verify what the kernel or driver
//! still enforces. Nothing is freed here: a share that cannot be verified becomes UNKNOWN
//! or DEGRADED and keeps its capacity until an explicit Unprepare. After a reboot nothing
//! survived, so every enforced share waits for its pod's sandbox again (PENDING), and the
//! discovery loop enforces it when the pod is back.

use crate::{
    audit::{AuditLine, Decision, now_rfc3339},
    config::DeviceKind,
    ledger::State,
    record::{self, ClaimId, ClaimRecord, Name, Phase, Reason, ShareRecord, reasons},
    store::{Batch, Loaded},
};

use super::{Engine, OpenError, now_ms};

pub(super) fn recover(
    engine: &Engine,
    mut loaded: Loaded,
    boot_id: &str,
) -> Result<(State, Batch), OpenError> {
    check_inventory(engine, &loaded.shares)?;
    // Before anything is re-verified: the phases as stored say what must be.
    engine.slo_expect_recovery(&loaded.shares);
    let rebooted = loaded.boot_id.as_deref().is_some_and(|b| b != boot_id);
    let mut state = State::default();
    state.epoch = loaded.epoch;
    state.epoch_durable = loaded.epoch;
    let mut batch = Batch {
        boot_id: (loaded.boot_id.as_deref() != Some(boot_id)).then(|| boot_id.to_owned()),
        ..Default::default()
    };
    let now = now_ms();
    let stand_ins = quarantine(engine, &mut loaded, &mut batch, now);
    state.claims.reserve(loaded.claims.len());
    state.records.reserve(loaded.shares.len() + stand_ins.len());
    for c in loaded.claims {
        state.claims.insert_boxed(c);
    }
    for r in stand_ins {
        state.put(r);
    }
    for mut r in loaded.shares {
        // Bounded before the comparison, so that a long reason stored cut is not found
        // changed, and rewritten, at every start.
        if let Some((phase, reason)) = reverify(engine, &r, rebooted)
            .map(|(phase, reason)| (phase, record::bounded_reason(reason)))
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
                r.set_sandboxes(Vec::new());
                r.enforced.clear();
            }
            r.updated_at_ms = now;
            // Written to the store directly, not through commit_locked.
            r.carry_condition_since(Some(&before));
            batch.put_shares.push(ShareRecord::clone(&r));
        }
        state.put_boxed(r);
    }
    Ok((state, batch))
}

/// Records that did not decode (a newer agent's format, a damaged value) do not stop the
/// node. Each is copied into the store's quarantine as found, audited and counted; the
/// rest load. A share record becomes an UNKNOWN stand-in holding what could be salvaged
/// of it: with its device and amounts readable, its capacity stays reserved there as any
/// unverifiable share's does; without them, the ledger cannot know what it held, so no
/// device admits anything until its claim is unprepared (see `ledger::check_claim`).
/// A claim's index is rebuilt from the shares that name its claim (at load).
fn quarantine(
    engine: &Engine,
    loaded: &mut Loaded,
    batch: &mut Batch,
    now: u64,
) -> Vec<ShareRecord> {
    engine.metrics.quarantined(loaded.quarantine_total);
    let mut stand_ins = Vec::new();
    for q in std::mem::take(&mut loaded.quarantined) {
        batch.quarantine.push((q.name(), q.bytes.clone()));
        tracing::error!(record = %q.name(), error = %q.error, "unreadable record quarantined");
        if q.tree == "claims" {
            // The index itself was rebuilt from the shares at load; what only such a
            // record held (a GPU claim's CDI ids) is not recovered.
            let shares: Vec<&ShareRecord> = loaded
                .shares
                .iter()
                .filter(|r| r.claim.uid == q.key)
                .map(|r| &**r)
                .collect();
            let claim = shares.first().map(|r| r.claim.clone()).unwrap_or(ClaimId {
                uid: q.key.clone(),
                ..Default::default()
            });
            let reason = format!(
                "record {} is unreadable ({}); quarantined as found, the claim's index rebuilt from {} share(s) naming it",
                q.name(),
                q.error,
                shares.len()
            );
            audit_quarantine(engine, &q, &claim, "", &Default::default(), &reason);
            continue;
        }
        let s = record::salvage(&q.bytes);
        let indexed = loaded
            .claims
            .iter()
            .find(|c| c.share_keys.contains(&q.key))
            .map(|c| c.claim.clone());
        let claim = s.claim.clone().or(indexed).unwrap_or_else(|| ClaimId {
            uid: stand_in_uid(&q.key),
            ..Default::default()
        });
        let (device, consumed) = match (&s.device, &s.consumed) {
            (Some(d), Some(c)) => (d.clone(), c.clone()),
            _ => (String::new(), Default::default()),
        };
        let held = if device.is_empty() {
            format!(
                "what it held cannot be read, so no device admits new shares until claim {} is unprepared",
                claim.uid
            )
        } else {
            format!(
                "its capacity stays reserved on device {device} until claim {} is unprepared",
                claim.uid
            )
        };
        let reason = format!(
            "record {} is unreadable ({}); quarantined as found: {held}",
            q.name(),
            q.error
        );
        audit_quarantine(engine, &q, &claim, &device, &consumed, &reason);
        // Known to the claim index, so an Unprepare of the claim finds it.
        match loaded.claims.iter_mut().find(|c| c.claim.uid == claim.uid) {
            Some(c) if !c.share_keys.contains(&q.key) => c.share_keys.push(q.key.clone()),
            Some(_) => {}
            None => loaded.claims.push(Box::new(ClaimRecord {
                claim: claim.clone(),
                allocation_id: Name::default(),
                share_keys: smallvec::smallvec![q.key.clone()],
                cdi_device_ids: Box::default(),
                updated_at_ms: now,
            })),
        }
        stand_ins.push(ShareRecord {
            key: q.key.clone(),
            shared: s.share_id.is_some() || !q.key.starts_with("dedicated/"),
            claim,
            allocation_id: Name::default(),
            request: Name::default(),
            driver: Name::default(),
            pool: Name::default(),
            device: device.into(),
            consumed: consumed.into(),
            policy_version: Name::default(),
            admin_access: s.admin_access,
            target: Default::default(),
            phase: Phase::Unknown,
            mechanism: Name::default(),
            enforced: Default::default(),
            reason: reason.into(),
            error: None,
            epoch: 0,
            created_at_ms: now,
            updated_at_ms: now,
            released_at_ms: None,
            sandbox: None,
            more_sandboxes: None,
            device_kind: s.device_kind,
            condition_since_ms: now,
            quarantined: true,
            rolling_back: false,
            pre_bind: false,
        });
    }
    stand_ins
}

/// A claim uid for a stand-in whose claim cannot be read: one the API accepts, so that
/// `shareguard release` can name it.
fn stand_in_uid(key: &str) -> String {
    let clean: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut uid = format!("quarantined-{clean}");
    uid.truncate(crate::validate::MAX_ID_LEN);
    uid
}

fn audit_quarantine(
    engine: &Engine,
    q: &crate::store::Quarantined,
    claim: &ClaimId,
    device: &str,
    consumed: &std::collections::BTreeMap<String, shareguard_common::Quantity>,
    reason: &str,
) {
    engine.audit.write(&AuditLine {
        time: now_rfc3339(),
        decision: Decision::Quarantine,
        reason,
        tenant: &claim.namespace,
        claim_uid: &claim.uid,
        claim_name: &claim.name,
        share_id: if q.tree == "shares" { &q.key } else { "" },
        device,
        amounts: consumed
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
        policy_version: "",
        allocation_id: "",
        epoch: 0,
        caller_uid: None,
        code: Some("DataLoss"),
    });
}

/// Refuses a config that dropped a device with live enforced shares, or changed the kind
/// of a device with live shares: their limits would stay in the kernel with nothing to
/// release them, or be judged by the wrong limiter. The message names each share, so an
/// operator can release them under the old config first. A dropped accounting device
/// holds nothing in the kernel: its shares become UNKNOWN and keep their capacity.
fn check_inventory(engine: &Engine, shares: &[Box<ShareRecord>]) -> Result<(), OpenError> {
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
fn reverify(engine: &Engine, r: &ShareRecord, rebooted: bool) -> Option<(Phase, Reason)> {
    if !r.phase.holds_capacity() {
        return None;
    }
    let Some(limiter) = engine.limiter(&r.device) else {
        return Some((
            Phase::Unknown,
            format!(
                "device {} is no longer in the inventory; capacity stays reserved until Unprepare",
                r.device
            )
            .into(),
        ));
    };
    if limiter.accounting_only() {
        // Accounting has no kernel state to lose: any live phase other than ACCOUNTED
        // (UNKNOWN while the device was missing from the inventory) is resolved by the
        // device being back.
        return (r.phase != Phase::Accounted)
            .then(|| (Phase::Accounted, reasons::ACCOUNTED.into()));
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
            "node rebooted: no enforcement survives a reboot; waiting for the pod's sandbox, capacity held".into(),
        ));
    }
    if matches!(r.phase, Phase::Pending | Phase::Preparing) {
        // Nothing verified to verify: the discovery loop's first pass takes these on.
        return None;
    }
    Some(match limiter.verify(&spec) {
        Ok(e) => {
            let (phase, reason) = engine.judge(r, &e);
            (phase, reason.into())
        }
        Err(e) => (
            Phase::Unknown,
            format!("could not be verified after restart: {e}").into(),
        ),
    })
}
