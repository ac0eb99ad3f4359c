//! What the driver holds for a share, read back per mechanism: the cgroup limit on every
//! leaf, the MPS daemon's limit and its clients' servers, or the watchdog's table.

use super::*;

impl GpuLimiter {
    /// Reads the limit back. The share counts as enforced only when every one of its
    /// cgroups carries exactly the expected limit; anything else yields no `enforced`
    /// entry, which the agent reports as DEGRADED rather than trusting it.
    pub(super) fn read_back(&self, key: &str, rec: &ShareRecord) -> Result<Enforcement, GpuError> {
        // The bytes in force when the read-back agrees: the share's memory, or for MPS
        // the bound on its processes together (see below).
        let mut per_process = None;
        let mut notes: Vec<String> = rec.note.iter().cloned().collect();
        let in_force = match rec.mechanism {
            Mechanism::NvmlCgroup => {
                let mut all = true;
                for cg in &rec.cgroups {
                    let want = self.cgroup_total(&rec.uuid, cg);
                    for t in self.targets(cg) {
                        let got = self.backend.cgroup_limit(&rec.uuid, &t)?;
                        if got.map(|l| l.hard_bytes) != Some(want) {
                            tracing::warn!(
                                share = key,
                                cgroup = %t.display(),
                                want,
                                got = ?got,
                                "GPU memory limit read back differs"
                            );
                            all = false;
                        }
                    }
                }
                all.then_some(rec.bytes)
            }
            Mechanism::Mps => {
                let want = enforceable_bytes(rec.bytes);
                let got = self.backend.mps_limit(&rec.uuid, key)?;
                if !got.is_some_and(|l| l.admits(want)) {
                    tracing::warn!(share = key, want, got = ?got, "MPS limit read back differs");
                    None
                } else {
                    let seen = self.mps_clients(rec)?;
                    if let Some(pid) = seen.root {
                        // Root without a user namespace owns the pipe directory: it can
                        // serve the daemon's socket itself or remove it, so what the
                        // daemon holds no longer binds the share.
                        tracing::warn!(
                            share = key,
                            pid,
                            pods = ?rec.pod_uids,
                            "a process of the share's pod runs as root outside a user namespace: MPS does not hold it"
                        );
                        notes.push(format!(
                            "MPS refused for a root tenant: process {pid} of the share's pod runs as root outside a user namespace and could take over the MPS daemon's sockets; run the pod as non-root or with hostUsers: false"
                        ));
                        None
                    } else if let Some(pid) = seen.outside {
                        // The daemon holds the limit, but this process never asked it: a
                        // container that lost or replaced CUDA_MPS_PIPE_DIRECTORY runs on
                        // the GPU directly, unlimited.
                        tracing::warn!(
                            share = key,
                            pid,
                            pods = ?rec.pod_uids,
                            "a process of the share's pod uses the GPU outside its MPS daemon"
                        );
                        None
                    } else {
                        // MPS bounds each client process on its own, not the server:
                        // two clients of the share may hold twice the limit. What holds
                        // the share as a whole is the limit times its clients, and that
                        // is what is reported; one client (or none yet) is the share's
                        // limit itself.
                        per_process = Some((want, seen.clients));
                        Some(want.saturating_mul(seen.clients.max(1)))
                    }
                }
            }
            Mechanism::Watchdog => None,
        };
        let mut enforced = BTreeMap::new();
        if let Some(bytes) = in_force {
            enforced.insert(MEMORY.to_string(), quantity(bytes)?);
        }
        let mut resolution = BTreeMap::new();
        let mut per = BTreeMap::new();
        if let Some((each, processes)) = per_process {
            // MPS limits are whole MiB, rounded down from the share's memory.
            resolution.insert(MEMORY.to_string(), quantity(MPS_STEP)?);
            per.insert(
                MEMORY.to_string(),
                PerProcess {
                    each: quantity(each)?,
                    processes,
                },
            );
        }
        Ok(Enforcement {
            mechanism: self.label(rec.mechanism),
            enforced,
            watch_only: !rec.mechanism.enforces(),
            simulated: self.backend.is_simulated(),
            unconstrained: Default::default(),
            // Cgroup limits are whole bytes, as requested: no rounding to allow for.
            resolution,
            per_process: per,
            notes,
            observed: false,
        })
    }
}
