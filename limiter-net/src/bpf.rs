//! The kernel side of bandwidth enforcement, as seen from user space: loads the tc programs
//! built from `ebpf/`, pins their maps and links, and reads and writes the maps.
//!
//! This is the one module of the crate that talks to aya and the `bpf(2)` system call;
//! everything `unsafe` in the crate is here, each with its reason.
//!
//! Everything the kernel holds is pinned under one directory on bpffs, so that it outlives
//! the agent (killing the agent lifts no limit) and a restarted agent finds it again:
//!
//! ```text
//! <pin_dir>/maps/SG_IFACES     ifindex -> IfaceConfig
//! <pin_dir>/maps/SG_COUNTERS   per-CPU counters, two per slot
//! <pin_dir>/maps/SG_PACE       EDT / policer state, two per slot
//! <pin_dir>/maps/SG_FLOWS      htb-ebpf: which flows are sparse (LRU, by flow hash)
//! <pin_dir>/maps/SG_ACTIVITY   htb-ebpf: when each share last sent, two per slot
//! <pin_dir>/maps/SG_WAKE       htb-ebpf: ring buffer, "this armed share sends again"
//! <pin_dir>/links/<name>       one TCX link per attachment (a directory in clsact mode)
//! ```
//!
//! A restarted agent loads the programs again, adopts the pinned maps (same counters and
//! configuration) and, for each attachment, swaps its freshly loaded program into the
//! pinned link (`bpf_link_update`), so an interface never runs two copies of a program.

use std::{
    ffi::{CStr, CString},
    fmt, fs, io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    sync::{Mutex, PoisonError},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, PerCpuValues, RingBuf},
    pin::PinError,
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttachType,
        links::{FdLink, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    },
    util::KernelVersion,
};
use shareguard_ebpf_common::{
    Activity, COUNTERS_MAP, DIR_FROM_POD, DIR_TO_POD, FLOWS_MAP, FlowKey, FlowState, IFACES_MAP,
    MAX_COUNTERS, MAX_FLOWS, PACE_MAP, PROG_FROM_POD, PROG_RETURN, PROG_TO_POD,
    activity::{ACTIVITY_MAP, WAKE_BYTES, WAKE_MAP},
    counter_index, flags_valid,
};
pub use shareguard_ebpf_common::{Counters, IfaceConfig, MAX_IFACES, MAX_SLOTS, Pace, PaceState};

/// Which way the traffic flows, seen from the pod; each has its own program and hook on
/// the pod's host-side veth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Traffic to the pod: egress of the host-side veth.
    ToPod,
    /// Traffic from the pod: ingress of the host-side veth.
    FromPod,
}

impl Direction {
    /// The direction as the programs and their maps number it (`DIR_TO_POD`,
    /// `DIR_FROM_POD`).
    pub fn index(self) -> u32 {
        match self {
            Self::ToPod => DIR_TO_POD,
            Self::FromPod => DIR_FROM_POD,
        }
    }
}

/// Where one of our programs is attached: a pod's host veth, one hook per direction, or
/// the ingress of a share's return device (see `PROG_RETURN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hook {
    Pod(Direction),
    Return,
}

impl Hook {
    fn program(self) -> &'static str {
        match self {
            Self::Pod(Direction::ToPod) => PROG_TO_POD,
            Self::Pod(Direction::FromPod) => PROG_FROM_POD,
            Self::Return => PROG_RETURN,
        }
    }

    fn tc_attach_type(self) -> TcAttachType {
        match self {
            Self::Pod(Direction::ToPod) => TcAttachType::Egress,
            Self::Pod(Direction::FromPod) | Self::Return => TcAttachType::Ingress,
        }
    }

    /// `enum bpf_attach_type` value of the TCX hook, as reported in a link's info.
    fn tcx_attach_type(self) -> u32 {
        match self {
            Self::Pod(Direction::ToPod) => sys::BPF_TCX_EGRESS,
            Self::Pod(Direction::FromPod) | Self::Return => sys::BPF_TCX_INGRESS,
        }
    }

    /// Where in the interface's chain the program goes. On a pod's veth, first: a CNI's
    /// program that passes a packet (TCX_PASS) ends the chain, so ours must run before
    /// any, and ours always hands on to the next (TCX_NEXT). The return device is ours
    /// alone.
    fn order(self) -> LinkOrder {
        match self {
            Self::Pod(_) => LinkOrder::first(),
            Self::Return => LinkOrder::default(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Pod(Direction::ToPod) => "egress",
            Self::Pod(Direction::FromPod) => "ingress",
            Self::Return => "return",
        }
    }

    fn from_name(hook: &str) -> Option<Self> {
        match hook {
            "egress" => Some(Self::Pod(Direction::ToPod)),
            "ingress" => Some(Self::Pod(Direction::FromPod)),
            "return" => Some(Self::Return),
            _ => None,
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pod(dir) => dir.fmt(f),
            Self::Return => f.write_str("back from the queue (return device ingress)"),
        }
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            Self::ToPod => "to the pod (veth egress)",
            Self::FromPod => "from the pod (veth ingress)",
        };
        f.write_str(text)
    }
}

/// How programs are attached to interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// TCX links (Linux 6.6 and later): pinned links, replaced atomically, owned by us.
    Tcx,
    /// cls_bpf filters on a clsact qdisc, for older kernels. The filter stays in place after
    /// the agent exits without any pin; `links/<name>` is then a directory recording where it
    /// was attached, since bpffs holds no plain files.
    Clsact,
}

impl AttachMode {
    /// TCX where the kernel has it, clsact otherwise.
    pub fn probe() -> Self {
        match KernelVersion::current() {
            Ok(version) if version >= KernelVersion::new(6, 6, 0) => Self::Tcx,
            // Unknown version: clsact works on every kernel that has BPF at all.
            _ => Self::Clsact,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcx => "tcx",
            Self::Clsact => "clsact",
        })
    }
}

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

/// Mounts a BPF filesystem at `root` (normally `/sys/fs/bpf`) unless one is mounted there
/// already. systemd mounts it on most distributions; containers and minimal machines
/// often lack it, and pins only outlive the agent on bpffs.
pub fn ensure_bpffs(root: &Path) -> Result<(), BpfError> {
    // Two threads that both see no bpffs would mount twice, and the second mount would hide
    // whatever the first caller already pinned under the first.
    static MOUNTING: Mutex<()> = Mutex::new(());
    let _guard = MOUNTING.lock().unwrap_or_else(PoisonError::into_inner);
    let mount_error = |source| BpfError::MountBpfFs {
        path: root.to_owned(),
        source,
    };
    fs::create_dir_all(root).map_err(mount_error)?;
    if sys::is_bpffs(root).map_err(mount_error)? {
        return Ok(());
    }
    sys::mount_bpffs(root).map_err(mount_error)
}

/// Priority and handle of our cls_bpf filter in clsact mode: one fixed filter per interface
/// and hook, so an attachment is found, replaced and removed without remembering what the
/// kernel allocated. The priority spells "SG".
const CLSACT_PRIORITY: u16 = 0x5347;
const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 1);

/// The loaded programs and their maps; see the module documentation for what is pinned.
///
/// Interfaces are named by ifindex in the network namespace of the calling thread, which
/// must be the host's (where the pods' host-side veths live), not a pod's.
pub struct Bpf {
    ebpf: Ebpf,
    ifaces: HashMap<MapData, u32, IfaceConfig>,
    counters: PerCpuArray<MapData, Counters>,
    pace: Array<MapData, PaceState>,
    /// Only the programs use it; held so that its descriptor outlives their loading. It
    /// is pinned like the others: a restart that forgot which flows are bulk would let
    /// their next packets overtake their own queued ones.
    _flows: Map,
    activity: Array<MapData, Activity>,
    /// Taken once by the burst governor ([`Bpf::take_wakeups`]).
    wake: Option<RingBuf<MapData>>,
    pin_dir: PathBuf,
    mode: AttachMode,
}

/// The ring of wake-ups from [`activity`](shareguard_ebpf_common::activity): counter
/// indices of armed shares that sent again. Its descriptor becomes readable when one is
/// there.
pub struct Wakeups {
    ring: RingBuf<MapData>,
}

impl Wakeups {
    /// The counter indices waiting in the ring, oldest first; records that are not one
    /// index are skipped.
    pub fn drain(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            if let Ok(bytes) = <[u8; 4]>::try_from(&item[..]) {
                out.push(u32::from_ne_bytes(bytes));
            }
        }
        out
    }
}

impl std::os::fd::AsFd for Wakeups {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.ring.as_fd()
    }
}

// The limiter keeps one `Bpf` behind a lock and calls it from blocking threads.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<Bpf>();
};

impl fmt::Debug for Bpf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bpf")
            .field("pin_dir", &self.pin_dir)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl Bpf {
    /// Loads the embedded object; maps are pinned under `pin_dir/maps/` and re-used (adopted)
    /// if already pinned there, so counters and configs survive an agent restart.
    /// Attaches with TCX where the kernel has it (6.6 and later), clsact otherwise.
    pub fn load(pin_dir: &Path) -> Result<Self, BpfError> {
        Self::load_with_mode(pin_dir, AttachMode::probe())
    }

    /// [`Bpf::load`] with the attach mode chosen by the caller (tests use it to exercise the
    /// clsact fallback on a kernel that has TCX).
    pub fn load_with_mode(pin_dir: &Path, mode: AttachMode) -> Result<Self, BpfError> {
        let maps_dir = pin_dir.join("maps");
        for dir in [&maps_dir, &pin_dir.join("links")] {
            fs::create_dir_all(dir).map_err(|source| BpfError::PinDir {
                path: dir.clone(),
                source,
            })?;
        }
        if !sys::is_bpffs(pin_dir).map_err(|source| BpfError::PinDir {
            path: pin_dir.to_owned(),
            source,
        })? {
            return Err(BpfError::NotBpfFs {
                path: pin_dir.to_owned(),
            });
        }

        let ifaces_path = maps_dir.join(IFACES_MAP);
        let counters_path = maps_dir.join(COUNTERS_MAP);
        let pace_path = maps_dir.join(PACE_MAP);
        let flows_path = maps_dir.join(FLOWS_MAP);
        let activity_path = maps_dir.join(ACTIVITY_MAP);
        let wake_path = maps_dir.join(WAKE_MAP);
        let mut ebpf = EbpfLoader::new()
            .map_pin_path(IFACES_MAP, ifaces_path.as_path())
            .map_pin_path(COUNTERS_MAP, counters_path.as_path())
            .map_pin_path(PACE_MAP, pace_path.as_path())
            .map_pin_path(FLOWS_MAP, flows_path.as_path())
            .map_pin_path(ACTIVITY_MAP, activity_path.as_path())
            .map_pin_path(WAKE_MAP, wake_path.as_path())
            .load(aya::include_bytes_aligned!(concat!(
                env!("OUT_DIR"),
                "/shareguard-ebpf"
            )))
            .map_err(|source| BpfError::Load {
                pin_dir: pin_dir.to_owned(),
                source: Box::new(source),
            })?;

        // aya adopts whatever is pinned under the name without comparing it to the object,
        // so a map left by another build with another layout must be caught here, before
        // the programs are verified against it or user space reads it with the wrong size.
        let ifaces = take_map(&mut ebpf, IFACES_MAP)?;
        check_map(
            &ifaces,
            IFACES_MAP,
            &ifaces_path,
            MapShape {
                kind: "hash",
                key_size: 4,
                value_size: size_of::<IfaceConfig>(),
                max_entries: MAX_IFACES,
            },
        )?;
        let counters = take_map(&mut ebpf, COUNTERS_MAP)?;
        check_map(
            &counters,
            COUNTERS_MAP,
            &counters_path,
            MapShape {
                kind: "percpu_array",
                key_size: 4,
                value_size: size_of::<Counters>(),
                max_entries: MAX_COUNTERS,
            },
        )?;
        let pace = take_map(&mut ebpf, PACE_MAP)?;
        check_map(
            &pace,
            PACE_MAP,
            &pace_path,
            MapShape {
                kind: "array",
                key_size: 4,
                value_size: size_of::<PaceState>(),
                max_entries: MAX_COUNTERS,
            },
        )?;
        let flows = take_map(&mut ebpf, FLOWS_MAP)?;
        check_map(
            &flows,
            FLOWS_MAP,
            &flows_path,
            MapShape {
                kind: "lru_hash",
                key_size: size_of::<FlowKey>(),
                value_size: size_of::<FlowState>(),
                max_entries: MAX_FLOWS,
            },
        )?;
        let activity = take_map(&mut ebpf, ACTIVITY_MAP)?;
        check_map(
            &activity,
            ACTIVITY_MAP,
            &activity_path,
            MapShape {
                kind: "array",
                key_size: 4,
                value_size: size_of::<Activity>(),
                max_entries: MAX_COUNTERS,
            },
        )?;
        let wake = take_map(&mut ebpf, WAKE_MAP)?;
        check_map(
            &wake,
            WAKE_MAP,
            &wake_path,
            MapShape {
                kind: "ringbuf",
                key_size: 0,
                value_size: 0,
                max_entries: WAKE_BYTES,
            },
        )?;
        let activity = Array::try_from(activity).map_err(|e| map_error(ACTIVITY_MAP, "open", e))?;
        let wake = RingBuf::try_from(wake).map_err(|e| map_error(WAKE_MAP, "open", e))?;
        let ifaces = HashMap::try_from(ifaces).map_err(|e| map_error(IFACES_MAP, "open", e))?;
        let pace = Array::try_from(pace).map_err(|e| map_error(PACE_MAP, "open", e))?;
        let counters =
            PerCpuArray::try_from(counters).map_err(|e| map_error(COUNTERS_MAP, "open", e))?;

        for program in [PROG_TO_POD, PROG_FROM_POD, PROG_RETURN] {
            classifier(&mut ebpf, program)?
                .load()
                .map_err(|source| BpfError::ProgramLoad {
                    program,
                    source: Box::new(source),
                })?;
        }

        Ok(Self {
            ebpf,
            ifaces,
            counters,
            pace,
            _flows: flows,
            activity,
            wake: Some(wake),
            pin_dir: pin_dir.to_owned(),
            mode,
        })
    }

    /// How this instance attaches programs.
    pub fn mode(&self) -> AttachMode {
        self.mode
    }

    /// Attaches the program for `dir` to `ifindex` and pins the attachment at
    /// `pin_dir/links/<name>`. If one is already pinned there for the same interface and
    /// direction it is adopted (its program is swapped for the one loaded here), never
    /// attached twice; one pinned there for another interface or direction is removed first.
    ///
    /// With TCX ours goes first in the interface's chain; a pinned one that another
    /// program has since been put in front of is detached and attached first again.
    pub fn attach(&mut self, ifindex: u32, dir: Direction, name: &str) -> Result<(), BpfError> {
        self.attach_hook(ifindex, Hook::Pod(dir), name)
    }

    /// As [`Bpf::attach`], for the return program on the ingress of a share's return
    /// device.
    pub fn attach_return(&mut self, ifindex: u32, name: &str) -> Result<(), BpfError> {
        self.attach_hook(ifindex, Hook::Return, name)
    }

    fn attach_hook(&mut self, ifindex: u32, hook: Hook, name: &str) -> Result<(), BpfError> {
        let path = self.link_path(name)?;
        match self.mode {
            AttachMode::Tcx => self.attach_tcx(ifindex, hook, &path),
            AttachMode::Clsact => self.attach_clsact(ifindex, hook, &path),
        }
    }

    /// The programs attached to `ifindex`'s TCX hook for `dir`, in the order they run:
    /// (program id, link id) each. Empty in clsact mode, where aya lists nothing.
    pub fn chain(&self, ifindex: u32, dir: Direction) -> Result<Vec<(u32, u32)>, BpfError> {
        if self.mode != AttachMode::Tcx {
            return Ok(Vec::new());
        }
        sys::tcx_chain(ifindex, Hook::Pod(dir).tcx_attach_type()).map_err(|source| {
            BpfError::Chain {
                ifindex,
                direction: dir,
                source,
            }
        })
    }

    /// Where the attachment pinned as `name` runs on `ifindex`'s hook for `dir`:
    /// `Ok(None)` when it is first (or in clsact mode, where the filter's fixed priority
    /// is its place), else the number of programs that run before it. An attachment that
    /// is not there at all counts as not first.
    pub fn ahead_of(
        &self,
        name: &str,
        ifindex: u32,
        dir: Direction,
    ) -> Result<Option<usize>, BpfError> {
        if self.mode != AttachMode::Tcx {
            return Ok(None);
        }
        let path = self.link_path(name)?;
        let Some(info) = pinned_link_info(&path)? else {
            return Ok(Some(self.chain(ifindex, dir)?.len()));
        };
        let chain = self.chain(ifindex, dir)?;
        Ok(match chain.iter().position(|&(_, link)| link == info.id) {
            Some(0) => None,
            Some(n) => Some(n),
            None => Some(chain.len()),
        })
    }

    /// Detach means unpin: removes the pinned link (and thereby the attachment). Ok if absent.
    pub fn detach(&mut self, name: &str) -> Result<(), BpfError> {
        let path = self.link_path(name)?;
        match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(BpfError::Pinned {
                op: "inspecting",
                path,
                source,
            }),
            // Whatever mode this instance runs in: a previous agent may have used the other.
            Ok(meta) if meta.is_dir() => self.detach_clsact(&path),
            Ok(_) => detach_tcx(&path),
        }
    }

    /// Whether a pinned attachment `name` exists and is still attached to `ifindex`.
    ///
    /// For TCX this is the kernel's word: the link's own record of its interface, which
    /// turns to 0 when the interface goes away. In clsact mode it is only the recorded
    /// interface and that the interface still exists, since aya offers no way to list
    /// filters; the limiter reads the qdiscs back itself.
    pub fn is_attached(&self, name: &str, ifindex: u32) -> Result<bool, BpfError> {
        let path = self.link_path(name)?;
        match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(BpfError::Pinned {
                op: "inspecting",
                path,
                source,
            }),
            Ok(meta) if meta.is_dir() => Ok(match read_clsact_record(&path)? {
                Some((recorded, _)) if recorded == ifindex => sys::interface_name(ifindex)
                    .map_err(|source| BpfError::InterfaceName { ifindex, source })?
                    .is_some(),
                _ => false,
            }),
            Ok(_) => match pinned_link_info(&path)? {
                None => Ok(false),
                Some(info) => {
                    Ok(info.link_type == sys::BPF_LINK_TYPE_TCX && info.ifindex == ifindex)
                }
            },
        }
    }

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

    fn link_path(&self, name: &str) -> Result<PathBuf, BpfError> {
        let invalid = |reason| BpfError::InvalidName {
            name: name.to_owned(),
            reason,
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(invalid("must be a non-empty file name"));
        }
        if name.len() > 200 {
            return Err(invalid("longer than 200 bytes"));
        }
        if name.contains('/') || name.contains('\0') {
            return Err(invalid("contains '/' or NUL"));
        }
        Ok(self.pin_dir.join("links").join(name))
    }

    fn program(&mut self, hook: Hook) -> Result<&mut SchedClassifier, BpfError> {
        classifier(&mut self.ebpf, hook.program())
    }

    fn attach_tcx(&mut self, ifindex: u32, hook: Hook, path: &Path) -> Result<(), BpfError> {
        let program = hook.program();
        let attach_error = |source: ProgramError| BpfError::Attach {
            program,
            hook,
            ifindex,
            mode: AttachMode::Tcx,
            source: Box::new(source),
        };
        // First, so that a request for a missing interface fails without side effects.
        let ifname = self.ifname(ifindex)?;

        if let Some(info) = pinned_link_info(path)? {
            // A link that another program was put in front of is attached anew, first:
            // its place cannot be changed in place. Detached before, never after: two of
            // ours on one hook would send a packet round the queue loop twice.
            let in_place = match hook {
                Hook::Pod(_) => sys::tcx_chain(ifindex, hook.tcx_attach_type())
                    .map_err(|source| BpfError::Pinned {
                        op: "listing the chain of the link pinned at",
                        path: path.to_owned(),
                        source,
                    })?
                    .first()
                    .is_some_and(|&(_, link)| link == info.id),
                Hook::Return => true,
            };
            if info.link_type == sys::BPF_LINK_TYPE_TCX
                && info.ifindex == ifindex
                && info.attach_type == hook.tcx_attach_type()
                && in_place
            {
                let pinned = PinnedLink::from_pin(path).map_err(|e| BpfError::Pinned {
                    op: "opening",
                    path: path.to_owned(),
                    source: io::Error::other(e),
                })?;
                let link = SchedClassifierLink::try_from(FdLink::from(pinned)).map_err(|e| {
                    BpfError::Pinned {
                        op: "adopting",
                        path: path.to_owned(),
                        source: io::Error::other(e),
                    }
                })?;
                let prog = self.program(hook)?;
                let id = prog.attach_to_link(link).map_err(attach_error)?;
                // The pin keeps the link; the handle aya tracks would only be closed when
                // `Bpf` drops, so let it go now.
                drop(prog.take_link(id).map_err(attach_error)?);
                return Ok(());
            }
            // Left by an earlier attachment under this name to an interface that is gone
            // or was replaced (a pod sandbox recreated with a new veth), or pushed back
            // in the chain: the name now means `ifindex`, first, and the old attachment
            // must not linger.
            detach_tcx(path)?;
        }

        let prog = self.program(hook)?;
        let id = prog
            .attach_with_options(
                &ifname,
                hook.tc_attach_type(),
                TcAttachOptions::TcxOrder(hook.order()),
            )
            .map_err(attach_error)?;
        let link = prog.take_link(id).map_err(attach_error)?;
        let link = FdLink::try_from(link)
            .map_err(|e| attach_error(ProgramError::IOError(io::Error::other(e))))?;
        // On failure the link is dropped, which detaches it: nothing half-done is left.
        drop(link.pin(path).map_err(|source| BpfError::Pin {
            path: path.to_owned(),
            source: Box::new(source),
        })?);

        // aya attached by name; if the interface was renamed or replaced in between, the
        // link sits on another interface than the caller asked for.
        let found = pinned_link_info(path)?.map_or(0, |info| info.ifindex);
        if found != ifindex {
            detach_tcx(path)?;
            return Err(BpfError::AttachRaced {
                path: path.to_owned(),
                expected: ifindex,
                found,
            });
        }
        Ok(())
    }

    fn attach_clsact(&mut self, ifindex: u32, hook: Hook, path: &Path) -> Result<(), BpfError> {
        let program = hook.program();
        let attach_error = |source: ProgramError| BpfError::Attach {
            program,
            hook,
            ifindex,
            mode: AttachMode::Clsact,
            source: Box::new(source),
        };
        // First, so that a request for a missing interface fails without side effects.
        let ifname = self.ifname(ifindex)?;

        match fs::symlink_metadata(path) {
            Ok(meta) if meta.is_dir() => {
                if read_clsact_record(path)? != Some((ifindex, hook)) {
                    self.detach_clsact(path)?;
                }
            }
            // A TCX link from an agent that ran in TCX mode: replace it.
            Ok(_) => detach_tcx(path)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(BpfError::Pinned {
                    op: "inspecting",
                    path: path.to_owned(),
                    source,
                });
            }
        }

        match tc::qdisc_add_clsact(&ifname) {
            Ok(()) => {}
            // Already there (ours from before, or someone else's): filters go on it either way.
            Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => {
                return Err(BpfError::Clsact {
                    ifindex,
                    source: Box::new(e),
                });
            }
        }

        let prog = self.program(hook)?;
        let options = NlOptions {
            priority: CLSACT_PRIORITY,
            handle: CLSACT_HANDLE,
            classid: None,
        };
        let id = match prog.attach_with_options(
            &ifname,
            hook.tc_attach_type(),
            TcAttachOptions::Netlink(options),
        ) {
            Ok(id) => id,
            // Our filter is already there (an earlier agent's): swap the program in place,
            // which never leaves the interface unfiltered.
            Err(ProgramError::TcError(TcError::NetlinkError(e)))
                if e.raw_os_error() == Some(libc::EEXIST) =>
            {
                let existing = SchedClassifierLink::attached(
                    &ifname,
                    hook.tc_attach_type(),
                    CLSACT_PRIORITY,
                    CLSACT_HANDLE,
                    None,
                )
                .map_err(|e| attach_error(ProgramError::IOError(e)))?;
                prog.attach_to_link(existing).map_err(attach_error)?
            }
            Err(e) => return Err(attach_error(e)),
        };
        let link = prog.take_link(id).map_err(attach_error)?;
        // Dropping the link would delete the filter; the filter must outlive this process,
        // as a pinned link does. The handle holds no file descriptor, so nothing leaks but
        // the few bytes of the struct.
        std::mem::forget(link);

        let record = path.join(clsact_record_name(ifindex, hook));
        fs::create_dir_all(&record).map_err(|source| BpfError::Pinned {
            op: "recording the clsact attachment at",
            path: record,
            source,
        })
    }

    fn detach_clsact(&mut self, path: &Path) -> Result<(), BpfError> {
        if let Some((ifindex, hook)) = read_clsact_record(path)? {
            let program = hook.program();
            // Gone interface: its filters went with it.
            if let Some(ifname) = sys::interface_name(ifindex)
                .map_err(|source| BpfError::InterfaceName { ifindex, source })?
            {
                match tc::qdisc_detach_program(&ifname, hook.tc_attach_type(), program) {
                    Ok(()) => {}
                    Err(TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(BpfError::ClsactDetach {
                            program,
                            ifindex,
                            source: Box::new(e),
                        });
                    }
                }
            }
        }
        fs::remove_dir_all(path).map_err(|source| BpfError::Pinned {
            op: "removing",
            path: path.to_owned(),
            source,
        })
    }

    fn ifname(&self, ifindex: u32) -> Result<String, BpfError> {
        sys::interface_name(ifindex)
            .map_err(|source| BpfError::InterfaceName { ifindex, source })?
            .ok_or(BpfError::NoSuchInterface { ifindex })
    }
}

/// Removes a pinned TCX link and with it the attachment. Ok if it is not there.
fn detach_tcx(path: &Path) -> Result<(), BpfError> {
    let link = match sys::obj_get(path) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(BpfError::Pinned {
                op: "opening",
                path: path.to_owned(),
                source,
            });
        }
    };
    // Detach explicitly: removing the pin alone frees the link only once every other holder
    // has closed it, and the kernel then releases it from a work queue, so the program
    // could still run for a moment after detach returns. EINVAL: already detached (its
    // interface is gone).
    match sys::link_detach(&link) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(source) => {
            return Err(BpfError::Pinned {
                op: "detaching the link pinned at",
                path: path.to_owned(),
                source,
            });
        }
    }
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(BpfError::Pinned {
            op: "unpinning",
            path: path.to_owned(),
            source,
        }),
    }
}

/// The kernel's record of a pinned link, or `None` when nothing is pinned at `path`.
fn pinned_link_info(path: &Path) -> Result<Option<sys::LinkInfo>, BpfError> {
    let fd = match sys::obj_get(path) {
        Ok(fd) => fd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(BpfError::Pinned {
                op: "opening",
                path: path.to_owned(),
                source,
            });
        }
    };
    sys::link_info(&fd)
        .map(Some)
        .map_err(|source| BpfError::Pinned {
            op: "reading the link info of",
            path: path.to_owned(),
            source,
        })
}

fn clsact_record_name(ifindex: u32, hook: Hook) -> String {
    format!("{ifindex}-{}", hook.name())
}

/// The (ifindex, direction) recorded in a clsact attachment directory, or `None` if it
/// holds no record (an interrupted attach; detach then just removes the directory).
fn read_clsact_record(path: &Path) -> Result<Option<(u32, Hook)>, BpfError> {
    let entries = fs::read_dir(path).map_err(|source| BpfError::Pinned {
        op: "reading",
        path: path.to_owned(),
        source,
    })?;
    for entry in entries {
        let entry = entry.map_err(|source| BpfError::Pinned {
            op: "reading",
            path: path.to_owned(),
            source,
        })?;
        let name = entry.file_name();
        let Some((ifindex, hook)) = name.to_str().and_then(|n| n.split_once('-')) else {
            continue;
        };
        if let (Ok(ifindex), Some(hook)) = (ifindex.parse(), Hook::from_name(hook)) {
            return Ok(Some((ifindex, hook)));
        }
    }
    Ok(None)
}

fn classifier<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut SchedClassifier, BpfError> {
    ebpf.program_mut(name)
        .and_then(|program| program.try_into().ok())
        .ok_or(BpfError::MissingObject {
            kind: "tc classifier",
            name,
        })
}

fn take_map(ebpf: &mut Ebpf, name: &'static str) -> Result<Map, BpfError> {
    ebpf.take_map(name)
        .ok_or(BpfError::MissingObject { kind: "map", name })
}

fn map_error(map: &'static str, op: &'static str, source: MapError) -> BpfError {
    BpfError::Map {
        map,
        op,
        source: Box::new(source),
    }
}

#[derive(PartialEq, Eq)]
struct MapShape {
    kind: &'static str,
    key_size: usize,
    value_size: usize,
    max_entries: u32,
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

fn check_map(
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

/// Thin wrappers over what aya does not expose: opening a pinned object as a plain file
/// descriptor, a link's kernel info (its interface and hook), detaching a link, the name of
/// an ifindex, the filesystem type of a path and mounting bpffs. All `unsafe` of the crate lives here
/// (the allow keeps it so once the crate denies `unsafe_code` everywhere else).
#[allow(unsafe_code)]
mod sys {
    use super::*;

    // Values from include/uapi/linux/bpf.h; they are kernel ABI and never change.
    const BPF_OBJ_GET: libc::c_int = 7;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_int = 15;
    const BPF_LINK_DETACH: libc::c_int = 34;
    const BPF_PROG_QUERY: libc::c_int = 16;
    pub(super) const BPF_LINK_TYPE_TCX: u32 = 11;
    pub(super) const BPF_TCX_INGRESS: u32 = 46;
    pub(super) const BPF_TCX_EGRESS: u32 = 47;
    /// include/uapi/linux/magic.h
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

    /// `union bpf_attr` as used by BPF_OBJ_GET. The trailing field is the struct's own
    /// padding made explicit: the kernel rejects attributes whose unused bytes are not zero.
    #[repr(C)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        pad: u32,
    }

    /// `union bpf_attr` as used by BPF_OBJ_GET_INFO_BY_FD.
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }

    /// `union bpf_attr` as used by BPF_PROG_QUERY on a TCX hook (Linux 6.6 and later):
    /// the programs and links of the hook, in the order they run.
    #[repr(C)]
    struct QueryAttr {
        target_ifindex: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        count: u32,
        _pad: u32,
        prog_attach_flags: u64,
        link_ids: u64,
        link_attach_flags: u64,
        revision: u64,
    }

    /// Most programs one hook is read with; a chain this long is not one a node runs.
    const CHAIN_MAX: usize = 64;

    /// `union bpf_attr` as used by BPF_LINK_DETACH.
    #[repr(C)]
    struct LinkDetachAttr {
        link_fd: u32,
    }

    /// The head of `struct bpf_link_info` up to the `tcx` member of its union (which starts
    /// 8-aligned, hence `pad`). The kernel fills in at most `info_len` bytes, so asking for
    /// this prefix only is allowed.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    pub(super) struct LinkInfo {
        pub(super) link_type: u32,
        /// The link's id, as `BPF_PROG_QUERY` lists it in a hook's chain.
        pub(super) id: u32,
        _prog_id: u32,
        _pad: u32,
        /// `tcx.ifindex`: 0 once the interface is gone or the link was detached.
        pub(super) ifindex: u32,
        /// `tcx.attach_type`
        pub(super) attach_type: u32,
    }

    fn bpf<T>(cmd: libc::c_int, attr: &mut T) -> io::Result<libc::c_long> {
        // SAFETY: `attr` is a live, exclusively borrowed `#[repr(C)]` value laid out as the
        // kernel's `union bpf_attr` prefix for `cmd`, and its size is passed along, so the
        // kernel reads and writes only within it. Pointers inside it (pathname, info) are
        // the callers' business, documented there.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                std::ptr::from_mut(attr),
                size_of::<T>() as libc::c_uint,
            )
        };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    /// Opens the object pinned at `path` (read-write).
    pub(super) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut attr = ObjGetAttr {
            // The kernel reads the NUL-terminated string during the call; `path` outlives it.
            pathname: path.as_ptr() as u64,
            bpf_fd: 0,
            file_flags: 0,
            path_fd: 0,
            pad: 0,
        };
        let fd = bpf(BPF_OBJ_GET, &mut attr)?;
        let fd = i32::try_from(fd)
            .map_err(|_| io::Error::other("BPF_OBJ_GET returned an fd beyond i32"))?;
        // SAFETY: BPF_OBJ_GET returned a new file descriptor (close-on-exec) that nothing
        // else owns; the OwnedFd closes it exactly once.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The kernel's info on the link `fd`.
    pub(super) fn link_info(fd: &OwnedFd) -> io::Result<LinkInfo> {
        let mut info = LinkInfo::default();
        let mut attr = InfoAttr {
            bpf_fd: fd.as_raw_fd() as u32,
            info_len: size_of::<LinkInfo>() as u32,
            // The kernel writes at most `info_len` bytes there during the call, and `info`
            // is a live local that outlives it.
            info: std::ptr::from_mut(&mut info) as u64,
        };
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok(info)
    }

    /// The TCX chain of `ifindex`'s hook `attach_type` in the order it runs: (program id,
    /// link id) each, link id 0 for a program attached without a link.
    pub(super) fn tcx_chain(ifindex: u32, attach_type: u32) -> io::Result<Vec<(u32, u32)>> {
        let mut progs = [0u32; CHAIN_MAX];
        let mut links = [0u32; CHAIN_MAX];
        let mut attr = QueryAttr {
            target_ifindex: ifindex,
            attach_type,
            query_flags: 0,
            attach_flags: 0,
            // The kernel writes at most `count` ids into each array during the call; both
            // are live locals of CHAIN_MAX entries that outlive it.
            prog_ids: progs.as_mut_ptr() as u64,
            count: CHAIN_MAX as u32,
            _pad: 0,
            prog_attach_flags: 0,
            link_ids: links.as_mut_ptr() as u64,
            link_attach_flags: 0,
            revision: 0,
        };
        match bpf(BPF_PROG_QUERY, &mut attr) {
            Ok(_) => {}
            // ENOSPC: more than CHAIN_MAX; the first CHAIN_MAX were written, and the
            // first is all a caller needs.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {}
            Err(e) => return Err(e),
        }
        let n = (attr.count as usize).min(CHAIN_MAX);
        Ok(progs[..n]
            .iter()
            .copied()
            .zip(links[..n].iter().copied())
            .collect())
    }

    /// Detaches the link `fd` from its hook, whoever else holds it.
    pub(super) fn link_detach(fd: &OwnedFd) -> io::Result<()> {
        let mut attr = LinkDetachAttr {
            link_fd: fd.as_raw_fd() as u32,
        };
        bpf(BPF_LINK_DETACH, &mut attr).map(drop)
    }

    /// The name of `ifindex` in this thread's network namespace, `None` if there is none.
    pub(super) fn interface_name(ifindex: u32) -> io::Result<Option<String>> {
        let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
        // SAFETY: `buf` is IF_NAMESIZE bytes, the size if_indextoname(3) writes at most.
        let ret = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
        if ret.is_null() {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENXIO) {
                Ok(None)
            } else {
                Err(e)
            };
        }
        // SAFETY: on success if_indextoname wrote a NUL-terminated name into `buf`.
        let name = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(Some(name.to_string_lossy().into_owned()))
    }

    /// Whether `path` is on a BPF filesystem, where pins can live.
    pub(super) fn is_bpffs(path: &Path) -> io::Result<bool> {
        let path = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: statfs is plain old data for which all-zero bytes are a valid value.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `path` is NUL-terminated and `st` is a valid, exclusively borrowed
        // statfs buffer; both outlive the call.
        if unsafe { libc::statfs(path.as_ptr(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        #[allow(
            clippy::unnecessary_cast,
            reason = "f_type's integer type differs by target"
        )]
        Ok(st.f_type as i64 == BPF_FS_MAGIC)
    }

    /// `mount -t bpf -o mode=0700 bpf <target>`: only root may use the pins, as systemd
    /// mounts it.
    pub(super) fn mount_bpffs(target: &Path) -> io::Result<()> {
        let target = CString::new(target.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: all four strings are NUL-terminated literals or CStrings that outlive the
        // call; bpffs takes its options as a string, as `data` expects.
        let ret = unsafe {
            libc::mount(
                c"bpf".as_ptr(),
                target.as_ptr(),
                c"bpf".as_ptr(),
                0,
                c"mode=0700".as_ptr().cast(),
            )
        };
        if ret != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    const _: () = {
        assert!(size_of::<ObjGetAttr>() == 24);
        assert!(size_of::<InfoAttr>() == 16);
        assert!(size_of::<LinkInfo>() == 24);
        assert!(size_of::<QueryAttr>() == 64);
    };
}
