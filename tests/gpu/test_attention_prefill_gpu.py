"""Prefill attention against the float32 reference on fresh random inputs: tails in Sq and Skv (1, odd, not a
multiple of the tiles), Sq != Skv both ways, GQA groups (power of two or not, MQA), every (Dqk, Dv) pair (64, 128,
192/128, 256 with its 80-key blocks), bf16 and fp16, (B, S, H, D) and (B, H, S, D) layouts, causal in both
alignments (rows that see no key: zeros and LSE -inf), the LSE row by row. Outputs are NaN-poisoned: every row must
be written."""
import random

import pytest
import torch

from nvfly.ops import attention
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


def check(q, k, v, tol=1e-2, **kwargs):
    """prefill (into a NaN-poisoned out, with the LSE) against the reference: relative error of out and, row by row,
    the LSE (-inf exactly where the reference's row sees no key)."""
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=q.dtype, device="cuda")
    got, lse = attention.prefill(q, k, v, return_lse=True, out=out, **kwargs)
    want, want_lse = attention.prefill_reference(q, k, v, **kwargs)
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
    odd = torch.zeros(1, 8, 2, 72, dtype=torch.bfloat16, device="cuda")[..., :64]  # rows 144 bytes apart
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
