"""Decode attention without a GPU: the split heuristic's invariants, the split + combine arithmetic against the
float32 reference (with a flex BlockMask's tables too), the reference itself (fp8 dequantised), the fp8 stage
conversion's layout, argument errors, mods tracing, and every plan family (fp8 and block masks included) compiling
for sm_90a to mma.sync, 16-byte cp.async and ldmatrix with no local-memory spills."""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import nvfly
from nvfly.ops import attention
from nvfly.ops.attention import mods as M
from nvfly.ops.attention import plan as P
from nvfly.ops.attention import decode_kernel as K
from nvfly.ops.attention import api
from nvfly.ops.attention import kv_options
from nvfly.ops.attention.api import reference
from nvfly.ops.common import scratch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from tests.dispatched import dispatched


# ---------------------------------------------------------------------------------------------- split heuristic
def slots_of(plan):
    return 132 * P.ctas_per_sm(plan)


@pytest.mark.parametrize("batch,kv_heads,group,seqlen", [(1, 8, 4, 128 * 1024), (1, 8, 6, 32 * 1024),
                                                         (16, 8, 6, 32 * 1024), (1, 1, 32, 8192)])
def test_few_sequences_are_split_to_fill_the_sms(batch, kv_heads, group, seqlen):
    plan = P.decode_plan(batch, 1, kv_heads, group, 128, 128, seqlen, 132)
    ctas = batch * kv_heads * plan.m_tiles
    n_blocks = -(-seqlen // P.BLOCK_N)

    def efficiency(splits):
        waves = ctas * splits / slots_of(plan)
        return waves / math.ceil(waves)
    best = max(efficiency(s) for s in range(1, min(P.MAX_SPLITS, n_blocks) + 1))
    # one long sequence (CTAs fill at most an eighth of the slots): the best efficiency, else FA3's 85% of it
    wanted = P.FEW_CTAS_SPLIT_EFFICIENCY if 8 * ctas <= slots_of(plan) else P.SPLIT_EFFICIENCY
    assert plan.splits > 1
    assert efficiency(plan.splits) >= wanted * best
    if ctas * n_blocks >= slots_of(plan):  # enough stages to fill every slot
        assert efficiency(plan.splits) > 0.8
    assert all(efficiency(s) < wanted * best for s in range(1, plan.splits))  # the fewest such
    assert plan.splits <= n_blocks  # every split has stages


@pytest.mark.parametrize("batch,kv_heads,group,seqlen", [(128, 8, 4, 4096), (32, 8, 4, 4096), (64, 8, 8, 8192),
                                                         (4, 8, 4, 200)])
def test_full_grids_and_short_sequences_are_not_split(batch, kv_heads, group, seqlen):
    assert P.decode_plan(batch, 1, kv_heads, group, 128, 128, seqlen, 132).splits == 1


def test_fa3_example():
    """hopper-kernels.md §3: 48 CTAs on 108 SMs take 2 splits (efficiency 0.89), not 3 (0.67)."""
    assert P.num_splits(48, 108, 100) == 2


def test_split_ranges_partition_every_sequence():
    for seqlen in (0, 1, 63, 64, 65, 1000, 4097, 131072):
        n_blocks = -(-seqlen // P.BLOCK_N)
        for splits in (1, 2, 3, 7, 29, 128):
            covered = []
            for split in range(splits):
                begin, end = P.split_range(seqlen, splits, split)
                covered.extend(range(begin, end))
            assert covered == list(range(n_blocks)), (seqlen, splits)


@pytest.mark.parametrize("dqk", P.HEAD_DIMS)
@pytest.mark.parametrize("dv", P.HEAD_DIMS)
@pytest.mark.parametrize("sq", [1, 4, 8])
def test_shared_memory_fits(dqk, dv, sq):
    plan = P.decode_plan(1, sq, 1, 8, dqk, dv, 4096, 132, splits=1, warp_tiles=1)
    assert plan.row_warps == {1: 1, 4: 2, 8: 4}[sq] and plan.tile_rows >= min(64, sq * 8)
    bf16_default = P.decode_plan(1, sq, 1, 8, dqk, dv, 4096, 132, splits=1)  # d 128 past 32 rows: warp32
    assert bf16_default.warp_tiles == (2 if sq * 8 > 2 * P.ROWS and dqk == dv == 128 else 1)
    assert bf16_default.smem_bytes <= P.MAX_SMEM and P.ctas_per_sm(bf16_default) == P.ctas_per_sm(plan)
    assert plan.smem_bytes <= P.MAX_SMEM
    assert P.WARPS * P.ROWS * dv * 4 <= plan.stages * plan.stage_bytes  # the warps' merge reuses the ring
    assert P.BLOCK_N * (dqk // 8) % plan.threads == 0 and P.BLOCK_N * (dv // 8) % plan.threads == 0
    fp8 = P.decode_plan(1, sq, 1, 8, dqk, dv, 4096, 132, splits=1, fp8=True, warp_tiles=1)
    assert fp8.smem_bytes == plan.smem_bytes and P.ctas_per_sm(fp8) == P.ctas_per_sm(plan)  # same occupancy
    default = P.decode_plan(1, sq, 1, 8, dqk, dv, 4096, 132, splits=1, fp8=True)  # d 128 past 16 rows: warp32
    assert default.warp_tiles == (2 if sq * 8 > P.ROWS and dqk == dv == 128 else 1)
    assert default.smem_bytes <= P.MAX_SMEM and P.ctas_per_sm(default) == P.ctas_per_sm(plan)
    assert fp8.stages == 2 * plan.stages and fp8.stage_bytes * 2 == plan.stage_bytes
    assert P.WARPS * P.ROWS * dv * 4 <= fp8.ring_bytes


# ---------------------------------------------------------------------------------------------- fragment maps
# PTX ISA, ldmatrix and mma.m16n8k16 with 16-bit inputs (g = lane / 4, q = lane % 4, element i = 2 * register + half)
def stage_memory(tile):
    """A [rows, d] tile as the kernel's cp.async copies lay it out in shared memory (2-byte elements)."""
    rows, d = tile.shape
    memory = np.full(rows * d, np.nan)
    for row, segment in itertools.product(range(rows), range(d // 8)):
        offset = K.swizzled(row, segment, d // 8) // 2
        memory[offset:offset + 8] = tile[row, 8 * segment:8 * segment + 8]
    return memory


def ldmatrix_x4(memory, sources, segments, transpose=False):
    """Each lane's four registers (two values each) from the (row, segment) every lane addresses."""
    matrices = []
    for j in range(4):
        rows = []
        for r in range(8):
            offset = K.swizzled(*sources[8 * j + r], segments) // 2
            rows.append(memory[offset:offset + 8])
        matrices.append(np.array(rows))
    out = []
    for lane in range(32):
        g, q = lane // 4, lane % 4
        out.append([(m[2 * q, g], m[2 * q + 1, g]) if transpose else (m[g, 2 * q], m[g, 2 * q + 1])
                    for m in matrices])
    return out


def mma(a, b, c):
    """D = A B + C from every lane's fragments (a: 4 registers, b: 2, c: 4 values)."""
    A, B = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for i in range(8):
            A[g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4)] = a[lane][i // 2][i % 2]
        for i in range(4):
            B[2 * q + i % 2 + 8 * (i // 2), g] = b[lane][i // 2][i % 2]
    D = A @ B
    return [[c[lane][i] + D[K.accumulator_coords(lane, i)] for i in range(4)] for lane in range(32)]


def assert_scores(s, q, k, warp):
    """S's accumulators [key tile][lane][index] equal q kᵀ for the keys of slice ``warp``."""
    want = q @ k[16 * warp:16 * warp + 16].T
    for t, lane, i in itertools.product(range(2), range(32), range(4)):
        row, col = K.accumulator_coords(lane, i)
        assert s[t][lane][i] == pytest.approx(want[row, 8 * t + col])


def p_fragment(p, warp):
    """Every lane's A fragment of P (16 rows x keys 16 warp..+15) taken from S's accumulator layout (P_FRAGMENT)."""
    p_acc = [[[p[K.accumulator_coords(lane, i)[0], 16 * warp + 8 * t + K.accumulator_coords(lane, i)[1]]
               for i in range(4)] for lane in range(32)] for t in range(2)]
    return [[(p_acc[lo[0]][lane][lo[1]], p_acc[hi[0]][lane][hi[1]]) for lo, hi in K.P_FRAGMENT] for lane in range(32)]


def fragment_inputs(rows: int, d: int):
    """Random Q (rows x d), K and V (64 x d) and P (rows x 64), the three tiles' shared-memory images and a warp of
    zero accumulators."""
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((rows, d)), rng.standard_normal((64, d)), rng.standard_normal((64, d))
    p = rng.standard_normal((rows, 64))
    return q, k, v, p, (stage_memory(q), stage_memory(k), stage_memory(v)), [[0.0] * 4 for _ in range(32)]


@pytest.mark.parametrize("d", [64, 128])
def test_fragment_maps_compute_scores_and_values(d):
    """Emulate a warp of each key slice: S = Q Kᵀ from the shared tiles through the kernel's ldmatrix sources, and
    O = P V with P's A fragment taken from S's accumulators (P_FRAGMENT) and V by ldmatrix.trans."""
    q, k, v, p, (q_mem, k_mem, v_mem), zero = fragment_inputs(16, d)
    for warp in range(P.WARPS):
        s = [zero, zero]
        for step in range(d // 16):
            a = ldmatrix_x4(q_mem, [K.q_fragment_source(lane, step) for lane in range(32)], d // 8)
            kb = ldmatrix_x4(k_mem, [K.k_fragment_source(lane, step, warp) for lane in range(32)], d // 8)
            s = [mma(a, [regs[0:2] for regs in kb], s[0]), mma(a, [regs[2:4] for regs in kb], s[1])]
        assert_scores(s, q, k, warp)
        a = p_fragment(p, warp)
        want = p[:, 16 * warp:16 * warp + 16] @ v[16 * warp:16 * warp + 16]
        for pair in range(d // 16):
            vb = ldmatrix_x4(v_mem, [K.v_fragment_source(lane, pair, warp) for lane in range(32)], d // 8, True)
            for half in range(2):
                acc = mma(a, [regs[2 * half:2 * half + 2] for regs in vb], zero)
                for lane, i in itertools.product(range(32), range(4)):
                    row, col = K.accumulator_coords(lane, i)
                    assert acc[lane][i] == pytest.approx(want[row, 16 * pair + 8 * half + col])


@pytest.mark.parametrize("segments", [8, 16, 24, 32])
def test_ldmatrix_phases_are_conflict_free(segments):
    """The 8 rows one matrix of an ldmatrix reads fall in 8 different 16-byte bank groups."""
    for step, warp in itertools.product(range(segments // 2), range(P.WARPS)):
        for source in (lambda lane: K.q_fragment_source(lane, step), lambda lane: K.k_fragment_source(lane, step, warp),
                       lambda lane: K.v_fragment_source(lane, step, warp)):
            for j in range(4):
                groups = {K.swizzled(*source(8 * j + r), segments) // 16 % 8 for r in range(8)}
                assert len(groups) == 8


@pytest.mark.parametrize("dim", P.HEAD_DIMS)
def test_fp8_ldmatrix_phases_are_conflict_free(dim):
    """fp8 rows (dim bytes, fp8_swizzled): the 8 rows one matrix of the K / V ldmatrix reads fall in 8 different
    16-byte bank groups, and every row's segments are a permutation of its own."""
    segments = dim // 16
    for row in range(P.BLOCK_N):
        offsets = sorted(K.fp8_swizzled(row, s, segments) for s in range(segments))
        assert offsets == [row * dim + 16 * s for s in range(segments)]
    for pair, warp in itertools.product(range(segments // 2), range(P.WARPS)):
        for j in range(4):
            sources = [K.v_fragment_source(8 * j + r, pair, warp) for r in range(8)]
            assert len({K.fp8_swizzled(*source, segments) // 16 % 8 for source in sources}) == 8


def fp8_memory(tile):
    """A [rows, d] tile of fp8 values as load_stage lays their bytes out (fp8_swizzled rows of d bytes)."""
    rows, d = tile.shape
    memory = np.full(rows * d, np.nan)
    for row, segment in itertools.product(range(rows), range(d // 16)):
        offset = K.fp8_swizzled(row, segment, d // 16)
        memory[offset:offset + 16] = tile[row, 16 * segment:16 * segment + 16]
    return memory


def ldmatrix_x4_bytes(memory, sources, segments, transpose=False):
    """ldmatrix.x4 (b16) over fp8 bytes: each lane's four registers as their 4 bytes (lowest first)."""
    out = [[] for _ in range(32)]
    for j in range(4):
        rows = [memory[K.fp8_swizzled(*sources[8 * j + r], segments):][:16] for r in range(8)]
        for lane in range(32):
            g, c = lane // 4, lane % 4
            if transpose:  # b16 elements (2c, g) and (2c + 1, g) of the matrix
                out[lane].append([*rows[2 * c][2 * g:2 * g + 2], *rows[2 * c + 1][2 * g:2 * g + 2]])
            else:
                out[lane].append(list(rows[g][4 * c:4 * c + 4]))
    return out


def permute(low, high, selector):
    """prmt.b32 on byte lists."""
    both = [*low, *high]
    return [both[(selector >> 4 * i) & 7] for i in range(4)]


@pytest.mark.parametrize("d", [64, 128, 192])
def test_fp8_fragment_maps_compute_scores_and_values(d):
    """Emulate a warp of each key slice on fp8 K and V bytes: the query tile as stage_query_f16 stores it
    (fp8_query_dim order), K's ldmatrix words converted as they are (e4m3x4_to_16bit: bytes 0-1, 2-3) into S = Q Kᵀ,
    and V's ldmatrix.trans words gathered by FP8_COLUMN_SELECTORS into O = P V at accumulator_column."""
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((16, d)), rng.standard_normal((64, d)), rng.standard_normal((64, d))
    p = rng.standard_normal((16, 64))
    q_tile = np.empty((16, d))  # stage_query_f16: words (dims 2w, 2w + 1) 0, 2, 4, 6 then 1, 3, 5, 7 of a group
    for row, group in itertools.product(range(16), range(d // 16)):
        words = [q[row, 16 * group + 2 * w:16 * group + 2 * w + 2] for w in range(8)]
        q_tile[row, 16 * group:16 * group + 16] = np.concatenate(words[0::2] + words[1::2])
        assert np.array_equal(q_tile[row, 16 * group:16 * group + 16],
                              [q[row, 16 * group + K.fp8_query_dim(i)] for i in range(16)])
    q_mem, k_mem, v_mem = stage_memory(q_tile), fp8_memory(k), fp8_memory(v)
    zero = [[0.0] * 4 for _ in range(32)]
    for warp in range(P.WARPS):
        s = [zero, zero]
        for pair in range(d // 32):
            kb = ldmatrix_x4_bytes(k_mem, [K.v_fragment_source(lane, pair, warp) for lane in range(32)], d // 16)
            for half in range(2):
                a = ldmatrix_x4(q_mem, [K.q_fragment_source(lane, 2 * pair + half) for lane in range(32)], d // 8)
                for t in range(2):
                    b = [[words[2 * half + t][0:2], words[2 * half + t][2:4]] for words in kb]
                    s[t] = mma(a, b, s[t])
        assert_scores(s, q, k, warp)
        a = p_fragment(p, warp)
        want = p[:, 16 * warp:16 * warp + 16] @ v[16 * warp:16 * warp + 16]
        for quad in range(d // 32):
            vb = ldmatrix_x4_bytes(v_mem, [K.v_fragment_source(lane, quad, warp) for lane in range(32)], d // 16, True)
            for half, (parity, selector) in itertools.product(range(2), enumerate(K.FP8_COLUMN_SELECTORS)):
                words = [permute(regs[2 * half], regs[2 * half + 1], selector) for regs in vb]
                acc = mma(a, [[w[0:2], w[2:4]] for w in words], zero)
                tile = 4 * quad + 2 * half + parity
                for lane, i in itertools.product(range(32), range(4)):
                    row = K.accumulator_coords(lane, i)[0]
                    assert acc[lane][i] == pytest.approx(want[row, K.accumulator_column(lane, tile, i, True)])
    columns = {K.accumulator_column(lane, tile, i, True) for lane in range(32) for tile in range(d // 8)
               for i in range(4)}
    assert columns == set(range(d))  # the fp8 tiles' accumulators cover O's columns


def movmatrix(words):
    """movmatrix.trans on every lane's pair (row g, columns 2c, 2c + 1): lane (g, c) gets (2c, g), (2c + 1, g)."""
    return [(words[4 * (2 * (lane % 4)) + lane // 8][lane // 4 % 2],
             words[4 * (2 * (lane % 4) + 1) + lane // 8][lane // 4 % 2]) for lane in range(32)]


def swapped_p_fragment(p, warp):
    """Pᵀ's B fragment of keys 16 warp..+15 (8 query rows): Sᵀ's C registers packed in pairs (keys g, g + 8 of
    rows 2c, 2c + 1) and transposed by movmatrix, as attend_slice_swapped does."""
    keys = p[:, 16 * warp:16 * warp + 16].T  # [16 keys, 8 rows]
    c = [[keys[K.accumulator_coords(lane, i)] for i in range(4)] for lane in range(32)]
    low, high = movmatrix([(r[0], r[1]) for r in c]), movmatrix([(r[2], r[3]) for r in c])
    return [[low[lane], high[lane]] for lane in range(32)]


def check_swapped_scores(s, q, k, warp):
    """Sᵀ's accumulators [lane][index] equal (q kᵀ)ᵀ for the keys of slice ``warp``: keys as rows."""
    want = k[16 * warp:16 * warp + 16] @ q.T
    for lane, i in itertools.product(range(32), range(4)):
        assert s[lane][i] == pytest.approx(want[K.accumulator_coords(lane, i)])


def check_swapped_values(acc, p, v, warp, tile, fp8):
    """Oᵀ's tile ``tile`` equals (P V)ᵀ's rows at swapped_column (the accumulators' columns: query rows)."""
    want = p[:, 16 * warp:16 * warp + 16] @ v[16 * warp:16 * warp + 16]
    for lane, i in itertools.product(range(32), range(4)):
        row = K.accumulator_coords(lane, i)[1]
        assert acc[lane][i] == pytest.approx(want[row, K.swapped_column(lane, tile, i, fp8)])


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_swapped_fragment_maps_compute_scores_and_values(d):
    """A swapped plan's warps (Sᵀ = K Qᵀ, Oᵀ = Vᵀ Pᵀ, 8 query rows as N): K's A fragments by ldmatrix of its rows
    (q_fragment_source from the slice's first key), Qᵀ's B fragments of two steps a query_pair_source ldmatrix,
    Pᵀ through movmatrix from Sᵀ's C registers, Vᵀ's A fragments by ldmatrix.trans (k_fragment_source), O's
    columns at swapped_column covering every column once."""
    q, k, v, p, (q_mem, k_mem, v_mem), zero = fragment_inputs(8, d)
    for warp in range(P.WARPS):
        s = zero
        for pair in range(d // 32):
            qb = ldmatrix_x4(q_mem, [K.query_pair_source(lane, pair) for lane in range(32)], d // 8)
            for half in range(2):
                sources = [K.q_fragment_source(lane, 2 * pair + half) for lane in range(32)]
                a = ldmatrix_x4(k_mem, [(16 * warp + row, segment) for row, segment in sources], d // 8)
                s = mma(a, [regs[2 * half:2 * half + 2] for regs in qb], s)
        check_swapped_scores(s, q, k, warp)
        b = swapped_p_fragment(p, warp)
        for tile in range(d // 16):
            va = ldmatrix_x4(v_mem, [K.k_fragment_source(lane, tile, warp) for lane in range(32)], d // 8, True)
            check_swapped_values(mma(va, b, zero), p, v, warp, tile, False)
    columns = [K.swapped_column(lane, tile, i, False) for lane in range(32) for tile in range(d // 16)
               for i in range(0, 4, 2)]
    assert sorted(columns) == [c for c in range(d) for _ in range(4)]  # each column in the 4 lanes of its row


@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_swapped_fp8_fragment_maps_compute_scores_and_values(d):
    """The swapped fp8 plan: K's ldmatrix words converted (bytes 0-1, 2-3 of keys g and g + 8) into Sᵀ's A
    fragments against the f16 query tile in fp8_query_dim order, V's ldmatrix.trans words gathered by
    FP8_COLUMN_SELECTORS into Vᵀ's A fragments (segments 2s and 2s + 1 as rows 0-7 and 8-15)."""
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((8, d)), rng.standard_normal((64, d)), rng.standard_normal((64, d))
    p = rng.standard_normal((8, 64))
    q_tile = np.array([[q[row, 16 * (i // 16) + K.fp8_query_dim(i % 16)] for i in range(d)] for row in range(8)])
    q_mem, k_mem, v_mem = stage_memory(q_tile), fp8_memory(k), fp8_memory(v)
    zero = [[0.0] * 4 for _ in range(32)]
    for warp in range(P.WARPS):
        s = zero
        for pair in range(d // 32):
            qb = ldmatrix_x4(q_mem, [K.query_pair_source(lane, pair) for lane in range(32)], d // 8)
            kb = ldmatrix_x4_bytes(k_mem, [K.v_fragment_source(lane, pair, warp) for lane in range(32)], d // 16)
            for half in range(2):
                a = [[w[2 * half][0:2], w[2 * half + 1][0:2], w[2 * half][2:4], w[2 * half + 1][2:4]] for w in kb]
                s = mma(a, [regs[2 * half:2 * half + 2] for regs in qb], s)
        check_swapped_scores(s, q, k, warp)
        b = swapped_p_fragment(p, warp)
        for quad in range(d // 32):
            vb = ldmatrix_x4_bytes(v_mem, [K.v_fragment_source(lane, quad, warp) for lane in range(32)], d // 16, True)
            for parity, selector in enumerate(K.FP8_COLUMN_SELECTORS):
                low = [permute(regs[0], regs[1], selector) for regs in vb]
                high = [permute(regs[2], regs[3], selector) for regs in vb]
                a = [[lo[0:2], hi[0:2], lo[2:4], hi[2:4]] for lo, hi in zip(low, high)]
                check_swapped_values(mma(a, b, zero), p, v, warp, 2 * quad + parity, True)
    columns = [K.swapped_column(lane, tile, i, True) for lane in range(32) for tile in range(d // 16)
               for i in range(0, 4, 2)]
    assert sorted(columns) == [c for c in range(d) for _ in range(4)]


# ---------------------------------------------------------------------------------------------- the arithmetic
def random_case(batch=3, sq=3, hq=8, hkv=2, d=64, capacity=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=gen)
    k = torch.randn(batch, capacity, hkv, d, generator=gen)
    v = torch.randn(batch, capacity, hkv, d, generator=gen)
    return q, k, v


def combine(outs, lses):
    """The combine kernel's arithmetic on the splits' normalised partials."""
    lse = torch.stack(lses)  # (splits, B, Hq, Sq)
    top = lse.max(dim=0).values
    ref = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - ref)
    total = weights.sum(dim=0)
    w = weights.permute(0, 1, 3, 2)[..., None]  # (splits, B, Sq, Hq, 1)
    out = (torch.stack(outs) * w).sum(dim=0) / torch.where(total > 0, total, 1.0).permute(0, 2, 1)[..., None]
    return out, torch.where(total > 0, ref + torch.log(total), torch.full_like(total, float("-inf")))


@pytest.mark.parametrize("dv", [64, 128, 192, 256, 512])
def test_combine_compiles_unrolled_without_spills(dv):
    """The combine (a warp per row's chunk of 128 or 64 columns) compiles for every head dim, decode's and MLA's,
    without spills; the unrolled loop reads UNROLL splits' partials with one vector load a lane each (16 bytes at
    128 columns, 8 at 64), and its grid covers every (row, chunk)."""
    from nvfly.ops.attention import combine_kernel as C
    rows, splits = 96, 9
    kernel = C.attention_combine_kernel.compile(
        nvfly.TensorDesc(nvfly.f32, (splits * rows, dv)), nvfly.TensorDesc(nvfly.f32, (splits * rows,)),
        nvfly.TensorDesc(nvfly.bf16, (2, 3, 16, dv)), nvfly.TensorDesc(nvfly.f32, (2, 16, 3)), rows, 16, splits,
        SQ=3, DV=dv, block=C.WARPS * 32, target="sm_90a")
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    wide = "LDG.E.128" if C.chunk_columns(dv) == 128 else "LDG.E.64"
    assert kernel.count(wide) >= C.UNROLL + 1  # the unrolled loop's and the tail's
    chunks = dv // C.chunk_columns(dv)
    assert C.combine_grid(rows, dv) * C.WARPS >= rows * chunks > (C.combine_grid(rows, dv) - 1) * C.WARPS


@pytest.mark.parametrize("splits", [2, 5])
def test_split_and_combine_equal_the_whole(splits):
    """Each split attends its stages (plan.split_range of its own sequence's length), the combine merges them: the
    result is the reference's, with a length-0 sequence and queries before a length-1 sequence's start giving
    zeros and -inf."""
    q, k, v = random_case()
    seqlens = torch.tensor([0, 1, 300])
    outs, lses = [], []
    for split in range(splits):
        ranges = [P.split_range(int(n), splits, split) for n in seqlens]
        lo = torch.tensor([b * P.BLOCK_N for b, _ in ranges])
        hi = torch.tensor([e * P.BLOCK_N for _, e in ranges])

        def in_split(b, h, q_idx, kv_idx):
            return (kv_idx >= lo[b]) & (kv_idx < hi[b])
        out, lse = reference(q, k, v, cache_seqlens=seqlens, mask_mod=in_split)
        outs.append(out)
        lses.append(lse)
    out, lse = combine(outs, lses)
    want_out, want_lse = reference(q, k, v, cache_seqlens=seqlens)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)
    assert torch.all(want_out[0] == 0) and torch.all(torch.isinf(want_lse[0]))
    assert torch.all(want_out[1, :2] == 0) and torch.all(torch.isfinite(want_lse[1, :, 2]))
    assert not torch.isnan(out).any()


def random_block_mask(batch, heads, blocks, kv_block=128, seed=0, full=True, mask_mod=None):
    """A BlockMask (one query block) with random partial, full (``full``) and empty KV blocks per (batch, head),
    listed in a random order with garbage past each count, as from_kv_blocks takes them."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3 if full else 2, (batch, heads, blocks), generator=gen)  # 0 empty, 1 partial, 2 full

    def listed(value):
        num = (kind == value).sum(-1, keepdim=True).to(torch.int32)
        order = torch.argsort(torch.rand(batch, heads, blocks, generator=gen) + (kind != value) * 2.0, dim=-1)
        indices = torch.where(torch.arange(blocks) < num, order, torch.randint(0, blocks, order.shape,
                                                                              generator=gen))
        return num, indices[:, :, None].to(torch.int32)
    num, indices = listed(1)
    full_num, full_indices = listed(2) if full else (None, None)
    return BlockMask.from_kv_blocks(num, indices, full_num, full_indices, BLOCK_SIZE=(128, kv_block),
                                    mask_mod=mask_mod), kind


def head_parity(b, h, q_idx, kv_idx):
    return (kv_idx + h + b) % 3 != 0


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads,kv_block", [(8, 128), (1, 192)])
def test_block_mask_tables_with_splits_equal_the_reference(splits, heads, kv_block):
    """The kernel's block-mask arithmetic: a KV head's CTAs read the stages in stage_list[:stage_count] (split as
    plan.split_range splits a sequence's stages), each row keeps a key of a full block, of a partial block where
    mask_mod does, none of an empty block; combined, that is the reference's BlockMask (per-head masks under GQA,
    ragged lengths, a split beginning mid-block)."""
    q, k, v = random_case(capacity=700)
    batch, sq, hq, _ = q.shape
    hkv, group = k.shape[2], hq // k.shape[2]
    seqlens = torch.tensor([0, 300, 700])
    mask, _ = random_block_mask(batch, heads, -(-700 // kv_block), kv_block, mask_mod=head_parity)
    kv_state, stage_list, stage_count = kv_options.block_mask_tables(mask, batch, hq, hkv,
                                                                     seqlens.to(torch.int32), 700)
    assert stage_list.dtype == stage_count.dtype == kv_state.dtype == torch.int32
    keys = torch.arange(700)
    outs, lses = [], []
    for split in range(splits):
        allowed = torch.zeros(batch, hq, 700, dtype=torch.bool)
        for b in range(batch):
            for h in range(hq):
                count = int(stage_count[b, h // group])
                per_split = -(-count // splits)
                stages = stage_list[b, h // group, split * per_split:min(count, (split + 1) * per_split)].long()
                in_split = torch.isin(keys // P.BLOCK_N, stages)
                state = kv_state[b, h, keys // kv_block]
                kept = (state == K.BLOCK_FULL) | ((state == K.BLOCK_PARTIAL) & head_parity(b, h, 0, keys))
                allowed[b, h] = in_split & kept

        def in_split_mask(b, h, q_idx, kv_idx):
            return allowed[int(b)][h.reshape(-1)][:, kv_idx.reshape(-1)][:, None, :]
        out, lse = reference(q, k, v, cache_seqlens=seqlens, mask_mod=in_split_mask)
        outs.append(out)
        lses.append(lse)
    out, lse = combine(outs, lses)
    want_out, want_lse = reference(q, k, v, cache_seqlens=seqlens, block_mask=mask)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse)
    assert not torch.allclose(want_out, reference(q, k, v, cache_seqlens=seqlens)[0])  # the mask masks
    # nothing past a sequence or in a block empty for every head of the group is listed
    for b in range(batch):
        for g in range(hkv):
            listed = stage_list[b, g, :int(stage_count[b, g])].long()
            assert torch.all(listed[1:] > listed[:-1]) and torch.all(listed < -(-int(seqlens[b]) // P.BLOCK_N))
            heads_state = kv_state[b, g * group:(g + 1) * group]
            blocks = listed * P.BLOCK_N // kv_block
            assert torch.all((heads_state[:, blocks] != K.BLOCK_EMPTY).any(0))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_reference_block_mask_is_flex_attention():
    """The reference's BlockMask semantics are flex_attention's (one query block at the sequence's end, uniform
    lengths): create_block_mask of a sliding window, q_idx shifted to the queries' positions."""
    from torch.nn.attention.flex_attention import flex_attention
    q, k, v = random_case(batch=2, sq=4, hq=8, hkv=2, capacity=640)
    window = M.sliding_window(200)

    def shifted(b, h, q_idx, kv_idx):  # flex's q_idx 0..Sq-1 are positions 636..639
        return window(b, h, q_idx + 636, kv_idx)
    mask = create_block_mask(shifted, 2, 1, 4, 640, device="cpu")
    mask.mask_mod = window  # decode calls mask_mod with positions
    want = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=create_block_mask(
        shifted, 2, 1, 4, 640, device="cpu"), enable_gqa=True).transpose(1, 2)
    out, _ = reference(q, k, v, block_mask=mask, causal=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum()) < 2 * 5  # blocks were skipped


def test_sliced_prefill_mask_with_a_positional_mask_mod():
    """A prefill BlockMask sliced at the queries' block (flex's decode recipe) with mask_mod given for its partial
    blocks: the reference equals the plain mask, and the kernel's tables list only the window's stages."""
    q, k, v = random_case(batch=2, sq=4, hq=8, hkv=2, capacity=640)
    window = M.sliding_window(200)

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & window(b, h, q_idx, kv_idx)
    sliced = create_block_mask(causal_window, 2, 1, 1024, 1024, device="cpu")[:, :, 636 // 128]
    out, lse = reference(q, k, v, block_mask=sliced, mask_mod=causal_window)
    want, want_lse = reference(q, k, v, mask_mod=window)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    _, _, count = kv_options.block_mask_tables(sliced, 2, 8, 2, torch.full((2,), 640, dtype=torch.int32), 640)
    assert torch.equal(count, torch.full((2, 2), 6, dtype=torch.int32))  # stages 4-9 of 10: blocks 2-4 of 5


def test_reference_dequantises_fp8():
    """fp8 caches in the reference: value * its KV head's scale (per tensor and per head), in float32."""
    q, k, v = random_case(hq=8, hkv=2)
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor(0.25), torch.tensor([0.5, 2.0])
    out, lse = reference(q, k8, v8, k_scale=k_scale, v_scale=v_scale)
    want, want_lse = reference(q, k8.float() * 0.25, v8.float() * v_scale[:, None])
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    plain, _ = reference(q, k8, v8)  # no scale: 1
    torch.testing.assert_close(plain, reference(q, k8.float(), v8.float())[0])


def test_reference_matches_sdpa():
    q, k, v = random_case(batch=2, sq=1, capacity=100)
    out, _ = reference(q, k, v, causal=False)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_paged_reference_reads_the_pages():
    q, k, v = random_case(capacity=256)
    page = 16
    pages = k.shape[1] // page
    perm = torch.randperm(k.shape[0] * pages, generator=torch.Generator().manual_seed(1))
    k_pages = torch.empty(k.shape[0] * pages, page, *k.shape[2:])
    v_pages = torch.empty_like(k_pages)
    k_pages[perm] = k.reshape(-1, page, *k.shape[2:])
    v_pages[perm] = v.reshape(-1, page, *v.shape[2:])
    table = perm.view(k.shape[0], pages).to(torch.int32)
    seqlens = torch.tensor([5, 200, 256])
    got = reference(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table)
    want = reference(q, k, v, cache_seqlens=seqlens)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------- argument errors
def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


def fp8(*shape):
    return torch.zeros(*shape, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("make,kind,needle", [
    (lambda: (bf16(2, 1, 12, 64), bf16(2, 32, 5, 64), bf16(2, 32, 5, 64), {}), ValueError, "q: 12 query heads"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64).half(), bf16(2, 32, 2, 64), {}), TypeError, "k_cache: dtype"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 64, 2, 32).transpose(1, 3), bf16(2, 32, 2, 64), {}), ValueError,
     "k_cache: the last dimension must be contiguous"),
    (lambda: (bf16(2, 17, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64), {}), ValueError, "q: 17 query tokens"),
    (lambda: (bf16(2, 1, 8, 96), bf16(2, 32, 2, 96), bf16(2, 32, 2, 96), {}), ValueError, "q: head dim 96"),
    (lambda: (bf16(2, 1, 8, 64), bf16(8, 16, 2, 64), bf16(8, 16, 2, 64),
              {"block_table": torch.zeros(3, 4, dtype=torch.int32)}), ValueError, "block_table: 3 rows"),
    (lambda: (bf16(2, 1, 8, 64), bf16(8, 16, 2, 64), bf16(8, 16, 2, 64),
              {"block_table": torch.zeros(2, 4, dtype=torch.int64)}), TypeError, "block_table: expected int32"),
    (lambda: (bf16(2, 1, 8, 64), bf16(8, 16, 2, 64), bf16(8, 16, 2, 64),
              {"block_table": torch.full((2, 4), 8, dtype=torch.int32)}), ValueError, "block_table: page numbers"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64),
              {"cache_seqlens": torch.tensor([3, 33], dtype=torch.int32)}), ValueError, "cache_seqlens: lengths"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64),
              {"cache_seqlens": torch.tensor([3], dtype=torch.int32)}), ValueError, "cache_seqlens: 1 lengths"),
    (lambda: (bf16(2, 1, 8, 64), bf16(3, 32, 2, 64), bf16(3, 32, 2, 64), {}), ValueError, "k_cache: 3 sequences"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64), {}), ValueError, "q: on cpu"),
    # fp8 caches and their scales
    (lambda: (bf16(2, 1, 8, 64), fp8(2, 32, 2, 64), bf16(2, 32, 2, 64), {}), TypeError,
     "v_cache: dtype torch.bfloat16: with a torch.float8_e4m3fn k_cache"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), fp8(2, 32, 2, 64), {}), TypeError, "v_cache: dtype"),
    (lambda: (bf16(2, 1, 8, 64), fp8(2, 32, 2, 64), fp8(2, 32, 2, 64), {"k_scale": torch.ones(3)}), ValueError,
     r"k_scale: shape \(3,\); expected \(\) or \(1,\) \(per tensor\) or \(2,\)"),
    (lambda: (bf16(2, 1, 8, 64), fp8(2, 32, 2, 64), fp8(2, 32, 2, 64), {"v_scale": torch.ones(2).half()}),
     TypeError, "v_scale: expected float32"),
    (lambda: (bf16(2, 1, 8, 64), fp8(2, 32, 2, 64), fp8(2, 32, 2, 64), {"v_scale": 0.5}), TypeError,
     "v_scale: expected a float32 torch.Tensor"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64), {"k_scale": torch.ones(())}), ValueError,
     "k_scale: given for torch.bfloat16 caches"),
    (lambda: (bf16(2, 1, 8, 64), fp8(2, 32, 2, 64)[:, :, :, :48], fp8(2, 32, 2, 64), {}), ValueError,
     "k_cache: head dim 48"),
    # block masks
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64), {"block_mask": "causal"}), TypeError,
     "block_mask: expected a flex_attention BlockMask"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": random_block_mask(2, 8, 8, kv_block=32)[0]}), ValueError,
     "block_mask: KV block size 32 is not a multiple of the kernel's 64-key stage"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": random_block_mask(2, 4, 2)[0]}), ValueError,
     r"block_mask: kv_num_blocks shape \(2, 4, 1\); expected \(1 or 2, 1 or 8, 1\)"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": create_block_mask(M.sliding_window(64), 2, 8, 256, 256, device="cpu")}), ValueError,
     "block_mask: 2 query blocks; decode takes one"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 512, 2, 64), bf16(2, 512, 2, 64),
              {"block_mask": random_block_mask(2, 8, 2)[0]}), ValueError,
     "block_mask: 2 KV blocks of 128 cover 256 keys, the cache holds 512"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": random_block_mask(2, 8, 2, mask_mod=head_parity)[0],
               "mask_mod": M.sliding_window(64)}), ValueError, "mask_mod: differs from the block mask's own mask_mod"),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": create_block_mask(M.sliding_window(64), 2, 1, 1024, 256, device="cpu")[:, :, 7]}),
     ValueError, "block_mask: a sliced mask's mask_mod is torch's placeholder; pass mask_mod="),
    (lambda: (bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64),
              {"block_mask": BlockMask.from_kv_blocks(torch.full((2, 8, 1), 2, dtype=torch.int32),
                                                      torch.full((2, 8, 1, 2), 5, dtype=torch.int32),
                                                      compute_q_blocks=False)}),
     ValueError, r"block_mask: kv_num_blocks or its indices out of range \(0..2\)"),
])
def test_bad_arguments_raise_naming_the_argument(make, kind, needle):
    q, k, v, kwargs = make()
    with pytest.raises(kind, match=f"attention.decode: {needle}"):
        attention.decode(q, k, v, **kwargs)


def test_eligibility_gives_reasons():
    assert "not CUDA" in attention.eligibility(bf16(2, 1, 8, 64), bf16(2, 32, 2, 64), bf16(2, 32, 2, 64))
    assert "query heads" in attention.eligibility(bf16(2, 1, 6, 64), bf16(2, 32, 4, 64), bf16(2, 32, 4, 64))
    assert "k_scale: shape" in attention.eligibility(bf16(2, 1, 8, 64), fp8(2, 32, 2, 64), fp8(2, 32, 2, 64),
                                                     k_scale=torch.ones(4))
    assert "not a multiple of the kernel's 64-key stage" in attention.eligibility(
        bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64), block_mask=random_block_mask(2, 8, 3, 96)[0])


# ---------------------------------------------------------------------------------------------- host path
@pytest.fixture
def cpu_launches(recorded_launches, monkeypatch):
    """decode's host path on CPU tensors: kernels compile and 'launch' through the real binder (conftest's
    recorded_launches), on a 132-SM device; split plans keep the combine kernel (the launches these tests count:
    the default in-kernel fix-up's host path is tests/test_attention_decode_combine_cpu.py's)."""
    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_sm_count", lambda device: 132)
    api._CALLS.clear()  # cached calls hold prepared launches bound to earlier tests' recorders
    with api.plan_options(fixup_combine=False):
        yield recorded_launches
    api._CALLS.clear()


def test_host_path_launches_the_decode_kernel(cpu_launches):
    q, k, v = bf16(2, 1, 8, 64), bf16(2, 4096, 2, 64), bf16(2, 4096, 2, 64)
    out, lse = attention.decode(q, k, v, cache_seqlens=torch.tensor([4096, 3], dtype=torch.int32), splits=1,
                                return_lse=True)
    assert out.shape == (2, 1, 8, 64) and lse.shape == (2, 8, 1) and lse.dtype == torch.float32
    assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_decode_kernel", (1, 2, 2))]
    assert out.data_ptr() in cpu_launches[0][2] and lse.data_ptr() in cpu_launches[0][2]


def test_host_path_splits_then_combines(cpu_launches):
    """Paged, 48/8 at Sq = 8 (one 64-row tile), split by the heuristic: the decode grid is (splits, Hkv, B), then
    the combine runs a warp per (sequence, token, head) row (its 128 columns)."""
    k, v = bf16(64, 64, 8, 128), bf16(64, 64, 8, 128)
    table = torch.randperm(64).view(1, 64).to(torch.int32)
    q = bf16(1, 8, 48, 128)
    out = attention.decode(q, k, v, block_table=table)
    plan = P.decode_plan(1, 8, 8, 6, 128, 128, 4096, 132, paged=True, page_size=64)
    assert plan.splits > 1 and plan.m_tiles == 1
    assert [(name, grid) for name, grid, _ in cpu_launches] == [
        ("attention_decode_kernel", (plan.splits, 8, 1)), ("attention_combine_kernel", (8 * 48 // 4, 1, 1))]
    assert out.data_ptr() in cpu_launches[1][2]


def test_host_path_passes_captured_tensors(cpu_launches):
    slopes = torch.tensor(M.alibi_slopes(8))
    q, k, v = bf16(1, 1, 8, 64), bf16(1, 256, 2, 64), bf16(1, 256, 2, 64)
    attention.decode(q, k, v, score_mod=M.alibi(slopes), splits=1)
    params = cpu_launches[0][2]
    assert len(cpu_launches) == 1 and any(p == slopes.data_ptr() for p in params)


def test_host_path_passes_fp8_caches_as_bytes_with_scales(cpu_launches):
    q, k, v = bf16(2, 1, 8, 64), fp8(2, 256, 2, 64), fp8(2, 256, 2, 64)
    attention.decode(q, k, v, k_scale=torch.tensor([0.5, 2.0]), v_scale=torch.tensor(3.0), splits=1)
    attention.decode(q, k, v, splits=1)  # no scales: 1
    assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel"] * 2
    assert all(k.data_ptr() in params and v.data_ptr() in params for _, _, params in cpu_launches)


def test_host_path_passes_block_mask_tables(cpu_launches):
    """A block mask's tables: written by one launch (grid (Hkv, B)) from the mask's tensors and the lengths, read by
    the decode launch after it; then split and combined."""
    q, k, v = bf16(2, 4, 8, 64), bf16(2, 512, 2, 64), bf16(2, 512, 2, 64)
    mask, _ = random_block_mask(2, 1, 4, 256, mask_mod=head_parity)
    lengths = torch.tensor([512, 100], dtype=torch.int32)
    out = attention.decode(q, k, v, block_mask=mask, splits=3, cache_seqlens=lengths)
    assert [(name, grid) for name, grid, _ in cpu_launches] == [
        ("block_mask_tables_kernel", (2, 2, 1)), ("attention_decode_kernel", (3, 2, 2)),
        ("attention_combine_kernel", (2 * 4 * 8 // 4, 1, 1))]
    assert out.shape == (2, 4, 8, 64)
    tables, decode_params = cpu_launches[0][2], cpu_launches[1][2]
    for t in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, lengths):
        assert t.data_ptr() in tables
    # kv_state of the mask's 4 blocks, stage_list of the cache's 8 stages
    kv_state, stage_list, stage_count = scratch.int32_tables(q.device, 0, ((2, 8, 4), (2, 2, 8), (2, 2)))
    for t in (kv_state, stage_list, stage_count):
        assert t.data_ptr() in tables and t.data_ptr() in decode_params


def test_host_path_binds_a_sliced_mask(cpu_launches):
    """flex's decode recipe (a prefill mask sliced at the queries' block): its tables are strided views, bound as
    they are (their strides in the tables launch's parameters)."""
    q, k, v = bf16(2, 4, 8, 64), bf16(2, 640, 2, 64), bf16(2, 640, 2, 64)
    window = M.sliding_window(200)

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & window(b, h, q_idx, kv_idx)
    sliced = create_block_mask(causal_window, 2, 1, 1024, 1024, device="cpu")[:, :, 636 // 128]
    assert not sliced.kv_indices.is_contiguous()
    attention.decode(q, k, v, block_mask=sliced, mask_mod=causal_window, splits=1)
    (name, grid, params), _ = cpu_launches
    assert name == "block_mask_tables_kernel" and grid == (2, 2, 1)
    assert sliced.kv_indices.data_ptr() in params and sliced.full_kv_indices.data_ptr() in params
    assert all(stride in params for stride in sliced.kv_indices.stride())


def test_a_block_mask_signature_checks_and_plans_once(counted_host):
    """A block-mask call is cached like the others: a new mask of the same layouts and mask_mod (other blocks,
    other tensors) checks and plans nothing and binds its tensors; per call only the tables, decode and combine launch
    (no torch operation but out's allocation)."""
    counts, launches = counted_host
    q, k, v = bf16(2, 1, 8, 64), bf16(2, 1024, 2, 64), bf16(2, 1024, 2, 64)
    masks = [random_block_mask(2, 8, 8, seed=seed)[0] for seed in (0, 1)]
    attention.decode(q, k, v, block_mask=masks[0], validate=False)
    assert counts == {"check": 2, "scales": 1, "plan": 1, "full": 1}  # the mask's checks need the capacity
    launches.clear()
    ops, _ = dispatched(lambda: attention.decode(q, k, v, block_mask=masks[1], validate=False))
    assert ops == ["aten.empty.memory_format"]  # out
    assert counts == {"check": 2, "scales": 1, "plan": 1, "full": 1} and len(api._CALLS) == 1
    plan = P.decode_plan(2, 1, 2, 4, 64, 64, 1024, 132, kv_block=128)
    assert [name for name, _, _ in launches] == ["block_mask_tables_kernel", "attention_decode_kernel"] + (
        ["attention_combine_kernel"] if plan.splits > 1 else [])
    assert masks[1].kv_indices.data_ptr() in launches[0][2] and masks[0].kv_indices.data_ptr() not in launches[0][2]
    attention.decode(q, k, v, block_mask=masks[1], validate=False, mask_mod=head_parity)  # another signature
    assert counts["check"] == 4 and len(api._CALLS) == 2


def test_a_block_mask_hit_validates_its_block_numbers(cpu_launches):
    """With validate, a cached block-mask call still reads its block numbers (out of range: the error), and
    without it does not."""
    q, k, v = bf16(2, 1, 8, 64), bf16(2, 512, 2, 64), bf16(2, 512, 2, 64)
    mask, _ = random_block_mask(2, 8, 4, 128)
    attention.decode(q, k, v, block_mask=mask)
    mask.kv_num_blocks[1, 3, 0] = 5
    with pytest.raises(ValueError, match="decode: block_mask: kv_num_blocks or its indices out of range"):
        attention.decode(q, k, v, block_mask=mask)
    attention.decode(q, k, v, block_mask=mask, validate=False)
    assert len(api._CALLS) == 1


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "block mask"])
def test_heads_first_binding_launches_as_the_decode_layout(cpu_launches, masked):
    """``bound_decode(heads_first=True)`` on flex's (B, H, S, D) views packs the parameters the decode-layout binding
    packs (its first call through the transposes, later ones the tensors as they are: no transpose), and returns out
    as the (B, Hq, Sq, Dv) view of (B, Sq, Hq, Dv) memory, with the LSE."""
    q, k, v = torch.randn(2, 1, 8, 64).to(torch.bfloat16), bf16(2, 1024, 2, 64), bf16(2, 1024, 2, 64)
    mask = random_block_mask(2, 8, 8)[0] if masked else None
    layout = attention.bound_decode(q, k, v, causal=False, block_mask=mask, return_lse=True)
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    heads_first = attention.bound_decode(*heads, causal=False, block_mask=mask, return_lse=True, heads_first=True)
    for call in range(2):  # binding, then bound
        cpu_launches.clear()
        out, lse = layout(q, k, v, 0.125, mask)
        want = list(cpu_launches)
        cpu_launches.clear()
        ops, (out_h, lse_h) = dispatched(lambda: heads_first(*heads, 0.125, mask))
        assert (call == 0) == ("aten.transpose.int" in ops)
        ours = {out.data_ptr(): out_h.data_ptr(), lse.data_ptr(): lse_h.data_ptr()}
        assert cpu_launches == [(name, grid, tuple(ours.get(p, p) for p in params)) for name, grid, params in want]
        assert [name for name, _, _ in want] == ["block_mask_tables_kernel"] * masked + [
            "attention_decode_kernel", "attention_combine_kernel"]
        assert out_h.shape == (2, 8, 1, 64) and out_h.stride() == out.transpose(1, 2).stride()
        assert lse_h.shape == lse.shape == (2, 8, 1)


@pytest.fixture
def counted_host(cpu_launches, monkeypatch):
    """cpu_launches, and how often decode's host path checked, planned and filled default lengths."""
    counts = {"check": 0, "scales": 0, "plan": 0, "full": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(api, "_check", counting("check", api._check))
    monkeypatch.setattr(api, "check_scales", counting("scales", api.check_scales))
    monkeypatch.setattr(api, "_plan", counting("plan", api._plan))
    monkeypatch.setattr(torch, "full", counting("full", torch.full))
    monkeypatch.setattr(scratch, "_CONSTANTS", {})
    api._CHECKED.clear()
    return counts, cpu_launches


def test_a_signature_checks_and_plans_once(counted_host):
    """The second call of a signature neither checks nor plans nor fills lengths; the prepared launches pack exactly
    the parameters that the first call's full launch path packed (the same tensors: the same bytes)."""
    counts, launches = counted_host
    q, k, v = bf16(1, 1, 48, 128), bf16(1, 32768, 8, 128), bf16(1, 32768, 8, 128)
    out = torch.empty(1, 1, 48, 128, dtype=torch.bfloat16)
    attention.decode(q, k, v, out=out)
    assert counts == {"check": 1, "scales": 1, "plan": 1, "full": 1}
    first = list(launches)
    launches.clear()
    for _ in range(3):
        attention.decode(q, k, v, out=out)
    assert counts == {"check": 1, "scales": 1, "plan": 1, "full": 1}
    assert [name for name, _, _ in first] == ["attention_decode_kernel", "attention_combine_kernel"]
    assert launches == first * 3
    lengths = scratch.constant(q.device, ("decode cache_seqlens", 1, 32768), lambda: pytest.fail("not kept"))
    assert lengths.tolist() == [32768] and lengths.data_ptr() in first[0][2]


def test_a_hit_binds_the_call_tensors(counted_host):
    """New tensors of the same signature: another address of every tensor, the same plan; int64 lengths converted
    on every call; a new signature plans again."""
    counts, launches = counted_host
    q, k, v = bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64)
    lengths = torch.tensor([256, 3])
    out = attention.decode(q, k, v, cache_seqlens=lengths, splits=2)  # kept: out2 is another tensor
    q2, k2, v2 = bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64)
    out2 = attention.decode(q2, k2, v2, cache_seqlens=torch.tensor([5, 6]), splits=2)
    assert counts["plan"] == 1 and len(api._CALLS) == 1
    (_, grid, params), (_, _, params2), (_, grid2, params3), (_, _, params4) = launches
    assert grid == grid2 == (2, 2, 2)
    assert all(t.data_ptr() in params3 for t in (q2, k2, v2)) and q.data_ptr() in params
    assert not {t.data_ptr() for t in (q, k, v)} & set(params3)  # alive: no other tensor's address
    assert out.data_ptr() in params2 and out2.data_ptr() in params4 and params2 != params4
    attention.decode(q2, k2, v2, cache_seqlens=torch.tensor([5, 6]), splits=3)
    assert counts["plan"] == 2 and len(api._CALLS) == 2


def test_a_hit_keeps_validating_values(counted_host):
    counts, _ = counted_host
    q, k, v = bf16(2, 1, 8, 64), bf16(2, 256, 2, 64), bf16(2, 256, 2, 64)
    attention.decode(q, k, v, cache_seqlens=torch.tensor([256, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="decode: cache_seqlens: lengths from 3 to 257"):
        attention.decode(q, k, v, cache_seqlens=torch.tensor([257, 3], dtype=torch.int32))
    attention.decode(q, k, v, cache_seqlens=torch.tensor([257, 3], dtype=torch.int32), validate=False)
    with pytest.raises(ValueError, match="decode: out: expected a contiguous"):  # another signature: checked
        attention.decode(q, k, v, cache_seqlens=torch.tensor([256, 3], dtype=torch.int32),
                         out=torch.empty(2, 1, 8, 32, dtype=torch.bfloat16))
    assert counts["check"] == 1 and len(api._CALLS) == 1  # the layouts checked once; a failed call is not kept


def test_a_hit_rereads_the_mods_tensors(cpu_launches):
    """A function's captured tensor rebound to another shape: the next call launches it through the general path."""
    q, k, v = bf16(1, 1, 8, 64), bf16(1, 256, 2, 64), bf16(1, 256, 2, 64)
    bias = torch.zeros(8)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    attention.decode(q, k, v, score_mod=biased, splits=1)
    bias = torch.zeros(16)
    attention.decode(q, k, v, score_mod=biased, splits=1)
    assert len(cpu_launches) == 2 and bias.data_ptr() in cpu_launches[1][2]


def test_constants_are_kept_outside_capture_only(monkeypatch):
    monkeypatch.setattr(scratch, "_CONSTANTS", {})
    made = []

    def make():
        made.append(torch.zeros(2))
        return made[-1]
    cuda = torch.device("cuda", 0)  # never touched: the tensors made are CPU ones
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert scratch.constant(cuda, "test constant", make) is made[0]
    assert scratch.constant(cuda, "test constant", make) is made[1]  # captured: this call's own
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kept = scratch.constant(cuda, "test constant", make)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert scratch.constant(cuda, "test constant", make) is kept is made[2] and len(made) == 3


# ---------------------------------------------------------------------------------------------- mods
GLOBAL_BIAS = torch.zeros(4, 4)


def test_captured_tensors_come_from_closures_and_globals():
    slopes = torch.ones(8)

    def uses_both(score, b, h, q_idx, kv_idx):
        return score + slopes[h] + GLOBAL_BIAS[h, kv_idx]
    found = M.captured_tensors(M.Mods(uses_both, M.document_mask(GLOBAL_BIAS)))
    assert len(found) == 2 and found[0] is slopes and found[1] is GLOBAL_BIAS


def test_captured_tensors_of_composed_mods():
    """A mod built from another (``causal & document(...)``) captures what the inner one captures."""
    ids = torch.zeros(2, 64, dtype=torch.int32)
    document = M.document_mask(ids)

    def causal_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & document(b, h, q_idx, kv_idx)
    assert [t is ids for t in M.captured_tensors(M.Mods(mask_mod=causal_documents))] == [True]


def test_unsupported_torch_functions_are_named():
    def cumulative(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, 0)
    plan = P.decode_plan(1, 1, 1, 4, 64, 64, 1024, 132, splits=1)
    with pytest.raises(nvfly.CompileError, match="cumsum is not supported"):
        attention.compile_kernels(plan, M.Mods(cumulative))


def test_branching_on_traced_values_is_refused():
    def branchy(b, h, q_idx, kv_idx):
        return kv_idx < 10 if q_idx > 5 else kv_idx > 3
    plan = P.decode_plan(1, 1, 1, 4, 64, 64, 1024, 132, splits=1)
    with pytest.raises(nvfly.CompileError, match="torch.where"):
        attention.compile_kernels(plan, M.Mods(None, branchy))


# ---------------------------------------------------------------------------------------------- compiled kernels
def check_sass(kernel, mma="HMMA.16816.F32.BF16"):
    ops = kernel.sass_opcodes()
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    assert kernel.resources.spill_stores == 0
    assert ops[mma] > 0
    assert ops["LDGSTS.E.BYPASS.128"] > 0   # 16-byte cp.async copies of K, V and Q
    assert ops["LDSM.16.M88.4"] > 0 and ops["LDSM.16.MT88.4"] > 0  # Q/K fragments, V transposed


FAMILIES = {
    "d64-sq1-g4": dict(sq=1, group=4, dqk=64, dv=64, splits=1),
    "d128-sq4-g8-paged16-split": dict(sq=4, group=8, dqk=128, dv=128, paged=True, page_size=16, splits=8),
    "d128-sq8-g6-64rows": dict(sq=8, group=6, dqk=128, dv=128, splits=1),
    "d128-sq1-g6-paged64-fp16": dict(sq=1, group=6, dqk=128, dv=128, paged=True, page_size=64, splits=1),
    "d256-sq2-g8-split": dict(sq=2, group=8, dqk=256, dv=256, splits=4),
    "d256-sq8-g8-64rows-paged128": dict(sq=8, group=8, dqk=256, dv=256, paged=True, page_size=128, splits=2),
    "dqk192-dv128-g16": dict(sq=1, group=16, dqk=192, dv=128, splits=1),
    "d64-sq1-g4-fp8": dict(sq=1, group=4, dqk=64, dv=64, splits=1, fp8=True),
    "d128-sq4-g8-paged16-split-fp8-blockmask": dict(sq=4, group=8, dqk=128, dv=128, paged=True, page_size=16,
                                                    splits=8, fp8=True, kv_block=128),
    "d128-sq1-g6-paged64-fp16-fp8": dict(sq=1, group=6, dqk=128, dv=128, paged=True, page_size=64, splits=1,
                                         fp8=True),
    "d256-sq8-g8-64rows-split-fp8": dict(sq=8, group=8, dqk=256, dv=256, splits=2, fp8=True),
    "d128-sq8-g6-64rows-blockmask256-window": dict(sq=8, group=6, dqk=128, dv=128, splits=1, kv_block=256),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_plan_families_compile_without_spills(name):
    spec = dict(FAMILIES[name])
    splits = spec.pop("splits")
    paged, page_size = spec.pop("paged", False), spec.pop("page_size", 0)
    fp8 = spec.get("fp8", False)
    plan = P.DecodePlan(paged=paged, page_size=page_size, causal=True,
                        stages=P.stages_for(spec["dqk"], spec["dv"], fp8), splits=splits,
                        row_warps=P.row_warps_for(spec["sq"] * spec["group"]), **spec)
    dtype = nvfly.f16 if "fp16" in name else nvfly.bf16
    mods = M.Mods(None, M.sliding_window(300)) if "window" in name else M.Mods()
    kernels = attention.compile_kernels(plan, mods, dtype=dtype, seqlen=1024)
    check_sass(kernels[0], "HMMA.16816.F32" if dtype == nvfly.f16 or fp8 else "HMMA.16816.F32.BF16")
    ops = kernels[0].sass_opcodes()
    assert (ops["F2FP.F16.E4M3.UNPACK_B"] > 0) == fp8  # e4m3 pairs converted in the kernel
    if fp8:
        check_fp8_conversion(kernels[0], plan)
    assert len(kernels) == (2 if splits > 1 else 1)
    if splits > 1:
        assert not any(op.startswith(("LDL", "STL")) for op in kernels[1].sass_opcodes())


def check_fp8_conversion(kernel, plan):
    """An fp8 plan's SASS: K and V fragments converted in registers, one F2FP.F16.E4M3.UNPACK_B a pair of a key
    slice the warp reads (unrolled once in the stage loop: row_warps > 1 loops over its slices), V's bytes gathered
    by one PRMT a pair of converts, no f16 -> f32 -> bf16 path (f16 -> f32 only for an f16 query tile's values, at
    most 8 a thread's 8-value load), no 16-bit tile (no 16-byte shared stores but the query tile's), f16
    tensor-core MMAs only, and no local memory."""
    ops = kernel.sass_opcodes()
    pairs = P.ROWS * (plan.dqk + plan.dv // plan.column_warps) // 2 // 32  # a lane's e4m3 pairs of one slice
    assert ops["F2FP.F16.E4M3.UNPACK_B"] == pairs
    assert ops["PRMT"] >= P.ROWS * plan.dv // plan.column_warps // 4 // 32
    query_loads = 2 * -(-plan.tile_rows * plan.dqk // 16 // plan.threads)
    assert ops["HADD2.F32"] <= 8 * query_loads and ops["STS.128"] <= query_loads
    assert ops["HMMA.16816.F32.BF16"] == 0 and ops["HMMA.16816.F32"] > 0
    assert not any(op.startswith(("LDL", "STL")) for op in ops) and kernel.resources.spill_stores == 0



# ---------------------------------------------------------------------------------------------- plan variants
def llama8b_fp8(sq, variant, batch=1, seqlen=131072):
    """Llama-8B's decode plan (32/8 heads, d 128, fp8 caches) under ``api.DECODE_VARIANTS[variant]``."""
    return P.decode_plan(batch, sq, 8, 4, 128, 128, seqlen, 132, fp8=True, **api.DECODE_VARIANTS[variant])


def test_decode_variants_change_only_their_options():
    """stages4: 4 fp8 stages, 3 CTAs an SM, the split count planned on those 396 slots; rows16 and warp16: 16-row
    tiles (two CTAs a KV head at Sq 8 / a warp a tile); the default plan is the plain plan: fp8 d 128 past 16 rows
    in 32-row warps (warp32), one long sequence split at the best wave efficiency (splits_full)."""
    for sq in (1, 4, 8):
        assert llama8b_fp8(sq, "default") == P.decode_plan(1, sq, 8, 4, 128, 128, 131072, 132, fp8=True)
    default, stages4 = llama8b_fp8(8, "default"), llama8b_fp8(8, "stages4")
    assert (default.stages, P.ctas_per_sm(default)) == (6, 2) and (stages4.stages, P.ctas_per_sm(stages4)) == (4, 3)
    assert stages4.warp_tiles == 1  # a forced depth keeps a tile a warp (warp32 at 4 stages spills)
    assert stages4.splits == P.num_splits(8 * stages4.m_tiles, 132 * 3, 131072 // P.BLOCK_N, split_efficiency=1.0)
    warp16, rows16 = llama8b_fp8(8, "warp16"), llama8b_fp8(8, "rows16")
    assert (warp16.row_warps, warp16.m_tiles, warp16.warp_tiles) == (2, 1, 1)
    assert (rows16.row_warps, rows16.m_tiles) == (1, 2)
    assert llama8b_fp8(1, "rows16") == llama8b_fp8(1, "default")  # 4 rows: one 16-row tile already
    both = llama8b_fp8(8, "lazy_stages4", batch=32, seqlen=4096)
    assert (both.stages, both.lazy_rescale, both.splits) == (4, True, 3)  # 256 CTAs fill less than 80% of 396
    assert llama8b_fp8(8, "lazy") == P.DecodePlan(**{**default.__dict__, "lazy_rescale": True})
    # B1 128K: 8 CTAs a split on 264 slots, 33 splits (every slot) at the best efficiency, 29 (232 CTAs) at FA3's
    assert (default.splits, llama8b_fp8(8, "splits_85").splits, llama8b_fp8(8, "splits_full").splits) == (33, 29, 33)
    assert llama8b_fp8(8, "default", batch=32, seqlen=4096).splits == 1
    assert P.decode_plan(16, 1, 8, 6, 128, 128, 32768, 132).splits == 2  # 128 CTAs: FA3's rule, as before
    warp32 = llama8b_fp8(8, "warp32")  # 32 rows: one warp's two tiles, 4 key warps
    assert warp32 == default
    assert (warp32.row_warps, warp32.warp_tiles, warp32.tile_rows, warp32.key_warps, warp32.m_tiles) == (1, 2, 32, 4, 1)
    assert not warp32.query_in_registers and warp32.stat_rows == 128 and warp32.partial_bytes <= warp32.ring_bytes
    assert llama8b_fp8(1, "warp32") == llama8b_fp8(1, "unswapped")  # 16 rows or fewer: one tile a warp
    assert P.decode_plan(1, 8, 8, 4, 128, 128, 4096, 132).warp_tiles == 1  # 16-bit caches: a tile a warp
    wide = P.decode_plan(1, 16, 8, 4, 128, 128, 4096, 132, fp8=True, warp_tiles=2)  # 64 rows: 2 x 32
    assert (wide.row_warps, wide.tile_rows, wide.key_warps) == (2, 64, 2)
    with pytest.raises(ValueError, match="plan_options: stages -1"):
        api.plan_options(stages=-1)
    with pytest.raises(ValueError, match="row_warps 3"):
        api.plan_options(row_warps=3)
    with pytest.raises(ValueError, match="split_efficiency -0.5"):
        api.plan_options(split_efficiency=-0.5)
    with pytest.raises(ValueError, match="warp_tiles 3"):
        P.decode_plan(1, 8, 8, 4, 128, 128, 4096, 132, warp_tiles=3)
    with pytest.raises(ValueError, match="larger than the ring"):
        P.decode_plan(1, 8, 8, 4, 128, 128, 4096, 132, fp8=True, warp_tiles=2, stages=2)


@pytest.mark.parametrize("variant", [name for name, options in api.DECODE_VARIANTS.items()
                                     if name != "default" and "wgmma" not in options])  # another kernel's switch
@pytest.mark.parametrize("sq", [1, 8])
def test_decode_variants_compile_without_spills(variant, sq):
    """Each variant's Llama-8B fp8 kernel: fp8 conversion in registers as the default's (one cvt a pair of the
    warp's slice: with warp32 once for its two row tiles, whose 64 HMMAs a slice share them), no local memory;
    stages4 asks for 3 CTAs an SM (.minnctapersm, hence at most 170 registers); lazy branches over O's
    multiplies on a warp vote (one a row tile)."""
    plan = llama8b_fp8(sq, variant)
    kernel = attention.compile_kernels(plan, M.Mods(), dtype=nvfly.bf16, seqlen=131072)[0]
    check_sass(kernel, "HMMA.16816.F32")
    check_fp8_conversion(kernel, plan)
    assert f".minnctapersm {P.ctas_per_sm(plan)}" in kernel.ptx
    assert kernel.dynamic_smem_bytes == plan.smem_bytes
    assert kernel.resources.registers * plan.threads * P.ctas_per_sm(plan) <= P.REGISTERS_PER_SM
    # a slice (once in the code): 2 a k16 step a tile; swapped (Sq 1): 1, m16 being the keys and O's columns
    hmma = (1 if plan.swapped else 2) * (plan.dqk + plan.dv) // 16 * plan.warp_tiles
    assert kernel.sass_opcodes()["HMMA.16816.F32"] == hmma
    assert kernel.sass_opcodes()["MOVM.16.MT88"] == (2 if plan.swapped else 0)  # Pᵀ's two 8 x 8 transposes
    assert kernel.sass_opcodes()["VOTE.ANY"] == (plan.warp_tiles if plan.lazy_rescale else 0)


def test_host_path_plans_with_the_plan_options(cpu_launches):
    """Inside ``plan_options`` decode launches the option's plan (its own signature: the default's call is not
    reused), outside the default again."""
    q, k, v = bf16(1, 8, 32, 128), fp8(1, 8192, 8, 128), fp8(1, 8192, 8, 128)
    attention.decode(q, k, v, splits=1)
    with api.plan_options(row_warps=1, warp_tiles=1):
        attention.decode(q, k, v, splits=1)
    with api.plan_options(stages=4):
        attention.decode(q, k, v, splits=1)
    attention.decode(q, k, v, splits=1)
    assert [grid for _, grid, _ in cpu_launches] == [(1, 8, 1), (2, 8, 1), (1, 8, 1), (1, 8, 1)]


# ---------------------------------------------------------------------------------------------- swapped operands
def test_swapped_plans_take_up_to_8_rows_and_decline_with_a_reason():
    """``swapped`` takes Sq·G <= 8 (Sq 1 at G 1-8, Sq 2 at G 4) as one 8-row tile a CTA, each warp a key slice,
    one warp a slice at any Dv (half of O's registers); more rows or m16 row options keep the plan without it,
    ``swap_declined`` saying why."""
    for sq, group, fp8, d in ((1, 4, False, 128), (1, 6, True, 128), (1, 8, False, 64), (2, 4, True, 256),
                              (1, 1, False, 192)):
        default = P.decode_plan(1, sq, 8, group, d, d, 131072, 132, fp8=fp8)
        plan = P.decode_plan(1, sq, 8, group, d, d, 131072, 132, fp8=fp8, swapped=True)
        assert P.swap_declined(sq, group) == ""
        assert (plan.swapped, plan.tile_rows, plan.m_tiles, plan.row_warps, plan.key_warps) == (True, 8, 1, 1, 4)
        assert (plan.column_warps, plan.threads, plan.stat_rows, plan.q_bytes) == (1, 128, 32, 16 * d)
        assert plan.query_in_registers == (d <= 128)
        assert (plan.stages, plan.splits) == (default.stages, default.splits)
    assert P.decode_plan(32, 1, 8, 4, 128, 128, 4096, 132, swapped=True, lazy_rescale=True).lazy_rescale
    for sq, group in ((2, 8), (4, 8), (16, 4), (1, 16)):
        assert f"Sq x G = {sq * group} query rows" in P.swap_declined(sq, group)
        assert (P.decode_plan(1, sq, 8, group, 128, 128, 4096, 132, swapped=True)
                == P.decode_plan(1, sq, 8, group, 128, 128, 4096, 132))
    assert "warp_tiles 2" in P.swap_declined(1, 8, warp_tiles=2) and "row_warps 2" in P.swap_declined(1, 4, 2)
    assert not P.decode_plan(1, 1, 8, 8, 128, 128, 4096, 132, row_warps=2, swapped=True).swapped
    assert api.DECODE_VARIANTS["swapped"] == {"swapped": True}


def test_swap_by_default_is_one_switch(monkeypatch):
    """Swapped by default (SWAP_BY_DEFAULT): every plan of at most 8 rows is swapped unless ``swapped=False`` (the
    ``unswapped`` variant) says otherwise, and larger ones are not; switched off, none is."""
    llama = dict(batch=1, kv_heads=8, group=4, dqk=128, dv=128, max_seqlen=4096, sm_count=132)
    monkeypatch.setattr(P, "SWAP_BY_DEFAULT", False)
    assert not P.decode_plan(sq=1, **llama).swapped
    monkeypatch.setattr(P, "SWAP_BY_DEFAULT", True)
    assert P.decode_plan(sq=1, **llama).swapped and P.decode_plan(sq=2, **llama).swapped
    assert not P.decode_plan(sq=4, **llama).swapped
    assert not P.decode_plan(sq=1, **llama, **api.DECODE_VARIANTS["unswapped"]).swapped


SWAPPED_FAMILIES = {
    # name: (decode_plan keyword arguments, mods)
    "d128-g4-bf16": (dict(group=4, dqk=128, dv=128, splits=1), "none"),
    "d128-g8-fp16-paged16-split": (dict(group=8, dqk=128, dv=128, paged=True, page_size=16, splits=4), "none"),
    "d128-sq2-g4-mods-lse": (dict(sq=2, group=4, dqk=128, dv=128, splits=1), "mods"),
    "d64-g4-split": (dict(group=4, dqk=64, dv=64, splits=3), "none"),
    "d256-g8-split": (dict(group=8, dqk=256, dv=256, splits=2), "none"),
    "dqk192-dv128-g6-paged64": (dict(group=6, dqk=192, dv=128, paged=True, page_size=64, splits=1), "none"),
    "d128-g6-lazy-blockmask128-window": (dict(group=6, dqk=128, dv=128, splits=2, kv_block=128, lazy_rescale=True),
                                         "window"),
    "d64-g4-fp8": (dict(group=4, dqk=64, dv=64, splits=1, fp8=True), "none"),
    "d128-g8-fp8-paged16-split": (dict(group=8, dqk=128, dv=128, paged=True, page_size=16, splits=5, fp8=True),
                                  "none"),
    "d128-g4-fp8-mods-blockmask128": (dict(group=4, dqk=128, dv=128, splits=1, fp8=True, kv_block=128), "mods"),
    "d256-g4-fp8-paged128-lazy": (dict(group=4, dqk=256, dv=256, paged=True, page_size=128, splits=2, fp8=True,
                                       lazy_rescale=True), "none"),
}


@pytest.mark.parametrize("name", SWAPPED_FAMILIES)
def test_swapped_plans_compile_without_spills(name):
    """The swapped kernel (16-bit and fp8 caches, d 64-256, paged, splits, mods, block masks, lazy rescaling): no
    local memory, one HMMA a k16 step of the warp's slice (Sᵀ's Dqk / 16 and Oᵀ's Dv / 16), Pᵀ by two movmatrix,
    Kᵀ non-transposed and V transposed ldmatrix, fp8 pairs converted once as the default's (check_fp8_conversion),
    the row maxima over the 8 lanes of a c (3 shuffles a row), the CTAs an SM that the plan counts on."""
    spec, mod = SWAPPED_FAMILIES[name]
    spec = dict(spec)
    splits = spec.pop("splits")
    plan = P.decode_plan(2, spec.pop("sq", 1), 2, spec.pop("group"), spec.pop("dqk"), spec.pop("dv"), 1024, 132,
                         splits=splits, swapped=True, fixup_combine=False, **spec)  # the counts below: no fix-up
    assert plan.swapped and plan.splits == splits
    mods = {"none": M.Mods(), "mods": M.Mods(M.soft_cap(20.0), M.sliding_window(300)),
            "window": M.Mods(None, M.sliding_window(300))}[mod]
    dtype = nvfly.f16 if "fp16" in name else nvfly.bf16
    kernels = attention.compile_kernels(plan, mods, dtype=dtype, seqlen=1024)
    kernel = kernels[0]
    check_sass(kernel, "HMMA.16816.F32" if dtype == nvfly.f16 or plan.fp8 else "HMMA.16816.F32.BF16")
    ops = kernel.sass_opcodes()
    mma = "HMMA.16816.F32" if dtype == nvfly.f16 or plan.fp8 else "HMMA.16816.F32.BF16"
    assert ops[mma] == (plan.dqk + plan.dv) // 16
    assert ops["MOVM.16.MT88"] == 2
    assert ops["SHFL.BFLY"] == 2 * 3 + 2 * 3  # each row's maximum a slice, its sum in the merge: lanes ^4, ^8, ^16
    assert (ops["F2FP.F16.E4M3.UNPACK_B"] > 0) == plan.fp8
    if plan.fp8:
        check_fp8_conversion(kernel, plan)
    assert ops["VOTE.ANY"] == (1 if plan.lazy_rescale else 0)
    assert f".minnctapersm {P.ctas_per_sm(plan)}" in kernel.ptx and kernel.dynamic_smem_bytes == plan.smem_bytes
    assert kernel.resources.registers * plan.threads * P.ctas_per_sm(plan) <= P.REGISTERS_PER_SM
    assert len(kernels) == (2 if splits > 1 else 1)


def test_host_path_plans_swapped_with_the_plan_option(cpu_launches, monkeypatch):
    """Inside ``plan_options(swapped=False)`` a Sq 1 G 4 call launches the m16-row plan, a Sq 4 G 8 call (32 rows)
    the default plan; outside, the default again: the swapped plan (one CTA a split and KV head)."""
    planned = []
    plan_of = api._plan
    monkeypatch.setattr(api, "_plan", lambda *a, **k: planned.append(plan_of(*a, **k)) or planned[-1])
    q, k, v = bf16(1, 1, 32, 128), bf16(1, 8192, 8, 128), bf16(1, 8192, 8, 128)
    with api.plan_options(**api.DECODE_VARIANTS["unswapped"]):
        attention.decode(q, k, v, splits=1)
        attention.decode(bf16(1, 4, 64, 128), k, v, splits=1)
    attention.decode(q, k, v, splits=1)
    assert [plan.swapped for plan in planned] == [False, False, True]
    assert [grid for _, grid, _ in cpu_launches] == [(1, 8, 1)] * 3


MOD_PLAN = P.decode_plan(2, 2, 2, 4, 128, 128, 1024, 132, splits=1)


@pytest.mark.parametrize("group,kv_block,batch_broadcast,head_broadcast,full", [
    (4, 128, False, False, True), (1, 64, True, True, False), (16, 256, True, False, True)])
def test_block_mask_tables_kernel_compiles(group, kv_block, batch_broadcast, head_broadcast, full):
    """The tables kernel: no local memory, and kv_state's read-back after its writes is a coherent load (no
    read-only LDG.E.CONSTANT anywhere)."""
    tables = P.MaskTablesPlan(group, kv_block, batch_broadcast, head_broadcast, full)
    kernel = attention.compile_mask_tables(tables, batch=3, kv_heads=2, seqlen=1000)
    ops = kernel.sass_opcodes()
    assert not any(op.startswith(("LDL", "STL")) for op in ops) and kernel.resources.spill_stores == 0
    assert ops["STG.E"] > 0 and ops["BAR.SYNC.DEFER_BLOCKING"] >= (4 if full else 3)
    assert not any(op.startswith("LDG") and "CONSTANT" in op for op in ops), sorted(ops)


def test_score_and_mask_mods_trace_into_the_kernel():
    """Soft-capping's tanh is the MUFU's (``tanh.approx.f32``, no IEEE division by the cap), with the sliding
    window's mask beside it."""
    capped = attention.compile_kernels(MOD_PLAN, M.Mods(M.soft_cap(30.0), M.sliding_window(128)))[0]
    assert "tanh.approx.f32" in capped.ptx and capped.sass_opcodes()["MUFU.TANH"] > 0
    assert "math.tanh" not in capped.mlir and "div.rn.f32" not in capped.ptx
    check_sass(capped)


def test_captured_tensors_are_kernel_inputs():
    """ALiBi's captured slopes are a kernel input, loaded in the kernel."""
    plain = attention.compile_kernels(MOD_PLAN)[0]
    slopes = torch.tensor(M.alibi_slopes(8))
    alibi = attention.compile_kernels(MOD_PLAN, M.Mods(M.alibi(slopes)))[0]
    check_sass(alibi)
    assert alibi.sass_opcodes()["LDG.E"] > plain.sass_opcodes()["LDG.E"]


def test_alignment_of_fake_tensors_reads_no_address():
    """torch.compile's passes check eligibility on fake tensors, which have no address (torch 2.11 raises on
    data_ptr, 2.13 warns): the storage offset stands for the base."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode
    from nvfly.ops.attention.checks import aligned
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = torch.empty(4, 72, dtype=torch.bfloat16)
        assert aligned(rows[:, :64]) and not aligned(rows[:, 4:68]) and not aligned(torch.empty(4, 68, dtype=torch.bfloat16)[:, :64])
