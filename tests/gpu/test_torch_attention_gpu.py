"""Decode attention from PyTorch on a Hopper GPU: ``nvfly::attention_decode`` against the float32 reference; under
``nvfly.torch.routing()``, ``F.scaled_dot_product_attention`` on decode shapes routed to nvfly (the decision says
so) with the result of unrouted SDPA (both against float32 SDPA), declined cases left to torch with their reason,
an injected nvfly failure falling back, and a routed decode step captured in a CUDA graph replaying new inputs."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nvfly.torch
from nvfly.ops import attention
from nvfly.torch import attention_ops as A
from nvfly.torch.gemm_ops import clear_decisions, decisions

pytestmark = pytest.mark.gpu

NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@pytest.fixture(autouse=True)
def fresh_state():
    clear_decisions()
    A.forget_decisions()
    yield
    nvfly.torch.disable_routing()


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sdpa_inputs(batch, hq, hkv, sq, skv, d=128, dtype=torch.bfloat16, *, sliced=False, bshd_q=False):
    """q (B, Hq, Sq, D) and k, v (B, Hkv, Skv, D); ``sliced``: k, v are the first Skv positions of a longer cache
    (a static KV cache); ``bshd_q``: q is the (B, H, S, D) view of a (B, S, H, D) projection."""
    torch.manual_seed(0)
    q = (torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype).transpose(1, 2) if bshd_q
         else torch.randn(batch, hq, sq, d, device="cuda", dtype=dtype))
    extra = 512 if sliced else 0
    k = torch.randn(batch, hkv, skv + extra, d, device="cuda", dtype=dtype)[:, :, :skv]
    v = torch.randn(batch, hkv, skv + extra, d, device="cuda", dtype=dtype)[:, :, :skv]
    return q, k, v


def sdpa_decisions():
    return [d for d in decisions() if d.op == "sdpa"]


def routed_and_torch(q, k, v, **kwargs):
    """(routed result, unrouted result, float32 SDPA, the route's decision reason)."""
    want = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with nvfly.torch.routing():
        got = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    (decision,) = sdpa_decisions()
    return got, want, ref, decision.reason


# ---------------------------------------------------------------------------------------------- the custom op
def test_op_matches_reference():
    q = torch.randn(2, 4, 48, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([3000, 17], dtype=torch.int32, device="cuda")
    out, lse = torch.ops.nvfly.attention_decode(q, k, v, seqlens)
    want, want_lse = attention.reference(q, k, v, cache_seqlens=seqlens)
    assert rel_err(out, want) < 1e-2
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------- routed SDPA
@pytest.mark.parametrize("batch,hq,hkv,sq,skv,layout", [
    (1, 32, 8, 4, 32768, "bhsd"),
    (2, 48, 8, 4, 8192, "sliced"),
    (1, 32, 8, 1, 32768, "bshd_q"),
    (2, 48, 8, 1, 8192, "bhsd"),
    (4, 8, 8, 2, 4096, "bhsd"),  # equal heads, enable_gqa=False
])
def test_routed_sdpa_matches_torch(batch, hq, hkv, sq, skv, layout):
    q, k, v = sdpa_inputs(batch, hq, hkv, sq, skv, sliced=layout == "sliced", bshd_q=layout == "bshd_q")
    # Sq = 1 stays with cuDNN where torch picks it; without cuDNN (flash picks) nvfly runs it
    with sdpa_kernel(NO_CUDNN):
        got, want, ref, reason = routed_and_torch(q, k, v, is_causal=False, enable_gqa=hq != hkv)
    assert reason is None
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, ref) < 1e-2 and rel_err(want, ref) < 1e-2
    assert rel_err(got, want) < 1e-2


def test_routed_sdpa_fp16_scale_and_inference_mode():
    q, k, v = sdpa_inputs(2, 32, 8, 8, 8192, dtype=torch.float16)
    with torch.inference_mode():  # reaches the CUDA-key route (autograd keys skipped)
        got, want, ref, reason = routed_and_torch(q, k, v, scale=0.05, enable_gqa=True)
    assert reason is None and rel_err(got, ref) < 1e-2 and rel_err(want, ref) < 1e-2


def test_sq1_follows_torchs_backend():
    q, k, v = sdpa_inputs(1, 32, 8, 1, 32768)
    got, want, ref, reason = routed_and_torch(q, k, v, enable_gqa=True)
    if A._torch_backend(q, k, v, True) == "cudnn":
        assert "torch picks cuDNN" in reason
    else:
        assert reason is None
    assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("kwargs,fragment", [
    ({"is_causal": True, "enable_gqa": True}, "top-left aligned"),
    ({"dropout_p": 0.0, "attn_mask": "bool", "enable_gqa": True}, "attn_mask is given"),
    ({"enable_gqa": True, "short": True}, "launch-bound"),
])
def test_declined_sdpa_is_torchs(kwargs, fragment):
    kwargs = dict(kwargs)
    q, k, v = sdpa_inputs(1, 32, 8, 4, 1024 if kwargs.pop("short", False) else 32768)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.ones(4, k.shape[2], dtype=torch.bool, device="cuda")
        with nvfly.torch.routing():
            got = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, **kwargs))
        assert fragment in A.sdpa_eligibility(q, k, v, **kwargs)
        return
    got, want, _, reason = routed_and_torch(q, k, v, **kwargs)
    assert fragment in reason
    torch.testing.assert_close(got, want)


def test_training_keeps_torchs_sdpa_and_gradients():
    q, k, v = sdpa_inputs(1, 32, 8, 4, 8192)
    q.requires_grad_()
    with nvfly.torch.routing():
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out.float().sum().backward()
    assert "requires grad" in sdpa_decisions()[0].reason and q.grad is not None


def test_nvfly_failure_falls_back_and_declines(monkeypatch):
    q, k, v = sdpa_inputs(1, 32, 8, 4, 32768)

    def broken(*args, **kwargs):
        raise RuntimeError("injected launch failure")

    monkeypatch.setattr(attention, "decode", broken)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with nvfly.torch.routing():
        first = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        second = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(second, want)
    reasons = [d.reason for d in sdpa_decisions()]
    assert reasons == [None, "nvfly raised RuntimeError: injected launch failure"]
    assert A.sdpa_eligibility(q, k, v, enable_gqa=True) == reasons[1]


def test_cuda_graph_of_a_routed_decode_step_replays_new_inputs():
    q, k, v = sdpa_inputs(2, 48, 8, 4, 8192)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with nvfly.torch.routing():
        with torch.cuda.stream(stream):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # compiled and decided before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert [d.reason for d in sdpa_decisions()] == [None]
    for seed in range(3):
        torch.manual_seed(seed + 1)
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        assert not out.isnan().any() and rel_err(out, want) < 1e-2, seed
