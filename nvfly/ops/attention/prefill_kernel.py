"""Prefill attention: softmax(q kᵀ scale + mods) v for long query sequences, compute-bound, on Hopper's TMA and wgmma.

    q [B, Sq, Hq, Dqk], k [B, Skv, Hkv, Dqk], v [B, Skv, Hkv, Dv] through 4-D TMA descriptors (any strides with the
    last dimension contiguous); out [B, Sq, Hq, Dv]; lse [B, Hq, Sq] f32 (natural log) or None. Packed sequences
    (``PLAN.varlen``): B = 1 and sequence b (block z) is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q, out and lse
    and cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v.

Grid (query tiles, Hq, B), heaviest causal tiles first (block x counts down the tiles). A CTA is a producer
warpgroup and ``consumers`` consumer warpgroups (``prefill_plan``). The producer's thread 0 loads the Q tile once
(its own mbarrier) and then K and V of each key block it needs into two ``stages``-deep rings (full/empty
mbarriers, ``sm90.TmaPipeline``): separate rings let S = Q Kᵀ start as soon as K lands. TMA zero-fills rows past
Sq and Skv (the S dimension is its own descriptor dimension: nothing leaks across sequences), so tails read zeros
and are masked, never NaN. Packed sequences share the S dimension: a tile's rows past its sequence read the next
sequence's (finite) rows, which the tail mask drops and whose output rows are not stored.

A consumer warpgroup owns 64 query rows. Per key block: S (64 x block_n f32) = Q Kᵀ by wgmma from shared memory
(K-major K), K's stage released; the score_mod if any (on the scaled score; the mods see the batch, the query head,
the row and the key in the sequence); the online softmax keeps each thread's two rows' maximum (score units) and
thread-partial sum, with the scale folded into exp2's one FFMA (p = exp2(s · scale·log2e − max · scale·log2e), or
log2e after a score_mod); O is rescaled in registers; P is rounded to the input type and fed as the A operand of
O += P V straight from registers (register-A wgmma, V MN-major from the ring: no transpose in shared memory), then
V's stage is released.

Which key blocks: without a BlockMask, ``prefill_plan.key_blocks`` splits a tile's blocks by the causal and window
bounds into blocks fully visible to the whole tile, run without any positional mask, and edge blocks (a window's
left edge, the causal diagonal, the sequence's tail) that apply it; blocks outside the bounds are never loaded. A
mask_mod is evaluated on every loaded block. With a BlockMask (``PLAN.kv_block``), the producer and the consumers
walk its partial list (positional bounds and the mask_mod) then its full list (positional bounds only) for the
tile's query block; unlisted blocks are never loaded. The end divides by the quad-reduced sum (rows with no key:
zeros, LSE −inf) and stores O as 4-byte pairs straight from registers.

fp8 (``PLAN.fp8``): e4m3 Q, K and V, both GEMMs QGMMA, P rounded to e4m3 in its register fragments; fp8 wgmma reads
B K-major only, so V comes transposed, (B, Dv, Hkv, Skv) with its keys permuted within every 16 to the columns P's
fragments hold (``prefill_api.transposed_values``), and its stages are K-major (Dv x block_n). The descales are
read once per consumer (``descale_factor``: per tensor, or with ``PLAN.per_head_descales`` at the CTA's batch and
KV head): q's and k's multiply the folded scale, v's the final 1/l; out is bf16.

Persistent (``PLAN.persistent``): a grid of min(units, SMs) CTAs, each walking the units (query tile, head, batch)
b, b + grid, ... in ``scheduler.head_grouped_lpt_unit``'s order (longest causal tiles first within groups of
(batch, head) pairs whose K and V fit L2). The producer and the consumers walk the same units with the same
per-tile code; the K and V rings' positions carry over, Q has a one-stage full/empty ring (the next unit's Q lands
once both consumers' last S of the previous one is done; O is stored from registers, so Q's buffer is free then),
and consumer 0's first ping-pong arrive happens once for the walk, every unit repeating the same waits and arrives.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.frontend.control_flow import if_
from nvfly.ops.attention.mods import apply_mask_mod, apply_score_mod
from nvfly.ops.attention.prefill_plan import (BARRIER_BYTES, CONSUMER_REGS, PINGPONG_BARRIER, PRODUCER_REGS,
                                                  block_inside_bounds, key_blocks, pair_group, pipelined_loops,
                                                  upper_inside_end)
from nvfly.ops.attention.softmax import EXP2_CUBIC, EXP2_POLYNOMIAL, LN2, LOG2E, NEG_INF, online_softmax, row_of
from nvfly.ops.common.scheduler import head_grouped_lpt_unit, unpack_unit

# ``attend_block``'s MASKED besides True (every positional bound) and False (none), with ``PLAN.hoist``: only a
# window's lower bound (blocks inside the causal bound and Skv), only the upper bounds (blocks inside the window's)
LOWER_BOUND = "lower"
UPPER_BOUNDS = "upper"


@nvfly.kernel
def attention_prefill_kernel(q_desc: nvfly.TmaDescriptor, k_desc: nvfly.TmaDescriptor, v_desc: nvfly.TmaDescriptor,
                             out: nvfly.Tensor, lse, cu_seqlens_q, cu_seqlens_k, captured0, captured1, kv_num_blocks,
                             kv_indices, full_kv_num_blocks, full_kv_indices, q_descale, k_descale, v_descale,
                             unit_table, sq: nvfly.i32, skv: nvfly.i32,
                             group: nvfly.i32, bottom_right: nvfly.i32, left: nvfly.i32, right: nvfly.i32,
                             scale_log2: nvfly.f32, PLAN: nvfly.Constexpr, MODS: nvfly.Constexpr):
    dtype = q_desc.info.dtype
    size = dtype.itemsize
    BM, BN, S, WGS = PLAN.block_m, PLAN.block_n, PLAN.stages, PLAN.consumers
    DQK, DV = PLAN.dqk, PLAN.dv
    SWIZZLE = PLAN.swizzle
    V_MAJOR = "K" if PLAN.fp8 else "MN"  # fp8: V transposed in global memory (fp8 wgmma has no transpose)
    s_atom = sm90.WgmmaAtom(BN, dtype, dtype, "K", "K")
    pv_atom = sm90.WgmmaAtom(DV, dtype, dtype, "K", V_MAJOR, a_source="registers")
    q_layout = sm90.operand_layout(BM, DQK, dtype, "K", SWIZZLE)
    k_layout = sm90.operand_layout(BN, DQK, dtype, "K", SWIZZLE)
    V_SWIZZLE = PLAN.v_swizzle
    v_layout = sm90.operand_layout(DV, BN, dtype, V_MAJOR, V_SWIZZLE)
    q_boxes = sm90.operand_boxes(q_layout, BM, DQK, dtype, "K", SWIZZLE)[1][0]
    k_boxes = sm90.operand_boxes(k_layout, BN, DQK, dtype, "K", SWIZZLE)[1][0]
    v_boxes = sm90.operand_boxes(v_layout, DV, BN, dtype, V_MAJOR, V_SWIZZLE)[1][0]
    q_desc_offsets = sm90.descriptor_offsets(q_layout, dtype, "K", SWIZZLE) + (SWIZZLE,)
    k_desc_offsets = sm90.descriptor_offsets(k_layout, dtype, "K", SWIZZLE) + (SWIZZLE,)
    v_desc_offsets = sm90.descriptor_offsets(v_layout, dtype, V_MAJOR, V_SWIZZLE) + (V_SWIZZLE,)
    Q_BYTES = PLAN.q_bytes(size)
    K_BYTES = PLAN.k_stage_bytes(size)
    V_BYTES = PLAN.v_stage_bytes(size)

    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (1 + 4 * S + 2 * PLAN.persistent,)))
    q_tile = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (Q_BYTES,), offset_bytes=BARRIER_BYTES))
    k_ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (S * K_BYTES,), offset_bytes=BARRIER_BYTES + Q_BYTES))
    v_ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (S * V_BYTES,),
                                                      offset_bytes=BARRIER_BYTES + Q_BYTES + S * K_BYTES))
    q_bar = bars
    k_pipe = sm90.TmaPipeline(bars + 8, S, K_BYTES, consumer_arrivals=4 * WGS)
    v_pipe = sm90.TmaPipeline(bars + 8 + 16 * S, S, V_BYTES, consumer_arrivals=4 * WGS)
    q_pipe = None
    if PLAN.persistent:  # Q's one-stage ring, released by the consumers' warps once their last S of a unit is done
        q_pipe = sm90.TmaPipeline(bars + 8 + 32 * S, 1, Q_BYTES, consumer_arrivals=4 * WGS)

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    wg = warp // 4
    if tid == 0:
        if PLAN.persistent:
            q_pipe.init()
        else:
            sm90.mbarrier_init(q_bar, 1)
        k_pipe.init()
        v_pipe.init()
        sm90.tma_prefetch_descriptor(q_desc)
        sm90.tma_prefetch_descriptor(k_desc)
        sm90.tma_prefetch_descriptor(v_desc)
    nvfly.syncthreads()

    if PLAN.persistent:
        # the CTA walks units first, first + grid, ...: the rings' positions, Q's ring's and the ping-pong turns
        # carry on from one unit to the next (each unit's waits and arrives are the same sequence as a CTA's);
        # each role derives the walk after setting its registers (values live across the branch would spill)
        if wg == 0:
            sm90.setmaxnreg(PLAN.producer_regs, increase=False)
            if tid == 0:
                walk = cta_units(unit_table, out, sq, skv, group, PLAN, size)
                offset = bottom_right * (skv - sq)
                rings = (sm90.PipelineState.start(S), sm90.PipelineState.start(S))
                q_state = sm90.PipelineState.start(1)
                for unit in range(*walk_range(walk, PLAN)):
                    m_block, head, batch = unit_coordinates(unit, unit_table, walk, PLAN)
                    tile = tile_keys(m_block, head, batch, skv, offset, left, right, kv_num_blocks, kv_indices,
                                     full_kv_num_blocks, full_kv_indices, PLAN)
                    q_pipe.producer_acquire(q_state)  # both consumers' last S of the previous unit is done
                    q_pipe.producer_expect(q_state)
                    for box in q_boxes:
                        sm90.tma_load(q_desc, q_tile + box.smem_offset,
                                      (batch, m_block * BM + box.mn_offset, head, box.k_offset), q_pipe.full(0))
                    loads = LoadContext(k_desc, v_desc, k_ring, v_ring, k_pipe, v_pipe, k_boxes, v_boxes, K_BYTES,
                                        V_BYTES, batch, 0, head // group, False)
                    rings = load_tile(rings, loads, tile, batch, head, PLAN)
                    q_state = q_state.advance()
        else:
            sm90.setmaxnreg(PLAN.consumer_regs, increase=True)
            walk = cta_units(unit_table, out, sq, skv, group, PLAN, size)
            offset = bottom_right * (skv - sq)
            consumer = wg - 1
            lane = nvfly.lane_idx()
            fold = scale_log2
            if MODS.score_mod is not None:
                fold = LOG2E
            rings = (sm90.PipelineState.start(S), sm90.PipelineState.start(S))
            q_state = sm90.PipelineState.start(1)
            if PLAN.pingpong and consumer == 0:  # consumer 0 issues its GEMMs first, once for the whole walk
                nvfly.named_barrier_arrive(PINGPONG_BARRIER, 256)
            for unit in range(*walk_range(walk, PLAN)):
                m_block, head, batch = unit_coordinates(unit, unit_table, walk, PLAN)
                tile = tile_keys(m_block, head, batch, skv, offset, left, right, kv_num_blocks, kv_indices,
                                 full_kv_num_blocks, full_kv_indices, PLAN)
                row0 = m_block * BM + consumer * 64 + (warp % 4) * 16 + lane // 4
                ctx = BlockContext(q_tile + consumer * (q_layout.inner((64, 0)) * size), k_ring, v_ring, k_pipe,
                                   v_pipe, s_atom, pv_atom, q_layout, k_layout, v_layout, q_desc_offsets,
                                   k_desc_offsets, v_desc_offsets, K_BYTES, V_BYTES, size, scale_log2 * LN2, fold,
                                   skv, offset - left, offset + right, row0, lane, batch, head,
                                   nvfly.minimum(row0, sq - 1), nvfly.minimum(row0 + 8, sq - 1),
                                   (captured0, captured1), MODS)
                state = Softmax([nvfly.f32(NEG_INF)] * 2, [nvfly.f32(0.0)] * 2, sm90.Accumulator.zeros(pv_atom),
                                rings[0], rings[1])
                if PLAN.pingpong and not PLAN.overlap:
                    scheduler_sync(consumer)
                q_pipe.consumer_wait(q_state)
                state = attend_tile(state, ctx, tile, m_block, skv, offset, right, batch, head, consumer, PLAN)
                if lane == 0:  # every S of the unit has been waited for: the producer may load the next Q
                    q_pipe.consumer_release(q_state)
                if PLAN.pingpong and not PLAN.overlap:
                    scheduler_arrive(consumer)
                store_rows(state, out, lse, batch, head, 0, row0, sq, lane, fold, DV, None)
                rings = (state.k_state, state.v_state)
                q_state = q_state.advance()
        return

    m_block = nvfly.grid_dim.x - 1 - nvfly.block_idx.x  # causal: the longest tiles start first
    head = nvfly.block_idx.y
    batch = nvfly.block_idx.z
    kv_head = head // group
    io_batch = batch  # the batch coordinate of q, k, v, out and lse (0 for packed sequences)
    q_start = 0       # the sequence's first row in them
    k_start = 0
    if PLAN.varlen:
        io_batch = 0
        q_start = cu_seqlens_q[batch]
        k_start = cu_seqlens_k[batch]
        sq = cu_seqlens_q[batch + 1] - q_start
        skv = cu_seqlens_k[batch + 1] - k_start
        skv = nvfly.select(m_block * BM < sq, skv, 0)  # a tile past its sequence's end attends to nothing
    offset = bottom_right * (skv - sq)
    tile = tile_keys(m_block, head, batch, skv, offset, left, right, kv_num_blocks, kv_indices, full_kv_num_blocks,
                     full_kv_indices, PLAN)

    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            sm90.mbarrier_arrive_expect_tx(q_bar, Q_BYTES)
            for box in q_boxes:
                sm90.tma_load(q_desc, q_tile + box.smem_offset,
                              (io_batch, q_start + m_block * BM + box.mn_offset, head, box.k_offset), q_bar)
            loads = LoadContext(k_desc, v_desc, k_ring, v_ring, k_pipe, v_pipe, k_boxes, v_boxes, K_BYTES, V_BYTES,
                                io_batch, k_start, kv_head, PLAN.fp8)
            load_tile((sm90.PipelineState.start(S), sm90.PipelineState.start(S)), loads, tile, batch, head, PLAN)
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        consumer = wg - 1
        lane = nvfly.lane_idx()
        warp_in_wg = warp % 4
        row0 = m_block * BM + consumer * 64 + warp_in_wg * 16 + lane // 4  # the thread's rows: row0, row0 + 8
        for descale in (q_descale, k_descale):  # fp8: scores are (q kᵀ) · q_descale · k_descale
            if descale is not None:
                scale_log2 = scale_log2 * descale_factor(descale, batch, kv_head, PLAN)
        fold = scale_log2  # what turns a score into log2 units: the scale folded into exp2, or log2(e) after a mod
        if MODS.score_mod is not None:
            fold = LOG2E
        ctx = BlockContext(q_tile + consumer * (q_layout.inner((64, 0)) * size), k_ring, v_ring, k_pipe, v_pipe,
                           s_atom, pv_atom, q_layout, k_layout, v_layout, q_desc_offsets, k_desc_offsets,
                           v_desc_offsets, K_BYTES, V_BYTES, size, scale_log2 * LN2, fold, skv, offset - left,
                           offset + right, row0, lane, batch, head, nvfly.minimum(row0, sq - 1),
                           nvfly.minimum(row0 + 8, sq - 1), (captured0, captured1), MODS)
        state = Softmax([nvfly.f32(NEG_INF)] * 2, [nvfly.f32(0.0)] * 2, sm90.Accumulator.zeros(pv_atom),
                        sm90.PipelineState.start(S), sm90.PipelineState.start(S))
        if PLAN.pingpong:
            if consumer == 0:  # consumer 0 issues its GEMMs first
                nvfly.named_barrier_arrive(PINGPONG_BARRIER, 256)
            if not PLAN.overlap:  # the turn covers the first S (then each P·V with the next S)
                scheduler_sync(consumer)
        sm90.mbarrier_wait(q_bar, 0)
        state = attend_tile(state, ctx, tile, m_block, skv, offset, right, batch, head, consumer, PLAN)
        if PLAN.pingpong and not PLAN.overlap:
            scheduler_arrive(consumer)
        store_rows(state, out, lse, io_batch, head, q_start, row0, sq, lane, fold, DV,
                   None if v_descale is None else descale_factor(v_descale, batch, kv_head, PLAN))


def descale_factor(descale, batch, kv_head, PLAN):
    """fp8's factor of one descale for the CTA's (batch, KV head): ``PLAN.per_head_descales``' (B, Hkv) tensor at
    [batch, kv_head] (zero strides where a factor is shared), else the one-element tensor's."""
    if PLAN.per_head_descales:
        return descale[batch, kv_head]
    return descale[0]


@nvfly.func
def unit_walk(out, sq, skv, group, PLAN, size):
    """``PLAN.persistent``: (query tiles a pair, query heads, (batch, head) pairs, units, pairs a group) of the
    CTAs' walk (``scheduler.head_grouped_lpt_unit``)."""
    heads = out.shape[2]
    tiles_m = (sq + PLAN.block_m - 1) // PLAN.block_m
    pairs = heads * out.shape[0]
    return tiles_m, heads, pairs, tiles_m * pairs, pair_group(skv, group, PLAN.kv_rows_in_l2(size), nvfly.maximum)


def cta_units(unit_table, out, sq, skv, group, PLAN, size):
    """``PLAN.persistent``: what the CTA's walk needs (``walk_range``, ``unit_coordinates``): with
    ``PLAN.unit_table`` its list's first and end positions in the table, else ``unit_walk``'s sizes."""
    if PLAN.unit_table:
        return unit_table[nvfly.block_idx.x], unit_table[nvfly.block_idx.x + 1]
    return unit_walk(out, sq, skv, group, PLAN, size)


def walk_range(walk, PLAN):
    """The ``range`` of the CTA's units (``cta_units``): its list's positions, or units first, first + grid, ..."""
    if PLAN.unit_table:
        return walk[0], walk[1], 1
    return nvfly.block_idx.x, walk[3], nvfly.grid_dim.x


def unit_coordinates(unit, unit_table, walk, PLAN):
    """(query tile, head, batch) of the walk's ``unit`` (``cta_units``): its table entry's code
    (``scheduler.unpack_unit``), or ``scheduler.head_grouped_lpt_unit``'s."""
    if PLAN.unit_table:
        return unpack_unit(unit_table[unit])
    tiles_m, heads, pairs, _, grouped = walk
    return head_grouped_lpt_unit(unit, tiles_m, heads, pairs, grouped, nvfly.minimum)


class TileKeys(NamedTuple):
    """A query tile's key blocks: ``key_blocks``' (start, unmasked_start, unmasked_end, total) and with a BlockMask
    the tile's query block and its (count, indices) tables, the partial key blocks' then the full ones'."""
    start: Any
    unmasked_start: Any
    unmasked_end: Any
    total: Any
    q_block: Any
    tables: list


@nvfly.func
def tile_keys(m_block, head, batch, skv, offset, left, right, kv_num_blocks, kv_indices, full_kv_num_blocks,
              full_kv_indices, PLAN):
    """The ``TileKeys`` of query tile ``m_block`` of ``head`` and ``batch``."""
    start, unmasked_start, unmasked_end, total = key_blocks(m_block, skv, PLAN.causal, PLAN.window, offset, left,
                                                            right, PLAN.block_m, PLAN.block_n, nvfly.minimum,
                                                            nvfly.maximum)
    q_block = 0
    tables = []
    if PLAN.kv_block:
        q_block = m_block * PLAN.block_m // PLAN.q_block
        tables.append((kv_num_blocks[batch, head, q_block], kv_indices))
        if full_kv_num_blocks is not None:
            tables.append((full_kv_num_blocks[batch, head, q_block], full_kv_indices))
    return TileKeys(start, unmasked_start, unmasked_end, total, q_block, tables)


@nvfly.func
def load_tile(states, loads, tile, batch, head, PLAN):
    """The producer's K and V loads of a tile's key blocks (``TileKeys``) from the rings' (K, V) ``states``;
    returns the states after them."""
    BN = PLAN.block_n
    if PLAN.kv_block:
        for count, indices in tile.tables:
            for i in range(count * (PLAN.kv_block // BN)):
                states = load_block(states, loads, listed_block(indices, batch, head, tile.q_block, i, PLAN), BN)
    else:
        for n in range(tile.start, tile.total):
            states = load_block(states, loads, n, BN)
    return states


@nvfly.func
def attend_tile(state, ctx, tile, m_block, skv, offset, right, batch, head, consumer, PLAN):
    """A consumer warpgroup's walk over a tile's key blocks (``TileKeys``): the overlapped pipeline, a BlockMask's
    lists, or the positional ranges (a window's left edge, the edges, the fully visible blocks, the diagonal and
    tail); returns the softmax state after them."""
    BM, BN = PLAN.block_m, PLAN.block_n
    tables, q_block = tile.tables, tile.q_block
    start, unmasked_start, unmasked_end, total = tile.start, tile.unmasked_start, tile.unmasked_end, tile.total
    if PLAN.overlap:
        state = attend_overlapped(state, ctx, tables, batch, head, q_block, start, unmasked_start, unmasked_end,
                                  total, consumer, PLAN)
    elif PLAN.kv_block:
        for t, (count, indices) in enumerate(tables):
            for i in range(count * (PLAN.kv_block // BN)):
                state = attend_block(state, ctx, listed_block(indices, batch, head, q_block, i, PLAN), PLAN,
                                     True, t == 0, consumer)
    else:
        both = start
        if PLAN.hoist and PLAN.window:
            # a window's left-edge blocks before the upper bounds need only its lower bound, and the diagonal's
            # and the tail's (from unmasked_start on) only the upper ones: one compare and select a score each
            both = nvfly.maximum(nvfly.minimum(upper_inside_end(m_block, skv, PLAN.causal, offset, right, BM,
                                                                BN, nvfly.minimum, nvfly.maximum),
                                               unmasked_start), start)
            for n in range(start, both):
                state = attend_block(state, ctx, n, PLAN, LOWER_BOUND, True, consumer)
        for n in range(both, unmasked_start):
            state = attend_block(state, ctx, n, PLAN, True, True, consumer)
        for n in range(unmasked_start, unmasked_end):
            state = attend_block(state, ctx, n, PLAN, False, True, consumer)
        for n in range(unmasked_end, total):
            state = attend_block(state, ctx, n, PLAN, UPPER_BOUNDS if PLAN.hoist else True, True, consumer)
    return state


class LoadContext(NamedTuple):
    """What the producer's loads of a key block need: the descriptors, rings, pipelines and boxes of K and V, and
    the block's coordinates (batch, the sequence's first key, the KV head); ``v_transposed``: V is (B, Dv, Hkv, Skv)
    (fp8), not (B, Skv, Hkv, Dv)."""
    k_desc: Any
    v_desc: Any
    k_ring: Any
    v_ring: Any
    k_pipe: Any
    v_pipe: Any
    k_boxes: Any
    v_boxes: Any
    k_bytes: int
    v_bytes: int
    batch: Any
    k_start: Any
    kv_head: Any
    v_transposed: bool


@nvfly.func
def load_block(states, ctx, n, BN):
    """TMA-load key block ``n``'s K then V into their rings; returns the rings' next (K, V) states."""
    k_state, v_state = states
    ctx.k_pipe.producer_acquire(k_state)
    ctx.k_pipe.producer_expect(k_state)
    for box in ctx.k_boxes:
        sm90.tma_load(ctx.k_desc, ctx.k_ring + k_state.stage * ctx.k_bytes + box.smem_offset,
                      (ctx.batch, ctx.k_start + n * BN + box.mn_offset, ctx.kv_head, box.k_offset),
                      ctx.k_pipe.full(k_state.stage))
    ctx.v_pipe.producer_acquire(v_state)
    ctx.v_pipe.producer_expect(v_state)
    for box in ctx.v_boxes:  # the box's K offset is the key, its MN offset the column
        coordinates = (ctx.batch, ctx.k_start + n * BN + box.k_offset, ctx.kv_head, box.mn_offset)
        if ctx.v_transposed:
            coordinates = (ctx.batch, box.mn_offset, ctx.kv_head, ctx.k_start + n * BN + box.k_offset)
        sm90.tma_load(ctx.v_desc, ctx.v_ring + v_state.stage * ctx.v_bytes + box.smem_offset, coordinates,
                      ctx.v_pipe.full(v_state.stage))
    return (k_state.advance(), v_state.advance())


@nvfly.func
def listed_block(indices, batch, head, q_block, i, PLAN):
    """The ring-stage key block of entry ``i`` of a BlockMask's list: each listed KV block is kv_block / block_n
    stages."""
    parts = PLAN.kv_block // PLAN.block_n
    return indices[batch, head, q_block, i // parts] * parts + i % parts


class Softmax(NamedTuple):
    """A consumer thread's running state: its two rows' maxima (raw score units) and thread-partial sums, the O
    accumulator (64 x Dv for the warpgroup), the K and V rings' positions, and with ``PLAN.overlap`` the P fragments
    and O's rescale factors of the block whose P·V is not issued yet (V's position is that block's)."""
    maxima: list
    sums: list
    acc: Any
    k_state: Any
    v_state: Any
    pending: Any = None


class BlockContext(NamedTuple):
    """What every key block of a consumer warpgroup needs: its Q slice's and the rings' shared addresses, the
    pipelines, atoms, operand layouts and descriptor fields (leading, stride byte offsets, swizzle), the scale in
    log2 units (``fold``: the scale, or log2(e) after a score_mod, which sees scaled scores), and what the masks
    and mods read: Skv, a row's first and last visible key relative to its index (``low``: offset - left, ``high``:
    offset + right), the thread's first row and lane, the sequence and head, the thread's two rows clamped to the
    sequence (the mods' q_idx: their tables cover the sequence), the captured tensors and the mods."""
    q_tile: Any
    k_ring: Any
    v_ring: Any
    k_pipe: Any
    v_pipe: Any
    s_atom: Any
    pv_atom: Any
    q_layout: Any
    k_layout: Any
    v_layout: Any
    q_desc: tuple
    k_desc: tuple
    v_desc: tuple
    k_bytes: int
    v_bytes: int
    size: int
    scale: Any
    fold: Any
    skv: Any
    low: Any
    high: Any
    row0: Any
    lane: Any
    batch: Any
    head: Any
    mod_row0: Any
    mod_row1: Any
    captured: tuple
    mods: Any


@nvfly.func
def attend_block(state, ctx, n, PLAN, MASKED, MASK_MOD, consumer):
    """Fold key block ``n`` into the warpgroup's online softmax and O, each GEMM waited for before the next step;
    ``MASKED``: apply the tail, causal and window bounds (a separate trace, so fully visible blocks carry no mask
    code; ``LOWER_BOUND``/``UPPER_BOUNDS``: only those, ``PLAN.hoist``'s window edges); ``MASK_MOD``: the mask_mod if there is one (not on a BlockMask's full blocks). The score_mod applies
    everywhere. Ping-pong: the turn is held from this P·V to the next block's S."""
    ctx.k_pipe.consumer_wait(state.k_state)
    s = issue_scores(ctx, state.k_state, PLAN)
    if PLAN.pingpong:
        scheduler_arrive(consumer)
    kept = mask_mod_keeps(ctx, n, PLAN, MASKED, MASK_MOD, None)
    sm90.wait_group(0)
    if ctx.lane == 0:
        ctx.k_pipe.consumer_release(state.k_state)
    fragments, maxima, sums, rescales = block_softmax(s, state, ctx, n, PLAN, MASKED, MASK_MOD, None, kept)
    acc = rescaled(state.acc, rescales, state.maxima, maxima, PLAN)
    ctx.v_pipe.consumer_wait(state.v_state)
    if PLAN.pingpong:
        scheduler_sync(consumer)
    sm90.fence()  # P's and O's registers were written since the last wgmma
    acc = issue_pv(ctx, acc, fragments, state.v_state)
    sm90.wait_group(0)
    if ctx.lane == 0:
        ctx.v_pipe.consumer_release(state.v_state)
    return Softmax(maxima, sums, acc, state.k_state.advance(), state.v_state.advance())


def rescaled(acc, factors, old_maxima, new_maxima, PLAN):
    """O times its rows' rescale factors; ``PLAN.lazy_rescale``: only when some row of the warp has a new maximum
    (a warp-uniform branch; the factors of the others are exp2(0) = 1 up to exp2's rounding)."""
    def scale(a):
        return (a.map(lambda x, i: x * factors[row_of(i)]),)
    if not PLAN.lazy_rescale:
        return scale(acc)[0]
    rose = (new_maxima[0] != old_maxima[0]) | (new_maxima[1] != old_maxima[1])
    (acc,) = if_(nvfly.vote_any(rose), scale, None, ["acc"], [acc])
    return acc


@nvfly.func
def attend_overlapped(state, ctx, tables, batch, head, q_block, start, unmasked_start, unmasked_end, total, consumer,
                      PLAN):
    """The key blocks of ``attend_block``'s walk with the softmax of block j + 1 under the P·V GEMM of block j
    (FlashAttention-3's intra-warpgroup overlap): the first block's S alone (always traced with the positional mask,
    harmless on a fully visible block), then per block S_{j+1} and P_j·V_j issued together, S waited for alone, and
    the last block's P·V. Nothing runs for a tile without key blocks."""
    if PLAN.kv_block:
        parts = PLAN.kv_block // PLAN.block_n
        counts = [count * parts for count, _ in tables]
        first = listed_block(tables[0][1], batch, head, q_block, 0, PLAN)
        partial_first = counts[0] > 0
        if len(tables) > 1:
            first = nvfly.select(partial_first, first, listed_block(tables[1][1], batch, head, q_block, 0, PLAN))
            blocks = counts[0] + counts[1]
        else:
            blocks = counts[0]
        if blocks > 0:
            # the first block is the partial list's (mask_mod) or, when it is empty, the full list's (no mask_mod)
            pipe = first_block(state, ctx, first, PLAN, ~partial_first if len(tables) > 1 else None)
            for i in range(1, counts[0]):
                pipe = overlapped_block(pipe, ctx, listed_block(tables[0][1], batch, head, q_block, i, PLAN), PLAN,
                                        True, True, consumer)
            if len(tables) > 1:
                for i in range(nvfly.select(partial_first, 0, 1), counts[1]):
                    pipe = overlapped_block(pipe, ctx, listed_block(tables[1][1], batch, head, q_block, i, PLAN),
                                            PLAN, True, False, consumer)
            state = last_block(pipe, ctx)
    else:
        if start < total:
            pipe = first_block(state, ctx, start, PLAN, None)
            for first, end, masked in pipelined_loops(start, unmasked_start, unmasked_end, total, nvfly.maximum):
                for n in range(first, end):
                    pipe = overlapped_block(pipe, ctx, n, PLAN, masked, True, consumer)
            state = last_block(pipe, ctx)
    return state


@nvfly.func
def first_block(state, ctx, n, PLAN, mod_off):
    """The pipeline's first block: S waited for, its softmax; its P (and O's factors) left pending.
    ``mod_off``: a traced flag that turns the mask_mod off (a BlockMask's full block), or None."""
    ctx.k_pipe.consumer_wait(state.k_state)
    s = issue_scores(ctx, state.k_state, PLAN)
    kept = mask_mod_keeps(ctx, n, PLAN, True, True, mod_off)
    sm90.wait_group(0)
    if ctx.lane == 0:
        ctx.k_pipe.consumer_release(state.k_state)
    fragments, maxima, sums, rescales = block_softmax(s, state, ctx, n, PLAN, True, True, mod_off, kept)
    return Softmax(maxima, sums, state.acc, state.k_state.advance(), state.v_state, (fragments, rescales))


@nvfly.func
def overlapped_block(state, ctx, n, PLAN, MASKED, MASK_MOD, consumer):
    """S of block ``n`` and P·V of the pending block issued back to back (the ping-pong turn covers both; O is
    rescaled by the pending block's factors under S), S waited for alone and block n's softmax run while P·V is in
    flight; then K and V released and block n's P and factors left pending."""
    ctx.k_pipe.consumer_wait(state.k_state)
    ctx.v_pipe.consumer_wait(state.v_state)  # V of the pending block: loaded before this K
    if PLAN.pingpong:
        scheduler_sync(consumer)
    s = issue_scores(ctx, state.k_state, PLAN)
    pending, factors = state.pending
    acc = state.acc.map(lambda x, i: x * factors[row_of(i)])
    sm90.fence()  # O's registers were written since S's fence
    acc = issue_pv(ctx, acc, pending, state.v_state)
    if PLAN.pingpong:
        scheduler_arrive(consumer)
    kept = mask_mod_keeps(ctx, n, PLAN, MASKED, MASK_MOD, None)
    sm90.wait_group(1)
    s = s.fence()  # S's registers are read no earlier than its wait
    fragments, maxima, sums, rescales = block_softmax(s, state, ctx, n, PLAN, MASKED, MASK_MOD, None, kept)
    # K's release waits for the row sums (the condition always holds: sums are >= 0, or NaN): ptxas places the
    # wgmma wait right after the last arrive before it, and would otherwise run the exp2s after P·V, not under it
    if (ctx.lane == 0) & ~(sums[0] + sums[1] < 0.0):
        ctx.k_pipe.consumer_release(state.k_state)
    sm90.wait_group(0)
    acc = acc.fence()
    if ctx.lane == 0:
        ctx.v_pipe.consumer_release(state.v_state)
    return Softmax(maxima, sums, acc, state.k_state.advance(), state.v_state.advance(), (fragments, rescales))


@nvfly.func
def last_block(state, ctx):
    """The pending block's P·V (O rescaled first), waited for; V released."""
    pending, factors = state.pending
    acc = state.acc.map(lambda x, i: x * factors[row_of(i)])
    ctx.v_pipe.consumer_wait(state.v_state)
    sm90.fence()  # P's and O's registers were written since the last wgmma
    acc = issue_pv(ctx, acc, pending, state.v_state)
    sm90.wait_group(0)
    if ctx.lane == 0:
        ctx.v_pipe.consumer_release(state.v_state)
    return Softmax(state.maxima, state.sums, acc, state.k_state, state.v_state.advance())


@nvfly.func
def issue_scores(ctx, k_state, PLAN):
    """S = Q Kᵀ for the K stage of ``k_state`` (landed), issued and committed, not waited for."""
    size = ctx.size
    k_stage = ctx.k_ring + k_state.stage * ctx.k_bytes
    s = sm90.Accumulator.undefined(ctx.s_atom)
    sm90.fence()  # P's and O's registers were written since the last wgmma
    for ks in nvfly.static_range(PLAN.dqk // ctx.s_atom.k):
        dq = sm90.smem_descriptor(ctx.q_tile + ctx.q_layout.inner((0, ks * ctx.s_atom.k)) * size, *ctx.q_desc)
        dk = sm90.smem_descriptor(k_stage + ctx.k_layout.inner((0, ks * ctx.s_atom.k)) * size, *ctx.k_desc)
        s = sm90.mma(ctx.s_atom, s, dq, dk, zero=ks == 0)
    sm90.commit_group()
    return s


@nvfly.func
def issue_pv(ctx, acc, fragments, v_state):
    """O += P V for the V stage of ``v_state`` (landed), issued and committed, not waited for."""
    size = ctx.size
    v_stage = ctx.v_ring + v_state.stage * ctx.v_bytes
    for ks in nvfly.static_range(len(fragments)):
        dv = sm90.smem_descriptor(v_stage + ctx.v_layout.inner((0, ks * ctx.pv_atom.k)) * size, *ctx.v_desc)
        acc = sm90.mma(ctx.pv_atom, acc, fragments[ks], dv)
    sm90.commit_group()
    return acc


@nvfly.func
def mask_mod_keeps(ctx, n, PLAN, MASKED, MASK_MOD, mod_off):
    """The mask_mod's verdicts on the thread's scores of key block ``n`` as bits (bit i % 32 of word i // 32: score
    i kept), or None without a mask_mod (or ``MASK_MOD`` False: a BlockMask's full block). It reads no score: the
    kernel evaluates it between issuing S and waiting for it, so the loads of the tables it indexes (document ids,
    a boolean mask) run under the GEMM instead of after it; bits, so that what waits with S is two registers, not
    a predicate (or a table entry) a score. ``mod_off``: None, or a traced flag under which every key is kept (the
    pipeline's first block when it may be a BlockMask's full block). Not with a score_mod, nor with the overlap's
    second S tile: there the verdicts' pending loads spill (28-100 registers in the CPU tests' kernels); then
    ``block_softmax`` evaluates the mask_mod score by score after the wait. ``PLAN.prefetch_mask``: a
    ``PrefetchedLoads`` instead, the mask_mod's loads of each score issued here, its compares left for after the
    wait (no bits to pack and unpack; the loaded values, not two words, wait with S)."""
    mods = ctx.mods
    if not MASK_MOD or mods.mask_mod is None or mods.score_mod is not None or PLAN.overlap:
        return None
    first_key = n * PLAN.block_n + 2 * (ctx.lane % 4)
    mod_rows = (ctx.mod_row0, ctx.mod_row1)
    if PLAN.prefetch_mask:
        loads = []
        for i in nvfly.static_range(PLAN.block_n // 2):
            loads.append([])
            apply_mask_mod(mods, ctx.captured, ctx.batch, ctx.head, mod_rows[row_of(i)],
                           mod_key(ctx, first_key + 8 * (i // 4) + i % 2, MASKED),
                           mod_affine(mod_rows, first_key, i, PLAN), loads[i])
        return PrefetchedLoads(loads)
    words = []
    scores = PLAN.block_n // 2
    for w in nvfly.static_range((scores + 31) // 32):
        word = nvfly.u32(0)
        for i in nvfly.static_range(32 * w, min(32 * w + 32, scores)):
            key = first_key + 8 * (i // 4) + i % 2  # column_offset(i), as two adds (the default plans' PTX)
            kept = apply_mask_mod(mods, ctx.captured, ctx.batch, ctx.head, mod_rows[row_of(i)],
                                  mod_key(ctx, key, MASKED), mod_affine(mod_rows, first_key, i, PLAN))
            word = word | nvfly.select(kept, nvfly.u32(1 << (i % 32)), nvfly.u32(0))
        if mod_off is not None:
            word = word | nvfly.select(mod_off, nvfly.u32(0xFFFFFFFF), nvfly.u32(0))
        words.append(word)
    return words


class PrefetchedLoads(NamedTuple):
    """``PLAN.prefetch_mask``: the mask_mod's loaded table values, a list a score (``mask_mod_keeps``)."""
    values: list


@nvfly.func
def positional_keep(ctx, key, row, PLAN):
    """Whether ``row`` sees ``key`` by the positional bounds: within the sequence, causal, window."""
    keep = key < ctx.skv
    if PLAN.causal:
        keep = keep & (key <= row + ctx.high)
    if PLAN.window:
        keep = keep & (key >= row + ctx.low)
    return keep


def column_offset(i: int) -> int:
    """The key of a thread's score ``i`` (of S's fragment) past the thread's first key of the block: 8 keys a
    group of four scores, two adjacent keys in each row."""
    return 8 * (i // 4) + i % 2


@nvfly.func
def row_limits(ctx, n, PLAN, MASKED=True):
    """``PLAN.hoist``: the positional bounds of the thread's two rows in block ``n`` as (lo, hi) offsets from the
    thread's first key: score i is visible iff lo <= column_offset(i) <= hi (lo None without a window or with
    ``MASKED`` UPPER_BOUNDS; hi: the sequence's last key, or the causal bound if lower; None with LOWER_BOUND). A
    few subtractions a row and block, then one compare with a constant a bound and score (``limits_keep``) instead
    of a key's add and three compares."""
    first_key = n * PLAN.block_n + 2 * (ctx.lane % 4)
    limits = []
    for r in nvfly.static_range(2):
        row = ctx.row0 + 8 * r
        hi = None
        if MASKED != LOWER_BOUND:
            hi = ctx.skv - 1 - first_key
            if PLAN.causal:
                hi = nvfly.minimum(hi, row + ctx.high - first_key)
        lo = None
        if PLAN.window and MASKED != UPPER_BOUNDS:
            lo = row + ctx.low - first_key
        limits.append((lo, hi))
    return limits


@nvfly.func
def limits_keep(limits, i):
    """Whether score ``i`` is within its row's ``row_limits``."""
    lo, hi = limits[row_of(i)]
    keep = None
    if hi is not None:
        keep = hi >= column_offset(i)
    if lo is not None:
        keep = lo <= column_offset(i) if keep is None else keep & (lo <= column_offset(i))
    return keep


def mod_affine(mod_rows, first_key, i, PLAN):
    """``PLAN.hoist``: the mods' q_idx and kv_idx of score ``i`` as (base, offset) pairs (``mods.ModValue``): the
    row, and the thread's first key plus the score's constant offset (unclamped: a masked block's tail keys differ
    from the clamped kv_idx only where the positional mask drops the score). None without hoisting."""
    if not PLAN.hoist:
        return None
    return ((mod_rows[row_of(i)], 0), (first_key, column_offset(i)))


@nvfly.func
def positional_mask(scores, ctx, n, PLAN):
    """Block ``n``'s scores (the thread's, a list) with those outside the positional bounds -inf."""
    if PLAN.hoist:
        limits = row_limits(ctx, n, PLAN)
        return [nvfly.select(limits_keep(limits, i), scores[i], NEG_INF) for i in range(len(scores))]
    first_key = n * PLAN.block_n + 2 * (ctx.lane % 4)
    rows = (ctx.row0, ctx.row0 + 8)
    return [nvfly.select(positional_keep(ctx, first_key + 8 * (i // 4) + i % 2, rows[row_of(i)], PLAN), scores[i],
                         NEG_INF) for i in range(len(scores))]


@nvfly.func
def block_inside(ctx, n, PLAN):
    """Whether block ``n`` is inside the positional bounds of every row of the thread's warp (rows row0 - lane / 4
    ... + 15): the same for the whole warp."""
    return block_inside_bounds(ctx.row0 - ctx.lane // 4, 16, n * PLAN.block_n, PLAN.block_n, ctx.skv, PLAN.causal,
                               PLAN.window, ctx.low, ctx.high)


@nvfly.func
def mod_key(ctx, key, MASKED):
    """The key the mods see: within the sequence (a masked block's tail is clamped; its elements are dropped)."""
    return nvfly.maximum(nvfly.minimum(key, ctx.skv - 1), 0) if MASKED else key


@nvfly.func
def block_softmax(s, state, ctx, n, PLAN, MASKED, MASK_MOD, mod_off, kept):
    """Key block ``n``'s scores (S) through the score_mod, the positional bounds (``MASKED``: the tail, causal and
    window) and the mask_mod (``MASK_MOD``; its verdicts ``kept``, ``mask_mod_keeps``' bits, or when that is None
    evaluated here, all kept under the traced flag ``mod_off`` if not None), and the online softmax step: (P as the
    P·V GEMM's A fragments, the new maxima and sums, O's rescale factors)."""
    scores = [s[i] for i in range(len(s))]
    mods = ctx.mods
    prefetched = isinstance(kept, PrefetchedLoads)
    mask_here = (kept is None or prefetched) and MASK_MOD and mods.mask_mod is not None
    if MASKED or mods.score_mod is not None or kept is not None or mask_here:
        first_key = n * PLAN.block_n + 2 * (ctx.lane % 4)
        rows = (ctx.row0, ctx.row0 + 8)
        mod_rows = (ctx.mod_row0, ctx.mod_row1)
        # a BlockMask lists blocks by its mask alone: whether one needs the positional bounds is known per block,
        # at run time, for the warp's 16 rows (a uniform branch, so a block inside them runs none of their code)
        branch = MASKED and PLAN.kv_block and not PLAN.overlap
        limits = None
        if MASKED and not branch and PLAN.hoist:
            limits = row_limits(ctx, n, PLAN, MASKED)
        for i in nvfly.static_range(len(scores)):
            key = first_key + 8 * (i // 4) + i % 2  # column_offset(i), as two adds (the default plans' PTX)
            r = row_of(i)
            affine = mod_affine(mod_rows, first_key, i, PLAN)
            if mods.score_mod is not None:
                scores[i] = apply_score_mod(mods, ctx.captured, scores[i], ctx.batch, ctx.head, mod_rows[r],
                                            mod_key(ctx, key, MASKED), scale=ctx.scale, affine=affine)
            keep = None
            if MASKED and not branch:
                keep = limits_keep(limits, i) if PLAN.hoist else positional_keep(ctx, key, rows[r], PLAN)
            verdict = None
            if kept is not None and not prefetched:
                verdict = (kept[i // 32] & nvfly.u32(1 << (i % 32))) != nvfly.u32(0)
            if mask_here:
                verdict = apply_mask_mod(mods, ctx.captured, ctx.batch, ctx.head, mod_rows[r],
                                         mod_key(ctx, key, MASKED), affine,
                                         list(kept.values[i]) if prefetched else None, prefetched)
                if mod_off is not None:
                    verdict = verdict | mod_off
            if verdict is not None:
                keep = verdict if keep is None else keep & verdict
            if keep is not None:
                scores[i] = nvfly.select(keep, scores[i], NEG_INF)
        if branch:
            if ~block_inside(ctx, n, PLAN):
                scores = positional_mask(scores, ctx, n, PLAN)
    MASKED = MASKED or kept is not None or mask_here or mods.score_mod is not None  # rows may have no key kept yet
    step = online_softmax(scores, state.maxima, state.sums, ctx.fold, MASKED, PLAN.tree_max,
                          PLAN.poly_exp2, EXP2_POLYNOMIAL if PLAN.fp8 else EXP2_CUBIC)
    fragments = s.map(lambda x, i: step.p[i]).to_a_fragments(ctx.pv_atom)
    return fragments, step.maxima, step.sums, step.rescales


@nvfly.func
def scheduler_sync(consumer):
    """Ping-pong: wait for this consumer's turn to issue GEMMs (the other consumer's ``scheduler_arrive``)."""
    nvfly.named_barrier(PINGPONG_BARRIER + consumer, 256)


@nvfly.func
def scheduler_arrive(consumer):
    """Ping-pong: hand the turn to the other consumer, which issues its GEMMs while this one runs its softmax."""
    nvfly.named_barrier_arrive(PINGPONG_BARRIER + 1 - consumer, 256)


@nvfly.func
def store_rows(state, out, lse, batch, head, q_start, row0, sq, lane, fold, DV, v_descale):
    """O / l for the thread's two rows (zeros for a row with no key) as 4-byte pairs, and its LSE (natural log,
    −inf for a row with no key) from the quad's first lane; rows from ``q_start`` (a packed sequence's first);
    ``v_descale``: None, or what O is multiplied by (fp8's V descale)."""
    for r in nvfly.static_range(2):
        row = row0 + 8 * r
        total = state.sums[r] + nvfly.shfl_xor(state.sums[r], 1)
        total = total + nvfly.shfl_xor(total, 2)
        kept = total > 0.0
        inverse = nvfly.select(kept, 1.0 / nvfly.maximum(total, 1e-30), 0.0)
        if v_descale is not None:
            inverse = inverse * v_descale
        inside = row < sq
        for j in nvfly.static_range(DV // 8):
            col = 8 * j + 2 * (lane % 4)
            pair = nvfly.make_vector([state.acc[4 * j + 2 * r] * inverse, state.acc[4 * j + 2 * r + 1] * inverse])
            out.store(pair.to(out.dtype), batch, q_start + row, head, col, mask=inside)
        if lse is not None:
            if inside & (lane % 4 == 0):
                row_lse = (state.maxima[r] * fold + nvfly.log2(nvfly.maximum(total, 1e-30))) * LN2
                lse[batch, head, q_start + row] = nvfly.select(kept, row_lse, NEG_INF)
