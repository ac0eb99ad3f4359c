#!/usr/bin/env bash
# Starts the test cluster's nodes (lib.sh has the layout): for each, its namespaces and
# folders, its cgroup root, containerd, kubelet and kube-proxy. Called by up.sh with the
# directory of the built programs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"
bin="$1"
export PATH="$bin:$PATH"
pki="$SGC_STATE/pki"
kc="$SGC_STATE/kubeconfig"
ns="$(sgc_ns_dir)"

# Namespace files are bind mounts; a mount namespace can only be bound on a mount that
# is not shared, hence a private mount of the folder that holds them.
mkdir -p "$ns"
mount --bind "$ns" "$ns"
mount --make-private "$ns"

for node in "${SGC_NODES[@]}"; do
  dir="$(sgc_node_dir "$node")"
  ip="$(sgc_node_ip "$node")"
  cidr="$(sgc_node_pod_cidr "$node")"
  cgroot="/$node"
  sgc_log "node $node: $ip, pods $cidr, cgroup root $cgroot"
  mkdir -p "$dir/root"

  # Namespaces. The mount namespace starts private, so nothing mounted in it reaches
  # the host or the other node; it is then made shared within itself, as a node's root
  # is, so that kubelet's mount propagation and containerd's netns mounts work in it.
  touch "$ns/$node.net" "$ns/$node.mnt" "$ns/$node.uts"
  unshare --net="$ns/$node.net" --mount="$ns/$node.mnt" --uts="$ns/$node.uts" \
    --propagation private hostname "$node"

  # The node's own copies of the paths kubelet, containerd, CNI and shareguard use.
  # A mount point that the host lacks is made here and noted, so that down.sh removes
  # exactly what was made.
  for p in "${SGC_NODE_PATHS[@]}"; do
    # Each folder made, parents too (/etc/cni for /etc/cni/net.d), deepest last.
    missing=()
    q="$p"
    while [ ! -e "$q" ]; do
      missing=("$q" "${missing[@]}")
      q="$(dirname "$q")"
    done
    for q in "${missing[@]}"; do
      mkdir "$q"
      echo "$q" >>"$SGC_STATE/made-on-host"
    done
    mkdir -p "$dir/root$p"
  done
  if [ "$SGC_CNI" = cilium ]; then
    cp "$bin"/{cilium-cni,loopback} "$dir/root/opt/cni/bin/"
  else
    cp "$bin"/{bridge,host-local,loopback,portmap} "$dir/root/opt/cni/bin/"
  fi
  # shellcheck disable=SC2016 # expanded by the inner shell
  sgc_in_node "$node" bash -euc '
    mount --make-rshared /
    dir="$1"; shift
    for p in "$@"; do mount --bind "$dir/root$p" "$p"; done
    # A bpffs of its own: each agent pins its programs and maps under
    # /sys/fs/bpf/shareguard, and ifindexes repeat across network namespaces.
    mount -t bpf bpf /sys/fs/bpf
  ' _ "$dir" "${SGC_NODE_PATHS[@]}"

  # Network: eth0 on the host's bridge, forwarding between eth0 and the pods' bridge,
  # and routes to the other node's pods over the bridge (no NAT anywhere).
  ip link add "sgc-$(sgc_node_index "$node")" type veth peer name eth0 netns "$ns/$node.net"
  ip link set "sgc-$(sgc_node_index "$node")" master "$SGC_BRIDGE" up
  sgc_in_node "$node" ip addr add "$ip/24" dev eth0
  sgc_in_node "$node" ip link set eth0 up
  sgc_in_node "$node" ip link set lo up
  sgc_in_node "$node" ip route add default via "$SGC_HOST_IP"
  sgc_in_node "$node" sysctl -qw net.ipv4.ip_forward=1
  ip route add "$cidr" via "$ip"
  for other in "${SGC_NODES[@]}"; do
    [ "$other" = "$node" ] && continue
    sgc_in_node "$node" ip route add "$(sgc_node_pod_cidr "$other")" via "$(sgc_node_ip "$other")"
  done
  if [ "$SGC_CNI" = cilium ]; then
    # Cilium's plugin asks the node's agent (cilium/start.sh) for everything.
    cat >"$dir/root/etc/cni/net.d/05-cilium.conflist" <<EOF
{"cniVersion": "0.3.1", "name": "cilium", "plugins": [{"type": "cilium-cni"}]}
EOF
  else
    cat >"$dir/root/etc/cni/net.d/10-sgc.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "sgc",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$cidr"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
  fi

  # The node's cgroup root in every hierarchy (kubelet refuses a cgroupRoot that does
  # not exist). A new v1 cpuset starts with no CPUs and no memory nodes: copy them.
  for h in /sys/fs/cgroup/*/; do
    mkdir -p "$h${cgroot#/}"
  done
  if [ -d /sys/fs/cgroup/cpuset ]; then
    cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset$cgroot/cpuset.cpus"
    cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset$cgroot/cpuset.mems"
  fi

  # containerd: CRI with the cgroupfs driver (no systemd here), CDI on, runc from the
  # cluster's build, the test pause image as the sandbox image.
  cat >"$dir/root/etc/containerd/config.toml" <<EOF
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.runtime']
  # Root here lacks CAP_SYS_RESOURCE, so no process may lower an OOM score below its
  # own, and runc fails every sandbox kubelet asks -998 for: clamp to containerd's own
  # score, as rootless set-ups do.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$bin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "localhost/shareguard-pause:1"
EOF
  sgc_start_in_node "$node" containerd containerd --config /etc/containerd/config.toml
done

for node in "${SGC_NODES[@]}"; do
  dir="$(sgc_node_dir "$node")"
  sgc_wait "containerd on $node" sgc_in_node "$node" ctr --address /run/containerd/containerd.sock version
done

for node in "${SGC_NODES[@]}"; do
  dir="$(sgc_node_dir "$node")"
  ip="$(sgc_node_ip "$node")"
  cat >"$dir/root/etc/kubernetes/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
# No systemd here, and cgroup v1 controllers with cgroup2 beside them (hybrid): the
# cgroupfs driver, and failCgroupV1 off, which kubelet requires from 1.35 on v1.
cgroupDriver: cgroupfs
cgroupRoot: /$node
failCgroupV1: false
failSwapOn: false
featureGates:
$(echo "$SGC_FEATURE_GATES" | tr ',' '\n' | sed 's/=/: /; s/^/  /')
# No registry can be reached, so an image that garbage collection removed could not
# come back: keep every image. Eviction only when really short of disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 2%, imagefs.available: 2%, nodefs.inodesFree: 2%}
serializeImagePulls: false
resolvConf: /etc/resolv.conf
EOF
  sgc_start_kubelet "$node"
  cat >"$dir/root/etc/kubernetes/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $kc/kube-proxy-$node.kubeconfig}
hostnameOverride: $node
mode: nftables
clusterCIDR: $SGC_CLUSTER_CIDR
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# The conntrack table is the host's: leave its sizes and timeouts alone.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  sgc_start_in_node "$node" kube-proxy kube-proxy --config /etc/kubernetes/kube-proxy.yaml
done

for node in "${SGC_NODES[@]}"; do
  SGC_WAIT=180 sgc_wait "node $node registered" kubectl get node "$node"
done

if [ "$SGC_CNI" = cilium ]; then
  "$here/cilium/start.sh" "$bin"
fi
