//! Why a claim could not be prepared or unprepared: each becomes the claim's error string
//! in kubelet's answer, and kubelet calls again.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClaimError {
    /// The claim or a pod could not be read from the API server.
    #[error("reading {what} from the API server: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// The claim is not the one kubelet asked for, or not in a state to prepare.
    #[error("claim {namespace}/{name}: {reason}")]
    Claim {
        namespace: String,
        name: String,
        reason: String,
    },
    /// The agent refused or failed the claim.
    #[error("the node agent refused the claim: {0}")]
    Refused(String),
    /// The agent could not be reached or failed the whole call.
    #[error("calling the node agent: {code:?}: {message}")]
    Agent { code: tonic::Code, message: String },
    /// This plugin instance was replaced by a newer one, whose epoch the agent follows.
    #[error(
        "this kubelet plugin instance (epoch {0}) was replaced by a newer one; it prepares nothing more"
    )]
    Fenced(u64),
}

impl ClaimError {
    pub fn claim(namespace: &str, name: &str, reason: impl Into<String>) -> Self {
        Self::Claim {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Errors that stop the plugin.
#[derive(Debug, Error)]
pub enum PluginError {
    #[error("kube client configuration: {0}")]
    KubeConfig(String),
    #[error("socket {path}: {source}")]
    Socket {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("kubelet refused to register driver {driver}: {error}")]
    RegistrationRefused { driver: String, error: String },
    #[error("the node agent at {socket} refused the plugin: {code:?}: {message}")]
    AgentRefused {
        socket: String,
        code: tonic::Code,
        message: String,
    },
    #[error("the agent's inventory names no driver: nothing to register")]
    NoDrivers,
    /// The agent serves a driver outside `--driver`: it is another release's agent.
    #[error(
        "the agent at {socket} serves driver(s) {found:?}, and this plugin is for {expected:?} (--driver): that agent belongs to another release of shareguard, and a node runs one release's agent only, so this release needs nodes of its own (its agent and plugin nodeSelector)"
    )]
    ForeignDrivers {
        socket: String,
        found: Vec<String>,
        expected: Vec<String>,
    },
    /// The agent was restarted with drivers this instance did not register (or without
    /// some it did). A DRA plugin registers its drivers once; a new process does it again.
    #[error(
        "the agent's drivers changed (added {added:?}, removed {removed:?}): stopping, so that a new plugin process registers them with kubelet"
    )]
    DriversChanged {
        added: Vec<String>,
        removed: Vec<String>,
    },
    /// Nothing this instance sends would be accepted again, and no newer instance
    /// serves in its place.
    #[error(
        "fenced: the agent no longer accepts this instance's epoch {epoch} (a newer epoch was taken, or the agent lost its store) and no other instance serves the driver; exiting so that a new instance takes a new epoch"
    )]
    Fenced { epoch: u64 },
    #[error("serving {what}: {source}")]
    Serve {
        what: String,
        #[source]
        source: tonic::transport::Error,
    },
}
