//! kubelet's DRA resource health service, versions v1alpha1 and v1 (the same messages):
//! each stream translated from [`crate::device_health::watch`], which decides.

use std::{pin::Pin, sync::Arc};

use futures::{Stream, StreamExt as _};
use shareguard_proto::kubelet::{dra_health_v1 as v1, dra_health_v1alpha1 as v1alpha1};
use tonic::{Request, Response, Status};

use crate::{
    agent::Agent,
    device_health::{self, DeviceHealth, Health},
    driver::Driver,
};

/// `v1alpha1.DRAResourceHealth`: kubelet 1.36 dials it on every DRA plugin.
pub struct HealthV1Alpha1 {
    pub agent: Arc<Agent>,
    pub driver: Arc<Driver>,
}

/// `v1.DRAResourceHealth`: kubelet 1.37 dials it when the registration lists it.
pub struct HealthV1 {
    pub agent: Arc<Agent>,
    pub driver: Arc<Driver>,
}

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// One version's messages, made the same way: the two packages differ in name only.
macro_rules! translate {
    ($v:ident) => {
        fn $v(list: Vec<DeviceHealth>) -> $v::NodeWatchResourcesResponse {
            $v::NodeWatchResourcesResponse {
                devices: list
                    .into_iter()
                    .map(|d| $v::DeviceHealth {
                        device: Some($v::DeviceIdentifier {
                            pool_name: d.pool,
                            device_name: d.device,
                        }),
                        health: match d.health {
                            Health::Unknown => $v::HealthStatus::Unknown,
                            Health::Healthy => $v::HealthStatus::Healthy,
                            Health::Unhealthy => $v::HealthStatus::Unhealthy,
                        }
                        .into(),
                        last_updated_time: d.at,
                        health_check_timeout_seconds: device_health::TIMEOUT_SECONDS,
                        message: d.message,
                    })
                    .collect(),
            }
        }
    };
}

translate!(v1alpha1);
translate!(v1);

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for HealthV1Alpha1 {
    type NodeWatchResourcesStream = Streamed<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _req: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let s = device_health::watch(self.agent.clone(), self.driver.clone())
            .map(|list| Ok(v1alpha1(list)));
        Ok(Response::new(Box::pin(s)))
    }
}

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for HealthV1 {
    type NodeWatchResourcesStream = Streamed<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _req: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        let s =
            device_health::watch(self.agent.clone(), self.driver.clone()).map(|list| Ok(v1(list)));
        Ok(Response::new(Box::pin(s)))
    }
}
