//! The plugin's reads from the API server: the claim kubelet asked about.

use std::{path::Path, time::Duration};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::error::{ClaimError, PluginError};

/// Builds the client: the kubeconfig given, else the in-cluster config, else the
/// kubeconfig `$KUBECONFIG` names.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, PluginError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| PluginError::KubeConfig(format!("reading {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| PluginError::KubeConfig(format!("{}: {e}", path.display())))?
        }
        None => match Config::incluster() {
            Ok(c) => c,
            Err(in_cluster) => Config::from_kubeconfig(&KubeConfigOptions::default())
                .await
                .map_err(|e| {
                    PluginError::KubeConfig(format!(
                        "not in a cluster ({in_cluster}), and no kubeconfig: {e}"
                    ))
                })?,
        },
    };
    // Well inside kubelet's 45 s for a whole NodePrepareResources.
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(10));
    config.write_timeout = Some(Duration::from_secs(10));
    Client::try_from(config).map_err(|e| PluginError::KubeConfig(e.to_string()))
}

#[derive(Clone)]
pub struct Cluster {
    client: Client,
    node: String,
}

impl Cluster {
    pub fn new(client: Client, node: String) -> Self {
        Self { client, node }
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ClaimError> {
        Api::<ResourceClaim>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|source| ClaimError::Api {
                what: format!("ResourceClaim {namespace}/{name}"),
                source,
            })
    }
}
