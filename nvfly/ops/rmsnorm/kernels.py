"""RMSNorm's kernels: the forward's row-in-registers, persistent, two-pass and bulk-copy kernels, the backward and
its weight-gradient column sum (plan.py chooses among them; docs/ops/rmsnorm.md has the measurements).

Forward, the row-in-registers kernel:
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
  when there are many (TWO_PASS_MIN_ROW_BYTES, TWO_PASS_MIN_ROWS, past the persistent kernel's rows), where it ties
  Inductor; and for the counts of long rows too few to give each persistent block PERSISTENT_MIN_TILES tiles.
- the bulk-copy kernel (``ForwardOptions(bulk=True)``, opt-in: slower, docs/ops/rmsnorm.md): a persistent block
  streams its rows into a shared-memory ring with one cp.async.bulk a row and normalises them from there.
Backward loops persistently over rows (about two blocks per SM), accumulating each block's weight gradient in
registers; dy and x are read once from memory and once more from L1/L2 after the row's reduction. One small
kernel then sums the per-block partials of the weight gradient.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import nvfly
from nvfly.arch import sm90
from nvfly.arch.memory import CacheHint, load_hinted, store_hinted
from nvfly.arch.ptx import smem_address
from nvfly.arch.reduce import block_reduce, group_reduce
from nvfly.ops.rmsnorm.hints import row_hints, two_pass_hints
from nvfly.ops.rmsnorm.plan import (BULK_BARRIER_BYTES, FULL_SM_REGISTERS, SM_MAX_WARPS, bulk_row_bytes,
                                    bulk_stage_bytes, two_pass_registers)


# ---------------------------------------------------------------------------------------------- row helpers
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


def row_vectors(N: int, VEC: int, GROUP: int) -> tuple[int, bool]:
    """(vectors per thread, whether the last one may fall past the row end)."""
    return -(-N // (GROUP * VEC)), N % (GROUP * VEC) != 0


def load_row(t: Any, row: Any, lane: Any, mask: Any, N: int, VEC: int, GROUP: int, hint: Optional[CacheHint]) -> list:
    """This thread's vectors of ``t``'s row ``row`` (of a 1-D ``t`` when ``row`` is None): columns
    ``(v * GROUP + lane) * VEC``; nothing is read past the row end or where ``mask`` (None: anywhere) is false."""
    vectors, tail = row_vectors(N, VEC, GROUP)
    out = []
    for v in range(vectors):
        col = (v * GROUP + lane) * VEC
        in_row = mask
        if tail and v == vectors - 1:
            in_row = col < N if mask is None else mask & (col < N)
        out.append(load_hinted(t, (col,) if row is None else (row, col), VEC, in_row, hint))
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
              hint: Optional[CacheHint]) -> None:
    """This thread's vectors ``xs`` to ``t``'s row ``row``; nothing past the row end or where ``valid`` is false."""
    vectors, tail = row_vectors(N, VEC, GROUP)
    for v in range(vectors):
        col = (v * GROUP + lane) * VEC
        store_hinted(t, xs[v], (row, col), VEC, valid & (col < N) if tail and v == vectors - 1 else valid, hint)


def normalize_row(y: Any, residual_out: Any, xs: list, weights: Optional[list], weight: Any, rstd: Any, row: Any,
                  lane: Any, valid: Any, N: int, VEC: int, GROUP: int,
                  hints: tuple[Optional[CacheHint], Optional[CacheHint], Optional[CacheHint]]) -> None:
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
            w = load_hinted(weight, (col,), VEC, keep if tail and v == vectors - 1 else None, keep_hint)
            out = out * w.to(nvfly.f32)
        store_hinted(y, out, (row, col), VEC, keep, store_hint)
        if residual_out is not None:
            store_hinted(residual_out, xs[v], (row, col), VEC, keep, store_hint)


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
    total = group_reduce(square_sum(xs, VEC), scratch, 0, group, warp, warp_lane, GROUP)
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
        total = group_reduce(square_sum(xs, VEC), scratch, parity * slots, group, warp, tid & 31, GROUP)
        rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
        normalize_row(y, None, xs, weights, None, rstd, row, lane, valid, N, VEC, GROUP, hints)
        if HAS_RSTD:
            if valid & (lane == 0):
                rstd_out[row] = rstd
        parity = parity ^ 1


# Cache hints of the two-pass kernel (RowPlan.cache_hints): the first pass keeps x's (and the residual's) lines
# ---------------------------------------------------------------------------------------------- two-pass kernel
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


def load_step(t: Any, row: Any, columns: list, VEC: int, hint: Optional[CacheHint]) -> list:
    """``t``'s vectors at ``columns`` (of ``step_columns``) of row ``row`` (of a 1-D ``t`` when None)."""
    return [load_hinted(t, (col,) if row is None else (row, col), VEC, mask, hint) for col, mask in columns]


def square_step(x: Any, residual: Any, row: Any, columns: list, squares: Any, VEC: int, HAS_RESIDUAL: bool,
                hint: Optional[CacheHint]) -> Any:
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
        store_hinted(y, out, (row, col), VEC, mask, store_hint)
        if HAS_RESIDUAL:
            store_hinted(residual_out, xs[v], (row, col), VEC, mask, store_hint)


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
        nvfly.no_unroll()  # ptxas would unroll the steps past the register budget (spills)
        squares = square_step(x, residual, row, step_columns(base, lane, N, VEC, THREADS, VECTORS), squares, VEC,
                              HAS_RESIDUAL, hints[0])
    if whole < N:
        squares = square_step(x, residual, row, step_columns(whole, lane, N, VEC, THREADS, VECTORS), squares, VEC,
                              HAS_RESIDUAL, hints[0])
    scratch = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    rstd = nvfly.rsqrt(block_reduce(squares.sum(), scratch, THREADS) * (1.0 / N) + eps)
    for base in range(0, whole, step):
        nvfly.no_unroll()  # ptxas would unroll the steps past the register budget (spills)
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
        nvfly.no_unroll()  # an unrolled copy of the row's vectors would double the registers
        sm90.mbarrier_wait(bars + state.stage * 8, state.phase)
        xs = load_row(ring, state.stage * (1 + HAS_RESIDUAL), tid, None, N, VEC, THREADS, None)
        if HAS_RESIDUAL:
            xs = add_residual(xs, load_row(ring, state.stage * 2 + 1, tid, None, N, VEC, THREADS, None))
        total = group_reduce(square_sum(xs, VEC), scratch, parity * (THREADS // 32), 0, tid >> 5, tid & 31, THREADS)
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
        mean_dot = group_reduce(dot.sum(), scratch, parity * slots, group, warp, tid & 31, GROUP) * r * (1.0 / N)
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
