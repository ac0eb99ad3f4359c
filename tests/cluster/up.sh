#!/usr/bin/env bash
# Starts the two-node test cluster (lib.sh has the layout), installs shareguard from
# deploy/ as a user would, waits until both nodes are Ready and shareguard has published
# its ResourceSlices, and prints KUBECONFIG=<path> and KUBECTL=<path> as its last two
# lines. The cluster stays up; down.sh removes it. Whatever a killed run left is removed
# first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"

if [ "$(id -u)" != 0 ]; then
  echo "the test cluster needs root (namespaces, mounts, cgroups, containers)" >&2
  exit 1
fi

"$here/down.sh"
. "$repo/scripts/lib.sh"
# libseccomp for runc; nftables for kube-proxy; openssl for the certificates; busybox
# for the test images' shell; iproute2 (tc) and iperf3 go into the images too; gcc
# builds the simulated driver's libraries and the tools image's cuda-probe.
ensure_debs libseccomp-dev nftables conntrack openssl busybox-static iproute2 iperf3 \
  iputils-ping ca-certificates gcc libc6-dev

bin="$("$here/build.sh" | tail -n 1)"
export PATH="$bin:$PATH"
mkdir -p "$SGC_STATE"/{logs,run}
"$here/pki.sh"
pki="$SGC_STATE/pki"
kc="$SGC_STATE/kubeconfig"

# ---- the host's side: the bridge the nodes hang on -------------------------------
sgc_log "network: bridge $SGC_BRIDGE $SGC_HOST_IP/24"
ip link add "$SGC_BRIDGE" type bridge
ip addr add "$SGC_HOST_IP/24" dev "$SGC_BRIDGE"
ip link set "$SGC_BRIDGE" up

# ---- control plane --------------------------------------------------------------
sgc_log "control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler"
sgc_start_etcd
sgc_start_apiserver "$SGC_FEATURE_GATES"
export KUBECONFIG="$kc/admin.kubeconfig"
SGC_WAIT=180 sgc_wait "kube-apiserver /readyz" kubectl get --raw /readyz
sgc_start_controller_manager
sgc_start_scheduler

# ---- nodes -----------------------------------------------------------------------
"$here/node.sh" "$bin"

# ---- images and shareguard --------------------------------------------------------
"$here/images.sh" "$bin"
"$here/install.sh"

echo "KUBECONFIG=$kc/admin.kubeconfig"
echo "KUBECTL=$bin/kubectl"
