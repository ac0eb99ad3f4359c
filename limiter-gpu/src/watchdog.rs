//! The watchdog's decisions, free of I/O: which share uses how much memory, which are
//! over their limit, and which processes to terminate.
//!
//! The agent feeds it the running compute processes of each GPU (from the back end), a
//! pid -> pod function (from `/proc/PID/cgroup`, see [`crate::cgroup`]) and the share
//! table; it acts on the verdict (events, metrics, audit lines, terminations). Keeping
//! the decisions pure lets the rules below be tested exactly:
//!
//! - usage is attributed per (pod, GPU). Several shares of one pod on one GPU cannot be
//!   told apart by the driver, so they form one group whose limit is their sum;
//! - a group over its limit raises an event when it crosses, and stays listed while over;
//! - with `terminate`, a group that has been over for at least the grace period loses its
//!   largest processes until the rest fits, each process signalled once; a process is
//!   only ever chosen from the group's own pod on that GPU;
//! - processes of no known share are listed as unattributed, never terminated;
//! - a process whose usage the driver does not report is not counted as zero: the
//!   group's figure is then a lower bound, and the process is listed as unknown;
//! - a client of an MPS server is stopped through its server (`terminate_client`), never
//!   with SIGKILL, which can hang or corrupt the server's other clients (see
//!   [`crate::limiter::GpuLimiter::terminate`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

/// What to do when a share is over its limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Report,
    /// Terminate processes once the share has been over its limit for `grace`.
    Terminate {
        grace: Duration,
    },
}

/// One share as the watchdog sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchedShare {
    pub share_key: String,
    pub pod_uid: String,
    pub gpu_uuid: String,
    pub limit_bytes: u64,
    pub action: Action,
}

/// One running compute process, as the back end reported it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessUsage {
    pub gpu_uuid: String,
    pub pid: u32,
    /// None where the driver cannot say; such a process is listed as of unknown usage,
    /// adds nothing to the known figure and is never chosen for termination, since
    /// killing it cannot be shown to help.
    pub used_bytes: Option<u64>,
    /// A client of an MPS server: stopped through the server, not signalled.
    pub via_mps: bool,
}

/// Usage of one (pod, GPU) group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareUsage {
    /// The shares of the group, sorted.
    pub share_keys: Vec<String>,
    pub pod_uid: String,
    pub gpu_uuid: String,
    /// What the processes of known usage use: a lower bound when `unknown_pids` is not
    /// empty.
    pub used_bytes: u64,
    pub limit_bytes: u64,
    pub pids: Vec<u32>,
    /// Processes of the group whose usage the driver does not report.
    pub unknown_pids: Vec<u32>,
}

impl ShareUsage {
    pub fn over_limit(&self) -> bool {
        self.used_bytes > self.limit_bytes
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverLimit {
    pub share_keys: Vec<String>,
    pub pod_uid: String,
    pub gpu_uuid: String,
    pub used_bytes: u64,
    pub limit_bytes: u64,
    /// When the group was first seen over its limit in the current episode.
    pub since: Instant,
    /// True on the evaluation where the group crossed the limit: emit the event then.
    pub new: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TerminateDecision {
    pub share_keys: Vec<String>,
    pub pod_uid: String,
    pub gpu_uuid: String,
    pub pid: u32,
    pub used_bytes: u64,
    /// Stop it through its MPS server (see [`ProcessUsage::via_mps`]).
    pub via_mps: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub usage: Vec<ShareUsage>,
    pub over_limit: Vec<OverLimit>,
    pub terminate: Vec<TerminateDecision>,
    /// (GPU, pid) of processes that belong to no share on that GPU.
    pub unattributed: Vec<(String, u32)>,
}

/// How a termination ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminated {
    Signalled,
    /// An MPS client whose GPU work its server ended (`terminate_client`); the process
    /// itself may live on without the GPU.
    MpsClientTerminated,
    /// An MPS client whose GPU work its server ended, and whose server still held its
    /// memory: the process was then killed (safe once its work is ended), and the server
    /// lets go when it has exited.
    MpsClientKilled,
    /// The process had already exited.
    AlreadyGone,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TerminateError {
    /// The pid no longer belongs to the pod (it exited and the pid was reused): refused.
    #[error("pid {pid} is not in pod {expected} (found {found:?}); not signalled")]
    NotInPod {
        pid: u32,
        expected: String,
        found: Option<String>,
    },
    #[error("terminate failed: {0}")]
    Failed(String),
}

/// Sends the termination; the real one is [`crate::sys::PidfdTerminator`].
pub trait ProcessTerminator: Send + Sync {
    /// Terminates `pid` if, and only if, it still belongs to pod `pod_uid`.
    fn terminate(&self, pid: u32, pod_uid: &str) -> Result<Terminated, TerminateError>;
}

type GroupKey = (String, String); // (pod uid, GPU uuid)

#[derive(Default)]
struct Episode {
    since: Option<Instant>,
    signalled: HashSet<u32>,
}

/// Remembers, between evaluations, since when each group is over its limit and which
/// processes it has already had signalled.
#[derive(Default)]
pub struct Watchdog {
    episodes: HashMap<GroupKey, Episode>,
}

struct Group<'a> {
    shares: Vec<&'a WatchedShare>,
    limit: u64,
    procs: Vec<&'a ProcessUsage>,
}

impl Watchdog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn evaluate<F>(
        &mut self,
        now: Instant,
        processes: &[ProcessUsage],
        mut pod_of: F,
        shares: &[WatchedShare],
    ) -> Verdict
    where
        F: FnMut(u32) -> Option<String>,
    {
        let mut groups: BTreeMap<GroupKey, Group<'_>> = BTreeMap::new();
        for s in shares {
            let g = groups
                .entry((s.pod_uid.clone(), s.gpu_uuid.clone()))
                .or_insert_with(|| Group {
                    shares: Vec::new(),
                    limit: 0,
                    procs: Vec::new(),
                });
            g.shares.push(s);
            g.limit = g.limit.saturating_add(s.limit_bytes);
        }

        let mut verdict = Verdict::default();
        let mut pod_cache: HashMap<u32, Option<String>> = HashMap::new();
        for p in processes {
            let pod = pod_cache.entry(p.pid).or_insert_with(|| pod_of(p.pid));
            let group = pod
                .as_ref()
                .and_then(|uid| groups.get_mut(&(uid.clone(), p.gpu_uuid.clone())));
            match group {
                Some(g) => g.procs.push(p),
                None => verdict.unattributed.push((p.gpu_uuid.clone(), p.pid)),
            }
        }

        // Forget groups that no longer exist.
        self.episodes.retain(|k, _| groups.contains_key(k));

        for ((pod_uid, gpu_uuid), g) in &groups {
            let mut share_keys: Vec<String> =
                g.shares.iter().map(|s| s.share_key.clone()).collect();
            share_keys.sort();
            let used = g
                .procs
                .iter()
                .fold(0u64, |acc, p| acc.saturating_add(p.used_bytes.unwrap_or(0)));
            let mut pids: Vec<u32> = g.procs.iter().map(|p| p.pid).collect();
            pids.sort_unstable();
            let mut unknown_pids: Vec<u32> = g
                .procs
                .iter()
                .filter(|p| p.used_bytes.is_none())
                .map(|p| p.pid)
                .collect();
            unknown_pids.sort_unstable();
            verdict.usage.push(ShareUsage {
                share_keys: share_keys.clone(),
                pod_uid: pod_uid.clone(),
                gpu_uuid: gpu_uuid.clone(),
                used_bytes: used,
                limit_bytes: g.limit,
                pids,
                unknown_pids,
            });

            let key = (pod_uid.clone(), gpu_uuid.clone());
            if used <= g.limit {
                self.episodes.remove(&key);
                continue;
            }
            let ep = self.episodes.entry(key).or_default();
            let new = ep.since.is_none();
            let since = *ep.since.get_or_insert(now);
            verdict.over_limit.push(OverLimit {
                share_keys: share_keys.clone(),
                pod_uid: pod_uid.clone(),
                gpu_uuid: gpu_uuid.clone(),
                used_bytes: used,
                limit_bytes: g.limit,
                since,
                new,
            });

            let Some(grace) = group_grace(&g.shares) else {
                continue;
            };
            if now.saturating_duration_since(since) < grace {
                continue;
            }
            // Signalled processes are on their way out: count them as freed, then pick
            // the largest of the rest until what is left fits.
            ep.signalled
                .retain(|pid| g.procs.iter().any(|p| p.pid == *pid));
            let mut candidates: Vec<(u32, u64, bool)> = g
                .procs
                .iter()
                .filter(|p| !ep.signalled.contains(&p.pid))
                .filter_map(|p| {
                    p.used_bytes
                        .filter(|b| *b > 0)
                        .map(|b| (p.pid, b, p.via_mps))
                })
                .collect();
            // Unknown or zero usage adds nothing, so the candidates hold all of it.
            let mut remaining = candidates
                .iter()
                .fold(0u64, |acc, (_, b, _)| acc.saturating_add(*b));
            // Largest first; ties by pid so the choice is deterministic.
            candidates.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            for (pid, bytes, via_mps) in candidates {
                if remaining <= g.limit {
                    break;
                }
                remaining = remaining.saturating_sub(bytes);
                ep.signalled.insert(pid);
                verdict.terminate.push(TerminateDecision {
                    share_keys: share_keys.clone(),
                    pod_uid: pod_uid.clone(),
                    gpu_uuid: gpu_uuid.clone(),
                    pid,
                    used_bytes: bytes,
                    via_mps,
                });
            }
        }
        verdict
    }
}

/// A group terminates only if every share in it asked for it: a share that asked to
/// be reported must not lose processes because of a neighbour's policy. The longest
/// grace period of the group applies.
fn group_grace(shares: &[&WatchedShare]) -> Option<Duration> {
    let mut grace = Duration::ZERO;
    for s in shares {
        match s.action {
            Action::Report => return None,
            Action::Terminate { grace: g } => grace = grace.max(g),
        }
    }
    Some(grace)
}

/// Carries out the terminations of a verdict with `terminate` and logs each outcome.
/// The agent's `terminate` is [`crate::limiter::GpuLimiter::terminate`], which picks the
/// way to stop each process.
pub fn execute_terminations(
    verdict: &Verdict,
    terminate: impl Fn(&TerminateDecision) -> Result<Terminated, TerminateError>,
) -> Vec<(TerminateDecision, Result<Terminated, TerminateError>)> {
    verdict
        .terminate
        .iter()
        .map(|d| {
            let r = terminate(d);
            match &r {
                Ok(t) => tracing::warn!(
                    pid = d.pid,
                    pod_uid = %d.pod_uid,
                    gpu = %d.gpu_uuid,
                    shares = ?d.share_keys,
                    used_bytes = d.used_bytes,
                    outcome = ?t,
                    "GPU watchdog terminated a process of a share over its memory limit"
                ),
                Err(e) => tracing::error!(
                    pid = d.pid,
                    pod_uid = %d.pod_uid,
                    gpu = %d.gpu_uuid,
                    shares = ?d.share_keys,
                    error = %e,
                    "GPU watchdog could not terminate a process"
                ),
            }
            (d.clone(), r)
        })
        .collect()
}

#[cfg(test)]
#[path = "watchdog_tests.rs"]
mod tests;
