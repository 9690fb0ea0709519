"""The warpgroup-MMA GQA decode kernel (``decode``'s ``wgmma`` plan option, ``gqa_kernel``) without a GPU: its
variants compile for sm_90a to the planned HGMMAs without spills or ptxas warnings within two CTAs an SM; the plan's
eligibility, split count and shared memory; decode's host path launches it (and the combine with splits) only
where asked and eligible, the decode kernel otherwise; the packed rows' (token, head) arithmetic; fp8 K/V plans
(``GqaPlan.fp8``): the same HGMMAs on f16 tiles converted in shared memory (the conversion's addresses against the
swizzled layouts), only under ``wgmma=True``, and the kernel's fp8 arithmetic (scales, f16 query) in a model."""
import collections
import math
import re
import struct

import pytest
import torch

from nvfly.ops import attention
from nvfly.ops.attention import api, gqa_api
from nvfly.ops.attention import gqa_plan as gqa_plans
from nvfly.ops.attention.gqa_plan import (BLOCK_M, CONSUMER_REGS, CTAS_PER_SM, FP8_STAGES, FP8_WIDE_STAGES,
                                          PRODUCER_REGS, THREADS, WIDE_CONSUMER_REGS, WIDE_STAGES, GqaPlan,
                                          gqa_declined, gqa_plan)
from nvfly.ops.attention.plan import SMEM_PER_SM, SMEM_RESERVED

D = 128


def hgmma(sass, shape, a_operand):
    return len(re.findall(rf"HGMMA\.{shape}\.F32(?:\.BF16)? {a_operand}", sass))


def compiled_without_spills(plan) -> tuple[list, str]:
    """``plan``'s kernels compiled: each consumer's S in 8 k-steps (64x64x16, both operands from shared memory) and
    P V in 4 (64x128x16, P from registers), once for the unmasked tiles' loop and once for the masked ones'; no
    local memory, no ptxas warnings. The kernels and the first's SASS."""
    kernels = gqa_api.compile_gqa(plan, seqlen=1024)
    kernel = kernels[0]
    sass = kernel.sass()
    assert hgmma(sass, "64x64x16", r"R\d+, gdesc\[") == 2 * 8
    assert hgmma(sass, "64x128x16", r"R\d+, R\d+, gdesc\[") == 2 * 4
    assert "LDL" not in sass and "STL" not in sass and not kernel.warnings
    assert kernel.resources.spill_stores == kernel.resources.spill_loads == kernel.resources.stack_bytes == 0
    return kernels, sass


@pytest.mark.parametrize("sq,group,paged,causal,splits", [(8, 8, False, True, 1), (8, 6, True, True, 1),
                                                          (16, 4, False, False, 3), (1, 64, False, True, 1)])
def test_variants_compile_to_hgmma_without_spills(sq, group, paged, causal, splits):
    """S's 8 k-steps (64x64x16, both operands from shared memory) and P V's 4 (64x128x16, P from registers), once
    for the unmasked tiles' loop and once for the masked ones'; no local memory; the registers rebalanced for two
    CTAs an SM."""
    plan = GqaPlan(sq, group, paged, 64 if paged else 0, causal, splits, pdl_combine=splits > 1)
    kernels, sass = compiled_without_spills(plan)
    kernel = kernels[0]
    assert kernel.resources.registers * THREADS * CTAS_PER_SM <= 65536
    assert kernel.dynamic_smem_bytes == plan.smem_bytes
    assert CTAS_PER_SM * (plan.smem_bytes + SMEM_RESERVED) <= SMEM_PER_SM
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {PRODUCER_REGS:#x} ;", sass)
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {CONSUMER_REGS:#x} ;", sass)
    assert len(kernels) == (2 if splits > 1 else 1)
    assert ("griddepcontrol.launch_dependents;" in kernel.ptx) == (splits > 1)
    assert splits == 1 or (kernels[1].dependent and kernels[1].ptx.count("griddepcontrol.wait;") == 1)


def test_fp16_compiles():
    kernel = gqa_api.compile_gqa(GqaPlan(8, 8, False, 0, True), dtype=__import__("nvfly").f16)[0]
    assert re.search(r"HGMMA\.64x128x16\.F32 R\d+, R\d+, gdesc\[", kernel.sass())
    assert not kernel.warnings and kernel.resources.spill_stores == 0


def test_declined_cases_name_the_reason():
    assert gqa_declined(8, 8, D, D, "torch.bfloat16") == ""
    assert gqa_declined(16, 4, D, D, "torch.float16", paged=True, page_size=128) == ""
    assert gqa_declined(8, 8, D, D, "torch.bfloat16", fp8=True) == ""
    assert gqa_declined(16, 8, D, D, "torch.bfloat16", fp8=True, wide=True) == ""
    assert "query rows" in gqa_declined(16, 8, D, D, "torch.bfloat16", fp8=True)
    assert "head dims" in gqa_declined(8, 8, 64, 64, "torch.bfloat16")
    assert "head dims" in gqa_declined(8, 8, 192, 128, "torch.bfloat16")
    assert "query rows" in gqa_declined(16, 8, D, D, "torch.bfloat16")
    assert "mods" in gqa_declined(8, 8, D, D, "torch.bfloat16", mods=True)
    assert "page size" in gqa_declined(8, 8, D, D, "torch.bfloat16", paged=True, page_size=16)
    assert "dtype" in gqa_declined(8, 8, D, D, "torch.float32")
    with pytest.raises(ValueError, match="query rows"):
        gqa_plan(1, 16, 8, 8, 1024, 132)


def test_plan_splits_grid_and_shared_memory():
    long = gqa_plan(1, 8, 8, 8, 32768, 132)  # 8 CTAs before splitting: split to fill the 264 slots
    assert 1 < long.splits and 8 * long.splits <= 2 * 264 and long.grid(1, 8) == (long.splits, 8, 1)
    wide = gqa_plan(16, 8, 8, 6, 32768, 132)
    assert wide.splits >= 1 and wide.rows == 48
    forced = gqa_plan(2, 8, 8, 8, 4096, 132, splits=3)  # the combine launched after it by default
    assert forced.splits == 3 and not forced.pdl_combine
    assert gqa_plan(2, 8, 8, 8, 4096, 132, splits=3, pdl_combine=True).pdl_combine
    assert not gqa_plan(2, 8, 8, 8, 4096, 132, splits=1, pdl_combine=True).pdl_combine
    assert CTAS_PER_SM * (long.smem_bytes + SMEM_RESERVED) <= SMEM_PER_SM
    with pytest.raises(ValueError, match="stages"):
        gqa_plan(1, 8, 8, 8, 1024, 132, stages=4)


def test_packed_rows_map_to_the_kv_heads_query_heads():
    """Row r of KV head hkv's tile is token r // G, head hkv * G + r % G: Q's TMA box (1, Sq, G, 64) at
    (b, 0, hkv * G, k) lays q's [b, :, hkv * G : (hkv + 1) * G] out token-major, exactly these rows."""
    sq, group, hkv_count = 8, 6, 8
    q = torch.arange(sq * hkv_count * group).view(1, sq, hkv_count * group)
    for hkv in range(hkv_count):
        box = q[0, :, hkv * group:(hkv + 1) * group].reshape(-1)  # the box's rows in shared memory order
        for r in range(sq * group):
            assert box[r] == q[0, r // group, hkv * group + r % group]
    assert sq * group <= BLOCK_M


@pytest.fixture
def cpu_launches(recorded_launches, monkeypatch):
    """decode's host path on CPU tensors through the real binder, TMA descriptors holding their tensor's address,
    on a 132-SM device."""
    from nvfly.runtime.tma import TmaDescriptor

    def descriptor(tensor, box, swizzle=128):
        desc = TmaDescriptor(tensor, box, swizzle)
        desc.raw = struct.pack("<Q", tensor.data_ptr()).ljust(128, b"\0")
        return desc
    monkeypatch.setattr(api, "_require_cuda", lambda q: None)
    monkeypatch.setattr(api, "_sm_count", lambda device: 132)
    monkeypatch.setattr(gqa_api, "cached_descriptor", descriptor)
    api._CALLS.clear()
    yield recorded_launches
    api._CALLS.clear()


def test_host_path_launches_the_wgmma_kernel_by_default_above_16_rows(cpu_launches):
    q = torch.zeros(2, 8, 48, D, dtype=torch.bfloat16)
    k = torch.zeros(2, 512, 8, D, dtype=torch.bfloat16)
    v = torch.zeros(2, 512, 8, D, dtype=torch.bfloat16)
    seqlens = torch.tensor([300, 0], dtype=torch.int32)
    out, lse = attention.decode(q, k, v, cache_seqlens=seqlens, splits=1, return_lse=True)
    assert out.shape == (2, 8, 48, D) and lse.shape == (2, 48, 8)
    assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_gqa_wgmma_kernel", (1, 8, 2))]
    params = cpu_launches[0][2]
    packed = b"".join(p for p in params if isinstance(p, bytes))
    assert all(struct.pack("<Q", t.data_ptr()) in packed for t in (q, k, v))
    assert all(t.data_ptr() in params for t in (seqlens, out, lse))
    for options in (api.DECODE_VARIANTS["mma_sync"], dict(stages=4), dict(warp_tiles=2), dict(pdl_combine=True)):
        cpu_launches.clear()  # wgmma=False, or another plan option: the decode kernel
        with api.plan_options(**options):
            attention.decode(q, k, v, cache_seqlens=seqlens, splits=1)
        assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel"], options


# (Sq, G) -> the kernel decode runs by default: the wgmma kernel at 16 < Sq x G <= 64, the decode kernel elsewhere
DEFAULT_KERNELS = {(1, 8): "decode", (2, 8): "decode", (4, 4): "decode", (16, 1): "decode", (3, 6): "wgmma",
                   (4, 6): "wgmma", (8, 4): "wgmma", (8, 8): "wgmma", (16, 4): "wgmma", (16, 6): "wgmma",
                   (16, 8): "wgmma", (16, 16): "decode"}  # past 64 rows on two consumers, up to 128


@pytest.mark.parametrize("sq,group", DEFAULT_KERNELS)
def test_default_kernel_of_each_shape(cpu_launches, sq, group):
    q = torch.zeros(1, sq, 2 * group, D, dtype=torch.bfloat16)
    k = torch.zeros(1, 256, 2, D, dtype=torch.bfloat16)
    attention.decode(q, k, k, splits=1)
    kernel = {"attention_gqa_wgmma_kernel": "wgmma", "attention_decode_kernel": "decode"}[cpu_launches[0][0]]
    assert kernel == DEFAULT_KERNELS[sq, group]
    cpu_launches.clear()
    with api.plan_options(wgmma=True):  # forced: wherever gqa_declined accepts
        attention.decode(q, k, k, splits=1)
    assert (cpu_launches[0][0] == "attention_gqa_wgmma_kernel") == (sq * group <= 64)


@pytest.mark.parametrize("heads_first", [False, True])
def test_bound_decode_takes_the_wgmma_kernel(cpu_launches, heads_first):
    """SDPA's and flex's bound launches: the wgmma kernel where decode's default takes it; heads-first tensors
    reach it as decode's layout (transposed views) on every call, since its TMA descriptors read shapes."""
    q = torch.randn(1, 8, 32, D, dtype=torch.bfloat16)
    k = torch.randn(1, 256, 4, D, dtype=torch.bfloat16)
    if heads_first:
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
    launch = attention.bound_decode(q, k, k, heads_first=heads_first)
    for _ in range(2):
        out = launch(q, k, k, None)
        assert out.shape == q.shape
    main = [params for name, _, params in cpu_launches if name != "attention_combine_kernel"]
    assert [name for name, _, _ in cpu_launches][::2] == ["attention_gqa_wgmma_kernel"] * 2 and len(main) == 2
    assert struct.pack("<Q", q.data_ptr()) in b"".join(p for p in main[1] if isinstance(p, bytes))


def test_host_path_splits_then_combines(cpu_launches):
    q = torch.zeros(1, 8, 64, D, dtype=torch.bfloat16)
    k = torch.zeros(1, 4096, 8, D, dtype=torch.bfloat16)
    table = torch.arange(32, dtype=torch.int32).view(1, 32)
    pages = torch.zeros(32, 128, 8, D, dtype=torch.bfloat16)
    attention.decode(q, k, k, splits=4)
    attention.decode(q, pages, pages, block_table=table, splits=4)
    names = [(name, grid[:3]) for name, grid, _ in cpu_launches]
    calls = [call for call in api._CALLS.values() if isinstance(call, gqa_api.GqaCall)]
    assert len(calls) == 2 and not any(call.plan.pdl_combine for call in calls)  # the combine after the split
    assert names[0] == ("attention_gqa_wgmma_kernel", (4, 8, 1)) and names[1][0] == "attention_combine_kernel"
    assert names[2] == ("attention_gqa_wgmma_kernel", (4, 8, 1)) and names[3][0] == "attention_combine_kernel"
    assert table.data_ptr() in cpu_launches[2][2]


@pytest.mark.parametrize("case", ["d64", "rows", "mods", "page16"])
def test_host_path_falls_back_where_declined(cpu_launches, case):
    d, sq, hq, page = {"d64": (64, 8, 64, 0), "rows": (D, 16, 64, 0), "mods": (D, 8, 64, 0),
                       "page16": (D, 8, 64, 16)}[case]
    q = torch.zeros(1, sq, hq, d, dtype=torch.bfloat16)
    mods = {"score_mod": lambda score, b, h, q_idx, kv_idx: score * 0.5} if case == "mods" else {}
    if page:
        k = torch.zeros(16, page, 8, d, dtype=torch.bfloat16)
        mods["block_table"] = torch.arange(16, dtype=torch.int32).view(1, 16)
    else:
        k = torch.zeros(1, 256, 8, d, dtype=torch.bfloat16)
    with api.plan_options(wgmma=True):
        attention.decode(q, k, k, splits=1, **mods)
    assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel"]


def test_v_is_read_mn_major_from_the_k_major_loaded_tile():
    """V's tile is loaded as K's (keys x 128 columns in two 64-column boxes); P V reads it MN-major: V's
    (column, key) element is the loaded tile's (key, column) one."""
    import nvfly
    from nvfly.ops.attention.gqa_kernel import layouts
    lay = layouts(nvfly.bf16)
    for key in range(64):
        for column in range(D):
            assert lay.v_layout.inner((column, key)) == lay.k_layout.inner((key, column))


def kernel_model(q, k, v, table, seqlens, causal, splits, group, k_scale=None, v_scale=None):
    """The kernel's arithmetic in float32 on CPU tensors: per (split, KV head, sequence) CTA the Q box's Sq x G rows
    (token r // G, head hkv * G + r % G), the split's 64-key tiles of K and V as the TMA loads read them (zero past
    the capacity; paged: the page from the table; NaN past the length left in), the mask only from
    ``unmasked_end`` on, V rows past the length zeroed there, the online softmax with P rounded to the input type;
    the partials at the combine's slots ((split * B + b) * Sq + token) * Hq + head, then the combine. fp8 plans
    (``k_scale``, ``v_scale`` per KV head): the query f16 times the softmax scale, K's and V's e4m3 values exact in
    f16, the scores times K's scale in log2 units, P rounded to f16, O times V's scale at the normalisation."""
    from nvfly.ops.attention.mla_plan import BLOCK_N, split_blocks, unmasked_end
    batch, sq, hq, _ = q.shape
    rows = sq * group
    fp8 = k_scale is not None
    p_dtype = torch.float16 if fp8 else q.dtype
    partial_o = torch.zeros(splits * batch * sq * hq, D)
    partial_lse = torch.full((splits * batch * sq * hq,), float("-inf"))
    for b in range(batch):
        seqlen = int(seqlens[b])
        middle = unmasked_end(seqlen, sq, causal)
        for hkv in range(hq // group):
            qt = q[b, :, hkv * group:(hkv + 1) * group].reshape(rows, D).float()
            scale_log2 = D ** -0.5 / math.log(2.0)
            if fp8:
                qt = (qt * D ** -0.5).half().float()
                scale_log2 = float(k_scale[hkv]) / math.log(2.0)
            packed = torch.arange(rows)
            positions = seqlen - sq + packed // group
            for split in range(splits):
                top = torch.full((rows,), float("-inf"))
                total = torch.zeros(rows)
                acc = torch.zeros(rows, D)
                for n in range(*split_blocks(seqlen, splits, split)):
                    keys = torch.arange(n * BLOCK_N, (n + 1) * BLOCK_N)
                    if table is None:
                        k_tile, v_tile = torch.zeros(BLOCK_N, D), torch.zeros(BLOCK_N, D)
                        inside = keys < k.shape[1]
                        k_tile[inside] = k[b, keys[inside], hkv].float()
                        v_tile[inside] = v[b, keys[inside], hkv].float()
                    else:
                        page, first = int(table[b, n * BLOCK_N // k.shape[1]]), n * BLOCK_N % k.shape[1]
                        k_tile = k[page, first:first + BLOCK_N, hkv].float()
                        v_tile = v[page, first:first + BLOCK_N, hkv].float()
                    s = qt @ k_tile.T
                    if n >= middle:
                        keep = (keys[None, :] < seqlen) & ((keys[None, :] <= positions[:, None]) if causal else True)
                        s = torch.where(keep, s, float("-inf"))
                        v_tile = torch.where((keys < seqlen)[:, None], v_tile, 0.0)
                    new_top = torch.maximum(top, s.max(dim=1).values)
                    shift = torch.where(new_top == float("-inf"), 0.0, new_top) if n >= middle else new_top
                    rescale = torch.exp2(top * scale_log2 - shift * scale_log2)
                    p = torch.exp2(s * scale_log2 - (shift * scale_log2)[:, None])
                    total = total * rescale + p.sum(dim=1)
                    acc = acc * rescale[:, None] + p.to(p_dtype).float() @ v_tile
                    top = new_top
                kept = total > 0
                slots = ((split * batch + b) * sq + packed // group) * hq + hkv * group + packed % group
                o_scale = float(v_scale[hkv]) if fp8 else 1.0
                partial_o[slots] = torch.where(kept[:, None], acc * o_scale / total.clamp_min(1e-30)[:, None], 0.0)
                partial_lse[slots] = torch.where(
                    kept, (top * scale_log2 + torch.log2(total.clamp_min(1e-30))) * math.log(2.0), float("-inf"))
    partial_o, partial_lse = partial_o.view(splits, -1, D), partial_lse.view(splits, -1)
    top = partial_lse.max(dim=0).values
    weights = torch.exp(partial_lse - torch.where(top == float("-inf"), 0.0, top))
    total = weights.sum(dim=0)
    out = (weights[..., None] * partial_o).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(total > 0, top + torch.log(total.clamp_min(1e-30)), float("-inf"))
    return out.view(batch, sq, hq, D), lse.view(batch, sq, hq).transpose(1, 2)


@pytest.mark.parametrize("sq, group, paged, causal, splits", [
    (8, 6, False, True, 1), (8, 8, True, True, 3), (4, 16, False, False, 2), (16, 4, True, True, 1),
    (16, 6, False, True, 1), (16, 8, True, True, 3), (8, 16, False, False, 2),  # two consumers' 96 and 128 rows
])
def test_kernel_model_matches_the_reference(sq, group, paged, causal, splits):
    """The kernel's row packing, tiling, masking and split slots reproduce the float32 reference on ragged lengths
    around tile edges (0, 1, 63, 64, 65, 200) with NaN in every cache row past a length."""
    gen = torch.Generator().manual_seed(sq * 100 + group)
    lengths = [0, 1, 63, 64, 65, 200]
    batch, hkv = len(lengths), 2
    q = torch.randn(batch, sq, hkv * group, D, generator=gen).bfloat16()
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if paged:
        k = torch.randn(batch * 4, 64, hkv, D, generator=gen).bfloat16()
        v = torch.randn(batch * 4, 64, hkv, D, generator=gen).bfloat16()
        table = torch.randperm(batch * 4, generator=gen).view(batch, 4).to(torch.int32)
        slots = torch.arange(4 * 64)
        for b, n in enumerate(lengths):
            k[table[b, slots[n:] // 64].long(), slots[n:] % 64] = float("nan")
            v[table[b, slots[n:] // 64].long(), slots[n:] % 64] = float("nan")
    else:
        k = torch.randn(batch, 230, hkv, D, generator=gen).bfloat16()
        v = torch.randn(batch, 230, hkv, D, generator=gen).bfloat16()
        table = None
        for b, n in enumerate(lengths):
            k[b, n:] = v[b, n:] = float("nan")
    got, got_lse = kernel_model(q, k, v, table, seqlens, causal, splits, group)
    want, want_lse = attention.reference(q, torch.nan_to_num(k), torch.nan_to_num(v), cache_seqlens=seqlens,
                                         block_table=table, causal=causal)
    assert not got.isnan().any()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(got_lse), empty) and empty.any()
    torch.testing.assert_close(got_lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("sq,group,paged,causal,splits", [(16, 8, False, True, 1), (16, 6, True, True, 3),
                                                          (8, 16, False, False, 1)])
def test_two_consumer_plans_compile_without_spills(sq, group, paged, causal, splits):
    """65-128 rows (``wide``): 384 threads, one CTA an SM (168 registers at launch, 40 + 2 x 232 after the
    setmaxnreg split), each consumer warpgroup the same 8 + 4 HGMMAs a tile, 5 stages in shared memory."""
    plan = gqa_plan(2, sq, 8, group, 4096, 132, paged, 64 if paged else 0, causal, splits, wide=True)
    assert plan.consumers == 2 and plan.threads == 384 and plan.ctas_per_sm == 1 and plan.stages == WIDE_STAGES
    kernels, sass = compiled_without_spills(plan)
    kernel = kernels[0]
    assert kernel.resources.registers * plan.threads <= 65536
    assert (PRODUCER_REGS + 2 * WIDE_CONSUMER_REGS) * 128 <= kernel.resources.registers * plan.threads
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {WIDE_CONSUMER_REGS:#x} ;", sass)
    assert kernel.dynamic_smem_bytes == plan.smem_bytes and plan.smem_bytes + SMEM_RESERVED <= SMEM_PER_SM
    assert len(kernels) == (2 if splits > 1 else 1)


def test_two_consumer_plans_only_when_asked():
    assert "query rows" in gqa_declined(16, 8, D, D, "torch.bfloat16")
    assert gqa_declined(16, 8, D, D, "torch.bfloat16", wide=True) == ""
    assert "two consumer" in gqa_declined(16, 16, D, D, "torch.bfloat16", wide=True)
    assert gqa_plan(2, 8, 8, 8, 4096, 132, wide=True).consumers == 1  # 64 rows: one consumer
    long = gqa_plan(1, 16, 8, 8, 32768, 132, wide=True)  # one CTA an SM: 132 slots to fill
    assert long.consumers == 2 and 8 * long.splits <= 2 * 132


def test_host_path_two_consumers_by_default_and_under_wgmma_wide(cpu_launches):
    q = torch.zeros(2, 16, 48, D, dtype=torch.bfloat16)  # Sq 16 at G 6: 96 rows
    k = torch.zeros(2, 512, 8, D, dtype=torch.bfloat16)
    for options in ({}, api.DECODE_VARIANTS["wgmma_wide"]):
        cpu_launches.clear()
        api._CALLS.clear()
        with api.plan_options(**options):
            attention.decode(q, k, k, splits=1)
        assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_gqa_wgmma_kernel", (1, 8, 2))]
        call = next(call for call in api._CALLS.values() if isinstance(call, gqa_api.GqaCall))
        assert call.plan.consumers == 2
    cpu_launches.clear()
    with api.plan_options(wgmma=False):  # the off switch: the decode kernel
        attention.decode(q, k, k, splits=1)
    assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel"]


def test_two_consumers_own_disjoint_64_row_blocks():
    """Consumer c's thread (warp w of its warpgroup, lane l) owns packed rows 64c + 16w + l // 4 (+ 8), and its
    accumulator columns 8j + 2(l % 4) (+ 1): together every row of 128 once, each by the four lanes of a quad."""
    owners = collections.Counter()
    for consumer in range(2):
        for warp in range(4):
            for lane in range(32):
                row0 = BLOCK_M * consumer + 16 * warp + lane // 4
                for row in (row0, row0 + 8):
                    owners[row] += 1
    assert sorted(owners) == list(range(2 * BLOCK_M)) and set(owners.values()) == {4}


# ---------------------------------------------------------------------------------------------- fp8 K and V
@pytest.mark.parametrize("sq,group,paged,causal,splits", [
    (4, 6, False, True, 1), (3, 8, True, True, 3), (8, 4, False, True, 2), (4, 8, True, False, 1),
    (8, 6, False, True, 1), (8, 6, True, True, 4), (8, 8, False, True, 1), (16, 4, True, True, 3)])
def test_fp8_plans_compile_to_hgmma_without_spills(sq, group, paged, causal, splits):
    """Sq x G of 24, 32, 48 and 64, paged and contiguous, split and not: the 16-bit plans' f16 HGMMAs on the
    converted tiles (8 + 4 a key tile, in both loops), no local memory, two CTAs an SM by registers and shared
    memory; each loop converts K's and V's 64 x 128 bytes (4 + 4 segments a thread, 8 cvt each), fenced for the
    async proxy before the two named barriers."""
    plan = gqa_plan(2, sq, 8, group, 4096, 132, paged, 64 if paged else 0, causal, splits, fp8=True)
    assert plan.fp8 and plan.stages == FP8_STAGES and plan.consumers == 1 and plan.splits == splits
    kernels, sass = compiled_without_spills(plan)
    kernel = kernels[0]
    assert kernel.resources.registers * THREADS * CTAS_PER_SM <= 65536
    assert re.search(rf"USETMAXREG\.DEALLOC\.CTAPOOL {PRODUCER_REGS:#x} ;", sass)
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {CONSUMER_REGS:#x} ;", sass)
    assert kernel.dynamic_smem_bytes == plan.smem_bytes
    assert CTAS_PER_SM * (plan.smem_bytes + SMEM_RESERVED) <= SMEM_PER_SM
    ptx = kernel.ptx
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * 2 * 4 * 8
    assert len(re.findall(r"bar\.sync\s+1, 128;", ptx)) == len(re.findall(r"bar\.sync\s+2, 128;", ptx)) == 2
    assert ptx.count("fence.proxy.async.shared::cta;") == 2 * 2 + 1
    assert ptx.count("bar.warp.sync -1;") == 2  # before each loop's release, with V converted
    assert len(kernels) == (2 if splits > 1 else 1)


def test_fp8_plan_with_fp16_queries_compiles():
    import nvfly
    plan = GqaPlan(8, 8, False, 0, True, stages=FP8_STAGES, fp8=True)
    kernel = gqa_api.compile_gqa(plan, dtype=nvfly.f16)[0]
    assert hgmma(kernel.sass(), "64x128x16", r"R\d+, R\d+, gdesc\[") == 2 * 4
    assert not kernel.warnings and kernel.resources.spill_stores == 0


def test_fp8_plans_shared_memory():
    plan = gqa_plan(4, 8, 8, 8, 8192, 132, fp8=True, wide=True)  # 64 rows: one consumer
    assert plan.fp8 and plan.consumers == 1 and plan.stage_bytes == 2 * 64 * D
    assert plan.staging_offset == 64 * D * 2 and plan.ring_offset == plan.staging_offset + 2 * 64 * D * 2
    assert CTAS_PER_SM * (plan.smem_bytes + SMEM_RESERVED) <= SMEM_PER_SM
    wide = gqa_plan(1, 16, 8, 6, 1024, 132, fp8=True, wide=True)
    assert wide.consumers == 2 and wide.stages == FP8_WIDE_STAGES and wide.smem_bytes + SMEM_RESERVED <= SMEM_PER_SM
    assert wide.staging_offset == 2 * 64 * D * 2
    with pytest.raises(ValueError, match="stages"):
        gqa_plan(1, 8, 8, 8, 1024, 132, fp8=True, stages=5)
    assert gqa_plans.gqa_by_default(4, 8) and not gqa_plans.gqa_by_default(4, 8, fp8=True)  # 32 rows
    assert gqa_plans.gqa_by_default(8, 6, fp8=True)


@pytest.mark.parametrize("sq,group,paged,causal,splits", [(16, 8, False, True, 1), (16, 6, True, True, 3),
                                                          (8, 16, False, False, 1)])
def test_fp8_two_consumer_plans_compile_without_spills(sq, group, paged, causal, splits):
    """65-128 rows of fp8 K/V: both consumer warpgroups convert half of each tile (2 + 2 segments a thread) behind
    named barriers over their 256 threads, then each its own 8 + 4 HGMMAs; 232-register consumers, one CTA an SM."""
    plan = gqa_plan(2, sq, 8, group, 4096, 132, paged, 64 if paged else 0, causal, splits, wide=True, fp8=True)
    assert plan.consumers == 2 and plan.threads == 384 and plan.stages == FP8_WIDE_STAGES
    kernels, sass = compiled_without_spills(plan)
    kernel = kernels[0]
    assert kernel.resources.registers * plan.threads <= 65536
    assert re.search(rf"USETMAXREG\.TRY_ALLOC\.CTAPOOL UP\d, {WIDE_CONSUMER_REGS:#x} ;", sass)
    assert kernel.dynamic_smem_bytes == plan.smem_bytes and plan.smem_bytes + SMEM_RESERVED <= SMEM_PER_SM
    ptx = kernel.ptx
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * 2 * 2 * 8
    assert len(re.findall(r"bar\.sync\s+1, 256;", ptx)) == len(re.findall(r"bar\.sync\s+2, 256;", ptx)) == 2
    assert len(kernels) == (2 if splits > 1 else 1)


def test_fp8_conversion_addresses_follow_the_swizzled_layouts():
    """``fp8_tile_addresses``: the warpgroup's 4 x 128 segment indices read every 16-byte segment of the TMA-loaded
    fp8 tile (K-major, 128-byte swizzle, 128 e4m3 a row) once and write its 16 f16 values where the 16-bit kernel's
    K-major tile (two 64-column boxes) holds those columns; each quarter-warp's loads and stores hit 8 distinct
    16-byte bank groups."""
    import nvfly
    from nvfly.arch import sm90
    from nvfly.ops.attention.gqa_kernel import layouts
    from nvfly.ops.attention.wgmma_tiles import fp8_tile_addresses
    k_layout = layouts(nvfly.f16).k_layout
    fp8_layout = sm90.operand_layout(64, D, nvfly.f8e4m3, "K", 128)
    seen = collections.Counter()
    for index in range(64 * 8):
        row, source, low, high = fp8_tile_addresses(index, 64)
        (segment,) = [s for s in range(8) if fp8_layout((row, 16 * s)) == source]
        seen[row, segment] += 1
        assert low == 2 * k_layout((row, 16 * segment)) and high == 2 * k_layout((row, 16 * segment + 8))
    assert len(seen) == 64 * 8 and set(seen.values()) == {1}
    for first in range(0, 64 * 8, 8):
        for part in (1, 2, 3):
            assert len({fp8_tile_addresses(i, 64)[part] // 16 % 8 for i in range(first, first + 8)}) == 8


def fp8_caches(shape, gen):
    k = (torch.randn(shape, generator=gen) * 2).to(torch.float8_e4m3fn)
    v = (torch.randn(shape, generator=gen) * 2).to(torch.float8_e4m3fn)
    return k, v


def test_host_path_takes_fp8_to_the_wgmma_kernel_past_32_rows(cpu_launches):
    """fp8 caches keep the decode kernel by default up to 32 rows (``FP8_DEFAULT_ABOVE_ROWS``) and take the wgmma
    kernel's fp8 plan past them, or when asked (``wgmma=True``), with the (2, Hkv) scales; past 64 rows two
    consumers (by default, or ``wgmma_wide``)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(2, 8, 48, D, dtype=torch.bfloat16)
    k, v = fp8_caches((2, 512, 8, D), gen)
    scales = dict(k_scale=torch.tensor(0.5), v_scale=torch.rand(8))
    attention.decode(torch.zeros(2, 4, 64, D, dtype=torch.bfloat16), k, v, splits=1, **scales)  # 32 rows
    assert [name for name, _, _ in cpu_launches] == ["attention_decode_kernel"]
    cpu_launches.clear()
    attention.decode(q, k, v, splits=1, **scales)  # 48 rows
    assert [name for name, _, _ in cpu_launches] == ["attention_gqa_wgmma_kernel"]
    cpu_launches.clear()
    api._CALLS.clear()
    with api.plan_options(**api.DECODE_VARIANTS["wgmma"]):
        attention.decode(q, k, v, splits=1, **scales)
    assert [(name, grid) for name, grid, _ in cpu_launches] == [("attention_gqa_wgmma_kernel", (1, 8, 2))]
    call = next(call for call in api._CALLS.values() if isinstance(call, gqa_api.GqaCall))
    assert call.plan.fp8 and call.plan.stages == FP8_STAGES and call.boxes[1] == (1, 64, 1, 128)
    packed = b"".join(p for p in cpu_launches[0][2] if isinstance(p, bytes))
    assert all(struct.pack("<Q", t.data_ptr()) in packed for t in (q, k, v))
    cpu_launches.clear()
    api._CALLS.clear()
    with api.plan_options(**api.DECODE_VARIANTS["wgmma_wide"]):  # 96 rows
        attention.decode(torch.zeros(2, 16, 48, D, dtype=torch.bfloat16), k, v, splits=1, **scales)
    assert [name for name, _, _ in cpu_launches] == ["attention_gqa_wgmma_kernel"]
    call = next(call for call in api._CALLS.values() if isinstance(call, gqa_api.GqaCall))
    assert call.plan.fp8 and call.plan.consumers == 2
    cpu_launches.clear()
    api._CALLS.clear()
    attention.decode(torch.zeros(2, 16, 48, D, dtype=torch.bfloat16), k, v, splits=1, **scales)  # the default
    call = next(call for call in api._CALLS.values() if isinstance(call, gqa_api.GqaCall))
    assert [name for name, _, _ in cpu_launches] == ["attention_gqa_wgmma_kernel"] and call.plan.consumers == 2


@pytest.mark.parametrize("sq, group, causal, splits", [(8, 6, True, 1), (4, 16, False, 2), (8, 8, True, 3)])
def test_fp8_kernel_model_matches_the_reference(sq, group, causal, splits):
    """The fp8 plans' scale placement (softmax scale in the f16 query, K's per-head scale in the scores', V's at the
    normalisation) reproduces the reference on the dequantised caches, with NaN past every length (zeroed V rows)
    and lengths 0 and 1."""
    gen = torch.Generator().manual_seed(sq * 10 + group)
    lengths = [0, 1, 63, 65, 200]
    batch, hkv = len(lengths), 2
    q = torch.randn(batch, sq, hkv * group, D, generator=gen).bfloat16()
    k, v = fp8_caches((batch, 230, hkv, D), gen)
    for b, n in enumerate(lengths):
        k[b, n:] = v[b, n:] = float("nan")
    k_scale, v_scale = torch.rand(hkv, generator=gen) + 0.1, torch.rand(hkv, generator=gen) + 0.1
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    got, got_lse = kernel_model(q, k, v, None, seqlens, causal, splits, group, k_scale, v_scale)
    clean_k, clean_v = (torch.nan_to_num(c.float()) for c in (k, v))
    want, want_lse = attention.reference(q, clean_k.to(torch.float8_e4m3fn), clean_v.to(torch.float8_e4m3fn),
                                         cache_seqlens=seqlens, causal=causal, k_scale=k_scale, v_scale=v_scale)
    assert not got.isnan().any()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(got_lse), empty) and empty.any()
    torch.testing.assert_close(got_lse[~empty], want_lse[~empty], atol=2e-3, rtol=1e-3)
