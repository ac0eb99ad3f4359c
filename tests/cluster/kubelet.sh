#!/usr/bin/env bash
# Stops or starts kubelet of one node of the test cluster, as a node cut off from the
# control plane would have it: SIGTERM and wait until it has exited; start it again with
# the same settings. Pods and containerd keep running meanwhile.
# Usage: kubelet.sh NODE stop|start
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
node="$1"
pidfile="$SGC_STATE/run/$node-kubelet.pid"
case "$2" in
  stop)
    pid="$(cat "$pidfile")"
    kill -TERM "$pid" 2>/dev/null || true
    # Not our child: wait for /proc/PID to go.
    SGC_WAIT=60 sgc_wait "kubelet of $node to exit" bash -c "! kill -0 $pid 2>/dev/null"
    sgc_log "kubelet of $node stopped (was pid $pid)"
    ;;
  start)
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      sgc_log "kubelet of $node runs already (pid $(cat "$pidfile"))"
      exit 0
    fi
    sgc_start_kubelet "$node"
    sgc_log "kubelet of $node started (pid $(cat "$pidfile"))"
    ;;
  *)
    echo "kubelet.sh: $2: stop or start" >&2
    exit 2
    ;;
esac
