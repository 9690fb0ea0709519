"""Eager flex_attention under ``nvfly.torch.routing()`` on a Hopper GPU: routed (nvfly's prefill or decode, the
decision says which and a spy sees the kernel called) against unrouted flex and float32 flex, with soft-capping,
ALiBi through captured slopes, a sliding-window BlockMask, a document mask, causal, GQA and a decode-sized call;
the LSE (natural log, as flex returns it); a training step (nvfly's forward, flex's backward from nvfly's LSE);
declined cases left to torch with their reason; an injected nvfly failure falling back. Fresh random inputs; the
memory nvfly's outputs are allocated from is NaN-poisoned first."""
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import nvfly.torch
from nvfly.ops import attention
from nvfly.torch import flex_ops as F
from nvfly.torch.gemm_ops import clear_decisions, decisions

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    clear_decisions()
    F.forget_decisions()
    calls = []
    for name in ("prefill", "decode"):
        real = getattr(attention, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(attention, name, spy)
    yield calls


def poison():
    """Fill the allocator's free blocks with NaN: outputs allocated next (torch.empty) start as NaN."""
    torch.full((64 << 20,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def inputs(batch=2, hq=8, hkv=8, sq=1024, skv=1024, d=128, dtype=torch.bfloat16, grad=False):
    q = torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, hkv, skv, d, device="cuda", dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, hkv, skv, d, device="cuda", dtype=dtype, requires_grad=grad)
    return q, k, v


def flex_decisions():
    return [d for d in decisions() if d.op == "flex_attention"]


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def soft_cap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 30.0) * 30.0


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 256)


def check(q, k, v, calls, kernel, **kwargs):
    """Routed vs unrouted vs float32 flex (out and LSE); the decision and the kernel called."""
    want, want_lse = flex_attention(q, k, v, return_lse=True, **kwargs)
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), return_lse=True, **kwargs)
    poison()
    with nvfly.torch.routing():
        got, got_lse = flex_attention(q, k, v, return_lse=True, **kwargs)
    (decision,) = flex_decisions()
    assert decision.reason is None and decision.candidates == (kernel,), decision
    assert calls == [kernel]
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2 and rel_err(got, want) < 1e-2, (rel_err(got, ref), rel_err(want, ref))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    torch.testing.assert_close(got_lse[finite], ref_lse[finite], atol=2e-2, rtol=1e-3)


def test_causal_block_mask(fresh_state):
    q, k, v = inputs()
    check(q, k, v, fresh_state, "prefill", block_mask=create_block_mask(causal, None, None, 1024, 1024))


def test_soft_cap_causal_gqa(fresh_state):
    q, k, v = inputs(hq=32, hkv=8, sq=1000, skv=1000)
    check(q, k, v, fresh_state, "prefill", score_mod=soft_cap, enable_gqa=True,
          block_mask=create_block_mask(causal, None, None, 1000, 1000))


def test_alibi_captured_slopes(fresh_state):
    slopes = torch.tensor(attention.alibi_slopes(8), device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    q, k, v = inputs(sq=700, skv=900)
    check(q, k, v, fresh_state, "prefill", score_mod=alibi)


def test_sliding_window_block_mask(fresh_state):
    q, k, v = inputs(batch=1, sq=2048, skv=2048, d=64)
    check(q, k, v, fresh_state, "prefill", block_mask=create_block_mask(sliding, None, None, 2048, 2048))


def test_document_mask(fresh_state):
    lengths = torch.tensor([300, 500, 224, 1000], device="cuda")
    documents = torch.repeat_interleave(torch.arange(4, device="cuda"), lengths)[None]  # (1, 2024)

    def document(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)
    q, k, v = inputs(batch=1, sq=2024, skv=2024)
    check(q, k, v, fresh_state, "prefill", score_mod=soft_cap,
          block_mask=create_block_mask(document, 1, None, 2024, 2024))


def test_decode_sized_call(fresh_state):
    def not_first(b, h, q_idx, kv_idx):
        return kv_idx != 0
    q, k, v = inputs(batch=2, hq=32, hkv=8, sq=4, skv=8192)
    check(q, k, v, fresh_state, "decode", score_mod=soft_cap, enable_gqa=True,
          block_mask=create_block_mask(not_first, None, None, 4, 8192))


def test_q_idx_at_decode_size_is_shifted(fresh_state):
    """ALiBi and a sliding-window mask read q_idx: decode gets them with q_idx shifted back to flex's row."""
    slopes = torch.rand(8, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def recent(b, h, q_idx, kv_idx):
        return (q_idx + 2048 - 8 >= kv_idx) & (q_idx + 2048 - 8 - kv_idx < 1000)
    q, k, v = inputs(sq=8, skv=2048)
    check(q, k, v, fresh_state, "decode", score_mod=alibi, block_mask=create_block_mask(recent, None, None, 8, 2048))


def test_training_step(fresh_state):
    """nvfly's forward (LSE in the op's log2 convention) and flex's own backward: the gradients of unrouted flex."""
    block_mask = create_block_mask(causal, None, None, 512, 512)
    q, k, v = inputs(batch=1, hq=4, hkv=4, sq=512, skv=512, grad=True)
    grad_out = torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
    want = flex_attention(q, k, v, score_mod=soft_cap, block_mask=block_mask)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=soft_cap, block_mask=block_mask)
        got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    assert fresh_state == ["prefill"]
    assert rel_err(got, want) < 1e-2
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) < 2e-2


@pytest.mark.parametrize("case", ["float32", "head dim 80", "floor in score_mod"])
def test_declined_with_reason(fresh_state, case):
    def floor_mod(score, b, h, q_idx, kv_idx):
        return torch.floor(score)
    q, k, v = inputs(dtype=torch.float32 if case == "float32" else torch.bfloat16, d=80 if case == "head dim 80"
                     else 128, sq=256, skv=256)
    score_mod = floor_mod if case.startswith("floor") else soft_cap
    want = flex_attention(q, k, v, score_mod=score_mod)
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=score_mod)
    (decision,) = flex_decisions()
    expected = {"float32": "bfloat16 or float16", "head dim 80": "head dim 80", "floor in score_mod": "floor"}[case]
    assert expected in decision.reason, decision.reason
    assert fresh_state == []
    torch.testing.assert_close(got, want)


def test_max_scores_declined(fresh_state):
    from torch.nn.attention import flex_attention as module
    if not hasattr(module, "AuxRequest"):
        pytest.skip("this torch has no return_aux")
    q, k, v = inputs(sq=256, skv=256)
    with nvfly.torch.routing():
        flex_attention(q, k, v, return_aux=module.AuxRequest(lse=True, max_scores=True))
    (decision,) = flex_decisions()
    assert "max scores" in decision.reason


def test_injected_failure_falls_back(fresh_state, monkeypatch):
    def broken(call):
        raise RuntimeError("injected")
    monkeypatch.setattr(F, "run", broken)
    q, k, v = inputs(sq=256, skv=256)
    want = flex_attention(q, k, v, score_mod=soft_cap)
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=soft_cap)
    torch.testing.assert_close(got, want)
    assert "nvfly raised RuntimeError: injected" in flex_decisions()[-1].reason
    assert math.isfinite(got.float().sum().item())


# ---------------------------------------------------------------------------------------------- torch.compile
from nvfly.torch import flex_compile as C  # noqa: E402


@pytest.fixture
def compiled():
    """nvfly's flex lowering (per-call option), the FX-graph cache off; returns run(options, ...) -> (out, whether
    the compiled code calls nvfly::flex_attention)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    patch = inductor_config.patch(fx_graph_cache=False)
    patch.__enter__()
    C.install()
    torch._dynamo.reset()

    def run(options, q, k, v, grad_out=None, **kwargs):
        fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, kernel_options=options, **kwargs))
        if grad_out is None:
            out, codes = run_and_get_code(fn, q, k, v)
            return out, any("torch.ops.nvfly.flex_attention" in c for c in codes)

        def step(q, k, v):
            out = fn(q, k, v)
            return (out,) + torch.autograd.grad(out, (q, k, v), grad_out)
        outs, codes = run_and_get_code(step, q, k, v)
        return outs, any("torch.ops.nvfly.flex_attention" in c for c in codes)
    yield run
    C.uninstall()
    patch.__exit__(None, None, None)
    torch._dynamo.reset()


def test_compiled_soft_cap_causal_calls_nvfly(compiled):
    q, k, v = inputs(hq=16, hkv=4, sq=1024, skv=1024)
    block_mask = create_block_mask(causal, None, None, 1024, 1024)
    ref = flex_attention(q.float(), k.float(), v.float(), score_mod=soft_cap, block_mask=block_mask, enable_gqa=True)
    got, calls_nvfly = compiled({"NVFLY": True}, q, k, v, score_mod=soft_cap, block_mask=block_mask,
                                enable_gqa=True)
    assert calls_nvfly
    assert rel_err(got, ref) < 1e-2
    assert {d.winner for d in decisions() if d.where == "inductor"} == {"prefill"}


def test_compiled_alibi_captured_slopes(compiled):
    slopes = torch.tensor(attention.alibi_slopes(8), device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    q, k, v = inputs(sq=900, skv=900)
    ref = flex_attention(q.float(), k.float(), v.float(), score_mod=alibi)
    got, calls_nvfly = compiled({"NVFLY": True}, q, k, v, score_mod=alibi)
    assert calls_nvfly and rel_err(got, ref) < 1e-2


def test_compiled_projection_inputs(compiled):
    """q, k, v computed in the compiled function (a projection's (B, H, S, D) view) reach nvfly's op."""
    from torch._inductor.utils import run_and_get_code
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3, 1024, 1024, device="cuda", dtype=torch.bfloat16) / 32

    def attend(x, w, options):
        q, k, v = ((x @ w[i]).view(2, 1024, 8, 128).transpose(1, 2) for i in range(3))
        return flex_attention(q, k, v, score_mod=soft_cap, kernel_options=options)
    got, codes = run_and_get_code(torch.compile(lambda x, w: attend(x, w, {"NVFLY": True})), x, w)
    assert any("torch.ops.nvfly.flex_attention" in c for c in codes)
    q, k, v = ((x @ w[i]).float().view(2, 1024, 8, 128).transpose(1, 2) for i in range(3))
    assert rel_err(got, flex_attention(q, k, v, score_mod=soft_cap)) < 2e-2


def test_compiled_decode_reuses_its_signature_on_new_tensors(compiled):
    """Compiled decode (48/8 GQA, Sq 1, 8K keys, no mods): the op's cached call binds each call's tensors (fresh
    inputs of the same layouts give their own flex result, nothing stale); the inference graph does not ask for the
    LSE, a return_lse graph gets flex's (natural log after flex's wrapper)."""
    import torch._inductor.config as inductor_config
    C._SIGNATURES.clear()
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True, kernel_options={"NVFLY": True}))
    with inductor_config.patch(fx_graph_cache=False):
        for _ in range(3):
            q, k, v = inputs(batch=1, hq=48, hkv=8, sq=1, skv=8192)
            ref = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True)
            assert rel_err(fn(q, k, v), ref) < 1e-2
        [signature] = C._SIGNATURES.values()
        assert not signature.failed and not signature.needs_lse and signature.path == "decode"
        with_lse = torch.compile(lambda q, k, v: flex_attention(q, k, v, enable_gqa=True, return_lse=True,
                                                                kernel_options={"NVFLY": True}))
        out, lse = with_lse(q, k, v)
    ref, ref_lse = flex_attention(q.float(), k.float(), v.float(), enable_gqa=True, return_lse=True)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    assert not any(s.failed for s in C._SIGNATURES.values()) and len(C._SIGNATURES) == 2


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_decode_with_mods_binds_each_call(mode):
    """Compiled decode with a score mod and a block mask that ignore q_idx (decode's kernel): the bound call binds
    flex's (B, H, S, D) tensors through transposes once, then as they are; each call's fresh tensors give their own
    flex result, also replayed from a CUDA graph (reduce-overhead: the warm call's direct path captured)."""
    import torch._inductor.config as inductor_config
    C._SIGNATURES.clear()
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx % 5 != 2, None, None, 1, 8192)
    C.install()
    try:
        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False):
            fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, score_mod=soft_cap, block_mask=block_mask,
                                                              enable_gqa=True, kernel_options={"NVFLY": True}),
                               mode=mode)
            for _ in range(4):
                q, k, v = inputs(batch=1, hq=48, hkv=8, sq=1, skv=8192)
                ref = flex_attention(q.float(), k.float(), v.float(), score_mod=soft_cap, block_mask=block_mask,
                                     enable_gqa=True)
                assert rel_err(fn(q, k, v).clone(), ref) < 1e-2
    finally:
        C.uninstall()
        torch._dynamo.reset()
    [signature] = C._SIGNATURES.values()
    assert not signature.failed and signature.path == "decode" and not signature.plain


@pytest.mark.slow
def test_compiled_option_off_keeps_inductor(compiled):
    q, k, v = inputs(sq=1024, skv=1024)
    _, calls_nvfly = compiled({"NVFLY": False}, q, k, v, score_mod=soft_cap)
    assert not calls_nvfly


def test_compiled_auto_under_install(compiled):
    """After nvfly.torch.install() a long prefill takes nvfly without the option (which calls the rule takes:
    tests/test_torch_flex_cpu.py)."""
    nvfly.torch.install()
    try:
        q, k, v = inputs(sq=C.AUTO_MIN_SQ, skv=C.AUTO_MIN_SQ)
        got, calls_nvfly = compiled({}, q, k, v, score_mod=soft_cap)
        assert calls_nvfly
        assert rel_err(got, flex_attention(q.float(), k.float(), v.float(), score_mod=soft_cap)) < 1e-2
    finally:
        nvfly.torch.uninstall()


def test_compiled_auto_takes_decode_with_a_causal_mask(compiled):
    """After nvfly.torch.install() a decode-sized call with a causal BlockMask (its mask reads q_idx) runs nvfly's
    decode kernel with q_idx shifted back to flex's row ("decode_shifted"): flex's result (rows see keys up to
    their row, top-left)."""
    nvfly.torch.install()
    try:
        q, k, v = inputs(hq=32, hkv=8, sq=8, skv=8192)
        block_mask = create_block_mask(causal, None, None, 8, 8192)
        got, calls_nvfly = compiled({}, q, k, v, block_mask=block_mask, enable_gqa=True)
        assert calls_nvfly
        assert [d.winner for d in flex_decisions() if d.where == "inductor"] == ["decode_shifted"]
        want = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, enable_gqa=True)
        assert rel_err(got, want) < 1e-2
    finally:
        nvfly.torch.uninstall()


@pytest.mark.slow
def test_compiled_training_step(compiled):
    """nvfly's forward under compile, Inductor's flex backward from nvfly's LSE: the gradients of float32 flex."""
    block_mask = create_block_mask(causal, None, None, 512, 512)
    q, k, v = inputs(batch=1, hq=4, hkv=4, sq=512, skv=512, grad=True)
    grad_out = torch.randn(1, 4, 512, 128, device="cuda", dtype=torch.bfloat16)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = flex_attention(q32, k32, v32, score_mod=soft_cap, block_mask=block_mask)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    (got, *grads), calls_nvfly = compiled({"NVFLY": True}, q, k, v, grad_out=grad_out, score_mod=soft_cap,
                                          block_mask=block_mask)
    assert calls_nvfly and rel_err(got, ref) < 1e-2
    for g, w in zip(grads, ref_grads):
        assert rel_err(g, w) < 3e-2
