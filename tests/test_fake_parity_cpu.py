"""The fakes of ``torch.ops.nvfly.*`` refuse what the ops refuse, with the same error class and message (so that a
shape bug fails ``torch.compile`` tracing as it would fail the call), and accept what the ops accept.

Each invalid input runs through the real op on CPU tensors (its checks precede the device's) and through its fake
under FakeTensorMode."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import nvfly.torch.attention_ops  # noqa: F401  (defines torch.ops.nvfly.attention_decode, _prefill)
import nvfly.torch.grouped_ops  # noqa: F401  (defines torch.ops.nvfly.grouped_mm*)
import nvfly.torch.moe_ops  # noqa: F401  (defines torch.ops.nvfly.moe_*)
import nvfly.torch.ops  # noqa: F401  (defines torch.ops.nvfly: the GEMM's ops, RMSNorm's and TopK's)

bf, f16 = torch.bfloat16, torch.float16


def _t(*shape, dtype=bf):
    return torch.randn(*shape).to(dtype)


# (op, make the arguments, keyword arguments, expected error class, a fragment of its message)
INVALID = [
    ("mm", lambda: (_t(8, 16), _t(32, 8)), {}, ValueError, "nvfly::mm: b: shape (32, 8) and a's (8, 16) do not "
                                                           "multiply (K is 16 in a, 32 in b)"),
    ("mm", lambda: (_t(8, 16), _t(16, 8, dtype=f16)), {}, TypeError, "nvfly::mm: b: dtype torch.float16 differs"),
    ("mm", lambda: (_t(2, 8, 16), _t(16, 8)), {}, ValueError, "nvfly::mm: a: expected a 2-D tensor, got 3-D"),
    ("bmm", lambda: (_t(2, 8, 16), _t(3, 16, 8)), {}, ValueError, "nvfly::bmm: b: 3 batches, a has 2"),
    ("bmm", lambda: (_t(8, 16), _t(16, 8)), {}, ValueError, "nvfly::bmm: a: expected a 3-D tensor"),
    ("addmm", lambda: (_t(7), _t(8, 16), _t(16, 8)), {}, ValueError,
     "nvfly::addmm: c: shape (7,) does not broadcast to the output's (8, 8)"),
    ("addmm", lambda: (_t(8), _t(8, 16), _t(12, 8)), {"beta": 0.5}, ValueError, "nvfly::addmm: b: shape (12, 8)"),
    ("addmm", lambda: (_t(7), _t(8, 16), _t(16, 8)), {"beta": 0.0}, ValueError,  # torch checks an unused c too
     "nvfly::addmm: c: shape (7,)"),
    ("linear", lambda: (_t(2, 4, 16), _t(6, 12)), {}, ValueError, "nvfly::linear: weight.mT: shape (12, 6) and x's "
                                                                  "(8, 16) do not multiply"),
    ("linear", lambda: (_t(2, 4, 16), _t(16)), {}, ValueError, "nvfly::linear: weight: expected a 2-D tensor"),
    ("linear", lambda: (_t(4, 16), _t(6, 16), _t(5)), {}, ValueError, "nvfly::linear: bias: shape (5,)"),
    ("linear", lambda: (torch.tensor(1.0).to(bf), _t(6, 16)), {}, ValueError,
     "nvfly::linear: x: expected a tensor of at least 1 dimension, got 0-D"),
    ("mm_out", lambda: (_t(8, 16), _t(16, 8), _t(8, 9)), {}, ValueError,
     "nvfly::mm_out: out: expected shape (8, 8), got (8, 9)"),
    ("addmm_out", lambda: (_t(3, 8), _t(8, 16), _t(16, 8), _t(8, 8)), {}, ValueError, "nvfly::addmm_out: c: shape"),
    ("rms_norm", lambda: (_t(4, 16), [16], _t(8)), {}, ValueError, "nvfly::rms_norm: weight: expected shape (16,)"),
    ("rms_norm", lambda: (_t(4, 16), [8]), {}, ValueError, "nvfly::rms_norm: normalized_shape: (8,) must "
                                                           "be non-empty and match the last dimensions of x"),
    ("rms_norm", lambda: (_t(4, 16), [16]), {"eps": -1.0}, ValueError, "nvfly::rms_norm: eps: expected a "
                                                                       "non-negative float"),
    ("fused_add_rms_norm", lambda: (_t(4, 16), _t(4, 8), [16]), {}, ValueError,
     "nvfly::fused_add_rms_norm: residual: expected shape (4, 16) (x's), got (4, 8)"),
    ("rms_norm_backward", lambda: (_t(4, 8), _t(4, 16), [16], torch.rand(4, 1), None, None, [True, False]), {},
     ValueError, "nvfly::rms_norm_backward: grad_out: expected shape (4, 16) (x's), got (4, 8)"),
    ("rms_norm_backward", lambda: (_t(4, 16), _t(4, 16), [16], torch.rand(3, 1), None, None, [True, False]), {},
     ValueError, "nvfly::rms_norm_backward: rstd: expected 4 values (one per row)"),
    ("topk", lambda: (_t(4, 16), 17), {}, ValueError, "nvfly::topk: k: expected an int in [0, 16]"),
    ("topk", lambda: (_t(4, 16), 2), {"dim": 2}, ValueError, "nvfly::topk: dim: 2 is out of range"),
    ("grouped_mm", lambda: (_t(8, 16), _t(2, 12, 8), torch.tensor([3, 8], dtype=torch.int32)), {}, ValueError,
     "nvfly::grouped_mm: b: shape (2, 12, 8) and a's (8, 16) do not multiply"),
    ("grouped_mm", lambda: (_t(8, 16), _t(2, 16, 8), torch.tensor([3, 8])), {}, TypeError,
     "nvfly::grouped_mm: offs: expected a 1-D int32 tensor, got 1-D torch.int64"),
    ("grouped_mm", lambda: (_t(8, 16), _t(2, 16, 8)), {}, TypeError, "nvfly::grouped_mm: offs: expected a 1-D int32"),
    ("grouped_mm", lambda: (_t(8, 16), _t(2, 16, 7), torch.tensor([3, 8], dtype=torch.int32)),
     {"fuse": "silu_mul"}, ValueError, "nvfly::grouped_mm: b: the fused gate/up projection takes gate and up"),
    ("grouped_mm_masked", lambda: (_t(2, 4, 16), _t(3, 16, 8), torch.tensor([1, 4], dtype=torch.int32)), {},
     ValueError, "nvfly::grouped_mm_masked: b: 3 groups, a has 2"),
    ("grouped_mm_out", lambda: (_t(8, 16), _t(2, 16, 8), torch.tensor([3, 8], dtype=torch.int32), _t(8, 9)), {},
     ValueError, "nvfly::grouped_mm_out: out: expected shape (8, 8), got (8, 9)"),
    ("moe_route", lambda: (torch.randn(4, 8), 9), {}, ValueError, "nvfly::moe_route: top_k: expected an int in [1, 8]"),
    ("moe_route", lambda: (torch.randn(4, 8, 2), 2), {}, ValueError, "nvfly::moe_route: logits: expected a 2-D"),
    ("moe_permute", lambda: (_t(4, 16), torch.zeros(5, 2, dtype=torch.int64), 8), {}, ValueError,
     "nvfly::moe_permute: ids: 5 tokens, x has 4"),
    ("moe_permute", lambda: (_t(4, 16), torch.zeros(4, 2), 8), {}, TypeError,
     "nvfly::moe_permute: ids: expected an int64 or int32 tensor, got torch.float32"),
    ("moe_unpermute", lambda: (_t(8, 16), torch.arange(8), torch.rand(3, 2)), {}, ValueError,
     "nvfly::moe_unpermute: weights: (3, 2) holds 6 routing slots, y has 8 rows"),
    ("moe_unpermute", lambda: (_t(8, 16), torch.arange(6), torch.rand(4, 2)), {}, ValueError,
     "nvfly::moe_unpermute: slots: expected a 1-D tensor of 8 elements"),
    # decode's own checks (its errors name the function and the argument)
    ("attention_decode", lambda: (_t(2, 1, 7, 64), _t(2, 32, 2, 64), _t(2, 32, 2, 64)), {}, ValueError,
     "attention.decode: q: 7 query heads are not a multiple of k_cache's 2 KV heads"),
    ("attention_decode", lambda: (_t(2, 1, 8, 64), _t(2, 32, 2, 64, dtype=f16), _t(2, 32, 2, 64)), {}, TypeError,
     "attention.decode: k_cache: dtype torch.float16 differs from q's torch.bfloat16"),
    ("attention_decode", lambda: (_t(2, 17, 8, 64), _t(2, 32, 2, 64), _t(2, 32, 2, 64)), {}, ValueError,
     "attention.decode: q: 17 query tokens per sequence"),
    ("attention_decode", lambda: (_t(2, 1, 8, 96), _t(2, 32, 2, 96), _t(2, 32, 2, 96)), {}, ValueError,
     "attention.decode: q: head dim 96 is not supported"),
    ("attention_decode", lambda: (_t(2, 1, 8, 64), _t(2, 32, 2, 64), _t(2, 32, 2, 64), torch.tensor([3])), {},
     ValueError, "attention.decode: cache_seqlens: 1 lengths, q has 2 sequences"),
    ("attention_prefill", lambda: (_t(2, 40, 7, 64), _t(2, 50, 2, 64), _t(2, 50, 2, 64)), {}, ValueError,
     "attention.prefill: q: 7 query heads are not a multiple of k's 2 KV heads"),
    ("attention_prefill", lambda: (_t(2, 40, 8, 192), _t(2, 50, 2, 192), _t(2, 50, 2, 192)), {}, ValueError,
     "attention.prefill: v: head dim 192 with Dqk 192 is not supported"),
    ("attention_prefill", lambda: (_t(2, 40, 8, 64), _t(2, 50, 2, 64), _t(2, 50, 2, 64)),
     {"causal_alignment": "left"}, ValueError, "attention.prefill: causal_alignment: expected one of"),
    ("attention_prefill", lambda: (_t(2, 40, 8, 64), _t(2, 50, 2, 64), _t(2, 50, 2, 64)), {"scale": -1.0},
     ValueError, "attention.prefill: scale: expected a positive finite number"),
]

# inputs nvfly declines but the ops accept (torch computes them: on CPU every one; the last one's rows are also
# unaligned for the kernel): the fakes accept them too, with the same result
VALID = [
    ("mm", lambda: (_t(8, 16, dtype=torch.float32), _t(16, 8, dtype=torch.float32)), {}),
    ("bmm", lambda: (_t(2, 8, 16, dtype=torch.float64), _t(2, 16, 8, dtype=torch.float64)), {}),
    ("linear", lambda: (_t(2, 4, 16), _t(6, 16), _t(6)), {}),
    ("rms_norm", lambda: (_t(4, 16, dtype=torch.float64), [16], _t(16, dtype=torch.float64)), {}),
    ("topk", lambda: (_t(4, 16, dtype=torch.float64), 3), {"dim": 0}),
    ("grouped_mm", lambda: (_t(8, 16, dtype=torch.float32), _t(2, 16, 6, dtype=torch.float32),
                            torch.tensor([3, 8], dtype=torch.int32)), {"fuse": "silu_mul"}),
    ("grouped_mm", lambda: (_t(16, 8), _t(8, 6), torch.tensor([3, 8], dtype=torch.int32)), {}),
    ("grouped_mm_masked", lambda: (_t(2, 4, 16), _t(2, 16, 8), torch.tensor([1, 4], dtype=torch.int32)), {}),
    ("moe_route", lambda: (torch.randn(5, 12), 3), {"renormalize": False}),
    ("moe_permute", lambda: (_t(5, 16), torch.randint(0, 6, (5, 2)), 6), {}),
    ("moe_unpermute", lambda: (_t(10, 16), torch.randperm(10), torch.rand(5, 2)), {}),
    ("attention_decode", lambda: (_t(2, 2, 8, 72)[..., 8:], _t(2, 32, 2, 65)[..., 1:], _t(2, 32, 2, 64)), {}),
    ("attention_prefill", lambda: (_t(1, 33, 4, 192), _t(1, 20, 2, 192), _t(1, 20, 2, 128)),
     {"causal": True, "causal_alignment": "top_left"}),
]


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return type(exc), str(exc)


def _real_and_fake(op, make, kwargs):
    args = make()
    real = _outcome(lambda: getattr(torch.ops.nvfly, op)(*args, **kwargs))
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _outcome(lambda: getattr(torch.ops.nvfly, op)(*fake_args, **kwargs))
    return real, fake


@pytest.mark.parametrize("op,make,kwargs,error,message", INVALID,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(INVALID)])
def test_fakes_raise_what_the_ops_raise(op, make, kwargs, error, message):
    real, fake = _real_and_fake(op, make, kwargs)
    assert real == fake
    assert real[0] is error and message in real[1], real


@pytest.mark.parametrize("op,make,kwargs", VALID, ids=[f"{c[0]}-{i}" for i, c in enumerate(VALID)])
def test_fakes_accept_what_the_ops_accept(op, make, kwargs):
    (real_status, real), (fake_status, fake) = _real_and_fake(op, make, kwargs)
    assert real_status == fake_status == "ok", (real, fake)
    flat = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    assert [(t.shape, t.dtype) for t in flat(real)] == [(t.shape, t.dtype) for t in flat(fake)]
