# The TopK implementation as of c7e0294 (before the topk-sampling branch), kept verbatim as the baseline that
# `python -m benchmarks.topk --compare-plans` checks and times beside the current one in the same process.
"""TopK along the last dimension: values and int64 indices like ``torch.topk``, k from 1 to 2048.

Order and ties. Every element gets a unique 64-bit rank, ``comp = (key << 32) | ~index``, where ``key`` is the
value's bits made monotone (so -0.0 ranks below +0.0, like torch's radix select) and NaN (any payload) ranks
above +inf, as in torch on CUDA; ``largest=False`` inverts the key, so NaNs then come last. The result is the k
largest ranks in decreasing order: equal values are taken and listed lowest index first. That is exactly
``torch.sort(x, descending=largest, stable=True)[..., :k]`` (NaN treated as the largest value). torch.topk on
CUDA picks the same elements (everything strictly better than the k-th value, then the lowest indices equal to
it) and lists them in the same order when k > 32 (its sort is stable there); for k <= 32 its bitonic sort may
list equal values in another index order. Values are gathered from the input by index, bit for bit.

Two kernels:
- ``topk_warp_kernel`` (k <= 32, rows up to 1024 elements, e.g. MoE routing): one warp per row, each lane
  holds ``N/32`` ranks in registers; k rounds of "lane max, warp max (redux.sync), retire the winner", so the
  output comes out sorted. One read of the row.
- ``topk_radix_kernel`` (everything else, e.g. sampling over 128K-152K vocabularies): one block per row (or per
  slice of a row, then a merge) streams the row once with 16-byte loads, appending every element that beats a
  running threshold T to a shared-memory candidate buffer. T starts at the k-th largest of the maxima of
  2k-4k disjoint groups of the first elements (a lower bound of the k-th largest rank). When the buffer may
  overflow, a block-wide radix select (11-bit digits over the bits where the candidates differ, shared-memory
  histograms) finds the k-th largest rank, raises T to it and compacts the buffer to k entries. After the row,
  one more select leaves exactly k candidates, which a bitonic sort orders. For typical data T is high from
  the start, so the stream costs one read of the row and a few selects over a few thousand candidates.
  Vector fast reject: per 16-byte vector a packed NaN-propagating max (min when smallest) is compared with the
  f32 value of T's key; a warp whose vectors are all strictly below it (as floats: NaN, -0.0 vs +0.0 and
  values equal to T's are never rejected) skips the per-element filter, about one instruction per element.
  Blocks have 256 threads (two per SM; 512 when k = 2048). Fewer rows than 2 blocks per SM: each row is cut
  into slices of whole 256 x vec sweeps (``slice_plan``: down to one sweep, at least 4k elements, at most
  MERGE_RANKS / k slices), each slice writes its k best ranks and a second launch merges them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import nvfly
from nvfly.arch.ptx import asm
from nvfly.frontend.language import atomic_add, count_leading_zeros, redux_sync, syncthreads_or, vote_any
from nvfly.ops.rmsnorm import vector_width
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import layout_key

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
MAX_K = 2048
WARP_MAX_K = 32           # the warp kernel's k rounds each cost a warp reduction
WARP_MAX_N = 1024         # and each lane holds N/32 ranks in registers
HIST_BITS = 11            # radix digit of the select: 2048 shared-memory counters
HIST = 1 << HIST_BITS
STREAM_BYTES = 64         # loaded per thread per streaming iteration (and as much prefetched): 32 KB per block
STREAM_THREADS = 512      # the merge's blocks (and the first pass's when k is 2048)
SLICE_THREADS = 256       # the first pass's blocks: two to an SM
BLOCKS_PER_SM = 2
SM_SMEM_BYTES = 228 * 1024  # shared memory of an SM (each block also takes 1 KB of it)
MERGE_RANKS = 16384       # the most ranks a row's merge reads (parts * k): 128 KB
MAX_PARTS = 128
MAX_UNROLL = 8            # loads per thread per iteration (narrow accesses would need too many registers)
ABSENT = -(1 << 63)       # the rank of "no element": below every real rank (a real ~index is never 0)
_KEY_MSB = 0x80000000
_NAN_ABOVE = {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}  # |bits| above this: NaN


# ---------------------------------------------------------------------------------------------- ranks
@nvfly.func
def order_key(value, LARGEST):
    """The u32 key of a bf16/f16/f32 value: larger key = earlier in the output (NaN first when LARGEST)."""
    if value.dtype == nvfly.f32:
        bits = value.bitcast(nvfly.u32)
        sign_fill = (value.bitcast(nvfly.i32) >> 31).bitcast(nvfly.u32)
        key = bits ^ (sign_fill | _KEY_MSB)
        key = nvfly.select((bits & 0x7FFFFFFF) > _NAN_ABOVE["f32"], 0xFFFFFFFF, key)
        inverted = 0xFFFFFFFF
    else:
        bits = (value.bitcast(nvfly.i16).to(nvfly.i32) & 0xFFFF).bitcast(nvfly.u32)
        key = bits ^ (((bits >> 15) * 0x7FFF) | 0x8000)
        key = nvfly.select((bits & 0x7FFF) > _NAN_ABOVE[value.dtype.name], 0xFFFF, key)
        inverted = 0xFFFF
    if not LARGEST:
        key = key ^ inverted
    return key


@nvfly.func
def rank64(key, index):
    """The unique signed 64-bit rank of (key, index): ``(key << 32) | ~index`` with the top bit flipped, so
    that signed comparisons order ranks like the unsigned values."""
    high = (key ^ _KEY_MSB).bitcast(nvfly.i32).to(nvfly.i64) << 32
    return high | (~index).bitcast(nvfly.u32).to(nvfly.i64)


@nvfly.func
def rank_index(rank):
    """The index encoded in a 64-bit rank."""
    return ~rank.to(nvfly.i32)


# ---------------------------------------------------------------------------------------------- warp kernel
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
            best = ranks[0]
            for r in ranks[1:]:
                best = nvfly.maximum(best, r)
            best = redux_sync(best, "max") if packed else nvfly.warp_reduce(best, "max")
            ranks = [nvfly.select(r == best, absent, r) for r in ranks]  # ranks are unique: retire the winner
            mine = nvfly.select(lane == j, best, mine)
        if lane < K:
            index = (0xFFFF - (mine & 0xFFFF)).bitcast(nvfly.i32) if packed else rank_index(mine)
            indices[row, lane] = index.to(nvfly.i64)
            values[row, lane] = x[row, index]


# ---------------------------------------------------------------------------------------------- block helpers
@nvfly.func
def warp_inclusive_sum(value, lane):
    """Inclusive prefix sum over the lanes of a warp (5 shuffles)."""
    for offset in nvfly.static_range(5):
        moved = nvfly.shfl_up(value, 1 << offset)
        value = value + nvfly.select(lane >= (1 << offset), moved, 0)
    return value


@nvfly.func
def reserve(state, count, lane):
    """Reserve ``count`` slots per thread of the candidate buffer (one atomic on ``state[0]`` per warp):
    returns (this thread's first slot, the buffer size after this warp's reservation as seen by lane 31)."""
    inclusive = warp_inclusive_sum(count, lane)
    total = nvfly.shfl_idx(inclusive, 31)
    base = nvfly.i32(0)
    if lane == 31:
        base = atomic_add(state, 0, total)
    base = nvfly.shfl_idx(base, 31)
    return base + inclusive - count, base + total


@nvfly.func
def block_max_min(high, low, scratch, lane, warp, WARPS):
    """(max of ``high``, min of ``low``) over the block (i64); ``scratch`` holds 64 i64 slots."""
    high = nvfly.warp_reduce(high, "max")
    low = nvfly.warp_reduce(low, "min")
    if lane == 0:
        scratch[warp] = high
        scratch[32 + warp] = low
    nvfly.syncthreads()
    high = scratch.load(lane, mask=lane < WARPS, other=ABSENT)
    low = scratch.load(32 + lane, mask=lane < WARPS, other=-1 - ABSENT)
    return nvfly.warp_reduce(high, "max"), nvfly.warp_reduce(low, "min")


@nvfly.func
def find_bucket(hist, state, warp_sums, needed, tid, lane, warp, THREADS):
    """The histogram bucket holding the ``needed``-th largest rank, counting from the top bucket:
    (bucket, ranks in higher buckets, ranks in the bucket). Thread t owns buckets [t*HB, (t+1)*HB)."""
    per_thread = HIST // THREADS
    counts = [hist[tid * per_thread + i] for i in nvfly.static_range(per_thread)]
    mine = counts[0]
    for c in counts[1:]:
        mine = mine + c
    # suffix sums: how many ranks are in the buckets of higher threads
    suffix = mine
    for offset in nvfly.static_range(5):
        moved = nvfly.shfl_down(suffix, 1 << offset)
        suffix = suffix + nvfly.select(lane + (1 << offset) < 32, moved, 0)
    if lane == 0:
        warp_sums[warp] = suffix
    nvfly.syncthreads()
    later_warps = nvfly.warp_reduce(warp_sums.load(lane, mask=(lane > warp) & (lane < THREADS // 32), other=0),
                                    "add")
    above = later_warps + suffix - mine
    for i in nvfly.static_range(per_thread - 1, -1, -1):
        if (above < needed) & (needed <= above + counts[i]):
            state[1] = tid * per_thread + i
            state[2] = above
            state[3] = counts[i]
        above = above + counts[i]
    nvfly.syncthreads()
    return state[1], state[2], state[3]


@nvfly.func
def select_top(buf, kept_buf, hist, state, warp_sums, scratch, needed, tid, lane, warp, THREADS):
    """Keep the ``needed`` largest ranks of ``buf[:state[0]]`` (all of them if there are no more) at
    ``buf[:kept]``, ``state[0] = kept``; returns T, a rank such that exactly the kept ranks are >= T.

    Radix select: the digits are the 11 bits below the highest bit where the candidates differ, then the next
    11, ... until the bucket of the needed-th rank holds exactly the ranks still needed. The candidates stay
    in shared memory (each pass reads them again); the kept ones go through ``kept_buf``."""
    count = state[0]
    high = nvfly.i64(ABSENT)
    low = nvfly.i64(-1 - ABSENT)
    for i in range(tid, count, THREADS):
        r = buf[i]
        high = nvfly.maximum(high, r)
        low = nvfly.minimum(low, r)
    high, low = block_max_min(high, low, scratch, lane, warp, THREADS // 32)
    if tid == 0:
        state[0] = 0  # everyone read the count before the barrier in block_max_min
    threshold = nvfly.i64(ABSENT)
    if count > needed:
        # work on the unsigned bits u = rank ^ ABSENT; [range_low, range_high] holds the ranks still in play
        top = 63 - count_leading_zeros((high ^ low) | 1)  # (| 1: only ABSENT duplicates can make them equal)
        shift = nvfly.maximum(top - (HIST_BITS - 1), 0)
        span = ((nvfly.i64(1) << top.to(nvfly.i64)) << 1) - 1
        range_low = ((high ^ ABSENT) & ~span) ^ ABSENT
        range_high = ((high ^ ABSENT) | span) ^ ABSENT
        searching = nvfly.i32(1)
        while searching != 0:
            for j in nvfly.static_range(HIST // THREADS):
                hist[j * THREADS + tid] = 0
            nvfly.syncthreads()
            for i in range(tid, count, THREADS):
                r = buf[i]
                if (r >= range_low) & (r <= range_high):
                    atomic_add(hist, (((r ^ ABSENT) >> shift.to(nvfly.i64)) & (HIST - 1)).to(nvfly.i32), 1)
            nvfly.syncthreads()
            bucket, above, in_bucket = find_bucket(hist, state, warp_sums, needed, tid, lane, warp, THREADS)
            needed = needed - above
            range_low = ((range_low ^ ABSENT) | (bucket.to(nvfly.i64) << shift.to(nvfly.i64))) ^ ABSENT
            range_high = ((range_low ^ ABSENT) | ((nvfly.i64(1) << shift.to(nvfly.i64)) - 1)) ^ ABSENT
            if (in_bucket == needed) | (shift == 0):
                searching = nvfly.i32(0)
                threshold = range_low
            else:
                shift = nvfly.maximum(shift - HIST_BITS, 0)
    # compaction: the trip count is the same in every thread, so the warp appends may shuffle
    for first in range(0, count, THREADS):
        r = buf.load(first + tid, mask=first + tid < count, other=ABSENT)
        keep = (r != ABSENT) & (r >= threshold)
        if vote_any(keep):
            position, _ = reserve(state, keep.to(nvfly.i32), lane)
            kept_buf.store(r, position, mask=keep)
    nvfly.syncthreads()
    kept = state[0]
    for i in range(tid, kept, THREADS):
        buf[i] = kept_buf[i]
    nvfly.syncthreads()
    return threshold


@nvfly.func
def bitonic_sort_descending(buf, tid, SIZE, THREADS):
    """Sort ``buf[:SIZE]`` (a power of two) in decreasing order; the block's threads share the pairs."""
    pairs = SIZE // 2
    size = 2
    while size <= SIZE:
        stride = size // 2
        while stride >= 1:
            for j in nvfly.static_range((pairs + THREADS - 1) // THREADS):
                pair = j * THREADS + tid
                first = ((pair >> int(math.log2(stride))) << int(math.log2(stride) + 1)) | (pair & (stride - 1))
                a = buf[first]
                b = buf[first + stride]
                descending = (first & size) == 0
                swap = nvfly.select(descending, a < b, a > b)
                if pairs % THREADS == 0 or pair < pairs:
                    buf[first] = nvfly.select(swap, b, a)
                    buf[first + stride] = nvfly.select(swap, a, b)
            nvfly.syncthreads()
            stride //= 2
        size *= 2


# ---------------------------------------------------------------------------------------------- streaming kernel
@nvfly.func
def element_filter(element, col, stop, threshold, threshold_key, threshold_low, LARGEST, FROM_RANKS):
    """(take, rank-or-key) of one streamed element: take when it is in the slice and ranks >= threshold."""
    if FROM_RANKS:
        take = (col < stop) & (element != ABSENT) & (element >= threshold)
        key = element
    else:
        # compare (key, ~col) with the threshold's halves: u32 work instead of a 64-bit rank per element
        key = order_key(element, LARGEST)
        low = (~col).bitcast(nvfly.u32)
        take = (col < stop) & ((key > threshold_key) | ((key == threshold_key) & (low >= threshold_low)))
    return take, key


@nvfly.func
def element_rank(element, col, stop, LARGEST, FROM_RANKS):
    """The 64-bit rank of one streamed element (ABSENT past the end of the slice)."""
    r = element if FROM_RANKS else rank64(order_key(element, LARGEST), col)
    return nvfly.select(col < stop, r, ABSENT)


_PACKED = {"bf16": "bf16x2", "f16": "f16x2"}


@nvfly.func
def half_to_f32(bits, dtype):
    """The f32 value of a 16-bit float (bf16/f16) given as the low 16 bits of ``bits`` (u32): exact."""
    if dtype == nvfly.bf16:
        return (bits << 16).bitcast(nvfly.f32)
    half = (bits & 0xFFFF).bitcast(nvfly.i32).to(nvfly.i16)
    return asm("cvt.f32.f16 $0, $1;", [half], nvfly.f32, side_effects=False)


@nvfly.func
def key_value(key, dtype, LARGEST):
    """The f32 value of an order key (``order_key``'s inverse); NaN for the NaN key and for key 0 (the key of
    ABSENT), so that comparisons with it are false."""
    if not LARGEST:
        key = key ^ (0xFFFFFFFF if dtype == nvfly.f32 else 0xFFFF)
    if dtype == nvfly.f32:
        value = nvfly.select((key & _KEY_MSB) != 0, key ^ _KEY_MSB, ~key).bitcast(nvfly.f32)
    else:
        value = half_to_f32(nvfly.select((key & 0x8000) != 0, key ^ 0x8000, key ^ 0xFFFF), dtype)
    return value


@nvfly.func
def vector_may_take(v, threshold_value, LARGEST):
    """False only when no element of the vector ``v`` can rank at or above a threshold whose value (its key's
    f32 value, ``key_value``) is ``threshold_value``: every element is strictly below it (above it when not
    LARGEST) as floats. The extreme is taken with NaN-propagating packed max/min, so a vector holding a NaN is
    never rejected, and neither is one whose extreme equals the value (-0.0 == +0.0 as floats: conservative)."""
    op = "max" if LARGEST else "min"
    if v.dtype == nvfly.f32:
        parts = [v[e] for e in nvfly.static_range(v.size)]
        while len(parts) > 1:
            parts = [asm(f"{op}.NaN.f32 $0, $1, $2;", [parts[2 * i], parts[2 * i + 1]], nvfly.f32,
                         side_effects=False) for i in nvfly.static_range(len(parts) // 2)]
        first = parts[0]
        second = parts[0]
    else:
        words = v.bitcast(nvfly.u32)
        parts = [words[i] for i in nvfly.static_range(words.size)]
        while len(parts) > 1:
            parts = [asm(f"{op}.NaN.{_PACKED[v.dtype.name]} $0, $1, $2;", [parts[2 * i], parts[2 * i + 1]],
                         nvfly.u32, side_effects=False) for i in nvfly.static_range(len(parts) // 2)]
        first = half_to_f32(parts[0], v.dtype)
        second = half_to_f32(parts[0] >> 16, v.dtype)
    if LARGEST:
        rejected = (first < threshold_value) & (second < threshold_value)
    else:
        rejected = (first > threshold_value) & (second > threshold_value)
    return ~rejected


@nvfly.func
def threshold_halves(threshold):
    """(key, ~index) of a rank, as the u32 pair the streaming filter compares against."""
    return ((threshold >> 32).to(nvfly.i32) ^ _KEY_MSB).bitcast(nvfly.u32), threshold.to(nvfly.i32).bitcast(nvfly.u32)


@nvfly.kernel
def topk_radix_kernel(x: nvfly.Tensor, ranks_in: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor,
                      ranks_out: nvfly.Tensor, k: nvfly.i32, slice_len: nvfly.i32, VEC: nvfly.Constexpr,
                      UNROLL: nvfly.Constexpr, THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr,
                      K_POW2: nvfly.Constexpr, LARGEST: nvfly.Constexpr, FROM_RANKS: nvfly.Constexpr,
                      TO_RANKS: nvfly.Constexpr):
    """Block (row, part) streams columns [part*slice_len, (part+1)*slice_len) of its row once, keeping the
    candidates that beat the running threshold in shared memory (see the module doc).

    FROM_RANKS: the elements are 64-bit ranks (``ranks_in``, from a first pass over slices) instead of values.
    TO_RANKS: write the slice's k best ranks to ``ranks_out[row, part*k:]`` (unsorted) instead of the sorted
    values and indices."""
    row = nvfly.block_idx.x  # rows along x: up to 2**31 - 1 blocks (y stops at 65535)
    part = nvfly.block_idx.y
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp = tid >> 5
    src = ranks_in if FROM_RANKS else x
    start = part * slice_len
    stop = nvfly.minimum(start + slice_len, src.shape[1])
    buf = nvfly.dynamic_shared_tensor(nvfly.i64, (CAP,))
    kept_buf = nvfly.dynamic_shared_tensor(nvfly.i64, (K_POW2,), CAP * 8)
    tail = (CAP + K_POW2) * 8
    hist = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST,), tail)
    scratch = nvfly.dynamic_shared_tensor(nvfly.i64, (64,), tail + HIST * 4)
    warp_sums = nvfly.dynamic_shared_tensor(nvfly.i32, (32,), tail + HIST * 4 + 512)
    state = nvfly.dynamic_shared_tensor(nvfly.i32, (4,), tail + HIST * 4 + 640)  # [0]: candidates in buf
    if tid == 0:
        state[0] = 0
    nvfly.syncthreads()
    per_iter = THREADS * VEC * UNROLL
    limit = CAP - per_iter  # a buffer filled up to here still has room for one more iteration's appends
    current = []
    for u in nvfly.static_range(UNROLL):
        col = start + (u * THREADS + tid) * VEC
        current.append(src.load(row, col, width=VEC, mask=col < stop))
    # a first threshold: the k-th largest of the maxima of GROUPS * THREADS disjoint groups of the first
    # iteration's elements. k distinct elements rank at least that high, so no top-k element ranks lower, and
    # the first select sees a few thousand maxima instead of a whole iteration (whose top bits crowd a few
    # histogram buckets).
    groups = min(VEC * UNROLL, 2 * ((K_POW2 + THREADS - 1) // THREADS))
    maxima = [nvfly.i64(ABSENT) for _ in nvfly.static_range(groups)]
    for u in nvfly.static_range(UNROLL):
        for e in nvfly.static_range(VEC):
            col = start + (u * THREADS + tid) * VEC + e
            r = element_rank(current[u][e] if VEC > 1 else current[u], col, stop, LARGEST, FROM_RANKS)
            maxima[(u * VEC + e) % groups] = nvfly.maximum(maxima[(u * VEC + e) % groups], r)
    for g in nvfly.static_range(groups):
        buf[g * THREADS + tid] = maxima[g]
    if tid == 0:
        state[0] = groups * THREADS
    nvfly.syncthreads()
    threshold = select_top(buf, kept_buf, hist, state, warp_sums, scratch, k, tid, lane, warp, THREADS)
    if tid == 0:
        state[0] = 0  # drop the maxima: the stream appends them again, with everything else above the threshold
    nvfly.syncthreads()
    threshold_key, threshold_low = threshold_halves(threshold)
    # vector fast reject (values, 16-byte vectors of 2+ elements): skip the per-element filter of a warp whose
    # vectors all lie strictly below the threshold's value
    fast = not FROM_RANKS and VEC > 1
    threshold_value = key_value(threshold_key, x.dtype, LARGEST) if fast else None
    for it in range((stop - start + per_iter - 1) // per_iter):
        # the next iteration's loads are in flight while this one is filtered (and across the barrier)
        upcoming = []
        for u in nvfly.static_range(UNROLL):
            col = start + (((it + 1) * UNROLL + u) * THREADS + tid) * VEC
            upcoming.append(src.load(row, col, width=VEC, mask=col < stop))
        count = nvfly.i32(0)
        if fast:
            may = vector_may_take(current[0], threshold_value, LARGEST)
            for u in nvfly.static_range(1, UNROLL):
                may = may | vector_may_take(current[u], threshold_value, LARGEST)
            if vote_any(may):
                for u in nvfly.static_range(UNROLL):
                    for e in nvfly.static_range(VEC):
                        col = start + ((it * UNROLL + u) * THREADS + tid) * VEC + e
                        take, _ = element_filter(current[u][e], col, stop, threshold, threshold_key, threshold_low,
                                                 LARGEST, FROM_RANKS)
                        count = count + take.to(nvfly.i32)
        else:
            for u in nvfly.static_range(UNROLL):
                for e in nvfly.static_range(VEC):
                    col = start + ((it * UNROLL + u) * THREADS + tid) * VEC + e
                    take, _ = element_filter(current[u][e] if VEC > 1 else current[u], col, stop, threshold,
                                             threshold_key, threshold_low, LARGEST, FROM_RANKS)
                    count = count + take.to(nvfly.i32)
        overflow = count < 0  # false; set by lane 31 of a warp whose append fills the buffer past the limit
        if vote_any(count > 0):
            # rare once the threshold has risen: reload the elements (an L1 hit) and filter them again rather
            # than keep their keys and flags in registers through the loop
            position, size = reserve(state, count, lane)
            overflow = (lane == 31) & (size > limit)
            for u in nvfly.static_range(UNROLL):
                col0 = start + ((it * UNROLL + u) * THREADS + tid) * VEC
                again = src.load(row, col0, width=VEC, mask=col0 < stop)
                for e in nvfly.static_range(VEC):
                    take, key = element_filter(again[e] if VEC > 1 else again, col0 + e, stop, threshold,
                                               threshold_key, threshold_low, LARGEST, FROM_RANKS)
                    buf.store(key if FROM_RANKS else rank64(key, col0 + e), position, mask=take)
                    position = position + take.to(nvfly.i32)
        if syncthreads_or(overflow):  # candidates are the elements ranked >= threshold
            threshold = select_top(buf, kept_buf, hist, state, warp_sums, scratch, k, tid, lane, warp, THREADS)
            threshold_key, threshold_low = threshold_halves(threshold)
            if fast:
                threshold_value = key_value(threshold_key, x.dtype, LARGEST)
        current = upcoming
    select_top(buf, kept_buf, hist, state, warp_sums, scratch, k, tid, lane, warp, THREADS)
    kept = state[0]  # k, or fewer when the slice is shorter
    if TO_RANKS:
        for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
            i = j * THREADS + tid
            if i < k:
                ranks_out[row, part * k + i] = buf.load(i, mask=i < kept, other=ABSENT)
    else:
        for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
            i = j * THREADS + tid
            if (i >= kept) & (i < K_POW2):
                buf[i] = ABSENT
        nvfly.syncthreads()
        bitonic_sort_descending(buf, tid, K_POW2, THREADS)
        for j in nvfly.static_range((K_POW2 + THREADS - 1) // THREADS):
            i = j * THREADS + tid
            if i < k:
                index = rank_index(buf[i])
                indices[row, i] = index.to(nvfly.i64)
                values[row, i] = x[row, index]


# ---------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class TopkPlan:
    """Launch shape of a TopK: the warp kernel (``warps`` rows per block) or the streaming kernel
    (``threads`` per block, ``parts`` slices per row merged by a second launch when rows are few)."""
    warp: bool
    vec: int
    warps: int = 1
    unroll: int = 0
    threads: int = 0
    cap: int = 0
    k_pow2: int = 0
    parts: int = 1
    slice_len: int = 0

    @property
    def smem_bytes(self) -> int:
        return _smem_bytes(self.cap, self.k_pow2) if not self.warp else 0


def _unroll(vec: int, itemsize: int) -> int:
    return min(MAX_UNROLL, STREAM_BYTES // (vec * itemsize))


def _capacity(per_iter: int, k_pow2: int, threads: int = STREAM_THREADS) -> int:
    """Candidate-buffer entries: one iteration's worth of appends on top of room for about 2k survivors."""
    margin = max(2 * k_pow2, threads)
    return per_iter + -(-margin // threads) * threads


def _smem_bytes(cap: int, k_pow2: int) -> int:
    return (cap + k_pow2) * 8 + HIST * 4 + 656


def slice_plan(n: int, k: int, m: int, vec: int, max_unroll: int, threads: int, sm_count: int) -> tuple[int, int, int]:
    """(parts, slice_len, unroll): how the rows are cut into slices, one block each. Slices are whole sweeps of
    ``threads * vec`` elements (the last one of a row may be short). Few rows: enough slices for about
    BLOCKS_PER_SM blocks on every SM, as long as a slice holds 4k elements or more and the merge reads at most
    MERGE_RANKS ranks a row (parts * k). A slice of c sweeps takes ceil(c / max_unroll) iterations of an unroll
    that spreads the sweeps evenly over them."""
    sweep = threads * vec
    sweeps = -(-n // sweep)
    parts = max(1, min(BLOCKS_PER_SM * sm_count // m, sweeps, n // (4 * k), MERGE_RANKS // k, MAX_PARTS))
    per_slice = -(-sweeps // parts)
    iterations = -(-per_slice // max_unroll)
    unroll = -(-per_slice // iterations)
    if parts == 1:
        unroll = max_unroll  # (as many loads in flight as the registers allow)
    elif vec == 1:
        unroll = max(unroll, 2)  # (ptxas spills a register at unroll 1 with scalar loads)
    return -(-sweeps // per_slice), per_slice * sweep, unroll


@functools.lru_cache(maxsize=4096)
def plan(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int) -> TopkPlan:
    """How to run a TopK of k over m rows of n elements (16-byte accesses hold ``vec`` elements)."""
    if k <= WARP_MAX_K and n <= WARP_MAX_N:
        return TopkPlan(True, vec, warps=max(1, min(8, m // (2 * sm_count))))
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    max_unroll = _unroll(vec, itemsize)
    # blocks of SLICE_THREADS, two to an SM, unless their shared memory is too large (k = 2048)
    threads = SLICE_THREADS
    if BLOCKS_PER_SM * (_smem_bytes(_capacity(threads * vec * max_unroll, k_pow2, threads), k_pow2) + 1024) > \
            SM_SMEM_BYTES:
        threads = STREAM_THREADS
    parts, slice_len, unroll = slice_plan(n, k, m, vec, max_unroll, threads, sm_count)
    return TopkPlan(False, vec, unroll=unroll, threads=threads,
                    cap=_capacity(threads * vec * unroll, k_pow2, threads), k_pow2=k_pow2, parts=parts,
                    slice_len=slice_len)


def _check(x: Any, k: Any, dim: Any) -> int:
    """Validate arguments (errors name the argument); returns the wrapped dim."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if str(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported (bfloat16, float16, float32)")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -max(1, x.dim()) <= dim < max(1, x.dim()):
        raise ValueError(f"dim: {dim!r} is out of range for a {x.dim()}-dimensional x")
    dim %= max(1, x.dim())
    size = x.shape[dim] if x.dim() else 1
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= size:
        raise ValueError(f"k: expected an int in [0, {size}] (the size of dimension {dim}), got {k!r}")
    if k > MAX_K:
        raise ValueError(f"k: at most {MAX_K} is supported, got {k}")
    return dim


def eligibility(x: Any, k: Any, dim: Any = -1, largest: bool = True, sorted: bool = True) -> Optional[str]:
    """None when nvfly computes this TopK, else the reason it declines (callers then use torch)."""
    try:
        dim = _check(x, k, dim)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if x.dim() == 0 or dim != x.dim() - 1:
        return "dim is not the last dimension"
    if k == 0 or x.numel() == 0:
        return "the result is empty"
    if x.numel() >= 1 << 31:
        return "x has 2**31 elements or more"
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    return None


# Per-call plans, keyed on everything the argument checks and the launches depend on (see rmsnorm._FORWARD): the
# first call of a key checks and plans, later ones allocate the outputs and launch.
_PLAN_LIMIT = 4096
_TOPK: dict[Any, "_Topk"] = {}


@dataclass
class _Topk:
    """A TopK call's plan: (m, k) outputs for m rows of n; ``direct`` when x is a 2-D tensor with unit-stride
    rows and dim is its last (outputs and x are then used as they are); ``run(rows, values, indices)``
    launches (None: nothing to launch)."""
    m: int
    n: int
    k: int
    dim: int
    direct: bool
    run: Any


def topk(x: "torch.Tensor", k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(values, int64 indices) of the k largest (``largest=False``: smallest) elements along ``dim``, sorted
    (also when ``sorted=False``), ties and NaN as described in the module doc."""
    try:
        key = (layout_key(x), k, type(k), dim, type(dim), largest)
        t = _TOPK.get(key)
    except Exception:  # noqa: BLE001 - not a tensor, an unhashable argument: the checks explain
        key = t = None
    if t is None:
        t = _plan_call(key, x, k, dim, largest)
    import torch
    if t.direct:
        values = torch.empty((t.m, t.k), dtype=x.dtype, device=x.device)
        indices = torch.empty((t.m, t.k), dtype=torch.int64, device=x.device)
        t.run(x, values, indices)
        return values, indices
    return _topk_general(t, x)


def _topk_general(t: _Topk, x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Any dim and layout: rows along ``dim`` (a copy where they are not unit-stride), outputs moved back."""
    import torch
    dim, m, n, k = t.dim, t.m, t.n, t.k
    last = x.dim() - 1
    moved = x if dim == last else x.movedim(dim, -1) if x.dim() else x.reshape(1)
    lead = moved.shape[:-1]
    values = torch.empty((m, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((m, k), dtype=torch.int64, device=x.device)
    if t.run is not None:
        rows = moved.reshape(m, n)
        if rows.stride(1) != 1 and n > 1:
            rows = rows.contiguous()
        t.run(rows, values, indices)

    def place(out: "torch.Tensor") -> "torch.Tensor":
        if not x.dim():
            return out.reshape(())
        out = out.reshape(*lead, k)
        return out if dim == last else out.movedim(-1, dim)
    return place(values), place(indices)


def _plan_call(key: Any, x: Any, k: Any, dim: Any, largest: Any) -> _Topk:
    """The first call of a key: the checks (they raise), then the plan, remembered under ``key``."""
    dim = _check(x, k, dim)
    n = x.shape[dim] if x.dim() else 1
    m = math.prod(s for i, s in enumerate(x.shape) if i != dim)
    direct = x.dim() == 2 and dim == 1 and (x.stride(1) == 1 or n == 1)
    run = None
    if k and m:
        vec = vector_width(n, (_rows_like(x, dim, m, n),), x.element_size())
        run = _runner(plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device())), m, n, k, bool(largest))
    t = _Topk(m, n, k, dim, direct and run is not None, run)
    if key is not None:
        if len(_TOPK) >= _PLAN_LIMIT:
            _TOPK.clear()
        _TOPK[key] = t
    return t


def _rows_like(x: "torch.Tensor", dim: int, m: int, n: int) -> "torch.Tensor":
    """The (m, n) rows the kernels read (as ``_topk_general`` makes them): for the vector width."""
    moved = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    rows = moved.reshape(m, n)
    return rows if rows.stride(1) == 1 or n == 1 else rows.contiguous()


def _runner(p: TopkPlan, m: int, n: int, k: int, largest: bool) -> Any:
    """``run(rows, values, indices)`` for a plan: one or two prepared launches."""
    import torch
    if p.warp:
        warp = topk_warp_kernel.prepared(-(-m // p.warps), 32 * p.warps)
        tail: tuple = (m, k, n, p.vec, p.warps, largest)
        return lambda rows, values, indices: warp.launch(rows, values, indices, *tail)
    if p.parts == 1:
        single = topk_radix_kernel.prepared((m, 1, 1), p.threads)
        tail = (k, n, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, False, False)
        return lambda rows, values, indices: single.launch(rows, rows, values, indices, rows, *tail)
    # slices of each row write their k best ranks; a second launch merges them (2 ranks per 16-byte access).
    # The ranks are a fresh allocation each call (the caching allocator's, a few microseconds): a buffer kept
    # across calls would need one per stream and would break under CUDA graph capture.
    first = topk_radix_kernel.prepared((m, p.parts, 1), p.threads)
    first_tail = (k, p.slice_len, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, False, True)
    merge_vec = 2 if p.parts * k % 2 == 0 else 1
    merge_unroll = _unroll(merge_vec, 8)
    merge_cap = _capacity(STREAM_THREADS * merge_vec * merge_unroll, p.k_pow2, STREAM_THREADS)
    merge = topk_radix_kernel.prepared((m, 1, 1), STREAM_THREADS)
    merge_tail = (k, p.parts * k, merge_vec, merge_unroll, STREAM_THREADS, merge_cap, p.k_pow2, largest, True, False)
    ranks_shape = (m, p.parts * k)

    def run(rows: "torch.Tensor", values: "torch.Tensor", indices: "torch.Tensor") -> None:
        ranks = torch.empty(ranks_shape, dtype=torch.int64, device=rows.device)
        first.launch(rows, rows, values, indices, ranks, *first_tail)
        merge.launch(rows, ranks, values, indices, ranks, *merge_tail)
    return run
