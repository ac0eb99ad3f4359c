//! The `shareguard.v1` gRPC API: prost messages, the tonic `NodeAgent` client and server,
//! and proto3 canonical JSON (camelCase field names, enum names) through pbjson. And
//! kubelet's APIs a DRA driver serves, in [`kubelet`].

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/shareguard.v1.rs"));
    include!(concat!(env!("OUT_DIR"), "/shareguard.v1.serde.rs"));

    /// Encoded `FileDescriptorSet` of the API, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/shareguard_descriptor.bin"));
}

/// kubelet's APIs for a DRA driver, with kubelet's own package, service and message names.
pub mod kubelet {
    /// Plugin registration (package `pluginregistration`): kubelet's plugin watcher asks
    /// a socket in its registry directory what it is.
    pub mod pluginregistration {
        #![allow(clippy::all, missing_docs)]
        include!(concat!(env!("OUT_DIR"), "/pluginregistration.rs"));
    }

    /// DRA plugin API `k8s.io.kubelet.pkg.apis.dra.v1` (kubelet 1.34 and later).
    pub mod dra_v1 {
        #![allow(clippy::all, missing_docs)]
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1.rs"
        ));
    }

    /// DRA plugin API `k8s.io.kubelet.pkg.apis.dra.v1beta1` (kubelet 1.32 and later).
    pub mod dra_v1beta1 {
        #![allow(clippy::all, missing_docs)]
        include!(concat!(
            env!("OUT_DIR"),
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.rs"
        ));
    }

    /// DRA resource health `v1alpha1` (kubelet 1.36 dials it on every DRA plugin; 1.37
    /// when the registration lists it and not v1).
    pub mod dra_health_v1alpha1 {
        #![allow(clippy::all, missing_docs)]
        include!(concat!(env!("OUT_DIR"), "/v1alpha1.rs"));
    }

    /// DRA resource health `v1` (kubelet 1.37 and later, when the registration lists it).
    pub mod dra_health_v1 {
        #![allow(clippy::all, missing_docs)]
        include!(concat!(env!("OUT_DIR"), "/v1.rs"));
    }
}
