use serde_json::json;

use super::*;
use shareguard_common::limiter::{CdiDeviceNode, CdiMount, MpsDirs};

const SHARE: &str = "3f2b8c1e-9d4a-4b7e-8f0a-1c2d3e4f5a6b";
const CLAIM: &str = "7a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
const GPU: &str = "GPU-5e1d4a2b-0c3f-4d5e-8a9b-7c6d5e4f3a2b";

fn writer(dir: &Path) -> CdiWriter {
    CdiWriter::new(CdiConfig {
        dir: dir.to_path_buf(),
        ..CdiConfig::default()
    })
    .unwrap()
}

fn share(device: &str, share_id: &str, mps: Option<&str>) -> CdiShare {
    CdiShare {
        share_id: share_id.into(),
        device: device.into(),
        gpu_uuid: GPU.into(),
        mps: mps.map(|d| MpsDirs {
            pipe: PathBuf::from(d).join("pipe"),
            shm: PathBuf::from(d).join("shm"),
        }),
        device_nodes: Vec::new(),
        mounts: Vec::new(),
    }
}

fn read(path: &Path) -> Value {
    serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
}

#[test]
fn writes_a_valid_spec_per_claim() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let ids = w
        .write_claim(CLAIM, &[share("gpu-0", SHARE, None)])
        .unwrap();
    assert_eq!(ids, vec![format!("shareguard.example/gpu=gpu-0-{SHARE}")]);

    let path = dir
        .path()
        .join(format!("shareguard.example-gpu_{CLAIM}.json"));
    assert_eq!(w.spec_path(CLAIM).unwrap(), path);
    let spec = read(&path);
    validate_spec(&spec).unwrap();
    assert_eq!(spec["kind"], "shareguard.example/gpu");
    assert_eq!(spec["cdiVersion"], "0.3.0");
    let dev = &spec["devices"][0];
    assert!(dev["name"].as_str().unwrap().contains(SHARE));
    assert_eq!(
        dev["containerEdits"]["env"],
        json!([
            format!("CUDA_VISIBLE_DEVICES={GPU}"),
            "NVIDIA_VISIBLE_DEVICES=void"
        ])
    );
    assert!(dev["containerEdits"].get("mounts").is_none());
    assert!(dev["containerEdits"].get("deviceNodes").is_none());

    // Only the spec is left behind: no temp files a runtime could trip over.
    let names: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn mps_share_gets_pipe_env_and_mount() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    w.write_claim(CLAIM, &[share("gpu-0", SHARE, Some("/run/nvidia/mps"))])
        .unwrap();
    let spec = read(&w.spec_path(CLAIM).unwrap());
    validate_spec(&spec).unwrap();
    let edits = &spec["devices"][0]["containerEdits"];
    let env: Vec<&str> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        env.contains(&"CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps/pipe"),
        "{env:?}"
    );
    assert_eq!(edits["mounts"][0]["hostPath"], "/run/nvidia/mps/pipe");
    assert_eq!(edits["mounts"][0]["containerPath"], "/run/nvidia/mps/pipe");
    // The daemon's /dev/shm, not the runtime's.
    assert_eq!(edits["mounts"][1]["hostPath"], "/run/nvidia/mps/shm");
    assert_eq!(edits["mounts"][1]["containerPath"], "/dev/shm");
    assert_eq!(edits["mounts"].as_array().unwrap().len(), 2);
}

#[test]
fn mps_pipe_is_writable_and_shm_like_a_runtimes_own() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    w.write_claim(CLAIM, &[share("gpu-0", SHARE, Some("/run/nvidia/mps"))])
        .unwrap();
    let spec = read(&w.spec_path(CLAIM).unwrap());
    let mounts = &spec["devices"][0]["containerEdits"]["mounts"];
    let options = |i: usize| -> Vec<&str> {
        mounts[i]["options"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect()
    };
    // MPS clients create files in the pipe directory (its sticky bit, on the host,
    // keeps the daemon's sockets theirs).
    let pipe = options(0);
    assert_eq!(mounts[0]["hostPath"], "/run/nvidia/mps/pipe");
    assert!(pipe.contains(&"rw") && !pipe.contains(&"ro"), "{pipe:?}");
    for o in ["bind", "nosuid", "nodev", "noexec"] {
        assert!(pipe.contains(&o), "{o} missing in {pipe:?}");
    }
    // Clients write their segments to /dev/shm: writable, but nothing to run or open
    // as a device there, as a runtime's own /dev/shm.
    let shm = options(1);
    assert!(shm.contains(&"rw") && !shm.contains(&"ro"), "{shm:?}");
    for o in ["bind", "nosuid", "nodev", "noexec"] {
        assert!(shm.contains(&o), "{o} missing in {shm:?}");
    }
    // Only the two shared directories reach the container, never the share directory
    // above them, where the agent keeps its own record of the daemon.
    for m in mounts.as_array().unwrap() {
        assert_ne!(m["hostPath"], "/run/nvidia/mps");
    }
}

#[test]
fn mps_directories_must_be_absolute() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let mut s = share("gpu-0", SHARE, Some("/run/nvidia/mps"));
    if let Some(m) = s.mps.as_mut() {
        m.shm = PathBuf::from("relative/shm");
    }
    assert!(matches!(
        w.write_claim(CLAIM, &[s]),
        Err(CdiError::Invalid(_))
    ));
    assert!(!w.spec_path(CLAIM).unwrap().exists(), "nothing written");
}

#[test]
fn rewrite_replaces_and_release_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let other = "0d9c8b7a-6f5e-4d3c-9b2a-1f0e9d8c7b6a";
    w.write_claim(CLAIM, &[share("gpu-0", SHARE, None)])
        .unwrap();
    let ids = w
        .write_claim(
            CLAIM,
            &[share("gpu-0", SHARE, None), share("gpu-1", other, None)],
        )
        .unwrap();
    assert_eq!(ids.len(), 2);
    let spec = read(&w.spec_path(CLAIM).unwrap());
    assert_eq!(spec["devices"].as_array().unwrap().len(), 2);
    // A device name that starts with a digit needs 0.5.0; the writer says so.
    w.write_claim(CLAIM, &[share("0", SHARE, None)]).unwrap();
    let spec = read(&w.spec_path(CLAIM).unwrap());
    assert_eq!(spec["cdiVersion"], "0.5.0");
    validate_spec(&spec).unwrap();

    w.remove_claim(CLAIM).unwrap();
    assert!(!w.spec_path(CLAIM).unwrap().exists());
    w.remove_claim(CLAIM).unwrap();
}

#[test]
fn odd_inventory_names_are_made_cdi_safe() {
    let s = share("node/GPU #0 (H100)", SHARE, None);
    let name = CdiWriter::device_name(&s).unwrap();
    assert_eq!(name, format!("node-GPU--0--H100-{SHARE}"));
    let s = share("///", SHARE, None);
    assert_eq!(CdiWriter::device_name(&s).unwrap(), format!("gpu-{SHARE}"));
}

#[test]
fn hostile_inputs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    for claim in [
        "",
        "../etc/passwd",
        "a/b",
        "-x",
        ".hidden",
        "a b",
        &"x".repeat(200),
    ] {
        assert!(w.spec_path(claim).is_err(), "{claim:?}");
    }
    assert!(w.write_claim(CLAIM, &[]).is_err());
    assert!(
        w.write_claim(CLAIM, &[share("gpu", "bad id!", None)])
            .is_err()
    );
    let mut bad_gpu = share("gpu", SHARE, None);
    bad_gpu.gpu_uuid = "GPU-1,GPU-2".into();
    assert!(w.write_claim(CLAIM, &[bad_gpu]).is_err());
    assert!(
        w.write_claim(CLAIM, &[share("gpu", SHARE, Some("relative/dir"))])
            .is_err()
    );
    // Nothing was written by the refused calls.
    assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);

    for (vendor, class) in [
        ("", "gpu"),
        ("1vendor", "gpu"),
        ("vendor.", "gpu"),
        ("v", "g/x"),
        ("v", ""),
    ] {
        let cfg = CdiConfig {
            vendor: vendor.into(),
            class: class.into(),
            ..CdiConfig::default()
        };
        assert!(CdiWriter::new(cfg).is_err(), "{vendor}/{class}");
    }
}

#[test]
fn write_into_a_missing_directory_is_an_io_error() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(&dir.path().join("missing"));
    let err = w
        .write_claim(CLAIM, &[share("gpu", SHARE, None)])
        .unwrap_err();
    assert!(matches!(err, CdiError::Io { .. }), "{err:?}");
}

fn good() -> Value {
    json!({
        "cdiVersion": "0.6.0",
        "kind": "vendor.com/gpu",
        "devices": [
            {"name": "d0", "containerEdits": {"env": ["A=1"]}}
        ]
    })
}

#[test]
fn validator_accepts_the_spec_examples() {
    validate_spec(&good()).unwrap();
    // From SPEC.md: valid kinds.
    let mut v = good();
    v["kind"] = json!("foo.bar.baz/foo-bar123.B_az");
    validate_spec(&v).unwrap();
    let mut v = good();
    v["cdiVersion"] = json!("v1.1.0");
    v["devices"][0]["containerEdits"] = json!({
        "deviceNodes": [{"path": "/dev/nvidia0"}],
        "mounts": [{"hostPath": "/a", "containerPath": "/b"}],
        "hooks": [{"hookName": "createContainer", "path": "/bin/true"}],
        "netDevices": [{"hostInterfaceName": "eth1", "name": "eth1"}]
    });
    validate_spec(&v).unwrap();
}

#[test]
fn validator_rejects_what_the_spec_forbids() {
    type Mutate = fn(&mut Value);
    let cases: Vec<(&str, Mutate)> = vec![
        ("no version", |v| {
            v.as_object_mut().unwrap().remove("cdiVersion");
        }),
        ("unknown version", |v| v["cdiVersion"] = json!("9.9.9")),
        ("kind without slash", |v| v["kind"] = json!("foo")),
        ("kind with two slashes", |v| {
            v["kind"] = json!("vendor.com/foo/bar")
        }),
        ("kind trailing slash", |v| {
            v["kind"] = json!("vendor.com/foo/")
        }),
        ("vendor starts with digit", |v| {
            v["kind"] = json!("1vendor.com/foo")
        }),
        ("class with space", |v| v["kind"] = json!("vendor.com/fo o")),
        ("dots in class before 0.6.0", |v| {
            v["cdiVersion"] = json!("0.5.0");
            v["kind"] = json!("vendor.com/a.b");
        }),
        ("device name starts with dash", |v| {
            v["devices"][0]["name"] = json!("-d")
        }),
        ("device name ends with dot", |v| {
            v["devices"][0]["name"] = json!("d.")
        }),
        ("device name with slash", |v| {
            v["devices"][0]["name"] = json!("a/b")
        }),
        ("digit-first name before 0.5.0", |v| {
            v["cdiVersion"] = json!("0.4.0");
            v["devices"][0]["name"] = json!("0d");
        }),
        ("env without =", |v| {
            v["devices"][0]["containerEdits"]["env"] = json!(["NOEQ"])
        }),
        ("env with empty key", |v| {
            v["devices"][0]["containerEdits"]["env"] = json!(["=x"])
        }),
        ("env not a string", |v| {
            v["devices"][0]["containerEdits"]["env"] = json!([1])
        }),
        ("unknown top-level field", |v| v["extra"] = json!(1)),
        ("unknown device field", |v| {
            v["devices"][0]["extra"] = json!(1)
        }),
        ("unknown edit field", |v| {
            v["devices"][0]["containerEdits"]["extra"] = json!(1)
        }),
        ("no devices", |v| v["devices"] = json!([])),
        ("duplicate device names", |v| {
            let d = v["devices"][0].clone();
            v["devices"].as_array_mut().unwrap().push(d);
        }),
        ("device without edits", |v| {
            v["devices"][0]
                .as_object_mut()
                .unwrap()
                .remove("containerEdits");
        }),
        ("device with empty edits", |v| {
            v["devices"][0]["containerEdits"] = json!({})
        }),
        ("mount without containerPath", |v| {
            v["devices"][0]["containerEdits"]["mounts"] = json!([{"hostPath": "/a"}]);
        }),
        ("netDevices before 1.1.0", |v| {
            v["devices"][0]["containerEdits"]["netDevices"] = json!([]);
        }),
    ];
    for (what, mutate) in cases {
        let mut v = good();
        mutate(&mut v);
        assert!(validate_spec(&v).is_err(), "{what}: {v}");
    }
    assert!(validate_spec(&json!([])).is_err());
}

#[test]
fn driver_nodes_and_files_go_in_with_their_host_paths_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let mut s = share("gpu-0", SHARE, None);
    s.device_nodes = vec![
        CdiDeviceNode {
            path: "/dev/nvidiactl".into(),
            host_path: "/dev/nvidiactl".into(),
        },
        CdiDeviceNode {
            path: "/dev/nvidia3".into(),
            host_path: "/run/nvidia/driver/dev/nvidia3".into(),
        },
    ];
    s.mounts = vec![CdiMount {
        host_path: "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into(),
        container_path: "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into(),
    }];
    w.write_claim(CLAIM, &[s]).unwrap();
    let spec = read(&w.spec_path(CLAIM).unwrap());
    validate_spec(&spec).unwrap();
    // A device node's hostPath came with 0.5.0.
    assert_eq!(spec["cdiVersion"], "0.5.0");
    let edits = &spec["devices"][0]["containerEdits"];
    assert_eq!(
        edits["deviceNodes"],
        json!([
            {"path": "/dev/nvidiactl"},
            {"path": "/dev/nvidia3", "hostPath": "/run/nvidia/driver/dev/nvidia3"},
        ])
    );
    assert_eq!(
        edits["mounts"],
        json!([{
            "hostPath": "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
            "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }])
    );

    // The same spec declared older than its fields is what a runtime would refuse.
    let mut old = spec.clone();
    old["cdiVersion"] = json!("0.4.0");
    let p = validate_spec(&old).unwrap_err();
    assert!(p.iter().any(|p| p.contains("older than 0.5.0")), "{p:?}");
}

#[test]
fn a_relative_driver_path_is_refused_and_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let w = writer(dir.path());
    let mut s = share("gpu-0", SHARE, None);
    s.mounts = vec![CdiMount {
        host_path: "usr/lib/libcuda.so.1".into(),
        container_path: "/usr/lib/libcuda.so.1".into(),
    }];
    let e = w.write_claim(CLAIM, &[s]).unwrap_err().to_string();
    assert!(e.contains("driver file usr/lib/libcuda.so.1"), "{e}");
    assert!(!w.spec_path(CLAIM).unwrap().exists());
}

#[test]
fn device_node_types_and_permissions_are_checked() {
    let spec = json!({
        "cdiVersion": "0.5.0",
        "kind": "shareguard.example/gpu",
        "devices": [{"name": "d", "containerEdits": {"deviceNodes": [
            {"path": "/dev/x", "type": "x", "permissions": "rwz"}
        ]}}]
    });
    let p = validate_spec(&spec).unwrap_err();
    assert_eq!(p.len(), 2, "{p:?}");
}
