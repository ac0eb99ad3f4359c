#!/usr/bin/env python3
"""Writes the image's SBOM, an SPDX 2.3 JSON document: the Rust crates compiled into the
shareguard binary for each architecture (cargo's resolved graph from the shareguard package,
normal dependencies only: build scripts and proc macros run at build time and are not in
the binary), and the Debian packages the base was made from, with their .deb digests. Its
time is the commit's, so the same commit gives the same document.

    image_sbom.py --name REF --digest sha256:... --epoch SECONDS --out FILE \
                  --arch amd64=x86_64-unknown-linux-gnu:base-amd64.packages [--arch ...]
"""

import argparse
import json
import subprocess
import sys
import time
import uuid


def crates(triple: str) -> set[tuple[str, str, str]]:
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--locked", "--format-version", "1", "--filter-platform", triple],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    packages = {p["id"]: p for p in meta["packages"]}
    nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
    root = next(p["id"] for p in meta["packages"] if p["name"] == "shareguard")
    seen, linked, todo = set(), set(), [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if any("proc-macro" in t["kind"] for t in packages[pid]["targets"]):
            continue  # runs inside the compiler; nothing of it or its dependencies is linked in
        linked.add(pid)
        for dep in nodes[pid]["deps"]:
            if any(k["kind"] is None for k in dep["dep_kinds"]):
                todo.append(dep["pkg"])
    out = set()
    for pid in linked:
        p = packages[pid]
        origin = "registry" if (p.get("source") or "").startswith("registry+") else "workspace"
        out.add((p["name"], p["version"], origin))
    return out


def spdx_id(*parts: str) -> str:
    safe = "".join(c if c.isalnum() or c in ".-" else "-" for c in "-".join(parts))
    return f"SPDXRef-{safe}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--digest", required=True)
    ap.add_argument("--epoch", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", action="append", required=True, help="ARCH=TRIPLE:PACKAGES_FILE")
    a = ap.parse_args()

    image_id = "SPDXRef-image"
    packages = [
        {
            "name": a.name,
            "SPDXID": image_id,
            "versionInfo": a.digest,
            "downloadLocation": "NOASSERTION",
            "primaryPackagePurpose": "CONTAINER",
        }
    ]
    relationships = [
        {"spdxElementId": "SPDXRef-DOCUMENT", "relationshipType": "DESCRIBES", "relatedSpdxElement": image_id}
    ]
    seen = set()
    for spec in a.arch:
        arch, rest = spec.split("=", 1)
        triple, debs = rest.split(":", 1)
        for name, version, origin in sorted(crates(triple)):
            sid = spdx_id("crate", name, version)
            if sid not in seen:
                seen.add(sid)
                pkg = {
                    "name": name,
                    "SPDXID": sid,
                    "versionInfo": version,
                    "downloadLocation": "NOASSERTION",
                }
                if origin == "registry":
                    pkg["externalRefs"] = [
                        {
                            "referenceCategory": "PACKAGE-MANAGER",
                            "referenceType": "purl",
                            "referenceLocator": f"pkg:cargo/{name}@{version}",
                        }
                    ]
                packages.append(pkg)
            relationships.append(
                {"spdxElementId": image_id, "relationshipType": "CONTAINS", "relatedSpdxElement": sid}
            )
        with open(debs) as f:
            for line in f:
                deb_arch, name, version, sha256 = line.split()
                sid = spdx_id("deb", name, version, deb_arch)
                if sid in seen:
                    continue
                seen.add(sid)
                packages.append(
                    {
                        "name": name,
                        "SPDXID": sid,
                        "versionInfo": version,
                        "downloadLocation": "NOASSERTION",
                        "checksums": [{"algorithm": "SHA256", "checksumValue": sha256}],
                        "externalRefs": [
                            {
                                "referenceCategory": "PACKAGE-MANAGER",
                                "referenceType": "purl",
                                "referenceLocator": f"pkg:deb/debian/{name}@{version}?arch={deb_arch}&distro=debian-12",
                            }
                        ],
                    }
                )
                relationships.append(
                    {"spdxElementId": image_id, "relationshipType": "CONTAINS", "relatedSpdxElement": sid}
                )

    doc = {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": a.name,
        "documentNamespace": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, a.name + '@' + a.digest)}",
        "creationInfo": {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(a.epoch)),
            "creators": ["Tool: scripts/image_sbom.py"],
        },
        "packages": packages,
        "relationships": relationships,
    }
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
