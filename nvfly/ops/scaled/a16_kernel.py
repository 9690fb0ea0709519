"""MXFP4 weights x 16-bit activations for small M: a memory-bound stream of the packed weight through mma.sync.

    out[t, j] = sum_k x[t, k] * e2m1(w[j, k]) * 2^(w_scale[j, k / 32] - 127) (+ bias[j])

x (M, K) bf16 or fp16 with K contiguous, w (N, K/2) packed e2m1 pairs (the low nibble the lower k), w_scale (N, K/32)
e8m0 bytes. The kernel computes the transposed product (swap AB): the weight's rows are the A operand of
``mma.m16n8k16`` (16 output columns per warp), the tokens its B operand (8 a tile, two tiles for M > 8), so the
weight, the only large operand, is read once and dequantised in registers (never converted in shared memory).

K permutation. A chunk is 128 k of 16 weight rows: lane l (g = l / 4, p = l % 4) loads the 16 bytes of rows g and
g + 8 at k 32p..32p+31 of the chunk (one MX block, so one scale byte per row; a warp instruction reads 8 rows x 64
contiguous bytes). Each 32-bit word j of those 16 bytes holds k 32p + 8j .. +7; ``e2m1x8_to_16bit_scaled`` turns it
into four words pairing values (i, i + 4) (shifts and masks, then one packed multiply by the block's scale, which
also undoes the conversion's 2^-126 (bf16) or 2^-14 (fp16)). mma step (j, s), s = 0, 1, takes pair words 2s (A
registers 0, 1: rows g, g + 8) and 2s + 1 (registers 2, 3); the tokens' 16-byte vectors (k 32p + 8j .. +7 in
natural order) are regrouped by ``pair_halves`` into the same pairs for the B registers. Which lane's k sits at which
ISA k index is free as long as A and B agree, so no shuffles are needed.

Parallelism (``a16_plan``). Grid: weight-row groups x K splits x token blocks (token blocks fastest). The CTA's
warps take its chunks round robin. With ``A16Config.stages`` (the default) each warp streams them through a private
ring of cp.async stages in shared memory (``stream_ring``): ``stages - 1`` chunks in flight, each lane reading back
only its own 32 bytes, so only ``cp.async.wait_group`` orders it. With ``stages`` 0 a warp loads ``unroll`` chunks
straight into registers (read-only path, no L1 allocation, 256-byte L2 prefetch) before their math; ptxas may then
delay the later loads. The tokens (L1 / L2 hits) and scales are read at use. Rows past N and tokens past M are
clamped (their results are never stored); a K tail (K % 128, whole MX blocks) is one predicated chunk of the last
warp of the last split, zeros past K in both operands. The warps' partial tiles meet in shared memory; one thread
per output sums them and stores out (+ bias), or, with split K, the f32 sum into partials[split] for the scaled
GEMM's reduce kernel.
"""
from __future__ import annotations

import nvfly
from nvfly.arch import sm80, sm90
from nvfly.arch.floats import (e2m1x8_shuffled_to_16bit_scaled, e2m1x8_to_16bit_scaled, e8m0_to_16bit_factors,
                               pair_halves, scale_16bit_pairs)
from nvfly.arch.memory import L1Eviction, load_global, load_shared
from nvfly.arch.ptx import smem_address
from nvfly.ops.scaled.a16_plan import (CHUNK_K, LANE_K, RING_CHUNK_BYTES, ROWS, TMA_BARRIER_BYTES, TMA_BOX_BYTES,
                                       TMA_CHUNKS, TMA_STAGE_BYTES, TMA_WEIGHT_BYTES, TMA_SCALE_BYTES, TOKEN_BLOCK)

TILE = ROWS * TOKEN_BLOCK  # a CTA's outputs


def load_weight(w_rows: tuple, s_rows: tuple, kk, valid) -> tuple:
    """This lane's 16 packed bytes (32 k from ``kk``) of both weight rows as four i32 words each, and the rows'
    scale bytes. ``valid`` (i1 or None): where false nothing is read and the words are zero (a K tail); the scale
    index is then clamped in range (the scale only multiplies those zeros)."""
    if valid is None:
        words = [load_global(r.address(kk // 2), 4, non_coherent=True, l1=L1Eviction.NO_ALLOCATE, prefetch=256)
                 for r in w_rows]
        block = kk // LANE_K
    else:
        words = [load_global(r.address(nvfly.minimum(kk, r.shape[0] * 2 - LANE_K) // 2), 4, valid,
                             non_coherent=True, l1=L1Eviction.NO_ALLOCATE) for r in w_rows]
        block = nvfly.minimum(kk // LANE_K, s_rows[0].shape[0] - 1)
    return words, [s[block] for s in s_rows]


def load_tokens(x_rows: list, kk, valid) -> list:
    """Each token tile's row g at k ``kk`` .. +31: four 16-byte vectors as 16 i32 words (natural k order); zeros
    where ``valid`` (i1 or None) is false."""
    tiles = []
    for x in x_rows:
        words = []
        for j in range(LANE_K // 8):
            if valid is None:
                v = x.load(kk + 8 * j, width=8)
            else:
                v = x.load(nvfly.minimum(kk, x.shape[0] - LANE_K) + 8 * j, width=8, mask=valid)
            words.extend(v.bitcast(nvfly.i32).tolist())
        tiles.append(words)
    return tiles


def lane_block(accs: list, weight: tuple, tokens: list, dtype, wide: bool, layout: str) -> list:
    """Accumulate the lane's 32 k of a chunk: 8 k16 mma steps per token tile (the module docstring's K
    permutation). ``wide`` (``A16Config.wide_scales``): a second packed multiply makes scales past 2 (e8m0 bytes
    > 128) exact too (``e8m0_to_16bit_factors``); without it they make the factor inf and poison the output.
    ``layout`` (``A16Config.layout``): "shuffled" words hold ``shuffle_mxfp4_a16``'s nibble order, whose pairs are
    the tokens' natural words (no ``prmt``); "shuffled-bf16" / "-f16" its bit-shuffled order (the same pairs from
    fewer integer ops, ``e2m1x8_shuffled_to_16bit_scaled``)."""
    convert = e2m1x8_shuffled_to_16bit_scaled if layout.startswith("shuffled-") else e2m1x8_to_16bit_scaled
    words, scales = weight
    factors = [e8m0_to_16bit_factors(s, dtype, wide) for s in scales]
    out = [list(a) for a in accs]
    for j in range(LANE_K // 8):
        rows = [convert(words[h][j], factors[h][0], dtype) for h in range(2)]
        if wide:
            rows = [scale_16bit_pairs(rows[h], factors[h][1], dtype) for h in range(2)]
        pairs = [token_pairs(x, j, pair_halves) if layout == "natural" else token_words(x, j) for x in tokens]
        for s in range(2):
            for t in range(len(out)):
                a, b = step_operands(rows, pairs[t], s)
                out[t] = sm80.mma_m16n8k16(a, b, out[t], dtype)
    return out


def token_pairs(words: list, j: int, pair) -> list:
    """A token row's word group ``j`` (k 8j .. 8j+7 of the lane's 32, natural order: (k0,k1) .. (k6,k7)) as the
    pairs the weight conversion gives, (k0,k4) (k1,k5) (k2,k6) (k3,k7), by ``pair`` (``pair_halves``)."""
    t = words[4 * j:4 * j + 4]
    return pair(t[0], t[2]) + pair(t[1], t[3])


def token_words(words: list, j: int) -> list:
    """A token row's word group ``j`` as the shuffled layout pairs it: (k0,k1) (k2,k3) (k4,k5) (k6,k7), the natural
    words as loaded (``shuffle_mxfp4_a16`` puts k 2i and 2i + 1 at nibbles i and i + 4 of each weight word)."""
    return words[4 * j:4 * j + 4]


def step_operands(rows: list, pairs: list, s: int) -> tuple[list, list]:
    """mma step ``s`` (0, 1) of a word group: A registers (row g, row g + 8, row g, row g + 8) = pair words 2s, 2s,
    2s + 1, 2s + 1 of the two weight rows (PTX's a0..a3: rows g / g + 8 at ISA k 2p, 2p + 1, then at 2p + 8, 2p + 9),
    B registers (b0, b1) = the token's pair words 2s, 2s + 1 (the same k)."""
    return ([rows[0][2 * s], rows[1][2 * s], rows[0][2 * s + 1], rows[1][2 * s + 1]],
            [pairs[2 * s], pairs[2 * s + 1]])


def load_chunks(w_rows: tuple, s_rows: tuple, chunks: list, p, k, tail: bool) -> list:
    """The weight of every chunk in ``chunks`` (first k of each) as (kk, valid, weight); ``tail``: the one partial
    chunk, masked at K."""
    loaded = []
    for c in chunks:
        kk = c + LANE_K * p
        valid = kk < k if tail else None
        loaded.append((kk, valid, load_weight(w_rows, s_rows, kk, valid)))
    return loaded


def math_chunks(accs: list, x_rows: list, loaded: list, dtype, cfg) -> list:
    """The tokens and the mmas of ``load_chunks``' chunks, one after the other."""
    for kk, valid, weight in loaded:
        accs = lane_block(accs, weight, load_tokens(x_rows, kk, valid), dtype, cfg.wide_scales, cfg.layout)
    return accs


def stream_chunks(accs: list, w_rows: tuple, s_rows: tuple, x_rows: list, chunks: list, p, k, tail: bool,
                  dtype, cfg) -> list:
    """Load the weight of every chunk in ``chunks`` (first k of each), then the tokens and the mmas chunk by chunk;
    ``tail``: the one partial chunk, masked at K."""
    return math_chunks(accs, x_rows, load_chunks(w_rows, s_rows, chunks, p, k, tail), dtype, cfg)


@nvfly.func
def stream_ahead(accs, w_rows, s_rows, x_rows, c_begin, first, count, p, k, DTYPE, CFG):
    """``A16Config(ahead=True)``: the warp's ``count`` (> 0) groups of ``unroll`` chunks (groups first, first +
    warps, ... from chunk ``c_begin``), each group's weights loaded before the previous group's math and carried in
    registers, so that its loads are in flight during a whole group of conversions (the last iteration reloads the
    last group, unused)."""
    UNROLL, WARPS = CFG.unroll, CFG.warps

    def group(gi):
        return [w for _, _, (words, scales) in
                load_chunks(w_rows, s_rows, [(c_begin + gi * UNROLL + u) * CHUNK_K
                                             for u in nvfly.static_range(UNROLL)], p, k, False)
                for w in (words, scales)]
    ahead = group(first)
    for i in range(0, count):
        current = ahead
        ahead = group(first + nvfly.minimum(i + 1, count - 1) * WARPS)
        g = first + i * WARPS
        loaded = [((c_begin + g * UNROLL + u) * CHUNK_K + LANE_K * p, None, (current[2 * u], current[2 * u + 1]))
                  for u in nvfly.static_range(UNROLL)]
        accs = math_chunks(accs, x_rows, loaded, DTYPE, CFG)
    return accs


def copy_chunk(slot, w_rows: tuple, kk, valid) -> None:
    """cp.async this lane's 16 bytes of both weight rows at k ``kk`` to its 32-byte ``slot`` of a ring stage, as one
    commit group; where ``valid`` (i1) is false nothing is read and the slot is zero-filled."""
    for h in range(2):
        sm80.cp_async(slot + 16 * h, w_rows[h].address(kk // 2), 16, valid)
    sm80.cp_async_commit()


@nvfly.func
def stream_ring(accs, w_rows, s_rows, x_rows, slot, first, count, p, DTYPE, CFG):
    """The warp's ``count`` full chunks (first, first + warps, ...) through its private cp.async ring (``slot``:
    this lane's 32 bytes of stage 0; stages RING_CHUNK_BYTES apart): ``stages - 1`` chunks in flight, each lane
    reading back only what it copied (so no warp synchronisation), the scales and tokens read at use (L1 hits)."""
    S = CFG.stages
    STEP = CFG.warps * CHUNK_K
    k0 = first * CHUNK_K + LANE_K * p
    for i in nvfly.static_range(S - 1):
        copy_chunk(slot + i * RING_CHUNK_BYTES, w_rows, nvfly.maximum(nvfly.minimum(i, count - 1), 0) * STEP + k0,
                   i < count)
    for i in range(0, count):
        ahead = i + S - 1
        copy_chunk(slot + (ahead % S) * RING_CHUNK_BYTES, w_rows, nvfly.minimum(ahead, count - 1) * STEP + k0,
                   ahead < count)
        sm80.cp_async_wait(S - 1)  # chunk i's copies have landed
        kk = i * STEP + k0
        stage = slot + (i % S) * RING_CHUNK_BYTES
        words = [load_shared(stage + 16 * h, 4) for h in range(2)]
        accs = lane_block(accs, (words, [s[kk // LANE_K] for s in s_rows]), load_tokens(x_rows, kk, None), DTYPE,
                          CFG.wide_scales, CFG.layout)
    sm80.cp_async_wait(0)
    return accs


@nvfly.func
def produce_tma_ring(pipe, ring, w_desc, s_desc, n0, c_begin, count, S):
    """The producer warp's one thread: ``count`` stages of TMA_CHUNKS chunks from chunk ``c_begin``, each the CTA's
    16 weight rows (two 128-byte-wide boxes) and their scale bytes, into the ring once its consumer released the
    stage. Boxes past N or K read as zeros."""
    for j in range(0, count):
        state = sm90.PipelineState(j % S, (j // S) & 1, S)
        pipe.producer_acquire(state)
        pipe.producer_expect(state)
        stage = ring + state.stage * TMA_STAGE_BYTES
        first = c_begin + j * TMA_CHUNKS
        full = pipe.full(state.stage)
        for box in nvfly.static_range(TMA_WEIGHT_BYTES // (ROWS * TMA_BOX_BYTES)):
            sm90.tma_load(w_desc, stage + box * ROWS * TMA_BOX_BYTES,
                          (n0, first * (CHUNK_K // 2) + box * TMA_BOX_BYTES), full)
        sm90.tma_load(s_desc, stage + TMA_WEIGHT_BYTES, (n0, first * (CHUNK_K // LANE_K)), full)


def ring_offsets(u: int, g, p) -> tuple[list, list]:
    """Byte offsets in a TMA ring stage of this lane's 16 bytes of rows g and g + 8 of chunk ``u`` (boxes of 16 rows
    x 128 bytes, 128-byte swizzled: 16-byte segment q of row r lies at segment q ^ (r % 8)), and of their scale
    bytes (the 16 x 16-byte scale box behind the weights)."""
    per_box = TMA_BOX_BYTES // (CHUNK_K // 2)  # chunks a box holds
    box, seg = u // per_box, (u % per_box) * (CHUNK_K // 32) + p
    rows = [g, g + 8]
    words = [box * ROWS * TMA_BOX_BYTES + r * TMA_BOX_BYTES + (seg ^ (r % 8)) * 16 for r in rows]
    scales = [TMA_WEIGHT_BYTES + r * (TMA_SCALE_BYTES // ROWS) + u * (CHUNK_K // LANE_K) + p for r in rows]
    return words, scales


@nvfly.func
def consume_tma_ring(accs, pipe, ring, ring_bytes, x_rows, c_begin, c_end, first, count, lane, g, p, k, DTYPE, CFG):
    """A warp's stages first, first + warps, ... (< ``count``) of the TMA ring: chunk by chunk, its lanes' bytes
    read back, then the tokens and the mmas; the stage released after its last chunk's mmas (released right after
    the last reads, a reused stage gave wrong results on the H200: the refill overtook reads still in flight);
    chunks at or past ``c_end`` (the next split's, or past K) count as zeros."""
    S, WARPS = CFG.tma_stages, CFG.warps
    for j in range(first, count, WARPS):
        state = sm90.PipelineState(j % S, (j // S) & 1, S)
        pipe.consumer_wait(state)
        stage = ring + state.stage * TMA_STAGE_BYTES
        for u in nvfly.static_range(TMA_CHUNKS):
            offsets, scale_offsets = ring_offsets(u, g, p)
            words = [load_shared(stage + o, 4) for o in offsets]
            scales = [ring_bytes[state.stage * TMA_STAGE_BYTES + o] for o in scale_offsets]
            c = c_begin + j * TMA_CHUNKS + u
            inside = c < c_end
            words = [[nvfly.select(inside, w, 0) for w in row] for row in words]
            kk = nvfly.minimum(c * CHUNK_K, k - CHUNK_K) + LANE_K * p  # in range (the words are zero past c_end)
            accs = lane_block(accs, (words, scales), load_tokens(x_rows, kk, None), DTYPE, CFG.wide_scales,
                              CFG.layout)
        # after the last chunk's mmas, which consumed every value read from the stage: the producer may refill it
        nvfly.syncwarp()
        if lane == 0:
            pipe.consumer_release(state)
    return accs


@nvfly.kernel
def mxfp4_a16_kernel(w: nvfly.Tensor, w_scale: nvfly.Tensor, x: nvfly.Tensor, out: nvfly.Tensor, bias,
                     m: nvfly.i32, n: nvfly.i32, k: nvfly.i32, chunks_per_split: nvfly.i32, token_blocks: nvfly.i32,
                     splits: nvfly.i32, w_desc, s_desc, CFG: nvfly.Constexpr, M_TILES: nvfly.Constexpr,
                     PARTIAL: nvfly.Constexpr):
    """out (M, N) = x (M, K) @ dequantised w (N, K)^T (+ bias); PARTIAL: out is partials [splits, M, N] f32 and
    each split stores its K range's sum (the scales were applied in the mainloop; the bias is the reduce's).
    ``splits`` is a runtime value (CFG's is unused, 0), so that shapes that split differently share a compile.
    ``w_desc``, ``s_desc`` (``CFG.tma_stages``, else None): TMA descriptors of w and w_scale, boxes of 16 rows x
    128 bytes (128-byte swizzle) and 16 rows x 16 bytes."""
    WARPS, UNROLL = CFG.warps, CFG.unroll
    THREADS = CFG.threads
    dtype = x.dtype
    # 512 threads an SM; the TMA ring's two token tiles take more registers than 3 CTAs of 160 threads leave
    nvfly.min_blocks_per_sm(2 if CFG.tma_stages and M_TILES == 2 else max(1, 512 // THREADS))
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    g = lane // 4
    p = lane % 4
    bid = nvfly.block_idx.x
    block = bid % token_blocks
    split = (bid // token_blocks) % splits
    group = bid // (token_blocks * splits)
    n0 = group * ROWS
    t0 = block * TOKEN_BLOCK

    # rows past N and tokens past M are clamped: they only feed results that are not stored
    w_rows = (w[nvfly.minimum(n0 + g, n - 1), :], w[nvfly.minimum(n0 + g + 8, n - 1), :])
    s_rows = (w_scale[nvfly.minimum(n0 + g, n - 1), :], w_scale[nvfly.minimum(n0 + g + 8, n - 1), :])
    x_rows = [x[nvfly.minimum(t0 + g + 8 * t, m - 1), :] for t in nvfly.static_range(M_TILES)]
    accs = [[nvfly.f32(0.0)] * 4 for _ in nvfly.static_range(M_TILES)]
    full = k // CHUNK_K
    c_begin = split * chunks_per_split
    c_end = nvfly.minimum(c_begin + chunks_per_split, full)
    unrolled = (c_end - c_begin) // UNROLL
    if CFG.tma_stages:
        S = CFG.tma_stages
        bars = smem_address(nvfly.dynamic_shared_tensor(nvfly.i64, (2 * S,)))
        ring_bytes = nvfly.dynamic_shared_tensor(nvfly.u8, (S * TMA_STAGE_BYTES,), offset_bytes=TMA_BARRIER_BYTES)
        ring = smem_address(ring_bytes)
        pipe = sm90.TmaPipeline(bars, S, TMA_WEIGHT_BYTES + TMA_SCALE_BYTES, consumer_arrivals=1)
        if tid == 0:
            pipe.init()
            sm90.tma_prefetch_descriptor(w_desc)
            sm90.tma_prefetch_descriptor(s_desc)
        nvfly.syncthreads()
        count = nvfly.maximum(c_end - c_begin + TMA_CHUNKS - 1, 0) // TMA_CHUNKS
        if warp == WARPS:
            if lane == 0:
                produce_tma_ring(pipe, ring, w_desc, s_desc, n0, c_begin, count, S)
        else:
            accs = consume_tma_ring(accs, pipe, ring, ring_bytes, x_rows, c_begin, c_end, warp, count, lane, g, p, k,
                                    dtype, CFG)
    elif CFG.stages:
        ring = smem_address(nvfly.shared_tensor(nvfly.u8, (WARPS * CFG.stages * RING_CHUNK_BYTES,)))
        accs = stream_ring(accs, w_rows, s_rows, x_rows, ring + warp * (CFG.stages * RING_CHUNK_BYTES) + lane * 32,
                           c_begin + warp, nvfly.maximum(c_end - c_begin - warp + WARPS - 1, 0) // WARPS, p, dtype,
                           CFG)
    else:
        if CFG.ahead:
            if unrolled > warp:
                accs = stream_ahead(accs, w_rows, s_rows, x_rows, c_begin, warp, (unrolled - warp + WARPS - 1) // WARPS,
                                    p, k, dtype, CFG)
        else:
            for gi in range(warp, unrolled, WARPS):
                first = c_begin + gi * UNROLL
                accs = stream_chunks(accs, w_rows, s_rows, x_rows,
                                     [(first + u) * CHUNK_K for u in nvfly.static_range(UNROLL)], p, k, False, dtype,
                                     CFG)
        for c in range(c_begin + unrolled * UNROLL + warp, c_end, WARPS):
            accs = stream_chunks(accs, w_rows, s_rows, x_rows, [c * CHUNK_K], p, k, False, dtype, CFG)
    if (split == splits - 1) & (warp == WARPS - 1) & (full * CHUNK_K < k):
        accs = stream_chunks(accs, w_rows, s_rows, x_rows, [full * CHUNK_K], p, k, True, dtype, CFG)

    # every warp's fragments into shared memory as [warp][token][column], then one thread per output sums them
    if CFG.tma_stages:
        partial = nvfly.dynamic_shared_tensor(nvfly.f32, (WARPS * TILE,),
                                              offset_bytes=TMA_BARRIER_BYTES + CFG.tma_stages * TMA_STAGE_BYTES)
    else:
        partial = nvfly.shared_tensor(nvfly.f32, (WARPS * TILE,))
    if CFG.tma_stages == 0 or warp < WARPS:  # not the TMA producer warp
        for t in nvfly.static_range(M_TILES):
            for i in nvfly.static_range(4):
                col = g + 8 * (i // 2)
                token = 8 * t + 2 * p + i % 2
                partial[warp * TILE + token * ROWS + col] = accs[t][i]
    nvfly.syncthreads()
    for r in nvfly.static_range((TILE + THREADS - 1) // THREADS):
        e = r * THREADS + tid
        if TILE % THREADS == 0 or e < TILE:
            total = partial[e]
            for v in nvfly.static_range(1, WARPS):
                total = total + partial[v * TILE + e]
            token = t0 + e // ROWS
            col = n0 + e % ROWS
            if (token < m) & (col < n):
                if PARTIAL:
                    out[split, token, col] = total
                else:
                    if bias is not None:
                        total = total + bias[col].to(nvfly.f32)
                    out[token, col] = total.to(out.dtype)
