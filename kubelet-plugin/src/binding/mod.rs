//! The binding gate: no pod is bound to this node for a share the node's ledger would
//! refuse.
//!
//! Each device the plugin publishes carries binding conditions ([`ADMITTED`], failure
//! [`REFUSED`]), so the scheduler's PreBind waits until the claim's `status.devices`
//! says one or the other. The scheduler writes the pod's `status.nominatedNodeName`
//! before PreBind; the gate watches the unbound pods nominated to this node (one watch
//! per node, field-selected), reads their claims, and prepares each claim's shares on
//! the agent before any kubelet does (`pre_bind`: capacity held, the pod's sandbox not
//! there yet). The agent's status of the shares then says `Admitted` (the status writer
//! applies it), or the gate applies `AdmissionRefused` with the agent's reason, and the
//! scheduler takes the allocation back and tries again, elsewhere where it fits.
//! A share admitted here whose claim loses the allocation before kubelet prepared it
//! (the binding timed out, the pod was deleted) is released by the sweep.

mod decide;
mod gate;
mod refusal;
mod sweep;

pub use decide::{Next, claim_names, decide};
pub use gate::Gate;
pub use refusal::body as refusal_body;
pub use sweep::{Verdict, sweep_verdict};

/// The binding condition: the node's ledger holds the share (the agent's status of a
/// share says it from admission to release).
pub const ADMITTED: &str = "Admitted";
/// The binding failure condition: the node's agent refused the share.
pub const REFUSED: &str = "AdmissionRefused";
