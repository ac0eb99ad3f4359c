//! `[agent]`: where the agent listens, stores and logs, who may call it, and the
//! periods of its loops.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use shareguard_common::Quantity;
use toml::Spanned;

use super::{
    AgentConfig, ConfigError, DEFAULT_MAX_CLAIMS, MAX_WATCHERS,
    node::NodeName,
    raw::{RawAgent, RawBytes},
    slo::ErrAt,
};

/// `[agent]` checked, each default filled in.
pub(super) fn parse(
    a: RawAgent,
    node_name: &NodeName,
    err: ErrAt<'_>,
) -> Result<AgentConfig, ConfigError> {
    let addr = |key: &str, s: &Option<Spanned<String>>| {
        s.as_ref()
            .map(|s| {
                s.get_ref().parse::<SocketAddr>().map_err(|e| {
                    err(
                        s.span(),
                        format!("agent.{key}: {:?} is not host:port: {e}", s.get_ref()),
                    )
                })
            })
            .transpose()
    };
    let metrics_addr = addr("metrics_addr", &a.metrics_addr)?
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9464)));
    let health_addr = addr("health_addr", &a.health_addr)?;
    let client_certs = a
        .metrics_tls
        .as_ref()
        .is_some_and(|t| t.client_ca_file.is_some());
    if !metrics_addr.ip().is_loopback()
        && a.metrics_token_file.is_none()
        && !client_certs
        && let Some(s) = &a.metrics_addr
    {
        return Err(err(
            s.span(),
            format!(
                "agent.metrics_addr: {metrics_addr} is reachable from other hosts, and the metrics name tenants' namespaces and claims: bind it to loopback, or set metrics_token_file (a bearer token) or metrics_tls with client_ca_file (client certificates) so that only authenticated scrapers read them"
            ),
        ));
    }
    // A uid listed but unable to connect is a config that does not do what it says.
    if a.socket_group.is_none() {
        for (key, list) in [
            ("allowed_uids", &a.allowed_uids),
            ("plugin_uids", &a.plugin_uids),
            ("reader_uids", &a.reader_uids),
        ] {
            if let Some(l) = list
                && let Some(uid) = l.get_ref().iter().find(|u| **u != 0)
            {
                return Err(err(
                    l.span(),
                    format!(
                        "agent.{key}: uid {uid} could never connect: the API socket is root's alone (mode 0600) unless socket_group names the group its callers are in (mode 0660)"
                    ),
                ));
            }
        }
    }
    let max_watchers = match a.max_watchers {
        // Watchers are the kubelet plugin and SREs' `shareguard watch`: a handful.
        None => 64,
        Some(n) if *n.get_ref() == 0 => {
            return Err(err(
                n.span(),
                "agent.max_watchers: must be at least 1".into(),
            ));
        }
        // Each open stream holds a semaphore permit, and a semaphore takes at most
        // `usize::MAX >> 3` (it panics above); far below that, every stream costs a
        // task and a queue, so the bound is what one node can really serve.
        Some(n) if *n.get_ref() > MAX_WATCHERS => {
            return Err(err(
                n.span(),
                format!(
                    "agent.max_watchers: {} is more than the {MAX_WATCHERS} streams one agent serves at once",
                    n.get_ref()
                ),
            ));
        }
        Some(n) => n.into_inner(),
    };
    let max_claims_per_request = match a.max_claims_per_request {
        None => DEFAULT_MAX_CLAIMS,
        Some(n) if *n.get_ref() == 0 => {
            return Err(err(
                n.span(),
                "agent.max_claims_per_request: must be at least 1".into(),
            ));
        }
        Some(n) => n.into_inner(),
    };
    let duration = |field: &str, s: &Spanned<String>| {
        crate::duration::parse(s.get_ref())
            .map_err(|e| err(s.span(), format!("agent.{field}: {:?}: {e}", s.get_ref())))
    };
    let tombstone_retention = match &a.tombstone_retention {
        None => Duration::from_secs(24 * 3600),
        Some(s) => duration("tombstone_retention", s)?,
    };
    let tombstone_max = match a.tombstone_max {
        // 100,000 records are about 600 MiB of the agent (docs/benchmarks.md): the
        // default keeps tombstones to a tenth of that.
        None => 10_000,
        Some(n) if *n.get_ref() == 0 => {
            return Err(err(
                n.span(),
                "agent.tombstone_max: must be at least 1 (a release is kept for audit)".into(),
            ));
        }
        Some(n) => n.into_inner(),
    };
    // A period of the agent's loops: at least 100 ms, so that a typo cannot make one
    // spin.
    let period = |field: &str, s: Option<Spanned<String>>, default: Duration| {
        let Some(s) = s else {
            return Ok(default);
        };
        let d = duration(field, &s)?;
        if d < Duration::from_millis(100) {
            return Err(err(
                s.span(),
                format!("agent.{field}: must be at least 100ms"),
            ));
        }
        Ok(d)
    };
    // Often enough that drift is noticed within a minute's dashboards, rarely enough
    // that re-reading thousands of shares costs nothing noticeable.
    let reconcile_period = period(
        "reconcile_period",
        a.reconcile_period,
        Duration::from_secs(10),
    )?;
    // Events find a sandbox within milliseconds; this only bounds what a lost event
    // costs.
    let rescan_period = period("rescan_period", a.rescan_period, Duration::from_secs(5))?;
    let counters_period = period("counters_period", a.counters_period, Duration::from_secs(5))?;
    // A second is nothing to a scrape interval of 15 s or more, and bounds what any
    // number of scrapers cost to one render a second.
    let metrics_max_age = match &a.metrics_max_age {
        None => Duration::from_secs(1),
        Some(s) => duration("metrics_max_age", s)?,
    };
    let audit_max_bytes = match a.audit_max_bytes {
        None => crate::audit::DEFAULT_MAX_BYTES,
        Some(b) => {
            let span = b.span();
            let bytes = match b.into_inner() {
                RawBytes::Int(n) => i128::from(n),
                RawBytes::Text(t) => Quantity::parse(&t)
                    .ok()
                    .and_then(|q| q.ceil_units())
                    .ok_or_else(|| {
                        err(
                            span.clone(),
                            format!("agent.audit_max_bytes: {t:?} is not a quantity of bytes"),
                        )
                    })?,
            };
            // Zero would rotate before every line; a bound of one line is the least
            // that keeps the log.
            u64::try_from(bytes)
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| {
                    err(
                        span,
                        format!("agent.audit_max_bytes: {bytes} is not at least 1 byte"),
                    )
                })?
        }
    };
    let audit_keep = match a.audit_keep {
        None => crate::audit::DEFAULT_KEEP,
        // Zero would delete the lines a rotation has just moved aside.
        Some(n) if *n.get_ref() == 0 => {
            return Err(err(n.span(), "agent.audit_keep: must be at least 1".into()));
        }
        Some(n) => n.into_inner(),
    };
    let mut mps = shareguard_limiter_gpu::mps::MpsConfig::default();
    if let Some(c) = a.mps_control {
        mps.control = c;
    }
    if let Some(l) = a.mps_launcher {
        let span = l.span();
        let l = l.into_inner();
        if l.first().is_some_and(String::is_empty) {
            return Err(err(
                span,
                "agent.mps_launcher: the first element names a program and cannot be empty".into(),
            ));
        }
        mps.launcher = l;
    }
    if let Some(q) = a.mps_shm_size {
        let span = q.span();
        mps.shm_bytes = Quantity::parse(q.get_ref())
            .ok()
            .and_then(|v| v.ceil_units())
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| {
                err(
                    span.clone(),
                    format!(
                        "agent.mps_shm_size: {:?} is not a quantity of bytes",
                        q.get_ref()
                    ),
                )
            })?;
        shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
            .map_err(|e| err(span, format!("agent.mps_shm_size: {e}")))?;
    }
    if let Some(c) = a.mps_cgroup {
        let span = c.span();
        mps.cgroup = c.into_inner();
        shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
            .map_err(|e| err(span, format!("agent.mps_cgroup: {e}")))?;
    }
    if let Some(d) = a.mps_dir {
        let span = d.span();
        mps.dir = d.into_inner();
        // The same check the daemons make, here so that it names the field.
        shareguard_limiter_gpu::mps::MpsDaemons::new(mps.clone())
            .map_err(|e| err(span, format!("agent.mps_dir: {e}")))?;
    }
    let kubelet_dir = match a.kubelet_dir {
        None => Some(PathBuf::from("/var/lib/kubelet")),
        Some(d) if d.get_ref().as_os_str().is_empty() => None,
        Some(d) if d.get_ref().is_absolute() => Some(d.into_inner()),
        Some(d) => {
            return Err(err(
                d.span(),
                format!(
                    "agent.kubelet_dir: {:?} is not an absolute path (\"\" reads no checkpoint)",
                    d.get_ref()
                ),
            ));
        }
    };
    let state_dir = a
        .state_dir
        .unwrap_or_else(|| PathBuf::from("/var/lib/shareguard"));
    Ok(AgentConfig {
        node_name: node_name.known().map(str::to_owned),
        socket: a
            .socket
            .unwrap_or_else(|| PathBuf::from("/run/shareguard/agent.sock")),
        audit_log: a.audit_log.unwrap_or_else(|| state_dir.join("audit.jsonl")),
        audit_bound: crate::audit::Bound {
            max_bytes: audit_max_bytes,
            keep: audit_keep,
        },
        state_dir,
        metrics_addr,
        health_addr,
        metrics_token_file: a.metrics_token_file,
        metrics_tls: a.metrics_tls.map(|t| super::MetricsTls {
            cert_file: t.cert_file,
            key_file: t.key_file,
            client_ca_file: t.client_ca_file,
        }),
        allowed_uids: a
            .allowed_uids
            .map(Spanned::into_inner)
            .unwrap_or_else(|| vec![0]),
        plugin_uids: a.plugin_uids.map(Spanned::into_inner).unwrap_or_default(),
        reader_uids: a.reader_uids.map(Spanned::into_inner).unwrap_or_default(),
        socket_group: a.socket_group,
        max_claims_per_request,
        tombstone_retention,
        tombstone_max,
        bpffs_dir: a
            .bpffs_dir
            .unwrap_or_else(|| PathBuf::from("/sys/fs/bpf/shareguard")),
        cdi_dir: a.cdi_dir.unwrap_or_else(|| PathBuf::from("/var/run/cdi")),
        cgroup_root: a.cgroup_root,
        pod_cgroup_roots: a.pod_cgroup_roots.unwrap_or_default(),
        kubelet_dir,
        rescan_period,
        counters_period,
        max_watchers,
        metrics_max_age,
        mps,
        simulated_gpu_processes: a.simulated_gpu_processes,
        simulated_gpu_faults: a.simulated_gpu_faults,
        reconcile_period,
    })
}
