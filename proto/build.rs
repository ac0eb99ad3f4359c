//! Generates the tonic service, prost messages and pbjson serde impls (proto3 canonical
//! JSON) from `proto/shareguard/v1/agent.proto`, plus the descriptor set that server
//! reflection serves; and kubelet's DRA, DRA resource health and plugin registration APIs
//! (`proto/kubelet/`), clients and servers both: the plugin serves them, the tests play
//! kubelet.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The vendored protoc keeps the build free of a system protobuf-compiler package.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: a build script is single threaded, so setting the variable races nothing.
    unsafe { env::set_var("PROTOC", protoc) };

    let out = PathBuf::from(env::var("OUT_DIR")?);
    let descriptor = out.join("shareguard_descriptor.bin");
    let protos = ["proto/shareguard/v1/agent.proto"];

    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptor)
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_protos(&protos, &["proto"])?;

    let set = std::fs::read(&descriptor)?;
    pbjson_build::Builder::new()
        .register_descriptors(&set)?
        .build(&[".shareguard.v1"])?;

    let kubelet = [
        "proto/kubelet/pluginregistration/v1/api.proto",
        "proto/kubelet/dra/v1/api.proto",
        "proto/kubelet/dra/v1beta1/api.proto",
        "proto/kubelet/dra-health/v1alpha1/api.proto",
        "proto/kubelet/dra-health/v1/api.proto",
    ];
    tonic_prost_build::configure().compile_protos(&kubelet, &["proto"])?;

    for p in protos.iter().chain(&kubelet) {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
