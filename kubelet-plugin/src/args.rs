//! The command line of `shareguard kubelet-plugin`.

use std::path::PathBuf;

use clap::Args;

/// Where the plugin listens, whom it calls, and which node it serves.
#[derive(Args, Clone, Debug)]
pub struct PluginArgs {
    /// The node agent's socket.
    #[arg(long, default_value = "/run/shareguard/agent.sock")]
    pub agent_socket: PathBuf,
    /// The drivers this plugin is for (repeatable; the chart gives its driverName). The
    /// plugin refuses to start, before it takes the agent's epoch or touches kubelet's
    /// directories, when the agent on `--agent-socket` serves any other driver: that agent
    /// is another release's, and a node runs one release's agent only. Not given: every
    /// driver the agent serves.
    #[arg(long = "driver", value_name = "NAME")]
    pub drivers: Vec<String>,
    /// This node's name, as in the Node object and the pods' spec.nodeName.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// kubelet's plugin registration directory; the plugin puts `<driver>/reg.sock`
    /// there (kubelet watches the directories below it too, and one per driver can be
    /// given to a plugin that does not run as root).
    #[arg(long, default_value = "/var/lib/kubelet/plugins_registry")]
    pub registry_dir: PathBuf,
    /// kubelet's plugins directory; the plugin serves `<driver>/dra.sock` there.
    #[arg(long, default_value = "/var/lib/kubelet/plugins")]
    pub plugins_dir: PathBuf,
    /// Names this instance's sockets `<driver>/reg-<id>.sock` and `<driver>/dra-<id>.sock`
    /// instead of `<driver>/reg.sock` and `<driver>/dra.sock`, so that a new instance
    /// can serve beside the one it replaces (kubelet 1.33 and later keep several
    /// instances of one driver and call the newest). The pod's uid in a DaemonSet.
    #[arg(long, env = "POD_UID", value_parser = instance_id)]
    pub instance_id: Option<String>,
    /// Serves `/healthz` and `/readyz` here (for example `0.0.0.0:9465` in the pod's own
    /// network namespace). Ready once the instance holds the agent's epoch and kubelet
    /// registered every driver; not ready once a newer instance fenced it.
    #[arg(long)]
    pub health_addr: Option<std::net::SocketAddr>,
    /// A kubeconfig; without it, the in-cluster config, then `$KUBECONFIG`.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Requests a second to the API server at most, on average (a token bucket shared by
    /// every request of the process; kubelet's own default).
    #[arg(long, default_value_t = crate::throttle::DEFAULT_QPS, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub kube_api_qps: u32,
    /// Requests the API server may get at once, above `--kube-api-qps`.
    #[arg(long, default_value_t = crate::throttle::DEFAULT_BURST, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub kube_api_burst: u32,
    /// How often, in seconds, at most the agent's inventory is read for changes to
    /// publish (every 5 s where this is longer); the ResourceSlices are checked against
    /// the API server every ten of these periods regardless, and on every change it
    /// reports.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub resync_seconds: u64,
    /// How many ResourceSlices of each driver this node may hold: one per pool, named
    /// `<node>-<driver>-<n>` with n below this bound. The admission policy
    /// (deploy/admission.yaml) refuses any other name to the plugin, so that no plugin
    /// can publish without bound; the chart sets both from one value. Pools beyond it
    /// are not published, with an error naming them.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=crate::slices::names::MAX_SLOTS as i64))]
    pub max_slices_per_node: u32,
    /// Publishes every device with binding conditions, so that the scheduler binds a
    /// pod only once this node's agent holds its shares (or sends it elsewhere when the
    /// agent refuses), and runs the gate that admits them (`binding`). Needs the
    /// `DRADeviceBindingConditions` and `DRAResourceClaimDeviceStatus` features (beta,
    /// on by default from 1.36); costs each such pod the scheduler's poll of the
    /// claim, up to 5 s before it binds. `--binding-conditions=false` turns it off.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub binding_conditions: bool,
    /// A Normal `ShareEnforced` Event on the pod when a share of it is enforced after it
    /// waited (for the pod's sandbox, a repair, the agent's restart, the end of the
    /// observe stage). The claim's `Enforced` condition says the same:
    /// `--enforced-events=false` leaves it there, one request less per claim and, in a
    /// large cluster, one Event less in etcd for nearly every pod started. Warnings (a
    /// refused claim, a share DEGRADED or FAILED) are written either way.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enforced_events: bool,
}

/// A pod uid, or anything that makes one file name: lowercase letters, digits and `-`,
/// 1 to 63 characters.
fn instance_id(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?}: 1 to 63 lowercase letters, digits or '-' (a pod uid), since it becomes part of a socket's file name"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instance_id_is_one_safe_file_name_part() {
        assert!(instance_id("0f5e3d1c-7b2a-4c9d-8e6f-1a2b3c4d5e6f").is_ok());
        for bad in ["", "../x", "a/b", "A", "a.b", &"a".repeat(64)] {
            let e = instance_id(bad).unwrap_err();
            assert!(e.contains("socket"), "{bad:?}: {e}");
        }
    }
}
