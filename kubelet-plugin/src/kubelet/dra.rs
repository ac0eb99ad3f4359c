//! kubelet's DRA service, versions v1 and v1beta1: the same calls with the same shapes
//! (v1beta1 without share ids), translated to and from [`crate::driver::Driver`].

use std::sync::Arc;

use shareguard_proto::{
    kubelet::{dra_v1 as v1, dra_v1beta1 as v1beta1},
    v1 as pb,
};
use tonic::{Request, Response, Status};

use crate::forward::FORWARDED_BY;
use crate::{
    answer::{Caller, DeviceAnswer},
    driver::Driver,
};

fn caller<T>(req: &Request<T>) -> Caller {
    if req.metadata().contains_key(FORWARDED_BY) {
        Caller::FencedInstance
    } else {
        Caller::Kubelet
    }
}

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
                let caller = caller(&req);
                let claims: Vec<pb::ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.uid, c.name))
                    .collect();
                let to_device: fn(DeviceAnswer) -> $api::Device = $device;
                let claims = self
                    .0
                    .prepare(&claims, caller)
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
                let caller = caller(&req);
                let claims: Vec<pb::ClaimRef> = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| claim_ref(c.namespace, c.uid, c.name))
                    .collect();
                let claims = self
                    .0
                    .unprepare(&claims, caller)
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

/// A device of a prepared claim as kubelet's v1 API has it: `share_id` is `optional`
/// there, so a whole device sends none.
fn v1_device(d: DeviceAnswer) -> v1::Device {
    v1::Device {
        request_names: vec![d.request],
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

/// v1beta1 has no share id: kubelets that speak only v1beta1 predate consumable capacity.
fn v1beta1_device(d: DeviceAnswer) -> v1beta1::Device {
    v1beta1::Device {
        request_names: vec![d.request],
        pool_name: d.pool,
        device_name: d.device,
        cdi_device_ids: d.cdi_device_ids,
    }
}

dra_service!(V1, v1, v1_device);

dra_service!(V1Beta1, v1beta1, v1beta1_device);

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(share_id: Option<&str>) -> DeviceAnswer {
        DeviceAnswer {
            request: "bw".into(),
            pool: "node-a".into(),
            device: "nic-0".into(),
            share_id: share_id.map(str::to_owned),
            cdi_device_ids: vec![],
        }
    }

    /// kubelet's proto has `optional string share_id`: a whole device sends none at
    /// all, a share sends its id, and the two are told apart on the wire.
    #[test]
    fn a_whole_device_sends_no_share_id_and_a_share_sends_its_own() {
        use prost::Message;
        let whole = v1_device(answer(None));
        assert_eq!(whole.share_id, None);
        let decoded = v1::Device::decode(whole.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.share_id, None);
        let id = "3f1b2c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d";
        let share = v1_device(answer(Some(id)));
        let decoded = v1::Device::decode(share.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.share_id.as_deref(), Some(id));
        // Set but empty is still set: proto3 `optional` keeps presence.
        let empty = v1::Device {
            share_id: Some(String::new()),
            ..whole
        };
        let decoded = v1::Device::decode(empty.encode_to_vec().as_slice()).unwrap();
        assert_eq!(decoded.share_id, Some(String::new()));
    }
}
