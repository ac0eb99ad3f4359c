//! The command line's shape: global flags, subcommands and their arguments, and which
//! subcommand takes which global flag.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{audit::Decision, config};

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
    /// Parses the command line as [`Parser::parse`] does. A global flag a subcommand
    /// has no use for is accepted, as kubectl-style tools accept their global flags
    /// everywhere (an alias or wrapper that always passes `--socket` must keep working),
    /// with a note on stderr that it was ignored, since a flag that silently does nothing
    /// misleads; a format a subcommand does not offer is refused.
    pub fn parse_checked() -> Cli {
        use clap::{CommandFactory, FromArgMatches, parser::ValueSource};
        let m = Cli::command().get_matches();
        let cli = Cli::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
        let given = |id: &str| m.value_source(id) == Some(ValueSource::CommandLine);
        match cli
            .cmd
            .takes(given("socket"), given("output").then_some(cli.output))
        {
            Ok(notes) => {
                for n in notes {
                    eprintln!("note: {n}");
                }
            }
            Err(msg) => Cli::command()
                .error(clap::error::ErrorKind::InvalidValue, msg)
                .exit(),
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

    /// Whether this subcommand uses `--socket` (when given) and `-o FORMAT` (when given):
    /// a note for each flag it ignores, or why the format is refused.
    pub fn takes(&self, socket: bool, output: Option<Output>) -> Result<Vec<String>, String> {
        let name = self.name();
        let local = matches!(
            self,
            Cmd::Agent { .. } | Cmd::Audit(_) | Cmd::Capacity(_) | Cmd::Cleanup(_) | Cmd::Config(_)
        );
        #[cfg(feature = "kubelet-plugin")]
        let local = local || matches!(self, Cmd::KubeletPlugin(_) | Cmd::KubeletPluginDirs(_));
        let mut notes = Vec::new();
        if socket && local {
            notes.push(format!(
                "--socket ignored: `{name}` does not talk to a running agent (the agent and cleanup take the socket from --config)"
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
            Some(_) if formats.is_empty() => {
                notes.push(format!(
                    "-o ignored: `{name}` prints no output that -o could format"
                ));
                Ok(notes)
            }
            Some(o) if !formats.contains(&o) => Err(format!(
                "`{name}` offers -o {}",
                formats
                    .iter()
                    .filter_map(|f| f.to_possible_value().map(|v| v.get_name().to_owned()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            _ => Ok(notes),
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
