//! A `NodeAgent` client over the agent's unix socket, for the CLI and the tests.

use std::path::Path;

use anyhow::Context;
use shareguard_proto::v1::node_agent_client::NodeAgentClient;
use tonic::transport::Channel;

pub async fn connect(socket: &Path) -> anyhow::Result<NodeAgentClient<Channel>> {
    let channel = shareguard_uds::client::connect(socket)
        .await
        .with_context(|| format!("cannot connect to the agent at {}", socket.display()))?;
    Ok(NodeAgentClient::new(channel))
}
