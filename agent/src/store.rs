//! Durable state in sled.
//!
//! Schema (one sled database under `<state_dir>/store`):
//!
//! | tree     | key                         | value                                   |
//! |----------|-----------------------------|-----------------------------------------|
//! | `shares` | share key (shareID, or `dedicated/<claim uid>/<device>`) | [`ShareRecord`], versioned |
//! | `claims` | claim uid                   | [`ClaimRecord`] (the per-claim index), versioned |
//! | `meta`   | `epoch`                     | u64 big-endian: highest epoch accepted  |
//! | `meta`   | `boot_id`                   | kernel boot id the live shares were verified under |
//!
//! Values are encoded by [`crate::record`] (format byte + JSON). Released shares stay in
//! `shares` as tombstones (phase RELEASED) until the retention period ends.
//!
//! Every change that must go together (a claim and its shares, a phase change of all
//! shares of a claim, the epoch) is one [`Batch`] applied in one multi-tree transaction,
//! and nothing is acknowledged before [`Store::flush`] made it durable.

use std::path::Path;

use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};

use crate::record::{self, ClaimRecord, DecodeError, ShareRecord};

const EPOCH_KEY: &[u8] = b"epoch";
const BOOT_ID_KEY: &[u8] = b"boot_id";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("record {tree}/{key}: {source}")]
    Decode {
        tree: &'static str,
        key: String,
        source: DecodeError,
    },
    #[error("meta/{0}: malformed value")]
    Meta(&'static str),
}

/// Writes that must land together.
#[derive(Default, Debug)]
pub struct Batch {
    pub put_shares: Vec<ShareRecord>,
    pub delete_shares: Vec<String>,
    pub put_claims: Vec<ClaimRecord>,
    pub delete_claims: Vec<String>,
    pub epoch: Option<u64>,
    pub boot_id: Option<String>,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.put_shares.is_empty()
            && self.delete_shares.is_empty()
            && self.put_claims.is_empty()
            && self.delete_claims.is_empty()
            && self.epoch.is_none()
            && self.boot_id.is_none()
    }
}

/// Everything the store holds, as read at start.
#[derive(Debug, Default)]
pub struct Loaded {
    pub shares: Vec<ShareRecord>,
    pub claims: Vec<ClaimRecord>,
    pub epoch: u64,
    pub boot_id: Option<String>,
}

pub struct Store {
    db: sled::Db,
    shares: sled::Tree,
    claims: sled::Tree,
    meta: sled::Tree,
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        // sled's own background flush is only a backstop; durability comes from the
        // explicit flush before every acknowledgement.
        let db = sled::Config::new()
            .path(dir)
            .flush_every_ms(Some(1000))
            .open()?;
        Ok(Self {
            shares: db.open_tree("shares")?,
            claims: db.open_tree("claims")?,
            meta: db.open_tree("meta")?,
            db,
        })
    }

    pub fn load(&self) -> Result<Loaded, StoreError> {
        let mut out = Loaded::default();
        for item in self.shares.iter() {
            let (k, v) = item?;
            out.shares.push(decode("shares", &k, &v)?);
        }
        for item in self.claims.iter() {
            let (k, v) = item?;
            out.claims.push(decode("claims", &k, &v)?);
        }
        if let Some(v) = self.meta.get(EPOCH_KEY)? {
            let bytes: [u8; 8] = v
                .as_ref()
                .try_into()
                .map_err(|_| StoreError::Meta("epoch"))?;
            out.epoch = u64::from_be_bytes(bytes);
        }
        if let Some(v) = self.meta.get(BOOT_ID_KEY)? {
            out.boot_id =
                Some(String::from_utf8(v.to_vec()).map_err(|_| StoreError::Meta("boot_id"))?);
        }
        Ok(out)
    }

    /// Applies `batch` atomically. Not yet durable: call [`Store::flush`] before
    /// acknowledging anything that depends on it.
    pub fn commit(&self, batch: &Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        // Encode outside the transaction: sled may run the closure more than once.
        let shares: Vec<(&[u8], Vec<u8>)> = batch
            .put_shares
            .iter()
            .map(|r| (r.key.as_bytes(), record::encode(r)))
            .collect();
        let claims: Vec<(&[u8], Vec<u8>)> = batch
            .put_claims
            .iter()
            .map(|c| (c.claim.uid.as_bytes(), record::encode(c)))
            .collect();
        let result = (&self.shares, &self.claims, &self.meta).transaction(|(s, c, m)| {
            for (k, v) in &shares {
                s.insert(*k, v.as_slice())?;
            }
            for k in &batch.delete_shares {
                s.remove(k.as_bytes())?;
            }
            for (k, v) in &claims {
                c.insert(*k, v.as_slice())?;
            }
            for k in &batch.delete_claims {
                c.remove(k.as_bytes())?;
            }
            if let Some(e) = batch.epoch {
                m.insert(EPOCH_KEY, &e.to_be_bytes())?;
            }
            if let Some(b) = &batch.boot_id {
                m.insert(BOOT_ID_KEY, b.as_bytes())?;
            }
            Ok::<(), ConflictableTransactionError<()>>(())
        });
        match result {
            Ok(()) => Ok(()),
            Err(TransactionError::Storage(e)) => Err(StoreError::Sled(e)),
            // The closure never aborts; sled retries conflicts internally.
            Err(TransactionError::Abort(())) => Err(StoreError::Meta("transaction aborted")),
        }
    }

    /// Waits until everything committed so far is on disk (fsync). Concurrent callers
    /// share one flush, which is what keeps durable Prepares cheap under load.
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.db.flush_async().await?;
        Ok(())
    }

    pub fn flush_blocking(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }
}

fn decode<T: for<'de> serde::Deserialize<'de>>(
    tree: &'static str,
    key: &[u8],
    value: &[u8],
) -> Result<T, StoreError> {
    record::decode(value).map_err(|source| StoreError::Decode {
        tree,
        key: String::from_utf8_lossy(key).into_owned(),
        source,
    })
}
