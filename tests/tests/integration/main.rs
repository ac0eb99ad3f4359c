//! shareguard's integration tests: each module an area, each test running the real
//! `shareguard` binary (and the kubelet plugin's) on a temporary socket and store, on the
//! real kernel where the area needs it. One binary, so that the workspace links it once;
//! the harness they share is `tests/src/` (docs/testing.md, "Where tests live").
//!
//! Tests run side by side in one process: what acts on the whole machine takes
//! [`shareguard_tests::net::HostLock`] exclusively, what measures takes the
//! [`shareguard_tests::net::TrafficLock`].

mod admin_access;
mod all_or_nothing;
mod api_roundtrip;
mod audit;
mod audit_log;
mod bandwidth;
mod binding_gate;
mod chart;
mod cleanup;
mod cli;
mod concurrency;
mod crash_recovery;
mod dashboard;
mod dedicated;
mod deploy;
mod device_health;
mod epoch;
mod full_disk;
mod gpu;
mod gpu_cgroupns;
mod health;
mod idempotency;
mod image_lock;
mod inventory_change;
mod kubelet_plugin;
mod kubelet_plugin_api;
mod list_pages;
mod metrics;
mod metrics_access;
mod metrics_tls;
mod net_devices;
mod net_harness;
mod other_clients;
mod plugin_uid;
mod pod_lifecycle;
mod prometheus_rules;
mod quarantine;
mod reconcile;
mod roles;
mod rollout;
mod slo;
mod smoke;
mod startup;
mod tombstones;
mod validation;
mod watch;
