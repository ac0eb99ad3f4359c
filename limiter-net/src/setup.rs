//! Builds the bandwidth limiters from the `net` devices' config section. The agent
//! parses the section ([`NetConfig`] per device) and hands it here: one back end
//! (programs, pins, install records, probe) for all of them, each device with its own
//! mechanism on top of it.

use std::{path::Path, sync::Arc};

use crate::{Mechanism, NetBackend, NetError, NetLimiter};

/// The `net` section of one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetConfig {
    /// The mechanism the config insists on; `None` (`auto`) takes the first of
    /// `AUTO_ORDER` the kernel probe finds (never `edt-fq`).
    pub mechanism: Option<Mechanism>,
    /// What the path from a pod carries at most, bit/s (`line_rate`). A share direction
    /// limited at or above it is counted but not shaped (its status says
    /// "unconstrained"): shaping it would cost throughput and hold nothing back. None
    /// (the default): every limit is shaped.
    pub line_rate_bps: Option<u64>,
    /// The NIC the device stands for (`interface`), whose link state is the device's
    /// health; None: none to watch.
    pub interface: Option<String>,
}

/// One `net` device of the inventory: its name and its section.
#[derive(Clone, Copy, Debug)]
pub struct NetDevice<'a> {
    pub name: &'a str,
    pub net: &'a NetConfig,
}

/// A device's name and its limiter, or why it has none.
pub type DeviceLimiter = (String, Result<NetLimiter, NetError>);

/// Every device's limiter, or why the kernel cannot run the mechanism it asks for; the
/// error alone when the back end cannot be opened (no BPF, no bpffs), which no device
/// can do without. With no device, nothing is opened.
pub fn build(
    state_dir: &Path,
    pin_dir: &Path,
    devices: &[NetDevice],
) -> Result<Vec<DeviceLimiter>, NetError> {
    if devices.is_empty() {
        return Ok(Vec::new());
    }
    let backend: Arc<NetBackend> = NetBackend::open(state_dir, pin_dir)?;
    Ok(devices
        .iter()
        .map(|d| {
            let l = NetLimiter::new(backend.clone(), d.net.mechanism, d.net.line_rate_bps)
                .map(|l| l.with_interface(d.net.interface.clone()));
            (d.name.to_owned(), l)
        })
        .collect())
}
