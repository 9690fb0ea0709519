"""RMSNorm forward and backward, with an optional weight and a fused residual add, at the memory roofline.

``y = x * rsqrt(mean(x**2) + eps) * weight`` over the last dimensions, in fp32 whatever the storage type
(bf16, fp16 or fp32); ``y`` takes the input's dtype. With ``residual``, ``h = x + residual`` is rounded to the
input's dtype (as the unfused ``x + residual`` would be), written out, and normalised.

Design (forward, the row-in-registers kernel):
- a row of N elements is owned by a group of ``GROUP`` threads (a power of two, up to 512); each thread holds
  ``ceil(N / (GROUP*VEC))`` 16-byte vectors of the row in registers (at most 8), so
  each element is read once and written once (with the residual add: x and residual read, y and x + residual
  written); the weight, shared by all rows, is loaded with the row (EARLY_WEIGHT) where registers allow: loaded
  after the reduction, each of its vectors waits for the store before it.
- ``GROUP`` grows with N so that every thread has about 8 vectors in flight; short rows are packed
  ``128 // GROUP`` to a block (a warp or less per row: a shuffle-only reduction; why 128 threads: see
  ROW_BLOCK_THREADS), long rows get a block each with a shared-memory step across warps.
- the persistent kernel: a few blocks per SM loop over the row tiles, loading the next tile while reducing and
  storing this one, with the weight read once per block; the default for long rows (over 8 KB) when there are a
  few hundred to PERSISTENT_MAX_ROWS of them, each block taking PERSISTENT_MIN_TILES tiles or more
  (``forward_plan`` says when).
- the two-pass kernel (Inductor's structure), for rows that do not fit the registers (N > 512*8*VEC: 32768 bf16,
  16384 fp32) and for any row on request (``ForwardOptions(two_pass=True)``): a block per row streams the row
  through registers in steps of a few vectors a thread, twice: the first pass only sums squares, the second
  reads the row again (from L1/L2) and writes y (and x + residual, recomputed). Nothing is held across the
  reduction, so about 32 registers a thread: a full SM of warps, each with its loads in flight. With Inductor's
  cache hints (LOAD_HINTS: the first read kept in L1 and L2, the stores plain) it is also the default for long rows
  when there are many (TWO_PASS_MIN_ROW_BYTES, TWO_PASS_MIN_ROWS, past the persistent kernel's rows): it ties
  Inductor there, the row kernel did not; and for the counts of long rows too few to give each persistent block
  PERSISTENT_MIN_TILES tiles.
- the bulk-copy kernel (``ForwardOptions(bulk=True)``, opt-in: measured slower): a persistent block streams its rows
  into a shared-memory ring with one cp.async.bulk a row and normalises them from there.
Backward loops persistently over rows (about two blocks per SM), accumulating each block's weight gradient in
registers; dy and x are read once from memory and once more from L1/L2 after the row's reduction. One small
kernel then sums the per-block partials of the weight gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import asm, asm_multi, smem_address
from nvfly.runtime import driver
from nvfly.runtime.torch_args import layout_key, vector_width

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
TARGET_VECTORS_PER_THREAD = 8   # enough bytes in flight per thread to cover memory latency
MAX_VECTORS_PER_THREAD = 8      # more 16-byte vectors of a row per thread spill (x and residual both in flight)
NARROW_MAX_ELEMENTS = 32        # the same limit for rows read in narrower accesses (odd lengths), in elements
MAX_GROUP = 512                 # threads per row: blocks of 512 keep a 128-register budget (1024 would allow 64)
BACKWARD_VECTORS_PER_THREAD = 2  # backward also keeps the weight-gradient sums in registers
BACKWARD_MAX_ELEMENTS = 16      # of a row per thread in the backward kernel (1024 threads): more would spill
SM_SUB_PARTITIONS = 4           # warp schedulers per SM, each with a quarter of the register file
# Threads of a forward block that packs short rows: one warp per sub-partition. Registers are allocated per
# sub-partition, so a register-limited SM holds 4 x (warps that fit in 16K registers) warps (resident_warps):
# blocks of 4 warps fill that count whatever the registers per thread, blocks of 8 leave 4 warps' registers
# idle when the count per sub-partition is odd (bf16 rows of 2048, 88 registers: 20 warps fit, 8-warp blocks
# use 16), and smaller blocks hold no more warps.
ROW_BLOCK_THREADS = 32 * SM_SUB_PARTITIONS
BACKWARD_ROW_BLOCK_THREADS = 256  # the persistent backward launches about two blocks per SM: 16 warps
# The two-pass kernel (rows too long for registers; any row on request): TWO_PASS_VECTORS 16-byte vectors a thread
# per step, blocks of 128 to 1024 threads (two_pass_plan), registers as two_pass_registers estimates them
TWO_PASS_VECTORS = 2
TWO_PASS_MIN_THREADS = 128
TWO_PASS_MAX_THREADS = 1024
TWO_PASS_OTHER_REGISTERS = 16   # besides the loaded vectors and the sum: row addresses, the column, rstd
COLUMN_SUM_COLS = 32            # columns per block of the weight-gradient partial sum
SM_REGISTERS = 65536            # sm_90 limits for resident_warps
SM_MAX_WARPS = 64
FULL_SM_REGISTERS = SM_REGISTERS // (SM_MAX_WARPS * 32)  # 32 registers a thread: 64 warps an SM
SM_MAX_BLOCKS = 32
REGISTER_ALLOCATION_UNIT = 256  # registers are given to a warp in multiples of this
# The persistent forward (forward_plan): it holds two row tiles (the one it normalises, the next one in flight) and
# the weight, so half the row kernel's vectors per thread; its register budget (without, with the residual: x and
# the residual of the next tile in flight) sets its blocks per SM: 5 or 4 blocks of 128 threads.
PERSISTENT_VECTORS_PER_THREAD = 4
PERSISTENT_REGISTERS = (96, 128)
# rows of at most SHORT_ROW_VECTORS 16-byte vectors (8 KB) take SHORT_ROW_TARGET_VECTORS a thread: more warps,
# the same bytes in flight (H200, benchmarks/results/rmsnorm_plans_h200.json: 16384x2048 bf16 36.2 -> 35.1 us,
# fused add 65536x2048 263 -> 256 us; longer rows at 2 vectors a thread lose: 16384x8192 136 -> 155 us)
SHORT_ROW_VECTORS = 512
SHORT_ROW_TARGET_VECTORS = 2
# Long rows (over SHORT_ROW_VECTORS, of 16-byte vectors, no residual) when there are sm_count to
# PERSISTENT_MAX_ROWS of them, measured side by side on the H200 (benchmarks/results/rmsnorm_few_rows_plans_h200.json,
# rmsnorm_persistent_mid_plans_h200.json; us from CUDA graphs, warm L2): fewer than two an SM of rows up to
# 2 x SHORT_ROW_VECTORS take the row kernel at SHORT_ROW_TARGET_VECTORS a thread (a 512-thread block fills an SM's
# warps where 128 threads of 7-8 vectors leave it 8: 256x7168 3.15 -> 2.86, 256x8192 3.35 -> 3.02); the others
# take the persistent kernel (512x7168 4.13 -> 3.87, 768x8192 6.21 -> 5.52, 1024x8192 7.38 -> 6.30, 2048x7168
# 16.16 -> 15.13, 256x16384 4.72 -> 4.65; at 4096 rows every plan ties, and beyond it the persistent one loses).
# Fewer rows than SMs keep 8 vectors a thread (32x7168: 1.88 us, 2.05 with 2).
PERSISTENT_MAX_ROWS = 2048
# ... where its blocks take PERSISTENT_MIN_TILES tiles each or more on average (the point of the kernel: the next
# tile's loads in flight under this one's reduction); with fewer, the two-pass kernel (LOAD_HINTS), a block a row,
# holds more warps an SM (384x7168 on 264 blocks: 3.56 us, two-pass 3.11; 384x8192 3.92, 3.63; 600x7168 4.31,
# 4.69; 512x7168 3.84, 4.00: rmsnorm_rows_rule_check_h200.json). Rows over 2 x SHORT_ROW_VECTORS keep the row
# kernel there instead: its 1024-thread blocks lose (132x16384 3.86, the row kernel 3.60; 200x16384 4.45, 4.13;
# rmsnorm_tiles_rule_check_h200.json).
PERSISTENT_MIN_TILES = 1.75
# The two-pass kernel with Inductor's cache hints (LOAD_HINTS: x's first read kept in L1 and L2, the stores plain)
# is the default for rows of TWO_PASS_MIN_ROW_BYTES or more, TWO_PASS_MIN_ROWS rows or more: measured side by side
# on the H200 (benchmarks/results/rmsnorm_plans_hints_h200.json) bf16 16384x7168 117.5 -> 113.0 us (Inductor 113.1),
# 16384x8192 134.7 -> 129.2 (129.2), 65536x8192 520.6 -> 498.8 (498.8), fused add 16384x8192 262.8 -> 257.3 (266.6);
# the same kernel with the stores hinted evict_first and the first read evict_normal in L2 was no faster than the
# row kernel (135.1 at 16384x8192), nor was the bulk-copy kernel (141.6: rms_norm_bulk_kernel)
TWO_PASS_MIN_ROW_BYTES = 12 * 1024
TWO_PASS_MIN_ROWS = 1024
# The bulk-copy kernel (rms_norm_bulk_kernel): rows padded to BULK_ROW_ALIGN bytes in its ring, which starts
# BULK_BARRIER_BYTES into dynamic shared memory (after the stage barriers); BULK_SMEM_PER_SM bytes of an SM's
# shared memory (228 KB, less 1 KB a block the driver reserves and the static scratch) shared by its blocks
BULK_ROW_ALIGN = 128
BULK_BARRIER_BYTES = 1024
BULK_SMEM_PER_SM = 224 * 1024
BULK_MAX_STAGES = 8
# a thread holds at most 4 vectors of the row and 4 of the weight (8 of each spill at 128 registers); a block is
# the fewest threads (BULK_MIN_THREADS to TWO_PASS_MAX_THREADS) that hold the row so
BULK_VECTORS_PER_THREAD = 4
BULK_MIN_THREADS = 128
BULK_BLOCKS_PER_SM = 2
BULK_SM_THREADS = 512         # threads an SM at most: 128 registers a thread (the row and the weight in registers)
EARLY_WEIGHT = True   # the row kernel loads the weight with the row: one round trip, not one per vector
CACHE_HINTS = False   # L1/L2 eviction hints on the forward's accesses (see STREAM_L1)
LOAD_HINTS = "loads"  # the cache_hints value that hints the loads only (row_hints, two_pass_hints)


# ---------------------------------------------------------------------------------------------- device helpers
@nvfly.func
def group_sum(value, scratch, base, group, warp, lane, GROUP):
    """Sum ``value`` over the GROUP threads of a row (shuffles; for GROUP > 32 also shared memory).

    Every thread of the block must call it (it holds a barrier when GROUP > 32); it uses the f32 slots
    ``scratch[base : base + threads // 32]``.
    """
    if GROUP <= 32:
        total = nvfly.warp_reduce(value, "add", GROUP)
    else:
        value = nvfly.warp_reduce(value, "add")
        if lane == 0:
            scratch[base + warp] = value
        nvfly.syncthreads()
        first = base + group * (GROUP // 32)
        total = scratch[first]
        for w in nvfly.static_range(1, GROUP // 32):
            total = total + scratch[first + w]
    return total


@nvfly.func
def row_layout(M, GROUP, ROWS):
    """(row, valid, lane_in_group, group, warp, lane): the row this thread works on (clamped to M - 1 when
    out of range, so that every thread reaches the barriers; stores are masked with ``valid``)."""
    tid = nvfly.thread_idx.x
    lane_in_group = tid & (GROUP - 1)
    group = tid >> int(math.log2(GROUP))
    row = nvfly.block_idx.x * ROWS + group
    valid = row < M
    return nvfly.minimum(row, M - 1), valid, lane_in_group, group, tid >> 5, tid & 31


# ---------------------------------------------------------------------------------------------- device helpers (rows)
def cache_policy(priority: str) -> Any:
    """An L2 eviction policy (``evict_first``, ``evict_normal`` or ``evict_last``) for every access it is given
    to."""
    return asm(f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", result=nvfly.i64, side_effects=False)


# Cache hints (RowPlan.cache_hints): x, the residual and both outputs are touched once, so they skip L1 and leave
# L2 first; the weight, read for every row, is kept in both (Inductor's kernel loads its weight evict_last).
STREAM_L1 = "L1::no_allocate"
KEEP_L1 = "L1::evict_last"


def row_hints(CACHE_HINTS: Any) -> tuple[Optional[tuple], Optional[tuple], Optional[tuple]]:
    """(hint for the streamed rows' loads, for the weight, for the stores) of ``load_vector``/``store_vector``:
    none (False), all three (True), or the loads' only (LOAD_HINTS: the stores plain, as Inductor's)."""
    if not CACHE_HINTS:
        return None, None, None
    stream = (STREAM_L1, cache_policy("evict_first"))
    return stream, (KEEP_L1, cache_policy("evict_last")), None if CACHE_HINTS == LOAD_HINTS else stream


def load_vector(t: Any, coord: tuple, width: int, mask: Any, hint: Optional[tuple]) -> Any:
    """``t.load(*coord, width=width, mask=mask)``; with ``hint`` = (L1 eviction qualifier, L2 policy) and a
    16- or 8-byte vector, one cache-hinted ld.global instead (zeros where ``mask`` is false: nothing is read)."""
    words = width * t.dtype.itemsize // 4
    if hint is None or words not in (2, 4):
        return t.load(*coord, width=width, mask=mask)
    l1, policy = hint
    outs = ", ".join(f"${i}" for i in range(words))
    load = f"ld.global.{l1}.L2::cache_hint.v{words}.u32 {{{outs}}}, [${words}], ${words + 1};"
    if mask is None:
        loaded = asm_multi(load, [nvfly.i32] * words, [t.address(*coord), policy], side_effects=False)
    else:
        predicated = load.replace(f"[${words}], ${words + 1}", f"[${words + 1}], ${words + 2}")
        zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(words))
        loaded = asm_multi(f"{{ .reg .pred p; setp.ne.b32 p, ${words}, 0; {zeros} @p {predicated} }}",
                           [nvfly.i32] * words, [mask.to(nvfly.i32), t.address(*coord), policy], side_effects=False)
    return nvfly.make_vector(loaded, nvfly.i32).bitcast(t.dtype)


def store_vector(t: Any, value: Any, coord: tuple, width: int, mask: Any, hint: Optional[tuple]) -> None:
    """``t.store(value, *coord, mask=mask)`` of ``width`` elements; with ``hint`` and a 16- or 8-byte vector, one
    cache-hinted st.global."""
    value = value.to(t.dtype)
    words = width * t.dtype.itemsize // 4
    if hint is None or words not in (2, 4):
        t.store(value, *coord, mask=mask)
        return
    l1, policy = hint
    parts = value.bitcast(nvfly.i32).tolist()

    def store(first: int) -> str:  # operand ``first`` is the address, then the words, then the policy
        ins = ", ".join(f"${first + 1 + i}" for i in range(words))
        return f"st.global.{l1}.L2::cache_hint.v{words}.u32 [${first}], {{{ins}}}, ${first + 1 + words};"
    if mask is None:
        asm(store(0), [t.address(*coord), *parts, policy])
    else:
        asm(f"{{ .reg .pred p; setp.ne.b32 p, $0, 0; @p {store(1)} }}",
            [mask.to(nvfly.i32), t.address(*coord), *parts, policy])


def row_vectors(N: int, VEC: int, GROUP: int) -> tuple[int, bool]:
    """(vectors per thread, whether the last one may fall past the row end)."""
    return -(-N // (GROUP * VEC)), N % (GROUP * VEC) != 0


def load_row(t: Any, row: Any, lane: Any, mask: Any, N: int, VEC: int, GROUP: int, hint: Optional[tuple]) -> list:
    """This thread's vectors of ``t``'s row ``row`` (of a 1-D ``t`` when ``row`` is None): columns
    ``(v * GROUP + lane) * VEC``; nothing is read past the row end or where ``mask`` (None: anywhere) is false."""
    vectors, tail = row_vectors(N, VEC, GROUP)
    out = []
    for v in range(vectors):
        col = (v * GROUP + lane) * VEC
        in_row = mask
        if tail and v == vectors - 1:
            in_row = col < N if mask is None else mask & (col < N)
        out.append(load_vector(t, (col,) if row is None else (row, col), VEC, in_row, hint))
    return out


def add_residual(xs: list, rs: list) -> list:
    """h = x + residual, rounded to the storage type like the unfused add."""
    return [(xv.to(nvfly.f32) + rv.to(nvfly.f32)).to(xv.dtype) for xv, rv in zip(xs, rs)]


def square_sum(xs: list, VEC: int) -> Any:
    """This thread's sum of squares of its vectors (of VEC elements), in fp32."""
    squares = nvfly.full(VEC, 0.0, nvfly.f32)
    for xv in xs:
        xf = xv.to(nvfly.f32)
        squares = nvfly.fma(xf, xf, squares)
    return squares.sum()


# ---------------------------------------------------------------------------------------------- forward kernels
def store_row(t: Any, xs: list, row: Any, lane: Any, valid: Any, N: int, VEC: int, GROUP: int,
              hint: Optional[tuple]) -> None:
    """This thread's vectors ``xs`` to ``t``'s row ``row``; nothing past the row end or where ``valid`` is false."""
    vectors, tail = row_vectors(N, VEC, GROUP)
    for v in range(vectors):
        col = (v * GROUP + lane) * VEC
        store_vector(t, xs[v], (row, col), VEC, valid & (col < N) if tail and v == vectors - 1 else valid, hint)


def normalize_row(y: Any, residual_out: Any, xs: list, weights: Optional[list], weight: Any, rstd: Any, row: Any,
                  lane: Any, valid: Any, N: int, VEC: int, GROUP: int,
                  hints: tuple[Optional[tuple], Optional[tuple], Optional[tuple]]) -> None:
    """y = x * rstd (* weight) for this thread's vectors of ``row``, each followed by x + residual to
    ``residual_out`` (None: not here); nothing is written past the row end or where ``valid`` is false. The
    weight's vectors are ``weights`` (loaded earlier), else read from ``weight`` (None: no weight) before each
    store."""
    _, keep_hint, store_hint = hints
    vectors, tail = row_vectors(N, VEC, GROUP)
    for v in range(vectors):
        col = (v * GROUP + lane) * VEC
        keep = valid & (col < N) if tail and v == vectors - 1 else valid
        out = xs[v].to(nvfly.f32) * rstd
        if weights is not None:
            out = out * weights[v].to(nvfly.f32)
        elif weight is not None:
            w = load_vector(weight, (col,), VEC, keep if tail and v == vectors - 1 else None, keep_hint)
            out = out * w.to(nvfly.f32)
        store_vector(y, out, (row, col), VEC, keep, store_hint)
        if residual_out is not None:
            store_vector(residual_out, xs[v], (row, col), VEC, keep, store_hint)


@nvfly.kernel
def rms_norm_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                    residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, M: nvfly.i32, eps: nvfly.f32,
                    N: nvfly.Constexpr, VEC: nvfly.Constexpr, GROUP: nvfly.Constexpr, ROWS: nvfly.Constexpr,
                    HAS_WEIGHT: nvfly.Constexpr, HAS_RESIDUAL: nvfly.Constexpr, HAS_RSTD: nvfly.Constexpr,
                    EARLY_WEIGHT: nvfly.Constexpr, CACHE_HINTS: nvfly.Constexpr):
    """One row per GROUP threads, the row held in registers: one read and one write per element.

    The weight is read with the row (EARLY_WEIGHT: in flight with it, more registers) or after the reduction,
    one vector before each store: those loads then wait for the stores before them (the weight could alias y),
    one L1/L2 round trip each."""
    nvfly.min_blocks_per_sm(max(1, 512 // (GROUP * ROWS)))  # a 128-register budget (ptxas may spill small blocks)
    row, valid, lane, group, warp, warp_lane = row_layout(M, GROUP, ROWS)
    hints = row_hints(CACHE_HINTS)
    stream, keep, _ = hints
    xs = load_row(x, row, lane, None, N, VEC, GROUP, stream)
    if HAS_RESIDUAL:
        xs = add_residual(xs, load_row(residual, row, lane, None, N, VEC, GROUP, stream))
    weights = load_row(weight, None, lane, None, N, VEC, GROUP, keep) if HAS_WEIGHT and EARLY_WEIGHT else None
    scratch = nvfly.shared_tensor(nvfly.f32, (max(1, ROWS * GROUP // 32),))
    total = group_sum(square_sum(xs, VEC), scratch, 0, group, warp, warp_lane, GROUP)
    rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
    normalize_row(y, residual_out if HAS_RESIDUAL else None, xs, weights, weight if HAS_WEIGHT else None, rstd, row,
                  lane, valid, N, VEC, GROUP, hints)
    if HAS_RSTD:
        if valid & (lane == 0):
            rstd_out[row] = rstd


@nvfly.kernel
def rms_norm_persistent_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                               residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, M: nvfly.i32, eps: nvfly.f32,
                               N: nvfly.Constexpr, VEC: nvfly.Constexpr, GROUP: nvfly.Constexpr,
                               ROWS: nvfly.Constexpr, BLOCKS_PER_SM: nvfly.Constexpr, HAS_WEIGHT: nvfly.Constexpr,
                               HAS_RESIDUAL: nvfly.Constexpr, HAS_RSTD: nvfly.Constexpr,
                               CACHE_HINTS: nvfly.Constexpr):
    """The row-in-registers kernel looped over row tiles (ROWS rows of GROUP threads): block b takes tiles
    b, b + grid, ... of a grid of BLOCKS_PER_SM blocks per SM. Software-pipelined: the next tile's rows are
    loaded before this tile's reduction and stores, so a tile's bytes stay in flight through the whole loop; the
    weight is read once per block and held in registers."""
    nvfly.min_blocks_per_sm(BLOCKS_PER_SM)  # the grid is sized for exactly this many resident blocks
    tid = nvfly.thread_idx.x
    lane = tid & (GROUP - 1)
    group = tid >> int(math.log2(GROUP))
    warp = tid >> 5
    hints = row_hints(CACHE_HINTS)
    stream, keep, store = hints
    weights = load_row(weight, None, lane, None, N, VEC, GROUP, keep) if HAS_WEIGHT else None
    first = nvfly.block_idx.x * ROWS + group
    xs_next = load_row(x, nvfly.minimum(first, M - 1), lane, first < M, N, VEC, GROUP, stream)
    rs_next = load_row(residual, nvfly.minimum(first, M - 1), lane, first < M, N, VEC, GROUP, stream) \
        if HAS_RESIDUAL else []
    # two scratch halves, alternating by iteration, so one barrier per tile is enough (as in the backward)
    slots = max(1, ROWS * GROUP // 32)
    scratch = nvfly.shared_tensor(nvfly.f32, (2 * slots,))
    parity = nvfly.i32(0)
    for tile in range(nvfly.block_idx.x, (M + ROWS - 1) // ROWS, nvfly.grid_dim.x):
        row = tile * ROWS + group
        valid = row < M
        xs = xs_next
        rs = rs_next
        following = row + nvfly.grid_dim.x * ROWS
        ahead = nvfly.minimum(following, M - 1)
        xs_next = load_row(x, ahead, lane, following < M, N, VEC, GROUP, stream)
        if HAS_RESIDUAL:
            rs_next = load_row(residual, ahead, lane, following < M, N, VEC, GROUP, stream)
            xs = add_residual(xs, rs)
            # stored now: only the fp32 x + residual stays in registers through the reduction (fewer registers)
            store_row(residual_out, xs, row, lane, valid, N, VEC, GROUP, store)
        total = group_sum(square_sum(xs, VEC), scratch, parity * slots, group, warp, tid & 31, GROUP)
        rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
        normalize_row(y, None, xs, weights, None, rstd, row, lane, valid, N, VEC, GROUP, hints)
        if HAS_RSTD:
            if valid & (lane == 0):
                rstd_out[row] = rstd
        parity = parity ^ 1


# Cache hints of the two-pass kernel (RowPlan.cache_hints): the first pass keeps x's (and the residual's) lines
# in L1 for the second, which reads them for the last time. In L2 the first read stays normal: a second read that
# hits L1 never reaches L2 to lower an evict_last line again. The weight and the outputs as in row_hints.
FIRST_READ = "L1::evict_last"
LAST_READ = "L1::evict_first"


def two_pass_hints(CACHE_HINTS: Any) -> tuple[Optional[tuple], Optional[tuple], Optional[tuple], Optional[tuple]]:
    """(first read, last read, weight, stores) hints of ``load_vector``/``store_vector``, or four Nones. With
    LOAD_HINTS, Inductor's: the first read also kept in L2 (evict_last), the stores plain."""
    if not CACHE_HINTS:
        return None, None, None, None
    drop = cache_policy("evict_first")
    if CACHE_HINTS == LOAD_HINTS:
        keep = cache_policy("evict_last")
        return (FIRST_READ, keep), (LAST_READ, drop), (KEEP_L1, keep), None
    return ((FIRST_READ, cache_policy("evict_normal")), (LAST_READ, drop), (KEEP_L1, cache_policy("evict_last")),
            (STREAM_L1, drop))


def step_columns(base: Any, lane: Any, N: int, VEC: int, THREADS: int, VECTORS: int) -> list:
    """(column, mask) of this thread's vectors in the step of THREADS * VECTORS vectors starting at column
    ``base``: a traced base is a whole step inside the row (no masks); a static one (the last step) leaves out
    vectors wholly past the row end and masks the one that crosses it."""
    out = []
    for v in range(VECTORS):
        col = base + (v * THREADS + lane) * VEC
        if isinstance(base, int):
            if base + v * THREADS * VEC >= N:
                break
            out.append((col, col < N if base + (v + 1) * THREADS * VEC > N else None))
        else:
            out.append((col, None))
    return out


def load_step(t: Any, row: Any, columns: list, VEC: int, hint: Optional[tuple]) -> list:
    """``t``'s vectors at ``columns`` (of ``step_columns``) of row ``row`` (of a 1-D ``t`` when None)."""
    return [load_vector(t, (col,) if row is None else (row, col), VEC, mask, hint) for col, mask in columns]


def square_step(x: Any, residual: Any, row: Any, columns: list, squares: Any, VEC: int, HAS_RESIDUAL: bool,
                hint: Optional[tuple]) -> Any:
    """The first pass over one step: ``squares`` plus the squares of x (+ residual); every load of the step is
    issued before the first use (masked-off vectors read as zeros)."""
    xs = load_step(x, row, columns, VEC, hint)
    if HAS_RESIDUAL:
        xs = add_residual(xs, load_step(residual, row, columns, VEC, hint))
    for xv in xs:
        xf = xv.to(nvfly.f32)
        squares = nvfly.fma(xf, xf, squares)
    return squares


def normalize_step(x: Any, weight: Any, residual: Any, y: Any, residual_out: Any, row: Any, columns: list,
                   rstd: Any, VEC: int, HAS_WEIGHT: bool, HAS_RESIDUAL: bool, hints: tuple) -> None:
    """The second pass over one step: x (+ residual, recomputed and written here) and the weight loaded, then
    y = x * rstd * weight stored."""
    _, last_read, weight_hint, store_hint = hints
    xs = load_step(x, row, columns, VEC, last_read)
    if HAS_RESIDUAL:
        xs = add_residual(xs, load_step(residual, row, columns, VEC, last_read))
    weights = load_step(weight, None, columns, VEC, weight_hint) if HAS_WEIGHT else None
    for v, (col, mask) in enumerate(columns):
        out = xs[v].to(nvfly.f32) * rstd
        if HAS_WEIGHT:
            out = out * weights[v].to(nvfly.f32)
        store_vector(y, out, (row, col), VEC, mask, store_hint)
        if HAS_RESIDUAL:
            store_vector(residual_out, xs[v], (row, col), VEC, mask, store_hint)


def two_pass_registers(first_streams: int, second_streams: int, vectors: int, vec: int, itemsize: int,
                       steps: int) -> int:
    """The two-pass kernel's registers a thread, estimated: what it holds at once and TWO_PASS_OTHER_REGISTERS.
    The first pass holds ``first_streams`` (x, the residual) x ``vectors`` accesses of ``vec`` elements (twice that
    when the row takes several steps: LLVM unrolls that loop by two) and the fp32 sum of squares, the second pass
    ``second_streams`` (x, the residual, the weight) x ``vectors`` accesses. Where it is FULL_SM_REGISTERS or
    fewer the kernel asks ptxas for a full SM of warps; otherwise ptxas chooses (a cap below its choice spills)."""
    words = -(-vec * itemsize // 4)
    first = first_streams * vectors * words * (2 if steps > 1 else 1) + vec
    return TWO_PASS_OTHER_REGISTERS + max(first, second_streams * vectors * words)


@nvfly.func
def block_sum(value, scratch, THREADS):
    """Sum ``value`` over the block; every thread gets the total (one barrier: each warp sums the warps' partial
    sums from ``scratch``, THREADS // 32 f32 slots, with shuffles over the next power of two of lanes, the lanes
    past the last warp adding zero)."""
    warps = THREADS // 32
    width = 1 << (warps - 1).bit_length()
    tid = nvfly.thread_idx.x
    lane = tid & 31
    value = nvfly.warp_reduce(value, "add")
    if lane == 0:
        scratch[tid >> 5] = value
    nvfly.syncthreads()
    slot = lane & (width - 1)
    if warps == width:
        return nvfly.warp_reduce(scratch[slot], "add", width)
    return nvfly.warp_reduce(nvfly.select(slot < warps, scratch[nvfly.minimum(slot, warps - 1)], 0.0), "add", width)


@nvfly.kernel
def rms_norm_two_pass_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                             residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, eps: nvfly.f32,
                             N: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr,
                             VECTORS: nvfly.Constexpr, HAS_WEIGHT: nvfly.Constexpr, HAS_RESIDUAL: nvfly.Constexpr,
                             HAS_RSTD: nvfly.Constexpr, CACHE_HINTS: nvfly.Constexpr):
    """A block per row that streams the row through registers twice, VECTORS vectors a thread per step: the
    first pass only sums squares (nothing held across steps or the reduction: few registers, many warps), the
    second reads the row again (from L1/L2: read moments earlier) and writes y.

    With the residual, the second pass reads x and the residual again and recomputes x + residual (the same
    rounding), writing it next to y: the first pass has no stores, and no just-written line is read back from
    L2, which the streaming already keeps busy."""
    step = THREADS * VECTORS * VEC
    registers = two_pass_registers(1 + HAS_RESIDUAL, 1 + HAS_WEIGHT + HAS_RESIDUAL, VECTORS, VEC, x.dtype.itemsize,
                                   -(-N // step))
    if registers <= FULL_SM_REGISTERS:
        nvfly.min_blocks_per_sm(SM_MAX_WARPS * 32 // THREADS)
    row = nvfly.block_idx.x
    lane = nvfly.thread_idx.x
    hints = two_pass_hints(CACHE_HINTS)
    whole = N // step * step   # columns covered by whole steps; the rest is the masked last step
    squares = nvfly.full(VEC, 0.0, nvfly.f32)
    for base in range(0, whole, step):
        asm('.pragma "nounroll";')  # ptxas would unroll the steps past the register budget (spills)
        squares = square_step(x, residual, row, step_columns(base, lane, N, VEC, THREADS, VECTORS), squares, VEC,
                              HAS_RESIDUAL, hints[0])
    if whole < N:
        squares = square_step(x, residual, row, step_columns(whole, lane, N, VEC, THREADS, VECTORS), squares, VEC,
                              HAS_RESIDUAL, hints[0])
    scratch = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    rstd = nvfly.rsqrt(block_sum(squares.sum(), scratch, THREADS) * (1.0 / N) + eps)
    for base in range(0, whole, step):
        asm('.pragma "nounroll";')  # ptxas would unroll the steps past the register budget (spills)
        normalize_step(x, weight, residual, y, residual_out, row,
                       step_columns(base, lane, N, VEC, THREADS, VECTORS), rstd, VEC, HAS_WEIGHT, HAS_RESIDUAL,
                       hints)
    if whole < N:
        normalize_step(x, weight, residual, y, residual_out, row,
                       step_columns(whole, lane, N, VEC, THREADS, VECTORS), rstd, VEC, HAS_WEIGHT, HAS_RESIDUAL,
                       hints)
    if HAS_RSTD:
        if lane == 0:
            rstd_out[row] = rstd


# ---------------------------------------------------------------------------------------------- bulk-copy kernel
def bulk_row_bytes(n: int, itemsize: int) -> int:
    """A row's bytes in a stage of the bulk kernel's ring: padded to BULK_ROW_ALIGN."""
    return -(-n * itemsize // BULK_ROW_ALIGN) * BULK_ROW_ALIGN


def bulk_stage_bytes(n: int, itemsize: int, has_residual: bool) -> int:
    """One stage of the bulk kernel's ring: the row of x (and of the residual)."""
    return bulk_row_bytes(n, itemsize) * (1 + has_residual)


@nvfly.func
def fetch_row(x, residual, row, M, bar, stage, ROW_BYTES, RESIDUAL_OFFSET, HAS_RESIDUAL):
    """Thread 0: the bulk copies of row ``row`` of x (and of the residual) into the stage at shared address
    ``stage``, completing on ``bar``; nothing past the last row."""
    if row < M:
        sm90.mbarrier_arrive_expect_tx(bar, ROW_BYTES * (1 + HAS_RESIDUAL))
        sm90.bulk_load(stage, x.address(row, 0), ROW_BYTES, bar)
        if HAS_RESIDUAL:
            sm90.bulk_load(stage + RESIDUAL_OFFSET, residual.address(row, 0), ROW_BYTES, bar)


@nvfly.kernel
def rms_norm_bulk_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                         residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, M: nvfly.i32, eps: nvfly.f32,
                         N: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr,
                         STAGES: nvfly.Constexpr, BLOCKS_PER_SM: nvfly.Constexpr, HAS_WEIGHT: nvfly.Constexpr,
                         HAS_RESIDUAL: nvfly.Constexpr, HAS_RSTD: nvfly.Constexpr):
    """A persistent block of THREADS threads a row at a time (rows b, b + grid, ...), its rows streamed into a
    shared-memory ring of STAGES stages by bulk copies (one instruction a row, issued by thread 0): STAGES rows a
    block are in flight whatever the registers, the reads never wait behind the block's own reduction. Each
    thread reads its vectors of the row from the stage, the block sums the squares (one barrier, after which the
    stage is refilled with the row STAGES ahead) and the thread stores y from registers; the weight is read once
    per block."""
    nvfly.min_blocks_per_sm(BLOCKS_PER_SM)  # the grid is sized for exactly this many resident blocks
    tid = nvfly.thread_idx.x
    itemsize = x.dtype.itemsize
    ROW_BYTES = N * itemsize
    STAGE_BYTES = bulk_stage_bytes(N, itemsize, HAS_RESIDUAL)
    RESIDUAL_OFFSET = bulk_row_bytes(N, itemsize)
    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (STAGES,)))
    # stage s: row s of x's view, the residual's row RESIDUAL_OFFSET bytes on
    ring = nvfly.dynamic_shared_tensor(x.dtype, (STAGES * (1 + HAS_RESIDUAL), RESIDUAL_OFFSET // itemsize),
                                       offset_bytes=BULK_BARRIER_BYTES)
    ring_address = smem_address(ring)
    first = nvfly.block_idx.x
    step = nvfly.grid_dim.x
    if tid == 0:
        for s in nvfly.static_range(STAGES):
            sm90.mbarrier_init(bars + 8 * s, 1)
        sm90.fence_barrier_init()
        for s in nvfly.static_range(STAGES):
            fetch_row(x, residual, first + s * step, M, bars + 8 * s, ring_address + s * STAGE_BYTES, ROW_BYTES,
                      RESIDUAL_OFFSET, HAS_RESIDUAL)
    weights = load_row(weight, None, tid, None, N, VEC, THREADS, None) if HAS_WEIGHT else None
    # two scratch halves, alternating by row, so one barrier a row is enough (as in the persistent kernel)
    scratch = nvfly.shared_tensor(nvfly.f32, (2 * THREADS // 32,))
    nvfly.syncthreads()  # the barriers are initialised before anyone waits on them
    state = sm90.PipelineState.start(STAGES)
    parity = nvfly.i32(0)
    for row in range(first, M, step):
        asm('.pragma "nounroll";')  # an unrolled copy of the row's vectors would double the registers
        sm90.mbarrier_wait(bars + state.stage * 8, state.phase)
        xs = load_row(ring, state.stage * (1 + HAS_RESIDUAL), tid, None, N, VEC, THREADS, None)
        if HAS_RESIDUAL:
            xs = add_residual(xs, load_row(ring, state.stage * 2 + 1, tid, None, N, VEC, THREADS, None))
        total = group_sum(square_sum(xs, VEC), scratch, parity * (THREADS // 32), 0, tid >> 5, tid & 31, THREADS)
        # every thread's reads of the stage are done (they fed the sum): refill it with the row STAGES ahead
        if tid == 0:
            fetch_row(x, residual, row + STAGES * step, M, bars + state.stage * 8,
                      ring_address + state.stage * STAGE_BYTES, ROW_BYTES, RESIDUAL_OFFSET, HAS_RESIDUAL)
        rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
        valid = row < M  # always: a traced true for the stores' masks
        if HAS_RESIDUAL:
            store_row(residual_out, xs, row, tid, valid, N, VEC, THREADS, None)
        normalize_row(y, None, xs, weights, None, rstd, row, tid, valid, N, VEC, THREADS, (None, None, None))
        if HAS_RSTD:
            if tid == 0:
                rstd_out[row] = rstd
        state = state.advance()
        parity = parity ^ 1


# ---------------------------------------------------------------------------------------------- backward kernels
@nvfly.kernel
def rms_norm_backward_kernel(grad_out: nvfly.Tensor, x: nvfly.Tensor, weight: nvfly.Tensor, rstd: nvfly.Tensor,
                             grad_residual: nvfly.Tensor, grad_x: nvfly.Tensor, weight_grad_partial: nvfly.Tensor,
                             M: nvfly.i32, N: nvfly.Constexpr, VEC: nvfly.Constexpr, GROUP: nvfly.Constexpr,
                             ROWS: nvfly.Constexpr, HAS_WEIGHT: nvfly.Constexpr,
                             HAS_GRAD_RESIDUAL: nvfly.Constexpr, NEEDS_WEIGHT_GRAD: nvfly.Constexpr):
    """dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd (+ the gradient that reached
    the residual output); each thread also sums dy * xhat over its rows for the weight gradient.

    Persistent: block b handles row tiles b, b + grid, ...; the loop trip count is uniform in the block, so
    the barriers of the group sum are reached by every thread. dy and x are read from memory once, for the
    dot product, and read again after the reduction (from L1/L2) instead of being held in registers."""
    nvfly.min_blocks_per_sm(max(1, 512 // (GROUP * ROWS)))  # a 128-register budget
    tid = nvfly.thread_idx.x
    lane = tid & (GROUP - 1)
    group = tid >> int(math.log2(GROUP))
    warp = tid >> 5
    vectors = (N + GROUP * VEC - 1) // (GROUP * VEC)
    tail = N % (GROUP * VEC) != 0
    weight_sums = []
    if NEEDS_WEIGHT_GRAD:
        weight_sums = [nvfly.full(VEC, 0.0, nvfly.f32) for _ in nvfly.static_range(vectors)]
    # two scratch halves, alternating by iteration, so one barrier per row tile is enough
    slots = max(1, ROWS * GROUP // 32)
    scratch = nvfly.shared_tensor(nvfly.f32, (2 * slots,))
    tiles = (M + ROWS - 1) // ROWS
    parity = nvfly.i32(0)
    for tile in range(nvfly.block_idx.x, tiles, nvfly.grid_dim.x):
        row = tile * ROWS + group
        valid = row < M
        row = nvfly.minimum(row, M - 1)
        r = rstd[row]
        dot = nvfly.full(VEC, 0.0, nvfly.f32)
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            in_row = col < N if tail and v == vectors - 1 else None
            g = grad_out.load(row, col, width=VEC, mask=in_row).to(nvfly.f32)
            if HAS_WEIGHT:  # read for every row (an L1 hit) rather than held in registers
                g = g * weight.load(col, width=VEC, mask=in_row).to(nvfly.f32)
            dot = nvfly.fma(g, x.load(row, col, width=VEC, mask=in_row).to(nvfly.f32), dot)
        mean_dot = group_sum(dot.sum(), scratch, parity * slots, group, warp, tid & 31, GROUP) * r * (1.0 / N)
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            keep = valid & (col < N) if tail and v == vectors - 1 else valid
            dy = grad_out.load(row, col, width=VEC, mask=keep).to(nvfly.f32)
            xhat = x.load(row, col, width=VEC, mask=keep).to(nvfly.f32) * r
            g = dy * weight.load(col, width=VEC, mask=keep).to(nvfly.f32) if HAS_WEIGHT else dy
            dx = (g - xhat * mean_dot) * r
            if HAS_GRAD_RESIDUAL:
                dx = dx + grad_residual.load(row, col, width=VEC, mask=keep).to(nvfly.f32)
            grad_x.store(dx.to(grad_x.dtype), row, col, mask=keep)
            if NEEDS_WEIGHT_GRAD:
                weight_sums[v] = nvfly.fma(dy, xhat, weight_sums[v])  # masked loads gave 0 for invalid rows
        parity = parity ^ 1
    if NEEDS_WEIGHT_GRAD:
        partial_row = nvfly.block_idx.x * ROWS + group
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            in_row = col < N if tail and v == vectors - 1 else None
            weight_grad_partial.store(weight_sums[v], partial_row, col, mask=in_row)


@nvfly.kernel
def column_sum_kernel(partial: nvfly.Tensor, out: nvfly.Tensor, P: nvfly.i32, N: nvfly.i32):
    """out[c] = sum over p of partial[p, c]: 8 threads x 4 columns across, 32 threads down each block's 32
    columns, four rows in flight per thread, then a shared-memory sum down the 32 partial sums."""
    tid = nvfly.thread_idx.x
    across = tid & 7
    down = tid >> 3
    col = nvfly.block_idx.x * 32 + across * 4
    sums = nvfly.full(4, 0.0, nvfly.f32)
    for p in range(down, P, 128):
        for u in nvfly.static_range(4):
            sums = sums + partial.load(p + 32 * u, col, width=4, mask=p + 32 * u < P)
    table = nvfly.shared_tensor(nvfly.f32, (32, 33))  # padded: the column reads below avoid bank conflicts
    for j in nvfly.static_range(4):
        table[down, across * 4 + j] = sums[j]
    nvfly.syncthreads()
    if tid < 32:
        total = table[0, tid]
        for r in nvfly.static_range(1, 32):
            total = total + table[r, tid]
        c = nvfly.block_idx.x * 32 + tid
        if c < N:
            out[c] = total.to(out.dtype)


# ---------------------------------------------------------------------------------------------- host side
@dataclass(frozen=True)
class RowPlan:
    """How a row of N elements is spread over threads: ``vec`` elements per access, ``group`` threads per row
    (a power of two), ``rows`` rows per block; ``looped`` when the row does not fit in registers."""
    vec: int
    group: int
    rows: int
    looped: bool
    persistent: bool = False    # the forward's persistent kernel, ``blocks_per_sm`` blocks per SM
    blocks_per_sm: int = 0
    two_pass: bool = False      # the forward's two-pass kernel (a block of ``group`` threads a row), ``vectors``
    vectors: int = 0            # accesses of ``vec`` elements a thread per step of each pass
    early_weight: bool = False  # the forward's row kernel reads the weight with the row
    cache_hints: Any = False    # False, True or LOAD_HINTS
    bulk: bool = False          # the forward's bulk-copy kernel: a block of ``group`` threads a row, ``stages``
    stages: int = 0             # rows a block in flight, ``blocks_per_sm`` blocks an SM

    @property
    def threads(self) -> int:
        """Threads per block of the row-in-registers kernels."""
        return self.group * self.rows


@dataclass(frozen=True)
class ForwardOptions:
    """The forward's plan choices (``benchmarks/rmsnorm.py --compare-plans`` times them side by side); the defaults
    are the model's (``forward_plan``)."""
    block_threads: int = ROW_BLOCK_THREADS  # threads of a block packing short rows: a power of two, 32 to 512
    persistent: bool = False                # the persistent kernel (forward_plan: measured slower by default)
    target_vectors: Optional[int] = None    # 16-byte vectors of a row per thread (None: forward_plan's, persistent 4)
    early_weight: bool = EARLY_WEIGHT
    cache_hints: Any = CACHE_HINTS          # False, True (loads and stores) or LOAD_HINTS (the loads only)
    two_pass: bool = False                  # the two-pass kernel for any row (rows too long for registers take it)
    two_pass_threads: Optional[int] = None  # its block, a row each: whole warps, 128 to 1024 (None: forward_plan's)
    two_pass_vectors: int = TWO_PASS_VECTORS  # its 16-byte vectors a thread per step of each pass, 1 to 8
    bulk: bool = False                      # the bulk-copy kernel (rows of whole 16-byte vectors)
    bulk_threads: Optional[int] = None      # its block: a power of two, 128 to 1024 (None: bulk_plan's)
    bulk_stages: Optional[int] = None       # its ring's rows a block (None: as many as fit, up to BULK_MAX_STAGES)
    bulk_blocks_per_sm: Optional[int] = None  # 1 to 4 (None: two blocks of up to 256 threads, else one)
    vector_bytes: Optional[int] = None      # narrower accesses than the layout allows: 4 or 8 (None: up to 16)

    def __post_init__(self) -> None:
        # checked here, not per call: options equal as values (128 == 128.0) share a cached plan
        threads, vectors = self.block_threads, self.target_vectors
        if type(threads) is not int or not 32 <= threads <= MAX_GROUP or threads & (threads - 1):
            raise ValueError(f"options.block_threads: expected a power of two from 32 to {MAX_GROUP}, got {threads!r}")
        if vectors is not None and (type(vectors) is not int or not 1 <= vectors <= MAX_VECTORS_PER_THREAD):
            raise ValueError(f"options.target_vectors: expected None or 1 to {MAX_VECTORS_PER_THREAD}, "
                             f"got {vectors!r}")
        if self.cache_hints not in (False, True, LOAD_HINTS) or type(self.cache_hints) not in (bool, str):
            raise ValueError(f"options.cache_hints: expected False, True or {LOAD_HINTS!r}, got {self.cache_hints!r}")
        for name in ("persistent", "early_weight", "two_pass", "bulk"):
            value = getattr(self, name)
            if type(value) is not bool:
                raise ValueError(f"options.{name}: expected a bool, got {value!r}")
        if self.persistent + self.two_pass + self.bulk > 1:
            raise ValueError("options: at most one of persistent, two_pass and bulk (each is a kernel)")
        # whole warps (block_sum takes any count)
        _check_block_or_none("two_pass_threads", self.two_pass_threads, TWO_PASS_MIN_THREADS, any_warps=True)
        vectors = self.two_pass_vectors
        if type(vectors) is not int or not 1 <= vectors <= MAX_VECTORS_PER_THREAD:
            raise ValueError(f"options.two_pass_vectors: expected 1 to {MAX_VECTORS_PER_THREAD}, got {vectors!r}")
        _check_block_or_none("bulk_threads", self.bulk_threads, BULK_MIN_THREADS)
        stages = self.bulk_stages
        if stages is not None and (type(stages) is not int or not 2 <= stages <= BULK_MAX_STAGES):
            raise ValueError(f"options.bulk_stages: expected None or 2 to {BULK_MAX_STAGES}, got {stages!r}")
        if self.vector_bytes not in (None, 4, 8):
            raise ValueError(f"options.vector_bytes: expected None, 4 or 8, got {self.vector_bytes!r}")
        blocks = self.bulk_blocks_per_sm
        if blocks is not None and (type(blocks) is not int or not 1 <= blocks <= 4):
            raise ValueError(f"options.bulk_blocks_per_sm: expected None or 1 to 4, got {blocks!r}")


def _check_block_or_none(name: str, threads: Any, least: int, any_warps: bool = False) -> None:
    """ForwardOptions' block sizes of a row a block: None or a power of two (with ``any_warps``, a multiple of 32)
    from ``least`` to TWO_PASS_MAX_THREADS."""
    if threads is not None and (type(threads) is not int or (threads % 32 if any_warps else threads & (threads - 1))
                                or not least <= threads <= TWO_PASS_MAX_THREADS):
        kind = "a multiple of 32" if any_warps else "a power of two"
        raise ValueError(f"options.{name}: expected None or {kind} from {least} to {TWO_PASS_MAX_THREADS}, "
                         f"got {threads!r}")


def fewest_threads(least: int, per_thread: int, amount: int) -> int:
    """The fewest threads, a power of two from ``least`` to TWO_PASS_MAX_THREADS, that cover ``amount`` at
    ``per_thread`` each (TWO_PASS_MAX_THREADS where none does)."""
    threads = least
    while threads < TWO_PASS_MAX_THREADS and threads * per_thread < amount:
        threads *= 2
    return threads


@functools.lru_cache(maxsize=4096)
def plan(n: int, vec: int, m: int, sm_count: int, target_vectors: int = TARGET_VECTORS_PER_THREAD,
         max_vectors: int = MAX_VECTORS_PER_THREAD, max_group: int = MAX_GROUP,
         block_threads: int = ROW_BLOCK_THREADS) -> RowPlan:
    """The launch shape for ``m`` rows of ``n`` elements read ``vec`` at a time (see the module doc).

    Threads per row grow until each holds about ``target_vectors`` vectors; short rows share a block of
    ``block_threads`` threads (rows of more threads get a block each), but never so many that fewer than two
    blocks per SM would be launched (blocks stay whole warps).
    """
    row_vectors = -(-n // vec)
    group = 1
    while group < max_group and group * target_vectors < row_vectors:
        group *= 2
    if -(-row_vectors // group) > max_vectors:
        return RowPlan(vec, TWO_PASS_MAX_THREADS, 1, True)
    # whole warps only (rows of less than a warp are packed by 32 // group)
    per_warp = max(1, 32 // group)
    rows = max(per_warp, min(block_threads // group, m // (2 * sm_count)) // per_warp * per_warp)
    return RowPlan(vec, group, rows, False)


@functools.lru_cache(maxsize=4096)
def forward_plan(n: int, vec: int, m: int, sm_count: int, max_vectors: int = MAX_VECTORS_PER_THREAD,
                 has_residual: bool = False, options: ForwardOptions = ForwardOptions()) -> RowPlan:
    """The forward's kernel and launch shape: the row kernel (one row tile per block), the persistent one, or the
    two-pass one (``two_pass_plan``: rows too long for registers, or any row with ``options.two_pass``; and rows of
    TWO_PASS_MIN_ROW_BYTES or more when there are TWO_PASS_MIN_ROWS of them, with LOAD_HINTS).

    The row kernel (one row tile per block, the weight loaded with the row where registers allow) is the default;
    rows of at most SHORT_ROW_VECTORS vectors take SHORT_ROW_TARGET_VECTORS a thread. The persistent kernel (a grid
    of ``blocks_per_sm`` x SMs blocks looping over tiles, the next tile's loads issued before each tile's
    reduction and stores, the weight read once; PERSISTENT_VECTORS_PER_THREAD vectors of two tiles a thread) is
    taken with ``options.persistent`` (ValueError where two tiles of a row do not fit) and for long rows when there
    are sm_count to PERSISTENT_MAX_ROWS of them (fewer than two an SM of rows up to 2 x SHORT_ROW_VECTORS take the
    row kernel at SHORT_ROW_TARGET_VECTORS instead, and fewer than PERSISTENT_MIN_TILES tiles a block the two-pass
    kernel: see PERSISTENT_MAX_ROWS). Measured side by side on the H200
    (``benchmarks/rmsnorm.py --compare-plans``) it lost to the row kernel on large shapes (16384x2048 37.0 vs
    35.1 us, 16384x8192 141.9 vs 133.4, fused add 16384x8192 276.6 vs 262.0).
    """
    row_vectors = -(-n // vec)
    chosen = options.target_vectors is None and not options.persistent and not options.cache_hints
    wide = max_vectors == MAX_VECTORS_PER_THREAD  # 16-byte vectors: the row is n * 16 // vec bytes
    # long rows, sm_count to PERSISTENT_MAX_ROWS of them (that fit the persistent kernel), no kernel asked for
    by_rows = chosen and wide and not has_residual and SHORT_ROW_VECTORS < row_vectors <= \
        MAX_GROUP * PERSISTENT_VECTORS_PER_THREAD and sm_count <= m <= PERSISTENT_MAX_ROWS
    to_16_kb = row_vectors <= 2 * SHORT_ROW_VECTORS
    one_wave = by_rows and m < 2 * sm_count and to_16_kb
    target = options.target_vectors or (SHORT_ROW_TARGET_VECTORS if row_vectors <= SHORT_ROW_VECTORS or one_wave
                                        else TARGET_VECTORS_PER_THREAD)
    rows = plan(n, vec, m, sm_count, target, max_vectors, block_threads=options.block_threads)
    if options.two_pass:
        return two_pass_plan(n, vec, max_vectors, options)
    if options.persistent or by_rows and not one_wave:
        vectors = options.target_vectors or PERSISTENT_VECTORS_PER_THREAD
        tiled = plan(n, vec, m, sm_count, vectors, max_vectors, block_threads=options.block_threads)
        if tiled.looped or -(-n // (vec * tiled.group)) > vectors:
            raise ValueError(f"options: rows of {n} elements do not fit the persistent kernel "
                             f"({vectors} vectors of {vec} per thread)")
        blocks_per_sm = max(1, SM_REGISTERS // (PERSISTENT_REGISTERS[has_residual] * tiled.threads))
        if options.persistent or -(-m // tiled.rows) >= PERSISTENT_MIN_TILES * blocks_per_sm * sm_count:
            return dataclasses.replace(tiled, persistent=True, blocks_per_sm=blocks_per_sm,
                                       cache_hints=options.cache_hints)
        if to_16_kb:  # longer rows: the row kernel's 8 vectors (see PERSISTENT_MIN_TILES)
            return two_pass_plan(n, vec, max_vectors, dataclasses.replace(options, cache_hints=LOAD_HINTS))
    # long rows, many of them, no other kernel asked for: Inductor's structure and cache hints (LOAD_HINTS)
    if rows.looped or chosen and wide and n * 16 // vec >= TWO_PASS_MIN_ROW_BYTES and m >= TWO_PASS_MIN_ROWS:
        return two_pass_plan(n, vec, max_vectors, dataclasses.replace(
            options, cache_hints=options.cache_hints or LOAD_HINTS))
    # the weight read with the row is a third stream of vectors in registers with the residual's: only where
    # the row kernel's budget (two streams of max_vectors) holds it
    streams = 2 + has_residual
    early_weight = options.early_weight and -(-n // (vec * rows.group)) * streams <= 2 * max_vectors
    return dataclasses.replace(rows, early_weight=early_weight, cache_hints=options.cache_hints)


def two_pass_plan(n: int, vec: int, max_vectors: int, options: ForwardOptions) -> RowPlan:
    """The two-pass kernel's block and accesses a thread per step: ``options.two_pass_vectors`` 16-byte vectors (of
    narrower accesses, ``max_vectors / MAX_VECTORS_PER_THREAD`` times as many, as the row kernel's budget), and
    ``options.two_pass_threads`` threads, else the fewest (a power of two, TWO_PASS_MIN_THREADS to
    TWO_PASS_MAX_THREADS) that take the row in one step: longer rows loop over steps."""
    vectors = options.two_pass_vectors * max_vectors // MAX_VECTORS_PER_THREAD
    threads = options.two_pass_threads or fewest_threads(TWO_PASS_MIN_THREADS, vectors * vec, n)
    return RowPlan(vec, threads, 1, False, two_pass=True, vectors=vectors, cache_hints=options.cache_hints)


def bulk_plan(n: int, vec: int, itemsize: int, has_residual: bool, options: ForwardOptions) -> RowPlan:
    """The bulk-copy kernel's block, ring and blocks per SM (ValueError where it cannot take the rows: they must
    be whole 16-byte vectors, few enough a thread, and two stages must fit): ``options.bulk_threads`` threads, else
    the fewest that hold the row in BULK_VECTORS_PER_THREAD vectors a thread; as many stages as fit the shared
    memory of ``options.bulk_blocks_per_sm`` blocks, up to ``options.bulk_stages`` (or BULK_MAX_STAGES)."""
    if vec * itemsize != 16 or n % vec:
        raise ValueError(f"options.bulk: rows of {n} elements of {itemsize} bytes read {vec} at a time are not whole "
                         "16-byte vectors (the bulk copies move 16-byte units from 16-byte aligned rows)")
    row_vectors = n // vec
    threads = options.bulk_threads or fewest_threads(BULK_MIN_THREADS, BULK_VECTORS_PER_THREAD, row_vectors)
    blocks = options.bulk_blocks_per_sm or (BULK_BLOCKS_PER_SM if threads <= BULK_SM_THREADS // 2 else 1)
    if -(-row_vectors // threads) > BULK_VECTORS_PER_THREAD or threads * blocks > BULK_SM_THREADS:
        raise ValueError(f"options.bulk: rows of {n} elements on {threads} threads, {blocks} blocks an SM: over the "
                         f"kernel's {BULK_VECTORS_PER_THREAD} vectors or 128 registers a thread")
    budget = BULK_SMEM_PER_SM // blocks - BULK_BARRIER_BYTES
    stages = min(options.bulk_stages or BULK_MAX_STAGES, budget // bulk_stage_bytes(n, itemsize, has_residual))
    if stages < 2:
        raise ValueError(f"options.bulk: two stages of rows of {n} elements do not fit the shared memory of "
                         f"{blocks} blocks an SM")
    return RowPlan(vec, threads, 1, False, bulk=True, stages=stages, blocks_per_sm=blocks)


def resident_warps(registers: int, threads: int) -> int:
    """Warps an sm_90 SM holds of blocks of ``threads`` threads using ``registers`` each (shared memory aside):
    the register, warp and block limits as cuda_occupancy.h computes them, where each sub-partition holds the
    warps its quarter of the register file fits."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    by_registers = SM_REGISTERS // SM_SUB_PARTITIONS // per_warp * SM_SUB_PARTITIONS
    return min(by_registers // warps, SM_MAX_WARPS // warps, SM_MAX_BLOCKS) * warps


def _is_tensor(value: Any) -> bool:
    import torch
    return isinstance(value, torch.Tensor)


def default_eps() -> float:
    """The eps torch uses when none is given: the float32 machine epsilon (fp32 accumulation)."""
    return 1.1920928955078125e-07


def _row_shape(x: "torch.Tensor", weight: Optional["torch.Tensor"],
               normalized_shape: Optional[Sequence[int]]) -> tuple[int, int]:
    """(M, N): the number of rows and the normalised size (the product of the last dimensions)."""
    if normalized_shape is None:
        normalized_shape = tuple(weight.shape) if weight is not None else (x.shape[-1],) if x.dim() else ()
    normalized_shape = tuple(int(s) for s in normalized_shape)
    axis = x.dim() - len(normalized_shape)
    if not normalized_shape or axis < 0 or tuple(x.shape[axis:]) != normalized_shape:
        raise ValueError(f"normalized_shape: {normalized_shape} must be non-empty and match the last dimensions of "
                         f"x, whose shape is {tuple(x.shape)}")
    if weight is not None and tuple(weight.shape) != normalized_shape:
        raise ValueError(f"weight: expected shape {normalized_shape}, got {tuple(weight.shape)}")
    return math.prod(x.shape[:axis]), math.prod(normalized_shape)


def _check(x: Any, weight: Any, residual: Any, eps: Any,
           normalized_shape: Optional[Sequence[int]]) -> tuple[int, int]:
    """Validate arguments (errors name the argument); returns (M, N) as ``_row_shape``."""
    if not _is_tensor(x):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if str(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported (bfloat16, float16, float32)")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is None:
            continue
        if not _is_tensor(t):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, x on {x.device}")
        if str(t.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported (bfloat16, float16, float32)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual: expected shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if eps is not None and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0):
        raise ValueError(f"eps: expected a non-negative float or None, got {eps!r}")
    return _row_shape(x, weight, normalized_shape)


def eligibility(x: Any, weight: Any = None, residual: Any = None,
                normalized_shape: Optional[Sequence[int]] = None) -> Optional[str]:
    """None when nvfly computes this RMSNorm, else the reason it declines (callers then use torch)."""
    try:
        _check(x, weight, residual, None, normalized_shape)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if x.numel() == 0:
        return "x is empty"
    if x.numel() >= 1 << 31:
        return "x has 2**31 elements or more"
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    return None


def _backward_size_reason(n: int, vec: int) -> Optional[str]:
    if -(-n // (1024 * vec)) > max(1, BACKWARD_MAX_ELEMENTS // vec):
        return f"rows of {n} elements are too long for the backward kernel (at most {1024 * BACKWARD_MAX_ELEMENTS})"
    return None


def backward_eligibility(x: Any, normalized_shape: Optional[Sequence[int]] = None,
                         grad_out: Optional["torch.Tensor"] = None) -> Optional[str]:
    """None when ``rms_norm_backward`` handles rows like ``x``'s, else why not (its rows must fit in registers:
    1024 threads x 16 elements, 16384 elements)."""
    reason = eligibility(x, None, None, normalized_shape)
    if reason is not None:
        return reason
    _, n = _row_shape(x, None, normalized_shape)
    rows = [_rows(x, n)] + ([_rows(grad_out, n)] if grad_out is not None else [])
    return _backward_size_reason(n, vector_width(n, rows, x.element_size()))


def _rows(t: "torch.Tensor", n: int) -> "torch.Tensor":
    """``t`` as (rows, n) with unit stride along the row: a view when the layout allows, else a copy."""
    rows = t.reshape(-1, n)
    return rows if rows.stride(1) == 1 or n == 1 else rows.contiguous()


def _is_rows(t: "torch.Tensor", m: int, n: int) -> bool:
    """Whether ``t`` is already a contiguous (m, n) tensor (passed to the kernels as it is)."""
    return t.dim() == 2 and t.shape[0] == m and t.is_contiguous()


# Per-call plans. The host path of a call is one dictionary lookup keyed on everything the argument checks and
# the launch shape depend on: for each tensor its shape, strides, dtype, device and base address modulo 16
# (vector widths), and the other arguments' values (with their types: True == 1 but is not a valid eps). The
# first call of a key runs the checks (which raise, naming the argument) and makes the plan; later calls
# allocate the outputs and launch (nvfly.PreparedLaunch: only addresses and scalars are read).
_PLAN_LIMIT = 4096
_FORWARD: dict[Any, "_Forward"] = {}
_BACKWARD: dict[Any, "_Backward"] = {}


def _remember(cache: dict, key: Any, value: Any) -> None:
    if key is not None:
        if len(cache) >= _PLAN_LIMIT:
            cache.clear()
        cache[key] = value


@dataclass
class _Forward:
    """A forward call's plan: ``direct`` when x (and the residual) are contiguous (m, n) tensors and the weight
    is contiguous, so that they are passed as they are and y is ``empty_like(x)``; otherwise the call makes
    (m, n) row views (or copies), the same for every call of its key."""
    m: int
    n: int
    shape: tuple[int, ...]
    direct: bool
    launch: Optional[nvfly.PreparedLaunch]  # None: nothing to launch (empty rows or no rows)
    tail: tuple        # the kernel's arguments after its six tensors


def rms_norm_forward(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, eps: Optional[float] = None,
                     residual: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None,
                     want_rstd: bool = True, options: Optional[ForwardOptions] = None
                     ) -> tuple["torch.Tensor", Optional["torch.Tensor"], Optional["torch.Tensor"]]:
    """(y, x + residual or None, rstd or None); ``rstd`` has one fp32 entry per row (for the backward).

    ``options`` replaces the default plan choices (ForwardOptions): for comparing plans.
    """
    try:
        key = (layout_key(x), layout_key(weight), layout_key(residual), eps, type(eps),
               normalized_shape if normalized_shape is None else tuple(normalized_shape), want_rstd, options)
        f = _FORWARD.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = f = None
    if f is None:
        f = _forward_plan(key, x, weight, eps, residual, normalized_shape, want_rstd, options)
    if not f.direct:
        return _forward_general(f, x, weight, residual, want_rstd)
    import torch
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    rstd = torch.empty(f.m, dtype=torch.float32, device=x.device) if want_rstd else None
    f.launch.launch(x, x if weight is None else weight, x if residual is None else residual, y,
                    x if h is None else h, x if rstd is None else rstd, *f.tail)
    return y, h, rstd


def _forward_general(f: _Forward, x: "torch.Tensor", weight: Optional["torch.Tensor"],
                     residual: Optional["torch.Tensor"], want_rstd: bool) -> tuple:
    """Any layout: (m, n) row views of x, the residual and the outputs (copies where rows are not unit-stride)."""
    import torch
    m, n = f.m, f.n
    if f.launch is None:
        return _forward_empty(f, x, residual, want_rstd)
    y = torch.empty(f.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(f.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device) if want_rstd else None
    x2 = _rows(x, n)
    w = weight.reshape(-1).contiguous() if weight is not None else x2
    r2 = _rows(residual, n) if residual is not None else x2
    f.launch.launch(x2, w, r2, y.view(m, n), h.view(m, n) if h is not None else x2,
                    rstd if rstd is not None else x2, *f.tail)
    return y, h, rstd


def _forward_empty(f: _Forward, x: "torch.Tensor", residual: Optional["torch.Tensor"], want_rstd: bool) -> tuple:
    """Rows of no elements, or no rows: nothing to launch."""
    import torch
    y = torch.empty(f.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(y) if residual is not None else None
    rstd = torch.empty(f.m, dtype=torch.float32, device=x.device) if want_rstd else None
    if rstd is not None:
        rstd.fill_(math.nan)  # the mean of an empty row
    if residual_out is not None:
        torch.add(x, residual, out=residual_out)
    return y, residual_out, rstd


def _forward_plan(key: Any, x: Any, weight: Any, eps: Any, residual: Any,
                  normalized_shape: Optional[Sequence[int]], want_rstd: bool, options: Any) -> _Forward:
    """The first call of a key: the checks (they raise), then the plan, remembered under ``key``."""
    m, n = _check(x, weight, residual, eps, normalized_shape)
    options = _check_options(options)
    if m == 0 or n == 0:  # nothing to launch
        f = _Forward(m, n, tuple(x.shape), False, None, ())
        _remember(_FORWARD, key, f)
        return f
    sms = driver.plan_sm_count(x.get_device())
    p = _forward_plan_of(x, weight, residual, m, n, sms, options)
    vec = p.vec
    flags = (weight is not None, residual is not None, bool(want_rstd))
    eps = default_eps() if eps is None else float(eps)
    if p.bulk:
        launch = rms_norm_bulk_kernel.prepared(min(m, p.blocks_per_sm * sms), p.threads)
        tail: tuple = (m, eps, n, vec, p.threads, p.stages, p.blocks_per_sm, *flags)
    elif p.two_pass:
        launch = rms_norm_two_pass_kernel.prepared(m, p.threads)
        tail = (eps, n, vec, p.threads, p.vectors, *flags, p.cache_hints)
    elif p.persistent:
        launch = rms_norm_persistent_kernel.prepared(min(-(-m // p.rows), p.blocks_per_sm * sms), p.threads)
        tail = (m, eps, n, vec, p.group, p.rows, p.blocks_per_sm, *flags, p.cache_hints)
    else:
        launch = rms_norm_kernel.prepared(-(-m // p.rows), p.threads)
        tail = (m, eps, n, vec, p.group, p.rows, *flags, p.early_weight and weight is not None, p.cache_hints)
    direct = _is_rows(x, m, n) and (residual is None or _is_rows(residual, m, n)) and \
        (weight is None or (weight.dim() == 1 and weight.is_contiguous()))
    f = _Forward(m, n, tuple(x.shape), direct, launch, tail)
    _remember(_FORWARD, key, f)
    return f


def _forward_plan_of(x: "torch.Tensor", weight: Optional["torch.Tensor"], residual: Optional["torch.Tensor"], m: int,
                     n: int, sm_count: int, options: ForwardOptions) -> RowPlan:
    """forward_plan for checked arguments: the vector width their layouts allow and its register budget."""
    vec = vector_width(n, (_rows(x, n), weight.reshape(-1).contiguous() if weight is not None else None,
                           _rows(residual, n) if residual is not None else None), x.element_size())
    if options.vector_bytes:
        vec = max(1, min(vec, options.vector_bytes // x.element_size()))
    if options.bulk:
        return bulk_plan(n, vec, x.element_size(), residual is not None, options)
    max_vectors = MAX_VECTORS_PER_THREAD if vec * x.element_size() == 16 else NARROW_MAX_ELEMENTS // vec
    return forward_plan(n, vec, m, sm_count, max_vectors, residual is not None, options)


def plan_of(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, residual: Optional["torch.Tensor"] = None,
            normalized_shape: Optional[Sequence[int]] = None, options: Optional[ForwardOptions] = None) -> RowPlan:
    """The plan ``rms_norm_forward`` follows for these arguments (raises as it does)."""
    m, n = _check(x, weight, residual, None, normalized_shape)
    return _forward_plan_of(x, weight, residual, m, n, driver.plan_sm_count(x.get_device()), _check_options(options))


def _check_options(options: Any) -> ForwardOptions:
    """``options``, None meaning the defaults (ForwardOptions checks its own fields)."""
    if options is None:
        return ForwardOptions()
    if not isinstance(options, ForwardOptions):
        raise ValueError(f"options: expected None or rmsnorm.ForwardOptions, got {type(options).__name__}")
    return options


def rms_norm(x: "torch.Tensor", weight: Optional["torch.Tensor"] = None, eps: Optional[float] = None,
             residual: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None) -> Any:
    """RMSNorm over the last dimensions (``normalized_shape``, default: the weight's shape or the last one).

    Returns ``y``, or ``(y, x + residual)`` when ``residual`` is given. ``eps=None`` means the fp32 epsilon
    (as torch). Any row length and row stride; fp32 math for bf16/fp16/fp32 inputs.
    """
    y, residual_out, _ = rms_norm_forward(x, weight, eps, residual, normalized_shape, want_rstd=False)
    return y if residual is None else (y, residual_out)


def rms_norm_backward(grad_out: "torch.Tensor", x: "torch.Tensor", rstd: "torch.Tensor",
                      weight: Optional["torch.Tensor"] = None, normalized_shape: Optional[Sequence[int]] = None,
                      grad_residual: Optional["torch.Tensor"] = None, needs_weight_grad: bool = True
                      ) -> tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """(grad_x, grad_weight or None) of ``y = rms_norm(x, weight)`` given ``rstd`` from the forward.

    ``x`` is the normalised input (``x + residual`` for the fused variant); ``grad_residual``, the gradient that
    reached the ``x + residual`` output, is added to ``grad_x`` (which is then also the residual's gradient).
    """
    try:
        key = (layout_key(grad_out), layout_key(x), layout_key(rstd), layout_key(weight), layout_key(grad_residual),
               normalized_shape if normalized_shape is None else tuple(normalized_shape), bool(needs_weight_grad))
        b = _BACKWARD.get(key)
    except Exception:  # noqa: BLE001 - not tensors, an unhashable argument: the checks explain
        key = b = None
    if b is None:
        b = _backward_plan(key, grad_out, x, rstd, weight, normalized_shape, grad_residual, needs_weight_grad)
    import torch
    if b.launch is None:  # nothing to launch
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if grad_residual is not None:
            grad_x.copy_(grad_residual)
        return grad_x, torch.zeros_like(weight) if b.needs_weight_grad else None
    m, n = b.m, b.n
    if b.direct:
        dy2, x2, dr2, grad_x = grad_out, x, grad_residual, torch.empty_like(x)
        grad_x2 = grad_x
    else:
        dy2, x2 = _rows(grad_out, n), _rows(x, n)
        dr2 = _rows(grad_residual, n) if grad_residual is not None else None
        grad_x = torch.empty(b.shape, dtype=x.dtype, device=x.device)
        grad_x2 = grad_x.view(m, n)
    w = (weight if b.weight_flat else weight.reshape(-1).contiguous()) if weight is not None else x2
    partial = torch.empty(b.partial_shape, dtype=torch.float32, device=x.device) if b.needs_weight_grad else x2
    b.launch.launch(dy2, x2, w, rstd if b.rstd_flat else rstd.reshape(-1), x2 if dr2 is None else dr2, grad_x2,
                    partial, *b.tail)
    if not b.needs_weight_grad:
        return grad_x, None
    grad_w = torch.empty(n, dtype=weight.dtype, device=x.device)
    b.column_sum.launch(partial, grad_w, *b.column_sum_tail)
    return grad_x, grad_w if b.weight_flat else grad_w.view(weight.shape)


@dataclass
class _Backward:
    """A backward call's plan (see _Forward); ``partial_shape`` is that of the per-block weight-gradient sums."""
    m: int
    n: int
    shape: tuple[int, ...]
    direct: bool
    weight_flat: bool   # the weight is a contiguous 1-D tensor (passed as it is; its gradient needs no view)
    rstd_flat: bool
    needs_weight_grad: bool
    launch: Optional[nvfly.PreparedLaunch]
    tail: tuple = ()
    partial_shape: tuple[int, int] = (0, 0)
    column_sum: Optional[nvfly.PreparedLaunch] = None
    column_sum_tail: tuple = ()


def _backward_plan(key: Any, grad_out: Any, x: Any, rstd: Any, weight: Any,
                   normalized_shape: Optional[Sequence[int]], grad_residual: Any, needs_weight_grad: Any) -> _Backward:
    """The first call of a key: the checks (they raise), then the plan, remembered under ``key``."""
    import torch
    m, n = _check(x, weight, grad_residual, None, normalized_shape)
    if not _is_tensor(grad_out) or grad_out.shape != x.shape or grad_out.device != x.device:
        raise ValueError(f"grad_out: expected a tensor of shape {tuple(x.shape)} on {x.device}")
    if not _is_tensor(rstd) or rstd.numel() != m or rstd.dtype != torch.float32:
        raise ValueError(f"rstd: expected {m} float32 values (one per row), got "
                         f"{getattr(rstd, 'dtype', type(rstd).__name__)} with {getattr(rstd, 'shape', '?')}")
    needs_weight_grad = bool(needs_weight_grad) and weight is not None
    weight_flat = weight is not None and weight.dim() == 1 and weight.is_contiguous()
    rstd_flat = rstd.dim() == 1  # as rstd.reshape(-1) would be
    b = _Backward(m, n, tuple(x.shape), False, weight_flat, rstd_flat, needs_weight_grad, None)
    if m == 0 or n == 0:
        _remember(_BACKWARD, key, b)
        return b
    dy2, x2 = _rows(grad_out, n), _rows(x, n)
    dr2 = _rows(grad_residual, n) if grad_residual is not None else None
    w = weight.reshape(-1).contiguous() if weight is not None else None
    vec = vector_width(n, (dy2, x2, dr2, w), x.element_size())
    reason = _backward_size_reason(n, vec)
    if reason is not None:
        raise ValueError(f"x: {reason}")
    sms = driver.plan_sm_count(x.get_device())
    p = plan(n, vec, m, sms, BACKWARD_VECTORS_PER_THREAD, max(1, BACKWARD_MAX_ELEMENTS // vec), 1024,
             BACKWARD_ROW_BLOCK_THREADS)
    # persistent: about two blocks per SM, each accumulating its own weight-gradient partial rows
    grid = min(-(-m // p.rows), 2 * sms)
    padded_n = -(-n // COLUMN_SUM_COLS) * COLUMN_SUM_COLS
    b.direct = _is_rows(x, m, n) and _is_rows(grad_out, m, n) and \
        (grad_residual is None or _is_rows(grad_residual, m, n))
    b.launch = rms_norm_backward_kernel.prepared(grid, p.threads)
    b.tail = (m, n, vec, p.group, p.rows, weight is not None, grad_residual is not None, needs_weight_grad)
    b.partial_shape = (grid * p.rows, padded_n)
    if needs_weight_grad:
        b.column_sum = column_sum_kernel.prepared(padded_n // COLUMN_SUM_COLS, 256)
        b.column_sum_tail = (grid * p.rows, n)
    _remember(_BACKWARD, key, b)
    return b
