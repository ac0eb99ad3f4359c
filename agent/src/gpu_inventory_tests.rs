use shareguard_limiter_gpu::backend::MigMode;

use super::*;

/// A node's config: a NIC, and a `gpus = "all"` table (SIMULATED, three GPUs listed).
const ALL: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"
cdi_dir = "/tmp/cdi"

[[device]]
name = "nic"
driver = "shareguard.example.com"
pool = "node-a"
kind = "generic"
[device.capacity.bandwidth]
value = "10G"

[[device]]
name = "gpu"
driver = "shareguard.example.com"
pool = "node-a"
kind = "gpu"
backend = "simulated"
gpus = "all"
allowed_namespaces = ["team-a"]
[device.simulated]
memory = "16Gi"
count = 3
[device.capacity.memory]
default = "1Gi"
valid_range = { min = "1Gi", step = "1Gi" }
"#;

fn gpu(uuid: &str, index: u32) -> GpuInfo {
    GpuInfo {
        uuid: uuid.into(),
        index,
        name: "NVIDIA H100 80GB HBM3".into(),
        total_memory_bytes: 80 << 30,
        mig: MigMode::Disabled,
        driver_version: "580.65.06".into(),
        minor: Some(index),
        pci_bus_id: None,
    }
}

fn names(c: &Config) -> Vec<&str> {
    c.devices.iter().map(|d| d.name.as_str()).collect()
}

#[test]
fn every_gpu_the_back_end_lists_becomes_a_device_named_by_its_uuid() {
    let mut c = Config::parse(ALL, "t.toml").unwrap();
    // As parsed, the table is one device that stands for every GPU.
    assert_eq!(names(&c), ["nic", "gpu"]);
    assert_eq!(
        c.devices[1].gpu.as_ref().unwrap().selector,
        GpuSelector::All
    );

    expand(&mut c).unwrap();
    // The SIMULATED back end lists `count` GPUs; the NIC stays as it was, first.
    assert_eq!(
        names(&c),
        [
            "nic",
            "gpu-simulated-gpu-0",
            "gpu-simulated-gpu-1",
            "gpu-simulated-gpu-2"
        ]
    );
    for (i, d) in c.devices[1..].iter().enumerate() {
        let g = d.gpu.as_ref().unwrap();
        assert_eq!(
            g.selector,
            GpuSelector::Uuid(format!("GPU-simulated-gpu-{i}")),
            "each device names its own GPU"
        );
        // Everything else is the table's.
        assert_eq!(d.allowed_namespaces, ["team-a"]);
        assert_eq!(d.capacities["memory"].value.to_string(), "16Gi");
        assert_eq!(d.kind, crate::config::DeviceKind::Gpu);
    }
}

#[test]
fn nvml_uuids_make_dns_labels_that_stay_with_the_gpu() {
    let mut c = Config::parse(ALL, "t.toml").unwrap();
    // Listed by NVML in PCI order: the names follow the uuids, not the order, so a GPU
    // gone before another does not rename it.
    expand_with(&mut c, |_, _| {
        Ok(vec![
            gpu("GPU-5C2A8F4E-1d3b-4f6a-9e7c-0b1a2c3d4e5f", 0),
            gpu("GPU-0b1a2c3d-aaaa-bbbb-cccc-000000000001", 1),
        ])
    })
    .unwrap();
    assert_eq!(
        names(&c),
        [
            "nic",
            "gpu-5c2a8f4e-1d3b-4f6a-9e7c-0b1a2c3d4e5f",
            "gpu-0b1a2c3d-aaaa-bbbb-cccc-000000000001"
        ]
    );
    assert_eq!(
        c.devices[1].gpu.as_ref().unwrap().selector,
        GpuSelector::Uuid("GPU-5C2A8F4E-1d3b-4f6a-9e7c-0b1a2c3d4e5f".into())
    );
}

#[test]
fn a_node_without_gpus_gets_no_gpu_device_and_keeps_the_others() {
    for listed in [
        Err("NVML: libnvidia-ml.so.1 not found".to_owned()),
        Ok(vec![]),
    ] {
        let mut c = Config::parse(ALL, "t.toml").unwrap();
        expand_with(&mut c, |_, _| listed.clone()).unwrap();
        assert_eq!(names(&c), ["nic"], "{listed:?}");
    }
}

#[test]
fn a_found_name_that_is_too_long_or_taken_is_refused_naming_the_device() {
    let long = ALL.replace("name = \"gpu\"", &format!("name = \"{}\"", "g".repeat(30)));
    let mut c = Config::parse(&long, "t.toml").unwrap();
    let e = expand_with(&mut c, |_, _| {
        Ok(vec![gpu("GPU-5c2a8f4e-1d3b-4f6a-9e7c-0b1a2c3d4e5f", 0)])
    })
    .unwrap_err();
    assert!(
        e.contains(&"g".repeat(30)) && e.contains("DNS label"),
        "{e}"
    );

    // A configured device already has the name a found GPU would get.
    let taken = ALL.replace("name = \"nic\"", "name = \"gpu-1\"");
    let mut c = Config::parse(&taken, "t.toml").unwrap();
    let e = expand_with(&mut c, |_, _| Ok(vec![gpu("GPU-1", 0)])).unwrap_err();
    assert!(e.contains("device gpu-1") && e.contains("rename"), "{e}");
}

/// A pool is one ResourceSlice of at most 128 devices: the GPUs found count too.
#[test]
fn gpus_found_past_a_pools_slice_are_refused_naming_the_pool() {
    let max = shareguard_common::slice::MAX_DEVICES_PER_SLICE;
    let list = |n: usize| {
        move |_: &str, _: &GpuBackendKind| {
            Ok((0..n)
                .map(|i| gpu(&format!("GPU-{i}"), u32::try_from(i).unwrap()))
                .collect())
        }
    };
    // The NIC and max - 1 GPUs fill the pool exactly.
    let mut c = Config::parse(ALL, "t.toml").unwrap();
    expand_with(&mut c, list(max - 1)).unwrap();
    assert_eq!(c.devices.len(), max);
    let mut c = Config::parse(ALL, "t.toml").unwrap();
    let e = expand_with(&mut c, list(max)).unwrap_err();
    assert!(
        e.contains(&format!("device gpu-{}", max - 1))
            && e.contains("pool \"node-a\"")
            && e.contains(&format!("more than {max} devices")),
        "{e}"
    );
}

#[test]
fn gpus_all_is_checked_when_the_config_is_read() {
    let cases = [
        (
            ALL.replace("gpus = \"all\"", "gpus = \"some\""),
            "gpus \"some\"",
        ),
        (
            ALL.replace("gpus = \"all\"", "gpus = \"all\"\nindex = 1"),
            "only one of them",
        ),
        (ALL.replace("count = 3", "count = 0"), "simulated.count 0"),
        (ALL.replace("count = 3", "count = 65"), "simulated.count 65"),
        (
            ALL.replace("gpus = \"all\"\n", ""),
            "simulated.count is only for gpus",
        ),
        (
            ALL.replace("kind = \"generic\"", "kind = \"generic\"\ngpus = \"all\""),
            "gpus is only for kind \"gpu\"",
        ),
    ];
    for (text, want) in cases {
        let e = Config::parse(&text, "bad.toml").unwrap_err();
        assert!(e.message.contains(want), "want {want:?}: {e}");
        assert!(e.line > 0, "{e}");
    }
}
