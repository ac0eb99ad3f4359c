//! The `shareguard` command line: `agent` runs the daemon; `audit` reads the audit log's
//! files directly; every other subcommand talks to a running agent over its socket.

pub mod cleanup;
pub mod rollout;
pub mod slo;

use std::{
    io::{Read, Write},
    path::PathBuf,
    process::ExitCode,
};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use shareguard_proto::v1 as pb;
use tokio_stream::StreamExt;

use crate::{
    api::convert::parse_phase,
    api::convert::phase_to_pb,
    audit::{
        Decision,
        bound::printable,
        query::{self, Entry, Filter},
    },
    client::connect,
    config,
};

#[derive(Parser, Debug)]
#[command(
    name = "shareguard",
    version,
    about = "Enforce and verify DRA consumable-capacity shares on this node"
)]
pub struct Cli {
    /// The agent's API socket.
    #[arg(
        long,
        global = true,
        env = "SHAREGUARD_SOCKET",
        default_value = "/run/shareguard/agent.sock"
    )]
    pub socket: PathBuf,
    /// Output format: human tables, proto3 canonical JSON, the same as YAML, or tables
    /// with more columns (yaml and wide for devices, shares and share).
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
    Wide,
}

impl Cli {
    /// Parses the command line as [`Parser::parse`] does, and refuses a global flag given
    /// to a subcommand that would ignore it: a flag that silently does nothing misleads.
    pub fn parse_checked() -> Cli {
        use clap::{CommandFactory, FromArgMatches, parser::ValueSource};
        let m = Cli::command().get_matches();
        let cli = Cli::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
        let given = |id: &str| m.value_source(id) == Some(ValueSource::CommandLine);
        if let Err(msg) = cli
            .cmd
            .takes(given("socket"), given("output").then_some(cli.output))
        {
            Cli::command()
                .error(clap::error::ErrorKind::ArgumentConflict, msg)
                .exit();
        }
        cli
    }
}

impl Cmd {
    fn name(&self) -> &'static str {
        match self {
            Cmd::Agent { .. } => "agent",
            #[cfg(feature = "kubelet-plugin")]
            Cmd::KubeletPlugin(_) => "kubelet-plugin",
            #[cfg(feature = "kubelet-plugin")]
            Cmd::KubeletPluginDirs(_) => "kubelet-plugin-dirs",
            Cmd::Devices => "devices",
            Cmd::Shares { .. } => "shares",
            Cmd::Share { .. } => "share",
            Cmd::Watch { .. } => "watch",
            Cmd::Prepare { .. } => "prepare",
            Cmd::Release { .. } => "release",
            Cmd::Audit(_) => "audit",
            Cmd::Rollout { .. } => "rollout",
            Cmd::Slo { .. } => "slo",
            Cmd::Capacity(_) => "capacity",
            Cmd::Cleanup(_) => "cleanup",
            Cmd::Config(_) => "config",
        }
    }

    /// Whether this subcommand uses `--socket` (when given) and `-o FORMAT` (when given).
    fn takes(&self, socket: bool, output: Option<Output>) -> Result<(), String> {
        let name = self.name();
        let local = matches!(
            self,
            Cmd::Agent { .. } | Cmd::Audit(_) | Cmd::Capacity(_) | Cmd::Cleanup(_) | Cmd::Config(_)
        );
        #[cfg(feature = "kubelet-plugin")]
        let local = local || matches!(self, Cmd::KubeletPlugin(_) | Cmd::KubeletPluginDirs(_));
        if socket && local {
            return Err(format!(
                "--socket is not used by `{name}`, which does not talk to a running agent (the agent and cleanup take the socket from --config)"
            ));
        }
        let formats: &[Output] = match self {
            Cmd::Devices | Cmd::Shares { .. } | Cmd::Share { .. } => {
                &[Output::Table, Output::Json, Output::Yaml, Output::Wide]
            }
            Cmd::Agent { .. } | Cmd::Config(_) => &[],
            #[cfg(feature = "kubelet-plugin")]
            Cmd::KubeletPlugin(_) | Cmd::KubeletPluginDirs(_) => &[],
            _ => &[Output::Table, Output::Json],
        };
        match output {
            Some(o) if !formats.contains(&o) => Err(format!(
                "`{name}` {}",
                if formats.is_empty() {
                    "prints no output that -o could format".to_owned()
                } else {
                    format!(
                        "offers -o {}",
                        formats
                            .iter()
                            .filter_map(|f| f.to_possible_value().map(|v| v.get_name().to_owned()))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            )),
            _ => Ok(()),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run the node agent.
    Agent {
        #[arg(long, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// This node's name, as the API server knows it: the pool of every device that
        /// sets none, and the `[[node]]` table that applies. `[agent] node_name` comes
        /// first (the two may not differ); without either, the host name, lower-cased,
        /// as kubelet's default.
        #[arg(long, env = "NODE_NAME")]
        node_name: Option<String>,
    },
    /// Run the DRA kubelet plugin: a separate, unprivileged process that registers the
    /// agent's drivers with kubelet and speaks to the API server.
    #[cfg(feature = "kubelet-plugin")]
    KubeletPlugin(shareguard_kubelet_plugin::PluginArgs),
    /// Make the kubelet plugin's socket directories and give them to the uid it runs
    /// as (run once before it, as root with CAP_CHOWN and CAP_FOWNER only), so that
    /// the plugin itself runs with neither root nor a capability.
    #[cfg(feature = "kubelet-plugin")]
    KubeletPluginDirs(shareguard_kubelet_plugin::DirsArgs),
    /// Devices with capacity, allocated and free.
    Devices,
    /// Shares, optionally filtered.
    Shares {
        #[arg(long)]
        device: Option<String>,
        /// Only claims in this namespace.
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Every namespace (the default; as kubectl's -A).
        #[arg(short = 'A', long, conflicts_with = "namespace")]
        all_namespaces: bool,
        /// e.g. enforced, accounted, released
        #[arg(long)]
        phase: Option<String>,
    },
    /// One share by shareID (or dedicated key), or a claim's shares by NAMESPACE/NAME.
    Share { id: String },
    /// Stream share changes (a snapshot first); tables get a header and each line the
    /// time it arrived.
    Watch {
        #[arg(long)]
        device: Option<String>,
        /// Only claims in this namespace.
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Every namespace (the default; as kubectl's -A).
        #[arg(short = 'A', long, conflicts_with = "namespace")]
        all_namespaces: bool,
    },
    /// Send a PrepareRequest written in proto3 canonical JSON ("-" reads stdin).
    Prepare {
        #[arg(short = 'f', long = "file")]
        file: String,
    },
    /// Release claims by uid, or by NAMESPACE/NAME.
    Release {
        #[arg(required = true)]
        claim_uids: Vec<String>,
        /// Control-plane epoch; defaults to the highest the agent accepted.
        #[arg(long)]
        epoch: Option<u64>,
    },
    /// Query the audit log on this node (reads its files; needs no running agent).
    Audit(AuditArgs),
    /// Rollout stages: without arguments each device's class and stage; with DEVICE and
    /// STAGE (observe or enforce) moves the device there, with --class CLASS STAGE every
    /// device of that DeviceClass (admin). `observe` lifts the limits and keeps every
    /// share and its capacity; `enforce` limits them again.
    Rollout {
        /// Every device of this DeviceClass (the config's `class`), all or none.
        #[arg(long)]
        class: Option<String>,
        /// DEVICE, or STAGE after --class.
        device: Option<String>,
        stage: Option<String>,
    },
    /// The SLO figures per DeviceClass, each beside its objective, and the verdict on
    /// each class (promote, hold or roll back) with the figures that decided it.
    Slo {
        /// One DeviceClass only.
        #[arg(long)]
        class: Option<String>,
        /// Exit with the verdict, for a pipeline that gates a rollout on it: 0 when
        /// every class shown says promote, 3 when one says hold and none roll back, 4
        /// when one says roll back (1 stays an error, 2 a usage error).
        #[arg(long)]
        check: bool,
    },
    /// Estimate the logical capacity a fleet of devices can promise under a request
    /// policy and a target utilisation, after what the policy's grid strands and a
    /// reserve (computed here; needs no running agent).
    Capacity(CapacityArgs),
    /// List everything shareguard put on this node (qdiscs, queue devices, BPF pins, CDI specs,
    /// MPS daemons, plugin directories, state, audit log); with --apply, remove it. The
    /// agent must be stopped. Needs no running agent.
    Cleanup(crate::cli::cleanup::CleanupArgs),
    /// The agent's config file, without an agent.
    #[command(subcommand)]
    Config(ConfigCmd),
}

#[derive(Args, Debug)]
pub struct CapacityArgs {
    /// How many devices.
    #[arg(long)]
    pub devices: u64,
    /// Each device's capacity, a quantity (40Gi, 100G).
    #[arg(long)]
    pub capacity: String,
    /// The request policy's smallest share (validRange min).
    #[arg(long)]
    pub min: String,
    /// The request policy's step (validRange step); without it any amount from min up.
    #[arg(long)]
    pub step: Option<String>,
    /// The request policy's largest share (validRange max).
    #[arg(long)]
    pub max: Option<String>,
    /// The share of the packable capacity to promise: 0.7 or 70%.
    #[arg(long)]
    pub utilization: String,
    /// Kept back on every device: an amount (4Gi) or a share of it (10%).
    #[arg(long)]
    pub reserve: Option<String>,
    /// The sizes requests ask for, each with its relative weight: 3Gi=2,10Gi=1. Each is
    /// rounded up to the policy as the scheduler does.
    #[arg(long)]
    pub mix: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// Validate FILE as the agent would at start: exit 0 (warnings on stderr), or 1 with
    /// `file:line: reason`. Reads only the file: devices and GPUs are not probed.
    Check { file: PathBuf },
    /// Print the reference of every config key (type, default, meaning) as Markdown:
    /// docs/config-reference.md is this output.
    Reference,
}

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

#[derive(Args, Debug)]
pub struct AuditArgs {
    /// The agent's config, for `[agent] audit_log`.
    #[arg(long, default_value = config::DEFAULT_PATH, conflicts_with = "file")]
    pub config: PathBuf,
    /// The audit log itself (rotated files `FILE.N` next to it are read too).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Only lines of this claim uid.
    #[arg(long)]
    pub claim: Option<String>,
    /// Only lines of this shareID.
    #[arg(long)]
    pub share: Option<String>,
    /// Only lines of claims in this namespace (the line's tenant).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only lines of this device.
    #[arg(long)]
    pub device: Option<String>,
    /// Only these decisions (repeat the flag or separate with commas).
    #[arg(long, value_delimiter = ',')]
    pub decision: Vec<Decision>,
    /// Only lines at or after this: a duration back from now (90s, 15m, 1h, 2d) or an
    /// RFC 3339 UTC time.
    #[arg(long)]
    pub since: Option<String>,
    /// Only the most recent N matching lines.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Check the log's hash chain instead of printing lines: exit 0 when every line
    /// follows the one before it, 1 (naming file and line) where one was removed or
    /// edited.
    #[arg(long, conflicts_with_all = ["claim", "share", "namespace", "device", "decision", "since", "limit"])]
    pub verify: bool,
}

/// `v` as JSON, with enum values spelled as the tables and `--phase` spell them
/// ([`plain_enums`]).
fn json<T: serde::Serialize>(v: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(&plain(v)?)?)
}

fn plain<T: serde::Serialize>(v: &T) -> anyhow::Result<serde_json::Value> {
    let mut v = serde_json::to_value(v)?;
    plain_enums(&mut v);
    Ok(v)
}

/// One spelling of a phase everywhere the CLI prints one: `ENFORCED`, as in the tables,
/// the claim's status and `--phase`, not proto3 JSON's `PHASE_ENFORCED`; the same for a
/// watch event's `kind`. The gRPC API itself is unchanged.
pub(crate) fn plain_enums(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                let prefix = match k.as_str() {
                    "phase" => "PHASE_",
                    "kind" => "KIND_",
                    _ => {
                        plain_enums(x);
                        continue;
                    }
                };
                if let serde_json::Value::String(s) = x
                    && let Some(rest) = s.strip_prefix(prefix)
                {
                    *s = rest.to_owned();
                } else {
                    plain_enums(x);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(plain_enums),
        _ => {}
    }
}

/// `v` as `out` asks: JSON, the same as YAML, or `table(wide)`.
fn print_as<T: serde::Serialize>(
    out: Output,
    v: &T,
    table: impl FnOnce(bool) -> String,
) -> anyhow::Result<()> {
    match out {
        Output::Json => println!("{}", json(v)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&plain(v)?)?),
        Output::Table => print!("{}", table(false)),
        Output::Wide => print!("{}", table(true)),
    }
    Ok(())
}

pub(crate) fn table(rows: Vec<Vec<String>>) -> String {
    let cols = rows.first().map(Vec::len).unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

fn kv(m: &std::collections::HashMap<String, String>) -> String {
    let mut v: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
    v.sort();
    v.join(",")
}

fn phase_name(p: i32) -> String {
    pb::Phase::try_from(p)
        .map(|p| p.as_str_name().trim_start_matches("PHASE_").to_owned())
        .unwrap_or_else(|_| p.to_string())
}

/// Shares as a table; `wide` adds the claim's uid, the pod interface the share is on,
/// its policy version and when it last changed.
fn share_rows(shares: &[pb::ShareStatus], wide: bool) -> String {
    let mut header: Vec<String> = [
        "SHARE",
        "CLAIM",
        "DEVICE",
        "PHASE",
        "MECHANISM",
        "REQUESTED",
        "ENFORCED",
        "ABOVE RATE",
    ]
    .map(String::from)
    .to_vec();
    if wide {
        header.extend(["CLAIM UID", "INTERFACE", "POLICY", "UPDATED"].map(String::from));
    }
    header.push("REASON".into());
    let mut rows = vec![header];
    for s in shares {
        let claim = s
            .claim
            .as_ref()
            .map(|c| format!("{}/{}", c.namespace, c.name))
            .unwrap_or_default();
        let req: Vec<String> = s
            .limits
            .iter()
            .map(|l| format!("{}={}", l.name, l.requested))
            .collect();
        let enf: Vec<String> = s
            .limits
            .iter()
            .map(|l| {
                format!(
                    "{}={}",
                    l.name,
                    if l.enforced.is_empty() {
                        "-"
                    } else {
                        &l.enforced
                    }
                )
            })
            .collect();
        rows.push(vec![
            if s.share_id.is_empty() {
                "(dedicated)".into()
            } else {
                s.share_id.clone()
            },
            claim,
            s.device.clone(),
            phase_name(s.phase),
            s.mechanism.clone(),
            req.join(","),
            enf.join(","),
            s.traffic
                .as_ref()
                .map_or_else(|| "-".to_owned(), above_rate),
        ]);
        if let Some(row) = rows.last_mut() {
            if wide {
                let or_dash = |v: &str| {
                    if v.is_empty() {
                        "-".to_owned()
                    } else {
                        v.to_owned()
                    }
                };
                row.extend([
                    or_dash(s.claim.as_ref().map_or("", |c| c.uid.as_str())),
                    or_dash(
                        &s.sandbox
                            .iter()
                            .chain(&s.more_sandboxes)
                            .map(|b| b.host_interface.as_str())
                            .filter(|i| !i.is_empty())
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                    or_dash(&s.policy_version),
                    s.updated_at.as_ref().map_or_else(
                        || "-".to_owned(),
                        |t| {
                            let secs = u64::try_from(t.seconds).unwrap_or(0);
                            humantime::format_rfc3339_seconds(
                                std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs),
                            )
                            .to_string()
                        },
                    ),
                ]);
            }
            row.push(s.reason.clone());
        }
    }
    table(rows)
}

/// A bandwidth share's time and bytes above its allocated rate, per direction, e.g.
/// `to-pod 12.0s/+15.0MB from-pod 0s`: in observe, what enforcing would have held back.
fn above_rate(t: &pb::Traffic) -> String {
    let dir = |name: &str, d: Option<&pb::DirectionTraffic>| {
        let d = d.copied().unwrap_or_default();
        if d.ms_above_rate == 0 {
            format!("{name} 0s")
        } else {
            // Display only: the exact integers are in -o json.
            #[allow(clippy::cast_precision_loss)]
            let (secs, mb) = (
                d.ms_above_rate as f64 / 1000.0,
                d.bytes_above_rate as f64 / 1e6,
            );
            format!("{name} {secs:.1}s/+{mb:.1}MB")
        }
    };
    format!(
        "{} {}",
        dir("to-pod", t.to_pod.as_ref()),
        dir("from-pod", t.from_pod.as_ref())
    )
}

/// Devices as a table; `wide` adds the DeviceClass, the rollout stage, whether the
/// mechanism enforces, and the allowed namespaces.
fn device_rows(devices: &[pb::DeviceStatus], wide: bool) -> String {
    let mut header: Vec<String> = [
        "DEVICE",
        "DRIVER",
        "POOL",
        "KIND",
        "CAPACITY",
        "ALLOCATED",
        "FREE",
        "SHARES",
        "MECHANISMS",
    ]
    .map(String::from)
    .to_vec();
    if wide {
        header.extend(["CLASS", "STAGE", "ENFORCES", "NAMESPACES"].map(String::from));
    }
    let mut rows = vec![header];
    for d in devices {
        rows.push(vec![
            d.name.clone(),
            d.driver.clone(),
            d.pool.clone(),
            d.kind.clone(),
            kv(&d.capacity),
            kv(&d.allocated),
            kv(&d.free),
            format!(
                "{}{}",
                d.live_shares,
                if d.dedicated { " (dedicated)" } else { "" }
            ),
            d.mechanisms.join(","),
        ]);
        if wide && let Some(row) = rows.last_mut() {
            row.extend([
                d.device_class.clone(),
                d.stage.clone(),
                d.enforces.to_string(),
                if d.allowed_namespaces.is_empty() {
                    "-".to_owned()
                } else {
                    d.allowed_namespaces.join(",")
                },
            ]);
        }
    }
    let mut out = table(rows);
    for w in devices.iter().flat_map(|d| &d.warnings) {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
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

fn audit_rows(entries: &[Entry]) -> String {
    let mut rows = vec![
        [
            "TIME", "DECISION", "TENANT", "CLAIM", "SHARE", "DEVICE", "AMOUNTS", "REASON",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_owned()
        } else {
            s.to_owned()
        }
    };
    for e in entries {
        let r = &e.record;
        let amounts: Vec<String> = r.amounts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        // The agent writes printable text, but the file is only a file: whatever it
        // holds, a control character or a newline never reaches the terminal raw.
        let p = |s: &str| printable(s).into_owned();
        rows.push(vec![
            p(&r.time),
            p(&r.decision),
            p(&dash(&r.tenant)),
            p(&dash(&r.claim_uid)),
            p(&dash(&r.share_id)),
            p(&dash(&r.device)),
            p(&dash(&amounts.join(","))),
            p(&r.reason),
        ]);
    }
    table(rows)
}

/// `shareguard audit --verify`.
fn verify_audit(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let v = crate::audit::chain::verify(path)?;
    for b in &v.breaks {
        // Paths and reasons only: nothing of the lines themselves reaches the terminal.
        eprintln!("shareguard audit: {}", printable(&b.to_string()));
    }
    let start = if v.from_genesis {
        "from the first line ever written"
    } else {
        "from the oldest line kept (older ones were rotated away)"
    };
    let unchained = if v.unchained > 0 {
        format!("; {} older lines carry no chain", v.unchained)
    } else {
        String::new()
    };
    if v.breaks.is_empty() {
        println!(
            "audit log intact: {} lines follow the line before them, {start}{unchained}",
            v.chained
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "audit log BROKEN in {} places (above); {} lines follow the line before them",
            v.breaks.len(),
            v.chained
        );
        Ok(ExitCode::FAILURE)
    }
}

/// `shareguard audit`: reads the log's files (oldest first), reports malformed lines on
/// stderr and skips them, and prints what the filters select. Exit code 1 when a file
/// could not be read to its end, since the answer may then be incomplete.
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

fn run_audit(a: AuditArgs, out: Output) -> anyhow::Result<ExitCode> {
    let path = match a.file {
        Some(f) => f,
        None => {
            config::Config::load(&a.config)
                .with_context(|| {
                    format!(
                        "reading the audit log's path from {} (or give --file)",
                        a.config.display()
                    )
                })?
                .agent
                .audit_log
        }
    };
    if a.verify {
        return verify_audit(&path);
    }
    let since = a
        .since
        .as_deref()
        .map(|s| query::parse_since(s, std::time::SystemTime::now()))
        .transpose()
        .context("--since")?;
    let filter = Filter {
        claim_uid: a.claim,
        share_id: a.share,
        namespace: a.namespace,
        device: a.device,
        decisions: a.decision,
        since,
        limit: a.limit,
    };
    let lines = query::read(&path)?;
    let mut incomplete = false;
    let entries = lines.filter_map(|l| match l {
        Ok(e) => Some(e),
        Err(e) => {
            incomplete |= matches!(e, query::LineError::Io { .. });
            eprintln!("shareguard audit: {e}");
            None
        }
    });
    let selected = query::select(entries, &filter);
    match out {
        // The lines exactly as written, one per line, for jq and grep.
        Output::Json => {
            let mut stdout = std::io::stdout().lock();
            for e in &selected {
                writeln!(stdout, "{}", e.raw)?;
            }
        }
        Output::Table | Output::Yaml | Output::Wide => print!("{}", audit_rows(&selected)),
    }
    Ok(if incomplete {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
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
                .unprepare(pb::UnprepareRequest { epoch, claims })
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
