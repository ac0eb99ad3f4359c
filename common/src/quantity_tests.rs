// Table cases are ported from k8s.io/apimachinery pkg/api/resource/quantity_test.go
// (TestQuantityParse, TestQuantityString, TestQuantityParseEmit, TestParseQuantity,
// TestQuantityCmp, TestQuantityNeg, TestAdd, TestSub, TestMul, TestNewSet,
// TestMilliNewSet, TestNewScaledSet, TestQuantityRoundUp) and quantity_example_test.go.
// apimachinery's decQuantity(m, e, format) becomes `dec(m, e)` nanos plus a format.

use super::Format::{BinarySI as B, DecimalExponent as X, DecimalSI as D};
use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;
use std::hash::DefaultHasher;

const UNIT: i128 = 1_000_000_000;
const MOST_POSITIVE: i128 = i64::MAX as i128;
const MOST_NEGATIVE: i128 = i64::MIN as i128;

/// m × 10^e in nano-units; e below -9 must still give whole nanos.
fn dec(m: i128, e: i32) -> i128 {
    let shift = e + 9;
    if shift >= 0 {
        m * 10i128.pow(shift.unsigned_abs())
    } else {
        let d = 10i128.pow(shift.unsigned_abs());
        assert_eq!(m % d, 0, "dec({m}, {e}) is finer than a nano");
        m / d
    }
}

fn q(s: &str) -> Quantity {
    match Quantity::parse(s) {
        Ok(q) => q,
        Err(e) => panic!("{s}: {e}"),
    }
}

fn qn(nanos: i128, format: Format) -> Quantity {
    match Quantity::from_nanos(nanos, format) {
        Some(q) => q,
        None => panic!("{nanos} is not a valid nano count"),
    }
}

fn hash_of(q: &Quantity) -> u64 {
    let mut h = DefaultHasher::new();
    q.hash(&mut h);
    h.finish()
}

// TestQuantityParse: (input, mantissa, exponent, format).
const PARSE_CASES: &[(&str, i128, i32, Format)] = &[
    ("0", 0, 0, D),
    ("0n", 0, 0, D),
    ("0u", 0, 0, D),
    ("0m", 0, 0, D),
    ("0Ki", 0, 0, B),
    ("0k", 0, 0, D),
    ("0Mi", 0, 0, B),
    ("0M", 0, 0, D),
    ("0Gi", 0, 0, B),
    ("0G", 0, 0, D),
    ("0Ti", 0, 0, B),
    ("0T", 0, 0, D),
    // Quantity less numbers are allowed
    ("1", 1, 0, D),
    // Binary suffixes
    ("1Ki", 1024, 0, B),
    ("8Ki", 8 * 1024, 0, B),
    ("7Mi", 7 << 20, 0, B),
    ("6Gi", 6 << 30, 0, B),
    ("5Ti", 5 << 40, 0, B),
    ("4Pi", 4 << 50, 0, B),
    ("3Ei", 3 << 60, 0, B),
    ("10Ti", 10 << 40, 0, B),
    ("100Ti", 100 << 40, 0, B),
    // Decimal suffixes
    ("5n", 5, -9, D),
    ("4u", 4, -6, D),
    ("3m", 3, -3, D),
    ("9", 9, 0, D),
    ("8k", 8, 3, D),
    ("50k", 5, 4, D),
    ("7M", 7, 6, D),
    ("6G", 6, 9, D),
    ("5T", 5, 12, D),
    ("40T", 4, 13, D),
    ("300T", 3, 14, D),
    ("2P", 2, 15, D),
    ("1E", 1, 18, D),
    // Decimal exponents
    ("1E-3", 1, -3, X),
    ("1e3", 1, 3, X),
    ("1E6", 1, 6, X),
    ("1e9", 1, 9, X),
    ("1E12", 1, 12, X),
    ("1e15", 1, 15, X),
    ("1E18", 1, 18, X),
    // Nonstandard but still parsable
    ("1e14", 1, 14, X),
    ("1e13", 1, 13, X),
    ("100.035k", 100035, 0, D),
    // Things that look like floating point
    ("0.001", 1, -3, D),
    ("0.0005k", 5, -1, D),
    ("0.005", 5, -3, D),
    ("0.05", 5, -2, D),
    ("0.5", 5, -1, D),
    ("0.00050k", 5, -1, D),
    ("0.00500", 5, -3, D),
    ("0.05000", 5, -2, D),
    ("0.50000", 5, -1, D),
    ("0.5e0", 5, -1, X),
    ("0.5e-1", 5, -2, X),
    ("0.5e-2", 5, -3, X),
    ("10.035M", 10035, 3, D),
    ("1.2e3", 12, 2, X),
    ("1.3E+6", 13, 5, X),
    ("1.40e9", 14, 8, X),
    ("1.53E12", 153, 10, X),
    ("1.6e15", 16, 14, X),
    ("1.7E18", 17, 17, X),
    ("9.01", 901, -2, D),
    ("8.1k", 81, 2, D),
    ("7.123456M", 7123456, 0, D),
    ("6.987654321G", 6987654321, 0, D),
    ("5.444T", 5444, 9, D),
    ("40.1T", 401, 11, D),
    ("300.2T", 3002, 11, D),
    ("2.5P", 25, 14, D),
    ("1.01E", 101, 16, D),
    // Things that saturate/round
    ("3.001n", 4, -9, D),
    ("1.1E-9", 2, -9, X),
    ("0.0000000001", 1, -9, D),
    ("0.0000000005", 1, -9, D),
    ("0.00000000050", 1, -9, D),
    ("0.5e-9", 1, -9, X),
    ("0.9n", 1, -9, D),
    ("0.00000012345", 124, -9, D),
    ("0.00000012354", 124, -9, D),
    ("12E", 12, 18, D),
    // We'll accept fractional binary stuff, too.
    ("100.035Ki", 10243584, -2, B),
    ("0.5Mi", 512 * 1024, 0, B),
    ("0.05Gi", 536870912, -1, B),
    ("0.025Ti", 274877906944, -1, B),
    // Things written by trolls
    ("0.000000000001Ki", 2, -9, D), // rounds up, changes format
    (".001", 1, -3, D),
    (".0001k", 100, -3, D),
    ("1.", 1, 0, D),
    ("1.G", 1, 9, D),
];

#[test]
fn parse_table_with_signs() {
    for &(input, m, e, format) in PARSE_CASES {
        let want = dec(m, e);
        for (text, nanos) in [
            (input.to_owned(), want),
            (format!("+{input}"), want),
            (format!("-{input}"), -want),
        ] {
            let got = q(&text);
            assert_eq!(got.nanos(), nanos, "{text}");
            assert_eq!(got.format(), format, "{text}");
        }
    }
}

#[test]
fn binary_si_is_not_clamped() {
    // Deliberate difference: apimachinery clamps these to 2^63-1.
    assert_eq!(q("9Ei").nanos(), (9 << 60) * UNIT);
    assert_eq!(q("9Ei").to_string(), "9Ei");
    assert_eq!(
        q("9223372036854775807Ki").nanos(),
        MOST_POSITIVE * 1024 * UNIT
    );
    assert_eq!(
        q("9223372036854775807Ki").to_string(),
        "9223372036854775807Ki"
    );
}

#[test]
fn invalid_inputs() {
    let invalid = [
        // TestQuantityParse
        "1.1.M",
        "1+1.0M",
        "0.1mi",
        "0.1am",
        "aoeu",
        ".5i",
        "1i",
        "-3.01i",
        "-3.01e-",
        " 1",
        "1 ",
        // TestQuantityParseNonNumericPanic, TestQuantityValueSet
        "Non-Numeric",
        "invalid",
        // our own
        "1.1.1",
        "1Kib",
        "1e",
        "+-1",
        "--1",
        "1K",
        "1ki",
        "1EE",
        "1e3.5",
        "1e--3",
        "1e+",
        "1 Gi",
        "1Gi ",
        "1_000",
        "0x10",
        "1,5",
        "\u{ff11}",
        "1\u{e9}",
        "\t1",
        "1\n",
        // apimachinery reads these as zero; we want a number to be written.
        "-",
        "+",
        ".",
        "-.",
        "Ki",
        "m",
        "e3",
        "-Gi",
    ];
    for s in invalid {
        assert!(
            matches!(Quantity::parse(s), Err(QuantityError::Syntax { .. })),
            "{s:?} parsed: {:?}",
            Quantity::parse(s)
        );
    }
    assert_eq!(Quantity::parse(""), Err(QuantityError::Empty));
}

#[test]
fn error_messages_say_what_is_wrong() {
    let msg = |s: &str| match Quantity::parse(s) {
        Ok(q) => panic!("{s} parsed as {q}"),
        Err(e) => e.to_string(),
    };
    assert_eq!(msg("12Q"), r#""12Q": unknown suffix "Q""#);
    assert_eq!(msg("1.1.1"), r#""1.1.1": unknown suffix ".1""#);
    assert_eq!(msg("1 "), r#""1 ": unknown suffix " ""#);
    assert!(msg("Ki").starts_with(r#""Ki": missing number"#));
    assert_eq!(msg(""), "empty string is not a quantity");
    assert!(msg("1e40").starts_with(r#""1e40": out of range"#));
    assert_eq!(
        msg("1e99999999999999999999"),
        r#""1e99999999999999999999": exponent "99999999999999999999" out of range"#
    );
    let neg = Quantity::parse_non_negative("-1Gi");
    assert_eq!(
        neg,
        Err(QuantityError::Negative {
            input: "-1Gi".into()
        })
    );
    assert_eq!(
        neg.err().map(|e| e.to_string()).as_deref(),
        Some(r#""-1Gi": negative quantity not allowed"#)
    );
    assert_eq!(Quantity::parse_non_negative("-0"), Ok(Quantity::ZERO));
    assert_eq!(
        Quantity::parse_non_negative("2G").map(|q| q.nanos()),
        Ok(2 * UNIT * UNIT)
    );
}

#[test]
fn range_limits() {
    let max = "170141183460469231731687303715.884105727";
    assert_eq!(q(max).nanos(), i128::MAX);
    assert_eq!(
        q(max).to_string(),
        "170141183460469231731687303715884105727n"
    );
    assert_eq!(q(&format!("-{max}")).nanos(), -i128::MAX);
    for s in [
        "170141183460469231731687303715.884105728",
        "-170141183460469231731687303715.884105728",
        "1e40",
        "-1e40",
        "1e30",
        "200000000000Ei",
        "1e4294967296", // apimachinery truncates the exponent to 32 bits and reads 1
        "1e9223372036854775807",
        "999999999999999999999999999999999999999999",
        "170141183460469231731687303715.8841057271", // rounds up past the limit
    ] {
        assert_eq!(
            Quantity::parse(s),
            Err(QuantityError::Overflow { input: s.into() }),
            "{s}"
        );
    }
    // Out of i64 exponent range is a syntax error, as in apimachinery.
    assert!(matches!(
        Quantity::parse("1e9223372036854775808"),
        Err(QuantityError::Syntax { .. })
    ));
    // Tiny and zero values never overflow, however large the exponent.
    assert_eq!(q("1e-9223372036854775808").nanos(), 1);
    assert_eq!(q("-1e-99999999999").nanos(), -1);
    assert_eq!(q("0e9223372036854775807").nanos(), 0);
    assert_eq!(q(&format!("0.{}1", "0".repeat(5000))).nanos(), 1);
    assert_eq!(
        q(&format!("{}1Ei", "0".repeat(5000))).nanos(),
        (1 << 60) * UNIT
    );
    assert_eq!(
        q("99999999999999999999.9999999999Ki").to_string(),
        "102399999999999999999999999999898n"
    );
}

// TestQuantityString: (mantissa, exponent, format, canonical, alternate spelling).
const STRING_CASES: &[(i128, i32, Format, &str, &str)] = &[
    (1 << 30, 0, B, "1Gi", "1024Mi"),
    (300 << 20, 0, B, "300Mi", "307200Ki"),
    (6 * 1024, 0, B, "6Ki", ""),
    (1001 << 30, 0, B, "1001Gi", "1025024Mi"),
    (1 << 40, 0, B, "1Ti", "1024Gi"),
    (5, 0, B, "5", "5000m"),
    (500, -3, B, "500m", "0.5"),
    (1, 9, D, "1G", "1000M"),
    (1000, 6, D, "1G", "0.001T"),
    (1000000, 3, D, "1G", ""),
    (1000000000, 0, D, "1G", ""),
    (1, -3, D, "1m", "1000u"),
    (80, -3, D, "80m", ""),
    (1080, -3, D, "1080m", "1.08"),
    (108, -2, D, "1080m", "1080000000n"),
    (10800, -4, D, "1080m", ""),
    (300, 6, D, "300M", ""),
    (1, 12, D, "1T", ""),
    (1234567, 6, D, "1234567M", ""),
    (1234567, -3, B, "1234567m", ""),
    (3, 3, D, "3k", ""),
    (1025, 0, B, "1025", ""),
    (0, 0, D, "0", ""),
    (0, 0, B, "0", ""),
    (1, 9, X, "1e9", ".001e12"),
    (1, -3, X, "1e-3", "0.001e0"),
    (1, -9, X, "1e-9", "1000e-12"),
    (80, -3, X, "80e-3", ""),
    (300, 6, X, "300e6", ""),
    (1, 12, X, "1e12", ""),
    (1, 3, X, "1e3", ""),
    (3, 3, X, "3e3", ""),
    (0, 0, X, "0", "00"),
    (1, -9, D, "1n", ""),
    (80, -9, D, "80n", ""),
    (1080, -9, D, "1080n", ""),
    (108, -8, D, "1080n", ""),
    (10800, -10, D, "1080n", ""),
    (1, -6, D, "1u", ""),
    (80, -6, D, "80u", ""),
    (1080, -6, D, "1080u", ""),
];

#[test]
fn canonical_strings() {
    for &(m, e, format, expect, alternate) in STRING_CASES {
        let value = qn(dec(m, e), format);
        assert_eq!(value.to_string(), expect, "{m}e{e} {format:?}");
        assert_eq!(q(expect), value, "{expect}");
        assert_eq!(q(expect).to_string(), expect);
        if !alternate.is_empty() {
            assert_eq!(q(alternate).to_string(), expect, "{alternate}");
        }
        if m != 0 {
            let negated = qn(-dec(m, e), format);
            assert_eq!(negated.to_string(), format!("-{expect}"));
        }
    }
}

#[test]
fn parse_then_emit() {
    // TestQuantityParseEmit
    for (input, expect) in [
        ("1Ki", "1Ki"),
        ("1Mi", "1Mi"),
        ("1Gi", "1Gi"),
        ("1024Mi", "1Gi"),
        ("1000M", "1G"),
        (".001Ki", "1024m"),
        (".000001Ki", "1024u"),
        (".000000001Ki", "1024n"),
        (".000000000001Ki", "2n"),
        // our own, from the capacity amounts the agent sees
        ("10Gi", "10Gi"),
        ("2G", "2G"),
        ("500M", "500M"),
        ("1.5Gi", "1536Mi"),
        ("100m", "100m"),
        ("1e3", "1e3"),
        ("1.5", "1500m"),
        ("+1", "1"),
        ("01Ki", "1Ki"),
        ("1.005k", "1005"),
        ("1E3", "1e3"),
        ("1024Ki", "1Mi"),
        ("1023Ki", "1023Ki"),
        ("1536", "1536"),
        ("0.5Ki", "512"),
        ("1000k", "1M"),
        ("12e2", "1200"),
        ("10e-4", "1e-3"),
        ("-0", "0"),
        ("-0Ki", "0"),
    ] {
        assert_eq!(q(input).to_string(), expect, "{input}");
        if !q(input).is_zero() && !input.starts_with(['+', '-']) {
            assert_eq!(
                q(&format!("-{input}")).to_string(),
                format!("-{expect}"),
                "-{input}"
            );
        }
    }
}

#[test]
fn wide_values_keep_their_digits() {
    // TestParseQuantity: (input, canonical if different).
    let cases: &[(&str, &str)] = &[
        ("-999999999999999999", ""),
        ("999999999999999999", ""),
        ("-999999999999999999.0", "-999999999999999999"),
        ("999999999999999999.0", "999999999999999999"),
        ("-999999999999999999.1", "-999999999999999999100m"),
        ("999999999999999999.1", "999999999999999999100m"),
        ("-9999999999999999999", ""),
        ("9999999999999999999", ""),
        ("-1E", ""),
        ("1E", ""),
        ("-1000000000000000000", "-1E"),
        ("1000000000000000000", "1E"),
        ("-9999999999999999999.0", "-9999999999999999999"),
        ("9999999999999999999.0", "9999999999999999999"),
        ("-1.0E", "-1E"),
        ("1.0E", "1E"),
        ("-1000000000000000000.0", "-1E"),
        ("1000000000000000000.0", "1E"),
        ("-9999999999999999999000m", "-9999999999999999999"),
        ("9999999999999999999000m", "9999999999999999999"),
        ("-9999999999999999999.1", "-9999999999999999999100m"),
        ("9999999999999999999.1", "9999999999999999999100m"),
        ("-1.0000000000000000001E", "-1000000000000000000100m"),
        ("1.0000000000000000001E", "1000000000000000000100m"),
        ("-1000000000000000000.1", "-1000000000000000000100m"),
        ("1000000000000000000.1", "1000000000000000000100m"),
        ("-1.000000000000000001E", "-1000000000000000001"),
        ("1.000000000000000001E", "1000000000000000001"),
        ("-1000000000000000001", ""),
        ("1000000000000000001", ""),
        ("-10E", ""),
        ("10E", ""),
        ("-10000000000000000000", "-10E"),
        ("10000000000000000000", "10E"),
        ("-10.0E", "-10E"),
        ("10.0E", "10E"),
        ("-10000000000000000000.0", "-10E"),
        ("10000000000000000000.0", "10E"),
        ("-10000000000000000000000m", "-10E"),
        ("10000000000000000000000m", "10E"),
        ("-10.0000000000000000001E", "-10000000000000000000100m"),
        ("10.0000000000000000001E", "10000000000000000000100m"),
        ("-10000000000000000000.1", "-10000000000000000000100m"),
        ("10000000000000000000.1", "10000000000000000000100m"),
        ("-10.000000000000000001E", "-10000000000000000001"),
        ("10.000000000000000001E", "10000000000000000001"),
        ("-10000000000000000001", ""),
        ("10000000000000000001", ""),
        ("-9223372036854775809", ""),
        ("9223372036854775806", ""),
        ("-9223372036854775809.0", "-9223372036854775809"),
        ("9223372036854775806.0", "9223372036854775806"),
        ("-9223372036854775809000m", "-9223372036854775809"),
        ("9223372036854775806000m", "9223372036854775806"),
        ("-9223372036854775809.1", "-9223372036854775809100m"),
        ("9223372036854775806.1", "9223372036854775806100m"),
        ("-9223372036854775808", ""),
        ("9223372036854775807", ""),
        ("-9223372036854775808.0", "-9223372036854775808"),
        ("9223372036854775807.0", "9223372036854775807"),
        ("-9223372036854775808000m", "-9223372036854775808"),
        ("9223372036854775807000m", "9223372036854775807"),
        ("-9223372036854775808.1", "-9223372036854775808100m"),
        ("9223372036854775807.1", "9223372036854775807100m"),
        ("-9223372036854775807", ""),
        ("9223372036854775808", ""),
        ("-9223372036854775807.0", "-9223372036854775807"),
        ("9223372036854775808.0", "9223372036854775808"),
        ("-9223372036854775807000m", "-9223372036854775807"),
        ("9223372036854775808000m", "9223372036854775808"),
        ("-9223372036854775807.1", "-9223372036854775807100m"),
        ("9223372036854775808.1", "9223372036854775808100m"),
    ];
    for &(input, canonical) in cases {
        let expect = if canonical.is_empty() {
            input
        } else {
            canonical
        };
        assert_eq!(q(input).to_string(), expect, "{input}");
        assert_eq!(q(expect), q(input));
    }
    assert_eq!(
        q("-9223372036854775809").nanos(),
        (MOST_NEGATIVE - 1) * UNIT
    );
    assert_eq!(
        q("9223372036854775808.1").nanos(),
        (MOST_POSITIVE + 1) * UNIT + UNIT / 10
    );
}

#[test]
fn suffixes_are_never_dropped() {
    // apimachinery prints these without a suffix, i.e. as a different value.
    let big = 10i128.pow(21);
    assert_eq!(qn(big * UNIT, D).to_string(), "1000E");
    assert_eq!(q("1000E").to_string(), "1000E");
    assert_eq!(qn(big * UNIT, X).to_string(), "1e21");
    assert_eq!(qn((1 << 70) * UNIT, B).to_string(), "1024Ei");
    assert_eq!(q("1024Ei").to_string(), "1024Ei");
    assert_eq!(
        qn((3 << 60) * UNIT + UNIT / 2, B).to_string(),
        "3458764513820540928500m"
    );
}

#[test]
fn comparisons_across_formats() {
    // TestQuantityCmp
    assert_eq!(q("0").cmp(&q("0")), Ordering::Equal);
    assert_eq!(q("100m").cmp(&q("50m")), Ordering::Greater);
    assert_eq!(q("50m").cmp(&q("100m")), Ordering::Less);
    assert_eq!(q("10000T").cmp(&q("100Gi")), Ordering::Greater);

    let same = [
        "1Gi",
        "1073741824",
        "1073741824000m",
        "1.073741824e9",
        "1048576Ki",
        "1.073741824G",
    ];
    for s in same {
        assert_eq!(q(s), q("1Gi"), "{s}");
        assert_eq!(hash_of(&q(s)), hash_of(&q("1Gi")), "{s}");
    }
    assert_ne!(q("1Gi").format(), q("1073741824").format());
    assert!(q("1k") < q("1Ki"));
    assert!(q("1G") < q("1Gi"));
    assert!(q("-1") < Quantity::ZERO && Quantity::ZERO < q("1n"));
    assert_eq!(q("0Ki"), Quantity::ZERO);
    let set: BTreeSet<Quantity> = same.iter().map(|s| q(s)).chain([q("1"), q("1k")]).collect();
    let sorted: Vec<i128> = set.iter().map(Quantity::nanos).collect();
    assert_eq!(sorted, [UNIT, 1000 * UNIT, (1 << 30) * UNIT]);
}

#[test]
fn checked_arithmetic() {
    // TestAdd and TestSub, values and resulting formats.
    let d = |m: i128, f| qn(m * UNIT, f);
    for (a, b, sum, diff) in [
        (d(10, D), d(10, D), (20, D), (0, D)),
        (d(10, D), d(1, B), (11, D), (9, D)),
        (d(10, B), d(1, D), (11, B), (9, B)),
        (Quantity::ZERO, d(50, D), (50, D), (-50, D)),
        (d(50, D), Quantity::ZERO, (50, D), (50, D)),
        (Quantity::ZERO, Quantity::ZERO, (0, D), (0, D)),
    ] {
        let s = a.checked_add(&b).map(|r| (r.nanos() / UNIT, r.format()));
        assert_eq!(s, Some(sum), "{a} + {b}");
        let s = a.checked_sub(&b).map(|r| (r.nanos() / UNIT, r.format()));
        assert_eq!(s, Some(diff), "{a} - {b}");
    }
    // TestQuantityAddZeroPreservesSuffix / TestQuantitySubZeroPreservesSuffix
    for s in ["100m", "1Gi"] {
        let v = q(s);
        let show = |r: Option<Quantity>| r.map(|r| r.to_string());
        assert_eq!(show(v.checked_add(&Quantity::ZERO)), Some(s.to_owned()));
        assert_eq!(show(Quantity::ZERO.checked_add(&v)), Some(s.to_owned()));
        assert_eq!(show(v.checked_sub(&Quantity::ZERO)), Some(s.to_owned()));
        assert_eq!(show(Quantity::ZERO.checked_sub(&v)), Some(format!("-{s}")));
    }
    // TestQuantityNeg
    assert_eq!(
        q("9.01").checked_neg().map(|r| r.to_string()),
        Some("-9010m".into())
    );
    // TestMul: everything apimachinery reports as inexact in int64 is exact here.
    for (a, n, want) in [
        (10, 10, 100),
        (10, 1, 10),
        (0, 50, 0),
        (50, 0, 0),
        (10, -10, -100),
        (-50, -50, 2500),
        (MOST_POSITIVE, 1, MOST_POSITIVE),
        (MOST_POSITIVE, -1, -MOST_POSITIVE),
        (MOST_POSITIVE / 2, 2, (MOST_POSITIVE / 2) * 2),
        (MOST_POSITIVE, 2, MOST_POSITIVE * 2),
        (MOST_POSITIVE, 10, MOST_POSITIVE * 10),
        (MOST_NEGATIVE, -1, MOST_POSITIVE + 1),
        (MOST_NEGATIVE, 2, MOST_NEGATIVE * 2),
        (MOST_NEGATIVE, -10, (MOST_POSITIVE + 1) * 10),
    ] {
        let got = d(a, D).checked_mul(n).map(|r| r.nanos());
        assert_eq!(got, Some(want * UNIT), "{a} * {n}");
    }
    assert_eq!(
        q("1Gi").checked_mul(3).map(|r| r.to_string()),
        Some("3Gi".into())
    );

    let max = qn(i128::MAX, D);
    let min = qn(-i128::MAX, D);
    let one_nano = q("1n");
    assert_eq!(max.checked_add(&one_nano), None);
    assert_eq!(min.checked_sub(&one_nano), None); // would be i128::MIN
    assert_eq!(min.checked_add(&min), None);
    assert_eq!(max.checked_sub(&min), None);
    assert_eq!(max.checked_mul(2), None);
    assert_eq!(min.checked_mul(-2), None);
    assert_eq!(q("1").checked_mul(i128::MAX), None);
    assert_eq!(max.checked_mul(-1), Some(min));
    assert_eq!(min.checked_neg(), Some(max));
    assert_eq!(max.checked_sub(&max), Some(Quantity::ZERO));
    assert_eq!(Quantity::from_nanos(i128::MIN, D), None);
    assert_eq!(
        Quantity::from_units(i128::MAX / UNIT, D).map(|r| r.nanos() % UNIT),
        Some(0)
    );
    assert_eq!(Quantity::from_units(i128::MAX / UNIT + 1, D), None);
    assert_eq!(Quantity::from_units(i128::MIN / UNIT - 1, D), None);
}

#[test]
fn constructors_print_like_apimachinery() {
    // TestNewSet
    for (v, f, expect) in [
        (1, D, "1"),
        (1000, D, "1k"),
        (1234000, D, "1234k"),
        (1024, B, "1Ki"),
        (1000000, X, "1e6"),
        (1 << 20, B, "1Mi"),
    ] {
        let made = Quantity::from_units(v, f).map(|r| r.to_string());
        assert_eq!(made.as_deref(), Some(expect));
        assert_eq!(q(expect).ceil_units(), Some(v));
    }
    // TestMilliNewSet
    for (v, f, expect) in [
        (1, D, "1m"),
        (1000, D, "1"),
        (1234000, D, "1234"),
        (1024, B, "1024m"),
        (1000000, X, "1e3"),
        (1 << 20, B, "1048576m"),
    ] {
        assert_eq!(qn(v * 1_000_000, f).to_string(), expect);
    }
    // TestNewScaledSet
    for (v, scale, expect) in [
        (1, -9, "1n"),
        (1000, -9, "1u"),
        (1, -6, "1u"),
        (1000, -6, "1m"),
        (1, -3, "1m"),
        (1000, -3, "1"),
        (1, 0, "1"),
        (0, -9, "0"),
        (0, -6, "0"),
        (0, -3, "0"),
        (0, 0, "0"),
    ] {
        assert_eq!(qn(dec(v, scale), D).to_string(), expect);
    }
    // quantity_example_test.go ExampleFormat
    let units = |v, f| Quantity::from_units(v, f).map(|r| r.to_string());
    assert_eq!(units(5 << 30, B).as_deref(), Some("5Gi"));
    assert_eq!(units(5_000_000_000, D).as_deref(), Some("5G"));
    assert_eq!(qn(5300 * 1_000_000, D).to_string(), "5300m");
    assert_eq!(format!("[{:>6}|{:<4}]", q("1Gi"), q("0")), "[   1Gi|0   ]");
}

#[test]
fn ceil_units_rounds_away_from_zero() {
    // TestQuantityRoundUp at scale 0, and ExampleMustParse.
    for (s, want) in [
        ("9.01", 10),
        ("-9.01", -10),
        ("9", 9),
        ("1n", 1),
        ("-1n", -1),
        ("0", 0),
        ("999999999n", 1),
        ("5Gi", 5368709120),
        ("5G", 5000000000),
        ("5300m", 6),
    ] {
        assert_eq!(q(s).ceil_units(), Some(want), "{s}");
    }
    assert_eq!(qn(i128::MAX, D).ceil_units(), Some(i128::MAX / UNIT + 1));
    assert_eq!(qn(-i128::MAX, D).ceil_units(), Some(-i128::MAX / UNIT - 1));
}

#[test]
fn exact_division() {
    for (a, step, want) in [
        ("10Gi", "1Gi", Some(10)),
        ("10Gi", "3Gi", None),
        ("1.5Gi", "512Mi", Some(3)),
        ("1", "1n", Some(1_000_000_000)),
        ("0", "5", Some(0)),
        ("5", "0", None),
        ("0", "0", None),
        ("-6", "2", Some(-3)),
        ("6", "-2", Some(-3)),
        ("1", "3", None),
        ("3Gi", "1G", None),
        ("2G", "500M", Some(4)),
        ("1k", "1e3", Some(1)),
    ] {
        assert_eq!(q(a).exact_div(&q(step)), want, "{a} / {step}");
    }
    let max = qn(i128::MAX, D);
    assert_eq!(max.exact_div(&max), Some(1));
    assert_eq!(max.exact_div(&q("1n")), Some(i128::MAX));
    assert_eq!(max.exact_div(&q("-1n")), Some(-i128::MAX));
}

fn any_format() -> impl Strategy<Value = Format> {
    prop_oneof![Just(B), Just(D), Just(X)]
}

/// Values made of few significant digits times a power of 1000 or 1024, so
/// that every suffix gets exercised.
fn round_nanos() -> impl Strategy<Value = i128> {
    (-99_999i128..=99_999, 0u32..=10, any::<bool>()).prop_map(|(m, p, binary)| {
        if binary {
            m * 1024i128.pow(p.min(6)) * UNIT
        } else {
            m * 1000i128.pow(p)
        }
    })
}

proptest! {
    #[test]
    fn display_then_parse_round_trips(
        nanos in prop_oneof![(i128::MIN + 1)..=i128::MAX, round_nanos()],
        format in any_format(),
    ) {
        let original = qn(nanos, format);
        let text = original.to_string();
        let back = Quantity::parse(&text);
        prop_assert_eq!(back.map(|r| r.nanos()), Ok(nanos), "{}", text);
        // Canonical text of a parsed value is a fixed point. (Not `text`
        // itself: BinarySI 2000 prints "2000", which reads back as DecimalSI
        // and then prints "2k", exactly as in apimachinery.)
        let again = q(&text).to_string();
        prop_assert_eq!(q(&again).to_string(), again);
    }

    #[test]
    fn whole_numbers_with_suffixes(v in 0i128..100_000_000_000, i in 0usize..16) {
        let (suffix, nanos_per) = [
            ("n", 1), ("u", 1_000), ("m", 1_000_000), ("", UNIT), ("k", 1_000 * UNIT),
            ("M", 1_000_000 * UNIT), ("G", UNIT * UNIT), ("T", 1_000 * UNIT * UNIT),
            ("P", 1_000_000 * UNIT * UNIT), ("E", UNIT * UNIT * UNIT),
            ("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("Ti", 1 << 40),
            ("Pi", 1 << 50), ("Ei", 1 << 60),
        ][i];
        let nanos_per = if suffix.ends_with('i') { nanos_per * UNIT } else { nanos_per };
        let got = Quantity::parse(&format!("{v}{suffix}")).map(|r| r.nanos());
        prop_assert_eq!(got, Ok(v * nanos_per));
        let got = Quantity::parse(&format!("{v}e{}", i)).map(|r| r.nanos());
        prop_assert_eq!(got, Ok(v * UNIT * 10i128.pow(i as u32)));
    }

    #[test]
    fn parse_never_panics(s in "[-+0-9.eEinumkKMGTP ]{0,40}|\\PC{0,20}") {
        if let Ok(v) = Quantity::parse(&s) {
            prop_assert_eq!(q(&v.to_string()), v);
        }
    }
}

#[test]
fn remaining_after_never_goes_below_zero() {
    let q = |s: &str| Quantity::parse(s).unwrap();
    assert_eq!(q("40Gi").remaining_after(&q("30Gi")), q("10Gi"));
    assert_eq!(q("25Gi").remaining_after(&q("30Gi")), Quantity::ZERO);
    assert_eq!(q("1").remaining_after(&q("1")), Quantity::ZERO);
}
