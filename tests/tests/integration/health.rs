//! The standard grpc.health.v1 service on the agent's socket.
//!
//! The test crate has no grpc.health.v1 client (no tonic-health or prost dependency), so
//! it borrows one from the API on the wire: `HealthCheckRequest { string service = 1 }` is
//! encoded exactly like `WatchSharesRequest { string device = 1 }`, and
//! `HealthCheckResponse { ServingStatus status = 1 }` exactly like `WatchSharesResponse
//! { Kind kind = 1 }`. A unary answer on the wire is a server stream of one message, so the
//! generated `watch_shares` call, re-routed to `/grpc.health.v1.Health/Check`, is a real
//! Check call whose answer decodes with `kind` holding the serving status.

use shareguard_tests::{Agent, Options, generic_device, proto as pb};
use tonic::{
    codegen::{Context, Poll, Service, http},
    transport::Channel,
};

const CHECK: &str = "/grpc.health.v1.Health/Check";
/// grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING
const SERVING: i32 = 1;

/// Sends every call on `inner` to `path`, whatever method the client named.
#[derive(Clone)]
struct Reroute {
    inner: Channel,
    path: &'static str,
}

type Req = http::Request<tonic::body::Body>;

impl Service<Req> for Reroute {
    type Response = <Channel as Service<Req>>::Response;
    type Error = <Channel as Service<Req>>::Error;
    type Future = <Channel as Service<Req>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        let mut parts = req.uri().clone().into_parts();
        parts.path_and_query = Some(http::uri::PathAndQuery::from_static(self.path));
        *req.uri_mut() =
            http::Uri::from_parts(parts).expect("only the path changed, so the URI stays valid");
        self.inner.call(req)
    }
}

/// grpc.health.v1 Check for `service`: the serving status, or the call's error.
async fn check(a: &Agent, service: &str) -> Result<i32, tonic::Status> {
    let channel = a.channel().await;
    let mut health = pb::node_agent_client::NodeAgentClient::new(Reroute {
        inner: channel,
        path: CHECK,
    });
    let mut answers = health
        .watch_shares(pb::WatchSharesRequest {
            device: service.into(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let first = answers
        .message()
        .await?
        .expect("Check answers with one message");
    assert_eq!(
        answers.message().await?,
        None,
        "Check answers with exactly one message"
    );
    Ok(first.kind)
}

#[tokio::test]
async fn health_check_reports_serving() {
    let a = Agent::start(Options::new(generic_device(
        "gen-0",
        "40Gi",
        "5Gi",
        &["team-a"],
        &[],
    )));
    // The empty name asks about the server as a whole.
    assert_eq!(check(&a, "").await.unwrap(), SERVING);
    assert_eq!(check(&a, "shareguard.v1.NodeAgent").await.unwrap(), SERVING);
    // An unknown service must not be reported healthy: this proves the answer above came
    // from a health service that looks at the name, not from anything that says OK.
    let e = check(&a, "no.such.Service").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
}
