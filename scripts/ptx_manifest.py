"""Byte-identity of the kernel library's PTX across a refactor.

``collect`` runs the CPU tests (every kernel and plan they compile) into a fresh compile cache and writes a
manifest: each PTX file's sha256 with its entry name. ``compare`` checks a new manifest against a base one:
every PTX of the new run must be byte-identical to one of the base run (new hashes are listed, by entry name,
as the intended differences to re-test on the GPU); base PTX that the new run no longer produced is listed too.

    python scripts/ptx_manifest.py collect --out base.json [-- pytest arguments]
    python scripts/ptx_manifest.py compare base.json new.json
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

_ENTRY = re.compile(rb"^\.visible \.entry ([A-Za-z_][A-Za-z0-9_]*)\(", re.M)


def manifest_of(cache_dir: str) -> dict[str, str]:
    """sha256 -> entry name of every PTX in a compile cache folder."""
    found: dict[str, str] = {}
    for folder, _, files in os.walk(cache_dir):
        if "kernel.ptx" in files:
            with open(os.path.join(folder, "kernel.ptx"), "rb") as f:
                ptx = f.read()
            entry = _ENTRY.search(ptx)
            found[hashlib.sha256(ptx).hexdigest()] = entry.group(1).decode() if entry else "?"
    return found


def collect(out: str, pytest_args: list[str]) -> int:
    cache = tempfile.mkdtemp(prefix="nvfly-ptx-manifest-")
    env = dict(os.environ, NVFLY_CACHE_DIR=cache, NVFLY_DISK_CACHE="1")
    args = pytest_args or ["-q", "-m", "not gpu and not slow"]
    rc = subprocess.call([sys.executable, "-m", "pytest", *args], env=env)
    found = manifest_of(cache)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(out, "w") as f:
        json.dump({"commit": commit, "pytest": args, "ptx": found}, f, indent=0, sort_keys=True)
    print(f"{len(found)} PTX files from the run (pytest exit {rc}) -> {out}")
    return 0


def compare(base_path: str, new_path: str) -> int:
    with open(base_path) as f:
        base = json.load(f)["ptx"]
    with open(new_path) as f:
        new = json.load(f)["ptx"]
    added = collections.Counter(new[h] for h in new.keys() - base.keys())
    missing = collections.Counter(base[h] for h in base.keys() - new.keys())
    print(f"base {len(base)} PTX, new {len(new)} PTX, identical {len(new.keys() & base.keys())}")
    for title, counts in (("new PTX not in the base run (intended differences?)", added),
                          ("base PTX the new run did not produce", missing)):
        if counts:
            print(f"{title}:")
            for name, n in sorted(counts.items()):
                print(f"  {name}: {n}")
    return 1 if added else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="run the CPU tests into a fresh cache and write the manifest")
    c.add_argument("--out", required=True)
    c.add_argument("pytest_args", nargs=argparse.REMAINDER)
    d = sub.add_parser("compare", help="check a new manifest against a base one (exit 1 on new PTX)")
    d.add_argument("base")
    d.add_argument("new")
    ns = parser.parse_args()
    if ns.command == "collect":
        return collect(ns.out, [a for a in ns.pytest_args if a != "--"])
    return compare(ns.base, ns.new)


if __name__ == "__main__":
    sys.exit(main())
