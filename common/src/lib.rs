//! Types shared by the shareguard agent and its limiters.
//!
//! - [`quantity`]: exact Kubernetes quantities ("10Gi", "2G", "500m"), no floats.
//! - [`limiter`]: the interface every enforcement back end (bandwidth, GPU memory,
//!   accounting only) implements, so the agent's ledger and store never depend on how a
//!   share is enforced.
//! - [`slice`]: what a device's ResourceSlice entry holds and resource.k8s.io's limits on
//!   it, shared by the agent's config checks and the kubelet plugin that publishes it.
//! - [`pci`]: where a PCI device (a NIC, a GPU) sits in the machine, from sysfs.

#[cfg(feature = "http")]
pub mod http;
pub mod limiter;
pub mod pci;
pub mod quantity;
pub mod slice;

pub use quantity::{Format, Quantity, QuantityError};
