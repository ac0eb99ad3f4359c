use super::{device::percent_of_mbit, *};

const GOOD: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"
allowed_uids = [0]

[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "generic"
allowed_namespaces = ["team-a", "team-b"]
[device.capacity.memory]
value = "40Gi"
default = "5Gi"
valid_range = { min = "5Gi", max = "40Gi", step = "5Gi" }
"#;

#[test]
fn parses_the_documented_example() {
    let c = Config::parse(GOOD, "t.toml").unwrap();
    assert_eq!(c.agent.allowed_uids, vec![0]);
    assert_eq!(c.agent.socket_group, None);
    assert_eq!(c.agent.audit_log, PathBuf::from("/tmp/state/audit.jsonl"));
    assert_eq!(c.agent.audit_bound, crate::audit::Bound::default());
    let d = c.device("gen-0").unwrap();
    assert_eq!(
        d.capacities["memory"].value,
        Quantity::parse("40Gi").unwrap()
    );
    assert!(d.allows_namespace("team-a"));
    assert!(!d.allows_namespace("team-c"));
}

/// Roles: a non-root uid in any list needs the socket's group to connect at all.
#[test]
fn a_listed_uid_that_could_never_connect_is_an_error() {
    for key in ["allowed_uids", "plugin_uids", "reader_uids"] {
        let text = GOOD.replace("allowed_uids = [0]", &format!("{key} = [0, 1000]"));
        let e = err_of(&text);
        assert_eq!(e.line, 5, "{e}");
        assert!(
            e.message
                .contains(&format!("agent.{key}: uid 1000 could never connect")),
            "{e}"
        );
        let ok = Config::parse(
            &text.replacen("[agent]\n", "[agent]\nsocket_group = 1000\n", 1),
            "ok.toml",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(ok.agent.socket_group, Some(1000));
    }
}

/// Metrics name tenants: on an address other hosts reach, only with a token.
#[test]
fn metrics_beyond_loopback_need_a_token() {
    let open = GOOD.replace("[agent]\n", "[agent]\nmetrics_addr = \"0.0.0.0:9464\"\n");
    let e = err_of(&open);
    assert_eq!(e.line, 3, "{e}");
    assert!(e.message.contains("set metrics_token_file"), "{e}");
    let with_token = open.replace(
        "[agent]\n",
        "[agent]\nmetrics_token_file = \"/etc/t\"\nhealth_addr = \"0.0.0.0:9465\"\n",
    );
    let c = Config::parse(&with_token, "ok.toml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.agent.health_addr, Some("0.0.0.0:9465".parse().unwrap()));
    // Client certificates authenticate too; TLS for the server alone does not.
    let tls = |ca: &str| {
        open.replace(
            "[agent]\n",
            &format!("[agent]\nmetrics_tls = {{ cert_file = \"/c\", key_file = \"/k\"{ca} }}\n"),
        )
    };
    let c = Config::parse(&tls(", client_ca_file = \"/ca\""), "ok.toml")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        c.agent.metrics_tls.and_then(|t| t.client_ca_file),
        Some(PathBuf::from("/ca"))
    );
    assert!(err_of(&tls("")).message.contains("client_ca_file"));
    assert!(
        err_of(&tls(", ca = \"/x\""))
            .message
            .contains("unknown field"),
        "{}",
        err_of(&tls(", ca = \"/x\""))
    );
    let bad = GOOD.replace("[agent]\n", "[agent]\nhealth_addr = \"nowhere\"\n");
    assert!(
        err_of(&bad).message.contains("agent.health_addr"),
        "{}",
        err_of(&bad)
    );
}

fn err_of(text: &str) -> ConfigError {
    Config::parse(text, "bad.toml").unwrap_err()
}

#[test]
fn errors_name_file_line_and_reason() {
    let e = err_of(&GOOD.replace("value = \"40Gi\"", "value = \"40Gx\""));
    assert_eq!(e.path, "bad.toml");
    assert_eq!(e.line, 14, "{e}");
    assert!(e.message.contains("memory.value"), "{e}");

    let e = err_of(&GOOD.replace("kind = \"generic\"", "kind = \"fpga\""));
    assert_eq!(e.line, 11, "{e}");
    assert!(e.message.contains("fpga"));

    let e = err_of(&GOOD.replace("default = \"5Gi\"", "default = \"6Gi\""));
    assert!(e.message.contains("default"), "{e}");

    let e = err_of(&GOOD.replace("socket =", "sockett ="));
    assert_eq!(e.line, 3, "{e}");
    assert!(e.message.contains("sockett"), "{e}");

    let e = err_of(&format!(
        "{GOOD}\n[[device]]\nname = \"gen-0\"\ndriver = \"d.example\"\npool = \"p\"\nkind = \"generic\"\n[device.capacity.x]\nvalue = \"1\"\n"
    ));
    assert!(e.message.contains("defined twice"), "{e}");

    let e = err_of(&GOOD.replace("kind = \"generic\"", "kind = \"net\""));
    assert!(e.message.contains("net device's capacities"), "{e}");
    let e = err_of(&GOOD.replace("kind = \"generic\"", "kind = \"gpu\""));
    assert!(
        e.message.contains("names its GPU with uuid or index"),
        "{e}"
    );
    let e = err_of(&GOOD.replace("value = \"40Gi\"\n", ""));
    assert!(e.message.contains("value is required"), "{e}");

    let e = err_of(&GOOD.replace(
        "kind = \"generic\"",
        "kind = \"generic\"\nstage = \"enforced\"",
    ));
    assert_eq!(e.line, 12, "{e}");
    assert!(
        e.message
            .contains("stage \"enforced\" is not \"observe\" or \"enforce\""),
        "{e}"
    );
}

#[test]
fn a_device_starts_in_the_stage_the_config_gives() {
    let c = Config::parse(GOOD, "good.toml").unwrap();
    assert_eq!(c.devices[0].stage, crate::rollout::Stage::Enforce);
    let c = Config::parse(
        &GOOD.replace(
            "kind = \"generic\"",
            "kind = \"generic\"\nstage = \"observe\"",
        ),
        "good.toml",
    )
    .unwrap();
    assert_eq!(c.devices[0].stage, crate::rollout::Stage::Observe);
}

#[test]
fn a_device_is_in_its_kinds_class_unless_it_names_one() {
    let c = Config::parse(GOOD, "good.toml").unwrap();
    assert_eq!(c.devices[0].class, "shareguard-accounted");
    let with = |class: &str| {
        GOOD.replace(
            "kind = \"generic\"",
            &format!("kind = \"generic\"\nclass = \"{class}\""),
        )
    };
    let c = Config::parse(&with("gpu-a100.example.com"), "good.toml").unwrap();
    assert_eq!(c.devices[0].class, "gpu-a100.example.com");
    for bad in ["", "Upper", "-lead", "trail-", "a..b", "under_score"] {
        let e = err_of(&with(bad));
        assert_eq!(e.line, 12, "{bad:?}: {e}");
        assert!(e.message.contains("class"), "{bad:?}: {e}");
    }
    assert!(err_of(&with(&"a".repeat(254))).message.contains("1 to 253"));
}

#[test]
fn the_audit_bound_takes_bytes_or_a_quantity_and_refuses_zero() {
    let with = |extra: &str| GOOD.replace("allowed_uids", &format!("{extra}\nallowed_uids"));
    let c = Config::parse(&with("audit_max_bytes = \"1Mi\"\naudit_keep = 2"), "t").unwrap();
    assert_eq!(
        c.agent.audit_bound,
        crate::audit::Bound {
            max_bytes: 1 << 20,
            keep: 2
        }
    );
    let c = Config::parse(&with("audit_max_bytes = 4096"), "t").unwrap();
    assert_eq!(c.agent.audit_bound.max_bytes, 4096);
    assert_eq!(c.agent.audit_bound.keep, crate::audit::DEFAULT_KEEP);

    for (bad, says) in [
        ("audit_max_bytes = 0", "at least 1 byte"),
        ("audit_max_bytes = -5", "at least 1 byte"),
        ("audit_max_bytes = \"lots\"", "not a quantity"),
        ("audit_keep = 0", "at least 1"),
    ] {
        let e = err_of(&with(bad));
        assert_eq!(e.line, 5, "{bad}: {e}");
        assert!(e.message.contains(says), "{bad}: {e}");
    }
}

const GPU: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"
cdi_dir = "/tmp/cdi"

[[device]]
name = "gpu-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "gpu"
backend = "simulated"
watchdog = { period = "200ms", action = "terminate", grace = "2s" }
[device.simulated]
memory = "80Gi"
[device.capacity.memory]
default = "10Gi"
valid_range = { min = "1Gi", step = "1Gi" }
"#;

#[test]
fn a_simulated_gpu_takes_its_memory_and_names_itself() {
    use shareguard_limiter_gpu::{limiter::GpuSelector, watchdog::Action};
    let c = Config::parse(GPU, "t.toml").unwrap();
    assert_eq!(c.agent.cdi_dir, PathBuf::from("/tmp/cdi"));
    let d = c.device("gpu-0").unwrap();
    assert_eq!(
        d.capacities["memory"].value,
        Quantity::parse("80Gi").unwrap()
    );
    let g = d.gpu.as_ref().unwrap();
    assert_eq!(
        g.backend,
        crate::config::gpu::GpuBackendKind::Simulated {
            memory_bytes: 80 << 30,
            cgroup_limits: true,
            mps: true,
            pci_bus_id: None,
            count: 1,
        }
    );
    assert_eq!(g.selector, GpuSelector::Uuid("GPU-simulated-gpu-0".into()));
    assert!(!g.discover_memory);
    assert_eq!(g.watchdog.period, Duration::from_millis(200));
    assert_eq!(
        g.watchdog.action,
        Action::Terminate {
            grace: Duration::from_secs(2)
        }
    );
}

#[test]
fn mps_settings_are_read_and_the_directory_checked() {
    let c = Config::parse(GPU, "t.toml").unwrap();
    assert_eq!(
        c.agent.mps,
        shareguard_limiter_gpu::mps::MpsConfig::default()
    );
    let text = GPU
        .replace(
            "cdi_dir = \"/tmp/cdi\"",
            "cdi_dir = \"/tmp/cdi\"\nmps_control = \"/opt/nv/mps-control\"\nmps_dir = \"/run/sg-mps\"",
        )
        .replace("memory = \"80Gi\"", "memory = \"80Gi\"\ncgroup_limits = false");
    let c = Config::parse(&text, "t.toml").unwrap();
    assert_eq!(c.agent.mps.control, PathBuf::from("/opt/nv/mps-control"));
    assert_eq!(c.agent.mps.dir, PathBuf::from("/run/sg-mps"));
    assert!(
        c.agent.mps.launcher.is_empty(),
        "started directly unless told"
    );
    let text = GPU.replace(
        "cdi_dir = \"/tmp/cdi\"",
        "cdi_dir = \"/tmp/cdi\"\nmps_launcher = [\"systemd-run\", \"--unit=sg-{name}\", \"--\"]",
    );
    let l = Config::parse(&text, "t.toml").unwrap();
    assert_eq!(
        l.agent.mps.launcher,
        ["systemd-run", "--unit=sg-{name}", "--"]
    );
    let sized = Config::parse(
        &GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            "cdi_dir = \"/tmp/cdi\"\nmps_shm_size = \"128Mi\"",
        ),
        "t",
    )
    .unwrap();
    assert_eq!(sized.agent.mps.shm_bytes, 128 << 20);
    for bad in ["0", "1500Ki", "lots"] {
        let e = err_of(&GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            &format!("cdi_dir = \"/tmp/cdi\"\nmps_shm_size = \"{bad}\""),
        ));
        assert!(e.message.contains("agent.mps_shm_size"), "{bad}: {e}");
    }
    let e = err_of(&GPU.replace(
        "cdi_dir = \"/tmp/cdi\"",
        "cdi_dir = \"/tmp/cdi\"\nmps_launcher = [\"\"]",
    ));
    assert!(e.message.contains("agent.mps_launcher"), "{e}");
    assert!(matches!(
        c.device("gpu-0").unwrap().gpu.as_ref().unwrap().backend,
        crate::config::gpu::GpuBackendKind::Simulated {
            cgroup_limits: false,
            mps: true,
            ..
        }
    ));
    for bad in ["", "a/b", "..", ".hidden", "with space"] {
        let e = err_of(&GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            &format!("cdi_dir = \"/tmp/cdi\"\nmps_cgroup = \"{bad}\""),
        ));
        assert!(e.message.contains("agent.mps_cgroup"), "{bad}: {e}");
        assert!(e.message.contains("one cgroup name"), "{bad}: {e}");
    }
    let named = Config::parse(
        &GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            "cdi_dir = \"/tmp/cdi\"\nmps_cgroup = \"tenants-mps\"",
        ),
        "t.toml",
    )
    .unwrap();
    assert_eq!(named.agent.mps.cgroup, "tenants-mps");
    for bad in [
        "relative/mps",
        "/run/a-directory-name-far-too-long-for-sockets",
    ] {
        let e = err_of(&GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            &format!("cdi_dir = \"/tmp/cdi\"\nmps_dir = \"{bad}\""),
        ));
        assert_eq!(e.line, 6, "{bad}: {e}");
        assert!(e.message.contains("agent.mps_dir"), "{bad}: {e}");
        assert!(e.message.contains("at most 40 bytes"), "{bad}: {e}");
    }
}

#[test]
fn an_nvml_gpu_without_a_memory_value_discovers_it() {
    let text = GPU
        .replace("backend = \"simulated\"", "backend = \"nvml\"\nindex = 0")
        .replace("[device.simulated]\nmemory = \"80Gi\"\n", "");
    let c = Config::parse(&text, "t.toml").unwrap();
    let d = c.device("gpu-0").unwrap();
    assert!(d.gpu.as_ref().unwrap().discover_memory);
    assert!(d.capacities["memory"].value.is_zero(), "filled in at start");
}

#[test]
fn gpu_fields_are_checked() {
    let e = err_of(&GPU.replace("\"simulated\"\nwatchdog", "\"cuda\"\nwatchdog"));
    assert!(
        e.message
            .contains("backend \"cuda\" is not one of nvml, simulated"),
        "{e}"
    );
    let e = err_of(&GPU.replace("action = \"terminate\"", "action = \"kill\""));
    assert!(e.message.contains("watchdog.action \"kill\""), "{e}");
    let e = err_of(&GPU.replace("action = \"terminate\", ", ""));
    assert!(e.message.contains("grace is only for action"), "{e}");
    let e = err_of(&GPU.replace("period = \"200ms\"", "period = \"1ms\""));
    assert!(e.message.contains("at least 10ms"), "{e}");
    let e = err_of(&GPU.replace(
        "backend = \"simulated\"",
        "backend = \"simulated\"\nuuid = \"GPU-1\"\nindex = 1",
    ));
    assert!(e.message.contains("uuid or index, not both"), "{e}");
    // The simulated back end has a GPU per device, under its uuid: an index named none
    // and the device silently had no GPU.
    let e = err_of(&GPU.replace(
        "backend = \"simulated\"",
        "backend = \"simulated\"\nindex = 0",
    ));
    assert!(e.message.contains("simulated GPU is named by uuid"), "{e}");
    assert_eq!(e.line, 13, "{e}");
    let e = err_of(&GPU.replace("[device.simulated]\nmemory = \"80Gi\"\n", ""));
    assert!(e.message.contains("needs [device.simulated]"), "{e}");
    let e = err_of(&GPU.replace(
        "[device.capacity.memory]",
        "[device.capacity.bandwidth]\nvalue = \"1G\"\n[device.capacity.memory]",
    ));
    assert!(e.message.contains("only capacity is memory"), "{e}");
    let e = err_of(&GOOD.replace(
        "kind = \"generic\"",
        "kind = \"generic\"\nbackend = \"nvml\"",
    ));
    assert!(
        e.message.contains("backend is only for kind \"gpu\""),
        "{e}"
    );
}

#[test]
fn a_gpus_driver_root_is_slash_for_nvml_none_for_simulated_and_must_be_plain() {
    let root_of = |text: &str| {
        Config::parse(text, "t.toml")
            .unwrap()
            .device("gpu-0")
            .unwrap()
            .gpu
            .clone()
            .unwrap()
            .driver_root
    };
    let nvml = GPU
        .replace("backend = \"simulated\"", "backend = \"nvml\"\nindex = 0")
        .replace("[device.simulated]\nmemory = \"80Gi\"\n", "");
    assert_eq!(root_of(&nvml), Some(PathBuf::from("/")));
    assert_eq!(root_of(GPU), None, "a simulated GPU has none unless given");
    let operator = "backend = \"simulated\"\ndriver_root = \"/run/nvidia/driver\"";
    assert_eq!(
        root_of(&GPU.replace("backend = \"simulated\"", operator)),
        Some(PathBuf::from("/run/nvidia/driver"))
    );
    for bad in ["run/nvidia/driver", "/run/../etc", ""] {
        let e = err_of(&GPU.replace(
            "backend = \"simulated\"",
            &format!("backend = \"simulated\"\ndriver_root = \"{bad}\""),
        ));
        assert!(e.message.contains("driver_root"), "{bad}: {e}");
        assert!(e.message.contains("absolute path"), "{bad}: {e}");
        assert_eq!(e.line, 13, "{bad}: {e}");
    }
    let both = GPU.replace(
        "backend = \"simulated\"",
        "backend = \"simulated\"\ndriver_root = \"/run/nvidia/driver\"\ncontainer_driver_root = \"/driver-root\"",
    );
    let c = Config::parse(&both, "t.toml").unwrap();
    assert_eq!(
        c.device("gpu-0")
            .unwrap()
            .gpu
            .as_ref()
            .unwrap()
            .container_driver_root,
        Some(PathBuf::from("/driver-root"))
    );
    let e = err_of(&GPU.replace(
        "backend = \"simulated\"",
        "backend = \"simulated\"\ncontainer_driver_root = \"/driver-root\"",
    ));
    assert!(
        e.message
            .contains("container_driver_root needs a driver_root"),
        "{e}"
    );
    let e = err_of(&both.replace("\"/driver-root\"", "\"driver-root\""));
    assert!(
        e.message.contains("container_driver_root \"driver-root\""),
        "{e}"
    );
    let e = err_of(&GOOD.replace(
        "kind = \"generic\"",
        "kind = \"generic\"\ndriver_root = \"/\"",
    ));
    assert!(
        e.message.contains("driver_root is only for kind \"gpu\""),
        "{e}"
    );
}

#[test]
fn tombstones_are_capped_by_count_and_the_cap_is_at_least_one() {
    assert_eq!(
        Config::parse(GOOD, "t.toml").unwrap().agent.tombstone_max,
        10_000
    );
    let set = GOOD.replace("[agent]\n", "[agent]\ntombstone_max = 3\n");
    assert_eq!(
        Config::parse(&set, "t.toml").unwrap().agent.tombstone_max,
        3
    );
    let e = err_of(&GOOD.replace("[agent]\n", "[agent]\ntombstone_max = 0\n"));
    assert!(e.message.contains("agent.tombstone_max"), "{e}");
    assert_eq!(e.line, 3, "{e}");
}

/// Found while fuzzing the config (fuzz/corpus/config/humantime-carry-overflow.toml):
/// humantime panicked on this duration, and took `Config::parse` down with it.
#[test]
fn a_duration_that_overflows_is_an_error_not_a_panic() {
    let overflow = "18446744073709551615s 1000000000ns";
    let e = err_of(&format!("[agent]\ntombstone_retention = \"{overflow}\"\n"));
    assert_eq!(e.line, 2, "{e}");
    assert!(e.message.contains("agent.tombstone_retention"), "{e}");
    assert!(e.message.contains("too large"), "{e}");
    let e = err_of(&GPU.replace("grace = \"2s\"", &format!("grace = \"{overflow}\"")));
    assert!(e.message.contains("watchdog.grace"), "{e}");
    assert!(e.message.contains("too large"), "{e}");
}

const NET: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"

[[device]]
name = "nic-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "net"
mechanism = "bpf-policer"
[device.capacity.bandwidth]
value = "10G"
"#;

/// `interface = "auto"` is the NIC of the node's default route, found when the config
/// is read, with the link speed and the hardware check as for a named interface; where
/// the node has none, the config is refused naming the device and the field.
#[test]
fn an_auto_interface_is_the_nic_of_the_default_route() {
    let text = NET.replace("kind = \"net\"", "kind = \"net\"\ninterface = \"auto\"");
    match shareguard_limiter_net::link::default_route_interface(std::path::Path::new("/proc/net")) {
        Ok(nic) => {
            let c = Config::parse(&text, "t.toml").unwrap();
            let got = c.devices[0].net.as_ref().unwrap().interface.clone();
            assert_eq!(got.as_deref(), Some(nic.as_str()));
            assert_ne!(got.as_deref(), Some("auto"));
            // The same NIC named twice, once as auto: refused as any two devices for one NIC.
            let twice = format!(
                "{text}\n[[device]]\nname = \"nic-1\"\ndriver = \"shareguard.example.com\"\npool = \"node-a\"\nkind = \"net\"\ninterface = \"{nic}\"\n[device.capacity.bandwidth]\nvalue = \"1G\"\n"
            );
            let e = err_of(&twice);
            assert!(e.message.contains("names the same interface"), "{e}");
        }
        Err(why) => {
            let e = err_of(&text);
            assert!(
                e.message.contains("device nic-0: interface \"auto\"") && e.message.contains(&why),
                "{e}"
            );
        }
    }
}

#[test]
fn two_devices_for_one_gpu_or_one_nic_are_refused() {
    let second = |first: &str, extra: &str| {
        let dup = first
            .replace("name = \"gpu-0\"", "name = \"gpu-1\"")
            .replace("name = \"nic-0\"", "name = \"nic-1\"");
        let body = dup.split_once("[[device]]").unwrap().1;
        format!("{first}\n[[device]]{}{extra}", body)
    };
    let nvml = GPU
        .replace("backend = \"simulated\"", "backend = \"nvml\"\nindex = 0")
        .replace("[device.simulated]\nmemory = \"80Gi\"\n", "");
    let e = err_of(&second(&nvml, ""));
    assert!(e.message.contains("same GPU as device gpu-0"), "{e}");
    let by_uuid = GPU.replace(
        "backend = \"simulated\"",
        "backend = \"nvml\"\nuuid = \"GPU-1\"",
    );
    let e = err_of(&second(
        &by_uuid.replace("[device.simulated]\nmemory = \"80Gi\"\n", ""),
        "",
    ));
    assert!(e.message.contains("same GPU"), "{e}");
    let nic = NET.replace("kind = \"net\"", "kind = \"net\"\ninterface = \"eth9\"");
    let e = err_of(&second(&nic, ""));
    assert!(e.message.contains("same interface as device nic-0"), "{e}");
    // Simulated GPUs are one per device, named after it: two devices are two GPUs.
    assert!(Config::parse(&second(GPU, ""), "t").is_ok());
}

#[test]
fn a_net_device_may_name_its_mechanism() {
    let c = Config::parse(NET, "t.toml").unwrap();
    assert_eq!(
        c.device("nic-0")
            .unwrap()
            .net
            .clone()
            .unwrap_or_default()
            .mechanism,
        Some(shareguard_limiter_net::Mechanism::BpfPolicer)
    );
    let c = Config::parse(&NET.replace("bpf-policer", "auto"), "t.toml").unwrap();
    assert_eq!(
        c.device("nic-0")
            .unwrap()
            .net
            .clone()
            .unwrap_or_default()
            .mechanism,
        None
    );
    let c = Config::parse(&NET.replace("mechanism = \"bpf-policer\"\n", ""), "t.toml").unwrap();
    assert_eq!(
        c.device("nic-0")
            .unwrap()
            .net
            .clone()
            .unwrap_or_default()
            .mechanism,
        None
    );

    let e = err_of(&NET.replace("bpf-policer", "tbf"));
    assert_eq!(e.line, 11, "{e}");
    assert!(
        e.message
            .contains("\"tbf\" is not one of auto, edt-fq, htb-ebpf, bpf-policer"),
        "{e}"
    );
    let e = err_of(&GOOD.replace(
        "kind = \"generic\"",
        "kind = \"generic\"\nmechanism = \"edt-fq\"",
    ));
    assert!(e.message.contains("only for kind \"net\""), "{e}");
}

#[test]
fn a_net_device_may_state_its_line_rate() {
    let with = |rate: &str| {
        NET.replace(
            "kind = \"net\"",
            &format!("kind = \"net\"\nline_rate = \"{rate}\""),
        )
    };
    let c = Config::parse(&with("25G"), "t.toml").unwrap();
    assert_eq!(
        c.device("nic-0")
            .unwrap()
            .net
            .clone()
            .unwrap_or_default()
            .line_rate_bps,
        Some(25_000_000_000)
    );
    let c = Config::parse(NET, "t.toml").unwrap();
    assert_eq!(
        c.device("nic-0")
            .unwrap()
            .net
            .clone()
            .unwrap_or_default()
            .line_rate_bps,
        None,
        "unset: all shaped"
    );
    for (bad, why) in [
        ("0", "must be positive"),
        ("-1G", "must be positive"),
        ("1500m", "not a whole number"),
        ("20E", "above 2^64-1"),
        ("fast", "line_rate"),
    ] {
        let e = err_of(&with(bad));
        assert_eq!(e.line, 11, "{bad}: {e}");
        assert!(e.message.contains("device nic-0: line_rate"), "{bad}: {e}");
        assert!(e.message.contains(why), "{bad}: {e}");
    }
    let e = err_of(&GOOD.replace(
        "kind = \"generic\"",
        "kind = \"generic\"\nline_rate = \"10G\"",
    ));
    assert!(
        e.message.contains("line_rate is only for kind \"net\""),
        "{e}"
    );
}

#[test]
fn a_percentage_of_the_link_speed_is_exact() {
    for (mbit, percent, want) in [
        (10_000, 10, "1G"),
        (10_000, 100, "10G"),
        (25_000, 33, "8250M"),
        (1_000, 1, "10M"),
        (100, 7, "7M"),
        (400_000, 50, "200G"),
    ] {
        assert_eq!(
            percent_of_mbit(mbit, percent).map(|q| q.to_string()),
            Some(want.to_owned()),
            "{percent}% of {mbit} Mbit/s"
        );
    }
    assert_eq!(percent_of_mbit(i128::MAX / 1000, 100), None, "overflow");
}

#[test]
fn link_percent_is_refused_where_it_cannot_apply() {
    // Each is refused before a link is read, so no interface here has to exist.
    let net = |iface: &str, cap: &str| {
        NET.replace("kind = \"net\"", &format!("kind = \"net\"{iface}"))
            .replace("value = \"10G\"\n", cap)
    };
    for (text, line, why) in [
        (
            net("\ninterface = \"eth0\"", "link_percent = 0\n"),
            14,
            "0 is not a whole percentage from 1 to 100",
        ),
        (
            net("\ninterface = \"eth0\"", "link_percent = 101\n"),
            14,
            "101 is not a whole percentage",
        ),
        (
            net("\ninterface = \"eth0\"", "link_percent = -5\n"),
            14,
            "-5 is not a whole percentage",
        ),
        (
            net(
                "\ninterface = \"eth0\"",
                "value = \"10G\"\nlink_percent = 10\n",
            ),
            15,
            "value is set too",
        ),
        (
            net("", "link_percent = 10\n"),
            13,
            "needs the device's interface",
        ),
        (
            GOOD.replace("value = \"40Gi\"", "link_percent = 10"),
            0,
            "only for kind \"net\"",
        ),
    ] {
        let e = err_of(&text);
        assert!(
            e.message.contains("capacity ") && e.message.contains(".link_percent: "),
            "the error names the field: {e}\n{text}"
        );
        assert!(e.message.contains(why), "{e}\n{text}");
        if line > 0 {
            assert_eq!(e.line, line, "{e}\n{text}");
        }
    }
    // A link the machine lacks: the speed is read and its absence said.
    let e = err_of(&net("\ninterface = \"sg-none0\"", "link_percent = 10\n"));
    assert!(
        e.message
            .contains("/sys/class/net/sg-none0/speed cannot be read"),
        "{e}"
    );
}

#[test]
fn kubelets_directory_is_absolute_or_off() {
    let c = Config::parse(GPU, "t.toml").unwrap();
    assert_eq!(c.agent.kubelet_dir, Some(PathBuf::from("/var/lib/kubelet")));
    let with = |line: &str| {
        GPU.replace(
            "cdi_dir = \"/tmp/cdi\"",
            &format!("cdi_dir = \"/tmp/cdi\"\n{line}"),
        )
    };
    let c = Config::parse(&with("kubelet_dir = \"/srv/kubelet\""), "t.toml").unwrap();
    assert_eq!(c.agent.kubelet_dir, Some(PathBuf::from("/srv/kubelet")));
    let c = Config::parse(&with("kubelet_dir = \"\""), "t.toml").unwrap();
    assert_eq!(c.agent.kubelet_dir, None, "\"\" reads no checkpoint");
    let e = err_of(&with("kubelet_dir = \"var/lib/kubelet\""));
    assert_eq!(e.line, 6, "{e}");
    assert!(e.message.contains("agent.kubelet_dir"), "{e}");
    assert!(e.message.contains("not an absolute path"), "{e}");
}
