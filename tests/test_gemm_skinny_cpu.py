"""The skinny (decode) GEMM without a GPU: the K-permuted fragment mapping against an emulation of
mma.m16n8k16, the kernel compiling to HMMA and 16-byte streaming loads without spills for every variant, and
matmul's choice between it and the wgmma kernel."""
import itertools

import numpy as np
import pytest
import torch

import nvfly
from nvfly.ops import gemm, gemm_skinny
from nvfly.ops.gemm_skinny import SkinnyConfig


# ---------------------------------------------------------------------------------------------- index math
# PTX ISA, mma.m16n8k16 with 16-bit inputs: g = lane / 4, q = lane % 4, i = 2 * register + half
def isa_a(lane, i):
    """(row, col) of A element a_i held by ``lane``."""
    g, q = lane // 4, lane % 4
    return g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4)


def isa_b(lane, i):
    """(row k, col) of B element b_i."""
    g, q = lane // 4, lane % 4
    return 2 * q + i % 2 + 8 * (i // 2), g


def isa_c(lane, i):
    g, q = lane // 4, lane % 4
    return g + 8 * (i // 2), 2 * q + i % 2


def test_c_fragment_target_is_the_isa_layout():
    for lane, i in itertools.product(range(32), range(4)):
        assert gemm_skinny.c_fragment_target(lane, i) == isa_c(lane, i)


def test_each_lane_loads_16_contiguous_bytes_per_row():
    for lane in range(32):
        for row_half in (0, 1):
            ks = sorted(gemm_skinny.a_fragment_source(lane, r, h, s)[1]
                        for r in range(4) for h in range(2) for s in range(2)
                        if gemm_skinny.A_REGISTER_WORDS[r][0] == row_half)
            assert ks == list(range(8 * (lane % 4), 8 * (lane % 4) + 8))
        ks = sorted(gemm_skinny.b_fragment_source(lane, r, h, s)[0] for r in range(2) for h in range(2)
                    for s in range(2))
        assert ks == list(range(8 * (lane % 4), 8 * (lane % 4) + 8))


@pytest.mark.parametrize("seed", range(3))
def test_permuted_fragments_compute_the_product(seed):
    """Emulate the warp: fill each lane's registers as the kernel does, run two mma steps with the ISA's
    fragment layouts, and compare with W @ X^T over the 32-wide chunk."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 32))
    x = rng.standard_normal((8, 32))
    d = np.zeros((16, 8))
    for step in range(2):
        a_mat = np.full((16, 16), np.nan)
        b_mat = np.full((16, 8), np.nan)
        for lane in range(32):
            for register, half in itertools.product(range(4), range(2)):
                row, k = gemm_skinny.a_fragment_source(lane, register, half, step)
                r, col = isa_a(lane, 2 * register + half)
                assert np.isnan(a_mat[r, col])
                a_mat[r, col] = w[row, k]
            for register, half in itertools.product(range(2), range(2)):
                k, token = gemm_skinny.b_fragment_source(lane, register, half, step)
                kk, col = isa_b(lane, 2 * register + half)
                assert np.isnan(b_mat[kk, col])
                b_mat[kk, col] = x[token, k]
        assert not np.isnan(a_mat).any() and not np.isnan(b_mat).any()
        d += a_mat @ b_mat
    result = np.zeros((16, 8))
    for lane, i in itertools.product(range(32), range(4)):
        row, token = gemm_skinny.c_fragment_target(lane, i)
        result[row, token] = d[isa_c(lane, i)]
    np.testing.assert_allclose(result, w @ x.T, rtol=1e-12, atol=1e-12)


def test_a_wrong_mapping_is_caught(monkeypatch):
    """The emulation can fail: B registers taken in the other order no longer pair k with k."""
    monkeypatch.setattr(gemm_skinny, "B_REGISTER_WORDS", (1, 0))
    with pytest.raises(AssertionError):
        test_permuted_fragments_compute_the_product(0)


# ---------------------------------------------------------------------------------------------- compilation
def check_sass(kernel, m, config=SkinnyConfig()):
    ops = kernel.sass_opcodes()
    hmma = sum(n for op, n in ops.items() if op.startswith("HMMA.16816.F32"))
    assert hmma > 0, sorted(ops)
    # the streamed weight: 16-byte loads that bypass L1
    assert sum(n for op, n in ops.items() if op.startswith("LDG.E.NA") and ".128" in op) >= 8, sorted(ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops), sorted(ops)
    r = kernel.resources
    assert r.spill_stores == 0 and r.spill_loads == 0 and r.stack_bytes == 0
    assert r.registers <= 128  # 16 warps per SM at least: occupancy keeps the weight loads in flight
    assert not kernel.warnings, kernel.warnings
    # two k16 steps per chunk and token tile, in the unrolled loop and the remainder loop
    tiles = -(-m // 8)
    assert hmma >= 2 * tiles * (config.unroll + 1)


@pytest.mark.parametrize("dtype", [nvfly.bf16, nvfly.f16])
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("epilogue", ["plain", "bias_gelu_f32", "scaled_silu"])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_compiles_without_spills(dtype, m, epilogue, splits):
    options = {"plain": {}, "bias_gelu_f32": dict(has_c=True, activation="gelu_tanh", out_dtype=nvfly.f32),
               "scaled_silu": dict(scaled=True, activation="silu", has_c=True)}[epilogue]
    kernel = gemm_skinny.compile_kernel(m, dtype=dtype, config=SkinnyConfig(splits=splits), **options)
    check_sass(kernel, m)
    hmma = {op for op in kernel.sass_opcodes() if op.startswith("HMMA")}
    assert hmma == ({"HMMA.16816.F32.BF16"} if dtype == nvfly.bf16 else {"HMMA.16816.F32"})  # f16 has no suffix
    # split K: partial sums go out with atomics, and one arrival per CTA
    assert (kernel.count("REDG") > 0 and kernel.count("ATOMG") > 0) == (splits > 1)


@pytest.mark.parametrize("m,config", [(16, SkinnyConfig(4, 2)), (1, SkinnyConfig(8, 8)), (16, SkinnyConfig(16, 4, 2)),
                                      (8, SkinnyConfig(2, 4, 3))])
def test_other_configs_compile(m, config):
    check_sass(gemm_skinny.compile_kernel(m, config=config), m, config)


def test_strided_tokens_compile():
    kernel = gemm_skinny.compile_kernel(7, x_contiguous=False)
    assert kernel.count("HMMA") > 0 and kernel.resources.spill_stores == 0


# ---------------------------------------------------------------------------------------------- planning
def weight(n, k, major):
    """A [K, N] B operand: 'col' is the F.linear weight (W [N, K] row-major, transposed)."""
    return torch.randn(n, k).to(torch.bfloat16).t() if major == "col" else torch.randn(k, n).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 7, 16, 17, 64])
@pytest.mark.parametrize("major", ["col", "row"])
def test_skinny_path_for_small_m_and_column_major_b(m, major):
    a = torch.randn(m, 4096).to(torch.bfloat16)
    b = weight(4096, 4096, major)
    assert gemm._skinny_wanted(a, b, None, None) == (m <= gemm.SKINNY_MAX_M and major == "col")
    assert not gemm._skinny_wanted(a, b, None, False)
    assert not gemm._skinny_wanted(a, b, gemm.GemmConfig(), None)
    if major == "col" and m <= gemm_skinny.MAX_M:
        assert gemm._skinny_wanted(a, b, SkinnyConfig(), None) and gemm._skinny_wanted(a, b, None, True)
    else:
        with pytest.raises(ValueError, match="skinny"):
            gemm._skinny_wanted(a, b, None, True)


def test_unaligned_weight_rows_are_declined():
    b = torch.randn(64, 1028).to(torch.bfloat16)[:, :1020].t()  # row stride 1028: 8-byte rows only
    assert "16-byte" in gemm_skinny.reason(torch.randn(1, 1020).to(torch.bfloat16), b)
    padded = torch.randn(64, 1024).to(torch.bfloat16)[:, :1023].t()  # K tail, 16-byte aligned rows
    assert gemm_skinny.reason(torch.randn(1, 1023).to(torch.bfloat16), padded) is None


@pytest.mark.parametrize("mnk", [(1, 4096, 4096), (16, 4096, 14336), (8, 33, 4104), (1, 1, 8), (16, 4097, 1023)])
def test_plans_cover_k_exactly(mnk):
    m, n, k = mnk
    plan = gemm_skinny.make_plan(m, n, k, 1, False, "none", False, None, 132)
    cfg = plan.config
    full = k // gemm_skinny.CHUNK_K
    assert plan.chunks_per_split % cfg.unroll == 0
    assert (cfg.splits - 1) * plan.chunks_per_split < max(full, 1) <= cfg.splits * plan.chunks_per_split
    assert plan.grid == (-(-n // 16) * cfg.splits, 1, 1) and plan.m_tiles == -(-m // 8)
    assert plan.tiles == -(-n // 16)


def test_few_column_groups_split_k_up_to_one_wave():
    sms = 132
    for n, k in ((4096, 4096), (4096, 14336), (1024, 4096), (33, 4104), (65536, 4096), (1, 8)):
        cfg = gemm_skinny.default_config(n, k, 1, sms)
        ctas = -(-n // 16) * cfg.splits
        assert cfg.splits == 1 or ctas <= gemm_skinny.TARGET_CTAS_PER_SM * sms, (n, k, cfg)
    assert gemm_skinny.default_config(1024, 4096, 1, sms).splits == 2  # 64 groups, 128 chunks
    assert gemm_skinny.default_config(33, 4104, 1, sms).splits > 1
    assert gemm_skinny.default_config(65536, 4096, 1, sms).splits == 1
