#!/usr/bin/env bash
# The test cluster's benchmark (docs/benchmarks.md, "On the test cluster"): a fresh
# cluster, tests/benches/cluster.rs against it, the cluster removed. As root.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"
out="$("$here/up.sh" | tail -n 2)"
sgc_export_cluster "$out"
status=0
(cd "$repo" && cargo bench --locked -p shareguard-tests --bench cluster) || status=$?
"$here/down.sh" || status=1
exit "$status"
