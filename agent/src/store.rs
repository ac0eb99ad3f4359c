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
//! and nothing is acknowledged before its [`Durable`] handle resolved.
//!
//! All writes go through one writer thread, in the order they were submitted (which is
//! the order the engine decided them in, under its state lock). The thread applies every
//! batch that is waiting, then makes them durable together: sled's flush (which only
//! does `sync_file_range`) followed by an `fdatasync` of sled's log file, so the disk's
//! write cache and the file size are on stable storage too. One group, one sync: this is
//! what keeps a durable Prepare close to the cost of one fsync under load. It also keeps
//! sled's own flush off the async runtime, where concurrent `flush_async` calls can
//! deadlock sled 0.34's thread pool.

use std::{
    fs::File,
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use tokio::sync::oneshot;

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
    #[error("sync of the store's log file: {0}")]
    Sync(String),
    #[error("the store failed earlier and accepts no more writes; restart the agent")]
    Failed,
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
    trees: Trees,
    writer: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    failed: Arc<AtomicBool>,
}

#[derive(Clone)]
struct Trees {
    db: sled::Db,
    shares: sled::Tree,
    claims: sled::Tree,
    meta: sled::Tree,
}

struct Job {
    batch: Batch,
    done: oneshot::Sender<Result<(), StoreError>>,
}

/// Resolves once a submitted batch is durable (or the write failed).
pub struct Durable(oneshot::Receiver<Result<(), StoreError>>);

impl Durable {
    pub async fn wait(self) -> Result<(), StoreError> {
        self.0.await.unwrap_or(Err(StoreError::Failed))
    }

    /// For start-up, before the async runtime serves anything.
    pub fn wait_blocking(self) -> Result<(), StoreError> {
        self.0.blocking_recv().unwrap_or(Err(StoreError::Failed))
    }
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        // No background flush: durability comes from the writer thread alone.
        let db = sled::Config::new().path(dir).flush_every_ms(None).open()?;
        // sled keeps its log in `<dir>/db`; an fdatasync on any descriptor of it makes
        // what sled wrote there stable.
        let log = File::open(dir.join("db"))
            .map_err(|e| StoreError::Sync(format!("open {}/db: {e}", dir.display())))?;
        let trees = Trees {
            shares: db.open_tree("shares")?,
            claims: db.open_tree("claims")?,
            meta: db.open_tree("meta")?,
            db,
        };
        let failed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = {
            let trees = trees.clone();
            let failed = failed.clone();
            std::thread::Builder::new()
                .name("shareguard-store".into())
                .spawn(move || writer(trees, log, rx, failed))
                .map_err(|e| StoreError::Sync(format!("cannot start the writer thread: {e}")))?
        };
        Ok(Self {
            trees,
            writer: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            failed,
        })
    }

    pub fn load(&self) -> Result<Loaded, StoreError> {
        let t = &self.trees;
        let mut out = Loaded::default();
        for item in t.shares.iter() {
            let (k, v) = item?;
            out.shares.push(decode("shares", &k, &v)?);
        }
        for item in t.claims.iter() {
            let (k, v) = item?;
            out.claims.push(decode("claims", &k, &v)?);
        }
        if let Some(v) = t.meta.get(EPOCH_KEY)? {
            let bytes: [u8; 8] = v
                .as_ref()
                .try_into()
                .map_err(|_| StoreError::Meta("epoch"))?;
            out.epoch = u64::from_be_bytes(bytes);
        }
        if let Some(v) = t.meta.get(BOOT_ID_KEY)? {
            out.boot_id =
                Some(String::from_utf8(v.to_vec()).map_err(|_| StoreError::Meta("boot_id"))?);
        }
        Ok(out)
    }

    /// True once a write failed: the in-memory state may then be ahead of the disk, so
    /// the agent must accept no more changes until it is restarted from the store.
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Queues `batch` behind everything submitted before it. Never blocks; an empty batch
    /// is a barrier that resolves once everything before it is durable.
    pub fn submit(&self, batch: Batch) -> Durable {
        let (done, rx) = oneshot::channel();
        let job = Job { batch, done };
        let sent = crate::sync::lock(&self.writer)
            .as_ref()
            .is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            // The writer is gone (shutdown or a panic): `rx` resolves as failed.
            self.failed.store(true, Ordering::Release);
        }
        Durable(rx)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Closing the channel lets the writer finish what is queued and exit; joining it
        // releases sled's lock on the directory before anyone reopens it.
        crate::sync::lock(&self.writer).take();
        if let Some(t) = crate::sync::lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// The writer thread: applies queued batches in order and makes each group durable.
fn writer(t: Trees, log: File, rx: mpsc::Receiver<Job>, failed: Arc<AtomicBool>) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        jobs.extend(rx.try_iter());
        let results: Vec<Result<(), StoreError>> = jobs
            .iter()
            .map(|j| {
                if failed.load(Ordering::Acquire) {
                    Err(StoreError::Failed)
                } else {
                    apply(&t, &j.batch)
                }
            })
            .collect();
        let synced =
            t.db.flush()
                .map_err(StoreError::from)
                .and_then(|_| log.sync_data().map_err(|e| StoreError::Sync(e.to_string())));
        if results.iter().any(Result::is_err) || synced.is_err() {
            failed.store(true, Ordering::Release);
        }
        for (job, r) in jobs.into_iter().zip(results) {
            let r = match (&r, &synced) {
                (Ok(()), Err(e)) => Err(StoreError::Sync(e.to_string())),
                _ => r,
            };
            // The submitter may have given up waiting; nothing to tell then.
            let _ = job.done.send(r);
        }
    }
}

fn apply(t: &Trees, batch: &Batch) -> Result<(), StoreError> {
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
    let result = (&t.shares, &t.claims, &t.meta).transaction(|(s, c, m)| {
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
