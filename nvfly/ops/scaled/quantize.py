"""Quantisation of bf16/fp16/fp32 tensors to fp8 with the scales ``scaled_mm`` takes, in torch (the reference the
quantisation kernels must match bit for bit in scale choice).

Scale choice (DeepGEMM's and torchao's, amax / FP8_MAX): a group's scale is max(amax, AMAX_FLOOR) * (1 / FP8_MAX)
in fp32 (amax = max |x| over the group; the floor keeps an all-zero group's scale finite; a multiply by the fp32
reciprocal, because torch's CUDA division by a scalar multiplies by it, so that the torch reference computes the
same scale on CPU and GPU), and q = fp8(clamp(x / scale, -FP8_MAX, FP8_MAX)) with an IEEE division, rounded to
nearest even. Layouts are ``torch._scaled_mm``'s (see nvfly.ops.scaled.api).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from nvfly.arch.floats import E2M1_ABOVE, E2M1_AT_OR_ABOVE, e2m1_shuffled_bit_positions
from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.scaled.config import MX_BLOCK, SCALE_BLOCK
from nvfly.runtime.torch_args import layout_key

AMAX_FLOOR = 1e-12
GRANULARITIES = ("tensor", "row", "1x128", "128x128", "mx", "mxfp4")
MX_EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}  # the largest value's exponent (448 = 1.75 * 2^8)
E2M1_EMAX = 2  # 6 = 1.5 * 2^2


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _quantize(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for amax broadcast to x's groups (same shape as x)."""
    top = fp8_max(dtype)
    scale = amax.float().clamp_min(AMAX_FLOOR) * (1.0 / top)
    return (x.float() / scale).clamp(-top, top).to(dtype), scale


def _quantize_mx(xf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, e8m0 scale bytes (rows, K/32)) of float32 ``xf`` (K a multiple of 32)."""
    rows, k = xf.shape
    if k % MX_BLOCK:
        raise ValueError(f"x: K={k} is not a multiple of the MX block ({MX_BLOCK})")
    if dtype not in MX_EMAX:
        raise TypeError(f"dtype: MX elements are float8_e4m3fn or float8_e5m2, got {dtype}")
    scale, byte = _mx_scales(xf, MX_EMAX[dtype])
    top = fp8_max(dtype)
    q = (xf / scale.repeat_interleave(MX_BLOCK, 1)).clamp(-top, top).to(dtype)
    return q, byte


def _mx_scales(xf: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP's shared scales of float32 ``xf`` (rows, K) per 32 of K: 2^(floor(log2 amax) - emax) (the biased
    exponent bits of amax less emax, clamped to [0, 254]; byte 0 the subnormal 2^-127), as float32 and e8m0 bytes."""
    rows, k = xf.shape
    amax = xf.view(rows, k // MX_BLOCK, MX_BLOCK).abs().amax(dim=2)
    exponent = (amax.view(torch.int32) >> 23) & 0xFF
    byte = (exponent - emax).clamp(0, 254)
    scale = torch.where(byte == 0, torch.full_like(byte, 0x00400000), byte << 23).view(torch.float32)
    return scale, byte.to(torch.uint8)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """The OCP e2m1 codes (int64, 0-15: sign bit 3) of float32 ``y``, rounded to nearest even and saturating to
    +-6, the sign kept (-0 for small negatives)."""
    mag = y.abs()
    code = sum((mag > t).long() for t in E2M1_ABOVE) + sum((mag >= t).long() for t in E2M1_AT_OR_ABOVE)
    return code | (y.signbit().long() << 3)


def _quantize_mxfp4(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 pairs (rows, K/2) float4_e2m1fn_x2, the low nibble first; e8m0 scale bytes (rows, K/32)) of
    float32 ``xf``: OCP's scales with e2m1's emax 2, then x / scale rounded to nearest even, saturating."""
    rows, k = xf.shape
    if k % MX_BLOCK:
        raise ValueError(f"x: K={k} is not a multiple of the MX block ({MX_BLOCK})")
    scale, byte = _mx_scales(xf, E2M1_EMAX)
    codes = e2m1_codes(xf / scale.repeat_interleave(MX_BLOCK, 1))
    return (codes[:, 1::2] << 4 | codes[:, ::2]).to(torch.uint8).view(torch.float4_e2m1fn_x2), byte


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) in float32 for e8m0 scales (float8_e8m0fnu, or their bytes as uint8): the byte shifted into the
    exponent field, 0 the subnormal 2^-127, 0xFF NaN (as nvfly.arch.floats.e8m0_to_f32 in kernels)."""
    byte = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(byte == 0, torch.full_like(byte, 0x00400000), byte << 23)
    return torch.where(byte == 0xFF, torch.full_like(byte, 0x7FC00000), bits).view(torch.float32)


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * 2^(scale - 127) in float32 for an MX tensor ``q`` (rows, K) and its e8m0 scales (rows, K/32)."""
    return q.float() * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, 1)


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_to_float(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of packed e2m1 pairs (float4_e2m1fn_x2, or their bytes as uint8) (rows, K/2): (rows, K),
    the low nibble the lower-numbered value (torch's float4_e2m1fn_x2 and OCP's order)."""
    byte = packed.view(torch.uint8).to(torch.int64)
    nibbles = torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)
    return torch.tensor(E2M1_VALUES, device=packed.device)[nibbles]


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 * 2^(scale - 127) in float32 for packed MXFP4 ``packed`` (rows, K/2) and e8m0 scales (rows, K/32)."""
    return e2m1_to_float(packed) * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, 1)


def quantize(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn,
             operand: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 ``x`` and its scales for ``scaled_mm``: ``operand`` "a" quantises x (M, K) and returns q (M, K)
    row-major; "b" quantises a weight x (N, K) and returns q as (K, N) column-major (``q_w.t()``) with scale_b in
    torch's layout. ``granularity``: "tensor" (one scale), "row" (per row of x: scale_a (M, 1) / scale_b (1, N)),
    "1x128" (per row and 128 k: scale_a (M, K/128), strides (1, M)) or "128x128" (per 128x128 block of the weight:
    scale_b (K/128, N/128), strides (1, K/128)) or "mx" (MXFP8: an e8m0 scale byte per 32 elements along K, OCP's
    rule 2^(floor(log2 amax) - emax), values saturated; the scale (rows, K/32) uint8 for either operand, K a multiple
    of 32) or "mxfp4" (the same scales with e2m1's emax 2, values packed two a byte as float4_e2m1fn_x2 (rows, K/2),
    ``dtype`` unused; "b" returns them as (K/2, N) column-major))."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got {x.dim()}-D")
    rows, k = x.shape
    xf = x.float()
    if granularity == "mx":
        q, scale = _quantize_mx(xf, dtype)
    elif granularity == "mxfp4":
        q, scale = _quantize_mxfp4(xf)
    elif granularity == "tensor":
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
    if granularity in ("mx", "mxfp4"):
        return (q if operand == "a" else q.t()), scale
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


EXPERT_GRANULARITIES = ("128x128", "row", "mx", "mxfp4")


def quantize_experts(w: torch.Tensor, granularity: str = "128x128",
                     dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights w [E, N, K] (F.linear's layout, any float dtype) quantised for ``scaled_grouped_mm``: b
    [E, K, N] column-major in the last two dimensions (``q.transpose(-2, -1)`` of a contiguous [E, N, K]) and
    scale_b [E, K/128, ceil(N/128)] ("128x128"), [E, N] ("row") or [E, N, K/32] e8m0 bytes ("mx": MXFP8; "mxfp4":
    b packed float4_e2m1fn_x2 [E, K/2, N], the transpose of a contiguous [E, N, K/2]), expert by expert as
    ``quantize``."""
    if granularity not in EXPERT_GRANULARITIES:
        raise ValueError(f"granularity: expected one of {EXPERT_GRANULARITIES}, got {granularity!r}")
    if w.dim() != 3:
        raise ValueError(f"w: expected 3-D expert weights [E, N, K], got {w.dim()}-D")
    pairs = [quantize(expert, granularity, dtype, operand="b") for expert in w]
    # [E, N, K] (or [E, N, K/2] pairs) contiguous, seen as [E, K, N]; stacked as bytes (torch stacks no e2m1 pairs)
    b = torch.stack([q.t().view(torch.uint8) for q, _ in pairs]).view(pairs[0][0].dtype).transpose(-2, -1)
    scales = torch.stack([s.reshape(-1) if granularity == "row" else s.contiguous() for _, s in pairs])
    return b, scales


# ---------------------------------------------------------------------------------------------- the kernels
KERNEL_GRANULARITIES = ("row", "1x128", "128x128", "mx")
_QUANT_THREADS = 256
_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_NAMES = {torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2"}
# plan variants (QuantizePlan fields over quantize_plan's) for the granularities they apply to, timed beside the
# default by ``python -m benchmarks.scaled --quantize-only`` and checked bit for bit by the GPU tests
QUANTIZE_VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # MXFP4 of bf16 rounded two values an instruction (bf16x2_to_e2m1x8)
    "e2m1-pairs": (("mxfp4",), {"e2m1_pairs": True}),
    # 16 elements a load step (two 16-byte loads, one 16-byte fp8 store): half the lanes a group, half the shuffles
    "wide": (("row", "1x128", "128x128", "mx"), {"chunk": 16}),
    "wide-e2m1-pairs": (("mxfp4",), {"chunk": 16, "e2m1_pairs": True}),
    # "-4cta": .minnctapersm 4 (up to 64 registers at 256 threads), under which ptxas issues every load of a
    # thread before its first shuffle; without it, it sinks some (MX: 2 of 4, e2m1-pairs: 3 of 4, wide MX: 4 of 8)
    "4cta": (("mx",), {"min_blocks": 4}),
    "e2m1-pairs-4cta": (("mxfp4",), {"e2m1_pairs": True, "min_blocks": 4}),
    "wide-4cta": (("mx",), {"chunk": 16, "min_blocks": 4}),
    # the per-warp plans as before pair_groups (each group's amax reduced alone, in f32): to measure that default
    "unpaired": (("1x128", "mx", "mxfp4"), {"pair_groups": False}),
    # plain loads and stores (no L1 no_allocate / L2 evict_first): whether the streaming hints help
    "no-hints": (("row", "1x128", "128x128", "mx", "mxfp4"), {"hints": False}),
}
# the variant a granularity's "default" plan takes: MXFP4's bf16 pair rounding at 4 CTAs an SM, measured 1.34x the
# f32 rounding on the H200 (docs/ops/scaled.md); the other variants measured within 3% of their defaults
DEFAULT_VARIANTS: dict[str, str] = {"mxfp4": "e2m1-pairs-4cta"}


def quantize_fp8(x: torch.Tensor, granularity: str, dtype: torch.dtype = torch.float8_e4m3fn,
                 operand: str = "a", variant: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize``'s result (the same values and scales, bit for bit, in the same layouts) from nvfly's
    memory-bound kernel: x a contiguous CUDA (rows, K) bf16/fp16/fp32 tensor, K a multiple of 16, granularity
    "row", "1x128", "128x128" or "mx" (MXFP8, K a multiple of 32; tensor-wise scales need a global amax first:
    ``quantize``). ``variant``: "default" or a ``QUANTIZE_VARIANTS`` name that applies to the granularity."""
    try:
        key = (layout_key(x), granularity, dtype, operand, variant)
        call = _QUANT_CALLS.get(key)
    except Exception:  # noqa: BLE001 - not a tensor, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _QUANT_CALLS.plan("nvfly.ops.scaled.quantize_fp8", key, _QuantizeCall, x, granularity, dtype,
                                 operand, variant)
    return call.run(x)


# shuffle_mxfp4_a16(layout="shuffled"): the natural nibble (k) at each position of a 32-bit word; k 2i and 2i + 1
# sit at nibbles i and i + 4, the pair e2m1x8_to_16bit_bits converts into one word
A16_SHUFFLE = (0, 2, 4, 6, 1, 3, 5, 7)
A16_SHUFFLED_LAYOUTS = ("shuffled", "shuffled-bf16", "shuffled-f16")


def _a16_words_nibbles(w_q: Any, name: str, layout: str) -> torch.Tensor:
    """``w_q`` ((K/2, N) column-major float4_e2m1fn_x2, as scaled_mm takes MXFP4 weights) as (N, K/8) 32-bit words
    (int64, unsigned); ``layout`` checked."""
    if not isinstance(w_q, torch.Tensor) or w_q.dtype != torch.float4_e2m1fn_x2:
        raise TypeError(f"{name}: expected a float4_e2m1fn_x2 tensor, got {getattr(w_q, 'dtype', type(w_q))}")
    if w_q.dim() != 2 or w_q.stride(0) != 1 or w_q.shape[0] % 16:
        raise ValueError(f"{name}: expected the (K/2, N) column-major weight scaled_mm takes (K a multiple of 32), "
                         f"got shape {tuple(w_q.shape)} strides {w_q.stride()}")
    if layout not in A16_SHUFFLED_LAYOUTS:
        raise ValueError(f"layout: expected one of {A16_SHUFFLED_LAYOUTS}, got {layout!r}")
    rows = w_q.t().contiguous().view(torch.uint8)
    return rows.view(rows.shape[0], -1, 4).long().mul(torch.tensor([1, 1 << 8, 1 << 16, 1 << 24],
                                                                    device=rows.device)).sum(-1)


def _a16_source_bits(layout: str) -> list:
    """For each natural value v (0..7) of a word, the shuffled word's bit positions of its nibble bits 0..3."""
    if layout == "shuffled":
        return [[4 * A16_SHUFFLE.index(v) + b for b in range(4)] for v in range(8)]
    return e2m1_shuffled_bit_positions(layout.split("-")[1])


def _a16_words(words: torch.Tensor) -> torch.Tensor:
    """(N, K/8) unsigned words (int64) back to scaled_mm's (K/2, N) column-major float4_e2m1fn_x2."""
    signed = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return signed.view(torch.uint8).view(torch.float4_e2m1fn_x2).t()


def shuffle_mxfp4_a16(w_q: torch.Tensor, layout: str = "shuffled") -> torch.Tensor:
    """The MXFP4 weight ``w_q`` ((K/2, N) column-major float4_e2m1fn_x2, what ``quantize(w, "mxfp4",
    operand="b")`` returns) in the layout ``scaled_mm(x, shuffled, None, w_scale, config=A16Config(layout=layout))``
    reads, each 32-bit word (8 k) permuted: "shuffled", the nibbles of k 0, 2, 4, 6, 1, 3, 5, 7 (the conversion's
    pairs are the tokens' natural words); "shuffled-bf16" / "shuffled-f16", the bits placed for the fewest
    conversion ops to that activation dtype (``nvfly.arch.floats.e2m1_shuffled_bit_positions``). Call it once per
    weight (a copy; the scales are unchanged); ``unshuffle_mxfp4_a16`` undoes it. Only that layout's config may read
    the result (any other computes with permuted weights)."""
    words = _a16_words_nibbles(w_q, "w_q", layout)
    out = torch.zeros_like(words)
    for v, positions in enumerate(_a16_source_bits(layout)):
        for b, position in enumerate(positions):
            out |= ((words >> (4 * v + b)) & 1) << position
    return _a16_words(out)


def unshuffle_mxfp4_a16(w_shuffled: torch.Tensor, layout: str = "shuffled") -> torch.Tensor:
    """The natural-order weight of ``shuffle_mxfp4_a16(w_q, layout)``'s result ``w_shuffled`` (same layouts)."""
    words = _a16_words_nibbles(w_shuffled, "w_shuffled", layout)
    out = torch.zeros_like(words)
    for v, positions in enumerate(_a16_source_bits(layout)):
        for b, position in enumerate(positions):
            out |= ((words >> position) & 1) << (4 * v + b)
    return _a16_words(out)


def quantize_mxfp4(x: torch.Tensor, operand: str = "b", variant: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize(x, "mxfp4", operand=operand)`` (the same packed e2m1 values and e8m0 scales, bit for bit) from
    nvfly's kernel: x a contiguous CUDA (rows, K) bf16/fp16/fp32 tensor, K a multiple of 32; returns the packed
    values as float4_e2m1fn_x2 (rows, K/2) ("a"), or their (K/2, N) column-major transpose ("b", as ``scaled_mm``
    takes MXFP4 weights), and the (rows, K/32) uint8 scales. ``variant``: as ``quantize_fp8``'s."""
    try:
        key = (layout_key(x), "mxfp4", operand, variant)
        call = _QUANT_CALLS.get(key)
    except Exception:  # noqa: BLE001 - not a tensor, an unhashable argument: the checks explain
        key = call = None
    if call is None:
        call = _QUANT_CALLS.plan("nvfly.ops.scaled.quantize_mxfp4", key, _QuantizeCall, x, "mxfp4",
                                 torch.float4_e2m1fn_x2, operand, variant)
    return call.run(x)


def quantize_plan(rows: int, k: int, itemsize: int, granularity: str, dtype: torch.dtype,
                  sms: int, variant: str = "default") -> tuple[Any, int]:
    """(QuantizePlan, blocks) of the quantisation kernel for x (rows, k) of ``itemsize``-byte elements on ``sms``
    SMs. 1x128 and MX groups: 16 and 4 lanes each (8 elements a lane), each thread the most groups (4, 2 or 1) that
    still leave 4 blocks (32 warps) per SM, so 4 16-byte loads are in flight per thread before the amax. Rows and
    128x128 blocks: a block each, at most 8 chunks (4 of fp32) per thread held in registers, the threads the next
    power of two in [128, 1024] that covers the group; longer rows in sweeps (read twice). ``variant``: "default"
    or a ``QUANTIZE_VARIANTS`` name, its fields set over the plan (``DEFAULT_VARIANTS``: the default's)."""
    from nvfly.ops.scaled.quantize_kernel import CHUNK
    if variant == "default":
        variant = DEFAULT_VARIANTS.get(granularity, "default")
    if variant == "default":
        return _plan(rows, k, itemsize, granularity, dtype, sms, CHUNK)
    if variant not in QUANTIZE_VARIANTS or granularity not in QUANTIZE_VARIANTS[variant][0]:
        known = [name for name, (granularities, _) in QUANTIZE_VARIANTS.items() if granularity in granularities]
        raise ValueError(f"variant: expected 'default' or one of {known} for granularity {granularity!r}, "
                         f"got {variant!r}")
    fields = QUANTIZE_VARIANTS[variant][1]
    plan, blocks = _plan(rows, k, itemsize, granularity, dtype, sms, fields.get("chunk", CHUNK))
    return dataclasses.replace(plan, **fields), blocks


def _plan(rows: int, k: int, itemsize: int, granularity: str, dtype: torch.dtype, sms: int,
          chunk: int) -> tuple[Any, int]:
    """quantize_plan's plan with ``chunk`` elements a load step (8: 16 bytes of bf16)."""
    from nvfly.ops.scaled.quantize_kernel import QuantizePlan
    loads = chunk * itemsize // 16  # 16-byte loads per chunk
    if granularity == "mxfp4":
        fp8, inv, emax = "e2m1", 1.0 / 6.0, E2M1_EMAX
    else:
        fp8, inv = _FP8_NAMES[dtype], 1.0 / fp8_max(dtype)
        emax = MX_EMAX[dtype] if granularity == "mx" else -1
    if granularity in ("1x128", "mx", "mxfp4"):
        group_cols = SCALE_BLOCK if granularity == "1x128" else MX_BLOCK
        groups = rows * -(-k // group_cols)
        per_block = _QUANT_THREADS // (group_cols // chunk)
        # at most 8 16-byte loads a thread (fp32 in 16-element chunks: 2 groups)
        unroll = next(u for u in (4, 2, 1) if u == 1 or (u * loads <= 8 and -(-groups // (per_block * u)) >= 4 * sms))
        plan = QuantizePlan(1, group_cols, True, _QUANT_THREADS, fp8, inv, AMAX_FLOOR, emax, unroll=unroll,
                            loads=loads, groups_per_row=-(-k // group_cols), chunk=chunk)
        return plan, -(-groups // (per_block * unroll))
    most = 8 // loads  # chunks a thread holds: 128 bytes
    if granularity == "row":
        group_rows, group_cols, total, blocks = 1, 0, k // chunk, rows
    else:
        group_rows, group_cols = SCALE_BLOCK, SCALE_BLOCK
        total, blocks = SCALE_BLOCK * SCALE_BLOCK // chunk, -(-rows // SCALE_BLOCK) * -(-k // SCALE_BLOCK)
    threads = min(1024, max(128, 1 << (-(-total // most) - 1).bit_length()))
    sweeps = -(-total // (threads * most))
    plan = QuantizePlan(group_rows, group_cols, False, threads, fp8, inv, AMAX_FLOOR, emax,
                        chunks=-(-total // (threads * sweeps)), sweeps=sweeps, loads=loads, chunk=chunk)
    return plan, blocks


class _QuantizeCall:
    """The quantisation kernel's launch for one call signature (checked on its first call)."""

    def __init__(self, x: Any, granularity: str, dtype: torch.dtype, operand: str, variant: str):
        from nvfly.ops.scaled.quantize_kernel import quantize_kernel
        if granularity not in KERNEL_GRANULARITIES and granularity != "mxfp4":
            raise ValueError(f"granularity: expected one of {KERNEL_GRANULARITIES}, got {granularity!r}")
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _SOURCE_DTYPES:
            raise TypeError(f"x: expected a 2-D bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x))}")
        if not x.is_contiguous() or x.shape[1] % 16 or not x.is_cuda or x.data_ptr() % 16:
            raise ValueError(f"x: expected a contiguous, 16-byte aligned CUDA tensor with K a multiple of 16, got "
                             f"shape {tuple(x.shape)} strides {x.stride()} on {x.device}")
        if dtype not in _FP8_NAMES and granularity != "mxfp4":
            raise TypeError(f"dtype: expected float8_e4m3fn or float8_e5m2, got {dtype}")
        if operand not in ("a", "b"):
            raise ValueError(f"operand: expected 'a' or 'b', got {operand!r}")
        self.granularity, self.dtype, self.operand = granularity, dtype, operand
        rows, k = x.shape
        self.kb = -(-k // SCALE_BLOCK)
        self.rb = -(-rows // SCALE_BLOCK)
        if granularity in ("mx", "mxfp4") and k % MX_BLOCK:
            raise ValueError(f"x: K={k} is not a multiple of the MX block ({MX_BLOCK})")
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        self.plan, blocks = quantize_plan(rows, k, x.element_size(), granularity, dtype, sms, variant)
        self.launch = quantize_kernel.prepared(max(1, blocks), self.plan.threads)

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, k = x.shape
        if self.granularity == "mxfp4":
            q = torch.empty((rows, k // 2), dtype=torch.uint8, device=x.device)
            scale = torch.empty((rows, k // MX_BLOCK), dtype=torch.uint8, device=x.device)
            if rows and k:
                self.launch(x, q.view(torch.int32), scale, rows, k, self.plan)
            q = q.view(torch.float4_e2m1fn_x2)
            return (q if self.operand == "a" else q.t()), scale
        q = torch.empty((rows, k), dtype=self.dtype, device=x.device)
        if self.granularity == "row":
            scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        elif self.granularity == "1x128":
            scale = torch.empty((self.kb, rows), dtype=torch.float32, device=x.device).t()  # strides (1, rows)
        elif self.granularity == "mx":
            scale = torch.empty((rows, k // MX_BLOCK), dtype=torch.uint8, device=x.device)
        else:
            scale = torch.empty((self.rb, self.kb), dtype=torch.float32, device=x.device)
        if rows and k:
            self.launch(x, q.view(torch.int32), scale, rows, k, self.plan)
        if self.operand == "a" or self.granularity == "mx":
            return (q if self.operand == "a" else q.t()), scale
        # the weight's transposes: b (K, N) column-major; scale_b row (1, N), 1x128 (kb, N) contiguous, 128x128
        # (kb, N/128) with strides (1, kb)
        return q.t(), scale.t()


_QUANT_CALLS: OpCalls[_QuantizeCall] = OpCalls()
