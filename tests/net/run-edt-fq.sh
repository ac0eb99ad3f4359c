#!/usr/bin/env bash
# edt-fq end to end, on a machine whose kernel has sch_fq (this project's CI kernel has
# not): runs the one bandwidth test that forces `mechanism = "edt-fq"`,
# `edt_fq_limits_both_directions_where_the_kernel_has_sch_fq`, with CI=true, so a kernel
# without sch_fq or a missing tool is reported instead of passing quietly.
#
# Usage (as root, from anywhere in the repository):
#   tests/net/run-edt-fq.sh
# Optional environment, for a machine that cannot build the eBPF programs (no nightly,
# no bpf-linker, no network):
#   EDT_TEST_BIN=<path>     the integration test binary, built elsewhere with
#                           `cargo test --release -p shareguard-tests --test integration --no-run`
#   SHAREGUARD_BIN=<path>   the agent it starts (`cargo build --release -p shareguard`)
#
# Needs ip, tc, ping and iperf3 (Debian: iproute2, iputils-ping, iperf3).
# Exit status: that of the test, or 1 when the script could not run it.

set -euo pipefail

say() { printf '%s\n' "$*"; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"

say "kernel $(uname -r)"
if ! grep -qw sch_fq /proc/modules 2>/dev/null; then
    modprobe sch_fq 2>/dev/null || true
fi
missing=()
for tool in ip tc ping iperf3; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    say "missing tools: ${missing[*]} (Debian: iproute2, iputils-ping, iperf3)"
    exit 1
fi

bin=${EDT_TEST_BIN:-}
if [[ -z $bin ]]; then
    command -v cargo >/dev/null 2>&1 || { say "cargo not found and EDT_TEST_BIN not set"; exit 1; }
    . scripts/lib.sh
    ensure_bpf_toolchain
    cargo build --release --locked -p shareguard
    export SHAREGUARD_BIN=${SHAREGUARD_BIN:-$repo/target/release/shareguard}
    bin=$(cargo test --release --locked -p shareguard-tests --test integration --no-run \
        --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)
    [[ -n $bin ]] || { say "could not build the integration test binary"; exit 1; }
fi
[[ -x $bin ]] || { say "$bin is not an executable file"; exit 1; }
[[ -z ${SHAREGUARD_BIN:-} || -x $SHAREGUARD_BIN ]] || {
    say "SHAREGUARD_BIN=$SHAREGUARD_BIN is not an executable file"
    exit 1
}

say "running $bin"
CI=true "$bin" --exact bandwidth::edt_fq_limits_both_directions_where_the_kernel_has_sch_fq --nocapture
