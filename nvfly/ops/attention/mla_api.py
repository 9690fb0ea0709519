"""MLA decode's host functions: argument checks and eligibility, the plan, the launches (the MLA kernel, then the
split-KV combine), the bytes and FLOPs the benchmark counts, and a compile helper for tests without a GPU. The
float32 reference is decode's (``api.reference`` with ``v_cache = k_cache[..., :512]``)."""
from __future__ import annotations

import contextvars
import functools
import math
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Union

import nvfly
from nvfly.ops.attention.checks import aligned, check_values, hopper_reason, require_cuda, sm_count, tensor_argument
from nvfly.ops.attention.calls import CallBuffers, check_out
from nvfly.ops.attention.combine_kernel import compile_combine, launch_combine, prepared_combine
from nvfly.ops.attention.kv_options import error
from nvfly.ops.attention.mla_kernel import attention_mla_kernel
from nvfly.ops.attention.mla_plan import BLOCK_M, BLOCK_N, DQK, DV, MAX_SQ, SWIZZLE, THREADS, MlaPlan, mla_plan
from nvfly.ops.common.opcall import CALL_LIMIT, OpCalls, context_value
from nvfly.runtime.tensor_desc import torch_dtype
from nvfly.runtime.torch_args import layout_key
from nvfly.runtime.tma import cached_descriptor
from nvfly.ops.attention.softmax import LN2

if TYPE_CHECKING:
    import torch

OP = "attention.decode_mla"
DECODE_OP = "attention.decode"
DTYPES = ("torch.bfloat16", "torch.float16")
DESCRIPTORS_KEPT = 8  # (q, cache) address pairs a call signature keeps descriptors for


def _check(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, scale: Optional[float],
           op: str, addresses: bool = True) -> tuple[int, int]:
    """Shapes, dtypes, devices, layouts and options (errors name the argument); returns (cache capacity, pages or
    0). ``addresses``: also check the cache's alignment and that v_cache shares k_cache's storage (not for fake
    tensors, which have no addresses)."""
    tensor_argument(q, "q", 4, op)
    tensor_argument(k_cache, "k_cache", 4, op)
    if str(q.dtype) not in DTYPES:
        raise error(TypeError, "q", f"dtype {q.dtype} is not supported (bfloat16, float16)", op)
    if k_cache.dtype != q.dtype:
        raise error(TypeError, "k_cache", f"dtype {k_cache.dtype} differs from q's {q.dtype}", op)
    if k_cache.device != q.device:
        raise error(ValueError, "k_cache", f"on {k_cache.device}, q on {q.device}", op)
    batch, sq, hq, dqk = q.shape
    if dqk != DQK:
        raise error(ValueError, "q", f"head dim {dqk}; MLA decode takes the {DQK}-column latent + rotary query", op)
    if not 1 <= sq <= MAX_SQ:
        raise error(ValueError, "q", f"{sq} query tokens per sequence (dimension 1); decode takes 1 to {MAX_SQ}", op)
    if hq == 0:
        raise error(ValueError, "q", "no query heads (dimension 2)", op)
    if k_cache.shape[2] != 1 or k_cache.shape[3] != DQK:
        raise error(ValueError, "k_cache", f"shape {tuple(k_cache.shape)}: MLA's cache has one latent KV head of "
                                           f"{DQK} columns (dimensions 2 and 3: 1, {DQK})", op)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if t.stride(-1) != 1:
            raise error(ValueError, name, f"the last dimension must be contiguous (stride 1), got strides "
                                          f"{tuple(t.stride())}", op)
    if addresses and not aligned(k_cache):
        raise error(ValueError, "k_cache", "TMA needs a 16-byte aligned base and strides but the last multiples of "
                                           f"16 bytes, got strides {tuple(k_cache.stride())}", op)
    if v_cache is not None:
        tensor_argument(v_cache, "v_cache", 4, op)
        same = ((not addresses or v_cache.data_ptr() == k_cache.data_ptr()) and v_cache.dtype == k_cache.dtype
                and tuple(v_cache.shape) == tuple(k_cache.shape[:3]) + (DV,)
                and tuple(v_cache.stride()) == tuple(k_cache.stride()))
        if not same:
            raise error(ValueError, "v_cache", f"MLA's values are the latent's first {DV} columns: pass "
                                               f"k_cache[..., :{DV}] (a view of the same storage) or None; a "
                                               "separate V cache is not supported", op)
    pages = 0
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise error(ValueError, "k_cache", f"{k_cache.shape[0]} sequences (dimension 0), q has {batch}", op)
        capacity = k_cache.shape[1]
    else:
        tensor_argument(block_table, "block_table", 2, op)
        if str(block_table.dtype) != "torch.int32":
            raise error(TypeError, "block_table", f"expected int32, got {block_table.dtype}", op)
        if block_table.shape[0] != batch:
            raise error(ValueError, "block_table", f"{block_table.shape[0]} rows, q has {batch} sequences", op)
        if block_table.device != q.device:
            raise error(ValueError, "block_table", f"on {block_table.device}, q on {q.device}", op)
        if k_cache.shape[1] % BLOCK_N:
            raise error(ValueError, "k_cache", f"page size {k_cache.shape[1]} (dimension 1): MLA decode reads "
                                               f"pages of a multiple of {BLOCK_N} tokens", op)
        pages = k_cache.shape[0]
        capacity = block_table.shape[1] * k_cache.shape[1]
    if cache_seqlens is not None:
        tensor_argument(cache_seqlens, "cache_seqlens", 1, op)
        if str(cache_seqlens.dtype) not in ("torch.int32", "torch.int64"):
            raise error(TypeError, "cache_seqlens", f"expected int32 or int64, got {cache_seqlens.dtype}", op)
        if cache_seqlens.shape[0] != batch:
            raise error(ValueError, "cache_seqlens", f"{cache_seqlens.shape[0]} lengths, q has {batch} sequences", op)
        if cache_seqlens.device != q.device:
            raise error(ValueError, "cache_seqlens", f"on {cache_seqlens.device}, q on {q.device}", op)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise error(ValueError, "scale", f"expected a positive finite number, got {scale!r}", op)
    return capacity, pages


def check_mla_arguments(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any, k_scale: Any,
                        v_scale: Any) -> None:
    """``api.check_arguments`` for a 576-column q: the checks that read no tensor values or addresses."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None:
            raise error(ValueError, name, f"not supported with MLA's {DQK}-column latent cache", DECODE_OP)
    _check(q, k_cache, v_cache, cache_seqlens, block_table, None, DECODE_OP, addresses=False)


def mla_eligibility(q: Any, k_cache: Any, v_cache: Any = None, *, cache_seqlens: Any = None,
                    block_table: Any = None, scale: Optional[float] = None) -> Optional[str]:
    """None when ``decode_mla`` computes this call, else the reason it declines."""
    try:
        _check(q, k_cache, v_cache, cache_seqlens, block_table, scale, OP)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return hopper_reason(q, "MLA decode")


# The host path (docs/ops/attention.md, MLA): as decode's, a call signature (the layouts of every tensor argument
# and the options) selects an _MlaCall whose checks ran on its first call; it holds the plan, the prepared launches
# and the shapes of what a call allocates, so a later call binds and launches.
_CALLS: OpCalls["_MlaCall"] = OpCalls()
_plan = functools.lru_cache(maxsize=CALL_LIMIT)(mla_plan)
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("mla_plan_options", default=(None, None, None))


def plan_options(chunked: Optional[bool] = None, evict_first: Optional[bool] = None,
                 pdl_combine: Optional[bool] = None) -> ContextManager[None]:
    """``decode_mla`` calls (and ``decode``'s MLA calls) inside run plans with these ``MlaPlan`` options (None: the
    plan's default): the benchmark's and the tests' way to run the kernel's variants side by side."""
    return context_value(_OPTIONS, (chunked, evict_first, pdl_combine))


def decode_mla(q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: Optional["torch.Tensor"] = None, *,
               cache_seqlens: Optional["torch.Tensor"] = None, block_table: Optional["torch.Tensor"] = None,
               scale: Optional[float] = None, causal: bool = True, return_lse: bool = False, validate: bool = True,
               splits: int = 0, out: Optional["torch.Tensor"] = None
               ) -> Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]:
    """MLA decode (DeepSeek-V2/V3): softmax(q kᵀ scale) v over a latent cache whose first 512 columns are V.

    q (B, Sq, Hq, 576), Sq 1..16, any Hq (16-128 in DeepSeek), bf16/fp16, last dimension contiguous; k_cache
    (B, S, 1, 576) contiguous-per-row (any strides, 16-byte multiples) or, with ``block_table`` (B, max_pages)
    int32, paged (pages, page_size, 1, 576) with page_size a multiple of 64 and pages in any order; ``v_cache``:
    None or ``k_cache[..., :512]`` (the same storage; read from the same tiles, not again). ``cache_seqlens`` (B,)
    int32/int64 (default: the whole cache; 0 gives zeros and LSE -inf). Queries are the last Sq positions of their
    sequence; ``causal`` masks the keys after each. ``scale``: default 576^-0.5 (DeepSeek passes its own).
    ``validate`` reads the lengths and block table to range-check them (a device sync; skipped under CUDA graph
    capture); ``splits`` > 0 forces the split-KV count; ``out``: a contiguous (B, Sq, Hq, 512) tensor of q's dtype.
    Returns out (B, Sq, Hq, 512) and with ``return_lse`` the log-sum-exp (B, Hq, Sq) float32 (natural log).
    ``decode(...)`` routes here for a 576-column q (then errors name ``attention.decode``).
    """
    return _decode(OP, q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, return_lse, validate, splits,
                   out)


def from_decode(q: Any, k_cache: Any, v_cache: Any, *, score_mod: Any, mask_mod: Any, k_scale: Any, v_scale: Any,
                block_mask: Any, cache_seqlens: Any, block_table: Any, scale: Optional[float], causal: bool,
                return_lse: bool, validate: bool, splits: int, out: Any) -> Any:
    """``decode``'s call with a 576-column q: decode_mla's, with its errors naming ``attention.decode``; the options
    the MLA kernel has no code for are errors."""
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod), ("k_scale", k_scale),
                        ("v_scale", v_scale), ("block_mask", block_mask)):
        if value is not None:
            raise error(ValueError, name, f"not supported with MLA's {DQK}-column latent cache (head dim {DQK})",
                        DECODE_OP)
    return _decode(DECODE_OP, q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, return_lse, validate,
                   splits, out)


def _decode(op: str, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any,
            scale: Optional[float], causal: bool, return_lse: bool, validate: bool, splits: int, out: Any) -> Any:
    try:  # everything that decides the checks, the plan and the launches (op: the name errors carry)
        key = (op, layout_key(q), layout_key(k_cache), layout_key(v_cache), layout_key(cache_seqlens),
               layout_key(block_table), layout_key(out), causal, splits, return_lse, type(scale), _OPTIONS.get())
        call = _CALLS.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable: the checks explain
        key = call = None
    if call is None:
        call = _new_call(op, q, k_cache, v_cache, cache_seqlens, block_table, scale, causal, return_lse, validate,
                         splits, out, key is not None)
        _CALLS.remember(key, call)
    else:
        if scale is not None and not (math.isfinite(scale) and scale > 0):  # the one check a value decides
            raise error(ValueError, "scale", f"expected a positive finite number, got {scale!r}", op)
        if validate and call.reads_values and not (call.cuda and _capturing()):
            check_values(cache_seqlens, block_table, call.capacity, call.pages, op)
    return call.run(q, k_cache, block_table, cache_seqlens, out, scale)


def _capturing() -> bool:
    import torch
    return torch.cuda.is_current_stream_capturing()


def _new_call(op: str, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any,
              scale: Optional[float], causal: bool, return_lse: bool, validate: bool, splits: int, out: Any,
              prepared: bool) -> "_MlaCall":
    """A signature's first call (or one that is not cached): the checks in the order they raise, then its plan;
    ``prepared``: with prepared launches (a cached call), else through the kernels' general launch path."""
    capacity, pages = _check(q, k_cache, v_cache, cache_seqlens, block_table, scale, op)
    if validate and not (q.device.type == "cuda" and _capturing()):
        check_values(cache_seqlens, block_table, capacity, pages, op)
    require_cuda(q, op)
    batch, sq, hq, _ = q.shape
    check_out(out, (batch, sq, hq, DV), q, op)
    plan = _plan(batch, sq, hq, capacity, sm_count(q.device), block_table is not None,
                 k_cache.shape[1] if block_table is not None else 0, bool(causal), int(splits),
                 *_OPTIONS.get()) if batch else None
    return _MlaCall(plan, q, cache_seqlens, block_table, capacity, pages, bool(return_lse), prepared and batch > 0)


class _MlaCall(CallBuffers):
    """The launches of one call signature: what depends only on it, computed once (the plan, the outputs' shapes,
    the prepared launches of the MLA and combine kernels on their grids, whether q's rows need a copy for TMA, the
    partials' size); ``run`` allocates the outputs, binds the call's tensors (q's and the cache's descriptors
    reused while their addresses repeat) and launches."""

    def __init__(self, plan: Optional[MlaPlan], q: Any, cache_seqlens: Any, block_table: Any, capacity: int,
                 pages: int, return_lse: bool, prepared: bool):
        from nvfly.ops.common import scratch
        batch, sq, hq, _ = q.shape
        super().__init__(q, (batch, sq, hq, DV), return_lse, cache_seqlens, capacity, "decode_mla cache_seqlens")
        self.plan, self.pages = plan, pages
        self.sq, self.hq = sq, hq
        self.cuda = q.device.type == "cuda"
        self.reads_values = cache_seqlens is not None or block_table is not None
        self.copies_q = not aligned(q.reshape(batch, sq * hq, DQK))  # then a new address every call
        self.rows = batch * sq * hq
        self.slots = plan.splits * self.rows if plan is not None and plan.splits > 1 else 0
        self.row_partials = scratch.row_partials
        self.boxes = _boxes(torch_dtype(q))
        self._descriptors: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.main = self.combine = None
        if prepared:
            self.main = attention_mla_kernel.prepared(plan.grid(batch), THREADS)
            if self.slots:
                self.combine = prepared_combine(self.rows, DV)

    def run(self, q: Any, k_cache: Any, block_table: Any, cache_seqlens: Any, out: Any, scale: Optional[float]
            ) -> Any:
        device = q.device
        out, lse = self.outputs(device, out)
        plan = self.plan
        if plan is not None:
            seqlens = self.lengths(device, cache_seqlens)
            scale_log2 = (DQK ** -0.5 if scale is None else float(scale)) / LN2
            descriptors = self._describe(q, k_cache)
            if self.main is None:
                _launch(plan, descriptors, q, block_table, seqlens, out, lse, scale_log2)
            else:
                self._launch(descriptors, q, block_table, seqlens, out, lse, scale_log2)
        return (out, lse) if self.lse_shape is not None else out

    def _describe(self, q: Any, k_cache: Any) -> tuple[Any, Any]:
        """The TMA descriptors of q's rows and of the cache, kept for the last addresses seen (a decode loop
        reuses its buffers; a CUDA graph always does)."""
        if self.copies_q:
            return _descriptors(q, k_cache, self.boxes)
        addresses = (q.data_ptr(), k_cache.data_ptr())
        found = self._descriptors.get(addresses)
        if found is None:
            found = _descriptors(q, k_cache, self.boxes)
            if len(self._descriptors) >= DESCRIPTORS_KEPT:
                self._descriptors.clear()
            self._descriptors[addresses] = found
        return found

    def _launch(self, descriptors: tuple[Any, Any], q: Any, block_table: Any, seqlens: Any, out: Any, lse: Any,
                scale_log2: float) -> None:
        """``_launch``'s launches through the prepared ones."""
        from nvfly.runtime.torch_args import current_stream
        plan = self.plan
        if self.combine is None:
            self.main(*descriptors, block_table, seqlens, out, lse, None, None, self.batch, scale_log2, plan)
            return
        partial_o, partial_lse = self.row_partials(q.device, current_stream(q.device.index), self.slots, DV)
        self.main(*descriptors, block_table, seqlens, None, None, partial_o, partial_lse, self.batch, scale_log2,
                  plan)
        launch_combine(self.combine, partial_o, partial_lse, out, lse, self.rows, self.hq, plan.splits, self.sq, DV,
                       plan.pdl_combine)


def _rows(q: "torch.Tensor") -> "torch.Tensor":
    """q as the kernel's (B, Sq * Hq, 576) rows for its TMA descriptor (a copy only where q's token and head
    dimensions do not merge or its rows are not 16-byte aligned)."""
    rows = q.reshape(q.shape[0], q.shape[1] * q.shape[2], DQK)
    return rows if aligned(rows) else rows.contiguous()


def _boxes(dtype: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The TMA boxes of Q (B, rows, 576) and of the cache (B or pages, S, 1, 576): 64 rows, one 128-byte swizzle
    row wide (the kernel issues 9 of each a tile)."""
    width = SWIZZLE // dtype.itemsize
    return (1, BLOCK_M, width), (1, BLOCK_N, 1, width)


def _descriptors(q: Any, k_cache: Any, boxes: tuple) -> tuple[Any, Any]:
    return cached_descriptor(_rows(q), boxes[0], SWIZZLE), cached_descriptor(k_cache, boxes[1], SWIZZLE)


def _launch(plan: MlaPlan, descriptors: tuple[Any, Any], q: Any, block_table: Any, seqlens: Any, out: Any, lse: Any,
            scale_log2: float) -> None:
    """The MLA kernel (and the combine with splits) through the kernels' general launch path."""
    from nvfly.ops.common import scratch
    from nvfly.runtime.torch_args import current_stream
    batch, sq, hq, _ = q.shape
    if plan.splits == 1:
        attention_mla_kernel[plan.grid(batch), THREADS](*descriptors, block_table, seqlens, out, lse, None, None,
                                                        batch, scale_log2, PLAN=plan)
        return
    rows = batch * sq * hq
    slots = plan.splits * rows
    partial_o, partial_lse = scratch.row_partials(q.device, current_stream(q.device.index), slots, DV)
    attention_mla_kernel[plan.grid(batch), THREADS](*descriptors, block_table, seqlens, None, None, partial_o,
                                                    partial_lse, batch, scale_log2, PLAN=plan)
    launch_combine(None, partial_o, partial_lse, out, lse, rows, hq, plan.splits, sq, DV, plan.pdl_combine)


def mla_bytes(q: "torch.Tensor", cache_seqlens: "torch.Tensor", capacity: int) -> int:
    """Bytes of q read, the cache read once (576 columns a key: V is inside it) and out written: what TB/s is
    counted on (``capacity``: the keys of a sequence without lengths)."""
    batch, sq, hq, _ = q.shape
    keys = batch * capacity if cache_seqlens is None else int(cache_seqlens.sum())
    return q.element_size() * (q.numel() + batch * sq * hq * DV + keys * DQK)


def mla_flops(q: "torch.Tensor", cache_seqlens: "torch.Tensor", capacity: int, causal: bool = True) -> int:
    """2 · (576 + 512) FLOPs per visible (query, key) pair and head: what TFLOP/s is counted on."""
    batch, sq, hq, _ = q.shape
    lengths = [capacity] * batch if cache_seqlens is None else [int(x) for x in cache_seqlens.tolist()]
    pairs = sum(max(0, n - (sq - 1 - t if causal else 0)) for n in lengths for t in range(sq))
    return 2 * (DQK + DV) * hq * pairs


# ---------------------------------------------------------------------------------------------- compile only
def compile_mla(plan: MlaPlan, dtype: Any = nvfly.bf16, batch: int = 2, seqlen: int = 1024, return_lse: bool = True,
                target: str = "sm_90a") -> list:
    """The MLA kernel (and the combine kernel with splits) for ``plan`` compiled without a GPU:
    [CompiledKernel, ...]. A paged plan gets seqlen / page_size pages per sequence."""
    from nvfly.runtime.tensor_desc import TensorDesc
    q_box, k_box = _boxes(dtype)
    rows = plan.rows
    q = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, rows, DQK)), q_box, SWIZZLE)
    if plan.paged:
        pages = seqlen // plan.page_size
        k = nvfly.TmaDescriptor(TensorDesc(dtype, (batch * pages, plan.page_size, 1, DQK)), k_box, SWIZZLE)
        table = TensorDesc(nvfly.i32, (batch, pages))
    else:
        k = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, seqlen, 1, DQK)), k_box, SWIZZLE)
        table = None
    seqlens = TensorDesc(nvfly.i32, (batch,))
    split = plan.splits > 1
    out = None if split else TensorDesc(dtype, (batch, plan.sq, plan.heads, DV))
    lse = TensorDesc(nvfly.f32, (batch, plan.heads, plan.sq)) if return_lse and not split else None
    partial_o = TensorDesc(nvfly.f32, (plan.splits * batch * rows, DV)) if split else None
    partial_lse = TensorDesc(nvfly.f32, (plan.splits * batch * rows,)) if split else None
    kernels = [attention_mla_kernel.compile(q, k, table, seqlens, out, lse, partial_o, partial_lse, batch, 0.18,
                                            PLAN=plan, block=THREADS, target=target)]
    if split:
        kernels.append(compile_combine(
            partial_o, partial_lse, TensorDesc(dtype, (batch, plan.sq, plan.heads, DV)),
            TensorDesc(nvfly.f32, (batch, plan.heads, plan.sq)) if return_lse else None,
            batch * rows, plan.heads, plan.splits, plan.sq, DV, plan.pdl_combine, target))
    return kernels
