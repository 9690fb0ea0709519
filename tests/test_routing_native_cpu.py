"""The routes' C++ kernel (``nvfly/torch/native_routes.py``, issue 28): a call the Python kernel declined leaves its
key, and later calls with that key go to torch's kernel without entering Python; every call it accepted, and every
call whose key is new, still reaches Python. CPU only: a test route of aten::topk on the CPU key counts the calls
reaching its Python kernel."""
from __future__ import annotations

import pytest
import torch

import nvfly.torch
from nvfly.torch import native_routes, routing

TOPK = "aten::topk"

pytestmark = pytest.mark.skipif(native_routes.module() is None,
                                reason="the C++ route kernel cannot be built here (no compiler)")


@pytest.fixture
def topk_route():
    """A route of aten::topk on the CPU key, its Python kernel counted (``calls``); ``accept`` (a one-item list)
    says whether its eligibility runs nvfly (here: the values and indices by a full sort) or declines."""
    calls, accept = [], [False]

    def eligibility(x, k, dim=-1, largest=True, sorted=True):
        return None if accept[0] else "the test declines"

    def run(x, k, dim=-1, largest=True, sorted=True):
        values, indices = x.sort(dim, descending=largest)
        return values.narrow(dim, 0, k).clone(), indices.narrow(dim, 0, k).clone()

    def signature(x, k, dim=-1, largest=True, sorted=True):
        return routing.tensor_key(x), k, dim, largest, sorted

    routing.register_route(TOPK, eligibility, run, "CPU", signature=signature)
    routed = routing._routed(routing._ROUTES[(TOPK, "CPU")], torch.library.get_kernel(TOPK, "CPU"))

    def kernel(keyset, *args, **kwargs):
        calls.append(args[1])
        return routed(keyset, *args, **kwargs)

    routing._KERNELS[(TOPK, "CPU")] = kernel
    yield calls, accept
    with routing._LOCK:
        for table in (routing._ROUTES, routing._KERNELS, routing._FALLTHROUGHS):
            table.pop((TOPK, "CPU"), None)
        routing._forget_plan(force=True)


def kept_calls(fn, times: int) -> int:
    """How many of ``times`` calls of ``fn`` the C++ kernels sent to torch without entering Python."""
    before = native_routes.loaded().hits()
    for _ in range(times):
        fn()
    return native_routes.loaded().hits() - before


def test_the_route_is_registered_as_the_cpp_kernel(topk_route):
    with nvfly.torch.routing():
        assert "native/route_kernel.cpp" in repr(torch.library.get_kernel(TOPK, "CPU"))
    assert "native/route_kernel.cpp" not in repr(torch.library.get_kernel(TOPK, "CPU"))


def test_a_declined_key_goes_to_torch_without_python(topk_route):
    calls, _ = topk_route
    x = torch.randn(6, 40)
    want = torch.topk(x, 5)
    with nvfly.torch.routing():
        assert kept_calls(lambda: torch.topk(x, 5), 1) == 0 and calls == [5]  # decided (declined) in Python
        assert kept_calls(lambda: torch.topk(x, 5), 4) == 4 and calls == [5]  # then kept
        got = torch.topk(x, 5)
        with nvfly.torch.routing(False):
            assert kept_calls(lambda: torch.topk(x, 5), 1) == 1  # switched off: torch's kernel either way
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)


def test_accepted_calls_always_reach_python(topk_route):
    calls, accept = topk_route
    accept[0] = True
    x = torch.randn(3, 64)
    want = torch.topk(x, 4)
    with nvfly.torch.routing():
        assert kept_calls(lambda: torch.topk(x, 4), 5) == 0 and calls == [4] * 5
        got = torch.topk(x, 4)
        with nvfly.torch.routing(False):  # switched off: torch's kernel, read from C++ (Python not entered)
            assert kept_calls(lambda: torch.topk(x, 4), 2) == 2 and calls == [4] * 6
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)


@pytest.mark.parametrize("change", ["shape", "strides", "dtype", "scalar", "grad_mode", "requires_grad"])
def test_any_change_the_key_holds_reaches_python_again(topk_route, change):
    calls, _ = topk_route
    x = torch.randn(8, 32)
    other = {"shape": lambda: torch.topk(torch.randn(8, 33), 3),
             "strides": lambda: torch.topk(torch.randn(32, 8).t(), 3),
             "dtype": lambda: torch.topk(x.double(), 3),
             "scalar": lambda: torch.topk(x, 2),
             "grad_mode": lambda: torch.no_grad()(torch.topk)(x, 3),
             "requires_grad": lambda: torch.topk(x.clone().requires_grad_(), 3)}[change]
    with nvfly.torch.routing():
        torch.topk(x, 3)
        assert kept_calls(lambda: torch.topk(x, 3), 1) == 1
        entered = len(calls)
        assert kept_calls(other, 1) == 0 and len(calls) == entered + 1


def test_forgetting_decisions_drops_the_kept_keys(topk_route):
    calls, accept = topk_route
    x = torch.randn(2, 16)
    with nvfly.torch.routing():
        torch.topk(x, 3)
        assert kept_calls(lambda: torch.topk(x, 3), 2) == 2
        accept[0] = True  # the rule changed: forget_decisions is what makes routing see it
        routing.forget_decisions()
        assert kept_calls(lambda: torch.topk(x, 3), 2) == 0 and len(calls) == 3


def test_a_layers_declined_sdpa_and_rms_norm_are_kept():
    """nvfly's own routes, registered on the CPU keys: CPU calls are declined ("not CUDA") once a key, then kept."""
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 1, 32, 16)
    x, w = torch.randn(8, 64), torch.randn(64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True), \
        torch.nn.functional.rms_norm(x, (64,), w)

    def step():
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True), \
            torch.nn.functional.rms_norm(x, (64,), w)

    with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}), nvfly.torch.routing():
        step()
        assert kept_calls(step, 3) == 6
        got = step()
    assert all(torch.equal(g, w_) for g, w_ in zip(got, want))


def test_without_the_extension_the_python_kernels_route(topk_route, monkeypatch):
    calls, _ = topk_route
    monkeypatch.setenv("NVFLY_ROUTING_NATIVE", "0")
    x = torch.randn(4, 10)
    with nvfly.torch.routing():
        assert "nvfly/torch/routing.py" in repr(torch.library.get_kernel(TOPK, "CPU"))
        for _ in range(3):
            torch.topk(x, 2)
    assert calls == [2, 2, 2]
