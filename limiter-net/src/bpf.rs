//! The kernel side of bandwidth enforcement, as seen from user space: loads the tc programs
//! built from `ebpf/`, pins their maps and links, and reads and writes the maps.
//!
//! This is the one module of the crate that talks to aya and the `bpf(2)` system call;
//! everything `unsafe` in the crate is in its `sys` submodule, each with its reason.
//! `hook` names where programs attach, `maps` reads and writes the maps, `tcx` and
//! `clsact` attach in either mode, `error` says what can fail.
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
//! <pin_dir>/maps/SG_TO_POD_QUEUES  htb-ebpf: per slot, the to-pod queue of a share with several pods
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
    maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray, RingBuf},
    pin::PinError,
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttachType,
        links::Link,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    },
    util::KernelVersion,
};
use shareguard_ebpf_common::{
    Activity, COUNTERS_MAP, DIR_FROM_POD, DIR_TO_POD, FLOWS_MAP, FlowKey, FlowState, IFACES_MAP,
    MAX_COUNTERS, MAX_FLOWS, PACE_MAP, PROG_FROM_POD, PROG_RETURN, PROG_TO_POD, TO_POD_QUEUES_MAP,
    activity::{ACTIVITY_MAP, WAKE_BYTES, WAKE_MAP},
};
pub use shareguard_ebpf_common::{Counters, IfaceConfig, MAX_IFACES, MAX_SLOTS, Pace, PaceState};

mod clsact;
use clsact::{clsact_place, read_clsact_record};
mod error;
mod hook;
mod maps;
use maps::{MapShape, check_map, map_error, take_map};
mod tcx;
use tcx::{detach_tcx, pinned_link_info};

pub use error::BpfError;
pub use hook::{AttachMode, Direction, Hook};

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

/// The loaded programs and their maps; see the module documentation for what is pinned.
///
/// Interfaces are named by ifindex in the network namespace of the calling thread, which
/// must be the host's (where the pods' host-side veths live), not a pod's.
pub struct Bpf {
    ebpf: Ebpf,
    ifaces: HashMap<MapData, u32, IfaceConfig>,
    counters: PerCpuArray<MapData, Counters>,
    pace: Array<MapData, PaceState>,
    /// Slot -> the to-pod queue device of a share with several pods.
    to_pod_queues: Array<MapData, u32>,
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
        let to_pod_queues_path = maps_dir.join(TO_POD_QUEUES_MAP);
        let mut ebpf = EbpfLoader::new()
            .map_pin_path(IFACES_MAP, ifaces_path.as_path())
            .map_pin_path(COUNTERS_MAP, counters_path.as_path())
            .map_pin_path(PACE_MAP, pace_path.as_path())
            .map_pin_path(FLOWS_MAP, flows_path.as_path())
            .map_pin_path(ACTIVITY_MAP, activity_path.as_path())
            .map_pin_path(WAKE_MAP, wake_path.as_path())
            .map_pin_path(TO_POD_QUEUES_MAP, to_pod_queues_path.as_path())
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
        let to_pod_queues = take_map(&mut ebpf, TO_POD_QUEUES_MAP)?;
        check_map(
            &to_pod_queues,
            TO_POD_QUEUES_MAP,
            &to_pod_queues_path,
            MapShape {
                kind: "array",
                key_size: 4,
                value_size: size_of::<u32>(),
                max_entries: MAX_SLOTS,
            },
        )?;
        let to_pod_queues =
            Array::try_from(to_pod_queues).map_err(|e| map_error(TO_POD_QUEUES_MAP, "open", e))?;
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
            to_pod_queues,
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
    /// `Ok(None)` when it is first, else the number of programs (in clsact mode: filters)
    /// that run before it. An attachment that is not there at all counts as not first.
    pub fn ahead_of(
        &self,
        name: &str,
        ifindex: u32,
        dir: Direction,
    ) -> Result<Option<usize>, BpfError> {
        if self.mode != AttachMode::Tcx {
            let ifname = self.ifname(ifindex)?;
            let (place, all) = clsact_place(&ifname, Hook::Pod(dir))?;
            return Ok(match place {
                Some(0) => None,
                Some(n) => Some(n),
                None => Some(all),
            });
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

    /// Moves the pinned attachment `from` to the name `to` (one rename on bpffs: the
    /// attachment runs on throughout). Ok when nothing is pinned as `from`; whatever was
    /// pinned as `to` is detached first.
    pub fn rename_link(&mut self, from: &str, to: &str) -> Result<(), BpfError> {
        let from_path = self.link_path(from)?;
        let to_path = self.link_path(to)?;
        match fs::symlink_metadata(&from_path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(source) => {
                return Err(BpfError::Pinned {
                    op: "inspecting",
                    path: from_path,
                    source,
                });
            }
            Ok(_) => {}
        }
        self.detach(to)?;
        fs::rename(&from_path, &to_path).map_err(|source| BpfError::Pinned {
            op: "renaming",
            path: from_path,
            source,
        })
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

    fn ifname(&self, ifindex: u32) -> Result<String, BpfError> {
        sys::interface_name(ifindex)
            .map_err(|source| BpfError::InterfaceName { ifindex, source })?
            .ok_or(BpfError::NoSuchInterface { ifindex })
    }
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

/// The `bpf(2)` and libc calls aya does not make; all `unsafe` of the crate is there.
#[allow(unsafe_code)]
mod sys;
