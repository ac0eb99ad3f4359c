#!/usr/bin/env bash
# Gives the shareguard image images.sh built (localhost/shareguard:dev) another tag in
# every node's containerd, as a new release's image would arrive (there is no
# registry here). Usage: tag-image.sh TAG
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
tag="$1"
# The cluster's programs (ctr), cached by up.sh's build.
export PATH="$("$here/build.sh" | tail -n 1):$PATH"
for node in "${SGC_NODES[@]}"; do
  sgc_in_node "$node" ctr --address /run/containerd/containerd.sock -n k8s.io images tag \
    --force localhost/shareguard:dev "localhost/shareguard:$tag" >/dev/null
done
