//! The Prometheus text format (0.0.4) from the OpenMetrics text prometheus-client writes,
//! for scrapers and tools that do not ask for OpenMetrics (`promtool check metrics`, older
//! Prometheus servers, curl). The two differ where it matters here in one way: an
//! OpenMetrics counter family is named without its `_total` suffix in `# HELP` and
//! `# TYPE`, a Prometheus one with it; and OpenMetrics ends with `# EOF`. Samples are
//! the same lines in both.

/// `openmetrics` rewritten as Prometheus text.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(l.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_families_get_their_suffix_and_eof_goes() {
        let om = "# HELP a_b Things.\n# TYPE a_b counter\na_b_total{x=\"1\"} 3\n# HELP g A gauge.\n# TYPE g gauge\ng 1.0\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# HELP a_b_total Things.\n# TYPE a_b_total counter\na_b_total{x=\"1\"} 3\n# HELP g A gauge.\n# TYPE g gauge\ng 1.0\n"
        );
    }

    #[test]
    fn a_counter_without_help_still_gets_its_type_renamed() {
        let om = "# TYPE c counter\nc_total 1\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# TYPE c_total counter\nc_total 1\n"
        );
    }
}
