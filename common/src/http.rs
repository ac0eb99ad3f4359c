//! A bounded HTTP/1.1 server for small endpoints: the agent's `/metrics`, and the
//! health endpoints of the agent and the kubelet plugin. Each connection gets a time to
//! send its request head and a time in all, and only so many are served at once (more
//! wait in the listen backlog), so that clients that connect and say nothing, or hold a
//! connection open, cannot keep the endpoint from others for long.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::net::{TcpListener, TcpStream};

/// What one listener allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Time to send a request's head after connecting or between requests.
    pub header_read: Duration,
    /// Time one connection is served at most, keep-alive included.
    pub connection: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

/// For health endpoints that kubelet probes: a probe sends its request at once and does
/// not keep the connection (kubelet's prober turns keep-alive off), so a second to send
/// the head and five in all are ample, and a silent client frees its slot within a
/// second; 256 of them at once leaves room for the probes beside a few slow clients.
pub const PROBES: Bounds = Bounds {
    header_read: Duration::from_secs(1),
    connection: Duration::from_secs(5),
    max_connections: 256,
};

/// Accepts connections on `listener` within `bounds` and hands each to `handle` (which
/// serves it, TLS included where it speaks TLS), until the process ends.
pub async fn serve<H, F>(listener: TcpListener, bounds: Bounds, handle: H)
where
    H: Fn(TcpStream) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(bounds.max_connections));
    loop {
        // Waiting here leaves further clients in the kernel's backlog.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "accepting an HTTP connection failed");
                continue;
            }
        };
        let served = handle(stream);
        tokio::spawn(async move {
            // A connection past its time is dropped, whatever it was doing.
            let _ = tokio::time::timeout(bounds.connection, served).await;
            drop(slot);
        });
    }
}

/// `app` over HTTP/1.1 on `listener`, plain, within `bounds`.
pub async fn serve_router(listener: TcpListener, app: axum::Router, bounds: Bounds) {
    serve(listener, bounds, move |stream| {
        serve_connection(stream, app.clone(), bounds.header_read)
    })
    .await;
}

/// HTTP/1.1 on one accepted connection, plain or TLS, with `header_read` for each
/// request's head.
pub async fn serve_connection<S>(stream: S, app: axum::Router, header_read: Duration)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = hyper_util::service::TowerToHyperService::new(app);
    let mut b = hyper::server::conn::http1::Builder::new();
    b.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_read);
    let _ = b
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
        .await;
}
