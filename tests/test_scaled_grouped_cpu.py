"""The grouped FP8 GEMM (MoE experts, block or row-wise scales) without a GPU: every kernel variant compiles to fp8
wgmma (QGMMA) and TMA code without spills, the plans follow the heuristic and fit shared memory, bad arguments raise
errors naming them, the float32 reference is the dense scaled GEMM's group by group, and the torch routes decide
as documented."""
import re
from dataclasses import replace

import pytest
import torch

from nvfly.ops import scaled
from nvfly.ops.common.gemm_config import SMEM_LIMIT
from nvfly.ops.scaled import ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled.grouped import compile_grouped_variants
from nvfly.ops.scaled.config import SCALE_ALIGN, SCALE_SLOT
from nvfly.ops.scaled.grouped_plan import MAX_GROUPS, deepest, fits, make_grouped_plan
from nvfly.ops.scaled.plan import make_plan
from nvfly.ops.scaled.quantize import quantize, quantize_experts
from tests.test_grouped_cpu import check_kernel

E4M3 = torch.float8_e4m3fn
VARIANTS = [
    ("contiguous", ScaledConfig(128, 128, 6, 2), ScaledEpilogue("block", True)),
    ("masked", ScaledConfig(64, 128, 9, 1), ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 128, 6, 2), ScaledEpilogue("row", False)),
    ("masked", ScaledConfig(128, 128, 6, 2), ScaledEpilogue("row", True)),
    ("contiguous", ScaledConfig(128, 128, 6, 2, issue_ahead=True), ScaledEpilogue("block", True)),
    # issue #30's candidates: staged activation scales, 192 and 160 wide (three or five weight-block runs, in order)
    ("contiguous", ScaledConfig(128, 128, 6, 2, issue_ahead=True, staged_scales=True), ScaledEpilogue("block", True)),
    ("masked", ScaledConfig(128, 192, 5, 2, staged_scales=True), ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 160, 5, 2, staged_scales=True), ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 192, 5, 2), ScaledEpilogue("block", True)),
    # the TMA-store epilogue (rows inside their group; the others through registers)
    ("contiguous", ScaledConfig(128, 128, 6, 2, issue_ahead=True, staged_scales=True, tma_store=True),
     ScaledEpilogue("block", True)),
    ("masked", ScaledConfig(128, 192, 5, 2, staged_scales=True, tma_store=True), ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 160, 5, 2, staged_scales=True, tma_store=True), ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 128, 6, 2, tma_store=True), ScaledEpilogue("row", True)),
    # 2-block clusters along N multicasting A
    ("contiguous", ScaledConfig(128, 128, 5, 2, issue_ahead=True, staged_scales=True, tma_store=True, cluster_n=2),
     ScaledEpilogue("block", True)),
    ("masked", ScaledConfig(128, 192, 5, 2, staged_scales=True, cluster_n=2), ScaledEpilogue("block", True)),
    # the default tile (128 x 192, TMA store, 2-block clusters) with staged scales on the contiguous layout
    ("contiguous", ScaledConfig(128, 192, 4, 2, staged_scales=True, tma_store=True, cluster_n=2),
     ScaledEpilogue("block", True)),
    ("contiguous", ScaledConfig(128, 128, 6, 2, cluster_n=2), ScaledEpilogue("row", False)),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1].bm}x{v[1].bn}-{v[2].scaling}"
                         f"{'-promoted' if v[2].promote else ''}{'-ahead' if v[1].issue_ahead else ''}"
                         f"{'-staged' if v[1].staged_scales else ''}{'-tmastore' if v[1].tma_store else ''}"
                         f"{'-cluster2n' if v[1].cluster_n > 1 else ''}")
def test_variants_compile_to_fp8_wgmma_without_spills(variant):
    layout, cfg, epi = variant
    (k,) = compile_grouped_variants([variant], groups=8)
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    # issuing ahead: the next k-block's wgmmas stay in flight while the previous one is promoted
    assert not epi.promote or ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in k.sass()) == cfg.issue_ahead
    plan = make_grouped_plan(layout, epi, 8, 4096, 4096, 4096, 512, 132, cfg)
    assert k.dynamic_smem_bytes == plan.smem_bytes
    # the TMA-store epilogue: a TMA store per column slice of the consumer's rows, staged with stmatrix; the register
    # stores stay for rows that cross their group's end
    assert (k.count("UTMASTG") > 0) == cfg.tma_store and (k.count("STSM") > 0) == cfg.tma_store
    assert k.count("STG") > 0
    # clusters: each block loads its half of A and multicasts it; a stage is released on both blocks' barriers
    assert ("MULTICAST" in k.sass()) == (cfg.cluster_n > 1)
    assert k.cluster == ((2, 1, 1) if cfg.cluster_n > 1 else None)


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_staged_scales_come_from_shared_memory(layout):
    """ScaledConfig.staged_scales in the grouped kernel: the producer also TMA-loads the tile rows' activation scales
    of each k-block (2-D boxes of the tokens' scales, 3-D of the masked layout's), and the consumers read them with
    shared loads: more TMA loads and shared loads, fewer global loads than the same kernel reading sa from global."""
    cfg = ScaledConfig(128, 128, 6, 2, issue_ahead=True)
    staged = replace(cfg, staged_scales=True)
    epi = ScaledEpilogue("block", True)
    plain, mine = compile_grouped_variants([(layout, cfg, epi), (layout, staged, epi)])
    check_kernel(mine, "QGMMA.64x128x32.F32.E4M3.E4M3")
    assert mine.count("UTMALDG") % 3 == 0 and plain.count("UTMALDG") % 2 == 0  # A, B (and sa) a k-block
    assert mine.count("LDS") >= plain.count("LDS") + 2
    assert mine.count("LDG") <= plain.count("LDG") - 2
    assert plan_of(layout, staged).smem_bytes == plan_of(layout, cfg).smem_bytes + 6 * 1024
    # contiguous tiles start at any row: the box starts at the row rounded down to 16 bytes, 4 rows longer, and the
    # stage's expected bytes follow it exactly (masked boxes start at multiples of bm: bm rows)
    rows = plan_of(layout, staged).scale_rows
    assert rows == (128 + SCALE_ALIGN if layout == "contiguous" else 128) and 4 * rows <= SCALE_SLOT
    consts = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", mine.ptx))
    expect = {int(consts[r]) for r in re.findall(r"expect_tx\.shared::cta\.b64 _, \[%r\d+\], (%r\d+);", mine.ptx)}
    assert expect == {staged.load_bytes + 4 * (rows - 128)}, expect


def plan_of(layout, cfg):
    return make_grouped_plan(layout, ScaledEpilogue("block", True), 8, 4096, 4096, 4096, 512, 132, cfg)


def test_staged_scales_and_wide_tiles_plans_and_fallback():
    """Staged scales take block scales only, and fall back to global reads where TMA cannot load scale_a (the
    quantiser's (1, T) strides load; T not a multiple of 4 does not); the contiguous layout's bm + 4 row boxes fit
    the slot up to 252 rows (256-row tiles stage there on the masked layout only); 192 and 160 wide tiles take
    block scales in order (a third accumulator would not fit), 256-row tiles none (two 128-row promoted
    accumulators)."""
    from nvfly.ops.scaled.api import staged_scales_reason
    from nvfly.ops.scaled.grouped import _plan
    block, row = ScaledEpilogue("block", True), ScaledEpilogue("row", True)
    staged = ScaledConfig(128, 128, 6, 2, staged_scales=True)
    assert fits(staged, 8, block) is None and "staged_scales" in fits(staged, 8, row)
    assert fits(ScaledConfig(128, 192, 5, 2, staged_scales=True), 256, block) is None
    assert "accumulator registers" in fits(ScaledConfig(128, 192, 5, 2, issue_ahead=True), 8, block)
    assert "accumulator registers" in fits(ScaledConfig(256, 128, 4, 2), 8, block)
    # 256 x 64 fits, but the contiguous layout's staged box of 256 + 4 rows would not fit the slot (masked: 256)
    tall = ScaledConfig(256, 64, 4, 2, staged_scales=True)
    assert fits(tall, 8, block) is None and plan_of("masked", tall).scale_rows == 256
    with pytest.raises(ValueError, match="256 \\+ 4|bm=256"):
        plan_of("contiguous", tall)
    assert scaled.describe_grouped("contiguous", 256, 32768, 4096, 7168).startswith(
        "scaled-grouped-contiguous-block-promoted-staged: 128x192")  # the default stages the tokens' scales
    for t, staged_ok in ((512, True), (510, False)):
        a, sa = quantize(torch.randn(t, 256), "1x128")
        assert (staged_scales_reason(sa, 128) is None) == staged_ok
        b, sb = quantize_experts(torch.randn(4, 256, 256), "128x128")
        offs = torch.tensor([100, 100, 300, t], dtype=torch.int32)
        plan, _ = _plan(a, b, sa, sb, offs, torch.bfloat16, None, False, False, staged, None, sms=132)
        assert plan.config.staged_scales == staged_ok and plan.config.stages == 6 and plan.scale_rows == 132
    # the heuristic's 128 x 192 clustered tile stores through TMA; an f32 output takes the 128 x 128 tile instead
    a, sa = quantize(torch.randn(512, 256), "1x128")
    for out_dtype, tile in ((torch.bfloat16, (192, True, 2)), (torch.float32, (128, False, 1))):
        cfg = _plan(a, b, sa, sb, offs, out_dtype, None, False, False, None, 128.0, sms=132)[0].config
        assert (cfg.bn, cfg.tma_store, cfg.cluster_n) == tile
    # masked: scale_a [E, Mmax, K/128] seen as [K/128, E, Mmax]
    a, sa = quantize(torch.randn(4 * 64, 256), "1x128")
    sa3 = sa.reshape(4, 64, 2)
    assert staged_scales_reason(sa3, 128) is None and "contiguous" in staged_scales_reason(sa3.contiguous(), 128)
    b, sb = quantize_experts(torch.randn(4, 256, 256), "128x128")
    counts = torch.tensor([0, 5, 64, 33], dtype=torch.int32)
    plan, _ = _plan(a.view(4, 64, 256), b, sa3, sb, counts, torch.bfloat16, None, False, True, staged, None, sms=132)
    assert plan.config.staged_scales and plan.layout == "masked"


def test_tma_store_plans_and_fallback():
    """The TMA-store epilogue's staging buffers come out of the ring (one stage fewer at 256 groups), its output
    boxes are the dense kernels' (2-D for the contiguous [T, N], 3-D for the masked [E, Mmax, N]), and f32 outputs
    store through registers."""
    from nvfly.ops.scaled.grouped import _plan
    block = ScaledEpilogue("block", True)
    plain = deepest(ScaledConfig(128, 128, 2, 2, issue_ahead=True), 256)
    store = deepest(replace(plain, tma_store=True), 256)
    assert store.staging_bytes() == 2 * 64 * 64 * 2 and store.stages == plain.stages - 1
    contiguous = make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 132, store)
    assert contiguous.store_box == ((64, 64), 128) and contiguous.smem_bytes <= 232448
    masked = make_grouped_plan("masked", block, 256, 256, 4096, 7168, 128, 132, store)
    assert masked.store_box == ((1, 64, 64), 128)
    assert make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 132, plain).store_box is None
    a, sa = quantize(torch.randn(512, 256), "1x128")
    b, sb = quantize_experts(torch.randn(4, 256, 256), "128x128")
    offs = torch.tensor([100, 100, 300, 512], dtype=torch.int32)
    for out_dtype, stored in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        plan, _ = _plan(a, b, sa, sb, offs, out_dtype, None, False, False, store, None, sms=132)
        assert plan.config.tma_store == stored and (plan.store_box is not None) == stored
    strided = torch.empty(512, 264, dtype=torch.bfloat16)[:, :256]  # rows 528 bytes apart: TMA can store them
    assert _plan(a, b, sa, sb, offs, torch.bfloat16, strided, False, False, store, None, sms=132)[0].store_box
    odd = torch.empty(512, 260, dtype=torch.bfloat16)[:, :256]  # 520 bytes: not a multiple of 16
    assert not _plan(a, b, sa, sb, offs, torch.bfloat16, odd, False, False, store, None, sms=132)[0].store_box


def test_cluster_plans():
    """cluster_n=2: A's box is half the tile rows (each block loads and multicasts one half), the grid a whole number
    of clusters, the tile bound in whole cluster columns; clusters of 4 are the dense kernel's only."""
    block = ScaledEpilogue("block", True)
    cfg = deepest(ScaledConfig(128, 128, 2, 2, issue_ahead=True, cluster_n=2), 256)
    plan = make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 132, cfg)
    assert plan.a_box == (64, 128) and plan.b_box == (1, 128, 128) and plan.grid == 132
    # the tile rows' bound x 3 tile columns in 2 clusters (4 columns)
    assert make_grouped_plan("masked", block, 4, 100, 320, 512, 100, 131, cfg).grid == 4 * 4
    assert make_grouped_plan("contiguous", block, 2, 100, 320, 512, 50, 131, cfg).grid == (1 + 2) * 4
    assert make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 131, cfg).grid == 130
    assert "cluster_n=3" in fits(replace(cfg, cluster_n=3), 8, block)
    assert "1 or 2 blocks per cluster" in fits(replace(cfg, cluster_n=4), 8, block)


def test_stream_hints():
    """stream_b: the weights' TMA loads evict_first, the tokens' evict_last (every load hinted; the dense GEMM's
    load_hint); unhinted by default; at most one operand streamed; the dense scaled GEMM takes none."""
    from nvfly.arch.memory import L2Policy
    block = ScaledEpilogue("block", True)
    cfg = ScaledConfig(128, 128, 6, 2, issue_ahead=True, staged_scales=True)
    hinted, plain = compile_grouped_variants([("contiguous", replace(cfg, stream_b=True), block),
                                              ("contiguous", cfg, block)])
    loads = [line for line in hinted.ptx.splitlines() if "cp.async.bulk.tensor" in line and "global.mbarrier" in line]
    hinted_loads = [line for line in loads if ".L2::cache_hint" in line]
    assert loads and len(hinted_loads) == 2 * len(loads) // 3  # A and B, not the staged scales
    assert str(L2Policy.EVICT_FIRST.descriptor) in hinted.ptx and str(L2Policy.EVICT_LAST.descriptor) in hinted.ptx
    assert ".L2::cache_hint" not in plain.ptx
    check_kernel(hinted, "QGMMA.64x128x32.F32.E4M3.E4M3")
    assert "at most one operand" in fits(replace(cfg, stream_a=True, stream_b=True), 8, block)
    with pytest.raises(ValueError, match="^config: stream_a, stream_b: only the grouped"):
        make_plan(4096, 4096, 4096, block, ScaledConfig(128, 128, 6, 2, stream_b=True), None, 132)


def test_fp16_and_fp32_outputs_and_many_groups_compile():
    for out_dtype in (torch.float16, torch.float32):
        (k,) = compile_grouped_variants([VARIANTS[0]], out_dtype=out_dtype)
        assert k.resources.spill_stores == 0 and not k.warnings
    cfg = deepest(ScaledConfig(128, 128, 2, 2), MAX_GROUPS)
    (k,) = compile_grouped_variants([("contiguous", cfg, ScaledEpilogue("block", True))], groups=MAX_GROUPS)
    assert k.resources.spill_stores == 0 and k.dynamic_smem_bytes <= 232448


def test_plans():
    block = ScaledEpilogue("block", True)
    decode = make_grouped_plan("masked", block, 256, 16, 4096, 7168, 4, 132)
    assert (decode.config.bm, decode.config.bn, decode.config.consumers) == (64, 128, 1)
    assert decode.config.stages >= 8 and decode.grid == 132 and decode.a_box == (1, 64, 128)
    prefill = make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 132)
    cfg = prefill.config  # 128 x 192, the TMA store, 2-block clusters (A's halves multicast)
    assert (cfg.bm, cfg.bn, cfg.consumers, cfg.tma_store, cfg.cluster_n) == (128, 192, 2, True, 2)
    assert prefill.k_tiles == 56 and prefill.a_box == (64, 128) and prefill.b_box == (1, 192, 128)
    assert prefill.smem_bytes <= 232448
    small = make_grouped_plan("contiguous", block, 2, 100, 256, 256, 50, 132)
    # 64-row tiles: the bound on tile rows (ceil(100 / 64), and a group adds at most one) x the tile columns
    assert small.config.bm == 64 and small.grid == (2 + 2) * 2
    assert fits(ScaledConfig(128, 256, 4, 2), 8, ScaledEpilogue("row", False)) is None  # fast row-wise: any width
    assert fits(ScaledConfig(64, 96, 4, 1), 8, block) is None  # three 32-column runs, each in one weight block
    assert "9 runs" in fits(ScaledConfig(64, 144, 4, 1), 8, block)
    assert "K splits" in fits(ScaledConfig(128, 128, 4, 2, split_k=2), 8, block)
    assert fits(ScaledConfig(128, 128, 7, 2), 1, block) is None  # the table of 1024 groups takes a stage away
    assert "shared memory" in fits(ScaledConfig(128, 128, 7, 2), MAX_GROUPS, block)
    with pytest.raises(ValueError, match="config: issue_ahead"):
        make_grouped_plan("contiguous", ScaledEpilogue("row", False), 8, 4096, 4096, 4096, 512, 132,
                          ScaledConfig(128, 128, 6, 2, issue_ahead=True))
    with pytest.raises(ValueError, match="bias"):
        make_grouped_plan("contiguous", ScaledEpilogue("row", True, bias=True), 8, 4096, 4096, 4096, 512, 132)
    text = scaled.describe_grouped("masked", 256, 16, 4096, 7168, rows_per_group=4)
    assert text.startswith("scaled-grouped-masked-block-promoted: 64x128 tile on 1 consumer")


def meta_operands(t=512, e=4, k=256, n=384, scaling="block", masked=False):
    """Operands of the right kinds on the meta device (no data): the host checks read shapes and strides only."""
    a = torch.empty((e, t, k) if masked else (t, k), dtype=E4M3, device="meta")
    b = torch.empty(e, n, k, dtype=E4M3, device="meta").transpose(-2, -1)
    rows = (e, t) if masked else (t,)
    if scaling == "block":
        sa = torch.empty(rows + (k // 128,), device="meta")
        sb = torch.empty(e, k // 128, -(-n // 128), device="meta")
    else:
        sa, sb = torch.empty(rows, device="meta"), torch.empty(e, n, device="meta")
    offs = torch.empty(e, dtype=torch.int32, device="meta")
    return a, b, sa, sb, offs


def test_checks_accept_both_layouts_and_recipes():
    for masked in (False, True):
        for scaling in ("block", "row"):
            a, b, sa, sb, offs = meta_operands(scaling=scaling, masked=masked)
            recipe, shape, groups = scaled.check_grouped(a, b, sa, sb, offs, masked=masked)
            assert (recipe, groups) == (scaling, 4) and shape == ((4, 512, 384) if masked else (512, 384))


def _bad(**change):
    a, b, sa, sb, offs = meta_operands()
    args = dict(a=a, b=b, scale_a=sa, scale_b=sb, offs=offs)
    args.update(change)
    return args


BAD = [
    (dict(a=torch.empty(512, 256, dtype=torch.bfloat16, device="meta")), TypeError, "^a: dtype torch.bfloat16"),
    (dict(b=torch.empty(4, 256, 384, dtype=E4M3, device="meta")), ValueError, "^b: expected column-major"),
    (dict(b=torch.empty(4, 384, 256, dtype=E4M3, device="meta").mT[:, :128]), ValueError, "^b: shape .* do not multiply"),
    (dict(a=torch.empty(512, 200, dtype=E4M3, device="meta"),
          b=torch.empty(4, 384, 200, dtype=E4M3, device="meta").mT), ValueError, "^b: K=200 and N=384 must be multiples of 16"),
    (dict(offs=torch.empty(4, dtype=torch.int64, device="meta")), TypeError, "^offs: expected a 1-D int32"),
    (dict(offs=torch.empty(3, dtype=torch.int32, device="meta")), ValueError, "^offs: 3 groups, b has 4 experts"),
    (dict(scale_a=torch.empty(512, 3, device="meta")), ValueError, r"^scale_a: shape \(512, 3\) matches no scaling"),
    (dict(scale_b=torch.empty(4, 3, 2, device="meta")), ValueError, r"^scale_b: shape \(4, 3, 2\) does not match"),
    (dict(scale_b=torch.empty(4, 384, device="meta")), ValueError, "^scale_b: .* block-wise"),
    (dict(scale_a=torch.empty(512, 2, dtype=torch.float16, device="meta")), TypeError, "^scale_a: dtype"),
    (dict(offs=None), TypeError, "^offs: expected a torch.Tensor"),
]


def assert_names_the_argument(args: dict, kind: type, match: str) -> None:
    """``check_grouped`` of ``args`` raises ``kind`` matching ``match``, and the op the same error naming itself."""
    with pytest.raises(kind, match=match):
        scaled.check_grouped(**args)
    with pytest.raises(kind, match="^nvfly.ops.scaled.scaled_grouped_mm: " + match.lstrip("^")):
        scaled.scaled_grouped_mm(args["a"], args["b"], args["scale_a"], args["scale_b"], args["offs"])


@pytest.mark.parametrize("change,kind,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(change, kind, match):
    assert_names_the_argument(_bad(**change), kind, match)


def test_k_not_a_multiple_of_128_with_block_scales():
    a = torch.empty(64, 320, dtype=E4M3, device="meta")
    b = torch.empty(2, 256, 320, dtype=E4M3, device="meta").mT
    sa, sb = torch.empty(64, 3, device="meta"), torch.empty(2, 3, 2, device="meta")
    with pytest.raises(ValueError, match="^a: K=320 is not a multiple of 128"):
        scaled.check_grouped(a, b, sa, sb, torch.empty(2, dtype=torch.int32, device="meta"))
    # row-wise scales take any K of 16s
    assert scaled.check_grouped(a, b, torch.empty(64, device="meta"), torch.empty(2, 256, device="meta"),
                                torch.empty(2, dtype=torch.int32, device="meta"))[0] == "row"


def test_masked_checks_and_eligibility_on_cpu():
    a, b, sa, sb, counts = meta_operands(masked=True)
    with pytest.raises(ValueError, match="^a: the masked layout takes a 3-D a"):
        scaled.check_grouped(a[0], b, sa, sb, counts, masked=True)
    with pytest.raises(ValueError, match="^b: 5 experts, a has 4 groups"):
        scaled.check_grouped(a, torch.empty(5, 384, 256, dtype=E4M3, device="meta").mT, sa, sb, counts, masked=True)
    with pytest.raises(ValueError, match="^counts: 3 groups, b has 4 experts"):
        scaled.check_grouped(a, b, sa, sb, counts[:3], masked=True)
    assert "not CUDA" in scaled.grouped_eligibility(a, b, sa, sb, counts, masked=True)
    assert "out: expected shape" in scaled.grouped_eligibility(a, b, sa, sb, counts, torch.bfloat16,
                                                               torch.empty(4, 512, 385, device="meta"), True)


def cpu_operands(sizes, n=256, k=384, scaling="block", seed=0):
    """Quantised CPU operands of groups of ``sizes`` tokens (contiguous) and their offsets."""
    g = torch.Generator().manual_seed(seed)
    t, e = sum(sizes), len(sizes)
    x = torch.randn(t, k, generator=g)
    w = torch.randn(e, n, k, generator=g)
    a, sa = quantize(x, "1x128" if scaling == "block" else "row")
    b, sb = quantize_experts(w, "128x128" if scaling == "block" else "row")
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    return a, b, (sa if scaling == "block" else sa.reshape(-1)), sb, offs


@pytest.mark.parametrize("scaling", ["block", "row"])
def test_reference_is_the_dense_scaled_gemm_group_by_group(scaling):
    sizes = [5, 0, 130, 1]
    a, b, sa, sb, offs = cpu_operands(sizes, scaling=scaling)
    assert b.stride(-2) == 1 and b.shape == (4, 384, 256)  # column-major [E, K, N]
    ref = scaled.grouped_reference(a, b, sa, sb, offs)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        if scaling == "block":
            dense = scaled.reference(a[rows], b[g], sa[rows], sb[g])
        else:
            dense = scaled.reference(a[rows], b[g], sa[rows].reshape(-1, 1), sb[g].reshape(1, -1))
        torch.testing.assert_close(ref[rows], dense)
        start += size
    # the masked layout: the same rows, NaN past each count
    a3 = torch.zeros(4, 130, 384, dtype=E4M3)
    sa3 = torch.ones((4, 130) + ((3,) if scaling == "block" else ()))
    start = 0
    for g, size in enumerate(sizes):
        a3[g, :size], sa3[g, :size] = a[start:start + size], sa[start:start + size]
        start += size
    counts = torch.tensor(sizes, dtype=torch.int32)
    masked = scaled.grouped_reference(a3, b, sa3, sb, counts, masked=True)
    start = 0
    for g, size in enumerate(sizes):
        torch.testing.assert_close(masked[g, :size], ref[start:start + size])
        assert masked[g, size:].isnan().all()
        start += size


def test_quantize_experts_matches_quantize():
    w = torch.randn(3, 256, 384)
    b, sb = quantize_experts(w)
    q, s = quantize(w[1], "128x128", operand="b")
    assert torch.equal(b[1].view(torch.uint8), q.view(torch.uint8)) and torch.equal(sb[1], s)
    b, sb = quantize_experts(w, "row")
    assert sb.shape == (3, 256) and b.shape == (3, 384, 256)
    with pytest.raises(ValueError, match="^granularity"):
        quantize_experts(w, "1x128")


def test_routes_decide_as_documented(monkeypatch):
    """torch's row-wise 2-D x 3-D and 3-D x 3-D calls go to nvfly (the device checks taken as passed: they need a
    GPU), the rest stays on torch with a reason."""
    from nvfly.torch import scaled_grouped_ops as routes
    a, b, sa, sb, offs = cpu_operands([3, 0, 29, 16], scaling="row")
    assert "not CUDA" in routes.grouped_eligibility(a, b, sa, sb, offs)
    monkeypatch.setattr(scaled, "grouped_eligibility", lambda *args, **kwargs: None)
    assert routes.grouped_eligibility(a, b, sa, sb, offs) is None
    assert routes.grouped_eligibility(a, b, sa, sb, offs, None, None, torch.bfloat16, True) is None
    assert "bias" in routes.grouped_eligibility(a, b, sa, sb, offs, torch.zeros(256))
    assert "scale_result" in routes.grouped_eligibility(a, b, sa, sb, offs, None, sa[:1])
    assert "out_dtype torch.float16" in routes.grouped_eligibility(a, b, sa, sb, offs, out_dtype=torch.float16)
    assert "2-D x 3-D" in routes.grouped_eligibility(a, b, sa, sb, None)
    assert "2-D x 3-D" in routes.grouped_eligibility(a, b[0], sa, sb, offs)
    a3 = torch.zeros(4, 32, 384, dtype=E4M3)
    assert routes.grouped_eligibility(a3, b, torch.ones(4, 32), sb) is None  # 3-D x 3-D: masked, full counts
    ab, bb, sab, sbb, offs_b = cpu_operands([3, 0, 29, 16], scaling="block")
    assert routes.grouped_eligibility(ab, bb, sab, sbb, offs_b).startswith("block scales: torch's grouped")
    if hasattr(torch.ops.aten, "_scaled_grouped_mm_v2"):
        assert routes.grouped_v2_eligibility(a, b, [sa], [1], [], [sb], [1], [], offs) is None
        assert "recipes 4/5" in routes.grouped_v2_eligibility(a, b, [sa], [4], [], [sb], [5], [], offs)
        assert "swizzled" in routes.grouped_v2_eligibility(a, b, [sa], [1], [1], [sb], [1], [], offs)
    registered = {route.op for route in __import__("nvfly.torch.routing", fromlist=["routes"]).routes()}
    assert "aten::_scaled_grouped_mm" in registered


def test_explain_describes_grouped_fp8(capsys):
    from nvfly.cli import main
    assert main(["explain", "32768", "4096", "7168", "--groups", "256", "--scaled", "block"]) == 0
    out = capsys.readouterr().out
    assert "scaled-grouped-contiguous-block-promoted-staged: 128x192 tile on 2 consumers" in out and "block scales" in out
    assert "TMA-store epilogue, 2-block clusters along N" in out
    assert main(["explain", "16", "4096", "7168", "--groups", "256", "--scaled", "row", "--layout", "masked"]) == 0
    assert "64x128 tile on 1 consumer" in capsys.readouterr().out


def test_benchmark_block_variants_plan():
    """benchmarks.grouped --fp8's FP8_BLOCK_VARIANTS plan on DeepSeek-V3's gate/up (256 experts, contiguous), the
    staged ones staged (boxes of bm + 4 rows)."""
    from benchmarks.grouped import FP8_BLOCK_VARIANTS
    block = ScaledEpilogue("block", True)
    assert any(fields.get("staged_scales") for fields in FP8_BLOCK_VARIANTS.values())
    for name, fields in FP8_BLOCK_VARIANTS.items():
        cfg = deepest(ScaledConfig(stages=2, **fields), 256)
        plan = make_grouped_plan("contiguous", block, 256, 32768, 4096, 7168, 128, 132, cfg)
        assert plan.config.staged_scales == fields.get("staged_scales", False), name
        assert plan.scale_rows == cfg.bm + SCALE_ALIGN and plan.smem_bytes <= SMEM_LIMIT and cfg.stages >= 3, name


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_skip_empty_halves(layout):
    """skip_empty: a consumer with no rows left in its group only waits for and releases the stages (one more wait
    on the full barriers and arrive on the empty ones, on both blocks of a cluster), in the default tile and in
    the 128 x 128 fallback; without it the kernel is as before; the dense scaled GEMM refuses it."""
    block = ScaledEpilogue("block", True)
    for cfg in (ScaledConfig(128, 192, 4, 2, staged_scales=True, tma_store=True, cluster_n=2),
                ScaledConfig(128, 128, 6, 2, issue_ahead=True)):
        skipping, plain = compile_grouped_variants([(layout, replace(cfg, skip_empty=True), block), (layout, cfg, block)])
        check_kernel(skipping, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
        assert skipping.count("SYNCS.PHASECHK") > plain.count("SYNCS.PHASECHK")  # the skipping loop's full waits
        arrive = "SYNCS.ARRIVE.TRANS64.RED.A1T0" if cfg.cluster_n > 1 else "SYNCS.ARRIVE.TRANS64.A1T0"
        assert skipping.count(arrive) > plain.count(arrive)
        assert skipping.count("QGMMA") == plain.count("QGMMA")
    with pytest.raises(ValueError, match="^config: skip_empty: only the grouped"):
        make_plan(4096, 4096, 4096, block, ScaledConfig(128, 128, 6, 2, skip_empty=True), None, 132)
