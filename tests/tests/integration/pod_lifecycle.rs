//! A share lives with its pod, through the real binary: Prepare with nothing but the pod's
//! uid (before the sandbox exists, as kubelet calls it), the pod's sandbox appearing in a
//! kubelet cgroup layout, traffic limited both ways, the sandbox deleted and made again,
//! and Unprepare; and what discovery refuses or reports instead of enforcing. Root only;
//! skips without it unless `CI=true`.

#![allow(clippy::unwrap_used)] // Setup failures panic with the reason; that is the test failing.

use std::{fs, time::Duration};

use shareguard_limiter_net::{
    bpf::Direction as Hook,
    limiter::link_name,
    state::{file_name, queue_name},
};
use shareguard_tests::{
    Agent, Client, device, get_share,
    net::{self, Direction, Iperf, PinDir, Pod, TrafficLock},
    pod::{Layout, Sandbox, pod_uid},
    prepare_one, proto as pb, share_id, unprepare_one, wait_phase, wait_share,
};

const LOW: f64 = net::GOODPUT_LOW;
const HIGH: f64 = net::GOODPUT_HIGH;

fn start(pins: &PinDir) -> Agent {
    let lines = format!(
        "mechanism = \"htb-ebpf\"\n{}",
        net::bandwidth_capacity("10G")
    );
    // A long rescan period: what these tests see must come from the kernel's events.
    net::start_agent(
        net::net_device("nic-0", &lines),
        pins,
        "rescan_period = \"1h\"\nreconcile_period = \"1h\"",
    )
}

/// A claim for `rate` of bandwidth for pod `uid`, naming nothing but the pod.
fn claim_for(claim_uid: &str, ns: &str, pod: &str, id: &str, rate: &str) -> pb::ClaimPrepare {
    net::bw_claim_for(claim_uid, ns, "nic-0", pod, id, rate)
}

/// Nothing the agent installs for share `id` exists: its ifb, its pinned links, its
/// install record.
fn nothing_left(a: &Agent, pins: &PinDir, id: &str) {
    assert!(!net::link_exists(&queue_name(id)), "ifb of {id} left");
    for hook in [Hook::ToPod, Hook::FromPod] {
        let pin = pins.0.join("net/links").join(link_name(id, hook));
        assert!(!pin.exists(), "{} left", pin.display());
    }
    let pin = pins
        .0
        .join("net/links")
        .join(shareguard_limiter_net::limiter::return_link_name(id));
    assert!(!pin.exists(), "{} left", pin.display());
    let rec = a
        .state_dir
        .join("net")
        .join(format!("{}.json", file_name(id)));
    assert!(!rec.exists(), "{} left", rec.display());
}

fn measure_both(pod: &Pod, rate_bps: f64, what: &str) {
    let server = pod.iperf_server();
    let _lock = TrafficLock::acquire();
    for dir in [Direction::ToPod, Direction::FromPod] {
        let m = server.measure(&Iperf::new(dir));
        let ratio = m.bits_per_second / rate_bps;
        eprintln!("{what} {dir}: {m} -> {ratio:.3} of the limit");
        assert!(
            (LOW..=HIGH).contains(&ratio),
            "{what} {dir}: {ratio:.3} of the limit, outside {LOW}..={HIGH}: {m}"
        );
    }
}

async fn lifecycle(layout: Layout) {
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let uid = pod_uid();
    let id = share_id();

    // kubelet prepares the claim before the sandbox exists: admitted, waiting, held.
    let r = prepare_one(&mut c, 0, claim_for("life", "team-a", &uid, &id, "200M")).await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Pending as i32, "{s:?}");
    assert!(s.reason.contains(&uid), "{s:?}");
    let status: serde_json::Value = serde_json::from_str(&s.device_status_json).unwrap();
    assert_eq!(status["conditions"][0]["status"], "False");
    assert_eq!(status["conditions"][0]["reason"], "WaitingForPodSandbox");
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "200M");

    // The pod's sandbox appears: enforced, no call needed, limited both ways.
    let pod = Pod::with(&uid, layout);
    let s = wait_phase(&mut c, &id, pb::Phase::Enforced).await;
    let sb = s.sandbox.clone().unwrap();
    assert_eq!(sb.host_interface, pod.host_if(), "{s:?}");
    assert_eq!(sb.pod_uid, uid);
    assert_eq!(
        sb.cgroup,
        pod.sandbox().unwrap().pod_cgroup(),
        "the pod's own cgroup"
    );
    assert_eq!(s.limits[0].enforced, "200M", "read back: {s:?}");
    measure_both(&pod, 200e6, &format!("{layout:?}"));

    // The pod is deleted before Unprepare: waiting again, capacity held, nothing of the
    // dead sandbox left.
    drop(pod);
    let s = wait_phase(&mut c, &id, pb::Phase::Pending).await;
    assert!(s.sandbox.is_none(), "{s:?}");
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "200M");
    nothing_left(&a, &pins, &id);

    // It is made again (a new netns, veth and cgroup): enforced again without a call.
    let pod = Pod::with(&uid, layout);
    let s = wait_phase(&mut c, &id, pb::Phase::Enforced).await;
    assert_eq!(s.sandbox.unwrap().host_interface, pod.host_if());
    measure_both(&pod, 200e6, &format!("{layout:?}, new sandbox"));

    // Unprepare: nothing left, the interface as found.
    assert_eq!(unprepare_one(&mut c, 0, "life").await.code, "");
    nothing_left(&a, &pins, &id);
    let qdiscs = net::sh(&["tc", "qdisc", "show", "dev", pod.host_if()]);
    assert!(!qdiscs.contains("htb"), "{qdiscs}");
    assert_eq!(device(&mut c, "nic-0").await.allocated["bandwidth"], "0");
}

#[tokio::test]
async fn a_share_lives_with_its_pod_systemd_layout() {
    if !net::privileged("a_share_lives_with_its_pod_systemd_layout") {
        return;
    }
    lifecycle(Layout::Systemd).await;
}

#[tokio::test]
async fn a_share_lives_with_its_pod_cgroupfs_layout() {
    if !net::privileged("a_share_lives_with_its_pod_cgroupfs_layout") {
        return;
    }
    lifecycle(Layout::Cgroupfs).await;
}

/// A pod in the host's network namespace cannot be limited per pod: the share says so
/// (DEGRADED, never ENFORCED) and no host interface is touched.
#[tokio::test]
async fn a_host_network_pod_is_reported_and_no_host_interface_touched() {
    if !net::privileged("a_host_network_pod_is_reported_and_no_host_interface_touched") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    // The host's own interfaces' qdiscs; other tests' links come and go meanwhile.
    let host_qdiscs = || -> Vec<String> {
        net::sh(&["tc", "qdisc", "show"])
            .lines()
            .filter(|l| !l.contains(" dev sg"))
            .map(str::to_owned)
            .collect()
    };
    let qdiscs_before = host_qdiscs();
    let sb = Sandbox::start(&pod_uid(), Layout::Systemd, None);
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for("hostnet", "team-a", sb.uid(), &id, "50M"),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    // Its process has just started: a starting sandbox's first process is in the
    // host's namespace for a moment, so the verdict waits until the pod's processes
    // have run for a while; then it comes by itself (this agent rescans hourly).
    assert_eq!(r.shares[0].phase, pb::Phase::Pending as i32, "{r:?}");
    assert!(
        r.shares[0].reason.contains("waiting to see whether"),
        "{r:?}"
    );
    let s = wait_phase(&mut c, &id, pb::Phase::Degraded).await;
    assert!(s.reason.contains("hostNetwork"), "{s:?}");
    assert!(s.limits[0].enforced.is_empty(), "{s:?}");
    assert_eq!(host_qdiscs(), qdiscs_before);
    assert!(!net::link_exists(&queue_name(&id)));
    assert_eq!(unprepare_one(&mut c, 0, "hostnet").await.code, "");
}

/// Both pods of `pods` measured at once in `dir`: their goodput together, bit/s.
fn together(pods: [&Pod; 2], dir: Direction) -> f64 {
    let (s1, s2) = (pods[0].iperf_server(), pods[1].iperf_server());
    let (m1, m2) = s1.measure_with(&s2, &Iperf::new(dir));
    for m in [&m1, &m2] {
        assert!(
            m.bits_per_second > 5e6,
            "{dir}: both pods make progress ({m1}; {m2})"
        );
    }
    m1.bits_per_second + m2.bits_per_second
}

/// A claim used by two pods on the node is one share, held by one limit: the two pods
/// sending at once get the share together, in both directions, never the share each
/// (which a tenant could otherwise get by starting a second pod). A hostNetwork pod
/// beside them cannot be limited per pod: the share says so (DEGRADED), and the limit
/// stays on the other two. Once one pod is gone, the other keeps the limit alone.
#[tokio::test]
async fn a_share_of_two_live_pods_holds_them_together() {
    if !net::privileged("a_share_of_two_live_pods_holds_them_together") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let (p1, p2) = (Pod::new(), Pod::new());
    let id = share_id();
    let one = claim_for("two", "team-a", p1.uid(), &id, "100M");
    let r = prepare_one(&mut c, 0, one.clone()).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    // The second pod joins the claim (kubelet reserved it for both).
    let mut both = one.clone();
    both.target
        .as_mut()
        .unwrap()
        .pod_uids
        .push(p2.uid().to_owned());
    let r = prepare_one(&mut c, 0, both.clone()).await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    let mut hosts: Vec<String> = s
        .sandbox
        .iter()
        .chain(&s.more_sandboxes)
        .map(|b| b.host_interface.clone())
        .collect();
    hosts.sort();
    let mut want = vec![p1.host_if().to_owned(), p2.host_if().to_owned()];
    want.sort();
    assert_eq!(hosts, want, "{s:?}");

    {
        let _lock = TrafficLock::acquire();
        for dir in [Direction::ToPod, Direction::FromPod] {
            let sum = together([&p1, &p2], dir);
            assert!(
                (100e6 * LOW..=100e6 * HIGH).contains(&sum),
                "{dir}: two pods of one 100M share got {:.1} Mbit/s together",
                sum / 1e6
            );
        }
    }

    // A hostNetwork pod joins too: reported, and the others stay limited.
    let host_pod = Sandbox::start(&pod_uid(), Layout::Systemd, None);
    let mut three = both.clone();
    three
        .target
        .as_mut()
        .unwrap()
        .pod_uids
        .push(host_pod.uid().to_owned());
    assert_eq!(prepare_one(&mut c, 0, three).await.error, None);
    let s = wait_phase(&mut c, &id, pb::Phase::Degraded).await;
    assert!(
        s.reason.contains("hostNetwork") && s.reason.contains(host_pod.uid()),
        "{s:?}"
    );
    assert_eq!(s.more_sandboxes.len(), 1, "the limit stays on both: {s:?}");
    {
        let _lock = TrafficLock::acquire();
        let sum = together([&p1, &p2], Direction::ToPod);
        assert!(
            sum <= 100e6 * HIGH,
            "with a hostNetwork pod beside them: {:.1} Mbit/s together",
            sum / 1e6
        );
    }
    drop(host_pod);
    let r = prepare_one(&mut c, 0, both).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");

    // The second pod ends: the first keeps the limit, alone.
    drop(p2);
    let s = wait_share(&mut c, &id, "ENFORCED on the first pod alone", |s| {
        s.phase == pb::Phase::Enforced as i32 && s.more_sandboxes.is_empty()
    })
    .await;
    assert_eq!(s.sandbox.unwrap().host_interface, p1.host_if());
    assert_eq!(unprepare_one(&mut c, 0, "two").await.code, "");
    nothing_left(&a, &pins, &id);
}

/// Kubelet prepares a claim once per node: a second pod of a claim that is already
/// prepared here only joins kubelet's record of the claim (its DRA checkpoint), and no
/// Prepare tells the agent. The agent reads that record itself: the second pod is under
/// the share's one limit as soon as its sandbox is there. A pod that kubelet runs with
/// another namespace's claim is refused when a caller names it, and a claim kubelet has
/// not admitted here touches no pod, whatever the caller names.
#[tokio::test]
async fn a_pod_kubelet_adds_to_a_prepared_claim_is_held_without_a_prepare() {
    if !net::privileged("a_pod_kubelet_adds_to_a_prepared_claim_is_held_without_a_prepare") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let (u1, u2, theirs) = (pod_uid(), pod_uid(), pod_uid());
    let claim_name = "claim-kc";
    a.write_kubelet_checkpoint(&[
        ("kc", claim_name, "team-a", &[u1.as_str()]),
        ("other", "claim-other", "team-b", &[theirs.as_str()]),
    ]);
    let p1 = Pod::with(&u1, Layout::Systemd);
    let id = share_id();
    let r = prepare_one(&mut c, 0, claim_for("kc", "team-a", &u1, &id, "100M")).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");

    // Kubelet admits a second pod with the claim: its record first, then the sandbox.
    a.write_kubelet_checkpoint(&[
        ("kc", claim_name, "team-a", &[u1.as_str(), u2.as_str()]),
        ("other", "claim-other", "team-b", &[theirs.as_str()]),
    ]);
    let p2 = Pod::with(&u2, Layout::Systemd);
    let s = wait_share(&mut c, &id, "ENFORCED on both pods", |s| {
        s.phase == pb::Phase::Enforced as i32 && s.more_sandboxes.len() == 1
    })
    .await;
    let mut pods: Vec<&str> = s
        .sandbox
        .iter()
        .chain(&s.more_sandboxes)
        .map(|b| b.pod_uid.as_str())
        .collect();
    pods.sort_unstable();
    let mut want = [u1.as_str(), u2.as_str()];
    want.sort_unstable();
    assert_eq!(pods, want, "{s:?}");
    {
        let _lock = TrafficLock::acquire();
        let sum = together([&p1, &p2], Direction::ToPod);
        assert!(
            (100e6 * LOW..=100e6 * HIGH).contains(&sum),
            "a pod kubelet added: {:.1} Mbit/s together",
            sum / 1e6
        );
    }

    // A caller naming a pod that kubelet runs with another namespace's claim.
    let r = prepare_one(
        &mut c,
        0,
        claim_for("kc2", "team-a", &theirs, &share_id(), "10M"),
    )
    .await;
    let e = r
        .error
        .expect("a pod of team-b named for a claim of team-a");
    assert_eq!(e.code, "PermissionDenied", "{e:?}");
    assert!(e.message.contains("kubelet runs pod"), "{e:?}");

    // A claim kubelet has not admitted here: nothing is touched, whatever is named.
    let p3 = Pod::new();
    let ghost = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for("ghost", "team-a", p3.uid(), &ghost, "10M"),
    )
    .await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Pending as i32, "{s:?}");
    assert!(s.reason.contains("kubelet has admitted no pod"), "{s:?}");
    assert!(
        !net::sh(&["tc", "qdisc", "show", "dev", p3.host_if()]).contains("htb"),
        "the named pod's veth is left alone"
    );
    assert_eq!(unprepare_one(&mut c, 0, "ghost").await.code, "");
    assert_eq!(unprepare_one(&mut c, 0, "kc").await.code, "");
    nothing_left(&a, &pins, &id);
}

/// An agent that looks for pods and reads enforcement back every 100 ms (a process
/// joining a cgroup raises no event of its own), and a pod with a 100M share of claim
/// `claim_uid`, ENFORCED.
async fn enforced_with_fast_rescans(
    pins: &PinDir,
    claim_uid: &str,
) -> (Agent, Client, Pod, String) {
    let lines = format!(
        "mechanism = \"htb-ebpf\"\n{}",
        net::bandwidth_capacity("10G")
    );
    let a = net::start_agent(
        net::net_device("nic-0", &lines),
        pins,
        "rescan_period = \"100ms\"\nreconcile_period = \"100ms\"",
    );
    let mut c = a.client().await;
    let pod = Pod::new();
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for(claim_uid, "team-a", pod.uid(), &id, "100M"),
    )
    .await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    (a, c, pod, id)
}

/// A process of an enforced pod that makes a network namespace of its own (`unshare
/// -n`, which kubelet's default seccomp profile allows) does not lift the pod's limit:
/// the limit stays on the sandbox it was verified on, the share stays ENFORCED and says
/// what it saw, and traffic stays limited both ways.
#[tokio::test]
async fn a_second_network_namespace_in_the_pod_does_not_lift_the_limit() {
    if !net::privileged("a_second_network_namespace_in_the_pod_does_not_lift_the_limit") {
        return;
    }
    let pins = PinDir::new();
    let (_a, mut c, mut pod, id) = enforced_with_fast_rescans(&pins, "unshare").await;

    pod.sandbox_mut().unwrap().spawn_in_own_netns();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let s = loop {
        let s = get_share(&mut c, id.clone()).await;
        if s.reason
            .contains("1 more network namespace(s), none wired to the host")
        {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no rescan saw the pod's second namespace: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.sandbox.as_ref().unwrap().host_interface, pod.host_if());
    assert_eq!(s.limits[0].enforced, "100M", "{s:?}");
    let classes = net::sh(&["tc", "class", "show", "dev", pod.host_if()]);
    assert!(classes.contains("rate 100Mbit"), "{classes}");
    measure_both(&pod, 100e6, "with a second namespace in the pod");
    // Still so after the measurement's rescans.
    assert_eq!(
        get_share(&mut c, id).await.phase,
        pb::Phase::Enforced as i32
    );
    assert_eq!(unprepare_one(&mut c, 0, "unshare").await.code, "");

    // A pod that has the second namespace before its share is enforced: of its two
    // namespaces, the one wired to the host is the sandbox.
    let mut early = Pod::new();
    early.sandbox_mut().unwrap().spawn_in_own_netns();
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for("early", "team-a", early.uid(), &id, "100M"),
    )
    .await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.sandbox.as_ref().unwrap().host_interface, early.host_if());
    assert!(s.reason.contains("1 more network namespace(s)"), "{s:?}");
    assert_eq!(unprepare_one(&mut c, 0, "early").await.code, "");
}

/// A pod with more than one scan of it reads does not lose its limit: a scan that
/// stopped short cannot tell that the sandbox is gone. First a container with more
/// processes than a scan reads, sorted before the sandbox's and in a network namespace
/// of its own: every container's first processes are read before one's many, so the
/// sandbox is still found. Then more containers than a scan reads, all sorted before
/// the sandbox's, so that it is not read at all: the share stays ENFORCED on the
/// sandbox it was enforced on, whose veth is still there, and says so.
#[tokio::test]
async fn a_pod_with_more_than_a_scan_reads_keeps_its_limit() {
    if !net::privileged("a_pod_with_more_than_a_scan_reads_keeps_its_limit") {
        return;
    }
    let pins = PinDir::new();
    let (_a, mut c, mut pod, id) = enforced_with_fast_rescans(&pins, "crowd").await;

    // More than the 4,096 processes a scan reads; the next rescans see their namespace.
    pod.sandbox_mut().unwrap().spawn_crowd(4200);
    let s = wait_reason(&mut c, &id, "1 more network namespace(s)").await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.sandbox.as_ref().unwrap().host_interface, pod.host_if());

    // More than the 256 cgroups a scan reads, before the sandbox's.
    pod.sandbox_mut().unwrap().add_empty_containers(300);
    let s = wait_reason(&mut c, &id, "more than one scan reads").await;
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.sandbox.as_ref().unwrap().host_interface, pod.host_if());
    assert_eq!(s.limits[0].enforced, "100M", "{s:?}");
    let classes = net::sh(&["tc", "class", "show", "dev", pod.host_if()]);
    assert!(classes.contains("rate 100Mbit"), "{classes}");
    assert_eq!(unprepare_one(&mut c, 0, "crowd").await.code, "");
}

/// Share `id` once its reason says `note`; fails if it goes PENDING first (its limit
/// removed) or no rescan says so within 30 s.
async fn wait_reason(c: &mut Client, id: &str, note: &str) -> pb::ShareStatus {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let s = get_share(c, id.to_owned()).await;
        assert_ne!(
            s.phase,
            pb::Phase::Pending as i32,
            "a scan that stopped short was taken for a gone sandbox: {s:?}"
        );
        if s.reason.contains(note) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no rescan said {note:?}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pod whose interface is not a veth (netkit, macvlan, ipvlan, SR-IOV: here an ifb
/// named eth0 in the pod's namespace) has no host side to limit: its share waits with
/// the reason, and nothing is installed anywhere.
#[tokio::test]
async fn a_pod_whose_interface_is_not_a_veth_waits_and_nothing_is_touched() {
    if !net::privileged("a_pod_whose_interface_is_not_a_veth_waits_and_nothing_is_touched") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let ns = net::Netns::new();
    // Unique as the namespace's own name (sgt-<pid>-<n>) is.
    let n = ns.name().rsplit('-').next().unwrap();
    let ifb = format!("sgn{}_{n}", std::process::id());
    net::sh(&["ip", "link", "add", &ifb, "type", "ifb"]);
    // Deleted with the namespace from here on.
    net::sh(&["ip", "link", "set", &ifb, "netns", ns.name()]);
    ns.sh(&["ip", "link", "set", &ifb, "name", "eth0"]);
    ns.sh(&["ip", "link", "set", "eth0", "up"]);
    let sb = Sandbox::start(&pod_uid(), Layout::Cgroupfs, Some(ns.name()));
    let id = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for("notveth", "team-a", sb.uid(), &id, "100M"),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Pending as i32, "{s:?}");
    assert!(
        s.reason.contains("interface eth0 has no host-side veth"),
        "{s:?}"
    );
    assert!(s.limits[0].enforced.is_empty(), "{s:?}");
    nothing_left(&a, &pins, &id);
    let qdiscs = ns.sh(&["tc", "qdisc", "show", "dev", "eth0"]);
    assert!(!qdiscs.contains("htb"), "{qdiscs}");
    assert_eq!(unprepare_one(&mut c, 0, "notveth").await.code, "");
    drop(sb);
}

/// kubelet prepares a shared claim again as each pod that uses it starts, naming the
/// claim's reserved pods as they are then. The share follows them: a repeated Prepare
/// naming a new pod enforces on it (not only on the pod of the first Prepare), and one
/// naming two live pods says the share is not enforced per pod, never ENFORCED on one
/// while the other runs unlimited.
#[tokio::test]
async fn a_repeated_prepare_follows_the_claims_pods() {
    if !net::privileged("a_repeated_prepare_follows_the_claims_pods") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let (p1, p2) = (Pod::new(), Pod::new());
    let id = share_id();
    let first = claim_for("moving", "team-a", p1.uid(), &id, "100M");
    let r = prepare_one(&mut c, 0, first.clone()).await;
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");

    // Both pods reserved now, both running: one limit on both.
    let mut both = first.clone();
    both.target
        .as_mut()
        .unwrap()
        .pod_uids
        .push(p2.uid().to_owned());
    let r = prepare_one(&mut c, 0, both).await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.more_sandboxes.len(), 1, "{s:?}");
    assert_eq!(s.pod_uids, vec![p1.uid().to_owned(), p2.uid().to_owned()]);

    // The first pod is done and no longer reserved: the share is enforced on the second.
    drop(p1);
    let second = claim_for("moving", "team-a", p2.uid(), &id, "100M");
    let r = prepare_one(&mut c, 0, second).await;
    let s = &r.shares[0];
    assert_eq!(s.phase, pb::Phase::Enforced as i32, "{s:?}");
    assert_eq!(s.sandbox.as_ref().unwrap().host_interface, p2.host_if());
    assert_eq!(s.pod_uids, vec![p2.uid().to_owned()]);
    // Persisted: the same after a restart.
    let mut a = a;
    a.restart();
    let mut c = a.client().await;
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.pod_uids, vec![p2.uid().to_owned()], "{s:?}");
    // A pod named by another namespace's live claim is refused here too.
    let other = Pod::new();
    let id2 = share_id();
    let r = prepare_one(
        &mut c,
        0,
        claim_for("theirs", "team-b", other.uid(), &id2, "10M"),
    )
    .await;
    assert_eq!(r.error, None, "{r:?}");
    let mut steal = claim_for("moving", "team-a", p2.uid(), &id, "100M");
    steal
        .target
        .as_mut()
        .unwrap()
        .pod_uids
        .push(other.uid().to_owned());
    let r = prepare_one(&mut c, 0, steal).await;
    let e = r
        .error
        .expect("a repeated Prepare named another namespace's pod");
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("PermissionDenied", "claims[0].target.pod_uids[1]"),
        "{e:?}"
    );
    let s = get_share(&mut c, id.clone()).await;
    assert_eq!(s.pod_uids, vec![p2.uid().to_owned()], "unchanged: {s:?}");
    assert_eq!(unprepare_one(&mut c, 0, "moving").await.code, "");
    assert_eq!(unprepare_one(&mut c, 0, "theirs").await.code, "");
}

/// Targets are verified, never trusted: a pod uid already named by another namespace's
/// live claim is refused, a cgroup hint outside the pod is refused, and an interface hint
/// is only ever a name inside the pod's namespace (never a host interface).
#[tokio::test]
async fn targets_are_verified_never_trusted() {
    if !net::privileged("targets_are_verified_never_trusted") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let victim = Pod::new();
    let attacker = Pod::new();
    let id = share_id();
    assert_eq!(
        prepare_one(
            &mut c,
            0,
            claim_for("v", "team-a", victim.uid(), &id, "100M")
        )
        .await
        .error,
        None
    );
    wait_phase(&mut c, &id, pb::Phase::Enforced).await;

    // Another namespace's claim for the victim's pod.
    let r = prepare_one(
        &mut c,
        0,
        claim_for("x", "team-b", victim.uid(), &share_id(), "10M"),
    )
    .await;
    let e = r.error.unwrap();
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("PermissionDenied", "claims[0].target.pod_uids[0]"),
        "{e:?}"
    );

    // A cgroup hint that is the other pod's cgroup.
    let mut cl = claim_for("y", "team-a", attacker.uid(), &share_id(), "10M");
    cl.target.as_mut().unwrap().cgroup_paths = vec![victim.sandbox().unwrap().pod_cgroup()];
    let e = prepare_one(&mut c, 0, cl).await.error.unwrap();
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("PermissionDenied", "claims[0].target.cgroup_paths[0]"),
        "{e:?}"
    );

    // An interface hint naming a host interface (the victim's host veth) is looked up
    // inside the attacker pod's namespace, where there is no such thing.
    let before = net::sh(&["tc", "qdisc", "show", "dev", victim.host_if()]);
    let zid = share_id();
    let mut cl = claim_for("z", "team-a", attacker.uid(), &zid, "10M");
    cl.target.as_mut().unwrap().interface = victim.host_if().to_owned();
    assert_eq!(prepare_one(&mut c, 0, cl).await.error, None);
    let s = get_share(&mut c, zid.clone()).await;
    assert_eq!(s.phase, pb::Phase::Pending as i32, "{s:?}");
    assert!(s.reason.contains(victim.host_if()), "{s:?}");
    assert_eq!(
        net::sh(&["tc", "qdisc", "show", "dev", victim.host_if()]),
        before
    );
    let v = get_share(&mut c, id.clone()).await;
    assert_eq!(
        v.limits[0].enforced, "100M",
        "the victim's share is untouched"
    );
}

/// A pod veth at an ifindex far past the counters' array: enforced and counted (the
/// counter slot is allocated, not the ifindex).
#[tokio::test]
async fn a_veth_at_a_high_ifindex_is_enforced_and_counted() {
    if !net::privileged("a_veth_at_a_high_ifindex_is_enforced_and_counted") {
        return;
    }
    let pins = PinDir::new();
    let a = start(&pins);
    let mut c = a.client().await;
    let uid = pod_uid();
    let pod = Pod::with_host_index(&uid, 20_000 + std::process::id() % 5_000, Layout::Systemd);
    assert!(pod.host_ifindex() >= 20_000);
    let id = share_id();
    let r = prepare_one(&mut c, 0, claim_for("hi", "team-a", &uid, &id, "100M")).await;
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.shares[0].phase, pb::Phase::Enforced as i32, "{r:?}");
    {
        let server = pod.iperf_server();
        let _lock = TrafficLock::acquire();
        server.measure(&Iperf::new(Direction::ToPod));
    }
    a.wait_metric(
        "shareguard_share_traffic_bytes_total",
        &[("share", &id), ("direction", "to_pod")],
        |b| b > 1e6,
    );
    assert_eq!(unprepare_one(&mut c, 0, "hi").await.code, "");
    nothing_left(&a, &pins, &id);
}

/// A client that gives up in the middle of a Prepare (its deadline passes, so tonic drops
/// the handler): the work it started still runs to a consistent end. Every share of the
/// request ends ENFORCED without another call; the repeat changes nothing; Unprepare
/// leaves no qdisc, ifb or pin.
#[tokio::test]
async fn a_cancelled_prepare_runs_to_a_consistent_end() {
    if !net::privileged("a_cancelled_prepare_runs_to_a_consistent_end") {
        return;
    }
    const N: usize = 6;
    let pins = PinDir::new();
    let a = start(&pins);
    let pods: Vec<Pod> = (0..N).map(|_| Pod::new()).collect();
    let ids: Vec<String> = (0..N).map(|_| share_id()).collect();
    let claims: Vec<pb::ClaimPrepare> = pods
        .iter()
        .zip(&ids)
        .enumerate()
        .map(|(i, (p, id))| claim_for(&format!("cx-{i}"), "team-a", p.uid(), id, "50M"))
        .collect();
    let mut c = a.client().await;
    let mut req = tonic::Request::new(pb::PrepareRequest {
        epoch: 0,
        claims: claims.clone(),
    });
    // Enforcing six shares takes several times this (tc, netlink, BPF per share).
    req.set_timeout(Duration::from_millis(60));
    let r = c.prepare(req).await;
    let code = r.err().map(|e| e.code());
    assert!(
        matches!(
            code,
            Some(tonic::Code::DeadlineExceeded | tonic::Code::Cancelled)
        ),
        "the call must be cut short for this test to mean anything: {code:?}"
    );
    let mut c: Client = a.client().await;
    for id in &ids {
        wait_phase(&mut c, id, pb::Phase::Enforced).await;
    }
    let r = c
        .prepare(pb::PrepareRequest { epoch: 0, claims })
        .await
        .unwrap()
        .into_inner();
    for (i, id) in ids.iter().enumerate() {
        let cr = &r.claims[&format!("cx-{i}")];
        assert_eq!(cr.error, None, "{cr:?}");
        assert_eq!(cr.shares[0].share_id, *id);
        assert_eq!(cr.shares[0].phase, pb::Phase::Enforced as i32);
    }
    let links = fs::read_dir(pins.0.join("net/links")).unwrap().count();
    assert_eq!(
        links,
        3 * N,
        "per share one pinned link per direction and one on its return device, never two"
    );
    for i in 0..N {
        assert_eq!(unprepare_one(&mut c, 0, &format!("cx-{i}")).await.code, "");
    }
    for (p, id) in pods.iter().zip(&ids) {
        nothing_left(&a, &pins, id);
        let q = net::sh(&["tc", "qdisc", "show", "dev", p.host_if()]);
        assert!(!q.contains("htb"), "{q}");
    }
    assert!(
        fs::read_dir(pins.0.join("net/links"))
            .unwrap()
            .next()
            .is_none()
    );
}
