//! The Kubernetes part of `make showcase`: the real `shareguard kubelet-plugin` between
//! kubelet's calls (made here from kubelet's own API definitions) and an API-server
//! STAND-IN (no kube-apiserver can be installed on this machine), over an agent the
//! showcase already runs. It prints the ResourceSlice the plugin publishes, kubelet's
//! calls and their answers, and the ResourceClaim's status as YAML: a pod that asked for
//! `bandwidth: 200M` gets it, measured with iperf3, and the claim says so.
//!
//! `cargo run -p shareguard-tests --example kubernetes -- AGENT_SOCKET`
//! (root: it makes a pod network namespace, veth and cgroup, and removes them).

#![allow(clippy::unwrap_used, clippy::print_stdout)] // A demo: a failed step ends it with the reason.

use std::{path::PathBuf, time::Duration};

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use shareguard_tests::{
    apiserver::ApiServer,
    k8s::{self, claim, pod, result},
    kubelet::{prepare_v1, unprepare_v1},
    net::{Direction, Iperf, Pod, wait_for},
    plugin::Plugin,
    pod::{Layout, pod_uid},
    proto as pb, share_id, wait_phase,
};

const NODE: &str = "showcase-node";
const NS: &str = "team-a";

fn yaml<T: serde::Serialize>(v: &T) -> String {
    serde_yaml::to_string(v).unwrap()
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}

fn claim_status(api: &ApiServer) -> String {
    let c = api.get::<ResourceClaim>(NS, "web-bandwidth").unwrap();
    yaml(&serde_json::json!({ "status": { "devices": c.status.and_then(|s| s.devices) } }))
}

#[tokio::main]
async fn main() {
    let socket = PathBuf::from(
        std::env::args()
            .nth(1)
            .expect("usage: kubernetes AGENT_SOCKET"),
    );
    let mut agent = shareguard::client::connect(&socket).await.unwrap();
    let devices = agent
        .list_devices(pb::ListDevicesRequest {})
        .await
        .unwrap()
        .into_inner();
    let nic = devices
        .devices
        .iter()
        .find(|d| d.kind == "net")
        .expect("the agent has a net device")
        .clone();

    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    let uid = pod_uid();
    api.put(&pod(NS, "web", &uid, NODE));
    let (claim_uid, share) = (share_id(), share_id());
    // As the scheduler leaves it: allocated (a 200M share of the NIC) and reserved for the pod.
    api.put(&claim(
        NS,
        "web-bandwidth",
        &claim_uid,
        Some(vec![result(
            "bw",
            &nic.driver,
            &nic.pool,
            &nic.name,
            Some(&share),
            &[("bandwidth", "200M")],
        )]),
        &[("web", &uid)],
    ));

    let plugin = Plugin::start_for(&socket, &api, NODE, &[nic.driver.as_str()]);
    let info = plugin.kubelet.register(&nic.driver, Ok(())).await;
    println!(
        "kubelet: registered {} ({}), endpoint {}, versions {:?}",
        info.name, info.r#type, info.endpoint, info.supported_versions
    );
    wait_for("the ResourceSlice", Duration::from_secs(20), || {
        !api.list::<ResourceSlice>().is_empty()
    });
    let slice = api.list::<ResourceSlice>().remove(0);
    println!("the plugin published (kubectl get resourceslice -o yaml, spec):");
    print!("{}", indent(&yaml(&slice.spec)));

    let mut kubelet = plugin.kubelet.v1(&plugin.endpoint(&nic.driver)).await;
    println!("kubelet: NodePrepareResources({NS}/web-bandwidth), before the pod's sandbox exists");
    let answer = prepare_v1(&mut kubelet, NS, "web-bandwidth", &claim_uid).await;
    assert_eq!(answer.error, "", "{answer:?}");
    for d in &answer.devices {
        println!(
            "  -> device {}/{} share {} for request {:?}",
            d.pool_name,
            d.device_name,
            d.share_id.as_deref().unwrap_or("(whole device)"),
            d.request_names
        );
    }

    println!("the pod's sandbox appears (netns, veth, a cgroup in kubelet's systemd layout)");
    let p = Pod::with(&uid, Layout::Systemd);
    wait_phase(&mut agent, &share, pb::Phase::Enforced).await;
    wait_for("the claim's status", Duration::from_secs(20), || {
        claim_status(&api).contains("Enforced\n") && claim_status(&api).contains("status: 'True'")
    });
    println!("kubectl get resourceclaim web-bandwidth -n {NS} -o yaml (status):");
    print!("{}", indent(&claim_status(&api)));

    let server = p.iperf_server();
    let m = server.measure(&Iperf::new(Direction::ToPod));
    println!(
        "iperf3 to the pod: {:.1} Mbit/s for a 200M share",
        m.bits_per_second / 1e6
    );

    println!("kubelet: NodeUnprepareResources after the pod's containers stopped");
    drop(server);
    let u = unprepare_v1(&mut kubelet, NS, "web-bandwidth", &claim_uid).await;
    assert_eq!(u.error, "", "{u:?}");
    wait_for("the entry gone", Duration::from_secs(20), || {
        !claim_status(&api).contains(&share)
    });
    println!("the claim's status after Unprepare:");
    print!("{}", indent(&claim_status(&api)));
    drop(p);
    drop(plugin);
}
