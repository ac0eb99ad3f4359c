#!/usr/bin/env bash
# Installs shareguard on the test cluster as a user would: deploy/ applied with kubectl
# through a kustomization of the user's own that names the image built here (no
# registry) and adds nothing else, then waits until both DaemonSets' pods (the agent's
# and the kubelet plugin's) are ready on both nodes and each node has published its
# ResourceSlices.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"
tag="${SGC_SHAREGUARD_TAG:-dev}"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"

overlay="$SGC_STATE/install"
rm -rf "$overlay"
mkdir -p "$overlay"
# The files `kubectl apply -f deploy/` applies (podmonitor.yaml and prometheusrule.yaml
# need the Prometheus Operator's CRDs, which this cluster does not have).
resources=()
for f in "$repo"/deploy/*.yaml; do
  case "$(basename "$f")" in podmonitor.yaml | prometheusrule.yaml) continue ;; esac
  cp "$f" "$overlay/"
  resources+=("$(basename "$f")")
done
{
  echo "apiVersion: kustomize.config.k8s.io/v1beta1"
  echo "kind: Kustomization"
  echo "resources:"
  printf '  - %s\n' "${resources[@]}"
  echo "images:"
  echo "  - name: shareguard"
  echo "    newName: localhost/shareguard"
  echo "    newTag: \"$tag\""
} >"$overlay/kustomization.yaml"

sgc_log "kubectl apply -k (deploy/ with image localhost/shareguard:$tag)"
kubectl apply -k "$overlay" >&2
for ds in shareguard-agent shareguard-kubelet-plugin; do
  kubectl -n shareguard-system rollout status "daemonset/$ds" --timeout=180s >&2
done

# Each node's slices: the plugin publishes one per pool of each driver, owned by the
# node. Wait for at least one from each node.
for node in "${SGC_NODES[@]}"; do
  SGC_WAIT=120 sgc_wait "ResourceSlices of $node" bash -c \
    "kubectl get resourceslices --field-selector spec.nodeName=$node -o name | grep -q ."
done
kubectl get resourceslices -o wide >&2
