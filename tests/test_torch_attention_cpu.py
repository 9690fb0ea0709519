"""Decode attention from PyTorch without a GPU: ``nvfly::attention_decode`` (torch fallback equal to SDPA, fake
shapes, tracing by torch.compile; its fake's errors are tested in test_fake_parity_cpu.py) and the eager SDPA route: its eligibility table and reasons (on fake CUDA
tensors), the decisions it records, its failure bookkeeping, and the dispatch mechanics of a composite op routed
on an autograd key and a backend key (exercised on the CPU keys: fallthrough, inference_mode, autograd kept,
an nvfly exception falling back)."""
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly.torch
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


# ---------------------------------------------------------------------------------------------- SDPA eligibility
def _sdpa_shapes(batch=1, hq=32, hkv=8, sq=1, skv=32768, d=128):
    return (batch, hq, sq, d), (batch, hkv, skv, d)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake CUDA tensors (no GPU) and torch's backend choice pinned to flash (``_fused_sdp_choice`` needs a GPU)."""
    monkeypatch.setattr(A, "_torch_backend", lambda *args: "flash")
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")  # data_ptr of a FakeTensor (0): the alignment check reads it
        yield lambda shape, dtype=bf: torch.empty(shape, dtype=dtype, device="cuda")


# (what changes, keyword arguments of _sdpa_reason's case, expected fragment of the reason or None: routed)
TABLE = [
    ("decode GQA 32/8 Sq 1", {}, None),
    ("Sq 4, MiniMax 48/8", {"hq": 48, "sq": 4}, None),
    ("Sq 16", {"sq": 16}, None),
    ("equal heads without enable_gqa", {"hq": 8, "gqa": False}, None),
    ("Sq 17", {"sq": 17}, "Sq = 17 query tokens: decode takes 1 to 16"),
    ("float32", {"dtype": torch.float32}, "nvfly's decode takes bfloat16 or float16"),
    ("GQA without enable_gqa", {"gqa": False}, "32 query heads, 8 KV heads without enable_gqa"),
    ("heads not a multiple", {"hq": 12}, "12 query heads are not a multiple of 8 KV heads"),
    ("top-left causal", {"sq": 4, "causal": True}, "torch's causal mask is top-left aligned"),
    ("short cache", {"skv": 2048}, "8.0 MiB of K and V (< 16 MiB): launch-bound"),
    ("head dim 96", {"d": 96}, "nvfly's decode declines: attention.decode: q: head dim 96 is not supported"),
    ("grad", {"grad": True}, "an input requires grad"),
    ("3-D", {"rank3": True}, "q, k, v are not all 4-D"),
]


@pytest.mark.parametrize("case,kw,expected", TABLE, ids=[c[0] for c in TABLE])
def test_sdpa_eligibility_table(fake_cuda, case, kw, expected):
    qs, ks = _sdpa_shapes(**{n: kw[n] for n in ("hq", "sq", "skv", "d") if n in kw})
    if kw.get("rank3"):
        qs, ks = qs[1:], ks[1:]
    q, k = fake_cuda(qs, kw.get("dtype", bf)), fake_cuda(ks, kw.get("dtype", bf))
    reason = A._sdpa_reason(q, k, k, kw.get("causal", False), kw.get("gqa", True), kw.get("grad", False))
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


def test_sdpa_math_only_is_kept(fake_cuda):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k = fake_cuda(_sdpa_shapes()[0]), fake_cuda(_sdpa_shapes()[1])
    with sdpa_kernel([SDPBackend.MATH]):
        assert "allows only the math backend" in A._sdpa_reason(q, k, k, False, True, False)


def test_sdpa_eligibility_front_checks_and_decisions():
    q, k = torch.empty(1, 32, 1, 128, dtype=bf), torch.empty(1, 8, 32768, 128, dtype=bf)
    assert "attn_mask is given" in A.sdpa_eligibility(q, k, k, torch.ones(1, 32768, dtype=torch.bool))
    assert "dropout_p=0.1" in A.sdpa_eligibility(q, k, k, None, 0.1)
    with FakeTensorMode() as mode:
        assert "FakeTensor, not a plain tensor" in A.sdpa_eligibility(mode.from_tensor(q), k, k)
    for _ in range(3):  # decided once per signature
        assert A.sdpa_eligibility(q, k, k, enable_gqa=True) == "q is on cpu, not CUDA"
    assert A.sdpa_eligibility(q, k, k, is_causal=True, enable_gqa=True) == "q is on cpu, not CUDA"
    recorded = [d for d in decisions() if d.op == "sdpa"]
    assert len(recorded) == 2 and recorded[0].shape == (1, 32, 8, 1, 32768, 128, 128)
    assert recorded[0].where == "eager" and recorded[0].reason == "q is on cpu, not CUDA"
    assert "is_causal=True" in recorded[1].problem


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
        assert "CompositeImplicitAutograd" in repr(routing._INSTALLED[(A.SDPA, key)]), key
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
    on a private library that is removed afterwards."""
    def install(stub):
        fallthroughs = {key: torch.library.get_kernel(A.SDPA, key) for key in ("AutogradCPU", "CPU")}
        for key, fallthrough in fallthroughs.items():
            route = routing.Route(A.SDPA, stub.eligibility, stub.run, key)
            library.impl("scaled_dot_product_attention", routing._routed(route, fallthrough), key, with_keyset=True)
    library = torch.library.Library("aten", "IMPL")
    yield install
    library._destroy()


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
    assert stub.calls == [False]
    torch.testing.assert_close(got, want)
    assert "injected launch failure" in caplog.text and "falls back to torch" in caplog.text
