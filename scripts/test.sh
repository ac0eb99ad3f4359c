#!/usr/bin/env bash
# The whole test suite: formatting, clippy with -D warnings, unit, property and
# integration tests (the latter run the real binary), then each fuzz target for a short
# while. Safe to run again and again.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps
# cargo-fuzz and g++ (libFuzzer): the fuzz crate is linted below and fuzzed last.
ensure_fuzz_toolchain
# promtool (Debian's prometheus package) lints the agent's /metrics in the tests,
# systemd-analyze (systemd) verifies the unit file, openssl makes the certificates of
# the metrics TLS test (curl, its scraper, is a build dependency already).
ensure_debs prometheus systemd openssl
# Other languages' gRPC clients, for tests/tests/integration/other_clients.rs.
ensure_py_clients
# Helm (pinned, from the Go module proxy) for tests/tests/integration/chart.rs: lints deploy/chart and
# holds deploy/*.yaml to its render. Exports SHAREGUARD_HELM, which the test reads.
ensure_helm

if [ "${CI:-}" = "true" ] && [ "$(id -u)" != 0 ]; then
  echo "CI=true but not root: the privileged tests must run in CI" >&2
  exit 1
fi

# One build from scratch (CI, or a check before pushing) gains nothing from incremental
# state, which was a gigabyte of the target directory.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# A fresh clone's build peaks near 2.3 GB, the image's release build 2.2 GB in
# target/image (twice: make image-reproduce builds it again in a clone under /tmp), and the
# fuzz build adds 1.2 GB in fuzz/target (measured); say so up front rather than let the
# linker die with a bus error halfway through.
avail_mb=$(df -Pm . | awk 'NR == 2 { print $4 }')
if [ -n "$avail_mb" ] && [ "$avail_mb" -lt 8600 ]; then
  echo "warning: only ${avail_mb} MB free here; a build from scratch needs about 8 GB" >&2
fi

# What the tests could leave on the host, to compare with what is there at the end.
host_before=$(scripts/host-state.sh | sort)

echo "==> cargo fmt --check"
cargo fmt --all -- --check
# ebpf/ is its own workspace (built for bpfel by limiter-net's build script), out of
# cargo fmt's reach above.
rustfmt --edition 2024 --check ebpf/src/*.rs
# fuzz/ too is its own workspace (cargo-fuzz's, see docs/fuzzing.md).
rustfmt --edition 2024 --check fuzz/src/*.rs fuzz/fuzz_targets/*.rs fuzz/examples/*.rs
echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
# The fuzz crate, checked into the main target directory: its dev profile and lock file
# match the root's, so most dependencies checked just above are reused (about 15 s here).
CARGO_TARGET_DIR="$PWD/target" cargo clippy --manifest-path fuzz/Cargo.toml --all-targets --locked -- -D warnings
echo "==> cargo build (the integration tests run this binary)"
cargo build --workspace --all-targets --locked
echo "==> cargo test"
cargo test --workspace --locked -- --test-threads="${TEST_THREADS:-4}"
# The scenarios on a real two-node cluster built from upstream (tests/cluster/README.md):
# a fresh cluster, the scenarios, the cluster removed; before the host
# check below, so that whatever the cluster leaves counts too.
echo "==> e2e on a real cluster (tests/cluster/e2e.sh)"
./tests/cluster/e2e.sh
# The image e2e ran, built again from this commit in a fresh clone at another path with a
# cold target directory: the same digests, or the run fails (docs/image.md).
echo "==> the image, reproducibly (make image-reproduce)"
./scripts/image-reproduce.sh
echo "==> the host as found"
check_host_as_found "$host_before" "the tests"
# Last, because its build is separate (nightly, sanitizers, fuzz/target): each target a
# short while from the corpus kept in fuzz/corpus, which the run only reads. A crash
# fails the run like a failing test.
echo "==> fuzz (each target ${FUZZ_CI_SECONDS:-20} s, scripts/fuzz.sh)"
FUZZ_SECONDS="${FUZZ_CI_SECONDS:-20}" ./scripts/fuzz.sh
echo "==> all tests passed"
# What the run took on disk, so that a machine short of space shows in the log.
du -sh target fuzz/target 2>/dev/null || true
df -h . 2>/dev/null | tail -1 || true
