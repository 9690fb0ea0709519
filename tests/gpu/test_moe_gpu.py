"""The MoE token shuffles on the GPU against their definitions: random routings (skewed, every token on one
expert), row widths with and without 16-byte vectors, int32 and int64 orders, poisoned outputs; the layer's
``permute``/``unpermute`` against torch's gather and index_add."""
import pytest
import torch

from nvfly.ops import moe
from nvfly.ops.moe import api as moe_api

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens,h,top_k,experts", [(4096, 2048, 8, 128), (64, 7168, 8, 256), (300, 100, 2, 8),
                                                    (5, 7, 1, 3), (1, 2048, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dispatch_and_combine_match_their_definitions(tokens, h, top_k, experts, dtype):
    x = torch.randn(tokens, h, device="cuda").to(dtype)
    ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
    ids[: tokens // 3] = 0  # a hot expert
    for index_dtype in (torch.int64, torch.int32):
        order = torch.argsort(ids.reshape(-1), stable=True).to(index_dtype)
        rows, slots = moe_api.dispatch(x, order, top_k)
        assert torch.equal(rows, x[order.long() // top_k])
        assert torch.equal(slots[order.long()], torch.arange(tokens * top_k, device="cuda"))
    y = torch.randn(tokens * top_k, h, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, device="cuda")
    out = moe_api.combine(y, slots, weights)
    want = (y[slots].view(tokens, top_k, h).double() * weights.double().unsqueeze(-1)).sum(1)
    assert out.dtype == dtype and out.shape == (tokens, h)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens,experts,top_k", [(4096, 128, 8), (64, 256, 8), (5, 60, 6), (300, 1024, 32), (1, 8, 2),
                                                  (1000, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_softmax_topk(tokens, experts, top_k, dtype):
    """The experts in order (ties: the lower first: logits on a coarse grid tie often) and their probabilities,
    renormalised or not, against float64 softmax and a stable descending sort."""
    logits = (torch.randint(-40, 40, (tokens, experts), device="cuda") / 8).to(dtype)
    for renormalize in (True, False):
        weights, ids = moe_api.route(logits, top_k, renormalize)
        want_i = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
        assert torch.equal(ids, want_i)
        probs = torch.softmax(logits.double(), -1).gather(1, want_i)
        if renormalize:
            probs = probs / probs.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.double(), probs, rtol=1e-5, atol=1e-7)  # (ex2.approx)


@pytest.mark.parametrize("tokens,top_k,experts", [(4096, 8, 128), (64, 8, 256), (7, 2, 1000), (1, 1, 1), (0, 2, 4),
                                                  (20000, 8, 64)])
def test_sort_by_expert_groups_every_slot(tokens, top_k, experts):
    ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
    ids[: tokens // 4] = experts - 1  # a hot expert
    for flat in (ids.reshape(-1), ids.reshape(-1).int()):
        order, offs = moe_api.sort_by_expert(flat, experts)
        assert torch.equal(offs, torch.bincount(flat.long(), minlength=experts).cumsum(0).int())
        assert torch.equal(order.sort().values, torch.arange(tokens * top_k, device="cuda", dtype=torch.int32))
        grouped = flat[order.long()]
        assert bool((grouped[1:] >= grouped[:-1]).all())  # grouped by expert


def test_permute_and_unpermute_write_every_element():
    """Poisoned allocations: the caching allocator hands back the NaN-filled blocks, every element is overwritten."""
    t, h, k, e = 333, 2048, 8, 64
    x = torch.randn(t, h, device="cuda").bfloat16()
    ids = torch.randint(0, e, (t, k), device="cuda")
    for _ in range(2):
        torch.full((t * k, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        rows, offs, slots = moe.permute(x, ids, e)
        assert not rows.isnan().any()
        assert torch.equal(rows[slots], x.repeat_interleave(k, dim=0))  # slot s holds token s // k
        assert torch.equal(offs, torch.bincount(ids.reshape(-1), minlength=e).cumsum(0).int())
        y = torch.randn(t * k, h, device="cuda").bfloat16()
        torch.full((t, h), float("nan"), device="cuda", dtype=torch.bfloat16)
        weights = torch.rand(t, k, device="cuda")
        out = moe.unpermute(y, slots, weights)
        assert not out.isnan().any()
        # slot s's expert row is y[slots[s]] (the counting sort's order within an expert is not fixed)
        want = (y[slots].view(t, k, h).float() * weights.unsqueeze(-1)).sum(1)
        torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=8e-3)


# ---------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("tokens,h,top_k,experts", [(512, 2048, 8, 128), (33, 7168, 8, 256), (40, 100, 2, 64),
                                                    (5, 7, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gradient_kernels_match_their_definitions(tokens, h, top_k, experts, dtype):
    """The unweighted combine, the scaled scatter and the slot dots against float64 torch, outputs poisoned."""
    ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
    order = torch.argsort(ids.reshape(-1), stable=True)
    _, slots = moe_api.dispatch(torch.randn(tokens, h, device="cuda").to(dtype), order, top_k)
    y = torch.randn(tokens * top_k, h, device="cuda").to(dtype)
    grad = torch.randn(tokens, h, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, device="cuda")
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]
    torch.full((tokens, h), float("nan"), device="cuda", dtype=dtype)
    summed = moe_api.combine(y, slots, None, top_k)
    torch.testing.assert_close(summed.double(), y[slots].view(tokens, top_k, h).double().sum(1), rtol=tol, atol=tol)
    torch.full((tokens * top_k, h), float("nan"), device="cuda", dtype=dtype)
    spread = moe_api.spread(grad, slots, weights)
    want = torch.empty(tokens * top_k, h, device="cuda", dtype=torch.float64)
    want[slots] = grad.double().repeat_interleave(top_k, 0) * weights.double().reshape(-1, 1)
    assert not spread.isnan().any()
    torch.testing.assert_close(spread.double(), want, rtol=tol, atol=tol)
    dots = moe_api.slot_dots(y, slots, grad)
    want = (y[slots].view(tokens, top_k, h).double() * grad.double().unsqueeze(1)).sum(-1)
    torch.testing.assert_close(dots.double(), want, rtol=1e-4, atol=1e-4 * h ** 0.5)


@pytest.mark.parametrize("pieces", ["functions", "operators"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [(256, 512, 128, 32, 4), (19, 256, 64, 64, 8)])
def test_layer_gradients_on_nvfly_shuffles_match_the_float32_layer(tokens, hidden, inter, experts, top_k, pieces):
    """The differentiable layer (nvfly's router, permute and unpermute with autograd: ``nvfly.ops.moe``'s Functions
    or ``torch.ops.nvfly.moe_*``; nvfly's grouped GEMM op with its backward) against the float32 torch layer:
    output, and the gradients of x, the router, both expert weights and the combine weights; random routing with
    experts that get no token (19 tokens x 8 over 64 experts, and the experts past the first half unused in the
    first case)."""
    import nvfly.torch  # noqa: F401 - registers torch.ops.nvfly.grouped_mm and moe_*
    ops = torch.ops.nvfly
    route, permute, unpermute = ((moe.route, moe.permute, moe.unpermute) if pieces == "functions" else
                                 (ops.moe_route, ops.moe_permute, ops.moe_unpermute))
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    router = (torch.randn(experts, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    if tokens == 256:  # the experts past the first half never routed to: logits lowered by 4 * 8 for every token
        x[:, 0] = 4.0
        router[experts // 2:, 0] = -8.0
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    grad_out = torch.randn(tokens, hidden, device="cuda").bfloat16()
    leaves = [a.detach().requires_grad_() for a in (x, router, w13, w2)]
    logits = leaves[0].float() @ leaves[1].float().mT
    weights, ids = route(logits, top_k)
    rows, offs, slots = permute(leaves[0], ids, experts)
    torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    hidden_rows = torch.ops.nvfly.grouped_mm(rows, leaves[2].mT, offs, fuse="silu_mul")
    out = unpermute(torch.ops.nvfly.grouped_mm(hidden_rows, leaves[3].mT, offs), slots, weights)
    got = torch.autograd.grad(out, leaves + [weights], grad_out)
    ref_leaves = [a.detach().float().requires_grad_() for a in (x, router, w13, w2)]
    ref_logits = ref_leaves[0] @ ref_leaves[1].mT
    ref_weights = torch.softmax(ref_logits, -1).gather(1, ids)
    ref_weights = ref_weights / ref_weights.sum(-1, keepdim=True)
    flat = ids.reshape(-1)
    ref_out = torch.zeros(tokens, hidden, device="cuda")
    for e in flat.unique().tolist():
        token, j = (ids == e).nonzero(as_tuple=True)
        h = ref_leaves[0][token] @ ref_leaves[2][e].mT
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        ref_out = ref_out.index_add(0, token, (h @ ref_leaves[3][e].mT) * ref_weights[token, j].unsqueeze(-1))
    want = torch.autograd.grad(ref_out, ref_leaves + [ref_weights], grad_out.float())
    assert not out.isnan().any()
    assert float((out.float() - ref_out).norm() / ref_out.norm()) < 2e-2
    names = ["x", "router", "w13", "w2", "combine weights"]
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and not g.isnan().any(), name
        err = float((g.float() - w).norm() / w.norm().clamp_min(1e-30))
        assert err < 3e-2, f"{name}: relative error {err:.2e}"
    if tokens == 256:  # the unused experts' weights get exactly zero gradient
        assert not got[2][experts // 2:].any() and not got[3][experts // 2:].any()


@pytest.mark.parametrize("tokens", [64, 300])
def test_the_operator_layer_without_grad_and_compiled_runs_nvflys_kernels_and_matches_the_layer(tokens):
    """The layer on ``torch.ops.nvfly.*`` under no_grad (the operators' direct path, ``register_autograd``), eager
    and under torch.compile (default: Inductor), equals ``nvfly.ops.moe.moe`` from the same logits bit for bit (the
    same kernels), its pieces ran on nvfly (no Declined signature), and new routings reuse the compiled graph."""
    import nvfly.torch  # noqa: F401
    import torch._dynamo
    from nvfly.ops.common.opcall import Declined
    experts, hidden, inter, top_k = 32, 512, 128, 4
    router = (torch.randn(experts, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()

    def layer(x, logits, w13, w2):
        weights, ids = torch.ops.nvfly.moe_route(logits, top_k)
        rows, offs, slots = torch.ops.nvfly.moe_permute(x, ids, experts)
        h = torch.ops.nvfly.grouped_mm(rows, w13.mT, offs, fuse="silu_mul")
        return torch.ops.nvfly.moe_unpermute(torch.ops.nvfly.grouped_mm(h, w2.mT, offs), slots, weights)
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(tokens, hidden, device="cuda").bfloat16()
            logits = x.float() @ router.float().mT
            want = moe.moe(x, router, w13, w2, top_k, logits=logits)
            assert torch.equal(layer(x, logits, w13, w2), want)
            assert torch.equal(compiled(x, logits, w13, w2), want)
    for calls in (moe_api._ROUTE_TAKEN, moe_api._SORT_TAKEN, moe_api._DISPATCH_TAKEN, moe_api._COMBINE_TAKEN):
        assert len(calls) and not any(type(c) is Declined for c in calls.values())
