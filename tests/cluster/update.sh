#!/usr/bin/env bash
# Updates shareguard on the test cluster to a new image tag, as a user updates to a new
# release: the image (here the one images.sh built, under the new tag in each node's
# containerd, since there is no registry) and the same kustomization with the new tag,
# applied with kubectl; then waits until both DaemonSets have rolled out.
# Usage: update.sh TAG
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
tag="$1"
# The cluster's programs (ctr, kubectl), cached by up.sh's build.
export PATH="$("$here/build.sh" | tail -n 1):$PATH"
for node in "${SGC_NODES[@]}"; do
  sgc_in_node "$node" ctr --address /run/containerd/containerd.sock -n k8s.io images tag \
    --force localhost/shareguard:dev "localhost/shareguard:$tag" >/dev/null
done
start=$(date +%s%N)
SGC_SHAREGUARD_TAG="$tag" "$here/install.sh"
sgc_log "updated to localhost/shareguard:$tag in $(( ($(date +%s%N) - start) / 1000000 )) ms"
