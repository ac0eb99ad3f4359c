//! shareguard's DRA kubelet plugin, run as `shareguard kubelet-plugin`.
//!
//! A separate, unprivileged process: it holds the API credentials the privileged agent
//! never has, and it never touches the kernel. It registers each driver of the agent's
//! inventory with kubelet, serves kubelet's DRA API (v1 and v1beta1) and each device's
//! health (v1alpha1 and v1), and turns each claim kubelet prepares into the agent's Prepare: the claim and its pods are read from
//! the API server, checked against this node's devices, and sent with this instance's
//! epoch, so that an instance replaced in a rolling update is fenced.

mod agent;
mod answer;
mod args;
mod backoff;
pub mod binding;
pub mod claims;
mod cluster;
mod device_health;
mod dirs;
mod driver;
pub mod error;
pub mod events;
mod forward;
mod health;
pub mod inventory;
pub mod kubelet;
pub mod policy;
mod run;
pub mod slices;
pub mod status;
mod stop;
pub mod throttle;

pub use args::PluginArgs;
pub use dirs::{DirError, DirsArgs, prepare as prepare_dirs};
pub use run::run;
