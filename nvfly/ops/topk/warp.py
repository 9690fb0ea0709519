"""The warp kernel (``topk_warp_kernel``: k <= WARP_MAX_K, rows up to WARP_MAX_N elements, e.g. MoE routing).

One warp per row, each lane holds ``N/32`` ranks in registers; k rounds of "lane max, warp max (``redux.sync``),
retire the winner", so the output comes out sorted. One read of the row.
"""
from __future__ import annotations

import nvfly
from nvfly.arch.reduce import tree_reduce, warp_max_i64
from nvfly.frontend.language import redux_sync
from nvfly.ops.topk.keys import ABSENT, order_key, rank64, rank_index


@nvfly.kernel
def topk_warp_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, M: nvfly.i32,
                     K: nvfly.Constexpr, N: nvfly.Constexpr, VEC: nvfly.Constexpr, WARPS: nvfly.Constexpr,
                     LARGEST: nvfly.Constexpr):
    """One warp per row of N <= 1024 elements, k <= 32: k rounds of lane max + warp max."""
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    row = nvfly.block_idx.x * WARPS + warp
    # 16-bit keys and indices below 2**16 fit one u32 rank: key << 16 | (0xFFFF - index), 0 = absent
    packed = x.dtype != nvfly.f32 and N < (1 << 16)
    if row < M:
        vectors = (N + 32 * VEC - 1) // (32 * VEC)
        tail = N % (32 * VEC) != 0
        ranks = []
        for v in nvfly.static_range(vectors):
            col = (v * 32 + lane) * VEC
            in_row = col < N if tail and v == vectors - 1 else None
            xv = x.load(row, col, width=VEC, mask=in_row)
            for e in nvfly.static_range(VEC):
                key = order_key(xv[e] if VEC > 1 else xv, LARGEST)
                if packed:
                    r = (key << 16) | (0xFFFF - (col + e)).bitcast(nvfly.u32)
                    absent = nvfly.u32(0)
                else:
                    r = rank64(key, col + e)
                    absent = nvfly.i64(ABSENT)
                if tail and v == vectors - 1:
                    r = nvfly.select(in_row, r, absent)
                ranks.append(r)
        mine = absent  # lanes < K get the j-th winner below
        for j in nvfly.static_range(K):
            best = tree_reduce(ranks, nvfly.maximum)
            best = redux_sync(best, "max") if packed else warp_max_i64(best)
            ranks = [nvfly.select(r == best, absent, r) for r in ranks]  # ranks are unique: retire the winner
            mine = nvfly.select(lane == j, best, mine)
        if lane < K:
            index = (0xFFFF - (mine & 0xFFFF)).bitcast(nvfly.i32) if packed else rank_index(mine)
            indices[row, lane] = index.to(nvfly.i64)
            values[row, lane] = x[row, index]
