"""TopK of few long rows through a row-wide threshold (``plans.plan(..., row_threshold=True)``): two launches (or
one) over the slices of each row instead of a top k per slice and a merge.

- ``topk_row_histogram_kernel``, grid (rows, parts): each block counts the top HIST_BITS bits (the bucket) of
  its slice's order keys in shared memory (COPIES interleaved copies, one per ``lane % COPIES``, so that the
  few hot buckets of a bell-shaped row see few same-address conflicts) and adds its non-zero buckets into the
  row's global histogram.
- ``topk_row_select_kernel``, the same grid: every block finds in the complete histogram the bucket B of the
  k-th largest key and how many keys lie in B or above (``locate_bucket``). When those fit ``ROW_CAP``, it
  re-reads its slice (L2 hits), flags the keys in B or above with the stream's packed compares, stages their
  ranks in shared memory and appends them to the row's global candidate list with one atomic. The last block
  of the row to arrive (arrival counter) loads the list, orders its k largest by a counting sort over fine key
  buckets (``finish_list``; heavy ties fall back to ``select_top`` and the bitonic sort), writes them, and
  zeroes the row's histogram and counters. When B and above hold more (heavy ties, e.g. an
  all-equal row), nothing is appended and the last block streams the whole row alone (``stream_top``): slow,
  exact. Where the rows outgrow the L2 (``TopkPlan.reversed_select``) the select's blocks take the slices in
  reverse order, the first ones re-reading what the histogram launch read last (still cached); where the
  select's slices would take the histogram launch over one wave, that launch cuts the rows into fewer slices of
  its own (``TopkPlan.hist_parts``).
- ``topk_row_one_launch_kernel`` (``TopkPlan.one_launch``, the default where all of the rows' blocks fit one an SM:
  M = 1 sampling rows): both in one cooperative launch, the blocks of a row waiting for each other between the
  count and the select (an arrival counter): one launch and its host work fewer. From k = 256
  (``TopkPlan.shared_finish``) every block of the row then waits for the row's appends and writes a share of the k
  (``finish_list``: the same bucket starts in every block, each ranking the buckets that start in its share). With
  16-bit keys (``TopkPlan.exact_stride``) the blocks skip the list: where every key above B lies within EXACT_SPAN
  buckets of it, each block counts its candidates by exact key, writes the counts to its column of a table and adds
  them to the row's totals, waits for the row's blocks once more, and writes its own candidates at their places
  (keys above, plus the same key in earlier slices, plus the same key above it in its own; ``exact_finish``).
  Measured against two launches: docs/ops/topk.md.
- ``topk_row_two_level_kernel`` (opt-in, ``plans.plan(..., two_level=True)``): the select launch also counts the
  threshold bucket's next key bits, so the last block knows the k-th key's second-level bucket and selects without
  radix passes.

Workspace, one per (device, stream), zero between launches (each row's last block, or last to leave, cleans up): the
histograms (rows x HIST i32), two counters a row (arrivals, appends), the candidate lists (rows x ROW_CAP_MAX
i64, never cleared; past the rows' lists, the exact finish's tables), the second-level histograms (also the exact
finish's totals). A launch cut short (an error) leaves it dirty, as the split-K GEMM's.
"""
from __future__ import annotations

import operator
from typing import Any

import nvfly
from nvfly.arch.gpu_scope import arrive, atom_add, load_acquire, load_relaxed, red_add
from nvfly.arch.reduce import block_scan, tree_reduce
from nvfly.arch.warp import ballot, highest_bit, lanemask, popc
from nvfly.frontend.language import atomic_add, redux_sync, syncthreads_or, vote_any
from nvfly.ops.topk.keys import ABSENT, NAN_ABOVE, flag_key, key_bits, order_key, rank64, rank_index, rank_key
from nvfly.ops.topk.plans import COPIES, EXACT_BINS, HIST, HIST_BITS, LIST_WORDS, SWEEP, shared_state_bytes
from nvfly.ops.topk.select import highest_index_bit, locate_bucket, select_top, shared_state, sweep_loads
from nvfly.ops.topk.sort import write_sorted
from nvfly.ops.topk.stream import append_slots, candidate_flags, next_flagged, step_loads, stream_top


# ---------------------------------------------------------------------------------------------- the histogram
@nvfly.func
def key_bucket(key, dtype):
    """The histogram bucket of an order key: its top HIST_BITS bits."""
    return key >> ((32 if dtype == nvfly.f32 else 16) - HIST_BITS)


@nvfly.kernel
def topk_row_histogram_kernel(x: nvfly.Tensor, hist: nvfly.Tensor, slice_len: nvfly.i32, VEC: nvfly.Constexpr,
                              UNROLL: nvfly.Constexpr, THREADS: nvfly.Constexpr, LARGEST: nvfly.Constexpr):
    """Block (row, part) adds the bucket counts of columns [part*slice_len, (part+1)*slice_len) to
    ``hist[row]``."""
    row = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    start = nvfly.block_idx.y * slice_len
    counts = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST * COPIES,))
    count_slice(x, hist, counts, row, start, nvfly.minimum(start + slice_len, x.shape[1]), tid, VEC, UNROLL,
                THREADS, LARGEST)


@nvfly.func
def count_slice(x, hist, counts, row, start, stop, tid, VEC, UNROLL, THREADS, LARGEST):
    """The bucket counts of columns [start, stop) of the row added to ``hist[row]``: counted in ``counts`` (shared,
    HIST * COPIES: bucket b, copy c at b * COPIES + c) first. Returns this thread's loads of the first step
    (``step_loads`` step 0), which a select of the same slice can use again."""
    for j in nvfly.static_range(HIST * COPIES // (4 * THREADS)):
        counts.store(nvfly.full(4, 0, nvfly.i32), (j * THREADS + tid) * 4)
    per_iter = THREADS * VEC * UNROLL
    copy = tid % COPIES
    first_loads = step_loads(x, row, start, stop, 0, tid, VEC, UNROLL, THREADS)  # in flight over the barrier
    nvfly.syncthreads()
    # each step's loads are issued before the previous step is counted: two steps in flight, not one (a slice of
    # a few steps otherwise waits out a full memory latency per step)
    current = first_loads
    for it in range((stop - start + per_iter - 1) // per_iter):
        upcoming = step_loads(x, row, start, stop, it + 1, tid, VEC, UNROLL, THREADS)
        col0 = start + (it * UNROLL * THREADS + tid) * VEC
        # a whole step counts without a bounds check per element (those branches took most of the kernel's issue
        # slots: docs/ops/topk.md); only the slice's last step can be partial
        if start + (it + 1) * per_iter <= stop:
            count_loads(counts, current, col0, stop, copy, x.dtype, VEC, UNROLL, THREADS, LARGEST, False)
        else:
            count_loads(counts, current, col0, stop, copy, x.dtype, VEC, UNROLL, THREADS, LARGEST, True)
        current = upcoming
    nvfly.syncthreads()
    for j in nvfly.static_range(HIST // THREADS):
        bucket = j * THREADS + tid
        total = nvfly.i32(0)
        for c in nvfly.static_range(COPIES // 4):
            four = counts.load(bucket * COPIES + 4 * c, width=4)
            total = total + four[0] + four[1] + four[2] + four[3]
        if total != 0:
            red_add(hist.address(row, bucket), total)
    return first_loads


@nvfly.func
def count_loads(counts, loaded, col0, stop, copy, dtype, VEC, UNROLL, THREADS, LARGEST, CHECKED):
    """Count one step's loads (``step_loads``, unroll u at columns ``col0 + u * THREADS * VEC``) into their buckets
    of copy ``copy`` of ``counts``: those before ``stop`` when ``CHECKED``, all of them when not (a whole step)."""
    packed = dtype != nvfly.f32 and VEC > 1
    for u in nvfly.static_range(UNROLL):
        if packed:
            buckets = []
            words = loaded[u].bitcast(nvfly.u32)
            for w in nvfly.static_range(VEC // 2):
                keys = pair_keys(words[w], dtype, LARGEST)
                buckets += [(keys >> (16 - HIST_BITS)) & (HIST - 1), keys >> (32 - HIST_BITS)]
        else:
            buckets = [key_bucket(order_key(loaded[u][e] if VEC > 1 else loaded[u], LARGEST), dtype)
                       for e in nvfly.static_range(VEC)]
        for e, bucket in enumerate(buckets):
            if CHECKED:
                if col0 + u * THREADS * VEC + e < stop:
                    atomic_add(counts, bucket.bitcast(nvfly.i32) * COPIES + copy, 1)
            else:
                atomic_add(counts, bucket.bitcast(nvfly.i32) * COPIES + copy, 1)


@nvfly.func
def pair_keys(word, dtype, LARGEST):
    """``order_key`` of the two 16-bit values packed in a u32 (the lower column in the low half), packed alike:
    the sign flip and the NaN test of both halves in one set of 32-bit operations (no carry crosses the halves:
    a half's magnitude plus the NaN offset stays below 0x10000), about 4 instructions an element instead of 8."""
    negative = (word >> 15) & 0x00010001
    keys = word ^ ((negative * 0x7FFF) | 0x80008000)
    offset = 0x8000 - (NAN_ABOVE[dtype.name] + 1)  # bit 15 of magnitude + offset: the half is NaN
    nan = (((word & 0x7FFF7FFF) + (offset | (offset << 16))) & 0x80008000) >> 15
    keys = keys | (nan * 0xFFFF)
    if not LARGEST:
        keys = keys ^ 0xFFFFFFFF
    return keys


# ---------------------------------------------------------------------------------------------- the select's appends
def level_shifts(key_width: int) -> tuple[int, int, int]:
    """(shift of the first-level bucket, bits of the second level, its shift) for keys of ``key_width`` bits: the
    first level is the top HIST_BITS bits; the second the next ones, up to HIST_BITS (16-bit keys: the 5 left, so
    a second-level bucket is one key; 32-bit keys: 11, leaving 10 bits)."""
    shift1 = key_width - HIST_BITS
    bits2 = min(HIST_BITS, shift1)
    return shift1, bits2, shift1 - bits2


@nvfly.func
def stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, counts,
                     current=None):
    """Append the ranks of the elements of columns [start, stop) whose key is ``lowest`` or above to ``buf``
    (``state[0]`` counts them): flagged by one packed compare per two 16-bit values, checked and appended one
    flagged element per lane a round, as in ``stream_top`` with a fixed threshold. ``counts`` (a shared histogram
    or None): those in ``lowest``'s first-level bucket also count their second-level bucket at
    ``counts[HIST + digit]``. ``current``: the first step's loads when the caller has them."""
    flag = key_bits(flag_key(lowest, True, x.dtype), x.dtype, LARGEST)
    packed = x.dtype != nvfly.f32 and VEC > 1
    per_iter = THREADS * VEC * UNROLL
    if current is None:
        current = step_loads(x, row, start, stop, 0, tid, VEC, UNROLL, THREADS)
    for it in range((stop - start + per_iter - 1) // per_iter):
        upcoming = step_loads(x, row, start, stop, it + 1, tid, VEC, UNROLL, THREADS)
        col0 = start + (it * UNROLL * THREADS + tid) * VEC
        pending = candidate_flags(current, flag, VEC, UNROLL, LARGEST)
        while vote_any(pending != 0):
            pending, next_flag, key, col = next_flagged(pending, current, col0, x.dtype, VEC, THREADS, packed, LARGEST)
            take = (key >= lowest) & (col < stop) & (next_flag != 0)
            position, _ = append_slots(state, take, lane)
            buf.store(rank64(key, col), position, mask=take)
            if counts is not None:
                shift1, bits2, shift2 = level_shifts(32 if x.dtype == nvfly.f32 else 16)
                if take & ((key >> shift1) == (lowest >> shift1)):
                    atomic_add(counts, HIST + ((key >> shift2) & ((1 << bits2) - 1)).bitcast(nvfly.i32), 1)
        current = upcoming


def block_slice(x: Any, slice_len: Any, REVERSED: bool = False) -> tuple:
    """(row, tid, lane, warp, start, stop) of block (row, part): its slice [start, stop) of the row; ``REVERSED``:
    of block (rows - 1 - row, parts - 1 - part), the grid's blocks taking the slices in reverse order."""
    row = nvfly.block_idx.x
    part = nvfly.block_idx.y
    if REVERSED:
        row = nvfly.grid_dim.x - 1 - row
        part = nvfly.grid_dim.y - 1 - part
    tid = nvfly.thread_idx.x
    lane = tid & 31
    warp = tid >> 5
    start = part * slice_len
    return row, tid, lane, warp, start, nvfly.minimum(start + slice_len, x.shape[1])


@nvfly.func
def locate_row_bucket(hist, row_hist, lane_sums, warp_sums, row, k, tid, lane, warp, THREADS, RELAXED):
    """The row's histogram into shared memory, then the bucket of its k-th key: (bucket, keys above it, keys in it
    or above: k or more). ``RELAXED``: read with GPU-scope loads (the histogram was completed by other blocks of
    this launch, so this SM's L1 must not answer)."""
    for j in nvfly.static_range(HIST // THREADS):
        if RELAXED:
            row_hist[j * THREADS + tid] = load_relaxed(hist.address(row, j * THREADS + tid), nvfly.i32)
        else:
            row_hist[j * THREADS + tid] = hist[row, j * THREADS + tid]
    nvfly.syncthreads()
    bucket, above, in_bucket = locate_bucket(row_hist, lane_sums, warp_sums, 0, HIST, k, tid, lane, warp, THREADS)
    return bucket, above, above + in_bucket


@nvfly.func
def publish_candidates(candidates, counters, row_hist, buf, state, row, tid, THREADS, LAST):
    """Append the block's staged candidates (``state[0]`` of them in ``buf``) to the row's list, zero its copy of
    the histogram (the last block's selects start from zeroed histograms) and count the block in; whether it is
    the row's last block (the arrivals counted before it: ``LAST``), every other block's appends in
    (``counters[2*row]``: arrivals, ``[2*row + 1]``: appends)."""
    staged = state[0]
    if (tid == 0) & (staged > 0):
        state[1] = atomic_add(counters, 2 * row + 1, staged)
    for j in nvfly.static_range(HIST // THREADS):
        row_hist[j * THREADS + tid] = 0
    nvfly.syncthreads()
    base = state[1]
    for i in range(tid, staged, THREADS):
        candidates[row, base + i] = buf[i]
    nvfly.threadfence()  # this thread's appends are visible GPU-wide before the block counts itself in
    nvfly.syncthreads()
    if tid == 0:
        state[0] = 0
        state[2] = arrive(counters.address(2 * row))
    nvfly.syncthreads()
    return state[2] == LAST


@nvfly.func
def clean_row(hist, counters, row, tid, THREADS):
    """The last block's end: the row's histogram and counters zeroed for the next launch."""
    for j in nvfly.static_range(HIST // THREADS):
        hist[row, j * THREADS + tid] = 0
    if tid < 2:
        counters[2 * row + tid] = 0


@nvfly.func
def finish_row(x, values, indices, hist, counters, buf, kept_buf, state, k, row, tid, lane, K_POW2, THREADS):
    """The last block's end: the sorted k results written, the row's histogram and counters zeroed."""
    write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
    clean_row(hist, counters, row, tid, THREADS)


# ---------------------------------------------------------------------------------------------- the list's finish
@nvfly.func
def list_loads(candidates, row, first, count, tid, THREADS):
    """A thread's share of ``candidates[row, first:first + 2 * SWEEP * THREADS]``, flat: SWEEP 16-byte loads of
    two ranks (entry ``first + 2 * (j * THREADS + tid) + h`` at ``2 * j + h``), issued together; pairs past
    ``count`` read the last one (the list's rows hold ROW_CAP_MAX entries: every address is inside)."""
    last_pair = (count - 1) >> 1
    loaded = []
    for j in nvfly.static_range(SWEEP):
        pair = nvfly.minimum((first >> 1) + j * THREADS + tid, last_pair)
        loaded += load_relaxed(candidates.address(row, 2 * pair), nvfly.i64, 2)
    return loaded


@nvfly.func
def ranks_above(buf, first, size, mine, ceiling=None):
    """How many of ``buf[first:first + size]`` (size >= 1) rank above ``mine`` (the same address in every thread of
    a bucket: shared-memory broadcasts), and at most ``ceiling`` when given. Four loads in flight: unmasked (a
    masked load is a branch each), at indices clamped to the last entry, whose extra compares are masked out."""
    higher = nvfly.i32(0)
    last = first + size - 1
    for j in range(0, size, 4):
        for u in nvfly.static_range(4):
            r = buf[nvfly.minimum(first + j + u, last)]
            counted = r > mine
            if ceiling is not None:
                counted = counted & (r <= ceiling)
            higher = higher + (counted & (j + u < size)).to(nvfly.i32)
    return higher


CROWDED = 256  # the most candidates in one kept fine bucket that the last block ranks by counting (more: select_top)


@nvfly.func
def load_list(candidates, buf, warp_sums, row, count, tid, lane, warp, THREADS):
    """``buf[:count]`` = the row's candidate list (relaxed 16-byte loads of two ranks, the next step's in flight
    while this one is stored); returns the largest key in it, in every thread after one barrier."""
    STEP = 2 * SWEEP * THREADS
    key_high = nvfly.u32(0)
    current = list_loads(candidates, row, 0, count, tid, THREADS)
    for first in range(0, count, STEP):
        upcoming = list_loads(candidates, row, first + STEP, count, tid, THREADS)
        for i in nvfly.static_range(2 * SWEEP):
            at = first + 2 * ((i // 2) * THREADS + tid) + i % 2
            real = at < count
            buf.store(current[i], at, mask=real)
            key_high = nvfly.select(real, nvfly.maximum(key_high, rank_key(current[i])), key_high)
        current = upcoming
    key_high = redux_sync(key_high, "max")
    if lane == 0:
        warp_sums[16 + warp] = key_high.bitcast(nvfly.i32)
    nvfly.syncthreads()
    for w in nvfly.static_range(THREADS // 32):
        key_high = nvfly.maximum(key_high, warp_sums[16 + w].bitcast(nvfly.u32))
    return key_high


FINE_SPAN = 8  # first-level buckets above the threshold's that the fine buckets spread over at most


@nvfly.func
def fine_shift_of(lowest, key_high, dtype):
    """The shift that cuts the keys from ``lowest`` up to ``key_high`` (at most FINE_SPAN first-level buckets of
    them) into at most HIST fine buckets: 0 for 16-bit keys (a bucket a key), 32-bit keys of random rows ~13. Keys
    beyond share the top bucket (``fine_bucket``), so that an outlier does not coarsen the buckets near the k-th."""
    span = nvfly.minimum(key_high - lowest, (FINE_SPAN << ((32 if dtype == nvfly.f32 else 16) - HIST_BITS)) - 1)
    return nvfly.maximum(highest_bit(span | 1).bitcast(nvfly.i32) - (HIST_BITS - 1), 0).bitcast(nvfly.u32)


@nvfly.func
def fine_bucket(rank, lowest, fine_shift):
    """The fine bucket of a candidate (its key >= lowest): a higher bucket holds only higher ranks."""
    return nvfly.minimum((rank_key(rank) - lowest) >> fine_shift, HIST - 1).bitcast(nvfly.i32)


@nvfly.func
def count_fine_buckets(buf, hist, count, lowest, fine_shift, tid, THREADS):
    """``hist[b]`` = the candidates of ``buf[:count]`` in fine bucket b (shared atomics), published by a barrier."""
    for first in range(tid, count, SWEEP * THREADS):
        for j, r in enumerate(sweep_loads(buf, first, count, THREADS)):
            if first + j * THREADS < count:
                atomic_add(hist, fine_bucket(r, lowest, fine_shift), 1)
    nvfly.syncthreads()


@nvfly.func
def bucket_starts(hist, warp_sums, state, k, tid, lane, warp, THREADS):
    """Each fine bucket's first output position (the candidates in higher buckets), in ``hist[b]`` and in its
    cursor ``hist[HIST + b]``; ``state[1]`` = where the bucket of the k-th largest ends (the candidates of the kept
    buckets, those starting below k). Thread t owns buckets [t*PER, (t+1)*PER): warp suffix sums by shuffles,
    the higher warps' totals after one barrier. Returns whether this thread owns a kept bucket of more than
    CROWDED (the block then falls back to ``select_top``)."""
    PER = HIST // THREADS
    counts = [hist[tid * PER + i] for i in nvfly.static_range(PER)]
    total = counts[0]
    for c in counts[1:]:
        total = total + c
    above = block_scan(total, warp_sums, lane, warp, THREADS // 32, exclusive=True, reverse=True)
    crowded = nvfly.i32(0)
    for i in nvfly.static_range(PER - 1, -1, -1):
        start = above
        above = above + counts[i]
        hist[tid * PER + i] = start
        hist[HIST + tid * PER + i] = start
        crowded = crowded | ((start < k) & (counts[i] > CROWDED)).to(nvfly.i32)
        if (start < k) & (k <= above):
            state[1] = above
    return crowded != 0


@nvfly.func
def scatter_kept(buf, hist, count, k, lowest, fine_shift, tid, THREADS):
    """The candidates of the kept fine buckets to ``buf[count:]``, each bucket's at [start, end) in any order (a
    shared atomic on its cursor), published by a barrier."""
    for first in range(tid, count, SWEEP * THREADS):
        for j, r in enumerate(sweep_loads(buf, first, count, THREADS)):
            real = first + j * THREADS < count
            bucket = nvfly.select(real, fine_bucket(r, lowest, fine_shift), 0)
            if real & (hist[bucket] < k):
                buf[count + atomic_add(hist, HIST + bucket, 1)] = r
    nvfly.syncthreads()


@nvfly.func
def write_result(x, values, indices, rank, row, position, LARGEST):
    """Output ``position`` of the row: the index, and the value rebuilt from the key (gathered from x only for
    NaN, whose payload the key drops)."""
    index = rank_index(rank)
    indices[row, position] = index.to(nvfly.i64)
    bits = key_bits(rank_key(rank), x.dtype, LARGEST)
    if x.dtype == nvfly.f32:
        nan = (bits & 0x7FFFFFFF) > NAN_ABOVE["f32"]
        value = bits.bitcast(nvfly.f32)
    else:
        nan = (bits & 0x7FFF) > NAN_ABOVE[x.dtype.name]
        value = bits.bitcast(nvfly.i32).to(nvfly.i16).bitcast(x.dtype)
    values[row, position] = nvfly.select(nan, x.load(row, index, mask=nan), value)


@nvfly.func
def write_ranked(x, values, indices, buf, hist, count, placed, k, lowest, fine_shift, row, part, parts, tid, THREADS,
                 LARGEST):
    """Each of the ``placed`` candidates at ``buf[count:]`` (grouped by bucket) whose bucket is the block's goes to
    its bucket's start plus the candidates of its bucket that rank above it (ranks are unique); those at k or
    beyond (the k-th's bucket's rest) are dropped. Block ``part`` of ``parts`` has the buckets that start in the
    part-th of ``parts`` equal shares of [0, k): whole buckets, since the order inside one differs between the
    blocks' copies."""
    for i in range(tid, placed, THREADS):
        mine = buf[count + i]
        bucket = fine_bucket(mine, lowest, fine_shift)
        start = hist[bucket]
        share = start * parts - part * k
        if (share >= 0) & (share < k):
            position = start + ranks_above(buf, count + start, hist[HIST + bucket] - start, mine)
            if position < k:
                write_result(x, values, indices, mine, row, position, LARGEST)


@nvfly.func
def finish_list(x, values, indices, candidates, smem, count, lowest, k, row, part, parts, alone, tid, lane, warp,
                THREADS, CAP, K_POW2, LARGEST):
    """The k largest of the row's list (``count`` candidates, keys ``lowest`` and above), written in order by
    ``parts`` blocks together (each run it; one, ``part`` 0 of 1, when the row's last block finishes alone). A
    counting sort: the candidates are counted in HIST fine buckets of their keys (exact keys for 16-bit floats),
    every bucket's start is the count above it, the buckets that start below k are copied to ``buf[count:]``
    grouped, and each candidate's position is its bucket's start plus those of its bucket that rank above it.
    Every block computes the same starts and its own copy; block ``part`` ranks and writes the candidates of its
    share of the buckets (``write_ranked``). Five barriers instead of ``select_top``'s radix passes and compaction
    and the bitonic sort's 55 stages. A kept bucket of more than CROWDED (heavy ties) or no room for the copy:
    ``select_top`` and the sort, by the block that is ``alone`` (every block sees the same list, so they agree on
    this)."""
    buf, kept_buf, hist, lane_sums, warp_sums, warp_lows, state = smem
    key_high = load_list(candidates, buf, warp_sums, row, count, tid, lane, warp, THREADS)
    fine_shift = fine_shift_of(lowest, key_high, x.dtype)
    count_fine_buckets(buf, hist, count, lowest, fine_shift, tid, THREADS)
    crowded = syncthreads_or(bucket_starts(hist, warp_sums, state, k, tid, lane, warp, THREADS))
    placed = state[1]  # (the kept buckets' candidates: k and the rest of the k-th's bucket)
    if crowded | (count + placed > CAP):
        if alone:
            for j in nvfly.static_range(2 * HIST // THREADS):
                hist[j * THREADS + tid] = 0  # (select_top counts from zeroed histograms)
            if tid == 0:
                state[0] = count
            nvfly.syncthreads()
            select_top(*smem, k, highest_index_bit(x), tid, lane, warp, THREADS)
            write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
    else:
        scatter_kept(buf, hist, count, k, lowest, fine_shift, tid, THREADS)
        write_ranked(x, values, indices, buf, hist, count, placed, k, lowest, fine_shift, row, part, parts, tid,
                     THREADS, LARGEST)


@nvfly.kernel
def topk_row_select_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, hist: nvfly.Tensor,
                           counters: nvfly.Tensor, candidates: nvfly.Tensor, k: nvfly.i32, slice_len: nvfly.i32,
                           VEC: nvfly.Constexpr, UNROLL: nvfly.Constexpr, THREADS: nvfly.Constexpr,
                           CAP: nvfly.Constexpr, ROW_CAP: nvfly.Constexpr, K_POW2: nvfly.Constexpr,
                           LARGEST: nvfly.Constexpr, REVERSED: nvfly.Constexpr):
    """Block (row, part) appends its slice's elements in the k-th largest key's bucket or above to
    ``candidates[row]``; the row's last block writes the k largest in order (``finish_list``) and cleans up
    (``counters[2*row]``: arrivals, ``counters[2*row + 1]``: appends). ``REVERSED`` (``TopkPlan.reversed_select``):
    the blocks take the slices in reverse order."""
    nvfly.min_blocks_per_sm(max(1, 512 // THREADS))
    row, tid, lane, warp, start, stop = block_slice(x, slice_len, REVERSED)
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    select_and_finish(x, values, indices, hist, counters, candidates, smem, k, row, tid, lane, warp, start, stop,
                      nvfly.grid_dim.y - 1, None, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST, False, False)


@nvfly.func
def select_and_finish(x, values, indices, hist, counters, candidates, smem, k, row, tid, lane, warp, start, stop,
                      last, first_loads, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST, RESIDENT, SHARED,
                      table=None, totals=None, EXACT_STRIDE=0):
    """The select's work once the row's histogram is complete: the k-th key's bucket, the block's candidates
    published, and the k largest written in order; the row's last block (``last`` arrivals before it) cleans up.
    ``first_loads``: the slice's first step as loaded by the caller (None: loaded here, in flight while the
    histogram is read). ``RESIDENT`` (one cooperative launch: the row's blocks all run at once): the histogram was
    completed by this launch, so it is read with GPU-scope loads; and when ``SHARED``, every block waits for the
    row's appends, then writes a share of the k (``finish_list``), and the last to leave cleans up. Else the last
    block writes them all. ``EXACT_STRIDE`` (one launch, 16-bit keys): where the keys from the k-th's bucket up
    span at most FINE_SPAN buckets, every block writes its own candidates at their places instead
    (``exact_finish``, through ``table`` and ``totals``)."""
    buf, kept_buf, row_hist, lane_sums, warp_sums, warp_lows, state = smem
    if first_loads is None:
        first_loads = step_loads(x, row, start, stop, 0, tid, VEC, UNROLL, THREADS)
    bucket, above, count = locate_row_bucket(hist, row_hist, lane_sums, warp_sums, row, k, tid, lane, warp, THREADS,
                                             RESIDENT)
    if EXACT_STRIDE:
        bins, inside = exact_bins(row_hist, bucket, above)
        if inside:
            exact_finish(x, values, indices, hist, counters, table, totals, smem, bucket, bins, k, row, tid, lane,
                         warp, start, stop, first_loads, VEC, UNROLL, THREADS, LARGEST, EXACT_STRIDE)
        else:
            list_finish(x, values, indices, hist, counters, candidates, smem, bucket, count, k, row, tid, lane, warp,
                        start, stop, last, first_loads, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST, SHARED)
    else:
        list_finish(x, values, indices, hist, counters, candidates, smem, bucket, count, k, row, tid, lane, warp,
                    start, stop, last, first_loads, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST, SHARED)


@nvfly.func
def list_finish(x, values, indices, hist, counters, candidates, smem, bucket, count, k, row, tid, lane, warp, start,
                stop, last, first_loads, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST, SHARED):
    """``select_and_finish`` through the row's candidate list: the block's candidates (keys in ``bucket`` or
    above, ``count`` in the row) appended, then the k written by the last block, or in shares (``SHARED``)."""
    buf, kept_buf, row_hist, lane_sums, warp_sums, warp_lows, state = smem
    lowest = bucket.bitcast(nvfly.u32) << ((32 if x.dtype == nvfly.f32 else 16) - HIST_BITS)
    if count <= ROW_CAP:
        stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, None,
                         first_loads)
    nvfly.syncthreads()
    is_last = publish_candidates(candidates, counters, row_hist, buf, state, row, tid, THREADS, last)
    if SHARED:
        if count <= ROW_CAP:
            parts = nvfly.grid_dim.y
            # the last block's arrival acquired every append; the others wait for it (one GPU-scope load or more)
            wait_for_count(counters, row, tid, last + 1, nvfly.select(is_last, last + 1, 0))
            leaving = nvfly.i32(0)
            if tid == 0:  # (relaxed, after the acquiring wait: its result is needed only at the end)
                leaving = atom_add(counters.address(2 * row), 1)
            finish_list(x, values, indices, candidates, smem, count, lowest, k, row, nvfly.block_idx.y, parts,
                        is_last, tid, lane, warp, THREADS, CAP, K_POW2, LARGEST)
            if syncthreads_or(leaving == last + parts):  # every block has passed the wait: the counters are free
                clean_row(hist, counters, row, tid, THREADS)
        elif is_last:  # (one call site for both branches compiled slower: docs/ops/topk.md)
            finish_alone(x, values, indices, hist, counters, candidates, smem, count, lowest, k, row, tid, lane, warp,
                         VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST)
    elif is_last:
        finish_alone(x, values, indices, hist, counters, candidates, smem, count, lowest, k, row, tid, lane, warp,
                     VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST)


# ---------------------------------------------------------------------------------------------- exact keys
EXACT_SPAN = EXACT_BINS >> (16 - HIST_BITS)  # first-level buckets of 16-bit keys that the exact bins cover
EXACT_UNROLL = 4  # the block's keys a warp reads the table for at once


def exact_table_index(x, row, key, column, STRIDE):
    """Where part ``column``'s count of ``key`` lies in the row's exact-finish table: the tables follow the rows'
    candidate lists (``plans.exact_table_rows``), which rows that take the list finish fill in the same launch."""
    return x.shape[0] * LIST_WORDS + (row * EXACT_BINS + key) * STRIDE + column


@nvfly.func
def exact_bins(row_hist, bucket, above):
    """(bins, inside) for 16-bit keys: ``bins`` exact keys from the k-th key's bucket's lowest up to the end of the
    highest non-empty bucket among the EXACT_SPAN from it, and whether every key above the bucket (``above``) lies
    there. Read from the row's histogram in shared memory: the same in every block."""
    top = bucket
    counted = nvfly.i32(0)
    for j in nvfly.static_range(1, EXACT_SPAN):
        c = nvfly.select(bucket + j < HIST, row_hist[nvfly.minimum(bucket + j, HIST - 1)], 0)
        counted = counted + c
        top = nvfly.select(c > 0, bucket + j, top)
    return (top - bucket + 1) << (16 - HIST_BITS), counted == above


@nvfly.func
def exact_finish(x, values, indices, hist, counters, table, totals, smem, bucket, bins, k, row, tid, lane, warp, start,
                 stop, first_loads, VEC, UNROLL, THREADS, LARGEST, STRIDE):
    """Every block writes its own candidates (16-bit keys in ``bucket`` or above: ``bins`` exact keys) at their
    output positions, with no list and no last block: the position of a candidate of key K is the row's elements
    of keys above K, plus those of key K in the earlier slices (lower indices), plus those of key K in its own
    slice that rank above it. The block stages its candidates and counts them by key; it writes every key's count
    to its column of the row's table (``exact_table_index``, STRIDE >= parts) and
    adds the non-zero ones to the row's ``totals``. After a second wait for the row's blocks, thread b loads key
    b's total, and each warp sums the earlier parts' counts of some of the keys the block holds (one 16-byte load a
    lane, a warp reduction); the totals' suffix sums plus those give each key's first position. Candidates at k or
    beyond are dropped. The table is never cleared (every entry read was written by this launch); the last block
    to leave zeroes the totals and cleans up (arrivals: the row's blocks twice, then their leaving)."""
    buf, kept_buf, row_hist, lane_sums, warp_sums, warp_lows, state = smem
    WARPS = THREADS // 32
    lowest = bucket.bitcast(nvfly.u32) << (16 - HIST_BITS)
    parts = nvfly.grid_dim.y
    part = nvfly.block_idx.y
    stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, None,
                     first_loads)
    if tid == 0:
        state[1] = 0  # (the block's keys, listed in lane_sums)
    nvfly.syncthreads()
    staged = state[0]
    counts = HIST  # row_hist[HIST:HIST + EXACT_BINS]: the block's counts (zeroed by the locate), then the starts
    earlier = HIST + EXACT_BINS  # row_hist[earlier + key]: the earlier parts' counts of the block's keys (zeroed too)
    for i in range(tid, staged, THREADS):
        atomic_add(row_hist, counts + (rank_key(buf[i]) - lowest).bitcast(nvfly.i32), 1)
    nvfly.syncthreads()
    if tid < bins:
        c = row_hist[counts + tid]
        table[exact_table_index(x, row, tid, part, STRIDE)] = c
        if c != 0:
            red_add(totals.address(row, tid), c)
            lane_sums[atomic_add(state, 1, 1)] = tid
    wait_for_row(counters, row, tid, 2 * parts)
    total = nvfly.i32(0)
    if tid < bins:
        total = load_relaxed(totals.address(row, tid), nvfly.i32)
    listed = state[1]
    for first in range(warp, listed, WARPS * EXACT_UNROLL):  # (warp w: the listed keys w, w + WARPS, ...)
        keys = [lane_sums[nvfly.minimum(first + u * WARPS, listed - 1)] for u in nvfly.static_range(EXACT_UNROLL)]
        # lanes past the stride re-read its last 16 bytes, whose parts are not earlier than any block's
        column = 4 * nvfly.minimum(lane, STRIDE // 4 - 1)
        loaded = [table.load(exact_table_index(x, row, key, column, STRIDE), width=4) for key in keys]
        for u in nvfly.static_range(EXACT_UNROLL):
            before = tree_reduce([nvfly.select(4 * lane + e < part, loaded[u][e], 0) for e in nvfly.static_range(4)],
                                 operator.add)
            before = redux_sync(before, "add")
            if (lane == 0) & (first + u * WARPS < listed):
                row_hist[earlier + keys[u]] = before
    # (the totals of later warps: 0)
    above = block_scan(total, warp_sums, lane, warp, EXACT_BINS // 32, exclusive=True, reverse=True)
    leaving = nvfly.i32(0)
    if tid == 0:  # (relaxed, after the block barrier that follows every thread's load of the totals)
        leaving = atom_add(counters.address(2 * row), 1)
    if tid < EXACT_BINS:
        row_hist[counts + tid] = above + row_hist[earlier + tid]
    nvfly.syncthreads()
    for i in range(tid, staged, THREADS):
        mine = buf[i]
        key_start = row_hist[counts + (rank_key(mine) - lowest).bitcast(nvfly.i32)]
        if key_start < k:
            position = key_start + ranks_above(buf, 0, staged, mine, mine | 0xFFFFFFFF)  # (mine's key only)
            if position < k:
                write_result(x, values, indices, mine, row, position, LARGEST)
    if syncthreads_or(leaving == 3 * parts - 1):  # every block has read the totals: they and the counters are free
        if tid < EXACT_BINS:
            totals[row, tid] = 0
        clean_row(hist, counters, row, tid, THREADS)


@nvfly.func
def finish_alone(x, values, indices, hist, counters, candidates, smem, count, lowest, k, row, tid, lane, warp, VEC,
                 UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST):
    """The row's last block writes the k largest: from the list (``finish_list``) or, when the threshold's bucket
    and above held more than ROW_CAP (nothing was appended), by streaming the whole row; then cleans up."""
    buf, kept_buf, row_hist, lane_sums, warp_sums, warp_lows, state = smem
    nvfly.threadfence()
    if count <= ROW_CAP:
        finish_list(x, values, indices, candidates, smem, count, lowest, k, row, 0, 1, True, tid, lane, warp,
                    THREADS, CAP, K_POW2, LARGEST)
    else:
        stream_top(x, row, 0, x.shape[1], k, smem, tid, VEC, UNROLL, THREADS, CAP, K_POW2, LARGEST)
        write_sorted(x, values, indices, buf, kept_buf, state[0], k, row, tid, lane, K_POW2, THREADS)
    clean_row(hist, counters, row, tid, THREADS)


# ---------------------------------------------------------------------------------------------- one launch
@nvfly.func
def wait_for_row(counters, row, tid, target):
    """A barrier over the row's blocks, all resident (a cooperative launch): the block's global writes, ordered
    before the block barrier, are fenced by its first thread (cumulative), which counts the block in on
    ``counters[2*row]`` and waits until the arrivals reach ``target`` (as CUDA's grid sync does)."""
    nvfly.syncthreads()
    if tid == 0:
        nvfly.threadfence()
        red_add(counters.address(2 * row), 1)  # (no result to wait for)
    wait_for_count(counters, row, tid, target, nvfly.i32(0))


@nvfly.func
def wait_for_count(counters, row, tid, target, seen):
    """The block waits until the row's arrivals (``counters[2*row]``) reach ``target``: its first thread loads
    them (acquire, GPU scope) until they do, starting from ``seen`` (a count it already acquired: no load when
    that is enough); the block barrier then orders every thread's loads after that acquire (as CUTLASS's
    ``GenericBarrier::wait_eq``: no fence after it)."""
    if tid == 0:
        while seen < target:
            seen = load_acquire(counters.address(2 * row), nvfly.i32)
    nvfly.syncthreads()


@nvfly.kernel
def topk_row_one_launch_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, hist: nvfly.Tensor,
                               counters: nvfly.Tensor, candidates: nvfly.Tensor, table: nvfly.Tensor,
                               totals: nvfly.Tensor, k: nvfly.i32,
                               slice_len: nvfly.i32, VEC: nvfly.Constexpr, UNROLL: nvfly.Constexpr,
                               THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr, ROW_CAP: nvfly.Constexpr,
                               K_POW2: nvfly.Constexpr, LARGEST: nvfly.Constexpr, SHARED: nvfly.Constexpr,
                               EXACT_STRIDE: nvfly.Constexpr):
    """The histogram and select launches in one, for grids whose blocks all fit on the GPU at once (a cooperative
    launch; ``plans.row_plan`` decides): block (row, part) counts its slice into ``hist[row]``, waits for the row's
    other blocks (``wait_for_row``: their arrivals on ``counters[2*row]``), then selects as
    ``topk_row_select_kernel``, whose arrivals then count on from the row's block count (the last block is the
    2 * blocks-th), with the slice's first step still in registers.
    ``SHARED`` (``TopkPlan.shared_finish``): every block of the row writes a share of the k. ``EXACT_STRIDE``
    (``TopkPlan.exact_stride``, 16-bit keys): where the keys from the k-th's bucket up are few enough, every
    block writes its own candidates at their places (``exact_finish``; ``table``: i32, the candidate lists'
    memory, past the rows' lists; ``totals``: the second-level histograms, zero between launches). One launch
    fewer than two: a launch gap and its host work."""
    nvfly.cooperative()
    nvfly.min_blocks_per_sm(1)  # (without it ptxas held this kernel to 64 registers and spilled)
    row, tid, lane, warp, start, stop = block_slice(x, slice_len)
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    counts = nvfly.dynamic_shared_tensor(nvfly.i32, (HIST * COPIES,), one_launch_counts_offset(CAP, K_POW2, THREADS))
    first_loads = count_slice(x, hist, counts, row, start, stop, tid, VEC, UNROLL, THREADS, LARGEST)
    wait_for_row(counters, row, tid, nvfly.grid_dim.y)
    select_and_finish(x, values, indices, hist, counters, candidates, smem, k, row, tid, lane, warp, start, stop,
                      2 * nvfly.grid_dim.y - 1, first_loads, VEC, UNROLL, THREADS, CAP, ROW_CAP, K_POW2, LARGEST,
                      True, SHARED, table, totals, EXACT_STRIDE)


def one_launch_counts_offset(cap: int, k_pow2: int, threads: int) -> int:
    """Where ``topk_row_one_launch_kernel``'s slice counts start in shared memory: after the select's state."""
    return -(-shared_state_bytes(cap, k_pow2, threads) // 1024) * 1024


def one_launch_smem_bytes(cap: int, k_pow2: int, threads: int) -> int:
    return one_launch_counts_offset(cap, k_pow2, threads) + HIST * COPIES * 4


# ---------------------------------------------------------------------------------------------- two levels
@nvfly.func
def append_two(state, firsts, seconds, lane):
    """Slots for two appends of several elements a lane at once (the lanes where ``firsts[i]`` / ``seconds[i]``
    hold), counted by ``state[0]``: the first's count in its low 16 bits, the second's in the high ones (each
    below 2**15: ROW_CAP_MAX), so one ballot an element and one shared atomic per warp for all of them."""
    below = lanemask("lt")
    votes = [ballot(t) for t in firsts] + [ballot(t) for t in seconds]
    totals = [popc(v) for v in votes]
    first_total = totals[0]
    for t in totals[1:len(firsts)]:
        first_total = first_total + t
    second_total = totals[len(firsts)]
    for t in totals[len(firsts) + 1:]:
        second_total = second_total + t
    packed = first_total | (second_total << 16)
    base = nvfly.i32(0)
    if (lane == 0) & (packed != 0):
        base = atomic_add(state, 0, packed)
    base = nvfly.shfl_idx(base, 0)
    positions = []
    for i in nvfly.static_range(len(votes)):
        if i == 0:
            at = base & 0xFFFF
        elif i == len(firsts):
            at = base >> 16
        positions.append(at + popc(votes[i] & below))
        at = at + totals[i]
    return positions[:len(firsts)], positions[len(firsts):]


@nvfly.kernel
def topk_row_two_level_kernel(x: nvfly.Tensor, values: nvfly.Tensor, indices: nvfly.Tensor, hist: nvfly.Tensor,
                              hist2: nvfly.Tensor, counters: nvfly.Tensor, candidates: nvfly.Tensor, k: nvfly.i32,
                              slice_len: nvfly.i32, VEC: nvfly.Constexpr, UNROLL: nvfly.Constexpr,
                              THREADS: nvfly.Constexpr, CAP: nvfly.Constexpr, ROW_CAP: nvfly.Constexpr,
                              K_POW2: nvfly.Constexpr, LARGEST: nvfly.Constexpr):
    """``topk_row_select_kernel`` with a second level (``plan(..., two_level=True)``): while it appends, every
    block also counts the next key bits (``level_shifts``) of its elements in the first-level bucket B of the k-th
    key and adds its non-zero counts into ``hist2[row]``. The row's last block locates the k-th key's second-level
    bucket B2 in that histogram, then reads the candidate list once (two ranks a 16-byte load; the first step's
    loads are in flight during the locate, the next step's during this one's): keys above B2's prefix (``sure``:
    fewer than k, all taken) go to ``buf[:sure]``, those at it (``inside``) to ``buf[sure:sure + inside]`` (one
    shared atomic a warp and step for both, ``append_two``), the rest are dropped. Only the ``need = k - sure``
    best of the inside ones remain to be chosen: all when ``inside == need``; else by counting, for each
    (inside <= THREADS), the inside ones that rank above it (16-bit keys:
    ranks differ only in the index, so the lowest indices are kept); else (heavy ties at the threshold) by a
    select of the k best of ``buf[:sure + inside]``. Then the sort of the k. The last block zeroes the row's
    second-level histogram as it loads it; the rest of the workspace as ``topk_row_select_kernel``."""
    nvfly.min_blocks_per_sm(max(1, 512 // THREADS))
    row, tid, lane, warp, start, stop = block_slice(x, slice_len)
    shift1, bits2, shift2 = level_shifts(32 if x.dtype == nvfly.f32 else 16)
    HIST2 = 1 << bits2
    smem = shared_state(CAP, K_POW2, THREADS, tid)
    buf, kept_buf, counts, lane_sums, warp_sums, warp_lows, state = smem  # counts: the two levels' histograms
    bucket, above, count = locate_row_bucket(hist, counts, lane_sums, warp_sums, row, k, tid, lane, warp, THREADS,
                                             False)
    if count <= ROW_CAP:
        lowest = bucket.bitcast(nvfly.u32) << shift1
        stage_candidates(x, row, start, stop, lowest, buf, state, tid, lane, VEC, UNROLL, THREADS, LARGEST, counts)
    nvfly.syncthreads()
    for j in nvfly.static_range((HIST2 + THREADS - 1) // THREADS):
        digit = j * THREADS + tid
        if digit < HIST2:
            c = counts[HIST + digit]
            if c != 0:  # (before publish_candidates' fence: the last block reads these)
                red_add(hist2.address(row, digit), c)
                counts[HIST + digit] = 0
    if publish_candidates(candidates, counters, counts, buf, state, row, tid, THREADS, nvfly.grid_dim.y - 1):
        nvfly.threadfence()
        if count <= ROW_CAP:
            STEP = 2 * SWEEP * THREADS
            current = list_loads(candidates, row, 0, count, tid, THREADS)  # (in flight during the locate)
            for j in nvfly.static_range((HIST2 + THREADS - 1) // THREADS):
                digit = j * THREADS + tid
                if digit < HIST2:
                    counts[HIST + digit] = load_relaxed(hist2.address(row, digit), nvfly.i32)
                    hist2[row, digit] = 0
            nvfly.syncthreads()
            bucket2, above2, inside = locate_bucket(counts, lane_sums, warp_sums, HIST, 0, k - above, tid, lane, warp,
                                                    THREADS)
            sure = above + above2  # below k; inside >= k - sure
            prefix = (bucket.bitcast(nvfly.u32) << bits2) | bucket2.bitcast(nvfly.u32)
            for first in range(0, count, STEP):  # (uniform trips: the appends vote over whole warps)
                upcoming = list_loads(candidates, row, first + STEP, count, tid, THREADS)
                highers = []
                ats = []
                for i in nvfly.static_range(2 * SWEEP):
                    real = first + 2 * ((i // 2) * THREADS + tid) + i % 2 < count
                    digits = rank_key(current[i]) >> shift2
                    highers.append(real & (digits > prefix))
                    ats.append(real & (digits == prefix))
                higher_slots, at_slots = append_two(state, highers, ats, lane)
                for i in nvfly.static_range(2 * SWEEP):
                    buf.store(current[i], higher_slots[i], mask=highers[i])
                    buf.store(current[i], sure + at_slots[i], mask=ats[i])
                current = upcoming
            nvfly.syncthreads()
            need = k - sure
            if (inside != need) & (inside <= THREADS):
                mine = buf.load(sure + tid, mask=tid < inside, other=ABSENT)
                higher = ranks_above(buf, sure, inside, mine)
                nvfly.syncthreads()
                if (tid < inside) & (higher < need):
                    buf[sure + higher] = mine  # (ranks are unique: the kept ones fill buf[sure:k])
            if (inside != need) & (inside > THREADS):
                if tid == 0:
                    state[0] = sure + inside
                nvfly.syncthreads()
                select_top(*smem, k, highest_index_bit(x), tid, lane, warp, THREADS)
            if tid == 0:
                state[0] = k
            nvfly.syncthreads()
        else:
            stream_top(x, row, 0, x.shape[1], k, smem, tid, VEC, UNROLL, THREADS, CAP, K_POW2, LARGEST)
        finish_row(x, values, indices, hist, counters, buf, kept_buf, state, k, row, tid, lane, K_POW2, THREADS)

