//! The GPU limiter's error type and how each error maps onto the agent's
//! retryable/permanent split.
//!
//! The split follows `shareguard_common::limiter::Retry`: retryable means the same call
//! can succeed later without anyone changing the request. A missing driver or library
//! is *not* retryable in that sense: the node as it is cannot enforce, an operator has
//! to install or load something, and a claim that keeps retrying would hide that. Such
//! errors are `Unavailable`, which the agent shows as the device's status.

use shareguard_common::limiter::{LimiterError, Retry};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GpuError {
    /// NVML cannot be used on this node: library missing, driver not loaded, no
    /// permission, library/driver mismatch. A device status, not a per-share problem.
    #[error("GPU back end unavailable: {0}")]
    Unavailable(String),
    /// The GPU or driver does not offer what was asked (for example cgroup memory limits
    /// on a MIG-enabled GPU, or a driver before R615).
    #[error("not supported: {0}")]
    NotSupported(String),
    /// The GPU (by UUID or index) does not exist on this node.
    #[error("GPU not found: {0}")]
    GpuNotFound(String),
    /// The request itself is wrong (unknown capacity, bad cgroup path, zero bytes).
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// More memory asked for than the GPU has left for shares.
    #[error("oversubscribed: {0}")]
    Oversubscribed(String),
    /// The pod's cgroup does not exist yet; the kubelet creates it shortly.
    #[error("target not ready: {0}")]
    TargetMissing(String),
    /// The driver or device was busy or timed out; a retry usually succeeds.
    #[error("transient GPU error: {0}")]
    Transient(String),
    /// The device itself is faulty (fell off the bus, needs a reset). Retryable: the
    /// request is fine and the same call succeeds once the GPU is recovered, which
    /// happens without changing the claim. The agent shows the share as DEGRADED meanwhile.
    #[error("GPU fault: {0}")]
    DeviceFault(String),
    /// The driver refused a per-cgroup limit below what the cgroup already uses.
    /// Retryable: the pod's usage can drop (its processes free memory or exit), and the
    /// same limit is then accepted without anyone changing the claim; meanwhile the
    /// watchdog reports the pod over its share.
    #[error(
        "cgroup {cgroup} already uses {used} bytes of GPU memory, more than the new limit of {limit} bytes; the driver refuses a limit below current usage"
    )]
    UsageAboveLimit {
        cgroup: String,
        used: u64,
        limit: u64,
    },
    /// The back end lost the driver (reloaded, upgraded, GPU reset) and is opened again
    /// at the next call after a short wait. Retryable: nothing about the request is
    /// wrong, and the reopened back end serves the same call.
    #[error("GPU back end lost, re-opening it: {0}")]
    Reopening(String),
    /// The library answered something this build cannot interpret.
    #[error("internal GPU back end error: {0}")]
    Internal(String),
    /// `terminate_client` ended an MPS client's GPU work, and its server still lists it
    /// and holds its memory: with driver 580 the server lets go only once the client
    /// process exits. Retryable: the process can still be stopped.
    #[error(
        "MPS server {server} still lists client {client} after terminate_client (answer {answer:?}): its GPU work is ended, its memory held until the process exits"
    )]
    MpsClientHeld {
        server: u32,
        client: u32,
        answer: String,
    },
}

impl GpuError {
    pub fn retry(&self) -> Retry {
        match self {
            GpuError::TargetMissing(_)
            | GpuError::Transient(_)
            | GpuError::DeviceFault(_)
            | GpuError::UsageAboveLimit { .. }
            | GpuError::MpsClientHeld { .. }
            | GpuError::Reopening(_) => Retry::Retryable,
            GpuError::Unavailable(_)
            | GpuError::NotSupported(_)
            | GpuError::GpuNotFound(_)
            | GpuError::InvalidArgument(_)
            | GpuError::Oversubscribed(_)
            | GpuError::Internal(_) => Retry::Permanent,
        }
    }

    pub fn is_retryable(&self) -> bool {
        self.retry() == Retry::Retryable
    }
}

/// A failed file operation on `path`, as a retryable error naming what was done.
pub(crate) fn io_err(what: &str, path: &std::path::Path, e: &std::io::Error) -> GpuError {
    GpuError::Transient(format!("{what} {}: {e}", path.display()))
}

impl From<GpuError> for LimiterError {
    fn from(e: GpuError) -> Self {
        LimiterError {
            retry: e.retry(),
            message: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_matches_the_documented_split() {
        let retryable = [
            GpuError::TargetMissing("x".into()),
            GpuError::Transient("x".into()),
            GpuError::DeviceFault("x".into()),
            GpuError::UsageAboveLimit {
                cgroup: "/sys/fs/cgroup/x".into(),
                used: 2,
                limit: 1,
            },
            GpuError::Reopening("x".into()),
            GpuError::MpsClientHeld {
                server: 1,
                client: 2,
                answer: "0".into(),
            },
        ];
        let permanent = [
            GpuError::Unavailable("x".into()),
            GpuError::NotSupported("x".into()),
            GpuError::GpuNotFound("x".into()),
            GpuError::InvalidArgument("x".into()),
            GpuError::Oversubscribed("x".into()),
            GpuError::Internal("x".into()),
        ];
        for e in retryable {
            assert_eq!(e.retry(), Retry::Retryable, "{e}");
        }
        for e in permanent {
            assert_eq!(e.retry(), Retry::Permanent, "{e}");
        }
    }

    #[test]
    fn limiter_error_keeps_retry_and_message() {
        let le: LimiterError = GpuError::Transient("nvml timeout".into()).into();
        assert_eq!(le.retry, Retry::Retryable);
        assert!(le.message.contains("nvml timeout"), "{}", le.message);
    }
}
