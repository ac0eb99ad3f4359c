//! `shareguard capacity`: how much logical capacity a fleet of devices can promise, given
//! each device's capacity, the request policy the scheduler rounds to, a target
//! utilisation and an optional reserve, after what the policy's grid strands.
//!
//! Three things come between the raw sum of capacities and what can be promised:
//!
//! - the reserve kept back on each device (an amount, or a percentage of it);
//! - fragmentation: shares are sizes the policy allows (`min + n*step`, at most `max`),
//!   or with a request mix, those sizes rounded up to the grid, so a device can be filled
//!   only to the largest sum of such sizes that fits what is left after the reserve;
//!   the rest is stranded on every device;
//! - rounding: a request of 3Gi under a 5Gi step consumes 5Gi, so with a mix of request
//!   sizes only the part asked for is logical capacity (the mix's weighted sum asked
//!   over its weighted sum consumed).
//!
//! What is promised is devices x packable x utilisation x rounding efficiency. Ratios
//! are kept in millionths and amounts in nano-units (as quantities are), so the figure
//! is exact to a millionth and no float is involved; an input too large for that is an
//! error naming it.

use shareguard_common::Quantity;

/// Millionths: ratios are kept as integers.
const PPM: i128 = 1_000_000;
/// The largest grid the fill is computed on exactly (units of the sizes' common
/// divisor per device); beyond it, the fill is the usable amount rounded down to that
/// divisor, which strands less than one of it.
const MAX_UNITS: i128 = 1 << 20;

/// A reserve kept back on every device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reserve {
    Amount(Quantity),
    /// Millionths of the device's capacity.
    Share(i128),
}

/// One request size of the mix and how often it comes, relative to the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MixEntry {
    pub size: Quantity,
    pub weight: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub devices: u64,
    pub capacity: Quantity,
    pub min: Quantity,
    pub step: Option<Quantity>,
    pub max: Option<Quantity>,
    /// Millionths.
    pub utilization: i128,
    pub reserve: Option<Reserve>,
    pub mix: Vec<MixEntry>,
}

/// One mix entry as the policy rounds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rounded {
    pub asked: Quantity,
    pub consumed: Quantity,
    pub weight: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Estimate {
    pub devices: u64,
    pub capacity: Quantity,
    pub reserve: Quantity,
    pub usable: Quantity,
    /// What shares of the allowed sizes can fill on one device.
    pub packable: Quantity,
    pub stranded: Quantity,
    pub rounding: Vec<Rounded>,
    /// Millionths: asked over consumed for the mix, all of it without one.
    pub rounding_efficiency: i128,
    pub utilization: i128,
    /// devices x capacity.
    pub raw: Quantity,
    /// What can be promised.
    pub promised: Quantity,
}

/// A flag's value that cannot be used, with the flag and the reason.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--{flag}: {reason}")]
pub struct PlanError {
    pub flag: &'static str,
    pub reason: String,
}

fn err(flag: &'static str, reason: impl Into<String>) -> PlanError {
    PlanError {
        flag,
        reason: reason.into(),
    }
}

/// A ratio in millionths from a decimal (`0.7`) or a percentage (`70%`), in `0..=1`.
pub fn parse_ratio(flag: &'static str, s: &str) -> Result<i128, PlanError> {
    let (digits, scale) = match s.trim().strip_suffix('%') {
        Some(p) => (p.trim(), PPM / 100),
        None => (s.trim(), PPM),
    };
    let (whole, frac) = digits.split_once('.').unwrap_or((digits, ""));
    let bad = || {
        err(
            flag,
            format!("{s:?} is not a decimal like 0.7 or a percentage like 70%"),
        )
    };
    if whole.is_empty() && frac.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    if frac.len() > 6 {
        return Err(err(flag, format!("{s:?} has more than 6 decimals")));
    }
    let whole: i128 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let frac_value: i128 = if frac.is_empty() {
        0
    } else {
        frac.parse::<i128>().map_err(|_| bad())? * 10i128.pow(6 - frac.len() as u32)
    };
    // A percentage's decimals are hundredths of a millionth's scale.
    let v = whole
        .checked_mul(scale)
        .and_then(|w| w.checked_add(frac_value * scale / PPM))
        .ok_or_else(bad)?;
    if v > PPM {
        return Err(err(flag, format!("{s:?} is more than the whole (1, 100%)")));
    }
    Ok(v)
}

/// `SIZE=WEIGHT,...` (a size alone weighs 1).
pub fn parse_mix(s: &str) -> Result<Vec<MixEntry>, PlanError> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (size, weight) = p.split_once('=').unwrap_or((p, "1"));
            let size =
                Quantity::parse(size.trim()).map_err(|e| err("mix", format!("{size:?}: {e}")))?;
            let weight: u64 = weight
                .trim()
                .parse()
                .ok()
                .filter(|w| *w > 0)
                .ok_or_else(|| {
                    err(
                        "mix",
                        format!("weight {weight:?} is not a positive whole number"),
                    )
                })?;
            Ok(MixEntry { size, weight })
        })
        .collect()
}

/// A reserve: an amount (`4Gi`) or a share of each device (`10%`, `0.1`).
pub fn parse_reserve(s: &str) -> Result<Reserve, PlanError> {
    if s.trim().ends_with('%') || s.trim().starts_with("0.") {
        return parse_ratio("reserve", s).map(Reserve::Share);
    }
    Quantity::parse(s.trim())
        .map(Reserve::Amount)
        .map_err(|e| err("reserve", format!("{s:?}: {e}")))
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl Plan {
    /// The smallest size the policy allows at or above `asked`; None above `max`.
    fn round_up(&self, asked: i128) -> Option<i128> {
        let min = self.min.nanos();
        let v = if asked <= min {
            min
        } else {
            match &self.step {
                None => asked,
                Some(step) => {
                    let step = step.nanos();
                    let n = (asked - min + step - 1) / step;
                    min.checked_add(n.checked_mul(step)?)?
                }
            }
        };
        match &self.max {
            Some(max) if v > max.nanos() => None,
            _ => Some(v),
        }
    }

    fn check(&self) -> Result<(), PlanError> {
        if self.devices == 0 {
            return Err(err("devices", "must be at least 1"));
        }
        if self.capacity.nanos() <= 0 {
            return Err(err("capacity", "must be positive"));
        }
        if self.min.nanos() <= 0 {
            return Err(err("min", "must be positive"));
        }
        if let Some(step) = &self.step
            && step.nanos() <= 0
        {
            return Err(err("step", "must be positive"));
        }
        if let Some(max) = &self.max
            && max < &self.min
        {
            return Err(err("max", format!("{max} is below --min {}", self.min)));
        }
        if self.utilization <= 0 {
            return Err(err("utilization", "must be above 0"));
        }
        Ok(())
    }

    /// The estimate, or which flag makes it impossible and why.
    pub fn estimate(&self) -> Result<Estimate, PlanError> {
        self.check()?;
        let cap = self.capacity.nanos();
        let reserve = match &self.reserve {
            None => 0,
            Some(Reserve::Amount(q)) if q.is_negative() => {
                return Err(err("reserve", "must not be negative"));
            }
            Some(Reserve::Amount(q)) => q.nanos(),
            Some(Reserve::Share(ppm)) => cap / PPM * ppm + cap % PPM * ppm / PPM,
        };
        let usable = cap - reserve;
        if usable < self.min.nanos() {
            return Err(err(
                "reserve",
                format!(
                    "leaves {} of each device, below the smallest share --min {}",
                    q(usable.max(0), &self.capacity),
                    self.min
                ),
            ));
        }
        // The sizes shares come in: the mix rounded to the grid, or the grid itself.
        let mut rounding = Vec::new();
        for m in &self.mix {
            if m.size.nanos() <= 0 {
                return Err(err("mix", format!("size {} must be positive", m.size)));
            }
            let consumed = self
                .round_up(m.size.nanos())
                .filter(|c| *c <= usable)
                .ok_or_else(|| {
                    err(
                        "mix",
                        format!(
                            "a request of {} can never be allocated: above --max or what a device leaves",
                            m.size
                        ),
                    )
                })?;
            rounding.push(Rounded {
                asked: m.size,
                consumed: q(consumed, &m.size),
                weight: m.weight,
            });
        }
        let packable = if rounding.is_empty() {
            match &self.step {
                // Any amount from min up: a device fills completely.
                None => usable,
                Some(step) => grid_fill(self.min.nanos(), step.nanos(), usable),
            }
        } else {
            let sizes: Vec<i128> = rounding.iter().map(|r| r.consumed.nanos()).collect();
            mix_fill(&sizes, usable)
        };
        let efficiency = if rounding.is_empty() {
            PPM
        } else {
            let weighted = |f: fn(&Rounded) -> i128| {
                rounding.iter().try_fold(0i128, |acc, r| {
                    acc.checked_add(f(r).checked_mul(i128::from(r.weight))?)
                })
            };
            let asked = weighted(|r| r.asked.nanos());
            let consumed = weighted(|r| r.consumed.nanos());
            match (asked, consumed) {
                (Some(a), Some(c)) if c > 0 => a
                    .checked_mul(PPM)
                    .map(|x| x / c)
                    .ok_or_else(|| err("mix", "sizes or weights too large"))?,
                _ => return Err(err("mix", "sizes or weights too large")),
            }
        };
        let too_large = || {
            err(
                "devices",
                "the fleet is too large to estimate in nano-units",
            )
        };
        let devices = i128::from(self.devices);
        let raw = cap.checked_mul(devices).ok_or_else(too_large)?;
        let promised = packable
            .checked_mul(devices)
            .and_then(|v| v.checked_mul(self.utilization))
            .map(|v| v / PPM)
            .and_then(|v| v.checked_mul(efficiency))
            .map(|v| v / PPM)
            .ok_or_else(too_large)?;
        Ok(Estimate {
            devices: self.devices,
            capacity: self.capacity,
            reserve: q(reserve, &self.capacity),
            usable: q(usable, &self.capacity),
            packable: q(packable, &self.capacity),
            stranded: q(usable - packable, &self.capacity),
            rounding,
            rounding_efficiency: efficiency,
            utilization: self.utilization,
            raw: q(raw, &self.capacity),
            promised: readable_floor(promised, &self.capacity),
        })
    }
}

/// Millionths as a percentage: `70%`, `62.5%`.
pub fn percent(ppm: i128) -> String {
    let whole = ppm / 10_000;
    let frac = ppm % 10_000;
    if frac == 0 {
        format!("{whole}%")
    } else {
        let digits = format!("{frac:04}");
        format!("{whole}.{}%", digits.trim_end_matches('0'))
    }
}

impl Estimate {
    /// The answer and how it comes about, one figure per line.
    pub fn table(&self) -> String {
        let mut rows: Vec<(String, String)> = vec![
            ("devices".into(), self.devices.to_string()),
            ("capacity per device".into(), self.capacity.to_string()),
            ("reserve per device".into(), self.reserve.to_string()),
            ("usable per device".into(), self.usable.to_string()),
            (
                "packable per device".into(),
                format!(
                    "{} ({} stranded by the policy's sizes)",
                    self.packable, self.stranded
                ),
            ),
        ];
        if self.rounding.is_empty() {
            rows.push((
                "rounding".into(),
                "none: requests ask for sizes the policy allows (no --mix)".into(),
            ));
        } else {
            for r in &self.rounding {
                rows.push((
                    format!("request {} (weight {})", r.asked, r.weight),
                    format!("consumes {}", r.consumed),
                ));
            }
            rows.push((
                "rounding efficiency".into(),
                percent(self.rounding_efficiency),
            ));
        }
        rows.push(("target utilization".into(), percent(self.utilization)));
        rows.push(("raw total".into(), self.raw.to_string()));
        rows.push(("promised (logical)".into(), self.promised.to_string()));
        let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        rows.iter()
            .map(|(k, v)| format!("{k:width$}  {v}\n"))
            .collect()
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "devices": self.devices,
            "capacityPerDevice": self.capacity.to_string(),
            "reservePerDevice": self.reserve.to_string(),
            "usablePerDevice": self.usable.to_string(),
            "packablePerDevice": self.packable.to_string(),
            "strandedPerDevice": self.stranded.to_string(),
            "rounding": self.rounding.iter().map(|r| serde_json::json!({
                "asked": r.asked.to_string(),
                "consumed": r.consumed.to_string(),
                "weight": r.weight,
            })).collect::<Vec<_>>(),
            "roundingEfficiency": percent(self.rounding_efficiency),
            "utilization": percent(self.utilization),
            "raw": self.raw.to_string(),
            "promised": self.promised.to_string(),
        })
    }
}

/// `nanos` as a quantity printed like `like`.
fn q(nanos: i128, like: &Quantity) -> Quantity {
    // In range: every caller's value lies between 0 and an i128 product that fit.
    Quantity::from_nanos(nanos, like.format()).unwrap_or(Quantity::ZERO)
}

/// What is promised, rounded down to what a person reads and a quantity holds: whole
/// units, then four significant figures in the capacity's own suffixes (at most 0.1%
/// less; an estimate of what can be promised must never overstate it). A rounding
/// efficiency below 100% makes the exact figure a fraction of a byte, which printed as
/// `2783020696207360m`.
fn readable_floor(nanos: i128, like: &Quantity) -> Quantity {
    const NANOS_PER_UNIT: i128 = 1_000_000_000;
    let base: i128 = match like.format() {
        shareguard_common::Format::BinarySI => 1024,
        _ => 1000,
    };
    let whole = nanos.max(0) / NANOS_PER_UNIT;
    // The largest suffix in which the figure still has four digits before the point.
    let mut unit: i128 = 1;
    while let Some(next) = unit.checked_mul(base)
        && whole / next >= 1000
    {
        unit = next;
    }
    q(whole / unit * unit * NANOS_PER_UNIT, like)
}

/// The largest sum of shares of the grid `min + n*step` (any number of shares, at
/// least one) that fits `usable`: k shares take `k*min` and the rest goes in whole steps.
fn grid_fill(min: i128, step: i128, usable: i128) -> i128 {
    let most = usable / min;
    // Past that many shares the best is found among the last ones tried; each k is one
    // division, so this stays quick for any sensible policy.
    let first = (most - MAX_UNITS).max(1);
    (first..=most)
        .map(|k| k * min + (usable - k * min) / step * step)
        .max()
        .unwrap_or(0)
}

/// The largest sum of `sizes` (each as often as wanted) that fits `usable`, computed on
/// the grid of their greatest common divisor; where that grid is finer than
/// [`MAX_UNITS`] per device, `usable` rounded down to it (the sizes' combinations then
/// reach all but the smallest sums).
fn mix_fill(sizes: &[i128], usable: i128) -> i128 {
    let unit = sizes.iter().fold(0, |a, s| gcd(a, *s));
    if unit <= 0 {
        return 0;
    }
    let units = usable / unit;
    let Ok(n) = usize::try_from(units) else {
        return units * unit;
    };
    if units > MAX_UNITS {
        return units * unit;
    }
    let steps: Vec<usize> = sizes
        .iter()
        .filter_map(|s| usize::try_from(s / unit).ok())
        .collect();
    // reach[i]: i units are a sum of shares (0: none yet).
    let mut reach = vec![false; n + 1];
    reach[0] = true;
    for i in 1..=n {
        reach[i] = steps.iter().any(|s| *s <= i && reach[i - s]);
    }
    (1..=n)
        .rev()
        .find(|i| reach[*i])
        .map_or(0, |i| i as i128 * unit)
}

#[cfg(test)]
#[path = "capacity_tests.rs"]
mod tests;
