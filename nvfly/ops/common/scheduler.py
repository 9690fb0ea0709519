"""The persistent tile scheduler: which output tile, K range and batch (or group) each block works on.

A persistent kernel launches ``TileSchedule.grid`` blocks (clusters of ``cluster_m`` or ``cluster_n`` blocks count
as one): block
``b`` of ``blocks`` takes the work units ``b``, ``b + blocks``, ``b + 2 * blocks``, ... below its end
(``block_units``), and ``unit_work`` says what a unit is (a ``WorkUnit``). The host plans a ``TileSchedule`` from
a problem shape (M, N, batches or ragged groups, k-blocks) and a tile shape; its compile-time part, a ``Tiling``,
is the kernel's Constexpr, and the rest (sizes, the stream-K split, tables) its run-time arguments.

- Rasterisation (``raster``): a batch's tiles are taken in groups of ``group_m`` tile rows, column after column
  inside a group, so that the tiles in flight share rows of A and columns of B in L2; ``group_m`` 1 is linear
  (row after row). Batches follow one another.
- Split K: work tile ``t`` is split ``t % split_k`` of output tile ``t // split_k``, k-blocks
  ``[split * k_per_split, min((split + 1) * k_per_split, k_tiles))``; ``split_count`` makes every split non-empty.
  With ``split_fix_up`` the splits meet in the kernel, as stream K's shared tiles do: a unit's ``slot`` is its
  output tile and its ``contributors`` the splits (the kernel's fix-up; without it, ``slot`` -1 and 1).
- Clusters along M: tiles are counted in cluster rows; block ``rank`` of a cluster takes row ``rank`` of it.
  Along N (``cluster_n``): tiles are counted in cluster columns, block ``rank`` takes column
  ``rank`` of one (a last cluster column past N holds a tile the kernel computes and does not store).
- Stream K (``stream_k_split``): the first ``dp_tiles`` work tiles (whole waves) run whole, then the k-blocks of
  the remaining ``sk_tiles`` tiles, in order, are dealt out as one contiguous range of ``block_iters`` k-blocks
  to each block; a block's range touches one or more tiles, one unit each, and a tile's ``contributors`` (the
  blocks whose ranges share it) add up its partial sums (the kernel's fix-up; the unit's ``slot`` indexes them).
- Ragged groups (``ragged_schedule``, grouped GEMM / MoE): group ``g`` of ``m_g`` rows owns tile rows
  ``group_rows[g] .. group_rows[g + 1] - 1`` (a device table of groups + 1 entries; empty groups own none), each
  group rasterised as a batch of its own; a unit's ``batch`` is its group. With clusters the table counts cluster
  rows (ceil(m_g / (bm * cluster_m))), so a cluster never straddles two groups; a group's last cluster row may
  hold tile rows past its end, which the kernel computes and does not store.
- Longest processing time first (``lpt_schedule``, e.g. causal attention): work tile ``t`` is output tile
  ``order[t]`` (a device table), the tiles sorted by non-increasing cost, so that the costly tiles start first and
  the cheap ones fill the gaps at the end.
- Head-grouped LPT walk (``head_grouped_lpt_unit``, attention prefill's persistent schedule): no table; unit ``u``
  is a (query tile, head, batch) by arithmetic, groups of (batch, head) pairs one after the other and, inside a
  group, the query tiles from the last (the longest causal ones) down, the group's pairs within a tile row.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import nvfly


@dataclass(frozen=True)
class Tiling:
    """The compile-time part of a schedule (a kernel's Constexpr).

    bm x bn: the output tile; group_m: tile rows per rasterisation group (1: linear); split_k: K splits;
    cluster_m: blocks per cluster along M (each takes one tile row of the cluster's); stream_k: the tail of tiles
    is dealt out as k ranges (``TileSchedule.dp_tiles``, ``block_iters``); groups: ragged groups (0: batches of
    equal size); ordered: work tiles are taken in the order of a table (LPT); split_fix_up: the K splits of an
    output tile add up in the kernel (``WorkUnit.slot`` and ``contributors`` name the tile and its splits);
    cluster_n: blocks per cluster along N (each takes one tile column of the cluster's; not with cluster_m).
    """
    bm: int
    bn: int
    group_m: int = 1
    split_k: int = 1
    cluster_m: int = 1
    stream_k: bool = False
    groups: int = 0
    ordered: bool = False
    split_fix_up: bool = False
    cluster_n: int = 1

    @property
    def cluster(self) -> int:
        """Blocks per cluster."""
        return self.cluster_m * self.cluster_n

    def __post_init__(self) -> None:
        why = self.check()
        if why:
            raise ValueError(f"Tiling: {why}")

    def check(self) -> Optional[str]:
        """None if the kernels' mapping covers this tiling, else why not."""
        if min(self.bm, self.bn, self.group_m, self.split_k, self.cluster_m, self.cluster_n) < 1 or self.groups < 0:
            return "tile sizes, group_m, split_k, cluster_m and cluster_n are at least 1, groups at least 0"
        if self.cluster_m > 1 and self.cluster_n > 1:
            return "a cluster runs along M or along N, not both"
        if self.group_m % self.cluster_m:
            return f"group_m={self.group_m} is not a whole number of {self.cluster_m}-row clusters"
        if self.stream_k and (self.split_k != 1 or self.cluster != 1 or self.ordered):
            return "stream K takes no K split, no cluster and no tile order"
        if self.ordered and self.cluster != 1:
            return "tile orders take no cluster"
        if self.groups and self.ordered:
            return "ragged groups take no tile order"
        if self.split_fix_up and (self.stream_k or self.cluster != 1):
            return "split K's fix-up takes no stream K and no cluster (a slot per output tile)"
        if self.ordered and self.group_m != 1:
            return "a tile order replaces the rasterisation: group_m=1"
        return None


@dataclass(frozen=True)
class StreamK:
    """Which tiles stream K deals out as k ranges. region: "short-tail", a last wave at most 1/min_tail_split
    full after whole waves (with at least min_tail_split * min_block_iters k-blocks a tile); "tail": any partial
    last wave (also a single partial wave); "tail+wave": a partial last wave and the whole wave before it; "off".
    A block streams at least min_block_iters k-blocks and at least 1/max_contributors of a tile's (so that a tile
    is shared by at most max_contributors + 1 blocks, max_contributors when the ranges align with it). The
    defaults are the GEMM's measured choice (docs/ops/gemm.md)."""
    region: str = "short-tail"
    min_tail_split: int = 8
    min_block_iters: int = 4
    max_contributors: int = 16

    def __post_init__(self) -> None:
        if self.region not in STREAM_K_REGIONS:
            raise ValueError(f"stream-K region {self.region!r}: expected one of {STREAM_K_REGIONS}")


STREAM_K_REGIONS = ("off", "short-tail", "tail", "tail+wave")


@dataclass(frozen=True)
class StreamKSplit:
    """Stream K over a launch: the first dp_tiles work tiles run whole, the k-blocks of the rest are dealt out
    block_iters to a block (0: nothing is streamed)."""
    dp_tiles: int = 0
    block_iters: int = 0

    @property
    def streamed(self) -> bool:
        return self.block_iters > 0


def stream_k_split(tiles: int, k_tiles: int, sms: int, policy: StreamK = StreamK()) -> StreamKSplit:
    """The stream-K split of a persistent launch of ``tiles`` work tiles of ``k_tiles`` k-blocks over ``sms``
    blocks (see ``StreamK``); nothing streamed for whole waves or a region the shape has not."""
    full, tail = divmod(tiles, sms)
    if policy.region == "off" or tail == 0:
        return StreamKSplit()
    if policy.region == "short-tail" and (full == 0 or tail > sms // policy.min_tail_split
                                          or k_tiles < policy.min_tail_split * policy.min_block_iters):
        return StreamKSplit()
    sk_tiles = tail + sms if policy.region == "tail+wave" and full else tail
    block_iters = max(math.ceil(sk_tiles * k_tiles / sms), math.ceil(k_tiles / policy.max_contributors),
                      policy.min_block_iters)
    return StreamKSplit(tiles - sk_tiles, block_iters)


def split_count(k_tiles: int, split_k: int) -> int:
    """The K splits used for ``split_k`` requested over ``k_tiles`` k-blocks: every split gets at least one."""
    return math.ceil(k_tiles / math.ceil(k_tiles / min(split_k, k_tiles)))


@dataclass(frozen=True)
class TileSchedule:
    """A persistent launch's schedule: the problem (m x n outputs in ``batches`` batches, ``k_tiles`` k-blocks;
    ragged: ``group_rows``), its ``tiling``, the ``grid`` of blocks to launch (0: nothing to do), the stream-K
    split and the device tables (``group_rows``: ragged groups' first tile rows, groups + 1 entries; ``order``:
    the output tile of each position, LPT)."""
    tiling: Tiling
    m: int
    n: int
    batches: int
    k_tiles: int
    grid: int
    dp_tiles: int = 0
    block_iters: int = 0
    group_rows: tuple[int, ...] = ()
    order: tuple[int, ...] = ()

    @property
    def tiles_m(self) -> int:
        """Tile rows per batch (whole clusters; ragged: of all groups)."""
        if self.tiling.groups:
            return self.group_rows[-1] * self.tiling.cluster_m
        rows = self.tiling.bm * self.tiling.cluster_m
        return math.ceil(self.m / rows) * self.tiling.cluster_m

    @property
    def tiles_n(self) -> int:
        """Tile columns (whole clusters)."""
        cn = self.tiling.cluster_n
        return math.ceil(self.n / (self.tiling.bn * cn)) * cn

    @property
    def output_tiles(self) -> int:
        return self.tiles_m * self.tiles_n * self.batches

    @property
    def tiles(self) -> int:
        """Work tiles: output tiles times K splits (a cluster's tile counts once per block)."""
        return self.output_tiles * self.tiling.split_k

    @property
    def k_per_split(self) -> int:
        return math.ceil(self.k_tiles / self.tiling.split_k)

    @property
    def sk_tiles(self) -> int:
        """Work tiles whose k-blocks stream K deals out."""
        return self.tiles - self.dp_tiles if self.block_iters else 0

    @property
    def blocks(self) -> int:
        """What the device strides units by: the grid's clusters."""
        return self.grid // self.tiling.cluster


def _grid(tiles: int, k_tiles: int, sms: int, cluster_m: int, split: StreamKSplit) -> int:
    if not split.streamed:
        return min(tiles, sms // cluster_m * cluster_m)
    if split.dp_tiles:
        return sms  # the whole tiles are whole waves: dp_tiles is a multiple of the grid
    return math.ceil((tiles - split.dp_tiles) * k_tiles / split.block_iters)  # as many blocks as k ranges


def _check_problem(k_tiles: int, sms: int, *sizes: int) -> None:
    if k_tiles < 1 or sms < 1 or min(sizes) < 0:
        raise ValueError(f"a schedule needs k_tiles >= 1 ({k_tiles}), sms >= 1 ({sms}) and sizes >= 0 {sizes}")


def grid_schedule(m: int, n: int, k_tiles: int, bm: int, bn: int, *, sms: int, batches: int = 1, group_m: int = 1,
                  split_k: int = 1, cluster_m: int = 1, stream_k: Optional[StreamK] = None,
                  split_fix_up: bool = False, cluster_n: int = 1) -> TileSchedule:
    """The schedule of ``batches`` m x n outputs of ``k_tiles`` k-blocks on bm x bn tiles over ``sms`` blocks:
    ``group_m`` rasterisation, ``split_k`` K splits (fewer when K is short: ``split_count``), clusters of
    ``cluster_m`` blocks along M or of ``cluster_n`` along N (tile columns in whole clusters), and with a
    ``stream_k`` policy a tail dealt out as k ranges (only without K splits or clusters, and where the policy
    applies); ``split_fix_up``: the K splits add up in the kernel (``Tiling.split_fix_up``; only with more than one
    split)."""
    _check_problem(k_tiles, sms, m, n, batches)
    cluster = cluster_m * cluster_n
    if cluster > sms:
        raise ValueError(f"clusters of {cluster} blocks on {sms} SMs")
    split = split_count(k_tiles, split_k)
    tiles = math.ceil(m / (bm * cluster_m)) * cluster_m * math.ceil(n / (bn * cluster_n)) * cluster_n * batches * split
    sk = stream_k_split(tiles, k_tiles, sms, stream_k) if stream_k and split == 1 and cluster == 1 \
        else StreamKSplit()
    tiling = Tiling(bm, bn, group_m, split, cluster_m, stream_k=sk.streamed, split_fix_up=split_fix_up and split > 1,
                    cluster_n=cluster_n)
    return TileSchedule(tiling, m, n, batches, k_tiles, _grid(tiles, k_tiles, sms, cluster, sk), sk.dp_tiles,
                        sk.block_iters)


def ragged_schedule(group_sizes: Sequence[int], n: int, k_tiles: int, bm: int, bn: int, *, sms: int,
                    group_m: int = 1, split_k: int = 1, cluster_m: int = 1, cluster_n: int = 1,
                    stream_k: Optional[StreamK] = None) -> TileSchedule:
    """The schedule of ragged groups (grouped GEMM, MoE experts): group g computes ``group_sizes[g]`` x n
    outputs (0 allowed) of ``k_tiles`` k-blocks; tiles, rasterisation, K splits, clusters of ``cluster_m``
    blocks along M (``group_rows`` then counts cluster rows) or of ``cluster_n`` along N, and stream K (without
    clusters) as ``grid_schedule``. The device reads ``group_rows``."""
    if not group_sizes:
        raise ValueError("ragged_schedule: at least one group")
    _check_problem(k_tiles, sms, n, *group_sizes)
    cluster = cluster_m * cluster_n
    if cluster > sms:
        raise ValueError(f"clusters of {cluster} blocks on {sms} SMs")
    rows = [0]
    for size in group_sizes:
        rows.append(rows[-1] + math.ceil(size / (bm * cluster_m)))
    split = split_count(k_tiles, split_k)
    tiles = rows[-1] * cluster_m * math.ceil(n / (bn * cluster_n)) * cluster_n * split
    sk = stream_k_split(tiles, k_tiles, sms, stream_k) if stream_k and split == 1 and cluster == 1 \
        else StreamKSplit()
    tiling = Tiling(bm, bn, group_m, split, cluster_m, groups=len(group_sizes), stream_k=sk.streamed,
                    cluster_n=cluster_n)
    return TileSchedule(tiling, sum(group_sizes), n, 1, k_tiles, _grid(tiles, k_tiles, sms, cluster, sk),
                        sk.dp_tiles, sk.block_iters, group_rows=tuple(rows))


def lpt_schedule(m: int, n: int, k_tiles: int, bm: int, bn: int, cost: Callable[[int, int, int], float], *,
                 sms: int, batches: int = 1, split_k: int = 1) -> TileSchedule:
    """The schedule of tiles of unequal cost, longest first: ``cost(batch, tile row, tile column)`` of each output
    tile (e.g. causal attention: the key blocks at or below the diagonal of its query rows); the device takes the
    tiles in the order of ``order`` (non-increasing cost, ties in linear order), K splits as ``grid_schedule``."""
    _check_problem(k_tiles, sms, m, n, batches)
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    costs = [cost(t // (tiles_m * tiles_n), t // tiles_n % tiles_m, t % tiles_n)
             for t in range(tiles_m * tiles_n * batches)]
    order = tuple(sorted(range(len(costs)), key=lambda t: -costs[t]))
    split = split_count(k_tiles, split_k)
    tiling = Tiling(bm, bn, 1, split, ordered=True)
    return TileSchedule(tiling, m, n, batches, k_tiles, _grid(len(costs) * split, k_tiles, sms, 1, StreamKSplit()),
                        order=order)


def head_grouped_lpt_unit(unit: Any, tiles_m: Any, heads: Any, pairs: Any, pair_group: Any,
                          minimum: Callable[[Any, Any], Any] = min) -> tuple[Any, Any, Any]:
    """(tile row, head, batch) of persistent work unit ``unit`` of ``tiles_m * pairs`` units: ``tiles_m`` tile
    rows (attention prefill's query tiles) of each of ``pairs`` (batch, head) pairs, ``heads`` a batch. The pairs
    go in groups of ``pair_group`` (consecutive, head fastest, so that query heads sharing a KV head are
    neighbours; the last group may be shorter), the groups one after the other, and inside a group tile row after
    tile row from the last (the longest causal tiles first), the group's pairs within a tile row: the units in
    flight at once are few pairs' tiles (their K and V stay in L2 when a group's K and V fit) and, within a group,
    in non-increasing causal cost (FlashAttention-3's LPT walk). Python ints (the CPU model) or traced values
    (the kernel, with ``nvfly.minimum``)."""
    group_units = pair_group * tiles_m
    group = unit // group_units
    first_pair = group * pair_group
    local = unit - group * group_units
    pairs_here = minimum(pair_group, pairs - first_pair)
    row_step = local // pairs_here
    pair = first_pair + (local - row_step * pairs_here)
    batch = pair // heads
    return tiles_m - 1 - row_step, pair - batch * heads, batch


# a packed (tile row, head, batch) unit code of a unit table's int32 lists (``csr_table``): 12 + 8 + 11 bits,
# non-negative
UNIT_ROW_BITS, UNIT_HEAD_BITS, UNIT_BATCH_BITS = 12, 8, 11


def pack_unit(tile_row: int, head: int, batch: int) -> int:
    """One int32 unit code, tile row | head << 12 | batch << 20 (``unpack_unit`` reads it back)."""
    return tile_row | head << UNIT_ROW_BITS | batch << (UNIT_ROW_BITS + UNIT_HEAD_BITS)


def unpack_unit(code: Any) -> tuple[Any, Any, Any]:
    """(tile row, head, batch) of a ``pack_unit`` code: Python ints or traced i32 values."""
    return (code & ((1 << UNIT_ROW_BITS) - 1), (code >> UNIT_ROW_BITS) & ((1 << UNIT_HEAD_BITS) - 1),
            code >> (UNIT_ROW_BITS + UNIT_HEAD_BITS))


def check_unit_sizes(tile_rows: int, heads: int, batch: int, op: str) -> None:
    """ValueError naming the size that does not fit a ``pack_unit`` code."""
    for name, size, bits in (("query tiles", tile_rows, UNIT_ROW_BITS), ("heads", heads, UNIT_HEAD_BITS),
                             ("batch", batch, UNIT_BATCH_BITS)):
        if size > 1 << bits:
            raise ValueError(f"{op}: a unit table holds at most {1 << bits} {name}, got {size}")


def lpt_work_lists(costs: Sequence[int], workers: int) -> list[list[int]]:
    """Greedy LPT: the indices of ``costs`` by cost, highest first (ties in index order), each to the worker with
    the least load so far (ties: the lowest worker). A worker's list keeps that order; its load is at most
    sum / workers + the highest cost."""
    loads = [(0, worker) for worker in range(workers)]  # a heap of (load, worker)
    lists: list[list[int]] = [[] for _ in range(workers)]
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, worker = heapq.heappop(loads)
        lists[worker].append(index)
        heapq.heappush(loads, (load + costs[index], worker))
    return lists


def csr_table(lists: Sequence[Sequence[int]]) -> list[int]:
    """``lists`` as one flat int list: len(lists) + 1 offsets (absolute positions in it) then the entries, list
    w's at [table[w], table[w + 1])."""
    offsets = [len(lists) + 1]
    for entries in lists:
        offsets.append(offsets[-1] + len(entries))
    return offsets + [entry for entries in lists for entry in entries]


# ---------------------------------------------------------------------------------------------- device side
class TileGrid(NamedTuple):
    """The run-time sizes of a schedule in a kernel (``tile_grid``): tiles_m (cluster rows of tiles per batch;
    ragged: of all groups) x tiles_n (cluster columns) tiles a batch, num_tiles work tiles (cluster tiles times K splits),
    k_per_split k-blocks a split of k_tiles, the stream-K split, blocks (the grid's clusters) and the tables."""
    tiles_m: Any
    tiles_n: Any
    num_tiles: Any
    k_tiles: Any
    k_per_split: Any
    dp_tiles: Any
    block_iters: Any
    blocks: Any
    group_rows: Any
    order: Any


class WorkUnit(NamedTuple):
    """One unit of a block's work: output tile (tile_m, tile_n) of ``batch`` (ragged: the group; tile_m then counts
    within it), K split ``split``, k-blocks [k_begin, k_end); stream K: the tile's ``slot`` among the streamed
    tiles (-1: a whole tile) and its ``contributors`` (1: no fix-up)."""
    batch: Any
    tile_m: Any
    tile_n: Any
    split: Any
    k_begin: Any
    k_end: Any
    slot: Any
    contributors: Any

    @property
    def k_blocks(self) -> Any:
        return self.k_end - self.k_begin


@nvfly.func
def tile_grid(m, n, batches, k_tiles, dp_tiles, block_iters, blocks, group_rows, order, TILING):
    """The ``TileGrid`` of m x n outputs in ``batches`` batches (ragged: the last entry of ``group_rows``, the
    groups' first tile rows, counts the rows) of ``k_tiles`` k-blocks, over ``blocks`` blocks (clusters)."""
    CM = TILING.cluster_m
    if TILING.groups:
        tiles_m = group_rows[TILING.groups]
    else:
        tiles_m = (m + TILING.bm * CM - 1) // (TILING.bm * CM)  # in units of cluster rows
    tiles_n = (n + TILING.bn * TILING.cluster_n - 1) // (TILING.bn * TILING.cluster_n)  # (cluster columns)
    num_tiles = tiles_m * tiles_n * batches * TILING.split_k
    k_per_split = (k_tiles + TILING.split_k - 1) // TILING.split_k
    return TileGrid(tiles_m, tiles_n, num_tiles, k_tiles, k_per_split, dp_tiles, block_iters, blocks, group_rows,
                    order)


@nvfly.func
def block_units(block, grid, TILING):
    """The end of block ``block``'s work units (it takes ``block``, ``block + grid.blocks``, ... below it)."""
    units = grid.num_tiles
    if TILING.stream_k:  # the other blocks' stream-K ranges are theirs
        units = stream_k_units(block, grid.blocks, grid.k_tiles, grid.num_tiles, grid.dp_tiles, grid.block_iters)
    return units


def persistent_units(m: Any, n: Any, batches: Any, k_tiles: Any, group_rows: Any, TILING: Any) -> tuple[Any, Any, Any, Any]:
    """A persistent block's walk over the tiles without stream K: (its first unit, the step between its units (the
    grid's clusters), the ``TileGrid``, the end of its units); ``group_rows`` the ragged table (None: not ragged).
    The blocks of a cluster walk the same units (``unit_work`` with their rank gives each its tile row)."""
    CS = TILING.cluster
    first = nvfly.cluster_idx.x if CS > 1 else nvfly.block_idx.x
    step = nvfly.grid_dim.x // CS
    grid = tile_grid(m, n, batches, k_tiles, 0, 0, step, group_rows, None, TILING)
    return first, step, grid, block_units(first, grid, TILING)


@nvfly.func
def stream_k_units(block, blocks, k_tiles, num_tiles, dp_tiles, block_iters):
    """The end of a block's work units under stream K: its share of the ``dp_tiles`` whole tiles (units
    ``block``, ``block + blocks``, ... below ``dp_tiles``, a multiple of ``blocks``), then one unit per tile
    its range of ``block_iters`` k-blocks of the stream-K tiles touches (units ``dp_tiles + j * blocks +
    block``)."""
    total = (num_tiles - dp_tiles) * k_tiles
    start = nvfly.minimum(block * block_iters, total)
    end = nvfly.minimum(start + block_iters, total)
    segments = nvfly.select(end > start, (end - 1) // k_tiles - start // k_tiles + 1, 0)
    return dp_tiles + segments * blocks


@nvfly.func
def unit_work(unit, grid, rank, TILING):
    """The ``WorkUnit`` of work unit ``unit`` for block ``rank`` of its cluster. With stream K, units below
    ``dp_tiles`` are whole tiles; the remaining tiles' k-blocks, in order, are dealt out as one contiguous range
    of ``block_iters`` to each block, and unit ``dp_tiles + j * blocks + b`` is block b's j-th tile: the part of
    that tile inside the block's range. The slot is the tile's index among the stream-K tiles (negative for a
    whole tile); the count is how many blocks' ranges share the tile (1: no fix-up). Split K with
    ``split_fix_up``: the slot is the output tile, the count its non-empty splits (all ``split_k`` of them when
    the host planned them with ``split_count``)."""
    if TILING.stream_k:
        k_tiles, dp_tiles, block_iters, blocks = grid.k_tiles, grid.dp_tiles, grid.block_iters, grid.blocks
        tail = unit >= dp_tiles
        v = nvfly.maximum(unit - dp_tiles, 0)
        start = (v % blocks) * block_iters
        slot = start // k_tiles + v // blocks
        tile_start = slot * k_tiles
        total = (grid.num_tiles - dp_tiles) * k_tiles
        tile_end = nvfly.minimum(tile_start + k_tiles, total)
        k_begin = nvfly.select(tail, nvfly.maximum(start, tile_start) - tile_start, 0)
        k_end = nvfly.select(tail, nvfly.minimum(start + block_iters, tile_end) - tile_start, k_tiles)
        contributors = nvfly.select(tail, (tile_end - 1) // block_iters - tile_start // block_iters + 1, 1)
        batch, tm, tn = output_tile(nvfly.select(tail, dp_tiles + slot, unit), grid, TILING)
        split = 0
        slot = nvfly.select(tail, slot, -1)
    else:
        CM = TILING.cluster_m
        split = unit % TILING.split_k
        batch, ctm, tn = output_tile(unit // TILING.split_k, grid, TILING)
        k_begin = split * grid.k_per_split
        if TILING.cluster_n > 1:  # block ``rank`` takes column ``rank`` of the cluster's
            tm = ctm
            tn = tn * TILING.cluster_n + rank
        else:
            tm = ctm * CM + rank
        k_end = nvfly.minimum(k_begin + grid.k_per_split, grid.k_tiles)
        slot = -1
        contributors = 1
        if TILING.split_fix_up:  # the count from run-time sizes, traced as stream K's (the fix-up branches on it)
            slot = unit // TILING.split_k
            contributors = (grid.k_tiles + grid.k_per_split - 1) // grid.k_per_split
    return WorkUnit(batch, tm, tn, split, k_begin, k_end, slot, contributors)


@nvfly.func
def output_tile(tile, grid, TILING):
    """(batch or group, tile row, tile column) of output tile ``tile`` (tile rows in cluster rows)."""
    if TILING.ordered:
        tile = grid.order[tile]
    if TILING.groups:
        batch, tm, tn = ragged_tile_coords(tile, grid.group_rows, grid.tiles_n, TILING.groups,
                                           TILING.group_m // TILING.cluster_m)
    else:
        batch, tm, tn = tile_coords(tile, grid.tiles_m, grid.tiles_n, TILING.group_m // TILING.cluster_m)
    return batch, tm, tn


@nvfly.func
def tile_coords(tile, tiles_m, tiles_n, GROUP_M):
    """(batch, tile row, tile column) of a linear tile index, rasterised in groups of GROUP_M tile rows."""
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    tm, tn = raster(tile - batch * per_batch, tiles_m, tiles_n, GROUP_M)
    return batch, tm, tn


@nvfly.func
def ragged_tile_coords(tile, group_rows, tiles_n, GROUPS, GROUP_M):
    """(group, tile row in the group, tile column) of a linear tile index over GROUPS ragged groups (rows in cluster
    rows with clusters): group g owns rows group_rows[g] .. group_rows[g + 1] - 1 of tiles_n tiles (the table has
    GROUPS + 1 entries), and the
    group is the last whose first row is at most the tile's (a binary search: empty groups are passed over)."""
    row = tile // tiles_n
    group = 0
    for step in nvfly.static_range((GROUPS - 1).bit_length() - 1, -1, -1):
        probe = group + (1 << step)
        # a probe past the last group reads the end of the table, beyond every row
        group = nvfly.select(group_rows[nvfly.minimum(probe, GROUPS)] <= row, probe, group)
    first = group_rows[group]
    tm, tn = raster(tile - first * tiles_n, group_rows[group + 1] - first, tiles_n, GROUP_M)
    return group, tm, tn


@nvfly.func
def raster(t, tiles_m, tiles_n, GROUP_M):
    """(tile row, tile column) of tile ``t`` of a tiles_m x tiles_n grid: in groups of GROUP_M tile rows (the last
    group may be shorter), column after column inside a group; GROUP_M 1: row after row."""
    if GROUP_M == 1:
        tm = t // tiles_n
        tn = t - tm * tiles_n
    else:
        group = GROUP_M * tiles_n
        gid = t // group
        first_m = gid * GROUP_M
        size_m = nvfly.minimum(tiles_m - first_m, GROUP_M)
        local = t - gid * group
        tm = first_m + local % size_m
        tn = local // size_m
    return tm, tn
