#!/usr/bin/env bash
# After the scenarios on the Cilium variant (e2e.sh with SGC_CNI=cilium): seen.sh with
# Cilium as start.sh sets it up (legacy host routing), then again with the agents
# restarted for BPF host routing (kube-proxy replacement; traffic into a pod on the same
# node then goes straight into the pod's namespace with bpf_redirect_peer). seen.sh
# fails if a program on the pod's veth misses the pod's packets, or if the claim says
# Enforced while the pod gets more than its share.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$here/lib.sh"
bin="$SGC_CACHE/bin"

restart_agents() {
  local node
  for node in "${SGC_NODES[@]}"; do
    sgc_kill "$node-cilium-agent"
  done
  SGC_CILIUM_ARGS="$*" "$here/cilium/start.sh" "$bin"
}

status=0
sgc_log "cilium: seen.sh with legacy host routing"
"$here/cilium/seen.sh" || status=1
sgc_log "cilium: seen.sh with BPF host routing"
restart_agents --kube-proxy-replacement=true --bpf-lb-sock=true --enable-host-legacy-routing=false
"$here/cilium/seen.sh" || status=1
exit "$status"
