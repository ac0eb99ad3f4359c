//! From a ResourceClaim, as the API server has it, to the agent's Prepare: the pure part
//! of NodePrepareResources, tested without an API server.

mod allocation_id;
mod build;
mod pods;

pub use allocation_id::allocation_id;
pub use build::{KubeletDevice, Prepared, build};
pub use pods::{ReservedPod, reserved_pods};
