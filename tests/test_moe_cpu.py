"""The MoE layer's token shuffles without a GPU: the dispatch and combine kernels compile for each row dtype, width
and top-k without spills, moving 16-byte vectors where rows allow; the plans; argument errors naming the argument;
the torch fallback of ``permute``/``unpermute`` against the definitions."""
import pytest
import torch

import nvfly
from nvfly.ops import moe
from nvfly.ops.moe import api as moe_api


def compile_shuffles(tokens, h, top_k, dtype, index_dtype=torch.int64):
    x = torch.empty(tokens, h, dtype=dtype)
    order = torch.empty(tokens * top_k, dtype=index_dtype)
    y = torch.empty(tokens * top_k, h, dtype=dtype)
    weights = torch.empty(tokens, top_k)
    with nvfly.compile_only() as kernels:
        moe_api.dispatch(x, order, top_k)
        moe_api.combine(y, torch.empty(tokens * top_k, dtype=torch.int64), weights)
    return kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("h,top_k", [(2048, 8), (7168, 8), (100, 2), (7, 1)])
def test_shuffle_kernels_compile_without_spills(dtype, h, top_k):
    kernels = compile_shuffles(16, h, top_k, dtype)
    assert len(kernels) == 2
    for k in kernels:
        assert k.cubin is not None and ".target sm_90a" in k.ptx
        assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0 and k.resources.stack_bytes == 0
    dispatch, combine = kernels
    wide = h * torch.empty((), dtype=dtype).element_size() % 16 == 0
    assert ("ld.global.v4" in dispatch.ptx) == wide
    assert combine.ptx.count("ld.global.v4" if wide else "ld.global") >= top_k  # a load of each slot's row


@pytest.mark.parametrize("slots,experts,threads", [(512, 128, 512), (32768, 256, 1024), (40, 8, 64), (16, 1000, 1024),
                                                   (0, 4, 32)])
def test_sort_kernel_compiles_with_a_thread_per_expert(slots, experts, threads):
    with nvfly.compile_only() as kernels:
        moe_api.sort_by_expert(torch.empty(slots, dtype=torch.int64), experts)
    (k,) = kernels
    assert k.cubin is not None and k.resources.spill_stores == 0 and k.resources.stack_bytes == 0
    assert k.summary()["threads"] == threads
    assert "atom.shared.add.u32" in k.ptx or "atom.shared.add" in k.ptx
    with pytest.raises(ValueError, match="nvfly.ops.moe.sort_by_expert: experts: expected an int in \\[1, 1024\\]"):
        moe_api.sort_by_expert(torch.empty(slots, dtype=torch.int64), 1025)


@pytest.mark.parametrize("experts,top_k,renormalize,dtype", [(128, 8, True, torch.float32), (256, 8, False, torch.float32),
                                                             (60, 6, True, torch.bfloat16), (1024, 32, True, torch.float32),
                                                             (8, 2, False, torch.float16)])
def test_route_kernel_compiles_without_spills(experts, top_k, renormalize, dtype):
    with nvfly.compile_only() as kernels:
        moe_api.route(torch.empty(64, experts, dtype=dtype), top_k, renormalize)
    (k,) = kernels
    assert k.cubin is not None and k.resources.spill_stores == 0 and k.resources.stack_bytes == 0
    assert k.ptx.count("redux.sync") >= 2 * top_k  # a warp max (two redux) per expert picked
    assert ("ex2.approx" in k.ptx) and k.summary()["threads"] == 32 * moe_api.ROUTE_WARPS


def test_route_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="nvfly.ops.moe.route: top_k: expected an int in \\[1, 8\\]"):
        moe_api.route(torch.empty(4, 8), 9)
    with pytest.raises(ValueError, match="logits: expected 1 to 1024 experts"):
        moe_api.route(torch.empty(4, 2000), 2)
    with pytest.raises(TypeError, match="logits: dtype torch.int64"):
        moe_api.route(torch.empty(4, 8, dtype=torch.int64), 2)


def test_route_on_torch_is_softmax_topk_renormalised():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(33, 64, generator=gen)
    for renormalize in (True, False):
        weights, ids = moe.route(logits, 4, renormalize)
        probs = torch.softmax(logits, -1)
        want_w, want_i = torch.topk(probs, 4)
        assert torch.equal(ids, want_i)
        if renormalize:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights, want_w)


def test_shuffle_plan_covers_the_row_with_whole_warps():
    assert moe_api.shuffle_plan(2048, 8) == moe_api.ShufflePlan(8, 256, 1)
    assert moe_api.shuffle_plan(7168, 8) == moe_api.ShufflePlan(8, 256, 4)  # 896 vectors: 4 blocks of 256
    assert moe_api.shuffle_plan(100, 4) == moe_api.ShufflePlan(4, 32, 1)
    for h, vec in ((7, 1), (4096, 4), (129, 1)):
        p = moe_api.shuffle_plan(h, vec)
        assert p.threads % 32 == 0 and p.threads * p.vec * p.column_blocks >= h
        assert p.threads * p.vec * (p.column_blocks - 1) < h


def test_shuffle_argument_errors_name_the_argument():
    x = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="nvfly.ops.moe.dispatch: order: expected a 1-D tensor of 8"):
        moe_api.dispatch(x, torch.zeros(6, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="order: expected an int64 or int32"):
        moe_api.dispatch(x, torch.zeros(8), 2)
    with pytest.raises(ValueError, match="top_k: expected a positive int"):
        moe_api.dispatch(x, torch.zeros(8, dtype=torch.int64), 0)
    with pytest.raises(TypeError, match="x: dtype torch.int32"):
        moe_api.dispatch(x.int(), torch.zeros(8, dtype=torch.int64), 2)
    y = torch.empty(8, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="nvfly.ops.moe.combine: weights: expected a 2-D float32"):
        moe_api.combine(y, torch.zeros(8, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weights: .* 6 routing slots, y has 8 rows"):
        moe_api.combine(y, torch.zeros(8, dtype=torch.int64), torch.zeros(3, 2))
    assert moe_api.eligibility(x, torch.zeros(8, dtype=torch.int64)) == "a tensor is not on CUDA"


def test_permute_and_unpermute_on_torch_match_their_definitions():
    """CPU tensors take the torch fallback: the copies sorted by expert (stable), each slot's row, and the
    weighted sum of a token's rows in float32."""
    gen = torch.Generator().manual_seed(3)
    t, h, e, k = 37, 24, 6, 3
    x = torch.randn(t, h, generator=gen).bfloat16()
    ids = torch.randint(0, e, (t, k), generator=gen)
    rows, offs, slots = moe.permute(x, ids, e)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(rows, x[order // k])
    assert torch.equal(offs, torch.bincount(ids.reshape(-1), minlength=e).cumsum(0).int())
    assert torch.equal(slots[order], torch.arange(t * k))
    y = torch.randn(t * k, h, generator=gen).bfloat16()
    weights = torch.rand(t, k, generator=gen)
    want = torch.zeros(t, h).index_add_(0, order // k, y.float() * weights.reshape(-1)[order].unsqueeze(-1))
    got = moe.unpermute(y, slots, weights)  # (y's row i belongs to slot order[i], whose row is slots[order[i]])
    torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)


def test_the_layer_asks_each_piece_once_per_signature(monkeypatch):
    """The pieces' eligibility answers are kept per signature (CPU: every piece declines and torch computes)."""
    import nvfly.ops.moe as moe_layer
    moe_layer._RUNS.clear()
    for calls in (moe_api._ROUTE_TAKEN, moe_api._SORT_TAKEN, moe_api._DISPATCH_TAKEN, moe_api._COMBINE_TAKEN):
        calls.clear()
    asked = []
    real = moe_api.eligibility
    monkeypatch.setattr(moe_layer.api, "eligibility", lambda *a: asked.append(len(a)) or real(*a))
    gen = torch.Generator().manual_seed(4)
    t, h, inter, e, k = 24, 32, 16, 4, 2
    args = (torch.randn(t, h, generator=gen).bfloat16(), torch.randn(e, h, generator=gen).bfloat16(),
            torch.randn(e, 2 * inter, h, generator=gen).bfloat16() / 6,
            torch.randn(e, h, inter, generator=gen).bfloat16() / 4)
    first = moe.moe(*args, k)
    assert sorted(asked) == [1, 1, 2, 3]  # the router's, the sort's, the dispatch's and the combine's, once
    assert torch.equal(moe.moe(*args, k), first) and sorted(asked) == [1, 1, 2, 3]
    assert all(reason for reason in moe_layer._RUNS.values())  # declined on CPU, with reasons
    assert all(str(declined).startswith("a tensor is not on CUDA") for declined in moe_api._DISPATCH_TAKEN.values())


def test_shuffle_eligibility_on_fake_cuda_tensors():
    """What the kernels take, decided from metadata: 2-D bf16/fp16/fp32 rows, contiguous, int indices; anything else
    (fp64 logits, strided rows) stays on torch with a reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        rows = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        order = torch.empty(8, dtype=torch.int64, device="cuda")
        strided = torch.empty_strided((8,), (2,), dtype=torch.int64, device="cuda")
        assert moe_api.eligibility(rows, order) is None
        assert moe_api.eligibility(torch.empty(4, 8, dtype=torch.float64, device="cuda")) == \
            "a float tensor is not 2-D bfloat16, float16 or float32"
        assert moe_api.eligibility(rows.t(), order) == "rows are not contiguous"
        assert moe_api.eligibility(rows, strided) == "an index tensor is not contiguous"


# ---------------------------------------------------------------------------------------------- autograd
def compile_gradients(tokens, h, top_k, dtype):
    """The backward's kernels: the unweighted combine, the scaled scatter and the slot dots."""
    grad = torch.empty(tokens, h, dtype=dtype)
    y = torch.empty(tokens * top_k, h, dtype=dtype)
    slots = torch.empty(tokens * top_k, dtype=torch.int64)
    with nvfly.compile_only() as kernels:
        moe_api.combine(y, slots, None, top_k)
        moe_api.spread(grad, slots, torch.empty(tokens, top_k))
        moe_api.slot_dots(y, slots, grad)
    return kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h,top_k", [(2048, 8), (7168, 32), (100, 2), (7, 1)])
def test_gradient_kernels_compile_without_spills(dtype, h, top_k):
    kernels = compile_gradients(16, h, top_k, dtype)
    assert [k.name for k in kernels] == ["moe_combine_kernel", "moe_dispatch_kernel", "moe_slot_dot_kernel"]
    for k in kernels:
        assert k.cubin is not None
        assert k.resources.spill_stores == 0 and k.resources.spill_loads == 0 and k.resources.stack_bytes == 0
    unweighted, spread, dots = kernels
    dispatch, weighted = compile_shuffles(16, h, top_k, dtype)
    assert unweighted.ptx.count("ld.global") == weighted.ptx.count("ld.global") - top_k  # no weight loads
    assert spread.ptx.count("ld.global") == dispatch.ptx.count("ld.global") + 1  # + the slot's weight
    assert "mul.f32" in spread.ptx or "mul.rn.f32" in spread.ptx
    assert dots.ptx.count("bar.sync") == 1  # the TOP_K block sums behind one barrier


def test_gradient_calls_check_their_arguments():
    y = torch.empty(8, 64, dtype=torch.bfloat16)
    slots = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="nvfly.ops.moe.combine: top_k: expected a positive int dividing"):
        moe_api.combine(y, slots, None, 3)
    with pytest.raises(ValueError, match="nvfly.ops.moe.spread: weights: expected \\[4, top_k\\] .* got \\(2, 4\\)"):
        moe_api.spread(torch.empty(4, 64, dtype=torch.bfloat16), slots, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="nvfly.ops.moe.slot_dots: grad: dtype torch.float32 is not y's"):
        moe_api.slot_dots(y, slots, torch.empty(4, 64))
    with pytest.raises(ValueError, match="nvfly.ops.moe.slot_dots: grad: expected \\[tokens, 64\\]"):
        moe_api.slot_dots(y, slots, torch.empty(3, 64, dtype=torch.bfloat16))


def _routing(gen, t, e, k):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[: t // 2, 0] = 0  # a hot expert; experts past the used ones get no tokens
    return ids, torch.argsort(ids.reshape(-1), stable=True)


def test_shuffle_gradients_match_torch_autograd_of_the_references():
    """The Functions' backward formulas (on the references here, the kernels' definitions) against torch's autograd
    through the references, float64, and gradcheck's finite differences."""
    from nvfly.ops.moe import autograd
    gen = torch.Generator().manual_seed(7)
    t, h, e, k = 9, 6, 12, 3
    ids, order = _routing(gen, t, e, k)
    x = torch.randn(t, h, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(t * k, h, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(t, k, dtype=torch.float64, generator=gen, requires_grad=True)
    g_rows = torch.randn(t * k, h, dtype=torch.float64, generator=gen)
    g_out = torch.randn(t, h, dtype=torch.float64, generator=gen)
    rows, slots = autograd.dispatch(x, order, k)
    (got,) = torch.autograd.grad(rows, x, g_rows)
    (want,) = torch.autograd.grad(moe_api.reference_dispatch(x, order, k)[0], x, g_rows)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, g_rows[slots].view(t, k, h).sum(1))  # each token's copies summed
    got = torch.autograd.grad(autograd.combine(y, slots, w), (y, w), g_out)
    want = torch.autograd.grad(moe_api.reference_combine(y, slots, w), (y, w), g_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda x: autograd.dispatch(x, order, k)[0], (x,))
    assert torch.autograd.gradcheck(lambda y, w: autograd.combine(y, slots, w), (y, w))


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_gradient_is_torch_autograd_of_softmax_topk(renormalize):
    from nvfly.ops.moe import autograd
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(11, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    g = torch.randn(11, 4, dtype=torch.float64, generator=gen)
    weights, ids = autograd.route(logits, 4, renormalize)
    want_w, want_i = torch.topk(torch.softmax(logits, -1), 4)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_i) and not ids.requires_grad
    torch.testing.assert_close(weights, want_w)
    torch.testing.assert_close(torch.autograd.grad(weights, logits, g)[0], torch.autograd.grad(want_w, logits, g)[0])
    assert torch.autograd.gradcheck(lambda l: autograd.route(l, 4, renormalize)[0], (logits,))


def test_the_layer_with_grad_matches_the_float32_reference_layer():
    """nvfly.ops.moe.moe differentiable (CPU: every piece on torch, through the Functions where they apply): output
    and the gradients of x, the router and both expert weights against autograd of ``moe.reference``."""
    gen = torch.Generator().manual_seed(9)
    t, h, inter, e, k = 20, 16, 8, 6, 2
    args = [torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen),
            torch.randn(e, 2 * inter, h, generator=gen) / 4, torch.randn(e, h, inter, generator=gen) / 3]
    args = [a.requires_grad_() for a in args]
    g = torch.randn(t, h, generator=gen)
    out = moe.moe(*args, k)
    want = moe.reference(*args, k)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(want, args, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- torch operators
def test_moe_operators_pass_opcheck_and_their_gradients_are_the_references():
    """torch.ops.nvfly.moe_route / moe_permute / moe_unpermute: schema, fakes and autograd registration
    (``torch.library.opcheck``), and their gradients against torch's autograd through the references (float64; the
    weights' gradient compared directly, the operator computing in float32 weights)."""
    import nvfly.torch  # noqa: F401 - registers the operators
    from torch.library import opcheck
    gen = torch.Generator().manual_seed(11)
    t, h, e, k = 9, 8, 12, 3
    logits = torch.randn(t, e, generator=gen, requires_grad=True)
    x = torch.randn(t, h, dtype=torch.float64, generator=gen, requires_grad=True)
    for renormalize in (True, False):
        opcheck(torch.ops.nvfly.moe_route.default, (logits, k, renormalize))
    weights, ids = torch.ops.nvfly.moe_route(logits, k)
    opcheck(torch.ops.nvfly.moe_permute.default, (x, ids, e))
    rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, e)
    assert torch.equal(offs, torch.bincount(ids.reshape(-1), minlength=e).cumsum(0).int())
    y = torch.randn(t * k, h, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(t, k, dtype=torch.float64, generator=gen, requires_grad=True)
    opcheck(torch.ops.nvfly.moe_unpermute.default, (y, slots, w))
    assert torch.autograd.gradcheck(lambda x: torch.ops.nvfly.moe_permute(x, ids, e)[0], (x,))
    assert torch.autograd.gradcheck(lambda y: torch.ops.nvfly.moe_unpermute(y, slots, w.detach()), (y,))
    g = torch.randn(t, h, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad(torch.ops.nvfly.moe_unpermute(y, slots, w), (y, w), g)
    want = torch.autograd.grad(moe_api.reference_combine(y, slots, w.float()), (y, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    gw = torch.randn(t, k, generator=gen)
    want_w = torch.topk(torch.softmax(logits, -1), k).values
    want_w = want_w / want_w.sum(-1, keepdim=True)
    torch.testing.assert_close(torch.autograd.grad(weights, logits, gw)[0],
                               torch.autograd.grad(want_w, logits, gw)[0])


def test_a_layer_on_the_operators_compiles_whole_and_matches_eager():
    """torch.compile (aot_eager: no C++ compiler needed) traces the whole layer, forward and backward, with no graph
    break (fullgraph), and its output and gradients equal the eager layer's."""
    import nvfly.torch  # noqa: F401
    import torch._dynamo

    def layer(x, router, w13, w2, k):
        weights, ids = torch.ops.nvfly.moe_route(x.float() @ router.float().mT, k)
        rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, router.shape[0])
        h = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs, fuse="silu_mul")
        return torch.ops.nvfly.moe_unpermute(torch.ops.nvfly.grouped_mm(h, w2.mT, offs), slots, weights)
    gen = torch.Generator().manual_seed(12)
    t, h, inter, e, k = 24, 32, 16, 6, 2
    args = [torch.randn(t, h, generator=gen), torch.randn(e, h, generator=gen) / 6,
            torch.randn(e, 2 * inter, h, generator=gen) / 6, torch.randn(e, h, inter, generator=gen) / 4]
    args = [a.bfloat16().requires_grad_() for a in args]
    g = torch.randn(t, h, generator=gen).bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    out = compiled(*args, k)
    want = layer(*args, k)
    assert torch.equal(out, want)
    for a, b in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(want, args, g)):
        assert torch.equal(a, b)
    ref = moe.reference(*(a.detach() for a in args), k)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


def _below_autograd() -> bool:
    """Whether the running code was dispatched below autograd (torch's autograd kernels redispatch there)."""
    return torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality)


def test_operators_without_a_gradient_to_record_call_their_implementation_directly(monkeypatch):
    """``nvfly.torch.library.register_autograd``: no input needing grad (or no_grad) -> the implementation itself,
    not torch's redispatch (its ~7 us a call is most of a host-bound layer's overhead); an input needing grad ->
    torch's autograd (below autograd, a grad_fn); fake tensors -> the fake (the implementation never runs)."""
    import nvfly.torch  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode
    seen = []
    real = moe.eager_route
    monkeypatch.setattr(moe, "eager_route", lambda *a: seen.append(_below_autograd()) or real(*a))
    logits = torch.randn(6, 8)
    with torch.no_grad():
        torch.ops.nvfly.moe_route(logits.requires_grad_(), 2)
    torch.ops.nvfly.moe_route(logits.detach(), 2)
    assert seen == [False, False]
    weights, _ = torch.ops.nvfly.moe_route(logits, 2)
    assert seen == [False, False, True] and weights.grad_fn is not None
    with FakeTensorMode(allow_non_fake_inputs=True):
        weights, ids = torch.ops.nvfly.moe_route(torch.empty(6, 8, device="cuda"), 2)
    assert len(seen) == 3 and weights.shape == (6, 2) and ids.dtype == torch.int64


def test_operator_errors_still_name_the_operator():
    import nvfly.torch  # noqa: F401
    with pytest.raises(ValueError, match=r"^nvfly::moe_route: top_k: expected an int in \[1, 8\]"):
        torch.ops.nvfly.moe_route(torch.randn(4, 8), 9)
    with pytest.raises(TypeError, match=r"^nvfly::moe_permute: ids: expected an int64 or int32"):
        torch.ops.nvfly.moe_permute(torch.randn(4, 8), torch.zeros(4, 2), 8)
    with pytest.raises(ValueError, match=r"^nvfly::moe_unpermute: weights: \(4, 3\) holds 12 routing slots"):
        torch.ops.nvfly.moe_unpermute(torch.randn(8, 5), torch.arange(8), torch.rand(4, 3))


@pytest.mark.parametrize("grad", [False, True])
def test_the_compiled_layer_is_one_graph_with_no_recompile_for_new_routings(grad):
    """A new routing of the same shapes (other tokens, other experts' counts) reuses the graph: the ragged
    offsets stay on the device, nothing in the layer reads them, so no guard on data-dependent sizes."""
    import nvfly.torch  # noqa: F401
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    def layer(x, router, w13, w2):
        weights, ids = torch.ops.nvfly.moe_route(x.float() @ router.float().mT, 2)
        rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, router.shape[0])
        h = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs, fuse="silu_mul")
        return torch.ops.nvfly.moe_unpermute(torch.ops.nvfly.grouped_mm(h, w2.mT, offs), slots, weights)
    gen = torch.Generator().manual_seed(13)
    t, h, inter, e = 12, 16, 8, 6
    weights = [torch.randn(e, h, generator=gen), torch.randn(e, 2 * inter, h, generator=gen) / 4,
               torch.randn(e, h, inter, generator=gen) / 3]
    weights = [w.bfloat16().requires_grad_(grad) for w in weights]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x = torch.randn(t, h, generator=gen).bfloat16()
            out = compiled(x, *weights)
            assert torch.equal(out, layer(x, *weights))
    assert counter.frame_count == 1
    if grad:
        out.float().sum().backward()
        assert all(w.grad is not None for w in weights)


def test_the_backward_pieces_ask_eligibility_once_per_layout(monkeypatch):
    from nvfly.ops.moe import autograd
    autograd._TAKEN.clear()
    asked = []
    real = moe_api.eligibility
    monkeypatch.setattr(autograd.api, "eligibility", lambda *a: asked.append(len(a)) or real(*a))
    gen = torch.Generator().manual_seed(14)
    y = torch.randn(8, 4, generator=gen, requires_grad=True)
    slots = torch.randperm(8, generator=gen)
    w = torch.rand(4, 2, generator=gen, requires_grad=True)
    for _ in range(3):
        out = autograd.combine(y, slots, w)
        torch.autograd.grad(out, (y, w), torch.ones_like(out))
    assert sorted(asked) == [3, 3, 3]  # forward (y, slots, w), y's and w's gradients: once each


def test_the_layer_pieces_decline_what_the_kernels_do_not_take_on_fake_cuda_tensors():
    """``api.try_*``: None (the layer then computes on torch) where ``eligibility`` declines, here strided rows."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        strided = torch.empty_strided((16, 32), (64, 2), dtype=torch.bfloat16, device="cuda")
        slots = torch.empty(16, dtype=torch.int64, device="cuda")
        weights = torch.empty(8, 2, dtype=torch.float32, device="cuda")
        assert moe_api.try_combine(strided, slots, weights) is None
        x = torch.empty_strided((8, 32), (64, 2), dtype=torch.bfloat16, device="cuda")
        assert moe_api.try_dispatch(x, slots, 2) is None
