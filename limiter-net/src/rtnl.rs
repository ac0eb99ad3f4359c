//! Netlink reads and writes of links and traffic-control classes, through rtnetlink.
//!
//! Every call runs on a fresh OS thread with its own single-threaded runtime: resolving a
//! pod's interface means entering the pod's network namespace with `setns`, which
//! changes the calling thread for good, so it must never happen on a thread anybody
//! else (a tokio worker, the blocking pool) will run code on afterwards. The thread ends
//! when the call does, and the namespace with it.

use std::{fs::File, future::Future, os::fd::AsRawFd, pin::Pin};

use futures::{StreamExt, TryStreamExt};
use nix::errno::Errno;
use rtnetlink::{
    Handle, LinkGetRequest, LinkUnspec, LinkVeth, MulticastGroup,
    packet_core::{NLM_F_ACK, NLM_F_ECHO, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload},
    packet_route::{
        RouteNetlinkMessage,
        link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo, LinkMessage},
        nsid::{NsidAttribute, NsidMessage},
        tc::{TcAttribute, TcHandle, TcHeader, TcMessage, TcOption},
    },
};
pub use shareguard_common::limiter::HostIface;

use crate::error::NetError;

type NlFuture<T> = Pin<Box<dyn Future<Output = Result<T, NetError>> + Send>>;

/// Runs `f` with a netlink handle on a new thread, inside the network namespace `netns`
/// (an open namespace file, so that what was verified is what is entered) when one is
/// given.
fn with_netlink<T, F>(netns: Option<File>, f: F) -> Result<T, NetError>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> NlFuture<T> + Send + 'static,
{
    let worker = std::thread::Builder::new()
        .name("shareguard-netlink".into())
        .spawn(move || {
            if let Some(ns) = &netns {
                nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                    NetError::Netns {
                        path: format!("fd {}", ns.as_raw_fd()),
                        reason: format!("setns: {e}"),
                    }
                })?;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
                .map_err(|e| NetError::Netlink(format!("runtime: {e}")))?;
            rt.block_on(async move {
                let (conn, handle, _) = rtnetlink::new_connection()
                    .map_err(|e| NetError::Netlink(format!("socket: {e}")))?;
                let task = tokio::spawn(conn);
                let out = f(handle).await;
                task.abort();
                out
            })
        })
        .map_err(|e| NetError::Netlink(format!("cannot start a netlink thread: {e}")))?;
    worker
        .join()
        .unwrap_or_else(|_| Err(NetError::Netlink("netlink thread panicked".into())))
}

fn nl_err(what: &str, e: rtnetlink::Error) -> NetError {
    if let rtnetlink::Error::NetlinkError(m) = &e
        && m.code.map(|c| c.get()) == Some(-libc_enodev())
    {
        return NetError::NotFound(what.to_owned());
    }
    NetError::Netlink(format!("{what}: {e}"))
}

/// ENODEV, spelled out so this module needs no libc dependency.
const fn libc_enodev() -> i32 {
    19
}

/// The first link a get request answers, or None when the kernel says there is no such
/// device.
async fn first_link(req: LinkGetRequest, what: String) -> Result<Option<LinkMessage>, NetError> {
    let mut s = req.execute();
    match s.try_next().await {
        Ok(m) => Ok(m),
        Err(rtnetlink::Error::NetlinkError(m))
            if m.code.map(|c| c.get()) == Some(-libc_enodev()) =>
        {
            Ok(None)
        }
        Err(e) => Err(nl_err(&what, e)),
    }
}

async fn link_by_name(h: &Handle, name: &str) -> Result<Option<LinkMessage>, NetError> {
    first_link(
        h.link().get().match_name(name.to_owned()),
        format!("link {name}"),
    )
    .await
}

async fn link_by_index(h: &Handle, index: u32) -> Result<Option<LinkMessage>, NetError> {
    first_link(h.link().get().match_index(index), format!("link #{index}")).await
}

fn name_of(m: &LinkMessage) -> Option<String> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

fn peer_of(m: &LinkMessage) -> Option<u32> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Link(i) => Some(*i),
        _ => None,
    })
}

fn is_veth(m: &LinkMessage) -> bool {
    m.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
        _ => false,
    })
}

fn link_netnsid(m: &LinkMessage) -> Option<i32> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkNetNsId(i) => Some(*i),
        _ => None,
    })
}

fn alias_of(m: &LinkMessage) -> Option<&str> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfAlias(s) => Some(s.as_str()),
        _ => None,
    })
}

fn kind_is(m: &LinkMessage, kind: &InfoKind) -> bool {
    m.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(k) if k == kind)),
        _ => false,
    })
}

/// The id the current namespace knows the namespace of `ns` by (RTM_GETNSID), if it has
/// one. Listing a link whose peer is there assigns one, so ask after such a listing.
async fn nsid_of(h: &mut Handle, ns: &File) -> Result<Option<i32>, NetError> {
    let mut msg = NsidMessage::default();
    // The kernel reads the descriptor while it handles the request, which this call
    // awaits; `ns` outlives it.
    msg.attributes = vec![NsidAttribute::Fd(
        u32::try_from(ns.as_raw_fd()).map_err(|_| NetError::Netlink("bad fd".into()))?,
    )];
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetNsId(msg));
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
    let mut answers = h
        .request(req)
        .map_err(|e| NetError::Netlink(format!("RTM_GETNSID: {e}")))?;
    while let Some(m) = answers.next().await {
        match m.payload {
            NetlinkPayload::Error(e) if e.code.is_some() => {
                return Err(NetError::Netlink(format!("RTM_GETNSID: {e}")));
            }
            NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNsId(m)) => {
                return Ok(m.attributes.iter().find_map(|a| match a {
                    NsidAttribute::Id(id) if *id >= 0 => Some(*id),
                    _ => None,
                }));
            }
            _ => {}
        }
    }
    Ok(None)
}

/// Finds the host side of a pod's veth: `ifname` inside the pod's network namespace
/// `netns` must be a veth, and its peer must be a veth in this (the host's) namespace
/// whose own peer is that interface *in that namespace*. The match is by link index and
/// namespace id, never by name: names are chosen by CNI plugins and can be anything.
pub fn pod_host_veth(netns: &File, ifname: &str) -> Result<HostIface, NetError> {
    let ns = netns
        .try_clone()
        .map_err(|e| NetError::Netlink(format!("dup the namespace fd: {e}")))?;
    let name = ifname.to_owned();
    let (pod_index, peer) = with_netlink(Some(ns), move |h| {
        Box::pin(async move {
            let m = link_by_name(&h, &name)
                .await?
                .ok_or_else(|| NetError::NotFound(format!("interface {name} in the pod")))?;
            if !is_veth(&m) {
                return Err(NetError::NotVeth(format!("{name} in the pod")));
            }
            let peer = peer_of(&m)
                .ok_or_else(|| NetError::NotVeth(format!("{name} in the pod has no peer")))?;
            Ok((m.header.index, peer))
        })
    })?;
    let ns = netns
        .try_clone()
        .map_err(|e| NetError::Netlink(format!("dup the namespace fd: {e}")))?;
    with_netlink(None, move |mut h| {
        Box::pin(async move {
            let m = link_by_index(&h, peer).await?.ok_or_else(|| {
                NetError::NotFound(format!("the pod veth's peer #{peer} on the host"))
            })?;
            if !is_veth(&m) {
                return Err(NetError::NotVeth(format!("host link #{peer}")));
            }
            let name =
                name_of(&m).ok_or_else(|| NetError::NotFound(format!("name of link #{peer}")))?;
            let nsid = nsid_of(&mut h, &ns).await?;
            if peer_of(&m) != Some(pod_index) || nsid.is_none() || link_netnsid(&m) != nsid {
                // Index #peer on the host is some other link: the pod's peer lives in a
                // third namespace (the pod is not wired to this host's stack directly).
                return Err(NetError::NotVeth(format!(
                    "host link {name} (#{peer}) is not the peer of the pod's interface"
                )));
            }
            Ok(HostIface { index: peer, name })
        })
    })
}

/// Calls `on_change` for every link added, changed or removed in the host's network
/// namespace (RTNLGRP_LINK), from a thread of its own, until the process ends: a pod's
/// veth appearing is one of the signals pod discovery waits for.
pub fn watch_links(
    on_change: impl Fn() + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, NetError> {
    let (tx, rx) = std::sync::mpsc::channel::<Result<(), NetError>>();
    let h = std::thread::Builder::new()
        .name("shareguard-linkwatch".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(NetError::Netlink(format!("runtime: {e}"))));
                    return;
                }
            };
            rt.block_on(async move {
                let (conn, _handle, mut events) =
                    match rtnetlink::new_multicast_connection(&[MulticastGroup::Link]) {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = tx.send(Err(NetError::Netlink(format!("link events: {e}"))));
                            return;
                        }
                    };
                let _ = tx.send(Ok(()));
                tokio::spawn(conn);
                while events.next().await.is_some() {
                    on_change();
                }
            });
        })
        .map_err(|e| NetError::Netlink(format!("cannot start the link watcher: {e}")))?;
    match rx.recv() {
        Ok(Ok(())) => Ok(h),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(NetError::Netlink("the link watcher ended at start".into())),
    }
}

/// The current index of the link called `name`, if it exists.
pub fn index_of(name: &str) -> Result<Option<u32>, NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move { Ok(link_by_name(&h, &name).await?.map(|m| m.header.index)) })
    })
}

/// Packets an interface received and sent, as its own counters say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkPackets {
    pub rx: u64,
    pub tx: u64,
}

/// The packet counters of link `index` (IFLA_STATS64), if it exists.
pub fn link_packets(index: u32) -> Result<Option<LinkPackets>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            Ok(link_by_index(&h, index)
                .await?
                .as_ref()
                .and_then(packets_of))
        })
    })
}

fn packets_of(m: &LinkMessage) -> Option<LinkPackets> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Stats64(s) => Some(LinkPackets {
            rx: s.rx_packets,
            tx: s.tx_packets,
        }),
        _ => None,
    })
}

/// The packet counters of the peer of veth `index` (the pod's end, in the pod's
/// namespace), read from this namespace by the id it knows the peer's namespace by
/// (IFLA_TARGET_NETNSID); `None` when `index` is gone, not a veth with a peer in another
/// namespace, or the peer cannot be read.
pub fn peer_packets(index: u32) -> Result<Option<LinkPackets>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            let Some(host) = link_by_index(&h, index).await? else {
                return Ok(None);
            };
            let (Some(peer), Some(nsid)) = (peer_of(&host), link_netnsid(&host)) else {
                return Ok(None);
            };
            let mut req = h.link().get().match_index(peer);
            req.message_mut()
                .attributes
                .push(LinkAttribute::IfNetnsId(nsid));
            Ok(first_link(req, format!("the peer of link #{index}"))
                .await?
                .as_ref()
                .and_then(packets_of))
        })
    })
}

/// The name of link `index`, if it exists.
pub fn name_of_index(index: u32) -> Result<Option<String>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move { Ok(link_by_index(&h, index).await?.as_ref().and_then(name_of)) })
    })
}

/// The alias shareguard gives the queue device it creates for `share_key`: an existing
/// link is only ever adopted as a share's queue device when it carries exactly this.
pub fn queue_alias(share_key: &str) -> String {
    format!("shareguard queue of share {share_key}")
}

/// The alias of the ifb an earlier version made for `share_key` where the queue device
/// is now: still recognised, so that an upgraded agent removes it.
fn legacy_ifb_alias(share_key: &str) -> String {
    format!("shareguard ifb of share {share_key}")
}

/// The device group shareguard creates its queue devices in. A group is set in the same
/// message that creates the link (an alias is not: the kernel takes it only afterwards),
/// so a link in this group was made by shareguard even when a crash fell between creating
/// it and naming it.
pub const QUEUE_GROUP: u32 = 0x5347;

fn group_of(m: &LinkMessage) -> Option<u32> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Group(g) => Some(*g),
        _ => None,
    })
}

/// Whether `m` is a device of a kind shareguard makes in its group: a veth of a queue
/// pair, or an ifb an earlier version made.
fn is_our_kind(m: &LinkMessage) -> bool {
    (kind_is(m, &InfoKind::Veth) || kind_is(m, &InfoKind::Ifb)) && group_of(m) == Some(QUEUE_GROUP)
}

/// Whether `m` is the queue device shareguard made for the share with alias `alias`
/// (or an earlier version's ifb for it): ours by kind and group, with that alias or none
/// yet.
fn is_our_queue(m: &LinkMessage, share_key: &str) -> bool {
    is_our_kind(m)
        && alias_of(m)
            .is_none_or(|a| a == queue_alias(share_key) || a == legacy_ifb_alias(share_key))
}

/// Creates the queue pair of `share_key` if it does not exist: a veth pair in the host's
/// namespace, `name` (traffic from the pod is redirected to its egress, where the
/// share's qdisc queues it) and `peer` (where the released packets arrive and the return
/// program sends them back to the pod's host veth). Both are set up; returns their
/// indexes. A link of either name that shareguard did not make for this share (another
/// kind, another group or alias) is refused, never taken over.
pub fn ensure_queue_pair(name: &str, peer: &str, share_key: &str) -> Result<(u32, u32), NetError> {
    let (name, peer) = (name.to_owned(), peer.to_owned());
    let alias = queue_alias(share_key);
    let key = share_key.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move {
            let found = link_by_name(&h, &name).await?;
            let found_peer = link_by_name(&h, &peer).await?;
            for m in [&found, &found_peer].into_iter().flatten() {
                if !is_our_queue(m, &key) {
                    let n = name_of(m).unwrap_or_default();
                    return Err(NetError::Conflict(format!(
                        "link {n} exists and is not the queue device shareguard made for this share: it is left alone"
                    )));
                }
            }
            let veth =
                |m: &Option<LinkMessage>| m.as_ref().is_some_and(|m| kind_is(m, &InfoKind::Veth));
            if !(veth(&found) && veth(&found_peer)) {
                // Not a whole pair: what another attempt left, or the ifb an earlier
                // version queued on. It goes, and the pair is made afresh.
                for m in [&found, &found_peer].into_iter().flatten() {
                    match h.link().del(m.header.index).execute().await {
                        Ok(()) => {}
                        Err(e) => match nl_err("delete a stale queue device", e) {
                            NetError::NotFound(_) => {}
                            e => return Err(e),
                        },
                    }
                }
                let peer_msg = LinkUnspec::new_with_name(&peer)
                    .link_group(QUEUE_GROUP)
                    .build();
                h.link()
                    .add(
                        LinkVeth::new(&name, &peer)
                            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer_msg)))
                            .link_group(QUEUE_GROUP)
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(|e| nl_err(&format!("create veth pair {name} / {peer}"), e))?;
            }
            let mut out = [0u32; 2];
            for (slot, n) in out.iter_mut().zip([&name, &peer]) {
                let index = link_by_name(&h, n)
                    .await?
                    .ok_or_else(|| NetError::NotFound(format!("{n} after creating it")))?
                    .header
                    .index;
                h.link()
                    .set(
                        LinkUnspec::new_with_index(index)
                            .up()
                            .alias(alias.clone())
                            .build(),
                    )
                    .execute()
                    .await
                    .map_err(|e| nl_err(&format!("set {n} up"), e))?;
                *slot = index;
            }
            Ok((out[0], out[1]))
        })
    })
}

/// Every device in shareguard's group ([`QUEUE_GROUP`]): (name, alias). What a crash left
/// between making a queue pair and recording it is among them.
pub fn our_queues() -> Result<Vec<(String, Option<String>)>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            let mut dump = h.link().get().execute();
            let mut out = Vec::new();
            loop {
                match dump.try_next().await {
                    Ok(Some(m)) => {
                        if is_our_kind(&m)
                            && let Some(name) = name_of(&m)
                        {
                            out.push((name, alias_of(&m).map(str::to_owned)));
                        }
                    }
                    Ok(None) => return Ok(out),
                    Err(e) => return Err(nl_err("listing links", e)),
                }
            }
        })
    })
}

/// Deletes link `name` if it is a device of shareguard's group (whatever its alias);
/// succeeds if it does not exist.
pub fn delete_our_queue(name: &str) -> Result<(), NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move {
            let Some(m) = link_by_name(&h, &name).await? else {
                return Ok(());
            };
            if !is_our_kind(&m) {
                return Err(NetError::Conflict(format!(
                    "link {name} is not a device shareguard made; left alone"
                )));
            }
            match h.link().del(m.header.index).execute().await {
                Ok(()) => Ok(()),
                Err(e) => match nl_err(&format!("delete {name}"), e) {
                    NetError::NotFound(_) => Ok(()),
                    e => Err(e),
                },
            }
        })
    })
}

/// Deletes the queue device `name` shareguard made for `share_key` (see
/// [`ensure_queue_pair`]; its peer goes with it), or an earlier version's ifb of that
/// name; succeeds if it does not exist, and leaves a link of that name that is not ours
/// alone.
pub fn delete_queue(name: &str, share_key: &str) -> Result<(), NetError> {
    delete_link_if(name, Some(share_key.to_owned()))
}

/// Deletes link `name`; succeeds if it does not exist.
pub fn delete_link(name: &str) -> Result<(), NetError> {
    delete_link_if(name, None)
}

/// Deletes link `name` (only when it is the queue device of `share_key`, if one is
/// given).
fn delete_link_if(name: &str, share_key: Option<String>) -> Result<(), NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move {
            if let Some(m) = link_by_name(&h, &name).await? {
                if let Some(key) = &share_key
                    && !is_our_queue(&m, key)
                {
                    tracing::warn!(link = %name, "a link with the share's queue device name is not ours; left alone");
                    return Ok(());
                }
                match h.link().del(m.header.index).execute().await {
                    Ok(()) => {}
                    Err(e) => {
                        let e = nl_err(&format!("delete {name}"), e);
                        if !matches!(e, NetError::NotFound(_)) {
                            return Err(e);
                        }
                    }
                }
            }
            Ok(())
        })
    })
}

/// `ifindex`'s root qdisc as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootQdisc {
    pub kind: String,
    pub major: u16,
    /// Packets it dropped (children included: HTB counts its leaves' drops).
    pub drops: u64,
    /// Packets it holds now (HTB: the whole tree).
    pub qlen: u64,
}

/// The root qdisc of `ifindex`, if the kernel reports one.
///
/// Asked for by itself (RTM_GETQDISC for the root, not a dump): the kernel's qdisc dump
/// ignores the interface it is given and returns every qdisc of every interface, so a
/// read per share cost the square of the number of shares (with 100 shares, two
/// hundred dumps of some 4,000 qdiscs on every counters period).
pub fn root_qdisc(ifindex: u32) -> Result<Option<RootQdisc>, NetError> {
    with_netlink(None, move |mut h| {
        Box::pin(async move {
            let what = || format!("RTM_GETQDISC root of #{ifindex}");
            let index = i32::try_from(ifindex)
                .map_err(|_| NetError::NotFound(format!("link #{ifindex}")))?;
            let mut msg = TcMessage::default();
            msg.header.index = index;
            msg.header.parent = TcHandle::ROOT;
            let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetQueueDiscipline(msg));
            // The kernel answers a single qdisc's request as a notification: to the TC
            // multicast group, and to the asker only with NLM_F_ECHO. The group's
            // listeners (`tc monitor`) therefore see each read as an unchanged qdisc,
            // which is the price of not walking every interface's qdiscs.
            req.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_ECHO;
            let mut answers = h
                .request(req)
                .map_err(|e| NetError::Netlink(format!("{}: {e}", what())))?;
            let mut root = None;
            while let Some(m) = answers.next().await {
                match m.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewQueueDiscipline(m))
                        if m.header.index == index =>
                    {
                        root = root_of(&m);
                    }
                    NetlinkPayload::Error(e) => match e.raw_code() {
                        0 => {}
                        // No such interface, no root, or the kernel's built-in one (which
                        // it does not report): no root qdisc, as a dump would show.
                        c if [Errno::ENODEV, Errno::ENOENT, Errno::EINVAL]
                            .iter()
                            .any(|n| c == -(*n as i32)) =>
                        {
                            return Ok(None);
                        }
                        _ => return Err(NetError::Netlink(format!("{}: {e}", what()))),
                    },
                    _ => {}
                }
            }
            Ok(root)
        })
    })
}

/// `m` as a root qdisc, if it says its kind.
fn root_of(m: &TcMessage) -> Option<RootQdisc> {
    let kind = m.attributes.iter().find_map(|a| match a {
        TcAttribute::Kind(k) => Some(k.clone()),
        _ => None,
    })?;
    let (drops, qlen) = m
        .attributes
        .iter()
        .find_map(|a| match a {
            TcAttribute::Stats(st) => Some((u64::from(st.drops), u64::from(st.qlen))),
            _ => None,
        })
        .unwrap_or((0, 0));
    Some(RootQdisc {
        kind,
        major: m.header.handle.major,
        drops,
        qlen,
    })
}

/// TCA_HTB_PARMS, TCA_HTB_RATE64 (linux/pkt_sched.h).
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_RATE64: u16 = 6;

/// One HTB class as the kernel has it, in bytes per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HtbClass {
    /// The parent's minor (the major is the qdisc's).
    pub parent_minor: u16,
    pub rate: u64,
    pub ceil: u64,
    /// What the class may send at once on its own tokens (its `burst`), in bytes: the
    /// kernel keeps it as the time that takes at `rate`.
    pub burst: u64,
}

/// Every HTB class of qdisc `major:` on `ifindex`, by minor, in one dump.
pub fn htb_classes(
    ifindex: u32,
    major: u16,
) -> Result<std::collections::BTreeMap<u16, HtbClass>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            let mut out = std::collections::BTreeMap::new();
            for (m, options) in htb_dump(&h, ifindex, major).await? {
                if let Some(c) = parse_htb(&options, m.header.parent.minor) {
                    out.insert(m.header.handle.minor, c);
                }
            }
            Ok(out)
        })
    })
}

/// Every HTB class of qdisc `major:` on `ifindex` as the kernel sent it, with its
/// options ([`htb_options`]), in one dump.
async fn htb_dump(
    h: &Handle,
    ifindex: u32,
    major: u16,
) -> Result<Vec<(TcMessage, Vec<u8>)>, NetError> {
    let index =
        i32::try_from(ifindex).map_err(|_| NetError::NotFound(format!("link #{ifindex}")))?;
    let mut out = Vec::new();
    let mut s = h.clone().traffic_class(index).get().execute();
    while let Some(m) = s
        .try_next()
        .await
        .map_err(|e| nl_err(&format!("classes of #{ifindex}"), e))?
    {
        let htb = m
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(k) if k == "htb"));
        if m.header.handle.major == major
            && htb
            && let Some(options) = htb_options(&m)
        {
            out.push((m, options));
        }
    }
    Ok(out)
}

/// HTB's own attributes of a class message, each with its header, as the kernel sent
/// them: the options arrive as one attribute whose value holds them.
fn htb_options(m: &TcMessage) -> Option<Vec<u8>> {
    m.attributes.iter().find_map(|a| match a {
        TcAttribute::Options(opts) => opts.iter().find_map(|o| match o {
            TcOption::Other(nla) => {
                let mut value = vec![0u8; netlink_value_len(nla)];
                emit_value(nla, &mut value);
                Some(value)
            }
            _ => None,
        }),
        _ => None,
    })
}

/// Sets the burst and cburst of HTB class `major:minor` on `ifindex` to `bytes` each,
/// leaving everything else of it as the kernel has it: its options are read, the two
/// buffers patched and written back (RTM_NEWTCLASS without NLM_F_CREATE changes the
/// class in place). HTB keeps the tokens a class holds, so a smaller bucket takes effect
/// at the class's next packet, and a larger one only fills as the class leaves its rate
/// unused. One netlink round trip each way, where `tc` costs a process.
pub fn set_htb_burst(ifindex: u32, major: u16, minor: u16, bytes: u64) -> Result<(), NetError> {
    with_netlink(None, move |mut h| {
        Box::pin(async move {
            let what = || format!("HTB class {major:x}:{minor:x} on #{ifindex}");
            let (class, options) = htb_dump(&h, ifindex, major)
                .await?
                .into_iter()
                .find(|(m, _)| m.header.handle.minor == minor)
                .ok_or_else(|| NetError::NotFound(what()))?;
            let nlas = patch_htb_buffers(&options, bytes)
                .ok_or_else(|| NetError::Netlink(format!("{}: options not understood", what())))?;
            let mut msg = TcMessage::default();
            // The class as dumped (interface, handle, parent); tcm_info names a leaf's
            // qdisc in a dump and means nothing in a change.
            msg.header = TcHeader {
                info: 0,
                ..class.header
            };
            msg.attributes = vec![
                TcAttribute::Kind("htb".into()),
                TcAttribute::Options(
                    nlas.into_iter()
                        .map(|(kind, value)| {
                            TcOption::Other(rtnetlink::packet_core::DefaultNla::new(kind, value))
                        })
                        .collect(),
                ),
            ];
            let mut req = NetlinkMessage::from(RouteNetlinkMessage::NewTrafficClass(msg));
            req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
            let mut answers = h
                .request(req)
                .map_err(|e| NetError::Netlink(format!("RTM_NEWTCLASS {}: {e}", what())))?;
            while let Some(m) = answers.next().await {
                if let NetlinkPayload::Error(e) = m.payload
                    && e.code.is_some()
                {
                    return Err(NetError::Netlink(format!("RTM_NEWTCLASS {}: {e}", what())));
                }
            }
            Ok(())
        })
    })
}

/// HTB's attributes from `options` (as [`htb_options`] returns them) with the buffer and
/// cbuffer of TCA_HTB_PARMS set to the time `bytes` take at the class's rate and ceil, as
/// (kind, value) pairs; None when TCA_HTB_PARMS is missing or short.
fn patch_htb_buffers(options: &[u8], bytes: u64) -> Option<Vec<(u16, Vec<u8>)>> {
    let mut nlas: Vec<(u16, Vec<u8>)> = attributes(options)
        .into_iter()
        .map(|(kind, value)| (kind, value.to_vec()))
        .collect();
    let class = parse_htb(options, 0)?;
    let parms = nlas
        .iter_mut()
        .find(|(kind, v)| *kind == TCA_HTB_PARMS && v.len() >= 32)?;
    let buffer = ticks_for_bytes(class.rate, bytes);
    let cbuffer = ticks_for_bytes(class.ceil, bytes);
    parms.1[24..28].copy_from_slice(&buffer.to_ne_bytes());
    parms.1[28..32].copy_from_slice(&cbuffer.to_ne_bytes());
    Some(nlas)
}

/// The netlink attributes in `buf` (each a header of length and kind, then the value,
/// padded to 4 bytes) as (kind, value); stops at the first that does not fit.
fn attributes(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while off + 4 <= buf.len() {
        let len = usize::from(u16::from_ne_bytes([buf[off], buf[off + 1]]));
        let kind = u16::from_ne_bytes([buf[off + 2], buf[off + 3]]) & 0x3fff;
        if len < 4 || off + len > buf.len() {
            break;
        }
        out.push((kind, &buf[off + 4..off + len]));
        off += (len + 3) & !3;
    }
    out
}

/// Scheduler ticks that `bytes` take at `rate` bytes/s, rounded down as tc rounds them;
/// saturates at `u32::MAX`, and a zero rate (which HTB refuses anyway) gives the most.
fn ticks_for_bytes(rate: u64, bytes: u64) -> u32 {
    if rate == 0 {
        return u32::MAX;
    }
    let ticks = u128::from(bytes) * 1_000_000_000 / (u128::from(rate) * PSCHED_TICK_NS);
    u32::try_from(ticks).unwrap_or(u32::MAX)
}

fn netlink_value_len(nla: &rtnetlink::packet_core::DefaultNla) -> usize {
    use rtnetlink::packet_core::Nla;
    nla.value_len()
}

fn emit_value(nla: &rtnetlink::packet_core::DefaultNla, buf: &mut [u8]) {
    use rtnetlink::packet_core::Nla;
    nla.emit_value(buf);
}

/// TCA_HTB_CEIL64 (linux/pkt_sched.h).
const TCA_HTB_CEIL64: u16 = 7;

/// Nanoseconds per packet scheduler tick (`PSCHED_SHIFT` in net/pkt_sched.h).
const PSCHED_TICK_NS: u128 = 1 << 6;

/// Bytes that `ticks` scheduler ticks carry at `rate` bytes/s: how the kernel keeps an
/// HTB burst (as the time it takes), and how far tc's rounding of it to whole ticks can
/// move it. At most 2^32 ticks of 2^64 bytes/s over 10^9 fits after the division, but
/// for rates no link has; saturates rather than wrap.
pub fn bytes_in_ticks(rate: u64, ticks: u32) -> u64 {
    let ns = u128::from(ticks) * PSCHED_TICK_NS;
    u64::try_from(u128::from(rate) * ns / 1_000_000_000).unwrap_or(u64::MAX)
}

/// One class (below parent `parent_minor`) from its HTB options (each attribute with its
/// header): the 32-bit values in TCA_HTB_PARMS (`struct tc_htb_opt`: the rate's
/// `tc_ratespec`, whose `rate` is at byte 8, then the ceil's, at byte 20, then `buffer`,
/// the burst in scheduler ticks, at byte 24), the rates overridden by TCA_HTB_RATE64 and
/// TCA_HTB_CEIL64 when they do not fit in 32 bits.
pub fn parse_htb(buf: &[u8], parent_minor: u16) -> Option<HtbClass> {
    let (mut rate32, mut ceil32, mut rate64, mut ceil64) = (None, None, None, None);
    let mut buffer_ticks: Option<u32> = None;
    let u32_at =
        |v: &[u8], i: usize| u64::from(u32::from_ne_bytes([v[i], v[i + 1], v[i + 2], v[i + 3]]));
    for (kind, value) in attributes(buf) {
        let u64_of = |v: &[u8]| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&v[..8]);
            u64::from_ne_bytes(b)
        };
        match kind {
            TCA_HTB_PARMS if value.len() >= 24 => {
                rate32 = Some(u32_at(value, 8));
                ceil32 = Some(u32_at(value, 20));
                if value.len() >= 28 {
                    buffer_ticks = u32::try_from(u32_at(value, 24)).ok();
                }
            }
            TCA_HTB_RATE64 if value.len() >= 8 => rate64 = Some(u64_of(value)),
            TCA_HTB_CEIL64 if value.len() >= 8 => ceil64 = Some(u64_of(value)),
            _ => {}
        }
    }
    let rate = rate64.or(rate32)?;
    Some(HtbClass {
        parent_minor,
        rate,
        ceil: ceil64.or(ceil32)?,
        burst: bytes_in_ticks(rate, buffer_ticks?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
        let len = u16::try_from(4 + value.len()).unwrap();
        let mut v = Vec::new();
        v.extend_from_slice(&len.to_ne_bytes());
        v.extend_from_slice(&kind.to_ne_bytes());
        v.extend_from_slice(value);
        while v.len() % 4 != 0 {
            v.push(0);
        }
        v
    }

    fn rates(buf: &[u8]) -> Option<(u64, u64)> {
        parse_htb(buf, 0x100).map(|c| (c.rate, c.ceil))
    }

    #[test]
    fn htb_rate_and_ceil_from_parms_and_the_64_bit_attributes() {
        let mut parms = vec![0u8; 44];
        parms[8..12].copy_from_slice(&390_625u32.to_ne_bytes());
        parms[20..24].copy_from_slice(&6_250_000u32.to_ne_bytes());
        assert_eq!(
            rates(&nla(TCA_HTB_PARMS, &parms)),
            Some((390_625, 6_250_000))
        );
        let mut all = nla(TCA_HTB_PARMS, &parms);
        all.extend(nla(TCA_HTB_CEIL64, &5_000_000_000u64.to_ne_bytes()));
        assert_eq!(rates(&all), Some((390_625, 5_000_000_000)));
        assert_eq!(rates(&[]), None);
    }

    #[test]
    fn htb_burst_is_the_buffer_time_at_the_rate() {
        // tc's `rate 2000000000bit burst 2500000b`: 10 ms, 156250 ticks of 64 ns.
        let mut parms = vec![0u8; 44];
        parms[8..12].copy_from_slice(&250_000_000u32.to_ne_bytes());
        parms[20..24].copy_from_slice(&250_000_000u32.to_ne_bytes());
        parms[24..28].copy_from_slice(&156_250u32.to_ne_bytes());
        let c = parse_htb(&nla(TCA_HTB_PARMS, &parms), 0x100).unwrap();
        assert_eq!((c.parent_minor, c.burst), (0x100, 2_500_000));
        parms[24..28].copy_from_slice(&u32::MAX.to_ne_bytes());
        let mut big = nla(TCA_HTB_PARMS, &parms);
        big.extend(nla(TCA_HTB_RATE64, &u64::MAX.to_ne_bytes()));
        assert_eq!(parse_htb(&big, 0).unwrap().burst, u64::MAX, "saturates");
    }

    #[test]
    fn patched_buffers_hold_the_bytes_at_rate_and_ceil_and_nothing_else_moves() {
        let mut parms = vec![0u8; 44];
        parms[8..12].copy_from_slice(&250_000_000u32.to_ne_bytes());
        parms[20..24].copy_from_slice(&250_000_000u32.to_ne_bytes());
        parms[24..28].copy_from_slice(&156_250u32.to_ne_bytes());
        parms[28..32].copy_from_slice(&156_250u32.to_ne_bytes());
        parms[32..36].copy_from_slice(&65_536u32.to_ne_bytes());
        let mut opts = nla(TCA_HTB_PARMS, &parms);
        opts.extend(nla(TCA_HTB_CEIL64, &5_000_000_000u64.to_ne_bytes()));
        let out = patch_htb_buffers(&opts, 16_384).unwrap();
        assert_eq!(out.len(), 2);
        let p = &out[0].1;
        let at = |i: usize| u32::from_ne_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
        // 16 KiB at 250 MB/s is 65,536 ns, 1024 ticks; at the 5 GB/s ceil 51 ticks.
        assert_eq!((at(24), at(28)), (1024, 51));
        assert_eq!(&p[..24], &parms[..24]);
        assert_eq!(&p[32..], &parms[32..], "quantum and the rest as they were");
        assert_eq!(
            out[1],
            (TCA_HTB_CEIL64, 5_000_000_000u64.to_ne_bytes().to_vec())
        );
        // Round trip through the read-back's decoding, within a tick.
        let back = parse_htb(&nla(TCA_HTB_PARMS, p), 0).unwrap();
        assert!(back.burst <= 16_384 && 16_384 - back.burst <= bytes_in_ticks(back.rate, 1));
        assert_eq!(patch_htb_buffers(&nla(TCA_HTB_RATE64, &[0; 8]), 1), None);
        assert_eq!(ticks_for_bytes(0, 1), u32::MAX);
        assert_eq!(ticks_for_bytes(1, u64::MAX), u32::MAX);
    }

    #[test]
    fn htb_rate_64_overrides_the_32_bit_one() {
        let mut parms = vec![0u8; 44];
        parms[8..12].copy_from_slice(&6_250_000u32.to_ne_bytes());
        let mut both = nla(TCA_HTB_PARMS, &parms);
        both.extend(nla(TCA_HTB_RATE64, &5_000_000_000u64.to_ne_bytes()));
        assert_eq!(rates(&both).map(|(r, _)| r), Some(5_000_000_000));
        assert_eq!(
            rates(&[1, 0, 0, 0]),
            None,
            "a length below the header is not trusted"
        );
    }
}
