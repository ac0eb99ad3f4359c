//! `/metrics`, `/healthz` and `/readyz` on `metrics_addr`, and `/healthz` and `/readyz`
//! alone on `health_addr`. Every connection is bounded (`shareguard_common::http`): on
//! the metrics listener a client gets [`HEADER_READ_TIMEOUT`] to send its request head
//! and [`CONNECTION_TIMEOUT`] in all, and at most [`MAX_CONNECTIONS`] are served at
//! once; the health listener, which kubelet probes, has the tighter
//! `shareguard_common::http::PROBES`.
//! With `[agent] metrics_tls` the metrics listener speaks TLS only (see
//! [`crate::api::metrics::tls`]); the TLS handshake counts as part of the request head's time.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::{
        HeaderMap, StatusCode,
        header::{ACCEPT, AUTHORIZATION},
    },
    response::IntoResponse,
    routing::get,
};

use shareguard_common::http;

use crate::{
    api::metrics::{
        Metrics,
        tls::{self as metrics_tls, MetricsTls},
    },
    engine::Engine,
};

#[derive(Clone)]
struct Ctx {
    engine: Arc<Engine>,
    ready: Arc<AtomicBool>,
}

#[derive(Clone)]
struct MetricsCtx {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
}

/// Time a client of the metrics listener has to send a request's head after connecting
/// or between requests (and to finish a TLS handshake).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time one metrics connection is served at most, keep-alive included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);
/// Metrics connections served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// The metrics listener's bounds: a scraper keeps its connection between scrapes.
pub const METRICS: http::Bounds = http::Bounds {
    header_read: HEADER_READ_TIMEOUT,
    connection: CONNECTION_TIMEOUT,
    max_connections: MAX_CONNECTIONS,
};

/// Health and `/metrics`, for `metrics_addr`. `metrics` is the registry the engine
/// reports to.
pub fn router(engine: Arc<Engine>, metrics: Arc<Metrics>, ready: Arc<AtomicBool>) -> Router {
    let scrape = Router::new()
        .route("/metrics", get(serve_metrics))
        .with_state(MetricsCtx {
            engine: engine.clone(),
            metrics,
        });
    health_routes()
        .with_state(Ctx { engine, ready })
        .merge(scrape)
}

/// Health alone, for `health_addr`.
pub fn health_router(engine: Arc<Engine>, ready: Arc<AtomicBool>) -> Router {
    health_routes().with_state(Ctx { engine, ready })
}

/// `/healthz` and `/readyz`, the same on both listeners.
fn health_routes() -> Router<Ctx> {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
}

/// Serves `app` on `listener` within [`METRICS`], over TLS when `tls` is given, until
/// the process ends.
pub async fn serve(listener: tokio::net::TcpListener, app: Router, tls: Option<MetricsTls>) {
    http::serve(listener, METRICS, move |stream| {
        let app = app.clone();
        let tls = tls.clone();
        async move {
            let Some(tls) = tls else {
                return http::serve_connection(stream, app, HEADER_READ_TIMEOUT).await;
            };
            // Read for each connection: a renewed certificate applies at once.
            let config = match metrics_tls::server_config(&tls) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics_tls cannot be loaded; connection refused");
                    return;
                }
            };
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
            match tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => http::serve_connection(stream, app, HEADER_READ_TIMEOUT).await,
                // A client without an admitted certificate, or no TLS at all: it
                // learns nothing, and is not worth a warning each time.
                Ok(Err(e)) => tracing::debug!(error = %e, "metrics TLS handshake failed"),
                Err(_) => tracing::debug!("metrics TLS handshake timed out"),
            }
        }
    })
    .await;
}

/// Serves the health endpoints on `listener` within [`http::PROBES`], until the process
/// ends: tighter than the metrics listener's, since kubelet's probes time out in
/// seconds.
pub async fn serve_health(listener: tokio::net::TcpListener, app: Router) {
    http::serve_router(listener, app, http::PROBES).await;
}

/// Whether `headers` carry the token in `file` as `Authorization: Bearer <token>`. The
/// file is read at each scrape (a rotated token applies at once); one that cannot be
/// read, or is empty, lets nobody in. Compared in constant time.
fn authorized(file: &std::path::Path, headers: &HeaderMap) -> bool {
    let Ok(want) = std::fs::read_to_string(file) else {
        tracing::warn!(file = %file.display(), "metrics_token_file cannot be read; /metrics refused");
        return false;
    };
    let want = want.trim();
    let got = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    !want.is_empty()
        && want.len() == got.len()
        && want
            .bytes()
            .zip(got.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// OpenMetrics to a scraper that asks for it (Prometheus does), the Prometheus text
/// format to everyone else.
async fn serve_metrics(
    State(c): State<MetricsCtx>,
    headers: HeaderMap,
) -> axum::response::Response {
    if let Some(file) = &c.engine.config().agent.metrics_token_file
        && !authorized(file, &headers)
    {
        return (
            StatusCode::UNAUTHORIZED,
            [("www-authenticate", "Bearer")],
            "a bearer token is required (metrics_token_file)\n",
        )
            .into_response();
    }
    let openmetrics = headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    // Rendering is CPU work over every live share: off the async workers, which serve
    // the gRPC API, and one at a time (see `Metrics::render`).
    let (engine, metrics) = (c.engine.clone(), c.metrics.clone());
    let max_age = engine.config().agent.metrics_max_age;
    let rendered = tokio::task::spawn_blocking(move || metrics.render_cached(&engine, max_age))
        .await
        .unwrap_or(Err(std::fmt::Error));
    match rendered {
        Ok(body) if openmetrics => (
            StatusCode::OK,
            [(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Ok(body) => (
            StatusCode::OK,
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            crate::api::metrics::text::to_prometheus_text(&body),
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics encoding failed\n",
        )
            .into_response(),
    }
}

/// Ready once the store is loaded, shares are re-verified and the socket accepts calls;
/// not ready while the store cannot take writes (a full or read-only disk), saying why,
/// since no change can be made durable then.
async fn readyz(State(c): State<Ctx>) -> impl IntoResponse {
    if !c.ready.load(Ordering::Acquire) {
        return (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_owned());
    }
    match c.engine.store_problem() {
        None => (StatusCode::OK, "ready\n".to_owned()),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: state store: {why}; reopening it every second\n"),
        ),
    }
}
