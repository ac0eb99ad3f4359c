//! `/metrics`, `/healthz` and `/readyz` on `metrics_addr`.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};

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

async fn metrics(State(c): State<Ctx>) -> impl IntoResponse {
    match c.engine.metrics().render(&c.engine) {
        Ok(body) => (
            StatusCode::OK,
            [(
                "content-type",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
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
/// not ready again if the store failed, since no change can be made durable then.
async fn readyz(State(c): State<Ctx>) -> impl IntoResponse {
    if c.ready.load(Ordering::Acquire) && c.engine.healthy() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}
