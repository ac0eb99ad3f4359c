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

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for V1 {
    async fn node_prepare_resources(
        &self,
        req: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims: Vec<pb::ClaimRef> = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.uid, c.name))
            .collect();
        let claims = self
            .0
            .prepare(&claims)
            .await
            .into_iter()
            .map(|(uid, r)| {
                let error = error_text(&r);
                let devices = r
                    .unwrap_or_default()
                    .into_iter()
                    .map(|d: DeviceAnswer| v1::Device {
                        request_names: vec![d.request],
                        pool_name: d.pool,
                        device_name: d.device,
                        cdi_device_ids: d.cdi_device_ids,
                        share_id: d.share_id,
                    })
                    .collect();
                (uid, v1::NodePrepareResourceResponse { devices, error })
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
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
                (uid, v1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for V1Beta1 {
    async fn node_prepare_resources(
        &self,
        req: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims: Vec<pb::ClaimRef> = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| claim_ref(c.namespace, c.uid, c.name))
            .collect();
        let claims = self
            .0
            .prepare(&claims)
            .await
            .into_iter()
            .map(|(uid, r)| {
                let error = error_text(&r);
                let devices = r
                    .unwrap_or_default()
                    .into_iter()
                    .map(|d: DeviceAnswer| v1beta1::Device {
                        request_names: vec![d.request],
                        pool_name: d.pool,
                        device_name: d.device,
                        cdi_device_ids: d.cdi_device_ids,
                    })
                    .collect();
                (uid, v1beta1::NodePrepareResourceResponse { devices, error })
            })
            .collect();
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims,
        }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
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
                (uid, v1beta1::NodeUnprepareResourceResponse { error })
            })
            .collect();
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims,
        }))
    }
}
