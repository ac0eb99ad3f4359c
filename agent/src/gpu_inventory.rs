//! GPUs found on the node: a `gpus = "all"` device table becomes one device per GPU its
//! back end lists when the agent starts, as NVIDIA's own DRA driver publishes every GPU
//! it finds. Each is named `<table name>-<the GPU's uuid>` (lowercase, without `gpu-`):
//! a share is stored by device name, and the uuid stays with the GPU where an index
//! would shift when a GPU before it is gone. Its model, memory, PCI address, PCIe root
//! and NUMA node are published by the GPU limiter like a configured GPU's.
//!
//! The list is taken once, at start: a node whose driver is not up yet (or that has no
//! GPU) gets no GPU devices from the table, says so in the log, and takes its GPUs at
//! the next restart. A GPU gone since the last start leaves its shares on a device no
//! longer in the inventory, which recovery keeps reserved until Unprepare.

use shareguard_common::slice::is_dns_label;
use shareguard_limiter_gpu::{
    backend::GpuInfo,
    limiter::GpuSelector,
    setup::{self, GpuBackendKind},
};
use tracing::{info, warn};

use crate::config::{Config, DeviceConfig};

/// Replaces every `gpus = "all"` device of `cfg` with one device per GPU its back end
/// lists now. Fails, naming the device, when a name it would make is not a DNS label or
/// is taken by another device.
pub fn expand(cfg: &mut Config) -> Result<(), String> {
    expand_with(cfg, |name, backend| {
        setup::list(name, backend).map_err(|e| e.to_string())
    })
}

/// [`expand`] with the GPUs listed by `list` (a test's fake list, or the back end's).
pub(crate) fn expand_with(
    cfg: &mut Config,
    list: impl Fn(&str, &GpuBackendKind) -> Result<Vec<GpuInfo>, String>,
) -> Result<(), String> {
    // The back end of a `gpus = "all"` device; None for every other device.
    let all_of = |d: &DeviceConfig| {
        d.gpu
            .as_ref()
            .filter(|g| g.selector == GpuSelector::All)
            .map(|g| g.backend.clone())
    };
    if !cfg.devices.iter().any(|d| all_of(d).is_some()) {
        return Ok(());
    }
    let mut devices = Vec::with_capacity(cfg.devices.len());
    for d in std::mem::take(&mut cfg.devices) {
        let Some(backend) = all_of(&d) else {
            devices.push(d);
            continue;
        };
        let gpus = match list(&d.name, &backend) {
            Ok(gpus) => gpus,
            Err(why) => {
                warn!(device = %d.name, reason = %why, "gpus = \"all\": no GPU listed, so no GPU device from this table (a node without GPUs, or a driver not up yet: restart the agent once it is)");
                continue;
            }
        };
        if gpus.is_empty() {
            warn!(device = %d.name, "gpus = \"all\": the back end lists no GPU, so no GPU device from this table");
        }
        for gpu in gpus {
            let mut one = d.clone();
            one.name = device_name(&d.name, &gpu.uuid)?;
            if let Some(g) = one.gpu.as_mut() {
                g.selector = GpuSelector::Uuid(gpu.uuid.clone());
            }
            info!(device = %one.name, uuid = %gpu.uuid, index = gpu.index, model = %gpu.name, "GPU found (gpus = \"all\")");
            devices.push(one);
        }
    }
    let mut names = std::collections::BTreeSet::new();
    if let Some(d) = devices.iter().find(|d| !names.insert(d.name.as_str())) {
        return Err(format!(
            "device {}: a GPU found for gpus = \"all\" is named like another device; rename one of them",
            d.name
        ));
    }
    // The config's own check of pool sizes ran on the tables; the GPUs found may have
    // taken a pool past what one ResourceSlice holds.
    let mut sizes = std::collections::BTreeMap::new();
    for d in &devices {
        let n = sizes
            .entry((d.driver.as_str(), d.pool.as_str()))
            .or_insert(0usize);
        *n += 1;
        if *n > shareguard_common::slice::MAX_DEVICES_PER_SLICE {
            return Err(format!(
                "device {}: with the GPUs found for gpus = \"all\", pool {:?} of driver {:?} has more than {} devices, which resource.k8s.io takes in one ResourceSlice: give some devices a pool of their own",
                d.name,
                d.pool,
                d.driver,
                shareguard_common::slice::MAX_DEVICES_PER_SLICE
            ));
        }
    }
    cfg.devices = devices;
    Ok(())
}

/// `<table>-<uuid>`: the uuid lowercased, its `GPU-` prefix dropped, anything not a
/// letter or digit made '-'.
fn device_name(table: &str, uuid: &str) -> Result<String, String> {
    let lower = uuid.to_ascii_lowercase();
    let id: String = lower
        .strip_prefix("gpu-")
        .unwrap_or(&lower)
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let name = format!("{table}-{}", id.trim_matches('-'));
    if is_dns_label(&name) {
        Ok(name)
    } else {
        Err(format!(
            "device {table}: the GPU {uuid:?} would be device {name:?}, not a DNS label of at most 63 characters: give the table a shorter name"
        ))
    }
}

#[cfg(test)]
#[path = "gpu_inventory_tests.rs"]
mod tests;
