#!/usr/bin/env bash
# `shareguard ARGS...` on one node of the test cluster, from the node's own namespaces
# against its agent's socket, as an operator on the node would run it: it needs neither
# kubelet nor the API server (kubectl exec needs both), so it works on a node cut off
# from them (the agent's socket at its usual path in the node). The binary is the one in
# the cluster's image (tests/cluster/images.sh keeps a copy).
# Usage: node-cli.sh NODE ARGS...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
node="$1"
shift
sgc_in_node "$node" "$SGC_STATE/images/shareguard/shareguard-amd64" "$@"
