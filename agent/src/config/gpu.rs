//! The `gpu` part of a device's configuration: which back end, which GPU, and what the
//! watchdog does. Parsed from the fields `[[device]]` tables of kind `gpu` may carry:
//!
//! ```toml
//! [[device]]
//! name = "gpu-0"
//! kind = "gpu"
//! backend = "nvml"                 # or "simulated" (named as such everywhere)
//! uuid = "GPU-..."                 # or index = 0, or gpus = "all": one device per
//!                                  #   GPU the back end lists when the agent starts,
//!                                  #   named <name>-<the GPU's uuid>
//! watchdog = { period = "1s", action = "report" }   # or "terminate", grace = "10s"
//! driver_root = "/"                # where the driver's files are on the host:
//!                                  #   "/run/nvidia/driver" under the GPU Operator;
//!                                  #   simulated: none unless given
//! container_driver_root = "/driver-root"   # where the agent's container mounts it
//! [device.simulated]               # backend = "simulated" only
//! memory = "80Gi"
//! cgroup_limits = true             # what the simulated driver offers (both default
//! mps = true                       #   true); MPS also needs [agent] mps_control
//! count = 2                        # gpus = "all" only: how many GPUs it lists
//! [device.capacity.memory]         # value optional: the GPU's memory when left out
//! default = "1Gi"
//! valid_range = { min = "1Gi", step = "1Gi" }
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use shareguard_common::Quantity;
use shareguard_limiter_gpu::{limiter::GpuSelector, watchdog::Action};
use toml::Spanned;

// The section's types are the GPU limiter's, which builds itself from them.
pub use shareguard_limiter_gpu::setup::{GpuBackendKind, GpuConfig, WatchdogConfig};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawWatchdog {
    period: Option<String>,
    action: Option<String>,
    grace: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSimulated {
    memory: Spanned<String>,
    cgroup_limits: Option<bool>,
    mps: Option<bool>,
    pci_bus_id: Option<Spanned<String>>,
    count: Option<Spanned<u32>>,
}

/// The most GPUs a SIMULATED back end lists for `gpus = "all"`: more than any machine
/// holds, few enough that a typo does not make thousands of devices.
const MAX_SIMULATED_COUNT: u32 = 64;

/// The gpu-only fields of a raw `[[device]]` table.
pub(crate) struct RawGpu<'a> {
    pub backend: &'a Option<Spanned<String>>,
    pub uuid: &'a Option<Spanned<String>>,
    pub index: &'a Option<Spanned<u32>>,
    pub gpus: &'a Option<Spanned<String>>,
    pub watchdog: &'a Option<Spanned<RawWatchdog>>,
    pub simulated: &'a Option<Spanned<RawSimulated>>,
    pub driver_root: &'a Option<Spanned<String>>,
    pub container_driver_root: &'a Option<Spanned<String>>,
}

/// A problem with a span in the config text, for `file:line: reason`.
pub(crate) type SpanError = (std::ops::Range<usize>, String);

/// Default watchdog period: often enough to catch a runaway allocation quickly, rare
/// enough that polling NVML costs nothing measurable.
const DEFAULT_PERIOD: Duration = Duration::from_secs(1);
/// Default grace before `terminate` acts: a process gets time to free what it took.
const DEFAULT_GRACE: Duration = Duration::from_secs(10);

fn duration(
    name: &str,
    field: &str,
    v: &str,
    span: &std::ops::Range<usize>,
) -> Result<Duration, SpanError> {
    crate::duration::parse(v).map_err(|e| {
        (
            span.clone(),
            format!("device {name}: watchdog.{field}: {v:?}: {e}"),
        )
    })
}

/// An absolute path without `..`, for the spec's host paths: the runtime takes them as
/// they are, and nothing that climbs or is not plain text in a JSON string goes there.
fn plain_path(name: &str, field: &str, r: &Spanned<String>) -> Result<PathBuf, SpanError> {
    let p = PathBuf::from(r.get_ref());
    let plain = p.is_absolute()
        && !p
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
        && !r.get_ref().contains(['\0', '\n']);
    if !plain {
        return Err((
            r.span(),
            format!(
                "device {name}: {field} {:?} must be an absolute path without \"..\"",
                r.get_ref()
            ),
        ));
    }
    Ok(p)
}

impl RawGpu<'_> {
    /// Whether any gpu-only field is present (they are refused on other kinds).
    pub fn first_present(&self) -> Option<(std::ops::Range<usize>, &'static str)> {
        [
            self.backend.as_ref().map(|s| (s.span(), "backend")),
            self.uuid.as_ref().map(|s| (s.span(), "uuid")),
            self.index.as_ref().map(|s| (s.span(), "index")),
            self.gpus.as_ref().map(|s| (s.span(), "gpus")),
            self.watchdog.as_ref().map(|s| (s.span(), "watchdog")),
            self.simulated.as_ref().map(|s| (s.span(), "simulated")),
            self.driver_root.as_ref().map(|s| (s.span(), "driver_root")),
            self.container_driver_root
                .as_ref()
                .map(|s| (s.span(), "container_driver_root")),
        ]
        .into_iter()
        .flatten()
        .next()
    }

    /// Parses the gpu fields of device `name`; `memory_given` says whether its `memory`
    /// capacity has a value. Returns the config and, for a simulated GPU whose capacity
    /// is left out, the capacity to use.
    pub fn parse(
        &self,
        name: &str,
        dspan: &std::ops::Range<usize>,
        memory_given: bool,
    ) -> Result<(GpuConfig, Option<Quantity>), SpanError> {
        let backend_name = self
            .backend
            .as_ref()
            .map_or("nvml", |b| b.get_ref().as_str());
        let (backend, simulated_memory) = match backend_name {
            "nvml" => {
                if let Some(s) = self.simulated {
                    return Err((
                        s.span(),
                        format!(
                            "device {name}: [device.simulated] is only for backend = \"simulated\""
                        ),
                    ));
                }
                (GpuBackendKind::Nvml, None)
            }
            "simulated" => {
                let s = self.simulated.as_ref().ok_or_else(|| {
                    (
                        dspan.clone(),
                        format!("device {name}: backend \"simulated\" needs [device.simulated] with memory"),
                    )
                })?;
                let m = &s.get_ref().memory;
                let q = Quantity::parse(m.get_ref())
                    .map_err(|e| (m.span(), format!("device {name}: simulated.memory: {e}")))?;
                let bytes = q
                    .ceil_units()
                    .filter(|b| *b > 0)
                    .and_then(|b| u64::try_from(b).ok())
                    .ok_or_else(|| {
                        (
                            m.span(),
                            format!("device {name}: simulated.memory: {q} is not a positive number of bytes"),
                        )
                    })?;
                let pci_bus_id = match &s.get_ref().pci_bus_id {
                    None => None,
                    Some(id) if shareguard_common::pci::is_pci_address(id.get_ref()) => {
                        Some(id.get_ref().clone())
                    }
                    Some(id) => {
                        return Err((
                            id.span(),
                            format!(
                                "device {name}: simulated.pci_bus_id {:?} is not a PCI address as sysfs spells it (0000:3b:00.0)",
                                id.get_ref()
                            ),
                        ));
                    }
                };
                let count = match &s.get_ref().count {
                    None => 1,
                    Some(c) if self.gpus.is_none() => {
                        return Err((
                            c.span(),
                            format!("device {name}: simulated.count is only for gpus = \"all\""),
                        ));
                    }
                    Some(c) if (1..=MAX_SIMULATED_COUNT).contains(c.get_ref()) => *c.get_ref(),
                    Some(c) => {
                        return Err((
                            c.span(),
                            format!(
                                "device {name}: simulated.count {} is not within 1..={MAX_SIMULATED_COUNT}",
                                c.get_ref()
                            ),
                        ));
                    }
                };
                (
                    GpuBackendKind::Simulated {
                        memory_bytes: bytes,
                        cgroup_limits: s.get_ref().cgroup_limits.unwrap_or(true),
                        mps: s.get_ref().mps.unwrap_or(true),
                        pci_bus_id,
                        count,
                    },
                    Some(q),
                )
            }
            other => {
                let span = self.backend.as_ref().map_or(dspan.clone(), |b| b.span());
                return Err((
                    span,
                    format!("device {name}: backend {other:?} is not one of nvml, simulated"),
                ));
            }
        };
        if let Some(g) = self.gpus {
            if g.get_ref() != "all" {
                return Err((
                    g.span(),
                    format!(
                        "device {name}: gpus {:?} is not \"all\" (name one GPU with uuid or index instead)",
                        g.get_ref()
                    ),
                ));
            }
            if self.uuid.is_some() || self.index.is_some() {
                return Err((
                    g.span(),
                    format!("device {name}: give gpus = \"all\", uuid or index, only one of them"),
                ));
            }
        }
        let selector = match (self.uuid, self.index) {
            _ if self.gpus.is_some() => GpuSelector::All,
            (Some(u), Some(_)) => {
                return Err((
                    u.span(),
                    format!("device {name}: give uuid or index, not both"),
                ));
            }
            (Some(u), None) if u.get_ref().is_empty() => {
                return Err((u.span(), format!("device {name}: uuid is empty")));
            }
            (Some(u), None) => GpuSelector::Uuid(u.get_ref().clone()),
            // A simulated GPU exists only as its device's, under its uuid: an index would
            // name no GPU of the simulated back end.
            (None, Some(i)) if matches!(backend, GpuBackendKind::Simulated { .. }) => {
                return Err((
                    i.span(),
                    format!(
                        "device {name}: a simulated GPU is named by uuid (or not at all), not index"
                    ),
                ));
            }
            (None, Some(i)) => GpuSelector::Index(*i.get_ref()),
            // A simulated GPU is made for its device, so its uuid can be derived; a real
            // one must be named, or two devices could silently share one GPU.
            (None, None) => match backend {
                GpuBackendKind::Simulated { .. } => {
                    GpuSelector::Uuid(format!("GPU-simulated-{name}"))
                }
                GpuBackendKind::Nvml => {
                    return Err((
                        dspan.clone(),
                        format!("device {name}: a gpu device names its GPU with uuid or index"),
                    ));
                }
            },
        };
        let watchdog = match self.watchdog {
            None => WatchdogConfig {
                period: DEFAULT_PERIOD,
                action: Action::Report,
            },
            Some(w) => {
                let span = w.span();
                let w = w.get_ref();
                let period = match &w.period {
                    None => DEFAULT_PERIOD,
                    Some(p) => duration(name, "period", p, &span)?,
                };
                if period < Duration::from_millis(10) {
                    return Err((
                        span,
                        format!("device {name}: watchdog.period must be at least 10ms"),
                    ));
                }
                let grace = match &w.grace {
                    None => DEFAULT_GRACE,
                    Some(g) => duration(name, "grace", g, &span)?,
                };
                let action = match w.action.as_deref() {
                    None | Some("report") => {
                        if w.grace.is_some() {
                            return Err((
                                span,
                                format!(
                                    "device {name}: watchdog.grace is only for action = \"terminate\""
                                ),
                            ));
                        }
                        Action::Report
                    }
                    Some("terminate") => Action::Terminate { grace },
                    Some(other) => {
                        return Err((
                            span,
                            format!(
                                "device {name}: watchdog.action {other:?} is not one of report, terminate"
                            ),
                        ));
                    }
                };
                WatchdogConfig { period, action }
            }
        };
        let driver_root = match self.driver_root {
            Some(r) => Some(plain_path(name, "driver_root", r)?),
            None if backend == GpuBackendKind::Nvml => Some(PathBuf::from("/")),
            None => None,
        };
        let container_driver_root = match self.container_driver_root {
            Some(r) if driver_root.is_none() => {
                return Err((
                    r.span(),
                    format!("device {name}: container_driver_root needs a driver_root"),
                ));
            }
            Some(r) => Some(plain_path(name, "container_driver_root", r)?),
            None => None,
        };
        // Only a simulated GPU has a memory to fill in (an NVML one is discovered).
        let capacity = if memory_given { None } else { simulated_memory };
        Ok((
            GpuConfig {
                discover_memory: !memory_given && backend == GpuBackendKind::Nvml,
                backend,
                selector,
                watchdog,
                driver_root,
                container_driver_root,
            },
            capacity,
        ))
    }
}
