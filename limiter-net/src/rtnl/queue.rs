//! shareguard's queue devices (veth pairs in its device group, named after their
//! share): made, found, and deleted only when they are shareguard's.

use super::*;

/// The alias shareguard gives the queue device it creates for `share_key`: an existing
/// link is only ever adopted as a share's queue device when it carries exactly this.
pub fn queue_alias(share_key: &str) -> String {
    format!("shareguard queue of share {share_key}")
}

/// The alias of the ifb an earlier version made for `share_key` where the queue device
/// is now: still recognised, so that an upgraded agent removes it.
pub(super) fn legacy_ifb_alias(share_key: &str) -> String {
    format!("shareguard ifb of share {share_key}")
}

/// The device group shareguard creates its queue devices in. A group is set in the same
/// message that creates the link (an alias is not: the kernel takes it only afterwards),
/// so a link in this group was made by shareguard even when a crash fell between creating
/// it and naming it.
pub const QUEUE_GROUP: u32 = 0x5347;

pub(super) fn group_of(m: &LinkMessage) -> Option<u32> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Group(g) => Some(*g),
        _ => None,
    })
}

/// Whether `m` is a device of a kind shareguard makes in its group: a veth of a queue
/// pair, or an ifb an earlier version made.
pub(super) fn is_our_kind(m: &LinkMessage) -> bool {
    (kind_is(m, &InfoKind::Veth) || kind_is(m, &InfoKind::Ifb)) && group_of(m) == Some(QUEUE_GROUP)
}

/// Whether `m` is the queue device shareguard made for the share with alias `alias`
/// (or an earlier version's ifb for it): ours by kind and group, with that alias or none
/// yet.
pub(super) fn is_our_queue(m: &LinkMessage, share_key: &str) -> bool {
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
pub(super) fn delete_link_if(name: &str, share_key: Option<String>) -> Result<(), NetError> {
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
