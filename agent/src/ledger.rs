//! The capacity ledger (I1): for every device and capacity name, the sum of consumed
//! capacity over the device's non-released shares never exceeds the device's capacity.
//!
//! The sums are a view of the share records, kept in [`State::put`] and [`State::remove`]
//! — the only two places a record enters, changes or leaves — by taking the old record's
//! contribution out and the new one's in. No limiter, callback or request path touches
//! them. Walking every record on each Prepare was the alternative, and it made a Prepare
//! with 10,000 live shares slower than the fsync it waits for. [`State::recompute_sums`]
//! derives them from scratch; the tests compare the two after every step, and the agent
//! checks them at start.

use std::collections::{BTreeMap, HashMap};

use shareguard_common::Quantity;

use crate::{
    config::{Config, DeviceConfig},
    error::ClaimError,
    keyed::KeyedSet,
    record::{ClaimRecord, ShareRecord},
    validate::ValidClaim,
};

/// The agent's in-memory view of the store. It only ever changes after the store
/// accepted the same change.
#[derive(Default, Debug)]
pub struct State {
    pub records: KeyedSet<ShareRecord>,
    pub claims: KeyedSet<ClaimRecord>,
    /// Highest epoch accepted (I4), and the highest one known to be durable: a call at
    /// the accepted epoch is answered only once that is durable too.
    pub epoch: u64,
    pub epoch_durable: u64,
    /// Device name -> what its records hold.
    sums: HashMap<String, DeviceSums>,
    /// Pod uid -> (namespace, live records naming the pod in it), kept like `sums`. A
    /// pod has one namespace, so a vector (one small allocation), not a map (a table).
    pods: HashMap<String, Vec<(String, u32)>>,
}

/// What one device's records hold, by contribution of each record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceSums {
    /// Consumed capacity of counting shares (dedicated allocations excluded); capacities
    /// at zero are absent, so two equal sums compare equal.
    pub shared: BTreeMap<String, Quantity>,
    /// Records holding capacity (admin-access ones included).
    pub live: u32,
    /// Records counting against the ledger.
    pub counting: u32,
    /// Claim uid of the dedicated allocation holding the device, if any.
    pub dedicated_by: Option<String>,
}

/// Adds (`sign` = 1) or removes (`sign` = -1) one record's contribution.
fn contribute(sums: &mut HashMap<String, DeviceSums>, r: &ShareRecord, sign: i128) {
    if !r.phase.holds_capacity() {
        return;
    }
    // Looked up before inserting: `entry` would allocate a copy of the name on every
    // call, and this runs for every record a start loads and every change after.
    if !sums.contains_key(r.device.as_str()) {
        sums.insert(r.device.to_string(), DeviceSums::default());
    }
    // Present: inserted just above if it was not.
    let d = sums
        .get_mut(r.device.as_str())
        .expect("the device's sums were just inserted");
    let step = |n: &mut u32| {
        *n = if sign > 0 {
            n.saturating_add(1)
        } else {
            n.saturating_sub(1)
        };
    };
    step(&mut d.live);
    if !r.counts() {
        return;
    }
    step(&mut d.counting);
    if r.is_dedicated() {
        d.dedicated_by = (sign > 0).then(|| r.claim.uid.clone());
        return;
    }
    for (name, q) in &r.consumed {
        let cur = d.shared.get(name).copied().unwrap_or(Quantity::ZERO);
        // Every admitted amount fits under a capacity, so the sum fits in i128 nanos and
        // the subtraction of what was added cannot underflow; saturate rather than
        // panic should a corrupted store ever say otherwise.
        let next = q
            .checked_mul(sign)
            .and_then(|delta| cur.checked_add(&delta))
            .unwrap_or(cur);
        if next.is_zero() {
            d.shared.remove(name);
        } else if let Some(sum) = d.shared.get_mut(name) {
            *sum = next;
        } else {
            d.shared.insert(name.to_owned(), next);
        }
    }
}

/// Adds or removes one record's pods in the pod -> namespace index.
fn index_pods(pods: &mut HashMap<String, Vec<(String, u32)>>, r: &ShareRecord, add: bool) {
    if !r.phase.holds_capacity() {
        return;
    }
    let ns = &r.claim.namespace;
    for pod in &r.target.pod_uids {
        let by_ns = pods.entry(pod.clone()).or_default();
        let i = match by_ns.iter().position(|(n, _)| n == ns) {
            Some(i) => i,
            None => {
                by_ns.push((ns.to_string(), 0));
                by_ns.len() - 1
            }
        };
        let n = &mut by_ns[i].1;
        *n = if add {
            n.saturating_add(1)
        } else {
            n.saturating_sub(1)
        };
        if *n == 0 {
            by_ns.swap_remove(i);
        }
        if by_ns.is_empty() {
            pods.remove(pod);
        }
    }
}

impl State {
    pub fn put(&mut self, r: ShareRecord) {
        self.put_boxed(Box::new(r));
    }

    /// [`Self::put`] for a record already boxed (a start's).
    pub fn put_boxed(&mut self, r: Box<ShareRecord>) {
        if let Some(old) = self.records.get(&r.key) {
            contribute(&mut self.sums, old, -1);
            index_pods(&mut self.pods, old, false);
        }
        contribute(&mut self.sums, &r, 1);
        index_pods(&mut self.pods, &r, true);
        self.records.insert_boxed(r);
    }

    pub fn remove(&mut self, key: &str) -> Option<ShareRecord> {
        let r = self.records.remove(key)?;
        contribute(&mut self.sums, &r, -1);
        index_pods(&mut self.pods, &r, false);
        Some(r)
    }

    /// The namespaces of the live records that name pod `uid`.
    pub fn pod_namespaces(&self, uid: &str) -> impl Iterator<Item = &str> {
        self.pods
            .get(uid)
            .into_iter()
            .flat_map(|v| v.iter().map(|(ns, _)| ns.as_str()))
    }

    pub fn sums(&self, device: &str) -> DeviceSums {
        self.sums.get(device).cloned().unwrap_or_default()
    }

    /// The sums derived from the records alone, to check the kept ones against.
    pub fn recompute_sums(&self) -> HashMap<String, DeviceSums> {
        let mut sums = HashMap::new();
        for r in self.records.values() {
            contribute(&mut sums, r, 1);
        }
        sums
    }

    /// True when the kept sums equal a recomputation from the records.
    pub fn sums_consistent(&self) -> bool {
        let fresh = self.recompute_sums();
        let nonempty = |m: &HashMap<String, DeviceSums>| -> BTreeMap<String, DeviceSums> {
            m.iter()
                .filter(|(_, v)| **v != DeviceSums::default())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        nonempty(&fresh) == nonempty(&self.sums)
    }
}

/// What a device has handed out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    pub allocated: BTreeMap<String, Quantity>,
    /// Records holding capacity (admin-access ones included).
    pub live: u32,
    /// Records counting against the ledger.
    pub counting: u32,
    /// Claim uid of the dedicated allocation holding the whole device, if any.
    pub dedicated_by: Option<String>,
}

pub fn usage(state: &State, dev: &DeviceConfig) -> DeviceUsage {
    let s = state.sums(&dev.name);
    let allocated = dev
        .capacities
        .iter()
        .map(|(name, cap)| {
            // A dedicated allocation holds the whole device.
            let q = if s.dedicated_by.is_some() {
                cap.value
            } else {
                s.shared.get(name).copied().unwrap_or(Quantity::ZERO)
            };
            (name.clone(), q)
        })
        .collect();
    DeviceUsage {
        allocated,
        live: s.live,
        counting: s.counting,
        dedicated_by: s.dedicated_by,
    }
}

/// Checks that admitting `claim` keeps every device it touches within capacity.
pub fn check_claim(cfg: &Config, state: &State, claim: &ValidClaim) -> Result<(), ClaimError> {
    // A quarantined record whose device could not be read may hold capacity on any
    // device: nothing is admitted on top of it (I1) until its claim is unprepared.
    if state.sums.get("").is_some_and(|s| s.live > 0) {
        let mut held: Vec<&str> = state
            .records
            .values()
            .filter(|r| r.quarantined && r.device.is_empty() && r.phase.holds_capacity())
            .map(|r| r.claim.uid.as_str())
            .collect();
        held.sort_unstable();
        held.dedup();
        return Err(ClaimError::unavailable(format!(
            "this node's store holds an unreadable share record, which may hold capacity on any device; nothing is admitted until it is unprepared (claim {})",
            held.join(", ")
        )));
    }
    let mut by_device: BTreeMap<&str, Vec<&crate::validate::ValidAlloc>> = BTreeMap::new();
    for a in claim.allocs.iter().filter(|a| !a.admin_access) {
        by_device.entry(a.device.as_str()).or_default().push(a);
    }
    for (device, allocs) in by_device {
        let Some(dev) = cfg.device(device) else {
            return Err(ClaimError::internal(format!(
                "device {device} vanished from the inventory"
            )));
        };
        let u = usage(state, dev);
        let field = |a: &crate::validate::ValidAlloc, rest: &str| {
            format!("claims[{}].allocations[{}]{rest}", claim.index, a.index)
        };
        if let Some(holder) = &u.dedicated_by {
            return Err(ClaimError::exhausted(
                field(allocs[0], ".device"),
                format!(
                    "device {device} is held whole by a dedicated allocation of claim {holder}"
                ),
            ));
        }
        if let Some(d) = allocs.iter().find(|a| a.share_id.is_none()) {
            let counting = u.counting as usize;
            if counting > 0 || allocs.len() > 1 {
                return Err(ClaimError::exhausted(
                    field(d, ".device"),
                    format!(
                        "a dedicated allocation needs the whole device {device}, which holds {} other allocation(s)",
                        counting + allocs.len() - 1
                    ),
                ));
            }
            continue;
        }
        for (name, cap) in &dev.capacities {
            let mut total = u.allocated.get(name).copied().unwrap_or(Quantity::ZERO);
            for a in &allocs {
                let want = a.consumed.get(name).copied().unwrap_or(Quantity::ZERO);
                let over = |total: &Quantity| {
                    ClaimError::exhausted(
                        field(a, &format!(".consumed_capacity[{name}]")),
                        format!(
                            "device {device} {name}: {want} requested, {} of {} already allocated ({} free)",
                            u.allocated.get(name).copied().unwrap_or(Quantity::ZERO),
                            cap.value,
                            cap.value.remaining_after(total)
                        ),
                    )
                };
                let next = total.checked_add(&want).ok_or_else(|| over(&total))?;
                if next > cap.value {
                    return Err(over(&total));
                }
                total = next;
            }
        }
    }
    Ok(())
}
