"""nvfly.ops.common.opcall, the host op-call mechanism (signature -> bounded plan cache -> prepared launch), and
the ops that plan through it: bounded, one plan per signature (layouts, dtypes and scalars tell signatures apart), a
hit skips planning, argument errors in the caller's order naming the op and the argument, eligibility reasons."""
import threading

import pytest
import torch

from nvfly.ops import gemm, rmsnorm, topk
from nvfly.ops.common import operands
from nvfly.ops.common.opcall import Declined, OpCalls, named
from nvfly.ops.gemm import api as gemm_api
from nvfly.ops.rmsnorm import api as rmsnorm_api
from nvfly.ops.topk import api as topk_api


# ---------------------------------------------------------------------------------------------- the cache
def test_a_full_cache_starts_again_and_stays_bounded():
    calls = OpCalls(limit=3)
    for i in range(3):
        calls.remember(i, f"plan {i}")
    assert len(calls) == 3 and calls.get(2) == "plan 2"
    calls.remember(2, "plan 2 again")  # a key it holds: replaced, nothing dropped
    assert len(calls) == 3 and calls.get(2) == "plan 2 again"
    calls.remember(3, "plan 3")
    assert len(calls) == 1 and calls.get(3) == "plan 3" and calls.get(0) is None


def test_a_miss_plans_once_and_a_hit_skips_planning():
    made = []

    def make(x, k):
        made.append((x, k))
        return ("plan", x, k)
    calls = OpCalls()
    assert calls.get_or_plan("op", ("sig", 1), make, 1, 2) == ("plan", 1, 2)
    assert calls.get_or_plan("op", ("sig", 1), make, 1, 2) == ("plan", 1, 2)
    assert made == [(1, 2)]
    assert calls.plan("op", None, make, 3, 4) == ("plan", 3, 4)  # no key (unhashable arguments): not remembered
    assert len(calls) == 1 and ("sig", 1) in calls and calls.values() == [("plan", 1, 2)]


def test_planning_errors_name_the_op_once():
    def bad(_):
        raise ValueError("k: expected an int")
    calls = OpCalls()
    with pytest.raises(ValueError, match=r"^nvfly.ops.x.f: k: expected an int$"):
        calls.plan("nvfly.ops.x.f", "key", bad, 1)
    assert len(calls) == 0  # a failed plan is not remembered: the next call checks again
    with pytest.raises(TypeError, match=r"^op: x$"):  # named twice: prefixed once
        with named("op"), named("op"):
            raise TypeError("x")

    class Custom(ValueError):
        pass
    with pytest.raises(Custom, match=r"^custom$"):  # subclasses keep their message
        with named("op"):
            raise Custom("custom")
    with pytest.raises(KeyError):  # other errors pass unchanged
        with named("op"):
            raise KeyError("x")


def test_concurrent_stores_stay_bounded():
    calls = OpCalls(limit=64)
    errors = []

    def fill(start):
        try:
            for i in range(2000):
                calls.remember((start, i), i)
                calls.get((start, i))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and 0 < len(calls) <= 64


def test_declined_is_its_reason():
    d = Declined("a is on cpu, not CUDA")
    assert str(d) == d.reason == "a is on cpu, not CUDA" and d == Declined("a is on cpu, not CUDA")


# ---------------------------------------------------------------------------------------------- the ops' signatures
@pytest.fixture
def counted(recorded_launches, monkeypatch):
    """recorded_launches (conftest), the ops' caches emptied, and how often each op planned."""
    counts = {"rms_norm": 0, "topk": 0, "matmul": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(rmsnorm_api, "_forward_plan", counting("rms_norm", rmsnorm_api._forward_plan))
    monkeypatch.setattr(topk_api, "_plan_call", counting("topk", topk_api._plan_call))
    monkeypatch.setattr(gemm_api, "_new_call", counting("matmul", gemm_api._new_call))
    monkeypatch.setattr(gemm_api, "eligibility", lambda *args, **kwargs: None)  # CPU tensors "launch"
    for cache in (rmsnorm_api._FORWARD, topk_api._TOPK, gemm_api._CALLS):
        cache.clear()
    yield counts
    for cache in (rmsnorm_api._FORWARD, topk_api._TOPK, gemm_api._CALLS):
        cache.clear()


def test_signatures_tell_layouts_dtypes_and_scalars_apart(counted):
    bf = torch.bfloat16
    x = torch.randn(8, 256).to(bf)
    variants = [lambda: rmsnorm.rms_norm(x), lambda: rmsnorm.rms_norm(x.half()),
                lambda: rmsnorm.rms_norm(torch.randn(8, 300).to(bf)[:, :256]),  # strided rows
                lambda: rmsnorm.rms_norm(torch.randn(4, 256).to(bf)),  # shape
                lambda: rmsnorm.rms_norm(x, eps=1e-6), lambda: rmsnorm.rms_norm(x, eps=1e-5),
                lambda: rmsnorm.rms_norm(x, eps=1), lambda: rmsnorm.rms_norm(x, eps=1.0)]  # 1 == 1.0, another type
    for call in variants:
        call()
    assert counted["rms_norm"] == len(rmsnorm_api._FORWARD) == len(variants)
    for call in variants:
        call()
    assert counted["rms_norm"] == len(variants)  # every one a hit
    for k, dim, largest in ((4, -1, True), (5, -1, True), (4, 0, True), (4, -1, False)):
        topk.topk(x, k, dim, largest)
        topk.topk(torch.randn(8, 256).to(bf), k, dim, largest)
    assert counted["topk"] == len(topk_api._TOPK) == 4


def test_a_gemm_hit_skips_planning(counted, monkeypatch):
    monkeypatch.setattr(gemm.skinny_plan, "current_stream", lambda device: 0)
    a, b = torch.randn(4, 512).bfloat16(), torch.randn(256, 512).bfloat16().t()  # the skinny kernel's
    gemm.matmul(a, b)
    gemm.matmul(torch.randn(4, 512).bfloat16(), torch.randn(256, 512).bfloat16().t())
    assert counted["matmul"] == 1
    gemm.matmul(a, b, alpha=0.5)  # scaled: another signature
    gemm.matmul(a[:2], b)  # M
    gemm.matmul(a, b.contiguous())  # B's major
    assert counted["matmul"] == len(gemm_api._CALLS) == 4


# ---------------------------------------------------------------------------------------------- errors and reasons
def _error(fn):
    with pytest.raises((TypeError, ValueError)) as info:
        fn()
    return info.type, str(info.value)


def test_gemm_errors_come_in_the_callers_order_and_name_the_op():
    a, b = torch.randn(8, 16).bfloat16(), torch.randn(16, 32).bfloat16()
    assert _error(lambda: gemm.matmul(a, torch.randn(32, 8).bfloat16())) == (
        ValueError, "nvfly.ops.gemm.matmul: b: shape (32, 8) and a's (8, 16) do not multiply (K is 16 in a, 32 in b)")
    assert _error(lambda: gemm.matmul(a.float(), b.float())) == (
        TypeError, "nvfly.ops.gemm.matmul: a: dtype torch.float32 is not supported: nvfly's GEMM takes bf16 or fp16 "
                   "operands")
    assert _error(lambda: gemm.matmul(a, b.half())) == (
        TypeError, "nvfly.ops.gemm.matmul: b: dtype torch.float16 differs from a's torch.bfloat16")
    assert _error(lambda: gemm.matmul(a, b, c=torch.randn(7).bfloat16())) == (
        ValueError, "nvfly.ops.gemm.matmul: c: shape (7,) does not broadcast to the output's (8, 32)")
    assert _error(lambda: gemm.matmul(a, b, out=torch.empty(8, 31).bfloat16())) == (
        ValueError, "nvfly.ops.gemm.matmul: out: expected shape (8, 32), got (8, 31)")
    assert _error(lambda: gemm.matmul(a, b, activation="tanh"))[1].startswith("nvfly.ops.gemm.matmul: activation:")
    assert _error(lambda: gemm.matmul(a, [1.0])) == (
        TypeError, "nvfly.ops.gemm.matmul: b: expected a torch.Tensor, got list")
    assert _error(lambda: gemm.matmul(a, b)) == (ValueError, "nvfly.ops.gemm.matmul: a is on cpu, not CUDA")
    assert _error(lambda: gemm.path(a, b)) == (ValueError, "nvfly.ops.gemm.path: a is on cpu, not CUDA")
    assert _error(lambda: gemm.bind(a, b.t())) == (
        ValueError, "nvfly.ops.gemm.bind: b: shape (32, 16) and a's (8, 16) do not multiply (K is 16 in a, 32 in b)")
    assert _error(lambda: gemm.path(a, b, skinny=True, config=gemm.GemmConfig()))[1].startswith(
        "nvfly.ops.gemm.path: ")


def test_gemm_eligibility_reasons_come_in_the_same_order(monkeypatch):
    monkeypatch.setattr(operands, "capability", lambda device: (9, 0))
    cuda = torch.device("cuda", 0)

    def meta(shape, strides, dtype=torch.bfloat16, device=cuda):
        from nvfly.torch.gemm_ops import TensorInfo
        return TensorInfo(shape, strides, dtype, device)
    a, b = meta((8, 16), (16, 1)), meta((16, 32), (32, 1))
    assert gemm.eligibility(a, b) is None
    assert "do not multiply" in gemm.eligibility(a, meta((32, 8), (8, 1), device=torch.device("cpu")))
    assert gemm.eligibility(meta((8, 16), (16, 1), torch.float32, torch.device("cpu")),
                            meta((16, 32), (32, 1), torch.float32)).startswith("a: dtype torch.float32")
    assert gemm.eligibility(a, meta((16, 32), (32, 1), device=torch.device("cpu"))) == "b is on cpu, a on cuda:0"
    assert gemm.eligibility(a, meta((16, 32), (64, 2))) == "b: neither of its last two dimensions is contiguous"
    monkeypatch.setattr(operands, "capability", lambda device: (8, 0))
    assert gemm.eligibility(a, meta((16, 32), (64, 2))) == \
        "a is on an sm_80 GPU: nvfly's GEMM needs an sm_90 (Hopper) GPU"  # the device before the layouts


def test_rms_norm_blames_the_argument_passed():
    x = torch.randn(4, 16)
    assert _error(lambda: rmsnorm.rms_norm(x, torch.randn(8))) == (
        ValueError, "nvfly.ops.rmsnorm.rms_norm: weight: shape (8,) must be non-empty and match the last dimensions "
                    "of x, whose shape is (4, 16)")
    assert _error(lambda: rmsnorm.rms_norm(x, torch.randn(8), normalized_shape=(16,))) == (
        ValueError, "nvfly.ops.rmsnorm.rms_norm: weight: expected shape (16,) (normalized_shape), got (8,)")
    assert _error(lambda: rmsnorm.rms_norm(x, normalized_shape=(8,)))[1].startswith(
        "nvfly.ops.rmsnorm.rms_norm: normalized_shape: (8,) must")
    assert _error(lambda: rmsnorm.rms_norm(x.double(), torch.randn(8).double()))[1].startswith(
        "nvfly.ops.rmsnorm.rms_norm: weight: shape")  # the shape before the dtype
    assert _error(lambda: rmsnorm.rms_norm_forward(x.double())) == (
        TypeError, "nvfly.ops.rmsnorm.rms_norm_forward: x: dtype torch.float64 is not supported (bfloat16, float16, "
                   "float32)")
    assert _error(lambda: rmsnorm.rms_norm(x, residual=x.half())) == (
        TypeError, "nvfly.ops.rmsnorm.rms_norm: residual: expected dtype torch.float32 (x's), got torch.float16")
    assert _error(lambda: rmsnorm.rms_norm_backward(x, x, torch.randn(4).double())) == (
        TypeError, "nvfly.ops.rmsnorm.rms_norm_backward: rstd: expected dtype torch.float32, got torch.float64")
    assert _error(lambda: rmsnorm.rms_norm_backward(x, x, torch.randn(4), grad_residual=torch.randn(4, 8)))[1] == (
        "nvfly.ops.rmsnorm.rms_norm_backward: grad_residual: expected shape (4, 16) (x's), got (4, 8)")
    assert rmsnorm.eligibility(x, torch.randn(8)).startswith("weight: shape (8,)")
    assert rmsnorm.eligibility(x, eps=-1.0).startswith("eps:")


def test_topk_names_itself():
    x = torch.randn(4, 16)
    assert _error(lambda: topk.topk(x, 17)) == (
        ValueError, "nvfly.ops.topk.topk: k: expected an int in [0, 16] (the size of dimension 1), got 17")
    assert _error(lambda: topk.topk(x.double(), 2)) == (
        TypeError, "nvfly.ops.topk.topk: x: dtype torch.float64 is not supported (bfloat16, float16, float32)")
    assert topk.eligibility(x.double(), 17).startswith("k:")  # the shape before the dtype
