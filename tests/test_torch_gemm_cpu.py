"""nvfly's GEMM in PyTorch without a GPU: config strings, workload analysis and its reasons, candidates, the
autotune database, eager routing decisions, the custom ops (torch fallback, autograd), the Inductor plumbing
(choices class, extern choices emitted as nvfly ops, failures dropped, hash keys, FX-graph cache keys,
preprocessing fallback) and explain."""
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor.choices import InductorChoices
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import nvfly.torch
from nvfly.ops import gemm
from nvfly.ops.common import operands
from nvfly.ops.gemm import GemmConfig
from nvfly.torch import inductor, routing
from nvfly.torch.autotune import (Database, Entry, _eager, _route, candidates, register_routes,
                                  search_space)
from nvfly.cli import main as cli_main
from nvfly.torch.explain import explain
from nvfly.torch.gemm_ops import (AUTO, TensorInfo, Workload, _gemm, analyze, clear_decisions, decisions,
                                  decode_config, encode_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.device("cuda", 0)


def info(shape, strides, dtype=torch.bfloat16, device=CUDA, byte_offset=0):
    return TensorInfo(tuple(shape), tuple(strides), dtype, device, byte_offset)


@pytest.fixture
def hopper_metadata(monkeypatch):
    """Eligibility of CUDA metadata as if an sm_90 GPU were present."""
    monkeypatch.setattr(operands, "capability", lambda device: (9, 0))


def workload(m, n, k, batches=1, majors=("K", "K")):
    return Workload(batches, m, n, k, torch.bfloat16, torch.bfloat16, *majors)


# ---------------------------------------------------------------------------------------------- config strings
def test_config_strings_round_trip_and_reject_garbage():
    cfg = GemmConfig(128, 64, 7, 2, group_m=16, split_k=3)
    assert decode_config(encode_config(cfg)) == (cfg, False)
    assert decode_config(encode_config(cfg, swap=True)) == (cfg, True)
    assert encode_config(None) == AUTO and decode_config(AUTO) == (None, False)
    assert encode_config(cfg).startswith("bm=128,bn=64,stages=7,consumers=2,group_m=16,split_k=3,")
    # a late field (store_tiles) is named only where set: older strings and names stay as they were
    late = dataclasses.replace(cfg, split_k=1, tma_store=True, store_tiles=2)
    assert encode_config(cfg).endswith(",cluster_n=1") and "store_tiles" not in repr(cfg)
    assert decode_config(encode_config(late)) == (late, False) and repr(late).endswith(", store_tiles=2)")
    for bad in ("bm=1x", "nonsense", "swap:", "bm=128,color=3"):
        with pytest.raises(ValueError, match="malformed"):
            decode_config(bad)


# ---------------------------------------------------------------------------------------------- analysis
def test_workload_analysis_of_compile_time_metadata(hopper_metadata):
    w, reason = analyze(info((512, 1024), (1024, 1)), info((1024, 4096), (1, 1024)))
    assert reason is None and (w.m, w.n, w.k, w.batches) == (512, 4096, 1024, 1)
    assert (w.a_major, w.b_major) == ("K", "K")
    assert w.key() == "bf16>bf16 b1 m512 n4096 k1024 K/K"
    w, _ = analyze(info((4, 304, 64), (64 * 304, 1, 304)), info((4, 64, 96), (64 * 96, 96, 1)))
    assert (w.batches, w.a_major, w.b_major) == (4, "MN", "MN")
    assert w.key() == "bf16>bf16 b4 m512 n128 k64 MN/MN"  # power-of-two buckets


@pytest.mark.parametrize("a,b,expected", [
    (info((64, 64), (64, 1), device=torch.device("cpu")), info((64, 64), (64, 1), device=torch.device("cpu")),
     "a is on cpu, not CUDA"),
    (info((64, 64), (64, 1), torch.float32), info((64, 64), (64, 1), torch.float32), "bf16 or fp16"),
    (info((64, 1023), (1023, 1)), info((1023, 64), (64, 1)), "not a multiple of 16 bytes"),
    (info((64, 64), (64, 1), byte_offset=2), info((64, 64), (64, 1)), "not 16-byte aligned"),
    (info((64, 64), (128, 2)), info((64, 64), (64, 1)), "neither of its last two dimensions is contiguous"),
    (info((64, 32), (32, 1)), info((64, 64), (64, 1)), "do not multiply"),
])
def test_declined_workloads_say_why(hopper_metadata, a, b, expected):
    w, reason = analyze(a, b)
    assert w is None and expected in reason


def test_analysis_failures_become_reasons(monkeypatch):
    def no_gpu(device):
        raise RuntimeError("no driver")
    monkeypatch.setattr(operands, "capability", no_gpu)
    w, reason = analyze(info((64, 64), (64, 1)), info((64, 64), (64, 1)))
    assert w is None and "eligibility check failed" in reason and "no driver" in reason


# ---------------------------------------------------------------------------------------------- candidates
def _valid(config):
    cfg, _ = decode_config(config)
    return cfg is None or cfg.check(2) is None


def test_candidates_are_few_valid_and_start_with_the_heuristic():
    small = candidates(workload(16, 4096, 4096))
    assert [c.config for c in small][0] == AUTO and len(small) == 4
    assert all(c.config.startswith("swap:") for c in small[1:])  # small M runs on the swapped problem
    large = candidates(workload(4096, 14336, 4096), limit=None)
    assert AUTO in [c.config for c in large] and not any(c.config.startswith("swap:") for c in large)
    assert len({c.config for c in large}) == len(large) and all(_valid(c.config) for c in small + large)
    # the heuristic's other tiles as tuned (not ping-pong variants that cannot hold their accumulators), and a
    # 2-block cluster
    tiles = {(cfg.bm, cfg.bn, cfg.pingpong, cfg.cluster_m) for cfg, _ in (decode_config(c.config) for c in large[1:])}
    assert {(128, 256, False, 1), (256, 128, False, 1), (128, 256, False, 2)} <= tiles
    split = candidates(workload(256, 512, 16384), limit=None)  # few tiles, long K: split K, whole tiles off
    assert all(cfg.split_k > 1 and not cfg.pingpong and not cfg.tma_store and cfg.cluster_m == 1
               for cfg, _ in (decode_config(c.config) for c in split[1:]))


def test_candidates_take_the_database_winners_next():
    w = workload(2048, 4096, 4096)
    tuned = encode_config(GemmConfig(128, 192, 4, 2))
    entry = Entry(w.key(), (1, 2048, 4096, 4096), tuned, {tuned: 0.1, AUTO: 0.2, "bm=64,bn=64": 0.3}, 0.15, "now")
    found = candidates(w, entry, limit=3)
    assert [(c.config, c.source) for c in found] == [(AUTO, "heuristic"), (tuned, "database"),
                                                     (found[2].config, "variant")]


def test_search_space():
    w = workload(2048, 4096, 4096)
    pruned, full = search_space(w), search_space(w, "full")
    assert pruned[0] == AUTO and len(pruned) < len(full) and set(pruned) <= set(full)
    assert all(_valid(c) for c in full)
    swapped = search_space(workload(16, 4096, 4096))
    assert all(c == AUTO or c.startswith("swap:") for c in swapped)
    with pytest.raises(ValueError):
        search_space(w, "everything")


# ---------------------------------------------------------------------------------------------- database
def _entry(key, best="auto", best_ms=0.5, torch_ms=1.0):
    return Entry(key, (1, 16, 4096, 4096), best, {best: best_ms, "other": best_ms * 2}, torch_ms, "2026-11-29")


def test_database_persists_and_merges_writers(tmp_path):
    path = str(tmp_path / "autotune" / "gemm-test.json")
    first, second = Database(path, "Test GPU"), Database(path, "Test GPU")
    first.update([_entry("k1")])
    second.update([_entry("k2", torch_ms=0.1)])  # a second process: its update keeps k1
    reread = Database(path, "Test GPU")
    assert {e.key for e in reread.entries()} == {"k1", "k2"}
    assert reread.lookup("k1").nvfly_faster and not reread.lookup("k2").nvfly_faster
    assert reread.lookup("k1").ranked() == ["auto", "other"]
    with open(path) as f:
        doc = json.load(f)
    assert doc["card"] == "Test GPU" and doc["nvfly"] == nvfly.__version__
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".autotune-")]  # no temp files left


def test_unreadable_database_is_ignored(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    assert Database(str(path), "x").entries() == []


# ---------------------------------------------------------------------------------------------- eager routing
@pytest.fixture
def fake_gpu_database(monkeypatch, tmp_path):
    """Eager decisions on CPU tensors as if they were eligible, against a database in tmp_path."""
    autotune_module = importlib.import_module("nvfly.torch.autotune")  # nvfly.torch.autotune is the function
    db = Database(str(tmp_path / "db.json"), "Test GPU")
    monkeypatch.setattr(autotune_module, "database", lambda device=None: db)
    monkeypatch.setattr(autotune_module, "analyze", lambda a, b, c=None: (Workload(
        1, a.shape[0], b.shape[1], a.shape[1], a.dtype, a.dtype, "K", "K"), None))
    autotune_module._forget_eager_decisions()
    yield db
    autotune_module._forget_eager_decisions()


def test_eager_routing_follows_the_database(fake_gpu_database):
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    key = Workload(1, 16, 32, 64, torch.bfloat16, torch.bfloat16, "K", "K").key()
    reason, _ = _eager("mm", a, b)
    assert "no autotune entry" in reason
    fake_gpu_database.update([_entry(key, best="bm=64,bn=32", best_ms=2.0, torch_ms=1.0)])  # clears decisions
    assert "torch is faster" in _eager("mm", a, b)[0]
    fake_gpu_database.update([_entry(key, best="bm=64,bn=32", best_ms=0.5, torch_ms=1.0)])
    assert _eager("mm", a, b) == (None, "bm=64,bn=32")
    assert "out=" in _eager("mm", a, b, out=torch.empty(0, dtype=torch.bfloat16))[0]
    assert "complex" in _eager("addmm", a, b, torch.zeros(32).bfloat16(), beta=1j)[0]


def test_database_updates_drop_the_eager_launches_with_the_decisions(fake_gpu_database):
    """A routed signature's bound launches belong to the config its decision picked: a database update forgets
    both, so the next call decides and binds again."""
    autotune_module = importlib.import_module("nvfly.torch.autotune")
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    _eager("mm", a, b)
    signature = autotune_module._eager_key(a, b, None, None, 1, 1)
    autotune_module._EAGER_CALLS.remember(signature, "launches of the old config")
    key = Workload(1, 16, 32, 64, torch.bfloat16, torch.bfloat16, "K", "K").key()
    fake_gpu_database.update([_entry(key, best="bm=64,bn=32", best_ms=0.5, torch_ms=1.0)])
    assert len(autotune_module._EAGER) == 0 and len(autotune_module._EAGER_CALLS) == 0


def test_eager_routes_decline_cpu_tensors_and_fall_through():
    register_routes()
    ops = {r.op for r in routing.routes()}
    assert {"aten::mm", "aten::mm.out", "aten::bmm", "aten::addmm", "aten::addmm.out", "aten::baddbmm"} <= ops
    eligibility, _, _, _ = _route("addmm", with_c=True)
    c, a, b = torch.zeros(3).bfloat16(), torch.randn(2, 4).bfloat16(), torch.randn(4, 3).bfloat16()
    assert eligibility(c, a, b, beta=1, alpha=1) == "a is on cpu, not CUDA"
    assert "a: dtype torch.float32 is not supported" in eligibility(c.float(), a.float(), b.float(), beta=1, alpha=1)

    class Fallthrough:
        calls = []

        def call_boxed(self, keyset, *args, **kwargs):
            self.calls.append(args)
            return torch.addmm(*args, **kwargs)

    route = next(r for r in routing.routes() if r.op == "aten::addmm")
    impl = routing._routed(route, Fallthrough())
    with nvfly.torch.routing():  # the module is callable: install the routes, then switch on
        assert routing.routing_enabled()
        assert torch.equal(impl(None, c, a, b), torch.addmm(c, a, b))
    assert not routing.routing_enabled() and len(Fallthrough.calls) == 1


def test_enable_and_disable_routing():
    assert not nvfly.torch.routing_enabled()
    nvfly.torch.enable_routing()
    try:
        assert nvfly.torch.routing_enabled()
    finally:
        nvfly.torch.disable_routing()
    assert not nvfly.torch.routing_enabled()


# ---------------------------------------------------------------------------------------------- custom ops
def test_custom_ops_fall_back_to_torch_and_differentiate():
    clear_decisions()
    a = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    c = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.nvfly.mm(a, b), (a, b))
    assert torch.autograd.gradcheck(lambda c, a, b: torch.ops.nvfly.addmm(c, a, b, beta=0.5, alpha=2.0), (c, a, b))
    wb = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: torch.ops.nvfly.bmm(a, b), (x, wb))
    assert torch.autograd.gradcheck(lambda x, w, c: torch.ops.nvfly.linear(x, w, c), (x, w, c))
    assert torch.autograd.gradcheck(lambda x, w: torch.ops.nvfly.linear(x, w), (x, w))
    # shapes and dtypes are checked before the device
    assert {d.reason for d in decisions() if d.where == "op"} == {
        "a: dtype torch.float64 is not supported: nvfly's GEMM takes bf16 or fp16 operands"}
    out = torch.empty(5, 3, dtype=torch.float64)
    torch.ops.nvfly.addmm_out(c.detach(), a.detach(), b.detach(), out, beta=0.5, alpha=2.0)
    assert torch.allclose(out, torch.addmm(c, a, b, beta=0.5, alpha=2.0))
    with pytest.raises(ValueError, match="2-D"):
        torch.ops.nvfly.mm(x, w.t())


def test_custom_ops_pass_opcheck():
    a, b, c = torch.randn(4, 5), torch.randn(5, 6), torch.randn(6)
    torch.library.opcheck(torch.ops.nvfly.mm.default, (a, b))
    torch.library.opcheck(torch.ops.nvfly.addmm.default, (c, a, b), {"beta": 0.5})
    torch.library.opcheck(torch.ops.nvfly.linear.default, (torch.randn(2, 4, 5), torch.randn(6, 5), c))
    torch.library.opcheck(torch.ops.nvfly.mm_out.default, (a, b, torch.empty(4, 6)))
    torch.library.opcheck(torch.ops.nvfly.addmm_out.default, (c, a, b, torch.empty(4, 6)), {"alpha": 2.0})


def test_a_failing_nvfly_call_falls_back_and_is_remembered(monkeypatch, hopper_metadata):
    gemm_ops = importlib.import_module("nvfly.torch.gemm_ops")
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected launch failure")
    monkeypatch.setattr(gemm_ops, "nvfly_gemm", broken)
    monkeypatch.setattr(gemm_ops, "analyze", lambda a, b, c=None: (workload(4, 3, 5), None))
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    for _ in range(2):
        assert torch.allclose(_gemm("mm", a, b, config="auto-test-key"), a @ b)
    assert calls == [1]  # the second call went straight to torch
    assert any("injected launch failure" in (d.reason or "") for d in decisions())
    # what Inductor's benchmark of an nvfly choice checks after timing the op: it ran torch, not nvfly
    assert "injected launch failure" in gemm_ops.bound_reason(a, b, config="auto-test-key")
    assert gemm_ops.bound_reason(a, b, config="another-key") is None


# ---------------------------------------------------------------------------------------------- inductor
@pytest.fixture
def compile_addmm(aten_max_autotune):
    """torch.compile(max-autotune) of an addmm on CPU with only ATen (and nvfly) to choose from."""
    def run(c, a, b):
        fn = torch.compile(lambda c, a, b: torch.addmm(c, a, b, beta=0.5), mode="max-autotune-no-cudagraphs")
        out, code = run_and_get_code(fn, c, a, b)
        assert torch.allclose(out, torch.addmm(c, a, b, beta=0.5), atol=1e-5)
        return "\n".join(code)
    return run


@pytest.fixture
def eligible_on_cpu(monkeypatch):
    """nvfly's choices on CPU tensors: the analysis accepts them, two candidates, no kernel compiles."""
    monkeypatch.setattr(inductor, "analyze", lambda a, b, c=None: (workload(a.shape[0], b.shape[1], a.shape[1]),
                                                                  None))
    monkeypatch.setattr(inductor, "_candidates", lambda w, device: [AUTO, encode_config(GemmConfig())])
    monkeypatch.setattr(inductor.NvflyCaller, "_compile", lambda self, operands: None)


OPERANDS = (torch.randn(48), torch.randn(64, 32), torch.randn(32, 48))


def test_inductor_declines_cpu_gemms_with_a_reason(compile_addmm):
    nvfly.torch.install()
    assert "nvfly" not in compile_addmm(*(t.bfloat16() for t in OPERANDS))
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.op == "addmm" and d.shape == (1, 64, 48, 32) and d.reason == "a is on cpu, not CUDA"


def test_inductor_emits_the_nvfly_op_when_it_wins(compile_addmm, eligible_on_cpu, monkeypatch):
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", lambda self, *args, out: 1e-6)
    nvfly.torch.install()
    code = compile_addmm(*OPERANDS)  # the op runs on torch at run time (CPU), so the result is still right
    assert "torch.ops.nvfly.addmm_out.default(" in code and "config='auto'" in code and "beta=0.5" in code
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.candidates == (AUTO, encode_config(GemmConfig())) and d.winner == "nvfly auto"
    # torch 2.11 adds a bias_addmm extern choice beside addmm
    assert {"aten addmm", "nvfly auto", f"nvfly {encode_config(GemmConfig())}"} <= set(d.timings_ms)
    assert set(d.timings_ms) <= {"aten addmm", "aten bias_addmm", "nvfly auto", f"nvfly {encode_config(GemmConfig())}"}


def test_inductor_drops_candidates_that_fail_to_benchmark(compile_addmm, eligible_on_cpu):
    nvfly.torch.install()
    assert "nvfly" not in compile_addmm(*OPERANDS)  # nvfly_gemm raises on CPU tensors: infinite times
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.winner == "aten addmm" and "failed to benchmark" in d.reason


def test_inductor_drops_candidates_that_fail_to_compile(compile_addmm, eligible_on_cpu, monkeypatch):
    def broken(self, operands):
        raise nvfly.CompileError("injected compile failure")
    monkeypatch.setattr(inductor.NvflyCaller, "_compile", broken)
    nvfly.torch.install()
    assert "nvfly" not in compile_addmm(*(t.bfloat16() for t in OPERANDS))
    (d,) = [d for d in decisions() if d.where == "inductor"]
    assert d.winner == "aten addmm" and "failed to compile" in d.reason and "injected" in d.reason


class ForeignChoices(InductorChoices):
    def uuid(self):
        return "someone-else"


def foreign_factory():
    return ForeignChoices()


def test_preprocessing_fallback_when_the_choices_slot_is_taken(compile_addmm, eligible_on_cpu, monkeypatch):
    monkeypatch.setattr(inductor.NvflyCaller, "benchmark", lambda self, *args, out: 1e-6)
    with inductor_config.patch(inductor_choices_class=foreign_factory):  # (monkeypatch would delete the key)
        nvfly.torch.install()
        assert inductor_config.inductor_choices_class is foreign_factory
        assert isinstance(inductor_config.post_grad_custom_post_pass, inductor.CacheKeyPass)
        assert "torch.ops.nvfly.addmm_out.default(" in compile_addmm(*OPERANDS)
        nvfly.torch.uninstall()
        assert inductor_config.post_grad_custom_post_pass is None


class PriorPass(CustomGraphPass):
    calls = 0

    def __call__(self, graph):
        PriorPass.calls += 1

    def uuid(self):
        return "prior"


def test_graph_cache_pass_for_torch_without_choices_uuid(monkeypatch):
    monkeypatch.setattr(inductor, "_choices_uuid_in_graph_key", lambda: False)
    prior = PriorPass()
    with inductor_config.patch(post_grad_custom_post_pass=prior):
        nvfly.torch.install()
        try:
            key_pass = inductor_config.post_grad_custom_post_pass
            assert isinstance(key_pass, inductor.CacheKeyPass) and key_pass.uuid() == (inductor.uuid(), "prior")
            key_pass(torch.fx.Graph())
            assert PriorPass.calls == 1
            assert inductor_config.inductor_choices_class is inductor.choices_factory
        finally:
            nvfly.torch.uninstall()
        assert inductor_config.post_grad_custom_post_pass is prior and inductor_config.inductor_choices_class is None


def test_fx_graph_cache_is_keyed_on_nvfly(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    c, a, b = OPERANDS

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda c, a, b: torch.addmm(c, a, b), mode="max-autotune-no-cudagraphs")
        assert torch.allclose(fn(c, a, b), torch.addmm(c, a, b), atol=1e-5)
        return counters["inductor"]["fxgraph_cache_hit"]

    with inductor_config.patch({"max_autotune_gemm_backends": "ATEN", "fx_graph_cache": True}):
        nvfly.torch.install()
        try:
            assert compile_once() == 0 and compile_once() == 1
        finally:
            nvfly.torch.uninstall()
        assert compile_once() == 0  # without nvfly the key differs: no graph compiled with nvfly is reused
    torch._dynamo.reset()


def _run_python(code, **env):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **env}, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_hash_keys_are_deterministic_across_processes():
    code = """
        import nvfly.torch.inductor as i
        print(i.uuid(), i._extern_choice("mm_out").hash_key(), i._extern_choice("addmm_out").hash_key())
    """
    first, second = _run_python(code), _run_python(code)
    assert first == second and first.split()[1].startswith("nvfly-mm_out-nvfly-")
    assert _run_python(code, NVFLY_OPT_LEVEL="2") != first  # a codegen setting changes every key


def test_importing_nvfly_torch_installs_nothing():
    out = _run_python("""
        import torch._inductor.config as c
        import nvfly.torch
        from nvfly.torch import routing
        print(c.inductor_choices_class, c.post_grad_custom_post_pass, routing.installed(), routing.routing_enabled(),
              "nvfly.torch.inductor" in __import__("sys").modules)
    """)
    assert out == "None None [] False False"


# ---------------------------------------------------------------------------------------------- explain
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what explain says on a machine without a GPU")
def test_explain_without_a_gpu(capsys):
    clear_decisions()
    _gemm("mm", torch.randn(16, 64).bfloat16(), torch.randn(64, 48).bfloat16())  # recorded for shape (1, 16, 48, 64)
    result = explain(16, 48, 64)
    assert "no CUDA GPU" in result.declined and result.candidates[0].config == AUTO
    assert [d.reason for d in result.decisions] == ["a is on cpu, not CUDA"]
    text = str(result)
    assert "verdict: nvfly is declined" in text and "a is on cpu, not CUDA" in text and "auto" in text
    assert cli_main(["explain", "16", "4096", "4096", "--majors", "K,MN", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["majors"] == ["K", "MN"] and doc["key"] == "bf16>bf16 b1 m16 n4096 k4096 K/MN"
    assert doc["auto"].startswith("wgmma-swapAB-splitK2: 64x16 tile of the transposed problem")
    # what "auto" runs, planned without a GPU: the token tile filling a wave, the weights streamed
    assert "auto (the heuristic's plan): wgmma: 64x80 tile on 128 blocks" in str(explain(64, 10240, 8192))
    assert explain(64, 10240, 8192).auto.endswith("B streamed (L2 evict_first)")
    assert cli_main(["explain", "16", "4096", "4096", "--majors", "K"]) == 2


def test_explain_verdicts():
    w = workload(16, 4096, 4096)
    fast = _entry(w.key(), best="auto", best_ms=0.5, torch_ms=1.0)
    slow = _entry(w.key(), best="auto", best_ms=2.0, torch_ms=1.0)
    from nvfly.torch.explain import Explanation
    assert "nvfly wins (autotune database)" in Explanation(w, None, "", [], fast, None, []).verdict()
    assert "nvfly loses (measured now)" in Explanation(w, None, "", [], fast, slow, []).verdict()
    assert "not measured" in Explanation(w, None, "", [], None, None, []).verdict()


# ---------------------------------------------------------------------------------------------- decision cache
def _counting_route(eligible, signature=None, run=None):
    """A route on CPU's topk schema whose eligibility counts its calls; with ``signature`` (default: the tensor's
    ``routing.tensor_key`` and k) the routed kernel decides once per signature."""
    checks = []

    def eligibility(x, k, dim=-1, largest=True, sorted=True):
        checks.append((tuple(x.shape), tuple(x.stride()), x.dtype, k))
        return eligible(x, k)

    def default_run(x, k, dim=-1, largest=True, sorted=True):
        return torch.full((1,), 7.0), torch.zeros(1, dtype=torch.int64)

    signature = signature or (lambda x, k, dim=-1, largest=True, sorted=True: (routing.tensor_key(x), k))
    route = routing.Route("aten::topk", eligibility, run or default_run, "CPU", signature)
    impl = routing._routed(route, torch.library.get_kernel("aten::topk", "CPU"))
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    return (lambda x, k: impl(keyset, x, k, -1, True, True)), checks


def test_a_repeated_declined_call_is_decided_once():
    call, checks = _counting_route(lambda x, k: "declined for the test")
    x = torch.randn(4, 32)
    with routing.routing():
        for _ in range(5):
            values, indices = call(x, 3)
            assert torch.equal(indices, torch.topk(x, 3).indices)  # torch's kernel ran
        call(torch.randn(4, 32), 3)  # new values, same signature
    assert len(checks) == 1


def test_strides_dtypes_alignment_and_scalars_get_their_own_decisions():
    """Eligibility reading strides and dtype: each layout is decided on its own, and each keeps its answer."""
    call, checks = _counting_route(lambda x, k: None if x.stride(-1) == 1 and x.dtype == torch.float32 else "no")
    base = torch.randn(64, 64)
    cases = [(base[:8, :32], True), (base.t()[:8, :32], False), (base[:8, :32].double(), False),
             (base.view(-1)[1:257].view(8, 32), True)]  # 4 bytes in: another alignment, another signature
    with routing.routing():
        for _ in range(2):
            for x, nvfly_runs in cases:
                got = call(x, 2)[0]
                assert torch.equal(got, torch.full((1,), 7.0)) == nvfly_runs
            call(base[:8, :32], 5)  # another k: another signature
    assert len(checks) == len(cases) + 1


def test_a_call_without_a_signature_is_decided_every_time():
    def unhashable(x, k, *rest):
        return [x.shape]  # a list: the call is decided without being remembered

    call, checks = _counting_route(lambda x, k: "no", signature=unhashable)
    with routing.routing():
        call(torch.randn(2, 8), 1)
        call(torch.randn(2, 8), 1)
    assert len(checks) == 2


def test_an_nvfly_failure_declines_its_signature():
    runs = []

    def failing(x, k, dim=-1, largest=True, sorted=True):
        runs.append(k)
        raise RuntimeError("boom")

    call, checks = _counting_route(lambda x, k: None, run=failing)
    x = torch.randn(3, 16)
    with routing.routing():
        for _ in range(3):
            assert torch.equal(call(x, 2)[1], torch.topk(x, 2).indices)
    assert runs == [2] and len(checks) == 1


def test_the_decision_cache_is_bounded():
    from nvfly.ops.common.opcall import CALL_LIMIT
    call, checks = _counting_route(lambda x, k: "no")
    decided = routing._DECIDED[-1]
    x = torch.randn(1, CALL_LIMIT + 8)
    with routing.routing():
        for k in range(1, CALL_LIMIT + 8):
            call(x, k)
    assert len(checks) == CALL_LIMIT + 7 and 0 < len(decided) <= CALL_LIMIT


def test_an_autotune_entry_added_later_flips_the_routed_gemm(fake_gpu_database):
    """The real mm route, decided once per signature: declined without an entry (and not asked again), run on
    nvfly once the database says it wins (the update forgets the routes' decisions)."""
    _, run, signature, _ = _route("mm", with_c=False)
    runs = []
    autotune_module = importlib.import_module("nvfly.torch.autotune")
    analyzed = []
    real_eager = autotune_module._eager

    def eager(*args, **kwargs):
        analyzed.append(args[0])
        return real_eager(*args, **kwargs)

    def nvfly_mm(a, b, **kwargs):
        runs.append(a.shape)
        return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)

    clear_decisions()
    route = routing.Route("aten::mm", lambda a, b, **kw: eager("mm", a, b)[0], nvfly_mm, "CPU", signature)
    impl = routing._routed(route, torch.library.get_kernel("aten::mm", "CPU"))
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    with routing.routing():
        for _ in range(3):
            assert torch.equal(impl(keyset, a, b), a @ b)  # no entry: torch
        assert analyzed == ["mm"] and runs == []
        key = Workload(1, 16, 32, 64, torch.bfloat16, torch.bfloat16, "K", "K").key()
        fake_gpu_database.update([_entry(key, best="bm=64,bn=32", best_ms=0.5, torch_ms=1.0)])
        for _ in range(2):
            assert not impl(keyset, a, b).any()  # nvfly (the stub's zeros)
    assert analyzed == ["mm", "mm"] and runs == [a.shape, a.shape]
    assert len([d for d in decisions() if d.where == "eager"]) == 2  # recorded once per decision


def test_gemm_bind_keeps_the_launches_and_the_output_it_allocates(monkeypatch):
    """The GEMM routes' bind: launches bound once per signature (``_EAGER_CALLS``), a runner that allocates the
    product (contiguous, the launches' shape and dtype, the operands' device) or writes out=, and passes each call's
    alpha and beta, and C only where beta is not 0."""
    from nvfly.ops.common.opcall import OpCalls
    autotune_module = importlib.import_module("nvfly.torch.autotune")
    monkeypatch.setattr(autotune_module, "_EAGER_CALLS", OpCalls())
    monkeypatch.setattr(autotune_module, "_eager", lambda *args, **kwargs: (None, "bm=64,bn=32"))
    binds, launches = [], []

    class Launches:
        shape, out_dtype = (16, 32), torch.bfloat16

        def run(self, a, b, c, out, alpha, beta):
            launches.append((a, b, c, out, alpha, beta))

    def bind_config(a, b, c_used, *, alpha, out, config):
        binds.append((c_used is not None, alpha, out is not None, config))
        return Launches()

    monkeypatch.setattr(autotune_module, "bind_config", bind_config)
    _, _, _, bind_addmm = _route("addmm", with_c=True)
    _, _, _, bind_mm = _route("mm", with_c=False)
    c, a, b = torch.zeros(32).bfloat16(), torch.randn(16, 64).bfloat16(), torch.randn(64, 32).bfloat16()
    runs = bind_addmm(c, a, b, beta=1, alpha=2)
    product = runs(c, a, b, beta=0.5, alpha=3)  # other values, one signature (alpha != 1, beta != 0)
    assert product.shape == (16, 32) and product.dtype == torch.bfloat16 and product.is_contiguous()
    assert launches[-1][:3] == (a, b, c) and launches[-1][3] is product and launches[-1][4:] == (3.0, 0.5)
    bind_addmm(c, a, b, beta=1, alpha=2)  # the same signature: the launches bound before
    bind_addmm(c, a, b, beta=0, alpha=1)(c, a, b, beta=0, alpha=1)
    assert launches[-1][2] is None and launches[-1][4:] == (1.0, 0.0)  # beta 0: C not read
    out = torch.empty(16, 32).bfloat16()
    assert bind_mm(a, b, out=out)(a, b, out=out) is out and launches[-1][3] is out
    assert binds == [(True, 2.0, False, "bm=64,bn=32"), (False, 1.0, False, "bm=64,bn=32"),
                     (False, 1.0, True, "bm=64,bn=32")]
