"""torch.compile(mode="max-autotune") of torch._scaled_mm with nvfly installed: nvfly's scaled-GEMM candidates are
compiled and benchmarked beside cuBLAS (and Inductor's Triton scaled-mm templates), the result is right whichever
wins, and a winning nvfly config runs on nvfly (no fallback to torch); every candidate config string computes the
GEMM through nvfly::scaled_mm_out. Fresh random inputs, float32 reference; about 30-60 s (Triton's templates
compile once)."""
import math

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import nvfly.torch
from nvfly.ops import scaled
from nvfly.ops.scaled.quantize import quantize
from nvfly.runtime.driver import sm_count
from nvfly.torch import inductor, scaled_ops
from nvfly.torch.gemm_ops import clear_decisions, decisions

pytestmark = pytest.mark.gpu

GRANULARITY = {"row": ("row", "row"), "block": ("1x128", "128x128")}


def operands(m, n, k, scaling):
    a, sa = quantize(torch.randn(m, k, device="cuda"), GRANULARITY[scaling][0])
    b, sb = quantize(torch.randn(n, k, device="cuda"), GRANULARITY[scaling][1], operand="b")
    return a, b, sa, sb


def rel_error(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def max_autotune():
    """max-autotune with nothing reused from caches; ``backends`` ATEN (cuBLAS) or ATEN,TRITON (few configs)."""
    def patches(backends):
        p = {"fx_graph_cache": False, "autotune_local_cache": False, "max_autotune_gemm_backends": backends,
             "benchmark_epilogue_fusion": False}
        if hasattr(inductor_config.test_configs, "max_mm_configs"):
            p["test_configs.max_mm_configs"] = 2
        return inductor_config.patch(p)
    torch._dynamo.reset()
    clear_decisions()
    yield patches
    nvfly.torch.uninstall()
    torch._dynamo.reset()


def compile_scaled_mm(a, b, sa, sb, bias=None, fast=False):
    fn = torch.compile(lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb, bias, out_dtype=torch.bfloat16,
                                                             use_fast_accum=fast), mode="max-autotune-no-cudagraphs")
    out, code = run_and_get_code(fn, a, b, sa, sb)
    ref = scaled.reference(a, b, sa, sb, bias)
    assert rel_error(out, ref) < 1e-2
    return "\n".join(code)


def tuned():
    (d,) = [d for d in decisions() if d.where == "inductor" and d.op == "scaled_mm"]
    return d


def test_candidates_are_benchmarked_beside_cublas_and_triton(hopper, max_autotune):
    nvfly.torch.install(max_candidates=3)
    with max_autotune("ATEN,TRITON"):
        code = compile_scaled_mm(*operands(64, 1024, 2048, "row"))
    d = tuned()
    assert d.reason is None and len(d.candidates) == 3 and d.candidates[0] == "auto"
    assert "aten _scaled_mm" in d.timings_ms
    nvfly_times = [d.timings_ms.get(f"nvfly {c}", math.nan) for c in d.candidates]
    # each compiled, ran and was timed (a failed one is dropped or timed inf, with its reason on the decision)
    assert all(math.isfinite(t) and t > 0 for t in nvfly_times), (d.timings_ms, d.reason)
    assert d.winner == min(d.timings_ms, key=d.timings_ms.__getitem__)
    assert ("torch.ops.nvfly.scaled_mm_out" in code) == d.winner.startswith("nvfly")


@pytest.mark.parametrize("scaling,bias,fast", [("row", True, True), ("block", False, False)])
def test_a_winning_nvfly_config_runs_on_nvfly(hopper, max_autotune, monkeypatch, scaling, bias, fast):
    """The last candidate (a forced ScaledConfig, not "auto") made to win: the compiled graph calls
    nvfly::scaled_mm_out with its config string, which computes the GEMM on nvfly (no decision of a fallback)."""
    m, n, k = 96, 512, 1024
    a, b, sa, sb = operands(m, n, k, scaling)
    bias_t = torch.randn(n, device="cuda").bfloat16() if bias else None
    last = scaled_ops.inductor_candidates(m, n, k, scaling, fast, bias, sm_count(0), 4)[-1]
    timed = inductor.NvflyCaller.benchmark

    def last_wins(self, *args, out):
        elapsed = timed(self, *args, out=out)  # still compiled and run for real
        return 1e-9 if self.kwargs["config"] == last else elapsed
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", last_wins)
    nvfly.torch.install()
    with max_autotune("ATEN"):
        code = compile_scaled_mm(a, b, sa, sb, bias_t, fast)
    assert last != "auto" and f"config='{last}'" in code and "torch.ops.nvfly.scaled_mm_out.default(" in code
    assert tuned().winner == f"nvfly {last}"
    fallbacks = [d.reason for d in decisions() if d.where == "op" and d.op == "scaled_mm"]
    assert not fallbacks, f"the emitted op fell back to torch: {fallbacks}"


@pytest.mark.parametrize("scaling,bias,fast", [("row", True, True), ("row", False, False), ("block", False, False)])
def test_every_candidate_config_computes_the_gemm(hopper, scaling, bias, fast):
    """nvfly::scaled_mm_out with each candidate config string (the kernels the compile above tuned) into a
    NaN-poisoned output, against the float32 GEMM of the dequantised operands."""
    m, n, k = 96, 512, 1024
    a, b, sa, sb = operands(m, n, k, scaling)
    bias_t = torch.randn(n, device="cuda").bfloat16() if bias else None
    ref = scaled.reference(a, b, sa, sb, bias_t)
    for config in scaled_ops.inductor_candidates(m, n, k, scaling, fast, bias, sm_count(0), 4):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops.nvfly.scaled_mm_out(a, b, sa, sb, bias_t, out=out, config=config, use_fast_accum=fast)
        assert scaled_ops.out_bound_reason(a, b, sa, sb, bias_t, out=out, config=config,
                                           use_fast_accum=fast) is None, config  # nvfly ran it, not torch
        assert not out.isnan().any(), f"{config}: elements not written"
        assert rel_error(out, ref) < 1e-2, config
