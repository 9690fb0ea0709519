"""Reductions and scans over a warp, a group of threads and a block, with the ops ``add``, ``max`` and ``min``.

- ``tree_reduce``: a thread's own values, pairwise (log2(n) dependent steps).
- ``warp_scan``: prefix (lanes at and below) or suffix (lanes at and above) scans over a warp by shuffles,
  inclusive or exclusive; ``warp_max_i64``: a 64-bit max over a warp in two ``redux.sync``. A butterfly reduction
  over a warp is the language's ``nvfly.warp_reduce``.
- ``group_reduce`` / ``block_reduce``: every thread of a group of threads / of the block gets the total (warp
  shuffles, then the warps' partial results through shared memory after one barrier); ``block_scan``: a scan over
  the block's threads in thread order (one barrier); ``block_reduce_many``: several values' block totals behind one
  barrier.

Every thread of the block must call the group and block helpers (they hold a barrier).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

from nvfly.errors import CompileError
from nvfly.frontend import dtypes
from nvfly.frontend.dtypes import DType
from nvfly.frontend.function import DeviceFunction
from nvfly.frontend.language import (maximum, minimum, redux_sync, select, shfl_down, shfl_up, static_range,
                                     syncthreads, thread_idx, warp_reduce)
from nvfly.frontend.tensor import Tensor
from nvfly.frontend.trace import traced
from nvfly.frontend.values import Scalar, as_value

OPS: dict[str, Callable[[Any, Any], Any]] = {"add": operator.add, "max": maximum, "min": minimum}


def combine_of(op: str) -> Callable[[Any, Any], Any]:
    """The binary function of reduction op ``op`` (add, max, min)."""
    if op not in OPS:
        raise CompileError(f"reduction op must be one of {', '.join(OPS)}; got {op!r}")
    return OPS[op]


def identity_of(op: str, dtype: DType) -> int | float:
    """The value that ``op`` leaves unchanged, for ``dtype``: what lanes and threads outside a scan or a
    reduction contribute (0; -inf / +inf for a float max / min; the integer type's extremes)."""
    combine_of(op)
    if op == "add":
        return 0
    if dtype.is_float:
        return -math.inf if op == "max" else math.inf
    if dtype.is_signed:
        low, high = -(1 << (dtype.bits - 1)), (1 << (dtype.bits - 1)) - 1
    else:
        low, high = 0, (1 << dtype.bits) - 1
    return low if op == "max" else high


def tree_reduce(values: Sequence[Any], combine: Callable[[Any, Any], Any]) -> Any:
    """``values`` combined by a tree of pairwise ``combine``: log2(n) dependent steps, not n - 1 (a 64-bit
    maximum is four dependent instructions)."""
    if not values:
        raise CompileError("tree_reduce needs at least one value")
    values = list(values)
    while len(values) > 1:
        values = [combine(a, b) for a, b in zip(values[::2], values[1::2])] + values[len(values) & ~1:]
    return values[0]


def _scalar(what: str, value: Any) -> Scalar:
    v = as_value(value)
    if not isinstance(v, Scalar):
        raise CompileError(f"{what} takes a scalar, got {v}")
    return v


def _exclusive(inclusive: Any, value: Scalar, lane: Any, op: str, reverse: bool) -> Any:
    """The exclusive scan from the inclusive one: for integer sums one subtraction, else the neighbour lane's
    inclusive result (the identity at the warp's end)."""
    if op == "add" and value.dtype.is_int:
        return inclusive - value
    if reverse:
        moved = shfl_down(inclusive, 1)
        return select(lane + 1 < 32, moved, identity_of(op, value.dtype))
    moved = shfl_up(inclusive, 1)
    return select(lane >= 1, moved, identity_of(op, value.dtype))


@traced
def warp_scan(value: Any, lane: Any, op: str = "add", exclusive: bool = False, reverse: bool = False) -> Any:
    """Scan of ``value`` over the lanes of a (whole, converged) warp, ``lane`` being this lane's index: the
    ``op`` of the lanes at and below this one (prefix), or with ``reverse`` at and above it (suffix); with
    ``exclusive`` this lane left out (the identity where no lane is left). 5 shuffles (``shfl.sync.up`` /
    ``shfl.sync.down``)."""
    combine = combine_of(op)
    v = _scalar("warp_scan", value)
    identity = identity_of(op, v.dtype)
    scan: Any = v
    for step in static_range(5):
        if reverse:
            moved = shfl_down(scan, 1 << step)
            scan = combine(scan, select(lane + (1 << step) < 32, moved, identity))
        else:
            moved = shfl_up(scan, 1 << step)
            scan = combine(scan, select(lane >= (1 << step), moved, identity))
    return _exclusive(scan, v, lane, op, reverse) if exclusive else scan


@traced
def warp_max_i64(value: Any) -> Scalar:
    """The largest i64 of the (whole, converged) warp in every lane: two ``redux.sync`` (the high words, then the
    low words of the lanes that hold the highest) instead of five rounds of 64-bit shuffles and compares."""
    v = _scalar("warp_max_i64", value)
    if v.dtype != dtypes.i64:
        raise CompileError(f"warp_max_i64 takes an i64, got {v.dtype.name}")
    high = (v >> 32).to(dtypes.i32)
    top = redux_sync(high, "max")
    low = redux_sync(select(high == top, v.to(dtypes.i32).bitcast(dtypes.u32), dtypes.u32(0)), "max")
    return (top.to(dtypes.i64) << 32) | low.to(dtypes.i64)


def _check_count(what: str, count: Any, fits: Callable[[int], bool], expected: str) -> None:
    """A CompileError unless ``count`` is a Python int for which ``fits`` holds."""
    if isinstance(count, bool) or not isinstance(count, int) or not fits(count):
        raise CompileError(f"{what}: expected {expected} (a Python int), got {count!r}")


@DeviceFunction
def group_reduce(value: Any, scratch: Tensor, base: Any, group: Any, warp: Any, lane: Any, GROUP: int,
                 op: str = "add") -> Any:
    """``op`` of ``value`` over the GROUP threads (a power of two; consecutive threads) of group ``group``; every
    thread of the group gets the result. Butterfly shuffles (``shfl.sync.bfly``); for GROUP > 32 also the
    GROUP // 32 warps' results through ``scratch[base : base + warps of the block]`` after a barrier
    (``bar.sync``; ``warp``, ``lane``: the thread's warp and lane in the block)."""
    _check_count("group_reduce GROUP", GROUP, lambda n: n > 0 and n & (n - 1) == 0, "a power of two")
    combine = combine_of(op)
    if GROUP <= 32:
        total = warp_reduce(value, op, GROUP)
    else:
        value = warp_reduce(value, op)
        if lane == 0:
            scratch[base + warp] = value
        syncthreads()
        first = base + group * (GROUP // 32)
        total = scratch[first]
        for w in static_range(1, GROUP // 32):
            total = combine(total, scratch[first + w])
    return total


@DeviceFunction
def block_reduce(value: Any, scratch: Tensor, THREADS: int, op: str = "add") -> Any:
    """``op`` of ``value`` over the block's THREADS threads (whole warps); every thread gets the result. One
    barrier (``bar.sync``): each warp combines the warps' results from ``scratch`` (THREADS // 32 slots) with
    butterfly shuffles (``shfl.sync.bfly``) over the next power of two of lanes, the lanes past the last warp
    adding the identity."""
    _check_count("block_reduce THREADS", THREADS, lambda n: 0 < n <= 1024 and n % 32 == 0, "whole warps")
    identity = identity_of(op, as_value(value).dtype)
    warps = THREADS // 32
    width = 1 << (warps - 1).bit_length()
    tid = thread_idx.x
    lane = tid & 31
    value = warp_reduce(value, op)
    if lane == 0:
        scratch[tid >> 5] = value
    syncthreads()
    slot = lane & (width - 1)
    if warps == width:
        return warp_reduce(scratch[slot], op, width)
    return warp_reduce(select(slot < warps, scratch[minimum(slot, warps - 1)], identity), op, width)


@DeviceFunction
def block_scan(value: Any, warp_totals: Tensor, lane: Any, warp: Any, WARPS: int, op: str = "add",
               exclusive: bool = False, reverse: bool = False) -> Any:
    """Scan of ``value`` over the block's WARPS warps in thread order (``warp_scan``'s prefix / suffix, inclusive
    / exclusive): the warp's scan (``shfl.sync.up`` / ``.down``), then the other warps' totals through
    ``warp_totals[:WARPS]`` after one barrier (``bar.sync``)."""
    _check_count("block_scan WARPS", WARPS, lambda n: 1 <= n <= 32, "1 to 32 warps")
    combine = combine_of(op)
    identity = identity_of(op, as_value(value).dtype)
    scan = warp_scan(value, lane, op, reverse=reverse)
    if lane == (0 if reverse else 31):  # the lane that holds the warp's total
        warp_totals[warp] = scan
    syncthreads()
    if exclusive:
        scan = _exclusive(scan, value, lane, op, reverse)
    for w in static_range(WARPS):
        scan = combine(scan, select(w > warp if reverse else w < warp, warp_totals[w], identity))
    return scan


@DeviceFunction
def block_reduce_many(values: Sequence[Any], scratch: Tensor, THREADS: int, op: str = "add") -> list:
    """``op`` of each of ``values`` over the block's THREADS threads (whole warps), every thread getting every
    result, behind one barrier (``block_reduce`` spends one each): each warp's results to ``scratch``
    (len(values) * THREADS // 32 slots), then each thread combines the warps' results of each value."""
    _check_count("block_reduce_many THREADS", THREADS, lambda n: 0 < n <= 1024 and n % 32 == 0, "whole warps")
    combine = combine_of(op)
    warps = THREADS // 32
    tid = thread_idx.x
    lane = tid & 31
    reduced = [warp_reduce(v, op) for v in values]
    if lane == 0:
        for j in static_range(len(values)):
            scratch[j * warps + (tid >> 5)] = reduced[j]
    syncthreads()
    return [tree_reduce([scratch[j * warps + w] for w in static_range(warps)], combine) for j in range(len(values))]
