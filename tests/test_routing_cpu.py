"""Eager routing's registrations (issue 28): the routes are registered with torch's dispatcher only while a
``routing()`` block or ``enable_routing()`` is in force, in any thread, and removed after, so that torch calls
outside routing cost what they cost without nvfly; nested blocks, threads, the decisions cache across blocks, the GEMM
routes wanted only while the autotune database has an entry where nvfly wins, and explain. CPU only: the routes are
registered on the CUDA keys of this CPU build (the dispatcher keeps its tables for them), and a test route on the CPU
key counts the calls that reach it."""
from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly.torch
from nvfly.torch import routing
from nvfly.torch.autotune import Database, Entry
from nvfly.torch.gemm_ops import Workload

TOPK = "aten::topk"


def ours(op: str, key: str) -> bool:
    """Whether the dispatcher's kernel for ``op`` on ``key`` is one routing registered (its Python kernel or the C++
    route kernel)."""
    kernel = repr(torch.library.get_kernel(op, key))
    return "nvfly/torch/routing.py" in kernel or "nvfly/torch/native/route_kernel.cpp" in kernel


def drop_route(key):
    """Remove a test's route (and its registration, inside a block)."""
    with routing._LOCK:
        routing._ROUTES.pop(key)
        routing._KERNELS.pop(key, None)
        routing._FALLTHROUGHS.pop(key, None)
        routing._forget_plan(force=True)


@pytest.fixture(autouse=True)
def no_routing_left():
    assert routing._HOLDS == 0 and routing.installed() == []
    yield
    assert routing._HOLDS == 0 and routing.installed() == [], "a test left routing held"


@pytest.fixture
def counted_topk(monkeypatch):
    """A route of aten::topk on the CPU key that counts the calls reaching its kernel (``calls``: the switch at each)
    and declines them (torch's CPU kernel runs), decided once per signature (``decisions`` counts the decisions). The
    Python kernel alone: the C++ route kernel would keep the declines (tests/test_routing_native_cpu.py)."""
    monkeypatch.setenv("NVFLY_ROUTING_NATIVE", "0")
    calls, decisions = [], []

    def eligibility(x, k, dim=-1, largest=True, sorted=True):
        decisions.append(k)
        return "the test declines"

    def signature(x, k, dim=-1, largest=True, sorted=True):
        return routing.tensor_key(x), k, dim, largest, sorted

    routing.register_route(TOPK, eligibility, lambda *args: None, "CPU", signature=signature)
    routed = routing._routed(routing._ROUTES[(TOPK, "CPU")], torch.library.get_kernel(TOPK, "CPU"))

    def kernel(keyset, *args, **kwargs):
        calls.append(routing.routing_enabled())
        return routed(keyset, *args, **kwargs)

    routing._KERNELS[(TOPK, "CPU")] = kernel  # the kernel the next plan registers
    yield calls, decisions
    drop_route((TOPK, "CPU"))


def test_routes_are_registered_only_inside_routing_blocks():
    routing.install_routing()
    assert routing.installed() == [] and not ours(TOPK, "CUDA")
    with nvfly.torch.routing():
        assert {TOPK, "aten::_fused_rms_norm", "aten::scaled_dot_product_attention"} <= set(routing.installed())
        assert ours(TOPK, "CUDA") and ours("aten::scaled_dot_product_attention", "AutogradCUDA")
        with nvfly.torch.routing(False):  # switched off inside: still registered (the outer block holds them)
            assert ours(TOPK, "CUDA") and not routing.routing_enabled()
    assert routing.installed() == [] and not ours(TOPK, "CUDA")  # torch's own kernels again
    with nvfly.torch.routing(False):  # a switched-off block registers nothing
        assert routing.installed() == []


def test_calls_outside_routing_never_reach_the_route(counted_topk):
    calls, decisions = counted_topk
    x = torch.randn(4, 50)
    want = torch.topk(x, 3)
    assert calls == []  # outside routing: torch's kernel directly, no hop through the route
    with nvfly.torch.routing():
        got = torch.topk(x, 3)
        with nvfly.torch.routing(False):
            torch.topk(x, 3)  # switched off inside a block: the route is passed through, torch runs it
    assert calls == [True, False] and decisions == [3]
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)
    torch.topk(x, 3)
    assert calls == [True, False]


def test_nested_blocks_keep_the_routes_until_the_outermost_ends(counted_topk):
    x = torch.randn(4, 50)
    with nvfly.torch.routing():
        with nvfly.torch.routing():
            assert ours(TOPK, "CPU")
        assert ours(TOPK, "CPU") and routing._HOLDS == 1
        torch.topk(x, 2)
    assert not ours(TOPK, "CPU")
    assert counted_topk[0] == [True]


def test_decisions_outlive_the_blocks(counted_topk):
    """A route's kernel is made once: a signature decided in one block is not decided again in the next."""
    calls, decisions = counted_topk
    x = torch.randn(4, 50)
    for _ in range(3):
        with nvfly.torch.routing():
            torch.topk(x, 5)
    assert decisions == [5] and calls == [True] * 3
    routing.forget_decisions()
    with nvfly.torch.routing():
        torch.topk(x, 5)
    assert decisions == [5, 5]


def test_enable_routing_holds_the_routes_until_disable(counted_topk):
    x = torch.randn(4, 50)
    nvfly.torch.enable_routing()
    try:
        nvfly.torch.enable_routing()  # twice: still one hold
        assert routing._HOLDS == 1 and ours(TOPK, "CPU") and routing.routing_enabled()
        with nvfly.torch.routing():
            assert routing._HOLDS == 2
        assert ours(TOPK, "CPU")  # the block's end leaves enable_routing's hold
        torch.topk(x, 1)
    finally:
        nvfly.torch.disable_routing()
    assert not ours(TOPK, "CPU") and not routing.routing_enabled() and routing._HOLDS == 0
    nvfly.torch.disable_routing()  # again: nothing to release
    assert routing._HOLDS == 0
    assert counted_topk[0] == [True]


def test_a_block_in_another_thread_keeps_the_routes_and_its_own_switch(counted_topk):
    """Registrations are process-wide, the switch per thread: while a block runs in a thread, the main thread's
    calls pass through the route switched off; the last block to end, in either thread, removes the routes."""
    calls, _ = counted_topk
    x = torch.randn(4, 50)
    entered, leave = threading.Event(), threading.Event()

    def worker():
        with nvfly.torch.routing():
            entered.set()
            leave.wait(10)
            torch.topk(x, 4)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(10)
        assert ours(TOPK, "CPU") and not routing.routing_enabled()
        torch.topk(x, 4)  # this thread is outside routing: through the route, switched off
        with nvfly.torch.routing():
            pass
        assert ours(TOPK, "CPU")  # the worker's block still holds them
    finally:
        leave.set()
        thread.join(10)
    assert not ours(TOPK, "CPU")
    assert calls == [False, True]


def test_many_threads_entering_and_leaving_blocks_leave_nothing_registered(counted_topk):
    x = torch.randn(2, 20)
    errors = []

    def worker():
        try:
            for _ in range(20):
                with nvfly.torch.routing():
                    assert ours(TOPK, "CPU")
                    torch.topk(x, 2)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and routing._HOLDS == 0 and not ours(TOPK, "CPU")
    assert counted_topk[0].count(True) == 80


def test_a_route_added_inside_a_block_is_registered_at_once():
    x = torch.randn(3, 30)
    reached = []
    with nvfly.torch.routing():
        routing.register_route(TOPK, lambda *a, **k: "declined", lambda *a: None, "CPU",
                               signature=lambda x, k, *a: reached.append(k))
        try:
            torch.topk(x, 2)
            assert reached == [2] and ours(TOPK, "CPU")
        finally:
            drop_route((TOPK, "CPU"))
        assert not ours(TOPK, "CPU") and ours(TOPK, "CUDA")


def test_on_keys_routes_cpu_calls_and_restores():
    with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}):
        with nvfly.torch.routing():
            assert ours(TOPK, "CPU") and ours("aten::scaled_dot_product_attention", "AutogradCPU")
            assert not ours(TOPK, "CUDA")
            x = torch.randn(4, 40)
            assert torch.equal(torch.topk(x, 3).indices, x.topk(3).indices)  # declined (a CPU tensor): torch's
        assert not ours(TOPK, "CPU")
    with nvfly.torch.routing():
        assert ours(TOPK, "CUDA") and not ours(TOPK, "CPU")
    with nvfly.torch.routing(), pytest.raises(RuntimeError, match="inside routing"):
        with routing.on_keys({"CUDA": "CPU"}):
            pass


@pytest.fixture
def gemm_database(monkeypatch, tmp_path):
    """An autotune database for one fake card, seen as the only visible device."""
    autotune_module = importlib.import_module("nvfly.torch.autotune")
    db = Database(str(tmp_path / "db.json"), "Test GPU")
    monkeypatch.setattr(autotune_module, "database", lambda device=None: db)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    autotune_module._forget_eager_decisions()
    yield db
    autotune_module._forget_eager_decisions()


def _entry(batches: int, nvfly_ms: float, torch_ms: float) -> Entry:
    key = Workload(batches, 16, 32, 64, torch.bfloat16, torch.bfloat16, "K", "K").key()
    return Entry(key, (batches, 16, 32, 64), "bm=64,bn=32", {"bm=64,bn=32": nvfly_ms}, torch_ms, "2026-12-02")


def test_gemm_routes_are_registered_only_where_the_database_lets_nvfly_win(gemm_database):
    """Without an entry where nvfly wins, every eager GEMM declines: mm/addmm/bmm are not registered and cost
    nothing even inside a block; an update inside a block registers them at once."""
    with nvfly.torch.routing():
        assert not {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"} & set(routing.installed())
        assert TOPK in routing.installed()
        gemm_database.update([_entry(1, 2.0, 1.0)])  # torch wins: still nothing to route
        assert "aten::mm" not in routing.installed()
        gemm_database.update([_entry(1, 0.5, 1.0)])  # nvfly wins a single GEMM: mm, addmm, and bmm (B = 1)
        assert {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"} <= set(routing.installed())
        assert ours("aten::mm", "CUDA") and ours("aten::bmm", "CUDA")
    assert not ours("aten::mm", "CUDA")
    gemm_database.update([_entry(1, 2.0, 1.0), _entry(8, 0.5, 1.0)])  # only a batched entry wins
    with nvfly.torch.routing():
        installed = set(routing.installed())
        assert {"aten::bmm", "aten::baddbmm"} <= installed and not {"aten::mm", "aten::addmm"} & installed


def test_gemm_routes_wait_for_cuda(gemm_database, monkeypatch):
    """Before CUDA is initialized no CUDA GEMM can run and the card's database is not read (it would initialize
    CUDA): the GEMM routes are not registered; the next block asks again."""
    gemm_database.update([_entry(1, 0.5, 1.0)])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with nvfly.torch.routing():
        assert "aten::mm" not in routing.installed()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with nvfly.torch.routing():
        assert "aten::mm" in routing.installed()


def test_explain_works_outside_routing(capsys):
    """explain reads the rules, not the registrations: it answers the same outside and inside a block."""
    from nvfly.torch.explain import explain_sdpa
    outside = explain_sdpa(1, 32, 8, 1, 32768, 128)
    with nvfly.torch.routing():
        inside = explain_sdpa(1, 32, 8, 1, 32768, 128)
    assert outside.declined == inside.declined and outside.kernel == inside.kernel
    assert routing.installed() == []


# ---------------------------------------------------------------------------------------------- declined fallthrough
class _Recorded:
    """Torch's kernel of a route, recording what each call hands it (the keyset, the arguments)."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def call_boxed(self, keyset, *args, **kwargs):
        self.seen.append((keyset, args, kwargs))
        return self.kernel.call_boxed(keyset, *args, **kwargs)


@pytest.fixture
def recorded_fallthroughs(monkeypatch):
    """The routes registered on the CPU keys, each falling through to torch's kernel through a ``_Recorded``:
    {(op, key): recorder}."""
    recorders = {}
    torch_kernel = routing._torch_kernel

    def recorded(route):
        kernel = torch_kernel(route)
        recorder = recorders[(route.op, route.dispatch_key)] = _Recorded(kernel)
        return None if kernel is None else recorder

    monkeypatch.setattr(routing, "_torch_kernel", recorded)
    with routing.on_keys({"CUDA": "CPU", "AutogradCUDA": "AutogradCPU"}):
        yield recorders


SDPA = "aten::scaled_dot_product_attention"


def _aten_ops(fn):
    """The aten ops a call runs, in order (torch.profiler's CPU events)."""
    from torch.profiler import profile
    with profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "grad"])
def test_a_declined_sdpa_call_hands_torch_its_very_arguments_once(recorded_fallthroughs, mode):
    """A declined SDPA call (CPU tensors) passes one routed kernel (AutogradCPU, or CPU under inference_mode, not
    both), whose fallthrough gets the caller's very tensors and scalars, and torch runs the kernels it runs without
    routing: the same aten ops, the same output bits."""
    q = torch.randn(1, 4, 3, 16, requires_grad=mode == "grad")
    k, v = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 8)
    mask = torch.randn(1, 1, 3, 7)

    def call():
        return F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3, enable_gqa=True)

    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": contextlib.nullcontext}[mode]
    with context():
        expected, expected_ops = call(), _aten_ops(call)
        with nvfly.torch.routing():
            out = call()
            seen = {key: list(r.seen) for key, r in recorded_fallthroughs.items() if key[0] == SDPA}
            routed_ops = _aten_ops(call)
    assert torch.equal(out, expected)
    assert routed_ops == expected_ops  # the composite picks the same kernel
    hit = "CUDA" if mode == "inference_mode" else "AutogradCUDA"  # the route's key (registered on its CPU twin)
    assert {key[1]: len(calls) for key, calls in seen.items()} == {"AutogradCUDA": int(hit != "CUDA"),
                                                                   "CUDA": int(hit == "CUDA")}
    _, args, kwargs = seen[(SDPA, hit)][0]
    assert len(args) >= 4 and all(a is b for a, b in zip(args[:4], (q, k, v, mask)))
    assert args[4:] == (0.0, False)[:len(args) - 4]  # the dispatcher leaves out trailing defaults
    assert kwargs == {"scale": 0.3, "enable_gqa": True}
    if mode == "grad":
        out.sum().backward()  # torch's backward of the composite it ran
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_a_declined_layer_passes_each_routed_op_once(recorded_fallthroughs, monkeypatch):
    """benchmarks/models.py's Llama layer (small, on CPU) under routing: each F.linear reaches one mm, each F.rms_norm
    one _fused_rms_norm, SDPA one route (GEMM routes registered as where the autotune database lets nvfly win); all
    declined, the output is eager's bit for bit."""
    from benchmarks.models import LlamaLayer
    monkeypatch.setattr(importlib.import_module("nvfly.torch.autotune"), "_nvfly_wins_somewhere", lambda batched: True)
    layer = LlamaLayer(64, 128, 16, 4, 1).eval()
    cache = tuple(torch.randn(1, 1, 32, 16) for _ in range(2))
    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        expected = layer(x, 31, [c.clone() for c in cache])
        with nvfly.torch.routing():
            assert "aten::mm" in routing.installed()
            out = layer(x, 31, cache)
    counts = {key: len(r.seen) for key, r in recorded_fallthroughs.items() if r.seen}
    assert counts == {("aten::mm", "CUDA"): 4, ("aten::_fused_rms_norm", "CUDA"): 2, (SDPA, "AutogradCUDA"): 1}
    assert torch.equal(out, expected)


def test_models_gemma2_block_attends_with_soft_capping_in_a_causal_window():
    """benchmarks/models.py's Gemma-2-like block (small, on CPU): its flex_attention is softmax(cap * tanh(s / cap))
    over the causal window of keys, GQA; the block runs whole."""
    import math
    from benchmarks.models import Gemma2Layer
    torch.manual_seed(3)
    layer = Gemma2Layer(256, window=64, softcap=5.0, hidden=64, inter=128, head=16, q_heads=4, kv_heads=2,
                        device="cpu").eval()
    q, k, v = torch.randn(1, 4, 256, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(16)
    rows, keys = torch.arange(256)[:, None], torch.arange(256)[None, :]
    visible = (keys <= rows) & (rows - keys < 64)
    weights = torch.softmax((5.0 * torch.tanh(scores / 5.0)).masked_fill(~visible, float("-inf")), dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(layer.attend(q, k, v), weights @ v.repeat_interleave(2, dim=1), atol=1e-5,
                                   rtol=1e-5)
        out = layer(torch.randn(1, 256, 64))
    assert out.shape == (1, 256, 64) and torch.isfinite(out).all()


def test_models_times_eager_and_routed_in_turn(monkeypatch):
    """benchmarks/models.py's timed(): eager outside routing and routed inside a block, alternating round by round
    (drift lands on both), the medians as eager_ms/routed_ms and each round's ratio's spread."""
    import benchmarks.common as common
    from benchmarks import models
    seen = []

    def bench_ms(fn, warmup_ms=25, rep_ms=100):
        seen.append((routing.routing_enabled(), bool(routing.installed()), warmup_ms, rep_ms))
        return [1.0, 2.0][routing.routing_enabled()] + len(seen) / 100

    monkeypatch.setattr(common, "bench_ms", bench_ms)
    row = models.timed({}, lambda: None, quick=True)
    rounds = models.ROUNDS[True]
    assert seen == [(False, False, 10, 40), (True, True, 10, 40)] * rounds
    assert row["ms_rounds"]["eager"] == [round(1.0 + (2 * i + 1) / 100, 4) for i in range(rounds)]
    assert row["eager_ms"] == pytest.approx(1.0 + rounds / 100)
    assert row["routed_ms"] == pytest.approx(2.0 + (rounds + 1) / 100)
    assert row["speedup"] == pytest.approx(row["eager_ms"] / row["routed_ms"])
    low, high = row["speedup_range"]
    assert low == pytest.approx(1.01 / 2.02)
    assert high == pytest.approx((1 + (2 * rounds - 1) / 100) / (2 + 2 * rounds / 100))


def test_models_times_the_compiled_variants_in_turn(monkeypatch):
    """benchmarks/models.py's compiled columns: torch.compile without and with nvfly's passes, each made on a code
    object of its own name (nvfly's passes installed only while its variant compiles), then timed in turn like
    eager and routed: medians as inductor_ms/nvfly_ms and the rounds' spread of their ratio."""
    import benchmarks.common as common
    from benchmarks import models
    from nvfly.torch import attention_compile
    made, seen = [], []

    def compile_fn(name):
        made.append((name, attention_compile.installed()))
        return lambda: seen.append(name) or torch.ones(2)

    monkeypatch.setattr(common, "bench_ms", lambda fn, warmup_ms=25, rep_ms=100: (fn(), 1.0 + len(seen) / 100)[1])
    row = models.timed({"case": "llama-decode"}, lambda: torch.ones(2), quick=True, compile_too=True,
                       compile_fn=compile_fn)
    assert made == [("llama_decode_inductor", False), ("llama_decode_nvfly", True)]
    assert not attention_compile.installed()
    rounds = models.ROUNDS[True]
    assert seen == ["llama_decode_inductor", "llama_decode_nvfly"] * (rounds + 1)  # the first calls compile
    assert row["inductor_rel_err_vs_eager"] == row["nvfly_rel_err_vs_eager"] == 0
    assert row["nvfly_vs_inductor"] == pytest.approx(row["inductor_ms"] / row["nvfly_ms"])
    low, high = row["nvfly_vs_inductor_range"]
    assert low <= row["nvfly_vs_inductor"] <= high


def test_models_flex_variants_keep_their_own_dynamo_caches():
    """benchmarks/models.py times compiled flex variants interleaved: each runs a copy of one function's code
    object, so Dynamo keeps one cache entry per variant (a shared code object would hold both entries, each call
    checking the other's guards first) and each copy computes what the original does."""
    from benchmarks import models
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    def scaled(x, factor):
        return x * factor

    first, second = models._own_code(scaled, "first"), models._own_code(scaled, "second")
    assert first.__code__ is not second.__code__ and first.__code__.co_code == scaled.__code__.co_code
    torch._dynamo.reset()
    x = torch.randn(8)
    compiled = [torch.compile(fn, backend="eager") for fn in (first, second)]
    for _ in range(2):
        assert torch.equal(compiled[0](x, 2.0), x * 2.0) and torch.equal(compiled[1](x, 3.0), x * 3.0)
    assert [len(_debug_get_cache_entry_list(fn.__code__)) for fn in (first, second)] == [1, 1]
    torch._dynamo.reset()
    factor = 4.0  # a closure and defaults (the layer rows' lambdas) come with the copy

    def closed(x, offset=1.0):
        return x * factor + offset

    copy = models._own_code(closed, "closed_copy")
    assert torch.equal(copy(x), closed(x)) and copy.__name__ == "closed_copy"


# ---------------------------------------------------------------------------------------------- decision cache, skip
class _Counted:
    """A route on CPU's topk schema, its kernel (``impl``) built by ``routing._routed`` over a fallthrough that
    counts torch's calls: ``checks`` (eligibility), ``binds``, ``runs`` and ``torch`` list what each was called with;
    ``skip`` (optional) is the route's."""

    def __init__(self, eligible=lambda x, k: None, skip=None):
        self.checks, self.binds, self.runs, self.torch, self.signatures = [], [], [], [], []

        def eligibility(x, k, dim=-1, largest=True, sorted=True):
            self.checks.append(k)
            return eligible(x, k)

        def signature(x, k, dim=-1, largest=True, sorted=True):
            self.signatures.append(k)
            return routing.tensor_key(x), k, dim, largest, sorted

        def bind(x, k, dim=-1, largest=True, sorted=True):
            self.binds.append(k)

            def runs(x, k, dim=-1, largest=True, sorted=True):
                self.runs.append(k)
                return torch.full((k,), 7.0), torch.zeros(k, dtype=torch.int64)
            return runs

        kernel = torch.library.get_kernel(TOPK, "CPU")
        counted = self

        class Fallthrough:
            @staticmethod
            def call_boxed(keyset, *args, **kwargs):
                counted.torch.append(args[1])
                return kernel.call_boxed(keyset, *args, **kwargs)

        self.route = routing.Route(TOPK, eligibility, lambda *a, **k: pytest.fail("run: the route binds"), "CPU",
                                   signature, skip=skip, bind=bind)
        impl = routing._routed(self.route, Fallthrough)
        self.decided = routing._DECIDED[-1]
        keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        self.call = lambda x, k: impl(keyset, x, k, -1, True, True)


def test_a_hit_returns_the_decision_and_runner_bound_for_its_signature():
    route, x = _Counted(), torch.randn(4, 32)
    with routing.routing():
        for _ in range(3):
            assert torch.equal(route.call(x, 2)[0], torch.full((2,), 7.0))  # nvfly's (the runner's) result
        route.call(torch.randn(4, 32), 2)  # other values, one signature
    assert route.checks == [2] and route.binds == [2] and route.runs == [2] * 4 and route.torch == []
    (decision,) = route.decided.values()
    assert decision[0] is None and callable(decision[1])  # (no reason, the runner bind made)


@pytest.mark.parametrize("change", ["shape", "strides", "dtype", "alignment", "scalar"])
def test_any_change_of_layout_or_scalar_misses(change):
    route = _Counted()
    base = torch.randn(8, 64)
    x, k = {"shape": (base[:4], 2), "strides": (base.t().contiguous().t(), 2), "dtype": (base.double(), 2),
            "alignment": (torch.randn(520)[1:513].view(8, 64), 2), "scalar": (base, 3)}[change]
    with routing.routing():
        route.call(base, 2)
        route.call(x, k)
        route.call(base, 2)
        route.call(x, k)
    assert len(route.checks) == len(route.binds) == 2 and len(route.decided) == 2


def test_forgetting_decisions_decides_and_binds_again():
    """What a signature leaves out changed (the autotune database, routing's setup): every route decides again."""
    route, x = _Counted(), torch.randn(4, 32)
    with routing.routing():
        route.call(x, 2)
        routing.forget_decisions()
        route.call(x, 2)
        route.call(x, 2)
    assert route.checks == [2, 2] and route.binds == [2, 2] and route.runs == [2, 2, 2]


def test_replacing_a_route_starts_from_no_decisions():
    """A route registered again (another rule or runner) gets a new kernel: none of the old decisions."""
    seen = []

    def register(answer):
        routing.register_route(TOPK, lambda x, k, *rest: seen.append(answer) or "declined", lambda *a: None, "CPU",
                               signature=lambda x, k, *rest: (routing.tensor_key(x), k))
    x = torch.randn(4, 32)
    try:
        register("first")
        with nvfly.torch.routing():
            torch.topk(x, 2)
            torch.topk(x, 2)
            register("second")
            torch.topk(x, 2)
            torch.topk(x, 2)
    finally:
        drop_route((TOPK, "CPU"))
    assert seen == ["first", "second"]


def test_a_skipped_call_goes_to_torch_before_its_signature(caplog):
    """``skip``: torch's kernel at once (no signature, no decision, nothing remembered) while routing decisions
    are not logged; logged, the call is decided in full and its reason logged, once per signature."""
    route = _Counted(eligible=lambda x, k: "launch-bound for the test", skip=lambda x, k, *rest: x.shape[0] < 8)
    small, large = torch.randn(4, 32), torch.randn(8, 32)
    caplog.set_level(logging.WARNING, "nvfly")
    with routing.routing():
        for _ in range(3):
            assert torch.equal(route.call(small, 2)[1], small.topk(2).indices)  # torch's
        route.call(large, 2)  # not skipped: decided (declined) once
        route.call(large, 2)
    assert route.signatures == [2, 2] and route.checks == [2] and len(route.decided) == 1
    assert route.torch == [2] * 5 and route.runs == []
    caplog.set_level(logging.DEBUG, "nvfly")
    with routing.routing():
        route.call(small, 2)
        route.call(small, 2)
    assert route.checks == [2, 2] and len(route.decided) == 2
    assert [r.getMessage() for r in caplog.records].count(
        "nvfly: aten::topk stays on torch: launch-bound for the test") == 1


def test_a_skip_that_raises_is_decided_in_full():
    route = _Counted(eligible=lambda x, k: None, skip=lambda x, k, *rest: x.no_such_attribute)
    with routing.routing():
        assert torch.equal(route.call(torch.randn(4, 32), 2)[0], torch.full((2,), 7.0))
    assert route.checks == [2] and route.runs == [2]


def test_a_failing_bind_falls_back_and_declines_its_signature():
    route, x = _Counted(), torch.randn(4, 32)

    def broken(*args):
        route.binds.append("broken")
        raise RuntimeError("bind failed")
    object.__setattr__(route.route, "bind", broken)
    with routing.routing():
        for _ in range(3):
            assert torch.equal(route.call(x, 2)[1], x.topk(2).indices)
    assert route.binds == ["broken"] and route.checks == [2] and route.torch == [2] * 3
    (decision,) = route.decided.values()
    assert decision == ("nvfly raised RuntimeError: bind failed", None)


def test_rms_norm_skip_is_its_launch_bound_rule(monkeypatch):
    """RMSNorm's skip: under RMS_NORM_EAGER_BYTES moved outside CUDA-graph capture, exactly where its eligibility
    says launch-bound; under capture nothing is skipped."""
    routing.install_routing()
    forward, backward = (routing._ROUTES[(op, "CUDA")] for op in ("aten::_fused_rms_norm",
                                                                   "aten::_fused_rms_norm_backward"))
    limit = routing.RMS_NORM_EAGER_BYTES
    for rows, moved in ((1, 2), (limit // (2 * 4 * 4096) - 1, 2), (limit // (2 * 4 * 4096), 2)):
        x = torch.empty(rows, 4096)
        small = moved * x.nbytes < limit
        assert forward.skip(x, [4096], None, 1e-6) is small
        assert (routing._launch_bound(x, 2) is not None) is small
    x = torch.empty(2048, 4096)  # 32 MiB: the forward's 64 MiB, the backward's 96 MiB
    assert not forward.skip(x, [4096], None, 1e-6) and not backward.skip(x, x, [4096], x, None, [True, True])
    x = torch.empty(1024, 4096)
    assert forward.skip(x, [4096], None, 1e-6) and backward.skip(x, x, [4096], x, None, [True, True])
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        cuda = torch.empty(8, 4096, device="cuda")
        monkeypatch.setattr(routing, "_STREAM_CAPTURING", lambda: False)  # this build's stand-in raises
        assert forward.skip(cuda, [4096], None, 1e-6)
        monkeypatch.setattr(routing, "_STREAM_CAPTURING", lambda: True)
        assert not forward.skip(cuda, [4096], None, 1e-6) and routing._launch_bound(cuda, 2) is None


def test_the_rms_norm_routes_follow_their_setting_at_the_outermost_block(monkeypatch):
    """NVFLY_ROUTING_RMS_NORM=0: the RMSNorm routes are not registered (F.rms_norm pays no hop); the setting is
    read when routing starts (the outermost block), as the routes' ``wanted``."""
    rms = "aten::_fused_rms_norm"
    with nvfly.torch.routing():
        assert rms in routing.installed()
    monkeypatch.setenv("NVFLY_ROUTING_RMS_NORM", "0")
    with nvfly.torch.routing():
        assert rms not in routing.installed() and TOPK in routing.installed()
        assert not ours(rms, "CUDA")
        monkeypatch.setenv("NVFLY_ROUTING_RMS_NORM", "1")
        with nvfly.torch.routing():  # nested: the routes stay as the outermost block found them
            assert rms not in routing.installed()
    with nvfly.torch.routing():
        assert rms in routing.installed() and ours(rms, "CUDA")


def test_gemm_routes_follow_the_minimum_gain(gemm_database, monkeypatch):
    """NVFLY_ROUTING_MIN_GAIN_US: an entry whose gain is under it counts as no win (the routes stay unregistered,
    read at the outermost block), and an eager GEMM decided after a change declines with the gain it measured."""
    from nvfly.torch.autotune import _eager
    gemm_database.update([_entry(1, 0.995, 1.0)])  # nvfly 5 us faster a call
    monkeypatch.setenv("NVFLY_ROUTING_MIN_GAIN_US", "8")
    with nvfly.torch.routing():
        assert "aten::mm" not in routing.installed()
    monkeypatch.setattr(importlib.import_module("nvfly.torch.autotune"), "analyze", lambda a, b, c=None: (Workload(
        1, a.shape[0], b.shape[1], a.shape[1], a.dtype, a.dtype, "K", "K"), None))
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    reason = _eager("mm", a, b)[0]
    assert "gain" in reason and "5.0 us a call" in reason and "NVFLY_ROUTING_MIN_GAIN_US=8" in reason
    monkeypatch.setenv("NVFLY_ROUTING_MIN_GAIN_US", "4")
    with nvfly.torch.routing():
        assert "aten::mm" in routing.installed()
    assert _eager("mm", a, b) == (None, "bm=64,bn=32")  # decided for this floor (routing's own decisions: at
    # routing.forget_decisions, as after a database update)


def test_a_routing_setting_change_reaches_decided_signatures_at_forget_decisions(gemm_database, monkeypatch):
    """Routing's decisions are per signature: a changed NVFLY_ROUTING_MIN_GAIN_US (what a signature leaves out)
    reaches a signature decided before at ``routing.forget_decisions``, as a database update does."""
    from nvfly.torch.autotune import _route
    autotune_module = importlib.import_module("nvfly.torch.autotune")
    monkeypatch.setattr(autotune_module, "analyze", lambda a, b, c=None: (Workload(
        1, a.shape[0], b.shape[1], a.shape[1], a.dtype, a.dtype, "K", "K"), None))
    gemm_database.update([_entry(1, 0.995, 1.0)])  # nvfly 5 us faster a call
    eligibility, _, signature, _ = _route("mm", with_c=False)
    runs = []
    route = routing.Route("aten::mm", eligibility, lambda a, b: runs.append(1) or torch.zeros(16, 32).bfloat16(),
                          "CPU", signature)
    impl = routing._routed(route, torch.library.get_kernel("aten::mm", "CPU"))
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    monkeypatch.setenv("NVFLY_ROUTING_MIN_GAIN_US", "8")
    with routing.routing():
        assert torch.equal(impl(keyset, a, b), a @ b) and runs == []  # the gain is under 8 us: torch
        monkeypatch.setenv("NVFLY_ROUTING_MIN_GAIN_US", "4")
        assert torch.equal(impl(keyset, a, b), a @ b) and runs == []  # decided before the change
        routing.forget_decisions()
        assert not impl(keyset, a, b).any() and runs == [1]  # decided again: nvfly (the stub's zeros)
