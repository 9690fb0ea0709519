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


# ---------------------------------------------------------------------------------------------- the kernels
KERNEL_GRANULARITIES = ("row", "1x128", "128x128")
_QUANT_THREADS = 256
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_NAMES = {torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2"}


def quantize_fp8(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn,
                 operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize``'s result (the same values and scales, bit for bit, in the same layouts) from nvfly's
    memory-bound kernel: x a contiguous CUDA (rows, K) bf16/fp16/fp32 tensor, K a multiple of 16, granularity
    "row", "1x128" or "128x128" (tensor-wise scales need a global amax first: ``quantize``)."""
    from nvfly.ops.common.opcall import named
    from nvfly.ops.scaled.quantize_kernel import QuantizePlan, quantize_kernel
    with named("nvfly.ops.scaled.quantize_fp8"):
        if granularity not in KERNEL_GRANULARITIES:
            raise ValueError(f"granularity: expected one of {KERNEL_GRANULARITIES}, got {granularity!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _SOURCE_DTYPES:
            raise TypeError(f"x: expected a 2-D bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
        if not x.is_contiguous() or x.shape[1] % 16:
            raise ValueError(f"x: expected a contiguous tensor with K a multiple of 16, got shape {tuple(x.shape)} "
                             f"strides {x.stride()}")
        if dtype not in _FP8_NAMES:
            raise TypeError(f"dtype: expected float8_e4m3fn or float8_e5m2, got {dtype}")
        if operand not in ("a", "b"):
            raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
    rows, k = x.shape
    kb = -(-k // SCALE_BLOCK)
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    if granularity == "row":
        scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        plan = QuantizePlan(1, 0, False, _QUANT_THREADS, 16 // x.element_size(), _FP8_NAMES[dtype], fp8_max(dtype),
                            AMAX_FLOOR)
        blocks = rows
    elif granularity == "1x128":
        scale = torch.empty((kb, rows), dtype=torch.float32, device=x.device).t()  # (rows, kb), strides (1, rows)
        plan = QuantizePlan(1, SCALE_BLOCK, True, _QUANT_THREADS, SCALE_BLOCK // 32, _FP8_NAMES[dtype],
                            fp8_max(dtype), AMAX_FLOOR)
        blocks = -(-rows * kb // (_QUANT_THREADS // 32))
    else:
        rb = -(-rows // SCALE_BLOCK)
        scale = torch.empty((rb, kb), dtype=torch.float32, device=x.device)
        plan = QuantizePlan(SCALE_BLOCK, SCALE_BLOCK, False, _QUANT_THREADS, 16 // x.element_size(),
                            _FP8_NAMES[dtype], fp8_max(dtype), AMAX_FLOOR)
        blocks = rb * kb
    if rows and k:
        quantize_kernel[blocks, _QUANT_THREADS](x, q.view(torch.int32), scale, rows, k, PLAN=plan)
    if operand == "a":
        return q, scale
    # the weight's transposes: b (K, N) column-major; scale_b row (1, N), 1x128 (kb, N) contiguous, 128x128
    # (kb, N/128) with strides (1, kb)
    return q.t(), scale.t()
