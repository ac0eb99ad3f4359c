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

ensure_rust() {
  if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: this machine kind ships a Rust toolchain via rustup; install it first" >&2
    exit 1
  fi
  # clippy and rustfmt are part of the checks; add them if the toolchain lacks them.
  if command -v rustup >/dev/null 2>&1; then
    cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
    cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
  fi
}

# Debian packages the build and the tests use. protoc is vendored by a crate, so no
# protobuf-compiler is needed; curl serves the showcase's metrics read.
ensure_build_deps() {
  ensure_rust
  ensure_debs ca-certificates curl pkg-config
}
