//! A Prepare or Unprepare as the caller sent it, before any check. The API translates
//! its protobuf into these field for field, deciding nothing; the engine checks them
//! (`validate`). Names follow the API's, so that an error names the field the caller
//! sent (`claims[0].allocations[1].consumed_capacity[memory]`); empty strings stand for
//! unset, as on the wire.

use std::collections::HashMap;

/// A ResourceClaim: its uid, namespace and name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimRef {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

/// The pods a claim is for, and the caller's hints about where they run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodTarget {
    /// Pod uids, as in the claim's `status.reservedFor`.
    pub pod_uids: Vec<String>,
    /// cgroup v2 paths the caller says are the pod's (checked: I9).
    pub cgroup_paths: Vec<String>,
    /// The network namespace the caller says is the pod's (checked: I9).
    pub netns_path: String,
    /// The interface inside the pod's namespace.
    pub interface: String,
}

/// `validRange` of a request-policy snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValidRange {
    pub min: String,
    pub max: String,
    pub step: String,
}

/// The request policy the scheduler used for one capacity (its ResourceSlice's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapacityPolicy {
    pub default: String,
    pub valid_values: Vec<String>,
    pub valid_range: Option<ValidRange>,
}

/// One allocation result of a claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceAllocation {
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// Empty for a dedicated allocation, which takes the whole device.
    pub share_id: String,
    /// Capacity name -> quantity string.
    pub consumed_capacity: HashMap<String, String>,
    /// Capacity name -> the policy snapshot the scheduler rounded by.
    pub policy: HashMap<String, CapacityPolicy>,
    pub policy_version: String,
    pub admin_access: bool,
}

/// One claim of a Prepare.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimPrepare {
    pub claim: Option<ClaimRef>,
    /// Changes when the claim is re-allocated.
    pub allocation_id: String,
    pub target: Option<PodTarget>,
    pub allocations: Vec<DeviceAllocation>,
    /// From the plugin's binding gate, before the pod is bound (see `ShareRecord::pre_bind`).
    pub pre_bind: bool,
}
