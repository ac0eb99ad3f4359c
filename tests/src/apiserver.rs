//! A STAND-IN for kube-apiserver, in the test process: no registry these tests can reach
//! ships a kube-apiserver, so the kubelet plugin is tested against this instead. It
//! serves the endpoints the plugin uses, over plain HTTP on loopback, from an in-memory
//! object store with resourceVersions, and keeps every object as the JSON of its
//! k8s-openapi type. Where the plugin depends on how kube-apiserver refuses or rewrites
//! a write (a uid that is not the stored object's; fields of a feature gate that is
//! off), it answers as kube-apiserver does. It is not an API server: no admission, no validation beyond what
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
    uids: u64,
    items: BTreeMap<Key, Value>,
    /// Claim -> status.devices entry (driver/pool/device/shareID) -> its field manager.
    status_owners: BTreeMap<Key, BTreeMap<String, String>>,
    /// When each request arrived and its "METHOD path", in order.
    requests: Vec<(std::time::Instant, String)>,
    applies: Vec<Apply>,
    /// Every change, for watches: (resourceVersion, ADDED|MODIFIED|DELETED, key, object).
    events: Vec<(u64, &'static str, Key, Value)>,
    /// The newest resourceVersion, for watches waiting for a change.
    changed: Option<tokio::sync::watch::Sender<u64>>,
    /// Drop the consumable-capacity fields of ResourceSlices as they are written, as a
    /// real API server does with the `DRAConsumableCapacity` feature gate off.
    without_consumable_capacity: bool,
    /// While set, every request is answered with this status (and Retry-After, in
    /// seconds, when given) and changes nothing: an API server in an incident.
    overloaded: Option<(StatusCode, Option<u64>)>,
}

/// One PATCH the stand-in received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Apply {
    pub path: String,
    /// The `fieldManager` query parameter.
    pub manager: String,
    pub content_type: String,
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
        let (changed, _) = tokio::sync::watch::channel(0);
        let objects = Arc::new(Mutex::new(Objects {
            changed: Some(changed),
            ..Objects::default()
        }));
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
        o.bump(&mut v);
        o.insert(key, v);
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
            .remove(&key_of::<K>(namespace, name));
    }

    /// Every PATCH so far.
    pub fn applies(&self) -> Vec<Apply> {
        self.objects.lock().unwrap().applies.clone()
    }

    /// Every stored object of type `K`, as its type.
    pub fn list<K: Resource + DeserializeOwned>(&self) -> Vec<K> {
        let o = self.objects.lock().unwrap();
        o.items
            .iter()
            .filter(|(k, _)| k.prefix == prefix_of::<K>() && k.plural == K::URL_PATH_SEGMENT)
            .map(|(_, v)| serde_json::from_value(v.clone()).unwrap())
            .collect()
    }

    /// Deletes a cluster-scoped object, as someone else with access might.
    pub fn delete_cluster<K: Resource>(&self, name: &str) {
        self.delete::<K>("", name);
    }

    /// "METHOD path" of every request so far.
    pub fn requests(&self) -> Vec<String> {
        let o = self.objects.lock().unwrap();
        o.requests.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Every request so far with when it arrived.
    pub fn requests_timed(&self) -> Vec<(std::time::Instant, String)> {
        self.objects.lock().unwrap().requests.clone()
    }

    /// From now on every request (watches too) is answered `code`, with a Retry-After
    /// of `retry_after` seconds when given, and changes nothing: as kube-apiserver's
    /// priority and fairness (429) or a server in trouble (503) answer. Open watches
    /// end.
    pub fn overload(&self, code: u16, retry_after: Option<u64>) {
        let mut o = self.objects.lock().unwrap();
        o.overloaded = Some((StatusCode::from_u16(code).unwrap(), retry_after));
        if let Some(changed) = &o.changed {
            changed.send_modify(|_| {});
        }
    }

    /// Answers as usual again.
    pub fn recover(&self) {
        self.objects.lock().unwrap().overloaded = None;
    }

    /// From now on, ResourceSlices are stored without `allowMultipleAllocations` and
    /// without their capacities' `requestPolicy`, the apply still answering 200 with the
    /// object as stored: what kube-apiserver does with the `DRAConsumableCapacity`
    /// feature gate off (alpha and off by default in 1.34 and 1.35), whose strategy
    /// drops a disabled feature's fields on every write.
    pub fn drop_consumable_capacity_fields(&self) {
        self.objects.lock().unwrap().without_consumable_capacity = true;
    }

    /// Stores those fields again from now on: the gate turned on.
    pub fn keep_consumable_capacity_fields(&self) {
        self.objects.lock().unwrap().without_consumable_capacity = false;
    }
}

/// Strips what an API server without `DRAConsumableCapacity` does not store.
fn strip_consumable_capacity(slice: &mut Value) {
    for d in slice["spec"]["devices"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if let Some(d) = d.as_object_mut() {
            d.remove("allowMultipleAllocations");
        }
        for c in d["capacity"]
            .as_object_mut()
            .into_iter()
            .flat_map(|m| m.values_mut())
        {
            if let Some(c) = c.as_object_mut() {
                c.remove("requestPolicy");
            }
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // Ends every watch (its notifier goes), so that the graceful stop below does not
        // wait for their timeouts.
        if let Ok(mut o) = self.objects.lock() {
            o.changed = None;
        }
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
/// plural, and maybe a name and a subresource.
fn parse(path: &str) -> Option<(Key, Option<String>)> {
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
    let key = |plural: &str, name: &str| Key {
        prefix: prefix.clone(),
        plural: plural.to_owned(),
        namespace: namespace.clone(),
        name: name.to_owned(),
    };
    match rest {
        [plural] => Some((key(plural, ""), None)),
        [plural, name] => Some((key(plural, name), None)),
        [plural, name, sub] => Some((key(plural, name), Some((*sub).to_owned()))),
        _ => None,
    }
}

fn query_param(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(v);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A JSON path such as `spec.nodeName` in an object.
fn field<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k))
}

/// `a=b,c=d` (only `=`, which is all the plugin sends).
fn field_selector_matches(selector: &str, v: &Value) -> Result<bool, String> {
    for term in selector.split(',').filter(|t| !t.is_empty()) {
        let Some((k, want)) = term.split_once('=').filter(|(k, _)| !k.ends_with('!')) else {
            return Err(format!(
                "the stand-in supports only `=` in field selectors, not {term:?}"
            ));
        };
        let got = field(v, k).and_then(Value::as_str).unwrap_or("");
        if got != want {
            return Ok(false);
        }
    }
    Ok(true)
}

fn not_found(key: &Key) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} {:?} not found", key.plural, key.name),
    )
}

/// The uid precondition of DeleteOptions: a slice deleted and created anew under its
/// name is not the one the client meant. kube-apiserver answers 409 Conflict.
fn uid_conflict(current: &Value, wanted: Option<&str>) -> Option<Response> {
    let wanted = wanted.filter(|u| !u.is_empty())?;
    let have = current["metadata"]["uid"].as_str().unwrap_or("");
    (have != wanted).then(|| {
        status(
            StatusCode::CONFLICT,
            "Conflict",
            format!(
                "Precondition failed: UID in precondition: {wanted}, UID in object meta: {have}"
            ),
        )
    })
}

/// A `metadata.uid` in a server-side apply body that is not the stored object's (the
/// claim was deleted and created anew under its name). kube-apiserver has no
/// precondition for it on a patch: the uid is applied like any field, and the update's
/// validation refuses the change of an immutable field, 422 Invalid with the cause on
/// `metadata.uid` (kubernetes/kubernetes#127625 shows the message).
fn uid_invalid(current: &Value, wanted: Option<&str>) -> Option<Response> {
    let wanted = wanted.filter(|u| !u.is_empty())?;
    let have = current["metadata"]["uid"].as_str().unwrap_or("");
    if have == wanted {
        return None;
    }
    let kind = current["kind"].as_str().unwrap_or("");
    let group = current["apiVersion"]
        .as_str()
        .and_then(|v| v.split_once('/'))
        .map_or("", |(g, _)| g);
    let name = current["metadata"]["name"].as_str().unwrap_or("");
    let detail = format!("Invalid value: {wanted:?}: field is immutable");
    let qualified = if group.is_empty() {
        kind.to_owned()
    } else {
        format!("{kind}.{group}")
    };
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("{qualified} {name:?} is invalid: metadata.uid: {detail}"),
        "reason": "Invalid",
        "details": {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": "metadata.uid"}],
        },
        "code": 422,
    });
    Some(
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response(),
    )
}

impl Objects {
    fn bump(&mut self, v: &mut Value) {
        self.resource_version += 1;
        v["metadata"]["resourceVersion"] = json!(self.resource_version.to_string());
    }

    /// Stores `v` (its resourceVersion already bumped) and tells the watches.
    fn insert(&mut self, key: Key, v: Value) {
        let kind = if self.items.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        self.events
            .push((self.resource_version, kind, key.clone(), v.clone()));
        self.items.insert(key, v);
        self.notify();
    }

    fn remove(&mut self, key: &Key) -> Option<Value> {
        let mut v = self.items.remove(key)?;
        self.resource_version += 1;
        v["metadata"]["resourceVersion"] = json!(self.resource_version.to_string());
        self.events
            .push((self.resource_version, "DELETED", key.clone(), v.clone()));
        self.notify();
        Some(v)
    }

    fn create_event(&mut self, mut key: Key, body: &[u8]) -> Response {
        let mut v: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", format!("body: {e}")),
        };
        let Some(name) = v["metadata"]["name"].as_str().map(str::to_owned) else {
            return status(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name: Required value".into(),
            );
        };
        key.name = name;
        if self.items.contains_key(&key) {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("events {:?} already exists", key.name),
            );
        }
        self.uids += 1;
        v["metadata"]["uid"] = json!(format!("stand-in-event-{}", self.uids));
        self.bump(&mut v);
        self.insert(key, v.clone());
        (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            v.to_string(),
        )
            .into_response()
    }

    /// A JSON merge patch (RFC 7386) onto a stored Event.
    fn merge_event(&mut self, key: &Key, body: &[u8]) -> Response {
        fn merge(into: &mut Value, patch: &Value) {
            match (into, patch) {
                (Value::Object(i), Value::Object(p)) => {
                    for (k, v) in p {
                        if v.is_null() {
                            i.remove(k);
                        } else {
                            merge(i.entry(k.clone()).or_insert(Value::Null), v);
                        }
                    }
                }
                (i, p) => *i = p.clone(),
            }
        }
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", format!("body: {e}")),
        };
        let Some(mut v) = self.items.get(key).cloned() else {
            return not_found(key);
        };
        merge(&mut v, &patch);
        self.bump(&mut v);
        self.insert(key.clone(), v.clone());
        ok(&v)
    }

    fn notify(&self) {
        if let Some(tx) = &self.changed {
            tx.send_replace(self.resource_version);
        }
    }

    fn list(&self, key: &Key, uri: &Uri) -> Response {
        let selector = query_param(uri, "fieldSelector").unwrap_or_default();
        let mut items = Vec::new();
        for (k, v) in &self.items {
            if k.prefix != key.prefix
                || k.plural != key.plural
                || (!key.namespace.is_empty() && k.namespace != key.namespace)
            {
                continue;
            }
            match field_selector_matches(&selector, v) {
                Ok(true) => items.push(v.clone()),
                Ok(false) => {}
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", e),
            }
        }
        let kind = items
            .first()
            .and_then(|v| v["kind"].as_str())
            .map_or_else(|| "List".to_owned(), |k| format!("{k}List"));
        let api_version = key
            .prefix
            .trim_start_matches("apis/")
            .trim_start_matches("api/");
        ok(&json!({
            "apiVersion": api_version,
            "kind": kind,
            "metadata": {"resourceVersion": self.resource_version.to_string()},
            "items": items,
        }))
    }

    /// Server-side apply of a whole object (the plugin applies ResourceSlices): created
    /// when absent; otherwise the applied fields replace the stored ones. Ownership is
    /// kept per top-level field only, which is all these tests look at.
    fn apply(&mut self, key: Key, manager: &str, body: Value) -> Response {
        let now = self.items.get(&key).cloned();
        if let Some(cur) = &now
            && let Some(r) = uid_invalid(cur, body["metadata"]["uid"].as_str())
        {
            return r;
        }
        let mut v = match now {
            Some(mut cur) => {
                for (k, val) in body.as_object().into_iter().flatten() {
                    if k == "metadata" {
                        for (mk, mv) in val.as_object().into_iter().flatten() {
                            cur["metadata"][mk] = mv.clone();
                        }
                    } else {
                        cur[k] = val.clone();
                    }
                }
                cur
            }
            None => {
                let mut v = body;
                self.uids += 1;
                v["metadata"]["uid"] = json!(format!("stand-in-uid-{}", self.uids));
                v["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
                v
            }
        };
        v["metadata"]["managedFields"] = json!([{
            "manager": manager, "operation": "Apply", "apiVersion": v["apiVersion"], "fieldsType": "FieldsV1",
        }]);
        if self.without_consumable_capacity && key.plural == "resourceslices" {
            strip_consumable_capacity(&mut v);
        }
        self.bump(&mut v);
        self.insert(key, v.clone());
        ok(&v)
    }

    /// Server-side apply of `status.devices` of a claim: a list map keyed by driver,
    /// pool, device and shareID in which every field manager owns the entries it
    /// applied. An apply replaces its manager's entries with the applied ones and leaves
    /// the others' alone, as the API server's structured merge does.
    fn apply_claim_status(&mut self, key: Key, manager: &str, body: &Value) -> Response {
        let Some(mut cur) = self.items.get(&key).cloned() else {
            return not_found(&key);
        };
        if let Some(r) = uid_invalid(&cur, body["metadata"]["uid"].as_str()) {
            return r;
        }
        let entry_key = |d: &Value| -> String {
            ["driver", "pool", "device", "shareID"]
                .map(|k| d[k].as_str().unwrap_or("").to_owned())
                .join("/")
        };
        let owners = self.status_owners.entry(key.clone()).or_default();
        let mut devices: Vec<Value> = cur["status"]["devices"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|d| owners.get(&entry_key(d)).is_none_or(|m| m != manager))
            .collect();
        owners.retain(|_, m| m != manager);
        for d in body["status"]["devices"].as_array().into_iter().flatten() {
            let k = entry_key(d);
            devices.retain(|x| entry_key(x) != k);
            owners.insert(k, manager.to_owned());
            devices.push(d.clone());
        }
        cur["status"]["devices"] = json!(devices);
        self.bump(&mut cur);
        self.insert(key, cur.clone());
        ok(&cur)
    }

    fn delete(&mut self, key: &Key, body: &[u8]) -> Response {
        let Some(cur) = self.items.get(key) else {
            return not_found(key);
        };
        let opts: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        if let Some(r) = uid_conflict(cur, opts["preconditions"]["uid"].as_str()) {
            return r;
        }
        self.status_owners.remove(key);
        match self.remove(key) {
            Some(v) => ok(&v),
            None => not_found(key),
        }
    }
}

/// A watch: every change after the request's resourceVersion that matches its field
/// selector, one JSON event per line, until `timeoutSeconds` (or the client goes).
fn watch(objects: Arc<Mutex<Objects>>, key: Key, uri: &Uri) -> Response {
    let selector = query_param(uri, "fieldSelector").unwrap_or_default();
    let since: u64 = query_param(uri, "resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout: u64 = query_param(uri, "timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(timeout);
    let rx = objects
        .lock()
        .unwrap()
        .changed
        .as_ref()
        .map(tokio::sync::watch::Sender::subscribe);
    let Some(rx) = rx else {
        return status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "no notifier".into(),
        );
    };
    let stream =
        futures::stream::unfold((objects, rx, since), move |(objects, mut rx, mut since)| {
            let (key, selector) = (key.clone(), selector.clone());
            async move {
                loop {
                    let lines: String = {
                        let o = objects.lock().unwrap();
                        if o.overloaded.is_some() {
                            // An overloaded server ends its watches.
                            return None;
                        }
                        let lines = o
                            .events
                            .iter()
                            .filter(|(rv, _, k, v)| {
                                *rv > since
                                    && k.prefix == key.prefix
                                    && k.plural == key.plural
                                    && (key.namespace.is_empty() || k.namespace == key.namespace)
                                    && field_selector_matches(&selector, v) == Ok(true)
                            })
                            .map(|(_, kind, _, v)| {
                                format!("{}\n", json!({"type": kind, "object": v}))
                            })
                            .collect();
                        since = o.resource_version;
                        rx.borrow_and_update();
                        lines
                    };
                    if !lines.is_empty() {
                        return Some((
                            Ok::<_, std::convert::Infallible>(Bytes::from(lines)),
                            (objects, rx, since),
                        ));
                    }
                    tokio::select! {
                        r = rx.changed() => if r.is_err() { return None },
                        () = tokio::time::sleep_until(deadline) => return None,
                    }
                }
            }
        });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(axum::body::Body::from_stream(stream))
        .unwrap()
}

async fn handle(
    State(objects): State<Arc<Mutex<Objects>>>,
    method: Method,
    uri: Uri,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_owned();
    {
        let mut o = objects.lock().unwrap();
        if let Some((code, retry_after)) = o.overloaded {
            o.requests
                .push((std::time::Instant::now(), format!("{method} {path}")));
            let mut r = status(code, "TooManyRequests", "overloaded (test)".into());
            if let Some(s) = retry_after {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, s.to_string().parse().unwrap());
            }
            return r;
        }
    }
    if method == Method::GET && matches!(query_param(&uri, "watch").as_deref(), Some("true" | "1"))
    {
        return match parse(&path) {
            Some((key, None)) if key.name.is_empty() => {
                objects
                    .lock()
                    .unwrap()
                    .requests
                    .push((std::time::Instant::now(), format!("WATCH {path}")));
                watch(objects.clone(), key, &uri)
            }
            _ => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("no watch at {path}"),
            ),
        };
    }
    let mut o = objects.lock().unwrap();
    o.requests
        .push((std::time::Instant::now(), format!("{method} {path}")));
    let Some((key, sub)) = parse(&path) else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no route {path}"),
        );
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let manager = query_param(&uri, "fieldManager").unwrap_or_default();
    if method == Method::PATCH {
        o.applies.push(Apply {
            path: path.clone(),
            manager: manager.clone(),
            content_type: content_type.to_owned(),
        });
    }
    match (method, sub.as_deref()) {
        (Method::GET, None) if !key.name.is_empty() => match o.items.get(&key) {
            Some(v) => ok(v),
            None => not_found(&key),
        },
        (Method::GET, None) => o.list(&key, &uri),
        (Method::PATCH, sub) if content_type.starts_with("application/apply-patch") => {
            if manager.is_empty() {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "PATCH with apply requires fieldManager".into(),
                );
            }
            let body: Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => {
                    return status(StatusCode::BAD_REQUEST, "BadRequest", format!("body: {e}"));
                }
            };
            match (key.plural.as_str(), sub) {
                ("resourceslices", None) => o.apply(key, &manager, body),
                ("resourceclaims", Some("status")) => o.apply_claim_status(key, &manager, &body),
                _ => status(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "MethodNotAllowed",
                    format!("the stand-in does not apply {path}"),
                ),
            }
        }
        (Method::DELETE, None) if key.plural == "resourceslices" => o.delete(&key, &body),
        // Events, as the kubelet plugin writes them: a create, and a merge patch that
        // counts a repeat in the Event's series.
        (Method::POST, None) if key.plural == "events" && key.name.is_empty() => {
            o.create_event(key, &body)
        }
        (Method::PATCH, None)
            if key.plural == "events" && content_type.starts_with("application/merge-patch") =>
        {
            o.merge_event(&key, &body)
        }
        (method, _) => status(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("the stand-in does not serve {method} {path} ({content_type})"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_parse_to_keys() {
        let (k, sub) = parse("/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims/c1").unwrap();
        assert_eq!(
            (
                k.prefix.as_str(),
                k.plural.as_str(),
                k.namespace.as_str(),
                k.name.as_str(),
                sub
            ),
            (
                "apis/resource.k8s.io/v1",
                "resourceclaims",
                "ns1",
                "c1",
                None
            )
        );
        let (k, sub) =
            parse("/apis/resource.k8s.io/v1/namespaces/ns1/resourceclaims/c1/status").unwrap();
        assert_eq!((k.name.as_str(), sub.as_deref()), ("c1", Some("status")));
        let (k, _) = parse("/api/v1/nodes/n1").unwrap();
        assert_eq!(
            (k.prefix.as_str(), k.plural.as_str(), k.namespace.as_str()),
            ("api/v1", "nodes", "")
        );
        let (k, _) = parse("/apis/resource.k8s.io/v1/resourceslices").unwrap();
        assert_eq!((k.plural.as_str(), k.name.as_str()), ("resourceslices", ""));
        assert!(parse("/healthz").is_none());
    }

    #[test]
    fn field_selectors_match_exactly() {
        let v = json!({"spec": {"driver": "d.example.com", "nodeName": "n1"}});
        let sel = percent_decode("spec.driver%3Dd.example.com%2Cspec.nodeName%3Dn1");
        assert_eq!(field_selector_matches(&sel, &v), Ok(true));
        assert_eq!(field_selector_matches("spec.nodeName=n2", &v), Ok(false));
        assert!(field_selector_matches("spec.nodeName!=n2", &v).is_err());
    }
}
