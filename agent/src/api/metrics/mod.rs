//! Prometheus metrics (prometheus-client). Ledger gauges are computed from the records
//! at scrape time, so they can never drift from what the ledger decides with.
//!
//! Capacity gauges are in the capacity's own base unit (bytes for memory, bit/s for
//! bandwidth): the device config decides the unit, so it is a label, not a name suffix.

pub mod slo;
pub mod text;
pub mod tls;

use std::{
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::Duration,
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, text::encode},
    metrics::{
        MetricType,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use shareguard_common::{Quantity, limiter::TrafficCounters};

use crate::{
    config::DeviceKind,
    engine::{Engine, observer::Observer},
    error::ClaimError,
    rollout::measure::{Above, Measured},
    slo::RefusalReason,
};

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
struct ShareCapacityLabels {
    share: String,
    namespace: String,
    claim: String,
    device: String,
    capacity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    device: String,
    /// One of [`crate::engine::gpu::TERMINATION_OUTCOMES`].
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PollLabel {
    /// "ok" or "error".
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DevicePhaseLabel {
    device: String,
    /// The phase the share moved to.
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShareLabels {
    share: String,
    namespace: String,
    claim: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShareDirLabels {
    share: String,
    namespace: String,
    claim: String,
    device: String,
    /// "to_pod" or "from_pod".
    direction: String,
}

/// Per-share traffic counters as the kernel holds them. They are taken fresh at every
/// scrape (into `samples`, just before encoding) rather than copied into counters the
/// agent would then have to keep in step with the kernel.
#[derive(Debug, Default)]
struct ShareTraffic {
    samples: Mutex<Vec<(ShareLabels, TrafficCounters, Option<Measured>)>>,
}

impl Collector for ShareTraffic {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let samples = crate::sync::lock(&self.samples);
        let with_dir = |l: &ShareLabels, direction: &str| ShareDirLabels {
            share: l.share.clone(),
            namespace: l.namespace.clone(),
            claim: l.claim.clone(),
            device: l.device.clone(),
            direction: direction.to_owned(),
        };
        type Pick = fn(&TrafficCounters) -> (u64, u64);
        let per_direction: [(&str, &str, Pick); 2] = [
            (
                "shareguard_share_traffic_bytes",
                "Bytes counted by the share's eBPF programs, by direction",
                |c| (c.to_pod_bytes, c.from_pod_bytes),
            ),
            (
                "shareguard_share_traffic_packets",
                "Packets counted by the share's eBPF programs, by direction",
                |c| (c.to_pod_packets, c.from_pod_packets),
            ),
        ];
        for (name, help, pick) in per_direction {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (l, c, _) in samples.iter() {
                let (to, from) = pick(c);
                ConstCounter::new(to).encode(m.encode_family(&with_dir(l, "to_pod"))?)?;
                ConstCounter::new(from).encode(m.encode_family(&with_dir(l, "from_pod"))?)?;
            }
        }
        let mut m = encoder.encode_descriptor(
            "shareguard_share_drops",
            "Packets the share's shaping queues or its policer dropped, both directions",
            None,
            MetricType::Counter,
        )?;
        for (l, c, _) in samples.iter() {
            ConstCounter::new(c.drops).encode(m.encode_family(l)?)?;
        }
        // What the agent measured against the allocated rate (in observe: what enforcing
        // would have held back), judged per counters period; lower bounds at that
        // resolution.
        type Measure = fn(&Above) -> f64;
        #[allow(clippy::cast_precision_loss)] // Prometheus samples are floats.
        let measured: [(&str, &str, Measure); 2] = [
            (
                "shareguard_share_above_rate_seconds",
                "Time the share's traffic ran above its allocated rate, by direction, judged per counters period",
                |a| a.ms_above as f64 / 1000.0,
            ),
            (
                "shareguard_share_above_rate_bytes",
                "Bytes beyond the share's allocated rate in the periods it ran above it, by direction",
                |a| a.bytes_above as f64,
            ),
        ];
        for (name, help, pick) in measured {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (l, _, measured) in samples.iter() {
                let Some(x) = measured else { continue };
                ConstCounter::new(pick(&x.to_pod))
                    .encode(m.encode_family(&with_dir(l, "to_pod"))?)?;
                ConstCounter::new(pick(&x.from_pod))
                    .encode(m.encode_family(&with_dir(l, "from_pod"))?)?;
            }
        }
        Ok(())
    }
}

pub struct Metrics {
    registry: Registry,
    capacity: Family<DeviceCapacity, FloatGauge>,
    allocated: Family<DeviceCapacity, FloatGauge>,
    free: Family<DeviceCapacity, FloatGauge>,
    live_shares: Family<DeviceLabel, Gauge>,
    shares: Family<PhaseLabel, Gauge>,
    prepare_seconds: Histogram,
    refusals: Family<RefusalLabel, Counter>,
    traffic: Arc<ShareTraffic>,
    gpu_used: Family<ShareLabels, Gauge>,
    gpu_limit: Family<ShareLabels, Gauge>,
    gpu_over_limit: Family<DeviceLabel, Counter>,
    gpu_terminations: Family<OutcomeLabel, Counter>,
    gpu_polls: Family<PollLabel, Counter>,
    gpu_poll_seconds: Histogram,
    reconcile_seconds: Histogram,
    drift: Family<DeviceLabel, Counter>,
    repairs: Family<DeviceLabel, Counter>,
    requested: Family<ShareCapacityLabels, FloatGauge>,
    enforced: Family<ShareCapacityLabels, FloatGauge>,
    enforce_seconds: Family<DeviceLabel, Histogram, fn() -> Histogram>,
    sandbox_transitions: Family<DevicePhaseLabel, Counter>,
    overcommitted: Family<DeviceCapacity, Gauge>,
    quarantined: Gauge,
    store_up: Gauge,
    /// The SLO figures per class (see [`crate::api::metrics::slo`]).
    slo: crate::api::metrics::slo::SloMetrics,
    /// Held through a render: a render sets and clears the per-share families before it
    /// encodes them, so two at once would each encode half of the other's. It also guards
    /// the last render, served again to scrapes within `metrics_max_age` of it.
    rendering: Mutex<Option<(std::time::Instant, String)>>,
}

/// 0.1 ms .. ~1.6 s: for what talks to the kernel or driver once or a few times (a map
/// update, netlink round trips, tc, an NVML call, a watchdog poll over /proc).
fn driver_call_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 15))
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

impl Observer for Metrics {
    fn observe_prepare(&self, took: Duration, error: Option<&ClaimError>) {
        self.prepare_seconds.observe(took.as_secs_f64());
        if let Some(e) = error {
            self.refused("Prepare", e.reason());
        }
    }

    fn refused(&self, rpc: &str, reason: &str) {
        self.refusals
            .get_or_create(&RefusalLabel {
                rpc: rpc.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
    }

    fn slo_prepared(&self, class: &str, took: Duration, refusal: Option<RefusalReason>) {
        self.slo.prepared(class, took, refusal);
    }

    fn slo_converged(&self, class: &str, took: Duration) {
        self.slo.converged(class, took);
    }

    fn slo_repaired(&self, class: &str) {
        self.slo.repaired(class);
    }

    fn gpu_over_limit(&self, device: &str) {
        self.gpu_over_limit
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    fn gpu_terminated(&self, device: &str, outcome: &str) {
        self.gpu_terminations
            .get_or_create(&OutcomeLabel {
                device: device.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    fn enforced_in(&self, device: &str, took: Duration) {
        self.enforce_seconds
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    fn sandbox_transition(&self, device: &str, phase: &str) {
        self.sandbox_transitions
            .get_or_create(&DevicePhaseLabel {
                device: device.to_owned(),
                phase: phase.to_owned(),
            })
            .inc();
    }

    fn quarantined(&self, n: usize) {
        self.quarantined.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    fn reconciled(&self, took: Duration) {
        self.reconcile_seconds.observe(took.as_secs_f64());
    }

    fn drift(&self, device: &str) {
        self.drift
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    fn repaired(&self, device: &str) {
        self.repairs
            .get_or_create(&DeviceLabel {
                device: device.to_owned(),
            })
            .inc();
    }

    fn gpu_polled(&self, took: Duration, ok: bool) {
        if ok {
            self.gpu_poll_seconds.observe(took.as_secs_f64());
        }
        self.gpu_polls
            .get_or_create(&PollLabel {
                result: if ok { "ok" } else { "error" }.to_owned(),
            })
            .inc();
    }
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
        // Every label set is known from the start: there at zero (see `zero_counters_of`).
        for rpc in ["Prepare", "Unprepare"] {
            for code in crate::error::Code::ALL {
                let _ = refusals.get_or_create(&RefusalLabel {
                    rpc: rpc.to_owned(),
                    reason: code.as_str().to_owned(),
                });
            }
        }
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
        let traffic = Arc::new(ShareTraffic::default());
        registry.register_collector(Box::new(traffic.clone()));
        let gpu_used = Family::<ShareLabels, Gauge>::default();
        let gpu_limit = Family::<ShareLabels, Gauge>::default();
        let gpu_over_limit = Family::<DeviceLabel, Counter>::default();
        let gpu_terminations = Family::<OutcomeLabel, Counter>::default();
        let gpu_polls = Family::<PollLabel, Counter>::default();
        let gpu_poll_seconds = driver_call_histogram();
        registry.register(
            "shareguard_gpu_share_used_bytes",
            "GPU memory used by the processes of the share's pod on its GPU, as the watchdog last saw it",
            gpu_used.clone(),
        );
        registry.register(
            "shareguard_gpu_share_limit_bytes",
            "The memory limit the watchdog holds the share's pod to on its GPU (its shares there, summed)",
            gpu_limit.clone(),
        );
        registry.register(
            "shareguard_gpu_over_limit_events",
            "Times a GPU share's usage crossed its limit",
            gpu_over_limit.clone(),
        );
        registry.register(
            "shareguard_gpu_terminations",
            "Processes the GPU watchdog terminated (or tried to) because their share was over its limit",
            gpu_terminations.clone(),
        );
        registry.register(
            "shareguard_gpu_watchdog_polls",
            "GPU watchdog polls, by result",
            gpu_polls.clone(),
        );
        registry.register(
            "shareguard_gpu_watchdog_poll_duration_seconds",
            "Time one GPU watchdog poll took",
            gpu_poll_seconds.clone(),
        );
        // 1 ms .. ~16 s: one netlink round trip or NVML call per share.
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let drift = Family::<DeviceLabel, Counter>::default();
        let repairs = Family::<DeviceLabel, Counter>::default();
        registry.register(
            "shareguard_reconcile_duration_seconds",
            "Time one reconciler pass over the enforced shares took",
            reconcile_seconds.clone(),
        );
        registry.register(
            "shareguard_reconcile_drift",
            "Enforced shares whose enforcement the reconciler found changed or missing",
            drift.clone(),
        );
        registry.register(
            "shareguard_reconcile_repairs",
            "Drifted shares the reconciler re-applied and verified again",
            repairs.clone(),
        );
        let requested = Family::<ShareCapacityLabels, FloatGauge>::default();
        let enforced = Family::<ShareCapacityLabels, FloatGauge>::default();
        let enforce_seconds =
            Family::<DeviceLabel, Histogram, fn() -> Histogram>::new_with_constructor(
                driver_call_histogram,
            );
        registry.register(
            "shareguard_share_requested",
            "What a live share asked for, per capacity, in the capacity's base unit",
            requested.clone(),
        );
        registry.register(
            "shareguard_share_enforced",
            "What the kernel or driver was last read back to enforce for a live share, per capacity (absent: not enforced)",
            enforced.clone(),
        );
        registry.register(
            "shareguard_enforcement_duration_seconds",
            "Time the device's limiter took to apply and read back one share",
            enforce_seconds.clone(),
        );
        let quarantined = Gauge::default();
        registry.register(
            "shareguard_store_quarantined_records",
            "Stored records this agent could not read, kept as found in the store's quarantine (shares among them are listed UNKNOWN)",
            quarantined.clone(),
        );
        let store_up = Gauge::default();
        registry.register(
            "shareguard_store_up",
            "1 while the state store takes writes; 0 while it failed and is being reopened (Prepare and Unprepare are refused as Unavailable meanwhile)",
            store_up.clone(),
        );
        let sandbox_transitions = Family::<DevicePhaseLabel, Counter>::default();
        registry.register(
            "shareguard_sandbox_transitions",
            "Shares that followed their pod's sandbox: enforced on one that appeared or changed, or back to PENDING when it went away",
            sandbox_transitions.clone(),
        );
        let overcommitted = Family::<DeviceCapacity, Gauge>::default();
        registry.register(
            "shareguard_device_overcommitted",
            "1 while a device's live shares hold more than its configured capacity (it was shrunk under them); new shares are refused until enough are released",
            overcommitted.clone(),
        );
        let slo = crate::api::metrics::slo::SloMetrics::register(&mut registry);
        Self {
            slo,
            rendering: Mutex::new(None),
            sandbox_transitions,
            overcommitted,
            quarantined,
            store_up,
            requested,
            enforced,
            enforce_seconds,
            reconcile_seconds,
            drift,
            repairs,
            gpu_used,
            gpu_limit,
            gpu_over_limit,
            gpu_terminations,
            gpu_polls,
            gpu_poll_seconds,
            traffic,
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

    /// The text format as rendered at most `max_age` ago: scrapers that come together
    /// (several Prometheus replicas, dashboards) share one render instead of each taking
    /// CPU from the agent's real work. Zero renders every time.
    pub fn render_cached(
        &self,
        engine: &Engine,
        max_age: Duration,
    ) -> Result<String, std::fmt::Error> {
        let mut last = crate::sync::lock(&self.rendering);
        if let Some((at, body)) = last.as_ref()
            && at.elapsed() < max_age
        {
            return Ok(body.clone());
        }
        let body = self.render_locked(engine)?;
        *last = Some((std::time::Instant::now(), body.clone()));
        Ok(body)
    }

    /// Sets the ledger gauges from the engine's records and renders the text format.
    pub fn render(&self, engine: &Engine) -> Result<String, std::fmt::Error> {
        self.render_cached(engine, Duration::ZERO)
    }

    /// Puts every counter and histogram series of a known device in place at zero, so
    /// that `increase()` and `rate()` over them see their first event, and a fresh
    /// agent's dashboard is not empty. Unchanged once there.
    fn zero_counters_of(&self, device: &str, gpu: bool) {
        let dev = DeviceLabel {
            device: device.to_owned(),
        };
        let _ = self.drift.get_or_create(&dev);
        let _ = self.repairs.get_or_create(&dev);
        let _ = self.enforce_seconds.get_or_create(&dev);
        for phase in crate::record::Phase::ALL {
            let _ = self.sandbox_transitions.get_or_create(&DevicePhaseLabel {
                device: device.to_owned(),
                phase: phase.name().to_owned(),
            });
        }
        if gpu {
            let _ = self.gpu_over_limit.get_or_create(&dev);
            for outcome in crate::engine::gpu::TERMINATION_OUTCOMES {
                let _ = self.gpu_terminations.get_or_create(&OutcomeLabel {
                    device: device.to_owned(),
                    outcome: outcome.to_owned(),
                });
            }
        }
    }

    /// [`Metrics::render`], with the rendering lock held by the caller.
    fn render_locked(&self, engine: &Engine) -> Result<String, std::fmt::Error> {
        self.store_up
            .set(i64::from(engine.store_problem().is_none()));
        let mut any_gpu = false;
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
                self.overcommitted
                    .get_or_create(&l)
                    .set(i64::from(used > cap.value));
            }
            self.live_shares
                .get_or_create(&DeviceLabel {
                    device: d.config.name.clone(),
                })
                .set(i64::from(d.usage.live));
            let gpu = d.config.kind == DeviceKind::Gpu;
            any_gpu |= gpu;
            self.zero_counters_of(&d.config.name, gpu);
        }
        if any_gpu {
            for result in ["ok", "error"] {
                let _ = self.gpu_polls.get_or_create(&PollLabel {
                    result: result.to_owned(),
                });
            }
        }
        for (phase, n) in engine.phase_counts() {
            self.shares
                .get_or_create(&PhaseLabel {
                    phase: phase.name().to_owned(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        // One snapshot of the live shares for every per-share family: a released share
        // must disappear from all of them, not linger at its last value.
        let live = engine.live_records();
        let share_labels = |r: &crate::record::ShareRecord| ShareLabels {
            share: r.key.clone(),
            namespace: r.claim.namespace.to_string(),
            claim: r.claim.name.to_string(),
            device: r.device.to_string(),
        };
        *crate::sync::lock(&self.traffic.samples) = engine
            .share_counters(&live)
            .into_iter()
            .map(|(r, c)| (share_labels(r), c, engine.measured(&r.key)))
            .collect();
        self.requested.clear();
        self.enforced.clear();
        for r in &live {
            for (capacity, q) in &r.consumed {
                let l = ShareCapacityLabels {
                    share: r.key.clone(),
                    namespace: r.claim.namespace.to_string(),
                    claim: r.claim.name.to_string(),
                    device: r.device.to_string(),
                    capacity: capacity.to_owned(),
                };
                self.requested.get_or_create(&l).set(as_f64(q));
                if let Some(e) = r.enforced.get(capacity) {
                    self.enforced.get_or_create(&l).set(as_f64(e));
                }
            }
        }
        // Only shares the watchdog watches now: released ones must disappear.
        self.gpu_used.clear();
        self.gpu_limit.clear();
        let obs = engine.gpu_observations();
        for r in &live {
            // A share released since the last poll is not live, whatever was observed.
            let Some(o) = obs.get(&r.key) else { continue };
            let labels = share_labels(r);
            self.gpu_used
                .get_or_create(&labels)
                .set(i64::try_from(o.used_bytes).unwrap_or(i64::MAX));
            self.gpu_limit
                .get_or_create(&labels)
                .set(i64::try_from(o.limit_bytes).unwrap_or(i64::MAX));
        }
        self.slo.set(engine);
        let mut out = String::new();
        encode(&mut out, &self.registry)?;
        Ok(out)
    }
}
