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
# nftables for kube-proxy; openssl for the certificates; busybox for the test images'
# shell; iproute2 (tc) and iperf3 go into the images too; gcc builds the simulated
# driver's libraries and the tools image's cuda-probe (build.sh ensures what it needs).
ensure_debs nftables conntrack openssl busybox-static iproute2 iperf3 \
  iputils-ping ca-certificates gcc libc6-dev

bin="$("$here/build.sh" | tail -n 1)"
export PATH="$bin:$PATH"
mkdir -p "$SGC_STATE"/{logs,run}
"$here/pki.sh"
pki="$SGC_STATE/pki"
kc="$SGC_STATE/kubeconfig"

# ---- the host's side: the bridge the nodes hang on, and the control plane ----------
sgc_start_control_plane

# ---- nodes -----------------------------------------------------------------------
"$here/node.sh" "$bin"

# ---- images and shareguard --------------------------------------------------------
"$here/images.sh" "$bin"
"$here/install.sh"

echo "KUBECONFIG=$kc/admin.kubeconfig"
echo "KUBECTL=$bin/kubectl"
