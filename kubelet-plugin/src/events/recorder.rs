//! Writes [`Notice`]s as `events.k8s.io/v1` Events, the way kubectl expects to show
//! them: an Event repeated within [`SERIES_WINDOW`] is one Event whose `series.count`
//! grows (`kubectl get events` shows "(x4 over 3m)"), not a new object each time; and no
//! object gets more than [`BURST`] Events plus one per [`REFILL`] (client-go's spam
//! filter, with its figures), so a claim kubelet retries every few seconds cannot flood
//! the API server. The API calls go through [`EventApi`], faked in the tests.

use std::{
    collections::HashMap,
    future::Future,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use tracing::{debug, warn};

use super::notice::Notice;
use crate::claims::ReservedPod;

/// A repeat within this long of the last one adds to its series (client-go's and
/// kube's figure).
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// Events one object may get at once ...
pub const BURST: u32 = 25;
/// ... and one more per this long after that.
pub const REFILL: Duration = Duration::from_secs(5 * 60);

/// events.k8s.io's limit on `note`.
const NOTE_MAX: usize = 1024;
/// events.k8s.io's limit on `reportingInstance`.
const INSTANCE_MAX: usize = 128;
/// `reportingController`: a qualified name, the same for every driver (the note names
/// the driver).
pub const CONTROLLER: &str = "shareguard/kubelet-plugin";

/// The API calls the recorder makes; [`super::KubeEvents`] is the real one.
pub trait EventApi: Send + Sync {
    fn create(&self, event: Event) -> impl Future<Output = Result<(), kube::Error>> + Send;
    /// A merge patch of `series` onto Event `name`.
    fn patch_series(
        &self,
        namespace: &str,
        name: &str,
        series: EventSeries,
    ) -> impl Future<Output = Result<(), kube::Error>> + Send;
    /// The pods in `status.reservedFor` of claim `namespace/name`, if it is still the
    /// claim of `uid`; with `recent`, as the plugin last read the claim where it did
    /// (for news that is not trouble: a pod reserved since goes without it).
    fn claim_pods(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        recent: bool,
    ) -> impl Future<Output = Result<Vec<ReservedPod>, kube::Error>> + Send;
}

/// A claim, as the plugin knows it from kubelet or the agent.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClaimObject {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimObject {
    fn reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("resource.k8s.io/v1".into()),
            kind: Some("ResourceClaim".into()),
            namespace: Some(self.namespace.clone()),
            name: Some(self.name.clone()),
            uid: Some(self.uid.clone()),
            ..Default::default()
        }
    }

    fn pod(&self, p: &ReservedPod) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            // A claim's pods are in its namespace.
            namespace: Some(self.namespace.clone()),
            name: Some(p.name.clone()),
            uid: Some(p.uid.clone()),
            ..Default::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SeriesKey {
    /// The object's uid: a claim or pod created anew under a name is another object.
    object: String,
    notice: Notice,
}

struct Series {
    namespace: String,
    name: String,
    count: i32,
    last: Instant,
}

struct Bucket {
    tokens: u32,
    refilled: Instant,
}

impl Bucket {
    fn take(&mut self, now: Instant) -> bool {
        let gained = now.duration_since(self.refilled).as_secs() / REFILL.as_secs();
        if gained > 0 {
            let gained = u32::try_from(gained).unwrap_or(u32::MAX);
            self.tokens = self.tokens.saturating_add(gained).min(BURST);
            self.refilled += REFILL * gained;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

pub struct Recorder<A> {
    api: A,
    instance: String,
    series: HashMap<SeriesKey, Series>,
    buckets: HashMap<String, Bucket>,
    /// Events not written because their object was over its budget.
    pub dropped: u64,
}

impl<A: EventApi> Recorder<A> {
    /// `node` names this instance in `reportingInstance`.
    pub fn new(api: A, node: &str) -> Self {
        let mut instance = format!("kubelet-plugin-{node}");
        truncate(&mut instance, INSTANCE_MAX);
        Self {
            api,
            instance,
            series: HashMap::new(),
            buckets: HashMap::new(),
            dropped: 0,
        }
    }

    /// A warning on the claim and on each pod it is reserved for (the pods are what a
    /// user looks at), the pods read from the API server now, so that a pod reserved
    /// since hears of the trouble too. A normal notice (a share enforced) on the pods
    /// alone, as the plugin last read them: the claim's own status already says so
    /// (its `Enforced` condition, with the time it turned), and every claim gets one,
    /// so the claim's copy and a GET were two of the API requests each claim cost. On
    /// the claim only when no pod can be named.
    pub async fn record(&mut self, claim: &ClaimObject, notice: &Notice) {
        let normal = notice.kind == super::notice::Kind::Normal;
        let mut objects = match self
            .api
            .claim_pods(&claim.namespace, &claim.name, &claim.uid, normal)
            .await
        {
            Ok(pods) => pods.iter().map(|p| claim.pod(p)).collect(),
            Err(e) => {
                debug!(claim = %claim.name, namespace = %claim.namespace, error = %e, "reading the claim's pods for an event; the event goes on the claim only");
                Vec::new()
            }
        };
        if !normal || objects.is_empty() {
            objects.insert(0, claim.reference());
        }
        for o in objects {
            self.publish(&o, notice, Instant::now()).await;
        }
    }

    async fn publish(&mut self, regarding: &ObjectReference, notice: &Notice, now: Instant) {
        let object = regarding.uid.clone().unwrap_or_default();
        self.series
            .retain(|_, s| now.duration_since(s.last) < SERIES_WINDOW);
        self.buckets.retain(|_, b| {
            // A full bucket is as good as none.
            b.tokens < BURST || now.duration_since(b.refilled) < REFILL
        });
        let bucket = self.buckets.entry(object.clone()).or_insert(Bucket {
            tokens: BURST,
            refilled: now,
        });
        if !bucket.take(now) {
            self.dropped += 1;
            debug!(object = ?regarding.name, reason = notice.reason, "event not written: the object had its share of events");
            return;
        }
        let key = SeriesKey {
            object,
            notice: notice.clone(),
        };
        if let Some(s) = self.series.get_mut(&key) {
            s.count += 1;
            s.last = now;
            let series = EventSeries {
                count: s.count,
                last_observed_time: MicroTime(Timestamp::now()),
            };
            match self.api.patch_series(&s.namespace, &s.name, series).await {
                Ok(()) => return,
                // Gone (its TTL on the API server is an hour by default): a new one.
                Err(e) => {
                    debug!(event = %s.name, error = %e, "adding to an event's series failed; writing a new event");
                    self.series.remove(&key);
                }
            }
        }
        let event = self.event(regarding, notice);
        let (namespace, name) = (
            event.metadata.namespace.clone().unwrap_or_default(),
            event.metadata.name.clone().unwrap_or_default(),
        );
        match self.api.create(event).await {
            Ok(()) => {
                self.series.insert(
                    key,
                    Series {
                        namespace,
                        name,
                        count: 1,
                        last: now,
                    },
                );
            }
            Err(e) => {
                warn!(object = ?regarding.name, kind = ?regarding.kind, reason = notice.reason, error = %e, "writing an event failed");
            }
        }
    }

    fn event(&self, regarding: &ObjectReference, notice: &Notice) -> Event {
        let now = Timestamp::now();
        let mut note = notice.note.clone();
        truncate(&mut note, NOTE_MAX);
        Event {
            metadata: ObjectMeta {
                // As client-go names them: the object's name and the time.
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or("shareguard"),
                    now.as_nanosecond()
                )),
                namespace: regarding.namespace.clone(),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(notice.kind.as_str().into()),
            reason: Some(notice.reason.into()),
            action: Some(notice.action.into()),
            note: Some(note),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(CONTROLLER.into()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        }
    }
}

/// Cuts `s` to at most `max` bytes, on a character boundary.
fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::events::notice::{self, Kind};

    /// The API server as the recorder sees it: what was created and patched.
    #[derive(Clone, Default)]
    struct Fake {
        created: Arc<Mutex<Vec<Event>>>,
        patched: Arc<Mutex<Vec<(String, i32)>>>,
        pods: Vec<ReservedPod>,
        /// Patches answer 404, as for an Event the API server let expire.
        expired: bool,
    }

    fn not_found() -> kube::Error {
        kube::Error::Api(Box::new(
            serde_json::from_value(serde_json::json!({"status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"}))
                .unwrap(),
        ))
    }

    impl EventApi for Fake {
        async fn create(&self, event: Event) -> Result<(), kube::Error> {
            self.created.lock().unwrap().push(event);
            Ok(())
        }
        async fn patch_series(
            &self,
            _: &str,
            name: &str,
            s: EventSeries,
        ) -> Result<(), kube::Error> {
            if self.expired {
                return Err(not_found());
            }
            self.patched
                .lock()
                .unwrap()
                .push((name.to_owned(), s.count));
            Ok(())
        }
        async fn claim_pods(
            &self,
            _: &str,
            _: &str,
            _: &str,
            _: bool,
        ) -> Result<Vec<ReservedPod>, kube::Error> {
            Ok(self.pods.clone())
        }
    }

    fn claim() -> ClaimObject {
        ClaimObject {
            namespace: "team-a".into(),
            name: "bw".into(),
            uid: "c-uid".into(),
        }
    }

    fn refused(message: &str) -> Notice {
        notice::refused("w1", "net.example.com", Some("ResourceExhausted"), message)
    }

    #[tokio::test]
    async fn the_claim_and_each_pod_get_the_event() {
        let fake = Fake {
            pods: vec![ReservedPod {
                name: "p1".into(),
                uid: "p-uid".into(),
            }],
            ..Default::default()
        };
        let mut r = Recorder::new(fake.clone(), "w1");
        r.record(&claim(), &refused("full")).await;
        let created = fake.created.lock().unwrap();
        let on: Vec<_> = created
            .iter()
            .map(|e| {
                let o = e.regarding.as_ref().unwrap();
                (
                    o.kind.clone().unwrap(),
                    o.name.clone().unwrap(),
                    e.metadata.namespace.clone().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            on,
            [
                (
                    "ResourceClaim".to_owned(),
                    "bw".to_owned(),
                    "team-a".to_owned()
                ),
                ("Pod".to_owned(), "p1".to_owned(), "team-a".to_owned())
            ]
        );
        let e = &created[0];
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some("CapacityExceeded"));
        assert_eq!(e.reporting_controller.as_deref(), Some(CONTROLLER));
        assert_eq!(e.reporting_instance.as_deref(), Some("kubelet-plugin-w1"));
        assert!(e.metadata.name.as_deref().unwrap().starts_with("bw."));
    }

    #[tokio::test]
    async fn a_share_enforced_is_told_on_the_pods_alone_and_on_the_claim_without_pods() {
        let enforced = Notice {
            kind: Kind::Normal,
            reason: "ShareEnforced",
            action: notice::ENFORCE,
            note: "enforced".into(),
        };
        let on = |fake: &Fake| -> Vec<String> {
            fake.created
                .lock()
                .unwrap()
                .iter()
                .map(|e| e.regarding.as_ref().unwrap().kind.clone().unwrap())
                .collect()
        };
        let fake = Fake {
            pods: vec![
                ReservedPod {
                    name: "p1".into(),
                    uid: "p1-uid".into(),
                },
                ReservedPod {
                    name: "p2".into(),
                    uid: "p2-uid".into(),
                },
            ],
            ..Default::default()
        };
        let mut r = Recorder::new(fake.clone(), "w1");
        r.record(&claim(), &enforced).await;
        assert_eq!(on(&fake), ["Pod", "Pod"]);

        let fake = Fake::default();
        let mut r = Recorder::new(fake.clone(), "w1");
        r.record(&claim(), &enforced).await;
        assert_eq!(on(&fake), ["ResourceClaim"], "not lost without a pod");
    }

    #[tokio::test]
    async fn a_repeat_grows_the_series_and_another_note_is_another_event() {
        let fake = Fake::default();
        let mut r = Recorder::new(fake.clone(), "w1");
        for _ in 0..3 {
            r.record(&claim(), &refused("full")).await;
        }
        r.record(&claim(), &refused("fuller")).await;
        let created = fake.created.lock().unwrap();
        assert_eq!(created.len(), 2, "one per note");
        let first = created[0].metadata.name.clone().unwrap();
        assert_eq!(
            *fake.patched.lock().unwrap(),
            [(first.clone(), 2), (first, 3)]
        );
    }

    #[tokio::test]
    async fn an_expired_event_is_written_anew() {
        let fake = Fake {
            expired: true,
            ..Default::default()
        };
        let mut r = Recorder::new(fake.clone(), "w1");
        r.record(&claim(), &refused("full")).await;
        r.record(&claim(), &refused("full")).await;
        assert_eq!(fake.created.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn an_object_gets_its_burst_then_one_event_per_refill() {
        let fake = Fake::default();
        let mut r = Recorder::new(fake.clone(), "w1");
        let o = claim().reference();
        let t0 = Instant::now();
        // Different notes, so that none is a repeat: each would be its own Event.
        for i in 0..BURST + 5 {
            r.publish(&o, &refused(&format!("n{i}")), t0).await;
        }
        assert_eq!(fake.created.lock().unwrap().len(), BURST as usize);
        assert_eq!(r.dropped, 5);
        r.publish(&o, &refused("later"), t0 + REFILL).await;
        r.publish(&o, &refused("later still"), t0 + REFILL).await;
        assert_eq!(fake.created.lock().unwrap().len(), BURST as usize + 1);
        // Another object has its own budget.
        let mut other = o.clone();
        other.uid = Some("other".into());
        r.publish(&other, &refused("x"), t0).await;
        assert_eq!(fake.created.lock().unwrap().len(), BURST as usize + 2);
    }

    #[test]
    fn a_long_note_is_cut_on_a_character_boundary() {
        let mut s = "é".repeat(600);
        truncate(&mut s, NOTE_MAX);
        assert!(s.len() <= NOTE_MAX && s.chars().all(|c| c == 'é'));
        let _ = Kind::Normal;
    }
}
