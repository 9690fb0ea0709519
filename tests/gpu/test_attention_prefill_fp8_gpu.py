"""FP8 (e4m3) prefill attention against the float32 reference of the dequantised inputs, on fresh random inputs
quantised per tensor (descale = amax / 448, FlashAttention-3's convention): tails in Sq and Skv (1, odd, not a
multiple of the tiles or of V's 16-key groups), Sq != Skv both ways (rows that see no key: zeros and LSE -inf), GQA
and MQA, causal in both alignments, a sliding window, Dqk = Dv = 64, 128, 256, (B, H, S, D) views, descales as
tensors, numbers or None; the three non-default overlap variants; D 128's 192-key blocks (``wide``); per-head
descales ((B, Hkv) and (Hkv,), FlashAttention-3's layout; ``PrefillPlan.per_head_descales``) on inputs whose (batch,
KV head) slices differ in amplitude, alone and mixed with per-tensor ones. Outputs are NaN-poisoned: every row must
be written. V's transpose kernel is checked bit for bit against the torch strided copy
it replaced.

Tolerance: P is rounded to e4m3 (3 mantissa bits: a relative rounding error up to 2^-4, about 2.5 % rms, and values
below 2^-9 of the row's running maximum flushed) before P·V, while the row sums are of the float32 P, as in
FlashAttention-3; on random V that gives out a relative (Frobenius) error of about 2-3 % against the exact softmax
of the dequantised inputs, so the bound is 6 %. Scores are exact products of e4m3 values accumulated in wgmma's f32:
the LSE is checked to 1e-2 absolute."""
import pytest
import torch

from nvfly.ops import attention
from tests.gpu.test_attention_decode_gpu import assert_matches

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TOL = 6e-2


def random_bshd(shape, seed, layout):
    """A fresh random (B, S, H, D) tensor (a view of (B, H, S, D) storage with ``layout="bhsd"``) and its generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, s, h, d = shape
    x = torch.randn(b, h, s, d, device="cuda", generator=gen).transpose(1, 2) if layout == "bhsd" else \
        torch.randn(b, s, h, d, device="cuda", generator=gen)
    return x, gen


def quantised(shape, seed, layout="bshd", amplitude=1.0):
    """(e4m3 tensor, its descale as a one-element float32 tensor, the dequantised float32 tensor) of a fresh random
    (B, S, H, D) tensor (``random_bshd``)."""
    x = random_bshd(shape, seed, layout)[0] * amplitude
    descale = (x.abs().amax().clamp_min(1e-12) / E4M3_MAX).reshape(1)
    q8 = (x / descale).to(FP8)
    return q8, descale, q8.float() * descale


def quantised_per_head(shape, kv_heads, seed, layout="bshd", per_sequence=True):
    """(e4m3 tensor, its descales, the dequantised float32 tensor) of a fresh random (B, S, H, D) tensor whose (batch,
    KV head) slices have amplitudes 1/4 to 4: descales (B, Hkv) float32 (``per_sequence``, else (Hkv,), the amax over
    the batch too), a KV head's covering its group's H / Hkv heads (q's query heads)."""
    x, gen = random_bshd(shape, seed, layout)
    b, _, h, _ = shape
    amplitudes = 2.0 ** torch.randint(-2, 3, (b, kv_heads), device="cuda", generator=gen)
    x = x * amplitudes.repeat_interleave(h // kv_heads, 1)[:, None, :, None]
    amax = x.abs().unflatten(2, (kv_heads, h // kv_heads)).amax(dim=(1, 3, 4))  # (B, Hkv)
    descale = (amax if per_sequence else amax.amax(dim=0)).clamp_min(1e-12) / E4M3_MAX
    factors = descale.expand(b, kv_heads).repeat_interleave(h // kv_heads, 1)[:, None, :, None]
    q8 = (x / factors).to(FP8)
    return q8, descale, q8.float() * factors


def check(q, k, v, descales, reference, **kwargs):
    """prefill of fp8 (q, k, v) into a NaN-poisoned bf16 out, with the LSE, against the float32 reference of
    ``reference`` (the dequantised inputs)."""
    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), dtype=torch.bfloat16, device="cuda")
    got, lse = attention.prefill(q, k, v, return_lse=True, out=out, **dict(zip(("q_descale", "k_descale",
                                                                                 "v_descale"), descales)), **kwargs)
    want, want_lse = attention.prefill_reference(*reference, **kwargs)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    return assert_matches(got, lse, want, want_lse, TOL, lse_atol=1e-2)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, d, causal, alignment, layout", [
    (2, 256, 256, 4, 4, 128, False, "bottom_right", "bshd"),
    (2, 256, 256, 4, 4, 128, True, "bottom_right", "bshd"),
    (1, 1000, 1000, 8, 2, 128, True, "bottom_right", "bshd"),
    (3, 77, 301, 6, 2, 128, True, "bottom_right", "bhsd"),
    (2, 301, 77, 6, 3, 128, True, "bottom_right", "bshd"),    # early rows see no key
    (1, 77, 301, 4, 1, 128, True, "top_left", "bhsd"),         # MQA
    (2, 1, 129, 4, 2, 128, False, "bottom_right", "bshd"),
    (1, 129, 1, 4, 2, 128, False, "bottom_right", "bshd"),    # one key: V padded to 16
    (1, 513, 700, 12, 4, 64, True, "bottom_right", "bhsd"),
    (1, 333, 333, 4, 2, 256, False, "bottom_right", "bshd"),
])
def test_fp8_shapes_against_the_dequantised_reference(batch, sq, skv, hq, hkv, d, causal, alignment, layout):
    seed = sq * 1000 + skv
    (q, qd, qf), (k, kd, kf), (v, vd, vf) = (quantised((batch, s, h, d), seed + i, layout)
                                             for i, (s, h) in enumerate(((sq, hq), (skv, hkv), (skv, hkv))))
    check(q, k, v, (qd, kd, vd), (qf, kf, vf), causal=causal, causal_alignment=alignment)


def test_fp8_descales_as_numbers_or_none_window_and_scale():
    """Descales given as numbers, and None (1: inputs already in range), with a sliding window and a scale."""
    (q, qd, qf), (k, kd, kf), (v, vd, vf) = (quantised((1, 400, h, 128), 11 + i, amplitude=a)
                                             for i, (h, a) in enumerate(((8, 3.0), (2, 0.5), (2, 2.0))))
    check(q, k, v, (qd.item(), kd.item(), vd.item()), (qf, kf, vf), causal=True, window=(100, 0), scale=0.1)
    check(q, k, v, (None, None, None), (q.float(), k.float(), v.float()), scale=1e-4)


def test_fp8_eligibility_and_default_out():
    (q, qd, _), (k, kd, _), (v, vd, _) = (quantised((1, 200, 4, 128), 21 + i) for i in range(3))
    assert attention.prefill_eligibility(q, k, v) is None
    got = attention.prefill(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 200, 4, 128) and not got.isnan().any()


@pytest.mark.parametrize("overlap, pingpong", [(True, True), (True, False), (False, False)])
def test_fp8_plan_variants(overlap, pingpong):
    """The non-default overlap variants (the benchmark's --prefill-variants) on tails, GQA and causal."""
    from nvfly.ops.attention.prefill_api import plan_options
    (q, qd, qf), (k, kd, kf), (v, vd, vf) = (quantised((2, s, h, 128), 31 + i)
                                             for i, (s, h) in enumerate(((333, 6), (301, 2), (301, 2))))
    with plan_options(overlap=overlap, pingpong=pingpong):
        check(q, k, v, (qd, kd, vd), (qf, kf, vf), causal=True)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, causal, layout, options", [
    (2, 333, 385, 6, 2, False, "bhsd", {}),   # two whole 192-key blocks and a 1-key tail
    (1, 1000, 1000, 8, 2, False, "bshd", {}),
    (2, 129, 77, 4, 4, False, "bshd", {}),    # one partial block (V padded to 80 keys)
    (1, 200, 193, 4, 1, False, "bshd", dict(pingpong=False)),  # MQA, serial
    (2, 301, 577, 6, 3, True, "bshd", {}),    # causal: the diagonal crosses 192-key blocks
    (1, 577, 301, 4, 2, True, "bhsd", dict(tree_max=False)),  # early rows see no key; the chained maxima
    (2, 333, 385, 6, 2, True, "bshd", dict(wide=False, tree_max=True)),  # the tree at 128 keys
    (2, 333, 385, 6, 2, False, "bshd", dict(poly_exp2=2)),  # 2 of 16 exp2 by the polynomial
    (1, 577, 301, 4, 2, True, "bshd", dict(poly_exp2=4)),  # rows with no key: -inf through the polynomial
    (2, 129, 77, 4, 4, True, "bhsd", dict(wide=False, poly_exp2=1)),
])
def test_fp8_wide_key_blocks(batch, sq, skv, hq, hkv, causal, layout, options):
    """D 128 with 192-key blocks (``plan_options(wide=True)``, the benchmark's wide variants; the row maxima by a
    tree with them unless ``tree_max=False``): Vᵀ's three 64-byte swizzled boxes a stage, Sq and Skv not multiples
    of the blocks, GQA/MQA, causal; the tree alone at 128 keys; exp2 partly by the polynomial."""
    from nvfly.ops.attention.prefill_api import plan_options
    seed = 7 * sq + skv
    (q, qd, qf), (k, kd, kf), (v, vd, vf) = (quantised((batch, s, h, 128), seed + i, layout)
                                             for i, (s, h) in enumerate(((sq, hq), (skv, hkv), (skv, hkv))))
    with plan_options(**{"wide": True, **options}):
        check(q, k, v, (qd, kd, vd), (qf, kf, vf), causal=causal)


def assert_graph_replays_a_new_query(quantise, batch, seed, new_query):
    """One fp8 call (V's transpose, the descales read in the kernel) on (batch, 300, 4 / 2 / 2 heads, 128) q, k, v
    from ``quantise(shape, seed)`` captured in a CUDA graph, ``new_query`` (q, its descales, dequantised) copied
    into the captured tensors, the graph replayed: the new inputs' reference."""
    (q, qd, _), (k, kd, kf), (v, vd, vf) = (quantise((batch, 300, h, 128), seed + i) for i, h in enumerate((4, 2, 2)))
    out = torch.empty(batch, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
    attention.prefill(q, k, v, causal=True, out=out, q_descale=qd, k_descale=kd, v_descale=vd)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.prefill(q, k, v, causal=True, out=out, q_descale=qd, k_descale=kd, v_descale=vd)
    new_q, new_qd, new_qf = new_query
    q.copy_(new_q)
    qd.copy_(new_qd)
    out.fill_(float("nan"))
    graph.replay()
    want, _ = attention.prefill_reference(new_qf, kf, vf, causal=True)
    assert not out.isnan().any()
    assert ((out.float() - want).norm() / want.norm()).item() < TOL


def test_fp8_cuda_graph_replays_with_new_inputs():
    """A captured per-tensor call replayed on new values and descales (the new q twice as large)."""
    assert_graph_replays_a_new_query(quantised, 1, 41, quantised((1, 300, 4, 128), 51, amplitude=2.0))


@pytest.mark.parametrize("batch, skv, hkv, d, layout", [
    (2, 1000, 3, 128, "bshd"),
    (2, 1000, 3, 128, "bhsd"),
    (1, 4099, 2, 64, "bhsd"),
    (3, 77, 2, 256, "bshd"),
    (1, 1, 1, 128, "bshd"),      # one key: 15 zeros
    (2, 301, 2, 128, "packed"),  # v = kv[:, :, 1] of a (B, S, 2, H, D) tensor
])
def test_fp8_values_transpose_kernel_is_the_torch_copy(batch, skv, hkv, d, layout):
    """V's transpose kernel, bit-equal to the torch strided copy on random bytes (every e4m3 code, NaNs included),
    into a poisoned output (launched directly) and through ``transposed_values``."""
    from nvfly.ops.attention import prefill_api
    gen = torch.Generator(device="cuda").manual_seed(skv + d)
    shape = {"bshd": (batch, skv, hkv, d), "bhsd": (batch, hkv, skv, d), "packed": (batch, skv, 2, hkv, d)}[layout]
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
    raw = raw.transpose(1, 2) if layout == "bhsd" else raw[:, :, 1] if layout == "packed" else raw
    v = raw.view(FP8)
    want = prefill_api.transposed_values_torch(v).view(torch.uint8)
    call = prefill_api._transpose_call(v)
    assert isinstance(call, prefill_api._TransposeCall) and call.keys == want.shape[3]
    out = torch.full_like(want, 0x7F)  # e4m3 NaN
    call.launch.launch(raw, out, *call.scalars.values)
    assert torch.equal(out, want)
    got = prefill_api.transposed_values(v)
    assert got.dtype == FP8 and got.is_contiguous() and torch.equal(got.view(torch.uint8), want)


@pytest.mark.parametrize("batch, sq, skv, hq, hkv, d, causal, alignment, layout, layouts", [
    (2, 333, 385, 8, 2, 128, True, "bottom_right", "bshd", ("bh", "bh", "bh")),    # GQA, all (B, Hkv)
    (2, 256, 256, 4, 4, 128, False, "bottom_right", "bhsd", ("h", "h", "h")),      # all (Hkv,)
    (3, 77, 301, 6, 2, 64, True, "top_left", "bshd", ("bh", "tensor", "h")),       # mixed with per tensor
    (2, 301, 77, 6, 3, 256, True, "bottom_right", "bshd", ("h", "bh", "number")),  # early rows see no key
    (3, 200, 129, 4, 1, 128, False, "bottom_right", "bhsd", ("bh", None, "bh")),   # MQA: per sequence only
    (1, 1000, 1000, 8, 2, 128, True, "bottom_right", "bshd", ("tensor", "bh", "tensor")),
    (2, 129, 1, 4, 2, 64, False, "bottom_right", "bshd", ("bh", "bh", "h")),       # one key
])
def test_fp8_per_head_descales(batch, sq, skv, hq, hkv, d, causal, alignment, layout, layouts):
    """Per-head descales ((B, Hkv) "bh", (Hkv,) "h") alone and mixed with per-tensor ones (a one-element tensor,
    a number, None) on inputs quantised so, against the float32 reference of the dequantised inputs, LSE too."""
    seed = 3 * sq + skv + d
    given, reference = [], []
    for i, (s, h, kind) in enumerate(((sq, hq, layouts[0]), (skv, hkv, layouts[1]), (skv, hkv, layouts[2]))):
        if kind in ("bh", "h"):
            x, descale, dequantised = quantised_per_head((batch, s, h, d), hkv, seed + i, layout, kind == "bh")
        elif kind is None:  # e4m3 values of N(0, 1), in range as they are
            _, _, dequantised = quantised((batch, s, h, d), seed + i, layout)
            x, descale = dequantised.to(FP8), None
            dequantised = x.float()
        else:
            x, descale, dequantised = quantised((batch, s, h, d), seed + i, layout)
            descale = descale.item() if kind == "number" else descale
        given.append((x, descale))
        reference.append(dequantised)
    (q, qd), (k, kd), (v, vd) = given
    check(q, k, v, (qd, kd, vd), reference, causal=causal, causal_alignment=alignment)


def test_fp8_per_head_descales_strided_wide_and_the_reference():
    """A (B, Hkv) descale that is a transposed view (strides (1, B)), under the 192-key ``wide`` plan and the
    overlap; ``prefill_reference`` given the e4m3 inputs and the same descales agrees with the dequantised ones."""
    from nvfly.ops.attention.prefill_api import plan_options
    (q, qd, qf), (k, kd, kf), (v, vd, vf) = (quantised_per_head((2, s, h, 128), 2, 61 + i)
                                             for i, (s, h) in enumerate(((333, 6), (385, 2), (385, 2))))
    strided = qd.t().contiguous().t()
    assert strided.stride() == (1, 2) and torch.equal(strided, qd)
    for options in (dict(wide=True), dict(overlap=True, pingpong=False)):
        with plan_options(**options):
            check(q, k, v, (strided, kd, vd), (qf, kf, vf), causal=True)
    want, want_lse = attention.prefill_reference(qf, kf, vf, causal=True)
    got, got_lse = attention.prefill_reference(q, k, v, causal=True, q_descale=strided, k_descale=kd, v_descale=vd)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def test_fp8_per_head_descales_cuda_graph_replays_with_new_descales():
    """A captured per-head call replayed after new inputs and (B, Hkv) descales are copied into the same tensors."""
    assert_graph_replays_a_new_query(lambda shape, seed: quantised_per_head(shape, 2, seed), 2, 71,
                                     quantised_per_head((2, 300, 4, 128), 2, 81))
