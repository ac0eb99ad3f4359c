//! Pages of `ListShares`: a position in the listing's fixed order, handed to the client
//! as an opaque token, so a node with 100k shares lists in answers of bounded size.
//!
//! The token is the sort key of the last share returned, so a page starts strictly after
//! it: a share that exists throughout the listing is on exactly one page, whatever is
//! admitted or swept between pages, and the agent keeps no cursor state.

use crate::record::ShareRecord;

/// Shares in an answer when the client asks for none in particular.
pub const DEFAULT_PAGE: usize = 500;
/// The most shares in one answer: a share's status is about 1.5 KiB, so a full page
/// stays well under the 4 MiB a gRPC client accepts by default.
pub const MAX_PAGE: usize = 1000;

/// The listing order, the same as `ListShares` always had: device, namespace, claim
/// name, share key (unique, so no two shares tie).
fn order(r: &ShareRecord) -> (&str, &str, &str, &str) {
    (
        r.device.as_str(),
        r.claim.namespace.as_str(),
        r.claim.name.as_str(),
        r.key.as_str(),
    )
}

/// A share's place in the listing order: device, namespace, claim name, share key.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Position(pub [String; 4]);

impl Position {
    pub fn of(r: &ShareRecord) -> Position {
        let (d, n, c, k) = order(r);
        Position([d.to_owned(), n.to_owned(), c.to_owned(), k.to_owned()])
    }

    fn cmp_record(&self, r: &ShareRecord) -> std::cmp::Ordering {
        let [d, n, c, k] = &self.0;
        (d.as_str(), n.as_str(), c.as_str(), k.as_str()).cmp(&order(r))
    }

    /// Hex of the four fields, each preceded by its length: opaque to clients, and no
    /// byte a field may hold can be mistaken for a separator.
    pub fn token(&self) -> String {
        let mut out = String::new();
        for f in &self.0 {
            out.push_str(&format!("{:08x}", f.len()));
            for b in f.bytes() {
                out.push_str(&format!("{b:02x}"));
            }
        }
        out
    }

    pub fn from_token(t: &str) -> Result<Position, BadToken> {
        let bytes = t.as_bytes();
        if !bytes.len().is_multiple_of(2) {
            return Err(BadToken);
        }
        let raw: Vec<u8> = bytes
            .chunks(2)
            .map(|p| {
                std::str::from_utf8(p)
                    .ok()
                    .and_then(|s| u8::from_str_radix(s, 16).ok())
                    .ok_or(BadToken)
            })
            .collect::<Result<_, _>>()?;
        let mut rest = raw.as_slice();
        let mut fields: [String; 4] = Default::default();
        for f in &mut fields {
            let (len, tail) = rest.split_at_checked(4).ok_or(BadToken)?;
            let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let (v, tail) = tail.split_at_checked(len).ok_or(BadToken)?;
            *f = String::from_utf8(v.to_vec()).map_err(|_| BadToken)?;
            rest = tail;
        }
        if !rest.is_empty() {
            return Err(BadToken);
        }
        Ok(Position(fields))
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("not a page token this agent issued")]
pub struct BadToken;

/// The page size a request's `page_size` asks for, bounded.
pub fn size(asked: u32) -> usize {
    match asked as usize {
        0 => DEFAULT_PAGE,
        n => n.min(MAX_PAGE),
    }
}

/// The first `limit` of `records` after `after`, in listing order, and the position to
/// continue from when more are left. Linear in the records (a partial selection, not a
/// sort of all of them), so listing n shares in pages of k costs about n*n/k steps.
pub fn select<'a>(
    records: impl Iterator<Item = &'a ShareRecord>,
    after: Option<&Position>,
    limit: usize,
) -> (Vec<&'a ShareRecord>, Option<Position>) {
    let mut v: Vec<&ShareRecord> = records
        .filter(|r| after.is_none_or(|a| a.cmp_record(r).is_lt()))
        .collect();
    let more = v.len() > limit;
    if more && limit > 0 {
        v.select_nth_unstable_by(limit - 1, |a, b| order(a).cmp(&order(b)));
    }
    v.truncate(limit);
    v.sort_unstable_by(|a, b| order(a).cmp(&order(b)));
    let next = if more {
        v.last().map(|r| Position::of(r))
    } else {
        None
    };
    (v, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_round_trips_and_a_foreign_one_is_refused() {
        let p = Position([
            "nic-0".into(),
            "team-a".into(),
            "c\u{0}ł".into(),
            String::new(),
        ]);
        assert_eq!(Position::from_token(&p.token()), Ok(p.clone()));
        let t = p.token();
        for bad in ["x", "zz", &t[..t.len() - 2], &format!("{t}00"), "ffffffff"] {
            assert_eq!(Position::from_token(bad), Err(BadToken), "{bad}");
        }
    }

    #[test]
    fn sizes_are_bounded() {
        assert_eq!((size(0), size(7), size(5000)), (DEFAULT_PAGE, 7, MAX_PAGE));
    }
}
