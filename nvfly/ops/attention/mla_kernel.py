"""MLA decode: softmax(q kᵀ scale) v over DeepSeek-V2/V3's latent cache, one KV head of 576 columns whose first 512
are V, on Hopper's TMA and wgmma.

    q [B, Sq * Hq, 576] through a 3-D TMA descriptor (row r: query token r // Hq, head r % Hq); the cache through a
    4-D descriptor: contiguous [B, S, 1, 576] (key j of sequence b at [b, j]) or paged [P, page, 1, 576] (key j at
    [block_table[b, j // page], j % page], page a multiple of 64); seqlens [B] int32.

Grid (splits x row blocks, B), 384 threads (``mla_plan``). Warpgroup 0 is the producer: its thread 0 TMA-loads the
CTA's 64 query rows once (9 boxes of 64 rows x 64 columns; rows past Sq x Hq are zero-filled) and then each 64-key
tile of the split (9 boxes, a page of 64 keys is one TMA row range; paged: the page from the block table) into a
2-stage ring (full/empty mbarriers, ``sm90.TmaPipeline``; with ``PLAN.chunked`` a full barrier per box, so that
S's k-steps over a box start as it lands and the value warpgroup waits for its V half's four boxes only; with
``PLAN.evict_first`` the loads carry an L2 evict-first hint). The cache is read once; the tile's first 512 columns
are V, already MN-major for P·V (a K-major K tile and an MN-major V tile have the same 128-byte swizzled rows), so
there is no second load and no transpose.

Warpgroup 1 (the softmax warpgroup) computes S = Q Kᵀ (64 x 64, K = 576: 36 wgmma steps from shared memory), the
online softmax (each thread's two rows; scale folded into exp2), writes P (rounded to the input type) into a
shared 64 x 64 K-major tile and each row's O rescale into shared memory, publishes them (``P_READY``), and does
O[:, :256] = O · rescale + P V[:, :256] with P from registers (register-A wgmma). Warpgroup 2 (the value warpgroup)
waits for ``P_READY``, rescales its O[:, 256:] and adds P V[:, 256:] with P from the shared tile, then frees the
P tile (``P_FREE``) for the next tile's P. Each consumer warp releases the ring stage after its P·V.

The masked tiles (the sequence's tail and, causally, the last Sq - 1 keys) mask S; their V rows past the sequence
are zeroed in shared memory by the warpgroup that reads them (the cache past a sequence's end may hold anything,
NaN included, and 0 · NaN is NaN in P V). At the end the softmax warpgroup publishes 1 / l per row (and writes
LSE); both store their O columns from registers: out [B, Sq, Hq, 512] (and lse [B, Hq, Sq]) or, with splits, the
normalised f32 partial O and LSE of ``combine_kernel``'s workspace. Rows with no key give zeros and LSE -inf.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import nvfly
from nvfly.arch import sm90
from nvfly.arch.memory import L2Policy, store_shared
from nvfly.arch.ptx import smem_address
from nvfly.ops.attention.mla_plan import (BLOCK_M, BLOCK_N, BOX_BYTES, CONSUMER_REGS, DQK, DV, FINAL_OFFSET,
                                          P_OFFSET, PRODUCER_REGS, Q_BYTES, Q_OFFSET, RESCALE_OFFSET, RING_OFFSET,
                                          STAGE_BYTES, STAGES, SWIZZLE, unmasked_end)
from nvfly.ops.attention.softmax import LN2, NEG_INF, online_softmax, row_of
from nvfly.ops.attention.wgmma_tiles import (Running, mask_key_tile, page_and_row, rescaled_plus_pv,
                                             zero_tail_rows)

HALF = DV // 2             # O columns of a consumer warpgroup
CONSUMER_THREADS = 256
# hardware barriers (0 is __syncthreads)
P_READY = 1                # softmax warpgroup -> value warpgroup: P and the rescales are in shared memory
P_FREE = 2                 # value warpgroup -> softmax warpgroup: its P V is done, the P tile may be rewritten
FINAL = 3                  # the rows' 1 / l are in shared memory
OWN = (4, 5)               # a consumer warpgroup's own barrier (its zeroed V rows before its wgmma)


class Layouts(NamedTuple):
    """The atoms, shared-memory operand layouts and descriptor fields (leading, stride byte offsets, swizzle)."""
    s_atom: Any
    pv_registers: Any
    pv_shared: Any
    q_layout: Any
    k_layout: Any
    v_layout: Any
    p_layout: Any
    q_desc: tuple
    k_desc: tuple
    v_desc: tuple
    p_desc: tuple


def layouts(dtype: Any) -> Layouts:
    q_layout = sm90.operand_layout(BLOCK_M, DQK, dtype, "K", SWIZZLE)
    k_layout = sm90.operand_layout(BLOCK_N, DQK, dtype, "K", SWIZZLE)
    v_layout = sm90.operand_layout(DV, BLOCK_N, dtype, "MN", SWIZZLE)  # the same bytes as k_layout's first 512
    p_layout = sm90.operand_layout(BLOCK_M, BLOCK_N, dtype, "K", SWIZZLE)
    return Layouts(sm90.WgmmaAtom(BLOCK_N, dtype, dtype, "K", "K"),
                   sm90.WgmmaAtom(HALF, dtype, dtype, "K", "MN", a_source="registers"),
                   sm90.WgmmaAtom(HALF, dtype, dtype, "K", "MN"),
                   q_layout, k_layout, v_layout, p_layout,
                   sm90.descriptor_offsets(q_layout, dtype, "K", SWIZZLE) + (SWIZZLE,),
                   sm90.descriptor_offsets(k_layout, dtype, "K", SWIZZLE) + (SWIZZLE,),
                   sm90.descriptor_offsets(v_layout, dtype, "MN", SWIZZLE) + (SWIZZLE,),
                   sm90.descriptor_offsets(p_layout, dtype, "K", SWIZZLE) + (SWIZZLE,))


class Tile(NamedTuple):
    """What every key tile of a consumer warpgroup needs: shared addresses, the ring's pipeline, the layouts, the
    sequence's length, the scale in log2 units, the thread's two rows' positions (token's position in the
    sequence), its lane and index in the warpgroup, and the split's tiles [begin, end)."""
    q_tile: Any
    ring: Any
    p_tile: Any
    rescale: Any
    pipe: Any
    lay: Any
    seqlen: Any
    scale_log2: Any
    positions: list
    lane: Any
    thread: Any
    begin: Any
    end: Any


def p_store_offset(lay: Layouts, row: Any, column: Any) -> Any:
    """Byte offset of P's (row, column) in the shared P tile: the swizzled layout (``p_layout(...)``, what the
    hardware's 128-byte swizzle makes of the canonical offset ``p_layout.inner(...)`` that descriptors carry)."""
    return lay.p_layout((row, column)) * 2


@nvfly.func
def softmax_tile(state, t, n, PLAN, MASKED):
    """The softmax warpgroup's part of key tile ``n``: S, the online softmax, P and the rescales published, its
    P V half."""
    lay = t.lay
    stage = t.ring + state.stage.stage * STAGE_BYTES
    steps_per_box = (SWIZZLE // 2) // lay.s_atom.k
    if not PLAN.chunked:
        t.pipe.consumer_wait(state.stage)
    s = sm90.Accumulator.undefined(lay.s_atom)
    sm90.fence()
    for ks in nvfly.static_range(DQK // lay.s_atom.k):
        if PLAN.chunked and ks % steps_per_box == 0:  # the box's bytes have landed: its wgmma may read them
            t.pipe.consumer_wait(state.stage, ks // steps_per_box)
        dq = sm90.smem_descriptor(t.q_tile + lay.q_layout.inner((0, ks * lay.s_atom.k)) * 2, *lay.q_desc)
        dk = sm90.smem_descriptor(stage + lay.k_layout.inner((0, ks * lay.s_atom.k)) * 2, *lay.k_desc)
        s = sm90.mma(lay.s_atom, s, dq, dk, zero=ks == 0)
    sm90.commit_group()
    sm90.wait_group(0)

    scores = [s[i] for i in range(len(s))]
    if MASKED:
        scores = mask_key_tile(scores, n * BLOCK_N + 2 * (t.lane % 4), t.seqlen, t.positions, PLAN.causal)
    soft = online_softmax(scores, state.maxima, state.sums, t.scale_log2, MASKED)
    rescales, p = soft.rescales, soft.p
    fragments = s.map(lambda x, i: p[i]).to_a_fragments(lay.pv_registers)

    # P and the rescales to shared memory for the value warpgroup, once it is done with the last tile's
    if n != t.begin:  # the split's first tile has no earlier P
        nvfly.named_barrier(P_FREE, CONSUMER_THREADS)
    warp_row = 16 * (t.thread // 32) + t.lane // 4
    for step in nvfly.static_range(len(fragments)):
        for reg in nvfly.static_range(4):  # register r: row + 8 (r % 2), columns 8 (r // 2) + 2 (lane % 4) + {0, 1}
            row = warp_row + 8 * (reg % 2)
            column = 16 * step + 8 * (reg // 2) + 2 * (t.lane % 4)
            store_shared(t.p_tile + p_store_offset(lay, row, column), [fragments[step].registers[reg]])
    if t.lane % 4 == 0:
        t.rescale[warp_row] = rescales[0]
        t.rescale[warp_row + 8] = rescales[1]
    sm90.fence_proxy_async()  # P's generic writes before the value warpgroup's wgmma reads them
    nvfly.named_barrier_arrive(P_READY, CONSUMER_THREADS)

    if MASKED:
        zero_tail_rows(stage, t.seqlen - n * BLOCK_N, t.thread, OWN[0], 0, 4, BLOCK_N)
    acc = rescaled_plus_pv(state.acc, rescales, fragments, stage, lay.pv_registers, lay.v_layout, lay.v_desc)
    if t.lane == 0:
        t.pipe.consumer_release(state.stage)
    return Running(soft.maxima, soft.sums, acc, state.stage.advance())


@nvfly.func
def value_tile(state, t, n, PLAN, MASKED):
    """The value warpgroup's part of key tile ``n``: its O half rescaled and P V[:, 256:] added with P from the
    shared tile; frees the P tile unless ``n`` is the split's last tile."""
    lay = t.lay
    stage = t.ring + state.stage.stage * STAGE_BYTES
    if PLAN.chunked:  # the boxes of V[:, 256:]
        for box in nvfly.static_range(HALF // (SWIZZLE // 2), DV // (SWIZZLE // 2)):
            t.pipe.consumer_wait(state.stage, box)
    else:
        t.pipe.consumer_wait(state.stage)
    nvfly.named_barrier(P_READY, CONSUMER_THREADS)
    warp_row = 16 * (t.thread // 32) + t.lane // 4
    rescales = [t.rescale[warp_row], t.rescale[warp_row + 8]]
    if MASKED:
        zero_tail_rows(stage, t.seqlen - n * BLOCK_N, t.thread, OWN[1], 4, 4, BLOCK_N)
    acc = state.acc.map(lambda x, i: x * rescales[row_of(i)])
    sm90.fence()
    for ks in nvfly.static_range(BLOCK_N // lay.pv_shared.k):
        dp = sm90.smem_descriptor(t.p_tile + lay.p_layout.inner((0, ks * lay.pv_shared.k)) * 2, *lay.p_desc)
        dv = sm90.smem_descriptor(stage + lay.v_layout.inner((HALF, ks * lay.pv_shared.k)) * 2, *lay.v_desc)
        acc = sm90.mma(lay.pv_shared, acc, dp, dv)
    sm90.commit_group()
    sm90.wait_group(0)
    if n + 1 < t.end:
        nvfly.named_barrier_arrive(P_FREE, CONSUMER_THREADS)
    if t.lane == 0:
        t.pipe.consumer_release(state.stage)
    return Running(state.maxima, state.sums, acc, state.stage.advance())


@nvfly.kernel
def attention_mla_kernel(q_desc: nvfly.TmaDescriptor, k_desc: nvfly.TmaDescriptor, block_table,
                         seqlens: nvfly.Tensor, out, lse, partial_o, partial_lse, batch: nvfly.i32,
                         scale_log2: nvfly.f32, PLAN: nvfly.Constexpr):
    """One (split x row block, batch) CTA (module docstring). Without splits it writes out [B, Sq, Hq, 512] and lse
    [B, Hq, Sq] (f32, natural log; None: not wanted); with splits partial_o [splits * B * Sq * Hq, 512] and
    partial_lse [splits * B * Sq * Hq] (f32; row ((split * B + b) * Sq + token) * Hq + head). block_table [B, pages]
    int32 when paged, else None."""
    if PLAN.pdl_combine:  # as the decode kernel's (``DecodePlan.pdl_combine``): the combine waits for this grid's end
        nvfly.launch_dependents()
    dtype = q_desc.info.dtype
    lay = layouts(dtype)
    SQ, H, SPLITS, M_BLOCKS = PLAN.sq, PLAN.heads, PLAN.splits, PLAN.m_blocks
    boxes = sm90.operand_boxes(lay.q_layout, BLOCK_M, DQK, dtype, "K", SWIZZLE)[1][0]  # 9 boxes, one a chunk

    bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (1 + (PLAN.full_barriers + 1) * STAGES,)))
    q_tile = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (Q_BYTES,), offset_bytes=Q_OFFSET))
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (STAGES * STAGE_BYTES,), offset_bytes=RING_OFFSET))
    p_tile = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (BLOCK_M * BLOCK_N * 2,), offset_bytes=P_OFFSET))
    rescale = nvfly.dynamic_shared_tensor(nvfly.f32, (BLOCK_M,), offset_bytes=RESCALE_OFFSET)
    final = nvfly.dynamic_shared_tensor(nvfly.f32, (BLOCK_M,), offset_bytes=FINAL_OFFSET)
    q_bar = bars
    pipe = sm90.TmaPipeline(bars + 8, STAGES, STAGE_BYTES, consumer_arrivals=8,  # each consumer warp releases
                            chunks=PLAN.full_barriers)
    hint = L2Policy.EVICT_FIRST if PLAN.evict_first else None

    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    wg = warp // 4
    if tid == 0:
        sm90.mbarrier_init(q_bar, 1)
        pipe.init()
        sm90.tma_prefetch_descriptor(q_desc)
        sm90.tma_prefetch_descriptor(k_desc)
    nvfly.syncthreads()

    split = nvfly.block_idx.x // M_BLOCKS
    m_block = nvfly.block_idx.x % M_BLOCKS
    b = nvfly.block_idx.y
    seqlen = seqlens[b]
    n_blocks = (seqlen + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + SPLITS - 1) // SPLITS
    begin = split * per_split
    end = nvfly.maximum(nvfly.minimum(begin + per_split, n_blocks), begin)
    middle = nvfly.maximum(nvfly.minimum(unmasked_end(seqlen, SQ, PLAN.causal, nvfly.maximum), end), begin)

    if wg == 0:
        sm90.setmaxnreg(PRODUCER_REGS, increase=False)
        if tid == 0:
            sm90.mbarrier_arrive_expect_tx(q_bar, Q_BYTES)
            for box in boxes:
                sm90.tma_load(q_desc, q_tile + box.smem_offset, (b, m_block * BLOCK_M + box.mn_offset, box.k_offset),
                              q_bar)
            loading = sm90.PipelineState.start(STAGES)
            for n in range(begin, end):
                key = n * BLOCK_N
                page, row = page_and_row(PLAN, block_table, b, key)
                pipe.producer_acquire(loading)
                if not PLAN.chunked:
                    pipe.producer_expect(loading)
                for i, box in enumerate(boxes):
                    if PLAN.chunked:
                        pipe.producer_expect(loading, i, BOX_BYTES)
                    sm90.tma_load(k_desc, ring + loading.stage * STAGE_BYTES + box.smem_offset,
                                  (page, row, 0, box.k_offset), pipe.full(loading.stage, i if PLAN.chunked else 0),
                                  cache_hint=hint)
                loading = loading.advance()
    else:
        sm90.setmaxnreg(CONSUMER_REGS, increase=True)
        lane = nvfly.lane_idx()
        thread = tid % 128
        row0 = 16 * (warp % 4) + lane // 4  # the thread's rows in the block: row0, row0 + 8
        packed = [m_block * BLOCK_M + row0, m_block * BLOCK_M + row0 + 8]
        positions = [seqlen - SQ + r // H for r in packed]
        t = Tile(q_tile, ring, p_tile, rescale, pipe, lay, seqlen, scale_log2, positions, lane, thread, begin,
                 end)
        state = Running([nvfly.f32(NEG_INF)] * 2, [nvfly.f32(0.0)] * 2, sm90.Accumulator.zeros(lay.pv_registers),
                        sm90.PipelineState.start(STAGES))
        sm90.mbarrier_wait(q_bar, 0)
        if wg == 1:
            for n in range(begin, middle):
                state = softmax_tile(state, t, n, PLAN, False)
            for n in range(middle, end):
                state = softmax_tile(state, t, n, PLAN, True)
        else:
            for n in range(begin, middle):
                state = value_tile(state, t, n, PLAN, False)
            for n in range(middle, end):
                state = value_tile(state, t, n, PLAN, True)
        store_rows(state, t, out, lse, partial_o, partial_lse, final, b, split, batch, packed, wg - 1, PLAN)


@nvfly.func
def store_rows(state, t, out, lse, partial_o, partial_lse, final, b, split, batch, packed, half, PLAN):
    """The softmax warpgroup publishes 1 / l per row (0 for a row with no key) and writes LSE (natural log, -inf
    for a row with no key); then each consumer warpgroup stores its O half / l as 4-byte pairs."""
    SQ, H = PLAN.sq, PLAN.heads
    row0 = 16 * (t.thread // 32) + t.lane // 4
    if half == 0:
        for r in nvfly.static_range(2):
            total = state.sums[r] + nvfly.shfl_xor(state.sums[r], 1)
            total = total + nvfly.shfl_xor(total, 2)
            kept = total > 0.0
            row_lse = nvfly.select(kept, (state.maxima[r] * t.scale_log2 + nvfly.log2(nvfly.maximum(total, 1e-30)))
                                   * LN2, NEG_INF)
            if t.lane % 4 == 0:
                final[row0 + 8 * r] = nvfly.select(kept, 1.0 / nvfly.maximum(total, 1e-30), 0.0)
                token = packed[r] // H
                head = packed[r] % H
                if packed[r] < SQ * H:
                    if PLAN.splits == 1:
                        if lse is not None:
                            lse[b, head, token] = row_lse
                    else:
                        partial_lse[((split * batch + b) * SQ + token) * H + head] = row_lse
    nvfly.named_barrier(FINAL, CONSUMER_THREADS)
    for r in nvfly.static_range(2):
        inverse = final[row0 + 8 * r]
        token = packed[r] // H
        head = packed[r] % H
        inside = packed[r] < SQ * H
        slot = ((split * batch + b) * SQ + token) * H + head
        for j in nvfly.static_range(HALF // 8):
            column = half * HALF + 8 * j + 2 * (t.lane % 4)
            pair = nvfly.make_vector([state.acc[4 * j + 2 * r] * inverse, state.acc[4 * j + 2 * r + 1] * inverse])
            if PLAN.splits == 1:
                out.store(pair.to(out.dtype), b, token, head, column, mask=inside)
            else:
                partial_o.store(pair, slot, column, mask=inside)
