//! The fleet's churn phase: claims prepared and released across the fleet, as kubelets
//! would, at a steady rate. The harness plays the scheduler and kubelet for each claim:
//! it creates a Pod bound to a node and the claim it uses (owned by the Pod, as one made
//! from the pod's template is), writes the allocation and reservation as the scheduler
//! does (one share of the node's device, the node in the allocation's node selector),
//! calls the node's plugin's `NodePrepareResources` over its DRA socket, and after the
//! claim's lifetime `NodeUnprepareResources`, then deletes the Pod and the claim. The
//! plugin reads the claim, prepares it on its (simulated) agent and writes its status as
//! it does on a real node. No scheduler places these pods (they are created bound), so
//! the binding gate takes no part: its requests are counted on the real cluster
//! (docs/kubernetes.md).

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    resource::v1::ResourceClaim,
};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use shareguard_tests::kubelet::{Kubelet, dra_v1 as v1};

pub const NAMESPACE: &str = "fleet-churn";
const DEVICE_CLASS: &str = "shareguard-net-bandwidth";
/// How long kubelet keeps calling Prepare for one claim that fails before the harness
/// counts it failed (kubelet itself retries for as long as the pod exists).
const PREPARE_PATIENCE: Duration = Duration::from_secs(120);

/// What the harness needs of one node to play its kubelet: its folders, and the DRA
/// endpoint its plugin registered.
pub struct NodeRef {
    pub name: String,
    pub kubelet: Kubelet,
    pub endpoint: String,
}

/// The share every claim asks for: the device's name and driver, and one capacity at
/// its policy's default.
#[derive(Clone)]
pub struct ShareAsk {
    pub driver: String,
    pub device: String,
    pub capacity: String,
    pub amount: String,
}

/// One claim's life as kubelet saw it.
pub struct Outcome {
    /// Prepare calls until one succeeded (kubelet retries a failed one).
    pub prepare_calls: u32,
    /// From the first Prepare call to the successful answer; None: never prepared.
    pub prepared_in: Option<Duration>,
    pub unprepared: bool,
}

pub async fn create_namespace(admin: &Client) {
    let api: Api<Namespace> = Api::all(admin.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).unwrap();
    api.create(&PostParams::default(), &ns).await.unwrap();
}

pub async fn delete_namespace(admin: &Client) {
    let api: Api<Namespace> = Api::all(admin.clone());
    let _ = api.delete(NAMESPACE, &DeleteParams::default()).await;
}

/// kubelet's registration of the node's plugin instance `instance` (the plugin
/// watcher's GetInfo and NotifyRegistrationStatus), giving the DRA endpoint kubelet then
/// calls.
pub async fn register(name: String, kubelet: Kubelet, driver: &str, instance: &str) -> NodeRef {
    let socket = kubelet.instance_registration_socket(driver, Some(instance));
    let endpoint = kubelet.register_at(&socket, Ok(())).await.endpoint;
    NodeRef {
        name,
        kubelet,
        endpoint,
    }
}

/// One claim from creation to deletion on `node`; `lifetime` from its Prepare to its
/// Unprepare.
pub async fn claim_life(
    admin: Client,
    node: Arc<NodeRef>,
    ask: Arc<ShareAsk>,
    name: String,
    lifetime: Duration,
) -> Outcome {
    let claims: Api<ResourceClaim> = Api::namespaced(admin.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    // Bound to the node from the start, and tolerating its being unreachable (no
    // kubelet reports it), so nothing evicts it during the run.
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeName": node.name,
            "resourceClaims": [{"name": "bw", "resourceClaimName": name}],
            "containers": [{
                "name": "c",
                "image": "fleet.invalid/none:0",
                "resources": {"claims": [{"name": "bw"}]},
            }],
            "tolerations": [{"operator": "Exists", "effect": "NoExecute"}],
        },
    }))
    .unwrap();
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
    let pod_uid = pod.metadata.uid.clone().unwrap();
    // Owned by its pod, as the resource claim controller makes a claim from a pod's
    // template (most claims are): the plugin leaves such a claim's release to its
    // deallocation.
    let claim: ResourceClaim = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod_uid,
                "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {"devices": {"requests": [{
            "name": "bw",
            "exactly": {
                "deviceClassName": DEVICE_CLASS,
                "capacity": {"requests": {ask.capacity.as_str(): ask.amount}},
            },
        }]}},
    }))
    .unwrap();
    let claim = claims.create(&PostParams::default(), &claim).await.unwrap();
    let uid = claim.metadata.uid.clone().unwrap();
    // What the scheduler writes: the allocation, on this node, and the reservation.
    let status = json!({"status": {
        "allocation": {
            "devices": {"results": [{
                "request": "bw",
                "driver": ask.driver,
                "pool": node.name,
                "device": ask.device,
                "shareID": shareguard_tests::share_id(),
                "consumedCapacity": {ask.capacity.as_str(): ask.amount},
            }]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{
                "key": "metadata.name", "operator": "In", "values": [node.name],
            }]}]},
        },
        "reservedFor": [{"resource": "pods", "name": name, "uid": pod_uid}],
    }});
    claims
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();

    let mut dra = node.kubelet.v1(&node.endpoint).await;
    let ask_claim = || vec![shareguard_tests::kubelet::v1_claim(NAMESPACE, &name, &uid)];
    let started = Instant::now();
    let mut out = Outcome {
        prepare_calls: 0,
        prepared_in: None,
        unprepared: false,
    };
    // kubelet's retry of a failed Prepare, shortened: it backs off up to minutes.
    let mut wait = Duration::from_millis(500);
    while started.elapsed() < PREPARE_PATIENCE {
        out.prepare_calls += 1;
        let answer = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: ask_claim(),
            })
            .await;
        let ok = match answer {
            Ok(r) => r
                .into_inner()
                .claims
                .get(&uid)
                .is_some_and(|c| c.error.is_empty()),
            Err(_) => false,
        };
        if ok {
            out.prepared_in = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(8));
    }
    if out.prepared_in.is_some() {
        tokio::time::sleep(lifetime).await;
        out.unprepared = dra
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: ask_claim(),
            })
            .await
            .is_ok_and(|r| {
                r.into_inner()
                    .claims
                    .get(&uid)
                    .is_some_and(|c| c.error.is_empty())
            });
    }
    // kubelet removes the pod once its containers stopped and the claim is unprepared;
    // the claim goes with it (as one made from a template does).
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete(&name, &now).await.unwrap();
    // The garbage collector may have taken the claim with its pod already.
    match claims.delete(&name, &now).await {
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        r => {
            r.unwrap_or_else(|e| panic!("deleting claim {name}: {e}"));
        }
    }
    out
}
