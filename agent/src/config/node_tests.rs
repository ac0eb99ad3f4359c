//! The node's name, the pool it gives devices that set none, and `[[node]]` tables.

use super::*;
use crate::config::{Config, ConfigError};

/// A net device and a generic one, neither with a pool.
const SHARED: &str = r#"
[agent]
socket = "/tmp/x.sock"
state_dir = "/tmp/state"

[[device]]
name = "nic-0"
driver = "shareguard.example.com"
kind = "net"
interface = "eth0"
allowed_namespaces = ["*"]
[device.capacity.bandwidth]
value = "10G"
default = "10M"
valid_range = { min = "10M", max = "10G", step = "10M" }

[[device]]
name = "gen-0"
driver = "shareguard.example.com"
kind = "generic"
[device.capacity.memory]
value = "40Gi"
"#;

fn given(name: &str) -> NodeNameSources {
    NodeNameSources {
        given: Some(name.into()),
        host: Some("the-host".into()),
    }
}

fn host(name: Option<&str>) -> NodeNameSources {
    NodeNameSources {
        given: None,
        host: name.map(str::to_owned),
    }
}

fn parse(text: &str, node: &NodeNameSources) -> Config {
    Config::parse_for(text, "t.toml", node).unwrap_or_else(|e| panic!("{e}"))
}

fn err(text: &str, node: &NodeNameSources) -> ConfigError {
    Config::parse_for(text, "bad.toml", node).unwrap_err()
}

fn pools(c: &Config) -> Vec<(&str, &str)> {
    c.devices
        .iter()
        .map(|d| (d.name.as_str(), d.pool.as_str()))
        .collect()
}

/// 1-based line of the first line of `text` that contains `needle`.
fn line_with(text: &str, needle: &str) -> usize {
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

#[test]
fn a_device_without_a_pool_gets_the_nodes_name_so_two_nodes_never_share_one() {
    let a = parse(SHARED, &given("worker-1"));
    let b = parse(SHARED, &given("worker-2"));
    assert_eq!(pools(&a), [("nic-0", "worker-1"), ("gen-0", "worker-1")]);
    assert_eq!(pools(&b), [("nic-0", "worker-2"), ("gen-0", "worker-2")]);
    assert_eq!(a.agent.node_name.as_deref(), Some("worker-1"));
}

#[test]
fn a_pool_that_is_set_is_kept() {
    let text = SHARED.replace(
        "name = \"gen-0\"\n",
        "name = \"gen-0\"\npool = \"worker-1/accounting\"\n",
    );
    let c = parse(&text, &given("worker-1"));
    assert_eq!(
        pools(&c),
        [("nic-0", "worker-1"), ("gen-0", "worker-1/accounting")]
    );
    let e = err(
        &SHARED.replace(
            "name = \"gen-0\"\n",
            "name = \"gen-0\"\npool = \"Pool_A\"\n",
        ),
        &given("worker-1"),
    );
    assert!(
        e.message
            .contains("pool \"Pool_A\" is not a valid pool name"),
        "{e}"
    );
}

#[test]
fn the_name_comes_from_the_config_then_the_flag_then_the_host() {
    let with_key =
        |n: &str| SHARED.replace("[agent]\n", &format!("[agent]\nnode_name = \"{n}\"\n"));
    // The config's key, over the host name.
    let c = parse(&with_key("from-config"), &host(Some("the-host")));
    assert_eq!(c.agent.node_name.as_deref(), Some("from-config"));
    assert_eq!(c.devices[0].pool, "from-config");
    // The flag or environment where the config has none, over the host name.
    let c = parse(SHARED, &given("from-flag"));
    assert_eq!(c.devices[0].pool, "from-flag");
    // Both, naming the same node.
    let c = parse(&with_key("worker-1"), &given("worker-1"));
    assert_eq!(c.devices[0].pool, "worker-1");
    // The host name, last.
    let c = parse(SHARED, &host(Some("the-host")));
    assert_eq!(c.devices[0].pool, "the-host");
    assert_eq!(c.agent.node_name.as_deref(), Some("the-host"));
}

#[test]
fn a_config_and_a_flag_that_name_different_nodes_are_refused() {
    // A node_name in a ConfigMap every node reads would give them one pool again.
    let text = SHARED.replace("[agent]\n", "[agent]\nnode_name = \"worker-1\"\n");
    let e = err(&text, &given("worker-2"));
    assert_eq!(e.line, 3, "{e}");
    assert!(e.message.contains("agent.node_name \"worker-1\""), "{e}");
    assert!(e.message.contains("NODE_NAME \"worker-2\""), "{e}");
    assert!(e.message.contains("different nodes"), "{e}");
}

#[test]
fn an_invalid_node_name_is_refused_with_the_field_and_the_reason() {
    for (bad, why) in [
        ("Worker-1", "contains 'W'"),
        ("worker_1", "contains '_'"),
        ("", "it is empty"),
        ("-worker", "starts or ends with '-'"),
        ("worker..1", "empty part between dots"),
        (&"a".repeat(64), "more than 63 characters"),
        (&"a.".repeat(127), "254 characters"),
    ] {
        let text = SHARED.replace("[agent]\n", &format!("[agent]\nnode_name = \"{bad}\"\n"));
        let e = err(&text, &host(Some("the-host")));
        assert_eq!(e.line, 3, "{bad}: {e}");
        assert!(e.message.starts_with("agent.node_name:"), "{bad}: {e}");
        assert!(e.message.contains(why), "{bad}: {e}");
        assert!(e.message.contains("DNS subdomain"), "{bad}: {e}");

        let e = err(SHARED, &given(bad));
        assert_eq!(e.line, 0, "not in the file: {e}");
        assert!(
            e.message.starts_with("--node-name/NODE_NAME:"),
            "{bad}: {e}"
        );
        assert!(e.message.contains(why), "{bad}: {e}");
    }
    let e = err(
        &SHARED.replace("[agent]\n", "[agent]\nnode_name = 7\n"),
        &given("worker-1"),
    );
    assert_eq!(e.line, 3, "{e}");
}

#[test]
fn a_host_name_that_is_no_node_name_matters_only_where_a_name_is_needed() {
    let every_pool_set = SHARED.replace("kind = ", "pool = \"p\"\nkind = ");
    let c = parse(&every_pool_set, &host(Some("build_host")));
    assert_eq!(c.agent.node_name, None);
    assert_eq!(pools(&c), [("nic-0", "p"), ("gen-0", "p")]);
    let c = parse(&every_pool_set, &host(None));
    assert_eq!(c.agent.node_name, None);

    let e = err(SHARED, &host(Some("build_host")));
    assert_eq!(e.line, line_with(SHARED, "name = \"nic-0\""), "{e}");
    assert!(
        e.message
            .contains("device nic-0: sets no pool, so its pool is the node's name"),
        "{e}"
    );
    assert!(e.message.contains("the host name \"build_host\""), "{e}");
    assert!(
        e.message
            .contains("set [agent] node_name or --node-name/NODE_NAME"),
        "{e}"
    );
    let e = err(SHARED, &host(None));
    assert!(e.message.contains("/proc/sys/kernel/hostname"), "{e}");

    let text = format!("{every_pool_set}\n[[node]]\nname = \"worker-1\"\n");
    let e = err(&text, &host(Some("build_host")));
    assert_eq!(e.line, line_with(&text, "name = \"worker-1\""), "{e}");
    assert!(
        e.message
            .contains("[[node]] tables are matched against the node's name"),
        "{e}"
    );
}

/// `SHARED` with a [[node]] table for worker-7.
fn with_override(fields: &str) -> String {
    format!("{SHARED}\n[[node]]\nname = \"worker-7\"\n{fields}")
}

#[test]
fn a_node_table_applies_on_the_node_of_that_exact_name_only() {
    let text = with_override(
        "[node.device.nic-0]\ninterface = \"ens5\"\npool = \"worker-7/nics\"\nline_rate = \"25G\"\n",
    );
    let on = parse(&text, &given("worker-7"));
    let nic = on.device("nic-0").unwrap();
    assert_eq!(nic.pool, "worker-7/nics");
    assert_eq!(
        nic.net.clone().unwrap_or_default().line_rate_bps,
        Some(25_000_000_000)
    );
    assert_eq!(on.device("gen-0").unwrap().pool, "worker-7", "untouched");
    // No prefix, suffix or substring matches.
    for other in ["worker-70", "worker", "worker-7.example.com", "xworker-7"] {
        let off = parse(&text, &given(other));
        let nic = off.device("nic-0").unwrap();
        assert_eq!(nic.pool, other, "{other}");
        assert_eq!(
            nic.net.clone().unwrap_or_default().line_rate_bps,
            None,
            "{other}"
        );
    }
}

#[test]
fn a_node_table_changes_the_interface_the_device_stands_for() {
    // Checked after the table applies: on worker-7, gen-0 turned into a second device for
    // nic-0's interface would hand its bandwidth out twice.
    let two_nics = SHARED.replace(
        "name = \"gen-0\"\ndriver = \"shareguard.example.com\"\nkind = \"generic\"\n[device.capacity.memory]\nvalue = \"40Gi\"",
        "name = \"nic-1\"\ndriver = \"shareguard.example.com\"\nkind = \"net\"\ninterface = \"eth1\"\n[device.capacity.bandwidth]\nvalue = \"10G\"",
    );
    let text = format!(
        "{two_nics}\n[[node]]\nname = \"worker-7\"\n[node.device.nic-1]\ninterface = \"eth0\"\n"
    );
    assert!(Config::parse_for(&text, "t", &given("worker-1")).is_ok());
    let e = err(&text, &given("worker-7"));
    assert!(e.message.contains("same interface as device nic-0"), "{e}");
}

#[test]
fn tables_merge_key_by_key_and_other_values_replace() {
    let text = with_override(
        "[node.device.nic-0]\nallowed_namespaces = [\"team-a\"]\n[node.device.nic-0.capacity.bandwidth]\nvalue = \"25G\"\nvalid_range = { max = \"25G\" }\n",
    );
    let c = parse(&text, &given("worker-7"));
    let nic = c.device("nic-0").unwrap();
    assert!(nic.allows_namespace("team-a"));
    assert!(
        !nic.allows_namespace("team-b"),
        "the list replaced, not extended"
    );
    let bw = &nic.capacities["bandwidth"];
    assert_eq!(bw.value, shareguard_common::Quantity::parse("25G").unwrap());
    // The default, min and step stayed; max changed.
    let q = |s: &str| shareguard_common::Quantity::parse(s).unwrap();
    assert!(bw.policy.allows(&q("25G")).is_ok());
    assert!(bw.policy.allows(&q("15M")).is_err(), "the step stays 10M");
    assert!(bw.policy.allows(&q("5M")).is_err(), "the min stays 10M");
}

#[test]
fn node_table_errors_name_the_table_and_the_line() {
    let node = given("worker-1");
    let cases: [(&str, &str, &str); 9] = [
        // An unknown device, on every node, not only worker-7.
        (
            "[node.device.nic-9]\ninterface = \"ens5\"\n",
            "[node.device.nic-9]",
            "[[node]] worker-7: device \"nic-9\" is not a [[device]] of this config",
        ),
        // A misspelt field of worker-7's, found on worker-1 too.
        (
            "[node.device.nic-0]\ninterfce = \"ens5\"\n",
            "interfce",
            "[[node]] worker-7: unknown field `interfce`",
        ),
        (
            "[node.device.nic-0]\ninterface = 5\n",
            "interface = 5",
            "[[node]] worker-7: ",
        ),
        (
            "[node.device.nic-0]\nname = \"nic-1\"\n",
            "name = \"nic-1\"",
            "name cannot differ per node",
        ),
        (
            "[node.device]\nnic-0 = \"ens5\"\n",
            "nic-0 = ",
            "device.nic-0: must be a table of the device's fields",
        ),
        (
            "device = \"nic-0\"\n",
            "device = ",
            "[[node]] device: must be a table of devices",
        ),
        (
            "pool = \"p\"\n",
            "pool = \"p\"",
            "[[node]]: unknown key \"pool\"; a [[node]] table has name and device",
        ),
        (
            "[[node]]\nname = \"worker-7\"\n",
            "[[node]]\nname = \"worker-7\"\n[[node]]",
            "[[node]] name \"worker-7\" is given twice",
        ),
        ("[[node]]\ndevice = {}\n", "", "[[node]]: name is required"),
    ];
    for (fields, at, says) in cases {
        let text = with_override(fields);
        let e = err(&text, &node);
        assert!(e.message.contains(says), "{fields}: {e}");
        let want = match at {
            "" => line_with(&text, "device = {}") - 1,
            a if a.contains('\n') => {
                // The second `name = "worker-7"`.
                text.lines()
                    .enumerate()
                    .filter(|(_, l)| *l == "name = \"worker-7\"")
                    .nth(1)
                    .unwrap()
                    .0
                    + 1
            }
            a => line_with(&text, a),
        };
        assert_eq!(e.line, want, "{fields}: {e}");
    }
    let text = format!("{SHARED}\n[[node]]\nname = \"Worker_7\"\n");
    let e = err(&text, &node);
    assert!(
        e.message
            .contains("[[node]] name: \"Worker_7\" is not a node name"),
        "{e}"
    );
    assert_eq!(e.line, line_with(&text, "Worker_7"), "{e}");
    let text = format!("{SHARED}\n[node]\nname = \"worker-7\"\n");
    let e = err(&text, &node);
    assert!(e.message.contains("one [[node]] table per node"), "{e}");
}

#[test]
fn pools_of_a_node_are_its_name_or_below_it() {
    assert!(pool_belongs_to("worker-7", "worker-7"));
    assert!(pool_belongs_to("worker-7/nics", "worker-7"));
    assert!(!pool_belongs_to("worker-70", "worker-7"));
    assert!(!pool_belongs_to("worker-7.x", "worker-7"));
    assert!(!pool_belongs_to("worker", "worker-7"));
    assert!(!pool_belongs_to("node-a", "worker-7"));
}

#[test]
fn the_host_name_is_read_as_kubelet_reads_it() {
    if let Some(h) = host_name() {
        assert_eq!(h, h.trim().to_ascii_lowercase());
    }
    assert_eq!(node_name_problem("worker-7.example.com"), None);
}
