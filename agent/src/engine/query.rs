//! Read-only views: one share, filtered lists, the device inventory with what is
//! allocated and free, and a consistent snapshot for watchers.

use std::collections::BTreeMap;

use shareguard_common::{Quantity, limiter::DeviceFacts};
use tokio::sync::broadcast;

use crate::{
    config::DeviceConfig,
    ledger::{self, DeviceUsage},
    record::{Phase, ShareRecord},
    sync::lock,
};

use super::Engine;

#[derive(Clone, Debug, Default)]
pub struct ShareFilter {
    pub device: Option<String>,
    pub namespace: Option<String>,
    pub phase: Option<Phase>,
}

impl ShareFilter {
    pub fn matches(&self, r: &ShareRecord) -> bool {
        self.device.as_ref().is_none_or(|d| *d == r.device)
            && self
                .namespace
                .as_ref()
                .is_none_or(|n| *n == r.claim.namespace)
            && self.phase.is_none_or(|p| p == r.phase)
    }
}

#[derive(Clone, Debug)]
pub struct DeviceView {
    pub config: DeviceConfig,
    pub usage: DeviceUsage,
    pub free: BTreeMap<String, Quantity>,
    pub mechanisms: Vec<String>,
    pub facts: DeviceFacts,
    pub stage: crate::rollout::Stage,
}

fn sorted(mut v: Vec<ShareRecord>) -> Vec<ShareRecord> {
    v.sort_by(|a, b| {
        (&a.device, &a.claim.namespace, &a.claim.name, &a.key).cmp(&(
            &b.device,
            &b.claim.namespace,
            &b.claim.name,
            &b.key,
        ))
    });
    v
}

impl Engine {
    pub fn get_share(&self, key: &str) -> Option<ShareRecord> {
        lock(&self.state).records.get(key).cloned()
    }

    pub fn list_shares(&self, f: &ShareFilter) -> Vec<ShareRecord> {
        let st = lock(&self.state);
        sorted(
            st.records
                .values()
                .filter(|r| f.matches(r))
                .cloned()
                .collect(),
        )
    }

    /// One page of the matching shares, after `after`, and where the next page starts.
    pub fn list_page(
        &self,
        f: &ShareFilter,
        after: Option<&super::page::Position>,
        limit: usize,
    ) -> (Vec<ShareRecord>, Option<super::page::Position>) {
        let st = lock(&self.state);
        let (page, next) =
            super::page::select(st.records.values().filter(|r| f.matches(r)), after, limit);
        (page.into_iter().cloned().collect(), next)
    }

    /// The matching shares and a receiver for every later change, taken under one lock
    /// so no change falls between the snapshot and the stream.
    pub fn subscribe(
        &self,
        f: &ShareFilter,
    ) -> (Vec<ShareRecord>, broadcast::Receiver<ShareRecord>) {
        let st = lock(&self.state);
        let rx = self.events.subscribe();
        let snap = sorted(
            st.records
                .values()
                .filter(|r| f.matches(r))
                .cloned()
                .collect(),
        );
        (snap, rx)
    }

    pub fn devices(&self) -> Vec<DeviceView> {
        let usages: Vec<_> = {
            let st = lock(&self.state);
            self.cfg
                .devices
                .iter()
                .map(|d| ledger::usage(&st, d))
                .collect()
        };
        // The limiters are asked outside the state lock: a device's facts may read the
        // kernel or the driver (its health), which no Prepare should wait for.
        self.cfg
            .devices
            .iter()
            .zip(usages)
            .map(|(d, usage)| {
                let free = d
                    .capacities
                    .iter()
                    .map(|(name, cap)| {
                        let used = usage.allocated.get(name).copied().unwrap_or(Quantity::ZERO);
                        (name.clone(), cap.value.remaining_after(&used))
                    })
                    .collect();
                DeviceView {
                    config: d.clone(),
                    usage,
                    free,
                    mechanisms: self
                        .limiter(&d.name)
                        .map(|l| l.mechanisms())
                        .unwrap_or_default(),
                    facts: self
                        .limiter(&d.name)
                        .map(|l| l.device_facts(&d.name))
                        .unwrap_or_default(),
                    stage: self.stage(&d.name),
                }
            })
            .collect()
    }

    pub fn epoch(&self) -> u64 {
        lock(&self.state).epoch
    }

    /// Every share that holds capacity.
    pub fn live_records(&self) -> Vec<ShareRecord> {
        let st = lock(&self.state);
        st.records
            .values()
            .filter(|r| r.phase.holds_capacity())
            .cloned()
            .collect()
    }

    pub fn phase_counts(&self) -> BTreeMap<Phase, u64> {
        let st = lock(&self.state);
        let mut m: BTreeMap<Phase, u64> = Phase::ALL.iter().map(|p| (*p, 0)).collect();
        for r in st.records.values() {
            *m.entry(r.phase).or_default() += 1;
        }
        m
    }
}
