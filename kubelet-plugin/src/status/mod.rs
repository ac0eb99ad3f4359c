//! ResourceClaim status: the enforced limit of each share written back into the claim's
//! `status.devices`, so that `kubectl get resourceclaim` says what is enforced.

pub mod build;
mod writer;
mod written;

pub use writer::StatusWriter;
pub use written::Written;
