//! Prometheus metrics (prometheus-client). Ledger gauges are computed from the records
//! at scrape time, so they can never drift from what the ledger decides with.
//!
//! Capacity gauges are in the capacity's own base unit (bytes for memory, bit/s for
//! bandwidth): the device config decides the unit, so it is a label, not a name suffix.

use std::{sync::atomic::AtomicU64, time::Duration};

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use shareguard_common::Quantity;

use crate::{engine::Engine, error::ClaimError};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceCapacity {
    device: String,
    capacity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabel {
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabel {
    /// "Prepare" or "Unprepare".
    rpc: String,
    /// The gRPC code name of the refusal.
    reason: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    capacity: Family<DeviceCapacity, FloatGauge>,
    allocated: Family<DeviceCapacity, FloatGauge>,
    free: Family<DeviceCapacity, FloatGauge>,
    live_shares: Family<DeviceLabel, Gauge>,
    shares: Family<PhaseLabel, Gauge>,
    prepare_seconds: Histogram,
    refusals: Family<RefusalLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Quantities are exact; Prometheus samples are floats. This is the one place the agent
/// turns one into the other, for display only.
fn as_f64(q: &Quantity) -> f64 {
    q.nanos() as f64 / 1e9
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let capacity = Family::<DeviceCapacity, FloatGauge>::default();
        let allocated = Family::<DeviceCapacity, FloatGauge>::default();
        let free = Family::<DeviceCapacity, FloatGauge>::default();
        let live_shares = Family::<DeviceLabel, Gauge>::default();
        let shares = Family::<PhaseLabel, Gauge>::default();
        // 0.25 ms .. ~4 s: a durable Prepare is an fsync or two.
        let prepare_seconds = Histogram::new(exponential_buckets(0.000_25, 2.0, 15));
        let refusals = Family::<RefusalLabel, Counter>::default();
        registry.register(
            "shareguard_device_capacity",
            "Capacity of a device, in the capacity's base unit",
            capacity.clone(),
        );
        registry.register(
            "shareguard_device_allocated",
            "Capacity held by live shares (every phase but FAILED and RELEASED)",
            allocated.clone(),
        );
        registry.register(
            "shareguard_device_free",
            "Capacity not held by any share",
            free.clone(),
        );
        registry.register(
            "shareguard_device_live_shares",
            "Shares holding capacity on a device",
            live_shares.clone(),
        );
        registry.register(
            "shareguard_shares",
            "Share records by phase",
            shares.clone(),
        );
        registry.register(
            "shareguard_prepare_duration_seconds",
            "Time to answer one claim of a Prepare, durable write included",
            prepare_seconds.clone(),
        );
        registry.register(
            "shareguard_refusals",
            "Refused or failed claims and whole requests, by call and gRPC code name",
            refusals.clone(),
        );
        Self {
            registry,
            capacity,
            allocated,
            free,
            live_shares,
            shares,
            prepare_seconds,
            refusals,
        }
    }

    pub fn observe_prepare(&self, took: Duration, error: Option<&ClaimError>) {
        self.prepare_seconds.observe(took.as_secs_f64());
        if let Some(e) = error {
            self.refused("Prepare", e.reason());
        }
    }

    /// Counts one refusal: of a claim, or of a whole request (then `reason` is the gRPC
    /// code of the status it was answered with).
    pub fn refused(&self, rpc: &str, reason: &str) {
        self.refusals
            .get_or_create(&RefusalLabel {
                rpc: rpc.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// Sets the ledger gauges from the engine's records and renders the text format.
    pub fn render(&self, engine: &Engine) -> Result<String, std::fmt::Error> {
        for d in engine.devices() {
            for (name, cap) in &d.config.capacities {
                let l = DeviceCapacity {
                    device: d.config.name.clone(),
                    capacity: name.clone(),
                };
                self.capacity.get_or_create(&l).set(as_f64(&cap.value));
                let used = d
                    .usage
                    .allocated
                    .get(name)
                    .copied()
                    .unwrap_or(Quantity::ZERO);
                self.allocated.get_or_create(&l).set(as_f64(&used));
                let free = d.free.get(name).copied().unwrap_or(Quantity::ZERO);
                self.free.get_or_create(&l).set(as_f64(&free));
            }
            self.live_shares
                .get_or_create(&DeviceLabel {
                    device: d.config.name.clone(),
                })
                .set(i64::from(d.usage.live));
        }
        for (phase, n) in engine.phase_counts() {
            self.shares
                .get_or_create(&PhaseLabel {
                    phase: phase.name().to_owned(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
