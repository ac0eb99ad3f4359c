//! Request policies (resource.k8s.io `CapacityRequestPolicy`) and the I2 check.
//!
//! The scheduler rounds a request up to what the policy allows before it writes the
//! allocation result. The agent re-checks the rounded amount and never rounds itself:
//! an amount the policy does not allow is a scheduler or kubelet plugin bug, and is refused.

use shareguard_common::Quantity;

pub use shareguard_common::slice::MAX_VALID_VALUES;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rule {
    /// No policy: any amount, bounded only by the capacity.
    Any,
    Values(Vec<Quantity>),
    Range {
        min: Quantity,
        max: Option<Quantity>,
        step: Option<Quantity>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// What a request naming no amount consumes (applied by the scheduler, not here).
    pub default: Option<Quantity>,
    pub rule: Rule,
}

/// A policy that is itself malformed, with the part at fault (`default`, `valid_values[2]`,
/// `valid_range.step`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{part}: {message}")]
pub struct PolicyError {
    pub part: String,
    pub message: String,
}

fn perr(part: impl Into<String>, message: impl Into<String>) -> PolicyError {
    PolicyError {
        part: part.into(),
        message: message.into(),
    }
}

/// Kubernetes 1.34–1.36 compute with a quantity's `Value()`: whole units, rounded up, in
/// an int64. Larger amounts wrap there.
const MAX_UNITS: i128 = i64::MAX as i128;

fn parse(part: &str, s: &str) -> Result<Quantity, PolicyError> {
    let q = Quantity::parse(s).map_err(|e| perr(part, e.to_string()))?;
    if q.is_negative() {
        return Err(perr(part, format!("{s:?} is negative")));
    }
    if q.ceil_units().is_none_or(|u| u > MAX_UNITS) {
        return Err(perr(
            part,
            format!("{s:?} is above {MAX_UNITS}, the largest amount Kubernetes computes with"),
        ));
    }
    Ok(q)
}

/// `q` is `min` plus a whole number of `step`s.
fn on_grid(q: &Quantity, min: &Quantity, step: &Quantity) -> bool {
    q >= min
        && q.checked_sub(min)
            .is_some_and(|off| off.exact_div(step).is_some())
}

fn whole(q: &Quantity) -> bool {
    q.ceil_units()
        .and_then(|u| Quantity::from_units(u, q.format()))
        .is_some_and(|w| w == *q)
}

/// A range with a step is a grid that Kubernetes 1.34–1.36 (validation and the scheduler
/// alike) compute in whole units, rounded up: with a fractional min or step, the amounts
/// the scheduler hands out are off the exact grid. So min and step are whole numbers.
fn check_whole(part: &str, q: &Quantity) -> Result<(), PolicyError> {
    if whole(q) {
        Ok(())
    } else {
        Err(perr(
            part,
            format!(
                "{q} is not a whole number: Kubernetes computes a range's step grid in whole units, so the scheduler's amounts would be off this one"
            ),
        ))
    }
}

impl Policy {
    pub const ANY: Policy = Policy {
        default: None,
        rule: Rule::Any,
    };

    /// Builds a policy from its string parts and checks it the way resource.k8s.io
    /// validates a `CapacityRequestPolicy` in a ResourceSlice (Kubernetes 1.34–1.36), and
    /// where a version accepts what another refuses or what its own scheduler cannot
    /// honour, the stricter way: one rule at most; values ascending and unique, also
    /// when rounded up to whole units; a positive whole step, a whole min, a max on the
    /// step grid; a default that the rule allows; nothing negative or beyond int64.
    /// What depends on the capacity's value is [`Policy::check_capacity`].
    pub fn from_parts(
        default: Option<&str>,
        valid_values: &[String],
        range: Option<(&str, Option<&str>, Option<&str>)>,
    ) -> Result<Policy, PolicyError> {
        let default = default.map(|d| parse("default", d)).transpose()?;
        let rule = match (valid_values.is_empty(), range) {
            (false, Some(_)) => {
                return Err(perr(
                    "valid_values",
                    "valid_values and valid_range are mutually exclusive: exactly one policy can be specified",
                ));
            }
            (false, None) => {
                if valid_values.len() > MAX_VALID_VALUES {
                    return Err(perr(
                        "valid_values",
                        format!("{} entries, at most {MAX_VALID_VALUES}", valid_values.len()),
                    ));
                }
                let mut values: Vec<Quantity> = Vec::with_capacity(valid_values.len());
                for (i, v) in valid_values.iter().enumerate() {
                    let part = format!("valid_values[{i}]");
                    let q = parse(&part, v)?;
                    if let Some(prev) = values.last() {
                        if q < *prev {
                            return Err(perr(
                                part,
                                format!(
                                    "{q} is below {prev}: values must be sorted in ascending order"
                                ),
                            ));
                        }
                        if q == *prev {
                            return Err(perr(part, format!("{q} is a duplicate of {prev}")));
                        }
                        // Sorted, so values equal when rounded up are neighbours.
                        if q.ceil_units() == prev.ceil_units() {
                            return Err(perr(
                                part,
                                format!(
                                    "{q} is a duplicate of {prev} to Kubernetes 1.34-1.36, which compare valid values rounded up to whole units"
                                ),
                            ));
                        }
                    }
                    values.push(q);
                }
                Rule::Values(values)
            }
            (true, Some((min, max, step))) => {
                let min = parse("valid_range.min", min)?;
                let max = max.map(|m| parse("valid_range.max", m)).transpose()?;
                let step = step.map(|s| parse("valid_range.step", s)).transpose()?;
                if let Some(max) = max
                    && max < min
                {
                    return Err(perr(
                        "valid_range.max",
                        format!("min {min} is larger than max {max}"),
                    ));
                }
                if let Some(step) = step {
                    if step.is_zero() {
                        return Err(perr("valid_range.step", "must be greater than zero"));
                    }
                    check_whole("valid_range.step", &step)?;
                    check_whole("valid_range.min", &min)?;
                    if let Some(max) = max
                        && !on_grid(&max, &min, &step)
                    {
                        return Err(perr(
                            "valid_range.max",
                            format!(
                                "{max} is not min {min} plus a whole number of steps of {step}"
                            ),
                        ));
                    }
                }
                Rule::Range { min, max, step }
            }
            (true, None) => Rule::Any,
        };
        if rule != Rule::Any && default.is_none() {
            return Err(perr(
                "default",
                "required when valid_values or valid_range is set",
            ));
        }
        let policy = Policy { default, rule };
        if let Some(d) = default {
            policy.allows(&d).map_err(|why| {
                perr(
                    "default",
                    format!("{d} is not allowed by the policy: {why}"),
                )
            })?;
        }
        Ok(policy)
    }

    /// What the policy must leave of the capacity's `value` (resource.k8s.io refuses a
    /// ResourceSlice otherwise): every valid value, the range's min and max, and min plus
    /// one step at most the value. A default above it, which the API server lets through
    /// without a max, is refused too: a request naming no amount could never fit.
    pub fn check_capacity(&self, value: &Quantity) -> Result<(), PolicyError> {
        let above = |part: &str, what: String, q: &Quantity| {
            if q > value {
                Err(perr(
                    part,
                    format!("{what} is larger than the capacity's value {value}"),
                ))
            } else {
                Ok(())
            }
        };
        match &self.rule {
            Rule::Any => {}
            Rule::Values(values) => {
                for (i, v) in values.iter().enumerate() {
                    above(&format!("valid_values[{i}]"), v.to_string(), v)?;
                }
            }
            Rule::Range { min, max, step } => {
                above("valid_range.min", min.to_string(), min)?;
                if let Some(max) = max {
                    above("valid_range.max", max.to_string(), max)?;
                }
                if let Some(step) = step {
                    let one = min.checked_add(step).ok_or_else(|| {
                        perr("valid_range.step", format!("{min} + {step} overflows"))
                    })?;
                    above("valid_range.step", format!("one step ({one})"), &one)?;
                }
            }
        }
        match &self.default {
            Some(d) => above("default", d.to_string(), d),
            None => Ok(()),
        }
    }

    /// A request-policy snapshot as a caller sent it (see [`crate::request`]).
    pub fn from_snapshot(p: &crate::request::CapacityPolicy) -> Result<Policy, PolicyError> {
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        let default = opt(&p.default);
        let range = p
            .valid_range
            .as_ref()
            .map(|r| (r.min.clone(), opt(&r.max), opt(&r.step)));
        Policy::from_parts(
            default.as_deref(),
            &p.valid_values,
            range
                .as_ref()
                .map(|(min, max, step)| (min.as_str(), max.as_deref(), step.as_deref())),
        )
    }

    /// The policy in its string form, as a ResourceSlice and the API write it.
    pub fn to_snapshot(&self) -> crate::request::CapacityPolicy {
        let mut out = crate::request::CapacityPolicy {
            default: self.default.map(|d| d.to_string()).unwrap_or_default(),
            ..Default::default()
        };
        match &self.rule {
            Rule::Any => {}
            Rule::Values(v) => out.valid_values = v.iter().map(|q| q.to_string()).collect(),
            Rule::Range { min, max, step } => {
                out.valid_range = Some(crate::request::ValidRange {
                    min: min.to_string(),
                    max: max.map(|q| q.to_string()).unwrap_or_default(),
                    step: step.map(|q| q.to_string()).unwrap_or_default(),
                });
            }
        }
        out
    }

    /// I2: is `amount` exactly a value this policy allows? The error says why not.
    pub fn allows(&self, amount: &Quantity) -> Result<(), String> {
        if amount.is_negative() {
            return Err(format!("{amount} is negative"));
        }
        match &self.rule {
            Rule::Any => Ok(()),
            Rule::Values(values) => {
                if values.contains(amount) {
                    Ok(())
                } else {
                    let list: Vec<String> = values.iter().map(|q| q.to_string()).collect();
                    Err(format!(
                        "{amount} is not one of the valid values [{}]",
                        list.join(", ")
                    ))
                }
            }
            Rule::Range { min, max, step } => {
                if amount < min {
                    return Err(format!("{amount} is below the minimum {min}"));
                }
                if let Some(max) = max
                    && amount > max
                {
                    return Err(format!("{amount} is above the maximum {max}"));
                }
                if let Some(step) = step {
                    // amount >= min, so the difference cannot be negative.
                    let off = amount
                        .checked_sub(min)
                        .ok_or_else(|| format!("{amount} - {min} overflows"))?;
                    if off.exact_div(step).is_none() {
                        return Err(format!(
                            "{amount} is not min {min} plus a whole number of steps of {step}"
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
#[path = "policy_scheduler_tests.rs"]
mod scheduler_tests;

#[cfg(test)]
#[path = "policy_tests.rs"]
mod tests;
