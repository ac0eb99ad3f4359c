//! The agent's faces to its callers: the gRPC service over the unix socket ([`grpc`]),
//! protobuf conversion ([`convert`] out, [`request`] in) and the claim's `status.devices` entry
//! ([`device_status`]), HTTP for `/metrics` and the health probes ([`http`]), and the
//! metrics themselves ([`metrics`]). Handlers translate; the engine decides.

pub mod convert;
pub mod device_status;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod request;
