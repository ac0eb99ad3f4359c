//! The client side: a tonic channel to a gRPC server on a unix socket.

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

// The URI is required by tonic but never dialled: every connection goes to the socket.
// `localhost` is also the :authority h2 sends, which every server accepts.
const PLACEHOLDER_URI: &str = "http://localhost";

fn endpoint() -> Endpoint {
    Endpoint::from_static(PLACEHOLDER_URI)
}

fn connector(
    path: PathBuf,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<UnixStream>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Uri| {
        let p = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(p).await?)) }
    })
}

/// Connects now: fails when nothing listens on `socket`. After a connection breaks, the
/// channel dials the socket again on the next call.
pub async fn connect(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    endpoint()
        .connect_with_connector(connector(socket.to_path_buf()))
        .await
}

/// Connects on the first call, and again on the first call after the server went away,
/// so that a long-lived client outlives restarts of the server.
pub fn lazy(socket: &Path) -> Channel {
    endpoint().connect_with_connector_lazy(connector(socket.to_path_buf()))
}
