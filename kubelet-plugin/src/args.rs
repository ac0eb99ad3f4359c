//! The command line of `shareguard kubelet-plugin`.

use std::path::PathBuf;

use clap::Args;

/// Where the plugin listens, whom it calls, and which node it serves.
#[derive(Args, Clone, Debug)]
pub struct PluginArgs {
    /// The node agent's socket.
    #[arg(long, default_value = "/run/shareguard/agent.sock")]
    pub agent_socket: PathBuf,
    /// This node's name, as in the Node object and the pods' spec.nodeName.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// kubelet's plugin registration directory; the plugin puts `<driver>-reg.sock` there.
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    pub registry_dir: PathBuf,
    /// kubelet's plugins directory; the plugin serves `<driver>/dra.sock` there.
    #[arg(long, default_value = "/var/lib/kubelet/plugins")]
    pub plugins_dir: PathBuf,
    /// A kubeconfig; without it, the in-cluster config, then `$KUBECONFIG`.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// How often the agent's inventory is read for changes to publish, in seconds. The
    /// ResourceSlices are also checked on every change the API server reports, and
    /// against the API server every ten of these periods regardless.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub resync_seconds: u64,
}
