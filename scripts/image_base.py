#!/usr/bin/env python3
"""Makes the image's base root from Debian packages extracted into a staging folder: the
programs asked for, the dynamic loader, and every shared library they load, found the way
the loader would (DT_NEEDED, searched in the multiarch and plain library folders),
followed through symlinks; nothing else of the packages. Works for any architecture
binutils' readelf reads, so an arm64 base is made on an amd64 machine.

It also checks what the loader would check at start: every symbol version an ELF file
needs (GLIBC_2.34, GCC_3.0, ...) is defined by the library that provides it. Programs that
are checked but not copied (--check, the shareguard binary of the layer above) are held to
the same rule, so a binary built against a newer glibc than the base's fails here, naming
the version, not in a pod.

    image_base.py --staging DIR --root DIR --triple aarch64-linux-gnu \
                  --program /sbin/tc ... [--check FILE]...
"""

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys


class Error(Exception):
    pass


def readelf(flag: str, path: str) -> str:
    return subprocess.run(
        ["readelf", "-W", flag, path], check=True, capture_output=True, text=True
    ).stdout


def needed(path: str) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", path))


def interpreter(path: str) -> str | None:
    m = re.search(r"Requesting program interpreter: ([^\]]+)\]", readelf("-l", path))
    return m.group(1) if m else None


def version_needs(path: str) -> dict[str, set[str]]:
    """Library file name -> the version names this ELF file needs from it."""
    needs: dict[str, set[str]] = {}
    text = readelf("-V", path)
    section = text.split("Version needs section", 1)
    if len(section) < 2:
        return needs
    current = None
    for line in section[1].splitlines():
        if line.startswith("Version ") and "section" in line:
            break
        m = re.search(r"File: (\S+)", line)
        if m:
            current = needs.setdefault(m.group(1), set())
            continue
        m = re.search(r"Name: (\S+)", line)
        if m and current is not None:
            current.add(m.group(1))
    return needs


@functools.cache  # the base's libc is asked for by every program that loads it
def version_defs(path: str) -> frozenset[str]:
    text = readelf("-V", path)
    section = text.split("Version definition section", 1)
    if len(section) < 2:
        return frozenset()
    defs = set()
    for line in section[1].splitlines()[1:]:
        if line.startswith("Version ") and "section" in line:
            break
        m = re.search(r"Index: \d+\s+Cnt: \d+\s+Name: (\S+)", line)
        if m:
            defs.add(m.group(1))
    return frozenset(defs)


class Base:
    def __init__(self, staging: str, root: str, triple: str):
        self.staging = staging
        self.root = root
        self.dirs = [f"/lib/{triple}", f"/usr/lib/{triple}", "/lib", "/usr/lib"]
        self.copied: set[str] = set()
        # soname -> path inside the image of the file that provides it
        self.provider: dict[str, str] = {}

    def inside(self, path: str) -> str:
        return os.path.join(self.staging, path.lstrip("/"))

    @staticmethod
    def target(path: str, real: str) -> str:
        """What the symlink at image path `path` (at `real` in the staging folder) names."""
        link = os.readlink(real)
        return os.path.normpath(link if link.startswith("/") else os.path.join(os.path.dirname(path), link))

    def resolve(self, path: str) -> str:
        """The path inside the image that a path names once its symlinks are followed."""
        for _ in range(40):
            real = self.inside(path)
            if not os.path.islink(real):
                return path
            path = self.target(path, real)
        raise Error(f"{path}: too many levels of symlinks")

    def copy(self, path: str) -> None:
        """Copies a path (its symlinks, then the file they end at) into the root."""
        for _ in range(40):
            if path in self.copied:
                return
            real = self.inside(path)
            if not os.path.lexists(real):
                raise Error(f"{path} is in none of the base's packages")
            dest = os.path.join(self.root, path.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            self.copied.add(path)
            if os.path.islink(real):
                os.symlink(os.readlink(real), dest)
                path = self.target(path, real)
                continue
            shutil.copy2(real, dest)
            return
        raise Error(f"{path}: too many levels of symlinks")

    def find(self, soname: str, wanted_by: str) -> str:
        for d in self.dirs:
            candidate = f"{d}/{soname}"
            if os.path.lexists(self.inside(candidate)):
                return candidate
        raise Error(
            f"{wanted_by} loads {soname}, which none of the base's packages provides "
            f"(looked in {', '.join(self.dirs)}): add its package to scripts/image.sh's list"
        )

    def add_elf(self, real: str, label: str) -> None:
        """Adds everything the ELF file at `real` (named `label`) loads, recursively."""
        interp = interpreter(real)
        if interp:
            self.copy(interp)
        for soname in needed(real):
            if soname in self.provider:
                continue
            lib = self.find(soname, label)
            self.copy(lib)
            self.provider[soname] = self.resolve(lib)
            self.add_elf(self.inside(self.provider[soname]), soname)
        self.check_versions(real, label)

    def check_versions(self, real: str, label: str) -> None:
        for lib, names in version_needs(real).items():
            provider = self.provider.get(lib)
            if provider is None:
                continue  # a library the file names in its version needs but loads through another
            missing = names - version_defs(self.inside(provider))
            if missing:
                raise Error(
                    f"{label} needs {', '.join(sorted(missing))} from {lib}, which the base's "
                    f"{lib} ({provider}) does not define: it was built against newer libraries "
                    f"than the base has"
                )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--staging", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--triple", required=True)
    ap.add_argument("--program", action="append", default=[])
    ap.add_argument("--check", action="append", default=[])
    a = ap.parse_args()
    base = Base(a.staging, a.root, a.triple)
    try:
        for program in a.program:
            base.copy(program)
            resolved = base.resolve(program)
            base.add_elf(base.inside(resolved), program)
        for path in a.check:
            base.add_elf(path, os.path.basename(path))
    except (Error, subprocess.CalledProcessError) as e:
        print(f"image_base.py: {e}", file=sys.stderr)
        return 1
    for soname, path in sorted(base.provider.items()):
        print(f"  {soname:24} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
