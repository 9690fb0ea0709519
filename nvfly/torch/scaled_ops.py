"""Eager routing of torch's FP8 scaled GEMMs to nvfly.ops.scaled: ``aten::_scaled_mm`` (``torch._scaled_mm``) and
``aten::_scaled_mm_v2`` (``F.scaled_mm`` in torch 2.10+), registered with nvfly.torch.routing when this module is
imported (nvfly.torch imports it).

Under ``torch.compile(mode="max-autotune")`` with ``nvfly.torch.install()``, nvfly's configs (``inductor_candidates``)
join Inductor's autotuning of ``aten._scaled_mm`` as the out-variant op ``nvfly::scaled_mm_out(a, b, scale_a,
scale_b, bias=None, *, out, config="auto", use_fast_accum=False)`` (``nvfly.torch.inductor``; declines:
``inductor_analysis``); ``explain_scaled`` is ``nvfly explain --scaled``.

Routing eligible: fp8 operands in _scaled_mm's layouts (a row-major, b column-major), a bf16, fp16 or fp32 output
(torch's default output, fp8, stays on torch), no ``scale_result``, tensor-wise or row-wise fp32 scales, and 1x128 x
128x128 or 1x128 x 1x128 block scales through ``_scaled_mm`` (v2's block scale layouts are declined until verified
on the GPU), on an sm_90 GPU; with a bias only where torch takes one (bf16/fp16 outputs). Of the eligible calls only
those nvfly was measured faster on are routed (``slower_reason``, the rule below). Everything else stays on torch
with a reason.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import Tensor

import nvfly
from nvfly.ops import scaled
from nvfly.ops.common.opcall import Declined, OpCalls
from nvfly.ops.scaled.config import BLOCKWISE, MX, ScaledConfig, ScaledEpilogue, deepest
from nvfly.ops.scaled.plan import SWAP_MAX_M, heuristic_config, make_plan
from nvfly.runtime import driver
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import routing
from nvfly.torch.gemm_ops import AUTO, Decision, decisions, decode_config, encode_config, record
from nvfly.torch.library import operator, register_fake

log = logging.getLogger("nvfly")

# F.ScalingType values (torch 2.10+): TensorWise 0, RowWise 1
_V2_RECIPES = {(0, 0): "tensor", (1, 1): "row"}

# Routing rule, measured on the H200 against cuBLAS's _scaled_mm (benchmarks/scaled.py --quick at f3d627a, torch
# 2.11, benchmarks/results/scaled_h200.json; docs/ops/scaled.md "Measurements"): nvfly is faster only on
# tensor/row-wise scales at M <= 64 (swap-AB: x0.97-1.37, geomean x1.09); cuBLAS at M = 128 (x0.94-1.00) and
# M >= 4096 (x0.72-0.99), and on block scales at every M (x0.64-0.86).
ROUTE_MAX_M = 64


def mx_reason(scaling: str) -> str:
    """Why torch's MX calls stay on torch."""
    return (f"{scaling} scales: torch's are cuBLAS's swizzled (blocked) layout, nvfly's scaled_mm reads "
            f"row-major (rows, K/32) scales")


def slower_reason(scaling: str, m: int) -> Optional[str]:
    """Why cuBLAS stays with an eligible call of this recipe and M (the measured rule above), or None to route it."""
    if scaling in MX:
        return mx_reason(scaling)
    if scaling in BLOCKWISE:
        return (f"{scaling} scales: cuBLAS measured faster at every M (nvfly's promoted block mainloop x0.64-0.86 on "
                f"the H200, docs/ops/scaled.md)")
    if m > ROUTE_MAX_M:
        return (f"M = {m} > {ROUTE_MAX_M}: cuBLAS measured faster (nvfly x0.94-1.00 at M = 128, x0.72-0.99 at "
                f"M = 4096-8192 on the H200, docs/ops/scaled.md)")
    return None


def output_reason(a: Any, bias: Any, out_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why a _scaled_mm call's output stays torch's (fp8; a bias next to an fp32 output), or None."""
    if out_dtype is None or out_dtype in scaled.api.FP8_DTYPES:
        return f"out_dtype {out_dtype or a.dtype}: nvfly's scaled GEMM writes bf16, fp16 or fp32"
    if bias is not None and out_dtype == torch.float32:
        return "a bias with an fp32 output: torch refuses it, and so its error is kept"
    return None


def _common_reason(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   bias: Optional[torch.Tensor], out_dtype: Optional[torch.dtype]) -> Optional[str]:
    reason = output_reason(a, bias, out_dtype)
    if reason:
        return reason
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


# ---------------------------------------------------------------------------------------------- torch.compile
# Under torch.compile(mode="max-autotune") with nvfly.torch.install(), nvfly.torch.inductor adds the configs of
# ``inductor_candidates`` beside ATen's (cuBLAS) and Inductor's Triton choices for aten._scaled_mm; a winner is
# emitted as ``nvfly::scaled_mm_out``.
_OUT_DECIDED: OpCalls[Any] = OpCalls()  # scaled_mm_out's: signature -> True (nvfly runs it) or Declined
_OUT_OP = "nvfly::scaled_mm_out"


def _kernel_options(config: str) -> dict[str, Any]:
    """``scaled.scaled_mm``'s config and swap for a config string ("auto": both left to the heuristic)."""
    cfg, swap = decode_config(config, ScaledConfig)
    return {"config": cfg, "swap": True if swap else None}


def bench_scaled_mm_out(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None, *,
                        out: Tensor, config: str = AUTO, use_fast_accum: bool = False) -> None:
    """nvfly's scaled GEMM into ``out`` with a config string, raising when nvfly cannot run it (Inductor's
    benchmark; ``scaled_mm_out`` falls back to torch instead)."""
    scaled.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out.dtype, use_fast_accum=use_fast_accum, out=out,
                     **_kernel_options(config))


def precompile_scaled(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None, *,
                      out: Tensor, config: str = AUTO, use_fast_accum: bool = False) -> None:
    """Compile (without running) the kernels ``bench_scaled_mm_out`` launches for operands like these."""
    with nvfly.compile_only(driver.target_of(a.device.index) if a.is_cuda else None):
        bench_scaled_mm_out(a, b, scale_a, scale_b, bias, out=out, config=config, use_fast_accum=use_fast_accum)


def _check_product(a: Tensor, b: Tensor, out: Tensor) -> None:
    """torch._scaled_mm's shape rules for ``out`` (what every call must meet, eligible for nvfly or not)."""
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.dim() != 2:
            raise ValueError(f"{_OUT_OP}: {name}: expected a 2-D tensor, got {t.dim()}-D")
    k = b.shape[0] * (2 if b.dtype == scaled.api.FP4_DTYPE else 1)  # packed e2m1 pairs along K
    if a.shape[1] != k:
        raise ValueError(f"{_OUT_OP}: b: shape {tuple(b.shape)} and a's {tuple(a.shape)} do not multiply")
    if tuple(out.shape) != (a.shape[0], b.shape[1]):
        raise ValueError(f"{_OUT_OP}: out: expected shape {(a.shape[0], b.shape[1])}, got {tuple(out.shape)}")


def _out_signature(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor], out: Tensor,
                   config: str, use_fast_accum: bool) -> tuple:
    return (layout_key(a), layout_key(b), layout_key(scale_a), layout_key(scale_b), layout_key(bias),
            layout_key(out), config, bool(use_fast_accum))


def _out_decision(a: Tensor, b: Tensor, reason: str) -> None:
    record(Decision.of("op", "scaled_mm", a, b, reason=reason))


@operator("scaled_mm_out", mutates_args=("out",))
def scaled_mm_out(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None, *,
                  out: Tensor, config: str = AUTO, use_fast_accum: bool = False) -> None:
    """out = torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=out.dtype, use_fast_accum=...) with a config
    string (``encode_config`` of a ScaledConfig, "swap:" for the transposed problem, or "auto"); torch's kernel where
    nvfly declines these operands or fails on them."""
    key = _out_signature(a, b, scale_a, scale_b, bias, out, config, use_fast_accum)
    decided = _OUT_DECIDED.get(key)
    if decided is None:
        _check_product(a, b, out)
        reason = scaled.eligibility(a, b, scale_a, scale_b, bias, out.dtype, out)
        decided = Declined(reason) if reason else True
        _OUT_DECIDED.remember(key, decided)
        if reason:
            _out_decision(a, b, reason)
    if decided is True:
        try:
            bench_scaled_mm_out(a, b, scale_a, scale_b, bias, out=out, config=config, use_fast_accum=use_fast_accum)
            return
        except Exception as exc:  # never break the model: torch computes this signature from now on
            reason = f"nvfly raised {type(exc).__name__}: {exc}"
            _OUT_DECIDED.remember(key, Declined(reason))
            _out_decision(a, b, reason)
            log.warning("nvfly: scaled_mm_out: %s; falling back to torch for these operands", reason)
    with routing.routing(False):
        torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out.dtype, use_fast_accum=use_fast_accum,
                         out=out)


def _scaled_mm_out_fake(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None, *,
                        out: Tensor, config: str = AUTO, use_fast_accum: bool = False) -> None:
    _check_product(a, b, out)


register_fake("scaled_mm_out", _scaled_mm_out_fake)


def out_bound_reason(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor] = None, *,
                     out: Tensor, config: str = AUTO, use_fast_accum: bool = False) -> Optional[str]:
    """Why ``scaled_mm_out`` ran torch for these operands since an earlier call, or None."""
    decided = _OUT_DECIDED.get(_out_signature(a, b, scale_a, scale_b, bias, out, config, use_fast_accum))
    return decided.reason if type(decided) is Declined else None


def inductor_analysis(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out: Any,
                      out_dtype: Optional[torch.dtype]) -> tuple[Optional[str], Optional[str]]:
    """(scaling, None) when nvfly's scaled GEMM can join the autotuning of a _scaled_mm whose operands and output
    are described by metadata (``gemm_ops.TensorInfo``: shapes, strides, dtypes, devices, address modulo 16), else
    (None, why not). Inductor benchmarks the eligible ones, so no measured rule (``slower_reason``) applies."""
    reason = output_reason(a, bias, out_dtype)
    if reason:
        return None, reason
    operands = (a, b, scale_a, scale_b, bias, out)
    metas = [None if t is None else torch.empty_strided(t.shape, t.strides, dtype=t.dtype, device="meta")
             for t in operands]
    try:
        scaling = scaled.check(*metas[:5], out_dtype, metas[5])
    except (TypeError, ValueError) as exc:
        return None, str(exc)
    if scaling in MX:
        return None, mx_reason(scaling)
    if out.strides != (out.shape[1], 1):
        return None, f"out: strides {out.strides}: nvfly writes a row-major (M, N) output"
    reason = scaled.api.placement_reason(*operands)
    return (None, reason) if reason else (scaling, None)


def inductor_candidates(m: int, n: int, k: int, scaling: str, use_fast_accum: bool, bias: bool, sms: int,
                        limit: int) -> list[str]:
    """Config strings for max-autotune: "auto" (the heuristic: swap-AB and split K for small M), then the variants
    below whose plans differ from those before (up to ``limit`` in all): the other side of the swap decision (the
    unswapped token tile for M <= 64, the swapped problem up to M = 256), the 128x128 tile, the widest tile of the
    mainloop (128x256 accumulating fast, 128x128 issuing ahead when promoted) and 128x64, the 128-row ones with the
    TMA-store epilogue (as the heuristic's)."""
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum, bias=bias)
    auto = make_plan(m, n, k, epilogue, None, None, sms)
    variants: list[tuple[ScaledConfig, bool]] = []
    if m <= SWAP_MAX_M:
        variants.append((heuristic_config(m, n, k, epilogue.promote, False, sms, scaling), False))
    elif m <= 256:
        variants.append((heuristic_config(n, m, k, epilogue.promote, True, sms, scaling), True))
    wide = ScaledConfig(128, 128, issue_ahead=True, tma_store=True) if epilogue.promote else \
        ScaledConfig(128, 256, tma_store=True)
    variants += [(deepest(ScaledConfig(128, 128, tma_store=True)), False), (deepest(wide), False),
                 (deepest(ScaledConfig(128, 64, tma_store=True)), False)]
    configs, planned = [AUTO], {(auto.config, auto.swap)}
    for cfg, swap in variants:
        try:
            plan = make_plan(m, n, k, epilogue, cfg, swap, sms)
        except ValueError:  # e.g. swapped block scales, issuing ahead with 1x128 weight scales
            continue
        if (plan.config, plan.swap) not in planned:
            planned.add((plan.config, plan.swap))
            configs.append(encode_config(cfg, swap))
    return configs[:limit]


def explain_scaled(m: int, n: int, k: int, *, scaling: str = "row", use_fast_accum: bool = False, sms: int = 132,
                   limit: int = 4) -> dict[str, Any]:
    """``nvfly explain --scaled``: what nvfly's scaled GEMM runs for an m x n x k call of this recipe, when routing
    takes it, the candidates it adds to max-autotune (config string and plan), and this process's decisions."""
    from nvfly.ops.scaled.api import describe_plan
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum)
    report: dict[str, Any] = {"m": m, "n": n, "k": k, "scaling": scaling, "use_fast_accum": use_fast_accum,
                              "nvfly": describe_plan(make_plan(m, n, k, epilogue, None, None, sms))}
    if scaling in MX:
        report["routing"] = ("stays on torch (torch passes cuBLAS's swizzled layout of MX scales); "
                             "nvfly.ops.scaled.scaled_mm takes row-major (rows, K/32) e8m0 scales")
        report["inductor"] = mx_reason(scaling)
    else:
        slower = slower_reason(scaling, m)
        report["routing"] = f"stays on torch: {slower}" if slower else \
            "under nvfly.torch.routing(), bf16/fp16/fp32 outputs run on nvfly on an sm_90 GPU"
        report["inductor"] = [
            {"config": text, "plan": describe_plan(make_plan(m, n, k, epilogue, *_plan_options(text), sms))}
            for text in inductor_candidates(m, n, k, scaling, use_fast_accum, False, sms, limit)]
    report["decisions"] = [f"{d.where} {d.problem}: {d.reason or 'candidates ' + ', '.join(d.candidates)}"
                           for d in decisions() if d.op == "scaled_mm"][-10:]
    return report


def _plan_options(config: str) -> tuple[Optional[ScaledConfig], Optional[bool]]:
    options = _kernel_options(config)
    return options["config"], options["swap"]
