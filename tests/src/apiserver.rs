//! A STAND-IN for kube-apiserver, in the test process: no registry these tests can reach
//! ships a kube-apiserver, so the kubelet plugin is tested against this instead. It
//! serves the endpoints the plugin uses, over plain HTTP on loopback, from an in-memory
//! object store with resourceVersions, and keeps every object as the JSON of its
//! k8s-openapi type. It is not an API server: no admission, no validation beyond what
//! the types parse, no authentication.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
};
use k8s_openapi::{
    Metadata, NamespaceResourceScope, Resource, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// Where an object lives: `api/v1` or `apis/<group>/<version>`, the resource's plural,
/// its namespace ("" for cluster-scoped) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    prefix: String,
    plural: String,
    namespace: String,
    name: String,
}

#[derive(Default)]
struct Objects {
    resource_version: u64,
    items: BTreeMap<Key, Value>,
    /// "METHOD path" of every request, in order.
    requests: Vec<String>,
}

pub struct ApiServer {
    addr: SocketAddr,
    objects: Arc<Mutex<Objects>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

fn prefix_of<K: Resource>() -> String {
    if K::GROUP.is_empty() {
        format!("api/{}", K::VERSION)
    } else {
        format!("apis/{}/{}", K::GROUP, K::VERSION)
    }
}

fn key_of<K: Resource>(namespace: &str, name: &str) -> Key {
    Key {
        prefix: prefix_of::<K>(),
        plural: K::URL_PATH_SEGMENT.to_owned(),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    }
}

impl ApiServer {
    /// Serves on a free loopback port, on a thread of its own, until dropped.
    pub fn start() -> Self {
        let objects = Arc::new(Mutex::new(Objects::default()));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let state = objects.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                let app = Router::new().fallback(handle).with_state(state);
                axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stopped.await;
                    })
                    .await
                    .unwrap();
            });
        });
        Self {
            addr,
            objects,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kubeconfig for the plugin: this server, plain HTTP, no credentials.
    pub fn write_kubeconfig(&self, path: &Path) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: {}\n\
             contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: stand-in\n\
             current-context: stand-in\nusers:\n- name: stand-in\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text).unwrap();
    }

    /// Creates or replaces a namespaced object, as a client's PUT would: the server sets
    /// its resourceVersion.
    pub fn put<K>(&self, obj: &K)
    where
        K: Resource<Scope = NamespaceResourceScope> + Metadata<Ty = ObjectMeta> + Serialize,
    {
        let meta = obj.metadata();
        let key = key_of::<K>(
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        );
        self.store(key, obj);
    }

    /// [`ApiServer::put`] for a cluster-scoped object.
    pub fn put_cluster<K>(&self, obj: &K)
    where
        K: Resource + Metadata<Ty = ObjectMeta> + Serialize,
    {
        let key = key_of::<K>("", obj.metadata().name.as_deref().unwrap_or_default());
        self.store(key, obj);
    }

    fn store<K: Resource + Serialize>(&self, key: Key, obj: &K) {
        let mut v = serde_json::to_value(obj).unwrap();
        v["apiVersion"] = json!(K::API_VERSION);
        v["kind"] = json!(K::KIND);
        let mut o = self.objects.lock().unwrap();
        o.resource_version += 1;
        v["metadata"]["resourceVersion"] = json!(o.resource_version.to_string());
        o.items.insert(key, v);
    }

    pub fn get<K: Resource + DeserializeOwned>(&self, namespace: &str, name: &str) -> Option<K> {
        let o = self.objects.lock().unwrap();
        o.items
            .get(&key_of::<K>(namespace, name))
            .map(|v| serde_json::from_value(v.clone()).unwrap())
    }

    pub fn delete<K: Resource>(&self, namespace: &str, name: &str) {
        self.objects
            .lock()
            .unwrap()
            .items
            .remove(&key_of::<K>(namespace, name));
    }

    /// "METHOD path" of every request so far.
    pub fn requests(&self) -> Vec<String> {
        self.objects.lock().unwrap().requests.clone()
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A Kubernetes `Status` answer, which clients parse into their API error.
fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn ok(v: &Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// `/api/v1/...` or `/apis/<group>/<version>/...`, then `namespaces/<ns>/` or not, the
/// plural, and maybe a name.
fn parse(path: &str) -> Option<Key> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (prefix, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => (format!("api/{v}"), rest),
        ["apis", g, v, rest @ ..] => (format!("apis/{g}/{v}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => ((*ns).to_owned(), rest),
        _ => (String::new(), rest),
    };
    match rest {
        [plural] => Some(Key {
            prefix,
            plural: (*plural).to_owned(),
            namespace,
            name: String::new(),
        }),
        [plural, name] => Some(Key {
            prefix,
            plural: (*plural).to_owned(),
            namespace,
            name: (*name).to_owned(),
        }),
        _ => None,
    }
}

async fn handle(
    State(objects): State<Arc<Mutex<Objects>>>,
    method: Method,
    uri: Uri,
    _body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    let mut o = objects.lock().unwrap();
    o.requests.push(format!("{method} {path}"));
    let Some(key) = parse(&path) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no route {path}"),
        );
    };
    match method {
        Method::GET if !key.name.is_empty() => match o.items.get(&key) {
            Some(v) => ok(v),
            None => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{} {:?} not found", key.plural, key.name),
            ),
        },
        _ => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the stand-in does not serve {method} {path}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_to_keys() {
        let k = parse("/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims/c1").unwrap();
        assert_eq!(
            (
                k.prefix.as_str(),
                k.plural.as_str(),
                k.namespace.as_str(),
                k.name.as_str()
            ),
            ("apis/resource.k8s.io/v1", "resourceclaims", "ns1", "c1")
        );
        let k = parse("/api/v1/nodes/n1").unwrap();
        assert_eq!(
            (
                k.prefix.as_str(),
                k.plural.as_str(),
                k.namespace.as_str(),
                k.name.as_str()
            ),
            ("api/v1", "nodes", "", "n1")
        );
        let k = parse("/apis/resource.k8s.io/v1/resourceslices").unwrap();
        assert_eq!((k.plural.as_str(), k.name.as_str()), ("resourceslices", ""));
        assert!(parse("/healthz").is_none());
    }
}
