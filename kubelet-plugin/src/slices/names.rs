//! The names of one driver's ResourceSlices on this node: `<node>-<driver>-<slot>`,
//! slot a number from 0 below a bound (`--max-slices-per-node`).
//!
//! Why slots rather than one name per pool: a node's pools are free-form below its name
//! (`worker-1`, `worker-1/nics`, ...), so names made from pools are unbounded, and the
//! API server cannot count objects in admission. With a fixed set of names per node, the
//! admission policy (deploy/admission.yaml) bounds the slices one node's plugin can hold,
//! and a plugin taken over by an attacker cannot fill etcd or the scheduler's cache with
//! them: names are unique, so the bound is the number of names it may use.
//!
//! A pool keeps the slot it was published under (found in the listed slices), so a new
//! pool never renames another pool's slice; a new pool takes the lowest slot that no
//! listed slice holds.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceSlice;

/// The highest bound `--max-slices-per-node` takes: the admission policy accepts a slot
/// of one or two digits.
pub const MAX_SLOTS: u32 = 100;

/// A DNS subdomain is at most 253 characters.
const MAX_NAME: usize = 253;

/// The name of slot `slot`.
pub fn slot_name(node: &str, driver: &str, slot: u32) -> String {
    format!("{node}-{driver}-{slot}")
}

/// The slot a slice name stands for, if it is one of this node's and driver's names
/// below `slots`. Written the way the admission policy reads it: no sign, no leading
/// zero, at most two digits.
pub fn slot_of(name: &str, node: &str, driver: &str, slots: u32) -> Option<u32> {
    let rest = name.strip_prefix(node)?.strip_prefix('-')?;
    let digits = rest.strip_prefix(driver)?.strip_prefix('-')?;
    let canonical = !digits.is_empty()
        && digits.len() <= 2
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !canonical {
        return None;
    }
    digits.parse::<u32>().ok().filter(|s| *s < slots)
}

/// Where each pool goes, and the pools that got no name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// Pool -> slice name.
    pub names: BTreeMap<String, String>,
    /// Pools left unpublished, with why.
    pub unplaced: Vec<(String, Unplaced)>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unplaced {
    #[error(
        "every one of the {slots} slice names this node may use (--max-slices-per-node) is taken; \
         a slice of a pool no longer here frees its name when it is deleted"
    )]
    NoFreeSlot { slots: u32 },
    #[error(
        "the node's name is too long for a slice name: `<node>-<driver>-<slot>` would be {len} characters, above {MAX_NAME}"
    )]
    NameTooLong { len: usize },
}

/// Gives each of `pools` a name: the slot its listed slice already has, else the lowest
/// slot no listed slice holds (a slice of a gone pool frees its slot once deleted, at the
/// next pass), else none.
pub fn place<'a>(
    pools: impl IntoIterator<Item = &'a str>,
    listed: &[ResourceSlice],
    node: &str,
    driver: &str,
    slots: u32,
) -> Placement {
    let mut out = Placement::default();
    let pools: Vec<&str> = pools.into_iter().collect();
    let longest = slot_name(node, driver, slots.saturating_sub(1)).len();
    if longest > MAX_NAME {
        out.unplaced = pools
            .iter()
            .map(|p| ((*p).to_owned(), Unplaced::NameTooLong { len: longest }))
            .collect();
        return out;
    }
    // Slot -> pool, of the listed slices that have a slot name.
    let mut held: BTreeMap<u32, &str> = BTreeMap::new();
    for s in listed {
        let Some(slot) = s
            .metadata
            .name
            .as_deref()
            .and_then(|n| slot_of(n, node, driver, slots))
        else {
            continue;
        };
        held.insert(slot, s.spec.pool.name.as_str());
    }
    let mut taken: BTreeSet<u32> = held.keys().copied().collect();
    let mut waiting = Vec::new();
    for pool in pools {
        // The lowest slot holding this pool; another slice of the same pool (an edit by
        // hand) is left to be deleted as unwanted.
        let own = held
            .iter()
            .find(|(_, p)| **p == pool)
            .map(|(slot, _)| *slot);
        match own {
            Some(slot) => {
                out.names
                    .insert(pool.to_owned(), slot_name(node, driver, slot));
            }
            None => waiting.push(pool),
        }
    }
    for pool in waiting {
        match (0..slots).find(|s| !taken.contains(s)) {
            Some(slot) => {
                taken.insert(slot);
                out.names
                    .insert(pool.to_owned(), slot_name(node, driver, slot));
            }
            None => out
                .unplaced
                .push((pool.to_owned(), Unplaced::NoFreeSlot { slots })),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::resource::v1::{ResourcePool, ResourceSliceSpec},
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    const D: &str = "d.example.com";

    fn slice(name: &str, pool: &str) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: ResourceSliceSpec {
                driver: D.into(),
                pool: ResourcePool {
                    name: pool.into(),
                    generation: 1,
                    resource_slice_count: 1,
                },
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_slot_name_is_read_back_exactly_as_the_policy_reads_it() {
        assert_eq!(slot_name("n1", D, 3), "n1-d.example.com-3");
        assert_eq!(slot_of("n1-d.example.com-3", "n1", D, 16), Some(3));
        assert_eq!(slot_of("n1-d.example.com-0", "n1", D, 16), Some(0));
        for not in [
            "n1-d.example.com-16",
            "n1-d.example.com-03",
            "n1-d.example.com-",
            "n1-d.example.com-x",
            "n1-d.example.com-+3",
            "n1-d.example.com-100",
            "n10-d.example.com-3",
            "n1-e.example.com-3",
            "n1-d.example.com-p",
        ] {
            assert_eq!(slot_of(not, "n1", D, 16), None, "{not}");
        }
        // Another node's slot is never this node's, even where one name starts with the
        // other: the slot has no '-', so the node part is fixed by the end of the name.
        assert_eq!(
            slot_of("n1-d.example.com-3", "n1-d.example.com", D, 16),
            None
        );
    }

    #[test]
    fn a_pool_keeps_its_slot_and_new_pools_take_the_lowest_free_one() {
        let listed = [
            slice("n1-d.example.com-1", "n1/b"),
            slice("n1-old-name", "n1"),
        ];
        let p = place(["n1", "n1/a", "n1/b"], &listed, "n1", D, 16);
        assert!(p.unplaced.is_empty(), "{p:?}");
        assert_eq!(p.names["n1/b"], "n1-d.example.com-1", "kept");
        assert_eq!(p.names["n1"], "n1-d.example.com-0");
        assert_eq!(p.names["n1/a"], "n1-d.example.com-2");
    }

    #[test]
    fn a_gone_pools_slot_is_free_only_once_its_slice_is_gone() {
        let listed = [slice("n1-d.example.com-0", "n1/gone")];
        let p = place(["n1/new"], &listed, "n1", D, 1);
        assert_eq!(
            p.unplaced,
            [("n1/new".to_owned(), Unplaced::NoFreeSlot { slots: 1 })]
        );
        let p = place(["n1/new"], &[], "n1", D, 1);
        assert_eq!(p.names["n1/new"], "n1-d.example.com-0");
    }

    #[test]
    fn more_pools_than_slots_leave_the_rest_unplaced_with_the_reason() {
        let p = place(["a", "b", "c"], &[], "n1", D, 2);
        assert_eq!(p.names.len(), 2);
        assert_eq!(p.unplaced.len(), 1);
        let why = p.unplaced[0].1.to_string();
        assert!(why.contains("--max-slices-per-node"), "{why}");
    }

    #[test]
    fn two_slices_of_one_pool_leave_one_name_for_the_pool() {
        let listed = [
            slice("n1-d.example.com-4", "n1"),
            slice("n1-d.example.com-2", "n1"),
        ];
        let p = place(["n1", "n1/x"], &listed, "n1", D, 16);
        assert_eq!(p.names["n1"], "n1-d.example.com-2");
        assert_eq!(p.names["n1/x"], "n1-d.example.com-0", "4 is still held");
    }

    #[test]
    fn a_node_name_too_long_for_any_slice_name_is_said_so() {
        let node = "n".repeat(240);
        let p = place(["p"], &[], &node, D, 16);
        assert!(p.names.is_empty());
        let why = p.unplaced[0].1.to_string();
        assert!(why.contains("too long") && why.contains("253"), "{why}");
    }
}
