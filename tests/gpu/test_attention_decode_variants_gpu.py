"""Decode's plan variants (``api.DECODE_VARIANTS``: 3 CTAs an SM, 16-row tiles, 32-row warps, lazy rescaling)
against the float32 reference, as the default plan is in test_attention_decode_gpu.py: fp8 caches at Sq 1, 4, 8 and
16 with ragged lengths (0 and 1 included), contiguous and paged, per-tensor and per-head scales, split-KV; 32-row
warps and lazy rescaling also over bf16 caches, with mods and with a per-head block mask (each row tile masks its
own rows and heads; blocks empty for a whole group hold NaN, so reading one would show). NaN-poisoned
outputs and split workspace. About a minute and a half, mostly compiles."""
import pytest
import torch

from nvfly.ops.attention import api
from nvfly.ops.attention import mods as M

from tests.gpu.test_attention_decode_gpu import (FP8, block_mask_of, check, head_parity, kv_scale, make_cache,
                                                 poison_unread, query)

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


@pytest.mark.parametrize("variant", ["warp32", "lazy_warp32"])
def test_warp32_with_a_per_head_block_mask(variant):
    """Random empty/partial/full blocks per (sequence, query head) with a mask_mod, 32 rows (Sq 4, G 8) in one
    warp's two tiles, fp8 paged caches, ragged lengths (0 included), 7 splits."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    kinds = torch.randint(0, 3, (3, 16, 24), device="cuda", generator=gen)
    kinds[:, :, 0] = 0  # the first block empty for every head
    k, v, table = make_cache(3, 3000, 2, 128, 128, FP8, page=64)
    q = query(3, 4, 16, 128, torch.bfloat16)
    seqlens = torch.tensor([3000, 129, 0], dtype=torch.int32, device="cuda")
    with api.plan_options(**api.DECODE_VARIANTS[variant]):
        check(q, k, v, cache_seqlens=seqlens, block_table=table, splits=7, k_scale=kv_scale("head", 2, 1),
              block_mask=block_mask_of(kinds, 128, head_parity), read=poison_unread(k, v, kinds, 128, 8, table))
