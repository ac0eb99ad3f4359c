//! shareguard: the per-node agent that makes Kubernetes DRA consumable-capacity shares
//! real. See `docs/architecture.md` for how the modules fit together.

#![forbid(unsafe_code)]

pub mod accounting;
pub mod agent_lock;
pub mod amounts;
pub mod api;
pub mod audit;
pub mod capacity;
pub mod cleanup;
pub mod cli;
pub mod client;
pub mod config;
pub mod discovery;
pub mod duration;
pub mod engine;
pub mod error;
pub mod gpu_inventory;
pub mod gpu_watch;
pub mod keyed;
pub mod ledger;
pub mod limiters;
pub mod policy;
pub mod record;
pub mod request;
pub mod rollout;
pub mod server;
pub mod slo;
pub mod store;
pub mod sync;
pub mod validate;
