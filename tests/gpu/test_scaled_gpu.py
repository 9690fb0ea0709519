"""nvfly's FP8 scaled GEMM against the float32 GEMM of the dequantised operands: every recipe (tensor-wise,
row-wise, 1x128 x 128x128 blocks, MXFP8, MXFP4 weights), promoted and fast accumulation, bias, output dtypes,
tails, small M (swap-AB and token tiles), e5m2; fresh random inputs, NaN-poisoned outputs."""
import pytest
import torch

from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledConfig
from nvfly.ops.scaled.quantize import quantize

pytestmark = pytest.mark.gpu

GRANULARITY = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ("1x128", "128x128"),
               "block1x128": ("1x128", "1x128")}


def operands(m, n, k, scaling, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, spread=True):
    """Quantised a (M, K), b (K, N column-major) and their scales; ``spread``: rows and 128-blocks of very different
    magnitudes, so that a scale applied to the wrong row, column or block shows."""
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    if spread:  # factors of 2^-2 .. 2^2 each: fp16 outputs stay finite
        blocks = torch.randint(-2, 3, (1, -(-k // 128)), device="cuda").float()
        x = x * torch.exp2(torch.randint(-2, 3, (m, 1), device="cuda").float()) \
            * torch.exp2(blocks).repeat_interleave(128, 1)[:, :k]
        w = w * torch.exp2(torch.randint(-2, 3, (n, 1), device="cuda").float())
    ga, gb = GRANULARITY[scaling]
    a, sa = quantize(x, ga, a_dtype)
    b, sb = quantize(w, gb, b_dtype, operand="b")
    return a, b, sa, sb


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


def rel_error(out, ref):
    assert not out.isnan().any(), f"{int(out.isnan().sum())} elements not written (NaN poison left)"
    if out.dtype == torch.float16:  # the data must fit fp16, so that an inf below is the kernel's
        assert ref.abs().max() < torch.finfo(torch.float16).max, "the test's data overflow fp16"
    assert torch.isfinite(out).all(), f"{int(out.isinf().sum())} elements overflowed"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()  # float64: a norm of 1e35s overflows float32


# output rounding (bf16 2^-9, fp16 2^-12 relative) plus accumulation; promoted fp32 outputs hold the tensor core's
# 128-product partial sums added in fp32
TOL = {torch.float32: 5e-4, torch.float16: 1e-3, torch.bfloat16: 5e-3}


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
@pytest.mark.parametrize("out_dtype,mnk", [(torch.bfloat16, (256, 512, 1024)), (torch.bfloat16, (1000, 1040, 4096)),
                                           (torch.float16, (200, 336, 544)), (torch.float32, (200, 336, 544)),
                                           (torch.float32, (4224, 4096, 2048))])
def test_recipes_match_the_dequantised_gemm(hopper, scaling, out_dtype, mnk):
    m, n, k = mnk
    a, b, sa, sb = operands(m, n, k, scaling)
    out = poisoned(m, n, out_dtype)
    scaled.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, out=out)
    assert rel_error(out, scaled.reference(a, b, sa, sb)) < TOL[out_dtype]


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fast_accumulation(hopper, scaling):
    """use_fast_accum: the tensor core's accumulator sums all of K (less exact than promotion, still close)."""
    m, n, k = 520, 784, 4096  # fp8 rows of whole 16 bytes: N a multiple of 16
    a, b, sa, sb = operands(m, n, k, scaling)
    out = poisoned(m, n, torch.float32)
    scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=True, out=out)
    assert rel_error(out, scaled.reference(a, b, sa, sb)) < 5e-3
    assert "promoted" not in scaled.path(a, b, sa, sb, out_dtype=torch.float32, use_fast_accum=True)


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
@pytest.mark.parametrize("m,bias_dtype", [(1, None), (8, torch.bfloat16), (37, torch.float16), (64, None),
                                          (100, torch.bfloat16)])
def test_small_m_and_bias(hopper, scaling, m, bias_dtype):
    """Small M: tensor/row-wise swap A and B (the bias then runs along the kernel's rows), block scales take one
    64-row token tile; both split K over the idle SMs here (f32 partials, then the reduce kernel)."""
    n, k = 1536, 2048
    a, b, sa, sb = operands(m, n, k, scaling)
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
    out = poisoned(m, n, torch.bfloat16)
    scaled.scaled_mm(a, b, sa, sb, bias=bias, out=out)
    assert rel_error(out, scaled.reference(a, b, sa, sb, bias)) < TOL[torch.bfloat16]
    if not scaling.startswith("block") and m <= 64:
        assert "swapAB" in scaled.path(a, b, sa, sb, bias=bias)
    if m <= 64:
        assert "splitK" in scaled.path(a, b, sa, sb, bias=bias)


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
def test_bias_fp32_and_configs(hopper, scaling):
    m, n, k = 384, 640, 1152
    a, b, sa, sb = operands(m, n, k, scaling)
    bias = torch.randn(n, device="cuda")
    ref = scaled.reference(a, b, sa, sb, bias)
    configs = [ScaledConfig(128, 128, 4, 2), ScaledConfig(64, 64, 6, 1), ScaledConfig(128, 64, 5, 1),
               ScaledConfig(64, 64, 6, 1, split_k=3), ScaledConfig(128, 128, 4, 2, split_k=4),
               ScaledConfig(128, 256, 4, 2), ScaledConfig(256, 128, 4, 2), ScaledConfig(128, 96, 5, 2)]
    for config in configs:
        for fast in (False, True):
            if fast and scaling.startswith("block"):
                continue
            if not fast and config.check(promote=True):
                continue
            out = poisoned(m, n, torch.float32)
            scaled.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float32, out=out, config=config,
                             use_fast_accum=fast)
            assert rel_error(out, ref) < (5e-3 if fast else 5e-4), (config, fast)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_scales_across_weight_blocks(hopper, out_dtype):
    """Block-scaled tiles wider than, or not aligned with, the 128x128 weight blocks (each run of gcd(bn, 128)
    columns reads its own block's scale): 128 x 192 (three 64-column runs over two blocks, in order, TMA store or
    registers), 128 x 160 (32-column runs), 128 x 112 issuing ahead (16-column runs), 64 x 96 split K, the plan's
    own tile, and the producer-staged activation scales (ScaledConfig.staged_scales; at M = 327 the fallback).
    Operands scaled by 2^-3 .. 2^3 per 128x128 block of the weight and per 1x128 block of the activations, so that
    a run reading its neighbour's scale is off by up to 64x; tails in M (328), N (784: the last 192-wide tile's third
    run starts past the last weight block) and K (1040)."""
    m, n, k = 328, 784, 1040
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    kb, nb = -(-k // 128), -(-n // 128)
    x = x * torch.exp2(torch.randint(-3, 4, (m, kb), device="cuda").float()).repeat_interleave(128, 1)[:, :k]
    w = w * torch.exp2(torch.randint(-3, 4, (nb, kb), device="cuda").float()).repeat_interleave(128, 0) \
        .repeat_interleave(128, 1)[:n, :k]
    a, sa = quantize(x, "1x128")
    b, sb = quantize(w, "128x128", operand="b")
    assert sb.unique().numel() > 4  # the weight blocks' scales differ
    ref = scaled.reference(a, b, sa, sb)
    configs = [None, ScaledConfig(128, 192, 5, 2, tma_store=True), ScaledConfig(128, 192, 5, 2),
               ScaledConfig(128, 160, 6, 2, tma_store=True), ScaledConfig(128, 112, 7, 2, tma_store=True,
                                                                          issue_ahead=True),
               ScaledConfig(64, 96, 8, 1, split_k=2),
               # the activation scales staged in shared memory by the producer (M = 328: TMA can load them)
               ScaledConfig(128, 128, 6, 2, tma_store=True, issue_ahead=True, staged_scales=True),
               ScaledConfig(128, 192, 5, 2, tma_store=True, staged_scales=True),
               ScaledConfig(64, 32, 8, 1, split_k=2, staged_scales=True)]
    for config in configs:
        out = poisoned(m, n, out_dtype)
        scaled.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, out=out, config=config)
        assert rel_error(out, ref) < TOL[out_dtype], config
        if config is not None and config.staged_scales:
            assert "-staged" in scaled.path(a, b, sa, sb, out_dtype=out_dtype, config=config)
    # M = 327: scale_a's k-block columns 1308 bytes apart, which TMA cannot load: the scales come from global
    out = poisoned(m - 1, n, out_dtype)
    a1, sa1 = quantize(x[:-1], "1x128")
    scaled.scaled_mm(a1, b, sa1, sb, out_dtype=out_dtype, out=out, config=configs[-2])
    assert rel_error(out, scaled.reference(a1, b, sa1, sb)) < TOL[out_dtype]
    assert "-staged" not in scaled.path(a1, b, sa1, sb, out_dtype=out_dtype, config=configs[-2])


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
def test_issue_ahead_promotion(hopper, scaling):
    """ScaledConfig.issue_ahead (k-block k+1's wgmmas before k's add, k-blocks in pairs): 1, 2, 5 (a partial last
    block), 8 and 9 k-blocks (pairs with and without the odd one), two consumers, and one with split K."""
    m, n = 264, 384
    configs = [ScaledConfig(128, 128, 4, 2, issue_ahead=True), ScaledConfig(64, 64, 6, 1, split_k=2, issue_ahead=True)]
    for k in (128, 256, 544, 1024, 1152):
        a, b, sa, sb = operands(m, n, k, scaling)
        ref = scaled.reference(a, b, sa, sb)
        for config in configs:
            out = poisoned(m, n, torch.float32)
            scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, out=out, config=config)
            assert rel_error(out, ref) < 5e-4, (k, config)


@pytest.mark.parametrize("scaling,m", [("row", 16), ("block", 200), ("tensor", 300), ("block1x128", 40)])
def test_strided_outputs(hopper, scaling, m):
    """A column-major out (a transposed view): the epilogue's and the reduce kernel's element stores."""
    n, k = 768, 2048
    a, b, sa, sb = operands(m, n, k, scaling)
    out = torch.full((n, m), float("nan"), device="cuda", dtype=torch.bfloat16).t()
    scaled.scaled_mm(a, b, sa, sb, out=out)
    assert rel_error(out, scaled.reference(a, b, sa, sb)) < TOL[torch.bfloat16]


def test_e5m2_operands(hopper):
    m, n, k = 256, 384, 1024
    for a_dtype, b_dtype in ((torch.float8_e5m2, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2)):
        a, b, sa, sb = operands(m, n, k, "row", a_dtype, b_dtype)
        out = scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
        assert rel_error(out, scaled.reference(a, b, sa, sb)) < 5e-4


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_agrees_with_torch_scaled_mm(hopper, scaling):
    """cuBLAS's _scaled_mm (promoted by default) and nvfly agree closely for the recipes both run (bf16 outputs:
    torch's row-wise kernel writes only bf16; each side rounds once)."""
    m, n, k = 512, 1024, 2048
    a, b, sa, sb = operands(m, n, k, scaling, spread=False)
    ours = scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    theirs = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    assert rel_error(ours, theirs.float()) < 2 * TOL[torch.bfloat16]


def test_repeated_calls_and_new_addresses(hopper):
    """The cached launch reads fresh addresses and scale values on every call."""
    m, n, k = 300, 512, 768
    for _ in range(3):
        a, b, sa, sb = operands(m, n, k, "block")
        out = poisoned(m, n, torch.bfloat16)
        scaled.scaled_mm(a, b, sa, sb, out=out)
        assert rel_error(out, scaled.reference(a, b, sa, sb)) < TOL[torch.bfloat16]


def test_declines_with_reasons(hopper):
    a, b, sa, sb = operands(128, 256, 512, "row")
    assert scaled.eligibility(a, b, sa, sb) is None
    assert "scale_b" in scaled.eligibility(a, b, sa, sb[:, :128])
    assert "not CUDA" in scaled.eligibility(a.cpu(), b.cpu(), sa.cpu(), sb.cpu())
    with pytest.raises(ValueError, match="nvfly.ops.scaled.scaled_mm: b: expected a column-major"):
        scaled.scaled_mm(a, b.contiguous(), sa, sb)


@pytest.mark.parametrize("granularity", ["row", "1x128", "128x128", "mx"])
@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_quantize_kernels_match_the_reference_bit_for_bit(hopper, granularity, operand, source):
    from nvfly.ops.scaled.quantize import quantize_fp8
    for rows, k in ((300, 1056), (256, 4096)):
        x = (torch.randn(rows, k, device="cuda") * torch.exp2(torch.randint(-8, 9, (rows, 1), device="cuda"))
             ).to(source)
        x[0, :128] = 0  # an all-zero group: the floor keeps its scale finite
        q, s = quantize_fp8(x, granularity, operand=operand)
        q_ref, s_ref = quantize(x, granularity, operand=operand)
        assert q.shape == q_ref.shape and q.stride() == q_ref.stride()
        assert s.shape == s_ref.shape
        if granularity != "128x128" or operand == "b":  # the layouts scaled_mm takes (a size-1 dim has any stride)
            assert [st for st, n in zip(s.stride(), s.shape) if n > 1] == \
                [st for st, n in zip(s_ref.stride(), s_ref.shape) if n > 1]
        assert torch.equal(s, s_ref), (s - s_ref).abs().max()
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_routing_sends_scaled_mm_to_nvfly_where_faster_and_declines_with_reasons(hopper, monkeypatch):
    """Small-M tensor/row-wise calls go to nvfly (the measured rule); large M, block scales and fp8 outputs stay on
    torch with their reasons, and torch's results are what it computes."""
    import torch.nn.functional as F

    import nvfly.torch
    from nvfly.ops import scaled as scaled_package
    from nvfly.torch import scaled_ops
    # F.scaled_mm reaches _scaled_mm_v2, routed where this torch's schema is the one nvfly reads
    v2 = int(hasattr(F, "scaled_mm") and set(scaled_ops._V2_NAMES) <= set(scaled_ops._v2_schema_names()))
    calls = []
    real = scaled_package.scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(scaled_package, "scaled_mm", counted)
    m, n, k = 32, 512, 1024
    a, b, sa, sb = operands(m, n, k, "row")
    bias = torch.randn(n, device="cuda").bfloat16()
    ref = scaled.reference(a, b, sa, sb, bias)
    with nvfly.torch.routing():
        out = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
        fp8_out = torch._scaled_mm(a, b, sa.new_ones(()), sb.new_ones(()))  # fp8 output: stays on torch
        if hasattr(F, "scaled_mm"):
            by_recipe = F.scaled_mm(a, b, sa, F.ScalingType.RowWise, sb, F.ScalingType.RowWise,
                                    output_dtype=torch.bfloat16)
    assert len(calls) == 1 + v2
    assert rel_error(out, ref) < TOL[torch.bfloat16] and fp8_out.dtype == torch.float8_e4m3fn
    if hasattr(F, "scaled_mm"):
        assert rel_error(by_recipe, scaled.reference(a, b, sa, sb)) < TOL[torch.bfloat16]
    big = operands(256, n, k, "tensor")
    assert "cuBLAS measured faster" in scaled_ops.scaled_mm_eligibility(*big, None, None, torch.bfloat16)
    with nvfly.torch.routing():
        stays = torch._scaled_mm(*big, out_dtype=torch.bfloat16)
    assert len(calls) == 1 + v2 and rel_error(stays, scaled.reference(*big)) < TOL[torch.bfloat16]
    for recipe in ("block", "block1x128"):
        reason = scaled_ops.scaled_mm_eligibility(*operands(m, n, k, recipe), None, None, torch.bfloat16)
        assert reason.startswith(f"{recipe} scales: cuBLAS measured faster")


# ---------------------------------------------------------------------------------------------- MXFP8
def mx_operands(m, n, k):
    """MXFP8 a (M, K), b (K, N column-major) and their (rows, K/32) float8_e8m0fnu scales; rows and 32-blocks of
    K of very different magnitudes (2^-4 .. 2^4 each), so that a scale read for the wrong row, column or k-step
    shows."""
    def spread(rows):
        x = torch.randn(rows, k, device="cuda")
        blocks = torch.exp2(torch.randint(-4, 5, (rows, k // 32), device="cuda").float()).repeat_interleave(32, 1)
        return x * blocks * torch.exp2(torch.randint(-2, 3, (rows, 1), device="cuda").float())
    a, sa = quantize(spread(m), "mx")
    b, sb = quantize(spread(n), "mx", operand="b")
    return a, b, sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)


def test_mxfp8_decodes_nan_and_the_smallest_scale(hopper):
    """e8m0 0xFF is NaN (its row's outputs NaN, the others untouched); 0 is 2^-127 (a subnormal, not zero: next to
    a 2^100 weight scale it leaves 2^-27)."""
    m, n, k = 128, 256, 512
    a, b, sa, sb = mx_operands(m, n, k)
    sa, sb = sa.view(torch.uint8).clone(), sb.view(torch.uint8).clone()
    sa[3, 5] = 0xFF
    sa[7, :] = 0
    sb = torch.where(torch.arange(k // 32, device="cuda") % 2 == 0, torch.full_like(sb, 127 + 100), sb)
    ref = scaled.reference(a, b, sa, sb)
    out = scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
    assert out[3].isnan().all() and ref[3].isnan().all()
    keep = torch.arange(m, device="cuda") != 3
    assert rel_error(out[keep], ref[keep]) < 5e-4
    assert ref[7].abs().max() > 2.0 ** -40 and rel_error(out[7], ref[7]) < 5e-4


# ---------------------------------------------------------------------------------------------- MXFP4 weights
def mxfp4_operands(m, n, k):
    """MXFP8 a (as ``mx_operands``) and MXFP4 b: random e2m1 pairs (every code) as float4_e2m1fn_x2 (K/2, N)
    column-major, e8m0 scales 2^-6 .. 2^6 per row and 32 of K."""
    a, _, sa, _ = mx_operands(m, 16, k)
    packed = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
    sb = torch.randint(127 - 6, 127 + 7, (n, k // 32), device="cuda", dtype=torch.uint8)
    return a, packed.view(torch.float4_e2m1fn_x2).t(), sa, sb.view(torch.float8_e8m0fnu)


MX_OPERANDS = {"mxfp8": mx_operands, "mxfp4": mxfp4_operands}


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("out_dtype,mnk", [(torch.bfloat16, (256, 512, 1024)), (torch.float32, (1000, 1040, 4160)),
                                           (torch.float32, (200, 336, 544)), (torch.bfloat16, (16, 1536, 2048))])
def test_mx_recipes_match_the_dequantised_gemm(hopper, recipe, out_dtype, mnk):
    """MXFP8 activations x MXFP8 or MXFP4 weights (converted to e4m3 in shared memory): tails in M and N, K tails of
    whole k-steps (544 = 4 k-blocks + one k-step), small M (one 64-row token tile, split K)."""
    m, n, k = mnk
    a, b, sa, sb = MX_OPERANDS[recipe](m, n, k)
    out = poisoned(m, n, out_dtype)
    scaled.scaled_mm(a, b, sa, sb, out_dtype=out_dtype, out=out)
    assert rel_error(out, scaled.reference(a, b, sa, sb)) < TOL[out_dtype]
    assert f"scaled-{recipe}-promoted" in scaled.path(a, b, sa, sb, out_dtype=out_dtype)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_configs_bias_and_byte_scales(hopper, recipe):
    """One and two consumers (MXFP4: converting the packed tile 2 or 1 chunks a thread, or fewer chunks than
    threads), split K; the scales as uint8 bytes."""
    m, n, k = 264, 384, 1120  # 8 full k-blocks and a partial one (three k-steps)
    a, b, sa, sb = MX_OPERANDS[recipe](m, n, k)
    bias = torch.randn(n, device="cuda").bfloat16()
    ref = scaled.reference(a, b, sa, sb, bias)
    for config in (ScaledConfig(128, 128, 4, 2), ScaledConfig(64, 32, 8, 1), ScaledConfig(128, 64, 5, 1),
                   ScaledConfig(128, 32, 6, 2), ScaledConfig(128, 128, 4, 2, split_k=3)):
        out = poisoned(m, n, torch.float32)
        scaled.scaled_mm(a, b, sa.view(torch.uint8), sb.view(torch.uint8), bias=bias, out_dtype=torch.float32,
                         out=out, config=config)
        assert rel_error(out, ref) < 5e-4, config


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_quantize_mxfp4_matches_the_reference_bit_for_bit(hopper, source):
    """nvfly's MXFP4 quantisation kernel against ``quantize(x, "mxfp4")`` (OCP scales, e2m1 rounded to nearest
    even, saturating), then those weights through scaled_mm."""
    from nvfly.ops.scaled.quantize import quantize_mxfp4
    for rows, k in ((300, 1056), (256, 4096)):
        x = (torch.randn(rows, k, device="cuda") * torch.exp2(torch.randint(-8, 9, (rows, 1), device="cuda"))
             ).to(source)
        x[0, :32] = 0  # an all-zero group: scale byte 0
        x[1, :64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], device="cuda").repeat(8).to(source)
        for operand in ("a", "b"):
            q, s = quantize_mxfp4(x, operand=operand)
            q_ref, s_ref = quantize(x, "mxfp4", operand=operand)
            assert q.dtype == torch.float4_e2m1fn_x2 and q.shape == q_ref.shape and q.stride() == q_ref.stride()
            assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    a, _, sa, _ = mx_operands(64, 16, k)
    out = poisoned(64, rows, torch.float32)
    scaled.scaled_mm(a, q, sa, s, out_dtype=torch.float32, out=out)
    assert rel_error(out, scaled.reference(a, q, sa, s)) < 5e-4


# ---------------------------------------------------------------------------------------------- clusters along N
CLUSTER_N, CLUSTER_K = 4112, 1104  # 4096 + 16: the last tile 16 wide and a last cluster column past N; K: a tail


def cluster_configs(m, n, k, scaling, fast):
    """The heuristic's tile of the shape and the 128 x 128 tile (block scales: in order, the scales from global),
    each in clusters of 2 and 4 blocks along N."""
    from dataclasses import replace
    from nvfly.ops.scaled import ScaledEpilogue
    from nvfly.ops.scaled.config import deepest
    from nvfly.ops.scaled.plan import make_plan
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    epilogue = ScaledEpilogue(scaling, promote=not fast or scaling.startswith("block"))
    plan = make_plan(m, n, k, epilogue, None, None, sms)
    assert not plan.swap and plan.config.split_k == 1 and plan.config.cluster_n == 1
    return [replace(cfg, cluster_n=cn) for cfg in (plan.config, deepest(ScaledConfig(128, 128, 2, 2, tma_store=True)))
            for cn in (2, 4)]


@pytest.mark.parametrize("scaling,fast", [("tensor", False), ("row", False), ("row", True), ("block", False),
                                          ("block1x128", False)], ids=["tensor", "row", "row-fast", "block",
                                                                       "block1x128"])
@pytest.mark.parametrize("m", [128, 200, 512])
def test_clusters_along_n(hopper, scaling, fast, m):
    """ScaledConfig.cluster_n 2 and 4 (A multicast to the cluster's blocks) on the heuristic's tile (M = 128 and 200:
    128 x 64; block scales staging their activation scales and issuing ahead) and on 128 x 128: N = 4112 leaves a
    16-wide last tile and cluster tiles wholly past N (computed, not stored; block scales clamp their weight-block
    column), more tiles than SMs at M = 512 (each cluster walks several, the ring's phases running on), K a tail;
    bf16 through the TMA-store epilogue with a bias (f32 through registers at M = 200); twice per config."""
    n, k = CLUSTER_N, CLUSTER_K
    a, b, sa, sb = operands(m, n, k, scaling)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    tol = 5e-3 if fast else None
    for config in cluster_configs(m, n, k, scaling, fast):
        for out_dtype, with_bias in ((torch.bfloat16, True),) + (((torch.float32, False),) if m == 200 else ()):
            ref = scaled.reference(a, b, sa, sb, bias if with_bias else None)
            for launch in range(2):
                out = poisoned(m, n, out_dtype)
                scaled.scaled_mm(a, b, sa, sb, bias=bias if with_bias else None, out_dtype=out_dtype, out=out,
                                 config=config, use_fast_accum=fast)
                assert rel_error(out, ref) < (tol or TOL[out_dtype]), (config, out_dtype, launch)
        assert f"{config.cluster_n}-block clusters along N" in scaled.path(a, b, sa, sb, config=config,
                                                                           use_fast_accum=fast)


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_clusters_along_n(hopper, recipe):
    """MX scales promoted every k-step (MXFP4: each block converts its own packed B tile) in clusters of 2 and 4
    along N: tails in M, N (a cluster column past it) and K."""
    m, n, k = 200, 1040, 1120
    a, b, sa, sb = MX_OPERANDS[recipe](m, n, k)
    ref = scaled.reference(a, b, sa, sb)
    from nvfly.ops.scaled.config import deepest
    for config in (deepest(ScaledConfig(128, 64, 2, 2, tma_store=True, packed_b=recipe == "mxfp4", cluster_n=4)),
                   ScaledConfig(128, 128, 4, 2, cluster_n=2)):
        out = poisoned(m, n, torch.bfloat16)
        scaled.scaled_mm(a, b, sa, sb, out=out, config=config)
        assert rel_error(out, ref) < TOL[torch.bfloat16], config
