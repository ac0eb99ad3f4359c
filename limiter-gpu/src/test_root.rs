//! For unit tests that need root (MPS daemons start in a mount namespace of their own).

/// True when the test can run. Without root it prints why it is skipped, except under
/// `CI=true`, where skipping would hide that the test never ran: then it panics.
pub fn require_root(test: &str) -> bool {
    let root = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false);
    if root {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test} needs root (a mount namespace) and CI=true: CI must run it as root");
    }
    eprintln!("SKIPPED {test}: needs root (a mount namespace)");
    false
}
