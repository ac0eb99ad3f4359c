#!/usr/bin/env bash
# Starts the test cluster's control plane alone (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler; no node, no container), with what shareguard's
# kubelet plugin needs from deploy/ (its namespace, ServiceAccount, RBAC, admission
# policies and DeviceClasses; not the DaemonSets, which would make a pod for every node).
# For the fleet simulation (tests/benches/fleet.rs), which plays the nodes' plugins
# itself. Prints KUBECONFIG=<path> and KUBECTL=<path> as its last two lines; down.sh
# removes it, and like up.sh it first removes whatever cluster was there.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"

if [ "$(id -u)" != 0 ]; then
  echo "the control plane needs root (its bridge address)" >&2
  exit 1
fi

"$here/down.sh"
. "$repo/scripts/lib.sh"
ensure_debs openssl ca-certificates

bin="$("$here/build.sh" | tail -n 1)"
export PATH="$bin:$PATH"
mkdir -p "$SGC_STATE"/{logs,run}
"$here/pki.sh"
kc="$SGC_STATE/kubeconfig"

sgc_start_control_plane

sgc_log "the kubelet plugin's namespace, ServiceAccount, RBAC, admission policies, DeviceClasses"
kubectl create namespace shareguard-system >&2
kubectl -n shareguard-system create serviceaccount shareguard-kubelet-plugin >&2
for f in rbac.yaml admission.yaml deviceclasses.yaml; do
  kubectl apply -f "$repo/deploy/$f" >&2
done

echo "KUBECONFIG=$kc/admin.kubeconfig"
echo "KUBECTL=$bin/kubectl"
