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
if [ "$(cat "$SGC_STATE/run/kube-apiserver.gates" 2>/dev/null)" = "$gates" ]; then
  sgc_log "kube-apiserver already runs with --feature-gates $gates"
  exit 0
fi
# SIGTERM makes kube-apiserver wait up to 60 s for its clients' watches to end; what
# is stored is in etcd, so a kill is as good a restart and takes no minute.
sgc_kill kube-apiserver
sgc_start_apiserver "$gates"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
SGC_WAIT=120 sgc_wait "kube-apiserver /readyz" "$SGC_CACHE/bin/kubectl" get --raw /readyz
# While kube-apiserver starts it refuses its clients (connection refused, then 403
# until its RBAC caches fill), and each refusal doubles a client's watch back-off, up to
# 30 s plus as much again in jitter: kube-controller-manager then took a minute to
# notice a new namespace (no default ServiceAccount, no pod). A control plane restarted
# together is what the next scenario needs; the kubelets and shareguard's plugin keep
# theirs, as on a real node, and the scenarios wait for them.
for daemon in kube-controller-manager kube-scheduler; do
  sgc_kill "$daemon"
done
sgc_start_controller_manager
sgc_start_scheduler
SGC_WAIT=60 sgc_wait "kube-controller-manager /healthz" curl -ksf https://127.0.0.1:10257/healthz
SGC_WAIT=60 sgc_wait "kube-scheduler /healthz" curl -ksf https://127.0.0.1:10259/healthz
sgc_log "kube-apiserver restarted with --feature-gates $gates"
