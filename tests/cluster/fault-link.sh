#!/usr/bin/env bash
# The second interface each node of the test cluster can be given for fault scenarios,
# `sgf0` (a veth pair with `sgf0p`, both in the node's network namespace): a NIC whose
# link can be taken down, brought up, deleted and added again without touching the
# node's own network (eth0 and the pods' veths). It carries no traffic; the agent
# reads its link state as it does a real NIC's.
# Usage: fault-link.sh NODE add|up|down|del
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
node="$1"
op="$2"
case "$op" in
  add)
    sgc_in_node "$node" ip link add sgf0 type veth peer name sgf0p
    sgc_in_node "$node" ip link set sgf0p up
    sgc_in_node "$node" ip link set sgf0 up
    ;;
  up | down) sgc_in_node "$node" ip link set sgf0 "$op" ;;
  # Deleting one end of a veth pair deletes both; gone already is no error.
  del) sgc_in_node "$node" ip link del sgf0 2>/dev/null || true ;;
  *)
    echo "fault-link.sh: $op: add, up, down or del" >&2
    exit 2
    ;;
esac
sgc_log "$node: sgf0 $op"
