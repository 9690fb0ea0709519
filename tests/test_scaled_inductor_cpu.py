"""The FP8 scaled GEMM under torch.compile(mode="max-autotune") without a GPU: Inductor lowers aten._scaled_mm on CPU
too, so nvfly's hook runs on real lowerings here (declined on CPU with the reason; with the placement check patched,
its candidates join ATen's and a winner is emitted as nvfly::scaled_mm_out, which runs torch on CPU). Also the op's
fake, the declines of ``inductor_analysis``, config strings, the candidates' plans, and every candidate tile
compiling to cubin."""
from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import nvfly.torch
from nvfly.ops.common import operands
from nvfly.ops.scaled import ScaledConfig
from nvfly.ops.scaled.api import compile_variants
from nvfly.ops.scaled.config import ScaledEpilogue
from nvfly.ops.scaled.plan import make_plan
from nvfly.ops.scaled.quantize import quantize
from nvfly.torch import inductor, scaled_ops
from nvfly.torch.gemm_ops import AUTO, TensorInfo, decisions, decode_config, encode_config
from nvfly.torch.scaled_ops import inductor_analysis, inductor_candidates

SMS = 132
F8 = torch.float8_e4m3fn


def _operands(m: int = 64, n: int = 256, k: int = 256, granularity: str = "row"):
    a, sa = quantize(torch.randn(m, k), "1x128" if granularity == "128x128" else granularity)
    b, sb = quantize(torch.randn(n, k), granularity, operand="b")
    return a, b, sa, sb


# ---------------------------------------------------------------------------------------------- config strings
def test_scaled_config_strings_round_trip():
    for cfg, swap in ((ScaledConfig(), False), (ScaledConfig(64, 8, 12, 1, split_k=4), True),
                      (ScaledConfig(128, 128, 7, issue_ahead=True), False)):
        text = encode_config(cfg, swap)
        assert decode_config(text, ScaledConfig) == (cfg, swap)
        assert text.startswith("swap:") == swap and "issue_ahead=" in text
    assert decode_config(AUTO, ScaledConfig) == (None, False)
    with pytest.raises(ValueError, match="malformed nvfly ScaledConfig config string 'bm=64,tile=3'"):
        decode_config("bm=64,tile=3", ScaledConfig)
    with pytest.raises(ValueError, match="malformed nvfly GemmConfig"):
        decode_config("bm=64,bogus=1")


@pytest.mark.parametrize("scaling,fast", [("tensor", False), ("row", False), ("row", True), ("block", False),
                                          ("block1x128", False)])
@pytest.mark.parametrize("m", [8, 128, 200, 4096])
def test_candidates_plan_and_differ(scaling, fast, m):
    n, k = 4096, 7168
    configs = inductor_candidates(m, n, k, scaling, fast, True, SMS, 4)
    assert configs[0] == AUTO and 1 <= len(configs) <= 4 and len(set(configs)) == len(configs)
    epilogue = ScaledEpilogue(scaling, promote=scaling in ("block", "block1x128") or not fast, bias=True)
    plans = set()
    for text in configs:
        cfg, swap = decode_config(text, ScaledConfig)
        plan = make_plan(m, n, k, epilogue, cfg, True if swap else None, SMS)  # what the op runs for the string
        plans.add((plan.config, plan.swap))
    assert len(plans) == len(configs)  # every candidate runs something the others do not
    assert len(inductor_candidates(m, n, k, scaling, fast, True, SMS, 2)) <= 2


def test_candidates_cover_both_sides_of_the_swap():
    small = inductor_candidates(16, 4096, 4096, "row", True, False, SMS, 4)
    assert not small[1].startswith("swap:") and decode_config(small[1], ScaledConfig)[0].bm == 64
    mid = inductor_candidates(128, 4096, 4096, "row", False, False, SMS, 4)
    assert mid[1].startswith("swap:")
    assert not any(c.startswith("swap:") for c in inductor_candidates(16, 4096, 4096, "block", False, False, SMS, 4))


@pytest.mark.parametrize("m,scaling,fast", [(16, "row", True), (128, "row", False), (4096, "block", False)])
def test_candidate_kernels_compile(m, scaling, fast):
    """Each candidate's kernel compiles to cubin without spills (the plans the strings give, as the op runs them)."""
    n, k = 4096, 4096
    epilogue = ScaledEpilogue(scaling, promote=scaling == "block" or not fast)
    variants = []
    for text in inductor_candidates(m, n, k, scaling, fast, False, SMS, 4)[1:]:  # "auto" is the eager path's
        cfg, swap = decode_config(text, ScaledConfig)
        plan = make_plan(m, n, k, epilogue, cfg, True if swap else None, SMS)
        variants.append((plan.config, plan.epilogue))
    for kernel in compile_variants(variants):
        assert kernel.resources.spill_stores == 0 and kernel.resources.stack_bytes == 0


# ---------------------------------------------------------------------------------------------- analysis
def _info(t: torch.Tensor, device: str = "cuda:0", byte_offset: int = 0) -> TensorInfo:
    return TensorInfo(tuple(t.shape), tuple(t.stride()), t.dtype, torch.device(device), byte_offset)


def _analysis(a, b, sa, sb, bias=None, out=None, out_dtype=torch.bfloat16, **info):
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype) if out is None else out
    return inductor_analysis(*(None if t is None else _info(t, **info) for t in (a, b, sa, sb, bias, out)),
                             out_dtype)


def test_inductor_analysis_declines_with_reasons(monkeypatch):
    a, b, sa, sb = _operands()
    assert _analysis(a, b, sa, sb, device="cpu") == (None, "a is on cpu, not CUDA")
    monkeypatch.setattr(operands, "capability", lambda device: (9, 0))
    assert _analysis(a, b, sa, sb) == ("row", None)
    assert _analysis(a, b, sa.expand(64, 1), sb.expand(1, 256), bias=torch.zeros(256, dtype=torch.bfloat16)) == \
        ("row", None)
    assert "out_dtype torch.float8_e4m3fn: nvfly's scaled GEMM writes" in _analysis(a, b, sa, sb, out_dtype=F8)[1]
    assert "out_dtype torch.float8_e4m3fn" in inductor_analysis(*(_info(t) for t in (a, b, sa, sb)), None,
                                                                _info(torch.empty(64, 256, dtype=F8)), None)[1]
    assert _analysis(a, b, sa, sb, bias=torch.zeros(256), out_dtype=torch.float32)[1].startswith("a bias with an fp32")
    assert _analysis(a, b.t().contiguous().t().contiguous(), sa, sb)[1].startswith("b: expected a column-major")
    out = torch.empty(256, 64, dtype=torch.bfloat16).t()
    assert _analysis(a, b, sa, sb, out=out)[1] == "out: strides (1, 64): nvfly writes a row-major (M, N) output"
    assert _analysis(a, b, sa, sb, byte_offset=8)[1] == "a: its address is not 16-byte aligned (TMA needs it)"
    mx = _operands(granularity="mx")
    reason = _analysis(mx[0], mx[1], mx[2].view(torch.float8_e8m0fnu), mx[3].view(torch.float8_e8m0fnu))[1]
    assert reason.startswith("mxfp8 scales: torch's are cuBLAS's swizzled (blocked) layout")
    # cuBLAS's swizzled MX scales (padded to 128 x 4 tiles) match no layout nvfly reads
    swizzled = torch.empty(128, 8, dtype=torch.float8_e8m0fnu)
    assert "scale_a: shape (128, 8)" in _analysis(mx[0], mx[1], swizzled, swizzled)[1]
    assert _analysis(*_operands(granularity="128x128"))[0] == "block"


# ---------------------------------------------------------------------------------------------- the op
def test_scaled_mm_out_fake_and_fallback():
    from torch._subclasses.fake_tensor import FakeTensorMode
    a, b, sa, sb = _operands()
    out = torch.full((64, 256), float("nan"), dtype=torch.bfloat16)
    torch.ops.nvfly.scaled_mm_out(a, b, sa, sb, out=out, config="auto")  # CPU: torch computes it, the reason kept
    assert torch.equal(out, torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))
    assert scaled_ops.out_bound_reason(a, b, sa, sb, out=out, config="auto") == "a is on cpu, not CUDA"
    with FakeTensorMode() as mode:
        fa, fb, fsa, fsb = (mode.from_tensor(t) for t in (a, b, sa, sb))
        torch.ops.nvfly.scaled_mm_out(fa, fb, fsa, fsb, out=torch.empty(64, 256, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"^nvfly::scaled_mm_out: out: expected shape \(64, 256\), got"):
            torch.ops.nvfly.scaled_mm_out(fa, fb, fsa, fsb, out=torch.empty(64, 128, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="^nvfly::scaled_mm_out: b: shape"):
            torch.ops.nvfly.scaled_mm_out(fa, fb[:128], fsa, fsb, out=torch.empty(64, 256, dtype=torch.bfloat16))
    bias = torch.randn(256).bfloat16()
    torch.library.opcheck(torch.ops.nvfly.scaled_mm_out.default, (a, b, sa, sb, bias),
                          {"out": torch.empty(64, 256, dtype=torch.bfloat16), "use_fast_accum": True},
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))  # (test_schema multiplies fp8)


# ---------------------------------------------------------------------------------------------- inductor
@pytest.fixture
def compile_scaled_mm(aten_max_autotune):
    """torch.compile(max-autotune) of torch._scaled_mm (bf16 out) on CPU with only ATen (and nvfly) to choose from;
    the result must be torch's eager one."""
    def run(a, b, sa, sb, bias=None, dynamic=False, **kwargs):
        fn = torch.compile(lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb, bias, out_dtype=torch.bfloat16,
                                                                 **kwargs),
                           mode="max-autotune-no-cudagraphs", dynamic=dynamic)
        out, code = run_and_get_code(fn, a, b, sa, sb)
        assert torch.equal(out, torch._scaled_mm(a, b, sa, sb, bias, out_dtype=torch.bfloat16, **kwargs))
        return "\n".join(code)
    return run


@pytest.fixture
def eligible_on_cpu(monkeypatch):
    """nvfly's scaled choices on CPU tensors: the placement check accepts them, no kernel compiles, every nvfly
    candidate wins its benchmark (the emitted op runs torch on CPU, so results stay right)."""
    monkeypatch.setattr(scaled_ops.scaled.api, "placement_reason", lambda *args: None)
    monkeypatch.setattr(inductor, "sm_count", lambda device: SMS)
    monkeypatch.setattr(inductor.NvflyCaller, "_compile", lambda self, operands: None)
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", lambda self, *args, out: 1e-6)


def _inductor_decisions():
    return [d for d in decisions() if d.where == "inductor" and d.op == "scaled_mm"]


def test_inductor_declines_cpu_scaled_mm_with_a_reason(compile_scaled_mm):
    nvfly.torch.install()
    assert "nvfly" not in compile_scaled_mm(*_operands())
    (d,) = _inductor_decisions()
    assert d.shape == (1, 64, 256, 256) and d.reason == "a is on cpu, not CUDA"


def test_inductor_declines_dynamic_shapes(compile_scaled_mm):
    nvfly.torch.install()
    assert "nvfly" not in compile_scaled_mm(*_operands(), dynamic=True)
    (d,) = _inductor_decisions()
    assert d.reason.startswith("workload analysis failed: ValueError: dynamic shape")


@pytest.mark.parametrize("with_bias,fast", [(False, False), (True, True)])
def test_inductor_emits_nvfly_scaled_mm_out_when_it_wins(compile_scaled_mm, eligible_on_cpu, with_bias, fast):
    nvfly.torch.install()
    a, b, sa, sb = _operands()
    bias = torch.randn(256).bfloat16() if with_bias else None
    code = compile_scaled_mm(a, b, sa, sb, bias, use_fast_accum=fast)
    assert "torch.ops.nvfly.scaled_mm_out.default(" in code and "config='auto'" in code
    assert f"use_fast_accum={fast}" in code
    (d,) = _inductor_decisions()
    assert d.candidates == tuple(inductor_candidates(64, 256, 256, "row", fast, with_bias, SMS, 4))
    assert d.winner == "nvfly auto" and "aten _scaled_mm" in d.timings_ms
    assert {f"nvfly {c}" for c in d.candidates} <= set(d.timings_ms)


def test_inductor_declines_fp8_outputs(aten_max_autotune, eligible_on_cpu):
    nvfly.torch.install()
    fn = torch.compile(lambda a, b, sa, sb: torch._scaled_mm(a, b, sa, sb), mode="max-autotune-no-cudagraphs")
    _, code = run_and_get_code(fn, *_operands())
    assert "nvfly" not in "\n".join(code)
    (d,) = _inductor_decisions()
    assert d.reason.startswith("out_dtype torch.float8_e4m3fn")


def test_preprocessing_hook_adds_scaled_choices_when_the_choices_slot_is_taken(compile_scaled_mm, eligible_on_cpu):
    from torch._inductor.choices import InductorChoices

    class Foreign(InductorChoices):
        def uuid(self):
            return "someone-else"

    with inductor_config.patch(inductor_choices_class=Foreign):
        nvfly.torch.install()
        assert inductor.installed() and inductor._STATE.via_preprocessing
        assert "torch.ops.nvfly.scaled_mm_out.default(" in compile_scaled_mm(*_operands())
        nvfly.torch.uninstall()
    (d,) = _inductor_decisions()
    assert d.winner == "nvfly auto"


def test_explain_lists_the_inductor_candidates(capsys):
    from nvfly.cli import main
    assert main(["explain", "128", "4096", "4096", "--scaled", "row"]) == 0
    out = capsys.readouterr().out
    assert "max-autotune (after nvfly.torch.install())" in out
    for text in inductor_candidates(128, 4096, 4096, "row", False, False, SMS, 4):
        assert f"    {text}: scaled-row-promoted" in out
    assert "swapAB-splitK2" in out
    assert main(["explain", "64", "4096", "4096", "--scaled", "mxfp8"]) == 0
    assert "max-autotune: declined: mxfp8 scales" in capsys.readouterr().out


def test_preprocessing_hook_adds_scaled_choices_when_the_lowering_skips_v_choices(compile_scaled_mm, eligible_on_cpu,
                                                                                   monkeypatch):
    """Torch releases whose tuned_scaled_mm binds ATen's choice itself (no V.choices.get_template_configs call):
    the preprocessing hook adds nvfly's choices."""
    from torch._inductor.choices import InductorChoices
    monkeypatch.setattr(inductor.NvflyChoices, "get_template_configs", InductorChoices.get_template_configs)
    monkeypatch.setattr(inductor._STATE, "scaled_via_choices", False)
    nvfly.torch.install()
    assert "torch.ops.nvfly.scaled_mm_out.default(" in compile_scaled_mm(*_operands())
    (d,) = _inductor_decisions()
    assert d.winner == "nvfly auto" and not inductor._STATE.scaled_via_choices


def test_the_v_choices_hook_joins_scaled_mm_on_this_torch(compile_scaled_mm, eligible_on_cpu):
    nvfly.torch.install()
    assert "torch.ops.nvfly.scaled_mm_out.default(" in compile_scaled_mm(*_operands())
    assert inductor._STATE.scaled_via_choices  # torch 2.13's tuned_scaled_mm asks V.choices
    assert len(_inductor_decisions()) == 1  # and the preprocessing hook did not add them a second time
