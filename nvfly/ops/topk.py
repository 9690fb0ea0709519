"""TopK along the last dimension: values and int64 indices like ``torch.topk``, k from 1 to 2048.

Order and ties. Every element gets a unique 64-bit rank, ``comp = (key << 32) | ~index``, where ``key`` is the
value's bits made monotone (so -0.0 ranks below +0.0, like torch's radix select) and NaN (any payload) ranks
above +inf, as in torch on CUDA; ``largest=False`` inverts the key, so NaNs then come last. The result is the k
largest ranks in decreasing order: equal values are taken and listed lowest index first. That is exactly
``torch.sort(x, descending=largest, stable=True)[..., :k]`` (NaN treated as the largest value). torch.topk on
CUDA picks the same elements (everything strictly better than the k-th value, then the lowest indices equal to
it) and lists them in the same order when k > 32 (its sort is stable there); for k <= 32 its bitonic sort may
list equal values in another index order. Values are gathered from the input by index, bit for bit.

Three kernels:
- ``topk_warp_kernel`` (k <= 32, rows up to 1024 elements, e.g. MoE routing): one warp per row, each lane
  holds ``N/32`` ranks in registers; k rounds of "lane max, warp max (redux.sync), retire the winner", so the
  output comes out sorted. One read of the row.
- ``topk_radix_kernel`` (everything else, e.g. sampling over 128K-152K vocabularies): one block per row (or per
  slice of a row, then ``topk_merge_kernel``) streams the row once with 16-byte loads, appending every element
  that ranks at or above a running threshold T to a shared-memory candidate buffer. T starts at the k-th
  largest of the maxima of 2k-4k disjoint groups of the first elements (a lower bound of the k-th largest
  rank). When the buffer may overflow, a select keeps the k largest candidates and raises T to the smallest
  of them; after the row one more select leaves exactly k, which a bitonic sort orders.
  Stream: per element one float compare with the value of a key just below T's (``flag_key``; two 16-bit
  values per ``set.gtu.u32.bf16x2``, NaN unordered, so flagged) sets a bit of a per-thread 32-bit mask: a
  superset of the candidates (-0.0/+0.0 and, in the first iteration, T's own key included; later every column
  lies beyond T's, so an element with T's key ranks below it). The flagged elements then go one per lane a
  round: picked from the loads in registers (``pick``: a tree of selects), checked exactly, appended with a
  ballot and one shared atomic per warp. About 1-2 instructions an element while T is high instead of ~15 for
  the rank test and ~20 more to append.
  Select: one sweep counts the real candidates and their key range (one barrier); radix passes with 11-bit
  digits from the highest differing key bit, skipping the ~index bits above the row's highest index bit (ones
  in every rank), each pass shared-memory atomics into one of two histograms and ``locate_bucket`` (every
  thread finds the bucket from warp, lane and bucket sums: two barriers a pass, the other histogram zeroed on
  the way); a compaction with a block scan instead of per-warp atomics. Nothing runs when k or fewer are real.
  Sort (``sort_descending``): each thread holds R consecutive entries in registers (``sort_per_thread``: 4 for
  1024 entries over 256 threads; 128 or fewer stay in one warp); strides below R swap in the thread, below 32R
  through warp shuffles, larger ones through shared memory (1024 entries: 6 barriers for the 55 stages).
  Blocks have 256 threads (two per SM; 512 when k = 2048). Fewer rows than 2 blocks per SM: each row is cut
  into slices of whole 256 x vec sweeps (``slice_plan``: down to one sweep, at least 4k elements, at most
  MERGE_RANKS / k slices), each slice writes its k best ranks and a second launch merges them.
- ``topk_merge_kernel``: one block of 512 threads a row loads the slices' parts * k ranks straight into shared
  memory, selects once and sorts.
- Rows cut into slices run ``topk_row``'s kernels instead where that measured faster (``plan``'s ``row_threshold``,
  by default ``ROW_THRESHOLD_MIN_K`` / ``ROW_THRESHOLD_MIN_PARTS``; blocks of 512 threads, one an SM, where
  ``row_threads`` says; rows of one slice with k >= 256 in two slices): a row-wide histogram of the top key bits, then
  every slice appends its elements in the k-th key's bucket or above and the row's last block selects and sorts
  them (``stream_top`` when there are too many: heavy ties at the threshold make it slow, not wrong). Opt-in
  ``plan(..., two_level=True)``: the select launch also counts the threshold bucket's next key bits, so the last
  block knows the k-th key's second-level bucket and selects without radix passes.

Where the time goes (estimates, H200): ``benchmarks/results/topk_notes.md``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import nvfly
from nvfly.arch.ptx import asm
from nvfly.frontend.language import atomic_add, redux_sync, syncthreads_or, vote_any
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import layout_key, vector_width

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
MAX_K = 2048
WARP_MAX_K = 32           # the warp kernel's k rounds each cost a warp reduction
WARP_MAX_N = 1024         # and each lane holds N/32 ranks in registers
HIST_BITS = 11            # radix digit of the select: 2048 shared-memory counters
HIST = 1 << HIST_BITS
SWEEP = 4                 # candidates a thread loads at once in the select's sweeps over shared memory
STREAM_BYTES = 64         # loaded per thread per streaming iteration (and as much prefetched): 32 KB per block
STREAM_THREADS = 512      # the merge's blocks (and the first pass's when k is 2048)
SLICE_THREADS = 256       # the first pass's blocks: two to an SM
BLOCKS_PER_SM = 2
SM_SMEM_BYTES = 228 * 1024  # shared memory of an SM (each block also takes 1 KB of it)
MERGE_RANKS = 16384       # the most ranks a row's merge reads (parts * k): 128 KB
ROW_CAP_MAX = 8192        # the most candidates a row-threshold plan collects for a row (``topk_row``)
MAX_PARTS = 128
# rows cut into slices take the row-threshold plan when k or the slices are this many. Measured on the H200
# (benchmarks/results/topk_plans_h200.json, us, slices+merge -> row threshold): 1x151936 k=50 (37-75 slices)
# 21.1 -> 15.5, k=1024 43.7 -> 23.3, 64x151936 k=1024 (4 slices) 64.0 -> 46.8, but 64x151936 k=50 (4 slices)
# 29.5 -> 31.9; the thresholds between those points are not measured
ROW_THRESHOLD_MIN_K = 256
ROW_THRESHOLD_MIN_PARTS = 8
# rows of one slice take the row-threshold plan's two slices when k >= ROW_THRESHOLD_MIN_K, the rows are this long
# and few enough for two waves: 256x128256 k=1024 bf16 76.0 -> 66.0 us, 256x151936 82.3 -> 74.7 (CUDA graphs,
# topk_threads_probe_h200.log; the radix kernel raises its threshold through many selects at k = 1024). Shorter
# rows are not measured
ROW_SPLIT_MIN_N = 65536
WIDE_THREADS = 512        # the row-threshold plan's blocks where ``row_threads`` says
# One launch: every block of a row writes a share of its k from k = 256 (H200, bf16, one row of 128256-151936, CUDA
# graphs: k = 1024 12.8 -> 11.7 us; k = 50 9.0 -> 9.7, the shared finish's extra wait not paid back by its shares;
# benchmarks/results/topk_shared_finish_every_k_probe_h200.log)
SHARED_FINISH_MIN_K = 256
COPIES = 8  # shared histograms a row-threshold histogram block counts into (64 KB, ``topk_row``)
# The select launch re-reads the rows the histogram launch just read: once they outgrow the L2 (50 MB), reading them
# in reverse order starts on what is still cached. Measured (topk_reversed_select_h200.log, bf16 k = 1024, us from
# CUDA graphs): 256x128256 (63 MB) 66.3 -> 60.0, 256x151936 (74 MB) 75.9 -> 69.0, 192x128256 (47 MB) 53.3 -> 51.2; below
# the L2 a little slower (128x128256, 31 MB: 35.2 -> 36.0; 160 rows, 39 MB: 49.9 -> 50.3); fp32 unchanged either way.
REVERSED_SELECT_MIN_BYTES = 44 << 20
EXACT_BINS = 256  # 16-bit keys the one-launch plan's exact finish counts (8 first-level buckets), a thread each
MAX_UNROLL = 8            # loads per thread per iteration (narrow accesses would need too many registers)
ABSENT = -(1 << 63)       # the rank of "no element": below every real rank (a real ~index is never 0)
_KEY_MSB = 0x80000000
_NAN_ABOVE = {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}  # |bits| above this: NaN


# ---------------------------------------------------------------------------------------------- ranks
@nvfly.func
def value_bits(value):
    """The bits of a bf16/f16/f32 value as a u32 (16-bit floats in the low half)."""
    if value.dtype == nvfly.f32:
        return value.bitcast(nvfly.u32)
    return (value.bitcast(nvfly.i16).to(nvfly.i32) & 0xFFFF).bitcast(nvfly.u32)


@nvfly.func
def bits_key(bits, dtype, LARGEST):
    """``order_key`` of the value with these bits (``value_bits``) and dtype."""
    if dtype == nvfly.f32:
        sign_fill = (bits.bitcast(nvfly.i32) >> 31).bitcast(nvfly.u32)
        key = bits ^ (sign_fill | _KEY_MSB)
        key = nvfly.select((bits & 0x7FFFFFFF) > _NAN_ABOVE["f32"], 0xFFFFFFFF, key)
        inverted = 0xFFFFFFFF
    else:
        key = bits ^ (((bits >> 15) * 0x7FFF) | 0x8000)
        key = nvfly.select((bits & 0x7FFF) > _NAN_ABOVE[dtype.name], 0xFFFF, key)
        inverted = 0xFFFF
    if not LARGEST:
        key = key ^ inverted
    return key


@nvfly.func
def order_key(value, LARGEST):
    """The u32 key of a bf16/f16/f32 value: larger key = earlier in the output (NaN first when LARGEST)."""
    return bits_key(value_bits(value), value.dtype, LARGEST)


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
            best = tree_reduce(ranks, nvfly.maximum)
            best = redux_sync(best, "max") if packed else warp_max_rank64(best)
            ranks = [nvfly.select(r == best, absent, r) for r in ranks]  # ranks are unique: retire the winner
            mine = nvfly.select(lane == j, best, mine)
        if lane < K:
            index = (0xFFFF - (mine & 0xFFFF)).bitcast(nvfly.i32) if packed else rank_index(mine)
            indices[row, lane] = index.to(nvfly.i64)
            values[row, lane] = x[row, index]


# ---------------------------------------------------------------------------------------------- warp helpers
def tree_reduce(values: list, combine: Callable[[Any, Any], Any]) -> Any:
    """``values`` combined by a tree of pairwise ``combine``: log2(n) dependent steps, not n - 1 (a 64-bit
    maximum is four dependent instructions)."""
    while len(values) > 1:
        values = [combine(a, b) for a, b in zip(values[::2], values[1::2])] + values[len(values) & ~1:]
    return values[0]


@nvfly.func
def warp_max_rank64(rank):
    """The largest 64-bit rank of the (whole, converged) warp in every lane: two ``redux.sync`` (the high words,
    then the low words of the lanes that hold the highest) instead of five rounds of 64-bit shuffles and
    compares."""
    high = (rank >> 32).to(nvfly.i32)
    top = redux_sync(high, "max")
    low = redux_sync(nvfly.select(high == top, rank.to(nvfly.i32).bitcast(nvfly.u32), nvfly.u32(0)), "max")
    return (top.to(nvfly.i64) << 32) | low.to(nvfly.i64)


@nvfly.func
def warp_inclusive_sum(value, lane):
    """Inclusive prefix sum over the lanes of a warp (5 shuffles)."""
    for offset in nvfly.static_range(5):
        moved = nvfly.shfl_up(value, 1 << offset)
        value = value + nvfly.select(lane >= (1 << offset), moved, 0)
    return value


@nvfly.func
def warp_suffix_sum(value, lane):
    """The sum of ``value`` over this lane and the warp's higher lanes (5 shuffles)."""
    for step in nvfly.static_range(5):
        moved = nvfly.shfl_down(value, 1 << step)
        value = value + nvfly.select(lane + (1 << step) < 32, moved, 0)
    return value


@nvfly.func
def block_sum_above(value, warp_sums, lane, warp, WARPS):
    """The sum of ``value`` over the block's higher threads: the warp's higher lanes, then the higher warps' totals
    through ``warp_sums[:WARPS]`` after one barrier."""
    suffix = warp_suffix_sum(value, lane)
    if lane == 0:
        warp_sums[warp] = suffix
    nvfly.syncthreads()
    above = suffix - value
    for w in nvfly.static_range(WARPS):
        above = above + nvfly.select(w > warp, warp_sums[w], 0)
    return above


@nvfly.func
def ballot(pred):
    """The lanes of the (whole, converged) warp where ``pred`` holds, as a u32 bit mask."""
    return asm("{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, -1; }", [pred.to(nvfly.u32)],
               nvfly.u32)


@nvfly.func
def popc(bits):
    return asm("popc.b32 $0, $1;", [bits], nvfly.i32, side_effects=False)


@nvfly.func
def highest_bit(bits):
    """The index of the highest set bit of a u32 (0xFFFFFFFF when none)."""
    return asm("bfind.u32 $0, $1;", [bits], nvfly.u32, side_effects=False)


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
    below = asm("mov.u32 $0, %lanemask_lt;", [], nvfly.u32, side_effects=False)
    return base + popc(votes & below), base + total


# ---------------------------------------------------------------------------------------------- the select
@nvfly.func
def rank_key(rank):
    """The u32 key of a 64-bit rank (``rank64``'s inverse for the high half)."""
    return ((rank >> 32).to(nvfly.i32) ^ _KEY_MSB).bitcast(nvfly.u32)


@nvfly.func
def sweep_loads(buf, first, count, THREADS):
    """``buf[first + j*THREADS]`` for j < SWEEP (ABSENT past ``count``): one step of a thread's strided sweep
    over the candidates, its shared-memory loads issued together."""
    return [buf.load(first + j * THREADS, mask=first + j * THREADS < count, other=ABSENT)
            for j in nvfly.static_range(SWEEP)]


@nvfly.func
def block_count_key_range(reals, key_high, key_low, warp_sums, lane, warp, WARPS):
    """(sum of ``reals``, max of ``key_high``, min of ``key_low``) over the block: one barrier."""
    reals = redux_sync(reals, "add")
    key_high = redux_sync(key_high, "max")
    key_low = redux_sync(key_low, "min")
    if lane == 0:
        warp_sums[warp] = reals
        warp_sums[16 + warp] = key_high.bitcast(nvfly.i32)
        warp_sums[32 + warp] = key_low.bitcast(nvfly.i32)
    nvfly.syncthreads()
    reals = warp_sums[0]
    key_high = warp_sums[16].bitcast(nvfly.u32)
    key_low = warp_sums[32].bitcast(nvfly.u32)
    for w in nvfly.static_range(1, WARPS):
        reals = reals + warp_sums[w]
        key_high = nvfly.maximum(key_high, warp_sums[16 + w].bitcast(nvfly.u32))
        key_low = nvfly.minimum(key_low, warp_sums[32 + w].bitcast(nvfly.u32))
    return reals, key_high, key_low


@nvfly.func
def locate_bucket(hist, lane_sums, warp_sums, offset, other, needed, tid, lane, warp, THREADS):
    """(bucket, ranks in higher buckets, ranks in the bucket) of the ``needed``-th largest rank counted in
    ``hist[offset:offset + HIST]``, in every thread after one barrier; zeroes ``hist[other:other + HIST]`` for the
    next pass. Thread t owns buckets [t*PER, (t+1)*PER): it publishes the ranks counted in its and the higher
    lanes' buckets of its warp (and lane 0 the warp's total); then every thread finds the warp, the lane and the
    bucket from the top."""
    PER = HIST // THREADS
    counts = [hist[offset + tid * PER + i] for i in nvfly.static_range(PER)]
    for i in nvfly.static_range(PER):
        hist[other + tid * PER + i] = 0
    suffix = counts[0]
    for c in counts[1:]:
        suffix = suffix + c
    suffix = warp_suffix_sum(suffix, lane)
    lane_sums[tid] = suffix
    if lane == 0:
        warp_sums[warp] = suffix
    nvfly.syncthreads()
    target = nvfly.i32(0)
    above = nvfly.i32(0)
    higher = nvfly.i32(0)
    for w in nvfly.static_range(THREADS // 32 - 1, -1, -1):
        in_warp = warp_sums[w]
        hit = (higher < needed) & (needed <= higher + in_warp)
        target = nvfly.select(hit, w, target)
        above = nvfly.select(hit, higher, above)
        higher = higher + in_warp
    lane_suffix = lane_sums[target * 32 + lane]
    owner_lane = highest_bit(ballot(above + lane_suffix >= needed)).bitcast(nvfly.i32)  # suffixes fall with the lane
    next_suffix = nvfly.shfl_idx(lane_suffix, nvfly.minimum(owner_lane + 1, 31))
    above = above + nvfly.select(owner_lane == 31, 0, next_suffix)
    owner = target * 32 + owner_lane
    bucket = nvfly.i32(0)
    bucket_above = nvfly.i32(0)
    in_bucket = nvfly.i32(0)
    for i in nvfly.static_range(PER - 1, -1, -1):
        c = hist[offset + owner * PER + i]
        hit = (above < needed) & (needed <= above + c)
        bucket = nvfly.select(hit, owner * PER + i, bucket)
        bucket_above = nvfly.select(hit, above, bucket_above)
        in_bucket = nvfly.select(hit, c, in_bucket)
        above = above + c
    return bucket, bucket_above, in_bucket


@nvfly.func
def radix_threshold(buf, hist, lane_sums, warp_sums, count, needed, key_high, key_low, index_top, tid, lane, warp,
                    THREADS):
    """(a bound such that exactly the ``needed`` largest real ranks of ``buf[:count]`` (more than ``needed`` are
    real) are >= it; the offset of the histogram the last pass left to zero).

    Radix select on u = rank ^ ABSENT (ranks as unsigned numbers): 11-bit digits from the highest bit where the
    real keys differ (or, when they are all equal, the highest index bit: ``~index`` has ones above bit
    ``index_top`` of every real index), skipping those constant index bits when the digits reach them, until the
    bucket of the needed-th rank holds exactly the ranks still needed. A pass is one sweep of shared-memory
    atomics into one of two histograms and ``locate_bucket``: two barriers."""
    keys_differ = key_high != key_low
    top = nvfly.select(keys_differ, highest_bit(key_high ^ key_low).bitcast(nvfly.i32) + 32, index_top)
    index_ones = nvfly.u32(0xFFFFFFFF) & ~((nvfly.u32(2) << index_top.bitcast(nvfly.u32)) - 1)
    span = (nvfly.i64(2) << top.to(nvfly.i64)) - 1  # (2 << 63 wraps to 0: span -1, all bits free)
    range_low = ((key_high.to(nvfly.i64) << 32) & ~span) | nvfly.select(keys_differ, 0, index_ones).to(nvfly.i64)
    range_high = range_low | span
    shift = nvfly.maximum(top - (HIST_BITS - 1), 0)
    threshold = nvfly.i64(ABSENT)
    parity = nvfly.i32(0)
    searching = nvfly.i32(1)
    while searching != 0:
        low = nvfly.maximum(range_low ^ ABSENT, ABSENT + 1)  # (ABSENT entries never count)
        high = range_high ^ ABSENT
        offset = parity * HIST
        for first in range(tid, count, SWEEP * THREADS):
            for r in sweep_loads(buf, first, count, THREADS):
                if (r >= low) & (r <= high):
                    atomic_add(hist, offset + (((r ^ ABSENT) >> shift.to(nvfly.i64)) & (HIST - 1)).to(nvfly.i32), 1)
        nvfly.syncthreads()
        bucket, above, in_bucket = locate_bucket(hist, lane_sums, warp_sums, offset, HIST - offset, needed, tid,
                                                 lane, warp, THREADS)
        needed = needed - above
        range_low = range_low | (bucket.to(nvfly.i64) << shift.to(nvfly.i64))
        if (in_bucket == needed) | (shift == 0):
            searching = nvfly.i32(0)
            threshold = range_low ^ ABSENT
        else:
            next_top = shift - 1
            if (next_top < 32) & (next_top > index_top):  # skip the index bits that are ones in every real rank
                range_low = range_low | ((nvfly.i64(1) << shift.to(nvfly.i64)) - 1) & \
                    ~((nvfly.i64(2) << index_top.to(nvfly.i64)) - 1)
                next_top = index_top
            range_high = range_low | ((nvfly.i64(2) << next_top.to(nvfly.i64)) - 1)
            shift = nvfly.maximum(next_top - (HIST_BITS - 1), 0)
            parity = parity ^ 1
    return threshold, parity * HIST


@nvfly.func
def compact(buf, kept_buf, hist, warp_sums, warp_lows, state, count, threshold, dirty, tid, lane, warp, THREADS):
    """Keep the real ranks >= ``threshold`` of ``buf[:count]`` at ``buf[:kept]`` (in another order),
    ``state[0] = kept``; returns the smallest kept rank; zeroes this thread's buckets of ``hist[dirty:dirty +
    HIST]`` (the last pass's) once every thread is done reading them. Each thread counts its keepers, a block
    scan (one barrier) gives its first slot, it writes them to ``kept_buf``, and the block copies them back."""
    PER = HIST // THREADS
    mine = nvfly.i32(0)
    lowest = nvfly.i64(-1 - ABSENT)
    for first in range(tid, count, SWEEP * THREADS):
        for r in sweep_loads(buf, first, count, THREADS):
            keep = (r != ABSENT) & (r >= threshold)
            mine = mine + keep.to(nvfly.i32)
            lowest = nvfly.select(keep, nvfly.minimum(lowest, r), lowest)
    inclusive = warp_inclusive_sum(mine, lane)
    lowest = nvfly.warp_reduce(lowest, "min")
    if lane == 31:
        warp_sums[48 + warp] = inclusive
        warp_lows[warp] = lowest
    nvfly.syncthreads()
    position = inclusive - mine
    kept = nvfly.i32(0)
    for w in nvfly.static_range(THREADS // 32):
        in_warp = warp_sums[48 + w]
        position = position + nvfly.select(w < warp, in_warp, 0)
        kept = kept + in_warp
        lowest = nvfly.minimum(lowest, warp_lows[w])
    for first in range(tid, count, SWEEP * THREADS):
        for r in sweep_loads(buf, first, count, THREADS):  # (the same order as the count)
            keep = (r != ABSENT) & (r >= threshold)
            kept_buf.store(r, position, mask=keep)
            position = position + keep.to(nvfly.i32)
    for i in nvfly.static_range(PER):
        hist[dirty + tid * PER + i] = 0
    nvfly.syncthreads()
    for first in range(tid, kept, SWEEP * THREADS):
        for j, r in enumerate(sweep_loads(kept_buf, first, kept, THREADS)):
            buf.store(r, first + j * THREADS, mask=first + j * THREADS < kept)
    if tid == 0:
        state[0] = kept
    nvfly.syncthreads()
    return lowest


@nvfly.func
def select_top(buf, kept_buf, hist, lane_sums, warp_sums, warp_lows, state, needed, index_top, tid, lane, warp,
               THREADS):
    """Keep the ``needed`` largest real ranks of ``buf[:state[0]]`` (all of them if there are no more) at
    ``buf[:kept]``, ``state[0] = kept``; returns T: the needed-th largest rank, the smallest kept (an element's
    rank, so an element of a later column with T's key ranks below it), or ABSENT when all are kept. One sweep
    counts the real ranks and finds their key range (one barrier); the radix passes run only when more than
    ``needed`` are real, the compaction only when something is dropped."""
    count = state[0]
    reals = nvfly.i32(0)
    key_high = nvfly.u32(0)
    key_low = nvfly.u32(0xFFFFFFFF)
    for first in range(tid, count, SWEEP * THREADS):
        for r in sweep_loads(buf, first, count, THREADS):
            real = r != ABSENT
            key = rank_key(r)
            reals = reals + real.to(nvfly.i32)
            key_high = nvfly.select(real, nvfly.maximum(key_high, key), key_high)
            key_low = nvfly.select(real, nvfly.minimum(key_low, key), key_low)
    reals, key_high, key_low = block_count_key_range(reals, key_high, key_low, warp_sums, lane, warp, THREADS // 32)
    bound = nvfly.i64(ABSENT)
    dirty = nvfly.i32(0)
    if reals > needed:
        bound, dirty = radix_threshold(buf, hist, lane_sums, warp_sums, count, needed, key_high, key_low,
                                       index_top, tid, lane, warp, THREADS)
    threshold = nvfly.i64(ABSENT)
    if (reals > needed) | (reals != count):
        lowest = compact(buf, kept_buf, hist, warp_sums, warp_lows, state, count, bound, dirty, tid, lane, warp,
                         THREADS)
        threshold = nvfly.select(reals > needed, lowest, threshold)
    return threshold


# ---------------------------------------------------------------------------------------------- the sort
def sort_per_thread(size: int, threads: int) -> int:
    """Entries per thread of the register bitonic sort of ``size`` entries: at least 4 (or all of a warp's
    share when fewer), so that strides below 4 stay in registers and those below 128 within a warp."""
    return max(1, size // threads, min(4, size // 32))


def bitonic_stages(size: int) -> list[tuple[int, int]]:
    """(block, stride) of each compare-exchange stage of a bitonic sort of ``size`` (a power of two) entries:
    entry i meets entry i ^ stride and keeps the larger when i is the lower one and (i & block) == 0."""
    stages = []
    block = 2
    while block <= size:
        stride = block // 2
        while stride >= 1:
            stages.append((block, stride))
            stride //= 2
        block *= 2
    return stages


@nvfly.func
def sort_descending(buf, spare, kept, tid, lane, SIZE, THREADS):
    """``buf[:kept]`` followed by ABSENT up to ``SIZE`` in decreasing order, in registers: thread t holds entries
    [t*R, (t+1)*R) (R = ``sort_per_thread``). Strides below R are exchanged within the thread, strides up to
    32R by warp shuffles, larger ones through shared memory (``spare`` and ``buf`` in turn: one barrier each).
    Returns this thread's R sorted entries."""
    R = sort_per_thread(SIZE, THREADS)
    first = tid * R
    active = first < SIZE
    items = [buf.load(first + j, mask=first + j < kept, other=ABSENT) for j in nvfly.static_range(R)]
    exchanges = 0
    for block, stride in bitonic_stages(SIZE):
        # entry first + j is in a descending run when (first + j) & block == 0: for a block smaller than R
        # j decides (first is a multiple of R), for a larger one first does (j < R adds no carry past bit R)
        descending = (first & block) == 0
        if stride < R:
            for j in nvfly.static_range(R):
                if j & stride == 0:
                    a, b = items[j], items[j | stride]
                    larger, smaller = nvfly.maximum(a, b), nvfly.minimum(a, b)
                    if block < R:
                        items[j], items[j | stride] = (larger, smaller) if j & block == 0 else (smaller, larger)
                    else:
                        items[j] = nvfly.select(descending, larger, smaller)
                        items[j | stride] = nvfly.select(descending, smaller, larger)
        else:
            if stride < 32 * R:
                lower = (lane & (stride // R)) == 0
                others = [nvfly.shfl_xor(items[j], stride // R) for j in nvfly.static_range(R)]
            else:
                area = spare if exchanges % 2 == 0 else buf
                exchanges += 1
                for j in nvfly.static_range(R):
                    area.store(items[j], first + j, mask=active)
                nvfly.syncthreads()
                lower = (first & stride) == 0
                others = [area.load((first + j) ^ stride, mask=active, other=ABSENT) for j in nvfly.static_range(R)]
            for j in nvfly.static_range(R):
                keep_larger = lower == descending  # (stride >= R: the block is larger than R)
                items[j] = nvfly.select(keep_larger, nvfly.maximum(items[j], others[j]),
                                        nvfly.minimum(items[j], others[j]))
    return items


# ---------------------------------------------------------------------------------------------- kernels
@nvfly.func
def element_filter(key, col, stop, threshold_key, threshold_low):
    """Whether the element with this key at this column is in the slice and ranks >= the threshold, whose
    (key, ~index) halves are given: u32 work instead of a 64-bit rank per element."""
    low = (~col).bitcast(nvfly.u32)
    return (col < stop) & ((key > threshold_key) | ((key == threshold_key) & (low >= threshold_low)))


_PACKED = {"bf16": "bf16x2", "f16": "f16x2"}


@nvfly.func
def half_to_f32(bits, dtype):
    """The f32 value of a 16-bit float (bf16/f16) given as the low 16 bits of ``bits`` (u32): exact."""
    if dtype == nvfly.bf16:
        return (bits << 16).bitcast(nvfly.f32)
    half = (bits & 0xFFFF).bitcast(nvfly.i32).to(nvfly.i16)
    return asm("cvt.f32.f16 $0, $1;", [half], nvfly.f32, side_effects=False)


@nvfly.func
def key_bits(key, dtype, LARGEST):
    """The bits (u32; 16-bit floats in the low half) of the value whose order key is ``key`` (``order_key``'s
    inverse; NaN for the NaN key and for key 0, the key of ABSENT)."""
    if not LARGEST:
        key = key ^ (0xFFFFFFFF if dtype == nvfly.f32 else 0xFFFF)
    if dtype == nvfly.f32:
        return nvfly.select((key & _KEY_MSB) != 0, key ^ _KEY_MSB, ~key)
    return nvfly.select((key & 0x8000) != 0, key ^ 0x8000, key ^ 0xFFFF)


_ZERO_BELOW = {"f32": 0x7FFFFFFF, "bf16": 0x7FFF, "f16": 0x7FFF}  # key of the zero ranked lower (-0.0 when largest)


@nvfly.func
def flag_key(threshold_key, ties, dtype):
    """The key whose value flags elements: every element that ranks at or above a threshold with key
    ``threshold_key`` compares above that value as a float (below it when smallest) or is unordered with it.
    ``ties``: an element with the threshold's key may rank above it (a lower index), so one key lower; the
    lower-ranked zero one key lower again (-0.0 < +0.0 as keys, not as floats). Key 0 (NaN) flags everything."""
    flag = threshold_key - nvfly.select(ties & (threshold_key != 0), 1, 0).bitcast(nvfly.u32)
    return flag - nvfly.select(flag == _ZERO_BELOW[dtype.name], 1, 0).bitcast(nvfly.u32)


def flag_bit(u: int, e: int, vec: int, packed: bool) -> int:
    """The bit of a thread's per-iteration flags that stands for element ``e`` of its load ``u``. Packed (16-bit
    values compared two to a u32 word): word w = u * vec/2 + e/2 takes bit w for its low half, w + 16 for its
    high half (so one AND of the compare's 0xFFFF halves with 0x00010001 << w places both)."""
    if packed:
        return u * (vec // 2) + e // 2 + 16 * (e % 2)
    return u * vec + e


def flag_element(bit: Any, vec: int, packed: bool) -> tuple[Any, Any]:
    """(u, e) of a flag bit: ``flag_bit``'s inverse (Python ints or traced i32)."""
    if packed:
        words_log2 = (vec // 2).bit_length() - 1
        word = bit & 15
        return word >> words_log2, ((word & (vec // 2 - 1)) << 1) | (bit >> 4)
    vec_log2 = vec.bit_length() - 1
    return bit >> vec_log2, bit & (vec - 1)


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
                hit = asm(f"set.{cmp}.u32.{_PACKED[dtype.name]} $0, $1, $2;", [words[w], pair], nvfly.u32,
                          side_effects=False)
                flags = flags | (hit & (0x00010001 << flag_bit(u, 2 * w, VEC, True)))
    else:
        flag_value = flag.bitcast(nvfly.f32) if dtype == nvfly.f32 else half_to_f32(flag, dtype)
        for u in nvfly.static_range(UNROLL):
            for e in nvfly.static_range(VEC):
                v = current[u][e] if VEC > 1 else current[u]
                if dtype != nvfly.f32:
                    v = half_to_f32((v.bitcast(nvfly.i16).to(nvfly.i32) & 0xFFFF).bitcast(nvfly.u32), dtype)
                hit = asm(f"set.{cmp}.u32.f32 $0, $1, $2;", [v, flag_value], nvfly.u32, side_effects=False)
                flags = flags | (hit & (1 << flag_bit(u, e, VEC, False)))
    return flags


@nvfly.func
def threshold_halves(threshold):
    """(key, ~index) of a rank, as the u32 pair the streaming filter compares against."""
    return rank_key(threshold), threshold.to(nvfly.i32).bitcast(nvfly.u32)


@nvfly.func
def shared_state(CAP, K_POW2, THREADS, tid):
    """The block's shared memory (``_smem_bytes``): the candidate buffer, the compaction's (and sort's) spare,
    two histograms (zeroed), the lane and warp sums, the warps' smallest kept ranks, the state ([0]: candidates
    in the buffer, zeroed). The caller's barrier publishes the zeroes."""
    buf = nvfly.dynamic_shared_tensor(nvfly.i64, (CAP,))
    kept_buf = nvfly.dynamic_shared_tensor(nvfly.i64, (K_POW2,), CAP * 8)
    tail = (CAP + K_POW2) * 8
    hist = nvfly.dynamic_shared_tensor(nvfly.i32, (2 * HIST,), tail)  # two: the passes of a select alternate
    lane_sums = nvfly.dynamic_shared_tensor(nvfly.i32, (THREADS,), tail + 8 * HIST)
    warp_sums = nvfly.dynamic_shared_tensor(nvfly.i32, (64,), tail + 8 * HIST + 4 * THREADS)
    warp_lows = nvfly.dynamic_shared_tensor(nvfly.i64, (16,), tail + 8 * HIST + 4 * THREADS + 256)
    state = nvfly.dynamic_shared_tensor(nvfly.i32, (4,), tail + 8 * HIST + 4 * THREADS + 384)
    for j in nvfly.static_range(2 * HIST // THREADS):
        hist[j * THREADS + tid] = 0  # (a select leaves both zeroed)
    if tid == 0:
        state[0] = 0
    return buf, kept_buf, hist, lane_sums, warp_sums, warp_lows, state


@nvfly.func
def highest_index_bit(x):
    """The highest bit of any column index of ``x``'s rows: ``~index`` has ones above it in every real rank."""
    return highest_bit(nvfly.maximum(x.shape[1] - 1, 1).bitcast(nvfly.u32)).bitcast(nvfly.i32)


@nvfly.func
def write_sorted(x, values, indices, buf, kept_buf, kept, k, row, tid, lane, K_POW2, THREADS):
    """Sort the ``kept`` candidates of ``buf`` and write the first k: indices and the values gathered by index."""
    items = sort_descending(buf, kept_buf, kept, tid, lane, K_POW2, THREADS)
    first = tid * sort_per_thread(K_POW2, THREADS)
    for j in nvfly.static_range(len(items)):
        if first + j < k:
            index = rank_index(items[j])
            indices[row, first + j] = index.to(nvfly.i64)
            values[row, first + j] = x[row, index]


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


# ---------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class TopkPlan:
    """Launch shape of a TopK: the warp kernel (``warps`` rows per block) or the streaming kernel
    (``threads`` per block, ``parts`` slices per row merged by ``topk_merge_kernel`` when rows are few: it holds
    all ``parts * k`` ranks of a row in ``merge_cap`` entries, loaded ``merge_vec`` at a time). ``row_threshold``:
    the slices run ``topk_row``'s histogram and select kernels instead, collecting at most ``row_cap``
    candidates a row (``cap``: their shared memory, also enough for a whole-row stream); ``two_level``: its
    select launch also counts the next key bits of the threshold bucket (``topk_row_two_level_kernel``);
    ``one_launch``: both launches as one cooperative launch (``topk_row_one_launch_kernel``), whose blocks all
    write a share of a row's k when ``shared_finish`` (else its last block writes them); ``reversed_select``: the
    select launch takes the slices in the reverse of the histogram launch's order, its first blocks reading what
    that launch read last, still in L2 (``REVERSED_SELECT_MIN_BYTES``); ``hist_parts`` slices of ``hist_slice_len``:
    the histogram launch's own slicing, where the select's slices would take it over one wave (0: the same);
    ``exact_stride`` (a one-launch plan of 16-bit keys): its blocks write their own candidates at their places
    where the keys from the k-th's bucket up are few (``topk_row.exact_finish``), through a table of this many
    parts a row (``parts`` rounded up to a power of two; 0: never)."""
    warp: bool
    vec: int
    warps: int = 1
    unroll: int = 0
    threads: int = 0
    cap: int = 0
    k_pow2: int = 0
    parts: int = 1
    slice_len: int = 0
    merge_cap: int = 0
    merge_vec: int = 0
    row_threshold: bool = False
    row_cap: int = 0
    two_level: bool = False
    one_launch: bool = False
    shared_finish: bool = False
    reversed_select: bool = False
    hist_parts: int = 0
    hist_slice_len: int = 0
    exact_stride: int = 0

    @property
    def smem_bytes(self) -> int:
        return _smem_bytes(self.cap, self.k_pow2, self.threads) if not self.warp else 0

    @property
    def merge_smem_bytes(self) -> int:
        return _smem_bytes(self.merge_cap, self.k_pow2, STREAM_THREADS) if self.merge_cap else 0


def _unroll(vec: int, itemsize: int) -> int:
    return min(MAX_UNROLL, STREAM_BYTES // (vec * itemsize))


def _capacity(per_iter: int, k_pow2: int, threads: int = STREAM_THREADS) -> int:
    """Candidate-buffer entries: one iteration's worth of appends on top of room for about 2k survivors."""
    margin = max(2 * k_pow2, threads)
    return per_iter + -(-margin // threads) * threads


def _smem_bytes(cap: int, k_pow2: int, threads: int) -> int:
    """The candidate buffer, the compaction's (and sort's) spare of k_pow2, two histograms, the lane and warp
    sums, the warps' smallest kept ranks and the state of ``topk_radix_kernel``."""
    return (cap + k_pow2) * 8 + 2 * HIST * 4 + threads * 4 + 256 + 128 + 16


def slice_plan(n: int, k: int, m: int, vec: int, max_unroll: int, threads: int, sm_count: int,
               max_parts: int = MAX_PARTS, merged: bool = True, blocks_per_sm: int = BLOCKS_PER_SM,
               min_parts: int = 1) -> tuple[int, int, int]:
    """(parts, slice_len, unroll): how the rows are cut into slices, one block each. Slices are whole sweeps of
    ``threads * vec`` elements (the last one of a row may be short). Few rows: enough slices for about
    ``blocks_per_sm`` blocks on every SM (``min_parts`` at least), at most ``max_parts``, and when the slices'
    top k are ``merged``, as long as a slice holds 4k elements or more and the merge reads at most MERGE_RANKS
    ranks a row (parts * k). A slice of c sweeps takes ceil(c / max_unroll) iterations of an unroll that spreads
    the sweeps evenly over them."""
    sweep = threads * vec
    sweeps = -(-n // sweep)
    limit = min(n // (4 * k), MERGE_RANKS // k) if merged else sweeps
    parts = max(1, min(max(min_parts, blocks_per_sm * sm_count // m), sweeps, limit, max_parts))
    parts, slice_len = whole_sweep_slices(n, sweep, parts)
    per_slice = slice_len // sweep
    iterations = -(-per_slice // max_unroll)
    unroll = -(-per_slice // iterations)
    if parts == 1:
        unroll = max_unroll  # (as many loads in flight as the registers allow)
    elif vec == 1:
        unroll = max(unroll, 2)  # (ptxas spills a register at unroll 1 with scalar loads)
    return parts, slice_len, unroll


def whole_sweep_slices(n: int, sweep: int, parts: int) -> tuple[int, int]:
    """(parts, slice_len): a row of n cut into at most ``parts`` slices of whole sweeps (``sweep`` elements; the
    last slice may be short), as even as whole sweeps allow."""
    sweeps = -(-n // sweep)
    per_slice = -(-sweeps // parts)
    return -(-sweeps // per_slice), per_slice * sweep


@functools.lru_cache(maxsize=4096)
def plan(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int, max_parts: int = MAX_PARTS,
         row_threshold: Optional[bool] = None, two_level: bool = False, one_launch: Optional[bool] = None,
         exact: Optional[bool] = None) -> TopkPlan:
    """How to run a TopK of k over m rows of n elements (16-byte accesses hold ``vec`` elements); ``max_parts``
    caps the slices of a row (``benchmarks.topk --compare-plans`` times fewer than the default);
    ``row_threshold``: rows this plan cuts into slices run ``topk_row``'s kernels instead (``row_plan``); None: where
    k >= ROW_THRESHOLD_MIN_K or the slices are at least ROW_THRESHOLD_MIN_PARTS. ``two_level`` (opt-in, not
    measured yet): a row-threshold plan's select launch also builds the second-level histogram of the threshold
    bucket, so that the row's last block selects without radix passes (``topk_row_two_level_kernel``); ignored
    where the plan is not a row-threshold one. ``one_launch``: a (one-level) row-threshold plan runs as one
    cooperative launch; None: where its blocks fit one to an SM (``row_plan``). ``exact``: a one-launch plan's
    exact finish (``TopkPlan.exact_stride``), None: where it can run."""
    if k <= WARP_MAX_K and n <= WARP_MAX_N:
        return TopkPlan(True, vec, warps=max(1, min(8, m // (2 * sm_count))))
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    max_unroll = _unroll(vec, itemsize)
    # blocks of SLICE_THREADS, two to an SM, unless their shared memory is too large (k = 2048)
    threads = SLICE_THREADS
    if BLOCKS_PER_SM * (_smem_bytes(_capacity(threads * vec * max_unroll, k_pow2, threads), k_pow2, threads) +
                        1024) > SM_SMEM_BYTES:
        threads = STREAM_THREADS
    parts, slice_len, unroll = slice_plan(n, k, m, vec, max_unroll, threads, sm_count, max_parts)
    row_block = row_threads(n, k, m, vec, itemsize, sm_count, max_parts, exact)
    if row_threshold is None:
        row_threshold = k >= ROW_THRESHOLD_MIN_K or parts >= ROW_THRESHOLD_MIN_PARTS or row_block == WIDE_THREADS
    # rows of one slice each, with a large k and few enough for two slices a row in two waves: two slices
    split = parts == 1 and k >= ROW_THRESHOLD_MIN_K and n >= ROW_SPLIT_MIN_N and m <= BLOCKS_PER_SM * sm_count
    if row_threshold and (parts > 1 or split):
        return row_plan(n, k, m, vec, itemsize, sm_count, max_parts, two_level, one_launch, row_block, exact)
    merge_cap = max(parts * k, k_pow2) if parts > 1 else 0  # (the sort exchanges k_pow2 entries through it)
    return TopkPlan(False, vec, unroll=unroll, threads=threads,
                    cap=_capacity(threads * vec * unroll, k_pow2, threads), k_pow2=k_pow2, parts=parts,
                    slice_len=slice_len, merge_cap=merge_cap,
                    merge_vec=(2 if parts * k % 2 == 0 else 1) if parts > 1 else 0)


def row_plan(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int, max_parts: int = MAX_PARTS,
             two_level: bool = False, one_launch: Optional[bool] = None, threads: Optional[int] = None,
             exact: Optional[bool] = None) -> TopkPlan:
    """The row-threshold plan (``topk_row``): blocks of ``threads`` (None: ``row_threads``), two slices a row at
    least, down to one sweep (no merge bounds them), for two blocks an SM (one of WIDE_THREADS): the unroll is
    lowered until the shared memory (the candidate list, or a whole-row stream's buffer) fits twice.
    ``one_launch`` (None: whenever it can): the histogram and the select in one cooperative launch, which needs
    every block resident at once: one an SM at most (its shared memory is the select's and the histogram's, side
    by side), and the one-level select. ``exact`` (None: whenever it can): a one-launch plan of 16-bit keys whose
    blocks hold a whole slice's candidates and have a thread for each of EXACT_BINS keys writes them in place
    (``TopkPlan.exact_stride``)."""
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    row_cap = min(ROW_CAP_MAX, max(2048, 8 * k_pow2))
    max_unroll = _unroll(vec, itemsize)
    if threads is None:
        threads = row_threads(n, k, m, vec, itemsize, sm_count, max_parts, exact)
    blocks_per_sm = 1 if threads == WIDE_THREADS else BLOCKS_PER_SM
    while True:
        parts, slice_len, unroll = slice_plan(n, k, m, vec, max_unroll, threads, sm_count, max_parts, merged=False,
                                              blocks_per_sm=blocks_per_sm, min_parts=2)
        cap = max(row_cap, _capacity(threads * vec * unroll, k_pow2, threads))
        if max_unroll == 1 or BLOCKS_PER_SM * (_smem_bytes(cap, k_pow2, threads) + 1024) <= SM_SMEM_BYTES:
            break
        max_unroll //= 2
    fits = not two_level and m * parts <= sm_count
    if one_launch and not fits:
        raise ValueError(f"one_launch: {m} rows of {parts} slices need {m * parts} resident blocks (at most "
                         f"{sm_count}: one an SM) and the one-level select (two_level={two_level})")
    one_launch = fits if one_launch is None else one_launch
    hist_parts, hist_slice_len = 0, 0
    hist_wave = SM_SMEM_BYTES // (HIST * COPIES * 4 + 1024) * sm_count  # histogram blocks resident at once
    if not one_launch and m * parts > hist_wave:
        # in one wave instead of a wave and a tail (256x128256 bf16: the histogram launch alone 24.2 -> 23.0 us,
        # topk_reversed_select_h200.log); whole calls at 224-256 rows 2.4-6.3 us faster under do_bench, from CUDA
        # graphs -4.6 to +0.7 us (topk_histogram_one_wave_h200.log)
        hist_parts, hist_slice_len = whole_sweep_slices(n, threads * vec, max(1, hist_wave // m))
    can_exact = one_launch and itemsize == 2 and slice_len <= cap and threads >= EXACT_BINS
    if exact and not can_exact:
        raise ValueError(f"exact: needs a one-launch plan (one_launch={one_launch}) of 16-bit keys (itemsize "
                         f"{itemsize}) whose slices fit a block's buffer ({slice_len} <= {cap}) and blocks of "
                         f"{EXACT_BINS} threads or more ({threads})")
    exact_stride = max(4, 1 << (parts - 1).bit_length()) if (can_exact if exact is None else exact) else 0
    return TopkPlan(False, vec, unroll=unroll, threads=threads, cap=cap, k_pow2=k_pow2, parts=parts,
                    slice_len=slice_len, row_threshold=True, row_cap=row_cap, two_level=two_level,
                    one_launch=one_launch, shared_finish=one_launch and k >= SHARED_FINISH_MIN_K,
                    reversed_select=(not one_launch and not two_level
                                     and m * n * itemsize >= REVERSED_SELECT_MIN_BYTES),
                    hist_parts=hist_parts, hist_slice_len=hist_slice_len, exact_stride=exact_stride)


def row_threads(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int,
                max_parts: int = MAX_PARTS, exact: Optional[bool] = None) -> int:
    """The row-threshold plan's block: WIDE_THREADS (one block an SM) where that measured faster than
    SLICE_THREADS, else SLICE_THREADS; from the slices a row of SLICE_THREADS blocks would get in that plan.
    Measured on the H200, bf16 randn rows of 128256-151936, us from CUDA graphs / do_bench, 256 -> 512 threads
    (benchmarks/results/topk_threads_probe_h200.log): one row, k = 1024: 13.6 / 16.3 -> 12.6 / 15.5 (the row's
    last block selects and orders the k with 16 warps instead of 8), k = 50: 9.1 / 11.2 -> 9.4 / 11.4, so only for
    k >= ROW_THRESHOLD_MIN_K; 64 rows, two slices of 512 instead of four of 256 (one wave of 128 blocks): k = 50
    21.5 / 27.1 -> 18.3 / 21.2, k = 1024 27.9 / 32.5 -> 24.4 / 27.7. Not faster: 4 rows (16.0 / 21.5 -> 16.3 /
    19.6), 16 rows (19.2 / 23.7 -> 20.5 / 24.4), 256 rows of two slices (66.0 -> 77.5: two blocks an SM no
    longer fit). So: one row with a large k, and rows that SLICE_THREADS blocks cut into at most 4 slices while
    WIDE_THREADS blocks still give each row two in one wave. One row of 16-bit keys (unless ``exact`` is False)
    keeps SLICE_THREADS: its blocks write their own candidates in place (``TopkPlan.exact_stride``), and smaller
    slices are faster there (topk_exact_finish_h200.log: 1x128256 k=1024 bf16 10.2 -> 9.6 us from CUDA graphs,
    k=256 9.1 -> 8.5)."""
    if m == 1:
        exact_keys = itemsize == 2 and exact is not False
        return WIDE_THREADS if k >= ROW_THRESHOLD_MIN_K and not exact_keys else SLICE_THREADS
    parts = slice_plan(n, k, m, vec, _unroll(vec, itemsize), SLICE_THREADS, sm_count, max_parts, merged=False)[0]
    return WIDE_THREADS if 1 < parts <= 4 and sm_count // m >= 2 else SLICE_THREADS


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
        # f16's first-level buckets are 1/32 of an octave, so the exact finish's 8 rarely hold a row's top keys:
        # f16 keeps the list path and its wider blocks (bf16's buckets are a quarter octave)
        exact = False if str(x.dtype) == "torch.float16" else None
        run = _runner(plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device()), exact=exact), m, n, k,
                      bool(largest))
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
    if p.row_threshold:
        from nvfly.ops import topk_row
        return topk_row.runner(p, m, k, largest)
    if p.parts == 1:
        single = topk_radix_kernel.prepared((m, 1, 1), p.threads)
        tail = (k, n, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, False)
        return lambda rows, values, indices: single.launch(rows, values, indices, rows, *tail)
    # slices of each row write their k best ranks; a second launch merges them (2 ranks per 16-byte access).
    # The ranks are a fresh allocation each call (the caching allocator's, a few microseconds): a buffer kept
    # across calls would need one per stream and would break under CUDA graph capture.
    first = topk_radix_kernel.prepared((m, p.parts, 1), p.threads)
    first_tail = (k, p.slice_len, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, True)
    merge = topk_merge_kernel.prepared((m, 1, 1), STREAM_THREADS)
    merge_tail = (k, p.merge_vec, STREAM_THREADS, p.merge_cap, p.k_pow2)
    ranks_shape = (m, p.parts * k)

    def run(rows: "torch.Tensor", values: "torch.Tensor", indices: "torch.Tensor") -> None:
        ranks = torch.empty(ranks_shape, dtype=torch.int64, device=rows.device)
        first.launch(rows, values, indices, ranks, *first_tail)
        merge.launch(rows, ranks, values, indices, *merge_tail)
    return run
