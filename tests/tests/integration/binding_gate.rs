//! The kubelet plugin's binding gate against the API STAND-IN, with the real plugin and
//! agent: a pod the scheduler nominated to the node has its claim admitted before it is
//! bound (capacity held, `Admitted` in the claim), a claim the node's ledger refuses says
//! `AdmissionRefused` (so the scheduler places the pod elsewhere), kubelet's Prepare
//! takes a gate share over, and a gate share whose claim lost the allocation before any
//! kubelet prepared it is released, while one kubelet prepared never is.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::time::Duration;

use k8s_openapi::api::{
    core::v1::{Pod, PodResourceClaim, PodStatus},
    resource::v1::{AllocatedDeviceStatus, ResourceClaim},
};
use shareguard_tests::proto::node_agent_client::NodeAgentClient;
use shareguard_tests::{
    Agent, DRIVER, Options, POOL,
    apiserver::ApiServer,
    generic_device, get_share,
    k8s::{self, claim, pod, result},
    kubelet::prepare_v1,
    net::wait_for,
    plugin::Plugin,
    proto as pb, share_id,
};
use tonic::transport::Channel;

const NODE: &str = "node-a";
const NS: &str = "team-a";
const WAIT: Duration = Duration::from_secs(20);

/// An unbound pod the scheduler nominated to NODE, using claim `claim`.
fn nominated(name: &str, uid: &str, claim: &str) -> Pod {
    let mut p = pod(NS, name, uid, NODE);
    let spec = p.spec.as_mut().unwrap();
    spec.node_name = None;
    spec.resource_claims = Some(vec![PodResourceClaim {
        name: "c".into(),
        resource_claim_name: Some(claim.into()),
        ..Default::default()
    }]);
    p.status = Some(PodStatus {
        nominated_node_name: Some(NODE.into()),
        ..Default::default()
    });
    p
}

/// A claim allocated on NODE's mem-0 with the gate's binding conditions, reserved for
/// the pod, as the scheduler's PreBind leaves it.
fn gated_claim(
    name: &str,
    uid: &str,
    share: &str,
    amount: &str,
    pod: (&str, &str),
) -> ResourceClaim {
    let mut r = result(
        "mem",
        DRIVER,
        POOL,
        "mem-0",
        Some(share),
        &[("memory", amount)],
    );
    r.binding_conditions = Some(vec!["Admitted".into()]);
    r.binding_failure_conditions = Some(vec!["AdmissionRefused".into()]);
    claim(NS, name, uid, Some(vec![r]), &[pod])
}

/// Our driver's entry of the claim's status.devices with condition `type_`, if any.
fn condition(api: &ApiServer, claim: &str, type_: &str) -> Option<(String, String, String)> {
    let devices: Vec<AllocatedDeviceStatus> = api
        .get::<ResourceClaim>(NS, claim)
        .and_then(|c| c.status)
        .and_then(|s| s.devices)
        .unwrap_or_default();
    devices
        .iter()
        .filter(|d| d.driver == DRIVER)
        .flat_map(|d| d.conditions.iter().flatten())
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn phase_of(c: &mut NodeAgentClient<Channel>, id: &str) -> Option<(pb::Phase, bool)> {
    c.get_share(pb::GetShareRequest {
        share_id: id.into(),
    })
    .await
    .ok()
    .map(|r| r.into_inner())
    .map(|s| {
        (
            pb::Phase::try_from(s.phase).unwrap_or(pb::Phase::Unspecified),
            s.pre_bind,
        )
    })
}

/// An agent with an 8Gi generic device on NODE, and the API stand-in with NODE.
async fn node() -> (Agent, NodeAgentClient<Channel>, ApiServer) {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let client = agent.client().await;
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    (agent, client, api)
}

/// Pod `pod` nominated to NODE with claim `claim` of `amount`, as the scheduler's
/// PreBind leaves them: (claim uid, share id).
fn nominate(api: &ApiServer, pod: &str, claim: &str, amount: &str) -> (String, String) {
    let (pod_uid, claim_uid, share) = (share_id(), share_id(), share_id());
    api.put(&nominated(pod, &pod_uid, claim));
    api.put(&gated_claim(
        claim,
        &claim_uid,
        &share,
        amount,
        (pod, &pod_uid),
    ));
    (claim_uid, share)
}

#[tokio::test]
async fn a_nominated_pods_claim_is_admitted_before_binding_or_refused_with_the_reason() {
    let (agent, mut client, api) = node().await;
    let (uid1, share1) = nominate(&api, "p1", "c1", "2Gi");
    let p = Plugin::start_with_resync(&agent, &api, NODE, &[DRIVER], 1);

    wait_for("c1 admitted in the claim", WAIT, || {
        condition(&api, "c1", "Admitted").is_some_and(|c| c.0 == "True")
    });
    let s = get_share(&mut client, &share1).await;
    assert!(s.pre_bind, "held for a pod not bound yet: {s:?}");
    // A generic device counts the share; no pod is needed for that.
    assert_eq!(
        pb::Phase::try_from(s.phase),
        Ok(pb::Phase::Accounted),
        "{s:?}"
    );

    // 7Gi beside c1's 2Gi does not fit the 8Gi the node has.
    let (_, share2) = nominate(&api, "p2", "c2", "7Gi");

    let until = std::time::Instant::now() + WAIT;
    let refused = loop {
        if condition(&api, "c2", "AdmissionRefused").is_some_and(|c| c.0 == "True") {
            break true;
        }
        if std::time::Instant::now() > until {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        refused,
        "c2 not refused in the claim: {:?}; requests {:?}; plugin log:\n{}",
        api.get::<ResourceClaim>(NS, "c2").and_then(|c| c.status),
        api.requests(),
        std::fs::read_to_string(&p.log).unwrap_or_default()
    );
    let (_, reason, message) = condition(&api, "c2", "AdmissionRefused").unwrap();
    assert_eq!(reason, "ResourceExhausted", "{message}");
    assert!(message.contains("memory"), "{message}");
    assert_eq!(
        phase_of(&mut client, &share2).await,
        None,
        "a refused share holds nothing"
    );
    assert_eq!(condition(&api, "c2", "Admitted"), None);

    // The scheduler binds p1; kubelet prepares the claim, which is now kubelet's.
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid1).await;
    assert_eq!(r.error, "", "{r:?}");
    let s = get_share(&mut client, &share1).await;
    assert!(!s.pre_bind, "kubelet's Prepare takes the share over: {s:?}");
}

#[tokio::test]
async fn a_gate_share_whose_claim_went_is_released_and_one_kubelet_prepared_is_not() {
    let (agent, mut client, api) = node().await;
    let (_, share1) = nominate(&api, "p1", "c1", "1Gi");
    let (uid2, share2) = nominate(&api, "p2", "c2", "1Gi");

    let p = Plugin::start_with_resync(&agent, &api, NODE, &[DRIVER], 1);
    for c in ["c1", "c2"] {
        wait_for(&format!("{c} admitted"), WAIT, || {
            condition(&api, c, "Admitted").is_some_and(|c| c.0 == "True")
        });
    }
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c2", &uid2).await;
    assert_eq!(r.error, "", "{r:?}");

    // Both claims go (the binding timed out and the pods were deleted; or, for c2, a
    // node cut off while its pod runs): only the share no kubelet prepared is released.
    api.delete::<ResourceClaim>(NS, "c1");
    api.delete::<ResourceClaim>(NS, "c2");
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if phase_of(&mut client, &share1)
            .await
            .is_some_and(|(p, _)| p == pb::Phase::Released)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "share {share1} was not released"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The same sweep saw c2's share; another one runs within the second.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        phase_of(&mut client, &share2).await,
        Some((pb::Phase::Accounted, false)),
        "a share kubelet prepared stays until kubelet's Unprepare"
    );
    let log = std::fs::read_to_string(&p.log).unwrap_or_default();
    assert!(log.contains("the claim is gone"), "{log}");
}
