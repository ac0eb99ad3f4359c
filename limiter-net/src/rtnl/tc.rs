//! Traffic control through netlink: the root qdisc of a device, and HTB classes read,
//! parsed and their bursts set in place.

use super::*;

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
pub(super) fn root_of(m: &TcMessage) -> Option<RootQdisc> {
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
pub(super) const TCA_HTB_PARMS: u16 = 1;
pub(super) const TCA_HTB_RATE64: u16 = 6;

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
pub(super) fn htb_options(m: &TcMessage) -> Option<Vec<u8>> {
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
pub(super) fn patch_htb_buffers(options: &[u8], bytes: u64) -> Option<Vec<(u16, Vec<u8>)>> {
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
pub(super) fn attributes(buf: &[u8]) -> Vec<(u16, &[u8])> {
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
pub(super) fn ticks_for_bytes(rate: u64, bytes: u64) -> u32 {
    if rate == 0 {
        return u32::MAX;
    }
    let ticks = u128::from(bytes) * 1_000_000_000 / (u128::from(rate) * PSCHED_TICK_NS);
    u32::try_from(ticks).unwrap_or(u32::MAX)
}

pub(super) fn netlink_value_len(nla: &rtnetlink::packet_core::DefaultNla) -> usize {
    use rtnetlink::packet_core::Nla;
    nla.value_len()
}

pub(super) fn emit_value(nla: &rtnetlink::packet_core::DefaultNla, buf: &mut [u8]) {
    use rtnetlink::packet_core::Nla;
    nla.emit_value(buf);
}

/// TCA_HTB_CEIL64 (linux/pkt_sched.h).
pub(super) const TCA_HTB_CEIL64: u16 = 7;

/// Nanoseconds per packet scheduler tick (`PSCHED_SHIFT` in net/pkt_sched.h).
pub(super) const PSCHED_TICK_NS: u128 = 1 << 6;

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
