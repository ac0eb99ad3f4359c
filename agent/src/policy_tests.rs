use super::*;

fn q(s: &str) -> Quantity {
    Quantity::parse(s).unwrap()
}

fn range(min: &str, max: Option<&str>, step: Option<&str>, default: &str) -> Policy {
    Policy::from_parts(Some(default), &[], Some((min, max, step))).unwrap()
}

#[test]
fn range_with_step_allows_only_aligned_values() {
    let p = range("5Gi", Some("40Gi"), Some("5Gi"), "5Gi");
    for ok in ["5Gi", "10Gi", "40Gi", "21474836480"] {
        assert_eq!(p.allows(&q(ok)), Ok(()), "{ok}");
    }
    assert!(
        p.allows(&q("4Gi"))
            .unwrap_err()
            .contains("below the minimum")
    );
    assert!(
        p.allows(&q("45Gi"))
            .unwrap_err()
            .contains("above the maximum")
    );
    assert!(p.allows(&q("6Gi")).unwrap_err().contains("steps"));
    // The agent never rounds: 5Gi plus one byte is refused, not rounded to 10Gi.
    assert!(p.allows(&q("5368709121")).is_err());
}

#[test]
fn range_without_step_or_max() {
    let p = range("1M", None, None, "1M");
    assert!(p.allows(&q("1M")).is_ok());
    assert!(p.allows(&q("1500001")).is_ok());
    assert!(p.allows(&q("999999")).is_err());
}

#[test]
fn values_must_match_exactly() {
    let p = Policy::from_parts(Some("1Gi"), &["1Gi".into(), "4Gi".into()], None).unwrap();
    assert!(p.allows(&q("1Gi")).is_ok());
    assert!(
        p.allows(&q("4096Mi")).is_ok(),
        "equal values in another unit"
    );
    assert!(p.allows(&q("2Gi")).unwrap_err().contains("not one of"));
}

#[test]
fn no_rule_allows_any_non_negative_amount() {
    let p = Policy::from_parts(Some("1Gi"), &[], None).unwrap();
    assert!(p.allows(&q("3Gi")).is_ok());
    assert!(p.allows(&q("0")).is_ok());
    assert!(p.allows(&q("-1")).is_err());
}

#[test]
fn malformed_policies_are_refused_with_the_part_named() {
    let e = Policy::from_parts(Some("1"), &["2".into(), "1".into()], None).unwrap_err();
    assert_eq!(e.part, "valid_values[1]");
    let e = Policy::from_parts(None, &["1".into()], None).unwrap_err();
    assert_eq!(e.part, "default");
    let e = Policy::from_parts(Some("3"), &["1".into(), "2".into()], None).unwrap_err();
    assert_eq!(e.part, "default");
    let e = Policy::from_parts(Some("1"), &[], Some(("1", None, Some("0")))).unwrap_err();
    assert_eq!(e.part, "valid_range.step");
    let e = Policy::from_parts(Some("5"), &[], Some(("5", Some("4"), None))).unwrap_err();
    assert_eq!(e.part, "valid_range.max");
    let e = Policy::from_parts(Some("1"), &["1".into()], Some(("1", None, None))).unwrap_err();
    assert_eq!(e.part, "valid_values");
    let e = Policy::from_parts(Some("x"), &[], None).unwrap_err();
    assert_eq!(e.part, "default");
    let many: Vec<String> = (1..=11).map(|i| i.to_string()).collect();
    let e = Policy::from_parts(Some("1"), &many, None).unwrap_err();
    assert!(e.message.contains("at most 10"));
}

#[test]
fn proto_round_trip() {
    let p = range("5Gi", Some("40Gi"), Some("5Gi"), "5Gi");
    assert_eq!(Policy::from_snapshot(&p.to_snapshot()).unwrap(), p);
    let p = Policy::from_parts(Some("1Gi"), &["1Gi".into(), "2Gi".into()], None).unwrap();
    assert_eq!(Policy::from_snapshot(&p.to_snapshot()).unwrap(), p);
}
