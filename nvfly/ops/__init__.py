"""nvfly's kernel library, written in the DSL: each op family is a subpackage (``gemm``, ``grouped``, ``rmsnorm``,
``topk``) offering a host function on torch tensors, an eligibility check that explains why an input is declined,
and the kernels behind it. The host functions are exported here::

    from nvfly.ops import grouped_mm, matmul, rms_norm, topk

They are imported on first use, so ``import nvfly.ops`` stays cheap. ``topk`` is both the function and the
subpackage ``nvfly.ops.topk`` (calling the package calls the function), so ``topk.plan`` still works.
"""
from __future__ import annotations

import importlib
from typing import Any

# exported name -> the subpackage that defines it
_EXPORTS = {"matmul": "nvfly.ops.gemm", "grouped_mm": "nvfly.ops.grouped", "rms_norm": "nvfly.ops.rmsnorm",
            "topk": "nvfly.ops.topk"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nvfly.ops' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    # importing nvfly.ops.topk binds the callable subpackage itself as nvfly.ops.topk
    return globals()[name] if name in globals() else getattr(module, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
