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
    asked = []
    real = moe_api.eligibility
    monkeypatch.setattr(moe_layer.api, "eligibility", lambda *a: asked.append(len(a)) or real(*a))
    gen = torch.Generator().manual_seed(4)
    t, h, inter, e, k = 24, 32, 16, 4, 2
    args = (torch.randn(t, h, generator=gen).bfloat16(), torch.randn(e, h, generator=gen).bfloat16(),
            torch.randn(e, 2 * inter, h, generator=gen).bfloat16() / 6,
            torch.randn(e, h, inter, generator=gen).bfloat16() / 4)
    first = moe.moe(*args, k)
    assert sorted(asked) == [1, 2, 3]  # the router's, the dispatch's and the combine's tensors, once
    assert torch.equal(moe.moe(*args, k), first) and sorted(asked) == [1, 2, 3]
    assert all(reason for reason in moe_layer._RUNS.values())  # declined on CPU, with reasons


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
