//! What the fuzz targets and the seed-corpus generator share: the fixed device inventory
//! that arbitrary `ClaimPrepare` messages are validated against.

use std::sync::LazyLock;

use shareguard::config::Config;

pub const DRIVER: &str = "shareguard.example.com";
pub const POOL: &str = "node-a";

/// One device of each kind, each capacity with a different policy shape (range, valid
/// values, none), so that every branch of allocation validation is reachable. Values are
/// given explicitly, so parsing it never looks at the host (a `net` device without a value
/// would read its NIC's speed from sysfs).
pub const INVENTORY: &str = r#"
[agent]
socket = "/tmp/shareguard-fuzz.sock"
state_dir = "/tmp/shareguard-fuzz"

[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "generic"
allowed_namespaces = ["team-a", "team-b", "ops"]
admin_namespaces = ["ops"]
[device.capacity.memory]
value = "40Gi"
default = "5Gi"
valid_range = { min = "5Gi", max = "40Gi", step = "5Gi" }
[device.capacity."example.com/slots"]
value = "8"
default = "1"
valid_values = ["1", "2", "4"]

[[device]]
name = "nic-0"
driver = "shareguard.example.com"
pool = "node-a"
kind = "net"
allowed_namespaces = ["*"]
[device.capacity.egressBandwidth]
value = "10G"
default = "10M"
valid_range = { min = "10M", max = "10G", step = "10M" }
[device.capacity.ingressBandwidth]
value = "10G"

[[device]]
name = "gpu-0"
driver = "shareguard.example.com"
pool = "node-a/gpus"
kind = "gpu"
backend = "simulated"
allowed_namespaces = ["team-a", "ops"]
admin_namespaces = ["ops"]
[device.simulated]
memory = "80Gi"
[device.capacity.memory]
default = "10Gi"
valid_range = { min = "1Gi", step = "1Gi" }
"#;

/// [`INVENTORY`], parsed once per process.
pub fn inventory() -> &'static Config {
    static CONFIG: LazyLock<Config> = LazyLock::new(|| {
        // A fixed text: failing here is a bug in this file, found on the first input.
        Config::parse(INVENTORY, "fuzz inventory").expect("the fuzz inventory parses")
    });
    &CONFIG
}
