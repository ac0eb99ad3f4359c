//! `/metrics`, `/healthz` and `/readyz` on `metrics_addr`.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode, header::ACCEPT},
    response::IntoResponse,
    routing::get,
};

use crate::engine::Engine;

#[derive(Clone)]
struct Ctx {
    engine: Arc<Engine>,
    ready: Arc<AtomicBool>,
}

pub fn router(engine: Arc<Engine>, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Ctx { engine, ready })
}

/// OpenMetrics to a scraper that asks for it (Prometheus does), the Prometheus text
/// format to everyone else.
async fn metrics(State(c): State<Ctx>, headers: HeaderMap) -> impl IntoResponse {
    let openmetrics = headers
        .get_all(ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    // Rendering is CPU work over every live share: off the async workers, which serve
    // the gRPC API, and one at a time (see `Metrics::render`).
    let engine = c.engine.clone();
    let max_age = engine.config().agent.metrics_max_age;
    let rendered =
        tokio::task::spawn_blocking(move || engine.metrics().render_cached(&engine, max_age))
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
            crate::metrics_text::to_prometheus_text(&body),
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
