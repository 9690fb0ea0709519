"""The grouped GEMM kernel (MoE experts): one persistent warp-specialised TMA + wgmma launch walks every group's
tiles with the shared scheduler; no launch per group and no host read of the group sizes.

Three layouts (``LAYOUT``), each group g a GEMM of its own:

- "contiguous" (the MoE forward, ``torch._grouped_mm`` 2-D x 3-D): tokens sorted by expert in A [T, K], group g
  rows [offs[g-1], offs[g]) (``offs``: cumulative ends on the device), weights B [E, K, N] (either major), out
  [T, N]. One 2-D descriptor covers all tokens and a 3-D one all weights with the group as the batch coordinate
  (DeepGEMM's contiguous layout): an M tile that runs past its group's end loads rows of the next group (or TMA's
  zero fill) that the epilogue does not store.
- "masked" (CUDA-graph decode): A [E, Mmax, K], group g rows [0, counts[g]), out [E, Mmax, N]; rows past the count
  are not written.
- "kgrouped" (the weight gradient, 2-D x 2-D): A [M, sum K], B [sum K, N], group g the K range
  [offs[g-1], offs[g]), out [E, M, N]. A group's k-blocks start at its first K (TMA takes any coordinate); its
  last k-block would read the next group's K, so the consumers zero the A columns past the group's end in shared
  memory before issuing it (an empty group runs one k-block of zeros: its output is zeros).

The contiguous and masked layouts give group g ceil(rows_g / BM) tile rows: each block computes the table of the
groups' first tile rows (``scheduler.ragged_schedule``'s ``group_rows``) in shared memory at start from the
device sizes (a block scan over the groups, each thread summing a few), and the launch is sized from an upper
bound on the tiles (blocks past the real count exit). Group sizes are clamped to [0, rows] on the device, so even
invalid offsets never read or write out of bounds.

Warpgroup 0 produces (one thread keeps the TMA ring full), the others consume cooperatively (each owns BM /
consumers rows of a tile; the mainloop is nvfly.ops.common.mainloop's, as in the dense and scaled GEMMs) or, with
``CFG.pingpong``, take whole tiles in turn; they store through registers with masks
(``nvfly.ops.common.epilogue.store_tile``) or, with ``CFG.tma_store``, through shared memory and TMA
(``stage_tile``): in the ragged layouts a consumer's rows that lie inside their group go by TMA (which clips N), a
slice that crosses the group's end through registers with masks (TMA would write the next group's rows); with
``CFG.skip_empty`` a consumer whose rows of a tile all lie past its group's end waits for and releases the tile's
stages without its wgmmas (``skip_k_blocks``). With ``CFG.cluster_m`` 2 (contiguous and masked layouts, not fused)
two blocks take tile rows 2i and 2i + 1 of one group's cluster row and multicast each half of the shared B tile to
both (the dense GEMM's cluster); the group table then counts cluster rows, and a group's last cluster row may hold a
tile row past its end, computed and not stored. With ``CFG.cluster_n`` 2 (contiguous and masked, fused too) two
blocks take tile columns 2j and 2j + 1 of one tile row and multicast each half of the shared A tile (the group's
rows) to both; a last cluster column past N is computed and not stored. ``FUSE`` "silu_mul" is the fused gate/up
projection: B holds the gate columns [0, I) then the up columns [I, 2I); a BN-wide B tile takes BN/2 gate and the
same BN/2 up columns, so each thread holds gate and up of its output columns, and the epilogue stores silu(gate) *
up, I columns wide.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import nvfly
from nvfly.arch import sm90
from nvfly.arch.memory import store_shared
from nvfly.arch.ptx import smem_address
from nvfly.ops.common.epilogue import activate, check_store_descriptor, stage_tile, store_tile
from nvfly.ops.common.gemm_config import BARRIER_BYTES, CONSUMER_REGS, PRODUCER_REGS, STORE_BARRIER, Epilogue
from nvfly.ops.common.groups import clamped_range, fill_group_table, group_rows_end, group_table, group_work
from nvfly.ops.common.mainloop import (consume_k_blocks, fill_stage, init_ring, issue_k_block, load_boxes,
                                       skip_k_blocks)
from nvfly.ops.common.scheduler import Tiling, persistent_units, unit_work

LAYOUTS = ("contiguous", "masked", "kgrouped")
FUSES = ("none", "silu_mul")


@nvfly.kernel
def grouped_kernel(a_desc: nvfly.TmaDescriptor, b_desc: nvfly.TmaDescriptor, out: nvfly.Tensor, offs: nvfly.Tensor,
                   out_desc, m: nvfly.i32, n: nvfly.i32, k: nvfly.i32, k_tiles: nvfly.i32,
                   CFG: nvfly.Constexpr, GROUPS: nvfly.Constexpr, LAYOUT: nvfly.Constexpr,
                   A_MAJOR: nvfly.Constexpr, B_MAJOR: nvfly.Constexpr, FUSE: nvfly.Constexpr):
    """``m``: the rows bound (contiguous: T, masked: Mmax, kgrouped: M); ``n``: the output columns (silu_mul: I);
    ``k``: K (kgrouped: sum K); ``k_tiles``: k-blocks of K (kgrouped: unused). silu_mul: B's up columns start
    at column n (= I). ``out_desc``: the output's TMA descriptor when ``CFG.tma_store`` (contiguous: 2-D [T, N];
    masked, kgrouped: 3-D [E, M, N]; its box ``store_box`` of the output tile's config), else None."""
    dtype = a_desc.info.dtype
    size = dtype.itemsize
    BM, BN, S, WGS = CFG.bm, CFG.bn, CFG.stages, CFG.consumers
    BK = CFG.bk(size)
    WG_M = CFG.wg_m
    ATOMS_M = WG_M // 64
    THREADS = 128 * (1 + WGS)
    RAGGED = LAYOUT != "kgrouped"
    FUSED = FUSE == "silu_mul"
    A_RANK3 = a_desc.info.rank == 3
    B_RANK3 = b_desc.info.rank == 3
    atom = sm90.WgmmaAtom(BN, dtype, dtype, A_MAJOR, B_MAJOR)
    A_SW = a_desc.info.swizzle
    B_SW = b_desc.info.swizzle
    a_layout = sm90.operand_layout(BM, BK, dtype, A_MAJOR, A_SW)
    b_layout = sm90.operand_layout(BN, BK, dtype, B_MAJOR, B_SW)
    CM, CN = CFG.cluster_m, CFG.cluster_n
    CS = CM * CN  # blocks per cluster (plan: along M or N, not both)
    a_parts = sm90.operand_boxes(a_layout, BM, BK, dtype, A_MAJOR, A_SW, parts=CN)[1]  # cluster_n: A's halves
    # fused: the gate and up halves; a cluster: each block's slice of B, multicast to both (plan: not both)
    b_parts = sm90.operand_boxes(b_layout, BN, BK, dtype, B_MAJOR, B_SW, parts=2 if FUSED else CM)[1]
    a_lbo, a_sbo = sm90.descriptor_offsets(a_layout, dtype, A_MAJOR, A_SW)
    b_lbo, b_sbo = sm90.descriptor_offsets(b_layout, dtype, B_MAJOR, B_SW)
    A_BYTES = BM * BK * size
    STAGE_BYTES = A_BYTES + BN * BK * size
    OUT_BN = BN // 2 if FUSED else BN  # output columns of a tile
    # ping-pong consumers (whole tiles each, one's epilogue under the other's mainloop) and the TMA-store epilogue
    # (staged in the output tile's geometry: fused, OUT_BN columns)
    PINGPONG = CFG.pingpong
    TMA_STORE = CFG.tma_store
    OUT_CFG = replace(CFG, bn=OUT_BN)
    OUT_BATCHED = LAYOUT != "contiguous"  # the contiguous output is [T, N]

    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (2 * S,)))
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (S * STAGE_BYTES,), offset_bytes=BARRIER_BYTES))
    # with a cluster, a stage is free once the consumers of both blocks are done: each multicast slice lands in both
    pipe = sm90.TmaPipeline(bars, S, STAGE_BYTES, consumer_arrivals=4 * (1 if PINGPONG else WGS) * CS)
    if TMA_STORE:
        check_store_descriptor(out_desc, OUT_CFG, OUT_BATCHED)
        assert OUT_CFG.staging_bytes() <= CFG.staging_bytes()  # a fused tile stages into its config's buffers
        staging = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (CFG.staging_bytes(),),
                                                           offset_bytes=CFG.ring_end(size)))

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    wg = warp // 4
    init_ring(pipe, tid, a_desc, b_desc, out_desc, TMA_STORE)
    table = None
    if RAGGED:  # the groups' first tile rows (cluster rows), from the device sizes; after the staging buffers
        table, totals = group_table(CFG.smem_bytes(size), GROUPS)
        fill_group_table(table, totals, offs, m, tid, lane, warp, THREADS, BM * CM, LAYOUT, GROUPS)
    if CS > 1:
        sm90.cluster_sync()  # every block's barriers (and table) exist before any multicast or remote arrive
    else:
        nvfly.syncthreads()  # the barriers (and the table) exist before anyone uses them
    rank = nvfly.block_rank_in_cluster() if CS > 1 else 0
    TILING = Tiling(BM, OUT_BN, CFG.group_m, cluster_m=CM, groups=GROUPS if RAGGED else 0, cluster_n=CN)
    first_tile, tile_step, tiles, num_units = persistent_units(m, n, 1 if RAGGED else GROUPS, k_tiles, table, TILING)

    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            state = sm90.PipelineState.start(S)
            for tile in range(first_tile, num_units, tile_step):
                g, tm, tn, split, k_begin, k_end, slot, contributors = unit_work(tile, tiles, rank, TILING)
                row_base, k_base, blocks = group_work(offs, g, tm, m, k, k_tiles, BM, BK, LAYOUT, GROUPS)
                for kt in range(blocks):
                    base, full = fill_stage(pipe, state, ring, STAGE_BYTES)
                    for r in nvfly.static_range(CN):
                        # cluster_n: this block loads slice r of A (for every block of the cluster); else all of it
                        if CN == 1 or rank == r:
                            load_boxes(a_desc, a_parts[r], row_base, k_base + kt * BK, A_MAJOR, base, full,
                                       g if A_RANK3 else None, multicast_mask=(1 << CN) - 1 if CN > 1 else None)
                    if FUSED:
                        for part in nvfly.static_range(len(b_parts)):
                            # the second half of the tile holds the up columns, n further on
                            load_boxes(b_desc, b_parts[part], tn * OUT_BN + part * (n - OUT_BN), k_base + kt * BK,
                                       B_MAJOR, base + A_BYTES, full, g if B_RANK3 else None)
                    else:
                        for r in nvfly.static_range(CM):
                            # cluster_m: this block loads slice r of B (for every block of the cluster)
                            if CM == 1 or rank == r:
                                load_boxes(b_desc, b_parts[r], tn * OUT_BN, k_base + kt * BK, B_MAJOR,
                                           base + A_BYTES, full, g if B_RANK3 else None,
                                           multicast_mask=(1 << CM) - 1 if CM > 1 else None)
                    state = state.advance()
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        consumer = wg - 1
        a_part = 0 if PINGPONG else consumer  # which WG_M-row slice of the A tile this consumer reads
        warp_in_wg = warp % 4
        state = sm90.PipelineState.start(S)
        own_first, own_step = first_tile, tile_step
        if PINGPONG:
            # consumer c takes every other tile of this block, starting with its c-th; the ring holds the other
            # consumer's k-blocks (its group's count) in between
            state = state.advance_by(consumer * tile_blocks(first_tile, num_units, tiles, offs, m, k, k_tiles, BM,
                                                            BK, LAYOUT, GROUPS, TILING))
            own_first, own_step = first_tile + consumer * tile_step, 2 * tile_step
        turn = consumer  # ping-pong: the first tile of consumer 0 needs no turn
        # CFG.store_tiles > 1: this consumer's tiles so far (its position in the staging ring)
        staged = nvfly.i32(0) if CFG.store_tiles > 1 else None
        for tile in range(own_first, num_units, own_step):
            g, tm, tn, split, k_begin, k_end, slot, contributors = unit_work(tile, tiles, rank, TILING)
            row_base, k_base, blocks = group_work(offs, g, tm, m, k, k_tiles, BM, BK, LAYOUT, GROUPS)
            # the epilogue's row bound, read before the mainloop so that its loads of offs do not wait after it
            row_end = group_rows_end(offs, g, m, LAYOUT, GROUPS)
            if PINGPONG:
                if turn > 0:
                    nvfly.named_barrier(2 + consumer, 256)  # wait until the other consumer issued its wgmmas
                turn = turn + 1

            tile_row = row_base + a_part * WG_M  # the consumer's first output row

            def own_tile(state, staged):
                # the consumer's share of the tile: its mainloop, then the epilogue of its rows
                def k_block(accs, stage, state, kt, first):
                    if LAYOUT == "kgrouped":
                        clear_k_tail(ring, state.stage * STAGE_BYTES, offs, g, k, k_base, kt, consumer, a_part,
                                     warp_in_wg * 32 + lane, WG_M, BK, A_SW, size, GROUPS)
                    return issue_k_block(atom, accs, stage, a_layout, b_layout, a_part, (a_lbo, a_sbo, A_SW),
                                         (b_lbo, b_sbo, B_SW), A_BYTES, WG_M, BK, size, first)

                accs = [sm90.Accumulator.undefined(atom) for _ in range(ATOMS_M)]
                # the first k-block starts the accumulators (scale-d 0): no instruction but wgmma writes them;
                # ping-pong: once this tile's wgmmas are issued, it is the other consumer's turn to issue
                accs, state = consume_k_blocks(pipe, state, ring, STAGE_BYTES, 0, blocks, lane, accs, k_block, CS,
                                               (lambda: nvfly.named_barrier_arrive(3 - consumer, 256)) if PINGPONG
                                               else None)
                if PINGPONG:  # skip the other consumer's next tile
                    state = state.advance_by(tile_blocks(tile + tile_step, num_units, tiles, offs, m, k, k_tiles, BM,
                                                         BK, LAYOUT, GROUPS, TILING))
                row0 = tile_row + warp_in_wg * 16 + lane // 4
                col0 = tn * OUT_BN + 2 * (lane % 4)
                batch = 0 if LAYOUT == "contiguous" else g
                values = silu_mul(accs, ATOMS_M, BN) if FUSED else accs
                if TMA_STORE:
                    own = staging + consumer * (CFG.staging_bytes() // WGS)
                    if RAGGED:
                        # rows inside the group: TMA (clips N); a slice across the group's end (it would write the
                        # next group's rows) or past it (a cluster's padding row): registers, masked
                        if tile_row + WG_M <= row_end:
                            stage_tile(out_desc, None, values, own, batch, tile_row, tn * OUT_BN, row0, col0, m, n,
                                       1.0, 0.0, consumer, warp_in_wg, lane, OUT_CFG, ATOMS_M, Epilogue(), OUT_BATCHED,
                                       False)
                        else:
                            store_tile(out, None, values, batch, row0, col0, row_end, n, 1.0, 0.0, OUT_BN, ATOMS_M,
                                       Epilogue(), False)
                    else:  # kgrouped: TMA clips the tile at M and N (every tile is staged: store_tiles may rotate)
                        stage_tile(out_desc, None, values, own, batch, tile_row, tn * OUT_BN, row0, col0, m, n, 1.0,
                                   0.0, consumer, warp_in_wg, lane, OUT_CFG, ATOMS_M, Epilogue(), OUT_BATCHED, False,
                                   staged)
                        if staged is not None:
                            staged = staged + 1
                else:
                    inside = (row_base + (a_part + 1) * WG_M <= row_end) & (tn * OUT_BN + OUT_BN <= n)
                    store_tile(out, None, values, batch, row0, col0, row_end, n, 1.0, 0.0, OUT_BN, ATOMS_M, Epilogue(),
                               inside)
                return state, staged

            if CFG.skip_empty:
                # a group's last tile row ending in the first consumer's rows: the second skips its wgmmas
                if tile_row < row_end:
                    state = own_tile(state, staged)[0]
                else:
                    state = skip_k_blocks(pipe, state, 0, blocks, lane, CS)
            else:
                state, staged = own_tile(state, staged)
        if TMA_STORE:
            if (warp_in_wg == 0) & (lane == 0):
                sm90.tma_store_wait(0, read_only=False)  # the block's shared memory outlives its last stores
    if CS > 1:
        sm90.cluster_sync()  # no block leaves while a peer may still multicast into it or arrive on it


@nvfly.func
def tile_blocks(tile, num_units, tiles, offs, m, k, k_tiles, BM, BK, LAYOUT, GROUPS, TILING):
    """The k-blocks of unit ``tile`` (0 past the block's last unit): how far a ping-pong consumer skips the other's
    tile in the ring."""
    g, tm, tn, split, k_begin, k_end, slot, contributors = unit_work(
        nvfly.maximum(nvfly.minimum(tile, num_units - 1), 0), tiles, 0, TILING)
    row_base, k_base, blocks = group_work(offs, nvfly.maximum(nvfly.minimum(g, GROUPS - 1), 0), tm, m, k, k_tiles, BM,
                                          BK, LAYOUT, GROUPS)
    return nvfly.select(tile < num_units, blocks, 0)


@nvfly.func
def k_end_of(offs, g, k, GROUPS):
    start, end = clamped_range(offs, g, k, "kgrouped", GROUPS)
    return end


@nvfly.func
def clear_k_tail(ring, stage, offs, g, k, k_base, kt, consumer, a_part, t, WG_M, BK, A_SW, size, GROUPS):
    """kgrouped: when k-block ``kt`` of group ``g`` runs past the group's K, zero the A columns past it of the
    consumer's row slice ``a_part`` (``zero_k_tail``) and sync the consumer's warpgroup before its wgmmas read
    them."""
    valid = k_end_of(offs, g, k, GROUPS) - k_base - kt * BK
    if valid < BK:
        zero_k_tail(ring, stage, a_part, valid, t, WG_M, BK, A_SW, size)
        nvfly.named_barrier(STORE_BARRIER + consumer, 128)


@nvfly.func
def zero_k_tail(ring, stage, a_part, valid, t, WG_M, BK, A_SW, size):
    """Zero the K columns from ``valid`` on of row slice ``a_part`` (WG_M rows) of the MN-major A tile at byte
    ``stage`` of the ring (shared address ``ring``; thread ``t`` of the consumer's 128), then fence the writes for
    wgmma (``a_tail_offset`` places the lines). A K row of a swizzle-wide MN chunk is one line of A_SW bytes
    whatever the swizzle, so each thread zeroes whole lines. (K-major operands are declined in this layout: a
    group's K start would be a TMA coordinate of the contiguous dimension.)"""
    WIDTH = A_SW // size
    LINES = WG_M // WIDTH * BK
    if t < LINES:
        kr = t % BK
        if kr >= valid:
            line = ring + stage + a_tail_offset(a_part * WG_M + t // BK * WIDTH, kr, BK, A_SW, size)
            zero = nvfly.i32(0)
            for q in nvfly.static_range(A_SW // 16):
                store_shared(line + 16 * q, [zero, zero, zero, zero])
    sm90.fence_proxy_async()


def a_tail_offset(r: Any, c: Any, bk: int, swizzle: int, size: int) -> Any:
    """Byte offset of K row c of the swizzle-wide MN chunk holding row r (a multiple of the chunk width) in an
    MN-major A tile of the kernel's layout (``sm90.operand_layout`` with ``swizzle``; ``tests/test_grouped_cpu.py``
    checks it against the layout)."""
    width = swizzle // size
    return (r // width) * (width * bk * size) + c * swizzle


@nvfly.func
def silu_mul(accs, ATOMS_M, BN):
    """silu(gate) * up of a fused gate/up tile: fragment column group j < BN/16 holds gate columns, j + BN/16 the
    up columns of the same outputs (element 4j + q of an atom's fragments is column 8j + ...)."""
    HALF = BN // 16
    values = []
    for i in nvfly.static_range(ATOMS_M):
        row = []
        for j in nvfly.static_range(HALF):
            for q in nvfly.static_range(4):
                gate = accs[i][4 * j + q]
                up = accs[i][4 * (j + HALF) + q]
                row.append(activate(gate, "silu") * up)
        values.append(row)
    return values
