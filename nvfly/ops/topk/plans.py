"""How a TopK runs: its plan (which kernels, blocks, slices and shared memory) from the problem's shape, in plain
Python (no kernel is imported here; the kernels' shared-memory layouts are sized here and laid out in ``select``
and ``row``).

- The warp kernel (``warp``) for k <= WARP_MAX_K over rows of WARP_MAX_N elements or fewer.
- Else the streaming kernel (``stream``): blocks of SLICE_THREADS, two to an SM (STREAM_THREADS when k = 2048).
  Fewer rows than 2 blocks per SM: each row is cut into slices of whole ``threads * vec`` sweeps (``slice_plan``:
  down to one sweep, at least 4k elements, at most MERGE_RANKS / k slices), each slice writes its k best ranks and
  a second launch merges them.
- Rows cut into slices take the row-threshold kernels (``row``) instead where that measured faster
  (``row_threshold``; by default ROW_THRESHOLD_MIN_K / ROW_THRESHOLD_MIN_PARTS; blocks of WIDE_THREADS, one an SM,
  where ``row_threads`` says; rows of one slice with k >= ROW_THRESHOLD_MIN_K in two slices), in one cooperative
  launch where a row's blocks all fit at once (``row_plan``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

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
ROW_CAP_MAX = 8192        # the most candidates a row-threshold plan collects for a row (``row``)
MAX_PARTS = 128
# rows cut into slices take the row-threshold plan when k or the slices are this many (where it measured faster:
# docs/ops/topk.md)
ROW_THRESHOLD_MIN_K = 256
ROW_THRESHOLD_MIN_PARTS = 8
# rows of one slice take the row-threshold plan's two slices when k >= ROW_THRESHOLD_MIN_K, the rows are this long
# and few enough for two waves (docs/ops/topk.md)
ROW_SPLIT_MIN_N = 65536
WIDE_THREADS = 512        # the row-threshold plan's blocks where ``row_threads`` says
# one launch: every block of a row writes a share of its k from this k (below, its extra wait does not pay:
# docs/ops/topk.md)
SHARED_FINISH_MIN_K = 256
COPIES = 8  # shared histograms a row-threshold histogram block counts into (64 KB, ``row``)
# the select launch re-reads the rows the histogram launch just read: once they outgrow the L2 (50 MB), reading them
# in reverse order starts on what is still cached (below it a little slower: docs/ops/topk.md)
REVERSED_SELECT_MIN_BYTES = 44 << 20
EXACT_BINS = 256  # 16-bit keys the one-launch plan's exact finish counts (8 first-level buckets), a thread each
LIST_WORDS = 2 * ROW_CAP_MAX  # i32 words of a row's candidate list (ROW_CAP_MAX i64)
MAX_UNROLL = 8            # loads per thread per iteration (narrow accesses would need too many registers)


# ---------------------------------------------------------------------------------------------- plans
@dataclass(frozen=True, kw_only=True)
class TopkPlan:
    """Launch shape of a TopK of ``dtype`` (nvfly's name of the element type: "bf16", "f16", "f32"; None where it
    was planned from the element size alone): the warp kernel (``warps`` rows per block) or the streaming kernel
    (``threads`` per block, ``parts`` slices per row merged by ``topk_merge_kernel`` when rows are few: it holds
    all ``parts * k`` ranks of a row in ``merge_cap`` entries, loaded ``merge_vec`` at a time). ``row_threshold``:
    the slices run ``row``'s histogram and select kernels instead, collecting at most ``row_cap``
    candidates a row (``cap``: their shared memory, also enough for a whole-row stream); ``two_level``: its
    select launch also counts the next key bits of the threshold bucket (``topk_row_two_level_kernel``);
    ``one_launch``: both launches as one cooperative launch (``topk_row_one_launch_kernel``), whose blocks all
    write a share of a row's k when ``shared_finish`` (else its last block writes them); ``reversed_select``: the
    select launch takes the slices in the reverse of the histogram launch's order, its first blocks reading what
    that launch read last, still in L2 (``REVERSED_SELECT_MIN_BYTES``); ``hist_parts`` slices of ``hist_slice_len``:
    the histogram launch's own slicing, where the select's slices would take it over one wave (0: the same);
    ``exact_stride`` (a one-launch plan of 16-bit keys): its blocks write their own candidates at their places
    where the keys from the k-th's bucket up are few (``row.exact_finish``), through a table of this many
    parts a row (``parts`` rounded up to a power of two; 0: never)."""
    warp: bool
    vec: int
    dtype: Optional[str] = None
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
        return shared_state_bytes(self.cap, self.k_pow2, self.threads) if not self.warp else 0

    @property
    def merge_smem_bytes(self) -> int:
        return shared_state_bytes(self.merge_cap, self.k_pow2, STREAM_THREADS) if self.merge_cap else 0


def unroll_limit(vec: int, itemsize: int) -> int:
    """The most loads of ``vec`` elements a thread issues per streaming iteration (STREAM_BYTES, MAX_UNROLL)."""
    return min(MAX_UNROLL, STREAM_BYTES // (vec * itemsize))


def candidate_capacity(per_iter: int, k_pow2: int, threads: int = STREAM_THREADS) -> int:
    """Candidate-buffer entries: one iteration's worth of appends on top of room for about 2k survivors."""
    margin = max(2 * k_pow2, threads)
    return per_iter + -(-margin // threads) * threads


def shared_state_bytes(cap: int, k_pow2: int, threads: int) -> int:
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
         exact: Optional[bool] = None, dtype: Optional[str] = None) -> TopkPlan:
    """How to run a TopK of k over m rows of n elements of ``dtype`` (``TopkPlan.dtype``; 16-byte accesses hold
    ``vec`` elements of ``itemsize`` bytes); ``max_parts`` caps the slices of a row (``benchmarks.topk
    --compare-plans`` times fewer than the default);
    ``row_threshold``: rows this plan cuts into slices run ``row``'s kernels instead (``row_plan``); None: where
    k >= ROW_THRESHOLD_MIN_K or the slices are at least ROW_THRESHOLD_MIN_PARTS. ``two_level`` (opt-in:
    docs/ops/topk.md): a row-threshold plan's select launch also builds the second-level histogram of the
    threshold bucket, so that the row's last block selects without radix passes (``topk_row_two_level_kernel``);
    ignored where the plan is not a row-threshold one. ``one_launch``: a (one-level) row-threshold plan runs as one
    cooperative launch; None: where its blocks fit one to an SM (``row_plan``). ``exact``: a one-launch plan's
    exact finish (``TopkPlan.exact_stride``), None: where it can run (``exact_default``)."""
    if k <= WARP_MAX_K and n <= WARP_MAX_N:
        return TopkPlan(warp=True, vec=vec, dtype=dtype, warps=max(1, min(8, m // (2 * sm_count))))
    exact = exact_default(exact, dtype)
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    max_unroll = unroll_limit(vec, itemsize)
    # blocks of SLICE_THREADS, two to an SM, unless their shared memory is too large (k = 2048)
    threads = SLICE_THREADS
    max_cap = candidate_capacity(threads * vec * max_unroll, k_pow2, threads)
    if BLOCKS_PER_SM * (shared_state_bytes(max_cap, k_pow2, threads) + 1024) > SM_SMEM_BYTES:
        threads = STREAM_THREADS
    parts, slice_len, unroll = slice_plan(n, k, m, vec, max_unroll, threads, sm_count, max_parts)
    row_block = row_threads(n, k, m, vec, itemsize, sm_count, max_parts, exact)
    if row_threshold is None:
        row_threshold = k >= ROW_THRESHOLD_MIN_K or parts >= ROW_THRESHOLD_MIN_PARTS or row_block == WIDE_THREADS
    # rows of one slice each, with a large k and few enough for two slices a row in two waves: two slices
    split = parts == 1 and k >= ROW_THRESHOLD_MIN_K and n >= ROW_SPLIT_MIN_N and m <= BLOCKS_PER_SM * sm_count
    if row_threshold and (parts > 1 or split):
        return row_plan(n, k, m, vec, itemsize, sm_count, max_parts, two_level, one_launch, row_block, exact, dtype)
    merge_cap = max(parts * k, k_pow2) if parts > 1 else 0  # (the sort exchanges k_pow2 entries through it)
    return TopkPlan(warp=False, vec=vec, dtype=dtype, unroll=unroll, threads=threads,
                    cap=candidate_capacity(threads * vec * unroll, k_pow2, threads), k_pow2=k_pow2, parts=parts,
                    slice_len=slice_len, merge_cap=merge_cap,
                    merge_vec=(2 if parts * k % 2 == 0 else 1) if parts > 1 else 0)


def row_plan(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int, max_parts: int = MAX_PARTS,
             two_level: bool = False, one_launch: Optional[bool] = None, threads: Optional[int] = None,
             exact: Optional[bool] = None, dtype: Optional[str] = None) -> TopkPlan:
    """The row-threshold plan (``row``): blocks of ``threads`` (None: ``row_threads``), two slices a row at
    least, down to one sweep (no merge bounds them), for two blocks an SM (one of WIDE_THREADS): the unroll is
    lowered until the shared memory (the candidate list, or a whole-row stream's buffer) fits twice.
    ``one_launch`` (None: whenever it can): the histogram and the select in one cooperative launch, which needs
    every block resident at once: one an SM at most (its shared memory is the select's and the histogram's, side
    by side), and the one-level select. ``exact`` (None: whenever it can): a one-launch plan of 16-bit keys whose
    blocks hold a whole slice's candidates and have a thread for each of EXACT_BINS keys writes them in place
    (``TopkPlan.exact_stride``; ``exact_default``)."""
    exact = exact_default(exact, dtype)
    k_pow2 = max(2, 1 << (k - 1).bit_length())
    row_cap = min(ROW_CAP_MAX, max(2048, 8 * k_pow2))
    max_unroll = unroll_limit(vec, itemsize)
    if threads is None:
        threads = row_threads(n, k, m, vec, itemsize, sm_count, max_parts, exact)
    blocks_per_sm = 1 if threads == WIDE_THREADS else BLOCKS_PER_SM
    while True:
        parts, slice_len, unroll = slice_plan(n, k, m, vec, max_unroll, threads, sm_count, max_parts, merged=False,
                                              blocks_per_sm=blocks_per_sm, min_parts=2)
        cap = max(row_cap, candidate_capacity(threads * vec * unroll, k_pow2, threads))
        if max_unroll == 1 or BLOCKS_PER_SM * (shared_state_bytes(cap, k_pow2, threads) + 1024) <= SM_SMEM_BYTES:
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
        # in one wave instead of a wave and a tail (docs/ops/topk.md)
        hist_parts, hist_slice_len = whole_sweep_slices(n, threads * vec, max(1, hist_wave // m))
    can_exact = one_launch and itemsize == 2 and slice_len <= cap and threads >= EXACT_BINS
    if exact and not can_exact:
        raise ValueError(f"exact: needs a one-launch plan (one_launch={one_launch}) of 16-bit keys (itemsize "
                         f"{itemsize}) whose slices fit a block's buffer ({slice_len} <= {cap}) and blocks of "
                         f"{EXACT_BINS} threads or more ({threads})")
    exact_stride = max(4, 1 << (parts - 1).bit_length()) if (can_exact if exact is None else exact) else 0
    return TopkPlan(warp=False, vec=vec, dtype=dtype, unroll=unroll, threads=threads, cap=cap, k_pow2=k_pow2,
                    parts=parts, slice_len=slice_len, row_threshold=True, row_cap=row_cap, two_level=two_level,
                    one_launch=one_launch, shared_finish=one_launch and k >= SHARED_FINISH_MIN_K,
                    reversed_select=(not one_launch and not two_level
                                     and m * n * itemsize >= REVERSED_SELECT_MIN_BYTES),
                    hist_parts=hist_parts, hist_slice_len=hist_slice_len, exact_stride=exact_stride)


def exact_default(exact: Optional[bool], dtype: Optional[str]) -> Optional[bool]:
    """The exact finish asked for (``exact``), else never for f16: its first-level buckets are 1/32 of an octave,
    so the exact finish's 8 rarely hold a row's top keys, and f16 keeps the list path and its wider blocks
    (bf16's buckets are a quarter octave). None: wherever it can run."""
    return False if exact is None and dtype == "f16" else exact


def row_threads(n: int, k: int, m: int, vec: int, itemsize: int, sm_count: int,
                max_parts: int = MAX_PARTS, exact: Optional[bool] = None) -> int:
    """The row-threshold plan's block: WIDE_THREADS (one block an SM) where that measured faster than
    SLICE_THREADS (docs/ops/topk.md), else SLICE_THREADS; from the slices a row of SLICE_THREADS blocks would get in
    that plan. One row with k >= ROW_THRESHOLD_MIN_K (the row's last block selects and orders the k with twice the
    warps), and rows that SLICE_THREADS blocks cut into at most 4 slices while WIDE_THREADS blocks still give each
    row two in one wave. One row of 16-bit keys (unless ``exact`` is False) keeps SLICE_THREADS: its blocks write
    their own candidates in place (``TopkPlan.exact_stride``), and smaller slices are faster there."""
    if m == 1:
        exact_keys = itemsize == 2 and exact is not False
        return WIDE_THREADS if k >= ROW_THRESHOLD_MIN_K and not exact_keys else SLICE_THREADS
    parts = slice_plan(n, k, m, vec, unroll_limit(vec, itemsize), SLICE_THREADS, sm_count, max_parts, merged=False)[0]
    return WIDE_THREADS if 1 < parts <= 4 and sm_count // m >= 2 else SLICE_THREADS


def exact_table_rows(m: int, exact_stride: int) -> int:
    """Candidate-list rows (LIST_WORDS i32 each) the one-launch plan's workspace needs: the m rows' own lists, then
    the exact finish's tables (``row.exact_table_index``), after them because each row chooses its finish while
    the launch runs: a row's table must not overlap another row's list."""
    return m + -(-m * EXACT_BINS * exact_stride // LIST_WORDS)

