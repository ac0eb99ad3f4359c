//! Rollout stages as the engine keeps and changes them (see [`crate::rollout`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use shareguard_common::limiter::Limiter;
use tracing::{Instrument, info, info_span, warn};

use crate::{
    audit::Decision,
    error::RequestError,
    record::Phase,
    rollout::{Stage, StageRecord, observing::Observing},
    store::Batch,
    sync::lock,
};

use super::{
    Engine, now_ms,
    sandbox::{Step, follows_sandbox},
};

/// What a stage change did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StageChange {
    pub device: String,
    pub previous: Stage,
    pub stage: Stage,
    /// Live shares of the device brought to the new stage in this pass.
    pub shares_changed: usize,
    /// Live shares whose change failed; the reconciler and the sandbox loop retry them.
    pub shares_failed: usize,
}

impl Engine {
    /// Takes the stored stages (set at runtime) over the config's first stages.
    pub(super) fn adopt_stages(&self, stored: &BTreeMap<String, StageRecord>) {
        let stages: HashMap<String, Stage> = self
            .cfg
            .devices
            .iter()
            .map(|d| {
                let s = stored.get(&d.name).map_or(d.stage, |r| r.stage);
                (d.name.clone(), s)
            })
            .collect();
        *lock(&self.stages) = stages;
    }

    /// The device's stage now.
    pub fn stage(&self, device: &str) -> Stage {
        lock(&self.stages).get(device).copied().unwrap_or_default()
    }

    /// The limiter the engine uses for `device`: the device's own in `enforce`, one that
    /// lifts and applies nothing in `observe`.
    pub(super) fn limiter(&self, device: &str) -> Option<Arc<dyn Limiter>> {
        let l = self.limiters.get(device)?.clone();
        Some(match self.stage(device) {
            Stage::Enforce => l,
            Stage::Observe => Arc::new(Observing::new(l)),
        })
    }

    /// Moves `device` to `stage`: durable and audited first, then every live share of
    /// the device is applied again under it in one pass (lifted for `observe`, limited
    /// for `enforce`), keeping every share and the capacity it holds.
    pub async fn set_stage(
        &self,
        device: &str,
        stage: Stage,
        caller: Option<u32>,
    ) -> Result<StageChange, RequestError> {
        let mut changes = self.set_stages(&[device.to_owned()], stage, caller).await?;
        Ok(changes.pop().unwrap_or_default())
    }

    /// Moves every device of DeviceClass `class` (the config's `class`) to `stage`, as
    /// [`Engine::set_stage`] does one: all of them or, when one cannot take the stage,
    /// none (the error names that device).
    pub async fn set_class_stage(
        &self,
        class: &str,
        stage: Stage,
        caller: Option<u32>,
    ) -> Result<Vec<StageChange>, RequestError> {
        let devices: Vec<String> = self
            .cfg
            .devices
            .iter()
            .filter(|d| d.class == class)
            .map(|d| d.name.clone())
            .collect();
        if devices.is_empty() {
            return Err(RequestError::UnknownClass(class.to_owned()));
        }
        self.set_stages(&devices, stage, caller).await
    }

    /// Why `device` cannot take `stage`, if it cannot.
    fn check_stage(&self, device: &str, stage: Stage) -> Result<(), RequestError> {
        let Some(l) = self.limiters.get(device) else {
            return Err(RequestError::UnknownDevice(device.to_owned()));
        };
        if l.accounting_only() {
            return Err(RequestError::StageNotSupported {
                device: device.to_owned(),
                reason: "it only accounts; there is no limit to lift or to apply".into(),
            });
        }
        if stage == Stage::Observe && l.device_facts(device).mechanism.ends_with("mps") {
            // Lifting an MPS share stops its daemon, whose pipe directory the claims' CDI
            // specs name: new containers of those claims would fail to start.
            return Err(RequestError::StageNotSupported {
                device: device.to_owned(),
                reason: "its shares run through their own MPS daemons, which the claims' CDI specs name; observe is not supported for the mps mechanism yet".into(),
            });
        }
        Ok(())
    }

    /// Checks every device first, makes the new stages durable in one write, audits
    /// each, then applies each device's live shares again.
    async fn set_stages(
        &self,
        devices: &[String],
        stage: Stage,
        caller: Option<u32>,
    ) -> Result<Vec<StageChange>, RequestError> {
        for d in devices {
            self.check_stage(d, stage)?;
        }
        // One change at a time: what each device was in is then what the audit says,
        // and two changes never interleave their passes over the shares.
        let _one = self.stage_change.lock().await;
        let changed_at_ms = now_ms();
        let previous: Vec<Stage> = devices.iter().map(|d| self.stage(d)).collect();
        // Every device's record is written, so that a stage set at runtime outlives a
        // later change of the config's first stage even where the two agreed. A device
        // already in the stage gets no audit line (nothing changed); its shares are still
        // applied again below, which repairs one left in the other stage's form.
        self.commit_durable(Batch {
            stages: devices
                .iter()
                .map(|d| {
                    let record = StageRecord {
                        stage,
                        changed_at_ms,
                        caller_uid: caller,
                    };
                    (d.clone(), record)
                })
                .collect(),
            ..Default::default()
        })
        .await?;
        {
            let mut stages = lock(&self.stages);
            for d in devices {
                stages.insert(d.clone(), stage);
            }
        }
        let epoch = lock(&self.state).epoch;
        let mut changes = Vec::with_capacity(devices.len());
        for (device, previous) in devices.iter().zip(previous) {
            changes.push(StageChange {
                device: device.clone(),
                previous,
                stage,
                ..Default::default()
            });
            if previous == stage {
                continue;
            }
            self.audit_node(
                Decision::Rollout,
                &format!(
                    "device {device}: stage {} -> {}",
                    previous.name(),
                    stage.name()
                ),
                epoch,
                caller,
                None,
            );
            info!(%device, from = previous.name(), to = stage.name(), "rollout stage changed");
        }
        for change in &mut changes {
            self.restage_device(change, caller).await;
        }
        Ok(changes)
    }

    /// Applies every live share of `change.device` again under its stage now.
    async fn restage_device(&self, change: &mut StageChange, caller: Option<u32>) {
        let device = change.device.as_str();
        let shares: Vec<(String, String)> = {
            let st = lock(&self.state);
            st.records
                .values()
                .filter(|r| r.device == device && follows_sandbox(r))
                .map(|r| (r.key.clone(), r.claim.uid.clone()))
                .collect()
        };
        for (key, claim) in shares {
            let span = info_span!("restage", share = %key, claim = %claim);
            match self.restage(&key, &claim, caller).instrument(span).await {
                Some(true) => change.shares_changed += 1,
                Some(false) => {}
                None => change.shares_failed += 1,
            }
        }
    }

    /// Applies share `key` again under its device's stage now, under its claim's lock.
    /// Some(changed), or None when applying failed (the share says why; the loops retry).
    async fn restage(&self, key: &str, claim_uid: &str, caller: Option<u32>) -> Option<bool> {
        let _guard = self.locks.lock(claim_uid).await;
        let r = lock(&self.state).records.get(key).cloned()?;
        if !follows_sandbox(&r) {
            return Some(false);
        }
        let (next, failed) = match self.step(&r, true).await {
            Step::Same => return Some(false),
            Step::Next(n) => (n, None),
            Step::Failed(mut n, e) => {
                n.phase = Phase::Degraded;
                n.reason = format!(
                    "applying the {} stage failed: {e}; retried by the reconciler, capacity held",
                    self.stage(&r.device).name()
                )
                .into();
                (n, Some(e))
            }
        };
        if next == r {
            return Some(false);
        }
        self.persist_change(&r, next, Decision::Rollout, caller)
            .await?;
        if let Some(e) = failed {
            warn!(error = %e, "a share could not be brought to its device's new stage");
            return None;
        }
        Some(true)
    }
}
