//! The agent's inventory as the plugin uses it: the devices of each driver, by pool.

use std::collections::BTreeMap;

use shareguard_proto::v1 as pb;

/// The devices of one driver on this node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DriverDevices {
    /// (pool, device name) -> the agent's view of the device.
    pub devices: BTreeMap<(String, String), pb::DeviceStatus>,
}

impl DriverDevices {
    pub fn get(&self, pool: &str, device: &str) -> Option<&pb::DeviceStatus> {
        self.devices.get(&(pool.to_owned(), device.to_owned()))
    }

    /// Pool name -> its devices, in name order.
    pub fn pools(&self) -> BTreeMap<&str, Vec<&pb::DeviceStatus>> {
        let mut out: BTreeMap<&str, Vec<&pb::DeviceStatus>> = BTreeMap::new();
        for ((pool, _), d) in &self.devices {
            out.entry(pool.as_str()).or_default().push(d);
        }
        out
    }
}

/// Driver name -> its devices.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Inventory {
    pub drivers: BTreeMap<String, DriverDevices>,
}

impl Inventory {
    pub fn from_agent(r: &pb::ListDevicesResponse) -> Self {
        let mut drivers: BTreeMap<String, DriverDevices> = BTreeMap::new();
        for d in &r.devices {
            drivers
                .entry(d.driver.clone())
                .or_default()
                .devices
                .insert((d.pool.clone(), d.name.clone()), d.clone());
        }
        Self { drivers }
    }
}
