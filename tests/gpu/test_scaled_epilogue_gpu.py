"""The scaled GEMM's TMA-store epilogue (the heuristic's 128-row tiles with 16-bit outputs) against the float32 GEMM
of the dequantised operands and against the register epilogue of the same tile (the same fp32 math, so the same
values to a bf16 ulp): every fp32 recipe, promoted and fast, bias, bf16 and fp16, tails in M, N and K, outputs TMA cannot store
(misaligned: the register epilogue instead) and row-padded ones it can; the split-K alternative at M = 128; stream
K. Fresh random inputs, NaN-poisoned outputs."""
from dataclasses import replace

import pytest
import torch

from nvfly.ops import scaled
from nvfly.ops.scaled import ScaledConfig, ScaledEpilogue
from nvfly.ops.scaled.plan import make_plan
from tests.gpu.test_scaled_gpu import TOL, operands, poisoned, rel_error

pytestmark = pytest.mark.gpu


def registers(config: ScaledConfig) -> ScaledConfig:
    return replace(config, tma_store=False)


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
def test_tma_store_matches_the_reference_and_the_register_epilogue(hopper, scaling):
    """M, N and K all with tails (300 = 2 x 128 + 44 rows, 400 = 3 x 128 + 16 = 2 x 192 + 16 columns, K = 1040 =
    8 x 128 + 16), a bias for row and block scales; the heuristic's plan (a 128 x 64 TMA-store tile here, also with
    fp16 outputs) and explicit TMA-store tiles (128 x 128, 128 x 192, issuing ahead; 128 x 256 accumulating fast),
    each but the last two next to the same tile storing through registers (the same values, to a bf16 ulp)."""
    m, n, k = 300, 400, 1040
    a, b, sa, sb = operands(m, n, k, scaling)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16) if scaling in ("row", "block") else None
    ref = scaled.reference(a, b, sa, sb, bias)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heuristic = make_plan(m, n, k, ScaledEpilogue(scaling, True, bias is not None), None, None, sms).config
    assert heuristic.tma_store and "TMA-store epilogue" in scaled.path(a, b, sa, sb, bias=bias)
    twins = [(heuristic, False), (ScaledConfig(128, 128, 6, 2, tma_store=True), False)]
    alone = []
    if scaling in ("tensor", "row"):  # promoted 64 x 192 per consumer; fast accumulation
        twins += [(ScaledConfig(128, 192, 5, 2, tma_store=True), False), (heuristic, True)]
        alone.append((ScaledConfig(128, 256, 4, 2, tma_store=True), True))
    if scaling != "block1x128":
        alone.append((ScaledConfig(128, 128, 6, 2, issue_ahead=True, tma_store=True), False))
    for config, fast in twins + alone:
        out = poisoned(m, n, torch.bfloat16)
        scaled.scaled_mm(a, b, sa, sb, bias=bias, out=out, config=config, use_fast_accum=fast)
        assert rel_error(out, ref) < TOL[torch.bfloat16] * (2 if fast else 1), (config, fast)
        assert "TMA-store epilogue" in scaled.path(a, b, sa, sb, bias=bias, config=config, use_fast_accum=fast)
        if (config, fast) in twins:
            through_registers = poisoned(m, n, torch.bfloat16)
            scaled.scaled_mm(a, b, sa, sb, bias=bias, out=through_registers, config=registers(config),
                             use_fast_accum=fast)
            # the same fp32 operations, one rounding to bf16 (ptxas may fuse a multiply-add differently: 1 ulp)
            torch.testing.assert_close(out.float(), through_registers.float(), rtol=2 ** -7, atol=0,
                                       msg=lambda text: f"{config} fast={fast}: {text}")
    fp16 = poisoned(m, n, torch.float16)
    scaled.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float16, out=fp16)
    assert rel_error(fp16, ref) < TOL[torch.float16]


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_outputs_tma_cannot_store_go_through_registers(hopper, scaling):
    """An output 4 bytes past a 16-byte boundary (TMA cannot describe it): the register epilogue writes it; a
    row-padded one (row stride n + 64): TMA stores it, leaving the padding untouched; f32 outputs: registers."""
    m, n, k = 260, 384, 640
    a, b, sa, sb = operands(m, n, k, scaling)
    ref = scaled.reference(a, b, sa, sb)
    wide = torch.full((m, n + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    for out in (wide[:, 2:n + 2], wide[:, :n]):
        out.fill_(float("nan"))
        scaled.scaled_mm(a, b, sa, sb, out=out)
        assert rel_error(out, ref) < TOL[torch.bfloat16]
    assert wide[:, n + 2:].isnan().all(), "a store wrote past the output's columns"
    f32 = poisoned(m, n, torch.float32)
    scaled.scaled_mm(a, b, sa, sb, out_dtype=torch.float32, out=f32)
    assert rel_error(f32, ref) < TOL[torch.float32]
    assert "TMA-store" not in scaled.path(a, b, sa, sb, out_dtype=torch.float32)


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_split_k_alternative_at_128_rows(hopper, scaling):
    """The benchmark's M = 128 alternative (128 x 128 tiles, K split in two: f32 partials, then the reduce kernel)
    and the heuristic's 128 x 64 TMA-store tile, on a 128 x 2048 x 4096 problem."""
    m, n, k = 128, 2048, 4096
    a, b, sa, sb = operands(m, n, k, scaling)
    ref = scaled.reference(a, b, sa, sb)
    for config in (None, ScaledConfig(128, 128, 7, 2, split_k=2)):
        out = poisoned(m, n, torch.bfloat16)
        scaled.scaled_mm(a, b, sa, sb, out=out, config=config)
        assert rel_error(out, ref) < TOL[torch.bfloat16], config


@pytest.mark.parametrize("scaling", ["tensor", "row", "block", "block1x128"])
def test_stream_k(hopper, scaling):
    """ScaledConfig.stream_k: tiles shared by several blocks' k ranges, summed in the workspace by the dense GEMM's
    fix-up, then scaled and stored (TMA and registers); tails in M, N and K, a bias; twice per signature (the
    workspace and counts are zero again after each launch); M = 128's single wave of 128 x 128 tiles."""
    for m, n, k in ((300, 400, 1040), (256, 512, 4096), (128, 2048, 4096)):
        a, b, sa, sb = operands(m, n, k, scaling)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        ref = scaled.reference(a, b, sa, sb, bias)
        # the TMA-store epilogue for tensor-wise and block scales, the register one for the others
        tma = scaling in ("tensor", "block")
        for config in (ScaledConfig(128, 128, 6, 2, tma_store=True, stream_k=True) if tma else
                       ScaledConfig(128, 64, 8, 2, stream_k=True),):
            assert "stream K" in scaled.path(a, b, sa, sb, bias=bias, config=config)
            for _ in range(2):
                out = poisoned(m, n, torch.bfloat16)
                scaled.scaled_mm(a, b, sa, sb, bias=bias, out=out, config=config)
                assert rel_error(out, ref) < TOL[torch.bfloat16], (m, n, k, config)
