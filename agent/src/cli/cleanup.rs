//! `shareguard cleanup [--apply]`: lists, or removes, everything shareguard put on this
//! node (see [`crate::cleanup`]).

use std::{path::PathBuf, process::ExitCode};

use anyhow::{Context, bail};
use clap::Args;

use crate::{cleanup, config};

#[derive(Args, Debug)]
pub struct CleanupArgs {
    /// The agent's config: where its state, pins, CDI specs, MPS daemons, socket and
    /// audit log are, and which drivers it served.
    #[arg(long, default_value = config::DEFAULT_PATH)]
    pub config: PathBuf,
    /// Remove what is listed (without it, nothing is touched).
    #[arg(long)]
    pub apply: bool,
    /// Leave the audit log.
    #[arg(long)]
    pub keep_audit: bool,
    /// The kubelet's directory, for the plugin's socket directories.
    #[arg(long, default_value = cleanup::KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
}

pub async fn run(a: &CleanupArgs, json: bool) -> anyhow::Result<ExitCode> {
    let cfg = config::Config::load(&a.config)
        .with_context(|| format!("reading {}", a.config.display()))?;
    // An agent that answers would put back what this removes (and holds the store).
    let running = answers(&cfg.agent.socket).await;
    if a.apply && running {
        bail!(
            "the agent answers on {}: stop it first (its DaemonSet or systemd unit), or it puts back what cleanup removes",
            cfg.agent.socket.display()
        );
    }
    let items = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        let kubelet_dir = a.kubelet_dir.clone();
        let keep_audit = a.keep_audit;
        move || cleanup::find(&cfg, &kubelet_dir, keep_audit)
    })
    .await??;
    let mut failed = Vec::new();
    if a.apply {
        let cfg2 = cfg.clone();
        let todo = items.clone();
        failed = tokio::task::spawn_blocking(move || {
            todo.iter()
                .filter_map(|i| {
                    cleanup::remove(&cfg2, i)
                        .err()
                        .map(|e| (i.clone(), e.to_string()))
                })
                .collect::<Vec<_>>()
        })
        .await?;
    }
    if json {
        let v = serde_json::json!({
            "applied": a.apply,
            "agentRunning": running,
            "items": items,
            "failed": failed.iter().map(|(i, e)| serde_json::json!({"kind": i.kind, "what": i.what, "error": e})).collect::<Vec<_>>(),
        });
        println!("{v}");
    } else {
        for i in &items {
            let failure = failed.iter().find(|(f, _)| f == i).map(|(_, e)| e);
            let state = match (a.apply, failure) {
                (false, _) => "would remove",
                (true, None) => "removed",
                (true, Some(_)) => "FAILED",
            };
            println!("{state:<13} {:<11} {}", i.kind, i.what);
            if let Some(e) = failure {
                println!("{:<13} {:<11}   {e}", "", "");
            }
        }
        match (items.is_empty(), a.apply) {
            (true, _) => println!("nothing of shareguard's found on this node"),
            (false, false) => {
                if running {
                    println!("the agent is running: stop it before `shareguard cleanup --apply`");
                }
                println!(
                    "dry run: {} items; `shareguard cleanup --apply` removes them",
                    items.len()
                );
            }
            (false, true) => println!(
                "{} removed, {} failed",
                items.len() - failed.len(),
                failed.len()
            ),
        }
    }
    Ok(if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Whether something answers the agent's API on `socket` (a health check, not a bare
/// connect: a stale socket file of a killed agent refuses connections anyway).
async fn answers(socket: &std::path::Path) -> bool {
    let Ok(mut c) = crate::client::connect(socket).await else {
        return false;
    };
    c.list_devices(shareguard_proto::v1::ListDevicesRequest {})
        .await
        .is_ok()
}
