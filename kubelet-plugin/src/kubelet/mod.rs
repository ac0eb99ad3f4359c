//! kubelet's side: the registration socket its plugin watcher finds, and the DRA and
//! resource health services it calls. The handlers translate kubelet's messages;
//! [`crate::driver`] and [`crate::device_health`] decide.

mod dra;
mod registration;
mod resource_health;
mod socket;

pub use dra::{V1, V1Beta1};
pub use registration::{Registration, RegistrationState};
pub use resource_health::{HealthV1, HealthV1Alpha1};
pub use socket::SocketFile;

/// The plugin type kubelet's plugin watcher hands to its DRA handler.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The gRPC services the plugin serves on its endpoint, as kubelet names them in the
/// registration's "supported versions": kubelet takes the first DRA service it knows,
/// and (1.37 and later) the first resource health service it knows; 1.36 ignores the
/// health entries and dials v1alpha1 regardless.
pub const SUPPORTED_VERSIONS: [&str; 4] = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
];
