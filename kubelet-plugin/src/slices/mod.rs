//! ResourceSlices: the agent's inventory published for the scheduler.

pub mod build;
mod publish;

pub use publish::{Pass, Publisher};
