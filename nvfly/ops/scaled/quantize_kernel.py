"""Quantisation to fp8 with amax scales (nvfly.ops.scaled.quantize's scale choice, bit for bit): memory-bound,
each group read twice (its amax, then its values; the second read hits L1/L2).

A group is ``PLAN.group_rows`` x ``PLAN.group_cols`` elements (group_cols 0: a whole row). Small groups (1x128,
MX's 1x32) take group_cols / VEC lanes each (each lane VEC consecutive elements); large ones (a row, a 128x128
block) one block each, the threads walking the group in VEC-element chunks. scale = max(amax, AMAX_FLOOR) *
(1 / FP8_MAX) (an fp32 multiply, as the reference; MX: a power of two) and q = fp8(x / scale) (an IEEE division,
rounded to nearest even, saturating: the reference's clamp), four fp8 values stored as one 32-bit word (``q`` is
passed as int32 words); MXFP4: four e2m1 codes as one 16-bit word (``q`` as int16 words).
"""
from __future__ import annotations

from dataclasses import dataclass

import nvfly
from nvfly.arch.floats import f32_to_e2m1, f32x2_to_fp8x2
from nvfly.arch.reduce import block_reduce


@dataclass(frozen=True)
class QuantizePlan:
    """group_rows x group_cols groups (group_cols 0: whole rows); per_warp: group_cols / vec lanes per group (a
    power of two up to 32), else one block of threads per group; fp8: the target dtype's name ("e2m1": MXFP4);
    inv_fp8_max (1 / the dtype's largest value), amax_floor: the scale choice; mx_emax >= 0: MX scales instead (an e8m0 byte per
    group, 2^(floor(log2 amax) - mx_emax), OCP's rule), the scale tensor then uint8."""
    group_rows: int
    group_cols: int
    per_warp: bool
    threads: int
    vec: int
    fp8: str
    inv_fp8_max: float
    amax_floor: float
    mx_emax: int = -1


@nvfly.func
def _amax(values, amax):
    for v in values:
        amax = nvfly.maximum(amax, abs(v))
    return amax


@nvfly.func
def _store_quantized(q32, values, row, col, scale_value, PLAN):
    """``values`` (a multiple of 4) divided by the scale and stored as fp8 words from element (row, col); e2m1: as
    16-bit words of four codes (the lowest nibble first; ``q32`` then holds 16-bit words)."""
    if PLAN.fp8 == "e2m1":
        for w in nvfly.static_range(len(values) // 4):
            codes = [f32_to_e2m1(values[4 * w + e] / scale_value) for e in range(4)]
            q32[row, col // 4 + w] = (codes[0] | (codes[1] << 4) | (codes[2] << 8) | (codes[3] << 12)).to(nvfly.i16)
    else:
        dtype = nvfly.f8e4m3 if PLAN.fp8 == "f8e4m3" else nvfly.f8e5m2
        for w in nvfly.static_range(len(values) // 4):
            low = f32x2_to_fp8x2(values[4 * w] / scale_value, values[4 * w + 1] / scale_value, dtype)
            high = f32x2_to_fp8x2(values[4 * w + 2] / scale_value, values[4 * w + 3] / scale_value, dtype)
            word = nvfly.make_vector([low, high]).bitcast(nvfly.i32)[0]
            q32[row, col // 4 + w] = word


@nvfly.func
def _load(x, row, col, inside, VEC):
    v = x.load(row, col, width=VEC, mask=inside, other=0.0).to(nvfly.f32)
    return [v[e] for e in range(VEC)]


@nvfly.kernel
def quantize_kernel(x: nvfly.Tensor, q32: nvfly.Tensor, scale: nvfly.Tensor, rows: nvfly.i32, cols: nvfly.i32,
                    PLAN: nvfly.Constexpr):
    """x (rows, cols) 16/32-bit -> q32 (rows, cols / 4) fp8 words and scale (rows / group_rows, cols / group_cols),
    indexed [group row, group column] through its strides."""
    VEC = PLAN.vec
    tid = nvfly.thread_idx.x
    if PLAN.per_warp:
        LANES = PLAN.group_cols // VEC  # lanes per group
        GROUPS = PLAN.threads // LANES  # groups per block
        groups_per_row = (cols + PLAN.group_cols - 1) // PLAN.group_cols
        group = nvfly.block_idx.x * GROUPS + tid // LANES
        row = group // groups_per_row
        gcol = group - row * groups_per_row
        col = gcol * PLAN.group_cols + (tid % LANES) * VEC
        # no branch before the shuffles: a warp may hold groups of two rows, or past the last row (masked to 0)
        valid = (row < rows) & (col < cols)
        values = _load(x, nvfly.minimum(row, rows - 1), col, valid, VEC)
        amax = nvfly.warp_reduce(_amax(values, 0.0), "max", LANES)
        if PLAN.mx_emax >= 0:
            # e8m0: the biased exponent of amax less emax, in [0, 254]; 2^(byte - 127) (byte 0: the subnormal 2^-127)
            byte = nvfly.minimum(nvfly.maximum(((amax.bitcast(nvfly.i32) >> 23) & 0xFF) - PLAN.mx_emax, 0), 254)
            s = nvfly.select(byte == 0, nvfly.i32(0x00400000), byte << 23).bitcast(nvfly.f32)
            stored = byte.to(nvfly.u8)
        else:
            s = nvfly.maximum(amax, PLAN.amax_floor) * PLAN.inv_fp8_max
            stored = s
        if row < rows:
            if tid % LANES == 0:
                scale[row, gcol] = stored
            if col < cols:
                _store_quantized(q32, values, row, col, s, PLAN)
    else:
        scratch = nvfly.shared_tensor(nvfly.f32, (PLAN.threads // 32,))
        GR = PLAN.group_rows
        gcols = cols if PLAN.group_cols == 0 else PLAN.group_cols
        groups_per_row = 1 if PLAN.group_cols == 0 else (cols + PLAN.group_cols - 1) // PLAN.group_cols
        grow = nvfly.block_idx.x // groups_per_row
        gcol = nvfly.block_idx.x - grow * groups_per_row
        chunks_per_row = gcols // VEC
        chunks = GR * chunks_per_row
        amax = 0.0
        for c in range(tid, chunks, PLAN.threads):
            r = c // chunks_per_row
            row = grow * GR + r
            col = gcol * gcols + (c - r * chunks_per_row) * VEC
            amax = _amax(_load(x, row, col, (row < rows) & (col < cols), VEC), amax)
        amax = block_reduce(amax, scratch, PLAN.threads, "max")
        s = nvfly.maximum(amax, PLAN.amax_floor) * PLAN.inv_fp8_max
        if tid == 0:
            scale[grow, gcol] = s
        for c in range(tid, chunks, PLAN.threads):
            r = c // chunks_per_row
            row = grow * GR + r
            col = gcol * gcols + (c - r * chunks_per_row) * VEC
            if (row < rows) & (col < cols):
                _store_quantized(q32, _load(x, row, col, row < rows, VEC), row, col, s, PLAN)
