//! When each share last sent, and whether user space waits to hear that it sends again:
//! what lets an HTB share start from a small bucket after an idle spell and keep the
//! large one while it is busy (`limiter-net`'s `burst` module says why).
//!
//! The programs note every packet of an HTB share in [`ACTIVITY_MAP`], at most once per
//! [`ACTIVITY_GRAIN_NS`] per share and direction so that a busy share does not bounce
//! one cache line between CPUs on every packet. When user space has *armed* the entry
//! (after it shrank the share's bucket), the next packet sends the entry's index on
//! [`WAKE_MAP`], a ring buffer, and disarms it; user space then restores the bucket.
//!
//! Both sides write the entry without atomics: a lost update costs one packet's lateness
//! in `last_ns` or one extra wake-up, never a missed one while armed (a program that
//! fails to send the wake-up leaves the entry armed for the next packet).

/// Name of the array `counter_index(slot, dir) -> Activity`.
pub const ACTIVITY_MAP: &str = "SG_ACTIVITY";
/// Name of the ring buffer of wake-ups: each record is a `u32` counter index.
pub const WAKE_MAP: &str = "SG_WAKE";
/// Bytes of [`WAKE_MAP`]: a power-of-two multiple of the page size; each wake-up takes
/// 16 (8 of header, 4 of index, padded), so 1024 fit between two reads.
pub const WAKE_BYTES: u32 = 16 * 1024;

/// `last_ns` moves at most once per this: fine enough for idle spells of tens of
/// milliseconds.
pub const ACTIVITY_GRAIN_NS: u64 = 1_000_000;

/// Value of [`ACTIVITY_MAP`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Activity {
    /// When the share's last packet in this direction was seen (`CLOCK_MONOTONIC`, ns),
    /// to within [`ACTIVITY_GRAIN_NS`]; 0: none since the slot was last reset.
    pub last_ns: u64,
    /// 1 while user space waits for the next packet ([`WAKE_MAP`]).
    pub armed: u32,
    pub _reserved: u32,
}

/// What to do with one packet at `now_ns` of a share whose entry is `a`: whether to send
/// a wake-up, and the entry to store, None when nothing changed (no write).
#[inline(always)]
pub const fn on_packet(a: Activity, now_ns: u64) -> (bool, Option<Activity>) {
    let wake = a.armed != 0;
    // Another CPU may have stored a later time: never move it back.
    let moved = now_ns > a.last_ns && now_ns - a.last_ns >= ACTIVITY_GRAIN_NS;
    if !wake && !moved {
        return (false, None);
    }
    (
        wake,
        Some(Activity {
            last_ns: if moved { now_ns } else { a.last_ns },
            armed: 0,
            _reserved: 0,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_busy_share_writes_once_per_grain() {
        let a = Activity {
            last_ns: 10 * MS,
            ..Activity::default()
        };
        assert_eq!(on_packet(a, 10 * MS + 1), (false, None));
        assert_eq!(on_packet(a, 11 * MS - 1), (false, None));
        let (wake, next) = on_packet(a, 11 * MS);
        assert!(!wake);
        assert_eq!(next.map(|n| n.last_ns), Some(11 * MS));
        // A time another CPU already passed does not move it back.
        assert_eq!(on_packet(a, 5 * MS), (false, None));
    }

    #[test]
    fn an_armed_entry_wakes_once_and_disarms() {
        let a = Activity {
            last_ns: 10 * MS,
            armed: 1,
            _reserved: 0,
        };
        let (wake, next) = on_packet(a, 10 * MS + 5);
        assert!(wake);
        let next = next.unwrap();
        assert_eq!((next.armed, next.last_ns), (0, 10 * MS));
        assert_eq!(on_packet(next, 10 * MS + 6), (false, None));
        // The first packet of a slot ever seen counts as moved.
        let (wake, fresh) = on_packet(Activity::default(), 3 * MS);
        assert!(!wake);
        assert_eq!(fresh.map(|n| n.last_ns), Some(3 * MS));
    }
}
