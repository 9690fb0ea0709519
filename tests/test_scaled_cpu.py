"""The FP8 scaled GEMM without a GPU: every kernel variant compiles to fp8 wgmma (QGMMA) and TMA code without
spills, the plans follow the heuristic, the recipes are read off the scales' shapes, bad arguments raise errors
naming them, and the torch references (quantisation, dequantised GEMM, MX decoding) are what they claim."""
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfly
from nvfly.ops import scaled
from nvfly.ops.common import scheduler
from nvfly.ops.scaled import ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled.api import compile_variants, kernel_scales
from nvfly.ops.scaled.config import deepest
from nvfly.ops.scaled.plan import SPLIT_FIX_UP, SWAP_MAX_M, make_plan
from nvfly.ops.scaled.quantize import quantize
from tests.test_grouped_cpu import check_kernel
from tests.test_scheduler_cpu import device_work

VARIANTS = [
    (ScaledConfig(128, 128, 6, 2), ScaledEpilogue("block", True)),
    (ScaledConfig(64, 32, 8, 1), ScaledEpilogue("block", True, bias=True)),
    (ScaledConfig(128, 64, 8, 1), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 256, 4, 2), ScaledEpilogue("tensor", False)),
    (ScaledConfig(128, 256, 4, 2), ScaledEpilogue("row", False, bias=True)),
    (ScaledConfig(128, 128, 6, 2), ScaledEpilogue("row", True, bias=True)),
    (ScaledConfig(128, 128, 6, 2), ScaledEpilogue("tensor", True)),
    (ScaledConfig(128, 192, 5, 2), ScaledEpilogue("tensor", True)),  # the wide promoted tile's f32 (register) plan
    (ScaledConfig(64, 16, 8, 1), ScaledEpilogue("row", False, bias=True, bias_rows=True)),
    (ScaledConfig(128, 64, 8, 2), ScaledEpilogue("tensor", True, bias=True, bias_rows=True)),
    (ScaledConfig(64, 16, 12, 1, split_k=8), ScaledEpilogue("row", True, bias=True, bias_rows=True, partial=True)),
    (ScaledConfig(64, 32, 12, 1, split_k=4), ScaledEpilogue("block", True, partial=True)),
    (ScaledConfig(128, 128, 6, 2), ScaledEpilogue("block1x128", True, bias=True)),
    (ScaledConfig(64, 64, 12, 1, split_k=2), ScaledEpilogue("block1x128", True, partial=True)),
    (ScaledConfig(128, 128, 6, 2, issue_ahead=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 128, 6, 2, issue_ahead=True), ScaledEpilogue("row", True, bias=True)),
    (ScaledConfig(64, 64, 12, 1, split_k=2, issue_ahead=True), ScaledEpilogue("tensor", True, partial=True)),
    (ScaledConfig(128, 128, 6, 2), ScaledEpilogue("mxfp8", True, bias=True)),
    (ScaledConfig(64, 32, 8, 1), ScaledEpilogue("mxfp8", True)),
    (ScaledConfig(64, 64, 12, 1, split_k=2), ScaledEpilogue("mxfp8", True, partial=True)),
    (ScaledConfig(128, 128, 5, 2, packed_b=True), ScaledEpilogue("mxfp4", True, bias=True)),
    (ScaledConfig(64, 32, 8, 1, split_k=2, packed_b=True), ScaledEpilogue("mxfp4", True, partial=True)),
    # block scales over several 128-wide weight blocks (runs of gcd(bn, 128) columns)
    (ScaledConfig(128, 192, 5, 2), ScaledEpilogue("block", True, bias=True)),
    (ScaledConfig(64, 96, 8, 1, split_k=2), ScaledEpilogue("block", True, partial=True)),
    (ScaledConfig(64, 32, 8, 1, split_k=2, staged_scales=True), ScaledEpilogue("block", True, partial=True)),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0].bm}x{v[0].bn}-{v[1].scaling}"
                         f"{'-promoted' if v[1].promote else ''}{'-bias' if v[1].bias else ''}"
                         f"{'-rows' if v[1].bias_rows else ''}{'-splitK' if v[1].partial else ''}"
                         f"{'-ahead' if v[0].issue_ahead else ''}")
def test_variants_compile_to_fp8_wgmma_without_spills(variant):
    cfg, epi = variant
    (k,) = compile_variants([variant], out_dtype=torch.bfloat16 if epi.scaling != "tensor" else torch.float32)
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    assert k.dynamic_smem_bytes == cfg.smem_bytes()
    assert k.cluster is None and "MULTICAST" not in k.sass()  # no cluster: every block loads its whole A tile
    # issuing ahead: the next k-block's wgmmas stay in flight while the previous one is promoted
    assert not epi.promote or ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in k.sass()) == cfg.issue_ahead
    if epi.scaling in ("mxfp8", "mxfp4"):  # a loop over the stage's four k-steps, each one wgmma per atom, promoted
        assert k.count("QGMMA") == cfg.wg_m // 64 and "LDG.E.U8" in k.sass()
    if epi.scaling == "mxfp4":  # the packed tile: 16-byte shared loads, converted, two 16-byte stores, a barrier
        assert k.count("LDS.128") >= 1 and k.count("STS.128") >= 2 and k.count("BAR.SYNC") == 2


# the TMA-store epilogue (the heuristic's 128-row tiles): scaled in registers, staged with stmatrix, stored by TMA
TMA_STORE_VARIANTS = [
    (ScaledConfig(128, 256, 4, 2, tma_store=True), ScaledEpilogue("row", False, bias=True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True), ScaledEpilogue("row", True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 64, 8, 2, tma_store=True), ScaledEpilogue("tensor", True, bias=True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True, issue_ahead=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True), ScaledEpilogue("block1x128", True, bias=True)),
    (ScaledConfig(128, 192, 5, 2, tma_store=True), ScaledEpilogue("row", True, bias=True)),
    (ScaledConfig(128, 192, 5, 2, tma_store=True), ScaledEpilogue("tensor", True)),
    (ScaledConfig(128, 192, 5, 2, tma_store=True), ScaledEpilogue("row", False, bias=True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True), ScaledEpilogue("mxfp8", True, bias=True)),
    (ScaledConfig(128, 128, 5, 2, packed_b=True, tma_store=True), ScaledEpilogue("mxfp4", True)),
    (ScaledConfig(128, 192, 5, 2, tma_store=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 160, 6, 2, tma_store=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 112, 7, 2, tma_store=True, issue_ahead=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True, issue_ahead=True, staged_scales=True), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 192, 5, 2, tma_store=True, staged_scales=True), ScaledEpilogue("block", True)),
]


@pytest.mark.parametrize("variant", TMA_STORE_VARIANTS, ids=lambda v: f"{v[0].bm}x{v[0].bn}-{v[1].scaling}"
                         f"{'-promoted' if v[1].promote else ''}{'-bias' if v[1].bias else ''}"
                         f"{'-ahead' if v[0].issue_ahead else ''}")
def test_tma_store_variants_compile_to_stmatrix_and_tma_stores(variant):
    """fp8 wgmma, no spills; the epilogue is the staged one only: a TMA store per column slice of the consumer's
    tile (UTMASTG), stmatrix.x4 per 16 columns of each 64-row atom (STSM), no register stores (STG)."""
    cfg, epi = variant
    (k,) = compile_variants([variant], out_dtype=torch.bfloat16 if epi.scaling != "tensor" else torch.float16)
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    assert k.dynamic_smem_bytes == cfg.smem_bytes() == cfg.ring_end + cfg.bm * cfg.store_width * 2
    assert k.count("UTMASTG") == cfg.bn // cfg.store_width
    assert k.count("STSM") == (cfg.wg_m // 64) * cfg.bn // 16
    assert k.count("STG") == 0
    assert not epi.promote or ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in k.sass()) == cfg.issue_ahead


@pytest.mark.parametrize("cfg", [ScaledConfig(128, 128, 6, 2, tma_store=True),
                                 ScaledConfig(128, 128, 6, 2, tma_store=True, issue_ahead=True),
                                 ScaledConfig(128, 192, 5, 2, tma_store=True),
                                 ScaledConfig(128, 112, 7, 2, tma_store=True, issue_ahead=True)],
                         ids=lambda c: f"{c.bn}{'-ahead' if c.issue_ahead else ''}")
def test_block_promotion_is_one_ffma_an_element(cfg):
    """Block scales promote with one FFMA per accumulator element (sum = fma(partial, sa * sb, sum)) and no FADD
    (bf16 output, no bias): the product's FMULs once per row and column run (``weight_runs``) and promotion, not
    per element. Issuing ahead unrolls the k-block pairs and both endings: several promotions."""
    from nvfly.ops.scaled.config import weight_runs
    (k,) = compile_variants([(cfg, ScaledEpilogue("block", True))])
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    per_promotion = cfg.wg_m // 64 * cfg.bn // 2
    promotions, rest = divmod(k.count("FFMA"), per_promotion)
    assert promotions >= (5 if cfg.issue_ahead else 1) and rest == 0 and k.count("FADD") == 0
    assert 0 < k.count("FMUL") <= promotions * 2 * (cfg.wg_m // 64) * weight_runs(cfg.bn)


@pytest.mark.parametrize("bn,atoms_m", [(128, 1), (64, 2), (32, 1), (96, 1), (112, 2), (160, 1), (192, 1), (224, 1),
                                        (256, 1)])
def test_block_scale_indexing_over_weight_blocks(bn, atoms_m, monkeypatch):
    """The kernel's block promotion scales (``promotion_scales``, looked up by ``scale_index``), run on the CPU with
    Python numbers (nvfly.minimum as min) for every thread, element and tile of N = 1000 (a tail): each element in
    range gets sa of its row times sb of its own 128-wide weight block (tiles wider than a block straddle two or
    three), and no read leaves the scales (a run past n reads the last block)."""
    from nvfly.ops.scaled.config import weight_runs
    from nvfly.ops.scaled.kernel import promotion_scales, scale_index

    class Scales:  # 2-D scales whose reads are checked: a [row, kt] read gives row + 1, b's [block, kt] 1000^block
        def __init__(self, shape, value):
            self.shape, self.value = shape, value

        def __getitem__(self, index):
            assert all(0 <= i < size for i, size in zip(index, self.shape)), (index, self.shape)
            return self.value(index[0])

    monkeypatch.setattr(nvfly, "minimum", min)
    m, n, kt = 300, 1000, 3
    sa, sb = Scales((m, 8), lambda row: row + 1), Scales((math.ceil(n / 128), 8), lambda block: 1000 ** block)
    runs = weight_runs(bn)
    for tn in range(math.ceil(n / bn)):
        for lane in range(32):
            row0, col0 = 64 + lane // 4, tn * bn + 2 * (lane % 4)
            scales = promotion_scales(sa, sb, row0, col0, kt, m, n, bn, atoms_m, ScaledEpilogue("block", True))
            assert len(scales) == 2 * atoms_m * runs
            for i in range(atoms_m):
                for e in range(bn // 2):
                    row, col = row0 + 64 * i + 8 * ((e // 2) % 2), col0 + 8 * (e // 4) + e % 2
                    if col < n:
                        assert scales[scale_index(i, e, runs, bn)] == (row + 1) * 1000 ** (col // 128), (tn, lane, e)


@pytest.mark.parametrize("cfg", [ScaledConfig(128, 128, 6, 2, tma_store=True, issue_ahead=True),
                                 ScaledConfig(128, 192, 5, 2, tma_store=True)], ids=lambda c: f"{c.bn}")
def test_staged_scales_come_from_shared_memory(cfg):
    """ScaledConfig.staged_scales: each stage also holds the tile rows' 1x128 activation scales (a 1024-byte slot
    behind the operands; TMA brings 4 bm bytes), the producer loads three boxes a k-block (A, B, the scales), and the
    consumers read sa with shared loads: fewer global loads than the same kernel reading sa from global."""
    staged = replace(cfg, staged_scales=True)
    assert staged.stage_bytes == cfg.stage_bytes + 1024 and staged.load_bytes == cfg.load_bytes + 4 * cfg.bm
    assert staged.stage_bytes % 1024 == 0 and staged.scales_offset == cfg.stage_bytes
    epi = ScaledEpilogue("block", True)
    plain, mine = compile_variants([(cfg, epi), (staged, epi)])
    check_kernel(mine, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    assert mine.count("LDS") >= 2 and plain.count("LDS") == 0
    assert mine.count("LDG") <= plain.count("LDG") - 2
    assert mine.count("UTMALDG") % 3 == 0 and plain.count("UTMALDG") % 2 == 0


def test_staged_scales_plans_and_fallback():
    """Only block scales stage (unswapped); scale_a TMA cannot load (not M-contiguous, a column not at 16 bytes) is
    read from global instead (``staged_scales_reason``; the grouped kernel's: tests/test_scaled_grouped_cpu.py)."""
    from nvfly.ops.scaled.api import staged_scales_reason
    staged = ScaledConfig(128, 128, 6, 2, staged_scales=True)
    assert make_plan(4096, 4096, 4096, ScaledEpilogue("block", True), staged, None, 132).config.staged_scales
    with pytest.raises(ValueError, match="^config: staged_scales: .* not row"):
        make_plan(4096, 4096, 4096, ScaledEpilogue("row", True), staged, None, 132)
    with pytest.raises(ValueError, match="^config: staged_scales: .* not block1x128"):
        make_plan(4096, 4096, 4096, ScaledEpilogue("block1x128", True), staged, None, 132)
    assert staged_scales_reason(torch.ones(32, 256).t(), 128) is None  # (M, K/128) = (256, 32), strides (1, 256)
    assert "contiguous" in staged_scales_reason(torch.ones(256, 32), 128)  # strides (32, 1)
    assert "16 bytes" in staged_scales_reason(torch.ones(32, 258).t(), 128)  # M = 258: columns 1032 bytes apart


def test_tma_store_config_and_plans():
    """The config's staging (behind the ring, counted by deepest), its checks, and where the plan keeps it: the
    heuristic's 128-row tiles with 16-bit outputs; f32 outputs, swapped and split-K plans store through registers."""
    cfg = ScaledConfig(128, 128, 6, 2, tma_store=True)
    assert cfg.staging_bytes() == 128 * 64 * 2 and cfg.smem_bytes() == cfg.ring_end + 16384
    assert deepest(ScaledConfig(128, 128, 2, 2, tma_store=True)).stages == 6  # 7 without staging
    assert deepest(ScaledConfig(128, 128, 2, 2)).stages == 7
    assert deepest(ScaledConfig(128, 256, 2, 2, tma_store=True)).stages == 4
    assert "multiple of 16" in ScaledConfig(128, 120, 4, 2, tma_store=True).check()
    assert "split-K" in ScaledConfig(128, 128, 4, 2, split_k=2, tma_store=True).check()
    for scaling, promote in (("tensor", False), ("row", True), ("block", True), ("block1x128", True)):
        epi = ScaledEpilogue(scaling, promote)
        for m, n, k in ((4096, 4096, 4096), (8192, 8192, 8192), (4096, 2112, 7168), (128, 8192, 8192)):
            plan = make_plan(m, n, k, epi, None, None, 132)
            assert plan.config.tma_store and plan.store_box == ((64, plan.config.store_width),
                                                                plan.config.store_width * 2)
            assert "TMA-store epilogue" in scaled.api.describe_plan(plan)
            f32 = make_plan(m, n, k, epi, None, None, 132, out_itemsize=4)
            assert not f32.config.tma_store and f32.store_box is None
            assert f32.config.stages == deepest(replace(plan.config, tma_store=False), most=plan.config.stages).stages
    # promoted tensor/row-wise tiles widen to 192 where their waves take less time (waves x width): 4096 x 2112 in
    # 3 waves of 128 x 192 (2.7) rather than 5 of 128 x 128 (4.1); 4096^2 stays 128 wide (6 x 192 > 8 x 128)
    wide = make_plan(4096, 2112, 7168, ScaledEpilogue("row", True), None, None, 132).config
    assert (wide.bn, wide.stages, wide.check(promote=True)) == (192, 5, None)
    assert make_plan(4096, 4096, 4096, ScaledEpilogue("tensor", True), None, None, 132).config.bn == 128
    assert make_plan(4096, 2112, 7168, ScaledEpilogue("block", True), None, None, 132).config.bn == 192
    assert make_plan(4096, 2112, 7168, ScaledEpilogue("block1x128", True), None, None, 132).config.bn == 128
    # below the SMs' fill, 64 wide only in one wave: 128 x 8192 is 128 tiles of 64 columns, 128 x 10240 would be 160
    # (two waves, as long as 80 tiles of 128 columns in one)
    for recipe in ("row", "block"):
        assert make_plan(128, 8192, 8192, ScaledEpilogue(recipe, True), None, False, 132).config.bn == 64
        assert make_plan(128, 10240, 8192, ScaledEpilogue(recipe, True), None, False, 132).config.bn == 128
    swapped = make_plan(16, 4096, 7168, ScaledEpilogue("row", True), ScaledConfig(64, 16, 8, 1, tma_store=True), True,
                        132)
    assert swapped.swap and not swapped.config.tma_store
    split = make_plan(128, 8192, 8192, ScaledEpilogue("row", True), ScaledConfig(128, 128, 6, 2, split_k=2,
                                                                                  tma_store=True), None, 132)
    assert split.epilogue.partial and not split.config.tma_store
    (k,) = compile_variants([(replace(split.config, tma_store=True), split.epilogue)])  # partials: registers
    assert k.count("UTMASTG") == 0 and k.count("STSM") == 0


def test_stream_k_compiles_and_plans():
    """ScaledConfig.stream_k: the dense GEMM's fix-up (16-byte f32 reductions into the workspace, an arrival count)
    next to the TMA-store epilogue, no spills; the plan streams a partial last wave (at M = 128 the only one: 64
    tiles of 64 k-blocks as 128 ranges of 32, each tile shared by two blocks) and nothing for whole waves."""
    for cfg, epi in ((ScaledConfig(128, 128, 6, 2, tma_store=True, stream_k=True), ScaledEpilogue("row", True, True)),
                     (ScaledConfig(128, 128, 6, 2, tma_store=True, stream_k=True), ScaledEpilogue("block", True))):
        (k,) = compile_variants([(cfg, epi)])
        check_kernel(k, "QGMMA.64x128x32.F32.E4M3.E4M3")
        assert k.count("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU") > 0 and k.count("ATOMG.E.ADD.STRONG.GPU") > 0
        assert k.count("UTMASTG") == 2
    stream = ScaledConfig(128, 128, 6, 2, tma_store=True, stream_k=True)
    plan = make_plan(128, 8192, 8192, ScaledEpilogue("row", True), stream, None, 132)
    assert (plan.dp_tiles, plan.block_iters, plan.sk_tiles, plan.grid) == (0, 32, 64, 128)
    assert "stream K over 64 tiles" in scaled.api.describe_plan(plan)
    whole = make_plan(128, 128 * 132, 4096, ScaledEpilogue("row", True), stream, None, 132)  # one whole wave
    assert (whole.block_iters, whole.sk_tiles, whole.grid) == (0, 0, 132)
    assert "stream K" in ScaledConfig(128, 128, 6, 2, split_k=2, stream_k=True).check()


# small M in one launch: split K adding up in the kernel (ScaledConfig.split_fix_up) on the small-M plans' tiles,
# swapped (tensor/row, the bias along the kernel's rows) and not (block scales on a 64-row token tile, issuing
# ahead), and on the M = 128 TMA-store tile; stream K over swapped tiles (the benchmark's small-M "streamk")
SINGLE_LAUNCH_VARIANTS = [
    (ScaledConfig(64, 16, 12, 1, split_k=2, split_fix_up=True), ScaledEpilogue("row", True, True, bias_rows=True)),
    (ScaledConfig(64, 40, 12, 1, split_k=4, split_fix_up=True), ScaledEpilogue("tensor", False)),
    (ScaledConfig(64, 32, 12, 1, split_k=2, issue_ahead=True, split_fix_up=True), ScaledEpilogue("block", True, True)),
    (ScaledConfig(128, 128, 6, 2, split_k=2, split_fix_up=True, tma_store=True), ScaledEpilogue("row", True)),
    (ScaledConfig(64, 8, 12, 1, stream_k=True), ScaledEpilogue("row", False, True, bias_rows=True))]


@pytest.mark.parametrize("variant", SINGLE_LAUNCH_VARIANTS,
                         ids=lambda v: f"{v[0].bm}x{v[0].bn}-{v[1].scaling}" + ("-streamK" if v[0].stream_k else ""))
def test_single_launch_small_m_compiles(variant):
    """One launch: the splits' (or k ranges') 16-byte f32 reductions into the workspace and the arrival count next
    to fp8 wgmma, no spills; the TMA-store epilogue stays after the fix-up."""
    cfg, epi = variant
    (k,) = compile_variants([variant])
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    vectors = (cfg.wg_m // 64) * cfg.bn // 8  # each thread's 16-byte vectors of a consumer tile
    assert k.count("REDG.E.ADD.F32x4.FTZ.RN.STRONG.GPU") == vectors and k.count("ATOMG.E.ADD.STRONG.GPU") == 1
    assert k.count("UTMASTG") == (cfg.bn // cfg.store_width if cfg.tma_store else 0)


def test_split_fix_up_plans():
    """split_fix_up plans one launch (no partials, no reduce kernel, a workspace slot per output tile and
    consumer), drops itself where K leaves one split, keeps a TMA-store epilogue, and excludes stream K."""
    row = ScaledEpilogue("row", True, bias=True)
    plan = make_plan(16, 4096, 7168, row, ScaledConfig(64, 16, 12, 1, split_k=2, split_fix_up=True), True, 132)
    assert plan.swap and plan.epilogue.bias_rows and not plan.epilogue.partial and plan.grid == 128
    assert plan.fix_up_tiles == plan.shared_tiles == 64 and plan.sk_tiles == 0
    assert scaled.api.describe_plan(plan).startswith("scaled-row-promoted-swapAB-splitK2-fixup: 64x16 tile")
    two = make_plan(16, 4096, 7168, row, ScaledConfig(64, 16, 12, 1, split_k=2), True, 132)
    assert two.epilogue.partial and two.fix_up_tiles == two.shared_tiles == 0 and two.grid == plan.grid
    short = make_plan(16, 4096, 128, row, ScaledConfig(64, 16, 12, 1, split_k=2, split_fix_up=True), True, 132)
    assert (short.config.split_k, short.config.split_fix_up, short.fix_up_tiles) == (1, False, 0)
    block = make_plan(16, 4096, 7168, ScaledEpilogue("block", True),
                      ScaledConfig(64, 32, 12, 1, split_k=3, split_fix_up=True), None, 132)
    assert not block.swap and not block.epilogue.partial and block.fix_up_tiles == 128
    staged = make_plan(128, 8192, 8192, row, ScaledConfig(128, 128, 6, 2, split_k=2, split_fix_up=True,
                                                          tma_store=True), None, 132)
    assert staged.config.tma_store and staged.fix_up_tiles == 64 and not staged.epilogue.partial
    assert "split_fix_up" in ScaledConfig(128, 128, 6, 2, stream_k=True, split_fix_up=True).check()
    assert (make_plan(1, 2048, 7168, ScaledEpilogue("tensor"), None, None, 132).config.split_fix_up
            == SPLIT_FIX_UP)  # the heuristic's choice: one named switch


class _Memory:
    """Global memory for ``fix_up`` run on Python numbers: addresses are indices."""

    def __init__(self, size):
        self.values = [0.0] * size

    def address(self, index):
        return index

    def __setitem__(self, index, value):
        self.values[index] = value


def _fix_up_on_python_numbers(monkeypatch, memory, counters):
    """``nvfly.ops.common.epilogue.fix_up`` itself, its GPU-scope operations on ``memory`` and ``counters``."""
    import numpy as np

    from nvfly.ops.common import epilogue

    def red_add(address, values):
        for e, v in enumerate(values):
            memory.values[address + e] += v

    def arrive(address):
        before = counters.values[address]
        counters.values[address] = before + 1
        return before

    def store_zeros(address):
        memory.values[address:address + 4] = [0.0] * 4
    monkeypatch.setattr(epilogue, "red_add", red_add)
    monkeypatch.setattr(epilogue, "arrive", arrive)
    monkeypatch.setattr(epilogue, "load_relaxed", lambda address, dtype, n: memory.values[address:address + n])
    monkeypatch.setattr(epilogue, "store_zeros_x4", store_zeros)
    monkeypatch.setattr(nvfly, "static_range", range)
    monkeypatch.setattr(nvfly, "threadfence", lambda: None)
    monkeypatch.setattr(nvfly, "named_barrier", lambda *args: None)
    return lambda partial, *args: epilogue.fix_up.fn(args[0], np.bool_(partial), memory, counters, *args[1:])


@settings(max_examples=15, deadline=None)
@given(n=st.sampled_from([16, 48, 400]), k=st.sampled_from([512, 1920, 7168]), split=st.integers(2, 6),
       consumers=st.sampled_from([1, 2]), data=st.data())
def test_split_fix_up_sums_each_tile_once_and_leaves_zeros(n, k, split, consumers, data):
    """The fix-up on a split-K plan's own schedule (the device mapping on Python ints), its units finishing in any
    order, twice (a CUDA graph replayed): each tile's consumer sums come out exactly once, as the sum of all its
    splits, from the split counted in last, and the workspace and counts are zero after every launch."""
    bm = 64 * consumers
    plan = make_plan(16, n, k, ScaledEpilogue("row", True),
                     ScaledConfig(bm, 16, 4, consumers, split_k=split, split_fix_up=True), True, 132)
    schedule = scheduler.grid_schedule(plan.m, plan.n, plan.k_tiles, bm, 16, sms=132, split_k=plan.config.split_k,
                                       split_fix_up=plan.config.split_fix_up)
    assert schedule.grid == plan.grid and schedule.output_tiles == plan.fix_up_tiles
    units = [u for block in device_work(schedule).values() for u in block]
    atoms, bn = bm // consumers // 64, 16
    memory = _Memory(plan.shared_tiles * consumers * 64 * atoms * bn)
    counters = _Memory(plan.shared_tiles * consumers)
    with pytest.MonkeyPatch.context() as patch:
        fix_up = _fix_up_on_python_numbers(patch, memory, counters)
        for launch in range(2):
            order = data.draw(st.permutations(range(len(units))), label=f"launch {launch}'s finishing order")
            done = {}
            expected = {}
            for position in order:
                u = units[position]
                for consumer in range(consumers):
                    arrivals = [None] * consumers  # the block's shared memory
                    for thread in range(128):
                        accs = [[float(hash((launch, u.split, u.slot, consumer, thread, i, e)) % 1024)
                                 for e in range(bn // 2)] for i in range(atoms)]
                        key = (u.slot, consumer, thread)
                        expected[key] = [[x + y for x, y in zip(a, b)] for a, b in
                                         zip(expected.get(key, [[0.0] * (bn // 2)] * atoms), accs)]
                        values, finished = fix_up(u.contributors > 1, accs, u.slot * consumers + consumer,
                                                  arrivals, consumer, thread // 32, thread % 32, u.contributors,
                                                  atoms, bn)
                        if finished:
                            assert key not in done, f"tile {u.slot} consumer {consumer} stored twice"
                            done[key] = values
            assert done == expected and len(done) == plan.shared_tiles * consumers * 128
            assert not any(memory.values) and not any(counters.values), "the next launch needs zeros"


def test_benchmark_times_the_small_m_reductions(monkeypatch):
    """benchmarks.scaled times the small-M plans' other K reduction beside them (--quick's 16 x 4096 x 7168 and
    64 x 7168 x 2048 rows): one launch against two where the plan splits K, stream K over the same swapped tiles."""
    from benchmarks import scaled as bench
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"multi_processor_count": 132}))
    other = "reduce" if SPLIT_FIX_UP else "fixup"  # the K reduction the heuristic does not pick
    for recipe in ("tensor", "row", "row-fast"):
        alternatives = bench.alternative_configs(16, 4096, 7168, recipe, False)
        assert set(alternatives) == {other, "streamk"} and all(swap for _, swap in alternatives.values()), recipe
        assert (alternatives[other][0].split_k, alternatives[other][0].split_fix_up) == (2, not SPLIT_FIX_UP)
        assert set(bench.alternative_configs(64, 7168, 2048, recipe, False)) == {"streamk"}  # 112 tiles: no split
    assert set(bench.alternative_configs(64, 2112, 7168, "block", False)) == {other, "streamk"}  # split in two


def test_wide_block_tiles_plan_in_order():
    """Block scales are among WIDE_PROMOTED: the heuristic widens block tiles to 192 where its waves take less time
    (weighted by WIDE_BLOCK_RATE), in order (three 64 x 192 accumulators do not fit) with the producer staging the
    activation scales; elsewhere 128 x 128 issues ahead, staged too."""
    block = ScaledEpilogue("block", True)
    wide = make_plan(4096, 2112, 7168, block, None, None, 132).config  # 3 waves x 192 against 5 x 128
    assert (wide.bn, wide.issue_ahead, wide.tma_store, wide.staged_scales) == (192, False, True, True)
    assert wide.check(promote=True) is None
    narrow = make_plan(4096, 7168, 7168, block, None, None, 132).config  # 10 waves x 192 against 14 x 128
    assert (narrow.bn, narrow.issue_ahead, narrow.staged_scales) == (128, True, True)
    # 37 waves x 192 / 1.05 against 55 x 128: the wide tile's measured rate decides
    assert make_plan(16384, 7168, 2048, block, None, None, 132).config.bn == 192
    small = make_plan(16, 4096, 7168, block, None, None, 132).config  # one 64-row token tile: scales from global
    assert small.bm == 64 and not small.staged_scales


def test_benchmark_times_the_block_tiles(monkeypatch):
    """benchmarks.scaled --block-tiles times the block plan beside its in-order mainloop (where it issues ahead) and
    each BLOCK_TILES config that is not the plan's, each a config the plan takes; nothing for other recipes."""
    from benchmarks import scaled as bench
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"multi_processor_count": 132}))
    block = ScaledEpilogue("block", True)
    for m, n, k in bench.BLOCK_TILE_SHAPES:
        plan = make_plan(m, n, k, block, None, None, 132).config
        alternatives = bench.alternative_configs(m, n, k, "block", False, block_tiles=True)
        names = {name for name, fields in bench.BLOCK_TILES.items()
                 if (plan.bn, plan.issue_ahead, plan.staged_scales) !=
                 (fields["bn"], fields["issue_ahead"], fields["staged_scales"])}
        assert set(alternatives) == names | ({"in_order"} if plan.issue_ahead else set())
        for name, (cfg, swap) in alternatives.items():
            fields = bench.BLOCK_TILES.get(name, {"bn": plan.bn, "issue_ahead": False,
                                                  "staged_scales": plan.staged_scales})
            assert not swap and cfg.bm == 128 and cfg.tma_store
            assert (cfg.bn, cfg.issue_ahead, cfg.staged_scales) == (fields["bn"], fields["issue_ahead"],
                                                                    fields["staged_scales"])
            assert make_plan(m, n, k, block, cfg, False, 132).config == cfg
    assert bench.alternative_configs(4096, 7168, 2048, "row", False, block_tiles=True) == {}


def test_out_dtypes_and_e5m2_compile():
    cfg = ScaledConfig(128, 128, 6, 2)
    for out_dtype in (torch.float16, torch.float32):
        (k,) = compile_variants([(cfg, ScaledEpilogue("row", True))], out_dtype=out_dtype)
        assert k.resources.spill_stores == 0 and not k.warnings
    (k,) = compile_variants([(cfg, ScaledEpilogue("block", True))], dtypes=(nvfly.f8e5m2, nvfly.f8e4m3))
    assert any(op.startswith("QGMMA.64x128x32.F32.E5M2.E4M3") for op in k.sass_opcodes())


def test_config_checks():
    assert ScaledConfig(128, 128, 6, 2).check(promote=True) is None
    assert "registers" in ScaledConfig(128, 256, 4, 2).check(promote=True)
    assert ScaledConfig(128, 256, 4, 2).check() is None
    assert "shared memory" in ScaledConfig(128, 256, 6, 2).check()
    assert "consumer" in ScaledConfig(96, 128, 4, 2).check()
    with pytest.raises(ValueError, match="promote"):
        ScaledEpilogue("block", promote=False)
    assert ScaledConfig(128, 128, 6, 2, issue_ahead=True).check(promote=True) is None
    assert "192" in ScaledConfig(128, 256, 4, 2, issue_ahead=True).check(promote=True)
    assert "only the promoted" in ScaledConfig(128, 128, 6, 2, issue_ahead=True).check()
    with pytest.raises(ValueError, match="issue_ahead with block1x128"):
        make_plan(4096, 4096, 4096, ScaledEpilogue("block1x128", True), ScaledConfig(128, 128, 6, 2, issue_ahead=True),
                  None, 132)
    assert "-ahead" in scaled.api.describe_plan(
        make_plan(4096, 4096, 4096, ScaledEpilogue("row", True), ScaledConfig(128, 128, 6, 2, issue_ahead=True),
                  None, 132))


def operands(m, n, k, scaling, dtype=torch.float8_e4m3fn):
    ga, gb = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ("1x128", "128x128"),
              "block1x128": ("1x128", "1x128")}[scaling]
    a, sa = quantize(torch.randn(m, k), ga, dtype)
    b, sb = quantize(torch.randn(n, k), gb, dtype, operand="b")
    return a, b, sa, sb


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
def test_recipes_are_read_off_the_scales(scaling):
    a, b, sa, sb = operands(200, 336, 544, scaling)
    assert scaled.recipe(a, b, sa, sb) == scaling
    assert scaled.check(a, b, sa, sb) == scaling
    ka, kb = kernel_scales(scaling, sa, sb)
    assert ka.data_ptr() == sa.data_ptr() and kb.data_ptr() == sb.data_ptr()  # views, no copies
    if scaling == "block":
        assert tuple(ka.shape) == (200, 5) and tuple(kb.shape) == (3, 5)
        assert kb[2, 4] == sb[4, 2]
    if scaling == "block1x128":
        assert tuple(sb.shape) == (5, 336) and sb.is_contiguous() and tuple(kb.shape) == (336, 5)


def test_mx_reference_picks_ocp_scales():
    from nvfly.ops.scaled.quantize import dequantize_mx
    x = torch.randn(64, 256) * 10
    x[0, :32] = 0
    x[1, 32:64] = 0.0
    x[1, 40] = 448.0 * 2  # amax 896 = 1.75 * 2^9: scale 2^(9 - 8), values up to 448 exactly
    q, s = quantize(x, "mx")
    assert s.dtype == torch.uint8 and tuple(s.shape) == (64, 8)
    assert s[0, 0] == 0 and (q[0, :32].float() == 0).all()
    assert s[1, 1] == 127 + 1 and q[1, 40].float() == 448
    assert ((dequantize_mx(q, s) - x).norm() / x.norm()) < 0.05
    with pytest.raises(ValueError, match="^x: K=48 is not a multiple of the MX block"):
        quantize(torch.randn(4, 48), "mx")


def test_quantize_reference_round_trips_and_picks_amax_scales():
    x = torch.randn(256, 384)
    x[3, 130] = 100.0
    for granularity, shape in (("tensor", ()), ("row", (256, 1)), ("1x128", (256, 3))):
        q, s = quantize(x, granularity)
        assert tuple(s.shape) == shape and q.dtype == torch.float8_e4m3fn
        deq = scaled.dequantize(q, s, (1, 128) if granularity == "1x128" else (1, 1))
        assert ((deq - x).norm() / x.norm()) < 0.05
    _, s = quantize(x, "1x128")
    assert s.stride() == (1, 256) and s[3, 1] == torch.tensor(100.0) * (1 / 448)
    q, s = quantize(x.t().contiguous(), "128x128", operand="b")  # a (384 x 256) weight, b = (256, 384) col-major
    assert q.shape == (256, 384) and q.stride() == (1, 256)
    assert tuple(s.shape) == (2, 3) and s.stride() == (1, 2)
    assert s[1, 0] == x[128:256, 0:128].abs().amax() * (1 / 448)
    q, s = quantize(torch.zeros(4, 128), "row")
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def test_block1x128_reference_and_plan():
    a, b, sa, sb = operands(130, 256, 300, "block1x128")
    rb = b.float() * sb.repeat_interleave(128, 0)[:300]
    assert torch.allclose(scaled.reference(a, b, sa, sb), scaled.dequantize(a, sa, (1, 128)) @ rb, rtol=1e-5,
                          atol=1e-5)
    plan = make_plan(16, 4096, 7168, ScaledEpilogue("block1x128", True), None, None, 132)
    assert not plan.swap and plan.epilogue.promote and plan.config.check(promote=True) is None
    plan = make_plan(256, 4096, 7168, ScaledEpilogue("block1x128", True), ScaledConfig(128, 96, 4, 2), None, 132)
    assert plan.config.bn == 96  # no 128-column weight blocks to stay inside


def test_reference_is_the_dequantised_gemm():
    a, b, sa, sb = operands(130, 256, 300, "block")
    ra = a.float() * sa.repeat_interleave(128, 1)[:, :300]
    rb = b.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :256]
    assert torch.allclose(scaled.reference(a, b, sa, sb), ra @ rb, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_themselves():
    a, b, sa, sb = operands(128, 256, 512, "row")
    with pytest.raises(ValueError, match="^scale_b: shape \\(1, 128\\)"):
        scaled.check(a, b, sa, sb[:, :128])
    with pytest.raises(ValueError, match="^scale_b: .* is tensor-wise but scale_a is row-wise"):
        scaled.check(a, b, sa, sb[:, :1])
    with pytest.raises(TypeError, match="^scale_a: dtype torch.float16"):
        scaled.check(a, b, sa.half(), sb)
    with pytest.raises(TypeError, match="^a: dtype torch.bfloat16"):
        scaled.check(a.bfloat16(), b, sa, sb)
    with pytest.raises(ValueError, match="^b: expected a column-major"):
        scaled.check(a, b.contiguous(), sa, sb)
    with pytest.raises(ValueError, match="^b: K=520 and N=256 must be multiples of 16"):
        scaled.check(quantize(torch.randn(128, 520), "row")[0], quantize(torch.randn(256, 520), "row", operand="b")[0],
                     sa, sb)
    with pytest.raises(ValueError, match="^bias: expected shape \\(256,\\)"):
        scaled.check(a, b, sa, sb, bias=torch.zeros(128))
    with pytest.raises(TypeError, match="^out_dtype"):
        scaled.check(a, b, sa, sb, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="^b: float8_e5m2"):
        scaled.check(a.view(torch.float8_e5m2), b.view(torch.float8_e5m2), sa, sb)
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_mm: scale_a"):
        scaled.scaled_mm(a, b, sa[:64], sb)
    assert "not CUDA" in scaled.eligibility(a, b, sa, sb)
    assert scaled.eligibility(a, b, sa[:64], sb).startswith("scale_a")
    block = operands(128, 256, 512, "block")
    with pytest.raises(ValueError, match="^scale_b"):
        scaled.check(*block[:3], block[3][:, :1])  # a 128x128 scale_b with one column too few


def test_plans():
    tensor, block = ScaledEpilogue("tensor", False), ScaledEpilogue("block", True)
    plan = make_plan(4096, 4096, 4096, tensor, None, None, 132)
    assert (plan.config.bm, plan.config.bn, plan.swap, plan.grid) == (128, 256, False, 132)
    # fast accumulation: the width whose waves take least time, ties to the wider (4096^2: 4 waves of 256 = 8 of
    # 128; 8192^2: 21 waves of 192 < 16 of 256 < 32 of 128; 4096 x 2112: 3 of 192 < 3 of 256 < 5 of 128)
    assert [make_plan(m, n, 4096, tensor, None, None, 132).config.bn
            for m, n in ((4096, 4096), (8192, 8192), (4096, 2112), (128, 8192))] == [256, 192, 192, 64]
    plan = make_plan(4096, 4096, 7168, block, None, None, 132)
    assert (plan.config.bm, plan.config.bn, plan.config.consumers) == (128, 128, 2) and plan.k_tiles == 56
    assert plan.config.issue_ahead  # block scales issue ahead by default (measured faster on every row)
    assert not make_plan(4096, 4096, 7168, ScaledEpilogue("row", True), None, None, 132).config.issue_ahead
    assert plan.config.check(promote=True) is None
    plan = make_plan(16, 7168, 2048, ScaledEpilogue("row", True, bias=True), None, None, 132)
    assert plan.swap and (plan.m, plan.n) == (7168, 16) and plan.config.bn == 16 and plan.epilogue.bias_rows
    assert plan.config.split_k == 1 and not plan.epilogue.partial  # 112 tiles: no idle half to split over
    plan = make_plan(16, 4096, 7168, ScaledEpilogue("row", True), None, None, 132)
    assert plan.swap and plan.config.split_k == 2 and plan.grid == 128
    assert plan.epilogue.partial != plan.config.split_fix_up == SPLIT_FIX_UP  # two launches, or one (the fix-up)
    plan = make_plan(1, 2048, 7168, ScaledEpilogue("tensor", False), None, None, 132)  # 32 tiles: 4 splits of 14
    assert plan.config.split_k == 4 and plan.grid == 128
    assert make_plan(SWAP_MAX_M + 1, 7168, 2048, tensor, None, None, 132).swap is False
    plan = make_plan(16, 4096, 7168, block, None, None, 132)  # a token tile narrow enough to fill the SMs
    assert not plan.swap and (plan.config.bm, plan.config.bn) == (64, 32) and plan.grid == 128
    assert plan.config.split_k == 1
    with pytest.raises(ValueError, match="^swap"):
        make_plan(16, 4096, 7168, block, None, True, 132)
    # tiles over several weight blocks: runs of gcd(bn, 128) columns, at most MOST_WEIGHT_RUNS of them
    assert make_plan(256, 4096, 7168, block, ScaledConfig(128, 96, 4, 2), None, 132).config.bn == 96
    with pytest.raises(ValueError, match="^config: bn=136: .* 17 runs"):
        make_plan(256, 4096, 7168, block, ScaledConfig(128, 136, 4, 2), None, 132)
    with pytest.raises(ValueError, match="^config: .*registers"):
        make_plan(256, 4096, 7168, block, ScaledConfig(128, 256, 4, 2), None, 132)
    for m, n in ((1, 4096), (64, 4096), (100, 1536), (4096, 2112), (8192, 8192)):
        for epi in (tensor, block, ScaledEpilogue("row", True)):
            plan = make_plan(m, n, 4096, epi, None, None, 132)
            assert plan.config.check(epi.promote) is None and 1 <= plan.grid <= 132
            tiles = math.ceil(plan.m / plan.config.bm) * math.ceil(plan.n / plan.config.bn)
            assert plan.grid <= tiles * plan.config.split_k
            assert plan.epilogue.partial == (plan.config.split_k > 1 and not plan.config.split_fix_up)
            assert plan.config.split_k == 1 or 2 * tiles <= 132


def _quantizer_plans() -> list:
    from nvfly.ops.scaled.quantize import QUANTIZE_VARIANTS
    return [(g, "default") for g in ("row", "1x128", "128x128", "mx", "mxfp4")] + \
        [(g, name) for name, (granularities, _) in QUANTIZE_VARIANTS.items() for g in granularities]


@pytest.mark.parametrize("source", ["bf16", "f32"])
@pytest.mark.parametrize("granularity, variant", _quantizer_plans())
def test_quantize_kernels_compile(granularity, variant, source):
    """Every granularity's plan (and QUANTIZE_VARIANTS') compiles without spills; x is read in 16-byte
    non-coherent streaming loads, all of a thread's issued before its amax reduction, and the fp8 values stored as
    8-byte words (e2m1: 4; 16-element chunks: twice as wide)."""
    rows, k = 4096, 7168
    plan, kern = _compile_quantizer(granularity, source, variant, rows, k)
    assert kern.resources.spill_stores == 0 and kern.resources.stack_bytes == 0 and not kern.warnings
    assert "STL" not in kern.sass() and "LDL" not in kern.sass()
    hinted = ".L1::no_allocate.L2::cache_hint" if plan.hints else ""
    load = f"ld.global.nc{hinted}.v4.u32"
    per_thread = plan.loads * (plan.unroll if plan.per_warp else plan.chunks)
    assert kern.ptx.count(load) == per_thread * (2 if plan.sweeps > 1 else 1)
    ldg = "LDG.E.NA.128.CONSTANT" if plan.hints else "LDG.E.128.CONSTANT"
    assert kern.sass_opcodes()[ldg] == kern.ptx.count(load)  # 16-byte read-only loads in SASS
    # the loads come first: none after the first reduction step (shuffle or barrier)
    body = kern.ptx[kern.ptx.index(load):]
    first_reduction = min(i for i in (body.find("shfl.sync.bfly"), body.find("bar.sync")) if i >= 0)
    assert body[:first_reduction].count(load) == per_thread
    if granularity in ("mx", "mxfp4"):  # a power-of-two scale: its exact reciprocal multiplies, no division
        assert "div.rn.f32" not in kern.ptx and "rcp" not in kern.ptx
    else:  # divide's reciprocal once per group; div.rn.f32 only for a group with an inf or NaN scale
        assert kern.ptx.count("rcp.approx.ftz.f32") == (plan.unroll if plan.per_warp else 1)
        assert "div.rn.f32" in kern.ptx
    wide = plan.chunk == 16
    if plan.per_warp:  # a butterfly step per halving of the group's lanes; 16-bit x: two groups a shuffle
        lanes = plan.group_cols // plan.chunk
        reductions = -(-plan.unroll // 2) if plan.pair_groups and source == "bf16" else plan.unroll
        assert kern.ptx.count("shfl.sync.bfly") == (lanes.bit_length() - 1) * reductions
    if granularity == "mxfp4":  # no fp8 cvt; a 32-bit word of eight codes, a scale byte
        stored = "v2.u32" if wide else "b32"
        assert "F2FP" not in kern.sass() and f"st.global{hinted}.{stored}" in kern.ptx
        assert "st.global.b8" in kern.ptx
        return
    kind = "E4M3" if plan.fp8 == "f8e4m3" else "E5M2"
    assert any(op.startswith(f"F2FP.SATFINITE.{kind}.F32") for op in kern.sass_opcodes())
    assert f"st.global{hinted}.{'v4' if wide else 'v2'}.u32" in kern.ptx
    assert ("cache_hint" in kern.ptx) == plan.hints
    if granularity == "mx":
        assert "st.global.b8" in kern.ptx
    if granularity == "1x128":
        from nvfly.ops.scaled.quantize import quantize_plan
        _, blocks = quantize_plan(rows, k, 4 if source == "f32" else 2, granularity, torch.float8_e4m3fn, 132, variant)
        assert plan.unroll * plan.loads <= 8 and plan.unroll == min(4, 8 // plan.loads)
        assert blocks == rows * 56 // (plan.threads // (128 // plan.chunk) * plan.unroll)


def _compile_quantizer(granularity: str, source: str, variant: str = "default", rows: int = 4096, k: int = 7168):
    from nvfly.frontend.dtypes import bf16, f16, f32, i32, u8
    from nvfly.ops.scaled.quantize import quantize_plan
    from nvfly.ops.scaled.quantize_kernel import quantize_kernel
    from nvfly.runtime.tensor_desc import TensorDesc
    dtype = torch.float4_e2m1fn_x2 if granularity == "mxfp4" else torch.float8_e4m3fn
    plan, _ = quantize_plan(rows, k, 4 if source == "f32" else 2, granularity, dtype, 132, variant)
    scale = {"row": TensorDesc(f32, (rows, 1)), "1x128": TensorDesc(f32, (rows, k // 128), (1, rows)),
             "128x128": TensorDesc(f32, (rows // 128, k // 128)), "mx": TensorDesc(u8, (rows, k // 32)),
             "mxfp4": TensorDesc(u8, (rows, k // 32))}[granularity]
    q = TensorDesc(i32, (rows, k // (8 if granularity == "mxfp4" else 4)))
    x = TensorDesc({"bf16": bf16, "f16": f16, "f32": f32}[source], (rows, k))
    return plan, quantize_kernel.compile(x, q, scale, rows, k, PLAN=plan, block=plan.threads)


def test_quantize_e2m1_pairs_variant_rounds_bf16_pairs(monkeypatch):
    """QUANTIZE_VARIANTS' "e2m1-pairs" (MXFP4): bf16 x rounded in bf16x2 (one add.rn.bf16x2 per pair, in SASS
    HADD2/HFMA2.BF16), no spills, fewer SASS instructions than the default; the f32 rounding kept for groups holding
    a NaN; fp16 / fp32 x compile as the default (the option applies to bf16 only); other granularities refuse it."""
    from nvfly.ops.scaled import quantize as quantize_module
    from nvfly.ops.scaled.quantize import quantize_plan
    monkeypatch.setattr(quantize_module, "DEFAULT_VARIANTS", {})  # the f32 rounding, whatever the default
    plan, kern = _compile_quantizer("mxfp4", "bf16", "e2m1-pairs")
    _, default = _compile_quantizer("mxfp4", "bf16")
    assert plan.e2m1_pairs and kern.resources.spill_stores == 0 and "STL" not in kern.sass()
    assert kern.ptx.count("add.rn.bf16x2") == 4 * plan.unroll
    assert kern.ptx.count("prmt.b32") == 2 * plan.unroll + 2 * (plan.unroll // 2)  # the nibbles; amaxes paired
    assert any(op.startswith(("HADD2.BF16", "HFMA2.MMA.BF16", "HFMA2.BF16")) for op in kern.sass_opcodes())
    assert sum(kern.sass_opcodes().values()) < 0.95 * sum(default.sass_opcodes().values())
    assert kern.ptx.count("add.rn.f32") == 8 * plan.unroll  # f32_to_e2m1's magic add: the NaN groups' path only
    for source in ("f16", "f32"):
        _, kern = _compile_quantizer("mxfp4", source, "e2m1-pairs")
        _, default = _compile_quantizer("mxfp4", source)
        assert "bf16x2" not in kern.ptx.replace("max.NaN.bf16x2", "")
        assert sum(kern.sass_opcodes().values()) == sum(default.sass_opcodes().values())
    with pytest.raises(ValueError, match="^variant: expected 'default' or one of .* for granularity 'row', got 'e2m1"):
        quantize_plan(16, 4096, 2, "row", torch.float8_e4m3fn, 132, "e2m1-pairs")
    with pytest.raises(ValueError, match="^variant: .*'e2m1-pairs'.* got 'nope'"):
        quantize_plan(16, 4096, 2, "mxfp4", torch.float4_e2m1fn_x2, 132, "nope")


def test_quantize_plan_holds_long_rows_in_sweeps():
    from nvfly.ops.scaled.quantize import quantize_plan
    plan, blocks = quantize_plan(8, 7168, 2, "row", torch.float8_e4m3fn, 132)
    assert (plan.threads, plan.chunks, plan.sweeps, blocks) == (128, 7, 1, 8)
    plan, _ = quantize_plan(8, 1 << 17, 2, "row", torch.float8_e4m3fn, 132)
    assert plan.threads == 1024 and plan.sweeps == 2 and plan.chunks * plan.threads * plan.sweeps * 8 >= 1 << 17
    plan, blocks = quantize_plan(300, 200 * 16, 4, "128x128", torch.float8_e4m3fn, 132)
    assert (plan.threads, plan.chunks, plan.loads, blocks) == (512, 4, 2, 3 * 25)
    assert quantize_plan(16, 7168, 2, "1x128", torch.float8_e4m3fn, 132)[0].unroll == 1


def test_routing_eligibility_keeps_torch_semantics():
    from nvfly.torch import scaled_ops
    a, b, sa, sb = operands(128, 256, 512, "row")
    assert "float8_e4m3fn" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb)  # torch's default output: fp8
    assert "scale_result" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, sa[0], torch.bfloat16)
    assert "torch refuses" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb, torch.zeros(256), None, torch.float32)
    assert "not CUDA" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, None, torch.bfloat16)
    assert "recipes 4/5" in scaled_ops.scaled_mm_v2_eligibility(a, b, [sa], [4], [], [sb], [5], [], None,
                                                                torch.bfloat16)
    assert "swizzled" in scaled_ops.scaled_mm_v2_eligibility(a, b, [sa], [1], [1], [sb], [1], [], None,
                                                             torch.bfloat16)
    assert "not CUDA" in scaled_ops.scaled_mm_v2_eligibility(a, b, [sa], [1], [], [sb], [1], [], None,
                                                             torch.bfloat16)
    assert len(scaled_ops._DECISIONS) >= 4  # decided once per signature
    assert "not CUDA" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, None, torch.bfloat16)  # cached
    one = operands(1, 256, 512, "row")  # M = 1: a (1, 1) scale_a is row-wise next to a (1, N) scale_b
    assert scaled.recipe(*one) == "row"


def test_routing_sends_only_what_nvfly_was_measured_faster_on(monkeypatch):
    """The measured rule (docs/ops/scaled.md): tensor/row-wise scales at M <= 64 go to nvfly, fast-accumulating or
    not, through _scaled_mm and _scaled_mm_v2; larger M and block scales stay with cuBLAS, saying why. The device
    checks are taken as passed (they need a GPU), so that the rule itself decides."""
    from nvfly.torch import scaled_ops
    monkeypatch.setattr(scaled, "eligibility", lambda *args, **kwargs: None)
    monkeypatch.setattr(scaled_ops, "_DECISIONS", type(scaled_ops._DECISIONS)())
    n, k = 256, 512
    for scaling in ("tensor", "row"):
        for m in (1, 16, scaled_ops.ROUTE_MAX_M):
            a, b, sa, sb = operands(m, n, k, scaling)
            for fast in (False, True):
                assert scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, None, torch.bfloat16, fast) is None
            recipe = {"tensor": 0, "row": 1}[scaling]
            assert scaled_ops.scaled_mm_v2_eligibility(a, b, [sa], [recipe], [], [sb], [recipe], [], None,
                                                       torch.float16) is None
        for m in (scaled_ops.ROUTE_MAX_M + 1, 128, 4096):
            a, b, sa, sb = operands(m, n, k, scaling)
            reason = scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, None, torch.bfloat16)
            assert f"M = {m} > 64: cuBLAS measured faster" in reason
    for scaling in ("block", "block1x128"):
        for m in (1, 64, 4096):
            a, b, sa, sb = operands(m, n, k, scaling)
            reason = scaled_ops.scaled_mm_eligibility(a, b, sa, sb, None, None, torch.bfloat16)
            assert reason.startswith(f"{scaling} scales: cuBLAS measured faster at every M")
    a, b, sa, sb = operands(16, n, k, "row")  # torch's own limits still come first
    assert "float8_e4m3fn" in scaled_ops.scaled_mm_eligibility(a, b, sa, sb)


@pytest.mark.parametrize("scaling,vec,bias", [("tensor", 8, True), ("row", 4, False), ("block", 1, True),
                                              ("mxfp8", 8, True)])
def test_reduce_kernel_compiles(scaling, vec, bias):
    from nvfly.ops.scaled.api import compile_reduce
    k = compile_reduce(scaling, 4, vec, bias)
    assert k.resources.spill_stores == 0 and k.resources.stack_bytes == 0 and not k.warnings
    assert k.count("LDG.E.128") >= (vec // 4) * 4 if vec >= 4 else True


def test_explain_describes_scaled_gemms(capsys):
    from nvfly.cli import main
    assert main(["explain", "16", "4096", "7168", "--scaled", "block"]) == 0
    out = capsys.readouterr().out
    assert "scaled-block-promoted: 64x32 tile on 128 blocks" in out and "routing" in out
    assert main(["explain", "8", "4096", "7168", "--scaled", "row", "--fast-accum"]) == 0
    assert "scaled-row-swapAB-splitK2-fixup: 64x8 tile" in capsys.readouterr().out
    assert main(["explain", "4096", "4096", "4096", "--scaled", "mxfp4"]) == 0
    out = capsys.readouterr().out
    assert "scaled-mxfp4-promoted: 128x128 tile" in out and "swizzled layout" in out


def test_quantize_fp8_checks_its_arguments():
    from nvfly.ops.scaled.quantize import quantize_fp8
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.quantize_fp8: granularity"):
        quantize_fp8(torch.randn(4, 32), "tensor")
    with pytest.raises(TypeError, match="^nvfly.ops.scaled.quantize_fp8: x: expected a 2-D"):
        quantize_fp8(torch.randn(4, 32, dtype=torch.float64), "row")
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.quantize_fp8: x: .*CUDA"):
        quantize_fp8(torch.randn(4, 32), "row")


# ---------------------------------------------------------------------------------------------- MXFP8
def mx_operands(m, n, k, e8m0=True):
    """MXFP8 a (M, K), b (K, N column-major) and their (rows, K/32) e8m0 scales (float8_e8m0fnu, or uint8 bytes)."""
    a, sa = quantize(torch.randn(m, k) * 4, "mx")
    b, sb = quantize(torch.randn(n, k), "mx", operand="b")
    if e8m0:
        sa, sb = sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)
    return a, b, sa, sb


def test_e8m0_decode_is_torchs_for_every_byte():
    from nvfly.ops.scaled.quantize import e8m0_to_float
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = e8m0_to_float(byte)
    theirs = byte.view(torch.float8_e8m0fnu).float()
    assert torch.equal(ours[:255], theirs[:255]) and ours[255].isnan() and theirs[255].isnan()
    assert ours[0] == 2.0 ** -127 and ours[127] == 1.0 and ours[254] == 2.0 ** 127
    assert torch.equal(e8m0_to_float(byte.view(torch.float8_e8m0fnu)).nan_to_num(), ours.nan_to_num())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), blocks=st.integers(1, 4), data=st.data())
def test_mx_dequantisation_matches_a_power_of_two_reference(rows, blocks, data):
    from nvfly.ops.scaled.quantize import dequantize_mx
    e = torch.tensor(data.draw(st.lists(st.integers(0, 254), min_size=rows * blocks, max_size=rows * blocks)))
    e = e.view(rows, blocks)
    q = (torch.randn(rows, 32 * blocks) * 100).to(torch.float8_e4m3fn)
    exact = q.double() * torch.pow(2.0, e.double() - 127).repeat_interleave(32, 1)
    assert torch.equal(dequantize_mx(q, e.to(torch.uint8).view(torch.float8_e8m0fnu)), exact.float())


def test_mx_recipe_reference_and_errors():
    a, b, sa, sb = mx_operands(70, 96, 320)
    assert scaled.recipe(a, b, sa, sb) == "mxfp8" and scaled.check(a, b, sa, sb) == "mxfp8"
    assert scaled.check(a, b, sa.view(torch.uint8), sb.view(torch.uint8)) == "mxfp8"  # quantize's bytes
    ka, kb = kernel_scales("mxfp8", sa, sb)
    assert ka.dtype == torch.uint8 and ka.data_ptr() == sa.data_ptr() and tuple(kb.shape) == (96, 10)
    fa = sa.float().repeat_interleave(32, 1)  # torch's own e8m0 -> float32
    fb = sb.float().repeat_interleave(32, 1)
    assert torch.allclose(scaled.reference(a, b, sa, sb), (a.float() * fa) @ (b.t().float() * fb).t(), rtol=1e-5,
                          atol=1e-5)
    with pytest.raises(ValueError, match="^a: K=304 is not a multiple of 32"):
        scaled.check(a[:, :304], b[:304], sa[:, :9], sb[:, :9])
    with pytest.raises(ValueError, match="^scale_a: shape \\(70, 9\\): expected \\(70, 10\\) e8m0"):
        scaled.check(a, b, sa[:, :9], sb)
    with pytest.raises(ValueError, match="^scale_b: shape \\(10, 96\\): expected \\(96, 10\\)"):
        scaled.check(a, b, sa, sb.t())
    with pytest.raises(TypeError, match="^scale_b: dtype torch.float32 next to MX"):
        scaled.check(a, b, sa, sb.float())
    with pytest.raises(ValueError, match="^nvfly.ops.scaled.scaled_mm: scale_a: shape"):
        scaled.scaled_mm(a, b, sa[:64], sb)
    flat = torch.zeros(128 * 12, dtype=torch.float8_e8m0fnu)  # cuBLAS's swizzled blocked layout: refused
    with pytest.raises(ValueError, match="swizzled blocked layout is not taken"):
        scaled.check(a, b, flat, sb)


def test_mx_plans():
    mx = ScaledEpilogue("mxfp8", True)
    assert mx.scale_k == 32 and ScaledEpilogue("block", True).scale_k == 128
    with pytest.raises(ValueError, match="promote"):
        ScaledEpilogue("mxfp8", promote=False)
    plan = make_plan(4096, 4096, 4096, mx, None, None, 132)
    assert (plan.config.bm, plan.config.bn, plan.swap) == (128, 128, False) and plan.config.check(True) is None
    plan = make_plan(16, 4096, 7168, mx, None, None, 132)
    assert not plan.swap and plan.config.bm == 64
    with pytest.raises(ValueError, match="^swap"):
        make_plan(16, 4096, 7168, mx, None, True, 132)
    with pytest.raises(ValueError, match="^config: issue_ahead with MX"):
        make_plan(4096, 4096, 4096, mx, ScaledConfig(128, 128, 6, 2, issue_ahead=True), None, 132)
    assert scaled.describe(4096, 4096, 4096, scaling="mxfp8").startswith("scaled-mxfp8-promoted: 128x128 tile")
    from nvfly.torch import scaled_ops
    assert "swizzled (blocked) layout" in scaled_ops.slower_reason("mxfp8", 16)


# ---------------------------------------------------------------------------------------------- MXFP4 weights
def mxfp4_operands(m, n, k):
    """MXFP8 a and MXFP4 b: random e2m1 pairs (every code, -0 included) as float4_e2m1fn_x2 (K/2, N) column-major,
    e8m0 scales around 2^0."""
    a, sa = quantize(torch.randn(m, k) * 4, "mx")
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sb = torch.randint(120, 135, (n, k // 32), dtype=torch.uint8)
    return a, packed.view(torch.float4_e2m1fn_x2).t(), sa.view(torch.float8_e8m0fnu), sb.view(torch.float8_e8m0fnu)


def test_e2m1_values_and_nibble_order_are_torchs():
    """torch's packing (torch.testing._internal.common_quantized.pack_uint4: ``odd << 4 | even``, the low nibble the
    lower-numbered value) of the OCP codes (sign bit 3, exponent bits 2-1 with bias 1, mantissa bit 0)."""
    from nvfly.ops.scaled.quantize import e2m1_to_float
    codes = torch.arange(16).repeat(3)[torch.randperm(48)]
    sign, exponent, mantissa = codes >> 3, (codes >> 1) & 3, codes & 1
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1.0) * (1 + 0.5 * mantissa))
    values = torch.where(sign == 1, -magnitude, magnitude).view(6, 8)
    packed = (codes[1::2] << 4 | codes[::2]).to(torch.uint8).view(6, 4).view(torch.float4_e2m1fn_x2)
    decoded = e2m1_to_float(packed)
    assert torch.equal(decoded, values) and torch.equal(decoded.signbit(), values.signbit())


@settings(max_examples=50, deadline=None)
@given(words=st.lists(st.integers(0, 2 ** 32 - 1), min_size=1, max_size=64))
def test_e2m1_to_e4m3_conversion_is_exact_times_2_to_the_minus_6(words):
    """The kernel's conversion's bit operations (nvfly.arch.floats.e2m1x8_to_e4m3x8, run on int64 tensors): each
    e4m3 byte is its e2m1 value times 2^-6, exactly (signed zero kept)."""
    from nvfly.arch.floats import e2m1x8_to_e4m3x8_bits
    from nvfly.ops.scaled.quantize import e2m1_to_float
    w = torch.tensor(words, dtype=torch.int64)
    low, high = e2m1x8_to_e4m3x8_bits(w)
    out = torch.stack([(word >> (8 * i)) & 0xFF for word in (low, high) for i in range(4)], 1).to(torch.uint8)
    got = out.view(torch.float8_e4m3fn).float() * 64
    expected = e2m1_to_float(torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], 1).to(torch.uint8))
    assert torch.equal(got, expected) and torch.equal(got.signbit(), expected.signbit())


def test_mxfp4_recipe_reference_plans_and_errors():
    a, b, sa, sb = mxfp4_operands(70, 96, 320)
    assert b.dtype == torch.float4_e2m1fn_x2 and tuple(b.shape) == (160, 96) and b.stride() == (1, 160)
    assert scaled.recipe(a, b, sa, sb) == "mxfp4" and scaled.check(a, b, sa, sb) == "mxfp4"
    nibbles = b.t().contiguous().view(torch.uint8).to(torch.int64)
    w = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    w = torch.cat([w, -w])[torch.stack((nibbles & 15, nibbles >> 4), -1).flatten(1)]  # (N, K), low nibble first
    wf = w * sb.float().repeat_interleave(32, 1)
    ref = (a.float() * sa.float().repeat_interleave(32, 1)) @ wf.t()
    assert torch.allclose(scaled.reference(a, b, sa, sb), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="^b: shape \\(160, 96\\) and a's \\(70, 160\\) do not multiply"):
        scaled.check(a[:, :160], b, sa[:, :5], sb)
    with pytest.raises(TypeError, match="^scale_a: dtype torch.float32 next to MX"):
        scaled.check(a, b, sa.float(), sb.float())
    with pytest.raises(TypeError, match="^a: dtype torch.float4_e2m1fn_x2 is not float8"):
        scaled.check(b.t().contiguous(), b, sa, sb)
    plan = make_plan(4096, 4096, 4096, ScaledEpilogue("mxfp4", True), None, None, 132)
    assert plan.config.packed_b and plan.b_box == (128, 64) and plan.b_swizzle == 0
    assert plan.config.check(True) is None and plan.config.stages == 5  # 40 KiB stages
    plan = make_plan(16, 4096, 7168, ScaledEpilogue("mxfp4", True), ScaledConfig(64, 32, 8, 1), None, 132)
    assert plan.config.packed_b  # a caller's config gets the packed tile too
    with pytest.raises(ValueError, match="^config: packed_b with mxfp8"):
        make_plan(256, 256, 256, ScaledEpilogue("mxfp8", True), ScaledConfig(64, 32, 8, 1, packed_b=True), None, 132)
    assert "multiple of 16" in ScaledConfig(64, 24, 4, 1, packed_b=True).check(True)


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(-12, 12, width=32), min_size=1, max_size=64))
def test_e2m1_rounding_is_nearest_even_and_saturates(values):
    """The reference's e2m1 codes (``e2m1_codes``, whose thresholds the kernel's ``f32_to_e2m1`` shares) against a
    brute-force nearest: the closest of the 8 magnitudes, ties to the even code, past 6 saturated, the sign kept."""
    from nvfly.ops.scaled.quantize import E2M1_VALUES, e2m1_codes
    y = torch.tensor(values, dtype=torch.float32)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    distance = (y.abs()[:, None] - magnitudes[None]).abs()
    best = distance.min(dim=1, keepdim=True).values
    index = torch.arange(8)
    nearest = torch.where(distance == best, index % 2 * 100 + index, 1000).argmin(dim=1)  # a tie: the even code
    expected = nearest | (y.signbit().long() << 3)
    assert torch.equal(e2m1_codes(y), expected)


def test_e2m1_magic_rounding_equals_the_reference_codes():
    """f32_to_e2m1's rule (``E2M1_MAGIC``: the magnitude plus a power of two rounds it to e2m1's step, the sum's bits
    count the steps) in torch float32 arithmetic equals ``e2m1_codes`` at every tie, its neighbours, a fine grid,
    zeros, subnormals, infinities and NaN."""
    import struct
    from nvfly.arch.floats import E2M1_MAGIC
    from nvfly.ops.scaled.quantize import e2m1_codes
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    near = torch.cat([ties, torch.nextafter(ties, torch.tensor(0.0)), torch.nextafter(ties, torch.tensor(100.0))])
    grid = torch.arange(-14 * 256, 14 * 256 + 1) / 256
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-30, 7.0, 1e30, 3.4e38, float("inf"), -float("inf"),
                            float("nan")])
    y = torch.cat([near, -near, grid, special]).float()
    mag = y.abs()
    (low, c0, o0), (mid, c1, o1), (_, c2, o2) = E2M1_MAGIC
    bits = lambda c: struct.unpack("<i", struct.pack("<f", c))[0]  # noqa: E731
    magic = torch.where(mag < low, c0, torch.where(mag < mid, c1, c2)).float()
    less = torch.where(mag < low, bits(c0) - o0, torch.where(mag < mid, bits(c1) - o1, bits(c2) - o2))
    steps = (mag + magic).view(torch.int32) - less
    code = torch.where(mag == mag, steps.clamp(max=7), 0).long() | (y.signbit().long() << 3)
    assert torch.equal(code, e2m1_codes(y))


def _bf16x2_to_e2m1x8_emulated(x: torch.Tensor, reciprocal: torch.Tensor) -> torch.Tensor:
    """``nvfly.arch.floats.bf16x2_to_e2m1x8``'s steps in torch on CPU: x (n, 8) bf16, reciprocal (n, 1) f32 -> n
    words (int64, unsigned). The bf16 ops as f32 ops rounded to bf16 (the product is exact in f32; for the sum,
    rounding to f32's 24 bits and then to bf16's 8 is innocuous, 24 >= 2 * 8 + 2), the integer ops on the packed
    32-bit words as the kernel does them (lanes that must not borrow from each other)."""
    from nvfly.arch.floats import _BF16_EXPONENT_PAIR, _BF16_TIMES_64, _E2M1_CODE_BIAS

    def bits(t: torch.Tensor) -> torch.Tensor:  # bf16 -> its 16 bits as int64
        return t.view(torch.int16).long() & 0xFFFF

    def bf16(b: torch.Tensor) -> torch.Tensor:  # 16 bits (int64) -> bf16 (the cast to int16 wraps)
        return b.to(torch.int16).view(torch.bfloat16)

    def pairs(lanes: torch.Tensor) -> torch.Tensor:  # (n, 8) 16-bit lanes -> (n, 4) words, value 2p low
        return lanes[:, 0::2] | (lanes[:, 1::2] << 16)

    w = pairs(bits(x))
    magnitude = bf16(bits(x) & 0x7FFF)
    a = (magnitude.float() * reciprocal).bfloat16().clamp(max=6.0)     # mul.rn.bf16x2, min.bf16x2 (no NaN here)
    e = pairs(bits(torch.maximum(a, torch.tensor(1.0, dtype=torch.bfloat16)))) & _BF16_EXPONENT_PAIR
    magic = e + _BF16_TIMES_64
    lanes = torch.stack([magic & 0xFFFF, magic >> 16], dim=-1).flatten(1)  # (n, 8) in value order
    total = pairs(bits((a.float() + bf16(lanes).float()).bfloat16()))   # add.rn.bf16x2
    mask = (1 << 32) - 1
    codes = ((total - e + (e >> 6) - _E2M1_CODE_BIAS) & mask) | ((w >> 12) & 0x00080008)
    low01, low23 = codes[:, 0] | (codes[:, 1] << 8), codes[:, 2] | (codes[:, 3] << 8)
    lows = (low01 & 0xFFFF) | ((low23 & 0xFFFF) << 16)                   # prmt 0x5410
    highs = (low01 >> 16) | ((low23 >> 16) << 16)                        # prmt 0x7632
    return (lows | (highs << 4)) & mask


def test_bf16_pair_e2m1_rounding_equals_the_reference_codes():
    """bf16x2_to_e2m1x8's rule (QuantizePlan.e2m1_pairs) gives the reference's codes (``e2m1_codes`` of x times the
    reciprocal in f32) for every non-NaN bf16 x (infinities, zeros, subnormals) and every MXFP4 scale byte 0-253
    (reciprocals 2^127 .. 2^-126), ties included, eight consecutive values to a word in the reference's nibble
    order; the GPU test runs the kernel itself."""
    from nvfly.ops.scaled.quantize import e2m1_codes
    every = torch.arange(1 << 16, dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    values = every[~every.isnan()]
    values = values[: values.numel() // 8 * 8].reshape(-1, 8)
    for byte in range(254):
        reciprocal = torch.tensor([(254 - byte) << 23], dtype=torch.int32).view(torch.float32)
        got = _bf16x2_to_e2m1x8_emulated(values, reciprocal.expand(values.shape[0], 1))
        codes = e2m1_codes(values.float() * reciprocal)
        want = sum(codes[:, i] << (4 * i) for i in range(8))
        assert torch.equal(got, want), (byte, values[got != want][:2])


def test_mxfp4_quantisation_reference():
    x = torch.randn(64, 256) * 3
    x[0, :32] = 0
    x[1, 32:64] = 0.0
    x[1, 40] = 7.0  # amax 7 = 1.75 * 2^2: scale 2^(2 - 2) = 1, 7 saturates to 6
    x[1, 41] = -2.5  # a tie: to 2 (the even code)
    q, s = quantize(x, "mxfp4")
    assert q.dtype == torch.float4_e2m1fn_x2 and tuple(q.shape) == (64, 128) and tuple(s.shape) == (64, 8)
    from nvfly.ops.scaled.quantize import dequantize_mxfp4, e2m1_to_float
    assert s[0, 0] == 0 and (e2m1_to_float(q)[0, :32] == 0).all()
    assert s[1, 1] == 127 and e2m1_to_float(q)[1, 40] == 6.0 and e2m1_to_float(q)[1, 41] == -2.0
    assert ((dequantize_mxfp4(q, s) - x).norm() / x.norm()) < 0.2  # 4-bit values
    qb, sb = quantize(x, "mxfp4", operand="b")
    assert qb.shape == (128, 64) and qb.stride() == (1, 128) and torch.equal(sb, s)
    a, sa = quantize(torch.randn(16, 256), "mx")
    assert scaled.recipe(a, qb, sa, sb) == "mxfp4"


# clusters along N (ScaledConfig.cluster_n): every scaling's mainloop and both epilogues, 2 and 4 blocks, the M = 128
# plan's 128 x 64 tile, 128 x 128 tiles and the 64-row token tile
CLUSTER_VARIANTS = [
    (ScaledConfig(128, 64, 8, 2, tma_store=True, cluster_n=2), ScaledEpilogue("row", True)),
    (ScaledConfig(128, 64, 8, 2, tma_store=True, cluster_n=4), ScaledEpilogue("tensor", True, bias=True)),
    (ScaledConfig(128, 64, 8, 2, tma_store=True, cluster_n=2), ScaledEpilogue("row", False)),
    (ScaledConfig(128, 128, 6, 2, cluster_n=4), ScaledEpilogue("tensor", False, bias=True)),
    (deepest(ScaledConfig(128, 64, 2, 2, tma_store=True, issue_ahead=True, staged_scales=True, cluster_n=4)),
     ScaledEpilogue("block", True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True, cluster_n=2), ScaledEpilogue("block", True, bias=True)),
    (ScaledConfig(64, 128, 8, 1, cluster_n=2), ScaledEpilogue("block", True)),
    (ScaledConfig(128, 128, 6, 2, cluster_n=2), ScaledEpilogue("block1x128", True, bias=True)),
    (ScaledConfig(128, 64, 8, 2, tma_store=True, cluster_n=4), ScaledEpilogue("block1x128", True)),
    (ScaledConfig(128, 128, 6, 2, tma_store=True, cluster_n=4), ScaledEpilogue("mxfp8", True)),
    (ScaledConfig(128, 128, 5, 2, packed_b=True, cluster_n=2), ScaledEpilogue("mxfp4", True)),
]


@pytest.mark.parametrize("variant", CLUSTER_VARIANTS, ids=lambda v: f"{v[0].bm}x{v[0].bn}-{v[1].scaling}"
                         f"{'-promoted' if v[1].promote else ''}-cluster{v[0].cluster_n}"
                         f"{'-tma' if v[0].tma_store else ''}")
def test_cluster_variants_multicast_a(variant):
    """fp8 wgmma without spills; A arrives by multicast TMA loads, the kernel's cluster shape is (cluster_n, 1, 1),
    the blocks meet at cluster barriers (after the ring's barriers exist, before leaving) and free each stage on
    every block's empty barrier (remote arrives); the epilogue as without a cluster."""
    cfg, epi = variant
    (k,) = compile_variants([variant])
    check_kernel(k, f"QGMMA.64x{cfg.bn}x32.F32.E4M3.E4M3")
    assert k.cluster == (cfg.cluster_n, 1, 1) and k.dynamic_smem_bytes == cfg.smem_bytes()
    assert k.count("UTMALDG.2D.MULTICAST") > 0 and k.count("UCGABAR_ARV") == k.count("UCGABAR_WAIT") == 2
    assert k.count("SYNCS.ARRIVE.TRANS64.RED") > 0
    assert k.count("UTMASTG") == (cfg.bn // cfg.store_width if cfg.tma_store else 0)
    assert not epi.promote or ("WARPGROUP.DEPBAR.LE gsb0, 0x1" in k.sass()) == cfg.issue_ahead


def test_cluster_plans_launches_and_declines():
    """cluster_n: the A box is the block's slice, whole clusters launch (tile columns padded to whole clusters),
    the launch carries the cluster shape and the plan names it; swapped, split-K, stream-K and grouped plans
    decline with their reason; the heuristic's plans and launches have no cluster."""
    row = ScaledEpilogue("row", True)
    plan = make_plan(128, 8192, 8192, row, None, None, 132)
    assert (plan.config.bm, plan.config.bn, plan.config.cluster_n, plan.grid) == (128, 64, 1, 128)
    assert scaled.api._Call(plan, None, torch.bfloat16).launch.cluster is None
    for cn in (2, 4):
        clustered = make_plan(128, 8192, 8192, row, replace(plan.config, cluster_n=cn), None, 132)
        assert clustered.a_box == (128 // cn, 128) and clustered.b_box == (64, 128) and clustered.grid == 128
        assert clustered.config.tma_store and clustered.config.stages == plan.config.stages
        assert f"{cn}-block clusters along N" in scaled.api.describe_plan(clustered)
        assert scaled.api._Call(clustered, None, torch.bfloat16).launch.cluster == (cn, 1, 1)
        # 2 tile rows x 17 tile columns (1040 = 16 x 64 + 16), padded to whole clusters of columns
        tail = make_plan(200, 1040, 1104, row, replace(plan.config, cluster_n=cn), None, 132)
        assert tail.grid == 2 * math.ceil(17 / cn) * cn and tail.k_tiles == 9
        assert make_plan(8192, 8192, 4096, row, replace(plan.config, cluster_n=cn), None, 132).grid == 132
        # an f32 output stores through registers, in the same clusters
        assert make_plan(128, 8192, 8192, row, replace(plan.config, cluster_n=cn), None, 132, 4).config == \
            deepest(replace(plan.config, tma_store=False, cluster_n=cn), most=plan.config.stages)
    assert "1, 2 or 4" in ScaledConfig(128, 64, 8, 2, cluster_n=3).check()
    assert "no K split or stream K" in ScaledConfig(128, 128, 6, 2, split_k=2, cluster_n=2).check()
    assert "no K split or stream K" in ScaledConfig(128, 128, 6, 2, stream_k=True, cluster_n=2).check()
    with pytest.raises(ValueError, match="^config: cluster_n=2 on a swapped plan"):
        make_plan(16, 4096, 7168, row, ScaledConfig(64, 16, 8, 1, cluster_n=2), True, 132)
    with pytest.raises(ValueError, match="^config: cluster_n=2: .*no K split"):
        make_plan(128, 8192, 8192, row, ScaledConfig(128, 128, 6, 2, split_k=2, cluster_n=2), None, 132)
    from nvfly.ops.scaled.grouped_plan import make_grouped_plan
    with pytest.raises(ValueError, match="1 or 2 blocks per cluster"):  # the grouped kernel's clusters: 2 at most
        make_grouped_plan("contiguous", row, 8, 1024, 4096, 4096, 128, 132, ScaledConfig(128, 128, 4, 2, cluster_n=4))
    for m, n in ((1, 4096), (64, 4096), (128, 8192), (512, 8192), (8192, 8192)):
        for epi in (ScaledEpilogue("tensor", False), ScaledEpilogue("block", True), row):
            assert make_plan(m, n, 4096, epi, None, None, 132).config.cluster_n == 1


def test_benchmark_times_the_clusters(monkeypatch):
    """benchmarks.scaled times the plan's tile in 2- and 4-block clusters along N up to M = 512 (the 64-wide M = 128
    tile also as 128 x 128, alone and in 2-block clusters), not on swapped small-M plans nor above 512."""
    from benchmarks import scaled as bench
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"multi_processor_count": 132}))
    for recipe in ("tensor", "row", "row-fast", "block", "block1x128"):
        at_128 = bench.alternative_configs(128, 8192, 8192, recipe, False)
        plan = make_plan(128, 8192, 8192, ScaledEpilogue(recipe.removesuffix("-fast"), not recipe.endswith("fast")),
                         None, None, 132)
        assert at_128["cluster2"][0] == replace(plan.config, cluster_n=2) and not at_128["cluster4"][1]
        assert at_128["cluster4"][0] == replace(plan.config, cluster_n=4)
        assert (at_128["tile128"][0].bn, at_128["tile128"][0].cluster_n, at_128["tile128_cluster2"][0].cluster_n) == \
            (128, 1, 2)
        assert {"cluster2", "cluster4"} <= set(bench.alternative_configs(512, 8192, 8192, recipe, False))
        assert not {"cluster2", "cluster4", "tile128"} & set(bench.alternative_configs(1024, 8192, 8192, recipe, False))
        if not recipe.startswith("block"):  # swapped (block scales' 64-row token tile takes clusters)
            assert not {"cluster2", "cluster4"} & set(bench.alternative_configs(16, 4096, 7168, recipe, False))
    assert {"cluster2", "cluster4"} <= set(bench.alternative_configs(16, 4096, 7168, "block", False))

