//! `shareguard audit`: the audit log read from its files, with no agent needed.

use std::{io::Write, process::ExitCode};

use anyhow::Context;

use crate::{
    audit::{
        bound::printable,
        query::{self, Entry, Filter},
    },
    config,
};

use super::{
    args::{AuditArgs, Output},
    render::table,
};

/// `shareguard audit`: reads the log's files (oldest first), reports malformed lines on
/// stderr and skips them, and prints what the filters select. Exit code 1 when a file
/// could not be read to its end, since the answer may then be incomplete.
pub(super) fn run_audit(a: AuditArgs, out: Output) -> anyhow::Result<ExitCode> {
    let path = match a.file {
        Some(f) => f,
        None => {
            config::Config::load(&a.config)
                .with_context(|| {
                    format!(
                        "reading the audit log's path from {} (or give --file)",
                        a.config.display()
                    )
                })?
                .agent
                .audit_log
        }
    };
    if a.verify {
        return verify_audit(&path);
    }
    let since = a
        .since
        .as_deref()
        .map(|s| query::parse_since(s, std::time::SystemTime::now()))
        .transpose()
        .context("--since")?;
    let filter = Filter {
        claim_uid: a.claim,
        share_id: a.share,
        namespace: a.namespace,
        device: a.device,
        decisions: a.decision,
        since,
        limit: a.limit,
    };
    let lines = query::read(&path)?;
    let mut incomplete = false;
    let entries = lines.filter_map(|l| match l {
        Ok(e) => Some(e),
        Err(e) => {
            incomplete |= matches!(e, query::LineError::Io { .. });
            eprintln!("shareguard audit: {e}");
            None
        }
    });
    let selected = query::select(entries, &filter);
    match out {
        // The lines exactly as written, one per line, for jq and grep.
        Output::Json => {
            let mut stdout = std::io::stdout().lock();
            for e in &selected {
                writeln!(stdout, "{}", e.raw)?;
            }
        }
        Output::Table | Output::Yaml | Output::Wide => print!("{}", audit_rows(&selected)),
    }
    Ok(if incomplete {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn audit_rows(entries: &[Entry]) -> String {
    let mut rows = vec![
        [
            "TIME", "DECISION", "TENANT", "CLAIM", "SHARE", "DEVICE", "AMOUNTS", "REASON",
        ]
        .map(String::from)
        .to_vec(),
    ];
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_owned()
        } else {
            s.to_owned()
        }
    };
    for e in entries {
        let r = &e.record;
        let amounts: Vec<String> = r.amounts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        // The agent writes printable text, but the file is only a file: whatever it
        // holds, a control character or a newline never reaches the terminal raw.
        let p = |s: &str| printable(s).into_owned();
        rows.push(vec![
            p(&r.time),
            p(&r.decision),
            p(&dash(&r.tenant)),
            p(&dash(&r.claim_uid)),
            p(&dash(&r.share_id)),
            p(&dash(&r.device)),
            p(&dash(&amounts.join(","))),
            p(&r.reason),
        ]);
    }
    table(rows)
}

/// `shareguard audit --verify`.
fn verify_audit(path: &std::path::Path) -> anyhow::Result<ExitCode> {
    let v = crate::audit::chain::verify(path)?;
    for b in &v.breaks {
        // Paths and reasons only: nothing of the lines themselves reaches the terminal.
        eprintln!("shareguard audit: {}", printable(&b.to_string()));
    }
    let start = if v.from_genesis {
        "from the first line ever written"
    } else {
        "from the oldest line kept (older ones were rotated away)"
    };
    let unchained = if v.unchained > 0 {
        format!("; {} older lines carry no chain", v.unchained)
    } else {
        String::new()
    };
    if v.breaks.is_empty() {
        println!(
            "audit log intact: {} lines follow the line before them, {start}{unchained}",
            v.chained
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "audit log BROKEN in {} places (above); {} lines follow the line before them",
            v.breaks.len(),
            v.chained
        );
        Ok(ExitCode::FAILURE)
    }
}
