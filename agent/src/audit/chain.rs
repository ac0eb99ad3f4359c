//! The audit log's hash chain: each line carries the SHA-256 of the line before it, so a
//! line removed from or edited in the log breaks the chain at the line after it.

use std::{
    fs::File,
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

use super::query;

pub type Hash = [u8; 32];

/// What the first line ever written carries.
pub const GENESIS: Hash = [0; 32];

/// The most of a file's end read to find its last line: lines are capped far below it
/// ([`super::bound`]).
const TAIL: u64 = 1 << 20;

pub fn hash(line: &[u8]) -> Hash {
    Sha256::digest(line).into()
}

pub fn hex(h: &Hash) -> String {
    use std::fmt::Write as _;
    h.iter().fold(String::with_capacity(64), |mut s, b| {
        // Writing to a String cannot fail.
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// `obj`, a serialized JSON object, with `"prev": hex(prev)` as its last field; None when
/// `obj` is not an object.
pub fn chained(mut obj: Vec<u8>, prev: &Hash) -> Option<Vec<u8>> {
    if obj.last() != Some(&b'}') || obj.first() != Some(&b'{') {
        return None;
    }
    obj.pop();
    if obj.len() > 1 {
        obj.push(b',');
    }
    obj.extend_from_slice(b"\"prev\":\"");
    obj.extend_from_slice(hex(prev).as_bytes());
    obj.extend_from_slice(b"\"}");
    Some(obj)
}

/// The hash of the last whole line of `path`; None when the file is missing or empty.
pub fn last_line_hash(path: &Path) -> std::io::Result<Option<Hash>> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let start = len.saturating_sub(TAIL);
    f.seek(SeekFrom::Start(start))?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail)?;
    Ok(tail
        .split(|b| *b == b'\n')
        .rfind(|l| !l.is_empty())
        .map(hash))
}

/// Where the chain is broken: the line whose `prev` does not match the line before it.
#[derive(Debug, PartialEq, Eq)]
pub struct Break {
    pub file: PathBuf,
    /// 1-based.
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for Break {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}: {}", self.file.display(), self.line, self.reason)
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Verified {
    /// Lines whose `prev` was checked against the line before.
    pub chained: usize,
    /// Whether the oldest line kept is the first ever written (its `prev` is the
    /// genesis); otherwise older lines were rotated away and the chain starts mid-way.
    pub from_genesis: bool,
    /// Lines before the first chained one, written by an agent that did not chain.
    pub unchained: usize,
    pub breaks: Vec<Break>,
}

/// Recomputes the chain over the log's files, oldest first.
pub fn verify(path: &Path) -> Result<Verified, query::ReadError> {
    let mut v = Verified::default();
    let mut before: Option<Hash> = None;
    let mut started = false;
    for file in query::log_files(path)? {
        let f = File::open(&file).map_err(|source| query::ReadError::Io {
            path: file.clone(),
            source,
        })?;
        for (i, line) in BufReader::new(f).split(b'\n').enumerate() {
            let at = |reason: String| Break {
                file: file.clone(),
                line: i + 1,
                reason,
            };
            let line = match line {
                Ok(l) => l,
                Err(e) => {
                    v.breaks.push(at(format!("read failed: {e}")));
                    break;
                }
            };
            if line.is_empty() {
                continue;
            }
            let prev = serde_json::from_slice::<serde_json::Value>(&line)
                .ok()
                .and_then(|j| j.get("prev").and_then(|p| p.as_str()).map(str::to_owned));
            match (prev, before) {
                (None, _) if !started => v.unchained += 1,
                (None, _) => v.breaks.push(at(
                    "no \"prev\" after chained lines: a line inserted, or one edited".into(),
                )),
                (Some(p), None) => {
                    started = true;
                    v.from_genesis = p == hex(&GENESIS);
                }
                (Some(p), Some(h)) => {
                    if !started {
                        started = true;
                        v.from_genesis = p == hex(&GENESIS);
                    } else if p != hex(&h) {
                        v.breaks.push(at(
                            "\"prev\" does not match the line before it: a line was removed there, or the line before was edited".into(),
                        ));
                    } else {
                        v.chained += 1;
                    }
                }
            }
            before = Some(hash(&line));
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prev_is_the_last_field_of_the_object() {
        let c = chained(br#"{"a":1}"#.to_vec(), &GENESIS).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["a"], 1);
        assert_eq!(v["prev"], "0".repeat(64));
        let c = chained(b"{}".to_vec(), &hash(b"x")).unwrap();
        assert!(serde_json::from_slice::<serde_json::Value>(&c).is_ok());
        assert!(chained(b"[1]".to_vec(), &GENESIS).is_none());
    }
}
