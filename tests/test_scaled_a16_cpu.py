"""MXFP4 weights x bf16/fp16 activations (scaled_mm's "mxfp4_a16" recipe) without a GPU: the e2m1 -> 16-bit
conversion and the e8m0 factor are exact against the torch reference, a model of one warp's chunk built from the
kernel's own fragment helpers (K permutation, nibble order, scale application) reproduces x @ w^T, the plans split
K as the heuristic says, every kernel variant compiles to HMMA without spills, and bad arguments raise errors
naming them."""
import itertools
from dataclasses import replace
import math
import random

import pytest
import torch

from nvfly.arch.floats import (E2M1_UNIT_EXPONENT, e2m1_shuffled_bit_positions, e2m1x8_shuffled_to_16bit_bits,
                               e2m1x8_to_16bit_bits, e8m0_factor_bits)
from nvfly.ops import scaled
from nvfly.ops.scaled import A16Config
from nvfly.ops.scaled.a16_kernel import LANE_K, step_operands, token_pairs, token_words
from nvfly.ops.scaled.a16_plan import CHUNK_K, ROWS, describe_a16_plan, make_a16_plan
from nvfly.ops.scaled.api import compile_a16
from nvfly.ops.scaled.quantize import E2M1_VALUES, dequantize_mxfp4, quantize, shuffle_mxfp4_a16, unshuffle_mxfp4_a16

TORCH16 = {"bf16": torch.bfloat16, "f16": torch.float16}


def half_value(bits: int, name: str) -> float:
    """The float value of a 16-bit pattern of bf16 / f16."""
    return torch.tensor([bits - 65536 if bits >= 32768 else bits], dtype=torch.int16).view(TORCH16[name]).item()


def factor_model(byte: int, name: str, wide: bool = False) -> list:
    """The kernel's factors (e8m0_factor_bits on Python ints) as floats, checking both halves agree."""
    out = []
    for word in e8m0_factor_bits(byte, name, wide):
        assert word >> 16 == word & 0xFFFF
        out.append(half_value(word & 0xFFFF, name))
    return out


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_e2m1_to_16bit_every_code_at_every_position(name):
    """Word i of the conversion holds nibble i (low half) and nibble i + 4 (high half), each e2m1 value times
    2^E2M1_UNIT_EXPONENT exactly (0.5 a 16-bit subnormal, -0 kept); every code at every nibble position."""
    unit = 2.0 ** E2M1_UNIT_EXPONENT[name]
    for position, code in itertools.product(range(8), range(16)):
        filler = random.Random(position * 16 + code).getrandbits(32)
        word = (filler & ~(0xF << 4 * position)) | code << 4 * position
        words = e2m1x8_to_16bit_bits(word, name)
        i, half = position % 4, position // 4
        bits = (words[i] >> 16 * half) & 0xFFFF
        assert half_value(bits, name) == E2M1_VALUES[code] * unit
        assert bits >> 15 == code >> 3  # the sign, -0 included


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_scale_factor_is_exact_in_range(name):
    """The packed multiply by the e8m0 factor gives the dequantised value rounded to the 16-bit type, exactly
    (bf16: every byte 0..128; f16: 99..128 exactly, 0..98 zero, as every f16 weight of that scale rounds to);
    bytes past 128 and 0xFF give an inf factor (poisoned, not clamped)."""
    unit = 2.0 ** E2M1_UNIT_EXPONENT[name]
    dt = TORCH16[name]
    for byte in range(0, 129):
        f = factor_model(byte, name)[0]
        if name == "bf16" or byte >= 99:
            assert f == 2.0 ** (byte - 127) / unit
        else:
            assert f == 0.0
        for v in E2M1_VALUES:
            product = (torch.tensor([v * unit], dtype=dt) * torch.tensor([f], dtype=dt)).float().item()
            assert product == torch.tensor([v * 2.0 ** (byte - 127)]).to(dt).float().item(), (byte, v)
    assert all(math.isinf(factor_model(b, name)[0]) for b in range(129, 256))


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_wide_scale_factors_are_exact_past_two(name):
    """A16Config(wide_scales=True): the factor of min(byte, 128) and then 2^(max(byte, 128) - 128), two packed
    multiplies, give the dequantised value rounded to the 16-bit type for every byte (bf16: up to 254, inf where the
    value itself overflows bf16; f16: up to 143)."""
    unit = 2.0 ** E2M1_UNIT_EXPONENT[name]
    dt = TORCH16[name]
    for byte in range(0, 255 if name == "bf16" else 144):
        first, second = (torch.tensor([f], dtype=dt) for f in factor_model(byte, name, wide=True))
        assert torch.isfinite(second).all()
        for v in E2M1_VALUES:
            product = (torch.tensor([v * unit], dtype=dt) * first * second).float().item()
            assert product == torch.tensor([v * 2.0 ** (byte - 127)]).to(dt).float().item(), (byte, v)


def pair_model(low: int, high: int) -> list:
    """pair_halves (prmt 0x5410 / 0x7632) on Python ints."""
    return [(low & 0xFFFF) | (high & 0xFFFF) << 16, (low >> 16) | (high >> 16) << 16]


def words_of(t: torch.Tensor) -> list:
    """A 1-D 16-bit tensor's values as unsigned 32-bit words, two a word, low half first."""
    return [w & 0xFFFFFFFF for w in t.contiguous().view(torch.int32).tolist()]


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_bit_shuffled_positions_tile_the_word(name):
    """The bit-shuffled layout places each of a word's 32 bits once, and its conversion gives, for every code at
    every position, what e2m1x8_to_16bit_bits gives for the natural word (value 2i + h in half h of word i)."""
    positions = e2m1_shuffled_bit_positions(name)
    assert sorted(p for v in positions for p in v) == list(range(32))
    for value, code in itertools.product(range(8), range(16)):
        codes = [random.Random(value * 16 + code + j).randrange(16) for j in range(8)]
        codes[value] = code
        word = sum(((c >> b) & 1) << positions[v][b] for v, c in enumerate(codes) for b in range(4))
        got = e2m1x8_shuffled_to_16bit_bits(word, name)
        ref = e2m1x8_to_16bit_bits(sum(c << 4 * v for v, c in enumerate(codes)), name)
        for v in range(8):
            assert (got[v // 2] >> 16 * (v % 2)) & 0xFFFF == (ref[v % 4] >> 16 * (v // 4)) & 0xFFFF, (value, code, v)


@pytest.mark.parametrize("layout", ["natural", "shuffled", "shuffled-bf16", "shuffled-f16"])
@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_warp_chunk_model_matches_reference(name, layout):
    """One warp's 128-k chunk of 16 weight rows and 8 tokens, assembled lane by lane with the kernel's helpers
    (e2m1x8_to_16bit_bits, token_pairs / token_words, step_operands) and PTX's m16n8k16 fragment layout, the scale
    applied as the kernel does, equals x @ dequantised(w)^T: the nibble order, the K permutation and the scales
    line up, for torch's layout and for shuffle_mxfp4_a16's (natural token words; the bit-shuffled layouts converted
    by e2m1x8_shuffled_to_16bit_bits; the API refuses one bit-shuffled for the other dtype)."""
    if layout.startswith("shuffled-") and layout != f"shuffled-{name}":
        pytest.skip("a layout bit-shuffled for the other activation dtype (refused by the API)")
    shuffled = layout != "natural"
    dt = TORCH16[name]
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(ROWS, CHUNK_K, generator=gen)
    x = torch.randn(8, CHUNK_K, generator=gen).to(dt)
    q, sb = quantize(w, "mxfp4", operand="a")  # (16, 64) packed, (16, 4) scales, row-major
    reference = x.float() @ dequantize_mxfp4(q, sb).to(dt).float().t()
    if shuffled:  # shuffle_mxfp4_a16 takes scaled_mm's (K/2, N) column-major view
        q = shuffle_mxfp4_a16(q.t(), layout).t()
    packed = q.view(torch.uint8)

    def tokens(words, j):
        return token_words(words, j) if shuffled else token_pairs(words, j, pair_model)
    unit = 2.0 ** E2M1_UNIT_EXPONENT[name]
    got = torch.zeros(ROWS, 8, dtype=torch.float64)  # out^T: weight rows x tokens
    for lane in range(32):
        g, p = lane // 4, lane % 4
        kk = LANE_K * p
        wwords = [words_of(packed[r, kk // 2:kk // 2 + 16].view(torch.int16)) for r in (g, g + 8)]
        factors = [factor_model(int(sb[r, kk // LANE_K]), name)[0] for r in (g, g + 8)]
        xwords = words_of(x[g, kk:kk + LANE_K])
        for j in range(LANE_K // 8):
            rows = [e2m1x8_shuffled_to_16bit_bits(wwords[h][j], name) if "-" in layout
                    else e2m1x8_to_16bit_bits(wwords[h][j], name) for h in range(2)]
            pairs = tokens(xwords, j)
            for s in range(2):
                a, b = step_operands(rows, pairs, s)
                # PTX m16n8k16: a0/a2 row g, a1/a3 row g + 8; a0, a1 and b0 at ISA k 2p, 2p + 1; a2, a3, b1 at
                # 2p + 8, 2p + 9; every lane's (a, b) pairs multiply into D[row, token g'] for every token g'
                for reg, row in ((0, g), (1, g + 8), (2, g), (3, g + 8)):
                    for half in range(2):
                        wv = half_value((a[reg] >> 16 * half) & 0xFFFF, name) / unit * factors[reg % 2] * unit
                        for token in range(8):
                            tw = tokens(words_of(x[token, kk:kk + LANE_K]), j)[2 * s + reg // 2]
                            got[row, token] += wv * half_value((tw >> 16 * half) & 0xFFFF, name)
                assert b == [pairs[2 * s], pairs[2 * s + 1]]
    torch.testing.assert_close(got.t().float(), reference, rtol=1e-5, atol=1e-4)


def test_shuffle_round_trips_and_names_bad_arguments():
    """shuffle_mxfp4_a16 permutes each 32-bit word (layout "shuffled": the nibbles of k 0, 2, 4, 6, 1, 3, 5, 7),
    keeps scaled_mm's (K/2, N) column-major layout, and unshuffle_mxfp4_a16 undoes it; wrong dtypes, layouts and a
    layout bit-shuffled for the other activations name the argument."""
    q, s = quantize(torch.randn(40, 256), "mxfp4", operand="b")
    for layout in ("shuffled", "shuffled-bf16", "shuffled-f16"):
        sh = shuffle_mxfp4_a16(q, layout)
        assert sh.shape == q.shape and sh.stride() == q.stride() and sh.dtype == q.dtype
        assert not torch.equal(sh.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(unshuffle_mxfp4_a16(sh, layout).view(torch.uint8), q.view(torch.uint8))
    sh = shuffle_mxfp4_a16(q)
    word = int(q.t().contiguous().view(torch.uint8)[3, 4:8].view(torch.int32)) & 0xFFFFFFFF
    got = int(sh.t().contiguous().view(torch.uint8)[3, 4:8].view(torch.int32)) & 0xFFFFFFFF
    assert all((got >> 4 * i) & 0xF == (word >> 4 * k) & 0xF for i, k in enumerate((0, 2, 4, 6, 1, 3, 5, 7)))
    with pytest.raises(TypeError, match="w_q: expected a float4_e2m1fn_x2"):
        shuffle_mxfp4_a16(q.view(torch.uint8))
    with pytest.raises(ValueError, match="w_q: expected the .K/2, N. column-major"):
        shuffle_mxfp4_a16(q.t())
    with pytest.raises(TypeError, match="w_shuffled: expected a float4_e2m1fn_x2"):
        unshuffle_mxfp4_a16(torch.zeros(4))
    with pytest.raises(ValueError, match="config: layout='swizzled'"):
        make_a16_plan(4, 64, 256, A16Config(layout="swizzled"), 132)
    with pytest.raises(ValueError, match="layout: expected one of"):
        shuffle_mxfp4_a16(q, "natural")
    x = torch.randn(4, 256).half()
    with pytest.raises(ValueError, match="config: layout='shuffled-bf16' is bit-shuffled for other activations"):
        scaled.path(x, q, None, s, config=A16Config(layout="shuffled-bf16"))
    assert "shuffled" in scaled.path(x, q, None, s, config=A16Config(layout="shuffled-f16"))


def test_plan_splits_k_over_idle_sms():
    """Few weight-row groups split K (every split non-empty, the tail chunk on the last); many do not; M > 8 takes
    two token tiles, M > 16 more token blocks."""
    p = make_a16_plan(4, 576, 7168, None, 132)
    assert p.splits > 1 and p.partial and p.m_tiles == 1
    assert (p.splits - 1) * p.chunks_per_split < 7168 // CHUNK_K <= p.splits * p.chunks_per_split
    assert p.grid == 36 * p.splits
    p = make_a16_plan(1, 7168, 2048, None, 132)
    assert p.splits == 1 and p.grid == 448
    p = make_a16_plan(16, 8192, 8192, None, 132)
    assert p.m_tiles == 2 and p.token_blocks == 1 and p.splits == 1
    p = make_a16_plan(40, 100, 96, None, 132)  # K below one chunk: a single split holding only the tail
    assert p.token_blocks == 3 and p.splits == 1 and p.chunks_per_split == 0 and p.grid == 7 * 3
    p = make_a16_plan(4, 576, 7168, A16Config(warps=8, stages=4, splits=3), 132)
    assert p.splits == 3 and p.threads == 256
    with pytest.raises(ValueError, match="config: ahead=True: the registers mainloop's"):
        make_a16_plan(4, 576, 7168, A16Config(ahead=True, stages=8), 132)
    with pytest.raises(ValueError, match="config: warps=3"):
        make_a16_plan(4, 576, 7168, A16Config(warps=3), 132)
    with pytest.raises(ValueError, match="config: warps=8 x stages=8: .* static shared memory"):
        make_a16_plan(4, 576, 7168, A16Config(warps=8, stages=8), 132)
    assert "splitK" in scaled.describe(4, 576, 7168, scaling="mxfp4_a16")


COMPILED = [
    (1, 7168, 2048, torch.bfloat16, torch.bfloat16, True, None),
    (16, 4096, 7168, torch.bfloat16, torch.float32, False, None),   # split K: f32 partials
    (12, 1000, 4128, torch.float16, torch.float16, True, A16Config(splits=1)),  # K tail, N tail, fp16
    (5, 256, 7168, torch.bfloat16, torch.bfloat16, False, A16Config(warps=8, stages=4)),
    (9, 1000, 4128, torch.bfloat16, torch.bfloat16, True, A16Config(stages=0, unroll=4)),  # weights into registers
    (16, 7168, 2048, torch.bfloat16, torch.bfloat16, True, A16Config(wide_scales=True)),
    (3, 7168, 2048, torch.float16, torch.bfloat16, False, A16Config(wide_scales=True)),
    (4, 7168, 2048, torch.bfloat16, torch.bfloat16, False, A16Config(layout="shuffled")),
    (16, 1000, 4128, torch.float16, torch.bfloat16, True, A16Config(layout="shuffled", stages=0)),
    (4, 576, 7168, torch.bfloat16, torch.bfloat16, False, A16Config(layout="shuffled", warps=8, stages=4)),
    (4, 7168, 2048, torch.bfloat16, torch.bfloat16, False, A16Config(layout="shuffled-bf16")),
    (16, 1000, 4128, torch.float16, torch.bfloat16, True, A16Config(layout="shuffled-f16", stages=0)),
    (9, 576, 7168, torch.bfloat16, torch.float32, False, A16Config(layout="shuffled-bf16", warps=8, stages=0)),
    (4, 7168, 2048, torch.bfloat16, torch.bfloat16, True, A16Config(layout="shuffled-bf16", stages=0, ahead=True)),
    (16, 1000, 4128, torch.float16, torch.bfloat16, False, A16Config(stages=0, ahead=True, warps=8)),
    # the TMA ring (a producer warp): split K, an N tail, fp16, the bit layout, wide scales
    (1, 7168, 2048, torch.bfloat16, torch.bfloat16, True, A16Config(tma_stages=8)),
    (16, 4096, 7168, torch.bfloat16, torch.float32, False, A16Config(tma_stages=8)),
    (12, 1000, 4608, torch.float16, torch.float16, True, A16Config(tma_stages=4, splits=1)),
    (4, 7168, 2048, torch.bfloat16, torch.bfloat16, False, A16Config(tma_stages=16, layout="shuffled-bf16")),
    (3, 7168, 2048, torch.float16, torch.bfloat16, False, A16Config(tma_stages=8, wide_scales=True)),
]


@pytest.mark.parametrize("m,n,k,act,out,bias,cfg", COMPILED)
def test_variants_compile_to_hmma_without_spills(m, n, k, act, out, bias, cfg):
    plan, kernel = compile_a16(m, n, k, cfg, act, out, bias)
    r = kernel.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0 and not kernel.warnings, r
    assert r.registers <= (168 if cfg is not None and cfg.tma_stages and m > 8 else 128), r  # 4 x 128 threads an SM
    ops = kernel.sass_opcodes()
    bf16 = act == torch.bfloat16
    assert ops["HMMA.16816.F32.BF16" if bf16 else "HMMA.16816.F32"] > 0  # mma.sync on 16-bit operands
    assert ops["HMUL2.BF16_V2" if bf16 else "HMUL2"] > 0  # the packed scale multiply
    if plan.config.stages:  # the streamed weight: cp.async (L1 bypassed) into the warp's ring
        assert ops["LDGSTS.E.BYPASS.128"] > 0 and ops["LDS.128"] > 0
    elif plan.config.tma_stages:  # TMA boxes into the shared ring, read back 16 bytes a lane, no global weight loads
        assert ops["UTMALDG.2D"] > 0 and ops["LDS.128"] > 0 and not ops.get("LDG.E.NA.LTC256B.128.CONSTANT")
        assert kernel.dynamic_smem_bytes == plan.config.dynamic_smem_bytes and plan.threads == 32 * 5
    else:  # straight into registers: read-only, no L1, L2 prefetch
        assert ops["LDG.E.NA.LTC256B.128.CONSTANT"] > 0


def loop_opcodes(cfg: A16Config) -> dict:
    """The SASS opcode counts of one 128-k chunk of a warp's loop at M <= 8 (registers mainloop, bf16): the
    difference between unroll 2 and unroll 1 kernels (each adds one chunk's straight-line body)."""
    counts = []
    for unroll in (1, 2):
        _, kernel = compile_a16(4, 7168, 2048, replace(cfg, stages=0, unroll=unroll), torch.bfloat16,
                                torch.bfloat16, False)
        counts.append(kernel.sass_opcodes())
    return {op: counts[1].get(op, 0) - counts[0].get(op, 0) for op in set(counts[0]) | set(counts[1])}


def test_shuffled_layouts_have_fewer_instructions_per_chunk():
    """Per 128-k chunk and warp (M <= 8, bf16): "shuffled" drops the tokens' 16 PRMTs (the few left build the scale
    factors), "shuffled-bf16" also converts in fewer integer ops (5 shifts and 8 LOP3 a word of 8 values);
    docs/ops/scaled.md's issue-rate prediction uses these counts (printed with -s)."""
    counts = {lay: loop_opcodes(A16Config(layout=lay)) for lay in ("natural", "shuffled", "shuffled-bf16")}
    total = {lay: sum(c.values()) for lay, c in counts.items()}
    print("SASS per chunk and warp, M <= 8:", total, {lay: {op: n for op, n in sorted(c.items()) if n}
                                                       for lay, c in counts.items()})
    assert all(c.get("HMMA.16816.F32.BF16") == 8 for c in counts.values())
    assert counts["natural"].get("PRMT", 0) - counts["shuffled"].get("PRMT", 0) >= 12
    assert total["shuffled-bf16"] < total["shuffled"] < total["natural"]


def test_tma_ring_offsets_pick_each_lanes_bytes():
    """The TMA ring's read-back: a stage laid out as TMA writes it (two 16 x 128-byte boxes, 128-byte swizzle, then
    the 16 x 16-byte scale box) gives every lane (g, p) of every chunk u the 16 bytes of rows g and g + 8 at k
    128u + 32p .. +31 (bytes 64u + 16p ..) and their scale bytes (block 4u + p): the lane layout the registers
    mainloop loads from global memory."""
    from nvfly.ops.scaled.a16_kernel import ring_offsets
    from nvfly.ops.scaled.a16_plan import TMA_BOX_BYTES, TMA_CHUNKS, TMA_SCALE_BYTES, TMA_STAGE_BYTES, TMA_WEIGHT_BYTES
    rng = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (16, TMA_CHUNKS * 64), generator=rng, dtype=torch.uint8)  # a stage's weight bytes
    sc = torch.randint(0, 256, (16, TMA_CHUNKS * 4), generator=rng, dtype=torch.uint8)  # and scale bytes
    stage = torch.zeros(TMA_STAGE_BYTES, dtype=torch.uint8)
    for box in range(TMA_WEIGHT_BYTES // (16 * TMA_BOX_BYTES)):
        for r in range(16):
            for q in range(TMA_BOX_BYTES // 16):
                at = box * 16 * TMA_BOX_BYTES + r * TMA_BOX_BYTES + (q ^ (r % 8)) * 16
                stage[at:at + 16] = w[r, box * TMA_BOX_BYTES + 16 * q:box * TMA_BOX_BYTES + 16 * q + 16]
    stage[TMA_WEIGHT_BYTES:TMA_WEIGHT_BYTES + TMA_SCALE_BYTES] = sc.flatten()
    for u in range(TMA_CHUNKS):
        for g in range(8):
            for p in range(4):
                words, scales = ring_offsets(u, g, p)
                for h, r in enumerate((g, g + 8)):
                    assert torch.equal(stage[words[h]:words[h] + 16], w[r, 64 * u + 16 * p:64 * u + 16 * p + 16])
                    assert stage[scales[h]] == sc[r, 4 * u + p]


def test_tma_ring_plan_checks():
    """tma_stages replaces the other mainloops, needs K a multiple of 512 (the scale rows' 16-byte TMA stride) and
    adds the producer warp."""
    plan = make_a16_plan(1, 8192, 8192, A16Config(tma_stages=8), 132)
    assert plan.threads == 160 and plan.config.static_smem_bytes == 0
    # splits start on whole stages (TMA box starts 16-byte aligned in the scale rows: an unaligned one faults)
    for m, n, k, splits in ((64, 520, 2048, 3), (4, 576, 7168, 0), (1, 100, 512 * 7, 5)):
        split = make_a16_plan(m, n, k, A16Config(tma_stages=4, splits=splits), 132)
        assert split.chunks_per_split % 4 == 0 and (split.splits - 1) * split.chunks_per_split < k // CHUNK_K
    assert "8-stage TMA ring of 4 chunks" in describe_a16_plan(plan)
    with pytest.raises(ValueError, match="config: tma_stages: K=4128 must be a multiple of 512"):
        make_a16_plan(1, 8192, 4128, A16Config(tma_stages=8), 132)
    with pytest.raises(ValueError, match="config: tma_stages=8: instead of stages / ahead"):
        make_a16_plan(1, 8192, 8192, A16Config(tma_stages=8, stages=4), 132)
    with pytest.raises(ValueError, match="config: tma_stages=2: 0 \\(off\\) or a multiple of warps=4 up to 32"):
        make_a16_plan(1, 8192, 8192, A16Config(tma_stages=2), 132)
