#!/usr/bin/env bash
# Removes everything the test cluster made (lib.sh has the layout), whether up.sh ended,
# failed or was killed halfway: its processes and the containers under each node's
# cgroup root, the nodes' namespaces (and with them their links, pod network
# namespaces, bpffs and pins, nftables rules and mounts), the cgroups, the host's bridge
# and routes, the state folder and the mount points it made on the host. The build cache
# stays. Safe to run when nothing is there.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
ns="$(sgc_ns_dir)"

# Every process of the cluster: the daemons it started (each is a program from the
# cache), the containerd shims, and each container under a node's cgroup root.
cluster_pids() {
  local p exe node h
  for p in /proc/[0-9]*; do
    exe="$(readlink "$p/exe" 2>/dev/null)" || continue
    case "$exe" in "$SGC_CACHE"/*) echo "${p#/proc/}" ;; esac
  done
  for node in "${SGC_NODES[@]}"; do
    for h in /sys/fs/cgroup/*/"$node"; do
      [ -d "$h" ] && find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null
    done
  done
}

kill_all() {
  local pids round
  for round in 1 2 3 4 5 6 7 8 9 10; do
    pids="$(cluster_pids | sort -u)"
    [ -z "$pids" ] && return 0
    if ((round == 1)); then
      # shellcheck disable=SC2086 # a list of pids
      kill -TERM $pids 2>/dev/null
      sleep 1
    else
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null
      sleep 0.5
    fi
  done
  echo "down: processes still running: $(cluster_pids | sort -u | tr '\n' ' ')" >&2
  return 1
}

status=0
kill_all || status=1

for node in "${SGC_NODES[@]}"; do
  for kind in mnt net uts; do
    if mountpoint -q "$ns/$node.$kind" 2>/dev/null; then
      umount "$ns/$node.$kind" || status=1
    fi
  done
  # Cgroups, deepest first; each is empty once its processes are gone.
  for h in /sys/fs/cgroup/*/"$node"; do
    [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} + 2>/dev/null
    if [ -d "$h" ]; then
      echo "down: cgroup $h could not be removed" >&2
      status=1
    fi
  done
done

ip link del "$SGC_BRIDGE" 2>/dev/null
for node in "${SGC_NODES[@]}"; do
  ip link del "sgc-$(sgc_node_index "$node")" 2>/dev/null
done

if mountpoint -q "$ns" 2>/dev/null; then
  umount "$ns" || status=1
fi
if [ -f "$SGC_STATE/made-on-host" ]; then
  sort -ru "$SGC_STATE/made-on-host" | while read -r p; do
    rmdir "$p" 2>/dev/null
  done
fi
if [ -d "$SGC_STATE" ]; then
  # A mount left under the state folder (none should be) would make rm fail rather
  # than delete through it.
  if grep -q " $SGC_STATE/" /proc/self/mountinfo; then
    echo "down: mounts remain under $SGC_STATE" >&2
    status=1
  else
    rm -rf "$SGC_STATE"
  fi
fi
exit $status
