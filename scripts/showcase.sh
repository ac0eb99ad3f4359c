#!/usr/bin/env bash
# The main job: a self-contained tour of the agent on this machine. It builds the agent,
# starts it on an embedded config with a temporary store, prepares shares for two
# namespaces, shows the ledger, shows an oversubscription and a policy violation refused,
# kills the agent with SIGKILL, restarts it and shows that nothing was lost; then two pods
# get bandwidth shares before their sandboxes exist (as kubelet prepares claims), the
# agent finds each sandbox itself and enforces it, iperf3 measures both, one pod goes
# away and its share waits again; and a GPU share is limited, watched and its over-limit
# process terminated (on the SIMULATED GPU back end: no GPU here); and the Kubernetes
# part: the kubelet plugin registers, publishes a ResourceSlice and prepares a claim for a
# pod through an API-server STAND-IN, and the claim's status says what is enforced. It
# ends by checking that it left nothing behind on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps

echo "==> building shareguard (release)"
cargo build --release --locked -p shareguard
cargo build --release --locked -p shareguard-tests --example kubernetes
SG="$PWD/target/release/shareguard"
host_before=$(scripts/host-state.sh | sort)

work=$(mktemp -d /tmp/shareguard-showcase.XXXXXX)
agent_pid=""
pins="/sys/fs/bpf/shareguard-showcase-$$"
tag="sgs$(( $$ % 100000 ))"
gpu_pid=""
# A pod cgroup laid out as the kubelet's systemd driver lays it out, under a directory of
# our own; on the cgroup v2 hierarchy (the unified one on a hybrid host).
cg2=/sys/fs/cgroup; [ -e "$cg2/cgroup.controllers" ] || cg2=/sys/fs/cgroup/unified
gpu_pod_uid="5e0c1a2b-0000-4000-8000-$(printf '%012d' $$)"
gpu_cg_top="shareguard-showcase-$$.slice"
gpu_cg="$gpu_cg_top/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod${gpu_pod_uid//-/_}.slice/cri-containerd-showcase.scope"
# Cgroup directories made here, parents first, and the pods' sandbox processes.
cgroups_made=()
sandboxes=()
rm_cgroups() { # removes the directories made here under $1 (or all), deepest first
  local i
  for (( i=${#cgroups_made[@]}-1; i>=0; i-- )); do
    case "${cgroups_made[$i]}" in "$cg2/${1:-}"*) rmdir "${cgroups_made[$i]}" 2>/dev/null || true ;; esac
  done
}
cleanup() {
  # Release what the agent still enforces, so its queue devices go; if it is gone, its
  # install records name them.
  if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
    sg release bw-a bw-b gpu-a >/dev/null 2>&1 || true
  fi
  if [ -n "$agent_pid" ]; then { kill -9 "$agent_pid" && wait "$agent_pid"; } 2>/dev/null || true; fi
  agent_pid=""
  for f in "$work"/state/net/*.json; do
    [ -e "$f" ] || continue
    queue=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("queue") or "")' "$f")
    [ -n "$queue" ] && ip link del "$queue" 2>/dev/null || true
  done
  if [ -n "$gpu_pid" ]; then kill -9 "$gpu_pid" 2>/dev/null || true; fi
  for p in "${sandboxes[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm_cgroups
  pkill -f "iperf3 -s -B 198.19.0" 2>/dev/null || true
  for p in a b; do
    ip link del "${tag}$p" 2>/dev/null || true
    ip netns del "${tag}-$p" 2>/dev/null || true
  done
  rm -rf "$pins" "$work"
}
trap cleanup EXIT
mkcg() { # makes $cg2/$1 and what is missing above it, remembering each directory
  local d="$cg2" part
  local IFS=/
  for part in $1; do
    d="$d/$part"
    if [ ! -d "$d" ]; then mkdir "$d"; cgroups_made+=("$d"); fi
  done
}

cat >"$work/agent.toml" <<TOML
[agent]
socket = "$work/agent.sock"
state_dir = "$work/state"
audit_log = "$work/audit.jsonl"
metrics_addr = "127.0.0.1:0"
allowed_uids = [$(id -u)]
bpffs_dir = "$pins"
cdi_dir = "$work/cdi"
# SIMULATION: the simulated GPU reports the compute processes listed in this file.
simulated_gpu_processes = "$work/gpu-processes.json"

# Accounting only: shares are counted in the ledger and reported ACCOUNTED, never
# ENFORCED, because nothing on this device can enforce them.
[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "showcase-node"
kind = "generic"
allowed_namespaces = ["team-a", "team-b"]
admin_namespaces = []
[device.capacity.memory]
value = "40Gi"
default = "5Gi"
valid_range = { min = "5Gi", max = "40Gi", step = "5Gi" }

# Enforced: both directions of each pod's traffic, on the host side of its veth.
[[device]]
name = "nic-0"
driver = "shareguard.example.com"
pool = "showcase-node"
kind = "net"
allowed_namespaces = ["team-a", "team-b"]
[device.capacity.bandwidth]
value = "1G"
default = "10M"
valid_range = { min = "10M", max = "1G", step = "10M" }

# GPU memory on the SIMULATED back end (this machine has no GPU; on one with NVIDIA's
# driver: backend = "nvml" and uuid or index). The watchdog polls every 200 ms and ends
# a process whose share stays over its limit for 1 s.
[[device]]
name = "gpu-0"
driver = "shareguard.example.com"
pool = "showcase-node"
kind = "gpu"
backend = "simulated"
allowed_namespaces = ["team-a", "team-b"]
watchdog = { period = "200ms", action = "terminate", grace = "1s" }
[device.simulated]
memory = "80Gi"
[device.capacity.memory]
default = "1Gi"
valid_range = { min = "1Gi", step = "1Gi" }
TOML

sg() { "$SG" --socket "$work/agent.sock" "$@"; }

start_agent() {
  : >"$work/agent.log"
  "$SG" agent --config "$work/agent.toml" >>"$work/agent.log" 2>&1 &
  agent_pid=$!
  # Wait for the condition, not for a fixed time: the ready line names the metrics port.
  for _ in $(seq 1 300); do
    if grep -q " ready " "$work/agent.log"; then
      metrics=$(grep " ready " "$work/agent.log" | tail -1 | tr ' ' '\n' | sed -n 's/^metrics=//p')
      if curl -fsS "http://$metrics/readyz" >/dev/null 2>&1; then return 0; fi
    fi
    kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log"; echo "agent exited" >&2; exit 1; }
    sleep 0.05
  done
  cat "$work/agent.log"; echo "agent not ready after 15 s" >&2; exit 1
}

uuid() { cat /proc/sys/kernel/random/uuid; }

# prepare NAMESPACE CLAIM_UID SHARE_ID AMOUNT: one claim with one share on gen-0.
prepare() {
  sg prepare -f - <<JSON
{"epoch": "0", "claims": [{
  "claim": {"uid": "$2", "namespace": "$1", "name": "$2"},
  "allocationId": "alloc-$2",
  "allocations": [{"request": "mem", "driver": "shareguard.example.com", "pool": "showcase-node",
    "device": "gen-0", "shareId": "$3", "consumedCapacity": {"memory": "$4"}, "policyVersion": "rv-1"}]}]}
JSON
}

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "start the agent (store in $work/state)"
start_agent
sg devices

step "team-a takes 10Gi, team-b takes 15Gi of gen-0"
prepare team-a claim-a1 "$(uuid)" 10Gi
prepare team-b claim-b1 "$(uuid)" 15Gi

step "the ledger: 25Gi of 40Gi allocated"
sg devices
sg shares

step "oversubscription: team-b asks for 20Gi more, only 15Gi is free -> refused"
if prepare team-b claim-b2 "$(uuid)" 20Gi; then echo "UNEXPECTED: admitted" >&2; exit 1; fi

step "policy violation: 7Gi is not 5Gi + n*5Gi -> refused, not rounded"
if prepare team-a claim-a2 "$(uuid)" 7Gi; then echo "UNEXPECTED: admitted" >&2; exit 1; fi

step "the refusals changed nothing"
sg devices

sg -o json shares >"$work/before.json"
step "SIGKILL the agent (pid $agent_pid), then start it again"
kill -9 "$agent_pid"; wait "$agent_pid" 2>/dev/null || true; agent_pid=""
start_agent
grep " ready " "$work/agent.log" | sed 's/.*\(shares=[0-9]*\).*\(startup_ms=[0-9]*\).*/restarted: \1 \2/'
sg -o json shares >"$work/after.json"
if diff -u "$work/before.json" "$work/after.json"; then
  echo "nothing lost: every share and phase is exactly as before the crash"
else
  echo "shares differ after restart" >&2; exit 1
fi
sg devices

step "release team-a's claim (twice: the second is a no-op) -> capacity freed once"
sg release claim-a1
sg release claim-a1
sg devices

step "bandwidth: two pods share nic-0 (1G); kubelet prepares a claim before the pod's sandbox exists"
pod_a=$(uuid); pod_b=$(uuid)
bw_prepare() { # NAMESPACE CLAIM POD_UID RATE: the pod's uid is all kubelet's plugin knows
  sg prepare -f - <<JSON
{"epoch": "0", "claims": [{
  "claim": {"uid": "$2", "namespace": "$1", "name": "$2"},
  "allocationId": "alloc-$2",
  "target": {"podUids": ["$3"]},
  "allocations": [{"request": "net", "driver": "shareguard.example.com", "pool": "showcase-node",
    "device": "nic-0", "shareId": "$(uuid)", "consumedCapacity": {"bandwidth": "$4"}, "policyVersion": "rv-1"}]}]}
JSON
}
bw_prepare team-a bw-a "$pod_a" 200M >/dev/null
bw_prepare team-b bw-b "$pod_b" 100M >/dev/null
echo "admitted, capacity held, waiting for the pods' sandboxes:"
sg shares --device nic-0
# A pod: a network namespace with a veth pair (addresses from 198.19.0.0/24, part of the
# 198.18.0.0/15 benchmarking range, so nothing leaves this machine), a pod cgroup laid
# out as kubelet lays it out (pod a: systemd driver, pod b: cgroupfs driver, each under a
# directory of our own, as kind nests kubelet's tree) and a sandbox process in both.
mkpod() { # NAME INDEX POD_UID
  local ns="${tag}-$1" host="${tag}$1" rel
  ip netns add "$ns"
  ip link add "$host" type veth peer name "${tag}p$1"
  ip link set "${tag}p$1" netns "$ns"
  ip -n "$ns" link set "${tag}p$1" name eth0
  ip addr add "198.19.0.$(( $2 * 4 + 1 ))/30" dev "$host"
  ip link set "$host" up
  ip -n "$ns" addr add "198.19.0.$(( $2 * 4 + 2 ))/30" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip netns exec "$ns" iperf3 -s -B "198.19.0.$(( $2 * 4 + 2 ))" -p 5201 -D
  if [ "$1" = a ]; then
    rel="sgs-$$-$1.slice/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod${3//-/_}.slice/cri-containerd-sandbox$1.scope"
  else
    rel="sgs-$$-$1/kubepods/burstable/pod$3/sandbox$1"
  fi
  mkcg "$rel"
  ip netns exec "$ns" sleep 100000 &
  sandboxes+=("$!")
  echo "$!" >"$cg2/$rel/cgroup.procs"
  echo "pod $1 ($3): sandbox process $! in $rel, host veth $host"
}
wait_phase() { # NAMESPACE PHASE: until the namespace's nic-0 share is in PHASE
  for _ in $(seq 1 300); do
    [ "$(sg -o json shares --device nic-0 --namespace "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["shares"][0]["phase"])')" = "$2" ] && return 0
    sleep 0.05
  done
  echo "the $1 share is not $2 after 15 s" >&2; sg shares --device nic-0; exit 1
}
mkpod a 0 "$pod_a"
mkpod b 1 "$pod_b"
wait_phase team-a ENFORCED
wait_phase team-b ENFORCED
echo "both sandboxes found and enforced, with no further call:"
sg shares --device nic-0
measure() { # ADDR [-R]
  for _ in $(seq 1 100); do iperf3 -c "$1" -p 5201 -t 1 -O 0 >/dev/null 2>&1 && break; sleep 0.1; done
  iperf3 -c "$1" -p 5201 -t 5 -O 1 ${2:-} -J | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e6, 1))'
}
printf '\n%-6s %-8s %-14s %-16s %-16s\n' POD LIMIT ENFORCED "TO POD Mbit/s" "FROM POD Mbit/s"
for p in a b; do
  idx=0; [ "$p" = b ] && idx=1
  share=$(sg -o json shares --device nic-0 --namespace "team-$p" | python3 -c 'import json,sys; s=json.load(sys.stdin)["shares"][0]; print(s["limits"][0]["requested"], s["limits"][0]["enforced"])')
  to=$(measure "198.19.0.$(( idx * 4 + 2 ))")
  from=$(measure "198.19.0.$(( idx * 4 + 2 ))" -R)
  printf '%-6s %-8s %-14s %-16s %-16s\n' "$p" ${share} "$to" "$from"
done
echo "(TCP goodput tops out at 1448/1514 = 0.956 of an Ethernet-level limit)"

step "pod b is deleted before its Unprepare: its share waits again, capacity held, its queue devices gone"
kill -9 "${sandboxes[1]}"; wait "${sandboxes[1]}" 2>/dev/null || true
rm_cgroups "sgs-$$-b"
ip link del "${tag}b"; ip netns del "${tag}-b"
wait_phase team-b PENDING
sg shares --device nic-0
sg devices | grep -E 'NAME|nic-0'
sg release bw-a bw-b
echo "released: $(ip -o link show group 21319 | grep -c sgb || true) shareguard queue devices left"

step "GPU: a share of gpu-0 (SIMULATED back end: no NVIDIA GPU on this machine)"
mkcg "$gpu_cg"
sleep 600 & gpu_pid=$!
echo "$gpu_pid" >"$cg2/$gpu_cg/cgroup.procs"
echo "pod $gpu_pod_uid: process $gpu_pid in cgroup $gpu_cg"
gpu_share=$(uuid)
sg prepare -f - <<JSON
{"epoch": "0", "claims": [{
  "claim": {"uid": "gpu-a", "namespace": "team-a", "name": "gpu-a"},
  "allocationId": "alloc-gpu-a",
  "target": {"podUids": ["$gpu_pod_uid"]},
  "allocations": [{"request": "gpu", "driver": "shareguard.example.com", "pool": "showcase-node",
    "device": "gpu-0", "shareId": "$gpu_share", "consumedCapacity": {"memory": "8Gi"}, "policyVersion": "rv-1"}]}]}
JSON
sg shares --device gpu-0
echo "CDI spec written for the claim ($work/cdi):"
cat "$work/cdi/"*gpu-a.json

step "GPU: the process uses 12Gi of its 8Gi share -> the watchdog reports, then terminates it"
printf '[{"gpu_uuid": "GPU-simulated-gpu-0", "pid": %d, "used_bytes": %d}]\n' "$gpu_pid" $((12 << 30)) >"$work/gpu-processes.json"
for _ in $(seq 1 200); do grep -q '"decision":"over_limit"' "$work/audit.jsonl" && break; sleep 0.05; done
echo "within the grace period (1s) the share's status says what the watchdog sees:"
sg -o json shares --device gpu-0 | python3 -c 'import json,sys; s=json.load(sys.stdin)["shares"][0]; print("usage:", s.get("usage")); print("reason:", s["reason"])'
for _ in $(seq 1 200); do kill -0 "$gpu_pid" 2>/dev/null || break; sleep 0.05; done
if kill -0 "$gpu_pid" 2>/dev/null; then echo "process $gpu_pid still runs after 10 s" >&2; exit 1; fi
wait "$gpu_pid" 2>/dev/null || true
echo "process $gpu_pid is gone"
gpu_pid=""
grep -E '"decision":"(over_limit|terminate)"' "$work/audit.jsonl"
sg release gpu-a >/dev/null
echo "released: CDI spec removed: $(ls "$work/cdi" | wc -l) spec files left"

step "Kubernetes: the kubelet plugin between kubelet and an API-server STAND-IN (no kube-apiserver here)"
# The real `shareguard kubelet-plugin` over this agent: it registers with "kubelet" (calls
# made from kubelet's own API definitions), publishes nic-0 as a ResourceSlice, prepares
# a claim for 200M before the pod's sandbox exists, and writes the enforced limit into the
# ResourceClaim's status. Its instance takes a new epoch, which fences the CLI's epoch 0 (the fresh agent's),
# so this comes after the steps above.
"$PWD/target/release/examples/kubernetes" "$work/agent.sock"

step "audit log (one JSON line per decision)"
cat "$work/audit.jsonl"

step "metrics (excerpt)"
curl -fsS "http://$metrics/metrics" | grep -E '^shareguard_(device|shares|refusals|share_|gpu_)' || true

step "the host as found"
cleanup
trap - EXIT
check_host_as_found "$host_before" "the showcase"

echo
echo "showcase complete"
