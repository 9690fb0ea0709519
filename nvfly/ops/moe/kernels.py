"""The MoE layer's token shuffles, memory-bound, one launch each (``api.py`` plans them):

- ``moe_sort_kernel``: the routing slots grouped by expert (``order``) and the experts' cumulative ends
  (``offs``), by a counting sort in one block: the expert counts in shared memory, their scan, then each slot's
  place from its expert's cursor (torch's stable argsort, count and cumsum take about ten launches and, at 64
  tokens, ~130 µs of host time). Within an expert the slots come in no fixed order: every later step treats a
  row on its own, so the layer's output does not depend on it.
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
from nvfly.arch.reduce import block_scan
from nvfly.frontend.language import atomic_add

SORT_ITEMS = 8  # slots a thread of the sort loads before its atomics (loads in flight)


@nvfly.kernel
def moe_sort_kernel(ids: nvfly.Tensor, order: nvfly.Tensor, offs: nvfly.Tensor, n: nvfly.i32, experts: nvfly.i32,
                    THREADS: nvfly.Constexpr):
    """One block of THREADS >= experts threads: counts[e] = slots routed to e; offs = their inclusive scan;
    order[cursor[e]++] = slot (a shared-memory atomic per slot)."""
    WARPS = THREADS // 32
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp = tid >> 5
    counts = nvfly.shared_tensor(nvfly.i32, (THREADS,))
    warp_totals = nvfly.shared_tensor(nvfly.i32, (WARPS,))
    counts[tid] = 0
    nvfly.syncthreads()
    for first in range(0, n, THREADS * SORT_ITEMS):
        slots = [first + u * THREADS + tid for u in nvfly.static_range(SORT_ITEMS)]
        experts_of = [ids.load(s, mask=s < n).to(nvfly.i32) for s in slots]
        for u in nvfly.static_range(SORT_ITEMS):
            if slots[u] < n:
                atomic_add(counts, experts_of[u], 1)
    nvfly.syncthreads()
    count = counts[tid]
    start = block_scan(count, warp_totals, lane, warp, WARPS, exclusive=True)
    if tid < experts:
        offs[tid] = start + count
    counts[tid] = start  # (now each expert's cursor)
    nvfly.syncthreads()
    for first in range(0, n, THREADS * SORT_ITEMS):
        slots = [first + u * THREADS + tid for u in nvfly.static_range(SORT_ITEMS)]
        experts_of = [ids.load(s, mask=s < n).to(nvfly.i32) for s in slots]
        for u in nvfly.static_range(SORT_ITEMS):
            if slots[u] < n:
                order[atomic_add(counts, experts_of[u], 1)] = slots[u]


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
