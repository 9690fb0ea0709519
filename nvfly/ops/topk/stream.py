"""The streaming kernel (``topk_radix_kernel``: everything the warp kernel does not take, e.g. sampling over
128K-152K vocabularies) and the merge of its slices (``topk_merge_kernel``).

One block per row (or per slice of a row, then ``topk_merge_kernel``) streams the row once with 16-byte loads,
appending every element that ranks at or above a running threshold T to a shared-memory candidate buffer. T starts
at the k-th largest of the maxima of 2k-4k disjoint groups of the first elements (a lower bound of the k-th
largest rank). When the buffer may overflow, a select (``select.select_top``) keeps the k largest candidates and
raises T to the smallest of them; after the row one more select leaves exactly k, which a bitonic sort (``sort``)
orders.

The filter: per element one float compare with the value of a key just below T's (``keys.flag_key``; two 16-bit
values per ``set.gtu.u32.bf16x2``, NaN unordered, so flagged) sets a bit of a per-thread 32-bit mask: a superset of
the candidates (-0.0/+0.0 and, in the first iteration, T's own key included; later every column lies beyond T's,
so an element with T's key ranks below it). The flagged elements then go one per lane a round: picked from the
loads in registers (``pick``: a tree of selects), checked exactly, appended with a ballot and one shared atomic per
warp (``append_slots``). About 1-2 instructions an element while T is high instead of ~15 for the rank test and
~20 more to append. The row-threshold kernels (``row``) stream with the same filter.

``topk_merge_kernel``: one block of STREAM_THREADS a row loads the slices' parts * k ranks straight into shared
memory, selects once and sorts.
"""
from __future__ import annotations

from typing import Any, Callable

import nvfly
from nvfly.arch.floats import compare_mask, f16_to_f32
from nvfly.arch.warp import ballot, highest_bit, lanemask, popc
from nvfly.frontend.language import atomic_add, syncthreads_or, vote_any
from nvfly.ops.topk.keys import (ABSENT, bits_key, flag_bit, flag_element, flag_key, key_bits, order_key, rank64,
                                 rank_key, value_bits)
from nvfly.ops.topk.plans import SWEEP
from nvfly.ops.topk.select import highest_index_bit, select_top, shared_state
from nvfly.ops.topk.sort import write_sorted

# ---------------------------------------------------------------------------------------------- the filter
@nvfly.func
def append_slots(state, take, lane):
    """Candidate-buffer slots for the lanes where ``take`` holds, one shared atomic on ``state[0]`` per warp:
    (this lane's slot, the buffer size after the warp's appends)."""
    votes = ballot(take)
    total = popc(votes)
    base = nvfly.i32(0)
    if (lane == 0) & (total > 0):
        base = atomic_add(state, 0, total)
    base = nvfly.shfl_idx(base, 0)
    below = lanemask("lt")
    return base + popc(votes & below), base + total


@nvfly.func
def element_filter(key, col, stop, threshold_key, threshold_low):
    """Whether the element with this key at this column is in the slice and ranks >= the threshold, whose
    (key, ~index) halves are given: u32 work instead of a 64-bit rank per element."""
    low = (~col).bitcast(nvfly.u32)
    return (col < stop) & ((key > threshold_key) | ((key == threshold_key) & (low >= threshold_low)))


@nvfly.func
def half_to_f32(bits, dtype):
    """The f32 value of a 16-bit float (bf16/f16) given as the low 16 bits of ``bits`` (u32): exact."""
    if dtype == nvfly.bf16:
        return (bits << 16).bitcast(nvfly.f32)
    half = (bits & 0xFFFF).bitcast(nvfly.i32).to(nvfly.i16)
    return f16_to_f32(half)


def pick(items: list, index: Any, select: Callable[[Any, Any, Any], Any]) -> Any:
    """``items[index]`` for a traced index in range: a tree of ``select(cond, a, b)`` on the index's bits, one
    fewer than there are items (Python values with a Python ``select`` too)."""
    level = 0
    while len(items) > 1:
        odd = ((index >> level) & 1) != 0
        items = [select(odd, items[i + 1], items[i]) if i + 1 < len(items) else items[i]
                 for i in range(0, len(items), 2)]
        level += 1
    return items[0]


@nvfly.func
def flagged_bits(current, bit, VEC, PACKED):
    """The bits (``value_bits``) of the element that flag bit ``bit`` stands for, picked from the thread's
    loads in registers: its u32 word (packed: ``flag_bit``'s word, bit & 15), then its half (bit >> 4)."""
    if PACKED:
        words = [current[u].bitcast(nvfly.u32)[w] for u in nvfly.static_range(len(current))
                 for w in nvfly.static_range(VEC // 2)]
        word = pick(words, bit & 15, nvfly.select)
        return (word >> ((bit >> 4) << 4).bitcast(nvfly.u32)) & 0xFFFF
    elements = [value_bits(current[u][e] if VEC > 1 else current[u]) for u in nvfly.static_range(len(current))
                for e in nvfly.static_range(VEC)]
    return pick(elements, bit, nvfly.select)


def step_loads(x: Any, row: Any, start: Any, stop: Any, step: Any, tid: Any, VEC: int, UNROLL: int,
               THREADS: int) -> list:
    """This thread's UNROLL loads of streaming step ``step`` over columns [start, stop) (masked at ``stop``)."""
    loads = []
    for u in nvfly.static_range(UNROLL):
        col = start + ((step * UNROLL + u) * THREADS + tid) * VEC
        loads.append(x.load(row, col, width=VEC, mask=col < stop))
    return loads


def next_flagged(pending: Any, current: list, col0: Any, dtype: Any, VEC: int, THREADS: int, packed: bool,
                 LARGEST: bool) -> tuple[Any, Any, Any, Any]:
    """Take the lowest of this lane's pending candidate flags (``candidate_flags``): (the flags left, the flag
    taken (0 when none was left), the flagged element's key and column, picked from the loads in registers)."""
    next_flag = pending & (0 - pending)
    pending = pending ^ next_flag
    bit = highest_bit(next_flag).bitcast(nvfly.i32)
    u, e = flag_element(bit, VEC, packed)
    col = col0 + u * THREADS * VEC + e
    key = bits_key(flagged_bits(current, bit, VEC, packed), dtype, LARGEST)
    return pending, next_flag, key, col


@nvfly.func
def candidate_flags(current, flag, VEC, UNROLL, LARGEST):
    """A thread's u32 flags (``flag_bit``) of the elements of this iteration's loads that may rank at or above
    the threshold: compared with ``flag`` (``flag_key``'s value) as floats, NaN-unordered included, two 16-bit
    values per instruction. A superset of the candidates: the append checks each flagged element exactly."""
    flags = nvfly.u32(0)
    cmp = "gtu" if LARGEST else "ltu"
    dtype = current[0].dtype
    if dtype != nvfly.f32 and VEC > 1:
        pair = flag | (flag << 16)
        for u in nvfly.static_range(UNROLL):
            words = current[u].bitcast(nvfly.u32)
            for w in nvfly.static_range(VEC // 2):
                hit = compare_mask(words[w], pair, cmp, dtype)
                flags = flags | (hit & (0x00010001 << flag_bit(u, 2 * w, VEC, True)))
    else:
        flag_value = flag.bitcast(nvfly.f32) if dtype == nvfly.f32 else half_to_f32(flag, dtype)
        for u in nvfly.static_range(UNROLL):
            for e in nvfly.static_range(VEC):
                v = current[u][e] if VEC > 1 else current[u]
                if dtype != nvfly.f32:
                    v = half_to_f32((v.bitcast(nvfly.i16).to(nvfly.i32) & 0xFFFF).bitcast(nvfly.u32), dtype)
                hit = compare_mask(v, flag_value, cmp, nvfly.f32)
                flags = flags | (hit & (1 << flag_bit(u, e, VEC, False)))
    return flags


@nvfly.func
def threshold_halves(threshold):
    """(key, ~index) of a rank, as the u32 pair the streaming filter compares against."""
    return rank_key(threshold), threshold.to(nvfly.i32).bitcast(nvfly.u32)


# ---------------------------------------------------------------------------------------------- kernels
@nvfly.kernel
def topk_radix_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, ranks_out: nvfly.Tensor,
                      k: nvfly.i32, slice_len: nvfly.i32, VEC: nvfly.Constexpr, UNROLL: nvfly.Constexpr,
                      THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr, K_POW2: nvfly.Constexpr,
                      LARGEST: nvfly.Constexpr, TO_RANKS: nvfly.Constexpr):
    """Block (row, part) streams columns [part*slice_len, (part+1)*slice_len) of its row once, keeping the
    candidates that beat the running threshold in shared memory (see the module doc). TO_RANKS: write the
    slice's k best ranks to ``ranks_out[row, part*k:]`` (unsorted, ABSENT where the slice has fewer) for
    ``topk_merge_kernel`` instead of the sorted values and indices."""
    nvfly.min_blocks_per_sm(max(1, 512 // THREADS))  # a 128-register budget (ptxas spills at its default 64)
    row = nvfly.block_idx.x  # rows along x: up to 2**31 - 1 blocks (y stops at 65535)
    part = nvfly.block_idx.y
    tid = nvfly.thread_idx.x
    start = part * slice_len
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    nvfly.syncthreads()
    stream_top(x, row, start, nvfly.minimum(start + slice_len, x.shape[1]), k, smem, tid, VEC, UNROLL, THREADS,
               CAP, K_POW2, LARGEST)
    buf, kept_buf, state = smem[0], smem[1], smem[-1]
    kept = state[0]  # k, or fewer when the slice is shorter
    if TO_RANKS:
        for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
            i = j * THREADS + tid
            if i < k:
                ranks_out[row, part * k + i] = buf.load(i, mask=i < kept, other=ABSENT)
    else:
        write_sorted(x, values, indices, buf, kept_buf, kept, k, row, tid, tid & 31, K_POW2, THREADS)


@nvfly.func
def stream_top(x, row, start, stop, k, smem, tid, VEC, UNROLL, THREADS, CAP, K_POW2, LARGEST):
    """Stream columns [start, stop) of ``x``'s row once, keeping the candidates that beat the running threshold
    in ``smem`` (``shared_state``, zeroed and published), until ``buf[:state[0]]`` holds the k best ranks (all of
    them when fewer): see the module doc."""
    lane = tid & 31
    warp = tid >> 5
    index_top = highest_index_bit(x)
    buf, state = smem[0], smem[-1]
    per_iter = THREADS * VEC * UNROLL
    limit = CAP - per_iter  # a buffer filled up to here still has room for one more iteration's appends
    current = step_loads(x, row, start, stop, 0, tid, VEC, UNROLL, THREADS)
    # a first threshold: the k-th largest of the maxima of GROUPS * THREADS disjoint groups of the first
    # iteration's elements. k distinct elements rank at least that high, so no top-k element ranks lower, and
    # the first select sees a few thousand maxima instead of a whole iteration (whose top bits crowd a few
    # histogram buckets).
    groups = min(VEC * UNROLL, 2 * ((K_POW2 + THREADS - 1) // THREADS))
    maxima = [nvfly.i64(ABSENT) for _ in nvfly.static_range(groups)]
    for u in nvfly.static_range(UNROLL):
        for e in nvfly.static_range(VEC):
            col = start + (u * THREADS + tid) * VEC + e
            r = rank64(order_key(current[u][e] if VEC > 1 else current[u], LARGEST), col)
            maxima[(u * VEC + e) % groups] = nvfly.maximum(maxima[(u * VEC + e) % groups],
                                                           nvfly.select(col < stop, r, ABSENT))
    for g in nvfly.static_range(groups):
        buf[g * THREADS + tid] = maxima[g]
    if tid == 0:
        state[0] = groups * THREADS
    nvfly.syncthreads()
    threshold = select_top(*smem, k, index_top, tid, lane, warp, THREADS)
    if tid == 0:
        state[0] = 0  # drop the maxima: the stream appends them again, with everything else above the threshold
    nvfly.syncthreads()
    threshold_key, threshold_low = threshold_halves(threshold)
    packed = x.dtype != nvfly.f32 and VEC > 1
    for it in range((stop - start + per_iter - 1) // per_iter):
        # the next iteration's loads are in flight while this one is filtered (and across the barrier)
        upcoming = step_loads(x, row, start, stop, it + 1, tid, VEC, UNROLL, THREADS)
        col0 = start + (it * UNROLL * THREADS + tid) * VEC
        # the threshold is an element's rank: in later iterations every column lies beyond its column, so an
        # element with its key ranks below it
        flag = key_bits(flag_key(threshold_key, it == 0, x.dtype), x.dtype, LARGEST)
        pending = candidate_flags(current, flag, VEC, UNROLL, LARGEST)
        overflow = nvfly.i32(0)  # set where a warp's append fills the buffer past the limit
        # one flagged element per lane a round, picked from the loads in registers (a tree of selects: no
        # dependent reload) and checked exactly: rare once the threshold has risen
        while vote_any(pending != 0):
            pending, next_flag, key, col = next_flagged(pending, current, col0, x.dtype, VEC, THREADS, packed, LARGEST)
            take = element_filter(key, col, stop, threshold_key, threshold_low) & (next_flag != 0)
            position, size = append_slots(state, take, lane)
            buf.store(rank64(key, col), position, mask=take)
            overflow = overflow | (size > limit).to(nvfly.i32)
        if syncthreads_or(overflow != 0):  # candidates are the elements ranked >= threshold
            threshold = select_top(*smem, k, index_top, tid, lane, warp, THREADS)
            threshold_key, threshold_low = threshold_halves(threshold)
        current = upcoming
    select_top(*smem, k, index_top, tid, lane, warp, THREADS)


@nvfly.kernel
def topk_merge_kernel(x: nvfly.Tensor, ranks: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor,
                      k: nvfly.i32, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr,
                      K_POW2: nvfly.Constexpr):
    """Block ``row`` merges the ranks the slices of its row wrote (their k best each): all of them into shared
    memory (CAP >= their count), one select, the sort."""
    nvfly.min_blocks_per_sm(max(1, 512 // THREADS))
    row = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp = tid >> 5
    count = ranks.shape[1]
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    buf, kept_buf, state = smem[0], smem[1], smem[-1]
    for first in range(tid * VEC, count, SWEEP * THREADS * VEC):
        loaded = [ranks.load(row, first + j * THREADS * VEC, width=VEC, mask=first + j * THREADS * VEC < count)
                  for j in nvfly.static_range(SWEEP)]
        for j in nvfly.static_range(SWEEP):
            buf.store(loaded[j], first + j * THREADS * VEC, mask=first + j * THREADS * VEC < count)
    if tid == 0:
        state[0] = count  # (ABSENT ones, from slices shorter than k, are no candidates)
    nvfly.syncthreads()
    select_top(*smem, k, highest_index_bit(x), tid, lane, warp, THREADS)
    write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
