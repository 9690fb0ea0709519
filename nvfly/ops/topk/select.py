"""The select of the k largest ranks among a block's candidates in shared memory (``select_top``), and the
block's shared state it works in (``shared_state``).

One sweep counts the real candidates and their key range (one barrier); radix passes with HIST_BITS-bit digits
from the highest differing key bit, skipping the ~index bits above the row's highest index bit (ones in every
rank), each pass shared-memory atomics into one of two histograms and ``locate_bucket`` (every thread finds the
bucket from warp, lane and bucket sums: two barriers a pass, the other histogram zeroed on the way); a compaction
with a block scan instead of per-warp atomics. Nothing runs when k or fewer are real.
"""
from __future__ import annotations

import nvfly
from nvfly.arch.reduce import warp_scan
from nvfly.arch.warp import ballot, highest_bit
from nvfly.frontend.language import atomic_add, redux_sync
from nvfly.ops.topk.keys import ABSENT, rank_key
from nvfly.ops.topk.plans import HIST, HIST_BITS, SWEEP


# ---------------------------------------------------------------------------------------------- the select
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
    suffix = warp_scan(suffix, lane, reverse=True)
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
    inclusive = warp_scan(mine, lane)
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


# ---------------------------------------------------------------------------------------------- the block's state
@nvfly.func
def shared_state(CAP, K_POW2, THREADS, tid):
    """The block's shared memory (``plans.shared_state_bytes``): the candidate buffer, the compaction's (and
    sort's) spare, two histograms (zeroed), the lane and warp sums, the warps' smallest kept ranks, the state ([0]:
    candidates in the buffer, zeroed). The caller's barrier publishes the zeroes."""
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
