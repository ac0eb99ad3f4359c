#!/usr/bin/env bash
# Restarts the test cluster's kube-apiserver with some feature gates changed, as a
# cluster whose API server runs with other settings, or with the usual ones when no
# change is given; waits until it is ready again. etcd and everything stored stay.
# Usage: restart-apiserver.sh [GATE=true|false ...]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
gates="$SGC_FEATURE_GATES"
for change in "$@"; do
  name="${change%%=*}"
  case "$change" in
    "$name=true" | "$name=false") ;;
    *) echo "restart-apiserver.sh: $change: not GATE=true or GATE=false" >&2; exit 2 ;;
  esac
  case ",$gates," in
    *",$name=true,"* | *",$name=false,"*)
      gates="$(echo ",$gates," | sed -e "s/,$name=[a-z]*,/,$change,/" -e 's/^,//' -e 's/,$//')" ;;
    *) gates="$gates,$change" ;;
  esac
done
pidfile="$SGC_STATE/run/kube-apiserver.pid"
pid="$(cat "$pidfile")"
# SIGTERM makes kube-apiserver wait up to 60 s for its clients' watches to end; what
# is stored is in etcd, so a kill is as good a restart and takes no minute.
kill -KILL "$pid" 2>/dev/null || true
# Not our child: wait for /proc/PID to go.
SGC_WAIT=30 sgc_wait "kube-apiserver to exit" bash -c "! kill -0 $pid"
sgc_start_apiserver "$gates"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
SGC_WAIT=120 sgc_wait "kube-apiserver /readyz" "$SGC_CACHE/bin/kubectl" get --raw /readyz
sgc_log "kube-apiserver restarted with --feature-gates $gates"
