//! Where and how our programs are attached: the direction of a pod's traffic, the hook
//! each program goes on, and TCX or clsact.

use super::*;

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
    pub(super) fn program(self) -> &'static str {
        match self {
            Self::Pod(Direction::ToPod) => PROG_TO_POD,
            Self::Pod(Direction::FromPod) => PROG_FROM_POD,
            Self::Return => PROG_RETURN,
        }
    }

    pub(super) fn tc_attach_type(self) -> TcAttachType {
        match self {
            Self::Pod(Direction::ToPod) => TcAttachType::Egress,
            Self::Pod(Direction::FromPod) | Self::Return => TcAttachType::Ingress,
        }
    }

    /// The clsact hook as `tc filter` names it.
    pub(super) fn tc_hook_name(self) -> &'static str {
        match self.tc_attach_type() {
            TcAttachType::Egress => "egress",
            _ => "ingress",
        }
    }

    /// `enum bpf_attach_type` value of the TCX hook, as reported in a link's info.
    pub(super) fn tcx_attach_type(self) -> u32 {
        match self {
            Self::Pod(Direction::ToPod) => sys::BPF_TCX_EGRESS,
            Self::Pod(Direction::FromPod) | Self::Return => sys::BPF_TCX_INGRESS,
        }
    }

    /// Where in the interface's chain the program goes. On a pod's veth, first: a CNI's
    /// program that passes a packet (TCX_PASS) ends the chain, so ours must run before
    /// any, and ours always hands on to the next (TCX_NEXT). The return device is ours
    /// alone.
    pub(super) fn order(self) -> LinkOrder {
        match self {
            Self::Pod(_) => LinkOrder::first(),
            Self::Return => LinkOrder::default(),
        }
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Pod(Direction::ToPod) => "egress",
            Self::Pod(Direction::FromPod) => "ingress",
            Self::Return => "return",
        }
    }

    pub(super) fn from_name(hook: &str) -> Option<Self> {
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
