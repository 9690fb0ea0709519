"""The split-KV combine: each query row's split partials (normalised f32 O_s and LSE_s) merged into its output.

With m = max_s LSE_s and w_s = e^(LSE_s - m): O = Σ w_s O_s / Σ w_s and LSE = m + log Σ w_s; an empty split
has LSE_s = -inf (weight 0) and a row every split found empty gets zeros and LSE = -inf.

One warp per (row, column chunk) of ``chunk_columns(DV)`` columns (128, or 64 where 128 does not divide DV), 4 warps
a CTA: a row's chunks are neighbouring warps, so a row of 512 columns takes a CTA of 4 and its reads spread over
more SMs than one warp a row did. Lane l holds the chunk's columns l * chunk / 32 .. (one 16- or 8-byte load a
split); the splits are read ``UNROLL`` at a time, their loads issued together, so a row of many splits (MLA at B 1
splits 32K keys about 60 ways) waits on the memory latency splits / UNROLL times rather than once per split.
"""
from __future__ import annotations

from typing import Any, Optional

import nvfly
from nvfly.ops.attention.softmax import LOG2E, NEG_INF

WARPS = 4
UNROLL = 8


def chunk_columns(dv: int) -> int:
    """Columns of a warp's chunk: 128 (4 a lane) where they divide Dv, else 64 (Dv 64 and 192)."""
    return 128 if dv % 128 == 0 else 64


def combine_grid(rows: int, dv: int) -> int:
    """CTAs of the combine of ``rows`` query rows of ``dv`` columns (WARPS warps a CTA, a warp a row's chunk)."""
    return -(-rows * (dv // chunk_columns(dv)) // WARPS)


@nvfly.func
def merge(acc, total, partial_o, partial_lse, first, count, rows, row, column, reference, PER_LANE):
    """``acc`` and ``total`` with splits first .. first + count - 1 (count static) added: their loads first."""
    lses = [partial_lse[(first + u) * rows + row] for u in nvfly.static_range(count)]
    parts = [partial_o.load((first + u) * rows + row, column, width=PER_LANE) for u in nvfly.static_range(count)]
    for u in nvfly.static_range(count):
        weight = nvfly.exp2((lses[u] - reference) * LOG2E)
        total = total + weight
        acc = acc + parts[u] * weight
    return acc, total


@nvfly.kernel
def attention_combine_kernel(partial_o: nvfly.Tensor, partial_lse: nvfly.Tensor, out, lse, rows: nvfly.i32,
                             heads: nvfly.i32, splits: nvfly.i32, SQ: nvfly.Constexpr, DV: nvfly.Constexpr,
                             DEPENDENT: nvfly.Constexpr = False):
    """partial_o [splits * rows, DV], partial_lse [splits * rows] (f32; row ((split * B + b) * SQ + token) * heads
    + head) into out [B, SQ, heads, DV] and lse [B, heads, SQ] (f32, natural log; None: not wanted). DEPENDENT:
    launched as the split kernel's programmatic dependent (``pdl_combine``): the CTAs may start while it runs and
    wait for its end (its partials) after their index math."""
    CHUNK = chunk_columns(DV)
    CHUNKS = DV // CHUNK
    PER_LANE = CHUNK // 32
    lane = nvfly.lane_idx()
    item = nvfly.block_idx.x * WARPS + nvfly.warp_idx()
    row = item // CHUNKS
    if DEPENDENT:  # nothing before this reads what the split kernel writes
        nvfly.wait_prior_grid()
    if row < rows:
        top = nvfly.f32(NEG_INF)
        for s in range(lane, splits, 32):
            top = nvfly.maximum(top, partial_lse[s * rows + row])
        top = nvfly.warp_reduce(top, "max")
        reference = nvfly.select(top == NEG_INF, 0.0, top)
        column = (item % CHUNKS) * CHUNK + lane * PER_LANE
        acc = nvfly.full(PER_LANE, 0.0, nvfly.f32)
        total = nvfly.f32(0.0)
        whole = splits // UNROLL * UNROLL
        for first in range(0, whole, UNROLL):
            acc, total = merge(acc, total, partial_o, partial_lse, first, UNROLL, rows, row, column, reference,
                               PER_LANE)
        for first in range(whole, splits):
            acc, total = merge(acc, total, partial_o, partial_lse, first, 1, rows, row, column, reference, PER_LANE)
        kept = total > 0.0
        inverse = nvfly.select(kept, 1.0 / nvfly.maximum(total, 1e-30), 0.0)
        b = row // (SQ * heads)
        token = (row // heads) % SQ
        head = row % heads
        out.store((acc * inverse).to(out.dtype), b, token, head, column)
        if lse is not None:
            if lane == 0 and item % CHUNKS == 0:
                lse[b, head, token] = nvfly.select(kept, reference + nvfly.log(nvfly.maximum(total, 1e-30)), NEG_INF)


def prepared_combine(rows: int, dv: int) -> Any:
    """A prepared launch of the combine of ``rows`` query rows of ``dv`` columns (for ``launch_combine``)."""
    return attention_combine_kernel.prepared(combine_grid(rows, dv), WARPS * 32)


def launch_combine(prepared: Optional[Any], partial_o: Any, partial_lse: Any, out: Any, lse: Any, rows: int,
                   heads: int, splits: int, sq: int, dv: int, dependent: bool) -> None:
    """The combine of a split launch's partials (the kernel's arguments): through ``prepared``
    (``prepared_combine(rows, dv)``) when given, else the kernels' general launch path."""
    if prepared is not None:
        prepared(partial_o, partial_lse, out, lse, rows, heads, splits, sq, dv, dependent)
    else:
        attention_combine_kernel[combine_grid(rows, dv), WARPS * 32](partial_o, partial_lse, out, lse, rows, heads,
                                                                     splits, SQ=sq, DV=dv, DEPENDENT=dependent)


def compile_combine(partial_o: Any, partial_lse: Any, out: Any, lse: Any, rows: int, heads: int, splits: int,
                    sq: int, dv: int, dependent: bool, target: str) -> Any:
    """The combine compiled without a GPU for tensor descriptions of its arguments (the compile helpers' tests)."""
    return attention_combine_kernel.compile(partial_o, partial_lse, out, lse, rows, heads, splits, SQ=sq, DV=dv,
                                            DEPENDENT=dependent, block=WARPS * 32, target=target)
