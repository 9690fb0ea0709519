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
from nvfly.ops import gemm, gemm_skinny
from nvfly.ops.gemm_skinny import SkinnyConfig


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
        assert gemm_skinny.c_fragment_target(lane, i) == isa_c(lane, i)


def test_each_lane_loads_16_contiguous_bytes_per_row():
    for lane in range(32):
        for row_half in (0, 1):
            ks = sorted(gemm_skinny.a_fragment_source(lane, r, h, s)[1]
                        for r in range(4) for h in range(2) for s in range(2)
                        if gemm_skinny.A_REGISTER_WORDS[r][0] == row_half)
            assert ks == list(range(8 * (lane % 4), 8 * (lane % 4) + 8))
        ks = sorted(gemm_skinny.b_fragment_source(lane, r, h, s)[0] for r in range(2) for h in range(2)
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
                row, k = gemm_skinny.a_fragment_source(lane, register, half, step)
                r, col = isa_a(lane, 2 * register + half)
                assert np.isnan(a_mat[r, col])
                a_mat[r, col] = w[row, k]
            for register, half in itertools.product(range(2), range(2)):
                k, token = gemm_skinny.b_fragment_source(lane, register, half, step)
                kk, col = isa_b(lane, 2 * register + half)
                assert np.isnan(b_mat[kk, col])
                b_mat[kk, col] = x[token, k]
        assert not np.isnan(a_mat).any() and not np.isnan(b_mat).any()
        d += a_mat @ b_mat
    result = np.zeros((16, 8))
    for lane, i in itertools.product(range(32), range(4)):
        row, token = gemm_skinny.c_fragment_target(lane, i)
        result[row, token] = d[isa_c(lane, i)]
    np.testing.assert_allclose(result, w @ x.T, rtol=1e-12, atol=1e-12)


def test_a_wrong_mapping_is_caught(monkeypatch):
    """The emulation can fail: B registers taken in the other order no longer pair k with k."""
    monkeypatch.setattr(gemm_skinny, "B_REGISTER_WORDS", (1, 0))
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
        return gemm_skinny.row_b_token_source(lane, register, half, step)[0]
    kq = gemm_skinny.token_vector_k(lane)
    words = [(kq + 2 * word, kq + 2 * word + 1) for word in range(gemm_skinny.VECTOR // 2)]
    return gemm_skinny.vector_token_fragments([words])(step)[0][register][half]


def staged_token_words(m_tiles, vector_order):
    """Emulate the staged tokens of one chunk with the kernel's maps: every lane's cp.async copies of 8 tokens at
    one k (stage_tokens: token_copy_slot, token_slot_k, token_slot_offset) into a token stage whose elements are
    modelled as (k, token), then each token tile's ldmatrix.x4.trans (load_staged_tokens). Every 8-lane phase
    of the copies and of the ldmatrix is free of bank conflicts, and the copies fill the stage exactly once.
    Returns words[tile][lane][word] = ((k, token), (k, token)) of the word's two halves."""
    stage = [None] * (m_tiles * gemm_skinny.TOKEN_TILE_BYTES // 2)
    for j in range(m_tiles):
        writes = []
        for lane in range(32):
            tile, matrix, row = gemm_skinny.token_copy_slot(lane, j, m_tiles)
            k = gemm_skinny.token_slot_k(matrix, row, vector_order)
            offset = gemm_skinny.token_slot_offset(tile, matrix, row)
            assert offset % 16 == 0 and stage[offset // 2:offset // 2 + 8] == [None] * 8, (lane, j)
            stage[offset // 2:offset // 2 + 8] = [(k, 8 * tile + token) for token in range(8)]
            writes.append(offset)
        assert [bank_conflicts(writes[8 * p:8 * p + 8]) for p in range(4)] == [0] * 4, ("copy", j)
    assert None not in stage
    words = []
    for tile in range(m_tiles):
        # ldmatrix: lane 8i + r gives the address of row r of matrix i
        addresses = [gemm_skinny.token_slot_offset(tile, lane // 8, lane % 8) for lane in range(32)]
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
    cols, chunk = gemm_skinny.COLS_ROW_B, gemm_skinny.CHUNK_K
    tiles = 2 if staged else 1
    b = rng.standard_normal((chunk, cols))  # [k, n]
    x = rng.standard_normal((8 * tiles, chunk))
    stage = np.full(gemm_skinny.CHUNK_BYTES // 2, np.nan)
    for j in range(chunk * gemm_skinny.SEGMENTS // 32):
        writes = []
        for lane in range(32):
            row, segment = gemm_skinny.copy_target(lane, j)
            offset = gemm_skinny.stage_offset(row, segment, token_vectors)
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
            addresses = [gemm_skinny.stage_offset(*gemm_skinny.ldmatrix_row(lane, step, tile, token_vectors),
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
                            k, token = gemm_skinny.vector_token_fragments(
                                [token_words[t][lane]])(step)[0][register][half]
                        else:
                            k, token = row_major_token_k(lane, register, half, step, token_vectors), lane // 4
                        kk, col = isa_b(lane, 2 * register + half)
                        assert np.isnan(b_mat[kk, col]) and token == 8 * t + col
                        b_mat[kk, col] = x[token, k]
                d[t] += a_mat @ b_mat
        for lane, i, t in itertools.product(range(32), range(4), range(tiles)):
            row, token = gemm_skinny.c_fragment_target(lane, i)
            result[16 * tile + row, 8 * t + token] = d[t][isa_c(lane, i)]
    np.testing.assert_allclose(result, b.T @ x.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("m_tiles", [1, 2])
def test_column_major_b_staged_tokens_compute_the_product(seed, m_tiles):
    """Column-major B with staged tokens: W's fragments as the kernel loads them (a_fragment_source), the tokens
    through the emulated stage in the vector order (staged_token_words) and picked as mma_chunk picks a token
    tile's words; two mma steps per token tile against W @ X^T over the chunk."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 32))
    x = rng.standard_normal((8 * m_tiles, 32))
    token_words = staged_token_words(m_tiles, vector_order=True)
    d = np.zeros((m_tiles, 16, 8))
    for step in range(2):
        a_mat = np.full((16, 16), np.nan)
        for lane in range(32):
            for register, half in itertools.product(range(4), range(2)):
                row, k = gemm_skinny.a_fragment_source(lane, register, half, step)
                a_mat[isa_a(lane, 2 * register + half)] = w[row, k]
        for t in range(m_tiles):
            b_mat = np.full((16, 8), np.nan)
            for lane in range(32):
                for register, half in itertools.product(range(2), range(2)):
                    word = 2 * step + gemm_skinny.B_REGISTER_WORDS[register]  # mma_chunk's B registers
                    k, token = token_words[t][lane][word][half]
                    kk, col = isa_b(lane, 2 * register + half)
                    assert np.isnan(b_mat[kk, col]) and token == 8 * t + col
                    b_mat[kk, col] = x[token, k]
            d[t] += a_mat @ b_mat
    result = np.zeros((16, 8 * m_tiles))
    for lane, i, t in itertools.product(range(32), range(4), range(m_tiles)):
        row, token = gemm_skinny.c_fragment_target(lane, i)
        result[row, 8 * t + token] = d[t][isa_c(lane, i)]
    np.testing.assert_allclose(result, w @ x.T, rtol=1e-12, atol=1e-12)


def test_staged_tokens_emulation_catches_the_other_k_order(monkeypatch):
    """Tokens staged in the ISA's k order meet column-major B's vector-ordered W fragments: wrong product (and
    the vector order under row-major B's unpermuted stages: wrong too)."""
    slot_k = gemm_skinny.token_slot_k
    monkeypatch.setattr(gemm_skinny, "token_slot_k", lambda matrix, row, vector_order: slot_k(matrix, row,
                                                                                                not vector_order))
    with pytest.raises(AssertionError):
        test_column_major_b_staged_tokens_compute_the_product(0, 2)
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, False, True)


def test_staged_tokens_emulation_catches_bank_conflicts(monkeypatch):
    """Without the tile swizzle a copy phase's rows of the two token tiles share banks (right product)."""
    monkeypatch.setattr(gemm_skinny, "token_slot_offset",
                        lambda tile, matrix, row: tile * gemm_skinny.TOKEN_TILE_BYTES + (8 * matrix + row) * 16)
    staged_token_words(1, True)  # one tile: no conflict either way
    with pytest.raises(AssertionError, match="'copy', 0"):
        staged_token_words(2, True)


def test_token_vectors_give_each_lane_8_consecutive_k():
    """With token_vectors a lane's B fragments over a chunk's two k16 steps are exactly the 8 k of its one
    16-byte vector."""
    for lane in range(32):
        ks = sorted(row_major_token_k(lane, r, h, s, True) for r in range(2) for h in range(2) for s in range(2))
        kq = gemm_skinny.token_vector_k(lane)
        assert ks == list(range(kq, kq + gemm_skinny.VECTOR))


def test_row_major_emulation_catches_a_wrong_swizzle(monkeypatch):
    """Reading with a different swizzle than the copies wrote breaks the product."""
    writes = gemm_skinny.stage_offset
    monkeypatch.setattr(gemm_skinny, "ldmatrix_row", lambda lane, step, tile, token_vectors=False: (
        16 * step + 8 * (lane // 8 // 2) + lane % 8, 2 * tile + (lane // 8 + 1) % 2))
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, False, False)
    assert writes is gemm_skinny.stage_offset


def test_token_vectors_emulation_catches_the_isa_token_order(monkeypatch):
    """The k-permuted ldmatrix rows with the tokens in the ISA's order (no permutation on their side) pair
    different k: the product is wrong."""
    monkeypatch.setattr(gemm_skinny, "vector_token_fragments", lambda words: lambda step: [
        [(16 * step + 8 * r + 2 * (w[0][0] // 8), 16 * step + 8 * r + 2 * (w[0][0] // 8) + 1) for r in range(2)]
        for w in words])
    with pytest.raises(AssertionError):
        test_row_major_staging_and_ldmatrix_trans_compute_the_product(0, True, False)


def test_token_vectors_emulation_catches_bank_conflicts(monkeypatch):
    """The k-permuted rows (c + {0, 1, 8, 9, 16, 17, 24, 25}) under the row % 8 swizzle: right product, but
    pairs of rows share banks."""
    monkeypatch.setattr(gemm_skinny, "segment_swizzle", lambda row, token_vectors: row % 8)
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


@pytest.mark.parametrize("dtype", [nvfly.bf16, nvfly.f16])
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu_f32", "scaled_silu"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("row_b", [False, True], ids=["colB", "rowB"])
def test_kernel_compiles_without_spills(dtype, m, epilogue, splits, row_b):
    options = {"plain": {}, "bias_gelu_f32": dict(has_c=True, activation="gelu_tanh", out_dtype=nvfly.f32),
               "scaled_silu": dict(scaled=True, activation="silu", has_c=True)}[epilogue]
    base = gemm_skinny.ROW_B_CONFIG if row_b else SkinnyConfig()
    config = SkinnyConfig(base.warps, base.unroll, splits)
    kernel = gemm_skinny.compile_kernel(m, dtype=dtype, config=config, row_b=row_b, **options)
    (check_row_b_sass if row_b else check_sass)(kernel, m, config)
    hmma = {op for op in kernel.sass_opcodes() if op.startswith("HMMA")}
    assert hmma == ({"HMMA.16816.F32.BF16"} if dtype == nvfly.bf16 else {"HMMA.16816.F32"})  # f16 has no suffix
    # split K: partial sums go out with atomics, and one arrival per CTA
    assert (kernel.count("REDG") > 0 and kernel.count("ATOMG") > 0) == (splits > 1)


@pytest.mark.parametrize("m,config", [(16, SkinnyConfig(4, 2)), (1, SkinnyConfig(8, 8)), (16, SkinnyConfig(16, 4, 2)),
                                      (8, SkinnyConfig(2, 4, 3))])
def test_other_configs_compile(m, config):
    check_sass(gemm_skinny.compile_kernel(m, config=config), m, config)


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
    check_row_b_sass(gemm_skinny.compile_kernel(m, config=config, row_b=True), m, config)
    check_row_b_sass(gemm_skinny.compile_kernel(m, config=config, row_b=True, x_contiguous=False), m, config)


def test_strided_tokens_compile():
    kernel = gemm_skinny.compile_kernel(7, x_contiguous=False)
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
def test_row_major_token_vectors_compile_for_every_benchmark_config(m):
    """Every row-major-B config of the benchmark sweep with token_vectors on, at K = 4096 (token rows 16-byte
    aligned, as gemm.eligibility requires): no spills or stack (ptxas; so no LDL/STL), 16-byte token loads and no
    16-bit ones in the PTX, and the SASS checks once per distinct cubin. With the sweep test's M = 16 every
    distinct kernel is covered: it depends on M through its token tiles only (1 and 8 alike, 9 and 16 alike), on
    K's row stride through its 16-byte alignment only."""
    configs = [cfg for cfg in bench.sweep(True, token_vectors=True)[0] if cfg.token_vectors]
    assert len(configs) == len(bench.ROW_B_CONFIGS) - 6  # 8 warps x 8 stages do not fit
    for cfg in configs:
        k = 4096
        kernel = gemm_skinny.compile_kernel(m, k, config=cfg, row_b=True)
        r = kernel.resources
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 128, (cfg, k, r)
        assert not kernel.warnings, kernel.warnings
        assert kernel.ptx.count("ld.global.v4.b32") >= 2 * -(-m // 8) and "ld.global.b16" not in kernel.ptx
        check_token_vectors_kernel(kernel, m, cfg)


def test_row_major_token_vectors_main_loop_at_m16():
    """The main loop at M = 16 (default ring, split K): with token_vectors, two chunks a trip, each token tile
    one 16-byte load per chunk and no PRMT; without, as before: 16 16-bit token loads a chunk, packed by PRMT."""
    config = SkinnyConfig(4, 4, 4)
    on_ops, on_chunks = main_loop(gemm_skinny.compile_kernel(16, config=dataclasses.replace(config, token_vectors=True),
                                                             row_b=True))
    off_ops, off_chunks = main_loop(gemm_skinny.compile_kernel(16, config=config, row_b=True))
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
    off = gemm_skinny.compile_kernel(16, config=config, row_b=True)
    on = gemm_skinny.compile_kernel(16, config=dataclasses.replace(config, token_vectors=True), row_b=True)
    assert on.key != off.key and on.ptx != off.ptx


@pytest.mark.parametrize("k,x_contiguous", [(4097, True), (4096, False)], ids=["odd_row_stride", "column_major"])
def test_token_vectors_fall_back_to_pairs(k, x_contiguous):
    """Token rows the kernel can neither read as aligned 16-byte vectors nor stage (an odd row stride;
    column-major tokens with an odd k stride): the option leaves the code as it is without it."""
    options = dict(k=k, x_contiguous=x_contiguous, row_b=True, x_k_stride=17)
    on = gemm_skinny.compile_kernel(16, config=SkinnyConfig(4, 4, 4, token_vectors=True), **options)
    assert on.ptx == gemm_skinny.compile_kernel(16, config=SkinnyConfig(4, 4, 4), **options).ptx
    assert on.count("LDG.E.U16") > 0


def test_token_vectors_is_a_row_major_b_option():
    config = SkinnyConfig(4, 4, 2, token_vectors=True)
    assert config.check(row_b=True) is None
    assert "row-major-B" in config.check(row_b=False)
    with pytest.raises(ValueError, match="token_vectors"):
        gemm_skinny.make_plan(16, 4096, 4096, 1, False, "none", False, SkinnyConfig(token_vectors=True), 132)
    plan = gemm_skinny.make_plan(16, 4096, 4096, 1, False, "none", False, config, 132, row_b=True)
    assert plan.config == config  # kept through planning
    assert gemm_skinny.default_config(16, 4096, 4096, 1, 132, row_b=True).token_vectors  # on by default


def test_row_major_splits_shrink_with_more_token_tiles():
    """The row-B split rule at the swept decode shapes (132 SMs, 64 column groups): 4 splits at M = 1, K = 4096,
    1 at M = 16 (each split reduces 16 rows), 3 at M = 16, K = 14336."""
    splits = {(m, k): gemm_skinny.default_config(m, 4096, k, 1, 132, row_b=True).splits
              for m, k in ((1, 4096), (16, 4096), (16, 14336))}
    assert splits == {(1, 4096): 4, (16, 4096): 1, (16, 14336): 3}


# ---------------------------------------------------------------------------------------------- staged tokens
def fake_tokens(k_stride, align=16, token_stride=1):
    """What tokens_stageable reads of a batch's traced tokens x [M, K]: strides (static ints, or a dynamic one
    with the power-of-two divisor the specialisation proves), dtype and base alignment."""
    stride = k_stride if isinstance(k_stride, int) else types.SimpleNamespace(divisor=k_stride[0])
    return types.SimpleNamespace(stride=(token_stride, stride), dtype=nvfly.bf16, align=align)


@pytest.fixture
def column_b_staging(monkeypatch):
    """The column-major-B kernel's staged tokens switched on (measured slower: off by default)."""
    monkeypatch.setattr(gemm_skinny, "COLUMN_B_STAGED_TOKENS", True)


def test_column_b_kernel_keeps_its_token_loads_by_default():
    x = fake_tokens((16,))
    assert gemm_skinny.tokens_stageable(x)
    assert not gemm_skinny.stages_tokens(x, SkinnyConfig(8, 4, 2), 2, False)
    assert gemm_skinny.stages_tokens(x, SkinnyConfig(8, 4, 2), 2, True)


def test_which_tokens_are_staged(column_b_staging):
    """Staged: tokens contiguous with a k stride of whole 16-byte rows and a 16-byte aligned base, when the
    stages fit the CTA's shared memory; the rest (row-major tokens, other strides, too many stages) keep their
    register loads."""
    stageable = gemm_skinny.tokens_stageable
    assert stageable(fake_tokens((16,))) and stageable(fake_tokens((8,))) and stageable(fake_tokens(0))
    assert not stageable(fake_tokens((4,)))  # e.g. M = 12 = K's stride: 24-byte rows
    assert not stageable(fake_tokens((16,), align=8))
    assert not stageable(fake_tokens(1, token_stride=(16,)))  # row-major tokens
    assert not stageable(fake_tokens(1))  # M = 1 column-major: K-contiguous, read as vectors
    x = fake_tokens((16,))
    assert gemm_skinny.stages_tokens(x, SkinnyConfig(8, 4, 2), 2, False)
    assert gemm_skinny.stages_tokens(x, SkinnyConfig(8, 6, 2), 1, True)  # 48 x (4 + 0.5) KB of stages
    assert not gemm_skinny.stages_tokens(x, SkinnyConfig(8, 6, 2), 2, True)  # 48 x 5 KB: past 227 KB
    assert gemm_skinny.stages_tokens(x, SkinnyConfig(32, 8), 1, False)
    assert not gemm_skinny.stages_tokens(x, SkinnyConfig(32, 8), 2, False)  # 256 x 1 KB
    assert not gemm_skinny.stages_tokens(fake_tokens((4,)), SkinnyConfig(), 1, False)


# (row-major B, config) per kernel variant: the committed row-B default and the token_vectors one
STAGED_VARIANTS = {"colB": (False, SkinnyConfig(8, 4, 2)), "rowB": (True, SkinnyConfig(4, 4)),
                   "rowB-token-vectors": (True, SkinnyConfig(8, 2, 3, token_vectors=True))}


@pytest.mark.parametrize("k", [4096, 4104])
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("variant", list(STAGED_VARIANTS))
def test_column_major_tokens_are_staged(column_b_staging, variant, m, k):
    """Column-major tokens (k stride 8 or 16 tokens: 16-byte rows; M = 1 in a padded column), K with and without
    a tail: no spills or stack, at most 128 registers, all shared memory dynamic and as planned, no 16-bit
    global load anywhere (the chunk holding K's end is staged too), and in the main loop the tokens arrive by
    cp.async (one 16-byte copy per token tile and chunk beside B's 8 with row-major B) and ldmatrix.trans (one
    x4 per token tile and chunk), with no token load from global memory and no PRMT."""
    row_b, config = STAGED_VARIANTS[variant]
    tiles = -(-m // 8)
    kernel = gemm_skinny.compile_kernel(m, k, config=config, row_b=row_b, x_contiguous=False, x_k_stride=8 * tiles)
    r = kernel.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 128, r
    assert not kernel.warnings, kernel.warnings
    assert r.static_smem_bytes == 0
    assert kernel.dynamic_smem_bytes == (gemm_skinny.row_b_smem_bytes(config, tiles) if row_b else
                                         gemm_skinny.column_b_staged_smem_bytes(config, tiles))
    assert not any(op.startswith("LDG.E.U16") for op in kernel.sass_opcodes())
    loop, _ = main_loop(kernel)
    chunks = sum(n for op, n in loop.items() if op.startswith("HMMA")) // (2 * tiles * (4 if row_b else 1))
    assert chunks == (1 if row_b else config.unroll)  # one ring stage a trip; one load group a trip
    b_copies = gemm_skinny.CHUNK_BYTES // 16 // 32 if row_b else 0
    assert loop["LDGSTS.E.BYPASS.128"] == (b_copies + tiles) * chunks, sorted(loop.items())
    assert loop["LDSM.16.MT88.4"] == ((8 if row_b else 0) + tiles) * chunks, sorted(loop.items())
    global_loads = token_loads(loop)
    if row_b:
        assert global_loads == {}, global_loads
    else:  # W's two 16-byte streaming loads per chunk only
        assert all(op.startswith("LDG.E.NA") and ".128" in op for op in global_loads), global_loads
        assert sum(global_loads.values()) == 2 * chunks
    assert loop["PRMT"] == 0


@pytest.mark.parametrize("row_b", [False, True], ids=["colB", "rowB"])
def test_tokens_that_cannot_be_staged_keep_their_loads(column_b_staging, row_b):
    """Column-major tokens with an odd k stride, and (row-major B) stages past 227 KB with 16 tokens: the
    16-bit token loads as before, and no token stages in shared memory."""
    odd = gemm_skinny.compile_kernel(16, config=SkinnyConfig(4, 4), row_b=row_b, x_contiguous=False, x_k_stride=17)
    assert odd.count("LDG.E.U16") > 0
    assert odd.dynamic_smem_bytes == (gemm_skinny.row_b_smem_bytes(SkinnyConfig(4, 4)) if row_b else 0)
    if row_b:
        config = SkinnyConfig(8, 6, 2)
        big = gemm_skinny.compile_kernel(16, config=config, row_b=True, x_contiguous=False)
        assert big.count("LDG.E.U16") > 0 and big.dynamic_smem_bytes == gemm_skinny.row_b_smem_bytes(config)


def test_staging_is_part_of_the_compile_key(column_b_staging):
    """The choice follows x's specialisation (k stride divisible by 8 or not), so the kernels differ in key."""
    options = dict(config=SkinnyConfig(4, 4), x_contiguous=False)
    staged = gemm_skinny.compile_kernel(16, x_k_stride=16, **options)
    loaded = gemm_skinny.compile_kernel(16, x_k_stride=20, **options)
    assert staged.key != loaded.key and "cp.async" in staged.ptx and "cp.async" not in loaded.ptx


# ---------------------------------------------------------------------------------------------- planning
def weight(n, k, major):
    """A [K, N] B operand: 'col' is the F.linear weight (W [N, K] row-major, transposed)."""
    return torch.randn(n, k).to(torch.bfloat16).t() if major == "col" else torch.randn(k, n).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 64])
@pytest.mark.parametrize("major", ["col", "row"])
def test_skinny_path_for_small_m(m, major):
    a = torch.randn(m, 4096).to(torch.bfloat16)
    b = weight(4096, 4096, major)
    assert gemm._skinny_wanted(a, b, None, None) == (m <= gemm.SKINNY_MAX_M)
    assert not gemm._skinny_wanted(a, b, None, False)
    assert not gemm._skinny_wanted(a, b, gemm.GemmConfig(), None)
    assert gemm_skinny.b_major(b) == major  # which variant _new_plan plans (row_b=True for "row")
    if m <= gemm_skinny.MAX_M:
        assert gemm._skinny_wanted(a, b, SkinnyConfig(), None) and gemm._skinny_wanted(a, b, None, True)
    else:
        with pytest.raises(ValueError, match="skinny"):
            gemm._skinny_wanted(a, b, None, True)


def test_row_major_b_can_be_switched_off(monkeypatch):
    monkeypatch.setattr(gemm, "SKINNY_ROW_B", False)
    a = torch.randn(8, 4096).to(torch.bfloat16)
    assert not gemm._skinny_wanted(a, weight(4096, 4096, "row"), None, None)
    assert gemm._skinny_wanted(a, weight(4096, 4096, "col"), None, None)
    assert gemm._skinny_wanted(a, weight(4096, 4096, "row"), None, True)


def test_unaligned_row_major_b_is_declined():
    a = torch.randn(4, 64).to(torch.bfloat16)
    assert "multiple of 8" in gemm_skinny.reason(a, torch.randn(64, 33).to(torch.bfloat16))
    assert "16-byte" in gemm_skinny.reason(a, torch.randn(64, 1028).to(torch.bfloat16)[:, :1020][:, :1016][:, :1016]
                                           .as_strided((64, 1016), (1020, 1)))
    assert gemm_skinny.reason(a, torch.randn(64, 1032).to(torch.bfloat16)[:, :1000]) is None  # N tail, padded rows
    assert not gemm._skinny_wanted(a, torch.randn(64, 33).to(torch.bfloat16), None, None)
    with pytest.raises(ValueError, match="skinny"):
        gemm._skinny_wanted(a, torch.randn(64, 33).to(torch.bfloat16), None, True)


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (16, 4096, 14336), (8, 40, 4104), (1, 8, 8), (16, 4104, 1023)])
def test_row_major_plans_cover_k_exactly(mnk):
    m, n, k = mnk
    plan = gemm_skinny.make_plan(m, n, k, 1, False, "none", False, None, 132, row_b=True)
    cfg = plan.config
    chunks = -(-k // gemm_skinny.CHUNK_K)
    assert plan.row_b and plan.tile_slots == gemm_skinny.COLS_ROW_B * gemm_skinny.MAX_M
    assert (cfg.splits - 1) * plan.chunks_per_split < chunks <= cfg.splits * plan.chunks_per_split
    assert plan.grid == (-(-n // 64) * cfg.splits, 1, 1) and plan.tiles == -(-n // 64)
    assert cfg.splits == 1 or plan.grid[0] <= gemm_skinny.TARGET_CTAS_PER_SM * 132
    with pytest.raises(ValueError, match="shared memory"):
        gemm_skinny.make_plan(m, n, k, 1, False, "none", False, SkinnyConfig(32, 8), 132, row_b=True)


def test_unaligned_weight_rows_are_declined():
    b = torch.randn(64, 1028).to(torch.bfloat16)[:, :1020].t()  # row stride 1028: 8-byte rows only
    assert "16-byte" in gemm_skinny.reason(torch.randn(1, 1020).to(torch.bfloat16), b)
    padded = torch.randn(64, 1024).to(torch.bfloat16)[:, :1023].t()  # K tail, 16-byte aligned rows
    assert gemm_skinny.reason(torch.randn(1, 1023).to(torch.bfloat16), padded) is None


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (16, 4096, 14336), (8, 33, 4104), (1, 1, 8), (16, 4097, 1023)])
def test_plans_cover_k_exactly(mnk):
    m, n, k = mnk
    plan = gemm_skinny.make_plan(m, n, k, 1, False, "none", False, None, 132)
    cfg = plan.config
    full = k // gemm_skinny.CHUNK_K
    assert plan.chunks_per_split % cfg.unroll == 0
    assert (cfg.splits - 1) * plan.chunks_per_split < max(full, 1) <= cfg.splits * plan.chunks_per_split
    assert plan.grid == (-(-n // 16) * cfg.splits, 1, 1) and plan.m_tiles == -(-m // 8)
    assert plan.tiles == -(-n // 16)


def test_few_column_groups_split_k_up_to_one_wave():
    sms = 132
    for n, k in ((4096, 4096), (4096, 14336), (1024, 4096), (33, 4104), (65536, 4096), (1, 8)):
        cfg = gemm_skinny.default_config(16, n, k, 1, sms)
        ctas = -(-n // 16) * cfg.splits
        assert cfg.splits == 1 or ctas <= gemm_skinny.TARGET_CTAS_PER_SM * sms, (n, k, cfg)
    assert gemm_skinny.default_config(16, 1024, 4096, 1, sms).splits == 2  # 64 groups, 128 chunks
    assert gemm_skinny.default_config(16, 33, 4104, 1, sms).splits > 1
    assert gemm_skinny.default_config(16, 65536, 4096, 1, sms).splits == 1


# ---------------------------------------------------------------------------------------------- launch limits
# what cuLaunchKernel accepts (sm_90), with the runtime's opt-in rule: runtime.driver.LoadedFunction sets
# CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (to the dynamic size) only when the dynamic size alone exceeds
# 48 KB; without it a launch may use 48 KB of static plus dynamic shared memory, with it 227 KB
def launch_problem(kernel, grid):
    """None when a launch of ``kernel`` on ``grid`` fits the device's limits, else why not."""
    static, dynamic = kernel.resources.static_smem_bytes, kernel.dynamic_smem_bytes
    limit = gemm_skinny.MAX_SMEM if dynamic > gemm_skinny.DEFAULT_SMEM else gemm_skinny.DEFAULT_SMEM
    if static + dynamic > limit:
        return f"{static} static + {dynamic} dynamic bytes of shared memory exceed {limit}"
    if kernel.threads > 1024 or kernel.resources.registers * kernel.threads > 65536:
        return f"{kernel.threads} threads x {kernel.resources.registers} registers"
    if not (1 <= grid[0] < 2 ** 31 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535):
        return f"grid {grid}"
    return None


def test_launch_problem_catches_static_shared_memory_past_48_kb():
    """The H200 failure of the row-major-B sweep (CUDA_ERROR_INVALID_VALUE at launch): 2 warps x 6 stages or
    4 x 3 with split K asked for exactly 48 KB of dynamic shared memory (so the runtime did not opt in) while the
    split-K arrival flag, a static array before the 1024-byte aligned dynamic region, added 1 KB of static."""
    def fake(static, dynamic, registers=115, threads=128):
        return types.SimpleNamespace(resources=types.SimpleNamespace(static_smem_bytes=static, registers=registers),
                                     dynamic_smem_bytes=dynamic, threads=threads)
    assert launch_problem(fake(0, 48 * 1024), (64, 1, 1)) is None
    assert "exceed 49152" in launch_problem(fake(1024, 48 * 1024), (64, 1, 1))
    assert launch_problem(fake(1024, 48 * 1024 + 16), (64, 1, 1)) is None  # opted in
    assert "exceed 232448" in launch_problem(fake(1024, 227 * 1024), (64, 1, 1))
    assert "registers" in launch_problem(fake(0, 0, 255, 512), (1, 1, 1))
    assert "grid" in launch_problem(fake(0, 0), (1, 65536, 1))


@pytest.mark.parametrize("config", [SkinnyConfig(2, 6, 2), SkinnyConfig(4, 3, 3), SkinnyConfig(4, 4, 2),
                                    SkinnyConfig(2, 6, 1), SkinnyConfig(8, 6, 8)])
def test_row_major_b_shared_memory_is_all_dynamic(config):
    """The row-major-B kernel has no static shared memory (the split-K arrival flag lives after the rings), so
    the dynamic size the runtime sees is all the CTA asks for; at 48 KB of rings the split-K flag takes the
    kernel past 48 KB and the runtime opts in."""
    kernel = gemm_skinny.compile_kernel(16, config=config, row_b=True)
    assert kernel.resources.static_smem_bytes == 0
    assert kernel.dynamic_smem_bytes == gemm_skinny.row_b_smem_bytes(config)
    assert gemm_skinny.row_b_smem_bytes(config) == config.warps * config.unroll * gemm_skinny.CHUNK_BYTES + \
        (gemm_skinny.ARRIVAL_BYTES if config.splits > 1 else 0)
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
        gemm_skinny.make_plan(1, 4096, 4096, 1, False, "none", False, config, 132, row_b=True)
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
    monkeypatch.setattr(gemm_skinny, "current_stream", lambda device: 0)
    monkeypatch.setattr(gemm, "eligibility", lambda *args, **kwargs: None)
    gemm._CALLS.clear()
    yield lambda: [(kernel, grid) for kernel, (_, grid, _) in zip(kernels, recorded_launches, strict=True)]
    gemm._CALLS.clear()


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
                    gemm_skinny.make_plan(m, n, k, 1, False, "none", False, cfg, 132, row_b=row_b)
            for cfg in configs:
                plan = gemm_skinny.make_plan(m, n, k, 1, False, "none", False, cfg, 132, row_b=row_b)
                assert plan.config.check(row_b) is None and plan.config.token_vectors == cfg.token_vectors
                assert 1 <= plan.grid[0] < 2 ** 31 and plan.grid[1:] == (1, 1)


@pytest.mark.parametrize("layout", ["rowxrow", "rowxrow-token-vectors", "rowxcol"])
def test_benchmark_sweep_compiles_and_fits_a_launch(matmul_launches, layout):
    """Every config the benchmark runs, through gemm.matmul as the benchmark calls it (CPU tensors, recorded
    launches) on a 16-token shape (8 tokens for column-major B, where the benchmark runs unroll 8 only there):
    it compiles without spills and its launch fits the device (launch_problem); with --token-vectors, the
    kernels of the configs with token_vectors on load 16-byte token vectors."""
    row_b = layout.startswith("rowxrow")
    token_vectors = layout.endswith("token-vectors")
    m, n, k = (16, 4096, 4096) if row_b else (8, 4096, 4096)
    a = torch.empty(m, k, dtype=torch.bfloat16)
    b = torch.empty(k, n, dtype=torch.bfloat16) if row_b else torch.empty(n, k, dtype=torch.bfloat16).t()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    configs, _ = bench.sweep(row_b, token_vectors)
    if token_vectors:
        configs = [cfg for cfg in configs if cfg.token_vectors]  # the others: the rowxrow case
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
            assert r.static_smem_bytes == 0 and kernel.dynamic_smem_bytes == gemm_skinny.row_b_smem_bytes(cfg)
        if token_vectors:
            check_token_vectors_kernel(kernel, m, cfg)
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
def test_matmul_stages_2d_column_major_tokens(column_b_staging, matmul_launches, major):
    """gemm.matmul on 2-D column-major tokens as the benchmark's --tokens col makes them, M = 9 in 16-token
    columns: the kernel's batch of one has stride 0 (one_batch; unsqueeze's stride 9 would leave a batch's tokens
    2-byte aligned), so the tokens are staged: ldmatrix and no 16-bit token loads."""
    m, n, k = 9, 1024, 4096
    a = bench.tokens(m, k, "col", device="cpu")
    assert a.shape == (m, k) and a.stride() == (1, 16)
    b = torch.empty(n, k, dtype=torch.bfloat16).t() if major == "col" else torch.empty(k, n, dtype=torch.bfloat16)
    gemm.matmul(a, b, out=torch.empty(m, n, dtype=torch.bfloat16))
    [(kernel, _)] = matmul_launches()
    assert kernel.count("LDSM") > 0 and kernel.count("LDG.E.U16") == 0
