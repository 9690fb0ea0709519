"""The MoE layer's token shuffles, memory-bound, one launch each (``api.py`` plans them):

- ``moe_dispatch_kernel``: row i of the expert-sorted copies is token ``order[i] // TOP_K`` of x, and the routing
  slot ``order[i]`` remembers its row (``slots[order[i]] = i``): the gather, the division and the inverse
  permutation in one pass (torch needs four launches).
- ``moe_combine_kernel``: token t's output is the sum over its TOP_K routing slots of the slot's routing weight
  times its expert row ``y[slots[t * TOP_K + j]]``, in fp32, rounded once: one read of y and one write of the
  output (torch's un-permutation writes and re-reads fp32 copies of y and adds with atomics).

A block owns ``COLUMNS = THREADS * VEC`` columns of one row (grid: rows x column blocks); each thread moves one
vector of VEC elements (16 bytes where the rows are aligned).
"""
from __future__ import annotations

import nvfly


@nvfly.kernel
def moe_dispatch_kernel(x: nvfly.Tensor, order: nvfly.Tensor, rows: nvfly.Tensor, slots: nvfly.Tensor,
                        H: nvfly.i32, TOP_K: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr):
    """rows[i] = x[order[i] // TOP_K]; slots[order[i]] = i (block (i, 0)'s first thread)."""
    i = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    slot = order[i]
    col = (nvfly.block_idx.y * THREADS + tid) * VEC
    inside = col < H
    token = (slot // TOP_K).to(nvfly.i32)
    values = x.load(token, col, width=VEC, mask=inside)
    rows.store(values, i, col, mask=inside)
    if (tid == 0) & (nvfly.block_idx.y == 0):
        slots[slot] = i.to(nvfly.i64)


@nvfly.kernel
def moe_combine_kernel(y: nvfly.Tensor, slots: nvfly.Tensor, weights: nvfly.Tensor, out: nvfly.Tensor,
                       H: nvfly.i32, TOP_K: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr):
    """out[t] = sum_j weights[t, j] * y[slots[t * TOP_K + j]] in fp32 (block (t, column block))."""
    t = nvfly.block_idx.x
    col = (nvfly.block_idx.y * THREADS + nvfly.thread_idx.x) * VEC
    inside = col < H
    # every slot's row and weight first, then all TOP_K row loads in flight at once
    sources = [slots[t * TOP_K + j].to(nvfly.i32) for j in nvfly.static_range(TOP_K)]
    scales = [weights[t, j] for j in nvfly.static_range(TOP_K)]
    loaded = [y.load(sources[j], col, width=VEC, mask=inside) for j in nvfly.static_range(TOP_K)]
    total = nvfly.full(VEC, 0.0, nvfly.f32)
    for j in nvfly.static_range(TOP_K):
        total = total + loaded[j].to(nvfly.f32) * scales[j]
    out.store(total.to(out.dtype), t, col, mask=inside)
