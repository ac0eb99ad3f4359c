//! Keeps one driver's ResourceSlices on the API server equal to what this node has:
//! applied (server-side, the driver as field manager) when missing or different, with the
//! pool's generation raised; slices of pools that are gone deleted.
//!
//! Each pass lists the slices on the API server rather than trusting memory; the plugin
//! runs one whenever the watch of its slices reports a change (so a slice someone
//! deleted or edited comes back at once), when the agent's inventory changed, and now and
//! then regardless. When the plugin is removed for good, kubelet deletes the driver's
//! slices on this node once its registration socket has been gone for 30 s; a rolling
//! update comes back well within that.

use std::collections::BTreeMap;

use k8s_openapi::api::{core::v1::Node, resource::v1::ResourceSlice};
use kube::{
    Api,
    api::{DeleteParams, ListParams, Patch, PatchParams, Preconditions},
    runtime::watcher,
};
use tracing::{info, warn};

use super::build::{self, Desired, NodeRef, digest_annotation};
use crate::{cluster::Clients, inventory::DriverDevices};

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
    clients: Clients,
    /// Calls: list, apply, delete.
    api: Api<ResourceSlice>,
}

impl Publisher {
    /// Reads the Node, whose uid the slices' owner reference needs.
    pub async fn new(clients: Clients, driver: &str, node: &str) -> Result<Self, kube::Error> {
        let n = clients
            .bounded(Api::<Node>::all(clients.calls.clone()).get(node))
            .await?;
        Ok(Self {
            driver: driver.to_owned(),
            node: NodeRef {
                name: node.to_owned(),
                uid: n.metadata.uid.unwrap_or_default(),
            },
            api: Api::all(clients.calls.clone()),
            clients,
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

    /// One pass: list this driver's slices of this node, apply what differs, delete
    /// what is no longer a pool here.
    pub async fn publish(&self, devices: &DriverDevices) -> Result<Pass, kube::Error> {
        let (desired, skipped) = build::desired(&self.driver, &self.node, devices);
        for s in &skipped {
            warn!(driver = %self.driver, device = %s.device, reason = %s.reason, "device not published");
        }
        let listed = self
            .clients
            .bounded(
                self.api
                    .list(&ListParams::default().fields(&self.selector())),
            )
            .await?
            .items;
        let mut pass = Pass::default();
        let annotation = digest_annotation(&self.driver);
        for d in desired.iter() {
            let name = d.slice.metadata.name.clone().unwrap_or_default();
            let current = listed
                .iter()
                .find(|s| s.metadata.name.as_deref() == Some(name.as_str()));
            let same = current.is_some_and(|s| {
                s.metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(&annotation))
                    == Some(&d.digest)
            });
            if same {
                continue;
            }
            // Any change of a pool's devices is a new generation: the scheduler uses only
            // the newest generation of a pool, and this pool is one slice.
            let generation = listed
                .iter()
                .filter(|s| s.spec.pool.name == d.pool)
                .map(|s| s.spec.pool.generation)
                .max()
                .map_or(1, |g| g + 1);
            self.apply(d, generation).await?;
            info!(driver = %self.driver, slice = %name, pool = %d.pool, generation, "published ResourceSlice");
            pass.applied.push((name, generation));
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
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(e),
            }
            info!(driver = %self.driver, slice = %name, "deleted ResourceSlice of a pool no longer here");
            pass.deleted.push(name.to_owned());
        }
        Ok(pass)
    }

    async fn apply(&self, d: &Desired, generation: i64) -> Result<(), kube::Error> {
        let mut slice = d.slice.clone();
        slice.spec.pool.generation = generation;
        let name = slice.metadata.name.clone().unwrap_or_default();
        // force: this driver owns its slices; a field another manager set is taken over.
        let params = PatchParams::apply(&self.driver).force();
        self.clients
            .bounded(self.api.patch(&name, &params, &Patch::Apply(&slice)))
            .await?;
        Ok(())
    }
}
