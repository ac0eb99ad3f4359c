//! Types shared by the shareguard agent and its limiters.
//!
//! - [`quantity`]: exact Kubernetes quantities ("10Gi", "2G", "500m"), no floats.
//! - [`limiter`]: the interface every enforcement back end (bandwidth, GPU memory,
//!   accounting only) implements, so the agent's ledger and store never depend on how a
//!   share is enforced.

pub mod limiter;
pub mod quantity;

pub use quantity::{Format, Quantity, QuantityError};
