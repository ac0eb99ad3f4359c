//! The agent's I2 check against the scheduler's side: a PORT, for these tests only, of
//! k8s.io/dynamic-resource-allocation's `calculateConsumedCapacity` (how the scheduler
//! turns a request into the amount it allocates) and `violatesPolicy` (which amounts it
//! refuses), unchanged from v0.34 to v0.36, with their test tables; then a property:
//! every amount the scheduler can allocate under a policy the config accepts is
//! admitted, and nothing else is.

use proptest::prelude::*;
use shareguard_common::{Format, Quantity};

use super::{Policy, Rule};

fn q(units: i128) -> Quantity {
    Quantity::from_units(units, Format::DecimalSI).expect("small test amounts")
}

/// Go's `Quantity.Value()`: whole units, rounded up.
fn value(x: &Quantity) -> i128 {
    x.ceil_units().expect("within i128")
}

/// `calculateConsumedCapacity(requestedVal, capacity)`. `None` policy is Go's nil.
fn scheduler_consumed(req: Option<Quantity>, cap: Quantity, p: Option<&Policy>) -> Quantity {
    let Some(req) = req else {
        return p.and_then(|p| p.default).unwrap_or(cap);
    };
    let Some(p) = p else { return req };
    match &p.rule {
        Rule::Range { min, step, .. } => {
            if req < *min {
                return *min;
            }
            let Some(step) = step else { return req };
            let added = value(&req) - value(min);
            let mut n = added / value(step);
            if added % value(step) != 0 {
                n += 1;
            }
            Quantity::from_units(value(min) + value(step) * n, Format::BinarySI)
                .expect("small test amounts")
        }
        Rule::Values(values) => values.iter().copied().find(|v| req <= *v).unwrap_or(req),
        Rule::Any => req,
    }
}

/// `violatesPolicy(val, policy)`.
fn scheduler_refuses(x: &Quantity, p: Option<&Policy>) -> bool {
    let Some(p) = p else { return false };
    if p.default == Some(*x) {
        return false;
    }
    match &p.rule {
        Rule::Range { min, max, step } => {
            max.is_some_and(|m| *x > m)
                || step.is_some_and(|s| (value(x) - value(min)) % value(&s) != 0)
        }
        Rule::Values(values) => !values.contains(x),
        Rule::Any => false,
    }
}

fn range(default: i128, min: i128, max: Option<i128>, step: Option<i128>) -> Policy {
    Policy {
        default: Some(q(default)),
        rule: Rule::Range {
            min: q(min),
            max: max.map(q),
            step: step.map(q),
        },
    }
}

fn values(default: i128, vs: &[i128]) -> Policy {
    Policy {
        default: Some(q(default)),
        rule: Rule::Values(vs.iter().map(|v| q(*v)).collect()),
    }
}

#[test]
fn the_schedulers_consumed_capacity_table() {
    // testCalculateConsumedCapacity: (request, capacity, policy, result).
    let empty = Policy {
        default: None,
        rule: Rule::Any,
    };
    let cases: Vec<(Option<i128>, i128, Policy, i128)> = vec![
        (None, 1, empty, 1),
        (None, 2, range(1, 1, None, None), 1),
        (None, 2, values(1, &[1]), 1),
        (Some(2), 2, range(1, 1, None, None), 2),
        (Some(1), 2, range(1, 2, None, None), 2),
        (Some(2), 3, range(1, 1, None, Some(2)), 3),
        (Some(2), 2, range(1, 1, None, Some(1)), 2),
        (Some(2), 3, values(1, &[1, 2, 3]), 2),
        (Some(2), 3, values(1, &[1, 3]), 3),
        (Some(3), 3, values(1, &[1, 2]), 3),
    ];
    for (req, cap, p, want) in cases {
        assert_eq!(
            scheduler_consumed(req.map(q), q(cap), Some(&p)),
            q(want),
            "{req:?} of {cap} under {p:?}"
        );
    }
    assert_eq!(
        scheduler_consumed(None, q(7), None),
        q(7),
        "no policy: all of it"
    );
}

#[test]
fn the_schedulers_policy_violation_table() {
    // testViolateCapacityRequestPolicy, and what the agent says of the same amounts.
    let cases: Vec<(i128, Option<Policy>, bool)> = vec![
        (1, None, false),
        (1, Some(range(1, 1, Some(2), None)), false),
        (2, Some(range(1, 1, Some(1), None)), true),
        (1, Some(values(1, &[1])), false),
        (2, Some(values(1, &[1])), true),
    ];
    for (x, p, refused) in cases {
        assert_eq!(
            scheduler_refuses(&q(x), p.as_ref()),
            refused,
            "{x} under {p:?}"
        );
        let agent = p.as_ref().map_or(Ok(()), |p| p.allows(&q(x)));
        assert_eq!(
            agent.is_err(),
            refused,
            "the agent on {x} under {p:?}: {agent:?}"
        );
    }
}

/// A policy the config accepts for a capacity of `cap`, from generated parts.
fn accepted(p: &Policy, cap: i128) -> bool {
    let s = p.to_snapshot();
    Policy::from_snapshot(&s).is_ok_and(|back| back == *p) && p.check_capacity(&q(cap)).is_ok()
}

fn policies() -> impl Strategy<Value = (Policy, i128)> {
    let ranges = (
        0i128..50,
        prop::option::of(1i128..20),
        0i128..10,
        prop::option::of(0i128..10),
        0i128..60,
    )
        .prop_map(|(min, step, d, k, extra)| {
            let s = step.unwrap_or(1);
            let max = k.map(|k| min + k * s);
            let default = (min + d * s).min(max.unwrap_or(i128::MAX));
            let default = min + (default - min) / s * s;
            let cap = max.unwrap_or(min + s) + extra;
            (range(default, min, max, step), cap)
        });
    let sets = (
        prop::collection::btree_set(1i128..100, 1..=10),
        any::<prop::sample::Index>(),
        0i128..60,
    )
        .prop_map(|(set, i, extra)| {
            let vs: Vec<i128> = set.into_iter().collect();
            let default = vs[i.index(vs.len())];
            let cap = vs[vs.len() - 1] + extra;
            (values(default, &vs), cap)
        });
    prop_oneof![ranges, sets]
}

proptest! {
    /// Every amount the scheduler allocates under an accepted policy is admitted.
    #[test]
    fn what_the_scheduler_allocates_is_admitted(
        (p, cap) in policies(),
        req in prop::option::of(0i128..250),
    ) {
        prop_assume!(accepted(&p, cap));
        let c = scheduler_consumed(req.map(q), q(cap), Some(&p));
        if !scheduler_refuses(&c, Some(&p)) && c <= q(cap) {
            prop_assert!(p.allows(&c).is_ok(), "{c} for {req:?} under {p:?}: {:?}", p.allows(&c));
        }
    }

    /// And nothing else: an amount the agent admits is what the scheduler allocates for
    /// a request of that amount.
    #[test]
    fn what_the_agent_admits_the_scheduler_allocates((p, cap) in policies(), x in 0i128..250) {
        prop_assume!(accepted(&p, cap));
        if p.allows(&q(x)).is_ok() {
            prop_assert_eq!(scheduler_consumed(Some(q(x)), q(cap), Some(&p)), q(x));
            prop_assert!(!scheduler_refuses(&q(x), Some(&p)));
        }
    }
}
