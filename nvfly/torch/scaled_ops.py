"""Eager routing of torch's FP8 scaled GEMMs to nvfly.ops.scaled: ``aten::_scaled_mm`` (``torch._scaled_mm``) and
``aten::_scaled_mm_v2`` (``F.scaled_mm`` in torch 2.10+), registered with nvfly.torch.routing when this module is
imported (nvfly.torch imports it).

Eligible: fp8 operands in _scaled_mm's layouts (a row-major, b column-major), a bf16, fp16 or fp32 output (torch's
default output, fp8, stays on torch), no ``scale_result``, tensor-wise or row-wise fp32 scales, and 1x128 x 128x128 or
1x128 x 1x128 block scales through ``_scaled_mm`` (v2's block scale layouts are declined until verified on the
GPU), on an sm_90
GPU; with a bias only where torch takes one (bf16/fp16 outputs). Of the eligible calls only those nvfly was measured
faster on are routed (``slower_reason``, the rule below). Everything else stays on torch with a reason.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from nvfly.ops import scaled
from nvfly.ops.common.opcall import Declined, OpCalls
from nvfly.ops.scaled.config import BLOCKWISE, MX
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import routing

# F.ScalingType values (torch 2.10+): TensorWise 0, RowWise 1
_V2_RECIPES = {(0, 0): "tensor", (1, 1): "row"}

# Routing rule, measured on the H200 against cuBLAS's _scaled_mm (benchmarks/scaled.py --quick at f3d627a, torch
# 2.11, benchmarks/results/scaled_h200.json; docs/ops/scaled.md "Measurements"): nvfly is faster only on
# tensor/row-wise scales at M <= 64 (swap-AB: x0.97-1.37, geomean x1.09); cuBLAS at M = 128 (x0.94-1.00) and
# M >= 4096 (x0.72-0.99), and on block scales at every M (x0.64-0.86).
ROUTE_MAX_M = 64


def slower_reason(scaling: str, m: int) -> Optional[str]:
    """Why cuBLAS stays with an eligible call of this recipe and M (the measured rule above), or None to route it."""
    if scaling in MX:
        return (f"{scaling} scales: torch's are cuBLAS's swizzled (blocked) layout, nvfly's scaled_mm reads "
                f"row-major (rows, K/32) scales")
    if scaling in BLOCKWISE:
        return (f"{scaling} scales: cuBLAS measured faster at every M (nvfly's promoted block mainloop x0.64-0.86 on "
                f"the H200, docs/ops/scaled.md)")
    if m > ROUTE_MAX_M:
        return (f"M = {m} > {ROUTE_MAX_M}: cuBLAS measured faster (nvfly x0.94-1.00 at M = 128, x0.72-0.99 at "
                f"M = 4096-8192 on the H200, docs/ops/scaled.md)")
    return None


def _common_reason(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> Optional[str]:
    if out_dtype is None or out_dtype in scaled.api.FP8_DTYPES:
        return f"out_dtype {out_dtype or a.dtype}: nvfly's scaled GEMM writes bf16, fp16 or fp32"
    if bias is not None and out_dtype == torch.float32:
        return "a bias with an fp32 output: torch refuses it, and so its error is kept"
    reason = scaled.eligibility(a, b, scale_a, scale_b, bias, out_dtype)
    return reason or slower_reason(scaled.recipe(a, b, scale_a, scale_b), a.shape[0])


# call signature -> Declined (its reason) or ELIGIBLE: a routed call's checks run once per signature
_DECISIONS: OpCalls[Any] = OpCalls()
ELIGIBLE = "eligible"


def scaled_mm_eligibility(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                          out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> Optional[str]:
    try:
        key = (layout_key(a), layout_key(b), layout_key(scale_a), layout_key(scale_b), layout_key(bias),
               scale_result is None, out_dtype)
        decision = _DECISIONS.get(key)
    except Exception:  # noqa: BLE001 - not tensors: the checks explain
        key = decision = None
    if decision is None:
        reason = "scale_result (an fp8 output's scale) is not supported" if scale_result is not None else \
            _common_reason(a, b, scale_a, scale_b, bias, out_dtype)
        decision = Declined(reason) if reason else ELIGIBLE
        _DECISIONS.remember(key, decision)
    return None if decision is ELIGIBLE else str(decision)


def scaled_mm_run(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> torch.Tensor:
    return scaled.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


# the _scaled_mm_v2 arguments nvfly reads, by schema name (2.13's schema; a torch whose schema lacks one is declined)
_V2_NAMES = ("self", "mat2", "scale_a", "recipe_a", "swizzle_a", "scale_b", "recipe_b", "swizzle_b", "bias",
             "out_dtype", "contraction_dim", "use_fast_accum")


def _v2_schema_names() -> tuple[str, ...]:
    return tuple(arg.name for arg in torch.ops.aten._scaled_mm_v2.default._schema.arguments)


def bound_arguments(op: Any, names: tuple[str, ...], args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """An aten call's arguments by schema name (defaults filled), or None when this torch's schema of ``op`` (an
    overload) lacks one of ``names``."""
    schema = op._schema
    schema_names = tuple(arg.name for arg in schema.arguments)
    if not set(names) <= set(schema_names):
        return None
    bound = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    bound.update(zip(schema_names, args))
    bound.update(kwargs)
    return bound


def _v2_arguments(args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """A _scaled_mm_v2 call's arguments by name (defaults filled), or None when this torch's schema differs."""
    return bound_arguments(torch.ops.aten._scaled_mm_v2.default, _V2_NAMES, args, kwargs)


def scaled_mm_v2_eligibility(*args: Any, **kwargs: Any) -> Optional[str]:
    call = _v2_arguments(args, kwargs)
    if call is None:
        return f"this torch's _scaled_mm_v2 schema {_v2_schema_names()} is not the one nvfly reads"
    scale_a, scale_b, recipe_a, recipe_b = call["scale_a"], call["scale_b"], call["recipe_a"], call["recipe_b"]
    if len(scale_a) != 1 or len(scale_b) != 1 or len(recipe_a) != 1 or len(recipe_b) != 1:
        return "one scale per operand is supported (no lists)"
    if any(call["swizzle_a"] or ()) or any(call["swizzle_b"] or ()):
        return "swizzled scales (MX/NVFP4 layouts) are not supported"
    if list(call["contraction_dim"] or ()) not in ([], [1, 0]):
        return f"contraction_dim {list(call['contraction_dim'])}: nvfly contracts a's dim 1 with b's dim 0"
    recipe = _V2_RECIPES.get((recipe_a[0], recipe_b[0]))
    if recipe is None:
        return (f"scale recipes {recipe_a[0]}/{recipe_b[0]}: nvfly routes tensor-wise and row-wise F.scaled_mm "
                f"(block scales through torch._scaled_mm)")
    a, b, sa, sb = call["self"], call["mat2"], scale_a[0], scale_b[0]
    reason = _common_reason(a, b, sa, sb, call["bias"], call["out_dtype"])
    if reason is None and scaled.recipe(a, b, sa, sb) != recipe:
        return "the scales' shapes do not match their recipes"
    return reason


def scaled_mm_v2_run(*args: Any, **kwargs: Any) -> torch.Tensor:
    call = _v2_arguments(args, kwargs)
    assert call is not None  # eligibility declined it otherwise
    return scaled.scaled_mm(call["self"], call["mat2"], call["scale_a"][0], call["scale_b"][0], bias=call["bias"],
                            out_dtype=call["out_dtype"], use_fast_accum=bool(call["use_fast_accum"]))


def scaled_mm_signature(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, scale_result: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None, use_fast_accum: bool = False) -> tuple:
    """The route's signature: what ``scaled_mm_eligibility``'s own key holds, in cheaper reads."""
    key = routing.tensor_key
    return (key(a), key(b), key(scale_a), key(scale_b), bias is not None and key(bias), scale_result is None,
            out_dtype)


routing.register_route("aten::_scaled_mm", scaled_mm_eligibility, scaled_mm_run, signature=scaled_mm_signature)
if hasattr(torch.ops.aten, "_scaled_mm_v2"):
    routing.register_route("aten::_scaled_mm_v2", scaled_mm_v2_eligibility, scaled_mm_v2_run)
