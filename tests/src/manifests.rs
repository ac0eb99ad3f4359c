//! Kubernetes manifests read as their types: each document through the k8s-openapi type
//! its apiVersion and kind name, and back, with no field lost. Shared by the checks of
//! deploy/*.yaml (tests/tests/integration/deploy.rs) and of the Helm chart's renders
//! (tests/tests/integration/chart.rs), so both hold manifests to the same standard.
//!
//! k8s-openapi's Deserialize skips unknown fields, as the API server does (it drops them,
//! with at most a warning): a misspelled `readOnlyRootFileSystem` would parse and
//! silently do nothing. So each document goes through its type and back to JSON, and
//! must come back equal: a field the type does not know is missing after the round trip.

use std::collections::BTreeSet;

/// The Prometheus Operator's PodMonitor (monitoring.coreos.com/v1), a CRD that
/// k8s-openapi does not have: the part of its schema these manifests use. A field outside
/// it is refused; add it here after checking it in the operator's CRD.
pub mod pod_monitor {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct PodMonitor {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: Spec,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Spec {
        pub selector: LabelSelector,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub namespace_selector: Option<NamespaceSelector>,
        pub pod_metrics_endpoints: Vec<Endpoint>,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct NamespaceSelector {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub any: Option<bool>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub match_names: Option<Vec<String>>,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Endpoint {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub port: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub path: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub interval: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub relabelings: Option<Vec<Relabeling>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub authorization: Option<Authorization>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub scheme: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub tls_config: Option<SafeTlsConfig>,
    }

    /// SafeTLSConfig: TLS settings from Secrets or ConfigMaps in the monitor's namespace
    /// (the chart's tlsConfig value, with metrics TLS on).
    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct SafeTlsConfig {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub ca: Option<SecretOrConfigMap>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub cert: Option<SecretOrConfigMap>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub key_secret: Option<SecretKeySelector>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub server_name: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub insecure_skip_verify: Option<bool>,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct SecretOrConfigMap {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub secret: Option<SecretKeySelector>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub config_map: Option<SecretKeySelector>,
    }

    /// SafeAuthorization: a credential from a Secret in the monitor's namespace.
    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Authorization {
        #[serde(rename = "type")]
        pub kind: String,
        pub credentials: SecretKeySelector,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields)]
    pub struct SecretKeySelector {
        pub name: String,
        pub key: String,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Relabeling {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub source_labels: Option<Vec<String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub target_label: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub action: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub regex: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub replacement: Option<String>,
    }
}

/// The Prometheus Operator's PrometheusRule (monitoring.coreos.com/v1), a CRD that
/// k8s-openapi does not have: the part of its schema the chart's rules use, each field
/// as the operator's CRD spells it.
pub mod prometheus_rule {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct PrometheusRule {
        pub api_version: String,
        pub kind: String,
        pub metadata: ObjectMeta,
        pub spec: Spec,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields)]
    pub struct Spec {
        pub groups: Vec<Group>,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields)]
    pub struct Group {
        pub name: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub interval: Option<String>,
        pub rules: Vec<Rule>,
    }

    #[derive(Deserialize, Serialize)]
    #[serde(deny_unknown_fields)]
    pub struct Rule {
        #[serde(skip_serializing_if = "Option::is_none")]
        pub record: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub alert: Option<String>,
        pub expr: String,
        #[serde(rename = "for", skip_serializing_if = "Option::is_none")]
        pub for_: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub labels: Option<BTreeMap<String, String>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub annotations: Option<BTreeMap<String, String>>,
    }
}

/// The first place where `after` (the round trip) differs from `before` (the manifest),
/// as a JSON path, or None when they are equal.
pub fn first_difference(
    before: &serde_json::Value,
    after: &serde_json::Value,
    path: &str,
) -> Option<String> {
    use serde_json::Value as J;
    match (before, after) {
        (J::Object(a), J::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let p = format!("{path}.{k}");
                match (a.get(k), b.get(k)) {
                    (Some(_), None) => {
                        return Some(format!(
                            "{p}: not a field of the type (misspelled or misplaced?)"
                        ));
                    }
                    (None, Some(x)) => return Some(format!("{p}: added by the round trip: {x}")),
                    (Some(x), Some(y)) => {
                        if let Some(d) = first_difference(x, y, &p) {
                            return Some(d);
                        }
                    }
                    (None, None) => unreachable!(),
                }
            }
            None
        }
        (J::Array(a), J::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (x, y))| first_difference(x, y, &format!("{path}[{i}]"))),
        _ if before == after => None,
        _ => Some(format!(
            "{path}: {before} in the manifest, {after} after the round trip"
        )),
    }
}

/// `doc` as a `T` and back: Ok when nothing is lost or changed.
pub fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    doc: &serde_json::Value,
) -> Result<(), String> {
    let typed: T = serde_json::from_value(doc.clone())
        .map_err(|e| format!("not a {}: {e}", std::any::type_name::<T>()))?;
    let back = serde_json::to_value(&typed).unwrap();
    match first_difference(doc, &back, "$") {
        None => Ok(()),
        Some(d) => Err(d),
    }
}

/// Checks one document against the type its apiVersion and kind name; a pair this test
/// does not know is an error.
pub fn check_document(doc: &serde_json::Value) -> Result<(), String> {
    use k8s_openapi::api::{
        admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding},
        apps::v1::DaemonSet,
        batch::v1::Job,
        core::v1::{ConfigMap, Namespace, Pod, Secret, Service, ServiceAccount},
        rbac::v1::{ClusterRole, ClusterRoleBinding},
        resource::v1::{DeviceClass, ResourceClaimTemplate},
    };
    let api = doc["apiVersion"].as_str().unwrap_or("(none)");
    let kind = doc["kind"].as_str().unwrap_or("(none)");
    match (api, kind) {
        ("v1", "Namespace") => round_trip::<Namespace>(doc),
        ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(doc),
        ("v1", "ConfigMap") => round_trip::<ConfigMap>(doc),
        ("v1", "Secret") => round_trip::<Secret>(doc),
        ("v1", "Pod") => round_trip::<Pod>(doc),
        ("v1", "Service") => round_trip::<Service>(doc),
        ("batch/v1", "Job") => round_trip::<Job>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<DaemonSet>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<ClusterRoleBinding>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy") => {
            round_trip::<ValidatingAdmissionPolicy>(doc)
        }
        ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding") => {
            round_trip::<ValidatingAdmissionPolicyBinding>(doc)
        }
        ("resource.k8s.io/v1", "DeviceClass") => round_trip::<DeviceClass>(doc),
        ("resource.k8s.io/v1", "ResourceClaimTemplate") => round_trip::<ResourceClaimTemplate>(doc),
        ("monitoring.coreos.com/v1", "PodMonitor") => round_trip::<pod_monitor::PodMonitor>(doc),
        ("monitoring.coreos.com/v1", "PrometheusRule") => {
            round_trip::<prometheus_rule::PrometheusRule>(doc)
        }
        _ => Err(format!(
            "apiVersion {api:?} kind {kind:?}: not a type this test knows"
        )),
    }
}
