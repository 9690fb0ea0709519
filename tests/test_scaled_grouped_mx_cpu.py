"""The grouped scaled GEMM's MX recipes (MXFP8 tokens x MXFP8 or MXFP4 expert weights, e8m0 scales per 32 of K)
without a GPU: the kernel variants compile to fp8 wgmma promoted every k-step without spills (MXFP4: the packed
tile converted in shared memory), the plans, the recipe read off the dtypes and shapes, bad arguments named, the
float32 reference against the dense MX reference group by group, and a CPU model of the kernel's batched MX scale
indexing (the kernel's own ``promotion_scales`` and ``promote`` per thread, on ragged groups, both layouts, K and N
tails)."""
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfly

from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled import kernel as scaled_kernel
from nvfly.ops.scaled.grouped import compile_grouped_variants
from nvfly.ops.scaled.grouped_plan import deepest, fits, make_grouped_plan
from nvfly.ops.scaled.quantize import E2M1_VALUES, e8m0_to_float, quantize, quantize_experts
from tests.test_grouped_cpu import check_kernel
from tests.test_scaled_grouped_cpu import assert_names_the_argument

E4M3, FP4, E8M0 = torch.float8_e4m3fn, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu
MXFP8, MXFP4 = ScaledEpilogue("mxfp8", True), ScaledEpilogue("mxfp4", True)


def packed(cfg, epi):
    return replace(cfg, packed_b=epi.scaling == "mxfp4")


# the heuristic's tiles (decode 64 x 64, 128 x 128 with the TMA store; the f32 fallback 128 x 128 through registers)
# on both layouts and recipes, 2-block clusters along N and skip_empty (MXFP8: no conversion barrier)
MX_VARIANTS = [(layout, packed(cfg, epi), epi) for layout, cfg, epi in [
    ("contiguous", ScaledConfig(128, 128, 5, 2, tma_store=True), MXFP4),
    ("masked", ScaledConfig(64, 64, 10, 1), MXFP4),
    ("contiguous", ScaledConfig(64, 64, 12, 1), MXFP8),
    ("masked", ScaledConfig(128, 128, 6, 2, tma_store=True), MXFP8),
    ("contiguous", ScaledConfig(128, 128, 5, 2), MXFP4),
    ("masked", ScaledConfig(128, 128, 5, 2), MXFP8),
    ("contiguous", ScaledConfig(128, 128, 4, 2, tma_store=True, cluster_n=2), MXFP4),
    ("contiguous", ScaledConfig(128, 128, 6, 2, tma_store=True, skip_empty=True), MXFP8),
]]


@pytest.mark.parametrize("variant", MX_VARIANTS, ids=lambda v: f"{v[0]}-{v[1].bm}x{v[1].bn}-{v[2].scaling}"
                         f"{'-tmastore' if v[1].tma_store else ''}{'-cluster2n' if v[1].cluster_n > 1 else ''}"
                         f"{'-skip' if v[1].skip_empty else ''}")
def test_mx_variants_compile_to_fp8_wgmma_without_spills(variant):
    layout, cfg, epi = variant
    (k,) = compile_grouped_variants([variant], groups=8)
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    plan = make_grouped_plan(layout, epi, 8, 4096, 4096, 4096, 512, 132, cfg)
    assert k.dynamic_smem_bytes == plan.smem_bytes
    # a loop over the stage's four k-steps, each one wgmma per 64-row atom, promoted with the e8m0 bytes decoded
    assert k.count("QGMMA") == cfg.wg_m // 64 and "LDG.E.U8" in k.sass()
    # MXFP4: the packed tile read back 16 bytes at a time, converted, written as two 16-byte swizzled segments
    assert (k.count("LDS.128") >= 1 and k.count("STS.128") >= 2) == cfg.packed_b
    assert (k.count("UTMASTG") > 0) == cfg.tma_store
    assert ("MULTICAST" in k.sass()) == (cfg.cluster_n > 1)


def test_mx_plans():
    """The heuristic's MX tiles (in order, packed B for MXFP4, 64 x 64 for decode), the packed B boxes, and the
    configs the MX mainloop refuses."""
    decode = make_grouped_plan("masked", MXFP4, 256, 16, 4096, 7168, 4, 132)
    cfg = decode.config
    assert (cfg.bm, cfg.bn, cfg.consumers, cfg.packed_b, cfg.issue_ahead) == (64, 64, 1, True, False)
    assert decode.b_box == (1, 64, 64) and decode.b_swizzle == 0 and cfg.stages >= 8
    prefill = make_grouped_plan("contiguous", MXFP4, 256, 32768, 4096, 7168, 128, 132)
    cfg = prefill.config
    assert (cfg.bm, cfg.bn, cfg.consumers, cfg.tma_store, cfg.packed_b) == (128, 128, 2, True, True)
    assert prefill.b_box == (1, 128, 64) and prefill.smem_bytes <= 232448 and cfg.stages >= 4
    mxfp8 = make_grouped_plan("contiguous", MXFP8, 256, 32768, 4096, 7168, 128, 132)
    assert not mxfp8.config.packed_b and mxfp8.b_box == (1, 128, 128) and mxfp8.b_swizzle == 128
    # a caller's tile gets the packed B tile; MXFP8 refuses one, and MX refuses issuing ahead or staged (1x128)
    # scales; MXFP4 refuses skip_empty (both consumers convert every stage and meet on a barrier)
    mine = make_grouped_plan("masked", MXFP4, 8, 256, 4096, 4096, 64, 132, ScaledConfig(64, 64, 8, 1))
    assert mine.config.packed_b and mine.b_box == (1, 64, 64)
    for epi, config, match in ((MXFP8, ScaledConfig(64, 64, 8, 1, packed_b=True), "packed_b with mxfp8"),
                               (MXFP8, ScaledConfig(128, 128, 5, 2, issue_ahead=True), "issue_ahead with MX"),
                               (MXFP8, ScaledConfig(128, 128, 5, 2, staged_scales=True), "staged_scales"),
                               (MXFP4, ScaledConfig(128, 128, 4, 2, skip_empty=True), "skip_empty with packed")):
        with pytest.raises(ValueError, match=f"^config: {match}"):
            make_grouped_plan("contiguous", epi, 8, 4096, 4096, 4096, 512, 132, config)
    assert "packed_b with block" in fits(ScaledConfig(128, 128, 4, 2, packed_b=True), 8, ScaledEpilogue("block", True))
    assert scaled.describe_grouped("masked", 256, 16, 4096, 7168, scaling="mxfp4", rows_per_group=4).startswith(
        "scaled-grouped-masked-mxfp4-promoted: 64x64 tile on 1 consumer")


def test_mx_f32_outputs_fall_back_to_the_register_tile():
    from nvfly.ops.scaled.grouped import _plan
    a, b, sa, sb, offs = cpu_operands([100, 0, 300, 112], "mxfp4")
    for out_dtype, tma_store in ((torch.bfloat16, True), (torch.float32, False)):
        cfg = _plan(a, b, sa, sb, offs, out_dtype, None, False, False, None, 128.0, sms=132)[0].config
        assert (cfg.bm, cfg.bn, cfg.packed_b, cfg.tma_store) == (128, 128, True, tma_store)
        assert fits(cfg, 4, MXFP4) is None


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_mx_plans_walk_all_of_k(recipe, masked):
    """The plan's K is a's (MXFP4's b [E, K/2, N] holds two values a byte): every k-block is loaded and promoted,
    the K tail's included (the H200 run with K/2 walked half of K: relative errors 0.5 - 0.7)."""
    from nvfly.ops.scaled.grouped import _plan
    k = 544  # 4 k-blocks and one k-step
    a, b, sa, sb, offs = meta_mx(recipe, k=k, masked=masked)
    plan = _plan(a, b, sa, sb, offs, torch.bfloat16, None, False, masked, None, None, sms=132)[0]
    assert (plan.k, plan.k_tiles, plan.config.packed_b) == (k, 5, recipe == "mxfp4")


def test_quantize_experts_mxfp4_packs_each_expert_as_the_dense_quantiser():
    w = torch.randn(3, 48, 96) * torch.exp2(torch.randint(-4, 5, (3, 48, 3)).float()).repeat_interleave(32, 2)
    b, sb = quantize_experts(w, "mxfp4")
    assert b.dtype == FP4 and b.shape == (3, 48, 48) and b.stride() == (48 * 48, 1, 48)
    for g in range(3):
        q, s = quantize(w[g], "mxfp4", operand="b")
        assert q.shape == b[g].shape and q.stride() == b[g].stride()
        assert torch.equal(q.view(torch.uint8), b[g].view(torch.uint8)) and torch.equal(s, sb[g])


# ---------------------------------------------------------------------------------------------- checks
def meta_mx(recipe="mxfp4", t=512, e=4, k=256, n=384, masked=False, scale_dtype=E8M0):
    """MX operands on the meta device: MXFP8 tokens, MXFP8 or packed MXFP4 weights [E, K(/2), N] column-major,
    e8m0 scales (tokens' rows by K/32, [E, N, K/32])."""
    rows = (e, t) if masked else (t,)
    a = torch.empty(rows + (k,), dtype=E4M3, device="meta")
    b = torch.empty(e, n, k // 2, dtype=FP4, device="meta").mT if recipe == "mxfp4" else \
        torch.empty(e, n, k, dtype=E4M3, device="meta").mT
    sa = torch.empty(rows + (k // 32,), dtype=scale_dtype, device="meta")
    sb = torch.empty(e, n, k // 32, dtype=scale_dtype, device="meta")
    return a, b, sa, sb, torch.empty(e, dtype=torch.int32, device="meta")


@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_recipe_read_off_dtypes_and_shapes(recipe, masked):
    for scale_dtype in (E8M0, torch.uint8):  # float8_e8m0fnu, or their bytes (quantize's)
        a, b, sa, sb, offs = meta_mx(recipe, masked=masked, scale_dtype=scale_dtype)
        assert scaled.grouped_recipe(a, b, sa, sb) == recipe
        got, shape, groups = scaled.check_grouped(a, b, sa, sb, offs, masked=masked)
        assert (got, groups) == (recipe, 4) and shape == ((4, 512, 384) if masked else (512, 384))
    # K of whole 32s that is not a multiple of 128: a K tail of k-steps (TMA zero-fills the rest)
    a, b, sa, sb, offs = meta_mx(recipe, k=160, masked=masked)
    assert scaled.check_grouped(a, b, sa, sb, offs, masked=masked)[0] == recipe


def _mx_bad(**change):
    a, b, sa, sb, offs = meta_mx()
    args = dict(a=a, b=b, scale_a=sa, scale_b=sb, offs=offs)
    args.update(change)
    return args


MX_BAD = [
    (dict(scale_a=torch.empty(512, 2, dtype=E8M0, device="meta")), ValueError,
     r"^scale_a: shape \(512, 2\): expected \(512, 8\) e8m0 scales"),
    (dict(scale_b=torch.empty(4, 8, 384, dtype=E8M0, device="meta")), ValueError,
     r"^scale_b: shape \(4, 8, 384\): expected \(4, 384, 8\) e8m0 scales"),
    (dict(scale_b=torch.empty(4, 384, 8, device="meta")), TypeError, "^scale_b: dtype torch.float32 next to MX"),
    (dict(scale_a=torch.empty(512, 2, device="meta"), scale_b=torch.empty(4, 2, 3, device="meta")), TypeError,
     "^scale_a: dtype torch.float32 next to MX"),  # packed weights take e8m0 scales only
    (dict(b=torch.empty(4, 384, 64, dtype=FP4, device="meta").mT), ValueError,
     r"^b: shape \(4, 64, 384\) and a's \(512, 256\) do not multiply \(K is 256 in a, 128 in b\)"),
    (dict(b=torch.empty(4, 128, 384, dtype=FP4, device="meta")), ValueError, "^b: expected column-major"),
    (dict(a=torch.empty(512, 128, dtype=FP4, device="meta")), TypeError, "^a: dtype torch.float4_e2m1fn_x2"),
    (dict(a=torch.empty(512, 272, dtype=E4M3, device="meta"), b=torch.empty(4, 384, 136, dtype=FP4, device="meta").mT,
          scale_a=torch.empty(512, 8, dtype=E8M0, device="meta")), ValueError, "^a: K=272 is not a multiple of 32"),
    (dict(b=torch.empty(4, 384, 128, dtype=torch.uint8, device="meta").mT), TypeError,
     "^b: dtype torch.uint8: .*float4_e2m1fn_x2 MXFP4 weights"),
]


@pytest.mark.parametrize("change,kind,match", MX_BAD, ids=[m for _, _, m in MX_BAD])
def test_mx_bad_input_names_the_argument(change, kind, match):
    assert_names_the_argument(_mx_bad(**change), kind, match)


def test_mx_masked_scales_are_batched():
    a, b, sa, sb, counts = meta_mx(masked=True)
    with pytest.raises(ValueError, match=r"^scale_a: shape \(2048, 8\): expected \(4, 512, 8\)"):
        scaled.check_grouped(a, b, sa.flatten(0, 1), sb, counts, masked=True)
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_grouped_mm_masked: scale_b: shape"):
        scaled.scaled_grouped_mm_masked(a, b, sa, sb[:, :128], counts)


# ---------------------------------------------------------------------------------------------- reference
def cpu_operands(sizes, recipe, n=96, k=160, seed=0):
    """MXFP8 tokens of groups of ``sizes`` rows (contiguous) and MXFP8 or MXFP4 experts, values and scales spread
    (a scale of the wrong row, column, group or k-step shows), e8m0 scales; and the offsets."""
    g = torch.Generator().manual_seed(seed)
    t, e = sum(sizes), len(sizes)
    x = torch.randn(t, k, generator=g) * torch.exp2(torch.randint(-4, 5, (t, k // 32), generator=g).float()
                                                     ).repeat_interleave(32, 1)
    w = torch.randn(e, n, k, generator=g) * torch.exp2(torch.randint(-4, 5, (e, n, k // 32), generator=g).float()
                                                        ).repeat_interleave(32, 2)
    a, sa = quantize(x, "mx")
    b, sb = quantize_experts(w, "mx" if recipe == "mxfp8" else "mxfp4")
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return a, b, sa.view(E8M0), sb.view(E8M0), offs


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_mx_reference_is_the_dense_mx_reference_group_by_group(recipe):
    sizes = [5, 0, 70, 1]
    a, b, sa, sb, offs = cpu_operands(sizes, recipe)
    assert b.stride(-2) == 1 and b.shape == ((4, 160, 96) if recipe == "mxfp8" else (4, 80, 96))
    ref = scaled.grouped_reference(a, b, sa, sb, offs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        assert scaled.recipe(a[rows], b[g], sa[rows], sb[g]) == recipe
        torch.testing.assert_close(ref[rows], scaled.reference(a[rows], b[g], sa[rows], sb[g]))
        start += size
    # the masked layout: the same rows, NaN past each count
    a3, sa3 = masked_operands(a, sa, sizes, 70)
    masked = scaled.grouped_reference(a3, b, sa3, sb, torch.tensor(sizes, dtype=torch.int32), masked=True)
    start = 0
    for g, size in enumerate(sizes):
        torch.testing.assert_close(masked[g, :size], ref[start:start + size])
        assert masked[g, size:].isnan().all()
        start += size


def masked_operands(a, sa, sizes, capacity, seed=1):
    """The contiguous tokens regrouped as [E, capacity, K] (and scales), random bytes past each group's rows."""
    g = torch.Generator().manual_seed(seed)
    e, k = len(sizes), a.shape[1]
    a3 = torch.randint(0, 0x78, (e, capacity, k), generator=g, dtype=torch.uint8).view(E4M3)
    sa3 = torch.randint(100, 150, (e, capacity, k // 32), generator=g, dtype=torch.uint8).view(E8M0)
    start = 0
    for group, size in enumerate(sizes):
        a3[group, :size], sa3[group, :size] = a[start:start + size], sa[start:start + size]
        start += size
    return a3, sa3


def test_quantize_experts_mx_matches_quantize():
    w = torch.randn(3, 64, 96)
    for granularity in ("mx", "mxfp4"):
        b, sb = quantize_experts(w, granularity)
        q, s = quantize(w[1], granularity, operand="b")
        assert b.dtype == q.dtype and b[1].stride() == q.stride() and torch.equal(sb[1], s)
        assert torch.equal(b[1].view(torch.uint8), q.view(torch.uint8))
    assert sb.shape == (3, 64, 3) and b.shape == (3, 48, 64)


# ---------------------------------------------------------------------------------------------- scale indexing
class ModelAccumulator:
    """An accumulator fragment on the CPU: element e's value (``sm90.Accumulator``'s ``map``/``n``/indexing)."""

    def __init__(self, values):
        self.values = list(values)
        self.n = len(self.values)

    def __getitem__(self, e):
        return self.values[e]

    def map(self, fn):
        return ModelAccumulator(fn(v, e) for e, v in enumerate(self.values))


E8M0_VALUES = e8m0_to_float(torch.arange(256, dtype=torch.int32).to(torch.uint8)).tolist()


def e8m0_model(byte):
    """nvfly.arch.floats.e8m0_to_f32 on a numpy byte: the torch reference decoder's value."""
    return E8M0_VALUES[int(byte)]


def kernel_operands(a, b, recipe):
    """The kernel's operand values as float64: A's e4m3, and B [E, N, K] as its e4m3 tile holds it (MXFP4: e2m1
    times 2^-6, ``convert_packed_b``)."""
    if recipe == "mxfp4":
        nibbles = b.transpose(-1, -2).contiguous().view(torch.uint8).long()
        codes = torch.stack((nibbles & 15, nibbles >> 4), -1).flatten(-2)
        kernel_b = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes] * 2.0 ** -6
    else:
        kernel_b = b.transpose(-1, -2).double()
    return a.double().numpy(), kernel_b.numpy()


def model_grouped_mx(a, b, sa, sb, offs, cfg, epi, masked):
    """The grouped kernel's MX mainloop on the CPU, thread by thread: each group's tiles (contiguous: from the group's
    first row, rows past the group are the next group's, past T TMA's zeros; masked: from row 0 of the group),
    each consumer thread's fragment (element 4j + 2h + c of atom i at row row0 + 64i + 8h, column col0 + 8j + c),
    each wgmma k-step's partial (K past the operands: zeros) promoted with the kernel's ``promotion_scales`` (the
    scales batched by group) and ``promote``, stored where the epilogue stores (rows before the group's end,
    columns before N). Returns the output (NaN where nothing was stored) and how often each element was stored."""
    bm, bn, wg_m = cfg.bm, cfg.bn, cfg.wg_m
    atoms = wg_m // 64
    av, bv = kernel_operands(a, b, epi.scaling)
    sa_bytes, sb_bytes = sa.view(torch.uint8).numpy(), sb.view(torch.uint8).numpy()
    n, k, m = bv.shape[1], av.shape[-1], a.shape[-2]
    k_steps = -(-k // 128) * 4  # whole k-blocks of four wgmma k-steps
    out = np.full(tuple(a.shape[:-1]) + (n,), np.nan)
    stores = np.zeros(out.shape, dtype=int)
    ends = offs.tolist()  # contiguous: cumulative ends; masked: counts
    for g in range(len(ends)):
        start = 0 if masked else max(0, min(ends[g - 1] if g else 0, m))
        end = max(start, min(ends[g], m))
        a_rows = np.zeros((m + bm, k_steps * 32))  # TMA's zeros past the rows and K
        a_rows[:m, :k] = av[g] if masked else av
        b_cols = np.zeros((n + bn, k_steps * 32))
        b_cols[:n, :k] = bv[g]
        for tile_m in range(-(-(end - start) // bm)):
            row_base = start + tile_m * bm
            for tile_n in range(-(-n // bn)):
                # every k-step's partial products of the tile: [k_steps, bm, bn]
                tile_a = a_rows[row_base:row_base + bm].reshape(bm, k_steps, 32)
                tile_b = b_cols[tile_n * bn:tile_n * bn + bn].reshape(bn, k_steps, 32)
                parts = np.einsum("rsk,csk->src", tile_a, tile_b)
                for consumer in range(cfg.consumers):
                    for thread in range(128):
                        warp, lane = thread // 32, thread % 32
                        r0 = consumer * wg_m + warp * 16 + lane // 4  # in the tile
                        c0 = 2 * (lane % 4)
                        row0, col0 = row_base + r0, tile_n * bn + c0
                        sums = [ModelAccumulator([0.0] * (bn // 2)) for _ in range(atoms)]
                        for ks in range(k_steps):
                            partial = [ModelAccumulator(parts[ks, r0 + 64 * i + 8 * ((e // 2) % 2),
                                                              c0 + 8 * (e // 4) + e % 2] for e in range(bn // 2))
                                       for i in range(atoms)]
                            scales = scaled_kernel.promotion_scales(
                                sa_bytes, sb_bytes, row0, col0, kt=ks, m=m, n=n, BN=bn, ATOMS_M=atoms, EPI=epi,
                                a_group=g if masked else None, b_group=g)
                            sums = scaled_kernel.promote(sums, partial, scales, atoms, epi)
                        for i in range(atoms):
                            for e in range(bn // 2):
                                row, col = row0 + 64 * i + 8 * ((e // 2) % 2), col0 + 8 * (e // 4) + e % 2
                                if row < end and col < n:
                                    at = (g, row, col) if masked else (row, col)
                                    out[at] = sums[i][e]
                                    stores[at] += 1
    return out, stores


@pytest.mark.parametrize("two_consumers", [False, True], ids=["64x16", "128x32"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
@settings(max_examples=4, deadline=None)
@given(sizes=st.lists(st.integers(0, 80), min_size=1, max_size=3).filter(sum), k=st.sampled_from([32, 96, 160, 256]),
       n=st.sampled_from([16, 48, 64]))
def test_mx_scale_indexing_model(recipe, masked, two_consumers, sizes, k, n):
    """The kernel's MX promotion on the CPU (``model_grouped_mx``) equals the float32 reference of the dequantised
    operands on every owned element, each stored once, no other element stored: the tokens' scales by row (masked:
    of the group), the experts' by group, column and k-step (clamped past N), a K tail's zero k-steps, MXFP4's
    2^6 folded into B's scales."""
    cfg = packed(ScaledConfig(128, 32, 4, 2) if two_consumers else ScaledConfig(64, 16, 4, 1),
                 ScaledEpilogue(recipe, True))
    a, b, sa, sb, offs = cpu_operands(sizes, recipe, n=n, k=k)
    if masked:
        a, sa = masked_operands(a, sa, sizes, max(sizes) + 3)
        offs = torch.tensor(sizes, dtype=torch.int32)
    with pytest.MonkeyPatch.context() as patch:  # the kernel's device arithmetic on host values
        patch.setattr(scaled_kernel, "e8m0_to_f32", e8m0_model)
        patch.setattr(nvfly, "minimum", min)
        patch.setattr(nvfly, "fma", lambda x, y, z: x * y + z)
        out, stores = model_grouped_mx(a, b, sa, sb, offs, cfg, ScaledEpilogue(recipe, True), masked)
    ref = scaled.grouped_reference(a, b, sa, sb, offs, masked=masked).double().numpy()
    owned = ~np.isnan(ref)
    assert (stores[owned] == 1).all() and (stores[~owned] == 0).all()
    scale = np.abs(ref[owned]).max(initial=1.0)
    np.testing.assert_allclose(out[owned], ref[owned], rtol=1e-5, atol=1e-5 * scale)


def test_benchmark_grouped_mx_cases_plan():
    """benchmarks.scaled --grouped-mx's cases plan on both recipes: the 128 x 128 TMA-store tile at 4096 tokens (128
    rows an expert), the 64 x 64 decode tile on the masked batch, within shared memory next to 256 groups' table."""
    from benchmarks.grouped import Case, group_sizes
    from benchmarks.scaled import GROUPED_MX_CASES
    for name, kind, e, n, k, rows, routing in GROUPED_MX_CASES:
        sizes = group_sizes(Case(name, kind, e, n, k, rows, routing))
        assert sum(sizes) == rows and len(sizes) == e
        for epi in (MXFP8, MXFP4):
            layout = "masked" if kind == "masked" else "contiguous"
            plan = make_grouped_plan(layout, epi, e, 8 if kind == "masked" else rows, n, k, rows / e, 132)
            cfg = plan.config
            assert (cfg.bm, cfg.bn) == ((64, 64) if kind == "masked" else (128, 128)), name
            assert cfg.packed_b == (epi is MXFP4) and plan.smem_bytes <= 232448 and cfg.stages >= 4


def test_explain_describes_grouped_mx(capsys):
    from nvfly.cli import main
    assert main(["explain", "32768", "4096", "7168", "--groups", "256", "--scaled", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "scaled-grouped-contiguous-mxfp4-promoted: 128x128 tile on 2 consumers" in out and "mxfp4 scales" in out
    assert main(["explain", "16", "4096", "7168", "--groups", "256", "--scaled", "mxfp8", "--layout", "masked"]) == 0
    assert "scaled-grouped-masked-mxfp8-promoted: 64x64 tile on 1 consumer" in capsys.readouterr().out


def test_routes_leave_mx_scales_to_torch(monkeypatch):
    """torch._scaled_grouped_mm's route takes row-wise scales only: MX operands (here with nvfly's own scale layout)
    stay on torch with the recipe named (the device checks taken as passed: they need a GPU)."""
    from nvfly.torch import scaled_grouped_ops as routes
    monkeypatch.setattr(scaled, "grouped_eligibility", lambda *args, **kwargs: None)
    for recipe in ("mxfp8", "mxfp4"):
        a, b, sa, sb, offs = meta_mx(recipe)
        assert routes.grouped_eligibility(a, b, sa, sb, offs).startswith(f"{recipe} scales: torch's grouped")
