//! `Quantity::parse` on arbitrary text: never a panic, and every parsed quantity prints
//! (in each format) as a string that parses back to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shareguard_common::{Format, Quantity};

fuzz_target!(|data: &[u8]| {
    // Quantities arrive as strings (proto, TOML, JSON), so always valid UTF-8.
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let non_negative = Quantity::parse_non_negative(s);
    let Ok(q) = Quantity::parse(s) else {
        assert!(
            non_negative.is_err(),
            "{s:?}: parse failed, parse_non_negative did not"
        );
        return;
    };
    assert_eq!(non_negative.is_ok(), !q.is_negative(), "{s:?}");

    // The value round-trips through its canonical text whatever format it carries: the
    // store and the API keep quantities as that text, and the ledger compares values.
    for format in [
        q.format(),
        Format::BinarySI,
        Format::DecimalSI,
        Format::DecimalExponent,
    ] {
        let q = q.with_format(format);
        let text = q.to_string();
        let back = match Quantity::parse(&text) {
            Ok(back) => back,
            Err(e) => panic!("{s:?} as {format:?} prints {text:?}, which does not parse: {e}"),
        };
        assert_eq!(
            back, q,
            "{s:?} as {format:?} prints {text:?}, which parses to {back:?}"
        );
        // The text itself may change once: a binary amount that is no multiple of 1Ki
        // prints as plain digits ("18000"), which read back as decimal ("18k"), as in
        // apimachinery. After that one step it is stable.
        let settled = back.to_string();
        match Quantity::parse(&settled) {
            Ok(again) => assert_eq!(again.to_string(), settled, "{s:?}: text never settles"),
            Err(e) => panic!("{s:?} settles as {settled:?}, which does not parse: {e}"),
        }
    }

    // The arithmetic the ledger and policies do on amounts: checked, never a panic.
    let _ = q.checked_add(&q);
    let _ = q.checked_sub(&q);
    let _ = q.checked_mul(-3);
    let _ = q.checked_neg();
    let _ = q.ceil_units();
    let _ = q.exact_div(&q);
});
