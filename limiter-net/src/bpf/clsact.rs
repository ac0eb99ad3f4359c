//! clsact mode (kernels before 6.6): our programs as cls_bpf filters at a fixed place,
//! ahead of a CNI's, and where they are found again: no pins hold a filter, so each
//! attachment is recorded in a directory under `links/`.

use super::*;

/// Priority and handle of our cls_bpf filter in clsact mode: one fixed filter per interface
/// and hook, so an attachment is found, replaced and removed without remembering what the
/// kernel allocated. Priority 1 is the first a filter can have and the one CNIs use
/// (Cilium: priority 1, handle 1); within one priority the filter added last runs first,
/// so ours, added after the CNI's, runs before it. The handle spells "SG": never a CNI's.
const CLSACT_PRIORITY: u16 = 1;
const CLSACT_HANDLE: TcHandle = TcHandle::new(0, 0x5347);
/// Where versions before this one put the filter: behind a CNI's. Removed on attach.
const LEGACY_CLSACT_PRIORITY: u16 = 0x5347;
const LEGACY_CLSACT_HANDLE: TcHandle = TcHandle::new(0, 1);

impl Bpf {
    pub(super) fn attach_clsact(
        &mut self,
        ifindex: u32,
        hook: Hook,
        path: &Path,
    ) -> Result<(), BpfError> {
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
                } else if matches!(hook, Hook::Pod(_))
                    && clsact_place(&ifname, hook)?.0.is_some_and(|n| n > 0)
                {
                    // A filter added since runs before ours: ours is removed and added
                    // anew, which puts it first in its priority. Removed before, never
                    // after: two of ours on one hook would send a packet round the
                    // queue loop twice.
                    remove_filter(&ifname, hook, CLSACT_PRIORITY, CLSACT_HANDLE)?;
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
        // An earlier version's filter of ours, at the place behind a CNI's: ours now
        // runs first, so that one would only see each packet a second time.
        let legacy = clsact_filters(&ifname, hook)?.into_iter().any(|f| {
            f.priority == u32::from(LEGACY_CLSACT_PRIORITY)
                && f.handle == u32::from(LEGACY_CLSACT_HANDLE)
                && f.name.as_deref().is_some_and(|n| n.starts_with(program))
        });
        if legacy {
            remove_filter(&ifname, hook, LEGACY_CLSACT_PRIORITY, LEGACY_CLSACT_HANDLE)?;
        }

        let record = path.join(clsact_record_name(ifindex, hook));
        fs::create_dir_all(&record).map_err(|source| BpfError::Pinned {
            op: "recording the clsact attachment at",
            path: record,
            source,
        })
    }

    pub(super) fn detach_clsact(&mut self, path: &Path) -> Result<(), BpfError> {
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
}

/// The filters on `ifname`'s clsact hook for `hook`, in the order they run.
pub(super) fn clsact_filters(ifname: &str, hook: Hook) -> Result<Vec<crate::tc::Filter>, BpfError> {
    crate::tc::clsact_filters(ifname, hook.tc_hook_name()).map_err(|e| BpfError::ClsactList {
        ifname: ifname.to_owned(),
        hook,
        source: Box::new(e),
    })
}

/// Where our filter runs on `ifname`'s clsact hook: the number of filters before it (None
/// when it is not there), and how many filters the hook has.
pub(super) fn clsact_place(ifname: &str, hook: Hook) -> Result<(Option<usize>, usize), BpfError> {
    let filters = clsact_filters(ifname, hook)?;
    let place = filters.iter().position(|f| {
        f.priority == u32::from(CLSACT_PRIORITY) && f.handle == u32::from(CLSACT_HANDLE)
    });
    Ok((place, filters.len()))
}

/// Deletes the filter at (`priority`, `handle`) on `ifname`'s clsact hook. Ok if absent.
pub(super) fn remove_filter(
    ifname: &str,
    hook: Hook,
    priority: u16,
    handle: TcHandle,
) -> Result<(), BpfError> {
    let program = hook.program();
    let link = SchedClassifierLink::attached(ifname, hook.tc_attach_type(), priority, handle, None)
        .map_err(|e| BpfError::ClsactRemove {
            ifname: ifname.to_owned(),
            program,
            source: Box::new(e),
        })?;
    match link.detach() {
        Ok(()) => Ok(()),
        Err(ProgramError::TcError(TcError::NetlinkError(e)))
            if e.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        Err(e) => Err(BpfError::ClsactRemove {
            ifname: ifname.to_owned(),
            program,
            source: Box::new(io::Error::other(e)),
        }),
    }
}

pub(super) fn clsact_record_name(ifindex: u32, hook: Hook) -> String {
    format!("{ifindex}-{}", hook.name())
}

/// The (ifindex, direction) recorded in a clsact attachment directory, or `None` if it
/// holds no record (an interrupted attach; detach then just removes the directory).
pub(super) fn read_clsact_record(path: &Path) -> Result<Option<(u32, Hook)>, BpfError> {
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
