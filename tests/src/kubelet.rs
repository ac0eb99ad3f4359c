//! kubelet's side of the plugin, for the tests: its plugin watcher's registration calls
//! and its DRA calls, from the kubelet API definitions, over the plugin's sockets.

use std::path::{Path, PathBuf};

use shareguard_proto::kubelet::{
    dra_v1::{self as v1, dra_plugin_client::DraPluginClient as V1Client},
    dra_v1beta1::{self as v1beta1, dra_plugin_client::DraPluginClient as V1Beta1Client},
    pluginregistration::{self as reg, registration_client::RegistrationClient},
};
use tonic::transport::Channel;

pub use shareguard_proto::kubelet::{dra_v1, dra_v1beta1, pluginregistration};

/// kubelet's plugin directories on a test "node".
#[derive(Clone, Debug)]
pub struct Kubelet {
    pub registry_dir: PathBuf,
    pub plugins_dir: PathBuf,
}

async fn channel(path: &Path) -> Channel {
    shareguard_uds::client::connect(path)
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", path.display()))
}

impl Kubelet {
    pub fn registration_socket(&self, driver: &str) -> PathBuf {
        self.registry_dir.join(driver).join("reg.sock")
    }

    /// What the plugin watcher does on finding the socket: GetInfo, then (when it
    /// accepts the plugin) NotifyRegistrationStatus.
    pub async fn register(&self, driver: &str, accept: Result<(), &str>) -> reg::PluginInfo {
        self.register_at(&self.registration_socket(driver), accept)
            .await
    }

    /// [`Kubelet::register`] through the registration socket at `socket`, one of
    /// several instances' (kubelet finds each in its registry directory).
    pub async fn register_at(&self, socket: &Path, accept: Result<(), &str>) -> reg::PluginInfo {
        let mut c = RegistrationClient::new(channel(socket).await);
        let info = c.get_info(reg::InfoRequest {}).await.unwrap().into_inner();
        let status = match accept {
            Ok(()) => reg::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            },
            Err(e) => reg::RegistrationStatus {
                plugin_registered: false,
                error: e.to_owned(),
            },
        };
        c.notify_registration_status(status).await.unwrap();
        info
    }

    pub async fn v1(&self, endpoint: &str) -> V1Client<Channel> {
        V1Client::new(channel(Path::new(endpoint)).await)
    }

    pub async fn v1beta1(&self, endpoint: &str) -> V1Beta1Client<Channel> {
        V1Beta1Client::new(channel(Path::new(endpoint)).await)
    }
}

/// kubelet's claim reference for a claim.
pub fn v1_claim(namespace: &str, name: &str, uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: namespace.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

pub fn v1beta1_claim(namespace: &str, name: &str, uid: &str) -> v1beta1::Claim {
    v1beta1::Claim {
        namespace: namespace.into(),
        uid: uid.into(),
        name: name.into(),
    }
}

/// kubelet's NodePrepareResources (v1) for one claim: the claim's entry of the answer.
pub async fn prepare_v1(
    c: &mut V1Client<Channel>,
    namespace: &str,
    name: &str,
    uid: &str,
) -> v1::NodePrepareResourceResponse {
    let mut r = c
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(namespace, name, uid)],
        })
        .await
        .unwrap()
        .into_inner();
    r.claims
        .remove(uid)
        .unwrap_or_else(|| panic!("no answer for claim {uid}: {r:?}"))
}

/// kubelet's NodeUnprepareResources (v1) for one claim: the claim's entry of the answer.
pub async fn unprepare_v1(
    c: &mut V1Client<Channel>,
    namespace: &str,
    name: &str,
    uid: &str,
) -> v1::NodeUnprepareResourceResponse {
    let mut r = c
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![v1_claim(namespace, name, uid)],
        })
        .await
        .unwrap()
        .into_inner();
    r.claims
        .remove(uid)
        .unwrap_or_else(|| panic!("no answer for claim {uid}: {r:?}"))
}
