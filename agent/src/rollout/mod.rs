//! Rollout stages: each device is in `observe` (its shares are admitted, counted in the
//! ledger and their pods found, and nothing is limited: phase OBSERVED) or `enforce`.
//! The config sets a device's first stage; `SetStage` changes it at runtime, and the
//! store keeps it from then on, so a restart does not undo an operator's rollback.
//! Going back to `observe` is the rollback: the limits are lifted, every share and its
//! capacity stay.
//!
//! The engine asks [`observing::Observing`] instead of the device's limiter while the
//! device observes, so every path that applies, verifies or removes (Prepare, the
//! sandbox loop, the reconciler, recovery) follows the stage without knowing of it.

pub mod measure;
pub mod observing;

use serde::{Deserialize, Serialize};

/// A device's stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// Published, admitted, counted, pods found; nothing limited.
    Observe,
    #[default]
    Enforce,
}

impl Stage {
    pub const ALL: [Stage; 2] = [Stage::Observe, Stage::Enforce];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Observe => "observe",
            Stage::Enforce => "enforce",
        }
    }

    /// `observe` or `enforce`, in any case.
    pub fn parse(s: &str) -> Option<Stage> {
        Stage::ALL
            .into_iter()
            .find(|st| st.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// What the store keeps of a device's stage (`meta/stage/<device>`, versioned like every
/// record): the stage, when it was set, and by which caller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub stage: Stage,
    pub changed_at_ms: u64,
    /// The caller's uid (None: never set at runtime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub caller_uid: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_parse_by_name_only() {
        assert_eq!(Stage::parse("observe"), Some(Stage::Observe));
        assert_eq!(Stage::parse(" ENFORCE "), Some(Stage::Enforce));
        assert_eq!(Stage::parse("enforced"), None);
        assert_eq!(Stage::parse(""), None);
        assert_eq!(Stage::default(), Stage::Enforce);
    }

    #[test]
    fn a_stage_record_reads_back_as_written() {
        let r = StageRecord {
            stage: Stage::Observe,
            changed_at_ms: 7,
            caller_uid: Some(0),
        };
        let bytes = crate::record::encode(&r);
        assert_eq!(crate::record::decode::<StageRecord>(&bytes).unwrap(), r);
        assert!(String::from_utf8_lossy(&bytes).contains("\"observe\""));
    }
}
