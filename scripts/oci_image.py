#!/usr/bin/env python3
"""Writes a one-layer OCI image archive from a root folder, with no Docker daemon and no
registry: the layer is a tar of the folder (owners root, times zero, so the same folder
gives the same digest), and the archive is an OCI image layout that
`ctr images import` reads, named by the `io.containerd.image.name` annotation.

    oci_image.py --root DIR --name REF --out FILE.tar [--entrypoint ARG]... [--env K=V]...
"""

import argparse
import hashlib
import io
import json
import os
import tarfile


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


def blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--env", action="append", default=[])
    a = ap.parse_args()

    layer = layer_tar(a.root)
    env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env
    with tarfile.open(a.out, "w") as out:
        layer_digest = blob(out, layer)
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": env, "Entrypoint": a.entrypoint or None},
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = blob(out, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": len(config_bytes),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": layer_digest,
                    "size": len(layer),
                }
            ],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = blob(out, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": len(manifest_bytes),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": a.name,
                        "org.opencontainers.image.ref.name": a.name.rsplit(":", 1)[-1],
                    },
                }
            ],
        }
        for name, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps(index, sort_keys=True).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    main()
