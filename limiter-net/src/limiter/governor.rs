//! The burst governor's thread: woken by the programs' ring or its tick, it hands the
//! registry of governed shares ([`crate::burst`]) the back end's BPF handle, and ends once
//! the back end is dropped.

use std::{
    os::fd::AsFd as _,
    sync::Weak,
    time::{Duration, Instant},
};

use nix::poll::{PollFd, PollFlags, PollTimeout};
use tracing::warn;

use super::NetBackend;
use crate::{
    bpf::Wakeups,
    burst::{RETRY_AFTER, TICK},
    error::NetError,
};

/// Starts the governor thread of `backend`, reading `wake`; it ends once the back end is
/// dropped (within one tick).
pub(super) fn spawn(backend: Weak<NetBackend>, wake: Wakeups) -> Result<(), NetError> {
    std::thread::Builder::new()
        .name("shareguard-burst".into())
        .spawn(move || run(&backend, wake))
        .map(|_| ())
        .map_err(|e| NetError::Bpf(format!("cannot start the burst governor: {e}")))
}

/// `poll`'s timeout for `wait`, rounded up to whole milliseconds: rounded down, the last
/// fraction of a millisecond before every tick would be spent polling with a zero
/// timeout, thousands of times a second.
fn poll_timeout(wait: Duration) -> PollTimeout {
    u32::try_from(wait.as_micros().div_ceil(1000))
        .ok()
        .and_then(|ms| PollTimeout::try_from(ms).ok())
        .unwrap_or(PollTimeout::MAX)
}

fn run(backend: &Weak<NetBackend>, mut wake: Wakeups) {
    let mut next_full = Instant::now() + RETRY_AFTER;
    // While every governed share is idle, only the once-a-second look is due: a share
    // that starts sending wakes the thread through the ring.
    let mut next_tick = next_full;
    loop {
        let wait = next_tick.saturating_duration_since(Instant::now());
        let mut fds = [PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
        if let Err(e) = nix::poll::poll(&mut fds, poll_timeout(wait))
            && e != nix::errno::Errno::EINTR
        {
            warn!(error = %e, "waiting for wake-ups; ticking only");
            std::thread::sleep(wait);
        }
        let Some(backend) = backend.upgrade() else {
            return;
        };
        let woken = wake.drain();
        let due = Instant::now() >= next_tick;
        if woken.is_empty() && !due {
            continue;
        }
        let mut ticking = false;
        backend.govern(|bpf, registry| {
            if !woken.is_empty() {
                registry.woken(bpf, &woken);
            }
            if due {
                let all = Instant::now() >= next_full;
                registry.tick(bpf, all);
                if all {
                    next_full = Instant::now() + RETRY_AFTER;
                }
            }
            ticking = registry.ticking();
        });
        let now = Instant::now();
        next_tick = match (ticking, due) {
            (true, true) => now + TICK,
            (true, false) => next_tick.min(now + TICK),
            (false, _) => next_full,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_timeout_rounds_up_so_the_thread_never_spins() {
        let ms = |t: PollTimeout| u32::try_from(t).unwrap();
        assert_eq!(ms(poll_timeout(Duration::from_micros(300))), 1);
        assert_eq!(ms(poll_timeout(Duration::from_micros(1001))), 2);
        assert_eq!(ms(poll_timeout(TICK)), 20);
        assert_eq!(ms(poll_timeout(Duration::ZERO)), 0);
        assert_eq!(poll_timeout(Duration::MAX), PollTimeout::MAX);
    }
}
