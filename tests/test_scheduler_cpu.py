"""The persistent tile scheduler without a GPU: its device mapping, run on Python ints, covers every k-block of
every tile exactly once (linear, grouped, split K, clusters, stream K, ragged groups, LPT order) on the grid the
plan launches, with no idle block; LPT orders are non-increasing in cost; the device functions compile."""
import contextlib
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfly
from nvfly.frontend.function import DeviceFunction
from nvfly.ops.common import scheduler
from nvfly.ops.common.scheduler import StreamK, Tiling
from nvfly.runtime.torch_args import TensorDesc


@contextlib.contextmanager
def python_ints():
    """The scheduler's device functions as plain Python over ints (their nvfly helpers and each other)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nvfly, "select", lambda c, a, b: a if c else b)
        patch.setattr(nvfly, "minimum", min)
        patch.setattr(nvfly, "maximum", max)
        for name, obj in list(vars(scheduler).items()):
            if isinstance(obj, DeviceFunction):
                patch.setattr(scheduler, name, obj.fn)
        yield


def device_work(schedule):
    """The Python model of a launch: {(block, rank): [WorkUnit, ...]} for every block of ``schedule.grid``, from
    the device functions themselves (tile_grid, block_units, unit_work) on Python ints."""
    tiling = schedule.tiling
    with python_ints():
        grid = scheduler.tile_grid(schedule.m, schedule.n, schedule.batches, schedule.k_tiles, schedule.dp_tiles,
                                   schedule.block_iters, schedule.blocks, schedule.group_rows, schedule.order, tiling)
        work = {}
        for block in range(schedule.blocks):
            end = scheduler.block_units(block, grid, tiling)
            for rank in range(tiling.cluster):
                work[block, rank] = [scheduler.unit_work(unit, grid, rank, tiling)
                                     for unit in range(block, end, schedule.blocks)]
    return work


def output_tiles(schedule):
    """Every output tile (batch or group, tile row, tile column) of the problem."""
    if schedule.tiling.groups:  # clusters: a group's last cluster row may hold tile rows past its end
        rows, cm = schedule.group_rows, schedule.tiling.cluster_m
        return {(g, tm, tn) for g in range(len(rows) - 1) for tm in range(cm * (rows[g + 1] - rows[g]))
                for tn in range(schedule.tiles_n)}
    return {(b, tm, tn) for b in range(schedule.batches) for tm in range(schedule.tiles_m)
            for tn in range(schedule.tiles_n)}


def check_schedule(schedule, sms):
    """Every k-block of every output tile exactly once, on a grid of at most ``sms`` blocks none of which idles;
    K splits as planned; stream K's and split K's (``split_fix_up``) slots and contributor counts as the fix-up
    needs them: one slot per shared tile, counting the units that add into it."""
    tiling = schedule.tiling
    work = device_work(schedule)
    assert schedule.grid <= sms and schedule.grid % tiling.cluster == 0
    assert len(work) == schedule.grid and all(work.values()), "a block of the grid without work"
    parts = {}
    for (block, rank), units in work.items():
        streamed = [u for u in units if u.slot >= 0] if tiling.stream_k else []
        if streamed:  # one contiguous range of at most block_iters k-blocks, over consecutive tiles
            assert [u.slot for u in streamed] == list(range(streamed[0].slot, streamed[0].slot + len(streamed)))
            assert sum(u.k_blocks for u in streamed) <= schedule.block_iters
        for u in units:
            assert 0 <= u.k_begin < u.k_end <= schedule.k_tiles, (block, rank, u)
            if tiling.split_k > 1:
                assert u.k_begin == u.split * schedule.k_per_split
                assert u.k_end == min(u.k_begin + schedule.k_per_split, schedule.k_tiles)
            parts.setdefault((u.batch, u.tile_m, u.tile_n), []).append(u)
    assert set(parts) == output_tiles(schedule)
    for tile, units in parts.items():
        blocks = Counter(k for u in units for k in range(u.k_begin, u.k_end))
        assert blocks == Counter(range(schedule.k_tiles)), (tile, units)
        assert {u.contributors for u in units} == {len(units) if units[0].slot >= 0 else 1}
        assert len({u.slot for u in units}) == 1
        if tiling.stream_k and units[0].slot >= 0:  # ranges of block_iters k-blocks: the fewest that touch k_tiles
            assert len(units) <= math.ceil((schedule.k_tiles - 1) / schedule.block_iters) + 1
        if tiling.split_fix_up:  # every split adds into the tile's slot, and the count waits for all of them
            assert sorted(u.split for u in units) == list(range(tiling.split_k)), (tile, units)
    if tiling.stream_k:
        assert schedule.dp_tiles % schedule.grid == 0
        slots = {u.slot for units in parts.values() for u in units if u.slot >= 0}
        assert slots == set(range(schedule.sk_tiles))
    if tiling.split_fix_up:  # a slot per output tile: the workspace the host sizes for output_tiles
        assert sorted(units[0].slot for units in parts.values()) == list(range(schedule.output_tiles))
    else:
        assert tiling.stream_k or all(u.slot == -1 for units in parts.values() for u in units)
    return work


tile_sizes = st.sampled_from([64, 128, 256])
regions = st.sampled_from(["short-tail", "tail", "tail+wave"])


@settings(max_examples=150, deadline=None)
@given(m=st.integers(1, 2500), n=st.integers(1, 2500), k_tiles=st.integers(1, 160), bm=tile_sizes, bn=tile_sizes,
       batches=st.integers(1, 3), group_m=st.sampled_from([1, 2, 3, 8, 16]), split_k=st.integers(1, 9),
       cluster=st.sampled_from([(1, 1), (2, 1), (1, 2), (1, 4)]), sms=st.sampled_from([1, 7, 16, 132]))
def test_linear_grouped_split_and_clustered_tiles_are_covered_once(m, n, k_tiles, bm, bn, batches, group_m, split_k,
                                                                   cluster, sms):
    cluster_m, cluster_n = cluster
    group_m = group_m * cluster_m
    sms = max(sms, cluster_m * cluster_n)
    schedule = scheduler.grid_schedule(m, n, k_tiles, bm, bn, sms=sms, batches=batches, group_m=group_m,
                                       split_k=split_k, cluster_m=cluster_m, cluster_n=cluster_n)
    assert schedule.tiling.split_k == scheduler.split_count(k_tiles, split_k) <= split_k
    assert schedule.tiles_n == math.ceil(n / (bn * cluster_n)) * cluster_n  # a last cluster column may pass N
    assert schedule.grid == min(schedule.tiles, sms // (cluster_m * cluster_n) * cluster_m * cluster_n)
    assert not schedule.tiling.stream_k
    work = check_schedule(schedule, sms)
    for (block, rank), units in work.items():  # a cluster's blocks take the rows (columns) of one cluster row (column)
        assert all((u.tile_m % cluster_m, u.tile_n % cluster_n) == (rank * (cluster_m > 1), rank * (cluster_n > 1))
                   for u in units)
        assert [(u.batch, u.tile_m // cluster_m, u.tile_n // cluster_n, u.k_begin, u.k_end) for u in units] == \
            [(u.batch, u.tile_m // cluster_m, u.tile_n // cluster_n, u.k_begin, u.k_end) for u in work[block, 0]]


@settings(max_examples=100, deadline=None)
@given(m=st.integers(1, 2500), n=st.integers(1, 2500), k_tiles=st.integers(1, 160), bm=st.sampled_from([64, 128]),
       bn=st.sampled_from([8, 16, 40, 64, 128]), batches=st.integers(1, 3), group_m=st.sampled_from([1, 8]),
       split_k=st.integers(2, 16), sms=st.sampled_from([1, 7, 132]))
def test_split_fix_up_slots_and_counts(m, n, k_tiles, bm, bn, batches, group_m, split_k, sms):
    """Split K whose splits add up in the kernel (the scaled GEMM's small-M single launch): each output tile's
    splits are all non-empty, each counts itself in on the tile's slot, and the count it waits for is theirs."""
    schedule = scheduler.grid_schedule(m, n, k_tiles, bm, bn, sms=sms, batches=batches, group_m=group_m,
                                       split_k=split_k, split_fix_up=True)
    assert schedule.tiling.split_fix_up == (schedule.tiling.split_k > 1)
    check_schedule(schedule, sms)


def test_split_fix_up_excludes_stream_k_and_clusters():
    for kwargs in ({"stream_k": True, "split_k": 1}, {"cluster_m": 2, "split_k": 2}):
        with pytest.raises(ValueError, match="fix-up"):
            Tiling(128, 128, 2, split_fix_up=True, **kwargs)


@settings(max_examples=150, deadline=None)
@given(m=st.integers(1, 4000), n=st.integers(1, 4000), k_tiles=st.integers(1, 300), bm=tile_sizes, bn=tile_sizes,
       batches=st.integers(1, 2), group_m=st.sampled_from([1, 8]), region=regions,
       sms=st.sampled_from([3, 16, 66, 132]))
def test_stream_k_covers_every_k_block_once(m, n, k_tiles, bm, bn, batches, group_m, region, sms):
    schedule = scheduler.grid_schedule(m, n, k_tiles, bm, bn, sms=sms, batches=batches, group_m=group_m,
                                       stream_k=StreamK(region))
    split = scheduler.stream_k_split(schedule.tiles, k_tiles, sms, StreamK(region))
    assert schedule.tiling.stream_k == split.streamed
    assert (schedule.dp_tiles, schedule.block_iters) == (split.dp_tiles, split.block_iters)
    check_schedule(schedule, sms)


def test_stream_k_split():
    """Which tiles are streamed per region, and each block's range: whole waves stay whole, a block streams at
    least min_block_iters k-blocks and a tile is shared by at most max_contributors blocks."""
    def split(tiles, k_tiles, region):
        s = scheduler.stream_k_split(tiles, k_tiles, 132, StreamK(region))
        return s.dp_tiles, s.block_iters
    assert split(272, 112, "short-tail") == (264, 7)  # 8 tiles left: 896 k-blocks, 7 a block
    assert split(448, 32, "short-tail") == (0, 0)     # 52 left: not short
    assert split(448, 32, "tail") == (396, 13)
    assert split(448, 32, "tail+wave") == (264, 45)
    assert split(272, 9, "short-tail") == (0, 0)      # K too short
    assert split(96, 64, "tail") == (0, 47)           # one partial wave: all of it streamed
    assert split(132, 112, "tail") == (0, 0)          # whole waves
    assert split(133, 112, "tail") == (132, 7)        # 1 tile: 16 blocks of 7 (max_contributors)
    assert split(133, 3, "tail") == (132, 4)          # min_block_iters
    assert split(272, 112, "off") == (0, 0)
    with pytest.raises(ValueError, match="stream-K region"):
        StreamK("all")


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.one_of(st.just(0), st.integers(0, 700)), min_size=1, max_size=40),
       n=st.integers(1, 1500), k_tiles=st.integers(1, 120), bm=tile_sizes, bn=tile_sizes,
       group_m=st.sampled_from([1, 2, 8]), split_k=st.integers(1, 4), region=st.none() | regions,
       cluster=st.sampled_from(["none", "none", "m", "n"]), sms=st.sampled_from([1, 5, 16, 132]))
def test_ragged_groups_are_covered_once(sizes, n, k_tiles, bm, bn, group_m, split_k, region, cluster, sms):
    cluster_m, cluster_n = (2 if cluster == "m" else 1), (2 if cluster == "n" else 1)
    group_m = group_m * cluster_m
    sms = max(sms, cluster_m * cluster_n)
    schedule = scheduler.ragged_schedule(sizes, n, k_tiles, bm, bn, sms=sms, group_m=group_m, split_k=split_k,
                                         cluster_m=cluster_m, cluster_n=cluster_n,
                                         stream_k=StreamK(region) if region else None)
    assert schedule.tiles_n == math.ceil(n / (bn * cluster_n)) * cluster_n  # a last cluster column may pass N
    rows = schedule.group_rows
    assert len(rows) == len(sizes) + 1 and rows[0] == 0
    assert [rows[g + 1] - rows[g] for g in range(len(sizes))] == [math.ceil(s / (bm * cluster_m)) for s in sizes]
    if schedule.tiles == 0:
        assert schedule.grid == 0  # every group empty: nothing to launch
        return
    work = check_schedule(schedule, sms)  # every tile of every group (and its cluster padding) once
    for (block, rank), units in work.items():  # a cluster's blocks take the tiles of one cluster tile of one group
        assert all((u.tile_m % cluster_m, u.tile_n % cluster_n) == (rank * (cluster_m > 1), rank * (cluster_n > 1))
                   for u in units)
        peer = work[block, 1 - rank] if cluster != "none" else units
        assert [(u.batch, u.tile_m // cluster_m, u.tile_n // cluster_n) for u in units] == \
            [(u.batch, u.tile_m // cluster_m, u.tile_n // cluster_n) for u in peer]


@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("bn", [128, 192])
def test_an_experts_tiles_run_together(bn, cluster_n):
    """DeepSeek-V3's E = 256 experts at 4096 tokens top-8, uniform routing (128 rows each: one 128-row tile row):
    the units run expert after expert, each expert's N tiles consecutive, so that a wave of 132 blocks holds the
    tiles of at most 6 experts and each expert's weight tiles are taken once (read from HBM once) while its token
    tile is re-read from L2 (the grouped FP8 GEMM's order, docs/ops/scaled.md)."""
    schedule = scheduler.ragged_schedule([128] * 256, 4096, 56, 128, bn, sms=132, group_m=8, cluster_n=cluster_n)
    work = device_work(schedule)
    order = sorted((block + i * schedule.blocks, rank, u) for (block, rank), units in work.items()
                   for i, u in enumerate(units))
    experts = [u.batch for _, _, u in order]
    assert experts == sorted(experts)  # expert after expert
    taken = Counter((u.batch, u.tile_n) for _, _, u in order)
    assert len(taken) == 256 * schedule.tiles_n and set(taken.values()) == {1}  # each weight tile once
    per_wave = 132 // cluster_n
    for first in range(0, len(order) // cluster_n, per_wave):
        wave = {u.batch for unit, _, u in order if first <= unit < first + per_wave}
        assert max(wave) - min(wave) + 1 <= 6, wave


@settings(max_examples=100, deadline=None)
@given(data=st.data(), m=st.integers(1, 2000), n=st.integers(1, 600), bm=tile_sizes, bn=tile_sizes,
       batches=st.integers(1, 4), k_tiles=st.integers(1, 64), split_k=st.integers(1, 3),
       sms=st.sampled_from([1, 7, 132]))
def test_lpt_order_is_longest_first_and_covered_once(data, m, n, bm, bn, batches, k_tiles, split_k, sms):
    tiles_m, tiles_n = math.ceil(m / bm), math.ceil(n / bn)
    costs = data.draw(st.lists(st.integers(0, 20), min_size=tiles_m * tiles_n * batches,
                               max_size=tiles_m * tiles_n * batches))

    def cost(batch, tm, tn):
        return costs[(batch * tiles_m + tm) * tiles_n + tn]
    schedule = scheduler.lpt_schedule(m, n, k_tiles, bm, bn, cost, sms=sms, batches=batches, split_k=split_k)
    order = schedule.order
    assert sorted(order) == list(range(len(costs)))
    assert all(costs[a] > costs[b] or (costs[a] == costs[b] and a < b) for a, b in zip(order, order[1:]))
    work = check_schedule(schedule, sms)
    # the blocks take the tiles in that order: unit u is position u // split_k of it
    taken = sorted((unit, u) for (block, _), units in work.items()
                   for unit, u in zip(range(block, 10 ** 9, schedule.blocks), units))
    assert [cost(*u[:3]) for _, u in taken] == [costs[t] for t in order for _ in range(schedule.tiling.split_k)]


def test_causal_lpt_takes_the_last_query_blocks_first():
    """Causal attention's tiles (query block i sees i + 1 key blocks): the last query block of every head first."""
    schedule = scheduler.lpt_schedule(1024, 64, 8, 128, 64, lambda head, q, _: q + 1, sms=132, batches=3)
    work = device_work(schedule)
    first = [work[b, 0][0] for b in range(6)]
    assert [(u.batch, u.tile_m) for u in first] == [(0, 7), (1, 7), (2, 7), (0, 6), (1, 6), (2, 6)]


@settings(max_examples=150, deadline=None)
@given(tiles_m=st.integers(1, 40), heads=st.integers(1, 12), batches=st.integers(1, 5), pair_group=st.integers(1, 20),
       grid=st.sampled_from([1, 7, 132]))
def test_head_grouped_lpt_walk_covers_every_unit_once_longest_first(tiles_m, heads, batches, pair_group, grid):
    """``head_grouped_lpt_unit`` (prefill's persistent walk) on Python ints: the CTAs' strided walks over
    min(units, grid) CTAs take every (tile row, head, batch) exactly once; the units go group by group of
    ``pair_group`` consecutive (batch, head) pairs, inside a group tile row after tile row from the last (causal
    cost, the tile row + 1 key blocks, non-increasing), all of a group's pairs in each tile row."""
    pairs = heads * batches
    units = tiles_m * pairs
    walk = [scheduler.head_grouped_lpt_unit(u, tiles_m, heads, pairs, pair_group) for u in range(units)]
    ctas = min(units, grid)
    taken = Counter(walk[u] for cta in range(ctas) for u in range(cta, units, ctas))
    assert taken == Counter({(tm, h, b): 1 for tm in range(tiles_m) for h in range(heads) for b in range(batches)})
    for start in range(0, units, pair_group * tiles_m):
        group = walk[start:start + pair_group * tiles_m]
        group_pairs = sorted({b * heads + h for _, h, b in group})
        assert group_pairs == list(range(start // tiles_m, start // tiles_m + len(group_pairs)))
        assert len(group_pairs) == min(pair_group, pairs - start // tiles_m)
        rows = [tm for tm, _, _ in group]
        assert rows == sorted(rows, reverse=True)  # longest first inside the group
        assert Counter(rows) == Counter({tm: len(group_pairs) for tm in range(tiles_m)})
    if pair_group >= pairs:  # one group: longest first over the whole launch
        assert [tm for tm, _, _ in walk] == sorted((tm for tm, _, _ in walk), reverse=True)


def test_plans_are_checked():
    with pytest.raises(ValueError, match="group_m=3"):
        Tiling(128, 128, group_m=3, cluster_m=2)
    with pytest.raises(ValueError, match="stream K"):
        Tiling(128, 128, split_k=2, stream_k=True)
    with pytest.raises(ValueError, match="k_tiles >= 1"):
        scheduler.grid_schedule(128, 128, 0, 128, 128, sms=132)
    with pytest.raises(ValueError, match="clusters of 2 blocks on 1 SMs"):
        scheduler.grid_schedule(128, 128, 4, 128, 128, sms=1, cluster_m=2)
    with pytest.raises(ValueError, match="at least one group"):
        scheduler.ragged_schedule([], 128, 4, 128, 128, sms=132)
    with pytest.raises(ValueError, match="tile orders take no cluster"):
        Tiling(128, 128, group_m=2, cluster_m=2, ordered=True)
    with pytest.raises(ValueError, match="along M or along N"):
        Tiling(128, 128, group_m=2, cluster_m=2, cluster_n=2)


@nvfly.kernel
def schedule_probe(out: nvfly.Tensor, m: nvfly.i32, n: nvfly.i32, batches: nvfly.i32, k_tiles: nvfly.i32,
                   dp_tiles: nvfly.i32, block_iters: nvfly.i32, group_rows, order, TILING: nvfly.Constexpr):
    """Row ``unit * cluster + rank`` of ``out``: the WorkUnit of each unit a block takes, and the block (a cluster
    of ``TILING.cluster`` blocks along M or N counts as one)."""
    CM = TILING.cluster
    if nvfly.thread_idx.x == 0:
        rank = nvfly.block_rank_in_cluster() if CM > 1 else 0
        block = nvfly.cluster_idx.x if CM > 1 else nvfly.block_idx.x
        grid = scheduler.tile_grid(m, n, batches, k_tiles, dp_tiles, block_iters, nvfly.grid_dim.x // CM, group_rows,
                                   order, TILING)
        for unit in range(block, scheduler.block_units(block, grid, TILING), grid.blocks):
            work = scheduler.unit_work(unit, grid, rank, TILING)
            row = unit * CM + rank
            for i in nvfly.static_range(len(work)):
                out[row, i] = work[i]
            out[row, len(work)] = block


PROBES = {
    "linear": scheduler.grid_schedule(1000, 900, 20, 128, 128, sms=16, batches=2),
    "grouped-split-k": scheduler.grid_schedule(1000, 900, 20, 128, 64, sms=132, group_m=8, split_k=3),
    "cluster": scheduler.grid_schedule(1000, 900, 20, 128, 64, sms=16, group_m=8, cluster_m=2),
    "stream-k": scheduler.grid_schedule(2048, 2112, 112, 128, 128, sms=132, group_m=8, stream_k=StreamK()),
    "ragged": scheduler.ragged_schedule([300, 0, 17, 1000, 0, 129], 700, 9, 128, 128, sms=16, group_m=2,
                                        stream_k=StreamK("tail")),
    "ragged-cluster": scheduler.ragged_schedule([300, 0, 17, 1000, 0, 129], 700, 9, 128, 128, sms=16, group_m=8,
                                                cluster_m=2),
    "ragged-cluster-n": scheduler.ragged_schedule([300, 0, 17, 1000, 0, 129], 700, 9, 128, 128, sms=16, group_m=8,
                                                  cluster_n=2),
    "lpt": scheduler.lpt_schedule(1024, 64, 8, 128, 64, lambda head, q, _: q + 1, sms=16, batches=3, split_k=2),
}


def probe_args(schedule, device="cpu"):
    """The probe's arguments for ``schedule``: an output of -1s big enough for every unit, then the sizes and
    tables (i32 tensors)."""
    units = max(unit for (block, _), us in device_work(schedule).items()
                for unit, _ in zip(range(block, 10 ** 9, schedule.blocks), us)) + 1
    out = torch.full((units * schedule.tiling.cluster, 9), -1, dtype=torch.int32, device=device)

    def table(values):
        return torch.tensor(values, dtype=torch.int32, device=device) if values else None
    return (out, schedule.m, schedule.n, schedule.batches, schedule.k_tiles, schedule.dp_tiles, schedule.block_iters,
            table(schedule.group_rows), table(schedule.order))


@pytest.mark.parametrize("name", PROBES)
def test_device_functions_compile(name):
    schedule = PROBES[name]
    out, *sizes, group_rows, order = probe_args(schedule)
    tables = [TensorDesc(nvfly.i32, tuple(t.shape)) if t is not None else None for t in (group_rows, order)]
    cluster = (schedule.tiling.cluster, 1, 1) if schedule.tiling.cluster > 1 else None
    k = schedule_probe.compile(TensorDesc(nvfly.i32, tuple(out.shape)), *sizes, *tables, TILING=schedule.tiling,
                               block=32, cluster=cluster, target="sm_90a")
    assert ".entry schedule_probe" in k.ptx and k.resources.spill_stores == 0
