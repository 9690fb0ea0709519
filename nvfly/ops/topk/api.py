"""TopK's host side: the argument checks and eligibility, the per-call plan cache of ``topk()``, and the runners:
a plan's prepared launches (and the row-threshold kernels' per-stream workspace)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.topk.plans import HIST, MAX_K, ROW_CAP_MAX, STREAM_THREADS, TopkPlan, exact_table_rows, plan
from nvfly.ops.topk.row import (topk_row_histogram_kernel, topk_row_one_launch_kernel, topk_row_select_kernel,
                                topk_row_two_level_kernel)
from nvfly.ops.topk.stream import topk_merge_kernel, topk_radix_kernel
from nvfly.ops.topk.warp import topk_warp_kernel
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import layout_key, vector_width

if TYPE_CHECKING:
    import torch

SUPPORTED_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}  # -> TopkPlan.dtype


# ---------------------------------------------------------------------------------------------- checks
def check_shapes(x: Any, k: Any, dim: Any) -> int:
    """The wrapped dim of a TopK's arguments of any dtype and device (raises TypeError or ValueError naming the
    argument when they are wrong for any TopK: the torch op and its fake check with it too)."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -max(1, x.dim()) <= dim < max(1, x.dim()):
        raise ValueError(f"dim: {dim!r} is out of range for a {x.dim()}-dimensional x")
    dim %= max(1, x.dim())
    size = x.shape[dim] if x.dim() else 1
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= size:
        raise ValueError(f"k: expected an int in [0, {size}] (the size of dimension {dim}), got {k!r}")
    return dim


def _check(x: Any, k: Any, dim: Any) -> int:
    """``check_shapes``, then what nvfly's TopK takes (errors name the argument); returns the wrapped dim."""
    dim = check_shapes(x, k, dim)
    if str(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"x: dtype {x.dtype} is not supported (bfloat16, float16, float32)")
    if k > MAX_K:
        raise ValueError(f"k: at most {MAX_K} is supported, got {k}")
    return dim


def eligibility(x: Any, k: Any, dim: Any = -1, largest: bool = True, sorted: bool = True) -> Optional[str]:
    """None when nvfly computes this TopK, else the reason it declines (callers then use torch)."""
    try:
        dim = _check(x, k, dim)
    except (TypeError, ValueError) as exc:
        return str(exc)
    if x.dim() == 0 or dim != x.dim() - 1:
        return "dim is not the last dimension"
    if k == 0 or x.numel() == 0:
        return "the result is empty"
    if x.numel() >= 1 << 31:
        return "x has 2**31 elements or more"
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    return None


# ---------------------------------------------------------------------------------------------- calls
# Per-call plans (nvfly.ops.common.opcall), keyed on everything the argument checks and the launches depend on
# (see rmsnorm.api): the first call of a key checks and plans, later ones allocate the outputs and launch.
TOPK = "nvfly.ops.topk.topk"
_TOPK: OpCalls["_Topk"] = OpCalls()


@dataclass
class _Topk:
    """A TopK call's plan: (m, k) outputs for m rows of n; ``direct`` when x is a 2-D tensor with unit-stride
    rows and dim is its last (outputs and x are then used as they are); ``run(rows, values, indices)``
    launches (None: nothing to launch)."""
    m: int
    n: int
    k: int
    dim: int
    direct: bool
    run: Any


def topk(x: "torch.Tensor", k: int, dim: int = -1, largest: bool = True,
         sorted: bool = True) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(values, int64 indices) of the k largest (``largest=False``: smallest) elements along ``dim``, sorted
    (also when ``sorted=False``), ties and NaN as ``nvfly.ops.topk`` documents."""
    try:
        key = (layout_key(x), k, type(k), dim, type(dim), largest)
        t = _TOPK.get(key)
    except Exception:  # noqa: BLE001 - not a tensor, an unhashable argument: the checks explain
        key = t = None
    if t is None:
        t = _TOPK.plan(TOPK, key, _plan_call, x, k, dim, largest)
    import torch
    if t.direct:
        values = torch.empty((t.m, t.k), dtype=x.dtype, device=x.device)
        indices = torch.empty((t.m, t.k), dtype=torch.int64, device=x.device)
        t.run(x, values, indices)
        return values, indices
    return _topk_general(t, x)


def _topk_general(t: _Topk, x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """Any dim and layout: rows along ``dim`` (a copy where they are not unit-stride), outputs moved back."""
    import torch
    dim, m, n, k = t.dim, t.m, t.n, t.k
    last = x.dim() - 1
    moved = x if dim == last else x.movedim(dim, -1) if x.dim() else x.reshape(1)
    lead = moved.shape[:-1]
    values = torch.empty((m, k), dtype=x.dtype, device=x.device)
    indices = torch.empty((m, k), dtype=torch.int64, device=x.device)
    if t.run is not None:
        rows = moved.reshape(m, n)
        if rows.stride(1) != 1 and n > 1:
            rows = rows.contiguous()
        t.run(rows, values, indices)

    def place(out: "torch.Tensor") -> "torch.Tensor":
        if not x.dim():
            return out.reshape(())
        out = out.reshape(*lead, k)
        return out if dim == last else out.movedim(-1, dim)
    return place(values), place(indices)


def _plan_call(x: Any, k: Any, dim: Any, largest: Any) -> _Topk:
    """The first call of a signature: the checks (they raise), then the plan."""
    dim = _check(x, k, dim)
    n = x.shape[dim] if x.dim() else 1
    m = math.prod(s for i, s in enumerate(x.shape) if i != dim)
    direct = x.dim() == 2 and dim == 1 and (x.stride(1) == 1 or n == 1)
    run = None
    if k and m:
        vec = vector_width(n, (_rows_like(x, dim, m, n),), x.element_size())
        p = plan(n, k, m, vec, x.element_size(), plan_sm_count(x.get_device()), dtype=SUPPORTED_DTYPES[str(x.dtype)])
        run = runner(p, m, n, k, bool(largest))
    return _Topk(m, n, k, dim, direct and run is not None, run)


def _rows_like(x: "torch.Tensor", dim: int, m: int, n: int) -> "torch.Tensor":
    """The (m, n) rows the kernels read (as ``_topk_general`` makes them): for the vector width."""
    moved = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    rows = moved.reshape(m, n)
    return rows if rows.stride(1) == 1 or n == 1 else rows.contiguous()


# ---------------------------------------------------------------------------------------------- launches
def runner(p: TopkPlan, m: int, n: int, k: int, largest: bool) -> Any:
    """``run(rows, values, indices)`` for a plan: one or two prepared launches."""
    import torch
    if p.warp:
        warp = topk_warp_kernel.prepared(-(-m // p.warps), 32 * p.warps)
        tail: tuple = (m, k, n, p.vec, p.warps, largest)
        return lambda rows, values, indices: warp.launch(rows, values, indices, *tail)
    if p.row_threshold:
        return row_runner(p, m, k, largest)
    if p.parts == 1:
        single = topk_radix_kernel.prepared((m, 1, 1), p.threads)
        tail = (k, n, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, False)
        return lambda rows, values, indices: single.launch(rows, values, indices, rows, *tail)
    # slices of each row write their k best ranks; a second launch merges them (2 ranks per 16-byte access).
    # The ranks are a fresh allocation each call (the caching allocator's, a few microseconds): a buffer kept
    # across calls would need one per stream and would break under CUDA graph capture.
    first = topk_radix_kernel.prepared((m, p.parts, 1), p.threads)
    first_tail = (k, p.slice_len, p.vec, p.unroll, p.threads, p.cap, p.k_pow2, largest, True)
    merge = topk_merge_kernel.prepared((m, 1, 1), STREAM_THREADS)
    merge_tail = (k, p.merge_vec, STREAM_THREADS, p.merge_cap, p.k_pow2)
    ranks_shape = (m, p.parts * k)

    def run(rows: "torch.Tensor", values: "torch.Tensor", indices: "torch.Tensor") -> None:
        ranks = torch.empty(ranks_shape, dtype=torch.int64, device=rows.device)
        first.launch(rows, values, indices, ranks, *first_tail)
        merge.launch(rows, ranks, values, indices, *merge_tail)
    return run


# ---------------------------------------------------------------------------------------------- row-threshold launches
MIN_ROWS = 64  # rows of a first workspace allocation


def _allocate_workspace(device: Any, sizes: tuple[int, ...]) -> tuple[Any, Any, Any, Any]:
    import torch
    from nvfly.ops.common import scratch
    rows = sizes[0]
    hist, counters, hist2 = scratch.zeroed_i32(device, (rows * HIST, 2 * rows, rows * HIST))
    return (hist.view(rows, HIST), counters, torch.empty((rows, ROW_CAP_MAX), dtype=torch.int64, device=device),
            hist2.view(rows, HIST))


@functools.lru_cache(maxsize=None)
def _workspaces() -> Any:
    """The scratch.StreamScratch of the workspaces, made on first use (torch is imported only when launching)."""
    from nvfly.ops.common import scratch
    return scratch.StreamScratch(_allocate_workspace, (MIN_ROWS,))


def workspace(device: Any, rows: int) -> tuple[Any, Any, Any, Any, Any]:
    """(histograms (rows, HIST) i32, counters (2 * rows,) i32, candidate lists (rows, ROW_CAP_MAX) i64,
    second-level histograms (rows, HIST) i32, the lists' memory as flat i32: ``row.exact_finish``'s tables) for
    launches on torch's current stream of ``device``: all but the lists zero between launches
    (``nvfly.ops.common.scratch``: per stream, grown as needed, a graph capture's own)."""
    from nvfly.runtime.torch_args import current_stream
    stream = current_stream(device.index) if device.type == "cuda" else 0
    return _workspaces().get(device, stream, (rows,), _first_rows)


def _first_rows(tensors: tuple[Any, Any, Any, Any], sizes: tuple[int]) -> tuple[Any, Any, Any, Any, Any]:
    import torch
    hist, counters, candidates, hist2 = tensors
    rows = sizes[0]
    table = candidates[:rows].view(torch.int32).view(-1)
    return hist[:rows], counters[:2 * rows], candidates[:rows], hist2[:rows], table


def row_runner(p: TopkPlan, m: int, k: int, largest: bool) -> Any:
    """``run(rows, values, indices)`` for a row-threshold plan: the histogram and the select launch (with the
    second level when ``p.two_level``), or the one cooperative launch of both (``p.one_launch``)."""
    histogram = topk_row_histogram_kernel.prepared((m, p.hist_parts or p.parts, 1), p.threads)
    hist_tail = (p.hist_slice_len or p.slice_len, p.vec, p.unroll, p.threads, largest)
    select_tail = (k, p.slice_len, p.vec, p.unroll, p.threads, p.cap, p.row_cap, p.k_pow2, largest)
    if p.one_launch:
        one = topk_row_one_launch_kernel.prepared((m, p.parts, 1), p.threads)
        rows_needed = exact_table_rows(m, p.exact_stride)

        def run_one_launch(rows: Any, values: Any, indices: Any) -> None:
            hist, counters, candidates, totals, table = workspace(rows.device, rows_needed)
            one.launch(rows, values, indices, hist, counters, candidates, table, totals, *select_tail,
                       p.shared_finish, p.exact_stride)
        return run_one_launch
    if p.two_level:
        two_level = topk_row_two_level_kernel.prepared((m, p.parts, 1), p.threads)

        def run_two_level(rows: Any, values: Any, indices: Any) -> None:
            hist, counters, candidates, hist2, _ = workspace(rows.device, m)
            histogram.launch(rows, hist, *hist_tail)
            two_level.launch(rows, values, indices, hist, hist2, counters, candidates, *select_tail)
        return run_two_level
    select = topk_row_select_kernel.prepared((m, p.parts, 1), p.threads)

    def run(rows: Any, values: Any, indices: Any) -> None:
        hist, counters, candidates, _, _ = workspace(rows.device, m)
        histogram.launch(rows, hist, *hist_tail)
        select.launch(rows, values, indices, hist, counters, candidates, *select_tail, p.reversed_select)
    return run
