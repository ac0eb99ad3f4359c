#!/usr/bin/env bash
# Builds the test cluster's images without a registry or a Docker daemon and imports
# them into every node's containerd (namespace k8s.io, where kubelet looks):
#
#   localhost/shareguard-pause:1                 the pod sandbox (cmd/pause)
#   localhost/shareguard-e2e-tools:latest        a shell (busybox), iperf3, ping, ip, and
#                                                cuda-probe, which needs a libcuda.so.1
#                                                that only a GPU claim's CDI spec mounts
#   localhost/shareguard:$SGC_SHAREGUARD_TAG     the project's image, built by
#     (default "dev")                            scripts/image.sh (`make image`)
#
# The two test images are each one layer of host binaries and the shared libraries they
# load (read with ldd), written by scripts/oci_image.py. Usage: images.sh BIN_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/lib.sh"
bin="$1"
export PATH="$bin:$PATH"
tag="${SGC_SHAREGUARD_TAG:-dev}"
work="$SGC_STATE/images"
rm -rf "$work"
mkdir -p "$work"

# libs ROOT FILE: copy every shared library FILE loads into ROOT at its path.
libs() {
  local lib
  for lib in $(ldd "$2" 2>/dev/null | awk '/=> \// { print $3 } /^[ \t]*\// { print $1 }'); do
    [ -e "$1$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$1$lib"
  done
}

# add ROOT FILE...: copy each file and the libraries it loads into ROOT at its path.
add() {
  local root="$1" f
  shift
  for f in "$@"; do
    install -D -m 0755 "$f" "$root$f"
    libs "$root" "$f"
  done
}

# A root with the folders a container expects and a passwd naming root.
skeleton() {
  mkdir -p "$1"/{etc,tmp,proc,sys,dev,run,var/run,usr/bin,bin}
  chmod 1777 "$1/tmp"
  echo "root:x:0:0:root:/root:/bin/sh" >"$1/etc/passwd"
  echo "root:x:0:" >"$1/etc/group"
}

sgc_log "image localhost/shareguard-pause:1"
skeleton "$work/pause"
install -m 0755 "$bin/pause" "$work/pause/pause"
python3 "$repo/scripts/oci_image.py" --root "$work/pause" --name localhost/shareguard-pause:1 \
  --entrypoint /pause --out "$work/pause.tar"

sgc_log "image localhost/shareguard-e2e-tools:latest"
tools="$work/tools"
skeleton "$tools"
install -m 0755 /bin/busybox "$tools/bin/busybox"
for applet in sh ls cat sleep echo grep awk sed head tail wc cut tr date env kill ps \
  mkdir rm cp mv id hostname nslookup wget timeout seq sort uniq tee true false test; do
  ln -sf busybox "$tools/bin/$applet"
done
add "$tools" /usr/bin/iperf3 /usr/bin/ping /usr/bin/ip /usr/bin/unshare
# Built against a SIMULATED driver root, which stays out of the image: a container gets
# libcuda.so.1 only from its claim's CDI spec (tests/tests/e2e/, scenario h).
"$repo/tests/gpu/simulated-driver-root.sh" "$work/driver-root" 0 550.54.15 "$work/cuda-probe"
install -D -m 0755 "$work/cuda-probe" "$tools/usr/bin/cuda-probe"
libs "$tools" "$tools/usr/bin/cuda-probe"
python3 "$repo/scripts/oci_image.py" --root "$tools" --name localhost/shareguard-e2e-tools:latest \
  --entrypoint /bin/sh --out "$work/tools.tar"

sgc_log "image localhost/shareguard:$tag (scripts/image.sh, as \`make image\` builds it)"
# The base from the Debian packages the mirror serves today rather than image/base.lock's:
# a point release that replaces a locked package must not stop the tests (docs/image.md).
IMAGE_NAME="localhost/shareguard:$tag" IMAGE_BASE=current IMAGE_OUT="$work/shareguard" \
  "$repo/scripts/image.sh" >&2
cp "$work/shareguard/shareguard.oci.tar" "$work/shareguard.tar"

for node in "${SGC_NODES[@]}"; do
  for image in pause tools shareguard; do
    sgc_in_node "$node" ctr --address /run/containerd/containerd.sock -n k8s.io images import \
      "$work/$image.tar" >/dev/null
  done
  sgc_log "node $node: images imported"
done
