//! kubelet's side of the plugin, for the tests: its plugin watcher's registration calls,
//! its DRA calls and its resource health streams, from the kubelet API definitions, over
//! the plugin's sockets.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use shareguard_proto::kubelet::{
    dra_health_v1::{
        self as health_v1, dra_resource_health_client::DraResourceHealthClient as HealthV1Client,
    },
    dra_health_v1alpha1::{
        self as health_v1alpha1,
        dra_resource_health_client::DraResourceHealthClient as HealthV1Alpha1Client,
    },
    dra_v1::{self as v1, dra_plugin_client::DraPluginClient as V1Client},
    dra_v1beta1::{self as v1beta1, dra_plugin_client::DraPluginClient as V1Beta1Client},
    pluginregistration::{self as reg, registration_client::RegistrationClient},
};
use tonic::transport::Channel;

pub use shareguard_proto::kubelet::{
    dra_health_v1, dra_health_v1alpha1, dra_v1, dra_v1beta1, pluginregistration,
};

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
        self.instance_registration_socket(driver, None)
    }

    /// The registration socket of the plugin instance `instance` (None: a plugin run
    /// without an instance id) for `driver`.
    pub fn instance_registration_socket(&self, driver: &str, instance: Option<&str>) -> PathBuf {
        let file = match instance {
            Some(id) => format!("reg-{id}.sock"),
            None => "reg.sock".to_owned(),
        };
        self.registry_dir.join(driver).join(file)
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

    /// What kubelet 1.36 does on every DRA plugin: `v1alpha1.DRAResourceHealth` on the
    /// DRA socket, one stream.
    pub async fn health_v1alpha1(&self, endpoint: &str) -> HealthStream {
        let mut c = HealthV1Alpha1Client::new(channel(Path::new(endpoint)).await);
        let s = c
            .node_watch_resources(health_v1alpha1::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        HealthStream::V1Alpha1(s)
    }

    /// What kubelet 1.37 does when the registration lists `v1.DRAResourceHealth`.
    pub async fn health_v1(&self, endpoint: &str) -> HealthStream {
        let mut c = HealthV1Client::new(channel(Path::new(endpoint)).await);
        let s = c
            .node_watch_resources(health_v1::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
        HealthStream::V1(s)
    }
}

/// One device's health as kubelet read it from a stream of either version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeardHealth {
    pub pool: String,
    pub device: String,
    /// "UNKNOWN", "HEALTHY" or "UNHEALTHY", as kubelet's enum names it.
    pub health: String,
    pub message: String,
    pub last_updated_time: i64,
    pub health_check_timeout_seconds: i64,
}

/// A resource health stream kubelet holds open.
pub enum HealthStream {
    V1Alpha1(tonic::Streaming<health_v1alpha1::NodeWatchResourcesResponse>),
    V1(tonic::Streaming<health_v1::NodeWatchResourcesResponse>),
}

macro_rules! heard {
    ($r:expr, $v:ident) => {
        $r.devices
            .into_iter()
            .map(|d| {
                let id = d.device.clone().unwrap_or_default();
                HeardHealth {
                    pool: id.pool_name,
                    device: id.device_name,
                    health: $v::HealthStatus::try_from(d.health)
                        .map_or_else(|_| format!("?{}", d.health), |h| h.as_str_name().to_owned()),
                    message: d.message,
                    last_updated_time: d.last_updated_time,
                    health_check_timeout_seconds: d.health_check_timeout_seconds,
                }
            })
            .collect()
    };
}

impl HealthStream {
    /// The next message: every device the driver has, as the plugin sees it now.
    pub async fn next(&mut self) -> Vec<HeardHealth> {
        match self {
            HealthStream::V1Alpha1(s) => {
                let r = s.message().await.unwrap().expect("the stream ended");
                heard!(r, health_v1alpha1)
            }
            HealthStream::V1(s) => {
                let r = s.message().await.unwrap().expect("the stream ended");
                heard!(r, health_v1)
            }
        }
    }

    /// Reads messages until `device` is reported in `health`; panics after `timeout`
    /// with the last message.
    pub async fn wait_for(&mut self, device: &str, health: &str, timeout: Duration) -> HeardHealth {
        let deadline = Instant::now() + timeout;
        let mut last = Vec::new();
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(m) = tokio::time::timeout(left, self.next()).await else {
                break;
            };
            if let Some(d) = m.iter().find(|d| d.device == device && d.health == health) {
                return d.clone();
            }
            last = m;
        }
        panic!("{device} not {health} within {timeout:?}; last heard: {last:#?}")
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
