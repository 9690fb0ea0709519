"""The GEMM's TMA-store epilogue (stmatrix into swizzled staging buffers + TMA store) without a GPU: the
staging addresses place every accumulator element where the output TMA box expects it, the kernels compile
to STSM/UTMASTG code without spills, shared memory is accounted exactly, and plans fall back to the register
epilogue where TMA cannot store the output."""
import itertools

import pytest
import torch

import nvfly
from nvfly.arch import sm90
from nvfly.ops import gemm
from nvfly.ops.common import operands
from nvfly.ops.gemm.config import SMEM_LIMIT, Epilogue, GemmConfig, store_box, store_width
from nvfly.ops.common.epilogue import staging_lane_xor, staging_offset

MAJORS = list(itertools.product(["K", "MN"], ["K", "MN"]))


# ---------------------------------------------------------------------------------------------- layout
@pytest.mark.parametrize("width", [64, 32, 16])
def test_staging_offsets_are_the_tma_swizzle(width):
    """staging_offset is the layout TMA's box uses (the K-major operand layout of the same box and swizzle,
    which the loads of A already rely on)."""
    layout = sm90.operand_layout(128, width, nvfly.bf16, "K", width * 2)
    for r in range(128):
        for c in range(0, width, 8):
            assert staging_offset(r, c // 8, width * 2) == layout((r, c)) * 2, (r, c)


def emulate_stage(bn, wg_m, buffers):
    """Run stage_tile's address arithmetic and stmatrix's semantics for every warp, lane and register of one
    consumer tile; return {slice: {byte offset in the slice buffer: (row, col) of the tile}}."""
    width = store_width(bn)
    row_bytes = width * 2
    slice_bytes = wg_m * row_bytes
    written = {}
    for s in range(bn // width):
        b = s % buffers
        smem = {}
        for w, i, jj in itertools.product(range(4), range(wg_m // 64), range(width // 16)):
            j = s * (width // 8) + 2 * jj
            for q in range(4):  # matrix q: rows from lanes 8q..8q+7
                for r in range(8):
                    lane = 8 * q + r
                    lane_row = 16 * w + lane % 16
                    lane_x = staging_lane_xor(lane_row, lane, row_bytes)
                    addr = lane_row * row_bytes + (b * slice_bytes + 64 * i * row_bytes) + \
                        (((2 * jj) << 4) ^ lane_x)
                    for c in range(8):  # element c of row r: thread 4r + c // 2, half c % 2 of register q
                        t = 4 * r + c // 2
                        e = 4 * j + 2 * q + c % 2  # accumulator element (module doc of wgmma)
                        row = 64 * i + 16 * w + t // 4 + 8 * ((e % 4) // 2)
                        col = 8 * (e // 4) + 2 * (t % 4) + e % 2
                        key = addr + 2 * c - b * slice_bytes
                        assert 0 <= key < slice_bytes and key not in smem
                        smem[key] = (row, col)
        written[s] = smem
    return written


@pytest.mark.parametrize("bn,wg_m", [(128, 128), (256, 64), (96, 128), (48, 64), (16, 128)])
def test_stmatrix_staging_matches_the_store_box(bn, wg_m):
    width = store_width(bn)
    layout = sm90.operand_layout(wg_m, width, nvfly.bf16, "K", width * 2)
    for s, smem in emulate_stage(bn, wg_m, 2).items():
        assert len(smem) == wg_m * width
        for r in range(wg_m):
            for c in range(width):  # what TMA stores to (tile row r, column s * width + c)
                assert smem[layout((r, c)) * 2] == (r, s * width + c), (s, r, c)


def test_stmatrix_phases_are_bank_conflict_free():
    """Each 8-lane phase of stmatrix writes 8 rows of 16 bytes: they must cover all 32 banks."""
    for width in (64, 32):
        row_bytes = width * 2
        for w, jj in itertools.product(range(4), range(width // 16)):
            for q in range(4):
                banks = set()
                for r in range(8):
                    lane = 8 * q + r
                    lane_row = 16 * w + lane % 16
                    addr = lane_row * row_bytes + (((2 * jj) << 4) ^ staging_lane_xor(lane_row, lane, row_bytes))
                    banks.add((addr // 16) % 8)
                assert len(banks) == 8, (width, w, jj, q)


# ---------------------------------------------------------------------------------------------- configs
TMA_CONFIGS = [GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True),
               GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1),
               GemmConfig(128, 256, 4, 2, tma_store=True),
               GemmConfig(256, 128, 4, 2, tma_store=True, store_buffers=1),
               GemmConfig(64, 256, 5, 1, tma_store=True),
               GemmConfig(64, 256, 4, 2, pingpong=True, tma_store=True),
               GemmConfig(128, 256, 4, 2, cluster_m=2, tma_store=True),
               GemmConfig(128, 96, 6, 2, tma_store=True),
               GemmConfig(64, 48, 7, 1, tma_store=True)]


def check_kernel(k, cfg):
    ops = k.sass_opcodes()
    atoms_m = cfg.wg_m // 64
    assert any(op.startswith(f"HGMMA.64x{cfg.bn}x16.F32") for op in ops), sorted(ops)
    assert k.count("UTMALDG") > 0 and k.count("USETMAXREG") == 2
    # one stmatrix.x4 per 16 columns of every 64-row atom, one TMA store per column slice
    assert k.count("STSM.16.M88.4") == k.count("STSM") == (cfg.bn // 16) * atoms_m
    assert k.count("UTMASTG") == cfg.bn // cfg.store_width
    # no register epilogue left: no global stores (STG) when the output goes through TMA
    assert k.count("STG") == 0
    assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0 and k.resources.stack_bytes == 0
    assert k.count("LDL") == 0 and k.count("STL") == 0
    assert k.resources.registers <= 65536 // k.threads
    assert not k.warnings, k.warnings
    assert k.dynamic_smem_bytes == cfg.smem_bytes(2) <= SMEM_LIMIT


@pytest.mark.parametrize("config", TMA_CONFIGS, ids=str)
def test_tma_store_configs_compile(config):
    assert config.check(2) is None
    majors = MAJORS if config.bn >= 64 else [("K", "K"), ("MN", "K")]
    for k in gemm.api.compile_configs([config], majors=majors):
        check_kernel(k, config)


@pytest.mark.parametrize("dtype,epi,batched", [
    (torch.float16, Epilogue(), False),
    (torch.bfloat16, Epilogue(has_c=True, activation="gelu_tanh", scaled=True), False),
    (torch.float16, Epilogue(has_c=True, activation="silu"), True),
    (torch.bfloat16, Epilogue(activation="relu", scaled=True), True)])
def test_tma_store_epilogues_dtypes_and_batches(dtype, epi, batched):
    for cfg in (GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True), GemmConfig(128, 256, 4, 2, tma_store=True)):
        (k,) = gemm.api.compile_configs([cfg], dtype=dtype, majors=[("MN", "K")], epilogue=epi, batched=batched)
        check_kernel(k, cfg)
        if batched:
            assert k.count("UTMASTG.3D") > 0 and k.count("UTMALDG.3D") > 0
        else:
            assert k.count("UTMASTG.2D") > 0


def test_f32_output_and_split_k_keep_the_register_epilogue():
    cfg = GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True)
    (k,) = gemm.api.compile_configs([cfg], out_dtype=torch.float32, majors=[("K", "K")])
    assert k.count("STSM") == 0 and k.count("UTMASTG") == 0 and k.count("STG") > 0
    assert GemmConfig(128, 128, 5, 2, split_k=2, tma_store=True).check(2)
    # without tma_store nothing changes: no staging, no STSM
    (k,) = gemm.api.compile_configs([GemmConfig(128, 128, 6, 2, pingpong=True)], majors=[("K", "K")])
    assert k.count("STSM") == 0 and k.count("UTMASTG") == 0 and k.dynamic_smem_bytes == 197632


def test_smem_accounting_and_rejections():
    # staging: 2 consumers x 128 rows x 64 columns x 2 slices x 2 bytes = 64 KB next to the ring
    pp = GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True)
    assert pp.staging_bytes() == 65536 and pp.smem_bytes(2) == 1024 + 5 * 256 * 128 + 65536
    assert GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True).check(2)  # 263168 bytes
    assert GemmConfig(128, 256, 4, 2, tma_store=True).staging_bytes() == 32768
    assert GemmConfig(128, 256, 5, 2, tma_store=True).check(2)
    assert GemmConfig(256, 128, 4, 2, tma_store=True).check(2)  # 2 slices of 128 rows per consumer
    assert GemmConfig(256, 128, 4, 2, tma_store=True, store_buffers=1).check(2) is None
    assert "multiple of 16" in GemmConfig(64, 24, 4, 1, tma_store=True).check(2)
    assert GemmConfig(128, 96, 4, 2, tma_store=True).store_width == 32
    assert store_box(GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True), True) == ((1, 128, 64), 128)
    assert store_box(GemmConfig(64, 48, 5, 1, tma_store=True), False) == ((64, 16), 32)
    space = gemm.config_space()
    tma = [c for c in space if c.tma_store]
    assert len(tma) > 10 and all(c.check(2) is None for c in tma)
    assert GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True) in tma


def test_every_tma_store_kind_of_the_space_compiles(config_sample):
    deepest = {}
    for cfg in gemm.config_space():
        key = (cfg.bm, cfg.bn, cfg.consumers, cfg.cluster_m, cfg.pingpong, cfg.store_buffers)
        if cfg.tma_store and (key not in deepest or cfg.stages > deepest[key].stages):
            deepest[key] = cfg
    assert len(deepest) >= 20
    for cfg in config_sample(deepest.values()):  # every kind under --run-slow
        (k,) = gemm.api.compile_configs([cfg], majors=[("K", "MN")])
        check_kernel(k, cfg)


# ---------------------------------------------------------------------------------------------- plans
def test_plans_decide_the_epilogue():
    cfg = GemmConfig(128, 128, 5, 2, pingpong=True, tma_store=True)
    a = torch.randn(333, 1024).to(torch.bfloat16)
    b = torch.randn(1024, 4096).to(torch.bfloat16)
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", cfg, False)
    assert plan.config.tma_store and plan.store_box == (128, 64) and plan.store_swizzle == 128
    assert plan.register_config == GemmConfig(128, 128, 5, 2, pingpong=True)
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", cfg, True)
    assert plan.store_box == (1, 128, 64)
    split = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", GemmConfig(
        128, 128, 5, 2, split_k=2, tma_store=True), False)
    assert split.config.split_k == 2 and not split.config.tma_store and split.store_box is None
    # launch-time decision on the output view
    assert operands.store_reason(torch.empty(1, 333, 4096, dtype=torch.bfloat16)) is None
    assert operands.store_reason(torch.empty(2, 333, 4096, dtype=torch.float16)) is None
    assert "16-bit" in operands.store_reason(torch.empty(1, 333, 4096, dtype=torch.float32))
    odd = torch.empty(333, 4097, dtype=torch.bfloat16)[:, :4096].unsqueeze(0)
    assert "16 bytes" in operands.store_reason(odd)
    assert "contiguous" in operands.store_reason(torch.empty(1, 4096, 333, dtype=torch.bfloat16).transpose(1, 2))
    assert "multiple of 16 bytes" in operands.store_reason(torch.empty(1, 8, 4104, dtype=torch.bfloat16)[..., :4097])
    assert "address" in operands.store_reason(torch.empty(8 * 4096 + 1, dtype=torch.bfloat16)[1:].view(1, 8, 4096))


def test_widened_mn_major_tiles_keep_within_shared_memory():
    """An MN-major B widens bn to whole 32-byte swizzle rows; the ring then sheds stages to fit (a swapped 128x168
    tile of 6 stages over a column-major A: the H200 refused the 128x176 launch, 234496 bytes, before)."""
    cfg = GemmConfig(128, 168, 6, 2)
    assert cfg.check(2) is None and GemmConfig(128, 176, 6, 2).check(2) is not None
    a = torch.randn(1024, 336).to(torch.bfloat16).t()  # column-major A: B of the swapped problem is MN-major
    b = torch.randn(4104, 1024).to(torch.bfloat16).t()
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", cfg, False, swap=True)
    assert plan.swap and plan.b_major == "MN" and plan.config.bn == 176
    assert plan.config.stages == 5 and plan.config.check(2, "MN") is None


@pytest.mark.parametrize("b_major", ["row", "col"])
def test_a_partial_single_wave_narrows_its_tiles_for_a_k_major_b(b_major):
    """336x4104x1024: 99 tiles of 128x128 on 132 SMs; a K-major (column-major) B takes 129 tiles of 128x96, which
    compile to HGMMA.64x96 with the TMA-store epilogue and no spills; a row-major B keeps 128x128 (a 96-wide
    MN-major tile loses the 128-byte swizzle)."""
    a = torch.randn(336, 1024).to(torch.bfloat16)
    b = torch.randn(1024, 4104).to(torch.bfloat16) if b_major == "row" else torch.randn(4104, 1024).to(
        torch.bfloat16).t()
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False)
    cfg = plan.config
    assert (cfg.bm, cfg.bn) == ((128, 96) if b_major == "col" else (128, 128))
    assert cfg.check(2) is None and plan.grid == (129 if b_major == "col" else 99)
    if b_major == "col":
        (k,) = gemm.api.compile_configs([cfg], majors=[("K", "K")])
        check_kernel(k, cfg)
    # a caller's config is kept as given
    given = GemmConfig(128, 128, 6, 2, tma_store=True, store_buffers=1)
    assert gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", given, False).config.bn == 128


@pytest.mark.parametrize("b_major", ["row", "col"])
def test_a_partial_wave_of_64_row_tiles_narrows_them_for_a_k_major_b(b_major):
    """128x6144x4096: 96 tiles of 64x128; a K-major B takes 128 tiles of 64x96 (one consumer, the deepest ring),
    a row-major B keeps 64x128."""
    a = torch.empty(128, 4096, dtype=torch.bfloat16)
    b = torch.empty(4096, 6144, dtype=torch.bfloat16) if b_major == "row" else \
        torch.empty(6144, 4096, dtype=torch.bfloat16).t()
    plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False)
    cfg = plan.config
    assert (cfg.bm, cfg.bn, cfg.consumers) == ((64, 96, 1) if b_major == "col" else (64, 128, 1))
    assert plan.grid == (128 if b_major == "col" else 96) and cfg.check(2, plan.b_major) is None
    assert cfg.stages == gemm.plan.deepest_ring(cfg, 2, plan.b_major).stages
