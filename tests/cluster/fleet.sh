#!/usr/bin/env bash
# The fleet simulation (docs/benchmarks.md, "A fleet of simulated nodes"): the test
# cluster's control plane alone (control-plane.sh), tests/benches/fleet.rs against it
# (many nodes' kubelet plugins in one process, each with a simulated agent), then the
# control plane removed. As root. FLEET_* variables size the run (fleet.rs says which).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"
# The bench starts a real agent for the devices' inventory (target/release/shareguard,
# beside the bench binary); built first, before the control plane is up.
(cd "$repo" && cargo build --release --locked -p shareguard)
out="$("$here/control-plane.sh" | tail -n 2)"
sgc_export_cluster "$out"
status=0
(cd "$repo" && cargo bench --locked -p shareguard-tests --bench fleet) || status=$?
"$here/down.sh" || status=1
exit "$status"
