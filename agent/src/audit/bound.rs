//! What one audit line may hold. Every string a caller sent is capped and made printable
//! before it is written, so that no request can make a line (or the log) grow with its
//! own size, or put terminal control sequences in front of the SRE who reads the log.
//! A capped field says how much was cut.

use std::{borrow::Cow, collections::BTreeMap, fmt::Write as _};

use serde::Serializer;

/// Identifiers: namespaces (63), names and uids (253) and ids fit whole.
pub const MAX_FIELD_BYTES: usize = 256;
/// A reason quotes the field at fault and the rule; a few lines of text at most.
pub const MAX_REASON_BYTES: usize = 1024;
/// Capacity names per share; a device has a handful.
pub const MAX_AMOUNTS: usize = 16;
/// A capacity name or quantity.
pub const MAX_AMOUNT_BYTES: usize = 64;

/// Characters that must not reach a terminal or a log viewer raw: the C0 and C1
/// controls and DEL, and the Unicode bidirectional overrides and isolates, which can
/// make a line read as something it does not say.
fn unprintable(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every unprintable character written as `\u{XX}`; borrowed when there is none.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unprintable) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unprintable(c) {
            // Writing to a String cannot fail.
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `s` made printable and cut to at most `max` bytes (on a character boundary), with
/// what was cut said at the end.
pub fn capped(s: &str, max: usize) -> Cow<'_, str> {
    let p = printable(s);
    if p.len() <= max {
        return p;
    }
    let mut end = max;
    while !p.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}…[{} more bytes]", &p[..end], p.len() - end))
}

pub fn field<S: Serializer>(s: &&str, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&capped(s, MAX_FIELD_BYTES))
}

pub fn reason<S: Serializer>(s: &&str, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_str(&capped(s, MAX_REASON_BYTES))
}

pub fn opt_field<S: Serializer>(s: &Option<&str>, ser: S) -> Result<S::Ok, S::Error> {
    match s {
        Some(s) => ser.serialize_str(&capped(s, MAX_FIELD_BYTES)),
        None => ser.serialize_none(),
    }
}

/// At most [`MAX_AMOUNTS`] entries, each capped; a map that had more gets one entry
/// `"…"` saying how many were left out.
pub fn amounts<S: Serializer>(m: &BTreeMap<String, String>, ser: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = ser.serialize_map(None)?;
    for (k, v) in m.iter().take(MAX_AMOUNTS) {
        map.serialize_entry(&capped(k, MAX_AMOUNT_BYTES), &capped(v, MAX_AMOUNT_BYTES))?;
    }
    if m.len() > MAX_AMOUNTS {
        map.serialize_entry("…", &format!("{} more", m.len() - MAX_AMOUNTS))?;
    }
    map.end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_bidi_characters_are_escaped() {
        assert_eq!(printable("team-a"), "team-a");
        assert_eq!(printable("a\nb\u{1b}[2Jc"), "a\\u{a}b\\u{1b}[2Jc");
        assert_eq!(
            printable("x\u{202e}y\u{7f}\u{85}"),
            "x\\u{202e}y\\u{7f}\\u{85}"
        );
    }

    #[test]
    fn long_fields_are_cut_on_a_character_boundary_saying_how_much() {
        let s = "é".repeat(200); // 400 bytes
        let c = capped(&s, MAX_FIELD_BYTES);
        assert!(c.starts_with(&"é".repeat(128)), "{c}");
        assert!(c.ends_with("…[144 more bytes]"), "{c}");
        assert_eq!(capped("short", MAX_FIELD_BYTES), "short");
        // Escaping counts: a field of controls grows, and is capped after it.
        let controls = "\u{1}".repeat(1000);
        let c = capped(&controls, MAX_FIELD_BYTES);
        assert!(c.len() < MAX_FIELD_BYTES + 32, "{}", c.len());
    }
}
