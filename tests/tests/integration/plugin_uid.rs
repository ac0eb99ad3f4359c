//! The kubelet plugin as the DaemonSet runs it: its own uid and group, no capability,
//! no root (I10). `shareguard kubelet-plugin-dirs` (as root, before it) gives the plugin
//! a registration directory inside kubelet's root-owned one and its DRA socket
//! directory; the plugin registers from there, calls the agent with the kubelet-plugin
//! role through the socket's group, prepares a claim, and removes its sockets when it
//! stops. Runs processes as other uids, so root only; skips without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt, symlink},
    path::Path,
    process::{Command, Output},
    time::Duration,
};

use shareguard_tests::{
    Agent, DRIVER, Options, agent_bin,
    apiserver::ApiServer,
    generic_device, get_share,
    k8s::{self, claim, pod, result},
    kubelet::prepare_v1,
    net::{self, wait_for},
    plugin::Plugin,
    proc_status, share_id,
};

const NODE: &str = "node-a";
const NS: &str = "team-a";
/// The plugin's uid and the socket's group: neither root nor a group root is in.
const UID: u32 = 65531;
const GID: u32 = 65530;
const WAIT: Duration = Duration::from_secs(20);

fn owner_mode(p: &Path) -> (u32, u32, u32) {
    let m = fs::symlink_metadata(p).unwrap();
    (m.uid(), m.gid(), m.mode() & 0o7777)
}

#[tokio::test]
async fn the_plugin_serves_kubelet_as_its_own_uid_with_no_capability() {
    if !net::privileged("the_plugin_serves_kubelet_as_its_own_uid_with_no_capability") {
        return;
    }
    let mut o = Options::new(generic_device("mem-0", "8Gi", "1Gi", &[NS], &[]));
    o.own_socket_dir = true;
    o.agent_extra = format!("socket_group = {GID}\nplugin_uids = [{UID}]");
    let agent = Agent::start(o);
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));

    let (mut p, dirs_said) = Plugin::start_as(&agent, &api, NODE, &[DRIVER], "i-1", (UID, GID));
    let pid = p.pid().unwrap();
    assert_eq!(proc_status(pid, "Uid"), format!("{UID} {UID} {UID} {UID}"));
    assert_eq!(proc_status(pid, "Gid"), format!("{GID} {GID} {GID} {GID}"));
    assert_eq!(proc_status(pid, "Groups"), "", "no supplementary group");
    for set in ["CapEff", "CapPrm"] {
        assert_eq!(proc_status(pid, set), "0000000000000000", "{set}");
    }

    // The directories kubelet-plugin-dirs made: the plugin's, 0750, inside root's.
    let reg_dir = p.kubelet.registry_dir.join(DRIVER);
    let dra_dir = p.kubelet.plugins_dir.join(DRIVER);
    for d in [&reg_dir, &dra_dir] {
        assert_eq!(owner_mode(d), (UID, GID, 0o750), "{}", d.display());
        assert!(dirs_said.contains(&d.display().to_string()), "{dirs_said}");
    }
    assert_eq!(
        owner_mode(reg_dir.parent().unwrap()).0,
        0,
        "kubelet's own stays root's"
    );

    // kubelet (root) finds the socket in the subdirectory and registers the driver.
    let reg = p.registration_socket(DRIVER);
    assert_eq!(reg.parent(), Some(reg_dir.as_path()));
    assert_eq!(owner_mode(&reg).0, UID);
    let info = p.kubelet.register_at(&reg, Ok(())).await;
    assert_eq!(info.endpoint, p.endpoint(DRIVER));
    // Ready needs the agent's epoch (NewEpoch, a kubelet-plugin call) and the
    // registration: both done as UID.
    wait_for("the plugin ready", WAIT, || p.readyz().0 == 200);

    // A claim prepared through it reaches the agent.
    let pod_uid = share_id();
    api.put(&pod(NS, "p1", &pod_uid, NODE));
    let (uid, share) = (share_id(), share_id());
    api.put(&claim(
        NS,
        "c1",
        &uid,
        Some(vec![result(
            "mem",
            DRIVER,
            shareguard_tests::POOL,
            "mem-0",
            Some(&share),
            &[("memory", "2Gi")],
        )]),
        &[("p1", &pod_uid)],
    ));
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid).await;
    assert_eq!(r.error, "", "{r:?}");
    let s = get_share(&mut agent.client().await, share.clone()).await;
    assert_eq!(s.claim.unwrap().uid, uid);

    // A stop removes both sockets: the plugin owns the directories they are in.
    let status = p.terminate();
    assert!(status.success(), "{status}\n{}", p.log_text());
    assert!(!reg.exists(), "registration socket left behind");
    assert!(
        !Path::new(&p.endpoint(DRIVER)).exists(),
        "DRA socket left behind"
    );
}

fn dirs(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .arg("kubelet-plugin-dirs")
        .args(args)
        .output()
        .unwrap()
}

/// What `kubelet-plugin-dirs` refuses, naming the path and the reason, and leaving it
/// as it was: a symlink (it would hand over whatever the link points to), something
/// that is not a directory, a directory whose parent is missing, root as the owner.
#[test]
fn plugin_dirs_refuses_links_files_and_root() {
    if !net::privileged("plugin_dirs_refuses_links_files_and_root") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let target = t.path().join("target");
    fs::create_dir(&target).unwrap();
    fs::set_permissions(&target, fs::Permissions::from_mode(0o700)).unwrap();
    let link = t.path().join("link");
    symlink(&target, &link).unwrap();
    let file = t.path().join("file");
    fs::write(&file, "").unwrap();
    let orphan = t.path().join("missing").join("dir");
    let owner = format!("{UID}:{GID}");

    for (path, says) in [
        (&link, "is a symlink"),
        (&file, "not a directory"),
        (&orphan, "parent is missing"),
    ] {
        let o = dirs(&["--owner", &owner, path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{}: {err}", path.display());
        assert!(
            err.contains(&path.display().to_string()) && err.contains(says),
            "{}: {err}",
            path.display()
        );
    }
    assert_eq!(
        owner_mode(&target),
        (0, 0, 0o700),
        "the link's target untouched"
    );
    assert_eq!(owner_mode(&file).0, 0);
    assert!(!orphan.parent().unwrap().exists());

    let o = dirs(&["--owner", "0:0", target.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&o.stderr).contains("uid 0"));
    assert_eq!(owner_mode(&target), (0, 0, 0o700));

    // As the DaemonSet's init container runs it, root with CAP_CHOWN and CAP_FOWNER
    // only, at every start of the pod: the second run finds the directories the
    // plugin's already (0750, which root without CAP_DAC_READ_SEARCH may not read),
    // changes nothing and succeeds; a mode changed meanwhile is put back.
    let made = t.path().join("made");
    for round in 0..3 {
        if round == 2 {
            fs::set_permissions(&made, fs::Permissions::from_mode(0o777)).unwrap();
        }
        let o = Command::new("setpriv")
            .args(["--bounding-set=-all,+chown,+fowner", "--inh-caps=-all"])
            .arg(agent_bin())
            .args([
                "kubelet-plugin-dirs",
                "--owner",
                &owner,
                made.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "round {round}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(owner_mode(&made), (UID, GID, 0o750), "round {round}");
    }
}
