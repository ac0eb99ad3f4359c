//! The maps the programs read and write, as [`Bpf`] methods: each interface's
//! configuration, each slot's counters, pacing state and activity, the to-pod queue
//! table and the wake-up ring; and the shape a pinned map must have to be adopted.

use std::{fmt, io, path::Path};

use aya::{
    Ebpf,
    maps::{Map, MapError, PerCpuValues},
};
use shareguard_ebpf_common::{
    Activity, COUNTERS_MAP, DIR_FROM_POD, DIR_TO_POD, IFACES_MAP, PACE_MAP, TO_POD_QUEUES_MAP,
    activity::ACTIVITY_MAP, counter_index, flags_valid,
};

use super::{Bpf, BpfError, Counters, IfaceConfig, MAX_SLOTS, PaceState, Wakeups};

impl Bpf {
    /// Tells the programs what to do for `ifindex`, replacing any earlier configuration;
    /// takes effect with the next packet.
    pub fn set_iface(&mut self, ifindex: u32, cfg: IfaceConfig) -> Result<(), BpfError> {
        if cfg.slot >= MAX_SLOTS {
            return Err(BpfError::SlotOutOfRange { slot: cfg.slot });
        }
        if !flags_valid(&cfg) {
            return Err(BpfError::InvalidFlags { flags: cfg.flags });
        }
        self.ifaces
            .insert(ifindex, cfg, 0)
            .map_err(|e| map_error(IFACES_MAP, "insert", e))
    }

    /// The configuration the programs see for `ifindex`, read back from the kernel.
    pub fn iface(&self, ifindex: u32) -> Result<Option<IfaceConfig>, BpfError> {
        match self.ifaces.get(&ifindex, 0) {
            Ok(cfg) => Ok(Some(cfg)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_error(IFACES_MAP, "lookup", e)),
        }
    }

    /// Stops the programs from acting on `ifindex` (they pass its traffic untouched).
    /// Ok if it was not configured.
    pub fn clear_iface(&mut self, ifindex: u32) -> Result<(), BpfError> {
        match self.ifaces.remove(&ifindex) {
            Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
            // aya passes the kernel's ENOENT for a missing key through as it is.
            Err(MapError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
                Ok(())
            }
            Err(e) => Err(map_error(IFACES_MAP, "delete", e)),
        }
    }

    /// Sets the to-pod queue device of the share in `slot` (0: none), which the programs
    /// read for interfaces configured with `FLAG_TO_POD_QUEUE`.
    pub fn set_to_pod_queue(&mut self, slot: u32, ifindex: u32) -> Result<(), BpfError> {
        if slot >= MAX_SLOTS {
            return Err(BpfError::SlotOutOfRange { slot });
        }
        self.to_pod_queues
            .set(slot, ifindex, 0)
            .map_err(|e| map_error(TO_POD_QUEUES_MAP, "update", e))
    }

    /// The to-pod queue device of the share in `slot`, read back from the kernel (0: none).
    pub fn to_pod_queue(&self, slot: u32) -> Result<u32, BpfError> {
        if slot >= MAX_SLOTS {
            return Err(BpfError::SlotOutOfRange { slot });
        }
        self.to_pod_queues
            .get(&slot, 0)
            .map_err(|e| map_error(TO_POD_QUEUES_MAP, "lookup", e))
    }

    /// Sums the per-CPU counters of a slot: (to_pod, from_pod).
    pub fn counters(&self, slot: u32) -> Result<(Counters, Counters), BpfError> {
        let read = |dir| -> Result<Counters, BpfError> {
            let index = counter_index(slot, dir).ok_or(BpfError::SlotOutOfRange { slot })?;
            self.index_counters(index)
        };
        Ok((read(DIR_TO_POD)?, read(DIR_FROM_POD)?))
    }

    /// The counters at counter `index` (one slot's one direction), summed over CPUs.
    pub fn index_counters(&self, index: u32) -> Result<Counters, BpfError> {
        let per_cpu = self
            .counters
            .get(&index, 0)
            .map_err(|e| map_error(COUNTERS_MAP, "lookup", e))?;
        Ok(per_cpu
            .iter()
            .fold(Counters::default(), |sum, cpu| sum.wrapping_add(*cpu)))
    }

    /// The EDT or policer state of a slot: (to_pod, from_pod).
    pub fn pace_state(&self, slot: u32) -> Result<(PaceState, PaceState), BpfError> {
        let read = |dir| -> Result<PaceState, BpfError> {
            let index = counter_index(slot, dir).ok_or(BpfError::SlotOutOfRange { slot })?;
            self.pace
                .get(&index, 0)
                .map_err(|e| map_error(PACE_MAP, "lookup", e))
        };
        Ok((read(DIR_TO_POD)?, read(DIR_FROM_POD)?))
    }

    /// Zeroes both directions of a slot (counters and pacing state), e.g. before it is
    /// given to a new share: state left by another share would hold or drop its packets.
    pub fn reset_counters(&mut self, slot: u32) -> Result<(), BpfError> {
        let cpus =
            aya::util::nr_cpus().map_err(|(what, source)| BpfError::Cpus { what, source })?;
        for dir in [DIR_TO_POD, DIR_FROM_POD] {
            let index = counter_index(slot, dir).ok_or(BpfError::SlotOutOfRange { slot })?;
            let zeroes =
                PerCpuValues::try_from(vec![Counters::default(); cpus]).map_err(|source| {
                    BpfError::Cpus {
                        what: "per-CPU value count",
                        source,
                    }
                })?;
            self.counters
                .set(index, zeroes, 0)
                .map_err(|e| map_error(COUNTERS_MAP, "update", e))?;
            self.pace
                .set(index, PaceState::default(), 0)
                .map_err(|e| map_error(PACE_MAP, "update", e))?;
            self.activity
                .set(index, Activity::default(), 0)
                .map_err(|e| map_error(ACTIVITY_MAP, "update", e))?;
        }
        Ok(())
    }

    /// When the share at counter `index` last sent, and whether it is armed.
    pub fn activity(&self, index: u32) -> Result<Activity, BpfError> {
        self.activity
            .get(&index, 0)
            .map_err(|e| map_error(ACTIVITY_MAP, "lookup", e))
    }

    /// Asks the programs to send `index` on the wake-up ring at the share's next packet.
    /// `seen` is the entry as last read: its `last_ns` is written back as it was.
    pub fn arm(&mut self, index: u32, seen: Activity) -> Result<(), BpfError> {
        let armed = Activity { armed: 1, ..seen };
        self.activity
            .set(index, armed, 0)
            .map_err(|e| map_error(ACTIVITY_MAP, "update", e))
    }

    /// The wake-up ring, to be read by one consumer; None once taken.
    pub fn take_wakeups(&mut self) -> Option<Wakeups> {
        self.wake.take().map(|ring| Wakeups { ring })
    }
}

pub(super) fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, BpfError> {
    ebpf.take_map(name)
        .ok_or(BpfError::MissingObject { kind: "map", name })
}

pub(super) fn map_error(map: &'static str, op: &'static str, source: MapError) -> BpfError {
    BpfError::Map {
        map,
        op,
        source: Box::new(source),
    }
}

#[derive(PartialEq, Eq)]
pub(super) struct MapShape {
    pub(super) kind: &'static str,
    pub(super) key_size: usize,
    pub(super) value_size: usize,
    pub(super) max_entries: u32,
}

impl fmt::Display for MapShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a {} map of {} entries, key {} B, value {} B",
            self.kind, self.max_entries, self.key_size, self.value_size
        )
    }
}

pub(super) fn check_map(
    map: &Map,
    name: &'static str,
    path: &Path,
    expected: MapShape,
) -> Result<(), BpfError> {
    let (kind, data) = match map {
        Map::HashMap(data) => ("hash", data),
        Map::PerCpuArray(data) => ("percpu_array", data),
        Map::Array(data) => ("array", data),
        Map::LruHashMap(data) => ("lru_hash", data),
        Map::RingBuf(data) => ("ringbuf", data),
        _ => {
            return Err(BpfError::IncompatibleMap {
                name,
                path: path.to_owned(),
                found: "a map of another type".to_owned(),
                expected: expected.to_string(),
            });
        }
    };
    let info = data
        .info()
        .map_err(|e| map_error(name, "reading map info", e))?;
    let found = MapShape {
        kind,
        key_size: info.key_size() as usize,
        value_size: info.value_size() as usize,
        max_entries: info.max_entries(),
    };
    if found != expected {
        return Err(BpfError::IncompatibleMap {
            name,
            path: path.to_owned(),
            found: found.to_string(),
            expected: expected.to_string(),
        });
    }
    Ok(())
}
