//! Which mechanism enforces a `net` device's shares, chosen from what the kernel offers
//! (docs/architecture.md, "Bandwidth"), and what each one installs for a share.
//!
//! | mechanism | to the pod (veth egress) | from the pod (veth ingress) |
//! |---|---|---|
//! | `edt-fq` | BPF sets `skb->tstamp`, root `fq` on the veth holds packets until then | BPF sets `skb->tstamp` and redirects to the share's queue device with a root `fq` |
//! | `htb-ebpf` | root HTB on the veth, BPF classifies each flow into its classes | BPF classifies and redirects to the share's queue device with a root HTB |
//! | `bpf-policer` | BPF drops what exceeds the token bucket | likewise |
//!
//! EDT is preferred: `fq` keeps flows apart (a ping does not wait behind a bulk flow) and
//! costs one timestamp per packet. HTB queues as well, with a priority class for sparse
//! flows and sixteen flow classes chosen by hash, which is coarser than `fq`. The
//! policer queues nothing, so TCP sees losses instead of delay; it is the fallback for
//! kernels where no qdisc can be used.

use serde::{Deserialize, Serialize};
use shareguard_ebpf_common::{
    FLAG_EDT_FROM_POD, FLAG_EDT_TO_POD, FLAG_HTB_FLOWS, FLAG_POLICE_FROM_POD, FLAG_POLICE_TO_POD,
    FLAG_TO_POD_QUEUE, IfaceConfig, Pace,
};

use crate::{error::NetError, probe::Probe, tc};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mechanism {
    EdtFq,
    HtbEbpf,
    BpfPolicer,
}

/// Longest an EDT packet may wait for its departure time before it is dropped instead:
/// the bound the CNI bandwidth plugin's tbf puts on queueing delay (`latency 25ms`).
pub const EDT_HORIZON_NS: u64 = 25_000_000;
/// Depth of the policer's bucket, as time at the rate. TCP through a policer needs room
/// for its bursts or it collapses: measured here with one bbr flow at 50 Mbit/s, a 50 ms
/// bucket gave 0.25 of the limit, 100 ms 0.50, 250 ms 0.95 (docs/benchmarks.md). The cost
/// is that a share idle for 250 ms may then send that much at line rate.
pub const POLICER_BUCKET_NS: u64 = 250_000_000;

impl Mechanism {
    /// Strongest first: the order `choose` tries them in.
    pub const ALL: [Mechanism; 3] = [Mechanism::EdtFq, Mechanism::HtbEbpf, Mechanism::BpfPolicer];

    /// The name in `ShareStatus.mechanism`, `ListDevices` and the config.
    pub const fn name(self) -> &'static str {
        match self {
            Mechanism::EdtFq => "edt-fq",
            Mechanism::HtbEbpf => "htb-ebpf",
            Mechanism::BpfPolicer => "bpf-policer",
        }
    }

    pub fn parse(name: &str) -> Option<Mechanism> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Why this kernel cannot run the mechanism, if it cannot.
    pub fn unsupported(self, p: &Probe) -> Option<&'static str> {
        match self {
            Mechanism::EdtFq if !p.fq => Some("the kernel has no fq qdisc (sch_fq)"),
            Mechanism::HtbEbpf if !p.htb => Some("the kernel has no htb qdisc (sch_htb)"),
            Mechanism::EdtFq | Mechanism::HtbEbpf if !p.queue => {
                Some("the kernel has no veth devices, which queue traffic from the pod")
            }
            _ => None,
        }
    }

    /// The root qdisc kind it installs, if any.
    pub const fn qdisc_kind(self) -> Option<&'static str> {
        match self {
            Mechanism::EdtFq => Some("fq"),
            Mechanism::HtbEbpf => Some("htb"),
            Mechanism::BpfPolicer => None,
        }
    }
}

impl std::fmt::Display for Mechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What `auto` tries, in order. Not `edt-fq`: it has not yet run end to end on a kernel
/// with `sch_fq` (the kernels it was tested on have none), and a default is what most
/// nodes get without anyone choosing it; it is used where a device names it.
pub const AUTO_ORDER: [Mechanism; 2] = [Mechanism::HtbEbpf, Mechanism::BpfPolicer];

/// The mechanism for a device: the one the config asks for, if the kernel can run it, or
/// else the first of [`AUTO_ORDER`] it can.
pub fn choose(probe: &Probe, requested: Option<Mechanism>) -> Result<Mechanism, NetError> {
    match requested {
        Some(m) => match m.unsupported(probe) {
            None => Ok(m),
            Some(why) => Err(NetError::Unsupported(format!(
                "mechanism {m} was configured, but {why}"
            ))),
        },
        // The policer needs nothing but the BPF programs, so there always is one.
        None => Ok(auto(probe)),
    }
}

/// What `mechanism = "auto"` picks on a kernel as probed: the first of [`AUTO_ORDER`] it
/// can run.
pub fn auto(probe: &Probe) -> Mechanism {
    AUTO_ORDER
        .into_iter()
        .find(|m| m.unsupported(probe).is_none())
        .unwrap_or(Mechanism::BpfPolicer)
}

/// Mechanism names a kernel as probed can run, strongest first.
pub fn available(probe: &Probe) -> Vec<&'static str> {
    Mechanism::ALL
        .into_iter()
        .filter(|m| m.unsupported(probe).is_none())
        .map(|m| m.name())
        .collect()
}

/// What a qdisc-based mechanism puts at the root of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootQdisc {
    Htb(tc::HtbParams),
    Fq,
}

/// Everything one share needs, before interfaces are resolved: the qdisc at the root of
/// the host veth (traffic to the pod), the qdisc of the queue device (traffic from the
/// pod, if it is redirected), and the programs' configuration without the queue
/// device's ifindex.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The root qdisc of every pod's host veth (traffic to the pod).
    pub veth_root: Option<RootQdisc>,
    /// The root qdisc of the queue device traffic from the pods is redirected to.
    pub queue_root: Option<RootQdisc>,
    /// The root qdisc of the queue device traffic to the pods is redirected to, instead
    /// of one on each veth (`htb-ebpf`, several pods: see [`Mechanism::plan`]).
    pub to_queue_root: Option<RootQdisc>,
    pub iface: IfaceConfig,
}

fn pace(bps: u64, slack_ns: u64) -> Pace {
    Pace {
        // Whole bytes, rounded down: never faster than the limit.
        bytes_per_sec: (bps / 8).max(1),
        slack_ns,
    }
}

/// Bits per second the programs enforce for a rate, as read back from their map.
pub const fn pace_bps(p: &Pace) -> u64 {
    p.bytes_per_sec.saturating_mul(8)
}

impl Mechanism {
    /// The plan for a share limited to `to_pod` / `from_pod` bit/s, counted in `slot`.
    ///
    /// `to_pod_queue`: the share has (or had) several pods. Traffic from them already
    /// meets in one queue device, and the programs' EDT and policer state is per share,
    /// but an HTB on each veth would give each pod the whole rate: for `htb-ebpf` traffic
    /// to the pods then goes round a queue device of its own, whose HTB holds them
    /// together.
    pub fn plan(
        self,
        to_pod: Option<u64>,
        from_pod: Option<u64>,
        slot: u32,
        to_pod_queue: bool,
    ) -> Plan {
        let mut iface = IfaceConfig {
            slot,
            ..IfaceConfig::default()
        };
        let (veth_root, queue_root) = match self {
            Mechanism::HtbEbpf => {
                // Both directions: the veth's HTB and, for traffic from the pod, the queue
                // device's classify by the priority the programs set (a flow class each). With
                // neither shaped (both unconstrained) nothing reads the priority, and
                // judging every packet's flow would be work on the hot path for nothing.
                if to_pod.is_some() || from_pod.is_some() {
                    iface.classid = tc::CLASSID;
                    iface.flags |= FLAG_HTB_FLOWS;
                }
                (
                    to_pod.map(|r| RootQdisc::Htb(tc::HtbParams::for_rate(r))),
                    from_pod.map(|r| RootQdisc::Htb(tc::HtbParams::for_rate(r))),
                )
            }
            // The programs pace (EDT) or police each direction themselves; only EDT needs
            // an fq to hold packets until their departure time.
            Mechanism::EdtFq | Mechanism::BpfPolicer => {
                let edt = self == Mechanism::EdtFq;
                let (to_flag, from_flag, slack) = if edt {
                    (FLAG_EDT_TO_POD, FLAG_EDT_FROM_POD, EDT_HORIZON_NS)
                } else {
                    (FLAG_POLICE_TO_POD, FLAG_POLICE_FROM_POD, POLICER_BUCKET_NS)
                };
                if let Some(r) = to_pod {
                    iface.flags |= to_flag;
                    iface.to_pod = pace(r, slack);
                }
                if let Some(r) = from_pod {
                    iface.flags |= from_flag;
                    iface.from_pod = pace(r, slack);
                }
                let fq = |rate: Option<u64>| rate.filter(|_| edt).map(|_| RootQdisc::Fq);
                (fq(to_pod), fq(from_pod))
            }
        };
        let (veth_root, to_queue_root) = match veth_root {
            Some(q @ RootQdisc::Htb(_)) if to_pod_queue => {
                iface.flags |= FLAG_TO_POD_QUEUE;
                (None, Some(q))
            }
            other => (other, None),
        };
        Plan {
            veth_root,
            queue_root,
            to_queue_root,
            iface,
        }
    }
}

#[cfg(test)]
mod tests {
    use shareguard_ebpf_common::flags_valid;

    use super::*;

    const ALL_THERE: Probe = Probe {
        queue: true,
        htb: true,
        fq: true,
    };
    /// This project's CI machine: no sch_fq.
    const NO_FQ: Probe = Probe {
        queue: true,
        htb: true,
        fq: false,
    };
    const NOTHING: Probe = Probe {
        queue: false,
        htb: false,
        fq: false,
    };

    #[test]
    fn auto_chooses_htb_even_where_fq_exists_and_edt_only_by_name() {
        // edt-fq is not a default until it has run end to end on a kernel with sch_fq.
        assert_eq!(choose(&ALL_THERE, None).unwrap(), Mechanism::HtbEbpf);
        assert_eq!(
            choose(&ALL_THERE, Some(Mechanism::EdtFq)).unwrap(),
            Mechanism::EdtFq
        );
        assert_eq!(choose(&NO_FQ, None).unwrap(), Mechanism::HtbEbpf);
        assert_eq!(choose(&NOTHING, None).unwrap(), Mechanism::BpfPolicer);
        // Without a queue device nothing can queue traffic from the pod.
        let no_queue = Probe {
            queue: false,
            ..ALL_THERE
        };
        assert_eq!(choose(&no_queue, None).unwrap(), Mechanism::BpfPolicer);
    }

    #[test]
    fn a_configured_mechanism_is_used_only_where_it_works() {
        assert_eq!(
            choose(&NO_FQ, Some(Mechanism::BpfPolicer)).unwrap(),
            Mechanism::BpfPolicer
        );
        assert_eq!(
            choose(&ALL_THERE, Some(Mechanism::HtbEbpf)).unwrap(),
            Mechanism::HtbEbpf
        );
        let e = choose(&NO_FQ, Some(Mechanism::EdtFq)).unwrap_err();
        assert!(e.to_string().contains("sch_fq"), "{e}");
        assert!(choose(&NOTHING, Some(Mechanism::HtbEbpf)).is_err());
    }

    #[test]
    fn names_round_trip() {
        for m in Mechanism::ALL {
            assert_eq!(Mechanism::parse(m.name()), Some(m));
            // The serialized form (install records) is the same name.
            assert_eq!(
                serde_json::to_string(&m).unwrap(),
                format!("\"{}\"", m.name())
            );
        }
        assert_eq!(Mechanism::parse("htb"), None);
    }

    #[test]
    fn edt_paces_both_directions_with_fq_on_veth_and_queue_device() {
        let p = Mechanism::EdtFq.plan(Some(2_000_000_000), Some(50_000_000), 9, false);
        assert_eq!(p.veth_root, Some(RootQdisc::Fq));
        assert_eq!(p.queue_root, Some(RootQdisc::Fq));
        assert_eq!(p.iface.flags, FLAG_EDT_TO_POD | FLAG_EDT_FROM_POD);
        assert_eq!(p.iface.classid, 0, "fq needs no class");
        assert_eq!(p.iface.slot, 9);
        assert_eq!(
            p.iface.to_pod,
            Pace {
                bytes_per_sec: 250_000_000,
                slack_ns: EDT_HORIZON_NS
            }
        );
        assert_eq!(pace_bps(&p.iface.from_pod), 50_000_000);
        assert!(flags_valid(&p.iface));
        // One direction only: nothing installed for the other.
        let p = Mechanism::EdtFq.plan(None, Some(50_000_000), 1, false);
        assert_eq!((p.veth_root, p.iface.flags), (None, FLAG_EDT_FROM_POD));
        assert_eq!(p.iface.to_pod, Pace::default());
        assert!(flags_valid(&p.iface));
    }

    #[test]
    fn htb_classifies_to_the_pod_and_shapes_from_the_pod_on_the_queue_device() {
        let p = Mechanism::HtbEbpf.plan(Some(50_000_000), Some(10_000_000), 2, false);
        assert_eq!(
            p.veth_root,
            Some(RootQdisc::Htb(tc::HtbParams::for_rate(50_000_000)))
        );
        assert_eq!(
            p.queue_root,
            Some(RootQdisc::Htb(tc::HtbParams::for_rate(10_000_000)))
        );
        assert_eq!(
            (p.iface.classid, p.iface.flags),
            (tc::CLASSID, FLAG_HTB_FLOWS),
            "flows spread over the flow classes"
        );
        assert!(flags_valid(&p.iface));
        let p = Mechanism::HtbEbpf.plan(None, Some(10_000_000), 2, false);
        assert_eq!(
            (p.iface.classid, p.iface.flags),
            (tc::CLASSID, FLAG_HTB_FLOWS),
            "traffic from the pod is classified for the queue device's HTB too"
        );
        // Nothing shaped (an unconstrained share): nothing to classify, only counting.
        let p = Mechanism::HtbEbpf.plan(None, None, 2, false);
        assert_eq!((p.veth_root, p.queue_root), (None, None));
        assert_eq!((p.iface.classid, p.iface.flags, p.iface.slot), (0, 0, 2));
    }

    #[test]
    fn several_pods_under_htb_share_one_to_pod_queue_and_other_mechanisms_need_none() {
        let p = Mechanism::HtbEbpf.plan(Some(50_000_000), Some(10_000_000), 2, true);
        assert_eq!(
            p.veth_root, None,
            "no HTB per veth: each would give its pod the rate"
        );
        assert_eq!(
            p.to_queue_root,
            Some(RootQdisc::Htb(tc::HtbParams::for_rate(50_000_000)))
        );
        assert_eq!(p.iface.flags, FLAG_HTB_FLOWS | FLAG_TO_POD_QUEUE);
        assert!(flags_valid(&p.iface));
        // Only traffic from the pods limited: nothing to queue on the way to them.
        let p = Mechanism::HtbEbpf.plan(None, Some(10_000_000), 2, true);
        assert_eq!((p.veth_root, p.to_queue_root), (None, None));
        assert_eq!(p.iface.flags & FLAG_TO_POD_QUEUE, 0);
        // EDT and the policer keep their state per share: every veth reads the same.
        for m in [Mechanism::EdtFq, Mechanism::BpfPolicer] {
            let p = m.plan(Some(50_000_000), Some(10_000_000), 2, true);
            assert_eq!(p.to_queue_root, None, "{m:?}");
            assert_eq!(p.iface.flags & FLAG_TO_POD_QUEUE, 0, "{m:?}");
        }
    }

    #[test]
    fn the_policer_installs_no_qdisc() {
        let p = Mechanism::BpfPolicer.plan(Some(80), Some(7), 3, false);
        assert_eq!((p.veth_root, p.queue_root), (None, None));
        assert_eq!(p.iface.flags, FLAG_POLICE_TO_POD | FLAG_POLICE_FROM_POD);
        assert_eq!(p.iface.to_pod.bytes_per_sec, 10);
        // Below one byte per second is still a rate, never "unlimited" (0).
        assert_eq!(p.iface.from_pod.bytes_per_sec, 1);
        assert!(flags_valid(&p.iface));
    }
}
