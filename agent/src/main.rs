//! `shareguard`: `shareguard agent --config FILE` runs the node agent, `shareguard
//! kubelet-plugin` its DRA kubelet plugin; the other subcommands are the SRE's command
//! line over the agent's socket.

use std::process::ExitCode;

use shareguard::cli::{Cli, Cmd, run_client};
use tracing_subscriber::EnvFilter;

/// The daemons log to stderr, `RUST_LOG` filtering (info by default).
fn init_logs() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse_checked();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("shareguard: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match &cli.cmd {
        Cmd::Agent { config, node_name } => {
            init_logs();
            rt.block_on(shareguard::server::run(config, node_name.clone()))
                .map(|()| ExitCode::SUCCESS)
        }
        #[cfg(feature = "kubelet-plugin")]
        Cmd::KubeletPlugin(args) => {
            init_logs();
            rt.block_on(shareguard_kubelet_plugin::run(
                args.clone(),
                shareguard::server::shutdown_signal(),
            ))
            .map(|()| ExitCode::SUCCESS)
        }
        #[cfg(feature = "kubelet-plugin")]
        Cmd::KubeletPluginDirs(args) => shareguard_kubelet_plugin::prepare_dirs(args)
            .map(|done| {
                for line in done {
                    println!("{line}");
                }
                ExitCode::SUCCESS
            })
            .map_err(Into::into),
        _ => rt.block_on(run_client(cli)),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("shareguard: {e:#}");
            ExitCode::FAILURE
        }
    }
}
