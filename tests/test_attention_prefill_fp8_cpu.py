"""FP8 (e4m3) prefill attention without a GPU: the fp8 plans compile for sm_90a to QGMMA (register-A e4m3 P for
P·V) without spills or ptxas warnings, the transposed V that the host builds puts each key where P's fp8 register
fragment puts its score (a lane-by-lane model of the fragments gives P·V exactly), per-head descales ((B, Hkv) and
(Hkv,), ``PrefillPlan.per_head_descales``) compile, are modelled against the reference and reach the kernel as
(B, Hkv) views, and bad fp8 arguments raise errors naming them."""
import dataclasses
import re
import struct

import pytest
import torch

import nvfly
from nvfly.arch import sm90
from nvfly.ops import attention
from nvfly.ops.attention import prefill_api
from nvfly.ops.attention.prefill_plan import (CONSUMER_REGS, FP8_HEAD_DIMS, FP8_WIDE_BLOCK_N, MAX_SMEM,
                                              PRODUCER_REGS, PrefillPlan, prefill_plan)
from tests.test_attention_prefill_cpu import _cpu_prefill

FP8 = torch.float8_e4m3fn


def qgmma_count(sass, shape, a_from_registers):
    """QGMMA (e4m3 x e4m3, f32 accumulator) instructions of ``shape`` whose A is a register or a descriptor."""
    a_operand = r"R\d+, " if a_from_registers else ""
    return len(re.findall(rf"QGMMA\.{shape}\.F32\.E4M3\.E4M3 R\d+, {a_operand}gdesc\[", sass))


@pytest.mark.parametrize("dqk, causal, window, wide, tree_max, poly", [
    (128, False, False, False, None, 0), (128, True, False, False, None, 0), (128, False, False, True, None, 0),
    (128, False, False, True, None, 2),
    pytest.param(128, False, False, True, None, 4, marks=pytest.mark.slow),
    pytest.param(128, True, False, False, None, 1, marks=pytest.mark.slow),
    pytest.param(128, False, False, False, True, 0, marks=pytest.mark.slow),
    pytest.param(128, False, False, True, False, 0, marks=pytest.mark.slow),
    pytest.param(128, True, False, True, None, 0, marks=pytest.mark.slow),
    pytest.param(128, True, True, False, None, 0, marks=pytest.mark.slow),
    pytest.param(64, True, False, False, None, 0, marks=pytest.mark.slow),
    pytest.param(256, False, False, False, None, 0, marks=pytest.mark.slow)])
def test_fp8_plans_compile_to_qgmma_without_spills(dqk, causal, window, wide, tree_max, poly):
    """``wide``: 192-key blocks (S 64 x 192, six P·V k-steps a block; Vᵀ's 192-byte rows in three 64-byte
    swizzled boxes while Q and K keep 128-byte rows), with the row maxima by a tree unless ``tree_max`` False;
    ``poly``: that many exp2 of every 16 by the polynomial (MUFU.EX2 fewer by as many)."""
    plan = prefill_plan(dqk, dqk, causal, window, fp8=True, wide=wide, tree_max=tree_max, poly_exp2=poly)
    assert plan.tree_max == (wide if tree_max is None else tree_max) and plan.poly_exp2 == poly
    assert (dqk, dqk) in FP8_HEAD_DIMS and plan.block_n == (FP8_WIDE_BLOCK_N if wide else 128) and plan.itemsize == 1
    assert plan.swizzle == (64 if dqk == 64 else 128) and plan.v_swizzle == (64 if wide or dqk == 64 else 128)
    kernel = attention.compile_prefill(plan)
    sass = kernel.sass()
    traces = 2 + window  # the unmasked and the masked loops (a window's left edge: one more)
    s_steps, pv_steps = dqk // 32, plan.block_n // 32
    assert qgmma_count(sass, f"64x{plan.block_n}x32", a_from_registers=False) == traces * s_steps
    assert qgmma_count(sass, f"64x{dqk}x32", a_from_registers=True) == traces * pv_steps
    assert "HGMMA" not in sass and sass.count("QGMMA") == traces * (s_steps + pv_steps)
    assert "LDL" not in sass and "STL" not in sass and not kernel.warnings
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < CONSUMER_REGS
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {PRODUCER_REGS:#x} ;", sass)
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {CONSUMER_REGS:#x} ;", sass)
    # P rounded to e4m3 by saturating pair conversions (4 bytes of A a register, 2 a conversion)
    assert kernel.sass_opcodes()["F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"] == traces * plan.block_n // 4
    if dqk == 128 and not window:  # a thread's block_n / 2 scores, each row's O rescale: 2 a block
        scores = plan.block_n // 2
        assert kernel.sass_opcodes()["MUFU.EX2"] == traces * (scores - scores * poly // 16 + 2)
    assert plan.smem_bytes(plan.itemsize) <= MAX_SMEM


@pytest.mark.slow
@pytest.mark.parametrize("overlap, pingpong, wide", [(True, True, False), (True, False, False), (False, False, False),
                                                     (True, True, True), (False, False, True)])
def test_fp8_overlap_variants_compile_without_spills(overlap, pingpong, wide):
    """The benchmark's --prefill-variants of the D 128 causal fp8 plan: the overlap's pipeline adds its first S and
    last P·V (with 192-key blocks too: the overlap's second S tile is 96 more registers)."""
    plan = prefill_plan(128, 128, True, overlap=overlap, pingpong=pingpong, fp8=True, wide=wide)
    kernel = attention.compile_prefill(plan)
    sass = kernel.sass()
    steps = 4 + plan.block_n // 32  # S's k-steps (D 128) and P·V's
    assert sass.count("QGMMA") == (3 if overlap else 2) * steps and "HGMMA" not in sass and not kernel.warnings
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < CONSUMER_REGS


@pytest.mark.parametrize("dqk, causal, strides, options", [
    (128, True, (None, None, None), {}), (64, False, ((0, 0), (0, 1), None), {}),
    (256, True, (None, (0, 0), (0, 1)), {}),
    pytest.param(128, False, ((1, 2), None, (0, 0)), dict(wide=True), marks=pytest.mark.slow),
    pytest.param(128, True, (None, None, None), dict(overlap=True, pingpong=False), marks=pytest.mark.slow),
    pytest.param(64, True, (None, None, None), {}, marks=pytest.mark.slow),
    pytest.param(256, False, (None, None, None), {}, marks=pytest.mark.slow)])
def test_fp8_per_head_descale_plans_compile_without_spills(dqk, causal, strides, options):
    """``per_head_descales``: the descales (B, Hkv) tensors (contiguous, a transposed view's strides (1, B), a
    per-tensor factor's (0, 0)-strided view or a (Hkv,) one's (0, 1)) read at the CTA's [batch, head // group]
    (GQA: 4 query heads on 2 KV heads): the same QGMMAs as the per-tensor plan, three descale loads a thread (once
    per consumer), no spills; the wide and overlap variants too."""
    plan = prefill_plan(dqk, dqk, causal, fp8=True, per_head_descales=True, **options)
    per_tensor_plan = prefill_plan(dqk, dqk, causal, fp8=True, **options)
    assert plan == dataclasses.replace(per_tensor_plan, per_head_descales=True)
    kernel = attention.compile_prefill(plan, heads=4, kv_heads=2, descale_strides=strides)
    per_tensor = attention.compile_prefill(per_tensor_plan, heads=4, kv_heads=2)
    sass = kernel.sass()
    assert sass.count("QGMMA") == per_tensor.sass().count("QGMMA") and "HGMMA" not in sass
    assert kernel.ptx.count("ld.global") == per_tensor.ptx.count("ld.global") == 3
    assert kernel.ptx != per_tensor.ptx
    assert "LDL" not in sass and "STL" not in sass and not kernel.warnings
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) < CONSUMER_REGS


def test_fp8_plan_rejects_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match="per_head_descales is an fp8 prefill plan's option"):
        PrefillPlan(128, 128, False, per_head_descales=True)
    with pytest.raises(ValueError, match="multiple of 32 keys"):
        PrefillPlan(256, 256, False, block_n=80, fp8=True)
    with pytest.raises(ValueError, match="no packed sequences"):
        PrefillPlan(128, 128, False, varlen=True, fp8=True)
    assert prefill_plan(128, 128, False) == PrefillPlan(128, 128, False, pingpong=True, hoist=True,
                                                        prefetch_mask=True)  # bf16 plans unchanged by fp8's
    # wide: fp8 D 128 (192 keys), bf16 D 64 and 128 (192, 176; prefill_plan.WIDE_BLOCK_N)
    assert prefill_plan(96, 96, False, wide=True) == prefill_plan(96, 96, False)
    assert prefill_plan(128, 128, False, wide=True).block_n == 176
    assert prefill_plan(64, 64, False, fp8=True, wide=True) == prefill_plan(64, 64, False, fp8=True)
    assert prefill_plan(128, 128, False, fp8=True, wide=True).tree_max  # the tree with the wide blocks by default
    assert not prefill_plan(128, 128, False, fp8=True).tree_max
    assert not prefill_plan(128, 128, False, tree_max=True).tree_max  # fp8 only
    assert PrefillPlan(128, 128, False, block_n=160, fp8=True).v_swizzle == 32  # five 32-key boxes
    assert PrefillPlan(128, 128, False, block_n=192).v_swizzle == 128  # bf16's V is MN-major: the plan's swizzle


def test_exp2_polynomial_model_is_within_e4m3s_rounding():
    """``softmax.exp2_polynomial``'s arithmetic, step by step in float32 and int32 as the kernel does it (clamp,
    magic-number rounding, polynomial, exponent bits added): relative error < 1.8e-3 of 2^x from 0 down to the
    clamp, never negative or NaN (at most 1.0005: P's e4m3 rounds it to 1), and -inf gives a value that e4m3
    rounds to 0."""
    from nvfly.ops.attention.softmax import EXP2_POLYNOMIAL, ROUND_MAGIC, exp2_polynomial, polynomial_slots
    assert exp2_polynomial.__doc__ and polynomial_slots(2) == {7, 15} and polynomial_slots(4) == {3, 7, 11, 15}
    assert polynomial_slots(1) == {15} and polynomial_slots(0) == frozenset() and len(polynomial_slots(8)) == 8
    x = torch.cat([torch.linspace(-126, 0, 200001), -torch.rand(10000) * 1e-3, torch.tensor([-1e4, -float("inf")])])
    x = torch.maximum(x.float(), torch.tensor(-126.0))
    rounded = x + ROUND_MAGIC
    f = x - (rounded - ROUND_MAGIC)
    c0, c1, c2 = (torch.tensor(c, dtype=torch.float32) for c in EXP2_POLYNOMIAL)
    p = (f * c2 + c1) * f + c0
    got = (p.view(torch.int32) + (rounded.view(torch.int32) << 23)).view(torch.float32)
    want = torch.exp2(x.double())
    assert f.abs().max() <= 0.5 and (got >= 0).all() and (got <= 1.0005).all() and got.isfinite().all()
    rel = ((got.double() - want) / want).abs()
    assert rel.max() < 1.8e-3
    assert got[-1].to(FP8).float() == 0 and got[-1] < 2 ** -125


def a_operand(s, atom):
    """The 64 x N matrix the register-A wgmma reads when the fragments come from accumulator ``s`` (64 x N), built
    lane by lane from the PTX ISA's fragment maps (module doc of ``sm90.wgmma``): accumulator element 4j + 2h + e
    of thread t is row 16w + l/4 + 8h, column 8j + 2(l%4) + e; 8-bit A register r byte b of k-step ks is row
    16w + l/4 + 8(r%2), column 32ks + 16(r/2) + 4(l%4) + b."""
    a = torch.full_like(s, float("nan"))
    for t in range(128):
        w, l = t // 32, t % 32
        for ks in range(s.shape[1] // atom.k):
            for r, elements in enumerate(sm90.a_fragment_elements(atom, ks)):
                for b, e in enumerate(elements):
                    j, h, low = e // 4, (e // 2) % 2, e % 2
                    value = s[16 * w + l // 4 + 8 * h, 8 * j + 2 * (l % 4) + low]
                    a[16 * w + l // 4 + 8 * (r % 2), atom.k * ks + 16 * (r // 2) + 4 * (l % 4) + b] = value
    return a


@pytest.mark.parametrize("block_n", [128, FP8_WIDE_BLOCK_N])
def test_transposed_values_match_the_fp8_p_fragments(block_n):
    """P·V through the kernel's operands, modelled: P's fp8 A fragments built from S's accumulator registers, times
    the K-major B tile that ``transposed_values`` gives for V's key block, is P·V of the untransposed V (exactly, on
    small integers), for every key block of ``block_n`` keys; column c holds key 16(c/16) + order[c%16], zeros past
    Skv."""
    torch.manual_seed(0)
    skv, dv = 300, 64
    v = torch.randint(-8, 9, (2, skv, 3, dv)).to(FP8)
    vt = prefill_api.transposed_values(v)
    assert vt.shape == (2, dv, 3, 304) and vt.is_contiguous() and vt.dtype == FP8
    order = sm90.register_a_k_order(sm90.WgmmaAtom(16, nvfly.f8e4m3, nvfly.f8e4m3, a_source="registers"))
    for column in range(304):
        key = column // 16 * 16 + order[column % 16]
        expected = v[:, key].float() if key < skv else torch.zeros(2, 3, dv)
        assert torch.equal(vt[:, :, :, column].float(), expected.transpose(1, 2))
    strided = v.transpose(1, 2).contiguous().transpose(1, 2)  # a (B, H, S, D) view
    assert torch.equal(prefill_api.transposed_values(strided).view(torch.uint8), vt.view(torch.uint8))
    atom = sm90.WgmmaAtom(dv, nvfly.f8e4m3, nvfly.f8e4m3, "K", "K", a_source="registers")
    for block in range(0, 304, block_n):
        keys = min(block_n, 304 - block) // 32 * 32
        if not keys:
            continue
        s = torch.randint(-4, 5, (64, keys)).float()  # S of the block (P in the kernel)
        values = torch.cat([v.float(), torch.zeros(2, 4, 3, dv)], dim=1)[1, block:block + keys, 2]  # (keys, Dv)
        b_tile = vt[1, :, 2, block:block + keys].float()  # (Dv, keys): row n, K-major along keys
        got = a_operand(s, atom) @ b_tile.T
        assert torch.equal(got, s @ values)


@pytest.mark.parametrize("causal, alignment, block_n", [(False, "bottom_right", 128), (True, "bottom_right", 128),
                                                       (True, "top_left", 128), (False, "bottom_right", 192)])
def test_fp8_blocked_model_is_within_the_gpu_tolerance(causal, alignment, block_n):
    """The kernel's algorithm (``blocked_model``: 128-key blocks, exp2 with the scale folded, P rounded to e4m3 before
    P·V, sums of the float32 P) on e4m3 inputs, descales folded as the kernel does (q·k's into the scale, v's into
    out), against the float32 reference of the dequantised inputs: within the GPU tests' 6 % (about 2.5 % here),
    the LSE within 1e-3."""
    from tests.gpu.test_attention_prefill_fp8_gpu import TOL
    from tests.test_attention_prefill_cpu import blocked_model
    torch.manual_seed(1)
    quantised = []
    for shape in ((1, 200, 2, 64), (1, 300, 1, 64), (1, 300, 1, 64)):
        x = torch.randn(shape)  # scores about N(0, 1): a flat softmax, P of every size
        descale = x.abs().amax() / 448
        quantised.append(((x / descale).to(FP8), float(descale)))
    (q, qd), (k, kd), (v, vd) = quantised
    scale = 64 ** -0.5
    out, lse = blocked_model(q, k, v, causal, scale * qd * kd, alignment, bm=64, bn=block_n)
    want, want_lse = attention.prefill_reference(q.float() * qd, k.float() * kd, v.float() * vd, causal=causal,
                                                 scale=scale, causal_alignment=alignment)
    err = ((out * vd - want).norm() / want.norm()).item()
    assert 1e-2 < err < TOL  # e4m3 P's rounding shows, within the bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-3, rtol=1e-4)


def test_fp8_per_head_descales_model_is_within_the_gpu_tolerance():
    """Per-head descales as the kernel reads them: ``_descale_tensors``' (B, Hkv) views ((B, Hkv), (Hkv,) and a
    number: per head as soon as one is) at [batch, head // group] folded per CTA (``blocked_model`` of each (batch,
    query head) with its q·k factors in the scale and its v factor on out), against the float32 reference of the
    same descales (``prefill_reference``'s dequantisation, GQA 6 query heads on 2 KV heads); heads of amplitudes
    1/8 to 8, so that per-head factors matter."""
    from tests.gpu.test_attention_prefill_fp8_gpu import TOL
    from tests.test_attention_prefill_cpu import blocked_model
    torch.manual_seed(2)
    batch, hq, hkv, d = 2, 6, 2, 64
    group = hq // hkv
    amplitudes = 2.0 ** torch.randint(-3, 4, (batch, hkv))
    x = [torch.randn(batch, s, h, d) * amplitudes.repeat_interleave(h // hkv, 1)[:, None, :, None]
         for s, h in ((150, hq), (200, hkv), (200, hkv))]
    q_descale = x[0].abs().unflatten(2, (hkv, group)).amax(dim=(1, 3, 4)) / 448  # (B, Hkv): a group's q heads
    k_descale = x[1].abs().amax(dim=(0, 1, 3)) / 448  # (Hkv,): every sequence
    v_descale = float(x[2].abs().amax() / 448)  # per tensor
    q = (x[0] / q_descale.repeat_interleave(group, 1)[:, None, :, None]).to(FP8)
    k = (x[1] / k_descale[:, None]).to(FP8)
    v = (x[2] / v_descale).to(FP8)
    factors, per_head = prefill_api._descale_tensors((q_descale, k_descale, v_descale), batch, hkv, "cpu")
    assert per_head and all(f.shape == (batch, hkv) for f in factors)
    assert [f.stride() for f in factors] == [(hkv, 1), (0, 1), (0, 0)]
    assert factors[0].data_ptr() == q_descale.data_ptr() and factors[1].data_ptr() == k_descale.data_ptr()
    scale = d ** -0.5
    out = torch.zeros(batch, 150, hq, d)
    lse = torch.zeros(batch, hq, 150)
    for b in range(batch):
        for head in range(hq):
            qd, kd, vd = (f[b, head // group].item() for f in factors)
            o, l = blocked_model(q[b:b + 1, :, head:head + 1], k[b:b + 1, :, head // group:head // group + 1],
                                 v[b:b + 1, :, head // group:head // group + 1], True, scale * qd * kd,
                                 "bottom_right", bm=64, bn=128)
            out[b, :, head], lse[b, head] = o[0, :, 0] * vd, l[0, 0]
    want, want_lse = attention.prefill_reference(q, k, v, causal=True, scale=scale, q_descale=q_descale,
                                                 k_descale=k_descale, v_descale=v_descale)
    err = ((out - want).norm() / want.norm()).item()
    assert 3e-3 < err < TOL  # e4m3 P's rounding shows (less than on flat rows: the amplitudes sharpen the softmax)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-3, rtol=1e-4)
    swapped, _ = attention.prefill_reference(q, k, v, causal=True, scale=scale, q_descale=q_descale.flip(1),
                                             k_descale=k_descale, v_descale=v_descale)
    assert ((swapped - want).norm() / want.norm()).item() > 5 * TOL  # a KV head's factors on the wrong heads


def test_fp8_reference_dequantises_by_the_descales():
    """``prefill_reference``'s descales (number, one-element, (Hkv,), (B, Hkv) tensors) equal dequantising by hand
    (q's factor of a KV head on its group's query heads), padded and packed (B the sequences)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, s, h, 64).to(FP8) for s, h in ((20, 4), (30, 2), (30, 2)))
    q_descale, k_descale, v_descale = torch.rand(2, 2) + 0.5, torch.rand(2) + 0.5, torch.full((1,), 0.25)
    want = attention.prefill_reference(q.float() * q_descale.repeat_interleave(2, 1)[:, None, :, None],
                                       k.float() * k_descale[:, None], v.float() * 0.25, causal=True)
    for given in (v_descale, 0.25, v_descale.reshape(())):
        got = attention.prefill_reference(q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale,
                                          v_descale=given)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    cu_q, cu_k = torch.tensor([0, 20, 40], dtype=torch.int32), torch.tensor([0, 30, 60], dtype=torch.int32)
    packed, packed_lse = attention.prefill_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), causal=True,
                                                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_descale=q_descale,
                                                     k_descale=k_descale, v_descale=0.25)
    torch.testing.assert_close(packed, want[0].flatten(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(packed_lse, want[1].permute(1, 0, 2).flatten(1, 2), rtol=1e-6, atol=1e-6)


def test_fp8_descale_tensors_per_tensor_stay_one_element():
    """No per-head descale: one-element tensors (a (1, 1) or () tensor reshaped, a number made one), the per-tensor
    plan; a (B, Hkv) descale of one element (B = Hkv = 1) is per tensor too."""
    one = torch.full((1, 1), 2.0)
    tensors, per_head = prefill_api._descale_tensors((one, 3.0, None), 2, 2, "cpu")
    assert not per_head and tensors[2] is None and [t.shape for t in tensors[:2]] == [(1,), (1,)]
    assert tensors[0].data_ptr() == one.data_ptr() and tensors[1].item() == 3.0
    assert not prefill_api._descale_tensors((torch.ones(1, 1), None, torch.ones(())), 1, 1, "cpu")[1]


def _inputs(b=1, sq=8, skv=8, hq=4, hkv=2, d=128, dtype=FP8):
    return tuple(torch.zeros(b, s, h, d, dtype=dtype) for s, h in ((sq, hq), (skv, hkv), (skv, hkv)))


ONE = torch.ones(1)


@pytest.mark.parametrize("change, kwargs, argument, kind, message", [
    (lambda q, k, v: (q, k.bfloat16(), v), {}, "k", TypeError, "differs from q's"),
    (lambda q, k, v: (q.bfloat16(), k.bfloat16(), v.bfloat16()), {"q_descale": ONE}, "q_descale", TypeError,
     "only for float8_e4m3fn"),
    (lambda q, k, v: (q[..., :96], k[..., :96], v[..., :96]), {}, "q", ValueError, "head dim 96 is not supported"),
    (lambda q, k, v: (q, k, v), {"k_descale": torch.ones(3)}, "k_descale", ValueError,
     "of one element (per tensor), (2,) (per KV head) or (1, 2) (per sequence and KV head), got (3,)"),
    (lambda q, k, v: (q, k, v), {"k_descale": torch.ones(2, 2)}, "k_descale", ValueError, "got (2, 2)"),
    (lambda q, k, v: (q, k, v), {"q_descale": torch.ones(1, 4)}, "q_descale", ValueError, "got (1, 4)"),  # Hq
    (lambda q, k, v: (q, k, v), {"v_descale": torch.ones(1, dtype=torch.float16)}, "v_descale", ValueError,
     "expected a float32 tensor on cpu"),
    (lambda q, k, v: (q, k, v), {"v_descale": torch.ones(1, 2, dtype=torch.float64)}, "v_descale", ValueError,
     "got (1, 2) torch.float64"),
    (lambda q, k, v: (q, k, v), {"q_descale": torch.ones(2, device="meta")}, "q_descale", ValueError,
     "on meta"),
    (lambda q, k, v: (q, k, v), {"q_descale": -1.0}, "q_descale", ValueError, "positive finite"),
    (lambda q, k, v: (q, k, v), {"score_mod": lambda s, b, h, i, j: s}, "score_mod", ValueError,
     "not supported with float8_e4m3fn"),
])
def test_fp8_argument_errors_name_the_argument(change, kwargs, argument, kind, message):
    q, k, v = change(*_inputs())
    with pytest.raises(kind, match=rf"^attention\.prefill: {argument}: .*{re.escape(message)}"):
        attention.prefill(q, k, v, **kwargs)


def test_fp8_eligibility_and_varlen():
    q, k, v = _inputs()
    assert attention.prefill_eligibility(q, k, v) == "q is on cpu, not CUDA"
    reason = attention.prefill_eligibility(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
    assert reason.startswith("attention.prefill: mask_mod: not supported with float8_e4m3fn")
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^attention\.prefill: q: float8_e4m3fn packed sequences"):
        attention.prefill_varlen(q[0], k[0], v[0], cu, cu)


def test_fp8_host_path_launches_with_transposed_v_and_descales(recorded_launches, monkeypatch):
    """prefill's fp8 host path on CPU tensors through the real binder: q and k passed as they are, V as its
    transposed copy (B, Dv, Hkv, Skv rounded up to 16), the descales as tensors (numbers made tensors), bf16 out."""
    from nvfly.runtime.tma import TmaDescriptor
    descriptors = []

    def descriptor(tensor, box, swizzle=128):
        desc = TmaDescriptor(tensor, box, swizzle)
        desc.raw = struct.pack("<Q", tensor.data_ptr()).ljust(128, b"\0")
        descriptors.append((tuple(tensor.shape), tensor.dtype, tuple(box), swizzle))
        return desc
    monkeypatch.setattr(prefill_api, "_require_cuda", lambda q, op: None)
    monkeypatch.setattr(prefill_api, "cached_descriptor", descriptor)
    q, k, v = _inputs(b=2, sq=300, skv=77, hq=6, hkv=2)
    q_descale, k_descale = torch.full((1,), 0.5), torch.full((1, 1), 2.0)
    out, lse = attention.prefill(q, k, v, causal=True, return_lse=True, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=3.0)
    assert out.shape == (2, 300, 6, 128) and out.dtype == torch.bfloat16 and lse.shape == (2, 6, 300)
    assert [(name, grid) for name, grid, _ in recorded_launches] == [("attention_prefill_kernel", (3, 6, 2))]
    box = (1, 128, 1, 128)
    assert descriptors == [((2, 300, 6, 128), FP8, box, 128), ((2, 77, 2, 128), FP8, box, 128),
                           ((2, 128, 2, 80), FP8, box, 128)]
    params = recorded_launches[0][2]
    assert out.data_ptr() in params and q_descale.data_ptr() in params and k_descale.data_ptr() in params
    packed = b"".join(p for p in params if isinstance(p, bytes))
    assert all(struct.pack("<Q", t.data_ptr()) in packed for t in (q, k))
    assert struct.pack("<Q", v.data_ptr()) not in packed  # the transposed copy instead
    descriptors.clear()
    with prefill_api.plan_options(wide=True):  # 192-key blocks: Vᵀ in 64-key boxes, 64-byte swizzled
        attention.prefill(q, k, v, q_descale=q_descale)
    assert descriptors == [((2, 300, 6, 128), FP8, box, 128), ((2, 77, 2, 128), FP8, (1, 192, 1, 128), 128),
                           ((2, 128, 2, 80), FP8, (1, 128, 1, 64), 64)]
    with pytest.raises(ValueError, match=r"^attention\.prefill: out: .*torch\.bfloat16 tensor"):
        attention.prefill(q, k, v, out=torch.zeros(2, 300, 6, 128, dtype=FP8))


def test_fp8_host_path_launches_per_head_descales(recorded_launches, monkeypatch):
    """Per-head descales through the real binder: a (B, Hkv) one, a (Hkv,) one and a number make the per-head plan
    with the three as (B, Hkv) views of the given tensors (strides (Hkv, 1), (0, 1), (0, 0)); one-element tensors and
    numbers alone keep the per-tensor plan."""
    launched = []
    launch = prefill_api._launch

    def spy(*args):  # prefill's positional call: the plan first, the descales 16th
        launched.append((args[0], args[15]))
        return launch(*args)
    _cpu_prefill(monkeypatch)
    monkeypatch.setattr(prefill_api, "_launch", spy)
    q, k, v = _inputs(b=2, sq=200, skv=77, hq=6, hkv=2)
    q_descale, k_descale = torch.rand(2, 2) + 0.5, torch.rand(2) + 0.5
    out, lse = attention.prefill(q, k, v, causal=True, return_lse=True, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=3.0)
    assert out.shape == (2, 200, 6, 128) and lse.shape == (2, 6, 200)
    plan, descales = launched[-1]
    assert plan == prefill_plan(128, 128, True, fp8=True, per_head_descales=True)
    assert [d.shape for d in descales] == [(2, 2)] * 3 and [d.stride() for d in descales] == [(2, 1), (0, 1), (0, 0)]
    assert descales[0].data_ptr() == q_descale.data_ptr() and descales[1].data_ptr() == k_descale.data_ptr()
    assert descales[2][1, 1].item() == 3.0
    params = recorded_launches[-1][2]
    assert q_descale.data_ptr() in params and k_descale.data_ptr() in params
    attention.prefill(q, k, v, v_descale=torch.rand(2, 2), k_descale=torch.ones(1))
    plan, descales = launched[-1]
    assert plan.per_head_descales and descales[0] is None and descales[1].stride() == (0, 0)
    attention.prefill(q, k, v, q_descale=torch.ones(1, 1), v_descale=2.0)
    plan, descales = launched[-1]
    assert not plan.per_head_descales and descales[1] is None and [d.shape for d in descales[::2]] == [(1,), (1,)]
    assert len(recorded_launches) == 3


def test_torch_prefill_op_declines_fp8():
    """torch.ops.nvfly.attention_prefill returns q's dtype and takes no descales: fp8 inputs are an error there."""
    import nvfly.torch  # noqa: F401 - registers the ops
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"nvfly\.attention_prefill: q: .*takes bfloat16 or float16"):
        torch.ops.nvfly.attention_prefill(q, k, v)
