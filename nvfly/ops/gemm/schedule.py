"""The persistent GEMM kernel's tile schedule (device functions): which output tile, K split and k-block range
each work unit of a block covers, with grouped rasterisation, split K and the stream-K tail.

Kept apart from the kernel so that a shared tile scheduler (problem and tile shape in, no GemmConfig) can
replace this module as a whole.
"""
from __future__ import annotations

import nvfly


@nvfly.func
def tile_coords(tile, tiles_m, tiles_n, GROUP_M):
    """(batch, tile row, tile column) of a linear tile index, rasterised in groups of GROUP_M tile rows."""
    per_batch = tiles_m * tiles_n
    batch = tile // per_batch
    t = tile - batch * per_batch
    group = GROUP_M * tiles_n
    gid = t // group
    first_m = gid * GROUP_M
    size_m = nvfly.minimum(tiles_m - first_m, GROUP_M)
    local = t - gid * group
    return batch, first_m + local % size_m, local // size_m


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
def unit_work(unit, tiles_m, tiles_n, k_per_split, k_tiles, rank, dp_tiles, block_iters, blocks, num_tiles, CFG,
              CM, STREAM_K):
    """``tile_work`` of a work unit, plus its stream-K slot and contributor count. With STREAM_K, units below
    ``dp_tiles`` are whole tiles; the remaining tiles' k-blocks, in order, are dealt out as one contiguous range
    of ``block_iters`` to each block (stream K), and unit ``dp_tiles + j * blocks + b`` is block b's j-th tile:
    the part of that tile inside the block's range. The slot is the tile's index among the stream-K tiles
    (negative for a whole tile); the count is how many blocks' ranges share the tile (1: no fix-up)."""
    if STREAM_K:
        tail = unit >= dp_tiles
        v = nvfly.maximum(unit - dp_tiles, 0)
        start = (v % blocks) * block_iters
        slot = start // k_tiles + v // blocks
        tile_start = slot * k_tiles
        total = (num_tiles - dp_tiles) * k_tiles
        tile_end = nvfly.minimum(tile_start + k_tiles, total)
        k_begin = nvfly.select(tail, nvfly.maximum(start, tile_start) - tile_start, 0)
        k_end = nvfly.select(tail, nvfly.minimum(start + block_iters, tile_end) - tile_start, k_tiles)
        contributors = nvfly.select(tail, (tile_end - 1) // block_iters - tile_start // block_iters + 1, 1)
        batch, tm, tn = tile_coords(nvfly.select(tail, dp_tiles + slot, unit), tiles_m, tiles_n, CFG.group_m)
        split = 0
        slot = nvfly.select(tail, slot, -1)
    else:
        batch, tm, tn, split, k_begin, k_end = tile_work(unit, tiles_m, tiles_n, k_per_split, k_tiles, rank, CFG, CM)
        slot = -1
        contributors = 1
    return batch, tm, tn, split, k_begin, k_end, slot, contributors


@nvfly.func
def tile_work(tile, tiles_m, tiles_n, k_per_split, k_tiles, rank, CFG, CM):
    """(batch, tile row, tile column, K split, first and end k-block) of a linear tile index; tile rows are
    counted in cluster rows, and ``rank`` picks this block's row of its cluster."""
    split = tile % CFG.split_k
    batch, ctm, tn = tile_coords(tile // CFG.split_k, tiles_m, tiles_n, CFG.group_m // CM)
    k_begin = split * k_per_split
    return batch, ctm * CM + rank, tn, split, k_begin, nvfly.minimum(k_begin + k_per_split, k_tiles)
