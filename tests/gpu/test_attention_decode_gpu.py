"""Decode attention against the float32 reference on fresh random inputs: ragged lengths (0 and 1 included), query
tokens 1-16, GQA groups (power of two or not, MQA), head dims, contiguous (B, S, H, D) and (B, H, S, D) caches,
paged caches with shuffled pages of 16-256 tokens, split-KV with its combine, each shipped mod, and a CUDA graph
replayed with changed lengths. Outputs are NaN-poisoned, and so is the split partials' workspace."""
import random

import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import mods as M
from nvfly.ops.attention import plan as P
from nvfly.ops.common import scratch
from nvfly.runtime.driver import plan_sm_count
from nvfly.runtime.torch_args import current_stream

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_cache(batch, capacity, hkv, dqk, dv, dtype, layout="bshd", page=0, seed=0):
    """(k_cache, v_cache, block_table or None): contiguous in ``layout`` (passed as (B, S, H, D) views), or pages of
    ``page`` tokens in a shuffled order."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if page:
        pages = -(-capacity // page)
        k = torch.randn(batch * pages, page, hkv, dqk, device="cuda", generator=gen).to(dtype)
        v = torch.randn(batch * pages, page, hkv, dv, device="cuda", generator=gen).to(dtype)
        table = torch.randperm(batch * pages, device="cuda", generator=gen).view(batch, pages).to(torch.int32)
        return k, v, table
    if layout == "bhsd":
        k = torch.randn(batch, hkv, capacity, dqk, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(batch, hkv, capacity, dv, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        return k, v, None
    k = torch.randn(batch, capacity, hkv, dqk, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, capacity, hkv, dv, device="cuda", generator=gen).to(dtype)
    return k, v, None


def poison_partials():
    """NaN in the split partials' buffer of this stream (every split must write all of its rows)."""
    device = torch.cuda.current_device()
    scratch.partials(torch.device("cuda", device), current_stream(device), 1 << 22).fill_(float("nan"))


def check(q, k, v, *, tol=1e-2, splits=0, **kwargs):
    """decode (into a NaN-poisoned out, with the LSE; ``splits`` forced when > 0) against the reference: relative
    error of out and, row by row, the LSE (-inf exactly where the reference has no key)."""
    poison_partials()
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = attention.decode(q, k, v, return_lse=True, out=out, splits=splits, **kwargs)
    want, want_lse = attention.reference(q, k, v, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any() and not lse.isnan().any()
    err = ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err < tol, err
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)
    assert torch.all(got.float().permute(0, 2, 1, 3)[empty] == 0)
    return err


def query(batch, sq, hq, d, dtype, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(batch, sq, hq, d, device="cuda", generator=gen).to(dtype)


CASES = {
    # name: (batch, sq, hq, hkv, dqk, dv, capacity, seqlens or None, dtype, layout, page)
    "llama-ragged": (2, 1, 32, 8, 128, 128, 1000, [1000, 1], "bf16", "bshd", 0),
    "lengths-0-1-sq4-fp16": (4, 4, 8, 2, 64, 64, 700, [0, 1, 65, 700], "fp16", "bshd", 0),
    "long-split": (1, 1, 32, 8, 128, 128, 20000, None, "bf16", "bshd", 0),
    "minimax-48-8-sq8-paged64": (3, 8, 48, 8, 128, 128, 2000, [2000, 777, 64], "bf16", "bshd", 64),
    "mqa-paged16": (2, 1, 16, 1, 128, 128, 3000, [3000, 17], "bf16", "bshd", 16),
    "d256-sq2-paged256": (2, 2, 16, 2, 256, 256, 1500, [1500, 300], "bf16", "bshd", 256),
    "bhsd-32-row-tiles": (2, 3, 16, 2, 128, 128, 900, [900, 500], "bf16", "bhsd", 0),
    "dqk192-dv128": (2, 1, 8, 2, 192, 128, 500, None, "bf16", "bshd", 0),
    "sq16-g16": (1, 16, 32, 2, 64, 64, 4000, None, "bf16", "bshd", 0),
}


@pytest.mark.parametrize("name", CASES)
def test_decode_matches_reference(name):
    batch, sq, hq, hkv, dqk, dv, capacity, lengths, dtype, layout, page = CASES[name]
    dtype = DTYPES[dtype]
    k, v, table = make_cache(batch, capacity, hkv, dqk, dv, dtype, layout, page)
    q = query(batch, sq, hq, dqk, dtype)
    seqlens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    check(q, k, v, cache_seqlens=seqlens, block_table=table)


def test_split_counts_agree():
    """The same call forced to 1, 3 and 37 splits, and the heuristic's choice (> 1 here), all match."""
    k, v, _ = make_cache(2, 5000, 2, 128, 128, torch.bfloat16)
    q = query(2, 2, 8, 128, torch.bfloat16)
    seqlens = torch.tensor([5000, 129], dtype=torch.int32, device="cuda")
    assert P.decode_plan(2, 2, 2, 4, 128, 128, 5000, plan_sm_count(torch.cuda.current_device())).splits > 1
    for splits in (1, 3, 37, 0):
        check(q, k, v, cache_seqlens=seqlens, splits=splits)


def test_not_causal():
    k, v, table = make_cache(2, 600, 2, 64, 64, torch.bfloat16, page=32)
    q = query(2, 4, 12, 64, torch.bfloat16)  # G = 6: 24 rows, a 32-row tile
    check(q, k, v, cache_seqlens=torch.tensor([600, 40], dtype=torch.int32, device="cuda"), block_table=table,
          causal=False)


MODS = ("softcap", "alibi", "sliding-window", "prefix-lm", "document", "softcap+window")


def mod_kwargs(name, batch=2, capacity=1200, hq=8):
    """decode's mod arguments for one of MODS (captured tensors made on the GPU when the test runs)."""
    if name == "alibi":
        return dict(score_mod=M.alibi(torch.tensor(M.alibi_slopes(hq), device="cuda")))
    if name == "prefix-lm":
        return dict(mask_mod=M.prefix_lm(torch.tensor([100, 7], dtype=torch.int32, device="cuda")), causal=False)
    if name == "document":
        documents = (torch.arange(capacity, device="cuda") // 300).repeat(batch, 1).to(torch.int32)
        return dict(mask_mod=M.document_mask(documents))
    return {"softcap": dict(score_mod=M.soft_cap(5.0)), "sliding-window": dict(mask_mod=M.sliding_window(100)),
            "softcap+window": dict(score_mod=M.soft_cap(5.0), mask_mod=M.sliding_window(3))}[name]


@pytest.mark.parametrize("mod", MODS)
def test_mods(mod):
    k, v, table = make_cache(2, 1200, 2, 128, 128, torch.bfloat16, page=64)
    q = query(2, 4, 8, 128, torch.bfloat16) * 3  # larger scores: the soft cap bites
    check(q, k, v, cache_seqlens=torch.tensor([1200, 250], dtype=torch.int32, device="cuda"), block_table=table,
          **mod_kwargs(mod))


def test_cuda_graph_replays_with_changed_lengths():
    k, v, table = make_cache(3, 4096, 2, 128, 128, torch.bfloat16, page=64)
    q = query(3, 2, 16, 128, torch.bfloat16)
    seqlens = torch.tensor([4096, 100, 1], dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention.decode(q, k, v, cache_seqlens=seqlens, block_table=table)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = attention.decode(q, k, v, cache_seqlens=seqlens, block_table=table)
    for lengths in ([4096, 100, 1], [7, 4000, 0], [65, 64, 63]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = attention.reference(q, k, v, cache_seqlens=seqlens, block_table=table)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (lengths, err)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_shapes(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 8])
    group = rng.choice([1, 3, 4, 6, 8, 16])
    sq = rng.choice([1, 2, 4, 5, 8, 16])
    d = rng.choice([64, 128, 256])
    batch = rng.choice([1, 2, 5])
    capacity = rng.choice([64, 513, 3000, 20000])
    page = rng.choice([0, 16, 64, 128, 256])
    dtype = rng.choice(list(DTYPES.values()))
    k, v, table = make_cache(batch, capacity, hkv, d, d, dtype, rng.choice(["bshd", "bhsd"]), page, seed)
    q = query(batch, sq, hkv * group, d, dtype, seed)
    lengths = [rng.choice([0, 1, capacity, rng.randrange(capacity + 1)]) for _ in range(batch)]
    check(q, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"), block_table=table)


@pytest.mark.slow
def test_one_long_sequence():
    k, v, _ = make_cache(1, 128 * 1024, 8, 128, 128, torch.bfloat16)
    q = query(1, 1, 32, 128, torch.bfloat16)
    check(q, k, v)
