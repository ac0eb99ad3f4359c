//! `shareguard agent`: opens the store, re-verifies live shares, then serves gRPC on the
//! unix socket and metrics over HTTP until SIGTERM or SIGINT.

use std::{
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use shareguard_proto::v1::{FILE_DESCRIPTOR_SET, node_agent_server::NodeAgentServer};
use tokio::{net::UnixListener, signal::unix::SignalKind};
use tracing::{info, warn};

use crate::{
    api::{grpc::Api, http, metrics::Metrics},
    config::Config,
    config::node::{NodeNameSources, pool_belongs_to},
    engine::{Engine, now_ms},
};

const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";
/// How often a failed store is tried again.
const STORE_RETRY: Duration = Duration::from_secs(1);

fn boot_id() -> anyhow::Result<String> {
    let id =
        std::fs::read_to_string(BOOT_ID_PATH).with_context(|| format!("reading {BOOT_ID_PATH}"))?;
    Ok(id.trim().to_owned())
}

/// Binds the API socket with mode 0600, or 0660 and group `group`. A socket file left by
/// a dead agent is replaced; one that still answers belongs to a running agent, and
/// starting a second one on the same store would break every invariant, so that is
/// refused. The socket's directory is its own when the agent makes it or it holds
/// nothing but sockets (a hostPath `DirectoryOrCreate` makes it 0755 before the agent
/// starts): 0700, or 0750 and the group's, so that only the socket's callers can even
/// see it. A directory that holds other files is shared and left as it is, said in the
/// log.
fn bind_socket(path: &Path, group: Option<u32>) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        if holds_only_sockets(dir)? {
            restrict(dir, group, 0o700, 0o750)?;
        } else {
            warn!(
                dir = %dir.display(),
                "the socket's directory holds other files: its owner and mode are left as they are; give the socket a directory of its own"
            );
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                bail!(
                    "{}: another agent is serving on this socket",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing stale {}", path.display()))?;
        }
        Ok(_) => bail!("{}: exists and is not a socket", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("inspecting {}", path.display())),
    }
    let l = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    // Peer credentials decide what a caller may do; the mode decides who may connect at
    // all: root alone, or root and the socket's group.
    restrict(path, group, 0o600, 0o660)?;
    Ok(l)
}

/// Whether every entry of `dir` is a socket (none at all included).
fn holds_only_sockets(dir: &Path) -> anyhow::Result<bool> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry.with_context(|| format!("reading {}", dir.display()))?;
        let kind = entry
            .file_type()
            .with_context(|| format!("inspecting {}", entry.path().display()))?;
        if !kind.is_socket() {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Gives `path` mode `alone` (root's), or with a group: owner 0:`group` and mode
/// `shared`.
fn restrict(path: &Path, group: Option<u32>, alone: u32, shared: u32) -> anyhow::Result<()> {
    let mode = match group {
        None => alone,
        Some(gid) => {
            // The group alone: as the file's owner the agent may give it any group it
            // is itself a member of, with no CAP_CHOWN (which it does not hold).
            std::os::unix::fs::chown(path, None, Some(gid)).with_context(|| {
                format!(
                    "chgrp {gid} {}: the agent must be in socket_group {gid} itself (the pod's supplementalGroups, the unit's SupplementaryGroups=)",
                    path.display()
                )
            })?;
            shared
        }
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

/// The node and each device's pool, once at start. A pool that is not the node's own
/// is served (outside Kubernetes the pool is only a name), but said loudly: the
/// admission policy of deploy/admission.yaml refuses its ResourceSlice, and if another
/// node had it too the scheduler would count both nodes' capacity as one.
fn log_pools(cfg: &Config) {
    let node = cfg.agent.node_name.as_deref();
    info!(node = node.unwrap_or("(unknown)"), "node name");
    for d in &cfg.devices {
        let own = node.is_some_and(|n| pool_belongs_to(&d.pool, n));
        if own {
            info!(device = %d.name, driver = %d.driver, pool = %d.pool, "device");
        } else {
            warn!(
                device = %d.name,
                driver = %d.driver,
                pool = %d.pool,
                node = node.unwrap_or("(unknown)"),
                "the device's pool is neither the node's name nor below it (\"<node>/...\"): its ResourceSlice is refused by the admission policy, and a pool another node also has is counted as one"
            );
        }
        for w in crate::config::warnings::device_warnings(d) {
            warn!(device = %d.name, "{w}");
        }
    }
}

/// How long a stop waits for calls in flight once the socket stopped accepting.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot watch SIGTERM; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT: shutting down"),
    }
}

/// Where the agent's node name comes from when `[agent] node_name` does not give it:
/// `node_name` (`--node-name` or `NODE_NAME`), else the host name.
pub async fn run(config_path: &Path, node_name: Option<String>) -> anyhow::Result<()> {
    let started = Instant::now();
    // Read once: the digest audited for a changed config (`Engine::note_config`) is of
    // the very text the agent runs with.
    let text = Config::read(config_path)?;
    let config_digest = crate::audit::chain::hex(&crate::audit::chain::hash(text.as_bytes()));
    let mut cfg = Config::parse_for(
        &text,
        &config_path.display().to_string(),
        &NodeNameSources::this_host(node_name),
    )?;
    log_pools(&cfg);
    std::fs::create_dir_all(&cfg.agent.state_dir)
        .with_context(|| format!("creating state_dir {}", cfg.agent.state_dir.display()))?;
    std::fs::set_permissions(&cfg.agent.state_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 0700 {}", cfg.agent.state_dir.display()))?;
    // Before anything of the node is touched: a second agent stops here.
    let state_dir = cfg.agent.state_dir.clone();
    let _node_lock = tokio::task::spawn_blocking(move || {
        crate::agent_lock::AgentLock::acquire(&state_dir, crate::agent_lock::PATIENCE)
    })
    .await??;
    let boot = boot_id()?;
    let metrics = Arc::new(Metrics::new());
    let observer: Arc<dyn crate::engine::Observer> = metrics.clone();
    let path = config_path.to_path_buf();
    let (engine, cfg, gpu_watches) = tokio::task::spawn_blocking(move || {
        // The limiters complete the config (GPU memory discovered from the GPU) before
        // the ledger is built from it.
        let limiters = crate::limiters::for_config(&mut cfg)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let cfg = Arc::new(cfg);
        let engine = Engine::open(cfg.clone(), limiters.by_device, &boot, observer)?;
        engine
            .note_config(config_digest)
            .context("recording the config in the store")?;
        anyhow::Ok((engine, cfg, limiters.gpu_watches))
    })
    .await??;
    let engine = Arc::new(engine);
    for w in gpu_watches {
        crate::gpu_watch::spawn(engine.clone(), w);
    }

    let ready = Arc::new(AtomicBool::new(false));
    let http_listener = tokio::net::TcpListener::bind(cfg.agent.metrics_addr)
        .await
        .with_context(|| format!("binding metrics_addr {}", cfg.agent.metrics_addr))?;
    let metrics_addr = http_listener.local_addr()?;
    let app = http::router(engine.clone(), metrics, ready.clone());
    if let Some(tls) = &cfg.agent.metrics_tls
        && let Err(e) = crate::api::metrics::tls::server_config(tls)
    {
        // Not fatal: the files may come later (a Secret not yet made); until then each
        // connection to the metrics listener is refused, and says why in the log.
        warn!(error = %e, "metrics_tls cannot be loaded yet");
    }
    tokio::spawn(http::serve(
        http_listener,
        app,
        cfg.agent.metrics_tls.clone(),
    ));
    let mut health_addr = "-".to_owned();
    if let Some(addr) = cfg.agent.health_addr {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding health_addr {addr}"))?;
        health_addr = l.local_addr()?.to_string();
        tokio::spawn(http::serve_health(
            l,
            http::health_router(engine.clone(), ready.clone()),
        ));
    }

    let sweeper = engine.clone();
    let period =
        (cfg.agent.tombstone_retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            match sweeper.sweep_tombstones(now_ms()).await {
                Ok(0) => {}
                Ok(n) => info!(removed = n, "expired tombstones removed"),
                Err(e) => warn!(error = %e, "tombstone sweep failed"),
            }
        }
    });

    // A failed store (full or read-only disk) is reopened once it can be written again;
    // until then the agent stays up, refuses changes as retryable, and /readyz says why.
    let storage = engine.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(STORE_RETRY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = String::new();
        loop {
            tick.tick().await;
            if storage.store_problem().is_none() {
                continue;
            }
            let e = storage.clone();
            match tokio::task::spawn_blocking(move || e.reopen_store()).await {
                Ok(Ok(_)) => last.clear(),
                Ok(Err(err)) => {
                    let msg = err.to_string();
                    if msg != last {
                        warn!(error = %msg, "the state store cannot be reopened yet; retrying");
                        last = msg;
                    }
                }
                Err(err) => warn!(error = %err, "reopening the state store panicked"),
            }
        }
    });

    // Traffic counters for /metrics, read off the async workers and off the scrape path.
    let counting = engine.clone();
    let period = cfg.agent.counters_period;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            counting.refresh_counters().await;
        }
    });

    // Pod discovery: a pass at once (shares left waiting, or whose sandbox changed while
    // the agent was away), then on every kernel event and every rescan period.
    tokio::spawn(engine.clone().discovery_loop(cfg.agent.rescan_period));

    // The SLO windows, saved for the next start (crate::slo::persist); once more at
    // the stop below.
    let saver = engine.clone();
    let period = cfg.slo.save_period;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = saver.save_slo().wait().await {
                warn!(error = %e, "SLO windows not saved; the next save tries again");
            }
        }
    });

    let reconciler = engine.clone();
    let period = cfg.agent.reconcile_period;
    tokio::spawn(async move {
        // The first pass one period after start: the start itself just verified
        // every share (recover).
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let s = reconciler.reconcile().await;
            if s.drifted > 0 || s.repaired > 0 {
                info!(
                    checked = s.checked,
                    drifted = s.drifted,
                    repaired = s.repaired,
                    "reconciled"
                );
            }
        }
    });

    let listener = bind_socket(&cfg.agent.socket, cfg.agent.socket_group)?;
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<NodeAgentServer<Api>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
        .build_v1()?;

    ready.store(true, Ordering::Release);
    info!(
        socket = %cfg.agent.socket.display(),
        metrics = %metrics_addr,
        health = %health_addr,
        shares = engine.phase_counts().values().sum::<u64>(),
        epoch = engine.epoch(),
        startup_ms = started.elapsed().as_millis() as u64,
        "ready"
    );
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection)
        .add_service(NodeAgentServer::new(Api::new(engine.clone())))
        // Normalised connections: clients that send the socket path as the HTTP/2
        // authority (grpc C-core, grpc-java, kubelet) are answered too (shareguard-uds).
        .serve_with_incoming_shutdown(shareguard_uds::incoming(listener), async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => r?,
        () = shutdown_signal() => {
            // A graceful stop waits for every connection to close, and the kubelet
            // plugin keeps a WatchShares stream open for good: without a bound the
            // agent would wait for the SIGKILL at the end of the pod's grace period,
            // and an update of the DaemonSet would take that long on every node.
            // Unary calls finish in milliseconds; one cut short ends as at a crash
            // (nothing is acknowledged before it is durable) and its client calls
            // again (every call is idempotent).
            let _ = stop_tx.send(());
            match tokio::time::timeout(STOP_GRACE, &mut server).await {
                Ok(r) => r?,
                Err(_) => info!(grace = ?STOP_GRACE, "streams still open; closing them"),
            }
        }
    }
    ready.store(false, Ordering::Release);
    // Bounded: a disk that hangs must not keep the pod from stopping, and the windows
    // are worth less than a prompt stop.
    match tokio::time::timeout(STOP_GRACE, engine.save_slo().wait()).await {
        Ok(Ok(())) => info!("SLO windows saved"),
        Ok(Err(e)) => warn!(error = %e, "SLO windows not saved at stop"),
        Err(_) => {
            warn!(grace = ?STOP_GRACE, "SLO windows not saved at stop: the store did not answer in time")
        }
    }
    let _ = std::fs::remove_file(&cfg.agent.socket);
    info!("stopped");
    Ok(())
}
