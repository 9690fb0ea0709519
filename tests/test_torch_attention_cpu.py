"""Attention from PyTorch without a GPU: ``nvfly::attention_decode`` and ``nvfly::attention_prefill`` (torch
fallback equal to SDPA, LSE, fake shapes, tracing by torch.compile; their fakes' errors are tested in
test_fake_parity_cpu.py), prefill's gradients by torch's backward kernels on nvfly's LSE (the CPU kernel here; the
choice of kernel for CUDA inputs), and the eager SDPA route: its eligibility table and reasons for decode and prefill
(on fake CUDA tensors), the decisions it records, its failure bookkeeping, and the dispatch mechanics of a composite
op routed on an autograd key and a backend key (exercised on the CPU keys: fallthrough, inference_mode, autograd
kept, training through the route, an nvfly exception falling back)."""
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly.torch
from nvfly.ops import attention
from nvfly.torch import attention_ops as A
from nvfly.torch import routing
from nvfly.torch.gemm_ops import clear_decisions, decisions

bf = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_decisions():
    clear_decisions()
    A.forget_decisions()


def _decode_inputs(batch=2, sq=3, hq=8, hkv=2, skv=40, d=64, dtype=bf):
    torch.manual_seed(0)
    return (torch.randn(batch, sq, hq, d).to(dtype), torch.randn(batch, skv, hkv, d).to(dtype),
            torch.randn(batch, skv, hkv, d).to(dtype))


# ---------------------------------------------------------------------------------------------- the custom op
def test_op_on_cpu_equals_sdpa_and_its_lse_is_natural_log():
    q, k, v = _decode_inputs()
    out, lse = torch.ops.nvfly.attention_decode(q, k, v, causal=False)
    assert out.shape == q.shape and out.dtype == bf and lse.shape == (2, 8, 3) and lse.dtype == torch.float32
    want = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                          v.transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(4, dim=2)) / math.sqrt(64)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-4, rtol=1e-4)


def test_op_causal_is_bottom_right_with_lengths():
    q, k, v = _decode_inputs(batch=1, sq=2, hq=2, hkv=2, skv=5)
    out, lse = torch.ops.nvfly.attention_decode(q, k, v, torch.tensor([4]))
    # the queries are positions 2 and 3 of a 4-key sequence: the first sees keys 0..2, the second 0..3
    full = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k[:, :4].transpose(1, 2).float(),
                                          v[:, :4].transpose(1, 2).float(),
                                          attn_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool))
    torch.testing.assert_close(out.float(), full.transpose(1, 2), atol=2e-2, rtol=2e-2)


def test_op_fake_shapes_and_compile():
    q, k, v = _decode_inputs(sq=1)
    with FakeTensorMode() as mode:
        out, lse = torch.ops.nvfly.attention_decode(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v))
        assert out.shape == q.shape and lse.shape == (2, 8, 1) and lse.dtype == torch.float32

    def step(q, k, v):
        return torch.ops.nvfly.attention_decode(q, k, v, causal=False)[0] * 2

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))


class _BothOps(torch.nn.Module):
    def forward(self, q, k, v, qp, kp, vp, mask):
        out, _ = torch.ops.nvfly.attention_decode(q, k, v, causal=False)
        prefilled, _ = torch.ops.nvfly.attention_prefill(qp, kp, vp, causal=True)
        masked, _ = torch.ops.nvfly.attention_prefill(qp, kp, vp, mask)
        return out * 2, prefilled + 1, masked


@pytest.mark.slow  # an AOTInductor build: 16-50 s of C++ compiling on the CI machine
def test_ops_export_and_run_from_an_aoti_package(tmp_path):
    """AOTInductor: a module calling both attention ops (prefill also with an attn_mask) exports (their fakes),
    compiles into a package and runs from it (the package calls the ops by name: on CPU their references) with the
    eager module's results."""
    q, k, v = _decode_inputs(sq=1)
    qp, kp, vp = _prefill_inputs()
    mask = torch.rand(2, 1, 40, 40) > 0.3
    mask[..., 0] = True
    inputs = (q, k, v, qp, kp, vp, mask)
    program = torch.export.export(_BothOps(), inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own deprecation warnings while packaging
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "attention.pt2"))
    got = torch._inductor.aoti_load_package(package)(*inputs)
    for mine, eager in zip(got, _BothOps()(*inputs)):
        torch.testing.assert_close(mine, eager)


def _prefill_inputs(batch=2, sq=40, skv=40, hq=8, hkv=2, d=64, dv=None, grad=False):
    torch.manual_seed(1)
    q, k = torch.randn(batch, sq, hq, d).to(bf), torch.randn(batch, skv, hkv, d).to(bf)
    v = torch.randn(batch, skv, hkv, dv or d).to(bf)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _sdpa_f32(q, k, v, **kwargs):
    """float32 SDPA of (B, S, H, D) tensors, in that layout, and its float32 leaves."""
    leaves = [t.detach().float().requires_grad_(t.requires_grad) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), enable_gqa=True, **kwargs)
    return out.transpose(1, 2), leaves


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("sq,skv,causal,alignment", [
    (40, 40, False, "bottom_right"), (40, 40, True, "top_left"), (50, 30, True, "top_left"),
    (20, 45, True, "bottom_right")])
def test_prefill_op_on_cpu_equals_sdpa_with_lse(sq, skv, causal, alignment):
    q, k, v = _prefill_inputs(sq=sq, skv=skv)
    out, lse = torch.ops.nvfly.attention_prefill(q, k, v, causal=causal, scale=0.2, causal_alignment=alignment)
    assert out.shape == q.shape and out.dtype == bf and lse.shape == (2, 8, sq) and lse.dtype == torch.float32
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(4, dim=2)) * 0.2
    if causal:  # query i sees keys up to i (top-left) or i + Skv - Sq (bottom-right)
        shift = 0 if alignment == "top_left" else skv - sq
        visible = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + shift
        scores = scores.masked_fill(~visible, float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-4, rtol=1e-4)
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float().repeat_interleave(4, dim=2))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sq,skv,hkv,d,dv", [(40, 40, 2, 64, None), (50, 30, 8, 64, None), (33, 20, 1, 128, None)])
def test_prefill_op_gradients_by_torchs_backward_on_its_lse(sq, skv, hkv, d, dv):
    """Top-left causal with GQA, Sq > Skv, MQA: torch's CPU flash backward, fed the op's out and LSE,
    gives float32 SDPA's gradients."""
    q, k, v = _prefill_inputs(sq=sq, skv=skv, hkv=hkv, d=d, dv=dv, grad=True)
    out, _ = torch.ops.nvfly.attention_prefill(q, k, v, causal=True, causal_alignment="top_left")
    grad = torch.randn_like(out)
    out.backward(grad)
    want, leaves = _sdpa_f32(q, k, v, is_causal=True)
    want.backward(grad.float())
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        assert got.shape == ref.shape and _rel(got, ref.grad) < 2e-2


def test_prefill_op_fake_and_compile():
    q, k, v = _prefill_inputs()
    with FakeTensorMode() as mode:
        out, lse = torch.ops.nvfly.attention_prefill(*map(mode.from_tensor, (q, k, v)), causal=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 40) and lse.dtype == torch.float32

    def layer(q, k, v):
        return torch.ops.nvfly.attention_prefill(q, k, v, causal=True, causal_alignment="top_left")[0] * 2

    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v))


@pytest.mark.parametrize("sq,skv,dqk,dv,causal,alignment,device,kernel", [
    (64, 64, 128, 128, True, "top_left", "cuda", "flash"),  # square: both alignments agree
    (64, 128, 128, 128, True, "bottom_right", "cuda", "flash"),
    (64, 128, 128, 128, False, "top_left", "cuda", "flash"),
    (64, 128, 128, 128, True, "top_left", "cuda", "efficient"),  # flash's causal is bottom-right
    (64, 64, 192, 128, True, "top_left", "cuda", "efficient"),  # flash needs Dqk = Dv
    (64, 128, 128, 128, True, "top_left", "cpu", "cpu_flash"),
    (64, 128, 128, 128, True, "bottom_right", "cpu", None),
    (64, 64, 192, 128, False, "top_left", "cpu", None),
])
def test_backward_kernel_choice(sq, skv, dqk, dv, causal, alignment, device, kernel):
    from nvfly.torch.attention_backward import backward_kernel, why_no_backward
    with FakeTensorMode():
        q = torch.empty(1, sq, 8, dqk, dtype=bf, device=device)
        k, v = torch.empty(1, skv, 2, dqk, dtype=bf, device=device), torch.empty(1, skv, 2, dv, dtype=bf, device=device)
    assert backward_kernel(q, k, v, causal, alignment) == kernel
    assert (why_no_backward(q, k, v, causal, alignment) is None) == (kernel is not None)


# ---------------------------------------------------------------------------------------------- SDPA eligibility
def _sdpa_shapes(batch=1, hq=32, hkv=8, sq=1, skv=32768, d=128):
    return (batch, hq, sq, d), (batch, hkv, skv, d)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake CUDA tensors (no GPU) and torch's backend choice pinned to flash (``_fused_sdp_choice`` needs a GPU)."""
    monkeypatch.setattr(A, "_torch_backend", lambda *args: "flash")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # prefill asks for sm_90
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")  # data_ptr of a FakeTensor (0): the alignment check reads it
        yield lambda shape, dtype=bf: torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("order, usable, expected", [
    ((3, 1, 2, 0), {3: True, 1: True, 2: True}, "cudnn"),  # cuDNN ahead of flash, as torch 2.11 picks on the H200
    ((3, 1, 2, 0), {3: False, 1: False, 2: True}, "efficient"),
    ((1, 2, 3, 0), {3: True, 1: True, 2: True}, "flash"),
    ((3, 1, 2, 0), {3: False, 1: False, 2: False}, "math"),
])
def test_fake_tensors_get_torchs_choice_by_its_order_and_checks(monkeypatch, order, usable, expected):
    """For fake tensors (the compiled training rewrite's) torch's choice op is not asked (under FakeTensorMode it
    answers "math" where the real tensors get cuDNN, measured on the H200): the priority order is walked with the
    per-backend checks, each handed the SDPA parameters of the call."""
    import torch.backends.cuda as backends
    seen = []

    def check(backend):
        return lambda params: seen.append((backend, params.is_causal, params.enable_gqa)) or usable[backend]

    monkeypatch.setattr(torch._C, "_get_sdp_priority_order", lambda: list(order))
    monkeypatch.setattr(backends, "can_use_cudnn_attention", check(3))
    monkeypatch.setattr(backends, "can_use_flash_attention", check(1))
    monkeypatch.setattr(backends, "can_use_efficient_attention", check(2))
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kwargs: pytest.fail("asked the choice op"))
    with FakeTensorMode():
        q, k = (torch.empty(shape, dtype=bf, device="cuda") for shape in _sdpa_shapes(sq=256, skv=256))
        assert A._torch_backend(q, k, k, True, True) == expected
    checked = [backend for backend in order if backend != 0]  # math has no check: its enable flag
    last = checked.index({"cudnn": 3, "flash": 1, "efficient": 2}[expected]) if expected != "math" else -1
    assert seen == [(backend, True, True) for backend in checked[:last + 1 or None]]  # up to the one taken


# (what changes, keyword arguments of _sdpa_reason's case, expected fragment of the reason or None: routed)
TABLE = [
    ("decode GQA 32/8 Sq 1", {}, None),
    ("Sq 4, MiniMax 48/8", {"hq": 48, "sq": 4}, None),
    ("Sq 16", {"sq": 16}, None),
    ("equal heads without enable_gqa", {"hq": 8, "gqa": False}, None),
    ("float32", {"dtype": torch.float32}, "nvfly's attention takes bfloat16 or float16"),
    ("GQA without enable_gqa", {"gqa": False}, "32 query heads, 8 KV heads without enable_gqa"),
    ("heads not a multiple", {"hq": 12}, "12 query heads are not a multiple of 8 KV heads"),
    ("top-left causal", {"sq": 4, "causal": True}, "torch's causal mask is top-left aligned"),
    ("short cache", {"skv": 2048}, "8.0 MiB of K and V (< 16 MiB): launch-bound"),
    ("head dim 96", {"d": 96}, "nvfly's decode declines: attention.decode: q: head dim 96 is not supported"),
    ("grad", {"grad": True}, "an input requires grad at Sq = 1 (nvfly's decode has no backward"),
    ("3-D", {"rank3": True}, "q, k, v are not all 4-D"),
    # prefill: Sq > 16
    ("prefill Sq 17", {"batch": 8, "sq": 17}, None),
    ("prefill Llama 4K causal 32/8", {"sq": 4096, "skv": 4096, "causal": True}, None),
    ("prefill top-left causal Sq < Skv", {"sq": 1024, "skv": 4096, "causal": True}, None),
    ("prefill training", {"sq": 4096, "skv": 4096, "causal": True, "grad": True}, None),
    ("prefill DeepSeek 192/128 training", {"hq": 128, "hkv": 128, "sq": 4096, "skv": 4096, "d": 192, "dv": 128,
                                           "causal": True, "grad": True}, None),
    ("prefill head dim 80", {"sq": 4096, "skv": 4096, "d": 80},
     "nvfly's prefill declines: attention.prefill: q: head dim 80 is not supported"),
    ("prefill small", {"sq": 64, "skv": 64}, "GFLOP (< 4): launch-bound"),
    ("prefill few tiles", {"hq": 8, "hkv": 8, "sq": 256, "skv": 32768}, "16 query tiles of 128 rows (< 132"),
    ("prefill GQA without enable_gqa", {"sq": 4096, "skv": 4096, "gqa": False}, "without enable_gqa"),
]


@pytest.mark.parametrize("case,kw,expected", TABLE, ids=[c[0] for c in TABLE])
def test_sdpa_eligibility_table(fake_cuda, case, kw, expected):
    qs, ks = _sdpa_shapes(**{n: kw[n] for n in ("batch", "hq", "hkv", "sq", "skv", "d") if n in kw})
    if kw.get("rank3"):
        qs, ks = qs[1:], ks[1:]
    q, k = fake_cuda(qs, kw.get("dtype", bf)), fake_cuda(ks, kw.get("dtype", bf))
    v = fake_cuda(ks[:-1] + (kw["dv"],)) if "dv" in kw else k
    reason = A._sdpa_reason(q, k, v, kw.get("causal", False), kw.get("gqa", True), kw.get("grad", False))
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason, reason


def test_sdpa_sq1_stays_with_cudnn(fake_cuda, monkeypatch):
    q, k = fake_cuda(_sdpa_shapes()[0]), fake_cuda(_sdpa_shapes()[1])
    monkeypatch.setattr(A, "_torch_backend", lambda *args: "cudnn")
    assert "torch picks cuDNN" in A._sdpa_reason(q, k, k, False, True, False)
    q4 = fake_cuda(_sdpa_shapes(sq=4)[0])
    assert A._sdpa_reason(q4, k, k, False, True, False) is None  # Sq >= 2 goes to nvfly whatever torch picks
    monkeypatch.setenv("NVFLY_ROUTING_SDPA_CUDNN_SQ1", "1")  # the setting routes cuDNN's Sq = 1 calls too
    assert A._sdpa_reason(q, k, k, False, True, False) is None


@pytest.mark.parametrize("batch,sq,mask", [(1, 2, False), (1, 4, False), (1, 8, False), (8, 4, False),
                                            (8, 4, True)])
def test_speculative_decoding_rows_go_to_nvfly_where_torch_picks_cudnn(fake_cuda, monkeypatch, batch, sq, mask):
    """benchmarks/models.py's spec-decode rows: Sq 2-8 drafts over a 32K cache (Llama 32/8), with or without a padding
    mask over the batch, run nvfly's decode even where torch picks cuDNN; so does the drafts' own causality as a mask
    with a row per query (HF's), not one with a row per query and none per key."""
    monkeypatch.setattr(A, "_torch_backend", lambda *args: "cudnn")
    qs, ks = _sdpa_shapes(batch=batch, sq=sq)
    q, k = fake_cuda(qs), fake_cuda(ks)
    padding = fake_cuda((batch, 1, 1, 32768), torch.bool) if mask else None
    assert A._sdpa_reason(q, k, k, False, True, False, mask=padding) is None
    assert A._sdpa_reason(q, k, k, False, True, False, mask=fake_cuda((batch, 1, sq, 32768), torch.bool)) is None
    rows_only = fake_cuda((batch, 1, sq, 1), torch.bool)
    assert "none per key" in A._sdpa_reason(q, k, k, False, True, False, mask=rows_only)


def test_sdpa_prefill_stays_with_cudnn(fake_cuda, monkeypatch):
    q, k = fake_cuda(_sdpa_shapes(sq=4096, skv=4096)[0]), fake_cuda(_sdpa_shapes(sq=4096, skv=4096)[1])
    picked = []
    monkeypatch.setattr(A, "_torch_backend", lambda q, k, v, gqa, causal, mask=None: picked.append(causal) or "cudnn")
    assert "torch picks cuDNN, measured faster than nvfly's prefill" in A._sdpa_reason(q, k, k, True, True, False)
    assert picked == [True]  # asked with the call's is_causal


def test_sdpa_math_only_is_kept(fake_cuda):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k = fake_cuda(_sdpa_shapes()[0]), fake_cuda(_sdpa_shapes()[1])
    with sdpa_kernel([SDPBackend.MATH]):
        assert "allows only the math backend" in A._sdpa_reason(q, k, k, False, True, False)


def test_sdpa_eligibility_front_checks_and_decisions():
    q, k = torch.empty(1, 32, 1, 128, dtype=bf), torch.empty(1, 8, 32768, 128, dtype=bf)
    assert "q is on cpu" in A.sdpa_eligibility(q, k, k, torch.ones(1, 32768, dtype=torch.bool))
    assert "dropout_p=0.1" in A.sdpa_eligibility(q, k, k, None, 0.1)
    assert "scale=-0.5" in A.sdpa_eligibility(q, k, k, scale=-0.5)
    with FakeTensorMode() as mode:
        assert "FakeTensor, not a plain tensor" in A.sdpa_eligibility(mode.from_tensor(q), k, k)
    for _ in range(3):  # decided once per signature
        assert A.sdpa_eligibility(q, k, k, enable_gqa=True) == "q is on cpu, not CUDA"
    assert A.sdpa_eligibility(q, k, k, is_causal=True, enable_gqa=True) == "q is on cpu, not CUDA"
    recorded = [d for d in decisions() if d.op == "sdpa"]
    assert len(recorded) == 3 and recorded[1].shape == (1, 32, 8, 1, 32768, 128, 128)  # the masked call, then two
    assert "attn_mask (1, 32768) torch.bool" in recorded[0].problem
    assert recorded[1].where == "eager" and recorded[1].reason == "q is on cpu, not CUDA"
    assert "is_causal=True" in recorded[2].problem


def test_sdpa_run_failure_declines_the_signature():
    q, k = torch.randn(1, 4, 1, 64, dtype=bf), torch.randn(1, 2, 64, 64, dtype=bf)
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        A.sdpa_run(q, k, k, enable_gqa=True)
    reason = A.sdpa_eligibility(q, k, k, enable_gqa=True)
    assert reason.startswith("nvfly raised ValueError: attention.decode: q: on cpu")
    assert [d.reason for d in decisions() if d.op == "sdpa"] == [reason]


def test_sdpa_routes_are_registered_above_and_below_autograd():
    keys = {r.dispatch_key for r in routing.routes() if r.op == A.SDPA}
    assert keys == {"AutogradCUDA", "CUDA"}
    with nvfly.torch.routing():
        assert A.SDPA in routing.installed()
        for key in ("AutogradCUDA", "CUDA"):  # both fall through to torch's composite (read before registering)
            assert torch._C._dispatch_has_kernel_for_dispatch_key(A.SDPA, key)
            assert "CompositeImplicitAutograd" in repr(routing._FALLTHROUGHS[(A.SDPA, key)]), key
    # on a CPU-only torch the CUDA routes are registered too: CPU calls never reach them
    q = torch.randn(1, 2, 3, 16, requires_grad=True)
    with nvfly.torch.routing():
        out = F.scaled_dot_product_attention(q, q, q)
    out.sum().backward()
    assert q.grad is not None


# ---------------------------------------------------------------------------------------------- dispatch mechanics
class _Stub:
    """A route of SDPA on the CPU keys, its run torch's math kernel (counted) or raising."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def eligibility(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False):
        grad = torch.is_grad_enabled() and q.requires_grad
        return "an input requires grad" if grad else None

    def run(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        self.calls.append(torch.is_inference_mode_enabled())
        if self.fail:
            raise RuntimeError("injected launch failure")
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, scale=scale, enable_gqa=enable_gqa)[0]


@pytest.fixture
def cpu_route():
    """The stub routed on AutogradCPU and CPU as install_routing routes SDPA on CUDA (fallthroughs read first),
    decided once per ``sdpa_signature``, on a private library that is removed afterwards."""
    def install(stub):
        fallthroughs = {key: torch.library.get_kernel(A.SDPA, key) for key in ("AutogradCPU", "CPU")}
        for key, fallthrough in fallthroughs.items():
            route = routing.Route(A.SDPA, stub.eligibility, stub.run, key, A.sdpa_signature)
            library.impl("scaled_dot_product_attention", routing._routed(route, fallthrough), key, with_keyset=True)
    library = torch.library.Library("aten", "IMPL")
    yield install
    library._destroy()


def test_sdpa_signature_keeps_what_the_rule_reads():
    """The route decides once per sdpa_signature: every argument, flag and mode the rule reads changes it, the
    tensors' values do not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 32, 16)
    base = A.sdpa_signature(q, k, k, enable_gqa=True)
    assert A.sdpa_signature(torch.randn(1, 4, 1, 16), k, k, enable_gqa=True) == base
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        assert A.sdpa_signature(qg, k, k, enable_gqa=True) == base  # no gradient: the rule sees none
    with torch.inference_mode():
        assert A.sdpa_signature(q, k, k, enable_gqa=True) == base
    mask = torch.ones(1, 32, dtype=torch.bool)
    others = [A.sdpa_signature(qg, k, k, enable_gqa=True), A.sdpa_signature(q, k, k, is_causal=True, enable_gqa=True),
              A.sdpa_signature(q, k, k, enable_gqa=False), A.sdpa_signature(q, k, k, scale=0.5, enable_gqa=True),
              A.sdpa_signature(q, k, k, None, 0.1, enable_gqa=True), A.sdpa_signature(q, k, k, mask, enable_gqa=True),
              A.sdpa_signature(q, k, k, mask.float().requires_grad_(), enable_gqa=True),
              A.sdpa_signature(q, k.transpose(1, 2).contiguous().transpose(1, 2), k, enable_gqa=True),
              A.sdpa_signature(q.to(bf), k, k, enable_gqa=True),
              A.sdpa_signature(torch.randn(65)[1:].view(1, 4, 1, 16), k, k, enable_gqa=True)]  # 4 bytes in
    with sdpa_kernel([SDPBackend.MATH]):
        others.append(A.sdpa_signature(q, k, k, enable_gqa=True))
    with attention.api.plan_options(stages=4):  # what sdpa_bind's decode launches were planned with
        others.append(A.sdpa_signature(q, k, k, enable_gqa=True))
    assert len({base, *others}) == len(others) + 1


@pytest.mark.parametrize("case,kw,expected", TABLE, ids=[c[0] for c in TABLE])
def test_sdpa_skip_only_skips_what_the_rule_declines(fake_cuda, case, kw, expected):
    """The route's skip (before the signature) is True only where the rule declines, and on its launch-bound
    rows."""
    qs, ks = _sdpa_shapes(**{n: kw[n] for n in ("batch", "hq", "hkv", "sq", "skv", "d") if n in kw})
    if kw.get("rank3"):
        qs, ks = qs[1:], ks[1:]
    q, k = fake_cuda(qs, kw.get("dtype", bf)), fake_cuda(ks, kw.get("dtype", bf))
    v = fake_cuda(ks[:-1] + (kw["dv"],)) if "dv" in kw else k
    skipped = A.sdpa_skip(q, k, v, is_causal=kw.get("causal", False), enable_gqa=kw.get("gqa", True))
    reason = A._sdpa_reason(q, k, v, kw.get("causal", False), kw.get("gqa", True), kw.get("grad", False))
    assert not skipped or reason is not None
    assert skipped == (expected is not None and "launch-bound" in expected)


def test_sdpa_skip_at_the_limits(fake_cuda):
    """Decode: K and V bytes under MIN_KV_BYTES (the rule's kv_bytes); prefill: the rule's work under
    MIN_PREFILL_FLOPS (causal: the visible pairs)."""
    for skv, skipped in ((4095, True), (4096, False)):  # 8 KV heads of 128, bf16: 16 MiB at 4096 keys
        q, k = (fake_cuda(shape) for shape in _sdpa_shapes(sq=4, skv=skv))
        assert A.sdpa_skip(q, k, k, enable_gqa=True) is skipped
        assert ("launch-bound" in (A._sdpa_reason(q, k, k, False, True, False) or "")) is skipped
    q, k = fake_cuda((1, 32, 128, 128)), fake_cuda((1, 8, 128, 128))  # 2 * 256 * 32 * 128 * 128 = 0.27 GFLOP
    assert A.sdpa_skip(q, k, k, is_causal=True, enable_gqa=True)
    q, k = fake_cuda((1, 32, 512, 128)), fake_cuda((1, 8, 512, 128))  # 4.3 GFLOP, 2.2 causal
    assert A.sdpa_skip(q, k, k, is_causal=True, enable_gqa=True)
    assert "launch-bound" in A._sdpa_reason(q, k, k, True, True, False)
    assert not A.sdpa_skip(q, k, k, is_causal=False, enable_gqa=True)
    assert "launch-bound" not in (A._sdpa_reason(q, k, k, False, True, False) or "")
    for sq, skv in ((17, 17), (17, 4000), (300, 40), (2000, 1000), (130, 129)):  # around 4 GFLOP, both sides
        for causal in (False, True):
            for batch in (1, 3):
                q, k = fake_cuda((batch, 32, sq, 128)), fake_cuda((batch, 8, skv, 128))
                flops = attention.prefill_flops(batch, sq, skv, 32, 128, 128, causal, "top_left")
                assert A.sdpa_skip(q, k, k, is_causal=causal, enable_gqa=True) == (flops < A.MIN_PREFILL_FLOPS)


def test_sdpa_bind_runs_decode_launches_on_sdpas_tensors(monkeypatch):
    """An accepted decode signature without a mask binds ``attention.bound_decode`` once (heads-first: SDPA's
    (B, H, S, D) tensors as they are) and its runner passes each call's tensors and scale to the launches; a
    masked or prefill call runs sdpa_run; a failing bind declines the signature and records why."""
    bound = []

    def bound_decode(q, k, v, *, causal, heads_first):
        bound.append((tuple(q.shape), causal, heads_first))
        return lambda q, k, v, scale: ("launched", q, k, v, scale)

    monkeypatch.setattr(attention, "bound_decode", bound_decode)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 32, 16)
    runs = A.sdpa_bind(q, k, k, enable_gqa=True)
    assert bound == [((1, 4, 2, 16), False, True)]
    q2 = torch.randn(1, 4, 2, 16)
    launched = runs(q2, k, k, None, 0.0, False, scale=0.25, enable_gqa=True)
    assert launched[0] == "launched" and launched[1] is q2 and launched[2] is k and launched[4] == 0.25
    assert A.sdpa_bind(q, k, k, torch.ones(1, 32, dtype=torch.bool), enable_gqa=True) is A.sdpa_run
    assert A.sdpa_bind(torch.randn(1, 4, 17, 16), k, k, enable_gqa=True) is A.sdpa_run
    assert len(bound) == 1

    def broken(*args, **kwargs):
        raise RuntimeError("injected bind failure")

    monkeypatch.setattr(attention, "bound_decode", broken)
    with pytest.raises(RuntimeError, match="injected bind failure"):
        A.sdpa_bind(q, k, k, enable_gqa=True)
    assert A.sdpa_eligibility(q, k, k, enable_gqa=True) == "nvfly raised RuntimeError: injected bind failure"
    assert decisions()[-1].reason == "nvfly raised RuntimeError: injected bind failure"


def test_composite_routed_on_both_keys(cpu_route):
    stub = _Stub()
    cpu_route(stub)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16)
    want = F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert stub.calls == []  # routing off: torch's composite
    with nvfly.torch.routing():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, k, enable_gqa=True), want)
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        with torch.inference_mode():
            F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert stub.calls == [False, False, True]  # AutogradCPU twice, then CPU under inference_mode

    qg = q.clone().requires_grad_()
    with nvfly.torch.routing():
        out = F.scaled_dot_product_attention(qg, k, k, enable_gqa=True)
    out.sum().backward()  # declined: the composite, with torch's backward
    assert len(stub.calls) == 3 and qg.grad is not None and out.grad_fn is not None


def test_nvfly_exception_falls_back_to_torch(cpu_route, caplog):
    stub = _Stub(fail=True)
    cpu_route(stub)
    routing._WARNED.discard((A.SDPA, "RuntimeError"))  # warned once per op and error type: this test's own
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 8, 16)
    want = F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    with caplog.at_level(logging.WARNING, logger="nvfly"), nvfly.torch.routing():
        got = F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        again = F.scaled_dot_product_attention(q, k, k, enable_gqa=True)  # the signature is declined from now on
    assert stub.calls == [False]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)
    assert "injected launch failure" in caplog.text and "falls back to torch" in caplog.text


class _Route:
    """The real ``sdpa_run`` behind an eligibility that accepts every call (the CPU keys stand for CUDA's)."""

    def __init__(self):
        self.run = A.sdpa_run

    @staticmethod
    def eligibility(*args, **kwargs):
        return None


@pytest.mark.parametrize("sq,skv", [(40, 40), (50, 30)])
def test_training_through_the_route_uses_torchs_backward_on_nvflys_lse(cpu_route, monkeypatch, sq, skv):
    """A routed SDPA that needs gradients runs prefill (here its float32 reference on CPU, top-left causal) in an
    autograd.Function whose backward is torch's kernel on prefill's out and LSE: the gradients are unrouted SDPA's."""
    from nvfly.ops import attention
    calls = []

    def cpu_prefill(q, k, v, *, causal=False, scale=None, return_lse=False, causal_alignment="bottom_right"):
        calls.append((causal, scale, causal_alignment, return_lse))
        out, lse = attention.prefill_reference(q, k, v, causal=causal, scale=scale, causal_alignment=causal_alignment)
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)

    monkeypatch.setattr(A.attention, "prefill", cpu_prefill)
    cpu_route(_Route())
    torch.manual_seed(3)
    q = torch.randn(2, 8, sq, 64).to(bf).requires_grad_()
    k, v = (torch.randn(2, 2, skv, 64).to(bf).requires_grad_() for _ in range(2))
    with nvfly.torch.routing():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
    assert calls == [(True, 0.1, "top_left", True)] and out.shape == (2, 8, sq, 64)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.1, enable_gqa=True)
    want.backward(grad.float())
    assert _rel(out, want) < 1e-2
    for got, ref in zip((q, k, v), leaves):
        assert _rel(got.grad, ref.grad) < 2e-2
    with nvfly.torch.routing(), torch.no_grad():  # without gradients: prefill alone, no LSE
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1, enable_gqa=True)
    assert calls[-1] == (True, 0.1, "top_left", False)


# ---------------------------------------------------------------------------------------------- explain
def test_explain_sdpa_names_the_kernel_and_this_process_decisions():
    q, k = torch.empty(1, 32, 4096, 128, dtype=bf), torch.empty(1, 8, 4096, 128, dtype=bf)
    A.sdpa_eligibility(q, k, k, is_causal=True, enable_gqa=True)  # a decision for this shape (CPU: declined)
    report = nvfly.torch.explain_sdpa(1, 32, 8, 4096, 4096, 128, is_causal=True)
    assert report.kernel == "prefill" and "PrefillPlan(dqk=128, dv=128, causal=True" in report.plan
    assert [d.reason for d in report.decisions] == ["q is on cpu, not CUDA"]
    text = str(report)
    assert "eager sdpa q (1, 32, 4096, 128)" in text and "q is on cpu, not CUDA" in text
    if not torch.cuda.is_available():
        assert report.declined == "no CUDA GPU in this process (eligibility not checked)"
        assert report.verdict().startswith("torch's SDPA runs it: no CUDA GPU")
    assert nvfly.torch.explain_sdpa(2, 48, 8, 4, 32768, 128).kernel == "decode"
    assert nvfly.torch.explain_sdpa(1, 8, 8, 4096, 4096, 80).plan == "no plan for these head dims"
    assert not report.skipped and "launch-bound, handed to torch" not in text


def test_explain_sdpa_says_when_routing_skips_the_shape():
    """A launch-bound shape (the route's skip) says so: eager routing hands it to torch before its signature."""
    short = nvfly.torch.explain_sdpa(1, 32, 8, 4, 2048, 128)  # 8 MiB of K and V
    assert short.skipped and "eager routing: launch-bound, handed to torch's SDPA" in str(short)
    assert short.to_dict()["skipped"] is True
    assert not nvfly.torch.explain_sdpa(1, 32, 8, 4, 32768, 128).skipped


def test_explain_sdpa_command(capsys):
    from nvfly.cli import main
    assert main(["explain", "--sdpa", "1,128,128,4096,4096,192,128", "--causal", "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["kernel"] == "prefill" and doc["shape"]["dv"] == 128 and doc["is_causal"] is True
    for argv, message in ((["explain", "--sdpa", "1,2,3"], "expected B,HQ,HKV,SQ,SKV,D[,DV]"),
                          (["explain", "16", "4096", "4096", "--sdpa", "1,2,2,3,4,64"], "not both")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_explain_sdpa_with_a_mask_or_dropout(capsys):
    """explain takes SDPA's attn_mask (by kind) and dropout_p: dropout is declined with its reason on any machine,
    the mask is named in the report and the JSON, an unknown mask kind is an error naming the argument."""
    from nvfly.cli import main
    dropped = nvfly.torch.explain_sdpa(1, 32, 8, 4096, 4096, 128, dropout_p=0.1)
    assert dropped.declined == "dropout_p=0.1 (nvfly has no dropout)" and "dropout_p=0.1" in str(dropped)
    masked = nvfly.torch.explain_sdpa(2, 32, 8, 4, 32768, 128, attn_mask="padding")
    assert "attn_mask=a (B, 1, 1, Skv) boolean padding mask" in str(masked)
    assert masked.to_dict()["attn_mask"] == "padding"
    with pytest.raises(ValueError, match="attn_mask: expected one of padding, bool, additive"):
        nvfly.torch.explain_sdpa(1, 8, 8, 64, 64, 64, attn_mask="causal")
    assert main(["explain", "--sdpa", "2,32,8,4096,4096,128", "--mask", "additive", "--dropout", "0.2",
                 "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["attn_mask"] == "additive" and doc["declined"] == "dropout_p=0.2 (nvfly has no dropout)"


# ---------------------------------------------------------------------------------------------- torch.compile pass
def _sdpa_graph(target, q_shape, kv_shape, *, causal=True, lse_used=False, extra=()):
    """A post-grad-like graph: one fused SDPA node of ``target`` on placeholders with fake CUDA values."""
    import operator
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(name) for name in "qkv"]
    for node, shape in zip(nodes, (q_shape, kv_shape, kv_shape)):
        node.meta["val"] = torch.empty(shape, dtype=bf, device="cuda")
    sdpa = graph.call_function(target, (*nodes, *extra), {"is_causal": causal, "scale": None})
    outputs = [graph.call_function(operator.getitem, (sdpa, i)) for i in ((0, 1) if lse_used else (0,))]
    graph.output(tuple(outputs) if lse_used else outputs[0])
    return graph


def _targets(graph):
    return [n.target for n in graph.nodes if n.op == "call_function"]


def test_compile_pass_rewrites_prefill_and_decode_nodes(fake_cuda):
    from nvfly.torch import attention_compile as C
    aten = torch.ops.aten
    graph = _sdpa_graph(aten._scaled_dot_product_flash_attention.default, (1, 32, 4096, 128), (1, 8, 4096, 128))
    assert C.rewrite(graph) == 1
    (call,) = [n for n in graph.nodes if n.target is torch.ops.nvfly.attention_prefill.default]
    assert call.kwargs == {"causal": True, "scale": None, "causal_alignment": "top_left"}
    result = graph.output_node().args[0]
    assert result.target is aten.permute.default and result.meta["val"].shape == (1, 32, 4096, 128)
    assert aten._scaled_dot_product_flash_attention.default not in _targets(graph)
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason is None and decision.candidates == ("prefill",)
    assert decision.shape == (1, 32, 8, 4096, 4096, 128, 128) and "torch picked flash" in decision.problem

    decode = _sdpa_graph(aten._scaled_dot_product_efficient_attention.default, (1, 32, 4, 128), (1, 32, 32768, 128),
                         causal=False, extra=(None, False))
    assert C.rewrite(decode) == 1 and torch.ops.nvfly.attention_decode.default in _targets(decode)


def test_compile_pass_leaves_the_graph_as_it_was_when_the_rewrite_fails(fake_cuda, monkeypatch):
    """A failure inside the rewrite (here the op's fake, run for the new node's traced value) leaves the graph with
    torch's kernel, untouched, and records why: an nvfly failure never breaks the compile."""
    from nvfly.torch import attention_compile as C
    aten = torch.ops.aten
    graph = _sdpa_graph(aten._scaled_dot_product_flash_attention.default, (1, 32, 4096, 128), (1, 8, 4096, 128))
    before = [(n.op, n.target, n.args) for n in graph.nodes]

    def broken(*args, **kwargs):
        raise RuntimeError("injected")
    monkeypatch.setattr(torch.ops.nvfly.attention_prefill, "default", broken)
    assert C.rewrite(graph) == 0
    assert [(n.op, n.target, n.args) for n in graph.nodes] == before
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason == "the rewrite raised RuntimeError: injected" and decision.candidates == ()


@pytest.mark.parametrize("case,fragment", [
    ("cudnn", "torch picks cuDNN"),
    ("lse", "uses the kernel's other outputs"),
    ("dropout", "dropout_p=0.1"),
    ("offset", "not 16-byte aligned"),
])
def test_compile_pass_leaves_what_nvfly_loses_or_cannot_run(fake_cuda, case, fragment):
    from nvfly.torch import attention_compile as C
    aten = torch.ops.aten
    target = aten._scaled_dot_product_cudnn_attention.default if case == "cudnn" else \
        aten._scaled_dot_product_flash_attention.default
    extra = (None, False) if case == "cudnn" else (0.1,) if case == "dropout" else ()
    graph = _sdpa_graph(target, (1, 32, 4096, 128), (1, 8, 4096, 128), lse_used=case == "lse", extra=extra)
    if case == "offset":
        q = graph.find_nodes(op="placeholder")[0]
        q.meta["val"] = torch.empty(1, 32, 4096, 136, dtype=bf, device="meta")[..., 3:131]  # 6 bytes in
    assert C.rewrite(graph) == 0 and target in _targets(graph)
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert fragment in decision.reason, decision.reason


def _training_graph(q_shape, kv_shape):
    """A Dynamo-like (pre-grad) graph: F.scaled_dot_product_attention on placeholders whose fake CUDA
    ``example_value``s require grad."""
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(name) for name in "qkv"]
    for node, shape in zip(nodes, (q_shape, kv_shape, kv_shape)):
        node.meta["example_value"] = torch.empty(shape, dtype=bf, device="cuda").requires_grad_()
    sdpa = graph.call_function(torch._C._nn.scaled_dot_product_attention, tuple(nodes),
                               {"is_causal": True, "enable_gqa": True})
    graph.output(sdpa)
    return graph


@pytest.mark.parametrize("training", [False, True], ids=["post-grad", "pre-grad"])
def test_compile_passes_decide_whatever_fake_mode_is_active(monkeypatch, training):
    """On torch 2.11 Inductor's pre-grad pass runs while a fake mode other than the graph's example values' is active
    (the tracing context's): the rule runs on stand-ins made from the values' metadata, never on the graph's fake
    tensors (viewing those there raised "Mixing fake modes NYI" and the call stayed on torch)."""
    from torch._guards import TracingContext, tracing

    from nvfly.torch import attention_compile as C
    monkeypatch.setattr(A, "_torch_backend", lambda *args: "flash")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    shapes = (1, 32, 4096, 128), (1, 8, 4096, 128)
    with warnings.catch_warnings(), FakeTensorMode():  # the graph's fake mode
        warnings.simplefilter("ignore")
        graph = _training_graph(*shapes) if training else \
            _sdpa_graph(torch.ops.aten._scaled_dot_product_flash_attention.default, *shapes)
    active = FakeTensorMode()
    with tracing(TracingContext(active)), active:
        replaced = C.rewrite_training(graph) if training else C.rewrite(graph)
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason is None and replaced == 1
    op = torch.ops.nvfly.attention_prefill.default
    assert op in _targets(graph)
    if not training:  # the new nodes' values are computed in the graph's own fake mode
        (call,) = [n for n in graph.nodes if n.target is op]
        assert call.meta["val"][0].fake_mode is graph.find_nodes(op="placeholder")[0].meta["val"].fake_mode


def _rewritten_module(graph):
    """``graph`` after the compile pass, decided as on an H200 where torch picked the node's kernel (without the
    size floors), as a module to run on CPU tensors (nvfly's ops compute their float32 reference there)."""
    from nvfly.torch import attention_compile as C
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "MIN_PREFILL_FLOPS", 0)
        mp.setattr(A, "MIN_PREFILL_TILES", 0)
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert C.rewrite(graph) == 1
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_compile_pass_rewritten_graph_computes_sdpa():
    """The rewritten graph run on CPU tensors (nvfly's ops fall back to their float32 reference there) equals SDPA:
    the transposes and top-left causal alignment are right."""
    aten = torch.ops.aten
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        graph = _sdpa_graph(aten._scaled_dot_product_flash_attention.default, (1, 8, 40, 64), (1, 2, 56, 64))
    module = _rewritten_module(graph)
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 8, 40, 64).to(bf), torch.randn(1, 2, 56, 64).to(bf), torch.randn(1, 2, 56, 64).to(bf)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    got = module(q, k, v)
    assert got.shape == want.shape and _rel(got, want) < 1e-2


def _masked_sdpa_graph(q_shape, kv_shape, bias_shape, bias_dtype=bf):
    """A post-grad-like graph: torch's memory-efficient SDPA node with an attention bias (SDPA's attn_mask as it
    reaches the kernel), on placeholders with fake CUDA values."""
    import operator
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(name) for name in ("q", "k", "v", "bias")]
    for node, shape, dtype in zip(nodes, (q_shape, kv_shape, kv_shape, bias_shape), (bf, bf, bf, bias_dtype)):
        node.meta["val"] = torch.empty(shape, dtype=dtype, device="cuda")
    sdpa = graph.call_function(torch.ops.aten._scaled_dot_product_efficient_attention.default, (*nodes, False),
                               {"is_causal": False, "scale": None})
    graph.output(graph.call_function(operator.getitem, (sdpa, 0)))
    return graph


@pytest.mark.parametrize("sq", [4, 4096], ids=["decode", "prefill"])
def test_compile_pass_passes_the_attention_bias_to_nvflys_op(fake_cuda, sq):
    """A compiled SDPA with an attn_mask (its post-grad node's attn_bias) reaches nvfly's decode or prefill op with
    the bias as the op's attn_mask; a bias that does not broadcast to (B, H, Sq, Skv) stays on torch's kernel with
    the reason."""
    from nvfly.torch import attention_compile as C
    op = torch.ops.nvfly.attention_decode.default if sq == 4 else torch.ops.nvfly.attention_prefill.default
    graph = _masked_sdpa_graph((2, 32, sq, 128), (2, 32, 32768 if sq == 4 else 4096, 128), (2, 1, 1, 32768 if sq == 4
                                                                                          else 4096))
    assert C.rewrite(graph) == 1
    (call,) = [n for n in graph.nodes if n.target is op]
    assert call.kwargs["attn_mask"] is graph.find_nodes(op="placeholder")[3]
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason is None

    clear_decisions()
    wrong = _masked_sdpa_graph((2, 32, sq, 128), (2, 32, 4096, 128), (2, 32, sq, 100))
    assert C.rewrite(wrong) == 0
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert "does not broadcast to (B, Hq, Sq, Skv)" in decision.reason, decision.reason


def test_compile_pass_rewritten_masked_graph_computes_sdpa():
    """The rewritten graph of an SDPA with an additive bias (a row per query and key, a head broadcast), run on CPU
    tensors (nvfly's op computes its float32 reference there), equals SDPA with that attn_mask; the -inf entries
    (a boolean mask made additive) mask keys out."""
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        graph = _masked_sdpa_graph((2, 4, 40, 64), (2, 4, 56, 64), (2, 1, 40, 56))
    module = _rewritten_module(graph)
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 40, 64).to(bf), torch.randn(2, 4, 56, 64).to(bf), torch.randn(2, 4, 56, 64).to(bf)
    bias = torch.randn(2, 1, 40, 56).to(bf)
    bias[0, 0, :, 30:] = float("-inf")
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float())
    got = module(q, k, v, bias)
    assert got.shape == want.shape and _rel(got, want) < 1e-2


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_ops_take_sdpas_attn_mask(kind):
    """Both ops read SDPA's attn_mask over (B, Hq, Sq, Skv) (here computed by their float32 reference on CPU): decode
    with a padding mask (a column per key), prefill with a row per query; prefill's gradients with a mask (through
    the reference) are SDPA's; a mask that does not broadcast, of a wrong dtype, or with a paged cache is refused
    naming attn_mask."""
    torch.manual_seed(8)
    q, k, v = _decode_inputs(batch=2, sq=3, hq=8, hkv=2, skv=40)
    pad = torch.arange(40)[None, None, None, :] < torch.tensor([33, 40])[:, None, None, None]
    mask = pad if kind == "bool" else torch.zeros(pad.shape).masked_fill(~pad, float("-inf"))
    out, lse = torch.ops.nvfly.attention_decode(q, k, v, causal=False, attn_mask=mask)
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), attn_mask=mask,
                                          enable_gqa=True).transpose(1, 2)
    assert _rel(out, want) < 1e-2 and lse.shape == (2, 8, 3)

    leaves = [torch.randn(2, s, 4, 64).to(bf).requires_grad_() for s in (24, 32, 32)]
    rows = torch.rand(2, 1, 24, 32) > 0.3
    rows[..., 0] = True  # every query keeps a key
    mask = rows if kind == "bool" else torch.randn(2, 1, 24, 32).masked_fill(~rows, float("-inf"))
    out, _ = torch.ops.nvfly.attention_prefill(*leaves, mask)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact = [t.detach().float().transpose(1, 2).requires_grad_() for t in leaves]
    want = F.scaled_dot_product_attention(*exact, attn_mask=mask)
    want.backward(grad.float().transpose(1, 2))
    assert _rel(out, want.transpose(1, 2)) < 1e-2
    for mine, ref in zip(leaves, exact):
        assert _rel(mine.grad, ref.grad.transpose(1, 2)) < 2e-2

    with pytest.raises(ValueError, match="attn_mask of shape .* does not broadcast"):
        torch.ops.nvfly.attention_decode(q, k, v, attn_mask=torch.ones(2, 1, 3, 39, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask of dtype torch.int32"):
        torch.ops.nvfly.attention_prefill(*leaves, torch.ones(2, 1, 24, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="attn_mask: takes a contiguous cache without cache_seqlens"):
        torch.ops.nvfly.attention_decode(q, k, v, torch.tensor([30, 40]), attn_mask=pad)


def test_compile_pass_install_chains_and_keys_the_cache():
    from torch._inductor import config as inductor_config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from nvfly.torch import attention_compile as C

    class Prior(CustomGraphPass):
        calls = 0

        def __call__(self, graph):
            Prior.calls += 1

        def uuid(self):
            return "prior"

    with inductor_config.patch(post_grad_custom_pre_pass=Prior(), pre_grad_custom_pass=None):
        C.install()
        C.install()  # idempotent
        current = inductor_config.post_grad_custom_pre_pass
        assert isinstance(current, C.SdpaPass) and isinstance(current.prior, Prior) and C.installed()
        assert isinstance(inductor_config.pre_grad_custom_pass, C.SdpaTrainingPass)
        key = current.uuid()
        assert key[0].startswith("nvfly-sdpa-") and key[1] == "prior"
        assert inductor_config.pre_grad_custom_pass.uuid()[0].startswith("nvfly-sdpa-training-")
        current(torch.fx.Graph())
        assert Prior.calls == 1
        C.uninstall()
        assert isinstance(inductor_config.post_grad_custom_pre_pass, Prior) and not C.installed()
        assert inductor_config.pre_grad_custom_pass is None


def test_compile_pass_end_to_end_through_inductor(monkeypatch):
    """torch.compile with the pass installed, on CPU: the CPU flash node stands for CUDA's (FUSED) and the rule
    accepts it; Inductor compiles the rewritten graph into a call of nvfly's op (computing its float32 reference on
    CPU), with SDPA's result."""
    from torch._inductor.utils import run_and_get_code

    from nvfly.torch import attention_compile as C
    monkeypatch.setattr(C, "FUSED", {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "flash"})
    monkeypatch.setattr(A, "_sdpa_reason", lambda *args, **kwargs: None)

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    torch.manual_seed(4)
    q, k, v = torch.randn(1, 8, 40, 64).to(bf), torch.randn(1, 8, 56, 64).to(bf), torch.randn(1, 8, 56, 64).to(bf)
    torch._dynamo.reset()
    C.install()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):  # the pass runs (a cached graph would skip it)
            got, codes = run_and_get_code(torch.compile(layer), q, k, v)
    finally:
        C.uninstall()
        torch._dynamo.reset()
    assert any("nvfly.attention_prefill" in code for code in codes)
    assert _rel(got, layer(q.float(), k.float(), v.float())) < 1e-2
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason is None and decision.shape == (1, 8, 8, 40, 56, 64, 64)


def test_compiled_training_through_inductor(monkeypatch):
    """torch.compile of a layer whose inputs require grad, on CPU: the pre-grad pass puts nvfly's prefill op (its
    float32 reference on CPU) in the graph, AOTAutograd traces its registered backward (torch's CPU flash backward on
    the op's LSE here; flash or memory-efficient on CUDA): output and gradients are eager SDPA's."""
    from torch._inductor.utils import run_and_get_code

    from nvfly.torch import attention_compile as C
    monkeypatch.setattr(A, "_sdpa_reason", lambda *args, **kwargs: None)

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2) * 2

    torch.manual_seed(6)
    leaves = [torch.randn(1, 8, s, 64).to(bf).requires_grad_() for s in (40, 56, 56)]
    grad = torch.randn(1, 8, 40, 64).to(bf)
    torch._dynamo.reset()
    C.install()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            compiled = torch.compile(layer)

            def step():
                out = compiled(*leaves)
                out.backward(grad)  # compiles the backward graph too
                return out

            got, codes = run_and_get_code(step)
    finally:
        C.uninstall()
        torch._dynamo.reset()
    assert any("nvfly.attention_prefill" in code for code in codes)
    assert any("flash_attention_for_cpu_backward" in code for code in codes)
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    want = layer(*f32)
    want.backward(grad.float())
    assert _rel(got, want) < 1e-2
    for mine, exact in zip(leaves, f32):
        assert _rel(mine.grad, exact.grad) < 2e-2
    (decision,) = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason is None and "(training)" in decision.problem


def test_a_refusing_backward_kernel_falls_back_to_the_reference(monkeypatch, caplog):
    """Should torch's backward kernel refuse nvfly's tensors at run time, autograd through the float32 reference
    computes the gradients (and a warning says why): training never breaks."""
    from nvfly.torch import attention_backward as B

    def refuse(*args, **kwargs):
        raise RuntimeError("injected: kernel refused")

    monkeypatch.setattr(B, "_cpu_flash", refuse)
    q, k, v = _prefill_inputs(sq=30, skv=50, grad=True)
    with caplog.at_level(logging.WARNING, logger="nvfly"):
        out, _ = torch.ops.nvfly.attention_prefill(q, k, v, causal=True, causal_alignment="top_left")
        grad = torch.randn_like(out)
        out.backward(grad)
    assert "injected: kernel refused" in caplog.text and "float32 reference" in caplog.text
    want, leaves = _sdpa_f32(q, k, v, is_causal=True)
    want.backward(grad.float())
    for got, ref in zip((q.grad, k.grad, v.grad), leaves):
        assert got.dtype == bf and _rel(got, ref.grad) < 2e-2
