"""nvfly's grouped MX GEMM (MoE experts: MXFP8 tokens x MXFP8 or MXFP4 expert weights, e8m0 scales per 32 of K,
promoted every k-step) against the float32 product of the dequantised operands group by group: the contiguous
layout with ragged groups (empty, under a tile, unaligned, rows past the last group), the masked layout with device
counts (0 to the capacity), the heuristic's and explicit tiles (decode 64 x 64, 128 x 128 with and without the
TMA store, clusters along N, skip_empty), K tails of whole k-steps, N tails, long K with f32 outputs, many
experts; NaN-poisoned outputs (every row a group owns is written, no other row is). Rows and 32-wide K blocks of
very different magnitudes, so that a scale read for the wrong row, column, group or k-step shows."""
import pytest
import torch

from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledConfig
from nvfly.ops.scaled.quantize import quantize, quantize_experts
from tests.gpu.test_grouped_gpu import CONTIGUOUS_SIZES, check, sizes_to_offs

pytestmark = pytest.mark.gpu

E8M0 = torch.float8_e8m0fnu
# output rounding plus accumulation, as the dense MX tests (fp32 outputs: promoted every k-step in fp32)
TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3, torch.float32: 5e-4}
# the heuristic's decode and prefill tiles, the prefill tile through registers, 2-block clusters along N (a cluster
# column past N), MXFP8's skip_empty (a consumer past its group's end skips the tile's k-steps)
CONFIGS = {"heuristic": None, "64x64": ScaledConfig(64, 64, 8, 1), "128x128-tmastore": ScaledConfig(128, 128, 4, 2,
                                                                                                 tma_store=True),
           "128x128": ScaledConfig(128, 128, 4, 2), "128x128-cluster2n": ScaledConfig(128, 128, 4, 2, tma_store=True,
                                                                                      cluster_n=2)}


def spread(x):
    """x with rows and 32-wide K blocks scaled by 2^-4 .. 2^4 (each row's blocks independently)."""
    blocks = torch.exp2(torch.randint(-4, 5, x.shape[:-1] + (x.shape[-1] // 32,), device="cuda").float())
    return x * blocks.repeat_interleave(32, -1) * torch.exp2(torch.randint(-2, 3, x.shape[:-1] + (1,),
                                                                           device="cuda").float())


def tokens(rows, k, magnitude=1.0):
    """MXFP8 tokens (rows, K) and their e8m0 scales (rows, K/32)."""
    a, sa = quantize(spread(torch.randn(rows, k, device="cuda")) * magnitude, "mx")
    return a, sa.view(E8M0)


def experts(e, n, k, recipe):
    """MXFP8 weights [E, K, N] column-major (quantised), or MXFP4 [E, K/2, N]: random e2m1 pairs (every code) and
    e8m0 scales 2^-6 .. 2^6 per expert, channel and 32 of K; scale_b [E, N, K/32]."""
    if recipe == "mxfp8":
        b, sb = quantize_experts(spread(torch.randn(e, n, k, device="cuda")), "mx")
        return b, sb.view(E8M0)
    packed = torch.randint(0, 256, (e, n, k // 2), device="cuda", dtype=torch.uint8)
    sb = torch.randint(127 - 6, 127 + 7, (e, n, k // 32), device="cuda", dtype=torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2).mT, sb.view(E8M0)


def masked_tokens(e, capacity, k, magnitude=1.0):
    a, sa = tokens(e * capacity, k, magnitude)
    return a.view(e, capacity, k), sa.view(e, capacity, k // 32)


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("sizes", CONTIGUOUS_SIZES, ids=["ragged", "even17", "one", "mixed"])
def test_contiguous(hopper, sizes, recipe, config):
    """Empty groups, groups under a tile, tiles straddling two groups (rows run into the next group's, never
    stored), rows past offs[-1], an N tail (320: 2.5 tiles of 128) and a K tail (544: 4 k-blocks and one k-step)."""
    k, n = 544, 320
    t = sum(sizes) + 11
    a, sa = tokens(t, k)
    b, sb = experts(len(sizes), n, k, recipe)
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, config=CONFIGS[config])
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_masked(hopper, recipe, config):
    """Counts 0, 1, the capacity, a partial tile, one tile, half a tile (and expected_rows 16: the heuristic's
    decode tile); an N tail."""
    e, capacity, k, n = 6, 160, 384, 320
    counts = torch.tensor([0, 1, 160, 77, 128, 64], dtype=torch.int32, device="cuda")
    a, sa = masked_tokens(e, capacity, k)
    b, sb = experts(e, n, k, recipe)
    out = torch.full((e, capacity, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, config=CONFIGS[config], expected_rows=16)
    check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.bfloat16])


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_heuristic_tiles_and_byte_scales(hopper, masked, recipe):
    """The heuristic's decode (64 x 64) and prefill (128 x 128, TMA store) plans on many rows a group, and the e8m0
    scales passed as their uint8 bytes: the same output bit for bit."""
    k, n = 1024, 256
    sizes = [300, 0, 129, 64, 200]
    b, sb = experts(len(sizes), n, k, recipe)
    if masked:
        capacity = 320
        a, sa = masked_tokens(len(sizes), capacity, k)
        counts = torch.tensor(sizes, dtype=torch.int32, device="cuda")
        # NaN-poisoned: the rows past each count are never written
        out = torch.full((len(sizes), capacity, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, expected_rows=200)
        check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.bfloat16])
        decode = scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, expected_rows=4)
        same = scaled.scaled_grouped_mm_masked(a, b, sa.view(torch.uint8), sb.view(torch.uint8), counts,
                                               expected_rows=200)
    else:
        a, sa = tokens(sum(sizes), k)
        offs = sizes_to_offs(sizes)
        out = scaled.scaled_grouped_mm(a, b, sa, sb, offs)
        check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])
        decode = scaled.scaled_grouped_mm(a, b, sa, sb, offs, rows_per_group=4)
        same = scaled.scaled_grouped_mm(a, b, sa.view(torch.uint8), sb.view(torch.uint8), offs)
    owned = ~out.isnan()
    assert torch.equal(same[owned], out[owned])
    torch.testing.assert_close(decode[owned], out[owned], rtol=1e-2, atol=1e-2 * out[owned].abs().max().item())


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_output_dtypes(hopper, recipe, out_dtype):
    """fp16 (TMA store) and f32 (the register tile, the heuristic's fallback) outputs."""
    sizes = [40, 0, 200, 7]
    k, n = 512, 256
    a, sa = tokens(sum(sizes), k, 2.0 ** -8 if out_dtype == torch.float16 else 1.0)  # fp16: outputs well under 65504
    b, sb = experts(len(sizes), n, k, recipe)
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes), n), float("nan"), device="cuda", dtype=out_dtype)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=out_dtype)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[out_dtype])


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_long_k_promotes_every_k_step(hopper, recipe):
    """DeepSeek-V3's K = 7168 (224 k-steps) with f32 outputs, both layouts."""
    sizes = [96, 0, 33, 160]
    k, n = 7168, 256
    a, sa = tokens(sum(sizes), k)
    b, sb = experts(len(sizes), n, k, recipe)
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes), n), float("nan"), device="cuda", dtype=torch.float32)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=torch.float32)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.float32])
    a3, sa3 = masked_tokens(len(sizes), 160, k)
    counts = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    out3 = torch.full((len(sizes), 160, n), float("nan"), device="cuda", dtype=torch.float32)
    scaled.scaled_grouped_mm_masked(a3, b, sa3, sb, counts, out=out3, out_dtype=torch.float32)
    check(out3, scaled.grouped_reference(a3, b, sa3, sb, counts, masked=True), TOL[torch.float32])


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_moe_routing_many_experts(hopper, recipe):
    """E = 64 experts, 2048 token slots routed at random (odd experts empty): the scheduler's group table."""
    e, t, k, n = 64, 2048, 512, 256
    sizes = torch.bincount(torch.randint(0, e // 2, (t,)) * 2, minlength=e).tolist()
    a, sa = tokens(t, k)
    b, sb = experts(e, n, k, recipe)
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_mxfp8_skip_empty(hopper, masked):
    """skip_empty with MX scales (MXFP8: no conversion barrier between the consumers)."""
    config = ScaledConfig(128, 128, 4, 2, tma_store=True, skip_empty=True)
    k, n = 512, 320
    b, sb = experts(6, n, k, "mxfp8")
    if masked:
        counts = torch.tensor([0, 1, 160, 77, 128, 64], dtype=torch.int32, device="cuda")
        a, sa = masked_tokens(6, 160, k)
        out = torch.full((6, 160, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, config=config)
        check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.bfloat16])
        return
    sizes = [127, 129, 3, 0, 200, 64]
    a, sa = tokens(sum(sizes) + 5, k)
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes) + 5, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


def test_mx_nan_scale_stays_in_its_rows(hopper):
    """An e8m0 0xFF (NaN) token scale makes only its row NaN."""
    sizes = [50, 70]
    k, n = 256, 128
    a, sa = tokens(sum(sizes), k)
    b, sb = experts(2, n, k, "mxfp4")
    sa = sa.view(torch.uint8).clone()
    sa[60, 3] = 0xFF
    out = scaled.scaled_grouped_mm(a, b, sa, sb, sizes_to_offs(sizes), out_dtype=torch.float32)
    ref = scaled.grouped_reference(a, b, sa, sb, sizes_to_offs(sizes))
    assert out[60].isnan().all() and ref[60].isnan().all()
    keep = torch.arange(sum(sizes), device="cuda") != 60
    err = ((out[keep] - ref[keep]).norm() / ref[keep].norm()).item()
    assert err < TOL[torch.float32], err
