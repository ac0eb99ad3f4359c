//! What in a valid config is probably not what its author meant: said at start (logged),
//! by `shareguard devices` and by `shareguard config check`, never refused.

use shareguard_common::{Quantity, quantity::Format};

use crate::{
    config::{DeviceConfig, DeviceKind},
    policy::Rule,
};

/// The warnings for one device.
pub fn device_warnings(d: &DeviceConfig) -> Vec<String> {
    let mut out = Vec::new();
    if d.allowed_namespaces.is_empty() {
        out.push(format!(
            "device {}: allowed_namespaces is empty: the device is published and no claim can use it",
            d.name
        ));
    }
    if d.kind == DeviceKind::Net {
        for (name, cap) in &d.capacities {
            let mut qs: Vec<(&str, &Quantity)> = vec![("value", &cap.value)];
            qs.extend(cap.policy.default.as_ref().map(|q| ("default", q)));
            match &cap.policy.rule {
                Rule::Any => {}
                Rule::Values(v) => qs.extend(v.iter().map(|q| ("valid_values", q))),
                Rule::Range { min, max, step } => {
                    qs.push(("valid_range.min", min));
                    qs.extend(max.as_ref().map(|q| ("valid_range.max", q)));
                    qs.extend(step.as_ref().map(|q| ("valid_range.step", q)));
                }
            }
            for (part, q) in qs {
                if q.format() == Format::BinarySI {
                    let written = q.to_string();
                    let decimal = written.strip_suffix('i').unwrap_or(&written);
                    out.push(format!(
                        "device {}: capacity {name}.{part} = {written:?} is a binary quantity ({} bit/s); network rates are decimal: did you mean {decimal:?}?",
                        d.name,
                        q.ceil_units().unwrap_or_default()
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn net(extra: &str, capacity: &str) -> String {
        format!(
            "[[device]]\nname = \"nic-0\"\ndriver = \"d.example.com\"\npool = \"p\"\nkind = \"net\"\n{extra}\n[device.capacity.bandwidth]\n{capacity}\n"
        )
    }

    #[test]
    fn a_device_nobody_may_use_and_binary_rates_are_warned_about() {
        let c = Config::parse(
            &net(
                "",
                "value = \"10Gi\"\ndefault = \"100M\"\nvalid_range = { min = \"100M\", step = \"1Mi\" }",
            ),
            "t",
        )
        .unwrap();
        let w = device_warnings(&c.devices[0]);
        assert_eq!(w.len(), 3, "{w:?}");
        assert!(w[0].contains("allowed_namespaces is empty"), "{w:?}");
        assert!(
            w[1].contains("bandwidth.value = \"10Gi\"")
                && w[1].contains("10737418240 bit/s")
                && w[1].contains("did you mean \"10G\""),
            "{w:?}"
        );
        assert!(w[2].contains("valid_range.step = \"1Mi\""), "{w:?}");
        let c =
            Config::parse(&net("allowed_namespaces = [\"a\"]", "value = \"10G\""), "t").unwrap();
        assert!(device_warnings(&c.devices[0]).is_empty());
    }
}
