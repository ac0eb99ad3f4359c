//! The real kubelet plugin between a test "kubelet" (the kubelet API definitions, over
//! the plugin's sockets), the API STAND-IN (no kube-apiserver can be installed here) and
//! the real agent: registration, NodePrepareResources and NodeUnprepareResources in both
//! API versions, what is refused, epochs, and restarts of either process.

use shareguard_tests::{
    Agent, DRIVER, Options, POOL,
    apiserver::ApiServer,
    generic_device, get_share,
    k8s::{self, claim, pod, result},
    kubelet::{
        dra_v1 as v1, dra_v1beta1 as v1beta1, prepare_v1, unprepare_v1, v1_claim, v1beta1_claim,
    },
    plugin::Plugin,
    proto as pb, share_id,
};

const NODE: &str = "node-a";
const NS: &str = "team-a";
const OTHER_DRIVER: &str = "other.example.com";
const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// An agent with one generic device, `mem-0` (8Gi in steps of 1Gi), for `NS`.
pub(super) fn agent() -> Agent {
    Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )))
}

/// The stand-in with this node, and a pod of it reserved by the claims.
pub(super) fn api_with_pod() -> (ApiServer, String) {
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let uid = share_id();
    api.put(&pod(NS, "p1", &uid, NODE));
    (api, uid)
}

/// An allocated claim of one share of mem-0, reserved for pod p1.
pub(super) fn share_claim(
    api: &ApiServer,
    name: &str,
    pod_uid: &str,
    amount: &str,
) -> (String, String) {
    let uid = share_id();
    let share = share_id();
    api.put(&claim(
        NS,
        name,
        &uid,
        Some(vec![result(
            "mem",
            DRIVER,
            POOL,
            "mem-0",
            Some(&share),
            &[("memory", amount)],
        )]),
        &[("p1", pod_uid)],
    ));
    (uid, share)
}

#[tokio::test]
async fn registers_each_driver_and_removes_its_sockets_at_stop() {
    let devices = format!(
        "{}{}",
        generic_device("mem-0", "8Gi", "1Gi", &[NS], &[]),
        generic_device("mem-1", "8Gi", "1Gi", &[NS], &[]).replace(
            &format!("driver = \"{DRIVER}\""),
            &format!("driver = \"{OTHER_DRIVER}\"")
        )
    );
    let agent = Agent::start(Options::new(devices));
    let (api, _) = api_with_pod();
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER, OTHER_DRIVER]);
    for driver in [DRIVER, OTHER_DRIVER] {
        let info = p.kubelet.register(driver, Ok(())).await;
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, driver);
        assert_eq!(info.endpoint, p.endpoint(driver));
        assert_eq!(
            info.supported_versions,
            [
                "v1.DRAPlugin",
                "v1beta1.DRAPlugin",
                "v1.DRAResourceHealth",
                "v1alpha1.DRAResourceHealth"
            ]
        );
        assert!(std::path::Path::new(&info.endpoint).exists());
    }
    assert_eq!(
        p.log_text()
            .matches("kubelet registered the plugin")
            .count(),
        2,
        "{}",
        p.log_text()
    );
    let kubelet = p.kubelet.clone();
    let endpoints = [p.endpoint(DRIVER), p.endpoint(OTHER_DRIVER)];
    let status = p.terminate();
    assert!(status.success(), "{status}:\n{}", p.log_text());
    for driver in [DRIVER, OTHER_DRIVER] {
        assert!(!kubelet.registration_socket(driver).exists(), "{driver}");
    }
    for e in endpoints {
        assert!(!std::path::Path::new(&e).exists(), "{e}");
    }
}

#[tokio::test]
async fn a_stale_socket_is_replaced_at_start() {
    let agent = agent();
    let (api, _) = api_with_pod();
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    // Killed: both sockets stay behind, and nothing listens on them.
    p.kill9();
    let reg = p.kubelet.registration_socket(DRIVER);
    assert!(reg.exists());
    p.launch();
    p.wait_ready();
    assert!(
        p.log_text()
            .contains("replacing a socket left by an earlier instance")
    );
    let info = p.kubelet.register(DRIVER, Ok(())).await;
    assert_eq!(info.endpoint, p.endpoint(DRIVER));
}

#[tokio::test]
async fn a_refused_registration_stops_the_plugin_with_the_reason() {
    let agent = agent();
    let (api, _) = api_with_pod();
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    p.kubelet
        .register(DRIVER, Err("no supported version in [v9.DRAPlugin]"))
        .await;
    let status = p.wait_exit();
    let log = p.log_text();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("kubelet refused to register driver")
            && log.contains("no supported version in [v9.DRAPlugin]"),
        "{log}"
    );
    assert!(!p.kubelet.registration_socket(DRIVER).exists());
}

#[tokio::test]
async fn prepares_and_unprepares_through_v1() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    // A second pod the claim is reserved for: the scheduler reserves a claim of this
    // node's devices only for pods it binds here. Its uid goes to the agent as
    // reservedFor has it; no Pod is read (the plugin needs no `pods: get`).
    let second = share_id();
    let (uid, share) = share_claim(&api, "c1", &pod_uid, "2Gi");
    let mut c = api
        .get::<k8s_openapi::api::resource::v1::ResourceClaim>(NS, "c1")
        .unwrap();
    c.status
        .as_mut()
        .unwrap()
        .reserved_for
        .as_mut()
        .unwrap()
        .push(
            k8s_openapi::api::resource::v1::ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: "p2".into(),
                uid: second.clone(),
            },
        );
    api.put(&c);
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;

    let prepare = v1::NodePrepareResourcesRequest {
        claims: vec![v1_claim(NS, "c1", &uid)],
    };
    let r = kubelet
        .node_prepare_resources(prepare.clone())
        .await
        .unwrap()
        .into_inner();
    let entry = &r.claims[&uid];
    assert_eq!(entry.error, "", "{r:?}\n{}", p.log_text());
    assert_eq!(
        entry.devices,
        [v1::Device {
            request_names: vec!["mem".into()],
            pool_name: POOL.into(),
            device_name: "mem-0".into(),
            cdi_device_ids: vec![],
            share_id: Some(share.clone()),
        }]
    );
    assert!(
        api.requests().contains(&format!(
            "GET /apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/c1"
        )),
        "{:?}",
        api.requests()
    );
    let mut client = agent.client().await;
    let s = get_share(&mut client, share.clone()).await;
    assert_eq!(s.phase, pb::Phase::Accounted as i32, "{s:?}");
    assert_eq!(
        s.pod_uids,
        [pod_uid, second],
        "the pods of status.reservedFor"
    );
    // The binding gate's list and watch of the pods nominated to the node (field
    // selected, /api/v1/pods) are no read of the claim's pods, which would name them.
    assert!(
        !api.requests().iter().any(|r| r.contains("/pods/")),
        "no Pod read: {:?}",
        api.requests()
    );
    assert_eq!(
        s.claim,
        Some(pb::ClaimRef {
            uid: uid.clone(),
            namespace: NS.into(),
            name: "c1".into()
        })
    );
    assert!(s.allocation_id.starts_with("sha256-"), "{s:?}");
    assert!(s.policy_version.starts_with("policy-"), "{s:?}");

    // kubelet calls again (it does after its own restart): the same answer, nothing new.
    let again = kubelet
        .node_prepare_resources(prepare)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again, r);
    let s2 = get_share(&mut client, share.clone()).await;
    assert_eq!(s2.allocation_id, s.allocation_id);

    let u = kubelet
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![v1_claim(NS, "c1", &uid)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(u.claims[&uid].error, "", "{u:?}");
    let s = get_share(&mut client, share).await;
    assert_eq!(s.phase, pb::Phase::Released as i32, "{s:?}");
}

#[tokio::test]
async fn prepares_and_unprepares_through_v1beta1() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (uid, share) = share_claim(&api, "c1", &pod_uid, "3Gi");
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1beta1(&p.endpoint(DRIVER)).await;
    let r = kubelet
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![v1beta1_claim(NS, "c1", &uid)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.claims[&uid],
        v1beta1::NodePrepareResourceResponse {
            devices: vec![v1beta1::Device {
                request_names: vec!["mem".into()],
                pool_name: POOL.into(),
                device_name: "mem-0".into(),
                cdi_device_ids: vec![],
            }],
            error: String::new(),
        },
        "{}",
        p.log_text()
    );
    let mut client = agent.client().await;
    let s = get_share(&mut client, share.clone()).await;
    assert_eq!(s.phase, pb::Phase::Accounted as i32, "{s:?}");
    let u = kubelet
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![v1beta1_claim(NS, "c1", &uid)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(u.claims[&uid].error, "", "{u:?}");
    let s = get_share(&mut client, share).await;
    assert_eq!(s.phase, pb::Phase::Released as i32, "{s:?}");
}

#[tokio::test]
async fn every_claim_gets_an_answer_and_only_the_good_one_holds_capacity() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (good, good_share) = share_claim(&api, "good", &pod_uid, "1Gi");
    // Deleted and created anew under the same name: kubelet asks for the old uid.
    let (_, _) = share_claim(&api, "replaced", &pod_uid, "1Gi");
    let old_uid = share_id();
    // Not allocated (yet).
    let unallocated = share_id();
    api.put(&claim(
        NS,
        "unallocated",
        &unallocated,
        None,
        &[("p1", &pod_uid)],
    ));
    // Allocated on a device this node does not have.
    let foreign = share_id();
    api.put(&claim(
        NS,
        "foreign",
        &foreign,
        Some(vec![result(
            "mem",
            DRIVER,
            POOL,
            "mem-9",
            Some(&share_id()),
            &[("memory", "1Gi")],
        )]),
        &[("p1", &pod_uid)],
    ));
    // More than the device has: the agent refuses it.
    let (too_big, _) = share_claim(&api, "too-big", &pod_uid, "16Gi");
    // Not in the API at all.
    let missing = share_id();

    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![
                v1_claim(NS, "good", &good),
                v1_claim(NS, "replaced", &old_uid),
                v1_claim(NS, "unallocated", &unallocated),
                v1_claim(NS, "foreign", &foreign),
                v1_claim(NS, "too-big", &too_big),
                v1_claim(NS, "missing", &missing),
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims.len(), 6, "{r:?}");
    assert_eq!(r.claims[&good].error, "", "{r:?}");
    let expect = [
        (&old_uid, "deleted and created anew"),
        (&unallocated, "it has no allocation"),
        (&foreign, "device node-a/mem-9 is not one of this node's"),
        (&too_big, "the node agent refused the claim"),
        (&missing, "ResourceClaim team-a/missing"),
    ];
    for (uid, text) in expect {
        let e = &r.claims[uid];
        assert!(
            e.error.contains(text),
            "{uid}: {:?} lacks {text:?}",
            e.error
        );
        assert!(e.devices.is_empty());
    }
    let shares = agent
        .client()
        .await
        .list_shares(pb::ListSharesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .shares;
    let live: Vec<&str> = shares
        .iter()
        .filter(|s| s.phase != pb::Phase::Failed as i32 && s.phase != pb::Phase::Released as i32)
        .map(|s| s.share_id.as_str())
        .collect();
    assert_eq!(live, [good_share.as_str()], "{shares:?}");
}

/// A fenced instance that no newer instance serves beside (the new one runs elsewhere,
/// or someone other than a plugin took the epoch) would fail every kubelet call from
/// then on: it exits with the reason instead, so that a new instance takes over.
#[tokio::test]
async fn a_fenced_instance_with_no_successor_exits_with_the_reason() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c2, _) = share_claim(&api, "c2", &pod_uid, "1Gi");
    let mut old = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    // The new instance takes its epoch at start, in a directory of its own.
    let mut new = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let status = old.wait_exit();
    assert!(!status.success(), "{status:?}");
    assert!(
        old.log_text()
            .contains("exiting so that a new instance takes a new epoch"),
        "{}",
        old.log_text()
    );
    let mut new_kubelet = new.kubelet.v1(&new.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut new_kubelet, NS, "c2", &c2).await;
    assert_eq!(r.error, "", "{r:?}");

    // An epoch taken by something other than a plugin instance fences it the same way.
    agent
        .client()
        .await
        .new_epoch(pb::NewEpochRequest {})
        .await
        .unwrap();
    let status = new.wait_exit();
    assert!(!status.success(), "{status:?}");
    assert!(new.log_text().contains("fenced"), "{}", new.log_text());
    // Its restart takes a new epoch and serves again.
    new.launch();
    new.wait_ready();
    let mut new_kubelet = new.kubelet.v1(&new.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut new_kubelet, NS, "c2", &c2).await;
    assert_eq!(r.error, "", "a repeated Prepare after the restart: {r:?}");
}

/// Two releases on one node: a plugin started for another driver (`--driver`, the
/// chart's driverName) finds this release's agent on the socket and exits naming both,
/// before it takes the epoch or makes a socket; the plugin of the agent's own release
/// (started with `--driver` too) keeps serving, unfenced.
#[tokio::test]
async fn a_plugin_for_another_driver_refuses_the_agent_and_fences_nobody() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c2, _) = share_claim(&api, "c2", &pod_uid, "1Gi");
    let mut own = Plugin::new(&agent, &api, NODE, &[DRIVER]);
    own.extra_args = vec!["--driver".into(), DRIVER.into()];
    own.launch();
    own.wait_ready();

    let mut other = Plugin::new(&agent, &api, NODE, &[OTHER_DRIVER]);
    other.extra_args = vec!["--driver".into(), OTHER_DRIVER.into()];
    other.launch();
    let status = other.wait_exit();
    let log = other.log_text();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains(&format!("serves driver(s) [\"{DRIVER}\"]"))
            && log.contains(&format!("this plugin is for [\"{OTHER_DRIVER}\"]"))
            && log.contains("another release"),
        "{log}"
    );
    for d in [DRIVER, OTHER_DRIVER] {
        assert!(!other.kubelet.registration_socket(d).exists(), "{d}");
        assert!(!std::path::Path::new(&other.endpoint(d)).exists(), "{d}");
    }
    // The own release's plugin still holds the epoch: kubelet's Prepare through it works.
    let mut kubelet = own.kubelet.v1(&own.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c2", &c2).await;
    assert_eq!(r.error, "", "{r:?}\n{}", own.log_text());
    assert!(
        !own.log_text()
            .lines()
            .any(|l| l.contains("fenced") && !l.contains("took a new epoch")),
        "{}",
        own.log_text()
    );
}

/// A rolling update: the new instance serves beside the old one on sockets of its own,
/// and once it has taken the epoch the old one passes kubelet's calls on to it instead
/// of refusing them (kubelet keeps calling the old one until it has registered the new
/// one). Readiness follows: the new one is ready once kubelet registered it, the old one
/// not any more. The old one's stop removes its own sockets only.
#[tokio::test]
async fn a_replaced_instance_passes_kubelets_calls_on_to_its_successor() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c1, s1) = share_claim(&api, "c1", &pod_uid, "1Gi");
    let (c2, s2) = share_claim(&api, "c2", &pod_uid, "1Gi");
    let mut old = Plugin::start_instance(&agent, &api, NODE, &[DRIVER], "old-0");
    old.kubelet
        .register_at(&old.registration_socket(DRIVER), Ok(()))
        .await;
    assert_eq!(old.readyz().0, 200, "{:?}", old.readyz());
    let mut old_kubelet = old.kubelet.v1(&old.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut old_kubelet, NS, "c1", &c1).await;
    assert_eq!(r.error, "", "{r:?}");

    let new = Plugin::start_beside(&old, &agent, &api, "new-1");
    assert_ne!(new.endpoint(DRIVER), old.endpoint(DRIVER));
    let (code, body) = new.readyz();
    assert_eq!(code, 503, "ready before kubelet registered it: {body}");
    assert!(body.contains("waiting for kubelet"), "{body}");
    // kubelet has not switched yet: the old instance gets the call, and it succeeds.
    let r = prepare_v1(&mut old_kubelet, NS, "c2", &c2).await;
    assert_eq!(r.error, "", "{r:?}\n{}", old.log_text());
    assert_eq!(r.devices[0].share_id.as_deref(), Some(s2.as_str()));
    assert!(
        old.log_text()
            .contains("passed kubelet's NodePrepareResources on"),
        "{}",
        old.log_text()
    );
    let (code, body) = old.readyz();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("fenced"), "{body}");
    new.kubelet
        .register_at(&new.registration_socket(DRIVER), Ok(()))
        .await;
    assert_eq!(new.readyz().0, 200, "{:?}", new.readyz());

    // Unprepare goes the same way.
    let r = unprepare_v1(&mut old_kubelet, NS, "c1", &c1).await;
    assert_eq!(r.error, "", "{r:?}");
    let mut client = agent.client().await;
    assert_eq!(
        get_share(&mut client, s1).await.phase,
        pb::Phase::Released as i32
    );
    assert_eq!(
        get_share(&mut client, s2).await.phase,
        pb::Phase::Accounted as i32
    );

    // The old one stops (SIGTERM, as the DaemonSet controller stops it): its sockets
    // go, the new one's stay.
    assert!(old.terminate().success(), "{}", old.log_text());
    assert!(!old.registration_socket(DRIVER).exists());
    assert!(!std::path::Path::new(&old.endpoint(DRIVER)).exists());
    assert!(new.registration_socket(DRIVER).exists());
    assert!(std::path::Path::new(&new.endpoint(DRIVER)).exists());
    assert_eq!(new.readyz().0, 200);
}

/// A call already passed on once is answered, never passed on again: two fenced
/// instances cannot send it back and forth.
#[tokio::test]
async fn a_call_is_passed_on_at_most_once() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c1, _) = share_claim(&api, "c1", &pod_uid, "1Gi");
    let a = Plugin::start_instance(&agent, &api, NODE, &[DRIVER], "a-0");
    let b = Plugin::start_beside(&a, &agent, &api, "b-1");
    // A third instance takes the epoch in a directory of its own: a and b are both
    // fenced and know only each other.
    let _c = Plugin::start_instance(&agent, &api, NODE, &[DRIVER], "c-2");
    let mut a_kubelet = a.kubelet.v1(&a.endpoint(DRIVER)).await;
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        prepare_v1(&mut a_kubelet, NS, "c1", &c1),
    )
    .await
    .expect("the call came back");
    assert!(
        r.error.contains("was replaced by a newer one"),
        "{r:?}\n{}\n{}",
        a.log_text(),
        b.log_text()
    );
}

#[tokio::test]
async fn the_plugin_outlives_an_agent_restart() {
    let mut agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c1, s1) = share_claim(&api, "c1", &pod_uid, "1Gi");
    let (c2, s2) = share_claim(&api, "c2", &pod_uid, "1Gi");
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(NS, "c1", &c1)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims[&c1].error, "", "{r:?}");
    agent.restart();
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(NS, "c2", &c2)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims[&c2].error, "", "{r:?}\n{}", p.log_text());
    let mut client = agent.client().await;
    for s in [s1, s2] {
        assert_eq!(
            get_share(&mut client, s).await.phase,
            pb::Phase::Accounted as i32
        );
    }
}

/// The agent's own pod is replaced (an update of its DaemonSet): a call kubelet makes
/// meanwhile waits for the new agent instead of failing.
#[tokio::test]
async fn a_call_waits_for_an_agent_that_is_being_replaced() {
    let mut agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c1, s1) = share_claim(&api, "c1", &pod_uid, "1Gi");
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    agent.kill9();
    let (kubelet, endpoint) = (p.kubelet.clone(), p.endpoint(DRIVER));
    let call = tokio::spawn(async move {
        kubelet
            .v1(&endpoint)
            .await
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(NS, "c1", &c1)],
            })
            .await
            .map(|r| (c1, r.into_inner()))
    });
    // The call is waiting, not failed, while no agent answers.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !p
        .log_text()
        .contains("the node agent is unavailable; waiting for it")
    {
        assert!(
            !call.is_finished(),
            "the call ended with no agent:\n{}",
            p.log_text()
        );
        assert!(std::time::Instant::now() < deadline, "{}", p.log_text());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(!call.is_finished());
    agent.start_again();
    let (c1, r) = call.await.unwrap().unwrap();
    assert_eq!(r.claims[&c1].error, "", "{r:?}\n{}", p.log_text());
    assert_eq!(
        get_share(&mut agent.client().await, s1).await.phase,
        pb::Phase::Accounted as i32
    );
}

#[tokio::test]
async fn a_restarted_plugin_registers_again_and_doubles_nothing() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (c1, s1) = share_claim(&api, "c1", &pod_uid, "2Gi");
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    p.kubelet.register(DRIVER, Ok(())).await;
    let prepare = v1::NodePrepareResourcesRequest {
        claims: vec![v1_claim(NS, "c1", &c1)],
    };
    let first = p
        .kubelet
        .v1(&p.endpoint(DRIVER))
        .await
        .node_prepare_resources(prepare.clone())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.claims[&c1].error, "", "{first:?}");
    p.restart();
    let info = p.kubelet.register(DRIVER, Ok(())).await;
    assert_eq!(info.endpoint, p.endpoint(DRIVER));
    // kubelet prepares the claim again after the plugin came back.
    let again = p
        .kubelet
        .v1(&p.endpoint(DRIVER))
        .await
        .node_prepare_resources(prepare)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again, first, "{}", p.log_text());
    let devices = agent
        .client()
        .await
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner()
        .devices;
    let mem = devices.iter().find(|d| d.name == "mem-0").unwrap();
    assert_eq!(mem.live_shares, 1, "{mem:?}");
    assert_eq!(mem.allocated["memory"], "2Gi", "{mem:?}");
    assert_eq!(
        get_share(&mut agent.client().await, s1).await.phase,
        pb::Phase::Accounted as i32
    );
}

/// A `firstAvailable` request's allocation result names the subrequest the scheduler
/// took (`mem/small`); kubelet matches the request names it gets exactly against the
/// containers' `resources.claims[].request`, which name the parent (`mem`), so that is
/// what it gets. The agent keeps the full name, which says which alternative it was.
#[tokio::test]
async fn a_subrequest_is_answered_with_its_parent_request() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (uid, share) = (share_id(), share_id());
    api.put(&claim(
        NS,
        "c1",
        &uid,
        Some(vec![result(
            "mem/small",
            DRIVER,
            POOL,
            "mem-0",
            Some(&share),
            &[("memory", "1Gi")],
        )]),
        &[("p1", &pod_uid)],
    ));
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(NS, "c1", &uid)],
        })
        .await
        .unwrap()
        .into_inner();
    let entry = &r.claims[&uid];
    assert_eq!(entry.error, "", "{r:?}\n{}", p.log_text());
    assert_eq!(entry.devices.len(), 1, "{r:?}");
    assert_eq!(entry.devices[0].request_names, ["mem"]);
    assert_eq!(entry.devices[0].share_id.as_deref(), Some(share.as_str()));
    let s = get_share(&mut agent.client().await, share).await;
    assert_eq!(s.request, "mem/small", "{s:?}");
}

/// The Events of the API stand-in, as (kind of the object, its name, type, reason,
/// series count, note), oldest first.
fn events(api: &ApiServer) -> Vec<(String, String, String, String, i32, String)> {
    let mut all: Vec<k8s_openapi::api::events::v1::Event> = api.list();
    all.sort_by_key(|e| e.event_time.clone().map(|t| t.0));
    all.into_iter()
        .map(|e| {
            let r = e.regarding.unwrap_or_default();
            (
                r.kind.unwrap_or_default(),
                r.name.unwrap_or_default(),
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.series.map_or(1, |s| s.count),
                e.note.unwrap_or_default(),
            )
        })
        .collect()
}

/// Waits (10 s at most) until `cond` holds of the stand-in's Events.
fn wait_events(
    api: &ApiServer,
    what: &str,
    cond: impl Fn(&[(String, String, String, String, i32, String)]) -> bool,
) -> Vec<(String, String, String, String, i32, String)> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let e = events(api);
        if cond(&e) {
            return e;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within 10 s; events: {e:#?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A claim the node refuses gets a Warning Event on itself and on its pod, naming the
/// reason; kubelet's retry counts in that Event's series instead of writing another.
#[tokio::test]
async fn a_refused_claim_gets_an_event_on_itself_and_its_pod() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (too_big, _) = share_claim(&api, "too-big", &pod_uid, "16Gi");
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let mut prepare = async || {
        let r = kubelet
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: vec![v1_claim(NS, "too-big", &too_big)],
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.claims[&too_big].error.contains("refused"), "{r:?}");
    };
    prepare().await;
    let first = wait_events(&api, "an event on the claim and the pod", |e| e.len() == 2);
    let on: Vec<(&str, &str)> = first.iter().map(|e| (e.0.as_str(), e.1.as_str())).collect();
    assert!(on.contains(&("ResourceClaim", "too-big")), "{first:#?}");
    assert!(on.contains(&("Pod", "p1")), "{first:#?}");
    for e in &first {
        assert_eq!(
            (e.2.as_str(), e.3.as_str()),
            ("Warning", "AllocationInvalid"),
            "{e:?}"
        );
        assert!(
            e.5.contains(&format!("{DRIVER} on node {NODE} refused the claim"))
                && e.5.contains("16Gi is above the maximum 8Gi"),
            "{e:?}"
        );
    }

    // kubelet calls again: the same two Events, each counted twice.
    prepare().await;
    let again = wait_events(&api, "the repeat counted in the series", |e| {
        e.iter().all(|e| e.4 == 2)
    });
    assert_eq!(again.len(), 2, "{again:#?}");
    // A claim that was prepared draws no Event.
    let (fits, _) = share_claim(&api, "fits", &pod_uid, "1Gi");
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(NS, "fits", &fits)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims[&fits].error, "", "{r:?}");
    assert!(
        api.requests()
            .iter()
            .filter(|r| r.starts_with("POST") && r.contains("/events"))
            .count()
            == 2,
        "{:?}",
        api.requests()
    );
}

/// A share that waited for its pod's sandbox gets a Normal Event on its pod (not on the
/// claim, whose status says it) once it is enforced, saying what was read back. And the
/// claim's whole life here (Prepare, the sandbox, ENFORCED, the sandbox gone, Unprepare)
/// costs the API server one GET of the claim, three status applies (waiting, enforced,
/// released) and that Event: the moves between (PREPARING, a message alone, PENDING as
/// the sandbox goes) go with the write that follows them. Root only (the pod's cgroup).
#[tokio::test]
async fn a_share_enforced_after_waiting_gets_an_event() {
    if !shareguard_tests::net::privileged("a_share_enforced_after_waiting_gets_an_event") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut o = Options::new(shareguard_tests::simulated_gpu_device(
        r#"{ period = "100ms", action = "report" }"#,
    ));
    o.agent_extra = format!("cdi_dir = {:?}", dir.path().join("cdi"));
    let agent = Agent::start(o);
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let pod_uid = shareguard_tests::pod::pod_uid();
    api.put(&pod(NS, "p1", &pod_uid, NODE));
    let uid = share_id();
    api.put(&claim(
        NS,
        "gpu",
        &uid,
        Some(vec![result(
            "gpu",
            DRIVER,
            POOL,
            "gpu-0",
            Some(&share_id()),
            &[("memory", "2Gi")],
        )]),
        &[("p1", &pod_uid)],
    ));
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![v1_claim(NS, "gpu", &uid)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.claims[&uid].error, "", "{r:?}");
    // No sandbox yet: the share waits, and nothing is told.
    let s = &agent
        .client()
        .await
        .list_shares(pb::ListSharesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .shares[0];
    assert_eq!(s.phase, pb::Phase::Pending as i32, "{s:?}");
    let share = s.share_id.clone();
    assert!(events(&api).is_empty(), "{:#?}", events(&api));

    let status_path = format!("/namespaces/{NS}/resourceclaims/gpu/status");
    let applies = || {
        api.applies()
            .iter()
            .filter(|a| a.path.ends_with(&status_path))
            .count()
    };
    let entry = |enforced: &str| {
        api.get::<k8s_openapi::api::resource::v1::ResourceClaim>(NS, "gpu")
            .and_then(|c| c.status?.devices)
            .unwrap_or_default()
            .iter()
            .any(|d| {
                d.conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Enforced" && c.status == enforced)
            })
    };
    shareguard_tests::net::wait_for("the claim says the share waits", WAIT, || entry("False"));

    let sandbox = shareguard_tests::pod::Sandbox::start(
        &pod_uid,
        shareguard_tests::pod::Layout::Cgroupfs,
        None,
    );
    let e = wait_events(&api, "ShareEnforced on the pod", |e| !e.is_empty());
    for e in &e {
        assert_eq!(
            (e.2.as_str(), e.3.as_str()),
            ("Normal", "ShareEnforced"),
            "{e:?}"
        );
        assert!(
            e.5.contains("memory 2Gi enforced and read back")
                && e.5.contains("after waiting for the pod's sandbox"),
            "{e:?}"
        );
    }
    // On the pod alone: the claim's own status says it, with the time it turned.
    let kinds: Vec<&str> = e.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(kinds, ["Pod"]);
    // The Event's pod is the one kubelet's Prepare read in the claim: one GET of the
    // claim in all, not a second one to find its pods.
    let claim_path = format!("GET /apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/gpu");
    let reads: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| *r == claim_path)
        .collect();
    assert_eq!(reads.len(), 1, "{:#?}", api.requests());

    // The pod goes: its sandbox first, then kubelet's Unprepare. It ran for longer than
    // the writer's spacing of writes to one claim (1 s), as pods do, so that spacing
    // alone does not merge the sandbox's going with the release.
    shareguard_tests::net::wait_for("the claim says the share is enforced", WAIT, || {
        entry("True")
    });
    std::thread::sleep(std::time::Duration::from_millis(1500));
    drop(sandbox);
    shareguard_tests::wait_phase(&mut agent.client().await, &share, pb::Phase::Pending).await;
    let u = unprepare_v1(&mut kubelet, NS, "gpu", &uid).await;
    assert_eq!(u.error, "", "{u:?}");
    shareguard_tests::net::wait_for("the release written", WAIT, || {
        !entry("True") && !entry("False")
    });
    let about_claim: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.contains("/resourceclaims/gpu") || r.contains("/events"))
        .collect();
    assert_eq!(
        applies(),
        3,
        "waiting, enforced, released: {about_claim:#?}\n{}",
        p.log_text()
    );
    assert_eq!(about_claim.len(), 5, "{about_claim:#?}");
}

/// A claim made for its pod (a Pod its controlling owner, as the resource claim
/// controller makes one from a template) costs no apply for its release: the controller
/// deallocates it once the pod is done, and the API server then drops its status
/// entries itself. A claim made by hand may stay allocated for another pod: its release
/// is written. Both in one plugin, so that the written release of the one shows the
/// writer had the other's release in hand too.
#[tokio::test]
async fn the_release_of_a_claim_made_for_its_pod_is_left_to_its_deallocation() {
    let agent = agent();
    let (api, pod_uid) = api_with_pod();
    let (by_hand, _) = share_claim(&api, "by-hand", &pod_uid, "1Gi");
    let (for_pod, _) = share_claim(&api, "for-pod", &pod_uid, "1Gi");
    let mut c = api
        .get::<k8s_openapi::api::resource::v1::ResourceClaim>(NS, "for-pod")
        .unwrap();
    c.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "Pod".into(),
            name: "p1".into(),
            uid: pod_uid.clone(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        },
    ]);
    api.put(&c);
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let claims = || {
        vec![
            v1_claim(NS, "by-hand", &by_hand),
            v1_claim(NS, "for-pod", &for_pod),
        ]
    };
    let r = kubelet
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: claims() })
        .await
        .unwrap()
        .into_inner();
    for uid in [&by_hand, &for_pod] {
        assert_eq!(r.claims[uid].error, "", "{r:?}\n{}", p.log_text());
    }
    let entries = |name: &str| {
        api.get::<k8s_openapi::api::resource::v1::ResourceClaim>(NS, name)
            .and_then(|c| c.status?.devices)
            .map_or(0, |d| d.len())
    };
    shareguard_tests::net::wait_for("both claims' status written", WAIT, || {
        entries("by-hand") == 1 && entries("for-pod") == 1
    });
    let applies = |name: &str| {
        let path = format!("/namespaces/{NS}/resourceclaims/{name}/status");
        api.applies()
            .iter()
            .filter(|a| a.path.ends_with(&path))
            .count()
    };
    assert_eq!((applies("by-hand"), applies("for-pod")), (1, 1));

    let u = kubelet
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims: claims() })
        .await
        .unwrap()
        .into_inner();
    for uid in [&by_hand, &for_pod] {
        assert_eq!(u.claims[uid].error, "", "{u:?}");
    }
    const LEFT: &str = "the release is not written: the claim was made for its pod alone";
    shareguard_tests::net::wait_for("the releases handled", WAIT, || {
        entries("by-hand") == 0
            && p.log_text()
                .lines()
                .any(|l| l.contains(LEFT) && l.contains("for-pod"))
    });
    assert_eq!(
        (applies("by-hand"), applies("for-pod")),
        (2, 1),
        "the release written to the claim made by hand alone:\n{}",
        p.log_text()
    );
    assert_eq!(entries("for-pod"), 1, "left for the deallocation to remove");
    assert!(
        !p.log_text()
            .lines()
            .any(|l| l.contains(LEFT) && l.contains("by-hand")),
        "{}",
        p.log_text()
    );
}
