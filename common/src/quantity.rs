//! Exact Kubernetes resource quantities, as written in DRA consumable-capacity
//! amounts ("10Gi", "2G", "500M", "1.5Gi", "100m", "1e3").
//!
//! This mirrors `k8s.io/apimachinery/pkg/api/resource.Quantity`: the same
//! grammar, the same rounding of sub-nano values, and the same canonical
//! string form. The value is held as an `i128` count of nano-units, which is
//! exact for everything apimachinery can represent at nano precision up to
//! about ±1.7e29 units.
//!
//! Values outside that range are refused with [`QuantityError::Overflow`].
//! apimachinery would fall back to arbitrary-precision decimals (and clamps
//! binary-suffixed input at 2^63-1); we refuse instead, on purpose: the agent
//! checks exact sums of capacity and must never silently clamp or round an
//! amount that someone else will compare against.
//!
//! Rounding: a value finer than 1n is rounded *away from zero* to the next
//! nano ("0.1n" -> "1n", "-0.1n" -> "-1n"), as apimachinery does, on the
//! theory that asking for a tiny amount of something means asking for some.
//!
//! Where we knowingly differ from apimachinery (all at the edges):
//! - inputs whose number has no digits ("-", "+", ".", "Ki", "m", "e3") are
//!   rejected; apimachinery reads them as zero;
//! - binary-suffixed input above 2^63-1 ("9Ei") keeps its exact value instead
//!   of being clamped to 2^63-1;
//! - an exponent is used at its true size; apimachinery truncates it to 32
//!   bits ("1e4294967296" reads as 1 there, is an overflow here);
//! - `Display` always prints the computed canonical form, like
//!   `CanonicalizeBytes`; apimachinery's `String()` echoes some inputs verbatim
//!   from a cache ("+1", "01Ki", "1.005k", "1E3");
//! - canonical output never drops a suffix: decimal values of 10^21 and more
//!   print as "1000E" (apimachinery prints "1", which reads back as a
//!   different value), binary multiples of 2^70 as "1024Ei".

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

const NANOS_PER_UNIT: i128 = 1_000_000_000;

/// Exact value held as an i128 count of nano-units (10^-9), plus the format it was written in.
///
/// Invariant: `nanos != i128::MIN`, so negation never overflows and every
/// value prints as a string that parses back to it.
#[derive(Clone, Copy, Debug)]
pub struct Quantity {
    nanos: i128,
    format: Format,
}

/// How a quantity was written, and so how it is printed back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Powers of 1024: Ki, Mi, Gi, Ti, Pi, Ei.
    BinarySI,
    /// Powers of 1000: n, u, m, (none), k, M, G, T, P, E.
    DecimalSI,
    /// `e`/`E` followed by a signed integer power of ten.
    DecimalExponent,
}

/// Why a string is not an acceptable quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty string is not a quantity")]
    Empty,
    #[error("{input:?}: {reason}")]
    Syntax { input: String, reason: String },
    #[error(
        "{input:?}: out of range: magnitude must be below 2^127 nano-units (about 1.7e29 units)"
    )]
    Overflow { input: String },
    #[error("{input:?}: negative quantity not allowed")]
    Negative { input: String },
}

impl Quantity {
    /// Zero, written as "0".
    pub const ZERO: Quantity = Quantity {
        nanos: 0,
        format: Format::DecimalSI,
    };

    /// Parses the apimachinery quantity grammar:
    /// `[+-] digits [. digits] [suffix]` where the suffix is one of
    /// Ki Mi Gi Ti Pi Ei, n u m k M G T P E, or `e`/`E` with a signed integer.
    /// No surrounding whitespace is allowed.
    ///
    /// # Errors
    ///
    /// [`QuantityError::Empty`] or [`QuantityError::Syntax`] for text outside
    /// that grammar, [`QuantityError::Overflow`] for a value of 2^127
    /// nano-units or more in magnitude.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        let syntax = |reason: String| QuantityError::Syntax {
            input: s.to_owned(),
            reason,
        };
        if s.is_empty() {
            return Err(QuantityError::Empty);
        }

        let mut rest = s.as_bytes();
        let negative = match rest {
            [b'-', tail @ ..] => {
                rest = tail;
                true
            }
            [b'+', tail @ ..] => {
                rest = tail;
                false
            }
            _ => false,
        };
        let int_digits = take_digits(&mut rest);
        let frac_digits = match rest {
            [b'.', tail @ ..] => {
                rest = tail;
                take_digits(&mut rest)
            }
            _ => &[],
        };
        if int_digits.is_empty() && frac_digits.is_empty() {
            return Err(syntax(
                "missing number: expected digits such as 1, 0.5 or .5 before any suffix".into(),
            ));
        }

        let (exp10, exp2, mut format) = interpret_suffix(rest).map_err(syntax)?;
        let magnitude = magnitude_nanos(int_digits, frac_digits, exp10, exp2).ok_or_else(|| {
            QuantityError::Overflow {
                input: s.to_owned(),
            }
        })?;
        // apimachinery reports a binary-suffixed amount below one unit as
        // decimal, since it cannot be shown with a binary suffix anyway.
        if format == Format::BinarySI && magnitude != 0 && magnitude < NANOS_PER_UNIT {
            format = Format::DecimalSI;
        }
        let nanos = if negative { -magnitude } else { magnitude };
        Ok(Quantity { nanos, format })
    }

    /// Like [`Quantity::parse`], but refuses negative amounts, which make no
    /// sense for capacities.
    ///
    /// # Errors
    ///
    /// As [`Quantity::parse`], plus [`QuantityError::Negative`] for a value
    /// below zero.
    pub fn parse_non_negative(s: &str) -> Result<Quantity, QuantityError> {
        let q = Self::parse(s)?;
        if q.is_negative() {
            return Err(QuantityError::Negative {
                input: s.to_owned(),
            });
        }
        Ok(q)
    }

    /// `v` whole units; `None` if that does not fit.
    #[must_use]
    pub fn from_units(v: i128, format: Format) -> Option<Quantity> {
        Self::from_nanos(v.checked_mul(NANOS_PER_UNIT)?, format)
    }

    /// `nanos` nano-units; `None` only for `i128::MIN` (see the type's invariant).
    #[must_use]
    pub fn from_nanos(nanos: i128, format: Format) -> Option<Quantity> {
        (nanos != i128::MIN).then_some(Quantity { nanos, format })
    }

    #[must_use]
    pub fn nanos(&self) -> i128 {
        self.nanos
    }

    #[must_use]
    pub fn format(&self) -> Format {
        self.format
    }

    /// The same value, printed in another format.
    #[must_use]
    pub fn with_format(self, format: Format) -> Quantity {
        Quantity { format, ..self }
    }

    #[must_use]
    pub fn is_negative(&self) -> bool {
        self.nanos < 0
    }

    #[must_use]
    pub fn is_zero(&self) -> bool {
        self.nanos == 0
    }

    /// Sum; keeps `self`'s format unless `self` is zero, as apimachinery's
    /// `Add` does, so that "0 + 1Gi" still prints as "1Gi".
    #[must_use]
    pub fn checked_add(&self, o: &Quantity) -> Option<Quantity> {
        Self::from_nanos(self.nanos.checked_add(o.nanos)?, self.format_with(o))
    }

    /// Difference; format chosen as for [`Quantity::checked_add`].
    #[must_use]
    pub fn checked_sub(&self, o: &Quantity) -> Option<Quantity> {
        Self::from_nanos(self.nanos.checked_sub(o.nanos)?, self.format_with(o))
    }

    /// What is left of `self` after `o`: the difference, or zero where `o` is larger (or
    /// the difference does not fit). For "free" capacity, which is never negative.
    #[must_use]
    pub fn remaining_after(&self, o: &Quantity) -> Quantity {
        self.checked_sub(o)
            .filter(|d| !d.is_negative())
            .unwrap_or(Quantity::ZERO)
    }

    #[must_use]
    pub fn checked_mul(&self, n: i128) -> Option<Quantity> {
        Self::from_nanos(self.nanos.checked_mul(n)?, self.format)
    }

    #[must_use]
    pub fn checked_neg(&self) -> Option<Quantity> {
        Self::from_nanos(self.nanos.checked_neg()?, self.format)
    }

    /// Value rounded up to whole units (e.g. bits per second), None if it does not fit.
    ///
    /// Like apimachinery's `Value()`, a fraction rounds away from zero: 9.01
    /// gives 10 and -9.01 gives -10. With `i128` units this always fits; the
    /// `Option` leaves room for a narrower unit type.
    #[must_use]
    pub fn ceil_units(&self) -> Option<i128> {
        let whole = self.nanos / NANOS_PER_UNIT;
        let rem = self.nanos % NANOS_PER_UNIT;
        // |whole| < i128::MAX / 10^9, so stepping one further cannot overflow.
        Some(whole + rem.signum())
    }

    /// Exact division test and quotient: how many whole `step`s fit in self, Some only if exact.
    /// `None` for a zero step.
    #[must_use]
    pub fn exact_div(&self, step: &Quantity) -> Option<i128> {
        if self.nanos.checked_rem(step.nanos)? != 0 {
            return None;
        }
        self.nanos.checked_div(step.nanos)
    }

    fn format_with(&self, o: &Quantity) -> Format {
        if self.is_zero() {
            o.format
        } else {
            self.format
        }
    }

    /// Canonical mantissa magnitude and suffix, following apimachinery's
    /// `CanonicalizeBytes`: the largest suffix that keeps the mantissa a whole
    /// number, binary only for whole multiples of at least 1Ki.
    fn canonical_parts(&self) -> (u128, Suffix) {
        let unit = NANOS_PER_UNIT.unsigned_abs();
        let magnitude = self.nanos.unsigned_abs();
        if self.format == Format::BinarySI
            && magnitude >= 1024 * unit
            && magnitude.is_multiple_of(unit)
        {
            let mut units = magnitude / unit;
            let [mut suffix, larger @ ..] = BINARY_SUFFIXES;
            // Ei is the largest binary suffix; beyond it the mantissa grows.
            for next in larger {
                if !units.is_multiple_of(1024) {
                    break;
                }
                units /= 1024;
                suffix = next;
            }
            return (units, Suffix::Fixed(suffix));
        }
        // Strip whole thousands above the nano scale. Zero never gets here,
        // so the mantissa stays non-zero and the loops end.
        let mut mantissa = magnitude;
        if self.format == Format::DecimalExponent {
            let mut exponent = -9;
            while mantissa.is_multiple_of(1000) {
                mantissa /= 1000;
                exponent += 3;
            }
            return (mantissa, Suffix::Exponent(exponent));
        }
        let [mut suffix, larger @ ..] = DECIMAL_SUFFIXES;
        // E is the largest decimal suffix; beyond it the mantissa grows.
        for next in larger {
            if !mantissa.is_multiple_of(1000) {
                break;
            }
            mantissa /= 1000;
            suffix = next;
        }
        (mantissa, Suffix::Fixed(suffix))
    }
}

const DECIMAL_SUFFIXES: [&str; 10] = ["n", "u", "m", "", "k", "M", "G", "T", "P", "E"];
const BINARY_SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];

enum Suffix {
    Fixed(&'static str),
    Exponent(i32),
}

impl fmt::Display for Suffix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Suffix::Fixed(s) => f.write_str(s),
            Suffix::Exponent(0) => Ok(()),
            Suffix::Exponent(e) => write!(f, "e{e}"),
        }
    }
}

/// Splits off the leading ASCII digits of `rest`.
fn take_digits<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let n = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (digits, tail) = rest.split_at(n);
    *rest = tail;
    digits
}

/// Maps a suffix to (power of ten, power of two, format).
fn interpret_suffix(suffix: &[u8]) -> Result<(i64, u32, Format), String> {
    use Format::{BinarySI, DecimalExponent, DecimalSI};
    Ok(match suffix {
        b"n" => (-9, 0, DecimalSI),
        b"u" => (-6, 0, DecimalSI),
        b"m" => (-3, 0, DecimalSI),
        b"" => (0, 0, DecimalSI),
        b"k" => (3, 0, DecimalSI),
        b"M" => (6, 0, DecimalSI),
        b"G" => (9, 0, DecimalSI),
        b"T" => (12, 0, DecimalSI),
        b"P" => (15, 0, DecimalSI),
        b"E" => (18, 0, DecimalSI),
        b"Ki" => (0, 10, BinarySI),
        b"Mi" => (0, 20, BinarySI),
        b"Gi" => (0, 30, BinarySI),
        b"Ti" => (0, 40, BinarySI),
        b"Pi" => (0, 50, BinarySI),
        b"Ei" => (0, 60, BinarySI),
        [b'e' | b'E', exponent @ ..] => (parse_exponent(suffix, exponent)?, 0, DecimalExponent),
        _ => return Err(unknown_suffix(suffix)),
    })
}

fn unknown_suffix(suffix: &[u8]) -> String {
    format!("unknown suffix {:?}", String::from_utf8_lossy(suffix))
}

/// `[+-]digits` into an i64, the range apimachinery accepts for exponents.
fn parse_exponent(suffix: &[u8], text: &[u8]) -> Result<i64, String> {
    let (negative, digits) = match text {
        [b'-', d @ ..] => (true, d),
        [b'+', d @ ..] | d => (false, d),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return Err(unknown_suffix(suffix));
    }
    let out_of_range = || format!("exponent {:?} out of range", String::from_utf8_lossy(text));
    let mut magnitude: i128 = 0;
    for &d in digits {
        magnitude = magnitude
            .checked_mul(10)
            .and_then(|m| m.checked_add(i128::from(d - b'0')))
            .filter(|&m| m <= 1 << 63)
            .ok_or_else(out_of_range)?;
    }
    let value = if negative { -magnitude } else { magnitude };
    i64::try_from(value).map_err(|_| out_of_range())
}

/// `int.frac` × 10^`exp10` × 2^`exp2` in nano-units, rounded up to a whole
/// nano; `None` if that exceeds `i128::MAX`.
fn magnitude_nanos(int: &[u8], frac: &[u8], exp10: i64, exp2: u32) -> Option<i128> {
    // Work on the decimal digits of the mantissa with the point removed, so
    // that any input length stays exact; only the result has to fit.
    let mut digits: Vec<u8> = int.iter().chain(frac).map(|c| c - b'0').collect();
    if exp2 > 0 {
        // Schoolbook multiply by 2^exp2 (at most 2^60): every intermediate
        // is below 10 * 2^60 + 2^60, far inside u128.
        let factor = 1u128 << exp2;
        let mut carry = 0u128;
        for d in digits.iter_mut().rev() {
            let v = u128::from(*d) * factor + carry;
            *d = (v % 10) as u8;
            carry = v / 10;
        }
        let mut head = Vec::new();
        while carry > 0 {
            head.push((carry % 10) as u8);
            carry /= 10;
        }
        head.reverse();
        head.extend_from_slice(&digits);
        digits = head;
    }

    let mut digits = digits.as_slice();
    while let [0, rest @ ..] = digits {
        digits = rest;
    }
    if digits.is_empty() {
        return Some(0);
    }
    // Power of ten that turns the digit string into nano-units. usize always
    // fits in i128, and i64 - usize + 9 cannot overflow it.
    let scale = i128::from(exp10) - frac.len() as i128 + 9;
    let (whole, dropped) = if scale >= 0 {
        (digits, &[][..])
    } else {
        let drop = usize::try_from(-scale).unwrap_or(usize::MAX);
        digits.split_at(digits.len().saturating_sub(drop))
    };

    let mut value: u128 = 0;
    for &d in whole {
        value = value.checked_mul(10)?.checked_add(u128::from(d))?;
    }
    if scale > 0 {
        // value >= 1 here, so a scale too large for checked_pow overflows anyway.
        value = value.checked_mul(10u128.checked_pow(u32::try_from(scale).ok()?)?)?;
    }
    if dropped.iter().any(|&d| d != 0) {
        value = value.checked_add(1)?;
    }
    i128::try_from(value).ok()
}

impl Default for Quantity {
    fn default() -> Self {
        Quantity::ZERO
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Quantity::parse(s)
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nanos == 0 {
            // Never "-0" nor "0Ki".
            return f.pad("0");
        }
        let (mantissa, suffix) = self.canonical_parts();
        let sign = if self.nanos < 0 { "-" } else { "" };
        // pad() so width and alignment work in log tables.
        f.pad(&format!("{sign}{mantissa}{suffix}"))
    }
}

// Equality, order and hash go by value alone: "1Gi" == "1073741824".
impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}

impl Eq for Quantity {}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl Hash for Quantity {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.nanos.hash(state);
    }
}

#[cfg(test)]
#[path = "quantity_tests.rs"]
mod tests;
