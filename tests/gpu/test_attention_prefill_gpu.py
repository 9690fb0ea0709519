"""Prefill attention against the float32 reference on fresh random inputs: tails in Sq and Skv (1, odd, not a
multiple of the tiles), Sq != Skv both ways, GQA groups (power of two or not, MQA), every (Dqk, Dv) pair (64, 128,
192/128, 256 with its 80-key blocks), bf16 and fp16, (B, S, H, D) and (B, H, S, D) layouts, causal in both
alignments (rows that see no key: zeros and LSE -inf), the LSE row by row; sliding windows, each shipped score/mask
mod, flex BlockMasks (key blocks no head lists hold NaN: reading one would show) and packed variable-length
sequences. Outputs are NaN-poisoned: every row must be written."""
import itertools
import random

import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import mods as M
from nvfly.ops.attention.prefill_plan import HEAD_DIMS
from tests.gpu.test_attention_decode_gpu import assert_matches

pytestmark = pytest.mark.gpu
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(batch, sq, skv, hq, hkv, d, dtype, layout="bshd", seed=0, dv=None):
    """q, k, v as (B, S, H, D) tensors (views of (B, H, S, D) storage with ``layout="bhsd"``), fresh random; v's
    head dim ``dv`` (default d)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def tensor(s, h, dim):
        if layout == "bhsd":
            return torch.randn(batch, h, s, dim, device="cuda", generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(batch, s, h, dim, device="cuda", generator=gen).to(dtype)
    return tensor(sq, hq, d), tensor(skv, hkv, d), tensor(skv, hkv, dv or d)


def check(q, k, v, tol=1e-2, clean=None, **kwargs):
    """prefill (into a NaN-poisoned out, with the LSE) against the reference: relative error of out and, row by row,
    the LSE (-inf exactly where the reference's row sees no key). ``clean``: the (q, k, v) the reference reads when
    the kernel's hold NaN where it must not read."""
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = attention.prefill(q, k, v, return_lse=True, out=out, **kwargs)
    want, want_lse = attention.prefill_reference(*(clean or (q, k, v)), **kwargs)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, lse, want, want_lse, tol)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, d, causal, alignment, dtype, layout", [
    (2, 256, 256, 4, 4, 128, False, "bottom_right", "bf16", "bshd"),
    (2, 256, 256, 4, 4, 128, True, "bottom_right", "bf16", "bshd"),
    (1, 1000, 1000, 8, 2, 64, True, "bottom_right", "bf16", "bshd"),
    (3, 77, 301, 6, 2, 128, True, "bottom_right", "fp16", "bhsd"),
    (2, 301, 77, 6, 3, 64, True, "bottom_right", "bf16", "bshd"),      # early rows see no key
    (2, 301, 77, 6, 3, 64, True, "top_left", "bf16", "bshd"),
    (1, 77, 301, 4, 1, 128, True, "top_left", "bf16", "bhsd"),          # MQA
    (2, 1, 129, 4, 2, 128, False, "bottom_right", "bf16", "bshd"),
    (1, 129, 1, 4, 2, 64, False, "bottom_right", "fp16", "bshd"),
    (1, 513, 700, 12, 4, 64, False, "bottom_right", "fp16", "bhsd"),
    (2, 333, 333, 4, 2, 256, True, "bottom_right", "bf16", "bshd"),     # 80-key blocks
    (1, 250, 411, 4, 4, 256, False, "bottom_right", "fp16", "bhsd"),
    (1, 300, 300, 8, 8, (192, 128), True, "bottom_right", "bf16", "bshd"),  # DeepSeek-like Dqk 192 / Dv 128
    (2, 129, 260, 8, 2, (192, 128), False, "bottom_right", "bf16", "bhsd"),
    (2, 333, 333, 8, 2, 96, True, "bottom_right", "bf16", "bshd"),      # 64-byte swizzle rows
    (1, 250, 700, 6, 3, 96, False, "top_left", "fp16", "bhsd"),
    (2, 300, 300, 4, 2, (64, 128), True, "bottom_right", "bf16", "bshd"),
    (1, 129, 400, 4, 4, (128, 64), False, "bottom_right", "fp16", "bshd"),
    (1, 333, 333, 32, 8, 128, True, "bottom_right", "bf16", "bshd"),     # the groups: 32/8, 48/8, 64/8
    (1, 257, 513, 48, 8, 128, False, "top_left", "bf16", "bhsd"),
    (1, 200, 200, 64, 8, 64, True, "top_left", "fp16", "bshd"),
])
def test_shapes_against_the_reference(batch, sq, skv, hq, hkv, d, causal, alignment, dtype, layout):
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v = make_inputs(batch, sq, skv, hq, hkv, dqk, DTYPES[dtype], layout, seed=sq * 1000 + skv, dv=dv)
    check(q, k, v, causal=causal, causal_alignment=alignment)


def test_scale_and_no_lse():
    q, k, v = make_inputs(1, 200, 200, 4, 2, 128, torch.bfloat16, seed=7)
    check(q, k, v, causal=True, scale=0.3)
    got = attention.prefill(q, k, v, causal=True)
    want, _ = attention.prefill_reference(q, k, v, causal=True)
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_no_keys_and_eligibility():
    q, k, v = make_inputs(2, 5, 1, 4, 2, 64, torch.bfloat16)
    out, lse = attention.prefill(q, k[:, :0], v[:, :0], return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all()
    assert attention.prefill_eligibility(q, k, v) is None
    odd = torch.zeros(1, 8, 2, 68, dtype=torch.bfloat16, device="cuda")[..., :64]  # rows 136 bytes apart
    assert "16 bytes" in attention.prefill_eligibility(odd, odd, odd)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(24))
def test_random_sweep(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3, 8])
    dqk, dv = rng.choice(HEAD_DIMS)
    causal = rng.random() < 0.5
    sq, skv = rng.randint(1, 3000), rng.randint(1, 3000)
    q, k, v = make_inputs(rng.randint(1, 3), sq, skv, hkv * rng.choice([1, 2, 3, 4, 8]), hkv, dqk,
                          DTYPES[rng.choice(list(DTYPES))], rng.choice(["bshd", "bhsd"]), seed=seed, dv=dv)
    check(q, k, v, causal=causal, causal_alignment=rng.choice(["bottom_right", "top_left"]))


# ---------------------------------------------------------------------------------------------- windows and mods
@pytest.mark.parametrize("sq, skv, d, causal, window, alignment", [
    (1000, 1000, 128, True, (256, None), "bottom_right"),   # causal sliding window (Mistral-like)
    (700, 900, 64, False, (100, 50), "top_left"),            # two-sided
    (513, 300, 64, False, (None, 20), "bottom_right"),       # right bound only; early rows see no key
    (300, 300, 128, True, (0, 0), "bottom_right"),           # the diagonal only
    (600, 333, 256, True, (150, 0), "bottom_right"),         # 80-key blocks
    pytest.param(257, 400, (192, 128), False, (130, 130), "bottom_right", marks=pytest.mark.slow),
])
def test_sliding_windows(sq, skv, d, causal, window, alignment):
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v = make_inputs(2, sq, skv, 8, 2, dqk, torch.bfloat16, seed=sq + skv, dv=dv)
    check(q, k, v, causal=causal, window=window, causal_alignment=alignment)


def _mod(name, hq, batch, skv):
    gen = torch.Generator(device="cuda").manual_seed(5)
    if name == "soft_cap":
        return dict(score_mod=M.soft_cap(5.0))
    if name == "alibi":
        return dict(score_mod=M.alibi(torch.tensor(M.alibi_slopes(hq), device="cuda")))
    if name == "relative_position_bias":
        return dict(score_mod=M.relative_position_bias(torch.randn(hq, 255, device="cuda", generator=gen)))
    if name == "sliding_window":
        return dict(mask_mod=M.sliding_window(200))
    if name == "prefix_lm":
        return dict(mask_mod=M.prefix_lm(torch.tensor([37, 300][:batch], device="cuda", dtype=torch.int32)))
    if name == "document_mask":
        ids = torch.randint(0, 4, (batch, skv), device="cuda", generator=gen).sort(dim=1).values.to(torch.int32)
        return dict(mask_mod=M.document_mask(ids))
    if name == "soft_cap+document_mask":
        return dict(_mod("soft_cap", hq, batch, skv), **_mod("document_mask", hq, batch, skv))
    raise ValueError(name)


@pytest.mark.parametrize("mod, sq, d, causal, dtype", [
    ("soft_cap", 700, 128, True, "bf16"),
    ("alibi", 500, 64, True, "fp16"),
    ("relative_position_bias", 333, 128, False, "bf16"),
    ("sliding_window", 600, 256, True, "bf16"),
    pytest.param("prefix_lm", 400, 64, False, "bf16", marks=pytest.mark.slow),
    ("document_mask", 640, (192, 128), False, "bf16"),
    ("soft_cap+document_mask", 300, 128, True, "fp16"),
])
def test_mods(mod, sq, d, causal, dtype):
    """Each shipped mod (captured tensors: ALiBi's slopes, the bias table, prefix lengths, document ids) against
    the reference applying the same functions with torch broadcasting; q_idx and kv_idx are row and key indices."""
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v = make_inputs(2, sq, sq, 8, 2, dqk, DTYPES[dtype], seed=len(mod), dv=dv)
    check(q, k, v, causal=causal, **_mod(mod, 8, 2, sq))


# ---------------------------------------------------------------------------------------------- block masks
def test_block_mask_from_create_block_mask():
    """create_block_mask of a causal sliding window ((1, 1) broadcast, 128 x 128 blocks): partial and full blocks
    (not reading the others is the next test's)."""
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v = make_inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=11)

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 300)
    mask = create_block_mask(causal_window, 1, 1, 1000, 1000, device="cuda")
    assert int(mask.full_kv_num_blocks.sum()) > 0
    check(q, k, v, block_mask=mask)


@pytest.mark.parametrize("kv_block, d, gqa, positional", [
    (128, 64, (8, 2), {}), (256, 128, (6, 3), {}),
    (128, 256, (4, 2), {}),  # D 256: 64-key stages
    # with positional bounds: full blocks inside them skip the bounds (a per-warp branch), the others apply them
    (128, 128, (8, 2), {"causal": True}), (256, 64, (4, 2), {"causal": True, "window": (300, 0)}),
    (128, 128, (4, 4), {"causal": True, "causal_alignment": "top_left"}),
    pytest.param(128, (192, 128), (4, 4), {}, marks=pytest.mark.slow)])
def test_random_block_masks_skip_unlisted_blocks(kv_block, d, gqa, positional):
    """Random per-(batch, head, query block) lists of partial and full key blocks (BlockMask.from_kv_blocks) with a
    mask_mod on the partial ones, alone or with causal / window bounds; blocks no head of a batch lists hold NaN in
    K and V (the kernel must not read them); rows with no key give zeros and LSE -inf."""
    from torch.nn.attention.flex_attention import BlockMask
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    hq, hkv = gqa
    batch, sq, skv = 2, 700, 1300
    q, k, v = make_inputs(batch, sq, skv, hq, hkv, dqk, torch.bfloat16, seed=kv_block, dv=dv)
    rng = random.Random(kv_block)
    q_blocks, kv_blocks = -(-sq // 128), -(-skv // kv_block)
    num = torch.zeros(batch, hq, q_blocks, dtype=torch.int32)
    full_num = torch.zeros_like(num)
    indices = torch.zeros(batch, hq, q_blocks, kv_blocks, dtype=torch.int32)
    full_indices = torch.zeros_like(indices)
    k_bad, v_bad = k.clone(), v.clone()
    for b in range(batch):
        dead = set(rng.sample(range(kv_blocks), 2))
        for block in dead:
            k_bad[b, block * kv_block:(block + 1) * kv_block] = float("nan")
            v_bad[b, block * kv_block:(block + 1) * kv_block] = float("nan")
        live = [n for n in range(kv_blocks) if n not in dead]
        for h in range(hq):
            for m in range(q_blocks):
                chosen = rng.sample(live, rng.randint(0, len(live)))
                cut = rng.randint(0, len(chosen))
                num[b, h, m], full_num[b, h, m] = cut, len(chosen) - cut
                indices[b, h, m, :cut] = torch.tensor(chosen[:cut], dtype=torch.int32)
                full_indices[b, h, m, :len(chosen) - cut] = torch.tensor(chosen[cut:], dtype=torch.int32)

    def stripes(b, h, q_idx, kv_idx):
        return (q_idx + 2 * kv_idx + h) % 3 != 0
    mask = BlockMask.from_kv_blocks(num.cuda(), indices.cuda(), full_num.cuda(), full_indices.cuda(),
                                    BLOCK_SIZE=(128, kv_block), mask_mod=stripes, seq_lengths=(sq, skv))
    check(q, k_bad, v_bad, clean=(q, k, v), block_mask=mask, **positional)
    assert torch.isnan(k_bad).any()


# ---------------------------------------------------------------------------------------------- packed sequences
def check_varlen(q, k, v, cu_q, cu_k, tol=1e-2, **kwargs):
    """prefill_varlen into a NaN-poisoned out against the reference sequence by sequence; rows after the last
    sequence stay unwritten (NaN)."""
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = attention.prefill_varlen(q, k, v, cu_q, cu_k, return_lse=True, out=out, **kwargs)
    reference_kwargs = {key: value for key, value in kwargs.items() if not key.startswith("max_seqlen")}
    want, want_lse = attention.prefill_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **reference_kwargs)
    end = int(cu_q[-1])
    assert got.data_ptr() == out.data_ptr() and got[end:].isnan().all()
    assert_matches(got[None, :end], lse[None, :, :end], want[None, :end], want_lse[None, :, :end], tol)


def packed(lengths_q, lengths_k, hq, hkv, dqk, dv, dtype=torch.bfloat16, padding=0, seed=0):
    """Random packed q, k, v (``padding`` finite rows after the last sequence) and their int32 cu_seqlens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rows(n, h, d):
        return torch.randn(n + padding, h, d, device="cuda", generator=gen).to(dtype)

    def offsets(lengths):
        return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    return (rows(sum(lengths_q), hq, dqk), rows(sum(lengths_k), hkv, dqk), rows(sum(lengths_k), hkv, dv),
            offsets(lengths_q), offsets(lengths_k))


@pytest.mark.parametrize("lengths_q, lengths_k, d, causal, alignment, extra", [
    ([300, 1, 0, 129, 1000], None, 128, True, "bottom_right", {}),
    ([77, 500, 3], [500, 77, 260], 64, True, "bottom_right", {}),          # Sq > Skv: rows with no key
    ([77, 500, 3], [500, 77, 260], 64, True, "top_left", {}),
    ([640, 129, 1], [640, 0, 33], (192, 128), False, "bottom_right", {}),  # a sequence without keys
    ([1000, 200], None, 256, True, "bottom_right", {"window": (128, None)}),
    pytest.param([513, 257, 5], None, 128, False, "bottom_right", {"window": (64, 64)}, marks=pytest.mark.slow),
])
def test_varlen_against_the_reference(lengths_q, lengths_k, d, causal, alignment, extra):
    dqk, dv = d if isinstance(d, tuple) else (d, d)
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k or lengths_q, 8, 2, dqk, dv, padding=5, seed=len(lengths_q))
    check_varlen(q, k, v, cu_q, cu_k, causal=causal, causal_alignment=alignment, **extra)


def test_varlen_mods_see_the_sequence():
    """A mod's b is the packed sequence and q_idx, kv_idx indices within it (a per-sequence table, ALiBi)."""
    q, k, v, cu_q, cu_k = packed([300, 129, 700], [300, 129, 700], 8, 4, 128, 128, dtype=torch.float16, seed=9)
    offsets = torch.tensor([0.0, 2.0, -1.0], device="cuda")
    slopes = torch.tensor(M.alibi_slopes(8), device="cuda")

    def per_sequence_alibi(score, b, h, q_idx, kv_idx):
        return score + offsets[b] * 0.1 + slopes[h] * (kv_idx - q_idx)
    check_varlen(q, k, v, cu_q, cu_k, causal=True, score_mod=per_sequence_alibi, max_seqlen_q=700, max_seqlen_k=700)


def test_varlen_cuda_graph_replays_with_new_offsets():
    """prefill_varlen captured in a CUDA graph (max_seqlen given: nothing is read back) and replayed after the
    offsets change in place: the kernel reads cu_seqlens at run time."""
    q, k, v, cu_q, cu_k = packed([300, 200, 500], [300, 200, 500], 8, 2, 128, 128, seed=4)
    out = torch.full((q.shape[0], 8, 128), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.empty(8, q.shape[0], device="cuda")
    kwargs = dict(causal=True, max_seqlen_q=700, max_seqlen_k=700)
    attention.prefill_varlen(q, k, v, cu_q, cu_k, out=out, **kwargs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, graph_lse = attention.prefill_varlen(q, k, v, cu_q, cu_k, out=out, return_lse=True, **kwargs)
    for offsets in ([0, 300, 500, 1000], [0, 700, 701, 1000]):
        cu_q.copy_(torch.tensor(offsets, dtype=torch.int32))
        cu_k.copy_(cu_q)
        out.fill_(float("nan"))
        graph.replay()
        lse.copy_(graph_lse)
        want, want_lse = attention.prefill_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
        assert_matches(out[None, :1000], lse[None, :, :1000], want[None, :1000], want_lse[None, :, :1000], 1e-2)


# ---------------------------------------------------------------------------------------------- plan variants
VARIANT_CASES = {  # name: the test above it reruns; the default plans (overlap, ping-pong up to D 128) run them all
    "d128-causal": lambda: test_shapes_against_the_reference(2, 1000, 1000, 8, 2, 128, True, "bottom_right", "bf16",
                                                             "bshd"),
    "d128-sq-gt-skv-fp16-bhsd": lambda: test_shapes_against_the_reference(1, 777, 300, 6, 3, 128, False,
                                                                          "bottom_right", "fp16", "bhsd"),
    "d64-causal-top-left-mqa": lambda: test_shapes_against_the_reference(2, 513, 1000, 4, 1, 64, True, "top_left",
                                                                         "bf16", "bshd"),
    "d64-window": lambda: test_sliding_windows(700, 900, 64, True, (200, 0), "bottom_right"),
    "d128-soft-cap": lambda: test_mods("soft_cap", 700, 128, True, "bf16"),
    "d64-document-mask": lambda: test_mods("document_mask", 640, 64, False, "bf16"),
    "d256-causal": lambda: test_shapes_against_the_reference(2, 600, 600, 4, 2, 256, True, "bottom_right", "bf16",
                                                             "bshd"),
    "d192-alibi": lambda: test_mods("alibi", 500, (192, 128), True, "fp16"),
    "d64-block-mask": lambda: test_random_block_masks_skip_unlisted_blocks(128, 64, (8, 2), {}),
    "d128-block-mask-256": lambda: test_random_block_masks_skip_unlisted_blocks(256, 128, (6, 3), {}),
    "d128-block-mask-causal": lambda: test_random_block_masks_skip_unlisted_blocks(128, 128, (8, 2),
                                                                                   {"causal": True}),
    "d128-varlen": lambda: test_varlen_against_the_reference([300, 1, 0, 129, 1000], None, 128, True,
                                                             "bottom_right", {}),
    "d64-varlen-sq-gt-skv": lambda: test_varlen_against_the_reference([77, 500, 3], [500, 77, 260], 64, True,
                                                                      "bottom_right", {}),
    "d256-varlen-window": lambda: test_varlen_against_the_reference([1000, 200], None, 256, True, "bottom_right",
                                                                    {"window": (128, None)}),
}


@pytest.mark.parametrize("overlap, pingpong, case", [
    (True, False, "d128-causal"), (False, True, "d128-sq-gt-skv-fp16-bhsd"), (False, False, "d64-causal-top-left-mqa"),
    (True, False, "d64-window"), (False, True, "d128-soft-cap"), (True, False, "d64-document-mask"),
    (True, True, "d256-causal"), (True, True, "d192-alibi"), (True, False, "d64-block-mask"),
    (False, True, "d128-block-mask-256"), (True, False, "d128-block-mask-causal"), (True, False, "d128-varlen"), (False, False, "d64-varlen-sq-gt-skv"),
    (True, True, "d256-varlen-window"), (False, True, "d192-alibi"), (False, True, "d256-causal"),
])
def test_plan_variants(overlap, pingpong, case):
    """The kernel's variants (``PrefillPlan.overlap``, ``.pingpong``) forced by ``plan_options``, against the
    reference: causal and not, a window, mods, block masks (a first block from the full list), packed
    sequences, D 64 ... 256."""
    from nvfly.ops.attention.prefill_api import plan_options
    with plan_options(overlap=overlap, pingpong=pingpong):
        VARIANT_CASES[case]()


# ---------------------------------------------------------------------------------------------- issue 27's options
def test_documents_block_mask_with_causal(sq=1000, d=128, dtype="bf16"):
    """The benchmark's documents row at a small size: a causal-documents BlockMask (create_block_mask: partial
    blocks on the diagonal and at document edges, full blocks below) with causal=True (its full blocks inside the
    bounds skip them), document lengths not multiples of 128 (one of 10 keys) and a tail."""
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v = make_inputs(2, sq, sq, 8, 2, d, DTYPES[dtype], seed=sq)
    # sequence 1's document [128, 600) holds key block 1 below query block 2 whole: a full block at 700 and 1000
    cuts = torch.tensor([[300, 520, 777], [128, 600, 610]], device="cuda")
    ids = (torch.arange(sq, device="cuda")[None, :, None] >= cuts[:, None, :]).sum(-1).to(torch.int32)
    documents = M.document_mask(ids)

    def causal_documents(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & documents(b, h, q_idx, kv_idx)
    mask = create_block_mask(causal_documents, 2, None, sq, sq, device="cuda")
    assert int(mask.full_kv_num_blocks.sum()) > 0 and int(mask.kv_num_blocks.sum()) > 0
    check(q, k, v, causal=True, block_mask=mask)


def test_alibi_with_sq_not_skv(sq=300, skv=777, d=128, alignment="bottom_right"):
    """ALiBi (kv_idx - q_idx, q_idx the row) with Sq != Skv, causal, tails in both."""
    q, k, v = make_inputs(2, sq, skv, 8, 2, d, torch.float16, seed=sq + skv)
    check(q, k, v, causal=True, causal_alignment=alignment, **_mod("alibi", 8, 2, skv))


HOIST_CASES = {  # the tests above that run the positional bounds and mods the options change
    "d128-causal-sq-lt-skv": lambda: test_shapes_against_the_reference(3, 77, 301, 6, 2, 128, True, "bottom_right",
                                                                       "fp16", "bhsd"),
    "d64-causal-keyless-rows": lambda: test_shapes_against_the_reference(2, 301, 77, 6, 3, 64, True, "bottom_right",
                                                                         "bf16", "bshd"),
    "d64-causal-top-left": lambda: test_shapes_against_the_reference(2, 301, 77, 6, 3, 64, True, "top_left", "bf16",
                                                                     "bshd"),
    "d256-causal": lambda: test_shapes_against_the_reference(2, 333, 333, 4, 2, 256, True, "bottom_right", "bf16",
                                                             "bshd"),
    "d128-causal-window": lambda: test_sliding_windows(1000, 1000, 128, True, (256, None), "bottom_right"),
    "d64-two-sided-window": lambda: test_sliding_windows(700, 900, 64, False, (100, 50), "top_left"),
    "d64-right-window-keyless": lambda: test_sliding_windows(513, 300, 64, False, (None, 20), "bottom_right"),
    "d128-diagonal-window": lambda: test_sliding_windows(300, 300, 128, True, (0, 0), "bottom_right"),
    "d256-window": lambda: test_sliding_windows(600, 333, 256, True, (150, 0), "bottom_right"),
    "alibi-sq-lt-skv": lambda: test_alibi_with_sq_not_skv(300, 777, 128, "bottom_right"),
    "alibi-sq-gt-skv-top-left": lambda: test_alibi_with_sq_not_skv(777, 300, 64, "top_left"),
    "alibi-d64": lambda: test_mods("alibi", 500, 64, True, "fp16"),
    "soft-cap": lambda: test_mods("soft_cap", 700, 128, True, "bf16"),
    "relative-bias": lambda: test_mods("relative_position_bias", 333, 128, False, "bf16"),
    "window-mask-mod": lambda: test_mods("sliding_window", 600, 256, True, "bf16"),
    "prefix-lm": lambda: test_mods("prefix_lm", 400, 64, False, "bf16"),
    "document-mask": lambda: test_mods("document_mask", 640, (192, 128), False, "bf16"),
    "soft-cap-document-mask": lambda: test_mods("soft_cap+document_mask", 300, 128, True, "fp16"),
    "documents-block-mask-causal": lambda: test_documents_block_mask_with_causal(1000, 128, "bf16"),
    "documents-block-mask-causal-d64": lambda: test_documents_block_mask_with_causal(700, 64, "fp16"),
    "block-mask-causal": lambda: test_random_block_masks_skip_unlisted_blocks(128, 128, (8, 2), {"causal": True}),
    "block-mask-256-causal-window": lambda: test_random_block_masks_skip_unlisted_blocks(
        256, 64, (4, 2), {"causal": True, "window": (300, 0)}),
    "block-mask-top-left": lambda: test_random_block_masks_skip_unlisted_blocks(
        128, 128, (4, 4), {"causal": True, "causal_alignment": "top_left"}),
    "block-mask-d256": lambda: test_random_block_masks_skip_unlisted_blocks(128, 256, (4, 2), {}),
    "varlen-sq-gt-skv": lambda: test_varlen_against_the_reference([77, 500, 3], [500, 77, 260], 64, True,
                                                                  "bottom_right", {}),
    "varlen-window": lambda: test_varlen_against_the_reference([1000, 200], None, 256, True, "bottom_right",
                                                               {"window": (128, None)}),
    "varlen-alibi": test_varlen_mods_see_the_sequence,
}
MASK_CASES = ("window-mask-mod", "prefix-lm", "document-mask", "documents-block-mask-causal",
              "documents-block-mask-causal-d64", "block-mask-causal", "block-mask-256-causal-window",
              "block-mask-top-left", "block-mask-d256")


@pytest.mark.parametrize("options, case",
                         [("hoist", case) for case in HOIST_CASES]
                         + [("hoist_prefetch", case) for case in MASK_CASES]
                         + [("prefetch", case) for case in MASK_CASES[:4]])
def test_hoist_and_prefetch_variants(options, case):
    """``PrefillPlan.hoist`` (positional bounds as per-row limits, the mods' indices affine) and
    ``.prefetch_mask`` (the mask_mod's loads under S, its compares after the wait) forced by ``plan_options``:
    causal in both alignments with tails and key-less rows, windows, every shipped mod, block masks with positional
    bounds, packed sequences, D 64 ... 256, the LSE."""
    from nvfly.ops.attention.prefill_api import plan_options
    chosen = {"hoist": dict(hoist=True), "hoist_prefetch": dict(hoist=True, prefetch_mask=True),
              "prefetch": dict(prefetch_mask=True)}[options]
    with plan_options(**chosen):
        HOIST_CASES[case]()


WIDE_CASES = {  # D 64 (192-key stages with ``wide``) and the polynomial exp2 (every head dim)
    "d64-causal": lambda: test_shapes_against_the_reference(1, 1000, 1000, 8, 2, 64, True, "bottom_right", "bf16",
                                                            "bshd"),
    "d64-keyless-rows": HOIST_CASES["d64-causal-keyless-rows"],
    "d64-top-left": HOIST_CASES["d64-causal-top-left"],
    "d64-one-key": lambda: test_shapes_against_the_reference(1, 129, 1, 4, 2, 64, False, "bottom_right", "fp16",
                                                             "bshd"),
    "d64-full-bhsd": lambda: test_shapes_against_the_reference(1, 513, 700, 12, 4, 64, False, "bottom_right", "fp16",
                                                               "bhsd"),
    "d64-window": HOIST_CASES["d64-two-sided-window"],
    "d64-right-window-keyless": HOIST_CASES["d64-right-window-keyless"],
    "d64-alibi": HOIST_CASES["alibi-d64"],
    "d64-document-mask": lambda: test_mods("document_mask", 640, 64, True, "bf16"),
    "d128-causal": HOIST_CASES["d128-causal-sq-lt-skv"],
    "d128-soft-cap": HOIST_CASES["soft-cap"],
    "d128-full": lambda: test_shapes_against_the_reference(2, 256, 256, 4, 4, 128, False, "bottom_right", "bf16",
                                                           "bshd"),
    "d128-sq-gt-skv-fp16-bhsd": VARIANT_CASES["d128-sq-gt-skv-fp16-bhsd"],
    "d128-causal-window": HOIST_CASES["d128-causal-window"],
    "d128-documents-block-mask": HOIST_CASES["documents-block-mask-causal"],  # a BlockMask keeps 128 keys
}


@pytest.mark.parametrize("options, case",
                         [(options, case) for options in ("wide_hoist", "poly2_hoist", "lazy_wide_poly2")
                          for case in WIDE_CASES]
                         + [("poly1_wide", case) for case in ("d64-causal", "d64-keyless-rows")]
                         + [("poly4_lazy", case) for case in ("d64-causal", "d64-keyless-rows", "d128-soft-cap")]
                         + [("lazy", case) for case in ("alibi-sq-lt-skv", "window-mask-mod", "block-mask-causal",
                                                         "varlen-sq-gt-skv", "d256-causal")])
def test_wide_and_polynomial_variants(options, case):
    """``wide`` (D 64: 192-key stages, D 128: 176; other head dims unchanged), ``lazy_rescale`` (O's rescale
    skipped on a warp vote; not with the overlap: D 256 runs without it) and ``poly_exp2`` (2 of every 16 exp2 by
    ``EXP2_CUBIC``: rows without keys must still sum to 0, LSE -inf) forced by ``plan_options``."""
    from nvfly.ops.attention.prefill_api import plan_options
    chosen = {"wide_hoist": dict(wide=True, hoist=True), "poly2_hoist": dict(poly_exp2=2, hoist=True),
              "poly1_wide": dict(poly_exp2=1, wide=True), "lazy": dict(lazy_rescale=True),
              "poly4_lazy": dict(poly_exp2=4, lazy_rescale=True, hoist=True),
              "lazy_wide_poly2": dict(lazy_rescale=True, wide=True, poly_exp2=2, hoist=True)}[options]
    with plan_options(**chosen):
        (WIDE_CASES.get(case) or HOIST_CASES[case])()
