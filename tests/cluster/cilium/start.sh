#!/usr/bin/env bash
# The Cilium variant of the test cluster (SGC_CNI=cilium up.sh): called by node.sh once
# both nodes have registered, with the directory of the built programs. Gives each node
# its pod CIDR (Cilium's "kubernetes" IPAM reads it from the Node), registers Cilium's
# CRDs (its operator's job, which the cluster does without), and starts one Cilium agent
# in each node's namespaces, then waits until both report ready.
#
# The datapath is Cilium's default veth one with native routing over the nodes' own
# routes and no masquerading; kube-proxy stays, so no socket load balancing and legacy
# host routing. SGC_CILIUM_ARGS adds agent flags (for example
# --enable-bandwidth-manager=true). Hubble, L7 proxy and health probing are off: they
# need programs (Envoy, cilium-health) this variant does not build.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"
. "$repo/scripts/lib.sh"
bin="$1"
export PATH="$bin:$PATH"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"

# The LLVM release Cilium's own image ships (19), from Debian, named as the agent calls
# it; iptables for the rules of legacy host routing.
ensure_debs clang-19 llvm-19 iptables
llvm="$SGC_CACHE/cilium-llvm"
mkdir -p "$llvm"
ln -sfn /usr/bin/clang-19 "$llvm/clang"
ln -sfn /usr/bin/llc-19 "$llvm/llc"

lib="$(readlink -f "$bin/cilium-lib")"
sgc_log "cilium: CRDs"
kubectl apply --server-side -f "$lib/crds/v2" -f "$lib/crds/v2alpha1" >/dev/null
for crd in ciliumendpoints ciliumidentities ciliumnodes ciliumnetworkpolicies; do
  kubectl wait --for condition=established --timeout=60s "crd/$crd.cilium.io" >/dev/null
done

for node in "${SGC_NODES[@]}"; do
  cidr="$(sgc_node_pod_cidr "$node")"
  kubectl patch node "$node" --type merge \
    -p "{\"spec\":{\"podCIDR\":\"$cidr\",\"podCIDRs\":[\"$cidr\"]}}" >/dev/null
  sgc_log "cilium: agent on $node (pods $cidr) ${SGC_CILIUM_ARGS:-}"
  # A bpffs of Cilium's own: the node's /sys/fs/bpf is a second mount over the host's,
  # which the agent refuses ("multiple mount points"). And the node's cgroup2 folder
  # bound where the agent looks for cgroup2 (its socket load balancing attaches there):
  # a folder that is not a mount point it would mount the whole hierarchy over, and the
  # node's containers would then be made at the hierarchy's root.
  # shellcheck disable=SC2016 # expanded by the inner shell
  sgc_in_node "$node" bash -euc '
    mkdir -p /run/cilium/bpffs /run/cilium/cgroupv2
    mountpoint -q /run/cilium/bpffs || mount -t bpf bpf /run/cilium/bpffs
    mountpoint -q /run/cilium/cgroupv2 || mount --bind "$1" /run/cilium/cgroupv2
  ' _ "/sys/fs/cgroup/unified/$node"
  # shellcheck disable=SC2086 # SGC_CILIUM_ARGS is a list of flags
  sgc_start_in_node "$node" cilium-agent env PATH="$llvm:$PATH" "$bin/cilium-agent" \
    --k8s-kubeconfig-path "$KUBECONFIG" \
    --lib-dir "$lib" --state-dir /run/cilium --bpf-root /run/cilium/bpffs \
    --cgroup-root /run/cilium/cgroupv2 \
    --ipam kubernetes --enable-ipv4=true --enable-ipv6=false \
    --routing-mode native --ipv4-native-routing-cidr "$SGC_CLUSTER_CIDR" \
    --enable-ipv4-masquerade=false --enable-bpf-masquerade=false \
    --kube-proxy-replacement=false --bpf-lb-sock=false --devices eth0 \
    --identity-allocation-mode crd --enable-hubble=false --enable-l7-proxy=false \
    --enable-envoy-config=false --enable-health-checking=false \
    --enable-endpoint-health-checking=false --enable-gateway-api=false \
    ${SGC_CILIUM_ARGS:-}
done
for node in "${SGC_NODES[@]}"; do
  SGC_WAIT=300 sgc_wait "cilium agent on $node ready" \
    sgc_in_node "$node" "$bin/cilium-dbg" status --brief
done
