//! Thin wrappers over what aya does not expose: opening a pinned object as a plain file
//! descriptor, a link's kernel info (its interface and hook), detaching a link, the name of
//! an ifindex, the filesystem type of a path and mounting bpffs. All `unsafe` of the crate lives here
//! (the allow keeps it so once the crate denies `unsafe_code` everywhere else).

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
    let fd =
        i32::try_from(fd).map_err(|_| io::Error::other("BPF_OBJ_GET returned an fd beyond i32"))?;
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
