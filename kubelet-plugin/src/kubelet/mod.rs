//! kubelet's side: the registration socket its plugin watcher finds, and the DRA service
//! it calls. The handlers translate kubelet's messages; [`crate::driver`] decides.

mod dra;
mod registration;
mod socket;

pub use dra::{V1, V1Beta1};
pub use registration::{Registration, RegistrationState};
pub use socket::SocketFile;

/// The plugin type kubelet's plugin watcher hands to its DRA handler.
pub const PLUGIN_TYPE: &str = "DRAPlugin";
/// The DRA service versions the plugin serves on its endpoint, as kubelet names them.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
