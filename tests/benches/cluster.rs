//! Pod start on the real test cluster, with and without a share (docs/benchmarks.md,
//! "On the test cluster"). A benchmark, not a test: it prints figures and asserts
//! nothing about speed. Run it with `tests/cluster/bench.sh` (a fresh cluster, this,
//! the cluster removed), or against a cluster of `make cluster-up` with SGC_KUBECONFIG
//! and SGC_KUBECTL set, as root:
//!
//! ```sh
//! cargo bench -p shareguard-tests --bench cluster
//! ```
//!
//! One pod at a time, alternating between the two nodes, `SGC_BENCH_PODS` (20) of each
//! kind: the baseline pods have no claim; the share pods each take 100M of their node's
//! NIC from a claim template. For each pod: created (kubectl apply returned) to Running
//! as kubectl sees it, polled every 50 ms; for share pods also created to the claim's
//! `Enforced` condition True, and the agent's ENFORCED (the share's `updatedAt`) to the
//! moment the condition was seen, and to the moment the API server received the status
//! apply that carried it (its audit log's `requestReceivedTimestamp`: no polling in
//! it). Then kubelet's own DRA operation durations from each
//! node's metrics. From the API server's audit log (`SGC_AUDIT_LOG`, which bench.sh
//! sets): everything the plugins ask for while nothing changes and the share pods run,
//! over `SGC_BENCH_REST_SECS` (600: long enough for watch renewals and the periodic
//! slice LIST), and the requests about the share pods' claims, per claim.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant, SystemTime},
};

use shareguard_tests::{
    audit::{AuditLog, by_kind},
    cluster::{Cluster, NODES, TOOLS_IMAGE, driver_entry, field, is_enforced},
};

const POLL: Duration = Duration::from_millis(50);
const TIMEOUT: Duration = Duration::from_secs(120);

fn pod_yaml(ns: &str, name: &str, node: &str, claim: bool) -> String {
    let (claims, uses, template) = if claim {
        (
            format!("  resourceClaims:\n  - name: net\n    resourceClaimTemplateName: {name}\n"),
            "    resources:\n      claims:\n      - name: net\n",
            format!(
                "apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  spec:\n    devices:\n      requests:\n      - name: net\n        exactly:\n          deviceClassName: shareguard-net-bandwidth\n          capacity:\n            requests: {{bandwidth: 100M}}\n---\n"
            ),
        )
    } else {
        (String::new(), "", String::new())
    };
    format!(
        "{template}apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  nodeSelector: {{kubernetes.io/hostname: {node}}}\n  terminationGracePeriodSeconds: 1\n{claims}  containers:\n  - name: tools\n    image: {TOOLS_IMAGE}\n    imagePullPolicy: Never\n    command: [sleep, \"86400\"]\n{uses}"
    )
}

/// Polls `f` until it gives Some, returning that and the time since `start`.
fn until<T>(what: &str, start: Instant, mut f: impl FnMut() -> Option<T>) -> (T, Duration) {
    loop {
        if let Some(v) = f() {
            return (v, start.elapsed());
        }
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(POLL);
    }
}

fn running(c: &Cluster, ns: &str, pod: &str) -> Option<()> {
    let p = c.get(&["pod", "-n", ns, pod])?;
    (field(&p, "status.phase") == "Running").then_some(())
}

/// RFC 3339 with milliseconds, as the agent writes `updatedAt`, to a SystemTime.
fn parse_time(s: &str) -> Option<SystemTime> {
    // 2026-12-02T16:33:34.900+00:00
    let (date, rest) = s.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let time = rest.get(..12)?;
    let (h, mi, sec) = (
        time.get(0..2)?.parse::<i64>().ok()?,
        time.get(3..5)?.parse::<i64>().ok()?,
        time.get(6..12)?.parse::<f64>().ok()?,
    );
    if !rest.ends_with("+00:00") && !rest.ends_with('Z') {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + h * 3600 + mi * 60;
    let ms = u64::try_from(secs).ok()? * 1000 + (sec * 1000.0).round() as u64;
    Some(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    // Nearest rank.
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn row(name: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "| {name} | {} | {:.2} | {:.2} | {:.2} |",
        v.len(),
        quantile(&v, 0.5).as_secs_f64(),
        quantile(&v, 0.99).as_secs_f64(),
        v.last().copied().unwrap_or_default().as_secs_f64()
    );
}

fn main() {
    if std::env::var_os("SGC_KUBECONFIG").is_none() {
        eprintln!(
            "SKIP cluster bench: no test cluster (run tests/cluster/bench.sh, or set SGC_KUBECONFIG and SGC_KUBECTL)"
        );
        return;
    }
    let c = Cluster::from_env();
    let n: usize = std::env::var("SGC_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    // kubelet's counters run from its start: the bench's own operations are the
    // difference from here.
    let before: Vec<Vec<(String, f64, f64)>> =
        NODES.iter().map(|n| c.kubelet_dra_operations(n)).collect();
    let audit = std::env::var_os("SGC_AUDIT_LOG").map(|_| AuditLog::from_env());
    let mark = audit.as_ref().map(AuditLog::mark);
    let ns = c.namespace("bench-pods");
    let bench_ns = ns.name.clone();
    let mut baseline = Vec::new();
    let mut share_running = Vec::new();
    let mut share_enforced = Vec::new();
    let mut convergence = Vec::new();
    let mut applied_lag = Vec::new();
    for i in 0..n {
        for claim in [false, true] {
            let node = NODES[i % NODES.len()];
            let name = format!("{}-{i}", if claim { "share" } else { "plain" });
            let start = Instant::now();
            if claim {
                // The template first, so that the pod's own time starts with the pod.
                let doc = pod_yaml(&ns.name, &name, node, true);
                let (template, pod) = doc.split_once("---\n").unwrap_or_default();
                c.apply(template);
                let start = Instant::now();
                c.apply(pod);
                let ((), t) = until("Running", start, || running(&c, &ns.name, &name));
                share_running.push(t);
                let ((share, seen), t) =
                    until("Enforced", start, || enforced_of(&c, &ns.name, &name));
                share_enforced.push(t);
                let at = c.agent_cli(node, &["share", &share]);
                if let Some(agent_at) = at["updatedAt"].as_str().and_then(parse_time) {
                    convergence.push(seen.duration_since(agent_at).unwrap_or_default());
                    if let (Some(audit), Some(mark)) = (&audit, mark)
                        && let Some(received) = enforced_apply(audit, mark, &ns.name, &share)
                    {
                        applied_lag.push(received.duration_since(agent_at).unwrap_or_default());
                    }
                }
            } else {
                c.apply(&pod_yaml(&ns.name, &name, node, false));
                let ((), t) = until("Running", start, || running(&c, &ns.name, &name));
                baseline.push(t);
            }
        }
    }
    println!("| pods, one at a time | n | p50 s | p99 s | max s |");
    println!("|---|---:|---:|---:|---:|");
    row("no claim: created -> Running", baseline);
    row("100M share: created -> Running", share_running);
    row(
        "100M share: created -> Enforced in the claim",
        share_enforced,
    );
    row("agent ENFORCED -> condition seen in the API", convergence);
    if !applied_lag.is_empty() {
        row(
            "agent ENFORCED -> its status apply received by the API server",
            applied_lag,
        );
    }
    // At rest with the share pods running: what a node's plugin asks while its shares
    // hold and nothing changes.
    let idle = audit.as_ref().map(|a| at_rest(a, n));
    // kubelet unprepares a pod's claims once its containers stopped: the namespace's
    // deletion (which waits until the pods are gone) comes first, so that the kubelet
    // figures count UnprepareResources too.
    drop(ns);
    println!();
    println!("| node | kubelet DRA operation | count | mean ms |");
    println!("|---|---|---:|---:|");
    for (node, before) in NODES.iter().zip(&before) {
        for (op, count, sum) in c.kubelet_dra_operations(node) {
            let (c0, s0) = before
                .iter()
                .find(|(o, _, _)| *o == op)
                .map_or((0.0, 0.0), |(_, c, s)| (*c, *s));
            let (count, sum) = (count - c0, sum - s0);
            let mean = if count > 0.0 {
                sum / count * 1000.0
            } else {
                0.0
            };
            println!("| {node} | {op} | {count} | {mean:.1} |");
        }
    }
    if let (Some(audit), Some(mark), Some(idle)) = (audit, mark, idle) {
        per_claim(&audit, mark, &bench_ns, n, &idle);
    }
}

/// Every request of the plugins over `SGC_BENCH_REST_SECS` while nothing changes and
/// the bench's `claims` share pods run, by node; their audit IDs.
fn at_rest(audit: &AuditLog, claims: usize) -> BTreeSet<String> {
    let secs: u64 = std::env::var("SGC_BENCH_REST_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let rest = audit.mark();
    // A window of time is what is measured here: requests per minute at rest.
    std::thread::sleep(Duration::from_secs(secs));
    let idle = audit.since(rest);
    println!();
    println!(
        "| at rest for {secs} s, {claims} share pods running: node | request | count | per minute |"
    );
    println!("|---|---|---:|---:|");
    for node in NODES {
        let of_node = by_kind(idle.iter().filter(|r| r.node == node));
        let all: usize = of_node.values().sum();
        for (kind, count) in of_node {
            println!(
                "| {node} | {kind} | {count} | {:.2} |",
                count as f64 * 60.0 / secs as f64
            );
        }
        println!(
            "| {node} | all | {all} | {:.2} |",
            all as f64 * 60.0 / secs as f64
        );
    }
    idle.into_iter().map(|r| r.audit_id).collect()
}

/// The plugins' API requests about the bench's claims (in namespace `ns`, `claims` of
/// them) since `mark`, from their pods' creation to their release, leaving out those
/// of the window at rest (`idle`).
fn per_claim(audit: &AuditLog, mark: u64, ns: &str, claims: usize, idle: &BTreeSet<String>) {
    let about: Vec<_> = audit
        .since(mark)
        .into_iter()
        .filter(|r| r.namespace == ns && !idle.contains(&r.audit_id))
        .collect();
    println!();
    println!("| API requests about the {claims} claims, at rest left out | total | per claim |");
    println!("|---|---:|---:|");
    for (kind, count) in by_kind(&about) {
        println!(
            "| {kind} | {count} | {:.2} |",
            count as f64 / claims.max(1) as f64
        );
    }
    let refused = about.iter().filter(|r| r.code >= 400).count();
    println!(
        "| all | {} | {:.2} |",
        about.len(),
        about.len() as f64 / claims.max(1) as f64
    );
    println!("| of which refused (4xx) | {refused} | |");
}

/// The Enforced entry of the claim made for pod `pod` (its claims are named after it).
/// When the API server received the first status apply in namespace `ns` that set
/// `share`'s Enforced condition True (the audit log logs claim status bodies).
fn enforced_apply(audit: &AuditLog, mark: u64, ns: &str, share: &str) -> Option<SystemTime> {
    audit
        .since(mark)
        .into_iter()
        .find(|r| {
            r.kind() == "patch resourceclaims/status"
                && r.namespace == ns
                && field(&r.body, "status.devices")
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|d| d["shareID"] == share && is_enforced(d))
        })
        .and_then(|r| parse_time(&r.received))
}

fn enforced_of(c: &Cluster, ns: &str, pod: &str) -> Option<(String, SystemTime)> {
    let p = c.get(&["pod", "-n", ns, pod])?;
    let claim = field(&p, "status.resourceClaimStatuses")
        .as_array()?
        .first()?
        .get("resourceClaimName")?
        .as_str()?
        .to_string();
    let claim = c.get(&["resourceclaim", "-n", ns, &claim])?;
    let entry = driver_entry(&claim)?;
    is_enforced(entry).then(|| {
        (
            entry["shareID"].as_str().unwrap_or_default().to_string(),
            SystemTime::now(),
        )
    })
}
