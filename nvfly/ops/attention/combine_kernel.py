"""The split-KV combine: each query row's split partials (normalised f32 O_s and LSE_s) merged into its output.

With m = max_s LSE_s and w_s = e^(LSE_s - m): O = Σ w_s O_s / Σ w_s and LSE = m + log Σ w_s; an empty split
has LSE_s = -inf (weight 0) and a row every split found empty gets zeros and LSE = -inf. One warp a row, 4 rows a
CTA; lane l holds columns l * Dv / 32 ..
"""
from __future__ import annotations

import math

import nvfly

WARPS = 4
LOG2E = 1.0 / math.log(2.0)
NEG_INF = float("-inf")


@nvfly.kernel
def attention_combine_kernel(partial_o: nvfly.Tensor, partial_lse: nvfly.Tensor, out, lse, rows: nvfly.i32,
                             heads: nvfly.i32, splits: nvfly.i32, SQ: nvfly.Constexpr, DV: nvfly.Constexpr):
    """partial_o [splits * rows, DV], partial_lse [splits * rows] (f32; row ((split * B + b) * SQ + token) * heads
    + head) into out [B, SQ, heads, DV] and lse [B, heads, SQ] (f32, natural log; None: not wanted)."""
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    row = nvfly.block_idx.x * WARPS + warp
    if row < rows:
        top = nvfly.f32(NEG_INF)
        for s in range(lane, splits, 32):
            top = nvfly.maximum(top, partial_lse[s * rows + row])
        top = nvfly.warp_reduce(top, "max")
        reference = nvfly.select(top == NEG_INF, 0.0, top)
        PER_LANE = DV // 32
        WIDTH = math.gcd(PER_LANE, 4)
        column = lane * PER_LANE
        acc = [nvfly.full(WIDTH, 0.0, nvfly.f32) for _ in nvfly.static_range(PER_LANE // WIDTH)]
        total = nvfly.f32(0.0)
        for s in range(splits):
            weight = nvfly.exp2((partial_lse[s * rows + row] - reference) * LOG2E)
            total = total + weight
            acc = [a + partial_o.load(s * rows + row, column + WIDTH * j, width=WIDTH) * weight
                   for j, a in enumerate(acc)]
        kept = total > 0.0
        inverse = nvfly.select(kept, 1.0 / nvfly.maximum(total, 1e-30), 0.0)
        b = row // (SQ * heads)
        token = (row // heads) % SQ
        head = row % heads
        for j in nvfly.static_range(PER_LANE // WIDTH):
            out.store((acc[j] * inverse).to(out.dtype), b, token, head, column + WIDTH * j)
        if lse is not None:
            if lane == 0:
                lse[b, head, token] = nvfly.select(kept, reference + nvfly.log(nvfly.maximum(total, 1e-30)), NEG_INF)
