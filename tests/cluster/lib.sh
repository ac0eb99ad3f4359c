# The test cluster's names, addresses and paths, shared by up.sh, down.sh and the e2e
# scenarios. One cluster per machine: a second `up` replaces the first.
#
# Layout (tests/cluster/README.md):
#   host network namespace  bridge sgc0 198.18.0.1/24; etcd (loopback), kube-apiserver
#                           (198.18.0.1:6443), kube-controller-manager, kube-scheduler
#   node N (N = 1, 2)       its own network, mount and UTS namespaces: eth0 198.18.0.1N
#                           on sgc0, pods in 198.18.(15+N).0/24 on the CNI bridge cni0;
#                           containerd, kubelet and kube-proxy, with kubelet's,
#                           containerd's and shareguard's usual host paths bound to
#                           folders of its own, a bpffs of its own, and cgroup root
#                           /sgc-node-N in every hierarchy.
# Every address is in 198.18.0.0/15, the range reserved for benchmarking.

SGC_STATE="${SGC_STATE:-/var/lib/shareguard-cluster}"
SGC_CACHE="${SGC_CACHE:-/var/cache/shareguard-cluster}"
SGC_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The API server's audit log of shareguard's own requests (audit-policy.yaml).
SGC_AUDIT_LOG="$SGC_STATE/logs/audit.log"
SGC_BRIDGE=sgc0
SGC_HOST_IP=198.18.0.1
SGC_API_PORT=6443
SGC_ETCD_PORT=12379
SGC_SERVICE_CIDR=198.19.0.0/24
SGC_SERVICE_IP=198.19.0.1
SGC_CLUSTER_CIDR=198.18.16.0/20
SGC_NODES=(sgc-node-1 sgc-node-2)
# Named explicitly, although 1.36 has each of them on by default, so that the cluster
# keeps testing what it says it tests when defaults move.
SGC_FEATURE_GATES="DynamicResourceAllocation=true,DRAConsumableCapacity=true,DRAPrioritizedList=true,DRAResourceClaimDeviceStatus=true,DRAResourceClaimGranularStatusAuthorization=true,DRADeviceBindingConditions=true"

sgc_node_index() { echo "${1##*-}"; }
sgc_node_ip() { echo "198.18.0.1$(sgc_node_index "$1")"; }
sgc_node_pod_cidr() { echo "198.18.$((15 + $(sgc_node_index "$1"))).0/24"; }
sgc_node_dir() { echo "$SGC_STATE/nodes/$1"; }
sgc_ns_dir() { echo "$SGC_STATE/ns"; }

# The host paths each node has of its own: its kubelet, containerd, CNI, CDI and
# shareguard folders, bound over the host's in the node's mount namespace. /run/nri is
# containerd's NRI socket: shared, the two nodes' containerds raced for it and the one
# that lost stopped ("address already in use").
SGC_NODE_PATHS=(
  /var/lib/kubelet /var/lib/containerd /run/containerd /var/lib/shareguard /run/shareguard
  /run/shareguard-mps /run/nri
  /run/cdi /etc/cni/net.d /var/lib/cni /var/log/pods /var/log/containers /run/netns
  /etc/containerd /opt/cni/bin /etc/kubernetes
)
# The nodes' CNI: bridge (the default: containernetworking's bridge with host-local) or
# cilium, a variant for trying shareguard beside Cilium (cilium/start.sh; docs/platform.md
# says what it showed). The Cilium agent keeps its state in the node's own folders.
SGC_CNI="${SGC_CNI:-bridge}"
case "$SGC_CNI" in
  bridge) ;;
  cilium) SGC_NODE_PATHS+=(/run/cilium /var/lib/cilium) ;;
  *)
    echo "SGC_CNI: '$SGC_CNI' is neither bridge nor cilium" >&2
    exit 1
    ;;
esac

# Run a command inside node $1's namespaces.
sgc_in_node() {
  local node="$1" ns
  shift
  ns="$(sgc_ns_dir)"
  nsenter --net="$ns/$node.net" --mount="$ns/$node.mnt" --uts="$ns/$node.uts" -- "$@"
}

# sgc_start_in_node NODE NAME COMMAND...: a daemon in node NODE's namespaces, in a
# session of its own, its output appended to logs/NODE-NAME.log.
sgc_start_in_node() {
  local node="$1" name="$2" ns
  shift 2
  ns="$(sgc_ns_dir)"
  setsid nsenter --net="$ns/$node.net" --mount="$ns/$node.mnt" --uts="$ns/$node.uts" -- \
    "$@" >>"$SGC_STATE/logs/$node-$name.log" 2>&1 </dev/null &
  echo $! >"$SGC_STATE/run/$node-$name.pid"
}

# kubelet of node $1, with the config node.sh wrote (also used to restart it).
# sgc_start NAME COMMAND...: a daemon on the host in its own session, its output
# appended to logs/NAME.log.
sgc_start() {
  local name="$1"
  shift
  setsid "$@" >>"$SGC_STATE/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$SGC_STATE/run/$name.pid"
}

# etcd on loopback, for kube-apiserver alone (up.sh, control-plane.sh).
sgc_start_etcd() {
  sgc_start etcd etcd --name sgc --data-dir "$SGC_STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$SGC_ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$SGC_ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
    --initial-cluster sgc=http://127.0.0.1:12380 --listen-metrics-urls http://127.0.0.1:12381 \
    --unsafe-no-fsync
}

# sgc_start_apiserver GATES: kube-apiserver with the feature gates GATES (up.sh gives
# $SGC_FEATURE_GATES; restart-apiserver.sh others).
sgc_start_apiserver() {
  local pki="$SGC_STATE/pki"
  sgc_start kube-apiserver "$SGC_CACHE/bin/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$SGC_ETCD_PORT" \
    --bind-address "$SGC_HOST_IP" --advertise-address "$SGC_HOST_IP" --secure-port "$SGC_API_PORT" \
    --service-cluster-ip-range "$SGC_SERVICE_CIDR" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" \
    --client-ca-file "$pki/ca.crt" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc \
    --kubelet-preferred-address-types InternalIP \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
    --allow-privileged=true --feature-gates "$1" --profiling=false \
    --audit-policy-file "$SGC_REPO/tests/cluster/audit-policy.yaml" \
    --audit-log-path "$SGC_AUDIT_LOG" --audit-log-format json
  echo "$1" >"$SGC_STATE/run/kube-apiserver.gates"
}

# The control plane on the host (up.sh, control-plane.sh): the bridge the nodes hang on,
# etcd, kube-apiserver (waited for), kube-controller-manager and kube-scheduler, with the
# usual feature gates. Needs the programs on PATH and pki.sh's certificates; exports
# KUBECONFIG as the admin's.
sgc_start_control_plane() {
  sgc_log "network: bridge $SGC_BRIDGE $SGC_HOST_IP/24"
  ip link add "$SGC_BRIDGE" type bridge
  ip addr add "$SGC_HOST_IP/24" dev "$SGC_BRIDGE"
  ip link set "$SGC_BRIDGE" up

  sgc_log "control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler"
  sgc_start_etcd
  sgc_start_apiserver "$SGC_FEATURE_GATES"
  export KUBECONFIG="$SGC_STATE/kubeconfig/admin.kubeconfig"
  SGC_WAIT=180 sgc_wait "kube-apiserver /readyz" kubectl get --raw /readyz
  sgc_start_controller_manager
  sgc_start_scheduler
}

# kube-controller-manager and kube-scheduler, with the usual feature gates (up.sh, and
# restart-apiserver.sh after each restart of kube-apiserver).
sgc_start_controller_manager() {
  local pki="$SGC_STATE/pki" kc="$SGC_STATE/kubeconfig/controller-manager.kubeconfig"
  sgc_start kube-controller-manager "$SGC_CACHE/bin/kube-controller-manager" \
    --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address 127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
    --service-account-private-key-file "$pki/sa.key" --root-ca-file "$pki/ca.crt" \
    --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --feature-gates "$SGC_FEATURE_GATES" --profiling=false
}

sgc_start_scheduler() {
  local kc="$SGC_STATE/kubeconfig/scheduler.kubeconfig"
  sgc_start kube-scheduler "$SGC_CACHE/bin/kube-scheduler" \
    --kubeconfig "$kc" --authentication-kubeconfig "$kc" --authorization-kubeconfig "$kc" \
    --bind-address 127.0.0.1 --leader-elect=false --feature-gates "$SGC_FEATURE_GATES" \
    --profiling=false
}

# sgc_kill NAME: SIGKILL the host daemon NAME started by sgc_start and wait until it is
# gone (not our child, so by /proc). What the daemons keep is in etcd, so a kill loses
# nothing, and it does not wait out kube-apiserver's minute for watches to end.
sgc_kill() {
  local pid
  pid="$(cat "$SGC_STATE/run/$1.pid")"
  kill -KILL "$pid" 2>/dev/null || true
  SGC_WAIT=30 sgc_wait "$1 to exit" bash -c "! kill -0 $pid"
}

sgc_start_kubelet() {
  local node="$1"
  sgc_start_in_node "$node" kubelet "$SGC_CACHE/bin/kubelet" \
    --config /etc/kubernetes/kubelet.yaml \
    --kubeconfig "$SGC_STATE/kubeconfig/kubelet-$node.kubeconfig" --hostname-override "$node" \
    --node-ip "$(sgc_node_ip "$node")" --v=2
}

sgc_log() { echo "[cluster $(date +%T)] $*" >&2; }

# Wait until `$@` succeeds, up to $SGC_WAIT seconds (default 120), polling every 0.5 s;
# fails with the description $desc.
sgc_wait() {
  local desc="$1" deadline
  shift
  deadline=$((SECONDS + ${SGC_WAIT:-120}))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      sgc_log "timed out waiting for $desc"
      return 1
    fi
    sleep 0.5
  done
}

# Exports SGC_KUBECONFIG and SGC_KUBECTL (and SGC_AUDIT_LOG) for the tests, from what
# up.sh or control-plane.sh printed last: KUBECONFIG=<path> and KUBECTL=<path>.
sgc_export_cluster() {
  SGC_KUBECONFIG="$(echo "$1" | sed -n 's/^KUBECONFIG=//p')"
  SGC_KUBECTL="$(echo "$1" | sed -n 's/^KUBECTL=//p')"
  export SGC_KUBECONFIG SGC_KUBECTL SGC_AUDIT_LOG
}
