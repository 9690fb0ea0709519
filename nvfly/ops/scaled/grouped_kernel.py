"""The grouped scaled (FP8) GEMM kernel (MoE experts with DeepSeek-V3's block scales, torch's row-wise ones, or MX
e8m0 scales with MXFP8 or MXFP4 weights): one persistent warp-specialised TMA + fp8 wgmma launch walks every
group's tiles, the grouped bf16 GEMM's schedule with the scaled GEMM's promotion mainloop.

Group g computes out_g = (A_g * sa_g) @ (B_g * sb_g)^T with A and B K-major e4m3 (as ``torch._scaled_grouped_mm``:
a row-major, b column-major) in one of two layouts (``LAYOUT``, ``nvfly.ops.common.groups``):

- "contiguous": tokens sorted by expert in A [T, K], group g the rows [offs[g-1], offs[g]), weights B [E, N, K]
  (the kernel's view), out [T, N]; one 2-D descriptor covers all tokens, a 3-D one all experts (the group is the
  batch coordinate): a tile past its group's end loads rows of the next group that the epilogue does not store;
- "masked": A [E, Mmax, K], group g its first counts[g] rows, out [E, Mmax, N].

Each block fills the groups' first tile rows from the device sizes (``fill_group_table``) and walks its tiles with
the shared scheduler (``Tiling(groups=...)``), as the grouped bf16 kernel. Warpgroup 0's first thread keeps the
ring of 128-wide k-blocks full; consumers 1..C own BM / C rows of a tile each. Scales (``ScaledEpilogue.scaling``):

- "block": sa per token and 128 of K (contiguous [T, K/128], masked [E, Mmax, K/128]), sb per 128 x 128 block of
  the expert's weight ([E, N/128, K/128] in the kernel's orientation); every k-block is issued into fresh
  accumulators and added, times sa[row, kb] * sb[g, n-block, kb], into fp32 sums once done (``promote_k_blocks``
  with the scaled GEMM's ``promotion_scales`` and ``promote``): DeepGEMM's scheme; with ``CFG.staged_scales`` the
  producer also TMA-loads the tile rows' sa of the k-block into the stage (the dense kernel's slot; a contiguous
  tile's rows start anywhere: its box starts at the row rounded down to SCALE_ALIGN rows, 16 bytes, and is
  SCALE_ALIGN rows longer), and the consumers read them from shared memory; tiles up to 192 wide (in order)
  read one sb per 128-wide weight block their columns cross (``weight_runs``), as the dense kernel's;
- "row": sa per token (contiguous [T], masked [E, Mmax]), sb per expert and column ([E, N]) applied in the
  epilogue; with ``EPI.promote`` (torch's use_fast_accum=False) each k-block is still added into fp32 sums,
  else the tensor core accumulates all of K (``consume_k_blocks``);
- "mxfp8" / "mxfp4": e8m0 sa per token and 32 of K (contiguous [T, K/32], masked [E, Mmax, K/32]) and sb per
  expert, column and 32 of K ([E, N, K/32]); each wgmma k-step is promoted with sa[row, ks] * sb[g, col, ks] (the
  dense kernel's MX mainloop, ``promotion_scales`` batched by group). MXFP4 weights (``CFG.packed_b``) arrive as
  packed e2m1 [E, N, K/2] bytes (a 3-D descriptor, one unswizzled BN x 64-byte box a k-block behind the stage's
  e4m3 tile), which the consumers convert into that tile before its wgmmas, as the dense kernel's.

With ``CFG.cluster_n`` 2, two blocks take tile columns 2j and 2j + 1 of one tile row (one group's rows): each
TMA-loads half of the A tile and multicasts it to both, and a stage is released on both blocks' barriers (the
grouped bf16 kernel's clusters along N); a last cluster column past N is computed and not stored. With
``CFG.stream_b`` (or ``stream_a``) the operands' TMA loads carry L2 eviction hints (``load_hint``).

The epilogue stores bf16/fp16/fp32 through registers, masked at the group's end (``store_tile``); with
``CFG.tma_store`` (16-bit outputs) a consumer's rows that lie inside their group are staged in shared memory and
TMA-stored instead (``stage_tile``, the dense kernels' epilogue; the grouped bf16 kernel's rule), the others still
through registers.
"""
from __future__ import annotations

import functools

import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.ops.common.epilogue import check_store_descriptor, stage_tile, store_tile
from nvfly.ops.common.gemm_config import CONSUMER_REGS, PRODUCER_REGS, Epilogue, load_hint
from nvfly.ops.common.groups import fill_group_table, group_rows_end, group_table, group_work
from nvfly.ops.common.mainloop import init_ring, load_boxes, produce_tiles, skip_k_blocks
from nvfly.ops.common.scheduler import Tiling, persistent_units, unit_work
from nvfly.ops.scaled.config import BK, SCALE_ALIGN
from nvfly.ops.scaled.kernel import batched, fp8_mainloop, fp8_ring, k_major_tiles, promotion_scales

GROUPED_LAYOUTS = ("contiguous", "masked")
GROUPED_SCALINGS = ("block", "row", "mxfp8", "mxfp4")


@nvfly.kernel
def scaled_grouped_kernel(a_desc: nvfly.TmaDescriptor, b_desc: nvfly.TmaDescriptor, out: nvfly.Tensor, out_desc,
                          offs: nvfly.Tensor, sa_desc, scale_a: nvfly.Tensor, scale_b: nvfly.Tensor, m: nvfly.i32,
                          n: nvfly.i32, k_tiles: nvfly.i32, CFG: nvfly.Constexpr, GROUPS: nvfly.Constexpr,
                          LAYOUT: nvfly.Constexpr, EPI: nvfly.Constexpr):
    """``m``: the rows bound (contiguous: T, masked: Mmax); ``offs``: the cumulative ends (contiguous) or the
    counts (masked), int32 [GROUPS]; ``out``: [1, T, N] (contiguous) or [E, Mmax, N]; ``sa_desc``
    (``CFG.staged_scales``, else None): scale_a seen as [K/128, T] (contiguous) or [K/128, E, Mmax] (masked), boxes
    of one k-block's BM rows (contiguous: BM + SCALE_ALIGN); ``out_desc`` (``CFG.tma_store``, else None): the
    16-bit output's TMA descriptor, [T, N] (contiguous) or [E, Mmax, N], ``store_box``'s boxes."""
    dtype = a_desc.info.dtype
    BM, BN, S, WGS = CFG.bm, CFG.bn, CFG.stages, CFG.consumers
    WG_M = CFG.wg_m
    ATOMS_M = WG_M // 64
    THREADS = 128 * (1 + WGS)
    MASKED_A = LAYOUT == "masked"  # A, its scales and the output batched by group
    atom = sm90.WgmmaAtom(BN, dtype, nvfly.f8e4m3 if CFG.packed_b else b_desc.info.dtype, "K", "K")
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    wg = warp // 4
    # contiguous staged scales: boxes from the tile's first row rounded down to 16 bytes, SCALE_ALIGN rows longer
    ALIGNED_SCALES = CFG.staged_scales and not MASKED_A
    ring, pipe = fp8_ring(CFG, SCALE_ALIGN if ALIGNED_SCALES else 0)  # then the TMA-store staging, the group table
    TMA_STORE = CFG.tma_store
    staging = None
    if TMA_STORE:
        check_store_descriptor(out_desc, CFG, MASKED_A)
        staging = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (CFG.staging_bytes(),),
                                                           offset_bytes=CFG.ring_end))
    init_ring(pipe, tid, a_desc, b_desc, out_desc, TMA_STORE)
    table, totals = group_table(CFG.smem_bytes(), GROUPS)
    fill_group_table(table, totals, offs, m, tid, lane, warp, THREADS, BM, LAYOUT, GROUPS)
    CN = CFG.cluster_n
    if CN > 1:
        sm90.cluster_sync()  # every block's barriers (and table) exist before any multicast or remote arrive
    else:
        nvfly.syncthreads()  # the barriers and the table exist before anyone uses them
    rank = nvfly.block_rank_in_cluster() if CN > 1 else 0
    TILING = Tiling(BM, BN, CFG.group_m, groups=GROUPS, cluster_n=CN)
    first_tile, tile_step, tiles, num_units = persistent_units(m, n, 1, k_tiles, table, TILING)

    tiles_of = k_major_tiles(BM, BN, dtype)
    b_boxes = tiles_of[3]
    # cluster_n: block r loads slice r of the A tile (the cluster's shared rows) and multicasts it to both
    a_parts = sm90.operand_boxes(tiles_of[0], BM, BK, dtype, "K", 128, CN)[1]
    A_BYTES = BM * BK
    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            def tile_loads(work):
                g = work.batch
                row_base, k_base, blocks = group_work(offs, g, work.tile_m, m, 0, k_tiles, BM, BK, LAYOUT, GROUPS)

                def load(kt, base, full):
                    for r in nvfly.static_range(CN):
                        if CN == 1 or rank == r:
                            load_boxes(a_desc, a_parts[r], row_base, kt * BK, "K", base, full,
                                       g if MASKED_A else None, multicast_mask=(1 << CN) - 1 if CN > 1 else None,
                                       cache_hint=load_hint(CFG, "A"))
                    if CFG.packed_b:  # e2m1 pairs: one unswizzled BN x 64-byte box, behind the e4m3 tile
                        sm90.tma_load(b_desc, base + A_BYTES + BN * BK, (g, work.tile_n * BN, kt * (BK // 2)), full,
                                      cache_hint=load_hint(CFG, "B"))
                    else:
                        load_boxes(b_desc, b_boxes, work.tile_n * BN, kt * BK, "K", base + A_BYTES, full, g,
                                   cache_hint=load_hint(CFG, "B"))
                    if CFG.staged_scales:  # the tile rows' sa[:, kt] (rows past the operand: TMA's zeros)
                        rows = (g, row_base) if MASKED_A else (row_base // SCALE_ALIGN * SCALE_ALIGN,)
                        sm90.tma_load(sa_desc, base + CFG.scales_offset, (kt,) + rows, full)
                return 0, k_tiles, load

            produce_tiles(pipe, ring, CFG.stage_bytes, S, first_tile, num_units, tile_step, tiles, TILING, tile_loads,
                          rank)
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        consumer = wg - 1
        warp_in_wg = warp % 4
        state = sm90.PipelineState.start(S)
        for tile in range(first_tile, num_units, tile_step):
            work = unit_work(tile, tiles, rank, TILING)
            g = work.batch
            row_base, k_base, blocks = group_work(offs, g, work.tile_m, m, 0, k_tiles, BM, BK, LAYOUT, GROUPS)
            row0 = row_base + consumer * WG_M + warp_in_wg * 16 + lane // 4
            col0 = work.tile_n * BN + 2 * (lane % 4)
            a_group = g if MASKED_A else None
            # a cluster's last column may lie past N (computed, not stored): its weight scales read the last block's
            scale_col = nvfly.minimum(col0, n - 1) if CN > 1 else col0
            scales_of = functools.partial(promotion_scales, scale_a, scale_b, row0, scale_col, m=m, n=n, BN=BN,
                                          ATOMS_M=ATOMS_M, EPI=EPI, a_group=a_group, b_group=g)
            if CFG.staged_scales:  # sa from the stage: the thread's first row's word in its slot
                box_row = row_base // SCALE_ALIGN * SCALE_ALIGN if ALIGNED_SCALES else row_base
                scales_of = functools.partial(scales_of, staged_row=CFG.scales_offset + 4 * (row0 - box_row))
            row_end = group_rows_end(offs, g, m, LAYOUT, GROUPS)
            tile_row = row_base + consumer * WG_M  # the consumer's first output row
            if CFG.skip_empty:
                if tile_row < row_end:
                    state = consumer_tile(pipe, state, ring, atom, tiles_of, consumer, k_tiles, lane, tid, scales_of,
                                          out, out_desc, staging, scale_a, scale_b, a_group, g, work.tile_n, row0,
                                          col0, row_end, tile_row, warp_in_wg, m, n, CFG, EPI, MASKED_A)
                else:
                    state = skip_k_blocks(pipe, state, 0, k_tiles, lane, CN)
            else:
                state = consumer_tile(pipe, state, ring, atom, tiles_of, consumer, k_tiles, lane, tid, scales_of, out,
                                      out_desc, staging, scale_a, scale_b, a_group, g, work.tile_n, row0, col0,
                                      row_end, tile_row, warp_in_wg, m, n, CFG, EPI, MASKED_A)
        if TMA_STORE:
            if (warp_in_wg == 0) & (lane == 0):
                sm90.tma_store_wait(0, read_only=False)  # the block's shared memory outlives its last stores
    if CN > 1:
        sm90.cluster_sync()  # no block leaves while a peer may still multicast into it or arrive on it


@nvfly.func
def consumer_tile(pipe, state, ring, atom, tiles_of, consumer, k_tiles, lane, tid, scales_of, out, out_desc, staging,
                  scale_a, scale_b, a_group, g, tile_n, row0, col0, row_end, tile_row, warp_in_wg, m, n, CFG, EPI,
                  MASKED_A):
    """A consumer's share of one tile: the mainloop over its k-blocks, then the epilogue of its rows. Returns the
    ring state after the tile."""
    BN, WG_M, WGS = CFG.bn, CFG.wg_m, CFG.consumers
    ATOMS_M = WG_M // 64
    accs, state = fp8_mainloop(pipe, state, ring, atom, tiles_of, consumer, 0, k_tiles, lane, tid, scales_of, CFG,
                               EPI)
    if EPI.scaling == "row":
        accs = row_scaled(accs, scale_a, scale_b, a_group, g, row0, col0, m, n, BN, ATOMS_M)
    if CFG.tma_store:
        # rows inside the group: staged and TMA-stored (clips N), drained under the next tile's mainloop; else
        # registers, masked at the group's end (a TMA store would write the next group's rows)
        if tile_row + WG_M <= row_end:
            stage_tile(out_desc, None, accs, staging + consumer * (CFG.staging_bytes() // WGS), g, tile_row,
                       tile_n * BN, row0, col0, m, n, 1.0, 0.0, consumer, warp_in_wg, lane, CFG, ATOMS_M, Epilogue(),
                       MASKED_A, False)
        else:
            store_tile(out, None, accs, g if MASKED_A else 0, row0, col0, row_end, n, 1.0, 0.0, BN, ATOMS_M,
                       Epilogue(), False)
    else:
        inside = (tile_row + WG_M <= row_end) & (tile_n * BN + BN <= n)
        store_tile(out, None, accs, g if MASKED_A else 0, row0, col0, row_end, n, 1.0, 0.0, BN, ATOMS_M, Epilogue(),
                   inside)
    return state


def row_scaled(accs: list, scale_a, scale_b, a_group, g, row0, col0, m, n, BN: int, ATOMS_M: int) -> list:
    """The consumer's fragments times sa[row] * sb[g, col] (row-wise scales; element 4j + 2h + c of atom i is
    (row0 + 64i + 8h, col0 + 8j + c)), the reads clamped into range (the masked store drops the rows and columns
    outside)."""
    rows = [batched(scale_a, a_group, nvfly.minimum(row0 + 64 * i + 8 * h, m - 1)) for i in range(ATOMS_M)
            for h in range(2)]
    cols = [scale_b[g, nvfly.minimum(col0 + 8 * j + c, n - 1)] for j in range(BN // 8) for c in range(2)]
    return [accs[i].map(lambda v, e, i=i: v * rows[2 * i + (e // 2) % 2] * cols[2 * (e // 4) + e % 2])
            for i in range(ATOMS_M)]
