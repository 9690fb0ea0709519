"""Attention gradients by torch's own backward kernels, fed nvfly's forward output and log-sum-exp.

nvfly's prefill returns LSE (B, Hq, Sq) float32 in natural log, -inf for a row that sees no key: the layout and base
of the logsumexp torch's flash-attention forward saves (FlashAttention-2's ``softmax_lse``; a key-less row is +inf
there, so -inf is mapped to +inf: P = exp(s - lse) is then 0, not NaN). The memory-efficient kernel's logsumexp is
also natural log, (B, H, Sq) padded to a multiple of 32 query rows. So a training step runs the forward in nvfly and
``torch.ops.aten._scaled_dot_product_flash_attention_backward`` (or ``_efficient_attention_backward``) for dq, dk, dv:

- flash (preferred: GQA native, the fastest of torch's backward kernels that take a given LSE): Dqk = Dv, a multiple
  of 8 up to 256, and the causal mask bottom-right aligned (FlashAttention-2's convention), which is torch's top-left
  one too when Sq = Skv. No dropout: its philox seed and offset are read only with dropout, so empty tensors do.
- memory-efficient (anything else on CUDA: Dqk ≠ Dv such as DeepSeek's 192/128, top-left causal with Sq ≠ Skv through
  its ``custom_mask_type`` 1, bottom-right 2): it takes as many KV heads as query heads, so k and v are expanded
  (a view) and the group's key and value gradients summed.
- on CPU (no GPU; the tests' path): ``_scaled_dot_product_flash_attention_for_cpu_backward``, top-left causal, LSE
  (B, H, Sq) over (B, Sq, H) memory, equal heads (k and v expanded as for the memory-efficient kernel), Dqk = Dv.

All take q (B, Sq, Hq, D), k and v (B, Skv, Hkv, D), out (B, Sq, Hq, Dv): the nvfly ops' layout.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

log = logging.getLogger("nvfly")

EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel's logsumexp is padded to a multiple of this many query rows
NO_MASK, TOP_LEFT, BOTTOM_RIGHT = 0, 1, 2  # _efficient_attention_backward's custom_mask_type


def backward_kernel(q: Tensor, k: Tensor, v: Tensor, causal: bool, causal_alignment: str) -> Optional[str]:
    """Which torch backward computes these gradients from nvfly's LSE: "flash", "efficient" or "cpu_flash"; None
    when none does (``why_no_backward`` says why)."""
    sq, skv = q.shape[1], k.shape[1]
    dqk, dv = q.shape[3], v.shape[3]
    if q.device.type == "cpu":
        top_left = not causal or sq == skv or causal_alignment == "top_left"
        return "cpu_flash" if top_left and dqk == dv else None
    if q.device.type != "cuda":
        return None
    bottom_right = not causal or sq == skv or causal_alignment == "bottom_right"
    if dqk == dv and dqk % 8 == 0 and dqk <= 256 and bottom_right:
        return "flash"
    if dqk % 8 == 0 and dv % 8 == 0:
        return "efficient"
    return None


def why_no_backward(q: Tensor, k: Tensor, v: Tensor, causal: bool, causal_alignment: str) -> Optional[str]:
    """None when ``backward_kernel`` finds one, else why no torch backward takes nvfly's LSE here."""
    if backward_kernel(q, k, v, causal, causal_alignment) is not None:
        return None
    if q.device.type == "cpu":
        return ("on CPU only equal head dims and top-left causal (or Sq = Skv) gradients are computed (torch's CPU "
                "flash backward)")
    if q.device.type != "cuda":
        return f"q is on {q.device.type}: torch's attention backward kernels run on CUDA"
    return (f"head dims {q.shape[3]}/{v.shape[3]} are not multiples of 8 (torch's flash and memory-efficient "
            "backward kernels need them)")


def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                       causal: bool, scale: Optional[float], causal_alignment: str, mods: Optional[dict] = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of softmax(q kᵀ scale) v by torch's backward kernels, from nvfly's ``out`` and ``lse``. Should
    torch's kernel refuse them at run time, the gradients are computed by autograd through the float32 reference
    instead (slow, never wrong; a warning says why); while tracing, the error is raised. ``mods``: the forward's
    score_mod / mask_mod keywords (SDPA's attn_mask), which no torch kernel fed nvfly's LSE applies: the
    reference computes those gradients."""
    if mods:
        return _by_reference(grad_out, q, k, v, causal, scale, causal_alignment, mods)
    try:
        return _by_torch_kernel(grad_out, q, k, v, out, lse, causal, scale, causal_alignment)
    except Exception as exc:
        if any(type(t) is not Tensor for t in (grad_out, q, k, v)):  # FakeTensor, FunctionalTensor: a trace
            raise
        log.warning("nvfly: attention backward: torch's kernel raised %s: %s; the gradients are computed through "
                    "the float32 reference", type(exc).__name__, exc)
    return _by_reference(grad_out, q, k, v, causal, scale, causal_alignment)


def _by_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float],
                  causal_alignment: str, mods: Optional[dict] = None) -> tuple[Tensor, Tensor, Tensor]:
    from nvfly.ops.attention import prefill_reference
    with torch.enable_grad():
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out, _ = prefill_reference(*leaves, causal=causal, scale=scale, causal_alignment=causal_alignment,
                                   **(mods or {}))
        grads = torch.autograd.grad(out, leaves, grad_out.float())
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))  # type: ignore[return-value]


def _by_torch_kernel(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                     scale: Optional[float], causal_alignment: str) -> tuple[Tensor, Tensor, Tensor]:
    kernel = backward_kernel(q, k, v, causal, causal_alignment)
    if kernel is None:
        raise NotImplementedError("nvfly attention backward: " + str(why_no_backward(q, k, v, causal,
                                                                                      causal_alignment)))
    lse = torch.where(lse == float("-inf"), float("inf"), lse)  # key-less rows: P = exp(s - lse) = 0
    if kernel == "flash":
        return _flash(grad_out, q, k, v, out, lse, causal, scale)
    hq, hkv = q.shape[2], k.shape[2]
    group = hq // hkv
    k_full, v_full = (_expand_heads(k, group), _expand_heads(v, group)) if group > 1 else (k, v)
    if kernel == "efficient":
        dq, dk, dv = _efficient(grad_out, q, k_full, v_full, out, lse, causal, scale, causal_alignment)
    else:
        dq, dk, dv = _cpu_flash(grad_out, q, k_full, v_full, out, lse, causal, scale)
    if group > 1:
        dk, dv = (_sum_groups(g, hkv, group) for g in (dk, dv))
    return dq, dk, dv


def _expand_heads(t: Tensor, group: int) -> Tensor:
    """(B, S, H, D) -> (B, S, H·group, D), each head repeated ``group`` times in a row (GQA's query-head order)."""
    b, s, h, d = t.shape
    return t.unsqueeze(3).expand(b, s, h, group, d).reshape(b, s, h * group, d)


def _sum_groups(grad: Tensor, heads: int, group: int) -> Tensor:
    b, s, _, d = grad.shape
    return grad.view(b, s, heads, group, d).sum(3)


def _flash(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
           scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    sq, skv = q.shape[1], k.shape[1]
    unused = torch.empty(0, dtype=torch.int64, device=q.device)  # philox seed and offset: read only with dropout
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        lse.contiguous(), None, None, sq, skv, 0.0, causal, unused, unused, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _efficient(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
               scale: Optional[float], causal_alignment: str) -> tuple[Tensor, Tensor, Tensor]:
    batch, hq, sq = lse.shape
    rows = -(-sq // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS
    padded = lse.new_zeros(batch, hq, rows)
    padded[:, :, :sq] = lse
    mask = NO_MASK if not causal else TOP_LEFT if causal_alignment == "top_left" else BOTTOM_RIGHT
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        grad_out.contiguous(), q, k, v, None, out, None, None, sq, k.shape[1], padded, 0.0, unused, unused, mask,
        False, scale=scale)
    return dq, dk, dv


def _cpu_flash(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
               scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    # the CPU kernel's logsumexp is (B, H, Sq) over (B, Sq, H) memory
    lse_bsh = lse.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
        lse_bsh, 0.0, causal, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
