//! The plugin's API clients, and its read of the claim kubelet asked about.
//!
//! Two clients over one configuration: a watch is one request that stays open for
//! minutes with nothing to read while nothing changes, so a client-wide read timeout
//! cuts it (and kube's watcher then relists and watches again, over and over); every
//! other call is short, and is bounded end to end so that none can hold up
//! NodePrepareResources or the status writer. Both pass one gate ([`crate::throttle`]):
//! a rate limit, and a hold while the API server says it is overloaded.

use std::{path::Path, time::Duration};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{
    Api, Client, Config,
    client::ClientBuilder,
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::error::{ClaimError, PluginError};
use crate::throttle::{ApiLimits, Gate, ThrottleLayer};

/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The most one API call other than a watch may take, from sending it to its response's
/// headers (and no read of its body may stall longer): well inside kubelet's 45 s for a
/// whole NodePrepareResources.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds of the two clients; tests shorten them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    pub call: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: CONNECT_TIMEOUT,
            call: CALL_TIMEOUT,
        }
    }
}

/// One client for calls, one for watches, both to the same API server as the same user.
#[derive(Clone)]
pub struct Clients {
    /// Every call but a watch, each made through [`Clients::bounded`].
    pub calls: Client,
    /// Watches only: no read timeout (the server ends a watch after its
    /// `timeoutSeconds`, and kube's watcher has its own idle timeout above that).
    pub watches: Client,
    pub timeouts: Timeouts,
}

/// The configurations of [`Clients`], from the one the kubeconfig or the pod gave:
/// (calls, watches).
pub fn configs(base: Config, t: Timeouts) -> (Config, Config) {
    let mut calls = base.clone();
    // Overloaded answers are retried by the gate, for every request at once.
    calls.default_retry = false;
    calls.connect_timeout = Some(t.connect);
    calls.read_timeout = Some(t.call);
    calls.write_timeout = Some(t.call);
    // The read timeout counts from the request sent, not from when a pooled connection
    // went idle: otherwise a connection unused for longer than the timeout fails the
    // next call on it at once.
    calls.reset_reader_on_write = true;
    let mut watches = base;
    watches.default_retry = false;
    watches.connect_timeout = Some(t.connect);
    watches.read_timeout = None;
    watches.write_timeout = Some(t.call);
    (calls, watches)
}

impl Clients {
    pub fn new(base: Config, t: Timeouts, limits: ApiLimits) -> Result<Self, PluginError> {
        let (calls, watches) = configs(base, t);
        let gate = ThrottleLayer::new(Gate::new(limits));
        let client = |c: Config| {
            ClientBuilder::try_from(c)
                .map(|b| b.with_layer(&gate).build())
                .map_err(|e| PluginError::KubeConfig(e.to_string()))
        };
        Ok(Self {
            calls: client(calls)?,
            watches: client(watches)?,
            timeouts: t,
        })
    }

    /// Runs one call of the calls client with its bound, end to end: the read timeout
    /// alone starts again with every byte, so a server that trickles a body would hold
    /// the call without end.
    pub async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, kube::Error> {
        match tokio::time::timeout(self.timeouts.call, call).await {
            Ok(r) => r,
            Err(_) => Err(kube::Error::Service(Box::new(CallTimedOut(
                self.timeouts.call,
            )))),
        }
    }
}

/// An API call that took longer than [`Timeouts::call`].
#[derive(Debug, thiserror::Error)]
#[error("no complete answer from the API server within {0:?}")]
pub struct CallTimedOut(pub Duration);

/// The configuration: the kubeconfig given, else the in-cluster config, else the
/// kubeconfig `$KUBECONFIG` names.
pub async fn config(kubeconfig: Option<&Path>) -> Result<Config, PluginError> {
    match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| PluginError::KubeConfig(format!("reading {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| PluginError::KubeConfig(format!("{}: {e}", path.display())))
        }
        None => match Config::incluster() {
            Ok(c) => Ok(c),
            Err(in_cluster) => Config::from_kubeconfig(&KubeConfigOptions::default())
                .await
                .map_err(|e| {
                    PluginError::KubeConfig(format!(
                        "not in a cluster ({in_cluster}), and no kubeconfig: {e}"
                    ))
                }),
        },
    }
}

#[derive(Clone)]
pub struct Cluster {
    clients: Clients,
    node: String,
}

impl Cluster {
    pub fn new(clients: Clients, node: String) -> Self {
        Self { clients, node }
    }

    pub fn clients(&self) -> &Clients {
        &self.clients
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub async fn claim(&self, namespace: &str, name: &str) -> Result<ResourceClaim, ClaimError> {
        let api = Api::<ResourceClaim>::namespaced(self.clients.calls.clone(), namespace);
        self.clients
            .bounded(api.get(name))
            .await
            .map_err(|source| ClaimError::Api {
                what: format!("ResourceClaim {namespace}/{name}"),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use k8s_openapi::api::resource::v1::ResourceSlice;
    use kube::api::{WatchEvent, WatchParams};
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    fn base(url: &str) -> Config {
        Config::new(url.parse().unwrap())
    }

    #[test]
    fn the_watch_client_has_no_read_timeout_and_the_other_a_bounded_one() {
        let t = Timeouts::default();
        let (calls, watches) = configs(base("http://127.0.0.1:1"), t);
        assert_eq!(calls.read_timeout, Some(CALL_TIMEOUT));
        assert!(calls.reset_reader_on_write);
        assert_eq!(calls.connect_timeout, Some(CONNECT_TIMEOUT));
        assert_eq!(watches.read_timeout, None, "a watch idles between events");
        assert_eq!(watches.connect_timeout, Some(CONNECT_TIMEOUT));
        assert_eq!(calls.cluster_url, watches.cluster_url);
    }

    /// Accepts one connection, reads the request, and answers with `parts`, waiting
    /// `gap` before each but the first; None: never answers.
    async fn server(parts: Option<Vec<String>>, gap: Duration) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut req = Vec::new();
            let mut buf = [0u8; 4096];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = conn.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                req.extend_from_slice(&buf[..n]);
            }
            let Some(parts) = parts else {
                // Holds the connection open, silent.
                tokio::time::sleep(Duration::from_secs(60)).await;
                return;
            };
            for (i, p) in parts.iter().enumerate() {
                if i > 0 {
                    tokio::time::sleep(gap).await;
                }
                if conn.write_all(p.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
        url
    }

    fn chunk(s: &str) -> String {
        format!("{:x}\r\n{s}\r\n", s.len())
    }

    fn event(name: &str) -> String {
        format!(
            "{{\"type\":\"ADDED\",\"object\":{{\"apiVersion\":\"resource.k8s.io/v1\",\"kind\":\"ResourceSlice\",\"metadata\":{{\"name\":\"{name}\",\"resourceVersion\":\"1\"}},\"spec\":{{\"driver\":\"d.example.com\",\"pool\":{{\"name\":\"p\",\"generation\":1,\"resourceSliceCount\":1}}}}}}}}\n"
        )
    }

    fn short() -> Timeouts {
        Timeouts {
            connect: Duration::from_secs(2),
            call: Duration::from_millis(300),
        }
    }

    /// A watch with nothing to report for longer than a call may take goes on: the
    /// event after the quiet spell arrives.
    #[tokio::test]
    async fn a_quiet_watch_outlives_the_call_timeout() {
        let headers = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
        let parts = vec![
            format!("{headers}{}", chunk(&event("a"))),
            chunk(&event("b")),
            "0\r\n\r\n".to_owned(),
        ];
        let url = server(Some(parts), Duration::from_millis(1000)).await;
        let clients = Clients::new(base(&url), short(), ApiLimits::default()).unwrap();
        let api = Api::<ResourceSlice>::all(clients.watches);
        let stream = api.watch(&WatchParams::default(), "0").await.unwrap();
        use futures::TryStreamExt;
        let events: Vec<WatchEvent<ResourceSlice>> = stream.try_collect().await.unwrap();
        let names: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                WatchEvent::Added(s) => s.metadata.name.clone(),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["a", "b"]);
    }

    /// A call to a server that never answers fails after the call timeout, not never.
    #[tokio::test]
    async fn a_call_to_a_silent_server_fails_within_its_bound() {
        let url = server(None, Duration::ZERO).await;
        let clients = Clients::new(base(&url), short(), ApiLimits::default()).unwrap();
        let start = Instant::now();
        let api = Api::<ResourceSlice>::all(clients.calls.clone());
        let r = clients.bounded(api.get("x")).await;
        assert!(r.is_err(), "{r:?}");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }

    /// A server that answers a call's headers at once and then trickles its body, a
    /// byte now and then, never inside the read timeout's reach: the call's bound
    /// still ends it.
    #[tokio::test]
    async fn a_trickling_call_is_cut_by_its_bound() {
        let headers =
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n";
        let mut parts = vec![headers.to_owned()];
        parts.extend((0..20).map(|_| " ".to_owned()));
        let url = server(Some(parts), Duration::from_millis(100)).await;
        let clients = Clients::new(base(&url), short(), ApiLimits::default()).unwrap();
        let start = Instant::now();
        let api = Api::<ResourceSlice>::all(clients.calls.clone());
        let r = clients.bounded(api.get("x")).await;
        let e = r.unwrap_err();
        assert!(e.to_string().contains("no complete answer"), "{e}");
        assert!(
            start.elapsed() < Duration::from_millis(1900),
            "{:?}",
            start.elapsed()
        );
    }
}
