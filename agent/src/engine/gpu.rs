//! What the GPU watchdog observed, as the engine keeps and shows it: per-share usage and
//! over-limit episodes (in memory: they are observations, re-made every poll, not
//! decisions to persist), turned into audit lines, metrics and watch events (the API
//! status shows them: `api::convert::share_status`); and the CDI spec files of claims with GPU shares.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Duration,
};

use shareguard_common::{Format, Quantity};
use shareguard_limiter_gpu::{
    cdi::{CdiConfig, CdiShare, CdiWriter},
    watchdog::{OverLimit, ShareUsage, TerminateDecision, TerminateError, Terminated},
};
use tracing::{info, warn};

use crate::{audit::Decision, record::ShareRecord, sync::lock};

use super::{Engine, now_ms};

/// What one poll of the GPU watchdog (`crate::gpu_watch`) found and did.
#[derive(Debug, Default)]
pub struct WatchReport {
    pub usage: Vec<ShareUsage>,
    pub over_limit: Vec<OverLimit>,
    pub terminated: Vec<(TerminateDecision, Result<Terminated, TerminateError>)>,
    /// PIDs on a watched GPU that belong to no share there: (GPU, pid).
    pub unattributed: Vec<(String, u32)>,
    pub took: Duration,
}

/// The watchdog's latest view of one share.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuObservation {
    /// Memory used by the processes of the share's (pod, GPU) group whose usage the
    /// driver reports: a lower bound while `unknown` is not zero.
    pub used_bytes: u64,
    /// Processes of the group whose usage the driver does not report.
    pub unknown: usize,
    /// The group's limit: the sum of the pod's shares on that GPU.
    pub limit_bytes: u64,
    /// Since when the group is over its limit, if it is.
    pub over_since_ms: Option<u64>,
}

/// A byte count as a binary-SI quantity ("3Gi"), as capacities are written.
pub(crate) fn bytes(b: u64) -> String {
    Quantity::from_units(i128::from(b), Format::BinarySI)
        .map_or_else(|| b.to_string(), |q| q.to_string())
}

/// Every `outcome` label of `shareguard_gpu_terminations_total`, put in place at zero.
pub const TERMINATION_OUTCOMES: [&str; 5] = [
    "terminated",
    "mps_client_terminated",
    "mps_client_killed",
    "already exited",
    "not terminated",
];

impl Engine {
    /// Takes one watchdog poll: keeps the usage, and for every share whose over-limit
    /// state changed writes an audit line and sends a watch event.
    pub fn observe_gpu(&self, report: &WatchReport) {
        let now = now_ms();
        let mut flipped = Vec::new();
        {
            let mut obs = lock(&self.gpu_obs);
            let mut seen = HashSet::new();
            for u in &report.usage {
                for key in &u.share_keys {
                    seen.insert(key.clone());
                    let over = u.over_limit();
                    let prev = obs.get(key).cloned().unwrap_or_default();
                    let next = GpuObservation {
                        used_bytes: u.used_bytes,
                        unknown: u.unknown_pids.len(),
                        limit_bytes: u.limit_bytes,
                        over_since_ms: if over {
                            prev.over_since_ms.or(Some(now))
                        } else {
                            None
                        },
                    };
                    if prev.over_since_ms.is_some() != over {
                        flipped.push(key.clone());
                    }
                    obs.insert(key.clone(), next);
                }
            }
            // Shares the limiter no longer watches (released) drop out.
            obs.retain(|k, _| seen.contains(k));
        }
        let records: HashMap<String, ShareRecord> = {
            let st = lock(&self.state);
            flipped
                .iter()
                .chain(
                    report
                        .terminated
                        .iter()
                        .flat_map(|(d, _)| d.share_keys.iter()),
                )
                .filter_map(|k| st.records.get(k).map(|r| (k.clone(), r.clone())))
                .collect()
        };
        for o in report.over_limit.iter().filter(|o| o.new) {
            for key in &o.share_keys {
                let Some(r) = records.get(key) else { continue };
                let reason = format!(
                    "watchdog: GPU memory over the share's limit: {} used of {} on {}",
                    bytes(o.used_bytes),
                    bytes(o.limit_bytes),
                    o.gpu_uuid
                );
                warn!(share = %key, claim = %r.claim.uid, used = o.used_bytes, limit = o.limit_bytes, "GPU share over its memory limit");
                self.audit_share(r, Decision::OverLimit, &reason, None, None);
                self.metrics.gpu_over_limit(&r.device);
            }
        }
        for (d, outcome) in &report.terminated {
            // One of TERMINATION_OUTCOMES.
            let what = match outcome {
                Ok(Terminated::Signalled) => "terminated",
                Ok(Terminated::MpsClientTerminated) => "mps_client_terminated",
                Ok(Terminated::MpsClientKilled) => "mps_client_killed",
                Ok(Terminated::AlreadyGone) => "already exited",
                Err(_) => "not terminated",
            };
            for key in &d.share_keys {
                let Some(r) = records.get(key) else { continue };
                let reason = match outcome {
                    Ok(Terminated::MpsClientTerminated) => format!(
                        "watchdog: the GPU work of MPS client pid {} ({} of GPU memory) ended through its MPS server: the share was over its limit past the grace period",
                        d.pid,
                        bytes(d.used_bytes)
                    ),
                    Ok(Terminated::MpsClientKilled) => format!(
                        "watchdog: the GPU work of MPS client pid {} ({} of GPU memory) ended through its MPS server, which still held its memory, so the process was killed: the share was over its limit past the grace period",
                        d.pid,
                        bytes(d.used_bytes)
                    ),
                    Ok(_) => format!(
                        "watchdog: pid {} ({} of GPU memory) {what}: the share was over its limit past the grace period",
                        d.pid,
                        bytes(d.used_bytes)
                    ),
                    Err(e) => format!("watchdog: pid {} {what}: {e}", d.pid),
                };
                self.audit_share(r, Decision::Terminate, &reason, None, None);
                self.metrics.gpu_terminated(&r.device, what);
            }
        }
        let changed: Vec<ShareRecord> = flipped
            .iter()
            .filter_map(|k| records.get(k).cloned())
            .collect();
        if !changed.is_empty() {
            info!(shares = changed.len(), "GPU over-limit state changed");
            self.publish(&changed);
        }
        self.metrics.gpu_polled(report.took, true);
    }

    pub fn gpu_poll_failed(&self) {
        self.metrics.gpu_polled(std::time::Duration::ZERO, false);
    }

    /// The watchdog's latest view of every watched share, by share key.
    pub fn gpu_observations(&self) -> BTreeMap<String, GpuObservation> {
        lock(&self.gpu_obs)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The watchdog's latest view of one share; None when it does not watch it.
    pub fn gpu_observation(&self, key: &str) -> Option<GpuObservation> {
        lock(&self.gpu_obs).get(key).cloned()
    }

    /// Writes the CDI specs of a claim's GPU shares (one file per driver, named after
    /// the claim) and returns their CDI device ids; empty when it has none.
    pub(crate) fn write_cdi(
        &self,
        claim_uid: &str,
        shares: &[ShareRecord],
    ) -> Result<Vec<String>, String> {
        let mut by_driver: BTreeMap<&str, Vec<CdiShare>> = BTreeMap::new();
        for r in shares {
            let Some(s) = self.cdi_share(r) else {
                continue;
            };
            by_driver.entry(&r.driver).or_default().push(s);
        }
        if by_driver.is_empty() {
            return Ok(Vec::new());
        }
        // The runtime may not have made its spec directory yet (it only reads it).
        let dir = &self.cfg.agent.cdi_dir;
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut ids = Vec::new();
        for (driver, list) in by_driver {
            let w = self.cdi_writer(driver)?;
            ids.extend(w.write_claim(claim_uid, &list).map_err(|e| e.to_string())?);
        }
        Ok(ids)
    }

    /// The CDI device id of one share of a claim whose spec lists `claim_ids`; None for a
    /// share without a CDI device.
    pub(crate) fn share_cdi_id(&self, r: &ShareRecord, claim_ids: &[String]) -> Option<String> {
        let share = self.cdi_share(r)?;
        let id = self.cdi_writer(&r.driver).ok()?.device_id(&share).ok()?;
        // Only an id the written spec has: the runtime could not resolve any other.
        claim_ids.contains(&id).then_some(id)
    }

    fn cdi_share(&self, r: &ShareRecord) -> Option<CdiShare> {
        let d = self.cdi_device(r)?;
        Some(CdiShare {
            share_id: r
                .share_id()
                .map_or_else(|| r.key.replace('/', "-"), str::to_owned),
            device: r.device.to_string(),
            gpu_uuid: d.gpu_uuid,
            mps: d.mps,
            device_nodes: d.device_nodes,
            mounts: d.mounts,
        })
    }

    /// Removes the claim's CDI specs, for every driver its shares are on.
    pub(crate) fn remove_cdi(&self, claim_uid: &str, shares: &[ShareRecord]) -> Result<(), String> {
        let drivers: HashSet<&str> = shares
            .iter()
            .filter(|r| self.cdi_device(r).is_some())
            .map(|r| r.driver.as_str())
            .collect();
        for driver in drivers {
            self.cdi_writer(driver)?
                .remove_claim(claim_uid)
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// What the share's device needs in a CDI spec; None for devices without one.
    fn cdi_device(&self, r: &ShareRecord) -> Option<shareguard_common::limiter::CdiDevice> {
        self.limiter(&r.device)?.cdi_device(&r.device, &r.key)
    }

    fn cdi_writer(&self, driver: &str) -> Result<CdiWriter, String> {
        // The device's driver name (a DNS subdomain) is the CDI vendor, as NVIDIA's
        // driver uses nvidia.com: the kind reads `<driver>/gpu`.
        CdiWriter::new(CdiConfig {
            dir: self.cfg.agent.cdi_dir.clone(),
            vendor: driver.to_owned(),
            class: "gpu".to_owned(),
        })
        .map_err(|e| e.to_string())
    }
}
