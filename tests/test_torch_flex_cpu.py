"""Eager flex_attention routing without a GPU (``nvfly.torch.flex_ops``): the FX-graph-to-callable translation of
the mods flex hands its op (dynamo graphs and aten graphs) against the Python mods on CPU tensors; the whole route
on the CPU dispatch key with nvfly's kernels replaced by their float32 references (``prefill_reference`` /
``reference``), against torch's flex; the eligibility reasons on fake CUDA tensors; the decisions; an nvfly
exception falling back; routing off and uninstall leaving torch's flex alone."""
import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import nvfly.torch
from nvfly.ops import attention
from nvfly.torch import flex_ops as F
from nvfly.torch.gemm_ops import clear_decisions, decisions
from tests.dispatched import dispatched

bf = torch.bfloat16
SLOPES = torch.rand(4) + 0.1
DOCS = torch.tensor([[0] * 100 + [1] * 150 + [2] * 50, [0] * 300])
BIAS = torch.randn(4, 9)


def soft_cap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 20) * 20


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def relative(score, b, h, q_idx, kv_idx):
    return score + BIAS[h, torch.clamp(kv_idx - q_idx, -4, 4) + 4]


def gated(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx > q_idx, score * 0.5, torch.sigmoid(score))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 64)


def document(b, h, q_idx, kv_idx):
    return DOCS[b, q_idx] == DOCS[b, kv_idx]


def not_first_key(b, h, q_idx, kv_idx):
    return kv_idx != 0


@pytest.fixture(autouse=True)
def route_on_cpu():
    """The route on the CPU key, decisions cleared; nvfly's kernels replaced by their references (``ran`` lists
    the kernels the route called)."""
    clear_decisions()
    F.forget_decisions()
    F.install(("CPU",))
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    yield
    F.uninstall()
    F.forget_decisions()


def references_run(ran):
    """``flex_ops.run`` with nvfly's kernels replaced by their float32 references (``ran`` lists the kernels)."""
    def run(call):
        decode = F._uses_decode(call)
        score, _, block_mask = F._kernel_mods(call, decode)
        kernel = "decode" if decode else "prefill"
        ran.append(kernel)
        if kernel == "decode":
            out, lse = attention.reference(call.q, call.k, call.v, scale=call.scale, causal=False, score_mod=score,
                                           block_mask=block_mask)
        else:
            out, lse = attention.prefill_reference(call.q, call.k, call.v, scale=call.scale, score_mod=score,
                                                   block_mask=block_mask)
        return out.to(call.q.dtype).transpose(1, 2), lse / math.log(2), lse.new_empty(0)
    return run


@pytest.fixture
def references(monkeypatch):
    ran = []
    monkeypatch.setattr(F, "run", references_run(ran))
    monkeypatch.setattr(F, "reason", lambda call, grad: None)  # CPU tensors: the references take them
    return ran


def _qkv(batch=2, hq=4, hkv=4, sq=300, skv=300, d=64, dtype=torch.float32):
    torch.manual_seed(sq * 7 + skv)
    return (torch.randn(batch, hq, sq, d, dtype=dtype), torch.randn(batch, hkv, skv, d, dtype=dtype),
            torch.randn(batch, hkv, skv, d, dtype=dtype))


# ---------------------------------------------------------------------------------------------- translation
def _graphs_flex_hands_over(monkeypatch, score_mod, mask_mod, sq=300):
    """The (score graph, score buffers, mask graph, mask buffers) flex's eager call gives its op."""
    seen = []
    monkeypatch.setattr(F, "decide", lambda call: seen.append(call) or "captured by the test")
    q, k, v = _qkv(sq=sq, skv=300)
    block_mask = create_block_mask(mask_mod, 2, None, sq, 300, device="cpu") if mask_mod else None
    with nvfly.torch.routing():
        flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    call = seen[0]
    return call.score_mod, call.score_buffers, call.mask_mod, call.mask_buffers


def _indices():
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(4)[None, :, None, None]
    q = torch.arange(300)[None, None, :, None]
    kv = torch.arange(300)[None, None, None, :]
    return b, h, q, kv


@pytest.mark.parametrize("score_mod", [soft_cap, alibi, relative, gated])
def test_score_graph_translates_to_the_mod(monkeypatch, score_mod):
    graph, buffers, _, _ = _graphs_flex_hands_over(monkeypatch, score_mod, None)
    assert isinstance(graph, torch.fx.GraphModule) and F.check_graph(graph) is None
    assert len(buffers) == (score_mod in (alibi, relative))
    fn = F.graph_callable("score", graph, buffers)
    b, h, q, kv = _indices()
    score = torch.randn(2, 4, 300, 300)
    torch.testing.assert_close(fn(score, b, h, q, kv), score_mod(score, b, h, q, kv))


@pytest.mark.parametrize("mask_mod", [causal, window, document, not_first_key])
def test_mask_graph_translates_to_the_mod(monkeypatch, mask_mod):
    _, _, graph, buffers = _graphs_flex_hands_over(monkeypatch, None, mask_mod)
    assert F.check_graph(graph) is None and F._masks(graph)
    fn = F.graph_callable("mask", graph, buffers)
    b, h, q, kv = _indices()
    assert torch.equal(fn(b, h, q, kv).expand(2, 4, 300, 300), mask_mod(b, h, q, kv).expand(2, 4, 300, 300))


def _aten_graph(mod, buffer=None):
    """``mod`` traced to aten ops as flex's autograd path does (make_fx), its captured tensor an input."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    scalars = (torch.tensor(0.5), torch.tensor(1), torch.tensor(2), torch.tensor(3), torch.tensor(5))
    with TransformGetItemToIndex():
        if buffer is None:
            return make_fx(lambda s, b, h, q, kv: mod(s, b, h, q, kv))(*scalars)
        return make_fx(lambda s, b, h, q, kv, t: mod(s, b, h, q, kv, t))(*scalars, buffer)


def test_aten_graphs_translate():
    """What flex's autograd path hands over (``create_fw_bw_graph``: make_fx, aten ops) translates too."""
    cases = [(soft_cap, None, soft_cap), (gated, None, gated),
             (lambda s, b, h, q, kv, t: s + t[h] * (kv - q), SLOPES, alibi),
             (lambda s, b, h, q, kv, t: s + t[h, torch.clamp(kv - q, -4, 4) + 4], BIAS, relative)]
    for traced, buffer, mod in cases:
        graph = _aten_graph(traced, buffer)
        targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
        assert all(isinstance(t, torch._ops.OpOverload) for t in targets), targets
        assert F.check_graph(graph) is None
        fn = F.graph_callable("score", graph, () if buffer is None else (buffer,))
        b, h, q, kv = _indices()
        score = torch.randn(2, 4, 300, 300)
        torch.testing.assert_close(fn(score, b, h, q, kv), mod(score, b, h, q, kv))


def test_operator_methods_translate():
    """torch 2.11's Dynamo records ``a == b`` on tensors as a ``call_method`` of ``__eq__``: the dunder methods
    translate like the operators (a document mask written with ``==`` and ``&``)."""
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 50, 150])).expand(2, 300)
    graph = torch.fx.Graph()
    b, h, q, kv, docs = (graph.placeholder(name) for name in ("b", "h", "q_idx", "kv_idx", "docs"))
    same = graph.call_method("__eq__", (graph.call_method("__getitem__", (docs, (b, q))),
                                        graph.call_method("__getitem__", (docs, (b, kv)))))
    graph.output(graph.call_method("__and__", (same, graph.call_method("__ge__", (q, kv)))))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert F.check_graph(gm) is None
    bi, hi, qi, kvi = _indices()
    got = F.interpret(gm, (bi, hi, qi, kvi, documents))
    want = (documents[bi, qi] == documents[bi, kvi]) & (qi >= kvi)
    assert torch.equal(got, want)


def test_same_code_shares_one_function_and_its_cells_follow_the_call(monkeypatch):
    graph, buffers, _, _ = _graphs_flex_hands_over(monkeypatch, alibi, None)
    first = F.graph_callable("score", graph, buffers)
    other = torch.full((4,), 2.0)
    second = F.graph_callable("score", graph, (other,))
    assert first is second  # one compiled kernel per graph code
    from nvfly.ops.attention.mods import Mods, captured_tensors
    assert captured_tensors(Mods(second))[0] is other


def test_untranslatable_graph_is_named(monkeypatch):
    def floor_mod(score, b, h, q_idx, kv_idx):
        return torch.floor(score)
    graph, _, _, _ = _graphs_flex_hands_over(monkeypatch, floor_mod, None)
    assert "floor" in F.check_graph(graph)


# ---------------------------------------------------------------------------------------------- the route
CASES = [
    ("causal", None, causal, 300, 300),
    ("soft-cap + causal", soft_cap, causal, 300, 300),
    ("alibi captured slopes", alibi, None, 300, 300),
    ("sliding window block mask", None, window, 300, 300),
    ("document mask", soft_cap, document, 300, 300),
    ("relative bias, Sq != Skv", relative, None, 200, 300),
    ("decode: Sq 4, mask without q_idx", soft_cap, not_first_key, 4, 300),
]


@pytest.mark.parametrize("case,score_mod,mask_mod,sq,skv", CASES, ids=[c[0] for c in CASES])
def test_routed_equals_torch_flex(references, case, score_mod, mask_mod, sq, skv):
    q, k, v = _qkv(sq=sq, skv=skv)
    block_mask = create_block_mask(mask_mod, 2, None, sq, skv, device="cpu") if mask_mod else None
    want, want_lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    assert not references
    with nvfly.torch.routing():
        got, got_lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    assert references == (["decode"] if sq <= 16 else ["prefill"])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-4, rtol=1e-4)  # natural log, as flex returns it
    # the references check themselves: without the mods the result differs
    if score_mod is not None:
        assert not torch.allclose(flex_attention(q, k, v, block_mask=block_mask), want, atol=1e-3)
    [decision] = [d for d in decisions() if d.op == "flex_attention"]
    assert decision.reason is None and decision.candidates == (references[0],)


@pytest.mark.parametrize("sq", [1, 4, 16])
def test_q_idx_at_decode_sizes_is_shifted(references, sq):
    """Decode's q_idx is the position: mods reading q_idx (ALiBi, a causal block mask) see it shifted back to flex's
    row by a captured (B,) tensor; the result is flex's."""
    q, k, v = _qkv(sq=sq, skv=300)
    block_mask = create_block_mask(window, 2, None, sq, 300, device="cpu")
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    assert references == ["decode"]
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask), atol=1e-4,
                               rtol=1e-4)


def test_q_idx_with_two_buffers_at_decode_size_runs_prefill(references):
    q, k, v = _qkv(sq=4, skv=300)
    block_mask = create_block_mask(document, 2, None, 4, 300, device="cpu")
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    assert references == ["prefill"]  # SLOPES and DOCS take both captured inputs: no room for the shift
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask), atol=1e-4,
                               rtol=1e-4)


def test_gqa(references):
    q, k, v = _qkv(hq=8, hkv=2)
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=soft_cap, enable_gqa=True)
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=soft_cap, enable_gqa=True), atol=1e-4,
                               rtol=1e-4)


def test_off_and_uninstalled_keep_torch(references):
    q, k, v = _qkv()
    flex_attention(q, k, v, score_mod=soft_cap)
    with nvfly.torch.routing(False):
        flex_attention(q, k, v, score_mod=soft_cap)
    F.uninstall()
    with nvfly.torch.routing():
        flex_attention(q, k, v, score_mod=soft_cap)
    assert references == []


def test_nvfly_exception_falls_back(monkeypatch, caplog):
    def broken(call):
        raise RuntimeError("injected")
    monkeypatch.setattr(F, "run", broken)
    monkeypatch.setattr(F, "reason", lambda call, grad: None)
    q, k, v = _qkv()
    with nvfly.torch.routing():
        got = flex_attention(q, k, v, score_mod=soft_cap)
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=soft_cap))
    assert any("nvfly raised RuntimeError: injected" in (d.reason or "") for d in decisions())


def test_real_reason_on_cpu_declines():
    q, k, v = _qkv()
    with nvfly.torch.routing():
        flex_attention(q, k, v, score_mod=soft_cap)
    [decision] = decisions()
    assert decision.reason == "q is on cpu, not CUDA"


# ---------------------------------------------------------------------------------------------- eligibility
@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        yield lambda shape, dtype=bf: torch.empty(shape, dtype=dtype, device="cuda")


def _call(make, sq=256, skv=256, hq=8, hkv=2, d=128, dtype=bf, score_mod=None, buffers=(), kv_batch=2,
          needs_max=False):
    q = make((2, sq, hq, d), dtype)
    k = make((kv_batch, skv, hkv, d), dtype)
    return F.FlexCall(q, k, k, score_mod, None, None, 0.1, buffers, (), needs_max)


def test_eligibility(fake_cuda):
    graph = _aten_graph(soft_cap)

    def floor_mod(score, b, h, q_idx, kv_idx):
        return torch.floor(score)
    floor_graph = _aten_graph(floor_mod)
    assert F.reason(_call(fake_cuda, score_mod=graph), False) is None
    assert F.reason(_call(fake_cuda, sq=8, skv=8192, score_mod=graph), False) is None  # decode
    assert "bfloat16 or float16" in F.reason(_call(fake_cuda, dtype=torch.float32), False)
    assert "max scores" in F.reason(_call(fake_cuda, needs_max=True), False)
    assert "batch" in F.reason(_call(fake_cuda, kv_batch=1), False)
    assert "floor" in F.reason(_call(fake_cuda, score_mod=floor_graph), False)
    assert "head dim 80" in F.reason(_call(fake_cuda, d=80), False)
    three = tuple(torch.zeros(2) for _ in range(3))
    assert "3 tensors" in F.reason(_call(fake_cuda, score_mod=graph, buffers=three), False)


def test_deepseek_head_dims_are_eligible(fake_cuda):
    """Dqk 192 / Dv 128 with 128 heads (models.py's DeepSeek-like flex row) reaches nvfly's prefill."""
    q, k = fake_cuda((1, 4096, 128, 192)), fake_cuda((1, 4096, 128, 192))
    v = fake_cuda((1, 4096, 128, 128))
    assert F.reason(F.FlexCall(q, k, v, None, None, None, 192 ** -0.5, (), (), False), False) is None


def test_fake_tensors_keep_torch(fake_cuda):
    call = _call(fake_cuda)
    assert "not a plain tensor" in F.decide(call)


# ---------------------------------------------------------------------------------------------- torch.compile
from nvfly.torch import flex_compile as C  # noqa: E402


def test_code_callable_reproduces_the_mods():
    """The op rebuilds the mods from their FX code (aten calls resolved to the translations)."""
    cases = [(soft_cap, None, soft_cap), (gated, None, gated),
             (lambda s, b, h, q, kv, t: s + t[h] * (kv - q), SLOPES, alibi),
             (lambda s, b, h, q, kv, t: s + t[h, torch.clamp(kv - q, -4, 4) + 4], BIAS, relative)]
    b, h, q, kv = _indices()
    for traced, buffer, mod in cases:
        code = _aten_graph(traced, buffer).code
        fn = C.code_callable("score", code, () if buffer is None else (buffer,))
        score = torch.randn(2, 4, 300, 300)
        torch.testing.assert_close(fn(score, b, h, q, kv), mod(score, b, h, q, kv))
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    with TransformGetItemToIndex():
        code = make_fx(lambda b, h, q, kv, t: t[b, q] == t[b, kv])(*map(torch.tensor, (1, 2, 3, 4)), DOCS).code
    fn = C.code_callable("mask", code, (DOCS,))
    assert torch.equal(fn(b, h, q, kv), document(b, h, q, kv))


def test_reason_on_meta():
    def meta(shape, dtype=bf, stride=None):
        t = torch.empty(shape, dtype=dtype, device="meta")
        return t if stride is None else t.as_strided(shape, stride)
    q, k = meta((2, 1024, 8, 128)), meta((2, 1024, 2, 128))
    assert F.reason_on_meta(F.FlexCall(q, k, k, None, None, None, 0.1, (), (), False)) is None
    odd = meta((2, 1024, 8, 80))
    assert "head dim 80" in F.reason_on_meta(F.FlexCall(odd, odd, odd, None, None, None, 0.1, (), (), False))
    unaligned = meta((2, 1024, 8, 128), stride=(1024 * 8 * 129, 8 * 129, 129, 1))
    assert "16 bytes" in F.reason_on_meta(F.FlexCall(unaligned, k, k, None, None, None, 0.1, (), (), False))


@pytest.fixture
def compiled_flex(monkeypatch):
    """nvfly's lowering installed (per-call option), the FX-graph cache off (each test lowers)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    patch = inductor_config.patch(fx_graph_cache=False)
    patch.__enter__()
    C.install()
    torch._dynamo.reset()

    def run(options, q, k, v, **kwargs):
        fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, kernel_options=options, **kwargs))
        out, codes = run_and_get_code(fn, q, k, v)
        return out, any("torch.ops.nvfly.flex_attention" in c for c in codes)
    yield run
    C.uninstall()
    patch.__exit__(None, None, None)
    torch._dynamo.reset()


def test_compiled_flex_calls_nvfly(compiled_flex, monkeypatch):
    """The per-call option emits nvfly's op (the code says so); on CPU the op computes through the float32
    reference with the mods rebuilt from the graphs' code: the result is flex's."""
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))  # the lowering's checks run on CPU (meta examples)
    q, k, v = (t.to(bf) for t in _qkv(sq=256, skv=256))
    block_mask = create_block_mask(document, 2, None, 256, 256, device="cpu")
    want = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    got, calls_nvfly = compiled_flex({"NVFLY": True}, q, k, v, score_mod=alibi, block_mask=block_mask)
    assert calls_nvfly
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert [d.winner for d in decisions() if d.where == "inductor"] == ["prefill"]


def test_auto_rule_takes_decode_calls_on_the_decode_kernel(compiled_flex, monkeypatch):
    """Without the option, the auto rule takes a decode-sized call (Sq <= 16) that nvfly runs on its decode kernel:
    mods that ignore q_idx as they are, mods that read it (ALiBi) with q_idx shifted back to flex's row (the op's
    "decode_shifted" path; on CPU its decode reference, which takes positions, gives flex's result). With both
    captured inputs taken (ALiBi's slopes and a document mask's ids: no room for the shift) the call would run
    nvfly's prefill kernel: it stays on Inductor, saying why."""
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))
    C.install(auto=True)
    q, k, v = (t.to(bf) for t in _qkv(sq=4, skv=300))
    for mod, path in ((soft_cap, "decode"), (alibi, "decode_shifted")):
        torch._dynamo.reset()
        clear_decisions()
        got, calls_nvfly = compiled_flex({}, q, k, v, score_mod=mod)
        assert calls_nvfly and [d.winner for d in decisions() if d.where == "inductor"] == [path]
        torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=mod), atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    clear_decisions()
    block_mask = create_block_mask(document, 2, None, 4, 300, device="cpu")
    got, calls_nvfly = compiled_flex({}, q, k, v, score_mod=alibi, block_mask=block_mask)
    assert not calls_nvfly
    assert [d.reason for d in decisions() if d.where == "inductor"][0].startswith("the auto rule takes Sq < 512")
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask), atol=2e-2,
                               rtol=2e-2)


def test_compiled_shifted_decode_with_a_mask(compiled_flex, monkeypatch):
    """A causal BlockMask at decode size under the per-call option: the op's decode path with q_idx shifted (each
    query sees the keys up to its row, flex's top-left meaning), equal to flex."""
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))
    q, k, v = (t.to(bf) for t in _qkv(sq=8, skv=200))
    block_mask = create_block_mask(causal, None, None, 8, 200, device="cpu")
    got, calls_nvfly = compiled_flex({"NVFLY": True}, q, k, v, block_mask=block_mask)
    assert calls_nvfly and [d.winner for d in decisions() if d.where == "inductor"] == ["decode_shifted"]
    torch.testing.assert_close(got, flex_attention(q, k, v, block_mask=block_mask), atol=2e-2, rtol=2e-2)


def test_compiled_flex_with_computed_inputs(monkeypatch):
    """q, k, v computed in the compiled function (a projection, its (B, H, S, D) view): realized for the op."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))
    x = torch.randn(2, 256, 64).to(bf)
    w = torch.randn(3, 64, 256).to(bf) / 8

    def attend(x, w, options):
        q, k, v = ((x @ w[i]).view(2, 256, 4, 64).transpose(1, 2) for i in range(3))
        return flex_attention(q, k, v, score_mod=soft_cap, kernel_options=options)
    with inductor_config.patch(fx_graph_cache=False):
        C.install()
        try:
            torch._dynamo.reset()
            got, codes = run_and_get_code(torch.compile(lambda x, w: attend(x, w, {"NVFLY": True})), x, w)
        finally:
            C.uninstall()
            torch._dynamo.reset()
    assert any("torch.ops.nvfly.flex_attention" in c for c in codes)
    torch.testing.assert_close(got, attend(x, w, None), atol=3e-2, rtol=3e-2)


def test_compiled_flex_declines_with_reason(compiled_flex):
    q, k, v = _qkv(sq=256, skv=256)
    got, calls_nvfly = compiled_flex({"NVFLY": True}, q, k, v, score_mod=soft_cap)
    assert not calls_nvfly
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=soft_cap), atol=1e-4, rtol=1e-4)
    [decision] = [d for d in decisions() if d.where == "inductor"]
    assert decision.reason == "q is on cpu, not CUDA"


def test_option_off_and_not_auto_keep_inductor(monkeypatch):
    """Which calls the lowering takes: the option first, then the auto rule (installed with auto=True)."""
    C.install(auto=False)
    try:
        assert C._wants({"NVFLY": True}, None) and not C._wants({"NVFLY": False}, None)
        assert not C._wants({}, None)
        C.install(auto=True)

        class Node:
            def __init__(self, sq):
                self.size = [2, 8, sq, 128]

            def get_size(self):
                return self.size
        assert C._wants({}, Node(C.AUTO_MIN_SQ)) and not C._wants({}, Node(C.AUTO_MIN_SQ - 1))
        assert C._wants({}, Node(1)) and C._wants({}, Node(16)) and not C._wants({}, Node(17))  # decode's
        assert not C._wants({"NVFLY": False}, Node(4096))
    finally:
        C.uninstall()
    assert not C.installed()


# ---------------------------------------------------------------------------------------------- into the kernel
def test_translated_graphs_compile_into_the_prefill_kernel(monkeypatch):
    """The mods flex hands over (dynamo graphs with captured slopes and document ids), translated, trace into nvfly's
    prefill kernel (block-mask plan): soft-cap's tanh the MUFU's, the captured tables loaded, no spills."""
    from nvfly.ops.attention.mods import Mods, captured_tensors

    def capped_alibi(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 20) * 20 + SLOPES[h] * (kv_idx - q_idx)
    score_graph, score_buffers, _, _ = _graphs_flex_hands_over(monkeypatch, capped_alibi, None)
    _, _, mask_graph, mask_buffers = _graphs_flex_hands_over(monkeypatch, None, document)
    score = F.graph_callable("score", score_graph, score_buffers)
    mask = F.graph_callable("mask", mask_graph, mask_buffers)
    mods = Mods(score, mask)
    assert [t.shape for t in captured_tensors(mods)] == [SLOPES.shape, DOCS.shape]
    plan = attention.prefill_plan(128, 128, False, kv_block=128, q_block=128)
    kernel = attention.compile_prefill(plan, mods=mods, sq=300, skv=300)
    assert kernel.sass_opcodes()["MUFU.TANH"] > 0
    assert kernel.sass_opcodes()["LDG.E"] > 0
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == 0 and not kernel.warnings


def test_code_callable_compiles_into_the_decode_kernel():
    """The compiled path's mods (rebuilt from aten FX code) trace into nvfly's decode kernel."""
    from nvfly.ops.attention.mods import Mods
    code = _aten_graph(lambda s, b, h, q, kv, t: torch.tanh(s / 20) * 20 + t[h] * kv, SLOPES).code
    mods = Mods(C.code_callable("score", code, (SLOPES,)))
    plan = attention.decode_plan(2, 4, 2, 4, 128, 128, 8192, 132, causal=False)
    kernels = attention.compile_kernels(plan, mods=mods)
    assert any(k.sass_opcodes()["MUFU.TANH"] > 0 for k in kernels)


def test_shifted_code_callable_compiles_into_the_decode_kernel():
    """The compiled path's decode_shifted mods (a causal mask rebuilt from aten FX code, q_idx shifted by a captured
    (B,) tensor) trace into nvfly's decode kernel: the shift loaded, no spills."""
    from nvfly.ops.attention.mods import Mods, captured_tensors
    code = make_fx(causal)(torch.tensor(1), torch.tensor(2), torch.tensor(3), torch.tensor(5)).code
    shift = torch.full((2,), 8184, dtype=torch.int32)
    mods = Mods(None, C.code_callable("mask", code, (), shift))
    assert [id(t) for t in captured_tensors(mods)] == [id(shift)]
    plan = attention.decode_plan(2, 4, 2, 8, 128, 128, 8192, 132, causal=False)
    kernels = attention.compile_kernels(plan, mods=mods)
    assert kernels[0].sass_opcodes()["LDG.E"] > 0
    assert all(k.resources.spill_stores == 0 and not k.warnings for k in kernels)


def test_training_through_flex_autograd(monkeypatch, references):
    """With inputs needing grad, flex's autograd op hands the route its aten forward graph and runs torch's
    backward from the route's output and LSE (log2): the gradients equal unrouted flex's. (Eager flex refuses
    backward on CPU, so this calls the op as eager flex does, with the graphs eager flex gives it.)"""
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    from torch.nn.attention.flex_attention import _apply_kernel_options

    def capped_alibi(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 20) * 20 + SLOPES[h] * (kv_idx - q_idx)
    monkeypatch.setattr(F, "decide", lambda call: seen.append(call) or "captured by the test")
    seen = []
    graph, buffers, mask_graph, mask_buffers = _graphs_flex_hands_over(monkeypatch, capped_alibi, causal)
    monkeypatch.undo()
    monkeypatch.setattr(F, "run", references_run(references))
    monkeypatch.setattr(F, "reason", lambda call, grad: None)
    q, k, v = (t.requires_grad_() for t in _qkv())
    block_mask = create_block_mask(causal, 2, None, 300, 300, device="cpu").as_tuple()
    block_mask = block_mask[:-1] + (mask_graph,)
    options = _apply_kernel_options(q, k, v, True, None)
    grad_out = torch.randn(2, 4, 300, 64)

    def step():
        out, lse, _ = hop(q, k, v, graph, block_mask, 0.125, options, buffers, mask_buffers)
        return (out, lse) + torch.autograd.grad((out * grad_out).sum() + lse.sum(), (q, k, v))
    want = step()
    assert references == []
    with nvfly.torch.routing():
        got = step()
    assert references == ["prefill"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_shifted_mods_compile_into_the_decode_kernel(monkeypatch):
    """Decode-sized calls whose mods read q_idx: the translated ALiBi with its q_idx shifted by a captured (B,)
    tensor traces into the decode kernel (the slopes and the shift loaded), without spills."""
    from nvfly.ops.attention.mods import Mods, captured_tensors
    graph, buffers, _, _ = _graphs_flex_hands_over(monkeypatch, alibi, None)
    shift = torch.full((2,), 296, dtype=torch.int32)
    mods = Mods(F.graph_callable("score", graph, buffers, shift))
    assert {id(t) for t in captured_tensors(mods)} == {id(SLOPES), id(shift)}
    plan = attention.decode_plan(2, 4, 2, 4, 64, 64, 1024, 132, causal=False)
    kernels = attention.compile_kernels(plan, mods=mods)
    assert kernels[0].sass_opcodes()["LDG.E"] > 0
    assert all(k.resources.spill_stores == 0 and not k.warnings for k in kernels)


def test_noop_masks_are_no_mask():
    from torch.nn.attention.flex_attention import noop_mask
    scalars = map(torch.tensor, (1, 2, 3, 4))
    aten_noop = make_fx(noop_mask)(*scalars)
    assert not F._masks(noop_mask) and not F._masks(aten_noop) and F.check_graph(aten_noop) is None


# ---------------------------------------------------------------------------------------------- the op's host path
def _op(q, k, v, score_code="", path="decode", needs_lse=False, buffers=()):
    return torch.ops.nvfly.flex_attention.default(q, k, v, None, None, None, None, list(buffers), [], score_code, "",
                                                  0.125, 1 << 30, 1 << 30, path, needs_lse)


@pytest.fixture
def op_host(recorded_launches, monkeypatch):
    """The compiled op's host path on CPU tensors: decode's checks and plan counted, its kernels 'launched' through
    the real binder (recorded_launches) on a 132-SM device, the op's signatures and decode's calls empty."""
    from nvfly.ops.attention import api
    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_sm_count", lambda device: 132)
    planned = []
    new_call = api._new_call
    monkeypatch.setattr(api, "_new_call", lambda *args: planned.append(args[0].dtype) or new_call(*args))
    C._SIGNATURES.clear()
    api._CALLS.clear()
    yield recorded_launches, planned
    C._SIGNATURES.clear()
    api._CALLS.clear()



def _decode_qkv(dtype=bf, hq=8, skv=1024, d=64):
    return tuple(torch.randn(1, h, s, d).to(dtype) for h, s in ((hq, 1), (2, skv), (2, skv)))


def test_op_plans_once_per_signature_and_binds_each_call(op_host):
    """A signature's first call checks and plans (decode's bound call); later calls of the same layouts reuse it,
    launching on their own tensors (nothing of the first call's is read) as they are: no torch operation but out's
    allocation. The graph does not read the LSE: the op returns out alone and the kernel writes no LSE."""
    launches, planned = op_host
    first = _decode_qkv()
    [out] = _op(*first)
    assert planned == [bf] and len(C._SIGNATURES) == 1
    assert out.shape == (1, 8, 1, 64) and out.stride() == (512, 64, 512, 1)  # (B, Hq, Sq, D) over (B, Sq, Hq, D)
    [decode] = [params for name, _, params in launches if name == "attention_decode_kernel"]
    assert out.data_ptr() in decode
    launches.clear()
    second = _decode_qkv()
    [signature] = C._SIGNATURES.values()
    ops, [out2] = dispatched(lambda: signature.run(*second, (None,) * 4, [], [], 0.125))  # the op's body
    assert ops == ["aten.empty_strided.default"]  # no transposes, no unread LSE
    assert planned == [bf] and len(C._SIGNATURES) == 1  # no new check, plan or signature
    assert out2.shape == out.shape and out2.stride() == out.stride()
    params = [p for name, _, p in launches if name == "attention_decode_kernel"][0]
    for t in (*second, out2):
        assert t.data_ptr() in params
    for t in first:
        assert t.data_ptr() not in params


def test_op_binds_mods_and_block_mask_tables(op_host):
    """Decode with a score mod and a block mask (the mods' cells set under the lock): every call binds its own q, k,
    v, out and mask tables; only a signature's first call transposes (the bound call's binding)."""
    launches, planned = op_host
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx % 5 != 2, None, None, 1, 1024, device="cpu")
    tables = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    for _ in range(2):
        launches.clear()
        q, k, v = _decode_qkv()
        [out] = torch.ops.nvfly.flex_attention.default(q, k, v, *tables, [], [], _aten_graph(soft_cap).code, "",
                                                      0.125, *mask.BLOCK_SIZE, "decode", False)
        (name, _, table_params), (decode_name, _, decode_params) = launches[:2]
        assert (name, decode_name) == ("block_mask_tables_kernel", "attention_decode_kernel")
        assert all(t.data_ptr() in table_params for t in tables)
        assert all(t.data_ptr() in decode_params for t in (q, k, v, out))
    [signature] = C._SIGNATURES.values()
    assert planned == [bf] and not signature.failed and not signature.plain
    ops, _ = dispatched(lambda: signature.run(q, k, v, tables, [], [], 0.125))
    assert "aten.transpose.int" not in ops


def test_op_signature_changes_plan_anew(op_host):
    """Another dtype, shape, mod or LSE need is another signature with its own plan; the earlier ones stay."""
    launches, planned = op_host
    _op(*_decode_qkv())
    _op(*_decode_qkv(torch.float16))
    assert planned == [bf, torch.float16]
    _op(*_decode_qkv(skv=2048))
    _op(*_decode_qkv(hq=4))
    assert len(planned) == 4 and len(C._SIGNATURES) == 4
    q, k, v = _decode_qkv()
    launches.clear()
    out, lse = _op(q, k, v, needs_lse=True)
    assert len(planned) == 5 and len(C._SIGNATURES) == 5
    [decode] = [params for name, _, params in launches if name == "attention_decode_kernel"]
    assert lse.data_ptr() in decode  # the kernel writes the LSE the graph reads
    _op(q, k, v, score_code=_aten_graph(soft_cap, None).code)
    assert len(planned) == 6 and len(C._SIGNATURES) == 6
    _op(*_decode_qkv())  # the first signature: planned already
    assert len(planned) == 6


def test_op_failure_computes_by_reference_on_each_call_tensors():
    """A signature whose first call fails (CPU: decode's CUDA check) computes every call by the float32 reference, on
    that call's tensors (nothing stale), with the LSE in log2 when read."""
    from nvfly.ops.attention import api
    C._SIGNATURES.clear()
    try:
        for _ in range(2):
            q, k, v = _decode_qkv()
            out, lse = _op(q, k, v, needs_lse=True)
            want, want_lse = attention.prefill_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          scale=0.125)
            torch.testing.assert_close(out, want.to(bf).transpose(1, 2))
            torch.testing.assert_close(lse, want_lse / math.log(2.0))
        [signature] = C._SIGNATURES.values()
        assert signature.failed and signature.launch is None
    finally:
        C._SIGNATURES.clear()


def test_lowering_asks_for_the_lse_only_when_the_graph_reads_it(compiled_flex, monkeypatch):
    """Inference reads the output alone: the op is told not to compute the LSE and returns out alone; a graph that
    reads it (return_lse; training saves it for the backward, which flex has only on CUDA) has it computed, and equal
    to flex's."""
    import re
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))
    q, k, v = (t.to(bf) for t in _qkv(sq=256, skv=256))

    def needs_lse(codes):
        calls = [line for c in codes for line in c.splitlines() if "torch.ops.nvfly.flex_attention.default(" in line]
        assert len(calls) == 1
        return re.search(r", (True|False)\)$", calls[0].strip()).group(1) == "True"
    got, codes = run_and_get_code(torch.compile(lambda q, k, v: flex_attention(
        q, k, v, score_mod=alibi, kernel_options={"NVFLY": True})), q, k, v)
    assert not needs_lse(codes)
    # the HOP's LSE and max scores, unread: the lowering's empty buffers, dropped (nothing allocated per call)
    assert not any("torch.float32" in c.split("def call(")[-1].split("\nrunner = ")[0] for c in codes)
    torch.testing.assert_close(got, flex_attention(q, k, v, score_mod=alibi), atol=2e-2, rtol=2e-2)
    torch._dynamo.reset()
    (got, lse), codes = run_and_get_code(torch.compile(lambda q, k, v: flex_attention(
        q, k, v, score_mod=alibi, return_lse=True, kernel_options={"NVFLY": True})), q, k, v)
    assert needs_lse(codes)
    want, want_lse = flex_attention(q, k, v, score_mod=alibi, return_lse=True)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------- explain
@pytest.mark.parametrize("shape,mods,eager,compiled,auto", [
    ((1, 16, 8, 8192, 8192, 256), ("softcap", "window"), "prefill", "prefill", None),  # Gemma-2-like
    ((1, 48, 8, 1, 32768, 128), (), "decode", "decode", None),  # MiniMax-like decode step
    ((1, 48, 8, 4, 32768, 128), ("causal",), "decode", "decode", None),  # q_idx shifted back to flex's row
    ((1, 8, 8, 256, 256, 64), (), "prefill", "prefill", "the auto rule leaves 16 < Sq < 512 to Inductor"),
])
def test_explain_flex_covers_eager_and_compiled(shape, mods, eager, compiled, auto):
    """explain_flex decides on meta tensors (no GPU): the kernel eager routing runs and the compiled backend emits
    (one rule: decode shifts q_idx for mods that read it), and what the auto rule does, with its reason; the report
    says each."""
    from nvfly.torch.explain import explain_flex
    report = explain_flex(*shape, mods=mods)
    assert report.declined is None
    assert (report.kernel, report.kernel) == (eager, compiled)
    assert (report.auto_declined or "").startswith(auto or ""), report.auto_declined
    assert bool(report.auto_declined) == bool(auto)
    text = str(report)
    assert f"nvfly's {eager}" in text and ("Inductor's flex kernel by default" in text) == bool(auto)
    assert (report.to_dict()["eager"]["kernel"], report.to_dict()["compiled"]["kernel"]) == (eager, compiled)


def test_explain_flex_declines_and_refuses_bad_mods(capsys):
    """A shape nvfly's kernels decline is declined both ways with the kernel's reason; unknown or doubled mods are
    errors naming the argument, on the command line too."""
    from nvfly.cli import main
    from nvfly.torch.explain import explain_flex
    report = explain_flex(1, 8, 8, 4096, 4096, 80)
    assert "head dim 80 is not supported" in report.declined
    text = str(report)
    assert f"torch's flex_attention runs it: {report.declined}" in text
    assert f"Inductor's flex kernel runs it: {report.declined}" in text
    with pytest.raises(ValueError, match="mods: at most one score_mod and one mask"):
        explain_flex(1, 8, 8, 64, 64, 64, mods=("causal", "window"))
    with pytest.raises(ValueError, match="mods: expected names of softcap, causal, window"):
        explain_flex(1, 8, 8, 64, 64, 64, mods=("alibi",))
    assert main(["explain", "--flex", "1,16,8,8192,8192,256", "--mods", "softcap,window", "--json"]) == 0
    doc = __import__("json").loads(capsys.readouterr().out)
    assert doc["mods"] == ["softcap", "window"] and doc["compiled"]["kernel"] == "prefill"
    assert main(["explain", "--flex", "1,8,8,64,64,64", "--mods", "alibi"]) == 2
    assert "--mods: expected names among softcap, causal, window" in capsys.readouterr().err
    assert main(["explain", "--flex", "1,8,8,64,64,64", "--sdpa", "1,8,8,64,64,64"]) == 2


@pytest.mark.parametrize("mods,sq,takes", [((), 4, True), (("causal",), 4, True), ((), 64, False)])
def test_explain_flex_agrees_with_the_compiled_auto_rule(compiled_flex, monkeypatch, mods, sq, takes):
    """What explain_flex says the auto rule does with a call is what the compiled lowering does with it (on CPU: the
    lowering's checks on meta examples), the kernel and any recorded reason word for word."""
    from nvfly.torch.explain import explain_flex
    monkeypatch.setattr(C, "DEVICES", ("cpu", "cuda"))
    C.install(auto=True)
    q, k, v = (t.to(bf) for t in _qkv(sq=sq, skv=256))
    kwargs = {"block_mask": create_block_mask(causal, None, None, sq, 256, device="cpu")} if mods else {}
    _, calls_nvfly = compiled_flex({}, q, k, v, **kwargs)
    assert calls_nvfly == takes
    report = explain_flex(2, 4, 4, sq, 256, 64, mods=mods)
    assert (report.auto_declined is None) == takes
    recorded = [d for d in decisions() if d.where == "inductor"]
    if recorded:
        (decision,) = recorded
        assert report.auto_declined == decision.reason
        assert decision.winner is None or decision.winner.startswith(report.kernel)
