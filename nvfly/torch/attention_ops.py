"""Attention from PyTorch: the ``nvfly::attention_decode`` and ``nvfly::attention_prefill`` custom ops and the
eager SDPA route (docs/torch-attention.md).

- ``torch.ops.nvfly.attention_decode(q, k_cache, v_cache, cache_seqlens=None, block_table=None, *, scale=None,
  causal=True, k_scale=None, v_scale=None, attn_mask=None) -> (out, lse)``: ``nvfly.ops.attention.decode`` (q (B, Sq, Hq, D),
  caches (B, S, Hkv, D) or paged, bottom-right causal: the queries are the last Sq positions) with its LSE,
  (B, Hq, Sq) float32 in natural log: the layout and base of torch's flash/flex logsumexp. The fake runs decode's
  argument checks (``check_arguments``), so tracing refuses what a call refuses, with the same error. Inputs the
  kernel declines (a CPU tensor, unaligned rows) and kernel failures are computed by the float32 reference in
  torch; argument errors are raised. No backward.
- ``torch.ops.nvfly.attention_prefill(q, k, v, attn_mask=None, *, causal=False, scale=None,
  causal_alignment="bottom_right") -> (out, lse)``: ``nvfly.ops.attention.prefill`` with its LSE (same convention);
  the fake runs prefill's argument checks; declined inputs and kernel failures are computed by the float32
  reference. Differentiable in q, k, v: the backward is torch's own flash or memory-efficient kernel fed this out
  and LSE (``attention_backward``; with a mask, autograd through the float32 reference).
- Both ops take SDPA's ``attn_mask`` (boolean: True keeps the key; or additive, added to the scaled score) over
  (B, Hq, Sq, Skv), broadcast by size-1 dimensions, read by the kernel as the eager route reads it (below); the
  compiled SDPA rewrite passes the graph's mask there.
- Under ``nvfly.torch.routing()``, ``F.scaled_dot_product_attention`` with q (B, Hq, Sq, D) and k/v
  (B, Hkv, Skv, D) runs decode (Sq <= 16) or prefill (Sq > 16, top-left causal as torch's ``is_causal``) on the
  (B, S, H, D) views of the (B, H, S, D) tensors when ``sdpa_eligibility`` finds nothing against it, and torch's
  SDPA otherwise, with the reason logged and kept in ``nvfly.torch.gemm_ops.decisions()`` (once per signature). A
  call that needs gradients runs prefill in an autograd.Function whose backward is torch's kernel on nvfly's LSE.
  An exception in nvfly falls back to torch's SDPA and declines that signature from then on. A boolean or
  additive ``attn_mask`` is read by the kernel: a cached mask_mod/score_mod per mask kind (boolean or additive, its
  broadcast pattern) that takes the call's mask as its tensor argument (``captured=``), so no call recompiles.

The route sits on ``aten::scaled_dot_product_attention``, torch's composite (not on the flash/cuDNN kernels it
picks), so it sees the caller's arguments: masks, dropout, ``is_causal`` and ``enable_gqa`` mean what torch
says. Its kernels are registered for ``AutogradCUDA`` (a call that needs gradients reaches it there) and ``CUDA``
(what ``torch.inference_mode`` reaches), both falling through to the composite.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from nvfly import settings
from nvfly.ops import attention
from nvfly.ops.attention import prefill_api
from nvfly.ops.attention.api import check_arguments, current_plan_options, is_mla
from nvfly.ops.attention import mods
from nvfly.ops.attention.kv_options import OP
from nvfly.ops.attention.plan import MAX_SQ
from nvfly.ops.attention.prefill_plan import BLOCK_M
from nvfly.ops.common.opcall import OpCalls
from nvfly.runtime.torch_args import layout_key
from nvfly.torch import routing
from nvfly.torch.attention_backward import attention_backward, why_no_backward
from nvfly.torch.gemm_ops import Decision, record
from nvfly.torch.library import operator, register_fake

log = logging.getLogger("nvfly")

SDPA = "aten::scaled_dot_product_attention"

# Routing rule, measured on the H200 (benchmarks/results/attention_decode_h200.json, torch 2.11): at Sq >= 2
# torch's kernels run each query head over its KV head's keys (flash and cuDNN 0.46-0.56 TB/s at Sq = 4, 48/8,
# 32K, nvfly 4.2: 7.5-9x), at Sq = 1 flash packs the group like nvfly does (nvfly 1.03-1.5x flash) and cuDNN
# is within 4% of nvfly either way (attention_decode_full/_pdl_h200.json: 0.96-1.02x, the B1 rows 1.01x since the
# fix-up combine), which does not pay for nvfly's host path: Sq = 1 stays with cuDNN where torch picks it. Below
# MIN_KV_BYTES of K and V a call moves less than ~4 us of HBM traffic: launch-bound either way, and nvfly's Python
# host path (~6-11 us a launch, launch_overhead_h200.json) would cost more than the bandwidth it saves.
MIN_KV_BYTES = 16 << 20
# Prefill (Sq > 16) below this much work takes under ~8 us at cuDNN's 500-600 TFLOP/s (anchors.md): launch-bound,
# where nvfly's host path (6-11 us a launch, launch_overhead_h200.json) would cost more than its kernel saves.
MIN_PREFILL_FLOPS = 4e9
# Prefill runs one CTA per (batch, query head, 128 query rows) and does not split the keys; below one wave of the
# H200's 132 SMs most of the GPU idles, where torch's flash splits the keys (its split-KV forward) and cuDNN tiles
# finer. The measured prefill shapes (0.91x cuDNN, 1.54x flash) all had more tiles than that.
MIN_PREFILL_TILES = 132
_FLOATS = (torch.bfloat16, torch.float16)
_MASK_DIMS = ("batch", "heads", "query", "key")


# ---------------------------------------------------------------------------------------------- the custom op
@operator("attention_decode")
def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor] = None,
                     block_table: Optional[Tensor] = None, *, scale: Optional[float] = None, causal: bool = True,
                     k_scale: Optional[Tensor] = None, v_scale: Optional[Tensor] = None,
                     attn_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out (B, Sq, Hq, Dv) in q's dtype, lse (B, Hq, Sq) float32) of ``nvfly.ops.attention.decode``; ``attn_mask``
    SDPA's (boolean, or additive to the scaled score) over (B, Hq, Sq, Skv), broadcast by size-1 dimensions, with a
    contiguous cache of Skv keys."""
    options = _checked_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, attn_mask)
    options.update(_mask_mods(attn_mask, decode=True))
    reason = attention.eligibility(q, k_cache, v_cache, **options)
    if reason is None:
        try:
            return attention.decode(q, k_cache, v_cache, scale=scale, causal=causal, return_lse=True, **options)
        except Exception as exc:
            if isinstance(exc, (TypeError, ValueError)) and str(exc).startswith(OP + ": "):
                raise  # an argument error (lengths or pages out of range): the caller's
            reason = f"nvfly raised {type(exc).__name__}: {exc}"  # a compile or launch failure: torch computes it
        log.warning("nvfly: attention_decode: %s; computed by the float32 reference in torch", reason)
    else:
        log.debug("nvfly: attention_decode computed by the float32 reference in torch: %s", reason)
    out, lse = attention.reference(q, k_cache, v_cache, scale=scale, causal=causal, **options)
    return out.to(q.dtype), lse


def _attention_decode_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor] = None,
                           block_table: Optional[Tensor] = None, *, scale: Optional[float] = None,
                           causal: bool = True, k_scale: Optional[Tensor] = None,
                           v_scale: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None
                           ) -> tuple[Tensor, Tensor]:
    _checked_decode(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale, attn_mask)
    batch, sq, hq, _ = q.shape
    return q.new_empty((batch, sq, hq, v_cache.shape[3])), q.new_empty((batch, hq, sq), dtype=torch.float32)


register_fake("attention_decode", _attention_decode_fake)


def _checked_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                    block_table: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
                    attn_mask: Optional[Tensor]) -> dict:
    """decode's argument checks and the mask's (the op and its fake alike): decode's keyword options."""
    options = {"cache_seqlens": cache_seqlens, "block_table": block_table, "k_scale": k_scale, "v_scale": v_scale}
    check_arguments(q, k_cache, v_cache, **options)
    _check_mask("attention_decode", q, k_cache, attn_mask, options)
    return options


def _check_mask(op: str, q: Tensor, k: Tensor, attn_mask: Optional[Tensor], options: Optional[dict] = None) -> None:
    """An op's ``attn_mask`` as SDPA takes it over (B, Hq, Sq, Skv) of the (B, S, H, D) q and k (decode: a contiguous
    cache whose every key takes part), else a TypeError/ValueError naming it."""
    if attn_mask is None:
        return
    if options and any(options.get(name) is not None for name in ("cache_seqlens", "block_table")):
        raise ValueError(f"nvfly.{op}: attn_mask: takes a contiguous cache without cache_seqlens (SDPA's keys: "
                         "the mask has a column per key)")
    reason = _mask_reason(q.transpose(1, 2), k.transpose(1, 2), attn_mask, False, False)
    if reason is not None:
        raise (TypeError if "dtype" in reason else ValueError)(f"nvfly.{op}: {reason}")


def _check_prefill(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], causal_alignment: str) -> None:
    """prefill's argument checks, and 16-bit inputs: this op's out is in q's dtype and it takes no descales
    (fp8 prefill is ``nvfly.ops.attention.prefill``'s)."""
    prefill_api._check(q, k, v, scale, causal_alignment)
    if q.dtype not in _FLOATS:
        raise TypeError(f"nvfly.attention_prefill: q: dtype {q.dtype}: this op takes bfloat16 or float16 (fp8 "
                        "prefill, with its descales and bfloat16 out, is nvfly.ops.attention.prefill)")


@operator("attention_prefill")
def attention_prefill(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, *, causal: bool = False,
                      scale: Optional[float] = None, causal_alignment: str = "bottom_right") -> tuple[Tensor, Tensor]:
    """(out (B, Sq, Hq, Dv) in q's dtype, lse (B, Hq, Sq) float32) of ``nvfly.ops.attention.prefill``; differentiable
    in q, k and v through torch's backward kernels fed this LSE (``nvfly.torch.attention_backward``; with
    ``attn_mask``, SDPA's boolean or additive mask over (B, Hq, Sq, Skv), through the float32 reference)."""
    _check_prefill(q, k, v, scale, causal_alignment)
    _check_mask("attention_prefill", q, k, attn_mask)
    masking = _mask_mods(attn_mask)
    reason = attention.prefill_eligibility(q, k, v, scale=scale, causal_alignment=causal_alignment, **masking)
    if reason is None:
        try:
            return attention.prefill(q, k, v, causal=causal, scale=scale, return_lse=True,
                                     causal_alignment=causal_alignment, **masking)
        except Exception as exc:
            reason = f"nvfly raised {type(exc).__name__}: {exc}"  # a compile or launch failure: torch computes it
        log.warning("nvfly: attention_prefill: %s; computed by the float32 reference in torch", reason)
    else:
        log.debug("nvfly: attention_prefill computed by the float32 reference in torch: %s", reason)
    out, lse = attention.prefill_reference(q, k, v, causal=causal, scale=scale, causal_alignment=causal_alignment,
                                           **masking)
    return out.to(q.dtype), lse


def _attention_prefill_fake(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None, *,
                            causal: bool = False, scale: Optional[float] = None,
                            causal_alignment: str = "bottom_right") -> tuple[Tensor, Tensor]:
    _check_prefill(q, k, v, scale, causal_alignment)
    _check_mask("attention_prefill", q, k, attn_mask)
    batch, sq, hq, _ = q.shape
    return q.new_empty((batch, sq, hq, v.shape[3])), q.new_empty((batch, hq, sq), dtype=torch.float32)


def _prefill_setup(ctx: Any, inputs: tuple, keyword_only_inputs: dict, output: tuple[Tensor, Tensor]) -> None:
    out, lse = output
    ctx.save_for_backward(*inputs, out, lse)
    ctx.options = dict(keyword_only_inputs)
    ctx.mark_non_differentiable(lse)


def _prefill_backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> tuple:
    q, k, v, mask, out, lse = ctx.saved_tensors
    return (*attention_backward(grad_out, q, k, v, out, lse, mods=_mask_mods(mask), **ctx.options), None)


register_fake("attention_prefill", _attention_prefill_fake)
torch.library.register_autograd("nvfly::attention_prefill", _prefill_backward, setup_context=_prefill_setup)


# ---------------------------------------------------------------------------------------------- SDPA routing
_SDPA_DECIDED: OpCalls[tuple[Optional[str]]] = OpCalls()  # signature -> (why torch runs it, or None)


def _flags() -> tuple[bool, bool, bool, bool]:
    """The SDPA backends torch may use now (``torch.nn.attention.sdpa_kernel`` changes them)."""
    b = torch.backends.cuda
    return b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled()


def _needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _signature(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, enable_gqa: bool, grad: bool,
               mask: Optional[Tensor] = None) -> tuple:
    masked = None if mask is None else (layout_key(mask), mask.requires_grad and torch.is_grad_enabled())
    return layout_key(q), layout_key(k), layout_key(v), bool(is_causal), bool(enable_gqa), grad, _flags(), masked


def sdpa_eligibility(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                     dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
                     enable_gqa: bool = False) -> Optional[str]:
    """None when the routed SDPA runs nvfly (decode for Sq <= 16, prefill above) for these arguments, else why
    torch's SDPA runs them. The arguments are ``aten::scaled_dot_product_attention``'s."""
    declined = sdpa_argument_reason(dropout_p, scale)
    if declined is not None:
        return declined
    if any(type(t) is not Tensor for t in (query, key, value)):  # FakeTensor, FunctionalTensor: a trace
        return f"q is a {type(query).__name__}, not a plain tensor (traced calls keep torch's SDPA)"
    if attn_mask is not None and type(attn_mask) is not Tensor:
        return f"attn_mask is a {type(attn_mask).__name__}, not a plain tensor (torch's SDPA takes it)"
    grad = _needs_grad(query, key, value)
    signature = _signature(query, key, value, is_causal, enable_gqa, grad, attn_mask)
    decided = _SDPA_DECIDED.get(signature)
    if decided is None:
        reason = _sdpa_reason(query, key, value, bool(is_causal), bool(enable_gqa), grad, mask=attn_mask)
        decided = (reason,)
        _SDPA_DECIDED.remember(signature, decided)
        _record(query, key, value, is_causal, enable_gqa, reason, attn_mask)
    return decided[0]


def sdpa_argument_reason(dropout_p: float = 0.0, scale: Optional[float] = None) -> Optional[str]:
    """Why torch's SDPA runs a call with this dropout and scale whatever its tensors, or None."""
    if dropout_p != 0.0:
        return f"dropout_p={dropout_p} (nvfly has no dropout)"
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return f"scale={scale!r} (nvfly's kernels take a positive finite scale)"
    return None


def _sdpa_reason(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, enable_gqa: bool, grad: bool,
                 backend: Optional[str] = None, mask: Optional[Tensor] = None) -> Optional[str]:
    """Why torch's SDPA runs these inputs, or None (nvfly runs them); ``backend``: what torch picks for them, when
    known (a compiled graph names it), else asked of torch (with ``mask``, SDPA's attn_mask) when the rule needs
    it."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return (f"q, k, v are not all 4-D (B, H, S, D): shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}")
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not CUDA"
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: nvfly's attention takes bfloat16 or float16, all alike"
    batch, hq, sq, _ = q.shape
    _, hkv, skv, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch or v.shape[1] != hkv or v.shape[2] != skv:
        return (f"k {tuple(k.shape)} and v {tuple(v.shape)} do not share q's batch {batch} and each other's heads "
                "and length (torch broadcasts or refuses them)")
    if hq != hkv and not enable_gqa:
        return f"{hq} query heads, {hkv} KV heads without enable_gqa (torch's own behaviour)"
    if hq % hkv:
        return f"{hq} query heads are not a multiple of {hkv} KV heads"
    flash, efficient, cudnn, _ = _flags()
    if not (flash or efficient or cudnn):
        return "torch.nn.attention.sdpa_kernel allows only the math backend (kept as asked)"
    if mask is not None:
        declined = _mask_reason(q, k, mask, is_causal, grad)
        if declined is not None:
            return declined
    picks = (lambda: backend) if backend else (lambda: _torch_backend(q, k, v, enable_gqa, is_causal, mask))
    if sq <= MAX_SQ:
        return _decode_reason(q, k, v, is_causal, grad, picks, mask)
    return _prefill_reason(q, k, v, is_causal, grad, picks, mask)


def _mask_reason(q: Tensor, k: Tensor, mask: Tensor, is_causal: bool, grad: bool) -> Optional[str]:
    """Why nvfly cannot read this attn_mask as torch means it, or None."""
    if is_causal:
        return "attn_mask with is_causal=True (torch refuses the pair)"
    if mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return (f"attn_mask of dtype {mask.dtype}: nvfly reads a boolean mask or an additive one of float32 or q's "
                f"dtype {q.dtype}, what torch takes (torch refuses the rest)")
    if mask.device != q.device:
        return f"attn_mask on {mask.device}, q on {q.device}"
    if mask.requires_grad and torch.is_grad_enabled():
        return "attn_mask requires grad (nvfly's kernels have no gradient for a bias)"
    if grad:
        return "an input requires grad with an attn_mask (no backward of nvfly's route reads the mask yet)"
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if not 2 <= mask.dim() <= 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])):
        return (f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (B, Hq, Sq, Skv) = {target} by "
                "size-1 dimensions, as 2 to 4 dimensions (torch broadcasts or refuses it)")
    return None


def _mask_operand(mask: Tensor) -> tuple[Tensor, tuple[bool, ...]]:
    """SDPA's attn_mask as the kernel reads it: 4-D, broadcast dimensions (size 1 or stride 0) cut to size 1,
    booleans viewed as bytes (no copy), and which of its four dimensions vary."""
    four = mask
    while four.dim() < 4:
        four = four.unsqueeze(0)
    varies = tuple(four.shape[d] != 1 and four.stride(d) != 0 for d in range(4))
    for d in range(4):
        if not varies[d]:
            four = four.narrow(d, 0, 1)
    return (four.view(torch.uint8) if four.dtype == torch.bool else four), varies


def _mask_mods(mask: Optional[Tensor], decode: bool = False) -> dict:
    """The mods keywords of nvfly's decode/prefill for SDPA's attn_mask: a cached mask_mod (boolean) or score_mod
    (additive: added to the scaled score, as torch adds it to q·kᵀ·scale) per broadcast pattern, the mask its tensor
    argument. In ``decode`` a mask with a row per query is read at the query's row, its position at the end of the
    keys minus Skv - Sq (decode's q_idx is the position)."""
    if mask is None:
        return {}
    operand, varies = _mask_operand(mask)
    rows_at_end = decode and varies[2]
    if mask.dtype == torch.bool:
        return {"mask_mod": mods.tensor_mask(varies, rows_at_end), "captured": (operand,)}
    return {"score_mod": mods.tensor_bias(varies, rows_at_end), "captured": (operand,)}


def _bshd(t: Tensor) -> Tensor:
    """The (B, S, H, D) view the kernels' checks read, detached: a check records no autograd (a graph pass's stand-in
    for a CUDA tensor that requires grad has no device to accumulate a gradient on)."""
    return t.detach().transpose(1, 2)


def _decode_reason(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, grad: bool,
                   picks: Callable[[], str], mask: Optional[Tensor] = None) -> Optional[str]:
    """Sq <= 16: nvfly's decode, or why not."""
    batch, hq, sq, dqk = q.shape
    _, hkv, skv, _ = k.shape
    if grad:
        return (f"an input requires grad at Sq = {sq} (nvfly's decode has no backward: torch's SDPA keeps autograd; "
                f"prefill's backward route starts above Sq = {MAX_SQ})")
    if is_causal and sq != skv:
        return (f"is_causal=True with Sq = {sq} < Skv = {skv}: torch's causal mask is top-left aligned (query i sees "
                "keys 0..i), nvfly's decode aligns the queries to the end of the keys (a decode step passes "
                "is_causal=False)")
    kv_bytes = batch * skv * hkv * (dqk + v.shape[3]) * q.element_size()
    if kv_bytes < MIN_KV_BYTES:
        return (f"{kv_bytes / 2**20:.1f} MiB of K and V (< {MIN_KV_BYTES >> 20} MiB): launch-bound, where nvfly's "
                "host path costs more than its bandwidth saves")
    if mask is not None and sq > 1 and _mask_operand(mask)[1][2:] == (True, False):
        return (f"attn_mask with a row per query but none per key at Sq = {sq}: nvfly's decode finds a query's row "
                "from the mask's key extent (its position at the end of the keys minus Skv - Sq)")
    if sq == 1 and not settings.get("routing_sdpa_cudnn_sq1") and picks() == "cudnn":
        return ("Sq = 1 and torch picks cuDNN, measured within 4% of nvfly's decode at Sq = 1 on the H200 (not "
                "worth nvfly's host path)")
    declined = attention.eligibility(_bshd(q), _bshd(k), _bshd(v), **_mask_mods(mask, decode=True))
    return None if declined is None else f"nvfly's decode declines: {declined}"


def _prefill_reason(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, grad: bool,
                    picks: Callable[[], str], mask: Optional[Tensor] = None) -> Optional[str]:
    """Sq > 16: nvfly's prefill (top-left causal: torch's is_causal), or why not."""
    batch, hq, sq, dqk = q.shape
    skv, dv = k.shape[2], v.shape[3]
    flops = attention.prefill_flops(batch, sq, skv, hq, dqk, dv, is_causal, "top_left")
    if flops < MIN_PREFILL_FLOPS:
        return (f"{flops / 1e9:.2f} GFLOP (< {MIN_PREFILL_FLOPS / 1e9:.0f}): launch-bound, where nvfly's host path "
                "costs more than its faster kernel saves")
    tiles = batch * hq * -(-sq // BLOCK_M)
    if tiles < MIN_PREFILL_TILES:
        return (f"{tiles} query tiles of {BLOCK_M} rows (< {MIN_PREFILL_TILES}, one wave of the H200's SMs): nvfly's "
                "prefill does not split the keys, torch's kernels do")
    qs, ks, vs = _bshd(q), _bshd(k), _bshd(v)
    declined = attention.prefill_eligibility(qs, ks, vs, causal_alignment="top_left", **_mask_mods(mask))
    if declined is not None:
        return f"nvfly's prefill declines: {declined}"
    if grad:
        missing = why_no_backward(qs, ks, vs, is_causal, "top_left")
        if missing is not None:
            return f"an input requires grad and no torch backward takes nvfly's LSE here: {missing}"
    if picks() == "cudnn":
        return ("torch picks cuDNN, measured faster than nvfly's prefill (0.91x cuDNN's TFLOP/s on the H200; nvfly "
                "runs where torch would pick flash, 1.54x, memory-efficient or math)")
    return None


def _torch_backend(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, is_causal: bool = False,
                   mask: Optional[Tensor] = None) -> str:
    """The SDPA backend torch picks for these inputs and attn_mask (without dropout): "cudnn", "flash", ...

    Fake tensors (a compiled graph's, in nvfly's pre-grad pass) cannot ask torch's choice op: under FakeTensorMode it
    answers "math" where the real tensors get cuDNN (measured on the H200; the compiled training rewrite took nvfly's
    prefill where eager keeps cuDNN). For them torch's priority order is walked with its per-backend checks, which
    read sizes, strides, dtypes and the fake device without dispatching, as its CUDA choice walks them."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.attention import SDPBackend
    if isinstance(q, FakeTensor):
        choice = _walked_choice(q, k, v, mask, is_causal, enable_gqa)
    else:
        choice = int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, scale=None, enable_gqa=enable_gqa))
    return {SDPBackend.CUDNN_ATTENTION.value: "cudnn", SDPBackend.FLASH_ATTENTION.value: "flash",
            SDPBackend.EFFICIENT_ATTENTION.value: "efficient", SDPBackend.MATH.value: "math"}.get(choice, "other")


def _walked_choice(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool,
                   enable_gqa: bool) -> int:
    """torch's SDPA choice (an ``SDPBackend`` value) from its priority order and its per-backend checks."""
    from torch.backends import cuda as backends
    from torch.nn.attention import SDPBackend
    params = backends.SDPAParams(q, k, v, mask, 0.0, is_causal, enable_gqa)
    checks = {SDPBackend.CUDNN_ATTENTION.value: backends.can_use_cudnn_attention,
              SDPBackend.FLASH_ATTENTION.value: backends.can_use_flash_attention,
              SDPBackend.EFFICIENT_ATTENTION.value: backends.can_use_efficient_attention,
              SDPBackend.MATH.value: lambda _: backends.math_sdp_enabled()}
    for backend in torch._C._get_sdp_priority_order():
        check = checks.get(int(backend))
        if check is not None and check(params):
            return int(backend)
    return SDPBackend.ERROR.value


def _kernel(q: Tensor) -> str:
    """The nvfly kernel an eligible SDPA call runs: decode up to Sq = 16 query tokens, prefill above."""
    return "decode" if q.shape[2] <= MAX_SQ else "prefill"


def _record(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, enable_gqa: bool, reason: Optional[str],
            mask: Optional[Tensor] = None) -> None:
    four_d = q.dim() == k.dim() == v.dim() == 4
    shape = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]) if four_d \
        else tuple(q.shape)
    problem = (f"q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} {q.dtype} on {q.device} "
               f"is_causal={bool(is_causal)} enable_gqa={bool(enable_gqa)}"
               + ("" if mask is None else f" attn_mask {tuple(mask.shape)} {mask.dtype}"))
    candidates = () if reason or not four_d else (_kernel(q),)
    record(Decision("eager", "sdpa", shape, problem, reason=reason, candidates=candidates))


class _PrefillSDPA(torch.autograd.Function):
    """SDPA (top-left causal) by nvfly's prefill, gradients by torch's backward kernels on nvfly's LSE; on the
    (B, S, H, D) views of SDPA's (B, H, S, D) tensors."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float]) -> Tensor:
        out, lse = attention.prefill(q, k, v, causal=causal, scale=scale, return_lse=True,
                                     causal_alignment="top_left")
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale,
                                        causal_alignment="top_left")
        return dq, dk, dv, None, None


def sdpa_run(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
             dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
             enable_gqa: bool = False) -> Tensor:
    """SDPA by nvfly's decode or prefill on the (B, S, H, D) views; an exception declines this signature from now
    on (and routing runs torch's SDPA for the call)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    try:
        masking = _mask_mods(attn_mask, decode=_kernel(query) == "decode")
        if _kernel(query) == "decode":
            out = attention.decode(q, k, v, scale=scale, causal=bool(is_causal), validate=False, **masking)
        elif _needs_grad(query, key, value):  # never with a mask (declined)
            out = _PrefillSDPA.apply(q, k, v, bool(is_causal), scale)
        else:
            out = attention.prefill(q, k, v, causal=bool(is_causal), scale=scale, causal_alignment="top_left",
                                    **masking)
    except Exception as exc:
        _run_failed(query, key, value, is_causal, enable_gqa, attn_mask, exc)
        raise
    return out.transpose(1, 2)  # (B, Hq, Sq, Dv) over (B, Sq, Hq, Dv) memory, as torch's flash and cuDNN return


def _run_failed(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, enable_gqa: bool,
                attn_mask: Optional[Tensor], exc: Exception) -> None:
    """Decline the signature of a call nvfly failed on (the caller then runs torch's SDPA), and record why."""
    reason = f"nvfly raised {type(exc).__name__}: {exc}"
    signature = _signature(query, key, value, is_causal, enable_gqa, _needs_grad(query, key, value), attn_mask)
    _SDPA_DECIDED.remember(signature, (reason,))
    _record(query, key, value, is_causal, enable_gqa, reason, attn_mask)


def sdpa_bind(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False) -> Callable[..., Tensor]:
    """The route's ``bind``: what runs the calls of an accepted signature. Decode without a mask (a model's decode
    and speculative steps) runs ``attention.bound_decode``'s launches on SDPA's (B, H, S, D) tensors as they are:
    decode's checks, plan and signature made once here, no transposes a call; other calls run ``sdpa_run``."""
    if attn_mask is not None or _kernel(query) != "decode" or is_mla(query, key):
        return sdpa_run
    try:
        launch = attention.bound_decode(query, key, value, causal=bool(is_causal), heads_first=True)
    except Exception as exc:
        _run_failed(query, key, value, is_causal, enable_gqa, attn_mask, exc)
        raise

    def runs(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
             is_causal: bool = False, *, scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
        try:
            return launch(query, key, value, scale)
        except Exception as exc:
            _run_failed(query, key, value, is_causal, enable_gqa, attn_mask, exc)
            raise
    return runs


def sdpa_skip(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False) -> bool:
    """The route's ``skip``: the launch-bound calls the rule declines whatever else they hold (or a check before the
    rule declines them): decode (4-D q, Sq <= 16) over less than MIN_KV_BYTES of K and V (their bytes are
    ``_decode_reason``'s ``kv_bytes`` whenever the checks before it pass), prefill under MIN_PREFILL_FLOPS
    (``_prefill_reason``'s count)."""
    if query.dim() != 4:
        return False
    batch, hq, sq, dqk = query.shape
    if sq <= MAX_SQ:
        return key.nbytes + value.nbytes < MIN_KV_BYTES
    skv = key.shape[-2]
    # attention.prefill_flops's top-left causal count in closed form (it sums over the rows: O(Sq) a call)
    pairs = (sq * (sq + 1) // 2 if sq <= skv else skv * (skv + 1) // 2 + (sq - skv) * skv) if is_causal else sq * skv
    return 2 * (dqk + value.shape[-1]) * batch * hq * pairs < MIN_PREFILL_FLOPS


def forget_decisions() -> None:
    """Decide every SDPA signature again (tests start from none); the routes' too."""
    _SDPA_DECIDED.clear()
    routing.forget_decisions()


_SDP_ENABLED = (torch._C._get_flash_sdp_enabled, torch._C._get_mem_efficient_sdp_enabled,
                torch._C._get_cudnn_sdp_enabled, torch._C._get_math_sdp_enabled)  # _flags' readings, unwrapped


def sdpa_signature(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                   dropout_p: float = 0.0, is_causal: bool = False, *, scale: Optional[float] = None,
                   enable_gqa: bool = False) -> tuple:
    """The route's signature: what ``sdpa_eligibility`` reads (``_signature``'s parts, the front checks' arguments
    and types) and the decode plan options ``sdpa_bind``'s launches were planned with, in reads that cost least."""
    tensor_key, decode_options = routing.tensor_key, current_plan_options
    flash, efficient, cudnn, math_ = _SDP_ENABLED
    grad = torch.is_grad_enabled()
    masked = None if attn_mask is None else (tensor_key(attn_mask), type(attn_mask), grad and attn_mask.requires_grad)
    return (tensor_key(query), tensor_key(key), tensor_key(value), type(query), type(key), type(value), masked,
            grad and (query.requires_grad or key.requires_grad or value.requires_grad), dropout_p, scale,
            is_causal, enable_gqa, flash(), efficient(), cudnn(), math_(), decode_options())


for _key in ("AutogradCUDA", "CUDA"):
    routing.register_route(SDPA, sdpa_eligibility, sdpa_run, _key, signature=sdpa_signature, skip=sdpa_skip,
                           bind=sdpa_bind)
