//! Reading the audit log back, for `shareguard audit`: the rotated files oldest first,
//! then the current one, line by line, with the filters as plain functions.
//!
//! The log is a local file, so this needs no running agent (and works on a node whose
//! agent is down, which is when an SRE most wants it). Every file is opened before any is
//! read: a rotation during the query then renames files under open handles and changes
//! nothing about what is read, except that lines written after the query began may be
//! missing.

use std::{
    collections::{BTreeMap, VecDeque},
    fs::File,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    time::SystemTime,
};

use serde::Deserialize;

use super::Decision;

/// The fields of a line the filters and the table use. Only `time` and `decision` are
/// required: a line without them is not an audit line. Unknown fields are ignored, so a
/// newer agent's lines still read.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub time: String,
    /// A string rather than [`Decision`], so a decision this binary does not know (from a
    /// newer agent) is still shown.
    pub decision: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub tenant: String,
    #[serde(default)]
    pub claim_uid: String,
    #[serde(default)]
    pub claim_name: String,
    #[serde(default)]
    pub share_id: String,
    #[serde(default)]
    pub device: String,
    #[serde(default)]
    pub amounts: BTreeMap<String, String>,
}

/// One line of the log: where it is, its text as written, and its fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    /// The line as written, without its newline: what `-o json` prints.
    pub raw: String,
    pub record: Record,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("no audit log at {0} (nor rotated files next to it)")]
    NotFound(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A line that is not an audit line, or a file that could not be read to its end: reported
/// and skipped, so one bad line does not hide the rest of the log.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("{}:{line}: skipped, not an audit line: {reason}", file.display())]
    Malformed {
        file: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("{}:{line}: read failed, rest of the file skipped: {source}", file.display())]
    Io {
        file: PathBuf,
        line: usize,
        source: std::io::Error,
    },
}

/// The log's files in chronological order: `path.N` .. `path.1`, then `path`. Rotated
/// files are found by listing the directory rather than by the configured `keep`, so a
/// query sees every file even after `keep` was lowered.
pub fn log_files(path: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let io = |source| ReadError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| ReadError::NotFound(path.to_owned()))?
        .to_string_lossy()
        .into_owned();
    let mut rotated: Vec<(u32, PathBuf)> = Vec::new();
    let listing = match std::fs::read_dir(dir) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ReadError::NotFound(path.to_owned()));
        }
        Err(e) => return Err(io(e)),
    };
    for entry in listing {
        let entry = entry.map_err(io)?;
        let file_name = entry.file_name();
        let Some(n) = file_name
            .to_str()
            .and_then(|f| f.strip_prefix(name.as_str()))
            .and_then(|rest| rest.strip_prefix('.'))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        rotated.push((n, entry.path()));
    }
    // The higher the number, the older the file.
    rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    if path.exists() {
        files.push(path.to_owned());
    }
    if files.is_empty() {
        return Err(ReadError::NotFound(path.to_owned()));
    }
    Ok(files)
}

/// Opens every file of the log (see the module comment for why all at once) and returns
/// its lines in order. A file that vanished between listing and opening was rotated
/// past `keep` and is skipped.
pub fn read(path: &Path) -> Result<Lines, ReadError> {
    let mut open = VecDeque::new();
    for f in log_files(path)? {
        match File::open(&f) {
            Ok(h) => open.push_back((f, BufReader::new(h))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(ReadError::Io { path: f, source }),
        }
    }
    Ok(Lines {
        files: open,
        line: 0,
        buf: Vec::new(),
    })
}

/// The lines of the log's files, oldest first.
pub struct Lines {
    files: VecDeque<(PathBuf, BufReader<File>)>,
    /// Line number in the front file.
    line: usize,
    buf: Vec<u8>,
}

impl Iterator for Lines {
    type Item = Result<Entry, LineError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (file, reader) = self.files.front_mut()?;
            self.buf.clear();
            match reader.read_until(b'\n', &mut self.buf) {
                Ok(0) => {
                    self.files.pop_front();
                    self.line = 0;
                }
                Ok(_) => {
                    self.line += 1;
                    let text = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
                    if text.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    return Some(parse_line(file, self.line, text));
                }
                Err(source) => {
                    let err = LineError::Io {
                        file: file.clone(),
                        line: self.line + 1,
                        source,
                    };
                    self.files.pop_front();
                    self.line = 0;
                    return Some(Err(err));
                }
            }
        }
    }
}

/// One line's text (without its newline) as an [`Entry`].
pub fn parse_line(file: &Path, line: usize, text: &[u8]) -> Result<Entry, LineError> {
    let malformed = |reason: String| LineError::Malformed {
        file: file.to_owned(),
        line,
        reason,
    };
    let raw = std::str::from_utf8(text).map_err(|e| malformed(e.to_string()))?;
    let record: Record = serde_json::from_str(raw).map_err(|e| malformed(e.to_string()))?;
    Ok(Entry {
        file: file.to_owned(),
        line,
        raw: raw.to_owned(),
        record,
    })
}

/// What `shareguard audit` selects. Every filter that is set must match; `None` and an
/// empty `decisions` match everything.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    pub claim_uid: Option<String>,
    pub share_id: Option<String>,
    /// The claim's namespace: the line's `tenant`.
    pub namespace: Option<String>,
    pub device: Option<String>,
    /// Any of these.
    pub decisions: Vec<Decision>,
    /// Lines at or after this time. A line whose time does not parse does not match:
    /// it cannot be shown to be recent.
    pub since: Option<SystemTime>,
    /// Only the most recent this many of the lines that match.
    pub limit: Option<usize>,
}

impl Filter {
    /// Whether one line passes every filter but `limit`.
    pub fn matches(&self, r: &Record) -> bool {
        let eq = |want: &Option<String>, have: &str| want.as_deref().is_none_or(|w| w == have);
        eq(&self.claim_uid, &r.claim_uid)
            && eq(&self.share_id, &r.share_id)
            && eq(&self.namespace, &r.tenant)
            && eq(&self.device, &r.device)
            && (self.decisions.is_empty()
                || self.decisions.iter().any(|d| d.as_str() == r.decision))
            && self.since.is_none_or(|since| {
                humantime::parse_rfc3339_weak(&r.time).is_ok_and(|t| t >= since)
            })
    }
}

/// The entries that match `f`, in the order given (chronological for [`read`]); with a
/// limit, only the last `limit` of them. Holds at most `limit` entries at a time, so a
/// `--limit` query over a large log stays small.
pub fn select(entries: impl IntoIterator<Item = Entry>, f: &Filter) -> Vec<Entry> {
    if f.limit == Some(0) {
        return Vec::new();
    }
    let mut out = VecDeque::new();
    for e in entries {
        if !f.matches(&e.record) {
            continue;
        }
        if f.limit.is_some_and(|n| out.len() == n) {
            out.pop_front();
        }
        out.push_back(e);
    }
    out.into()
}

#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is neither a duration (e.g. 90s, 15m, 1h, 2d) nor an RFC 3339 UTC time (e.g. 2025-01-31T08:00:00Z)"
)]
pub struct BadSince(pub String);

/// `--since`: a duration back from `now`, or an RFC 3339 time in UTC (as the log writes
/// them).
pub fn parse_since(s: &str, now: SystemTime) -> Result<SystemTime, BadSince> {
    if let Ok(d) = crate::duration::parse(s) {
        return Ok(now.checked_sub(d).unwrap_or(SystemTime::UNIX_EPOCH));
    }
    humantime::parse_rfc3339_weak(s).map_err(|_| BadSince(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn rec(decision: &str, tenant: &str, claim: &str, share: &str, device: &str) -> Record {
        Record {
            time: "2025-01-01T12:00:00.000Z".into(),
            decision: decision.into(),
            tenant: tenant.into(),
            claim_uid: claim.into(),
            share_id: share.into(),
            device: device.into(),
            ..Record::default()
        }
    }

    fn entry(n: usize, r: Record) -> Entry {
        Entry {
            file: PathBuf::from("audit.jsonl"),
            line: n,
            raw: format!("line {n}"),
            record: r,
        }
    }

    #[test]
    fn each_filter_matches_its_field_only() {
        let r = rec("refuse", "team-a", "uid-1", "s-1", "gen-0");
        assert!(Filter::default().matches(&r));
        let cases: [(Filter, bool); 12] = [
            (
                Filter {
                    claim_uid: Some("uid-1".into()),
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    claim_uid: Some("uid-2".into()),
                    ..Default::default()
                },
                false,
            ),
            (
                Filter {
                    share_id: Some("s-1".into()),
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    share_id: Some("s-2".into()),
                    ..Default::default()
                },
                false,
            ),
            (
                Filter {
                    namespace: Some("team-a".into()),
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    namespace: Some("team-b".into()),
                    ..Default::default()
                },
                false,
            ),
            (
                Filter {
                    device: Some("gen-0".into()),
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    device: Some("gen-1".into()),
                    ..Default::default()
                },
                false,
            ),
            (
                Filter {
                    decisions: vec![Decision::Admit, Decision::Refuse],
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    decisions: vec![Decision::Admit],
                    ..Default::default()
                },
                false,
            ),
            (
                Filter {
                    since: humantime::parse_rfc3339("2025-01-01T12:00:00Z").ok(),
                    ..Default::default()
                },
                true,
            ),
            (
                Filter {
                    since: humantime::parse_rfc3339("2025-01-01T12:00:01Z").ok(),
                    ..Default::default()
                },
                false,
            ),
        ];
        for (f, want) in cases {
            assert_eq!(f.matches(&r), want, "{f:?}");
        }
        // All set filters must hold, not any.
        let both = Filter {
            claim_uid: Some("uid-1".into()),
            device: Some("gen-1".into()),
            ..Default::default()
        };
        assert!(!both.matches(&r));
    }

    #[test]
    fn a_line_whose_time_does_not_parse_is_not_recent() {
        let mut r = rec("admit", "a", "u", "s", "d");
        r.time = "yesterday".into();
        let f = Filter {
            since: Some(SystemTime::UNIX_EPOCH),
            ..Default::default()
        };
        assert!(!f.matches(&r));
    }

    #[test]
    fn limit_keeps_the_most_recent_matches_in_order() {
        let entries: Vec<Entry> = (1..=10)
            .map(|n| {
                let d = if n % 2 == 0 { "refuse" } else { "admit" };
                entry(n, rec(d, "t", "u", "s", "d"))
            })
            .collect();
        let f = Filter {
            decisions: vec![Decision::Refuse],
            limit: Some(3),
            ..Default::default()
        };
        let lines: Vec<usize> = select(entries.clone(), &f).iter().map(|e| e.line).collect();
        assert_eq!(lines, vec![6, 8, 10]);
        let all = Filter {
            limit: Some(100),
            ..Default::default()
        };
        assert_eq!(select(entries.clone(), &all).len(), 10);
        let none = Filter {
            limit: Some(0),
            ..Default::default()
        };
        assert!(select(entries, &none).is_empty());
    }

    #[test]
    fn since_takes_a_duration_or_an_rfc3339_time() {
        let now = humantime::parse_rfc3339("2025-01-01T12:00:00Z").unwrap();
        assert_eq!(
            parse_since("1h", now).unwrap(),
            now - Duration::from_secs(3600)
        );
        assert_eq!(
            parse_since("90s", now).unwrap(),
            now - Duration::from_secs(90)
        );
        assert_eq!(
            parse_since("2024-12-31T00:00:00Z", now).unwrap(),
            humantime::parse_rfc3339("2024-12-31T00:00:00Z").unwrap()
        );
        assert_eq!(
            parse_since("2024-12-31T00:00:00.250Z", now).unwrap(),
            humantime::parse_rfc3339("2024-12-31T00:00:00.250Z").unwrap()
        );
        assert!(parse_since("last tuesday", now).is_err());
        assert!(parse_since("", now).is_err());
        // humantime panicked on this one (see crate::duration).
        assert!(parse_since("18446744073709551615s 1000000000ns", now).is_err());
    }

    #[test]
    fn files_are_listed_oldest_first_by_their_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        for name in [
            "audit.jsonl",
            "audit.jsonl.1",
            "audit.jsonl.3",
            "audit.jsonl.10",
            "audit.jsonl.new",
            "audit.jsonl.2x",
            "audit.jsonl.",
            "other.jsonl.4",
            "audit.jsonl1",
        ] {
            std::fs::write(dir.path().join(name), "").unwrap();
        }
        let names: Vec<String> = log_files(&p)
            .unwrap()
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "audit.jsonl.10",
                "audit.jsonl.3",
                "audit.jsonl.1",
                "audit.jsonl"
            ]
        );
        assert!(matches!(
            log_files(&dir.path().join("none.jsonl")),
            Err(ReadError::NotFound(_))
        ));
        assert!(matches!(
            log_files(&dir.path().join("no-dir/audit.jsonl")),
            Err(ReadError::NotFound(_))
        ));
    }

    #[test]
    fn a_malformed_line_is_reported_with_file_and_line_and_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("audit.jsonl");
        let good = |c: &str| {
            format!(
                "{{\"time\":\"2025-01-01T00:00:00.000Z\",\"decision\":\"admit\",\"claim_uid\":\"{c}\",\"extra\":1}}\n"
            )
        };
        std::fs::write(
            dir.path().join("audit.jsonl.1"),
            format!("{}not json\n{}", good("a"), good("b")),
        )
        .unwrap();
        let mut current = good("c").into_bytes();
        current.extend_from_slice(b"\n{\"decision\":\"admit\"}\n\xff\xfe\n");
        current.extend_from_slice(good("d").as_bytes());
        std::fs::write(&p, current).unwrap();

        let mut ok = Vec::new();
        let mut bad = Vec::new();
        for l in read(&p).unwrap() {
            match l {
                Ok(e) => ok.push((e.record.claim_uid.clone(), e.line)),
                Err(LineError::Malformed { file, line, .. }) => bad.push((
                    file.file_name().unwrap().to_string_lossy().into_owned(),
                    line,
                )),
                Err(e) => panic!("{e}"),
            }
        }
        let s = |v: &str| v.to_owned();
        assert_eq!(ok, vec![(s("a"), 1), (s("b"), 3), (s("c"), 1), (s("d"), 5)]);
        assert_eq!(
            bad,
            vec![
                (s("audit.jsonl.1"), 2),
                // Missing `time`; the blank line 2 is neither an entry nor an error.
                (s("audit.jsonl"), 3),
                (s("audit.jsonl"), 4),
            ]
        );
        let e = parse_line(&p, 7, b"nope").unwrap_err().to_string();
        assert!(e.contains("audit.jsonl:7:"), "{e}");
    }

    #[test]
    fn raw_is_the_line_as_written() {
        let text = br#"{"time":"t","decision":"admit","zzz":[1,2]}"#;
        let e = parse_line(Path::new("f"), 1, text).unwrap();
        assert_eq!(e.raw.as_bytes(), text);
    }
}
