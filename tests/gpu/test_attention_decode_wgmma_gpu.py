"""The warpgroup-MMA GQA decode kernel (``decode``'s default at 16 < Sq·G <= 64, forced by
``plan_options(wgmma=True)``; ``gqa_kernel``) against the
float32 reference on fresh random inputs: 16-bit d 128 at Sq 8 with G 6 and 8 (MiniMax 48/8, Llama-70B 64/8), Sq 4
and 16 at G 4-16 within 64 rows, ragged lengths (0, 1, 63-65 and long), contiguous caches (by strides, and a
heads-first cache passed transposed) and paged ones of 64 and 128 tokens in shuffled page order, causal and not,
split-KV forced and chosen, one 32K sequence and 16 sequences, bf16 and fp16. Outputs, LSE and the split partials'
workspace are NaN-poisoned, and so is every cache row past its sequence's length (the kernel must mask those keys
and zero those values). Each case asserts the wgmma kernel ran (not the decode kernel's fallback); the default's
cases also run on the decode kernel (``mma_sync``), which must keep matching. fp8 (e4m3) caches (``GqaPlan.fp8``)
under ``wgmma=True`` (``wgmma_wide`` past 64 rows): the 16-bit cases' shapes with per-tensor, per-head and no scales,
against the reference on the dequantised caches, NaN past every length; by default fp8 keeps the decode kernel."""
import random

import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import api, gqa_api
from nvfly.ops.attention import gqa_plan
from tests.gpu.test_attention_decode_gpu import assert_matches, kv_scale, poison_partials

pytestmark = pytest.mark.gpu
D = 128

CASES = {
    # name: (batch, sq, hq, hkv, lengths, dtype, page, causal, splits, heads_first)
    "minimax-48-8-sq8-ragged": (3, 8, 48, 8, [2000, 777, 64], torch.bfloat16, 0, True, 0, False),
    "llama70b-64-8-sq8": (2, 8, 64, 8, [1000, 1], torch.bfloat16, 0, True, 0, False),
    "sq8-g6-paged64": (3, 8, 48, 8, [2000, 63, 65], torch.bfloat16, 64, True, 0, False),
    "sq8-g8-paged128-split5": (2, 8, 64, 8, [3000, 129], torch.bfloat16, 128, True, 5, False),
    "sq4-g4-lengths-0-1": (4, 4, 16, 4, [0, 1, 65, 700], torch.bfloat16, 0, True, 0, False),
    "sq4-g8-fp16": (2, 4, 64, 8, [513, 1000], torch.float16, 0, True, 0, False),
    "sq4-g16-noncausal": (2, 4, 32, 2, [900, 3], torch.bfloat16, 0, False, 0, False),
    "sq16-g4": (2, 16, 16, 4, [1500, 16], torch.bfloat16, 0, True, 0, False),
    "sq8-g8-split3-heads-first": (2, 8, 16, 2, [4000, 2500], torch.bfloat16, 0, True, 3, True),
    "b1-32k-sq8-g8": (1, 8, 64, 8, [32768], torch.bfloat16, 0, True, 0, False),
    "b16-sq8-g6": (16, 8, 48, 8, [4096 - 37 * i for i in range(16)], torch.bfloat16, 0, True, 0, False),
}
# 65-128 rows on two consumer warpgroups (variant wgmma_wide)
WIDE_CASES = {
    "sq16-g6-96rows-ragged": (3, 16, 48, 8, [2000, 777, 15], torch.bfloat16, 0, True, 0, False),
    "sq16-g8-128rows": (2, 16, 64, 8, [1000, 1], torch.bfloat16, 0, True, 0, False),
    "sq16-g8-paged64-lengths-0-65": (3, 16, 64, 8, [0, 65, 1500], torch.bfloat16, 64, True, 0, False),
    "sq8-g16-noncausal-fp16": (2, 8, 32, 2, [900, 63], torch.float16, 0, False, 0, False),
    "sq16-g8-split5-paged128": (2, 16, 64, 8, [3000, 129], torch.bfloat16, 128, True, 5, False),
    "sq16-g6-split3-heads-first": (2, 16, 12, 2, [4000, 2500], torch.bfloat16, 0, True, 3, True),
    "b1-32k-sq16-g6": (1, 16, 48, 8, [32768], torch.bfloat16, 0, True, 0, False),
    "b16-sq16-g8": (16, 16, 64, 8, [4096 - 37 * i for i in range(16)], torch.bfloat16, 0, True, 0, False),
}
CASES.update(WIDE_CASES)


def make_caches(batch, hkv, lengths, dtype, page, heads_first, gen):
    """(k, v, block_table or None): randn caches whose rows past each length are NaN; paged in a shuffled page
    order with unused pages NaN; ``heads_first``: (B, Hkv, S, D) storage passed as its (B, S, Hkv, D) view."""
    capacity = max(lengths)
    if page:
        per = -(-capacity // page)
        count = batch * per + 2
        k = torch.randn(count, page, hkv, D, device="cuda", generator=gen).to(dtype)
        v = torch.randn(count, page, hkv, D, device="cuda", generator=gen).to(dtype)
        order = torch.randperm(count, device="cuda", generator=gen)
        table = order[:batch * per].view(batch, per).to(torch.int32)
        k[order[batch * per:]] = float("nan")
        v[order[batch * per:]] = float("nan")
        slots = torch.arange(per * page, device="cuda")
        for b, n in enumerate(lengths):
            tail = slots[n:]
            k[table[b, tail // page].long(), tail % page] = float("nan")
            v[table[b, tail // page].long(), tail % page] = float("nan")
        return k, v, table
    shape = (batch, hkv, capacity + 7, D) if heads_first else (batch, capacity + 7, hkv, D)
    k = torch.randn(*shape, device="cuda", generator=gen).to(dtype)
    v = torch.randn(*shape, device="cuda", generator=gen).to(dtype)
    if heads_first:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    for b, n in enumerate(lengths):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    return k, v, None


@pytest.mark.parametrize("name", [name for name in CASES if name not in WIDE_CASES])
def test_matches_reference(name, monkeypatch):
    check_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma"])


@pytest.mark.parametrize("name", ["sq8-g8-paged128-split5", "b1-32k-sq8-g8"])
def test_split_plans_with_the_combine_as_programmatic_dependent(name, monkeypatch):
    """The split plans' combine as the split kernel's programmatic dependent launch (``wgmma_pdl``)."""
    check_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma_pdl"])


@pytest.mark.parametrize("name", list(WIDE_CASES))
def test_two_consumer_warpgroups_match_reference(name, monkeypatch):
    """96 and 128 rows (``wgmma_wide``): two consumer warpgroups sharing the ring, ragged, paged, split."""
    plans = check_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma_wide"])
    assert plans[0].consumers == 2


@pytest.mark.parametrize("name", [name for name, case in CASES.items()
                                  if 16 < case[1] * case[2] // case[3] <= 64])
def test_default_runs_the_wgmma_kernel(name, monkeypatch):
    """No plan options: the wgmma kernel at 16 < Sq·G <= 64, its combine launched after it."""
    check_case(name, monkeypatch, {})


@pytest.mark.parametrize("name", ["minimax-48-8-sq8-ragged", "sq8-g8-paged128-split5", "sq8-g8-split3-heads-first"])
def test_the_decode_kernel_when_switched_off(name, monkeypatch):
    """``wgmma=False`` (variant ``mma_sync``): the decode kernel, as before the wgmma default."""
    check_case(name, monkeypatch, api.DECODE_VARIANTS["mma_sync"], wgmma=False)


def test_bound_decode_heads_first_runs_the_wgmma_kernel(monkeypatch):
    """SDPA's and flex's bound launches on (B, H, S, D) tensors: the wgmma kernel, matching on new values."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    runs = []
    run = gqa_api.GqaCall.run
    monkeypatch.setattr(gqa_api.GqaCall, "run", lambda self, *a, **kw: runs.append(self.plan) or run(self, *a, **kw))
    q = torch.randn(2, 32, 8, D, device="cuda", generator=gen).to(torch.bfloat16)  # Sq 8 at G 4: 32 rows
    k = torch.randn(2, 8, 3000, D, device="cuda", generator=gen).to(torch.bfloat16)
    launch = attention.bound_decode(q, k, k, causal=True, heads_first=True)
    for _ in range(3):
        q = torch.randn(2, 32, 8, D, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(2, 8, 3000, D, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(2, 8, 3000, D, device="cuda", generator=gen).to(torch.bfloat16)
        poison_partials()
        got = launch(q, k, v, None)
        want, _ = attention.reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        assert got.shape == q.shape
        err = ((got.transpose(1, 2).float() - want).norm() / want.norm()).item()
        assert not got.isnan().any() and err < 1e-2, err
    assert len(runs) == 3


def check_case(name, monkeypatch, options, wgmma=True):
    batch, sq, hq, hkv, lengths, dtype, page, causal, splits, heads_first = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, name)))
    q = torch.randn(batch, sq, hq, D, device="cuda", generator=gen).to(dtype)
    k, v, table = make_caches(batch, hkv, lengths, dtype, page, heads_first, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    runs = []
    run = gqa_api.GqaCall.run
    monkeypatch.setattr(gqa_api.GqaCall, "run", lambda self, *a, **kw: runs.append(self.plan) or run(self, *a, **kw))
    poison_partials()
    out = torch.full((batch, sq, hq, D), float("nan"), dtype=dtype, device="cuda")
    with api.plan_options(**options):
        got, lse = attention.decode(q, k, v, cache_seqlens=seqlens, block_table=table, causal=causal, splits=splits,
                                    return_lse=True, out=out)
    torch.cuda.synchronize()
    if wgmma:
        assert len(runs) == 1 and (splits == 0 or runs[0].splits == splits), runs
        assert runs[0].pdl_combine == (runs[0].splits > 1 and bool(options.get("pdl_combine")))
    else:
        assert not runs
    clean_k, clean_v = torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0)
    want, want_lse = attention.reference(q, clean_k, clean_v, cache_seqlens=seqlens, block_table=table,
                                         causal=causal)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, lse, want, want_lse, 1e-2)
    return runs


def test_repeated_calls_reuse_the_call():
    """A second call of one signature (the prepared launches, cached descriptors) on new values matches too."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    seqlens = torch.tensor([1200, 300], dtype=torch.int32, device="cuda")
    for _ in range(2):
        q = torch.randn(2, 8, 64, D, device="cuda", generator=gen).to(torch.bfloat16)
        k, v, _ = make_caches(2, 8, [1200, 300], torch.bfloat16, 0, False, gen)
        with api.plan_options(wgmma=True):
            got, lse = attention.decode(q, k, v, cache_seqlens=seqlens, return_lse=True)
        want, want_lse = attention.reference(q, torch.nan_to_num(k), torch.nan_to_num(v), cache_seqlens=seqlens)
        assert_matches(got, lse, want, want_lse, 1e-2)


# ---------------------------------------------------------------------------------------------- fp8 caches
FP8 = torch.float8_e4m3fn
# name (a 16-bit case's shape, at most 64 rows) -> (K's scale, V's scale): None, per tensor or per KV head
FP8_SCALES = {
    "minimax-48-8-sq8-ragged": ("head", "head"),
    "llama70b-64-8-sq8": ("tensor", "tensor1"),
    "sq8-g6-paged64": ("tensor", "head"),
    "sq8-g8-paged128-split5": ("head", "tensor"),
    "sq4-g4-lengths-0-1": (None, None),
    "sq4-g8-fp16": ("head", "head"),
    "sq4-g16-noncausal": ("head", None),
    "sq16-g4": ("tensor", "tensor"),
    "sq8-g8-split3-heads-first": ("head", "head"),
    "b1-32k-sq8-g8": ("head", "head"),
    "b16-sq8-g6": ("tensor", "head"),
}
# two consumer warpgroups (variant wgmma_wide)
FP8_WIDE_SCALES = {
    "sq16-g6-96rows-ragged": ("head", "head"),
    "sq16-g8-paged64-lengths-0-65": ("tensor", "head"),
    "sq8-g16-noncausal-fp16": ("head", None),
    "sq16-g8-split5-paged128": ("head", "tensor"),
    "sq16-g6-split3-heads-first": ("tensor", "tensor1"),
    "b16-sq16-g8": ("head", "head"),
}
FP8_SCALES.update(FP8_WIDE_SCALES)


def check_fp8_case(name, monkeypatch, options, wgmma=True, case=None):
    """``check_case`` with fp8 caches: the 16-bit case's caches rounded to e4m3 (NaN past each length stays NaN),
    its scales; the reference on the NaN-free caches dequantised in float32. ``case``: (the case's fields, K's and
    V's scale kinds) instead of ``name``'s."""
    (batch, sq, hq, hkv, lengths, dtype, page, causal, splits, heads_first), (k_kind, v_kind) = (
        case if case is not None else (CASES[name], FP8_SCALES[name]))
    gen = torch.Generator(device="cuda").manual_seed(sum(map(ord, name)) + 8)
    q = torch.randn(batch, sq, hq, D, device="cuda", generator=gen).to(dtype)
    k16, v16, table = make_caches(batch, hkv, lengths, torch.bfloat16, page, heads_first, gen)
    k, v = k16.to(FP8), v16.to(FP8)
    assert k.float().isnan().any() and v.float().isnan().any()  # past the lengths: must be masked and zeroed
    scales = dict(k_scale=kv_scale(k_kind, hkv, 1), v_scale=kv_scale(v_kind, hkv, 2))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    runs = []
    run = gqa_api.GqaCall.run
    monkeypatch.setattr(gqa_api.GqaCall, "run", lambda self, *a, **kw: runs.append(self.plan) or run(self, *a, **kw))
    poison_partials()
    out = torch.full((batch, sq, hq, D), float("nan"), dtype=dtype, device="cuda")
    with api.plan_options(**options):
        got, lse = attention.decode(q, k, v, cache_seqlens=seqlens, block_table=table, causal=causal, splits=splits,
                                    return_lse=True, out=out, **scales)
    torch.cuda.synchronize()
    if wgmma:
        assert len(runs) == 1 and runs[0].fp8 and (splits == 0 or runs[0].splits == splits), runs
        assert runs[0].pdl_combine == (runs[0].splits > 1 and bool(options.get("pdl_combine")))
    else:
        assert not runs
    clean_k, clean_v = torch.nan_to_num(k16, nan=0.0).to(FP8), torch.nan_to_num(v16, nan=0.0).to(FP8)
    want, want_lse = attention.reference(q, clean_k, clean_v, cache_seqlens=seqlens, block_table=table,
                                         causal=causal, **scales)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, lse, want, want_lse, 1e-2)
    return runs


@pytest.mark.parametrize("name", [name for name in FP8_SCALES if name not in FP8_WIDE_SCALES])
def test_fp8_matches_reference(name, monkeypatch):
    check_fp8_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma"])


@pytest.mark.parametrize("name", list(FP8_WIDE_SCALES))
def test_fp8_two_consumer_warpgroups_match_reference(name, monkeypatch):
    """96 and 128 rows of fp8 (``wgmma_wide``): both consumer warpgroups convert half of each tile."""
    plans = check_fp8_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma_wide"])
    assert plans[0].consumers == 2


@pytest.mark.parametrize("name", ["sq8-g8-paged128-split5", "b1-32k-sq8-g8"])
def test_fp8_split_plans_with_the_combine_as_programmatic_dependent(name, monkeypatch):
    check_fp8_case(name, monkeypatch, api.DECODE_VARIANTS["wgmma_pdl"])


@pytest.mark.parametrize("name", ["minimax-48-8-sq8-ragged", "sq8-g8-paged128-split5", "sq16-g6-96rows-ragged",
                                  "sq4-g8-fp16", "sq4-g4-lengths-0-1"])
def test_fp8_default_plan(name, monkeypatch):
    """No plan options: fp8 caches past ``gqa_plan.FP8_DEFAULT_ABOVE_ROWS`` rows run on the wgmma kernel (two
    consumers past 64), the others on the decode kernel; both against the reference."""
    batch, sq, hq, hkv = CASES[name][:4]
    runs = check_fp8_case(name, monkeypatch, {}, wgmma=sq * hq // hkv > gqa_plan.FP8_DEFAULT_ABOVE_ROWS)
    assert all(plan.consumers == (2 if sq * hq // hkv > 64 else 1) for plan in runs)


def test_fp8_with_queries_beyond_f16_range(monkeypatch):
    """The softmax scale is folded into the f16 query tile: bf16 queries of ~1e5 (past f16's 65504) with a K scale
    of 1e-5 (scores of order 1) match the reference, no inf."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = (torch.randn(2, 8, 48, D, device="cuda", generator=gen) * 1e5).to(torch.bfloat16)
    assert q.float().abs().max() > 65504
    k16, v16, _ = make_caches(2, 8, [700, 300], torch.bfloat16, 0, False, gen)
    k, v = k16.to(FP8), v16.to(FP8)
    seqlens = torch.tensor([700, 300], dtype=torch.int32, device="cuda")
    scales = dict(k_scale=torch.tensor(1e-5, device="cuda"), v_scale=kv_scale("head", 8, 2))
    with api.plan_options(wgmma=True):
        got, lse = attention.decode(q, k, v, cache_seqlens=seqlens, return_lse=True, **scales)
    want, want_lse = attention.reference(q, torch.nan_to_num(k16).to(FP8), torch.nan_to_num(v16).to(FP8),
                                         cache_seqlens=seqlens, **scales)
    assert_matches(got, lse, want, want_lse, 1e-2)


@pytest.mark.parametrize("seed", range(6))
def test_fp8_random_shapes(seed, monkeypatch):
    """Random Sq x G (up to 128 rows, two consumers past 64), ragged lengths with 0 and 1 among them, contiguous or
    paged (64 or 128 tokens), causal or not, planned or forced splits, any scale kinds, bf16 or fp16 queries."""
    rng = random.Random(seed)
    sq, group = rng.choice([(1, 8), (2, 8), (4, 4), (4, 6), (4, 8), (8, 4), (8, 6), (8, 8), (16, 4), (3, 16),
                            (16, 6), (16, 8), (8, 16)])
    hkv = rng.choice([1, 2, 8])
    batch = rng.randint(3, 6)
    lengths = [0, 1] + [rng.randint(2, 3000) for _ in range(batch - 2)]
    rng.shuffle(lengths)
    case = ((batch, sq, hkv * group, hkv, lengths, rng.choice([torch.bfloat16, torch.float16]),
             rng.choice([0, 64, 128]), rng.random() < 0.7, rng.choice([0, 0, 2, 5]), False),
            (rng.choice([None, "tensor", "head"]), rng.choice([None, "tensor1", "head"])))
    plans = check_fp8_case(f"random-{seed}", monkeypatch, api.DECODE_VARIANTS["wgmma_wide"], case=case)
    assert plans[0].consumers == (2 if sq * group > 64 else 1)
