//! Input validation: every field of a request is checked before anything is looked up or
//! changed, and a refusal names the field and the reason.

use std::collections::{BTreeMap, BTreeSet};

use shareguard_common::Quantity;

use crate::{
    config::Config,
    error::ClaimError,
    policy::Policy,
    record::{ClaimId, TargetHints, TargetRecord},
    request,
};

/// A claim has at most this many allocation results (Kubernetes' own limit).
pub const MAX_ALLOCATIONS_PER_CLAIM: usize = 32;
pub const MAX_ID_LEN: usize = 128;
/// Bounds on what a record keeps of a target, so that a record stays far below the size
/// at which sled writes a value to a file of its own (see `record::MAX_RECORD_BYTES`).
pub const MAX_PATH_LEN: usize = 512;
pub const MAX_CGROUP_PATHS: usize = 8;
/// Pods one claim may be reserved for (Kubernetes allows 256 consumers; a share used by
/// more than a few pods on one node cannot be enforced per pod anyway).
pub const MAX_PODS: usize = 16;
/// Linux IFNAMSIZ minus the terminating NUL.
const MAX_IFNAME_LEN: usize = 15;

#[derive(Clone, Debug)]
pub struct ValidAlloc {
    /// Index in the request, for error fields.
    pub index: usize,
    pub key: String,
    pub share_id: Option<String>,
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    pub consumed: BTreeMap<String, Quantity>,
    pub policy_version: String,
    pub admin_access: bool,
}

#[derive(Clone, Debug)]
pub struct ValidClaim {
    pub index: usize,
    pub claim: ClaimId,
    pub allocation_id: String,
    /// The pods and hints as checked here; the hints are verified against the pods'
    /// sandboxes at admission, where `netns_path` becomes `target.netns_inode`.
    pub target: TargetRecord,
    pub netns_path: Option<String>,
    pub allocs: Vec<ValidAlloc>,
    pub pre_bind: bool,
}

pub fn dedicated_key(claim_uid: &str, device: &str) -> String {
    format!("dedicated/{claim_uid}/{device}")
}

/// A lowercase UUIDv4 as the scheduler writes shareIDs.
pub fn check_share_id(s: &str) -> Result<(), String> {
    if s.len() != 36 {
        return Err(format!("{s:?} is not a UUID (36 characters)"));
    }
    if s.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(format!("{s:?} must be lowercase"));
    }
    for (i, b) in s.bytes().enumerate() {
        let ok = match i {
            8 | 13 | 18 | 23 => b == b'-',
            14 => b == b'4',
            19 => matches!(b, b'8' | b'9' | b'a' | b'b'),
            _ => b.is_ascii_hexdigit(),
        };
        if !ok {
            return Err(format!(
                "{s:?} is not a lowercase UUIDv4 (xxxxxxxx-xxxx-4xxx-[89ab]xxx-xxxxxxxxxxxx)"
            ));
        }
    }
    Ok(())
}

pub use shareguard_common::slice::{
    is_c_identifier, is_dns_label, is_dns_subdomain, is_driver_name, is_namespace, is_pool_name,
    is_qualified_name,
};

/// Identifiers the agent uses in store keys and audit lines: uids, allocation ids.
fn check_id(field: &str, s: &str) -> Result<(), ClaimError> {
    if s.is_empty() {
        return Err(ClaimError::invalid(field, "required"));
    }
    if s.len() > MAX_ID_LEN {
        return Err(ClaimError::invalid(
            field,
            format!("longer than {MAX_ID_LEN} characters"),
        ));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(ClaimError::invalid(
            field,
            format!("{s:?} may contain only letters, digits, '-', '_' and '.'"),
        ));
    }
    Ok(())
}

/// A lowercase UUID, as the API server writes object uids (any version).
pub fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_digit() || (b'a'..=b'f').contains(&b),
        })
}

/// A claim uid: an id without '.', since it names the claim's CDI spec file and devices.
fn check_claim_uid(field: &str, s: &str) -> Result<(), ClaimError> {
    check_id(field, s)?;
    if s.contains('.') {
        return Err(ClaimError::invalid(
            field,
            format!("{s:?} may contain only letters, digits, '-' and '_'"),
        ));
    }
    Ok(())
}

pub fn validate_claim_ref(
    field: &str,
    c: Option<&request::ClaimRef>,
) -> Result<ClaimId, ClaimError> {
    let c = c.ok_or_else(|| ClaimError::invalid(field, "required"))?;
    check_claim_uid(&format!("{field}.uid"), &c.uid)?;
    if !is_namespace(&c.namespace) {
        return Err(ClaimError::invalid(
            format!("{field}.namespace"),
            format!("{:?} is not a namespace name (RFC 1123 label)", c.namespace),
        ));
    }
    if !is_dns_subdomain(&c.name) {
        return Err(ClaimError::invalid(
            format!("{field}.name"),
            format!("{:?} is not an object name (RFC 1123 subdomain)", c.name),
        ));
    }
    Ok(ClaimId {
        uid: c.uid.clone(),
        namespace: c.namespace.as_str().into(),
        name: c.name.as_str().into(),
    })
}

/// Unprepare only needs the uid to find the claim. '.' stays allowed here, so that a
/// claim admitted before it was refused can still be released.
pub fn validate_claim_uid(field: &str, c: &request::ClaimRef) -> Result<(), ClaimError> {
    check_id(&format!("{field}.uid"), &c.uid)
}

fn check_path_components(field: &str, p: &str) -> Result<(), ClaimError> {
    if p.len() > MAX_PATH_LEN {
        return Err(ClaimError::invalid(
            field,
            format!("longer than {MAX_PATH_LEN} bytes"),
        ));
    }
    if p.bytes().any(|b| b == 0 || b.is_ascii_control()) {
        return Err(ClaimError::invalid(field, "contains control characters"));
    }
    let rest = p.strip_prefix('/').unwrap_or(p);
    for comp in rest.split('/') {
        match comp {
            "" => {
                return Err(ClaimError::invalid(
                    field,
                    format!("{p:?} has an empty path component"),
                ));
            }
            "." | ".." => {
                return Err(ClaimError::invalid(
                    field,
                    format!("{p:?}: path traversal ('{comp}') is not allowed"),
                ));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Network namespaces the kubelet and CNI plugins use: bind mounts under /run/netns or
/// /var/run/netns, or a process's namespace under /proc. Anything else could make the
/// agent enter a namespace it was never meant to touch.
fn check_netns_path(field: &str, p: &str) -> Result<(), ClaimError> {
    check_path_components(field, p)?;
    let under = |prefix: &str| {
        p.strip_prefix(prefix)
            .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
    };
    let proc_ns = p
        .strip_prefix("/proc/")
        .and_then(|rest| rest.strip_suffix("/ns/net"))
        .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
    if under("/run/netns/") || under("/var/run/netns/") || proc_ns {
        Ok(())
    } else {
        Err(ClaimError::invalid(
            field,
            format!("{p:?} is not under /run/netns/, /var/run/netns/ or /proc/<pid>/ns/net"),
        ))
    }
}

fn validate_target(
    field: &str,
    t: Option<&request::PodTarget>,
) -> Result<(TargetRecord, Option<String>), ClaimError> {
    let Some(t) = t else {
        return Ok((TargetRecord::default(), None));
    };
    if t.pod_uids.len() > MAX_PODS {
        return Err(ClaimError::invalid(
            format!("{field}.pod_uids"),
            format!("{} entries, at most {MAX_PODS}", t.pod_uids.len()),
        ));
    }
    for (i, u) in t.pod_uids.iter().enumerate() {
        let f = format!("{field}.pod_uids[{i}]");
        if !is_uuid(u) {
            return Err(ClaimError::invalid(
                f,
                format!("{u:?} is not a pod uid (a lowercase UUID)"),
            ));
        }
        if t.pod_uids[..i].contains(u) {
            return Err(ClaimError::invalid(f, format!("{u} appears twice")));
        }
    }
    if t.cgroup_paths.len() > MAX_CGROUP_PATHS {
        return Err(ClaimError::invalid(
            format!("{field}.cgroup_paths"),
            format!(
                "{} entries, at most {MAX_CGROUP_PATHS}",
                t.cgroup_paths.len()
            ),
        ));
    }
    for (i, p) in t.cgroup_paths.iter().enumerate() {
        check_path_components(&format!("{field}.cgroup_paths[{i}]"), p)?;
    }
    let netns_path = (!t.netns_path.is_empty()).then(|| t.netns_path.clone());
    if let Some(p) = &netns_path {
        check_netns_path(&format!("{field}.netns_path"), p)?;
    }
    let interface = (!t.interface.is_empty()).then(|| t.interface.clone());
    if let Some(i) = &interface {
        let ok = i.len() <= MAX_IFNAME_LEN
            && i != "."
            && i != ".."
            && i.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'/' && b != b':');
        if !ok {
            return Err(ClaimError::invalid(
                format!("{field}.interface"),
                format!(
                    "{i:?} is not an interface name (1-{MAX_IFNAME_LEN} printable characters, no '/' or ':')"
                ),
            ));
        }
    }
    Ok((
        TargetRecord::new(
            t.pod_uids.clone(),
            TargetHints {
                cgroup_paths: t.cgroup_paths.clone(),
                netns_inode: None,
                interface,
            },
        ),
        netns_path,
    ))
}

fn validate_alloc(
    cfg: &Config,
    claim: &ClaimId,
    field: &str,
    index: usize,
    a: &request::DeviceAllocation,
) -> Result<ValidAlloc, ClaimError> {
    if !is_dns_subdomain(&a.driver) {
        return Err(ClaimError::invalid(
            format!("{field}.driver"),
            format!("{:?} is not a driver name", a.driver),
        ));
    }
    if !is_pool_name(&a.pool) {
        return Err(ClaimError::invalid(
            format!("{field}.pool"),
            format!("{:?} is not a pool name", a.pool),
        ));
    }
    if !is_dns_label(&a.device) {
        return Err(ClaimError::invalid(
            format!("{field}.device"),
            format!("{:?} is not a device name", a.device),
        ));
    }
    if a.request.is_empty() || a.request.len() > 127 || !a.request.split('/').all(is_dns_label) {
        return Err(ClaimError::invalid(
            format!("{field}.request"),
            format!(
                "{:?} is not a request name (DNS label, or request/subrequest)",
                a.request
            ),
        ));
    }
    if a.policy_version.len() > MAX_ID_LEN {
        return Err(ClaimError::invalid(
            format!("{field}.policy_version"),
            format!("longer than {MAX_ID_LEN} characters"),
        ));
    }
    let dev = cfg
        .devices
        .iter()
        .find(|d| d.name == a.device && d.driver == a.driver && d.pool == a.pool)
        .ok_or_else(|| {
            ClaimError::invalid(
                format!("{field}.device"),
                format!(
                    "unknown device {}/{}/{}: not in this node's inventory",
                    a.driver, a.pool, a.device
                ),
            )
        })?;

    if a.share_id.is_empty() {
        // A dedicated allocation: the whole device, no amounts.
        if !a.consumed_capacity.is_empty() {
            return Err(ClaimError::invalid(
                format!("{field}.consumed_capacity"),
                "must be empty for a dedicated allocation (no share_id)",
            ));
        }
        return Ok(ValidAlloc {
            index,
            key: dedicated_key(&claim.uid, &dev.name),
            share_id: None,
            request: a.request.clone(),
            driver: a.driver.clone(),
            pool: a.pool.clone(),
            device: dev.name.clone(),
            consumed: BTreeMap::new(),
            policy_version: a.policy_version.clone(),
            admin_access: a.admin_access,
        });
    }
    check_share_id(&a.share_id).map_err(|m| ClaimError::invalid(format!("{field}.share_id"), m))?;

    let mut consumed = BTreeMap::new();
    for (name, amount) in &a.consumed_capacity {
        let f = format!("{field}.consumed_capacity[{name}]");
        let Some(cap) = dev.capacities.get(name) else {
            let have: Vec<&str> = dev.capacities.keys().map(String::as_str).collect();
            return Err(ClaimError::invalid(
                f,
                format!(
                    "device {} has no capacity {name:?} (it has: {})",
                    dev.name,
                    have.join(", ")
                ),
            ));
        };
        let q = Quantity::parse(amount).map_err(|e| ClaimError::invalid(&f, e.to_string()))?;
        if q.is_negative() {
            return Err(ClaimError::invalid(&f, format!("{amount:?} is negative")));
        }
        cap.policy.allows(&q).map_err(|why| {
            ClaimError::invalid(
                &f,
                format!("not allowed by device {}'s policy: {why}", dev.name),
            )
        })?;
        consumed.insert(name.clone(), q);
    }
    // Kubernetes lists every capacity of a shared device, consumed or not.
    if let Some(missing) = dev.capacities.keys().find(|k| !consumed.contains_key(*k)) {
        return Err(ClaimError::invalid(
            format!("{field}.consumed_capacity"),
            format!("missing capacity {missing:?} of device {}", dev.name),
        ));
    }
    // The scheduler's policy snapshot must allow the amount too: if the two disagree the
    // scheduler worked from a stale ResourceSlice, and the stricter answer wins.
    for (name, p) in &a.policy {
        let f = format!("{field}.policy[{name}]");
        let Some(q) = consumed.get(name) else {
            return Err(ClaimError::invalid(
                f,
                format!("policy for capacity {name:?} the allocation does not consume"),
            ));
        };
        let snapshot =
            Policy::from_snapshot(p).map_err(|e| ClaimError::invalid(&f, e.to_string()))?;
        snapshot.allows(q).map_err(|why| {
            ClaimError::invalid(
                format!("{field}.consumed_capacity[{name}]"),
                format!(
                    "not allowed by the policy snapshot (version {:?}): {why}",
                    a.policy_version
                ),
            )
        })?;
    }
    Ok(ValidAlloc {
        index,
        key: a.share_id.clone(),
        share_id: Some(a.share_id.clone()),
        request: a.request.clone(),
        driver: a.driver.clone(),
        pool: a.pool.clone(),
        device: dev.name.clone(),
        consumed,
        policy_version: a.policy_version.clone(),
        admin_access: a.admin_access,
    })
}

/// Checks one claim of a Prepare. `index` is its position in the request.
pub fn validate_claim(
    cfg: &Config,
    index: usize,
    c: &request::ClaimPrepare,
) -> Result<ValidClaim, ClaimError> {
    let field = format!("claims[{index}]");
    let claim = validate_claim_ref(&format!("{field}.claim"), c.claim.as_ref())?;
    check_id(&format!("{field}.allocation_id"), &c.allocation_id)?;
    let (target, netns_path) = validate_target(&format!("{field}.target"), c.target.as_ref())?;
    if c.allocations.is_empty() {
        return Err(ClaimError::invalid(
            format!("{field}.allocations"),
            "required",
        ));
    }
    if c.allocations.len() > MAX_ALLOCATIONS_PER_CLAIM {
        return Err(ClaimError::invalid(
            format!("{field}.allocations"),
            format!(
                "{} entries, at most {MAX_ALLOCATIONS_PER_CLAIM}",
                c.allocations.len()
            ),
        ));
    }
    let mut allocs = Vec::with_capacity(c.allocations.len());
    let mut keys = BTreeSet::new();
    for (i, a) in c.allocations.iter().enumerate() {
        let af = format!("{field}.allocations[{i}]");
        let v = validate_alloc(cfg, &claim, &af, i, a)?;
        if !keys.insert(v.key.clone()) {
            let what = if v.share_id.is_some() {
                "share_id"
            } else {
                "device"
            };
            return Err(ClaimError::invalid(
                format!("{af}.{what}"),
                format!("{} appears twice in the claim", v.key),
            ));
        }
        allocs.push(v);
    }
    // An enforced device needs the pod: the agent finds its sandbox by uid.
    if target.pod_uids.is_empty()
        && let Some(d) = allocs
            .iter()
            .filter_map(|a| cfg.device(&a.device))
            .find(|d| d.kind != crate::config::DeviceKind::Generic)
    {
        return Err(ClaimError::invalid(
            format!("{field}.target.pod_uids"),
            format!(
                "required for device {} (kind {}): the agent finds the pod's sandbox by its uid",
                d.name,
                d.kind.as_str()
            ),
        ));
    }
    Ok(ValidClaim {
        index,
        claim,
        allocation_id: c.allocation_id.clone(),
        target,
        netns_path,
        allocs,
        pre_bind: c.pre_bind,
    })
}

/// I7: the namespace must be allowed on every device, and admin access needs an admin
/// namespace. Cross-namespace use is denied unless the device allows it.
pub fn authorize(cfg: &Config, c: &ValidClaim) -> Result<(), ClaimError> {
    for a in &c.allocs {
        let field = format!("claims[{}].allocations[{}]", c.index, a.index);
        // validate_alloc resolved the device, so it exists.
        let Some(dev) = cfg.device(&a.device) else {
            return Err(ClaimError::internal(format!(
                "device {} vanished from the inventory",
                a.device
            )));
        };
        if !dev.allows_namespace(&c.claim.namespace) {
            return Err(ClaimError::denied(
                format!("claims[{}].claim.namespace", c.index),
                format!(
                    "namespace {:?} may not use device {}",
                    c.claim.namespace, dev.name
                ),
            ));
        }
        if a.admin_access && !dev.is_admin_namespace(&c.claim.namespace) {
            return Err(ClaimError::denied(
                format!("{field}.admin_access"),
                format!(
                    "namespace {:?} is not an admin namespace of device {}",
                    c.claim.namespace, dev.name
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn share_ids() {
        assert!(check_share_id("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5c").is_ok());
        assert!(
            check_share_id("3F1C2A4E-8B7D-4C1E-9A2B-0D1E2F3A4B5C")
                .unwrap_err()
                .contains("lowercase")
        );
        assert!(
            check_share_id("3f1c2a4e-8b7d-1c1e-9a2b-0d1e2f3a4b5c").is_err(),
            "version 1"
        );
        assert!(
            check_share_id("3f1c2a4e-8b7d-4c1e-7a2b-0d1e2f3a4b5c").is_err(),
            "variant"
        );
        assert!(check_share_id("3f1c2a4e8b7d4c1e9a2b0d1e2f3a4b5c").is_err());
        assert!(check_share_id("").is_err());
        assert!(check_share_id("3f1c2a4e-8b7d-4c1e-9a2b-0d1e2f3a4b5g").is_err());
    }

    #[test]
    fn pod_and_claim_uids() {
        assert!(is_uuid("0d6f2b5e-7d4e-4a64-8a1b-3c2d1e0f9a88"));
        assert!(
            is_uuid("0d6f2b5e-7d4e-1a64-0a1b-3c2d1e0f9a88"),
            "any version"
        );
        assert!(!is_uuid("0D6F2B5E-7D4E-4A64-8A1B-3C2D1E0F9A88"));
        assert!(!is_uuid("pod-a"));
        assert!(!is_uuid("0d6f2b5e7d4e4a648a1b3c2d1e0f9a88"));
        assert!(check_claim_uid("f", "claim-1_a").is_ok());
        let e = check_claim_uid("f", "claim.1").unwrap_err();
        assert!(e.message.contains("only letters"), "{e}");
    }

    #[test]
    fn names() {
        assert!(is_namespace("team-a"));
        assert!(!is_namespace("Team-a"));
        assert!(!is_namespace("-a"));
        assert!(!is_namespace(&"a".repeat(64)));
        assert!(is_dns_subdomain("gpu.example.com"));
        assert!(!is_dns_subdomain("gpu..example"));
        assert!(is_pool_name("node-a/pool-1"));
        assert!(is_qualified_name("memory"));
        assert!(is_qualified_name("egressBandwidth"));
        assert!(is_qualified_name("example.com/egress_bandwidth"));
        assert!(is_qualified_name(&"m".repeat(32)));
        for bad in [
            "-memory",
            "egress-rate",
            "example.com/egress-rate",
            "1memory",
            "a.b",
            "example.com/",
            "/memory",
            "a/b/c",
            "Example.com/memory",
        ] {
            assert!(!is_qualified_name(bad), "{bad}");
        }
        assert!(!is_qualified_name(&"m".repeat(33)));
        assert!(!is_qualified_name(&format!("{}.com/m", "d".repeat(60))));
        assert!(is_driver_name("gpu.example.com"));
        assert!(!is_driver_name(&format!("{}.example.com", "d".repeat(60))));
    }

    #[test]
    fn paths() {
        assert!(check_netns_path("f", "/var/run/netns/cni-1234").is_ok());
        assert!(check_netns_path("f", "/proc/42/ns/net").is_ok());
        assert!(
            check_netns_path("f", "/var/run/netns/../../etc/passwd")
                .unwrap_err()
                .message
                .contains("traversal")
        );
        assert!(check_netns_path("f", "/etc/passwd").is_err());
        assert!(check_netns_path("f", "/proc/self/ns/net").is_err());
        assert!(check_path_components("f", "/kubepods.slice/pod1.slice").is_ok());
        assert!(check_path_components("f", "kubepods/../../x").is_err());
        assert!(check_path_components("f", "/a//b").is_err());
    }
}
