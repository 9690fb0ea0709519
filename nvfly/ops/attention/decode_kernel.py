"""Decode attention: softmax(q kᵀ scale + mods) v for a few query tokens over a long KV cache, at the HBM roofline.

    q [B, Sq, Hq, Dqk], k [P, S, Hkv, Dqk], v [P, S, Hkv, Dv] (last dims contiguous, other strides free)
    contiguous cache: P = B, key j of sequence b at [b, j]; paged: P pages of S = PAGE tokens, key j of sequence b
    at [block_table[b, j // PAGE], j % PAGE]; seqlens [B] int32: keys of each sequence.

Grid (splits x query tiles, Hkv, B). A CTA owns ``tile_rows`` (16, 32 or 64) packed query rows of one KV head (row
r: query token r // G, head hkv * G + r % G; rows past Sq * G are padding, computed and never stored) and the stages
[begin, end) of its split (``plan.split_range``). Keys stream through a ``stages``-deep shared-memory ring filled by
16-byte cp.async copies from all threads (one commit group a stage, zero-filled past the sequence's end so that
padding keys are 0, never NaN, and masked); one __syncthreads a stage orders the refill of the stage every warp has
finished with. Rows of K, V and Q are 16-byte segments XOR-swizzled by row % 8, so that ldmatrix reads 8 rows with
no bank conflict.

The 4 warps are row_warps x key_warps (``WarpRole``): a warp owns 16 rows of the tile and the 16-key slices
key_warp, key_warp + key_warps, ... of every stage (with Dv > 128, 8 warps: pairs share rows and slices, each with
half of O's columns; ``warp_tiles`` = 2: a warp owns 32 rows, two m16 tiles sharing each slice's K and V
fragments). Per slice: S (16 rows x 16 keys) = Q Kᵀ by mma.m16n8k16 with Q's A fragments ldmatrix'ed from
the shared query tile and K's B fragments by ldmatrix (K rows are Kᵀ's columns); scores are scaled (the mods see
natural units), modded, masked (past the sequence, causal: key <= the query's position seqlen - Sq + token,
mask_mod) and kept in log2 units for exp2. The online softmax keeps each row's max m and lane-partial sum l
(``lazy_rescale``: O's rescale skipped on a warp vote when no row maximum rose); P in
registers is the A fragment of O += P V (the S accumulators of keys 0-7 and 8-15 are the A registers of one k16
step), V's B fragments come from ldmatrix.trans. After the last stage the warps that share rows merge (m, l, O)
through shared memory (the ring, now free); the result is O / l and LSE = m + log l (natural log), or for a fully
masked row zeros and -inf. With splits, a CTA writes its normalised partial O and LSE in f32 for
``combine_kernel`` (``pdl_combine``: launched as this kernel's programmatic dependent), or with ``fixup_combine``
counts itself in on its (sequence, KV head, query tile)'s counter and, if last, merges the tile's partials
itself (``fixup_tile``).

fp8 (e4m3) K/V: the ring holds the bytes (rows ``fp8_swizzled``, twice the stages) and each warp converts the
fragments it reads in registers, with f16 MMAs: an ldmatrix matrix of 8 K rows x 16 bytes gives a lane the bytes
of dims 4c..4c+3 of its key, whose two packed cvt (e4m3x2 -> f16x2) are its B registers of a k16 step if the k
order of the step is ``fp8_query_dim``'s, which the f16 query tile (times the softmax scale) is stored in; V's
ldmatrix.trans words (keys 2c, 2c+1 of columns 2g, 2g+1) of keys 0-7 and 8-15 are gathered by prmt into the B
registers of the even and odd columns (``FP8_COLUMN_SELECTORS``), so O's tiles hold columns in
``accumulator_column`` order. K's scale is folded into the scores' scale and V's into the final normalisation.
docs/ops/attention.md weighs this against a converted shared tile and fp8 MMAs.

Swapped plans (``DecodePlan.swapped``, Sq·G <= 8): an 8-row query tile, and each warp's slice as Sᵀ = K Qᵀ and
Oᵀ += Vᵀ Pᵀ (keys and O's columns as the MMAs' M, the query rows as N; ``attend_slice_swapped``), the same ring,
masks, mods, merge and outputs.

A flex BlockMask: the CTA reads only the stages its ``stage_list`` names (those of blocks non-empty for a head of
its group), split evenly like a sequence's stages, and each row masks by its own head's block state
(``kv_state``).
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import nvfly
from nvfly.arch import sm80
from nvfly.arch.floats import e4m3x4_to_16bit, permute_bytes
from nvfly.arch.gpu_scope import load_relaxed
from nvfly.arch.memory import store_shared
from nvfly.arch.ptx import smem_address
from nvfly.frontend.control_flow import if_
from nvfly.ops.attention.mods import apply_mask_mod, apply_score_mod
from nvfly.ops.attention.plan import BLOCK_N, ROWS, WARPS, ctas_per_sm, fixup_counter
from nvfly.ops.attention.softmax import LN2, LOG2E, NEG_INF
from nvfly.ops.common.arrival import last_to_arrive

BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2  # a flex BlockMask's KV blocks, per (batch, query head) (api.py)


def swizzled(row: Any, segment: Any, segments: int) -> Any:
    """Byte offset of 16-byte segment ``segment`` of row ``row`` in a tile of rows of ``segments`` segments:
    segments XORed with row % 8 (within their group of 8), so 8 consecutive rows' same segment hit 8 bank groups."""
    return row * (segments * 16) + (segment ^ (row & 7)) * 16


def fp8_swizzled(row: Any, segment: Any, segments: int) -> Any:
    """Byte offset of 16-byte segment ``segment`` of an fp8 row (rows of ``segments`` segments, a multiple of 4),
    so that 8 consecutive rows' same segment hit 8 bank groups: rows of a multiple of 128 bytes as ``swizzled``;
    rows of 64 or 192 bytes (odd rows start half a bank row on) XOR the segment with (row / 2) % 4 in its group of
    4."""
    if segments % 8 == 0:
        return swizzled(row, segment, segments)
    return row * (segments * 16) + (segment ^ ((row >> 1) & 3)) * 16


def fp8_query_dim(index: Any) -> Any:
    """The query dim (within its group of 16) at k index ``index`` of an fp8 plan's k16 step: ldmatrix of an fp8 K
    row gives a lane the 4 bytes of dims 4c..4c+3 (c = lane % 4), whose two f16 pairs are its B registers for k
    2c, 2c + 1 and 2c + 8, 2c + 9; the query tile holds its dims in that order (``stage_query_f16``)."""
    return 4 * (index % 8 // 2) + index % 2 + 2 * (index // 8)


def accumulator_column(lane: Any, tile: int, index: int, fp8: bool) -> Any:
    """O's column (within the warp's columns) of accumulator ``index`` of n8 tile ``tile``: 8 tile + the C layout's
    column; fp8: tile 2s + e holds the columns of segment s (16 columns) of parity e (``attend_slice``)."""
    column = accumulator_coords(lane, index)[1]
    if fp8:
        return 16 * (tile // 2) + 2 * column + tile % 2
    return 8 * tile + column


# ---------------------------------------------------------------------------------------------- fragment maps
# (row, 16-byte segment) of the shared tile whose address lane ``lane`` gives an ldmatrix.x4 (matrix lane // 8); the
# CPU tests emulate ldmatrix and mma.m16n8k16 on these maps
def q_fragment_source(lane: Any, step: Any) -> tuple[Any, Any]:
    """Q's A fragment of k16 step ``step``: matrices (rows +8, k +8) = (bit 0, bit 1) of lane // 8, i.e. A registers
    a0a1, a2a3, a4a5, a6a7."""
    return (lane & 7) + 8 * ((lane >> 3) & 1), 2 * step + (lane >> 4)


def k_fragment_source(lane: Any, step: Any, key_slice: Any) -> tuple[Any, Any]:
    """K rows 16 * key_slice.. as the B fragments of k16 step ``step`` for keys +0..7 (registers 0, 1) and +8..15
    (2, 3): matrices (k +8, keys +8) = (bit 0, bit 1) of lane // 8."""
    return 16 * key_slice + (lane & 7) + 8 * (lane >> 4), 2 * step + ((lane >> 3) & 1)


def v_fragment_source(lane: Any, pair: Any, key_slice: Any) -> tuple[Any, Any]:
    """V rows 16 * key_slice.. (ldmatrix.trans) as the B fragments of columns 16 * pair + 0..7 (registers 0, 1) and
    + 8..15 (2, 3): matrices (keys +8, columns +8) = (bit 0, bit 1) of lane // 8."""
    return 16 * key_slice + (lane & 7) + 8 * ((lane >> 3) & 1), 2 * pair + (lane >> 4)


def query_pair_source(lane: Any, pair: Any) -> tuple[Any, Any]:
    """Swapped plans: the query rows (ldmatrix, not transposed) as Qᵀ's B fragments of k16 steps 2 pair (registers
    0, 1) and 2 pair + 1 (2, 3): matrix lane // 8 is k +8 lane // 8 of the two steps."""
    return lane & 7, 4 * pair + (lane >> 3)


def swapped_column(lane: Any, tile: int, index: int, fp8: bool) -> Any:
    """Swapped plans: O's column of accumulator ``index`` of Oᵀ's m16 tile ``tile`` (the C layout's row; its
    column is the query row): 16 tile + row; fp8: tile 2s + e holds the columns of parity e of segments 2s (rows
    0-7) and 2s + 1 (rows 8-15) (``attend_slice_swapped``)."""
    row = accumulator_coords(lane, index)[0]
    if fp8:
        return 32 * (tile // 2) + 16 * (index // 2) + 2 * (lane >> 2) + tile % 2
    return 16 * tile + row


def accumulator_coords(lane: Any, index: int) -> tuple[Any, Any]:
    """(row, column) of accumulator ``index`` of an m16n8 tile (PTX's C layout)."""
    return (lane >> 2) + 8 * (index // 2), 2 * (lane & 3) + index % 2


# prmt selectors of an fp8 V fragment: bytes 0, 2 (keys 2c, 2c + 1) of the keys 0-7 word and of the keys 8-15 word,
# for the even column; bytes 1, 3 for the odd one
FP8_COLUMN_SELECTORS = (0x6420, 0x7531)

# P's A fragment from the S accumulators [key tile t][index]: registers a0a1, a2a3, a4a5, a6a7
P_FRAGMENT = (((0, 0), (0, 1)), ((0, 2), (0, 3)), ((1, 0), (1, 1)), ((1, 2), (1, 3)))


class RowCoords(NamedTuple):
    """One packed query row as the masks and mods see it, and whether it is a real row."""
    head: Any
    token: Any
    position: Any
    valid: Any


def row_coords(packed: Any, hkv: Any, seqlen: Any, sq: int, group: int) -> RowCoords:
    """Query token packed // G of head hkv * G + packed % G, at position seqlen - Sq + token; padding rows are
    clamped to the last real one (their indices stay in range for the mods' tables)."""
    valid = packed < sq * group
    packed = nvfly.minimum(packed, sq * group - 1)
    token = packed // group
    return RowCoords(hkv * group + packed % group, token, seqlen - sq + token, valid)


class WarpRole(NamedTuple):
    """What a warp computes: 16 rows of the query tile from ``row0``, the key slices key_warp, key_warp + key_warps,
    ... of every stage, and column half ``half`` of O (column_warps = 2)."""
    row0: Any
    key_warp: Any
    half: Any
    lane: Any


def query_copies(tid: Any, hkv: Any, m_tile: Any, seqlen: Any, pieces: int, plan: Any) -> Iterator[tuple]:
    """(row, piece, RowCoords) of each copy the thread makes of the query tile, rows of ``pieces`` pieces; traced
    as the caller iterates (a copy repeated where the threads do not divide the copies)."""
    copies = plan.tile_rows * pieces
    for i in nvfly.static_range(-(-copies // plan.threads)):
        copy = nvfly.minimum(tid + i * plan.threads, copies - 1)
        row = copy // pieces
        yield row, copy % pieces, row_coords(m_tile * plan.tile_rows + row, hkv, seqlen, plan.sq, plan.group)


@nvfly.func
def stage_query(q, q_tile, b, hkv, m_tile, seqlen, tid, PLAN):
    """cp.async the CTA's packed query rows into the swizzled query tile (padding rows zero-filled)."""
    SEGMENTS = PLAN.dqk // 8
    for row, segment, coords in query_copies(tid, hkv, m_tile, seqlen, SEGMENTS, PLAN):
        sm80.cp_async(q_tile + swizzled(row, segment, SEGMENTS), q.address(b, coords.token, coords.head, segment * 8),
                      16, coords.valid)


@nvfly.func
def stage_query_f16(q, q_tile, b, hkv, m_tile, seqlen, scale, tid, PLAN):
    """The fp8 plans' query tile: the packed query rows times ``scale`` (the softmax scale, so that f16's range
    covers |q| up to 65504 / scale) rounded to f16, swizzled like ``stage_query``'s (padding rows zero), each 16
    dims in ``fp8_query_dim`` order: pairs (4c, 4c + 1) to k 2c, 2c + 1 and (4c + 2, 4c + 3) to k 2c + 8, 2c + 9."""
    SEGMENTS = PLAN.dqk // 8
    for row, group, coords in query_copies(tid, hkv, m_tile, seqlen, PLAN.dqk // 16, PLAN):
        words = []  # word w: dims 2w, 2w + 1 of the group
        for part in nvfly.static_range(2):
            values = q.load(b, coords.token, coords.head, group * 16 + part * 8, width=8, mask=coords.valid)
            words += (values.to(nvfly.f32) * scale).to(nvfly.f16).bitcast(nvfly.i32).tolist()
        store_shared(q_tile + swizzled(row, 2 * group, SEGMENTS), words[0::2])
        store_shared(q_tile + swizzled(row, 2 * group + 1, SEGMENTS), words[1::2])


def cache_address(cache: Any, b: Any, hkv: Any, key: Any, column: Any, plan: Any, page: Any) -> Any:
    """Address of ``cache``'s element (key ``key`` of sequence b, KV head hkv, ``column``); paged: in ``page``."""
    if plan.paged:
        return cache.address(page, key % plan.page_size, hkv, column)
    return cache.address(b, key, hkv, column)


def key_page(pages: dict, block_table: Any, b: Any, key: Any, plan: Any, slot: tuple) -> Any:
    """The page of ``key`` (None for a contiguous cache), looked up once per ``slot`` (a copy's row: K's and V's
    copies read the same rows when Dqk == Dv) or once per stage when pages are whole stages (``pages["stage"]``)."""
    if not plan.paged:
        return None
    if "stage" in pages:
        return pages["stage"]
    if slot not in pages:
        pages[slot] = block_table[b, key // plan.page_size]
    return pages[slot]


@nvfly.func
def load_stage(k, v, block_table, stage, b, hkv, block, seqlen, tid, PLAN):
    """cp.async keys block * BLOCK_N .. + BLOCK_N - 1 of K (rows of Dqk) then of V (rows of Dv) into the ring stage
    at shared address ``stage``; keys past ``seqlen`` are zero-filled (nothing read, the address clamped). Rows are
    swizzled 16-byte segments (``swizzled``, fp8 ``fp8_swizzled``)."""
    THREADS = PLAN.threads
    ITEM = 1 if PLAN.fp8 else 2
    pages = {}
    if PLAN.paged and PLAN.page_size % BLOCK_N == 0:  # the stage lies in one page: one lookup
        pages["stage"] = block_table[b, block * BLOCK_N // PLAN.page_size]
    for cache, dim, base in ((k, PLAN.dqk, stage), (v, PLAN.dv, stage + BLOCK_N * PLAN.dqk * ITEM)):
        SEGMENTS = dim * ITEM // 16
        for i in nvfly.static_range(BLOCK_N * SEGMENTS // THREADS):  # dims are multiples of 64: it divides
            copy = tid + i * THREADS
            row = copy // SEGMENTS
            segment = copy % SEGMENTS
            key = block * BLOCK_N + row
            clamped = nvfly.minimum(key, seqlen - 1)
            page = key_page(pages, block_table, b, clamped, PLAN, (SEGMENTS, i))
            target = base + (fp8_swizzled if PLAN.fp8 else swizzled)(row, segment, SEGMENTS)
            sm80.cp_async(target, cache_address(cache, b, hkv, clamped, segment * 16 // ITEM, PLAN, page), 16,
                          key < seqlen)


class Softmax(NamedTuple):
    """A warp's running state for its lane's rows g and g + 8: row maxima (log2 units), lane-partial row sums, and
    the O accumulators [Dv / 8 column tiles][4] (mma's C layout)."""
    maxima: list
    sums: list
    acc: list


def pack(a: Any, b: Any, dtype: Any) -> Any:
    """Two f32 as one 32-bit word of two 16-bit ``dtype`` values (low half first)."""
    return nvfly.make_vector([a, b], nvfly.f32).to(dtype).bitcast(nvfly.i32).tolist()[0]


class StageContext(NamedTuple):
    """What every stage's scores need: the sequence, the lane's two rows of each of the warp's row tiles, the
    scales and the mods."""
    b: Any
    seqlen: Any
    rows: tuple
    scale: Any
    scale_log2: Any
    captured: tuple
    plan: Any
    mods: Any
    dtype: Any
    kv_state: Any


def query_fragment(query: Any, role: WarpRole, step: int, segments: int, tile: int = 0) -> list:
    """Q's A fragment of k16 step ``step`` for the warp's 16 rows of tile ``tile`` (``DecodePlan.warp_tiles``):
    from ``query``, the query tile's shared address, or the list of them the warp holds in registers
    (``DecodePlan.query_in_registers``)."""
    if isinstance(query, list):
        return query[step]
    q_row, q_segment = q_fragment_source(role.lane, step)
    return sm80.ldmatrix_x4(query + swizzled(role.row0 + ROWS * tile + q_row, q_segment, segments))


def stage_scores(ctx: StageContext, stage: Any, query: Any, role: WarpRole, key_slice: Any, key0: Any,
                 dtype: Any) -> list:
    """The warp's rows x 16 keys (slice ``key_slice`` of the stage, from key ``key0``) in log2 units, masked to
    -inf: [row tile][key tile t][4] in mma's C layout (row 16 * tile + g + 8 * (i // 2), key key0 + 8t + 2 *
    (lane % 4) + i % 2). K's fragments are read (and converted) once for all the warp's row tiles."""
    plan = ctx.plan
    lane = role.lane
    segments = plan.dqk // 8
    tiles = range(plan.warp_tiles)
    s = [[[nvfly.f32(0.0)] * 4 for _ in range(2)] for _ in tiles]
    if plan.fp8:  # an ldmatrix matrix of 8 fp8 K rows x 16 bytes: a lane's word is its B registers of a k16 step
        for pair in nvfly.static_range(plan.dqk // 32):  # (keys +8, dims +16) = bits 0, 1 of the matrix
            kb = sm80.ldmatrix_x4(stage + fp8_swizzled(*v_fragment_source(lane, pair, key_slice), plan.dqk // 16))
            for half in range(2):
                b0 = e4m3x4_to_16bit(kb[2 * half], dtype)
                b1 = e4m3x4_to_16bit(kb[2 * half + 1], dtype)
                for tile in tiles:
                    a = query_fragment(query, role, 2 * pair + half, segments, tile)
                    s[tile][0] = sm80.mma_m16n8k16(a, b0, s[tile][0], dtype)
                    s[tile][1] = sm80.mma_m16n8k16(a, b1, s[tile][1], dtype)
    else:
        for step in nvfly.static_range(plan.dqk // 16):
            a = [query_fragment(query, role, step, segments, tile) for tile in tiles]
            kb = sm80.ldmatrix_x4(stage + swizzled(*k_fragment_source(lane, step, key_slice), segments))
            for tile in tiles:
                s[tile][0] = sm80.mma_m16n8k16(a[tile], kb[0:2], s[tile][0], dtype)
                s[tile][1] = sm80.mma_m16n8k16(a[tile], kb[2:4], s[tile][1], dtype)
    return [tile_scores(ctx, s[tile], ctx.rows[tile], lane, key0) for tile in tiles]


def tile_scores(ctx: StageContext, s: list, rows: tuple, lane: Any, key0: Any) -> list:
    """One row tile's raw scores ``s`` [key tile][4] scaled to log2 units, modded and masked for its lane's rows
    ``rows`` (g, g + 8)."""
    elements = [(s[t][i], i // 2, lambda t=t, i=i: key0 + 8 * t + accumulator_coords(lane, i)[1])
                for t in range(2) for i in range(4)]
    flat = masked_scores(ctx, elements, rows, key0)
    return [flat[0:4], flat[4:8]]


def masked_scores(ctx: StageContext, elements: list, rows: tuple, key0: Any) -> list:
    """Raw scores scaled to log2 units, modded and masked: ``elements`` (score, index of its row in ``rows``, a
    function tracing its key: traced in place, as each element's masks) of the keys of the stage slice from
    ``key0``."""
    plan = ctx.plan
    mods = ctx.mods
    plain = mods.score_mod is None and mods.mask_mod is None
    states = [None] * len(rows)
    if plan.kv_block:  # the block mask's state of this stage's block for each of the lane's rows (their heads)
        states = [ctx.kv_state[ctx.b, row.head, key0 // plan.kv_block] for row in rows]
    out = []
    for value, index, key_of in elements:
        row = rows[index]
        state = states[index]
        key = key_of()
        if not plain:
            # the mods see indices within the sequence (their tables cover it); elements outside are masked
            mod_key = nvfly.maximum(nvfly.minimum(key, ctx.seqlen - 1), 0)
            mod_position = nvfly.maximum(row.position, 0)
        if mods.score_mod is None:
            score = value * ctx.scale_log2
        else:
            score = apply_score_mod(mods, ctx.captured, value, ctx.b, row.head, mod_position, mod_key,
                                    scale=ctx.scale) * LOG2E
        keep = key < ctx.seqlen
        if plan.causal:
            keep = keep & (key <= row.position)
        kept = None if plain else apply_mask_mod(mods, ctx.captured, ctx.b, row.head, mod_position, mod_key)
        if state is not None:  # an empty block keeps no key, a full one every key, a partial one asks the mask
            kept = (state != BLOCK_EMPTY if kept is None
                    else (state == BLOCK_FULL) | ((state == BLOCK_PARTIAL) & kept))
        if kept is not None:
            keep = keep & kept
        out.append(nvfly.select(keep, score, NEG_INF))
    return out


def attend_slice(states: list, ctx: StageContext, stage: Any, query: Any, role: WarpRole, key_slice: Any,
                 key0: Any, dtype: Any) -> list:
    """Fold the 16 keys of slice ``key_slice`` of one ring stage (from key ``key0``) into the warp's online softmax
    and its O columns: ``states``, a Softmax per row tile; V's fragments are read (and converted) once for all."""
    plan = ctx.plan
    if plan.swapped:
        return attend_slice_swapped(states, ctx, stage, query, role, key_slice, key0, dtype)
    lane = role.lane
    scores = stage_scores(ctx, stage, query, role, key_slice, key0, dtype)
    folded = [softmax_step(state, s, dtype, plan.lazy_rescale) for state, s in zip(states, scores)]
    a = [fragment for fragment, _ in folded]
    acc = [tile_acc for _, (_, _, tile_acc) in folded]
    tiles = range(plan.warp_tiles)
    if plan.fp8:
        # ldmatrix.trans of 8 fp8 V rows x 16 bytes: a lane's word holds keys 2c, 2c + 1 of columns 2g, 2g + 1;
        # with the word of keys +8, prmt gathers each column's 4 keys: the B registers of the even and odd columns
        v_tile = stage + BLOCK_N * plan.dqk
        QUADS = plan.dv // 32 // plan.column_warps
        for quad in nvfly.static_range(QUADS):  # (keys +8, columns +16) = bits 0, 1 of the matrix
            source = v_fragment_source(lane, quad + role.half * QUADS, key_slice)
            vb = sm80.ldmatrix_x4(v_tile + fp8_swizzled(*source, plan.dv // 16), transpose=True)
            for half in range(2):
                for parity, selector in enumerate(FP8_COLUMN_SELECTORS):
                    b = e4m3x4_to_16bit(permute_bytes(vb[2 * half], vb[2 * half + 1], selector), dtype)
                    column_tile = 4 * quad + 2 * half + parity
                    for tile in tiles:
                        acc[tile][column_tile] = sm80.mma_m16n8k16(a[tile], b, acc[tile][column_tile], dtype)
    else:
        segments = plan.dv // 8
        v_tile = stage + BLOCK_N * plan.dqk * 2
        PAIRS = plan.dv // 16 // plan.column_warps
        for pair in nvfly.static_range(PAIRS):
            source = v_fragment_source(lane, pair + role.half * PAIRS, key_slice)
            vb = sm80.ldmatrix_x4(v_tile + swizzled(*source, segments), transpose=True)
            for tile in tiles:
                acc[tile][2 * pair] = sm80.mma_m16n8k16(a[tile], vb[0:2], acc[tile][2 * pair], dtype)
                acc[tile][2 * pair + 1] = sm80.mma_m16n8k16(a[tile], vb[2:4], acc[tile][2 * pair + 1], dtype)
    return [Softmax(maxima, sums, tile_acc) for (_, (maxima, sums, _)), tile_acc in zip(folded, acc)]


def softmax_step(state: Softmax, s: list, dtype: Any, lazy: bool) -> tuple[list, tuple]:
    """One row tile's online softmax over its scores ``s`` [key tile][4]: (P's A fragment, (new maxima, new sums,
    O rescaled to the new maxima)); ``lazy`` (``DecodePlan.lazy_rescale``): O's multiplies only when some row of
    the warp has a factor other than 1 (a warp-uniform branch; exact, as the multiplies it skips are by 1)."""
    maxima, sums, scales, p = [], [], [], [[None] * 4 for _ in range(2)]
    for r in range(2):
        row = [s[t][2 * r + j] for t in range(2) for j in range(2)]
        top = nvfly.maximum(nvfly.maximum(row[0], row[1]), nvfly.maximum(row[2], row[3]))
        new_max, total, scale, exps = fold_row(state, r, top, (1, 2), row)  # the 4 lanes of a row
        for t in range(2):
            for j in range(2):
                p[t][2 * r + j] = exps[2 * t + j]
        maxima.append(new_max)
        sums.append(total)
        scales.append(scale)
    a = [pack(p[lo[0]][lo[1]], p[hi[0]][hi[1]], dtype) for lo, hi in P_FRAGMENT]
    return a, (maxima, sums, rescaled(state.acc, scales, lambda i: i // 2, lazy))


def fold_row(state: Softmax, r: int, top: Any, lanes: tuple, scores: list) -> tuple:
    """The online-softmax update of the lane's row ``r`` of ``state`` by its new ``scores`` (log2 units), ``top``
    their maximum in this lane, reduced over the lanes of the row (shfl_xor by each of ``lanes``): (new maximum,
    new lane-partial sum, O's factor, exp2 of each score less the new maximum)."""
    for mask in lanes:
        top = nvfly.maximum(top, nvfly.shfl_xor(top, mask))
    new_max = nvfly.maximum(state.maxima[r], top)
    reference = nvfly.select(new_max == NEG_INF, 0.0, new_max)  # nothing kept yet: no -inf - -inf
    scale = nvfly.exp2(state.maxima[r] - reference)
    total = state.sums[r] * scale
    exps = []
    for score in scores:
        exps.append(nvfly.exp2(score - reference))
        total = total + exps[-1]
    return new_max, total, scale, exps


def rescaled(acc: list, scales: list, row_of: Any, lazy: bool) -> list:
    """O's accumulators [tile][4] times their rows' factors (``scales`` [row ``row_of(index)``]); ``lazy``: only
    when some factor of the warp is not 1 (a warp-uniform branch)."""
    def rescale(acc: list) -> tuple:
        return ([[o * scales[row_of(i)] for i, o in enumerate(tile)] for tile in acc],)
    if lazy:
        (acc,) = if_(nvfly.vote_any((scales[0] != 1.0) | (scales[1] != 1.0)), rescale, None, ["acc"], [acc])
    else:
        (acc,) = rescale(acc)
    return acc


def attend_slice_swapped(states: list, ctx: StageContext, stage: Any, query: Any, role: WarpRole, key_slice: Any,
                         key0: Any, dtype: Any) -> list:
    """``attend_slice`` of a swapped plan (``DecodePlan.swapped``): Sᵀ (16 keys x 8 query rows) = K Qᵀ with K's A
    fragments ldmatrix'ed from its rows (fp8: converted, their k order ``fp8_query_dim``'s) and Qᵀ's B fragments
    from the query rows; a lane holds keys g, g + 8 of rows 2c, 2c + 1, whose maxima and sums reduce over the 8
    lanes of a c; Pᵀ's B fragment is the 8 x 8 transpose (movmatrix) of each key half of P's C registers; Oᵀ (Dv x
    8 rows) += Vᵀ Pᵀ with Vᵀ's A fragments by ldmatrix.trans of V's rows (fp8: prmt-gathered columns,
    ``swapped_column``)."""
    plan = ctx.plan
    lane = role.lane
    (state,) = states
    chains = [[nvfly.f32(0.0)] * 4 for _ in range(2)]  # even and odd k16 steps: two dependent HMMA chains, not one
    for pair in nvfly.static_range(plan.dqk // 32):
        qb = query_pair(query, lane, pair, plan.dqk // 8)
        if plan.fp8:  # (keys +8, dims +16) = bits 0, 1 of the matrix; a lane's word: dims 4c..4c+3 of its key
            kb = sm80.ldmatrix_x4(stage + fp8_swizzled(*v_fragment_source(lane, pair, key_slice), plan.dqk // 16))
        for half in range(2):
            if plan.fp8:
                low, high = e4m3x4_to_16bit(kb[2 * half], dtype), e4m3x4_to_16bit(kb[2 * half + 1], dtype)
                a = [low[0], high[0], low[1], high[1]]
            else:
                source = q_fragment_source(lane, 2 * pair + half)
                a = sm80.ldmatrix_x4(stage + swizzled(16 * key_slice + source[0], source[1], plan.dqk // 8))
            chains[half] = sm80.mma_m16n8k16(a, qb[2 * half:2 * half + 2], chains[half], dtype)
    s = [even + odd for even, odd in zip(*chains)]
    g = lane >> 2
    s = masked_scores(ctx, [(s[i], i % 2, lambda i=i: key0 + g + 8 * (i // 2)) for i in range(4)], ctx.rows[0], key0)
    maxima, sums, scales, p = [], [], [], [None] * 4
    for r in range(2):  # keys g and g + 8 here, the slice's others in the lanes of the same c
        new_max, total, scale, exps = fold_row(state, r, nvfly.maximum(s[r], s[2 + r]), (4, 8, 16), s[r::2])
        p[r], p[2 + r] = exps
        maxima.append(new_max)
        sums.append(total)
        scales.append(scale)
    b = [sm80.movmatrix_trans(pack(p[0], p[1], dtype)), sm80.movmatrix_trans(pack(p[2], p[3], dtype))]
    acc = rescaled(state.acc, scales, lambda i: i % 2, plan.lazy_rescale)
    if plan.fp8:
        v_tile = stage + BLOCK_N * plan.dqk
        for quad in nvfly.static_range(plan.dv // 32):  # (keys +8, columns +16) = bits 0, 1 of the matrix
            vb = sm80.ldmatrix_x4(v_tile + fp8_swizzled(*v_fragment_source(lane, quad, key_slice), plan.dv // 16),
                                  transpose=True)
            for parity, selector in enumerate(FP8_COLUMN_SELECTORS):
                low = e4m3x4_to_16bit(permute_bytes(vb[0], vb[1], selector), dtype)  # column 32 quad + 2g + parity
                high = e4m3x4_to_16bit(permute_bytes(vb[2], vb[3], selector), dtype)  # and 16 on
                tile = 2 * quad + parity
                acc[tile] = sm80.mma_m16n8k16([low[0], high[0], low[1], high[1]], b, acc[tile], dtype)
    else:
        v_tile = stage + BLOCK_N * plan.dqk * 2
        for tile in nvfly.static_range(plan.dv // 16):  # (columns +8, keys +8) = bits 0, 1 of the matrix
            va = sm80.ldmatrix_x4(v_tile + swizzled(*k_fragment_source(lane, tile, key_slice), plan.dv // 8),
                                  transpose=True)
            acc[tile] = sm80.mma_m16n8k16(va, b, acc[tile], dtype)
    return [Softmax(maxima, sums, acc)]


def query_pair(query: Any, lane: Any, pair: Any, segments: int) -> list:
    """A swapped plan's Qᵀ B fragments of k16 steps 2 pair and 2 pair + 1 (``query_pair_source``): from ``query``,
    the query tile's shared address, or the list of them the warp holds in registers."""
    if isinstance(query, list):
        return query[pair]
    return sm80.ldmatrix_x4(query + swizzled(*query_pair_source(lane, pair), segments))


def stage_index(stage_list: Any, b: Any, hkv: Any, index: Any, plan: Any) -> Any:
    """The ``index``-th stage the CTA's sequence reads: every stage, or with a block mask the ``index``-th of the
    stages in its non-empty blocks (``stage_list``, ascending)."""
    return stage_list[b, hkv, index] if plan.kv_block else index


@nvfly.func
def stream_keys(k, v, block_table, stage_list, ring, q_tile, ctx, hkv, begin, count, tid, role, PLAN):
    """The CTA's ``count`` stages from the ``begin``-th (``stage_index``) through the ring; returns the warp's
    Softmax per row tile (``role``, ``DecodePlan.warp_tiles``)."""
    STAGE = PLAN.stage_bytes
    dtype = ctx.dtype
    for i in nvfly.static_range(PLAN.stages - 1):
        if i < count:
            load_stage(k, v, block_table, ring + i * STAGE, ctx.b, hkv,
                       stage_index(stage_list, ctx.b, hkv, begin + i, PLAN), ctx.seqlen, tid, PLAN)
        sm80.cp_async_commit()  # the first group also holds the query tile
    query = q_tile
    if PLAN.query_in_registers:  # the tile's stores are visible after a barrier (while the first stages land)
        if not PLAN.fp8:  # a 16-bit tile is cp.async'ed: its group (the first stage's) landed first
            sm80.cp_async_wait(PLAN.stages - 2)
        nvfly.syncthreads()
        if PLAN.swapped:
            query = [query_pair(q_tile, role.lane, pair, PLAN.dqk // 8) for pair in nvfly.static_range(PLAN.dqk // 32)]
        else:
            query = [query_fragment(q_tile, role, step, PLAN.dqk // 8) for step in nvfly.static_range(PLAN.dqk // 16)]
    tiles = PLAN.dv // 16 if PLAN.swapped else PLAN.dv // 8 // PLAN.column_warps  # Oᵀ's m16 tiles, or O's n8 tiles
    state = [Softmax([nvfly.f32(NEG_INF)] * 2, [nvfly.f32(0.0)] * 2,
                     [[nvfly.f32(0.0)] * 4 for _ in nvfly.static_range(tiles)])
             for _ in nvfly.static_range(PLAN.warp_tiles)]
    for i in range(count):
        sm80.cp_async_wait(PLAN.stages - 2)
        nvfly.syncthreads()  # stage i landed for every thread; every warp is done with stage i - 1
        ahead = i + PLAN.stages - 1
        if ahead < count:
            load_stage(k, v, block_table, ring + (ahead % PLAN.stages) * STAGE, ctx.b, hkv,
                       stage_index(stage_list, ctx.b, hkv, begin + ahead, PLAN), ctx.seqlen, tid, PLAN)
        sm80.cp_async_commit()
        stage = ring + (i % PLAN.stages) * STAGE
        first = stage_index(stage_list, ctx.b, hkv, begin + i, PLAN) * BLOCK_N
        if PLAN.row_warps == 1:  # one slice a warp
            state = attend_slice(state, ctx, stage, query, role, role.key_warp, first + 16 * role.key_warp, dtype)
        else:  # the warp's slices as a loop: unrolled, ptxas interleaves them and spills at d > 128
            for j in range(PLAN.row_warps):
                key_slice = role.key_warp + j * PLAN.key_warps
                state = attend_slice(state, ctx, stage, query, role, key_slice, first + 16 * key_slice, dtype)
    sm80.cp_async_wait(0)
    nvfly.syncthreads()  # the ring is free for the merge
    return state


def merge_layout(plan: Any, lane: Any) -> tuple:
    """How a warp's state maps to the merge's rows, as functions traced where they are used: (the shfl_xor masks
    over the lanes that share a row's sum, whether the lane writes its rows' statistics, the tile row of its row r
    from the warp's ``base``, O's tiles, (tile row, column) of accumulator i of tile j). Swapped: rows 2c, 2c + 1
    summed over the 8 lanes of a c, Oᵀ's m16 tiles; else rows g, g + 8 summed over the 4 lanes of a row, O's n8
    tiles."""
    if plan.swapped:
        return ((4, 8, 16), lambda: (lane >> 2) == 0, lambda base, r: base + 2 * (lane & 3) + r, plan.dv // 16,
                lambda j, i: (accumulator_coords(lane, i)[1], swapped_column(lane, j, i, plan.fp8)))
    return ((1, 2), lambda: (lane & 3) == 0, lambda base, r: base + (lane >> 2) + 8 * r,
            plan.dv // plan.column_warps // 8,
            lambda j, i: (accumulator_coords(lane, i)[0], accumulator_column(lane, j, i, plan.fp8)))


@nvfly.func
def merge_warps(states, stats, partial, role, PLAN):
    """Each warp's row maxima and sums (quad-reduced) into ``stats`` [maxima | sums][key warp][tile row] and its O
    into ``partial`` [key warp][tile row][Dv] (its column half with column_warps = 2), a Softmax per row tile of
    the warp's, then a barrier."""
    lane = role.lane
    DV = PLAN.dv
    TILE_ROWS = PLAN.tile_rows
    COLUMNS = DV // PLAN.column_warps
    lanes, writer, stat_row, tiles, coords = merge_layout(PLAN, lane)
    for tile in nvfly.static_range(PLAN.warp_tiles):
        state = states[tile]
        sums = []
        for r in nvfly.static_range(2):
            total = state.sums[r]
            for mask in lanes:
                total = total + nvfly.shfl_xor(total, mask)
            sums.append(total)
        base = role.key_warp * TILE_ROWS + role.row0 + ROWS * tile
        if writer() & (role.half == 0):  # both column halves hold the same statistics
            for r in nvfly.static_range(2):
                stats[stat_row(base, r)] = state.maxima[r]
                stats[stat_row(PLAN.stat_rows + base, r)] = sums[r]
        for j in nvfly.static_range(tiles):
            for i in nvfly.static_range(4):
                row, column = coords(j, i)
                partial[(base + row) * DV + role.half * COLUMNS + column] = state.acc[j][i]
    nvfly.syncthreads()


@nvfly.kernel
def attention_decode_kernel(q: nvfly.Tensor, k: nvfly.Tensor, v: nvfly.Tensor, block_table, seqlens: nvfly.Tensor,
                            out, lse, partial_o, partial_lse, captured0, captured1, kv_scales, kv_state, stage_list,
                            stage_count, counters, scale: nvfly.f32, PLAN: nvfly.Constexpr, MODS: nvfly.Constexpr):
    """One (split x query tile, KV head, batch) CTA of ``WARPS`` warps (module docstring). Without splits it writes
    out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] (f32, natural log; None: not wanted); with splits partial_o
    [splits * B * Sq * Hq, Dv] and partial_lse [splits * B * Sq * Hq] (f32; row ((split * B + b) * Sq + token) * Hq
    + head). captured0/1: the mods' captured tensors (``mods.captured_tensors``) or None. fp8 K/V: kv_scales
    [2, Hkv] f32 (K's, V's dequantisation scale per KV head), else None. A block mask: kv_state [B, Hq, KV blocks]
    i32 (BLOCK_EMPTY/PARTIAL/FULL), stage_list [B, Hkv, stages] i32 (the stages of the blocks non-empty for a
    head of the group and within the sequence, ascending, then the rest) and stage_count [B, Hkv] i32 (how many),
    else None. counters: ``fixup_combine``'s zeroed i32 arrival counters (``DecodePlan.fixup_counters``), else None."""
    nvfly.min_blocks_per_sm(ctas_per_sm(PLAN))
    if PLAN.pdl_combine:
        # the combine's CTAs launch once every CTA of this grid has run this (all resident: they take no slot a split
        # CTA waits for) and wait for the grid's end before reading, so the trigger can come first: the combine's
        # launch latency hides behind the whole split loop
        nvfly.launch_dependents()
    SQ, G, DV, SPLITS, M_TILES = PLAN.sq, PLAN.group, PLAN.dv, PLAN.splits, PLAN.m_tiles
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx() % WARPS
    lane = nvfly.lane_idx()
    role = WarpRole(ROWS * PLAN.warp_tiles * (warp // PLAN.key_warps), warp % PLAN.key_warps,
                    nvfly.warp_idx() // WARPS, lane)
    TILE_ROWS = PLAN.tile_rows
    b = nvfly.block_idx.z
    hkv = nvfly.block_idx.y
    split = nvfly.block_idx.x // M_TILES
    m_tile = nvfly.block_idx.x % M_TILES
    seqlen = seqlens[b]
    RING = PLAN.ring_bytes
    ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (PLAN.smem_bytes,)))
    q_tile = ring + RING
    stats = nvfly.dynamic_shared_tensor(nvfly.f32, (2 * PLAN.stat_rows,), offset_bytes=RING + PLAN.q_bytes)
    k_scale = v_scale = 1.0
    score_scale = scale
    dtype = q.dtype
    # fp8: K's scale goes into the scores' scale, V's into the output's normalisation; the MMAs are f16 (e4m3 -> f16
    # is one cvt a pair) and the f16 query tile is already times the softmax scale
    if PLAN.fp8:
        k_scale = kv_scales[0, hkv]
        v_scale = kv_scales[1, hkv]
        score_scale = 1.0
        dtype = nvfly.f16
    partial = nvfly.dynamic_shared_tensor(nvfly.f32, (PLAN.stat_rows * DV,))  # over the ring, after the loop

    if PLAN.kv_block:
        n_blocks = stage_count[b, hkv]
    else:
        n_blocks = (seqlen + BLOCK_N - 1) // BLOCK_N
    per_split = (n_blocks + SPLITS - 1) // SPLITS
    begin = split * per_split
    count = nvfly.maximum(nvfly.minimum(per_split, n_blocks - begin), 0)

    if PLAN.fp8:
        stage_query_f16(q, q_tile, b, hkv, m_tile, seqlen, scale, tid, PLAN)
    else:
        stage_query(q, q_tile, b, hkv, m_tile, seqlen, tid, PLAN)
    if PLAN.swapped:  # a lane's scores: Sᵀ's columns 2c, 2c + 1
        first = m_tile * TILE_ROWS + 2 * (lane & 3)
        rows = ((row_coords(first, hkv, seqlen, SQ, G), row_coords(first + 1, hkv, seqlen, SQ, G)),)
    else:
        first = m_tile * TILE_ROWS + role.row0 + (lane >> 2)
        rows = tuple((row_coords(first + ROWS * tile, hkv, seqlen, SQ, G),
                      row_coords(first + ROWS * tile + 8, hkv, seqlen, SQ, G))
                     for tile in nvfly.static_range(PLAN.warp_tiles))
    ctx = StageContext(b, seqlen, rows, score_scale * k_scale, score_scale * k_scale * LOG2E, (captured0, captured1),
                       PLAN, MODS, dtype, kv_state)
    state = stream_keys(k, v, block_table, stage_list, ring, q_tile, ctx, hkv, begin, count, tid, role, PLAN)
    merge_warps(state, stats, partial, role, PLAN)

    # thread t: tile row t // PARTS, columns (t % PARTS) * DV / PARTS ..: the key warps' (m, l, O) merged
    KEY_WARPS = PLAN.key_warps
    PARTS = PLAN.threads // TILE_ROWS
    row = tid // PARTS
    part = tid % PARTS
    maxima = [stats[w * TILE_ROWS + row] for w in nvfly.static_range(KEY_WARPS)]
    top = maxima[0]
    for w in nvfly.static_range(1, KEY_WARPS):
        top = nvfly.maximum(top, maxima[w])
    reference = nvfly.select(top == NEG_INF, 0.0, top)
    weights = [nvfly.exp2(m - reference) for m in maxima]
    total = stats[PLAN.stat_rows + row] * weights[0]
    for w in nvfly.static_range(1, KEY_WARPS):
        total = total + stats[PLAN.stat_rows + w * TILE_ROWS + row] * weights[w]
    kept = total > 0.0
    inverse = nvfly.select(kept, v_scale / nvfly.maximum(total, 1e-30), 0.0)
    row_lse = nvfly.select(kept, (reference + nvfly.log2(nvfly.maximum(total, 1e-30))) * LN2, NEG_INF)
    coords = row_coords(m_tile * TILE_ROWS + row, hkv, seqlen, SQ, G)
    COLUMNS = DV // PARTS
    for c in nvfly.static_range(COLUMNS // 4):
        column = part * COLUMNS + 4 * c
        merged = partial.load(row * DV + column, width=4) * weights[0]
        for w in nvfly.static_range(1, KEY_WARPS):
            merged = merged + partial.load((w * TILE_ROWS + row) * DV + column, width=4) * weights[w]
        merged = merged * inverse
        if SPLITS == 1:
            out.store(merged.to(out.dtype), b, coords.token, coords.head, column, mask=coords.valid)
        else:
            slot = ((split * q.shape[0] + b) * SQ + coords.token) * q.shape[2] + coords.head
            partial_o.store(merged, slot, column, mask=coords.valid)
    if coords.valid & (part == 0):
        if SPLITS == 1:
            if lse is not None:
                lse[b, coords.head, coords.token] = row_lse
        else:
            partial_lse[((split * q.shape[0] + b) * SQ + coords.token) * q.shape[2] + coords.head] = row_lse
    if PLAN.fixup_combine:
        arrived = nvfly.dynamic_shared_tensor(nvfly.i32, (1,), offset_bytes=RING)  # over the query tile, now free
        index = fixup_counter(b, hkv, m_tile, q.shape[2] // G, M_TILES)
        if last_to_arrive(counters, index, arrived, SPLITS):
            fixup_tile(partial_o, partial_lse, out, lse, b, hkv, m_tile, seqlen, tid, PLAN)
            if tid == 0:
                counters[index] = 0  # every split has counted in: zero for the next call


@nvfly.func
def fixup_tile(partial_o, partial_lse, out, lse, b, hkv, m_tile, seqlen, tid, PLAN):
    """``fixup_combine``'s merge of the query tile's SPLITS partials (every split's now visible; read at GPU scope,
    past any L1 line) into out and lse, as ``combine_kernel`` merges a row's: a warp a row computes the splits'
    weights e^(LSE_s - max) (a lane 1-4 splits) into shared memory (over the ring, free after the warps' merge)
    with the row's 1 / Σ weights, and writes its LSE; then each thread sums 4-column vectors of the tile's rows over
    the splits, 16 vectors' loads a thread at a time. A row every split found empty gets zeros and -inf."""
    SQ, G, DV, SPLITS, TILE_ROWS = PLAN.sq, PLAN.group, PLAN.dv, PLAN.splits, PLAN.tile_rows
    WARPS_ALL = PLAN.threads // 32
    LANE_SPLITS = -(-SPLITS // 32)
    weights = nvfly.dynamic_shared_tensor(nvfly.f32, (TILE_ROWS * (SPLITS + 1),))  # [row][split], then 1 / total
    lane = nvfly.lane_idx()
    warp = nvfly.warp_idx()
    rows = partial_lse.shape[0] // SPLITS  # B * Sq * Hq: one split's rows
    heads = out.shape[2]
    for i in nvfly.static_range(TILE_ROWS // WARPS_ALL):
        row = warp + i * WARPS_ALL
        coords = row_coords(m_tile * TILE_ROWS + row, hkv, seqlen, SQ, G)
        slot = (b * SQ + coords.token) * heads + coords.head
        lses = []
        for j in nvfly.static_range(LANE_SPLITS):
            split = nvfly.minimum(lane + 32 * j, SPLITS - 1)
            lse_s = load_relaxed(partial_lse.address(split * rows + slot), nvfly.f32)
            lses.append(nvfly.select(lane + 32 * j < SPLITS, lse_s, NEG_INF))
        top = lses[0]
        for j in nvfly.static_range(1, LANE_SPLITS):
            top = nvfly.maximum(top, lses[j])
        top = nvfly.warp_reduce(top, "max")
        reference = nvfly.select(top == NEG_INF, 0.0, top)
        total = nvfly.f32(0.0)
        for j in nvfly.static_range(LANE_SPLITS):
            weight = nvfly.exp2((lses[j] - reference) * LOG2E)
            total = total + weight
            if lane + 32 * j < SPLITS:
                weights[row * SPLITS + lane + 32 * j] = weight
        total = nvfly.warp_reduce(total, "add")
        kept = total > 0.0
        if lane == 0:
            weights[TILE_ROWS * SPLITS + row] = nvfly.select(kept, 1.0 / nvfly.maximum(total, 1e-30), 0.0)
            if lse is not None:
                if coords.valid:
                    lse[b, coords.head, coords.token] = nvfly.select(
                        kept, reference + nvfly.log(nvfly.maximum(total, 1e-30)), NEG_INF)
    nvfly.syncthreads()
    VECTORS = DV // 4
    ITEMS = TILE_ROWS * VECTORS // PLAN.threads  # whole: tiles of 8k rows, Dv of 64k, 128 threads (256 from 16 rows)
    UNROLL = max(1, 16 // ITEMS)  # splits a step: 16 loads a thread in flight (the combine kernel's 8, of 2 items)
    items = []
    for i in nvfly.static_range(ITEMS):
        item = tid + i * PLAN.threads
        row = item // VECTORS
        coords = row_coords(m_tile * TILE_ROWS + row, hkv, seqlen, SQ, G)
        items.append((row, (b * SQ + coords.token) * heads + coords.head, item % VECTORS * 4, coords))
    accs = [nvfly.full(4, 0.0, nvfly.f32) for _ in nvfly.static_range(ITEMS)]
    WHOLE = SPLITS // UNROLL * UNROLL
    for first in range(0, WHOLE, UNROLL):
        accs = fixup_add(accs, partial_o, weights, items, first, UNROLL, rows, SPLITS)
    for first in nvfly.static_range(WHOLE, SPLITS):
        accs = fixup_add(accs, partial_o, weights, items, first, 1, rows, SPLITS)
    for (row, slot, column, coords), acc in zip(items, accs):
        merged = acc * weights[TILE_ROWS * SPLITS + row]
        out.store(merged.to(out.dtype), b, coords.token, coords.head, column, mask=coords.valid)


def fixup_add(accs: list, partial_o: Any, weights: Any, items: list, first: Any, count: int, rows: Any,
              splits: int) -> list:
    """``accs`` (a 4-column vector an item) with splits first .. first + count - 1 added, their loads issued first
    (GPU-scope relaxed 16-byte loads)."""
    parts = [[load_relaxed(partial_o.address((first + u) * rows + slot, column), nvfly.f32, 4) for u in range(count)]
             for _, slot, column, _ in items]
    out = []
    for (row, _, _, _), acc, loaded in zip(items, accs, parts):
        for u in range(count):
            acc = acc + nvfly.make_vector(loaded[u], nvfly.f32) * weights[row * splits + first + u]
        out.append(acc)
    return out
