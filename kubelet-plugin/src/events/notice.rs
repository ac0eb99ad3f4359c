//! What is worth an Event, and in which words: a claim the node refused, a share that
//! went DEGRADED or FAILED, and a share enforced after it waited. Pure functions of what
//! the agent answered; [`super::recorder`] decides whether and where they are written.

use shareguard_proto::v1 as pb;

/// The two Event types Kubernetes knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Normal,
    Warning,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// One Event's content, the same on the claim and on each of its pods.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Notice {
    pub kind: Kind,
    /// CamelCase, what `kubectl get events` shows as REASON.
    pub reason: &'static str,
    /// What the plugin was doing (events.k8s.io `action`).
    pub action: &'static str,
    /// The message, in words a claim's owner can act on.
    pub note: String,
}

/// `action` of a refusal in NodePrepareResources.
pub const PREPARE: &str = "PrepareResources";
/// `action` of a change the agent made or found while enforcing.
pub const ENFORCE: &str = "Enforce";

/// A claim this node refused in NodePrepareResources: `code` is the agent's gRPC code
/// name, or None where the plugin itself could not build the request (the claim
/// unreadable, an allocation not on this node). kubelet calls again, so the pod waits
/// in ContainerCreating; the reason says whose move it is.
pub fn refused(node: &str, driver: &str, code: Option<&str>, message: &str) -> Notice {
    let (reason, hint) = match code {
        Some("ResourceExhausted") => (
            "CapacityExceeded",
            "the node's own ledger has less free than the scheduler allocated; the claim waits until capacity is released",
        ),
        Some("InvalidArgument") => (
            "AllocationInvalid",
            "the allocation does not fit the device's request policy on this node",
        ),
        Some("PermissionDenied") => (
            "NamespaceNotAllowed",
            "the claim's namespace may not use this device (the agent's allowed_namespaces)",
        ),
        Some("AlreadyExists") => (
            "AllocationConflict",
            "a share of this allocation is already held with other amounts",
        ),
        Some("Unavailable") => (
            "AgentUnavailable",
            "the node agent cannot take claims now; kubelet retries",
        ),
        _ => ("PrepareFailed", "kubelet retries"),
    };
    Notice {
        kind: Kind::Warning,
        reason,
        action: PREPARE,
        note: format!("{driver} on node {node} refused the claim: {message} ({hint})"),
    }
}

fn phase(p: i32) -> Option<pb::Phase> {
    pb::Phase::try_from(p).ok()
}

/// Which share, in words: its id (or device for a whole one) and device.
fn which(s: &pb::ShareStatus, node: &str) -> String {
    if s.share_id.is_empty() {
        format!("device {} on node {node}", s.device)
    } else {
        format!("share {} of device {} on node {node}", s.share_id, s.device)
    }
}

/// "bandwidth 100M" for each capacity read back.
fn limits(s: &pb::ShareStatus) -> String {
    let held: Vec<String> = s
        .limits
        .iter()
        .filter(|l| !l.enforced.is_empty())
        .map(|l| format!("{} {}", l.name, l.enforced))
        .collect();
    if held.is_empty() {
        String::from("its limit")
    } else {
        held.join(", ")
    }
}

/// The Event a share's move from `before` (None: first seen) to `now` calls for, if
/// any. Only moves are told: a share first seen in a phase (after a restart of the
/// plugin) is not, or every restart would repeat every warning.
pub fn on_change(
    before: Option<&pb::ShareStatus>,
    now: &pb::ShareStatus,
    node: &str,
) -> Option<Notice> {
    let from = phase(before?.phase)?;
    let to = phase(now.phase)?;
    if from == to {
        return None;
    }
    let why = if now.reason.is_empty() {
        now.error
            .as_ref()
            .map(|e| e.message.clone())
            .unwrap_or_default()
    } else {
        now.reason.clone()
    };
    match to {
        pb::Phase::Degraded => Some(Notice {
            kind: Kind::Warning,
            reason: "ShareDegraded",
            action: ENFORCE,
            note: format!(
                "{}: enforcement no longer verifies ({why}); the agent repairs it, capacity stays held",
                which(now, node)
            ),
        }),
        pb::Phase::Failed => {
            let retry = match now.error.as_ref() {
                Some(e) if e.retryable => "the agent retries",
                _ => {
                    "not retried: what the reason names must be fixed on the node, then the pod created again"
                }
            };
            Some(Notice {
                kind: Kind::Warning,
                reason: "ShareFailed",
                action: ENFORCE,
                note: format!("{}: not enforced ({why}); {retry}", which(now, node)),
            })
        }
        pb::Phase::Enforced => {
            let after = match from {
                pb::Phase::Pending => "after waiting for the pod's sandbox",
                pb::Phase::Degraded => "again, after a repair",
                pb::Phase::Unknown => "again, verified after the agent's restart",
                pb::Phase::Observed => "as its device left the observe stage",
                _ => return None,
            };
            Some(Notice {
                kind: Kind::Normal,
                reason: "ShareEnforced",
                action: ENFORCE,
                note: format!(
                    "{}: {} enforced and read back ({}) {after}",
                    which(now, node),
                    limits(now),
                    now.mechanism
                ),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(phase: pb::Phase, reason: &str) -> pb::ShareStatus {
        pb::ShareStatus {
            share_id: "0b6a4c9e-1111-4c3e-9f00-000000000001".into(),
            device: "nic-0".into(),
            phase: phase as i32,
            mechanism: "htb-ebpf".into(),
            reason: reason.into(),
            limits: vec![pb::CapacityLimit {
                name: "bandwidth".into(),
                requested: "100M".into(),
                enforced: "100M".into(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn only_moves_into_trouble_or_out_of_waiting_are_told() {
        use pb::Phase::*;
        let told = |from: Option<pb::Phase>, to: pb::Phase| {
            let before = from.map(|p| share(p, ""));
            on_change(before.as_ref(), &share(to, "drift: root qdisc gone"), "n1")
                .map(|n| (n.kind, n.reason))
        };
        assert_eq!(
            told(Some(Pending), Enforced),
            Some((Kind::Normal, "ShareEnforced"))
        );
        assert_eq!(
            told(Some(Degraded), Enforced),
            Some((Kind::Normal, "ShareEnforced"))
        );
        assert_eq!(
            told(Some(Enforced), Degraded),
            Some((Kind::Warning, "ShareDegraded"))
        );
        assert_eq!(
            told(Some(Pending), Failed),
            Some((Kind::Warning, "ShareFailed"))
        );
        // Enforced at once, a repeat of the phase, a share first seen (a restart of the
        // plugin), a release: nothing to tell.
        assert_eq!(told(Some(Preparing), Enforced), None);
        assert_eq!(told(Some(Degraded), Degraded), None);
        assert_eq!(told(None, Degraded), None);
        assert_eq!(told(Some(Enforced), Releasing), None);
        assert_eq!(told(Some(Enforced), Pending), None);
    }

    #[test]
    fn the_note_says_which_share_what_is_held_and_why() {
        let n = on_change(
            Some(&share(pb::Phase::Pending, "")),
            &share(pb::Phase::Enforced, ""),
            "worker-1",
        )
        .unwrap();
        assert_eq!(
            n.note,
            "share 0b6a4c9e-1111-4c3e-9f00-000000000001 of device nic-0 on node worker-1: bandwidth 100M enforced and read back (htb-ebpf) after waiting for the pod's sandbox"
        );
        let mut failed = share(pb::Phase::Failed, "");
        failed.error = Some(pb::Error {
            code: "FailedPrecondition".into(),
            message: "no qdisc htb".into(),
            retryable: false,
            field: String::new(),
        });
        let n = on_change(Some(&share(pb::Phase::Pending, "")), &failed, "w").unwrap();
        assert!(n.note.contains("(no qdisc htb)"), "{}", n.note);
        assert!(n.note.contains("not retried"), "{}", n.note);
    }

    #[test]
    fn a_refusal_names_the_reason_by_the_agents_code() {
        let n = refused(
            "w1",
            "net.example.com",
            Some("ResourceExhausted"),
            "ResourceExhausted: 10G asked, 2G free",
        );
        assert_eq!(
            (n.kind, n.reason, n.action),
            (Kind::Warning, "CapacityExceeded", PREPARE)
        );
        assert!(
            n.note.starts_with(
                "net.example.com on node w1 refused the claim: ResourceExhausted: 10G asked"
            ),
            "{}",
            n.note
        );
        assert_eq!(
            refused("w", "d", Some("PermissionDenied"), "x").reason,
            "NamespaceNotAllowed"
        );
        assert_eq!(
            refused("w", "d", None, "claim not found").reason,
            "PrepareFailed"
        );
    }
}
