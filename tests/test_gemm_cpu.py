"""The GEMM without a GPU: every config compiles to HGMMA/UTMALDG code within its register budget, plans and
TMA descriptors are consistent for every operand major-ness and shape class, and inputs are declined with
reasons."""
import itertools
import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nvfly
from nvfly.arch.memory import L2Policy
from nvfly.ops import gemm
from nvfly.ops.common import operands
from nvfly.ops.gemm.config import REDUCE_THREADS, SMEM_LIMIT, Epilogue, GemmConfig
from nvfly.ops.gemm.kernel import split_k_reduce_kernel
from nvfly.runtime.torch_args import vector_width

CONFIGS = [GemmConfig(128, 256, 4, 2), GemmConfig(256, 128, 4, 2), GemmConfig(128, 128, 6, 2),
           GemmConfig(64, 256, 4, 1), GemmConfig(64, 16, 7, 1, split_k=4), GemmConfig(128, 64, 7, 2, group_m=16),
           GemmConfig(128, 256, 4, 2, cluster_m=2), GemmConfig(128, 128, 6, 2, pingpong=True)]
MAJORS = list(itertools.product(["K", "MN"], ["K", "MN"]))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_configs_compile_to_hopper_instructions(config):
    for k in gemm.api.compile_configs([config], majors=MAJORS if config.bn >= 64 else [("K", "K"), ("MN", "K")]):
        ops = k.sass_opcodes()
        assert any(op.startswith(f"HGMMA.64x{config.bn}x16.F32.BF16") for op in ops), sorted(ops)
        assert k.count("UTMALDG") > 0 and k.count("USETMAXREG") == 2
        assert (k.count("UTMALDG.2D.MULTICAST") > 0) == (config.cluster_m > 1)
        assert k.resources.spill_stores == 0 and k.resources.stack_bytes == 0
        assert k.resources.registers <= 65536 // k.threads
        assert not k.warnings, k.warnings  # no serialised wgmma (C7515/C7520), setmaxnreg honoured (C7508)
        assert k.dynamic_smem_bytes == config.smem_bytes(2)


@pytest.mark.parametrize("config", [GemmConfig(128, 128, 6, 2, pingpong=True, tma_store=True, store_buffers=1),
                                    GemmConfig(128, 256, 4, 2, tma_store=True, store_buffers=1),
                                    GemmConfig(64, 64, 8, 1)], ids=str)
def test_stream_k_configs_compile_without_spills(config):
    """With the stream-K fix-up (workspace adds, the arrival count, the last part's sums read back in a branch):
    no spills or stack, registers in budget, the vector reductions in the SASS."""
    for k in gemm.api.compile_configs([config], majors=[("K", "MN"), ("MN", "K")], stream_k=True):
        assert k.resources.spill_stores == 0 and k.resources.stack_bytes == 0, k.resources
        assert k.resources.registers <= 65536 // k.threads
        assert not k.warnings, k.warnings
        assert "red.relaxed.gpu.global.add.v4.f32" in k.ptx and k.count("REDG") > 0


def test_every_tile_shape_of_the_space_compiles(config_sample):
    deepest = {}
    for cfg in gemm.config_space():
        key = (cfg.bm, cfg.bn, cfg.consumers, cfg.cluster_m, cfg.pingpong)
        if key not in deepest or cfg.stages > deepest[key].stages:
            deepest[key] = cfg
    for cfg in config_sample(deepest.values()):  # every tile shape under --run-slow
        (k,) = gemm.api.compile_configs([cfg], majors=[("K", "MN" if cfg.check(2, "MN") is None else "K")])
        assert k.count("HGMMA") > 0 and k.resources.spill_stores == 0, cfg
        assert not k.warnings, (cfg, k.warnings)


def test_config_space_is_valid_and_broad():
    space = gemm.config_space()
    assert len(space) > 50
    assert all(c.check(2) is None for c in space)
    assert GemmConfig(256, 256, 4, 2).check(2) and GemmConfig(128, 256, 5, 2).check(2)  # too big


def make(m, n, k, a_major, b_major):
    """Operands of each major, without values: plans read only shapes and strides (and filling 470 MB of weights
    with random numbers takes seconds)."""
    a = torch.empty(m, k, dtype=torch.bfloat16) if a_major == "row" else torch.empty(k, m, dtype=torch.bfloat16).t()
    b = torch.empty(k, n, dtype=torch.bfloat16) if b_major == "row" else torch.empty(n, k, dtype=torch.bfloat16).t()
    return a, b


@pytest.mark.parametrize("mnk", [(4096, 4096, 4096), (16, 4096, 4096), (1, 4096, 4096), (128, 8192, 8192),
                                 (64, 6144, 4096), (8, 2112, 7168), (333, 520, 1000), (2048, 24576, 1536)])
@pytest.mark.parametrize("majors", list(itertools.product(["row", "col"], ["row", "col"])))
def test_plans_and_descriptors_for_every_layout(mnk, majors):
    m, n, k = mnk
    a, b = make(m, n, k, *majors)
    if operands.tma_reason("A", a, -1 if majors[0] == "row" else -2) or \
            operands.tma_reason("B", b, -2 if majors[1] == "col" else -1):
        pytest.skip("a stride TMA cannot express: declined by eligibility")
    a3, b3 = a.unsqueeze(0), b.unsqueeze(0)
    plan = gemm.plan.make_plan(a3, b3, False, "none", None, False)
    assert plan.config.check(2) is None
    token_tile = gemm.plan.token_tile_config(m, n, k, 1, 2, 132, "K" if majors[1] == "col" else "MN")
    assert plan.swap == (m <= 64 < n and token_tile is None)
    if plan.swap:
        a3, b3 = b3.transpose(-1, -2), a3.transpose(-1, -2)
    a_desc, b_desc = gemm.api._descriptors(plan, a3, b3, False)
    assert a_desc.info.box[-1] * 2 == a_desc.info.swizzle or a_desc.info.swizzle == 128
    tiles = -(-plan.m // plan.config.bm) * -(-plan.n // plan.config.bn) * plan.config.split_k
    assert plan.grid == min(tiles, 132)
    assert (plan.config.split_k > 1) == (plan.reduce_epilogue is not None)


def test_heuristic_prefers_big_tiles_and_splits_long_k():
    # big problems take a tile of the tuned table (TILES), at least 128x128, without a K split and with the TMA-store
    # epilogue, that fits shared memory and the accumulator registers (which tile wins is tuned: not pinned here)
    for k in (8192, 2048):
        big = gemm.plan.default_config(8192, 8192, k)
        assert big in [cfg for cfg, _ in gemm.plan.TILES] and big.bm * big.bn >= 128 * 128, big
        assert big.split_k == 1 and big.tma_store and big.check(2) is None, big
    assert gemm.plan.default_config(2048, 2112, 7168).bn == 128  # 9 x 16 = 144 tiles of 128x256: 2 waves
    # 68 tiles of 128x128 on 132 SMs: 128x64 fills the wave (132 tiles)
    half = gemm.plan.default_config(512, 2112, 7168)
    assert (half.bm, half.bn, half.split_k) == (128, 64, 1) and half.check(2) is None
    # every default config fits shared memory with its staging buffers (128x64 at 9 stages plus the TMA-store
    # staging did not: 238592 bytes)
    for m in (128, 336, 512, 1024, 2048, 4096):
        for n, k in [(2112, 7168), (4104, 1024), (6144, 4096), (7168, 16384), (24576, 1536), (32768, 512)]:
            assert gemm.plan.default_config(m, n, k).check(2) is None, (m, n, k)
            assert gemm.plan.small_m_config(m, n, k, 1, 2, 132).check(2) is None, (m, n, k)
    small = gemm.plan.default_config(128, 1024, 16384)
    assert small.split_k > 1 and small.check(2) is None
    swapped = gemm.plan.small_m_config(16, 4096, 4096, 1, 2, 132)
    assert swapped.bn == 16


def test_eligibility_reasons_on_cpu():
    a, b = make(64, 64, 64, "row", "row")
    assert gemm.eligibility(a, b) == "a is on cpu, not CUDA"
    odd = torch.randn(64, 1023).to(torch.bfloat16)
    assert "16 bytes" in operands.tma_reason("A", odd, -1)


@pytest.mark.parametrize("m", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("b_major", ["row", "col"])
def test_column_major_tokens_take_the_skinny_kernel_up_to_one_token_tile(m, b_major):
    """Column-major A (x.t()) with a row-major B runs the skinny kernel up to SKINNY_MAX_M_COLUMN_TOKENS tokens and
    the wgmma kernel above; with a column-major B up to SKINNY_MAX_M, with row-major A and B up to
    SKINNY_MAX_M_ROW_B. M = 1 is K-contiguous."""
    a_col = torch.randn(4096, m).to(torch.bfloat16).t()
    a_row = torch.randn(m, 4096).to(torch.bfloat16)
    b = torch.randn(4096, 4096).to(torch.bfloat16)
    b = b.t() if b_major == "col" else b
    row_limit = gemm.plan.SKINNY_MAX_M if b_major == "col" else gemm.plan.SKINNY_MAX_M_ROW_B
    limit = gemm.plan.SKINNY_MAX_M_COLUMN_TOKENS if m > 1 and b_major == "row" else row_limit
    assert gemm.plan.skinny_wanted(a_col, b, None, None) == (m <= limit)
    assert gemm.plan.skinny_wanted(a_row, b, None, None) == (m <= row_limit)
    assert gemm.plan.SKINNY_MAX_M_ROW_B < gemm.plan.SKINNY_MAX_M_COLUMN_TOKENS < gemm.plan.SKINNY_MAX_M


@pytest.mark.parametrize("a_major", ["row", "col"])
def test_short_k_takes_the_skinny_kernel_only_up_to_8_tokens(a_major):
    """With a column-major B and K under SKINNY_SHORT_K the skinny kernel runs up to SKINNY_MAX_M_SHORT_K tokens
    (the wgmma kernel wins at 16 there); from SKINNY_SHORT_K on, up to SKINNY_MAX_M."""
    for m, k, want in [(16, 512, False), (9, 512, False), (8, 512, True), (16, 1024, True), (16, 4096, True)]:
        a = torch.randn(m, k).to(torch.bfloat16) if a_major == "row" else torch.randn(k, m).to(torch.bfloat16).t()
        b = torch.randn(32768, k).to(torch.bfloat16).t()
        assert gemm.plan.skinny_wanted(a, b, None, None) == want, (m, k)


def test_wave_fit_takes_the_width_that_fills_the_waves():
    """A few waves of 128-row tiles take the width that minimises waves x (128 + width), a config that compiles
    and fits: 512x7168x16384 112 tiles of 128x256 -> 128 of 128x224, 512x6144x4096 -> 128 of 128x192,
    512x10240x8192 320 ping-pong tiles -> 256 of 128x160; whole waves of 128x256 (2048x4096x14336: 2 x 128) and
    many waves keep their tile, as does short K's ping-pong tile in well-filled waves (512x8192x1024)."""
    for (m, n, k), width in [((512, 7168, 16384), 224), ((512, 6144, 4096), 192), ((512, 10240, 8192), 160),
                             ((336, 7168, 2048), 192)]:
        cfg = gemm.plan.default_config(m, n, k)
        assert (cfg.bm, cfg.bn, cfg.pingpong) == (128, width, False) and cfg.check(2) is None, (m, n, k, cfg)
    for m, n, k in [(2048, 4096, 14336), (4096, 14336, 4096), (4096, 10240, 8192)]:
        assert (gemm.plan.default_config(m, n, k).bm, gemm.plan.default_config(m, n, k).bn) == (128, 256)
    assert gemm.plan.default_config(512, 8192, 1024).pingpong  # short K, 256 tiles: 97% of two waves
    assert not gemm.plan.default_config(336, 8192, 1024).pingpong  # short K, 192 tiles: 73%


def test_the_autotune_space_holds_every_heuristic_pick():
    """The heuristic's config of every suite-like shape and B major is in ``config_space`` (split K and the L2 load
    hints aside: the space lists whole-K configs, and the hints follow the call's operand sizes), so autotuning over
    the space can always find the tile the heuristic runs."""
    space = set(gemm.config_space())
    for m in (64, 128, 256, 336, 384, 512, 1024, 2048, 4096, 16384):
        for n, k in [(6144, 4096), (4096, 14336), (10240, 8192), (2112, 7168), (24576, 1536), (32768, 512),
                     (7168, 16384), (4104, 1024), (14336, 4096), (28672, 8192)]:
            for b_major in ("row", "col"):
                a = torch.empty(m, k, dtype=torch.bfloat16)
                b = torch.empty(k, n, dtype=torch.bfloat16) if b_major == "row" else \
                    torch.empty(n, k, dtype=torch.bfloat16).t()
                cfg = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False).config
                if cfg.split_k == 1:
                    assert replace(cfg, stream_a=False, stream_b=False) in space, (m, n, k, b_major, cfg)


@settings(max_examples=300, deadline=None)
@given(m=st.integers(1, 20000), n=st.integers(1, 60000), k=st.integers(1, 30000), batches=st.sampled_from([1, 2, 7]),
       a_major=st.sampled_from(["row", "col"]), b_major=st.sampled_from(["row", "col"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16]))
def test_every_heuristic_plan_fits_the_hardware(m, n, k, batches, a_major, b_major, dtype):
    """Whatever shape and majors, the plan the heuristic makes (tile choice, wave filling, swap, widening for an
    MN-major B, split K, stream K) is a config that compiles and fits shared memory, on a grid of at most one block
    per SM. (Two smem overflows of today's heuristic changes were first seen on the GPU.)"""
    # strides TMA can express: 16-byte aligned rows of each operand's contiguous dimension
    m, n, k = (8 * math.ceil(v / 8) for v in (m, n, k))
    a = torch.empty(batches, k, m, dtype=dtype).transpose(1, 2) if a_major == "col" else \
        torch.empty(batches, m, k, dtype=dtype)
    b = torch.empty(batches, n, k, dtype=dtype).transpose(1, 2) if b_major == "col" else \
        torch.empty(batches, k, n, dtype=dtype)
    plan = gemm.plan.make_plan(a, b, False, "none", None, batches > 1)
    cfg = plan.config
    assert cfg.check(2, plan.b_major) is None, (cfg, plan.b_major)
    assert cfg.smem_bytes(2) <= SMEM_LIMIT
    assert 1 <= plan.grid <= 132


def test_benchmark_named_tiles():
    """benchmarks.gemm_configs --tiles names: 128- and 256-row tiles get two consumers, 64-row tiles one; split K
    and swap parse; an impossible tile says why."""
    from benchmarks.gemm_configs import named_tile
    cfg, swap = named_tile("256x128")
    assert (cfg.bm, cfg.bn, cfg.consumers, swap) == (256, 128, 2, False) and cfg.check(2) is None
    cfg, swap = named_tile("swap:64x32k2")
    assert (cfg.bm, cfg.bn, cfg.consumers, cfg.split_k, swap) == (64, 32, 1, 2, True)
    assert named_tile("128x160")[0].tma_store and named_tile("128x128pp")[0].pingpong
    with pytest.raises(ValueError, match="accumulator registers"):
        named_tile("256x192")
    cfg, swap = named_tile("swap:128x64c2s14")
    assert (cfg.bm, cfg.bn, cfg.cluster_m, swap) == (128, 64, 2, True) and cfg.stages > 7
    with pytest.raises(ValueError, match="expected"):
        named_tile("128x64q")


def test_two_block_clusters_split_narrow_b_tiles():
    """cluster_m=2: each block loads half of the B tile and multicasts it, so any bn of whole 8-row swizzle atoms
    (K-major B) or of whole 32-byte swizzle rows (MN-major: a 64-wide tile's 32-column halves take the 64-byte
    swizzle); a config the call's B cannot take is declined with the reason."""
    narrow = gemm.plan.deepest_ring(GemmConfig(128, 64, 9, 2, cluster_m=2), 2)
    assert narrow.check(2, "K") is None and narrow.check(2, "MN") is None
    assert GemmConfig(64, 112, 9, 1, cluster_m=2).check(2, "K") is None
    assert "cluster_m=2" in GemmConfig(64, 112, 9, 1, cluster_m=2).check(2, "MN")  # halves of 56 columns
    assert "cluster_m=2" in GemmConfig(128, 8, 9, 2, cluster_m=2).check(2, "K")
    assert gemm.plan.operand_box(64, 64, nvfly.bf16, "MN", 2, 2)[1] == 64
    assert gemm.plan.operand_box(64, 64, nvfly.bf16, "MN", 2)[1] == 128
    for k in gemm.api.compile_configs([narrow], majors=[("K", "K"), ("K", "MN")]):
        assert k.count("UTMALDG.2D.MULTICAST") > 0 and k.resources.spill_stores == 0, k.summary()
    a, b = make(128, 7168, 256, "col", "row")  # B row-major: MN-major
    with pytest.raises(ValueError, match="cluster_m=2 with bn=112.*MN-major here"):
        gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", GemmConfig(64, 112, 9, 1, cluster_m=2),
                            False)
    with pytest.raises(ValueError, match="skip_empty: only the grouped kernel"):  # a grouped kernel's option
        gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none",
                            GemmConfig(128, 128, 6, 2, skip_empty=True), False)


def test_benchmark_reruns_the_rows_under_a_ratio(tmp_path):
    """benchmarks.gemm --rerun-below: the (shape, layout) rows of a results file under the ratio, in file order."""
    import json
    from benchmarks.gemm import rerun_cases
    rows = [{"M": 64, "N": 4096, "K": 4096, "layout": "rowxcol", "vs_cublas": 0.85},
            {"M": 512, "N": 6144, "K": 4096, "layout": "colxrow", "vs_cublas": 1.01},
            {"M": 16, "N": 2112, "K": 7168, "layout": "rowxrow", "vs_cublas": 0.76}]
    path = tmp_path / "gemm_full_h200.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows}))
    assert rerun_cases(str(path), 0.9) == [(0, (64, 4096, 4096), ("row", "col")), (2, (16, 2112, 7168), ("row", "row"))]
    assert rerun_cases(str(path), 0.5) == []


@pytest.mark.parametrize("vec,out_dtype,epi", [
    (8, nvfly.bf16, Epilogue()), (4, nvfly.f16, Epilogue(has_c=True, scaled=True, activation="silu")),
    (8, nvfly.f32, Epilogue(activation="gelu_tanh")), (4, nvfly.f32, Epilogue()), (1, nvfly.bf16, Epilogue(scaled=True))])
def test_split_k_reduce_reads_and_writes_whole_vectors(vec, out_dtype, epi):
    """The split-K reduce moves vec elements of a row per thread in 16-byte (or narrower whole-vector) accesses:
    vec f32 partials of each split in 128-bit loads, the outputs in one store (no scalar splitting)."""
    from nvfly.runtime.torch_args import TensorDesc
    splits, m, n = 3, 64, 4096
    partials = TensorDesc(nvfly.f32, (splits, m, n))
    out = TensorDesc(out_dtype, (1, m, n))
    c_in = TensorDesc(out_dtype, (1, m, n)) if epi.has_c else None
    k = split_k_reduce_kernel.compile(partials, out, c_in, m, n, 1.0, 0.0, SPLITS=splits, EPI=epi, VEC=vec,
                                      block=REDUCE_THREADS, target="sm_90a")
    ops = k.sass_opcodes()
    wide_loads = sum(ops[op] for op in ops if op.startswith("LDG.E.128"))
    assert wide_loads == splits * vec // 4, sorted(ops)
    store_bits = vec * out_dtype.itemsize * 8
    stores = sum(ops[op] for op in ops if op.startswith("STG"))
    assert stores == max(1, store_bits // 128), sorted(ops)
    assert k.resources.spill_stores == 0 and k.count("LDL") == 0


def test_reduce_vector_widths():
    """The split-K reduce's width (vector_width of its output; None: a new contiguous one)."""
    assert vector_width(4096, (None,), 2) == 8
    assert vector_width(4100, (None,), 2) == 4
    assert vector_width(4098, (None,), 2) == 2
    assert vector_width(4097, (None,), 2) == 1
    assert vector_width(4096, (torch.empty(64, 4100, dtype=torch.bfloat16)[:, :4096],), 2) == 4  # rows 4100 apart
    eight_byte_aligned = torch.empty(64 * 4096 + 4, dtype=torch.bfloat16)[4:].view(64, 4096)
    assert vector_width(4096, (eight_byte_aligned,), 2) == 4
    batched = torch.empty(3, 64, 4096 + 8, dtype=torch.bfloat16)  # a batched output: every row start counts
    assert vector_width(4096, (batched[:, :, :4096],), 2) == 8 and vector_width(4096, (batched[:, :, 1:4097],), 2) == 1


@pytest.mark.parametrize("majors", list(itertools.product(["row", "col"], ["row", "col"])))
def test_token_tile_takes_one_wave_of_64_rows(majors):
    """48 < M <= 64 runs unswapped 64-row tiles as narrow as one wave of at least 80% of the SMs allows (widths of
    16, of 32 with an MN-major B), with the TMA-store epilogue and no K split; too few tiles, more than one wave of
    the widest, fewer tokens, or a short K the swapped tiles split keep the swapped plan."""
    k_major_b = majors[1] == "col"
    for m, n, k, width in [(64, 4096, 4096, 32), (56, 4096, 7168, 32), (64, 4104, 14336, 32),
                           (64, 10240, 8192, 80 if k_major_b else 96), (64, 32768, 512, 256),
                           (64, 28672, 4096, 224), (64, 24576, 1536, 192), (64, 7168, 2048, 64)]:
        a, b = make(m, n, k, *majors)
        plan = gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False)
        assert not plan.swap and (plan.config.bm, plan.config.bn, plan.config.split_k) == (64, width, 1), (m, n, k)
        assert plan.config.tma_store and plan.config.check(2, plan.b_major) is None
        assert plan.config == gemm.plan.deepest_ring(plan.config, 2, plan.b_major)
        assert plan.reduce_epilogue is None and 0.8 * 132 <= plan.grid == -(-n // width) <= 132
    swapped = [(64, 2112, 7168), (48, 4096, 4096), (64, 4096, 1024), (64, 57344, 8192)]
    for m, n, k in swapped + ([] if k_major_b else [(64, 6144, 4096)]):  # MN-major: 96 tiles of 64
        a, b = make(m, n, k, *majors)
        assert gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False).swap, (m, n, k)


def test_weights_read_once_between_one_and_eight_l2s_are_hinted():
    """stream_hints marks the operand one row of tiles reads once (the weights of small M, B unswapped and A
    swapped) when it spans [1, 8) L2s; smaller or larger weights, operands re-read and a caller's config stay
    unhinted; the hinted loads carry .L2::cache_hint (the weights evict_first, the tokens evict_last)."""
    l2 = 50 << 20
    token = gemm.plan.token_tile_config(64, 10240, 8192, 1, 2, 132)
    assert gemm.plan.stream_hints(token, 64, 10240, 8192, 1, 2, l2) == replace(token, stream_b=True)  # 160 MiB
    assert gemm.plan.stream_hints(token, 64, 32768, 512, 1, 2, l2) == token  # 32 MiB: may stay in L2
    assert gemm.plan.stream_hints(token, 64, 57344, 8192, 1, 2, l2) == token  # 896 MiB: 18 L2s
    swapped = gemm.plan.small_m_config(16, 4096, 14336, 1, 2, 132)  # the swapped problem is 4096 x 16
    assert gemm.plan.stream_hints(swapped, 4096, 16, 14336, 1, 2, l2) == replace(swapped, stream_a=True)
    big = gemm.plan.default_config(4096, 10240, 8192)
    assert gemm.plan.stream_hints(big, 4096, 10240, 8192, 1, 2, l2) == big  # B re-read by 32 rows of tiles
    a, b = make(64, 10240, 8192, "row", "col")
    assert gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", None, False).config.stream_b
    assert not gemm.plan.make_plan(a.unsqueeze(0), b.unsqueeze(0), False, "none", token, False).config.stream_b
    assert replace(token, stream_a=True, stream_b=True).check(2) is not None
    (hinted,) = gemm.api.compile_configs([replace(token, stream_b=True)], majors=[("K", "K")])
    (plain,) = gemm.api.compile_configs([token], majors=[("K", "K")])
    loads = [line for line in hinted.ptx.splitlines() if "cp.async.bulk.tensor" in line and "global.mbarrier" in line]
    assert loads and all(".L2::cache_hint" in line for line in loads)
    # the 64-bit policies, in decimal
    assert str(L2Policy.EVICT_FIRST.descriptor) in hinted.ptx and str(L2Policy.EVICT_LAST.descriptor) in hinted.ptx
    assert ".L2::cache_hint" not in plain.ptx and hinted.count("UTMALDG") > 0
    assert not hinted.warnings and hinted.resources.spill_stores == 0
