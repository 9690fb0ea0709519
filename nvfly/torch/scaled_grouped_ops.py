"""Eager routing of torch's grouped FP8 GEMMs to ``nvfly.ops.scaled.scaled_grouped_mm``: ``aten::_scaled_grouped_mm``
(``torch._scaled_grouped_mm``) and ``aten::_scaled_grouped_mm_v2`` (``F.scaled_grouped_mm``), registered with
nvfly.torch.routing when this module is imported (nvfly.torch imports it).

Eligible: what torch runs on sm90, e4m3 tokens [T, K] (row-major) x expert weights [E, K, N] (column-major) with
``offs`` (2-D x 3-D, the MoE forward: nvfly's contiguous layout) or [E, M, K] x [E, K, N] without offsets (3-D x 3-D:
nvfly's masked layout with every row counted), row-wise fp32 scales (scale_a per token, scale_b [E, N]), a bf16
output, no bias and no ``scale_result``, on an sm_90 GPU. The 2-D x 2-D and 3-D x 2-D products, MX scales and the
v2 op's other recipes stay on torch with a reason (``nvfly explain M N K --groups E --scaled row`` shows the
decision). Block scales (1x128 x 128x128), which torch's grouped op does not take on Hopper, are
``nvfly.ops.scaled.scaled_grouped_mm``'s alone.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from nvfly.ops import scaled
from nvfly.torch import routing
from nvfly.torch.scaled_ops import bound_arguments

# F.ScalingType RowWise (torch 2.10+)
_ROW_RECIPE = 1
_V2_NAMES = ("self", "mat2", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "offs", "bias",
             "out_dtype", "contraction_dim", "use_fast_accum")


def _masked(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor]) -> Optional[bool]:
    """The nvfly layout of torch's operands: False contiguous (2-D x 3-D with offs), True masked (3-D x 3-D
    without), None neither."""
    if a.dim() == 2 and b.dim() == 3 and offs is not None:
        return False
    if a.dim() == 3 and b.dim() == 3 and offs is None:
        return True
    return None


@functools.lru_cache(maxsize=64)
def _full_counts(device: torch.device, groups: int, rows: int) -> torch.Tensor:
    """3-D x 3-D: every row of every group counts (the masked layout's counts)."""
    return torch.full((groups,), rows, dtype=torch.int32, device=device)


def grouped_eligibility(a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any = None, bias: Any = None,
                        scale_result: Any = None, out_dtype: Optional[torch.dtype] = None,
                        use_fast_accum: bool = False) -> Optional[str]:
    """None when nvfly runs ``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, ...)``, else why not."""
    if scale_result is not None:
        return "scale_result (an fp8 output's scale) is not supported"
    if bias is not None:
        return "bias: nvfly's grouped scaled GEMM takes no bias (nor does torch's on sm90: its error stays torch's)"
    if out_dtype not in (None, torch.bfloat16):
        return f"out_dtype {out_dtype}: torch's grouped scaled GEMM writes bf16 (its error stays torch's)"
    masked = _masked(a, b, offs)
    if masked is None:
        return (f"a {a.dim()}-D, b {b.dim()}-D{' with' if offs is not None else ' without'} offs: nvfly routes the "
                f"2-D x 3-D MoE forward (with offs) and 3-D x 3-D (without)")
    counts = _full_counts(a.device, a.shape[0], a.shape[1]) if masked else offs
    reason = scaled.grouped_eligibility(a, b, scale_a, scale_b, counts, torch.bfloat16, None, masked)
    recipe = scaled.grouped_recipe(a, b, scale_a, scale_b) if reason is None else "row"
    if recipe != "row":
        return f"{recipe} scales: torch's grouped scaled GEMM takes row-wise ones (its error stays torch's)"
    return reason


def grouped_run(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                offs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                scale_result: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                use_fast_accum: bool = False) -> torch.Tensor:
    if _masked(a, b, offs):
        return scaled.scaled_grouped_mm_masked(a, b, scale_a, scale_b, _full_counts(a.device, a.shape[0], a.shape[1]),
                                               use_fast_accum=use_fast_accum)
    return scaled.scaled_grouped_mm(a, b, scale_a, scale_b, offs, use_fast_accum=use_fast_accum)


def grouped_signature(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                      scale_result: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                      use_fast_accum: bool = False) -> tuple:
    key = routing.tensor_key
    return (key(a), key(b), key(scale_a), key(scale_b), offs is not None and key(offs), bias is None,
            scale_result is None, out_dtype)


def grouped_v2_eligibility(*args: Any, **kwargs: Any) -> Optional[str]:
    call = bound_arguments(torch.ops.aten._scaled_grouped_mm_v2.default, _V2_NAMES, args, kwargs)
    if call is None:
        return "this torch's _scaled_grouped_mm_v2 schema is not the one nvfly reads"
    scale_a, scale_b, recipe_a, recipe_b = call["scale_a"], call["scale_b"], call["recipe_a"], call["recipe_b"]
    if len(scale_a) != 1 or len(scale_b) != 1 or len(recipe_a) != 1 or len(recipe_b) != 1:
        return "one scale per operand is supported (no lists)"
    if any(call["swizzle_a"] or ()) or any(call["swizzle_b"] or ()):
        return "swizzled scales (MX layouts) are not supported"
    if list(call["contraction_dim"] or ()):
        return f"contraction_dim {list(call['contraction_dim'])}: nvfly contracts a's last dim with b's second last"
    if (recipe_a[0], recipe_b[0]) != (_ROW_RECIPE, _ROW_RECIPE):
        return (f"scale recipes {recipe_a[0]}/{recipe_b[0]}: nvfly routes row-wise F.scaled_grouped_mm (block scales: "
                f"nvfly.ops.scaled.scaled_grouped_mm)")
    return grouped_eligibility(call["self"], call["mat2"], scale_a[0], scale_b[0], call["offs"], call["bias"], None,
                               call["out_dtype"], call["use_fast_accum"])


def grouped_v2_run(*args: Any, **kwargs: Any) -> torch.Tensor:
    call = bound_arguments(torch.ops.aten._scaled_grouped_mm_v2.default, _V2_NAMES, args, kwargs)
    assert call is not None  # eligibility declined it otherwise
    return grouped_run(call["self"], call["mat2"], call["scale_a"][0], call["scale_b"][0], call["offs"],
                       use_fast_accum=bool(call["use_fast_accum"]))


def explain_scaled_grouped(groups: int, m: int, n: int, k: int, *, layout: str = "contiguous",
                           scaling: str = "row", use_fast_accum: bool = False) -> str:
    """``nvfly explain M N K --groups E --scaled block|row|mxfp8|mxfp4``: what nvfly runs for a grouped FP8 GEMM
    (``layout`` "contiguous": m routed tokens in all; "masked": m rows of capacity a group) and what the routes
    take."""
    lines = [f"grouped FP8 GEMM, {layout}: {groups} groups, M={m} N={n} K={k}, {scaling} scales"
             f"{', fast accumulation' if use_fast_accum else ''}"]
    try:
        lines.append("  nvfly runs: " + scaled.describe_grouped(layout, groups, m, n, k, scaling=scaling,
                                                                 use_fast_accum=use_fast_accum))
    except (TypeError, ValueError) as exc:
        lines.append(f"  nvfly declines: {exc}")
    lines.append("  routed: torch._scaled_grouped_mm / F.scaled_grouped_mm (row-wise) under nvfly.torch.routing(): "
                 "2-D x 3-D with offs and 3-D x 3-D, bf16 out, no bias, on an sm_90 GPU")
    if scaling != "row":
        lines.append(f"  {scaling} scales: torch's grouped op does not take them on sm90; call "
                     "nvfly.ops.scaled.scaled_grouped_mm(_masked) directly")
    return "\n".join(lines) + "\n"


routing.register_route("aten::_scaled_grouped_mm", grouped_eligibility, grouped_run, signature=grouped_signature)
if hasattr(torch.ops.aten, "_scaled_grouped_mm_v2"):
    routing.register_route("aten::_scaled_grouped_mm_v2", grouped_v2_eligibility, grouped_v2_run)
