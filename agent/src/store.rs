//! Durable state in sled.
//!
//! Schema (one sled database under `<state_dir>/store`):
//!
//! | tree     | key                         | value                                   |
//! |----------|-----------------------------|-----------------------------------------|
//! | `shares` | share key (shareID, or `dedicated/<claim uid>/<device>`) | [`ShareRecord`], versioned |
//! | `claims` | claim uid                   | [`ClaimRecord`], versioned: only for a claim whose record carries what its shares do not (the CDI device ids of its spec) |
//! | `meta`   | `epoch`                     | u64 big-endian: highest epoch accepted  |
//! | `meta`   | `boot_id`                   | kernel boot id the live shares were verified under |
//! | `meta`   | `config`                    | JSON `{"digest", "devices"}`: the config the last start ran with (SHA-256 of its text, device names) |
//! | `meta`   | `stage/<device>`            | [`StageRecord`], versioned: the device's rollout stage as last set at runtime |
//! | `meta`   | `slo/<class>`               | [`crate::slo::persist::SloRecord`], versioned: the class's SLO window as last saved (periodically and at stop; not acknowledged to anyone) |
//! | `quarantine` | `<tree>/<key>`          | the bytes of a record this agent could not read, as found; never overwritten |
//!
//! A record that does not decode (a newer agent's format, a damaged value) does not stop
//! the agent: [`Store::load`] skips it and reports it, and the first start that meets it
//! copies it into `quarantine`, so whatever later happens to its key, the original stays.
//!
//! Values are encoded by [`crate::record`] (format byte + JSON). Released shares stay in
//! `shares` as tombstones (phase RELEASED) until the retention period ends.
//!
//! The claims' index (which shares a claim has, under which allocation) is rebuilt from
//! the share records at load ([`index_claims`]); the engine keeps it in memory. Storing
//! it for every claim made a Prepare of one share write two trees in one transaction,
//! which sled logs as a manifest and the batch, each synced on its own, where one key
//! is one plain insert. An index record an earlier version wrote for a claim without
//! CDI ids still loads and goes when its claim is next written; share records written
//! since are format 2, which an agent that expects the index for every claim does not
//! read (see [`crate::record::FORMAT_V2`]).
//!
//! Every change that must go together (a claim's shares, a phase change of all shares
//! of a claim, the epoch) is one [`Batch`], applied as one plain write when it is one
//! key and otherwise in one multi-tree transaction, and nothing is acknowledged before
//! its [`Durable`] handle resolved.
//!
//! All writes go through one writer thread, in the order they were submitted (which is
//! the order the engine decided them in, under its state lock). The thread applies every
//! batch that is waiting, then makes them durable together: sled's flush (which only
//! does `sync_file_range`) followed by an `fdatasync` of sled's log file, so the disk's
//! write cache and the file size are on stable storage too. One group, one sync: this is
//! what keeps a durable Prepare close to the cost of one fsync under load. It also keeps
//! sled's own flush off the async runtime, where concurrent `flush_async` calls can
//! deadlock sled 0.34's thread pool. When one batch of a group fails, the batches after
//! it are not applied and fail too: they were decided on a state that included it.
//!
//! Values stay below [`record::MAX_RECORD_BYTES`]: sled writes larger ones to blob files
//! that its flush does not fsync, so such a write is refused instead.

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

use crate::record::{self, ClaimRecord, ShareRecord};
use crate::rollout::StageRecord;

const EPOCH_KEY: &[u8] = b"epoch";
const BOOT_ID_KEY: &[u8] = b"boot_id";
const CONFIG_KEY: &[u8] = b"config";
const STAGE_PREFIX: &str = "stage/";
const SLO_PREFIX: &str = "slo/";

pub use crate::error::StoreError;

/// Writes that must land together.
#[derive(Default, Debug)]
pub struct Batch {
    pub put_shares: Vec<ShareRecord>,
    pub delete_shares: Vec<String>,
    pub put_claims: Vec<ClaimRecord>,
    pub delete_claims: Vec<String>,
    pub epoch: Option<u64>,
    pub boot_id: Option<String>,
    /// `<tree>/<key>` -> bytes, kept in `quarantine` unless an entry is already there.
    pub quarantine: Vec<(String, Vec<u8>)>,
    /// The config this start runs with (`meta/config`).
    pub config: Option<ConfigSeen>,
    /// Rollout stages set at runtime, by device (`meta/stage/<device>`).
    pub stages: Vec<(String, StageRecord)>,
    /// SLO windows by class, encoded and within the bound (`meta/slo/<class>`); None
    /// deletes the class's.
    pub slo: Vec<(String, Option<Vec<u8>>)>,
}

/// What the store remembers of a start's config, to audit the next start's changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfigSeen {
    /// SHA-256 of the config file's text, hex.
    pub digest: String,
    pub devices: Vec<String>,
}

impl Batch {
    /// Every value is within [`record::MAX_RECORD_BYTES`] (see the module comment).
    pub fn check_sizes(&self) -> Result<(), StoreError> {
        for r in &self.put_shares {
            bounded("shares", &r.key, record::encode_share(r))?;
        }
        for c in &self.put_claims {
            bounded("claims", &c.claim.uid, record::encode(c))?;
        }
        for (class, v) in self.slo.iter().filter_map(|(c, v)| Some((c, v.as_ref()?))) {
            bounded("meta", &format!("{SLO_PREFIX}{class}"), v.clone())?;
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.put_shares.is_empty()
            && self.delete_shares.is_empty()
            && self.put_claims.is_empty()
            && self.delete_claims.is_empty()
            && !self.writes_meta()
    }

    /// Whether it writes anything but shares and claims.
    fn writes_meta(&self) -> bool {
        self.epoch.is_some()
            || self.boot_id.is_some()
            || !self.quarantine.is_empty()
            || self.config.is_some()
            || !self.stages.is_empty()
            || !self.slo.is_empty()
    }
}

/// Everything the store holds, as read at start.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Boxed as they are decoded, to be moved into the agent's set of records as they
    /// are: decoded into a vector and boxed from there, 100,000 records were in memory
    /// twice at the peak of a start, which reached 260 MiB of RSS against 221 MiB boxed
    /// (docs/benchmarks.md).
    pub shares: Vec<Box<ShareRecord>>,
    /// Boxed for the same reason: one for every claim.
    pub claims: Vec<Box<ClaimRecord>>,
    pub epoch: u64,
    pub boot_id: Option<String>,
    /// Records that did not decode, left where they are.
    pub quarantined: Vec<Quarantined>,
    /// Rollout stages set at runtime, by device.
    pub stages: std::collections::BTreeMap<String, StageRecord>,
    /// Saved SLO windows by class, as stored (decoded by [`crate::slo`]).
    pub slo: std::collections::BTreeMap<String, Vec<u8>>,
    /// Entries in the `quarantine` tree once this start's are added: every record ever
    /// quarantined, each once.
    pub quarantine_total: usize,
}

/// A stored record this agent cannot read.
#[derive(Debug, Clone)]
pub struct Quarantined {
    pub tree: &'static str,
    pub key: String,
    /// Why it does not decode.
    pub error: String,
    pub bytes: Vec<u8>,
}

impl Quarantined {
    /// Its key in the `quarantine` tree.
    pub fn name(&self) -> String {
        format!("{}/{}", self.tree, self.key)
    }
}

pub struct Store {
    trees: Trees,
    writer: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    failed: Arc<AtomicBool>,
    /// Why the store failed, for /readyz and the logs.
    problem: Arc<Mutex<Option<String>>>,
    /// Tests close it to hold writes back and see what waits for durability.
    #[cfg(test)]
    gate: Arc<Gate>,
}

#[derive(Clone)]
struct Trees {
    db: sled::Db,
    shares: sled::Tree,
    claims: sled::Tree,
    meta: sled::Tree,
    quarantine: sled::Tree,
}

struct Job {
    batch: Batch,
    done: oneshot::Sender<Result<(), StoreError>>,
}

/// Resolves once a submitted batch is durable (or the write failed).
pub struct Durable(oneshot::Receiver<Result<(), StoreError>>);

impl Durable {
    /// A handle that resolves as failed at once: for a write with no store to go to.
    pub fn failed() -> Durable {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Err(StoreError::Failed));
        Durable(rx)
    }

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
            quarantine: db.open_tree("quarantine")?,
            db,
        };
        let failed = Arc::new(AtomicBool::new(false));
        let problem = Arc::new(Mutex::new(None));
        let gate = Arc::new(Gate::default());
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = {
            let trees = trees.clone();
            let failed = Failure {
                flag: failed.clone(),
                problem: problem.clone(),
            };
            let gate = gate.clone();
            std::thread::Builder::new()
                .name("shareguard-store".into())
                .spawn(move || writer(trees, log, rx, failed, &gate))
                .map_err(|e| StoreError::Sync(format!("cannot start the writer thread: {e}")))?
        };
        Ok(Self {
            trees,
            writer: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            failed,
            problem,
            #[cfg(test)]
            gate,
        })
    }

    /// Marks the store failed, as a write that could not be made durable does.
    #[cfg(test)]
    pub(crate) fn fail_for_test(&self, why: &str) {
        Failure {
            flag: self.failed.clone(),
            problem: self.problem.clone(),
        }
        .set(&StoreError::Sync(why.to_owned()));
    }

    /// Holds every write back (queued, not applied, not durable) until the guard drops.
    #[cfg(test)]
    pub(crate) fn hold(&self) -> Held {
        *crate::sync::lock(&self.gate.closed) = true;
        Held(self.gate.clone())
    }

    /// [`Store::open`], waiting up to `patience` for the directory's lock: sled releases
    /// it from its own threads a moment after the last handle of the previous instance
    /// in this process is dropped.
    pub fn open_patiently(dir: &Path, patience: std::time::Duration) -> Result<Self, StoreError> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            match Store::open(dir) {
                Err(StoreError::Sled(e))
                    if e.to_string().contains("could not acquire lock")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => return other,
            }
        }
    }

    /// Why the store stopped accepting writes, once it has.
    pub fn problem(&self) -> Option<String> {
        if !self.has_failed() {
            return None;
        }
        Some(
            crate::sync::lock(&self.problem)
                .clone()
                .unwrap_or_else(|| "a write failed".to_owned()),
        )
    }

    /// The config the last start recorded; None before any did (or if its value does
    /// not read, which only means the next change is audited as a first start).
    pub fn config_seen(&self) -> Result<Option<ConfigSeen>, StoreError> {
        Ok(self
            .trees
            .meta
            .get(CONFIG_KEY)?
            .and_then(|v| serde_json::from_slice(&v).ok()))
    }

    pub fn load(&self) -> Result<Loaded, StoreError> {
        let t = &self.trees;
        let mut out = Loaded::default();
        let (shares, mut bad) = load_tree(&t.shares, "shares")?;
        out.shares = shares;
        out.quarantined.append(&mut bad);
        let (claims, mut bad) = load_tree::<ClaimRecord>(&t.claims, "claims")?;
        out.claims = index_claims(&out.shares, claims);
        out.quarantined.append(&mut bad);
        let new = out
            .quarantined
            .iter()
            .map(|q| t.quarantine.contains_key(q.name().as_bytes()))
            .collect::<Result<Vec<bool>, _>>()?
            .into_iter()
            .filter(|kept| !kept)
            .count();
        out.quarantine_total = t.quarantine.len() + new;
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
        for item in t.meta.scan_prefix(STAGE_PREFIX.as_bytes()) {
            let (k, v) = item?;
            let device = String::from_utf8_lossy(&k[STAGE_PREFIX.len()..]).into_owned();
            match record::decode::<StageRecord>(&v) {
                Ok(r) => {
                    out.stages.insert(device, r);
                }
                // The config's stage applies then; the operator's is named in the log.
                Err(e) => {
                    tracing::error!(%device, error = %e, "the device's stored rollout stage does not read; the config's applies");
                }
            }
        }
        for item in t.meta.scan_prefix(SLO_PREFIX.as_bytes()) {
            let (k, v) = item?;
            let class = String::from_utf8_lossy(&k[SLO_PREFIX.len()..]).into_owned();
            out.slo.insert(class, v.to_vec());
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
            if !self.failed.swap(true, Ordering::AcqRel) {
                *crate::sync::lock(&self.problem) =
                    Some("the store's writer thread is gone".into());
            }
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

/// The store's failed flag and the reason it was set.
struct Failure {
    flag: Arc<AtomicBool>,
    problem: Arc<Mutex<Option<String>>>,
}

impl Failure {
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    fn set(&self, why: &StoreError) {
        if !self.flag.swap(true, Ordering::AcqRel) {
            *crate::sync::lock(&self.problem) = Some(why.to_string());
            tracing::error!(error = %why, "the state store failed; no change is accepted until it is reopened");
        }
    }
}

/// Applies one group of batches in order. Once one fails, the rest are not applied
/// and fail too, and so does every later group (`failed`): the engine decided them on a
/// state that included the failed batch, and only a reload from disk makes the two
/// agree again.
fn apply_group(t: &Trees, batches: &[&Batch], failed: &Failure) -> Vec<Result<(), StoreError>> {
    batches
        .iter()
        .map(|b| {
            if failed.is_set() {
                return Err(StoreError::Failed);
            }
            let r = apply(t, b).map(|_| ());
            if let Err(e) = &r {
                failed.set(e);
            }
            r
        })
        .collect()
}

/// The writer thread: applies queued batches in order and makes each group durable.
/// Lets writes through unless a test closed it.
#[derive(Default)]
pub(crate) struct Gate {
    closed: Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gate {
    fn pass(&self) {
        let mut closed = crate::sync::lock(&self.closed);
        while *closed {
            closed = self.opened.wait(closed).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Writes are held back while this lives (see [`Store::hold`]).
#[cfg(test)]
pub(crate) struct Held(Arc<Gate>);

#[cfg(test)]
impl Drop for Held {
    fn drop(&mut self) {
        *crate::sync::lock(&self.0.closed) = false;
        self.0.opened.notify_all();
    }
}

fn writer(t: Trees, log: File, rx: mpsc::Receiver<Job>, failed: Failure, gate: &Gate) {
    while let Ok(first) = rx.recv() {
        gate.pass();
        let mut jobs = vec![first];
        jobs.extend(rx.try_iter());
        let batches: Vec<&Batch> = jobs.iter().map(|j| &j.batch).collect();
        let results = apply_group(&t, &batches, &failed);
        let synced =
            t.db.flush()
                .map_err(StoreError::from)
                .and_then(|_| log.sync_data().map_err(|e| StoreError::Sync(e.to_string())));
        if let Err(e) = &synced {
            failed.set(e);
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

/// How [`apply`] wrote a batch.
#[derive(Debug, PartialEq, Eq)]
enum Written {
    Nothing,
    OneKey,
    Transaction,
}

fn apply(t: &Trees, batch: &Batch) -> Result<Written, StoreError> {
    if batch.is_empty() {
        return Ok(Written::Nothing);
    }
    // Encode outside the transaction: sled may run the closure more than once.
    let shares: Vec<(&[u8], Vec<u8>)> = batch
        .put_shares
        .iter()
        .map(|r| bounded("shares", &r.key, record::encode_share(r)).map(|v| (r.key.as_bytes(), v)))
        .collect::<Result<_, _>>()?;
    // A claim's record is written only when it carries CDI ids; otherwise one that is
    // there (an earlier version's, or one whose ids are gone) is removed. The writer is
    // the store's only one, so what it reads here stays true until it writes.
    let mut claims: Vec<(&[u8], Option<Vec<u8>>)> = Vec::new();
    for c in &batch.put_claims {
        let key = c.claim.uid.as_bytes();
        if !c.cdi_device_ids.is_empty() {
            claims.push((
                key,
                Some(bounded("claims", &c.claim.uid, record::encode(c))?),
            ));
        } else if t.claims.contains_key(key)? {
            claims.push((key, None));
        }
    }
    for k in &batch.delete_claims {
        if t.claims.contains_key(k.as_bytes())? {
            claims.push((k.as_bytes(), None));
        }
    }
    if claims.is_empty() && !batch.writes_meta() {
        // One share: a plain write of one key, which sled logs without a manifest.
        match (shares.as_slice(), batch.delete_shares.as_slice()) {
            ([(k, v)], []) => {
                t.shares.insert(*k, v.as_slice())?;
                return Ok(Written::OneKey);
            }
            ([], [k]) => {
                t.shares.remove(k.as_bytes())?;
                return Ok(Written::OneKey);
            }
            _ => {}
        }
    }
    let config = batch
        .config
        .as_ref()
        .map(|c| serde_json::to_vec(c).map_err(|_| StoreError::Meta("config")))
        .transpose()?;
    let stages: Vec<(String, Vec<u8>)> = batch
        .stages
        .iter()
        .map(|(d, r)| (format!("{STAGE_PREFIX}{d}"), record::encode(r)))
        .collect();
    let slo: Vec<(String, Option<Vec<u8>>)> = batch
        .slo
        .iter()
        .map(|(c, v)| {
            let key = format!("{SLO_PREFIX}{c}");
            match v {
                Some(v) => bounded("meta", &key, v.clone()).map(|v| (key, Some(v))),
                None => Ok((key, None)),
            }
        })
        .collect::<Result<_, _>>()?;
    let result = (&t.shares, &t.claims, &t.meta, &t.quarantine).transaction(|(s, c, m, q)| {
        for (k, v) in &shares {
            s.insert(*k, v.as_slice())?;
        }
        for k in &batch.delete_shares {
            s.remove(k.as_bytes())?;
        }
        for (k, v) in &claims {
            match v {
                Some(v) => c.insert(*k, v.as_slice())?,
                None => c.remove(*k)?,
            };
        }
        if let Some(e) = batch.epoch {
            m.insert(EPOCH_KEY, &e.to_be_bytes())?;
        }
        if let Some(b) = &batch.boot_id {
            m.insert(BOOT_ID_KEY, b.as_bytes())?;
        }
        if let Some(c) = &config {
            m.insert(CONFIG_KEY, c.as_slice())?;
        }
        for (k, v) in &stages {
            m.insert(k.as_bytes(), v.as_slice())?;
        }
        for (k, v) in &slo {
            match v {
                Some(v) => m.insert(k.as_bytes(), v.as_slice())?,
                None => m.remove(k.as_bytes())?,
            };
        }
        for (k, v) in &batch.quarantine {
            if q.get(k.as_bytes())?.is_none() {
                q.insert(k.as_bytes(), v.as_slice())?;
            }
        }
        Ok::<(), ConflictableTransactionError<()>>(())
    });
    match result {
        Ok(()) => Ok(Written::Transaction),
        Err(TransactionError::Storage(e)) => Err(StoreError::Sled(e)),
        // The closure never aborts; sled retries conflicts internally.
        Err(TransactionError::Abort(())) => Err(StoreError::Meta("transaction aborted")),
    }
}

/// The claims' index, from the shares (see the module comment): for each claim its
/// shares, oldest first (then by key), under the allocation of its newest one, and what
/// a stored record of it adds: its CDI ids, when it names the same allocation, and keys
/// of shares it lists that did not load (unreadable ones, which recovery puts back
/// under the claim). A stored record of a claim without a share that loaded is kept as
/// it is.
// Boxed: each is moved into the agent's set as it is (see [`Loaded`]).
#[allow(clippy::vec_box)]
fn index_claims(
    shares: &[Box<ShareRecord>],
    stored: Vec<Box<ClaimRecord>>,
) -> Vec<Box<ClaimRecord>> {
    use std::collections::{HashMap, HashSet, hash_map::Entry};
    // Nearly every claim has one share: grouped in one pass, and only a claim with
    // several sorts them (oldest first, then by key).
    let mut out: Vec<Box<ClaimRecord>> = Vec::with_capacity(shares.len() + stored.len());
    let mut at: HashMap<&str, usize> = HashMap::with_capacity(shares.len());
    let mut several = false;
    for r in shares {
        match at.entry(r.claim.uid.as_str()) {
            Entry::Occupied(e) => {
                out[*e.get()].share_keys.push(r.key.clone());
                several = true;
            }
            Entry::Vacant(e) => {
                e.insert(out.len());
                out.push(Box::new(ClaimRecord {
                    claim: r.claim.clone(),
                    allocation_id: r.allocation_id.clone(),
                    share_keys: smallvec::smallvec![r.key.clone()],
                    cdi_device_ids: Box::default(),
                    updated_at_ms: r.updated_at_ms,
                }));
            }
        }
    }
    if several {
        let by_key: HashMap<&str, &ShareRecord> =
            shares.iter().map(|r| (r.key.as_str(), &**r)).collect();
        for c in out.iter_mut().filter(|c| c.share_keys.len() > 1) {
            let mut rs: Vec<&ShareRecord> = c
                .share_keys
                .iter()
                .filter_map(|k| by_key.get(k.as_str()).copied())
                .collect();
            rs.sort_by(|a, b| (a.created_at_ms, &a.key).cmp(&(b.created_at_ms, &b.key)));
            if let Some(newest) = rs.last() {
                c.allocation_id = newest.allocation_id.clone();
            }
            c.updated_at_ms = rs.iter().map(|r| r.updated_at_ms).max().unwrap_or(0);
            c.share_keys = rs.iter().map(|r| r.key.clone()).collect();
        }
    }
    if stored.is_empty() {
        return out;
    }
    let loaded: HashSet<&str> = shares.iter().map(|r| r.key.as_str()).collect();
    for s in stored {
        let Some(&i) = at.get(s.claim.uid.as_str()) else {
            // sled's keys are unique: no second stored record of this claim follows.
            out.push(s);
            continue;
        };
        let c = &mut out[i];
        if c.allocation_id == s.allocation_id {
            c.cdi_device_ids = s.cdi_device_ids;
        }
        for k in s.share_keys {
            if !loaded.contains(k.as_str()) && !c.share_keys.contains(&k) {
                c.share_keys.push(k);
            }
        }
    }
    out
}

/// `value`, unless it is over [`record::MAX_RECORD_BYTES`].
fn bounded(tree: &'static str, key: &str, value: Vec<u8>) -> Result<Vec<u8>, StoreError> {
    if value.len() > record::MAX_RECORD_BYTES {
        return Err(StoreError::TooLarge {
            tree,
            key: key.to_owned(),
            bytes: value.len(),
            max: record::MAX_RECORD_BYTES,
        });
    }
    Ok(value)
}

/// Every record of `tree`, in key order, and those that do not decode. Decoding costs
/// about as much as sled's reading, so with many records one thread reads while a
/// second decodes what was read (a start with 100,000 records spends most of its time
/// here); without a second thread, this one does both.
fn load_tree<T: for<'de> serde::Deserialize<'de> + Send>(
    tree: &sled::Tree,
    name: &'static str,
) -> Result<(Vec<Box<T>>, Vec<Quarantined>), StoreError> {
    const CHUNK: usize = 256;
    let decode_all = |chunks: &mut dyn Iterator<Item = Vec<(sled::IVec, sled::IVec)>>| {
        let mut ok = Vec::new();
        let mut bad = Vec::new();
        for (k, v) in chunks.flatten() {
            match decode::<T>(name, &k, &v) {
                Ok(r) => ok.push(Box::new(r)),
                Err(e) => bad.push(unreadable(name, &k, &v, e)),
            }
        }
        (ok, bad)
    };
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<Vec<(sled::IVec, sled::IVec)>>(8);
        let decoder = std::thread::Builder::new()
            .name("shareguard-load".into())
            .spawn_scoped(scope, move || decode_all(&mut rx.into_iter()));
        let mut inline = Vec::new();
        let mut chunk = Vec::with_capacity(CHUNK);
        for item in tree.iter() {
            chunk.push(item?);
            if chunk.len() == CHUNK {
                let full = std::mem::replace(&mut chunk, Vec::with_capacity(CHUNK));
                if decoder.is_ok() {
                    // Refused only by a decoder that panicked, which the join raises.
                    let _ = tx.send(full);
                } else {
                    inline.push(full);
                }
            }
        }
        inline.push(chunk);
        drop(tx);
        let (mut ok, mut bad) = match decoder {
            // A panic there is one that decoding here would have raised.
            Ok(d) => d.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            Err(_) => (Vec::new(), Vec::new()),
        };
        let (more_ok, more_bad) = decode_all(&mut inline.into_iter());
        ok.extend(more_ok);
        bad.extend(more_bad);
        Ok((ok, bad))
    })
}

fn unreadable(tree: &'static str, key: &[u8], value: &[u8], e: StoreError) -> Quarantined {
    let error = match e {
        StoreError::Decode { source, .. } => source.to_string(),
        other => other.to_string(),
    };
    Quarantined {
        tree,
        key: String::from_utf8_lossy(key).into_owned(),
        error,
        bytes: value.to_vec(),
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

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
