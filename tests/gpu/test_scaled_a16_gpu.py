"""MXFP4 weights x bf16/fp16 activations (``scaled_mm(x, w_q.t(), None, w_scale)``, the streaming kernel) against
the float32 GEMM on the dequantised weights: every M from 1 to 16 on random shapes with N and K tails, larger M
(token blocks), split K (heuristic and forced), bias, fp16 activations, every output dtype, strided activation rows,
rows and blocks of very different scales, and the documented poisoning of scales past 2; fresh random inputs,
NaN-poisoned outputs; the shuffled-layout variants (A16Config(layout="shuffled") on shuffle_mxfp4_a16's weight)
against the reference on the unshuffled weight."""
import random

import pytest
import torch

from benchmarks.scaled import A16_VARIANTS
from nvfly.ops import scaled
from nvfly.ops.scaled import A16Config
from nvfly.ops.scaled.quantize import quantize, shuffle_mxfp4_a16, unshuffle_mxfp4_a16

pytestmark = pytest.mark.gpu

# products of two 16-bit values are exact in fp32: the kernel differs from the reference by the summation order and
# the output rounding only
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def operands(m, n, k, act=torch.bfloat16, spread=True, seed=0):
    """x (M, K) and MXFP4 w: packed (K/2, N) column-major and e8m0 scales (N, K/32); ``spread``: weight 32-blocks of
    magnitudes 2^-8 .. 2^1, so that a scale applied to the wrong row or block shows (|w| < 16: OCP scales of at most
    2, the kernel's exact range)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).to(act)
    w = torch.randn(n, k, device="cuda", generator=gen)
    if spread:
        w = w * torch.exp2(torch.randint(-8, 2, (n, k // 32), device="cuda", generator=gen).float()
                           ).repeat_interleave(32, 1)
    q, s = quantize(w, "mxfp4", operand="b")
    assert int(s.max()) <= 128, "the test's weights need scales past 2"
    return x, q, s


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def rel_error(out, ref):
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements not written (NaN poison left)"
    assert torch.isfinite(out).all(), f"{int(out.isinf().sum())} elements overflowed"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(m, n, k, act=torch.bfloat16, out_dtype=torch.bfloat16, bias=False, config=None, seed=0):
    x, q, s = operands(m, n, k, act, seed=seed)
    b = torch.randn(n, device="cuda").to(out_dtype if out_dtype != torch.float32 else torch.bfloat16) \
        if bias else None
    out = poisoned(m, n, out_dtype)
    scaled.scaled_mm(x, q, None, s, bias=b, out_dtype=out_dtype, out=out, config=config)
    ref = scaled.reference(x, q, None, s, b)
    err = rel_error(out, ref)
    assert err < TOL[out_dtype], (m, n, k, scaled.path(x, q, None, s, out_dtype=out_dtype, config=config), err)
    # a second call on the cached plan (split K's workspace reused) gives the same result
    again = scaled.scaled_mm(x, q, None, s, bias=b, out_dtype=out_dtype, config=config)
    assert torch.equal(again, out)


@pytest.mark.parametrize("m", range(1, 17))
def test_small_m_random_shapes(hopper, m):
    """M 1..16, N and K drawn at random (N any size, K any multiple of 32: tails of both)."""
    rng = random.Random(m)
    check(m, rng.randrange(17, 1500), 32 * rng.randrange(1, 160), seed=m)


@pytest.mark.parametrize("m,n,k,act,out_dtype,bias,config", [
    (4, 576, 7168, torch.bfloat16, torch.bfloat16, True, None),           # heuristic split K, reduce adds the bias
    (16, 7168, 2048, torch.bfloat16, torch.float32, False, None),         # DeepSeek-V3 down projection, no split
    (7, 1000, 4128, torch.float16, torch.float16, True, None),            # fp16 activations, K tail
    (12, 300, 4096, torch.bfloat16, torch.bfloat16, False, A16Config(warps=8, stages=4, splits=5)),
    (9, 1000, 4128, torch.bfloat16, torch.float16, True, A16Config(stages=0, unroll=3)),  # weights into registers
    (1, 256, 96, torch.float16, torch.float32, True, None),               # K below one chunk: only the tail
    (64, 1040, 1024, torch.bfloat16, torch.bfloat16, True, None),         # four token blocks
    (200, 333, 640, torch.float16, torch.bfloat16, False, None),          # larger M, every tail
])
def test_shapes_dtypes_bias_split(hopper, m, n, k, act, out_dtype, bias, config):
    check(m, n, k, act, out_dtype, bias, config)


def test_strided_activation_rows(hopper):
    """x a column slice of a wider tensor (row stride K + 64): the kernel reads rows by their stride."""
    m, n, k = 9, 500, 1024
    wide, q, s = operands(m, n, k + 64)
    x = wide[:, :k]
    q, s = quantize(torch.randn(n, k, device="cuda"), "mxfp4", operand="b")
    out = scaled.scaled_mm(x, q, None, s)
    assert rel_error(out, scaled.reference(x, q, None, s)) < TOL[torch.bfloat16]


def test_scales_past_two_poison_or_widen(hopper):
    """An e8m0 byte above 128 (a scale of 4 or more) is outside what the default single bf16 factor holds: the
    documented result is a non-finite output column, never a silently clamped one, the other columns exact; with
    A16Config(wide_scales=True) every column is exact."""
    m, n, k = 3, 64, 256
    x, q, s = operands(m, n, k, spread=False)
    s = s.clone()
    s[5, 2] = 130
    s[9, 0] = 200
    ref = scaled.reference(x, q, None, s)
    out = scaled.scaled_mm(x, q, None, s, out_dtype=torch.float32)
    assert not torch.isfinite(out[:, 5]).all() and not torch.isfinite(out[:, 9]).all()
    keep = [j for j in range(n) if j not in (5, 9)]
    assert rel_error(out[:, keep], ref[:, keep]) < TOL[torch.float32]
    wide = poisoned(m, n, torch.float32)
    scaled.scaled_mm(x, q, None, s, out_dtype=torch.float32, out=wide, config=A16Config(wide_scales=True))
    for cols in (keep, [5], [9]):  # column 9 is ~2^72 times the others: each apart
        assert rel_error(wide[:, cols], ref[:, cols]) < TOL[torch.float32], cols


# benchmarks.scaled's A16_VARIANTS on shuffled layouts
# (the TMA ring needs K a multiple of 512: test_tma_ring_on_the_bit_layout runs its shuffled variant)
SHUFFLED = {name: config for name, config in A16_VARIANTS.items()
            if config.layout != "natural" and not config.tma_stages}


@pytest.mark.parametrize("variant", list(SHUFFLED))
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("n,k", [(576, 7168), (1000, 4128), (333, 96)])  # split K; N and K tails; only the K tail
def test_shuffled_layout_variants(hopper, variant, m, n, k):
    """Each shuffled-layout variant on shuffle_mxfp4_a16's copy of the weight equals the float32 GEMM on the
    dequantised (unshuffled) weight; the shuffle round-trips on the GPU."""
    x, q, s = operands(m, n, k, seed=m + n)
    layout = SHUFFLED[variant].layout
    shuffled = shuffle_mxfp4_a16(q, layout)
    assert torch.equal(unshuffle_mxfp4_a16(shuffled, layout).view(torch.uint8), q.view(torch.uint8))
    bias = torch.randn(n, device="cuda").bfloat16() if m == 4 else None
    out = poisoned(m, n, torch.bfloat16)
    scaled.scaled_mm(x, shuffled, None, s, bias=bias, out=out, config=SHUFFLED[variant])
    err = rel_error(out, scaled.reference(x, q, None, s, bias))
    assert err < TOL[torch.bfloat16], (variant, m, n, k, err)


@pytest.mark.parametrize("layout", ["shuffled", "shuffled-f16"])
@pytest.mark.parametrize("stages", [8, 0])
def test_shuffled_layout_fp16_activations(hopper, layout, stages):
    """fp16 activations and output through the nibble-shuffled layout (dtype-free) and the fp16 bit-shuffled one."""
    x, q, s = operands(7, 1000, 4128, torch.float16)
    out = poisoned(7, 1000, torch.float16)
    scaled.scaled_mm(x, shuffle_mxfp4_a16(q, layout), None, s, out_dtype=torch.float16, out=out,
                     config=A16Config(layout=layout, stages=stages))
    assert rel_error(out, scaled.reference(x, q, None, s)) < TOL[torch.float16]


@pytest.mark.parametrize("m,n,k", [(3, 700, 1024 + 96), (12, 333, 5 * 128), (1, 64, 96)])
def test_ahead_on_the_natural_layout(hopper, m, n, k):
    """A16Config(ahead=True) on torch's layout: groups carried in registers, leftover chunks and the K tail after
    them (K 1120: 8 full chunks, 2 groups of 4 over 4 warps, a tail; 640: one group short; 96: only the tail)."""
    check(m, n, k, config=A16Config(stages=0, ahead=True, splits=1))


@pytest.mark.parametrize("m,n,k,act,splits,stages", [
    (1, 8192, 4096, torch.bfloat16, 0, 8),      # many groups: no split, stages 8 chunks deep over 4 warps
    (4, 576, 7168, torch.bfloat16, 0, 8),       # the heuristic's split K: a split's last stage runs into the next's
    (16, 1000, 4608, torch.float16, 1, 4),      # two token tiles, an N tail (TMA's zero rows), fp16, a 4-deep ring
    (16, 1000, 4608, torch.bfloat16, 1, 4),     # the same in bf16 (each stage slot reused twice)
    (1, 4096, 8192, torch.bfloat16, 1, 4),      # 16 stages through a 4-deep ring: every slot reused 4 times
    (9, 333, 512, torch.bfloat16, 0, 16),       # one stage in all, a ring deeper than the work
    (64, 520, 2048, torch.bfloat16, 3, 4),      # four token blocks, 3 splits asked: 2 of 8 chunks (whole stages)
])
def test_tma_ring(hopper, m, n, k, act, splits, stages):
    """A16Config(tma_stages=...): a producer warp TMA-loads stages of 4 chunks (weights 128-byte swizzled, scales)
    into a ring the warps take stage by stage; chunks past a split's end are loaded and zeroed; repeated calls."""
    check(m, n, k, act, torch.bfloat16, m == 4, A16Config(tma_stages=stages, splits=splits))
    check(m, n, k, act, torch.bfloat16, False, A16Config(tma_stages=stages, splits=splits), seed=7)


@pytest.mark.parametrize("m", [1, 16])
def test_tma_ring_on_the_bit_layout(hopper, m):
    """The TMA ring on the bf16 bit-shuffled weight (the benchmark's bits_tma)."""
    x, q, s = operands(m, 4096, 7168, seed=m)
    out = poisoned(m, 4096, torch.bfloat16)
    scaled.scaled_mm(x, shuffle_mxfp4_a16(q, "shuffled-bf16"), None, s, out=out,
                     config=A16Config(layout="shuffled-bf16", tma_stages=8))
    assert rel_error(out, scaled.reference(x, q, None, s)) < TOL[torch.bfloat16]
