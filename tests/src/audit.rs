//! The test cluster's API audit log (tests/cluster/audit-policy.yaml): every request
//! shareguard's ServiceAccounts made, one JSON line per stage, read from an offset so
//! that a scenario or benchmark counts only what happened while it watched.

use std::{collections::BTreeMap, fs, io::Read, path::PathBuf};

use serde_json::Value;

/// One API request, as the audit log records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub audit_id: String,
    /// get, list, watch, patch, create, update, delete, ...
    pub verb: String,
    /// `resourceclaims`, `resourceclaims/status`, `events`, ...
    pub resource: String,
    pub namespace: String,
    pub name: String,
    /// The user (`system:serviceaccount:<ns>:<name>`).
    pub user: String,
    /// The node the caller's pod-bound token names (its pod runs there), or "".
    pub node: String,
    /// The HTTP status the request was answered with (0 while a watch still runs).
    pub code: u64,
    /// When the API server received it (RFC 3339, microseconds).
    pub received: String,
    /// When the latest stage logged was reached: for a request that completed, when its
    /// answer was sent.
    pub completed: String,
    /// The first of its stages logged after the mark: `ResponseComplete` for a watch
    /// that began before it and ended after.
    pub first_stage: String,
    /// The request's body, where the policy logs it (claim status writes).
    pub body: Value,
}

impl Request {
    /// `verb resource`, e.g. `patch resourceclaims/status`.
    pub fn kind(&self) -> String {
        format!("{} {}", self.verb, self.resource)
    }

    /// How long the API server took to answer it, from the two timestamps; None for a
    /// watch (it lasts as long as the caller keeps it) and where a timestamp does not
    /// read.
    pub fn latency(&self) -> Option<std::time::Duration> {
        if self.verb == "watch" {
            return None;
        }
        let (a, b) = (
            micros_of_day(&self.received)?,
            micros_of_day(&self.completed)?,
        );
        // A request that spans midnight.
        let us = (b - a).rem_euclid(86_400_000_000);
        Some(std::time::Duration::from_micros(u64::try_from(us).ok()?))
    }
}

/// Microseconds since midnight of an RFC 3339 time in UTC as the audit log writes it
/// (`2026-12-07T05:37:01.123456Z`).
fn micros_of_day(ts: &str) -> Option<i64> {
    let time = ts.split_once('T')?.1.strip_suffix('Z')?;
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut parts = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (h, m, s) = (parts.next()??, parts.next()??, parts.next()??);
    // The fraction to microseconds: "5" is 500000, "123456789" is 123456.
    let digits: String = frac.chars().chain(std::iter::repeat('0')).take(6).collect();
    let us: i64 = digits.parse().ok()?;
    Some(((h * 60 + m) * 60 + s) * 1_000_000 + us)
}

/// The audit log of the cluster e2e.sh or bench.sh started (`SGC_AUDIT_LOG`).
#[derive(Debug, Clone)]
pub struct AuditLog {
    path: PathBuf,
}

impl AuditLog {
    pub fn from_env() -> AuditLog {
        let path = std::env::var_os("SGC_AUDIT_LOG")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                panic!("SGC_AUDIT_LOG is not set: run the scenarios with `make e2e` (tests/cluster/e2e.sh)")
            });
        AuditLog { path }
    }

    /// Where the log ends now: what [`AuditLog::since`] counts from.
    pub fn mark(&self) -> u64 {
        fs::metadata(&self.path)
            .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()))
            .len()
    }

    /// The requests logged after `mark`, one per audit ID (a watch logs a line when it
    /// starts and one when it ends), in the order they were first logged. A line the
    /// API server is still writing is left for the next read.
    pub fn since(&self, mark: u64) -> Vec<Request> {
        let mut f =
            fs::File::open(&self.path).unwrap_or_else(|e| panic!("{}: {e}", self.path.display()));
        let mut bytes = Vec::new();
        std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(mark))
            .and_then(|_| f.read_to_end(&mut bytes))
            .unwrap_or_else(|e| panic!("{}: {e}", self.path.display()));
        let text = String::from_utf8_lossy(&bytes);
        let whole = text.rfind('\n').map_or("", |end| &text[..end]);
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut out: Vec<Request> = Vec::new();
        for line in whole.lines() {
            let e: Value = serde_json::from_str(line)
                .unwrap_or_else(|err| panic!("audit line {line:?}: {err}"));
            let r = parse(&e);
            match seen.get(&r.audit_id) {
                // The later stage has the final code and time.
                Some(&i) => {
                    out[i].code = r.code;
                    out[i].completed = r.completed;
                }
                None => {
                    seen.insert(r.audit_id.clone(), out.len());
                    out.push(r);
                }
            }
        }
        out
    }
}

fn parse(e: &Value) -> Request {
    let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let obj = &e["objectRef"];
    let resource = match obj["subresource"].as_str() {
        Some(sub) => format!("{}/{sub}", s(&obj["resource"])),
        None => s(&obj["resource"]),
    };
    Request {
        audit_id: s(&e["auditID"]),
        verb: s(&e["verb"]),
        resource,
        namespace: s(&obj["namespace"]),
        name: s(&obj["name"]),
        user: s(&e["user"]["username"]),
        node: s(&e["user"]["extra"]["authentication.kubernetes.io/node-name"][0]),
        code: e["responseStatus"]["code"].as_u64().unwrap_or(0),
        received: s(&e["requestReceivedTimestamp"]),
        completed: s(&e["stageTimestamp"]),
        first_stage: s(&e["stage"]),
        body: e["requestObject"].clone(),
    }
}

/// How many of `requests` there are of each [`Request::kind`].
pub fn by_kind<'a>(requests: impl IntoIterator<Item = &'a Request>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in requests {
        *out.entry(r.kind()).or_insert(0) += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(id: &str, stage: &str, verb: &str, code: Option<u64>) -> String {
        let mut e = serde_json::json!({
            "kind": "Event", "level": "Metadata", "auditID": id, "stage": stage, "verb": verb,
            "user": {"username": "system:serviceaccount:shareguard-system:shareguard-kubelet-plugin",
                     "extra": {"authentication.kubernetes.io/node-name": ["sgc-node-1"]}},
            "objectRef": {"resource": "resourceclaims", "namespace": "ns", "name": "c",
                          "apiGroup": "resource.k8s.io", "subresource": "status"},
        });
        if let Some(c) = code {
            e["responseStatus"] = serde_json::json!({"code": c});
        }
        e.to_string()
    }

    #[test]
    fn latency_is_from_received_to_the_last_stage_and_none_for_a_watch() {
        let r = |verb: &str, received: &str, completed: &str| Request {
            audit_id: "a".into(),
            verb: verb.into(),
            resource: "resourceslices".into(),
            namespace: String::new(),
            name: String::new(),
            user: String::new(),
            node: String::new(),
            code: 200,
            received: received.into(),
            completed: completed.into(),
            first_stage: "ResponseComplete".into(),
            body: Value::Null,
        };
        let ms = |v: u64| Some(std::time::Duration::from_micros(v));
        assert_eq!(
            r(
                "get",
                "2026-12-07T05:37:01.123456Z",
                "2026-12-07T05:37:01.125956Z"
            )
            .latency(),
            ms(2_500)
        );
        assert_eq!(
            r("list", "2026-12-07T23:59:59.9Z", "2026-12-08T00:00:00.1Z").latency(),
            ms(200_000),
            "across midnight"
        );
        assert_eq!(
            r("watch", "2026-12-07T05:37:01Z", "2026-12-07T05:42:01Z").latency(),
            None
        );
        assert_eq!(r("get", "", "2026-12-07T05:37:01Z").latency(), None);
    }

    #[test]
    fn a_watch_is_one_request_and_a_half_written_line_waits() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.log");
        fs::write(
            &path,
            format!("{}\n", line("old", "ResponseComplete", "get", Some(200))),
        )
        .unwrap();
        let log = AuditLog { path: path.clone() };
        let mark = log.mark();
        let text = format!(
            "{}\n{}\n{}\n{}",
            line("w", "ResponseStarted", "watch", Some(200)),
            line("p", "ResponseComplete", "patch", Some(201)),
            line("w", "ResponseComplete", "watch", Some(200)),
            // Not yet ended by a newline: the API server is writing it.
            &line("x", "ResponseComplete", "get", Some(200))[..40],
        );
        fs::write(
            &path,
            format!(
                "{}\n{text}",
                line("old", "ResponseComplete", "get", Some(200))
            ),
        )
        .unwrap();
        let got = log.since(mark);
        let ids: Vec<&str> = got.iter().map(|r| r.audit_id.as_str()).collect();
        assert_eq!(ids, ["w", "p"], "{got:?}");
        assert_eq!(got[0].first_stage, "ResponseStarted");
        assert_eq!(got[1].kind(), "patch resourceclaims/status");
        assert_eq!(got[1].node, "sgc-node-1");
        assert_eq!(got[1].code, 201);
        assert_eq!(
            by_kind(&got),
            BTreeMap::from([
                ("patch resourceclaims/status".to_owned(), 1),
                ("watch resourceclaims/status".to_owned(), 1)
            ])
        );
    }
}
