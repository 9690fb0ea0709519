"""Per-stream scratch tensors of the ops' launches: launches on one stream are ordered, so they share one set per
(device, stream), grown as needed.

``workspace``: the zeroed f32 sums and arrival counters of kernels that reduce across CTAs, the skinny GEMM's split
K and the wgmma GEMM's stream-K tail (see ``nvfly.arch.gpu_scope``); every launch leaves them zeroed, so the next
one needs no memset. ``partials``: the f32 partial products of the wgmma GEMM's split K, which its reduce kernel
reads back. ``int32_tables``: int32 tables one launch writes for the next (attention decode's block-mask tables).
``StreamScratch`` is the rule they (and TopK's row-threshold lists) share.

Under CUDA graph capture every request gets tensors of its own from the graph's memory pool, zero-filled by a
captured fill where the kernels expect zeros: a graph keeps writing to what it captured, may replay on any stream,
and must not see a buffer that a later growth here frees. Tensors that land in a private memory pool outside capture
are not kept either (``in_private_pool``): Inductor's cudagraph trees run a graph's first (warm-up) call eagerly on
their own stream with every allocation of the thread routed to the graph's pool, and then require every live block
of that pool to be one of the graph's outputs ("tensor(s) in the cudagraph pool not tracked as outputs"); a cached
set would stay alive there for good."""
from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Callable, Generic, Optional, TypeVar

import torch

Tensors = TypeVar("Tensors")
MAX_VIEWS = 64  # views kept per (device, stream): one per distinct request size and view


class StreamScratch(Generic[Tensors]):
    """``get(device, stream, sizes)``: tensors of at least ``sizes`` (one int per tensor family, in the units
    ``allocate`` takes), cached per (device, stream) and grown to the largest request seen (at least ``floor``);
    under graph capture fresh tensors of exactly ``sizes``, not cached; tensors that ``in_private_pool`` finds in a
    private memory pool are not cached either. With ``view``, what ``view(tensors, sizes)`` returns (e.g. the first
    rows of each), kept beside the tensors until they grow: slicing tensors costs the host microseconds a launch
    does not have to spend."""

    def __init__(self, allocate: Callable[[torch.device, tuple[int, ...]], Tensors], floor: tuple[int, ...]):
        self._allocate = allocate
        self._floor = floor
        self._entries: dict[tuple[int, int], tuple[tuple[int, ...], Tensors, dict[tuple, Any]]] = {}

    def get(self, device: torch.device, stream: int, sizes: tuple[int, ...],
            view: Optional[Callable[[Tensors, tuple[int, ...]], Any]] = None) -> Any:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            fresh = self._allocate(device, sizes)
            return fresh if view is None else view(fresh, sizes)
        key = (device.index, stream)
        entry = self._entries.get(key)
        if entry is not None and view is not None:  # a view kept is of tensors large enough (growth drops them)
            found = entry[2].get((sizes, view))
            if found is not None:
                return found
        if entry is None or any(need > have for need, have in zip(sizes, entry[0])):
            grown = tuple(max(need, least, have) for need, least, have in
                          zip(sizes, self._floor, entry[0] if entry else self._floor))
            tensors = self._allocate(device, grown)
            if in_private_pool(tensors):  # e.g. a cudagraph tree's warm-up: this call's only, like capture's
                return tensors if view is None else view(tensors, sizes)
            entry = self._entries[key] = (grown, tensors, {})
        if view is None:
            return entry[1]
        views = entry[2]
        found = views.get((sizes, view))
        if found is None:
            if len(views) >= MAX_VIEWS:
                views.clear()
            found = views[(sizes, view)] = view(entry[1], sizes)
        return found


def in_private_pool(tensors: Any) -> bool:
    """Whether the memory of CUDA tensors (a tensor or a tuple of views of one allocation) came from a private
    memory pool (a CUDA graph's, cudagraph trees' warm-up, ``torch.cuda.use_mem_pool``) rather than the caching
    allocator's own, and so must not outlive the call that allocated it. Reads the allocator's snapshot (what
    cudagraph trees' own check reads): for the rare calls that allocate here."""
    first = tensors if isinstance(tensors, torch.Tensor) else next(
        (t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or first.device.type != "cuda" or not first.numel():
        return False
    address = first.untyped_storage().data_ptr()
    for segment in torch.cuda.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)
    return False


MIN_SUMS = 1 << 18  # f32 sums of a first allocation (1 MB), so that most calls never grow it
MIN_COUNTERS = 1024


def zeroed_i32(device: torch.device, counts: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Flat zeroed i32 tensors of ``counts`` elements, views of one allocation (one fill under graph capture),
    each starting 16-byte aligned."""
    padded = [-(-count // 4) * 4 for count in counts]
    whole = torch.zeros(sum(padded), dtype=torch.int32, device=device)
    starts = itertools.accumulate(padded, initial=0)
    return tuple(whole[start:start + count] for start, count in zip(starts, counts))


def _allocate_workspace(device: torch.device, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    sums, counters = zeroed_i32(device, sizes)
    return sums.view(torch.float32), counters  # all-zero bits: 0.0


_WORKSPACE = StreamScratch(_allocate_workspace, (MIN_SUMS, MIN_COUNTERS))
_PARTIALS = StreamScratch(lambda device, sizes: torch.empty(sizes[0], dtype=torch.float32, device=device),
                          (MIN_SUMS,))


def workspace(device: torch.device, stream: int, tiles: int, tile_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f32 sums, i32 arrival counters) for ``tiles`` output tiles of ``tile_slots`` sums each, zero between
    launches, for launches on ``stream`` of ``device``."""
    return _WORKSPACE.get(device, stream, (tiles * tile_slots, tiles))


def partials(device: torch.device, stream: int, numel: int) -> torch.Tensor:
    """A flat f32 buffer of at least ``numel`` elements (contents undefined) for launches on ``stream`` of
    ``device``."""
    return _PARTIALS.get(device, stream, (numel,))


@functools.lru_cache(maxsize=None)
def _rows_view(columns: int) -> Callable[[torch.Tensor, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]]:
    """The view of ``row_partials`` with rows of ``columns`` (one function per width: it keys the cached views)."""
    def view(buffer: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sizes[0] // (columns + 1)
        return buffer[:rows * columns].view(rows, columns), buffer[rows * columns:rows * (columns + 1)]
    return view


def row_partials(device: torch.device, stream: int, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``partials`` of rows * (columns + 1) elements as (f32 [rows, columns], f32 [rows]): partial results and a
    statistic per row right after them (split-KV attention's partial outputs and log-sum-exps); the views are
    cached, so a call costs a lookup."""
    return _PARTIALS.get(device, stream, (rows * (columns + 1),), _rows_view(columns))


MIN_TABLES = 1 << 14  # i32 elements of a first allocation (64 KB)
_TABLES = StreamScratch(lambda device, sizes: torch.empty(sizes[0], dtype=torch.int32, device=device),
                        (MIN_TABLES,))


@functools.lru_cache(maxsize=None)
def _tables_view(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, Callable[[torch.Tensor, tuple[int, ...]], Any]]:
    """(elements, view) of ``int32_tables`` of ``shapes``: each table starts 16-byte aligned."""
    padded = [-(-math.prod(shape) // 4) * 4 for shape in shapes]
    starts = list(itertools.accumulate(padded, initial=0))

    def view(buffer: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(buffer[start:start + math.prod(shape)].view(shape) for start, shape in zip(starts, shapes))
    return starts[-1], view


def int32_tables(device: torch.device, stream: int, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    """Contiguous int32 tensors of ``shapes`` (contents undefined), views of one per-stream buffer: tables that one
    launch on ``stream`` writes for the next to read; the views are cached, so a call costs a lookup."""
    elements, view = _tables_view(shapes)
    return _TABLES.get(device, stream, (elements,), view)


CONSTANTS_LIMIT = 1024
_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(device: torch.device, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A tensor that ``make()`` builds on ``device``, made once per (device, key) and shared by every caller: kernels
    read it, nothing may write it. Under graph capture (when none is kept yet), in a private memory pool, or past
    ``CONSTANTS_LIMIT`` kept ones, this call's own: a kept tensor is never dropped, since a captured graph may read
    it."""
    found = _CONSTANTS.get((device, key))
    if found is not None:
        return found
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return make()
    made = make()
    if len(_CONSTANTS) < CONSTANTS_LIMIT and not in_private_pool(made):
        _CONSTANTS[(device, key)] = made
    return made
