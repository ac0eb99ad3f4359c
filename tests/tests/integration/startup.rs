//! What the daemon does at start: refuses a bad config with file, line and reason; makes
//! its socket 0600; refuses to start a second agent on a socket that still answers.

use std::{os::unix::fs::PermissionsExt, process::Command};

use shareguard_tests::{Agent, Options, agent_bin, generic_device};

#[test]
fn bad_config_is_refused_with_file_line_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    let text = format!(
        "[agent]\nsocket = {:?}\nstate_dir = {:?}\nmetrics_addr = \"127.0.0.1:0\"\n{}",
        dir.path().join("s.sock"),
        dir.path().join("state"),
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
            .replace("value = \"40Gi\"", "value = \"40 Gi\"")
    );
    std::fs::write(&path, &text).unwrap();
    let line = text.lines().position(|l| l.contains("40 Gi")).unwrap() + 1;
    let out = Command::new(agent_bin())
        .args(["agent", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("{}:{line}:", path.display())),
        "stderr should name {}:{line}: {stderr}",
        path.display()
    );
    assert!(stderr.contains("memory.value"), "{stderr}");
    assert!(
        !dir.path().join("state").exists(),
        "nothing may start on a bad config"
    );
    assert!(!dir.path().join("s.sock").exists());
}

/// A `max_watchers` above what one agent can serve used to pass the config and panic
/// when the semaphore that bounds the streams was made: a config error now, at start.
#[test]
fn too_many_watchers_is_a_config_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("watchers.toml");
    let text = format!(
        "[agent]\nsocket = {:?}\nstate_dir = {:?}\nmetrics_addr = \"127.0.0.1:0\"\nmax_watchers = {}\n{}",
        dir.path().join("s.sock"),
        dir.path().join("state"),
        u64::MAX >> 1,
        generic_device("gen-0", "40Gi", "5Gi", &["team-a"], &[])
    );
    std::fs::write(&path, &text).unwrap();
    let out = Command::new(agent_bin())
        .args(["agent", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:5:", path.display())) && stderr.contains("max_watchers"),
        "{stderr}"
    );
    assert!(!dir.path().join("s.sock").exists());
}

#[test]
fn socket_is_private_and_a_second_agent_is_refused() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    let mode = std::fs::metadata(&a.socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");

    // A second agent on the same config would share the store and the socket. It
    // stops at the state directory's lock, before the limiters or the store, naming the
    // agent that holds it.
    let out = Command::new(agent_bin())
        .args(["agent", "--config"])
        .arg(&a.config)
        .output()
        .unwrap();
    assert!(!out.status.success(), "a second agent must not start");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("another shareguard agent (pid {})", a.pid()))
            && stderr.contains("agent.lock"),
        "the refusal should say why: {stderr}"
    );
    // The first agent still answers.
    assert_eq!(a.http("/readyz").0, 200);
}
