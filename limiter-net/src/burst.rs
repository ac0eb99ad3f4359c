//! Earned burst: an `htb-ebpf` share's class holds its full bucket (10 ms of its rate,
//! [`crate::tc::HtbParams`]) only while the share is busy, and [`tc::IDLE_BURST`] while
//! it is idle.
//!
//! The bucket is what makes up for time the queue stood empty while the sender had data
//! (a window cut, a late dequeue); without 10 ms of it TCP loses goodput on this kind of
//! node. But HTB, like every token bucket, also fills it during any idle spell, so a new
//! flow could send 10 ms of the rate at once: 1.03 to 1.05 of the limit in its first
//! 100 ms. HTB cannot tell the two apart; the programs can, because they see every
//! packet.
//!
//! HTB keeps the tokens a class holds when its bucket changes, and clips them to the
//! bucket at the class's next packet. So the bucket may be shrunk while the share is
//! idle and grown again any time after the share has started again: from the moment
//! traffic starts, the share can never get ahead of its rate by more than what it held
//! then ([`tc::HtbParams::after_idle_bytes`], at most 64 KiB), while the full bucket is
//! back for the rest of the busy spell. Tokens it holds again later are only rate it left
//! unused since then.
//!
//! "Busy" means using the rate, not merely sending: the full bucket is only given back
//! once the share has sent at least [`GROW_AT`] of its rate over a [`WINDOW`], and taken
//! away again once it has sent less than [`SHRINK_BELOW`] of it for [`SHRINK_AFTER`], or
//! less than [`QUIET_BELOW`] over one window (it stopped). A TCP flow's own stalls are
//! shorter than that, or not as quiet, and the bucket is what makes up for
//! them: taking it away at a stall would throw away the very tokens the flow needs to
//! catch up (judged on a single 20 ms window instead, a steady 2 Gbit/s flow lost its
//! bucket every 1 to 5 s). A share with light
//! traffic (health checks, a trickle) keeps the idle bucket, so a bulk flow that starts
//! beside it gets no 10 ms burst either, and between two bursts of an RPC the bucket is
//! small again.
//!
//! The governor is one thread per agent:
//! - every [`TICK`], it reads the counters of each governed share that is not idle and
//!   decides from the last window ([`at_tick`]); idle shares it looks at once every
//!   [`RETRY_AFTER`], and while all are idle it sleeps that long;
//! - a share with the idle bucket whose traffic stopped is *armed*: its next packet sends
//!   its counter index on the wake-up ring (`shareguard_ebpf_common::activity`), which
//!   wakes the governor at once, so that the window that may give the bucket back starts
//!   with the share's first packet, not up to a tick later.
//!
//! The bucket changes over netlink (one round trip), at most twice per busy spell.

use std::{
    collections::BTreeMap,
    sync::{Mutex, PoisonError},
    time::Duration,
};

use shareguard_ebpf_common::Activity;
use tracing::{debug, warn};

use crate::{
    bpf::{Bpf, Direction},
    error::NetError,
    rtnl, tc,
};

/// How often the governor reads the counters of shares that are not idle.
pub const TICK: Duration = Duration::from_millis(20);
/// How often it also looks at idle shares, and waits after a share it could not change.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The shortest span the governor judges a share's use of its rate over: a tick, less
/// the lateness a tick may have.
pub const WINDOW: Duration = Duration::from_millis(15);
/// A share with the idle bucket gets the full one back once it sends this part of its
/// rate over a window. Well below what a saturating TCP flow reaches with the idle
/// bucket (0.84 at 2 Gbit/s on a quiet machine of this kind, less on a loaded one), or a
/// busy share on a loaded node might never get it back; light traffic stays far below.
pub const GROW_AT: f64 = 0.5;
/// A share with the full bucket gets the idle one once it has sent less than this part
/// of its rate over every window for [`SHRINK_AFTER`], idle shares first of all.
pub const SHRINK_BELOW: f64 = 0.5;
/// See [`SHRINK_BELOW`]: longer than a TCP flow's stalls within a busy spell, shorter
/// than a pause between two requests a user would call idle.
pub const SHRINK_AFTER: Duration = Duration::from_millis(100);
/// A share with the full bucket that sent less than this part of its rate over one
/// window has stopped, or waits on a timeout (a TCP flow that cut its window still
/// sends most of its rate): it gets the idle bucket at once, so that a flow starting 20
/// to 40 ms after the last one ended finds it.
/// (With [`SHRINK_AFTER`] alone, sixteen flows started just after a single flow ended
/// got 1.03 to 1.06 of the bound in the benchmark.)
pub const QUIET_BELOW: f64 = 0.05;

/// Which bucket a governed share's class holds, as far as the governor knows, and since
/// when it has counted the share's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bucket {
    /// The full bucket; the current window began at `since_ns` with `bytes` counted, and
    /// the last window in which the share used its rate ended at `used_ns`.
    Busy {
        since_ns: u64,
        bytes: u64,
        used_ns: u64,
    },
    /// The idle bucket, with the share silent and its activity entry armed.
    Idle,
    /// The idle bucket, the share sending again; the window began at `since_ns`.
    Waking { since_ns: u64, bytes: u64 },
    /// Not known: found installed (after a restart), not installed by this agent process.
    Unknown,
}

/// What the governor does for one share at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Nothing,
    /// Start a new window: the share stays as it is; `used`: it used its rate in the one
    /// that ended.
    Window {
        used: bool,
    },
    /// Give the class its idle bucket and arm the entry (-> `Idle`).
    Shrink,
    /// Arm the entry; the class already has its idle bucket (-> `Idle`).
    Arm,
    /// The share sends again: start a window with the idle bucket (-> `Waking`).
    Wake,
    /// Give the class its full bucket (-> `Busy`).
    Grow,
}

/// The tick's decision at `now_ns` (`CLOCK_MONOTONIC`) for a share whose class holds
/// `bucket`, whose counters read `bytes` and whose activity entry reads `seen`;
/// `bytes_per_sec` is its rate.
pub fn at_tick(
    bucket: Bucket,
    seen: Activity,
    bytes: u64,
    now_ns: u64,
    bytes_per_sec: u64,
) -> Step {
    // The part of the rate the share used since `since_ns`, once a window has passed.
    let used = |since_ns: u64, from: u64| {
        let span = now_ns.saturating_sub(since_ns);
        (span >= nanos(WINDOW)).then(|| {
            let allowed = bytes_per_sec as f64 * span as f64 / 1e9;
            bytes.wrapping_sub(from) as f64 / allowed.max(1.0)
        })
    };
    match bucket {
        Bucket::Unknown => Step::Shrink,
        Bucket::Busy {
            since_ns,
            bytes: from,
            used_ns,
        } => match used(since_ns, from) {
            None => Step::Nothing,
            Some(u) if u >= SHRINK_BELOW => Step::Window { used: true },
            Some(u) if u < QUIET_BELOW => Step::Shrink,
            Some(_) if now_ns.saturating_sub(used_ns) >= nanos(SHRINK_AFTER) => Step::Shrink,
            Some(_) => Step::Window { used: false },
        },
        // Disarmed by a packet whose wake-up was read before the entry was armed again,
        // or lost: wake it here.
        Bucket::Idle if seen.armed == 0 && now_ns.saturating_sub(seen.last_ns) < nanos(WINDOW) => {
            Step::Wake
        }
        Bucket::Idle => Step::Nothing,
        Bucket::Waking {
            since_ns,
            bytes: from,
        } => match used(since_ns, from) {
            None => Step::Nothing,
            Some(u) if u >= GROW_AT => Step::Grow,
            Some(_) if bytes == from => Step::Arm,
            Some(_) => Step::Window { used: false },
        },
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One direction of a share whose bucket the governor keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Governed {
    pub share_key: String,
    pub direction: Direction,
    /// The interface whose root HTB holds the share's class: the host veth for traffic
    /// to the pod, the queue device for traffic from it.
    pub ifindex: u32,
    /// The direction's rate, bytes per second.
    pub bytes_per_sec: u64,
    pub busy_bytes: u64,
    pub idle_bytes: u64,
    pub bucket: Bucket,
    /// After a failure, not before this (`CLOCK_MONOTONIC`, ns).
    pub retry_after_ns: u64,
}

/// The governed shares by counter index. Lock order: the back end's `Bpf` first, then
/// this.
#[derive(Debug, Default)]
pub struct Registry {
    shares: Mutex<BTreeMap<u32, Governed>>,
}

impl Registry {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Governed>> {
        // Entries are plain data, consistent after any panic.
        self.shares.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Governs the direction at counter `index` with the tree as just installed: the
    /// share's class holds the idle bucket ([`tc::htb_tree_commands`]), and the share is
    /// armed, so that its first packet starts the window that gives the full one back.
    pub fn installed(&self, bpf: &mut Bpf, index: u32, g: Governed) -> Result<(), NetError> {
        arm(bpf, index)?;
        self.map().insert(
            index,
            Governed {
                bucket: Bucket::Idle,
                ..g
            },
        );
        Ok(())
    }

    /// Governs the direction at `index` if it is not yet, its bucket unknown (a share
    /// found installed, after a restart).
    pub fn found(&self, index: u32, g: Governed) {
        self.map().entry(index).or_insert(Governed {
            bucket: Bucket::Unknown,
            ..g
        });
    }

    /// Stops governing `index` (the share's limit is being removed).
    pub fn forget(&self, index: u32) {
        self.map().remove(&index);
    }

    /// Runs one tick over the governed shares: all of them when `all`, else those not
    /// idle (an idle share is woken by its first packet; a tick only catches a wake-up
    /// that was missed, which can wait).
    pub fn tick(&self, bpf: &mut Bpf, all: bool) {
        let mut shares = self.map();
        let now_ns = monotonic_ns();
        for (&index, g) in shares.iter_mut() {
            if (g.bucket == Bucket::Idle && !all) || now_ns < g.retry_after_ns {
                continue;
            }
            // Only an idle share's decision reads the activity entry (`at_tick`); arming
            // a busy one reads it then. Busy shares are ticked every TICK: one map read
            // a tick fewer for each.
            let seen = if g.bucket == Bucket::Idle {
                bpf.activity(index)
            } else {
                Ok(Activity::default())
            };
            let read = seen.and_then(|a| Ok((a, bpf.index_counters(index)?.bytes)));
            let result =
                read.map_err(|e| NetError::Bpf(e.to_string()))
                    .and_then(|(seen, bytes)| {
                        let now_ns = monotonic_ns();
                        let step = at_tick(g.bucket, seen, bytes, now_ns, g.bytes_per_sec);
                        apply(bpf, index, g, step, bytes, now_ns)
                    });
            if let Err(e) = result {
                // Its interface or class is gone or changed: the reconciler finds that
                // drift and installs the tree again, which governs it afresh. Until
                // then, once a second is enough.
                g.retry_after_ns = now_ns.saturating_add(nanos(RETRY_AFTER));
                g.bucket = Bucket::Unknown;
                warn!(share = %g.share_key, direction = %g.direction, error = %e, "keeping the share's bucket");
            }
        }
    }

    /// Whether a governed share needs the governor every [`TICK`]: one that is not idle
    /// (an idle one wakes it through the ring) and not waiting after a failure (the
    /// once-a-second look retries it).
    pub fn ticking(&self) -> bool {
        let now_ns = monotonic_ns();
        self.map()
            .values()
            .any(|g| g.bucket != Bucket::Idle && now_ns >= g.retry_after_ns)
    }

    /// Starts a window for each of `woken` (counter indices from the ring) that was idle.
    pub fn woken(&self, bpf: &mut Bpf, woken: &[u32]) {
        let mut shares = self.map();
        for index in woken {
            let Some(g) = shares.get_mut(index) else {
                continue;
            };
            if g.bucket != Bucket::Idle {
                continue;
            }
            // The packet that woke it is counted already; the window counts what follows.
            let result = bpf
                .index_counters(*index)
                .map_err(|e| NetError::Bpf(e.to_string()))
                .and_then(|c| apply(bpf, *index, g, Step::Wake, c.bytes, monotonic_ns()));
            if let Err(e) = result {
                warn!(share = %g.share_key, direction = %g.direction, error = %e, "waking the share");
            }
        }
    }
}

fn apply(
    bpf: &mut Bpf,
    index: u32,
    g: &mut Governed,
    step: Step,
    bytes: u64,
    now_ns: u64,
) -> Result<(), NetError> {
    match step {
        Step::Nothing => {}
        Step::Window { used } => {
            let since_ns = now_ns;
            g.bucket = match g.bucket {
                Bucket::Busy { used_ns, .. } => Bucket::Busy {
                    since_ns,
                    bytes,
                    used_ns: if used { now_ns } else { used_ns },
                },
                _ => Bucket::Waking { since_ns, bytes },
            };
        }
        Step::Shrink => {
            rtnl::set_htb_burst(g.ifindex, tc::MAJOR, tc::SHARE_MINOR, g.idle_bytes)?;
            arm(bpf, index)?;
            g.bucket = Bucket::Idle;
            debug!(share = %g.share_key, direction = %g.direction, bytes = g.idle_bytes, "rate unused: idle bucket");
        }
        Step::Arm => {
            arm(bpf, index)?;
            g.bucket = Bucket::Idle;
        }
        Step::Wake => {
            g.bucket = Bucket::Waking {
                since_ns: now_ns,
                bytes,
            };
        }
        Step::Grow => {
            rtnl::set_htb_burst(g.ifindex, tc::MAJOR, tc::SHARE_MINOR, g.busy_bytes)?;
            g.bucket = Bucket::Busy {
                since_ns: now_ns,
                bytes,
                used_ns: now_ns,
            };
            debug!(share = %g.share_key, direction = %g.direction, bytes = g.busy_bytes, "rate in use: full bucket");
        }
    }
    Ok(())
}

/// Arms the entry at `index`: the share's next packet wakes the governor. The entry is
/// read just before and its `last_ns` written back as it was; a packet between the
/// read and the write finds the entry unarmed, and the next tick sees it sent
/// ([`at_tick`] wakes it).
fn arm(bpf: &mut Bpf, index: u32) -> Result<(), NetError> {
    let seen = bpf
        .activity(index)
        .map_err(|e| NetError::Bpf(e.to_string()))?;
    bpf.arm(index, seen)
        .map_err(|e| NetError::Bpf(e.to_string()))
}

/// `CLOCK_MONOTONIC` in nanoseconds, the clock the programs' `bpf_ktime_get_ns` reads.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        u64::try_from(t.tv_sec())
            .unwrap_or(0)
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::try_from(t.tv_nsec()).unwrap_or(0))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shares_that_are_not_idle_keep_the_governor_ticking() {
        let r = Registry::default();
        assert!(!r.ticking(), "nothing governed");
        let g = |bucket, retry_after_ns| Governed {
            share_key: "k".into(),
            direction: Direction::ToPod,
            ifindex: 1,
            bytes_per_sec: RATE,
            busy_bytes: 2_500_000,
            idle_bytes: 16_384,
            bucket,
            retry_after_ns,
        };
        r.map().insert(0, g(Bucket::Idle, 0));
        assert!(
            !r.ticking(),
            "an idle share wakes the governor through the ring"
        );
        r.map().insert(1, g(Bucket::Unknown, u64::MAX));
        assert!(
            !r.ticking(),
            "a share waiting after a failure is retried once a second"
        );
        r.map().insert(
            2,
            g(
                Bucket::Waking {
                    since_ns: 0,
                    bytes: 0,
                },
                0,
            ),
        );
        assert!(r.ticking());
        r.forget(2);
        r.map().insert(1, g(Bucket::Unknown, 0));
        assert!(
            r.ticking(),
            "a share found after a restart is judged at the next tick"
        );
    }

    const MS: u64 = 1_000_000;
    /// 2 Gbit/s.
    const RATE: u64 = 250_000_000;

    fn seen(last_ms: u64, armed: u32) -> Activity {
        Activity {
            last_ns: last_ms * MS,
            armed,
            _reserved: 0,
        }
    }

    /// Bytes of `part` of the rate over `ms`.
    fn sent(part: f64, ms: u64) -> u64 {
        (RATE as f64 * part * ms as f64 / 1e3) as u64
    }

    #[test]
    fn the_full_bucket_goes_when_the_rate_goes_unused_for_a_while() {
        // Last used its rate 50 ms ago: a window below half of it is a stall, kept.
        let busy = Bucket::Busy {
            since_ns: 980 * MS,
            bytes: 1_000,
            used_ns: 950 * MS,
        };
        let at = |bytes| at_tick(busy, seen(999, 0), bytes, 1_000 * MS, RATE);
        assert_eq!(at(1_000 + sent(0.95, 20)), Step::Window { used: true });
        assert_eq!(at(1_000 + sent(0.55, 20)), Step::Window { used: true });
        assert_eq!(at(1_000 + sent(0.45, 20)), Step::Window { used: false });
        assert_eq!(at(1_000 + sent(0.06, 20)), Step::Window { used: false });
        // Stopped, not stalled: the idle bucket at once.
        assert_eq!(at(1_000 + sent(0.04, 20)), Step::Shrink);
        assert_eq!(at(1_000), Step::Shrink, "silent");
        // Unused for 100 ms: the idle bucket.
        let long = Bucket::Busy {
            since_ns: 980 * MS,
            bytes: 1_000,
            used_ns: 900 * MS,
        };
        let at = |bytes| at_tick(long, seen(999, 0), bytes, 1_000 * MS, RATE);
        assert_eq!(at(1_000 + sent(0.45, 20)), Step::Shrink);
        assert_eq!(at(1_000), Step::Shrink);
        assert_eq!(at(1_000 + sent(0.6, 20)), Step::Window { used: true });
        // Within a window nothing is judged.
        let early = at_tick(long, seen(999, 0), 1_000, 990 * MS, RATE);
        assert_eq!(early, Step::Nothing);
    }

    #[test]
    fn the_full_bucket_comes_back_only_for_a_share_that_uses_its_rate() {
        let waking = Bucket::Waking {
            since_ns: 980 * MS,
            bytes: 1_000,
        };
        let at = |bytes| at_tick(waking, seen(999, 0), bytes, 1_000 * MS, RATE);
        // A saturating flow with the idle bucket reaches 0.8 or more, less under load.
        assert_eq!(at(1_000 + sent(0.8, 20)), Step::Grow);
        assert_eq!(at(1_000 + sent(0.55, 20)), Step::Grow);
        // A trickle beside nothing: a new window, still the idle bucket.
        assert_eq!(at(1_000 + sent(0.1, 20)), Step::Window { used: false });
        // Nothing since the wake-up: armed again.
        assert_eq!(at(1_000), Step::Arm);
        // Counters wrap as the programs' do.
        let wrapped = Bucket::Waking {
            since_ns: 980 * MS,
            bytes: u64::MAX - 10,
        };
        assert_eq!(
            at_tick(wrapped, seen(999, 0), sent(0.9, 20), 1_000 * MS, RATE),
            Step::Grow
        );
    }

    #[test]
    fn an_idle_share_waits_for_its_wake_up_unless_it_was_missed() {
        let now = 1_000 * MS;
        let at = |s| at_tick(Bucket::Idle, s, 0, now, RATE);
        assert_eq!(at(seen(500, 1)), Step::Nothing, "armed and silent");
        assert_eq!(at(seen(999, 1)), Step::Nothing, "its wake-up is on the way");
        assert_eq!(at(seen(999, 0)), Step::Wake, "its wake-up was read before");
        assert_eq!(at(seen(500, 0)), Step::Nothing);
    }

    #[test]
    fn a_share_found_after_a_restart_starts_from_the_idle_bucket() {
        assert_eq!(
            at_tick(Bucket::Unknown, seen(999, 0), 5, 1_000 * MS, RATE),
            Step::Shrink
        );
    }
}
