#!/usr/bin/env bash
# `make image-reproduce`: builds the image twice from this commit, here and in a fresh
# clone at another path with a cold cargo target directory, and fails unless both give the
# same digests (docs/image.md, "Reproducible"). IMAGE_ARCHES as for `make image`; the base
# is today's Debian packages (IMAGE_BASE=current) in both, so that the check does not
# depend on image/base.lock being current; what it shows is that nothing of the machine,
# the checkout's path or the build's order reaches the image.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "the working tree has changes that are not committed; the clone would not have them" >&2
  exit 1
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/shareguard-reproduce.XXXXXX")
trap 'rm -rf "$work"' EXIT

export IMAGE_BASE=current IMAGE_NAME="shareguard:reproduce"
echo "==> build 1: $repo"
IMAGE_OUT="$work/one" scripts/image.sh
# Another path, of another length, and nothing built there before.
clone="$work/a/checkout/of/another/length"
git clone -q "$repo" "$clone"
git -C "$clone" -c advice.detachedHead=false checkout -q "$(git rev-parse HEAD)"
echo "==> build 2: $clone (a cold target directory)"
IMAGE_OUT="$work/two" "$clone/scripts/image.sh"

# The layers' and configs' digests too, to say what differs when the images do.
describe() {
  python3 - "$1" <<'PY'
import json, sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    blob = lambda d: json.load(t.extractfile("blobs/sha256/" + d.split(":", 1)[1]))
    top = json.load(t.extractfile("index.json"))["manifests"][0]
    todo = [top]
    while todo:
        d = todo.pop(0)
        body = blob(d["digest"])
        arch = d.get("platform", {}).get("architecture", "")
        print(d["digest"], arch, d["mediaType"].split(".")[-2])
        if "manifests" in body:
            todo += body["manifests"]
        else:
            print(" ", body["config"]["digest"], arch, "config")
            for n, layer in enumerate(body["layers"]):
                print(" ", layer["digest"], arch, "layer", n, "base" if n == 0 else "shareguard")
PY
}
describe "$work/one/shareguard.oci.tar" >"$work/one.txt"
describe "$work/two/shareguard.oci.tar" >"$work/two.txt"
cat "$work/one.txt"
if ! diff -u "$work/one.txt" "$work/two.txt"; then
  echo "NOT REPRODUCIBLE: the two builds of $(git rev-parse --short HEAD) differ (above)" >&2
  cmp -l "$work/one/shareguard-amd64" "$work/two/shareguard-amd64" 2>/dev/null | head -5 >&2 || true
  exit 1
fi
for f in shareguard.spdx.json $(cd "$work/one" && ls shareguard-* base-*.packages); do
  cmp "$work/one/$f" "$work/two/$f"
done
echo "reproducible: both builds gave $(head -n 1 "$work/one/shareguard.digests" | cut -d' ' -f1)" \
  "(binaries, debug info, base package lists and SBOM byte for byte the same)"
