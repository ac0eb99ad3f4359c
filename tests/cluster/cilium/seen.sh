#!/usr/bin/env bash
# On the Cilium variant of the test cluster (SGC_CNI=cilium make cluster-up): does
# Cilium's own program on a pod's host veth still see every packet of the pod, in both
# directions, with the pod's bandwidth share enforced by shareguard in front of it?
#
# Makes a namespace with an iperf3 server pod and a client pod holding a 100M share
# on sgc-node-1, prints the TCX programs on the client's host veth (in chain order), then
# runs iperf3 each way for 5 s with kernel.bpf_stats_enabled on, and prints, per hook,
# each program's runs against the packets the veth itself counted, and the rate. Removes
# what it made and restores the sysctl, also when it fails.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
. "$here/lib.sh"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
export PATH="$SGC_CACHE/bin:$PATH"
node=sgc-node-1
ns="sgc-seen-$$"
image=localhost/shareguard-e2e-tools:latest
stats_before="$(sysctl -n kernel.bpf_stats_enabled)"
cleanup() {
  sysctl -qw kernel.bpf_stats_enabled="$stats_before"
  kubectl delete namespace "$ns" --wait=false >/dev/null 2>&1 || true
}
trap cleanup EXIT

kubectl create namespace "$ns" >/dev/null
kubectl apply -f - >/dev/null <<YAML
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: net, namespace: $ns}
spec:
  devices:
    requests:
    - name: net
      exactly:
        deviceClassName: shareguard-net-bandwidth
        capacity: {requests: {bandwidth: 100M}}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: $ns}
spec:
  nodeSelector: {kubernetes.io/hostname: $node}
  terminationGracePeriodSeconds: 1
  containers:
  - {name: tools, image: $image, imagePullPolicy: Never, command: [iperf3, -s]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: $ns}
spec:
  nodeSelector: {kubernetes.io/hostname: $node}
  terminationGracePeriodSeconds: 1
  resourceClaims: [{name: net, resourceClaimName: net}]
  containers:
  - name: tools
    image: $image
    imagePullPolicy: Never
    command: [sleep, "86400"]
    resources: {claims: [{name: net}]}
YAML
kubectl -n "$ns" wait --for condition=Ready --timeout=120s pod/server pod/client >/dev/null
server="$(kubectl -n "$ns" get pod server -o jsonpath='{.status.podIP}')"
client="$(kubectl -n "$ns" get pod client -o jsonpath='{.status.podIP}')"
SGC_WAIT=60 sgc_wait "the client's share Enforced in its claim" bash -c \
  "kubectl -n $ns get resourceclaim net -o jsonpath='{.status.devices[*].conditions[?(@.type==\"Enforced\")].status}' | grep -q True"

# The client's host veth: the one Cilium's endpoint for its address names.
veth="$(sgc_in_node "$node" cilium-dbg endpoint list -o json |
  jq -r --arg ip "$client" '.[] | select(.status.networking.addressing[0].ipv4 == $ip) |
    .status.networking["interface-name"]')"
[ -n "$veth" ] || { echo "no Cilium endpoint for $client" >&2; exit 1; }
echo "client $client on $node, host veth $veth; server $server"

# Program ids on a TCX hook of the veth, in chain order, with their names (Debian's
# bpftool predates TCX, so the query is made here).
progs() { # hook
  local id
  for id in $(sgc_in_node "$node" python3 -c "$tcx_query" "$veth" "$1"); do
    echo "$id $(bpftool -j prog show id "$id" | jq -r .name)"
  done
}
tcx_query='
import ctypes, os, socket, struct, sys
# BPF_PROG_QUERY (16) on a TCX hook of an interface of this network namespace: the
# program ids attached, in chain order.
BPF_PROG_QUERY = 16
HOOKS = {"ingress": 46, "egress": 47}  # BPF_TCX_INGRESS, BPF_TCX_EGRESS
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ifindex = socket.if_nametoindex(sys.argv[1])
ids = (ctypes.c_uint32 * 64)()
attr = ctypes.create_string_buffer(128)
struct.pack_into("IIIIQI", attr, 0, ifindex, HOOKS[sys.argv[2]], 0, 0,
                 ctypes.addressof(ids), 64)
if libc.syscall(321, BPF_PROG_QUERY, attr, 128) != 0:
    sys.exit(f"BPF_PROG_QUERY: {os.strerror(ctypes.get_errno())}")
count = struct.unpack_from("I", attr, 24)[0]
print(" ".join(str(ids[i]) for i in range(count)))

'
runs() { bpftool -j prog show id "$1" | jq -r '.run_cnt // 0'; }
counter() { # rx or tx
  sgc_in_node "$node" ip -s -j link show dev "$veth" | jq -r ".[0].stats64.$1.packets"
}

# Packets the share's own queue dropped (shaping drops what is over the limit; those
# never come back to the veth, so no program after shareguard's sees them): the root
# qdisc of the queue device shareguard made for the share, found by its alias.
share="$(kubectl -n "$ns" get resourceclaim net -o jsonpath='{.status.allocation.devices.results[0].shareID}')"
queue="$(sgc_in_node "$node" ip -j link show | jq -r --arg id "$share" '.[] |
  select((.ifalias // "") | startswith("shareguard queue of share") and contains($id)) |
  .ifname' | head -n 1)"
[ -n "$queue" ] || { echo "no queue device for share $share" >&2; exit 1; }
drops() {
  sgc_in_node "$node" tc -s -j qdisc show dev "$queue" | jq '[.[] | select(.root) | .drops] | add // 0'
}
# Whether the share's queue holds no packet: what it still holds when iperf3 ends has
# passed shareguard's program once and the programs after it not yet.
drained() {
  [ "$(sgc_in_node "$node" tc -s -j qdisc show dev "$queue" |
    jq '[.[] | select(.root) | .qlen] | add // 0')" = 0 ]
}

# The claim's Enforced condition as shareguard's plugin wrote it.
enforced() {
  kubectl -n "$ns" get resourceclaim net -o json | jq -r '.status.devices[]?.conditions[]? |
    select(.type == "Enforced") | "Enforced=\(.status) (\(.reason)): \(.message)"'
}
not_enforced() { ! enforced | grep -q '^Enforced=True'; }

sysctl -qw kernel.bpf_stats_enabled=1
failed=0
for dir in out in; do
  # Out of the pod: the veth receives (its ingress hook); into the pod it sends (egress).
  if [ "$dir" = out ]; then hook=ingress counter=rx rev=""; else hook=egress counter=tx rev=-R; fi
  mapfile -t chain < <(progs "$hook")
  declare -A before=()
  for p in "${chain[@]}"; do before[$p]="$(runs "${p%% *}")"; done
  pk0="$(counter "$counter")" d0="$(drops)"
  rate="$(kubectl -n "$ns" exec client -- iperf3 -c "$server" -t 5 -O 1 -J $rev |
    jq -r '.end.sum_received.bits_per_second / 1e6 | floor')"
  SGC_WAIT=10 sgc_wait "the share's queue to drain" drained
  d1="$(drops)" pk1="$(counter "$counter")"
  packets=$((pk1 - pk0)) dropped=$((d1 - d0))
  echo "$dir of the pod: ${rate} Mbit/s under a 100M share; $veth $counter +$packets," \
    "the share's queue dropped $dropped; tcx/$hook in order:"
  for p in "${chain[@]}"; do
    ran=$(($(runs "${p%% *}") - before[$p]))
    echo "  ${p#* } (id ${p%% *}): ran $ran times"
    # A program every packet passes ran as often as the veth counted, less what the
    # queue dropped, within 1%: the veth counts a packet when the pod sends it, the
    # programs when the host processes it, and GRO may merge a few in between. One that
    # another program's verdict skips, or that a redirect passes by, misses them all.
    missed=$((packets - dropped - ran))
    if ((missed * 100 > packets)); then
      echo "  FAIL: ${p#* } missed $missed of the pod's $packets packets" >&2
      failed=1
    fi
  done
  unset before
  # The claim's Enforced condition, as shareguard's plugin wrote it, must not say True
  # while the pod gets more than its share: over the limit, wait for the agent's next
  # look (its reconcile period) to say otherwise.
  if ((rate > 110)) && ! SGC_WAIT=30 sgc_wait "the claim to stop saying Enforced" not_enforced; then
    echo "  FAIL: $rate Mbit/s under a 100M share, and the claim still says it is enforced" >&2
    failed=1
  fi
  echo "  the claim says: $(enforced)"
done
exit "$failed"
