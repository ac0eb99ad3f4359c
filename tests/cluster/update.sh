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
"$here/tag-image.sh" "$tag"
# The cluster's programs (kubectl), cached by up.sh's build.
export PATH="$("$here/build.sh" | tail -n 1):$PATH"
start=$(date +%s%N)
SGC_SHAREGUARD_TAG="$tag" "$here/install.sh"
sgc_log "updated to localhost/shareguard:$tag in $(( ($(date +%s%N) - start) / 1000000 )) ms"
