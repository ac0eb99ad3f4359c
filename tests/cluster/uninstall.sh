#!/usr/bin/env bash
# Uninstalls shareguard from the test cluster as docs/kubernetes.md says a user does:
# `kubectl delete -k` of the kustomization install.sh applied, waiting until every
# object is gone. (Deleting the pods that use shareguard's claims first is the
# caller's part.)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
export PATH="$("$here/build.sh" | tail -n 1):$PATH"
sgc_log "kubectl delete -k (the install's kustomization)"
kubectl delete -k "$SGC_STATE/install" --wait=true --timeout=180s >&2
