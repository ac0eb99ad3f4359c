//! What a durable write costs in sled, the way the agent's store makes one, beside the
//! ways it could: the part of a Prepare that is the store's, measured without the agent.
//!
//! In one sled database with the store's trees and `STORE_SYNC_LIVE` records (default
//! 10,000; values of the sizes a share's and a claim's JSON have), interleaved, each
//! `STORE_SYNC_SAMPLES` times (default 2,000):
//! - the store's write today: one transaction over its four trees inserting a share and
//!   its claim, sled's flush, an `fdatasync` of sled's log;
//! - one plain insert of a value holding both, the same flush and `fdatasync`;
//! - the same insert and flush without the `fdatasync` (sled's `sync_file_range` alone,
//!   which does not flush the disk's write cache: not durable);
//! - the yardstick of the agent bench: append 4 KiB to a file and `fsync` it.
//!
//! Prints markdown for docs/benchmarks.md; asserts nothing about speed. Run:
//! `cargo bench -p shareguard-tests --bench store_sync` (any user; the database is made
//! under the temporary directory, on the disk the agent's store would use when its state
//! directory is there too).

#![allow(clippy::unwrap_used)] // A benchmark that cannot set up has nothing to report.

use std::{
    fs::{File, OpenOptions},
    io::Write,
    time::{Duration, Instant},
};

use shareguard_tests::{env_or, net, net::TrafficLock};
use sled::transaction::{ConflictableTransactionError, Transactional};

/// About a live share's and its claim's stored JSON (docs/benchmarks.md, memory).
const SHARE_BYTES: usize = 740;
const CLAIM_BYTES: usize = 300;

fn row(what: &str, v: &[Duration], yardstick: (f64, f64)) {
    let (p50, p99) = p50_p99(v);
    println!(
        "| {what} | {} | {p50:.3} | {p99:.3} | {:.2}x | {:.2}x |",
        v.len(),
        p50 / yardstick.0,
        p99 / yardstick.1
    );
}

fn p50_p99(v: &[Duration]) -> (f64, f64) {
    let ms: Vec<f64> = v.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    (net::percentile(&ms, 50.0), net::percentile(&ms, 99.0))
}

fn main() {
    let live = env_or::<usize>("STORE_SYNC_LIVE", 10_000);
    let samples = env_or::<usize>("STORE_SYNC_SAMPLES", 2_000);
    assert!(samples > 0, "STORE_SYNC_SAMPLES is 0");
    let dir = tempfile::Builder::new()
        .prefix("sg-store-sync-")
        .tempdir()
        .unwrap();
    // As the store opens it (agent/src/store.rs): no background flush.
    let db = sled::Config::new()
        .path(dir.path().join("store"))
        .flush_every_ms(None)
        .open()
        .unwrap();
    let log = File::open(dir.path().join("store").join("db")).unwrap();
    let [shares, claims, meta, quarantine] =
        ["shares", "claims", "meta", "quarantine"].map(|t| db.open_tree(t).unwrap());
    let share = vec![b's'; SHARE_BYTES];
    let claim = vec![b'c'; CLAIM_BYTES];
    let both = vec![b'b'; SHARE_BYTES + CLAIM_BYTES];
    for i in 0..live {
        shares
            .insert(format!("live-{i:08}"), share.clone())
            .unwrap();
        claims
            .insert(format!("live-{i:08}"), claim.clone())
            .unwrap();
    }
    db.flush().unwrap();
    log.sync_data().unwrap();
    let mut bare = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.path().join("fsync.dat"))
        .unwrap();
    let block = [0xa5u8; 4096];

    let _lock = TrafficLock::acquire();
    let (mut txn, mut one, mut unsynced, mut fsync) = (vec![], vec![], vec![], vec![]);
    for i in 0..samples {
        let key = format!("new-{i:08}");
        let t = Instant::now();
        (&shares, &claims, &meta, &quarantine)
            .transaction(|(s, c, _, _)| {
                s.insert(key.as_bytes(), share.clone())?;
                c.insert(key.as_bytes(), claim.clone())?;
                Ok::<(), ConflictableTransactionError<()>>(())
            })
            .unwrap();
        db.flush().unwrap();
        log.sync_data().unwrap();
        txn.push(t.elapsed());

        let t = Instant::now();
        shares.insert(format!("one-{i:08}"), both.clone()).unwrap();
        db.flush().unwrap();
        log.sync_data().unwrap();
        one.push(t.elapsed());

        let t = Instant::now();
        shares
            .insert(format!("unsynced-{i:08}"), both.clone())
            .unwrap();
        db.flush().unwrap();
        unsynced.push(t.elapsed());

        let t = Instant::now();
        bare.write_all(&block).unwrap();
        bare.sync_all().unwrap();
        fsync.push(t.elapsed());
    }

    let yardstick = p50_p99(&fsync);
    println!("### A durable write in sled, {live} records live (ms)\n");
    println!("| write | samples | p50 | p99 | p50 / fsync p50 | p99 / fsync p99 |");
    println!("|---|---:|---:|---:|---:|---:|");
    row(
        "the store's: transaction over its 4 trees (a share and its claim), flush, fdatasync",
        &txn,
        yardstick,
    );
    row(
        "one insert of both in one value, flush, fdatasync",
        &one,
        yardstick,
    );
    row(
        "one insert, flush only (not durable: the disk's cache is not flushed)",
        &unsynced,
        yardstick,
    );
    row("bare: append 4 KiB, fsync", &fsync, yardstick);
}
