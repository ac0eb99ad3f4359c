//! Least privilege between callers (I10), through the real binary and its socket: each
//! RPC needs a role (read-only, kubelet-plugin, admin), a caller has the roles its uid is
//! listed for, and a listed non-root uid can really connect: the socket is 0660 in a
//! directory of its own, both in `socket_group`. Callers run as other uids, so root
//! only; skips without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    fs,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::Path,
    process::{Command, Output},
};

use shareguard_tests::{Agent, Options, agent_bin, generic_device, net, proc_status};

const GROUP: u32 = 65534;
const READER: u32 = 65534;
const PLUGIN: u32 = 65533;
const NOBODY_LISTED: u32 = 65532;

/// The CLI as `uid` in group `gid`, from a copy every uid may run (the build's own
/// directory may not be reachable for other uids).
fn cli_as(a: &Agent, bin: &Path, uid: u32, gid: u32, args: &[&str]) -> Output {
    Command::new(bin)
        .arg("--socket")
        .arg(&a.socket)
        .args(args)
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap()
}

/// The roles config, the agent started through `setpriv` without CAP_CHOWN and with
/// `groups` (setpriv's group options).
fn roles_options(groups: &[&str]) -> Options {
    let mut o = Options::new(generic_device("gen-0", "10Gi", "1Gi", &["team-a"], &[]));
    o.own_socket_dir = true;
    o.agent_extra =
        format!("socket_group = {GROUP}\nreader_uids = [{READER}]\nplugin_uids = [{PLUGIN}]");
    o.run_through = ["setpriv", "--bounding-set=-chown", "--inh-caps=-chown"]
        .into_iter()
        .chain(groups.iter().copied())
        .map(str::to_owned)
        .collect();
    o
}

/// Without CAP_CHOWN and outside socket_group the agent cannot give its socket the
/// group: it stops at start and says what it needs, instead of serving a socket the
/// listed uids cannot reach.
#[test]
fn an_agent_outside_socket_group_says_so_at_start() {
    if !net::privileged("an_agent_outside_socket_group_says_so_at_start") {
        return;
    }
    let failed = std::panic::catch_unwind(|| Agent::start(roles_options(&["--clear-groups"])))
        .err()
        .expect("the agent started outside socket_group");
    let message = failed.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains(&format!("chgrp {GROUP}"))
            && message.contains(&format!("must be in socket_group {GROUP}")),
        "{message}"
    );
}

/// The socket's directory is tightened when it was there before the agent, as a
/// hostPath `DirectoryOrCreate` makes it (0755, root's), not only when the agent made
/// it; a directory that holds other files than sockets is shared and left as it is.
#[test]
fn a_socket_directory_made_before_the_agent_is_tightened_a_shared_one_left() {
    if !net::privileged("a_socket_directory_made_before_the_agent_is_tightened_a_shared_one_left") {
        return;
    }
    let mut a = Agent::start(roles_options(&["--groups", &GROUP.to_string()]));
    let dir = a.socket.parent().unwrap().to_owned();
    let meta = |p: &Path| {
        let m = fs::metadata(p).unwrap();
        (m.mode() & 0o777, m.uid(), m.gid())
    };
    assert_eq!(meta(&dir), (0o750, 0, GROUP), "made by the agent");

    // As the kubelet leaves a hostPath it made: the next start tightens it.
    std::os::unix::fs::chown(&dir, Some(0), Some(0)).unwrap();
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    a.restart();
    assert_eq!(meta(&dir), (0o750, 0, GROUP), "there before the agent");

    // Shared with other files: not the socket's own, left alone.
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(dir.join("notes.txt"), "someone else's").unwrap();
    a.restart();
    assert_eq!(meta(&dir), (0o755, 0, GROUP), "a shared directory");
    let sock = fs::metadata(&a.socket).unwrap();
    assert_eq!((sock.mode() & 0o777, sock.gid()), (0o660, GROUP));
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn each_rpc_needs_its_role_and_listed_uids_can_connect() {
    if !net::privileged("each_rpc_needs_its_role_and_listed_uids_can_connect") {
        return;
    }
    // As the DaemonSet runs it: without CAP_CHOWN, in the socket's group.
    let a = Agent::start(roles_options(&["--groups", &GROUP.to_string()]));
    let cap_eff = u64::from_str_radix(&proc_status(a.pid(), "CapEff"), 16).unwrap();
    assert_eq!(cap_eff & 1, 0, "the agent holds CAP_CHOWN: {cap_eff:x}");
    let bin = a.dir.path().join("shareguard");
    fs::copy(agent_bin(), &bin).unwrap();
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();

    let sock = fs::metadata(&a.socket).unwrap();
    assert_eq!(
        (sock.mode() & 0o777, sock.uid(), sock.gid()),
        (0o660, 0, GROUP)
    );
    let dir = fs::metadata(a.socket.parent().unwrap()).unwrap();
    assert_eq!(
        (dir.mode() & 0o777, dir.uid(), dir.gid()),
        (0o750, 0, GROUP)
    );

    // Read-only: the reads, nothing that changes anything.
    let o = cli_as(&a, &bin, READER, GROUP, &["devices"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("gen-0"));
    // The SLO figures and verdicts are a read too.
    let o = cli_as(&a, &bin, READER, GROUP, &["slo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("CLASS shareguard-accounted"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = cli_as(
        &a,
        &bin,
        READER,
        GROUP,
        &["release", "--epoch", "0", "some-claim"],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!(
            "caller uid {READER} has the read-only role; Unprepare needs kubelet-plugin"
        )),
        "{}",
        stderr(&o)
    );

    // The kubelet plugin's role: Unprepare (and Prepare, NewEpoch) too.
    let o = cli_as(
        &a,
        &bin,
        PLUGIN,
        GROUP,
        &["release", "--epoch", "0", "some-claim"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // A rollout stage is the node operators' (admin) alone, not the plugin's.
    let o = cli_as(&a, &bin, PLUGIN, GROUP, &["rollout", "gen-0", "observe"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!(
            "caller uid {PLUGIN} has the kubelet-plugin role; SetStage needs admin"
        )),
        "{}",
        stderr(&o)
    );

    // In the group but in no list: connects, is refused every call.
    let o = cli_as(&a, &bin, NOBODY_LISTED, GROUP, &["devices"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains(&format!(
            "caller uid {NOBODY_LISTED} is in none of allowed_uids, plugin_uids, reader_uids"
        )),
        "{}",
        stderr(&o)
    );
    // Listed, but not in the socket's group: cannot even reach the socket.
    let o = cli_as(&a, &bin, READER, 4242, &["devices"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("ermission denied"), "{}", stderr(&o));

    // Each refusal is audited with the caller's uid.
    let refused: Vec<_> = a
        .audit_lines()
        .into_iter()
        .filter(|l| l["decision"] == "refuse")
        .collect();
    assert!(
        refused
            .iter()
            .any(|l| l["caller_uid"] == READER
                && l["reason"].as_str().unwrap().starts_with("Unprepare")),
        "{refused:?}"
    );
}
