"""MLA decode against the float32 reference on fresh random inputs: DeepSeek's latent cache (one KV head of 576
columns, V its first 512) with 16, 64 and 128 query heads, Sq 1-16, ragged lengths (0, 1, 63, 64, 65 and long ones),
contiguous caches and paged caches of 64 and 128 tokens in shuffled page order, causal and not, split-KV forced and
chosen, bf16 and fp16, through ``decode_mla`` and ``decode``. Outputs and the split partials' workspace are
NaN-poisoned, and so is every cache row past its sequence's length (the kernel must mask and zero them, never read
them into the output)."""
import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.common import scratch
from nvfly.runtime.torch_args import current_stream
from tests.gpu.test_attention_decode_gpu import assert_matches

pytestmark = pytest.mark.gpu
DQK, DV = 576, 512


def poison_partials():
    device = torch.cuda.current_device()
    scratch.partials(torch.device("cuda", device), current_stream(device), 1 << 24).fill_(float("nan"))


def make_inputs(batch, sq, hq, lengths, dtype, page=0, seed=0):
    """(q, cache, block_table or None, cache_seqlens): randn scaled like DeepSeek's (unit rows), rows past each
    length NaN; paged caches in pages of ``page`` tokens in a shuffled order, unused pages NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    capacity = max(max(lengths), 1)
    q = torch.randn(batch, sq, hq, DQK, device="cuda", generator=gen).to(dtype)
    if page:
        pages_per = -(-capacity // page)
        cache = torch.randn(batch * pages_per + 3, page, 1, DQK, device="cuda", generator=gen).to(dtype)
        order = torch.randperm(batch * pages_per + 3, device="cuda", generator=gen)
        table = order[:batch * pages_per].view(batch, pages_per).to(torch.int32)
        unused = order[batch * pages_per:]
        cache[unused] = float("nan")
        slots = torch.arange(pages_per * page, device="cuda")
        for b, n in enumerate(lengths):
            tail = slots[n:]
            cache[table[b, tail // page].long(), tail % page] = float("nan")
        return q, cache, table, seqlens
    cache = torch.randn(batch, capacity + 5, 1, DQK, device="cuda", generator=gen).to(dtype)
    for b, n in enumerate(lengths):
        cache[b, n:] = float("nan")
    return q, cache, None, seqlens


def reference(q, cache, table, seqlens, causal, scale=None):
    """decode's float32 reference over the cache's clean copy (NaN rows past the lengths set to 0: the reference
    multiplies every row by its weight, the kernel never reads them)."""
    clean = torch.nan_to_num(cache, nan=0.0)
    return attention.reference(q, clean, clean[..., :DV], cache_seqlens=seqlens, block_table=table, causal=causal,
                               scale=scale)


CASES = {
    # name: (batch, sq, hq, lengths, dtype, page, causal, splits)
    "v3_paged64": (4, 1, 128, [1000, 0, 64, 2049], torch.bfloat16, 64, True, 0),
    "v3_contiguous_split": (3, 1, 128, [777, 1, 4096], torch.bfloat16, 0, True, 5),
    "h16_paged128_mtp2": (5, 2, 16, [65, 63, 0, 1500, 2], torch.bfloat16, 128, True, 0),
    "h64_sq2_nocausal": (2, 2, 64, [300, 129], torch.bfloat16, 64, False, 3),
    "h16_sq16_causal": (2, 16, 16, [10, 700], torch.bfloat16, 64, True, 0),
    "h128_sq4_fp16_split": (2, 4, 128, [513, 3], torch.float16, 0, True, 7),
    "h16_long_auto_split": (1, 1, 16, [16384], torch.bfloat16, 64, True, 0),
    "h128_b32": (32, 1, 128, [1 + 97 * i for i in range(32)], torch.bfloat16, 64, True, 0),
    "v3_b1_61_splits": (1, 1, 128, [8000], torch.bfloat16, 64, True, 61),  # the combine's 8-split loop and tail
    "v3_b1_auto_split": (1, 1, 128, [32768], torch.bfloat16, 64, True, 0),  # the benchmark's B1 row: 64 splits
}


@pytest.mark.parametrize("name", list(CASES))
def test_mla_matches_the_reference(name):
    batch, sq, hq, lengths, dtype, page, causal, splits = CASES[name]
    q, cache, table, seqlens = make_inputs(batch, sq, hq, lengths, dtype, page)
    poison_partials()
    out = torch.full((batch, sq, hq, DV), float("nan"), dtype=dtype, device="cuda")
    got, lse = attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table, causal=causal,
                                    return_lse=True, splits=splits, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, lse, *reference(q, cache, table, seqlens, causal), 1e-2)


@pytest.mark.parametrize("options", [dict(chunked=False), dict(evict_first=True)])
@pytest.mark.parametrize("name", ["v3_paged64", "h128_sq4_fp16_split"])
def test_load_variants_match_the_reference(name, options):
    """The plan's other load options (one full barrier a stage; the evict-first hint) compute the same."""
    from nvfly.ops.attention.mla_api import plan_options
    batch, sq, hq, lengths, dtype, page, causal, splits = CASES[name]
    q, cache, table, seqlens = make_inputs(batch, sq, hq, lengths, dtype, page)
    poison_partials()
    out = torch.full((batch, sq, hq, DV), float("nan"), dtype=dtype, device="cuda")
    with plan_options(**options):
        got, lse = attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table, causal=causal,
                                        return_lse=True, splits=splits, out=out)
    assert_matches(got, lse, *reference(q, cache, table, seqlens, causal), 1e-2)


def test_decode_routes_576_columns_to_mla():
    """decode(q, k_cache, k_cache[..., :512]) is the MLA call: the same result as decode_mla, an explicit scale
    (DeepSeek's softmax scale) honoured, no LSE unless asked."""
    q, cache, table, seqlens = make_inputs(3, 1, 128, [200, 4000, 64], torch.bfloat16, page=64, seed=3)
    scale = 0.1147
    got = attention.decode(q, cache, cache[..., :DV], cache_seqlens=seqlens, block_table=table, scale=scale)
    want, _ = reference(q, cache, table, seqlens, True, scale)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    same = attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table, scale=scale)
    torch.testing.assert_close(got, same, atol=0, rtol=0)


def test_whole_contiguous_cache_without_lengths():
    """No cache_seqlens: every sequence is the whole cache (its capacity not a multiple of 64: TMA zero-fills)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(2, 1, 64, DQK, device="cuda", generator=gen).bfloat16()
    cache = torch.randn(2, 1000, 1, DQK, device="cuda", generator=gen).bfloat16()
    got, lse = attention.decode_mla(q, cache, return_lse=True)
    assert_matches(got, lse, *attention.reference(q, cache, cache[..., :DV]), 1e-2)


def test_cuda_graph_replays_with_new_lengths():
    q, cache, table, seqlens = make_inputs(4, 1, 128, [100, 2000, 640, 7], torch.bfloat16, page=64, seed=7)
    attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = attention.decode_mla(q, cache, cache_seqlens=seqlens, block_table=table)
    seqlens.copy_(torch.tensor([60, 1000, 600, 0], dtype=torch.int32))  # within the old: no NaN row
    graph.replay()
    torch.cuda.synchronize()
    want, _ = reference(q, torch.nan_to_num(cache), table, seqlens, True)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, err


def test_repeated_calls_bind_each_calls_tensors():
    """A signature's later calls (prepared launches, descriptors kept per address) read each call's q and cache
    contents and lengths: a new q at a new address, then new contents at the same addresses, then no lengths (the
    kept default-lengths tensor)."""
    q, cache, table, seqlens = make_inputs(2, 1, 128, [3000, 70], torch.bfloat16, page=64, seed=11)
    clean = torch.nan_to_num(cache)
    for step in range(3):
        if step == 1:
            q = torch.randn_like(q)  # a new tensor
        if step == 2:
            q.normal_()
            clean.normal_()
            seqlens.copy_(torch.tensor([2900, 1], dtype=torch.int32))
        poison_partials()
        got, lse = attention.decode_mla(q, clean, cache_seqlens=seqlens, block_table=table, return_lse=True,
                                        validate=False)
        assert_matches(got, lse, *reference(q, clean, table, seqlens, True), 1e-2)
    whole = clean.view(-1, 1, DQK)[:2 * 2048].view(2, 2048, 1, DQK)
    for _ in range(2):
        q.normal_()
        got, lse = attention.decode_mla(q, whole, return_lse=True)
        assert_matches(got, lse, *attention.reference(q, whole, whole[..., :DV]), 1e-2)
