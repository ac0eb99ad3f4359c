//! A `NodeAgent` client over the agent's unix socket, for the CLI and the tests.

use std::path::Path;

use anyhow::Context;
use hyper_util::rt::TokioIo;
use shareguard_proto::v1::node_agent_client::NodeAgentClient;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

pub async fn connect(socket: &Path) -> anyhow::Result<NodeAgentClient<Channel>> {
    let path = socket.to_path_buf();
    // The URI is required by the API but unused: every connection goes to the socket.
    let channel = Endpoint::try_from("http://agent.invalid")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
        }))
        .await
        .with_context(|| format!("cannot connect to the agent at {}", socket.display()))?;
    Ok(NodeAgentClient::new(channel))
}
