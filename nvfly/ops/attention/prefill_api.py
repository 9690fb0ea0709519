"""Prefill attention's host functions: argument checks and eligibility, the launches (padded batches and packed
variable-length sequences), a float32 reference, the FLOP count the benchmark reports and a compile helper for tests
without a GPU."""
from __future__ import annotations

import contextvars
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, NamedTuple, Optional, Union

import nvfly
from nvfly.ops.attention.api import _aligned, _kernel_captured, _mods, _require_cuda, _tensor, check_captured
from nvfly.ops.attention.kv_options import check_block_mask, error, mask_mod_of, reference_block_keep
from nvfly.ops.attention.mods import MAX_CAPTURED, Mods, bound, captured_tensors
from nvfly.ops.attention.prefill_kernel import attention_prefill_kernel
from nvfly.ops.attention.prefill_plan import (BLOCK_M, FP8_HEAD_DIMS, HEAD_DIMS, PrefillPlan, causal_offset,
                                              prefill_plan, prefill_unit_table)
from nvfly.ops.attention.softmax import LN2
from nvfly.ops.attention.transpose_kernel import THREADS, transpose_plan, transpose_values_kernel
from nvfly.ops.common.opcall import Declined, KernelScalars, OpCalls, context_value
from nvfly.runtime.torch_args import layout_key
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.tensor_desc import torch_dtype
from nvfly.runtime.tma import cached_descriptor

if TYPE_CHECKING:
    import torch

OP = "attention.prefill"
DTYPES = ("torch.bfloat16", "torch.float16", "torch.float8_e4m3fn")
FP8 = "torch.float8_e4m3fn"
DESCALES = ("q_descale", "k_descale", "v_descale")
ALIGNMENTS = ("bottom_right", "top_left")


def _check(q: Any, k: Any, v: Any, scale: Optional[float], causal_alignment: str) -> None:
    """Shapes, dtypes, devices, the last dimensions' strides and the options (errors name the argument)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name, 4, OP)
    if str(q.dtype) not in DTYPES:
        raise error(TypeError, "q", f"dtype {q.dtype} is not supported (bfloat16, float16, float8_e4m3fn)", OP)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise error(TypeError, name, f"dtype {t.dtype} differs from q's {q.dtype}", OP)
        if t.device != q.device:
            raise error(ValueError, name, f"on {t.device}, q on {q.device}", OP)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise error(ValueError, name, f"the last dimension must be contiguous (stride 1), got strides "
                                          f"{tuple(t.stride())}", OP)
    batch, _, hq, dqk = q.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != batch:
            raise error(ValueError, name, f"{t.shape[0]} sequences (dimension 0), q has {batch}", OP)
    if tuple(v.shape[1:3]) != tuple(k.shape[1:3]):
        raise error(ValueError, "v", f"shape {tuple(v.shape)} does not match k's {tuple(k.shape)} in its keys and "
                                     "heads (dimensions 1 and 2)", OP)
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise error(ValueError, "q", f"{hq} query heads are not a multiple of k's {hkv} KV heads", OP)
    if k.shape[3] != dqk:
        raise error(ValueError, "k", f"head dim {k.shape[3]} differs from q's {dqk}", OP)
    head_dims = FP8_HEAD_DIMS if str(q.dtype) == FP8 else HEAD_DIMS
    pairs = ", ".join(f"{a}/{b}" for a, b in head_dims) + (" in float8_e4m3fn" if str(q.dtype) == FP8 else "")
    if dqk not in {a for a, _ in head_dims}:
        raise error(ValueError, "q", f"head dim {dqk} is not supported yet (Dqk/Dv: {pairs})", OP)
    if (dqk, v.shape[3]) not in head_dims:
        raise error(ValueError, "v", f"head dim {v.shape[3]} with Dqk {dqk} is not supported yet (Dqk/Dv: {pairs})",
                    OP)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise error(ValueError, "scale", f"expected a positive finite number, got {scale!r}", OP)
    if causal_alignment not in ALIGNMENTS:
        raise error(ValueError, "causal_alignment", f"expected one of {ALIGNMENTS}, got {causal_alignment!r}", OP)


def _layout_reason(q: Any, k: Any, v: Any) -> Optional[str]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not _aligned(t):
            return (f"{name}: TMA needs a 16-byte aligned base and strides but the last a multiple of 16 bytes, got "
                    f"strides {tuple(t.stride())}")
    return None


def prefill_eligibility(q: Any, k: Any, v: Any, *, scale: Optional[float] = None,
                        causal_alignment: str = "bottom_right", window: Optional[tuple] = None,
                        score_mod: Optional[Callable[..., Any]] = None, mask_mod: Optional[Callable[..., Any]] = None,
                        block_mask: Any = None, captured: tuple = ()) -> Optional[str]:
    """None when ``prefill`` computes this call, else the reason it declines: the argument checks' error (mods and
    block mask included, without reading the block mask; fp8's), then the device's, then the layouts'."""
    try:
        _check(q, k, v, scale, causal_alignment)
        _window(window)
        _check_fp8(q, k, (None, None, None), score_mod, mask_mod, block_mask)
        _check_mods(q, k, score_mod, mask_mod, block_mask, False, captured)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    import torch
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"q is on an sm_{major}{minor} GPU: nvfly's prefill attention needs an sm_90 (Hopper) GPU"
    return _layout_reason(q, k, v)


_plan = functools.lru_cache(maxsize=64)(prefill_plan)
_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("prefill_plan_options", default=(None,) * 10)


def plan_options(overlap: Optional[bool] = None, pingpong: Optional[bool] = None, wide: Optional[bool] = None,
                 tree_max: Optional[bool] = None, poly_exp2: Optional[int] = None,
                 hoist: Optional[bool] = None, prefetch_mask: Optional[bool] = None,
                 lazy_rescale: Optional[bool] = None, persistent: Optional[bool] = None,
                 unit_table: Optional[bool] = None) -> ContextManager[None]:
    """``prefill`` and ``prefill_varlen`` calls inside run plans with these ``PrefillPlan`` options (None: the
    plan's default; ``wide``, ``tree_max``, ``poly_exp2``: fp8's, ``prefill_plan``; ``persistent``,
    ``unit_table``: ``prefill``'s bf16/fp16 calls, packed sequences ignore them): the benchmark's and the tests' way
    to run the kernel's variants side by side."""
    return context_value(_OPTIONS, (overlap, pingpong, wide, tree_max, poly_exp2, hoist, prefetch_mask,
                                     lazy_rescale, persistent, unit_table))


def _boxes(plan: PrefillPlan, dtype: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The (B, S, H, D) boxes of the Q, K and V loads: a tile's rows of one head, one swizzle row (128 or 64 bytes)
    wide (the boxes ``sm90.operand_boxes`` lays out in the kernel); fp8's transposed V (B, Dv, Hkv, Skv): Dv rows of
    a swizzle row of keys."""
    width = plan.swizzle // dtype.itemsize
    v_box = (1, plan.dv, 1, plan.v_swizzle // dtype.itemsize) if plan.fp8 else (1, plan.block_n, 1, width)
    return (1, plan.block_m, 1, width), (1, plan.block_n, 1, width), v_box


def _window(window: Any) -> tuple[Optional[int], Optional[int]]:
    """(left, right) of a ``window`` argument, None for an unbounded side (given as None or -1)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise error(ValueError, "window", f"expected (left, right), got {window!r}", OP)
    bounds = []
    for side in window:
        if side is None or (isinstance(side, int) and side == -1):
            bounds.append(None)
        elif isinstance(side, int) and not isinstance(side, bool) and side >= 0:
            bounds.append(int(side))
        else:
            raise error(ValueError, "window", f"sides must be non-negative ints or None/-1 (unbounded), got "
                                              f"{window!r}", OP)
    return bounds[0], bounds[1]


@functools.lru_cache(maxsize=64)
def _unit_table(plan: PrefillPlan, batch: int, heads: int, sq: int, skv: int, group: int, offset: int, left: int,
                right: int, ctas: int, device: Any) -> "torch.Tensor":
    """``plan.unit_table``'s CTA work lists (``prefill_unit_table``) as an int32 tensor on ``device``, built once a
    call signature."""
    import torch
    return torch.tensor(prefill_unit_table(plan, batch, heads, sq, skv, group, offset, left, right, ctas),
                        dtype=torch.int32, device=device)


class Masking(NamedTuple):
    """The plan's masking flags and the kernel's runtime bounds: keys from a query's position minus ``left``
    (``window``) to its position plus ``right`` (``causal``: 0 for causal), positions bottom-right aligned or not."""
    causal: bool
    window: bool
    left: int
    right: int
    bottom_right: int


def masking(causal: bool, window: Any, causal_alignment: str) -> Masking:
    """The bounds of ``causal`` and ``window=(left, right)`` together (causal caps the right side at 0)."""
    left, right = _window(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    return Masking(right is not None, left is not None, left or 0, right or 0,
                   int(causal_alignment == "bottom_right"))


def _check_mods(q: Any, k: Any, score_mod: Any, mask_mod: Any, block_mask: Any, read: bool,
                captured: tuple = ()) -> Mods:
    """The mods of a call (a BlockMask's own mask_mod when it has one, ``captured``'s count of tensor arguments)
    after checking the block mask; raises naming the argument."""
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise error(TypeError, name, f"expected a function, got {type(fn).__name__}", OP)
    if block_mask is not None:
        check_block_mask(block_mask, mask_mod, q, k.shape[2], k.shape[1], read, OP, 128, BLOCK_M)
        mask_mod = mask_mod_of(block_mask, mask_mod)
    mods = _mods(score_mod, mask_mod, check_captured(captured, q, OP))
    if mods.arguments + len(captured_tensors(mods)) > MAX_CAPTURED:
        raise error(ValueError, "score_mod", f"the mods take {mods.arguments + len(captured_tensors(mods))} tensors "
                                             f"(captured= and captured by the functions); at most {MAX_CAPTURED}", OP)
    return mods


def _check_fp8(q: Any, k: Any, descales: tuple, score_mod: Any, mask_mod: Any, block_mask: Any) -> None:
    """fp8 inputs: no mods nor block mask; descales (FlashAttention-3's factors) only with fp8 inputs, each None (1),
    a positive finite number or a float32 tensor on q's device of one element (per tensor), (Hkv,) (per KV head) or
    (B, Hkv) (per sequence and KV head); a tensor's values are not read (no device sync): finite and positive is the
    caller's part."""
    import torch
    if str(q.dtype) != FP8:
        for name, descale in zip(DESCALES, descales):
            if descale is not None:
                raise error(TypeError, name, f"only for float8_e4m3fn q, k and v (q is {q.dtype})", OP)
        return
    for name, given in (("score_mod", score_mod), ("mask_mod", mask_mod), ("block_mask", block_mask)):
        if given is not None:
            raise error(ValueError, name, "not supported with float8_e4m3fn inputs yet", OP)
    batch, hkv = q.shape[0], k.shape[2]
    for name, descale in zip(DESCALES, descales):
        if descale is None:
            continue
        if isinstance(descale, torch.Tensor):
            shape = tuple(descale.shape)
            if (descale.dtype != torch.float32 or descale.device != q.device
                    or not (descale.numel() == 1 or shape in ((hkv,), (batch, hkv)))):
                raise error(ValueError, name, f"expected a float32 tensor on {q.device} of one element (per tensor), "
                                              f"({hkv},) (per KV head) or ({batch}, {hkv}) (per sequence and KV "
                                              f"head), got {shape} {descale.dtype} on {descale.device}", OP)
        elif isinstance(descale, bool) or not isinstance(descale, (int, float)) or not (
                math.isfinite(descale) and descale > 0):
            raise error(ValueError, name, f"expected a positive finite number or a float32 tensor, got {descale!r}",
                        OP)


def _head_factors(descale: Any, batch: int, kv_heads: int, device: Any) -> Any:
    """A descale as ``prefill`` takes it (None, a number, a one-element, (Hkv,) or (B, Hkv) float32 tensor) as a
    (B, Hkv) float32 view (a per-tensor factor or the batch broadcast by zero strides: no copy of a tensor), or
    None."""
    import torch
    if descale is None:
        return None
    factors = torch.as_tensor(descale, dtype=torch.float32, device=device)
    return (factors.reshape(1, 1) if factors.numel() == 1 else factors).expand(batch, kv_heads)


def _descale_tensors(descales: tuple, batch: int, kv_heads: int, device: Any) -> tuple[list, bool]:
    """The descales as the kernel reads them (None: a factor of 1) and whether per head
    (``PrefillPlan.per_head_descales``): with a (Hkv,) or (B, Hkv) descale among them, each given one as
    ``_head_factors``' (B, Hkv) view, else one-element tensors."""
    import torch
    if all(d is None or not isinstance(d, torch.Tensor) or d.numel() == 1 for d in descales):
        return [None if d is None else torch.as_tensor(d, dtype=torch.float32, device=device).reshape(1)
                for d in descales], False
    return [_head_factors(d, batch, kv_heads, device) for d in descales], True


def transposed_values(v: "torch.Tensor") -> "torch.Tensor":
    """The fp8 kernel's V: (B, Dv, Hkv, Skv rounded up to 16) contiguous, zeros past Skv, keys permuted within every
    16 to the order in which P's fp8 register fragments hold S's columns (``sm90.register_a_k_order``: column
    4q + 2i + j holds key 8i + 2q + j); fp8 wgmma reads B K-major only, and P·V's K is the key. On CUDA one launch
    of ``transpose_kernel`` (one pass over V, no host sync: CUDA-graph capturable) when v's base and strides are
    multiples of 4 bytes (prefill's always are), else ``transposed_values_torch``."""
    import torch
    try:
        key = layout_key(v)
        call = _TRANSPOSES.get(key)
    except Exception:  # noqa: BLE001 - not a tensor: the torch copy's errors explain
        key = call = None
    if call is None:
        call = _TRANSPOSES.plan(OP, key, _transpose_call, v)
    if isinstance(call, Declined):
        return transposed_values_torch(v)
    batch, skv, heads, dv = v.shape
    out = torch.empty(batch, dv, heads, call.keys, dtype=torch.uint8, device=v.device)
    call.launch.launch(v.view(torch.uint8), out, *call.scalars.values)
    return out.view(v.dtype)


@dataclass(frozen=True)
class _TransposeCall:
    """A V layout's transpose launch: ``keys`` output keys (Skv rounded up to 16) and the prepared kernel."""
    keys: int
    launch: Any  # nvfly.PreparedLaunch
    scalars: KernelScalars


_TRANSPOSES: OpCalls[Union[_TransposeCall, Declined]] = OpCalls()


def _transpose_call(v: Any) -> Union[_TransposeCall, Declined]:
    """The kernel's launch for v's layout, or why the torch copy does it (not CUDA, misaligned, an empty V)."""
    batch, skv, heads, dv = v.shape
    if v.device.type != "cuda":
        return Declined(f"v is on {v.device.type}")
    if v.data_ptr() % 4 or any(s % 4 for s in v.stride()[:3]) or dv % 4 or v.stride(3) != 1:
        return Declined(f"v's base or strides {tuple(v.stride())} are not multiples of 4 bytes")
    if not (batch and skv and heads and dv):
        return Declined("v is empty")
    try:
        plan = transpose_plan(dv)
    except ValueError as exc:
        return Declined(str(exc))
    keys = -(-skv // 16) * 16
    scalars = KernelScalars.of(transpose_values_kernel, skv=skv, keys=keys, PLAN=plan)
    return _TransposeCall(keys, transpose_values_kernel.prepared(plan.grid(batch, heads, keys), THREADS), scalars)


def transposed_values_torch(v: "torch.Tensor") -> "torch.Tensor":
    """``transposed_values`` by one torch strided copy of V (a pad first when Skv is not a multiple of 16): the CPU
    path and the kernel's reference."""
    import torch
    batch, skv, heads, dv = v.shape
    keys = -(-skv // 16) * 16
    raw = v.view(torch.uint8)  # bytes: padding and copies of every torch version
    if keys != skv:
        raw = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, keys - skv))
    # keys as (group of 16, i, q, j) -> (B, Dv, Hkv, group, q, i, j)
    digits = raw.reshape(batch, keys // 16, 2, 4, 2, heads, dv).permute(0, 6, 5, 1, 3, 2, 4)
    return digits.contiguous().view(batch, dv, heads, keys).view(v.dtype)


def prefill(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", *, causal: bool = False,
            scale: Optional[float] = None, return_lse: bool = False, causal_alignment: str = "bottom_right",
            out: Optional["torch.Tensor"] = None, window: Optional[tuple] = None,
            score_mod: Optional[Callable[..., Any]] = None, mask_mod: Optional[Callable[..., Any]] = None,
            block_mask: Any = None, validate: bool = True, captured: tuple = (),
            q_descale: Union[None, float, "torch.Tensor"] = None, k_descale: Union[None, float, "torch.Tensor"] = None,
            v_descale: Union[None, float, "torch.Tensor"] = None
            ) -> Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]:
    """softmax(q kᵀ scale + mods) v with fp32 accumulation, for long query sequences.

    q (B, Sq, Hq, Dqk), k (B, Skv, Hkv, Dqk), v (B, Skv, Hkv, Dv): bf16 or fp16, any strides with the last dimension
    contiguous and the others multiples of 16 bytes (a (B, H, S, D) tensor is passed as ``t.transpose(1, 2)``);
    Hq a multiple of Hkv (GQA, MQA); Sq and Skv any lengths (tails are masked in the kernel). v's head dim Dv may
    differ from q's and k's Dqk: (Dqk, Dv) is one of 64/64, 96/96, 128/128, 64/128, 128/64, 192/128 (DeepSeek-like),
    256/256. ``causal``: query i sees keys up to i + Skv - Sq (``causal_alignment="bottom_right"``, flash-attn's and
    decode's convention) or up to i (``"top_left"``, torch SDPA's is_causal); they agree when Sq = Skv. ``window=(left,
    right)``: query i sees keys from its position (i + the alignment's offset) minus left to its position plus right
    (flash-attn's window_size; None or -1 for an unbounded side; causal caps right at 0); key blocks outside are
    skipped. ``score_mod(score, b, h, q_idx, kv_idx)``/``mask_mod(b, h, q_idx, kv_idx)``: flex_attention's mods
    (q_idx, kv_idx the row and key index in the sequence; ``nvfly.ops.attention.mods``), traced into the kernel.
    ``block_mask``: a flex ``BlockMask`` (128-row query blocks or multiples, KV blocks of 128 keys or multiples):
    its partial blocks apply its mask_mod (or ``mask_mod=``), its full blocks no mask_mod,
    other blocks are not read; ``validate`` reads its block numbers (a device sync). ``captured``: tensors passed to
    the mods as trailing arguments (``score_mod(score, b, h, q_idx, kv_idx, *captured)``), kernel inputs read at run
    time: one compiled mod serves calls with different tensors. ``scale``: default Dqk^-0.5.
    Returns out (B, Sq, Hq, Dv) in q's dtype and, with ``return_lse``, the log-sum-exp (B, Hq, Sq) float32 (natural
    log; -inf for a row that sees no key, whose output is zeros). ``out``: a contiguous (B, Sq, Hq, Dv) tensor of
    q's dtype to write (else a new one).

    float8_e4m3fn q, k and v (Dqk = Dv = 64, 128 or 256; no mods nor block mask): FlashAttention-3's interface,
    scores = (q kᵀ) · q_descale · k_descale · scale and out = (P v) · v_descale, P rounded to e4m3; each descale
    is None (1), a number or a float32 tensor on q's device (read in the kernel: no sync; its values finite and
    positive) of one element (per tensor), (Hkv,) (per KV head, every sequence) or (B, Hkv) (per sequence and KV
    head; q's factor of a KV head applies to every query head of its group), each independently. out and its
    ``out=`` are bfloat16. V is first transposed (and its keys permuted by 16) into a (B, Dv, Hkv, Skv) copy by
    one pass over it: fp8 wgmma reads its shared-memory operand K-major only (``transposed_values``).
    """
    import torch
    _check(q, k, v, scale, causal_alignment)
    descales = (q_descale, k_descale, v_descale)
    _check_fp8(q, k, descales, score_mod, mask_mod, block_mask)
    fp8 = str(q.dtype) == FP8
    bounds = masking(causal, window, causal_alignment)
    mods = _check_mods(q, k, score_mod, mask_mod, block_mask, validate and not _capturing(q), captured)
    _require_cuda(q, OP)
    reason = _layout_reason(q, k, v)
    if reason:
        raise ValueError(f"{OP}: {reason}")
    batch, sq, hq, dqk = q.shape
    skv, dv = k.shape[1], v.shape[3]
    out = _out(out, (batch, sq, hq, dv), q, torch.bfloat16 if fp8 else q.dtype)
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device) if return_lse else None
    if batch and sq and hq:
        if skv == 0:  # no key: TMA cannot describe an empty tensor, and there is nothing to attend
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            tables = _block_tables(block_mask, batch, hq)
            q_block = int(block_mask.BLOCK_SIZE[0]) if block_mask is not None else 0
            kv_block = int(block_mask.BLOCK_SIZE[1]) if block_mask is not None else 0
            (overlap, pingpong, wide, tree_max, poly_exp2, hoist, prefetch_mask, lazy, persistent,
             unit_table) = _OPTIONS.get()
            kernel_descales, per_head = _descale_tensors(descales, batch, k.shape[2], q.device)
            plan = _plan(dqk, dv, bounds.causal, bounds.window, kv_block, q_block, False, overlap, pingpong, fp8,
                         wide, tree_max, poly_exp2, mods.active, hoist, prefetch_mask, lazy, persistent,
                         unit_table and persistent, per_head)
            if fp8:
                v = transposed_values(v)
            grid = plan.grid(batch, hq, sq, plan_sm_count(q.get_device()) if plan.persistent else 0)
            units = None
            if plan.unit_table:
                units = _unit_table(plan, batch, hq, sq, skv, hq // k.shape[2],
                                    bounds.bottom_right * (skv - sq), bounds.left, bounds.right, grid[0], q.device)
            _launch(plan, mods, q, k, v, out, lse, None, tables, _scale(scale, dqk), bounds, sq, skv, grid,
                    tuple(captured), kernel_descales, units)
    return (out, lse) if return_lse else out


def _capturing(q: Any) -> bool:
    """Whether a CUDA graph is being captured on the current stream (no reading tensors back then)."""
    import torch
    return q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _scale(scale: Optional[float], dqk: int) -> float:
    return dqk ** -0.5 if scale is None else float(scale)


def _out(out: Any, shape: tuple, q: Any, dtype: Any) -> Any:
    """``out`` checked (a contiguous tensor of ``shape`` in ``dtype`` on q's device), or a new one."""
    import torch
    if out is None:
        return torch.empty(*shape, dtype=dtype, device=q.device)
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype
            or out.device != q.device or not out.is_contiguous()):
        raise error(ValueError, "out", f"expected a contiguous {shape} {dtype} tensor on {q.device}", OP)
    return out


def _block_tables(block_mask: Any, batch: int, hq: int) -> list:
    """A BlockMask's [kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices] as the kernel reads them:
    (B, Hq, ...) int32, contiguous (broadcast batch and head dimensions expanded); Nones without."""
    if block_mask is None:
        return [None] * 4
    tables = []
    for num, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                         (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            tables += [None, None]
        else:
            tables += [num.expand(batch, hq, num.shape[2]).contiguous(),
                       indices.expand(batch, hq, *indices.shape[2:]).contiguous()]
    return tables


def _launch(plan: PrefillPlan, mods: Mods, q: Any, k: Any, v: Any, out: Any, lse: Any, cu_seqlens: Any,
            tables: list, scale: float, bounds: Masking, sq: int, skv: int, grid: tuple,
            arguments: tuple = (), descales: Any = (None, None, None), unit_table: Any = None) -> None:
    """One launch: q, k, v, out (B, S, H, D) and lse (B, H, S) as the kernel takes them (packed sequences: B = 1;
    fp8: v (B, Dv, Hkv, Skv), ``transposed_values``); ``arguments``: the mods' tensor arguments; ``descales``:
    fp8's q, k and v descales (float32 tensors or None, ``_descale_tensors``); ``unit_table``:
    ``PrefillPlan.unit_table``'s int32 work lists (``_unit_table``)."""
    q_box, kv_box, v_box = _boxes(plan, torch_dtype(q))
    descriptors = [cached_descriptor(t, box, swizzle) for t, box, swizzle in ((q, q_box, plan.swizzle),
                                                                              (k, kv_box, plan.swizzle),
                                                                              (v, v_box, plan.v_swizzle))]
    captured = _kernel_captured(mods, q.device, arguments)
    captured = captured + [None] * (MAX_CAPTURED - len(captured))
    attention_prefill_kernel[grid, plan.threads](
        *descriptors, out, lse, *(cu_seqlens or (None, None)), *captured, *tables, *descales, unit_table, sq, skv,
        q.shape[2] // k.shape[2], bounds.bottom_right, bounds.left, bounds.right, scale / LN2, PLAN=plan,
        MODS=mods)


# ---------------------------------------------------------------------------------------------- packed sequences
def _check_varlen(q: Any, k: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
                  validate: bool, capturing: bool) -> tuple[int, int]:
    """cu_seqlens int32 (B + 1,) on q's device; with ``validate`` (a device sync) non-decreasing from >= 0 to at
    most the packed length and the max lengths at least every sequence's (read from them when None; under CUDA
    graph capture, which reads nothing back, they must be given). Returns (max_seqlen_q, max_seqlen_k)."""
    import torch
    maxima = []
    for name, cu, t, given, max_name in (("cu_seqlens_q", cu_seqlens_q, q, max_seqlen_q, "max_seqlen_q"),
                                         ("cu_seqlens_k", cu_seqlens_k, k, max_seqlen_k, "max_seqlen_k")):
        _tensor(cu, name, 1, OP)
        if cu.dtype != torch.int32:
            raise error(TypeError, name, f"expected int32, got {cu.dtype}", OP)
        if cu.device != q.device:
            raise error(ValueError, name, f"on {cu.device}, q on {q.device}", OP)
        if cu.shape[0] != cu_seqlens_q.shape[0] or cu.shape[0] < 1:
            raise error(ValueError, name, f"{cu.shape[0]} offsets; cu_seqlens_q and cu_seqlens_k need B + 1 each "
                                          f"(cu_seqlens_q has {cu_seqlens_q.shape[0]})", OP)
        if given is not None and (not isinstance(given, int) or given < 0):
            raise error(ValueError, max_name, f"expected a non-negative int, got {given!r}", OP)
        if given is None and capturing:
            raise error(ValueError, max_name, "needed under CUDA graph capture (cu_seqlens cannot be read back)", OP)
        if (validate or given is None) and not capturing:
            values = cu.tolist()
            lengths = [b - a for a, b in zip(values, values[1:])]
            if values[0] < 0 or any(n < 0 for n in lengths):
                raise error(ValueError, name, f"offsets must be non-decreasing from 0 or more, got {values}", OP)
            if values[-1] > t.shape[0]:
                raise error(ValueError, name, f"the last offset {values[-1]} is beyond the {t.shape[0]} packed "
                                              "tokens", OP)
            longest = max(lengths, default=0)
            if given is not None and given < longest:
                raise error(ValueError, max_name, f"{given} is shorter than a sequence of {longest}", OP)
            given = longest if given is None else given
        maxima.append(given)
    return maxima[0], maxima[1]


def prefill_varlen(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", cu_seqlens_q: "torch.Tensor",
                   cu_seqlens_k: "torch.Tensor", max_seqlen_q: Optional[int] = None,
                   max_seqlen_k: Optional[int] = None, *, causal: bool = False, scale: Optional[float] = None,
                   return_lse: bool = False, causal_alignment: str = "bottom_right",
                   out: Optional["torch.Tensor"] = None, window: Optional[tuple] = None,
                   score_mod: Optional[Callable[..., Any]] = None, mask_mod: Optional[Callable[..., Any]] = None,
                   validate: bool = True) -> Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]:
    """``prefill`` of B sequences of any lengths packed along S (flash-attn's varlen convention): q (total_q, Hq,
    Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q
    and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v (int32 (B + 1,) tensors). Causal, window and mods apply per
    sequence (the mods' b is the sequence, q_idx and kv_idx indices within it). ``max_seqlen_q``/``max_seqlen_k``:
    the longest sequences (read from cu_seqlens when None: a device sync; under CUDA graph capture they must be
    given). ``validate`` (skipped under capture) reads cu_seqlens: a device sync checking the offsets are
    non-decreasing and within the tensors. Returns out (total_q, Hq, Dv) and, with ``return_lse``, LSE
    (Hq, total_q) float32. Rows outside every sequence are left unwritten."""
    import torch
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name, 3, OP)
    _check(q[None], k[None], v[None], scale, causal_alignment)
    if str(q.dtype) == FP8:
        raise error(TypeError, "q", "float8_e4m3fn packed sequences are not supported yet (prefill takes them)", OP)
    bounds = masking(causal, window, causal_alignment)
    mods = _check_mods(q[None], k[None], score_mod, mask_mod, None, False)
    max_q, _ = _check_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, validate, _capturing(q))
    _require_cuda(q, OP)
    reason = _layout_reason(q, k, v)
    if reason:
        raise ValueError(f"{OP}: {reason}")
    total_q, hq, dqk = q.shape
    dv = v.shape[2]
    out = _out(out, (total_q, hq, dv), q, q.dtype)
    lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device) if return_lse else None
    batch = cu_seqlens_q.shape[0] - 1
    if batch and max_q and hq and total_q:
        if k.shape[0] == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            options = _OPTIONS.get()
            plan = _plan(dqk, dv, bounds.causal, bounds.window, 0, 0, True, *options[:2], mods=mods.active,
                         hoist=options[5], prefetch_mask=options[6], lazy_rescale=options[7])
            _launch(plan, mods, q[None], k[None], v[None], out[None], None if lse is None else lse[None],
                    (cu_seqlens_q, cu_seqlens_k), [None] * 4, _scale(scale, dqk), bounds, 0, 0,
                    plan.grid(batch, hq, max_q))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------- reference
def _dequantised(x: Any, factors: Any) -> Any:
    """One sequence's (S, H, D) x in float32, times its (Hkv,) ``factors`` (None: 1), a KV head's factor on each head
    of its group."""
    x = x.float()
    if factors is None:
        return x
    return x * factors.repeat_interleave(x.shape[1] // factors.shape[0])[:, None]


def _attend(q: Any, k: Any, v: Any, scale: float, bounds: Masking, score_mod: Any, mask_mod: Any, b: int,
            block_mask: Any, factors: tuple = (None, None, None)) -> tuple[Any, Any]:
    """One sequence in float32: q (Sq, Hq, Dqk), k (Skv, Hkv, Dqk), v (Skv, Hkv, Dv) -> out (Sq, Hq, Dv), lse (Hq,
    Sq); the mods see q_idx, kv_idx as indices in the sequence, b as ``b``; ``factors``: q's, k's and v's (Hkv,)
    descales of the sequence (``_dequantised``)."""
    import torch
    q, k, v = (_dequantised(x, f) for x, f in zip((q, k, v), factors))
    sq, hq = q.shape[:2]
    skv, hkv = k.shape[:2]
    keys = k.float().repeat_interleave(hq // hkv, dim=1)
    values = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # (Hq, Sq, Skv)
    heads = torch.arange(hq, device=q.device)[:, None, None]
    rows = torch.arange(sq, device=q.device)[None, :, None]
    kv = torch.arange(skv, device=q.device)[None, None, :]
    index_b = torch.tensor(b, device=q.device)
    if score_mod is not None:
        scores = score_mod(scores, index_b, heads, rows, kv).float()
    positions = rows + bounds.bottom_right * (skv - sq)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if bounds.causal:
        keep = keep & (kv <= positions + bounds.right)
    if bounds.window:
        keep = keep & (kv >= positions - bounds.left)
    if block_mask is not None:
        keep = keep & reference_block_keep(block_mask, mask_mod, b, hq, rows, kv, query_blocks=True)
    elif mask_mod is not None:
        keep = keep & mask_mod(index_b, heads, rows, kv).bool()
    scores = scores.masked_fill(~keep, float("-inf"))
    row_lse = torch.logsumexp(scores, dim=-1)  # (Hq, Sq)
    weights = torch.exp(scores - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
    return torch.einsum("hqk,khd->qhd", weights, values), row_lse


def prefill_reference(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", *, causal: bool = False,
                      scale: Optional[float] = None, causal_alignment: str = "bottom_right",
                      window: Optional[tuple] = None, score_mod: Optional[Callable[..., Any]] = None,
                      mask_mod: Optional[Callable[..., Any]] = None, block_mask: Any = None,
                      cu_seqlens_q: Optional["torch.Tensor"] = None, cu_seqlens_k: Optional["torch.Tensor"] = None,
                      captured: tuple = (), q_descale: Any = None, k_descale: Any = None,
                      v_descale: Any = None) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(out, lse) of ``prefill``'s (or, with cu_seqlens, ``prefill_varlen``'s) arguments in float32, sequence by
    sequence, from the definitions: the mods applied with torch broadcasting, a block mask from flex's meaning
    (``reference_block_keep``); the descales as ``prefill`` takes them (per tensor, (Hkv,) or (B, Hkv); B the
    sequences) dequantise q, k and v (q's factor of a KV head on its group's query heads). Packed: out (total_q, Hq,
    Dv), lse (Hq, total_q), rows outside every sequence 0 and -inf."""
    import torch
    bounds = masking(causal, window, causal_alignment)
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    descales = [_head_factors(d, batch, k.shape[-2], q.device) for d in (q_descale, k_descale, v_descale)]

    def factors(b: int) -> tuple:
        return tuple(None if d is None else d[b] for d in descales)
    if block_mask is not None:
        mask_mod = mask_mod_of(block_mask, mask_mod)
    score_mod, mask_mod = bound(score_mod, tuple(captured)), bound(mask_mod, tuple(captured))
    scale = _scale(scale, q.shape[-1])
    if cu_seqlens_q is None:
        pieces = [_attend(q[b], k[b], v[b], scale, bounds, score_mod, mask_mod, b, block_mask, factors(b))
                  for b in range(q.shape[0])]
        out = torch.stack([o for o, _ in pieces]) if pieces else q.new_zeros(0, *q.shape[1:3], v.shape[3]).float()
        lse = torch.stack([s for _, s in pieces]) if pieces else q.new_zeros(0, q.shape[2], q.shape[1]).float()
        return out, lse
    out = torch.zeros(*q.shape[:2], v.shape[2], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        (q0, q1), (k0, k1) = starts_q[b:b + 2], starts_k[b:b + 2]
        out[q0:q1], lse[:, q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, bounds, score_mod, mask_mod, b,
                                            None, factors(b))
    return out, lse


def visible_pairs(sq: int, skv: int, causal: bool, causal_alignment: str = "bottom_right",
                  window: Optional[tuple] = None) -> int:
    """(query, key) pairs a head computes: Sq · Skv, or under the causal mask and a window the keys each query
    sees."""
    bounds = masking(causal, window, causal_alignment)
    offset = causal_offset(sq, skv, causal_alignment)
    total = 0
    for i in range(sq):
        first = max(i + offset - bounds.left, 0) if bounds.window else 0
        last = min(i + offset + bounds.right, skv - 1) if bounds.causal else skv - 1
        total += max(last - first + 1, 0)
    return total


def prefill_flops(batch: int, sq: int, skv: int, hq: int, dqk: int, dv: int, causal: bool,
                  causal_alignment: str = "bottom_right", window: Optional[tuple] = None) -> int:
    """The unmasked work the benchmark's TFLOP/s counts: 2 · (Dqk + Dv) per visible (query, key) pair and head."""
    return 2 * (dqk + dv) * batch * hq * visible_pairs(sq, skv, causal, causal_alignment, window)


# ---------------------------------------------------------------------------------------------- compile only
COMPILE_SMS = 132  # an H200's SMs: the grid a compiled persistent plan's unit table is laid out for


def compile_prefill(plan: PrefillPlan, dtype: Any = nvfly.bf16, batch: int = 2, sq: int = 1000, skv: int = 1000,
                    heads: int = 4, kv_heads: int = 2, return_lse: bool = True, mods: Mods = Mods(),
                    target: str = "sm_90a", captured: tuple = (),
                    descale_strides: tuple = (None, None, None)) -> Any:
    """The prefill kernel for ``plan`` (and ``mods``) compiled without a GPU (a CompiledKernel); a varlen plan gets
    ``batch`` sequences packed into sq and skv rows, a block-mask plan its tables; ``captured``: (CPU) tensors
    standing for the mods' arguments. An fp8 plan takes e4m3 inputs whatever ``dtype``, V transposed, the three
    descales and a bf16 out; ``PrefillPlan.per_head_descales``: (batch, kv_heads) descales of ``descale_strides``
    (each None, contiguous, or a (batch, head) pair: (0, 0) a per-tensor factor's view, (0, 1) a (Hkv,) one's)."""
    from nvfly.runtime.tensor_desc import TensorDesc
    out_dtype = nvfly.bf16 if plan.fp8 else dtype
    dtype = nvfly.f8e4m3 if plan.fp8 else dtype
    q_box, kv_box, v_box = _boxes(plan, dtype)
    rows = 1 if plan.varlen else batch
    v_shape = (rows, plan.dv, kv_heads, -(-skv // 16) * 16) if plan.fp8 else (rows, skv, kv_heads, plan.dv)
    q = nvfly.TmaDescriptor(TensorDesc(dtype, (rows, sq, heads, plan.dqk)), q_box, plan.swizzle)
    k = nvfly.TmaDescriptor(TensorDesc(dtype, (rows, skv, kv_heads, plan.dqk)), kv_box, plan.swizzle)
    v = nvfly.TmaDescriptor(TensorDesc(dtype, v_shape), v_box, plan.v_swizzle)
    out = TensorDesc(out_dtype, (rows, sq, heads, plan.dv))
    lse = TensorDesc(nvfly.f32, (rows, heads, sq)) if return_lse else None
    cu_seqlens = [TensorDesc(nvfly.i32, (batch + 1,))] * 2 if plan.varlen else [None, None]
    captured = [TensorDesc(nvfly.i32 if str(t.dtype) in ("torch.int64", "torch.bool") else torch_dtype(t),
                           tuple(t.shape)) for t in (*captured, *captured_tensors(mods))]
    captured = captured + [None] * (MAX_CAPTURED - len(captured))
    tables = [None] * 4
    if plan.kv_block:
        q_blocks, kv_blocks = -(-sq // plan.q_block), -(-skv // plan.kv_block)
        tables = [TensorDesc(nvfly.i32, (batch, heads, q_blocks)), TensorDesc(nvfly.i32, (batch, heads, q_blocks,
                                                                                          kv_blocks))] * 2
    descales = [TensorDesc(nvfly.f32, (1,)) if plan.fp8 else None] * 3
    if plan.per_head_descales:
        descales = [TensorDesc(nvfly.f32, (batch, kv_heads), stride) for stride in descale_strides]
    units = None
    if plan.unit_table:
        ctas = plan.grid(batch, heads, sq, COMPILE_SMS)[0]
        units = TensorDesc(nvfly.i32, (ctas + 1 + -(-sq // plan.block_m) * heads * batch,))
    return attention_prefill_kernel.compile(q, k, v, out, lse, *cu_seqlens, *captured, *tables, *descales, units,
                                            sq, skv, heads // kv_heads, 1, 0, 0, 0.18, PLAN=plan, MODS=mods,
                                            block=plan.threads, target=target)
