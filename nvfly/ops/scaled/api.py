"""The scaled GEMM's host functions on torch tensors: ``scaled_mm`` (``torch._scaled_mm`` / ``F.scaled_mm``
semantics for the fp32 recipes), ``recipe`` (which scaling a call's scales describe), ``check`` and
``eligibility``, ``path``, ``dequantize`` and ``reference``, and ``compile_variants`` (the kernel compiled without
a GPU).

Operands follow ``torch._scaled_mm``: ``a`` (M, K) row-major, ``b`` (K, N) column-major (``w.t()`` of a row-major
(N, K) weight), both fp8 (e4m3, or e5m2 with an e4m3 partner), K and N multiples of 16. Scales (fp32):

    recipe           scale_a                          scale_b
    tensor           one element                      one element
    row              (M, 1)                           (1, N)
    block            (M, ceil(K/128)), any strides    (ceil(K/128), ceil(N/128)), any strides
                     (1x128: per token, per 128 k)    (128x128 blocks of the weight)
    block1x128       (M, ceil(K/128)), any strides    (ceil(K/128), N), any strides (1x128: per channel, 128 k)
    mxfp8            (M, K/32) e8m0, any strides      (N, K/32) e8m0, any strides (OCP MX: 2^(e - 127) per 32 k)
    mxfp4            (M, K/32) e8m0, any strides      (N, K/32) e8m0, any strides, b packed e2m1 (below)

out = (a * sa) @ (b * sb) (+ bias), in bf16 (the default, as ``F.scaled_mm``), fp16 or fp32.

MX scales are ``torch.float8_e8m0fnu`` (or their bytes as uint8, as ``quantize(x, "mx")`` gives them), K a multiple
of 32, in the plain row-major (rows, K/32) layout: torch's ``ScalingType.BlockWise1x32`` hands cuBLAS (sm100 only;
Hopper has no MX tensor cores and torch does not run MX there) the swizzled "blocked" layout (128 x 4 tiles padded
to whole tiles), which nvfly does not take: unswizzle it first. MXFP4 weights (``mxfp4``, with MXFP8 activations):
``b`` is ``torch.float4_e2m1fn_x2`` (K/2, N) column-major, the ``.t()`` of a row-major (N, K/2) packed weight, two
e2m1 values a byte along K, the lower-numbered one in the low nibble (torch's and OCP's order); the kernel converts
them to e4m3 in shared memory (Hopper has no fp4 tensor cores).

MXFP4 weights x 16-bit activations (recipe ``mxfp4_a16``, weight-only quantisation, W4A16): ``a`` bf16 or fp16
(M, K) row-major, ``scale_a`` None (the activations are not scaled), ``b`` and ``scale_b`` as for ``mxfp4``. torch
has no scaled_mm for this mix (its MX recipes scale both operands); the call is ``scaled_mm(x, w_q.t(), None,
w_scale)``. A weight-streaming kernel (``a16_kernel``: swap AB, e2m1 dequantised into mma.sync's registers with the
block's scale, fp32 accumulation) runs it, fast for M <= 16; ``use_fast_accum`` changes nothing there.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import torch

import nvfly
from nvfly.errors import LaunchError
from nvfly.ops.common import scratch
from nvfly.ops.common.gemm_config import store_box
from nvfly.ops.common.opcall import OpCalls, named
from nvfly.ops.common.operands import hopper_reason, store_reason
from nvfly.ops.scaled.a16_kernel import mxfp4_a16_kernel
from nvfly.ops.scaled.a16_plan import (ROWS, TMA_BOX_BYTES, TMA_SCALE_BYTES, A16Config, A16Plan, describe_a16_plan,
                                       make_a16_plan)
from nvfly.ops.scaled.config import BK, BLOCKWISE, MX, MX_BLOCK, SCALE_BLOCK, ScaledConfig, ScaledEpilogue, deepest
from nvfly.ops.scaled.kernel import scaled_mm_kernel, scaled_reduce_kernel
from nvfly.ops.scaled.plan import ScaledPlan, make_plan
from nvfly.ops.scaled.quantize import dequantize_mx, dequantize_mxfp4
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.tma import cached_descriptor, check_tma_layout
from nvfly.runtime.torch_args import current_stream, layout_key, vector_width

SCALED_MM = "nvfly.ops.scaled.scaled_mm"
PATH = "nvfly.ops.scaled.path"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP4_DTYPE = torch.float4_e2m1fn_x2
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MX_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
A16_DTYPES = (torch.bfloat16, torch.float16)  # activations next to MXFP4 weights (the "mxfp4_a16" recipe)
MXFP4_A16 = "mxfp4_a16"
A16_LAYOUT_DTYPE = {torch.bfloat16: "bf16", torch.float16: "f16"}  # A16Config.layout's "shuffled-<dtype>" suffix


# ---------------------------------------------------------------------------------------------- checks
def _ceil(x: int, d: int) -> int:
    return -(-x // d)


def is_a16(a: Any, b: Any, scale_a: Any) -> bool:
    """Whether a call is MXFP4 weights x 16-bit activations ("mxfp4_a16"): bf16/fp16 ``a`` with no ``scale_a`` or
    with float4_e2m1fn_x2 ``b`` (``check_a16`` then explains what does not fit)."""
    return isinstance(a, torch.Tensor) and a.dtype in A16_DTYPES and \
        (scale_a is None or getattr(b, "dtype", None) == FP4_DTYPE)


def is_mx(scale: Any) -> bool:
    """Whether ``scale`` holds MX (e8m0) scales: float8_e8m0fnu, or their bytes as uint8."""
    return scale.dtype in MX_SCALE_DTYPES


def mx_recipe(a: Any, b: Any, scale_a: Any, scale_b: Any) -> str:
    """"mxfp8" (or "mxfp4" for packed e2m1 ``b``) when the e8m0 scales fit a (M, K) @ b (K, N): scale_a (M, K/32),
    scale_b (N, K/32), K a multiple of 32; raises TypeError or ValueError naming the argument."""
    m, k = a.shape
    n = b.shape[1]
    check_mx_scales(k, (("scale_a", scale_a, (m,)), ("scale_b", scale_b, (n,))))
    return "mxfp4" if b.dtype == FP4_DTYPE else "mxfp8"


def check_mx_scales(k: int, scales: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
    """MX (e8m0) scales of a K-wide product: each (name, scale, rows) must be float8_e8m0fnu (or uint8) of shape
    rows + (K/32,), K a multiple of 32 (the dense GEMM's (M, K/32) and (N, K/32); the grouped GEMM's batched ones);
    raises TypeError or ValueError naming the argument."""
    if k % MX_BLOCK:
        raise ValueError(f"a: K={k} is not a multiple of {MX_BLOCK} (MX scales cover 32 elements of K)")
    for name, scale, _ in scales:
        if not is_mx(scale):
            raise TypeError(f"{name}: dtype {scale.dtype} next to MX (e8m0) scales or MXFP4 weights: expected "
                            f"float8_e8m0fnu or uint8 scales for both")
    for name, scale, rows in scales:
        expected = tuple(rows) + (k // MX_BLOCK,)
        if tuple(scale.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(scale.shape)}: expected {expected} e8m0 scales, one per "
                             f"{MX_BLOCK} of K, row-major (cuBLAS's swizzled blocked layout is not taken)")


def recipe(a: Any, b: Any, scale_a: Any, scale_b: Any) -> str:
    """The scaling ("tensor", "row", "block", "block1x128" or "mxfp8") that the scales' shapes (and e8m0 dtypes)
    describe for a (M, K) @ b (K, N); raises ValueError naming the scale that matches no recipe or not its
    partner's."""
    if is_mx(scale_a) or is_mx(scale_b) or b.dtype == FP4_DTYPE:
        return mx_recipe(a, b, scale_a, scale_b)
    m, k = a.shape
    n = b.shape[1]
    kb = _ceil(k, SCALE_BLOCK)
    shapes = {"tensor": (None, None), "row": ((m, 1), (1, n)), "block": ((m, kb), (kb, _ceil(n, SCALE_BLOCK))),
              "block1x128": ((m, kb), (kb, n))}

    def which(scale: Any, index: int) -> set[str]:
        """The recipes a scale's shape fits (M = 1: a (1, 1) scale_a is tensor-wise and row-wise)."""
        fits = {r for r, pair in shapes.items() if pair[index] == tuple(scale.shape)}
        return fits | {"tensor"} if scale.numel() == 1 else fits
    ra, rb = which(scale_a, 0), which(scale_b, 1)
    expected = "; ".join(f"{r}: {pair[0] or 'one element'} and {pair[1] or 'one element'}"
                         for r, pair in shapes.items())
    if not ra:
        raise ValueError(f"scale_a: shape {tuple(scale_a.shape)} matches no scaling of a {tuple(a.shape)} "
                         f"(expected {expected})")
    if not rb:
        raise ValueError(f"scale_b: shape {tuple(scale_b.shape)} matches no scaling of b {tuple(b.shape)} "
                         f"(expected {expected})")
    both = ra & rb
    if not both:
        first = min(ra, key=list(shapes).index)
        raise ValueError(f"scale_b: shape {tuple(scale_b.shape)} is {'/'.join(sorted(rb))}-wise but scale_a is "
                         f"{first}-wise (expected {shapes[first][1] or 'one element'}; the pairs are {expected})")
    return min(both, key=list(shapes).index)  # several fit only when they compute the same: the simplest


def check(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None,
          out_dtype: torch.dtype = torch.bfloat16, out: Any = None) -> str:
    """What nvfly's scaled GEMM takes, on any device (the same checks as the op's fake): raises TypeError or
    ValueError naming the argument; returns the recipe."""
    if is_a16(a, b, scale_a):
        return check_a16(a, b, scale_a, scale_b, bias, out_dtype, out)
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got {t.dim()}-D")
        if t.dtype not in FP8_DTYPES and not (name == "b" and t.dtype == FP4_DTYPE):
            raise TypeError(f"{name}: dtype {t.dtype} is not float8_e4m3fn or float8_e5m2"
                            + (" (or float4_e2m1fn_x2 MXFP4 weights)" if name == "b" else
                               " (bf16/fp16 activations take MXFP4 weights and scale_a None)"))
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise TypeError("b: float8_e5m2 with an float8_e5m2 a: one operand must be float8_e4m3fn (as torch)")
    m, k = a.shape
    packing = 2 if b.dtype == FP4_DTYPE else 1  # e2m1 pairs: b is (K/2, N)
    if b.shape[0] * packing != k:
        raise ValueError(f"b: shape {tuple(b.shape)} and a's {tuple(a.shape)} do not multiply (K is {k} in a, "
                         f"{b.shape[0] * packing} in b)")
    n = b.shape[1]
    if k % 16 or n % 16:
        raise ValueError(f"b: K={k} and N={n} must be multiples of 16 (fp8 GEMM rows of 16 bytes)")
    if a.stride(1) != 1 and a.shape[1] > 1:
        raise ValueError(f"a: expected a row-major (M, K) tensor (stride 1 along K), got strides {a.stride()}")
    if b.stride(0) != 1 and b.shape[0] > 1:
        raise ValueError(f"b: expected a column-major (K, N) tensor (w.t() of a row-major (N, K) weight), got "
                         f"strides {b.stride()}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32 and not is_mx(t):
            raise TypeError(f"{name}: dtype {t.dtype}: expected float32 scales (or float8_e8m0fnu MX scales)")
    scaling = recipe(a, b, scale_a, scale_b)
    _check_output(m, n, bias, out_dtype, out)
    return scaling


def _check_output(m: int, n: int, bias: Any, out_dtype: torch.dtype, out: Any) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} is not bf16, fp16 or fp32")
    for name, t in (("bias", bias), ("out", out)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if bias is not None:
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype not in BIAS_DTYPES:
            raise TypeError(f"bias: dtype {bias.dtype} is not bf16, fp16 or fp32")
    if out is not None:
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape {(m, n)}, got {tuple(out.shape)}")
        if out.dtype != out_dtype:
            raise TypeError(f"out: expected dtype {out_dtype}, got {out.dtype}")


def check_a16(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None,
              out_dtype: torch.dtype = torch.bfloat16, out: Any = None) -> str:
    """``check`` for 16-bit activations: a bf16/fp16 (M, K) row-major, scale_a None, b float4_e2m1fn_x2 (K/2, N)
    column-major, scale_b e8m0 (N, K/32), K a multiple of 32; returns "mxfp4_a16"."""
    if scale_a is not None:
        raise TypeError(f"scale_a: {a.dtype} activations with MXFP4 weights take no activation scale: pass None "
                        f"(got a {type(scale_a).__name__})")
    for name, t in (("b", b), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got {t.dim()}-D")
    if b.dtype != FP4_DTYPE:
        raise TypeError(f"b: dtype {b.dtype} next to {a.dtype} activations: expected float4_e2m1fn_x2 MXFP4 weights "
                        f"(K/2, N) column-major (fp8 weights take fp8 activations)")
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] * 2 != k:
        raise ValueError(f"b: shape {tuple(b.shape)} and a's {tuple(a.shape)} do not multiply (packed e2m1 pairs: "
                         f"expected ({k // 2}, N), K/2 rows for K={k})")
    if k % MX_BLOCK:
        raise ValueError(f"a: K={k} is not a multiple of {MX_BLOCK} (MX scales cover 32 elements of K)")
    if a.stride(1) != 1 and k > 1:
        raise ValueError(f"a: expected a row-major (M, K) tensor (stride 1 along K), got strides {a.stride()}")
    if b.stride(0) != 1 and b.shape[0] > 1:
        raise ValueError(f"b: expected a column-major (K/2, N) tensor (w.t() of a row-major (N, K/2) packed "
                         f"weight), got strides {b.stride()}")
    if not isinstance(scale_b, torch.Tensor) or not is_mx(scale_b):
        raise TypeError(f"scale_b: dtype {getattr(scale_b, 'dtype', None)}: expected float8_e8m0fnu (or uint8) "
                        f"MX scales next to MXFP4 weights")
    if tuple(scale_b.shape) != (n, k // MX_BLOCK):
        raise ValueError(f"scale_b: shape {tuple(scale_b.shape)}: expected ({n}, {k // MX_BLOCK}) e8m0 scales, one "
                         f"per {MX_BLOCK} of K, row-major (cuBLAS's swizzled blocked layout is not taken)")
    _check_output(m, n, bias, out_dtype, out)
    return MXFP4_A16


def _aligned_reason(name: str, t: torch.Tensor) -> Optional[str]:
    if t.data_ptr() % 16:
        return f"{name}: its address is not 16-byte aligned (TMA needs it)"
    return None


def eligibility(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None,
                out_dtype: torch.dtype = torch.bfloat16, out: Any = None) -> Optional[str]:
    """None when ``scaled_mm`` runs these arguments on nvfly, else why not (``check``'s error, the device's,
    the operands' alignment)."""
    try:
        scaling = check(a, b, scale_a, scale_b, bias, out_dtype, out)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return placement_reason(a, b, scale_a, scale_b, bias, out, scaling)


def placement_reason(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None, out: Any = None,
                     scaling: Optional[str] = None) -> Optional[str]:
    """Why nvfly cannot run operands that passed ``check`` (whose recipe is ``scaling``) where they are (device,
    GPU, TMA strides and alignment; the streaming kernel's 16-byte loads for MXFP4 x bf16), or None; reads only
    their devices, shapes, strides and ``data_ptr()`` (an address, or its value modulo 16 for operands described at
    compile time)."""
    reason = hopper_reason("nvfly's scaled GEMM", a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias, out=out)
    if reason:
        return reason
    if scaling == MXFP4_A16:
        return _a16_alignment(a, b)
    if a.shape[0] > 1 and a.stride(0) % 16:
        return f"a: row stride {a.stride(0)} is not a multiple of 16 bytes (TMA cannot describe it)"
    if b.shape[1] > 1 and b.stride(1) % 16:
        return f"b: column stride {b.stride(1)} is not a multiple of 16 bytes (TMA cannot describe it)"
    return _aligned_reason("a", a) or _aligned_reason("b", b)


def _a16_alignment(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """Why the streaming kernel's 16-byte loads cannot read a (activation rows) or b (packed weight rows), or None."""
    if a.shape[0] > 1 and (a.stride(0) * a.element_size()) % 16:
        return f"a: row stride {a.stride(0)} elements is not a multiple of 16 bytes (16-byte token loads)"
    if b.shape[1] > 1 and b.stride(1) % 16:
        return f"b: column stride {b.stride(1)} bytes is not a multiple of 16 (16-byte weight loads)"
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            return f"{name}: its address is not 16-byte aligned (16-byte loads)"
    return None


# ---------------------------------------------------------------------------------------------- calls
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: Optional[torch.Tensor], scale_b: torch.Tensor, *,
              bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
              use_fast_accum: bool = False, out: Optional[torch.Tensor] = None,
              config: Optional[Union[ScaledConfig, A16Config]] = None, swap: Optional[bool] = None) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) (+ bias) for fp8 ``a`` (M, K) row-major and ``b`` (K, N) column-major with
    tensor-wise, row-wise or block (1x128 x 128x128) fp32 scales (see the module doc), as ``torch._scaled_mm``.

    ``use_fast_accum``: tensor/row-wise scales accumulate every k-block in the tensor core's accumulator (fast);
    False (the default, as torch) adds each k-block of 128 into an fp32 sum (promotion); block scales always
    promote. ``config``/``swap``: the kernel's tile (of the transposed problem when swapped) and whether small M
    is computed as out^T = b^T a^T (None: the heuristic's). bf16/fp16 ``a`` with MXFP4 ``b`` (recipe mxfp4_a16):
    ``scale_a`` None, ``config`` an A16Config, ``swap`` None (the streaming kernel is always swapped). Raises
    TypeError or ValueError naming the argument when nvfly cannot run it."""
    if is_a16(a, b, scale_a):
        call = _bound_a16(SCALED_MM, a, b, scale_a, scale_b, bias, out_dtype, out, config, swap)
        if out is None:
            out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
        call.run(a, b, scale_b, bias, out)
        return out
    call = _bound(SCALED_MM, a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, out, config, swap)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    call.run(a, b, scale_a, scale_b, bias, out)
    return out


def path(a: torch.Tensor, b: torch.Tensor, scale_a: Optional[torch.Tensor], scale_b: torch.Tensor, *,
         bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False,
         config: Optional[Union[ScaledConfig, A16Config]] = None, swap: Optional[bool] = None) -> str:
    """What ``scaled_mm`` runs (for benchmarks and ``nvfly explain``), e.g. "scaled-block-promoted: 128x128 tile
    on 132 blocks, 6 stages"; raises when it would."""
    with named(PATH):
        if is_a16(a, b, scale_a):
            return describe_a16_plan(_plan_a16(a, b, scale_a, scale_b, bias, out_dtype, None, config, swap))
        plan = _plan(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, None, config, swap)
    return describe_plan(plan)


def describe(m: int, n: int, k: int, *, scaling: str = "row", use_fast_accum: bool = False,
             bias: bool = False, sms: int = 132) -> str:
    """What ``scaled_mm`` runs without a config for an m x n x k call with ``scaling`` ("tensor", "row", "block"
    or "block1x128"; "mxfp4_a16": MXFP4 weights x 16-bit activations) scales, planned for ``sms`` SMs (no GPU
    needed), as ``path`` names it."""
    if scaling == MXFP4_A16:
        return describe_a16_plan(make_a16_plan(m, n, k, None, sms))
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum, bias=bias)
    return describe_plan(make_plan(m, n, k, epilogue, None, None, sms))


def describe_plan(plan: ScaledPlan) -> str:
    cfg, epi = plan.config, plan.epilogue
    name = f"scaled-{epi.scaling}" + ("-promoted" if epi.promote else "") + ("-ahead" if cfg.issue_ahead else "") + \
        ("-swapAB" if plan.swap else "") + (f"-splitK{cfg.split_k}" if cfg.split_k > 1 else "") + \
        ("-fixup" if cfg.split_fix_up else "") + ("-staged" if cfg.staged_scales else "")
    return f"{name}: {cfg.bm}x{cfg.bn} tile on {plan.grid} blocks, {cfg.stages} stages" + \
        (f", {cfg.cluster_n}-block clusters along N (A multicast)" if cfg.cluster_n > 1 else "") + \
        (", TMA-store epilogue" if cfg.tma_store else "") + \
        (f", stream K over {plan.sk_tiles} tiles" if plan.sk_tiles else "")


def _plan(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: torch.dtype, use_fast_accum: bool,
          out: Any, config: Optional[ScaledConfig], swap: Optional[bool]) -> ScaledPlan:
    scaling = check(a, b, scale_a, scale_b, bias, out_dtype, out)
    if config is not None and not isinstance(config, ScaledConfig):
        raise TypeError(f"config: expected a ScaledConfig or None, got {type(config).__name__}")
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum, bias=bias is not None)
    sms = plan_sm_count(a.get_device())
    plan = make_plan(a.shape[0], b.shape[1], a.shape[1], epilogue, config, swap, sms, out_dtype.itemsize)
    # staged scales where TMA can load scale_a, else the scales from global
    if plan.config.staged_scales and staged_scales_reason(scale_a, plan.config.bm) is not None:
        plan = make_plan(a.shape[0], b.shape[1], a.shape[1], epilogue, replace(plan.config, staged_scales=False),
                         plan.swap, sms, out_dtype.itemsize)
    return plan


def _bound(op: str, a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: Any, use_fast_accum: bool,
           out: Any, config: Any, swap: Any) -> "_Call":
    try:
        key = (layout_key(a), layout_key(b), layout_key(scale_a), layout_key(scale_b), layout_key(bias),
               layout_key(out), out_dtype, bool(use_fast_accum), config, swap)
        call = _CALLS.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _CALLS.plan(op, key, _new_call, a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, out, config,
                           swap)
    return call


def _new_call(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: Any, use_fast_accum: bool,
              out: Any, config: Any, swap: Any) -> "_Call":
    plan = _plan(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, out, config, swap)
    reason = eligibility(a, b, scale_a, scale_b, bias, out_dtype, out)
    if reason:
        raise ValueError(reason)
    if plan.config.tma_store and out is not None and store_reason(out) is not None:  # registers store any layout
        registers = deepest(replace(plan.config, tma_store=False), most=plan.config.stages)
        plan = _plan(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, out, registers, plan.swap)
    return _Call(plan, out, out_dtype)


def staged_scales_view(scale_a: torch.Tensor) -> torch.Tensor:
    """Block scales' scale_a as the staged-scales TMA descriptor sees it: K/128 outermost, the rows innermost
    ((M, K/128) -> (K/128, M); the grouped masked layout's (E, Mmax, K/128) -> (K/128, E, Mmax))."""
    return scale_a.movedim(-1, 0)


def staged_scales_box(scale_a: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The staged-scales TMA box of ``staged_scales_view(scale_a)``: one k-block's ``rows`` rows (of one group; bm,
    the grouped contiguous layout's bm + SCALE_ALIGN)."""
    return (1,) * (scale_a.dim() - 1) + (rows,)


def staged_scales_reason(scale_a: torch.Tensor, rows: int) -> Optional[str]:
    """None if TMA can load block scales' scale_a (M, K/128), or the grouped masked layout's (E, Mmax, K/128), as
    ``staged_scales_view`` boxes of ``rows`` rows of one k-block (``ScaledConfig.staged_scales``: rows contiguous,
    torch's strides (1, M) with M a multiple of 4), else TMA's reason."""
    view = staged_scales_view(scale_a)
    try:
        check_tma_layout("scale_a", nvfly.f32, tuple(view.shape), view.stride(), scale_a.data_ptr(),
                         staged_scales_box(scale_a, rows), 0)
    except LaunchError as e:
        return str(e)
    return None


REDUCE_THREADS = 256


class _Call:
    """The launches of one call signature: the kernel, and with split K the reduce kernel (f32 partials laid out
    like the caller's output, so that the reduce reads and writes in memory order; a swapped plan's kernel writes
    their transpose), unless the splits add up in the kernel (``ScaledConfig.split_fix_up``: one launch)."""

    def __init__(self, plan: ScaledPlan, out: Optional[torch.Tensor], out_dtype: torch.dtype):
        self.plan = plan
        self.launch = scaled_mm_kernel.prepared(plan.grid, plan.threads, cluster_dims(plan.config))
        self.out_m, self.out_n = (plan.n, plan.m) if plan.swap else (plan.m, plan.n)
        self.reduce = None
        if plan.epilogue.partial:
            self.reduce_vec = vector_width(self.out_n, (out,), out_dtype.itemsize) \
                if out is None or out.stride(-1) == 1 else 1
            self.reduce = scaled_reduce_kernel.prepared(
                math.ceil(self.out_m * self.out_n / (REDUCE_THREADS * self.reduce_vec)), REDUCE_THREADS)

    def run(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            bias: Optional[torch.Tensor], out: torch.Tensor) -> None:
        plan = self.plan
        if a.shape[0] == 0 or b.shape[1] == 0:
            return
        if a.shape[1] == 0:
            out.copy_(torch.zeros_like(out) if bias is None else bias.to(out.dtype).expand_as(out))
            return
        kernel_a, kernel_b = a, b.t()  # the kernel's operands, both (rows, K) row-major
        sa, sb = kernel_scales(plan.epilogue.scaling, scale_a, scale_b)
        caller_sa, caller_sb = sa, sb
        target = out
        if plan.swap:
            kernel_a, kernel_b = kernel_b, kernel_a
            sa, sb = sb, sa
            target = out.t()
        if self.reduce is not None:
            splits = plan.config.split_k
            count = splits * self.out_m * self.out_n
            buffer = scratch.partials(a.device, current_stream(a.device.index), count)[:count]
            partials = buffer.view(splits, self.out_m, self.out_n)
            target = partials.transpose(1, 2) if plan.swap else partials
        if kernel_b.dtype == FP4_DTYPE:  # TMA copies the packed pairs as bytes
            kernel_b = kernel_b.view(torch.uint8)
        out_desc = cached_descriptor(target, *plan.store_box) if plan.config.tma_store else None
        sums = counts = None
        if plan.shared_tiles:  # stream K, split K's fix-up: a workspace slot (zero between launches) and count per
            cfg = plan.config   # shared consumer tile
            sums, counts = scratch.workspace(a.device, current_stream(a.device.index),
                                             plan.shared_tiles * cfg.consumers, cfg.wg_m * cfg.bn)
        sa_desc = cached_descriptor(staged_scales_view(sa), staged_scales_box(sa, plan.config.bm), 0) \
            if plan.config.staged_scales else None
        self.launch(cached_descriptor(kernel_a, plan.a_box, 128),
                    cached_descriptor(kernel_b, plan.b_box, plan.b_swizzle),
                    target, out_desc, sa_desc, sa, sb, None if self.reduce is not None else bias, plan.m, plan.n,
                    plan.k_tiles,
                    sums, counts, plan.dp_tiles, plan.block_iters, plan.config, plan.epilogue)
        if self.reduce is not None:
            self.reduce(partials, out, caller_sa, caller_sb, bias, self.out_m, self.out_n, plan.config.split_k,
                        plan.epilogue.scaling, self.reduce_vec, REDUCE_THREADS)


def cluster_dims(cfg: ScaledConfig) -> Optional[tuple[int, int, int]]:
    """The launch's cluster shape (``ScaledConfig.cluster_n`` blocks along x), or None: no cluster."""
    return (cfg.cluster_n, 1, 1) if cfg.cluster_n > 1 else None


def kernel_scales(scaling: str, scale_a: torch.Tensor, scale_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales as the kernel indexes them (views, no copies): tensor-wise one element each ([0]); row-wise
    vectors along M and N; block: scale_a (M, K/128) as given, scale_b as (N/128, K/128) (block1x128: (N, K/128));
    MX: the e8m0 bytes, (M, K/32) and (N, K/32)."""
    if scaling == "tensor":
        return scale_a.reshape(1), scale_b.reshape(1)
    if scaling == "row":
        return scale_a.select(1, 0), scale_b.select(0, 0)
    if scaling in MX:  # (M, K/32) and (N, K/32) as given, their bytes
        return scale_a.view(torch.uint8), scale_b.view(torch.uint8)
    return scale_a, scale_b.t()


_CALLS: OpCalls[_Call] = OpCalls()


# ---------------------------------------------------------------------------------------------- MXFP4 x 16-bit
def _plan_a16(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: torch.dtype, out: Any,
              config: Any, swap: Any) -> A16Plan:
    check_a16(a, b, scale_a, scale_b, bias, out_dtype, out)
    if config is not None and not isinstance(config, A16Config):
        raise TypeError(f"config: expected an A16Config or None for {a.dtype} activations with MXFP4 weights, got "
                        f"{type(config).__name__}")
    if swap is not None:
        raise ValueError("swap: MXFP4 weights with 16-bit activations always run swapped (the weight's rows are "
                         "the mma's M): pass None")
    layout = config.layout if config is not None else "natural"
    if layout.startswith("shuffled-") and layout != f"shuffled-{A16_LAYOUT_DTYPE[a.dtype]}":
        raise ValueError(f"config: layout={layout!r} is bit-shuffled for other activations than a's {a.dtype} "
                         f"(use shuffle_mxfp4_a16(w_q, 'shuffled-{A16_LAYOUT_DTYPE[a.dtype]}'))")
    return make_a16_plan(a.shape[0], b.shape[1], a.shape[1], config, plan_sm_count(a.get_device()))


def _bound_a16(op: str, a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: Any, out: Any,
               config: Any, swap: Any) -> "_A16Call":
    try:
        key = (layout_key(a), layout_key(b), layout_key(scale_b), layout_key(bias), layout_key(out), out_dtype,
               scale_a is None, config, swap)
        call = _A16_CALLS.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _A16_CALLS.plan(op, key, _new_a16_call, a, b, scale_a, scale_b, bias, out_dtype, out, config, swap)
    return call


def _new_a16_call(a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any, out_dtype: Any, out: Any, config: Any,
                  swap: Any) -> "_A16Call":
    plan = _plan_a16(a, b, scale_a, scale_b, bias, out_dtype, out, config, swap)
    reason = eligibility(a, b, scale_a, scale_b, bias, out_dtype, out)
    if reason:
        raise ValueError(reason)
    return _A16Call(plan, out, out_dtype)


class _A16Call:
    """The launches of one MXFP4 x 16-bit call signature: the streaming kernel, and with split K the scaled GEMM's
    reduce kernel (f32 partials [split, M, N]: it adds them and the bias; no scales left to apply)."""

    def __init__(self, plan: A16Plan, out: Optional[torch.Tensor], out_dtype: torch.dtype):
        self.plan = plan
        self.launch = mxfp4_a16_kernel.prepared(plan.grid, plan.threads)
        self.reduce = None
        if plan.partial:
            self.reduce_vec = vector_width(plan.n, (out,), out_dtype.itemsize) \
                if out is None or out.stride(-1) == 1 else 1
            self.reduce = scaled_reduce_kernel.prepared(
                math.ceil(plan.m * plan.n / (REDUCE_THREADS * self.reduce_vec)), REDUCE_THREADS)

    def run(self, a: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor, bias: Optional[torch.Tensor],
            out: torch.Tensor) -> None:
        plan = self.plan
        if plan.m == 0 or plan.n == 0:
            return
        if plan.k == 0:
            out.copy_(torch.zeros_like(out) if bias is None else bias.to(out.dtype).expand_as(out))
            return
        w = b.t().view(torch.uint8)  # (N, K/2) packed pairs, row-major
        w_scale = scale_b.view(torch.uint8)
        target = out
        if self.reduce is not None:
            count = plan.splits * plan.m * plan.n
            buffer = scratch.partials(a.device, current_stream(a.device.index), count)[:count]
            target = buffer.view(plan.splits, plan.m, plan.n)
        w_desc = s_desc = None
        if plan.config.tma_stages:
            w_desc = cached_descriptor(w, (ROWS, TMA_BOX_BYTES), TMA_BOX_BYTES)
            s_desc = cached_descriptor(w_scale, (ROWS, TMA_SCALE_BYTES // ROWS), 0)
        self.launch(w, w_scale, a, target, None if self.reduce is not None else bias, plan.m, plan.n, plan.k,
                    plan.chunks_per_split, plan.token_blocks, plan.splits, w_desc, s_desc, plan.kernel_config,
                    plan.m_tiles, self.reduce is not None)
        if self.reduce is not None:
            self.reduce(target, out, w_scale, w_scale, bias, plan.m, plan.n, plan.splits, "mxfp4", self.reduce_vec,
                        REDUCE_THREADS)


_A16_CALLS: OpCalls[_A16Call] = OpCalls()


def compile_a16(m: int, n: int, k: int, config: Optional[A16Config] = None, activations: Any = torch.bfloat16,
                out_dtype: torch.dtype = torch.bfloat16, bias: bool = False, sms: int = 132,
                target: str = "sm_90a") -> tuple[A16Plan, Any]:
    """Plan an m x n x k MXFP4 x 16-bit call for ``sms`` SMs and compile its streaming kernel without a GPU
    (contiguous operands); returns (plan, CompiledKernel)."""
    from nvfly.frontend.dtypes import bf16, f16, f32, u8
    from nvfly.runtime.tensor_desc import TensorDesc
    nv = {torch.bfloat16: bf16, torch.float16: f16, torch.float32: f32}
    plan = make_a16_plan(m, n, k, config, sms)
    out = TensorDesc(f32, (plan.splits, m, n)) if plan.partial else TensorDesc(nv[out_dtype], (m, n))
    w, w_scale = TensorDesc(u8, (n, k // 2)), TensorDesc(u8, (n, k // MX_BLOCK))
    w_desc = s_desc = None
    if plan.config.tma_stages:
        w_desc = nvfly.TmaDescriptor(w, (ROWS, TMA_BOX_BYTES), swizzle=TMA_BOX_BYTES)
        s_desc = nvfly.TmaDescriptor(w_scale, (ROWS, TMA_SCALE_BYTES // ROWS), swizzle=0)
    kernel = mxfp4_a16_kernel.compile(w, w_scale, TensorDesc(nv[activations], (m, k)), out,
                                      TensorDesc(bf16, (n,)) if bias and not plan.partial else None, m, n, k,
                                      plan.chunks_per_split, plan.token_blocks, plan.splits, w_desc, s_desc,
                                      CFG=plan.kernel_config,
                                      M_TILES=plan.m_tiles,
                                      PARTIAL=plan.partial, block=plan.threads, target=target)
    return plan, kernel


# ---------------------------------------------------------------------------------------------- references
def dequantize(x: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """x * scale in float32, each scale element covering a ``block`` of x (a one-element scale covers all of
    it; row/column scales broadcast)."""
    if scale.numel() == 1 or block == (1, 1):
        return x.float() * scale.float()
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return x.float() * full[:x.shape[0], :x.shape[1]]


def reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 GEMM of the dequantised operands (+ bias): what ``scaled_mm`` approximates."""
    if is_a16(a, b, scale_a):  # MXFP4 weights x 16-bit activations: the weight dequantised, a as given
        r = a.float() @ dequantize_mxfp4(b.t(), scale_b).t()
        return r if bias is None else r + bias.float()
    scaling = recipe(a, b, scale_a, scale_b)
    if scaling in MX:
        weight = dequantize_mxfp4(b.t(), scale_b) if scaling == "mxfp4" else dequantize_mx(b.t(), scale_b)
        r = dequantize_mx(a, scale_a) @ weight.t()
        return r if bias is None else r + bias.float()
    blocks = {"block": ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)),
              "block1x128": ((1, SCALE_BLOCK), (SCALE_BLOCK, 1))}.get(scaling, ((1, 1), (1, 1)))
    r = dequantize(a, scale_a, blocks[0]) @ dequantize(b, scale_b, blocks[1])
    return r if bias is None else r + bias.float()


# ---------------------------------------------------------------------------------------------- compiling
def compile_variants(variants: Sequence[tuple[ScaledConfig, ScaledEpilogue]], out_dtype: torch.dtype = torch.bfloat16,
                     dtypes: tuple[Any, Any] = (nvfly.f8e4m3, nvfly.f8e4m3), target: str = "sm_90a") -> list[Any]:
    """Compile the kernel for each (config, epilogue) without a GPU (M = N = K = 4096 strides; ``bias_rows``: a
    swapped plan's transposed output); returns CompiledKernels."""
    from nvfly.frontend.dtypes import bf16, f16, f32, i32, u8
    from nvfly.runtime.tensor_desc import TensorDesc
    out_nv = {torch.bfloat16: bf16, torch.float16: f16, torch.float32: f32}[out_dtype]
    size = 4096
    kernels = []
    for cfg, epi in variants:
        a_desc = nvfly.TmaDescriptor(TensorDesc(dtypes[0], (size, size)), (cfg.bm // cfg.cluster_n, BK), swizzle=128)
        b_desc = nvfly.TmaDescriptor(TensorDesc(dtypes[1], (size, size)), (min(cfg.bn, 256), BK), swizzle=128)
        if epi.scaling == "mxfp4":  # packed e2m1 pairs, (N, K/2) bytes
            b_desc = nvfly.TmaDescriptor(TensorDesc(u8, (size, size // 2)), (min(cfg.bn, 256), BK // 2), swizzle=0)
        out = TensorDesc(out_nv, (size, size), (1, size) if epi.bias_rows else None)
        if epi.partial:  # [split, rows, cols] f32 partial sums (a swapped plan's: transposed)
            out = TensorDesc(f32, (cfg.split_k, size, size),
                             (size * size, 1, size) if epi.bias_rows else None)
        kb = size // SCALE_BLOCK
        if epi.scaling == "tensor":
            sa, sb = TensorDesc(f32, (1,)), TensorDesc(f32, (1,))
        elif epi.scaling == "row":
            sa, sb = TensorDesc(f32, (size,)), TensorDesc(f32, (size,))
        elif epi.scaling == "block":
            sa, sb = TensorDesc(f32, (size, kb), (1, size)), TensorDesc(f32, (kb, kb))
        elif epi.scaling in MX:  # e8m0 bytes, (rows, K/32) row-major
            sa, sb = TensorDesc(u8, (size, size // MX_BLOCK)), TensorDesc(u8, (size, size // MX_BLOCK))
        else:  # 1x128 x 1x128: the kernel's sb is torch's (K/128, N) transposed
            sa, sb = TensorDesc(f32, (size, kb), (1, size)), TensorDesc(f32, (size, kb), (1, size))
        bias = TensorDesc(bf16, (size,)) if epi.bias else None
        out_desc = None
        if cfg.tma_store and not epi.partial:
            box, swizzle = store_box(cfg, False)
            out_desc = nvfly.TmaDescriptor(out, box, swizzle=swizzle)
        fix_up = cfg.stream_k or (cfg.split_fix_up and cfg.split_k > 1)  # the workspace and counts
        sums = TensorDesc(f32, (1 << 24,)) if fix_up else None
        counts = TensorDesc(i32, (1024,)) if fix_up else None
        sa_desc = nvfly.TmaDescriptor(TensorDesc(f32, (kb, size)), (1, cfg.bm), swizzle=0) if cfg.staged_scales \
            else None
        kernels.append(scaled_mm_kernel.compile(a_desc, b_desc, out, out_desc, sa_desc, sa, sb, bias, size, size,
                                                math.ceil(size / BK), sums, counts, 0, 0, CFG=cfg, EPI=epi,
                                                block=128 * (1 + cfg.consumers), cluster=cluster_dims(cfg),
                                                target=target))
    return kernels


def compile_reduce(scaling: str, splits: int, vec: int, bias: bool, out_dtype: torch.dtype = torch.bfloat16,
                   target: str = "sm_90a") -> Any:
    """Compile split K's reduce kernel without a GPU (a 64 x 4096 output)."""
    from nvfly.frontend.dtypes import bf16, f16, f32, u8
    from nvfly.runtime.tensor_desc import TensorDesc
    out_nv = {torch.bfloat16: bf16, torch.float16: f16, torch.float32: f32}[out_dtype]
    m, n = 64, 4096
    scales = {"tensor": ((1,), (1,)), "row": ((m,), (n,)), "block": ((m, 32), (32, 32)),
              "block1x128": ((m, 32), (n, 32)), "mxfp8": ((m, 128), (n, 128))}[scaling]
    scale_nv = u8 if scaling in MX else f32  # unread: block scales were applied in the mainloop
    return scaled_reduce_kernel.compile(TensorDesc(f32, (splits, m, n)), TensorDesc(out_nv, (m, n)),
                                        TensorDesc(scale_nv, scales[0]), TensorDesc(scale_nv, scales[1]),
                                        TensorDesc(bf16, (n,)) if bias else None, m, n, SPLITS=splits,
                                        SCALING=scaling, VEC=vec, THREADS=REDUCE_THREADS, block=REDUCE_THREADS,
                                        target=target)
