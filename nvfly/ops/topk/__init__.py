"""TopK along the last dimension: values and int64 indices like ``torch.topk``, k from 1 to 2048.

Order and ties: the result is exactly ``torch.sort(x, descending=largest, stable=True)[..., :k]`` with NaN (any
payload) treated as the largest value (``keys``: every element's unique rank). torch.topk on CUDA picks the same
elements and lists them in the same order when k > 32; for k <= 32 its bitonic sort may list equal values in another
index order. Values are gathered from the input by index, bit for bit.

Modules, each depending only on those before it: ``plans`` (which kernels and launch shapes, pure Python),
``keys`` (ranks and keys), ``select`` and ``sort`` (a block's select and sort of candidates in shared memory),
``warp`` (k <= 32 over short rows), ``stream`` (the streaming filter, its slices' merge), ``row`` (long rows through
a row-wide threshold), ``api`` (``topk``, ``eligibility``, the runners). The warp and block building blocks (votes,
scans, GPU-scope atomics) are ``nvfly.arch``'s (``warp``, ``reduce``, ``gpu_scope``, ``floats``). Measurements
behind the plans' thresholds: ``docs/ops/topk.md``.
"""
import sys
import types

from nvfly.ops.topk.api import check_shapes, eligibility, topk
from nvfly.ops.topk.plans import TopkPlan, plan

__all__ = ["TopkPlan", "check_shapes", "eligibility", "plan", "topk"]


class _CallablePackage(types.ModuleType):
    """``nvfly.ops.topk`` names both this package and its function (``from nvfly.ops import topk``): calling the
    package calls ``topk``, whichever of the two a caller imported."""
    __call__ = staticmethod(topk)


sys.modules[__name__].__class__ = _CallablePackage
