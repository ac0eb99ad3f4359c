use super::*;

/// a. Each node publishes its own pool, and the API server keeps every field the plugin
/// applied (a server with consumable capacity off would drop allowMultipleAllocations and
/// requestPolicy).
#[test]
#[ignore = "needs the test cluster: make e2e"]
fn a_each_node_publishes_its_own_pool_with_every_field_kept() {
    let c = Cluster::from_env();
    let slices = c.json(&["get", "resourceslices"]);
    let items = slices["items"].as_array().cloned().unwrap_or_default();
    let mut pools = Vec::new();
    for node in NODES {
        let mine: Vec<&Value> = items
            .iter()
            .filter(|s| field(s, "spec.nodeName") == node && field(s, "spec.driver") == DRIVER)
            .collect();
        assert!(!mine.is_empty(), "no slice of {node}: {slices}");
        for s in mine {
            let pool = field(s, "spec.pool.name").as_str().unwrap_or_default();
            assert_eq!(pool, node, "{node}'s pool is named after the node: {s}");
            pools.push(pool.to_string());
            let devices = field(s, "spec.devices")
                .as_array()
                .cloned()
                .unwrap_or_default();
            let nic = devices
                .iter()
                .find(|d| d["name"] == "nic-0")
                .unwrap_or_else(|| panic!("{node} publishes no nic-0: {s}"));
            assert_eq!(
                nic["allowMultipleAllocations"], true,
                "the API server kept allowMultipleAllocations: {nic}"
            );
            let bw = &nic["capacity"]["bandwidth"];
            assert_eq!(bw["value"], "10G", "{nic}");
            assert_eq!(
                field(bw, "requestPolicy.validRange.step"),
                "10M",
                "the API server kept the request policy: {nic}"
            );
            assert_eq!(
                nic["attributes"]["kind"]["string"], "net",
                "attributes, unqualified, so in the driver's domain: {nic}"
            );
        }
    }
    pools.sort();
    pools.dedup();
    assert_eq!(pools.len(), NODES.len(), "one pool per node: {pools:?}");
}
