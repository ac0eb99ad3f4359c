//! Durations as people write them in the config and on the command line ("10s",
//! "1h 30m", "100ms"): humantime's grammar, behind a guard against its one panic.

use std::time::Duration;

pub use humantime::DurationError;

/// humantime's largest unit, a year of 365.25 days, in seconds.
const YEAR_SECS: u128 = 31_557_600;

/// `humantime::parse_duration`, except that no text makes it panic.
///
/// humantime (2.4 and upstream, chronotope/humantime#66) panics with "overflow in
/// Duration::new" instead of failing when its running sum reaches exactly 2^64-1
/// seconds with a whole second of nanoseconds, e.g. "18446744073709551615s
/// 1000000000ns". Each number humantime reads is a run of digits (blanks inside it are
/// skipped) ended by a unit, and adds less than (number + 1) years, the 1 covering a
/// fraction after it. A text whose runs stay below 2^64-1 seconds even that way cannot
/// reach the panic; anything else is refused with the error humantime gives for an
/// overflow. That refuses only texts whose numbers add up to about 5.8e11 (of any
/// unit, "1000000000000ns" included), far above any duration the agent reads.
pub fn parse(s: &str) -> Result<Duration, DurationError> {
    let mut bound: u128 = 0;
    let mut number: Option<u128> = None;
    let mut fraction = false;
    for c in s.chars() {
        match c {
            // A fraction's digits add less than the 1 counted for its number.
            '0'..='9' if fraction => {}
            '0'..='9' => {
                let digit = u128::from(c as u8 - b'0');
                let n = number.unwrap_or(0).saturating_mul(10).saturating_add(digit);
                number = Some(n);
            }
            c if c.is_whitespace() => {}
            _ => {
                if let Some(n) = number.take() {
                    bound = bound.saturating_add(n.saturating_add(1));
                }
                fraction = c == '.';
            }
        }
    }
    if let Some(n) = number {
        bound = bound.saturating_add(n.saturating_add(1));
    }
    if bound.saturating_mul(YEAR_SECS) >= u128::from(u64::MAX) {
        return Err(DurationError::NumberOverflow);
    }
    #[expect(
        clippy::disallowed_methods,
        reason = "the guarded call that the rest of the agent goes through"
    )]
    let parsed = humantime::parse_duration(s);
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found while fuzzing the config, whose target reaches humantime's parser
    /// (fuzz/corpus/config/humantime-carry-overflow.toml): humantime panicked on these
    /// instead of returning an error.
    #[test]
    fn a_sum_of_exactly_2_to_the_64_seconds_is_an_error_not_a_panic() {
        for s in [
            "18446744073709551615s 1000000000ns",
            "18446744073709551615s 999999999ns 1ns",
            "18446744073709551615s1000000000ns",
            "1844674407 3709551615s 1000000000ns",
            "18446744073709551614s 1.5s 500000000ns",
        ] {
            assert_eq!(parse(s), Err(DurationError::NumberOverflow), "{s}");
        }
    }

    #[test]
    fn reads_what_humantime_reads() {
        for s in [
            "0",
            "10s",
            "100ms",
            "1.5s",
            "1h 30m",
            "1h30m",
            "24h",
            "2d",
            "20 min 17 nsec ",
            "1y 2M 3w 4d 5h 6m 7s 8ms 9us 10ns",
            "0.000000001s",
            "100000000000ns",
            "500000000y",
        ] {
            #[expect(clippy::disallowed_methods, reason = "the reference")]
            let want = humantime::parse_duration(s);
            assert!(want.is_ok(), "{s}");
            assert_eq!(parse(s), want, "{s}");
        }
        for bad in ["", "10", "1x", "1.s", "-1s"] {
            #[expect(clippy::disallowed_methods, reason = "the reference")]
            let want = humantime::parse_duration(bad);
            assert!(want.is_err(), "{bad}");
            assert_eq!(parse(bad), want, "{bad}");
        }
    }

    #[test]
    fn refuses_only_absurd_magnitudes() {
        assert_eq!(parse("1000000000000ns"), Err(DurationError::NumberOverflow));
        assert_eq!(parse("600000000000y"), Err(DurationError::NumberOverflow));
        assert_eq!(
            parse("584542046000y"),
            Ok(Duration::from_secs(584_542_046_000 * 31_557_600))
        );
    }
}
