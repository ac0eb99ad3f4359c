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

mod queue;
mod tc;

pub use queue::*;
pub use tc::*;
