//! The plugin's reads from the API server: the claim kubelet asked about and its pods.

use std::{path::Path, time::Duration};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use tracing::warn;

use crate::{
    claims::ReservedPod,
    error::{ClaimError, PluginError},
};

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

    /// The uids of the reserved pods that are bound to this node. A pod that is gone or
    /// was replaced (another uid under the name) is left out: its sandbox will never
    /// appear here.
    pub async fn pods_on_node(
        &self,
        namespace: &str,
        pods: &[ReservedPod],
    ) -> Result<Vec<String>, ClaimError> {
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let mut out = Vec::new();
        for p in pods {
            let pod = match api.get_opt(&p.name).await {
                Ok(Some(pod)) => pod,
                Ok(None) => {
                    warn!(pod = %p.name, uid = %p.uid, "reserved pod not found; left out");
                    continue;
                }
                Err(source) => {
                    return Err(ClaimError::Api {
                        what: format!("Pod {namespace}/{}", p.name),
                        source,
                    });
                }
            };
            let uid = pod.metadata.uid.as_deref().unwrap_or("");
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            if uid != p.uid {
                warn!(pod = %p.name, reserved = %p.uid, found = %uid, "reserved pod was replaced; left out");
            } else if node == Some(self.node.as_str()) {
                out.push(p.uid.clone());
            }
        }
        Ok(out)
    }
}
