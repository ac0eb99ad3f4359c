//! Typed errors of the agent library and the gRPC code each one maps to.
//!
//! Per-claim refusals are [`ClaimError`]s: they travel inside `ClaimResult.error` and are
//! persisted with FAILED shares. Whole-request problems are [`RequestError`]s and become a
//! gRPC status. Each kind keeps its own code; nothing is folded into one catch-all.

use serde::{Deserialize, Serialize};

/// The gRPC code names the API promises in `Error.code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Code {
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    AlreadyExists,
    Unavailable,
    Internal,
}

impl Code {
    pub const ALL: [Code; 7] = [
        Code::InvalidArgument,
        Code::PermissionDenied,
        Code::ResourceExhausted,
        Code::FailedPrecondition,
        Code::AlreadyExists,
        Code::Unavailable,
        Code::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidArgument => "InvalidArgument",
            Code::PermissionDenied => "PermissionDenied",
            Code::ResourceExhausted => "ResourceExhausted",
            Code::FailedPrecondition => "FailedPrecondition",
            Code::AlreadyExists => "AlreadyExists",
            Code::Unavailable => "Unavailable",
            Code::Internal => "Internal",
        }
    }

    pub fn to_tonic(self) -> tonic::Code {
        match self {
            Code::InvalidArgument => tonic::Code::InvalidArgument,
            Code::PermissionDenied => tonic::Code::PermissionDenied,
            Code::ResourceExhausted => tonic::Code::ResourceExhausted,
            Code::FailedPrecondition => tonic::Code::FailedPrecondition,
            Code::AlreadyExists => tonic::Code::AlreadyExists,
            Code::Unavailable => tonic::Code::Unavailable,
            Code::Internal => tonic::Code::Internal,
        }
    }
}

/// Why one claim (or one of its allocations) was refused or failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}{message}", if field.is_empty() { String::new() } else { format!("{field}: ") })]
pub struct ClaimError {
    pub code: Code,
    /// The request field at fault, e.g. `claims[0].allocations[1].share_id`; may be empty.
    pub field: String,
    pub message: String,
    pub retryable: bool,
}

impl ClaimError {
    fn new(
        code: Code,
        field: impl Into<String>,
        message: impl Into<String>,
        retryable: bool,
    ) -> Self {
        Self {
            code,
            field: field.into(),
            message: message.into(),
            retryable,
        }
    }

    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, field, message, false)
    }

    pub fn denied(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::PermissionDenied, field, message, false)
    }

    /// Capacity may be freed by a release, so a later retry can succeed.
    pub fn exhausted(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::ResourceExhausted, field, message, true)
    }

    pub fn conflict(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::AlreadyExists, field, message, false)
    }

    pub fn precondition(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(Code::FailedPrecondition, field, message, false)
    }

    /// I4 at a claim: a newer epoch was accepted since the request passed the fence.
    pub fn stale_epoch(got: u64, current: u64) -> Self {
        Self::precondition(
            "epoch",
            format!("{got} is older than the highest accepted epoch {current}"),
        )
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(Code::Unavailable, "", message, true)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, "", message, true)
    }

    /// Short label for metrics and audit: the code name.
    pub fn reason(&self) -> &'static str {
        self.code.as_str()
    }
}

/// The store could not take or make durable a change: nothing of it is acknowledged, and
/// a retry (after the agent is restarted, if the store failed for good) can succeed.
impl From<StoreError> for ClaimError {
    fn from(e: StoreError) -> Self {
        ClaimError::unavailable(format!("state store: {e}"))
    }
}

/// Problems with a whole request; no claim of it was looked at.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("epoch: {got} is older than the highest accepted epoch {current}")]
    StaleEpoch { got: u64, current: u64 },
    /// Only `NewEpoch` issues epochs; a caller cannot name one of its own.
    #[error(
        "epoch: {got} was never issued (the current epoch is {current}); only NewEpoch issues epochs"
    )]
    UnknownEpoch { got: u64, current: u64 },
    #[error("{field}: {count} entries, more than the limit of {max} per request")]
    BatchTooLarge {
        field: &'static str,
        count: usize,
        max: usize,
    },
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("caller has no peer credentials; connect over the agent's unix socket")]
    Unauthenticated,
    #[error("caller uid {uid} is in none of allowed_uids, plugin_uids, reader_uids")]
    CallerNotAllowed { uid: u32 },
    #[error("caller uid {uid} has the {has} role; {rpc} needs {needs}")]
    RoleTooLow {
        uid: u32,
        rpc: &'static str,
        has: &'static str,
        needs: &'static str,
    },
    #[error("share {0} not found")]
    NotFound(String),
    #[error("device {0} not found")]
    UnknownDevice(String),
    #[error("no device is in DeviceClass {0}")]
    UnknownClass(String),
    #[error("device {device}: the rollout stage cannot change: {reason}")]
    StageNotSupported { device: String, reason: String },
    #[error("state store: {0}")]
    Store(#[from] StoreError),
}

impl RequestError {
    pub fn code(&self) -> tonic::Code {
        match self {
            // The plugin takes either as "fenced": it hands over to, or is replaced by,
            // an instance that takes a new epoch.
            RequestError::StaleEpoch { .. } | RequestError::UnknownEpoch { .. } => {
                tonic::Code::FailedPrecondition
            }
            RequestError::BatchTooLarge { .. } | RequestError::Invalid { .. } => {
                tonic::Code::InvalidArgument
            }
            RequestError::Unauthenticated => tonic::Code::Unauthenticated,
            RequestError::CallerNotAllowed { .. } | RequestError::RoleTooLow { .. } => {
                tonic::Code::PermissionDenied
            }
            RequestError::NotFound(_)
            | RequestError::UnknownDevice(_)
            | RequestError::UnknownClass(_) => tonic::Code::NotFound,
            RequestError::StageNotSupported { .. } => tonic::Code::FailedPrecondition,
            // The store refused a write: the node cannot make anything durable right now.
            RequestError::Store(_) => tonic::Code::Unavailable,
        }
    }

    pub fn to_status(&self) -> tonic::Status {
        tonic::Status::new(self.code(), self.to_string())
    }
}

/// A stored value that cannot be read back ([`crate::record`]).
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("empty value")]
    Empty,
    #[error("value format {found} is newer than this agent understands (max {max})")]
    UnknownFormat { found: u8, max: u8 },
    #[error("malformed JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// The store failing ([`crate::store`]).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("record {tree}/{key}: {source}")]
    Decode {
        tree: &'static str,
        key: String,
        source: DecodeError,
    },
    #[error("meta/{0}: malformed value")]
    Meta(&'static str),
    #[error("sync of the store's log file: {0}")]
    Sync(String),
    #[error("{tree}/{key}: encoded value of {bytes} bytes is over the store's bound of {max}")]
    TooLarge {
        tree: &'static str,
        key: String,
        bytes: usize,
        max: usize,
    },
    #[error("the store failed earlier and accepts no more writes; restart the agent")]
    Failed,
}
