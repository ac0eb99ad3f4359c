//! The capacity ledger (I1): for every device and capacity name, the sum of consumed
//! capacity over the device's non-released shares never exceeds the device's capacity.
//!
//! Sums are derived from the share records every time they are needed, never kept in
//! counters that callbacks bump: a counter that missed one update would silently
//! oversubscribe a node, while a sum over the records is right by construction.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use shareguard_common::Quantity;

use crate::{
    config::{Config, DeviceConfig},
    error::ClaimError,
    record::{ClaimRecord, ShareRecord},
    validate::ValidClaim,
};

/// The agent's in-memory view of the store. It only ever changes after the store
/// accepted the same change.
#[derive(Default, Debug)]
pub struct State {
    pub records: HashMap<String, ShareRecord>,
    /// Device name -> keys of its records (tombstones included), so a device's sum does
    /// not scan every share on the node.
    pub by_device: HashMap<String, BTreeSet<String>>,
    pub claims: HashMap<String, ClaimRecord>,
    pub epoch: u64,
}

impl State {
    pub fn put(&mut self, r: ShareRecord) {
        if let Some(old) = self.records.get(&r.key)
            && old.device != r.device
            && let Some(keys) = self.by_device.get_mut(&old.device)
        {
            keys.remove(&r.key);
        }
        self.by_device
            .entry(r.device.clone())
            .or_default()
            .insert(r.key.clone());
        self.records.insert(r.key.clone(), r);
    }

    pub fn remove(&mut self, key: &str) -> Option<ShareRecord> {
        let r = self.records.remove(key)?;
        if let Some(keys) = self.by_device.get_mut(&r.device) {
            keys.remove(key);
        }
        Some(r)
    }

    pub fn device_records<'a>(
        &'a self,
        device: &str,
    ) -> impl Iterator<Item = &'a ShareRecord> + 'a {
        self.by_device
            .get(device)
            .into_iter()
            .flatten()
            .filter_map(|k| self.records.get(k))
    }
}

/// What a device has handed out, derived from its records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    pub allocated: BTreeMap<String, Quantity>,
    /// Records holding capacity (admin-access ones included).
    pub live: u32,
    /// Claim uid of the dedicated allocation holding the whole device, if any.
    pub dedicated_by: Option<String>,
}

pub fn usage(state: &State, dev: &DeviceConfig) -> DeviceUsage {
    let mut u = DeviceUsage {
        allocated: dev
            .capacities
            .keys()
            .map(|k| (k.clone(), Quantity::ZERO))
            .collect(),
        ..Default::default()
    };
    for r in state.device_records(&dev.name) {
        if !r.phase.holds_capacity() {
            continue;
        }
        u.live += 1;
        if !r.counts() {
            continue;
        }
        if r.is_dedicated() {
            u.dedicated_by = Some(r.claim.uid.clone());
            for (name, cap) in &dev.capacities {
                u.allocated.insert(name.clone(), cap.value);
            }
            continue;
        }
        for (name, q) in &r.consumed {
            let slot = u.allocated.entry(name.clone()).or_insert(Quantity::ZERO);
            // Admitted amounts each fit under the capacity, so their sum fits in i128;
            // saturate rather than panic if a corrupted store says otherwise.
            *slot = slot.checked_add(q).unwrap_or(*slot);
        }
    }
    u
}

/// Checks that admitting `claim` keeps every device it touches within capacity.
pub fn check_claim(cfg: &Config, state: &State, claim: &ValidClaim) -> Result<(), ClaimError> {
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
            let counting = state.device_records(device).filter(|r| r.counts()).count();
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
                            cap.value.checked_sub(total).unwrap_or(Quantity::ZERO)
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
