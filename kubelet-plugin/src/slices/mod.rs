//! ResourceSlices: the agent's inventory published for the scheduler.

pub mod build;
pub mod compare;
pub mod names;
mod publish;

pub use publish::{Dropped, Pass, PublishError, Publisher, dropped_cause};
