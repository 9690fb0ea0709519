"""Prefill attention's host functions: argument checks and eligibility, the launch, a float32 reference (decode's,
which already takes any Sq), the FLOP count the benchmark reports and a compile helper for tests without a GPU."""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Optional, Union

import nvfly
from nvfly.ops.attention.api import _aligned, _require_cuda, _tensor, reference
from nvfly.ops.attention.kv_options import error
from nvfly.ops.attention.prefill_kernel import attention_prefill_kernel
from nvfly.ops.attention.prefill_plan import HEAD_DIMS, SWIZZLE, PrefillPlan, causal_offset, prefill_plan
from nvfly.runtime.tensor_desc import torch_dtype
from nvfly.runtime.tma import cached_descriptor

if TYPE_CHECKING:
    import torch

OP = "attention.prefill"
DTYPES = ("torch.bfloat16", "torch.float16")
ALIGNMENTS = ("bottom_right", "top_left")


def _check(q: Any, k: Any, v: Any, scale: Optional[float], causal_alignment: str) -> None:
    """Shapes, dtypes, devices, the last dimensions' strides and the options (errors name the argument)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(t, name, 4, OP)
    if str(q.dtype) not in DTYPES:
        raise error(TypeError, "q", f"dtype {q.dtype} is not supported (bfloat16, float16)", OP)
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
    pairs = ", ".join(f"{a}/{b}" for a, b in HEAD_DIMS)
    if dqk not in {a for a, _ in HEAD_DIMS}:
        raise error(ValueError, "q", f"head dim {dqk} is not supported yet (Dqk/Dv: {pairs})", OP)
    if (dqk, v.shape[3]) not in HEAD_DIMS:
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
                        causal_alignment: str = "bottom_right") -> Optional[str]:
    """None when ``prefill`` computes this call, else the reason it declines: the argument checks' error, then the
    device's, then the layouts'."""
    try:
        _check(q, k, v, scale, causal_alignment)
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


def _boxes(plan: PrefillPlan, dtype: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (B, S, H, D) boxes of the Q loads and of the K and V loads: a tile's rows of one head, one 128-byte
    swizzle row wide (the boxes ``sm90.operand_boxes`` lays out in the kernel)."""
    width = SWIZZLE // dtype.itemsize
    return (1, plan.block_m, 1, width), (1, plan.block_n, 1, width)


def prefill(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", *, causal: bool = False,
            scale: Optional[float] = None, return_lse: bool = False, causal_alignment: str = "bottom_right",
            out: Optional["torch.Tensor"] = None) -> Union["torch.Tensor", tuple["torch.Tensor", "torch.Tensor"]]:
    """softmax(q kᵀ scale) v with fp32 accumulation, for long query sequences.

    q (B, Sq, Hq, Dqk), k (B, Skv, Hkv, Dqk), v (B, Skv, Hkv, Dv): bf16 or fp16, any strides with the last dimension
    contiguous and the others multiples of 16 bytes (a (B, H, S, D) tensor is passed as ``t.transpose(1, 2)``);
    Hq a multiple of Hkv (GQA, MQA); Sq and Skv any lengths (tails are masked in the kernel). v's head dim Dv may
    differ from q's and k's Dqk: (Dqk, Dv) is one of 64/64, 128/128, 192/128 (DeepSeek-like), 256/256.
    ``causal``: query i sees keys up to i + Skv - Sq (``causal_alignment="bottom_right"``, flash-attn's and decode's
    convention) or up to i (``"top_left"``, torch SDPA's is_causal); they agree when Sq = Skv. ``scale``: default
    Dqk^-0.5. Returns out (B, Sq, Hq, Dv) in q's dtype and, with ``return_lse``, the log-sum-exp (B, Hq, Sq) float32
    (natural log; -inf for a row that sees no key, whose output is zeros). ``out``: a contiguous (B, Sq, Hq, Dv)
    tensor of q's dtype to write (else a new one).
    """
    import torch
    _check(q, k, v, scale, causal_alignment)
    _require_cuda(q, OP)
    reason = _layout_reason(q, k, v)
    if reason:
        raise ValueError(f"{OP}: {reason}")
    batch, sq, hq, dqk = q.shape
    skv, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = torch.empty(batch, sq, hq, dv, dtype=q.dtype, device=q.device)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != (batch, sq, hq, dv) or out.dtype != q.dtype
          or out.device != q.device or not out.is_contiguous()):
        raise error(ValueError, "out", f"expected a contiguous {(batch, sq, hq, dv)} {q.dtype} tensor on {q.device}",
                    OP)
    lse = torch.empty(batch, hq, sq, dtype=torch.float32, device=q.device) if return_lse else None
    if batch and sq and hq:
        if skv == 0:  # no key: TMA cannot describe an empty tensor, and there is nothing to attend
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            _launch(_plan(dqk, dv, bool(causal)), q, k, v, out, lse, dqk ** -0.5 if scale is None else float(scale),
                    causal_offset(sq, skv, causal_alignment))
    return (out, lse) if return_lse else out


def _launch(plan: PrefillPlan, q: Any, k: Any, v: Any, out: Any, lse: Any, scale: float, offset: int) -> None:
    q_box, kv_box = _boxes(plan, torch_dtype(q))
    descriptors = [cached_descriptor(q, q_box, SWIZZLE)] + [cached_descriptor(t, kv_box, SWIZZLE) for t in (k, v)]
    batch, sq, hq, _ = q.shape
    attention_prefill_kernel[plan.grid(batch, hq, sq), plan.threads](
        *descriptors, out, lse, sq, k.shape[1], hq // k.shape[2], offset, scale / math.log(2.0), PLAN=plan)


def prefill_reference(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", *, causal: bool = False,
                      scale: Optional[float] = None, causal_alignment: str = "bottom_right"
                      ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(out, lse) of ``prefill``'s arguments in float32: decode's reference, whose queries are the last Sq
    positions (bottom-right causal); top-left alignment is its mask shifted by Skv - Sq."""
    sq, skv = q.shape[1], k.shape[1]
    shift = causal_offset(sq, skv, "bottom_right") - causal_offset(sq, skv, causal_alignment)
    if causal and shift:
        return reference(q, k, v, scale=scale, causal=False,
                         mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx - shift)
    return reference(q, k, v, scale=scale, causal=causal)


def visible_pairs(sq: int, skv: int, causal: bool, causal_alignment: str = "bottom_right") -> int:
    """(query, key) pairs a head computes: Sq · Skv, or under the causal mask the keys each query sees."""
    if not causal:
        return sq * skv
    offset = causal_offset(sq, skv, causal_alignment)
    return sum(min(max(i + offset + 1, 0), skv) for i in range(sq))


def prefill_flops(batch: int, sq: int, skv: int, hq: int, dqk: int, dv: int, causal: bool,
          causal_alignment: str = "bottom_right") -> int:
    """The unmasked work the benchmark's TFLOP/s counts: 2 · (Dqk + Dv) per visible (query, key) pair and head."""
    return 2 * (dqk + dv) * batch * hq * visible_pairs(sq, skv, causal, causal_alignment)


# ---------------------------------------------------------------------------------------------- compile only
def compile_prefill(plan: PrefillPlan, dtype: Any = nvfly.bf16, batch: int = 2, sq: int = 1000, skv: int = 1000,
                    heads: int = 4, kv_heads: int = 2, return_lse: bool = True, target: str = "sm_90a") -> Any:
    """The prefill kernel for ``plan`` compiled without a GPU (a CompiledKernel)."""
    from nvfly.runtime.tensor_desc import TensorDesc
    q_box, kv_box = _boxes(plan, dtype)
    q = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, sq, heads, plan.dqk)), q_box, SWIZZLE)
    k = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, skv, kv_heads, plan.dqk)), kv_box, SWIZZLE)
    v = nvfly.TmaDescriptor(TensorDesc(dtype, (batch, skv, kv_heads, plan.dv)), kv_box, SWIZZLE)
    out = TensorDesc(dtype, (batch, sq, heads, plan.dv))
    lse = TensorDesc(nvfly.f32, (batch, heads, sq)) if return_lse else None
    return attention_prefill_kernel.compile(q, k, v, out, lse, sq, skv, heads // kv_heads, skv - sq, 0.18, PLAN=plan,
                                            block=plan.threads, target=target)
