"""nvfly's GEMM in PyTorch on a Hopper GPU: config strings and custom ops against a float32 reference (with
autograd), precompile producing the exact kernels a call needs, the autotuner and explain, eager routing of
F.linear / torch.matmul forward and backward, and torch.compile(max-autotune) with nvfly installed: the same
results as eager, the choices and their times recorded, and injected failures (compile, benchmark, launch)
leaving the compiled model correct."""
import importlib

import pytest
import torch
import torch.nn.functional as F
import torch._inductor.config as inductor_config
from torch._inductor.utils import run_and_get_code

import nvfly
import nvfly.torch
from nvfly.ops import gemm
from nvfly.ops.gemm import GemmConfig
from nvfly.ops.common.opcall import OpCalls
from nvfly.ops.gemm.kernel import gemm_kernel
from nvfly.torch import inductor, routing
from nvfly.torch.autotune import Database, make_operands, measure
from nvfly.torch.gemm_ops import AUTO, Workload, clear_decisions, decisions, encode_config, nvfly_gemm, precompile

pytestmark = pytest.mark.gpu

# nvfly.torch.autotune and nvfly.torch.explain are functions; their modules are reached this way
autotune_module = importlib.import_module("nvfly.torch.autotune")
gemm_ops = importlib.import_module("nvfly.torch.gemm_ops")


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def operand(rows, cols, major, batches=None):
    """A bf16 [(batches,) rows, cols] CUDA matrix; major "row": the last dimension is contiguous."""
    lead = (batches,) if batches else ()
    if major == "row":
        return torch.randn(*lead, rows, cols, device="cuda").bfloat16()
    return torch.randn(*lead, cols, rows, device="cuda").bfloat16().transpose(-1, -2)


@pytest.fixture(autouse=True)
def fresh_state():
    clear_decisions()
    gemm_ops._BOUND.clear()
    autotune_module._forget_eager_decisions()
    yield
    nvfly.torch.uninstall()
    nvfly.torch.disable_routing()


# ---------------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("mnk,config", [
    ((512, 768, 1024), AUTO),
    ((512, 768, 1024), encode_config(GemmConfig(128, 128, 6, 2))),
    ((304, 520, 1000), encode_config(GemmConfig(256, 128, 4, 2, group_m=16))),
    ((16, 4096, 2048), AUTO),
    ((16, 4096, 2048), encode_config(GemmConfig(64, 16, 7, 1, split_k=4), swap=True)),
    ((40, 1024, 512), encode_config(GemmConfig(128, 40, 6, 2), swap=True)),
])
@pytest.mark.parametrize("majors", [("row", "row"), ("col", "col")])
@pytest.mark.parametrize("bias", [False, True])
def test_config_strings_compute_the_gemm(hopper, mnk, config, majors, bias):
    m, n, k = mnk
    a, b = operand(m, k, majors[0]), operand(k, n, majors[1])
    c = torch.randn(n, device="cuda").bfloat16() if bias else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    nvfly_gemm(a, b, c, alpha=0.5, beta=2.0 if bias else 1.0, out=out, config=config)
    assert rel_err(out, gemm.reference(a, b, c, alpha=0.5, beta=2.0)) < 1e-2


def test_custom_ops_and_their_gradients_run_on_nvfly(hopper):
    x = torch.randn(4, 64, 512, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(768, 512, device="cuda").bfloat16().requires_grad_()
    bias = torch.randn(768, device="cuda").bfloat16().requires_grad_()
    y = torch.ops.nvfly.linear(x, w, bias)
    y_ref = F.linear(x.float(), w.float(), bias.float())
    assert rel_err(y, y_ref) < 1e-2
    grad = torch.randn_like(y)
    gx, gw, gb = torch.autograd.grad(y, (x, w, bias), grad)
    rx, rw, rb = torch.autograd.grad(y_ref, (x, w, bias), grad.float())
    assert rel_err(gx, rx) < 2e-2 and rel_err(gw, rw) < 2e-2 and rel_err(gb, rb) < 2e-2
    a, b3 = operand(256, 128, "row", batches=3), operand(128, 96, "col", batches=3)
    assert rel_err(torch.ops.nvfly.bmm(a, b3), a.float() @ b3.float()) < 1e-2
    c = torch.randn(1, 96, device="cuda").bfloat16()
    assert rel_err(torch.ops.nvfly.addmm(c, a[0], b3[0], beta=0.5, alpha=2.0),
                   torch.addmm(c.float(), a[0].float(), b3[0].float(), beta=0.5, alpha=2.0)) < 1e-2
    assert [d for d in decisions() if d.where == "op"] == []  # nothing declined, nothing fell back


def test_precompile_compiles_exactly_what_the_call_launches(hopper):
    a, b = operand(200, 328, "row"), operand(328, 264, "col")
    c = torch.randn(264, device="cuda").bfloat16()
    config = encode_config(GemmConfig(128, 96, 5, 2))
    precompile(a, b, c, config=config)
    stats = (gemm_kernel.stats.traced, gemm_kernel.stats.lowered, gemm_kernel.stats.disk_hits)
    out = nvfly_gemm(a, b, c, config=config)
    assert (gemm_kernel.stats.traced, gemm_kernel.stats.lowered, gemm_kernel.stats.disk_hits) == stats
    assert rel_err(out, gemm.reference(a, b, c)) < 1e-2


# ---------------------------------------------------------------------------------------------- autotuner
def test_autotune_stores_winners_and_explain_reads_them(hopper, tmp_path):
    db = Database(str(tmp_path / "db.json"), torch.cuda.get_device_name())
    entries = nvfly.torch.autotune([(256, 512, 384), (2, 16, 1024, 512)], db=db, progress=False, target_ms=5)
    assert [e.shape for e in entries] == [(1, 256, 512, 384), (2, 16, 1024, 512)]
    for e in entries:
        assert db.lookup(e.key) == e and e.torch_ms > 0 and AUTO in e.times_ms and len(e.times_ms) > 4
    assert Database(db.path, db.card).lookup(entries[0].key) is not None  # on disk
    w = Workload(1, 256, 512, 384, torch.bfloat16, torch.bfloat16, "K", "K")
    measured = measure(w, *make_operands(w, torch.device("cuda")), [AUTO])
    assert measured.best == AUTO and measured.torch_ms > 0
    result = nvfly.torch.explain(256, 512, 384, benchmark=True)
    assert result.declined is None and result.measured is not None
    assert "nvfly wins" in result.verdict() or "nvfly loses" in result.verdict()
    assert "torch" in str(result)


# ---------------------------------------------------------------------------------------------- eager routing
def nvfly_wins_everywhere(monkeypatch):
    """As if the autotune database said nvfly wins everywhere: the GEMM routes are registered in routing blocks and
    every eligible GEMM goes to nvfly."""
    monkeypatch.setattr(autotune_module, "_expected_faster", lambda w, device: (None, AUTO))
    monkeypatch.setattr(autotune_module, "_nvfly_wins_somewhere", lambda batched: True)
    autotune_module._forget_eager_decisions()


def test_routing_sends_linear_and_its_backward_to_nvfly(hopper, monkeypatch):
    nvfly_wins_everywhere(monkeypatch)
    x = torch.randn(256, 384, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(512, 384, device="cuda").bfloat16().requires_grad_()
    bias = torch.randn(512, device="cuda").bfloat16().requires_grad_()
    with nvfly.torch.routing():
        y = F.linear(x, w, bias)
        grads = torch.autograd.grad(y.float().square().sum(), (x, w, bias))
        z = torch.matmul(operand(8, 256, "row", batches=4), operand(256, 128, "row"))  # folded into one mm
    routed = [d for d in decisions() if d.where == "eager" and d.reason is None]
    assert {d.op for d in routed} >= {"addmm", "mm"} and len(routed) >= 4  # forward, 2 backward GEMMs, matmul
    y_ref = F.linear(x.float(), w.float(), bias.float())
    refs = torch.autograd.grad(y_ref.square().sum(), (x, w, bias))
    assert rel_err(y, y_ref) < 1e-2 and z.shape == (4, 8, 128)
    assert all(rel_err(g, r) < 3e-2 for g, r in zip(grads, refs))


def test_routed_calls_reuse_their_bound_launches(hopper, monkeypatch):
    """A routed signature binds its launches once; later calls with other tensors (and out=, and addmm's beta 0
    or alpha != 1, other signatures) compute their own products."""
    nvfly_wins_everywhere(monkeypatch)
    monkeypatch.setattr(autotune_module, "_EAGER_CALLS", OpCalls())
    with nvfly.torch.routing():
        for _ in range(3):
            a, b = operand(192, 256, "row"), operand(256, 320, "col")
            c = torch.randn(320, device="cuda").bfloat16()
            out = torch.full((192, 320), float("nan"), device="cuda").bfloat16()
            torch.mm(a, b, out=out)
            results = [(a @ b, a.float() @ b.float()), (out, a.float() @ b.float()),
                       (torch.addmm(c, a, b, beta=0.0), a.float() @ b.float()),
                       (torch.addmm(c, a, b, alpha=0.5), c.float() + 0.5 * (a.float() @ b.float()))]
            assert all(rel_err(x, ref) < 1e-2 for x, ref in results)
    assert len(autotune_module._EAGER_CALLS) == 4


def test_routing_keeps_gemms_on_torch_without_a_database_entry(hopper, monkeypatch):
    a, b = operand(128, 256, "row"), operand(256, 64, "row")
    # no entry anywhere where nvfly wins: the GEMM routes are not registered (GEMMs cost what they cost in torch)
    monkeypatch.setattr(autotune_module, "_nvfly_wins_somewhere", lambda batched: False)
    autotune_module._forget_eager_decisions()
    with nvfly.torch.routing():
        assert "aten::mm" not in routing.installed()
        out = a @ b
    assert [d for d in decisions() if d.where == "eager"] == [] and torch.equal(out, a @ b)
    # an entry where nvfly wins, for another shape: registered, and this shape declined for want of its own
    monkeypatch.setattr(autotune_module, "_nvfly_wins_somewhere", lambda batched: True)
    autotune_module._forget_eager_decisions()
    with nvfly.torch.routing():
        assert "aten::mm" in routing.installed()
        out = a @ b
    (d,) = [d for d in decisions() if d.where == "eager"]
    assert "no autotune entry" in d.reason and torch.equal(out, a @ b)


# ---------------------------------------------------------------------------------------------- inductor
class MLP(torch.nn.Module):
    """A Llama-style MLP block at a small size: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden=1024, inter=2816):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inter, bias=False)
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.fixture
def max_autotune():
    """Compile with max-autotune, ATen and Triton (few configs) beside nvfly; nothing reused from caches."""
    # no epilogue-fusion benchmarking: the fastest GEMM choice is the one emitted
    patches = {"fx_graph_cache": False, "autotune_local_cache": False, "max_autotune_gemm_backends": "ATEN,TRITON",
               "benchmark_epilogue_fusion": False}
    if hasattr(inductor_config.test_configs, "max_mm_configs"):
        patches["test_configs.max_mm_configs"] = 4
    torch._dynamo.reset()
    with inductor_config.patch(patches):
        yield
    torch._dynamo.reset()


def compiled_vs_eager(mode="max-autotune-no-cudagraphs", tokens=256):
    torch.manual_seed(0)
    model = MLP().cuda().bfloat16()
    x = torch.randn(tokens, 1024, device="cuda").bfloat16()
    with torch.no_grad():
        expected = model(x)
        out, code = run_and_get_code(torch.compile(model, mode=mode), x)
    assert rel_err(out, expected) < 2e-2
    return "\n".join(code)


def test_compiled_mlp_matches_eager_and_records_every_choice(hopper, max_autotune):
    nvfly.torch.install(max_candidates=3)
    code = compiled_vs_eager(mode="max-autotune")
    tuned = [d for d in decisions() if d.where == "inductor"]
    assert tuned and all(d.reason is None and len(d.candidates) == 3 for d in tuned)
    for d in tuned:
        assert any(name.startswith("aten") for name in d.timings_ms) and any(
            name.startswith("nvfly") for name in d.timings_ms)
        assert d.winner == min(d.timings_ms, key=d.timings_ms.__getitem__)
    assert ("torch.ops.nvfly." in code) == any(d.winner.startswith("nvfly") for d in tuned)


def test_cudagraph_trees_with_a_split_k_choice_keep_no_scratch_in_the_pool(hopper, max_autotune, monkeypatch):
    """mode="max-autotune" (cudagraph trees) with "nvfly auto" winning every GEMM: the down projection
    (256x1024x2816) runs split K, whose f32 partials come from the per-stream scratch. Cudagraph trees warm a graph
    up by running it once on their own stream with every allocation routed to the graph's pool, then require each
    live block of the pool to be an output: a scratch set cached for that stream failed them ("tensor(s) in the
    cudagraph pool not tracked as outputs"). The scratch caches start empty, so the warm-up allocates whatever the
    tests before left; then warm-up, recording and replays all match eager."""
    from nvfly.ops.common import scratch
    for cache in (scratch._WORKSPACE, scratch._PARTIALS):
        monkeypatch.setattr(cache, "_entries", {})
    timed = inductor.NvflyCaller.benchmark

    def auto_wins(self, *args, out):
        elapsed = timed(self, *args, out=out)  # the real call and timing, so that a failure still drops it
        return 1e-6 if self.kwargs["config"] == AUTO else elapsed
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", auto_wins)
    nvfly.torch.install(max_candidates=2)
    torch.manual_seed(0)
    model = MLP().cuda().bfloat16()
    x = torch.randn(256, 1024, device="cuda").bfloat16()
    assert gemm.path(x @ model.gate.weight.t(), model.down.weight.t()).startswith("wgmma-splitK")
    compiled = torch.compile(model, mode="max-autotune")
    with torch.no_grad():
        expected = model(x)
        outs = [compiled(x).clone() for _ in range(4)]  # warm-up, recording, replays
    assert all(rel_err(out, expected) < 2e-2 for out in outs)
    tuned = [d for d in decisions() if d.where == "inductor"]
    assert tuned and all(d.winner.startswith("nvfly") for d in tuned)


def test_injected_compile_failure_leaves_the_model_correct(hopper, max_autotune, monkeypatch):
    def broken(*args, **kwargs):
        raise nvfly.CompileError("injected compile failure")
    monkeypatch.setattr(inductor, "precompile", broken)
    nvfly.torch.install(max_candidates=2)
    assert "torch.ops.nvfly." not in compiled_vs_eager()
    tuned = [d for d in decisions() if d.where == "inductor"]
    # choices that fail to compile are dropped before benchmarking (so they may have no time at all)
    assert tuned and all("failed to compile" in d.reason and not (d.winner or "").startswith("nvfly") for d in tuned)


def test_injected_benchmark_failure_leaves_the_model_correct(hopper, max_autotune, monkeypatch):
    def broken(*args, **kwargs):
        raise nvfly.LaunchError("injected benchmark failure")  # not a RuntimeError: nvfly converts it
    monkeypatch.setattr(inductor, "nvfly_gemm", broken)
    nvfly.torch.install(max_candidates=2)
    assert "torch.ops.nvfly." not in compiled_vs_eager()
    tuned = [d for d in decisions() if d.where == "inductor"]
    assert tuned and all("failed to benchmark" in d.reason and not d.winner.startswith("nvfly") for d in tuned)


def test_injected_launch_failure_falls_back_to_torch(hopper, max_autotune, monkeypatch):
    monkeypatch.setattr(inductor.NvflyCaller, "_compile", lambda self, operands: None)
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", lambda self, *args, out: 1e-6)  # nvfly wins all

    def broken(*args, **kwargs):
        raise nvfly.LaunchError("injected launch failure")
    monkeypatch.setattr(gemm_ops, "nvfly_gemm", broken)  # what the emitted nvfly ops call at run time
    nvfly.torch.install(max_candidates=2)
    assert "torch.ops.nvfly.mm_out.default(" in compiled_vs_eager()
    failed = [d for d in decisions() if d.where == "op"]
    assert failed and all("injected launch failure" in d.reason for d in failed)
