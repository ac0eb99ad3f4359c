//! What the CLI prints: JSON and YAML with one spelling of each enum value, and the
//! tables of shares and devices.

use shareguard_proto::v1 as pb;

use super::args::Output;

/// `v` as JSON, with enum values spelled as the tables and `--phase` spell them
/// ([`plain_enums`]).
pub(super) fn json<T: serde::Serialize>(v: &T) -> anyhow::Result<String> {
    Ok(serde_json::to_string_pretty(&plain(v)?)?)
}

pub(super) fn plain<T: serde::Serialize>(v: &T) -> anyhow::Result<serde_json::Value> {
    let mut v = serde_json::to_value(v)?;
    plain_enums(&mut v);
    Ok(v)
}

/// One spelling of a phase everywhere the CLI prints one: `ENFORCED`, as in the tables,
/// the claim's status and `--phase`, not proto3 JSON's `PHASE_ENFORCED`; the same for a
/// watch event's `kind`. The gRPC API itself is unchanged.
pub(crate) fn plain_enums(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                let prefix = match k.as_str() {
                    "phase" => "PHASE_",
                    "kind" => "KIND_",
                    _ => {
                        plain_enums(x);
                        continue;
                    }
                };
                if let serde_json::Value::String(s) = x
                    && let Some(rest) = s.strip_prefix(prefix)
                {
                    *s = rest.to_owned();
                } else {
                    plain_enums(x);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(plain_enums),
        _ => {}
    }
}

/// `v` as `out` asks: JSON, the same as YAML, or `table(wide)`.
pub(super) fn print_as<T: serde::Serialize>(
    out: Output,
    v: &T,
    table: impl FnOnce(bool) -> String,
) -> anyhow::Result<()> {
    match out {
        Output::Json => println!("{}", json(v)?),
        Output::Yaml => print!("{}", serde_yaml::to_string(&plain(v)?)?),
        Output::Table => print!("{}", table(false)),
        Output::Wide => print!("{}", table(true)),
    }
    Ok(())
}

pub(crate) fn table(rows: Vec<Vec<String>>) -> String {
    let cols = rows.first().map(Vec::len).unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

pub(super) fn kv(m: &std::collections::HashMap<String, String>) -> String {
    let mut v: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
    v.sort();
    v.join(",")
}

pub(super) fn phase_name(p: i32) -> String {
    pb::Phase::try_from(p)
        .map(|p| p.as_str_name().trim_start_matches("PHASE_").to_owned())
        .unwrap_or_else(|_| p.to_string())
}

/// Shares as a table; `wide` adds the claim's uid, the pod interface the share is on,
/// its policy version and when it last changed.
pub(super) fn share_rows(shares: &[pb::ShareStatus], wide: bool) -> String {
    let mut header: Vec<String> = [
        "SHARE",
        "CLAIM",
        "DEVICE",
        "PHASE",
        "MECHANISM",
        "REQUESTED",
        "ENFORCED",
        "ABOVE RATE",
    ]
    .map(String::from)
    .to_vec();
    if wide {
        header.extend(["CLAIM UID", "INTERFACE", "POLICY", "UPDATED"].map(String::from));
    }
    header.push("REASON".into());
    let mut rows = vec![header];
    for s in shares {
        let claim = s
            .claim
            .as_ref()
            .map(|c| format!("{}/{}", c.namespace, c.name))
            .unwrap_or_default();
        let req: Vec<String> = s
            .limits
            .iter()
            .map(|l| format!("{}={}", l.name, l.requested))
            .collect();
        let enf: Vec<String> = s
            .limits
            .iter()
            .map(|l| {
                format!(
                    "{}={}",
                    l.name,
                    if l.enforced.is_empty() {
                        "-"
                    } else {
                        &l.enforced
                    }
                )
            })
            .collect();
        rows.push(vec![
            if s.share_id.is_empty() {
                "(dedicated)".into()
            } else {
                s.share_id.clone()
            },
            claim,
            s.device.clone(),
            phase_name(s.phase),
            s.mechanism.clone(),
            req.join(","),
            enf.join(","),
            s.traffic
                .as_ref()
                .map_or_else(|| "-".to_owned(), above_rate),
        ]);
        if let Some(row) = rows.last_mut() {
            if wide {
                let or_dash = |v: &str| {
                    if v.is_empty() {
                        "-".to_owned()
                    } else {
                        v.to_owned()
                    }
                };
                row.extend([
                    or_dash(s.claim.as_ref().map_or("", |c| c.uid.as_str())),
                    or_dash(
                        &s.sandbox
                            .iter()
                            .chain(&s.more_sandboxes)
                            .map(|b| b.host_interface.as_str())
                            .filter(|i| !i.is_empty())
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                    or_dash(&s.policy_version),
                    s.updated_at.as_ref().map_or_else(
                        || "-".to_owned(),
                        |t| {
                            let secs = u64::try_from(t.seconds).unwrap_or(0);
                            humantime::format_rfc3339_seconds(
                                std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs),
                            )
                            .to_string()
                        },
                    ),
                ]);
            }
            row.push(s.reason.clone());
        }
    }
    table(rows)
}

/// A bandwidth share's time and bytes above its allocated rate, per direction, e.g.
/// `to-pod 12.0s/+15.0MB from-pod 0s`: in observe, what enforcing would have held back.
pub(super) fn above_rate(t: &pb::Traffic) -> String {
    let dir = |name: &str, d: Option<&pb::DirectionTraffic>| {
        let d = d.copied().unwrap_or_default();
        if d.ms_above_rate == 0 {
            format!("{name} 0s")
        } else {
            // Display only: the exact integers are in -o json.
            #[allow(clippy::cast_precision_loss)]
            let (secs, mb) = (
                d.ms_above_rate as f64 / 1000.0,
                d.bytes_above_rate as f64 / 1e6,
            );
            format!("{name} {secs:.1}s/+{mb:.1}MB")
        }
    };
    format!(
        "{} {}",
        dir("to-pod", t.to_pod.as_ref()),
        dir("from-pod", t.from_pod.as_ref())
    )
}

/// Devices as a table; `wide` adds the DeviceClass, the rollout stage, whether the
/// mechanism enforces, and the allowed namespaces.
pub(super) fn device_rows(devices: &[pb::DeviceStatus], wide: bool) -> String {
    let mut header: Vec<String> = [
        "DEVICE",
        "DRIVER",
        "POOL",
        "KIND",
        "CAPACITY",
        "ALLOCATED",
        "FREE",
        "SHARES",
        "MECHANISMS",
    ]
    .map(String::from)
    .to_vec();
    if wide {
        header.extend(["CLASS", "STAGE", "ENFORCES", "NAMESPACES"].map(String::from));
    }
    let mut rows = vec![header];
    for d in devices {
        rows.push(vec![
            d.name.clone(),
            d.driver.clone(),
            d.pool.clone(),
            d.kind.clone(),
            kv(&d.capacity),
            kv(&d.allocated),
            kv(&d.free),
            format!(
                "{}{}",
                d.live_shares,
                if d.dedicated { " (dedicated)" } else { "" }
            ),
            d.mechanisms.join(","),
        ]);
        if wide && let Some(row) = rows.last_mut() {
            row.extend([
                d.device_class.clone(),
                d.stage.clone(),
                d.enforces.to_string(),
                if d.allowed_namespaces.is_empty() {
                    "-".to_owned()
                } else {
                    d.allowed_namespaces.join(",")
                },
            ]);
        }
    }
    let mut out = table(rows);
    for w in devices.iter().flat_map(|d| &d.warnings) {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}
