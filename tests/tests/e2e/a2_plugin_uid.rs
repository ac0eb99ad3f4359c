use super::*;

/// a2. The kubelet plugin runs as the DaemonSet says, which every other scenario
/// relies on working: on each node its process has the manifest's uid and group (not
/// root), no capability and no way to gain one, and its registration socket, which
/// kubelet found, is its own, in a directory of its own inside kubelet's.
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn a2_the_kubelet_plugin_runs_as_its_own_uid_with_no_capability() {
    let c = Cluster::from_env();
    let ds = c.json(&[
        "get",
        "daemonset",
        "-n",
        "shareguard-system",
        "shareguard-kubelet-plugin",
    ]);
    let sc = &field(&ds, "spec.template.spec.containers")[0]["securityContext"];
    let (uid, gid) = (sc["runAsUser"].as_u64(), sc["runAsGroup"].as_u64());
    let (Some(uid), Some(gid)) = (uid, gid) else {
        panic!("no runAsUser/runAsGroup: {sc}")
    };
    assert_ne!(uid, 0, "{sc}");
    for node in NODES {
        let name = c.shareguard_pod(node, "kubelet-plugin");
        let pod = c.json(&["get", "pod", "-n", "shareguard-system", &name]);
        let pod_uid = field(&pod, "metadata.uid")
            .as_str()
            .unwrap_or_default()
            .to_owned();
        // The plugin's process on this machine: the nodes share its process table.
        let pid = std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
                args.contains(&b"kubelet-plugin".as_slice())
                    && args
                        .windows(2)
                        .any(|w| w[0] == b"--instance-id" && w[1] == pod_uid.as_bytes())
            })
            .unwrap_or_else(|| panic!("no process of {name} ({pod_uid})"));
        let line = |key: &str| shareguard_tests::proc_status(pid, key);
        assert_eq!(line("Uid"), format!("{uid} {uid} {uid} {uid}"), "{name}");
        assert_eq!(line("Gid"), format!("{gid} {gid} {gid} {gid}"), "{name}");
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(line(set), "0000000000000000", "{name}: {set}");
        }
        assert_eq!(line("NoNewPrivs"), "1", "{name}");

        let reg = std::path::PathBuf::from(format!(
            "/proc/{pid}/root/var/lib/kubelet/plugins_registry/{DRIVER}/reg-{pod_uid}.sock"
        ));
        let meta = |p: &std::path::Path| {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::symlink_metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (u64::from(m.uid()), m.mode() & 0o7777)
        };
        assert_eq!(meta(&reg).0, uid, "{}", reg.display());
        assert_eq!(meta(reg.parent().unwrap()), (uid, 0o750), "{name}");
    }
}
