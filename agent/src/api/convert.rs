//! Translation between the library's records and the `shareguard.v1` messages.

use shareguard_limiter_gpu::limiter::MEMORY;
use shareguard_proto::v1 as pb;

use crate::rollout::measure::{Above, Measured};
use crate::{
    api::device_status,
    audit::rfc3339,
    engine::{DeviceView, Engine, PrepareOutcome, gpu::bytes},
    error::ClaimError,
    record::{Phase, ShareRecord},
};

pub fn phase_to_pb(p: Phase) -> pb::Phase {
    match p {
        Phase::Preparing => pb::Phase::Preparing,
        Phase::Enforced => pb::Phase::Enforced,
        Phase::Accounted => pb::Phase::Accounted,
        Phase::Degraded => pb::Phase::Degraded,
        Phase::Failed => pb::Phase::Failed,
        Phase::Unknown => pb::Phase::Unknown,
        Phase::Releasing => pb::Phase::Releasing,
        Phase::Released => pb::Phase::Released,
        Phase::Pending => pb::Phase::Pending,
        Phase::Observed => pb::Phase::Observed,
    }
}

pub fn phase_from_pb(p: pb::Phase) -> Option<Phase> {
    Phase::ALL.into_iter().find(|x| phase_to_pb(*x) == p)
}

/// Phase names as the CLI accepts them: "enforced", "ENFORCED" or "PHASE_ENFORCED".
pub fn parse_phase(s: &str) -> Option<Phase> {
    let up = s.to_ascii_uppercase();
    let name = up.strip_prefix("PHASE_").unwrap_or(&up);
    Phase::ALL.into_iter().find(|p| p.name() == name)
}

pub fn error_to_pb(e: &ClaimError) -> pb::Error {
    pb::Error {
        code: e.code.as_str().to_owned(),
        message: e.message.clone(),
        retryable: e.retryable,
        field: e.field.clone(),
    }
}

fn timestamp(ms: u64) -> pbjson_types::Timestamp {
    pbjson_types::Timestamp {
        seconds: i64::try_from(ms / 1000).unwrap_or(i64::MAX),
        // Below 1e9 by construction, so it fits.
        nanos: i32::try_from((ms % 1000) * 1_000_000).unwrap_or(0),
    }
}

/// A share's status as the API shows it: the record, plus what the engine measured of
/// its traffic and what the GPU watchdog sees of its memory.
pub fn share_status(engine: &Engine, r: &ShareRecord) -> pb::ShareStatus {
    let traffic = engine.measured(&r.key);
    let Some(o) = engine.gpu_observation(&r.key) else {
        return share_to_pb_with(r, &[], traffic.as_ref());
    };
    let mut s = share_to_pb_with(
        r,
        &[(MEMORY.to_owned(), bytes(o.used_bytes))],
        traffic.as_ref(),
    );
    if o.unknown > 0 {
        s.reason = format!(
            "{}; watchdog: the driver does not report the memory of {} of the share's processes: the usage shown counts only the others",
            s.reason, o.unknown
        );
    }
    if let Some(since) = o.over_since_ms {
        s.reason = format!(
            "{}; watchdog: over the memory limit since {}: {} used of {}",
            s.reason,
            rfc3339(since),
            bytes(o.used_bytes),
            bytes(o.limit_bytes)
        );
    }
    s
}

pub fn share_to_pb(r: &ShareRecord) -> pb::ShareStatus {
    share_to_pb_with(r, &[], None)
}

/// [`share_to_pb`] with what the agent observes the share using (capacity name ->
/// amount) and, for bandwidth, what it measured of its traffic: shown as its usage and
/// traffic, and in `device_status_json`.
pub fn share_to_pb_with(
    r: &ShareRecord,
    observed: &[(String, String)],
    traffic: Option<&Measured>,
) -> pb::ShareStatus {
    pb::ShareStatus {
        share_id: r.share_id().unwrap_or_default().to_owned(),
        claim: Some(pb::ClaimRef {
            uid: r.claim.uid.clone(),
            namespace: r.claim.namespace.to_string(),
            name: r.claim.name.to_string(),
        }),
        driver: r.driver.to_string(),
        pool: r.pool.to_string(),
        device: r.device.to_string(),
        request: r.request.to_string(),
        phase: phase_to_pb(r.phase) as i32,
        mechanism: r.mechanism.to_string(),
        // What was asked for, and what is enforced; a dedicated allocation asks for no
        // amount but is enforced at the device's capacity, which shows here too.
        limits: r
            .consumed
            .keys()
            .chain(r.enforced.keys().filter(|k| !r.consumed.contains_key(k)))
            .map(|name| pb::CapacityLimit {
                name: name.to_owned(),
                requested: r
                    .consumed
                    .get(name)
                    .map(|q| q.to_string())
                    .unwrap_or_default(),
                enforced: r
                    .enforced
                    .get(name)
                    .map(|e| e.to_string())
                    .unwrap_or_default(),
            })
            .collect(),
        usage: observed
            .iter()
            .map(|(name, used)| pb::CapacityUsage {
                name: name.clone(),
                used: used.clone(),
            })
            .collect(),
        error: r.error.as_deref().map(error_to_pb),
        policy_version: r.policy_version.to_string(),
        allocation_id: r.allocation_id.to_string(),
        device_status_json: device_status::render(r, observed, traffic),
        updated_at: Some(timestamp(r.updated_at_ms)),
        admin_access: r.admin_access,
        reason: r.reason.to_string(),
        pod_uids: r.target.pod_uids.clone(),
        sandbox: r.sandbox.as_deref().map(sandbox_to_pb),
        more_sandboxes: r.more_sandboxes().iter().map(sandbox_to_pb).collect(),
        pre_bind: r.pre_bind,
        // Filled in Prepare's answer (outcome_to_pb), where the claim's CDI spec is known.
        cdi_device_ids: Vec::new(),
        traffic: traffic.map(traffic_to_pb),
    }
}

fn sandbox_to_pb(s: &crate::record::SandboxRecord) -> pb::Sandbox {
    pb::Sandbox {
        pod_uid: s.pod_uid.clone(),
        cgroup: s.cgroup.clone(),
        netns_inode: s.netns_inode.unwrap_or(0),
        host_interface: s.host_ifname.as_deref().unwrap_or_default().to_owned(),
        host_ifindex: s.host_ifindex.unwrap_or(0),
    }
}

fn traffic_to_pb(m: &Measured) -> pb::Traffic {
    let dir = |a: &Above| pb::DirectionTraffic {
        bytes: a.bytes,
        ms_above_rate: a.ms_above,
        bytes_above_rate: a.bytes_above,
        peak_bps: a.peak_bps,
    };
    pb::Traffic {
        to_pod: Some(dir(&m.to_pod)),
        from_pod: Some(dir(&m.from_pod)),
        interval_ms: m.interval_ms,
    }
}

pub fn outcome_to_pb(o: &PrepareOutcome) -> pb::ClaimResult {
    pb::ClaimResult {
        shares: o
            .shares
            .iter()
            .zip(o.share_cdi_ids.iter().chain(std::iter::repeat(&None)))
            .map(|(r, id)| pb::ShareStatus {
                cdi_device_ids: id.iter().cloned().collect(),
                ..share_to_pb(r)
            })
            .collect(),
        error: o.error.as_ref().map(error_to_pb),
        cdi_device_ids: o.cdi_device_ids.clone(),
    }
}

pub fn device_to_pb(d: &DeviceView) -> pb::DeviceStatus {
    let c = &d.config;
    pb::DeviceStatus {
        name: c.name.clone(),
        driver: c.driver.clone(),
        pool: c.pool.clone(),
        kind: c.kind.as_str().to_owned(),
        capacity: c
            .capacities
            .iter()
            .map(|(k, v)| (k.clone(), v.value.to_string()))
            .collect(),
        allocated: d
            .usage
            .allocated
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
        free: d
            .free
            .iter()
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect(),
        policy: c
            .capacities
            .iter()
            .map(|(k, v)| (k.clone(), v.policy.to_snapshot().into()))
            .collect(),
        allowed_namespaces: c.allowed_namespaces.clone(),
        admin_namespaces: c.admin_namespaces.clone(),
        mechanisms: d.mechanisms.clone(),
        live_shares: d.usage.live,
        dedicated: d.usage.dedicated_by.is_some(),
        mechanism: d.facts.mechanism.clone(),
        enforces: d.facts.enforces,
        stage: d.stage.name().to_owned(),
        device_class: d.config.class.clone(),
        warnings: crate::config::warnings::device_warnings(&d.config),
        fault: d
            .facts
            .fault
            .as_ref()
            .map(|f| f.message.clone())
            .unwrap_or_default(),
        fault_reason: d
            .facts
            .fault
            .as_ref()
            .map(|f| f.reason.to_owned())
            .unwrap_or_default(),
        attributes: d
            .facts
            .attributes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        int_attributes: d
            .facts
            .int_attributes
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect(),
    }
}

/// One class's SLO figures and verdict (see [`crate::slo`]).
pub fn class_slo_to_pb(s: &crate::engine::ClassSlo) -> pb::ClassSlo {
    let f = &s.figures;
    let window = |d: std::time::Duration| humantime::format_duration(d).to_string();
    let (recovery_seconds, unverified_shares) = match &f.recovery {
        crate::slo::Recovery::Done(d) => (Some(d.as_secs_f64()), 0),
        crate::slo::Recovery::Waiting { unverified, .. } => (None, *unverified),
    };
    pb::ClassSlo {
        device_class: f.class.clone(),
        stage: f.stage.name().to_owned(),
        devices: f.devices.clone(),
        verdict: s.verdict.kind.name().to_owned(),
        reasons: s.verdict.reasons.clone(),
        window: window(f.window.span),
        short_window: window(f.short.span),
        figures: s
            .verdict
            .lines
            .iter()
            .map(|l| pb::SloFigure {
                name: l.figure.to_owned(),
                unit: l.unit.to_owned(),
                value: l.value,
                short_value: l.short_value,
                comparison: l.comparison.to_owned(),
                objective: l.objective,
                samples: l.samples,
                status: l.status.name().to_owned(),
                enforcement: l.enforcement,
                note: l.note.clone(),
            })
            .collect(),
        refusals: f
            .window
            .refusals
            .iter()
            .map(|(r, n)| (r.name().to_owned(), *n))
            .collect(),
        claims: f.window.claims,
        read_back: f
            .read_back
            .iter()
            .map(|r| pb::SloReadBack {
                capacity: r.capacity.clone(),
                allocated: r.allocated.to_string(),
                requested: r.requested.to_string(),
                read_back: r.read_back.to_string(),
                ratio: r.ratio(),
                shares: r.shares,
            })
            .collect(),
        recovery_seconds,
        unverified_shares,
    }
}
