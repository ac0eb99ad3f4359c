//! What the running kernel offers for shaping, probed once at start on a throw-away queue
//! pair (the veth pair that queues a share's traffic from the pod): whether the `fq`
//! qdisc exists (for EDT, as Cilium's Bandwidth Manager does it) and whether HTB and the
//! pair do (for the HTB + eBPF mechanism). A qdisc counts as present
//! when the kernel accepts one at the root of that device: module autoloading included,
//! and nothing is concluded from config files that may not match the running kernel.

use std::process::Command;

use crate::{error::NetError, rtnl};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// A veth pair can be made to queue traffic from the pod on.
    pub queue: bool,
    pub htb: bool,
    pub fq: bool,
}

fn qdisc_works(dev: &str, kind: &str) -> bool {
    let ok = Command::new("tc")
        .args(["qdisc", "add", "dev", dev, "root", "handle", "1:", kind])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        let _ = Command::new("tc")
            .args(["qdisc", "del", "dev", dev, "root"])
            .output();
    }
    ok
}

pub fn probe() -> Result<Probe, NetError> {
    let dev = format!("sgprobe{}", std::process::id() % 100_000);
    let peer = format!("sgprober{}", std::process::id() % 100_000);
    let queue = rtnl::ensure_queue_pair(&dev, &peer, "probe").is_ok();
    let mut p = Probe {
        queue,
        ..Probe::default()
    };
    if queue {
        p.htb = qdisc_works(&dev, "htb");
        p.fq = qdisc_works(&dev, "fq");
        rtnl::delete_link(&dev)?;
    }
    Ok(p)
}
