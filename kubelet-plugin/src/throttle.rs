//! One gate for every API request of the plugin process: a token bucket
//! (`--kube-api-qps`, `--kube-api-burst`, as kubelet's own flags), and a hold that the
//! API server's overload closes.
//!
//! An answer 429, 503 or 504 closes the hold for every request of the process, not only
//! for the one that got it, since they all go to the same server: for the Retry-After
//! the server sent (capped at a minute), else for a backoff that doubles with each
//! overloaded answer in a row, from 200 ms to 30 s. Both get jitter, only ever later,
//! so that the nodes of a cluster told the same thing do not come back in one wave. The
//! request that got the answer is sent again once the hold ends, at most three more
//! times and within its caller's own bound ([`crate::cluster::Clients::bounded`]); then
//! its caller sees the answer, and retries on its own schedule. kube's retry layer
//! (each request alone, up to 15 times from 5 ms) is off.

use std::{
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use tokio::time::Instant;
use tower::{BoxError, Layer, Service, ServiceExt as _};
use tracing::{debug, warn};

use crate::backoff;

/// kubelet's own defaults for its API client: the plugin works on kubelet's behalf.
pub const DEFAULT_QPS: u32 = 50;
pub const DEFAULT_BURST: u32 = 100;
/// The first hold without a Retry-After, doubled with each overloaded answer in a row.
const FIRST_HOLD: Duration = Duration::from_millis(200);
const MAX_HOLD: Duration = Duration::from_secs(30);
/// The longest Retry-After honoured as given.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// How often one request is sent again after an overloaded answer.
const MAX_RETRIES: u32 = 3;

/// The request rate one process may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ApiLimits {
    pub qps: u32,
    pub burst: u32,
}

impl Default for ApiLimits {
    fn default() -> Self {
        Self {
            qps: DEFAULT_QPS,
            burst: DEFAULT_BURST,
        }
    }
}

#[derive(Debug)]
struct State {
    tokens: f64,
    refilled: Instant,
    hold_until: Instant,
    overloaded_in_a_row: u32,
}

/// The gate: shared by every client of the process.
#[derive(Debug)]
pub struct Gate {
    qps: f64,
    burst: f64,
    state: Mutex<State>,
    seed: AtomicU64,
}

impl Gate {
    pub fn new(limits: ApiLimits) -> Arc<Self> {
        let now = Instant::now();
        let seed = backoff::seed();
        Arc::new(Self {
            qps: f64::from(limits.qps.max(1)),
            burst: f64::from(limits.burst.max(1)),
            state: Mutex::new(State {
                tokens: f64::from(limits.burst.max(1)),
                refilled: now,
                hold_until: now,
                overloaded_in_a_row: 0,
            }),
            seed: AtomicU64::new(seed),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding it leaves numbers only, which stay usable.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A number in [0, 1) for jitter.
    fn jitter(&self) -> f64 {
        let state = self
            .seed
            .fetch_add(backoff::STEP, Ordering::Relaxed)
            .wrapping_add(backoff::STEP);
        backoff::unit(state)
    }

    /// Waits until a request may be sent: the hold over, and a token taken.
    pub async fn admit(&self) {
        loop {
            let wait = {
                let mut s = self.state();
                let now = Instant::now();
                if now < s.hold_until {
                    s.hold_until - now
                } else {
                    let gained = now.duration_since(s.refilled).as_secs_f64() * self.qps;
                    s.tokens = (s.tokens + gained).min(self.burst);
                    s.refilled = now;
                    if s.tokens >= 1.0 {
                        s.tokens -= 1.0;
                        return;
                    }
                    Duration::from_secs_f64((1.0 - s.tokens) / self.qps)
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Notes an answer's status; true when it says the server is overloaded, which
    /// closes the hold for everyone.
    pub fn answered(&self, status: StatusCode, retry_after: Option<Duration>) -> bool {
        let overloaded = matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS
                | StatusCode::SERVICE_UNAVAILABLE
                | StatusCode::GATEWAY_TIMEOUT
        );
        let j = self.jitter();
        let mut s = self.state();
        if !overloaded {
            s.overloaded_in_a_row = 0;
            return false;
        }
        s.overloaded_in_a_row = s.overloaded_in_a_row.saturating_add(1);
        let hold = hold_for(s.overloaded_in_a_row, retry_after, j);
        let now = Instant::now();
        let until = now + hold;
        if until > s.hold_until {
            if s.hold_until <= now {
                warn!(
                    status = status.as_u16(),
                    ?retry_after,
                    ?hold,
                    "the API server is overloaded: every request of this plugin waits"
                );
            } else {
                debug!(
                    status = status.as_u16(),
                    ?hold,
                    "the API server is still overloaded"
                );
            }
            s.hold_until = until;
        }
        true
    }
}

/// How long an overloaded answer holds every request: `retry_after` (capped) up to a
/// fifth more, else the backoff for the `in_a_row`-th such answer, between half of it and
/// all of it. `jitter` in [0, 1).
fn hold_for(in_a_row: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
    match retry_after {
        Some(d) => d.min(MAX_RETRY_AFTER).mul_f64(1.0 + 0.2 * jitter),
        None => backoff::doubled(FIRST_HOLD, MAX_HOLD, in_a_row.saturating_sub(1), jitter),
    }
}

/// A Retry-After header in seconds (what kube-apiserver sends).
fn retry_after<B>(r: &Response<B>) -> Option<Duration> {
    r.headers()
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// The request again, when its body can be had again (kube's bodies are buffered).
fn again(req: &Request<Body>) -> Option<Request<Body>> {
    let body = req.body().try_clone()?;
    let mut next = Request::new(body);
    *next.method_mut() = req.method().clone();
    *next.uri_mut() = req.uri().clone();
    *next.version_mut() = req.version();
    *next.headers_mut() = req.headers().clone();
    *next.extensions_mut() = req.extensions().clone();
    Some(next)
}

/// The tower layer that puts [`Gate`] in front of a kube client's stack.
#[derive(Clone, Debug)]
pub struct ThrottleLayer {
    gate: Arc<Gate>,
}

impl ThrottleLayer {
    pub fn new(gate: Arc<Gate>) -> Self {
        Self { gate }
    }
}

impl<S> Layer<S> for ThrottleLayer {
    type Service = Throttle<S>;

    fn layer(&self, inner: S) -> Throttle<S> {
        Throttle {
            inner: Arc::new(tokio::sync::Mutex::new(inner)),
            gate: self.gate.clone(),
        }
    }
}

/// A kube client's stack behind the gate. The stack is called under a lock, released
/// before its answer is awaited, so requests still run side by side.
pub struct Throttle<S> {
    inner: Arc<tokio::sync::Mutex<S>>,
    gate: Arc<Gate>,
}

impl<S, B> Service<Request<Body>> for Throttle<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Send + 'static,
{
    type Response = Response<B>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Readiness is the inner stack's, checked under the lock in `call`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        let gate = self.gate.clone();
        Box::pin(async move {
            let mut req = req;
            let mut retries = 0;
            loop {
                let next = if retries < MAX_RETRIES {
                    again(&req)
                } else {
                    None
                };
                gate.admit().await;
                let answer = {
                    let mut s = inner.lock().await;
                    s.ready().await.map_err(Into::into)?;
                    s.call(req)
                };
                let r = answer.await.map_err(Into::into)?;
                let overloaded = gate.answered(r.status(), retry_after(&r));
                match next {
                    Some(n) if overloaded => {
                        retries += 1;
                        req = n;
                    }
                    _ => return Ok(r),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hold_honours_retry_after_and_otherwise_doubles_with_jitter() {
        // Retry-After: never earlier, at most a fifth later, capped at a minute.
        assert_eq!(
            hold_for(1, Some(Duration::from_secs(2)), 0.0),
            Duration::from_secs(2)
        );
        let late = hold_for(1, Some(Duration::from_secs(2)), 0.999);
        assert!(late > Duration::from_millis(2390) && late < Duration::from_millis(2400));
        assert_eq!(
            hold_for(1, Some(Duration::from_secs(3600)), 0.0),
            MAX_RETRY_AFTER
        );
        // Without: 200 ms, 400 ms, ... up to 30 s, each between half and all of it.
        for (n, full) in [
            (1, 200),
            (2, 400),
            (3, 800),
            (8, 25_600),
            (9, 30_000),
            (40, 30_000),
        ] {
            let full = Duration::from_millis(full);
            assert_eq!(hold_for(n, None, 0.0), full / 2, "{n}");
            assert!(
                hold_for(n, None, 0.999) <= full && hold_for(n, None, 0.999) > full.mul_f64(0.99)
            );
        }
    }

    #[test]
    fn jitter_stays_in_its_range_and_varies() {
        let g = Gate::new(ApiLimits::default());
        let v: Vec<f64> = (0..1000).map(|_| g.jitter()).collect();
        assert!(v.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(v.iter().any(|x| *x < 0.1) && v.iter().any(|x| *x > 0.9));
    }

    #[tokio::test]
    async fn the_bucket_lets_a_burst_through_then_the_rate() {
        let g = Gate::new(ApiLimits { qps: 20, burst: 5 });
        let started = std::time::Instant::now();
        for _ in 0..5 {
            g.admit().await;
        }
        assert!(
            started.elapsed() < Duration::from_millis(40),
            "the burst waited"
        );
        for _ in 0..4 {
            g.admit().await;
        }
        // Four more at 20 a second: about 200 ms.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(190), "{took:?}");
    }

    #[tokio::test]
    async fn an_overloaded_answer_holds_every_request_and_a_good_one_resets_the_backoff() {
        let g = Gate::new(ApiLimits::default());
        assert!(g.answered(
            StatusCode::TOO_MANY_REQUESTS,
            Some(Duration::from_millis(300))
        ));
        let started = std::time::Instant::now();
        g.admit().await;
        assert!(
            started.elapsed() >= Duration::from_millis(290),
            "{:?}",
            started.elapsed()
        );
        assert!(!g.answered(StatusCode::OK, None));
        assert!(!g.answered(StatusCode::NOT_FOUND, None));
        assert_eq!(g.state().overloaded_in_a_row, 0);
        for _ in 0..3 {
            assert!(g.answered(StatusCode::SERVICE_UNAVAILABLE, None));
        }
        assert_eq!(g.state().overloaded_in_a_row, 3);
    }
}
