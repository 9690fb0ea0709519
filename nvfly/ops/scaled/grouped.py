"""The grouped scaled (FP8) GEMM's host functions on torch tensors (MoE experts): ``scaled_grouped_mm`` (tokens
sorted by expert, ``torch._scaled_grouped_mm``'s 2-D x 3-D), ``scaled_grouped_mm_masked`` (a fixed capacity per
expert with device counts, CUDA-graph decode), ``grouped_recipe``, ``check_grouped`` and ``grouped_eligibility``
(why a call is declined), ``describe_grouped``, ``grouped_reference`` and ``compile_grouped_variants``.

Operands are e4m3: ``a`` row-major tokens (contiguous [T, K]; masked [E, Mmax, K]), ``b`` the experts' weights
[E, K, N] column-major in the last two dimensions (``w.transpose(-2, -1)`` of row-major [E, N, K] weights, as
torch); MXFP4 weights are float4_e2m1fn_x2 [E, K/2, N], the ``transpose(-2, -1)`` of row-major packed [E, N, K/2]
(two values a byte along K, the lower k in the low nibble). Scales (fp32; MX: float8_e8m0fnu or their uint8 bytes):

    recipe   scale_a                                            scale_b
    block    contiguous [T, K/128], masked [E, Mmax, K/128]     [E, K/128, ceil(N/128)]  (128 x 128 weight blocks)
             (1 x 128: per token and 128 of K; any strides)     (any strides; K a multiple of 128)
    row      contiguous [T], masked [E, Mmax] (per token)       [E, N] (per expert and output channel)
    mxfp8    contiguous [T, K/32], masked [E, Mmax, K/32]       [E, N, K/32] (per expert, channel and 32 of K)
    mxfp4    as mxfp8 (MXFP8 tokens)                            as mxfp8, b packed e2m1 (K a multiple of 32)

out = (a * sa) @ (b * sb) per group, bf16 (default), fp16 or fp32; the rows no group covers are not written.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

import nvfly
from nvfly.ops.common.groups import validate_offsets
from nvfly.ops.common.opcall import OpCalls, named
from nvfly.ops.common.operands import hopper_reason, store_reason
from nvfly.ops.scaled.api import (FP4_DTYPE, check_mx_scales, is_mx, staged_scales_box, staged_scales_reason,
                                  staged_scales_view)
from nvfly.ops.scaled.config import BK, BLOCKWISE, MX, MX_BLOCK, SCALE_BLOCK, ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled.grouped_kernel import scaled_grouped_kernel
from nvfly.ops.scaled.grouped_plan import MAX_GROUPS, ScaledGroupedPlan, fallback_config, make_grouped_plan
from nvfly.ops.scaled.quantize import dequantize_mx, dequantize_mxfp4
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.tma import cached_descriptor
from nvfly.runtime.torch_args import layout_key

SCALED_GROUPED_MM = "nvfly.ops.scaled.scaled_grouped_mm"
SCALED_GROUPED_MM_MASKED = "nvfly.ops.scaled.scaled_grouped_mm_masked"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------- checks
def grouped_recipe(a: Any, b: Any, scale_a: Any, scale_b: Any) -> str:
    """"block" (1 x 128 tokens x 128 x 128 weights) or "row" (per token x per expert channel), as the scales' shapes
    say for a ([T, K] or [E, Mmax, K]) @ b [E, K, N]; raises ValueError naming the scale that fits neither. e8m0
    scales (or packed e2m1 ``b`` [E, K/2, N]) are MX: "mxfp8" ("mxfp4" for packed ``b``) when scale_a is a's rows by
    K/32 and scale_b [E, N, K/32], else a TypeError or ValueError naming the argument (``check_mx_scales``)."""
    e, k, n = b.shape
    rows = tuple(a.shape[:-1])
    if is_mx(scale_a) or is_mx(scale_b) or b.dtype == FP4_DTYPE:
        check_mx_scales(a.shape[-1], (("scale_a", scale_a, rows), ("scale_b", scale_b, (e, n))))
        return "mxfp4" if b.dtype == FP4_DTYPE else "mxfp8"
    kb = math.ceil(k / SCALE_BLOCK)
    block = (rows + (kb,), (e, kb, math.ceil(n / SCALE_BLOCK)))
    row = (rows, (e, n))
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    expected = (f"block: scale_a {block[0]} and scale_b {block[1]}; row: scale_a {row[0]} and scale_b {row[1]}")
    if sa == block[0] and sb == block[1]:
        if k % SCALE_BLOCK:
            raise ValueError(f"a: K={k} is not a multiple of {SCALE_BLOCK}: block scales cover whole 128-wide blocks "
                             f"of K")
        return "block"
    if sa == row[0] and sb == row[1]:
        return "row"
    if sa not in (block[0], row[0]):
        raise ValueError(f"scale_a: shape {sa} matches no scaling of a {tuple(a.shape)} (expected {expected})")
    raise ValueError(f"scale_b: shape {sb} does not match scale_a's {'block' if sa == block[0] else 'row'}-wise "
                     f"{sa} for b {tuple(b.shape)} (expected {expected})")


def check_grouped(a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any, out_dtype: Any = torch.bfloat16,
                  out: Any = None, masked: bool = False) -> tuple[str, tuple[int, ...], int]:
    """What the grouped scaled GEMM takes, on any device: raises TypeError or ValueError naming the argument;
    returns (recipe, output shape, groups). ``offs`` is the masked layout's counts when ``masked``."""
    offs_name = "counts" if masked else "offs"
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b), (offs_name, offs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    a_rank = 3 if masked else 2
    if a.dim() != a_rank:
        raise ValueError(f"a: the {'masked' if masked else 'contiguous'} layout takes a {a_rank}-D a "
                         f"{'[E, Mmax, K]' if masked else '[T, K]'}, got {a.dim()}-D")
    if b.dim() != 3:
        raise ValueError(f"b: expected 3-D expert weights [E, K, N], got {b.dim()}-D")
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn and not (name == "b" and t.dtype == FP4_DTYPE):
            raise TypeError(f"{name}: dtype {t.dtype}: the grouped scaled GEMM takes float8_e4m3fn operands"
                            + (" (or float4_e2m1fn_x2 MXFP4 weights)" if name == "b" else ""))
    e, k, n = b.shape
    if b.dtype == FP4_DTYPE:  # e2m1 pairs: b is [E, K/2, N]
        k *= 2
    if a.shape[-1] != k:
        raise ValueError(f"b: shape {tuple(b.shape)} and a's {tuple(a.shape)} do not multiply (K is {a.shape[-1]} "
                         f"in a, {k} in b)")
    if masked and a.shape[0] != e:
        raise ValueError(f"b: {e} experts, a has {a.shape[0]} groups")
    if k % 16 or n % 16:
        raise ValueError(f"b: K={k} and N={n} must be multiples of 16 (fp8 GEMM rows of 16 bytes)")
    if a.stride(-1) != 1 and k > 1:
        raise ValueError(f"a: expected row-major tokens (stride 1 along K), got strides {a.stride()}")
    if b.stride(-2) != 1 and k > 1:
        raise ValueError(f"b: expected column-major weights [E, K, N] (stride 1 along K: w.transpose(-2, -1) of "
                         f"[E, N, K] weights), got strides {b.stride()}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"{offs_name}: expected a 1-D int32 tensor, got {offs.dim()}-D {offs.dtype}")
    groups = offs.shape[0]
    if groups != e:
        raise ValueError(f"{offs_name}: {groups} groups, b has {e} experts")
    if not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"{offs_name}: {groups} groups: the grouped scaled GEMM takes 1 to {MAX_GROUPS}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32 and not is_mx(t):
            raise TypeError(f"{name}: dtype {t.dtype}: expected float32 scales (or float8_e8m0fnu MX scales)")
    scaling = grouped_recipe(a, b, scale_a, scale_b)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: {out_dtype} is not bf16, fp16 or fp32")
    shape = tuple(a.shape[:-1]) + (n,)
    if out is not None:
        if tuple(out.shape) != shape:
            raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
        if out.dtype != out_dtype:
            raise TypeError(f"out: expected dtype {out_dtype}, got {out.dtype}")
    return scaling, shape, groups


def grouped_eligibility(a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any, out_dtype: Any = torch.bfloat16,
                        out: Any = None, masked: bool = False) -> Optional[str]:
    """None when nvfly runs these arguments, else why not (``check_grouped``'s error, the device's, TMA's)."""
    try:
        check_grouped(a, b, scale_a, scale_b, offs, out_dtype, out, masked)
    except (TypeError, ValueError) as exc:
        return str(exc)
    offs_name = "counts" if masked else "offs"
    reason = hopper_reason("nvfly's grouped scaled GEMM", a, b=b, scale_a=scale_a, scale_b=scale_b,
                           **{offs_name: offs}, out=out)
    if reason:
        return reason
    if offs.stride(0) != 1 and offs.shape[0] > 1:
        return f"{offs_name}: not contiguous"
    for name, t, dims in (("a", a, range(a.dim() - 1)), ("b", b, (0, 2))):
        for d in dims:
            if t.shape[d] > 1 and t.stride(d) % 16:
                return f"{name}: stride {t.stride(d)} of dimension {d} is not a multiple of 16 bytes (TMA needs it)"
        if t.data_ptr() % 16:
            return f"{name}: its address is not 16-byte aligned (TMA needs it)"
    return None


# ---------------------------------------------------------------------------------------------- calls
class _GroupedScaledCall:
    """The kernel's launch for one call signature."""

    def __init__(self, plan: ScaledGroupedPlan, shape: tuple):
        self.plan = plan
        self.shape = shape
        self.launch = scaled_grouped_kernel.prepared(plan.grid, plan.threads, (plan.config.cluster_n, 1, 1))

    def run(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
            offs: torch.Tensor, out: torch.Tensor) -> None:
        plan = self.plan
        if math.prod(self.shape) == 0:
            return
        if plan.k == 0:
            out.zero_()
            return
        scaling = plan.epilogue.scaling
        sa, sb = scale_a, scale_b.transpose(-1, -2) if scaling == "block" else scale_b  # [E, N/128, K/128]
        kernel_b = b.transpose(-1, -2)  # [E, N, K] (MXFP4: [E, N, K/2] pairs, which TMA copies as bytes)
        if scaling in MX:  # the e8m0 bytes
            sa, sb = scale_a.view(torch.uint8), scale_b.view(torch.uint8)
            kernel_b = kernel_b.view(torch.uint8) if plan.config.packed_b else kernel_b
        sa_desc = cached_descriptor(staged_scales_view(scale_a), staged_scales_box(scale_a, plan.scale_rows), 0) \
            if plan.config.staged_scales else None
        out_desc = cached_descriptor(out, *plan.store_box) if plan.store_box else None
        self.launch(cached_descriptor(a, plan.a_box, 128), cached_descriptor(kernel_b, plan.b_box, plan.b_swizzle),
                    out.unsqueeze(0) if plan.layout == "contiguous" else out, out_desc, offs, sa_desc, sa, sb,
                    plan.m, plan.n, plan.k_tiles, plan.config, plan.groups, plan.layout, plan.epilogue)


_CALLS: OpCalls[_GroupedScaledCall] = OpCalls()


def _plan(a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any, out_dtype: Any, out: Any, use_fast_accum: bool,
          masked: bool, config: Optional[ScaledConfig], rows_per_group: Optional[float],
          sms: Optional[int] = None) -> tuple[ScaledGroupedPlan, tuple]:
    scaling, shape, groups = check_grouped(a, b, scale_a, scale_b, offs, out_dtype, out, masked)
    if config is not None and not isinstance(config, ScaledConfig):
        raise TypeError(f"config: expected a ScaledConfig or None, got {type(config).__name__}")
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum)
    m = a.shape[-2] if masked else a.shape[0]
    rows = rows_per_group if rows_per_group is not None else (m if masked else m / groups)
    sms = sms if sms is not None else plan_sm_count(a.get_device())
    # K from a: MXFP4's b [E, K/2, N] holds two values a byte along K
    plan = make_grouped_plan("masked" if masked else "contiguous", epilogue, groups, m, b.shape[2], a.shape[-1], rows,
                             sms, config)
    # staged scales where TMA can load scale_a (rows contiguous, as the quantiser's), else the scales from global;
    # the TMA-store epilogue where TMA can store the output (16-bit), else registers
    cfg = plan.config
    if cfg.staged_scales and staged_scales_reason(scale_a, plan.scale_rows) is not None:
        cfg = replace(cfg, staged_scales=False)
    if cfg.tma_store and (out_dtype.itemsize != 2 or (out is not None and store_reason(out) is not None)):
        # the heuristic's tile measured only with its store: without it, the 128 x 128 tile (the caller's keeps its)
        cfg = fallback_config(groups, epilogue) if config is None else replace(cfg, tma_store=False)
    if cfg != plan.config:
        plan = make_grouped_plan(plan.layout, epilogue, groups, m, plan.n, plan.k, rows, sms, cfg)
    return plan, shape


def _new_call(a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any, out_dtype: Any, out: Any,
              use_fast_accum: bool, masked: bool, config: Any, rows_per_group: Any) -> _GroupedScaledCall:
    plan, shape = _plan(a, b, scale_a, scale_b, offs, out_dtype, out, use_fast_accum, masked, config,
                        rows_per_group)
    reason = grouped_eligibility(a, b, scale_a, scale_b, offs, out_dtype, out, masked)
    if reason:
        raise ValueError(reason)
    return _GroupedScaledCall(plan, shape)


def _bound(op: str, a: Any, b: Any, scale_a: Any, scale_b: Any, offs: Any, out_dtype: Any, out: Any,
           use_fast_accum: bool, masked: bool, config: Any, rows_per_group: Any) -> _GroupedScaledCall:
    try:
        key = (layout_key(a), layout_key(b), layout_key(scale_a), layout_key(scale_b), layout_key(offs),
               layout_key(out), out_dtype, bool(use_fast_accum), masked, config, rows_per_group)
        call = _CALLS.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _CALLS.plan(op, key, _new_call, a, b, scale_a, scale_b, offs, out_dtype, out, use_fast_accum, masked,
                           config, rows_per_group)
    return call


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                      out: Optional[torch.Tensor] = None, use_fast_accum: bool = False,
                      config: Optional[ScaledConfig] = None, rows_per_group: Optional[float] = None,
                      check_offsets: bool = False) -> torch.Tensor:
    """The MoE forward in FP8: a [T, K] (tokens sorted by expert) x b [E, K, N] with ``offs`` (int32 [E], the
    cumulative group ends on the device; group g the rows [offs[g-1], offs[g])) -> out [T, N], each group's rows
    (a * scale_a) @ (b[g] * scale_b[g]); rows past offs[-1] are not written. Block (DeepSeek-V3), row-wise
    (``torch._scaled_grouped_mm``'s) or MX (e8m0 per 32 of K; ``b`` MXFP8 or packed MXFP4) scales, see the module
    doc; block scales always promote every k-block of 128 into fp32, MX ones every k-step of 32, row-wise ones
    unless ``use_fast_accum``. The group sizes are never read on the host (groups of any size, 0 included; offsets
    that decrease or pass T are clamped on the device). ``config``: the kernel's tile
    (a ScaledConfig without K splits), ``rows_per_group`` the heuristic's estimate (default the average);
    ``check_offsets=True`` checks the offsets first, with a host sync (``validate_offsets``). Raises TypeError or
    ValueError naming the argument when nvfly cannot run it."""
    call = _bound(SCALED_GROUPED_MM, a, b, scale_a, scale_b, offs, out_dtype, out, use_fast_accum, False, config,
                  rows_per_group)
    if check_offsets:
        with named(SCALED_GROUPED_MM):
            validate_offsets(offs, a.shape[0])
    if out is None:
        out = torch.empty(call.shape, dtype=out_dtype, device=a.device)
    call.run(a, b, scale_a, scale_b, offs, out)
    return out


def scaled_grouped_mm_masked(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                             counts: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
                             out: Optional[torch.Tensor] = None, use_fast_accum: bool = False,
                             config: Optional[ScaledConfig] = None,
                             expected_rows: Optional[float] = None, check_offsets: bool = False) -> torch.Tensor:
    """The masked layout: a [E, Mmax, K] x b [E, K, N] -> out [E, Mmax, N], group g its first ``counts[g]`` rows
    (int32 [E] on the device, clamped to [0, Mmax]); the other rows are not written. ``expected_rows``: the rows a
    group has on average, for the heuristic (default Mmax; DeepGEMM's expected_m). Scales and the rest as
    ``scaled_grouped_mm`` (scale_a [E, Mmax, K/128], [E, Mmax] or MX [E, Mmax, K/32]; ``check_offsets`` checks the
    counts)."""
    call = _bound(SCALED_GROUPED_MM_MASKED, a, b, scale_a, scale_b, counts, out_dtype, out, use_fast_accum, True,
                  config, expected_rows)
    if check_offsets:
        with named(SCALED_GROUPED_MM_MASKED):
            validate_offsets(counts, a.shape[1], masked=True, name="counts")
    if out is None:
        out = torch.empty(call.shape, dtype=out_dtype, device=a.device)
    call.run(a, b, scale_a, scale_b, counts, out)
    return out


def describe_grouped(layout: str, groups: int, m: int, n: int, k: int, *, scaling: str = "block",
                     use_fast_accum: bool = False, rows_per_group: Optional[float] = None, sms: int = 132) -> str:
    """What the grouped scaled GEMM runs (no GPU needed): ``layout`` "contiguous" (m tokens in all) or "masked"
    (m rows of capacity a group), planned for ``sms`` SMs."""
    epilogue = ScaledEpilogue(scaling, promote=scaling in BLOCKWISE or not use_fast_accum)
    rows = rows_per_group if rows_per_group is not None else (m / groups if layout == "contiguous" else m)
    plan = make_grouped_plan(layout, epilogue, groups, m, n, k, rows, sms)
    cfg = plan.config
    return (f"scaled-grouped-{layout}-{scaling}{'-promoted' if epilogue.promote else ''}"
            f"{'-staged' if cfg.staged_scales else ''}: {cfg.bm}x{cfg.bn} tile on "
            f"{cfg.consumers} consumer{'s' if cfg.consumers > 1 else ''}, {cfg.stages} stages, up to {plan.grid} "
            f"blocks{', TMA-store epilogue' if cfg.tma_store else ''}"
            f"{f', {cfg.cluster_n}-block clusters along N (A multicast)' if cfg.cluster_n > 1 else ''}")


# ---------------------------------------------------------------------------------------------- references
def grouped_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, *, masked: bool = False) -> torch.Tensor:
    """The float32 per-group product of the dequantised operands (what ``scaled_grouped_mm`` and, with
    ``masked``, ``scaled_grouped_mm_masked`` approximate); rows no group covers are NaN."""
    scaling = grouped_recipe(a, b, scale_a, scale_b)

    def dequantized(g: int, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        x = a[g][rows] if masked else a[rows]
        sx = scale_a[g][rows] if masked else scale_a[rows]
        if scaling in MX:  # the dense MX reference's dequantisation, b[g].t() the expert's [N, K] (or [N, K/2])
            dequantize_b = dequantize_mxfp4 if scaling == "mxfp4" else dequantize_mx
            return dequantize_mx(x, sx), dequantize_b(b[g].t(), scale_b[g]).t()
        w = b[g].float()
        if scaling == "row":
            return x.float() * sx[:, None], w * scale_b[g][None, :]
        k, n = w.shape
        sa_full = sx.repeat_interleave(SCALE_BLOCK, 1)[:, :k]
        sb_full = scale_b[g].repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)[:k, :n]
        return x.float() * sa_full, w * sb_full

    n = b.shape[2]
    out = torch.full(tuple(a.shape[:-1]) + (n,), float("nan"), device=a.device)
    sizes = offs.cpu().tolist()
    for g, size in enumerate(sizes):
        if masked:
            rows = slice(0, max(0, min(size, a.shape[1])))
        else:
            rows = slice(sizes[g - 1] if g else 0, size)
        if rows.stop > rows.start:
            x, w = dequantized(g, rows)
            (out[g] if masked else out)[rows] = x @ w
    return out


# ---------------------------------------------------------------------------------------------- compiling
def compile_grouped_variants(variants: Sequence[tuple[str, ScaledConfig, ScaledEpilogue]], groups: int = 8,
                             out_dtype: torch.dtype = torch.bfloat16, target: str = "sm_90a") -> list[Any]:
    """Compile the kernel without a GPU for each (layout, config, epilogue) of a 4096 x 4096 x 4096 problem a group
    (masked: Mmax 4096; contiguous: T 4096); returns CompiledKernels."""
    from nvfly.frontend.dtypes import bf16, f16, f32, u8
    from nvfly.runtime.tensor_desc import TensorDesc
    out_nv = {torch.bfloat16: bf16, torch.float16: f16, torch.float32: f32}[out_dtype]
    size = 4096
    kb = size // BK
    kernels = []
    for layout, cfg, epi in variants:
        plan = make_grouped_plan(layout, epi, groups, size, size, size, size / groups, 132, cfg)
        rows = (groups, size) if layout == "masked" else (size,)
        a_desc = nvfly.TmaDescriptor(TensorDesc(nvfly.f8e4m3, rows + (size,)), plan.a_box, swizzle=128)
        b_desc = nvfly.TmaDescriptor(TensorDesc(nvfly.f8e4m3, (groups, size, size)), plan.b_box, swizzle=128)
        if plan.config.packed_b:  # MXFP4: e2m1 pairs [E, N, K/2] as bytes
            b_desc = nvfly.TmaDescriptor(TensorDesc(u8, (groups, size, size // 2)), plan.b_box, swizzle=plan.b_swizzle)
        out = TensorDesc(out_nv, (groups if layout == "masked" else 1, size, size))
        out_desc = None
        if plan.store_box:  # the contiguous output's descriptor is 2-D [T, N]
            out_desc = nvfly.TmaDescriptor(TensorDesc(out_nv, out.shape[1:] if layout == "contiguous" else out.shape),
                                           plan.store_box[0], swizzle=plan.store_box[1])
        if epi.scaling == "block":  # torch's scale_b [E, K/128, N/128] seen as [E, N/128, K/128]
            sa = TensorDesc(f32, rows + (kb,))
            sb = TensorDesc(f32, (groups, kb, kb), (kb * kb, 1, kb))
        elif epi.scaling in MX:  # e8m0 bytes, K/32 innermost
            sa, sb = TensorDesc(u8, rows + (size // MX_BLOCK,)), TensorDesc(u8, (groups, size, size // MX_BLOCK))
        else:
            sa, sb = TensorDesc(f32, rows), TensorDesc(f32, (groups, size))
        # staged scales: scale_a seen K/128 outermost (staged_scales_view), one k-block's plan.scale_rows a box
        sa_desc = nvfly.TmaDescriptor(TensorDesc(f32, (kb,) + rows), (1,) * len(rows) + (plan.scale_rows,), swizzle=0) \
            if cfg.staged_scales else None
        kernels.append(scaled_grouped_kernel.compile(a_desc, b_desc, out, out_desc, TensorDesc(nvfly.i32, (groups,)),
                                                     sa_desc,
                                                     sa, sb, size, size, plan.k_tiles, CFG=plan.config, GROUPS=groups,
                                                     LAYOUT=layout, EPI=epi, block=plan.threads,
                                                     cluster=(cfg.cluster_n, 1, 1) if cfg.cluster_n > 1 else None,
                                                     target=target))
    return kernels
