//! The `shareguard` command line: `agent` runs the daemon; `audit` reads the audit log's
//! files directly; every other subcommand talks to a running agent over its socket.

mod args;
mod audit;
pub mod cleanup;
mod render;
pub mod rollout;
pub mod slo;

pub use args::{AuditArgs, CapacityArgs, Cli, Cmd, ConfigCmd, Output};
use audit::run_audit;
pub(crate) use render::table;
use render::{device_rows, json, phase_name, plain, print_as, share_rows};

use std::{io::Read, process::ExitCode};

use anyhow::{Context, bail};
use shareguard_proto::v1 as pb;
use tokio_stream::StreamExt;

use crate::{api::convert::parse_phase, api::convert::phase_to_pb, client::connect, config};

/// `shareguard config check FILE`.
fn check_config(file: &std::path::Path) -> ExitCode {
    match config::Config::load(file) {
        Ok(cfg) => {
            for d in &cfg.devices {
                for w in crate::config::warnings::device_warnings(d) {
                    eprintln!("{}: warning: {w}", file.display());
                }
            }
            println!("{}: ok ({} devices)", file.display(), cfg.devices.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn read_input(file: &str) -> anyhow::Result<String> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading stdin")?;
        Ok(s)
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))
    }
}

fn run_capacity(a: &CapacityArgs, out: Output) -> anyhow::Result<ExitCode> {
    use crate::capacity::{Plan, PlanError, parse_mix, parse_ratio, parse_reserve};
    let quantity = |flag: &'static str, s: &str| {
        shareguard_common::Quantity::parse(s.trim()).map_err(|e| PlanError {
            flag,
            reason: format!("{s:?}: {e}"),
        })
    };
    let plan = Plan {
        devices: a.devices,
        capacity: quantity("capacity", &a.capacity)?,
        min: quantity("min", &a.min)?,
        step: a.step.as_deref().map(|s| quantity("step", s)).transpose()?,
        max: a.max.as_deref().map(|s| quantity("max", s)).transpose()?,
        utilization: parse_ratio("utilization", &a.utilization)?,
        reserve: a.reserve.as_deref().map(parse_reserve).transpose()?,
        mix: a
            .mix
            .as_deref()
            .map(parse_mix)
            .transpose()?
            .unwrap_or_default(),
    };
    let e = plan.estimate()?;
    match out {
        Output::Json => println!("{}", serde_json::to_string_pretty(&e.to_json())?),
        Output::Table | Output::Yaml | Output::Wide => print!("{}", e.table()),
    }
    Ok(ExitCode::SUCCESS)
}

/// Every share `req` matches, page by page, so that a node with 100k shares lists within
/// the default message size.
async fn list_all(
    c: &mut shareguard_proto::v1::node_agent_client::NodeAgentClient<tonic::transport::Channel>,
    mut req: pb::ListSharesRequest,
) -> anyhow::Result<pb::ListSharesResponse> {
    let mut r = pb::ListSharesResponse::default();
    loop {
        let page = c.list_shares(req.clone()).await?.into_inner();
        r.shares.extend(page.shares);
        if page.next_page_token.is_empty() {
            return Ok(r);
        }
        req.page_token = page.next_page_token;
    }
}

/// The shares of the claim `NAMESPACE/NAME`.
async fn claim_shares(
    c: &mut shareguard_proto::v1::node_agent_client::NodeAgentClient<tonic::transport::Channel>,
    id: &str,
) -> anyhow::Result<Vec<pb::ShareStatus>> {
    let Some((namespace, name)) = id
        .split_once('/')
        .filter(|(n, c)| !n.is_empty() && !c.is_empty() && !c.contains('/'))
    else {
        bail!("{id:?} is not NAMESPACE/NAME");
    };
    let r = list_all(
        c,
        pb::ListSharesRequest {
            namespace: namespace.to_owned(),
            ..Default::default()
        },
    )
    .await?;
    Ok(r.shares
        .into_iter()
        .filter(|s| s.claim.as_ref().is_some_and(|c| c.name == name))
        .collect())
}

/// Runs a client subcommand. Returns the exit code: 1 when any claim was refused.
pub async fn run_client(cli: Cli) -> anyhow::Result<ExitCode> {
    let out = cli.output;
    // Local: no socket, so a stopped agent does not keep an SRE from its audit trail.
    let cmd = match cli.cmd {
        Cmd::Audit(a) => return run_audit(a, out),
        Cmd::Capacity(a) => return run_capacity(&a, out),
        Cmd::Cleanup(a) => return crate::cli::cleanup::run(&a, matches!(out, Output::Json)).await,
        Cmd::Config(ConfigCmd::Check { file }) => return Ok(check_config(&file)),
        Cmd::Config(ConfigCmd::Reference) => {
            print!("{}", crate::config::reference::markdown());
            return Ok(ExitCode::SUCCESS);
        }
        cmd => cmd,
    };
    let mut c = connect(&cli.socket).await?;
    match cmd {
        Cmd::Agent { .. } => bail!("`agent` is not a client command"),
        #[cfg(feature = "kubelet-plugin")]
        Cmd::KubeletPlugin(_) => bail!("`kubelet-plugin` is not a client command"),
        #[cfg(feature = "kubelet-plugin")]
        Cmd::KubeletPluginDirs(_) => bail!("`kubelet-plugin-dirs` is not a client command"),
        Cmd::Audit(_) => bail!("`audit` reads local files and is handled before connecting"),
        Cmd::Capacity(_) => bail!("`capacity` computes locally and is handled before connecting"),
        Cmd::Cleanup(_) => bail!("`cleanup` works locally and is handled before connecting"),
        Cmd::Config(_) => bail!("`config` works locally and is handled before connecting"),
        Cmd::Rollout {
            class,
            device,
            stage,
        } => {
            let a = crate::cli::rollout::RolloutArgs {
                class,
                first: device,
                second: stage,
            };
            return crate::cli::rollout::run(&mut c, a, matches!(out, Output::Json)).await;
        }
        Cmd::Slo { class, check } => {
            return crate::cli::slo::run(&mut c, class, check, matches!(out, Output::Json)).await;
        }
        Cmd::Devices => {
            let r = c
                .list_devices(pb::ListDevicesRequest {})
                .await?
                .into_inner();
            print_as(out, &r, |wide| device_rows(&r.devices, wide))?;
        }
        Cmd::Shares {
            device,
            namespace,
            phase,
            all_namespaces: _,
        } => {
            let phase = match phase {
                None => pb::Phase::Unspecified,
                Some(p) => phase_to_pb(
                    parse_phase(&p).with_context(|| format!("--phase: {p:?} is not a phase"))?,
                ),
            };
            let r = list_all(
                &mut c,
                pb::ListSharesRequest {
                    device: device.unwrap_or_default(),
                    namespace: namespace.unwrap_or_default(),
                    phase: phase as i32,
                    ..Default::default()
                },
            )
            .await?;
            print_as(out, &r, |wide| share_rows(&r.shares, wide))?;
        }
        Cmd::Share { id } if id.contains('/') => {
            let r = pb::ListSharesResponse {
                shares: claim_shares(&mut c, &id).await?,
                next_page_token: String::new(),
            };
            if r.shares.is_empty() {
                bail!("claim {id}: no share of it on this node");
            }
            print_as(out, &r, |wide| share_rows(&r.shares, wide))?;
        }
        Cmd::Share { id } => {
            let r = c
                .get_share(pb::GetShareRequest { share_id: id })
                .await?
                .into_inner();
            print_as(out, &r, |wide| share_rows(std::slice::from_ref(&r), wide))?;
        }
        Cmd::Watch {
            device,
            namespace,
            all_namespaces: _,
        } => {
            let mut s = c
                .watch_shares(pb::WatchSharesRequest {
                    device: device.unwrap_or_default(),
                    namespace: namespace.unwrap_or_default(),
                })
                .await?
                .into_inner();
            if out == Output::Table {
                println!("TIME                 KIND         SHARE CLAIM DEVICE PHASE");
            }
            while let Some(ev) = s.next().await {
                let ev = ev?;
                let at = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
                match out {
                    // One event per line, so the stream can be piped into line tools.
                    Output::Json => println!("{}", serde_json::to_string(&plain(&ev)?)?),
                    Output::Table | Output::Yaml | Output::Wide => {
                        let kind = pb::watch_shares_response::Kind::try_from(ev.kind)
                            .map(|k| k.as_str_name().trim_start_matches("KIND_").to_owned())
                            .unwrap_or_default();
                        match ev.share {
                            Some(sh) => println!(
                                "{at} {kind:<12} {} {}/{} {} {}",
                                if sh.share_id.is_empty() {
                                    "(dedicated)"
                                } else {
                                    &sh.share_id
                                },
                                sh.claim
                                    .as_ref()
                                    .map(|c| c.namespace.as_str())
                                    .unwrap_or(""),
                                sh.claim.as_ref().map(|c| c.name.as_str()).unwrap_or(""),
                                sh.device,
                                phase_name(sh.phase)
                            ),
                            None => println!("{at} {kind}"),
                        }
                    }
                }
            }
        }
        Cmd::Prepare { file } => {
            let text = read_input(&file)?;
            let req: pb::PrepareRequest = serde_json::from_str(&text)
                .with_context(|| format!("{file}: not a PrepareRequest in proto3 JSON"))?;
            let r = c.prepare(req).await?.into_inner();
            match out {
                Output::Json => println!("{}", json(&r)?),
                Output::Table | Output::Yaml | Output::Wide => {
                    let shares: Vec<pb::ShareStatus> =
                        r.claims.values().flat_map(|c| c.shares.clone()).collect();
                    if !shares.is_empty() {
                        print!("{}", share_rows(&shares, false));
                    }
                }
            }
            let mut refused = false;
            let mut uids: Vec<&String> = r.claims.keys().collect();
            uids.sort();
            for uid in uids {
                if let Some(e) = r.claims[uid].error.as_ref().filter(|e| !e.code.is_empty()) {
                    refused = true;
                    eprintln!(
                        "claim {uid}: {} {}{}{}",
                        e.code,
                        if e.field.is_empty() {
                            String::new()
                        } else {
                            format!("{}: ", e.field)
                        },
                        e.message,
                        if e.retryable { " (retryable)" } else { "" }
                    );
                }
            }
            return Ok(if refused {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            });
        }
        Cmd::Release { claim_uids, epoch } => {
            let epoch = match epoch {
                Some(e) => e,
                None => {
                    c.list_devices(pb::ListDevicesRequest {})
                        .await?
                        .into_inner()
                        .epoch
                }
            };
            // NAMESPACE/NAME is the uid of the claim of that name that holds shares here.
            let mut claim_uids = claim_uids;
            for id in &mut claim_uids {
                if id.contains('/') {
                    let live: std::collections::BTreeSet<String> = claim_shares(&mut c, id)
                        .await?
                        .into_iter()
                        .filter(|s| s.phase != pb::Phase::Released as i32)
                        .filter_map(|s| s.claim.map(|c| c.uid))
                        .collect();
                    *id = match live.len() {
                        1 => live.into_iter().next().unwrap_or_default(),
                        0 => bail!("claim {id}: no live share of it on this node"),
                        _ => bail!(
                            "claim {id}: more than one claim of that name holds shares here ({}); give the uid",
                            live.into_iter().collect::<Vec<_>>().join(", ")
                        ),
                    };
                }
            }
            let claims = claim_uids
                .iter()
                .map(|uid| pb::ClaimRef {
                    uid: uid.clone(),
                    ..Default::default()
                })
                .collect();
            let r = c
                .unprepare(pb::UnprepareRequest {
                    epoch,
                    claims,
                    only_pre_bind: false,
                })
                .await?
                .into_inner();
            if out == Output::Json {
                println!("{}", json(&r)?);
            }
            let mut failed = false;
            for uid in &claim_uids {
                match r.claims.get(uid).filter(|e| !e.code.is_empty()) {
                    Some(e) => {
                        failed = true;
                        eprintln!("claim {uid}: {} {}", e.code, e.message);
                    }
                    None if out == Output::Table => println!("claim {uid}: released"),
                    None => {}
                }
            }
            return Ok(if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            });
        }
    }
    Ok(ExitCode::SUCCESS)
}
