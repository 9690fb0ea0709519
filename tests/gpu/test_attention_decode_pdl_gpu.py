"""Split-KV decode's combine alternatives (issue 26) against the float32 reference on fresh random inputs:
``pdl_combine`` (the combine kernel as the split kernel's programmatic dependent; MLA's too) and ``fixup_combine``
(the last split CTA of each query tile merges its partials; a per-tile counter in the zeroed workspace). bf16 and fp8
caches, contiguous and paged, Sq 1-16, GQA groups, the LSE, rows with no key (length 0, queries before a length-1
sequence's start: zeros and -inf), forced and chosen split counts up to 128, repeated calls on new inputs (the
counters must be back at zero: a stale one would merge early, and the NaN-poisoned partials and outputs would show),
and CUDA graphs replayed with changed lengths. About a minute, mostly compiles; a fix-up counter left non-zero
would give wrong results, not a hang (no CTA waits on another)."""
import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import api
from nvfly.ops.attention import plan as P
from nvfly.ops.common import scratch
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import current_stream

from tests.gpu.test_attention_decode_gpu import FP8, check, kv_scale, make_cache, query

pytestmark = pytest.mark.gpu
VARIANTS = ["pdl", "fixup"]

CASES = {
    # name: (batch, sq, hq, hkv, d, capacity, lengths or None, cache dtype, page, splits (0: the plan's))
    "llama-b1-long-bf16": (1, 1, 32, 8, 128, 32768, None, "bf16", 0, 0),
    "llama-b1-long-fp8-paged64": (1, 1, 32, 8, 128, 32768, None, "fp8", 64, 0),
    "sq4-lengths-0-1-bf16-paged16": (4, 4, 32, 8, 128, 3000, [3000, 0, 1, 1700], "bf16", 16, 7),
    "sq8-48-8-fp8-ragged": (3, 8, 48, 8, 128, 5000, [5000, 1, 2100], "fp8", 0, 0),
    "sq16-64-rows-fp8-paged128": (2, 16, 32, 8, 128, 4000, [4000, 3], "fp8", 128, 5),
    "sq16-g8-two-tiles-bf16": (2, 16, 16, 2, 64, 2500, [2500, 900], "bf16", 0, 3),
    "sq2-g8-d256-bf16": (2, 2, 16, 2, 256, 3000, [3000, 2999], "bf16", 0, 0),
    "sq3-g5-128-splits-fp8": (2, 3, 10, 2, 64, 9000, [9000, 8191], "fp8", 0, 128),
}


def dtype_of(name):
    return FP8 if name == "fp8" else torch.bfloat16


def scales(kind, hkv):
    return (kv_scale("head", hkv, 1), kv_scale("head", hkv, 2)) if kind == "fp8" else (None, None)


def plan_for(q, k, table, variant, splits=0):
    batch, sq, hq, d = q.shape
    hkv = k.shape[2]
    capacity = k.shape[1] * (table.shape[1] if table is not None else 1)
    return P.decode_plan(batch, sq, hkv, hq // hkv, d, k.shape[3], capacity, plan_sm_count(q.device.index),
                         table is not None, k.shape[1], splits=splits, fp8=k.dtype == FP8,
                         **api.DECODE_VARIANTS[variant])


def counters_are_zero(plan, batch, hkv):
    """The stream's workspace counters the fix-up used are zero again."""
    device = torch.cuda.current_device()
    counters = scratch.workspace(torch.device("cuda", device), current_stream(device),
                                 plan.fixup_counters(batch, hkv), 0)[1]
    return int(counters[:plan.fixup_counters(batch, hkv)].abs().sum()) == 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", CASES)
def test_matches_reference_on_repeated_calls(name, variant):
    """Three calls on fresh inputs (new queries, caches and lengths each): each matches the reference, and the
    fix-up's counters are zero after each."""
    batch, sq, hq, hkv, d, capacity, lengths, kind, page, splits = CASES[name]
    for seed in range(3):
        k, v, table = make_cache(batch, capacity, hkv, d, d, dtype_of(kind), page=page, seed=seed)
        q = query(batch, sq, hq, d, torch.bfloat16, seed=seed + 10)
        seqlens = None
        if lengths is not None:
            seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
            seqlens = torch.where(seqlens > 1, seqlens - 17 * seed, seqlens).clamp_min(0)
        k_scale, v_scale = scales(kind, hkv)
        plan = plan_for(q, k, table, variant, splits)
        assert plan.splits > 1 and (plan.pdl_combine if variant == "pdl" else plan.fixup_combine)
        with api.plan_options(**api.DECODE_VARIANTS[variant]):
            check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=splits, k_scale=k_scale,
                  v_scale=v_scale, tol=2e-2 if kind == "fp8" else 1e-2)
        torch.cuda.synchronize()
        if variant == "fixup":
            assert counters_are_zero(plan, batch, hkv)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_cuda_graph_replays(variant, kind):
    """Captured once (the call compiled before), replayed with changed lengths (0 and 1 included) into a
    NaN-poisoned output: every replay matches the reference (the fix-up's counters start each replay at zero)."""
    k, v, table = make_cache(3, 8192, 8, 128, 128, dtype_of(kind), page=64)
    q = query(3, 2, 32, 128, torch.bfloat16)
    k_scale, v_scale = scales(kind, 8)
    seqlens = torch.tensor([8192, 100, 1], dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=seqlens, block_table=table, k_scale=k_scale, v_scale=v_scale, return_lse=True,
                  splits=9)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        with torch.cuda.stream(stream):
            attention.decode(q, k, v, **kwargs)  # compiled before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, lse = attention.decode(q, k, v, **kwargs)
    for lengths in ([8192, 100, 1], [7, 8000, 0], [65, 64, 4097], [8192, 8192, 8192]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = attention.reference(q, k, v, cache_seqlens=seqlens, block_table=table, k_scale=k_scale,
                                             v_scale=v_scale)
        assert not out.isnan().any() and not lse.isnan().any(), lengths
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 2e-2, (lengths, err)
        empty = torch.isinf(want_lse)
        assert torch.equal(torch.isinf(lse), empty)
        torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)


def test_fixup_then_default_on_one_stream():
    """The fix-up's counters are the stream's shared workspace: calls of the default plan (combine kernel) and of
    the fix-up, interleaved back to back without a sync, all match."""
    k, v, table = make_cache(2, 6000, 8, 128, 128, torch.bfloat16, page=16)
    seqlens = torch.tensor([6000, 1], dtype=torch.int32, device="cuda")
    results = []
    for i in range(6):
        q = query(2, 4, 32, 128, torch.bfloat16, seed=i)
        with api.plan_options(**api.DECODE_VARIANTS["fixup" if i % 2 else "default"]):
            results.append((q, attention.decode(q, k, v, cache_seqlens=seqlens, block_table=table, splits=11,
                                                return_lse=True)))
    for q, (out, lse) in results:
        want, want_lse = attention.reference(q, k, v, cache_seqlens=seqlens, block_table=table)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 1e-2 and torch.equal(torch.isinf(lse), torch.isinf(want_lse))


@pytest.mark.parametrize("splits", [0, 7])
def test_mla_pdl_matches_reference(splits):
    """MLA's combine as a dependent launch: B1 32K (the plan's ~64 splits) and 7 forced splits over ragged
    lengths (0 included)."""
    from nvfly.ops.attention.mla_api import plan_options
    from tests.gpu.test_attention_decode_gpu import assert_matches
    from tests.gpu.test_attention_mla_gpu import make_inputs, poison_partials, reference
    lengths = [32768] if splits == 0 else [777, 0, 4096]
    q, cache, table, seqlens = make_inputs(len(lengths), 1, 128, lengths, torch.bfloat16, 64)
    for _ in range(2):
        poison_partials()
        out = torch.full((len(lengths), 1, 128, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        with plan_options(pdl_combine=True):
            got, lse = attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table, return_lse=True,
                                            splits=splits, out=out)
        assert_matches(got, lse, *reference(q, cache, table, seqlens, True), 1e-2)
