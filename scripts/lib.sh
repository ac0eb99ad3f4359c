# Shared by the README's commands: make sure this machine has what the build needs.
# Idempotent: installs only what is missing, so a second run does nothing.

ensure_debs() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "==> installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

# The toolchains the repository pins: rust-toolchain.toml for everything, and
# ebpf/rust-toolchain.toml's dated nightly for the eBPF programs and cargo-fuzz.
_sg_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pinned_channel() {
  sed -n 's/^channel *= *"\(.*\)"/\1/p' "$1"
}
SG_STABLE="$(pinned_channel "$_sg_repo/rust-toolchain.toml")"
SG_NIGHTLY="$(pinned_channel "$_sg_repo/ebpf/rust-toolchain.toml")"

ensure_rust() {
  if ! command -v rustup >/dev/null 2>&1; then
    echo "rustup not found: this machine kind ships Rust via rustup; install it first" >&2
    exit 1
  fi
  # The pinned toolchain with clippy and rustfmt, which are part of the checks. rustup
  # would install it on the first cargo call too; here it happens once, visibly.
  if ! rustup run "$SG_STABLE" cargo clippy --version >/dev/null 2>&1 ||
    ! rustup run "$SG_STABLE" cargo fmt --version >/dev/null 2>&1; then
    echo "==> installing Rust $SG_STABLE (rust-toolchain.toml) with clippy and rustfmt"
    rustup toolchain install "$SG_STABLE" --profile minimal --component clippy,rustfmt
  fi
}

# Debian packages the build and the tests use. protoc is vendored by a crate, so no
# protobuf-compiler is needed; curl serves the showcase's metrics read; gcc builds the
# simulated driver libraries of tests/gpu/simulated-driver-root.sh (and links Rust);
# /usr/bin/python3 is the simulated MPS daemon's control socket listener.
ensure_build_deps() {
  ensure_rust
  ensure_debs ca-certificates curl pkg-config gcc libc6-dev python3
  ensure_bpf_toolchain
}

# The eBPF side of bandwidth enforcement (ebpf/) is built by limiter-net's build script with
# the pinned nightly (build-std needs rust-src) and bpf-linker; its tests need ip/tc and iperf3.
# Fast when everything is there: a file test and one `bpf-linker --version`.
ensure_bpf_toolchain() {
  ensure_debs iproute2 iperf3 iputils-ping

  if ! rustup run "$SG_NIGHTLY" rustc --version >/dev/null 2>&1; then
    echo "==> installing Rust $SG_NIGHTLY (ebpf/rust-toolchain.toml, for the eBPF build)"
    rustup toolchain install "$SG_NIGHTLY" --profile minimal --component rust-src
  fi
  local nightly_sysroot
  nightly_sysroot="$(rustup run "$SG_NIGHTLY" rustc --print sysroot)"
  if [ ! -d "$nightly_sysroot/lib/rustlib/src/rust/library/core" ]; then
    echo "==> adding rust-src to $SG_NIGHTLY (for -Z build-std=core)"
    rustup component add rust-src --toolchain "$SG_NIGHTLY"
  fi

  # A bpf-linker linked against a toolchain's libLLVM stops loading when rustup updates
  # that toolchain; running it is the only check that catches that, so a failing run
  # means reinstall, not just a missing binary.
  if bpf-linker --version >/dev/null 2>&1; then
    return 0
  fi
  # bpf-linker links against the stable toolchain's own libLLVM instead of a system LLVM:
  # Debian 12 has no LLVM that matches the bitcode nightly rustc emits, and the toolchain's
  # copy always matches its major version. Its directory holds the real shared object and a
  # linker script named libLLVM-*.so that lld/ld cannot use for -lLLVM, so a private
  # directory with a plain libLLVM.so symlink serves the link, and an rpath serves the run.
  local sysroot llvm_major llvm_so linkdir
  sysroot="$(rustup run "$SG_STABLE" rustc --print sysroot)"
  llvm_major="$(rustup run "$SG_STABLE" rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')"
  llvm_so="$(find "$sysroot/lib" -maxdepth 1 -type f -name 'libLLVM.so.*-rust-*' | head -n 1)"
  if [ -z "$llvm_major" ] || [ -z "$llvm_so" ]; then
    echo "cannot find the stable toolchain's libLLVM under $sysroot/lib; bpf-linker needs it" >&2
    exit 1
  fi
  linkdir="$(mktemp -d)"
  ln -s "$llvm_so" "$linkdir/libLLVM.so"
  echo "==> installing bpf-linker 0.13 against the toolchain's LLVM $llvm_major (a few minutes)"
  if ! RUSTFLAGS="-L $linkdir -C link-arg=-Wl,-rpath,$sysroot/lib" \
    rustup run "$SG_STABLE" cargo install bpf-linker --version '~0.13' --locked --force \
      --no-default-features --features "llvm-$llvm_major"; then
    rm -rf "$linkdir"
    echo "installing bpf-linker failed" >&2
    exit 1
  fi
  rm -rf "$linkdir"
  bpf-linker --version >/dev/null
}

# Fails, naming what is new, unless everything on the host now was there when
# scripts/host-state.sh looked in "$1" (taken before the work began). $2 names the work for
# the message. What is gone is named but does not fail: the cluster scripts remove what a
# killed earlier run of them left (tests/cluster/up.sh starts with down.sh), and that is
# cleaning, not a leak.
check_host_as_found() {
  local after new gone
  after=$(scripts/host-state.sh | sort)
  new=$(comm -13 <(echo "$1") <(echo "$after"))
  gone=$(comm -23 <(echo "$1") <(echo "$after"))
  if [ -n "$gone" ]; then
    echo "there before $2 and removed by them (a killed earlier run's leftovers):"
    echo "$gone" | sed 's/^/  /'
  fi
  if [ -n "$new" ]; then
    echo "$2 left this behind:" >&2
    echo "$new" | sed 's/^/  /' >&2
    exit 1
  fi
  echo "no queue device, qdisc, pin, network namespace, cgroup, mount or MPS directory left behind"
}

# The fuzz targets in fuzz/ (scripts/fuzz.sh), after ensure_build_deps: cargo-fuzz runs on
# the nightly toolchain that ensure_bpf_toolchain installs (the agent crate in the targets
# builds the eBPF programs too), and libfuzzer-sys compiles libFuzzer with a C++ compiler.
# Fast when all is there.
ensure_fuzz_toolchain() {
  ensure_debs g++
  if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> installing cargo-fuzz (about a minute)"
    cargo install cargo-fuzz --version '~0.13' --locked
  fi
}

# Python clients for the tests that call the agent's socket the way other languages'
# gRPC clients do: grpcio (C-core, which sends the socket's path as the HTTP/2 authority)
# and h2 (a raw HTTP/2 client). In a venv under target/, nothing system-wide; versions
# pinned so that every run tests the same clients. Fast when they are there.
ensure_py_clients() {
  local venv="$PWD/target/pyclients"
  if "$venv/bin/python" -c 'import grpc, h2' >/dev/null 2>&1; then
    return 0
  fi
  echo "==> installing Python gRPC clients (grpcio, h2) in $venv"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    ensure_debs python3-venv
    /usr/bin/python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q 'grpcio==1.85.3' 'h2==4.4.1'
}

# Helm, for tests/tests/integration/chart.rs: it lints deploy/chart and renders it, and deploy/*.yaml
# must equal the default render. Built from the Go module proxy (Helm's release
# downloads are on GitHub), pinned so that every run renders with the same Helm, into
# the cache the test cluster's programs use (tests/cluster/lib.sh), in a folder named by
# the version so that a changed pin builds anew. Exports SHAREGUARD_HELM, where the test
# looks. Fast when it is there.
SHAREGUARD_HELM_VERSION=v4.3.2
ensure_helm() {
  local dir="${SGC_CACHE:-/var/cache/shareguard-cluster}/helm-$SHAREGUARD_HELM_VERSION"
  if [ ! -x "$dir/helm" ]; then
    echo "==> building helm $SHAREGUARD_HELM_VERSION from the Go module proxy into $dir (a few minutes)"
    # Helm 4.3 needs Go 1.26 (its go.mod), as the test cluster's build does; Debian's
    # golang-go is older, so a missing Go is an error, not a package to install.
    if ! command -v go >/dev/null 2>&1; then
      echo "go not found: Helm (and the test cluster, tests/cluster/build.sh) is built with Go 1.26 or later" >&2
      exit 1
    fi
    rm -rf "$dir.tmp"
    mkdir -p "$dir.tmp"
    # The version ldflag is what Helm's release build stamps, so that `helm version`
    # names the pinned release.
    CGO_ENABLED=0 GOBIN="$dir.tmp" go install -trimpath \
      -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$SHAREGUARD_HELM_VERSION" \
      "helm.sh/helm/v4/cmd/helm@$SHAREGUARD_HELM_VERSION"
    rm -rf "$dir"
    mv "$dir.tmp" "$dir"
  fi
  export SHAREGUARD_HELM="$dir/helm"
}
