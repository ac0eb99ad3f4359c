//! Errors of the bandwidth limiter, and whether a retry can help.

use shareguard_common::limiter::LimiterError;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Something the share needs is not there (yet): a namespace, an interface. The pod
    /// sandbox may still be coming up, so a retry can succeed.
    #[error("{0} does not exist")]
    NotFound(String),
    #[error("network namespace {path}: {reason}")]
    Netns { path: String, reason: String },
    #[error("{0} is not a veth interface: the pod's host side cannot be found from it")]
    NotVeth(String),
    #[error("netlink: {0}")]
    Netlink(String),
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("{0}")]
    Conflict(String),
    /// The share is installed for the other rollout stage (counted only while it should
    /// be limited, or the reverse): installing it again for its stage repairs that.
    #[error("{0}")]
    OtherStage(String),
    /// The kernel lacks what was asked for (a qdisc, a kind of link).
    #[error("{0}")]
    Unsupported(String),
    #[error("bpf: {0}")]
    Bpf(String),
    /// Traffic of the share passes the interface without passing our programs: another
    /// program runs before ours and ends the chain, or redirects past the hook. Retrying
    /// (attaching ours first again) can repair the first; the share is not ENFORCED
    /// while it lasts.
    #[error("traffic bypasses the shaper: {0}")]
    Bypassed(String),
    #[error("limiter state {path}: {reason}")]
    State { path: String, reason: String },
    /// The state directory cannot be written now (full, over quota, read-only): a retry
    /// can succeed once an operator made room.
    #[error("limiter state {path}: {reason}")]
    StateUnwritable { path: String, reason: String },
}

impl From<NetError> for LimiterError {
    fn from(e: NetError) -> Self {
        match &e {
            NetError::NotFound(_)
            | NetError::Netns { .. }
            | NetError::Netlink(_)
            | NetError::OtherStage(_)
            | NetError::Bypassed(_)
            | NetError::StateUnwritable { .. } => LimiterError::retryable(e.to_string()),
            NetError::NotVeth(_)
            | NetError::Command { .. }
            | NetError::Conflict(_)
            | NetError::Unsupported(_)
            | NetError::Bpf(_)
            | NetError::State { .. } => LimiterError::permanent(e.to_string()),
        }
    }
}
