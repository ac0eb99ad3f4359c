#!/usr/bin/env bash
# The main job: a self-contained tour of the agent on this machine. It builds the agent,
# starts it on an embedded config with a temporary store, prepares shares for two
# namespaces, shows the ledger, shows an oversubscription and a policy violation refused,
# kills the agent with SIGKILL, restarts it and shows that nothing was lost.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
ensure_build_deps

echo "==> building shareguard (release)"
cargo build --release --locked -p shareguard
SG="$PWD/target/release/shareguard"

work=$(mktemp -d /tmp/shareguard-showcase.XXXXXX)
agent_pid=""
cleanup() {
  if [ -n "$agent_pid" ]; then { kill -9 "$agent_pid" && wait "$agent_pid"; } 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/agent.toml" <<TOML
[agent]
socket = "$work/agent.sock"
state_dir = "$work/state"
audit_log = "$work/audit.jsonl"
metrics_addr = "127.0.0.1:0"
allowed_uids = [$(id -u)]

# Accounting only: shares are counted in the ledger and reported ACCOUNTED, never
# ENFORCED, because nothing on this device can enforce them.
[[device]]
name = "gen-0"
driver = "shareguard.example.com"
pool = "showcase-node"
kind = "generic"
allowed_namespaces = ["team-a", "team-b"]
admin_namespaces = []
[device.capacity.memory]
value = "40Gi"
default = "5Gi"
valid_range = { min = "5Gi", max = "40Gi", step = "5Gi" }
TOML

sg() { "$SG" --socket "$work/agent.sock" "$@"; }

start_agent() {
  : >"$work/agent.log"
  "$SG" agent --config "$work/agent.toml" >>"$work/agent.log" 2>&1 &
  agent_pid=$!
  # Wait for the condition, not for a fixed time: the ready line names the metrics port.
  for _ in $(seq 1 300); do
    if grep -q " ready " "$work/agent.log"; then
      metrics=$(grep " ready " "$work/agent.log" | tail -1 | tr ' ' '\n' | sed -n 's/^metrics=//p')
      if curl -fsS "http://$metrics/readyz" >/dev/null 2>&1; then return 0; fi
    fi
    kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log"; echo "agent exited" >&2; exit 1; }
    sleep 0.05
  done
  cat "$work/agent.log"; echo "agent not ready after 15 s" >&2; exit 1
}

uuid() { cat /proc/sys/kernel/random/uuid; }

# prepare NAMESPACE CLAIM_UID SHARE_ID AMOUNT: one claim with one share on gen-0.
prepare() {
  sg prepare -f - <<JSON
{"epoch": "1", "claims": [{
  "claim": {"uid": "$2", "namespace": "$1", "name": "$2"},
  "allocationId": "alloc-$2",
  "target": {"podUid": "pod-$2"},
  "allocations": [{"request": "mem", "driver": "shareguard.example.com", "pool": "showcase-node",
    "device": "gen-0", "shareId": "$3", "consumedCapacity": {"memory": "$4"}, "policyVersion": "rv-1"}]}]}
JSON
}

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "start the agent (store in $work/state)"
start_agent
sg devices

step "team-a takes 10Gi, team-b takes 15Gi of gen-0"
prepare team-a claim-a1 "$(uuid)" 10Gi
prepare team-b claim-b1 "$(uuid)" 15Gi

step "the ledger: 25Gi of 40Gi allocated"
sg devices
sg shares

step "oversubscription: team-b asks for 20Gi more, only 15Gi is free -> refused"
if prepare team-b claim-b2 "$(uuid)" 20Gi; then echo "UNEXPECTED: admitted" >&2; exit 1; fi

step "policy violation: 7Gi is not 5Gi + n*5Gi -> refused, not rounded"
if prepare team-a claim-a2 "$(uuid)" 7Gi; then echo "UNEXPECTED: admitted" >&2; exit 1; fi

step "the refusals changed nothing"
sg devices

sg -o json shares >"$work/before.json"
step "SIGKILL the agent (pid $agent_pid), then start it again"
kill -9 "$agent_pid"; wait "$agent_pid" 2>/dev/null || true; agent_pid=""
start_agent
grep " ready " "$work/agent.log" | sed 's/.*\(shares=[0-9]*\).*\(startup_ms=[0-9]*\).*/restarted: \1 \2/'
sg -o json shares >"$work/after.json"
if diff -u "$work/before.json" "$work/after.json"; then
  echo "nothing lost: every share and phase is exactly as before the crash"
else
  echo "shares differ after restart" >&2; exit 1
fi
sg devices

step "release team-a's claim (twice: the second is a no-op) -> capacity freed once"
sg release claim-a1
sg release claim-a1
sg devices

step "audit log (one JSON line per decision)"
cat "$work/audit.jsonl"

step "metrics (excerpt)"
curl -fsS "http://$metrics/metrics" | grep -E '^shareguard_(device|shares|refusals)' || true

echo
echo "showcase complete"
