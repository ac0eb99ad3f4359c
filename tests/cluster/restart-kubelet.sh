#!/usr/bin/env bash
# Restarts kubelet of one node of the test cluster, as a node upgrade or a crash would:
# SIGTERM, wait until it has exited, start it again with the same settings. Pods and
# containerd keep running meanwhile. Usage: restart-kubelet.sh NODE
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
node="$1"
pidfile="$SGC_STATE/run/$node-kubelet.pid"
pid="$(cat "$pidfile")"
kill -TERM "$pid"
# Not our child: wait for /proc/PID to go.
SGC_WAIT=60 sgc_wait "kubelet of $node to exit" bash -c "! kill -0 $pid"
sgc_start_kubelet "$node"
sgc_log "kubelet of $node restarted (was pid $pid, now $(cat "$pidfile"))"
