//! The `shareguard.v1` gRPC API: prost messages, the tonic `NodeAgent` client and server,
//! and proto3 canonical JSON (camelCase field names, enum names) through pbjson.

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/shareguard.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/shareguard.v1.serde.rs"));

    /// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/shareguard_descriptor.bin"));
}
