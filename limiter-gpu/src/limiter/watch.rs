//! What the watchdog asks of the limiter: the shares to watch, the GPUs, each process's
//! usage, and terminations carried out through the share's mechanism.

use super::*;

impl GpuLimiter {
    /// The share table as the watchdog needs it, every share with `action`.
    pub fn watched_shares(&self, action: Action) -> Vec<WatchedShare> {
        self.watched_shares_by(|_| action)
    }

    /// The share table as the watchdog needs it, each share with its device's action.
    pub fn watched_shares_by(&self, action_of: impl Fn(&str) -> Action) -> Vec<WatchedShare> {
        // A share of several pods is watched in each of them (the engine reports such a
        // share as not enforced for them together).
        self.lock()
            .iter()
            .flat_map(|(k, r)| {
                r.pod_uids.iter().map(|pod| WatchedShare {
                    share_key: k.clone(),
                    pod_uid: pod.clone(),
                    gpu_uuid: r.uuid.clone(),
                    limit_bytes: r.bytes,
                    action: if r.observed {
                        Action::Report
                    } else {
                        action_of(&r.device)
                    },
                })
            })
            .collect()
    }

    /// UUIDs of the GPUs behind the configured devices, each once.
    pub fn gpu_uuids(&self) -> Vec<String> {
        let mut v: Vec<String> = self.devices.values().map(|d| d.gpu.uuid.clone()).collect();
        v.sort();
        v.dedup();
        v
    }

    /// Stops a process the watchdog chose: a client of an MPS server through the server
    /// of its share's daemon (`terminate_client`), any other with `signal` (SIGKILL after
    /// the pod check). A client no daemon of the group's shares serves is left alone:
    /// SIGKILL of an MPS client can hang or corrupt the other clients of its server, which
    /// may be another tenant's. A client whose server ended its work but still holds its
    /// memory (driver 580 does until the process exits) is then killed with `signal`:
    /// with its work ended, nothing of the server's other clients depends on it.
    pub fn terminate(
        &self,
        d: &TerminateDecision,
        signal: &dyn ProcessTerminator,
    ) -> Result<Terminated, TerminateError> {
        if !d.via_mps {
            return signal.terminate(d.pid, &d.pod_uid);
        }
        let daemons: Vec<(String, String)> = self
            .lock()
            .iter()
            .filter(|(k, r)| r.mechanism == Mechanism::Mps && d.share_keys.contains(k))
            .map(|(k, r)| (k.clone(), r.uuid.clone()))
            .collect();
        for (key, uuid) in daemons {
            match self.backend.terminate_mps_client(&uuid, &key, d.pid) {
                Ok(true) => return Ok(Terminated::MpsClientTerminated),
                Ok(false) => {}
                Err(held @ GpuError::MpsClientHeld { .. }) => {
                    return match signal.terminate(d.pid, &d.pod_uid)? {
                        Terminated::Signalled => Ok(Terminated::MpsClientKilled),
                        other => Ok(other),
                    }
                    .inspect(|_| tracing::info!(pid = d.pid, share = %key, why = %held, "MPS client killed after terminate_client"));
                }
                Err(e) => {
                    return Err(TerminateError::Failed(format!(
                        "terminate_client through the MPS daemon of share {key}: {e}"
                    )));
                }
            }
        }
        // The agent sees the host's PIDs (NVML reports those).
        if !Path::new("/proc").join(d.pid.to_string()).exists() {
            return Ok(Terminated::AlreadyGone);
        }
        Err(TerminateError::Failed(format!(
            "pid {} is an MPS client of no daemon the agent runs for its share; not killed, \
             since SIGKILL of an MPS client can hang or corrupt the other clients of its server",
            d.pid
        )))
    }

    /// Every compute process on this limiter's GPUs, as the watchdog takes them. Every
    /// GPU is asked, and what each answered is kept as its health
    /// ([`GpuLimiter::device_facts`]); the first failure fails the poll.
    pub fn process_usage(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        let mut out = Vec::new();
        let mut first_err = None;
        for uuid in self.gpu_uuids() {
            let answer = self.backend.compute_processes(&uuid);
            self.answered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(uuid.clone(), answer.as_ref().err().map(ToString::to_string));
            match answer {
                Ok(procs) => out.extend(procs.into_iter().map(|p| ProcessUsage {
                    gpu_uuid: uuid.clone(),
                    pid: p.pid,
                    used_bytes: p.used_bytes,
                    via_mps: p.via_mps,
                })),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}
