//! `shareguard slo`: each class's SLO figures beside their objectives, and the verdict
//! (promote, hold, roll back) with its reasons. The agent decides; this only prints.

use std::{fmt::Write as _, process::ExitCode};

use shareguard_proto::v1::{self as pb, node_agent_client::NodeAgentClient};
use tonic::transport::Channel;

use crate::slo::{VerdictKind, verdict::fmt};

fn value(v: Option<f64>, unit: &str) -> String {
    v.map_or_else(|| "-".to_owned(), |v| fmt(v, unit))
}

/// The table for one class.
fn class_table(c: &pb::ClassSlo) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        out,
        "CLASS {}  stage {}  devices {}",
        c.device_class,
        c.stage,
        c.devices.join(",")
    );
    let _ = writeln!(out, "VERDICT {}", c.verdict.to_uppercase());
    for r in &c.reasons {
        let _ = writeln!(out, "  - {r}");
    }
    let mut rows = vec![vec![
        "FIGURE".to_owned(),
        format!("WINDOW {}", c.window),
        format!("LAST {}", c.short_window),
        "OBJECTIVE".to_owned(),
        "SAMPLES".to_owned(),
        "STATUS".to_owned(),
        "NOTE".to_owned(),
    ]];
    for f in &c.figures {
        let objective = match f.objective {
            Some(o) => format!("{} {}", f.comparison, fmt(o, &f.unit)),
            None => "-".to_owned(),
        };
        let status = if f.enforcement && f.status == "missed" {
            "MISSED (enforcement)".to_owned()
        } else {
            f.status.clone()
        };
        rows.push(vec![
            f.name.clone(),
            value(f.value, &f.unit),
            value(f.short_value, &f.unit),
            objective,
            f.samples.to_string(),
            status,
            f.note.clone(),
        ]);
    }
    out.push_str(&crate::cli::table(rows));
    let refusals: Vec<String> = c
        .refusals
        .iter()
        .map(|(reason, n)| format!("{reason} {n}"))
        .collect();
    let _ = writeln!(
        out,
        "REFUSALS over {}: {} of {} claims{}",
        c.window,
        c.refusals.values().sum::<u64>(),
        c.claims,
        if refusals.is_empty() {
            String::new()
        } else {
            format!(" ({})", refusals.join(", "))
        }
    );
    for r in &c.read_back {
        let _ = writeln!(
            out,
            "READ BACK {}: allocated {}, requested {} by {} share(s) that should be enforced, read back {}, ratio {}",
            r.capacity,
            r.allocated,
            r.requested,
            r.shares,
            r.read_back,
            value(r.ratio, "ratio")
        );
    }
    let _ = match c.recovery_seconds {
        Some(s) => writeln!(out, "RECOVERY {}", fmt(s, "seconds")),
        None => writeln!(
            out,
            "RECOVERY not complete: {} share(s) not verified yet",
            c.unverified_shares
        ),
    };
    out
}

pub fn table(r: &pb::GetSloResponse) -> String {
    r.classes
        .iter()
        .map(class_table)
        .collect::<Vec<_>>()
        .join("\n")
}

/// `slo --check`'s exit status for the classes shown: the worst verdict among them.
/// A verdict this binary does not know (a newer agent's) counts as hold: a gate must
/// not pass on what it cannot read.
fn check_status(r: &pb::GetSloResponse) -> u8 {
    r.classes
        .iter()
        .map(|c| {
            let kind = VerdictKind::ALL.into_iter().find(|k| k.name() == c.verdict);
            match kind {
                Some(VerdictKind::Promote) => 0,
                Some(VerdictKind::RollBack) => 4,
                Some(VerdictKind::Hold) | None => 3,
            }
        })
        .max()
        .unwrap_or(0)
}

pub async fn run(
    c: &mut NodeAgentClient<Channel>,
    class: Option<String>,
    check: bool,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let r = c
        .get_slo(pb::GetSloRequest {
            device_class: class.unwrap_or_default(),
        })
        .await?
        .into_inner();
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", table(&r));
    }
    Ok(if check {
        ExitCode::from(check_status(&r))
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_exits_with_the_worst_verdict_shown() {
        let of = |verdicts: &[&str]| {
            check_status(&pb::GetSloResponse {
                classes: verdicts
                    .iter()
                    .map(|v| pb::ClassSlo {
                        verdict: (*v).to_owned(),
                        ..Default::default()
                    })
                    .collect(),
            })
        };
        assert_eq!(of(&[]), 0);
        assert_eq!(of(&["promote", "promote"]), 0);
        assert_eq!(of(&["promote", "hold"]), 3);
        assert_eq!(of(&["hold", "roll back", "promote"]), 4);
        assert_eq!(of(&["promote", "something newer"]), 3);
    }

    #[test]
    fn the_table_puts_each_figure_beside_its_objective_and_the_verdict_first() {
        let c = pb::ClassSlo {
            device_class: "shareguard-net-bandwidth".into(),
            stage: "enforce".into(),
            devices: vec!["nic-0".into()],
            verdict: "roll back".into(),
            reasons: vec!["read_back_ratio 0.5000 is not >= 0.9900".into()],
            window: "1h".into(),
            short_window: "5m".into(),
            figures: vec![pb::SloFigure {
                name: "read_back_ratio".into(),
                unit: "ratio".into(),
                value: Some(0.5),
                comparison: ">=".into(),
                objective: Some(0.99),
                samples: 1,
                status: "missed".into(),
                enforcement: true,
                ..Default::default()
            }],
            refusals: [("capacity".to_owned(), 2)].into(),
            claims: 5,
            recovery_seconds: None,
            unverified_shares: 1,
            ..Default::default()
        };
        let t = table(&pb::GetSloResponse { classes: vec![c] });
        assert!(t.contains("VERDICT ROLL BACK"), "{t}");
        assert!(
            t.contains("  - read_back_ratio 0.5000 is not >= 0.9900"),
            "{t}"
        );
        let row = t
            .lines()
            .find(|l| l.starts_with("read_back_ratio"))
            .unwrap();
        assert!(
            row.contains("0.5000") && row.contains(">= 0.9900") && row.contains("MISSED"),
            "{row}"
        );
        assert!(
            t.contains("REFUSALS over 1h: 2 of 5 claims (capacity 2)"),
            "{t}"
        );
        assert!(t.contains("RECOVERY not complete: 1 share(s)"), "{t}");
    }
}
