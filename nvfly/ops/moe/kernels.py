"""The MoE layer's router and token shuffles, one launch each (``api.py`` plans them):

- ``moe_route_kernel``: a warp per token: the top-k experts of its router logits (ties: the lower expert first, as
  ``nvfly.ops.topk``) and their softmax probabilities, renormalised over the k or not: softmax, TopK and the
  renormalisation in one launch (torch: four, each with its host time).

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
  output (torch's un-permutation writes and re-reads fp32 copies of y and adds with atomics). Unweighted, it is
  the dispatch's gradient; the dispatch kernel scattering to ``slots`` with each slot's weight as a row scale is
  the combine's gradient with respect to y.
- ``moe_slot_dot_kernel``: the combine's gradient with respect to its weights, dot(y[slots[t * TOP_K + j]],
  grad[t]) per routing slot: a block per token walks the row, one barrier for the TOP_K block sums.

A block owns ``COLUMNS = THREADS * VEC`` columns of one row (grid: rows x column blocks); each thread moves one
vector of VEC elements (16 bytes where the rows are aligned).
"""
from __future__ import annotations

from typing import Any

import nvfly
from nvfly.arch.reduce import block_reduce_many, block_scan, tree_reduce, warp_max_i64
from nvfly.frontend.language import atomic_add, warp_reduce
from nvfly.ops.topk.keys import ABSENT, order_key, rank64, rank_index

SORT_ITEMS = 8  # slots a thread of the sort loads before its atomics (loads in flight)


@nvfly.kernel
def moe_route_kernel(logits: nvfly.Tensor, weights: nvfly.Tensor, ids: nvfly.Tensor, T: nvfly.i32,
                     E: nvfly.Constexpr, TOP_K: nvfly.Constexpr, WARPS: nvfly.Constexpr,
                     RENORMALIZE: nvfly.Constexpr):
    """Warp w of block b routes token b * WARPS + w: each lane holds E / 32 of its logits; TOP_K rounds of "lane
    max, warp max, retire" pick the experts in order (lane j keeps the j-th), then exp(logit - max) over the
    row's (or the k's) sum."""
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    row = nvfly.block_idx.x * WARPS + warp
    if row < T:
        per_lane = -(-E // 32)
        values = []
        ranks = []
        for v in nvfly.static_range(per_lane):
            col = v * 32 + lane
            inside = col < E
            x = logits.load(row, nvfly.minimum(col, E - 1)).to(nvfly.f32)
            values.append(nvfly.select(inside, x, -float("inf")))
            ranks.append(nvfly.select(inside, rank64(order_key(x, True), col), nvfly.i64(ABSENT)))
        top = warp_reduce(tree_reduce(values, nvfly.maximum), "max")
        row_sum = nvfly.f32(0.0)
        if not RENORMALIZE:
            row_sum = warp_reduce(tree_reduce([nvfly.exp(x - top) for x in values], lambda a, b: a + b), "add")
        mine = nvfly.i64(ABSENT)
        for j in nvfly.static_range(TOP_K):
            best = warp_max_i64(tree_reduce(ranks, nvfly.maximum))
            ranks = [nvfly.select(r == best, nvfly.i64(ABSENT), r) for r in ranks]  # (ranks are unique)
            mine = nvfly.select(lane == j, best, mine)
        expert = nvfly.select(lane < TOP_K, rank_index(mine), 0)
        share = nvfly.select(lane < TOP_K, nvfly.exp(logits.load(row, expert).to(nvfly.f32) - top), 0.0)
        total = warp_reduce(share, "add") if RENORMALIZE else row_sum
        if lane < TOP_K:
            weights[row, lane] = share / total
            ids[row, lane] = expert.to(nvfly.i64)


def slot_experts(ids: Any, first: Any, n: Any, tid: Any, THREADS: int) -> tuple[list, list]:
    """(slots, their experts) of the thread's SORT_ITEMS slots from ``first`` (loaded at once; none past n)."""
    slots = [first + u * THREADS + tid for u in nvfly.static_range(SORT_ITEMS)]
    return slots, [ids.load(s, mask=s < n).to(nvfly.i32) for s in slots]


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
        slots, experts_of = slot_experts(ids, first, n, tid, THREADS)
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
        slots, experts_of = slot_experts(ids, first, n, tid, THREADS)
        for u in nvfly.static_range(SORT_ITEMS):
            if slots[u] < n:
                order[atomic_add(counts, experts_of[u], 1)] = slots[u]


@nvfly.kernel
def moe_dispatch_kernel(x: nvfly.Tensor, order: nvfly.Tensor, rows: nvfly.Tensor, slots: nvfly.Tensor,
                        scale: nvfly.Tensor, H: nvfly.i32, TOP_K: nvfly.Constexpr, VEC: nvfly.Constexpr,
                        THREADS: nvfly.Constexpr, SCATTER: nvfly.Constexpr, SCALED: nvfly.Constexpr):
    """rows[i] = x[order[i] // TOP_K]; slots[order[i]] = i (block (i, 0)'s first thread). SCATTER (the combine's
    y-gradient, ``order`` then being the slots): rows[order[s]] = x[s // TOP_K], no slots written. SCALED: each row
    times ``scale[slot]`` (the slot's routing weight) in fp32."""
    i = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    index = order[i]
    col = (nvfly.block_idx.y * THREADS + tid) * VEC
    inside = col < H
    slot = i.to(nvfly.i64) if SCATTER else index
    dest = index.to(nvfly.i32) if SCATTER else i
    token = (slot // TOP_K).to(nvfly.i32)
    values = x.load(token, col, width=VEC, mask=inside)
    if SCALED:
        values = (values.to(nvfly.f32) * scale[slot]).to(rows.dtype)
    rows.store(values, dest, col, mask=inside)
    if not SCATTER:
        if (tid == 0) & (nvfly.block_idx.y == 0):
            slots[slot] = i.to(nvfly.i64)


@nvfly.kernel
def moe_combine_kernel(y: nvfly.Tensor, slots: nvfly.Tensor, weights: nvfly.Tensor, out: nvfly.Tensor,
                       H: nvfly.i32, TOP_K: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr,
                       WEIGHTED: nvfly.Constexpr):
    """out[t] = sum_j weights[t, j] * y[slots[t * TOP_K + j]] in fp32 (block (t, column block)); not WEIGHTED: the
    plain sum (the dispatch's x-gradient)."""
    t = nvfly.block_idx.x
    col = (nvfly.block_idx.y * THREADS + nvfly.thread_idx.x) * VEC
    inside = col < H
    # every slot's row and weight first, then all TOP_K row loads in flight at once
    sources = [slots[t * TOP_K + j].to(nvfly.i32) for j in nvfly.static_range(TOP_K)]
    scales = [weights[t, j] if WEIGHTED else None for j in nvfly.static_range(TOP_K)]
    loaded = [y.load(sources[j], col, width=VEC, mask=inside) for j in nvfly.static_range(TOP_K)]
    total = nvfly.full(VEC, 0.0, nvfly.f32)
    for j in nvfly.static_range(TOP_K):
        total = total + (loaded[j].to(nvfly.f32) * scales[j] if WEIGHTED else loaded[j].to(nvfly.f32))
    out.store(total.to(out.dtype), t, col, mask=inside)


@nvfly.kernel
def moe_slot_dot_kernel(y: nvfly.Tensor, slots: nvfly.Tensor, grad: nvfly.Tensor, out: nvfly.Tensor,
                        H: nvfly.i32, TOP_K: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr):
    """out[t, j] = dot(y[slots[t * TOP_K + j]], grad[t]) in fp32 (the combine's weight-gradient): block t walks the
    row THREADS * VEC columns at a time, then one block reduction of the TOP_K sums."""
    t = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    scratch = nvfly.shared_tensor(nvfly.f32, (TOP_K * (THREADS // 32),))
    sources = [slots[t * TOP_K + j].to(nvfly.i32) for j in nvfly.static_range(TOP_K)]
    sums = [nvfly.f32(0.0) for j in nvfly.static_range(TOP_K)]  # (scalars: TOP_K fp32 vectors would spill at 32)
    for first in range(0, H, THREADS * VEC):
        col = first + tid * VEC
        inside = col < H
        g = grad.load(t, col, width=VEC, mask=inside).to(nvfly.f32)
        loaded = [y.load(sources[j], col, width=VEC, mask=inside) for j in nvfly.static_range(TOP_K)]
        products = [loaded[j].to(nvfly.f32) * g for j in nvfly.static_range(TOP_K)]
        sums = [sums[j] + (products[j].sum() if VEC > 1 else products[j]) for j in nvfly.static_range(TOP_K)]
    totals = block_reduce_many(sums, scratch, THREADS)
    for j in nvfly.static_range(TOP_K):
        if tid == j:
            out[t, j] = totals[j]
