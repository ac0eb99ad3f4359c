//! What kubelet hears of each device's health (`DRAResourceHealth` v1alpha1 and v1 on the
//! plugin's DRA socket), from the real plugin over the real agent: HEALTHY while a device
//! can hold its shares, UNHEALTHY with the reason when it cannot (a GPU that stopped
//! answering the SIMULATED driver, a NIC whose link went down or away), UNKNOWN while the
//! agent does not answer, and each back again once the fault is gone. And what the
//! scheduler sees of it: a NoSchedule taint on the device in its slice (the API-server
//! STAND-IN).

use std::{fs, time::Duration};

use k8s_openapi::api::resource::v1::ResourceSlice;

use shareguard_tests::{
    Agent, DRIVER, Options, POOL,
    apiserver::ApiServer,
    generic_device, k8s,
    kubelet::HeardHealth,
    net::{self, PinDir},
    plugin::Plugin,
    simulated_gpu_device,
};

const NODE: &str = "node-a";

/// A device taint as (key, value, effect).
type Taint = (String, String, String);
/// The plugin asks the agent every 5 s while kubelet listens; a change shows within
/// two of its periods even on a loaded machine.
const HEARD_WITHIN: Duration = Duration::from_secs(15);

fn api() -> ApiServer {
    let api = ApiServer::start();
    api.put_cluster(&k8s::node(NODE));
    api
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// An agent with a SIMULATED GPU `gpu-0` and an accounting device `mem-0`, and the file
/// (under `dir`, absent for now) its simulated driver's faults are read from.
fn gpu_and_accounting_agent(dir: &std::path::Path) -> (Agent, std::path::PathBuf) {
    let faults = dir.join("faults.json");
    let mut o = Options::new(format!(
        "{}{}",
        simulated_gpu_device("{ period = \"1s\", action = \"report\" }"),
        generic_device("mem-0", "8Gi", "1Gi", &["team-a"], &[])
    ));
    o.agent_extra = format!(
        "cdi_dir = {:?}\nsimulated_gpu_faults = {faults:?}",
        dir.join("cdi")
    );
    (Agent::start(o), faults)
}

fn assert_fresh(h: &HeardHealth) {
    assert_eq!(h.pool, POOL, "{h:?}");
    assert_eq!(h.health_check_timeout_seconds, 30, "{h:?}");
    assert!(
        (now() - h.last_updated_time).abs() <= 10,
        "stamped now, not {}: {h:?}",
        h.last_updated_time
    );
}

/// A simulated GPU the driver stops answering is UNHEALTHY on both versions' streams,
/// with the driver's error; the accounting device beside it stays HEALTHY; both are
/// HEALTHY again once the driver answers.
#[tokio::test]
async fn a_gpu_the_driver_loses_is_unhealthy_until_it_answers_again() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, faults) = gpu_and_accounting_agent(dir.path());
    let api = api();
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let endpoint = p.endpoint(DRIVER);
    let mut alpha = p.kubelet.health_v1alpha1(&endpoint).await;
    let mut v1 = p.kubelet.health_v1(&endpoint).await;

    let first = alpha.next().await;
    let mut names: Vec<_> = first.iter().map(|d| d.device.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["gpu-0", "mem-0"],
        "every device of the driver: {first:#?}"
    );
    for d in &first {
        assert_eq!(d.health, "HEALTHY", "{d:?}");
        assert!(d.message.starts_with("mechanism "), "{d:?}");
        assert_fresh(d);
    }

    fs::write(
        &faults,
        r#"[{"op": "compute_processes", "error": "gpu_lost"}]"#,
    )
    .unwrap();
    for s in [&mut alpha, &mut v1] {
        let h = s.wait_for("gpu-0", "UNHEALTHY", HEARD_WITHIN).await;
        assert!(
            h.message.contains("does not answer the driver"),
            "says why: {h:?}"
        );
        assert_fresh(&h);
        let m = s.next().await;
        let mem = m.iter().find(|d| d.device == "mem-0").unwrap();
        assert_eq!(
            mem.health, "HEALTHY",
            "another device is not touched: {m:#?}"
        );
    }

    fs::remove_file(&faults).unwrap();
    for s in [&mut alpha, &mut v1] {
        s.wait_for("gpu-0", "HEALTHY", HEARD_WITHIN).await;
    }
}

/// While the agent is down kubelet hears UNKNOWN for every device, with the reason, and
/// HEALTHY again once a new agent answers; the stream itself stays open throughout.
#[tokio::test]
async fn devices_are_unknown_while_the_agent_does_not_answer() {
    let mut agent = Agent::start(Options::new(generic_device(
        "mem-0",
        "8Gi",
        "1Gi",
        &["team-a"],
        &[],
    )));
    let api = api();
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut s = p.kubelet.health_v1(&p.endpoint(DRIVER)).await;
    s.wait_for("mem-0", "HEALTHY", HEARD_WITHIN).await;

    agent.kill9();
    let h = s.wait_for("mem-0", "UNKNOWN", HEARD_WITHIN).await;
    assert!(
        h.message
            .starts_with("the shareguard agent does not answer"),
        "{h:?}"
    );
    assert_fresh(&h);

    agent.start_again();
    s.wait_for("mem-0", "HEALTHY", HEARD_WITHIN).await;
}

/// A `net` device stands for its NIC (`interface`): the link taken down makes it
/// UNHEALTHY naming the interface, up again HEALTHY, and the interface deleted UNHEALTHY
/// as gone. The NIC is a veth of the test's own.
#[tokio::test]
async fn a_nic_whose_link_goes_down_or_away_is_unhealthy() {
    if !net::privileged("a_nic_whose_link_goes_down_or_away_is_unhealthy") {
        return;
    }
    let (_netns, link) = net::veth_to_new_netns();
    let nic = link.name().to_owned();
    let pins = PinDir::new();
    let agent = net::start_agent(
        net::net_device(
            "nic-0",
            &format!("interface = \"{nic}\"\n{}", net::bandwidth_capacity("1G")),
        ),
        &pins,
        "",
    );
    let api = api();
    let p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    let mut s = p.kubelet.health_v1alpha1(&p.endpoint(DRIVER)).await;
    let h = s.wait_for("nic-0", "HEALTHY", HEARD_WITHIN).await;
    assert_fresh(&h);

    net::sh(&["ip", "link", "set", &nic, "down"]);
    let h = s.wait_for("nic-0", "UNHEALTHY", HEARD_WITHIN).await;
    assert_eq!(h.message, format!("interface {nic} is down"), "{h:?}");

    net::sh(&["ip", "link", "set", &nic, "up"]);
    s.wait_for("nic-0", "HEALTHY", HEARD_WITHIN).await;

    net::sh(&["ip", "link", "del", &nic]);
    let h = s.wait_for("nic-0", "UNHEALTHY", HEARD_WITHIN).await;
    assert_eq!(h.message, format!("interface {nic} is gone"), "{h:?}");
}

/// A device that cannot hold its shares carries a NoSchedule taint in its slice, its
/// value the kind of fault, and loses it once the device can again; the device beside it
/// is never tainted.
#[tokio::test]
async fn a_device_that_cannot_hold_its_shares_is_tainted_in_its_slice() {
    let dir = tempfile::tempdir().unwrap();
    let (agent, faults) = gpu_and_accounting_agent(dir.path());
    let api = api();
    let _p = Plugin::start(&agent, &api, NODE, &[DRIVER]);
    // Device name -> its taints as (key, value, effect), once the slice is published.
    let taints = || -> Option<Vec<(String, Vec<Taint>)>> {
        let slices: Vec<ResourceSlice> = api
            .list::<ResourceSlice>()
            .into_iter()
            .filter(|s| s.spec.driver == DRIVER)
            .collect();
        let s = slices.first()?;
        Some(
            s.spec
                .devices
                .iter()
                .flatten()
                .map(|d| {
                    let t = d
                        .taints
                        .iter()
                        .flatten()
                        .map(|t| {
                            (
                                t.key.clone(),
                                t.value.clone().unwrap_or_default(),
                                t.effect.clone(),
                            )
                        })
                        .collect();
                    (d.name.clone(), t)
                })
                .collect(),
        )
    };
    let untainted =
        || taints().is_some_and(|ds| ds.len() == 2 && ds.iter().all(|(_, t)| t.is_empty()));
    net::wait_for("the slice, with no taint", HEARD_WITHIN, untainted);

    fs::write(
        &faults,
        r#"[{"op": "compute_processes", "error": "gpu_lost"}]"#,
    )
    .unwrap();
    let want = vec![(
        format!("{DRIVER}/unhealthy"),
        "gpu-not-answering".to_owned(),
        "NoSchedule".to_owned(),
    )];
    net::wait_for("gpu-0 tainted", HEARD_WITHIN, || {
        taints().is_some_and(|ds| {
            ds.iter().any(|(n, t)| n == "gpu-0" && *t == want)
                && ds.iter().any(|(n, t)| n == "mem-0" && t.is_empty())
        })
    });

    fs::remove_file(&faults).unwrap();
    net::wait_for("the taint gone", HEARD_WITHIN, untainted);
}
