use super::*;

/// The value on the table's line for `key`.
fn row(table: &str, key: &str) -> Option<String> {
    table
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_owned())
}

fn qty(s: &str) -> Quantity {
    Quantity::parse(s).unwrap()
}

fn plan(devices: u64, capacity: &str, min: &str, step: Option<&str>, util: &str) -> Plan {
    Plan {
        devices,
        capacity: qty(capacity),
        min: qty(min),
        step: step.map(qty),
        max: None,
        utilization: parse_ratio("utilization", util).unwrap(),
        reserve: None,
        mix: Vec::new(),
    }
}

#[test]
fn the_design_cards_example_is_2800gi_before_reserves() {
    // 100 devices of 40 GiB, shares min 5Gi step 5Gi, 70% utilisation.
    let e = plan(100, "40Gi", "5Gi", Some("5Gi"), "0.7")
        .estimate()
        .unwrap();
    assert_eq!(e.promised, qty("2800Gi"));
    assert_eq!(e.raw, qty("4000Gi"));
    assert_eq!(e.packable, qty("40Gi"));
    assert!(e.stranded.is_zero());
    assert_eq!(
        row(&e.table(), "promised (logical)").as_deref(),
        Some("2800Gi")
    );
    assert_eq!(e.to_json()["promised"], "2800Gi");
}

#[test]
fn the_grid_strands_what_no_share_size_fills() {
    // 40Gi with shares of 6Gi + n*4Gi: 6+6+6+6+6+6 = 36, 6+6+6+6+6+6+4? k=6 -> 36 + 4 = 40
    // fits exactly; with 7Gi shares and a 7Gi step only 35Gi fills.
    let e = plan(10, "40Gi", "7Gi", Some("7Gi"), "1")
        .estimate()
        .unwrap();
    assert_eq!(e.packable, qty("35Gi"));
    assert_eq!(e.stranded, qty("5Gi"));
    assert_eq!(e.promised, qty("350Gi"));
    let e = plan(10, "40Gi", "6Gi", Some("4Gi"), "1")
        .estimate()
        .unwrap();
    assert_eq!(e.packable, qty("40Gi"));
    // min 24Gi, step 10Gi: one share of 34Gi at most, two do not fit.
    let e = plan(1, "40Gi", "24Gi", Some("10Gi"), "1")
        .estimate()
        .unwrap();
    assert_eq!(e.packable, qty("34Gi"));
    // No step: any amount from min up fills a device.
    let e = plan(1, "40Gi", "7Gi", None, "1").estimate().unwrap();
    assert_eq!(e.packable, qty("40Gi"));
}

#[test]
fn a_reserve_comes_off_each_device_first() {
    let mut p = plan(100, "40Gi", "5Gi", Some("5Gi"), "70%");
    p.reserve = Some(parse_reserve("10%").unwrap());
    let e = p.estimate().unwrap();
    // 36Gi usable, 35Gi in 5Gi shares, 70% of 3500Gi.
    assert_eq!(e.usable, qty("36Gi"));
    assert_eq!(e.packable, qty("35Gi"));
    assert_eq!(e.promised, qty("2450Gi"));
    p.reserve = Some(parse_reserve("4Gi").unwrap());
    assert_eq!(p.estimate().unwrap().promised, qty("2450Gi"));
    p.reserve = Some(parse_reserve("38Gi").unwrap());
    let err = p.estimate().unwrap_err();
    assert_eq!(err.flag, "reserve");
    assert!(err.reason.contains("below the smallest share"), "{err}");
}

/// A mix whose rounding efficiency is not a whole ratio of bytes: the promise is a
/// quantity a person reads (four figures, rounded down), not nano-units.
#[test]
fn a_mix_promises_a_readable_quantity_rounded_down() {
    let mut p = plan(100, "40Gi", "4Gi", Some("4Gi"), "70%");
    p.mix = parse_mix("7Gi=50,12Gi=30,33Gi=20").unwrap();
    let e = p.estimate().unwrap();
    // 2800Gi x (7x50 + 12x30 + 33x20) / (8x50 + 12x30 + 36x20) = 2591.89...Gi.
    assert_eq!(e.promised, qty("2591Gi"));
    assert_eq!(e.to_json()["promised"], "2591Gi");
    // Decimal capacities keep decimal suffixes.
    let mut p = plan(3, "10G", "300M", Some("300M"), "0.9");
    p.mix = parse_mix("250M").unwrap();
    let e = p.estimate().unwrap();
    // 3 x 9.9G packable x 0.9 x 0.833333 (250/300 in millionths) = 22.27499G.
    assert_eq!(e.promised.to_string(), "22274M");
}

#[test]
fn a_request_mix_counts_what_is_asked_not_what_rounding_consumes() {
    let mut p = plan(100, "40Gi", "5Gi", Some("5Gi"), "0.7");
    // 3Gi requests consume 5Gi, 10Gi ones 10Gi: (2*3 + 10) / (2*5 + 10) = 80%.
    p.mix = parse_mix("3Gi=2,10Gi=1").unwrap();
    let e = p.estimate().unwrap();
    assert_eq!(e.rounding[0].consumed, qty("5Gi"));
    assert_eq!(e.rounding[1].consumed, qty("10Gi"));
    assert_eq!(e.rounding_efficiency, 800_000);
    assert_eq!(e.promised, qty("2240Gi"));
    assert_eq!(
        row(&e.table(), "rounding efficiency").as_deref(),
        Some("80%")
    );
    // Sizes that cannot fill a device: 15Gi shares leave 10Gi of 40Gi.
    p.mix = parse_mix("15Gi").unwrap();
    let e = p.estimate().unwrap();
    assert_eq!(e.packable, qty("30Gi"));
    // Above max: never allocated.
    p.max = Some(qty("20Gi"));
    p.mix = parse_mix("25Gi=1").unwrap();
    assert_eq!(p.estimate().unwrap_err().flag, "mix");
}

#[test]
fn bad_flags_are_named_with_the_reason() {
    for (s, why) in [
        ("1.5", "more than the whole"),
        ("150%", "more than the whole"),
        ("0.1234567", "more than 6 decimals"),
        ("seventy", "not a decimal"),
        ("", "not a decimal"),
        ("-0.5", "not a decimal"),
    ] {
        let e = parse_ratio("utilization", s).unwrap_err();
        assert_eq!(e.flag, "utilization");
        assert!(e.reason.contains(why), "{s:?}: {e}");
    }
    assert_eq!(parse_ratio("utilization", "70.5%").unwrap(), 705_000);
    assert_eq!(parse_ratio("utilization", ".7").unwrap(), 700_000);
    assert_eq!(parse_ratio("utilization", "1").unwrap(), 1_000_000);
    assert_eq!(parse_mix("3Gi=0").unwrap_err().flag, "mix");
    assert_eq!(parse_mix("3Gx").unwrap_err().flag, "mix");
    assert_eq!(
        plan(0, "40Gi", "5Gi", None, "1")
            .estimate()
            .unwrap_err()
            .flag,
        "devices"
    );
    assert_eq!(
        plan(1, "40Gi", "5Gi", None, "0")
            .estimate()
            .unwrap_err()
            .flag,
        "utilization"
    );
    assert_eq!(
        plan(1, "40Gi", "0", None, "1").estimate().unwrap_err().flag,
        "min"
    );
    let mut p = plan(1, "40Gi", "5Gi", None, "1");
    p.max = Some(qty("1Gi"));
    assert_eq!(p.estimate().unwrap_err().flag, "max");
}

#[test]
fn a_fleet_too_large_for_nano_units_is_an_error_not_a_wrong_figure() {
    let e = plan(u64::MAX, "1Ei", "1Gi", None, "1")
        .estimate()
        .unwrap_err();
    assert_eq!(e.flag, "devices");
}

#[test]
fn percentages_print_without_trailing_zeros() {
    assert_eq!(percent(700_000), "70%");
    assert_eq!(percent(625_000), "62.5%");
    assert_eq!(percent(1), "0.0001%");
}
