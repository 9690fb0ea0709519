"""nvfly's grouped FP8 GEMM (MoE experts) against the float32 product of the dequantised operands group by group:
1x128 x 128x128 block scales (promoted every k-block) and row-wise scales (promoted or fast-accumulating), the
contiguous layout with ragged groups (empty, under a tile, unaligned, tails in N), the masked layout with device
counts (0 to the capacity), both tiles, output dtypes, long K (56 k-blocks), torch._scaled_grouped_mm's route, and
poisoned outputs (every row a group owns is written, no other row is). Fresh random inputs, rows and 128-blocks of
very different magnitudes (a scale applied to the wrong row, column, group or block shows)."""
import pytest
import torch

import nvfly.torch  # noqa: F401  (the routes)
from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledConfig
from nvfly.ops.scaled import grouped as grouped_module
from nvfly.ops.scaled.quantize import quantize, quantize_experts
from tests.gpu.test_grouped_gpu import CONTIGUOUS_SIZES, check, sizes_to_offs

pytestmark = pytest.mark.gpu

SMALL = ScaledConfig(64, 128, 9, 1)    # the decode tile
LARGE = ScaledConfig(128, 128, 6, 2)   # the prefill tile
TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-3}


def spread(x):
    """x with rows and 128-wide K blocks scaled by 2^-2 .. 2^2."""
    rows = torch.exp2(torch.randint(-2, 3, x.shape[:-1] + (1,), device="cuda").float())
    k = x.shape[-1]
    blocks = torch.exp2(torch.randint(-2, 3, (-(-k // 128),), device="cuda").float()).repeat_interleave(128)[:k]
    return x * rows * blocks


def tokens(t, k, scaling, magnitude=1.0):
    """Quantised tokens [t, k] and their scales (block: [t, K/128] with torch's (1, t) strides; row: [t]);
    ``magnitude`` scales the values (fp16 outputs: the spread's 2^8 range over K 1024 can pass fp16's 65504)."""
    a, sa = quantize(spread(torch.randn(t, k, device="cuda")) * magnitude, "1x128" if scaling == "block" else "row")
    return a, sa if scaling == "block" else sa.reshape(-1)


def experts(e, n, k, scaling):
    w = spread(torch.randn(e, n, k, device="cuda")) * torch.exp2(torch.randint(-2, 3, (e, 1, 1), device="cuda"))
    return quantize_experts(w, "128x128" if scaling == "block" else "row")




@pytest.mark.parametrize("config", [None, SMALL, LARGE], ids=["heuristic", "64x128", "128x128"])
@pytest.mark.parametrize("scaling", ["block", "row"])
@pytest.mark.parametrize("sizes", CONTIGUOUS_SIZES, ids=["ragged", "even17", "one", "mixed"])
def test_contiguous(hopper, sizes, scaling, config):
    k, n = 512, 320  # an N tail (320 = 2.5 tiles; block scales: 3 column blocks)
    t = sum(sizes) + 11  # rows past offs[-1]: never written
    a, sa = tokens(t, k, scaling)
    b, sb = experts(len(sizes), n, k, scaling)
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


@pytest.mark.parametrize("config", [None, SMALL, LARGE], ids=["heuristic", "64x128", "128x128"])
@pytest.mark.parametrize("scaling", ["block", "row"])
def test_masked(hopper, scaling, config):
    e, capacity, k, n = 6, 160, 384, 256
    counts = torch.tensor([0, 1, 160, 77, 128, 64], dtype=torch.int32, device="cuda")
    a, sa = tokens(e * capacity, k, scaling)
    a = a.view(e, capacity, k)
    sa = sa.reshape(e, capacity, -1) if scaling == "block" else sa.view(e, capacity)
    b, sb = experts(e, n, k, scaling)
    out = torch.full((e, capacity, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, config=config, expected_rows=16)
    check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.bfloat16])


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fast", [False, True])
def test_row_wise_output_dtypes_and_fast_accumulation(hopper, out_dtype, fast):
    sizes = [40, 0, 200, 7]
    k, n = 1024, 256
    a, sa = tokens(sum(sizes), k, "row", 2.0 ** -6 if out_dtype == torch.float16 else 1.0)
    b, sb = experts(len(sizes), n, k, "row")
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes), n), float("nan"), device="cuda", dtype=out_dtype)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=out_dtype, use_fast_accum=fast)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), 5e-3 if fast else TOL[out_dtype])


def test_long_k_block_scales_promote(hopper):
    """DeepSeek-V3's K = 7168 (56 k-blocks): promotion keeps fp32 accuracy over the whole sum (fp32 out)."""
    sizes = [96, 0, 33, 160]
    k, n = 7168, 256
    a, sa = tokens(sum(sizes), k, "block")
    b, sb = experts(len(sizes), n, k, "block")
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes), n), float("nan"), device="cuda", dtype=torch.float32)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=torch.float32)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), 5e-4)


def test_moe_routing_many_experts(hopper):
    """E = 64 experts, 2048 token slots routed at random (some experts empty): the scheduler's group table."""
    e, t, k, n = 64, 2048, 512, 256
    sizes = torch.bincount(torch.randint(0, e // 2, (t,)) * 2, minlength=e).tolist()  # odd experts empty
    a, sa = tokens(t, k, "block")
    b, sb = experts(e, n, k, "block")
    offs = sizes_to_offs(sizes)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


# issue #30's block-scale tiles (benchmarks.grouped's FP8_BLOCK_VARIANTS): staged activation scales on the default
# tile, 192 and 160 wide (in order), 192 wide reading sa from global, the TMA-store epilogue (rows inside their
# group; the rest through registers) and 2-block clusters along N multicasting A (N = 352 on 128-wide tiles: 3 tile
# columns, the cluster's 4th computed past N and not stored), L2 hints on the loads, and consumers that skip the
# k-blocks of their empty half of a group's last tile
BLOCK_VARIANTS = [ScaledConfig(128, 128, 6, 2, issue_ahead=True, staged_scales=True),
                  ScaledConfig(128, 192, 5, 2, staged_scales=True), ScaledConfig(128, 160, 5, 2, staged_scales=True),
                  ScaledConfig(128, 192, 5, 2),
                  ScaledConfig(128, 128, 5, 2, issue_ahead=True, staged_scales=True, tma_store=True),
                  ScaledConfig(128, 128, 6, 2, issue_ahead=True, tma_store=True),
                  ScaledConfig(128, 192, 4, 2, staged_scales=True, tma_store=True),
                  ScaledConfig(128, 160, 5, 2, staged_scales=True, tma_store=True),
                  ScaledConfig(128, 128, 5, 2, issue_ahead=True, staged_scales=True, tma_store=True, cluster_n=2),
                  ScaledConfig(128, 192, 4, 2, staged_scales=True, tma_store=True, cluster_n=2),
                  ScaledConfig(128, 128, 5, 2, issue_ahead=True, staged_scales=True, tma_store=True, stream_b=True),
                  ScaledConfig(128, 192, 4, 2, staged_scales=True, tma_store=True, cluster_n=2, skip_empty=True),
                  ScaledConfig(128, 128, 6, 2, issue_ahead=True, skip_empty=True)]
BLOCK_IDS = ["128x128-ahead-staged", "128x192-staged", "128x160-staged", "128x192", "128x128-ahead-staged-tmastore",
             "128x128-ahead-tmastore", "128x192-staged-tmastore", "128x160-staged-tmastore",
             "128x128-ahead-staged-tmastore-cluster2n", "128x192-staged-tmastore-cluster2n",
             "128x128-ahead-staged-tmastore-streamb", "128x192-staged-tmastore-cluster2n-skip", "128x128-ahead-skip"]


def staged_runs(plan, config):
    """The staged variants must run staged (not the fallback's global reads): TMA can load the tokens' scales in the
    plan's boxes (contiguous: bm + 4 rows from the tile's first row rounded down to 16 bytes)."""
    assert plan.config.staged_scales == config.staged_scales, plan.config


@pytest.mark.parametrize("config", BLOCK_VARIANTS, ids=BLOCK_IDS)
@pytest.mark.parametrize("sizes", CONTIGUOUS_SIZES, ids=["ragged", "even17", "one", "mixed"])
def test_block_variants_contiguous(hopper, sizes, config):
    """Empty groups, groups under a tile, tiles straddling two groups (rows run into the next group's, never
    stored; staged configs load their scales in boxes from the tile's first row rounded down to 16 bytes: the
    groups' rows start anywhere), rows past offs[-1], an N tail (352: 1.8 tiles of 192, 2.2 of 160, the last tile's
    columns in a third weight block) and K of 8 k-blocks."""
    k, n = 1024, 352
    t = 4 * (sum(sizes) // 4) + 12  # rows past offs[-1]; a multiple of 4 (TMA's 16-byte strides)
    a, sa = tokens(t, k, "block")
    b, sb = experts(len(sizes), n, k, "block")
    offs = sizes_to_offs(sizes)
    staged_runs(grouped_module._plan(a, b, sa, sb, offs, torch.bfloat16, None, False, False, config, None)[0], config)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.bfloat16])


@pytest.mark.parametrize("config", BLOCK_VARIANTS, ids=BLOCK_IDS)
def test_block_variants_masked(hopper, config):
    """The masked layout (staged: 3-D boxes of scale_a [E, Mmax, K/128]): counts 0, 1, a partial tile, the capacity,
    one tile, half a tile; an N tail."""
    e, capacity, k, n = 6, 160, 640, 352
    counts = torch.tensor([0, 1, 160, 77, 128, 64], dtype=torch.int32, device="cuda")
    a, sa = tokens(e * capacity, k, "block")
    a, sa = a.view(e, capacity, k), sa.reshape(e, capacity, -1)
    b, sb = experts(e, n, k, "block")
    staged_runs(grouped_module._plan(a, b, sa, sb, counts, torch.bfloat16, None, False, True, config, None)[0],
                config)
    out = torch.full((e, capacity, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.bfloat16])


@pytest.mark.parametrize("config", BLOCK_VARIANTS[:2] + BLOCK_VARIANTS[4:5], ids=BLOCK_IDS[:2] + BLOCK_IDS[4:5])
def test_block_variants_long_k(hopper, config):
    """DeepSeek-V3's K = 7168 with f32 outputs (the promotion's accuracy over 56 k-blocks; a TMA-store config stores
    them through registers) on E = 16 experts, and the staged path's fallback: scale_a with T not a multiple of 4 is
    read from global (the same result)."""
    sizes = [96, 0, 33, 160, 128, 128, 1, 0, 255, 64, 64, 7, 130, 0, 40, 2]
    k, n = 7168, 384
    a, sa = tokens(sum(sizes) + 4, k, "block")
    b, sb = experts(len(sizes), n, k, "block")
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes) + 4, n), float("nan"), device="cuda", dtype=torch.float32)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=torch.float32, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), 5e-4)
    odd = sum(sizes) + 3
    a3, sa3 = a[:odd].contiguous(), sa[:odd].t().contiguous().t()  # (1, T) strides, T odd: no TMA
    got = scaled.scaled_grouped_mm(a3, b, sa3, sb, offs, out_dtype=torch.float32, config=config)
    owned = ~out[:odd].isnan()
    assert torch.equal(got[owned], out[:odd][owned])


@pytest.mark.parametrize("config", [ScaledConfig(128, 128, 6, 2, tma_store=True),
                                    ScaledConfig(128, 128, 6, 2, tma_store=True, cluster_n=2)],
                         ids=["tmastore", "tmastore-cluster2n"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_row_wise_tma_store(hopper, masked, config):
    """The TMA-store epilogue with row-wise scales (applied in registers before staging), fp16 out; with clusters
    along N (320 columns: 3 tile columns, a 4th computed and not stored)."""
    k, n = 512, 320
    if masked:
        e, capacity = 6, 160
        counts = torch.tensor([0, 1, 160, 77, 128, 64], dtype=torch.int32, device="cuda")
        a, sa = tokens(e * capacity, k, "row")
        a, sa = a.view(e, capacity, k), sa.view(e, capacity)
        b, sb = experts(e, n, k, "row")
        out = torch.full((e, capacity, n), float("nan"), device="cuda", dtype=torch.float16)
        scaled.scaled_grouped_mm_masked(a, b, sa, sb, counts, out=out, out_dtype=torch.float16, config=config)
        check(out, scaled.grouped_reference(a, b, sa, sb, counts, masked=True), TOL[torch.float16])
        return
    sizes = CONTIGUOUS_SIZES[3]
    a, sa = tokens(sum(sizes) + 8, k, "row")
    b, sb = experts(len(sizes), n, k, "row")
    offs = sizes_to_offs(sizes)
    out = torch.full((sum(sizes) + 8, n), float("nan"), device="cuda", dtype=torch.float16)
    scaled.scaled_grouped_mm(a, b, sa, sb, offs, out=out, out_dtype=torch.float16, config=config)
    check(out, scaled.grouped_reference(a, b, sa, sb, offs), TOL[torch.float16])


def torch_own(*args, **kwargs):
    """torch._scaled_grouped_mm on torch's kernel, or None where this torch has none for these operands."""
    try:
        return torch._scaled_grouped_mm(*args, **kwargs)
    except RuntimeError:
        return None


def test_torch_scaled_grouped_mm_is_routed(hopper):
    """torch._scaled_grouped_mm (row-wise, 2-D x 3-D and 3-D x 3-D) under routing: nvfly's kernel's result (bit for
    bit: a failure inside the route would fall back to torch quietly), close to the reference and to torch's own
    kernel where it runs."""
    sizes = [32, 0, 96, 16]
    k, n = 512, 256
    a, sa = tokens(sum(sizes), k, "row")
    b, sb = experts(len(sizes), n, k, "row")
    offs = sizes_to_offs(sizes)
    from nvfly.torch import scaled_grouped_ops
    assert scaled_grouped_ops.grouped_eligibility(a, b, sa, sb, offs, None, None, torch.bfloat16) is None
    with nvfly.torch.routing():
        routed = torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    ref = scaled.grouped_reference(a, b, sa, sb, offs)
    check(routed, ref, TOL[torch.bfloat16])
    owned = ~ref.isnan()
    assert torch.equal(routed[owned], scaled.scaled_grouped_mm(a, b, sa, sb, offs)[owned])
    own = torch_own(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    if own is not None:
        torch.testing.assert_close(routed, own, rtol=2e-2, atol=2e-2 * own.abs().max().item())
    a3, sa3 = a[:96].reshape(3, 32, k), sa[:96].reshape(3, 32)
    with nvfly.torch.routing():
        batched = torch._scaled_grouped_mm(a3, b[:3], sa3, sb[:3], out_dtype=torch.bfloat16)
    full = torch.full((3,), 32, dtype=torch.int32, device="cuda")
    assert torch.equal(batched, scaled.scaled_grouped_mm_masked(a3, b[:3], sa3, sb[:3], full))
    own = torch_own(a3, b[:3], sa3, sb[:3], out_dtype=torch.bfloat16)
    if own is not None:
        torch.testing.assert_close(batched, own, rtol=2e-2, atol=2e-2 * own.abs().max().item())


def test_bad_input_is_declined_and_bad_offsets_clamped(hopper):
    a, sa = tokens(64, 256, "block")
    b, sb = experts(2, 128, 256, "block")
    offs = sizes_to_offs([32, 32])
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_grouped_mm: offs is on cpu"):
        scaled.scaled_grouped_mm(a, b, sa, sb, offs.cpu())
    bad = torch.tensor([40, 30], dtype=torch.int32, device="cuda")  # decreasing: group 1 is clamped to empty
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_grouped_mm: offs: offsets must not decrease"):
        scaled.scaled_grouped_mm(a, b, sa, sb, bad, check_offsets=True)
    out = torch.full((64, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    scaled.scaled_grouped_mm(a, b, sa, sb, bad, out=out)
    assert torch.isfinite(out[:40]).all() and out[40:].isnan().all()
    counts = torch.tensor([3, 99], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_grouped_mm_masked: counts: count 99 of group 1"):
        scaled.scaled_grouped_mm_masked(a.view(2, 32, 256), b, sa.reshape(2, 32, 2), sb, counts, check_offsets=True)
