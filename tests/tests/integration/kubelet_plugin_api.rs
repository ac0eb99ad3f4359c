//! What the real kubelet plugin writes to the API STAND-IN (no kube-apiserver can be
//! installed here): the agent's inventory as ResourceSlices, kept there, and each
//! share's status in its ResourceClaim, from Prepare to Unprepare; then the whole path
//! on a real pod network: kubelet's calls, the pod's sandbox appearing, traffic limited,
//! and the claim saying so.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::time::Duration;

use k8s_openapi::api::resource::v1::{
    AllocatedDeviceStatus, ResourceClaim, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;
use shareguard_tests::{
    Agent, DRIVER, Options, POOL,
    apiserver::ApiServer,
    generic_device, get_share,
    k8s::{self, claim, pod, result},
    kubelet::{prepare_v1, unprepare_v1},
    net::{self, Direction, Iperf, PinDir, Pod, TrafficLock, wait_for},
    plugin::Plugin,
    pod::{Layout, pod_uid},
    proto as pb, share_id, wait_phase,
};

const NODE: &str = "node-a";
const NS: &str = "team-a";
const WAIT: Duration = Duration::from_secs(20);

fn slices(api: &ApiServer) -> Vec<ResourceSlice> {
    api.list::<ResourceSlice>()
}

fn ours(api: &ApiServer) -> Vec<ResourceSlice> {
    slices(api)
        .into_iter()
        .filter(|s| s.spec.driver == DRIVER && s.spec.node_name.as_deref() == Some(NODE))
        .collect()
}

/// Our driver's entries of the claim's status.devices.
fn entries(api: &ApiServer, name: &str) -> Vec<AllocatedDeviceStatus> {
    api.get::<ResourceClaim>(NS, name)
        .and_then(|c| c.status)
        .and_then(|s| s.devices)
        .unwrap_or_default()
}

/// Whether claim `name`'s status.devices has an entry for `share`.
fn shows(api: &ApiServer, name: &str, share: &str) -> bool {
    entries(api, name)
        .iter()
        .any(|e| e.share_id.as_deref() == Some(share))
}

fn data(e: &AllocatedDeviceStatus) -> Value {
    e.data.as_ref().map(|d| d.0.clone()).unwrap_or(Value::Null)
}

#[tokio::test]
async fn publishes_the_inventory_as_resource_slices_and_keeps_them_there() {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    let node = k8s::node(NODE);
    api.put_cluster(&node);
    // Another node's slice of the same driver; a pool this node no longer has, in the
    // first of the node's slice names; and this node's pool under the name an older
    // plugin gave it (one per pool, unbounded).
    let foreign = |name: &str, node: &str, pool: &str, generation: i64| ResourceSlice {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(share_id()),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: k8s_openapi::api::resource::v1::ResourcePool {
                name: pool.into(),
                generation,
                resource_slice_count: 1,
            },
            ..Default::default()
        },
    };
    api.put_cluster(&foreign("other-node-slice", "node-b", "node-b", 7));
    let stale = format!("{NODE}-{DRIVER}-0");
    api.put_cluster(&foreign(&stale, NODE, "gone-pool", 7));
    let old_name = format!("{NODE}-{DRIVER}-{POOL}");
    api.put_cluster(&foreign(&old_name, NODE, POOL, 3));

    // An hour between inventory reads and full passes: within the test, only the watch
    // of the slices can notice a change on the API server.
    let mut p = Plugin::start_with_resync(&agent, &api, NODE, &[DRIVER], 3600);
    wait_for("our slice published, the stale ones deleted", WAIT, || {
        let o = ours(&api);
        o.len() == 1 && o[0].spec.pool.name == POOL
    });
    let s = ours(&api).remove(0);
    assert_eq!(
        s.metadata.name.as_deref(),
        Some(format!("{NODE}-{DRIVER}-1").as_str()),
        "the lowest name no slice held when the pass began (the gone pool's is free only once deleted)"
    );
    assert_eq!(
        s.spec.pool.generation, 4,
        "a generation above the pool's slice under its old name, so the scheduler takes the new one"
    );
    assert_eq!(s.spec.pool.resource_slice_count, 1);
    let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), &owner.uid),
        ("Node", NODE, node.metadata.uid.as_ref().unwrap())
    );
    let devices = s.spec.devices.as_ref().unwrap();
    assert_eq!(devices.len(), 1);
    let d = &devices[0];
    assert_eq!(d.name, "mem-0");
    assert_eq!(d.allow_multiple_allocations, Some(true));
    let cap = &d.capacity.as_ref().unwrap()["memory"];
    assert_eq!(cap.value.0, "8Gi");
    let policy = cap.request_policy.as_ref().unwrap();
    assert_eq!(policy.default.as_ref().unwrap().0, "1Gi");
    let range = policy.valid_range.as_ref().unwrap();
    assert_eq!(
        (
            range.min.0.as_str(),
            range.max.as_ref().unwrap().0.as_str(),
            range.step.as_ref().unwrap().0.as_str()
        ),
        ("1Gi", "8Gi", "1Gi")
    );
    let attrs = d.attributes.as_ref().unwrap();
    assert_eq!(attrs["kind"].string.as_deref(), Some("generic"));
    assert_eq!(
        attrs["mechanism"].string.as_deref(),
        Some("accounting-only")
    );
    assert_eq!(
        attrs["enforced"].bool,
        Some(false),
        "accounting enforces nothing"
    );
    assert_eq!(attrs["stage"].string.as_deref(), Some("enforce"));
    assert!(
        slices(&api)
            .iter()
            .any(|s| s.metadata.name.as_deref() == Some("other-node-slice")),
        "another node's slice is not ours to delete"
    );
    let applies = api.applies();
    assert!(
        applies
            .iter()
            .all(|a| a.manager == DRIVER && a.content_type.starts_with("application/apply-patch")),
        "server-side apply with the driver as field manager: {applies:?}"
    );

    // Someone deletes it: the watch reports it, and it is back.
    let name = s.metadata.name.clone().unwrap();
    api.delete_cluster::<ResourceSlice>(&name);
    wait_for("the deleted slice published again", WAIT, || {
        ours(&api).len() == 1
    });

    // A restarted plugin finds its slices as they should be and writes nothing.
    p.kill9();
    let before = api.applies().len();
    let lists_before = slice_lists(&api);
    p.restart();
    wait_for("the restarted plugin's first pass", WAIT, || {
        p.log_text().contains("ResourceSlices up to date")
    });
    assert!(
        p.log_text().contains("applied=0 deleted=0"),
        "{}",
        p.log_text()
    );
    assert_eq!(
        api.applies().len(),
        before,
        "nothing changed, nothing applied"
    );
    assert_eq!(ours(&api).len(), 1);

    // Deleted again: the pass that puts it back lists the slices itself (the watch's
    // list is no longer current), and its own apply's echo starts no pass. So the
    // restarted plugin listed its slices twice in all: its watch's start, whose list
    // its first pass worked from, and this pass.
    let name = ours(&api)[0].metadata.name.clone().unwrap();
    api.delete_cluster::<ResourceSlice>(&name);
    wait_for("the deleted slice published again", WAIT, || {
        ours(&api).len() == 1
    });
    assert_eq!(slice_lists(&api) - lists_before, 2, "{:#?}", api.requests());
}

/// LISTs of ResourceSlices the stand-in has served (watches are counted apart).
fn slice_lists(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| r.as_str() == "GET /apis/resource.k8s.io/v1/resourceslices")
        .count()
}

#[tokio::test]
async fn a_claims_status_shows_its_share_until_unprepare() {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let pod_uid = share_id();
    api.put(&pod(NS, "p1", &pod_uid, NODE));
    let (uid, share) = (share_id(), share_id());
    let mut c = claim(
        NS,
        "c1",
        &uid,
        Some(vec![result(
            "mem",
            DRIVER,
            POOL,
            "mem-0",
            Some(&share),
            &[("memory", "2Gi")],
        )]),
        &[("p1", &pod_uid)],
    );
    // Another driver's entry, which this plugin must leave alone.
    let other = AllocatedDeviceStatus {
        driver: "other.example.com".into(),
        pool: "x".into(),
        device: "y".into(),
        ..Default::default()
    };
    c.status.as_mut().unwrap().devices = Some(vec![other.clone()]);
    api.put(&c);

    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid).await;
    assert_eq!(r.error, "", "{r:?}");

    wait_for("the share's status in the claim", WAIT, || {
        shows(&api, "c1", &share)
    });
    let all = entries(&api, "c1");
    assert!(all.contains(&other), "{all:?}");
    let e = all.iter().find(|e| e.driver == DRIVER).unwrap();
    assert_eq!((e.pool.as_str(), e.device.as_str()), (POOL, "mem-0"));
    let cond = &e.conditions.as_ref().unwrap()[0];
    assert_eq!(
        (
            cond.type_.as_str(),
            cond.status.as_str(),
            cond.reason.as_str()
        ),
        ("Enforced", "False", "AccountingOnly"),
        "a generic device is counted, not enforced: {e:?}"
    );
    assert_eq!(data(e)["requested"]["memory"], "2Gi");
    assert!(
        api.applies()
            .iter()
            .any(|a| a.path.ends_with("/resourceclaims/c1/status") && a.manager == DRIVER),
        "{:?}",
        api.applies()
    );

    let u = unprepare_v1(&mut kubelet, NS, "c1", &uid).await;
    assert_eq!(u.error, "", "{u:?}");
    wait_for("our entry gone from the claim", WAIT, || {
        entries(&api, "c1").iter().all(|e| e.driver != DRIVER)
    });
    assert_eq!(
        entries(&api, "c1"),
        [other],
        "the other driver's entry stays"
    );
}

/// A restart of the plugin (a rolling update, a crash) writes no claim status the
/// instance before it already wrote: it reads what that one recorded beside its socket
/// (`<plugins-dir>/<driver>/claim-status.json`). Without the record, every live claim is
/// applied again.
#[tokio::test]
async fn a_restarted_plugin_writes_no_claim_status_it_wrote_before() {
    let agent = super::kubelet_plugin::agent();
    let (api, pod_uid) = super::kubelet_plugin::api_with_pod();
    let uids: Vec<String> = ["c1", "c2"]
        .iter()
        .map(|name| super::kubelet_plugin::share_claim(&api, name, &pod_uid, "1Gi").0)
        .collect();
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    for (name, uid) in ["c1", "c2"].iter().zip(&uids) {
        let r = prepare_v1(&mut kubelet, NS, name, uid).await;
        assert_eq!(r.error, "", "{r:?}");
    }
    let record = p.kubelet.plugins_dir.join(DRIVER).join("claim-status.json");
    let recorded = |uid: &str| {
        std::fs::read(&record)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .is_some_and(|v| v["claims"].get(uid).is_some())
    };
    wait_for("both claims' status written and recorded", WAIT, || {
        ["c1", "c2"].iter().all(|n| !entries(&api, n).is_empty())
            && uids.iter().all(|u| recorded(u))
    });
    let status_applies = |name: &str| {
        let path = format!("/namespaces/{NS}/resourceclaims/{name}/status");
        api.applies()
            .iter()
            .filter(|a| a.path.ends_with(&path))
            .count()
    };
    let (c1_before, c2_before) = (status_applies("c1"), status_applies("c2"));

    // A crash and a start: the new instance sees both claims in the agent's snapshot.
    p.restart();
    // c2 released after the start: its write (the entry removed) is the only one. The
    // writer writes due claims in one pass and records after it, so once c2 is off the
    // record, a write of c1 at the start would have come before.
    let u = unprepare_v1(
        &mut p.kubelet.v1(&p.endpoint(DRIVER)).await,
        NS,
        "c2",
        &uids[1],
    )
    .await;
    assert_eq!(u.error, "", "{u:?}");
    wait_for("c2's release written and recorded", WAIT, || {
        entries(&api, "c2").is_empty() && !recorded(&uids[1])
    });
    assert_eq!(
        status_applies("c2"),
        c2_before + 1,
        "c2: only its release: {}",
        p.log_text()
    );
    assert_eq!(
        status_applies("c1"),
        c1_before,
        "c1's status is what the instance before wrote: not applied again: {}",
        p.log_text()
    );
    assert!(recorded(&uids[0]), "c1 stays on the record");

    // Without the record, a start applies every live claim again.
    p.kill9();
    std::fs::remove_file(&record).unwrap();
    p.restart();
    wait_for("c1 applied again by a start with no record", WAIT, || {
        status_applies("c1") == c1_before + 1
    });
}

/// The whole path on a real pod network (root; skips without it unless `CI=true`):
/// kubelet prepares before the sandbox exists, the sandbox appears, the share is
/// ENFORCED and the claim says so with the amount read back, traffic stays in the band,
/// and Unprepare lifts the limit and takes the entry out of the claim.
#[tokio::test]
async fn a_pod_gets_its_bandwidth_and_its_claim_says_so() {
    if !net::privileged("a_pod_gets_its_bandwidth_and_its_claim_says_so") {
        return;
    }
    let pins = PinDir::new();
    let lines = format!(
        "mechanism = \"htb-ebpf\"\n{}",
        net::bandwidth_capacity("10G")
    );
    let agent = net::start_agent(net::net_device("nic-0", &lines), &pins, "");
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let pod_uid = pod_uid();
    api.put(&pod(NS, "iperf", &pod_uid, NODE));
    let (uid, share) = (share_id(), share_id());
    api.put(&claim(
        NS,
        "bw",
        &uid,
        Some(vec![result(
            "bw",
            DRIVER,
            POOL,
            "nic-0",
            Some(&share),
            &[("bandwidth", "200M")],
        )]),
        &[("iperf", &pod_uid)],
    ));
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    wait_for("the net device published as enforcing", WAIT, || {
        ours(&api).iter().any(|s| {
            s.spec.devices.iter().flatten().any(|d| {
                let a = d.attributes.as_ref();
                a.and_then(|a| a["enforced"].bool) == Some(true)
                    && a.and_then(|a| a["mechanism"].string.clone()).as_deref() == Some("htb-ebpf")
            })
        })
    });

    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "bw", &uid).await;
    assert_eq!(r.error, "", "{r:?}");
    let mut client = agent.client().await;
    let s = get_share(&mut client, share.clone()).await;
    assert_eq!(s.phase, pb::Phase::Pending as i32, "no sandbox yet: {s:?}");
    assert_eq!(
        s.pod_uids,
        std::slice::from_ref(&pod_uid),
        "the pod from reservedFor"
    );

    let pod = Pod::with(&pod_uid, Layout::Systemd);
    wait_phase(&mut client, &share, pb::Phase::Enforced).await;
    wait_for("the claim says enforced", WAIT, || {
        entries(&api, "bw").iter().any(|e| {
            e.conditions
                .as_ref()
                .is_some_and(|c| c[0].status == "True" && c[0].reason == "Enforced")
        })
    });
    let e = entries(&api, "bw").remove(0);
    assert_eq!(e.share_id.as_deref(), Some(share.as_str()));
    assert_eq!(data(&e)["enforced"]["bandwidth"], "200M", "{e:?}");
    assert_eq!(data(&e)["requested"]["bandwidth"], "200M", "{e:?}");

    {
        let server = pod.iperf_server();
        let _lock = TrafficLock::acquire();
        let m = server.measure(&Iperf::new(Direction::ToPod));
        let ratio = m.bits_per_second / 200e6;
        eprintln!("to the pod: {m} -> {ratio:.3} of the limit");
        assert!(
            (net::GOODPUT_LOW..=net::GOODPUT_HIGH).contains(&ratio),
            "{ratio:.3}: {m}"
        );
    }

    let u = unprepare_v1(&mut kubelet, NS, "bw", &uid).await;
    assert_eq!(u.error, "", "{u:?}");
    let qdiscs = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    assert!(!qdiscs.contains("htb"), "limit lifted: {qdiscs}");
    wait_for("the entry gone from the claim", WAIT, || {
        entries(&api, "bw").is_empty()
    });
}

/// The agent restarted on a changed inventory under a running plugin: the slice follows
/// with a new pool generation, and Prepare checks against the new policy.
#[tokio::test]
async fn a_changed_inventory_is_published_with_a_new_generation() {
    let mut agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let _p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    wait_for("the slice published", WAIT, || ours(&api).len() == 1);
    let first = ours(&api).remove(0);
    assert_eq!(first.spec.pool.generation, 1);

    let full = std::fs::read_to_string(&agent.config).unwrap();
    let grown = full.replace("value = \"8Gi\"", "value = \"16Gi\"");
    assert_ne!(grown, full, "the harness's config layout changed");
    std::fs::write(&agent.config, grown).unwrap();
    agent.restart();
    let memory = |s: &ResourceSlice| {
        s.spec.devices.as_ref().unwrap()[0]
            .capacity
            .as_ref()
            .unwrap()["memory"]
            .value
            .0
            .clone()
    };
    wait_for("the grown device published", WAIT, || {
        ours(&api).first().is_some_and(|s| memory(s) == "16Gi")
    });
    let s = ours(&api).remove(0);
    assert_eq!(s.spec.pool.generation, 2, "a new generation of the pool");
    assert_eq!(s.metadata.name, first.metadata.name, "the same slice");
}

/// Status writes lost while the plugin was down (here: the entry removed behind its
/// back) are made good from the agent's snapshot when it starts again.
#[tokio::test]
async fn a_restarted_plugin_writes_the_status_again_from_the_snapshot() {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let pod_uid = share_id();
    api.put(&pod(NS, "p1", &pod_uid, NODE));
    let (uid, share) = (share_id(), share_id());
    api.put(&claim(
        NS,
        "c1",
        &uid,
        Some(vec![result(
            "mem",
            DRIVER,
            POOL,
            "mem-0",
            Some(&share),
            &[("memory", "1Gi")],
        )]),
        &[("p1", &pod_uid)],
    ));
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid).await;
    assert_eq!(r.error, "", "{r:?}");
    wait_for("the status written", WAIT, || {
        entries(&api, "c1").len() == 1
    });

    p.kill9();
    let mut c = api.get::<ResourceClaim>(NS, "c1").unwrap();
    c.status.as_mut().unwrap().devices = None;
    api.put(&c);
    p.restart();
    wait_for("the status written again", WAIT, || {
        shows(&api, "c1", &share)
    });
}

/// The agent restarted with a driver the plugin did not register: the plugin stops with
/// the reason (its container is restarted and registers the new set), removing its
/// sockets as at any clean stop.
#[tokio::test]
async fn a_new_driver_in_the_agent_stops_the_plugin_to_register_it() {
    let mut agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let reg = p.kubelet.registration_socket(DRIVER);
    assert!(reg.exists());

    let other =
        generic_device("mem-9", "8Gi", "1Gi", &[NS], &[]).replace(DRIVER, "other.example.com");
    let mut text = std::fs::read_to_string(&agent.config).unwrap();
    text.push_str(&other);
    std::fs::write(&agent.config, text).unwrap();
    agent.restart();

    let status = p.wait_exit();
    assert!(!status.success(), "{status}");
    let log = p.log_text();
    assert!(
        log.contains("the agent's drivers changed (added [\"other.example.com\"], removed [])"),
        "{log}"
    );
    assert!(!reg.exists(), "sockets removed at the stop");
}

/// The claim deleted and created anew under its name while its share is live: the
/// API server refuses the apply that names the old uid (422 Invalid, the cause on
/// metadata.uid, as kube-apiserver answers), and the plugin stops writing that claim
/// instead of trying again with backoff; the new claim is left alone.
#[tokio::test]
async fn a_replaced_claim_is_not_written_again() {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let pod_uid = share_id();
    api.put(&pod(NS, "p1", &pod_uid, NODE));
    let (uid, share) = (share_id(), share_id());
    let allocated = |uid: &str| {
        claim(
            NS,
            "c1",
            uid,
            Some(vec![result(
                "mem",
                DRIVER,
                POOL,
                "mem-0",
                Some(&share),
                &[("memory", "1Gi")],
            )]),
            &[("p1", &pod_uid)],
        )
    };
    api.put(&allocated(&uid));
    let mut p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid).await;
    assert_eq!(r.error, "", "{r:?}");
    wait_for("the status written", WAIT, || {
        entries(&api, "c1").len() == 1
    });

    // Deleted and created anew (another uid, no status of ours). The restarted plugin
    // marks the share's claim again from the agent's snapshot and tries to write it.
    p.kill9();
    api.delete::<ResourceClaim>(NS, "c1");
    api.put(&allocated(&share_id()));
    let status_path = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/c1/status");
    let writes = || {
        api.applies()
            .iter()
            .filter(|a| a.path == status_path)
            .count()
    };
    let before = writes();
    p.restart();
    wait_for("the refused write", WAIT, || writes() > before);
    // Backoff would try again after 1 s, 2 s, ...: nothing comes.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(writes(), before + 1, "{}", p.log_text());
    let log = p.log_text();
    assert!(
        log.contains("claim deleted or replaced; its status is not written any more")
            && log.contains("metadata.uid"),
        "{log}"
    );
    assert!(!log.contains("writing claim status failed"), "{log}");
    assert_eq!(entries(&api, "c1"), [], "the new claim is left alone");
}

/// An API server that drops the consumable-capacity fields (the DRAConsumableCapacity
/// gate off) stores the slices without `allowMultipleAllocations` and `requestPolicy`,
/// and answers the apply with 200. The plugin reads back what was stored, names each
/// dropped field with its slice and device at error level with the likely cause, does
/// not call the publish done, and says so again on later passes without applying the
/// same content over and over.
#[tokio::test]
async fn fields_the_api_server_drops_are_reported_loudly() {
    let agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &[NS],
        &[],
    )));
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    api.drop_consumable_capacity_fields();
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let slice = format!("{NODE}-{DRIVER}-0");
    let reports = |field: &str| {
        p.log_text()
            .lines()
            .filter(|l| {
                l.contains("ERROR")
                    && l.contains("did not store a field of the ResourceSlice")
                    && l.contains(&format!("slice={slice}"))
                    && l.contains("device=mem-0")
                    && l.contains(&format!("field={field}"))
                    && l.contains("DRAConsumableCapacity feature gate")
            })
            .count()
    };
    // --resync-seconds 1: the check runs again every second.
    wait_for("the dropped fields reported on two passes", WAIT, || {
        reports("allowMultipleAllocations") >= 2 && reports("capacity[memory].requestPolicy") >= 2
    });
    let log = p.log_text();
    assert!(
        log.contains("ResourceSlices published without fields the API server dropped"),
        "{log}"
    );
    assert!(!log.contains("ResourceSlices up to date"), "{log}");
    let stored = ours(&api);
    assert_eq!(stored.len(), 1);
    let d = &stored[0].spec.devices.as_ref().unwrap()[0];
    assert_eq!(
        d.allow_multiple_allocations, None,
        "the stand-in dropped it"
    );
    let generation = stored[0].spec.pool.generation;

    // The gate turned on: the next check's apply is stored whole, at the same
    // generation (its content is what that generation always meant).
    api.keep_consumable_capacity_fields();
    wait_for("the slice stored whole again", WAIT, || {
        let s = ours(&api);
        s.len() == 1
            && s[0].spec.devices.as_ref().unwrap()[0].allow_multiple_allocations == Some(true)
    });
    assert_eq!(
        ours(&api)[0].spec.pool.generation,
        generation,
        "a new generation"
    );
    wait_for("the plugin to say so", WAIT, || {
        p.log_text()
            .contains("the API server now stores every field of the ResourceSlice")
    });
}

/// An API server incident: every request is refused, first 30 s of 503 without
/// Retry-After, then 429 with Retry-After: 2 (12 s from the first request that gets
/// one), while kubelet prepares and unprepares. The plugin's requests come in waves that every request of the process
/// waits out together: under the 503s a bounded number, under the 429s never sooner than
/// the server asked. Once the server answers again, kubelet's next Prepare works and the
/// claims' status catches up.
#[tokio::test]
async fn an_overloaded_api_server_gets_no_retry_storm_and_the_plugin_recovers() {
    const PHASE: Duration = Duration::from_secs(30);
    let agent = super::kubelet_plugin::agent();
    let (api, pod_uid) = super::kubelet_plugin::api_with_pod();
    let put_claim = |name: &str| super::kubelet_plugin::share_claim(&api, name, &pod_uid, "1Gi");
    let (uid1, share1) = put_claim("c1");
    let (uid2, share2) = put_claim("c2");
    let (uid3, share3) = put_claim("c3");
    // It measures time (the gaps between requests): not beside another measurement.
    let _lock = TrafficLock::acquire();
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    wait_for("the slice", WAIT, || !ours(&api).is_empty());
    let mut kubelet = p.kubelet.v1(&p.endpoint(DRIVER)).await;
    let r = prepare_v1(&mut kubelet, NS, "c1", &uid1).await;
    assert_eq!(r.error, "", "{r:?}");
    wait_for("c1's status", WAIT, || shows(&api, "c1", &share1));

    // 503s without Retry-After, while kubelet prepares c2 (its claim cannot be read)
    // and unprepares c1 (its status cannot be written).
    let start_503 = std::time::Instant::now();
    api.overload(503, None);
    let r = prepare_v1(&mut kubelet, NS, "c2", &uid2).await;
    assert_ne!(r.error, "", "c2 prepared without its claim: {r:?}");
    let u = unprepare_v1(&mut kubelet, NS, "c1", &uid1).await;
    assert_eq!(u.error, "", "Unprepare needs no API call: {u:?}");
    tokio::time::sleep(PHASE.saturating_sub(start_503.elapsed())).await;

    let start_429 = std::time::Instant::now();
    api.overload(429, Some(2));
    let r = prepare_v1(&mut kubelet, NS, "c3", &uid3).await;
    assert_ne!(r.error, "", "c3 prepared without its claim: {r:?}");
    // The hold the 503s left (up to 30 s, drawn with jitter) may still run when the 429s
    // begin: they are watched from the first request that reaches them, for as long
    // as the server asks for six times over.
    let first_429 = loop {
        let first = api
            .requests_timed()
            .into_iter()
            .map(|(t, _)| t)
            .find(|t| *t >= start_429);
        if let Some(t) = first {
            break t;
        }
        assert!(
            start_429.elapsed() < PHASE + Duration::from_secs(15),
            "no request in {:?} of 429s: the 503s' hold is at most 30 s",
            start_429.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(
        (first_429 + Duration::from_secs(12)).saturating_duration_since(std::time::Instant::now()),
    )
    .await;
    let end = std::time::Instant::now();
    api.recover();

    let timed = api.requests_timed();
    let during = |from: std::time::Instant, to: std::time::Instant| -> Vec<std::time::Instant> {
        timed
            .iter()
            .map(|(t, _)| *t)
            .filter(|t| *t >= from && *t < to)
            .collect()
    };
    let listing = || {
        timed
            .iter()
            .filter(|(t, _)| *t >= start_503)
            .map(|(t, r)| format!("{:>6} ms {r}", t.duration_since(start_503).as_millis()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    // Under the 503s: the holds double from 200 ms to 30 s; 9 requests in 30 s in one
    // run, where kube's retry of each request alone (from 5 ms, up to 15 times) sent 107.
    let under_503 = during(start_503, start_429);
    assert!(
        !under_503.is_empty() && under_503.len() <= 40,
        "{} requests in 30 s of 503s:\n{}",
        under_503.len(),
        listing()
    );
    // Under the 429s: after the first wave, waves at least the 2 s the server asked
    // apart; within a wave, the requests the gate let go together.
    let under_429 = during(start_429, end);
    let gaps: Vec<Duration> = under_429.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.iter()
            .all(|g| *g < Duration::from_millis(300) || *g >= Duration::from_millis(1950)),
        "a request came sooner than the Retry-After: gaps {gaps:?}\n{}",
        listing()
    );
    let waves = 1 + gaps
        .iter()
        .filter(|g| **g >= Duration::from_millis(1950))
        .count();
    eprintln!(
        "requests: {} under 30 s of 503s, {} in {waves} waves under the 429s",
        under_503.len(),
        under_429.len()
    );
    assert!(
        (2..=16).contains(&waves) && under_429.len() <= 8 * waves,
        "{} requests in {waves} waves under the 429s:\n{}",
        under_429.len(),
        listing()
    );

    // The server back: kubelet's next try of c2 works at once, and the claims' status
    // catches up (c1's entry gone, c2's there).
    let recovered = std::time::Instant::now();
    let r = prepare_v1(&mut kubelet, NS, "c2", &uid2).await;
    assert_eq!(r.error, "", "{r:?}");
    assert!(
        recovered.elapsed() < Duration::from_secs(5),
        "{:?}",
        recovered.elapsed()
    );
    let r = prepare_v1(&mut kubelet, NS, "c3", &uid3).await;
    assert_eq!(r.error, "", "{r:?}");
    wait_for(
        "the claims' status after the incident",
        Duration::from_secs(70),
        || {
            entries(&api, "c1").iter().all(|e| e.driver != DRIVER)
                && [("c2", &share2), ("c3", &share3)]
                    .iter()
                    .all(|(c, s)| shows(&api, c, s))
        },
    );
}
