//! Keeps one driver's ResourceSlices on the API server equal to what this node has:
//! applied (server-side, the driver as field manager) when missing or different, with the
//! pool's generation raised; slices of pools that are gone deleted.
//!
//! Each pass works from a fresh list of the slices on the API server rather than from
//! memory: the list the watch of its slices has just made (at its start, or when it had
//! to list again), or else one of its own. The plugin runs a pass whenever that watch
//! reports a change someone else made (so a slice someone deleted or edited comes back
//! at once; the echoes of the pass's own writes are told apart and start none), when
//! the agent's inventory changed, and now and then regardless. When the plugin is
//! removed for good, kubelet deletes the driver's slices on this node once its
//! registration socket has been gone for 30 s; a rolling update comes back well within
//! that.

use std::{collections::BTreeMap, sync::Mutex};

use k8s_openapi::api::{core::v1::Node, resource::v1::ResourceSlice};
use kube::{
    Api,
    api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions},
    runtime::watcher,
};
use tracing::{error, info, warn};

use super::{
    build::{self, Desired, NodeRef, digest_annotation},
    compare::{Difference, differences},
    names::{self, Unplaced},
};
use crate::{cluster::Clients, inventory::DriverDevices};

/// One field the API server did not store as applied, with its slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dropped {
    pub slice: String,
    pub difference: Difference,
}

/// Why a pass did not leave the slices as they should be.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("ResourceSlices: {0}")]
    Api(#[from] kube::Error),
    /// The API server stored the slices without fields the plugin applied. Applying
    /// again changes nothing, so it is not retried at once; every pass reports it
    /// again until the stored slices are whole.
    #[error("{}", dropped_message(.0))]
    FieldsDropped(Vec<Dropped>),
    /// Pools that got no slice name (`super::names`): not published. Everything else
    /// was; the pass is tried again on the next change of the slices (a deleted slice
    /// frees its name) or period.
    #[error("{}", unplaced_message(.0))]
    Unplaced(Vec<(String, Unplaced)>),
}

fn unplaced_message(unplaced: &[(String, Unplaced)]) -> String {
    let pools: Vec<String> = unplaced
        .iter()
        .map(|(pool, why)| format!("pool {pool:?}: {why}"))
        .collect();
    format!("ResourceSlices not published: {}", pools.join("; "))
}

/// The likely cause, by what was dropped.
pub fn dropped_cause(dropped: &[Dropped]) -> &'static str {
    if dropped
        .iter()
        .any(|d| d.difference.is_consumable_capacity())
    {
        "the API server drops consumable-capacity fields: is the DRAConsumableCapacity \
         feature gate on (kube-apiserver, kube-scheduler and kubelet; alpha and off by default \
         in 1.34 and 1.35)? Without them the scheduler allocates each device whole, to one \
         claim, and no share is ever made"
    } else if dropped.iter().any(|d| d.difference.is_binding_condition()) {
        "the API server drops binding conditions: is the DRADeviceBindingConditions \
         feature gate on (kube-apiserver and kube-scheduler; beta and on by default from \
         1.36)? Without it pods bind before this node admitted their shares; run the \
         plugin with --binding-conditions=false (chart: kubeletPlugin.bindingConditions) \
         on such a cluster"
    } else {
        "the API server keeps other values than were applied: an admission webhook or \
         mutating policy may rewrite ResourceSlices, or the API server is older than the \
         resource.k8s.io/v1 fields the plugin publishes"
    }
}

fn dropped_message(dropped: &[Dropped]) -> String {
    let fields: Vec<String> = dropped
        .iter()
        .map(|d| {
            format!(
                "{} device {} {}",
                d.slice, d.difference.device, d.difference.field
            )
        })
        .collect();
    format!(
        "the API server did not store {} field(s) of the published ResourceSlices as applied ({}): {}",
        dropped.len(),
        fields.join(", "),
        dropped_cause(dropped)
    )
}

/// What one pass changed, for logs and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Slices applied, with the pool generation they got.
    pub applied: Vec<(String, i64)>,
    pub deleted: Vec<String>,
}

pub struct Publisher {
    driver: String,
    node: NodeRef,
    /// How many slice names this node may use (`--max-slices-per-node`).
    slots: u32,
    clients: Clients,
    /// Calls: list, apply, delete.
    api: Api<ResourceSlice>,
    /// Slice name -> the digest of the content the API server was seen to store
    /// without some applied fields. Such a slice is not applied again for the same
    /// content (it would come back the same, with a new generation and a watch event
    /// each time); it is reported every pass instead.
    dropped: Mutex<BTreeMap<String, String>>,
    /// Devices carry the binding gate's conditions.
    gated: bool,
    /// Slice name -> this publisher's last write of it, to tell its echo in the watch.
    written: Mutex<BTreeMap<String, Written>>,
}

/// What a pass last did to one slice.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Written {
    /// Applied; the API server stored it at this resourceVersion.
    Applied(String),
    /// Deleted, the object of this uid.
    Deleted(String),
}

impl Publisher {
    /// Reads the Node, whose uid the slices' owner reference needs.
    pub async fn new(
        clients: Clients,
        driver: &str,
        node: &str,
        slots: u32,
        gated: bool,
    ) -> Result<Self, kube::Error> {
        let n = clients
            .bounded(Api::<Node>::all(clients.calls.clone()).get(node))
            .await?;
        Ok(Self {
            driver: driver.to_owned(),
            node: NodeRef {
                name: node.to_owned(),
                uid: n.metadata.uid.unwrap_or_default(),
            },
            slots,
            api: Api::all(clients.calls.clone()),
            clients,
            dropped: Mutex::new(BTreeMap::new()),
            gated,
            written: Mutex::new(BTreeMap::new()),
        })
    }

    fn selector(&self) -> String {
        format!(
            "spec.driver={},spec.nodeName={}",
            self.driver, self.node.name
        )
    }

    /// Changes of this driver's slices of this node on the API server.
    pub fn watch(
        &self,
    ) -> impl futures::Stream<Item = Result<watcher::Event<ResourceSlice>, watcher::Error>> + Send + use<>
    {
        // On the watch client: a watch idles between events for minutes, which the
        // calls client's read timeout would cut.
        watcher::watcher(
            Api::all(self.clients.watches.clone()),
            watcher::Config::default().fields(&self.selector()),
        )
    }

    /// Whether a watch event is only the echo of this publisher's own last write of
    /// that slice (the object as its apply stored it, or the one it deleted): a pass for
    /// it would find nothing to do, at the cost of a LIST.
    pub fn is_echo(&self, event: &watcher::Event<ResourceSlice>) -> bool {
        let (slice, seen) = match event {
            watcher::Event::Apply(s) => {
                (s, s.metadata.resource_version.clone().map(Written::Applied))
            }
            watcher::Event::Delete(s) => (s, s.metadata.uid.clone().map(Written::Deleted)),
            _ => return false,
        };
        let (Some(name), Some(seen)) = (slice.metadata.name.as_deref(), seen) else {
            return false;
        };
        self.written_map().get(name) == Some(&seen)
    }

    fn written_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Written>> {
        // A poisoned lock only means a panic elsewhere while it was held; the map is whole.
        self.written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Each pool's slice digest for `devices`, as a pass would publish them: what tells
    /// a change worth a pass (a device's fault, capacity, attributes) from one that is
    /// not (its shares' allocations, which no slice shows).
    pub fn digests(&self, devices: &DriverDevices) -> Vec<(String, String)> {
        build::desired(&self.driver, &self.node, devices, self.gated)
            .0
            .into_iter()
            .map(|d| (d.pool, d.digest))
            .collect()
    }

    /// One pass: list this driver's slices of this node, apply what differs, delete
    /// what is no longer a pool here, and check that the API server stores each slice
    /// as applied (see [`super::compare`]). Fields it dropped fail the pass with
    /// [`PublishError::FieldsDropped`] once everything else is done; such a slice is
    /// applied again at every pass, at its generation, until it is stored whole.
    ///
    /// `listed`: this driver's slices of this node as a list the caller has just had
    /// from the API server (the watch's), with no change since; None: the pass lists
    /// them itself.
    pub async fn publish(
        &self,
        devices: &DriverDevices,
        listed: Option<Vec<ResourceSlice>>,
    ) -> Result<Pass, PublishError> {
        let (mut desired, skipped) = build::desired(&self.driver, &self.node, devices, self.gated);
        for s in &skipped {
            warn!(driver = %self.driver, device = %s.device, reason = %s.reason, "device not published");
        }
        let listed = match listed {
            Some(l) => l,
            None => {
                self.clients
                    .bounded(
                        self.api
                            .list(&ListParams::default().fields(&self.selector())),
                    )
                    .await?
                    .items
            }
        };
        let placement = names::place(
            desired.iter().map(|d| d.pool.as_str()),
            &listed,
            &self.node.name,
            &self.driver,
            self.slots,
        );
        desired.retain_mut(|d| match placement.names.get(&d.pool) {
            Some(name) => {
                d.slice.metadata.name = Some(name.clone());
                true
            }
            None => false,
        });
        for (pool, why) in &placement.unplaced {
            error!(driver = %self.driver, pool = %pool, reason = %why, "pool not published");
        }
        let mut pass = Pass::default();
        let mut dropped = Vec::new();
        let annotation = digest_annotation(&self.driver);
        for d in desired.iter() {
            let name = d.slice.metadata.name.clone().unwrap_or_default();
            let current = listed
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name.as_str()));
            let same = current.filter(|s| {
                s.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(&annotation))
                    == Some(&d.digest)
            });
            if let Some(stored) = same {
                let diffs = differences(&d.slice.spec, &stored.spec);
                if diffs.is_empty() {
                    self.forget_dropped(&name);
                    continue;
                }
                if self.known_dropped(&name, &d.digest) {
                    // Applied again at every check, at the generation it has: its
                    // content is what that generation was always meant to be, so the
                    // scheduler sees no new generation, and once the API server keeps
                    // the fields (the gate turned on) the slice is whole again without
                    // a restart of the plugin.
                    let stored = self.apply(d, stored.spec.pool.generation).await?;
                    let diffs = differences(&d.slice.spec, &stored.spec);
                    if diffs.is_empty() {
                        self.forget_dropped(&name);
                        info!(driver = %self.driver, slice = %name, "the API server now stores every field of the ResourceSlice");
                        pass.applied
                            .push((name.clone(), stored.spec.pool.generation));
                    } else {
                        dropped.extend(self.report(&name, diffs));
                    }
                    continue;
                }
                // Our content by its annotation but not in its fields: someone edited
                // it, or the server dropped fields of an apply before this process
                // started. One apply tells which.
            }
            // Any change of a pool's devices is a new generation: the scheduler uses only
            // the newest generation of a pool, and this pool is one slice.
            let generation = listed
                .iter()
                .filter(|s| s.spec.pool.name == d.pool)
                .map(|s| s.spec.pool.generation)
                .max()
                .map_or(1, |g| g + 1);
            let stored = self.apply(d, generation).await?;
            info!(driver = %self.driver, slice = %name, pool = %d.pool, generation, "published ResourceSlice");
            pass.applied.push((name.clone(), generation));
            // The apply's answer is the object as stored.
            let diffs = differences(&d.slice.spec, &stored.spec);
            if diffs.is_empty() {
                self.forget_dropped(&name);
            } else {
                self.remember_dropped(&name, &d.digest);
                dropped.extend(self.report(&name, diffs));
            }
        }
        let wanted: BTreeMap<String, ()> = desired
            .iter()
            .filter_map(|d| d.slice.metadata.name.clone().map(|n| (n, ())))
            .collect();
        for s in &listed {
            let Some(name) = s.metadata.name.as_deref() else {
                continue;
            };
            if wanted.contains_key(name) {
                continue;
            }
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: s.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            match self.clients.bounded(self.api.delete(name, &dp)).await {
                Ok(_) => {
                    if let Some(uid) = s.metadata.uid.clone() {
                        self.written_map()
                            .insert(name.to_owned(), Written::Deleted(uid));
                    }
                }
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
            self.forget_dropped(name);
            info!(driver = %self.driver, slice = %name, "deleted ResourceSlice of a pool no longer here");
            pass.deleted.push(name.to_owned());
        }
        if !dropped.is_empty() {
            Err(PublishError::FieldsDropped(dropped))
        } else if !placement.unplaced.is_empty() {
            Err(PublishError::Unplaced(placement.unplaced))
        } else {
            Ok(pass)
        }
    }

    /// Applies the slice; the answer is the object as the API server stored it.
    async fn apply(&self, d: &Desired, generation: i64) -> Result<ResourceSlice, kube::Error> {
        let mut slice = d.slice.clone();
        slice.spec.pool.generation = generation;
        let name = slice.metadata.name.clone().unwrap_or_default();
        // force: this driver owns its slices; a field another manager set is taken over.
        let params = PatchParams::apply(&self.driver).force();
        let stored = self
            .clients
            .bounded(self.api.patch(&name, &params, &Patch::Apply(&slice)))
            .await?;
        if let Some(rv) = stored.metadata.resource_version.clone() {
            self.written_map().insert(name, Written::Applied(rv));
        }
        Ok(stored)
    }

    /// Logs each dropped field at error level, naming the slice, device and field, and
    /// the likely cause.
    fn report(&self, slice: &str, diffs: Vec<Difference>) -> Vec<Dropped> {
        let dropped: Vec<Dropped> = diffs
            .into_iter()
            .map(|difference| Dropped {
                slice: slice.to_owned(),
                difference,
            })
            .collect();
        let cause = dropped_cause(&dropped);
        for d in &dropped {
            error!(
                driver = %self.driver,
                slice = %d.slice,
                device = %d.difference.device,
                field = %d.difference.field,
                applied = %d.difference.applied,
                stored = %d.difference.stored,
                cause,
                "the API server did not store a field of the ResourceSlice as applied"
            );
        }
        dropped
    }

    fn dropped_map(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, String>> {
        // A poisoned lock only means a panic elsewhere while it was held; the map is whole.
        self.dropped
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn known_dropped(&self, slice: &str, digest: &str) -> bool {
        self.dropped_map().get(slice).map(String::as_str) == Some(digest)
    }

    fn remember_dropped(&self, slice: &str, digest: &str) {
        self.dropped_map()
            .insert(slice.to_owned(), digest.to_owned());
    }

    fn forget_dropped(&self, slice: &str) {
        self.dropped_map().remove(slice);
    }
}
