#!/usr/bin/env python3
"""Writes an OCI image layout archive from root folders, with no Docker daemon and no
registry. Each folder becomes one uncompressed layer: a tar with its entries sorted, owners
root and times zero, so the same folders give the same digests on any machine (a
compressed layer's bytes would depend on the zlib that wrote them). `ctr images import`
reads the archive; the image is named by the `io.containerd.image.name` annotation.

One platform: index.json points at its manifest. Several (`--image` per architecture):
index.json points at an image index over their manifests, as a multi-arch tag does.

    oci_image.py --name REF --out FILE.tar --image ARCH=DIR[,DIR...] [--image ...]
                 [--entrypoint ARG]... [--env K=V]... [--label K=V]... [--digests FILE]
    oci_image.py --name REF --out FILE.tar --root DIR ...     (one amd64 layer)

--digests writes "<digest> <what>" lines: the image's (what index.json names) and each
platform's manifest.
"""

import argparse
import hashlib
import io
import json
import os
import tarfile

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"

# Docker's and OCI's names for the architectures the project builds.
PLATFORMS = {
    "amd64": {"architecture": "amd64", "os": "linux"},
    "arm64": {"architecture": "arm64", "os": "linux", "variant": "v8"},
}


def layer_tar(root: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                path = os.path.join(dirpath, name)
                info = tar.gettarinfo(path, arcname=os.path.relpath(path, root))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                info.mtime = 0
                if info.isfile():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


class Layout:
    """The archive being written; each blob once, however many images share it."""

    def __init__(self, tar: tarfile.TarFile):
        self.tar = tar
        self.written: set[str] = set()

    def blob(self, data: bytes, media_type: str, **extra) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if digest not in self.written:
            self.written.add(digest)
            info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
            info.size = len(data)
            self.tar.addfile(info, io.BytesIO(data))
        return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}

    def file(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        self.tar.addfile(info, io.BytesIO(data))


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def image(layout: Layout, arch: str, roots: list[str], a) -> dict:
    platform = PLATFORMS[arch]
    layers = [layer_tar(root) for root in roots]
    descriptors = [layout.blob(data, LAYER) for data in layers]
    config = {
        **platform,
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env,
            "Entrypoint": a.entrypoint or None,
            "Labels": dict(kv.split("=", 1) for kv in a.label) or None,
        },
        "rootfs": {"type": "layers", "diff_ids": [d["digest"] for d in descriptors]},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": layout.blob(canonical(config), CONFIG),
        "layers": descriptors,
    }
    return layout.blob(canonical(manifest), MANIFEST, platform=platform)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", help="one amd64 layer from this folder")
    ap.add_argument("--image", action="append", default=[], help="ARCH=DIR[,DIR...]")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--label", action="append", default=[])
    ap.add_argument("--digests")
    a = ap.parse_args()

    images = [spec.split("=", 1) for spec in a.image]
    if a.root:
        images.append(["amd64", a.root])
    if not images:
        ap.error("give --image ARCH=DIR[,DIR...] or --root DIR")
    for arch, _ in images:
        if arch not in PLATFORMS:
            ap.error(f"--image {arch}=...: the architecture must be one of {sorted(PLATFORMS)}")

    with tarfile.open(a.out, "w") as out:
        layout = Layout(out)
        manifests = [image(layout, arch, dirs.split(","), a) for arch, dirs in images]
        if len(manifests) == 1:
            top = dict(manifests[0])
        else:
            top = layout.blob(canonical({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}), INDEX)
        top["annotations"] = {
            "io.containerd.image.name": a.name,
            "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1],
        }
        layout.file("oci-layout", canonical({"imageLayoutVersion": "1.0.0"}))
        layout.file("index.json", canonical({"schemaVersion": 2, "mediaType": INDEX, "manifests": [top]}))

    if a.digests:
        with open(a.digests, "w") as f:
            f.write(f"{top['digest']} {a.name}\n")
            for (arch, _), m in zip(images, manifests):
                f.write(f"{m['digest']} {arch}\n")


if __name__ == "__main__":
    main()
