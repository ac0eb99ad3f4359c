//! What failed in the BPF layer, on which object, and the kernel's or aya's reason.

use super::*;

/// What failed, on which object, and the kernel's or aya's reason.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("creating pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{path} is not on a BPF filesystem, so nothing pinned there would survive the agent \
         (mount one with `mount -t bpf bpf /sys/fs/bpf`)"
    )]
    NotBpfFs { path: PathBuf },
    #[error("mounting a BPF filesystem at {path}: {source}")]
    MountBpfFs {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("loading the embedded BPF object (maps pinned under {pin_dir}): {source}")]
    Load {
        pin_dir: PathBuf,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("the embedded BPF object has no {kind} named {name}")]
    MissingObject {
        kind: &'static str,
        name: &'static str,
    },
    #[error(
        "map {name} pinned at {path} is {found}, but this build expects {expected}; it was \
         created by another version of the programs (removing the pin recreates it, losing \
         its entries)"
    )]
    IncompatibleMap {
        name: &'static str,
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("the kernel refused program {program}: {source}")]
    ProgramLoad {
        program: &'static str,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("map {map}: {op}: {source}")]
    Map {
        map: &'static str,
        op: &'static str,
        #[source]
        source: Box<MapError>,
    },
    #[error("invalid attachment name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("counter slot {slot} is out of range (slots are 0..{MAX_SLOTS})")]
    SlotOutOfRange { slot: u32 },
    #[error(
        "IfaceConfig.flags {flags:#x}: unknown flags, EDT and policing in one direction, or pacing without a rate"
    )]
    InvalidFlags { flags: u32 },
    #[error("no network interface with ifindex {ifindex} in this network namespace")]
    NoSuchInterface { ifindex: u32 },
    #[error("looking up the name of ifindex {ifindex}: {source}")]
    InterfaceName {
        ifindex: u32,
        #[source]
        source: io::Error,
    },
    #[error("attaching {program} ({hook}) to ifindex {ifindex} with {mode}: {source}")]
    Attach {
        program: &'static str,
        hook: Hook,
        ifindex: u32,
        mode: AttachMode,
        #[source]
        source: Box<ProgramError>,
    },
    #[error("adding the clsact qdisc to ifindex {ifindex}: {source}")]
    Clsact {
        ifindex: u32,
        #[source]
        source: Box<TcError>,
    },
    #[error("pinning the link at {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: Box<PinError>,
    },
    #[error("{op} {path}: {source}")]
    Pinned {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "the link pinned at {path} is attached to ifindex {found}, not {expected}: the \
         interface changed while attaching; the link was removed"
    )]
    AttachRaced {
        path: PathBuf,
        expected: u32,
        found: u32,
    },
    #[error("detaching the clsact filter of {program} from ifindex {ifindex}: {source}")]
    ClsactDetach {
        program: &'static str,
        ifindex: u32,
        #[source]
        source: Box<TcError>,
    },
    #[error("listing the clsact filters on {ifname} ({hook}): {source}")]
    ClsactList {
        ifname: String,
        hook: Hook,
        #[source]
        source: Box<crate::NetError>,
    },
    #[error("removing the clsact filter of {program} from {ifname}: {source}")]
    ClsactRemove {
        ifname: String,
        program: &'static str,
        #[source]
        source: Box<io::Error>,
    },
    #[error("listing the programs on ifindex {ifindex} ({direction}): {source}")]
    Chain {
        ifindex: u32,
        direction: Direction,
        #[source]
        source: io::Error,
    },
    #[error("counting the possible CPUs ({what}): {source}")]
    Cpus {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}
