"""Every nvfly setting, in one typed registry.

Nothing else in nvfly reads ``os.environ``. Each setting names its environment variable (``NVFLY_`` prefix) and
says whether it changes the generated code; those that do are part of every compile cache key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {text!r}")


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    affects_codegen: bool
    doc: str


_REGISTRY: dict[str, Setting] = {}


def _register(name: str, parse: Callable[[str], Any], default: Any, affects_codegen: bool, doc: str) -> None:
    _REGISTRY[name] = Setting(name, "NVFLY_" + name.upper(), parse, default, affects_codegen, doc)


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nvfly")


_register("cache_dir", str, None, False, "on-disk compile cache folder (default: $XDG_CACHE_HOME/nvfly)")
_register("disk_cache", _parse_bool, True, False, "use the on-disk compile cache")
_register("dump_dir", str, None, False, "write the IR after every pass, the PTX and the cubin of each compile here")
_register("ptxas", str, None, False, "path of ptxas (default: PATH, $CUDA_HOME/bin, then the nvidia-cuda-nvcc wheel)")
_register("cuobjdump", str, None, False, "path of cuobjdump (default: PATH, $CUDA_HOME/bin, then the nvidia-cuda-cuobjdump wheel)")
_register("arch", str, None, True, "target when no GPU is visible, e.g. sm_90a or sm_80 (default sm_90a)")
_register("opt_level", int, 3, True, "LLVM and ptxas optimisation level")
_register("ptxas_options", str, "", True, "extra ptxas flags, space separated")
_register("debug", _parse_bool, False, False, "log compile, cache and routing decisions to the 'nvfly' logger")
_register("routing_rms_norm", _parse_bool, True, False,
          "register the RMSNorm routes in routing blocks (asked at the outermost block's start); off: F.rms_norm "
          "never pays the dispatcher's hop into nvfly (eager RMSNorm under 64 MiB stays torch's anyway), nor runs "
          "nvfly's kernel under CUDA-graph capture")
_register("routing_native", _parse_bool, True, False,
          "routing blocks register the routes' C++ kernel (built once per torch version with torch's C++ extension "
          "builder; the calls nvfly declined go to torch's kernel without entering Python); off, or where it cannot "
          "be built: the Python kernels alone")
_register("routing_sdpa_cudnn_sq1", _parse_bool, False, False,
          "SDPA routing and nvfly's compile pass: run Sq = 1 decode calls where torch picks cuDNN on nvfly's decode "
          "too (off: they stay cuDNN's, whose kernel is within 4% of nvfly's); read when a signature is decided")
_register("routing_min_gain_us", float, 0.0, False,
          "eager GEMM routing: route a shape class only where the autotune database has nvfly faster than torch by at "
          "least this many µs a call (what the routed host path costs over torch's; 0: any win); read when a "
          "signature is decided and at the outermost block's start (a change reaches the signatures decided before "
          "at routing.forget_decisions)")


def get(name: str) -> Any:
    """The current value of setting ``name`` (environment variable, else default)."""
    setting = _REGISTRY[name]
    raw = os.environ.get(setting.env)
    if raw is None:
        return _default_cache_dir() if name == "cache_dir" else setting.default
    try:
        return setting.parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {setting.env}={raw!r}: {exc}") from None


def codegen_fingerprint() -> tuple[tuple[str, Any], ...]:
    """The settings that change generated code, for cache keys."""
    return tuple((s.name, get(s.name)) for s in _REGISTRY.values() if s.affects_codegen)


def describe() -> list[Setting]:
    return list(_REGISTRY.values())
