//! The store's failure and recovery. A write that fails (a full disk, a file system
//! remounted read-only) stops the store: the engine's memory may then be ahead of the
//! disk, so nothing more is accepted, and every call that needs a durable write is
//! answered with a retryable Unavailable. The agent stays up, says why in /readyz, and
//! tries to reopen the store on a period: the reopened store is what was durable, which
//! the engine reloads and re-verifies as at a restart. Nothing acknowledged was ever
//! only in memory, so nothing acknowledged is lost; a change that failed may or may not
//! be on disk afterwards, and the caller's retry settles it either way (I3).

use std::time::Duration;

use crate::{
    ledger::State,
    record::ShareRecord,
    store::{Batch, Store, StoreError},
    sync::lock,
};

use super::{Engine, OpenError, recover};

/// How long a reopen waits for sled to let go of the old instance's directory lock.
pub(super) const REOPEN_PATIENCE: Duration = Duration::from_secs(5);

impl Engine {
    /// Why the store accepts no changes now, if it does not.
    pub fn store_problem(&self) -> Option<String> {
        match lock(&self.store).as_ref() {
            Some(s) => s.problem(),
            None => Some("the state store is being reopened".to_owned()),
        }
    }

    /// Queues `batch` on the store (see [`Store::submit`]); fails at once without one.
    pub(super) fn submit(&self, batch: Batch) -> crate::store::Durable {
        match lock(&self.store).as_ref() {
            Some(s) => s.submit(batch),
            None => crate::store::Durable::failed(),
        }
    }

    fn store_err(&self, source: StoreError) -> OpenError {
        OpenError::Store {
            path: self.cfg.agent.state_dir.join("store").display().to_string(),
            source,
        }
    }

    /// The ledger from what the store holds, re-verified (see [`recover`]), with the
    /// changes that makes written and durable.
    /// `store` is not in the engine's slot yet: nothing else can commit through it
    /// while it is read and re-verified, and no engine lock is held meanwhile.
    pub(super) fn load_state_from(&self, store: &Store) -> Result<State, OpenError> {
        let loaded = store.load().map_err(|e| self.store_err(e))?;
        // Before recovery, which verifies each share under its device's stage.
        self.adopt_stages(&loaded.stages);
        // Before anything is recorded: the first Prepare lands behind what was saved.
        let stale = self.slo_restore(&loaded.slo);
        let (mut state, mut batch) = recover::recover(self, loaded, &self.boot_id)?;
        batch
            .slo
            .extend(stale.into_iter().map(|class| (class, None)));
        store
            .submit(batch)
            .wait_blocking()
            .map_err(|e| self.store_err(e))?;
        if !state.sums_consistent() {
            // Cannot happen while put/remove are the only mutators; if it ever does, the
            // records are the truth and the view is rebuilt from them.
            tracing::error!("ledger sums disagreed with the records; rebuilt from the records");
            let records: Vec<ShareRecord> = state.records.values().cloned().collect();
            let mut fresh = State::default();
            fresh.epoch = state.epoch;
            fresh.epoch_durable = state.epoch_durable;
            fresh.claims = std::mem::take(&mut state.claims);
            for r in records {
                fresh.put(r);
            }
            state = fresh;
        }
        Ok(state)
    }

    /// Audits a config other than the one the last start ran with (`digest`: SHA-256 of
    /// this config file's text), naming the devices it adds and removes, and remembers
    /// this one, durably, before the agent serves.
    pub fn note_config(&self, digest: String) -> Result<(), StoreError> {
        let now = crate::store::ConfigSeen {
            digest,
            devices: self.cfg.devices.iter().map(|d| d.name.clone()).collect(),
        };
        let before = match lock(&self.store).as_ref() {
            Some(s) => s.config_seen()?,
            None => return Err(StoreError::Failed),
        };
        if before.as_ref() == Some(&now) {
            return Ok(());
        }
        let reason = match &before {
            None => format!(
                "first start recorded on this store: config sha256 {}; devices: {}",
                now.digest,
                now.devices.join(", ")
            ),
            Some(b) => {
                let added: Vec<&str> = now
                    .devices
                    .iter()
                    .filter(|d| !b.devices.contains(d))
                    .map(String::as_str)
                    .collect();
                let removed: Vec<&str> = b
                    .devices
                    .iter()
                    .filter(|d| !now.devices.contains(d))
                    .map(String::as_str)
                    .collect();
                format!(
                    "config changed since the last start: sha256 {} (was {}); devices added: [{}]; removed: [{}]",
                    now.digest,
                    b.digest,
                    added.join(", "),
                    removed.join(", ")
                )
            }
        };
        self.submit(Batch {
            config: Some(now),
            ..Default::default()
        })
        .wait_blocking()?;
        let epoch = lock(&self.state).epoch;
        self.audit_node(crate::audit::Decision::Config, &reason, epoch, None, None);
        tracing::info!(%reason, "config recorded");
        Ok(())
    }

    /// Reopens a failed store and reloads the engine from it. Blocking (file I/O, and the
    /// limiters' read-back): call it from a blocking thread. No change is decided
    /// meanwhile, because the engine has no store until the reload is done (every change
    /// is refused as retryable, as while the store was failed); but no lock is held
    /// across the reload either, so reads, health and metrics keep answering from the
    /// state as it was. Returns whether the store works again; Ok(false) when it had not
    /// failed.
    pub fn reopen_store(&self) -> Result<bool, OpenError> {
        if self.store_problem().is_none() {
            return Ok(false);
        }
        let dir = self.cfg.agent.state_dir.join("store");
        // The failed instance goes first: its writer thread ends and sled lets go of the
        // directory. What it had only in memory is gone with it.
        drop(lock(&self.store).take());
        let store = Store::open_patiently(&dir, REOPEN_PATIENCE).map_err(|e| self.store_err(e))?;
        // A write that must reach the disk before the store counts as working again: a
        // disk that is still full fails here rather than on the next tenant's Prepare.
        let epoch = lock(&self.state).epoch_durable;
        store
            .submit(Batch {
                epoch: Some(epoch),
                ..Default::default()
            })
            .wait_blocking()
            .map_err(|e| self.store_err(e))?;
        let state = self.load_state_from(&store)?;
        {
            // Both at once: whoever commits next sees the reloaded state and the new store.
            let mut st = lock(&self.state);
            *lock(&self.store) = Some(store);
            *st = state;
        }
        tracing::info!("the state store works again; the engine was reloaded from it");
        // Shares whose sandbox changed while nothing could be written are followed now.
        self.kick();
        Ok(true)
    }
}
