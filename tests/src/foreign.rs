//! Stand-ins for a CNI's own tc programs (Cilium's, say), to put beside shareguard's on
//! a pod's host veth: a few instructions each, loaded and linked with TCX straight
//! through `bpf(2)`, so that the tests need no compiler for them. Their run counts come
//! from the kernel's own statistics, switched on for as long as a [`RunStats`] lives.
//!
//! The one module of the test crate with `unsafe`: the system calls.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// What a stand-in does with each packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// TC_ACT_OK, which TCX reads as TCX_PASS: the packet goes on and the chain ends, as
    /// a CNI's program does when its policy allows a packet.
    Pass,
    /// `bpf_redirect(ifindex, 0)`: to another interface's egress.
    Redirect(u32),
    /// `bpf_redirect_peer(ifindex, 0)`: into the peer of a veth, in its namespace, past
    /// the host side's egress (Cilium's host routing).
    RedirectPeer(u32),
}

/// Where in the hook's chain the stand-in goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    First,
    Last,
}

/// A stand-in linked to one hook; dropping it detaches it.
pub struct Foreign {
    prog: OwnedFd,
    _link: OwnedFd,
}

impl Foreign {
    /// Loads a program that does `action` and links it to the TCX hook of `ifindex`
    /// (`ingress`: true for the receive side), at `place`.
    pub fn attach(ifindex: u32, ingress: bool, action: Action, place: Place) -> io::Result<Self> {
        let prog = sys::load(&program(action))?;
        let link = sys::link(&prog, ifindex, ingress, place)?;
        Ok(Foreign { prog, _link: link })
    }

    /// How often the program ran since it was loaded, while a [`RunStats`] was held.
    pub fn runs(&self) -> io::Result<u64> {
        sys::run_count(&self.prog)
    }

    /// The program's id, as a hook's chain lists it.
    pub fn id(&self) -> io::Result<u32> {
        sys::prog_id(&self.prog)
    }
}

/// The kernel counts program runs while this is held (`BPF_ENABLE_STATS`); nothing is
/// left switched on after it drops, whatever the test did.
pub struct RunStats(#[allow(dead_code, reason = "held for its effect")] OwnedFd);

impl RunStats {
    pub fn enable() -> io::Result<Self> {
        sys::enable_stats().map(RunStats)
    }
}

/// `struct bpf_insn` (include/uapi/linux/bpf.h) as bytes.
fn insn(code: u8, dst: u8, src: u8, imm: i32) -> [u8; 8] {
    let i = imm.to_le_bytes();
    [code, (src << 4) | dst, 0, 0, i[0], i[1], i[2], i[3]]
}

/// BPF_ALU64 | BPF_MOV | BPF_K: dst = imm.
const MOV_IMM: u8 = 0xb7;
/// BPF_JMP | BPF_CALL: call helper imm.
const CALL: u8 = 0x85;
/// BPF_JMP | BPF_EXIT.
const EXIT: u8 = 0x95;
const HELPER_REDIRECT: i32 = 23;
const HELPER_REDIRECT_PEER: i32 = 155;

fn program(action: Action) -> Vec<u8> {
    let call = |helper: i32, ifindex: u32| {
        let ifindex = i32::try_from(ifindex).unwrap_or(i32::MAX);
        [
            insn(MOV_IMM, 1, 0, ifindex),
            insn(MOV_IMM, 2, 0, 0),
            insn(CALL, 0, 0, helper),
            insn(EXIT, 0, 0, 0),
        ]
        .concat()
    };
    match action {
        Action::Pass => [insn(MOV_IMM, 0, 0, 0), insn(EXIT, 0, 0, 0)].concat(),
        Action::Redirect(ifindex) => call(HELPER_REDIRECT, ifindex),
        Action::RedirectPeer(ifindex) => call(HELPER_REDIRECT_PEER, ifindex),
    }
}

#[allow(unsafe_code)]
mod sys {
    use super::*;

    // include/uapi/linux/bpf.h; kernel ABI.
    const BPF_PROG_LOAD: libc::c_int = 5;
    const BPF_OBJ_GET_INFO_BY_FD: libc::c_int = 15;
    const BPF_LINK_CREATE: libc::c_int = 28;
    const BPF_ENABLE_STATS: libc::c_int = 32;
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    const BPF_TCX_INGRESS: u32 = 46;
    const BPF_TCX_EGRESS: u32 = 47;
    const BPF_F_BEFORE: u32 = 1 << 3;
    const BPF_F_AFTER: u32 = 1 << 4;
    /// `struct bpf_prog_info`: `id` at byte 4, `run_cnt` at byte 200.
    const INFO_WORDS: usize = 26;

    /// A `union bpf_attr`, zeroed, large enough for every command used here.
    #[repr(C, align(8))]
    struct Attr([u8; 128]);

    impl Attr {
        fn new() -> Self {
            Attr([0; 128])
        }
        fn u32(&mut self, at: usize, v: u32) -> &mut Self {
            self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
            self
        }
        fn u64(&mut self, at: usize, v: u64) -> &mut Self {
            self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
            self
        }
    }

    fn bpf(cmd: libc::c_int, attr: &mut Attr) -> io::Result<libc::c_long> {
        // SAFETY: `attr` is a live, exclusively borrowed buffer of the size passed, so the
        // kernel reads and writes only within it; the pointers the callers put in it point
        // to buffers that outlive the call.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr.0.as_mut_ptr(),
                attr.0.len() as libc::c_uint,
            )
        };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    fn fd(ret: libc::c_long) -> io::Result<OwnedFd> {
        let fd = i32::try_from(ret).map_err(|_| io::Error::other("fd beyond i32"))?;
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    pub(super) fn load(insns: &[u8]) -> io::Result<OwnedFd> {
        let license = c"GPL";
        let mut log = vec![0u8; 4096];
        let mut attr = Attr::new();
        attr.u32(0, BPF_PROG_TYPE_SCHED_CLS)
            .u32(4, (insns.len() / 8) as u32)
            .u64(8, insns.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, 1)
            .u32(28, log.len() as u32)
            .u64(32, log.as_mut_ptr() as u64);
        bpf(BPF_PROG_LOAD, &mut attr).and_then(fd).map_err(|e| {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            io::Error::other(format!(
                "loading the stand-in: {e}: {}",
                String::from_utf8_lossy(&log[..end])
            ))
        })
    }

    pub(super) fn link(
        prog: &OwnedFd,
        ifindex: u32,
        ingress: bool,
        place: Place,
    ) -> io::Result<OwnedFd> {
        let mut attr = Attr::new();
        attr.u32(0, prog.as_raw_fd() as u32)
            .u32(4, ifindex)
            .u32(
                8,
                if ingress {
                    BPF_TCX_INGRESS
                } else {
                    BPF_TCX_EGRESS
                },
            )
            // Before or after no program (relative id 0): the head or the tail.
            .u32(
                12,
                match place {
                    Place::First => BPF_F_BEFORE,
                    Place::Last => BPF_F_AFTER,
                },
            );
        bpf(BPF_LINK_CREATE, &mut attr).and_then(fd)
    }

    fn info(prog: &OwnedFd) -> io::Result<[u64; INFO_WORDS]> {
        let mut info = [0u64; INFO_WORDS];
        let mut attr = Attr::new();
        attr.u32(0, prog.as_raw_fd() as u32)
            .u32(4, (INFO_WORDS * 8) as u32)
            .u64(8, info.as_mut_ptr() as u64);
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
        Ok(info)
    }

    pub(super) fn run_count(prog: &OwnedFd) -> io::Result<u64> {
        Ok(info(prog)?[200 / 8])
    }

    pub(super) fn prog_id(prog: &OwnedFd) -> io::Result<u32> {
        // `type` and `id` share the first word.
        Ok((info(prog)?[0] >> 32) as u32)
    }

    pub(super) fn enable_stats() -> io::Result<OwnedFd> {
        let mut attr = Attr::new();
        // BPF_STATS_RUN_TIME
        attr.u32(0, 0);
        bpf(BPF_ENABLE_STATS, &mut attr).and_then(fd)
    }
}
