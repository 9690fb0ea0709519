"""SDPA's attn_mask through nvfly without a GPU: the mods' tensor arguments (``captured=``: one compiled mod per mask
kind serves every call's mask), the routing decisions for boolean and additive masks (on fake CUDA tensors), routed
masked SDPA equal to torch's (the CPU keys standing for CUDA's, the kernels' float32 references standing for the
kernels), and the masked kernels compiled to cubin without spills."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly
import nvfly.torch
from nvfly.ops import attention
from nvfly.ops.attention import mods as M
from nvfly.ops.attention import plan as P
from nvfly.torch import attention_ops as A
from nvfly.torch import routing
from nvfly.torch.gemm_ops import clear_decisions, decisions

bf = torch.bfloat16
PADDING = (True, False, False, True)  # (B, 1, 1, Skv): HF's padding mask
FULL = (True, True, True, True)


@pytest.fixture(autouse=True)
def fresh_decisions():
    clear_decisions()
    A.forget_decisions()


# ---------------------------------------------------------------------------------------------- the mods' tensors
def test_mask_mods_are_cached_per_kind_and_their_tensor_is_an_argument():
    assert M.tensor_mask(PADDING) is M.tensor_mask(PADDING) and M.tensor_bias(FULL) is M.tensor_bias(FULL)
    assert M.tensor_mask(PADDING) is not M.tensor_mask(FULL)
    one = A._mask_mods(torch.rand(2, 1, 1, 70) > 0.5)
    two = A._mask_mods(torch.rand(2, 1, 1, 90) > 0.5)  # another mask of the same kind: the same function
    assert one["mask_mod"] is two["mask_mod"] and one["captured"][0] is not two["captured"][0]
    operand, varies = A._mask_operand(torch.ones(70, dtype=torch.bool)[None].expand(40, 70))  # a stride-0 row
    assert varies == (False, False, False, True) and operand.shape == (1, 1, 1, 70) and operand.dtype == torch.uint8
    bias = torch.randn(3, 40, 70, dtype=bf)
    operand, varies = A._mask_operand(bias)
    assert varies == (False, True, True, True) and operand.data_ptr() == bias.data_ptr()  # a view, no copy


def test_additive_mask_floor_keeps_minus_inf():
    """finfo.min sums are raised to BIAS_FLOOR (finite after the kernels' log2(e) scaling), -inf stays -inf."""
    bias = torch.tensor([[[[0.0, torch.finfo(bf).min, float("-inf"), -5.0]]]], dtype=bf)
    kv = torch.arange(4)
    got = M.tensor_bias(PADDING)(torch.ones(4), torch.tensor(0), torch.tensor(0), torch.tensor(0), kv, bias)
    assert got.tolist() == [1.0, torch.tensor(M.BIAS_FLOOR).item(), float("-inf"), -4.0]  # float32
    # the kernels' exponent is exp2(fma(s, log2e, -fl(max * log2e))): at s = max = BIAS_FLOOR what is left is
    # fl(max * log2e)'s rounding error (a float32 product is exact in float64); exp2 of it must stay near 1
    floor = torch.tensor(M.BIAS_FLOOR, dtype=torch.float32)
    log2e = torch.tensor(1.4426950408889634, dtype=torch.float32)
    left = floor.double() * log2e.double() - (floor * log2e).double()
    assert abs(left.item()) < 0.1
    finfo = torch.tensor(torch.finfo(bf).min, dtype=torch.float32)  # what the floor replaces: no longer finite
    assert abs(finfo.double() * log2e.double() - (finfo * log2e).double()) > 1e20


def test_captured_argument_errors():
    q, k = torch.randn(1, 40, 2, 64, dtype=bf), torch.randn(1, 40, 2, 64, dtype=bf)
    mask = torch.ones(1, 1, 1, 40, dtype=torch.uint8)
    with pytest.raises(TypeError, match="attention.prefill: captured: expected a tuple of tensors"):
        attention.prefill(q, k, k, mask_mod=M.tensor_mask(PADDING), captured=mask)
    with pytest.raises(ValueError, match="attention.prefill: captured: 3 tensors; the kernels take at most 2"):
        attention.prefill(q, k, k, mask_mod=M.tensor_mask(PADDING), captured=(mask,) * 3)
    slopes = torch.ones(2)

    def two_closure_tensors(score, b, h, q_idx, kv_idx, bias):
        return score + slopes[h] + mask[0, 0, 0, kv_idx] + bias[0, 0, 0, kv_idx]
    with pytest.raises(ValueError, match="the mods take 3 tensors"):
        attention.prefill(q, k, k, score_mod=two_closure_tensors, captured=(mask.float(),))


# ---------------------------------------------------------------------------------------------- decisions
@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake CUDA tensors (no GPU) and torch's backend choice pinned (``_fused_sdp_choice`` needs a GPU)."""
    picked = {"backend": "efficient"}
    monkeypatch.setattr(A, "_torch_backend", lambda *args: picked["backend"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")  # data_ptr of a FakeTensor (0): the alignment check reads it
        yield picked


# (case, q (B, Hq, Sq, D), kv (B, Hkv, Skv, D), mask shape, mask dtype, keywords of _sdpa_reason, reason or None)
PREFILL = ((2, 32, 2048, 128), (2, 8, 2048, 128))
DECODE = ((4, 32, 1, 128), (4, 8, 32768, 128))
TABLE = [
    ("prefill bool padding (B,1,1,Skv)", *PREFILL, (2, 1, 1, 2048), torch.bool, {}, None),
    ("prefill bool (Sq,Skv)", *PREFILL, (2048, 2048), torch.bool, {}, None),
    ("prefill additive (B,Hq,Sq,Skv)", *PREFILL, (2, 32, 2048, 2048), bf, {}, None),
    ("prefill additive (B,1,Sq,Skv)", *PREFILL, (2, 1, 2048, 2048), bf, {}, None),
    ("decode bool padding Sq 1", *DECODE, (4, 1, 1, 32768), torch.bool, {}, None),
    ("decode additive (B,1,Sq,Skv) Sq 1", *DECODE, (4, 1, 1, 32768), bf, {}, None),
    ("decode padding Sq 4", (4, 32, 4, 128), DECODE[1], (4, 1, 1, 32768), torch.bool, {}, None),
    ("decode per-query rows Sq 4 (drafts' causality)", (4, 32, 4, 128), DECODE[1], (4, 1, 4, 32768), torch.bool, {},
     None),
    ("decode additive rows Sq 4", (4, 32, 4, 128), DECODE[1], (4, 32, 4, 32768), bf, {}, None),
    ("decode rows without keys Sq 4", (4, 32, 4, 128), DECODE[1], (4, 1, 4, 1), torch.bool, {},
     "a row per query but none per key at Sq = 4"),
    ("is_causal with a mask", *PREFILL, (2048, 2048), torch.bool, {"causal": True}, "torch refuses the pair"),
    ("float32 mask, bf16 q", *PREFILL, (2048, 2048), torch.float32, {}, None),
    ("float16 mask, bf16 q", *PREFILL, (2048, 2048), torch.float16, {}, "attn_mask of dtype torch.float16"),
    ("int mask", *PREFILL, (2048, 2048), torch.int32, {}, "attn_mask of dtype torch.int32"),
    ("mask not broadcastable", *PREFILL, (2, 1, 1, 1024), torch.bool, {}, "does not broadcast"),
    ("mask of rank 5", *PREFILL, (1, 2, 1, 1, 2048), torch.bool, {}, "does not broadcast"),
    ("mask of rank 1", *PREFILL, (2048,), torch.bool, {}, "does not broadcast"),
    ("training with a mask", *PREFILL, (2048, 2048), torch.bool, {"grad": True}, "an input requires grad with"),
    ("still launch-bound", (1, 32, 64, 128), (1, 8, 64, 128), (64, 64), torch.bool, {}, "launch-bound"),
]


@pytest.mark.parametrize("case,qs,ks,ms,mdtype,kw,expected", TABLE, ids=[c[0] for c in TABLE])
def test_masked_sdpa_decisions(fake_cuda, case, qs, ks, ms, mdtype, kw, expected):
    q, k = torch.empty(qs, dtype=bf, device="cuda"), torch.empty(ks, dtype=bf, device="cuda")
    mask = torch.empty(ms, dtype=mdtype, device="cuda")
    reason = A._sdpa_reason(q, k, k, kw.get("causal", False), True, kw.get("grad", False), mask=mask)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason, reason


def test_masked_sdpa_keeps_cudnn_and_masks_needing_grad(fake_cuda):
    q, k = torch.empty(PREFILL[0], dtype=bf, device="cuda"), torch.empty(PREFILL[1], dtype=bf, device="cuda")
    fake_cuda["backend"] = "cudnn"
    mask = torch.empty(2048, 2048, dtype=bf, device="cuda")
    assert "torch picks cuDNN" in A._sdpa_reason(q, k, k, False, True, False, mask=mask)
    fake_cuda["backend"] = "efficient"
    assert "attn_mask requires grad" in A._sdpa_reason(q, k, k, False, True, False, mask=mask.requires_grad_())


def test_mask_is_part_of_the_decision_signature():
    q, k = torch.empty(1, 32, 1, 128, dtype=bf), torch.empty(1, 8, 32768, 128, dtype=bf)
    padding = torch.ones(1, 1, 1, 32768, dtype=torch.bool)
    assert A.sdpa_eligibility(q, k, k, padding, enable_gqa=True) == "q is on cpu, not CUDA"
    assert A.sdpa_eligibility(q, k, k, padding.float(), enable_gqa=True) == "q is on cpu, not CUDA"
    recorded = [d for d in decisions() if d.op == "sdpa"]
    assert len(recorded) == 2 and "attn_mask (1, 1, 1, 32768) torch.float32" in recorded[1].problem


# ---------------------------------------------------------------------------------------------- routed == torch
@pytest.fixture
def reference_route(monkeypatch):
    """The real ``sdpa_run`` on the CPU keys (standing for CUDA's) with the kernels' float32 references standing for
    decode and prefill; the calls' keywords are recorded."""
    calls = []

    def cpu_prefill(q, k, v, **kw):
        calls.append(("prefill", kw))
        return attention.prefill_reference(q, k, v, **kw)[0].to(q.dtype)

    def cpu_decode(q, k, v, *, validate=True, **kw):
        calls.append(("decode", kw))
        return attention.reference(q, k, v, **kw)[0].to(q.dtype)

    monkeypatch.setattr(A.attention, "prefill", cpu_prefill)
    monkeypatch.setattr(A.attention, "decode", cpu_decode)
    library = torch.library.Library("aten", "IMPL")
    for key in ("AutogradCPU", "CPU"):
        route = routing.Route(A.SDPA, lambda *args, **kwargs: None, A.sdpa_run, key)
        fallthrough = torch.library.get_kernel(A.SDPA, key)
        library.impl("scaled_dot_product_attention", routing._routed(route, fallthrough), key, with_keyset=True)
    yield calls
    library._destroy()


def _mask(shape, boolean, generator):
    if boolean:
        return torch.rand(shape, generator=generator) > 0.3
    bias = torch.randn(shape, generator=generator) * 2
    return bias if len(shape) == 2 else bias.to(bf)  # float32 or q's dtype, both SDPA's


@pytest.mark.parametrize("boolean", [True, False], ids=["bool", "additive"])
@pytest.mark.parametrize("sq,skv,shape", [
    (40, 70, (2, 8, 40, 70)), (40, 70, (2, 1, 1, 70)), (40, 70, (40, 70)), (40, 40, (1, 8, 40, 1)), (50, 30, (1, 30)),
    (3, 70, (2, 1, 1, 70)), (1, 70, (2, 8, 1, 70)), (4, 70, (1, 70)), (4, 70, (2, 8, 4, 70)), (4, 70, (4, 70)),
    (7, 70, (2, 1, 7, 70))])
def test_routed_masked_sdpa_equals_torch(reference_route, boolean, sq, skv, shape):
    generator = torch.Generator().manual_seed(sq * 1000 + skv + len(shape))
    q = torch.randn(2, 8, sq, 64, generator=generator).to(bf)
    k, v = (torch.randn(2, 2, skv, 64, generator=generator).to(bf) for _ in range(2))
    mask = _mask(shape, boolean, generator)
    with nvfly.torch.routing():
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.11, enable_gqa=True)
    kernel, keywords = reference_route[-1]
    assert kernel == ("decode" if sq <= P.MAX_SQ else "prefill")
    assert ("mask_mod" if boolean else "score_mod") in keywords and len(keywords["captured"]) == 1
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask if boolean else mask.float(),
                                          scale=0.11, enable_gqa=True)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_routed_fully_masked_rows_are_zeros_as_torch(reference_route):
    """A row with no key kept (all False, or all -inf) is zeros in nvfly's kernels and in torch's math backend."""
    q, k = torch.randn(1, 2, 40, 64).to(bf), torch.randn(1, 2, 40, 64).to(bf)
    keep = torch.ones(40, 40, dtype=torch.bool)
    keep[5] = False
    bias = torch.zeros(40, 40, dtype=bf)
    bias[7] = float("-inf")
    for mask in (keep, bias):
        with nvfly.torch.routing():
            got = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        want = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        assert reference_route[-1][0] == "prefill"
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert not got.isnan().any()


# ---------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("name", ["prefill-d128-bool-padding", "prefill-d128-additive-full-bf16",
                                  "decode-d128-sq1-g4-bool-padding", "decode-d128-sq1-g4-additive-f16",
                                  "decode-d128-sq4-g4-bool-rows"])
def test_masked_kernels_compile_without_spills(name):
    """A masked variant compiles with its mask read in the kernel (byte loads for a boolean mask, 16-bit for an
    additive one) and no spills or local memory."""
    boolean = "bool" in name
    dtype = torch.uint8 if boolean else (torch.float16 if "f16" in name else bf)
    if name.startswith("prefill"):
        shape = (2, 1, 1, 1000) if "padding" in name else (2, 4, 1000, 1000)
        varies = tuple(s != 1 for s in shape)
        mods = M.Mods(None, M.tensor_mask(varies), 1) if boolean else M.Mods(M.tensor_bias(varies), None, 1)
        kernels = [attention.compile_prefill(attention.prefill_plan(128, 128, False), mods=mods,
                                             captured=(torch.zeros(shape, dtype=dtype),))]
    else:  # "rows": the drafts' causal mask of a speculative step, a row per query read at position - (Skv - Sq)
        sq = 4 if "rows" in name else 1
        shape = (2, 1, 1, 1024) if "padding" in name else (2, 1, 4, 1024) if "rows" in name else (2, 8, 1, 1024)
        varies = tuple(s != 1 for s in shape)
        rows = "rows" in name
        mods = (M.Mods(None, M.tensor_mask(varies, rows), 1) if boolean
                else M.Mods(M.tensor_bias(varies, rows), None, 1))
        plan = P.decode_plan(2, sq, 2, 4, 128, 128, 1024, 132, splits=1)
        kernels = attention.compile_kernels(plan, mods, dtype=nvfly.f16 if "f16" in name else nvfly.bf16,
                                            captured=(torch.zeros(shape, dtype=dtype),))
    kernel = kernels[0]
    resources = kernel.resources
    assert resources.spill_stores == resources.spill_loads == resources.stack_bytes == 0
    opcodes = kernel.sass_opcodes()
    assert not any(op.startswith(("LDL", "STL")) for op in opcodes)
    assert opcodes["LDG.E.U8" if boolean else "LDG.E.U16"] > 0  # the mask read in the kernel
