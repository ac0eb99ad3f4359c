//! kubelet's DRA service, versions v1 and v1beta1: the same calls with the same shapes
//! (v1beta1 without share ids), translated to and from [`crate::driver::Driver`].

use std::sync::Arc;

use shareguard_proto::{
    kubelet::{dra_v1 as v1, dra_v1beta1 as v1beta1},
    v1 as pb,
};
use tonic::{Request, Response, Status};

use crate::driver::{DeviceAnswer, Driver};

/// `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
pub struct V1(pub Arc<Driver>);
/// `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`.
pub struct V1Beta1(pub Arc<Driver>);

fn claim_ref(namespace: String, uid: String, name: String) -> pb::ClaimRef {
    pb::ClaimRef {
        uid,
        namespace,
        name,
    }
}

fn error_text<T>(r: &Result<T, String>) -> String {
    r.as_ref().err().cloned().unwrap_or_default()
}

/// The two versions' services differ only in their message types (and v1beta1's
/// `Device` has no share id), so one body serves both.
macro_rules! dra_service {
    ($service:ident, $api:ident, $device:expr) => {
        #[tonic::async_trait]
        impl $api::dra_plugin_server::DraPlugin for $service {
            async fn node_prepare_resources(
                &self,
                req: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let claims: Vec<pb::ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.uid, c.name))
                    .collect();
                let to_device: fn(DeviceAnswer) -> $api::Device = $device;
                let claims = self
                    .0
                    .prepare(&claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let error = error_text(&r);
                        let devices = r.unwrap_or_default().into_iter().map(to_device).collect();
                        (uid, $api::NodePrepareResourceResponse { devices, error })
                    })
                    .collect();
                Ok(Response::new($api::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let claims: Vec<pb::ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.uid, c.name))
                    .collect();
                let claims = self
                    .0
                    .unprepare(&claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let error = error_text(&r);
                        (uid, $api::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($api::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_service!(V1, v1, |d| v1::Device {
    request_names: vec![d.request],
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_device_ids,
    share_id: d.share_id,
});

dra_service!(V1Beta1, v1beta1, |d| v1beta1::Device {
    request_names: vec![d.request],
    pool_name: d.pool,
    device_name: d.device,
    cdi_device_ids: d.cdi_device_ids,
});
