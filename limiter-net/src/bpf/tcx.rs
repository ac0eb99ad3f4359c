//! TCX attachments (kernels 6.6 and later): attach a program first on its hook and pin
//! the link, or adopt a link an earlier run pinned by swapping the freshly loaded program
//! into it; detach and unpin.

use std::{fs, io, path::Path};

use aya::programs::{
    ProgramError,
    links::{FdLink, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};

use super::{AttachMode, Bpf, BpfError, Hook, sys};

impl Bpf {
    pub(super) fn attach_tcx(
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
}

/// Removes a pinned TCX link and with it the attachment. Ok if it is not there.
pub(super) fn detach_tcx(path: &Path) -> Result<(), BpfError> {
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
pub(super) fn pinned_link_info(path: &Path) -> Result<Option<sys::LinkInfo>, BpfError> {
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
