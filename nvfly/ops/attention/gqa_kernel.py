"""Warpgroup-MMA GQA decode (``decode``'s default at 16 < Sq x G <= 128, fp8 caches past 32): softmax(q kᵀ scale) v
for 16-bit or e4m3 K and V of head dim 128, the Sq x G query rows of one KV head as one wgmma M = 64 (two, 65-128
rows: ``PLAN.consumers`` 2), on Hopper's TMA and wgmma (the MLA kernel's structure, ``mla_kernel``, with separate K
and V tiles).

    q [B, Sq, Hq, 128] through a 4-D TMA descriptor whose box (1, Sq, G, 64) is the KV head's Sq x G query rows in
    token-major order (row r: token r // G, head hkv * G + r % G; rows past Sq x G stay unwritten and are never
    stored); K and V through 4-D descriptors: contiguous [B, S, Hkv, 128] or paged [P, page, Hkv, 128] (key j of
    sequence b at [block_table[b, j // page], j % page], page a multiple of 64); seqlens [B] int32.

Grid (splits, Hkv, B), 256 threads (``gqa_plan``; 384 with two consumer warpgroups, each its own 64 rows, both
releasing each stage). Warpgroup 0 is the producer: its thread 0 TMA-loads the query
rows once (2 boxes of 64 columns) and then each 64-key tile of the split, K and V (2 boxes each), into a
``PLAN.stages``-deep ring whose stages have a full barrier for K and one for V, so that S = Q Kᵀ starts while V
lands. Warpgroup 1 computes S (64 x 64, 8 wgmma k-steps from shared memory), the online softmax (each thread's two
rows; scale folded into exp2), and O = O · rescale + P V with P from registers (4 register-A k-steps, V MN-major:
a K-major tile's 128-byte swizzled rows), then releases the stage. Masked tiles (the sequence's tail and, causally,
the last Sq - 1 keys) mask S and zero their V rows past the sequence (the cache past a sequence's end may hold
anything, NaN included, and 0 · NaN is NaN in P V). At the end it writes out [B, Sq, Hq, 128] (and lse [B, Hq, Sq])
or, with splits, the normalised f32 partial O and LSE of ``combine_kernel``'s workspace (``PLAN.pdl_combine``: the
combine a programmatic dependent launch). Rows with no key give
zeros and LSE -inf.

fp8 (e4m3) K and V (``PLAN.fp8``): the ring's stages hold K's and V's 64 keys x 128 bytes, one 128-byte swizzled box
each, and the consumer threads (both warpgroups' with two, each converting half) convert each into an f16 staging
tile laid out as the 16-bit kernel's (``wgmma_tiles.convert_fp8_tile``) for the same f16 wgmmas: K, then (a named
barrier over the consumers) S's wgmmas issued, V converted while they run (its rows past the sequence written as
zeros on masked tiles), after which each warp releases the stage (the producer's refill overlaps S, the softmax
and P V), then a second barrier (every warp's S has read K's staging tile, V's is written). The query tile,
TMA-loaded as q's 16-bit rows, is rescaled to f16 times the softmax scale in place once (as the decode kernel's
``stage_query_f16``: f16's range for |q| up to 65504 / scale); K's per-head scale (``kv_scales`` [2, Hkv]: K's, then
V's) goes into the scores' scale and V's into the output's normalisation.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly
from nvfly.arch import sm90
from nvfly.arch.ptx import smem_address
from nvfly.ops.attention.gqa_plan import (BLOCK_M, BLOCK_N, FP8_TILE_BYTES, HEAD_DIM, K_BYTES, PRODUCER_REGS,
                                          Q_BYTES, Q_OFFSET, SWIZZLE)
from nvfly.ops.attention.mla_plan import unmasked_end
from nvfly.ops.attention.softmax import LN2, LOG2E, NEG_INF, online_softmax
from nvfly.ops.attention.wgmma_tiles import (Running, convert_fp8_tile, mask_key_tile, page_and_row,
                                             rescaled_plus_pv, scale_to_f16, zero_tail_rows)

ZEROED = 1                 # hardware barriers (0 is __syncthreads): consumer c's zeroed V rows before its wgmma: 1 + c
# fp8 (no ZEROED), over every consumer thread: K's staging tile (and the query tile, on the first) converted before
# S's wgmmas; V's converted and every warp's S done with K's, before P V
K_CONVERTED, V_CONVERTED = 1, 2


class Layouts(NamedTuple):
    """The atoms, shared-memory operand layouts and descriptor fields (leading, stride byte offsets, swizzle)."""
    s_atom: Any
    pv_atom: Any
    q_layout: Any
    k_layout: Any
    v_layout: Any
    q_desc: tuple
    k_desc: tuple
    v_desc: tuple


def layouts(dtype: Any, consumers: int = 1) -> Layouts:
    """``consumers``: Q's tile holds their 64-row blocks (consumer c's rows at 8 KB x c in each 64-column box)."""
    q_layout = sm90.operand_layout(BLOCK_M * consumers, HEAD_DIM, dtype, "K", SWIZZLE)
    k_layout = sm90.operand_layout(BLOCK_N, HEAD_DIM, dtype, "K", SWIZZLE)
    v_layout = sm90.operand_layout(HEAD_DIM, BLOCK_N, dtype, "MN", SWIZZLE)  # the bytes of a K-major (keys, 128) tile
    return Layouts(sm90.WgmmaAtom(BLOCK_N, dtype, dtype, "K", "K"),
                   sm90.WgmmaAtom(HEAD_DIM, dtype, dtype, "K", "MN", a_source="registers"),
                   q_layout, k_layout, v_layout,
                   sm90.descriptor_offsets(q_layout, dtype, "K", SWIZZLE) + (SWIZZLE,),
                   sm90.descriptor_offsets(k_layout, dtype, "K", SWIZZLE) + (SWIZZLE,),
                   sm90.descriptor_offsets(v_layout, dtype, "MN", SWIZZLE) + (SWIZZLE,))


class Tile(NamedTuple):
    """What every key tile needs: Q's and the ring's shared addresses, the pipeline, the layouts, the sequence's
    length, the scale in log2 units, the thread's two rows' positions in the sequence, its lane and thread index in
    the warpgroup, its consumer warpgroup (0 or 1; Q's rows at ``q_tile`` are its 64); fp8: the f16 staging tiles'
    address (K's, then V's) and V's scale (None and 1.0 for 16-bit K and V)."""
    q_tile: Any
    ring: Any
    pipe: Any
    lay: Any
    seqlen: Any
    scale_log2: Any
    positions: list
    lane: Any
    thread: Any
    consumer: Any
    staging: Any
    v_scale: Any


@nvfly.func
def key_tile(state, t, n, PLAN, MASKED):
    """Key tile ``n``: S, the online softmax, O rescaled and P V added; the stage released (fp8: once the warp has
    converted its part of K and V to the staging tiles, while S's wgmmas run)."""
    lay = t.lay
    stage = t.ring + state.stage.stage * PLAN.stage_bytes
    k_tile = t.staging if PLAN.fp8 else stage
    v_tile = k_tile + K_BYTES
    t.pipe.consumer_wait(state.stage, 0)
    CONVERTERS = 128 * PLAN.consumers
    converter = None
    if PLAN.fp8:  # K's keys past the sequence are converted as they are: S masks them
        converter = t.thread + 128 * t.consumer  # the thread's index among the consumers'
        convert_fp8_tile(stage, k_tile, converter, None, BLOCK_N, CONVERTERS)
        nvfly.named_barrier(K_CONVERTED, CONVERTERS)
    s = sm90.Accumulator.undefined(lay.s_atom)
    sm90.fence()
    for ks in nvfly.static_range(HEAD_DIM // lay.s_atom.k):
        dq = sm90.smem_descriptor(t.q_tile + lay.q_layout.inner((0, ks * lay.s_atom.k)) * 2, *lay.q_desc)
        dk = sm90.smem_descriptor(k_tile + lay.k_layout.inner((0, ks * lay.s_atom.k)) * 2, *lay.k_desc)
        s = sm90.mma(lay.s_atom, s, dq, dk, zero=ks == 0)
    sm90.commit_group()
    if PLAN.fp8:  # V converted while S's wgmmas run: the previous tile's P V finished before K_CONVERTED
        t.pipe.consumer_wait(state.stage, 1)
        convert_fp8_tile(stage + FP8_TILE_BYTES, v_tile, converter, t.seqlen - n * BLOCK_N if MASKED else None,
                         BLOCK_N, CONVERTERS)
        nvfly.syncwarp()  # the warp's reads of the stage are done (K's before K_CONVERTED): the producer may refill it
        if t.lane == 0:
            t.pipe.consumer_release(state.stage)
    sm90.wait_group(0)
    if PLAN.fp8:  # past it every warp's S has read K's staging tile, and V's is written
        nvfly.named_barrier(V_CONVERTED, CONVERTERS)

    scores = [s[i] for i in range(len(s))]
    if MASKED:
        scores = mask_key_tile(scores, n * BLOCK_N + 2 * (t.lane % 4), t.seqlen, t.positions, PLAN.causal)
    soft = online_softmax(scores, state.maxima, state.sums, t.scale_log2, MASKED)
    fragments = s.map(lambda x, i: soft.p[i]).to_a_fragments(lay.pv_atom)

    if not PLAN.fp8:
        t.pipe.consumer_wait(state.stage, 1)
        if MASKED:
            zero_tail_rows(v_tile, t.seqlen - n * BLOCK_N, t.thread, ZEROED + t.consumer, 0,
                           HEAD_DIM // 64, BLOCK_N)
    acc = rescaled_plus_pv(state.acc, soft.rescales, fragments, v_tile, lay.pv_atom, lay.v_layout, lay.v_desc)
    if not PLAN.fp8 and t.lane == 0:
        t.pipe.consumer_release(state.stage)
    return Running(soft.maxima, soft.sums, acc, state.stage.advance())


@nvfly.kernel
def attention_gqa_wgmma_kernel(q_desc: nvfly.TmaDescriptor, k_desc: nvfly.TmaDescriptor,
                               v_desc: nvfly.TmaDescriptor, block_table, seqlens: nvfly.Tensor, out, lse, partial_o,
                               partial_lse, kv_scales, batch: nvfly.i32, heads: nvfly.i32, scale_log2: nvfly.f32,
                               PLAN: nvfly.Constexpr):
    """One (split, KV head, batch) CTA (module docstring). Without splits it writes out [B, Sq, Hq, 128] and lse
    [B, Hq, Sq] (f32, natural log; None: not wanted); with splits partial_o [splits * B * Sq * Hq, 128] and
    partial_lse [splits * B * Sq * Hq] (f32; row ((split * B + b) * Sq + token) * Hq + head). block_table [B, pages]
    int32 when paged, else None; kv_scales [2, Hkv] f32 (K's, then V's) with fp8 K and V, else None; heads: Hq;
    scale_log2: the softmax scale in log2 units."""
    nvfly.min_blocks_per_sm(PLAN.ctas_per_sm)
    if PLAN.pdl_combine:  # as the MLA kernel's: the combine waits for this grid's end before it reads a partial
        nvfly.launch_dependents()
    dtype = q_desc.info.dtype
    CONSUMERS = PLAN.consumers
    lay = layouts(nvfly.f16 if PLAN.fp8 else dtype, CONSUMERS)  # fp8: f16 wgmmas on the converted tiles
    SQ, G, SPLITS, STAGES = PLAN.sq, PLAN.group, PLAN.splits, PLAN.stages
    if PLAN.fp8:  # a tile's 64 keys x 128 bytes: one box
        boxes, TILE_BYTES = [sm90.TmaBox(0, 0, 0)], FP8_TILE_BYTES
    else:
        boxes = sm90.operand_boxes(lay.k_layout, BLOCK_N, HEAD_DIM, dtype, "K", SWIZZLE)[1][0]  # 2 of 64 columns
        TILE_BYTES = K_BYTES
    q_boxes = sm90.operand_boxes(lay.q_layout, BLOCK_M * CONSUMERS, HEAD_DIM, dtype, "K", SWIZZLE)[1][0]

    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (PLAN.barriers,), offset_bytes=PLAN.barrier_offset))
    q_tile = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (PLAN.q_bytes,), offset_bytes=Q_OFFSET))
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (STAGES * PLAN.stage_bytes,),
                                                    offset_bytes=PLAN.ring_offset))
    q_bar = bars
    # each consumer warp releases a stage: both warpgroups' before the producer refills it
    pipe = sm90.TmaPipeline(bars + 8, STAGES, PLAN.stage_bytes, consumer_arrivals=4 * CONSUMERS, chunks=2)

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    if tid == 0:
        sm90.mbarrier_init(q_bar, 1)
        pipe.init()
        sm90.tma_prefetch_descriptor(q_desc)
        sm90.tma_prefetch_descriptor(k_desc)
        sm90.tma_prefetch_descriptor(v_desc)
    nvfly.syncthreads()

    split = nvfly.block_idx.x
    hkv = nvfly.block_idx.y
    b = nvfly.block_idx.z
    seqlen = seqlens[b]
    n_blocks = (seqlen + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + SPLITS - 1) // SPLITS
    begin = split * per_split
    end = nvfly.maximum(nvfly.minimum(begin + per_split, n_blocks), begin)
    middle = nvfly.maximum(nvfly.minimum(unmasked_end(seqlen, SQ, PLAN.causal, nvfly.maximum), end), begin)

    if warp // 4 == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            sm90.mbarrier_arrive_expect_tx(q_bar, SQ * G * HEAD_DIM * 2)
            for box in q_boxes:
                sm90.tma_load(q_desc, q_tile + box.smem_offset, (b, 0, hkv * G, box.k_offset), q_bar)
            loading = sm90.PipelineState.start(STAGES)
            for n in range(begin, end):
                key = n * BLOCK_N
                page, row = page_and_row(PLAN, block_table, b, key)
                pipe.producer_acquire(loading)
                stage = ring + loading.stage * PLAN.stage_bytes
                pipe.producer_expect(loading, 0, TILE_BYTES)
                for box in boxes:
                    sm90.tma_load(k_desc, stage + box.smem_offset, (page, row, hkv, box.k_offset),
                                  pipe.full(loading.stage, 0))
                pipe.producer_expect(loading, 1, TILE_BYTES)
                for box in boxes:
                    sm90.tma_load(v_desc, stage + TILE_BYTES + box.smem_offset, (page, row, hkv, box.k_offset),
                                  pipe.full(loading.stage, 1))
                loading = loading.advance()
    else:
        sm90.setmaxnreg(PLAN.consumer_regs, increase=True)
        lane = nvfly.lane_idx()
        thread = tid % 128
        row0 = 16 * (warp % 4) + lane // 4  # the thread's rows: row0, row0 + 8 (of its consumer's 64)
        consumer, consumer_q = 0, q_tile
        if CONSUMERS > 1:  # consumer c's 64 rows: 8 KB (64 rows of 128 bytes) into each 64-column box of Q's tile
            consumer = warp // 4 - 1
            row0 = row0 + BLOCK_M * consumer
            consumer_q = q_tile + consumer * (Q_BYTES // 2)
        packed = [row0, row0 + 8]
        positions = [seqlen - SQ + r // G for r in packed]
        staging, v_scale, score_scale_log2 = None, 1.0, scale_log2
        if PLAN.fp8:  # the softmax scale goes into the f16 query tile, K's scale into the scores'
            staging = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (2 * K_BYTES,),
                                                               offset_bytes=PLAN.staging_offset))
            v_scale = kv_scales[1, hkv]
            score_scale_log2 = kv_scales[0, hkv] * LOG2E
        t = Tile(consumer_q, ring, pipe, lay, seqlen, score_scale_log2, positions, lane, thread, consumer, staging,
                 v_scale)
        state = Running([nvfly.f32(NEG_INF)] * 2, [nvfly.f32(0.0)] * 2, sm90.Accumulator.zeros(lay.pv_atom),
                        sm90.PipelineState.start(STAGES))
        sm90.mbarrier_wait(q_bar, 0)
        if PLAN.fp8:  # in place (all consumers' rows), ordered before S's wgmmas by the first K_CONVERTED barrier
            scale_to_f16(q_tile, nvfly.dynamic_shared_tensor(dtype, (PLAN.q_bytes // 2,), offset_bytes=Q_OFFSET),
                         scale_log2 * LN2, thread + 128 * consumer, PLAN.q_bytes, 128 * CONSUMERS)
        for n in range(begin, middle):
            state = key_tile(state, t, n, PLAN, False)
        for n in range(middle, end):
            state = key_tile(state, t, n, PLAN, True)
        store_rows(state, t, out, lse, partial_o, partial_lse, b, hkv, split, batch, heads, packed, PLAN)


@nvfly.func
def store_rows(state, t, out, lse, partial_o, partial_lse, b, hkv, split, batch, heads, packed, PLAN):
    """Each row's LSE (natural log, -inf for a row with no key) and O / l (times V's scale; 0 for a row with no key)
    as 4-byte pairs; rows past Sq x G are not stored."""
    SQ, G = PLAN.sq, PLAN.group
    for r in nvfly.static_range(2):
        total = state.sums[r] + nvfly.shfl_xor(state.sums[r], 1)
        total = total + nvfly.shfl_xor(total, 2)
        kept = total > 0.0
        row_lse = nvfly.select(kept, (state.maxima[r] * t.scale_log2 + nvfly.log2(nvfly.maximum(total, 1e-30)))
                               * LN2, NEG_INF)
        inverse = nvfly.select(kept, t.v_scale / nvfly.maximum(total, 1e-30), 0.0)
        token = packed[r] // G
        head = hkv * G + packed[r] % G
        inside = packed[r] < SQ * G
        slot = ((split * batch + b) * SQ + token) * heads + head
        if inside & (t.lane % 4 == 0):
            if PLAN.splits == 1:
                if lse is not None:
                    lse[b, head, token] = row_lse
            else:
                partial_lse[slot] = row_lse
        for j in nvfly.static_range(HEAD_DIM // 8):
            column = 8 * j + 2 * (t.lane % 4)
            pair = nvfly.make_vector([state.acc[4 * j + 2 * r] * inverse, state.acc[4 * j + 2 * r + 1] * inverse])
            if PLAN.splits == 1:
                out.store(pair.to(out.dtype), b, token, head, column, mask=inside)
            else:
                partial_o.store(pair, slot, column, mask=inside)
