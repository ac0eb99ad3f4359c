//! Netlink reads and writes of links and traffic-control classes, through rtnetlink.
//!
//! Every call runs on a fresh OS thread with its own single-threaded runtime: resolving a
//! pod's interface means entering the pod's network namespace with `setns`, which
//! changes the calling thread for good, so it must never happen on a thread anybody
//! else (a tokio worker, the blocking pool) will run code on afterwards. The thread ends
//! when the call does, and the namespace with it.

use std::{fs::File, future::Future, path::PathBuf, pin::Pin};

use futures::TryStreamExt;
use rtnetlink::{
    Handle, LinkGetRequest, LinkIfb, LinkUnspec,
    packet_route::{
        link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
        tc::{TcAttribute, TcOption},
    },
};

use crate::error::NetError;

/// The host side of a pod's interface (or a host interface named directly).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostIface {
    pub index: u32,
    pub name: String,
}

type NlFuture<T> = Pin<Box<dyn Future<Output = Result<T, NetError>> + Send>>;

/// Runs `f` with a netlink handle on a new thread, inside the network namespace at
/// `netns` when one is given.
fn with_netlink<T, F>(netns: Option<PathBuf>, f: F) -> Result<T, NetError>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> NlFuture<T> + Send + 'static,
{
    let worker = std::thread::Builder::new()
        .name("shareguard-netlink".into())
        .spawn(move || {
            if let Some(path) = &netns {
                let ns = File::open(path).map_err(|e| NetError::Netns {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                    NetError::Netns {
                        path: path.display().to_string(),
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

/// Finds the host-side interface of a pod: the veth peer of `ifname` inside the pod's
/// network namespace, or, without a namespace, the host interface `ifname` itself.
pub fn resolve(netns: Option<&str>, ifname: &str) -> Result<HostIface, NetError> {
    let Some(ns) = netns else {
        let name = ifname.to_owned();
        return with_netlink(None, move |h| {
            Box::pin(async move {
                let m = link_by_name(&h, &name)
                    .await?
                    .ok_or_else(|| NetError::NotFound(format!("host interface {name}")))?;
                Ok(HostIface {
                    index: m.header.index,
                    name,
                })
            })
        });
    };
    if !std::path::Path::new(ns).exists() {
        return Err(NetError::NotFound(format!("network namespace {ns}")));
    }
    let name = ifname.to_owned();
    let ns_owned = ns.to_owned();
    let peer = with_netlink(Some(PathBuf::from(ns)), move |h| {
        Box::pin(async move {
            let m = link_by_name(&h, &name)
                .await?
                .ok_or_else(|| NetError::NotFound(format!("interface {name} in {ns_owned}")))?;
            if !is_veth(&m) {
                return Err(NetError::NotVeth(format!("{name} in {ns_owned}")));
            }
            peer_of(&m)
                .ok_or_else(|| NetError::NotVeth(format!("{name} in {ns_owned} has no peer")))
        })
    })?;
    with_netlink(None, move |h| {
        Box::pin(async move {
            let m = link_by_index(&h, peer)
                .await?
                .ok_or_else(|| NetError::NotFound(format!("host-side peer #{peer}")))?;
            if !is_veth(&m) {
                return Err(NetError::NotVeth(format!("host-side peer #{peer}")));
            }
            let name =
                name_of(&m).ok_or_else(|| NetError::NotFound(format!("name of link #{peer}")))?;
            Ok(HostIface { index: peer, name })
        })
    })
}

/// The current index of the link called `name`, if it exists.
pub fn index_of(name: &str) -> Result<Option<u32>, NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move { Ok(link_by_name(&h, &name).await?.map(|m| m.header.index)) })
    })
}

/// The name of link `index`, if it exists.
pub fn name_of_index(index: u32) -> Result<Option<String>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move { Ok(link_by_index(&h, index).await?.as_ref().and_then(name_of)) })
    })
}

/// Creates the ifb device `name` if it does not exist, sets it up, returns its index.
pub fn ensure_ifb(name: &str) -> Result<u32, NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move {
            let index = match link_by_name(&h, &name).await? {
                Some(m) => m.header.index,
                None => {
                    h.link()
                        .add(LinkIfb::new(&name).build())
                        .execute()
                        .await
                        .map_err(|e| nl_err(&format!("create ifb {name}"), e))?;
                    link_by_name(&h, &name)
                        .await?
                        .ok_or_else(|| NetError::NotFound(format!("ifb {name} after creating it")))?
                        .header
                        .index
                }
            };
            h.link()
                .set(LinkUnspec::new_with_index(index).up().build())
                .execute()
                .await
                .map_err(|e| nl_err(&format!("set {name} up"), e))?;
            Ok(index)
        })
    })
}

/// Deletes link `name`; succeeds if it does not exist.
pub fn delete_link(name: &str) -> Result<(), NetError> {
    let name = name.to_owned();
    with_netlink(None, move |h| {
        Box::pin(async move {
            if let Some(m) = link_by_name(&h, &name).await? {
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
}

/// The root qdisc of `ifindex`, if the kernel reports one.
pub fn root_qdisc(ifindex: u32) -> Result<Option<RootQdisc>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            let index = i32::try_from(ifindex)
                .map_err(|_| NetError::NotFound(format!("link #{ifindex}")))?;
            let mut s = h.qdisc().get().index(index).execute();
            while let Some(m) = s
                .try_next()
                .await
                .map_err(|e| nl_err(&format!("qdiscs of #{ifindex}"), e))?
            {
                // TC_H_ROOT is parent ffff:ffff.
                if m.header.index != index
                    || m.header.parent.major != 0xffff
                    || m.header.parent.minor != 0xffff
                {
                    continue;
                }
                let kind = m.attributes.iter().find_map(|a| match a {
                    TcAttribute::Kind(k) => Some(k.clone()),
                    _ => None,
                });
                let drops = m
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        TcAttribute::Stats(st) => Some(u64::from(st.drops)),
                        _ => None,
                    })
                    .unwrap_or(0);
                return Ok(kind.map(|kind| RootQdisc {
                    kind,
                    major: m.header.handle.major,
                    drops,
                }));
            }
            Ok(None)
        })
    })
}

/// TCA_HTB_PARMS, TCA_HTB_RATE64 (linux/pkt_sched.h).
const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_RATE64: u16 = 6;

/// Reads the rate of HTB class `major:minor` on `ifindex` back from the kernel, in bytes
/// per second, or None when there is no such HTB class.
pub fn htb_class_rate(ifindex: u32, major: u16, minor: u16) -> Result<Option<u64>, NetError> {
    with_netlink(None, move |h| {
        Box::pin(async move {
            let index = i32::try_from(ifindex)
                .map_err(|_| NetError::NotFound(format!("link #{ifindex}")))?;
            let mut s = h.traffic_class(index).get().execute();
            while let Some(m) = s
                .try_next()
                .await
                .map_err(|e| nl_err(&format!("classes of #{ifindex}"), e))?
            {
                if m.header.handle.major != major || m.header.handle.minor != minor {
                    continue;
                }
                let kind_is_htb = m
                    .attributes
                    .iter()
                    .any(|a| matches!(a, TcAttribute::Kind(k) if k == "htb"));
                if !kind_is_htb {
                    return Ok(None);
                }
                for a in &m.attributes {
                    if let TcAttribute::Options(opts) = a {
                        for o in opts {
                            if let TcOption::Other(nla) = o {
                                let mut value = vec![0u8; netlink_value_len(nla)];
                                emit_value(nla, &mut value);
                                return Ok(parse_htb_rate(&value));
                            }
                        }
                    }
                }
                return Ok(None);
            }
            Ok(None)
        })
    })
}

fn netlink_value_len(nla: &rtnetlink::packet_core::DefaultNla) -> usize {
    use rtnetlink::packet_core::Nla;
    nla.value_len()
}

fn emit_value(nla: &rtnetlink::packet_core::DefaultNla, buf: &mut [u8]) {
    use rtnetlink::packet_core::Nla;
    nla.emit_value(buf);
}

/// Parses the nested attributes of an HTB class's TCA_OPTIONS: the 32-bit rate inside
/// TCA_HTB_PARMS (struct tc_htb_opt starts with struct tc_ratespec, whose `rate` is at
/// byte 8), overridden by TCA_HTB_RATE64 when the rate does not fit in 32 bits.
pub fn parse_htb_rate(buf: &[u8]) -> Option<u64> {
    let mut rate32 = None;
    let mut rate64 = None;
    let mut off = 0usize;
    while off + 4 <= buf.len() {
        let len = usize::from(u16::from_ne_bytes([buf[off], buf[off + 1]]));
        let kind = u16::from_ne_bytes([buf[off + 2], buf[off + 3]]) & 0x3fff;
        if len < 4 || off + len > buf.len() {
            break;
        }
        let value = &buf[off + 4..off + len];
        match kind {
            TCA_HTB_PARMS if value.len() >= 12 => {
                rate32 = Some(u64::from(u32::from_ne_bytes([
                    value[8], value[9], value[10], value[11],
                ])));
            }
            TCA_HTB_RATE64 if value.len() >= 8 => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&value[..8]);
                rate64 = Some(u64::from_ne_bytes(b));
            }
            _ => {}
        }
        // Attributes are padded to 4 bytes.
        off += (len + 3) & !3;
    }
    rate64.or(rate32)
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

    #[test]
    fn htb_rate_from_parms_and_rate64() {
        let mut parms = vec![0u8; 44];
        parms[8..12].copy_from_slice(&6_250_000u32.to_ne_bytes());
        assert_eq!(parse_htb_rate(&nla(TCA_HTB_PARMS, &parms)), Some(6_250_000));
        let mut both = nla(TCA_HTB_PARMS, &parms);
        both.extend(nla(TCA_HTB_RATE64, &5_000_000_000u64.to_ne_bytes()));
        assert_eq!(parse_htb_rate(&both), Some(5_000_000_000));
        assert_eq!(parse_htb_rate(&[]), None);
        assert_eq!(
            parse_htb_rate(&[1, 0, 0, 0]),
            None,
            "a length below the header is not trusted"
        );
    }
}
