"""Warp and block helpers of the TopK kernels, and their GPU-scope memory operations as raw PTX.

Generic pieces (reductions and scans over a warp or a block, ballot / lane masks / bit counts, relaxed and acquire
global accesses, GPU-scope atomics) kept apart from the TopK logic so that shared versions (``nvfly.arch``, the
language) can replace them in one place: nothing here knows about ranks, keys or plans.
"""
from __future__ import annotations

from typing import Any, Callable

import nvfly
from nvfly.arch.ptx import asm, asm_multi
from nvfly.frontend.language import redux_sync


# ---------------------------------------------------------------------------------------------- reductions and scans
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


# ---------------------------------------------------------------------------------------------- votes and bits
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
def lanemask_lt():
    """The lanes below this one, as a u32 bit mask (``%lanemask_lt``)."""
    return asm("mov.u32 $0, %lanemask_lt;", [], nvfly.u32, side_effects=False)


# ---------------------------------------------------------------------------------------------- GPU-scope memory
def red_add_u32(address: Any, value: Any) -> None:
    asm("red.relaxed.gpu.global.add.u32 [$0], $1;", [address, value])


def atom_add_relaxed_u32(address: Any, value: Any) -> Any:
    return asm("atom.relaxed.gpu.global.add.u32 $0, [$1], $2;", [address, value], nvfly.i32)


def load_relaxed_i32(address: Any) -> Any:
    return asm("ld.relaxed.gpu.global.b32 $0, [$1];", [address], nvfly.i32)


def load_relaxed_i64x2(address: Any) -> list[Any]:
    """Two i64 from the 16-byte aligned ``address`` (relaxed, GPU scope)."""
    return asm_multi("ld.relaxed.gpu.global.v2.b64 {$0, $1}, [$2];", [nvfly.i64, nvfly.i64], [address])


def load_acquire_i32(address: Any) -> Any:
    return asm("ld.acquire.gpu.global.b32 $0, [$1];", [address], nvfly.i32)
