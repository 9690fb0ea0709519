"""Quantisation of bf16/fp16/fp32 tensors to fp8 with the scales ``scaled_mm`` takes, in torch (the reference the
quantisation kernels must match bit for bit in scale choice).

Scale choice (DeepGEMM's and torchao's): a group's scale is amax / FP8_MAX in fp32 (amax = max |x| over the group,
at least AMAX_FLOOR so that an all-zero group has a finite scale), and q = fp8(clamp(x / scale, -FP8_MAX,
FP8_MAX)), rounded to nearest even. Layouts are ``torch._scaled_mm``'s (see nvfly.ops.scaled.api).
"""
from __future__ import annotations

import torch

from nvfly.ops.scaled.config import SCALE_BLOCK

AMAX_FLOOR = 1e-12
GRANULARITIES = ("tensor", "row", "1x128", "128x128")


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _quantize(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for amax broadcast to x's groups (same shape as x)."""
    top = fp8_max(dtype)
    scale = amax.float().clamp_min(AMAX_FLOOR) / top
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


def quantize(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn,
             operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``x`` and its scales for ``scaled_mm``: ``operand`` "a" quantises x (M, K) and returns q (M, K)
    row-major; "b" quantises a weight x (N, K) and returns q as (K, N) column-major (``q_w.t()``) with scale_b in
    torch's layout. ``granularity``: "tensor" (one scale), "row" (per row of x: scale_a (M, 1) / scale_b (1, N)),
    "1x128" (per row and 128 k: scale_a (M, K/128), strides (1, M)) or "128x128" (per 128x128 block of the weight:
    scale_b (K/128, N/128), strides (1, K/128))."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got {x.dim()}-D")
    rows, k = x.shape
    xf = x.float()
    if granularity == "tensor":
        q, scale = _quantize(xf, xf.abs().amax(), dtype)
        scale = scale.reshape(())
    elif granularity == "row":
        q, scale = _quantize(xf, xf.abs().amax(dim=1, keepdim=True), dtype)
    else:
        kb = -(-k // SCALE_BLOCK)
        padded = torch.nn.functional.pad(xf, (0, kb * SCALE_BLOCK - k))
        if granularity == "1x128":
            amax = padded.view(rows, kb, SCALE_BLOCK).abs().amax(dim=2)                     # (rows, kb)
            q, scale = _quantize(padded, amax.repeat_interleave(SCALE_BLOCK, 1), dtype)
            scale = scale[:, ::SCALE_BLOCK]
        else:
            rb = -(-rows // SCALE_BLOCK)
            padded = torch.nn.functional.pad(padded, (0, 0, 0, rb * SCALE_BLOCK - rows))
            amax = padded.view(rb, SCALE_BLOCK, kb, SCALE_BLOCK).abs().amax(dim=(1, 3))    # (rb, kb)
            full = amax.repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
            q, scale = _quantize(padded, full, dtype)
            scale = scale[::SCALE_BLOCK, ::SCALE_BLOCK]
            q = q[:rows]
        q = q[:, :k]
    if operand == "a":
        if granularity == "1x128":
            scale = scale.t().contiguous().t()  # (M, K/128) with strides (1, M), as torch's 1x128 scale_a
        return q.contiguous(), scale if granularity != "tensor" else scale.reshape(())
    if operand != "b":
        raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    q_t = q.contiguous().t()  # (K, N) column-major
    if granularity == "row":
        return q_t, scale.reshape(1, rows)
    if granularity == "128x128":
        return q_t, scale.contiguous().t()  # (K/128, N/128) with strides (1, K/128)
    if granularity == "1x128":
        return q_t, scale.t().contiguous()  # (K/128, N) contiguous (torch's 1x128 scale_b)
    return q_t, scale
