#!/usr/bin/env bash
# The whole test suite: formatting, clippy with -D warnings, unit, property and
# integration tests (the latter run the real binary). Safe to run again and again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps
# promtool (Debian's prometheus package) lints the agent's /metrics in the tests, and
# systemd-analyze (systemd) verifies the unit file.
ensure_debs prometheus systemd

if [ "${CI:-}" = "true" ] && [ "$(id -u)" != 0 ]; then
  echo "CI=true but not root: the privileged tests must run in CI" >&2
  exit 1
fi

# One build from scratch (CI, or a check before pushing) gains nothing from incremental
# state, which was a gigabyte of the target directory.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# A fresh clone's build peaks near 2.3 GB (measured); say so up front rather than let the
# linker die with a bus error halfway through.
avail_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
if [ -n "$avail_mb" ] && [ "$avail_mb" -lt 3000 ]; then
  echo "warning: only ${avail_mb} MB free here; a build from scratch needs about 2.5 GB" >&2
fi

# What the tests could leave on the host, to compare with what is there at the end.
host_before=$(scripts/host-state.sh | sort)

echo "==> cargo fmt --check"
cargo fmt --all -- --check
# ebpf/ is its own workspace (built for bpfel by limiter-net's build script), out of
# cargo fmt's reach above.
rustfmt --edition 2024 --check ebpf/src/*.rs
echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "==> cargo build (the integration tests run this binary)"
cargo build --workspace --all-targets --locked
echo "==> cargo test"
cargo test --workspace --locked -- --test-threads="${TEST_THREADS:-4}"
echo "==> the host as found"
check_host_as_found "$host_before" "the tests"
echo "==> all tests passed"
# What the run took on disk, so that a machine short of space shows in the log.
du -sh target 2>/dev/null || true
df -h . 2>/dev/null | tail -1 || true
