//! Privilege and tools, and running commands: what every harness module needs of the
//! machine it runs on.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

/// Whether the effective uid is 0 (read from /proc, no libc needed).
pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

/// Whether `CI=true` is set: privileged tests must then run, not skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Call first in a test that needs root: returns `true` when it may run. Without root it
/// prints why it skips and returns `false`, or panics when `CI=true`. Missing tools fail
/// the test with the package to install (they are never a reason to skip).
pub fn privileged(test: &str) -> bool {
    if !is_root() {
        assert!(
            !in_ci(),
            "{test}: needs root (network namespaces, veth, tc); CI=true, so this fails instead of skipping"
        );
        eprintln!(
            "SKIP {test}: needs root for network namespaces, veth and tc (run the tests as root; with CI=true this is a failure)"
        );
        return false;
    }
    require_tools();
    true
}

/// Panics naming the Debian package for any missing tool.
pub fn require_tools() {
    for (tool, package) in [
        ("ip", "iproute2"),
        ("tc", "iproute2"),
        ("iperf3", "iperf3"),
        ("ping", "iputils-ping"),
    ] {
        assert!(
            on_path(tool),
            "`{tool}` not found: install it (`apt-get install -y {package}`; scripts/lib.sh does this for the tests)"
        );
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
}

/// Runs `args` and returns its standard output; panics with the command and its
/// standard error if it fails.
pub fn sh(args: &[&str]) -> String {
    match try_sh(args) {
        Ok(out) => out,
        Err(e) => panic!("{e}"),
    }
}

/// Runs `args`: its standard output, or an error naming the command and its stderr.
pub fn try_sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("`{}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Cleanup: runs `args`, ignoring failure (the thing may already be gone).
pub(crate) fn quiet(args: &[&str]) {
    let _ = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Polls `cond` every 10 ms until it holds; panics with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a network interface of that name exists in the root namespace.
pub fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Names listed by `ip netns list`.
pub fn netns_list() -> Vec<String> {
    sh(&["ip", "netns", "list"])
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}
