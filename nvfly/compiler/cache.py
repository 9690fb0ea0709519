"""The on-disk compile cache.

Layout under the cache folder (``NVFLY_CACHE_DIR``)::

    v1/bin/<k[:2]>/<k>/      one compiled kernel, k = hash of its IR, target, toolchain and nvfly versions
        meta.json, kernel.mlir, kernel.llvm.mlir, kernel.ptx, kernel.cubin, checksums.json
    v1/spec/<s[:2]>/<s>.json the IR key that a specialisation s (function source + argument specs) produced,
                             so a new process skips tracing and lowering

Writes go to a private temporary folder that is renamed into place (atomic on POSIX); when two processes race,
the first rename wins and the other's copy is dropped: both wrote the same content. Every read checks the
files against ``checksums.json``; a corrupt entry is removed and reported as a miss, so it is rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from typing import Optional

log = logging.getLogger("nvfly")

LAYOUT_VERSION = "v1"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class DiskCache:
    def __init__(self, root: str):
        self.root = os.path.join(root, LAYOUT_VERSION)

    def _bin_dir(self, key: str) -> str:
        return os.path.join(self.root, "bin", key[:2], key)

    def _spec_file(self, spec_key: str) -> str:
        return os.path.join(self.root, "spec", spec_key[:2], spec_key + ".json")

    def _tmp(self) -> str:
        path = os.path.join(self.root, "tmp", f"{os.getpid()}-{uuid.uuid4().hex}")
        os.makedirs(path)
        return path

    # ------------------------------------------------------------------ compiled kernels
    def get(self, key: str) -> Optional[dict[str, bytes]]:
        """The files of entry ``key``, or None (missing, or corrupt and now removed)."""
        folder = self._bin_dir(key)
        try:
            with open(os.path.join(folder, "checksums.json"), "rb") as f:
                sums = json.loads(f.read())
            files = {}
            for name, digest in sums.items():
                with open(os.path.join(folder, name), "rb") as f:
                    data = f.read()
                if _sha(data) != digest:
                    raise ValueError(f"{name} does not match its checksum")
                files[name] = data
            return files
        except FileNotFoundError:
            if os.path.isdir(folder):
                self._discard(folder, "incomplete entry")
            return None
        except (ValueError, OSError) as exc:
            self._discard(folder, str(exc))
            return None

    def put(self, key: str, files: dict[str, bytes]) -> None:
        tmp = self._tmp()
        try:
            for name, data in files.items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            with open(os.path.join(tmp, "checksums.json"), "w") as f:
                json.dump({name: _sha(data) for name, data in files.items()}, f, sort_keys=True)
            final = self._bin_dir(key)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not os.path.isdir(final):
                    raise
                # another process stored the same entry first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _discard(self, folder: str, why: str) -> None:
        log.warning("nvfly cache: dropping %s (%s); it will be rebuilt", folder, why)
        trash = os.path.join(self.root, "tmp", f"trash-{uuid.uuid4().hex}")
        try:
            os.makedirs(os.path.dirname(trash), exist_ok=True)
            os.rename(folder, trash)
        except OSError:
            return  # someone else moved or replaced it
        shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------------ specialisation index
    def get_spec(self, spec_key: str) -> Optional[str]:
        try:
            with open(self._spec_file(spec_key)) as f:
                key = json.load(f)["ir_key"]
            return key if isinstance(key, str) and len(key) == 64 else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put_spec(self, spec_key: str, ir_key: str) -> None:
        path = self._spec_file(spec_key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump({"ir_key": ir_key}, f)
        os.replace(tmp, path)
