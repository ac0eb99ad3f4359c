//! What the engine reports to be counted. The engine decides and tells; the metrics
//! registry (`api::metrics`) counts and serves. The trait keeps the engine free of the
//! registry, so the dependency points one way: api -> engine.

use std::time::Duration;

use crate::{error::ClaimError, slo::RefusalReason};

pub trait Observer: Send + Sync {
    /// One claim of a Prepare answered after `took`; `error` when it was refused.
    fn observe_prepare(&self, took: Duration, error: Option<&ClaimError>);
    /// One refusal: of a claim, or of a whole request (then `reason` is the gRPC code
    /// of the status it was answered with).
    fn refused(&self, rpc: &str, reason: &str);
    /// A claim of the SLO class `class` answered after `took`.
    fn slo_prepared(&self, class: &str, took: Duration, refusal: Option<RefusalReason>);
    /// A share of `class` reached its goal phase `took` after its Prepare.
    fn slo_converged(&self, class: &str, took: Duration);
    /// A drifted share of `class` repaired.
    fn slo_repaired(&self, class: &str);
    fn gpu_over_limit(&self, device: &str);
    /// The watchdog's configured action on an over-limit process, and how it went.
    fn gpu_terminated(&self, device: &str, outcome: &str);
    /// One watchdog poll: how long it took, whether it read the driver.
    fn gpu_polled(&self, took: Duration, ok: bool);
    /// The limiter of `device` took `took` to apply and read back one share.
    fn enforced_in(&self, device: &str, took: Duration);
    /// A share moved to `phase` because its sandbox came or went.
    fn sandbox_transition(&self, device: &str, phase: &str);
    /// Stored records the agent could not read, set at start.
    fn quarantined(&self, n: usize);
    /// One reconcile pass over every share.
    fn reconciled(&self, took: Duration);
    /// Drift found on a share of `device`.
    fn drift(&self, device: &str);
    /// Drift repaired on a share of `device`.
    fn repaired(&self, device: &str);
}
