//! What the bandwidth limiter left on the node, for `shareguard cleanup` (run with the
//! agent stopped): the root qdisc of each share's host veth that its install record
//! names, and every queue device (or an earlier version's ifb) in shareguard's device
//! group. Found read-only; each removed on
//! its own, only when it is still ours. Pins are a directory the caller removes whole.

use std::path::Path;

use crate::{NetError, rtnl, state::Installed, tc};

/// One thing to remove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leftover {
    /// A share's qdisc at the root of its pod's host veth.
    RootQdisc {
        dev: String,
        ifindex: u32,
        kind: String,
        share_key: String,
    },
    /// A queue device (either end of a share's queue pair, or an earlier version's ifb)
    /// in shareguard's group.
    Queue { name: String, alias: Option<String> },
}

impl Leftover {
    /// The thing in words, for a listing.
    pub fn describe(&self) -> String {
        match self {
            Leftover::RootQdisc {
                dev,
                kind,
                share_key,
                ..
            } => format!("root qdisc {kind} 1: on {dev} (share {share_key})"),
            Leftover::Queue { name, alias } => match alias {
                Some(a) => format!("queue device {name} ({a})"),
                None => format!("queue device {name}"),
            },
        }
    }
}

/// The install records in `state_dir`, read without creating anything.
fn records(state_dir: &Path) -> Result<Vec<Installed>, NetError> {
    if !state_dir.is_dir() {
        return Ok(Vec::new());
    }
    crate::state::StateDir::open(state_dir)?.all()
}

/// Everything of the bandwidth limiter's on the node, given its state directory.
pub fn leftovers(state_dir: &Path) -> Result<Vec<Leftover>, NetError> {
    let mut out = Vec::new();
    for i in records(state_dir)? {
        let Some(kind) = i.mechanism.qdisc_kind() else {
            continue;
        };
        for (h, _) in i.hosts() {
            // The record's interface, only while it still has that name (an index is
            // reused) and a root qdisc of ours: a veth gone with its pod took its qdisc
            // along.
            if rtnl::name_of_index(h.index)?.as_deref() != Some(h.name.as_str()) {
                continue;
            }
            if rtnl::root_qdisc(h.index)?.is_some_and(|q| q.kind == kind && q.major == tc::MAJOR) {
                out.push(Leftover::RootQdisc {
                    dev: h.name.clone(),
                    ifindex: h.index,
                    kind: kind.to_owned(),
                    share_key: i.share_key.clone(),
                });
            }
        }
    }
    for (name, alias) in rtnl::our_queues()? {
        out.push(Leftover::Queue { name, alias });
    }
    Ok(out)
}

/// Removes one leftover, if it is still there and still ours.
pub fn remove(l: &Leftover) -> Result<(), NetError> {
    match l {
        Leftover::RootQdisc {
            dev, ifindex, kind, ..
        } => {
            let still = rtnl::name_of_index(*ifindex)?.as_deref() == Some(dev.as_str())
                && rtnl::root_qdisc(*ifindex)?
                    .is_some_and(|q| q.kind == *kind && q.major == tc::MAJOR);
            if still {
                tc::remove_root(dev)?;
            }
            Ok(())
        }
        Leftover::Queue { name, .. } => rtnl::delete_our_queue(name),
    }
}
