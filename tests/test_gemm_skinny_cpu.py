"""The skinny (decode) GEMM without a GPU: the K-permuted fragment mapping against an emulation of
mma.m16n8k16, the kernel compiling to HMMA and 16-byte streaming loads without spills for every variant, and
matmul's choice between it and the wgmma kernel."""
import collections
import dataclasses
import itertools
import math
import re
import types

import numpy as np
import pytest
import torch

import nvfly
from benchmarks import gemm_skinny_configs as bench
from nvfly.ops import gemm
from nvfly.ops.gemm import skinny_config, skinny_kernel, skinny_plan
from nvfly.ops.gemm.skinny_config import SkinnyConfig
from nvfly.runtime import driver


# ---------------------------------------------------------------------------------------------- index math
# PTX ISA, mma.m16n8k16 with 16-bit inputs: g = lane / 4, q = lane % 4, i = 2 * register + half
def isa_a(lane, i):
    """(row, col) of A element a_i held by ``lane``."""
    g, q = lane // 4, lane % 4
    return g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4)


def isa_b(lane, i):
    """(row k, col) of B element b_i."""
    g, q = lane // 4, lane % 4
    return 2 * q + i % 2 + 8 * (i // 2), g


def isa_c(lane, i):
    g, q = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * q + i % 2


def test_c_fragment_target_is_the_isa_layout():
    for lane, i in itertools.product(range(32), range(4)):
        assert skinny_kernel.c_fragment_target(lane, i) == isa_c(lane, i)


def test_each_lane_loads_16_contiguous_bytes_per_row():
    for lane in range(32):
        for row_half in (0, 1):
            ks = sorted(skinny_kernel.a_fragment_source(lane, r, h, s)[1]
                        for r in range(4) for h in range(2) for s in range(2)
                        if skinny_kernel.A_REGISTER_WORDS[r][0] == row_half)
            assert ks == list(range(8 * (lane % 4), 8 * (lane % 4) + 8))
        ks = sorted(skinny_kernel.b_fragment_source(lane, r, h, s)[0] for r in range(2) for h in range(2)
                    for s in range(2))
        assert ks == list(range(8 * (lane % 4), 8 * (lane % 4) + 8))


@pytest.mark.parametrize("seed", range(3))
def test_permuted_fragments_compute_the_product(seed):
    """Emulate the warp: fill each lane's registers as the kernel does, run two mma steps with the ISA's
    fragment layouts, and compare with W @ X^T over the 32-wide chunk."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 32))
    x = rng.standard_normal((8, 32))
    d = np.zeros((16, 8))
    for step in range(2):
        a_mat = np.full((16, 16), np.nan)
        b_mat = np.full((16, 8), np.nan)
        for lane in range(32):
            for register, half in itertools.product(range(4), range(2)):
                row, k = skinny_kernel.a_fragment_source(lane, register, half, step)
                r, col = isa_a(lane, 2 * register + half)
                assert np.isnan(a_mat[r, col])
                a_mat[r, col] = w[row, k]
            for register, half in itertools.product(range(2), range(2)):
                k, token = skinny_kernel.b_fragment_source(lane, register, half, step)
                kk, col = isa_b(lane, 2 * register + half)
                assert np.isnan(b_mat[kk, col])
                b_mat[kk, col] = x[token, k]
        assert not np.isnan(a_mat).any() and not np.isnan(b_mat).any()
        d += a_mat @ b_mat
    result = np.zeros((16, 8))
    for lane, i in itertools.product(range(32), range(4)):
        row, token = skinny_kernel.c_fragment_target(lane, i)
        result[row, token] = d[isa_c(lane, i)]
    np.testing.assert_allclose(result, w @ x.T, rtol=1e-12, atol=1e-12)


def test_a_wrong_mapping_is_caught(monkeypatch):
    """The emulation can fail: B registers taken in the other order no longer pair k with k."""
    monkeypatch.setattr(skinny_kernel, "B_REGISTER_WORDS", (1, 0))
    with pytest.raises(AssertionError):
        test_permuted_fragments_compute_the_product(0)


# ---------------------------------------------------------------------------------------------- row-major B
def ldmatrix_trans(stage_bytes, addresses):
    """Emulate ldmatrix.sync.m8n8.x4.trans.b16 on a byte-addressed stage of 16-bit values: lane 8i + j gives the
    address of row j of matrix i; lane t receives, per matrix, elements (row 2 * (t % 4) + h, column t // 4)
    for h = 0, 1 (the transpose of the untransposed load's row t // 4, columns 2 * (t % 4) + h)."""
    regs = [[None] * 4 for _ in range(32)]
    for t in range(32):
        for i in range(4):
            regs[t][i] = tuple(stage_bytes[addresses[8 * i + 2 * (t % 4) + h] // 2 + t // 4] for h in range(2))
    return regs


def bank_conflicts(addresses):
    """Extra shared-memory wavefronts of one phase of 16-byte accesses: for each of the 32 4-byte banks, the
    distinct addresses touching it beyond the first (the same address is a broadcast, not a conflict)."""
    by_bank = {}
    for address in set(addresses):
        for word in range(address // 4, address // 4 + 4):
            by_bank.setdefault(word % 32, set()).add(address)
    return sum(len(hits) - 1 for hits in by_bank.values())


def row_major_token_k(lane, register, half, step, token_vectors):
    """k within the chunk that the kernel puts in half ``half`` of B register ``register`` of k16 step ``step``:
    pair by pair in the ISA's order (row_b_token_source, as scalar_token_fragments loads them), or with
    token_vectors picked (vector_token_fragments) from the lane's 16-byte vector at token_vector_k, its words
    modelled as (k, k + 1)."""
    if not token_vectors:
        return skinny_kernel.row_b_token_source(lane, register, half, step)[0]
    kq = skinny_kernel.token_vector_k(lane)
    words = [(kq + 2 * word, kq + 2 * word + 1) for word in range(skinny_config.VECTOR // 2)]
    return skinny_kernel.vector_token_fragments([words])(step)[0][register][half]


def staged_token_words(m_tiles, vector_order):
    """Emulate the staged tokens of one chunk with the kernel's maps: every lane's cp.async copies of 8 tokens at
    one k (stage_tokens: token_copy_slot, token_slot_k, token_slot_offset) into a token stage whose elements are
    modelled as (k, token), then each token tile's ldmatrix.x4.trans (load_staged_tokens). Every 8-lane phase
    of the copies and of the ldmatrix is free of bank conflicts, and the copies fill the stage exactly once.
    Returns words[tile][lane][word] = ((k, token), (k, token)) of the word's two halves."""
    stage = [None] * (m_tiles * skinny_config.TOKEN_TILE_BYTES // 2)
    for j in range(m_tiles):
        writes = []
        for lane in range(32):
            tile, matrix, row = skinny_kernel.token_copy_slot(lane, j, m_tiles)
            k = skinny_kernel.token_slot_k(matrix, row, vector_order)
            offset = skinny_kernel.token_slot_offset(tile, matrix, row)
            assert offset % 16 == 0 and stage[offset // 2:offset // 2 + 8] == [None] * 8, (lane, j)
            stage[offset // 2:offset // 2 + 8] = [(k, 8 * tile + token) for token in range(8)]
            writes.append(offset)
        assert [bank_conflicts(writes[8 * p:8 * p + 8]) for p in range(4)] == [0] * 4, ("copy", j)
    assert None not in stage
    words = []
    for tile in range(m_tiles):
        # ldmatrix: lane 8i + r gives the address of row r of matrix i
        addresses = [skinny_kernel.token_slot_offset(tile, lane // 8, lane % 8) for lane in range(32)]
        assert [bank_conflicts(addresses[8 * i:8 * i + 8]) for i in range(4)] == [0] * 4, ("ldmatrix", tile)
        words.append(ldmatrix_trans(stage, addresses))
    return words


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("token_vectors", [False, True], ids=["isa_order", "token_vectors"])
@pytest.mark.parametrize("staged", [False, True], ids=["registers", "staged"])
def test_row_major_staging_and_ldmatrix_trans_compute_the_product(seed, token_vectors, staged):
    """Emulate a warp on one 32 x 64 chunk of row-major B with the kernel's own index maps: the cp.async copies
    into the swizzled stage, each column tile's ldmatrix.x4.trans per k16 step (k-permuted with token_vectors),
    the tokens' B fragments (in registers: pair by pair or 16-byte vectors; staged: two token tiles through
    staged_token_words, in the stage's k order, picked by vector_token_fragments as ring_chunk does), the mmas
    and the accumulator layout; compare with W @ X^T (W = B^T, 64 columns). Every 8-lane phase of the copies
    and of the ldmatrix is free of bank conflicts."""
    rng = np.random.default_rng(seed)
    cols, chunk = skinny_config.COLS_ROW_B, skinny_config.CHUNK_K
    tiles = 2 if staged else 1
    b = rng.standard_normal((chunk, cols))  # [k, n]
    x = rng.standard_normal((8 * tiles, chunk))
    stage = np.full(skinny_config.CHUNK_BYTES // 2, np.nan)
    for j in range(chunk * skinny_config.SEGMENTS // 32):
        writes = []
        for lane in range(32):
            row, segment = skinny_kernel.copy_target(lane, j)
            offset = skinny_kernel.stage_offset(row, segment, token_vectors)
            writes.append(offset)
            assert np.isnan(stage[offset // 2:offset // 2 + 8]).all()
            stage[offset // 2:offset // 2 + 8] = b[row, 8 * segment:8 * segment + 8]
        assert all(bank_conflicts(writes[8 * p:8 * p + 8]) == 0 for p in range(4))
    assert not np.isnan(stage).any()
    token_words = staged_token_words(tiles, token_vectors) if staged else None
    result = np.zeros((cols, 8 * tiles))
    for tile in range(cols // 16):
        d = np.zeros((tiles, 16, 8))
        for step in range(chunk // 16):
            addresses = [skinny_kernel.stage_offset(*skinny_kernel.ldmatrix_row(lane, step, tile, token_vectors),
                                                    token_vectors) for lane in range(32)]
            for i in range(4):  # one phase per 8 x 8 matrix
                assert bank_conflicts(addresses[8 * i:8 * i + 8]) == 0, (tile, step, i)
            regs = ldmatrix_trans(stage, addresses)
            a_mat = np.full((16, 16), np.nan)
            for lane in range(32):
                for register, half in itertools.product(range(4), range(2)):
                    r, col = isa_a(lane, 2 * register + half)
                    a_mat[r, col] = regs[lane][register][half]
            for t in range(tiles):
                b_mat = np.full((16, 8), np.nan)
                for lane in range(32):
                    for register, half in itertools.product(range(2), range(2)):
                        if staged:
                            k, token = skinny_kernel.vector_token_fragments(
                                [token_words[t][lane]])(step)[0][register][half]
                        else:
                            k, token = row_major_token_k(lane, register, half, step, token_vectors), lane // 4
                        kk, col = isa_b(lane, 2 * register + half)
                        assert np.isnan(b_mat[kk, col]) and token == 8 * t + col
                        b_mat[kk, col] = x[token, k]
                d[t] += a_mat @ b_mat
        for lane, i, t in itertools.product(range(32), range(4), range(tiles)):
            row, token = skinny_kernel.c_fragment_target(lane, i)
            result[16 * tile + row, 8 * t + token] = d[t][isa_c(lane, i)]
    np.testing.assert_allclose(result, b.T @ x.T, rtol=1e-12, atol=1e-12)


def check_column_major_b_product(token_words, seed):
    """Column-major B: W's fragments as the kernel loads them (a_fragment_source), the tokens' words
    (token_words[tile][lane][word] = ((k, token), (k, token)) of the word's halves) picked as mma_chunk picks a token
    tile's words; two mma steps per token tile against W @ X^T over the chunk."""
    m_tiles = len(token_words)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 32))
    x = rng.standard_normal((8 * m_tiles, 32))
    d = np.zeros((m_tiles, 16, 8))
    for step in range(2):
        a_mat = np.full((16, 16), np.nan)
        for lane in range(32):
            for register, half in itertools.product(range(4), range(2)):
                row, k = skinny_kernel.a_fragment_source(lane, register, half, step)
                a_mat[isa_a(lane, 2 * register + half)] = w[row, k]
        for t in range(m_tiles):
            b_mat = np.full((16, 8), np.nan)
            for lane in range(32):
                for register, half in itertools.product(range(2), range(2)):
                    word = 2 * step + skinny_kernel.B_REGISTER_WORDS[register]  # mma_chunk's B registers
                    k, token = token_words[t][lane][word][half]
                    kk, col = isa_b(lane, 2 * register + half)
                    assert np.isnan(b_mat[kk, col]) and token == 8 * t + col
                    b_mat[kk, col] = x[token, k]
            d[t] += a_mat @ b_mat
    result = np.zeros((16, 8 * m_tiles))
    for lane, i, t in itertools.product(range(32), range(4), range(m_tiles)):
        row, token = skinny_kernel.c_fragment_target(lane, i)
        result[row, 8 * t + token] = d[t][isa_c(lane, i)]
    np.testing.assert_allclose(result, w @ x.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_column_major_b_staged_tokens_compute_the_product(seed, m_tiles):
    """Staged tokens (cp.async and registers fill the same slots): through the emulated stage in the vector
    order (staged_token_words)."""
    check_column_major_b_product(staged_token_words(m_tiles, vector_order=True), seed)


# ---------------------------------------------------------------------------------------------- movmatrix tokens
def movmatrix_trans(words):
    """Emulate movmatrix.sync.aligned.m8n8.trans.b16: lane l holds row l // 4, columns 2 * (l % 4) + h (h the
    word's half) of an 8 x 8 matrix; it receives the same elements of the transpose, i.e. source row
    2 * (l % 4) + h, column l // 4."""
    source = {(lane // 4, 2 * (lane % 4) + h): words[lane][h] for lane in range(32) for h in range(2)}
    return [tuple(source[2 * (lane % 4) + h, lane // 4] for h in range(2)) for lane in range(32)]


def movmatrix_pair(lane, word, tile, m):
    """(first token, k) of the 32-bit word lane ``lane`` loads for B word ``word`` of token tile ``tile``: the
    kernel's movmatrix_source, clamped past M as load_token_pairs clamps it (min(token, M - 1) & -2)."""
    token, k = skinny_kernel.movmatrix_source(lane, word)
    return min(8 * tile + token, m - 1) & -2, k


def movmatrix_token_words(m):
    """Each token tile's words after the movmatrix path with M = m tokens, as words[tile][lane][word] =
    ((k, token), (k, token)): every lane's loaded pairs (movmatrix_pair) through the emulated transpose."""
    words = []
    for tile in range(-(-m // 8)):
        per_word = []
        for word in range(skinny_config.VECTOR // 2):
            loaded = []
            for lane in range(32):
                first, k = movmatrix_pair(lane, word, tile, m)
                loaded.append(((k, first), (k, first + 1)))
            per_word.append(movmatrix_trans(loaded))
        words.append([[per_word[word][lane] for word in range(skinny_config.VECTOR // 2)] for lane in range(32)])
    return words


def test_movmatrix_lanes_hold_the_vector_words():
    """After the transpose, lane l's word w of token tile t holds token 8t + l // 4 at k 8 * (l % 4) + 2w + {0, 1}:
    what load_tokens' 16-byte vector of K-contiguous tokens gives (b_fragment_source), register by register."""
    words = movmatrix_token_words(16)
    for t, lane in itertools.product(range(2), range(32)):
        assert [words[t][lane][w] for w in range(4)] == [
            tuple((8 * (lane % 4) + 2 * w + h, 8 * t + lane // 4) for h in range(2)) for w in range(4)]
        for step, register, half in itertools.product(range(2), range(2), range(2)):
            k, token = skinny_kernel.b_fragment_source(lane, register, half, step)
            assert words[t][lane][2 * step + skinny_kernel.B_REGISTER_WORDS[register]][half] == (k, 8 * t + token)


def test_movmatrix_source_lanes():
    """Which lane reads which (token, k): lane 4i + p reads tokens 2p, 2p + 1 of the tile at chunk k
    8 * (i // 2) + 2w + i % 2; a warp's load covers 8 k rows, each the tile's 8 tokens (16 contiguous bytes), and
    the four words cover the chunk's 32 k once."""
    rows = collections.Counter()
    for word in range(4):
        reads = {skinny_kernel.movmatrix_source(lane, word) for lane in range(32)}
        assert len(reads) == 32
        ks = {k for _, k in reads}
        assert len(ks) == 8 and all({t for t, kk in reads if kk == k} == {0, 2, 4, 6} for k in ks)
        rows.update(ks)
    assert rows == collections.Counter(range(32))
    assert [skinny_kernel.movmatrix_source(lane, 1) for lane in (0, 1, 4, 9, 31)] == [(0, 2), (2, 2), (0, 3), (2, 10),
                                                                                      (6, 27)]


@pytest.mark.parametrize("m", range(1, 17))
def test_movmatrix_pairs_past_m_stay_in_bounds(m):
    """Every word read starts at an even token below M (an aligned word holding a real token: within the
    allocation), and every lane whose token is below M receives exactly its word (clamping touches only tokens
    past M, whose results are never stored)."""
    for tile, word, lane in itertools.product(range(-(-m // 8)), range(4), range(32)):
        first, _ = movmatrix_pair(lane, word, tile, m)
        assert first % 2 == 0 and 0 <= first < m
    words = movmatrix_token_words(m)
    for tile, lane, word in itertools.product(range(len(words)), range(32), range(4)):
        if 8 * tile + lane // 4 < m:
            assert words[tile][lane][word] == tuple((8 * (lane % 4) + 2 * word + h, 8 * tile + lane // 4)
                                                    for h in range(2))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("m", [8, 16])
def test_column_major_b_movmatrix_tokens_compute_the_product(seed, m):
    check_column_major_b_product(movmatrix_token_words(m), seed)


def test_movmatrix_emulation_catches_a_wrong_source(monkeypatch):
    """Source rows i in another k order (k 8 * (i // 2) + w + 4 * (i % 2): still every k of the chunk once, but a
    lane's word no longer holds the k pair W's fragment has): wrong product."""
    monkeypatch.setattr(skinny_kernel, "movmatrix_source",
                        lambda lane, word: (2 * (lane % 4), 8 * (lane // 8) + word + 4 * (lane // 4 % 2)))
    with pytest.raises(AssertionError):
        test_column_major_b_movmatrix_tokens_compute_the_product(0, 16)


def test_staged_tokens_emulation_catches_the_other_k_order(monkeypatch):
    """Tokens staged in the ISA's k order meet column-major B's vector-ordered W fragments: wrong product (and
    the vector order under row-major B's unpermuted stages: wrong too)."""
    slot_k = skinny_kernel.token_slot_k
    monkeypatch.setattr(skinny_kernel, "token_slot_k", lambda matrix, row, vector_order: slot_k(matrix, row,
                                                                                                  not vector_order))
    with pytest.raises(AssertionError):
        test_column_major_b_staged_tokens_compute_the_product(0, 2)
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, False, True)


def test_staged_tokens_emulation_catches_bank_conflicts(monkeypatch):
    """Without the tile swizzle a copy phase's rows of the two token tiles share banks (right product)."""
    monkeypatch.setattr(skinny_kernel, "token_slot_offset",
                        lambda tile, matrix, row: tile * skinny_config.TOKEN_TILE_BYTES + (8 * matrix + row) * 16)
    staged_token_words(1, True)  # one tile: no conflict either way
    with pytest.raises(AssertionError, match="'copy', 0"):
        staged_token_words(2, True)


def test_token_vectors_give_each_lane_8_consecutive_k():
    """With token_vectors a lane's B fragments over a chunk's two k16 steps are exactly the 8 k of its one
    16-byte vector."""
    for lane in range(32):
        ks = sorted(row_major_token_k(lane, r, h, s, True) for r in range(2) for h in range(2) for s in range(2))
        kq = skinny_kernel.token_vector_k(lane)
        assert ks == list(range(kq, kq + skinny_config.VECTOR))


def test_row_major_emulation_catches_a_wrong_swizzle(monkeypatch):
    """Reading with a different swizzle than the copies wrote breaks the product."""
    writes = skinny_kernel.stage_offset
    monkeypatch.setattr(skinny_kernel, "ldmatrix_row", lambda lane, step, tile, token_vectors=False: (
        16 * step + 8 * (lane // 8 // 2) + lane % 8, 2 * tile + (lane // 8 + 1) % 2))
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, False, False)
    assert writes is skinny_kernel.stage_offset


def test_token_vectors_emulation_catches_the_isa_token_order(monkeypatch):
    """The k-permuted ldmatrix rows with the tokens in the ISA's order (no permutation on their side) pair
    different k: the product is wrong."""
    monkeypatch.setattr(skinny_kernel, "vector_token_fragments", lambda words: lambda step: [
        [(16 * step + 8 * r + 2 * (w[0][0] // 8), 16 * step + 8 * r + 2 * (w[0][0] // 8) + 1) for r in range(2)]
        for w in words])
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, True, False)


def test_token_vectors_emulation_catches_bank_conflicts(monkeypatch):
    """The k-permuted rows (c + {0, 1, 8, 9, 16, 17, 24, 25}) under the row % 8 swizzle: right product, but
    pairs of rows share banks."""
    monkeypatch.setattr(skinny_kernel, "segment_swizzle", lambda row, token_vectors: row % 8)
    with pytest.raises(AssertionError, match=r"\(0, 0, 0\)"):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, True, False)


# ---------------------------------------------------------------------------------------------- compilation
def check_sass(kernel, m, config=SkinnyConfig()):
    ops = kernel.sass_opcodes()
    hmma = sum(n for op, n in ops.items() if op.startswith("HMMA.16816.F32"))
    assert hmma > 0, sorted(ops)
    # the streamed weight: 16-byte loads that bypass L1
    assert sum(n for op, n in ops.items() if op.startswith("LDG.E.NA") and ".128" in op) >= 8, sorted(ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    r = kernel.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0
    assert r.registers <= 128  # 16 warps per SM at least: occupancy keeps the weight loads in flight
    assert not kernel.warnings, kernel.warnings
    # two k16 steps per chunk and token tile, in the unrolled loop and the remainder loop
    tiles = -(-m // 8)
    assert hmma >= 2 * tiles * (config.unroll + 1)


@pytest.mark.sweep
@pytest.mark.parametrize("dtype", [nvfly.bf16, nvfly.f16])
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu_f32", "scaled_silu"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("row_b", [False, True], ids=["colB", "rowB"])
def test_kernel_compiles_without_spills(dtype, m, epilogue, splits, row_b):
    options = {"plain": {}, "bias_gelu_f32": dict(has_c=True, activation="gelu_tanh", out_dtype=nvfly.f32),
               "scaled_silu": dict(scaled=True, activation="silu", has_c=True)}[epilogue]
    base = skinny_plan.ROW_B_CONFIG if row_b else SkinnyConfig()
    config = SkinnyConfig(base.warps, base.unroll, splits)
    kernel = skinny_plan.compile_kernel(m, dtype=dtype, config=config, row_b=row_b, **options)
    (check_row_b_sass if row_b else check_sass)(kernel, m, config)
    hmma = {op for op in kernel.sass_opcodes() if op.startswith("HMMA")}
    assert hmma == ({"HMMA.16816.F32.BF16"} if dtype == nvfly.bf16 else {"HMMA.16816.F32"})  # f16 has no suffix
    # split K: partial sums go out with atomics, and one arrival per CTA
    assert (kernel.count("REDG") > 0 and kernel.count("ATOMG") > 0) == (splits > 1)


@pytest.mark.parametrize("m,config", [(16, SkinnyConfig(4, 2)), (1, SkinnyConfig(8, 8)), (16, SkinnyConfig(16, 4, 2)),
                                      (8, SkinnyConfig(2, 4, 3))])
def test_other_configs_compile(m, config):
    check_sass(skinny_plan.compile_kernel(m, config=config), m, config)


def check_row_b_sass(kernel, m, config):
    ops = kernel.sass_opcodes()
    tiles = -(-m // 8)
    # per chunk: 4 column tiles x 2 k16 steps x token tiles mmas, one ldmatrix.x4.trans per tile and step, and
    # 8 16-byte cp.async per lane (the prologue's STAGES - 1 chunks and the loop's one)
    assert sum(n for op, n in ops.items() if op.startswith("HMMA.16816.F32")) >= 8 * tiles, sorted(ops)
    assert ops["LDSM.16.MT88.4"] >= 8, sorted(ops)
    assert ops["LDGSTS.E.BYPASS.128"] >= 8 * config.unroll, sorted(ops)
    assert kernel.count("LDGDEPBAR") >= 1 and kernel.count("DEPBAR.LE") >= 1
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    r = kernel.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0
    assert r.registers <= 128
    assert not kernel.warnings, kernel.warnings


@pytest.mark.parametrize("m,config", [(16, SkinnyConfig(8, 4)), (1, SkinnyConfig(4, 8)), (16, SkinnyConfig(2, 2, 3)),
                                      (9, SkinnyConfig(16, 3, 2))])
def test_row_major_b_other_configs_compile(m, config):
    check_row_b_sass(skinny_plan.compile_kernel(m, config=config, row_b=True), m, config)
    check_row_b_sass(skinny_plan.compile_kernel(m, config=config, row_b=True, x_contiguous=False), m, config)


def test_strided_tokens_compile():
    kernel = skinny_plan.compile_kernel(7, x_contiguous=False)
    assert kernel.count("HMMA") > 0 and kernel.resources.spill_stores == 0


# ---------------------------------------------------------------------------------------------- token vectors
SASS_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]+)([^;]*);")


def main_loop(kernel):
    """(opcode counts, chunks per trip) of the kernel's main loop: the longest backward branch over HMMAs (the
    arms it branches over included); one cp.async commit group (LDGDEPBAR) per chunk."""
    lines = [(int(address, 16), op, args) for address, op, args in SASS_INSTRUCTION.findall(kernel.sass())]
    loops = []
    for address, op, args in lines:
        target = re.match(r"\s*0x([0-9a-f]+)", args)
        if op == "BRA" and target and int(target.group(1), 16) < address:
            body = [o for a, o, _ in lines if int(target.group(1), 16) <= a <= address]
            if any(o.startswith("HMMA") for o in body):
                loops.append(body)
    ops = collections.Counter(max(loops, key=len))
    return ops, ops["LDGDEPBAR"]


def token_loads(ops):
    """The global loads other than the weight's cp.async (LDGSTS): in the main loop, the tokens'."""
    return {op: n for op, n in ops.items() if op.startswith("LDG.")}


def check_token_vectors_sass(kernel, m):
    """16-byte token loads (each token tile's 8 k a lane per chunk, and the masked ones of the chunk holding K's
    end), and no 16-bit global load anywhere (the plain epilogue loads nothing else)."""
    ops = kernel.sass_opcodes()
    assert sum(n for op, n in ops.items() if op.startswith("LDG.E.128")) >= 2 * -(-m // 8), sorted(ops)
    assert not any(op.startswith("LDG.E.U16") for op in ops), sorted(ops)


CHECKED_CUBINS = set()


def check_token_vectors_kernel(kernel, m, config):
    """check_row_b_sass and check_token_vectors_sass, once per distinct cubin (disassembly is slow)."""
    if kernel.cubin not in CHECKED_CUBINS:
        check_row_b_sass(kernel, m, config)
        check_token_vectors_sass(kernel, m)
        CHECKED_CUBINS.add(kernel.cubin)


@pytest.mark.parametrize("m", [1])  # M = 16: test_benchmark_sweep_compiles_and_fits_a_launch[rowxrow-token-vectors]
def test_row_major_token_vectors_compile_for_every_benchmark_config(m, config_sample):
    """Every row-major-B config of the benchmark sweep with token_vectors on, at K = 4096 (token rows 16-byte
    aligned, as gemm.eligibility requires): no spills or stack (ptxas; so no LDL/STL), 16-byte token loads and no
    16-bit ones in the PTX, and the SASS checks once per distinct cubin. With the sweep test's M = 16 every
    distinct kernel is covered: it depends on M through its token tiles only (1 and 8 alike, 9 and 16 alike), on
    K's row stride through its 16-byte alignment only."""
    configs = [cfg for cfg in bench.sweep(True, token_vectors=True)[0] if cfg.token_vectors]
    assert len(configs) == len(bench.ROW_B_CONFIGS) - 6  # 8 warps x 8 stages do not fit
    for cfg in config_sample(configs, pairs=True):  # every config under --run-slow
        k = 4096
        kernel = skinny_plan.compile_kernel(m, k, config=cfg, row_b=True)
        r = kernel.resources
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 128, (cfg, k, r)
        assert not kernel.warnings, kernel.warnings
        assert kernel.ptx.count("ld.global.v4.b32") >= 2 * -(-m // 8) and "ld.global.b16" not in kernel.ptx
        check_token_vectors_kernel(kernel, m, cfg)


def test_row_major_token_vectors_main_loop_at_m16():
    """The main loop at M = 16 (default ring, split K): with token_vectors, two chunks a trip, each token tile
    one 16-byte load per chunk and no PRMT; without, as before: 16 16-bit token loads a chunk, packed by PRMT."""
    config = SkinnyConfig(4, 4, 4)
    on_ops, on_chunks = main_loop(skinny_plan.compile_kernel(16, config=dataclasses.replace(config, token_vectors=True),
                                                             row_b=True))
    off_ops, off_chunks = main_loop(skinny_plan.compile_kernel(16, config=config, row_b=True))
    assert (on_chunks, off_chunks) == (2, 1)
    assert on_ops["LDSM.16.MT88.4"] == 8 * on_chunks and on_ops["HMMA.16816.F32.BF16"] == 16 * on_chunks
    loads = token_loads(on_ops)
    assert all(op.startswith("LDG.E.128") for op in loads), loads
    assert sum(loads.values()) >= 2 * on_chunks  # the masked arm for K's end may hold its own
    assert on_ops["PRMT"] == 0
    assert token_loads(off_ops) == {"LDG.E.U16": 16} and off_ops["PRMT"] >= 16
    assert sum(on_ops.values()) / on_chunks < sum(off_ops.values())


def test_token_vectors_is_part_of_the_compile_key():
    config = SkinnyConfig(4, 4, 4)
    off = skinny_plan.compile_kernel(16, config=config, row_b=True)
    on = skinny_plan.compile_kernel(16, config=dataclasses.replace(config, token_vectors=True), row_b=True)
    assert on.key != off.key and on.ptx != off.ptx


@pytest.mark.parametrize("k,x_contiguous", [(4097, True), (4096, False)], ids=["odd_row_stride", "column_major"])
def test_token_vectors_fall_back_to_pairs(k, x_contiguous):
    """Token rows the kernel can neither read as aligned 16-byte vectors nor stage (an odd row stride;
    column-major tokens with an odd k stride): the option leaves the code as it is without it."""
    options = dict(k=k, x_contiguous=x_contiguous, row_b=True, x_k_stride=17)
    on = skinny_plan.compile_kernel(16, config=SkinnyConfig(4, 4, 4, token_vectors=True), **options)
    assert on.ptx == skinny_plan.compile_kernel(16, config=SkinnyConfig(4, 4, 4), **options).ptx
    assert on.count("LDG.E.U16") > 0


def test_token_vectors_is_a_row_major_b_option():
    config = SkinnyConfig(4, 4, 2, token_vectors=True)
    assert config.check(row_b=True) is None
    assert "row-major-B" in config.check(row_b=False)
    with pytest.raises(ValueError, match="token_vectors"):
        skinny_plan.make_plan(16, 4096, 4096, 1, False, "none", False, SkinnyConfig(token_vectors=True), 132)
    plan = skinny_plan.make_plan(16, 4096, 4096, 1, False, "none", False, config, 132, row_b=True)
    assert plan.config == config  # kept through planning
    assert skinny_plan.default_config(16, 4096, 4096, 1, 132, row_b=True).token_vectors  # on by default


def test_row_major_splits_shrink_with_more_token_tiles():
    """The row-B split rule at the swept decode shapes (132 SMs, 64 column groups): 4 splits at M = 1, K = 4096,
    1 at M = 16 (each split reduces 16 rows), 3 at M = 16, K = 14336."""
    splits = {(m, k): skinny_plan.default_config(m, 4096, k, 1, 132, row_b=True).splits
              for m, k in ((1, 4096), (16, 4096), (16, 14336))}
    assert splits == {(1, 4096): 4, (16, 4096): 1, (16, 14336): 3}


# ---------------------------------------------------------------------------------------------- column-major tokens
def fake_tokens(k_stride, align=16, token_stride=1):
    """What token_path reads of a batch's traced tokens x [M, K]: strides (static ints, or a dynamic one with the
    power-of-two divisor the specialisation proves), dtype and base alignment."""
    stride = k_stride if isinstance(k_stride, int) else types.SimpleNamespace(divisor=k_stride[0])
    token_stride = token_stride if isinstance(token_stride, int) else types.SimpleNamespace(divisor=token_stride[0])
    return types.SimpleNamespace(stride=(token_stride, stride), dtype=nvfly.bf16, align=align)


def column_config(path, warps=8, unroll=4, splits=2):
    return SkinnyConfig(warps, unroll, splits, column_tokens=path)


def test_column_b_kernel_reads_column_major_tokens_through_registers_by_default():
    """The heuristic's config takes COLUMN_B_TOKENS (measured fastest); an explicit SkinnyConfig keeps the loads
    unless it names a path (row-major B declines any other value)."""
    x = fake_tokens((16,))
    assert skinny_kernel.tokens_stageable(x) and skinny_kernel.token_pairs_loadable(x)
    assert skinny_plan.COLUMN_B_TOKENS == "registers" and SkinnyConfig().column_tokens == "loads"
    assert skinny_plan.default_config(16, 4096, 4096, 1, 132).column_tokens == skinny_plan.COLUMN_B_TOKENS
    assert skinny_plan.default_config(16, 4096, 4096, 1, 132, row_b=True).column_tokens == "loads"
    assert skinny_kernel.token_path(x, skinny_plan.default_config(16, 4096, 4096, 1, 132), 2, False) == "registers"
    assert skinny_kernel.token_path(x, SkinnyConfig(8, 4, 2), 2, False) == "loads"
    assert skinny_kernel.token_path(x, SkinnyConfig(8, 4, 2), 2, True) == "cp.async"  # row-major B stages them


def test_which_tokens_take_which_path():
    """Staged (cp.async, registers): tokens contiguous with a k stride of whole 16-byte rows and a 16-byte aligned
    base, when the stages fit the CTA's shared memory; movmatrix: tokens contiguous, an even k stride and a 4-byte
    aligned base; the rest (row-major tokens, other strides, too many stages) keep the loads."""
    stageable, pairs = skinny_kernel.tokens_stageable, skinny_kernel.token_pairs_loadable
    assert stageable(fake_tokens((16,))) and stageable(fake_tokens((8,))) and stageable(fake_tokens(0))
    assert not stageable(fake_tokens((4,)))  # e.g. M = 12 = K's stride: 24-byte rows
    assert not stageable(fake_tokens((16,), align=8))
    assert not stageable(fake_tokens(1, token_stride=(16,)))  # row-major tokens
    assert not stageable(fake_tokens(1))  # M = 1 column-major: K-contiguous, read as vectors
    assert pairs(fake_tokens((4,))) and pairs(fake_tokens((2,), align=4)) and pairs(fake_tokens(12, align=4))
    assert not pairs(fake_tokens(17)) and not pairs(fake_tokens(1)) and not pairs(fake_tokens((16,), align=2))
    assert not pairs(fake_tokens(1, token_stride=(16,)))
    x = fake_tokens((16,))
    for path in skinny_config.STAGED_TOKENS:
        assert skinny_kernel.token_path(x, column_config(path), 2, False) == path
        assert skinny_kernel.token_path(x, column_config(path, 32, 8), 1, False) == path
        assert skinny_kernel.token_path(x, column_config(path, 32, 8), 2, False) == "loads"  # 256 x 1 KB
        assert skinny_kernel.token_path(fake_tokens((4,)), column_config(path), 1, False) == "loads"
    assert skinny_kernel.token_path(x, SkinnyConfig(8, 6, 2), 1, True) == "cp.async"  # 48 x (4 + 0.5) KB of stages
    assert skinny_kernel.token_path(x, SkinnyConfig(8, 6, 2), 2, True) == "loads"  # 48 x 5 KB: past 227 KB
    assert skinny_kernel.token_path(fake_tokens((4,)), column_config("movmatrix"), 2, False) == "movmatrix"
    assert skinny_kernel.token_path(fake_tokens(17), column_config("movmatrix"), 2, False) == "loads"
    assert skinny_kernel.token_path(fake_tokens(1, token_stride=(16,)), column_config("movmatrix"), 2, False) == "loads"


@pytest.mark.parametrize("config,why", [
    (column_config("shared"), "one of 'loads', 'cp.async', 'registers', 'movmatrix'"),
    (column_config("cp.async", 32, 16), "262160 bytes of shared memory"),
    (column_config("registers", 32, 16), "262160 bytes of shared memory")])
def test_column_tokens_check_declines_with_a_reason(config, why):
    assert why in config.check()
    with pytest.raises(ValueError, match="column_tokens"):
        skinny_plan.make_plan(16, 4096, 4096, 1, False, "none", False, config, 132)
    assert column_config("movmatrix", 32, 16).check() is None  # no shared memory
    assert column_config("registers", 32, 14).check() is None  # 448 token tiles of 512 bytes + the arrival count


@pytest.mark.parametrize("path", ["cp.async", "registers", "movmatrix"])
def test_column_tokens_is_a_column_major_b_option(path):
    assert "column-major-B" in column_config(path).check(row_b=True)
    with pytest.raises(ValueError, match="column_tokens"):
        skinny_plan.make_plan(16, 4096, 4096, 1, False, "none", False, column_config(path, 4), 132, row_b=True)
    plan = skinny_plan.make_plan(16, 4096, 4096, 1, False, "none", False, column_config(path), 132)
    assert plan.config.column_tokens == path  # kept through planning


# (row-major B, config) per kernel variant with staged tokens: the committed row-B default and the token_vectors
# one, and column-major B's two staged paths
STAGED_VARIANTS = {"colB-cp.async": (False, column_config("cp.async")),
                   "colB-registers": (False, column_config("registers")),
                   "rowB": (True, SkinnyConfig(4, 4)),
                   "rowB-token-vectors": (True, SkinnyConfig(8, 2, 3, token_vectors=True))}


def check_column_tokens_kernel(kernel):
    """No spills, stack or local memory, at most 128 registers, no ptxas warnings, and no 16-bit global load
    anywhere (the chunk holding K's end is handled by the path too)."""
    ops = kernel.sass_opcodes()
    r = kernel.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 128, r
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    assert not kernel.warnings, kernel.warnings
    assert not any(op.startswith("LDG.E.U16") for op in ops), sorted(ops)


@pytest.mark.sweep
@pytest.mark.parametrize("k", [4096, 4100])
@pytest.mark.parametrize("m", [1, 2, 8, 12, 16])
@pytest.mark.parametrize("variant", list(STAGED_VARIANTS))
def test_column_major_tokens_are_staged(variant, m, k):
    """Column-major tokens (k stride 8 or 16 tokens: 16-byte rows; M = 1 in a padded column), K with and without
    a tail: check_column_tokens_kernel, all shared memory dynamic and as planned, and in the main loop the tokens
    arrive by 16-byte copies (one per token tile and chunk; cp.async, beside B's 8 with row-major B, or a vector
    load and st.shared) and ldmatrix.trans (one x4 per token tile and chunk), with no PRMT."""
    row_b, config = STAGED_VARIANTS[variant]
    tiles = -(-m // 8)
    kernel = skinny_plan.compile_kernel(m, k, config=config, row_b=row_b, x_contiguous=False, x_k_stride=8 * tiles)
    check_column_tokens_kernel(kernel)
    assert kernel.resources.static_smem_bytes == 0
    assert kernel.dynamic_smem_bytes == (skinny_config.row_b_smem_bytes(config, tiles) if row_b else
                                         skinny_config.column_b_staged_smem_bytes(config, tiles))
    loop, _ = main_loop(kernel)
    chunks = sum(n for op, n in loop.items() if op.startswith("HMMA")) // (2 * tiles * (4 if row_b else 1))
    assert chunks == (1 if row_b else config.unroll)  # one ring stage a trip; one load group a trip
    b_copies = skinny_config.CHUNK_BYTES // 16 // 32 if row_b else 0
    registers = config.column_tokens == "registers"
    assert loop["LDGSTS.E.BYPASS.128"] == (b_copies + (0 if registers else tiles)) * chunks, sorted(loop.items())
    assert loop["LDSM.16.MT88.4"] == ((8 if row_b else 0) + tiles) * chunks, sorted(loop.items())
    assert loop["STS.128"] == (tiles * chunks if registers else 0), sorted(loop.items())
    global_loads = token_loads(loop)
    if row_b:
        assert global_loads == {}, global_loads
    else:  # W's two 16-byte streaming loads per chunk, and the registers path's 16-byte token loads
        assert sum(n for op, n in global_loads.items() if op.startswith("LDG.E.NA") and ".128" in op) == 2 * chunks
        assert global_loads.get("LDG.E.128", 0) == (tiles * chunks if registers else 0), global_loads
        assert sum(global_loads.values()) == (2 + (tiles if registers else 0)) * chunks, global_loads
    assert loop["PRMT"] == 0


@pytest.mark.sweep
@pytest.mark.parametrize("k", [4096, 4100])
@pytest.mark.parametrize("m", [1, 2, 8, 12, 16])
def test_column_major_tokens_by_movmatrix(m, k):
    """The movmatrix path, column-major tokens with an even k stride (16-byte rows as matmul makes them, and M = 12
    in 12-token columns: 24-byte rows, not stageable), K with and without a tail: check_column_tokens_kernel, no
    shared memory beyond the plain kernel's, and in the main loop per chunk and token tile four 32-bit token
    loads and four MOVM, beside W's two 16-byte loads; no ldmatrix, cp.async or PRMT."""
    tiles = -(-m // 8)
    config = column_config("movmatrix")
    for k_stride in {8 * tiles, m + m % 2}:
        kernel = skinny_plan.compile_kernel(m, k, config=config, x_contiguous=False, x_k_stride=k_stride)
        check_column_tokens_kernel(kernel)
        assert kernel.dynamic_smem_bytes == 0
        assert kernel.resources.static_smem_bytes == \
            skinny_plan.compile_kernel(m, k, config=column_config("loads"), x_contiguous=False,
                                       x_k_stride=k_stride).resources.static_smem_bytes
        loop, _ = main_loop(kernel)
        chunks = sum(n for op, n in loop.items() if op.startswith("HMMA")) // (2 * tiles)
        assert chunks == config.unroll
        assert loop["MOVM.16.MT88"] == 4 * tiles * chunks, sorted(loop.items())
        assert token_loads(loop) == {"LDG.E": 4 * tiles * chunks, "LDG.E.NA.LTC256B.128.CONSTANT": 2 * chunks}
        assert not any(op.startswith(("LDSM", "LDGSTS", "PRMT")) for op in loop), sorted(loop.items())


@pytest.mark.parametrize("m", [2, 8, 12, 16])
@pytest.mark.parametrize("path", skinny_config.COLUMN_TOKENS)
def test_every_column_token_path_compiles(path, m):
    """Each path at K = 4100 (a tail) with column-major tokens in 16-byte rows, under other configs (one chunk a
    group, split K; 16 warps x 8 chunks): check_column_tokens_kernel, and SASS with what the path uses: LDSM
    for the staged paths, MOVM for movmatrix, 16-bit token loads only for loads."""
    tiles = -(-m // 8)
    for config in (column_config(path, 4, 1, 3), column_config(path, 16, 8, 1)):
        kernel = skinny_plan.compile_kernel(m, 4100, config=config, x_contiguous=False, x_k_stride=8 * tiles)
        ops = kernel.sass_opcodes()
        if path == "loads":
            assert ops["LDG.E.U16"] > 0 and "LDSM.16.MT88.4" not in ops and "MOVM.16.MT88" not in ops
            r = kernel.resources
            assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 128, r
            continue
        check_column_tokens_kernel(kernel)
        assert (ops["LDSM.16.MT88.4"] > 0) == (path in skinny_config.STAGED_TOKENS), sorted(ops)
        assert (ops["MOVM.16.MT88"] > 0) == (path == "movmatrix"), sorted(ops)
        assert (ops["LDGSTS.E.BYPASS.128"] > 0) == (path == "cp.async"), sorted(ops)
        assert ops["HMMA.16816.F32.BF16"] >= 2 * tiles * (config.unroll + 1)


@pytest.mark.parametrize("path", ["cp.async", "registers", "movmatrix"])
def test_tokens_a_path_cannot_take_keep_their_loads(path):
    """Column-major tokens with an odd k stride, K-contiguous tokens, and (staged paths) 12-token columns
    (24-byte rows): the kernel is the loads path's, byte for byte."""
    cases = [dict(x_contiguous=False, x_k_stride=17), dict(x_contiguous=True)]
    if path != "movmatrix":
        cases.append(dict(x_contiguous=False, x_k_stride=12))
    for options in cases:
        kernel = skinny_plan.compile_kernel(12, 4100, config=column_config(path), **options)
        assert kernel.ptx == skinny_plan.compile_kernel(12, 4100, config=column_config("loads"), **options).ptx
        assert kernel.dynamic_smem_bytes == 0


def test_row_major_b_tokens_that_cannot_be_staged_keep_their_loads():
    """Row-major B: column-major tokens with an odd k stride, and stages past 227 KB with 16 tokens: the 16-bit
    token loads as before, and no token stages in shared memory."""
    odd = skinny_plan.compile_kernel(16, config=SkinnyConfig(4, 4), row_b=True, x_contiguous=False, x_k_stride=17)
    assert odd.count("LDG.E.U16") > 0 and odd.dynamic_smem_bytes == skinny_config.row_b_smem_bytes(SkinnyConfig(4, 4))
    config = SkinnyConfig(8, 6, 2)
    big = skinny_plan.compile_kernel(16, config=config, row_b=True, x_contiguous=False)
    assert big.count("LDG.E.U16") > 0 and big.dynamic_smem_bytes == skinny_config.row_b_smem_bytes(config)


def test_token_paths_are_part_of_the_compile_key():
    """column_tokens is a field of CFG, so each path is its own kernel (a module constant flipped at run time would
    not be in the key); the row-major-B choice follows x's specialisation (k stride divisible by 8 or not)."""
    options = dict(x_contiguous=False, x_k_stride=16)
    kernels = {path: skinny_plan.compile_kernel(16, config=column_config(path), **options)
               for path in skinny_config.COLUMN_TOKENS}
    assert len({kernel.key for kernel in kernels.values()}) == len(skinny_config.COLUMN_TOKENS)
    assert "cp.async" in kernels["cp.async"].ptx and "st.shared.v4" in kernels["registers"].ptx
    assert "movmatrix" in kernels["movmatrix"].ptx and "ldmatrix" not in kernels["loads"].ptx
    for config, row_b in ((SkinnyConfig(4, 4), True), (column_config("registers"), False)):
        staged = skinny_plan.compile_kernel(16, config=config, row_b=row_b, **options)
        loaded = skinny_plan.compile_kernel(16, config=config, row_b=row_b, x_contiguous=False, x_k_stride=20)
        assert staged.key != loaded.key and staged.count("LDSM") > 0 and loaded.count("LDG.E.U16") > 0


# ---------------------------------------------------------------------------------------------- planning
def weight(n, k, major):
    """A [K, N] B operand: 'col' is the F.linear weight (W [N, K] row-major, transposed)."""
    return torch.randn(n, k).to(torch.bfloat16).t() if major == "col" else torch.randn(k, n).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 64])
@pytest.mark.parametrize("major", ["col", "row"])
def test_skinny_path_for_small_m(m, major):
    a = torch.randn(m, 4096).to(torch.bfloat16)
    b = weight(4096, 4096, major)
    assert gemm.plan.skinny_wanted(a, b, None, None) == (m <= (gemm.plan.SKINNY_MAX_M if major == "col" else
                                                          gemm.plan.SKINNY_MAX_M_ROW_B))
    assert not gemm.plan.skinny_wanted(a, b, None, False)
    assert not gemm.plan.skinny_wanted(a, b, gemm.GemmConfig(), None)
    assert skinny_plan.b_major(b) == major  # which variant _new_plan plans (row_b=True for "row")
    if m <= skinny_config.MAX_M:
        assert gemm.plan.skinny_wanted(a, b, SkinnyConfig(), None) and gemm.plan.skinny_wanted(a, b, None, True)
    else:
        with pytest.raises(ValueError, match="skinny"):
            gemm.plan.skinny_wanted(a, b, None, True)


def test_row_major_b_takes_the_skinny_kernel_for_fewer_tokens(monkeypatch):
    """8 row-major tokens: the skinny kernel with the F.linear weight, the wgmma kernel with a row-major B
    (unless forced); at most SKINNY_MAX_M_ROW_B tokens take the skinny kernel with either, and 0 switches the
    row-major B variant off."""
    a = torch.randn(8, 4096).to(torch.bfloat16)
    assert gemm.plan.SKINNY_MAX_M_ROW_B < 8 <= gemm.plan.SKINNY_MAX_M
    assert not gemm.plan.skinny_wanted(a, weight(4096, 4096, "row"), None, None)
    assert gemm.plan.skinny_wanted(a, weight(4096, 4096, "col"), None, None)
    assert gemm.plan.skinny_wanted(a, weight(4096, 4096, "row"), None, True)
    few = torch.randn(gemm.plan.SKINNY_MAX_M_ROW_B, 4096).to(torch.bfloat16)
    assert gemm.plan.skinny_wanted(few, weight(4096, 4096, "row"), None, None)
    monkeypatch.setattr(gemm.plan, "SKINNY_MAX_M_ROW_B", 0)
    assert not gemm.plan.skinny_wanted(few, weight(4096, 4096, "row"), None, None)


def test_unaligned_row_major_b_is_declined():
    a = torch.randn(4, 64).to(torch.bfloat16)
    assert "multiple of 8" in skinny_plan.reason(a, torch.randn(64, 33).to(torch.bfloat16))
    assert "16-byte" in skinny_plan.reason(a, torch.randn(64, 1028).to(torch.bfloat16)[:, :1020][:, :1016][:, :1016]
                                           .as_strided((64, 1016), (1020, 1)))
    assert skinny_plan.reason(a, torch.randn(64, 1032).to(torch.bfloat16)[:, :1000]) is None  # N tail, padded rows
    assert not gemm.plan.skinny_wanted(a, torch.randn(64, 33).to(torch.bfloat16), None, None)
    with pytest.raises(ValueError, match="skinny"):
        gemm.plan.skinny_wanted(a, torch.randn(64, 33).to(torch.bfloat16), None, True)


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (16, 4096, 14336), (8, 40, 4104), (1, 8, 8), (16, 4104, 1023)])
def test_row_major_plans_cover_k_exactly(mnk):
    m, n, k = mnk
    plan = skinny_plan.make_plan(m, n, k, 1, False, "none", False, None, 132, row_b=True)
    cfg = plan.config
    chunks = -(-k // skinny_config.CHUNK_K)
    assert plan.row_b and plan.tile_slots == skinny_config.COLS_ROW_B * skinny_config.MAX_M
    assert (cfg.splits - 1) * plan.chunks_per_split < chunks <= cfg.splits * plan.chunks_per_split
    assert plan.grid == (-(-n // 64) * cfg.splits, 1, 1) and plan.tiles == -(-n // 64)
    assert cfg.splits == 1 or plan.grid[0] <= skinny_plan.TARGET_CTAS_PER_SM * 132
    with pytest.raises(ValueError, match="shared memory"):
        skinny_plan.make_plan(m, n, k, 1, False, "none", False, SkinnyConfig(32, 8), 132, row_b=True)


def test_unaligned_weight_rows_are_declined():
    b = torch.randn(64, 1028).to(torch.bfloat16)[:, :1020].t()  # row stride 1028: 8-byte rows only
    assert "16-byte" in skinny_plan.reason(torch.randn(1, 1020).to(torch.bfloat16), b)
    padded = torch.randn(64, 1024).to(torch.bfloat16)[:, :1023].t()  # K tail, 16-byte aligned rows
    assert skinny_plan.reason(torch.randn(1, 1023).to(torch.bfloat16), padded) is None


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (16, 4096, 14336), (8, 33, 4104), (1, 1, 8), (16, 4097, 1023)])
def test_plans_cover_k_exactly(mnk):
    m, n, k = mnk
    plan = skinny_plan.make_plan(m, n, k, 1, False, "none", False, None, 132)
    cfg = plan.config
    full = k // skinny_config.CHUNK_K
    assert plan.chunks_per_split % cfg.unroll == 0
    assert (cfg.splits - 1) * plan.chunks_per_split < max(full, 1) <= cfg.splits * plan.chunks_per_split
    assert plan.grid == (-(-n // 16) * cfg.splits, 1, 1) and plan.m_tiles == -(-m // 8)
    assert plan.tiles == -(-n // 16)


def test_few_column_groups_split_k_up_to_one_wave():
    sms = 132
    for n, k in ((4096, 4096), (4096, 14336), (1024, 4096), (33, 4104), (65536, 4096), (1, 8)):
        cfg = skinny_plan.default_config(16, n, k, 1, sms)
        ctas = -(-n // 16) * cfg.splits
        assert cfg.splits == 1 or ctas <= skinny_plan.TARGET_CTAS_PER_SM * sms, (n, k, cfg)
    assert skinny_plan.default_config(16, 1024, 4096, 1, sms).splits == 2  # 64 groups, 128 chunks
    assert skinny_plan.default_config(16, 33, 4104, 1, sms).splits > 1
    assert skinny_plan.default_config(16, 65536, 4096, 1, sms).splits == 1


# ---------------------------------------------------------------------------------------------- launch limits
# what cuLaunchKernel accepts (sm_90), with the runtime's opt-in rule (runtime.driver.smem_opt_in: past 48 KB of
# static plus dynamic shared memory LoadedFunction sets CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, up to 227 KB)
def launch_problem(kernel, grid):
    """None when a launch of ``kernel`` on ``grid`` fits the device's limits, else why not."""
    static, dynamic = kernel.resources.static_smem_bytes, kernel.dynamic_smem_bytes
    limit = skinny_config.MAX_SMEM if driver.smem_opt_in(static, dynamic) else driver.DEFAULT_SMEM_BYTES
    if static + dynamic > limit:
        return f"{static} static + {dynamic} dynamic bytes of shared memory exceed {limit}"
    if kernel.threads > 1024 or kernel.resources.registers * kernel.threads > 65536:
        return f"{kernel.threads} threads x {kernel.resources.registers} registers"
    if not (1 <= grid[0] < 2 ** 31 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535):
        return f"grid {grid}"
    return None


def test_launch_problem_counts_static_shared_memory():
    """An H200 failure of the row-major-B sweep (CUDA_ERROR_INVALID_VALUE at launch): exactly 48 KB of dynamic
    shared memory plus the split-K arrival flag's 1 KB of static, when the runtime opted in by the dynamic size
    alone. It now counts both (driver.smem_opt_in), and so does this model of the launch."""
    def fake(static, dynamic, registers=115, threads=128):
        return types.SimpleNamespace(resources=types.SimpleNamespace(static_smem_bytes=static, registers=registers),
                                     dynamic_smem_bytes=dynamic, threads=threads)
    assert launch_problem(fake(0, 48 * 1024), (64, 1, 1)) is None
    assert not driver.smem_opt_in(0, 48 * 1024) and driver.smem_opt_in(1024, 48 * 1024)
    assert launch_problem(fake(1024, 48 * 1024), (64, 1, 1)) is None  # opted in by static + dynamic
    assert launch_problem(fake(1024, 226 * 1024), (64, 1, 1)) is None
    assert "exceed 232448" in launch_problem(fake(1024, 227 * 1024), (64, 1, 1))
    assert "registers" in launch_problem(fake(0, 0, 255, 512), (1, 1, 1))
    assert "grid" in launch_problem(fake(0, 0), (1, 65536, 1))


@pytest.mark.parametrize("config", [SkinnyConfig(2, 6, 2), SkinnyConfig(4, 3, 3), SkinnyConfig(4, 4, 2),
                                    SkinnyConfig(2, 6, 1), SkinnyConfig(8, 6, 8)])
def test_row_major_b_shared_memory_is_all_dynamic(config):
    """The row-major-B kernel has no static shared memory (the split-K arrival flag lives after the rings), so
    the dynamic size the runtime sees is all the CTA asks for; at 48 KB of rings the split-K flag takes the
    kernel past 48 KB and the runtime opts in."""
    kernel = skinny_plan.compile_kernel(16, config=config, row_b=True)
    assert kernel.resources.static_smem_bytes == 0
    assert kernel.dynamic_smem_bytes == skinny_config.row_b_smem_bytes(config)
    assert skinny_config.row_b_smem_bytes(config) == config.warps * config.unroll * skinny_config.CHUNK_BYTES + \
        (skinny_config.ARRIVAL_BYTES if config.splits > 1 else 0)
    assert launch_problem(kernel, (64, 1, 1)) is None
    # the split-K path still counts its arrivals and reads the flag back from shared memory
    assert (kernel.count("ATOMG") > 0) == (config.splits > 1)


@pytest.mark.parametrize("config,why", [
    (SkinnyConfig(8, 8), "262144 bytes of shared memory"), (SkinnyConfig(8, 8, 4), "262160 bytes of shared memory"),
    (SkinnyConfig(32, 2), "shared memory"), (SkinnyConfig(4, 1), "at least 2 stages"),
    (SkinnyConfig(0, 4), "warps=0"), (SkinnyConfig(4, 17), "unroll=17"), (SkinnyConfig(4, 4, 0), "splits=0")])
def test_row_major_b_check_declines_with_a_reason(config, why):
    assert why in config.check(row_b=True)
    with pytest.raises(ValueError, match=r"config=SkinnyConfig\(.*" + why.replace("(", r"\(").replace(")", r"\)")):
        skinny_plan.make_plan(1, 4096, 4096, 1, False, "none", False, config, 132, row_b=True)
    # the largest rings that fit: 56 stages per CTA (with the split-K flag)
    assert SkinnyConfig(8, 7, 2).check(row_b=True) is None and SkinnyConfig(14, 4, 2).check(row_b=True) is None
    assert SkinnyConfig(8, 8).check(row_b=False) is None  # column-major B has no ring


@pytest.fixture
def matmul_launches(recorded_launches, monkeypatch):
    """gemm.matmul on CPU tensors through the real plans and prepared launches: a list of (compiled kernel, grid)
    per launch (recorded_launches, conftest)."""
    compiled_for = nvfly.Kernel.compiled_for
    kernels = []

    def record(self, *args, **kwargs):
        kernel = compiled_for(self, *args, **kwargs)
        kernels.append(kernel)
        return kernel
    monkeypatch.setattr(nvfly.Kernel, "compiled_for", record)
    monkeypatch.setattr(skinny_plan, "current_stream", lambda device: 0)
    monkeypatch.setattr(gemm.api, "eligibility", lambda *args, **kwargs: None)
    gemm.api._CALLS.clear()
    yield lambda: [(kernel, grid) for kernel, (_, grid, _) in zip(kernels, recorded_launches, strict=True)]
    gemm.api._CALLS.clear()


def test_benchmark_sweeps_plan_every_config_or_decline_it():
    """benchmarks/gemm_skinny_configs.py: on every one of its shapes, each config of both sweeps plans (grid within
    the limits) or is declined by SkinnyConfig.check with a reason that make_plan raises too."""
    for row_b, token_vectors in ((False, False), (True, False), (True, True)):
        configs, declined = bench.sweep(row_b, token_vectors)
        variants = (False, True) if token_vectors else (False,)
        assert len(configs) + len(declined) == len(bench.ROW_B_CONFIGS if row_b else bench.CONFIGS) * len(variants)
        too_big = [SkinnyConfig(8, 8, s) for s in (1, 2, 3, 4, 6, 8)] if row_b else []
        assert [c for c, _ in declined] == [dataclasses.replace(c, token_vectors=v) for c in too_big for v in variants]
        for m, n, k in bench.SHAPES:
            for cfg, why in declined:
                with pytest.raises(ValueError, match="shared memory"):
                    skinny_plan.make_plan(m, n, k, 1, False, "none", False, cfg, 132, row_b=row_b)
            for cfg in configs:
                plan = skinny_plan.make_plan(m, n, k, 1, False, "none", False, cfg, 132, row_b=row_b)
                assert plan.config.check(row_b) is None and plan.config.token_vectors == cfg.token_vectors
                assert 1 <= plan.grid[0] < 2 ** 31 and plan.grid[1:] == (1, 1)


def test_benchmark_column_tokens_sweep_and_grid_filter():
    """--column-tokens: each config once per path, in the given order, all accepted by SkinnyConfig.check;
    --warps/--unroll/--splits replace the grid's values (those not given keep it)."""
    grid = ((8,), (2, 4), (1, 2, 3, 4))
    configs, declined = bench.sweep(False, column_tokens=skinny_config.COLUMN_TOKENS, grid=grid)
    assert declined == [] and len(configs) == 8 * len(skinny_config.COLUMN_TOKENS)
    assert [c.column_tokens for c in configs[:4]] == list(skinny_config.COLUMN_TOKENS)
    assert {(c.warps, c.unroll, c.splits) for c in configs} == set(itertools.product(*grid))
    configs, _ = bench.sweep(False, grid=((8,), None, None))
    assert configs == [c for c in bench.CONFIGS if c.warps == 8]
    configs, declined = bench.sweep(True, grid=(None, (8,), (1,)))
    assert [(c.warps, c.unroll) for c in configs] == [(2, 8), (4, 8)] and [c.warps for c, _ in declined] == [8]
    assert bench.integers("1,2,,4") == (1, 2, 4) and bench.names("loads,movmatrix") == ("loads", "movmatrix")


@pytest.mark.parametrize("argv", [["--column-tokens", "registers"], ["--column-tokens", "registers", "--tokens",
                                                                     "col", "--layout", "rowxrow"],
                                  ["--column-tokens", "shared", "--tokens", "col"]])
def test_benchmark_declines_column_tokens_it_cannot_time(argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "--column-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["rowxrow", "rowxrow-token-vectors", "rowxcol", "colxcol-column-tokens"])
def test_benchmark_sweep_compiles_and_fits_a_launch(matmul_launches, layout, config_sample):
    """Every config the benchmark runs, through gemm.matmul as the benchmark calls it (CPU tensors, recorded
    launches) on a 16-token shape (8 tokens for column-major B, where the benchmark runs unroll 8 only there;
    with --column-tokens, 16 column-major tokens under every path on the filtered grid the H200 sweep uses):
    it compiles without spills and its launch fits the device (launch_problem); with --token-vectors, the
    kernels of the configs with token_vectors on load 16-byte token vectors."""
    row_b = layout.startswith("rowxrow")
    token_vectors = layout.endswith("token-vectors")
    column_tokens = skinny_config.COLUMN_TOKENS if layout.endswith("column-tokens") else ()
    m, n, k = (16, 4096, 4096) if row_b or column_tokens else (8, 4096, 4096)
    a = bench.tokens(m, k, "col", device="cpu") if column_tokens else torch.empty(m, k, dtype=torch.bfloat16)
    b = torch.empty(k, n, dtype=torch.bfloat16) if row_b else torch.empty(n, k, dtype=torch.bfloat16).t()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    grid = ((8,), (2, 4), (1, 2, 3, 4)) if column_tokens else None
    configs, _ = bench.sweep(row_b, token_vectors, column_tokens, grid)
    if token_vectors:
        configs = [cfg for cfg in configs if cfg.token_vectors]  # the others: the rowxrow case
    configs = config_sample(configs, pairs=True)  # every config under --run-slow
    for cfg in configs:
        gemm.matmul(a, b, out=out, config=cfg)
    launches = matmul_launches()
    assert len(launches) == len(configs)
    problems = [(cfg, launch_problem(kernel, grid)) for cfg, (kernel, grid) in zip(configs, launches)]
    assert [p for p in problems if p[1]] == []
    for cfg, (kernel, grid) in zip(configs, launches):
        r = kernel.resources
        assert r.spill_stores == 0 and r.spill_loads == 0 and r.registers <= 128, (cfg, r)
        if row_b:
            assert r.static_smem_bytes == 0 and kernel.dynamic_smem_bytes == skinny_config.row_b_smem_bytes(cfg)
        if token_vectors:
            check_token_vectors_kernel(kernel, m, cfg)
        if column_tokens:  # the path the config names, not the loads' fallback
            ops = kernel.sass_opcodes()
            assert (ops["LDG.E.U16"] > 0, ops["LDGSTS.E.BYPASS.128"] > 0, ops["STS.128"] > 0, ops["MOVM.16.MT88"] > 0) \
                == tuple(cfg.column_tokens == path for path in skinny_config.COLUMN_TOKENS), (cfg, sorted(ops))
        assert grid == (math.ceil(n / (64 if row_b else 16)) * cfg.splits, 1, 1)


def test_benchmark_reports_a_failing_config_and_goes_on(monkeypatch):
    """A config that fails to launch (the H200's CUDA_ERROR_INVALID_VALUE) comes back as a reason, not an
    exception that ends the sweep."""
    from nvfly.errors import CudaError

    def fail(*args, **kwargs):
        raise CudaError("cuLaunchKernel(skinny_gemm_kernel)", 1, "CUDA_ERROR_INVALID_VALUE")
    monkeypatch.setattr(bench.gemm, "matmul", fail)
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    ms, why = bench.try_config(None, None, out, None, SkinnyConfig(2, 6, 2))
    assert ms is None and "CudaError" in why and "CUDA_ERROR_INVALID_VALUE" in why


@pytest.mark.parametrize("major", ["col", "row"])
def test_matmul_stages_2d_column_major_tokens(matmul_launches, major):
    """gemm.matmul on 2-D column-major tokens as the benchmark's --tokens col makes them, M = 9 in 16-token
    columns: the kernel's batch of one has stride 0 (one_batch; unsqueeze's stride 9 would leave a batch's tokens
    2-byte aligned), so the tokens are staged (row-major B by default, column-major B with column_tokens
    "cp.async"): ldmatrix and no 16-bit token loads."""
    m, n, k = 9, 1024, 4096
    a = bench.tokens(m, k, "col", device="cpu")
    assert a.shape == (m, k) and a.stride() == (1, 16)
    b = torch.empty(n, k, dtype=torch.bfloat16).t() if major == "col" else torch.empty(k, n, dtype=torch.bfloat16)
    config = column_config("cp.async") if major == "col" else None
    # (a row-major B takes the wgmma kernel above SKINNY_MAX_M_COLUMN_TOKENS column-major tokens unless forced)
    gemm.matmul(a, b, out=torch.empty(m, n, dtype=torch.bfloat16), config=config, skinny=True)
    [(kernel, _)] = matmul_launches()
    assert kernel.count("LDSM") > 0 and kernel.count("LDG.E.U16") == 0
