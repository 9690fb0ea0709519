"""Eager routing's registrations on a Hopper GPU (issue 28): the routes are registered with the dispatcher only
inside ``nvfly.torch.routing()`` blocks (calls outside never pass through nvfly: no decision is made or recorded);
the GEMM routes only while the autotune database has an entry where nvfly wins; and the speculative-decoding rows of
``benchmarks/models.py`` (Sq 2-8 drafts over a 32K cache, without a mask, with a padding mask, with the drafts' causal
mask as a boolean or HF's additive one, a row per query) routed to nvfly's decode
whatever torch picks, as ``explain_sdpa`` says, with torch's result (both against float32 SDPA)."""
import pytest
import torch
import torch.nn.functional as F

import nvfly.torch
from nvfly.torch import attention_ops as A
from nvfly.torch import routing
from nvfly.torch.autotune import _nvfly_wins_somewhere
from nvfly.torch.gemm_ops import clear_decisions, decisions

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh_state():
    clear_decisions()
    A.forget_decisions()
    yield
    assert routing.installed() == []


def ours(op, key):
    """Whether the dispatcher's kernel for ``op`` on ``key`` is one routing registered (the C++ route kernel or,
    without it, the Python kernel)."""
    kernel = repr(torch.library.get_kernel(op, key))
    return "nvfly/torch/routing.py" in kernel or "nvfly/torch/native/route_kernel.cpp" in kernel


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_routes_exist_only_inside_blocks():
    q = torch.randn(1, 32, 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 32768, 128, device="cuda", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, k, k, enable_gqa=True)  # outside: torch's SDPA, the route never asked
    assert [d for d in decisions() if d.op == "sdpa"] == []
    assert not ours("aten::_fused_rms_norm", "CUDA") and not ours(A.SDPA, "AutogradCUDA")
    with nvfly.torch.routing():
        assert ours("aten::_fused_rms_norm", "CUDA") and ours(A.SDPA, "AutogradCUDA") and ours(A.SDPA, "CUDA")
        assert ("aten::mm" in routing.installed()) == _nvfly_wins_somewhere(False)
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert [d.reason for d in decisions() if d.op == "sdpa"] == [None]
    assert not ours("aten::_fused_rms_norm", "CUDA") and not ours(A.SDPA, "CUDA")


def drafts_mask(kind, batch, sq, skv):
    """"padding": (B, 1, 1, Skv) boolean, sequence b's last 64 b keys padding; "causal": the drafts' own causality,
    (Sq, Skv) boolean, draft i sees the cache and drafts 0..i; "hf": HF's eager mask for it, (B, 1, Sq, Skv) bf16
    additive causal + padding with finfo.min."""
    keys = torch.arange(skv, device="cuda")
    valid = keys[None, :] < (skv - 64 * torch.arange(batch, device="cuda"))[:, None]  # (B, Skv)
    causal = keys[None, :] <= torch.arange(sq, device="cuda")[:, None] + skv - sq  # (Sq, Skv)
    if kind == "padding":
        return valid[:, None, None, :]
    if kind == "causal":
        return causal
    keep = (valid[:, None, :] & causal[None])[:, None]
    bias = torch.zeros(keep.shape, device="cuda", dtype=torch.bfloat16)
    return bias.masked_fill(~keep, torch.finfo(torch.bfloat16).min)


@pytest.mark.parametrize("batch,sq,mask_kind", [(1, 2, None), (1, 4, None), (1, 8, None), (8, 4, "padding"),
                                                (1, 4, "causal"), (4, 8, "hf")])
def test_speculative_decoding_rows_run_nvflys_decode(batch, sq, mask_kind):
    torch.manual_seed(sq + batch)
    hq, hkv, skv, d = 32, 8, 32768, 128
    q = torch.randn(batch, hq, sq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, hkv, skv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = None if mask_kind is None else drafts_mask(mask_kind, batch, sq, skv)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with nvfly.torch.routing():
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True,
                                         attn_mask=mask if mask is None or mask.dtype == torch.bool else mask.float())
    (decision,) = [d for d in decisions() if d.op == "sdpa"]
    assert decision.reason is None and decision.candidates == ("decode",), decision.reason
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel_err(got, ref) < 1e-2 and rel_err(want, ref) < 1e-2
    if mask is None:
        report = nvfly.torch.explain_sdpa(batch, hq, hkv, sq, skv, d)
        assert report.kernel == "decode" and report.declined is None, report.declined
