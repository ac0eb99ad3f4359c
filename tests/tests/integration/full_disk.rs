//! A full disk under the state directory. Prepare answers a retryable Unavailable and
//! acknowledges nothing; the agent stays up and /readyz says why; once the disk can be
//! written again it works without a restart, and everything it did acknowledge is still
//! there after one. The state directory is a small tmpfs of the test's own, filled with
//! a file. (A file system remounted read-only fails the same writes the same way; Linux
//! refuses to remount one read-only while the agent holds its files open for writing,
//! so that case is not staged here.) Root only; skips without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use shareguard_tests::{
    Agent, Client, Options, PHASE_TIMEOUT, alloc, claim, device, generic_device, net, prepare_one,
    proto as pb, share_id,
};

/// A tmpfs of `size`, unmounted (lazily, so a busy file cannot keep it) when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        net::sh(&[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            &format!("size={size},mode=0700"),
            "tmpfs",
            at.to_str().unwrap(),
        ]);
        Tmpfs(at.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .args(["-l", self.0.to_str().unwrap()])
            .status();
    }
}

/// Writes `path` until the file system says it is full; returns how much it took.
fn fill(path: &Path) -> u64 {
    let mut f = fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 64 * 1024];
    let mut n = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    n
}

fn gen_claim(uid: &str, amount: &str) -> (pb::ClaimPrepare, String) {
    let id = share_id();
    (
        claim(uid, "team-a", "a1", vec![alloc("gen-0", &id, amount)]),
        id,
    )
}

/// Waits for /readyz to answer `code`; returns its body.
fn wait_ready(a: &Agent, code: u16) -> String {
    let deadline = Instant::now() + PHASE_TIMEOUT;
    loop {
        let (got, body) = a.http("/readyz");
        if got == code {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz not {code} within {PHASE_TIMEOUT:?}: {got} {body}\n{}",
            a.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Prepares claims `<prefix>-0`, `-1`, ... until one is refused (at most `most`);
/// returns those acknowledged and the refused one with its error.
async fn prepare_until_refused(
    c: &mut Client,
    prefix: &str,
    most: usize,
) -> (Vec<String>, (pb::ClaimPrepare, pb::Error)) {
    let mut acked = Vec::new();
    for i in 0..most {
        let (cl, id) = gen_claim(&format!("{prefix}-{i}"), "1Mi");
        let r = prepare_one(c, 0, cl.clone()).await;
        match r.error {
            None => acked.push(id),
            Some(e) => return (acked, (cl, e)),
        }
    }
    panic!("{most} Prepares on a full disk were all acknowledged");
}

#[tokio::test]
async fn a_full_disk_acknowledges_nothing_and_recovers_without_a_restart() {
    if !net::privileged("a_full_disk_acknowledges_nothing_and_recovers_without_a_restart") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let tmpfs = Tmpfs::mount(&state, "16m");
    let mut o = Options::new(generic_device("gen-0", "100Gi", "1Mi", &["team-a"], &[]));
    o.state_dir = Some(state.clone());
    let mut a = Agent::start(o);
    let mut c = a.client().await;
    let (first, first_id) = gen_claim("before", "1Mi");
    assert_eq!(prepare_one(&mut c, 0, first).await.error, None);
    let mut acked = vec![first_id];

    // Full: a Prepare is refused as retryable, the agent stays up and says why.
    let filler = state.join("filler");
    assert!(fill(&filler) > 0);
    let (more, (refused, e)) = prepare_until_refused(&mut c, "full", 500).await;
    acked.extend(more);
    assert_eq!(e.code, "Unavailable", "{e:?}");
    assert!(e.retryable, "{e:?}");
    let body = wait_ready(&a, 503);
    assert!(body.contains("state store"), "{body}");
    assert!(
        Path::new(&format!("/proc/{}", a.pid())).exists(),
        "the agent stays up"
    );
    let (cl, _) = gen_claim("while-full", "1Mi");
    let r = prepare_one(&mut c, 0, cl).await;
    assert_eq!(r.error.map(|e| e.code).as_deref(), Some("Unavailable"));

    // Room again: it works without a restart, and the refused claim can be retried.
    fs::remove_file(&filler).unwrap();
    wait_ready(&a, 200);
    let r = prepare_one(&mut c, 0, refused.clone()).await;
    assert_eq!(r.error, None, "{r:?}");
    acked.push(refused.allocations[0].share_id.clone());

    // Everything acknowledged survives a crash, counted once.
    a.restart();
    let mut c = a.client().await;
    let live: Vec<String> = c
        .list_shares(pb::ListSharesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .shares
        .into_iter()
        .filter(|s| s.phase == pb::Phase::Accounted as i32)
        .map(|s| s.share_id)
        .collect();
    for id in &acked {
        assert!(live.contains(id), "acknowledged share {id} lost: {live:?}");
    }
    let held = device(&mut c, "gen-0").await.allocated["memory"].clone();
    let one = shareguard_common::Quantity::parse("1Mi").unwrap();
    assert_eq!(
        shareguard_common::Quantity::parse(&held).unwrap(),
        one.checked_mul(live.len() as i128).unwrap(),
        "every live share counted once ({} live)",
        live.len()
    );
    drop(a);
    drop(tmpfs);
}
