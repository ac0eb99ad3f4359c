#!/usr/bin/env bash
# The benchmarks of docs/benchmarks.md: the release binary, driven over its socket.
# A benchmark prints figures; it asserts nothing about speed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps
cargo build --release --locked -p shareguard
cargo bench --locked -p shareguard-tests --bench agent
# The store's part of a Prepare: a durable write in sled, beside a bare fsync.
cargo bench --locked -p shareguard-tests --bench store_sync
# Traffic through network namespaces: needs root.
cargo bench --locked -p shareguard-tests --bench bandwidth
# Many tenants on one NIC; draws docs/isolation-*.png with a DejaVu font.
ensure_debs fonts-dejavu-core
cargo bench --locked -p shareguard-tests --bench isolation
# The same shares on a NIC ten times faster than the capacity they are published under
# (docs/benchmarks.md, "The NIC's line rate against the capacity").
ISOLATION_NIC=10000000000 cargo bench --locked -p shareguard-tests --bench isolation
# CPU and softirq per shaped GB with 1, 10 and 100 pods beside tbf and HTB, one round
# (about 20 minutes; docs/benchmarks.md, "CPU per shaped GB").
SHAPING_CPU_ROUNDS=1 cargo bench --locked -p shareguard-tests --bench shaping_cpu
# A sparse flow beside a bulk flow in shares of 2M to 20M.
cargo bench --locked -p shareguard-tests --bench small_shares
