"""Eager routing of torch's FP8 scaled GEMMs to nvfly.ops.scaled: ``aten::_scaled_mm`` (``torch._scaled_mm``) and
``aten::_scaled_mm_v2`` (``F.scaled_mm`` in torch 2.10+), registered with nvfly.torch.routing when this module is
imported (nvfly.torch imports it).

Eligible: fp8 operands in _scaled_mm's layouts (a row-major, b column-major), a bf16, fp16 or fp32 output (torch's
default output, fp8, stays on torch), no ``scale_result``, tensor-wise or row-wise fp32 scales, and 1x128 x 128x128
block scales through ``_scaled_mm`` (v2's block scale layouts are declined until verified on the GPU), on an sm_90
GPU; with a bias only where torch takes one (bf16/fp16 outputs). Everything else stays on torch with a reason.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from nvfly.ops import scaled
from nvfly.torch import routing

# F.ScalingType values (torch 2.10+): TensorWise 0, RowWise 1
_V2_RECIPES = {(0, 0): "tensor", (1, 1): "row"}


def _common_reason(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> Optional[str]:
    if out_dtype is None or out_dtype in scaled.api.FP8_DTYPES:
        return f"out_dtype {out_dtype or a.dtype}: nvfly's scaled GEMM writes bf16, fp16 or fp32"
    if bias is not None and out_dtype == torch.float32:
        return "a bias with an fp32 output: torch refuses it, and so its error is kept"
    return scaled.eligibility(a, b, scale_a, scale_b, bias, out_dtype)


def scaled_mm_eligibility(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                          out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> Optional[str]:
    if scale_result is not None:
        return "scale_result (an fp8 output's scale) is not supported"
    return _common_reason(a, b, scale_a, scale_b, bias, out_dtype)


def scaled_mm_run(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> torch.Tensor:
    return scaled.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _v2_scales(scale_a: Sequence[torch.Tensor], recipe_a: Sequence[int], swizzle_a: Sequence[int],
               scale_b: Sequence[torch.Tensor], recipe_b: Sequence[int], swizzle_b: Sequence[int],
               contraction_dim: Sequence[int]) -> tuple[Optional[str], Any, Any]:
    """(reason or None, scale_a, scale_b) of a _scaled_mm_v2 call nvfly may run."""
    if len(scale_a) != 1 or len(scale_b) != 1 or len(recipe_a) != 1 or len(recipe_b) != 1:
        return "one scale per operand is supported (no lists)", None, None
    if any(swizzle_a) or any(swizzle_b):
        return "swizzled scales (MX/NVFP4 layouts) are not supported", None, None
    if list(contraction_dim) not in ([], [1, 0]):
        return f"contraction_dim {list(contraction_dim)}: nvfly contracts a's dim 1 with b's dim 0", None, None
    recipe = _V2_RECIPES.get((recipe_a[0], recipe_b[0]))
    if recipe is None:
        return (f"scale recipes {recipe_a[0]}/{recipe_b[0]}: nvfly routes tensor-wise and row-wise F.scaled_mm "
                f"(block scales through torch._scaled_mm)"), None, None
    return None, scale_a[0], scale_b[0]


def scaled_mm_v2_eligibility(a: torch.Tensor, b: torch.Tensor, scale_a: Sequence[torch.Tensor],
                             recipe_a: Sequence[int], swizzle_a: Sequence[int], scale_b: Sequence[torch.Tensor],
                             recipe_b: Sequence[int], swizzle_b: Sequence[int], bias: Optional[torch.Tensor],
                             out_dtype: Optional[torch.dtype], contraction_dim: Sequence[int] = (),
                             use_fast_accum: bool = False) -> Optional[str]:
    reason, sa, sb = _v2_scales(scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, contraction_dim)
    if reason:
        return reason
    reason = _common_reason(a, b, sa, sb, bias, out_dtype)
    if reason is None and scaled.recipe(a, b, sa, sb) != _V2_RECIPES[(recipe_a[0], recipe_b[0])]:
        return "the scales' shapes do not match their recipes"
    return reason


def scaled_mm_v2_run(a: torch.Tensor, b: torch.Tensor, scale_a: Sequence[torch.Tensor], recipe_a: Sequence[int],
                     swizzle_a: Sequence[int], scale_b: Sequence[torch.Tensor], recipe_b: Sequence[int],
                     swizzle_b: Sequence[int], bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype],
                     contraction_dim: Sequence[int] = (), use_fast_accum: bool = False) -> torch.Tensor:
    return scaled.scaled_mm(a, b, scale_a[0], scale_b[0], bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


routing.register_route("aten::_scaled_mm", scaled_mm_eligibility, scaled_mm_run)
if hasattr(torch.ops.aten, "_scaled_mm_v2"):
    routing.register_route("aten::_scaled_mm_v2", scaled_mm_v2_eligibility, scaled_mm_v2_run)
