//! Root checks for tests that need real privileges (a mount namespace for the MPS
//! daemons, cgroups for the watchdog's system tests). Also included by
//! `tests/support/cgroups.rs` and the watchdog bench, so there is one copy.

/// Whether this process runs as root: the effective uid, the second field of the
/// `Uid:` line of `/proc/self/status` (no libc call, so no unsafe).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

/// True when the test can run. Without root it prints why it is skipped, except under
/// `CI=true`, where skipping would hide that the test never ran: then it panics.
/// `needs` says what root is for.
pub fn require_root_for(test: &str, needs: &str) -> bool {
    if is_root() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test} needs root ({needs}) and CI=true: CI must run it as root");
    }
    eprintln!("SKIPPED {test}: needs root ({needs})");
    false
}

/// [`require_root_for`] the MPS daemons' mount namespace.
#[allow(dead_code)] // Only the unit tests use this one.
pub fn require_root(test: &str) -> bool {
    require_root_for(test, "a mount namespace")
}
