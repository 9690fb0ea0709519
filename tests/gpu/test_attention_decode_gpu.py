"""Decode attention against the float32 reference on fresh random inputs: ragged lengths (0 and 1 included), query
tokens 1-16, GQA groups (power of two or not, MQA), head dims, contiguous (B, S, H, D) and (B, H, S, D) caches,
paged caches with shuffled pages of 16-256 tokens, split-KV with its combine, each shipped mod, fp8 (e4m3) caches
with per-tensor and per-head scales, flex BlockMasks (keys in empty blocks NaN: they must not be read), and CUDA
graphs replayed with changed lengths. Outputs are NaN-poisoned, and so is the split partials' workspace."""
import random

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

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


def check(q, k, v, *, tol=1e-2, splits=0, read=None, **kwargs):
    """decode (into a NaN-poisoned out, with the LSE; ``splits`` forced when > 0; reading the caches ``read``, else
    k and v) against the reference: relative error of out and, row by row, the LSE (-inf exactly where the
    reference has no key)."""
    poison_partials()
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = attention.decode(q, *(read or (k, v)), return_lse=True, out=out, splits=splits, **kwargs)
    want, want_lse = attention.reference(q, k, v, **kwargs)
    assert got.data_ptr() == out.data_ptr()
    return assert_matches(got, lse, want, want_lse, tol)


def assert_matches(got, lse, want, want_lse, tol, lse_atol=2e-3):
    """out (B, S, H, D) and lse (B, H, S) against the reference's: no NaN, the relative error of out below ``tol``,
    the LSE row by row (-inf exactly where the reference has no key, and zeros in out there; within ``lse_atol``
    elsewhere); returns the error (shared by the prefill tests)."""
    assert not got.isnan().any() and not lse.isnan().any()
    err = ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert err < tol, err
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=lse_atol, rtol=1e-3)
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


def test_cached_signature_binds_new_tensors_and_default_lengths_in_a_graph():
    """One signature (split, default lengths) called on fresh tensors: the cached call's prepared launches bind each
    call's addresses; then captured in a graph (the default lengths tensor kept from the eager calls) and replayed
    on new values copied into the captured inputs."""
    def inputs(seed):
        k, v, _ = make_cache(1, 8192, 8, 128, 128, torch.bfloat16, seed=seed)
        return query(1, 1, 48, 128, torch.bfloat16, seed=seed), k, v
    for seed in range(3):
        q, k, v = inputs(seed)
        check(q, k, v)
    q, k, v = inputs(3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention.decode(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = attention.decode(q, k, v)
    for seed in (4, 5):
        for dst, src in zip((q, k, v), inputs(seed)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = attention.reference(q, k, v)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert not out.isnan().any() and err < 1e-2, (seed, err)


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


# ---------------------------------------------------------------------------------------------- fp8 caches
FP8 = torch.float8_e4m3fn


def kv_scale(kind, hkv, seed=0):
    """None, a per-tensor (shape () or (1,)) or a per-KV-head (Hkv,) float32 scale."""
    if kind is None:
        return None
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = {"tensor": (), "tensor1": (1,), "head": (hkv,)}[kind]
    return torch.rand(shape, device="cuda", generator=gen) * 2 + 0.05


FP8_CASES = {
    # name: (batch, sq, hq, hkv, d, capacity, lengths or None, q dtype, layout, page, k scale, v scale); the
    # fragment paths of fp8 plans: 16-, 32- and 64-row tiles (row_warps 1, 2, 4), column warps (d 256), and fp8
    # rows of 64, 128, 192 and 256 bytes (fp8_swizzled's two swizzles)
    "48-8-sq4-paged64-fp16-per-tensor": (3, 4, 48, 8, 128, 2000, [2000, 777, 0], "fp16", "bshd", 64, "tensor",
                                         "tensor1"),
    "llama8b-sq1-per-head-split": (2, 1, 32, 8, 128, 6000, [6000, 1234], "bf16", "bshd", 0, "head", "head"),
    "llama8b-sq8-paged16-32rows": (2, 8, 32, 8, 128, 1500, [1500, 700], "bf16", "bshd", 16, "tensor", "head"),
    "d64-sq16-64rows-bhsd": (2, 16, 8, 2, 64, 900, [900, 65], "bf16", "bhsd", 0, "head", "tensor"),
    "d192-sq1-g8": (1, 1, 8, 1, 192, 800, None, "bf16", "bshd", 0, None, "head"),
    "d256-sq2-g8-column-warps": (1, 2, 16, 2, 256, 1000, None, "bf16", "bshd", 0, "head", "head"),
}
FP8_SLOW_CASES = {  # bf16 q over fp8 caches runs by default in the block-mask tests below
    "ragged-per-head": (2, 1, 32, 8, 128, 1000, [1000, 1], "bf16", "bshd", 0, "head", "head"),
    "long-split-k-scale-only-bhsd": (1, 1, 32, 8, 128, 20000, None, "bf16", "bhsd", 0, "head", None),
    "d64-sq2-lengths-0-1-no-scales": (4, 2, 8, 2, 64, 700, [0, 1, 65, 700], "bf16", "bshd", 0, None, None),
    "d256-sq8-paged16": (2, 8, 16, 2, 256, 900, [900, 300], "bf16", "bshd", 16, "tensor", "head"),
}


def fp8_case(batch, sq, hq, hkv, d, capacity, lengths, dtype, layout, page, k_kind, v_kind):
    k, v, table = make_cache(batch, capacity, hkv, d, d, FP8, layout, page)
    q = query(batch, sq, hq, d, DTYPES[dtype])
    seqlens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    check(q, k, v, cache_seqlens=seqlens, block_table=table, k_scale=kv_scale(k_kind, hkv, 1),
          v_scale=kv_scale(v_kind, hkv, 2))


@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_matches_reference(name):
    fp8_case(*FP8_CASES[name])


def test_fp8_with_queries_beyond_f16_range():
    """fp8 plans compute in f16 with the softmax scale folded into the query tile: bf16 queries of ~1e5 (past f16's
    65504) with a K scale of 1e-5 (scores of order 1) match the reference, no inf."""
    k, v, _ = make_cache(2, 700, 2, 128, 128, FP8)
    q = (query(2, 2, 8, 128, torch.float32) * 1e5).to(torch.bfloat16)
    assert q.float().abs().max() > 65504
    check(q, k, v, k_scale=torch.tensor(1e-5, device="cuda"), v_scale=kv_scale("head", 2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("name", FP8_SLOW_CASES)
def test_fp8_more_shapes(name):
    fp8_case(*FP8_SLOW_CASES[name])


# ---------------------------------------------------------------------------------------------- block masks
def block_mask_of(kinds, kv_block, mask_mod=None):
    """A BlockMask (one query block) from (B', H', KV blocks) kinds: 0 empty, 1 partial, 2 full."""
    def listed(value):
        hit = kinds == value
        order = torch.argsort((~hit).to(torch.int32), dim=-1, stable=True).to(torch.int32)
        return hit.sum(-1, keepdim=True).to(torch.int32), order[:, :, None]
    return BlockMask.from_kv_blocks(*listed(1), *listed(2), BLOCK_SIZE=(128, kv_block), mask_mod=mask_mod)


def poison_unread(k, v, kinds, kv_block, group, table=None):
    """Copies of the caches with NaN in every KV block that is empty for all the query heads of a KV head (the
    kernel must not read them; NaN would reach the output if it did)."""
    k, v = k.clone(), v.clone()
    nan = 0x7F if k.dtype == FP8 else float("nan")  # e4m3fn's NaN, written through a byte view
    k_view, v_view = (k.view(torch.uint8), v.view(torch.uint8)) if k.dtype == FP8 else (k, v)
    batch, hkv = k.shape[0] if table is None else table.shape[0], k.shape[2]
    kinds = kinds.expand(batch, hkv * group, -1)
    for b in range(batch):
        for h in range(hkv):
            for block in torch.nonzero((kinds[b, h * group:(h + 1) * group] == 0).all(0)).flatten().tolist():
                keys = torch.arange(block * kv_block, (block + 1) * kv_block, device="cuda")
                if table is None:
                    keys = keys[keys < k.shape[1]]
                    k_view[b, keys, h] = nan
                    v_view[b, keys, h] = nan
                else:
                    page = k.shape[1]
                    keys = keys[keys < table.shape[1] * page]
                    k_view[table[b, keys // page].long(), keys % page, h] = nan
                    v_view[table[b, keys // page].long(), keys % page, h] = nan
    return k, v


def head_parity(b, h, q_idx, kv_idx):
    return (kv_idx + h + q_idx) % 3 != 0


def test_block_mask_sliding_window_skips_blocks():
    """create_block_mask of a 700-key window for the 4 queries at the end of 4096-key sequences (32/8 GQA): the
    blocks before the window are empty (NaN in the caches), the window's edge is partial, the rest full."""
    k, v, _ = make_cache(2, 4096, 8, 128, 128, torch.bfloat16)
    q = query(2, 4, 32, 128, torch.bfloat16)
    window = M.sliding_window(700)

    def at_positions(b, h, q_idx, kv_idx):
        return window(b, h, q_idx + 4092, kv_idx)
    mask = create_block_mask(at_positions, 2, 1, 4, 4096, device="cuda")
    mask.mask_mod = window  # decode calls mask_mod with the queries' positions
    kinds = torch.zeros(2, 1, 32, dtype=torch.int32, device="cuda")
    for num, indices, kind in ((mask.kv_num_blocks, mask.kv_indices, 1),
                               (mask.full_kv_num_blocks, mask.full_kv_indices, 2)):
        for b in range(2):
            kinds[b, 0, indices[b, 0, 0, :int(num[b, 0, 0])].long()] = kind
    assert int((kinds == 0).sum()) >= 2 * 26
    check(q, k, v, block_mask=mask, read=poison_unread(k, v, kinds, 128, 4))


@pytest.mark.slow
def test_block_mask_sliced_prefill_recipe():
    """flex's decode recipe: a prefill mask sliced at the queries' block, the positional mask given as mask_mod."""
    k, v, table = make_cache(2, 4096, 8, 128, 128, FP8, page=64)
    q = query(2, 2, 48, 128, torch.bfloat16)
    window = M.sliding_window(1000)

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & window(b, h, q_idx, kv_idx)
    prefill = create_block_mask(causal_window, 2, 1, 4096, 4096, device="cuda")
    check(q, k, v, block_table=table, block_mask=prefill[:, :, 4094 // 128], mask_mod=causal_window,
          k_scale=kv_scale("head", 8, 1))


def test_block_mask_per_head_ragged_splits():
    """Random empty/partial/full blocks per (sequence, query head), ragged lengths (0 included), a mask_mod on the
    partial blocks, 7 splits (a split's stages begin mid-block; the slow sweep has the heuristic's counts)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    kinds = torch.randint(0, 3, (3, 16, 24), device="cuda", generator=gen)
    kinds[:, :, 0] = 0  # the first block empty for every head
    k, v, table = make_cache(3, 3000, 2, 64, 64, torch.bfloat16, page=64)
    q = query(3, 2, 16, 64, torch.bfloat16)
    seqlens = torch.tensor([3000, 129, 0], dtype=torch.int32, device="cuda")
    check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=7,
          block_mask=block_mask_of(kinds, 128, head_parity), read=poison_unread(k, v, kinds, 128, 8, table))


def test_block_mask_with_fp8_caches():
    """fp8 caches (per-head scales) under a broadcast (1, 1) block mask of 256-key blocks without a mask_mod."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    kinds = torch.randint(0, 3, (1, 1, 8), device="cuda", generator=gen)
    kinds[0, 0, 1] = 0
    k, v, _ = make_cache(2, 2048, 2, 128, 128, FP8)
    q = query(2, 1, 16, 128, torch.bfloat16)
    check(q, k, v, cache_seqlens=torch.tensor([2048, 1500], dtype=torch.int32, device="cuda"),
          block_mask=block_mask_of(kinds, 256), k_scale=kv_scale("head", 2, 1), v_scale=kv_scale("tensor", 2, 2),
          read=poison_unread(k, v, kinds, 256, 8))


def test_cuda_graph_replays_block_mask_and_fp8_with_changed_lengths():
    """The block mask's tables are built by device operations: a captured decode replays with new lengths."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    kinds = torch.randint(0, 3, (1, 1, 8), device="cuda", generator=gen)
    k, v, _ = make_cache(2, 2048, 2, 128, 128, FP8)
    q = query(2, 1, 16, 128, torch.bfloat16)
    seqlens = torch.tensor([2048, 1500], dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=seqlens, block_mask=block_mask_of(kinds, 256), k_scale=kv_scale("head", 2, 1),
                  v_scale=kv_scale("tensor", 2, 2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention.decode(q, k, v, **kwargs)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = attention.decode(q, k, v, **kwargs)
    for lengths in ([2048, 1500], [700, 0], [1, 2047]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = attention.reference(q, k, v, **kwargs)
        err = ((out.float() - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert not out.isnan().any() and err < 1e-2, (lengths, err)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_fp8_and_block_masks(seed):
    rng = random.Random(seed)
    hkv, group = rng.choice([1, 2, 8]), rng.choice([1, 4, 6, 16])
    sq, d, batch = rng.choice([1, 2, 4, 8]), rng.choice([64, 128, 256]), rng.choice([1, 2, 3])
    capacity, page = rng.choice([513, 3000, 9000]), rng.choice([0, 16, 64, 256])
    fp8, masked = rng.random() < 0.6, rng.random() < 0.6 or seed == 0
    dtype = rng.choice(list(DTYPES.values()))
    k, v, table = make_cache(batch, capacity, hkv, d, d, FP8 if fp8 else dtype, rng.choice(["bshd", "bhsd"]), page,
                             seed)
    q = query(batch, sq, hkv * group, d, dtype, seed)
    lengths = [rng.choice([0, 1, capacity, rng.randrange(capacity + 1)]) for _ in range(batch)]
    kwargs = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"), block_table=table,
                  splits=rng.choice([0, 0, 3, 16]))
    if fp8:
        kwargs.update(k_scale=kv_scale(rng.choice([None, "tensor", "head"]), hkv, seed),
                      v_scale=kv_scale(rng.choice([None, "tensor1", "head"]), hkv, seed + 1))
    if masked:
        kv_block = rng.choice([64, 128, 256, 192])
        blocks = -(-(capacity if table is None else table.shape[1] * k.shape[1]) // kv_block)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        kinds = torch.randint(0, 3, (rng.choice([1, batch]), rng.choice([1, hkv * group]), blocks), device="cuda",
                              generator=gen)
        kwargs["block_mask"] = block_mask_of(kinds, kv_block, rng.choice([None, head_parity]))
        kwargs["read"] = poison_unread(k, v, kinds, kv_block, group, table)
    check(q, k, v, **kwargs)


@pytest.mark.parametrize("shape,kv_block,full,lengths", [
    ((3, 16), 128, True, [3000, 129, 0]),      # per (sequence, head), ragged, an empty sequence
    ((1, 1), 256, False, [2048, 1500, 1]),     # broadcast, partial blocks only
    ((3, 1), 192, True, [2990, 64, 65]),       # per sequence, blocks of 3 stages, a capacity of odd stages
    ((1, 16), 64, True, [3000, 3000, 2999])])  # per head, a block a stage
def test_block_mask_tables_kernel_equals_the_torch_tables(shape, kv_block, full, lengths):
    """block_mask_kernel's tables (one launch) against kv_options.block_mask_tables (their definition in torch):
    kv_state and stage_count equal, the listed stages equal and ascending, every stage_list row a permutation of
    the stages; with garbage past each count in the mask's indices and outputs poisoned first."""
    from nvfly.ops.attention import kv_options
    from nvfly.ops.attention.block_mask_kernel import THREADS, block_mask_tables_kernel
    batch, hq, hkv, capacity = 3, 16, 2, 3000 if kv_block != 192 else 2990
    gen = torch.Generator(device="cuda").manual_seed(kv_block)
    blocks = -(-capacity // kv_block)
    kinds = torch.randint(0, 3 if full else 2, (*shape, blocks), device="cuda", generator=gen)
    mask = block_mask_of(kinds, kv_block)
    if not full:
        mask = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, BLOCK_SIZE=(128, kv_block))
    listed = torch.arange(blocks, device="cuda") >= mask.kv_num_blocks  # garbage past the count: out of range too
    mask.kv_indices[:, :, 0][listed] = torch.randint(-5, blocks + 5, (int(listed.sum()),), device="cuda",
                                                      dtype=torch.int32, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = kv_options.block_mask_tables(mask, batch, hq, hkv, seqlens, capacity)
    shapes = kv_options.mask_table_shapes(mask, batch, hq, hkv, capacity)
    got = [torch.full(s, -7, dtype=torch.int32, device="cuda") for s in shapes]
    tables = kv_options.mask_tables_plan(mask, batch, hq, hkv)
    assert (tables.batch_broadcast, tables.head_broadcast, tables.full) == (shape[0] == 1, shape[1] == 1, full)
    block_mask_tables_kernel[(hkv, batch), THREADS](
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, seqlens, *got,
        shapes[0][2], shapes[1][2], TABLES=tables)
    torch.cuda.synchronize()
    kv_state, stage_list, stage_count = got
    assert torch.equal(kv_state, want[0]) and torch.equal(stage_count, want[2])
    stages = shapes[1][2]
    assert torch.equal(stage_list.sort(-1).values, torch.arange(stages, device="cuda").expand(batch, hkv, -1).int())
    for b in range(batch):
        for h in range(hkv):
            count = int(stage_count[b, h])
            assert torch.equal(stage_list[b, h, :count], want[1][b, h, :count])
    assert int(stage_count.sum()) > 0


def test_block_masks_in_a_row_and_in_a_graph_changed_in_place():
    """Two block masks decoded back to back on one stream (their tables share the stream's scratch) each match the
    reference; a captured decode replays with the mask's tensors rewritten in place (its tables are computed in
    the graph), including a head whose blocks are all empty (zeros, LSE -inf)."""
    k, v, _ = make_cache(2, 2048, 2, 128, 128, torch.bfloat16)
    q = query(2, 2, 16, 128, torch.bfloat16)
    seqlens = torch.tensor([2048, 1000], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(6)
    masks = []
    for _ in range(4):  # the last one is the graph's, rewritten with the others' tensors
        kinds = torch.randint(0, 3, (2, 16, 16), device="cuda", generator=gen)
        kinds[1, 5] = 0  # every block of a head empty
        masks.append(block_mask_of(kinds, 128, head_parity))
    outs = [attention.decode(q, k, v, cache_seqlens=seqlens, block_mask=m, return_lse=True) for m in masks[:2]]
    for (out, lse), mask in zip(outs, masks):
        want, want_lse = attention.reference(q, k, v, cache_seqlens=seqlens, block_mask=mask)
        assert_matches(out, lse, want, want_lse, 1e-2)
    mask = masks[3]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the signature's call made (and its kernels loaded) before the capture
        attention.decode(q, k, v, cache_seqlens=seqlens, block_mask=mask, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, lse = attention.decode(q, k, v, cache_seqlens=seqlens, block_mask=mask, return_lse=True)
    for source, lengths in ((masks[2], [2048, 1000]), (masks[1], [700, 0]), (masks[0], [1, 2047])):
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            getattr(mask, name).copy_(getattr(source, name))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = attention.reference(q, k, v, cache_seqlens=seqlens, block_mask=source)
        assert_matches(out, lse, want, want_lse, 1e-2)
