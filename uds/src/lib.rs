//! gRPC on unix sockets for every real client.
//!
//! Several gRPC clients send the socket's path as the HTTP/2 `:authority` when they dial
//! a unix socket: grpc C-core (Python, C++, Ruby, C#), grpc-java, and grpc-go when it
//! dials a bare path with a custom dialer, which is how kubelet's plugin watcher reaches
//! a plugin's registration socket. The `h2` crate under tonic takes such a request as
//! malformed and resets the stream (PROTOCOL_ERROR), and its maintainers will not relax
//! the check (hyperium/h2#487, grpc/grpc-rust#1876). So a plain tonic server on a unix
//! socket never registers with a real kubelet, and SREs' Python or Java tools cannot
//! call it.
//!
//! The fix sits on the accepted connection, below h2 ([`stream::Normalized`]): the
//! client's bytes pass through a normaliser that decodes each header block with HPACK
//! (keeping the client's dynamic table), replaces an `:authority` that is a socket path
//! (raw or percent-encoded) or empty with `localhost` ([`authority`]), and encodes the
//! block again for h2 with an encoder of its own, whose dynamic table h2's decoder then
//! follows. Every other frame passes through unchanged, and nothing else about a
//! request is loosened: any other authority h2 refuses is still refused. The depth is
//! deliberate: the alternatives were a fork of h2 (not maintainable) or a second HTTP/2
//! stack (the whole of tonic's serving path again).
//!
//! [`incoming`] gives tonic's `serve_with_incoming` such connections from a unix
//! listener, with the peer credentials tonic's `UdsConnectInfo` carries. [`client`] is
//! the other end: a tonic channel to a unix socket.

pub mod authority;
pub mod client;
mod frames;
pub mod normalize;
pub mod stream;

pub use stream::{Normalized, incoming};
