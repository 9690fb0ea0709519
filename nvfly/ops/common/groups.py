"""The ragged groups of the persistent grouped GEMMs (bf16 ``nvfly.ops.grouped``, FP8 ``nvfly.ops.scaled``'s grouped
kernel): group sizes read on the device, never on the host.

Two layouts keep the groups along M: "contiguous" (tokens sorted by expert, group g the rows [offs[g-1], offs[g])
of A, ``offs`` the cumulative ends) and "masked" (A [E, Mmax, K], group g its first counts[g] rows); the grouped
bf16 GEMM's "kgrouped" keeps them along K (offs the cumulative K ends). Each block fills a table of the groups'
first tile rows in shared memory at start (``fill_group_table``: a block scan over the groups, each thread summing
a few), which ``nvfly.ops.common.scheduler`` walks (``Tiling(groups=...)``); ``group_work`` and ``group_rows_end``
place a tile of a group; ``validate_offsets`` checks device sizes on the host (a sync, on request). Sizes are clamped to [0, limit] (``clamped_range``), so that even invalid offsets never
address memory outside the operands.
"""
from __future__ import annotations

import torch

import nvfly
from nvfly.arch.reduce import block_scan

TABLE_WORDS = 32  # after the group table: the block scan's warp totals


def table_bytes(groups: int) -> int:
    """Shared memory of the group table (groups + 1 first tile rows) and the scan's warp totals."""
    return 4 * (groups + 1 + TABLE_WORDS)


@nvfly.func
def clamped_range(offs, g, limit, LAYOUT, GROUPS):
    """[start, end) of group g (rows, or K for "kgrouped"), clamped to [0, limit] and end >= start, so that
    offsets that decrease or pass the end never address memory outside the operands."""
    if LAYOUT == "masked":
        start = 0
        end = nvfly.minimum(nvfly.maximum(offs[g], 0), limit)
    else:
        previous = nvfly.select(g > 0, offs[nvfly.maximum(g - 1, 0)], 0)
        start = nvfly.minimum(nvfly.maximum(previous, 0), limit)
        end = nvfly.minimum(nvfly.maximum(offs[g], start), limit)
    return start, end


def group_table(table_offset: int, groups: int):
    """The group table (groups + 1 i32 first tile rows) and the scan's warp totals in dynamic shared memory at byte
    ``table_offset`` (``table_bytes`` of them)."""
    table = nvfly.dynamic_shared_tensor(nvfly.i32, (groups + 1,), offset_bytes=table_offset)
    totals = nvfly.dynamic_shared_tensor(nvfly.i32, (TABLE_WORDS,), offset_bytes=table_offset + 4 * (groups + 1))
    return table, totals


@nvfly.func
def fill_group_table(table, totals, offs, m, tid, lane, warp, THREADS, BM, LAYOUT, GROUPS):
    """The groups' first tile rows of BM rows (table[g]; table[GROUPS] the total) from the device sizes: each of the
    block's THREADS threads sums PER groups' tile rows, a block scan gives each its first. The caller syncs the
    block before reading it."""
    PER = (GROUPS + THREADS - 1) // THREADS
    first_group = tid * PER
    count = 0
    for i in nvfly.static_range(PER):
        g = nvfly.minimum(first_group + i, GROUPS - 1)
        start, end = clamped_range(offs, g, m, LAYOUT, GROUPS)
        count = count + nvfly.select(first_group + i < GROUPS, (end - start + BM - 1) // BM, 0)
    row = block_scan(count, totals, lane, warp, THREADS // 32, exclusive=True)
    for i in nvfly.static_range(PER):
        g = first_group + i
        if g < GROUPS:
            table[g] = row
            start, end = clamped_range(offs, g, m, LAYOUT, GROUPS)
            row = row + (end - start + BM - 1) // BM
    if tid == THREADS - 1:
        table[GROUPS] = row


@nvfly.func
def group_work(offs, g, tm, m, k, k_tiles, BM, BK, LAYOUT, GROUPS):
    """(first row of the tile in A's rows, first K of the group, k-blocks) of tile row ``tm`` of group ``g``."""
    if LAYOUT == "contiguous":
        start, end = clamped_range(offs, g, m, LAYOUT, GROUPS)
        row_base = start + tm * BM
        k_base = 0
        blocks = k_tiles
    elif LAYOUT == "masked":
        row_base = tm * BM
        k_base = 0
        blocks = k_tiles
    else:
        row_base = tm * BM
        k_base, k_end = clamped_range(offs, g, k, LAYOUT, GROUPS)
        blocks = nvfly.maximum((k_end - k_base + BK - 1) // BK, 1)  # an empty group: one k-block of zeros
    return row_base, k_base, blocks


@nvfly.func
def group_rows_end(offs, g, m, LAYOUT, GROUPS):
    """The bound of the rows the epilogue stores: the group's end (contiguous: in all tokens' rows; masked: its
    count; kgrouped: M)."""
    if LAYOUT == "kgrouped":
        end = m
    else:
        start, end = clamped_range(offs, g, m, LAYOUT, GROUPS)
    return end


def validate_offsets(offs: torch.Tensor, limit: int, *, masked: bool = False, name: str = "offs") -> None:
    """Check device group sizes on the host (a sync; the grouped GEMMs never do this themselves): cumulative ends that
    never decrease and end within ``limit`` (T or sum K), or masked counts in [0, limit]; raises ValueError
    naming ``name``."""
    values = offs.detach().to("cpu", torch.int64)
    if masked:
        bad = ((values < 0) | (values > limit)).nonzero()
        if len(bad):
            g = int(bad[0])
            raise ValueError(f"{name}: count {int(values[g])} of group {g} is outside [0, {limit}]")
        return
    previous = torch.cat([values.new_zeros(1), values[:-1]])
    bad = (values < previous).nonzero()
    if len(bad):
        g = int(bad[0])
        raise ValueError(f"{name}: offsets must not decrease, offs[{g}] = {int(values[g])} < {int(previous[g])}")
    if len(values) and int(values[-1]) > limit:
        raise ValueError(f"{name}: the last offset {int(values[-1])} is beyond the {limit} rows of the operand")
