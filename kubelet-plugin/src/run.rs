//! The plugin process: wait for the agent, learn its drivers, serve kubelet one
//! registration socket and one DRA socket per driver, and stop cleanly, beside the
//! instance it replaces during a rolling update.

use std::{collections::BTreeSet, future::Future, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use futures::StreamExt;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::{WatchStreamExt, watcher};
use shareguard_proto::kubelet::{
    dra_health_v1::dra_resource_health_server::DraResourceHealthServer as HealthV1Server,
    dra_health_v1alpha1::dra_resource_health_server::DraResourceHealthServer as HealthV1Alpha1Server,
    dra_v1::dra_plugin_server::DraPluginServer as V1Server,
    dra_v1beta1::dra_plugin_server::DraPluginServer as V1Beta1Server,
    pluginregistration::registration_server::RegistrationServer,
};
use tokio::{sync::watch, task::JoinSet};
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::{
    PluginArgs,
    agent::Agent,
    backoff::Backoff,
    claims::SeenClaims,
    cluster::{self, Cluster},
    driver::{Devices, Driver},
    error::PluginError,
    events::Events,
    forward::Successors,
    health::{self, Readiness},
    inventory::{DriverDevices, Inventory},
    kubelet::{HealthV1, HealthV1Alpha1, Registration, RegistrationState, SocketFile, V1, V1Beta1},
    slices::{PublishError, Publisher},
    status::{StatusWriter, Written},
    stop::{stopped, until_stopped},
};

/// How long a stop waits for calls in flight, once the registration sockets are gone.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long a stop waits for kubelet's calls in flight before it gives up its
/// registration: kubelet closes its connection to an instance that unregisters, and the
/// calls on it fail (seen in a rolling update: a Prepare passed on to the successor
/// was cut). Well inside the pod's termination grace of 30 s.
const DRAIN_BEFORE_UNREGISTER: Duration = Duration::from_secs(10);

/// One driver's sockets, each in a directory of the driver's own:
/// `<plugins-dir>/<driver>/dra.sock` and `<registry-dir>/<driver>/reg.sock`, or with
/// `--instance-id` `dra-<id>.sock` and `reg-<id>.sock`, so that two instances never
/// share a file. kubelet's plugin watcher finds registration sockets in the directories
/// below its own, and a directory per driver is what a plugin that is not root can be
/// given (kubelet's own is root's); the driver's name is in the directory, which keeps
/// the path within what a unix socket's address holds.
fn socket_paths(args: &PluginArgs, driver: &str) -> (PathBuf, PathBuf) {
    let part = args
        .instance_id
        .as_deref()
        .map(|id| format!("-{id}"))
        .unwrap_or_default();
    (
        args.plugins_dir
            .join(driver)
            .join(format!("dra{part}.sock")),
        args.registry_dir
            .join(driver)
            .join(format!("reg{part}.sock")),
    )
}

/// Runs until `shutdown` resolves, kubelet refuses a registration, or a server fails.
///
/// The order of the start is what lets a new instance replace a running one with no
/// call refused: its DRA sockets serve first, then it takes the agent's epoch (the old
/// instance, fenced from then on, passes kubelet's calls on to the new sockets), then
/// it registers with kubelet, which calls the newest registered instance.
pub async fn run(args: PluginArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if args.node_name.is_empty() {
        anyhow::bail!("--node-name (or $NODE_NAME): empty; the plugin serves one named node");
    }
    let readiness = Arc::new(Readiness::default());
    if let Some(addr) = args.health_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --health-addr {addr}"))?;
        info!(addr = %listener.local_addr()?, "serving /healthz and /readyz");
        let app = health::router(readiness.clone());
        // Bounded as the agent's health listener is: clients that connect and say
        // nothing, or hold a connection, cannot keep kubelet's probes out for long.
        tokio::spawn(shareguard_common::http::serve_router(
            listener,
            app,
            shareguard_common::http::PROBES,
        ));
    }
    let config = cluster::config(args.kubeconfig.as_deref()).await?;
    let clients = cluster::Clients::new(
        config,
        cluster::Timeouts::default(),
        crate::throttle::ApiLimits {
            qps: args.kube_api_qps,
            burst: args.kube_api_burst,
        },
    )?;
    let cluster = Cluster::new(clients, args.node_name.clone());
    tokio::pin!(shutdown);
    let refused = |e: tonic::Status| PluginError::AgentRefused {
        socket: args.agent_socket.display().to_string(),
        code: e.code(),
        message: e.message().to_owned(),
    };
    let (agent, inventory) = tokio::select! {
        r = Agent::connect(&args.agent_socket) => r.map_err(refused)?,
        () = &mut shutdown => return Ok(()),
    };
    let agent = Arc::new(agent);
    readiness.set_agent(agent.clone());
    let inventory = Inventory::from_agent(&inventory);
    if inventory.drivers.is_empty() {
        return Err(PluginError::NoDrivers.into());
    }
    if !args.drivers.is_empty() && inventory.drivers.keys().any(|d| !args.drivers.contains(d)) {
        return Err(PluginError::ForeignDrivers {
            socket: args.agent_socket.display().to_string(),
            found: inventory.drivers.keys().cloned().collect(),
            expected: args.drivers.clone(),
        }
        .into());
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    // What the drivers' reads of claims found, for Events and the status writer.
    let seen = SeenClaims::default();
    // Events on claims and pods, written by a task of their own (events/mod.rs).
    let (events, events_task) = Events::start(
        cluster.clients().clone(),
        &args.node_name,
        args.enforced_events,
        seen.clone(),
        stop_rx.clone(),
    );
    tokio::spawn(events_task.instrument(info_span!("events")));
    let mut servers = JoinSet::new();
    let mut dra_sockets = Vec::new();
    let mut reg_sockets = Vec::new();
    let mut drivers = Vec::new();
    for (name, devices) in &inventory.drivers {
        check_driver_name(name)?;
        let (dra_path, _) = socket_paths(&args, name);
        let driver = Arc::new(Driver::new(
            name,
            agent.clone(),
            cluster.clone(),
            Devices::new(devices.clone()),
            Successors::new(&dra_path),
            events.clone(),
            seen.clone(),
        ));
        let (dra_listener, dra_socket) = SocketFile::bind(&dra_path)?;
        let dra = tonic::transport::Server::builder()
            .add_service(V1Server::new(V1(driver.clone())))
            .add_service(V1Beta1Server::new(V1Beta1(driver.clone())))
            .add_service(HealthV1Alpha1Server::new(HealthV1Alpha1 {
                agent: agent.clone(),
                driver: driver.clone(),
            }))
            .add_service(HealthV1Server::new(HealthV1 {
                agent: agent.clone(),
                driver: driver.clone(),
            }))
            .serve_with_incoming_shutdown(
                shareguard_uds::incoming(dra_listener),
                stopped(&stop_rx),
            );
        let what = format!("{}", dra_path.display());
        servers.spawn(
            async move {
                dra.await
                    .map_err(|source| PluginError::Serve { what, source })
            }
            .instrument(info_span!("driver", driver = %name)),
        );
        dra_sockets.push(dra_socket);
        drivers.push(driver);
    }

    let epoch = tokio::select! {
        r = agent.take_epoch() => r.map_err(refused)?,
        () = &mut shutdown => return Ok(()),
    };

    let period = Duration::from_secs(args.resync_seconds);
    // One reading of the agent's inventory a period, for every driver's slices and the
    // check of the driver set alike.
    let (inventory_tx, inventory_rx) = watch::channel(Arc::new(inventory.clone()));
    // Background tasks: the inventory poller, ResourceSlices and claim status. Their
    // failures are logged and retried, never a reason to stop serving kubelet.
    let mut background = JoinSet::new();
    background.spawn(
        poll_inventory(
            agent.clone(),
            INVENTORY_PERIOD.min(period),
            inventory_tx,
            stop_rx.clone(),
        )
        .instrument(info_span!("inventory")),
    );
    // Read after the epoch is ours: an instance this one replaced leaves the record
    // alone once it finds this epoch in it (status/written.rs).
    let written = Written::load(
        inventory
            .drivers
            .keys()
            .map(|d| (d.clone(), args.plugins_dir.join(d)))
            .collect(),
        epoch,
    );
    background.spawn(
        StatusWriter::new(
            cluster.clients().clone(),
            agent.clone(),
            inventory.drivers.keys().cloned().collect(),
            events.clone(),
            seen,
            written,
        )
        .run(stop_rx.clone()),
    );
    let mut registrations = Vec::new();
    for driver in &drivers {
        let name = driver.name();
        let (dra_path, reg_path) = socket_paths(&args, name);
        let endpoint = dra_path.to_str().with_context(|| {
            format!("--plugins-dir: {} is not UTF-8", args.plugins_dir.display())
        })?;
        let (reg_listener, reg_socket) = SocketFile::bind(&reg_path)?;
        let (registration, state) = Registration::new(name, endpoint);
        registrations.push((name.to_owned(), state));
        let reg = tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(registration))
            .serve_with_incoming_shutdown(
                shareguard_uds::incoming(reg_listener),
                stopped(&stop_rx),
            );
        let what = format!("{}", reg_path.display());
        servers.spawn(
            async move {
                reg.await
                    .map_err(|source| PluginError::Serve { what, source })
            }
            .instrument(info_span!("driver", driver = %name)),
        );
        background.spawn(
            keep_published(
                driver.clone(),
                agent.clone(),
                cluster.clone(),
                Publishing {
                    period,
                    slots: args.max_slices_per_node,
                    gated: args.binding_conditions,
                },
                inventory_rx.clone(),
                stop_rx.clone(),
            )
            .instrument(info_span!("slices", driver = %name)),
        );
        info!(driver = %name, registration = %reg_path.display(), endpoint = %dra_path.display(), epoch, "serving kubelet");
        reg_sockets.push(reg_socket);
    }
    readiness.set_registrations(registrations.clone());
    if args.binding_conditions {
        let gate = Arc::new(crate::binding::Gate::new(
            cluster.clients().clone(),
            cluster.node(),
            agent.clone(),
            drivers.clone(),
            period,
        ));
        background.spawn(
            gate.run(stop_rx.clone())
                .instrument(info_span!("binding-gate")),
        );
    }

    let registered: BTreeSet<String> = inventory.drivers.keys().cloned().collect();
    let outcome: anyhow::Result<()> = tokio::select! {
        () = &mut shutdown => Ok(()),
        e = drivers_changed(inventory_rx, &registered) => Err(e.into()),
        e = refused_registration(registrations) => Err(e.into()),
        e = fenced_for_good(&agent, drivers.iter().map(|d| d.successors().clone()).collect()) => Err(e.into()),
        Some(r) = servers.join_next() => match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(anyhow::anyhow!("a server task ended: {e}")),
        },
    };
    // The calls in flight finish first: kubelet, once it sees the registration go,
    // closes its connection to this instance and fails what is still on it. New calls
    // go to the newest registered instance, where there is one.
    let drain = async {
        for d in &drivers {
            d.idle().await;
        }
    };
    if tokio::time::timeout(DRAIN_BEFORE_UNREGISTER, drain)
        .await
        .is_err()
    {
        info!(waited = ?DRAIN_BEFORE_UNREGISTER, "calls still in flight; unregistering anyway");
    }
    // Then the registration sockets: kubelet's plugin watcher sees them go and stops
    // calling this instance (a newer one, if any, serves on).
    drop(reg_sockets);
    stop_tx.send_replace(true);
    // A graceful stop waits for clients to close their connections, and kubelet keeps
    // its open until it has dropped the registration: calls in flight get a moment to
    // finish, then the servers are dropped. An interrupted Prepare is safe, since the
    // agent finishes what it started and kubelet calls again.
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        info!(grace = ?SHUTDOWN_GRACE, "connections still open; closing them");
        servers.shutdown().await;
    }
    background.shutdown().await;
    // Removes the DRA socket files (those still ours).
    drop(dra_sockets);
    info!("stopped");
    outcome
}

/// How often a fenced instance checks that an instance that replaced it still serves.
const SUCCESSOR_CHECK: Duration = Duration::from_secs(2);

/// Resolves once this instance is fenced and no other instance serves any of its
/// drivers on this node. While a successor serves (a rolling update: it took the epoch
/// and kubelet is switching to it), this one passes kubelet's calls on to it and waits
/// to be stopped. With none (an epoch taken by something other than a plugin instance,
/// or an agent that lost its store), every call would fail: exiting with the reason
/// lets the DaemonSet start an instance that takes a new epoch.
async fn fenced_for_good(agent: &Agent, successors: Vec<Successors>) -> PluginError {
    agent.fenced().await;
    loop {
        let mut served = false;
        for s in &successors {
            if s.any_live(SUCCESSOR_CHECK).await {
                served = true;
                break;
            }
        }
        if !served {
            return PluginError::Fenced {
                epoch: agent.epoch(),
            };
        }
        tokio::time::sleep(SUCCESSOR_CHECK).await;
    }
}

/// How often the agent's inventory is read: a local call, so that a device's fault
/// reaches its slice (a taint) within seconds. What it changes on the API server is only
/// what changed in a slice.
const INVENTORY_PERIOD: Duration = Duration::from_secs(5);
/// The longest wait before the slice publisher tries again after failures in a row.
const RETRY_AT_MOST: Duration = Duration::from_secs(120);

/// Reads the agent's inventory every `period` and hands each reading to the watchers
/// (a restarted agent may have a new config). A failed reading is skipped: the agent
/// may be restarting, and the last inventory stays in force until the next one.
async fn poll_inventory(
    agent: Arc<Agent>,
    period: Duration,
    readings: watch::Sender<Arc<Inventory>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is immediate, and the caller has just read it.
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = until_stopped(&mut stop) => return,
        }
        match agent.list_devices().await {
            // Every reading goes out, changed or not: the watchers compare.
            Ok(r) => {
                agent.saw_epoch(r.epoch);
                readings.send_replace(Arc::new(Inventory::from_agent(&r)));
            }
            Err(e) => warn!(error = %e, "reading the agent's inventory; keeping the last one"),
        }
    }
}

/// How the slices are published: the resync period, how many slices a node may hold
/// (`--max-slices-per-node`), and whether devices carry binding conditions.
#[derive(Clone, Copy, Debug)]
struct Publishing {
    period: Duration,
    slots: u32,
    gated: bool,
}

/// Publishes the driver's ResourceSlices and keeps them so: a pass runs when the watch
/// of them has listed them (at its start, and when it had to list again: the pass works
/// from that list, with no LIST of its own), when the API server reports a change of one
/// of them that the pass itself did not make (so a slice someone deleted or edited comes
/// back at once), when a reading of the agent's inventory (`inventory`, every
/// [`INVENTORY_PERIOD`]) changed what this driver's slices publish, and every
/// `FULL_PASS_EVERY` periods in case a watch went quiet without an error. A starting
/// plugin thus lists its slices once, where it listed them three times (its first pass,
/// the watch's start, and the pass its own applies' echoes started).
async fn keep_published(
    driver: Arc<Driver>,
    agent: Arc<Agent>,
    cluster: Cluster,
    how: Publishing,
    mut inventory: watch::Receiver<Arc<Inventory>>,
    mut stop: watch::Receiver<bool>,
) {
    const FULL_PASS_EVERY: u32 = 10;
    let Publishing {
        period,
        slots,
        gated,
    } = how;
    // A failure that reaches the publisher (the gate already held off an overloaded
    // API server): retried from 1 s, doubling to 2 minutes, with jitter.
    let mut backoff = Backoff::new(Duration::from_secs(1), RETRY_AT_MOST);
    let publisher = loop {
        match Publisher::new(
            cluster.clients().clone(),
            driver.name(),
            cluster.node(),
            slots,
            gated,
        )
        .await
        {
            Ok(p) => break p,
            Err(e) => {
                let retry = backoff.failed();
                warn!(node = %cluster.node(), error = %e, retry_in = ?retry, "reading the Node for the ResourceSlices' owner");
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = until_stopped(&mut stop) => return,
                }
            }
        }
    };
    backoff.succeeded();
    let mut changes = publisher.watch().default_backoff().boxed();
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ticks = 0u32;
    // The first pass follows the watch's first list; should that list not come within
    // a period (the API server refuses watches), a pass lists for itself.
    let mut due: Option<tokio::time::Instant> = Some(tokio::time::Instant::now() + period);
    // The slices the watch is listing now, and the last complete list while no change
    // came after it: the next pass works from it instead of listing again.
    let mut listing: Option<Vec<ResourceSlice>> = None;
    let mut listed: Option<Vec<ResourceSlice>> = None;
    // Until then, a change of the inventory (its first reading, mostly) waits for the
    // pass that follows the watch's first list, rather than listing for itself.
    let mut watch_listed = false;
    let mut first = true;
    let mut published_for = publisher.digests(&driver.devices_now().devices);
    loop {
        let sleep_until = due.unwrap_or_else(|| tokio::time::Instant::now() + period * 1000);
        tokio::select! {
            ev = changes.next() => match ev {
                Some(Ok(watcher::Event::Init)) => listing = Some(Vec::new()),
                Some(Ok(watcher::Event::InitApply(slice))) => {
                    listing.get_or_insert_with(Vec::new).push(slice);
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    watch_listed = true;
                    listed = Some(listing.take().unwrap_or_default());
                    due = Some(tokio::time::Instant::now());
                }
                // The pass's own writes come back here too: nothing to do for them.
                Some(Ok(ev)) if publisher.is_echo(&ev) => {}
                // A burst of events is one pass, which lists again.
                Some(Ok(_)) => {
                    listed = None;
                    due.get_or_insert_with(|| tokio::time::Instant::now() + DEBOUNCE);
                }
                Some(Err(e)) => debug!(error = %e, "watching ResourceSlices; the watch restarts"),
                None => {
                    changes = publisher.watch().default_backoff().boxed();
                }
            },
            _ = tick.tick() => {
                ticks += 1;
                if ticks.is_multiple_of(FULL_PASS_EVERY) {
                    due.get_or_insert_with(tokio::time::Instant::now);
                }
            }
            Ok(()) = inventory.changed() => {
                let reading = inventory.borrow_and_update().clone();
                if take_devices(&driver, &reading) {
                    // Allocations change with every Prepare and are in no slice: only a
                    // change of what the slices say is worth a pass (and its LIST).
                    let now = publisher.digests(&driver.devices_now().devices);
                    if now != published_for {
                        published_for = now;
                        if watch_listed {
                            due.get_or_insert_with(tokio::time::Instant::now);
                        }
                    }
                }
            }
            () = tokio::time::sleep_until(sleep_until) => {
                due = None;
                // A replaced instance leaves the slices to the one that replaced it.
                if agent.is_fenced() {
                    continue;
                }
                let published = publisher
                    .publish(&driver.devices_now().devices, listed.take())
                    .await;
                if !matches!(published, Err(PublishError::Api(_))) {
                    backoff.succeeded();
                }
                match published {
                    Ok(pass) if first => {
                        first = false;
                        info!(applied = pass.applied.len(), deleted = pass.deleted.len(), "ResourceSlices up to date");
                    }
                    Ok(_) => {}
                    // Published, but not as applied: the slices do not offer what the
                    // agent enforces. Applying again changes nothing, so the check runs
                    // again each period (and on every change), failing loudly each time.
                    Err(e @ PublishError::FieldsDropped(_)) => {
                        error!(error = %e, check_again_in = ?period, "ResourceSlices published without fields the API server dropped");
                        due = Some(tokio::time::Instant::now() + period);
                    }
                    // More pools than slice names: a config to change, not a call to
                    // retry. The deletion of a gone pool's slice, which frees a name, is
                    // a watch event and starts a pass at once.
                    Err(e @ PublishError::Unplaced(_)) => {
                        error!(error = %e, check_again_in = ?period, "pools left unpublished");
                        due = Some(tokio::time::Instant::now() + period);
                    }
                    Err(e) => {
                        let retry = backoff.failed();
                        warn!(error = %e, retry_in = ?retry, "publishing ResourceSlices failed");
                        due = Some(tokio::time::Instant::now() + retry);
                    }
                }
            }
            () = until_stopped(&mut stop) => return,
        }
    }
}

/// Resolves when a reading of the agent's inventory names another set of drivers than
/// `registered`.
async fn drivers_changed(
    mut inventory: watch::Receiver<Arc<Inventory>>,
    registered: &BTreeSet<String>,
) -> PluginError {
    loop {
        if inventory.changed().await.is_err() {
            // The poller stopped, which only happens at shutdown.
            return std::future::pending().await;
        }
        let now: BTreeSet<String> = inventory
            .borrow_and_update()
            .drivers
            .keys()
            .cloned()
            .collect();
        if now != *registered && !now.is_empty() {
            return PluginError::DriversChanged {
                added: now.difference(registered).cloned().collect(),
                removed: registered.difference(&now).cloned().collect(),
            };
        }
    }
}

/// How long a pass waits after a watch event for more of them.
const DEBOUNCE: Duration = Duration::from_millis(200);

/// Takes this driver's devices from an inventory reading; true when they changed (and
/// the driver now serves the new ones).
fn take_devices(driver: &Driver, reading: &Inventory) -> bool {
    let none = DriverDevices::default();
    let fresh = reading.drivers.get(driver.name()).unwrap_or(&none);
    if *fresh == driver.devices_now().devices {
        return false;
    }
    // Allocations change it with every Prepare: not news for the log.
    debug!(
        devices = fresh.devices.len(),
        "the agent's inventory changed"
    );
    driver.set_devices(Devices::new(fresh.clone()));
    true
}

/// Resolves when kubelet refuses any of the registrations.
async fn refused_registration(
    regs: Vec<(String, watch::Receiver<RegistrationState>)>,
) -> PluginError {
    let waits = regs.into_iter().map(|(driver, mut rx)| {
        Box::pin(async move {
            loop {
                if let RegistrationState::Refused(error) = &*rx.borrow_and_update() {
                    return PluginError::RegistrationRefused {
                        driver,
                        error: error.clone(),
                    };
                }
                if rx.changed().await.is_err() {
                    // The registration server is gone; the server's end is reported.
                    std::future::pending::<()>().await;
                }
            }
        })
    });
    futures::future::select_all(waits).await.0
}

/// A driver name becomes a directory and a file name: kubelet's rules (a DNS subdomain of
/// at most 63 characters) keep it one path component.
fn check_driver_name(name: &str) -> Result<(), anyhow::Error> {
    if shareguard_common::slice::is_driver_name(name) {
        Ok(())
    } else {
        anyhow::bail!(
            "driver name {name:?} in the agent's inventory: not a DNS subdomain of at most 63 characters"
        )
    }
}
