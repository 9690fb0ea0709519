"""Decode attention's host functions: argument checks and eligibility, the plan, the launches, a float32 reference
and a compile helper for tests without a GPU."""
from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Union

import nvfly
from nvfly.ops.attention.checks import aligned as _aligned
from nvfly.ops.attention.checks import check_values as _check_values
from nvfly.ops.attention.checks import require_cuda as _require_cuda
from nvfly.ops.attention.checks import sm_count as _sm_count
from nvfly.ops.attention.checks import tensor_argument as _tensor
from nvfly.ops.attention.combine_kernel import compile_combine, launch_combine, prepared_combine
from nvfly.ops.attention.decode_kernel import attention_decode_kernel
from nvfly.ops.attention.block_mask_kernel import THREADS as TABLES_THREADS
from nvfly.ops.attention.block_mask_kernel import block_mask_tables_kernel
from nvfly.ops.attention.calls import CallBuffers, check_out
from nvfly.ops.attention.gqa_api import GqaCall
from nvfly.ops.attention.gqa_plan import gqa_by_default, gqa_declined, gqa_plan
from nvfly.ops.attention.kv_options import (FP8, OP, block_mask_key, block_mask_tables, check_block_mask,
                                            check_block_numbers, check_scales, error, kernel_scales, mask_mod_of,
                                            mask_table_shapes, mask_tables_plan, per_head, reference_block_keep)
from nvfly.ops.attention.mla_api import check_mla_arguments, from_decode, mla_eligibility
from nvfly.ops.attention.mla_plan import DQK as MLA_DQK
from nvfly.ops.attention.mods import MAX_CAPTURED, Mods, bound, captured_tensors
from nvfly.ops.attention.plan import BLOCK_N, HEAD_DIMS, MAX_SQ, DecodePlan, MaskTablesPlan, decode_plan
from nvfly.ops.common.opcall import CALL_LIMIT, OpCalls, context_value
from nvfly.runtime import torch_args
from nvfly.runtime.torch_args import layout_key

if TYPE_CHECKING:
    import torch

DTYPES = ("torch.bfloat16", "torch.float16")
_MODS: dict = {}  # (score_mod, mask_mod, arguments) -> Mods: one compile key per pair of functions


def is_mla(q: Any, k_cache: Any) -> bool:
    """A 576-column q (no head dim of the general kernel): MLA decode's call (``mla_api``)."""
    return getattr(q, "ndim", 0) == 4 and q.shape[-1] == MLA_DQK


def _check(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any) -> tuple[int, int]:
    """Validate shapes, dtypes, devices and layouts (errors name the argument); returns (cache capacity, pages or 0)."""
    _tensor(q, "q", 4)
    _tensor(k_cache, "k_cache", 4)
    _tensor(v_cache, "v_cache", 4)
    if str(q.dtype) not in DTYPES:
        raise error(TypeError, "q", f"dtype {q.dtype} is not supported (bfloat16, float16)")
    fp8 = str(k_cache.dtype) == FP8
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if fp8 and str(t.dtype) != FP8:
            raise error(TypeError, name, f"dtype {t.dtype}: with a {FP8} k_cache, v_cache must be {FP8} too")
        if not fp8 and t.dtype != q.dtype:
            raise error(TypeError, name, f"dtype {t.dtype} differs from q's {q.dtype} (or use {FP8} K and V)")
        if t.device != q.device:
            raise error(ValueError, name, f"on {t.device}, q on {q.device}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise error(ValueError, name, f"the last dimension must be contiguous (stride 1), got strides "
                                           f"{tuple(t.stride())}")
    batch, sq, hq, dqk = q.shape
    if not 1 <= sq <= MAX_SQ:
        raise error(ValueError, "q", f"{sq} query tokens per sequence (dimension 1); decode takes 1 to {MAX_SQ}")
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise error(ValueError, "v_cache", f"shape {tuple(v_cache.shape)} does not match k_cache's "
                                            f"{tuple(k_cache.shape)} in its first three dimensions")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise error(ValueError, "q", f"{hq} query heads are not a multiple of k_cache's {hkv} KV heads")
    if k_cache.shape[3] != dqk:
        raise error(ValueError, "k_cache", f"head dim {k_cache.shape[3]} differs from q's {dqk}")
    for name, d in (("q", dqk), ("v_cache", v_cache.shape[3])):
        if d not in HEAD_DIMS:
            raise error(ValueError, name, f"head dim {d} is not supported ({', '.join(map(str, HEAD_DIMS))})")
    pages = 0
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise error(ValueError, "k_cache", f"{k_cache.shape[0]} sequences (dimension 0), q has {batch}")
        capacity = k_cache.shape[1]
    else:
        _tensor(block_table, "block_table", 2)
        if str(block_table.dtype) != "torch.int32":
            raise error(TypeError, "block_table", f"expected int32, got {block_table.dtype}")
        if block_table.shape[0] != batch:
            raise error(ValueError, "block_table", f"{block_table.shape[0]} rows, q has {batch} sequences")
        if block_table.device != q.device:
            raise error(ValueError, "block_table", f"on {block_table.device}, q on {q.device}")
        pages = k_cache.shape[0]
        capacity = block_table.shape[1] * k_cache.shape[1]
    if cache_seqlens is not None:
        _tensor(cache_seqlens, "cache_seqlens", 1)
        if str(cache_seqlens.dtype) not in ("torch.int32", "torch.int64"):
            raise error(TypeError, "cache_seqlens", f"expected int32 or int64, got {cache_seqlens.dtype}")
        if cache_seqlens.shape[0] != batch:
            raise error(ValueError, "cache_seqlens", f"{cache_seqlens.shape[0]} lengths, q has {batch} sequences")
        if cache_seqlens.device != q.device:
            raise error(ValueError, "cache_seqlens", f"on {cache_seqlens.device}, q on {q.device}")
    return capacity, pages


def check_arguments(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None, block_table: Any = None,
                    k_scale: Any = None, v_scale: Any = None) -> None:
    """``decode``'s checks of shapes, dtypes, devices and layouts, raising as it does: what reads no tensor values or
    addresses (so a fake implementation under FakeTensorMode runs them too)."""
    if is_mla(q, k_cache):
        check_mla_arguments(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale)
        return
    _check(q, k_cache, v_cache, cache_seqlens, block_table)
    check_scales(k_scale, v_scale, q, k_cache)


def eligibility(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any = None, block_table: Any = None,
                score_mod: Optional[Callable[..., Any]] = None, mask_mod: Optional[Callable[..., Any]] = None,
                k_scale: Any = None, v_scale: Any = None, block_mask: Any = None,
                captured: tuple = ()) -> Optional[str]:
    """None when ``decode`` computes this call, else the reason it declines."""
    if is_mla(q, k_cache):
        if any(x is not None for x in (score_mod, mask_mod, k_scale, v_scale, block_mask)) or captured:
            return "mods, fp8 scales and block masks are not supported with MLA's 576-column latent cache"
        return mla_eligibility(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table)
    try:
        capacity, _ = _check(q, k_cache, v_cache, cache_seqlens, block_table)
        check_scales(k_scale, v_scale, q, k_cache)
        if block_mask is not None:
            check_block_mask(block_mask, mask_mod, q, k_cache.shape[2], capacity)
            mask_mod = mask_mod_of(block_mask, mask_mod)
        mods = _mods(score_mod, mask_mod, check_captured(captured, q))
    except (TypeError, ValueError) as exc:
        return str(exc)
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    if not all(_aligned(t) for t in (q, k_cache, v_cache)):
        return "q, k_cache and v_cache need 16-byte aligned rows (strides but the last a multiple of 8 elements)"
    if mods.arguments + len(captured_tensors(mods)) > MAX_CAPTURED:
        return f"the mods take more than {MAX_CAPTURED} tensors (captured= and captured by the functions)"
    return None


def check_captured(captured: Any, q: Any, op: str = OP) -> int:
    """The number of tensors in a ``captured=`` argument (a tuple or list of tensors on q's device); raises naming
    the argument."""
    import torch
    if not isinstance(captured, (tuple, list)):
        raise error(TypeError, "captured", f"expected a tuple of tensors, got {type(captured).__name__}", op)
    for t in captured:
        if not isinstance(t, torch.Tensor):
            raise error(TypeError, "captured", f"expected tensors, got a {type(t).__name__}", op)
        if t.device != q.device:
            raise error(ValueError, "captured", f"a tensor on {t.device}, q on {q.device}", op)
    if len(captured) > MAX_CAPTURED:
        raise error(ValueError, "captured", f"{len(captured)} tensors; the kernels take at most {MAX_CAPTURED}", op)
    return len(captured)


def _mods(score_mod: Optional[Callable[..., Any]], mask_mod: Optional[Callable[..., Any]], arguments: int = 0) -> Mods:
    key = (score_mod, mask_mod, arguments)
    found = _MODS.get(key)
    if found is None:
        found = _MODS[key] = Mods(score_mod, mask_mod, arguments)
    return found


def _kernel_captured(mods: Mods, device: Any, captured: tuple = ()) -> list:
    """The mods' tensors as the kernel reads them (``captured``, the call's arguments, then the functions'):
    on the device, contiguous, 32-bit."""
    import torch
    out = []
    for t in (*captured, *captured_tensors(mods)):
        dtype = {torch.int64: torch.int32, torch.float64: torch.float32, torch.bool: torch.int32}.get(t.dtype, t.dtype)
        out.append(t.to(device=device, dtype=dtype).contiguous())
    return out


def decode(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", *,
           cache_seqlens: Optional["torch.Tensor"] = None, block_table: Optional["torch.Tensor"] = None,
           scale: Optional[float] = None, causal: bool = True, score_mod: Optional[Callable[..., Any]] = None,
           mask_mod: Optional[Callable[..., Any]] = None, return_lse: bool = False, validate: bool = True,
           splits: int = 0, out: Optional["torch.Tensor"] = None, k_scale: Optional["torch.Tensor"] = None,
           v_scale: Optional["torch.Tensor"] = None, block_mask: Any = None, captured: tuple = ()
           ) -> Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]:
    """softmax(q kᵀ scale + mods) v for Sq = 1..16 query tokens per sequence, fp32 accumulation.

    q (B, Sq, Hq, Dqk); k_cache (B, S, Hkv, Dqk) and v_cache (B, S, Hkv, Dv), any strides with the last dimension
    contiguous (a (B, Hkv, S, D) cache is passed as ``cache.transpose(1, 2)``); or, with ``block_table``
    (B, max_pages) int32, paged caches (pages, page_size, Hkv, D) with sequence b's key j in page
    block_table[b, j // page_size]. ``cache_seqlens`` (B,) int32/int64: keys of each sequence (default: all of
    the cache). Queries are the last Sq positions of their sequence; ``causal`` masks keys after each query.
    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` as in flex_attention (see
    ``nvfly.ops.attention.mods``; q_idx is the query's position in its sequence). Returns out (B, Sq, Hq, Dv) in
    q's dtype, and with ``return_lse`` the log-sum-exp (B, Hq, Sq) float32 (natural log; -inf for a row with no key,
    whose output is zeros). ``validate`` reads cache_seqlens and block_table to check them (a device sync; skipped
    under CUDA graph capture). ``splits`` > 0 forces the split-KV count. ``out``: a contiguous (B, Sq, Hq, Dv)
    tensor of q's dtype to write (else a new one).

    fp8 caches: ``k_cache`` and ``v_cache`` of dtype torch.float8_e4m3fn (q stays bf16/fp16), dequantised in the
    kernel as value * scale by ``k_scale`` and ``v_scale``: float32 tensors of shape () or (1,) (per tensor) or
    (Hkv,) (per KV head); None is a scale of 1. ``block_mask``: a flex_attention ``BlockMask`` whose query
    dimension is one block covering the Sq queries (kv_num_blocks (1 or B, 1 or Hq, 1)) and whose KV block size is
    a multiple of 64: keys in its empty blocks are masked and not read, its partial blocks apply its ``mask_mod``
    (called like ``mask_mod``, with q_idx the query's position), its full blocks keep every key. ``mask_mod`` with
    a block mask is the mask of its partial blocks: the block mask's own (then pass None or the same function), or
    one given for a mask without its own (flex's no-op, or a prefill mask sliced with ``block_mask[:, :, i]``).
    ``captured``: tensors passed to the mods as trailing arguments (``nvfly.ops.attention.mods``), kernel inputs
    read at run time: one compiled mod serves calls with different tensors.
    """
    if is_mla(q, k_cache):  # DeepSeek's 576-column latent cache: its own kernel (mla_api)
        if captured:
            raise error(ValueError, "captured", "MLA's 576-column latent cache takes no mods")
        return from_decode(q, k_cache, v_cache, score_mod=score_mod, mask_mod=mask_mod, k_scale=k_scale,
                           v_scale=v_scale, block_mask=block_mask, cache_seqlens=cache_seqlens,
                           block_table=block_table, scale=scale, causal=causal, return_lse=return_lse,
                           validate=validate, splits=splits, out=out)
    try:  # everything that decides the checks, the plan and the launches
        key = (layout_key(q), layout_key(k_cache), layout_key(v_cache), layout_key(cache_seqlens),
               layout_key(block_table), layout_key(out), layout_key(k_scale), layout_key(v_scale), score_mod, mask_mod,
               type(captured), tuple(map(layout_key, captured)), causal, splits, return_lse, block_mask_key(block_mask),
               _OPTIONS.get())
        call = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable, no BlockMask: the checks explain
        key = call = None
    if call is None:
        call = _new_call(q, k_cache, v_cache, cache_seqlens, block_table, out, k_scale, v_scale, score_mod, mask_mod,
                         captured, causal, splits, return_lse, validate, key is not None, block_mask)
        _CALLS.remember(key, call)
    elif validate and call.reads_values and not (call.cuda and _capturing()):
        _check_values(cache_seqlens, block_table, call.capacity, call.pages)
        if block_mask is not None:
            check_block_numbers(block_mask)
    return call.run(q, k_cache, v_cache, cache_seqlens, block_table, out, k_scale, v_scale, captured, scale,
                    block_mask)


def bound_decode(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", *, causal: bool = True,
                 score_mod: Optional[Callable[..., Any]] = None, block_mask: Any = None,
                 return_lse: bool = False, heads_first: bool = False) -> Callable[..., Any]:
    """``decode``'s checks and plan for these arguments (no lengths, block table, out, fp8 scales or captured=),
    once: ``run(q, k_cache, v_cache, scale, block_mask)`` then binds and launches for tensors of the same
    ``layout_key``s (and a block mask of the same tables' layouts), with the same mods: for a caller that keys its
    own calls on those (Inductor's flex op) and so skips ``decode``'s signature per call. Raises as ``decode``.
    ``heads_first``: q (B, Hq, Sq, D) and the caches (B, Hkv, S, D), here and per call (flex's layout: decode's
    transposed), and out returned as the (B, Hq, Sq, Dv) view of (B, Sq, Hq, Dv) memory: once the launches are
    warm they read only addresses, so a call passes its tensors as they are (no transposes)."""
    if heads_first:
        q, k_cache, v_cache = q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    call = _new_call(q, k_cache, v_cache, None, None, None, None, None, score_mod, None, (), causal, 0, return_lse,
                     False, True, block_mask)
    run = call.run
    if not heads_first:
        def launch(q: Any, k: Any, v: Any, scale: Optional[float], block_mask: Any = None) -> Any:
            return run(q, k, v, None, None, None, None, None, (), scale, block_mask)
        return launch
    import torch
    batch, sq, hq, dv = call.out_shape
    shape, strides = (batch, hq, sq, dv), (sq * hq * dv, dv, hq * dv, 1)
    empty_strided, dtype = torch.empty_strided, q.dtype
    main = call.main
    direct = [False]  # the launches read addresses alone (after the first call); ``main.warm`` per call: not in
    # compile-only mode, whose launches take the general path, which reads shapes

    def launch_heads_first(q: Any, k: Any, v: Any, scale: Optional[float], block_mask: Any = None) -> Any:
        out = empty_strided(shape, strides, dtype=dtype, device=q.device)
        if direct[0] and main.warm:
            return run(q, k, v, None, None, out, None, None, (), scale, block_mask)
        # decode's layout, the one the launches bind to on their first call
        result = run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, out.transpose(1, 2), None,
                     None, (), scale, block_mask)
        direct[0] = call.reads_addresses()
        return (out, result[1]) if call.lse_shape is not None else out
    return launch_heads_first


def _capturing() -> bool:
    import torch
    return torch.cuda.is_current_stream_capturing()


# The host path (docs/ops/attention.md): a call signature (the layouts of every tensor argument, a block mask's
# tables included, the mods, the options) selects a _DecodeCall: its checks ran on its first call (raising errors
# that name the argument), and it holds the plan, the prepared launches and the shapes of what a call allocates; a
# later call binds and launches.
_CALLS: OpCalls["_DecodeCall"] = OpCalls()
# Per-layout checks (shapes, strides, dtypes, devices, 16-byte alignment of every tensor, and the mods), shared by
# the signatures that differ only in other arguments (a new out, other options) and by calls that are not cached
_CHECKED: OpCalls[tuple[int, int]] = OpCalls()
_plan = functools.lru_cache(maxsize=CALL_LIMIT)(decode_plan)
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar(
    "decode_plan_options", default=(0, 0, 0, False, 0.0, None, False, None, False, None))
_NO_OPTIONS = _OPTIONS.get()[:-1]  # every option but wgmma at its default
# the plan options the benchmark and the GPU tests compare (``plan_options``; {}: the default plan)
DECODE_VARIANTS: dict[str, dict[str, int]] = {
    "default": {},
    # fp8 d 128: 4 stages of 16 KB, 3 CTAs an SM (159-161 registers, no spills) instead of 6 stages and 2: a
    # third more warps to hide the fragment conversions' latency, about the same bytes in flight an SM
    "stages4": dict(stages=4),
    # Sq·G > 16 in 16-row tiles: each warp one key slice a stage (as at Sq 1) and Q in registers, the tiles'
    # CTAs neighbours that read the keys from L2; the same conversions in all, spread over twice the CTAs
    "rows16": dict(row_warps=1, warp_tiles=1),
    # Sq·G > 16: a warp owns 32 rows (two m16 tiles) and one key slice a stage, so each slice's K/V fragments are
    # read and converted once (fp8 Sq 8: 72 F2FP a warp a stage, not 136; 252 registers at 2 CTAs an SM, no
    # spills; with 4 stages, 3 CTAs an SM, it spills)
    "warp32": dict(warp_tiles=2),
    # a warp one 16-row tile (fp8 d 128's default before warp32 measured faster)
    "warp16": dict(warp_tiles=1),
    # O's 64 multiplies a lane a slice (d 128; a fifth of the fp8 loop's instructions) skipped when no row maximum
    # of the warp rose: a VOTE.ANY and a branch instead, the multiplies by exactly 1 left out
    "lazy": dict(lazy_rescale=True),
    "lazy_warp32": dict(lazy_rescale=True, warp_tiles=2),
    "lazy_stages4": dict(lazy_rescale=True, stages=4),
    # the split count of the best wave efficiency, not the fewest splits within 85% of it: B1 128K (8 KV heads,
    # 264 slots) 33 splits, every slot one CTA of 62 stages, where 29 leave 32 SMs one CTA and give CTAs 71
    "splits_full": dict(split_efficiency=1.0),
    # FA3's choice, the default before splits_full measured faster on one long sequence: the fewest splits within
    # 85% of the best wave efficiency
    "splits_85": dict(split_efficiency=0.85),
    "lazy_splits_full": dict(lazy_rescale=True, split_efficiency=1.0),
    # Sq·G <= 8 (Sq 1 at G 4-8): Sᵀ = K Qᵀ and Oᵀ = Vᵀ Pᵀ, the query rows as the MMAs' N (8), not padded to an
    # m16 tile: half the HMMAs, O's registers and its rescale; more rows (or row options) keep the default plan
    "swapped": dict(swapped=True),
    "swapped_lazy": dict(swapped=True, lazy_rescale=True),
    # fp8 d 128: 4 stages, 3 CTAs an SM (107 registers; stages4 155) as stages4, with the swapped operands
    "swapped_stages4": dict(swapped=True, stages=4),
    # the m16 row tiles at Sq·G <= 8 whatever plan.SWAP_BY_DEFAULT says (the default while it is False)
    "unswapped": dict(swapped=False),
    # split plans: the combine kernel as the split kernel's programmatic dependent (its launch and the gap before it,
    # ~22 us of fp8 B1 128K's 93 by ncu, behind the split loop), or no combine kernel: the last split CTA of each
    # query tile merges its partials (fixup_combine, the default: 1.00-1.04x, pdl 0.97-1.03x), or the combine
    # kernel launched after the split kernel (the default before)
    "pdl": dict(pdl_combine=True),
    "fixup": dict(fixup_combine=True),
    "combine_kernel": dict(fixup_combine=False),
    # 16-bit d 128 at 16 < Sq·G <= 64 runs the warpgroup-MMA GQA kernel (gqa_kernel) by default: the decode kernel
    # (mma.sync) for every call instead, the default before
    "mma_sync": dict(wgmma=False),
    # the wgmma kernel at Sq·G <= 16 as well (all that gqa_declined accepts; other calls keep the decode kernel), and
    # for fp8 caches (GqaPlan.fp8: converted to f16 in shared memory) at <= 32 rows, where they keep the decode
    # kernel by default (gqa_plan.FP8_DEFAULT_ABOVE_ROWS)
    "wgmma": dict(wgmma=True),
    # its split plans' combine kernel as the split kernel's programmatic dependent, not launched after it
    "wgmma_pdl": dict(wgmma=True, pdl_combine=True),
    # and at 65-128 rows (Sq 16 at G 6 and 8, Sq 8 at G 16) on two consumer warpgroups of 64 rows sharing the K/V
    # ring, one CTA an SM (the decode kernel's 96 and 128 rows ran at 0.8-1.7 TB/s)
    "wgmma_wide": dict(wgmma=True, wgmma_wide=True),
}


def plan_options(stages: int = 0, row_warps: int = 0, warp_tiles: int = 0, lazy_rescale: bool = False,
                 split_efficiency: float = 0.0, swapped: Optional[bool] = None, pdl_combine: bool = False,
                 fixup_combine: Optional[bool] = None, wgmma_wide: bool = False, wgmma: Optional[bool] = None
                 ) -> ContextManager[None]:
    """``decode`` calls inside run plans with these ``decode_plan`` overrides (stages, row_warps, warp_tiles and
    split_efficiency 0, swapped None, fixup_combine None: the plan's default; swapped where ``plan.swap_declined``
    allows; pdl_combine or fixup_combine, one of them, where the plan splits; ``wgmma`` True: the warpgroup-MMA GQA
    kernel's ``gqa_plan`` wherever ``gqa_declined`` allows, its own split count (0: ``gqa_plan``'s) and depth (0: its
    default), its combine launched after it (a programmatic dependent launch with pdl_combine); the other options
    do not apply to it, but ``wgmma_wide``: 65-128 rows on its two-consumer plan too; False: the decode kernel
    always; None: the wgmma kernel where ``gqa_declined`` allows and ``gqa_by_default`` (Sq x G > 16; > 32 with fp8
    caches) when no other option is given, else the decode kernel): the benchmark's and the tests' way to run the
    kernels' variants side by side (``DECODE_VARIANTS``)."""
    if stages < 0 or row_warps not in (0, 1, 2, 4) or warp_tiles not in (0, 1, 2) or not 0 <= split_efficiency <= 1:
        raise ValueError(f"attention.plan_options: stages {stages} must be >= 0, row_warps {row_warps} one of "
                         f"0, 1, 2, 4, warp_tiles {warp_tiles} 0, 1 or 2 and split_efficiency {split_efficiency} in "
                         "[0, 1]")
    if pdl_combine and fixup_combine:
        raise ValueError("attention.plan_options: pdl_combine and fixup_combine are two ways of one combine; ask for "
                         "one")
    return context_value(_OPTIONS, (int(stages), int(row_warps), int(warp_tiles), bool(lazy_rescale),
                                    float(split_efficiency), None if swapped is None else bool(swapped),
                                    bool(pdl_combine), None if fixup_combine is None else bool(fixup_combine),
                                    bool(wgmma_wide), None if wgmma is None else bool(wgmma)))


def wgmma_choice(options: tuple, sq: int, group: int, fp8: bool) -> tuple[bool, bool]:
    """Whether a call of Sq x G packed rows goes to the warpgroup-MMA GQA kernel under the plan options ``options``
    (``current_plan_options()``; where ``gqa_declined`` then accepts it), and whether with two consumer warpgroups
    past 64 rows: asked for (``wgmma``, ``wgmma_wide``), or by default where no other plan option asks for the
    decode kernel's plan (``gqa_by_default``), then two consumers past 64 rows (the decode kernel's 96/128 rows ran
    at half their speed)."""
    wgmma_wide, wgmma = options[-2:]
    by_default = wgmma is None and gqa_by_default(sq, group, fp8) and options[:-1] == _NO_OPTIONS
    return bool(wgmma or by_default), bool(wgmma_wide or by_default)


# the plan options in force (``plan_options``), for callers that keep bound launches per signature (routing)
current_plan_options: Callable[[], tuple] = _OPTIONS.get


def _new_call(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, out: Any, k_scale: Any,
              v_scale: Any, score_mod: Any, mask_mod: Any, captured: Any, causal: Any, splits: Any, return_lse: bool,
              validate: bool, prepared: bool, block_mask: Any = None) -> Union["_DecodeCall", GqaCall]:
    """A signature's first call (or a call that is not cached): the checks in the order they raise, then its plan;
    ``prepared``: with prepared launches (a cached call), else through the kernels' general launch path; the
    warpgroup-MMA GQA kernel where the ``wgmma`` plan option (``plan_options``) chooses it."""
    capturing = q.device.type == "cuda" and _capturing()
    kv_block = 0
    if block_mask is not None:  # its checks need the cache's capacity; its mask_mod is the mods' mask
        capacity, _ = _check(q, k_cache, v_cache, cache_seqlens, block_table)
        check_block_mask(block_mask, mask_mod, q, k_cache.shape[2], capacity, validate and not capturing)
        mask_mod, kv_block = mask_mod_of(block_mask, mask_mod), int(block_mask.BLOCK_SIZE[1])
    mods = _mods(score_mod, mask_mod, check_captured(captured, q))
    capacity, pages = _checked(q, k_cache, v_cache, cache_seqlens, block_table, mods)
    check_scales(k_scale, v_scale, q, k_cache)
    if validate and not capturing:
        _check_values(cache_seqlens, block_table, capacity, pages)
    _require_cuda(q)
    batch, sq, hq, dqk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    check_out(out, (batch, sq, hq, dv), q, OP)
    options = _OPTIONS.get()
    stages, row_warps, warp_tiles, lazy_rescale, split_efficiency, swapped, pdl_combine, fixup_combine = options[:8]
    fp8 = str(k_cache.dtype) == FP8
    wgmma, wgmma_wide = wgmma_choice(options, sq, hq // hkv, fp8)
    if batch and wgmma:
        paged = block_table is not None
        declined = gqa_declined(sq, hq // hkv, dqk, dv, str(q.dtype), fp8, mods.active or block_mask is not None,
                                paged, k_cache.shape[1], wgmma_wide)
        if not declined and all(map(_aligned, (q, k_cache, v_cache))):  # TMA's 16-byte base and strides
            plan = gqa_plan(batch, sq, hkv, hq // hkv, capacity, _sm_count(q.device), paged, k_cache.shape[1],
                            bool(causal), int(splits), stages, pdl_combine=pdl_combine, wide=wgmma_wide, fp8=fp8)
            return GqaCall(plan, q, cache_seqlens, capacity, pages, bool(return_lse), prepared)
    plan = _plan(batch, sq, hkv, hq // hkv, dqk, dv, capacity, _sm_count(q.device), block_table is not None,
                 k_cache.shape[1], bool(causal), int(splits), row_warps, fp8=fp8,
                 kv_block=kv_block, stages=stages, warp_tiles=warp_tiles, lazy_rescale=lazy_rescale,
                 split_efficiency=split_efficiency, swapped=swapped, pdl_combine=pdl_combine,
                 fixup_combine=fixup_combine) if batch else None
    return _DecodeCall(plan, mods, q, k_cache, v_cache, cache_seqlens, block_table, capacity, pages,
                       bool(return_lse), captured, prepared and batch > 0, block_mask)


class _DecodeCall(CallBuffers):
    """The launches of one call signature: what depends only on it, computed once (the plan, the outputs' shapes,
    the prepared launches of the split and combine kernels on their grids, the scratch partials' shape); ``run``
    allocates the outputs, binds the call's tensors and launches."""

    def __init__(self, plan: Optional[DecodePlan], mods: Mods, q: Any, k_cache: Any, v_cache: Any,
                 cache_seqlens: Any, block_table: Any, capacity: int, pages: int, return_lse: bool, captured: Any,
                 prepared: bool, block_mask: Any = None):
        import torch
        from nvfly.ops.common import scratch
        batch, sq, hq, dqk = q.shape
        super().__init__(q, (batch, sq, hq, v_cache.shape[3]), return_lse, cache_seqlens, capacity,
                         "decode cache_seqlens")
        self.plan, self.mods, self.pages = plan, mods, pages
        self.sq, self.hq, self.hkv = sq, hq, k_cache.shape[2]
        self.cuda = q.device.type == "cuda"
        # what _check_values (and check_block_numbers) read
        self.reads_values = cache_seqlens is not None or block_table is not None or block_mask is not None
        self.fp8 = str(k_cache.dtype) == FP8
        self.default_scale = dqk ** -0.5
        self.captures = mods.arguments + len(captured_tensors(mods)) > 0
        self.rows = batch * sq * hq
        self.slots = plan.splits * self.rows if plan is not None and plan.splits > 1 else 0
        self.uint8 = torch.uint8
        self.row_partials = scratch.row_partials
        self.fixup = plan is not None and plan.fixup_combine
        if self.fixup:
            self.counters, self.workspace = plan.fixup_counters(batch, self.hkv), scratch.workspace
        self.main = self.combine = self.tables_launch = None
        self.no_captured, self.no_tables = [None] * MAX_CAPTURED, [None] * 3  # the kernel's unused arguments
        self.captured_keys: Optional[tuple] = None
        self.tables: Optional[MaskTablesPlan] = None
        if block_mask is not None and plan is not None:  # its tables: written by one launch per call
            self.tables = mask_tables_plan(block_mask, batch, hq, self.hkv)
            self.table_shapes = mask_table_shapes(block_mask, batch, hq, self.hkv, capacity)
            self.blocks, self.stages = self.table_shapes[0][2], self.table_shapes[1][2]
            self.int32_tables = scratch.int32_tables
        if prepared:
            if self.tables is not None:
                self.tables_launch = block_mask_tables_kernel.prepared((self.hkv, batch), TABLES_THREADS)
            self.main = attention_decode_kernel.prepared(plan.grid(batch, self.hkv), plan.threads)
            if self.slots and not self.fixup:
                self.combine = prepared_combine(self.rows, plan.dv)
            if captured_tensors(mods):  # read from the functions per call: a prepared launch needs their layouts
                self.captured_keys = tuple(map(layout_key, _kernel_captured(mods, q.device, tuple(captured))))

    def run(self, q: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any, out: Any, k_scale: Any,
            v_scale: Any, captured: Any, scale: Any, block_mask: Any = None) -> Any:
        device = q.device
        out, lse = self.outputs(device, out)
        plan = self.plan
        if plan is not None:
            seqlens = self.lengths(device, cache_seqlens)
            kernel_captured = _kernel_captured(self.mods, device, tuple(captured)) if self.captures else []
            if self.fp8:  # the kernel copies and converts bytes (MLIR's LLVM dialect has no pointer arithmetic on f8)
                extra = [kernel_scales(k_scale, v_scale, self.hkv, device)]
                k, v = k.view(self.uint8), v.view(self.uint8)
            else:
                extra = [None]
            extra += self.no_tables if self.tables is None else self._mask_tables(block_mask, seqlens, device)
            scale = self.default_scale if scale is None else float(scale)
            if self.main is None or (self.captured_keys is not None
                                     and tuple(map(layout_key, kernel_captured)) != self.captured_keys):
                _launch(plan, q, k, v, block_table, seqlens, out, lse, kernel_captured, extra, self.mods, scale)
            else:
                self._launch(q, k, v, block_table, seqlens, out, lse, kernel_captured, extra, scale)
        return (out, lse) if self.lse_shape is not None else out

    def _mask_tables(self, block_mask: Any, seqlens: Any, device: Any) -> list:
        """The decode kernel's [kv_state, stage_list, stage_count] of ``block_mask`` (``block_mask_kernel``), in the
        stream's scratch tables (the decode launch after this one reads them)."""
        tables = self.int32_tables(device, torch_args.current_stream(device.index), self.table_shapes)
        args = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                block_mask.full_kv_indices, seqlens, *tables, self.blocks, self.stages)
        if self.tables_launch is None:
            block_mask_tables_kernel[(self.hkv, self.batch), TABLES_THREADS](*args, TABLES=self.tables)
        else:
            self.tables_launch.launch(*args, self.tables)
        return list(tables)

    def _launch(self, q: Any, k: Any, v: Any, block_table: Any, seqlens: Any, out: Any, lse: Any, captured: list,
                extra: list, scale: float) -> None:
        """``_launch``'s launches through the prepared ones."""
        captured = captured + [None] * (MAX_CAPTURED - len(captured)) if captured else self.no_captured
        plan = self.plan
        if not self.slots:
            self.main.launch(q, k, v, block_table, seqlens, out, lse, None, None, *captured, *extra, None, scale,
                             plan, self.mods)
            return
        stream = torch_args.current_stream(q.device.index)
        partial_o, partial_lse = self.row_partials(q.device, stream, self.slots, plan.dv)
        counters = self.workspace(q.device, stream, self.counters, 0)[1] if self.fixup else None
        self.main.launch(q, k, v, block_table, seqlens, out, lse, partial_o, partial_lse, *captured, *extra, counters,
                         scale, plan, self.mods)
        if not self.fixup:
            launch_combine(self.combine, partial_o, partial_lse, out, lse, self.rows, self.hq, plan.splits, self.sq,
                           plan.dv, plan.pdl_combine)

    def reads_addresses(self) -> bool:
        """Whether ``run`` now launches through warm prepared launches alone, which read only their tensors'
        addresses (any view of a tensor's memory serves), not through the general path."""
        return self.main is not None and self.captured_keys is None and all(
            launch is None or launch.warm for launch in (self.main, self.combine, self.tables_launch))


def _checked(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, mods: Mods) -> tuple[int, int]:
    """``_check``, the rows' alignment and the mods' captures, once per layout; (cache capacity, pages or 0)."""
    try:
        key = (layout_key(q), layout_key(k_cache), layout_key(v_cache), layout_key(cache_seqlens),
               layout_key(block_table), mods)
        found = _CHECKED.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks explain
        key = found = None
    if found is not None:
        return found
    found = _check(q, k_cache, v_cache, cache_seqlens, block_table)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not _aligned(t):
            raise error(ValueError, name, "rows must be 16-byte aligned (a 16-byte aligned base and strides but the "
                                           f"last a multiple of 8 elements), got strides {tuple(t.stride())}")
    captures = mods.arguments + len(captured_tensors(mods))
    if captures > MAX_CAPTURED:
        raise error(ValueError, "score_mod/mask_mod", f"take {captures} tensors (captured= and captured by the "
                                                      f"functions), at most {MAX_CAPTURED}")
    _CHECKED.remember(key, found)
    return found


def _launch(plan: DecodePlan, q: Any, k: Any, v: Any, block_table: Any, seqlens: Any, out: Any, lse: Any,
            captured: list, extra: list, mods: Mods, scale: float) -> None:
    """The decode kernel (and the combine with splits); ``extra``: the kernel's kv_scales, kv_state, stage_list and
    stage_count (None where unused)."""
    from nvfly.ops.common import scratch
    from nvfly.runtime.torch_args import current_stream
    captured = captured + [None] * (MAX_CAPTURED - len(captured))
    batch, sq, hq, _ = q.shape
    grid = plan.grid(batch, k.shape[2])
    if plan.splits == 1:
        attention_decode_kernel[grid, plan.threads](q, k, v, block_table, seqlens, out, lse, None, None, *captured,
                                                    *extra, None, scale, PLAN=plan, MODS=mods)
        return
    rows = batch * sq * hq
    stream = current_stream(q.device.index)
    partial_o, partial_lse = scratch.row_partials(q.device, stream, plan.splits * rows, plan.dv)
    counters = scratch.workspace(q.device, stream, plan.fixup_counters(batch, k.shape[2]), 0)[1] \
        if plan.fixup_combine else None
    attention_decode_kernel[grid, plan.threads](q, k, v, block_table, seqlens, out, lse, partial_o, partial_lse,
                                                *captured, *extra, counters, scale, PLAN=plan, MODS=mods)
    if not plan.fixup_combine:
        launch_combine(None, partial_o, partial_lse, out, lse, rows, hq, plan.splits, sq, plan.dv, plan.pdl_combine)


# ---------------------------------------------------------------------------------------------- reference
def _gather_rows(cache: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
    """``cache.flatten(0, 1)[index]``, through a byte view for fp8 (torch does not index fp8 on every device)."""
    import torch
    flat = cache.flatten(0, 1)
    if str(cache.dtype) == FP8:
        return flat.view(torch.uint8)[index].view(cache.dtype)
    return flat[index]


def reference(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor", *,
              cache_seqlens: Optional["torch.Tensor"] = None, block_table: Optional["torch.Tensor"] = None,
              scale: Optional[float] = None, causal: bool = True, score_mod: Optional[Callable[..., Any]] = None,
              mask_mod: Optional[Callable[..., Any]] = None, k_scale: Optional["torch.Tensor"] = None,
              v_scale: Optional["torch.Tensor"] = None, block_mask: Any = None, captured: tuple = ()
              ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(out, lse) of ``decode``'s arguments in float32 (out float32), sequence by sequence: the definition the
    kernels are tested against. fp8 caches are dequantised in float32 (value * its KV head's scale); a block mask
    keeps a key of a full block, of a partial block where its mask_mod does, and none of an empty block."""
    import torch
    batch, sq, hq, dqk = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = dqk ** -0.5 if scale is None else scale
    score_mod, mask_mod = bound(score_mod, tuple(captured)), bound(mask_mod, tuple(captured))
    out = torch.zeros(batch, sq, hq, v_cache.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((batch, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        if block_table is None:
            length = k_cache.shape[1] if cache_seqlens is None else int(cache_seqlens[b])
            keys, values = k_cache[b, :length], v_cache[b, :length]
        else:
            page = k_cache.shape[1]
            length = block_table.shape[1] * page if cache_seqlens is None else int(cache_seqlens[b])
            slots = torch.arange(length, device=q.device)
            index = block_table[b].long().repeat_interleave(page)[:length] * page + slots % page
            keys, values = _gather_rows(k_cache, index), _gather_rows(v_cache, index)
        keys = (keys.float() * per_head(k_scale, hkv, q.device)[:, None]).repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = (values.float() * per_head(v_scale, hkv, q.device)[:, None]).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * scale  # (Hq, Sq, L)
        heads = torch.arange(hq, device=q.device)[:, None, None]
        positions = (length - sq + torch.arange(sq, device=q.device))[None, :, None]
        kv = torch.arange(length, device=q.device)[None, None, :]
        index_b = torch.tensor(b, device=q.device)
        if score_mod is not None:
            scores = score_mod(scores, index_b, heads, positions, kv).float()
        keep = torch.ones_like(scores, dtype=torch.bool)
        if causal:
            keep = keep & (kv <= positions)
        if block_mask is not None:
            keep = keep & reference_block_keep(block_mask, mask_mod, b, hq, positions, kv)
        elif mask_mod is not None:
            keep = keep & mask_mod(index_b, heads, positions, kv).bool()
        scores = scores.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # (Hq, Sq)
        weights = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        out[b] = torch.einsum("hqk,khd->qhd", weights, values)
        lse[b] = row_lse
    return out, lse


# ---------------------------------------------------------------------------------------------- compile only
def compile_kernels(plan: DecodePlan, mods: Mods = Mods(), dtype: Any = nvfly.bf16, batch: int = 2, kv_heads: int = 2,
                    seqlen: int = 1024, return_lse: bool = True, target: str = "sm_90a", captured: tuple = ()) -> list:
    """The decode kernel (and the combine kernel with splits, but for ``fixup_combine``) for ``plan`` compiled
    without a GPU:
    [CompiledKernel, ...]. A paged plan gets a cache of seqlen / page_size pages per sequence; an fp8 plan e4m3
    caches and their scales; a block-mask plan its tables; ``captured``: (CPU) tensors standing for the mods'
    arguments (``mods.arguments`` of them)."""
    from nvfly.runtime.tensor_desc import TensorDesc, torch_dtype
    hq = kv_heads * plan.group
    q = TensorDesc(dtype, (batch, plan.sq, hq, plan.dqk))
    kv_dtype = nvfly.u8 if plan.fp8 else dtype  # decode passes fp8 caches as bytes
    if plan.paged:
        pages = seqlen // plan.page_size
        k = TensorDesc(kv_dtype, (batch * pages, plan.page_size, kv_heads, plan.dqk))
        v = TensorDesc(kv_dtype, (batch * pages, plan.page_size, kv_heads, plan.dv))
        table = TensorDesc(nvfly.i32, (batch, pages))
    else:
        k = TensorDesc(kv_dtype, (batch, seqlen, kv_heads, plan.dqk))
        v = TensorDesc(kv_dtype, (batch, seqlen, kv_heads, plan.dv))
        table = None
    extra = [TensorDesc(nvfly.f32, (2, kv_heads)) if plan.fp8 else None]
    if plan.kv_block:
        extra += [TensorDesc(nvfly.i32, (batch, hq, -(-seqlen // plan.kv_block))),
                  TensorDesc(nvfly.i32, (batch, kv_heads, -(-seqlen // BLOCK_N))),
                  TensorDesc(nvfly.i32, (batch, kv_heads))]
    else:
        extra += [None] * 3
    seqlens = TensorDesc(nvfly.i32, (batch,))
    out = TensorDesc(dtype, (batch, plan.sq, hq, plan.dv))
    lse = TensorDesc(nvfly.f32, (batch, hq, plan.sq)) if return_lse else None
    captured = [TensorDesc(torch_dtype(t) if str(t.dtype) not in ("torch.int64", "torch.bool") else nvfly.i32,
                           tuple(t.shape)) for t in (*captured, *captured_tensors(mods))]
    captured = captured + [None] * (MAX_CAPTURED - len(captured))
    rows = batch * plan.sq * hq
    split = plan.splits > 1
    partial_o = TensorDesc(nvfly.f32, (plan.splits * rows, plan.dv)) if split else None
    partial_lse = TensorDesc(nvfly.f32, (plan.splits * rows,)) if split else None
    counters = TensorDesc(nvfly.i32, (plan.fixup_counters(batch, kv_heads),)) if plan.fixup_combine else None
    kernels = [attention_decode_kernel.compile(q, k, v, table, seqlens, out, lse, partial_o, partial_lse, *captured,
                                               *extra, counters, 0.125, PLAN=plan, MODS=mods, block=plan.threads,
                                               target=target)]
    if split and not plan.fixup_combine:
        kernels.append(compile_combine(partial_o, partial_lse, out, lse, rows, hq, plan.splits, plan.sq, plan.dv,
                                       plan.pdl_combine, target))
    return kernels


def compile_mask_tables(tables: MaskTablesPlan, batch: int = 2, kv_heads: int = 2, seqlen: int = 1024,
                        target: str = "sm_90a") -> Any:
    """The block-mask tables kernel (``block_mask_kernel``) for ``tables`` compiled without a GPU: a CompiledKernel
    for a cache of ``seqlen`` keys (its BlockMask's tables broadcast or not as ``tables`` says)."""
    from nvfly.runtime.tensor_desc import TensorDesc
    hq = kv_heads * tables.group
    blocks, stages = -(-seqlen // tables.kv_block), -(-seqlen // BLOCK_N)
    num = TensorDesc(nvfly.i32, (1 if tables.batch_broadcast else batch, 1 if tables.head_broadcast else hq, 1))
    indices = TensorDesc(nvfly.i32, (*num.shape, blocks))
    full = (num, indices) if tables.full else (None, None)
    return block_mask_tables_kernel.compile(
        num, indices, *full, TensorDesc(nvfly.i32, (batch,)), TensorDesc(nvfly.i32, (batch, hq, blocks)),
        TensorDesc(nvfly.i32, (batch, kv_heads, stages)), TensorDesc(nvfly.i32, (batch, kv_heads)), blocks, stages,
        TABLES=tables, block=TABLES_THREADS, target=target)


def bytes_moved(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor",
                cache_seqlens: Optional["torch.Tensor"] = None, block_table: Optional["torch.Tensor"] = None,
                block_mask: Any = None) -> int:
    """Bytes of q, the keys and values read (each sequence's length, at the caches' element size: 1 for fp8; with
    a block mask the keys of the stages read) and o written: what TB/s is counted on."""
    import torch
    batch, sq, hq, dqk = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if block_mask is None:
        head_keys = hkv * (batch * capacity if cache_seqlens is None else int(cache_seqlens.sum()))
    else:
        seqlens = (torch.full((batch,), capacity, dtype=torch.int32, device=q.device) if cache_seqlens is None
                   else cache_seqlens.to(torch.int32))
        _, stage_list, stage_count = block_mask_tables(block_mask, batch, hq, hkv, seqlens, capacity)
        read = torch.arange(stage_list.shape[2], device=q.device) < stage_count[..., None]
        keys = (seqlens[:, None, None] - stage_list * BLOCK_N).clamp(0, BLOCK_N)  # of each stage in the sequence
        head_keys = int((keys * read).sum())
    return (q.element_size() * (q.numel() + batch * sq * hq * dv)
            + head_keys * (dqk * k_cache.element_size() + dv * v_cache.element_size()))


