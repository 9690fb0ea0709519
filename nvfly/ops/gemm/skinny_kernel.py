"""Skinny GEMM for decode shapes (M <= 16): a memory-bound stream of the weight through mma.sync.

    out = act(alpha * A @ B + beta * C)       A: [(B,) M, K] (M <= 16), B: [(B,) K, N] column-major

With M this small the weight B dominates the traffic (N x K elements read once), so the kernel is built to
stream it at the memory roofline rather than to fill tensor cores. It computes the transposed product
out^T = W @ A^T with W = B^T ([N, K], K contiguous: the ``F.linear`` weight): W's rows are the A operand of
``mma.m16n8k16`` (16 output columns per warp), A's rows its B operand (8 tokens per mma, two mmas for M > 8).

K permutation. The k order inside a reduction is free, so each lane loads 16 bytes (8 consecutive k) of W
row g and of row g + 8 (g = lane / 4) at k offset 8 * (lane % 4) of a 32-wide k chunk and uses them as the
fragment values of two k16 mma steps; A's rows are loaded with the same mapping (``A_REGISTER_WORDS``,
``B_REGISTER_WORDS``). A warp's load instruction thus covers 16 rows x 64 contiguous bytes with no shared
memory and no shuffles. Rows past M or N are clamped (their results are never stored); only the last k chunk
(K % 32) is predicated and masked element by element, since garbage there would meet real data.

Parallelism. A CTA owns one group of 16 output columns (N rows of W); its warps split the CTA's K range in
groups of ``unroll`` chunks (``unroll`` KB of W in flight per warp) and reduce through shared memory. When
that gives too few CTAs for the memory system, ``splits`` CTAs share a group, each with its own K range: they
add fp32 partial sums into a zero-initialised workspace (``red.global.add``) and count arrivals on a
per-tile counter; the last CTA to arrive applies the epilogue, writes the output and resets its workspace
slice and counter to zero, so the next launch needs no memset and there is no second kernel. The workspace is
``scratch.workspace``'s, one per (device, stream), shared with the wgmma kernel's stream-K tail.

Row-major B (``ROW_B``: B [K, N] with N contiguous, e.g. ``x @ W`` with W stored K x N). W's 16 rows of one mma are
now 32-byte pieces of B's k rows, too short for DRAM bursts and not in fragment order, so B goes through shared
memory. A CTA owns 64 consecutive columns (128 bytes of every k row of B) and its warps split its K range chunk by
chunk (chunk c + warp + i * warps); each warp owns a ring of ``unroll`` 32 x 64 chunk stages (4 KB each) that it
fills with 16-byte ``cp.async`` copies (one warp instruction: four whole 128-byte rows) and drains with
``ldmatrix.x4.trans``, which turns a 16 k x 16 n block of the N-contiguous stage into the m16n8k16 A fragment (16 n
rows x 16 k). The ring is private to its warp, so the pipeline needs only ``cp.async.wait_group`` and
``__syncwarp`` (no CTA barrier until the reduction): ``unroll - 1`` chunks (12 KB with the default 4 warps x 4
stages, 64 KB of shared memory per CTA) are in flight per warp. Giving each warp all 64 columns (rather than a
16-column slice) lets one token fragment feed four mmas and keeps every copy a full row. Stages are XOR-swizzled
(16-byte segment s of row r at s ^ (r % 8)) so ldmatrix is conflict-free. ldmatrix leaves k in natural order, so
the tokens use the ISA's B layout (two consecutive k per register, loaded element-wise, masked at K). Every chunk,
the partial last one included, is staged: rows past K and columns past N are zero-filled by cp.async (nothing
read), so only the tokens need masking. N must be a multiple of 8 and B's rows 16-byte aligned
(``skinny_plan.reason``; the wgmma kernel runs the rest). After the loop a warp's first stage holds its 64 x 16
partial tile, and the shared reduction / split-K epilogue follows. All of this variant's shared memory is dynamic
(``row_b_smem_bytes``: the rings, then split K's arrival count): the runtime opts in to more than 48 KB by the
dynamic size alone, and a static array would have added 1 KB ahead of the 1024-byte aligned dynamic region (exactly
48 KB of rings with split K then failed to launch). ``SkinnyConfig.check(row_b=True)`` declines rings that do not
fit 227 KB.

Token vectors (``SkinnyConfig.token_vectors``, row-major B only, on by default; measured in docs/ops/gemm.md). The
pair-by-pair tokens cost 8 predicated 16-bit loads and their packing per token tile and chunk, issued after the
wait. With the option, k is permuted in the ldmatrix addressing instead (``ldmatrix_row``) so that each lane's B
fragments over a chunk are the 8 consecutive k of one 16-byte token vector, as in the column-major kernel; the
permuted rows an ldmatrix matrix reads need another swizzle (``segment_swizzle``). The tokens of the next chunk are
loaded before the current chunk's wait, the loop running two chunks an iteration so that they land where its mmas
read them, and only the chunk holding K's end is masked. Token rows that are not K-contiguous and 16-byte aligned
keep the pair-by-pair path (``tokens_as_vectors``).

Column-major tokens (A = x.t(), 8 tokens contiguous at each k). Read element by element (``load_tokens``) they cost
8 16-bit loads per token tile, chunk and lane, each warp instruction touching 4 sectors of 4 k rows: at M = 16 the
L1 wavefronts, not DRAM, bound the column-major-B kernel (the profile: docs/ops/gemm.md). How the kernel reads them
is chosen at trace time (``token_path``) from the config and x's specialisation, both in the compile key:

- Row-major B stages them (``tokens_stageable``, when the stages fit the CTA's 227 KB beside the rings): each
  chunk's tokens are copied into shared memory by cp.async in the chunk's commit group, 16 bytes = 8 tokens at one
  k a copy (M <= 8: one per lane and chunk, else two), and read by one ldmatrix.x4.trans per token tile and chunk.
  A stored 8 x 8 matrix of 8 k rows (8 tokens each) gives lane l, transposed, k rows 2 * (l % 4) + {0, 1} of token
  l / 4: the m16n8k16 B fragment. The k a row holds (``token_slot_k``) follows the weight's k order: each lane's 8
  consecutive k for column-major B and for row-major B with token_vectors, the ISA's order otherwise, so the weight
  path is unchanged. Slots are 8-row matrices per token tile, rows XORed with 4 * tile (``token_slot_offset``):
  conflict-free copies and ldmatrix. Rows past K are zero-filled (the padding could hold NaN), so the chunk holding
  K's end needs no token mask; a token tile's copy reads tokens past M whole (16 aligned bytes holding a real
  token; those tokens feed results never stored).
- Column-major B follows ``SkinnyConfig.column_tokens`` (``skinny_plan.COLUMN_B_TOKENS`` by default), per load
  group and with the tokens' loads issued before the group's W loads. "loads": the element loads above. "cp.async":
  the row-major-B stages (one per chunk of the group), filled by cp.async, then ``cp.async.wait_group 0``: the
  copies hit L2, sooner than W's DRAM loads arrive, but the wait is for all of them. "registers": the same 16-byte
  copies read by plain ``ld.global.v4`` into registers (rows past K predicated off: zero) and written to the stages
  by st.shared.v4, so each store waits only for its own load while W's stay in flight. Both then ``__syncwarp`` and
  the ldmatrix.x4.trans above, and need ``tokens_stageable`` tokens and stages that fit; afterwards a warp's stages
  hold its partial tile. "movmatrix" needs no shared memory: for B word w of a token tile, lane 4i + p loads the
  32-bit word of tokens 2p, 2p + 1 at chunk k 8 * (i // 2) + 2w + i % 2, and ``movmatrix.trans`` hands lane l token
  l / 4 at k 8 * (l % 4) + 2w + {0, 1}, the word the K-contiguous vector would give (``movmatrix_source``); it
  needs 4-byte aligned token pairs (``token_pairs_loadable``), clamps pairs past M to the one holding token M - 1
  and zeroes words past K. Tokens a path cannot take (K-contiguous ones included) use "loads".

With staged tokens all shared memory is dynamic (``row_b_smem_bytes``, ``column_b_staged_smem_bytes``).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import nvfly
from nvfly.arch import sm80
from nvfly.arch.gpu_scope import arrive, load_relaxed, red_add
from nvfly.arch.memory import L1Eviction, load_global, store_shared
from nvfly.arch.ptx import smem_address
from nvfly.ops.common.epilogue import activate
from nvfly.ops.gemm.skinny_config import (ARRIVAL_BYTES, CHUNK_BYTES, CHUNK_K, COLS_ROW_B, MAX_M, MAX_SMEM, ROWS,
                                          SEGMENTS, STAGED_TOKENS, TOKEN_TILE_BYTES, VECTOR, SkinnyConfig,
                                          column_b_staged_smem_bytes, row_b_smem_bytes, staged_token_bytes)

# mma fragment registers from the loaded 32-bit words (each word: two consecutive k of one row).
# A (W): register r of k16 step s is word 2 * s + offset of row g (half 0) or g + 8 (half 1), with
# (half, offset) = A_REGISTER_WORDS[r]; B (A's token row g): register r of step s is word 2 * s + r.
A_REGISTER_WORDS = ((0, 0), (1, 0), (0, 1), (1, 1))
B_REGISTER_WORDS = (0, 1)


# ---------------------------------------------------------------------------------------------- index maps
def a_fragment_source(lane: int, register: int, half: int, step: int) -> tuple[int, int]:
    """(W row within the 16-row group, k within the 32-wide chunk) that lane ``lane`` puts in A register
    ``register`` (16-bit ``half``) of k16 step ``step`` (the kernel's loads and A_REGISTER_WORDS)."""
    row_half, offset = A_REGISTER_WORDS[register]
    word = 2 * step + offset
    return lane // 4 + 8 * row_half, VECTOR * (lane % 4) + 2 * word + half


def b_fragment_source(lane: int, register: int, half: int, step: int) -> tuple[int, int]:
    """(k within the chunk, token within the n8 tile) that lane ``lane`` puts in B register ``register``."""
    word = 2 * step + B_REGISTER_WORDS[register]
    return VECTOR * (lane % 4) + 2 * word + half, lane // 4


def c_fragment_target(lane: int, index: int) -> tuple[int, int]:
    """(W row within the group, token within the n8 tile) of accumulator ``index`` (PTX's C layout)."""
    return lane // 4 + 8 * (index // 2), 2 * (lane % 4) + index % 2


# ---------------------------------------------------------------------------------------------- device helpers
def load_stream(address: Any) -> list:
    """16 bytes of the streamed weight as four i32 words: read-only path, not kept in L1, 256-byte L2
    prefetch (every byte is read once)."""
    return load_global(address, 4, non_coherent=True, l1=L1Eviction.NO_ALLOCATE, prefetch=256)


def load_stream_predicated(address: Any, valid: Any) -> list:
    """``load_stream`` where ``valid`` (i1) holds, else four zero words (nothing is read)."""
    return load_global(address, 4, valid, non_coherent=True, l1=L1Eviction.NO_ALLOCATE)


def keep_first(words: list, valid: Any) -> list:
    """The words with every element from index ``valid`` on (two 16-bit elements a word, low half first)
    set to zero."""
    out = []
    for j, word in enumerate(words):
        mask = nvfly.select(valid >= 2 * j + 2, -1, nvfly.select(valid == 2 * j + 1, 0xFFFF, 0))
        out.append(word & mask)
    return out


def load_tokens(x_row: Any, kk: Any) -> list:
    """Eight consecutive k of one token row as four i32 words (one 16-byte load when K is contiguous)."""
    if isinstance(x_row.stride[0], int) and x_row.stride[0] == 1:
        return x_row.load(kk, width=VECTOR).bitcast(nvfly.i32).tolist()
    values = [x_row[kk + j] for j in range(VECTOR)]
    return nvfly.make_vector(values, x_row.dtype).bitcast(nvfly.i32).tolist()


def load_chunk(w_rows: tuple, x_rows: list, kk: Any) -> tuple:
    """One 32-wide k chunk at this lane's offset ``kk``: W rows g and g + 8, and each token tile's row g."""
    return [load_stream(w.address(kk)) for w in w_rows], [load_tokens(x, kk) for x in x_rows]


def load_tail_weight(w_rows: tuple, kk: Any, k: Any) -> list:
    """W's rows in the last, partial chunk: nothing is read at or past K and those elements are zero (the
    padding of W's rows could hold NaN)."""
    valid = k - kk
    return [keep_first(load_stream_predicated(w.address(kk), valid > 0), valid) for w in w_rows]


def load_tail_chunk(w_rows: tuple, x_rows: list, kk: Any, k: Any) -> tuple:
    """The last, partial chunk: nothing is read at or past K and those elements are zero in both operands."""
    ws = load_tail_weight(w_rows, kk, k)
    xs = []
    for x in x_rows:
        values = [x.load(kk + j, mask=kk + j < k) for j in range(VECTOR)]
        xs.append(nvfly.make_vector(values, x.dtype).bitcast(nvfly.i32).tolist())
    return ws, xs


def mma_chunk(accs: list, chunk: tuple, dtype: Any) -> list:
    """Accumulate one chunk: two k16 steps for each token tile."""
    w_words, x_words = chunk
    out = [list(a) for a in accs]
    for step in range(CHUNK_K // 16):
        a = [w_words[half][2 * step + offset] for half, offset in A_REGISTER_WORDS]
        for t in range(len(out)):
            b = [x_words[t][2 * step + r] for r in B_REGISTER_WORDS]
            out[t] = sm80.mma_m16n8k16(a, b, out[t], dtype)
    return out


@nvfly.func
def finish(value, out, c_in, batch, row, col, alpha, beta, EPI):
    """out[batch, row, col] = act(alpha * value + beta * C_in[batch, row, col])."""
    if EPI.scaled:
        value = value * alpha
    if EPI.has_c:
        value = value + beta * c_in[batch, row, col].to(nvfly.f32)
    out[batch, row, col] = activate(value, EPI.activation).to(out.dtype)


# ---------------------------------------------------------------------------------------------- staged tokens
def tokens_stageable(x_batch: Any) -> bool:
    """Whether one batch's tokens x [M, K] can be staged by 16-byte copies (cp.async, or vector loads and
    st.shared) of 8 consecutive tokens at one k: tokens contiguous (column-major A, so never K-contiguous tokens
    past M = 1), K's stride a multiple of 8 elements and a 16-byte aligned base (what x's specialisation
    proves). Token tile t's copies read tokens 8t..8t+7 whole, past M too: 16 aligned bytes that hold token
    8t < M, so inside the allocation, and tokens past M only feed results that are not stored."""
    token_stride, k_stride = x_batch.stride
    if not (isinstance(token_stride, int) and token_stride == 1):
        return False
    k_divisor = abs(k_stride) if isinstance(k_stride, int) else k_stride.divisor
    return k_divisor * x_batch.dtype.itemsize % 16 == 0 and x_batch.align % 16 == 0


def token_pairs_loadable(x_batch: Any) -> bool:
    """Whether one batch's tokens x [M, K] can be read as 32-bit words of two consecutive tokens at one k (the
    movmatrix path): tokens contiguous, K's stride even and a 4-byte aligned base, so that every even token starts
    an aligned word (what x's specialisation proves)."""
    token_stride, k_stride = x_batch.stride
    if not (isinstance(token_stride, int) and token_stride == 1):
        return False
    k_divisor = abs(k_stride) if isinstance(k_stride, int) else k_stride.divisor
    return k_divisor * x_batch.dtype.itemsize % 4 == 0 and x_batch.align % 4 == 0


def token_path(x_batch: Any, config: SkinnyConfig, m_tiles: int, row_b: bool) -> str:
    """How the kernel gets its tokens, one of COLUMN_TOKENS, decided at trace time from CFG and x's specialisation
    (both in the compile key). Row-major B: "cp.async" (staged in its ring's commit groups) for tokens_stageable
    tokens whose stages fit the CTA's shared memory beside the rings. Column-major B: config.column_tokens where
    the tokens allow it (the staged paths: tokens_stageable and stages that fit; movmatrix: token_pairs_loadable).
    Everything else, K-contiguous tokens included, is "loads" (16-byte vectors for K-contiguous rows, else
    element by element)."""
    if row_b:
        wanted, smem = "cp.async", row_b_smem_bytes(config, m_tiles)
    else:
        wanted, smem = config.column_tokens, column_b_staged_smem_bytes(config, m_tiles)
    if wanted in STAGED_TOKENS and tokens_stageable(x_batch) and smem <= MAX_SMEM:
        return wanted
    if wanted == "movmatrix" and token_pairs_loadable(x_batch):
        return wanted
    return "loads"


def token_slot_k(matrix: Any, row: Any, vector_order: bool) -> Any:
    """k within the chunk that a token stage holds in row ``row`` of 8 x 8 matrix ``matrix`` of a token tile.
    ldmatrix.x4.trans gives lane l rows 2 * (l % 4) + {0, 1} of each matrix at token l // 4, so B register r of k16
    step s is matrix 2s + r (``vector_token_fragments``). vector_order: the lane's four words are its 8
    consecutive k from 8 * (l % 4), the words ``load_token_vectors`` and ``load_tokens`` give (``b_fragment_source``;
    column-major B, and row-major B with token_vectors); else the ISA's k order (``row_b_token_source``)."""
    if vector_order:
        return VECTOR * (row // 2) + 2 * matrix + row % 2
    return 8 * matrix + row


def token_slot_offset(tile: Any, matrix: Any, row: Any) -> Any:
    """Byte offset in a token stage of row ``row`` (8 tokens at one k: 16 bytes) of matrix ``matrix`` of token
    tile ``tile``: per tile 4 matrices of 8 consecutive rows (an ldmatrix phase reads one matrix: 128 contiguous
    bytes), rows XORed with 4 * tile so that a copy phase's rows of both tiles (``token_copy_slot``) hit
    different banks."""
    return tile * TOKEN_TILE_BYTES + (8 * matrix + (row ^ (4 * tile))) * 16


def token_copy_slot(lane: Any, j: int, m_tiles: int) -> tuple[Any, Any, Any]:
    """(token tile, matrix, row) that lane ``lane`` fills in its ``j``-th cp.async of a chunk's tokens: the 32 *
    m_tiles slots in order, tiles interleaved, so that a warp instruction copies 32 / m_tiles whole k rows of
    the token tiles (512 contiguous bytes in the ISA order when K's stride is 8 * m_tiles)."""
    slot = (32 * j + lane) // m_tiles
    return (32 * j + lane) % m_tiles, slot // 8, slot % 8


def token_copies(kc: Any, lane: Any, m_tiles: int, vector_order: bool) -> list:
    """(token tile, k, byte offset in a token stage) of each of lane ``lane``'s m_tiles 16-byte copies (8 tokens
    at one k) of the tokens of the chunk at k ``kc``."""
    copies = []
    for j in nvfly.static_range(m_tiles):
        tile, matrix, row = token_copy_slot(lane, j, m_tiles)
        copies.append((tile, kc + token_slot_k(matrix, row, vector_order), token_slot_offset(tile, matrix, row)))
    return copies


def stage_tokens(stage: Any, x_batch: Any, kc: Any, lane: Any, m_tiles: int, vector_order: bool, k: Any = None,
                 wanted: Any = None) -> None:
    """cp.async the tokens of the chunk at k ``kc`` into the token stage at shared address ``stage`` (no commit):
    m_tiles 16-byte copies per lane. With ``k``, rows at or past K (and every row unless ``wanted``) are
    zero-filled, nothing read (the address is clamped in bounds): the padding past K could hold NaN."""
    for tile, kg, offset in token_copies(kc, lane, m_tiles, vector_order):
        if k is None:
            sm80.cp_async(stage + offset, x_batch.address(8 * tile, kg))
        else:
            ok = kg < k if wanted is None else wanted & (kg < k)
            sm80.cp_async(stage + offset, x_batch.address(8 * tile, nvfly.minimum(kg, k - 1)), 16, ok)


def load_token_copies(x_batch: Any, kc: Any, lane: Any, m_tiles: int, k: Any = None) -> list:
    """The registers path's loads of the chunk at ``kc``: each of this lane's ``token_copies`` (vector k order)
    as (byte offset in a token stage, its 16 bytes as four i32 words), read by plain vector loads. With ``k``,
    rows at or past K are zero, nothing read (the padding past K could hold NaN)."""
    return [(offset, load_global(x_batch.address(8 * tile, kg), 4, None if k is None else kg < k))
            for tile, kg, offset in token_copies(kc, lane, m_tiles, True)]


def store_token_copies(stage: Any, copies: list) -> None:
    """st.shared ``load_token_copies``' words into their slots of the token stage at shared address ``stage``
    (the slots stage_tokens' cp.async copies fill)."""
    for offset, words in copies:
        store_shared(stage + offset, words)


def load_staged_tokens(stage: Any, lane: Any, m_tiles: int) -> list:
    """Each token tile's words of a staged chunk, one ldmatrix.x4.trans per tile: word w is matrix w
    (``token_slot_k``)."""
    return [sm80.ldmatrix_x4(stage + token_slot_offset(t, lane // 8, lane % 8), transpose=True)
            for t in range(m_tiles)]


# ---------------------------------------------------------------------------------------------- movmatrix tokens
def movmatrix_source(lane: Any, word: int) -> tuple[Any, Any]:
    """(first token within the n8 tile, k within the chunk) of the 32-bit word (that token and the next, at one
    k) lane ``lane`` loads for B word ``word`` (0..3) of a token tile: lane 4i + p holds row i, columns 2p and
    2p + 1 of an 8 x 8 matrix whose row i is k 8 * (i // 2) + 2 * word + i % 2 and whose column c is token c.
    movmatrix.trans then gives lane l column l // 4 (token l // 4) of rows 2 * (l % 4) + {0, 1}, i.e. k
    8 * (l % 4) + 2 * word + {0, 1}: word ``word`` of the lane's 8 consecutive k, as ``load_tokens`` reads
    K-contiguous tokens (``b_fragment_source``)."""
    i, p = lane // 4, lane % 4
    return 2 * p, VECTOR * (i // 2) + 2 * word + i % 2


def load_token_pairs(x_batch: Any, kc: Any, lane: Any, m: Any, m_tiles: int, k: Any = None) -> list:
    """The movmatrix path's loads of the chunk at ``kc``: each token tile's four source words
    (``movmatrix_source``), 32-bit loads of two consecutive tokens. A pair past M is clamped to the pair holding
    token M - 1 (in bounds: an aligned word holding a real token; it only feeds results that are not stored);
    with ``k``, words at or past K are zero, nothing read (the padding past K could hold NaN)."""
    words = []
    for t in nvfly.static_range(m_tiles):
        tile_words = []
        for word in nvfly.static_range(VECTOR // 2):
            token, kw = movmatrix_source(lane, word)
            first = nvfly.minimum(8 * t + token, m - 1) & -2
            kg = kc + kw
            tile_words.append(load_global(x_batch.address(first, kg), 1, None if k is None else kg < k))
        words.append(tile_words)
    return words


# ---------------------------------------------------------------------------------------------- row-major B
def segment_swizzle(row: Any, token_vectors: bool) -> Any:
    """What the 16-byte segments of k row ``row`` are XORed with, so that the 8 rows one ldmatrix matrix reads
    hit 8 different bank groups: row % 8 for its 8 consecutive rows (ISA k order) and, with ``token_vectors``
    (rows c + {0, 1, 8, 9, 16, 17, 24, 25}, c even and below 8), row bits 0, 3 and 4."""
    if token_vectors:
        return (row & 1) | ((row >> 2) & 6)
    return row % 8


def stage_offset(row: Any, segment: Any, token_vectors: bool = False) -> Any:
    """Byte offset in a ring stage of 16-byte segment ``segment`` (8 columns) of k row ``row``: 128-byte rows,
    segments XOR-swizzled (``segment_swizzle``; the cp.async writes of a warp cover whole rows, so they are
    conflict-free either way)."""
    return row * (SEGMENTS * 16) + (segment ^ segment_swizzle(row, token_vectors)) * 16


def copy_target(lane: Any, j: int) -> tuple[Any, Any]:
    """(k row within the chunk, 16-byte segment) that lane ``lane`` copies in its ``j``-th cp.async of a chunk:
    one warp instruction moves 4 whole 128-byte rows."""
    return lane // SEGMENTS + (32 // SEGMENTS) * j, lane % SEGMENTS


def ldmatrix_row(lane: Any, step: int, tile: int, token_vectors: bool = False) -> tuple[Any, Any]:
    """(k row within the chunk, segment) whose 16 bytes lane ``lane`` addresses in the ldmatrix.x4.trans of k16
    step ``step`` and 16-column tile ``tile``: matrix lane // 8 is (columns +8, mma k +8) = (lane // 8 % 2,
    lane // 8 // 2), i.e. A registers a0a1, a2a3, a4a5, a6a7 of mma.m16n8k16, and its row r is mma k
    8 * (lane // 8 // 2) + r. Without ``token_vectors`` that is the chunk's k16 step in order; with it, mma k
    2q + h (register 0 of the lanes q = lane % 4) and 8 + 2q + h (register 1) read chunk k 8q + 4 * step + h and
    8q + 4 * step + 2 + h: each lane's B fragment is 8 consecutive k over the two steps (``b_fragment_source``)."""
    matrix, r = lane // 8, lane % 8
    if token_vectors:
        return 8 * (r // 2) + 4 * step + 2 * (matrix // 2) + r % 2, 2 * tile + matrix % 2
    return 16 * step + 8 * (matrix // 2) + r, 2 * tile + matrix % 2


def row_b_token_source(lane: Any, register: int, half: int, step: int) -> tuple[Any, Any]:
    """(k within the chunk, token within the n8 tile) of B register ``register`` (the ISA's order: ldmatrix
    leaves k unpermuted; with token_vectors, ``vector_token_fragments`` instead)."""
    return 16 * step + 8 * register + 2 * (lane % 4) + half, lane // 4


def issue_chunk(stage: Any, w: Any, batch: Any, chunk: Any, n0: Any, lane: Any, k: Any, n: Any, wanted: Any,
                token_vectors: bool) -> None:
    """cp.async one 32 x 64 chunk of B (k rows from ``chunk * 32``, columns from ``n0``) into the ring stage at
    shared address ``stage`` (swizzled for ``token_vectors`` or not; no commit); rows at or past K, columns past
    N and unwanted chunks are zero-filled (nothing is read; the address is clamped in bounds)."""
    for j in nvfly.static_range(CHUNK_K * SEGMENTS // 32):
        row, segment = copy_target(lane, j)
        kg = chunk * CHUNK_K + row
        ng = n0 + segment * VECTOR
        ok = wanted & (kg < k) & (ng < n)
        src = w.address(batch, nvfly.minimum(kg, k - 1), nvfly.minimum(ng, n - VECTOR))
        sm80.cp_async(stage + stage_offset(row, segment, token_vectors), src, 16, ok)


def load_pair(x_row: Any, kk: Any, k: Any) -> Any:
    """x_row[kk], x_row[kk + 1] as one i32 word (zero at or past K)."""
    values = [x_row.load(kk + j, mask=kk + j < k) for j in range(2)]
    return nvfly.make_vector(values, x_row.dtype).bitcast(nvfly.i32).tolist()[0]


def scalar_token_fragments(x_rows: list, kc: Any, k: Any, lane: Any) -> Callable[[int], list]:
    """The tokens' B fragments of the chunk at ``kc`` in the ISA's k order, per k16 step: loaded pair by pair
    (both halves of a register are consecutive k: one word per register from its half 0 k), masked at K."""
    def of_step(step: int) -> list:
        return [[load_pair(x, kc + row_b_token_source(lane, reg, 0, step)[0], k) for reg in range(2)]
                for x in x_rows]
    return of_step


def vector_token_fragments(token_words: list) -> Callable[[int], list]:
    """The tokens' B fragments per k16 step from each token tile's loaded words (``load_token_vectors``), for
    the k-permuted ldmatrix addressing."""
    def of_step(step: int) -> list:
        return [[words[2 * step + r] for r in B_REGISTER_WORDS] for words in token_words]
    return of_step


@nvfly.func
def load_token_vectors(x_rows, kc, kq, k):
    """Each token tile's 8 consecutive k at ``kc + kq`` (this lane's share of the chunk at ``kc``) as four i32
    words, one 16-byte load per tile. Only the chunk holding K's end (or a chunk past it) is masked: a vector
    starting before K is read whole (16-byte aligned, so within the aligned 16 bytes that hold the row's last
    element) and its k at or past K are zeroed, since the padding could hold NaN."""
    if kc + CHUNK_K <= k:
        words = [x.load(kc + kq, width=VECTOR).bitcast(nvfly.i32).tolist() for x in x_rows]
    else:
        valid = k - kc - kq
        words = [keep_first(x.load(kc + kq, width=VECTOR, mask=valid > 0).bitcast(nvfly.i32).tolist(), valid)
                 for x in x_rows]
    return words


def token_vector_k(lane: Any) -> Any:
    """k within a chunk of the 16-byte token vector lane ``lane`` loads with token_vectors (row-major B)."""
    return (lane % 4) * VECTOR


def tokens_as_vectors(x_row: Any) -> bool:
    """Whether a token row can be read as 16-byte vectors: K contiguous and 16-byte aligned rows (what x's
    specialisation proves)."""
    return isinstance(x_row.stride[-1], int) and x_row.stride[-1] == 1 and x_row.align % 16 == 0


def mma_stage(accs: list, stage: Any, token_fragments: Callable[[int], list], lane: Any, token_vectors: bool,
              dtype: Any) -> list:
    """Accumulate one staged chunk: per k16 step, the tokens' B fragments (``token_fragments(step)``: two
    registers per token tile), then an ldmatrix.x4.trans and the mmas of each 16-column tile."""
    out = [[list(a) for a in tile] for tile in accs]
    for step in nvfly.static_range(CHUNK_K // 16):
        b = token_fragments(step)
        for tile in nvfly.static_range(COLS_ROW_B // ROWS):
            row, segment = ldmatrix_row(lane, step, tile, token_vectors)
            a = sm80.ldmatrix_x4(stage + stage_offset(row, segment, token_vectors), transpose=True)
            for t in range(len(b)):
                out[tile][t] = sm80.mma_m16n8k16(a, b[t], out[tile][t], dtype)
    return out


class WarpRing(NamedTuple):
    """One warp's STAGES-deep cp.async ring (shared address ``base``) over its ``count`` chunks first,
    first + WARPS, ... of the 64 columns of B from ``n0``, and the token rows of its mmas; with ``token_vectors``
    the stages are k-permuted and the tokens read as 16-byte vectors (``kq``: this lane's k in a chunk) unless
    staged. ``tokens``: with staged tokens, the shared address of the ring's token stages (``TOKEN_TILE_BYTES``
    per token tile of ``x_batch``, one stage per ring stage, filled in its commit group), else None."""
    w: Any
    x_rows: list
    x_batch: Any
    tokens: Any
    batch: Any
    n0: Any
    lane: Any
    k: Any
    n: Any
    base: Any
    first: Any
    count: Any
    kq: Any
    warps: int
    stages: int
    m_tiles: int
    token_vectors: bool

    def token_stage(self, i: Any) -> Any:
        """Shared address of the token stage of the warp's chunk ``i``."""
        return self.tokens + (i % self.stages) * (self.m_tiles * TOKEN_TILE_BYTES)


def issue_ring_chunk(ring: WarpRing, i: Any) -> None:
    """cp.async the warp's chunk ``i`` (zero-filled from its ``count``-th on) into stage i % stages as one commit
    group: B's 32 x 64 block and, when staged, its tokens (in the k order of the B stage's ldmatrix)."""
    chunk = ring.first + i * ring.warps
    wanted = i < ring.count
    issue_chunk(ring.base + (i % ring.stages) * CHUNK_BYTES, ring.w, ring.batch, chunk, ring.n0, ring.lane, ring.k,
                ring.n, wanted, ring.token_vectors)
    if ring.tokens is not None:
        stage_tokens(ring.token_stage(i), ring.x_batch, chunk * CHUNK_K, ring.lane, ring.m_tiles, ring.token_vectors,
                     ring.k, wanted)
    sm80.cp_async_commit()


def ring_chunk(ring: WarpRing, accs: list, i: Any, tokens: Optional[list]) -> tuple[list, Optional[list]]:
    """Chunk ``i`` of a warp's ring: refill the stage ``stages - 1`` chunks ahead, wait for chunk i and
    accumulate it. With token_vectors and tokens in registers, ``tokens`` are chunk i's (loaded a chunk earlier)
    and the next chunk's (past the warp's range: unused, masked past K) are loaded before the wait so that their
    latency overlaps this chunk's; returns (accumulators, the next chunk's tokens or None)."""
    issue_ring_chunk(ring, i + ring.stages - 1)
    following = None
    if ring.token_vectors and ring.tokens is None:
        following = load_token_vectors(ring.x_rows, (ring.first + (i + 1) * ring.warps) * CHUNK_K, ring.kq, ring.k)
    sm80.cp_async_wait(ring.stages - 1)
    nvfly.syncwarp()
    stage = ring.base + (i % ring.stages) * CHUNK_BYTES
    if ring.tokens is not None:
        fragments = vector_token_fragments(load_staged_tokens(ring.token_stage(i), ring.lane, ring.m_tiles))
    elif ring.token_vectors:
        fragments = vector_token_fragments(tokens)
    else:
        fragments = scalar_token_fragments(ring.x_rows, (ring.first + i * ring.warps) * CHUNK_K, ring.k, ring.lane)
    accs = mma_stage(accs, stage, fragments, ring.lane, ring.token_vectors, ring.w.dtype)
    nvfly.syncwarp()  # every lane is done with stage i % stages before the next chunk refills it
    return accs, following


@nvfly.func
def stream_row_major(w, x, ring, tokens, batch, n0, c_begin, c_end, warp, lane, m, n, k, WARPS, STAGES, M_TILES,
                     TOKEN_VECTORS):
    """This warp's chunks c_begin + warp, + WARPS, ... through its own STAGES-deep cp.async ring (only
    wait_group and __syncwarp: no CTA barrier); accumulators [column tile][token tile][4]. ``tokens``: the shared
    address of the CTA's token stages when the tokens are staged (``token_path``), else None. TOKEN_VECTORS,
    where x's rows allow it: k-permuted stages and the tokens as 16-byte vectors, a chunk ahead (staged tokens
    follow either k order)."""
    g = lane // 4
    x_rows = [x[batch, nvfly.minimum(g + 8 * t, m - 1), :] for t in nvfly.static_range(M_TILES)]
    vectors = TOKEN_VECTORS and tokens_as_vectors(x_rows[0])  # K-contiguous tokens: never staged
    # k-permuted stages with token vectors in registers or staged tokens; else the ISA's k order, tokens pair by pair
    permuted = TOKEN_VECTORS and (vectors or tokens is not None)
    base = ring + warp * (STAGES * CHUNK_BYTES)
    warp_tokens = None if tokens is None else tokens + warp * (STAGES * M_TILES * TOKEN_TILE_BYTES)
    count = (c_end - c_begin - warp + WARPS - 1) // WARPS
    first = c_begin + warp
    warp_ring = WarpRing(w, x_rows, x[batch, :, :], warp_tokens, batch, n0, lane, k, n, base, first, count,
                         token_vector_k(lane), WARPS, STAGES, M_TILES, permuted)
    accs = [[[nvfly.f32(0.0)] * 4 for _ in nvfly.static_range(M_TILES)] for _ in nvfly.static_range(COLS_ROW_B // ROWS)]
    for i in nvfly.static_range(STAGES - 1):
        issue_ring_chunk(warp_ring, i)
    if vectors:
        # two chunks an iteration, so that the tokens loaded for the next chunk land in the registers its mmas
        # read (one chunk an iteration would copy them at its end, waiting for the load there)
        current = load_token_vectors(x_rows, first * CHUNK_K, warp_ring.kq, k)
        for pair in range(count // 2):
            accs, following = ring_chunk(warp_ring, accs, 2 * pair, current)
            accs, current = ring_chunk(warp_ring, accs, 2 * pair + 1, following)
        if count % 2 == 1:
            accs = ring_chunk(warp_ring, accs, count - 1, current)[0]
    else:
        for i in range(count):
            accs = ring_chunk(warp_ring, accs, i, None)[0]
    sm80.cp_async_wait(0)
    nvfly.syncwarp()  # the ring may now hold this warp's partial sums
    return accs


class ColumnMajorRows(NamedTuple):
    """What a warp of the column-major-B kernel streams: W rows g and g + 8 (``w_rows``), each token tile's row g
    (``x_rows``), this lane's k in a chunk (``kq``), the batch's tokens ``x_batch`` and how they are read
    (``path``: ``token_path``); ``tokens``: on the staged paths, the shared address of the warp's token stages
    (one per chunk of a load group), else None."""
    w_rows: tuple
    x_rows: list
    x_batch: Any
    tokens: Any
    kq: Any
    lane: Any
    m: Any
    k: Any
    m_tiles: int
    path: str


def load_weight(rows: ColumnMajorRows, kcs: list, tail: bool) -> list:
    """W rows g and g + 8 of the chunks at k ``kcs`` at this lane's k (``tail``: the partial chunk, masked at K)."""
    return [load_tail_weight(rows.w_rows, kc + rows.kq, rows.k) if tail else
            [load_stream(w.address(kc + rows.kq)) for w in rows.w_rows] for kc in kcs]


def column_major_chunks(accs: list, rows: ColumnMajorRows, kcs: list, tail: bool, dtype: Any) -> list:
    """Load the chunks at k ``kcs`` (``tail``: the one partial chunk, masked at K), then accumulate them. The
    tokens' loads are issued before W's (the module docstring's "Column-major tokens"): cp.async copies (one
    commit group, zero-filled past K in the tail) then wait, or vector loads then st.shared, each followed by
    __syncwarp and ldmatrix.trans (the stages are free again at the end); or 32-bit pairs then movmatrix."""
    if rows.path == "loads":
        chunks = [load_tail_chunk(rows.w_rows, rows.x_rows, kc + rows.kq, rows.k) if tail else
                  load_chunk(rows.w_rows, rows.x_rows, kc + rows.kq) for kc in kcs]
        for chunk in chunks:
            accs = mma_chunk(accs, chunk, dtype)
        return accs
    mask = rows.k if tail else None
    if rows.path == "movmatrix":
        pairs = [load_token_pairs(rows.x_batch, kc, rows.lane, rows.m, rows.m_tiles, mask) for kc in kcs]
        ws = load_weight(rows, kcs, tail)
        for w_words, tile_words in zip(ws, pairs):
            x_words = [[sm80.movmatrix_trans(word) for word in words] for words in tile_words]
            accs = mma_chunk(accs, (w_words, x_words), dtype)
        return accs
    stages = [rows.tokens + u * (rows.m_tiles * TOKEN_TILE_BYTES) for u in range(len(kcs))]
    if rows.path == "cp.async":
        for stage, kc in zip(stages, kcs):
            stage_tokens(stage, rows.x_batch, kc, rows.lane, rows.m_tiles, True, mask)
        sm80.cp_async_commit()
        ws = load_weight(rows, kcs, tail)
        sm80.cp_async_wait(0)
    else:  # registers: the st.shared waits for its own loads (L2 hits) only, W's stay in flight
        copies = [load_token_copies(rows.x_batch, kc, rows.lane, rows.m_tiles, mask) for kc in kcs]
        ws = load_weight(rows, kcs, tail)
        for stage, chunk_copies in zip(stages, copies):
            store_token_copies(stage, chunk_copies)
    nvfly.syncwarp()
    for stage, w_words in zip(stages, ws):
        accs = mma_chunk(accs, (w_words, load_staged_tokens(stage, rows.lane, rows.m_tiles)), dtype)
    nvfly.syncwarp()  # every lane has read the stages before the next copies overwrite them
    return accs


@nvfly.func
def stream_column_major(w, x, tokens, batch, group, split, warp, lane, m, n, k, chunks_per_split, WARPS, UNROLL,
                        SPLITS, M_TILES, TOKEN_PATH):
    """This warp's share of the CTA's K range, W rows loaded straight into registers; accumulators
    [token tile][4]. TOKEN_PATH: how the tokens are read (``token_path``); ``tokens``: on the staged paths, the
    shared address of the CTA's token stages, else None."""
    dtype = w.dtype
    g = lane // 4
    # rows past N and tokens past M are clamped: they only feed results that are not stored
    w_rows = (w[batch, nvfly.minimum(group * ROWS + g, n - 1), :],
              w[batch, nvfly.minimum(group * ROWS + g + 8, n - 1), :])
    x_rows = [x[batch, nvfly.minimum(g + 8 * t, m - 1), :] for t in nvfly.static_range(M_TILES)]
    warp_tokens = None if tokens is None else tokens + warp * (UNROLL * M_TILES * TOKEN_TILE_BYTES)
    rows = ColumnMajorRows(w_rows, x_rows, x[batch, :, :], warp_tokens, (lane % 4) * VECTOR, lane, m, k, M_TILES,
                           TOKEN_PATH)
    accs = [[nvfly.f32(0.0)] * 4 for _ in nvfly.static_range(M_TILES)]
    full_chunks = k // CHUNK_K
    c_begin = split * chunks_per_split
    c_end = nvfly.minimum(c_begin + chunks_per_split, full_chunks)
    groups = (c_end - c_begin) // UNROLL
    for gi in range(warp, groups, WARPS):
        first = c_begin + gi * UNROLL
        accs = column_major_chunks(accs, rows, [(first + u) * CHUNK_K for u in nvfly.static_range(UNROLL)], False,
                                   dtype)
    for c in range(c_begin + groups * UNROLL + warp, c_end, WARPS):
        accs = column_major_chunks(accs, rows, [c * CHUNK_K], False, dtype)
    if (split == SPLITS - 1) & (warp == WARPS - 1) & (full_chunks * CHUNK_K < k):
        accs = column_major_chunks(accs, rows, [full_chunks * CHUNK_K], True, dtype)
    return accs


# ---------------------------------------------------------------------------------------------- the kernel
@nvfly.kernel
def skinny_gemm_kernel(w: nvfly.Tensor, x: nvfly.Tensor, out: nvfly.Tensor, c_in, workspace, counters,
                       m: nvfly.i32, n: nvfly.i32, k: nvfly.i32, chunks_per_split: nvfly.i32, alpha: nvfly.f32,
                       beta: nvfly.f32, CFG: nvfly.Constexpr, M_TILES: nvfly.Constexpr, EPI: nvfly.Constexpr,
                       ROW_B: nvfly.Constexpr):
    """out[b] = act(alpha * x[b] @ W[b]^T + beta * C_in[b]), x [B, M, K], out and C_in [B, M, N]. W is w
    [B, N, K] with K contiguous and 16-byte aligned rows, or with ROW_B, w is B itself: [B, K, N] with N
    contiguous, N % 8 == 0 and 16-byte aligned rows. Grid: (column groups x splits, batches)."""
    WARPS, UNROLL, SPLITS = CFG.warps, CFG.unroll, CFG.splits
    THREADS = WARPS * 32
    TOKENS = 8 * M_TILES
    COLS = COLS_ROW_B if ROW_B else ROWS  # output columns per CTA
    TILE = COLS * TOKENS
    SLOTS = COLS * MAX_M  # workspace slots per output tile
    nvfly.min_blocks_per_sm(max(1, 512 // THREADS))  # a 128-register budget (64 spills the unrolled loads)
    tid = nvfly.thread_idx.x
    warp = nvfly.warp_idx()
    lane = nvfly.lane_idx()
    batch = nvfly.block_idx.y
    group = nvfly.block_idx.x // SPLITS
    split = nvfly.block_idx.x % SPLITS
    g = lane // 4

    # per warp: (column within the group, token, partial sum) of each accumulator (PTX's C layout), and where
    # its partial tile goes in shared memory. Staged tokens: every warp's token stages in dynamic shared memory
    # (after the rings with row-major B), then all shared memory is dynamic (the arrival count too)
    RING_BYTES = WARPS * UNROLL * CHUNK_BYTES if ROW_B else 0
    TOKEN_PATH = token_path(x[batch, :, :], CFG, M_TILES, ROW_B)
    STAGED = TOKEN_PATH in STAGED_TOKENS
    TOKEN_BYTES = staged_token_bytes(CFG, M_TILES) if STAGED else 0
    tokens = None
    if STAGED:
        tokens = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (TOKEN_BYTES,), offset_bytes=RING_BYTES))
    if ROW_B:
        # the ring is reused for the partial sums: a warp's first stage (4 KB) holds its 64 x 16 tile
        ring = smem_address(nvfly.dynamic_shared_tensor(nvfly.u8, (RING_BYTES,)))
        c_begin = split * chunks_per_split
        c_end = nvfly.minimum(c_begin + chunks_per_split, (k + CHUNK_K - 1) // CHUNK_K)
        tiles = stream_row_major(w, x, ring, tokens, batch, group * COLS, c_begin, c_end, warp, lane, m, n, k, WARPS,
                                 UNROLL, M_TILES, CFG.token_vectors)
        partial = nvfly.dynamic_shared_tensor(nvfly.f32, (RING_BYTES // 4,))
        WARP_STRIDE = UNROLL * CHUNK_BYTES // 4
    else:
        tiles = [stream_column_major(w, x, tokens, batch, group, split, warp, lane, m, n, k, chunks_per_split, WARPS,
                                     UNROLL, SPLITS, M_TILES, TOKEN_PATH)]
        if STAGED:  # a warp's token stages (at least one chunk's: 512 bytes a token tile) hold its 16 x TOKENS tile
            partial = nvfly.dynamic_shared_tensor(nvfly.f32, (TOKEN_BYTES // 4,))
            WARP_STRIDE = UNROLL * M_TILES * TOKEN_TILE_BYTES // 4
        else:
            partial = nvfly.shared_tensor(nvfly.f32, (WARPS * TILE,))
            WARP_STRIDE = TILE

    # every warp's fragments into shared memory as [warp][token][column], then one thread per output sums them
    for ct in nvfly.static_range(len(tiles)):
        for t in nvfly.static_range(M_TILES):
            for i in nvfly.static_range(4):
                col = ROWS * ct + g + 8 * (i // 2)
                token = 8 * t + 2 * (lane % 4) + i % 2
                partial[warp * WARP_STRIDE + token * COLS + col] = tiles[ct][t][i]
    nvfly.syncthreads()
    tile = batch * ((n + COLS - 1) // COLS) + group
    totals = []
    for p in nvfly.static_range((TILE + THREADS - 1) // THREADS):
        e = p * THREADS + tid
        total = partial[nvfly.minimum(e, TILE - 1)]
        for v in nvfly.static_range(1, WARPS):
            total = total + partial[v * WARP_STRIDE + nvfly.minimum(e, TILE - 1)]
        token = e // COLS
        col = group * COLS + e % COLS
        valid = (e < TILE) & (token < m) & (col < n)
        totals.append((total, token, col, valid, tile * SLOTS + e))
    if SPLITS == 1:
        for total, token, col, valid, slot in totals:
            if valid:
                finish(total, out, c_in, batch, token, col, alpha, beta, EPI)
    else:
        for total, token, col, valid, slot in totals:
            if valid:
                red_add(workspace.address(slot), total)
        nvfly.threadfence()  # this thread's sums are visible GPU-wide before the CTA counts itself in
        # row-major B and staged tokens keep all shared memory dynamic (row_b_smem_bytes,
        # column_b_staged_smem_bytes): a static array would add 1 KB before the 1024-byte aligned dynamic region,
        # unseen by the launch's opt-in decision
        if ROW_B or STAGED:
            arrived = nvfly.dynamic_shared_tensor(nvfly.i32, (ARRIVAL_BYTES // 4,),
                                                  offset_bytes=RING_BYTES + TOKEN_BYTES)
        else:
            arrived = nvfly.shared_tensor(nvfly.i32, (1,))
        nvfly.syncthreads()
        if tid == 0:
            arrived[0] = arrive(counters.address(tile))
        nvfly.syncthreads()
        if arrived[0] == SPLITS - 1:  # the last CTA of this tile: every other split's sums are in
            nvfly.threadfence()
            for partial_sum, token, col, valid, slot in totals:
                if valid:
                    total = load_relaxed(workspace.address(slot), nvfly.f32)
                    workspace[slot] = 0.0
                    finish(total, out, c_in, batch, token, col, alpha, beta, EPI)
            if tid == 0:
                counters[tile] = 0
