"""RMSNorm forward and backward, with an optional weight and a fused residual add, at the memory roofline.

``y = x * rsqrt(mean(x**2) + eps) * weight`` over the last dimensions, in fp32 whatever the storage type
(bf16, fp16 or fp32); ``y`` takes the input's dtype. With ``residual``, ``h = x + residual`` is rounded to the
input's dtype (as the unfused ``x + residual`` would be), written out, and normalised.

Design (forward, the row-in-registers kernel):
- a row of N elements is owned by a group of ``GROUP`` threads (a power of two, up to 1024); each thread holds
  ``ceil(N / (GROUP*VEC))`` 16-byte vectors of the row in registers (at most 8, 16 for the longest rows), so
  the row is read from memory once and written once: 2 (3 with the residual add) bytes per element moved.
- ``GROUP`` grows with N so that every thread has about 8 vectors in flight; small rows are packed
  ``256 // GROUP`` to a block (a warp or less per row, a shuffle-only reduction), long rows get a block each
  with a shared-memory step across warps.
- rows that do not fit the registers (N > 1024*16*VEC) use a looped kernel that reads the row twice.
Backward keeps the weight in registers and loops persistently over rows, accumulating each block's weight
gradient in registers; one small kernel then sums the per-block partials.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

import nvfly

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
MAX_VECTORS_PER_THREAD = 16     # registers hold at most this many 16-byte vectors of a row per thread
TARGET_VECTORS_PER_THREAD = 8   # enough bytes in flight per thread to cover memory latency
BACKWARD_VECTORS_PER_THREAD = 4  # backward also keeps dy, the weight and the weight-gradient sums in registers
ROW_BLOCK_THREADS = 256         # threads of a block that packs several short rows
LOOPED_THREADS = 1024           # the looped kernel for rows too long for registers
COLUMN_SUM_COLS = 32            # columns per block of the weight-gradient partial sum


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


# ---------------------------------------------------------------------------------------------- forward kernels
@nvfly.kernel
def rms_norm_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                    residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, M: nvfly.i32, eps: nvfly.f32,
                    N: nvfly.Constexpr, VEC: nvfly.Constexpr, GROUP: nvfly.Constexpr, ROWS: nvfly.Constexpr,
                    HAS_WEIGHT: nvfly.Constexpr, HAS_RESIDUAL: nvfly.Constexpr, HAS_RSTD: nvfly.Constexpr):
    """One row per GROUP threads, the row held in registers: one read and one write per element."""
    row, valid, lane, group, warp, warp_lane = row_layout(M, GROUP, ROWS)
    vectors = (N + GROUP * VEC - 1) // (GROUP * VEC)
    tail = N % (GROUP * VEC) != 0   # only the last vector of each thread may fall past the row end
    # issue every load first: the row, the residual and the weight are all in flight together
    xs = []
    ws = []
    for v in nvfly.static_range(vectors):
        col = (v * GROUP + lane) * VEC
        in_row = col < N if tail and v == vectors - 1 else None
        xv = x.load(row, col, width=VEC, mask=in_row)
        if HAS_RESIDUAL:
            # h = x + residual, rounded to the storage type like the unfused add
            xv = (xv.to(nvfly.f32) + residual.load(row, col, width=VEC, mask=in_row).to(nvfly.f32)).to(x.dtype)
        xs.append(xv)
        if HAS_WEIGHT:
            ws.append(weight.load(col, width=VEC, mask=in_row))
    squares = nvfly.full(VEC, 0.0, nvfly.f32)
    for v in nvfly.static_range(vectors):
        xf = xs[v].to(nvfly.f32)
        squares = nvfly.fma(xf, xf, squares)
    scratch = nvfly.shared_tensor(nvfly.f32, (max(1, ROWS * GROUP // 32),))
    total = group_sum(squares.sum(), scratch, 0, group, warp, warp_lane, GROUP)
    rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
    for v in nvfly.static_range(vectors):
        col = (v * GROUP + lane) * VEC
        keep = valid & (col < N) if tail and v == vectors - 1 else valid
        out = xs[v].to(nvfly.f32) * rstd
        if HAS_WEIGHT:
            out = out * ws[v].to(nvfly.f32)
        y.store(out.to(y.dtype), row, col, mask=keep)
        if HAS_RESIDUAL:
            residual_out.store(xs[v], row, col, mask=keep)
    if HAS_RSTD:
        if valid & (lane == 0):
            rstd_out[row] = rstd


@nvfly.kernel
def rms_norm_looped_kernel(x: nvfly.Tensor, weight: nvfly.Tensor, residual: nvfly.Tensor, y: nvfly.Tensor,
                           residual_out: nvfly.Tensor, rstd_out: nvfly.Tensor, eps: nvfly.f32,
                           N: nvfly.Constexpr, VEC: nvfly.Constexpr, THREADS: nvfly.Constexpr,
                           HAS_WEIGHT: nvfly.Constexpr, HAS_RESIDUAL: nvfly.Constexpr, HAS_RSTD: nvfly.Constexpr):
    """One block per row for rows too long for registers: the first pass sums squares (and writes x + r),
    the second reads the row again (mostly from L2) and writes y."""
    row = nvfly.block_idx.x
    tid = nvfly.thread_idx.x
    squares = nvfly.full(VEC, 0.0, nvfly.f32)
    for col in range(tid * VEC, N, THREADS * VEC):
        xv = x.load(row, col, width=VEC)
        if HAS_RESIDUAL:
            xv = (xv.to(nvfly.f32) + residual.load(row, col, width=VEC).to(nvfly.f32)).to(x.dtype)
            residual_out.store(xv, row, col)
        xf = xv.to(nvfly.f32)
        squares = nvfly.fma(xf, xf, squares)
    scratch = nvfly.shared_tensor(nvfly.f32, (THREADS // 32,))
    total = group_sum(squares.sum(), scratch, 0, 0, tid >> 5, tid & 31, THREADS)
    rstd = nvfly.rsqrt(total * (1.0 / N) + eps)
    for col in range(tid * VEC, N, THREADS * VEC):
        # the same thread wrote these residual_out elements in the first pass, so it reads its own writes
        xv = residual_out.load(row, col, width=VEC) if HAS_RESIDUAL else x.load(row, col, width=VEC)
        out = xv.to(nvfly.f32) * rstd
        if HAS_WEIGHT:
            out = out * weight.load(col, width=VEC).to(nvfly.f32)
        y.store(out.to(y.dtype), row, col)
    if HAS_RSTD:
        if tid == 0:
            rstd_out[row] = rstd


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
    the barriers of the group sum are reached by every thread."""
    tid = nvfly.thread_idx.x
    lane = tid & (GROUP - 1)
    group = tid >> int(math.log2(GROUP))
    warp = tid >> 5
    vectors = (N + GROUP * VEC - 1) // (GROUP * VEC)
    tail = N % (GROUP * VEC) != 0
    ws = []
    weight_sums = []
    for v in nvfly.static_range(vectors):
        col = (v * GROUP + lane) * VEC
        in_row = col < N if tail and v == vectors - 1 else None
        if HAS_WEIGHT:
            ws.append(weight.load(col, width=VEC, mask=in_row).to(nvfly.f32))
        weight_sums.append(nvfly.full(VEC, 0.0, nvfly.f32))
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
        dys = []
        xhats = []
        dot = nvfly.full(VEC, 0.0, nvfly.f32)
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            in_row = col < N if tail and v == vectors - 1 else None
            dy = grad_out.load(row, col, width=VEC, mask=in_row).to(nvfly.f32)
            xhat = x.load(row, col, width=VEC, mask=in_row).to(nvfly.f32) * r
            g = dy * ws[v] if HAS_WEIGHT else dy
            dot = nvfly.fma(g, xhat, dot)
            dys.append(dy)
            xhats.append(xhat)
        total = group_sum(dot.sum(), scratch, parity * slots, group, warp, tid & 31, GROUP)
        mean_dot = total * (1.0 / N)
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            keep = valid & (col < N) if tail and v == vectors - 1 else valid
            g = dys[v] * ws[v] if HAS_WEIGHT else dys[v]
            dx = (g - xhats[v] * mean_dot) * r
            if HAS_GRAD_RESIDUAL:
                dx = dx + grad_residual.load(row, col, width=VEC, mask=keep).to(nvfly.f32)
            grad_x.store(dx.to(grad_x.dtype), row, col, mask=keep)
            if NEEDS_WEIGHT_GRAD:
                weight_sums[v] = weight_sums[v] + nvfly.select(valid, dys[v] * xhats[v], 0.0)
        parity = parity ^ 1
    if NEEDS_WEIGHT_GRAD:
        partial_row = nvfly.block_idx.x * ROWS + group
        for v in nvfly.static_range(vectors):
            col = (v * GROUP + lane) * VEC
            in_row = col < N if tail and v == vectors - 1 else None
            weight_grad_partial.store(weight_sums[v], partial_row, col, mask=in_row)
