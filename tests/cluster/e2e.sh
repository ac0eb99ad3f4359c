#!/usr/bin/env bash
# The scenarios on a real cluster (`make e2e`): a fresh cluster from up.sh, the
# scenarios in tests/tests/e2e/ against it (those named in the arguments, or all),
# then the cluster removed, also when a scenario fails. With SGC_CNI=cilium (`make
# e2e-cilium`) the nodes run Cilium, and cilium/checks.sh runs after the scenarios. On
# failure the cluster's logs are kept in target/e2e-logs and the end of each is
# printed, since the cluster itself is gone by then.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"

if [ "$(id -u)" != 0 ]; then
  if [ "${CI:-}" = "true" ]; then
    echo "e2e: CI=true but not root: the cluster scenarios must run in CI" >&2
    exit 1
  fi
  echo "SKIP e2e: the test cluster needs root (namespaces, mounts, cgroups, containers)" >&2
  exit 0
fi

keep_logs() {
  rm -rf "$repo/target/e2e-logs"
  mkdir -p "$repo/target/e2e-logs"
  cp -r "$SGC_STATE/logs/." "$repo/target/e2e-logs/" 2>/dev/null || true
  export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
  local k="$SGC_CACHE/bin/kubectl"
  if [ -x "$k" ] && [ -f "$KUBECONFIG" ]; then
    "$k" get pods -A -o wide >"$repo/target/e2e-logs/pods.txt" 2>&1 || true
    "$k" get events -A --sort-by=.lastTimestamp >"$repo/target/e2e-logs/events.txt" 2>&1 || true
    "$k" -n shareguard-system logs -l app.kubernetes.io/name=shareguard --all-containers \
      --prefix --tail=-1 >"$repo/target/e2e-logs/shareguard.txt" 2>&1 || true
  fi
  for f in "$repo"/target/e2e-logs/*; do
    echo "---- $(basename "$f") (last 30 lines; all of it in target/e2e-logs)" >&2
    tail -n 30 "$f" >&2
  done
}

# Scenario zz installs the chart with Helm: the pinned build scripts/test.sh makes
# (built once, then cached), also when the scenarios run alone (`make e2e`).
if [ -z "${SHAREGUARD_HELM:-}" ]; then
  . "$repo/scripts/lib.sh"
  ensure_helm
fi

started=$SECONDS
out="$("$here/up.sh" | tail -n 2)" || {
  echo "e2e: the cluster did not come up" >&2
  keep_logs
  "$here/down.sh"
  exit 1
}
echo "e2e: cluster up in $((SECONDS - started)) s" >&2
sgc_export_cluster "$out"

status=0
# One scenario at a time: they share two nodes' capacity and measure traffic.
# Arguments, if any, name the scenarios to run (cargo test's filters).
(cd "$repo" && cargo test --locked -p shareguard-tests --test e2e -- --ignored \
  --test-threads=1 "$@") || status=$?
if [ "$SGC_CNI" = cilium ]; then
  "$here/cilium/checks.sh" || status=$?
fi
if [ "$status" != 0 ]; then
  keep_logs
fi
"$here/down.sh" || status=1
echo "e2e: done in $((SECONDS - started)) s" >&2
exit "$status"
