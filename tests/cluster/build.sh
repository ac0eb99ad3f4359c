#!/usr/bin/env bash
# Builds the test cluster's programs from the pinned upstream modules in this folder and
# prints the directory that holds them. Each module's programs are cached under
# $SGC_CACHE (default /var/cache/shareguard-cluster) in a folder named by its release and
# a digest of its go.mod, go.sum and the Go version, so a rerun (or a fresh clone on the
# same machine) builds nothing, and a changed pin builds anew.
#
#   kubernetes  kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy
#               kubectl, etcd (the release k8s.io/kubernetes requires), pause
#   containerd  containerd containerd-shim-runc-v2 ctr
#   runc        runc (with seccomp, as distributions build it)
#   cni         bridge host-local loopback portmap
#   cilium      cilium-agent cilium-cni cilium-dbg, and the agent's BPF sources (only with
#               SGC_CNI=cilium: the Cilium variant, cilium/start.sh)
#
# Usage: build.sh            build what is missing; print the bin directory
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/../../scripts/lib.sh"
# runc is built with cgo and seccomp (below): a C compiler, and libseccomp's headers
# and pkg-config file. Here rather than in each caller: control-plane.sh (the fleet)
# builds runc too.
ensure_debs libseccomp-dev pkg-config gcc libc6-dev >&2
cache="${SGC_CACHE:-/var/cache/shareguard-cluster}"
bin="$cache/bin"
mkdir -p "$bin"

go_version="$(go env GOVERSION)"
# The release a module pins for a program: the version of `mod` in that go.mod
# (in a require block, or on a require line of its own).
pinned() {
  awk -v m="$1" '$1 == m { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$2"
}

# build NAME DIR VERSION CGO TAGS LDFLAGS PACKAGES...: build into $cache/NAME-VERSION-DIGEST
# unless it is there, then link each program into $bin. $MODFILE names another go.mod
# of DIR (its go.sum beside it, as `go build -modfile` reads it).
build() {
  local name="$1" dir="$2" version="$3" cgo="$4" tags="$5" ldflags="$6"
  shift 6
  local digest out mod="${MODFILE:-go.mod}"
  digest="$(cat "$dir/$mod" "$dir/${mod%.mod}.sum" <(echo "$go_version $cgo $tags $ldflags $*") |
    sha256sum | cut -c1-12)"
  out="$cache/$name-$version-$digest"
  if [ ! -f "$out/.done" ]; then
    echo "==> building $name $version ($*) into $out" >&2
    rm -rf "$out.tmp"
    mkdir -p "$out.tmp"
    (cd "$dir" && CGO_ENABLED="$cgo" go build -modfile "$mod" -trimpath -tags "$tags" \
      -ldflags "$ldflags" -o "$out.tmp/" "$@")
    touch "$out.tmp/.done"
    rm -rf "$out"
    mv "$out.tmp" "$out"
  fi
  local f
  for f in "$out"/*; do
    ln -sfn "$f" "$bin/$(basename "$f")"
  done
}

# The Kubernetes release, by $SGC_K8S: 1.36 (the default) from go.mod, 1.37 from
# go.1.37.mod, the same programs with every k8s.io module at the other release.
case "${SGC_K8S:-1.36}" in
  1.36) k8s_mod=go.mod ;;
  1.37) k8s_mod=go.1.37.mod ;;
  *) echo "build.sh: SGC_K8S=$SGC_K8S: the test cluster builds 1.36 or 1.37" >&2; exit 2 ;;
esac
k8s="$(pinned k8s.io/kubernetes "$here/$k8s_mod")"
# What upstream's release build stamps into its programs (hack/lib/version.sh): kubelet
# reports it as the node's kubeletVersion, and kubectl version prints it.
k8s_minor="$(echo "$k8s" | cut -d. -f2)"
ld="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld="$ld -X $p.gitVersion=$k8s -X $p.gitMajor=1 -X $p.gitMinor=$k8s_minor -X $p.gitTreeState=clean"
done
MODFILE="$k8s_mod" build kubernetes "$here" "$k8s" 0 "" "$ld" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet \
  k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubectl ./cmd/etcd ./cmd/pause

ctrd="$(pinned github.com/containerd/containerd/v2 "$here/containerd/go.mod")"
build containerd "$here/containerd" "$ctrd" 0 "" \
  "-s -w -X github.com/containerd/containerd/v2/version.Version=$ctrd" \
  github.com/containerd/containerd/v2/cmd/containerd \
  github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
  github.com/containerd/containerd/v2/cmd/ctr

runc="$(pinned github.com/opencontainers/runc "$here/runc/go.mod")"
# runc's nsenter is C, so cgo is on; seccomp needs libseccomp (Debian's libseccomp-dev).
build runc "$here/runc" "$runc" 1 seccomp "-s -w -X main.version=${runc#v}" \
  github.com/opencontainers/runc

cni="$(pinned github.com/containernetworking/plugins "$here/cni/go.mod")"
build cni "$here/cni" "$cni" 0 "" "-s -w" \
  github.com/containernetworking/plugins/plugins/main/bridge \
  github.com/containernetworking/plugins/plugins/ipam/host-local \
  github.com/containernetworking/plugins/plugins/main/loopback \
  github.com/containernetworking/plugins/plugins/meta/portmap

if [ "${SGC_CNI:-bridge}" = cilium ]; then
  cilium="$(pinned github.com/cilium/cilium "$here/cilium/go.mod")"
  build cilium "$here/cilium" "$cilium" 0 "" \
    "-s -w -X github.com/cilium/cilium/pkg/version.ciliumVersion=${cilium#v}" \
    ./cmd/cilium-agent github.com/cilium/cilium/plugins/cilium-cni \
    github.com/cilium/cilium/cilium-dbg
  # The agent compiles its datapath with clang when it starts, from the C sources in
  # <lib-dir>/bpf: those of the same module, kept beside the programs with its CRDs.
  lib="$cache/cilium-lib-$cilium"
  if [ ! -f "$lib/.done" ]; then
    src="$(cd "$here/cilium" && go list -m -f '{{.Dir}}' github.com/cilium/cilium)"
    rm -rf "$lib"
    mkdir -p "$lib"
    cp -r "$src/bpf" "$lib/bpf"
    # Its CRDs, which Cilium's operator would register (the test cluster runs none).
    cp -r "$src/pkg/k8s/apis/cilium.io/client/crds" "$lib/crds"
    chmod -R u+w "$lib"
    touch "$lib/.done"
  fi
  ln -sfn "$lib" "$bin/cilium-lib"
fi

echo "$bin"
