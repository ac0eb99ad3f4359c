#!/usr/bin/env bash
# `make image`: shareguard's container image, built so that the same commit gives the same
# image digest on any machine of this kind, without a Docker daemon or a registry
# (docs/image.md says what goes in, and how a release publishes it).
#
#   make image                                 amd64
#   IMAGE_ARCHES="amd64 arm64" make image      one multi-arch image (arm64 cross-built)
#
# IMAGE_NAME   the reference it is named by (default shareguard:<the agent's version>)
# IMAGE_OUT    where it is written (default target/image)
# IMAGE_BASE   locked (the default): the base's Debian packages at the versions and
#              digests image/base.lock names, or fail; current: what the Debian mirror
#              serves today (the test cluster's build), with its differences from the
#              lock printed
# IMAGE_LOCK=1 rewrite image/base.lock from the packages this build used
# IMAGE_LOCK_FILE  the lock read and written (default image/base.lock)
#
# It writes, in IMAGE_OUT:
#   shareguard.oci.tar        an OCI image layout (`ctr images import`, `skopeo copy oci-archive:`)
#   shareguard.digests        the image's digest, then each architecture's manifest
#   shareguard.spdx.json      the SBOM: the crates in the binary, the base's Debian packages
#   shareguard-ARCH           the binary in the image; shareguard-ARCH.debug its debug info
#   base-ARCH.packages        the Debian packages the base was made from, with digests
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
. scripts/lib.sh

version=$(sed -n '/^\[workspace.package\]/,/^\[/ s/^version = "\(.*\)"/\1/p' Cargo.toml)
name="${IMAGE_NAME:-shareguard:$version}"
arches="${IMAGE_ARCHES:-amd64}"
out="${IMAGE_OUT:-$repo/target/image}"
base_mode="${IMAGE_BASE:-locked}"
lock="${IMAGE_LOCK_FILE:-$repo/image/base.lock}"
lock_name="${lock#"$repo"/}"
debs="${IMAGE_DEB_CACHE:-/var/cache/shareguard-image/debs}"
case "$base_mode" in locked | current) ;; *)
  echo "IMAGE_BASE=$base_mode: must be locked or current" >&2
  exit 1
  ;;
esac

# The programs the agent runs besides itself (tc for qdiscs and HTB classes; unshare and
# mount for each MPS daemon's /dev/shm) and the packages they and shareguard's own
# libraries come from. image_base.py copies the programs and exactly the libraries they
# load, and fails naming a library none of these packages has.
programs=(/sbin/tc /usr/bin/unshare /bin/mount /bin/umount)
packages=(libc6 libgcc-s1 iproute2 libbpf1 libelf1 zlib1g libmnl0 libbsd0 libmd0 libcap2
  libxtables12 util-linux mount libmount1 libblkid1 libselinux1 libpcre2-8-0)

# The directory every build sees its inputs at, whatever the checkout's, cargo's and
# rustup's paths on this machine: they end up in the binary (panic locations, the eBPF
# object's BTF), so they must not vary. Each build mounts its own tmpfs there in a mount
# namespace of its own, so the host's directory stays empty and builds can run side by side.
canonical=/tmp/shareguard-image-build

rust_triple() { case "$1" in amd64) echo x86_64-unknown-linux-gnu ;; arm64) echo aarch64-unknown-linux-gnu ;; esac; }
gnu_triple() { case "$1" in amd64) echo x86_64-linux-gnu ;; arm64) echo aarch64-linux-gnu ;; esac; }
for arch in $arches; do
  if [ -z "$(rust_triple "$arch")" ]; then
    echo "IMAGE_ARCHES: $arch is not one this build makes (amd64, arm64)" >&2
    exit 1
  fi
done

ensure_build_deps
ensure_debs binutils
for arch in $arches; do
  if [ "$arch" = arm64 ]; then
    ensure_debs gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static
    rustup target list --installed --toolchain "$SG_STABLE" | grep -qx aarch64-unknown-linux-gnu ||
      rustup target add aarch64-unknown-linux-gnu --toolchain "$SG_STABLE"
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
      echo "==> adding arm64 to dpkg's architectures (to download the arm64 base's packages)"
      dpkg --add-architecture arm64
      apt-get update -qq
    fi
  fi
done

mkdir -p "$out" "$debs" "$canonical"
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)

# build ARCH: the release binary for ARCH, built at $canonical in a namespace of its own.
build() {
  local arch="$1" triple target_dir cross=()
  triple=$(rust_triple "$arch")
  target_dir="$repo/target/image/cargo-$arch"
  mkdir -p "$target_dir"
  if [ "$arch" = arm64 ]; then
    cross=(CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
      CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar)
  fi
  local userns=()
  [ "$(id -u)" = 0 ] || userns=(--user --map-root-user)
  echo "==> cargo build --release --target $triple (at $canonical/src)"
  unshare "${userns[@]}" --mount --propagation private -- bash -euo pipefail -c '
    c="$1"; repo="$2"; target="$3"; cargo_home="$4"; rustup_home="$5"; shift 5
    mount -t tmpfs -o mode=0755 shareguard-image-build "$c"
    mkdir "$c/src" "$c/target" "$c/cargo" "$c/rustup"
    mount --bind "$repo" "$c/src"
    mount --bind "$target" "$c/target"
    mount --bind "$cargo_home" "$c/cargo"
    mount --bind "$rustup_home" "$c/rustup"
    cd "$c/src"
    exec env -i HOME="$c" LANG=C.UTF-8 PATH="$c/cargo/bin:/usr/local/bin:/usr/bin:/bin" \
      CARGO_HOME="$c/cargo" RUSTUP_HOME="$c/rustup" CARGO_INCREMENTAL=0 "$@"
  ' _ "$canonical" "$repo" "$target_dir" "${CARGO_HOME:-$HOME/.cargo}" "${RUSTUP_HOME:-$HOME/.rustup}" \
    SOURCE_DATE_EPOCH="$epoch" "${cross[@]}" \
    cargo build --release --locked -p shareguard --target "$triple" --target-dir "$canonical/target"
  # Debug info out of the image, beside it, linked by name and checksum.
  local objcopy=objcopy
  [ "$arch" = arm64 ] && objcopy=aarch64-linux-gnu-objcopy
  local bin="$target_dir/$triple/release/shareguard"
  rm -f "$out/shareguard-$arch" "$out/shareguard-$arch.debug"
  "$objcopy" --only-keep-debug "$bin" "$out/shareguard-$arch.debug"
  "$objcopy" --strip-debug --add-gnu-debuglink="$out/shareguard-$arch.debug" "$bin" "$out/shareguard-$arch"
}

# deb ARCH PACKAGE: downloads the package's .deb (the lock's version, or today's) into
# $debs and prints "package version sha256 file".
deb() {
  local arch="$1" pkg="$2" version want="" file sum
  if [ "$base_mode" = locked ]; then
    read -r version want < <(awk -v a="$arch" -v p="$pkg" '$1 == a && $2 == p { print $3, $4 }' "$lock" 2>/dev/null) || true
    if [ -z "${version:-}" ]; then
      echo "$lock_name has no $arch $pkg: build with IMAGE_BASE=current IMAGE_LOCK=1 to add it" >&2
      return 1
    fi
  else
    version=$(apt-cache policy "$pkg:$arch" | awk '/Candidate:/ { print $2 }')
    if [ -z "$version" ] || [ "$version" = "(none)" ]; then
      apt-get update -qq
      version=$(apt-cache policy "$pkg:$arch" | awk '/Candidate:/ { print $2 }')
    fi
  fi
  # Named pkg_version_arch.deb, arch "all" for a package of every architecture.
  local stem="$debs/${pkg}_${version//:/%3a}"
  file=$(compgen -G "${stem}_$arch.deb" || compgen -G "${stem}_all.deb" || true)
  if [ -z "$file" ]; then
    (cd "$debs" && { apt-get download -qq "$pkg:$arch=$version" 2>/dev/null ||
      { apt-get update -qq && apt-get download -qq "$pkg:$arch=$version"; }; }) || {
      echo "the Debian mirror does not serve $pkg:$arch $version ($lock_name's); a newer" \
        "point release replaced it: build with IMAGE_BASE=current IMAGE_LOCK=1 and commit the lock" >&2
      return 1
    }
    file=$(compgen -G "${stem}_$arch.deb" || compgen -G "${stem}_all.deb")
  fi
  sum=$(sha256sum "$file" | cut -d' ' -f1)
  if [ -n "$want" ] && [ "$sum" != "$want" ]; then
    echo "$file: sha256 $sum, but $lock_name pins $want" >&2
    return 1
  fi
  echo "$pkg $version $sum $file"
}

# fetch_packages ARCH: the base's Debian packages, fetched and checked against the lock, and
# unpacked into $work/staging-ARCH.
fetch_packages() {
  local arch="$1" staging="$work/staging-$arch" list="$out/base-$arch.packages"
  mkdir -p "$staging"
  : >"$list"
  local pkg line
  for pkg in "${packages[@]}"; do
    line=$(deb "$arch" "$pkg")
    dpkg-deb -x "${line##* }" "$staging"
    echo "$arch ${line% *}" >>"$list"
  done
  if [ "$base_mode" = current ] && [ -f "$lock" ] && ! diff -q <(grep "^$arch " "$lock") "$list" >/dev/null; then
    echo "note: the $arch base differs from $lock_name (IMAGE_BASE=current):"
    { diff <(grep "^$arch " "$lock") "$list" || true; } | sed -n 's/^[<>]/ &/p'
  fi
}

# base ARCH: the base layer's root, into $work/base-ARCH: the programs and exactly the
# libraries they and the binary (built by then) load, from the unpacked packages.
base() {
  local arch="$1" staging="$work/staging-$arch" root="$work/base-$arch"
  mkdir -p "$root"/{etc,tmp,proc,sys,dev,run,var/run,root}
  chmod 1777 "$root/tmp"
  echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
  echo "root:x:0:" >"$root/etc/group"
  echo "==> $arch base: ${programs[*]} and the libraries they and shareguard load"
  python3 scripts/image_base.py --staging "$staging" --root "$root" --triple "$(gnu_triple "$arch")" \
    $(printf -- '--program %s ' "${programs[@]}") --check "$out/shareguard-$arch"
}

work=$(mktemp -d "${TMPDIR:-/tmp}/shareguard-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
umask 022
images=()
# Every base's packages first: a lock the mirror no longer serves fails here, before
# minutes of compiling.
for arch in $arches; do
  fetch_packages "$arch"
done
for arch in $arches; do
  build "$arch"
  base "$arch"
  install -D -m 0755 "$out/shareguard-$arch" "$work/app-$arch/usr/local/bin/shareguard"
  images+=(--image "$arch=$work/base-$arch,$work/app-$arch")
done

# started ARCH: each program of the image runs from the image's root alone, under qemu for
# arm64: the loader, the libraries and the symbol versions all there.
started() {
  local arch="$1" root="$work/run-$arch" cmd run=()
  mkdir -p "$root"
  cp -a "$work/base-$arch/." "$work/app-$arch/." "$root/"
  if [ "$arch" = arm64 ]; then
    run=(qemu-aarch64-static -L "$root")
  elif [ "$(id -u)" = 0 ]; then
    run=(chroot "$root")
  else
    run=(unshare --user --map-root-user chroot "$root")
  fi
  for cmd in "/usr/local/bin/shareguard --version" "/sbin/tc -V" "/usr/bin/unshare --version" \
    "/bin/mount --version" "/bin/umount --version"; do
    local path="${cmd%% *}"
    [ "$arch" = arm64 ] && path="$root$path"
    if ! "${run[@]}" "$path" "${cmd#* }" >"$work/started.out" 2>&1; then
      echo "the $arch image cannot run $cmd:" >&2
      cat "$work/started.out" >&2
      return 1
    fi
  done
  echo "==> $arch image: shareguard, tc, unshare, mount and umount start from its root alone"
}
for arch in $arches; do
  started "$arch"
done

python3 scripts/oci_image.py --name "$name" --out "$out/shareguard.oci.tar" "${images[@]}" \
  --entrypoint /usr/local/bin/shareguard \
  --label "org.opencontainers.image.title=shareguard" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$revision" \
  --digests "$out/shareguard.digests"

sbom_args=()
for arch in $arches; do
  sbom_args+=(--arch "$arch=$(rust_triple "$arch"):$out/base-$arch.packages")
done
python3 scripts/image_sbom.py --name "$name" --digest "$(head -n 1 "$out/shareguard.digests" | cut -d' ' -f1)" \
  --epoch "$epoch" --out "$out/shareguard.spdx.json" "${sbom_args[@]}"

if [ "${IMAGE_LOCK:-}" = 1 ]; then
  {
    echo "# The image's base: arch, Debian package, version, sha256 of the .deb (scripts/image.sh)."
    for arch in amd64 arm64; do
      if [ -f "$out/base-$arch.packages" ] && [[ " $arches " == *" $arch "* ]]; then
        cat "$out/base-$arch.packages"
      elif [ -f "$lock" ]; then
        grep "^$arch " "$lock" || true
      fi
    done
  } >"$work/lock"
  mkdir -p "$(dirname "$lock")"
  mv "$work/lock" "$lock"
  echo "==> wrote $lock_name"
fi

echo "==> $out/shareguard.oci.tar"
cat "$out/shareguard.digests"
