"""Decode's plan variants (``api.DECODE_VARIANTS``: 3 CTAs an SM, 16-row tiles, 32-row warps, lazy rescaling,
swapped operands) against the float32 reference, as the default plan is in test_attention_decode_gpu.py: fp8 caches
at Sq 1, 4, 8 and 16 with ragged lengths (0 and 1 included), contiguous and paged, per-tensor and per-head scales,
split-KV; 32-row warps and lazy rescaling also over bf16 caches, with mods and with a per-head block mask (each row
tile masks its own rows and heads; blocks empty for a whole group hold NaN, so reading one would show); the swapped
plans (Sq·G <= 8) over bf16, fp16 and fp8 caches at G 4, 6, 8 (Sq 1) and Sq 2 at G 4, d 64-256, paged, lengths 0
and 1, splits, mods and per-head block masks. NaN-poisoned outputs and split workspace. About two minutes, mostly
compiles."""
import pytest
import torch

from nvfly.ops.attention import api
from nvfly.ops.attention import mods as M
from nvfly.ops.attention import plan as P

from tests.gpu.test_attention_decode_gpu import (DTYPES, FP8, block_mask_of, check, head_parity, kv_scale,
                                                 make_cache, poison_unread, query)

pytestmark = pytest.mark.gpu
VARIANTS = [name for name in api.DECODE_VARIANTS if name != "default"]

FP8_CASES = {
    # name: (batch, sq, hq, hkv, d, capacity, lengths or None, layout, page, k scale, v scale)
    "sq1-lengths-0-1-per-head-split": (4, 1, 32, 8, 128, 3000, [3000, 0, 1, 1700], "bshd", 0, "head", "head"),
    "sq4-paged16-per-tensor": (2, 4, 32, 8, 128, 1500, [1500, 1], "bshd", 16, "tensor", "tensor1"),
    "sq8-paged64-lengths-0-1": (3, 8, 32, 8, 128, 2000, [2000, 0, 1], "bshd", 64, "head", "tensor"),
    "sq8-long-split": (1, 8, 32, 8, 128, 20000, None, "bshd", 0, "head", "head"),
    "sq16-64-rows-bhsd": (2, 16, 32, 8, 128, 900, [900, 65], "bhsd", 0, "tensor", "head"),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_variant_matches_reference(name, variant):
    batch, sq, hq, hkv, d, capacity, lengths, layout, page, k_kind, v_kind = FP8_CASES[name]
    k, v, table = make_cache(batch, capacity, hkv, d, d, FP8, layout, page)
    q = query(batch, sq, hq, d, torch.bfloat16)
    seqlens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=seqlens, block_table=table, k_scale=kv_scale(k_kind, hkv, 1),
              v_scale=kv_scale(v_kind, hkv, 2))


@pytest.mark.parametrize("variant", ["warp32", "lazy"])
def test_variant_over_bf16_caches(variant):
    k, v, table = make_cache(2, 1000, 8, 128, 128, torch.bfloat16, page=16)
    q = query(2, 8, 32, 128, torch.bfloat16)
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=torch.tensor([1000, 1], dtype=torch.int32, device="cuda"), block_table=table)


def test_lazy_warp32_with_mods():
    """A score mod and a mask mod see each row tile's own rows (heads, positions); the sliding window's masked
    prefix keeps early maxima at -inf (lazy rescaling's first factors are 0, not 1)."""
    k, v, _ = make_cache(2, 1200, 8, 128, 128, FP8)
    q = query(2, 8, 32, 128, torch.bfloat16)
    with api.plan_options(**api.DECODE_VARIANTS["lazy_warp32"]):
        check(q, k, v, cache_seqlens=torch.tensor([1200, 333], dtype=torch.int32, device="cuda"),
              score_mod=M.soft_cap(20.0), mask_mod=M.sliding_window(300), k_scale=kv_scale("head", 8, 1))


@pytest.mark.parametrize("variant", ["warp32", "lazy_warp32", "pdl", "fixup", "combine_kernel"])
def test_variants_with_a_per_head_block_mask(variant):
    """Random empty/partial/full blocks per (sequence, query head) with a mask_mod, 32 rows (Sq 4, G 8: one warp's
    two tiles under warp32), fp8 paged caches, ragged lengths (0 included), 7 splits (each way of combining them):
    rows whose every block is empty give zeros and -inf."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    kinds = torch.randint(0, 3, (3, 16, 24), device="cuda", generator=gen)
    kinds[:, :, 0] = 0  # the first block empty for every head
    kinds[1, :4] = 0  # every block empty for the first group of sequence 1
    k, v, table = make_cache(3, 3000, 2, 128, 128, FP8, page=64)
    q = query(3, 4, 16, 128, torch.bfloat16)
    seqlens = torch.tensor([3000, 129, 0], dtype=torch.int32, device="cuda")
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=7, k_scale=kv_scale("head", 2, 1),
              block_mask=block_mask_of(kinds, 128, head_parity), read=poison_unread(k, v, kinds, 128, 8, table))


# swapped operands: every case has Sq·G <= 8, so the variant runs the swapped kernel (asserted: a declined plan
# would test the default instead)
SWAPPED_CASES = {
    # name: (batch, sq, hq, hkv, d, capacity, lengths or None, cache dtype, layout, page, splits)
    "g4-bf16-lengths-0-1": (4, 1, 32, 8, 128, 3000, [3000, 0, 1, 1700], "bf16", "bshd", 0, 0),
    "g6-bf16-paged16": (3, 1, 48, 8, 128, 2000, [2000, 1, 777], "bf16", "bshd", 16, 0),
    "g8-fp16-paged64-split7": (2, 1, 64, 8, 128, 2500, [2500, 0], "fp16", "bshd", 64, 7),
    "g8-bf16-bhsd-one-long": (1, 1, 64, 8, 128, 20000, None, "bf16", "bhsd", 0, 0),
    "sq2-g4-bf16": (2, 2, 32, 8, 128, 1500, [1500, 65], "bf16", "bshd", 0, 0),
    "g4-d64-bf16-split3": (2, 1, 16, 4, 64, 1000, [1000, 1], "bf16", "bshd", 0, 3),
    "g8-d256-bf16-paged128": (2, 1, 16, 2, 256, 1200, [1200, 300], "bf16", "bshd", 128, 0),
    "g6-dqk192-fp8": (2, 1, 12, 2, 192, 900, [900, 0], "fp8", "bshd", 0, 0),
    "g4-fp8-lengths-0-1": (4, 1, 32, 8, 128, 3000, [3000, 0, 1, 1700], "fp8", "bshd", 0, 0),
    "g6-fp8-paged16-split5": (3, 1, 48, 8, 128, 2000, [2000, 1, 777], "fp8", "bshd", 16, 5),
    "g8-fp8-paged64-long": (1, 1, 64, 8, 128, 20000, None, "fp8", "bshd", 64, 0),
    "sq2-g4-fp8-bhsd": (2, 2, 32, 8, 128, 1500, [1500, 65], "fp8", "bhsd", 0, 0),
    "g4-d64-fp8": (2, 1, 16, 4, 64, 700, [700, 1], "fp8", "bshd", 0, 0),
    "g8-d256-fp8-split3": (1, 1, 16, 2, 256, 3000, None, "fp8", "bshd", 0, 3),
}


@pytest.mark.parametrize("variant", ["swapped", "swapped_lazy"])
@pytest.mark.parametrize("name", SWAPPED_CASES)
def test_swapped_matches_reference(name, variant):
    batch, sq, hq, hkv, d, capacity, lengths, kind, layout, page, splits = SWAPPED_CASES[name]
    assert not P.swap_declined(sq, hq // hkv)
    fp8 = kind == "fp8"
    k, v, table = make_cache(batch, capacity, hkv, d, d, FP8 if fp8 else DTYPES[kind], layout, page)
    q = query(batch, sq, hq, d, torch.bfloat16 if fp8 else DTYPES[kind])
    seqlens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    scales = dict(k_scale=kv_scale("head", hkv, 1), v_scale=kv_scale("tensor", hkv, 2)) if fp8 else {}
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=splits, **scales)


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
@pytest.mark.parametrize("variant", ["swapped", "swapped_lazy"])
def test_swapped_with_mods(kind, variant):
    """A score mod and a mask mod see the rows a lane holds in the swapped layout (rows 2c, 2c + 1: their heads and
    positions); the window's masked prefix keeps early maxima at -inf; Sq 2 at G 4 (both tokens' positions)."""
    k, v, table = make_cache(2, 1200, 8, 128, 128, FP8 if kind == "fp8" else torch.bfloat16, page=16)
    q = query(2, 2, 32, 128, torch.bfloat16)
    scales = dict(k_scale=kv_scale("head", 8, 1)) if kind == "fp8" else {}
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=torch.tensor([1200, 333], dtype=torch.int32, device="cuda"), block_table=table,
              score_mod=M.soft_cap(20.0), mask_mod=M.sliding_window(300), **scales)


@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_swapped_with_a_per_head_block_mask(kind, group):
    """Random empty/partial/full blocks per (sequence, query head) with a mask_mod: each lane's two rows mask by
    their own heads' block states; paged caches, ragged lengths (0 included), 7 splits; blocks empty for a whole
    group hold NaN."""
    gen = torch.Generator(device="cuda").manual_seed(group)
    hq = 2 * group
    kinds = torch.randint(0, 3, (3, hq, 24), device="cuda", generator=gen)
    kinds[:, :, 0] = 0  # the first block empty for every head
    k, v, table = make_cache(3, 3000, 2, 128, 128, FP8 if kind == "fp8" else torch.bfloat16, page=64)
    q = query(3, 1, hq, 128, torch.bfloat16)
    seqlens = torch.tensor([3000, 129, 0], dtype=torch.int32, device="cuda")
    scales = dict(k_scale=kv_scale("head", 2, 1), v_scale=kv_scale("head", 2, 2)) if kind == "fp8" else {}
    with api.plan_options(**api.DECODE_VARIANTS["swapped"]):
        check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=7,
              block_mask=block_mask_of(kinds, 128, head_parity), read=poison_unread(k, v, kinds, 128, group, table),
              **scales)
