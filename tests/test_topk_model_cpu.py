"""TopK's streaming radix kernel modelled in Python, step by step as the device code computes it (no GPU needed):
the candidate flags (one compare per element against ``flag_key``'s value, a superset of the candidates), the
trip loop that decodes flag bits back to columns (``flag_element``), the select (key range, radix passes with
the index-bit skip, ``locate_bucket``'s warp/lane/bucket search, the compaction's slots, the smallest kept rank
as the next threshold), the register bitonic sort (``sort_per_thread``, ``bitonic_stages`` and each stage's keep
rule) and the slices + ``topk_merge_kernel`` (every rank of a row in shared memory, one select); ``topk_row``'s
row-threshold launches and their opt-in two-level select (the second-level histogram of the threshold bucket,
the last block's one sweep over the list with packed appends, the counting and select paths), and the one-launch
exact finish of 16-bit keys (every block placing its own candidates from per-key counts). The model runs
the kernel's plans on random rows, heavy ties, NaN/inf/zeros and sorted rows and must return exactly the
documented order (a stable sort, NaN largest)."""
import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from nvfly.ops import topk
from nvfly.ops.topk import keys as topk_keys, plans as topk_plans, row as topk_row, select as topk_select, \
    sort as topk_sort, stream as topk_stream

ABSENT = topk_keys.ABSENT
M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
FORMATS = {"bf16": 16, "f16": 16, "f32": 32}


# ---------------------------------------------------------------------------------------------- values and ranks
def as_floats(bits, fmt):
    """float64 values of bit patterns (numpy u32 array)."""
    bits = np.asarray(bits, dtype=np.uint32)
    with np.errstate(invalid="ignore"):  # (NaN patterns)
        if fmt == "f32":
            return bits.view(np.float32).astype(np.float64)
        if fmt == "bf16":
            return (bits << 16).view(np.float32).astype(np.float64)
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def order_keys(bits, fmt, largest):
    """``topk_keys.order_key`` for bit patterns (numpy u32 array)."""
    width = FORMATS[fmt]
    full = (1 << width) - 1
    sign = 1 << (width - 1)
    bits = np.asarray(bits, dtype=np.int64)
    key = bits ^ np.where(bits & sign, full, sign)
    nan_above = {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}[fmt]
    key = np.where((bits & (full >> 1)) > nan_above, full, key)
    return key ^ full if not largest else key


def to_signed(u):
    """A 64-bit pattern (0..2**64-1) as the kernel's signed i64."""
    return u - (1 << 64) if u >= 1 << 63 else u


def rank_of(key, col):
    """``rank64``: (key << 32 | ~col) with the top bit flipped, signed."""
    return to_signed(((key << 32) | (~col & M32)) ^ (1 << 63))


def rank_u(r):
    """u = rank ^ ABSENT: the rank as an unsigned number (0 for ABSENT)."""
    return (r & M64) ^ (1 << 63)


def reference(bits, k, fmt, largest):
    """The documented result: a stable sort of the values, NaN largest (the columns, in order)."""
    keys = order_keys(bits, fmt, largest)
    return sorted(range(len(bits)), key=lambda c: (-int(keys[c]), c))[:k]


# ---------------------------------------------------------------------------------------------- flags
def key_bits(key, fmt, largest):
    """``topk_keys.key_bits``: the bit pattern whose order key is ``key``."""
    width = FORMATS[fmt]
    full = (1 << width) - 1
    sign = 1 << (width - 1)
    if not largest:
        key ^= full
    return key ^ sign if key & sign else ~key & full


def flag_key(threshold_key, ties, fmt):
    """``topk_keys.flag_key``."""
    flag = (threshold_key - (1 if ties and threshold_key != 0 else 0)) & M32
    return (flag - (1 if flag == {"f32": 0x7FFFFFFF}.get(fmt, 0x7FFF) else 0)) & M32


def flagged(values, flag_value, largest):
    """``set.gtu`` (largest) / ``set.ltu``: above (below) the flag value, or unordered with it."""
    with np.errstate(invalid="ignore"):
        return ~(values <= flag_value) if largest else ~(values >= flag_value)


@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("largest", [True, False])
def test_flags_are_a_superset_of_the_candidates(fmt, largest):
    """Every bit pattern that ranks at or above a threshold (ties by index: in the first iteration an element
    with the threshold's key may have a lower index) is flagged by the one float compare with flag_key's value:
    over all 16-bit patterns (a sample of f32 ones) and thresholds at zeros, infinities, NaN, ABSENT's key 0,
    denormals and random keys."""
    width = FORMATS[fmt]
    rng = np.random.default_rng(1)
    if width == 16:
        patterns = np.arange(1 << 16, dtype=np.uint32)
    else:
        special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 1, 0x80000001, 0x7F7FFFFF,
                   0xFF7FFFFF, 0x00800000, 0x80800000]
        patterns = np.concatenate([np.array(special, dtype=np.uint32),
                                   rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)])
    keys = order_keys(patterns, fmt, largest)
    values = as_floats(patterns, fmt)
    full = (1 << width) - 1
    thresholds = {0, 1, 2, full, full - 1} | {int(order_keys(np.array([b]), fmt, largest)[0]) for b in
                                               ([0, 1 << (width - 1), 1, (1 << (width - 1)) + 1] +
                                                [int(b) for b in rng.choice(patterns, 300)])}
    for tkey in sorted(thresholds):
        for ties in (True, False):
            flag_value = as_floats(np.array([key_bits(flag_key(tkey, ties, fmt), fmt, largest)]), fmt)[0]
            hit = flagged(values, flag_value, largest)
            must = keys >= tkey if ties else keys > tkey
            missed = np.flatnonzero(must & ~hit)
            assert missed.size == 0, (fmt, largest, hex(tkey), ties, [hex(int(patterns[i])) for i in missed[:5]])
            if tkey not in (0, 1) and not math.isnan(flag_value):  # and little else is flagged
                assert np.count_nonzero(hit & ~must) <= np.count_nonzero(np.isnan(values)) + 2 + (keys == tkey).sum()


@pytest.mark.parametrize("vec,unroll,packed", [(8, 4, True), (8, 1, True), (2, 8, True), (4, 4, False),
                                               (1, 8, False), (2, 4, False), (8, 2, True), (4, 2, False)])
def test_flag_bits_cover_each_element_of_an_iteration_once(vec, unroll, packed):
    bits = [topk_keys.flag_bit(u, e, vec, packed) for u in range(unroll) for e in range(vec)]
    assert len(set(bits)) == len(bits) and all(0 <= b < 32 for b in bits)
    for u in range(unroll):
        for e in range(vec):
            assert topk_keys.flag_element(topk_keys.flag_bit(u, e, vec, packed), vec, packed) == (u, e)
    if packed:  # both halves of word w sit at w and w + 16: one AND with 0x00010001 << w places them
        for u in range(unroll):
            for w in range(vec // 2):
                assert topk_keys.flag_bit(u, 2 * w + 1, vec, packed) == topk_keys.flag_bit(u, 2 * w, vec, packed) + 16


# ---------------------------------------------------------------------------------------------- the select
def locate_bucket(hist, needed, threads):
    """``topk_select.locate_bucket``: thread ownership, lane suffix sums, warp sums, the ballot of the lanes."""
    per = topk_plans.HIST // threads
    totals = [sum(hist[t * per:(t + 1) * per]) for t in range(threads)]
    suffix = [sum(totals[t - t % 32 + lane] for lane in range(t % 32, 32)) for t in range(threads)]
    warp_sums = [suffix[w * 32] for w in range(threads // 32)]
    target = above = higher = 0
    for w in range(threads // 32 - 1, -1, -1):
        if higher < needed <= higher + warp_sums[w]:
            target, above = w, higher
        higher += warp_sums[w]
    lane_suffix = [suffix[target * 32 + lane] for lane in range(32)]
    reach = [lane for lane in range(32) if above + lane_suffix[lane] >= needed]
    assert reach, "the ballot of the target warp is empty"
    owner_lane = max(reach)
    above += 0 if owner_lane == 31 else lane_suffix[owner_lane + 1]
    owner = target * 32 + owner_lane
    found = None
    for i in range(per - 1, -1, -1):
        c = hist[owner * per + i]
        if above < needed <= above + c:
            found = (owner * per + i, above, c)
        above += c
    assert found is not None
    return found


def radix_threshold(buf, needed, key_high, key_low, index_top, threads, passes):
    """``topk_select.radix_threshold`` on Python ints (u-space patterns masked to 64 bits)."""
    keys_differ = key_high != key_low
    top = (key_high ^ key_low).bit_length() - 1 + 32 if keys_differ else index_top
    index_ones = M32 & ~((2 << index_top) - 1)
    span = ((2 << top) - 1) & M64
    range_low = ((key_high << 32) & ~span & M64) | (0 if keys_differ else index_ones)
    range_high = range_low | span
    shift = max(top - (topk_plans.HIST_BITS - 1), 0)
    while True:
        passes.append(shift)
        low = max(to_signed(range_low ^ (1 << 63)), ABSENT + 1)
        high = to_signed(range_high ^ (1 << 63))
        hist = [0] * topk_plans.HIST
        for r in buf:
            if low <= r <= high:
                hist[(rank_u(r) >> shift) & (topk_plans.HIST - 1)] += 1
        bucket, above, in_bucket = locate_bucket(hist, needed, threads)
        needed -= above
        range_low |= bucket << shift
        if in_bucket == needed or shift == 0:
            return to_signed(range_low ^ (1 << 63))
        next_top = shift - 1
        if index_top < next_top < 32:
            range_low |= ((1 << shift) - 1) & ~((2 << index_top) - 1)
            next_top = index_top
        range_high = range_low | ((2 << next_top) - 1)
        shift = max(next_top - (topk_plans.HIST_BITS - 1), 0)


def compaction_slots(buf, threshold, threads):
    """``topk_select.compact``'s slots: each thread's keepers (strided over the buffer) after a block scan."""
    keeps = [[i for i in range(t, len(buf), threads) if buf[i] != ABSENT and buf[i] >= threshold]
             for t in range(threads)]
    slots = {}
    position = 0
    for t in range(threads):  # the warp inclusive sums and the earlier warps' totals: an exclusive scan
        for i in keeps[t]:
            slots[i] = position
            position += 1
    return slots


def select_top(buf, needed, index_top, threads, stats):
    """``topk_select.select_top``: (threshold: the smallest kept rank or ABSENT, the kept ranks in their new order)."""
    reals = [r for r in buf if r != ABSENT]
    bound = threshold = ABSENT
    if len(reals) > needed:
        keys = [(rank_u(r) >> 32) for r in reals]
        passes = []
        bound = radix_threshold(buf, needed, max(keys), min(keys), index_top, threads, passes)
        stats.append((len(buf), len(passes)))
    if len(reals) > needed or len(reals) != len(buf):
        slots = compaction_slots(buf, bound, threads)
        kept = [None] * len(slots)
        for i, s in slots.items():
            kept[s] = buf[i]
        assert sorted(kept) == sorted(r for r in reals if r >= bound)
        buf = kept
        if len(reals) > needed:
            threshold = min(kept)
    assert len(buf) == min(len(reals), needed)
    if len(reals) > needed:  # exactly the kept ranks are >= the bound and >= T
        assert sum(r >= bound for r in reals) == needed == sum(r >= threshold for r in reals)
    return threshold, buf


# ---------------------------------------------------------------------------------------------- the sort
def sort_descending(buf, kept, size, threads):
    """``topk_sort.sort_descending``: per-thread registers, each stage's keep rule as the device computes it."""
    per = topk_sort.sort_per_thread(size, threads)
    items = [[buf[t * per + j] if t * per + j < kept else ABSENT for j in range(per)] for t in range(threads)]
    for block, stride in topk_sort.bitonic_stages(size):
        new = [row[:] for row in items]
        for t in range(threads):
            first = t * per
            if first >= size:
                continue
            descending = (first & block) == 0
            for j in range(per):
                if stride < per:
                    if j & stride:
                        continue
                    a, b = items[t][j], items[t][j | stride]
                    down = (j & block) == 0 if block < per else descending
                    new[t][j], new[t][j | stride] = (max(a, b), min(a, b)) if down else (min(a, b), max(a, b))
                    continue
                if stride < 32 * per:  # a shuffle: lane ^ stride / per, same j
                    lane = t % 32
                    other = items[(t - lane) + (lane ^ (stride // per))][j]
                    lower = (lane & (stride // per)) == 0
                else:  # through shared memory
                    partner = (first + j) ^ stride
                    other = items[partner // per][partner % per]
                    lower = (first & stride) == 0
                mine = items[t][j]
                new[t][j] = max(mine, other) if lower == descending else min(mine, other)
        items = new
    return [v for row in items[:-(-size // per)] for v in row][:size]


@pytest.mark.parametrize("size,threads", [(2, 256), (4, 256), (32, 256), (64, 256), (128, 256), (256, 256),
                                          (1024, 256), (2048, 512), (2048, 256), (512, 512)])
def test_register_bitonic_sort_model(size, threads):
    rng = random.Random(size + threads)
    for kept in {size, size // 2 + 1, 1, max(1, size - 3)}:
        ranks = list({rng.randrange(-(1 << 62), 1 << 62) for _ in range(kept)})
        out = sort_descending(ranks + [ABSENT] * (size - kept), kept, size, threads)
        assert out == sorted(ranks, reverse=True) + [ABSENT] * (size - kept)


# ---------------------------------------------------------------------------------------------- the kernel
def flagged_bits(loaded, bit, vec, packed):
    """``topk_stream.flagged_bits``: the flagged element's bits picked from the thread's loads (lists of bit patterns)
    by ``topk_stream.pick``'s tree of selects."""
    select = lambda cond, a, b: a if cond else b  # noqa: E731
    if packed:  # 16-bit values two to a little-endian u32 word
        words = [row[2 * w] | row[2 * w + 1] << 16 for row in loaded for w in range(vec // 2)]
        return (topk_stream.pick(words, bit & 15, select) >> ((bit >> 4) << 4)) & 0xFFFF
    return topk_stream.pick([v for row in loaded for v in row], bit, select)


def stream_block(bits, start, stop, k, vec, unroll, threads, cap, k_pow2, fmt, largest, rng, stats):
    """One block of ``topk_radix_kernel`` over columns [start, stop) of a row (bit patterns): the maxima
    select, the flagged stream with its trips, the overflow selects and the final one; returns the kept ranks
    (``buf[:kept]``)."""
    index_top = max(len(bits) - 1, 1).bit_length() - 1
    per_iter = threads * vec * unroll
    limit = cap - per_iter
    packed = fmt != "f32" and vec > 1
    keys = order_keys(bits, fmt, largest)

    def rank(col):
        return rank_of(int(keys[col]), col) if col < stop else ABSENT

    groups = min(vec * unroll, 2 * ((k_pow2 + threads - 1) // threads))
    maxima = [ABSENT] * (groups * threads)
    for t in range(threads):
        for u in range(unroll):
            for e in range(vec):
                col = start + (u * threads + t) * vec + e
                g = (u * vec + e) % groups
                maxima[g * threads + t] = max(maxima[g * threads + t], rank(col))
    threshold, _ = select_top(maxima, k, index_top, threads, stats)
    buf = []
    for it in range(-(-(stop - start) // per_iter)):
        tkey = rank_u(threshold) >> 32
        flag_value = as_floats(np.array([key_bits(flag_key(tkey, it == 0, fmt), fmt, largest)]), fmt)[0]
        appended = []
        for t in range(threads):
            col0 = start + (it * unroll * threads + t) * vec
            loaded = [[int(bits[c]) if c < stop else 0 for c in range(col0 + u * threads * vec,
                                                                     col0 + u * threads * vec + vec)]
                      for u in range(unroll)]  # (masked loads past the end read 0)
            hits = flagged(as_floats(np.array(loaded).ravel(), fmt), flag_value, largest)
            pending = 0
            for u in range(unroll):
                for e in range(vec):
                    if hits[u * vec + e]:
                        pending |= 1 << topk_keys.flag_bit(u, e, vec, packed)
            while pending:  # the trips: lowest flag first, decoded back to a column, picked, checked exactly
                lowest = pending & -pending
                pending ^= lowest
                bit = lowest.bit_length() - 1
                u, e = topk_keys.flag_element(bit, vec, packed)
                col = col0 + u * threads * vec + e
                picked = flagged_bits(loaded, bit, vec, packed)
                assert picked == loaded[u][e]
                if col < stop and rank_of(int(order_keys(np.array([picked]), fmt, largest)[0]), col) >= threshold:
                    appended.append(rank(col))
        exact = [rank(c) for c in range(start + it * per_iter, min(stop, start + (it + 1) * per_iter))]
        assert sorted(appended) == sorted(r for r in exact if r >= threshold), \
            "the flags missed a candidate, or the trips visited one twice"
        rng.shuffle(appended)  # the warps append in any order
        buf += appended
        if len(buf) > limit:
            threshold, buf = select_top(buf, k, index_top, threads, stats)
    _, buf = select_top(buf, k, index_top, threads, stats)
    return buf


def model_topk(bits, k, fmt, largest, m_rows, sm_count=132, seed=0):
    """The kernels' plan for m_rows rows like this one, run on this row: the columns of the top k."""
    n = len(bits)
    itemsize = FORMATS[fmt] // 8
    vec = 16 // itemsize
    while n % vec:  # (runtime.torch_args.vector_width for contiguous rows)
        vec //= 2
    p = topk.plan(n, k, m_rows, vec, itemsize, sm_count, row_threshold=False)
    assert not p.warp
    rng = random.Random(seed)
    stats = []
    if p.parts == 1:
        kept = stream_block(bits, 0, n, k, vec, p.unroll, p.threads, p.cap, p.k_pow2, fmt, largest, rng, stats)
    else:
        ranks = []
        for part in range(p.parts):
            start = part * p.slice_len
            kept = stream_block(bits, start, min(start + p.slice_len, n), k, vec, p.unroll, p.threads, p.cap,
                                p.k_pow2, fmt, largest, rng, stats)
            ranks += kept + [ABSENT] * (k - len(kept))
        assert len(ranks) <= p.merge_cap  # topk_merge_kernel: every rank into shared memory, one select
        _, kept = select_top(ranks, k, max(n - 1, 1).bit_length() - 1, topk_plans.STREAM_THREADS, stats)
    threads = p.threads if p.parts == 1 else topk_plans.STREAM_THREADS
    out = sort_descending(kept + [ABSENT] * (p.k_pow2 - len(kept)), len(kept), p.k_pow2, threads)
    return [~r & M32 for r in out[:k]], stats


def rows(kind, n, fmt, seed):
    """Bit patterns of a test row."""
    g = torch.Generator().manual_seed(seed)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[fmt]
    if kind == "randn":
        x = torch.randn(n, generator=g)
    elif kind == "ties":
        x = torch.randint(-2, 3, (n,), generator=g).float()
    elif kind == "zeros":
        x = torch.zeros(n)
        x[torch.rand(n, generator=g) < 0.5] = -0.0
    elif kind == "special":
        x = torch.randn(n, generator=g)
        s = torch.rand(n, generator=g)
        x[s < 0.01] = float("nan")
        x[(s >= 0.01) & (s < 0.02)] = float("inf")
        x[(s >= 0.02) & (s < 0.03)] = -float("inf")
        x[(s >= 0.03) & (s < 0.05)] = 0.0
    elif kind == "rising":
        x = torch.arange(n).float()
    else:
        x = -torch.arange(n).float()
    x = x.to(dtype)
    view = {16: torch.int16, 32: torch.int32}[FORMATS[fmt]]
    return (x.view(view).numpy().astype(np.int64) & ((1 << FORMATS[fmt]) - 1)).astype(np.uint32)


CASES = [  # (n, k, rows the plan is for): one block per row, slices + merge, k = 1 ... 2048
    (20_000, 50, 256), (20_000, 1024, 256), (40_000, 50, 1), (40_000, 1024, 1), (40_000, 2048, 1),
    (9_000, 1, 256), (30_001, 33, 3), (12_000, 1000, 64), (4097, 2048, 64), (1100, 8, 1), (40, 40, 2),
]


@pytest.mark.sweep
@pytest.mark.parametrize("n,k,m", CASES)
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_model_matches_the_stable_sort_on_random_rows(n, k, m, fmt):
    for largest in (True, False):
        bits = rows("randn", n, fmt, seed=n + k)
        got, _ = model_topk(bits, min(k, n), fmt, largest, m)
        assert got == reference(bits, min(k, n), fmt, largest)


@pytest.mark.sweep
@pytest.mark.parametrize("kind", ["ties", "zeros", "special", "rising", "falling"])
@pytest.mark.parametrize("n,k,m", [(20_000, 50, 256), (20_000, 1024, 1), (5000, 100, 2)])
@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
def test_model_matches_the_stable_sort_on_ties_nan_and_sorted_rows(kind, n, k, m, fmt):
    for largest in (True, False):
        bits = rows(kind, n, fmt, seed=7)
        got, _ = model_topk(bits, k, fmt, largest, m)
        assert got == reference(bits, k, fmt, largest)


def test_model_select_passes_skip_the_constant_index_bits():
    """bf16 rows: the key digits, then index digits from the row's highest index bit (not bit 31): at most
    one pass on the key and two on the index (N < 2**22) per select."""
    bits = rows("randn", 40_000, "bf16", seed=3)
    _, stats = model_topk(bits, 1024, "bf16", True, 256)
    assert stats and max(passes for _, passes in stats) <= 4, stats
    index_top = 40_000 .bit_length() - 1
    passes = []
    ranks = [rank_of(0x4000, c) for c in range(0, 40_000, 7)]  # one key: only the index decides
    radix_threshold(ranks, 100, 0x4000, 0x4000, index_top, 256, passes)
    assert passes[0] == max(index_top - 10, 0) and len(passes) <= 2


# ---------------------------------------------------------------------------------------------- row threshold
def row_threshold_topk(bits, k, fmt, largest, m_rows, sm_count=132, seed=0, two_level=False, paths=None,
                       exact=False):
    """``topk_row``'s two launches under ``topk_plans.row_plan`` for m_rows rows like this one, run on this row: the
    slices' bucket counts summed into the row's histogram, ``locate_bucket`` of the k-th largest key, each
    slice's flagged and checked elements in the bucket or above appended in any order (blocks arrive in any
    order), the last block's select and sort, or its whole-row stream when the bucket and above exceed the
    list. ``two_level``: ``topk_row_two_level_kernel`` instead (``two_level_select``); ``exact`` (as
    ``topk.plan``'s): a one-launch plan's exact finish where the keys allow (``exact_finish``); ``paths`` (a list)
    gets the path. Returns (columns, whether the row was streamed)."""
    n = len(bits)
    itemsize = FORMATS[fmt] // 8
    vec = 16 // itemsize
    while n % vec:
        vec //= 2
    p = topk_plans.row_plan(n, k, m_rows, vec, itemsize, sm_count, two_level=two_level, exact=exact)
    assert p.row_threshold and p.cap >= max(p.row_cap, p.k_pow2) and p.two_level == two_level
    rng = random.Random(seed)
    keys = order_keys(bits, fmt, largest)
    shift = FORMATS[fmt] - topk_plans.HIST_BITS
    index_top = max(n - 1, 1).bit_length() - 1
    per_iter = p.threads * vec * p.unroll
    slices = [(part * p.slice_len, min((part + 1) * p.slice_len, n)) for part in range(p.parts)]
    hist = np.zeros(topk_plans.HIST, dtype=np.int64)
    for start, stop in slices:  # topk_row_histogram_kernel: thread t's loop over its vectors
        cols = np.array([first + u * p.threads * vec + e for t in range(p.threads)
                         for first in range(start + t * vec, stop, per_iter)
                         for u in range(p.unroll) for e in range(vec) if first + u * p.threads * vec + e < stop])
        assert sorted(cols.tolist()) == list(range(start, stop))
        np.add.at(hist, keys[cols] >> shift, 1)
    bucket, above, in_bucket = locate_bucket(hist.tolist(), k, p.threads)
    count = above + in_bucket
    assert above < k <= count == int((keys >> shift >= bucket).sum())
    stats = []
    if p.exact_stride:
        ordered = exact_finish(keys, slices, hist.tolist(), bucket, above, k, fmt, largest, bits, p, rng, paths)
        if ordered is not None:
            return [~r & M32 for r in ordered], False
    if count > p.row_cap:  # the last block streams the row
        kept = stream_block(bits, 0, n, k, vec, p.unroll, p.threads, p.cap, p.k_pow2, fmt, largest, rng, stats)
        if paths is not None:
            paths.append("stream")
    else:
        lowest = bucket << shift
        flag_value = as_floats(np.array([key_bits(flag_key(lowest, True, fmt), fmt, largest)]), fmt)[0]
        values = as_floats(bits, fmt)
        candidates = []
        shift1, bits2, shift2 = topk_row.level_shifts(FORMATS[fmt])
        assert shift1 == shift
        hist2 = np.zeros(topk_plans.HIST, dtype=np.int64)  # the second level, summed over the blocks
        for start, stop in rng.sample(slices, len(slices)):  # stage_candidates: iterations of the slice
            iterations = -(-(stop - start) // per_iter)
            cols = np.array([start + ((it * p.unroll + u) * p.threads + t) * vec + e for it in range(iterations)
                             for u in range(p.unroll) for t in range(p.threads) for e in range(vec)])
            cols = cols[cols < stop]
            assert sorted(cols.tolist()) == list(range(start, stop))
            hit = flagged(values[cols], flag_value, largest)
            exact = keys[cols] >= lowest
            assert not (exact & ~hit).any(), "a flag missed a candidate"
            staged = [rank_of(int(keys[c]), int(c)) for c in cols[exact]]
            rng.shuffle(staged)
            candidates += staged
            if two_level:  # the staged ones in the bucket count their next bits (a block's shared counts, red.add)
                block = np.zeros(1 << bits2, dtype=np.int64)
                staged_keys = keys[cols[exact]]
                np.add.at(block, (staged_keys[staged_keys >> shift1 == bucket] >> shift2) & ((1 << bits2) - 1), 1)
                hist2[:1 << bits2] += block
        assert len(candidates) == count <= p.row_cap
        if two_level:
            assert hist2.sum() == in_bucket
            kept = two_level_select(candidates, hist2, bucket, above, k, fmt, index_top, p.threads, rng, stats,
                                    paths)
        else:
            parts = len(slices) if p.one_launch else 1  # (one launch: every block writes its share)
            ordered = counting_finish(candidates, lowest, k, fmt, largest, bits, p.threads, p.cap, rng, paths, parts)
            if ordered is not None:
                return [~r & M32 for r in ordered], False
            _, kept = select_top(candidates, k, index_top, p.threads, stats)
    out = sort_descending(kept + [ABSENT] * (p.k_pow2 - len(kept)), len(kept), p.k_pow2, p.threads)
    return [~r & M32 for r in out[:k]], count > p.row_cap


def bucket_starts(hist, k, threads):
    """``topk_row.bucket_starts``: thread t owns buckets [t*PER, (t+1)*PER), warp suffix sums, the higher warps'
    totals. Returns (starts, where the k-th's bucket ends, whether a kept bucket holds more than CROWDED)."""
    per = topk_plans.HIST // threads
    totals = [sum(hist[t * per:(t + 1) * per]) for t in range(threads)]
    suffix = [sum(totals[t - t % 32 + lane] for lane in range(t % 32, 32)) for t in range(threads)]
    warp_sums = [suffix[w * 32] for w in range(threads // 32)]
    starts = [0] * topk_plans.HIST
    placed = None
    crowded = False
    for t in range(threads):
        above = suffix[t] - totals[t] + sum(warp_sums[w] for w in range(t // 32 + 1, threads // 32))
        for i in range(per - 1, -1, -1):
            b = t * per + i
            starts[b] = above
            above += hist[b]
            crowded |= starts[b] < k and hist[b] > topk_row.CROWDED
            if starts[b] < k <= above:
                assert placed is None
                placed = above
    assert starts == [sum(hist[b + 1:]) for b in range(topk_plans.HIST)]
    return starts, placed, crowded


def counting_finish(candidates, lowest, k, fmt, largest, bits, threads, cap, rng, paths, parts=1):
    """``topk_row.finish_list`` run by ``parts`` blocks: the key range (the largest key of the list), the fine
    buckets, their starts, the kept buckets copied grouped in any order (shared atomics: each block its own
    order), each of the block's share of buckets' candidates placed by counting, the values rebuilt from the keys
    (NaN gathered). Every output written once. Returns the k ranks in order, or None for the fallback
    (``select_top`` and the sort)."""
    count = len(candidates)
    key_high = max(rank_u(r) >> 32 for r in candidates)
    span = min(key_high - lowest, (topk_row.FINE_SPAN << (FORMATS[fmt] - topk_plans.HIST_BITS)) - 1)
    fine_shift = max((span | 1).bit_length() - 1 - (topk_plans.HIST_BITS - 1), 0)
    bucket = lambda r: min(((rank_u(r) >> 32) - lowest) >> fine_shift, topk_plans.HIST - 1)  # noqa: E731
    assert fine_shift == 0 or FORMATS[fmt] == 32  # 16-bit keys: a bucket a key (the top one: all beyond)
    hist = [0] * topk_plans.HIST
    for r in candidates:
        hist[bucket(r)] += 1
    starts, placed, crowded = bucket_starts(hist, k, threads)
    if crowded or count + placed > cap:
        if paths is not None:
            paths.append("select")
        return None
    if paths is not None:
        paths.append("count")
    out = [None] * k
    for part in range(parts):
        cursors = starts[:]
        placed_ranks = [None] * placed
        for r in rng.sample(candidates, count):  # the atomics of the warps in any order
            b = bucket(r)
            if starts[b] < k:
                placed_ranks[cursors[b]] = r
                cursors[b] += 1
        assert None not in placed_ranks and cursors[bucket(placed_ranks[-1])] == placed
        for r in placed_ranks:  # write_ranked: the buckets that start in the block's share of [0, k)
            b = bucket(r)
            if 0 <= starts[b] * parts - part * k < k:
                position = starts[b] + sum(o > r for o in placed_ranks[starts[b]:cursors[b]])
                if position < k:
                    assert out[position] is None
                    out[position] = r
    assert out == sorted(candidates, reverse=True)[:k]
    width = FORMATS[fmt]
    for r in out:  # write_result: the value from the key, bit for bit unless NaN
        value_bits = key_bits(rank_u(r) >> 32, fmt, largest)
        nan = (value_bits & ((1 << (width - 1)) - 1)) > {"f32": 0x7F800000, "bf16": 0x7F80, "f16": 0x7C00}[fmt]
        assert nan == bool(np.isnan(as_floats(np.array([bits[~r & M32]]), fmt)[0]))
        assert nan or value_bits == bits[~r & M32]
    return out


def exact_finish(keys, slices, hist, bucket, above, k, fmt, largest, bits, p, rng, paths):
    """``topk_row.exact_finish``: where every key above the k-th's bucket lies within EXACT_SPAN buckets of it
    (``exact_bins``), each slice's candidates (its keys in the bucket or above, staged in any order) counted by
    exact key into the block's column of the table (entries of other columns and keys: garbage) and the row's
    totals; then in each block the totals' suffix sums (warp shuffles, the warps' sums), the earlier parts' counts
    of the block's keys (lanes past the stride re-read its last four parts, masked off), and each candidate
    placed at its key's start plus those of its key staged in its block above it. Every output written once.
    Returns the k ranks in order, or None (the list path)."""
    assert FORMATS[fmt] == 16 and p.one_launch and p.threads >= topk_plans.EXACT_BINS
    shift = 16 - topk_plans.HIST_BITS
    span = topk_plans.EXACT_BINS >> shift
    inside = [hist[bucket + j] if bucket + j < topk_plans.HIST else 0 for j in range(1, span)]
    top = bucket + max([0] + [j + 1 for j, c in enumerate(inside) if c > 0])
    if sum(inside) != above:
        if paths is not None:
            paths.append("list")
        return None
    bins = (top - bucket + 1) << shift
    lowest = bucket << shift
    stride = p.exact_stride
    assert stride >= len(slices) and stride & (stride - 1) == 0 and stride % 4 == 0
    table = np.array([[rng.randrange(-1000, 1000) for _ in range(stride)] for _ in range(topk_plans.EXACT_BINS)])
    staged_parts = []
    for part, (start, stop) in enumerate(slices):
        cols = [c for c in range(start, stop) if keys[c] >= lowest]
        staged = [rank_of(int(keys[c]), c) for c in cols]
        rng.shuffle(staged)
        assert len(staged) <= p.cap
        counts = [0] * topk_plans.EXACT_BINS
        for r in staged:
            b = (rank_u(r) >> 32) - lowest
            assert 0 <= b < bins
            counts[b] += 1
        table[:bins, part] = counts[:bins]
        staged_parts.append(staged)
    out = [None] * k
    parts = len(slices)
    totals = [int(table[b, :parts].sum()) if b < bins else 0 for b in range(p.threads)]
    for part, staged in enumerate(staged_parts):
        total = totals
        listed = {(rank_u(r) >> 32) - lowest for r in staged}
        earlier = [0] * topk_plans.EXACT_BINS
        for b in listed:  # lane l reads parts 4 * min(l, stride / 4 - 1) + e; those below the block's count
            parts_read = [4 * min(lane, stride // 4 - 1) + e for lane in range(32) for e in range(4)]
            earlier[b] = sum(int(table[b, q]) for q in parts_read if q < part)
        suffix = [sum(total[t - t % 32 + lane] for lane in range(t % 32, 32)) for t in range(p.threads)]
        warp_sums = [suffix[w * 32] for w in range(p.threads // 32)]
        first = [suffix[b] - total[b] + sum(warp_sums[w] for w in range(b // 32 + 1, topk_plans.EXACT_BINS // 32))
                 + earlier[b] for b in range(topk_plans.EXACT_BINS)]
        for b in range(topk_plans.EXACT_BINS):
            assert first[b] == sum(total[b + 1:]) + earlier[b]
        for r in staged:
            b = (rank_u(r) >> 32) - lowest
            if first[b] < k:
                position = first[b] + sum(o > r and o <= r | M32 for o in staged)
                if position < k:
                    assert out[position] is None
                    out[position] = r
    assert None not in out
    if paths is not None:
        paths.append("exact")
    width = FORMATS[fmt]
    for r in out:  # write_result: the value from the key, bit for bit unless NaN
        value_bits = key_bits(rank_u(r) >> 32, fmt, largest)
        nan = (value_bits & ((1 << (width - 1)) - 1)) > {"bf16": 0x7F80, "f16": 0x7C00}[fmt]
        assert nan or value_bits == bits[~r & M32]
    return out


def classify(candidates, prefix, shift2, sure, threads, rng):
    """The last block's sweep over the list as ``topk_row.list_loads`` and ``append_two`` do it: steps of
    2 * SWEEP * threads entries, thread t's j-th 16-byte load the pair ``first / 2 + j * threads + t`` (clamped to
    the last pair), the warps of a step in any order, each with one atomic on the packed counter (above the prefix
    in the low 16 bits, at it in the high) and every lane's slots from the ballots below it. Returns ``buf``."""
    count = len(candidates)
    step = 2 * topk_plans.SWEEP * threads
    last_pair = (count - 1) >> 1
    buf = {}
    counter = 0
    for first in range(0, count, step):
        warps = list(range(threads // 32))
        rng.shuffle(warps)
        for w in warps:
            flags = []  # per lane: ([higher] * 2 SWEEP, [at] * 2 SWEEP, the loaded ranks)
            for t in range(32 * w, 32 * w + 32):
                loaded, higher, at = [], [], []
                for j in range(topk_plans.SWEEP):
                    pair = min(first // 2 + j * threads + t, last_pair)
                    for h in range(2):
                        real = first + 2 * (j * threads + t) + h < count
                        assert not real or 2 * pair + h == first + 2 * (j * threads + t) + h
                        r = candidates[min(2 * pair + h, count - 1)]  # (past count: anything, not taken)
                        digits = rank_u(r) >> 32 >> shift2
                        loaded.append(r)
                        higher.append(real and digits > prefix)
                        at.append(real and digits == prefix)
                flags.append((higher, at, loaded))
            votes = [[flags[lane][c][i] for lane in range(32)] for c in range(2) for i in range(2 * topk_plans.SWEEP)]
            totals = [sum(v) for v in votes]
            packed = sum(totals[:2 * topk_plans.SWEEP]) | sum(totals[2 * topk_plans.SWEEP:]) << 16
            base, counter = counter, counter + packed
            for c in range(2):
                at_slot = base & 0xFFFF if c == 0 else base >> 16
                for i in range(2 * topk_plans.SWEEP):
                    v = votes[c * 2 * topk_plans.SWEEP + i]
                    for lane in range(32):
                        if v[lane]:
                            slot = at_slot + sum(v[:lane]) + (0 if c == 0 else sure)
                            assert slot not in buf
                            buf[slot] = flags[lane][2][i]
                    at_slot += sum(v)
    assert sorted(buf) == list(range(len(buf)))
    return [buf[i] for i in range(len(buf))]


def two_level_select(candidates, hist2, bucket, above, k, fmt, index_top, threads, rng, stats, paths):
    """The last block of ``topk_row_two_level_kernel``: ``locate_bucket`` in the second-level histogram, the one
    sweep over the candidate list that puts the ranks above the second-level prefix at ``buf[:sure]`` and those at
    it after them (appends in any warp order), then the ``need`` best inside ones: all, by counting (each of
    ``inside <= threads`` threads counts the inside ranks above its own and moves it to ``sure + that``), or by
    a select of the k best of ``buf[:sure + inside]``. Returns the k kept ranks."""
    _, bits2, shift2 = topk_row.level_shifts(FORMATS[fmt])
    bucket2, above2, inside = locate_bucket(hist2.tolist(), k - above, threads)
    sure = above + above2
    prefix = (bucket << bits2) | bucket2
    assert sure < k <= sure + inside
    buf = classify(candidates, prefix, shift2, sure, threads, rng)
    assert sorted(buf[:sure]) == sorted(r for r in candidates if rank_u(r) >> 32 >> shift2 > prefix)
    assert sorted(buf[sure:]) == sorted(r for r in candidates if rank_u(r) >> 32 >> shift2 == prefix)
    assert len(buf) == sure + inside
    need = k - sure
    if inside == need:
        path = "all"
    elif inside <= threads:
        path = "count"
        mine = [buf[sure + t] if t < inside else ABSENT for t in range(threads)]
        counted = [sum(buf[sure + j] > mine[t] for j in range(inside)) for t in range(threads)]  # ranks_above
        for t in range(threads):  # the moves, after the barrier
            if t < inside and counted[t] < need:
                buf[sure + counted[t]] = mine[t]
    else:
        path = "select"
        _, kept = select_top(buf, k, index_top, threads, stats)
        buf = kept
    if paths is not None:
        paths.append(path)
    kept = buf[:k]
    assert sorted(kept) == sorted(candidates)[-k:]
    return kept


ROW_CASES = [(8192, 1, 1), (8192, 50, 1), (40_000, 1024, 1), (40_000, 2048, 3), (151_936, 50, 1),
             (151_936, 1024, 1), (151_936, 1024, 64), (128_256, 2048, 1), (262_144, 1024, 1), (262_144, 50, 64)]


@pytest.mark.sweep
@pytest.mark.parametrize("n,k,m", ROW_CASES)
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_row_threshold_model_matches_torch_topk_on_random_rows(n, k, m, fmt):
    """Random rows: no stream fallback, torch.topk's values (on CPU: its indices list ties in any order) and the
    indices of torch's stable sort."""
    paths = []
    for largest in (True, False):
        bits = rows("randn", n, fmt, seed=n + k)
        got, streamed = row_threshold_topk(bits, k, fmt, largest, m, paths=paths)
        assert not streamed and got == reference(bits, k, fmt, largest)
        x = torch.from_numpy(as_floats(bits, fmt))
        assert torch.equal(x[got], torch.topk(x, k, largest=largest).values)
        assert got == torch.sort(x, descending=largest, stable=True).indices[:k].tolist()
    assert paths == ["count", "count"]  # random rows: the counting finish, no select


@pytest.mark.sweep
@pytest.mark.parametrize("kind", ["ties", "zeros", "special", "rising", "falling"])
@pytest.mark.parametrize("n,k,m", [(20_000, 50, 1), (20_000, 1024, 1), (9000, 2048, 3), (40_000, 1, 1)])
@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
def test_row_threshold_model_on_ties_nan_and_sorted_rows(kind, n, k, m, fmt):
    """Ties, NaN/inf, mixed zeros and sorted rows (some overflow the list: the last block streams the row): the
    documented order."""
    for largest in (True, False):
        bits = rows(kind, n, fmt, seed=7)
        got, _ = row_threshold_topk(bits, k, fmt, largest, m)
        assert got == reference(bits, k, fmt, largest)


@pytest.mark.parametrize("k", [1, 50, 1024, 2048])
def test_row_threshold_model_streams_all_equal_rows(k):
    """An all-equal row (every key in one bucket) overflows any list: the last block streams it, lowest
    indices first."""
    bits = rows("ties", 30_000, "bf16", seed=1) * 0 + 0x3F80  # 1.0
    for largest in (True, False):
        got, streamed = row_threshold_topk(bits, k, "bf16", largest, 1)
        assert streamed and got == list(range(k))


def test_row_threshold_model_finish_takes_every_path():
    """The last block's counting finish (random rows, a few NaN/inf/zeros: values rebuilt from the keys), its
    fallback to ``select_top`` when a kept fine bucket holds more than CROWDED (hundreds of NaN and inf in the top
    bucket, thousands of ties at the k-th value) and the stream (the threshold bucket overflows the list)."""
    paths = []
    rng = np.random.default_rng(3)
    for kind, fmt in [("randn", "f32"), ("sprinkled", "bf16"), ("sprinkled", "f16"), ("special", "bf16")]:
        bits = rows("special" if kind == "special" else "randn", 20_000, fmt, seed=3)
        if kind == "sprinkled":  # a few NaN (payloads differ: gathered by index), +-inf and zeros of both signs
            nans = [0x7FC0, 0xFFC1, 0x7F81] if fmt == "bf16" else [0x7E00, 0xFE01, 0x7C01]
            specials = nans + ([0x7F80, 0xFF80] if fmt == "bf16" else [0x7C00, 0xFC00]) + [0x0000, 0x8000]
            bits[rng.choice(len(bits), 70, replace=False)] = np.repeat(specials, 10)
        assert row_threshold_topk(bits, 1024, fmt, True, 1, paths=paths)[0] == reference(bits, 1024, fmt, True)
    assert paths == ["count"] * 3 + ["select"], paths  # special: 1% NaN, 1% inf crowd the top fine bucket
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40_000, generator=g)
    x[torch.randperm(40_000, generator=g)[:3000]] = 2.5  # 3000 ties near the k-th value
    bits = (x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF).astype(np.uint32)
    for k in (50, 1024):
        assert row_threshold_topk(bits, k, "bf16", True, 1, paths=paths)[0] == reference(bits, k, "bf16", True)
    assert paths[4:] == ["stream", "select"], paths  # k = 50: a list of 2048 only


EXACT_CASES = [(8192, 1, 1), (40_000, 1024, 1), (151_936, 50, 1), (65_536, 64, 2), (30_001, 33, 1)]


@pytest.mark.sweep
@pytest.mark.parametrize("n,k,m", EXACT_CASES)
@pytest.mark.parametrize("kind", ["randn", "ties", "zeros", "special", "rising", "falling", "outlier"])
@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_exact_finish_model(n, k, m, kind, fmt):
    """The one-launch plans of 16-bit keys (``TopkPlan.exact_stride``): every block places its own candidates
    (``exact_finish``) on random rows, ties and mixed zeros, and on rows whose keys above the k-th's bucket reach
    beyond EXACT_SPAN buckets (NaN/inf, one outlier; sorted rows, whose smallest keys span many octaves) through
    the list instead: the documented order."""
    bits = rows("randn" if kind == "outlier" else kind, n, fmt, seed=n + k)
    if kind == "outlier":
        bits[n // 3] = 0x4780 if fmt == "bf16" else 0x7800  # 65536 (f16: 32768): far above the rest
    for largest in (True, False):
        paths = []
        got, _ = row_threshold_topk(bits, k, fmt, largest, m, paths=paths, exact=None)
        assert got == reference(bits, k, fmt, largest)
        if kind in ("ties", "zeros") or (kind == "randn" and fmt == "bf16"):  # (f16's buckets: 1/32 octave)
            assert paths == ["exact"], paths
        elif kind == "outlier" and largest and k > 1:  # (k = 1: the outlier is the k-th)
            assert paths[0] == "list", paths


def test_row_threshold_plans():
    """The row plan replaces the plans that cut rows into slices, and those of one slice a row with a large k on
    long rows that two slices a row fit in two waves; its slices (two at least) go down to one sweep, cover the
    row, and two blocks fit an SM. By default it runs where k or the slices are large, or where ``row_threads``
    gives it 512-thread blocks."""
    sms = 132
    for n, k, m, (vec, itemsize) in [(151936, 50, 1, (8, 2)), (151936, 1024, 1, (8, 2)), (128256, 2048, 1, (8, 2)),
                                     (151936, 1024, 64, (8, 2)), (151936, 1024, 256, (8, 2)), (151936, 50, 64, (8, 2)),
                                     (151936, 1024, 1, (4, 4)), (262144, 2048, 64, (4, 4)), (4097, 2048, 64, (1, 2)),
                                     (40_000, 33, 3, (8, 2)), (151936, 1024, 300, (8, 2)), (4096, 1024, 256, (8, 2))]:
        default = topk.plan(n, k, m, vec, itemsize, sms, row_threshold=False)
        p = topk.plan(n, k, m, vec, itemsize, sms, row_threshold=True)
        split = k >= topk_plans.ROW_THRESHOLD_MIN_K and n >= topk_plans.ROW_SPLIT_MIN_N and \
            m <= topk_plans.BLOCKS_PER_SM * sms
        assert p.row_threshold == (default.parts > 1 or split)
        auto = topk.plan(n, k, m, vec, itemsize, sms)
        wide = topk_plans.row_threads(n, k, m, vec, itemsize, sms) == topk_plans.WIDE_THREADS
        wanted = k >= topk_plans.ROW_THRESHOLD_MIN_K or default.parts >= topk_plans.ROW_THRESHOLD_MIN_PARTS or wide
        assert auto == (p if wanted else default)
        if not p.row_threshold:
            assert p == default
            continue
        assert p.threads == (topk_plans.WIDE_THREADS if wide else topk_plans.SLICE_THREADS)
        assert p.parts >= 2 and (p.parts - 1) * p.slice_len < n <= p.parts * p.slice_len
        assert p.slice_len % (p.threads * vec) == 0 and p.merge_cap == 0
        assert topk_plans.BLOCKS_PER_SM * (p.smem_bytes + 1024) <= topk_plans.SM_SMEM_BYTES
        # a whole-row stream fits
        assert p.cap >= topk_plans.candidate_capacity(p.threads * vec * p.unroll, p.k_pow2, p.threads)
        if wide and m > 1:
            assert m * p.parts <= sms and p.one_launch  # one block an SM, one wave
    assert topk.plan(151936, 50, 1, 8, 2, sms).parts == 75  # one sweep of 256 threads a block
    assert topk.plan(151936, 1024, 1, 8, 2, sms).parts == 75  # 16-bit keys: the exact finish, blocks of 256
    assert topk.plan(151936, 1024, 1, 4, 4, sms).threads == 512  # f32: no exact finish, wider blocks


# ---------------------------------------------------------------------------------------------- two levels
TWO_LEVEL_CASES = [(8192, 1, 1), (8192, 50, 3), (16_384, 2048, 1), (40_000, 1024, 1), (40_000, 2048, 3),
                   (151_936, 50, 1), (151_936, 1024, 1), (151_936, 1024, 64), (128_256, 2048, 1), (151_936, 2048, 64),
                   (262_144, 1024, 1), (262_144, 50, 64), (262_144, 2048, 3)]


@pytest.mark.sweep
@pytest.mark.parametrize("n,k,m", TWO_LEVEL_CASES)
@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
def test_two_level_model_matches_torch_topk_on_random_rows(n, k, m, fmt):
    """``plan(..., two_level=True)`` on random rows: no stream fallback, torch.topk's values and the indices of
    torch's stable sort (torch.topk on CUDA lists them so for k > 32)."""
    paths = []
    for largest in (True, False):
        bits = rows("randn", n, fmt, seed=n + k + m)
        got, streamed = row_threshold_topk(bits, k, fmt, largest, m, two_level=True, paths=paths)
        assert not streamed and got == reference(bits, k, fmt, largest)
        x = torch.from_numpy(as_floats(bits, fmt))
        assert torch.equal(x[got], torch.topk(x, k, largest=largest).values)
        assert got == torch.sort(x, descending=largest, stable=True).indices[:k].tolist()
    assert "select" not in paths, paths  # random rows: the second-level bucket holds few keys


@pytest.mark.sweep
@pytest.mark.parametrize("kind", ["ties", "zeros", "special", "rising", "falling"])
@pytest.mark.parametrize("n,k,m", [(8192, 1, 1), (20_000, 50, 1), (20_000, 1024, 1), (9000, 2048, 3),
                                   (40_000, 1, 64), (151_936, 1024, 64)])
@pytest.mark.parametrize("fmt", ["bf16", "f16", "f32"])
def test_two_level_model_on_ties_nan_and_sorted_rows(kind, n, k, m, fmt):
    """Ties (many equal values at the threshold: the select over sure + inside), NaN/+-inf, mixed -0.0/+0.0 (the
    second level separates them: -0.0 ranks below +0.0), sorted rows, and rows whose bucket overflows the list
    (the whole-row stream): the documented order, torch.topk's values."""
    for largest in (True, False):
        bits = rows(kind, n, fmt, seed=11)
        got, _ = row_threshold_topk(bits, k, fmt, largest, m, two_level=True)
        assert got == reference(bits, k, fmt, largest)
        x = torch.from_numpy(as_floats(bits, fmt))
        assert torch.equal(x[got].view(-1).nan_to_num(7.0), torch.topk(x, k, largest=largest).values.nan_to_num(7.0))


@pytest.mark.parametrize("k", [1, 50, 1024, 2048])
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_two_level_model_streams_all_equal_rows(k, fmt):
    """An all-equal row overflows any list: the last block streams it, lowest indices first."""
    one = 0x3F80 if fmt == "bf16" else 0x3F800000
    bits = np.full(30_000, one, dtype=np.uint32)
    for largest in (True, False):
        paths = []
        got, streamed = row_threshold_topk(bits, k, fmt, largest, 1, two_level=True, paths=paths)
        assert streamed and paths == ["stream"] and got == list(range(k))


def test_two_level_model_takes_every_path():
    """Each way the last block chooses the inside ones is exercised: all of them (f32: the second level leaves
    10 key bits, most buckets hold one key), by counting (bf16: the k-th value's ties), by a select (a few
    hundred ties at the threshold), and the stream (the bucket overflows the list)."""
    paths = []
    for fmt, n, k in [("f32", 151_936, 1024), ("f32", 40_000, 50), ("bf16", 151_936, 1024), ("bf16", 40_000, 50)]:
        row_threshold_topk(rows("randn", n, fmt, seed=5), k, fmt, True, 1, two_level=True, paths=paths)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40_000, generator=g)
    x[torch.randperm(40_000, generator=g)[:3000]] = 2.5  # 3000 ties around the k-th value
    bits = (x.to(torch.bfloat16).view(torch.int16).numpy().astype(np.int64) & 0xFFFF).astype(np.uint32)
    got, _ = row_threshold_topk(bits, 1024, "bf16", True, 1, two_level=True, paths=paths)
    assert got == reference(bits, 1024, "bf16", True)
    row_threshold_topk(bits, 50, "bf16", True, 1, two_level=True, paths=paths)
    assert {"all", "count", "select", "stream"} <= set(paths), paths


def test_two_level_plans():
    """``two_level`` only marks row-threshold plans (same launch shape, in two launches, the select's slices in
    the histogram's order: only the one-level select reads them reversed); elsewhere it is ignored."""
    sms = 132
    for n, k, m, (vec, itemsize) in [(151936, 50, 1, (8, 2)), (151936, 1024, 1, (8, 2)), (151936, 1024, 64, (8, 2)),
                                     (262144, 2048, 64, (4, 4)), (151936, 50, 64, (8, 2)), (151936, 1024, 256, (8, 2))]:
        one = topk.plan(n, k, m, vec, itemsize, sms, row_threshold=True, one_launch=False)
        two = topk.plan(n, k, m, vec, itemsize, sms, row_threshold=True, two_level=True)
        if one.row_threshold:
            assert two.two_level and two == dataclasses.replace(one, two_level=True, reversed_select=False)
        else:
            assert two == one and not two.two_level
        assert not topk.plan(n, k, m, vec, itemsize, sms).two_level  # not the default
    assert topk_row.level_shifts(16) == (5, 5, 0) and topk_row.level_shifts(32) == (21, 11, 10)


# ---------------------------------------------------------------------------------------------- packed keys
def pair_keys_model(words, nan_above, largest):
    """``topk_row.pair_keys`` on int64 tensors of u32 words, operation for operation."""
    negative = (words >> 15) & 0x00010001
    keys = words ^ ((negative * 0x7FFF) | 0x80008000)
    offset = 0x8000 - (nan_above + 1)
    nan = (((words & 0x7FFF7FFF) + (offset | (offset << 16))) & 0x80008000) >> 15
    keys = keys | (nan * 0xFFFF)
    return keys if largest else keys ^ 0xFFFFFFFF


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("largest", [True, False])
def test_pair_keys_match_the_order_key_of_each_half(dtype, largest):
    """Every 16-bit pattern, in the low half beside every pattern's neighbour and in the high half beside random
    ones: both halves of the packed keys equal ``bits_key`` of their value (sign flip, any NaN to the top key, or
    the bottom when smallest) and the histogram buckets taken from them are the halves' top HIST_BITS bits."""
    nan_above = topk_keys.NAN_ABOVE[dtype]
    bits = torch.arange(1 << 16, dtype=torch.int64)
    partner = bits[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))]

    def reference(b):
        key = b ^ torch.where(b >> 15 == 1, 0xFFFF, 0x8000)
        key = torch.where((b & 0x7FFF) > nan_above, 0xFFFF, key)
        return key if largest else key ^ 0xFFFF

    for low, high in ((bits, partner), (partner, bits)):
        keys = pair_keys_model(low | (high << 16), nan_above, largest)
        assert torch.equal(keys & 0xFFFF, reference(low)) and torch.equal(keys >> 16, reference(high))
        shift = 16 - topk_plans.HIST_BITS
        assert torch.equal((keys >> shift) & (topk_plans.HIST - 1), reference(low) >> shift)
        assert torch.equal(keys >> (32 - topk_plans.HIST_BITS), reference(high) >> shift)
